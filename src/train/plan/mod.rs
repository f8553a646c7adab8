//! `harpe plan`: per-GPU memory by term and the step time of a run before it starts, whether it fits,
//! and when it does not, the cheapest change that does.
//!
//! Reference: the budget this reproduces (Llama-2-7B at 128K on 8 x 80 GB; docs/VALIDATION.md), Rajbhandari et
//! al. 2020 (ZeRO: 2 B bf16 weight + 2 B bf16 grad + 12 B fp32 master/m/v per parameter, stage s shards
//! the last s of them), Jacobs et al. 2023 (DeepSpeed-Ulysses: activations / P, four all-to-alls per
//! layer), Korthikanti et al. 2022 (activations counted tensor by tensor per layer), Chen et al. 2016
//! (checkpointing), `model::flops_per_token` (6N + 12·L·C·T, the FLOPs the MFU column uses).
//! The non-obvious decisions:
//! - Two device modes, one activation count. `gpu` models harpe's CUDA path (bf16, flash attention, the
//!   chunked loss: nothing T x T or T x V); `cpu` models the CPU path as it is (f32 everywhere). On both,
//!   candle's autograd keeps every op output of a layer until that layer's backward returns: `layer_graph`
//!   counts those tensors op by op for a `LayerPath` (the paths differ only in RoPE's and attention's
//!   copies), and tests/plan_graph_memory.rs checks the count against the allocator in bf16 on the CPU.
//!   The backward's temporaries are counted on the bf16/CUDA paths; on the CPU f32 path they and the
//!   process baseline are *calibrated* constants, measured as documented at `CPU_BWD_*` and
//!   `CPU_BASELINE_BYTES` and checked by tests/stage_train/plan_memory.rs.
//! - The activation peak is layer inputs + max(recompute working set, loss working set): the loss runs
//!   before any segment is recomputed, and `train::step` drops the last segment's graph after the loss's
//!   backward, so their buffers are never alive together.
//! - Step time = max(compute, ZeRO collectives) + Ulysses all-to-alls: ZeRO traffic is bucketed and
//!   overlaps compute; the all-to-alls sit between the projections and attention, so they do not.
//!   Compute counts the recomputed forward; `mfu` is the achieved fraction of peak on those FLOPs.
//! - "Cheapest change" = the candidate (checkpoint every layer, micro-batch 1 with more accumulation,
//!   higher ZeRO stage, SP degree, more GPUs) that fits with the fewest GPU-seconds per token.
//!
//! What this folder does not do: tensor/pipeline parallelism, CPU offload, the data loader's prefetch,
//! fragmentation beyond the stated margin; it predicts, the training loop measures (`metrics.jsonl`).
//!
//! The files: `inputs.rs` (device, world, model, stage shape), `memory.rs` (the memory terms and the
//! activation count), `time.rs` (step time and checkpoint time), `attention.rs` (the attention kernel's
//! rate and backward workspace); this file puts them together into a
//! `Plan` and searches the cheapest change that fits.
mod attention;
mod inputs;
mod memory;
mod time;

pub use attention::for_run as attention_for_run;
pub use inputs::{
    ckpt_name, Arch, AttentionRate, AttnKernelKind, Gpu, GpuKind, StageShape, World, FA2_A100_TFLOPS, FA2_H100_TFLOPS,
    GIB, HARPE_PEAK_FRACTION,
};
pub use memory::{
    activations, backward_temporaries, layer_graph, layer_graph_bytes, Activations, LayerPath, Stored, Term,
};
pub use memory::{CPU_BASELINE_BYTES, CPU_BWD_PER_C, CPU_BWD_PER_I};
pub use time::{CheckpointTime, CHECKPOINT_WRITE_GBS};

use crate::config::{Checkpointing, RunConfig, StageBatch, ZeroStage};
use crate::device::ComputeDtype;
use anyhow::{bail, Result};
use memory::{activation_terms, comm_terms, state_terms, Sizes};
use serde::Serialize;
use time::step_time;

/// Memory and time of one stage on one device.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub mode: &'static str,
    pub gpu: Gpu,
    pub world: World,
    pub arch: Arch,
    pub stage: usize,
    pub shape: StageShape,
    #[serde(serialize_with = "ser_terms")]
    pub terms: Vec<Term>,
    /// per GPU
    pub total_bytes: u64,
    /// memory minus the margin
    pub usable_bytes: u64,
    pub fits: bool,
    /// model FLOPs per token (6N + 12·L·C·T, as the MFU column) and executed (causal, with recompute)
    pub flops_per_token: f64,
    pub hw_flops_per_token: f64,
    pub compute_s: f64,
    /// bytes each GPU sends per optimizer step for ZeRO / Ulysses, and their time
    pub zero_comm_bytes: f64,
    pub zero_comm_s: f64,
    pub sp_comm_bytes: f64,
    pub sp_comm_s: f64,
    pub step_time_s: f64,
    pub tokens_per_s: f64,
    /// the whole run (every stage at its own plan), hours
    pub run_hours: f64,
    /// a checkpoint: what one rank writes (its optimizer shard; rank 0 also the HF weights) and how long
    pub checkpoint: CheckpointTime,
    /// when it does not fit: the cheapest change that does
    pub suggestion: Option<Suggestion>,
}

/// A change that makes a run fit.
#[derive(Clone, Debug, Serialize)]
pub struct Suggestion {
    pub change: String,
    pub total_bytes: u64,
    pub tokens_per_s: f64,
    pub gpus: usize,
}

fn ser_terms<S: serde::Serializer>(t: &[Term], s: S) -> std::result::Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(Some(t.len()))?;
    for x in t {
        m.serialize_entry(x.name, &x.bytes)?;
    }
    m.end()
}

impl Plan {
    /// Bytes of a term (0 when absent).
    pub fn term(&self, name: &str) -> u64 {
        self.terms.iter().find(|t| t.name == name).map(|t| t.bytes).unwrap_or(0)
    }

    /// An error when the run will not fit (for `harpe train` at start-up; `--force` skips the check).
    pub fn check_fits(&self) -> Result<()> {
        if self.fits {
            return Ok(());
        }
        let fix = match &self.suggestion {
            Some(s) => format!("{} ({:.1} GiB per GPU)", s.change, s.total_bytes as f64 / GIB),
            None => "no single change found; shorten seq_len or use more memory".into(),
        };
        bail!(
            "stage {} (seq_len {}) needs {:.1} GiB per {} but {:.1} GiB are usable ({:.1} GiB less a {:.0}% margin); largest term: {}\nhint: {fix}; `harpe plan --config ...` shows every term; --force trains anyway",
            self.stage,
            self.shape.seq_len,
            self.total_bytes as f64 / GIB,
            if self.gpu.is_cpu() { "process" } else { "GPU" },
            self.usable_bytes as f64 / GIB,
            self.gpu.mem_bytes as f64 / GIB,
            100.0 * self.gpu.margin,
            self.terms.iter().max_by_key(|t| t.bytes).map(|t| t.name).unwrap_or("?")
        )
    }
}

/// The shape of stage `i` of a run.
pub fn stage_shape(cfg: &RunConfig, i: usize, gpu: &Gpu) -> StageShape {
    StageShape {
        seq_len: cfg.stages[i].seq_len,
        micro_batch: cfg.train.micro_batch_size,
        tokens_per_step: cfg.tokens_per_step(i),
        checkpointing: cfg.train.activation_checkpointing,
        loss_chunk: cfg.train.loss_chunk_tokens,
        bf16: cfg.train.dtype == ComputeDtype::Bf16 && !gpu.is_cpu(),
    }
}

/// The stage with the longest sequences (the memory peak of the run).
pub fn peak_stage(cfg: &RunConfig) -> usize {
    (0..cfg.stages.len()).max_by_key(|&i| (cfg.stages[i].seq_len, std::cmp::Reverse(i))).unwrap_or(0)
}

/// Plan a run: memory and time of its longest stage on `world` x `gpu`, the whole run's hours, and when
/// it does not fit the cheapest change that does.
pub fn plan_for(cfg: &RunConfig, world: &World, gpu: &Gpu) -> Result<Plan> {
    let arch = Arch::of_run(cfg, "[model]")?;
    if world.gpus == 0 {
        bail!("--gpus 0: a run needs at least one device\nhint: e.g. --gpus 8");
    }
    world.dist().validate("[dist]", world.gpus, Some(arch.kv_heads), &cfg.stage_batches())?;
    let si = peak_stage(cfg);
    let mut plan = plan_stage(&arch.for_stage(cfg, si), &stage_shape(cfg, si, gpu), world, gpu);
    plan.stage = si;
    plan.run_hours = (0..cfg.stages.len())
        .map(|i| {
            let p = plan_stage(&arch.for_stage(cfg, i), &stage_shape(cfg, i, gpu), world, gpu);
            let (steps, per_step) = cfg.stage_steps(i);
            steps as f64 * per_step as f64 / p.tokens_per_s / 3600.0
        })
        .sum();
    if !plan.fits {
        plan.suggestion = suggest(&plan.arch, &plan.shape, world, gpu);
    }
    Ok(plan)
}

/// Memory and time of one stage shape (pure arithmetic; `plan_for` adds the run-level parts): the model
/// state, the activations and the communication buffers as named terms, then the step time.
pub fn plan_stage(arch: &Arch, shape: &StageShape, world: &World, gpu: &Gpu) -> Plan {
    let sz = Sizes::of(arch, shape, world, gpu);
    let mut terms = vec![];
    state_terms(&sz, arch, world, &mut terms);
    activation_terms(&sz, arch, shape, &mut terms);
    comm_terms(&sz, arch, world, gpu, &mut terms);
    let total_bytes: u64 = terms.iter().map(|t| t.bytes).sum();
    let usable_bytes = (gpu.mem_bytes as f64 * (1.0 - gpu.margin)) as u64;
    let t = step_time(&sz, arch, shape, world, gpu);
    Plan {
        mode: if sz.cpu { "cpu" } else { "gpu" },
        gpu: gpu.clone(),
        world: *world,
        arch: arch.clone(),
        stage: 0,
        shape: *shape,
        terms,
        total_bytes,
        usable_bytes,
        fits: total_bytes <= usable_bytes,
        flops_per_token: t.flops_per_token,
        hw_flops_per_token: t.hw_flops_per_token,
        compute_s: t.compute_s,
        zero_comm_bytes: t.zero_comm_bytes,
        zero_comm_s: t.zero_comm_s,
        sp_comm_bytes: t.sp_comm_bytes,
        sp_comm_s: t.sp_comm_s,
        step_time_s: t.step_time_s,
        tokens_per_s: shape.tokens_per_step as f64 / t.step_time_s,
        run_hours: 0.0,
        checkpoint: CheckpointTime::of(arch, shape, world, t.step_time_s),
        suggestion: None,
    }
}

/// Whether `w` satisfies `[dist]`'s rules for a stage of this shape (suggestions skip those that do not).
fn splits_over_ranks(arch: &Arch, sh: &StageShape, w: &World) -> bool {
    let unit = (sh.micro_batch * sh.seq_len).max(1);
    let stage =
        StageBatch { seq_len: sh.seq_len, micro_batches: sh.tokens_per_step / unit, micro_batch: sh.micro_batch };
    sh.tokens_per_step.is_multiple_of(unit) && w.dist().validate("", w.gpus, Some(arch.kv_heads), &[stage]).is_ok()
}

/// The cheapest change that makes `shape` fit: candidates ordered by GPU-seconds per token.
pub fn suggest(arch: &Arch, shape: &StageShape, world: &World, gpu: &Gpu) -> Option<Suggestion> {
    let mut cands: Vec<(String, StageShape, World)> = vec![];
    if !matches!(shape.checkpointing, Checkpointing::EveryLayer) {
        let s = StageShape { checkpointing: Checkpointing::EveryLayer, ..*shape };
        cands.push(("train.activation_checkpointing = \"every-layer\"".into(), s, *world));
    }
    if shape.micro_batch > 1 {
        let s = StageShape { micro_batch: 1, ..*shape };
        cands.push(("train.micro_batch_size = 1 (more accumulation, same tokens per step)".into(), s, *world));
    }
    let divisors: Vec<usize> = (1..=arch.kv_heads).filter(|d| arch.kv_heads.is_multiple_of(*d)).collect();
    let mut gpus_opts = vec![world.gpus];
    let mut g = world.gpus;
    for _ in 0..6 {
        g *= 2;
        gpus_opts.push(g);
    }
    for &gpus in &gpus_opts {
        for z in ZeroStage::ALL.into_iter().filter(|&z| z >= world.zero_stage) {
            for &p in divisors.iter().filter(|&&p| p >= world.sp_degree && gpus.is_multiple_of(p)) {
                let w = World { gpus, zero_stage: z, sp_degree: p };
                if w == *world {
                    continue;
                }
                let mut what = vec![];
                if z != world.zero_stage {
                    what.push(format!("dist.zero_stage = {z}"));
                }
                if p != world.sp_degree {
                    what.push(format!("dist.sp_degree = {p}"));
                }
                if gpus != world.gpus {
                    what.push(format!("--gpus {gpus}"));
                }
                cands.push((what.join(", "), *shape, w));
            }
        }
    }
    cands
        .into_iter()
        .filter(|(_, s, w)| splits_over_ranks(arch, s, w))
        .map(|(what, s, w)| (what, plan_stage(arch, &s, &w, gpu)))
        .filter(|(_, p)| p.fits)
        .min_by(|(_, a), (_, b)| {
            let cost = |p: &Plan| p.world.gpus as f64 / p.tokens_per_s;
            cost(a).total_cmp(&cost(b)).then(a.world.gpus.cmp(&b.world.gpus))
        })
        .map(|(change, p)| Suggestion {
            change,
            total_bytes: p.total_bytes,
            tokens_per_s: p.tokens_per_s,
            gpus: p.world.gpus,
        })
}

/// The largest sequence length T, a multiple of `multiple`, at which `shape` (its seq_len set to T,
/// tokens_per_step to micro_batch x T) fits `gpu` by `plan_stage`; `None` when T = `multiple` does not.
/// Every memory term of the plan is non-decreasing in T, so the fitting T form a prefix of the
/// multiples: doubling finds a bound that does not fit, then a binary search (at most 2^20 multiples).
pub fn largest_fitting_tokens(
    arch: &Arch,
    shape: &StageShape,
    world: &World,
    gpu: &Gpu,
    multiple: usize,
) -> Option<usize> {
    let m = multiple.max(1);
    let fits = |k: usize| {
        let s = StageShape { seq_len: k * m, tokens_per_step: shape.micro_batch.max(1) * k * m, ..*shape };
        plan_stage(arch, &s, world, gpu).fits
    };
    if !fits(1) {
        return None;
    }
    // invariant: fits(lo), !fits(hi) (or hi past the cap)
    let (mut lo, mut hi) = (1usize, 2usize);
    while hi <= 1 << 20 && fits(hi) {
        lo = hi;
        hi *= 2;
    }
    if hi > 1 << 20 {
        return Some(lo * m);
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(lo * m)
}
