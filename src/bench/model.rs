//! `harpe bench model`: the two model-level rows of issue 10 on `--device` — one Llama decoder layer
//! forward+backward (`Llama::layer_forward_with` on `Var` weights, then `sum().backward()`), and one
//! full training step of a small model (`train::forward_backward` with every-layer checkpointing, global
//! norm, clipping, AdamW on the fp32 master, write-back into the compute weights: the `harpe train`
//! loop's calls, on one rank). The rows are `bench::Row`s in the same table, plus TFLOP/s from the
//! matmul FLOPs and tokens/s in the shape column.
//!
//! Reference: Megatron-LM / PaLM MFU accounting (6 N T for the weights' matmuls of a step; attention
//! 4 T^2 C per layer forward, halved for the causal mask, x3 with the backward).
//! The non-obvious decision: sizes default by device — tiny on the CPU (C = 64, H = 4, T = 128, so the
//! rows run in seconds in a debug build and in tests), Llama-2-7B-shaped on CUDA (C = 4096, H = 32,
//! I = 11008, T = 4096 and, without `--model-tokens`, the layer again at T = 16384; a 2-layer step with
//! V = 32000); `--hidden/--heads/--model-tokens/--step-layers` override them. Bytes (the GB/s and %copy columns) are the weights read twice and their gradients
//! written once plus the (B, T, C) activations in and out — a floor, since these rows are
//! compute-bound; the TFLOP/s column is the one to read.
//! On CUDA the same shapes run in PyTorch beside them (scripts/bench_model_torch.py: transformers'
//! LlamaDecoderLayer math with SDPA, checkpointed layers, fused AdamW on fp32 masters).
//! Not done here: the largest-T search of issue 10's 7B step (it needs the GPU machine).
use super::{BenchArgs, Row};
use crate::comms::zero::{self, ShardMap, Split};
use crate::comms::Comm;
use crate::flatbuf::Placement;
use crate::grads::{self, GradAccum};
use crate::model::attention::AttentionImpl;
use crate::model::config::LlamaConfig;
use crate::model::llama::{is_norm_param, param_shapes, LayerWeights, Llama};
use crate::model::rope::RopeScheme;
use crate::model::weights::init_flat;
use crate::optim::adamw::{AdamW, AdamWHyper};
use crate::train::{batch_tensors, forward_backward, rope_tables, trainable_model};
use anyhow::{anyhow, Result};
use candle_core::{DType, Device, Tensor, Var};
use std::time::Instant;

/// The shapes the rows run at (device defaults, overridden by flags).
#[derive(Clone)]
struct Shape {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    inter: usize,
    tokens: usize,
    vocab: usize,
    layers: usize,
    dtype: DType,
}

impl Shape {
    fn of(args: &BenchArgs, dev: &Device) -> Shape {
        let gpu = !dev.is_cpu();
        let hidden = args.hidden.unwrap_or(if gpu { 4096 } else { 64 });
        let heads = args.heads.unwrap_or(if gpu { 32 } else { 4 });
        Shape {
            hidden,
            heads,
            kv_heads: heads,
            inter: (8 * hidden / 3).div_ceil(256) * 256, // Llama's rule: 11008 for C = 4096
            tokens: args.model_tokens.unwrap_or(if gpu { 4096 } else { 128 }),
            vocab: if gpu { 32000 } else { 259 },
            layers: args.step_layers,
            dtype: if gpu { DType::BF16 } else { DType::F32 },
        }
    }

    fn config(&self, layers: usize) -> LlamaConfig {
        let mut c = LlamaConfig::tiny(self.vocab, RopeScheme::Default { theta: 10000.0 });
        c.hidden_size = self.hidden;
        c.num_attention_heads = self.heads;
        c.num_key_value_heads = self.kv_heads;
        c.head_dim = self.hidden / self.heads;
        c.intermediate_size = self.inter;
        c.num_hidden_layers = layers;
        c.max_position_embeddings = self.tokens.max(c.max_position_embeddings);
        c
    }

    /// Weights of one decoder layer and forward matmul FLOPs of it at T tokens (causal attention).
    fn layer_counts(&self) -> (usize, f64) {
        let (c, d) = (self.hidden, self.hidden / self.heads);
        let w = c * self.heads * d + 2 * c * self.kv_heads * d + self.heads * d * c + 3 * c * self.inter;
        let t = self.tokens as f64;
        (w, 2.0 * t * w as f64 + 2.0 * t * t * (self.heads * d) as f64)
    }
}

/// Mean seconds of `f` over `iters` calls after one warm-up call, synchronised.
fn time(dev: &Device, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    dev.synchronize()?;
    Ok(t0.elapsed().as_secs_f64() / iters as f64)
}

/// The device's copy bandwidth (GB/s, read + write counted) from a 64 MiB tensor copy: the 100% line.
pub fn copy_bandwidth(dev: &Device, iters: usize) -> Result<f64> {
    let n = 16usize << 20;
    let x = Tensor::zeros(n, DType::F32, dev)?;
    let s = time(dev, iters, || Ok(x.copy().map(|_| ())?))?;
    Ok((2 * 4 * n) as f64 / s / 1e9)
}

/// Both rows on `dev`.
pub fn rows(args: &BenchArgs, dev: &Device, copy_gbps: f64) -> Result<Vec<Row>> {
    let sh = Shape::of(args, dev);
    let iters = args.iters.max(1);
    let mut rows = vec![layer_row(&sh, dev, iters, copy_gbps)?];
    // on CUDA without --model-tokens the layer also at T = 16K (issue 10: 4K and 16K)
    let long = (!dev.is_cpu() && args.model_tokens.is_none()).then(|| Shape { tokens: 16384, ..sh.clone() });
    if let Some(l) = &long {
        rows.push(layer_row(l, dev, iters, copy_gbps)?);
    }
    rows.push(step_row(&sh, dev, iters, copy_gbps)?);
    // PyTorch at the same shapes (scripts/bench_model_torch.py), on CUDA when torch is importable
    if !dev.is_cpu() && !args.no_torch {
        let torch = |s: &Shape, layer_only: bool| {
            let n = |v: usize| v.to_string();
            let (hidden, heads, kv, inter) = (n(s.hidden), n(s.heads), n(s.kv_heads), n(s.inter));
            let (tokens, vocab, layers, it) = (n(s.tokens), n(s.vocab), n(s.layers), n(iters));
            let mut flags = vec![
                "--hidden",
                &hidden,
                "--heads",
                &heads,
                "--kv-heads",
                &kv,
                "--inter",
                &inter,
                "--tokens",
                &tokens,
                "--vocab",
                &vocab,
                "--layers",
                &layers,
                "--iters",
                &it,
            ];
            if layer_only {
                flags.push("--layer-only");
            }
            super::torch_script("bench_model_torch.py", &flags)
        };
        let ms = |j: &Option<serde_json::Value>, k: &str| j.as_ref().and_then(|j| j.get(k)).and_then(|v| v.as_f64());
        let short = torch(&sh, false);
        let long_t = long.as_ref().map(|l| torch(l, true)).unwrap_or(None);
        for (i, r) in rows.iter_mut().enumerate() {
            let j = if long.is_some() && i == 1 { &long_t } else { &short };
            r.torch_ms = ms(j, &r.kernel);
        }
    }
    Ok(rows)
}

fn row(kernel: &str, shape: String, s: f64, bytes: usize, flops: f64, copy_gbps: f64) -> Row {
    let mut r = Row::new(kernel, &shape, s * 1e3, bytes as u64, copy_gbps);
    r.tflops = Some(flops / s / 1e12);
    r
}

fn layer_row(sh: &Shape, dev: &Device, iters: usize, copy_gbps: f64) -> Result<Row> {
    let cfg = sh.config(1);
    let model = Llama::skeleton(cfg.clone(), sh.dtype, dev)?.with_attention(AttentionImpl::for_device(dev));
    let vars: Vec<Var> = param_shapes(&cfg)
        .into_iter()
        .filter(|(n, _)| n.starts_with("model.layers.0."))
        .map(|(n, s)| {
            let t =
                if is_norm_param(&n) { Tensor::ones(s, DType::F32, dev)? } else { Tensor::randn(0f32, 0.02, s, dev)? };
            Ok(Var::from_tensor(&t.to_dtype(sh.dtype)?)?)
        })
        .collect::<Result<_>>()?;
    let arr: [Tensor; 9] = vars
        .iter()
        .map(|v| v.as_tensor().clone())
        .collect::<Vec<_>>()
        .try_into()
        .map_err(|_| anyhow!("internal: a decoder layer has not 9 parameters"))?;
    let w = LayerWeights::from_array(arr);
    let tables = model.rope_tables(0, 0, sh.tokens)?;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, sh.tokens, sh.hidden), dev)?.to_dtype(sh.dtype)?)?;
    let s = time(dev, iters, || {
        let y = model.layer_forward_with(0, &w, x.as_tensor(), &tables, None, None)?; // (1, T, C)
        let g = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
        g.get(x.as_tensor()).ok_or_else(|| anyhow!("no gradient reached the layer's input"))?;
        Ok(())
    })?;
    let (nw, fwd) = sh.layer_counts();
    let es = sh.dtype.size_in_bytes();
    let bytes = 3 * nw * es + 4 * sh.tokens * sh.hidden * es;
    let shape = format!("C{} H{} I{} T{} {:?}", sh.hidden, sh.heads, sh.inter, sh.tokens, sh.dtype);
    Ok(row("decoder layer fwd+bwd", shape, s, bytes, 3.0 * fwd, copy_gbps))
}

fn step_row(sh: &Shape, dev: &Device, iters: usize, copy_gbps: f64) -> Result<Row> {
    let cfg = sh.config(sh.layers);
    let (layout, mut weights) = init_flat(&cfg, 0, &Placement::of(dev))?;
    let (model, vars) = trainable_model(&cfg, &layout, &weights, sh.dtype, dev)?;
    let model = model.with_attention(AttentionImpl::for_device(dev));
    let map = ShardMap::new(&layout, 1, Split::Slices);
    let hp = AdamWHyper { beta1: 0.9, beta2: 0.95, eps: 1e-8, wd_matrix: 0.1, wd_embedding: 0.0, wd_norm: 0.0 };
    let mut optim = AdamW::new(&layout, &weights, &map, 0, hp)?;
    let mut g = GradAccum::new(&layout, dev)?;
    let tables = rope_tables(&model, sh.tokens)?;
    let seq: Vec<u32> = (0..sh.tokens).map(|i| ((i * 7 + i * i) % sh.vocab) as u32).collect();
    let (ids, targets) = batch_tensors(&[&seq], sh.vocab, dev)?;
    let comm = Comm::Single;
    let s = time(dev, iters, || {
        g.zero()?;
        let out = forward_backward(&model, &vars, &layout, &tables, &ids, &targets, 1, 1024, 1.0, &mut g)?;
        out.nll.sum_all()?.to_scalar::<f32>()?; // the step's loss read, as the loop reads it
        let norm = grads::global_norm(g.buf())?;
        grads::clip_by_global_norm(g.buf_mut(), norm, 1.0)?;
        optim.step(g.buf(), 1e-4)?;
        zero::gather_and_write_back(&comm, &map, &optim, &mut weights, &layout, &vars)
    })?;
    let (_, fwd) = sh.layer_counts();
    let n_params = layout.total;
    let head = 2.0 * sh.tokens as f64 * (sh.vocab * sh.hidden) as f64; // lm head forward
    let flops = 3.0 * (sh.layers as f64 * fwd + head);
    let es = sh.dtype.size_in_bytes();
    let bytes = 3 * n_params * es + 16 * n_params; // weights x3, + AdamW's fp32 master/m/v/grad
    let shape = format!("L{} C{} V{} T{} {:.0} tok/s", sh.layers, sh.hidden, sh.vocab, sh.tokens, sh.tokens as f64 / s);
    Ok(row("train step", shape, s, bytes, flops, copy_gbps))
}
