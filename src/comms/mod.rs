//! Collectives between training ranks: `Comm` with the operations the loop needs, the rank `Mesh`, and
//! ZeRO ownership (`zero`).
//!
//! Reference: DESIGN.md §6 (`Comm` = Single | Local | Nccl, `Mesh {dp, sp}`), llm.c `llmc/zero.cuh`
//! (ZeRO as a no-op at one process). The non-obvious decisions: the training loop always calls the
//! collectives (gradient all-reduce, master-weight all-gather, metric reduction, checkpoint barrier),
//! so one process and many processes run the same straight-line code and `train.rs` has no
//! `if distributed` branch; collectives take `FlatBuf`s (host or device), never host slices. `Single`
//! leaves device buffers where they are; `Local` (threads) copies a device buffer through the host and
//! back for each collective for now, which is correct but slow: the NCCL backend is the GPU path. The mesh
//! separates the data-parallel rank (which data a rank reads) from the sequence-parallel rank (which
//! part of a sequence it holds); the optimizer shard and the checkpoint file names use the global rank
//! `dp_rank * sp_size + sp_rank` of `dp_size * sp_size` (ZeRO shards over every rank, as DeepSpeed-Ulysses
//! does), which is `optim-00000-of-00001` at one rank, as before.
//! `Local` wraps one rank's `LocalComm` handle (ranks as threads, `local::spawn_local` starts them; the
//! training loop does that for `dist.backend = "local"`). A shard map of ONE rank used with N ranks
//! means "replicated" (ZeRO-0: every rank owns the whole flat space), so `all_gather` is then a no-op.
//! `sequence` holds the Ulysses all-to-all for `dist.sp_degree` > 1 (its own `SpGroup` per sequence-
//! parallel group; the mesh of `Local(c, P)` is (N/P) x P).
//! What this file does not do yet: the `Nccl` backend; a config asking for it is refused by
//! `Comm::from_config` with a hint. A new backend is one more variant.
pub mod launch;
pub mod local;
pub mod rendezvous;
pub mod sequence;
pub mod zero;

use crate::config::{Backend, DistSection};
use crate::flatbuf::FlatBuf;
use anyhow::{bail, Result};
use local::{LocalComm, ReduceOp};
use std::sync::Arc;
use zero::ShardMap;

/// Who this process is among the training ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mesh {
    /// data-parallel rank: which slice of the data stream this rank reads
    pub dp_rank: usize,
    /// number of data-parallel ranks
    pub dp_size: usize,
    /// sequence-parallel rank: which part of each sequence this rank holds
    pub sp_rank: usize,
    /// ranks sharing one sequence (1 = no sequence parallelism)
    pub sp_size: usize,
}

impl Mesh {
    /// The mesh of one process.
    pub fn single() -> Mesh {
        Mesh { dp_rank: 0, dp_size: 1, sp_rank: 0, sp_size: 1 }
    }

    /// Global rank: the optimizer shard this rank owns and its checkpoint file.
    pub fn rank(&self) -> usize {
        self.dp_rank * self.sp_size + self.sp_rank
    }

    /// Number of ranks in total.
    pub fn world(&self) -> usize {
        self.dp_size * self.sp_size
    }
}

/// The communicator of this process.
#[derive(Clone, Debug)]
pub enum Comm {
    /// One process, one device: every collective is a no-op.
    Single,
    /// One of N ranks running as threads of this process, and the sequence-parallel degree P: ranks
    /// r*P..(r+1)*P share sequences (data-parallel rank r), so the mesh is (N/P) x P.
    Local(Arc<LocalComm>, usize),
}

impl Comm {
    /// The communicator `[dist]` asks for; `origin` (the config file) names where the request came from.
    pub fn from_config(dist: &DistSection, origin: &str) -> Result<Comm> {
        match dist.backend {
            Backend::Single => Ok(Comm::Single),
            Backend::Local => bail!(
                "{origin}: dist.backend = \"local\" starts its ranks as threads inside `harpe train`; a lone communicator cannot be built for it\nhint: run `harpe train --set dist.backend=local --set dist.world_size=N`, or use comms::local::spawn_local in tests"
            ),
            b @ Backend::Nccl => bail!(
                "{origin}: dist.backend = \"{}\" is not implemented in this build of harpe\nhint: use dist.backend = \"single\" (one process, one device); multi-rank training arrives with the Local and NCCL backends",
                b.name()
            ),
        }
    }

    /// This process's place in the rank mesh.
    pub fn mesh(&self) -> Mesh {
        match self {
            Comm::Single => Mesh::single(),
            Comm::Local(c, sp) => {
                let sp = (*sp).max(1);
                Mesh { dp_rank: c.rank() / sp, dp_size: c.world_size() / sp, sp_rank: c.rank() % sp, sp_size: sp }
            }
        }
    }

    /// Sum `buf` over all ranks (gradients already scaled by 1 / the global token count).
    pub fn all_reduce_sum(&self, buf: &mut FlatBuf) -> Result<()> {
        match self {
            Comm::Single => {
                let _ = buf;
                Ok(())
            }
            // threads exchange host slices: a device buffer is copied through the host for now (the
            // NCCL backend will reduce device memory in place)
            Comm::Local(c, _) => buf.with_host_mut(|v| c.all_reduce(v, ReduceOp::Sum, "grads")),
        }
    }

    /// Sum a few f64 scalars (loss sums, token counts, error flags) over all ranks.
    pub fn all_reduce_sum_f64(&self, vals: &mut [f64]) -> Result<()> {
        match self {
            Comm::Single => {
                let _ = vals;
                Ok(())
            }
            Comm::Local(c, _) => c.all_reduce(vals, ReduceOp::Sum, "scalars"),
        }
    }

    /// On entry every rank's own range of `buf` (per `map`) is valid; on exit the whole buffer is.
    pub fn all_gather(&self, buf: &mut FlatBuf, map: &ShardMap) -> Result<()> {
        if map.world() == 1 {
            return Ok(()); // replicated ownership (ZeRO-0): every rank already holds everything
        }
        if map.world() != self.mesh().world() {
            bail!("internal: a shard map for {} ranks used with {} ranks", map.world(), self.mesh().world());
        }
        match self {
            Comm::Single => {
                let _ = buf;
                Ok(())
            }
            Comm::Local(c, _) => {
                let counts: Vec<usize> = (0..map.world()).map(|r| map.flat_range(r).len()).collect();
                // through the host for a device buffer, as all_reduce_sum
                buf.with_host_mut(|v| c.all_gather_v_inplace(v, &counts, "weights"))
            }
        }
    }

    /// Wait until every rank has arrived.
    pub fn barrier(&self) -> Result<()> {
        match self {
            Comm::Single => Ok(()),
            Comm::Local(c, _) => c.barrier("barrier"),
        }
    }

    /// All-gather of slices of lengths `counts` (rank order) into `output`, their concatenation; this
    /// rank contributes `input` (`counts[rank]` values). ZeRO-3 gathers one layer's weights with it.
    pub fn all_gather_v(&self, input: &[f32], output: &mut [f32], counts: &[usize], label: &str) -> Result<()> {
        match self {
            Comm::Single => {
                if input.len() != output.len() {
                    bail!("internal: all_gather \"{label}\" of {} values into {}", input.len(), output.len());
                }
                output.copy_from_slice(input);
                Ok(())
            }
            Comm::Local(c, _) => c.all_gather_v(input, output, counts, label),
        }
    }

    /// Reduce-scatter (sum) of `input`, the concatenation of slices of lengths `counts`: this rank gets
    /// slice `rank` summed over ranks in `output`. ZeRO-3 hands one layer's gradients to their owners.
    pub fn reduce_scatter_v_sum(&self, input: &[f32], output: &mut [f32], counts: &[usize], label: &str) -> Result<()> {
        match self {
            Comm::Single => {
                if input.len() != output.len() {
                    bail!("internal: reduce_scatter \"{label}\" of {} values into {}", input.len(), output.len());
                }
                output.copy_from_slice(input);
                Ok(())
            }
            Comm::Local(c, _) => c.reduce_scatter_v(input, output, counts, ReduceOp::Sum, label),
        }
    }

    /// Barrier that also agrees on success: true only when `ok` is true on every rank.
    pub fn all_ok(&self, ok: bool) -> Result<bool> {
        let mut bad = [if ok { 0.0 } else { 1.0 }];
        self.all_reduce_sum_f64(&mut bad)?;
        Ok(bad[0] == 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_rank_owns_everything_and_collectives_keep_values() {
        let c = Comm::from_config(&DistSection::default(), "test.toml").unwrap();
        assert_eq!(c.mesh(), Mesh::single());
        assert_eq!((c.mesh().rank(), c.mesh().world()), (0, 1));
        let mut g = FlatBuf::from_vec(vec![1.0f32, -2.0]);
        c.all_reduce_sum(&mut g).unwrap();
        assert_eq!(g.host().unwrap(), &[1.0, -2.0]);
        // device buffers stay on their device
        let mut d =
            g.try_clone().unwrap().placed(&crate::flatbuf::Placement::Device(candle_core::Device::Cpu)).unwrap();
        c.all_reduce_sum(&mut d).unwrap();
        let l = crate::grads::ParamLayout::new(&[("w".into(), vec![2])]);
        c.all_gather(&mut d, &ShardMap::new(&l, 1, zero::Split::Slices)).unwrap();
        assert!(matches!(d, FlatBuf::Device(_)) && d == g);
        assert!(c.all_ok(true).unwrap() && !c.all_ok(false).unwrap());
    }

    #[test]
    fn unimplemented_backends_are_refused_with_a_hint() {
        for b in [Backend::Local, Backend::Nccl] {
            let d = DistSection { backend: b, ..Default::default() };
            let e = Comm::from_config(&d, "run.toml").unwrap_err().to_string();
            assert!(e.contains("run.toml: dist.backend") && e.contains(b.name()) && e.contains("hint:"), "{e}");
        }
    }

    #[test]
    fn local_collectives_accept_device_buffers() {
        use crate::flatbuf::Placement;
        use std::time::Duration;
        let l = crate::grads::ParamLayout::new(&[("w".into(), vec![5])]);
        let map = ShardMap::new(&l, 2, zero::Split::Slices);
        let out = local::spawn_local(2, Duration::from_secs(20), |lc| {
            let c = Comm::Local(lc, 1);
            let r = c.mesh().rank() as f32;
            let dp = Placement::Device(candle_core::Device::Cpu);
            let mut g = FlatBuf::from_vec(vec![1.0 + r; 5]).placed(&dp)?;
            c.all_reduce_sum(&mut g)?;
            let mut w = FlatBuf::from_vec(vec![10.0 * (r + 1.0); 5]).placed(&dp)?;
            c.all_gather(&mut w, &map)?;
            anyhow::ensure!(matches!(g, FlatBuf::Device(_)) && matches!(w, FlatBuf::Device(_)));
            Ok((g.to_host()?.to_vec(), w.to_host()?.to_vec()))
        })
        .unwrap();
        for (g, w) in out {
            assert_eq!(g, vec![3.0; 5]);
            assert_eq!(w, vec![10.0, 10.0, 10.0, 20.0, 20.0]);
        }
    }
}
