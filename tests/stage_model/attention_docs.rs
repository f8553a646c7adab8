//! Document masks of packed sequences (`ops::attention::{attention, DocStarts}` with `docs: Some(..)`, `train.document_mask`):
//! the CPU op (GEMM blocks and reference loops) forward and backward (dQ, dK, dV through the op's own
//! backward) against the dense-mask slow op (segment ids compared element by element) and the blocked reference; one document
//! equals plain causal attention bit for bit; `DocStarts` refuses malformed starts; the model seam refuses an
//! attention that cannot mask; and a packed sequence of two documents gives the second document's tokens
//! the logits of that document alone at the same (packed) positions.
use crate::common::ops::{check_op, fwd_bwd, max_abs_diff, Tol};
use candle_core::{DType, Device, Tensor};
use harpe::model::attention::{AttentionFn, AttentionImpl};
use harpe::model::llama::Tokens;
use harpe::model::rope::RopeScheme;
use harpe::model::testing::tiny_config;
use harpe::model::weights::init_random;
use harpe::model::Llama;
use harpe::ops::attention::{attention, attention_blocked, attention_slow, attention_with, CpuKernel, DocStarts};
use std::sync::Arc;

fn make(shape: (usize, usize, usize, usize), seed: f32) -> Tensor {
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let v: Vec<f32> = (0..n).map(|i| ((i as f32 * 0.731 + seed).sin() * 1.3).tanh()).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// (O, dQ, dK, dV) of `f` on q, k, v (`common::ops::fwd_bwd`).
fn outputs(name: &str, f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>, qkv: &[Tensor; 3]) -> Vec<Tensor> {
    let g = fwd_bwd(name, f, qkv);
    [vec![g.out], g.grads].concat()
}

/// (B, H, Hkv, T, D).
type Shape5 = (usize, usize, usize, usize, usize);

/// Shapes and each sequence's document starts: lengths 1, 17, uneven, a batch with two packings.
fn cases() -> Vec<(Shape5, Vec<Vec<usize>>)> {
    vec![
        ((1, 2, 2, 1, 8), vec![vec![0]]),
        ((1, 4, 2, 40, 8), vec![vec![0, 1, 18, 23]]),
        ((2, 4, 1, 33, 16), vec![vec![5, 22], vec![0, 17, 32]]),
        ((1, 2, 1, 20, 8), vec![vec![7]]),
        // GEMM blocks of 128 queries x 256 keys: documents crossing both, a query block past whole key blocks
        ((1, 2, 1, 600, 8), vec![vec![1, 140, 300, 599]]),
        // >= 1024 keys: the GEMMs read K^T and V^T made first
        ((1, 2, 1, 1100, 8), vec![vec![3, 500, 1030]]),
    ]
}

#[test]
fn reference_loops_match_the_dense_mask_slow_op_forward_and_backward() {
    for (n, ((b, h, hkv, t, d), starts)) in cases().into_iter().enumerate() {
        let st: Vec<&[usize]> = starts.iter().map(|s| s.as_slice()).collect();
        let docs = DocStarts::from_starts(&st, t, &Device::Cpu).unwrap();
        let qkv = [make((b, h, t, d), n as f32), make((b, hkv, t, d), 1.1), make((b, hkv, t, d), 2.3)];
        let scale = 1.0 / (d as f32).sqrt();
        let slow = |x: &[Tensor]| attention_slow(&x[0], &x[1], &x[2], scale, true, Some(&docs));
        type Op<'a> = &'a dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>;
        let gemm = |x: &[Tensor]| attention(&x[0], &x[1], &x[2], scale, true, Some(&docs));
        let loops = |x: &[Tensor]| attention_with(&x[0], &x[1], &x[2], scale, true, Some(&docs), CpuKernel::Reference);
        let blocked = |x: &[Tensor]| attention_blocked(&x[0], &x[1], &x[2], scale, true, Some(&docs), 7);
        let ops: [(&str, Op); 3] =
            [("GEMM blocks", &gemm), ("reference loops", &loops), ("blocked reference", &blocked)];
        if t == 1 {
            // one token attends to itself alone: O = V, and dQ = dK = 0 (the softmax of one logit is 1),
            // which `check_op` would take for a dead backward
            let want = outputs("slow", slow, &qkv);
            for (name, op) in ops {
                for (i, (a, r)) in outputs(name, op, &qkv).iter().zip(&want).enumerate() {
                    assert!(max_abs_diff(a, r) < 1e-6, "case {n}: output {i} of the {name} differs from slow");
                }
            }
            continue;
        }
        let [_, refs] = check_op(&format!("case {n}: GEMM blocks"), gemm, slow, &qkv, Tol::F32);
        for (name, op) in &ops[1..] {
            check_op(&format!("case {n}: {name}"), op, slow, &qkv, Tol::F32);
        }
        // the mask is real: without it the output differs
        let [q, k, v] = &qkv;
        let causal = attention_with(q, k, v, scale, true, None, CpuKernel::Reference).unwrap();
        assert!(max_abs_diff(&causal, &refs.out) > 1e-3, "case {n}: the document mask changed nothing");
    }
}

#[test]
fn one_document_equals_causal_attention_bit_for_bit() {
    let (b, h, hkv, t, d) = (2, 4, 2, 37, 16);
    let docs = DocStarts::from_starts(&[&[], &[0]], t, &Device::Cpu).unwrap();
    let qkv = [make((b, h, t, d), 0.3), make((b, hkv, t, d), 1.2), make((b, hkv, t, d), 2.1)];
    let with = |docs: Option<&DocStarts>, kernel: CpuKernel, x: &[Tensor]| {
        attention_with(&x[0], &x[1], &x[2], 0.25, true, docs, kernel)
    };
    let plain = outputs("loops", |x| with(None, CpuKernel::Reference, x), &qkv);
    let masked = outputs("loops, one document", |x| with(Some(&docs), CpuKernel::Reference, x), &qkv);
    let plain_gemm = outputs("gemm", |x| attention(&x[0], &x[1], &x[2], 0.25, true, None), &qkv);
    let masked_gemm = outputs("gemm, one document", |x| attention(&x[0], &x[1], &x[2], 0.25, true, Some(&docs)), &qkv);
    for i in 0..4 {
        assert_eq!(max_abs_diff(&plain[i], &masked[i]), 0.0, "reference loops: output {i}");
        assert_eq!(max_abs_diff(&plain_gemm[i], &masked_gemm[i]), 0.0, "GEMM blocks: output {i}");
    }
}

#[test]
fn doc_starts_expand_offsets_and_refuse_malformed_ones() {
    let ds = DocStarts::from_starts(&[&[7, 3], &[0, 1]], 10, &Device::Cpu).unwrap();
    assert_eq!(ds.host(), &[0, 0, 0, 3, 3, 3, 3, 7, 7, 7, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1]);
    assert_eq!(ds.tensor().dims(), &[2, 10]);
    assert_eq!(ds.tensor().dtype(), DType::U32);
    let e = DocStarts::from_starts(&[&[10]], 10, &Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("10"), "{e}");
    // token 2 cannot start at 1 when token 1 started at 0
    let e = DocStarts::from_per_token(vec![0, 0, 1], 1, 3, &Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("token 2"), "{e}");
    // starts for another batch or length are refused by the op, naming both
    let (q, k) = (make((1, 2, 10, 8), 0.0), make((1, 2, 10, 8), 1.0));
    let e = attention(&q, &k, &k, 1.0, true, Some(&ds)).unwrap_err().to_string();
    assert!(e.contains("B 2") && e.contains("hint:"), "{e}");
}

#[derive(Debug)]
struct NoMask;

impl AttentionFn for NoMask {
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, causal: bool) -> candle_core::Result<Tensor> {
        AttentionImpl::Cpu.attend(q, k, v, scale, causal)
    }
}

#[test]
fn an_attention_without_document_masks_is_refused_with_a_hint() {
    let imp = AttentionImpl::Custom(Arc::new(NoMask));
    assert!(!imp.supports_document_mask());
    for builtin in
        [AttentionImpl::Cpu, AttentionImpl::CpuReference, AttentionImpl::Flash, AttentionImpl::Blocked { block: 4 }]
    {
        assert!(builtin.supports_document_mask(), "{builtin:?}");
    }
    let q = make((1, 2, 6, 8), 0.0);
    let docs = DocStarts::from_starts(&[&[3]], 6, &Device::Cpu).unwrap();
    let e = imp.attend_doc(&q, &q, &q, 1.0, &docs).unwrap_err().to_string();
    assert!(e.contains("train.document_mask") && e.contains("hint:"), "{e}");
    // the trainer refuses it before the first step, naming the key; with the key off it runs
    let e = harpe::train::check_document_mask("run.toml", true, &imp).unwrap_err().to_string();
    assert!(e.contains("run.toml") && e.contains("train.document_mask = true") && e.contains("hint:"), "{e}");
    harpe::train::check_document_mask("run.toml", false, &imp).unwrap();
    harpe::train::check_document_mask("run.toml", true, &AttentionImpl::Cpu).unwrap();
}

/// A batch's document starts come from the loader's `Sequence::doc_starts`; a sequence that opens inside
/// a document (no start at 0) has that piece as its first document.
#[test]
fn batch_document_starts_come_from_the_loaded_sequences() {
    let seq = |starts: Vec<usize>| harpe::data::Sequence {
        tokens: vec![1; 8],
        sources: vec![],
        doc_starts: starts,
        index: 0,
        epoch: 0,
    };
    let ds = harpe::train::doc_starts(&[seq(vec![0, 3]), seq(vec![5])], &Device::Cpu).unwrap();
    assert_eq!(ds.host(), &[0, 0, 0, 3, 3, 3, 3, 3, 0, 0, 0, 0, 0, 5, 5, 5]);
}

/// A packed sequence [doc A (9 tokens) | doc B (14 tokens)] under the document mask: B's tokens get the
/// logits of B alone run at B's packed positions 9.. (RoPE positions are not reset per document), and
/// differ from the unmasked run.
#[test]
fn second_document_of_a_packed_sequence_sees_only_itself() {
    let mut cfg = tiny_config(RopeScheme::Harpe { head_bases: vec![1e4, 1e6], layer_head_bases: None });
    cfg.initializer_range = 0.2;
    let t = init_random(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    let m = Llama::from_tensors(cfg, t.into_iter().collect(), "test").unwrap();
    let (la, lb) = (9usize, 14usize);
    let ids: Vec<u32> = (0..la + lb).map(|i| ((i * 53 + 7) % 259) as u32).collect();
    let packed = Tensor::from_vec(ids.clone(), (1, la + lb), &Device::Cpu).unwrap();
    let alone = Tensor::from_vec(ids[la..].to_vec(), (1, lb), &Device::Cpu).unwrap();
    let docs = DocStarts::from_starts(&[&[0, la]], la + lb, &Device::Cpu).unwrap();
    for imp in [AttentionImpl::Cpu, AttentionImpl::CpuReference, AttentionImpl::Blocked { block: 5 }] {
        let m = m.clone().with_attention(imp.clone());
        let masked = m.logits(&m.forward(&packed, Tokens::Packed(0, &docs)).unwrap()).unwrap(); // (1, T, V)
        let b_alone = m.logits(&m.forward(&alone, Tokens::At(la)).unwrap()).unwrap(); // (1, lb, V)
        let b_masked = masked.narrow(1, la, lb).unwrap();
        let e = max_abs_diff(&b_masked, &b_alone);
        assert!(e < 1e-4, "{imp:?}: document B's logits differ from B alone by {e}");
        // document A is a prefix: its logits equal A alone at positions 0..
        let a_alone = m.logits(&m.forward(&packed.narrow(1, 0, la).unwrap(), Tokens::At(0)).unwrap()).unwrap();
        assert!(max_abs_diff(&masked.narrow(1, 0, la).unwrap(), &a_alone) < 1e-4, "{imp:?}: document A");
        let unmasked = m.logits(&m.forward(&packed, Tokens::At(0)).unwrap()).unwrap();
        assert!(
            max_abs_diff(&unmasked.narrow(1, la, lb).unwrap(), &b_alone) > 1e-3,
            "{imp:?}: the mask changed nothing"
        );
    }
}
