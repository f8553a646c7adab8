//! The group's first collectives: one small call of each kind the run makes, on every communicator, right
//! after the group forms and before any weight is read (`Comm::warm_up`, called by `train::session`).
//!
//! Why: NCCL sets up a communicator's transport buffers (per peer and channel, tens to hundreds of MiB on a
//! node of 8) lazily, at the first collective of each kind and connection pattern, with cudaMalloc outside
//! the device's memory pool. Made for the first time mid-step, after the pool has grown to the step's
//! peak, that allocation is the one that fails. Made first, NCCL's memory sits below the pool and the
//! plan's headroom is measured over it. Each call's result is checked, so a fabric that connects but
//! moves wrong bytes stops the run here, in seconds, on every backend (Local threads and Gloo processes
//! take the same calls and paths, which is how CI rehearses it).
//!
//! The calls: an all-reduce (the loss and grad-norm sums), a ragged all-gather (ZeRO's weight gathers; under
//! NCCL one broadcast per root), a ragged reduce-scatter (ZeRO's gradient hand-off; one reduce per root), a
//! barrier, and with sequence parallelism the all-to-all of `comms::sequence` on the SP group.
use super::sequence::{heads_to_seq, SpGroup};
use super::Comm;
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};

impl Comm {
    /// One small call of every collective kind on this group (and the SP group), results checked.
    pub fn warm_up(&self, dev: &Device, sp: Option<&SpGroup>) -> Result<()> {
        let mesh = self.mesh();
        let (rank, world) = (mesh.rank(), mesh.world());
        let fail = |what: &str, got: String, want: String| -> Result<()> {
            bail!(
                "the group's first {what} gave {got}, expected {want}\nhint: the ranks connect but the collective \
                 moves wrong data: check the network/NVLink settings (NCCL_DEBUG=INFO) and that every rank runs \
                 the same harpe binary"
            )
        };
        let mut sum = [rank as f64 + 1.0];
        self.all_reduce_sum_f64(&mut sum).context("warm-up all-reduce")?;
        let want = (world * (world + 1) / 2) as f64;
        if sum[0] != want {
            fail("all-reduce", sum[0].to_string(), want.to_string())?;
        }
        // ragged: rank r holds r + 1 values, all equal to r
        let counts: Vec<usize> = (1..=world).collect();
        let mine = Tensor::full(rank as f32, counts[rank], dev)?;
        let all = self.all_gather_v_tensor(&mine, &counts, "warm-up all-gather").context("warm-up all-gather")?;
        let want: Vec<f32> = counts.iter().enumerate().flat_map(|(r, &n)| std::iter::repeat_n(r as f32, n)).collect();
        let got = all.to_vec1::<f32>()?;
        if got != want {
            fail("all-gather", format!("{got:?}"), format!("{want:?}"))?;
        }
        let ones = Tensor::ones(counts.iter().sum::<usize>(), candle_core::DType::F32, dev)?;
        let part = self
            .reduce_scatter_v_sum_tensor(&ones, &counts, "warm-up reduce-scatter")
            .context("warm-up reduce-scatter")?;
        let got = part.to_vec1::<f32>()?;
        if got != vec![world as f32; counts[rank]] {
            fail("reduce-scatter", format!("{got:?}"), format!("{} x {world}", counts[rank]))?;
        }
        self.barrier().context("warm-up barrier")?;
        if let Some(g) = sp {
            // (B 1, heads P, T/P 1, D 2): this rank's one token of every head; after the exchange, all P tokens
            // of head `g.rank()`, token i holding rank i's value
            let p = g.size();
            let x = Tensor::full(g.rank() as f32, (1, p, 1, 2), dev)?;
            let y = heads_to_seq(g, &x, "warm-up all-to-all").context("warm-up all-to-all (sequence parallel)")?;
            let got = y.flatten_all()?.to_vec1::<f32>()?;
            let want: Vec<f32> = (0..p).flat_map(|i| [i as f32, i as f32]).collect();
            if got != want {
                fail("all-to-all", format!("{got:?}"), format!("{want:?}"))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comms::local::{spawn_local, LocalGroup};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// 4 Local ranks in 2 sequence-parallel pairs: every call of the warm-up runs and checks its result, and
    /// a group of one (`Single`) passes it too.
    #[test]
    fn every_collective_of_the_warm_up_runs_on_local_ranks_with_sequence_parallel_pairs() {
        let sp: Vec<_> = (0..2).flat_map(|_| LocalGroup::new(2, Duration::from_secs(20)).unwrap().handles()).collect();
        let sp = Mutex::new(sp.into_iter().map(Some).collect::<Vec<_>>());
        let ranks = spawn_local(4, Duration::from_secs(20), |lc| {
            let g = sp.lock().unwrap()[lc.rank()].take().map(|h| SpGroup::Local(Arc::new(h)));
            let c = Comm::Local(lc, 2);
            c.warm_up(&Device::Cpu, g.as_ref())?;
            Ok(c.mesh().rank())
        })
        .unwrap();
        assert_eq!(ranks.len(), 4);
        Comm::Single.warm_up(&Device::Cpu, None).unwrap();
    }
}
