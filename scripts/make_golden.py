#!/usr/bin/env python3
"""Golden fixtures from HF transformers for harpe's numerics tests.

Run with torch + transformers + tokenizers + safetensors installed from PyPI:

    python3 -m venv /tmp/gvenv && /tmp/gvenv/bin/pip install torch transformers tokenizers safetensors
    /tmp/gvenv/bin/python scripts/make_golden.py tests/golden

Writes, for a tiny random Llama with GQA (4 query heads, 2 kv heads):
  <out>/tokenizer.json                      a small word-level tokenizer (BOS added by its post-processor)
  <out>/text.txt                            text for the perplexity fixture
  <out>/<case>/model/                       HF model directory (config.json, safetensors, tokenizer.json)
  <out>/<case>/golden.safetensors           input_ids, logits, loss, grad.<param> for every parameter
  <out>/<case>/ppl.json                     sliding-window NLL of text.txt (the rule of `harpe eval-ppl`)
  <out>/adamw/golden.safetensors            weights after one torch.optim.AdamW step (+ hyper-parameters)
  <out>/adamw_steps/golden.safetensors      weights after 5 AdamW steps from adamw/model: three weight-decay
                                            groups, clip_grad_norm_ active, a different lr each step
  <out>/rope_parity_hf/golden.safetensors   logits of default/model at positions 100000.. in transformers'
                                            float32 RoPE arithmetic (what `--rope-parity hf` reproduces)
  <out>/default/ppl_disjoint.json           perplexity of text.txt by transformers' documented recipe with
                                            stride = max_length (disjoint windows)
The last three read the committed model directories, so they can be made alone without touching the
others: `python3 scripts/make_golden.py tests/golden adamw_steps rope_parity_hf ppl_disjoint`.
Cases: default (transformers-5 `rope_parameters` config, sharded safetensors), harpe (per-kv-head bases,
by patching transformers' rotary functions), and one per classic scheme (linear, dynamic, yarn, llama3,
longrope) with logits only.
"""
import json
import math
import os
import sys

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

torch.manual_seed(0)
OUT = sys.argv[1] if len(sys.argv) > 1 else "tests/golden"

WORDS = ("the a of and to in is was for on with as by at from that this it be are an or which but not have had "
         "his her they their one all were we when there can more has been would who no will if out so up said "
         "what its about than into them only other new some could time these two may then first any like "
         "now my such make over our even most me state after also made many did must before back see through").split()
VOCAB = ["<unk>", "<s>", "</s>"] + WORDS[: 64 - 3]
TEXT = ("the time of the state was one of the first and the most new . " * 1).replace(" .", "")


def make_tokenizer():
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


def base_config(**kw):
    c = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, attn_implementation="eager",
             initializer_range=0.2)
    c.update(kw)
    return c


HARPE_BASES = [10000.0, 500000.0]  # one per kv head
ORIGINAL_APPLY_ROTARY = modeling_llama.apply_rotary_pos_emb


def patch_harpe(model, bases):
    """Per-kv-head RoPE: rotary returns (B, Hkv, T, D) tables; q heads of a group share their kv head's."""
    cfg = model.config
    d = cfg.head_dim
    n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
    inv = torch.stack([1.0 / (b ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)) for b in bases])

    def rotary_forward(x, position_ids):
        freqs = position_ids[:, None, :, None].float() * inv[None, :, None, :]  # (B, Hkv, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def apply_rotary(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        cq, sq = cos.repeat_interleave(n_rep, dim=1), sin.repeat_interleave(n_rep, dim=1)
        rot = modeling_llama.rotate_half
        return q * cq + rot(q) * sq, k * cos + rot(k) * sin

    model.model.rotary_emb.forward = rotary_forward
    modeling_llama.apply_rotary_pos_emb = apply_rotary


def windows_nll(model, ids, W, S):
    """The pinned rule of `harpe eval-ppl`: every target 1..N-1 once, from the context inside its window."""
    n = len(ids)
    nll, count, windows, prev_end, k = 0.0, 0, 0, 0, 0
    per_window = []
    while True:
        begin = k * S
        end = min(begin + W, n)
        lo = max(prev_end, 1)
        # Dynamic NTK in HF only grows its cached base with the longest length seen so far; harpe
        # computes it from each call's own length. Reset HF's cache so every window starts fresh.
        rot = model.model.rotary_emb
        if getattr(rot, "rope_type", "") == "dynamic":
            rot.inv_freq = rot.original_inv_freq.clone()
            rot.max_seq_len_cached = rot.original_max_seq_len
        with torch.no_grad():
            logits = model(torch.tensor([ids[begin:end]])).logits[0].double()
        lp = torch.log_softmax(logits, dim=-1)
        wn = 0.0
        for t in range(lo, end):
            wn -= lp[t - 1 - begin, ids[t]].item()
        nll += wn
        count += end - lo
        per_window.append(wn / max(end - lo, 1))
        windows += 1
        prev_end = end
        if end == n:
            break
        k += 1
    return {"nll": nll / count, "tokens": count, "windows": windows, "window_mean_nll": sum(per_window) / len(per_window),
            "window": W, "stride": S}


def golden_case(name, cfg_kw, harpe=None, grads=True, rope_scaling_json=None):
    torch.manual_seed(1234)
    cfg = LlamaConfig(**cfg_kw)
    model = LlamaForCausalLM(cfg).float()
    if harpe is not None:
        patch_harpe(model, harpe)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    out = model(ids, labels=ids)
    tensors = {"input_ids": ids.to(torch.int64).contiguous(), "logits": out.logits.detach().float().contiguous(),
               "loss": out.loss.detach().reshape(1).float()}
    if grads:
        out.loss.backward()
        for n, p in model.named_parameters():
            tensors["grad." + n] = p.grad.detach().float().contiguous()
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    save_file(tensors, os.path.join(d, "golden.safetensors"))
    mdir = os.path.join(d, "model")
    shard = "20KB" if name == "default" else "50MB"
    model.save_pretrained(mdir, safe_serialization=True, max_shard_size=shard)
    make_tokenizer().save(os.path.join(mdir, "tokenizer.json"))
    cpath = os.path.join(mdir, "config.json")
    c = json.load(open(cpath))
    if rope_scaling_json is not None:
        # transformers-4 form, as other tools write it.
        c.pop("rope_parameters", None)
        c["rope_theta"] = cfg_kw.get("rope_theta", 10000.0)
        c["rope_scaling"] = rope_scaling_json
    json.dump(c, open(cpath, "w"), indent=2)
    # perplexity fixture
    tok = make_tokenizer()
    text = open(os.path.join(OUT, "text.txt")).read()
    enc = tok.encode(text).ids
    model.eval()
    ppl = windows_nll(model, enc, W=12, S=5)
    json.dump(ppl, open(os.path.join(d, "ppl.json"), "w"), indent=2)
    modeling_llama.apply_rotary_pos_emb = ORIGINAL_APPLY_ROTARY
    return model, ids


def adamw_case():
    torch.manual_seed(1234)
    cfg = LlamaConfig(**base_config())
    model = LlamaForCausalLM(cfg).float()
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"])
    d = os.path.join(OUT, "adamw")
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(os.path.join(d, "model"), safe_serialization=True)
    make_tokenizer().save(os.path.join(d, "model", "tokenizer.json"))
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    t = {"input_ids": ids.to(torch.int64).contiguous(), "loss": loss.detach().reshape(1).float()}
    for n, p in model.named_parameters():
        t["param." + n] = p.detach().float().contiguous()
    save_file(t, os.path.join(d, "golden.safetensors"), metadata={k: repr(v) for k, v in hp.items()})
    json.dump(hp, open(os.path.join(d, "hparams.json"), "w"), indent=2)


def adamw_steps_case():
    """Several AdamW steps, where bias correction no longer cancels the betas; three decay groups."""
    src = os.path.join(OUT, "adamw", "model")
    model = LlamaForCausalLM.from_pretrained(src, torch_dtype=torch.float32, attn_implementation="eager")
    model.train()
    hp = dict(beta1=0.8, beta2=0.95, eps=1e-8, wd_matrix=0.1, wd_embedding=0.05, wd_norm=0.0, max_norm=0.5,
              lrs=[1e-3, 3e-3, 2e-3, 5e-3, 1e-3])
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not n.endswith("norm.weight") and "embed_tokens" not in n],
         "weight_decay": hp["wd_matrix"]},
        {"params": [p for n, p in named if "embed_tokens" in n], "weight_decay": hp["wd_embedding"]},
        {"params": [p for n, p in named if n.endswith("norm.weight")], "weight_decay": hp["wd_norm"]},
    ]
    opt = torch.optim.AdamW(groups, lr=hp["lrs"][0], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"])
    gen = torch.Generator().manual_seed(11)
    t, losses, norms = {}, [], []
    for k, lr in enumerate(hp["lrs"]):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
        t[f"input_ids.{k}"] = ids.to(torch.int64).contiguous()
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp["max_norm"])
        assert norm > hp["max_norm"], "the fixture must exercise clipping"
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    t["loss"] = torch.tensor(losses, dtype=torch.float32)
    t["grad_norm"] = torch.tensor(norms, dtype=torch.float32)
    for n, p in model.named_parameters():
        t["param." + n] = p.detach().float().contiguous()
    d = os.path.join(OUT, "adamw_steps")
    os.makedirs(d, exist_ok=True)
    save_file(t, os.path.join(d, "golden.safetensors"))
    json.dump(hp, open(os.path.join(d, "hparams.json"), "w"), indent=2)


def rope_parity_case():
    """Logits far from position 0, where float32 angles (transformers) and f64 angles (harpe) differ."""
    model = LlamaForCausalLM.from_pretrained(os.path.join(OUT, "default", "model"), torch_dtype=torch.float32,
                                             attn_implementation="eager")
    model.eval()
    start = 100000
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(start, start + 16)[None, :]
    with torch.no_grad():
        logits = model(ids, position_ids=pos).logits.float()
    d = os.path.join(OUT, "rope_parity_hf")
    os.makedirs(d, exist_ok=True)
    save_file({"input_ids": ids.to(torch.int64).contiguous(), "logits": logits.contiguous(),
               "start": torch.tensor([start], dtype=torch.int64)}, os.path.join(d, "golden.safetensors"))


def ppl_disjoint_case():
    """transformers' documented perplexity recipe ("Perplexity of fixed-length models") with stride =
    max_length: disjoint windows; labels shift inside each window, so each window's first token is unscored."""
    mdir = os.path.join(OUT, "default", "model")
    model = LlamaForCausalLM.from_pretrained(mdir, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    enc = torch.tensor([make_tokenizer().encode(open(os.path.join(OUT, "text.txt")).read()).ids])
    max_length = stride = 12
    seq_len = enc.size(1)
    assert seq_len % stride not in (0, 1), "keep a tail window with targets"
    nll_sum, n_tokens, windows, prev_end = 0.0, 0, 0, 0
    position_nll = []  # per window, -log p of each target from its own logits (eval-loss cross-check)
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end
        input_ids = enc[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            out = model(input_ids, labels=target_ids)
            loss = out.loss
        lp = torch.log_softmax(out.logits[0].double(), dim=-1)
        position_nll.append([-lp[p - 1, input_ids[0, p]].item() for p in range(1, input_ids.size(1))])
        num_loss_tokens = (target_ids != -100).sum().item() - target_ids.size(0)
        nll_sum += loss.double().item() * num_loss_tokens
        n_tokens += num_loss_tokens
        windows += 1
        prev_end = end_loc
        if end_loc == seq_len:
            break
    json.dump({"nll": nll_sum / n_tokens, "tokens": n_tokens, "windows": windows, "window": max_length,
               "stride": stride, "position_nll": position_nll},
              open(os.path.join(OUT, "default", "ppl_disjoint.json"), "w"), indent=2)


NEW_CASES = {"adamw_steps": adamw_steps_case, "rope_parity_hf": rope_parity_case, "ppl_disjoint": ppl_disjoint_case}


def main():
    only = sys.argv[2:]
    if only:
        for name in only:
            NEW_CASES[name]()
        print("wrote", ", ".join(only), "under", OUT)
        return
    os.makedirs(OUT, exist_ok=True)
    make_tokenizer().save(os.path.join(OUT, "tokenizer.json"))
    with open(os.path.join(OUT, "text.txt"), "w") as f:
        f.write("the time of the state was one of the first and the most new state . "
                "we said that they would make more of it and then they did . "
                "after all there was no time for what his first state had made .\n")
    golden_case("default", base_config())
    golden_case("harpe", base_config(), harpe=HARPE_BASES,
                rope_scaling_json={"rope_type": "harpe", "head_bases": HARPE_BASES})
    # MHA with tied embeddings and four per-head bases (the paper's Llama-2 layout, scaled down)
    mha = [10000.0, 50000.0, 200000.0, 1000000.0]
    golden_case("harpe_mha_tied", base_config(num_key_value_heads=4, tie_word_embeddings=True), harpe=mha,
                rope_scaling_json={"rope_type": "harpe", "head_bases": mha})
    # classic schemes: logits only, transformers-4 config form
    golden_case("linear", base_config(rope_scaling={"rope_type": "linear", "factor": 4.0}), grads=False,
                rope_scaling_json={"rope_type": "linear", "factor": 4.0})
    golden_case("dynamic", base_config(rope_scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=8),
                grads=False, rope_scaling_json={"rope_type": "dynamic", "factor": 4.0})
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0}
    golden_case("yarn", base_config(rope_scaling=yarn, max_position_embeddings=128), grads=False, rope_scaling_json=yarn)
    l3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
    golden_case("llama3", base_config(rope_scaling=l3, max_position_embeddings=128), grads=False, rope_scaling_json=l3)
    lr = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.0, 2.0, 4.0, 8.0],
          "original_max_position_embeddings": 8}
    golden_case("longrope", base_config(rope_scaling=lr, max_position_embeddings=64), grads=False, rope_scaling_json=lr)
    adamw_case()
    for f in NEW_CASES.values():
        f()
    print("wrote", OUT)


if __name__ == "__main__":
    main()
