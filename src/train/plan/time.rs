//! The time side of a plan: FLOPs per token with recompute at the stated MFU (the attention's at its
//! kernel's rate, `attention.rs`), ZeRO's and Ulysses' collectives over the interconnect, and how long a checkpointed stop takes (the warning a scheduler
//! must give). Apart from the memory terms (`memory.rs`), whose `Sizes` it reads.
use super::inputs::{Arch, Gpu, StageShape, World};
use super::memory::Sizes;
use crate::config::{Checkpointing, ZeroStage};
use serde::Serialize;

/// The time side of a plan.
pub(super) struct StepTime {
    pub(super) flops_per_token: f64,
    pub(super) hw_flops_per_token: f64,
    pub(super) compute_s: f64,
    pub(super) zero_comm_bytes: f64,
    pub(super) zero_comm_s: f64,
    pub(super) sp_comm_bytes: f64,
    pub(super) sp_comm_s: f64,
    pub(super) step_time_s: f64,
}

/// FLOPs with recompute at the stated MFU and the attention's at its kernel's rate; collectives over the
/// interconnect.
pub(super) fn step_time(sz: &Sizes, arch: &Arch, shape: &StageShape, world: &World, gpu: &Gpu) -> StepTime {
    let (n, w, p, l, wb, gb, tl) = (sz.n, sz.w, sz.p, sz.l, sz.wb, sz.gb, sz.tl);
    let flops_per_token = crate::model::flops_per_token(arch.params as usize, l, arch.hidden, shape.seq_len);
    let recomputed = if matches!(shape.checkpointing, Checkpointing::None) { 0 } else { l - sz.last_seg };
    // Executed FLOPs: causal flash attention skips the masked half of 12·L·C·T; recompute repeats the
    // forward (a third) of the recomputed layers.
    let executed = flops_per_token - 6.0 * (l * arch.hidden * shape.seq_len) as f64;
    let recompute = 1.0 + recomputed as f64 / l as f64 / 3.0;
    let hw_flops_per_token = executed * recompute;
    let tokens = shape.tokens_per_step as f64;
    // The causal attention's share of those FLOPs (6·L·C·T, recompute included) runs at its kernel's rate
    // (`Gpu::attention`), the rest at mfu of the peak. Attention rates are stated in FlashAttention's count
    // (causal forward 2·C·T per token and layer, backward 2.5x the forward), so its time is that count over
    // the rate: 3.5 forwards per layer plus one per recomputed layer.
    let lct = (l * arch.hidden * shape.seq_len) as f64;
    let attn_share = 6.0 * lct * recompute;
    let attn_rated = 2.0 * lct * (3.5 + recomputed as f64 / l as f64);
    let compute_s = tokens * (hw_flops_per_token - attn_share) / (w * gpu.peak_tflops * 1e12 * gpu.mfu)
        + tokens * attn_rated / (w * gpu.attention.tflops * 1e12);
    let accum = (tokens / (shape.micro_batch * shape.seq_len) as f64 * p as f64 / w).max(1.0); // per rank
    let ring = (w - 1.0) / w;
    let zero_comm_bytes = if world.gpus > 1 {
        ring * n
            * match sz.z {
                ZeroStage::Replicated => 2.0 * gb,
                ZeroStage::Optimizer => gb + wb,
                ZeroStage::Gradients => gb * accum + wb,
                ZeroStage::Parameters => (2.0 * wb + gb) * accum,
            }
    } else {
        0.0
    };
    let passes = if recomputed > 0 { 3.0 } else { 2.0 };
    let sp_comm_bytes = if p > 1 {
        (p as f64 - 1.0) / p as f64 * tl * (sz.hd + 2.0 * sz.kvd + sz.hd) * wb * l as f64 * passes * accum
    } else {
        0.0
    };
    let bus = |gbs: f64| gbs * 1e9;
    let intra = bus(gpu.link_gbs / 2.0 * 0.8);
    let zero_bw = if world.gpus > gpu.gpus_per_node { bus(gpu.inter_node_gbs * 0.8) } else { intra };
    let zero_comm_s = if zero_comm_bytes > 0.0 { zero_comm_bytes / zero_bw } else { 0.0 };
    let sp_comm_s = if sp_comm_bytes > 0.0 { sp_comm_bytes / intra } else { 0.0 };
    StepTime {
        flops_per_token,
        hw_flops_per_token,
        compute_s,
        zero_comm_bytes,
        zero_comm_s,
        sp_comm_bytes,
        sp_comm_s,
        step_time_s: compute_s.max(zero_comm_s) + sp_comm_s,
    }
}

/// Write rate of one process to the run directory's file system assumed for checkpoints, GB/s: a
/// conservative figure for a cluster's parallel file system under 16 concurrent writers (a local NVMe
/// writes 2-5 GB/s).
pub const CHECKPOINT_WRITE_GBS: f64 = 1.0;

/// How long a checkpointed stop takes, for a scheduler's advance warning (Slurm's `--signal=TERM@N`).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct CheckpointTime {
    /// rank 0's bytes: its fp32 master + AdamW m, v shard (12 bytes a parameter over the ranks), then the
    /// HF weights in the compute dtype, which rank 0 writes alone after every shard is on disk
    pub rank0_bytes: f64,
    /// rank 0's bytes at `CHECKPOINT_WRITE_GBS`, seconds
    pub write_s: f64,
    /// warning a stop needs: the signal lands mid-step, the stop is agreed at the end of the next step
    /// (up to 2 steps), then the save; plus a quarter for error, rounded up to whole minutes
    pub stop_lead_s: u64,
}

impl CheckpointTime {
    pub(super) fn of(arch: &Arch, shape: &StageShape, world: &World, step_s: f64) -> CheckpointTime {
        let params = arch.params as f64;
        let weight_bytes = if shape.bf16 { 2.0 } else { 4.0 };
        let rank0_bytes = params * 12.0 / world.gpus.max(1) as f64 + params * weight_bytes;
        let write_s = rank0_bytes / (CHECKPOINT_WRITE_GBS * 1e9);
        // f64 to u64 saturates, so a step time the plan cannot bound (infinite) stays a number
        let stop_lead_s = (((2.0 * step_s + write_s) * 1.25 / 60.0).ceil() * 60.0) as u64;
        CheckpointTime { rank0_bytes, write_s, stop_lead_s }
    }
}
