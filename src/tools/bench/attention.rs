//! `harpe bench attention`: the flash-attention kernels (kernels/attention.cu, the tiles `ops::attention`
//! runs on CUDA) forward, backward and forward+backward at T = 8K, 32K, 128K (batch 1, 32 query heads, 8
//! and 32 kv heads, head dim 128, causal, bf16): time, TFLOP/s, percent of the GPU's dense bf16 peak, and
//! PyTorch's `scaled_dot_product_attention` with each backend it offers (flash, cuDNN, efficient) timed in
//! the same run by scripts/bench_attention_torch.py, with the ratio to the best backend (> 1: harpe faster).
//!
//! Reference: FlashAttention-2's benchmark conventions: forward FLOPs 4 B H T^2 D, halved for causal;
//! backward 2.5x the forward (five matmuls against two), forward+backward 3.5x.
//! The non-obvious decision: the rows time the launchers directly (`ops::attention_cuda::{fwd, bwd}`, the
//! tensor-core tiles for bf16), not the autograd op, so the numbers are the kernels' and compare to SDPA's
//! kernels; the op adds its one packing copy of q, O and dO (`Tensor::cat` in its backward). Repetitions adapt to the problem (at least one
//! timed call after one warm-up, about `--attn-seconds` per row; from T = 32K exactly one: a 128K backward
//! takes seconds, and a second call would only double a step's time for little precision).
//! Each row is printed (and flushed) as it is measured, so a run stopped by a time limit keeps its rows;
//! with torch the table is printed again at the end with the SDPA columns filled in.
//! With `--features flash-attn` the forward rows also time candle-flash-attn's FA2 forward on the same
//! q, k, v (`ops::candle_flash`, the autograd-free call the eval commands make), and rows of their own
//! (`fa2-fwd`, `fa2-bwd`, `fa2-fwd+bwd`, `"kernel": "flash2"` in JSON) time FlashAttention-2's own forward
//! and backward as training runs them (`ops::flash2` through autograd: its layout copies, and under GQA
//! the dK/dV group sum, included; bwd = fwd+bwd - fwd). `harpe plan --attn-bench` reads the JSON.
//! `--target emulated --profile` (`run_emulated`) runs no GPU: it measures the tensor-core kernels on the host
//! emulation (`ops::emu::profile`: sectors, bank conflicts, barriers, atomics, mma) with a roofline bound.
//! Does not: the decode (Tq < Tk) path, f16, or head dim 64 (the training case it measures is bf16 at Llama-2-7B's D = 128).
use super::BenchArgs;
use anyhow::Result;
use serde::Serialize;

/// One timed attention pass.
#[derive(Clone, Debug, Serialize)]
pub struct AttnRow {
    /// "harpe" (kernels/attention.cu's launchers) or "flash2" (FlashAttention-2's, through `ops::flash2`)
    pub kernel: String,
    pub pass: String,
    pub t: usize,
    pub hkv: usize,
    pub ms: f64,
    pub tflops: f64,
    /// percent of the dense bf16 peak, when the GPU is known
    pub pct_peak: Option<f64>,
    /// PyTorch SDPA per backend (ms), when measured; None where the backend refused the shape
    pub torch_ms: Vec<(String, Option<f64>)>,
    /// candle-flash-attn's forward (ms): forward rows of a --features flash-attn build
    pub candle_flash_ms: Option<f64>,
}

/// Causal FLOPs of one pass ("fwd", "bwd", "fwd+bwd") at (1, 32, T, 128).
pub fn flops(pass: &str, h: usize, t: usize, d: usize) -> f64 {
    let fwd = 4.0 * h as f64 * (t as f64) * (t as f64) * d as f64 / 2.0;
    match pass {
        "fwd" => fwd,
        "bwd" => 2.5 * fwd,
        _ => 3.5 * fwd,
    }
}

/// Dense bf16 tensor-core peak (TFLOP/s) of a compute capability: A100 312, H100/H200 SXM 989.
pub fn peak_tflops(cc: (i32, i32)) -> Option<f64> {
    match cc {
        (8, 0) => Some(312.0),
        (9, 0) => Some(989.0),
        _ => None,
    }
}

/// Print the rows as a table.
pub fn print_rows(device: &str, rows: &[AttnRow]) {
    print_header(device);
    for r in rows {
        print_row(r);
    }
}

/// The table's title and column line.
pub fn print_header(device: &str) {
    println!("harpe bench attention — {device}; B 1, H 32, D 128, causal, bf16 (tensor-core tiles)");
    println!(
        "{:<11} {:>7} {:>4} {:>10} {:>8} {:>6}  {:<44} {:>7} {:>10}",
        "pass",
        "T",
        "Hkv",
        "ms",
        "TFLOP/s",
        "%peak",
        "torch SDPA ms (flash / cudnn / efficient)",
        "x best",
        "cflash ms"
    );
    super::flush_stdout();
}

/// One line of the table, flushed (scripts/gpu-check.sh sizes its 128K step from the 32K lines: pass, T,
/// Hkv and ms are the first four fields).
pub fn print_row(r: &AttnRow) {
    let pct = r.pct_peak.map(|p| format!("{p:.0}%")).unwrap_or_else(|| "-".into());
    let torch: Vec<String> =
        r.torch_ms.iter().map(|(b, v)| format!("{b} {}", v.map(|x| format!("{x:.2}")).unwrap_or("-".into()))).collect();
    let best = r.torch_ms.iter().filter_map(|(_, v)| *v).fold(f64::INFINITY, f64::min);
    let x = if best.is_finite() { format!("{:.2}", best / r.ms) } else { "-".into() };
    let cf = r.candle_flash_ms.map(|x| format!("{x:.3}")).unwrap_or_else(|| "-".into());
    let pass = if r.kernel == "flash2" { format!("fa2-{}", r.pass) } else { r.pass.clone() };
    println!(
        "{:<11} {:>7} {:>4} {:>10.3} {:>8.1} {:>6}  {:<44} {:>7} {:>10}",
        pass,
        r.t,
        r.hkv,
        r.ms,
        r.tflops,
        pct,
        if torch.is_empty() { "-".into() } else { torch.join(" / ") },
        x,
        cf
    );
    super::flush_stdout();
}

/// PyTorch SDPA times from scripts/bench_attention_torch.py: {"<pass> T<t> hkv<hkv>": {backend: ms|null}}.
pub fn torch_sdpa(tokens: &[usize], seconds: f64) -> Option<serde_json::Value> {
    let t: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
    super::torch_script("bench_attention_torch.py", &["--tokens", &t.join(","), "--seconds", &seconds.to_string()])
}

/// One measured kernel launch of `harpe bench attention --target emulated --profile`.
#[derive(Clone, Debug, Serialize)]
pub struct ProfileRow {
    pub kernel: String,
    /// "B1 H2/2 T256 D128 causal"
    pub shape: String,
    pub global_sectors: u64,
    pub useful_bytes: u64,
    pub sector_efficiency: f64,
    pub bank_conflicts: u64,
    pub barriers: u64,
    pub atomics: u64,
    pub mma: u64,
    /// roofline bound of the pass's causal FLOPs: max(sector bytes / bandwidth, mma FLOPs / peak), per GPU
    pub predicted_tflops: PredictedTflops,
}

/// `ProfileRow::predicted_tflops` for the A100 (SXM 80 GB: 2.04 TB/s, 312 TFLOP/s bf16) and H100 (SXM:
/// 3.35 TB/s, 989 TFLOP/s).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct PredictedTflops {
    pub a100: f64,
    pub h100: f64,
}

/// FLOPs of one mma.sync m16n8k16 (a warp instruction).
const MMA_FLOPS: f64 = 2.0 * 16.0 * 8.0 * 16.0;

fn roofline(useful_flops: f64, p: &crate::ops::emu::profile::Profile) -> PredictedTflops {
    let at = |bw_tb_s: f64, peak_tflops: f64| {
        let s =
            (p.global_sectors as f64 * 32.0 / (bw_tb_s * 1e12)).max(p.mma as f64 * MMA_FLOPS / (peak_tflops * 1e12));
        if s > 0.0 {
            useful_flops / s / 1e12
        } else {
            0.0
        }
    };
    PredictedTflops { a100: at(2.04, 312.0), h100: at(3.35, 989.0) }
}

/// `harpe bench attention --target emulated --profile`: the tensor-core kernels (bf16) run once each on the
/// host emulation with measuring on, one row per kernel and shape. The shapes are small (the emulator runs a
/// thread per GPU thread); per-tile counts do not depend on T beyond the causal tile count.
pub fn run_emulated(args: &BenchArgs) -> Result<()> {
    use crate::ops::attention_shape::{AttnDims, AttnKernel, AttnMask};
    use crate::ops::emu::{attention as ka, profile};
    if !args.profile {
        anyhow::bail!(
            "harpe bench attention --target emulated only measures (it cannot time a GPU)\nhint: add --profile"
        );
    }
    let mut rows = vec![];
    for d in [128usize, 64] {
        let dims = AttnDims { b: 1, h: 2, hkv: 2, tq: 256, tk: 256, d };
        let n = dims.b * dims.h * dims.tq * d;
        let x: Vec<half::bf16> =
            (0..n).map(|i| half::bf16::from_f32(((i * 7919) % 997) as f32 / 997.0 - 0.5)).collect();
        // on a 128-byte boundary as on a GPU: a heap Vec 16 bytes past a sector boundary read 94 % (16/17)
        let xa = profile::Aligned::new(&x);
        let x: &[half::bf16] = &xa;
        let scale = 1.0 / (d as f32).sqrt();
        profile::reset();
        profile::enable(true);
        let run = (|| -> candle_core::Result<()> {
            let (o, lse) =
                ka::attention_fwd(AttnKernel::TensorCore, (x, x, x), dims, AttnMask::new(scale, true, None))?;
            ka::attention_bwd(
                AttnKernel::TensorCore,
                (x, x, x),
                (&o, &lse),
                x,
                dims,
                AttnMask::new(scale, true, None),
            )?;
            Ok(())
        })();
        profile::enable(false);
        run?;
        let shape = format!("B{} H{}/{} T{} D{d} causal", dims.b, dims.h, dims.hkv, dims.tq);
        let fwd = flops("fwd", dims.h, dims.tq, d);
        for (kernel, useful) in [
            (format!("attn_fwd_tc_bf16_d{d}"), fwd),
            ("attn_bwd_delta_bf16".to_string(), 0.0),
            (format!("attn_bwd_tc_bf16_d{d}"), 2.5 * fwd),
            ("attn_dq_convert_bf16".to_string(), 0.0),
        ] {
            let Some(p) = profile::get(&kernel) else { anyhow::bail!("{kernel} did not run while measuring") };
            rows.push(ProfileRow {
                kernel,
                shape: shape.clone(),
                global_sectors: p.global_sectors,
                useful_bytes: p.useful_bytes,
                sector_efficiency: p.sector_efficiency(),
                bank_conflicts: p.bank_conflicts,
                barriers: p.barriers,
                atomics: p.atomics,
                mma: p.mma,
                predicted_tflops: roofline(useful, &p),
            });
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!("harpe bench attention --target emulated --profile (measured accesses only: copy16/cp.async tiles, gld/gst sites, ldmatrix, mma)");
    println!(
        "{:<24} {:<24} {:>9} {:>10} {:>6} {:>9} {:>8} {:>8} {:>8} {:>12}",
        "kernel", "shape", "sectors", "useful B", "eff", "conflicts", "barriers", "atomics", "mma", "TF A100/H100"
    );
    for r in &rows {
        println!(
            "{:<24} {:<24} {:>9} {:>10} {:>5.0}% {:>9} {:>8} {:>8} {:>8} {:>5.0}/{:<6.0}",
            r.kernel,
            r.shape,
            r.global_sectors,
            r.useful_bytes,
            100.0 * r.sector_efficiency,
            r.bank_conflicts,
            r.barriers,
            r.atomics,
            r.mma,
            r.predicted_tflops.a100,
            r.predicted_tflops.h100
        );
    }
    Ok(())
}

/// `harpe bench attention`.
pub fn run(args: &BenchArgs) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        gpu::run(args)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = args;
        anyhow::bail!("harpe bench attention times the CUDA kernels, and this harpe was built without CUDA\nhint: build with --features cuda")
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::{flops, peak_tflops, print_header, print_row, print_rows, torch_sdpa, AttnRow, BenchArgs};
    use crate::ops::attention_cuda::{bwd, fwd};
    use crate::ops::attention_shape::AttnMask;
    use anyhow::{bail, Result};
    use candle_core::{DType, Device, Storage, Tensor, Var};
    use std::time::Instant;

    /// From this T on, a row is one warm-up and one timed call.
    const LONG_T: usize = 32768;

    /// Mean ms of `f`: one warm-up, then as many calls as fit in about `seconds` (at least one; exactly
    /// one at T >= `LONG_T`).
    fn time(dev: &Device, t: usize, seconds: f64, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        f()?;
        dev.synchronize()?;
        let t0 = Instant::now();
        f()?;
        dev.synchronize()?;
        let once = t0.elapsed().as_secs_f64();
        if t >= LONG_T {
            return Ok(once * 1e3);
        }
        let n = ((seconds / once.max(1e-6)) as usize).clamp(1, 50);
        let t0 = Instant::now();
        for _ in 0..n {
            f()?;
        }
        dev.synchronize()?;
        Ok(t0.elapsed().as_secs_f64() * 1e3 / n as f64)
    }

    pub fn run(args: &BenchArgs) -> Result<()> {
        let dev = crate::tools::selftest::open_cuda()?;
        let cd = dev.as_cuda_device()?.clone();
        let ctx = cd.cuda_stream().context().clone();
        let name = ctx.name().unwrap_or_else(|_| "CUDA device 0".into());
        let peak = ctx.compute_capability().ok().and_then(peak_tflops);
        let tokens = args.attn_tokens.clone();
        let mut rows = Vec::new();
        if !args.json {
            print_header(&name);
        }
        let mut done = |r: &AttnRow| {
            if !args.json {
                print_row(r);
            }
        };
        for &t in &tokens {
            for hkv in [8usize, 32] {
                let sh = Shape { t, hkv, h: 32, d: 128 };
                rows.extend(measure_shape(&dev, sh, args.attn_seconds, peak, &mut done)?);
            }
        }
        if !args.no_torch {
            add_torch_columns(&mut rows, &tokens, args.attn_seconds);
            if !args.json && rows.iter().any(|r| !r.torch_ms.is_empty()) {
                println!();
                print_rows(&name, &rows);
            }
        }
        if args.json {
            println!("{}", serde_json::json!({"device": name, "peak_bf16_tflops": peak, "rows": rows}));
        }
        Ok(())
    }

    /// One benchmark shape: batch 1, `h` query heads over `hkv` kv heads, T tokens, head dim `d`.
    #[derive(Clone, Copy)]
    struct Shape {
        t: usize,
        hkv: usize,
        h: usize,
        d: usize,
    }

    /// harpe's fwd, bwd and fwd+bwd (and candle-flash-attn's forward where built) on one causal bf16 shape;
    /// `done` sees each row as soon as it is timed.
    fn measure_shape(
        dev: &Device,
        sh: Shape,
        seconds: f64,
        peak: Option<f64>,
        done: &mut dyn FnMut(&AttnRow),
    ) -> Result<Vec<AttnRow>> {
        let Shape { t, hkv, h, d } = sh;
        let scale = 1.0 / (d as f32).sqrt();
        let mk = |heads: usize| -> Result<Tensor> {
            Ok(Tensor::randn(0f32, 1.0, (1, heads, t, d), dev)?.to_dtype(DType::BF16)?)
        };
        let (q, k, v, dout) = (mk(h)?, mk(hkv)?, mk(hkv)?, mk(h)?);
        let fa2 =
            if cfg!(feature = "flash-attn") { Some(time_flash2(dev, sh, seconds, (&q, &k, &v, &dout))?) } else { None };
        // candle-flash-attn's forward on the same q, k, v (before the storage guards below)
        let cf_ms = cfg!(feature = "flash-attn")
            .then(|| {
                time(dev, t, seconds, || Ok(crate::ops::candle_flash::attention(&q, &k, &v, scale, true).map(|_| ())?))
            })
            .transpose()?;
        let (sq, lq) = q.storage_and_layout();
        let (sk, lk) = k.storage_and_layout();
        let (sv, lv) = v.storage_and_layout();
        let (sd, ld) = dout.storage_and_layout();
        let (Storage::Cuda(cq), Storage::Cuda(ck), Storage::Cuda(cv), Storage::Cuda(cdo)) = (&*sq, &*sk, &*sv, &*sd)
        else {
            bail!("bench attention: tensors are not on the CUDA device");
        };
        let (q, k, v, dout, mask) = ((cq, lq), (ck, lk), (cv, lv), (cdo, ld), AttnMask::new(scale, true, None));
        let (o, lse, kernel) = fwd(q, k, v, mask, None)?;
        let lo = candle_core::Layout::contiguous((1, h, t, d));
        let mut rows = Vec::new();
        let mut emit = |pass: &str, ms: f64| {
            let tflops = flops(pass, h, t, d) / (ms * 1e-3) / 1e12;
            let r = AttnRow {
                kernel: "harpe".into(),
                pass: pass.into(),
                t,
                hkv,
                ms,
                tflops,
                pct_peak: peak.map(|p| 100.0 * tflops / p),
                torch_ms: Vec::new(),
                candle_flash_ms: if pass == "fwd" { cf_ms } else { None },
            };
            done(&r);
            rows.push(r);
        };
        emit("fwd", time(dev, t, seconds, || Ok(fwd(q, k, v, mask, None).map(|_| ())?))?);
        emit("bwd", time(dev, t, seconds, || Ok(bwd(q, k, v, ((&o, &lo), &lse), dout, mask, None).map(|_| ())?))?);
        emit(
            "fwd+bwd",
            time(dev, t, seconds, || {
                let (o2, lse2, _) = fwd(q, k, v, mask, None)?;
                Ok(bwd(q, k, v, ((&o2, &lo), &lse2), dout, mask, None).map(|_| ())?)
            })?,
        );
        if let Some((f, fb)) = fa2 {
            for (pass, ms) in [("fwd", f), ("bwd", fb - f), ("fwd+bwd", fb)] {
                let tflops = flops(pass, h, t, d) / (ms * 1e-3) / 1e12;
                let r = AttnRow {
                    kernel: "flash2".into(),
                    pass: pass.into(),
                    t,
                    hkv,
                    ms,
                    tflops,
                    pct_peak: peak.map(|p| 100.0 * tflops / p),
                    torch_ms: Vec::new(),
                    candle_flash_ms: None,
                };
                done(&r);
                rows.push(r);
            }
        }
        eprintln!("bench attention: T {t} Hkv {hkv}: {kernel:?} tiles");
        Ok(rows)
    }

    /// FlashAttention-2's (forward ms, forward+backward ms) through `ops::flash2` with autograd, dO as the
    /// upstream gradient.
    fn time_flash2(
        dev: &Device,
        sh: Shape,
        seconds: f64,
        (q, k, v, dout): (&Tensor, &Tensor, &Tensor, &Tensor),
    ) -> Result<(f64, f64)> {
        let scale = 1.0 / (sh.d as f32).sqrt();
        let (qv, kv, vv) = (Var::from_tensor(q)?, Var::from_tensor(k)?, Var::from_tensor(v)?);
        let fwd = || -> Result<Tensor> {
            Ok(crate::ops::flash2::attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), scale, None)?)
        };
        let f = time(dev, sh.t, seconds, || fwd().map(|_| ()))?;
        let fb = time(dev, sh.t, seconds, || {
            (fwd()? * dout)?.sum_all()?.backward()?;
            Ok(())
        })?;
        Ok((f, fb))
    }

    /// PyTorch SDPA's backends beside each row, where torch runs.
    fn add_torch_columns(rows: &mut [AttnRow], tokens: &[usize], seconds: f64) {
        let Some(tj) = torch_sdpa(tokens, seconds) else {
            return;
        };
        for r in rows.iter_mut() {
            let key = format!("{} T{} hkv{}", r.pass, r.t, r.hkv);
            if let Some(obj) = tj.get(&key).and_then(|v| v.as_object()) {
                r.torch_ms = ["flash", "cudnn", "efficient"]
                    .iter()
                    .map(|b| (b.to_string(), obj.get(*b).and_then(|v| v.as_f64())))
                    .collect();
            }
        }
    }
}
