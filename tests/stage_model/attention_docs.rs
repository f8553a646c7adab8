//! Document masks of packed sequences (`ops::attention::{attention, DocStarts}` with `docs: Some(..)`, `train.document_mask`):
//! the CPU op (GEMM blocks and reference loops) forward and backward (dQ, dK, dV through the op's own
//! backward) against the dense-mask slow op (segment ids compared element by element) and the blocked reference; one document
//! equals plain causal attention bit for bit; `DocStarts` refuses malformed starts; the model seam refuses an
//! attention that cannot mask; and a packed sequence of two documents gives the second document's tokens
//! the logits of that document alone at the same (packed) positions.
use crate::common::ops::max_abs_diff;
use candle_core::{DType, Device, Tensor, Var};
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

type Attn<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>;

/// (O, dQ, dK, dV) of `f` with loss sum(O * W).
fn fwd_bwd(f: Attn, q: &Tensor, k: &Tensor, v: &Tensor, w: &Tensor) -> [Tensor; 4] {
    let (qv, kv, vv) = (Var::from_tensor(q).unwrap(), Var::from_tensor(k).unwrap(), Var::from_tensor(v).unwrap());
    let o = f(qv.as_tensor(), kv.as_tensor(), vv.as_tensor()).unwrap();
    let g = (&o * w).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = |x: &Var| g.get(x.as_tensor()).unwrap().clone();
    [o.clone(), grad(&qv), grad(&kv), grad(&vv)]
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
        let (q, k, v, w) = (
            make((b, h, t, d), n as f32),
            make((b, hkv, t, d), 1.1),
            make((b, hkv, t, d), 2.3),
            make((b, h, t, d), 3.7),
        );
        let scale = 1.0 / (d as f32).sqrt();
        let refs = fwd_bwd(&|q, k, v| attention_slow(q, k, v, scale, true, Some(&docs)), &q, &k, &v, &w);
        let got = fwd_bwd(&|q, k, v| attention(q, k, v, scale, true, Some(&docs)), &q, &k, &v, &w);
        let loops =
            fwd_bwd(&|q, k, v| attention_with(q, k, v, scale, true, Some(&docs), CpuKernel::Reference), &q, &k, &v, &w);
        let blk = fwd_bwd(&|q, k, v| attention_blocked(q, k, v, scale, true, Some(&docs), 7), &q, &k, &v, &w);
        for (i, name) in ["O", "dQ", "dK", "dV"].iter().enumerate() {
            let e = max_abs_diff(&got[i], &refs[i]);
            assert!(e < 2e-5, "case {n}: {name} of the GEMM blocks differs from slow by {e}");
            let e = max_abs_diff(&loops[i], &refs[i]);
            assert!(e < 2e-5, "case {n}: {name} of the reference loops differs from slow by {e}");
            let e = max_abs_diff(&blk[i], &refs[i]);
            assert!(e < 2e-5, "case {n}: {name} of the blocked reference differs from slow by {e}");
        }
        // the mask is real: without it the output differs (every case but the one-token one)
        if t > 1 {
            let causal = attention_with(&q, &k, &v, scale, true, None, CpuKernel::Reference).unwrap();
            assert!(max_abs_diff(&causal, &refs[0]) > 1e-3, "case {n}: the document mask changed nothing");
        }
    }
}

#[test]
fn one_document_equals_causal_attention_bit_for_bit() {
    let (b, h, hkv, t, d) = (2, 4, 2, 37, 16);
    let docs = DocStarts::from_starts(&[&[], &[0]], t, &Device::Cpu).unwrap();
    let (q, k, v, w) =
        (make((b, h, t, d), 0.3), make((b, hkv, t, d), 1.2), make((b, hkv, t, d), 2.1), make((b, h, t, d), 0.9));
    let plain = fwd_bwd(&|q, k, v| attention_with(q, k, v, 0.25, true, None, CpuKernel::Reference), &q, &k, &v, &w);
    let masked =
        fwd_bwd(&|q, k, v| attention_with(q, k, v, 0.25, true, Some(&docs), CpuKernel::Reference), &q, &k, &v, &w);
    let plain_gemm = fwd_bwd(&|q, k, v| attention(q, k, v, 0.25, true, None), &q, &k, &v, &w);
    let masked_gemm = fwd_bwd(&|q, k, v| attention(q, k, v, 0.25, true, Some(&docs)), &q, &k, &v, &w);
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
