//! The collectives of an NCCL rank: in-place all-reduce, all-gather-v and reduce-scatter-v on flat
//! buffers, their `_start` forms into new tensors, the per-step scalars, the barrier, and the
//! sequence-parallel all-to-all. Each is its NCCL calls in one group (`NcclComm::enqueue`), on device
//! addresses held as `buffers.rs` hands them out.
//!
//! Separate from `comms/nccl.rs` (the join, the communicator and its enqueue): this is the part the
//! training loop calls every step. The ragged forms are in `comms/nccl.rs`'s header.
use super::{ok, NcclComm};
use crate::launch::signature::CollOp;
use anyhow::{bail, Context, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{DType, Layout, Tensor};
use cudarc::driver::{CudaEvent, CudaSlice, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::sys as ns;
use std::ffi::c_void;
use std::sync::Arc;

/// The NCCL element type of a tensor dtype.
fn nccl_type(dt: DType, what: &str) -> Result<ns::ncclDataType_t> {
    Ok(match dt {
        DType::F32 => ns::ncclDataType_t::ncclFloat32,
        DType::F64 => ns::ncclDataType_t::ncclFloat64,
        DType::BF16 => ns::ncclDataType_t::ncclBfloat16,
        DType::F16 => ns::ncclDataType_t::ncclFloat16,
        d => bail!("{what}: NCCL collectives take f32, f64, bf16 or f16 tensors, not {d:?}"),
    })
}

/// Exclusive prefix sums of `counts` (the offsets of the ragged slices).
fn offsets(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let o = *at;
            *at += c;
            Some(o)
        })
        .collect()
}

impl NcclComm {
    /// In-place sum over all ranks of a contiguous device tensor (a `FlatBuf::Device` buffer: never
    /// shared, so the in-place write is seen by nobody else).
    pub fn all_reduce_sum_inplace(&self, t: &Tensor, label: &str) -> Result<()> {
        let what = format!("all_reduce \"{label}\"");
        if t.elem_count() == 0 {
            return Ok(());
        }
        let (n, ty) = (t.elem_count(), nccl_type(t.dtype(), &what)?);
        let comm = self.raw(false)?;
        self.writing(t, &what, |p| {
            self.enqueue(&what, (CollOp::AllReduce, n, t.dtype()), |s| {
                // SAFETY: `p` addresses `n` elements of type `ty` on this rank's device (checked by
                // `writing`, which holds them until the enqueue returned).
                let r = unsafe {
                    ns::ncclAllReduce(p as *const c_void, p as *mut c_void, n, ty, ns::ncclRedOp_t::ncclSum, comm, s)
                };
                ok(r)
            })
        })?;
        Ok(())
    }

    /// Sum a few f64 scalars over all ranks (through a small device buffer; waits on the host).
    pub fn all_reduce_sum_f64(&self, vals: &mut [f64]) -> Result<()> {
        if vals.is_empty() {
            return Ok(());
        }
        let t = Tensor::from_slice(vals, vals.len(), &self.device)?;
        let what = "all_reduce \"scalars\"";
        let n = vals.len();
        let comm = self.raw(false)?;
        let done = self.writing(&t, what, |p| {
            self.enqueue(what, (CollOp::AllReduce, n, DType::F64), |s| {
                // SAFETY: `p` addresses `n` f64 of `t`, held by `writing` until the enqueue returned and
                // alive until the copy back below.
                ok(unsafe {
                    ns::ncclAllReduce(
                        p as *const c_void,
                        p as *mut c_void,
                        n,
                        ns::ncclDataType_t::ncclFloat64,
                        ns::ncclRedOp_t::ncclSum,
                        comm,
                        s,
                    )
                })
            })
        })?;
        self.wait(&done, what)?;
        vals.copy_from_slice(&t.to_vec1::<f64>()?);
        Ok(())
    }

    /// Wait until every rank has arrived (a one-value all-reduce, waited for on the host).
    pub fn barrier(&self, label: &str) -> Result<()> {
        let mut one = [0.0f64];
        self.all_reduce_sum_f64(&mut one).with_context(|| format!("barrier \"{label}\""))
    }

    /// In place: on entry rank r's slice `offsets[r]..+counts[r]` of `t` is valid, on exit all of it.
    pub fn all_gather_v_inplace(&self, t: &Tensor, counts: &[usize], label: &str) -> Result<()> {
        // SAFETY (each call): the slice lies inside `t` (check_counts); in-place broadcast from its owner.
        let what = (CollOp::AllGather, format!("all_gather \"{label}\""));
        self.per_owner_in_place(t, counts, what, |p, c, ty, root, comm, s| unsafe {
            ns::ncclBroadcast(p, p, c, ty, root, comm, s)
        })
    }

    /// In-place reduce-scatter-v (sum) over a flat buffer split into consecutive slices of `counts`:
    /// slice r of `t` on rank r becomes the sum over ranks; the other slices keep their values.
    pub fn reduce_scatter_v_inplace(&self, t: &Tensor, counts: &[usize], label: &str) -> Result<()> {
        // SAFETY (each call): the slice lies inside `t` (check_counts); in-place reduce into its owner.
        let what = (CollOp::ReduceScatter, format!("reduce_scatter \"{label}\""));
        self.per_owner_in_place(t, counts, what, |p, c, ty, root, comm, s| unsafe {
            ns::ncclReduce(p, p, c, ty, ns::ncclRedOp_t::ncclSum, root, comm, s)
        })
    }

    /// One grouped NCCL call per owner on its slice of the flat buffer `t` (consecutive slices of
    /// `counts`, rank order): `call(slice, count, dtype, owner, comm, stream)`; `op` names it for the
    /// signature check.
    fn per_owner_in_place(
        &self,
        t: &Tensor,
        counts: &[usize],
        (op, what): (CollOp, String),
        call: impl Fn(*mut c_void, usize, ns::ncclDataType_t, i32, ns::ncclComm_t, ns::cudaStream_t) -> ns::ncclResult_t,
    ) -> Result<()> {
        let what = what.as_str();
        self.check_counts(counts, t.elem_count(), what)?;
        if t.elem_count() == 0 {
            return Ok(());
        }
        let ty = nccl_type(t.dtype(), what)?;
        let es = t.dtype().size_in_bytes() as u64;
        let offs = offsets(counts);
        let comm = self.raw(false)?;
        self.writing(t, what, |base| {
            self.enqueue(what, (op, t.elem_count(), t.dtype()), |s| {
                for (root, (&o, &c)) in offs.iter().zip(counts).enumerate().filter(|(_, (_, &c))| c > 0) {
                    ok(call((base + o as u64 * es) as *mut c_void, c, ty, root as i32, comm, s))?;
                }
                Ok(())
            })
        })?;
        Ok(())
    }

    /// All-gather-v into a new tensor: this rank contributes `input` (`counts[rank]` elements).
    pub fn all_gather_v(&self, input: &Tensor, counts: &[usize], label: &str) -> Result<Tensor> {
        self.joined(self.all_gather_v_start(input, counts, label)?)
    }

    /// `all_gather_v` without the compute stream waiting for it: the result may be used only after
    /// `join_compute(done)`, and `input` must stay alive until then (None: nothing was queued).
    pub fn all_gather_v_start(
        &self,
        input: &Tensor,
        counts: &[usize],
        label: &str,
    ) -> Result<(Tensor, Option<Arc<CudaEvent>>)> {
        let what = format!("all_gather \"{label}\"");
        let total: usize = counts.iter().sum();
        if counts.len() != self.world || input.elem_count() != counts[self.rank] {
            bail!("internal: {what} of {} values with counts {counts:?} at rank {}", input.elem_count(), self.rank);
        }
        let out = crate::device::zeros_1d(total, input.dtype(), &self.device)?;
        if total == 0 {
            return Ok((out, None));
        }
        let ty = nccl_type(input.dtype(), &what)?;
        let es = input.dtype().size_in_bytes() as u64;
        let offs = offsets(counts);
        let (me, comm) = (self.rank, self.raw(false)?);
        let gather = |ip: u64, op: u64| {
            self.enqueue_with(&what, (CollOp::AllGather, total, input.dtype()), false, |s| {
                for (root, (&o, &c)) in offs.iter().zip(counts).enumerate().filter(|(_, (_, &c))| c > 0) {
                    let send = if root == me { ip } else { op + o as u64 * es };
                    // SAFETY: `out` holds `total` elements; the root's send buffer holds `c`.
                    ok(unsafe {
                        ns::ncclBroadcast(
                            send as *const c_void,
                            (op + o as u64 * es) as *mut c_void,
                            c,
                            ty,
                            root as i32,
                            comm,
                            s,
                        )
                    })?;
                }
                Ok(())
            })
        };
        // `out` written; `input` read when this rank contributes values
        let done = self.writing(&out, &what, |op| match counts[me] {
            0 => gather(0, op),
            _ => self.reading(input, &what, |ip| gather(ip, op)),
        })?;
        Ok((out, Some(done)))
    }

    /// The result of a `*_start` collective, joined at once (the blocking form).
    fn joined(&self, (out, done): (Tensor, Option<Arc<CudaEvent>>)) -> Result<Tensor> {
        if let Some(d) = done {
            self.join_compute(&d)?;
        }
        Ok(out)
    }

    /// Reduce-scatter-v (sum): `input` is the concatenation of slices of `counts`; this rank gets slice
    /// `rank` summed over ranks as a new tensor.
    pub fn reduce_scatter_v_sum(&self, input: &Tensor, counts: &[usize], label: &str) -> Result<Tensor> {
        self.joined(self.reduce_scatter_v_sum_start(input, counts, label)?)
    }

    /// `reduce_scatter_v_sum` without the compute stream waiting for it: the result may be used only
    /// after `join_compute(done)`, and `input` must stay alive until then (None: nothing was queued).
    pub fn reduce_scatter_v_sum_start(
        &self,
        input: &Tensor,
        counts: &[usize],
        label: &str,
    ) -> Result<(Tensor, Option<Arc<CudaEvent>>)> {
        let what = format!("reduce_scatter \"{label}\"");
        self.check_counts(counts, input.elem_count(), &what)?;
        let out = crate::device::zeros_1d(counts[self.rank], input.dtype(), &self.device)?;
        if input.elem_count() == 0 {
            return Ok((out, None));
        }
        let ty = nccl_type(input.dtype(), &what)?;
        let es = input.dtype().size_in_bytes() as u64;
        let offs = offsets(counts);
        let (me, comm) = (self.rank, self.raw(false)?);
        let sig = (CollOp::ReduceScatter, input.elem_count(), input.dtype());
        let scatter = |ip: u64, op: u64| {
            self.enqueue_with(&what, sig, false, |s| {
                for (root, (&o, &c)) in offs.iter().zip(counts).enumerate().filter(|(_, (_, &c))| c > 0) {
                    // off the root the receive buffer is ignored
                    let recv = if root == me { op } else { ip + o as u64 * es };
                    // SAFETY: the slice lies inside `input`; the root's `out` holds `c` elements.
                    ok(unsafe {
                        ns::ncclReduce(
                            (ip + o as u64 * es) as *const c_void,
                            recv as *mut c_void,
                            c,
                            ty,
                            ns::ncclRedOp_t::ncclSum,
                            root as i32,
                            comm,
                            s,
                        )
                    })?;
                }
                Ok(())
            })
        };
        // `input` read; `out` written when this rank owns a slice (else no call receives into it)
        let done = self.reading(input, &what, |ip| match counts[me] {
            0 => scatter(ip, ip),
            _ => self.writing(&out, &what, |op| scatter(ip, op)),
        })?;
        Ok((out, Some(done)))
    }

    /// Equal-chunk all-to-all inside this rank's sequence-parallel group, on the storage of a custom
    /// op (`sequence::AllToAll`): P chunks of the contiguous input, chunk j to group rank j; chunk i of
    /// the new storage came from group rank i.
    pub fn sp_all_to_all_storage(&self, s: &CudaStorage, l: &Layout, label: &str) -> Result<CudaStorage> {
        let what = format!("all_to_all \"{label}\"");
        let p = self.sp;
        let Some((lo, hi)) = l.contiguous_offsets() else { bail!("{what}: the input must be contiguous") };
        let n = hi - lo;
        if !n.is_multiple_of(p) {
            bail!("internal: {what} of {n} values over {p} ranks");
        }
        nccl_type(s.dtype(), &what)?;
        let dev = self.dev.clone();
        Ok(match s.dtype() {
            DType::F32 => CudaStorage::wrap_cuda_slice(self.all_to_all_into::<f32>(s, lo, n, &what)?, dev),
            DType::BF16 => CudaStorage::wrap_cuda_slice(self.all_to_all_into::<half::bf16>(s, lo, n, &what)?, dev),
            d => bail!("{what}: sequence parallelism exchanges f32 or bf16, not {d:?}"),
        })
    }

    /// The all-to-all of `sp_all_to_all_storage` from `s` (its `n` elements from `lo`) into a new
    /// buffer, which the collective stream writes under cudarc's write guard.
    fn all_to_all_into<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
        &self,
        s: &CudaStorage,
        lo: usize,
        n: usize,
        what: &str,
    ) -> Result<CudaSlice<T>> {
        let p = self.sp;
        let chunk = n / p;
        let ty = nccl_type(s.dtype(), what)?;
        let bytes = (chunk * s.dtype().size_in_bytes()) as u64;
        self.check_device(s, what)?;
        let mut out = self.dev.alloc_zeros::<T>(n)?;
        let comm = self.raw(true)?;
        {
            let (op, _write) = out.device_ptr_mut(&self.stream);
            super::buffers::with_read(s, lo, &self.stream, what, |ip| {
                self.enqueue(what, (CollOp::AllToAll, n, s.dtype()), |st| {
                    for peer in 0..p {
                        let at = peer as u64 * bytes;
                        // SAFETY: chunk `peer` of the input and of the new buffer each hold `chunk` elements.
                        ok(unsafe { ns::ncclSend((ip + at) as *const c_void, chunk, ty, peer as i32, comm, st) })?;
                        ok(unsafe { ns::ncclRecv((op + at) as *mut c_void, chunk, ty, peer as i32, comm, st) })?;
                    }
                    Ok(())
                })
            })?;
        }
        Ok(out)
    }

    fn check_counts(&self, counts: &[usize], n: usize, what: &str) -> Result<()> {
        if counts.len() != self.world || counts.iter().sum::<usize>() != n {
            bail!("internal: {what} over {n} values with counts {counts:?} for {} ranks", self.world);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::offsets;

    #[test]
    fn ragged_offsets_are_exclusive_prefix_sums() {
        assert_eq!(offsets(&[3, 0, 5, 1]), vec![0, 3, 3, 8]);
        assert!(offsets(&[]).is_empty());
    }
}
