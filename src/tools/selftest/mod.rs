//! `harpe selftest`: every harpe kernel against its reference on fresh random ragged inputs, forward and
//! backward, f32, bf16 and f16 (attention); a PASS/FAIL table with each row's worst error / bound ratio,
//! printed row by row as the rows are computed; exit code 1 on any FAIL.
//!
//! Reference: ggml `test-backend-ops` and flash-attention's tests (one harness, every op). Targets: `cuda`
//! (the CUDA kernels through the ops the model calls, on the GPU) and `emulated` (the same kernel source
//! compiled for the host against kernels/emu.h — what a CPU build runs, and what `cargo test` checks).
//! Sizes are drawn per run (seeded) and are never multiples of 32.
//!
//! Bounds. f32 rows: max |kernel - reference| <= tol * max(1, max |reference|), tol 1e-5 (1e-6 for AdamW),
//! the reference being the f32 CPU op. 16-bit rows (bf16/f16 storage; [`check16`]): the exact value y of
//! every output element is computed in f64 from the same 16-bit-rounded inputs the kernel reads, and the
//! kernel's output must satisfy, element by element,
//!
//!   |kernel - y| <= B = 2 h(|y| + E) + E,    E = 2 u_op M + 2 L u32 M_f
//!
//! - h(x): half an ulp of x in the output's type, 2^(e-p) with e = floor(log2 x) (at least the smallest
//!   normal exponent) and p = 8 (bf16), 11 (f16), 24 (f32): the output's one rounding at the store,
//!   |round(z) - z| <= h(|z|), applied to z = the kernel's f32 value, |z| <= |y| + E. The bound allows two
//!   of them (a full ulp), and twice the operand roundings below, so that a correct kernel, whose worst
//!   element among thousands does round by almost h, still shows an err/bound ratio of about 0.5 and not 1:
//!   the margin the table prints.
//! - M: the same computation on absolute values (sum |a_k b_k| for a dot product, and so on through the
//!   op): every rounding error below is relative to it. M_f: M with, in attention, each score's own
//!   magnitude folded in (an absolute error e in a score s changes exp(s) by the relative e).
//! - The f32 term 2 L u32 M_f, u32 = 2^-24, L = the length of the longest f32 reduction feeding the
//!   element plus the head dim plus 16: summing L terms in f32, in any order (sequential, tree, by tiles
//!   with rescaling), errs by at most gamma_L sum|terms| <= 1.01 L u32 sum|terms| (Higham, "Accuracy and
//!   Stability of Numerical Algorithms", 2nd ed., Lemma 3.1 and §3.1); the +16 and the factor 2 cover the
//!   elementwise steps (expf, logf, rsqrtf, divisions: a few ulps each) and second-order terms. Products of
//!   16-bit values are exact in f32, so the inputs add nothing.
//! - 2 u_op M (twice the bound, as for h): u_op = 2^-8 (bf16) or 2^-11 (f16) where the kernel rounds an intermediate operand to the
//!   storage type, else 0: operands a_k(1 + d_k), |d_k| <= u, move sum a_k b_k by at most u sum |a_k b_k|
//!   = u M. Attention's tensor-core tiles round P and dS before their MMAs (FA2's choice); a row with one
//!   visible key has P = 1 and dS = 0, exact, so M counts only rows with two or more keys. RMSNorm rounds
//!   the normalised row before the weight (HF's order): that rounding is part of the op, so the reference
//!   applies it too, and M holds ulp(xhat)/u |w| only where xhat lies so close to a rounding midpoint that
//!   the kernel's f32 xhat may round the other way.
//!
//! This is a correct kernel's worst-case error, to first order in u32. It does not grow with a 16-bit
//! accumulator: the former rule ("at most 2x a naive 16-bit implementation that rounds every partial
//! sum") was about as large as the output itself on a 33K-term row, so a kernel off by several percent
//! passed. A kernel off by 1% fails wherever E is small against |y| and |y|'s significand is large (RoPE,
//! RMSNorm, the dlogits, single-key rows of causal attention: at |y| = 1.9 x 2^e in bf16, B = 2^(e-7) =
//! 0.41% of |y| while the error is 1% of |y| less half an ulp);
//! tests/tools/selftest_perturbed.rs checks that with kernels perturbed through `HARPE_EMU_PERTURB`
//! (ops::emu::perturb) and that every unperturbed row passes with margin.
//! Not done here: the CPU-vs-GPU training run (scripts/gpu-check.sh), timing (`harpe bench`).
pub mod attention;
pub mod candle_flash;

use crate::model::rope::{RopeParity, RopeScheme};
use crate::ops::cross_entropy_chunk::ce_rows_cpu;
use crate::ops::cross_entropy_chunk::IGNORE_INDEX;
use crate::ops::emu::{self as emu, Dims};
use crate::ops::rms_norm::{rms_norm_bwd_cpu, rms_norm_cpu};
use crate::ops::rotary::rotary_cpu;
use crate::optim::adamw::{AdamW, AdamWHyper};
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
    /// harpe's CUDA kernels on a CUDA device
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

    /// (significand bits p, smallest normal exponent) of the type.
    fn format(self) -> (i32, i32) {
        match self {
            Dt::F32 => (24, -126),
            Dt::Bf16 => (8, -126),
            Dt::F16 => (11, -14),
        }
    }

    /// Unit roundoff u = 2^-p: round-to-nearest errs by at most u relative.
    pub fn unit(self) -> f64 {
        (2f64).powi(-self.format().0)
    }

    /// Half an ulp of |x| in this type (the error bound of one round-to-nearest of x, subnormals included).
    pub fn half_ulp(self, x: f64) -> f64 {
        let (p, emin) = self.format();
        let e = if x > 0.0 && x.is_finite() { (x.log2().floor() as i32).max(emin) } else { emin };
        (2f64).powi(e - p)
    }
}

/// One comparison: a kernel output against its reference.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub kernel: String,
    pub case: String,
    pub dtype: Dt,
    /// the error of the element with the largest error / bound ratio (f32 rows: the largest error)
    pub max_err: f64,
    /// that element's bound (f32 rows: the row's bound)
    pub bound: f64,
    /// max_err / bound: above 1 fails; how close a passing row came
    pub ratio: f64,
    /// how the bound was set
    pub rule: &'static str,
    pub pass: bool,
}

impl Check {
    fn new(kernel: &str, case: String, dtype: Dt, max_err: f64, bound: f64, rule: &'static str) -> Check {
        let ratio = if max_err.is_nan() { f64::INFINITY } else { max_err / bound.max(f64::MIN_POSITIVE) };
        Check { kernel: kernel.into(), case, dtype, max_err, bound, ratio, rule, pass: ratio <= 1.0 }
    }
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

/// An f32 row: `got` against the f32 reference `exact`, max |err| <= tol * max(1, max |exact|).
fn check(kernel: &str, case: String, dt: Dt, got: &[f32], exact: &[f32], tol: f64) -> Check {
    Check::new(kernel, case, dt, max_abs_diff(got, exact), tol * max_abs(exact).max(1.0), "f32 tolerance")
}

/// Exact values of one 16-bit row's outputs (f64, from the kernel's own rounded inputs) and, per element,
/// the magnitudes M and M_f of the header's bound.
#[derive(Clone, Debug, Default)]
pub struct Exact {
    pub y: Vec<f64>,
    pub mag: Vec<f64>,
    pub magf: Vec<f64>,
}

impl Exact {
    /// `n` zeros (an output nobody writes to stays exactly 0, with bound h(0)).
    pub fn zeros(n: usize) -> Exact {
        Exact { y: vec![0.0; n], mag: vec![0.0; n], magf: vec![0.0; n] }
    }
    /// Element i: value, M, and M_f = M.
    pub fn set(&mut self, i: usize, y: f64, mag: f64) {
        (self.y[i], self.mag[i], self.magf[i]) = (y, mag, mag);
    }
}

/// The parameters of a 16-bit row's bound (see the header): output type, operand rounding, f32 length L.
#[derive(Clone, Copy, Debug)]
pub struct Bound16 {
    /// the type the kernel stores the output in (f32 for the cross-entropy nll and attention's lse)
    pub out: Dt,
    /// `Some(dt)`: the kernel rounds intermediate operands to `dt` (u_op = dt's unit roundoff)
    pub operands: Option<Dt>,
    /// the longest f32 reduction feeding an element, plus the head dim where there is one (the +16 is added here)
    pub len: usize,
}

/// A 16-bit row: every element of `got` against `ex` under the header's bound; reports the element with
/// the largest error / bound ratio.
pub fn check16(kernel: &str, case: String, dt: Dt, got: &[f32], ex: &Exact, b: Bound16) -> Check {
    let rule = "f64 exact, derived bound";
    if got.len() != ex.y.len() {
        return Check::new(kernel, case, dt, f64::INFINITY, 0.0, rule);
    }
    let u_op = 2.0 * b.operands.map_or(0.0, Dt::unit);
    let f32_term = 2.0 * (b.len + 16) as f64 * Dt::F32.unit();
    let mut worst = (f64::NEG_INFINITY, 0.0, 0.0);
    for (i, &g) in got.iter().enumerate() {
        let e = u_op * ex.mag[i] + f32_term * ex.magf[i];
        let bound = 2.0 * b.out.half_ulp(ex.y[i].abs() + e) + e;
        let err = (g as f64 - ex.y[i]).abs();
        let ratio = if err.is_nan() { f64::INFINITY } else { err / bound };
        if ratio > worst.0 {
            worst = (ratio, if err.is_nan() { f64::INFINITY } else { err }, bound);
        }
    }
    if got.is_empty() {
        worst = (0.0, 0.0, 0.0);
    }
    Check {
        kernel: kernel.into(),
        case,
        dtype: dt,
        max_err: worst.1,
        bound: worst.2,
        ratio: worst.0,
        rule,
        pass: worst.0 <= 1.0,
    }
}

fn uniform(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (r.random::<f32>() * 2.0 - 1.0) * scale).collect()
}

/// Round to the case's dtype (the values the kernel will see).
fn as_dt(v: Vec<f32>, dt: Dt) -> Vec<f32> {
    match dt {
        Dt::F32 => v,
        Dt::Bf16 => v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect(),
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

/// Every check on `target` with inputs drawn from `seed`, each group handed to `sink` as soon as it is
/// computed (so a run cut short still shows the rows it made).
pub fn run_all(target: &Target, seed: u64, sink: &mut dyn FnMut(&[Check])) -> Result<()> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    for dt in [Dt::F32, Dt::Bf16] {
        sink(&rope_checks(target, dt, &mut r)?);
        sink(&rms_norm_checks(target, dt, &mut r)?);
        sink(&cross_entropy_checks(target, dt, &mut r)?);
        sink(&adamw_checks(target, dt, &mut r)?);
    }
    attention::checks_each(target, &mut r, sink)?;
    sink(&candle_flash::checks(target, &mut r)?);
    Ok(())
}

/// The rows of the checks above as one Vec (tests).
pub fn all_checks(target: &Target, seed: u64) -> Result<Vec<Check>> {
    let mut out = Vec::new();
    run_all(target, seed, &mut |cs: &[Check]| out.extend_from_slice(cs))?;
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
    let case = format!("B{b} H{h} Htab{htab} T{t} D{d} pos{start}");
    if dt == Dt::F32 {
        let y_ref = rotary_cpu(&x, &cos, &sin, shape, htab);
        let dx_ref = rotary_cpu(&dy, &cos, &nsin, shape, htab);
        return Ok(vec![
            check("rope fwd", case.clone(), dt, &y, &y_ref, 1e-5),
            check("rope bwd", case, dt, &dx, &dx_ref, 1e-5),
        ]);
    }
    // exact: y1 = x1 c - x2 s, y2 = x2 c + x1 s from the rounded x and the f32 tables; M = |x1 c| + |x2 s|
    let exact = |inp: &[f32], s: &[f32]| -> Exact {
        let (half, rep) = (d / 2, h / htab);
        let mut ex = Exact::zeros(inp.len());
        for row in 0..b * h * t {
            let (ti, hi) = (row % t, (row / t) % h);
            let tr = ((hi / rep) * t + ti) * half;
            for j in 0..half {
                let (c, sn) = (cos[tr + j] as f64, s[tr + j] as f64);
                let (x1, x2) = (inp[row * d + j] as f64, inp[row * d + j + half] as f64);
                let m = (x1 * c).abs() + (x2 * sn).abs();
                ex.set(row * d + j, x1 * c - x2 * sn, m);
                ex.set(row * d + j + half, x2 * c + x1 * sn, m);
            }
        }
        ex
    };
    let bd = Bound16 { out: dt, operands: None, len: 2 };
    Ok(vec![
        check16("rope fwd", case.clone(), dt, &y, &exact(&x, &sin), bd),
        check16("rope bwd", case, dt, &dx, &exact(&dy, &nsin), bd),
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
    let case = format!("N{n} C{c}");
    if dt == Dt::F32 {
        let (y_ref, _) = rms_norm_cpu(&x, &w, c, eps);
        let (dx_ref, dw_ref) = rms_norm_bwd_cpu(&dy, &x, &w, c, eps);
        return Ok(vec![
            check("rms_norm fwd", case.clone(), dt, &y, &y_ref, 1e-5),
            check("rms_norm bwd dx", case.clone(), dt, &dx, &dx_ref, 1e-5),
            check("rms_norm bwd dw", case, dt, &dw, &dw_ref, 1e-5),
        ]);
    }
    // exact, per row: r = 1/sqrt(sum x^2 / C + eps), xh = x r, y = round(xh) w, dot = sum dy w xh / C,
    // dx = r (dy w - xh dot), dw = sum over rows of dy round(xh): the op rounds xh (HF's order); where the
    // kernel's f32 xh (relative error <= 2 (C + 16) u32) may round the other way, M holds ulp(xh)/u |w|
    let (mut ey, mut edx, mut edw) = (Exact::zeros(n * c), Exact::zeros(n * c), Exact::zeros(c));
    let f = |v: &[f32], i: usize| v[i] as f64;
    let rel = 2.0 * (c + 16) as f64 * Dt::F32.unit();
    let round = |v: f64| as_dt(vec![v as f32], dt)[0] as f64;
    // (round(xh), ulp(xh)/u where the rounding is ambiguous, else 0)
    let rounded = |xh: f64| {
        let tie = round(xh - rel * xh.abs()) != round(xh + rel * xh.abs());
        (round(xh), if tie { 2.0 * dt.half_ulp(xh.abs()) / dt.unit() } else { 0.0 })
    };
    for i in 0..n {
        let rs = 1.0 / ((0..c).map(|j| f(&x, i * c + j).powi(2)).sum::<f64>() / c as f64 + eps as f64).sqrt();
        let xh = |j: usize| f(&x, i * c + j) * rs;
        let g = |j: usize| f(&dy, i * c + j) * f(&w, j);
        let dot = (0..c).map(|j| g(j) * xh(j)).sum::<f64>() / c as f64;
        let dot_m = (0..c).map(|j| (g(j) * xh(j)).abs()).sum::<f64>() / c as f64;
        for j in 0..c {
            let k = i * c + j;
            let (xr, amb) = rounded(xh(j));
            (ey.y[k], ey.mag[k], ey.magf[k]) = (xr * f(&w, j), amb * f(&w, j).abs(), (xr * f(&w, j)).abs());
            edx.set(k, rs * (g(j) - xh(j) * dot), rs * (g(j).abs() + xh(j).abs() * dot_m));
            edw.y[j] += f(&dy, k) * xr;
            edw.mag[j] += f(&dy, k).abs() * amb;
            edw.magf[j] += (f(&dy, k) * xr).abs();
        }
    }
    let bd = Bound16 { out: dt, operands: Some(dt), len: c };
    Ok(vec![
        check16("rms_norm fwd", case.clone(), dt, &y, &ey, bd),
        check16("rms_norm bwd dx", case.clone(), dt, &dx, &edx, Bound16 { operands: None, ..bd }),
        check16("rms_norm bwd dw", case, dt, &dw, &edw, Bound16 { len: c + n, ..bd }),
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
    let case = format!("n{n} V{v} (1 ignored)");
    if dt == Dt::F32 {
        let (nll_ref, _, dl_ref) = ce_rows_cpu(&logits, &targets, Some(&g), v, |x| x, |x| x);
        return Ok(vec![
            check("cross_entropy nll", case.clone(), dt, &nll, &nll_ref, 1e-5),
            check("cross_entropy dlogits", case, dt, &dl, &dl_ref.unwrap_or_default(), 1e-5),
        ]);
    }
    // exact, per row: lse = m + ln sum exp(l - m), nll = lse - l_y (an f32 output), dl = g (p - [j = y]) with
    // p = exp(l - lse); an error e in lse or l moves p by the relative e: M_f = g p (1 + |l| + |lse|)
    let (mut enll, mut edl) = (Exact::zeros(n), Exact::zeros(n * v));
    for i in 0..n {
        let row: Vec<f64> = logits[i * v..(i + 1) * v].iter().map(|&l| l as f64).collect();
        let y = targets[i];
        if y == IGNORE_INDEX {
            continue;
        }
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|l| (l - m).exp()).sum::<f64>().ln();
        let ly = row[y as usize];
        enll.set(i, lse - ly, 1.0 + m.abs() + lse.abs() + ly.abs());
        let gi = g[i] as f64;
        for (j, &l) in row.iter().enumerate() {
            let p = (l - lse).exp();
            let hot = if j as u32 == y { 1.0 } else { 0.0 };
            edl.set(i * v + j, gi * (p - hot), gi * (p + hot));
            edl.magf[i * v + j] = gi * (p * (1.0 + l.abs() + lse.abs()) + hot);
        }
    }
    Ok(vec![
        check16("cross_entropy nll", case.clone(), dt, &nll, &enll, Bound16 { out: Dt::F32, operands: None, len: v }),
        check16("cross_entropy dlogits", case, dt, &dl, &edl, Bound16 { out: dt, operands: None, len: v }),
    ])
}

/// Fused AdamW against `optim::adamw::AdamW` over three steps (decay on one segment, none on the
/// other, a clipping scale), and the gradient sum of squares against an f64 sum.
pub fn adamw_checks(target: &Target, dt: Dt, r: &mut ChaCha8Rng) -> Result<Vec<Check>> {
    let big = matches!(target, Target::Cuda(_));
    let n = ragged(r, 40, if big { 300_000 } else { 3000 });
    let split = r.random_range(1..n);
    let hp = AdamWHyper { beta1: 0.9, beta2: 0.95, eps: 1e-8, wd_matrix: 0.1, wd_embedding: 0.1, wd_norm: 0.0 };
    let layout = crate::model::layout::ParamLayout::new(&[
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
    let run = AdamwRun { p0: &p0, grads: &grads, scales: &scales, segments: &segments, hp, lr };
    let (sumsq, master, out) = match target {
        Target::Emulated => emu_adamw(dt, run, emu_dims(r))?,
        Target::Cuda(dev) => cuda_run::adamw(dev, dt, run)?,
    };
    for (g, &s) in grads.iter().zip(&scales) {
        let gs: Vec<f32> = g.iter().map(|x| x * s).collect();
        reference.step(&crate::flatbuf::FlatBuf::from_vec(gs), lr)?;
    }
    let exact_ss: f64 = grads[0].iter().map(|&x| x as f64 * x as f64).sum();
    let case = format!("n{n} split{split} 3 steps");
    let ref_master: Vec<f32> = reference.master().to_host()?.into_owned();
    let mut checks = vec![check("adamw master", case.clone(), Dt::F32, &master, &ref_master, 1e-6)];
    // compute weights: within 2x the rounding error of a correctly rounded copy of the master
    let err = max_abs_diff(&out, &ref_master);
    let (bound, rule) = match dt {
        Dt::F32 => (1e-6 * max_abs(&ref_master).max(1.0), "f32 tolerance"),
        _ => (2.0 * max_abs_diff(&as_dt(ref_master.clone(), dt), &ref_master).max(1e-30), "<= 2x rounding"),
    };
    checks.push(Check::new("adamw compute copy", case.clone(), dt, err, bound, rule));
    let ss_err = (sumsq - exact_ss).abs();
    checks.push(Check::new("grad sum of squares", case, Dt::F32, ss_err, 1e-12 * exact_ss.max(1.0), "f64 tolerance"));
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

/// One AdamW check's inputs: initial weights, one gradient per step with its clipping scale, the weight-decay
/// segments, the hyper-parameters and the learning rate.
#[derive(Clone, Copy)]
struct AdamwRun<'a> {
    p0: &'a [f32],
    grads: &'a [Vec<f32>],
    scales: &'a [f32],
    segments: &'a [(std::ops::Range<usize>, f32)],
    hp: AdamWHyper,
    lr: f64,
}

/// `run` through the emulated kernels: (gradient sum of squares of step 1, master, compute weights).
fn emu_adamw(dt: Dt, run: AdamwRun<'_>, dims: Dims) -> Result<AdamwOut> {
    let AdamwRun { p0, grads, scales, segments, hp, lr } = run;
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
    use super::{AdamwOut, AdamwRun, Dt};
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
    pub fn adamw(_: &Device, _: Dt, _: AdamwRun<'_>) -> Result<AdamwOut> {
        bail!(MSG)
    }
}

#[cfg(feature = "cuda")]
mod cuda_run {
    //! The same cases through the ops the model calls (rope, rms_norm with autograd, the CE chunk ops)
    //! and the optimizer's flat-buffer launchers.
    use super::{adamw_scalars, AdamwOut, AdamwRun, Dt};
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

    /// `run` through the CUDA kernels: (gradient sum of squares of step 1, master, compute weights).
    pub fn adamw(dev: &Device, dt: Dt, run: AdamwRun<'_>) -> Result<AdamwOut> {
        let AdamwRun { p0, grads, scales, segments, hp, lr } = run;
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

/// The table's header line.
fn print_header(target: &Target) {
    println!("harpe selftest — target: {}", target.name());
    println!(
        "{:<26} {:<5} {:<32} {:>10} {:>10} {:>9}  {:<24} result",
        "kernel", "dtype", "case", "err", "bound", "err/bound", "rule"
    );
}

/// One row of the table (printed, and flushed by stdout's line buffering, as soon as it is known).
fn print_row(c: &Check) {
    println!(
        "{:<26} {:<5} {:<32} {:>10.3e} {:>10.3e} {:>9.3}  {:<24} {}",
        c.kernel,
        c.dtype.name(),
        c.case,
        c.max_err,
        c.bound,
        c.ratio,
        c.rule,
        if c.pass { "PASS" } else { "FAIL" }
    );
}

/// Print the table; true when every check passed.
pub fn print_table(target: &Target, checks: &[Check]) -> bool {
    print_header(target);
    checks.iter().for_each(print_row);
    print_summary(checks)
}

/// The closing lines: counts and the largest ratio of a passing row (the margin); true when all passed.
fn print_summary(checks: &[Check]) -> bool {
    let failed = checks.iter().filter(|c| !c.pass).count();
    let margin = checks.iter().filter(|c| c.pass).map(|c| c.ratio).fold(0.0, f64::max);
    println!("{} checks, {} failed; largest err/bound of a passing row {margin:.3}", checks.len(), failed);
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
    /// only list the devices this harpe sees (CUDA: name, free and total memory; a CPU build: the host's
    /// cores and available memory) and exit: scripts/gpu-check.sh's preflight
    #[arg(long)]
    pub devices: bool,
}

/// `harpe selftest --devices`.
fn print_devices() -> Result<()> {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let build = if cfg!(feature = "cuda") { "CUDA" } else { "CPU" };
    println!("harpe {} ({build} build)", env!("CARGO_PKG_VERSION"));
    if cfg!(feature = "cuda") {
        let mut n = 0;
        // device_memory asks the driver through the device's primary context; the first index that
        // cannot be opened ends the list (an error on device 0 is the answer: no usable GPU)
        for i in 0..64 {
            match crate::device::device_memory(&crate::device::DeviceSpec::Cuda(i), "--devices") {
                Ok(Some(m)) => {
                    println!("cuda:{i} {}: {:.1} GiB free of {:.1} GiB", m.name, gib(m.free), gib(m.total));
                    n += 1;
                }
                Err(e) if i == 0 => return Err(e),
                _ => break,
            }
        }
        println!("{n} CUDA device(s)");
    } else {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let avail = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?.to_string();
                line.split_whitespace().nth(1)?.parse::<u64>().ok()
            })
            .map_or("unknown".to_string(), |kib| format!("{:.1} GiB", gib(kib * 1024)));
        println!("no CUDA in this build; host: {cores} cores, {avail} of memory available");
    }
    Ok(())
}

/// `harpe selftest`.
pub fn run(args: SelftestArgs) -> Result<()> {
    if args.devices {
        return print_devices();
    }
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
    if !args.json {
        println!("seed {seed} (rerun with --seed {seed})");
        print_header(&target);
    }
    for round in 0..args.rounds.max(1) {
        run_all(&target, seed.wrapping_add(round), &mut |cs: &[Check]| {
            if !args.json {
                cs.iter().for_each(print_row);
            }
            all.extend_from_slice(cs);
        })?;
    }
    let ok = if args.json {
        println!("{}", serde_json::json!({"target": target.name(), "seed": seed, "checks": all}));
        all.iter().all(|c| c.pass)
    } else {
        print_summary(&all)
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
    let dev = Device::new_cuda(0).map_err(|e| {
        anyhow::anyhow!("cannot open CUDA device 0: {e}\nhint: check `nvidia-smi`; the driver must support CUDA 13 and the GPU must be sm_80 or newer")
    })?;
    crate::device::keep_freed_device_memory(&dev)?;
    Ok(dev)
}
