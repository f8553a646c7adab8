//! The fused RMSNorm op (`ops::rms_norm`): CPU reference loops vs the plain-op `rms_norm_slow` (the
//! model's formula), forward and backward (`common::ops::check_op`), f32 and bf16, finite differences of
//! the backward, and the op's parallel row loops against the sequential reference loops.
use crate::common::ops::{check_op, fd_check, fwd_bwd, max_abs, max_abs_diff, projection, randn, Fd, Tol};
use candle_core::{DType, Tensor};
use harpe::ops::rms_norm::{rms_norm, rms_norm_slow};

#[test]
fn forward_and_backward_match_the_slow_version() {
    for shape in [vec![3usize, 37], vec![2, 5, 19]] {
        let c = *shape.last().unwrap();
        check_op(
            &format!("rms_norm {shape:?}"),
            |x| rms_norm(&x[0], &x[1], 1e-6),
            |x| rms_norm_slow(&x[0], &x[1], 1e-6),
            &[randn(&shape, 1, 2.0), randn(&[c], 2, 1.0)],
            Tol::F32,
        );
    }
}

#[test]
fn bf16_matches_the_slow_version_within_bf16_rounding() {
    let x = randn(&[4, 29], 4, 2.0).to_dtype(DType::BF16).unwrap();
    let w = randn(&[29], 5, 1.0).to_dtype(DType::BF16).unwrap();
    let y = rms_norm(&x, &w, 1e-5).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    let ys = rms_norm_slow(&x, &w, 1e-5).unwrap();
    // both round xhat and y to bf16; they may differ by one bf16 ulp where the f32 sums differ
    let ulp = ys.to_dtype(DType::F32).unwrap().abs().unwrap().max_keepdim(1).unwrap().max(0).unwrap();
    let bound = (ulp.to_vec1::<f32>().unwrap()[0] / 128.0) as f64;
    assert!(max_abs_diff(&y, &ys) <= bound, "{} > {bound}", max_abs_diff(&y, &ys));
    // the backward runs in bf16 too: gradients of the inputs' dtype, against the slow version in f64
    check_op(
        "rms_norm bf16",
        |x| rms_norm(&x[0], &x[1], 1e-5),
        |x| rms_norm_slow(&x[0], &x[1], 1e-5),
        &[x, w],
        Tol::BF16,
    );
}

#[test]
fn finite_differences_agree_with_backward() {
    let (n, c) = (3, 11);
    let (x0, w0) = (randn(&[n, c], 6, 1.5), randn(&[c], 7, 1.0));
    let g = fwd_bwd("rms_norm", |x| rms_norm(&x[0], &x[1], 1e-6), &[x0.clone(), w0.clone()]);
    let up = projection(g.out.shape(), DType::F64);
    let f = |xt: &Tensor, wt: &Tensor| -> f64 {
        // in f64 through the slow version, so the difference quotient is accurate
        let y = rms_norm_slow(&xt.to_dtype(DType::F64).unwrap(), &wt.to_dtype(DType::F64).unwrap(), 1e-6).unwrap();
        (y * &up).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
    };
    fd_check("dx", &x0, |xt| f(xt, &w0), &g.grads[0], Fd::F64);
    fd_check("dw", &w0, |wt| f(&x0, wt), &g.grads[1], Fd::F64);
}

#[test]
fn mismatched_weight_is_an_error() {
    let e = rms_norm(&randn(&[2, 5], 1, 1.0), &randn(&[4], 2, 1.0), 1e-6).unwrap_err().to_string();
    assert!(e.contains("does not end in the weight's width 4"), "{e}");
}

#[test]
fn parallel_loops_match_the_reference_loops() {
    use harpe::ops::rms_norm::{rms_norm_bwd_cpu, rms_norm_bwd_par, rms_norm_cpu, rms_norm_par};
    // 103 rows: several rayon tasks and a ragged last one
    let (n, c) = (103, 24);
    let vals = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (x, w, dy) = (vals(&randn(&[n, c], 4, 2.0)), vals(&randn(&[c], 5, 1.0)), vals(&randn(&[n, c], 6, 1.0)));
    assert_eq!(rms_norm_par(&x, &w, c, 1e-5), rms_norm_cpu(&x, &w, c, 1e-5).0, "forward is the same row code");
    let ((dxp, dwp), (dxr, dwr)) = (rms_norm_bwd_par(&dy, &x, &w, c, 1e-5), rms_norm_bwd_cpu(&dy, &x, &w, c, 1e-5));
    assert_eq!(dxp, dxr, "dx is the same row code");
    let (err, mag) = (max_abs_diff(&dwp, &dwr), max_abs(&dwr));
    assert!(err <= 1e-5 * mag.max(1.0) && mag > 0.0, "dw differs by {err} (max {mag})");
}

#[test]
fn parallel_backward_is_the_same_on_every_run_and_thread_count() {
    use harpe::ops::rms_norm::rms_norm_bwd_par;
    // enough rows for many tasks; work stealing differs from run to run and with the thread count, the
    // summation order of dw must not
    let (n, c) = (4099, 32);
    let vals = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (x, w, dy) = (vals(&randn(&[n, c], 7, 2.0)), vals(&randn(&[c], 8, 1.0)), vals(&randn(&[n, c], 9, 1.0)));
    let on = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| rms_norm_bwd_par(&dy, &x, &w, c, 1e-5))
    };
    let first = on(1);
    for threads in [2, 3, 8, 8, 8, 16] {
        assert!(on(threads) == first, "dx/dw differ at {threads} threads");
    }
}
