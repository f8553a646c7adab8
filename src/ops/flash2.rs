//! FlashAttention-2's own kernels, forward and backward, as a differentiable op (`AttentionImpl::Flash2`,
//! `--attention flash2`): the training attention of a CUDA build with `--features flash-attn` for bf16/f16 at
//! head dims 64 and 128. harpe's own kernels (`ops::attention`) stay the independent check and the path for
//! everything else.
//!
//! Reference: Dao 2023 (FlashAttention-2), release 2.8.3's `csrc/flash_attn` (the forward kernels as
//! candle-flash-attn 0.11.1 ships them, the backward from the release itself, both in
//! third_party/candle-flash-attn); the parameters are `ops::flash2_params`', tested on CPU against
//! `flash_api.cpp`. Same contract as `ops::attention`: q (B, H, T, D), k, v (B, Hkv, T, D), causal, GQA, and
//! with `docs` the per-document causal mask of packed sequences, which goes through FA2's varlen entry (the
//! documents become the varlen batch: `candle_flash::cu_seqlens`).
//! Algorithm, forward: O = softmax(q k^T * scale) v per row with lse = log-sum-exp of the scaled row;
//! backward (FA2's three kernels): delta = rowsum(dO * O) (`softmax_d`), then per key block P = exp(S - lse),
//! dV += P^T dO, dP = dO v^T, dS = P * (dP - delta), dK += dS^T q * scale, dQ += dS k * scale (f32
//! atomics into `dq_accum`), then dQ converted to the input type; GQA gradients come per query head and are
//! summed over each kv head's group (as `mha_bwd` does).
//! The non-obvious decision: the forward's output is one flat buffer, O (B*T, H, D) then lse's f32 values
//! stored in the input type's slots (`Fa2Shape::workspace().lse` f32 = twice as many bf16 slots), so the lse
//! the backward needs is a tensor autograd keeps, as in `ops::attention`, not state inside the op.
//! Not here: non-causal backward, dropout, ALiBi, softcapping, local windows, Tq != Tk (KV-cached
//! generation uses `ops::candle_flash`, forward only) and the CPU (this op refuses; `attention_slow`-style
//! references are `ops::attention`'s).
use crate::ops::attention::DocStarts;
use crate::ops::candle_flash;
use crate::ops::flash2_params::Fa2Shape;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

/// Head dims FA2's kernels are compiled for in harpe's build (forward and backward).
pub const HEAD_DIMS: [usize; 2] = [64, 128];

/// The error of a build without the kernels.
pub const NOT_BUILT: &str = "--attention flash2: this harpe was built without --features flash-attn\nhint: build with `cargo build --release --features flash-attn` (README \"Build for GPUs\"), or pass --attention harpe";

/// An error unless FA2's kernels take this dtype and head dim (naming the limit).
pub fn check_supported(dtype: DType, head_dim: usize) -> Result<()> {
    if !matches!(dtype, DType::BF16 | DType::F16) {
        bail!("--attention flash2 runs bf16 or f16 only, not {dtype:?}\nhint: pass --dtype bf16, or --attention harpe (harpe's kernels also run f32)");
    }
    if !HEAD_DIMS.contains(&head_dim) {
        bail!("--attention flash2 takes head dims {HEAD_DIMS:?}, and this model's is {head_dim}\nhint: pass --attention harpe");
    }
    Ok(())
}

/// Whether this build has FA2's kernels and they take `dtype` on `dev` at `head_dim`: the rule by which
/// `flash2` is the default attention.
pub fn available(dev: &candle_core::Device, dtype: DType, head_dim: usize) -> bool {
    cfg!(feature = "flash-attn") && dev.is_cuda() && check_supported(dtype, head_dim).is_ok()
}

/// FA2's view of a causal call on q (B, H, T, D), k, v (B, Hkv, T, D), checked: shapes, dtypes, head dim,
/// and with `docs` the documents as FA2's varlen batch (their cu_seqlens, B*T tokens flat).
pub fn fa2_shape(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    docs: Option<&DocStarts>,
) -> Result<(Fa2Shape, Option<Vec<u32>>)> {
    let (b, h, tq, d) = q.dims4()?;
    let (bk, hkv, tk, dk) = k.dims4()?;
    if v.dims4()? != (bk, hkv, tk, dk) || bk != b || dk != d {
        bail!(
            "flash2 attention: q {:?}, k {:?}, v {:?} do not fit (B, H, T, D), (B, Hkv, T, D) twice\nhint: the same contract as ops::attention",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    if hkv == 0 || !h.is_multiple_of(hkv) {
        bail!("flash2 attention: {h} query heads are not a multiple of {hkv} kv heads\nhint: GQA needs H % Hkv == 0");
    }
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!(
            "flash2 attention: q is {:?} but k {:?}, v {:?}\nhint: one dtype for q, k, v",
            q.dtype(),
            k.dtype(),
            v.dtype()
        );
    }
    check_supported(q.dtype(), d)?;
    if tq != tk {
        bail!("--attention flash2: queries and keys of one length only (Tq {tq}, Tk {tk})\nhint: KV-cached generation runs --attention candle-flash or harpe");
    }
    let is_bf16 = q.dtype() == DType::BF16;
    let dense = Fa2Shape { b, h, hkv, d, max_seqlen: tk, total: b * tk, varlen: false, causal: true, scale, is_bf16 };
    let (shape, cu) = match docs {
        None => (dense, None),
        Some(ds) => {
            if ds.dims() != (b, tk) {
                bail!(
                    "flash2 attention: document starts are for {:?} but k has B {b}, Tk {tk}\nhint: build DocStarts from the whole sequences of the batch",
                    ds.dims()
                );
            }
            let (cu, longest) = candle_flash::cu_seqlens(ds.host(), b, tk)?;
            (Fa2Shape { b: cu.len() - 1, max_seqlen: longest, varlen: true, ..dense }, Some(cu))
        }
    };
    shape.check().map_err(|e| candle_core::Error::Msg(format!("{e}\nhint: pass --attention harpe")))?;
    Ok((shape, cu))
}

/// Causal attention of q (B, H, T, D) over k, v (B, Hkv, T, D) -> (B, H, T, D) on FA2's kernels,
/// differentiable in q, k, v; with `docs` per document (query i sees keys j <= i of its own document).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, docs: Option<&DocStarts>) -> Result<Tensor> {
    let (packed, _) = packed(q, k, v, scale, docs)?;
    let (b, h, t, d) = q.dims4()?;
    packed.narrow(0, 0, b * t * h * d)?.reshape((b, t, h, d))?.transpose(1, 2) // (B, H, T, D)
}

/// `attention` and its lse (B, H, T) read back to the host: the op's saved values, for the selftest's
/// comparison with the f64 reference.
pub fn attention_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    docs: Option<&DocStarts>,
) -> Result<(Tensor, Vec<f32>)> {
    let (packed, shape) = packed(q, k, v, scale, docs)?;
    let (b, h, t, d) = q.dims4()?;
    let n_o = b * t * h * d;
    let o = packed.narrow(0, 0, n_o)?.reshape((b, t, h, d))?.transpose(1, 2)?;
    let slots = packed.narrow(0, n_o, packed.dim(0)? - n_o)?.to_device(&candle_core::Device::Cpu)?;
    let bits: Vec<u16> = match slots.dtype() {
        DType::BF16 => slots.to_vec1::<half::bf16>()?.iter().map(|x| x.to_bits()).collect(),
        _ => slots.to_vec1::<half::f16>()?.iter().map(|x| x.to_bits()).collect(),
    };
    // each f32 in two 16-bit slots, low half first (the device is little-endian)
    let raw: Vec<f32> = bits.chunks(2).map(|p| f32::from_bits(p[0] as u32 | (p[1] as u32) << 16)).collect();
    if !shape.varlen {
        return Ok((o, raw)); // (B, H, T)
    }
    // varlen: (H, B*T) -> (B, H, T)
    let mut lse = vec![0f32; b * h * t];
    for bi in 0..b {
        for hi in 0..h {
            for ti in 0..t {
                lse[(bi * h + hi) * t + ti] = raw[hi * b * t + bi * t + ti];
            }
        }
    }
    Ok((o, lse))
}

/// The op's packed output (B*T*H*D values of O, then lse) and FA2's shape of the call.
fn packed(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, docs: Option<&DocStarts>) -> Result<(Tensor, Fa2Shape)> {
    let (shape, cu) = fa2_shape(q, k, v, scale, docs)?;
    if !q.device().is_cuda() {
        bail!("--attention flash2 runs on CUDA only (the tensors are on {:?})\nhint: pass --device cuda, or --attention harpe", q.device());
    }
    let (b, h, t, d) = q.dims4()?;
    let hkv = k.dim(1)?;
    let cu = match cu {
        Some(cu) => Some(Tensor::from_slice(&cu, cu.len(), q.device())?),
        None => None,
    };
    // (B*T, heads, D) contiguous: FA2's rows, one token's heads after another
    let flat = |x: &Tensor, heads: usize| x.transpose(1, 2)?.contiguous()?.reshape((b * t, heads, d));
    let packed = flat(q, h)?.apply_op3(&flat(k, hkv)?, &flat(v, hkv)?, Flash2 { shape, cu })?; // (B*T*H*D + 2 lse,)
    Ok((packed, shape))
}

/// The op on flat inputs q (B*T, H, D), k, v (B*T, Hkv, D): output O (B*T*H*D values) then lse (f32 bits
/// in 2 slots each), flat.
struct Flash2 {
    shape: Fa2Shape,
    /// cu_seqlens (u32 on the device) of the varlen (document) form.
    cu: Option<Tensor>,
}

impl Flash2 {
    /// Elements of O, and of the whole packed output.
    fn lens(&self) -> (usize, usize) {
        let n_o = self.shape.total * self.shape.h * self.shape.d;
        (n_o, n_o + 2 * self.shape.workspace().lse)
    }
}

impl CustomOp3 for Flash2 {
    fn name(&self) -> &'static str {
        "harpe-flash2"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("--attention flash2 runs on CUDA only\nhint: pass --attention harpe on the CPU")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        if !cfg!(feature = "flash-attn") {
            bail!("{}", NOT_BUILT);
        }
        let out = imp::forward(&self.shape, self.cu.as_ref(), (s1, l1), (s2, l2), (s3, l3))?;
        Ok((out, Shape::from_dims(&[self.lens().1])))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n_o, _) = self.lens();
        // dO: the gradient of O's part (lse is no output of `attention`, its part of `grad` is zero)
        let dout = grad.narrow(0, 0, n_o)?.reshape(q.shape())?.contiguous()?;
        let (dq, dk, dv) = imp::backward(&self.shape, self.cu.as_ref(), (q, k, v), res, &dout)?;
        let s = &self.shape;
        let (dk, dv) = if s.hkv == s.h {
            (dk, dv)
        } else {
            // per query head (B*T, H, D) -> summed over each kv head's H/Hkv query heads, in f32
            let group = |x: Tensor| -> Result<Tensor> {
                x.reshape((s.total, s.hkv, s.h / s.hkv, s.d))?.to_dtype(DType::F32)?.sum(2)?.to_dtype(k.dtype())
            };
            (group(dk)?, group(dv)?)
        };
        Ok((Some(dq), Some(dk.reshape(k.shape())?), Some(dv.reshape(v.shape())?)))
    }
}

#[cfg(feature = "flash-attn")]
use crate::ops::flash2_cuda as imp;

#[cfg(not(feature = "flash-attn"))]
mod imp {
    //! Without the kernels: the op refuses before anything runs (`attention` never gets here on a CPU).
    use super::NOT_BUILT;
    use crate::ops::flash2_params::Fa2Shape;
    use candle_core::{bail, Result, Tensor};

    #[cfg(feature = "cuda")]
    pub fn forward(
        _: &Fa2Shape,
        _: Option<&Tensor>,
        _: (&candle_core::CudaStorage, &candle_core::Layout),
        _: (&candle_core::CudaStorage, &candle_core::Layout),
        _: (&candle_core::CudaStorage, &candle_core::Layout),
    ) -> Result<candle_core::CudaStorage> {
        bail!("{}", NOT_BUILT)
    }

    pub fn backward(
        _: &Fa2Shape,
        _: Option<&Tensor>,
        _: (&Tensor, &Tensor, &Tensor),
        _: &Tensor,
        _: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        bail!("{}", NOT_BUILT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn mk(b: usize, h: usize, t: usize, d: usize, dt: DType) -> Tensor {
        Tensor::zeros((b, h, t, d), dt, &Device::Cpu).unwrap()
    }

    #[test]
    fn dense_and_document_shapes() {
        let (q, kv) = (mk(2, 8, 96, 64, DType::BF16), mk(2, 2, 96, 64, DType::BF16));
        let (s, cu) = fa2_shape(&q, &kv, &kv, 0.125, None).unwrap();
        assert_eq!(
            (s.b, s.h, s.hkv, s.d, s.max_seqlen, s.total, s.varlen, s.causal, s.is_bf16),
            (2, 8, 2, 64, 96, 192, false, true, true)
        );
        assert!(cu.is_none());
        // sequence 0: documents of 40 and 56 tokens; sequence 1: one of 96
        let docs = DocStarts::from_starts(&[&[40], &[]], 96, &Device::Cpu).unwrap();
        let (s, cu) = fa2_shape(&q, &kv, &kv, 0.125, Some(&docs)).unwrap();
        assert_eq!(cu.unwrap(), vec![0, 40, 96, 192]);
        assert_eq!((s.b, s.max_seqlen, s.total, s.varlen), (3, 96, 192, true));
    }

    #[test]
    fn refusals_name_the_limit() {
        let e = |q: &Tensor, kv: &Tensor| fa2_shape(q, kv, kv, 1.0, None).unwrap_err().to_string();
        let m = e(&mk(1, 4, 8, 64, DType::F32), &mk(1, 4, 8, 64, DType::F32));
        assert!(m.contains("bf16 or f16 only") && m.contains("hint:"), "{m}");
        let m = e(&mk(1, 4, 8, 96, DType::BF16), &mk(1, 4, 8, 96, DType::BF16));
        assert!(m.contains("head dims [64, 128]") && m.contains("is 96"), "{m}");
        let m = e(&mk(1, 4, 4, 64, DType::BF16), &mk(1, 4, 8, 64, DType::BF16));
        assert!(m.contains("Tq 4, Tk 8") && m.contains("hint:"), "{m}");
        // a supported shape on the CPU: CUDA only
        let (q, kv) = (mk(1, 4, 8, 64, DType::F16), mk(1, 2, 8, 64, DType::F16));
        let m = attention(&q, &kv, &kv, 1.0, None).unwrap_err().to_string();
        assert!(m.contains("CUDA only") && m.contains("hint:"), "{m}");
        assert!(!available(&Device::Cpu, DType::BF16, 128));
    }
}
