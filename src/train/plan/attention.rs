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
//! The non-obvious decision: the rate belongs to the device description (`Gpu::attention`), chosen from the
//! recipe's `[train] attention` before planning (`choose`), so the memory and time code read one value.
//! Not here: the rates of other head dims (taken as the head dim 128 figure) or of document masks (fewer
//! FLOPs at the same rate).
use super::inputs::{Arch, GpuKind, StageShape};
use crate::config::TrainAttention;
use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use std::path::Path;

/// FA2's published forward+backward rate on an A100 SXM (causal, D 128, bf16, long T), TFLOP/s.
pub const FA2_A100_TFLOPS: f64 = 185.0;
/// The same on an H100 SXM (and an H200: the same SMs and clocks), TFLOP/s.
pub const FA2_H100_TFLOPS: f64 = 335.0;
/// harpe's own kernels' forward+backward rate as a fraction of the dense bf16 peak (90 of an A100's 312).
pub const HARPE_PEAK_FRACTION: f64 = 90.0 / 312.0;

/// Which attention kernels the plan counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttnKernelKind {
    /// harpe's own (kernels/attention.cu, `ops::attention`)
    Harpe,
    /// FlashAttention-2's own forward and backward (`ops::flash2`)
    Flash2,
}

impl AttnKernelKind {
    pub fn name(&self) -> &'static str {
        match self {
            AttnKernelKind::Harpe => "harpe",
            AttnKernelKind::Flash2 => "flash2",
        }
    }

    /// The kernels a run with `[train] attention = want` trains a model of `head_dim` with: `auto` plans FA2's
    /// where they take the model (`flash16`: a 16-bit run of a build that has them), `flash2` and `harpe` as
    /// asked (`train` itself refuses flash2 where it cannot run).
    pub fn for_run(want: TrainAttention, flash16: bool, head_dim: usize) -> AttnKernelKind {
        let fits = flash16 && crate::ops::flash2::HEAD_DIMS.contains(&head_dim);
        match want {
            TrainAttention::Harpe => AttnKernelKind::Harpe,
            TrainAttention::Flash2 => AttnKernelKind::Flash2,
            TrainAttention::Auto if fits => AttnKernelKind::Flash2,
            TrainAttention::Auto => AttnKernelKind::Harpe,
        }
    }
}

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

/// The attention kernel of a plan and its forward+backward rate on one device.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AttentionRate {
    pub kernel: AttnKernelKind,
    /// causal forward+backward TFLOP/s of one device
    pub tflops: f64,
    /// where `tflops` comes from
    pub source: String,
}

impl AttentionRate {
    /// The prior rate of `kernel` on a device of `kind` with dense peak `peak` (TFLOP/s). On the CPU the
    /// attention runs at the same `mfu` of the peak as everything else.
    pub fn prior(kernel: AttnKernelKind, kind: GpuKind, peak: f64, mfu: f64) -> AttentionRate {
        let (tflops, source) = match (kernel, kind) {
            (_, GpuKind::Cpu) => (peak * mfu, "the CPU's peak x mfu, as the rest of the step".to_string()),
            (AttnKernelKind::Flash2, GpuKind::A100) => {
                (FA2_A100_TFLOPS, "FlashAttention-2's published A100 rate".into())
            }
            (AttnKernelKind::Flash2, GpuKind::H100 | GpuKind::H200) => {
                (FA2_H100_TFLOPS, "FlashAttention-2's published H100 rate".into())
            }
            (AttnKernelKind::Harpe, _) => (
                peak * HARPE_PEAK_FRACTION,
                format!("{:.0}% of peak, harpe's kernels by reading", 100.0 * HARPE_PEAK_FRACTION),
            ),
        };
        AttentionRate { kernel, tflops, source }
    }

    /// The measured rate of `kernel` in a `harpe bench attention --json` file: its forward+backward row
    /// of the longest T (the kv-head count closest to `arch`'s when both were measured).
    pub fn from_bench(path: &Path, kernel: AttnKernelKind, arch: &Arch) -> Result<AttentionRate> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "--attn-bench {}: cannot read it\nhint: write it with `harpe bench attention --json > FILE` on the GPU",
                path.display()
            )
        })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            anyhow!(
                "--attn-bench {}: not JSON ({e})\nhint: the file `harpe bench attention --json` prints",
                path.display()
            )
        })?;
        let rows = v.get("rows").and_then(|r| r.as_array()).ok_or_else(|| {
            anyhow!(
                "--attn-bench {}: no \"rows\" list\nhint: the file `harpe bench attention --json` prints",
                path.display()
            )
        })?;
        let field = |r: &serde_json::Value, k: &str| r.get(k).and_then(|x| x.as_f64());
        let best = rows
            .iter()
            .filter(|r| r.get("pass").and_then(|p| p.as_str()) == Some("fwd+bwd"))
            // rows of benches from before the kernel column are harpe's
            .filter(|r| r.get("kernel").and_then(|p| p.as_str()).unwrap_or("harpe") == kernel.name())
            .filter_map(|r| Some((field(r, "t")?, field(r, "hkv")?, field(r, "tflops")?)))
            .max_by(|a, b| {
                let key = |x: &(f64, f64, f64)| (x.0, -(x.1 - arch.kv_heads as f64).abs());
                key(a).partial_cmp(&key(b)).unwrap_or(std::cmp::Ordering::Equal)
            });
        let Some((t, hkv, tflops)) = best else {
            bail!("--attn-bench {}: no fwd+bwd row of the {} kernels\nhint: measure them with a build that has them (`--features flash-attn` for flash2)", path.display(), kernel.name());
        };
        let device = v.get("device").and_then(|d| d.as_str()).unwrap_or("?");
        let source = format!("measured on {device} at T {t}, Hkv {hkv} ({})", path.display());
        Ok(AttentionRate { kernel, tflops, source })
    }
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
    use super::*;

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
