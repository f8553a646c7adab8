//! The op harness itself (`common::ops::check_op`): it passes a correct op, and fails each way a fused op
//! can be wrong: a forward off by 0.1%, one input's gradient off by 1% (in f32, bf16 and f16), an input
//! whose gradient is stopped or zero, and a backward that ignores its upstream gradient, which a loss of
//! sum(out) cannot see.
use crate::common::ops::{check_op, fwd_bwd, max_abs_diff, randn, Tol};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The message `f` panics with; fails the test if it does not panic.
fn failure(f: impl FnOnce()) -> String {
    let e = catch_unwind(AssertUnwindSafe(f)).expect_err("the harness passed a wrong op");
    e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

/// The op every case is a variant of: x * w, elementwise, two inputs with gradients w * dy and x * dy.
fn slow(x: &[Tensor]) -> Result<Tensor> {
    x[0].mul(&x[1])
}

fn inputs(dtype: DType) -> [Tensor; 2] {
    [randn(&[3, 17], 1, 1.0), randn(&[3, 17], 2, 1.0)].map(|x| x.to_dtype(dtype).unwrap())
}

#[test]
fn a_correct_op_passes() {
    for dt in [DType::F32, DType::BF16, DType::F16] {
        check_op("x * w", |x| x[1].mul(&x[0]), slow, &inputs(dt), Tol::of(dt));
    }
}

#[test]
fn a_wrong_forward_fails() {
    let e = failure(|| {
        check_op("x * w * 1.001", |x| x[0].mul(&x[1])? * 1.001, slow, &inputs(DType::F32), Tol::F32);
    });
    assert!(e.contains("the output differs"), "{e}");
}

#[test]
fn a_gradient_off_by_one_percent_fails_in_every_dtype() {
    // the same forward; w's gradient scaled by 1.01 (the detached copy takes the extra part's forward away)
    let fused = |x: &[Tensor]| {
        let y = x[0].mul(&x[1])?;
        let extra = x[0].detach().mul(&x[1])?;
        y + ((&extra - extra.detach())? * 0.01)?
    };
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let e = failure(|| {
            check_op("dw x 1.01", fused, slow, &inputs(dt), Tol::of(dt));
        });
        assert!(e.contains("the gradient of input 1"), "{dt:?}: {e}");
    }
}

#[test]
fn a_stopped_or_zero_gradient_fails() {
    let e = failure(|| {
        check_op("w detached", |x| x[0].mul(&x[1].detach()), slow, &inputs(DType::F32), Tol::F32);
    });
    assert!(e.contains("input 1 received no gradient"), "{e}");
    // x's gradient present but zero: the forward is right, the backward dead
    let dead_x = |x: &[Tensor]| x[0].detach().mul(&x[1])? + (&x[0] - &x[0])?;
    let e = failure(|| {
        check_op("dx zero", dead_x, slow, &inputs(DType::F32), Tol::F32);
    });
    assert!(e.contains("the gradient of input 0 is 0"), "{e}");
}

/// y = 2x whose backward returns 2 for every entry, whatever the upstream gradient: right only when
/// the upstream gradient is all ones, as under the loss sum(y).
struct IgnoresUpstream;

impl CustomOp1 for IgnoresUpstream {
    fn name(&self) -> &'static str {
        "ignores-upstream"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(v), Some((lo, hi))) = (s, l.contiguous_offsets()) else {
            candle_core::bail!("ignores-upstream: a contiguous f32 input");
        };
        Ok((CpuStorage::F32(v[lo..hi].iter().map(|x| 2.0 * x).collect()), l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, _grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some((arg.ones_like()? * 2.0)?))
    }
}

#[test]
fn a_backward_that_ignores_its_upstream_gradient_fails() {
    let x = randn(&[4, 9], 3, 1.0);
    let fused = |x: &[Tensor]| x[0].apply_op1(IgnoresUpstream);
    let twice = |x: &[Tensor]| &x[0] * 2.0;
    // what the old sum(out).backward() comparison saw: the same gradient on both sides
    let sum_grad = |f: &dyn Fn(&[Tensor]) -> Result<Tensor>| {
        let v = candle_core::Var::from_tensor(&x).unwrap();
        let g = f(&[v.as_tensor().clone()]).unwrap().sum_all().unwrap().backward().unwrap();
        g.get(v.as_tensor()).unwrap().clone()
    };
    assert_eq!(max_abs_diff(&sum_grad(&fused), &sum_grad(&twice)), 0.0);
    assert_eq!(max_abs_diff(&fwd_bwd("fused", fused, std::slice::from_ref(&x)).out, &(&x * 2.0).unwrap()), 0.0);
    let e = failure(|| {
        check_op("ignores upstream", fused, twice, std::slice::from_ref(&x), Tol::F32);
    });
    assert!(e.contains("the gradient of input 0"), "{e}");
}
