//! The fused SwiGLU op (`ops::swiglu`): silu(gate) * up forward and backward against the plain-op
//! `swiglu_slow` (the model's former formula) in f32 and in f64, every input receiving a gradient, and the
//! op's vectorised parallel loops against the scalar reference loops (`f32::exp`), tails and large
//! magnitudes included.
use crate::common::ops::{fd_check, max_abs_diff, randn, Fd};
use candle_core::{DType, Tensor, Var};
use harpe::ops::swiglu::{swiglu, swiglu_bwd_cpu, swiglu_bwd_par, swiglu_cpu, swiglu_par, swiglu_slow};

#[test]
fn forward_and_backward_match_the_slow_version() {
    // 2*5*37 = 370 elements: not a multiple of the 16 lanes, so the loops' tails run too
    for (shape, amp) in [(vec![2usize, 5, 37], 3.0), (vec![4, 1000], 12.0)] {
        let g = Var::from_tensor(&randn(&shape, 1, amp)).unwrap();
        let u = Var::from_tensor(&randn(&shape, 2, 1.0)).unwrap();
        let up = randn(&shape, 3, 1.0);
        let y = swiglu(g.as_tensor(), u.as_tensor()).unwrap();
        let ys = swiglu_slow(g.as_tensor(), u.as_tensor()).unwrap();
        // f64 through the slow version: the exact values both f32 paths approximate
        let y64 =
            swiglu_slow(&g.as_tensor().to_dtype(DType::F64).unwrap(), &u.as_tensor().to_dtype(DType::F64).unwrap())
                .unwrap();
        let tol = 1e-5 * amp as f64;
        assert!(max_abs_diff(&y, &ys) < tol, "{shape:?}: {}", max_abs_diff(&y, &ys));
        assert!(max_abs_diff(&y, &y64) < tol, "{shape:?}: {}", max_abs_diff(&y, &y64));
        let gf = (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let gs = (ys * &up).unwrap().sum_all().unwrap().backward().unwrap();
        for (name, v) in [("gate", &g), ("up", &u)] {
            let (a, b) = (gf.get(v.as_tensor()).unwrap(), gs.get(v.as_tensor()).unwrap());
            assert_eq!(a.dims(), v.as_tensor().dims());
            assert!(max_abs_diff(a, b) < tol, "{shape:?} d{name}: {}", max_abs_diff(a, b));
            let mag = a.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(mag > 0.0, "d{name} is zero");
        }
    }
}

#[test]
fn backward_agrees_with_finite_differences() {
    let (g0, u0, up) = (randn(&[3, 7], 4, 2.0), randn(&[3, 7], 5, 1.0), randn(&[3, 7], 6, 1.0));
    let (g, u) = (Var::from_tensor(&g0).unwrap(), Var::from_tensor(&u0).unwrap());
    let grads = (swiglu(g.as_tensor(), u.as_tensor()).unwrap() * &up).unwrap().sum_all().unwrap().backward().unwrap();
    // the loss in f64 through the slow version, so the difference quotient is accurate
    let f = |gt: &Tensor, ut: &Tensor| -> f64 {
        let y = swiglu_slow(&gt.to_dtype(DType::F64).unwrap(), &ut.to_dtype(DType::F64).unwrap()).unwrap();
        (y * up.to_dtype(DType::F64).unwrap()).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
    };
    fd_check("dgate", &g0, |gt| f(gt, &u0), grads.get(g.as_tensor()).unwrap(), Fd::F64);
    fd_check("dup", &u0, |ut| f(&g0, ut), grads.get(u.as_tensor()).unwrap(), Fd::F64);
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
/// here two blocks and a ragged one) within one rounding of the half type of the f64 gradient, at most 2x
/// the slow version's own error (which differentiates in the half type), and every input gets a gradient.
#[test]
fn half_precision_matches_the_slow_version_forward_and_backward() {
    let shape = [2usize, 4100, 3];
    for dt in [DType::BF16, DType::F16] {
        let (g0, u0, up) = (randn(&shape, 7, 3.0), randn(&shape, 8, 1.0), randn(&shape, 9, 1.0));
        let (g, u) = (
            Var::from_tensor(&g0.to_dtype(dt).unwrap()).unwrap(),
            Var::from_tensor(&u0.to_dtype(dt).unwrap()).unwrap(),
        );
        let y = swiglu(g.as_tensor(), u.as_tensor()).unwrap();
        let ys = swiglu_slow(g.as_tensor(), u.as_tensor()).unwrap();
        assert_eq!(y.dtype(), dt);
        assert_eq!(max_abs_diff(&y, &ys), 0.0, "{dt:?}: forward differs from the slow version");
        let upd = up.to_dtype(dt).unwrap();
        let gf = (y * &upd).unwrap().sum_all().unwrap().backward().unwrap();
        let gs = (ys * &upd).unwrap().sum_all().unwrap().backward().unwrap();
        // the exact gradient from f64 of the same (rounded) inputs
        let [g64, u64v, up64] = [g.as_tensor(), u.as_tensor(), &upd].map(|t| t.to_dtype(DType::F64).unwrap());
        let (g64v, u64t) = (Var::from_tensor(&g64).unwrap(), Var::from_tensor(&u64v).unwrap());
        let ge = (swiglu_slow(g64v.as_tensor(), u64t.as_tensor()).unwrap() * &up64)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (name, v, v64) in [("gate", &g, &g64v), ("up", &u, &u64t)] {
            let exact = ge.get(v64.as_tensor()).unwrap().to_dtype(DType::F32).unwrap();
            let (a, b) = (gf.get(v.as_tensor()).unwrap(), gs.get(v.as_tensor()).unwrap());
            assert_eq!((a.dims(), a.dtype()), (v.as_tensor().dims(), dt));
            let ea = max_abs_diff(&a.to_dtype(DType::F32).unwrap(), &exact);
            let eb = max_abs_diff(&b.to_dtype(DType::F32).unwrap(), &exact);
            assert!(ea <= 2.0 * eb.max(1e-3), "{dt:?} d{name}: fused error {ea}, slow error {eb}");
            let mag = a.to_dtype(DType::F32).unwrap().abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(mag > 0.0, "{dt:?} d{name} is zero");
        }
    }
}
