# Golden samples for tests/stage_eval/niah_generators.rs: a line-by-line re-run of RULER's niah.py
# generate_input_output (NVIDIA/RULER at commit dd4c2ad) for the noise and needle haystacks, with CPython's
# `random` and the wonderwords 2.2.0 lists in src/eval/words/. Run from the repository root:
#   python3 tests/data/niah_golden.py > tests/data/niah_golden.json
import random, uuid, json, sys
adj=[l.rstrip() for l in open('src/eval/words/adjectivelist.txt')]
nou=[l.rstrip() for l in open('src/eval/words/nounlist.txt')]
WORDS=sorted(set(f"{a}-{n}" for a in adj for n in nou))
NOISE="The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
needle="One of the special magic {type_needle_v} for {key} is: {value}."
template="Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?"+" The special magic {type_needle_v} for {query} mentioned in the provided text are"
def gen(t):
    if t=='numbers': return str(random.randint(10**6,10**7-1))
    if t=='words': return random.choice(WORDS)
    return str(uuid.UUID(int=random.getrandbits(128), version=4))
def gio(num_haystack, hay, tk, tv, K, V, Q, seed=42):
    K=max(K,Q)
    keys,values,needles=[],[],[]
    for _ in range(K):
        keys.append(gen(tk)); value=[]
        for _ in range(V):
            value.append(gen(tv)); needles.append(needle.format(type_needle_v=tv,key=keys[-1],value=value[-1]))
        values.append(value)
    random.Random(seed).shuffle(needles)
    if hay=='noise': sentences=[NOISE]*num_haystack
    else: sentences=[needle.format(type_needle_v=tv,key=gen(tk),value=gen(tv)) for _ in range(num_haystack)]
    indexes=sorted(random.sample(range(num_haystack),len(needles)),reverse=True)
    for i,e in zip(indexes,needles): sentences.insert(i,e)
    context="\n".join(sentences)
    indices=random.sample(range(K),Q)
    queries=[keys[i] for i in indices]
    answers=[a for i in indices for a in values[i]]
    query=', '.join(queries[:-1])+', and '+queries[-1] if len(queries)>1 else queries[0]
    t=template; tvv=tv
    if Q*V==1:
        t=t.replace('Some','A').replace('are all','is').replace('are','is').replace('answers','answer'); tvv=tv[:-1]
    return t.format(type_needle_v=tvv,context=context,query=query), answers
cases={'s1':('noise','words','numbers',1,1,1),'mk2':('needle','words','numbers',1,1,1),'mk3':('needle','uuids','uuids',1,1,1),
       'mq_noise':('noise','words','numbers',4,1,4),'mv_noise':('noise','words','numbers',1,4,1)}
out={'words': {'len': len(WORDS), 'first': WORDS[0], 'last': WORDS[-1], 'at_1234567': WORDS[1234567],
      'at_3000000': WORDS[3000000]}}
random.seed(42); out['spec_mk2_3']=gio(3,*cases['mk2'])
for name,c in cases.items():
    random.seed(42)
    out[name]=[gio(5,*c), gio(9,*c)]
print(json.dumps(out,indent=1))
