//! `Nccl`: one rank per process and GPU, collectives on device memory through NCCL (cudarc's raw
//! bindings), on a stream of their own, watched so that no rank ever hangs on a lost peer.
//!
//! Reference: the NCCL user guide (ncclAllReduce / ncclBroadcast / ncclReduce /
//! ncclSend+ncclRecv in a group, "Fault tolerance": ncclCommGetAsyncError + ncclCommAbort from another
//! thread); torch's ProcessGroupNCCL (a watchdog thread per communicator, a timeout per collective).
//! Start-up (`NcclComm::join`): the TCP rendezvous checks token / binary / config hash and hands every
//! rank rank 0's `ncclUniqueId`; its connections stay open as the failure watch (`launch::watch`); the
//! process opens `cuda:LOCAL_RANK`, then `ncclCommInitRank`; a sequence-parallel run splits a second
//! communicator per group of P consecutive ranks (`ncclCommSplit`, color = data-parallel rank).
//! The non-obvious decisions:
//! - Collectives run on their own stream: it first waits for an event recorded on candle's compute
//!   stream (the producers are done), and the compute stream then waits for the collective's event, so
//!   the host never blocks on a gradient or weight exchange; only `all_reduce_sum_f64` (the per-step
//!   scalars) and `barrier` wait on the host, polling, so a timeout can fire there too.
//! - Ragged collectives (ZeRO's ownership slices differ in size) are NCCL groups: an all-gather-v is
//!   one `ncclBroadcast` per root into its offset, a reduce-scatter-v one `ncclReduce` per root, an
//!   all-to-all one send + one recv per peer — no padding to the largest slice.
//! - Flat-buffer collectives work in place on the `FlatBuf::Device` tensor (never shared, see
//!   flatbuf.rs), like the fused AdamW kernel: no second copy of 7B gradients.
//! - Failure: every enqueued collective is a pending (events, label, start) on the watchdog's list; the
//!   watchdog thread (every 20 ms) drops the completed ones, and when the oldest has run on the GPU for
//!   longer than `dist.timeout_s` (its clock starts when the collective stream reaches it, not when the
//!   host queued it) or NCCL reports an asynchronous error it records the failure, tells the group
//!   through the watch, and aborts the communicators, which makes waiting kernels return. A failure of
//!   another rank (from the watch) aborts them too. Every later collective returns the first failure as
//!   its error; and if the training loop has not stopped `dist.timeout_s` after an abort, the process
//!   prints the failure and exits (status 1): the guarantee "every rank stops within the timeout"
//!   does not depend on what the loop was blocked in.
//!
//! - Collective signatures (`dist.check_collectives`): each enqueue records (seq, op, count, dtype) in
//!   the rank's `SigLog`; every `SIG_EVERY` collectives the window goes to rank 0 over the watch, which
//!   compares the ranks' windows and stops every rank on a difference (NCCL itself would run a
//!   same-size mismatch with wrong values).
//!
//! - Overlap: ZeRO 2-3 start each group's gradient reduce-scatter without the compute stream waiting
//!   (`reduce_scatter_v_sum_start`); the result is joined and added to the shard only when the next
//!   group's gradients are handed on (or the micro-batch ends), so the exchange of layer l runs while
//!   the backward of the layers before it does.
//!
//! - ZeRO-3's next layer weights are gathered while the current layer computes
//!   (`zero::ZeroShards::gather` with `next`, through `all_gather_v_start`: `Comm::overlaps` is true here).
//! - Empty slices (a rank that owns none of a layer): no zero-length device allocation (`device::zeros_1d`).
//!
//! What it does not do: reduce in bf16, or run anywhere but on CUDA devices (one GPU per rank: NCCL
//! refuses two ranks on one GPU; the thread backend `Local` shares one). Compiled with `--features nccl`
//! only; not run in CI (no GPU there).
//!
//! The files: `nccl/guard.rs` (abortable handles, the failure state, the watchdog); this file joins the
//! group and enqueues the collectives.
mod guard;

use crate::launch::env::LaunchEnv;
use crate::launch::rendezvous::{rendezvous, RendezvousSpec};
use crate::launch::signature::GroupFailure;
use crate::launch::signature::{CollOp, SigLog};
use crate::launch::watch::Watch;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Storage, Tensor};
use cudarc::driver::{CudaEvent, CudaStream, DevicePtr};
use cudarc::nccl::{result as nr, sys as ns};
use guard::{check_nccl, nccl_err, start_watchdog, Guard, Pending, Raw};
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Bytes of an `ncclUniqueId`.
const ID_BYTES: usize = 128;

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

/// One rank's NCCL communicator(s), device and collective stream.
pub struct NcclComm {
    rank: usize,
    world: usize,
    /// the sequence-parallel degree (ranks r*P..(r+1)*P share sequences)
    sp: usize,
    device: Device,
    dev: CudaDevice,
    stream: Arc<CudaStream>,
    world_comm: Arc<Raw>,
    /// the communicator of this rank's sequence-parallel group (P > 1)
    sp_comm: Option<Arc<Raw>>,
    guard: Arc<Guard>,
    pending: Arc<Mutex<VecDeque<Pending>>>,
    seq: AtomicU64,
    /// the collective signatures of this rank (`dist.check_collectives`; records nothing when off)
    sigs: Mutex<SigLog>,
    stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm(rank {} of {}, sp {})", self.rank, self.world, self.sp)
    }
}

/// The rendezvous of `env`'s group, with the NCCL unique id rank 0 created (`ncclGetUniqueId`) as its
/// payload.
fn rendezvous_with_id(
    env: &LaunchEnv,
    resolved_config: &str,
    timeout: Duration,
) -> Result<(crate::launch::rendezvous::Rendezvous, ns::ncclUniqueId)> {
    let spec = RendezvousSpec::from_launch(env, resolved_config, timeout);
    let mut id_err = None;
    let rv = rendezvous(&spec, || match nr::get_uniqueid() {
        Ok(id) => id.internal.iter().map(|&c| c as u8).collect(),
        Err(e) => {
            id_err = Some(nccl_err(e.0));
            vec![]
        }
    })?;
    if let Some(e) = id_err {
        bail!("rank 0 could not create the NCCL unique id: {e}\nhint: is libnccl.so.2 on LD_LIBRARY_PATH?");
    }
    if rv.payload().len() != ID_BYTES {
        bail!(
            "rank {}: the rendezvous delivered {} bytes instead of an NCCL id (rank 0 could not create it; its log says why)",
            env.rank,
            rv.payload().len()
        );
    }
    let mut id = ns::ncclUniqueId { internal: [0; ID_BYTES] };
    for (d, s) in id.internal.iter_mut().zip(rv.payload()) {
        *d = *s as std::ffi::c_char;
    }
    Ok((rv, id))
}

impl NcclComm {
    /// Join the group this process was launched into (`env`): rendezvous (token, binary, config hash
    /// of `resolved_config`), failure watch, `cuda:LOCAL_RANK`, `ncclCommInitRank`, and for `sp` > 1
    /// the split per sequence-parallel group. `timeout` bounds the rendezvous and every collective;
    /// `check_every`: collectives per signature window (0: no signature check).
    pub fn join(
        env: &LaunchEnv,
        resolved_config: &str,
        timeout: Duration,
        sp: usize,
        check_every: u64,
    ) -> Result<NcclComm> {
        let (rank, world) = (env.rank, env.world_size);
        let sp = sp.max(1);
        if !world.is_multiple_of(sp) {
            bail!("dist.sp_degree = {sp} does not divide the world size {world}\nhint: choose a divisor of {world}");
        }
        let (rv, id) = rendezvous_with_id(env, resolved_config, timeout)?;
        let guard = Arc::new(Guard {
            rank,
            timeout,
            failure: Mutex::new(None),
            comms: Mutex::new(vec![]),
            watch: OnceLock::new(),
            exit_armed: AtomicBool::new(false),
            busy: Mutex::new(None),
            finished: AtomicBool::new(false),
        });
        let g = Arc::clone(&guard);
        let watch = Watch::start(rv, Box::new(move |f| g.fail(f.clone())))?;
        let _ = guard.watch.set(watch);
        // every start-up failure from here on is told to the group (the peers then name its reason)
        let failed = |doing: &str, e: anyhow::Error| -> anyhow::Error {
            guard.fail(GroupFailure { rank, doing: doing.into(), reason: format!("{e:#}") });
            e
        };

        // cuda:LOCAL_RANK, or the only device when the launcher bound one GPU to this task (floors::rank_gpu)
        let gpu = crate::floors::rank_gpu(env.local_rank).map_err(|e| failed("choosing its GPU", e))?;
        let device = Device::new_cuda(gpu)
            .with_context(|| {
                format!(
                    "rank {rank}: opening cuda:{gpu} (LOCAL_RANK {})\nhint: NCCL needs one GPU per rank on each node; \
                     check CUDA_VISIBLE_DEVICES and --nproc-per-node",
                    env.local_rank
                )
            })
            .map_err(|e| failed("opening its GPU", e))?;
        crate::device::keep_freed_device_memory(&device).map_err(|e| failed("opening its GPU", e))?;
        let dev = device.as_cuda_device().map_err(|e| failed("opening its GPU", e.into()))?.clone();
        let stream = dev
            .cuda_stream()
            .context()
            .new_stream()
            .context("creating the collective stream")
            .map_err(|e| failed("creating the collective stream", e))?;
        let pending = Arc::new(Mutex::new(VecDeque::new()));
        let stop = Arc::new(AtomicBool::new(false));
        // the watchdog runs before ncclCommInitRank, which blocks until every rank joined
        start_watchdog(&guard, &pending, &stop, Arc::clone(stream.context()))
            .map_err(|e| failed("starting the watchdog", e))?;
        let world_comm = guard.init_world(id, world).map_err(|e| failed("in ncclCommInitRank", e))?;
        guard.check()?; // a failure that arrived during the init found no communicator to abort
        let sp_comm = match sp {
            1 => None,
            _ => Some(guard.split_sp(&world_comm, sp).map_err(|e| failed("in ncclCommSplit", e))?),
        };
        Ok(NcclComm {
            rank,
            world,
            sp,
            device,
            dev,
            stream,
            world_comm,
            sp_comm,
            guard,
            pending,
            seq: AtomicU64::new(0),
            sigs: Mutex::new(SigLog::new(check_every)),
            stop,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The sequence-parallel degree the communicators were built for.
    pub fn sp_degree(&self) -> usize {
        self.sp
    }

    /// The training device of this rank (`cuda:LOCAL_RANK`): the one every tensor of the run must use.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// This rank leaves normally (the peers do not take its closing connection as a failure).
    pub fn finish(&self) {
        self.guard.finished.store(true, Ordering::SeqCst);
        self.stop.store(true, Ordering::SeqCst);
        if let Some(w) = self.guard.watch.get() {
            w.finish();
        }
    }

    /// This rank failed outside a collective: tell the group (the others stop naming this rank).
    pub fn report_failure(&self, doing: &str, reason: &str) {
        self.guard.fail(GroupFailure { rank: self.rank, doing: doing.into(), reason: reason.into() });
    }

    /// The first failure seen in the group (another rank's, or this rank's watchdog), if any.
    pub fn failure(&self) -> Option<GroupFailure> {
        self.guard.failure.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Tell rank 0 what this rank is doing (named if this process dies).
    pub fn progress(&self, doing: &str) {
        if let Some(w) = self.guard.watch.get() {
            w.progress(doing);
        }
    }

    /// Device address of the first element of a contiguous tensor on this rank's device.
    fn ptr(&self, t: &Tensor, what: &str) -> Result<u64> {
        let (st, l) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*st else { bail!("{what}: the tensor is not on a CUDA device") };
        let Some((lo, _)) = l.contiguous_offsets() else { bail!("{what}: the tensor must be contiguous") };
        self.storage_ptr(cs, lo, what)
    }

    /// Device address of element `lo` of a CUDA storage on this rank's device.
    fn storage_ptr(&self, cs: &candle_core::CudaStorage, lo: usize, what: &str) -> Result<u64> {
        if cs.device().id() != self.dev.id() {
            bail!("{what}: the tensor is on another CUDA device than this rank's");
        }
        let base = match cs.dtype() {
            DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(&self.stream).0,
            DType::F64 => cs.as_cuda_slice::<f64>()?.device_ptr(&self.stream).0,
            DType::BF16 => cs.as_cuda_slice::<half::bf16>()?.device_ptr(&self.stream).0,
            DType::F16 => cs.as_cuda_slice::<half::f16>()?.device_ptr(&self.stream).0,
            d => bail!("{what}: NCCL collectives take f32, f64, bf16 or f16 tensors, not {d:?}"),
        };
        Ok(base + (lo * cs.dtype().size_in_bytes()) as u64)
    }

    /// Enqueue the NCCL calls of `f` as one group on the collective stream, ordered after the compute
    /// stream's work so far and before its work from now on; returns the completion event.
    /// `sig`: the collective's (op, whole element count, dtype), for the signature check.
    fn enqueue(
        &self,
        what: &str,
        sig: (CollOp, usize, DType),
        f: impl FnOnce(ns::cudaStream_t) -> std::result::Result<(), ns::ncclResult_t>,
    ) -> Result<Arc<CudaEvent>> {
        self.enqueue_with(what, sig, true, f)
    }

    /// `enqueue`, where `join = false` leaves the compute stream free to run on: the caller makes it
    /// wait (`join_compute`) before the first use of the result (the overlapped reduce-scatter of ZeRO).
    fn enqueue_with(
        &self,
        what: &str,
        (op, count, dtype): (CollOp, usize, DType),
        join: bool,
        f: impl FnOnce(ns::cudaStream_t) -> std::result::Result<(), ns::ncclResult_t>,
    ) -> Result<Arc<CudaEvent>> {
        self.guard.check()?;
        let seq = self.seq.fetch_add(1, Ordering::SeqCst) + 1;
        // one hash step per collective; every `check_every` a small write to rank 0 (never waited for)
        let window = self.sigs.lock().unwrap_or_else(|p| p.into_inner()).record(op, count, dtype);
        if let (Some(w), Some(watch)) = (window, self.guard.watch.get()) {
            watch.check_signatures(w);
        }
        let what = format!("collective #{seq} {what}");
        let compute = self.dev.cuda_stream();
        self.stream.wait(&compute.record_event(None)?)?;
        let started = Arc::new(self.stream.record_event(None)?);
        check_nccl(nr::group_start(), &what)?;
        // the group's calls and ncclGroupEnd may block on the host (connection set-up): timed too
        let (r, end) = self.guard.timed(&what, || (f(self.stream.cu_stream() as ns::cudaStream_t), nr::group_end()));
        if let Err(e) = r {
            let reason = format!("NCCL error {}", nccl_err(e));
            self.guard.fail(GroupFailure { rank: self.rank, doing: format!("in {what}"), reason });
            self.guard.check()?;
        }
        if let Err(e) = end {
            let reason = format!("ncclGroupEnd: {}", nccl_err(e.0));
            self.guard.fail(GroupFailure { rank: self.rank, doing: format!("in {what}"), reason });
            self.guard.check()?;
        }
        let done = Arc::new(self.stream.record_event(None)?);
        if join {
            compute.wait(&done)?;
        }
        let p = Pending { done: Arc::clone(&done), started, what, since: None };
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).push_back(p);
        Ok(done)
    }

    /// Wait on the host for `done`, failing with the group's failure or at the timeout.
    fn wait(&self, done: &CudaEvent, what: &str) -> Result<()> {
        let t0 = Instant::now();
        loop {
            self.guard.check()?;
            if done.try_is_complete().with_context(|| format!("waiting for {what}"))? {
                return Ok(());
            }
            if t0.elapsed() > self.guard.timeout {
                let reason = format!("{what} not complete after {:.0}s", self.guard.timeout.as_secs_f64());
                self.guard.fail(GroupFailure { rank: self.rank, doing: format!("waiting for {what}"), reason });
                self.guard.check()?;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn raw(&self, sp_group: bool) -> Result<ns::ncclComm_t> {
        let c = if sp_group {
            self.sp_comm.as_ref().ok_or_else(|| anyhow!("internal: no sequence-parallel communicator"))?
        } else {
            &self.world_comm
        };
        if c.aborted.load(Ordering::SeqCst) {
            self.guard.check()?;
            bail!("rank {}: the NCCL communicator was aborted", self.rank);
        }
        Ok(c.comm)
    }

    /// In-place sum over all ranks of a contiguous device tensor (a `FlatBuf::Device` buffer: never
    /// shared, so the in-place write is seen by nobody else).
    pub fn all_reduce_sum_inplace(&self, t: &Tensor, label: &str) -> Result<()> {
        let what = format!("all_reduce \"{label}\"");
        if t.elem_count() == 0 {
            return Ok(());
        }
        let (p, n, ty) = (self.ptr(t, &what)?, t.elem_count(), nccl_type(t.dtype(), &what)?);
        let comm = self.raw(false)?;
        self.enqueue(&what, (CollOp::AllReduce, n, t.dtype()), |s| {
            // SAFETY: `p` addresses `n` elements of type `ty` on this rank's device (checked by `ptr`).
            let r = unsafe {
                ns::ncclAllReduce(p as *const c_void, p as *mut c_void, n, ty, ns::ncclRedOp_t::ncclSum, comm, s)
            };
            ok(r)
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
        let (p, n) = (self.ptr(&t, what)?, vals.len());
        let comm = self.raw(false)?;
        let done = self.enqueue(what, (CollOp::AllReduce, n, DType::F64), |s| {
            // SAFETY: `p` addresses `n` f64 of `t`, alive until the copy back below.
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
        let (base, ty) = (self.ptr(t, what)?, nccl_type(t.dtype(), what)?);
        let es = t.dtype().size_in_bytes() as u64;
        let offs = offsets(counts);
        let comm = self.raw(false)?;
        self.enqueue(what, (op, t.elem_count(), t.dtype()), |s| {
            for (root, (&o, &c)) in offs.iter().zip(counts).enumerate().filter(|(_, (_, &c))| c > 0) {
                ok(call((base + o as u64 * es) as *mut c_void, c, ty, root as i32, comm, s))?;
            }
            Ok(())
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
        let ip = if counts[self.rank] > 0 { self.ptr(input, &what)? } else { 0 };
        let (op, ty) = (self.ptr(&out, &what)?, nccl_type(input.dtype(), &what)?);
        let es = input.dtype().size_in_bytes() as u64;
        let offs = offsets(counts);
        let (me, comm) = (self.rank, self.raw(false)?);
        let done = self.enqueue_with(&what, (CollOp::AllGather, total, input.dtype()), false, |s| {
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
        })?;
        Ok((out, Some(done)))
    }

    /// Make the compute stream wait for a collective started without joining it.
    pub fn join_compute(&self, done: &CudaEvent) -> Result<()> {
        Ok(self.dev.cuda_stream().wait(done)?)
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
        let (ip, ty) = (self.ptr(input, &what)?, nccl_type(input.dtype(), &what)?);
        let op = if counts[self.rank] > 0 { self.ptr(&out, &what)? } else { ip };
        let es = input.dtype().size_in_bytes() as u64;
        let offs = offsets(counts);
        let (me, comm) = (self.rank, self.raw(false)?);
        let sig = (CollOp::ReduceScatter, input.elem_count(), input.dtype());
        let done = self.enqueue_with(&what, sig, false, |s| {
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
        })?;
        Ok((out, Some(done)))
    }

    /// Equal-chunk all-to-all inside this rank's sequence-parallel group, on the storage of a custom
    /// op (`sequence::AllToAll`): P chunks of the contiguous input, chunk j to group rank j; chunk i of
    /// the new storage came from group rank i.
    pub fn sp_all_to_all_storage(
        &self,
        s: &candle_core::CudaStorage,
        l: &candle_core::Layout,
        label: &str,
    ) -> Result<candle_core::CudaStorage> {
        use candle_core::CudaStorage;
        let what = format!("all_to_all \"{label}\"");
        let p = self.sp;
        let Some((lo, hi)) = l.contiguous_offsets() else { bail!("{what}: the input must be contiguous") };
        let n = hi - lo;
        if !n.is_multiple_of(p) {
            bail!("internal: {what} of {n} values over {p} ranks");
        }
        let chunk = n / p;
        let ty = nccl_type(s.dtype(), &what)?;
        let es = s.dtype().size_in_bytes() as u64;
        let out = match s.dtype() {
            DType::F32 => CudaStorage::wrap_cuda_slice(self.dev.alloc_zeros::<f32>(n)?, self.dev.clone()),
            DType::BF16 => CudaStorage::wrap_cuda_slice(self.dev.alloc_zeros::<half::bf16>(n)?, self.dev.clone()),
            d => bail!("{what}: sequence parallelism exchanges f32 or bf16, not {d:?}"),
        };
        let (ip, op) = (self.storage_ptr(s, lo, &what)?, self.storage_ptr(&out, 0, &what)?);
        let bytes = chunk as u64 * es;
        let comm = self.raw(true)?;
        self.enqueue(&what, (CollOp::AllToAll, n, s.dtype()), |st| {
            for peer in 0..p {
                let at = peer as u64 * bytes;
                // SAFETY: chunk `peer` of the input and of the new buffer each hold `chunk` elements.
                ok(unsafe { ns::ncclSend((ip + at) as *const c_void, chunk, ty, peer as i32, comm, st) })?;
                ok(unsafe { ns::ncclRecv((op + at) as *mut c_void, chunk, ty, peer as i32, comm, st) })?;
            }
            Ok(())
        })?;
        Ok(out)
    }

    fn check_counts(&self, counts: &[usize], n: usize, what: &str) -> Result<()> {
        if counts.len() != self.world || counts.iter().sum::<usize>() != n {
            bail!("internal: {what} over {n} values with counts {counts:?} for {} ranks", self.world);
        }
        Ok(())
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.stream.synchronize();
    }
}

fn ok(r: ns::ncclResult_t) -> std::result::Result<(), ns::ncclResult_t> {
    match r {
        ns::ncclResult_t::ncclSuccess | ns::ncclResult_t::ncclInProgress => Ok(()),
        e => Err(e),
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
