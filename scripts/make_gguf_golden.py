#!/usr/bin/env python3
"""Golden values of a real pretrained model, SmolLM2-135M-Instruct (Q4_1 GGUF), from transformers' own GGUF
loader, for tests/real_model (harpe convert, eval-ppl, eval-niah's passkey and its BOS rule).

Needs torch, transformers 5.25.0, gguf and numpy (a CPU torch venv: scripts/install-torchrun.sh, then
`pip install transformers==5.25.0 gguf numpy accelerate`), the GGUF (scripts/fetch-smollm2.sh) and the
passkey prompts harpe writes for it:

    GGUF=$(scripts/fetch-smollm2.sh target/smollm2)
    HF=$(scripts/fetch-smollm2.sh target/smollm2 --convert target/release/harpe)
    target/release/harpe eval-niah --prepare-only --tokenizer $HF/tokenizer.json --tasks passkey \\
        --lengths 1024,2048,4096 --samples 2 --passkey-depths 2 --out /tmp/pk
    target/torch-venv/bin/python scripts/make_gguf_golden.py --gguf $GGUF --passkey-data /tmp/pk \\
        --out tests/golden/smollm2

With `--tiny DIR` instead, it makes a tiny Llama GGUF itself (a SentencePiece "llama" vocabulary with scores and
no merges, so transformers rebuilds the merges; 2 layers with GQA, weights in F32, F16, Q8_0 and Q4_1, Q and K
permuted as llama.cpp's converter does) and writes DIR/tiny-llama.gguf and DIR/golden.json (config, tensor
digests, ids) for tests/tools/convert_gguf.rs:

    target/torch-venv/bin/python scripts/make_gguf_golden.py --tiny tests/golden/gguf_tiny

Writes into --out (small JSON files; the model itself is never committed):
  config.json     transformers' config of the file (the keys harpe's config.json has)
  tensors.json    per HF tensor: shape, sha256 of its float32 little-endian bytes, sum, sum of |x|, 16 values
  tokenize.json   ids of short strings with and without the tokenizer's special tokens
  ppl.json        sliding-window NLL of tests/data/smollm2/text.txt under harpe's window rule (windows 256/128
                  and 1024/1024), the text encoded as eval-ppl does (the tokenizer's own special tokens)
  passkey.json    per passkey prompt: sha256 of the prompt and of its ids under RULER's rule (the tokenizer's
                  own encoding) and under a prepended BOS, and transformers' greedy answer (10 new tokens,
                  stop at EOS) under each
"""
import argparse
import hashlib
import json
import os

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

TRANSFORMERS_VERSION = "5.25.0"
TOKENIZE = [
    "Hello world",
    " leading space and  two spaces",
    "The pass key is 12345. Remember it. 12345 is the pass key.",
    "line one\nline two\n\n\ttab",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>after the separator",
    "café naïve jalapeño — “quotes” 東京 🙂",
    "x = [1, 22, 333]; y = {'a': 4444}",
]


def sha256_ids(ids):
    return hashlib.sha256(np.asarray(ids, dtype="<u4").tobytes()).hexdigest()


def tensor_digest(t):
    a = t.detach().to(torch.float32).contiguous().numpy()
    flat = a.reshape(-1)
    idx = sorted({int(i) for i in np.linspace(0, flat.size - 1, 16)})
    return {
        "shape": list(a.shape),
        "sha256": hashlib.sha256(flat.astype("<f4").tobytes()).hexdigest(),
        "sum": float(flat.astype(np.float64).sum()),
        "sum_abs": float(np.abs(flat.astype(np.float64)).sum()),
        "samples": [[i, float(flat[i])] for i in idx],
    }


def windows(n, window, stride):
    """harpe eval-ppl's windows (src/eval/ppl.rs `windows`): (begin, end, first scored position)."""
    if n < 2:
        return []
    if n <= window:
        return [(0, n, 1)]
    out, prev_end, k = [], 0, 0
    while True:
        begin = k * stride
        end = min(begin + window, n)
        lo = max(prev_end, begin + 1)
        if lo < end:
            out.append((begin, end, lo))
        prev_end = end
        if end == n:
            return out
        k += 1


@torch.no_grad()
def window_nll(model, ids, window, stride):
    total, scored = 0.0, 0
    for begin, end, lo in windows(len(ids), window, stride):
        x = torch.tensor([ids[begin:end]])
        logp = torch.log_softmax(model(x).logits[0].to(torch.float64), dim=-1)
        for t in range(lo, end):
            total -= float(logp[t - 1 - begin, ids[t]])
            scored += 1
    return {"window": window, "stride": stride, "nll_sum": total, "scored": scored, "nll": total / scored}


@torch.no_grad()
def greedy(model, ids, eos, max_new=10):
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos)
    new = out[0, len(ids):].tolist()
    if new and new[-1] == eos:
        new = new[:-1]
    return new


def make_tiny(out):
    """A tiny Llama GGUF written as llama.cpp's converter writes one, and transformers' reading of it."""
    import gguf
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(0)
    # a SentencePiece-style BPE vocabulary: <unk> <s> </s>, 256 byte pieces, then learned pieces by rank
    text = open("tests/data/smollm2/text.txt", encoding="utf-8").read()
    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=[], show_progress=False, limit_alphabet=60)
    bpe.train_from_iterator([text], trainer)
    learned = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
    learned = [t for t, _ in learned if t not in ("<unk>", "<s>", "</s>")]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + learned
    types = [2, 3, 3] + [6] * 256 + [1] * len(learned)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(learned))]
    V, C, I, L, H, HKV, D = len(tokens), 64, 128, 2, 4, 2, 16

    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(os.path.join(out, "tiny-llama.gguf"), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(512)
    w.add_embedding_length(C)
    w.add_feed_forward_length(I)
    w.add_block_count(L)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    rnd = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)
    quant = lambda x, q: {"tensor": gguf.quants.quantize(x, q), "raw_dtype": q}
    w.add_tensor("token_embd.weight", **quant(rnd(V, C), gguf.GGMLQuantizationType.Q8_0))
    for l in range(L):
        p = f"blk.{l}."
        w.add_tensor(p + "attn_q.weight", **quant(permute(rnd(H * D, C), H), gguf.GGMLQuantizationType.Q8_0))
        w.add_tensor(p + "attn_k.weight", **quant(permute(rnd(HKV * D, C), HKV), gguf.GGMLQuantizationType.Q4_1))
        w.add_tensor(p + "attn_v.weight", rnd(HKV * D, C).astype(np.float16))
        w.add_tensor(p + "attn_output.weight", rnd(C, H * D))
        w.add_tensor(p + "ffn_gate.weight", **quant(rnd(I, C), gguf.GGMLQuantizationType.Q4_0))
        w.add_tensor(p + "ffn_up.weight", **quant(rnd(I, C), gguf.GGMLQuantizationType.Q5_0))
        w.add_tensor(p + "ffn_down.weight", **quant(rnd(C, I), gguf.GGMLQuantizationType.Q8_0))
        w.add_tensor(p + "attn_norm.weight", 1 + rnd(C))
        w.add_tensor(p + "ffn_norm.weight", 1 + rnd(C))
    w.add_tensor("output_norm.weight", 1 + rnd(C))
    w.add_tensor("output.weight", rnd(V, C).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    tok = AutoTokenizer.from_pretrained(out, gguf_file="tiny-llama.gguf")
    model = AutoModelForCausalLM.from_pretrained(out, gguf_file="tiny-llama.gguf", dtype=torch.float32)
    c = model.config
    sd = model.state_dict()
    strings = TOKENIZE + ["  the keeper  ", "lighthouse\nlog", "<s> inside </s> text", "zz\u00e9\u00e9 \u2581x"]
    json.dump({
        "provenance": {"transformers": transformers.__version__, "gguf": "gguf-py " + gguf.__name__},
        "config": {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
                   "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
                   "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": c.tie_word_embeddings,
                   "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_parameters["rope_theta"],
                   "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id},
        "tensors": {k: tensor_digest(v) for k, v in sd.items()},
        "tokenize": [{"text": t, "ids": tok(t)["input_ids"], "ids_plain": tok(t, add_special_tokens=False)["input_ids"],
                      "decoded": tok.decode(tok(t, add_special_tokens=False)["input_ids"])} for t in strings],
    }, open(os.path.join(out, "golden.json"), "w"), indent=1, ensure_ascii=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny")
    ap.add_argument("--gguf")
    ap.add_argument("--passkey-data")
    ap.add_argument("--out")
    ap.add_argument("--text", default="tests/data/smollm2/text.txt")
    a = ap.parse_args()
    assert transformers.__version__ == TRANSFORMERS_VERSION, transformers.__version__
    if a.tiny:
        return make_tiny(a.tiny)
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    d, f = os.path.split(os.path.abspath(a.gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    os.makedirs(a.out, exist_ok=True)
    write = lambda name, obj: json.dump(obj, open(os.path.join(a.out, name), "w"), indent=1, ensure_ascii=False)
    provenance = {"transformers": transformers.__version__, "torch": torch.__version__, "gguf": f}

    c = model.config
    write("config.json", {
        "provenance": provenance,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "rope_theta": c.rope_parameters["rope_theta"], "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
    })
    sd = model.state_dict()
    names = [k for k in sd if not (c.tie_word_embeddings and k == "lm_head.weight")]
    write("tensors.json", {"provenance": provenance, "tensors": {k: tensor_digest(sd[k]) for k in names}})
    write("tokenize.json", {"provenance": provenance, "cases": [
        {"text": s, "ids": tok(s)["input_ids"], "ids_plain": tok(s, add_special_tokens=False)["input_ids"]}
        for s in TOKENIZE]})

    text = open(a.text, encoding="utf-8").read()
    ids = tok(text)["input_ids"]
    write("ppl.json", {"provenance": provenance, "input": a.text, "tokens": len(ids), "ids_sha256": sha256_ids(ids),
                       "windows": [window_nll(model, ids, 256, 128), window_nll(model, ids, 1024, 1024)]})

    eos, bos = c.eos_token_id, c.bos_token_id
    cases = []
    for length in sorted(int(x) for x in os.listdir(a.passkey_data) if x.isdigit()):
        path = os.path.join(a.passkey_data, str(length), "data", "passkey", "validation.jsonl")
        for line, rec in enumerate(json.loads(l) for l in open(path, encoding="utf-8")):
            prompt = rec["input"]
            auto = tok(prompt)["input_ids"]
            with_bos = [bos] + tok(prompt, add_special_tokens=False)["input_ids"]
            case = {"length": length, "line": line, "key": rec["outputs"][0],
                    "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest()}
            for rule, ids_ in [("auto", auto), ("always", with_bos)]:
                new = greedy(model, ids_, eos)
                case[rule] = {"n_ids": len(ids_), "ids_sha256": sha256_ids(ids_), "new_ids": new,
                              "text": tok.decode(new, skip_special_tokens=True)}
            cases.append(case)
            print(length, line, case["key"], repr(case["auto"]["text"]), repr(case["always"]["text"]), flush=True)
    write("passkey.json", {"provenance": provenance, "cases": cases})


if __name__ == "__main__":
    main()
