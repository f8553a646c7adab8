//! Rotary and attention ops: fused CPU op vs the slow plain-candle version, forward and backward
//! (`common::ops::check_op`), and finite-difference gradient checks of the fused ops in f32 on tiny shapes
//! (`common::ops::fd_check`, `Fd::F32`).
use crate::common::ops::{check_op, fd_check, fwd_bwd, max_abs_diff, projection, randn, Fd, Tol};
use candle_core::{DType, Device, Tensor};
use harpe::model::rope::{Positions, RopeParity, RopeScheme};
use harpe::ops::attention::{attention, attention_slow};
use harpe::ops::rotary::{rope, rope_slow};

fn tables(htab_bases: &[f64], d: usize, t: usize, start: usize) -> (Tensor, Tensor) {
    let scheme = if htab_bases.len() == 1 {
        RopeScheme::Default { theta: htab_bases[0] }
    } else {
        RopeScheme::Harpe { head_bases: htab_bases.to_vec(), layer_head_bases: None }
    };
    let tab = scheme.tables(d, 0, Positions::new(start, t), RopeParity::F64, &Device::Cpu).unwrap();
    (tab.cos, tab.sin)
}

#[test]
fn rotary_matches_slow_forward_and_backward() {
    for (h, bases) in [(4usize, vec![10000.0]), (4, vec![1e4, 5e5]), (2, vec![1e4, 5e5]), (3, vec![1e4, 2e4, 3e4])] {
        let (b, t, d) = (2, 7, 8);
        let (cos, sin) = tables(&bases, d, t, 100);
        check_op(
            &format!("rope h {h} tables {}", bases.len()),
            |x| rope(&x[0], &cos, &sin),
            |x| rope_slow(&x[0], &cos, &sin),
            &[randn(&[b, h, t, d], 1, 1.0)],
            Tol::F32,
        );
    }
}

#[test]
fn rotary_reads_strided_rows_like_the_reference_forward_and_backward() {
    // the model's layout: projections (B, T, H, D) seen as (B, H, T, D) through a transpose, no copy
    use harpe::ops::rotary::{rotary_cpu, rotary_par};
    let (b, t, h, d) = (2, 9, 4, 8);
    let (cos, sin) = tables(&[1e4, 5e5], d, t, 3);
    let x = randn(&[b, t, h, d], 7, 1.0);
    let strided = |x: &Tensor| {
        let xt = x.transpose(1, 2).unwrap(); // (B, H, T, D), strided
        assert!(!xt.is_contiguous());
        xt
    };
    check_op(
        "rope of strided rows",
        |x| rope(&strided(&x[0]), &cos, &sin),
        |x| rope_slow(&strided(&x[0]).contiguous()?, &cos, &sin),
        std::slice::from_ref(&x),
        Tol::F32,
    );
    // the parallel strided loops against the readable reference loops, bit for bit
    let xt = strided(&x);
    let vals = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (c, s) = (vals(&cos), vals(&sin));
    let xs = vals(&x);
    let reference = rotary_cpu(&vals(&xt.contiguous().unwrap()), &c, &s, (b, h, t, d), 2);
    assert_eq!(rotary_par(&xs, [t * h * d, d, h * d], &c, &s, (b, h, t, d), 2), reference);
}

#[test]
fn rotary_preserves_norm_and_relative_position() {
    // A rotation: norms are kept; q.k after RoPE depends only on the position difference.
    let d = 16;
    let q = randn(&[1, 1, 1, d], 3, 1.0);
    let k = randn(&[1, 1, 1, d], 4, 1.0);
    let dot_at = |m: usize, n: usize| -> f32 {
        let (cq, sq) = tables(&[5e5], d, 1, m);
        let (ck, sk) = tables(&[5e5], d, 1, n);
        let rq = rope(&q, &cq, &sq).unwrap();
        let rk = rope(&k, &ck, &sk).unwrap();
        (rq * rk).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()
    };
    assert!((dot_at(10, 3) - dot_at(1007, 1000)).abs() < 1e-4);
    let (c, s) = tables(&[5e5], d, 1, 123_456);
    let r = rope(&q, &c, &s).unwrap();
    let n0 = q.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
    let n1 = r.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
    assert!((n0 - n1).abs() < 1e-5);
}

#[test]
fn rotary_finite_differences() {
    let (cos, sin) = tables(&[1e4, 1e6], 8, 5, 3);
    let x = randn(&[1, 4, 5, 8], 5, 1.0);
    let g = fwd_bwd("rotary", |x| rope(&x[0], &cos, &sin), std::slice::from_ref(&x));
    let w = projection(g.out.shape(), DType::F32);
    let loss = |x: &Tensor| (rope(x, &cos, &sin).unwrap() * &w).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
    fd_check("rotary", &x, |x| loss(x) as f64, &g.grads[0], Fd::F32);
}

fn attn_case(b: usize, h: usize, hkv: usize, tq: usize, tk: usize, d: usize, causal: bool) {
    let qkv = [randn(&[b, h, tq, d], 11, 1.0), randn(&[b, hkv, tk, d], 12, 1.0), randn(&[b, hkv, tk, d], 13, 1.0)];
    let scale = 1.0 / (d as f32).sqrt() * 2.0;
    check_op(
        &format!("attention b{b} h{h} hkv{hkv} tq{tq} tk{tk} causal {causal}"),
        |x| attention(&x[0], &x[1], &x[2], scale, causal, None),
        |x| attention_slow(&x[0], &x[1], &x[2], scale, causal, None),
        &qkv,
        Tol::F32,
    );
}

#[test]
fn attention_matches_slow_forward_and_backward() {
    attn_case(2, 4, 2, 9, 9, 8, true); // GQA, causal
    attn_case(1, 4, 4, 5, 5, 8, true); // MHA
    attn_case(1, 4, 1, 3, 11, 8, true); // MQA, decode-style Tq < Tk (KV cache)
    attn_case(1, 2, 2, 6, 6, 8, false); // full attention
    attn_case(1, 2, 1, 150, 150, 4, true); // several key blocks
}

#[test]
fn attention_finite_differences() {
    let qkv = [randn(&[1, 2, 6, 4], 21, 1.0), randn(&[1, 1, 6, 4], 22, 1.0), randn(&[1, 1, 6, 4], 23, 1.0)];
    let g = fwd_bwd("attention", |x| attention(&x[0], &x[1], &x[2], 0.7, true, None), &qkv);
    let w = projection(g.out.shape(), DType::F32);
    // the loss with input `i` replaced by `x`
    let loss = |i: usize, x: &Tensor| {
        let mut a = qkv.clone();
        a[i] = x.clone();
        let y = attention(&a[0], &a[1], &a[2], 0.7, true, None).unwrap();
        (y * &w).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64
    };
    for (i, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
        fd_check(name, &qkv[i], |x| loss(i, x), &g.grads[i], Fd::F32);
    }
}

#[test]
fn attention_is_stable_with_large_logits() {
    // Logits of 1e4 would overflow a naive exp; the online softmax keeps the output finite and exact.
    let q = (randn(&[1, 1, 4, 4], 31, 1.0) * 100.0).unwrap();
    let k = (randn(&[1, 1, 4, 4], 32, 1.0) * 100.0).unwrap();
    let v = randn(&[1, 1, 4, 4], 33, 1.0);
    let y = attention(&q, &k, &v, 1.0, true, None).unwrap();
    let ys = attention_slow(&q, &k, &v, 1.0, true, None).unwrap();
    assert!(y.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().all(|x| x.is_finite()));
    assert!(max_abs_diff(&y, &ys) < 1e-4);
}

#[test]
fn bf16_inputs_are_computed_in_f32_and_cast_back() {
    let q = randn(&[1, 2, 5, 8], 41, 1.0).to_dtype(DType::BF16).unwrap();
    let k = randn(&[1, 2, 5, 8], 42, 1.0).to_dtype(DType::BF16).unwrap();
    let y = attention(&q, &k, &k, 0.3, true, None).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    let (cos, sin) = tables(&[1e4], 8, 5, 0);
    let r = rope(&q, &cos, &sin).unwrap();
    assert_eq!(r.dtype(), DType::BF16);
    // Values: against the f32 reference on the same (bf16-rounded) inputs, the fused ops must be within
    // 2x the error of a naive bf16 computation (the ggml / flash-attention criterion), and no worse
    // than one bf16 rounding of the output.
    let (q32, k32) = (q.to_dtype(DType::F32).unwrap(), k.to_dtype(DType::F32).unwrap());
    let want = attention_slow(&q32, &k32, &k32, 0.3, true, None).unwrap();
    let naive = attention_slow(&q, &k, &k, 0.3, true, None).unwrap();
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let (e_fused, e_naive) = (max_abs_diff(&f32_of(&y), &want), max_abs_diff(&f32_of(&naive), &want));
    assert!(e_fused <= 2.0 * e_naive + 1e-6, "attention bf16 error {e_fused} vs naive bf16 {e_naive}");
    assert!(e_fused <= 8e-3, "attention bf16 error {e_fused} is more than an output rounding");
    let want = rope_slow(&q32, &cos, &sin).unwrap();
    let e = max_abs_diff(&f32_of(&r), &want);
    assert!(e <= 2e-2 && e > 0.0, "rope bf16 error {e} (one bf16 rounding of values up to ~4)");
}

/// bf16 backward too: the fused ops compute in f32 and round once, so under `check_op`'s half-precision
/// rule they must be within twice the error of the slow versions differentiated in bf16.
#[test]
fn bf16_forward_and_backward_match_the_slow_versions() {
    let qkv = [41, 42, 43].map(|seed| randn(&[1, 2, 5, 8], seed, 1.0).to_dtype(DType::BF16).unwrap());
    check_op(
        "attention bf16",
        |x| attention(&x[0], &x[1], &x[2], 0.3, true, None),
        |x| attention_slow(&x[0], &x[1], &x[2], 0.3, true, None),
        &qkv,
        Tol::BF16,
    );
    let (cos, sin) = tables(&[1e4, 5e5], 8, 5, 7);
    check_op(
        "rope bf16",
        |x| rope(&x[0], &cos, &sin),
        |x| rope_slow(&x[0], &cos.to_dtype(x[0].dtype())?, &sin.to_dtype(x[0].dtype())?),
        &qkv[..1],
        Tol::BF16,
    );
}

/// Forward and backward of the three attention implementations on one case: the CPU op (with its
/// own backward op) and the blocked reference (query blocks, autograd), each against the slow
/// full-matrix one.
#[allow(clippy::too_many_arguments)]
fn three_way_case(b: usize, h: usize, hkv: usize, tq: usize, tk: usize, d: usize, causal: bool, block: usize) {
    use harpe::ops::attention::attention_blocked;
    let qkv = [randn(&[b, h, tq, d], 51, 1.0), randn(&[b, hkv, tk, d], 52, 1.0), randn(&[b, hkv, tk, d], 53, 1.0)];
    let scale = 0.9;
    let tag = format!("b{b} h{h} hkv{hkv} tq{tq} tk{tk} causal {causal} block {block}");
    let slow = |x: &[Tensor]| attention_slow(&x[0], &x[1], &x[2], scale, causal, None);
    let op = |x: &[Tensor]| attention(&x[0], &x[1], &x[2], scale, causal, None);
    check_op(&format!("op {tag}"), op, slow, &qkv, Tol::F32);
    let blocked = |x: &[Tensor]| attention_blocked(&x[0], &x[1], &x[2], scale, causal, None, block);
    check_op(&format!("blocked {tag}"), blocked, slow, &qkv, Tol::F32);
}

#[test]
fn blocked_reference_matches_op_and_slow_forward_and_backward() {
    three_way_case(2, 4, 2, 9, 9, 8, true, 4); // GQA, causal, last block partial
    three_way_case(1, 4, 1, 3, 11, 8, true, 2); // MQA, decode-style Tq < Tk
    three_way_case(1, 2, 2, 6, 6, 8, false, 4); // full attention
    three_way_case(1, 2, 1, 70, 70, 4, true, 16); // several blocks and key blocks of the op
    three_way_case(1, 2, 2, 5, 5, 4, true, 64); // one block larger than Tq
}
