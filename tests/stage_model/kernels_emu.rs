//! The kernels' own source (kernels/*.cu), compiled for the host against kernels/emu.h, against the CPU
//! references: every kernel forward and backward, f32 and bf16, ragged shapes, several launch shapes
//! (the `selftest` cases, which `harpe selftest` runs on a GPU); plus the cross-entropy kernel against
//! `model::loss::chunked_cross_entropy` end to end (nll and both gradients through the matmuls), in-place
//! dlogits, the RMSNorm kernels against the op's autograd, and the emulator's collectives.
use crate::common::ops::{fwd_bwd, max_abs_diff, projection, randn, randv};
use candle_core::{DType, Device, Tensor};
use harpe::model::loss::chunked_cross_entropy;
use harpe::ops::cross_entropy_chunk::IGNORE_INDEX;
use harpe::ops::emu::{self as emu, Dims};
use harpe::tools::selftest::{self, Check, Dt, Target};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

type CaseFn = fn(&Target, Dt, &mut ChaCha8Rng) -> anyhow::Result<Vec<Check>>;

/// Four seeds x both dtypes: each draws new ragged sizes, tables and launch shapes.
fn for_seeds(f: CaseFn) {
    for seed in 0..4u64 {
        for dt in [Dt::F32, Dt::Bf16] {
            let mut r = ChaCha8Rng::seed_from_u64(seed * 7 + 1);
            let checks = f(&Target::Emulated, dt, &mut r).unwrap();
            assert!(!checks.is_empty());
            for c in &checks {
                assert!(
                    c.pass,
                    "{} {:?} {}: max err {:e} > bound {:e} ({})",
                    c.kernel, c.dtype, c.case, c.max_err, c.bound, c.rule
                );
            }
        }
    }
}

#[test]
fn rope_forward_and_backward_match_the_cpu_reference() {
    for_seeds(selftest::rope_checks);
}

#[test]
fn rms_norm_forward_dx_dw_match_the_cpu_reference() {
    for_seeds(selftest::rms_norm_checks);
}

#[test]
fn cross_entropy_nll_and_dlogits_match_the_cpu_reference() {
    for_seeds(selftest::cross_entropy_checks);
}

#[test]
fn adamw_and_grad_norm_match_the_optimizer() {
    for_seeds(selftest::adamw_checks);
}

#[test]
fn cross_entropy_kernel_reproduces_chunked_cross_entropy_and_its_gradients() {
    // hidden (N, C), lm head (V, C): logits by matmul, then the kernel, then dh = dl W, dW = dl^T h,
    // exactly the GPU path's chunk loop; against loss.rs's op and its autograd.
    let (n, c, v) = (11, 7, 53);
    let dev = Device::Cpu;
    let (h, w) = (randn(&[n, c], 1, 1.0), randn(&[v, c], 2, 1.0));
    let mut ys: Vec<u32> = (0..n as u32).map(|i| (i * 13 + 5) % v as u32).collect();
    ys[4] = IGNORE_INDEX;
    let t = Tensor::from_vec(ys.clone(), n, &dev).unwrap();
    let vals = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    // the op's nll and, through its autograd, dh and dW of sum(nll * up), `up` the harness's projection
    let r = fwd_bwd("chunked_cross_entropy", |x| chunked_cross_entropy(&x[0], &x[1], &t, 4), &[h.clone(), w.clone()]);
    let (nll_ref, dh_ref, dw_ref) = (vals(&r.out), vals(&r.grads[0]), vals(&r.grads[1]));
    let up = vals(&projection(r.out.shape(), DType::F32));

    let mut dh = vec![0f32; n * c];
    let mut dw = Tensor::zeros((v, c), DType::F32, &dev).unwrap();
    let mut nll = Vec::new();
    for (start, len) in [(0usize, 4usize), (4, 4), (8, 3)] {
        let hc = h.narrow(0, start, len).unwrap();
        let logits = hc.matmul(&w.t().unwrap()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let out = emu::cross_entropy::<f32>(
            &logits,
            &ys[start..start + len],
            Some(&up[start..start + len]),
            (len, v),
            true,
            Dims { grid: 2, block: 64 },
        )
        .unwrap();
        nll.extend(out.nll);
        let dl = Tensor::from_vec(out.dlogits.unwrap(), (len, v), &dev).unwrap();
        let dhc = dl.matmul(&w).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        dh[start * c..(start + len) * c].copy_from_slice(&dhc);
        dw = (dw + dl.t().unwrap().matmul(&hc).unwrap()).unwrap();
    }
    assert!(max_abs_diff(&nll, &nll_ref) < 1e-5);
    assert_eq!(nll[4], 0.0, "the ignored token has no loss");
    assert!(max_abs_diff(&dh, &dh_ref) < 1e-5);
    assert!(dh[4 * c..5 * c].iter().all(|&x| x == 0.0), "the ignored token gets no gradient");
    assert!(max_abs_diff(&dw.flatten_all().unwrap().to_vec1::<f32>().unwrap(), &dw_ref) < 1e-5);
}

#[test]
fn cross_entropy_in_place_equals_out_of_place_and_forward_only_skips_dlogits() {
    let (n, v) = (5, 77);
    let logits = randv(n * v, 3, 4.0);
    let ys = vec![0u32, 76, IGNORE_INDEX, 40, 3];
    let g = vec![1.0f32, 0.5, 2.0, 0.25, 1.5];
    let d = Dims { grid: 3, block: 32 };
    let a = emu::cross_entropy::<f32>(&logits, &ys, Some(&g), (n, v), true, d).unwrap();
    let b = emu::cross_entropy::<f32>(&logits, &ys, Some(&g), (n, v), false, d).unwrap();
    assert_eq!(a.dlogits, b.dlogits);
    assert_eq!(a.nll, b.nll);
    // each row of dlogits sums to 0 (softmax minus one-hot), an ignored row is all zero
    let dl = a.dlogits.unwrap();
    for i in 0..n {
        let s: f32 = dl[i * v..(i + 1) * v].iter().sum();
        assert!(s.abs() < 1e-5, "row {i} sums to {s}");
    }
    assert!(dl[2 * v..3 * v].iter().all(|&x| x == 0.0));
    let f = emu::cross_entropy::<f32>(&logits, &ys, None, (n, v), false, d).unwrap();
    assert!(f.dlogits.is_none());
    assert_eq!(f.nll, a.nll);
    // lse is the log-sum-exp of each row
    for i in 0..n {
        let row = &logits[i * v..(i + 1) * v];
        let lse = row.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
        assert!((f.lse[i] as f64 - lse).abs() < 1e-5, "row {i}: {} vs {lse}", f.lse[i]);
    }
}

#[test]
fn rms_norm_kernels_match_the_ops_autograd() {
    // the op's backward (RmsNormBwd) and the slow plain-op version's autograd against the kernels
    let (n, c) = (6, 45);
    let (x, w) = (randn(&[n, c], 4, 2.0), randn(&[c], 5, 1.0));
    let slow = |t: &[Tensor]| harpe::ops::rms_norm::rms_norm_slow(&t[0], &t[1], 1e-6);
    let r = fwd_bwd("rms_norm_slow", slow, &[x.clone(), w.clone()]);
    let vals = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (xs, ws, dy) = (vals(&x), vals(&w), vals(&projection(r.out.shape(), DType::F32)));
    let d = Dims { grid: 4, block: 64 };
    let (yk, rstd) = emu::rms_norm_fwd::<f32>(&xs, &ws, (n, c), 1e-6, d).unwrap();
    let (dx, dw) = emu::rms_norm_bwd::<f32>(&dy, &xs, &ws, Some(&rstd), (n, c), 1e-6, d).unwrap();
    assert!(max_abs_diff(&yk, &vals(&r.out)) < 1e-5);
    let (dx_ref, dw_ref) = (vals(&r.grads[0]), vals(&r.grads[1]));
    assert!(max_abs_diff(&dx, &dx_ref) < 1e-5, "{}", max_abs_diff(&dx, &dx_ref));
    assert!(max_abs_diff(&dw, &dw_ref) < 1e-4, "{}", max_abs_diff(&dw, &dw_ref));
}

#[test]
fn launch_shape_does_not_change_results() {
    // one block per row, fewer blocks than rows, wide and narrow blocks: identical bits for per-row
    // kernels whose reduction order depends only on the block size.
    let (n, c) = (9, 100);
    let x = randv(n * c, 7, 1.0);
    let w = randv(c, 8, 1.0);
    let (a, _) = emu::rms_norm_fwd::<f32>(&x, &w, (n, c), 1e-5, Dims { grid: 9, block: 64 }).unwrap();
    let (b, _) = emu::rms_norm_fwd::<f32>(&x, &w, (n, c), 1e-5, Dims { grid: 2, block: 64 }).unwrap();
    assert_eq!(a, b);
    let s1 = emu::grad_sumsq(&x, Dims { grid: 1, block: 32 }).unwrap();
    let s2 = emu::grad_sumsq(&x, Dims { grid: 3, block: 256 }).unwrap();
    let exact: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    assert!((s1 - exact).abs() < 1e-9 && (s2 - exact).abs() < 1e-9);
}

#[test]
fn bad_launches_and_lengths_are_errors_not_crashes() {
    let x = vec![0f32; 10];
    let w = vec![1f32; 5];
    let e = emu::rms_norm_fwd::<f32>(&x, &w, (2, 5), 1e-5, Dims { grid: 1, block: 48 }).unwrap_err().to_string();
    assert!(e.contains("multiple of 32"), "{e}");
    let e = emu::rms_norm_fwd::<f32>(&x, &w, (3, 5), 1e-5, Dims { grid: 1, block: 32 }).unwrap_err().to_string();
    assert!(e.contains("`x` has 10 elements, expected 15"), "{e}");
    let e = emu::rope::<f32>(&x, &x, &x, (1, 3, 1, 10), 2, 1.0, Dims { grid: 1, block: 32 }).unwrap_err().to_string();
    assert!(e.contains("multiple of Htab"), "{e}");
}

#[test]
fn bf16_store_rounds_to_nearest_even_like_half() {
    // AdamW with lr = 0 leaves the master as it is and writes it to bf16: the emulator's conversion
    // must agree with half's on ties (1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6), tiny, huge and NaN values
    let vals: Vec<f32> = vec![1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -2.5e-3, 3.0e38, 1.0e-40, 0.1, -7.77, f32::NAN];
    let n = vals.len();
    let (mut master, mut m, mut v) = (vals.clone(), vec![0f32; n], vec![0f32; n]);
    let mut out = vec![half::bf16::ZERO; n];
    let a = emu::AdamWArgs {
        lr: 0.0,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        wd: 0.0,
        step_size: 0.0,
        bc2_sqrt: 1.0,
        grad_scale: 1.0,
    };
    emu::adamw::<half::bf16>(
        &mut master,
        &mut m,
        &mut v,
        &vec![0f32; n],
        Some(&mut out),
        a,
        Dims { grid: 1, block: 32 },
    )
    .unwrap();
    for (i, (&got, &x)) in out.iter().zip(&vals).enumerate() {
        let want = half::bf16::from_f32(x);
        assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{i}: {x} -> {got} vs {want}");
    }
    assert_eq!(out[0].to_f32(), 1.0);
    assert_eq!(out[1].to_f32(), 1.0 + 4.0 / 256.0);
}
