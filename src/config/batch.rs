//! The batch arithmetic of a recipe: tokens per optimizer step, micro-batches accumulated per step,
//! target tokens per step (T tokens train T - 1), optimizer steps per stage, and how each
//! data-parallel rank splits its share of a step.
//!
//! It lives under config, not train, because `RunConfig::validate` applies `[dist]`'s batch rules to
//! it and config imports nothing above it; the training stage (`train::stage`), the loss sums, the
//! plan and the sweep read the same numbers from here.
use super::sections::RunConfig;
use anyhow::{bail, Result};

/// One stage's batch as `[dist]`'s rules see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageBatch {
    /// tokens per sequence
    pub seq_len: usize,
    /// micro-batches per optimizer step (at one rank)
    pub micro_batches: usize,
    /// sequences per micro-batch (`train.micro_batch_size`)
    pub micro_batch: usize,
}

/// Targets among positions `start..start + len` of sequences of `seq_len` tokens: every position
/// predicts the next token except the sequence's last (the one rule of targets: T tokens train T - 1;
/// a sequence-parallel rank's share is its positions' count, less one on the rank holding the last).
pub fn targets_in(start: usize, len: usize, seq_len: usize) -> usize {
    len - usize::from(start + len == seq_len)
}

/// How each data-parallel rank runs its part of an optimizer step of `micro_batches_per_step`
/// micro-batches of `micro_batch` sequences: (sequences per micro-batch, micro-batches), together
/// `micro_batches_per_step * micro_batch / dp_size` sequences. The step's sequences must split evenly
/// over the ranks (results must not depend on the world; the loader's stride gives the ranks exactly
/// one rank's sequences of the step); when a rank's share is not a multiple of `micro_batch`, it runs
/// smaller micro-batches (the largest common divisor), which changes memory and speed, never results.
pub fn rank_batching(
    origin: &str,
    stage: &str,
    micro_batches_per_step: usize,
    micro_batch: usize,
    dp_size: usize,
) -> Result<(usize, usize)> {
    let seqs = micro_batches_per_step * micro_batch;
    if dp_size == 0 || micro_batch == 0 || !seqs.is_multiple_of(dp_size) {
        bail!(
            "{origin}: {stage}: {seqs} sequences per optimizer step cannot be split evenly over \
             {dp_size} data-parallel ranks\nhint: make train.global_batch_tokens / seq_len a multiple of the \
             data-parallel world size"
        );
    }
    let per_rank = seqs / dp_size;
    let mut mb = micro_batch.min(per_rank);
    while !per_rank.is_multiple_of(mb) {
        mb -= 1;
    }
    Ok((mb, per_rank / mb))
}

impl RunConfig {
    /// Optimizer steps of stage `i` and its tokens per step.
    pub fn stage_steps(&self, i: usize) -> (u64, u64) {
        let s = &self.stages[i];
        let per_step = self.tokens_per_step(i) as u64;
        let steps = match (s.steps, s.tokens) {
            (Some(n), _) => n,
            (None, Some(t)) => t.div_ceil(per_step).max(1),
            (None, None) => 0,
        };
        (steps, per_step)
    }

    /// Tokens in one optimizer step of stage `i`.
    pub fn tokens_per_step(&self, i: usize) -> usize {
        self.train.global_batch_tokens.unwrap_or(self.train.micro_batch_size * self.stages[i].seq_len)
    }

    /// Target tokens of one optimizer step of stage `i` over all ranks: the loss is their mean, so each
    /// micro-batch's nll sum is scaled by its inverse.
    pub fn targets_per_step(&self, i: usize) -> usize {
        let t = self.stages[i].seq_len;
        self.tokens_per_step(i) / t * targets_in(0, t, t)
    }

    /// Every stage's batch as `[dist]`'s rules see it.
    pub fn stage_batches(&self) -> Vec<StageBatch> {
        (0..self.stages.len())
            .map(|i| StageBatch {
                seq_len: self.stages[i].seq_len,
                micro_batches: self.accumulation(i),
                micro_batch: self.train.micro_batch_size,
            })
            .collect()
    }

    /// Micro-batches accumulated per optimizer step in stage `i`.
    pub fn accumulation(&self, i: usize) -> usize {
        self.tokens_per_step(i) / (self.train.micro_batch_size * self.stages[i].seq_len)
    }
}
