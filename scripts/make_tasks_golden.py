#!/usr/bin/env python3
"""Golden fixtures from EleutherAI lm-evaluation-harness itself for `harpe eval-tasks`.

Run offline with torch + transformers + accelerate + datasets + lm-eval 0.4.13 from PyPI:

    python3 -m venv /work/pyenv && /work/pyenv/bin/pip install torch transformers accelerate "lm-eval==0.4.13" datasets
    /work/pyenv/bin/python scripts/make_tasks_golden.py tests/fixtures/eval_tasks

Writes under <out>:
  model/                 a tiny random transformers Llama (tied embeddings, GQA) with a small Llama-layout
                         tokenizer: the Llama-2 tokenizer.json's normalizer/decoder/post-processor
                         (../shared/fixtures/llama2-tokenizer) with a 640-piece BPE vocabulary trained here
                         on the task texts (byte fallback), and the Llama-2 tokenizer_config.json (BOS/EOS,
                         tokenizer_class LlamaTokenizer: transformers builds its tokenizer the way it does
                         for a real Llama-2 checkpoint). The full 32000-piece vocabulary would make the
                         fixture's embedding table megabytes.
  data/<task>/<split>.jsonl, data/mmlu/<subject>/{dev,test}.jsonl
                         small local copies in the HF datasets' record formats (cais/mmlu, Rowan/hellaswag,
                         allenai/ai2_arc, baber/piqa, mandarjoshi/trivia_qa rc.nocontext): harpe's --data layout
  golden/<task>_<k>shot.json, golden/<task>_<k>shot_len<L>.json (with the harness's max_length=L: truncated inputs)
  golden/text_rules.json  HellaSwag's preprocess, str.capitalize/strip and exact_match on 400 random strings
                         per-sample prompts (context, continuation), log-likelihoods, is-greedy flags,
                         generations and metrics, and the harness's aggregated results (incl. stderr)
The model runs in float32 with the harness's `softmax_dtype=float64` (log-softmax and the continuation sums in
float64 from float32 logits, as harpe scores): with the default float32 sums the harness's own rounding reaches
1e-4 on continuations of a few hundred nats.
The harness reads the same files through task YAMLs that `include` its own YAMLs and set
dataset_path: json, dataset_name: null, dataset_kwargs.data_files (HF_DATASETS_OFFLINE=1).
"""
import glob
import json
import os
import shutil
import sys
import tempfile

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import torch  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

OUT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/eval_tasks")
HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA2 = os.path.join(HERE, "..", "..", "shared", "fixtures", "llama2-tokenizer")
if not os.path.isdir(LLAMA2):
    LLAMA2 = "/work/shared/fixtures/llama2-tokenizer"
HARNESS_TASKS = os.path.join(os.path.dirname(lm_eval.__file__), "tasks")
# zero-shot, a small few-shot, and HARPE Table 3's shots (5-shot MMLU, 10 HellaSwag, 25 ARC-C, 0 PIQA, 5 TriviaQA)
SHOTS = {"mmlu": [0, 3, 5], "hellaswag": [0, 3, 10], "arc_challenge": [0, 3, 25], "piqa": [0, 3], "triviaqa": [0, 3, 5]}
VOCAB = 640

# ---------------------------------------------------------------- data (HF record formats)
MMLU = {
    # subject -> (dev rows, test rows); rows are (question, choices, answer index)
    "anatomy": (
        [("Which bone is the longest in the human body?", ["Femur", "Tibia", "Humerus", "Radius"], 0),
         ("The heart has how many chambers?", ["Two", "Three", "Four", "Five"], 2),
         ("Which organ filters blood to make urine?", ["Liver", "Kidney", "Lung", "Spleen"], 1),
         ("  The cranium protects which organ?  ", ["Heart", "Stomach", "Brain", "Liver"], 2),
         ("Where is the patella found?", ["Knee", "Elbow", "Skull", "Foot"], 0)],
        [("Which muscle is the main muscle of breathing?", ["Biceps", "Diaphragm", "Deltoid", "Soleus"], 1),
         ("The smallest bone of the body is in the:", ["ear", "nose", "hand", "toe"], 0),
         ("Red blood cells are made mainly in the", ["bone marrow", "heart", "skin", "brain"], 0),
         ("Which vessel carries blood away from the heart?", ["Vein", "Artery", "Capillary", "Venule"], 1)],
    ),
    "astronomy": (
        [("Which planet is closest to the Sun?", ["Venus", "Earth", "Mercury", "Mars"], 2),
         ("What is the largest planet?", ["Jupiter", "Saturn", "Neptune", "Earth"], 0),
         ("A light-year measures", ["time", "distance", "speed", "mass"], 1),
         ("The Moon orbits the Earth in about", ["1 day", "7 days", "27 days", "365 days"], 2),
         ("Which star is at the centre of our solar system?", ["Sirius", "Vega", "Polaris", "The Sun"], 3)],
        [("Which planet is known as the Red Planet?", ["Mars", "Venus", "Jupiter", "Uranus"], 0),
         ("What causes the seasons on Earth?", ["Distance to the Sun", "Axial tilt", "The Moon", "Comets"], 1),
         ("Saturn is best known for its", ["rings", "moons", "storms", "colour"], 0)],
    ),
    "high_school_us_history": (
        [("Who was the first President of the United States?", ["Adams", "Jefferson", "Washington", "Lincoln"], 2),
         ("The Declaration of Independence was signed in", ["1776", "1789", "1812", "1865"], 0),
         ("Which war ended in 1865?", ["The Civil War", "World War I", "The War of 1812", "The Korean War"], 0),
         ("The Louisiana Purchase was made from", ["Spain", "France", "Britain", "Mexico"], 1),
         ("The New Deal is associated with", ["Hoover", "Roosevelt", "Truman", "Wilson"], 1)],
        [("The Emancipation Proclamation was issued by", ["Lincoln", "Grant", "Lee", "Johnson"], 0),
         ("Which amendment gave women the right to vote?", ["13th", "15th", "19th", "21st"], 2),
         ("The Boston Tea Party protested a tax on", ["sugar", "tea", "stamps", "glass"], 1)],
    ),
}

HELLASWAG_CTX = [
    ("Removing ice from car", "Then, the man writes over the snow covering the window of a car, and a woman wearing winter clothes smiles.", "then",
     [", the man adds wax to the windshield and cuts it.", ", a person board a ski lift, while two men supporting the head of the person wearing winter clothes snow as the we girls sled.",
      ", the man puts on a christmas coat, knitted with netting.", ", the man continues removing the snow on his car."], "3"),
    ("Baking cookies", "A female chef in white uniform shows a stack of baking pans in a large kitchen presenting them.", "the pans",
     ["contain egg yolks and baking soda.", "are then sprinkled with brown sugar.", "are placed in a strainer on the counter.", "are filled with pastries and loaded into the oven."], "3"),
    ("Personal Care and Style", "[header] How to dye your hair [title] Choose a color. [step] Pick a shade close to your natural one.", "",
     ["[substeps] A lighter shade is easier to cover later.", "You can then dye the pets in the house.", "[title] Buy a kit. [step] Kits are sold in stores.", "Rinse the car with water."], "0"),
    ("Playing guitar", "A man is sitting on a chair holding a guitar.", "he",
     ["starts to play the guitar while singing.", "throws the guitar into a lake.", "eats the strings of the guitar.", "paints the chair red."], "0"),
    ("Home and Garden", "[header] How to plant tulips [title] Pick a sunny spot. [step] Tulips need six hours of sun.", "you",
     ["should dig holes eight inches deep.", "[title] Fly a kite. [step] Wind helps.", "can swim in the garden pond.", "must paint the bulbs blue."], "0"),
    ("Running a marathon", "Runners line up at the start of a race in a city.", "the gun",
     ["fires and the runners start running.", "melts into the road.", "sings a song to the crowd.", "turns into a bird and flies."], "0"),
    ("Washing dishes", "A woman stands at a sink full of dirty plates.", "she",
     ["scrubs the plates with a sponge and soap.", "reads the plates a bedtime story.", "plants the plates in the yard.", "drives the plates to work."], "0"),
    ("Skateboarding", "A boy rides a skateboard down a ramp at the park.", "he",
     ["jumps over a small box and lands.", "bakes a cake on the board.", "falls asleep in mid air.", "mails the ramp to a friend."], "0"),
    ("Food and Entertaining", "[header] How to make lemonade [title] Squeeze the lemons. [step] Use about six lemons.", "",
     ["[title] Add sugar and water. [step] Stir until the sugar dissolves.", "Throw the lemons at the wall.", "[title] Wash the dog.", "Put the lemons in the freezer for a year."], "0"),
    ("Walking the dog", "A man clips a leash to a small dog by the door.", "they",
     ["walk out the door and down the street.", "fly to the moon together.", "argue about the weather forecast.", "swim across the carpet."], "0"),
    ("Painting a fence", "A teenager holds a brush next to a white fence.", "the teenager",
     ["dips the brush in paint and starts on the fence.", "eats the paint with a spoon.", "hides the fence under the bed.", "sells the fence to a bird."], "0"),
    ("Cleaning windows", "A worker sprays liquid onto a tall window.", "the worker",
     ["wipes the window with a squeegee.", "drinks the liquid from the bottle.", "climbs into the window.", "shouts at the clouds."], "0"),
    ("Making tea", "A woman pours hot water into a cup with a tea bag.", "she",
     ["waits a few minutes and removes the bag.", "pours the cup onto the floor.", "puts the kettle in the fridge.", "reads the tea bag aloud."], "0"),
    ("Sports and Fitness", "[header] How to do a push up [title] Get into position. [step] Put your hands under your shoulders.", "",
     ["[title] Lower your body. [step] Keep your back straight.", "[title] Eat a sandwich.", "Sing loudly while lying down.", "Call a plumber."], "0"),
    ("Tying shoes", "A child sits on the stairs and holds two shoe laces.", "the child",
     ["crosses the laces and pulls them into a bow.", "throws the shoes out the window.", "eats the shoe laces.", "paints the stairs green."], "0"),
    ("Fixing a bike", "A man flips a bicycle upside down on the grass.", "he",
     ["removes the wheel and checks the tube.", "rides the bicycle upside down.", "plants seeds in the tyre.", "names the bicycle Steve."], "0"),
    ("Swimming", "A girl stands at the edge of a pool in goggles.", "she",
     ["dives into the water and swims a lap.", "drinks the whole pool.", "builds a sand castle on the diving board.", "paints the water."], "0"),
]
# labels are rotated so the gold is not always 0
HELLASWAG = []
for i, (act, ca, cb, ends, lab) in enumerate(HELLASWAG_CTX):
    lab = int(lab)
    r = i % 4
    ends = ends[-r:] + ends[:-r] if r else ends
    lab = (lab + r) % 4
    HELLASWAG.append({"ind": i, "activity_label": act, "ctx_a": ca, "ctx_b": cb, "ctx": (ca + " " + cb).strip(),
                      "endings": ends, "source_id": f"src~{i}", "split": "x", "split_type": "indomain",
                      "label": str(lab)})

ARC_QS = [
    ("Which gas do plants absorb from the air?", ["Oxygen", "Carbon dioxide", "Nitrogen", "Helium"], "B"),
    ("What is the boiling point of water at sea level?", ["50 °C", "100 °C", "150 °C", "200 °C"], "B"),
    ("Which of these is a mammal?", ["Shark", "Frog", "Whale", "Lizard"], "C"),
    ("Which force pulls objects toward Earth?", ["Friction", "Gravity", "Magnetism"], "B"),
    ("What part of the plant makes food?", ["Root", "Stem", "Leaf", "Flower"], "C"),
    ("Which is a renewable energy source?", ["Coal", "Oil", "Wind", "Natural gas"], "C"),
    ("What do we call frozen water?", ["Steam", "Ice", "Fog", "Dew"], "B"),
    ("Which organ pumps blood?", ["Lung", "Heart", "Brain", "Stomach", "Skin"], "B"),
    ("A student mixes salt into water. The salt", ["dissolves", "melts", "burns", "freezes"], "A"),
    ("Which tool measures temperature?", ["Ruler", "Thermometer", "Scale", "Clock"], "B"),
    ("What is the main source of light for Earth?", ["The Moon", "The Sun", "Stars", "Lamps"], "B"),
    ("Which animal lays eggs?", ["Dog", "Cat", "Chicken", "Horse"], "C"),
    ("Which state of matter has a fixed shape?", ["Solid", "Liquid", "Gas", "Plasma"], "A"),
    ("Sound travels fastest through", ["air", "water", "steel", "vacuum"], "C"),
    ("Which planet has the most moons known today?", ["Earth", "Mars", "Saturn", "Mercury"], "C"),
    ("What happens to metal when heated?", ["It contracts", "It expands", "It vanishes", "It freezes"], "B"),
    ("Which is an example of a chemical change?", ["Melting ice", "Burning wood", "Cutting paper", "Boiling water"], "B"),
    ("Where do fish get oxygen?", ["From the water", "From the sand", "From the sun", "From rocks"], "A"),
    ("Which layer of Earth do we live on?", ["Core", "Mantle", "Crust", "Outer core"], "C"),
    ("What do bees collect from flowers?", ["Nectar", "Bark", "Soil", "Stones"], "A"),
    ("Which simple machine is a ramp?", ["Lever", "Pulley", "Inclined plane", "Wheel"], "C"),
    ("The Moon shines because it", ["makes light", "reflects sunlight", "is on fire", "is hot"], "B"),
    ("Which unit measures force?", ["Newton", "Meter", "Liter", "Kelvin"], "A"),
    ("What is H2O?", ["Salt", "Water", "Sugar", "Air"], "B"),
    ("Which habitat is driest?", ["Desert", "Rainforest", "Swamp", "Ocean"], "A"),
    ("Which of these conducts electricity best?", ["Wood", "Plastic", "Copper", "Glass"], "C"),
    ("What do caterpillars become?", ["Beetles", "Butterflies", "Spiders", "Ants"], "B"),
    ("Which season is usually coldest in the north?", ["Summer", "Spring", "Winter", "Autumn"], "C"),
    ("Rocks broken into small pieces by wind is called", ["erosion", "weathering", "melting", "growth"], "B"),
    ("Which gas do humans exhale most?", ["Nitrogen", "Oxygen", "Carbon dioxide", "Argon"], "A"),
    ("Which is the closest star to Earth?", ["Sirius", "The Sun", "Vega", "Betelgeuse"], "B"),
    ("What is the hardest natural material?", ["Gold", "Iron", "Diamond", "Quartz"], "C"),
    ("Which organ helps us breathe?", ["Lungs", "Kidneys", "Liver", "Heart"], "A"),
    ("Which of these is not a planet?", ["Mars", "Venus", "Pluto", "Earth"], "C"),
]


def arc_rec(i, q, choices, key, numeric=False):
    labels = [str(j + 1) for j in range(len(choices))] if numeric else [chr(65 + j) for j in range(len(choices))]
    if numeric:
        key = str(ord(key) - 64)
    return {"id": f"Mercury_{7000 + i}", "question": q, "choices": {"text": choices, "label": labels}, "answerKey": key}


ARC = [arc_rec(i, *x, numeric=(i % 7 == 3)) for i, x in enumerate(ARC_QS)]

PIQA = [
    ("How do I ready a guinea pig cage for it's new occupants?", "Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips, you will also need to supply it with a water bottle and a food dish.", "Provide the guinea pig with a cage full of a few inches of bedding made of ripped jeans material, you will also need to supply it with a water bottle and a food dish.", 0),
    ("To make a hard boiled egg", "put the egg in boiling water for ten minutes.", "put the egg in cold water for ten seconds.", 0),
    ("How can I keep bread fresh longer?", "Leave it open on the counter in the sun.", "Store it in a sealed bag in a cool place.", 1),
    ("To remove a splinter from your finger", "use clean tweezers to pull it out.", "hit the finger with a hammer.", 0),
    ("How do you sharpen a pencil?", "Put it in a sharpener and turn it.", "Put it in water and wait.", 0),
    ("To cool down soup quickly", "stir it in a bowl set in ice water.", "cover it with a thick blanket.", 0),
    ("How to stop a door from squeaking?", "Put a little oil on the hinges.", "Paint the door handle.", 0),
    ("To clean a dirty window", "spray it with glass cleaner and wipe with newspaper.", "rub it with butter.", 0),
    ("How do I find north without a compass?", "Look at where the sun rises in the morning, that is east, so north is to the left.", "Spin around until you feel dizzy.", 0),
    ("To keep ice cream from melting on a picnic", "pack it in a cooler with dry ice.", "leave it in the car on the dashboard.", 0),
    ("How can you tell if an egg is fresh?", "Place it in water; fresh eggs sink.", "Shake it next to your ear for an hour.", 0),
]
PIQA = [{"goal": g, "sol1": a, "sol2": b, "label": (lab if i % 2 == 0 else 1 - lab)} if i % 2 == 0 else
        {"goal": g, "sol1": b, "sol2": a, "label": 1 - lab} for i, (g, a, b, lab) in enumerate(PIQA)]

TRIVIA = [
    ("Which Lloyd Webber musical premiered in the US on 10th December 1993", ["Sunset Boulevard", "Sunset Blvd"]),
    ("Who was the man behind The Chipmunks", ["David Seville", "Ross Bagdasarian"]),
    ("What star sign is Jamie Lee Curtis", ["Scorpio", "Scorpio (astrology)"]),
    ("Which country is Europe's largest silk producer", ["Italy", "Italia"]),
    ("In which city is the Eiffel Tower", ["Paris", "Paris, France"]),
    ("What is the chemical symbol for gold", ["Au", "AU"]),
    ("Who wrote the play Hamlet", ["William Shakespeare", "Shakespeare"]),
    ("What is the capital of Japan", ["Tokyo", "Tōkyō"]),
    ("How many legs does a spider have", ["8", "Eight"]),
    ("Which ocean is the largest", ["Pacific Ocean", "Pacific"]),
]


def trivia_rec(i, q, aliases):
    return {"question": q, "question_id": f"tc_{i}", "question_source": "http://www.triviacountry.com/",
            "entity_pages": {"doc_source": [], "filename": [], "title": [], "wiki_context": []},
            "search_results": {"description": [], "filename": [], "rank": [], "title": [], "url": [], "search_context": []},
            "answer": {"aliases": aliases, "normalized_aliases": [a.lower() for a in aliases],
                       "matched_wiki_entity_name": "", "normalized_matched_wiki_entity_name": "",
                       "normalized_value": aliases[0].lower(), "type": "WikipediaEntity", "value": aliases[0]}}


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_data(data, trivia_val):
    for subj, (dev, test) in MMLU.items():
        for split, rows in (("dev", dev), ("test", test)):
            write_jsonl(f"{data}/mmlu/{subj}/{split}.jsonl",
                        [{"question": q, "subject": subj, "choices": c, "answer": a} for q, c, a in rows])
    write_jsonl(f"{data}/hellaswag/train.jsonl", HELLASWAG[:12])
    write_jsonl(f"{data}/hellaswag/validation.jsonl", HELLASWAG[12:])
    write_jsonl(f"{data}/arc_challenge/train.jsonl", ARC[:26])
    write_jsonl(f"{data}/arc_challenge/validation.jsonl", ARC[26:28])
    write_jsonl(f"{data}/arc_challenge/test.jsonl", ARC[28:])
    write_jsonl(f"{data}/piqa/train.jsonl", PIQA[:6])
    write_jsonl(f"{data}/piqa/validation.jsonl", PIQA[6:])
    write_jsonl(f"{data}/triviaqa/train.jsonl", [trivia_rec(i, q, a) for i, (q, a) in enumerate(TRIVIA[:6])])
    write_jsonl(f"{data}/triviaqa/validation.jsonl", trivia_val)


# ---------------------------------------------------------------- tokenizer and model
def corpus():
    out = []
    for dev, test in MMLU.values():
        for q, c, _ in dev + test:
            out += [q] + c
    for r in HELLASWAG:
        out += [r["activity_label"], r["ctx_a"], r["ctx_b"]] + r["endings"]
    for q, c, _ in ARC_QS:
        out += [q] + c
    for r in PIQA:
        out += [r["goal"], r["sol1"], r["sol2"]]
    for q, a in TRIVIA:
        out += [q] + a
    out += ["Question: Answer: The following are multiple choice questions (with answers) about"] * 20
    return out


def make_tokenizer(mdir):
    """Llama-2's tokenizer.json layout with a small trained BPE vocabulary (specials, 256 bytes, pieces)."""
    base = json.load(open(os.path.join(LLAMA2, "tokenizer.json")))
    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    # pieces never cross a word boundary (sentencepiece's split_by_whitespace, as in Llama-2's vocabulary)
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 259 + 100, special_tokens=[], show_progress=False)
    bpe.train_from_iterator(corpus(), trainer)
    trained = json.loads(bpe.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = 3 + b
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in vocab and len(vocab) < VOCAB:
            vocab[piece] = len(vocab)
    merges = []
    for m in trained["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ")
        if a in vocab and b in vocab and a + b in vocab:
            merges.append([a, b])
    base["model"]["vocab"] = vocab
    base["model"]["merges"] = merges
    os.makedirs(mdir, exist_ok=True)
    json.dump(base, open(os.path.join(mdir, "tokenizer.json"), "w"), ensure_ascii=False)
    shutil.copy(os.path.join(LLAMA2, "tokenizer_config.json"), os.path.join(mdir, "tokenizer_config.json"))
    return len(vocab)


def make_model(mdir, vocab):
    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, initializer_range=0.25)
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(mdir, safe_serialization=True)
    c = json.load(open(os.path.join(mdir, "config.json")))
    c["torch_dtype"] = "float32"
    json.dump(c, open(os.path.join(mdir, "config.json"), "w"), indent=2)


# ---------------------------------------------------------------- harness task YAMLs over the local files
def yaml_files(tdir, data):
    def w(name, text):
        open(os.path.join(tdir, name + ".yaml"), "w").write(text)

    def files(task, splits):
        return "dataset_kwargs:\n  data_files:\n" + "".join(f"    {s}: {data}/{task}/{s}.jsonl\n" for s in splits)

    common = "dataset_path: json\ndataset_name: null\n"
    w("harpe_hellaswag", f"include: {HARNESS_TASKS}/hellaswag/hellaswag.yaml\ntask: harpe_hellaswag\ntag: []\n"
      + common + files("hellaswag", ["train", "validation"]))
    w("harpe_arc_challenge", f"include: {HARNESS_TASKS}/arc/arc_challenge.yaml\ntask: harpe_arc_challenge\ntag: []\n"
      + common + files("arc_challenge", ["train", "validation", "test"]))
    w("harpe_piqa", f"include: {HARNESS_TASKS}/piqa/piqa.yaml\ntask: harpe_piqa\ntag: []\n"
      + common + files("piqa", ["train", "validation"]))
    w("harpe_triviaqa", f"include: {HARNESS_TASKS}/triviaqa/default.yaml\ntask: harpe_triviaqa\n"
      + common + files("triviaqa", ["train", "validation"]))
    cats = {"stem": ["anatomy", "astronomy"], "humanities": ["high_school_us_history"]}
    for cat, subjects in cats.items():
        for s in subjects:
            src = open(f"{HARNESS_TASKS}/mmlu/default/mmlu_{s}.yaml").read()
            desc = [ln for ln in src.splitlines(True) if not ln.startswith(('"include"', '"task"', '"tag"', '"dataset_name"', '"task_alias"'))]
            w(f"harpe_mmlu_{s}", "".join(desc) + f"include: {HARNESS_TASKS}/mmlu/default/_default_template_yaml\n"
              + f"task: harpe_mmlu_{s}\ntask_alias: {s}\n" + common + files(f"mmlu/{s}", ["dev", "test"]))
        w(f"harpe_mmlu_{cat}", f"group: harpe_mmlu_{cat}\ngroup_alias: {cat}\ntask:\n"
          + "".join(f"  - harpe_mmlu_{s}\n" for s in subjects)
          + "aggregate_metric_list:\n  - metric: acc\n    weight_by_size: True\nmetadata:\n  version: 2\n")
    w("harpe_mmlu", "group: harpe_mmlu\ntask:\n" + "".join(f"  - harpe_mmlu_{c}\n" for c in cats)
      + "aggregate_metric_list:\n  - metric: acc\n    weight_by_size: True\nmetadata:\n  version: 2\n")


TASKS = {"mmlu": "harpe_mmlu", "hellaswag": "harpe_hellaswag", "arc_challenge": "harpe_arc_challenge",
         "piqa": "harpe_piqa", "triviaqa": "harpe_triviaqa"}


def rename(name):
    return name.replace("harpe_", "", 1) if name.startswith("harpe_") else name


def args_of(a):
    """The request arguments of one logged sample as lists: [context, continuation] or [context, gen_kwargs]."""
    if isinstance(a, dict):
        a = list(a.values())
    return [list(x.values()) if isinstance(x, dict) else list(x) for x in a]


def run_harness(mdir, tdir, task, shots, max_length=None):
    tm = TaskManager(include_path=tdir)
    margs = f"pretrained={mdir},dtype=float32,softmax_dtype=float64" + (f",max_length={max_length}" if max_length else "")
    res = lm_eval.simple_evaluate(model="hf", model_args=margs, tasks=[TASKS[task]],
                                  num_fewshot=shots, batch_size=1, device="cpu", log_samples=True, task_manager=tm,
                                  random_seed=0, numpy_random_seed=1234, torch_random_seed=1234,
                                  fewshot_random_seed=1234, bootstrap_iters=100000)
    out = {"results": {rename(k): {m: v for m, v in r.items()} for k, r in res["results"].items()},
           "n-shot": {rename(k): v for k, v in res.get("n-shot", {}).items()},
           "lm_eval_version": lm_eval.__version__ if hasattr(lm_eval, "__version__") else "0.4.13",
           "samples": {}}
    for k, rs in res["samples"].items():
        rows = []
        for s in rs:
            row = {"doc_id": s["doc_id"], "arguments": args_of(s["arguments"])}
            row["resps"] = s["resps"]
            row["filtered_resps"] = s["filtered_resps"]
            for m in ("acc", "acc_norm", "exact_match"):
                if m in s:
                    row[m] = s[m]
            rows.append(row)
        out["samples"][rename(k)] = rows
    return out


# (task, shots, max_length): the harness's left truncation of (context + continuation)[-(max_length + 1):]
TRUNCATED = [("arc_challenge", 3, 48), ("hellaswag", 3, 64)]


def truncated_cases():
    """Only the truncation goldens, over the committed model and data (`... make_tasks_golden.py OUT truncated`)."""
    data, mdir, gdir = f"{OUT}/data", f"{OUT}/model", f"{OUT}/golden"
    tdir = tempfile.mkdtemp(prefix="harpe_tasks_")
    yaml_files(tdir, data)
    for task, k, n in TRUNCATED:
        g = run_harness(mdir, tdir, task, k, max_length=n)
        json.dump(g, open(f"{gdir}/{task}_{k}shot_len{n}.json", "w"), indent=1, ensure_ascii=False)
        print(task, k, n, {t: {m: v for m, v in r.items() if "," in m} for t, r in g["results"].items()})
    shutil.rmtree(tdir)


def text_rules():
    """The harness's string rules on random strings: HellaSwag's preprocess, str.capitalize/strip, and
    exact_match(ignore_case, ignore_punctuation), for `tests/eval_tasks.rs`."""
    import random

    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.tasks.hellaswag import utils as hs

    rnd = random.Random(0)
    pieces = ["[", "]", " [title]", "[step]", "\n", " ", "  ", ".", ",", "a", "The", "eiffel", "İ", "Σ", "ß", "ǆ",
              "é", "😀", "\x1f", "\u00a0", "\t", "!", "'", "\u2028", "x y", "ΌΣΟΣ", "\x00"]
    cases = []
    for _ in range(400):
        t = "".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 12)))
        u = "".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 6)))
        g = rnd.choice([t, t.upper(), t.lower() + "!", u, t.replace(" ", "")])
        em = exact_match_hf_evaluate(predictions=[t], references=[g], ignore_case=True, ignore_punctuation=True)
        cases.append({"s": t, "preprocess": hs.preprocess(t), "capitalize": t.capitalize(), "strip": t.strip(),
                      "gold": g, "exact_match": float(em["exact_match"])})
    json.dump(cases, open(f"{OUT}/golden/text_rules.json", "w"), ensure_ascii=False)


def llama2_tokenization_check():
    """With the real Llama-2 vocabulary, transformers' LlamaTokenizer (which rebuilds its pipeline from
    tokenizer_config.json) and tokenizer.json as harpe reads it agree on every golden request string."""
    from transformers import AutoTokenizer

    tdir = tempfile.mkdtemp(prefix="harpe_llama2_")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(LLAMA2, f), tdir)
    hf, raw = AutoTokenizer.from_pretrained(tdir), Tokenizer.from_file(os.path.join(tdir, "tokenizer.json"))
    strs = []
    for f in glob.glob(f"{OUT}/golden/*shot*.json"):
        for rows in json.load(open(f))["samples"].values():
            for r in rows:
                for a in r["arguments"]:
                    strs += [a[0]] + ([a[0] + a[1]] if isinstance(a[1], str) else [])
    strs = list(dict.fromkeys(strs))
    bad = [x for x in strs if hf.encode(x) != raw.encode(x).ids]
    print(f"Llama-2 vocabulary: {len(bad)} of {len(strs)} request strings tokenize differently in transformers and tokenizer.json")
    shutil.rmtree(tdir)


def main():
    if sys.argv[2:] == ["llama2"]:
        llama2_tokenization_check()
        return
    if sys.argv[2:] == ["truncated"]:
        truncated_cases()
        return
    if sys.argv[2:] == ["text"]:
        text_rules()
        return
    os.makedirs(OUT, exist_ok=True)
    data, mdir, gdir = f"{OUT}/data", f"{OUT}/model", f"{OUT}/golden"
    for d in (data, mdir, gdir):
        shutil.rmtree(d, ignore_errors=True)
    trivia_val = [trivia_rec(100 + i, q, a) for i, (q, a) in enumerate(TRIVIA[6:])]
    write_data(data, trivia_val)
    vocab = make_tokenizer(mdir)
    make_model(mdir, vocab)
    tdir = tempfile.mkdtemp(prefix="harpe_tasks_")
    yaml_files(tdir, data)
    # first pass on TriviaQA: make two validation answers the model's own (normalized differently), so
    # exact_match is exercised at 1 as well as 0
    first = run_harness(mdir, tdir, "triviaqa", 0)["samples"]["triviaqa"]
    preds = {r["doc_id"]: r["filtered_resps"][0] for r in first}
    for i in (0, 2):
        p = preds.get(i, "")
        if p.strip():
            trivia_val[i]["answer"]["aliases"].append(p.upper() + "!")
    write_data(data, trivia_val)
    os.makedirs(gdir, exist_ok=True)
    for task in TASKS:
        for k in SHOTS[task]:
            g = run_harness(mdir, tdir, task, k)
            json.dump(g, open(f"{gdir}/{task}_{k}shot.json", "w"), indent=1, ensure_ascii=False)
            print(task, k, {t: {m: v for m, v in r.items() if "," in m} for t, r in g["results"].items()})
    shutil.rmtree(tdir)
    truncated_cases()
    text_rules()
    llama2_tokenization_check()
    total = sum(os.path.getsize(f) for f in glob.glob(f"{OUT}/**", recursive=True) if os.path.isfile(f))
    print(f"wrote {OUT} ({total} bytes)")


if __name__ == "__main__":
    main()
