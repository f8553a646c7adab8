//! The launches of `ops::flash2`: FA2's forward and backward (third_party/candle-flash-attn's `harpe_mha_fwd`,
//! `harpe_mha_bwd` = its C `run_mha_bwd`) on candle's CUDA storages, with the parameters of
//! `ops::flash2_params` and the pointers filled in here.
//!
//! Reference: upstream `flash_api.cpp` (2.8.3) `mha_fwd`/`mha_varlen_fwd` and `mha_bwd`/`mha_varlen_bwd`, whose
//! allocations these are: O and lse (the forward's packed output), dQ, dK, dV (per query head under GQA),
//! the f32 `dq_accum` and `softmax_d` (`Fa2Shape::workspace`), and the 2 x u64 `rng_state` upstream always
//! passes (zero: no dropout is compiled, but the kernels' dropout object still reads it).
//! The non-obvious decision: every buffer is fresh and contiguous, so the only strides are the ones
//! `Fa2Shape` computes; inputs are checked contiguous with the element count that shape implies before a
//! pointer is taken. `dq_accum` needs no zeroing: FA2's first kernel clears it (non-deterministic mode).
//! Not here: the deterministic backward (its split accumulators), streams other than candle's.
use crate::ops::cuda::view;
use crate::ops::flash2_params::{Fa2Args, Fa2Shape};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr};
use candle_core::cuda_backend::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{bail, CudaStorage, DType, Layout, Result, Storage, Tensor};
use half::{bf16, f16};

/// A device address of a view (its guard dropped at once: candle's one stream orders every use).
fn addr<T>(v: &CudaView<'_, T>, stream: &CudaStream) -> u64 {
    let (p, _guard) = v.device_ptr(stream);
    p
}

/// The same for a whole slice.
fn addr_slice<T>(v: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _guard) = v.device_ptr(stream);
    p
}

/// A dense view of `n` elements of a storage, or an error naming `what`.
fn input<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout, n: usize, what: &str) -> Result<CudaView<'a, T>> {
    if l.shape().elem_count() != n {
        bail!("flash2: `{what}` has {} elements, the shape says {n}", l.shape().elem_count());
    }
    view::<T>(s, l, "flash2", what)
}

/// One of the shim's FA2 entries (`harpe_mha_fwd`, `harpe_mha_bwd`) on `args`, queued on `stream`.
type Fa2Entry = unsafe fn(*const core::ffi::c_void, usize, *mut core::ffi::c_void) -> Result<()>;

/// Hand `args` (with its size, which the shim checks against its own struct) to `entry` on `stream`.
///
/// # Safety
/// Every pointer in `args` addresses a live buffer of the size its shape implies, usable on `stream`.
unsafe fn launch(entry: Fa2Entry, args: &Fa2Args, stream: &CudaStream) -> Result<()> {
    entry(
        args as *const Fa2Args as *const core::ffi::c_void,
        std::mem::size_of::<Fa2Args>(),
        stream.cu_stream() as *mut core::ffi::c_void,
    )
}

/// The cu_seqlens pointer (0 for the dense form) with the view that keeps it borrowed.
fn cu_addr(cu: Option<&Tensor>, shape: &Fa2Shape, stream: &CudaStream) -> Result<u64> {
    let Some(t) = cu else { return Ok(0) };
    if t.dtype() != DType::U32 || t.dims() != [shape.b + 1] {
        bail!("flash2: cu_seqlens are {:?} {:?}, expected ({}) u32", t.dtype(), t.dims(), shape.b + 1);
    }
    let (st, l) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*st else { bail!("flash2: cu_seqlens are not on the CUDA device") };
    Ok(addr(&view::<u32>(cs, l, "flash2", "cu_seqlens")?, stream))
}

/// FA2's forward into a fresh packed buffer: O (total*H*D values) then lse's f32 values, 2 slots each.
pub fn forward(
    shape: &Fa2Shape,
    cu: Option<&Tensor>,
    (q, lq): (&CudaStorage, &Layout),
    (k, lk): (&CudaStorage, &Layout),
    (v, lv): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    match q.dtype() {
        DType::BF16 => forward_t::<bf16>(shape, cu, (q, lq), (k, lk), (v, lv)),
        DType::F16 => forward_t::<f16>(shape, cu, (q, lq), (k, lk), (v, lv)),
        d => bail!("flash2: q is {d:?}; FA2 runs bf16 or f16\nhint: pass --attention harpe"),
    }
}

fn forward_t<T: CudaDType + DeviceRepr>(
    shape: &Fa2Shape,
    cu: Option<&Tensor>,
    (q, lq): (&CudaStorage, &Layout),
    (k, lk): (&CudaStorage, &Layout),
    (v, lv): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dev = q.device();
    let stream = dev.cuda_stream();
    let (n_q, n_k) = (shape.total * shape.h * shape.d, shape.total * shape.hkv * shape.d);
    let (qv, kv, vv) = (input::<T>(q, lq, n_q, "q")?, input::<T>(k, lk, n_k, "k")?, input::<T>(v, lv, n_k, "v")?);
    let n_lse = shape.workspace().lse;
    // SAFETY: FA2 writes every O value and every lse value of this shape before anything reads them.
    let out = unsafe { dev.alloc::<T>(n_q + 2 * n_lse)? };
    let rng = dev.alloc_zeros::<u64>(2)?;
    let o_ptr = addr_slice(&out, &stream);
    let args = Fa2Args {
        q_ptr: addr(&qv, &stream),
        k_ptr: addr(&kv, &stream),
        v_ptr: addr(&vv, &stream),
        o_ptr,
        // O holds total*H*D 2-byte values, an even count (D is 64 or 128): lse starts 4-byte aligned
        softmax_lse_ptr: o_ptr + (n_q * 2) as u64,
        cu_seqlens_q: cu_addr(cu, shape, &stream)?,
        cu_seqlens_k: cu_addr(cu, shape, &stream)?,
        rng_state: addr_slice(&rng, &stream),
        ..shape.fwd_args()
    };
    // SAFETY: every pointer addresses a live buffer of the size `shape` implies (checked above or allocated
    // here), on candle's stream, which runs the kernels before any later use or free of them.
    unsafe { launch(candle_flash_attn::harpe_mha_fwd, &args, &stream)? };
    drop(rng); // after the launch is queued: the stream-ordered free waits for the kernels
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// FA2's backward: (dQ (total, H, D), dK, dV) with dK, dV per query head (total, H, D) under GQA, else
/// (total, Hkv, D). `res` is the forward's packed output, `dout` dO (total, H, D) contiguous.
pub fn backward(
    shape: &Fa2Shape,
    cu: Option<&Tensor>,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    res: &Tensor,
    dout: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    match q.dtype() {
        DType::BF16 => backward_t::<bf16>(shape, cu, (q, k, v), res, dout),
        DType::F16 => backward_t::<f16>(shape, cu, (q, k, v), res, dout),
        d => bail!("flash2: q is {d:?}; FA2 runs bf16 or f16\nhint: pass --attention harpe"),
    }
}

fn backward_t<T: CudaDType + DeviceRepr>(
    shape: &Fa2Shape,
    cu: Option<&Tensor>,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    res: &Tensor,
    dout: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (n_q, n_k) = (shape.total * shape.h * shape.d, shape.total * shape.hkv * shape.d);
    let ws = shape.workspace();
    let (q, k, v, res, dout) =
        (q.contiguous()?, k.contiguous()?, v.contiguous()?, res.contiguous()?, dout.contiguous()?);
    let (sq, lq) = q.storage_and_layout();
    let (sk, lk) = k.storage_and_layout();
    let (sv, lv) = v.storage_and_layout();
    let (sr, lr) = res.storage_and_layout();
    let (sd, ld) = dout.storage_and_layout();
    let (Storage::Cuda(sq), Storage::Cuda(sk), Storage::Cuda(sv), Storage::Cuda(sr), Storage::Cuda(sd)) =
        (&*sq, &*sk, &*sv, &*sr, &*sd)
    else {
        bail!("flash2 backward: q, k, v, O and dO must all be on the CUDA device")
    };
    let dev = sq.device();
    let stream = dev.cuda_stream();
    let qv = input::<T>(sq, lq, n_q, "q")?;
    let kv = input::<T>(sk, lk, n_k, "k")?;
    let vv = input::<T>(sv, lv, n_k, "v")?;
    let rv = input::<T>(sr, lr, n_q + 2 * ws.lse, "O|lse")?;
    let dv_ = input::<T>(sd, ld, n_q, "dO")?;
    let n_dkv = if ws.dkv_expanded > 0 { ws.dkv_expanded } else { n_k };
    // SAFETY: FA2 writes every value of dQ, dK, dV (dK, dV are per query head under GQA: all of them),
    // softmax_d and dq_accum (its first kernel clears dq_accum) before reading them.
    let (dq, dk, dv, dq_accum, softmax_d) = unsafe {
        (
            dev.alloc::<T>(n_q)?,
            dev.alloc::<T>(n_dkv)?,
            dev.alloc::<T>(n_dkv)?,
            dev.alloc::<f32>(ws.dq_accum)?,
            dev.alloc::<f32>(ws.softmax_d)?,
        )
    };
    let rng = dev.alloc_zeros::<u64>(2)?;
    let o_ptr = addr(&rv, &stream);
    let args = Fa2Args {
        q_ptr: addr(&qv, &stream),
        k_ptr: addr(&kv, &stream),
        v_ptr: addr(&vv, &stream),
        o_ptr,
        softmax_lse_ptr: o_ptr + (n_q * 2) as u64,
        do_ptr: addr(&dv_, &stream),
        dq_ptr: addr_slice(&dq, &stream),
        dk_ptr: addr_slice(&dk, &stream),
        dv_ptr: addr_slice(&dv, &stream),
        dq_accum_ptr: addr_slice(&dq_accum, &stream),
        dsoftmax_sum: addr_slice(&softmax_d, &stream),
        cu_seqlens_q: cu_addr(cu, shape, &stream)?,
        cu_seqlens_k: cu_addr(cu, shape, &stream)?,
        rng_state: addr_slice(&rng, &stream),
        ..shape.bwd_args()
    };
    // SAFETY: as in `forward_t`, for the backward's buffers (all sized from `shape`, checked or allocated
    // here, on candle's stream).
    unsafe { launch(candle_flash_attn::harpe_mha_bwd, &args, &stream)? };
    drop((dq_accum, softmax_d, rng)); // stream-ordered frees, after the kernels
    let heads_kv = if ws.dkv_expanded > 0 { shape.h } else { shape.hkv };
    let wrap = |s: CudaSlice<T>, heads: usize| {
        Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())),
            (shape.total, heads, shape.d),
            BackpropOp::none(),
            false,
        )
    };
    Ok((wrap(dq, shape.h), wrap(dk, heads_kv), wrap(dv, heads_kv)))
}
