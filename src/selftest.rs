//! `harpe selftest`: every harpe kernel against its CPU reference on fresh random ragged inputs, forward
//! and backward, f32 and bf16; a PASS/FAIL table with the errors; exit code 1 on any FAIL.
//!
//! Reference: ggml `test-backend-ops` and flash-attention's tests (one harness, every op, a bf16 bound of
//! "at most 2x the error of a naive bf16 implementation"). Targets: `cuda` (the PTX kernels through the
//! ops the model calls, on the GPU) and `emulated` (the same kernel source compiled for the host against
//! kernels/emu.h — what a CPU build runs, and what `cargo test` checks).
//! Bounds: f32 — max |kernel - reference| <= tol * max(1, max |reference|) with tol 1e-5 (1e-6 for
//! AdamW); bf16 — the exact result is the f32 reference on the same bf16-rounded inputs, and the kernel's
//! max error must be at most twice that of a naive bf16 implementation (every intermediate rounded to
//! bf16), which is also computed here. Sizes are drawn per run (seeded) and are never multiples of 32.
//! Not done here: the CPU-vs-GPU training run (it needs the device-resident training state, a later
//! issue), timing (`harpe bench`).
pub mod attention;
pub mod candle_flash;

use crate::kernels_emu::{self as emu, Dims};
use crate::model::rope::{RopeParity, RopeScheme};
use crate::ops::cross_entropy_chunk::ce_rows_cpu;
use crate::ops::rms_norm::{rms_norm_bwd_cpu, rms_norm_cpu};
use crate::ops::rotary::rotary_cpu;
use crate::optim::adamw::{AdamW, AdamWHyper};
use crate::train::loss::IGNORE_INDEX;
use anyhow::{bail, Result};
use candle_core::Device;
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// Where the kernels run.
#[derive(Clone, Debug)]
pub enum Target {
    /// the kernels' source compiled for the host (kernels/emu.h)
    Emulated,
    /// the PTX kernels on a CUDA device
    Cuda(Device),
}

impl Target {
    fn name(&self) -> &'static str {
        match self {
            Target::Emulated => "emulated",
            Target::Cuda(_) => "cuda",
        }
    }
}

/// Storage dtype of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dt {
    F32,
    Bf16,
    /// only the attention kernels are instantiated for f16 (`selftest::attention`)
    F16,
}

impl Dt {
    /// The candle dtype the GPU rows upload in.
    #[cfg(feature = "cuda")]
    fn dtype(self) -> candle_core::DType {
        match self {
            Dt::F32 => candle_core::DType::F32,
            Dt::Bf16 => candle_core::DType::BF16,
            Dt::F16 => candle_core::DType::F16,
        }
    }
}

impl Dt {
    fn name(self) -> &'static str {
        match self {
            Dt::F32 => "f32",
            Dt::Bf16 => "bf16",
            Dt::F16 => "f16",
        }
    }
}

/// One comparison: a kernel output against its reference.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub kernel: String,
    pub case: String,
    pub dtype: Dt,
    pub max_err: f64,
    /// the bound max_err must not exceed
    pub bound: f64,
    /// how the bound was set
    pub rule: &'static str,
    pub pass: bool,
}

fn r16(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).abs()).fold(0.0, |m, d| {
        if d.is_nan() {
            f64::INFINITY
        } else {
            m.max(d)
        }
    })
}

fn max_abs(a: &[f32]) -> f64 {
    a.iter().map(|x| x.abs() as f64).fold(0.0, f64::max)
}

/// A check of `got` against `exact`; for bf16 the bound is 2x the naive implementation's error.
fn check(kernel: &str, case: String, dt: Dt, got: &[f32], exact: &[f32], naive: Option<&[f32]>, tol: f64) -> Check {
    let max_err = max_abs_diff(got, exact);
    let (bound, rule) = match (dt, naive) {
        (Dt::Bf16, Some(nv)) => (2.0 * max_abs_diff(nv, exact).max(1e-30), "<= 2x naive bf16"),
        (Dt::F16, Some(nv)) => (2.0 * max_abs_diff(nv, exact).max(1e-30), "<= 2x naive f16"),
        _ => (tol * max_abs(exact).max(1.0), "f32 tolerance"),
    };
    Check { kernel: kernel.into(), case, dtype: dt, max_err, bound, rule, pass: max_err <= bound }
}

fn uniform(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (r.random::<f32>() * 2.0 - 1.0) * scale).collect()
}

/// Round to the case's dtype (the values the kernel will see).
fn as_dt(v: Vec<f32>, dt: Dt) -> Vec<f32> {
    match dt {
        Dt::F32 => v,
        Dt::Bf16 => v.into_iter().map(r16).collect(),
        Dt::F16 => v.into_iter().map(|x| half::f16::from_f32(x).to_f32()).collect(),
    }
}

/// An odd size in lo..hi that is not a multiple of 32.
fn ragged(r: &mut ChaCha8Rng, lo: usize, hi: usize) -> usize {
    loop {
        let n = r.random_range(lo..hi);
        if !n.is_multiple_of(32) {
            return n;
        }
    }
}

/// A launch for the emulator: fewer blocks than rows, so grid-stride loops are exercised.
fn emu_dims(r: &mut ChaCha8Rng) -> Dims {
    Dims { grid: r.random_range(1..4), block: [32, 64, 96][r.random_range(0..3)] }
}

macro_rules! by_dtype {
    ($dt:expr, |$t:ident| $body:expr) => {
        match $dt {
            Dt::F32 => {
                type $t = f32;
                $body
            }
            Dt::Bf16 => {
                type $t = bf16;
                $body
            }
            Dt::F16 => bail!("selftest: only the attention kernels are instantiated for f16"),
        }
    };
}

fn to_t<T: emu::EmuFloat>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}
fn of_t<T: emu::EmuFloat>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// Every check on `target` with inputs drawn from `seed`.
pub fn run_all(target: &Target, seed: u64) -> Result<Vec<Check>> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    for dt in [Dt::F32, Dt::Bf16] {
        out.extend(rope_checks(target, dt, &mut r)?);
        out.extend(rms_norm_checks(target, dt, &mut r)?);
        out.extend(cross_entropy_checks(target, dt, &mut r)?);
        out.extend(adamw_checks(target, dt, &mut r)?);
    }
    out.extend(attention::checks(target, &mut r)?);
    out.extend(candle_flash::checks(target, &mut r)?);
    Ok(out)
}

/// RoPE forward and backward with HARPE tables (one row set per kv head, GQA sharing).
pub fn rope_checks(target: &Target, dt: Dt, r: &mut ChaCha8Rng) -> Result<Vec<Check>> {
    let big = matches!(target, Target::Cuda(_));
    let htab = r.random_range(1..4);
    let h = htab * r.random_range(1..4);
    let (b, t) = (r.random_range(1..3), ragged(r, 3, if big { 700 } else { 40 }));
    let d = 2 * r.random_range(3..if big { 70 } else { 20 });
    let bases: Vec<f64> = (0..htab).map(|i| 1e4 * 10f64.powi(i as i32)).collect();
    let scheme = if htab == 1 {
        RopeScheme::Default { theta: bases[0] }
    } else {
        RopeScheme::Harpe { head_bases: bases, layer_head_bases: None }
    };
    let start = r.random_range(0..200_000);
    let at = crate::model::rope::Positions::new(start, t);
    let tab = scheme.tables(d, 0, at, RopeParity::F64, &Device::Cpu)?;
    let cos = tab.cos.flatten_all()?.to_vec1::<f32>()?;
    let sin = tab.sin.flatten_all()?.to_vec1::<f32>()?;
    let nsin: Vec<f32> = sin.iter().map(|s| -s).collect();
    let x = as_dt(uniform(r, b * h * t * d, 1.0), dt);
    let dy = as_dt(uniform(r, b * h * t * d, 1.0), dt);
    let shape = (b, h, t, d);
    let (y, dx) = match target {
        Target::Emulated => {
            let dims = emu_dims(r);
            by_dtype!(dt, |T| (
                of_t(&emu::rope::<T>(&to_t::<T>(&x), &cos, &sin, shape, htab, 1.0, dims)?),
                of_t(&emu::rope::<T>(&to_t::<T>(&dy), &cos, &sin, shape, htab, -1.0, dims)?)
            ))
        }
        Target::Cuda(dev) => cuda_run::rope(dev, dt, &x, &dy, &tab.cos, &tab.sin, shape)?,
    };
    let naive = |inp: &[f32], s: &[f32]| -> Vec<f32> {
        let half = d / 2;
        let rep = h / htab;
        let mut o = vec![0f32; inp.len()];
        for row in 0..b * h * t {
            let (ti, hi) = (row % t, (row / t) % h);
            let tr = ((hi / rep) * t + ti) * half;
            for j in 0..half {
                let (c, sn) = (r16(cos[tr + j]), r16(s[tr + j]));
                let (x1, x2) = (inp[row * d + j], inp[row * d + j + half]);
                o[row * d + j] = r16(r16(x1 * c) - r16(x2 * sn));
                o[row * d + j + half] = r16(r16(x2 * c) + r16(x1 * sn));
            }
        }
        o
    };
    let case = format!("B{b} H{h} Htab{htab} T{t} D{d} pos{start}");
    let y_ref = rotary_cpu(&x, &cos, &sin, shape, htab);
    let dx_ref = rotary_cpu(&dy, &cos, &nsin, shape, htab);
    Ok(vec![
        check("rope fwd", case.clone(), dt, &y, &y_ref, Some(&naive(&x, &sin)), 1e-5),
        check("rope bwd", case, dt, &dx, &dx_ref, Some(&naive(&dy, &nsin)), 1e-5),
    ])
}

/// RMSNorm forward (y) and backward (dx, dw).
pub fn rms_norm_checks(target: &Target, dt: Dt, r: &mut ChaCha8Rng) -> Result<Vec<Check>> {
    let big = matches!(target, Target::Cuda(_));
    let n = ragged(r, 2, if big { 300 } else { 12 });
    let c = ragged(r, 5, if big { 5000 } else { 200 });
    let eps = 1e-5f32;
    let x = as_dt(uniform(r, n * c, 2.0), dt);
    let w = as_dt(uniform(r, c, 1.5), dt);
    let dy = as_dt(uniform(r, n * c, 1.0), dt);
    let (y, dx, dw) = match target {
        Target::Emulated => {
            let dims = emu_dims(r);
            by_dtype!(dt, |T| {
                let (xt, wt, dyt) = (to_t::<T>(&x), to_t::<T>(&w), to_t::<T>(&dy));
                let (y, rstd) = emu::rms_norm_fwd::<T>(&xt, &wt, (n, c), eps, dims)?;
                // once with the forward's rstd, once recomputing it: both must agree
                let (dx, dw) = emu::rms_norm_bwd::<T>(&dyt, &xt, &wt, Some(&rstd), (n, c), eps, dims)?;
                let (dx2, dw2) = emu::rms_norm_bwd::<T>(&dyt, &xt, &wt, None, (n, c), eps, dims)?;
                if of_t(&dx) != of_t(&dx2) || of_t(&dw) != of_t(&dw2) {
                    bail!("rms_norm backward: saved and recomputed rstd give different gradients");
                }
                (of_t(&y), of_t(&dx), of_t(&dw))
            })
        }
        Target::Cuda(dev) => cuda_run::rms_norm(dev, dt, &x, &w, &dy, (n, c), eps)?,
    };
    let (y_ref, _) = rms_norm_cpu(&x, &w, c, eps);
    let (dx_ref, dw_ref) = rms_norm_bwd_cpu(&dy, &x, &w, c, eps);
    // naive bf16: every intermediate (squares, running sums, products) rounded to bf16
    let (mut yn, mut dxn, mut dwn) = (vec![0f32; n * c], vec![0f32; n * c], vec![0f32; c]);
    for i in 0..n {
        let row = &x[i * c..(i + 1) * c];
        let ss = row.iter().fold(0f32, |s, v| r16(s + r16(v * v)));
        let rs = r16(1.0 / r16(r16(ss / c as f32 + eps).sqrt()));
        let mut dot = 0f32;
        for j in 0..c {
            let xh = r16(row[j] * rs);
            yn[i * c + j] = r16(xh * w[j]);
            dot = r16(dot + r16(r16(dy[i * c + j] * w[j]) * xh));
            dwn[j] = r16(dwn[j] + r16(dy[i * c + j] * xh));
        }
        let dot = r16(dot / c as f32);
        for j in 0..c {
            let xh = r16(row[j] * rs);
            dxn[i * c + j] = r16(rs * r16(r16(dy[i * c + j] * w[j]) - r16(xh * dot)));
        }
    }
    let case = format!("N{n} C{c}");
    Ok(vec![
        check("rms_norm fwd", case.clone(), dt, &y, &y_ref, Some(&yn), 1e-5),
        check("rms_norm bwd dx", case.clone(), dt, &dx, &dx_ref, Some(&dxn), 1e-5),
        check("rms_norm bwd dw", case, dt, &dw, &dw_ref, Some(&dwn), 1e-5),
    ])
}

/// Fused cross-entropy on one logits chunk: nll (forward) and dlogits (backward), with ignored rows.
pub fn cross_entropy_checks(target: &Target, dt: Dt, r: &mut ChaCha8Rng) -> Result<Vec<Check>> {
    let big = matches!(target, Target::Cuda(_));
    let n = ragged(r, 3, if big { 100 } else { 10 });
    let v = ragged(r, 33, if big { 33_000 } else { 300 });
    let logits = as_dt(uniform(r, n * v, 6.0), dt);
    let mut targets: Vec<u32> = (0..n).map(|_| r.random_range(0..v as u32)).collect();
    targets[r.random_range(0..n)] = IGNORE_INDEX;
    let g: Vec<f32> = (0..n).map(|_| r.random::<f32>() + 0.1).collect();
    let (nll, dl) = match target {
        Target::Emulated => {
            let dims = emu_dims(r);
            by_dtype!(dt, |T| {
                let lt = to_t::<T>(&logits);
                let fwd = emu::cross_entropy::<T>(&lt, &targets, None, (n, v), false, dims)?;
                let bwd = emu::cross_entropy::<T>(&lt, &targets, Some(&g), (n, v), true, dims)?;
                let dl = bwd.dlogits.map(|d| of_t(&d)).unwrap_or_default();
                if fwd.nll != bwd.nll {
                    bail!("cross_entropy: nll differs between the forward and the in-place backward launch");
                }
                (fwd.nll, dl)
            })
        }
        Target::Cuda(dev) => cuda_run::cross_entropy(dev, dt, &logits, &targets, &g, (n, v))?,
    };
    let (nll_ref, _, dl_ref) = ce_rows_cpu(&logits, &targets, Some(&g), v, |x| x, |x| x);
    let dl_ref = dl_ref.unwrap_or_default();
    // naive bf16: max, exponentials, running sum, log and products all rounded to bf16
    let (mut nll_n, mut dl_n) = (vec![0f32; n], vec![0f32; n * v]);
    for i in 0..n {
        let row = &logits[i * v..(i + 1) * v];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let s = row.iter().fold(0f32, |s, &l| r16(s + r16(r16(l - m).exp())));
        let lse = r16(r16(s.ln()) + m);
        let y = targets[i];
        if y != IGNORE_INDEX {
            nll_n[i] = r16(lse - row[y as usize]);
            for j in 0..v {
                let p = r16(r16(row[j] - lse).exp());
                dl_n[i * v + j] = r16(r16(g[i]) * r16(p - if j as u32 == y { 1.0 } else { 0.0 }));
            }
        }
    }
    let case = format!("n{n} V{v} (1 ignored)");
    // nll is f32 for either storage dtype: the bf16 case still rounds only the logits it reads
    Ok(vec![
        check("cross_entropy nll", case.clone(), dt, &nll, &nll_ref, Some(&nll_n), 1e-5),
        check("cross_entropy dlogits", case, dt, &dl, &dl_ref, Some(&dl_n), 1e-5),
    ])
}

/// Fused AdamW against `optim::adamw::AdamW` over three steps (decay on one segment, none on the
/// other, a clipping scale), and the gradient sum of squares against an f64 sum.
pub fn adamw_checks(target: &Target, dt: Dt, r: &mut ChaCha8Rng) -> Result<Vec<Check>> {
    let big = matches!(target, Target::Cuda(_));
    let n = ragged(r, 40, if big { 300_000 } else { 3000 });
    let split = r.random_range(1..n);
    let hp = AdamWHyper { beta1: 0.9, beta2: 0.95, eps: 1e-8, wd_matrix: 0.1, wd_embedding: 0.1, wd_norm: 0.0 };
    let layout = crate::grads::ParamLayout::new(&[
        ("model.layers.0.mlp.up_proj.weight".into(), vec![split]),
        ("model.layers.0.input_layernorm.weight".into(), vec![n - split]),
    ]);
    let p0 = uniform(r, n, 1.0);
    let one_rank = crate::comms::zero::ShardMap::new(&layout, 1, crate::comms::zero::Split::Slices);
    let mut reference = AdamW::new(&layout, &crate::flatbuf::FlatBuf::from_vec(p0.clone()), &one_rank, 0, hp)?;
    let segments = vec![(0..split, hp.wd_matrix), (split..n, hp.wd_norm)];
    let grads: Vec<Vec<f32>> = (0..3).map(|_| uniform(r, n, 0.05)).collect();
    let scales = [1.0f32, 0.5, 0.25];
    let lr = 3e-3;
    let (sumsq, master, out) = match target {
        Target::Emulated => emu_adamw(dt, &p0, &grads, &scales, &segments, hp, lr, emu_dims(r))?,
        Target::Cuda(dev) => cuda_run::adamw(dev, dt, &p0, &grads, &scales, &segments, hp, lr)?,
    };
    for (g, &s) in grads.iter().zip(&scales) {
        let gs: Vec<f32> = g.iter().map(|x| x * s).collect();
        reference.step(&crate::flatbuf::FlatBuf::from_vec(gs), lr)?;
    }
    let exact_ss: f64 = grads[0].iter().map(|&x| x as f64 * x as f64).sum();
    let case = format!("n{n} split{split} 3 steps");
    let ref_master: Vec<f32> = reference.master().to_host()?.into_owned();
    let mut checks = vec![check("adamw master", case.clone(), Dt::F32, &master, &ref_master, None, 1e-6)];
    // compute weights: within 2x the rounding error of a correctly rounded copy of the master
    let rounded: Vec<f32> = as_dt(ref_master.clone(), dt);
    let mut c = check("adamw compute copy", case.clone(), dt, &out, &ref_master, Some(&rounded), 1e-6);
    if dt == Dt::F32 {
        c.bound = 1e-6 * max_abs(&ref_master).max(1.0);
        c.pass = c.max_err <= c.bound;
    }
    checks.push(c);
    let ss_err = (sumsq - exact_ss).abs();
    let bound = 1e-12 * exact_ss.max(1.0);
    checks.push(Check {
        kernel: "grad sum of squares".into(),
        case,
        dtype: Dt::F32,
        max_err: ss_err,
        bound,
        rule: "f64 tolerance",
        pass: ss_err <= bound,
    });
    Ok(checks)
}

/// torch's bias corrections for step t, as `AdamW::step` computes them (f64, then f32).
pub fn adamw_scalars(hp: AdamWHyper, lr: f64, t: u64, wd: f32, grad_scale: f32) -> emu::AdamWArgs {
    let bc1 = 1.0 - (hp.beta1 as f64).powi(t as i32);
    let bc2_sqrt = (1.0 - (hp.beta2 as f64).powi(t as i32)).sqrt();
    emu::AdamWArgs {
        lr: lr as f32,
        beta1: hp.beta1,
        beta2: hp.beta2,
        eps: hp.eps,
        wd,
        step_size: (lr / bc1) as f32,
        bc2_sqrt: bc2_sqrt as f32,
        grad_scale,
    }
}

type AdamwOut = (f64, Vec<f32>, Vec<f32>);

#[allow(clippy::too_many_arguments)]
fn emu_adamw(
    dt: Dt,
    p0: &[f32],
    grads: &[Vec<f32>],
    scales: &[f32],
    segments: &[(std::ops::Range<usize>, f32)],
    hp: AdamWHyper,
    lr: f64,
    dims: Dims,
) -> Result<AdamwOut> {
    let n = p0.len();
    let sumsq = emu::grad_sumsq(&grads[0], dims)?;
    let (mut master, mut m, mut v) = (p0.to_vec(), vec![0f32; n], vec![0f32; n]);
    let out = by_dtype!(dt, |T| {
        let mut out = vec![T::default(); n];
        for (t, (g, &s)) in grads.iter().zip(scales).enumerate() {
            for (rg, wd) in segments {
                let a = adamw_scalars(hp, lr, t as u64 + 1, *wd, s);
                let rg = rg.clone();
                emu::adamw::<T>(
                    &mut master[rg.clone()],
                    &mut m[rg.clone()],
                    &mut v[rg.clone()],
                    &g[rg.clone()],
                    Some(&mut out[rg]),
                    a,
                    dims,
                )?;
            }
        }
        of_t(&out)
    });
    Ok((sumsq, master, out))
}

#[cfg(not(feature = "cuda"))]
mod cuda_run {
    //! Without the `cuda` feature there is no device to run on; `Target::Cuda` cannot be built by
    //! `run`, and these stubs only keep the match arms total.
    use super::{AdamWHyper, AdamwOut, Dt};
    use anyhow::{bail, Result};
    use candle_core::{Device, Tensor};
    const MSG: &str = "this harpe was built without --features cuda";
    pub fn rope(
        _: &Device,
        _: Dt,
        _: &[f32],
        _: &[f32],
        _: &Tensor,
        _: &Tensor,
        _: (usize, usize, usize, usize),
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        bail!(MSG)
    }
    pub fn rms_norm(
        _: &Device,
        _: Dt,
        _: &[f32],
        _: &[f32],
        _: &[f32],
        _: (usize, usize),
        _: f32,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        bail!(MSG)
    }
    pub fn cross_entropy(
        _: &Device,
        _: Dt,
        _: &[f32],
        _: &[u32],
        _: &[f32],
        _: (usize, usize),
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        bail!(MSG)
    }
    #[allow(clippy::too_many_arguments)]
    pub fn adamw(
        _: &Device,
        _: Dt,
        _: &[f32],
        _: &[Vec<f32>],
        _: &[f32],
        _: &[(std::ops::Range<usize>, f32)],
        _: AdamWHyper,
        _: f64,
    ) -> Result<AdamwOut> {
        bail!(MSG)
    }
}

#[cfg(feature = "cuda")]
mod cuda_run {
    //! The same cases through the ops the model calls (rope, rms_norm with autograd, the CE chunk ops)
    //! and the optimizer's flat-buffer launchers.
    use super::{adamw_scalars, AdamWHyper, AdamwOut, Dt};
    use crate::ops::cuda::{adamw_step, grad_sumsq, AdamWBuffers, AdamWStep, ComputeOut};
    use anyhow::{anyhow, bail, Result};
    use candle_core::{DType, Device, Tensor, Var};

    /// Host values as a tensor of `dt` on `dev` (the GPU rows' inputs; `selftest::attention` too).
    pub(super) fn up<S: Into<candle_core::Shape>>(v: &[f32], shape: S, dt: Dt, dev: &Device) -> Result<Tensor> {
        Ok(Tensor::from_slice(v, shape, &Device::Cpu)?.to_dtype(dt.dtype())?.to_device(dev)?)
    }
    /// A device tensor's values as host f32.
    pub(super) fn down(t: &Tensor) -> Result<Vec<f32>> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<f32>()?)
    }

    pub fn rope(
        dev: &Device,
        dt: Dt,
        x: &[f32],
        dy: &[f32],
        cos: &Tensor,
        sin: &Tensor,
        (b, h, t, d): (usize, usize, usize, usize),
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let xv = Var::from_tensor(&up(x, &[b, h, t, d], dt, dev)?)?;
        let (c, s) = (cos.to_device(dev)?, sin.to_device(dev)?);
        let y = crate::ops::rotary::rope(xv.as_tensor(), &c, &s)?;
        let g = (&y * up(dy, &[b, h, t, d], dt, dev)?)?.sum_all()?.backward()?;
        let dx = g.get(xv.as_tensor()).ok_or_else(|| anyhow!("rope: no gradient reached x"))?;
        Ok((down(&y)?, down(dx)?))
    }

    pub fn rms_norm(
        dev: &Device,
        dt: Dt,
        x: &[f32],
        w: &[f32],
        dy: &[f32],
        (n, c): (usize, usize),
        eps: f32,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let xv = Var::from_tensor(&up(x, &[n, c], dt, dev)?)?;
        let wv = Var::from_tensor(&up(w, &[c], dt, dev)?)?;
        let y = crate::ops::rms_norm::rms_norm(xv.as_tensor(), wv.as_tensor(), eps as f64)?;
        let g = (&y * up(dy, &[n, c], dt, dev)?)?.sum_all()?.backward()?;
        let dx = g.get(xv.as_tensor()).ok_or_else(|| anyhow!("rms_norm: no gradient reached x"))?;
        let dw = g.get(wv.as_tensor()).ok_or_else(|| anyhow!("rms_norm: no gradient reached w"))?;
        Ok((down(&y)?, down(dx)?, down(dw)?))
    }

    pub fn cross_entropy(
        dev: &Device,
        dt: Dt,
        logits: &[f32],
        targets: &[u32],
        g: &[f32],
        (n, v): (usize, usize),
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        use crate::ops::cross_entropy_chunk::{ce_chunk_dlogits, ce_chunk_nll, check_targets};
        let l = up(logits, &[n, v], dt, dev)?;
        let t = Tensor::from_slice(targets, n, &Device::Cpu)?.to_device(dev)?;
        check_targets(&t, v)?;
        let gt = Tensor::from_slice(g, n, &Device::Cpu)?.to_device(dev)?;
        Ok((down(&ce_chunk_nll(&l, &t)?)?, down(&ce_chunk_dlogits(&l, &t, &gt)?)?))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn adamw(
        dev: &Device,
        dt: Dt,
        p0: &[f32],
        grads: &[Vec<f32>],
        scales: &[f32],
        segments: &[(std::ops::Range<usize>, f32)],
        hp: AdamWHyper,
        lr: f64,
    ) -> Result<AdamwOut> {
        let cd = dev.as_cuda_device()?;
        let n = p0.len();
        let mut master = cd.clone_htod(p0)?;
        let mut m = cd.alloc_zeros::<f32>(n)?;
        let mut v = cd.alloc_zeros::<f32>(n)?;
        let g0 = cd.clone_htod(&grads[0])?;
        let sumsq = grad_sumsq(cd, &g0.slice(..))?;
        let mut of = cd.alloc_zeros::<f32>(n)?;
        let mut ob = cd.alloc_zeros::<half::bf16>(n)?;
        for (t, (g, &s)) in grads.iter().zip(scales).enumerate() {
            let gd = cd.clone_htod(g)?;
            let a = adamw_scalars(hp, lr, t as u64 + 1, 0.0, s);
            let step = AdamWStep {
                lr: a.lr,
                beta1: a.beta1,
                beta2: a.beta2,
                eps: a.eps,
                step_size: a.step_size,
                bc2_sqrt: a.bc2_sqrt,
                grad_scale: a.grad_scale,
            };
            let out = match dt {
                Dt::F32 => ComputeOut::F32(&mut of),
                Dt::Bf16 => ComputeOut::Bf16(&mut ob),
                Dt::F16 => bail!("adamw: no f16 compute weights"),
            };
            adamw_step(cd, AdamWBuffers { master: &mut master, m: &mut m, v: &mut v, grad: &gd }, out, segments, step)?;
        }
        let out = match dt {
            Dt::Bf16 => cd.clone_dtoh(&ob)?.into_iter().map(|x| x.to_f32()).collect(),
            _ => cd.clone_dtoh(&of)?,
        };
        Ok((sumsq, cd.clone_dtoh(&master)?, out))
    }
}

/// Print the table; true when every check passed.
pub fn print_table(target: &Target, checks: &[Check]) -> bool {
    println!("harpe selftest — target: {}", target.name());
    println!("{:<24} {:<5} {:<30} {:>11} {:>11}  {:<18} result", "kernel", "dtype", "case", "max err", "bound", "rule");
    for c in checks {
        let dt = c.dtype.name();
        println!(
            "{:<24} {:<5} {:<30} {:>11.3e} {:>11.3e}  {:<18} {}",
            c.kernel,
            dt,
            c.case,
            c.max_err,
            c.bound,
            c.rule,
            if c.pass { "PASS" } else { "FAIL" }
        );
    }
    let failed = checks.iter().filter(|c| !c.pass).count();
    println!("{} checks, {} failed", checks.len(), failed);
    failed == 0
}

/// Check every kernel against its CPU reference.
#[derive(clap::Args, Debug)]
pub struct SelftestArgs {
    /// where the kernels run: `cuda` (needs a build with --features cuda and a GPU) or `emulated` (the
    /// kernels' source compiled for the host; the default in a CPU build)
    #[arg(long)]
    pub target: Option<String>,
    /// seed of the random inputs and sizes (default: from the clock, printed)
    #[arg(long)]
    pub seed: Option<u64>,
    /// how many rounds of fresh inputs
    #[arg(long, default_value_t = 2)]
    pub rounds: u64,
    /// print the results as JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

/// `harpe selftest`.
pub fn run(args: SelftestArgs) -> Result<()> {
    let target = match args.target.as_deref() {
        Some("emulated") => Target::Emulated,
        Some("cuda") => Target::Cuda(open_cuda()?),
        None if cfg!(feature = "cuda") => Target::Cuda(open_cuda()?),
        None => {
            eprintln!(
                "note: this is a CPU build; running the host-emulated kernels (build with --features cuda for the GPU)"
            );
            Target::Emulated
        }
        Some(o) => bail!("--target {o}: unknown\nhint: use --target cuda or --target emulated"),
    };
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
    });
    let mut all = Vec::new();
    for round in 0..args.rounds.max(1) {
        all.extend(run_all(&target, seed.wrapping_add(round))?);
    }
    let ok = if args.json {
        println!("{}", serde_json::json!({"target": target.name(), "seed": seed, "checks": all}));
        all.iter().all(|c| c.pass)
    } else {
        println!("seed {seed} (rerun with --seed {seed})");
        print_table(&target, &all)
    };
    if !ok {
        bail!("selftest: some kernels disagree with their CPU reference (FAIL rows above)\nhint: rerun with the printed --seed; report the table with the GPU name and driver version");
    }
    Ok(())
}

/// CUDA device 0 or an error that names what is missing.
pub fn open_cuda() -> Result<Device> {
    if !cfg!(feature = "cuda") {
        bail!("--target cuda: this harpe was built without CUDA\nhint: build with `cargo build --release --features cuda` (README: Build for GPUs), or use --target emulated");
    }
    Device::new_cuda(0).map_err(|e| {
        anyhow::anyhow!("cannot open CUDA device 0: {e}\nhint: check `nvidia-smi`; the driver must support CUDA 13 and the GPU must be sm_80 or newer")
    })
}
