//! The GEMM-block CPU attention (`ops::attention_gemm`, what `attention` runs) against the scalar
//! reference loops of the same op (`attention_with(.., CpuKernel::Reference)`), forward and backward, on shapes that cross
//! its query (64) and key (128) block edges: ragged, GQA / MQA / MHA, training (Tq = Tk), chunked
//! prefill and single-token decode (Tq < Tk), full attention, large logits, and the backward's split
//! over key ranges when threads outnumber B * Hkv.
//! Forward and backward through `common::ops::check_op` (its f32 rule); the other comparisons are
//! `rel_err(.., 1.0)`: scaled by the reference's largest entry, at least 1.
use crate::common::ops::{check_op, fwd_bwd, max_abs, randn, rel_err, Tol};
use candle_core::{Device, Tensor};
use harpe::model::attention::AttentionImpl;
use harpe::ops::attention::{attention, attention_slow, attention_with, CpuKernel};

#[allow(clippy::too_many_arguments)]
fn case(b: usize, h: usize, hkv: usize, tq: usize, tk: usize, d: usize, causal: bool, amp: f32) {
    let q = randn(&[b, h, tq, d], 31 + tq as u64, amp);
    let k = randn(&[b, hkv, tk, d], 32 + tk as u64, amp);
    let v = randn(&[b, hkv, tk, d], 33, 1.0);
    compare(&q, &k, &v, causal, &format!("b{b} h{h} hkv{hkv} tq{tq} tk{tk} d{d} causal {causal} amp {amp}"));
}

/// The fast op against the reference loops on these inputs, forward and dq, dk, dv (`check_op`).
fn compare(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, tag: &str) {
    compare_within(q, k, v, causal, tag, Tol::F32);
}

fn compare_within(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, tag: &str, tol: Tol) {
    let scale = 1.0 / (q.dim(3).unwrap() as f32).sqrt();
    check_op(
        tag,
        |x| attention(&x[0], &x[1], &x[2], scale, causal, None),
        |x| attention_with(&x[0], &x[1], &x[2], scale, causal, None, CpuKernel::Reference),
        &[q.clone(), k.clone(), v.clone()],
        tol,
    );
}

#[test]
fn gemm_attention_matches_reference_training_shapes() {
    case(2, 4, 2, 300, 300, 16, true, 1.0); // GQA, ragged last query and key block (128 + 128 + 44, 256 + 44)
    case(1, 2, 2, 129, 129, 64, true, 1.0); // MHA, head dim 64, one row past a query block
    case(1, 3, 1, 128, 128, 8, true, 1.0); // MQA, exactly one query block
    case(1, 2, 1, 516, 516, 4, true, 1.0); // key blocks 256 + 256 + 4
    case(1, 4, 2, 1100, 1100, 8, true, 1.0); // >= 1024 keys: K^T (and V^T) made first, 4 key blocks + 76
}

#[test]
fn gemm_attention_matches_reference_prefill_and_decode() {
    case(1, 4, 2, 70, 600, 8, true, 1.0); // chunked prefill: 70 new rows after 530 cached keys
    case(2, 4, 2, 1, 513, 8, true, 1.0); // single-token decode over a KV cache (256 + 256 + 1 keys)
    case(1, 2, 1, 3, 5, 8, true, 1.0); // tiny
}

#[test]
fn gemm_attention_matches_reference_full_and_large_logits() {
    case(1, 2, 2, 260, 77, 8, false, 1.0); // full attention, Tq > Tk
    case(1, 2, 1, 300, 300, 8, true, 6.0); // logits up to ~100: online softmax rescaling across key blocks
}

/// Scores that climb along the keys (key j scaled by 0.05 j, queries positive): every key block's
/// scores rise far above the row's softmax reference, so the forward rebases rows block after block
/// (re-running the row's block product and rescaling; `attention_gemm::REBASE_ABOVE`), and with the
/// climb reversed never does (later blocks' exponentials are tiny against the reference).
#[test]
fn gemm_attention_matches_reference_when_scores_climb_across_key_blocks() {
    let (h, t, d) = (2, 700, 8);
    let q = (randn(&[1, h, t, d], 41, 0.1) + 1.0).unwrap();
    let ramp: Vec<f32> = (0..t).map(|j| 0.05 * j as f32).collect();
    let ramp = Tensor::from_vec(ramp, (1, 1, t, 1), &Device::Cpu).unwrap();
    let k = (randn(&[1, 1, t, d], 42, 0.1) + 1.0).unwrap();
    let v = randn(&[1, 1, t, d], 43, 1.0);
    let climbing = k.broadcast_mul(&ramp).unwrap();
    let falling = k.broadcast_mul(&(ramp.max_keepdim(2).unwrap().broadcast_sub(&ramp).unwrap())).unwrap();
    for (name, k) in [("climbing", climbing), ("falling", falling)] {
        let top = max_abs(&k) * max_abs(&q) * d as f64 / (d as f64).sqrt();
        assert!(top > 80.0, "{name}: scores reach {top}: no block rises 16 above the one before");
        // scores near 100: exp(s - m) carries s's rounding (100 x 2^-24), which the two summation orders
        // meet differently; full attention measured 1.9e-5 of the largest output
        let tol = Tol { fwd: 3e-5, grad: 3e-5 };
        compare_within(&q, &k, &v, true, name, tol);
        compare_within(&q, &k, &v, false, name, tol);
    }
}

#[test]
fn gemm_attention_backward_split_over_key_ranges_matches_reference() {
    // more threads than B * Hkv tasks: the backward cuts each head's keys into ranges (private dQ sums)
    let pool = rayon::ThreadPoolBuilder::new().num_threads(8).build().unwrap();
    pool.install(|| {
        case(1, 2, 1, 600, 600, 8, true, 1.0); // ranges of 256 keys: 256 + 256 + 88
        case(1, 4, 2, 70, 1200, 8, true, 1.0); // chunked prefill: early ranges are all cached keys
        case(2, 2, 1, 513, 513, 16, true, 1.0);
        case(1, 2, 1, 260, 400, 8, false, 1.0); // full attention
    });
}

#[test]
fn gemm_attention_matches_full_matrix_version() {
    // independent of the op's own reference: the plain-candle (Tq x Tk) version
    let (q, k, v) = (randn(&[1, 4, 90, 8], 1, 1.0), randn(&[1, 2, 200, 8], 2, 1.0), randn(&[1, 2, 200, 8], 3, 1.0));
    let e = rel_err(
        &attention(&q, &k, &v, 0.5, true, None).unwrap(),
        &attention_slow(&q, &k, &v, 0.5, true, None).unwrap(),
        1.0,
    );
    assert!(e < 1e-5, "forward vs slow differs by {e}");
}

#[test]
fn cpu_default_is_the_gemm_op() {
    let imp = AttentionImpl::for_device(&Device::Cpu);
    assert!(matches!(imp, AttentionImpl::Cpu), "CPU default is {imp:?}");
    let (q, k, v) = (randn(&[1, 2, 9, 8], 4, 1.0), randn(&[1, 1, 9, 8], 5, 1.0), randn(&[1, 1, 9, 8], 6, 1.0));
    let via_seam = imp.attend(&q, &k, &v, 0.3, true).unwrap();
    let e = rel_err(&via_seam, &attention_with(&q, &k, &v, 0.3, true, None, CpuKernel::Reference).unwrap(), 1.0);
    assert!(e < 1e-5, "seam vs reference differs by {e}");
}

#[test]
fn gemm_attention_backward_is_the_same_on_every_run() {
    // the key-range split sums private dQ parts: their order must not follow rayon's run-time splits
    let (q, k, v) = (randn(&[1, 4, 300, 8], 11, 1.0), randn(&[1, 1, 300, 8], 12, 1.0), randn(&[1, 1, 300, 8], 13, 1.0));
    let pool = rayon::ThreadPoolBuilder::new().num_threads(8).build().unwrap();
    let grads = || {
        pool.install(|| {
            let g = fwd_bwd(
                "attention",
                |x| attention(&x[0], &x[1], &x[2], 0.35, true, None),
                &[q.clone(), k.clone(), v.clone()],
            );
            g.grads.iter().map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect::<Vec<_>>()
        })
    };
    let first = grads();
    for _ in 0..12 {
        assert!(grads() == first, "two runs of the same backward differ");
    }
}
