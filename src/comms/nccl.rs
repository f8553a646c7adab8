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
//! The files: `nccl/guard.rs` (abortable handles, the failure state, the watchdog),
//! `nccl/collectives.rs` (each collective's NCCL calls), `nccl/buffers.rs` (the device addresses handed
//! to NCCL, with cudarc's read / write guards held until the call is enqueued); this file joins the group
//! and enqueues the collectives.
mod buffers;
mod collectives;
mod guard;

use crate::launch::env::LaunchEnv;
use crate::launch::rendezvous::{rendezvous, RendezvousSpec};
use crate::launch::signature::GroupFailure;
use crate::launch::signature::{CollOp, SigLog};
use crate::launch::watch::Watch;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device};
use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::{result as nr, sys as ns};
use guard::{check_nccl, nccl_err, start_watchdog, Guard, Pending, Raw};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Bytes of an `ncclUniqueId`.
const ID_BYTES: usize = 128;

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

    /// Make the compute stream wait for a collective started without joining it.
    pub fn join_compute(&self, done: &CudaEvent) -> Result<()> {
        Ok(self.dev.cuda_stream().wait(done)?)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.stream.synchronize();
    }
}

pub(super) fn ok(r: ns::ncclResult_t) -> std::result::Result<(), ns::ncclResult_t> {
    match r {
        ns::ncclResult_t::ncclSuccess | ns::ncclResult_t::ncclInProgress => Ok(()),
        e => Err(e),
    }
}
