//! One evaluation split over the ranks of a training group (`[eval]` during a multi-rank run): item i
//! (a document, a passkey sample, a loss sequence, a group of task requests) is scored by rank
//! i mod world, and every item's result reaches every rank (`Share::rows`).
//!
//! Why: work done on rank 0 alone while the others wait could outlast `dist.timeout_s`.
//! The non-obvious decision: results travel as per-item rows of f64 through `all_reduce_sum_f64` (the one
//! host collective every backend has), each item's row filled by its one owner and zero on every other
//! rank. Adding zeros is exact, so each rank gets the owner's values bit for bit, and the caller sums them
//! in item order exactly as one rank would have: the logged numbers are the same bits as a one-rank
//! evaluation of the same weights, not just close. Strings (a task's generations) travel as their bytes.
//! What this file does not do: score anything (`train::eval` calls the eval commands' scorers).
use crate::comms::Comm;
use crate::eval::tasks::results::Response;
use crate::eval::tasks::score::ChoiceScore;
use anyhow::{anyhow, bail, Result};

/// This rank's share of an evaluation.
pub struct Share<'a> {
    comm: &'a Comm,
    /// this rank
    pub rank: usize,
    /// ranks in the group
    pub world: usize,
}

impl<'a> Share<'a> {
    /// The share of this rank of `comm`'s group.
    pub fn new(comm: &'a Comm) -> Share<'a> {
        let m = comm.mesh();
        Share { comm, rank: m.rank(), world: m.world() }
    }

    /// Whether item `i` is this rank's to score.
    pub fn mine(&self, i: usize) -> bool {
        i % self.world == self.rank
    }

    /// Every item's row on every rank: `rows[i]` is `Some` on the rank that scored item i (`mine`) and
    /// `None` on the others; rows may differ in length. Two collectives: the lengths, then the values.
    pub fn rows(&self, rows: Vec<Option<Vec<f64>>>) -> Result<Vec<Vec<f64>>> {
        if self.world == 1 {
            return rows
                .into_iter()
                .enumerate()
                .map(|(i, r)| r.ok_or_else(|| anyhow!("internal: evaluation item {i} was not scored")))
                .collect();
        }
        let mut lens: Vec<f64> = rows.iter().map(|r| r.as_ref().map_or(0.0, |v| v.len() as f64 + 1.0)).collect();
        self.comm.all_reduce_sum_f64(&mut lens)?;
        // a row's length is told as len + 1, so an unscored item (0) differs from an empty row (1)
        if let Some(i) = lens.iter().position(|&l| l == 0.0) {
            bail!("internal: evaluation item {i} was scored by no rank");
        }
        let lens: Vec<usize> = lens.iter().map(|&l| l as usize - 1).collect();
        let mut flat = vec![0f64; lens.iter().sum()];
        let mut at = 0;
        for (r, &n) in rows.iter().zip(&lens) {
            if let Some(v) = r {
                flat[at..at + n].copy_from_slice(v);
            }
            at += n;
        }
        self.comm.all_reduce_sum_f64(&mut flat)?;
        let mut out = Vec::with_capacity(lens.len());
        let mut at = 0;
        for n in lens {
            out.push(flat[at..at + n].to_vec());
            at += n;
        }
        Ok(out)
    }
}

/// A task response as a row: `[0, loglik, greedy, ...]` for choices, `[1, bytes...]` for a generation.
pub fn response_row(r: &Response) -> Vec<f64> {
    match r {
        Response::Choices(c) => {
            std::iter::once(0.0).chain(c.iter().flat_map(|s| [s.loglik, f64::from(u8::from(s.is_greedy))])).collect()
        }
        Response::Generation(g) => std::iter::once(1.0).chain(g.bytes().map(f64::from)).collect(),
    }
}

/// The response of a row made by `response_row`.
pub fn row_response(row: &[f64]) -> Result<Response> {
    let bad = || anyhow!("internal: a task response row of {} values is malformed", row.len());
    let (&tag, rest) = row.split_first().ok_or_else(bad)?;
    if tag == 0.0 && rest.len() % 2 == 0 {
        let c = rest.chunks_exact(2).map(|c| ChoiceScore { loglik: c[0], is_greedy: c[1] != 0.0 });
        return Ok(Response::Choices(c.collect()));
    }
    if tag != 1.0 {
        return Err(bad());
    }
    let bytes: Vec<u8> = rest.iter().map(|&b| b as u8).collect();
    Ok(Response::Generation(String::from_utf8(bytes).map_err(|e| anyhow!("internal: a generation row: {e}"))?))
}

/// Test hook of the long-evaluation test (`testing::SLOW_EVAL`): each scored item sleeps, so an
/// evaluation outlasts `dist.timeout_s` deterministically.
pub fn test_delay(items: usize) {
    if let Some(d) = crate::testing::hooks().slow_eval {
        std::thread::sleep(d * items as u32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comms::local::spawn_local;
    use std::time::Duration;

    /// Rows of different lengths (one empty) scored by 3 ranks arrive on every rank bit for bit, and
    /// task responses survive the trip.
    #[test]
    fn every_rank_gets_every_items_row_exactly() {
        let row = |i: usize| -> Vec<f64> { (0..i).map(|k| 0.1 * (i * 7 + k) as f64 - 1e-17).collect() };
        let got = spawn_local(3, Duration::from_secs(20), |lc| {
            let comm = Comm::Local(lc, 1);
            let share = Share::new(&comm);
            let mine = (0..7).map(|i| share.mine(i).then(|| row(i))).collect();
            share.rows(mine)
        })
        .unwrap();
        for rows in got {
            for (i, r) in rows.iter().enumerate() {
                assert_eq!(
                    r.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    row(i).iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                );
            }
        }
        // an item nobody scored is an error, not a zero
        let e = spawn_local(2, Duration::from_secs(20), |lc| {
            let comm = Comm::Local(lc, 1);
            Share::new(&comm).rows(vec![Some(vec![1.0]).filter(|_| comm.mesh().rank() == 0), None])
        });
        assert!(e.is_err());
        for r in [
            Response::Choices(vec![
                ChoiceScore { loglik: -1.25, is_greedy: true },
                ChoiceScore { loglik: -3.0, is_greedy: false },
            ]),
            Response::Generation("Paris, naïve ✓".into()),
            Response::Generation(String::new()),
        ] {
            assert_eq!(row_response(&response_row(&r)).unwrap(), r);
        }
        assert!(row_response(&[0.0, 1.0]).is_err() && row_response(&[]).is_err());
    }
}
