//! The fused RMSNorm op (`ops::rms_norm`): CPU reference loops vs the plain-op `rms_norm_slow` (the
//! model's formula), forward and backward, f32 and bf16, finite differences of the backward, and the
//! op's parallel row loops against the sequential reference loops.
use crate::common::ops::{fd_check, max_abs, max_abs_diff, randn, Fd};
use candle_core::{DType, Tensor, Var};
use harpe::ops::rms_norm::{rms_norm, rms_norm_slow};

#[test]
fn forward_and_backward_match_the_slow_version() {
    for shape in [vec![3usize, 37], vec![2, 5, 19]] {
        let c = *shape.last().unwrap();
        let x = Var::from_tensor(&randn(&shape, 1, 2.0)).unwrap();
        let w = Var::from_tensor(&randn(&[c], 2, 1.0)).unwrap();
        let up = randn(&shape, 3, 1.0);
        let y = rms_norm(x.as_tensor(), w.as_tensor(), 1e-6).unwrap();
        let ys = rms_norm_slow(x.as_tensor(), w.as_tensor(), 1e-6).unwrap();
        assert!(max_abs_diff(&y, &ys) < 1e-6, "{shape:?}: {}", max_abs_diff(&y, &ys));
        let g = (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let gs = (ys * &up).unwrap().sum_all().unwrap().backward().unwrap();
        for (name, v) in [("x", &x), ("w", &w)] {
            let (a, b) = (g.get(v.as_tensor()).unwrap(), gs.get(v.as_tensor()).unwrap());
            assert!(max_abs_diff(a, b) < 1e-5, "{shape:?} d{name}: {}", max_abs_diff(a, b));
            let mag = a.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(mag > 0.0, "d{name} is zero");
        }
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
    // the backward runs in bf16 too and gives gradients of the right dtype
    let xv = Var::from_tensor(&x).unwrap();
    let wv = Var::from_tensor(&w).unwrap();
    let g = rms_norm(xv.as_tensor(), wv.as_tensor(), 1e-5).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(g.get(xv.as_tensor()).unwrap().dtype(), DType::BF16);
    assert_eq!(g.get(wv.as_tensor()).unwrap().dims(), &[29]);
}

#[test]
fn finite_differences_agree_with_backward() {
    let (n, c) = (3, 11);
    let x0 = randn(&[n, c], 6, 1.5);
    let w0 = randn(&[c], 7, 1.0);
    let up = randn(&[n, c], 8, 1.0);
    let x = Var::from_tensor(&x0).unwrap();
    let w = Var::from_tensor(&w0).unwrap();
    let g =
        (rms_norm(x.as_tensor(), w.as_tensor(), 1e-6).unwrap() * &up).unwrap().sum_all().unwrap().backward().unwrap();
    let f = |xt: &Tensor, wt: &Tensor| -> f64 {
        // in f64 through the slow version, so the difference quotient is accurate
        let y = rms_norm_slow(&xt.to_dtype(DType::F64).unwrap(), &wt.to_dtype(DType::F64).unwrap(), 1e-6).unwrap();
        (y * up.to_dtype(DType::F64).unwrap()).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
    };
    fd_check("dx", &x0, |xt| f(xt, &w0), g.get(x.as_tensor()).unwrap(), Fd::F64);
    fd_check("dw", &w0, |wt| f(&x0, wt), g.get(w.as_tensor()).unwrap(), Fd::F64);
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
