//! The fused SwiGLU op (`ops::swiglu`): silu(gate) * up forward and backward against the plain-op
//! `swiglu_slow` (the model's former formula) in f32, bf16 and f16 (`common::ops::check_op`), the f32
//! forward also against f64, and the op's vectorised parallel loops against the scalar reference loops
//! (`f32::exp`), tails and large magnitudes included.
use crate::common::ops::{check_op, fd_check, fwd_bwd, max_abs_diff, projection, randn, Fd, Tol};
use candle_core::{DType, Tensor};
use harpe::ops::swiglu::{swiglu, swiglu_bwd_cpu, swiglu_bwd_par, swiglu_cpu, swiglu_par, swiglu_slow};

#[test]
fn forward_and_backward_match_the_slow_version() {
    // 2*5*37 = 370 elements: not a multiple of the 16 lanes, so the loops' tails run too
    for (shape, amp) in [(vec![2usize, 5, 37], 3.0), (vec![4, 1000], 12.0)] {
        let (g, u) = (randn(&shape, 1, amp), randn(&shape, 2, 1.0));
        let [fused, _] = check_op(
            &format!("swiglu {shape:?}"),
            |x| swiglu(&x[0], &x[1]),
            |x| swiglu_slow(&x[0], &x[1]),
            &[g.clone(), u.clone()],
            Tol::F32,
        );
        // f64 through the slow version: the exact values both f32 paths approximate
        let y64 = swiglu_slow(&g.to_dtype(DType::F64).unwrap(), &u.to_dtype(DType::F64).unwrap()).unwrap();
        let e = max_abs_diff(&fused.out, &y64);
        assert!(e < 1e-5 * amp as f64, "{shape:?}: {e}");
    }
}

#[test]
fn backward_agrees_with_finite_differences() {
    let (g0, u0) = (randn(&[3, 7], 4, 2.0), randn(&[3, 7], 5, 1.0));
    let g = fwd_bwd("swiglu", |x| swiglu(&x[0], &x[1]), &[g0.clone(), u0.clone()]);
    let up = projection(g.out.shape(), DType::F64);
    // the loss in f64 through the slow version, so the difference quotient is accurate
    let f = |gt: &Tensor, ut: &Tensor| -> f64 {
        let y = swiglu_slow(&gt.to_dtype(DType::F64).unwrap(), &ut.to_dtype(DType::F64).unwrap()).unwrap();
        (y * &up).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
    };
    fd_check("dgate", &g0, |gt| f(gt, &u0), &g.grads[0], Fd::F64);
    fd_check("dup", &u0, |ut| f(&g0, ut), &g.grads[1], Fd::F64);
}

#[test]
fn parallel_vectorised_loops_match_the_reference_loops() {
    // 70_001 elements: several rayon tasks and a ragged tail; magnitudes up to ~100 reach exp's clamps
    let n = 70_001;
    let g: Vec<f32> = (0..n).map(|i| ((i as f32 * 0.37).sin() * 100.0) / (1.0 + (i % 7) as f32)).collect();
    let u: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
    let dy: Vec<f32> = (0..n).map(|i| (i as f32 * 0.05).sin() + 0.1).collect();
    let close = |a: &[f32], b: &[f32], what: &str| {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "{what}[{i}]: {x} vs {y}");
        }
    };
    close(&swiglu_par(&g, &u), &swiglu_cpu(&g, &u), "y");
    let packed = swiglu_bwd_par(&dy, &g, &u);
    let (dg, du) = swiglu_bwd_cpu(&dy, &g, &u);
    assert_eq!(packed.len(), 2 * n);
    close(&packed[..n], &dg, "dgate");
    close(&packed[n..], &du, "dup");
}

#[test]
fn shapes_and_dtypes_are_checked() {
    let e = swiglu(&randn(&[2, 5], 1, 1.0), &randn(&[2, 6], 2, 1.0)).unwrap_err().to_string();
    assert!(e.contains("differ"), "{e}");
}

/// bf16 and f16 (the GPU's dtypes; on CUDA the same code runs candle's kernels): the forward is
/// `swiglu_slow`'s values exactly (the same silu and product kernels), the backward (f32 blocks of rows,
/// here two blocks and a ragged one) under `check_op`'s half-precision rule (against the slow version in
/// f64, at most 2x the slow version's own error in the half type, or one rounding of it).
#[test]
fn half_precision_matches_the_slow_version_forward_and_backward() {
    let shape = [2usize, 4100, 3];
    for dt in [DType::BF16, DType::F16] {
        let inputs = [randn(&shape, 7, 3.0), randn(&shape, 8, 1.0)].map(|x| x.to_dtype(dt).unwrap());
        let [fused, slow] = check_op(
            &format!("swiglu {dt:?}"),
            |x| swiglu(&x[0], &x[1]),
            |x| swiglu_slow(&x[0], &x[1]),
            &inputs,
            Tol::of(dt),
        );
        assert_eq!(max_abs_diff(&fused.out, &slow.out), 0.0, "{dt:?}: forward differs from the slow version");
    }
}
