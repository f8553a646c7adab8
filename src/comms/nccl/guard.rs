//! The failure side of the NCCL backend (see the header of `nccl.rs`): communicator handles that any
//! thread may abort once (`Raw`), the group's first failure and what follows it (`Guard`: abort every
//! communicator, tell the group, exit if the loop does not stop within the timeout), the collectives
//! not yet seen complete (`Pending`) and the watchdog thread that times them. Apart from the
//! collectives, which only enqueue, register and check.
use crate::launch::signature::GroupFailure;
use crate::launch::watch::Watch;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::CudaEvent;
use cudarc::nccl::{result as nr, sys as ns};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// One NCCL communicator handle, abortable from any thread, at most once.
pub(super) struct Raw {
    pub(super) comm: ns::ncclComm_t,
    pub(super) aborted: AtomicBool,
    /// held by `abort` and `async_error`, so the watchdog never queries a communicator being freed
    /// (the training thread's enqueues cannot take it: an abort is what unblocks a hung enqueue)
    pub(super) lock: Mutex<()>,
}

// SAFETY: an ncclComm_t may be used from any thread; this crate serializes enqueues per communicator
// (one training thread per rank) and the only cross-thread call is ncclCommAbort (documented as safe to
// call from another thread to unblock a hang) and ncclCommGetAsyncError (thread-safe query).
unsafe impl Send for Raw {}
unsafe impl Sync for Raw {}

impl Raw {
    pub(super) fn new(comm: ns::ncclComm_t) -> Raw {
        Raw { comm, aborted: AtomicBool::new(false), lock: Mutex::new(()) }
    }

    pub(super) fn abort(&self) {
        let _held = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: the handle came from ncclCommInitRank/Split and is aborted only here, once.
            let _ = unsafe { ns::ncclCommAbort(self.comm) };
        }
    }

    /// The communicator's asynchronous error, if NCCL reported one.
    pub(super) fn async_error(&self) -> Option<ns::ncclResult_t> {
        let _held = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        if self.aborted.load(Ordering::SeqCst) {
            return None;
        }
        let mut r = ns::ncclResult_t::ncclSuccess;
        // SAFETY: a live handle and a valid out pointer.
        let q = unsafe { ns::ncclCommGetAsyncError(self.comm, &mut r) };
        match (q, r) {
            (ns::ncclResult_t::ncclSuccess, ns::ncclResult_t::ncclSuccess | ns::ncclResult_t::ncclInProgress) => None,
            (ns::ncclResult_t::ncclSuccess, e) | (e, _) => Some(e),
        }
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::SeqCst) {
            // SAFETY: not aborted, so the handle is live; nothing uses it after the drop.
            let _ = unsafe { ns::ncclCommDestroy(self.comm) };
        }
    }
}

/// An enqueued collective not yet seen complete.
pub(super) struct Pending {
    pub(super) done: Arc<CudaEvent>,
    /// recorded on the collective stream just before the collective: complete once the GPU reached it
    pub(super) started: Arc<CudaEvent>,
    pub(super) what: String,
    /// when the watchdog first saw `started` complete: the timeout clock. Not the enqueue time, since the
    /// host runs ahead of the GPU (up to a step's kernels at long T) and a collective queued behind that
    /// compute would otherwise spend part of `dist.timeout_s` waiting for its own rank's work.
    pub(super) since: Option<Instant>,
}

/// The group's failure state, shared by the training thread, the watchdog and the watch's readers.
pub(super) struct Guard {
    pub(super) rank: usize,
    pub(super) timeout: Duration,
    pub(super) failure: Mutex<Option<GroupFailure>>,
    pub(super) comms: Mutex<Vec<Arc<Raw>>>,
    pub(super) watch: OnceLock<Watch>,
    pub(super) exit_armed: AtomicBool,
    /// a host call into NCCL that may block (init, split, a group's enqueue) and since when: timed by
    /// the watchdog like a pending collective
    pub(super) busy: Mutex<Option<(String, Instant)>>,
    /// this rank left normally: later failures of others no longer concern it
    pub(super) finished: AtomicBool,
}

impl Guard {
    /// Run `f`, a host call into NCCL that may block, under the watchdog's timer.
    pub(super) fn timed<R>(&self, what: &str, f: impl FnOnce() -> R) -> R {
        *self.busy.lock().unwrap_or_else(|p| p.into_inner()) = Some((what.to_string(), Instant::now()));
        let r = f();
        *self.busy.lock().unwrap_or_else(|p| p.into_inner()) = None;
        r
    }

    /// Record the first failure, abort every communicator, arm the exit, and (ours) tell the group —
    /// in that order, so a peer whose socket does not drain cannot hold up the abort.
    pub(super) fn fail(&self, f: GroupFailure) {
        if self.finished.load(Ordering::SeqCst) {
            return;
        }
        {
            let mut g = self.failure.lock().unwrap_or_else(|p| p.into_inner());
            if g.is_some() {
                return;
            }
            *g = Some(f.clone());
        }
        let comms: Vec<Arc<Raw>> = self.comms.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for c in comms {
            c.abort();
        }
        self.arm_exit(&f);
        if f.rank == self.rank {
            if let Some(w) = self.watch.get() {
                w.report(&f.doing, &f.reason);
            }
        }
    }

    /// After `timeout`, print `f` and end the process without running exit handlers (CUDA / NCCL
    /// teardown may hang with kernels still stuck): the "stops within the timeout" guarantee.
    pub(super) fn arm_exit(&self, f: &GroupFailure) {
        let f = f.clone();
        if !self.exit_armed.swap(true, Ordering::SeqCst) {
            let (rank, grace) = (self.rank, self.timeout);
            let _ = std::thread::Builder::new().name("harpe-nccl-exit".into()).spawn(move || {
                std::thread::sleep(grace);
                eprintln!(
                    "harpe: rank {rank}: {f}\nharpe: rank {rank}: the training loop did not stop within {:.0}s after \
                     the NCCL communicators were aborted; exiting (status 1)",
                    grace.as_secs_f64()
                );
                // SAFETY: _exit(2) ends the process at once; stderr is unbuffered, so the message is out.
                unsafe { libc::_exit(1) }
            });
        }
    }

    /// The first failure as an error, if there is one.
    pub(super) fn check(&self) -> Result<()> {
        match &*self.failure.lock().unwrap_or_else(|p| p.into_inner()) {
            None => Ok(()),
            Some(f) => Err(failure_error(f)),
        }
    }
    /// `ncclCommInitRank` of this rank in a world of `world` (blocks until every rank joined; the
    /// watchdog bounds it), registered for abort.
    pub(super) fn init_world(&self, id: ns::ncclUniqueId, world: usize) -> Result<Arc<Raw>> {
        let rank = self.rank;
        let mut comm: ns::ncclComm_t = std::ptr::null_mut();
        // SAFETY: a valid out pointer, the id every rank received, rank < world; blocking init.
        let r = self
            .timed("ncclCommInitRank", || unsafe { ns::ncclCommInitRank(&mut comm, world as i32, id, rank as i32) });
        if r != ns::ncclResult_t::ncclSuccess {
            bail!(
                "rank {rank}: ncclCommInitRank (world {world}) failed: {}\nhint: NCCL_DEBUG=INFO shows why",
                nccl_err(r)
            );
        }
        Ok(self.register(comm))
    }

    /// The communicator of this rank's sequence-parallel group of `sp` consecutive ranks, split from
    /// `world_comm`, registered for abort.
    pub(super) fn split_sp(&self, world_comm: &Raw, sp: usize) -> Result<Arc<Raw>> {
        let rank = self.rank;
        let mut config = split_share_config()?;
        let mut sub: ns::ncclComm_t = std::ptr::null_mut();
        // SAFETY: a live parent; color = data-parallel rank, key = place in the group; `config` is a complete
        // ncclConfig_t (magic, size and version set) that lives across the call.
        let r = self.timed("ncclCommSplit", || unsafe {
            ns::ncclCommSplit(world_comm.comm, (rank / sp) as i32, (rank % sp) as i32, &mut sub, &mut config)
        });
        if r != ns::ncclResult_t::ncclSuccess {
            bail!("rank {rank}: ncclCommSplit for sequence parallelism (P = {sp}) failed: {}", nccl_err(r));
        }
        Ok(self.register(sub))
    }

    /// Keep `comm` where a failure aborts it.
    pub(super) fn register(&self, comm: ns::ncclComm_t) -> Arc<Raw> {
        let raw = Arc::new(Raw::new(comm));
        self.comms.lock().unwrap_or_else(|p| p.into_inner()).push(Arc::clone(&raw));
        raw
    }
}

pub(super) fn failure_error(f: &GroupFailure) -> anyhow::Error {
    anyhow!(
        "{f}\nhint: the rank named failed first; the others stopped because of it (its own log says more); the \
         last complete checkpoint is intact: resume with --resume"
    )
}

pub(super) fn nccl_err(e: ns::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any result code.
    let s = unsafe { std::ffi::CStr::from_ptr(ns::ncclGetErrorString(e)) };
    format!("{e:?} ({})", s.to_string_lossy())
}

pub(super) fn check_nccl(r: std::result::Result<nr::NcclStatus, nr::NcclError>, what: &str) -> Result<()> {
    r.map(|_| ()).map_err(|e| anyhow!("{what}: NCCL error {}", nccl_err(e.0)))
}

/// The watchdog thread (see the file header): completed collectives dropped, the oldest pending one
/// and any blocking host call timed, NCCL's asynchronous errors polled; every 20 ms until `stop`.
pub(super) fn start_watchdog(
    guard: &Arc<Guard>,
    pending: &Arc<Mutex<VecDeque<Pending>>>,
    stop: &Arc<AtomicBool>,
    ctx: Arc<cudarc::driver::CudaContext>,
) -> Result<()> {
    let (pending, guard, stop) = (Arc::clone(pending), Arc::clone(guard), Arc::clone(stop));
    let (rank, timeout) = (guard.rank, guard.timeout);
    std::thread::Builder::new().name("harpe-nccl-watchdog".into()).spawn(move || {
        let _ = ctx.bind_to_thread();
        while !stop.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(20));
            let mut q = pending.lock().unwrap_or_else(|p| p.into_inner());
            while q.front().is_some_and(|p| p.done.try_is_complete().unwrap_or(false)) {
                q.pop_front();
            }
            if let Some(p) = q.front_mut().filter(|p| p.since.is_none()) {
                if p.started.try_is_complete().unwrap_or(false) {
                    p.since = Some(Instant::now());
                }
            }
            // the oldest collective the GPU has reached (one still behind its rank's compute is not late)
            let oldest = q.front().and_then(|p| p.since.map(|t| (format!("in {}", p.what), t)));
            drop(q);
            let busy = guard.busy.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let (doing, since) = match (busy, oldest) {
                (Some((what, t)), _) => (format!("in {what} (host call)"), Some(t)),
                (None, Some((what, t))) => (what, Some(t)),
                (None, None) => ("between collectives".to_string(), None),
            };
            let comms: Vec<Arc<Raw>> = guard.comms.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if let Some(e) = comms.iter().find_map(|c| c.async_error()) {
                guard.fail(GroupFailure { rank, doing, reason: format!("NCCL reported {}", nccl_err(e)) });
            } else if let Some(t) = since.map(|t| t.elapsed()).filter(|t| *t > timeout) {
                let reason = format!(
                    "not complete after {:.0}s (dist.timeout_s = {:.0}): a peer never joined it (stuck or gone)",
                    t.as_secs_f64(),
                    timeout.as_secs_f64()
                );
                guard.fail(GroupFailure { rank, doing, reason });
            }
        }
    })?;
    Ok(())
}

/// The config of the sequence-parallel split: NCCL_CONFIG_INITIALIZER with `splitShare = 1`. Why: split
/// without it, the SP communicator sets up transport buffers of its own (per peer and channel, with
/// cudaMalloc outside candle's memory pool) beside the world communicator's, on every rank; shared, it
/// reuses the parent's. Sharing asks that the two never run at once, which holds here: every collective
/// of both is enqueued on the one collective stream, in order.
/// `version` is the running library's (`ncclGetVersion`), not the one cudarc's layout was made from, so an
/// older NCCL (the CUDA 12 build ships 2.21.5) reads the struct as its own: it copies min(`size`, its own
/// size) bytes, and its fields sit at the same offsets (NCCL only appends; `splitShare` has been where it is
/// since 2.18). A struct literal, so a change of cudarc's layout fails to compile here.
fn split_share_config() -> Result<ns::ncclConfig_t> {
    use std::ffi::{c_int, c_uint};
    // NCCL_CONFIG_UNDEF_INT and NCCL_CONFIG_UNDEF_PTR: "not set, take the default"
    const UNDEF: c_int = c_int::MIN;
    let undef_ptr = std::ptr::null();
    let version =
        cudarc::nccl::result::get_nccl_version().map_err(|e| anyhow::anyhow!("ncclGetVersion: {}", nccl_err(e.0)))?;
    Ok(ns::ncclConfig_t {
        size: std::mem::size_of::<ns::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: version as c_uint,
        blocking: UNDEF,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: undef_ptr,
        splitShare: 1,
        trafficClass: UNDEF,
        commName: undef_ptr,
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    })
}
