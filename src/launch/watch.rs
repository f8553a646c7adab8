//! The failure watch of a multi-process group: after the rendezvous its TCP connections stay open as a
//! small control plane that tells every rank, within a second, which rank failed and what it was doing.
//!
//! Reference: torch's ProcessGroupNCCL watchdog + TCPStore "abort" key (a rank that fails publishes it,
//! the others abort their communicators); the wire format of `rendezvous` (frames `kind u8, len u32,
//! body`). Frames after the rendezvous:
//! - `F` rank u32, doing str, reason str: a rank failed (sent by it, forwarded by rank 0 to all others);
//! - `P` doing str: what the sender is doing now (a step number; rank 0 keeps the last one per rank);
//! - `E`: the sender leaves normally (its connection closing next is not a failure);
//! - `S` window: the sender's collective signatures (`signature::encode`), compared by rank 0.
//!
//! The non-obvious decisions:
//! - The heavy traffic goes through NCCL, which cannot say *which* peer is gone: a collective with a dead
//!   peer just never completes. The star of TCP connections can: rank 0 reads one connection per rank,
//!   and a connection that closes without `E` means that process died (killed, crashed), however it
//!   died, because the kernel closes its sockets. Rank 0 forwards every failure to all ranks; a rank
//!   that loses its connection to rank 0 knows rank 0 is gone. A host that vanishes without closing
//!   anything (power loss, partition) is not seen here (no TCP keepalive): the collective timeout of
//!   the NCCL watchdog catches it.
//! - The first failure wins and is kept (later ones are consequences); the `on_failure` hook runs once,
//!   on a reader thread, for a failure of ANOTHER rank: it aborts this rank's NCCL communicator so a
//!   collective waiting for the dead peer returns, and the training loop then fails with this message.
//!   A failure that names this rank but comes from rank 0 (the signature check's verdict) runs it too.
//! - The collective signature check (`signature`) rides on the same connections, beside NCCL: every
//!   `every` collectives a rank sends its window to rank 0, whose board compares it with the first
//!   window of that index; a mismatch is a failure of the rank that differs, told to every rank
//!   (each aborts its communicators), naming both ranks' signatures.
//! - `Drop` without `finish` shuts the sockets down without `E`, which the peers see as this rank being
//!   lost: that is how a test stands in for a killed process.
//!
//! What it does not do: carry data, detect a rank that is alive but stuck (the collective timeout of the
//! NCCL watchdog does), or survive the loss of rank 0 for the others (they all stop, told why).
use crate::launch::rendezvous::{frame, put_str, read_frame, Rendezvous};
use crate::launch::signature::GroupFailure;
use crate::launch::signature::{self, SigBoard, Window};
use anyhow::{bail, Result};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Called once, on a reader thread, with the first failure of another rank.
pub type FailureHook = Box<dyn Fn(&GroupFailure) + Send + Sync>;

/// The group's first failure: claimed by the thread that saw it, then published once it has been told
/// to the others (so no waiter can exit the process, closing the connections, before the forward).
#[derive(Default)]
struct First {
    failure: Option<GroupFailure>,
    published: bool,
}

/// How long a failure already claimed may take to be published (a forward's 5 s write timeout per
/// link is the worst case of the first link; the others are local sockets).
const PUBLISH_WAIT: Duration = Duration::from_secs(6);

/// Where a failure came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// this rank's own report
    Here,
    /// read from the connection to this peer
    Peer(usize),
    /// rank 0's signature check (concerns every rank, the one it names included)
    Verdict,
}

struct Shared {
    rank: usize,
    /// rank 0: the collective signature check's comparer
    board: Mutex<SigBoard>,
    failure: Mutex<First>,
    /// notified when the first failure is published
    cond: Condvar,
    /// rank 0: the last `P` of each rank, and which ranks left with `E`
    doing: Mutex<Vec<(String, bool)>>,
    /// this rank is leaving: connections closing now are expected
    closing: AtomicBool,
    /// rank 0: rank r's connection at index r - 1; others: the one to rank 0 (write side)
    links: Vec<Mutex<TcpStream>>,
    on_failure: FailureHook,
}

/// The running watch of this rank (see the file header).
pub struct Watch {
    shared: Arc<Shared>,
    finished: AtomicBool,
}

fn encode_failure(f: &GroupFailure) -> Vec<u8> {
    let mut b = (f.rank as u32).to_le_bytes().to_vec();
    put_str(&mut b, &f.doing);
    put_str(&mut b, &f.reason);
    frame(b'F', &b)
}

fn decode_failure(b: &[u8]) -> Option<GroupFailure> {
    let u32_at = |at: usize| -> Option<u32> { Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?)) };
    let rank = u32_at(0)? as usize;
    let n1 = u32_at(4)? as usize;
    let doing = String::from_utf8(b.get(8..8 + n1)?.to_vec()).ok()?;
    let n2 = u32_at(8 + n1)? as usize;
    let reason = String::from_utf8(b.get(12 + n1..12 + n1 + n2)?.to_vec()).ok()?;
    Some(GroupFailure { rank, doing, reason })
}

impl Shared {
    /// Record `f` if it is the first failure; then tell the others (rank 0: every link but `from`'s;
    /// others: rank 0, when the failure is their own) and, for another rank's failure or one that came
    /// from elsewhere, run the hook. Waiters see it only when that is done (`publish`): a rank 0 whose
    /// main thread stopped at the first sign would otherwise exit before its forward, and the others
    /// would name rank 0.
    fn fail(&self, f: GroupFailure, source: Source) {
        {
            let mut g = self.failure.lock().unwrap_or_else(|p| p.into_inner());
            if g.failure.is_some() {
                return;
            }
            g.failure = Some(f.clone());
        }
        let own = f.rank == self.rank;
        let from = match source {
            Source::Peer(p) => Some(p),
            Source::Here | Source::Verdict => None,
        };
        // the hook first (it aborts NCCL): a peer whose socket does not drain must not delay it
        if !own || source != Source::Here {
            (self.on_failure)(&f);
        }
        let msg = encode_failure(&f);
        if self.rank == 0 || own {
            for (i, l) in self.links.iter().enumerate() {
                let to = if self.rank == 0 { i + 1 } else { 0 };
                if Some(to) != from {
                    let mut s = l.lock().unwrap_or_else(|p| p.into_inner());
                    let _ = std::io::Write::write_all(&mut *s, &msg);
                }
            }
        }
        self.failure.lock().unwrap_or_else(|p| p.into_inner()).published = true;
        self.cond.notify_all();
    }

    /// None when no failure is claimed; else the first failure once published (its forward runs;
    /// waited for up to `PUBLISH_WAIT`).
    fn settled(&self) -> Option<GroupFailure> {
        let claimed = self.failure.lock().unwrap_or_else(|p| p.into_inner()).failure.is_some();
        claimed.then(|| self.published(PUBLISH_WAIT)).flatten()
    }

    /// The first failure once published; a claimed one is waited for up to `wait` (its forward runs).
    fn published(&self, wait: Duration) -> Option<GroupFailure> {
        let g = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        let (g, _) = self.cond.wait_timeout_while(g, wait, |s| !s.published).unwrap_or_else(|p| p.into_inner());
        g.failure.clone().filter(|_| g.published)
    }

    /// The reader of the connection to `peer` (rank 0: one per rank; others: rank 0's).
    fn read_loop(self: Arc<Self>, mut s: TcpStream, peer: usize) {
        loop {
            match read_frame(&mut s) {
                Ok((b'F', body)) => match decode_failure(&body) {
                    Some(f) => self.fail(f, Source::Peer(peer)),
                    None => self.malformed(peer, "failure report"),
                },
                Ok((b'S', body)) => match signature::decode(&body) {
                    Some(w) if self.rank == 0 => self.compare(peer, w),
                    _ => self.malformed(peer, "collective signature window"),
                },
                Ok((b'P', body)) => {
                    if let Some(d) = self.doing.lock().unwrap_or_else(|p| p.into_inner()).get_mut(peer) {
                        d.0 = String::from_utf8_lossy(&body).into_owned();
                    }
                }
                Ok((b'E', _)) => {
                    if let Some(d) = self.doing.lock().unwrap_or_else(|p| p.into_inner()).get_mut(peer) {
                        d.1 = true;
                    }
                    return;
                }
                Ok((k, _)) => {
                    let reason = format!("sent an unexpected control message {k:?} (a different harpe binary?)");
                    self.fail(
                        GroupFailure { rank: peer, doing: "on the control connection".into(), reason },
                        Source::Peer(peer),
                    );
                    return;
                }
                Err(e) => {
                    if self.closing.load(Ordering::SeqCst) {
                        return;
                    }
                    let last = self.doing.lock().unwrap_or_else(|p| p.into_inner()).get(peer).cloned();
                    let doing = match last {
                        Some((d, _)) if !d.is_empty() => format!("while {d}"),
                        _ => "(what it was doing is unknown)".to_string(),
                    };
                    let reason = format!(
                        "its process is gone: the control connection closed without a goodbye ({e}); it was killed \
                         (SIGKILL, out of memory), crashed, or its host shut down"
                    );
                    self.fail(GroupFailure { rank: peer, doing, reason }, Source::Peer(peer));
                    return;
                }
            }
        }
    }
}

impl Shared {
    /// `peer` sent something it should not have: a failure of that peer.
    fn malformed(&self, peer: usize, what: &str) {
        let reason = format!("sent a malformed {what} (a different harpe binary?)");
        self.fail(GroupFailure { rank: peer, doing: "on the control connection".into(), reason }, Source::Peer(peer));
    }

    /// Rank 0: compare `rank`'s signature window with the first one of its index; a mismatch is told
    /// to every rank.
    fn compare(&self, rank: usize, w: Window) {
        let verdict = self.board.lock().unwrap_or_else(|p| p.into_inner()).submit(rank, w);
        if let Err(m) = verdict {
            self.fail(GroupFailure::from_mismatch(&m), Source::Verdict);
        }
    }
}

impl Watch {
    /// Keep the rendezvous connections of `rv` open as the failure watch; `on_failure` runs once with
    /// the first failure of another rank.
    pub fn start(rv: Rendezvous, on_failure: FailureHook) -> Result<Watch> {
        let (rank, world) = (rv.rank(), rv.world_size());
        let links = rv.into_links();
        let want = if world == 1 {
            0
        } else if rank == 0 {
            world - 1
        } else {
            1
        };
        if links.len() != want {
            bail!("internal: rank {rank} of {world} has {} control connections, expected {want}", links.len());
        }
        let mut readers = Vec::with_capacity(links.len());
        for s in &links {
            s.set_read_timeout(None)?;
            // a peer that stops reading (frozen process, full buffers) must not block a report
            s.set_write_timeout(Some(Duration::from_secs(5)))?;
            readers.push(s.try_clone()?);
        }
        let shared = Arc::new(Shared {
            rank,
            board: Mutex::new(SigBoard::new(world)),
            failure: Mutex::new(First::default()),
            cond: Condvar::new(),
            doing: Mutex::new(vec![(String::new(), false); world]),
            closing: AtomicBool::new(false),
            links: links.into_iter().map(Mutex::new).collect(),
            on_failure,
        });
        for (i, s) in readers.into_iter().enumerate() {
            let peer = if rank == 0 { i + 1 } else { 0 };
            let sh = Arc::clone(&shared);
            std::thread::Builder::new().name(format!("harpe-watch-{peer}")).spawn(move || sh.read_loop(s, peer))?;
        }
        Ok(Watch { shared, finished: AtomicBool::new(false) })
    }

    /// The first failure seen in the group (this rank's own included), if any; one being told to the
    /// others right now is waited for (a few ms; at most `PUBLISH_WAIT`).
    pub fn failure(&self) -> Option<GroupFailure> {
        self.shared.settled()
    }

    /// Wait up to `timeout` for a failure in the group (published: already told to the others).
    pub fn wait_failure(&self, timeout: Duration) -> Option<GroupFailure> {
        self.shared.published(timeout)
    }

    /// This rank failed `doing` something because of `reason`: tell the group (first failure wins).
    pub fn report(&self, doing: &str, reason: &str) {
        let f = GroupFailure { rank: self.shared.rank, doing: doing.into(), reason: reason.into() };
        self.shared.fail(f, Source::Here);
    }

    /// Hand this rank's collective signature window to the check: rank 0 compares it at once, the
    /// others send it to rank 0 (one small write; a mismatch comes back as a failure).
    pub fn check_signatures(&self, w: Window) {
        if self.shared.rank == 0 {
            return self.shared.compare(0, w);
        }
        if let Some(l) = self.shared.links.first() {
            let mut s = l.lock().unwrap_or_else(|p| p.into_inner());
            let _ = std::io::Write::write_all(&mut *s, &frame(b'S', &signature::encode(&w)));
        }
    }

    /// Tell rank 0 what this rank is doing now (named if this process dies later); cheap, once per step.
    pub fn progress(&self, doing: &str) {
        if self.shared.rank == 0 {
            return;
        }
        if let Some(l) = self.shared.links.first() {
            let mut s = l.lock().unwrap_or_else(|p| p.into_inner());
            let _ = std::io::Write::write_all(&mut *s, &frame(b'P', doing.as_bytes()));
        }
    }

    /// Leave normally: the peers are told, so this connection closing is not a failure.
    pub fn finish(&self) {
        if !self.finished.swap(true, Ordering::SeqCst) {
            self.close(true);
        }
    }

    fn close(&self, goodbye: bool) {
        // a failure being forwarded finishes first: closing under it would cut the others off
        let _ = self.shared.settled();
        self.shared.closing.store(true, Ordering::SeqCst);
        for l in &self.shared.links {
            let mut s = l.lock().unwrap_or_else(|p| p.into_inner());
            if goodbye {
                let _ = std::io::Write::write_all(&mut *s, &frame(b'E', &[]));
            }
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Watch {
    /// Without `finish`, the sockets close without a goodbye: the peers take this rank as lost.
    fn drop(&mut self) {
        if !self.finished.load(Ordering::SeqCst) {
            self.close(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::env::rank_threads;
    use crate::launch::rendezvous::{rendezvous, Meeting, RendezvousSpec};
    use std::sync::atomic::AtomicUsize;
    use std::time::Instant;

    /// `world` ranks as threads, each with a watch whose hook counts calls; `f(rank, watch, hooks)`.
    fn group<T: Send + 'static>(
        world: usize,
        f: impl Fn(usize, Watch, Arc<AtomicUsize>) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        rank_threads(world, move |rank, port| {
            let spec = RendezvousSpec {
                addr: "127.0.0.1".into(),
                port,
                meet: Meeting::Listen,
                rank,
                world,
                token: "t".into(),
                version: "v".into(),
                config_hash: [0; 32],
                timeout: Duration::from_secs(20),
                spans_hosts: false,
            };
            let rv = rendezvous(&spec, || vec![1, 2, 3]).unwrap();
            let hooks = Arc::new(AtomicUsize::new(0));
            let h = Arc::clone(&hooks);
            let w = Watch::start(
                rv,
                Box::new(move |_| {
                    h.fetch_add(1, Ordering::SeqCst);
                }),
            )
            .unwrap();
            f(rank, w, hooks)
        })
    }

    #[test]
    fn a_reported_failure_reaches_every_rank_with_its_name() {
        let out = group(4, |rank, w, hooks| {
            if rank == 2 {
                std::thread::sleep(Duration::from_millis(100));
                w.report("in step 7 forward", "injected failure");
            }
            let t = Instant::now();
            let f = w.wait_failure(Duration::from_secs(10)).expect("no failure seen");
            std::thread::sleep(Duration::from_millis(100)); // a second report must not run the hook again
            (rank, f, t.elapsed(), hooks.load(Ordering::SeqCst))
        });
        for (rank, f, took, hooks) in out {
            assert_eq!(f.to_string(), "rank 2 failed in step 7 forward: injected failure", "rank {rank}");
            assert!(took < Duration::from_secs(5), "rank {rank} learned it after {took:?}");
            assert_eq!(hooks, usize::from(rank != 2), "rank {rank}: the hook runs for other ranks' failures only");
        }
    }

    #[test]
    fn a_rank_that_vanishes_is_named_with_its_last_progress() {
        let out = group(3, |rank, w, _| {
            if rank == 1 {
                w.progress("in step 41");
                std::thread::sleep(Duration::from_millis(100));
                drop(w); // no goodbye: as if the process was killed
                return None;
            }
            w.wait_failure(Duration::from_secs(10))
        });
        for (rank, f) in out.into_iter().enumerate().filter(|(r, _)| *r != 1) {
            let f = f.unwrap_or_else(|| panic!("rank {rank} saw no failure"));
            assert_eq!((f.rank, f.doing.as_str()), (1, "while in step 41"), "rank {rank}: {f}");
            assert!(f.reason.contains("its process is gone"), "{f}");
        }
        // rank 0 vanishing: the others learn that rank 0 is gone
        let out = group(3, |rank, w, _| {
            if rank == 0 {
                std::thread::sleep(Duration::from_millis(100));
                drop(w);
                return None;
            }
            w.wait_failure(Duration::from_secs(10))
        });
        for f in out.into_iter().skip(1) {
            assert_eq!(f.expect("no failure seen").rank, 0);
        }
    }

    #[test]
    fn ranks_that_finish_normally_see_no_failure() {
        let out = group(3, |rank, w, hooks| {
            w.progress("in step 1");
            std::thread::sleep(Duration::from_millis(50 * rank as u64));
            let seen = w.failure();
            w.finish();
            std::thread::sleep(Duration::from_millis(300));
            (seen, hooks.load(Ordering::SeqCst))
        });
        for (seen, hooks) in out {
            assert!(seen.is_none() && hooks == 0, "{seen:?}");
        }
    }

    /// The NCCL path of the collective signature check, without NCCL: windows over the watch to rank 0.
    #[test]
    fn a_diverging_collective_stops_every_rank_naming_both_signatures() {
        use crate::launch::signature::{CollOp, SigLog};
        use candle_core::DType;
        let out = group(3, |rank, w, hooks| {
            let mut log = SigLog::new(4);
            for i in 0..12 {
                // rank 2 gathers f32 where the others reduce-scatter bf16 at collective #6 (window 1)
                let (op, dt) = match (rank, i) {
                    (2, 5) => (CollOp::AllGather, DType::F32),
                    _ => (CollOp::ReduceScatter, DType::BF16),
                };
                if let Some(win) = log.record(op, 1000 + i, dt) {
                    w.check_signatures(win);
                }
            }
            let f = w.wait_failure(Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(100)); // a second report must not run the hook again
            (f, hooks.load(Ordering::SeqCst))
        });
        for (rank, (f, hooks)) in out.into_iter().enumerate() {
            let f = f.unwrap_or_else(|| panic!("rank {rank} saw no failure"));
            assert_eq!((f.rank, f.doing.as_str()), (2, "at collective #6"), "rank {rank}: {f}");
            assert!(f.reason.contains("rank 0 issued #6 reduce_scatter(1005 x bf16)"), "{f}");
            assert!(f.reason.contains("rank 2 issued #6 all_gather(1005 x f32)") && f.reason.contains("hint:"), "{f}");
            assert_eq!(hooks, 1, "rank {rank}: every rank aborts its communicators, the one named included");
        }
        // the same collectives everywhere: no failure
        let out = group(3, |_, w, hooks| {
            let mut log = SigLog::new(4);
            for i in 0..12 {
                if let Some(win) = log.record(CollOp::AllReduce, i, DType::F32) {
                    w.check_signatures(win);
                }
            }
            std::thread::sleep(Duration::from_millis(300));
            let seen = w.failure();
            w.finish();
            (seen, hooks.load(Ordering::SeqCst))
        });
        for (seen, hooks) in out {
            assert!(seen.is_none() && hooks == 0, "{seen:?}");
        }
    }

    #[test]
    fn failure_frames_round_trip() {
        let f = GroupFailure { rank: 7, doing: "in collective #3 all_reduce \"grads\"".into(), reason: "ü".into() };
        let b = encode_failure(&f);
        assert_eq!(decode_failure(&b[5..]), Some(f));
        assert_eq!(decode_failure(&b[5..b.len() - 1]), None, "a truncated frame is refused");
    }
}
