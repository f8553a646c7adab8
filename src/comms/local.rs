//! `Local`: N ranks as threads of one process, with real collectives on host buffers.
//!
//! Reference: DESIGN.md §6 (`Comm::Local` proves on CPU that N ranks compute what one rank computes);
//! the operation set and argument shapes follow NCCL (`ncclAllReduce`, `ncclReduceScatter`,
//! `ncclAllGather`, `ncclBroadcast`, grouped send/recv for all-to-all) with MPI's `*_v` variants for
//! uneven slices (ZeRO ownership maps give ranks different-sized slices of the flat index space).
//!
//! The non-obvious decision: every collective is one *exchange round*. Each rank deposits a copy of
//! its input and a descriptor (operation, label, sizes, element type) into the shared group; when the
//! last rank arrives, every rank reads all deposits and computes its own output from them, summing in
//! rank order (0, 1, ..., N-1). So the sum is bit-identical on every rank and for every thread
//! schedule, descriptors that disagree (rank 1 calls `broadcast` while rank 0 calls `all_reduce`, or
//! ragged counts differ) are an error on every rank instead of silent garbage, and the code is short.
//! The copies cost memory bandwidth, which does not matter for the CPU tests this backend serves.
//!
//! Failure: a rank that returns an error, panics or drops its handle marks the group failed (the first
//! failure wins and is kept); every rank waiting in, or later entering, a collective returns an error
//! naming that rank and what it was doing. A rank that waits longer than the timeout marks the group
//! failed itself, naming the ranks that never arrived and their last collective. Nothing ever hangs
//! longer than the timeout.
//!
//! What it does not do: device (CUDA) buffers, overlap with compute, or cross-process transport; it
//! is a correctness backend for one process (the NCCL backend is the fast one).
use anyhow::{anyhow, bail, Result};
use half::bf16;
use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Element types the collectives move; sums accumulate in `Acc` (f32 for bf16) in rank order.
pub trait Elem: Copy + Send + Sync + 'static {
    /// Accumulator type of a reduction.
    type Acc: Copy;
    /// Widen to the accumulator.
    fn acc(self) -> Self::Acc;
    /// `a + b` in the accumulator.
    fn add(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// `a / n` in the accumulator (for `ReduceOp::Avg`).
    fn div(a: Self::Acc, n: usize) -> Self::Acc;
    /// Round the accumulator back to the element type.
    fn finish(a: Self::Acc) -> Self;
}

impl Elem for f32 {
    type Acc = f32;
    fn acc(self) -> f32 {
        self
    }
    fn add(a: f32, b: f32) -> f32 {
        a + b
    }
    fn div(a: f32, n: usize) -> f32 {
        a / n as f32
    }
    fn finish(a: f32) -> f32 {
        a
    }
}

impl Elem for f64 {
    type Acc = f64;
    fn acc(self) -> f64 {
        self
    }
    fn add(a: f64, b: f64) -> f64 {
        a + b
    }
    fn div(a: f64, n: usize) -> f64 {
        a / n as f64
    }
    fn finish(a: f64) -> f64 {
        a
    }
}

impl Elem for bf16 {
    type Acc = f32;
    fn acc(self) -> f32 {
        self.to_f32()
    }
    fn add(a: f32, b: f32) -> f32 {
        a + b
    }
    fn div(a: f32, n: usize) -> f32 {
        a / n as f32
    }
    fn finish(a: f32) -> bf16 {
        bf16::from_f32(a)
    }
}

/// Reduction of all_reduce / reduce_scatter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum over ranks, in rank order.
    Sum,
    /// Sum over ranks in rank order, then divide by the world size.
    Avg,
}

/// Why a group stopped: the first rank that failed and what it was doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupFailure {
    /// The rank that failed first.
    pub rank: usize,
    /// What it was doing, e.g. `in collective #3 all_reduce "grads"` or `after collective #2 ...`.
    pub doing: String,
    /// The error, panic message or timeout description.
    pub reason: String,
}

impl fmt::Display for GroupFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} failed {}: {}", self.rank, self.doing, self.reason)
    }
}

impl std::error::Error for GroupFailure {}

/// What a rank put into one exchange round.
struct Deposit {
    /// The operation's descriptor; every rank's must be equal.
    desc: String,
    /// A copy of the rank's input (a `Vec<T>`).
    data: Box<dyn Any + Send + Sync>,
}

/// Where a rank last was, for error messages.
#[derive(Clone, Default)]
struct Whereabouts {
    /// Collectives entered so far (the current one's number while inside it).
    entered: u64,
    /// `op "label"` of the last collective entered.
    what: String,
    /// True between entering a collective and leaving it.
    inside: bool,
}

impl Whereabouts {
    fn describe(&self) -> String {
        match (self.entered, self.inside) {
            (0, _) => "before its first collective".to_string(),
            (n, true) => format!("in collective #{n} {}", self.what),
            (n, false) => format!("after collective #{n} {}", self.what),
        }
    }
}

struct State {
    /// Number of completed rounds.
    round: u64,
    /// Deposits of the round in progress, by rank.
    deposits: Vec<Option<Deposit>>,
    /// The deposits of the last completed round (read by its ranks after it completes).
    last: Arc<Vec<Deposit>>,
    /// Ranks that have not yet taken `last`; the group lets go of it when this reaches 0.
    unread: usize,
    failed: Option<GroupFailure>,
    /// Ranks that dropped their handle (they will never arrive again).
    left: Vec<bool>,
    whereabouts: Vec<Whereabouts>,
}

/// The object shared by the ranks of one `Local` group.
pub struct LocalGroup {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

impl LocalGroup {
    /// A group of `world` ranks whose collectives give up after `timeout`.
    pub fn new(world: usize, timeout: Duration) -> Result<Arc<LocalGroup>> {
        if world == 0 {
            bail!("a Local group needs at least one rank (got world size 0)\nhint: set dist.world_size >= 1");
        }
        Ok(Arc::new(LocalGroup {
            world,
            timeout,
            state: Mutex::new(State {
                round: 0,
                deposits: (0..world).map(|_| None).collect(),
                last: Arc::new(Vec::new()),
                unread: 0,
                failed: None,
                left: vec![false; world],
                whereabouts: vec![Whereabouts::default(); world],
            }),
            cv: Condvar::new(),
        }))
    }

    /// One handle per rank, in rank order; hand handle r to the thread of rank r.
    pub fn handles(self: &Arc<Self>) -> Vec<LocalComm> {
        (0..self.world).map(|rank| LocalComm { rank, group: Arc::clone(self), entered: AtomicU64::new(0) }).collect()
    }

    /// The first failure, if the group has failed.
    pub fn failure(&self) -> Option<GroupFailure> {
        self.lock().failed.clone()
    }

    /// Poison-tolerant lock: a panicking rank must not make the others panic on the mutex.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Record `rank`'s failure unless an earlier one is already recorded; wake every waiter.
    fn mark_failed(&self, st: &mut State, rank: usize, reason: String) {
        if st.failed.is_none() {
            let doing = st.whereabouts[rank].describe();
            st.failed = Some(GroupFailure { rank, doing, reason });
        }
        self.cv.notify_all();
    }
}

/// One rank's handle on a `Local` group. Dropping it (normally or by a panic) tells the others that
/// this rank will not take part in any further collective.
pub struct LocalComm {
    rank: usize,
    group: Arc<LocalGroup>,
    entered: AtomicU64,
}

impl fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LocalComm(rank {} of {})", self.rank, self.group.world)
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let g = &self.group;
        let mut st = g.lock();
        st.left[self.rank] = true;
        if std::thread::panicking() {
            g.mark_failed(&mut st, self.rank, "panicked (handle dropped while unwinding)".into());
        }
        g.cv.notify_all();
    }
}

/// Checked sizes: `counts` has one entry per rank; returns the offsets (prefix sums) and the total.
fn offsets(counts: &[usize], world: usize, what: &str) -> Result<(Vec<usize>, usize)> {
    if counts.len() != world {
        bail!("{what}: {} counts for {world} ranks\nhint: pass one slice length per rank, in rank order", counts.len());
    }
    let mut offs = Vec::with_capacity(world);
    let mut total = 0usize;
    for &c in counts {
        offs.push(total);
        total += c;
    }
    Ok((offs, total))
}

fn downcast<T: 'static>(d: &Deposit) -> Result<&Vec<T>> {
    d.data.downcast_ref::<Vec<T>>().ok_or_else(|| anyhow!("internal: deposit has another element type"))
}

impl LocalComm {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.group.world
    }

    /// The group this handle belongs to.
    pub fn group(&self) -> &Arc<LocalGroup> {
        &self.group
    }

    /// Mark the group failed because this rank hit `reason` outside a collective (an error in its own
    /// work); the other ranks then stop at their next collective instead of waiting for the timeout.
    pub fn abort(&self, reason: &str) {
        let g = &self.group;
        let mut st = g.lock();
        g.mark_failed(&mut st, self.rank, reason.to_string());
    }

    /// Deposit `data` for one round under `desc`, wait for all ranks, return every rank's deposit.
    fn exchange<T: Elem>(&self, op: &str, label: &str, desc: String, data: Vec<T>) -> Result<Arc<Vec<Deposit>>> {
        let g = &*self.group;
        let n = self.entered.fetch_add(1, Ordering::Relaxed) + 1;
        let what = format!("{op} \"{label}\"");
        let mut st = g.lock();
        st.whereabouts[self.rank] = Whereabouts { entered: n, what: what.clone(), inside: true };
        let context = format!("rank {} in collective #{n} {what}", self.rank);
        if let Some(f) = &st.failed {
            let f = f.clone();
            st.whereabouts[self.rank].inside = false;
            return Err(anyhow::Error::new(f).context(format!("{context}: the group has already failed")));
        }
        if g.world == 1 {
            st.whereabouts[self.rank].inside = false;
            return Ok(Arc::new(vec![Deposit { desc, data: Box::new(data) }]));
        }
        let my_round = st.round;
        st.deposits[self.rank] = Some(Deposit { desc, data: Box::new(data) });
        if st.deposits.iter().all(Option::is_some) {
            let all: Vec<Deposit> = st.deposits.iter_mut().filter_map(Option::take).collect();
            st.last = Arc::new(all);
            st.unread = g.world;
            st.round += 1;
            g.cv.notify_all();
        }
        let deadline = Instant::now() + g.timeout;
        loop {
            // Completion first: a rank that left after this round completed did not break it.
            if st.round > my_round {
                st.whereabouts[self.rank].inside = false;
                let all = Arc::clone(&st.last);
                st.unread -= 1;
                if st.unread == 0 {
                    st.last = Arc::new(Vec::new()); // the copies live only as long as a reader needs them
                }
                drop(st);
                return self.check_descs(&all, n, &what).map(|()| all);
            }
            if let Some(f) = &st.failed {
                let f = f.clone();
                st.whereabouts[self.rank].inside = false;
                return Err(anyhow::Error::new(f).context(format!("{context}: stopped because a rank failed")));
            }
            let missing: Vec<usize> = (0..g.world).filter(|&r| st.deposits[r].is_none()).collect();
            if let Some(&r) = missing.iter().find(|&&r| st.left[r]) {
                let reason = format!("left the group (dropped its handle) {}", st.whereabouts[r].describe());
                g.mark_failed(&mut st, r, reason);
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                // Blame the first rank that never arrived; name all of them.
                let who: Vec<String> =
                    missing.iter().map(|&r| format!("rank {r} ({})", st.whereabouts[r].describe())).collect();
                let reason = format!(
                    "did not reach collective #{n} {what} within {:.1}s (rank {} timed out waiting; missing: {})\n\
                     hint: a rank is stuck, dead or much slower than the others; raise dist.timeout_s if the work \
                     between collectives is legitimately long",
                    g.timeout.as_secs_f64(),
                    self.rank,
                    who.join(", ")
                );
                let blamed = missing.first().copied().unwrap_or(self.rank);
                g.mark_failed(&mut st, blamed, reason);
                continue;
            }
            st = g.cv.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Every rank must have called the same collective with the same sizes; say who differs.
    fn check_descs(&self, all: &[Deposit], n: u64, what: &str) -> Result<()> {
        let first = &all[0].desc;
        if let Some(r) = all.iter().position(|d| &d.desc != first) {
            bail!(
                "rank {} in collective #{n} {what}: ranks called different collectives in the same round: \
                 rank 0 called {first}, rank {r} called {}\nhint: every rank must call the same collectives \
                 in the same order with the same sizes",
                self.rank,
                all[r].desc
            );
        }
        Ok(())
    }

    fn sum_into<T: Elem>(all: &[Deposit], range: std::ops::Range<usize>, op: ReduceOp, out: &mut [T]) -> Result<()> {
        let bufs: Vec<&Vec<T>> = all.iter().map(downcast::<T>).collect::<Result<_>>()?;
        for (k, o) in range.zip(out.iter_mut()) {
            let mut acc = bufs[0][k].acc();
            for b in &bufs[1..] {
                acc = T::add(acc, b[k].acc());
            }
            if op == ReduceOp::Avg {
                acc = T::div(acc, bufs.len());
            }
            *o = T::finish(acc);
        }
        Ok(())
    }

    /// Reduce `buf` over all ranks in place (sum or average, in rank order: bit-identical everywhere).
    pub fn all_reduce<T: Elem>(&self, buf: &mut [T], op: ReduceOp, label: &str) -> Result<()> {
        let desc = format!("all_reduce({op:?}, {} x {})", buf.len(), std::any::type_name::<T>());
        let all = self.exchange("all_reduce", label, desc, buf.to_vec())?;
        Self::sum_into(&all, 0..buf.len(), op, buf)
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
        let (offs, total) = offsets(counts, self.world_size(), "reduce_scatter")?;
        self.check_len("reduce_scatter", label, "input", input.len(), total)?;
        self.check_len("reduce_scatter", label, "output", output.len(), counts[self.rank])?;
        let desc = format!("reduce_scatter({op:?}, counts {counts:?} x {})", std::any::type_name::<T>());
        let all = self.exchange("reduce_scatter", label, desc, input.to_vec())?;
        let lo = offs[self.rank];
        Self::sum_into(&all, lo..lo + counts[self.rank], op, output)
    }

    /// Equal-slice all-gather: `output` is `world` slices of `input.len()`, slice r from rank r.
    pub fn all_gather<T: Elem>(&self, input: &[T], output: &mut [T], label: &str) -> Result<()> {
        let counts = vec![input.len(); self.world_size()];
        self.all_gather_v(input, output, &counts, label)
    }

    /// All-gather with explicit slice lengths: rank r contributes `counts[r]` elements; `output` is
    /// their concatenation in rank order. Every rank must pass the same `counts`.
    pub fn all_gather_v<T: Elem>(&self, input: &[T], output: &mut [T], counts: &[usize], label: &str) -> Result<()> {
        let (offs, total) = offsets(counts, self.world_size(), "all_gather")?;
        self.check_len("all_gather", label, "input", input.len(), counts[self.rank])?;
        self.check_len("all_gather", label, "output", output.len(), total)?;
        let desc = format!("all_gather(counts {counts:?} x {})", std::any::type_name::<T>());
        let all = self.exchange("all_gather", label, desc, input.to_vec())?;
        for (r, d) in all.iter().enumerate() {
            output[offs[r]..offs[r] + counts[r]].copy_from_slice(downcast::<T>(d)?);
        }
        Ok(())
    }

    /// In-place all-gather over a flat buffer split into consecutive slices of lengths `counts`: rank
    /// r's slice of `buf` is authoritative on rank r and is copied to every rank (ZeRO: updated
    /// master shards gathered into the full weight vector).
    pub fn all_gather_v_inplace<T: Elem>(&self, buf: &mut [T], counts: &[usize], label: &str) -> Result<()> {
        let (offs, total) = offsets(counts, self.world_size(), "all_gather")?;
        self.check_len("all_gather", label, "buffer", buf.len(), total)?;
        let mine = buf[offs[self.rank]..offs[self.rank] + counts[self.rank]].to_vec();
        self.all_gather_v(&mine, buf, counts, label)
    }

    /// Copy `buf` on rank `root` into `buf` on every rank.
    pub fn broadcast<T: Elem>(&self, buf: &mut [T], root: usize, label: &str) -> Result<()> {
        if root >= self.world_size() {
            bail!(
                "rank {}: broadcast \"{label}\" from root {root}, but the world has {} ranks\nhint: the root is a rank index",
                self.rank,
                self.world_size()
            );
        }
        let desc = format!("broadcast(root {root}, {} x {})", buf.len(), std::any::type_name::<T>());
        // Only the root's data is read; the others deposit nothing to save the copy.
        let data = if self.rank == root { buf.to_vec() } else { Vec::new() };
        let all = self.exchange("broadcast", label, desc, data)?;
        buf.copy_from_slice(downcast::<T>(&all[root])?);
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
                self.rank,
                input.len(),
                output.len()
            );
        }
        let c = input.len() / w;
        let desc = format!("all_to_all({} x {})", input.len(), std::any::type_name::<T>());
        let all = self.exchange("all_to_all", label, desc, input.to_vec())?;
        for (i, d) in all.iter().enumerate() {
            output[i * c..(i + 1) * c].copy_from_slice(&downcast::<T>(d)?[self.rank * c..(self.rank + 1) * c]);
        }
        Ok(())
    }

    /// Wait until every rank has reached this barrier.
    pub fn barrier(&self, label: &str) -> Result<()> {
        self.exchange::<f32>("barrier", label, "barrier".to_string(), Vec::new()).map(|_| ())
    }

    fn check_len(&self, op: &str, label: &str, what: &str, got: usize, want: usize) -> Result<()> {
        if got != want {
            bail!(
                "rank {}: {op} \"{label}\": {what} has {got} elements, expected {want}\nhint: the buffer \
                 lengths must match the slice counts (every rank passes the same counts)",
                self.rank
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
    let group = match LocalGroup::new(world, timeout) {
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
