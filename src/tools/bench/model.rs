//! `harpe bench model`: the model-level benchmark rows on `--device` — one Llama decoder layer
//! forward+backward (`Llama::run_layers` over one layer of `Var` weights, then `sum().backward()`), and one
//! full training step (`train::forward_backward` with every-layer checkpointing, global norm,
//! clipping, AdamW on the fp32 master, write-back into the compute weights: the `harpe train` loop's
//! calls, on one rank). The rows are `bench::Row`s in the same table, plus TFLOP/s from the matmul
//! FLOPs; the step row's shape column adds tokens/s and MFU.
//!
//! Reference: Megatron-LM / PaLM MFU accounting (6 N T for the weights' matmuls of a step; attention
//! 4 T^2 C per layer forward, halved for the causal mask, x3 with the backward). MFU uses
//! `metrics::flops_per_token` (6N + 12·L·C·T, what `harpe train` logs) against the kind's peak.
//! The non-obvious decisions:
//! - Sizes default by device — tiny on the CPU (C = 64, H = 4, T = 128, a 2-layer step, so the rows
//!   run in seconds in a debug build and in tests), Llama-2-7B on CUDA: the layer (C = 4096, H = 32,
//!   I = 11008) at T = 4096 and 16384, and the full 32-layer, V = 32000, bf16 step at the largest T (a
//!   multiple of 1024) whose memory plan (`train::plan::largest_fitting_tokens`) fits the device's free memory,
//!   timed over 1 warm-up + 2 steps. When not even T = 1024 fits (an 80 GB A100: ~18 B/param = 121 GB)
//!   the row says so instead of running out of memory. `--hidden/--heads/--model-tokens/--step-layers`
//!   override the defaults; `--model-rows` picks the rows (scripts/gpu-check.sh times them apart).
//! - The step holds what `harpe train` holds at one rank: bf16 weights, fp32 gradients, fp32 master,
//!   m and v (18 B/param, 121 GB at 7B; the initial fp32 weights are dropped once the optimizer has its
//!   master, and `zero::publish` writes the update straight into the weights), as the plan counts it.
//! - Bytes (the GB/s and %copy columns) are the weights read twice and their gradients written once plus
//!   the (B, T, C) activations in and out — a floor, since these rows are compute-bound; the TFLOP/s
//!   column is the one to read.
//!
//! On CUDA the same shapes run in PyTorch beside them (scripts/bench_model_torch.py: transformers'
//! LlamaDecoderLayer math with SDPA, checkpointed layers, fused AdamW on fp32 masters; its out of
//! memory is a missing torch number, not a failed row), one script call per row, with harpe's device
//! memory handed back first (`device::release_device_memory`).
//! Not done here: the 7B step across GPUs (ZeRO; `harpe plan` sizes it, `harpe train` runs it).
use super::{BenchArgs, Row};
use crate::comms::zero::{self, ShardMap, Split};
use crate::comms::Comm;
use crate::flatbuf::Placement;
use crate::grads::{self, GradAccum};
use crate::model::attention::AttentionImpl;
use crate::model::config::LlamaConfig;
use crate::model::llama::{is_norm_param, param_shapes, Forward, LayerWeights, Llama, OwnWeights};
use crate::model::rope::{Positions, RopeScheme};
use crate::model::weights::init_flat;
use crate::optim::adamw::{AdamW, AdamWHyper};
use crate::train::{batch_tensors, forward_backward, trainable_model, Backward, MicroBatch, Params};
use anyhow::{anyhow, Result};
use candle_core::{DType, Device, Tensor, Var};

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
            layers: args.step_layers.unwrap_or(if gpu { 32 } else { 2 }),
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

/// Tokens per lm-head chunk of the step row's loss: (1024 x V) f32 logits, 131 MB at V = 32000.
const LOSS_CHUNK: usize = 1024;

/// Mean seconds of `f` over `iters` calls after one warm-up call, synchronised.
fn time(dev: &Device, iters: usize, f: impl FnMut() -> Result<()>) -> Result<f64> {
    super::mean_seconds(dev, 1, iters, f)
}

/// The device's copy bandwidth (GB/s, read + write counted) from a 64 MiB tensor copy: the 100% line.
pub fn copy_bandwidth(dev: &Device, iters: usize) -> Result<f64> {
    let n = 16usize << 20;
    let x = Tensor::zeros(n, DType::F32, dev)?;
    let s = time(dev, iters, || Ok(x.copy().map(|_| ())?))?;
    Ok((2 * 4 * n) as f64 / s / 1e9)
}

/// The rows `--model-rows` names on `dev`, each with PyTorch's time beside it on CUDA; `done` sees each
/// row as soon as it is measured.
pub fn rows(args: &BenchArgs, dev: &Device, copy_gbps: f64, done: &mut dyn FnMut(&Row)) -> Result<Vec<Row>> {
    let sh = Shape::of(args, dev);
    let iters = args.iters.max(1);
    let want = |r: &str| args.model_rows.iter().any(|x| x == r);
    let torch = !dev.is_cpu() && !args.no_torch;
    let mut rows = vec![];
    if want("layer") {
        let mut shapes = vec![sh.clone()];
        // on CUDA without --model-tokens the layer also at T = 16K, the long-context shape beside the 4K default
        if !dev.is_cpu() && args.model_tokens.is_none() {
            shapes.push(Shape { tokens: 16384, ..sh.clone() });
        }
        for s in &shapes {
            let mut r = layer_row(s, dev, iters, copy_gbps)?;
            if torch {
                r.torch_ms = torch_ms(dev, s, "--layer-only", iters, &r.kernel)?;
            }
            done(&r);
            rows.push(r);
        }
    }
    if want("step") {
        let step_iters = args.step_iters.unwrap_or(if dev.is_cpu() { iters } else { 2 }).max(1);
        let picked = match args.model_tokens {
            Some(_) => Ok((sh.clone(), None)),
            None if dev.is_cpu() => Ok((sh.clone(), None)),
            None => step_tokens(&sh, dev)?,
        };
        match picked {
            Err(note) => {
                let shape = format!("L{} C{} V{} {:?}", sh.layers, sh.hidden, sh.vocab, sh.dtype);
                let r = Row::skipped("train step", &shape, note);
                done(&r);
                rows.push(r);
            }
            Ok((s, why)) => {
                if let Some(why) = why {
                    eprintln!("bench model: {why}");
                }
                let mut r = step_row(&s, dev, step_iters, copy_gbps)?;
                if torch {
                    r.torch_ms = torch_ms(dev, &s, "--step-only", step_iters, &r.kernel)?;
                }
                done(&r);
                rows.push(r);
            }
        }
    }
    Ok(rows)
}

/// The step row's T on CUDA: the largest multiple of 1024 whose plan fits the device's free memory now,
/// with the reason as a sentence; `Err(note)` when not even T = 1024 fits.
fn step_tokens(sh: &Shape, dev: &Device) -> Result<std::result::Result<(Shape, Option<String>), String>> {
    let spec = match dev.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => crate::device::DeviceSpec::Cuda(gpu_id),
        _ => return Ok(Ok((sh.clone(), None))),
    };
    crate::device::release_device_memory(dev)?; // the layer rows' buffers, back to the driver
    let m = crate::device::device_memory(&spec, "--device")?
        .ok_or_else(|| anyhow!("internal: no memory reading for CUDA device {spec}"))?;
    Ok(pick_tokens(sh, &m))
}

/// `step_tokens` for a memory reading `m` (pure: tested with made-up devices).
fn pick_tokens(sh: &Shape, m: &crate::device::DeviceMemory) -> std::result::Result<(Shape, Option<String>), String> {
    use crate::config::Checkpointing;
    use crate::train::plan::{largest_fitting_tokens, plan_stage, Arch, Gpu, StageShape, World};
    const MULTIPLE: usize = 1024;
    let arch = Arch::from_llama(&sh.config(sh.layers));
    let (gpu, _) = Gpu::measured(m);
    let world = World { gpus: 1, zero_stage: crate::config::ZeroStage::Replicated, sp_degree: 1 };
    let template = StageShape {
        seq_len: MULTIPLE,
        micro_batch: 1,
        tokens_per_step: MULTIPLE,
        checkpointing: Checkpointing::EveryLayer,
        loss_chunk: LOSS_CHUNK,
        bf16: sh.dtype == DType::BF16,
    };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let need = |t: usize| {
        let p = plan_stage(&arch, &StageShape { seq_len: t, tokens_per_step: t, ..template }, &world, &gpu);
        (gib(p.total_bytes), gib(p.usable_bytes))
    };
    let params = format!("{:.2}B params", arch.params as f64 / 1e9);
    match largest_fitting_tokens(&arch, &template, &world, &gpu, MULTIPLE) {
        None => {
            let (total, usable) = need(MULTIPLE);
            Err(format!(
                "the {}-layer step ({params}) does not fit in {:.1} GiB free on {}: its plan needs {total:.1} GiB at T = {MULTIPLE}, {usable:.1} GiB are usable ({:.0}% margin); use `harpe plan` and ZeRO across GPUs, or --step-layers N for a shorter stack",
                sh.layers,
                gib(m.free),
                m.name,
                100.0 * gpu.margin
            ))
        }
        Some(t) => {
            let ((total, usable), (next, _)) = (need(t), need(t + MULTIPLE));
            let why = format!(
                "train step at T = {t}, the largest multiple of {MULTIPLE} that fits {} ({:.1} GiB free): plan {total:.1} GiB, {usable:.1} GiB usable; T = {} would need {next:.1} GiB",
                m.name,
                gib(m.free),
                t + MULTIPLE
            );
            Ok((Shape { tokens: t, ..sh.clone() }, Some(why)))
        }
    }
}

/// PyTorch's milliseconds for the row `kernel` at `s` (scripts/bench_model_torch.py with `only`:
/// `--layer-only` or `--step-only`), after handing harpe's freed device memory back; `None` without torch,
/// or when torch ran out of memory (said on stderr).
fn torch_ms(dev: &Device, s: &Shape, only: &str, iters: usize, kernel: &str) -> Result<Option<f64>> {
    crate::device::release_device_memory(dev)?;
    let n = |v: usize| v.to_string();
    let (hidden, heads, kv, inter) = (n(s.hidden), n(s.heads), n(s.kv_heads), n(s.inter));
    let (tokens, vocab, layers, it) = (n(s.tokens), n(s.vocab), n(s.layers), n(iters));
    let flags = [
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
        only,
    ];
    let Some(j) = super::torch_script("bench_model_torch.py", &flags) else { return Ok(None) };
    if let Some(e) = j.get("errors").and_then(|e| e.get(kernel)).and_then(|e| e.as_str()) {
        eprintln!("warning: PyTorch's {kernel} row: {e}");
    }
    Ok(j.get(kernel).and_then(|v| v.as_f64()))
}

fn row(kernel: &str, shape: String, s: f64, bytes: usize, flops: f64, copy_gbps: f64) -> Row {
    let mut r = Row::new(kernel, &shape, s * 1e3, bytes as u64, copy_gbps);
    r.tflops = Some(flops / s / 1e12);
    r
}

fn layer_row(sh: &Shape, dev: &Device, iters: usize, copy_gbps: f64) -> Result<Row> {
    let cfg = sh.config(1);
    let mut model = Llama::skeleton(cfg.clone(), sh.dtype, dev)?.with_attention(AttentionImpl::for_device(dev));
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
    model.layers = vec![LayerWeights::from_array(arr)]; // the one layer, without an embedding or head
    let tables = model.rope_tables(Positions::new(0, sh.tokens))?;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, sh.tokens, sh.hidden), dev)?.to_dtype(sh.dtype)?)?;
    let s = time(dev, iters, || {
        let run = Forward { tables: &tables, docs: None, cache: None };
        let (y, _) = model.run_layers(&mut OwnWeights, x.as_tensor(), 0..1, run, None)?; // (1, T, C)
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
    let (layout, weights) = init_flat(&cfg, 0, &Placement::of(dev))?;
    let map = ShardMap::new(&layout, 1, Split::Slices);
    let hp = AdamWHyper { beta1: 0.9, beta2: 0.95, eps: 1e-8, wd_matrix: 0.1, wd_embedding: 0.0, wd_norm: 0.0 };
    let mut optim = AdamW::new(&layout, &weights, &map, 0, hp)?;
    // as `harpe train`: no fp32 copy beside the master (its peak, 16 B/param, comes before the compute
    // weights exist; at one rank the master is the whole flat space the model is built from)
    drop(weights);
    let (model, vars) = trainable_model(&cfg, &layout, optim.master(), sh.dtype, dev)?;
    let model = model.with_attention(AttentionImpl::for_device(dev));
    let comm = Comm::Single;
    let mut g = GradAccum::new(&layout, dev)?;
    let tables = model.rope_tables(Positions::new(0, sh.tokens))?;
    let seq: Vec<u32> = (0..sh.tokens).map(|i| ((i * 7 + i * i) % sh.vocab) as u32).collect();
    let (ids, targets) = batch_tensors(&[&seq], sh.vocab, dev)?;
    let s = time(dev, iters, || {
        g.reset()?;
        let out = forward_backward(
            &model,
            &mut Params::resident(&vars, &layout, &mut g),
            &MicroBatch { ids: &ids, targets: &targets, tables: &tables, docs: None },
            Backward { seg: 1, loss_chunk: LOSS_CHUNK, scale: 1.0 },
        )?;
        out.nll.sum_all()?.to_scalar::<f32>()?; // the step's loss read, as the loop reads it
        let norm = grads::global_norm(g.buf())?;
        grads::clip_by_global_norm(g.buf_mut(), norm, 1.0)?;
        optim.step(g.buf(), 1e-4)?;
        zero::publish(&zero::Shards { comm: &comm, map: &map, layout: &layout, master: optim.master() }, &vars, 1 << 24)
    })?;
    let (_, fwd) = sh.layer_counts();
    let n_params = layout.total;
    let head = 2.0 * sh.tokens as f64 * (sh.vocab * sh.hidden) as f64; // lm head forward
    let flops = 3.0 * (sh.layers as f64 * fwd + head);
    let es = sh.dtype.size_in_bytes();
    let bytes = 3 * n_params * es + 16 * n_params; // weights x3, + AdamW's fp32 master/m/v/grad
    let tok_s = sh.tokens as f64 / s;
    let mfu = mfu(dev, n_params, sh, tok_s)?.map(|(m, peak)| format!(" MFU {:.1}% of {peak:.0}", 100.0 * m));
    let shape = format!(
        "L{} C{} V{} T{} {tok_s:.0} tok/s{}",
        sh.layers,
        sh.hidden,
        sh.vocab,
        sh.tokens,
        mfu.unwrap_or_default()
    );
    Ok(row("train step", shape, s, bytes, flops, copy_gbps))
}

/// Model FLOPs utilisation of a step at `tok_s` tokens/s (`metrics::flops_per_token`, as `harpe train`
/// logs it) against the dense peak of the device's kind, with that peak; `None` on the CPU and on GPUs
/// whose kind (and so peak) is not known.
fn mfu(dev: &Device, n_params: usize, sh: &Shape, tok_s: f64) -> Result<Option<(f64, f64)>> {
    let candle_core::DeviceLocation::Cuda { gpu_id } = dev.location() else { return Ok(None) };
    let Some(m) = crate::device::device_memory(&crate::device::DeviceSpec::Cuda(gpu_id), "--device")? else {
        return Ok(None);
    };
    let (gpu, known) = crate::train::plan::Gpu::measured(&m);
    let achieved = crate::model::flops_per_token(n_params, sh.layers, sh.hidden, sh.tokens) * tok_s / 1e12;
    Ok(known.then_some((achieved / gpu.peak_tflops, gpu.peak_tflops)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DeviceMemory;

    fn llama_7b() -> Shape {
        let (hidden, heads) = (4096, 32);
        Shape {
            hidden,
            heads,
            kv_heads: heads,
            inter: 11008,
            tokens: 4096,
            vocab: 32000,
            layers: 32,
            dtype: DType::BF16,
        }
    }

    /// The CUDA step row's T from a memory reading: an H200's free memory gives a multiple of 1024 and
    /// says why; an 80 GB A100 gives the "does not fit" note instead of a run that would run out of memory.
    #[test]
    fn the_7b_step_picks_a_t_on_an_h200_and_a_note_on_an_a100() {
        let gib = 1u64 << 30;
        let h200 = DeviceMemory { name: "NVIDIA H200".into(), free: 139 * gib, total: 140 * gib };
        let (s, why) = pick_tokens(&llama_7b(), &h200).unwrap();
        let why = why.unwrap();
        assert!(s.tokens % 1024 == 0 && (8192..65536).contains(&s.tokens), "T = {}: {why}", s.tokens);
        assert!(why.starts_with(&format!("train step at T = {}, the largest multiple of 1024", s.tokens)), "{why}");
        assert!(why.contains(&format!("T = {} would need", s.tokens + 1024)), "{why}");
        let a100 = DeviceMemory { name: "NVIDIA A100-SXM4-80GB".into(), free: 79 * gib, total: 80 * gib };
        let note = pick_tokens(&llama_7b(), &a100).map(|_| ()).unwrap_err();
        assert!(
            note.starts_with("the 32-layer step (6.74B params) does not fit in 79.0 GiB free on NVIDIA A100"),
            "{note}"
        );
        assert!(note.contains("harpe plan") && note.contains("ZeRO"), "{note}");
        // a 2-layer stack fits the A100 at some T
        let (s2, _) = pick_tokens(&Shape { layers: 2, ..llama_7b() }, &a100).unwrap();
        assert!(s2.tokens >= 16384, "T = {}", s2.tokens);
    }
}
