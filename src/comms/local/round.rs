//! `Local`'s exchange round (see the header of `local.rs`): the group's shared state, each rank's deposit
//! and whereabouts, the wait for the last rank with its timeout and failure naming, the descriptor check,
//! and the reduction in rank order that makes every rank's sum bit-identical. Also the handle's state
//! (`LocalComm`, `Issued`): `local.rs` writes the collectives on top of these.
use super::elem::{Elem, ReduceOp};
use crate::launch::signature::{GroupFailure, SigBoard, SigLog, SIG_EVERY};
use anyhow::{anyhow, bail, Result};
use std::any::Any;
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What each exchange round compares between the ranks' deposits (see the file header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoundCheck {
    /// Every rank's full descriptor (operation, sizes, element type, reduction, root) must be equal.
    Descriptors,
    /// Only what moving the data needs, as NCCL: each deposit's element type and length.
    Transport,
}

/// What a `Local` group checks between its ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalChecks {
    /// per exchange round
    pub round: RoundCheck,
    /// collectives per window of the signature check (`signature`; 0 = off)
    pub sig_every: u64,
}

impl Default for LocalChecks {
    /// Both checks: descriptors every round, signatures every `SIG_EVERY` collectives.
    fn default() -> Self {
        LocalChecks { round: RoundCheck::Descriptors, sig_every: SIG_EVERY }
    }
}

/// What a rank put into one exchange round.
pub(super) struct Deposit {
    /// The operation's descriptor (compared under `RoundCheck::Descriptors`).
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

pub(super) struct State {
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
    pub(super) world: usize,
    pub(super) timeout: Duration,
    pub(super) checks: LocalChecks,
    pub(super) state: Mutex<State>,
    pub(super) cv: Condvar,
    /// the signature check's comparer (the side channel: shared memory)
    pub(super) board: Mutex<SigBoard>,
}

impl LocalGroup {
    /// A group of `world` ranks whose collectives give up after `timeout`, with the default checks.
    pub fn new(world: usize, timeout: Duration) -> Result<Arc<LocalGroup>> {
        LocalGroup::with_checks(world, timeout, LocalChecks::default())
    }

    /// `new` with the given checks.
    pub fn with_checks(world: usize, timeout: Duration, checks: LocalChecks) -> Result<Arc<LocalGroup>> {
        if world == 0 {
            bail!("a Local group needs at least one rank (got world size 0)\nhint: set dist.world_size >= 1");
        }
        Ok(Arc::new(LocalGroup {
            world,
            timeout,
            checks,
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
            board: Mutex::new(SigBoard::new(world)),
        }))
    }

    /// One handle per rank, in rank order; hand handle r to the thread of rank r.
    pub fn handles(self: &Arc<Self>) -> Vec<LocalComm> {
        (0..self.world)
            .map(|rank| LocalComm {
                core: Arc::new(Core { rank, group: Arc::clone(self), entered: AtomicU64::new(0) }),
                lane: Mutex::new(None),
                sigs: Mutex::new(SigLog::new(self.checks.sig_every)),
            })
            .collect()
    }

    /// The first failure, if the group has failed.
    pub fn failure(&self) -> Option<GroupFailure> {
        self.lock().failed.clone()
    }

    /// Poison-tolerant lock: a panicking rank must not make the others panic on the mutex.
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Record `rank`'s failure unless an earlier one is already recorded; wake every waiter.
    pub(super) fn mark_failed(&self, st: &mut State, rank: usize, reason: String) {
        let doing = st.whereabouts[rank].describe();
        self.record_failure(st, GroupFailure { rank, doing, reason });
    }

    /// Record `f` unless an earlier failure is already recorded; wake every waiter.
    pub(super) fn record_failure(&self, st: &mut State, f: GroupFailure) {
        if st.failed.is_none() {
            st.failed = Some(f);
        }
        self.cv.notify_all();
    }
}

/// What a rank's communication thread needs of it (the thread holds no `LocalComm`, so dropping the
/// handle is what ends the thread).
pub(super) struct Core {
    pub(super) rank: usize,
    pub(super) group: Arc<LocalGroup>,
    pub(super) entered: AtomicU64,
}

/// One collective for a rank's communication thread.
pub(super) type Job = Box<dyn FnOnce(&Core) + Send>;

/// A collective issued to this rank's communication thread; `wait` gives its result.
pub struct Issued<R> {
    pub(super) rx: mpsc::Receiver<Result<R>>,
    pub(super) rank: usize,
}

impl<R> Issued<R> {
    /// Block until the collective completed (or failed: at most the group's timeout).
    pub fn wait(self) -> Result<R> {
        self.rx.recv().unwrap_or_else(|_| {
            Err(anyhow!("internal: rank {}'s communication thread ended before a collective it was given", self.rank))
        })
    }
}

/// One rank's handle on a `Local` group. Dropping it (normally or by a panic) ends its communication
/// thread once the collectives issued to it are done, and tells the others that this rank will not
/// take part in any further collective.
pub struct LocalComm {
    pub(super) core: Arc<Core>,
    /// the communication thread's queue and the thread (started by the first collective)
    pub(super) lane: Mutex<Option<(mpsc::Sender<Job>, JoinHandle<()>)>>,
    /// this rank's collective signatures (issue order)
    pub(super) sigs: Mutex<SigLog>,
}

impl fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LocalComm(rank {} of {})", self.core.rank, self.core.group.world)
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let (g, rank) = (&self.core.group, self.core.rank);
        if std::thread::panicking() {
            g.mark_failed(&mut g.lock(), rank, "panicked (handle dropped while unwinding)".into());
        }
        // the collectives already issued run to their end (each bounded by the timeout; at once when
        // the group has failed), so the others never wait for a round this rank has entered
        if let Some((queue, thread)) = self.lane.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            drop(queue);
            let _ = thread.join();
        }
        let mut st = g.lock();
        st.left[rank] = true;
        g.cv.notify_all();
    }
}

/// Checked sizes: `counts` has one entry per rank; returns the offsets (prefix sums) and the total.
pub(super) fn offsets(counts: &[usize], world: usize, what: &str) -> Result<(Vec<usize>, usize)> {
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

/// Rank `r`'s deposit as `len` values of `T`: what moving the data needs (a transport check; under
/// `RoundCheck::Transport` the only one), an error naming both sides otherwise.
pub(super) fn deposit<'a, T: Elem>(all: &'a [Deposit], r: usize, len: usize, what: &str) -> Result<&'a [T]> {
    let hint = "hint: every rank must issue the same collectives in the same order with the same sizes";
    let Some(v) = all[r].data.downcast_ref::<Vec<T>>() else {
        bail!(
            "{what}: rank {r} sent values of another type than this rank's {} (it called {})\n{hint}",
            T::DTYPE.as_str(),
            all[r].desc
        );
    };
    if v.len() != len {
        bail!(
            "{what}: rank {r} sent {} values where this rank needs {len} (it called {})\n{hint}",
            v.len(),
            all[r].desc
        );
    }
    Ok(v)
}

/// An empty output of `n` elements' capacity, made by the thread that issues a collective (not by the
/// communication thread that fills it): glibc gives every thread an arena of its own and a freed block
/// goes back to the arena that made it, so outputs made on the communication threads would stay
/// resident there as those threads' free memory (measured: a fifth more peak memory for 4 ranks with
/// SP 4) instead of being reused by the rank's next allocation.
pub(super) fn out_vec<T>(n: usize) -> Vec<T> {
    Vec::with_capacity(n)
}

/// Elements `range` of every rank's deposit (each `len` long) reduced in rank order, appended to `out`.
pub(super) fn reduce<T: Elem>(
    all: &[Deposit],
    len: usize,
    range: std::ops::Range<usize>,
    op: ReduceOp,
    what: &str,
    mut out: Vec<T>,
) -> Result<Vec<T>> {
    let bufs: Vec<&[T]> = (0..all.len()).map(|r| deposit::<T>(all, r, len, what)).collect::<Result<_>>()?;
    out.extend(range.map(|k| {
        let mut acc = bufs[0][k].acc();
        for b in &bufs[1..] {
            acc = T::add(acc, b[k].acc());
        }
        if op == ReduceOp::Avg {
            acc = T::div(acc, bufs.len());
        }
        T::finish(acc)
    }));
    Ok(out)
}

impl Core {
    /// `rank R in collective "label"`: the context of an error computing a collective's output.
    pub(super) fn ctx(&self, label: &str) -> String {
        format!("rank {} in collective \"{label}\"", self.rank)
    }

    /// Deposit `data` for one round under `desc`, wait for all ranks, return every rank's deposit.
    pub(super) fn exchange<T: Elem>(
        &self,
        op: &str,
        label: &str,
        desc: String,
        data: Vec<T>,
    ) -> Result<Arc<Vec<Deposit>>> {
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
                if g.checks.round == RoundCheck::Descriptors {
                    self.check_descs(&all, n, &what)?;
                }
                return Ok(all);
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
}
