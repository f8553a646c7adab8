//! Collectives between training ranks: `Comm` with the operations the loop needs.
//!
//! Reference: DESIGN.md §6 (`Comm` = Single | Local | Nccl), llm.c `llmc/zero.cuh` (ZeRO as a no-op at
//! one process). The non-obvious decision: the training loop always calls the collectives (gradient
//! all-reduce, master-weight all-gather, metric reduction), so one process and many processes run the
//! same straight-line code and `train.rs` has no `if distributed` branch. all_gather / reduce_scatter /
//! broadcast / all_to_all arrive with the backends that need them.
//! What this file does not do yet: the `Local` (threads) and `Nccl` backends and the launcher; only
//! `Single` exists, and configs that ask for anything else are refused by `config.rs`.
pub mod launch;
pub mod local;
pub mod rendezvous;

use anyhow::Result;
use std::ops::Range;

/// The communicator of this process.
#[derive(Clone, Debug)]
pub enum Comm {
    /// One process, one device: every collective is a no-op.
    Single,
}

impl Comm {
    /// This process's rank.
    pub fn rank(&self) -> usize {
        match self {
            Comm::Single => 0,
        }
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        match self {
            Comm::Single => 1,
        }
    }

    /// Sum `buf` over all ranks, then divide by the world size (gradient averaging).
    pub fn all_reduce_mean(&self, buf: &mut [f32]) -> Result<()> {
        match self {
            Comm::Single => {
                let _ = buf;
                Ok(())
            }
        }
    }

    /// Sum a few f64 scalars (loss sums, token counts) over all ranks.
    pub fn all_reduce_sum_f64(&self, vals: &mut [f64]) -> Result<()> {
        match self {
            Comm::Single => {
                let _ = vals;
                Ok(())
            }
        }
    }

    /// The slice of a flat parameter vector of length `n` that this rank's optimizer owns (ZeRO-1):
    /// contiguous, equal-sized up to rounding, the last rank takes the remainder.
    pub fn shard_range(&self, n: usize) -> Range<usize> {
        let (r, w) = (self.rank(), self.world_size());
        let per = n.div_ceil(w);
        let lo = (r * per).min(n);
        let hi = ((r + 1) * per).min(n);
        lo..hi
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_rank_owns_everything_and_collectives_keep_values() {
        let c = Comm::Single;
        assert_eq!(c.shard_range(10), 0..10);
        let mut g = vec![1.0f32, -2.0];
        c.all_reduce_mean(&mut g).unwrap();
        assert_eq!(g, vec![1.0, -2.0]);
    }
}
