//! The op harness (`common::ops`; benches/attention_cpu.rs takes its inputs from here too):
//! deterministic pseudo-random inputs, the max-difference helpers every numeric comparison of the tests
//! uses, and the one finite-difference checker of gradients with its tolerance rule.
#![allow(dead_code)]
use candle_core::{DType, Device, Tensor};

/// Deterministic pseudo-random f32 values in [-amp, amp) (an LCG from `seed`).
pub fn randv(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0) * amp
        })
        .collect()
}

/// `randv` as an f32 tensor of `shape` on the CPU.
pub fn randn(shape: &[usize], seed: u64, amp: f32) -> Tensor {
    Tensor::from_vec(randv(shape.iter().product(), seed, amp), shape, &Device::Cpu).unwrap()
}

/// What the max-difference helpers compare: a tensor of any float dtype (on any device) or a slice of
/// f32 or f64, read as f64 values in row-major order.
pub trait Values {
    fn f64s(&self) -> Vec<f64>;
}

impl Values for Tensor {
    fn f64s(&self) -> Vec<f64> {
        self.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()
    }
}

impl Values for [f32] {
    fn f64s(&self) -> Vec<f64> {
        self.iter().map(|&x| x as f64).collect()
    }
}

impl Values for Vec<f32> {
    fn f64s(&self) -> Vec<f64> {
        self.as_slice().f64s()
    }
}

impl Values for [f64] {
    fn f64s(&self) -> Vec<f64> {
        self.to_vec()
    }
}

impl Values for Vec<f64> {
    fn f64s(&self) -> Vec<f64> {
        self.clone()
    }
}

/// The largest of `v`, at least 0; a NaN makes it infinite, so a NaN never passes a bound.
fn max_or_inf(v: impl Iterator<Item = f64>) -> f64 {
    v.fold(0.0, |m, x| if x.is_nan() { f64::INFINITY } else { m.max(x) })
}

/// max |a_i - b_i| in f64 (the f32 differences exact); infinite where either side is NaN.
/// `a` and `b` hold the same number of values.
pub fn max_abs_diff<A: Values + ?Sized, B: Values + ?Sized>(a: &A, b: &B) -> f64 {
    let (a, b) = (a.f64s(), b.f64s());
    assert_eq!(a.len(), b.len(), "max_abs_diff of {} and {} values", a.len(), b.len());
    max_or_inf(a.iter().zip(&b).map(|(x, y)| (x - y).abs()))
}

/// max |a_i| in f64; infinite if any is NaN.
pub fn max_abs<A: Values + ?Sized>(a: &A) -> f64 {
    max_or_inf(a.f64s().iter().map(|x| x.abs()))
}

/// The error of `a` relative to the reference `b`: max |a_i - b_i| / max(max |b_i|, floor). With floor 0
/// a zero reference gives infinity or NaN, which fails any bound; floor 1 makes the bound absolute for
/// references below 1.
pub fn rel_err<A: Values + ?Sized, B: Values + ?Sized>(a: &A, b: &B, floor: f64) -> f64 {
    max_abs_diff(a, b) / max_abs(b).max(floor)
}

/// The step and the bound of a finite-difference check (`fd_check`); the presets are the two kinds of
/// check the op tests make, and a test that needs another value says so with struct update syntax
/// (`Fd { atol: 1e-4, ..Fd::F64 }`), never by a looser bound than the one it had.
#[derive(Clone, Copy, Debug)]
pub struct Fd {
    /// h: the loss is evaluated at x_i + h and x_i - h (rounded to the f32 input).
    pub step: f32,
    /// The absolute part of the bound.
    pub atol: f64,
    /// The part of the bound relative to the gradient's largest entry, max_j |analytic_j|.
    pub rtol: f64,
}

impl Fd {
    /// The loss in f64 through the op's plain-op reference (`_slow`): h = 1e-3 keeps the central
    /// difference's truncation error (h² |f'''| / 6) near 1e-6 on unit-scale inputs while f64 round-off
    /// (1e-16 |f| / h) is negligible, so the bound is absolute: 1e-3 (the op tests' worst difference is
    /// below 1e-4, RMSNorm's dx).
    pub const F64: Fd = Fd { step: 1e-3, atol: 1e-3, rtol: 0.0 };
    /// The loss in f32 through the op itself: f32 round-off of the loss (about 1e-7 |f| / h) does not
    /// shrink with the entry, so h = 1e-2 and the bound is 2% of the gradient's largest entry (the op
    /// tests' worst difference is below 0.1% of it).
    pub const F32: Fd = Fd { step: 1e-2, atol: 0.0, rtol: 2e-2 };
}

/// The one finite-difference check of a backward: `analytic` (the autograd gradient of the scalar
/// `loss` at the f32 input `x0`) against central differences, at every entry i of `x0`:
///
///   fd_i = (loss(x0 + h e_i) - loss(x0 - h e_i)) / ((x0_i + h) - (x0_i - h)),
///
/// the denominator being the step the f32 input actually took (exact in f64), and the rule
///
///   |fd_i - analytic_i| < atol + rtol * max_j |analytic_j|.
///
/// The gradient must not be all zero (a check against nothing). Keep the shapes tiny: every entry costs
/// two evaluations of `loss`.
pub fn fd_check(name: &str, x0: &Tensor, loss: impl Fn(&Tensor) -> f64, analytic: &Tensor, fd: Fd) {
    assert_eq!(x0.dtype(), DType::F32, "{name}: fd_check perturbs an f32 input");
    assert_eq!(x0.dims(), analytic.dims(), "{name}: input and gradient shapes differ");
    let xs = x0.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let an = analytic.f64s();
    let scale = max_abs(&an);
    assert!(scale > 0.0, "{name}: the analytic gradient is all zero");
    let bound = fd.atol + fd.rtol * scale;
    for i in 0..xs.len() {
        let at = |x: f32| {
            let mut v = xs.clone();
            v[i] = x;
            loss(&Tensor::from_vec(v, x0.shape(), x0.device()).unwrap())
        };
        let (hi, lo) = (xs[i] + fd.step, xs[i] - fd.step);
        let q = (at(hi) - at(lo)) / (hi as f64 - lo as f64);
        let err = (q - an[i]).abs();
        assert!(
            err < bound,
            "{name}[{i}]: finite difference {q} vs analytic {}: |diff| {err:e} >= {bound:e} (atol {:e} + rtol {:e} x max |analytic| {scale:e})",
            an[i],
            fd.atol,
            fd.rtol
        );
    }
}
