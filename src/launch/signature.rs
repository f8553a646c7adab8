//! Collective signatures: each collective a rank issues — its sequence number, operation, element count
//! and element type — is folded into a running hash, and every `every` collectives the ranks' windows
//! are compared over a side channel that does not depend on the collectives themselves.
//!
//! Reference: torch's `TORCH_DISTRIBUTED_DEBUG=DETAIL` (`ProcessGroupWrapper` checks each collective's
//! op, shapes and dtypes against the other ranks' before running it). Why it is needed: NCCL matches
//! collectives by their order alone, so a rank that issues another collective of the same size (an
//! all-reduce where the others reduce-scatter, a bf16 gather where they gather as many f32 values from a
//! smaller buffer) is not refused: the run goes on with wrong values, or hangs until the timeout.
//!
//! The non-obvious decisions: the check is batched and asynchronous, so no collective ever waits for it.
//! A rank records each collective when it issues it (`SigLog::record`: one hash step and one push, a
//! few ns); every `every` collectives it hands its `Window` (index, running hash, the window's
//! signatures, 18 bytes each) to one comparer, a `SigBoard`: rank 0's, over the failure watch's TCP
//! connections under NCCL (`watch.rs`, frame `S`); the group's shared memory under `Local`
//! (`local.rs`). The board compares each window with rank 0's of the same index (so the rank blamed
//! does not depend on arrival order); as every earlier window agreed, the first signature that differs
//! is where the ranks diverged, and the error names it with both ranks' signatures. The count is the collective's whole size (an all-gather's total, not
//! this rank's share), so it is the same on every rank of a correct run.
//!
//! What it does not do: check the values, or the last `< every` collectives of a run (never sent).
use candle_core::DType;
use std::collections::BTreeMap;
use std::fmt;

/// Collectives per window: the default check interval (one ~1.2 KB message per 64 collectives).
pub const SIG_EVERY: u64 = 64;

/// The operations a signature tells apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollOp {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    AllToAll,
    Barrier,
}

const OPS: [CollOp; 6] =
    [CollOp::AllReduce, CollOp::ReduceScatter, CollOp::AllGather, CollOp::Broadcast, CollOp::AllToAll, CollOp::Barrier];

/// Element types on the wire, by index.
const DTYPES: [DType; 7] = [DType::F32, DType::BF16, DType::F16, DType::F64, DType::U32, DType::U8, DType::I64];

impl CollOp {
    /// The name errors use.
    pub fn name(self) -> &'static str {
        match self {
            CollOp::AllReduce => "all_reduce",
            CollOp::ReduceScatter => "reduce_scatter",
            CollOp::AllGather => "all_gather",
            CollOp::Broadcast => "broadcast",
            CollOp::AllToAll => "all_to_all",
            CollOp::Barrier => "barrier",
        }
    }

    fn code(self) -> u8 {
        OPS.iter().position(|&o| o == self).unwrap_or(0) as u8
    }
}

/// One collective as issued: the `seq`-th of this rank (from 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sig {
    pub seq: u64,
    pub op: CollOp,
    /// elements of the whole collective (an all-gather's or reduce-scatter's total)
    pub count: u64,
    pub dtype: DType,
}

impl fmt::Display for Sig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{} {}({} x {})", self.seq, self.op.name(), self.count, self.dtype.as_str())
    }
}

/// The signatures of collectives `index*every+1 ..= (index+1)*every` and the running hash after them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    pub index: u64,
    pub hash: u64,
    pub sigs: Vec<Sig>,
}

/// One rank's record of the collectives it issued (see the file header).
#[derive(Clone, Debug)]
pub struct SigLog {
    every: u64,
    seq: u64,
    hash: u64,
    window: Vec<Sig>,
}

/// One step of the running hash (splitmix64's finalizer over the state xor the value).
fn fold(h: u64, x: u64) -> u64 {
    let mut z = (h ^ x).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn dtype_code(d: DType) -> u8 {
    DTYPES.iter().position(|&t| t == d).map_or(255, |i| i as u8)
}

impl SigLog {
    /// A log that hands out a window every `every` collectives (0: records nothing, never checks).
    pub fn new(every: u64) -> SigLog {
        SigLog { every, seq: 0, hash: 0, window: Vec::with_capacity(every as usize) }
    }

    /// Record the next collective; the completed window when this one ends it.
    pub fn record(&mut self, op: CollOp, count: usize, dtype: DType) -> Option<Window> {
        if self.every == 0 {
            return None;
        }
        self.seq += 1;
        let sig = Sig { seq: self.seq, op, count: count as u64, dtype };
        for x in [sig.seq, u64::from(op.code()), sig.count, u64::from(dtype_code(dtype))] {
            self.hash = fold(self.hash, x);
        }
        self.window.push(sig);
        if !self.seq.is_multiple_of(self.every) {
            return None;
        }
        let sigs = std::mem::replace(&mut self.window, Vec::with_capacity(self.every as usize));
        Some(Window { index: self.seq / self.every - 1, hash: self.hash, sigs })
    }
}

/// A rank whose window differs from rank 0's window of the same index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// rank 0's signature at the first difference (None: its window is shorter)
    pub reference: Option<Sig>,
    /// (the rank that differs, its signature there)
    pub other: (usize, Option<Sig>),
    /// the window both belong to
    pub index: u64,
}

impl Mismatch {
    /// The rank blamed: the one that differs from rank 0.
    pub fn rank(&self) -> usize {
        self.other.0
    }

    /// Where the ranks diverged (`at collective #17`).
    pub fn doing(&self) -> String {
        let seq = self.reference.or(self.other.1).map_or("?".to_string(), |s| s.seq.to_string());
        format!("at collective #{seq}")
    }

    /// Both ranks' signatures at the first difference, with a hint.
    pub fn reason(&self) -> String {
        let show = |s: &Option<Sig>| s.map_or("nothing".to_string(), |s| s.to_string());
        format!(
            "the ranks issued different collectives (signatures seq, op, count, dtype): rank 0 issued {}, rank {} \
             issued {} (window {} of the collective signature check)\nhint: every rank must issue the same \
             collectives in the same order; look for a branch on rank-local state before a collective",
            show(&self.reference),
            self.other.0,
            show(&self.other.1),
            self.index
        )
    }
}

/// One window index on the board: rank 0's window (the reference) once it came, the others' until it
/// does, and how many have matched it.
#[derive(Debug, Default)]
struct Slot {
    reference: Option<Window>,
    waiting: Vec<(usize, Window)>,
    matched: usize,
}

/// The comparer: each rank's window against rank 0's of the same index (so the blame is the same
/// whatever order the windows arrive in: a rank that differs from rank 0).
#[derive(Debug)]
pub struct SigBoard {
    world: usize,
    open: BTreeMap<u64, Slot>,
}

/// `w` against the reference `r`: the first signature that differs, when any does.
fn compare(r: &Window, rank: usize, w: &Window) -> Result<(), Box<Mismatch>> {
    if r.hash == w.hash && r.sigs == w.sigs {
        return Ok(());
    }
    let at = (0..r.sigs.len().max(w.sigs.len())).find(|&i| r.sigs.get(i) != w.sigs.get(i));
    let pick = |s: &[Sig]| at.and_then(|i| s.get(i).copied());
    Err(Box::new(Mismatch { reference: pick(&r.sigs), other: (rank, pick(&w.sigs)), index: w.index }))
}

impl SigBoard {
    /// A board for `world` ranks.
    pub fn new(world: usize) -> SigBoard {
        SigBoard { world, open: BTreeMap::new() }
    }

    /// `rank`'s window; the first mismatch with rank 0's window of its index, once both are here. A
    /// window index is forgotten once every rank's window has matched rank 0's.
    pub fn submit(&mut self, rank: usize, w: Window) -> Result<(), Box<Mismatch>> {
        let index = w.index;
        let slot = self.open.entry(index).or_default();
        let mut check: Vec<(usize, Window)> = vec![];
        match (slot.reference.is_some(), rank) {
            (false, 0) => {
                slot.reference = Some(w);
                slot.matched += 1;
                check = std::mem::take(&mut slot.waiting);
            }
            (false, _) => slot.waiting.push((rank, w)),
            (true, _) => check.push((rank, w)),
        }
        if let Some(r) = &slot.reference {
            for (rank, w) in &check {
                compare(r, *rank, w)?;
                slot.matched += 1;
            }
        }
        if slot.matched >= self.world {
            self.open.remove(&index);
        }
        Ok(())
    }

    /// Window indices not yet matched by every rank.
    pub fn open_windows(&self) -> usize {
        self.open.len()
    }
}

/// A window as a frame body: index u64, hash u64, n u32, then per signature seq u64, op u8, dtype u8,
/// count u64 (little-endian).
pub fn encode(w: &Window) -> Vec<u8> {
    let mut b = Vec::with_capacity(20 + 18 * w.sigs.len());
    b.extend_from_slice(&w.index.to_le_bytes());
    b.extend_from_slice(&w.hash.to_le_bytes());
    b.extend_from_slice(&(w.sigs.len() as u32).to_le_bytes());
    for s in &w.sigs {
        b.extend_from_slice(&s.seq.to_le_bytes());
        b.push(s.op.code());
        b.push(dtype_code(s.dtype));
        b.extend_from_slice(&s.count.to_le_bytes());
    }
    b
}

/// The window of a frame body; None when malformed.
pub fn decode(b: &[u8]) -> Option<Window> {
    let u64_at = |at: usize| -> Option<u64> { Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?)) };
    let n = u32::from_le_bytes(b.get(16..20)?.try_into().ok()?) as usize;
    if b.len() != 20 + 18 * n {
        return None;
    }
    let sigs = (0..n)
        .map(|i| {
            let at = 20 + 18 * i;
            Some(Sig {
                seq: u64_at(at)?,
                op: *OPS.get(usize::from(b[at + 8]))?,
                dtype: *DTYPES.get(usize::from(b[at + 9]))?,
                count: u64_at(at + 10)?,
            })
        })
        .collect::<Option<Vec<Sig>>>()?;
    Some(Window { index: u64_at(0)?, hash: u64_at(8)?, sigs })
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

impl GroupFailure {
    /// The collective signature check's verdict as the group's failure (blames the rank that differs
    /// from the first window seen; the reason names both ranks' signatures).
    pub fn from_mismatch(m: &Mismatch) -> GroupFailure {
        GroupFailure { rank: m.rank(), doing: m.doing(), reason: m.reason() }
    }
}

impl fmt::Display for GroupFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} failed {}: {}", self.rank, self.doing, self.reason)
    }
}

impl std::error::Error for GroupFailure {}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(ops: &[(CollOp, usize, DType)], every: u64) -> Vec<Window> {
        let mut log = SigLog::new(every);
        ops.iter().filter_map(|&(o, n, d)| log.record(o, n, d)).collect()
    }

    #[test]
    fn windows_come_every_n_collectives_and_equal_runs_agree() {
        let ops: Vec<_> = (0..10).map(|i| (OPS[i % 6], i * 3, DTYPES[i % 3])).collect();
        let w = run(&ops, 4);
        assert_eq!(w.len(), 2);
        assert_eq!((w[0].index, w[1].index), (0, 1));
        assert_eq!(w[1].sigs.iter().map(|s| s.seq).collect::<Vec<_>>(), [5, 6, 7, 8]);
        assert!(run(&ops, 0).is_empty(), "every = 0: off");
        let mut board = SigBoard::new(3);
        for r in 0..3 {
            for x in run(&ops, 4) {
                board.submit(r, x).unwrap();
            }
        }
        assert_eq!(board.open_windows(), 0, "matched windows are forgotten");
    }

    #[test]
    fn a_differing_window_names_the_first_difference_with_both_signatures_whatever_the_order() {
        let a: Vec<_> = (0..8).map(|i| (CollOp::AllGather, 100 + i, DType::BF16)).collect();
        for (at, swap) in [(2, (CollOp::ReduceScatter, 102, DType::BF16)), (6, (CollOp::AllGather, 106, DType::F32))] {
            let mut b = a.clone();
            b[at] = swap;
            for rank0_first in [false, true] {
                let mut board = SigBoard::new(3);
                let mut res = vec![];
                for ((x, y), z) in run(&a, 4).into_iter().zip(run(&b, 4)).zip(run(&a, 4)) {
                    if rank0_first {
                        res.push(board.submit(0, x));
                        res.push(board.submit(2, y));
                        res.push(board.submit(1, z));
                    } else {
                        res.push(board.submit(2, y));
                        res.push(board.submit(1, z));
                        res.push(board.submit(0, x));
                    }
                }
                let m = res.into_iter().find_map(Result::err).expect("a mismatch");
                let want_b = Sig { seq: at as u64 + 1, op: swap.0, count: swap.1 as u64, dtype: swap.2 };
                assert_eq!(m.other, (2, Some(want_b)), "the rank that differs from rank 0 is blamed");
                let e = format!("{}: {}", m.doing(), m.reason());
                assert_eq!(m.rank(), 2);
                assert!(e.contains(&format!("at collective #{}", at + 1)), "{e}");
                assert!(e.contains(&format!("rank 0 issued #{} all_gather({} x bf16)", at + 1, 100 + at)), "{e}");
                assert!(e.contains(&format!("rank 2 issued {want_b}")) && e.contains("hint:"), "{e}");
            }
        }
    }

    #[test]
    fn windows_round_trip_and_malformed_frames_are_refused() {
        let ops =
            [(CollOp::Barrier, 0, DType::F32), (CollOp::AllToAll, 7, DType::F16), (CollOp::Broadcast, 1, DType::F64)];
        let w = run(&ops, 3).remove(0);
        let b = encode(&w);
        assert_eq!(decode(&b), Some(w));
        assert_eq!(decode(&b[..b.len() - 1]), None);
        let mut bad = b.clone();
        bad[20 + 8] = 99; // no such op
        assert_eq!(decode(&bad), None);
    }
}
