//! The op harness (`common::ops`; benches/attention_cpu.rs takes its inputs from here too):
//! deterministic pseudo-random inputs, the max-difference helpers every numeric comparison of the tests
//! uses, `check_op` (a fused op against its reference, forward and every input's gradient, with the one
//! tolerance rule) and the one finite-difference checker of gradients with its tolerance rule.
#![allow(dead_code)]
use candle_core::{DType, Device, Shape, Tensor, Var};

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

/// The upstream gradient every op test backpropagates: multiples of 1/64 in [-1, 1] from a fixed seed.
/// Random rather than ones: with the loss sum(out), a backward that ignores its upstream gradient, or
/// mixes up which entry it belongs to, passes. Multiples of 1/64 are exact in every float dtype, so the
/// loss sum(out * P) is the same function in bf16, f16, f32 and f64.
pub fn projection(shape: &Shape, dtype: DType) -> Tensor {
    let v: Vec<f32> = randv(shape.elem_count(), 0x5eed, 1.0).iter().map(|x| (x * 64.0).round() / 64.0).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

/// One run of an op: its output and, for each input, the gradient of sum(out * projection).
pub struct FwdBwd {
    pub out: Tensor,
    pub grads: Vec<Tensor>,
}

/// `f` on `inputs` (each made a fresh `Var`) and the gradients of sum(out * `projection`) with respect to
/// each of them. Panics when an input receives no gradient: an op without a backward (or with one that
/// drops an input) stops the gradient silently, and this is where a test sees it.
pub fn fwd_bwd(name: &str, f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>, inputs: &[Tensor]) -> FwdBwd {
    let vars: Vec<Var> = inputs.iter().map(|x| Var::from_tensor(x).unwrap()).collect();
    let xs: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&xs).unwrap_or_else(|e| panic!("{name}: {e}"));
    let loss = (&out * projection(out.shape(), out.dtype())).unwrap().sum_all().unwrap();
    let store = loss.backward().unwrap();
    let grads = xs
        .iter()
        .enumerate()
        .map(|(i, x)| match store.get(x) {
            Some(g) => g.clone(),
            None => panic!("{name}: input {i} received no gradient (no backward, or one that drops it)"),
        })
        .collect();
    FwdBwd { out, grads }
}

/// The bounds of `check_op`, one for the output and one for the gradients; the presets are the rule of
/// its doc comment. A test that needs another value says so with struct update syntax
/// (`Tol { fwd: 0.0, ..Tol::BF16 }`): tighter where it can, looser only for an ill-conditioned case
/// (scores near 100 in a softmax), with the reason beside it.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub fwd: f64,
    pub grad: f64,
}

impl Tol {
    /// f32: 1e-5 of the reference's largest entry (see `check_op`).
    pub const F32: Tol = Tol { fwd: 1e-5, grad: 1e-5 };
    /// bf16: one bf16 rounding (unit roundoff 2^-8) of the reference's largest entry.
    pub const BF16: Tol = Tol { fwd: 1.0 / 256.0, grad: 1.0 / 256.0 };
    /// f16: one f16 rounding (unit roundoff 2^-11) of the reference's largest entry.
    pub const F16: Tol = Tol { fwd: 1.0 / 2048.0, grad: 1.0 / 2048.0 };

    /// The preset of the output's dtype (f64 has f32's).
    pub fn of(dtype: DType) -> Tol {
        match dtype {
            DType::BF16 => Tol::BF16,
            DType::F16 => Tol::F16,
            _ => Tol::F32,
        }
    }
}

/// The one comparison of a fused op with its reference: `fused` and `slow` (closures of the inputs whose
/// gradients are checked; whatever else the op needs, RoPE's tables or a mask, they capture) run on the same `inputs`
/// (`fwd_bwd`: each input a fresh Var, the loss sum(out * `projection`)); their outputs are compared, then
/// EVERY input's gradient, and every gradient of the fused op must be finite and not all zero (a missing
/// or dead backward cannot pass). Returns both runs, for a test's own further checks.
///
/// The tolerance rule, for the output and for each gradient: the error of a against its reference r is
/// err(a, r) = max_i |a_i - r_i| / max_i |r_i| (relative to the reference's scale; a NaN fails), and
///
/// - f32 (and f64): the reference is `slow` in the same dtype, and err(fused, slow) <= tol, `Tol::F32` =
///   1e-5, about 170 f32 roundings (2^-24 each) of the largest entry: the two sides sum in different
///   orders, and the longest sums here (attention at T = 1100) reach 2e-6.
/// - bf16 and f16: `slow` rounds at every step, so it is no exact reference. The reference is `slow` run
///   on the same (already rounded) inputs in f64, and the fused op may be at most twice as far from it as
///   `slow` in the half type is (the ggml / flash-attention criterion), or one rounding of the half type
///   at the reference's largest entry (its unit roundoff), whichever is larger: err(fused, exact) <=
///   max(2 err(slow, exact), tol), `Tol::BF16` = 2^-8, `Tol::F16` = 2^-11. `slow` must accept f64 inputs
///   (a closure casts what it captures to its inputs' dtype).
pub fn check_op(
    name: &str,
    fused: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    slow: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    inputs: &[Tensor],
    tol: Tol,
) -> [FwdBwd; 2] {
    let f = fwd_bwd(name, &fused, inputs);
    let s = fwd_bwd(name, &slow, inputs);
    assert_eq!(f.out.dims(), s.out.dims(), "{name}: output shapes differ");
    assert_eq!(f.out.dtype(), s.out.dtype(), "{name}: output dtypes differ");
    let half = matches!(s.out.dtype(), DType::BF16 | DType::F16);
    let exact = half.then(|| {
        let wide: Vec<Tensor> = inputs.iter().map(|x| x.to_dtype(DType::F64).unwrap()).collect();
        fwd_bwd(name, &slow, &wide)
    });
    let compare = |what: &str, a: &Tensor, r: &Tensor, exact: Option<&Tensor>, bound: f64| {
        let floor = f64::MIN_POSITIVE;
        match exact {
            None => {
                let e = rel_err(a, r, floor);
                assert!(
                    e <= bound,
                    "{name}: {what} differs from the slow version by {e:e} of its largest entry (> {bound:e})"
                );
            }
            Some(x) => {
                let (ea, er) = (rel_err(a, x, floor), rel_err(r, x, floor));
                let limit = (2.0 * er).max(bound);
                assert!(
                    ea <= limit,
                    "{name}: {what} is {ea:e} of its largest entry from the f64 reference, the slow version {er:e} (> max(2 x slow, {bound:e}))"
                );
            }
        }
    };
    compare("the output", &f.out, &s.out, exact.as_ref().map(|x| &x.out), tol.fwd);
    for (i, x) in inputs.iter().enumerate() {
        let (gf, gs) = (&f.grads[i], &s.grads[i]);
        assert_eq!((gf.dims(), gf.dtype()), (x.dims(), x.dtype()), "{name}: gradient of input {i}: shape or dtype");
        let mag = max_abs(gf);
        assert!(
            mag.is_finite() && mag > 0.0,
            "{name}: the gradient of input {i} is {mag} at its largest (zero or not finite)"
        );
        let what = format!("the gradient of input {i}");
        compare(&what, gf, gs, exact.as_ref().map(|x| &x.grads[i]), tol.grad);
    }
    [f, s]
}
