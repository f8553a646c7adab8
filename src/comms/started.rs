//! `Started`: a collective running beside the compute — on NCCL's stream, or on a `Local` or `Gloo` rank's
//! communication thread — and how a 1-D tensor is handed to those threads in its own dtype and made a
//! tensor again at the join. Apart from `Comm` (`mod.rs`), whose `_start` collectives return it and
//! whose ZeRO callers (`zero.rs`) wait on it.
#[cfg(feature = "gloo")]
use super::gloo;
use super::local::{self, Elem, LocalComm, ReduceOp};
#[cfg(feature = "nccl")]
use super::nccl;
use crate::launch::signature::CollOp;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
#[cfg(any(feature = "gloo", feature = "nccl"))]
use std::sync::Arc;

/// A collective started by `Comm::reduce_scatter_v_sum_tensor_start` or `all_gather_v_tensor_start`; `wait` gives its result. Dropped
/// without `wait` (an error unwinding), it still makes the compute stream wait for the exchange, so
/// its buffers are never freed under a running collective (`Local`: the exchange runs on; its result
/// is dropped).
pub struct Started {
    out: Option<Tensor>,
    /// `Local`: the exchange under way on the rank's communication thread, and the tensor made of its
    /// result on the input's device
    local: Option<LocalStarted>,
    /// NCCL: the communicator, the completion event, and the input kept alive until the join
    #[cfg(feature = "nccl")]
    nccl: Option<(Arc<nccl::NcclComm>, Arc<cudarc::driver::CudaEvent>, Tensor)>,
}

/// Waits for a `Local` exchange and makes its result a tensor.
type LocalStarted = Box<dyn FnOnce() -> Result<Tensor>>;

impl Started {
    /// A collective that completed on the host (`Single`).
    pub(super) fn ready(out: Tensor) -> Started {
        Started {
            out: Some(out),
            local: None,
            #[cfg(feature = "nccl")]
            nccl: None,
        }
    }

    /// A `Local` collective issued to the rank's communication thread: its values become a 1-D tensor
    /// on `device` at the join.
    pub(super) fn local<T: Elem + candle_core::WithDType>(issued: local::Issued<Vec<T>>, device: &Device) -> Started {
        let device = device.clone();
        let join: LocalStarted = Box::new(move || {
            let v = issued.wait()?;
            let n = v.len();
            Ok(Tensor::from_vec(v, n, &device)?)
        });
        Started {
            out: None,
            local: Some(join),
            #[cfg(feature = "nccl")]
            nccl: None,
        }
    }

    /// A collective under way on a communication thread (`Gloo`): `join` waits for it and makes its
    /// result a tensor.
    #[cfg(feature = "gloo")]
    pub(super) fn deferred(join: LocalStarted) -> Started {
        Started {
            out: None,
            local: Some(join),
            #[cfg(feature = "nccl")]
            nccl: None,
        }
    }

    /// An NCCL collective under way on `c`'s stream (`NcclComm::*_start`); `input` is kept alive until
    /// the join.
    #[cfg(feature = "nccl")]
    pub(super) fn nccl(
        c: &Arc<nccl::NcclComm>,
        (out, done): (Tensor, Option<Arc<cudarc::driver::CudaEvent>>),
        input: Tensor,
    ) -> Started {
        Started { out: Some(out), local: None, nccl: done.map(|d| (Arc::clone(c), d, input)) }
    }

    /// True when the result can be used at once (`Single`); false while an exchange may still run
    /// beside the compute (`Local`'s communication thread, NCCL's stream).
    pub fn is_ready(&self) -> bool {
        #[cfg(feature = "nccl")]
        if self.nccl.is_some() {
            return false;
        }
        self.local.is_none()
    }

    /// Under NCCL, make the compute stream wait for the exchange (no host wait); then free the input
    /// (in stream order, after the join). Under `Local`, wait for the communication thread.
    fn join(&mut self) -> Result<()> {
        if let Some(join) = self.local.take() {
            self.out = Some(join()?);
        }
        #[cfg(feature = "nccl")]
        if let Some((c, done, input)) = self.nccl.take() {
            c.join_compute(&done)?;
            drop(input);
        }
        Ok(())
    }

    /// The result, usable on the compute stream.
    pub fn wait(mut self) -> Result<Tensor> {
        self.join()?;
        self.out.take().ok_or_else(|| anyhow::anyhow!("internal: a started collective waited twice"))
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        self.local = None; // `Local`: the exchange completes on its thread; nobody needs its result
        let _ = self.join();
    }
}

/// `Local`'s all-gather or reduce-scatter (sum) of a 1-D tensor in its own dtype (f32, bf16 or f16: the
/// compute dtype for weights, as NCCL gathers), issued to the rank's communication thread.
pub(super) fn local_start(c: &LocalComm, op: CollOp, input: &Tensor, counts: &[usize], label: &str) -> Result<Started> {
    fn go<T: Elem + candle_core::WithDType>(
        c: &LocalComm,
        op: CollOp,
        t: &Tensor,
        counts: &[usize],
        label: &str,
    ) -> Result<Started> {
        let v = t.to_vec1::<T>()?;
        let issued = match op {
            CollOp::AllGather => c.all_gather_v_start(v, counts, label)?,
            CollOp::ReduceScatter => c.reduce_scatter_v_start(v, counts, ReduceOp::Sum, label)?,
            _ => bail!("internal: {} \"{label}\" has no started form under Local", op.name()),
        };
        Ok(Started::local(issued, t.device()))
    }
    match input.dtype() {
        DType::F32 => go::<f32>(c, op, input, counts, label),
        DType::BF16 => go::<half::bf16>(c, op, input, counts, label),
        DType::F16 => go::<half::f16>(c, op, input, counts, label),
        d => bail!("internal: {} \"{label}\" of a {d:?} tensor (Local moves f32, bf16 or f16)", op.name()),
    }
}

/// `Gloo`'s all-gather or reduce-scatter (sum) of a 1-D tensor, issued to the rank's communication
/// thread: an all-gather moves the tensor's own dtype (f32, bf16, f16: weights as NCCL gathers them);
/// a reduce-scatter sums in f32 (a 16-bit input is widened, summed and rounded once).
#[cfg(feature = "gloo")]
pub(super) fn gloo_start(
    c: &Arc<gloo::GlooComm>,
    op: CollOp,
    input: &Tensor,
    counts: &[usize],
    label: &str,
) -> Result<Started> {
    let (device, dtype) = (input.device().clone(), input.dtype());
    match op {
        CollOp::AllGather => {
            let size = dtype.size_in_bytes();
            if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
                bail!("internal: all_gather \"{label}\" of a {dtype:?} tensor (Gloo moves f32, bf16 or f16)");
            }
            let bytes = tensor_bytes(input)?;
            let issued = c.all_gather_v_bytes_start(bytes, counts, (size, dtype), label)?;
            Ok(Started::deferred(Box::new(move || {
                let out = issued.wait()?;
                let n = out.len() / size;
                bytes_tensor(&out, n, dtype, &device)
            })))
        }
        CollOp::ReduceScatter => {
            let v = input.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            let issued = c.reduce_scatter_v_sum_start(v, counts, label)?;
            Ok(Started::deferred(Box::new(move || {
                let out = issued.wait()?;
                let n = out.len();
                Ok(Tensor::from_vec(out, n, &Device::Cpu)?.to_dtype(dtype)?.to_device(&device)?)
            })))
        }
        _ => bail!("internal: {} \"{label}\" has no started form under Gloo", op.name()),
    }
}

/// A 1-D tensor's values as bytes in its own dtype (host order).
#[cfg(feature = "gloo")]
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    Ok(match t.dtype() {
        DType::F32 => t.flatten_all()?.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => t.flatten_all()?.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => t.flatten_all()?.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        d => bail!("internal: a {d:?} tensor on the wire"),
    })
}

/// `n` values of `dtype` from bytes, as a 1-D tensor on `device`.
#[cfg(feature = "gloo")]
fn bytes_tensor(b: &[u8], n: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let t = match dtype {
        DType::F32 => Tensor::from_vec(
            b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<_>>(),
            n,
            &Device::Cpu,
        )?,
        DType::BF16 => Tensor::from_vec(
            b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]])).collect::<Vec<_>>(),
            n,
            &Device::Cpu,
        )?,
        DType::F16 => Tensor::from_vec(
            b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]])).collect::<Vec<_>>(),
            n,
            &Device::Cpu,
        )?,
        d => bail!("internal: a {d:?} tensor on the wire"),
    };
    Ok(t.to_device(device)?)
}
