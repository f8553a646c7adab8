//! `Local`: N ranks as threads of one process, with real collectives on host buffers.
//!
//! It exists to prove on CPU that N ranks compute what one rank computes.
//! Reference: the operation set and argument shapes follow NCCL (`ncclAllReduce`, `ncclReduceScatter`,
//! `ncclAllGather`, `ncclBroadcast`, grouped send/recv for all-to-all) with MPI's `*_v` variants for
//! uneven slices (ZeRO ownership maps give ranks different-sized slices of the flat index space).
//!
//! The non-obvious decisions:
//! - Every collective is one *exchange round*. Each rank deposits a copy of its input and a descriptor
//!   (operation, label, sizes, element type) into the shared group; when the last rank arrives, every
//!   rank reads all deposits and computes its own output from them, summing in rank order (0, 1, ...,
//!   N-1). So the sum is bit-identical on every rank and for every thread schedule, and the code is
//!   short. The copies cost memory bandwidth, which does not matter for the CPU tests this backend serves.
//! - As NCCL runs collectives on a stream of their own, each rank issues its collectives to its own
//!   *communication thread* (started with the rank's first collective), which runs them one after the
//!   other in the order they were issued. A `*_start` collective returns at once with an `Issued`
//!   handle, so the rank computes on while the exchange runs (ZeRO-2/3's deferred gradient
//!   reduce-scatters, ZeRO-3's weight prefetch); a blocking collective is issued the same way and
//!   waited for, so it also waits for every collective issued before it, as on one NCCL stream.
//! - What a round checks (`RoundCheck`): by default every rank's full descriptor must be equal, so a
//!   rank that calls `broadcast` while the others `all_reduce` is an error at that collective. NCCL
//!   cannot do that; `RoundCheck::Transport` checks only what moving the data needs (each deposit's
//!   element type and length), as NCCL, and lets a same-size mismatch through with wrong values. Both
//!   modes also run the collective signature check of the NCCL path (`signature`): every rank records
//!   each collective when it issues it, and every `LocalChecks::sig_every` collectives compares its
//!   window with the other ranks' on the group's board (shared memory here, rank 0 over TCP under NCCL).
//!
//! Failure: a rank that returns an error, panics or drops its handle marks the group failed (the first
//! failure wins and is kept); every rank waiting in, or later entering, a collective returns an error
//! naming that rank and what it was doing. A rank that waits longer than the timeout marks the group
//! failed itself, naming the ranks that never arrived and their last collective. Nothing ever hangs
//! longer than the timeout.
//!
//! What it does not do: device (CUDA) buffers or cross-process transport; it is a correctness backend
//! for one process (the NCCL backend is the fast one).
//!
//! The files: `local/elem.rs` (element types, `ReduceOp`), `local/round.rs` (the exchange round, the group
//! and the handle's state); this file holds the collectives every rank calls and `spawn_local`.
mod elem;
mod round;

pub use elem::{Elem, ReduceOp};
pub use round::{Issued, LocalChecks, LocalComm, LocalGroup, RoundCheck};

use crate::launch::signature::{CollOp, GroupFailure};
use anyhow::{anyhow, bail, Result};
use candle_core::DType;
use round::{deposit, offsets, out_vec, reduce, Core, Job};
use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

impl LocalComm {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.core.rank
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.core.group.world
    }

    /// The group this handle belongs to.
    pub fn group(&self) -> &Arc<LocalGroup> {
        &self.core.group
    }

    /// Mark the group failed because this rank hit `reason` outside a collective (an error in its own
    /// work); the other ranks then stop at their next collective instead of waiting for the timeout.
    pub fn abort(&self, reason: &str) {
        let g = &self.core.group;
        g.mark_failed(&mut g.lock(), self.core.rank, reason.to_string());
    }

    /// Record the collective `sig` in issue order; at the end of a window, compare it on the group's
    /// board. A mismatch fails the group (every rank stops, naming both ranks' signatures).
    fn check_signature(&self, (op, count, dtype): (CollOp, usize, DType)) -> Result<()> {
        let window = self.sigs.lock().unwrap_or_else(|p| p.into_inner()).record(op, count, dtype);
        let Some(w) = window else { return Ok(()) };
        let g = &self.core.group;
        let verdict = g.board.lock().unwrap_or_else(|p| p.into_inner()).submit(self.core.rank, w);
        let Err(m) = verdict else { return Ok(()) };
        let f = GroupFailure::from_mismatch(&m);
        g.record_failure(&mut g.lock(), f.clone());
        Err(anyhow::Error::new(f).context(format!("rank {}: the collective signature check failed", self.core.rank)))
    }

    /// Issue `job` (the collective `sig`) to this rank's communication thread, after the collectives
    /// issued before it; returns at once.
    fn issue<R: Send + 'static>(
        &self,
        sig: (CollOp, usize, DType),
        job: impl FnOnce(&Core) -> Result<R> + Send + 'static,
    ) -> Result<Issued<R>> {
        self.check_signature(sig)?;
        let rank = self.core.rank;
        let (tx, rx) = mpsc::sync_channel(1);
        let run: Job = Box::new(move |core: &Core| {
            let r = catch_unwind(AssertUnwindSafe(|| job(core))).unwrap_or_else(|p| {
                let reason = format!("its communication thread panicked: {}", panic_message(&*p));
                core.group.mark_failed(&mut core.group.lock(), core.rank, reason.clone());
                Err(anyhow!("rank {}: {reason}", core.rank))
            });
            let _ = tx.send(r);
        });
        let mut lane = self.lane.lock().unwrap_or_else(|p| p.into_inner());
        if lane.is_none() {
            let (queue, jobs) = mpsc::channel::<Job>();
            let core = Arc::clone(&self.core);
            let thread = std::thread::Builder::new()
                .name(format!("local-comm-{rank}"))
                .spawn(move || jobs.into_iter().for_each(|job| job(&core)))
                .map_err(|e| anyhow!("rank {rank}: could not start its communication thread: {e}"))?;
            *lane = Some((queue, thread));
        }
        let sent = lane.as_ref().map(|(queue, _)| queue.send(run).is_ok());
        if sent != Some(true) {
            bail!("internal: rank {rank}'s communication thread has ended");
        }
        Ok(Issued { rx, rank })
    }

    /// Reduce `buf` over all ranks in place (sum or average, in rank order: bit-identical everywhere).
    pub fn all_reduce<T: Elem>(&self, buf: &mut [T], op: ReduceOp, label: &str) -> Result<()> {
        let n = buf.len();
        let desc = format!("all_reduce({op:?}, {n} x {})", std::any::type_name::<T>());
        let (data, label, out) = (buf.to_vec(), label.to_string(), out_vec(n));
        let out = self
            .issue((CollOp::AllReduce, n, T::DTYPE), move |c| {
                let all = c.exchange("all_reduce", &label, desc, data)?;
                reduce::<T>(&all, n, 0..n, op, &c.ctx(&label), out)
            })?
            .wait()?;
        buf.copy_from_slice(&out);
        Ok(())
    }

    /// Equal-slice reduce-scatter: `input` is `world` slices of `output.len()`; rank r gets slice r
    /// reduced over ranks.
    pub fn reduce_scatter<T: Elem>(&self, input: &[T], output: &mut [T], op: ReduceOp, label: &str) -> Result<()> {
        let counts = vec![output.len(); self.world_size()];
        self.reduce_scatter_v(input, output, &counts, op, label)
    }

    /// Reduce-scatter with explicit slice lengths: `input` is the concatenation of slices of lengths
    /// `counts` (rank order); rank r receives slice r reduced over ranks into `output`
    /// (`output.len() == counts[r]`). Every rank must pass the same `counts`.
    pub fn reduce_scatter_v<T: Elem>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        op: ReduceOp,
        label: &str,
    ) -> Result<()> {
        if counts.len() == self.world_size() {
            self.check_len("reduce_scatter", label, "output", output.len(), counts[self.rank()])?;
        }
        output.copy_from_slice(&self.reduce_scatter_v_start(input.to_vec(), counts, op, label)?.wait()?);
        Ok(())
    }

    /// `reduce_scatter_v`, started: returns at once; the result (this rank's reduced slice) comes
    /// from `Issued::wait`.
    pub fn reduce_scatter_v_start<T: Elem>(
        &self,
        input: Vec<T>,
        counts: &[usize],
        op: ReduceOp,
        label: &str,
    ) -> Result<Issued<Vec<T>>> {
        let (offs, total) = offsets(counts, self.world_size(), "reduce_scatter")?;
        self.check_len("reduce_scatter", label, "input", input.len(), total)?;
        let desc = format!("reduce_scatter({op:?}, counts {counts:?} x {})", std::any::type_name::<T>());
        let (lo, hi) = (offs[self.rank()], offs[self.rank()] + counts[self.rank()]);
        let (label, out) = (label.to_string(), out_vec(hi - lo));
        self.issue((CollOp::ReduceScatter, total, T::DTYPE), move |c| {
            let all = c.exchange("reduce_scatter", &label, desc, input)?;
            reduce::<T>(&all, total, lo..hi, op, &c.ctx(&label), out)
        })
    }

    /// Equal-slice all-gather: `output` is `world` slices of `input.len()`, slice r from rank r.
    pub fn all_gather<T: Elem>(&self, input: &[T], output: &mut [T], label: &str) -> Result<()> {
        let counts = vec![input.len(); self.world_size()];
        self.all_gather_v(input, output, &counts, label)
    }

    /// All-gather with explicit slice lengths: rank r contributes `counts[r]` elements; `output` is
    /// their concatenation in rank order. Every rank must pass the same `counts`.
    pub fn all_gather_v<T: Elem>(&self, input: &[T], output: &mut [T], counts: &[usize], label: &str) -> Result<()> {
        let (_, total) = offsets(counts, self.world_size(), "all_gather")?;
        self.check_len("all_gather", label, "output", output.len(), total)?;
        output.copy_from_slice(&self.all_gather_v_start(input.to_vec(), counts, label)?.wait()?);
        Ok(())
    }

    /// `all_gather_v`, started: returns at once; the concatenation comes from `Issued::wait`.
    pub fn all_gather_v_start<T: Elem>(&self, input: Vec<T>, counts: &[usize], label: &str) -> Result<Issued<Vec<T>>> {
        let (_, total) = offsets(counts, self.world_size(), "all_gather")?;
        self.check_len("all_gather", label, "input", input.len(), counts[self.rank()])?;
        let desc = format!("all_gather(counts {counts:?} x {})", std::any::type_name::<T>());
        let (counts, label, mut out) = (counts.to_vec(), label.to_string(), out_vec(total));
        self.issue((CollOp::AllGather, total, T::DTYPE), move |c| {
            let all = c.exchange("all_gather", &label, desc, input)?;
            for (r, &n) in counts.iter().enumerate() {
                out.extend_from_slice(deposit::<T>(&all, r, n, &c.ctx(&label))?);
            }
            Ok(out)
        })
    }

    /// In-place all-gather over a flat buffer split into consecutive slices of lengths `counts`: rank
    /// r's slice of `buf` is authoritative on rank r and is copied to every rank (ZeRO: updated
    /// master shards gathered into the full weight vector).
    pub fn all_gather_v_inplace<T: Elem>(&self, buf: &mut [T], counts: &[usize], label: &str) -> Result<()> {
        let (offs, total) = offsets(counts, self.world_size(), "all_gather")?;
        self.check_len("all_gather", label, "buffer", buf.len(), total)?;
        let mine = buf[offs[self.rank()]..offs[self.rank()] + counts[self.rank()]].to_vec();
        self.all_gather_v(&mine, buf, counts, label)
    }

    /// Copy `buf` on rank `root` into `buf` on every rank.
    pub fn broadcast<T: Elem>(&self, buf: &mut [T], root: usize, label: &str) -> Result<()> {
        if root >= self.world_size() {
            bail!(
                "rank {}: broadcast \"{label}\" from root {root}, but the world has {} ranks\nhint: the root is a rank index",
                self.rank(),
                self.world_size()
            );
        }
        let n = buf.len();
        let desc = format!("broadcast(root {root}, {n} x {})", std::any::type_name::<T>());
        // Only the root's data is read; the others deposit nothing to save the copy.
        let data = if self.rank() == root { buf.to_vec() } else { Vec::new() };
        let (label, mut out) = (label.to_string(), out_vec(n));
        let out = self
            .issue((CollOp::Broadcast, n, T::DTYPE), move |c| {
                let all = c.exchange("broadcast", &label, desc, data)?;
                out.extend_from_slice(deposit::<T>(&all, root, n, &c.ctx(&label))?);
                Ok(out)
            })?
            .wait()?;
        buf.copy_from_slice(&out);
        Ok(())
    }

    /// All-to-all with equal chunks (Ulysses): `input` is `world` chunks; chunk j goes to rank j, and
    /// `output` chunk i is what rank i sent to this rank.
    pub fn all_to_all<T: Elem>(&self, input: &[T], output: &mut [T], label: &str) -> Result<()> {
        let w = self.world_size();
        if !input.len().is_multiple_of(w) || output.len() != input.len() {
            bail!(
                "rank {}: all_to_all \"{label}\": input has {} elements and output {}; both must be the same \
                 multiple of the world size {w}\nhint: split the sequence/heads into world-size equal chunks",
                self.rank(),
                input.len(),
                output.len()
            );
        }
        let (n, me) = (input.len(), self.rank());
        let c = n / w;
        let desc = format!("all_to_all({n} x {})", std::any::type_name::<T>());
        let (data, label, mut out) = (input.to_vec(), label.to_string(), out_vec(n));
        let out = self
            .issue((CollOp::AllToAll, n, T::DTYPE), move |core| {
                let all = core.exchange("all_to_all", &label, desc, data)?;
                for i in 0..all.len() {
                    out.extend_from_slice(&deposit::<T>(&all, i, n, &core.ctx(&label))?[me * c..(me + 1) * c]);
                }
                Ok(out)
            })?
            .wait()?;
        output.copy_from_slice(&out);
        Ok(())
    }

    /// Wait until every rank has reached this barrier (and every collective issued before it is done).
    pub fn barrier(&self, label: &str) -> Result<()> {
        let label = label.to_string();
        self.issue((CollOp::Barrier, 0, DType::F32), move |c| {
            c.exchange::<f32>("barrier", &label, "barrier".to_string(), Vec::new()).map(|_| ())
        })?
        .wait()
    }

    fn check_len(&self, op: &str, label: &str, what: &str, got: usize, want: usize) -> Result<()> {
        if got != want {
            bail!(
                "rank {}: {op} \"{label}\": {what} has {got} elements, expected {want}\nhint: the buffer \
                 lengths must match the slice counts (every rank passes the same counts)",
                self.rank()
            );
        }
        Ok(())
    }
}

/// How a `spawn_local` run ended badly.
#[derive(Debug)]
pub struct LocalRunError {
    /// The first failure recorded by the group (the root cause).
    pub first: GroupFailure,
    /// Every rank's own error, by rank (`None` for ranks that succeeded).
    pub per_rank: Vec<Option<String>>,
}

impl fmt::Display for LocalRunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let others: Vec<usize> =
            (0..self.per_rank.len()).filter(|&r| r != self.first.rank && self.per_rank[r].is_some()).collect();
        write!(f, "{} (failed first)", self.first)?;
        if !others.is_empty() {
            write!(f, "; ranks {others:?} stopped because of it")?;
        }
        Ok(())
    }
}

impl std::error::Error for LocalRunError {}

fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}

/// Run `f(rank_comm)` on `world` threads (rank r on thread r) sharing one `Local` group whose
/// collectives time out after `timeout`. Returns the per-rank results in rank order, or a
/// `LocalRunError` naming the rank that failed first (error, panic, or timeout) and what it was doing.
/// The handle comes as an `Arc` so the rank can keep it in a `Comm`; this function holds a clone until
/// the rank's error is recorded, so a failing rank is reported by its error, not as "left the group".
pub fn spawn_local<R, F>(world: usize, timeout: Duration, f: F) -> Result<Vec<R>, LocalRunError>
where
    R: Send,
    F: Fn(Arc<LocalComm>) -> Result<R> + Sync,
{
    spawn_local_with(world, timeout, LocalChecks::default(), f)
}

/// `spawn_local` with the given checks (`RoundCheck::Transport`: the group checks what NCCL can).
pub fn spawn_local_with<R, F>(
    world: usize,
    timeout: Duration,
    checks: LocalChecks,
    f: F,
) -> Result<Vec<R>, LocalRunError>
where
    R: Send,
    F: Fn(Arc<LocalComm>) -> Result<R> + Sync,
{
    let group = match LocalGroup::with_checks(world, timeout, checks) {
        Ok(g) => g,
        Err(e) => {
            let first = GroupFailure { rank: 0, doing: "at start".into(), reason: format!("{e:#}") };
            return Err(LocalRunError { first, per_rank: vec![] });
        }
    };
    let handles = group.handles();
    let outs: Vec<Result<R, String>> = std::thread::scope(|s| {
        let joins: Vec<_> = handles
            .into_iter()
            .map(|comm| {
                let f = &f;
                std::thread::Builder::new().name(format!("local-rank-{}", comm.rank())).spawn_scoped(s, move || {
                    let comm = Arc::new(comm);
                    let res = catch_unwind(AssertUnwindSafe(|| f(Arc::clone(&comm))));
                    match res {
                        Ok(Ok(v)) => Ok(v),
                        Ok(Err(e)) => {
                            comm.abort(&format!("returned an error: {e:#}"));
                            Err(format!("{e:#}"))
                        }
                        Err(p) => {
                            let msg = panic_message(&*p);
                            comm.abort(&format!("panicked: {msg}"));
                            Err(format!("panicked: {msg}"))
                        }
                    }
                })
            })
            .collect();
        joins
            .into_iter()
            .map(|j| match j {
                Ok(h) => h.join().unwrap_or_else(|p| Err(format!("panicked: {}", panic_message(&*p)))),
                Err(e) => Err(format!("could not start the rank thread: {e}")),
            })
            .collect()
    });
    if outs.iter().all(Result::is_ok) {
        return Ok(outs.into_iter().filter_map(Result::ok).collect());
    }
    let per_rank: Vec<Option<String>> = outs.iter().map(|o| o.as_ref().err().cloned()).collect();
    let first = group.failure().unwrap_or_else(|| {
        // A thread that failed before the group saw it (e.g. could not start): the lowest failing rank.
        let r = per_rank.iter().position(Option::is_some).unwrap_or(0);
        GroupFailure { rank: r, doing: "at start".into(), reason: per_rank[r].clone().unwrap_or_default() }
    });
    Err(LocalRunError { first, per_rank })
}
