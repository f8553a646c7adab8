//! The device memory an NCCL call is handed: its address, with cudarc's guard for it alive until the
//! call has been enqueued — a read guard (`DevicePtr`) for memory NCCL only reads, a write guard
//! (`DevicePtrMut`) for memory it writes. Taking the guard makes the collective stream wait for the
//! buffer's earlier users; dropping it records the collective on the buffer's read or write event, so
//! its later users (and the free of the buffer) wait for the collective. cudarc does that only while its
//! event tracking is on; the explicit events of `NcclComm::enqueue` order the collective against the
//! compute stream either way, so neither replaces the other.
//!
//! Why closures: a guard borrows the slice it came from, which lives behind candle's lock on the
//! tensor's storage; `f` runs inside both borrows, so neither can end before the enqueue. Writing needs
//! the storage mutably, and candle hands a `&mut` storage only to an in-place op (`Tensor::inplace_op1`,
//! as its fused ops get theirs): `Writing` is such an op, whose whole work is running `f`.
//! Separate from `collectives.rs` so each collective there reads as the NCCL calls it makes.
use super::NcclComm;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Storage, Tensor};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use std::cell::Cell;

/// Run `f` with the device address of element `lo` of `cs`, read by work on `stream`; cudarc's read
/// guard lives until `f` returns.
pub(super) fn with_read<R>(
    cs: &CudaStorage,
    lo: usize,
    stream: &CudaStream,
    what: &str,
    f: impl FnOnce(u64) -> Result<R>,
) -> Result<R> {
    fn go<T: CudaDType, R>(cs: &CudaStorage, lo: usize, s: &CudaStream, f: impl FnOnce(u64) -> Result<R>) -> Result<R> {
        let (base, _read) = cs.as_cuda_slice::<T>()?.device_ptr(s);
        f(base + (lo * std::mem::size_of::<T>()) as u64)
    }
    match cs.dtype() {
        DType::F32 => go::<f32, R>(cs, lo, stream, f),
        DType::F64 => go::<f64, R>(cs, lo, stream, f),
        DType::BF16 => go::<half::bf16, R>(cs, lo, stream, f),
        DType::F16 => go::<half::f16, R>(cs, lo, stream, f),
        d => bail!("{what}: NCCL collectives take f32, f64, bf16 or f16 tensors, not {d:?}"),
    }
}

/// Run `f` with the device address of element `lo` of `cs`, written by work on `stream`; cudarc's write
/// guard lives until `f` returns.
pub(super) fn with_write<R>(
    cs: &mut CudaStorage,
    lo: usize,
    stream: &CudaStream,
    what: &str,
    f: impl FnOnce(u64) -> Result<R>,
) -> Result<R> {
    fn go<T: CudaDType, R>(
        cs: &mut CudaStorage,
        lo: usize,
        s: &CudaStream,
        f: impl FnOnce(u64) -> Result<R>,
    ) -> Result<R> {
        let (base, _write) = cs.as_cuda_slice_mut::<T>()?.device_ptr_mut(s);
        f(base + (lo * std::mem::size_of::<T>()) as u64)
    }
    match cs.dtype() {
        DType::F32 => go::<f32, R>(cs, lo, stream, f),
        DType::F64 => go::<f64, R>(cs, lo, stream, f),
        DType::BF16 => go::<half::bf16, R>(cs, lo, stream, f),
        DType::F16 => go::<half::f16, R>(cs, lo, stream, f),
        d => bail!("{what}: NCCL collectives take f32, f64, bf16 or f16 tensors, not {d:?}"),
    }
}

/// Candle's in-place op, used for the one thing it hands over: the tensor's storage held for writing.
/// `f` runs once, on the CUDA path; its result waits in `out` for the caller.
struct Writing<F, R> {
    f: Cell<Option<F>>,
    out: Cell<Option<Result<R>>>,
}

impl<F, R> InplaceOp1 for Writing<F, R>
where
    F: FnOnce(&mut CudaStorage, &Layout) -> Result<R>,
{
    fn name(&self) -> &'static str {
        "nccl-buffer"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        Err(candle_core::Error::Msg("the tensor is not on a CUDA device".into()))
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        if let Some(f) = self.f.take() {
            self.out.set(Some(f(storage, layout)));
        }
        Ok(())
    }
}

impl NcclComm {
    /// Element offset of the contiguous layout `l` in `cs`, which must be on this rank's device.
    pub(super) fn first_elem(&self, cs: &CudaStorage, l: &Layout, what: &str) -> Result<usize> {
        let Some((lo, _)) = l.contiguous_offsets() else { bail!("{what}: the tensor must be contiguous") };
        self.check_device(cs, what)?;
        Ok(lo)
    }

    /// `cs` must be on this rank's device (NCCL would read another GPU's address as its own).
    pub(super) fn check_device(&self, cs: &CudaStorage, what: &str) -> Result<()> {
        if cs.device().id() != self.dev.id() {
            bail!("{what}: the tensor is on another CUDA device than this rank's");
        }
        Ok(())
    }

    /// Run `f` with the device address of contiguous tensor `t`'s first element, read by the collective
    /// stream: `t`'s storage and cudarc's read guard are held until `f` returns.
    pub(super) fn reading<R>(&self, t: &Tensor, what: &str, f: impl FnOnce(u64) -> Result<R>) -> Result<R> {
        let (st, l) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*st else { bail!("{what}: the tensor is not on a CUDA device") };
        let lo = self.first_elem(cs, l, what)?;
        with_read(cs, lo, &self.stream, what, f)
    }

    /// Run `f` with the device address of contiguous tensor `t`'s first element, written by the
    /// collective stream: `t`'s storage (candle's write lock) and cudarc's write guard are held until `f`
    /// returns. `t` must share its storage with no tensor `f` touches (the lock is not reentrant).
    pub(super) fn writing<R>(&self, t: &Tensor, what: &str, f: impl FnOnce(u64) -> Result<R>) -> Result<R> {
        if !t.device().is_cuda() {
            bail!("{what}: the tensor is not on a CUDA device");
        }
        let op = Writing {
            f: Cell::new(Some(|cs: &mut CudaStorage, l: &Layout| {
                let lo = self.first_elem(cs, l, what)?;
                with_write(cs, lo, &self.stream, what, f)
            })),
            out: Cell::new(None),
        };
        t.inplace_op1(&op).with_context(|| what.to_string())?;
        op.out.into_inner().unwrap_or_else(|| Err(anyhow!("internal: {what}: candle did not run the in-place access")))
    }
}
