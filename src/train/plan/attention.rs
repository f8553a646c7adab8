//! The attention kernel a planned run trains with: its causal forward+backward rate (the step time's
//! attention FLOPs run at it, the rest at `Gpu::mfu` of the peak) and its backward workspace (one layer's at a
//! time, on GPUs).
//!
//! Reference: FlashAttention-2 (Dao 2023) and its repository's published benchmarks, forward+backward, causal,
//! head dim 128, 16-bit, long sequences: about 185 TFLOP/s on an A100 SXM (the paper's 180-190 band) and up
//! to 335 TFLOP/s on an H100 SXM (the paper's Hopper figure, unchanged code); harpe's own kernels
//! (kernels/attention.cu) by a line-by-line reading of their backward: shared-memory bound at about 90 TFLOP/s on
//! an A100, taken as the same 29% of the tensor-core peak elsewhere. These are priors: `harpe bench attention
//! --json` measures the rate on the machine, and `harpe plan --attn-bench FILE` replaces the prior with it.
//! The non-obvious decision: the rate belongs to the device description (`Gpu::attention`; the kind and rate
//! types live in `inputs.rs` beside it), chosen from the recipe's `[train] attention` before planning
//! (`for_run`), so the memory and time code read one value.
//! Not here: the rates of other head dims (taken as the head dim 128 figure) or of document masks (fewer
//! FLOPs at the same rate).
use super::inputs::{Arch, AttentionRate, AttnKernelKind, StageShape};
use anyhow::Result;
use std::path::Path;

/// `gpu` running the attention a run of `cfg` trains `arch` with (`[train] attention`; `flash_built`: whether
/// the run's build has FA2's kernels), at the prior rate, or at the one measured in `bench` when given.
pub fn for_run(
    cfg: &crate::config::RunConfig,
    arch: &Arch,
    gpu: super::Gpu,
    flash_built: bool,
    bench: Option<&Path>,
) -> Result<super::Gpu> {
    let sixteen = !matches!(cfg.train.dtype, crate::device::ComputeDtype::F32);
    let kernel = AttnKernelKind::for_run(cfg.train.attention, sixteen && flash_built, arch.head_dim);
    let mut gpu = gpu.with_attention_prior(kernel);
    if let Some(p) = bench {
        gpu.attention = AttentionRate::from_bench(p, kernel, arch)?;
    }
    Ok(gpu)
}

/// One layer's attention backward workspace on a GPU (bytes) and its note, for `kernel` at `shape` with `heads`
/// query and `kv_heads` kv heads (Ulysses: this rank's share of the heads over the whole sequence) and `wb`
/// bytes per element.
pub fn workspace(
    kernel: AttnKernelKind,
    arch: &Arch,
    shape: &StageShape,
    (heads, kv_heads): (usize, usize),
    wb: f64,
) -> (f64, String) {
    let gib = |b: f64| b / super::GIB;
    let (b, t, d) = (shape.micro_batch, shape.seq_len, arch.head_dim);
    match kernel {
        AttnKernelKind::Harpe => {
            let dims = crate::ops::attention_shape::AttnDims { b, h: heads, hkv: kv_heads, tq: t, tk: t, d };
            let aw = crate::ops::attention_shape::attention_workspace(dims, wb as usize);
            let note = format!(
                "one layer's attention backward (harpe's kernels): packed [q|O|lse|dO] rows {:.2} GiB + f32 delta and dQ accumulator {:.2} GiB",
                gib(aw.bwd_packed as f64),
                gib(aw.bwd_scratch as f64)
            );
            (aw.total() as f64, note)
        }
        AttnKernelKind::Flash2 => {
            let s = crate::ops::flash2_params::Fa2Shape {
                b,
                h: heads,
                hkv: kv_heads,
                d,
                max_seqlen: t,
                total: b * t,
                varlen: false,
                causal: true,
                scale: 1.0,
                is_bf16: true,
            };
            let ws = s.workspace();
            let scratch = 4.0 * (ws.dq_accum + ws.softmax_d) as f64;
            // dO made contiguous, and dK, dV per query head under GQA before their group sum
            let dout = (b * t * heads * d) as f64 * wb;
            let dkv = 2.0 * ws.dkv_expanded as f64 * wb;
            let note = format!(
                "one layer's attention backward (FlashAttention-2): f32 dq_accum + softmax_d {:.2} GiB, dO {:.2} GiB, dK/dV per query head (GQA) {:.2} GiB",
                gib(scratch),
                gib(dout),
                gib(dkv)
            );
            (scratch + dout + dkv, note)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::inputs::{GpuKind, FA2_A100_TFLOPS, FA2_H100_TFLOPS};
    use super::*;
    use crate::config::TrainAttention;

    #[test]
    fn priors_by_kernel_and_device() {
        let a = AttentionRate::prior(AttnKernelKind::Flash2, GpuKind::A100, 312.0, 0.4);
        assert_eq!(a.tflops, FA2_A100_TFLOPS);
        let h = AttentionRate::prior(AttnKernelKind::Flash2, GpuKind::H200, 989.0, 0.4);
        assert_eq!(h.tflops, FA2_H100_TFLOPS);
        let o = AttentionRate::prior(AttnKernelKind::Harpe, GpuKind::A100, 312.0, 0.4);
        assert!((o.tflops - 90.0).abs() < 1e-9);
        let c = AttentionRate::prior(AttnKernelKind::Flash2, GpuKind::Cpu, 0.05, 0.5);
        assert!((c.tflops - 0.025).abs() < 1e-12);
    }

    #[test]
    fn auto_plans_flash2_where_it_takes_the_model() {
        assert_eq!(AttnKernelKind::for_run(TrainAttention::Auto, true, 128), AttnKernelKind::Flash2);
        assert_eq!(AttnKernelKind::for_run(TrainAttention::Auto, true, 96), AttnKernelKind::Harpe);
        assert_eq!(AttnKernelKind::for_run(TrainAttention::Auto, false, 128), AttnKernelKind::Harpe);
        assert_eq!(AttnKernelKind::for_run(TrainAttention::Harpe, true, 128), AttnKernelKind::Harpe);
    }

    #[test]
    fn a_bench_file_gives_the_longest_rows_rate() {
        let dir = std::env::temp_dir().join(format!("harpe-attn-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("bench.json");
        let rows = r#"{"device": "NVIDIA A100-SXM4-80GB", "rows": [
            {"pass": "fwd+bwd", "t": 8192, "hkv": 8, "ms": 1.0, "tflops": 150.0, "kernel": "flash2"},
            {"pass": "fwd+bwd", "t": 32768, "hkv": 32, "ms": 1.0, "tflops": 171.0, "kernel": "flash2"},
            {"pass": "fwd+bwd", "t": 32768, "hkv": 8, "ms": 1.0, "tflops": 175.0, "kernel": "flash2"},
            {"pass": "fwd", "t": 131072, "hkv": 8, "ms": 1.0, "tflops": 200.0, "kernel": "flash2"},
            {"pass": "fwd+bwd", "t": 131072, "hkv": 8, "ms": 1.0, "tflops": 88.0}]}"#;
        std::fs::write(&p, rows).unwrap();
        let arch = Arch {
            params: 0,
            vocab: 0,
            hidden: 4096,
            intermediate: 0,
            layers: 1,
            heads: 32,
            kv_heads: 32,
            head_dim: 128,
            tied: false,
            rope_rows: 1,
            rope_tables: 1,
        };
        let r = AttentionRate::from_bench(&p, AttnKernelKind::Flash2, &arch).unwrap();
        assert_eq!(r.tflops, 171.0, "the longest T, the kv heads of the model");
        assert!(r.source.contains("A100") && r.source.contains("T 32768"), "{}", r.source);
        // a row without a kernel column is harpe's
        assert_eq!(AttentionRate::from_bench(&p, AttnKernelKind::Harpe, &arch).unwrap().tflops, 88.0);
        std::fs::write(&p, r#"{"rows": []}"#).unwrap();
        let e = AttentionRate::from_bench(&p, AttnKernelKind::Flash2, &arch).unwrap_err().to_string();
        assert!(e.contains("no fwd+bwd row of the flash2 kernels") && e.contains("hint:"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
