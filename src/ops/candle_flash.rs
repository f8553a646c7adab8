//! candle-flash-attn's FlashAttention-2 forward as a third CUDA attention (`AttentionImpl::CandleFlash`,
//! `--attention candle-flash`): the fast forward of evaluation and generation, and an independent GPU
//! reference for harpe's own flash forward (`harpe selftest`, `harpe bench attention`).
//!
//! Reference: Dao 2023 (FlashAttention-2); the crate candle-flash-attn 0.11.1 (`flash_attn`,
//! `flash_attn_varlen`: FA2's `csrc/flash_attn` kernels, sm80+). Same contract as `ops::attention`: q
//! (B, H, Tq, D), k, v (B, Hkv, Tk, D), causal aligned bottom-right (query i at key position Tk - Tq + i,
//! FA2's rule since 2.1 and harpe's), so a KV-cached step is the same call.
//! The non-obvious decisions: (1) harpe's (B, H, T, D) tensors go in as (B, T, H, D) *views* (a transpose,
//! no copy: the crate takes any batch, row and head stride with a contiguous last dim) and the output, the
//! crate's contiguous (B, Tq, H, D), comes back as its transposed view; (2) a document mask goes through
//! the varlen entry: the B packed sequences become one flat ragged batch whose sequences are the documents
//! (`cu_seqlens`, read from `DocStarts`: a document never crosses a sequence, so causal per varlen
//! sequence is exactly harpe's per-document causal mask).
//! Everything but the crate call (argument checks, cu_seqlens) compiles and is tested on CPU builds; the
//! call is `cfg(feature = "flash-attn")`, and without it the functions refuse with a hint.
//! Not done here: backward (the crate has none, and candle would stop the gradient silently: `harpe train`
//! refuses it, `model::attention::refuse_for_training`), f32, head dims other than 64 and 128 (the crate
//! has more; these are the ones harpe's tensor-core tiles share and the selftest compares), a document
//! mask with Tq < Tk.
use crate::ops::attention::DocStarts;
use candle_core::{bail, DType, Result, Tensor};

/// Head dims `--attention candle-flash` takes.
pub const HEAD_DIMS: [usize; 2] = [64, 128];

/// The error of a build without the feature (CPU-only or `--features cuda` alone).
pub const NOT_BUILT: &str = "--attention candle-flash: this harpe was built without --features flash-attn\nhint: build with `cargo build --release --features flash-attn` (README \"Build for GPUs\"), or pass --attention harpe";

/// An error unless candle-flash-attn's forward takes this dtype and head dim (naming the limit).
pub fn check_supported(dtype: DType, head_dim: usize) -> Result<()> {
    if !matches!(dtype, DType::BF16 | DType::F16) {
        bail!("--attention candle-flash runs bf16 or f16 only, not {dtype:?}\nhint: pass --dtype bf16, or --attention harpe (harpe's kernels also run f32)");
    }
    if !HEAD_DIMS.contains(&head_dim) {
        bail!("--attention candle-flash takes head dims {HEAD_DIMS:?}, and this model's is {head_dim}\nhint: pass --attention harpe");
    }
    Ok(())
}

/// Shapes of q (B, H, Tq, D), k, v (B, Hkv, Tk, D) checked for the crate: one dtype (bf16/f16), D in
/// `HEAD_DIMS`, H a multiple of Hkv. Returns (B, H, Hkv, Tq, Tk, D).
pub fn check_inputs(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(usize, usize, usize, usize, usize, usize)> {
    let (b, h, tq, d) = q.dims4()?;
    let (bk, hkv, tk, dk) = k.dims4()?;
    if v.dims4()? != (bk, hkv, tk, dk) || bk != b || dk != d {
        bail!(
            "candle-flash attention: q {:?}, k {:?}, v {:?} do not fit (B, H, Tq, D), (B, Hkv, Tk, D) twice\nhint: the same contract as ops::attention",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    if hkv == 0 || h % hkv != 0 {
        bail!("candle-flash attention: {h} query heads are not a multiple of {hkv} kv heads\nhint: GQA needs H % Hkv == 0");
    }
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!(
            "candle-flash attention: q is {:?} but k {:?}, v {:?}\nhint: one dtype for q, k, v",
            q.dtype(),
            k.dtype(),
            v.dtype()
        );
    }
    check_supported(q.dtype(), d)?;
    Ok((b, h, hkv, tq, tk, d))
}

/// An error unless the tensors are on a CUDA device (checked last: shape errors name the shape first).
fn check_cuda(q: &Tensor) -> Result<()> {
    if !q.device().is_cuda() {
        bail!("--attention candle-flash runs on CUDA only (the tensors are on {:?})\nhint: pass --device cuda, or --attention harpe", q.device());
    }
    Ok(())
}

/// The documents of packed sequences as varlen offsets: `DocStarts` per token of (B, T) -> (cu_seqlens,
/// longest document), cu_seqlens = [0, end of document 1, ..., B*T] over the flattened B*T tokens (every
/// sequence opens a document at its first token).
pub fn cu_seqlens(host: &[u32], b: usize, t: usize) -> Result<(Vec<u32>, usize)> {
    if host.len() != b * t || b == 0 || t == 0 {
        bail!(
            "candle-flash attention: {} document starts for B {b} x T {t}\nhint: one start per token (DocStarts)",
            host.len()
        );
    }
    if b * t > i32::MAX as usize {
        bail!("candle-flash attention: B*T = {} tokens is past the varlen entry's i32 offsets\nhint: evaluate fewer sequences at once", b * t);
    }
    let mut cu = vec![0u32];
    let mut longest = 0;
    for (bi, row) in host.chunks(t).enumerate() {
        for (j, &s) in row.iter().enumerate() {
            if s as usize == j && j > 0 {
                cu.push((bi * t + j) as u32);
            }
        }
        cu.push(((bi + 1) * t) as u32);
    }
    for w in cu.windows(2) {
        longest = longest.max((w[1] - w[0]) as usize);
    }
    Ok((cu, longest))
}

/// Attention of q (B, H, Tq, D) over k, v (B, Hkv, Tk, D) -> (B, H, Tq, D) with candle-flash-attn's
/// forward (no gradient). Causal aligned bottom-right (Tq <= Tk: a prefill chunk or decode step).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, causal: bool) -> Result<Tensor> {
    check_inputs(q, k, v)?;
    check_cuda(q)?;
    imp::dense(q, k, v, scale, causal)
}

/// Per-document causal attention of packed sequences (query i sees keys j <= i of its own document)
/// through the crate's varlen entry; q (B, H, T, D), k, v (B, Hkv, T, D) -> (B, H, T, D).
pub fn attention_doc(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, docs: &DocStarts) -> Result<Tensor> {
    let (b, _h, _hkv, tq, tk, _d) = check_inputs(q, k, v)?;
    if tq != tk {
        bail!("--attention candle-flash: a document mask needs as many queries as keys (Tq {tq}, Tk {tk})\nhint: pass --attention harpe for document masks under a KV cache");
    }
    if docs.dims() != (b, tk) {
        bail!(
            "candle-flash attention: document starts are for {:?} but k has B {b}, Tk {tk}\nhint: build DocStarts from the whole sequences of the batch",
            docs.dims()
        );
    }
    check_cuda(q)?;
    let (cu, longest) = cu_seqlens(docs.host(), b, tk)?;
    imp::varlen(q, k, v, scale, &cu, longest)
}

#[cfg(feature = "flash-attn")]
mod imp {
    use candle_core::{Result, Tensor};

    pub fn dense(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, causal: bool) -> Result<Tensor> {
        // (B, T, H, D) views of the (B, H, T, D) tensors: the crate reads the strides (contiguous() is a
        // no-op on the model's tensors; it only guards the crate's contiguous last dim)
        let view = |x: &Tensor| x.contiguous()?.transpose(1, 2);
        let (qt, kt, vt) = (view(q)?, view(k)?, view(v)?);
        let o = candle_flash_attn::flash_attn(&qt, &kt, &vt, scale, causal)?; // (B, Tq, H, D)
        o.transpose(1, 2) // (B, H, Tq, D)
    }

    pub fn varlen(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, cu: &[u32], longest: usize) -> Result<Tensor> {
        let (b, h, t, d) = q.dims4()?;
        let hkv = k.dim(1)?;
        // (B*T, heads, D): the sequences' tokens one after another, as the varlen entry reads them
        let flat = |x: &Tensor, heads: usize| x.transpose(1, 2)?.contiguous()?.reshape((b * t, heads, d));
        let cu = Tensor::from_slice(cu, cu.len(), q.device())?;
        let o = candle_flash_attn::flash_attn_varlen(
            &flat(q, h)?,
            &flat(k, hkv)?,
            &flat(v, hkv)?,
            &cu,
            &cu,
            longest,
            longest,
            scale,
            true,
        )?; // (B*T, H, D)
        o.reshape((b, t, h, d))?.transpose(1, 2) // (B, H, T, D)
    }
}

#[cfg(not(feature = "flash-attn"))]
mod imp {
    use super::NOT_BUILT;
    use candle_core::{bail, Result, Tensor};

    pub fn dense(_: &Tensor, _: &Tensor, _: &Tensor, _: f32, _: bool) -> Result<Tensor> {
        bail!("{}", NOT_BUILT)
    }

    pub fn varlen(_: &Tensor, _: &Tensor, _: &Tensor, _: f32, _: &[u32], _: usize) -> Result<Tensor> {
        bail!("{}", NOT_BUILT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn cu_seqlens_are_the_documents_of_the_flattened_batch() {
        // sequence 0: documents [0, 3) [3, 5); sequence 1: [0, 2) [2, 4) [4, 5)
        let docs = DocStarts::from_starts(&[&[3], &[4, 2]], 5, &Device::Cpu).unwrap();
        let (cu, longest) = cu_seqlens(docs.host(), 2, 5).unwrap();
        assert_eq!(cu, vec![0, 3, 5, 7, 9, 10]);
        assert_eq!(longest, 3);
        // one document per sequence: the plain batch offsets
        let one = DocStarts::from_starts(&[&[], &[]], 4, &Device::Cpu).unwrap();
        assert_eq!(cu_seqlens(one.host(), 2, 4).unwrap(), (vec![0, 4, 8], 4));
    }

    #[test]
    fn cu_seqlens_rebuild_the_per_token_starts() {
        // every document of cu_seqlens, read back per token, gives DocStarts' own starts
        let (b, t) = (3, 23);
        let starts: Vec<Vec<usize>> = vec![vec![1, 7, 8, 22], vec![], vec![0, 11]];
        let refs: Vec<&[usize]> = starts.iter().map(|s| s.as_slice()).collect();
        let docs = DocStarts::from_starts(&refs, t, &Device::Cpu).unwrap();
        let (cu, longest) = cu_seqlens(docs.host(), b, t).unwrap();
        let mut back = vec![0u32; b * t];
        for w in cu.windows(2) {
            let (lo, hi) = (w[0] as usize, w[1] as usize);
            assert!(lo < hi && (lo / t == (hi - 1) / t), "document {lo}..{hi} crosses a sequence");
            back[lo..hi].fill((lo % t) as u32);
        }
        assert_eq!(back, docs.host());
        assert_eq!(longest, cu.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap());
        assert_eq!(longest, 23, "sequence 1 is one document of all 23 tokens");
    }

    #[test]
    fn cu_seqlens_refuse_a_wrong_count() {
        let e = cu_seqlens(&[0, 0, 0], 2, 2).unwrap_err().to_string();
        assert!(e.contains("3 document starts for B 2 x T 2") && e.contains("hint:"), "{e}");
    }

    #[test]
    fn unsupported_dtype_and_head_dim_name_the_limit() {
        let e = check_supported(DType::F32, 128).unwrap_err().to_string();
        assert!(e.contains("bf16 or f16 only, not F32") && e.contains("hint:"), "{e}");
        let e = check_supported(DType::BF16, 96).unwrap_err().to_string();
        assert!(e.contains("head dims [64, 128]") && e.contains("is 96") && e.contains("hint:"), "{e}");
        check_supported(DType::BF16, 64).unwrap();
        check_supported(DType::F16, 128).unwrap();
    }

    #[test]
    fn inputs_are_checked_before_the_crate_is_called() {
        let dev = Device::Cpu;
        let mk = |h: usize, t: usize, d: usize, dt: DType| Tensor::zeros((1, h, t, d), dt, &dev).unwrap();
        // GQA that does not divide
        let e =
            attention(&mk(6, 4, 64, DType::BF16), &mk(4, 4, 64, DType::BF16), &mk(4, 4, 64, DType::BF16), 1.0, true)
                .unwrap_err()
                .to_string();
        assert!(e.contains("6 query heads are not a multiple of 4 kv heads"), "{e}");
        // f32 names the dtype limit before anything else
        let e = attention(&mk(4, 4, 64, DType::F32), &mk(2, 4, 64, DType::F32), &mk(2, 4, 64, DType::F32), 1.0, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bf16 or f16 only"), "{e}");
        // a CPU tensor of a supported shape: CUDA only
        let e =
            attention(&mk(4, 4, 64, DType::BF16), &mk(2, 4, 64, DType::BF16), &mk(2, 4, 64, DType::BF16), 1.0, true)
                .unwrap_err()
                .to_string();
        assert!(e.contains("CUDA only") && e.contains("hint:"), "{e}");
        // a document mask under a KV cache
        let docs = DocStarts::from_starts(&[&[2]], 6, &dev).unwrap();
        let e = attention_doc(
            &mk(4, 4, 64, DType::BF16),
            &mk(2, 6, 64, DType::BF16),
            &mk(2, 6, 64, DType::BF16),
            1.0,
            &docs,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("needs as many queries as keys (Tq 4, Tk 6)") && e.contains("hint:"), "{e}");
        // starts of another batch
        let e = attention_doc(
            &mk(4, 5, 64, DType::BF16),
            &mk(2, 5, 64, DType::BF16),
            &mk(2, 5, 64, DType::BF16),
            1.0,
            &docs,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("document starts are for (1, 6) but k has B 1, Tk 5"), "{e}");
    }
}
