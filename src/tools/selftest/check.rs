//! The harness every selftest row goes through: where the kernels run (`Target`), the storage type
//! (`Dt`), one row (`Check`), the f32 tolerance rule and the 16-bit bound of the header of `mod.rs`
//! (`check16`, with its `Exact` values and `Bound16` parameters), and the seeded ragged inputs. Apart from
//! the rows (`kernels.rs`, `attention.rs`, `candle_flash.rs`) and the table (`mod.rs`), so the bound a
//! row is held to is written once.
use crate::ops::emu::{self as emu, Dims};
use candle_core::Device;
use half::bf16;
use rand::Rng;
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
    pub(super) fn name(&self) -> &'static str {
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
    pub(super) fn dtype(self) -> candle_core::DType {
        match self {
            Dt::F32 => candle_core::DType::F32,
            Dt::Bf16 => candle_core::DType::BF16,
            Dt::F16 => candle_core::DType::F16,
        }
    }

    pub(super) fn name(self) -> &'static str {
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
    pub(super) fn new(kernel: &str, case: String, dtype: Dt, max_err: f64, bound: f64, rule: &'static str) -> Check {
        let ratio = if max_err.is_nan() { f64::INFINITY } else { max_err / bound.max(f64::MIN_POSITIVE) };
        Check { kernel: kernel.into(), case, dtype, max_err, bound, ratio, rule, pass: ratio <= 1.0 }
    }
}

pub(super) fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
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

pub(super) fn max_abs(a: &[f32]) -> f64 {
    a.iter().map(|x| x.abs() as f64).fold(0.0, f64::max)
}

/// An f32 row: `got` against the f32 reference `exact`, max |err| <= tol * max(1, max |exact|).
pub(super) fn check(kernel: &str, case: String, dt: Dt, got: &[f32], exact: &[f32], tol: f64) -> Check {
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

pub(super) fn uniform(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (r.random::<f32>() * 2.0 - 1.0) * scale).collect()
}

/// Round to the case's dtype (the values the kernel will see).
pub(super) fn as_dt(v: Vec<f32>, dt: Dt) -> Vec<f32> {
    match dt {
        Dt::F32 => v,
        Dt::Bf16 => v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect(),
        Dt::F16 => v.into_iter().map(|x| half::f16::from_f32(x).to_f32()).collect(),
    }
}

/// An odd size in lo..hi that is not a multiple of 32.
pub(super) fn ragged(r: &mut ChaCha8Rng, lo: usize, hi: usize) -> usize {
    loop {
        let n = r.random_range(lo..hi);
        if !n.is_multiple_of(32) {
            return n;
        }
    }
}

/// A launch for the emulator: fewer blocks than rows, so grid-stride loops are exercised.
pub(super) fn emu_dims(r: &mut ChaCha8Rng) -> Dims {
    Dims { grid: r.random_range(1..4), block: [32, 64, 96][r.random_range(0..3)] }
}

pub(super) fn to_t<T: emu::EmuFloat>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}
pub(super) fn of_t<T: emu::EmuFloat>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}
