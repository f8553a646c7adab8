//! The loss sums of one optimizer step, on the device, per source (see `LossSums`).
use crate::config::targets_in;
use crate::data::Sequence;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

/// The loss sums of one optimizer step, kept on the nll's device across its micro-batches (f64) and
/// read back once per step: the nll sum and, with >= 2 sources, the nll sum per source id. Per-source
/// token counts come from the spans on the host (they do not depend on the nll), so only 1 + sources
/// scalars cross per step. The per-source sums select each source's positions (`where_cond` on an
/// (S, B*T) mask built on the device from one u32 source id per position) and sum each row: parallel on
/// CUDA (candle's `index_add` of a 1-D tensor runs on one GPU thread); on the CPU each row is summed in
/// position order, so one micro-batch gives exactly the bits of the host loop this replaced, and
/// several differ from it only in how the f64 partial sums associate (~1e-16 relative).
pub struct LossSums {
    /// () f64: nll sum of every position
    total: Tensor,
    /// (S) f64: nll sum per source id (None below 2 sources)
    by_source: Option<Tensor>,
    /// predicted tokens per source id
    counts: Vec<f64>,
}

impl LossSums {
    /// Zero sums on `device` for a dataset of `n_sources` sources (no per-source sums below 2).
    pub fn new(n_sources: usize, device: &Device) -> Result<LossSums> {
        let n = if n_sources < 2 { 0 } else { n_sources };
        let by_source = if n == 0 { None } else { Some(Tensor::zeros(n, DType::F64, device)?) };
        Ok(LossSums { total: Tensor::zeros((), DType::F64, device)?, by_source, counts: vec![0.0; n] })
    }

    /// Add one micro-batch: `nll` (B*len) holds positions `start..start + len` of each of `seqs` (one
    /// rank's part under sequence parallelism, all of it otherwise); position p predicts token p + 1,
    /// whose source is `Sequence::source_of` (the one rule).
    pub fn add(&mut self, nll: &Tensor, seqs: &[Sequence], start: usize, len: usize) -> Result<()> {
        let nll = nll.to_dtype(DType::F64)?; // (B*len), exact
        self.total = (&self.total + nll.sum_all()?)?;
        let Some(acc) = &self.by_source else { return Ok(()) };
        let (n, bt) = (self.counts.len(), nll.elem_count());
        let mut ids = vec![n as u32; bt]; // (B*len) source id per position, n = none (no target or source)
        for (i, s) in seqs.iter().enumerate() {
            let t = s.tokens.len();
            for p in start..start + targets_in(start, len.min(t.saturating_sub(start)), t) {
                if let Some(id) = s.source_of(p + 1) {
                    if id as usize >= n {
                        bail!("a sequence names source id {id}, but the dataset lists {n} sources\nhint: the dataset is damaged; check it with harpe inspect-data --verify");
                    }
                    ids[i * len + p - start] = id;
                    self.counts[id as usize] += 1.0;
                }
            }
        }
        let dev = nll.device();
        let ids = Tensor::from_vec(ids, (1, bt), dev)?; // (1, B*len)
        let hit = ids.broadcast_eq(&Tensor::arange(0u32, n as u32, dev)?.reshape((n, 1))?)?; // (S, B*len) u8
        let zero = Tensor::zeros((n, bt), DType::F64, dev)?;
        let picked = hit.where_cond(&nll.reshape((1, bt))?.broadcast_as((n, bt))?, &zero)?; // (S, B*len)
        self.by_source = Some((acc + picked.sum(1)?)?); // (S)
        Ok(())
    }

    /// The nll sum, then (nll sum, count) per source id (empty with < 2 sources): the step's only
    /// device-to-host copy of the loss.
    pub fn read(&self) -> Result<(f64, Vec<f64>)> {
        let total = self.total.to_scalar::<f64>()?;
        let Some(acc) = &self.by_source else { return Ok((total, vec![])) };
        let sums = acc.to_vec1::<f64>()?;
        Ok((total, self.counts.iter().zip(&sums).flat_map(|(&c, &s)| [s, c]).collect()))
    }
}
