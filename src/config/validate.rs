//! The checks serde cannot express: a recipe's rules across its sections and stages (`RunConfig::validate`),
//! `[dist]`'s world / sequence-parallel / kv-head / seq-len / batch divisibility rules, `[eval]`'s window
//! and buckets. Every error names the config and the key and ends with a hint.
//!
//! Apart from the sections (`sections.rs`) because a rule often spans several of them; the batch
//! arithmetic the rules apply is `batch.rs`.
use super::batch::{rank_batching, StageBatch};
use super::sections::{Backend, Checkpointing, DataSource, DistSection, EvalSection, RunConfig};
use crate::device::ComputeDtype;
use anyhow::{anyhow, bail, Result};

impl RunConfig {
    /// Checks that serde cannot express.
    pub fn validate(&self, origin: &str) -> Result<()> {
        match (&self.model.path, &self.model.init) {
            (None, None) => bail!("{origin}: [model] needs `path` (an HF model directory) or a [model.init] table\nhint: see configs/tiny-cpu.toml for random initialization"),
            (Some(_), Some(_)) => bail!("{origin}: [model] has both `path` and [model.init]\nhint: keep one: continue from a checkpoint or initialize randomly"),
            _ => {}
        }
        if self.stages.is_empty() {
            bail!("{origin}: no [[stage]] table\nhint: add one, e.g.\n[[stage]]\nseq_len = 4096\ntokens = 1_000_000");
        }
        for (i, s) in self.stages.iter().enumerate() {
            let what = format!("{origin}: stage {i}{}", s.name.as_ref().map(|n| format!(" ({n})")).unwrap_or_default());
            match (s.tokens, s.steps) {
                (None, None) => bail!("{what} has no budget\nhint: give it `tokens = N` or `steps = N`"),
                (Some(_), Some(_)) => bail!("{what} has both `tokens` and `steps`\nhint: keep one budget"),
                (Some(0), _) | (_, Some(0)) => {
                    bail!("{what} has a zero budget\nhint: give a positive `tokens` or `steps`")
                }
                _ => {}
            }
            if s.seq_len < 2 {
                bail!("{what}: seq_len {} is too short\nhint: a training sequence needs at least 2 tokens", s.seq_len);
            }
            if let Some(lr) = s.lr {
                if !(lr.is_finite() && lr >= 0.0) {
                    bail!("{what}: lr {lr} is not a non-negative number\nhint: e.g. lr = 2e-5");
                }
            }
            // Checked: a huge or zero value must be an error, not an overflow or a division by 0.
            let Some(tokens_per_micro) = self.train.micro_batch_size.checked_mul(s.seq_len).filter(|&t| t > 0) else {
                bail!(
                    "{what}: train.micro_batch_size x seq_len = {} x {} is zero or out of range\nhint: e.g. micro_batch_size = 1",
                    self.train.micro_batch_size,
                    s.seq_len
                );
            };
            if let Some(g) = self.train.global_batch_tokens {
                if g == 0 || g % tokens_per_micro != 0 {
                    bail!(
                        "{what}: train.global_batch_tokens {g} is not a positive multiple of micro_batch_size x seq_len = {tokens_per_micro}\nhint: choose a global batch that every stage divides"
                    );
                }
            }
            if self.data.source == DataSource::Prepared && s.data.is_none() && self.data.path.is_none() {
                bail!("{what} has no dataset\nhint: set [data] path = \"DIR\" (from harpe prepare-data), `data = \"DIR\"` in the stage, or [data] source = \"builtin\"");
            }
        }
        if self.train.dtype == ComputeDtype::F16 {
            bail!("{origin}: train.dtype = \"f16\" is not supported for training (no loss scaling)\nhint: use \"bf16\" or \"f32\"");
        }
        if self.train.micro_batch_size == 0 {
            bail!("{origin}: train.micro_batch_size must be > 0\nhint: e.g. micro_batch_size = 1");
        }
        if self.train.loss_chunk_tokens == 0 {
            bail!("{origin}: train.loss_chunk_tokens must be > 0\nhint: e.g. loss_chunk_tokens = 4096");
        }
        if let Checkpointing::Every(0) = self.train.activation_checkpointing {
            bail!("{origin}: train.activation_checkpointing = {{ every = 0 }} is invalid\nhint: use \"none\", \"every-layer\" or {{ every = k }} with k >= 1");
        }
        for (k, v) in [("beta1", self.optim.beta1), ("beta2", self.optim.beta2)] {
            if !(0.0..1.0).contains(&v) {
                bail!("{origin}: optim.{k} = {v} must be in [0, 1)\nhint: the paper uses beta1 = 0.9, beta2 = 0.95");
            }
        }
        if !(self.optim.lr.is_finite() && self.optim.lr >= 0.0 && self.optim.eps > 0.0) {
            bail!("{origin}: optim.lr must be >= 0 and optim.eps > 0\nhint: e.g. lr = 2e-5, eps = 1e-8");
        }
        if let Some(e) = &self.eval {
            e.validate(origin)?;
        }
        if let Some(a) = &self.model.init {
            if a.num_hidden_layers == 0 || a.hidden_size == 0 || a.num_attention_heads == 0 || a.vocab_size == 0 {
                bail!("{origin}: [model.init] sizes must be > 0\nhint: see configs/tiny-cpu.toml");
            }
        }
        // the world-dependent rules again with the real world and model (`train` and `plan`)
        let kv_heads = self.model.init.as_ref().map(|a| a.kv_heads());
        self.dist.validate(origin, self.dist.world_size, kv_heads, &self.stage_batches())?;
        Ok(())
    }
}

impl DistSection {
    /// Range checks of the keys themselves (no world, model or stage needed); `origin` names the config.
    pub fn check_keys(&self, origin: &str) -> Result<()> {
        if !(self.bucket_mb.is_finite() && self.bucket_mb > 0.0) {
            bail!("{origin}: dist.bucket_mb = {} must be a positive size in MiB\nhint: e.g. 25", self.bucket_mb);
        }
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0) {
            bail!("{origin}: dist.timeout_s = {} must be a positive number of seconds\nhint: e.g. 600", self.timeout_s);
        }
        if self.backend == Backend::Local && self.world_size == 0 {
            bail!(
                "{origin}: dist.backend = \"local\" needs dist.world_size >= 1 (it runs that many ranks as threads; dist.world_size is not set)\nhint: add --set dist.world_size=N (e.g. 2 or 4)"
            );
        }
        if self.check_collectives && self.backend == Backend::Single {
            bail!(
                "{origin}: dist.check_collectives = true with dist.backend = \"single\": one rank has no other rank to compare its collectives with\nhint: remove the key, or run several ranks (dist.backend = \"nccl\"; \"local\" always checks)"
            );
        }
        if self.sp_degree == 0 {
            bail!("{origin}: dist.sp_degree = 0: at least one rank holds each sequence\nhint: 1 (no sequence parallelism) or a divisor of dist.world_size");
        }
        Ok(())
    }

    /// Every divisibility rule of a run of `world` ranks (0: not known yet, the launcher decides; the
    /// world-dependent rules wait for it), a model with `kv_heads` kv heads (None: not known here) and
    /// `stages`: SP divides the world, the kv heads and every seq_len; each step's sequences split
    /// evenly over the data-parallel ranks.
    pub fn validate(&self, origin: &str, world: usize, kv_heads: Option<usize>, stages: &[StageBatch]) -> Result<()> {
        self.check_keys(origin)?;
        let p = self.sp_degree;
        // (what is wrong, hint) of each SP rule that fails: all are named at once
        let mut bad: Vec<(String, String)> = vec![];
        if p > 1 && world != 0 && !world.is_multiple_of(p) {
            let lo = world / p * p;
            let near = if lo > 0 { format!("{lo} or {}", lo + p) } else { format!("{p}") };
            bad.push((
                format!("dist.sp_degree = {p} must divide dist.world_size = {world} (world size {world} is not divisible by dist.sp_degree {p}: each sequence is split over {p} ranks)"),
                format!("nearest valid world size: --gpus {near} (dist.world_size), or an SP degree that divides {world}"),
            ));
        }
        if let Some(hkv) = kv_heads.filter(|&h| p > h || !h.is_multiple_of(p)) {
            let valid: Vec<usize> = (1..=hkv).filter(|d| hkv.is_multiple_of(*d)).collect();
            let nearest = valid.iter().min_by_key(|d| d.abs_diff(p)).copied().unwrap_or(1);
            bad.push((
                format!("dist.sp_degree {p} does not divide the model's {hkv} kv heads (Ulysses gives each rank whole kv heads)"),
                format!("the nearest valid degree is {nearest}; valid: {valid:?}"),
            ));
        }
        for (i, st) in stages.iter().enumerate().filter(|(_, st)| !st.seq_len.is_multiple_of(p)) {
            bad.push((
                format!("stage {i}: seq_len {} does not split into dist.sp_degree = {p} equal parts", st.seq_len),
                format!("use a seq_len divisible by {p} (harpe does not pad sequence-parallel sequences)"),
            ));
        }
        if !bad.is_empty() {
            let what: Vec<String> = bad.iter().map(|(w, _)| format!("{origin}: {w}")).collect();
            let hints: Vec<&str> = bad.iter().map(|(_, h)| h.as_str()).collect();
            bail!("{}\nhint: {}", what.join("\n"), hints.join("; "));
        }
        let dp = world / p;
        if dp > 1 {
            for (i, st) in stages.iter().enumerate() {
                rank_batching(origin, &format!("stage {i}"), st.micro_batches, st.micro_batch, dp)?;
            }
        }
        Ok(())
    }
}

impl EvalSection {
    /// Checks serde cannot express: the window rule, buckets, sample counts. The task list is checked
    /// against the task data by `eval::tasks::check_section` (`harpe train` calls it before it writes
    /// anything): config names no module above it.
    pub fn validate(&self, origin: &str) -> Result<()> {
        if let Some(w) = self.ppl_window {
            check_window(w, self.ppl_stride.unwrap_or((w / 2).max(1)))
                .map_err(|e| anyhow!("{origin}: [eval] ppl_window/ppl_stride: {e:#}"))?;
        } else if self.ppl_stride == Some(0) {
            bail!("{origin}: [eval] ppl_stride = 0 never advances\nhint: omit it (half the window) or give 1..=ppl_window");
        }
        if !self.passkey_lengths.is_empty() && self.passkey_samples == 0 {
            bail!("{origin}: [eval] passkey_samples = 0 with passkey_lengths set\nhint: e.g. passkey_samples = 10");
        }
        if self.tasks.is_some() != self.tasks_data.is_some() {
            bail!("{origin}: [eval] tasks and tasks_data go together\nhint: e.g. tasks = \"mmlu,hellaswag\" with tasks_data = \"data/tasks\"");
        }
        check_buckets(&self.loss_buckets, "[eval] loss_buckets").map_err(|e| anyhow!("{origin}: {e:#}"))
    }
}

/// The sliding-window rule of perplexity (`eval-ppl --window/--stride`, `[eval] ppl_window/ppl_stride`;
/// `eval::ppl::windows` applies it): a window holds at least 2 tokens and the stride advances.
pub fn check_window(window: usize, stride: usize) -> Result<()> {
    if window < 2 {
        bail!("--window {window} is too small\nhint: a window needs at least 2 tokens");
    }
    if stride == 0 {
        bail!("--stride 0 never advances\nhint: pass --stride between 1 and --window ({window})");
    }
    Ok(())
}

/// Position buckets of the loss report (`eval-loss --buckets`, `[eval] loss_buckets`): positive and
/// strictly ascending.
pub fn check_buckets(buckets: &[usize], what: &str) -> Result<()> {
    if buckets.is_empty() || buckets.windows(2).any(|w| w[0] >= w[1]) || buckets[0] == 0 {
        bail!("{what} {buckets:?} must be positive and strictly ascending\nhint: e.g. {what} 4096,32768,131072");
    }
    Ok(())
}
