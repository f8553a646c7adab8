//! `Stage`: one stage of a run — its model (the run's weights with the stage's RoPE), its data (this
//! rank's slice, the cursor restored on resume) and its step arithmetic (micro-batches, targets, this
//! rank's tokens under sequence parallelism).
//!
//! The non-obvious decision: a stage boundary resets the optimizer's moments only when the recipe says
//! so (`RunConfig::stage_resets_optimizer`), and only when the stage starts fresh, never on a resume
//! inside it.
use super::batch::check_document_mask;
use super::session::{stage_dataset, Run};
use crate::comms::sequence::Ulysses;
use crate::config::rank_batching;
use crate::data::{Loader, LoaderConfig};
use crate::grads::GradAccum;
use crate::model::attention::AttentionImpl;
use crate::model::config::LlamaConfig;
use crate::model::rope::{Positions, RopeTables};
use crate::model::Llama;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::Var;
use std::sync::Arc;

/// One stage: its model (the run's weights with the stage's RoPE), data and step arithmetic.
pub(super) struct Stage {
    pub(super) si: usize,
    /// model config of this stage (its RoPE scheme), written into checkpoints
    pub(super) mc: LlamaConfig,
    pub(super) model: Llama,
    pub(super) vars: Vec<Var>,
    pub(super) tables: Vec<RopeTables>,
    pub(super) loader: Loader,
    pub(super) sources: Vec<String>,
    pub(super) grads: GradAccum,
    pub(super) steps: u64,
    pub(super) tokens_per_step: u64,
    pub(super) accum: usize,
    pub(super) bsz: usize,
    pub(super) seq_len: usize,
    /// this rank's tokens of every sequence: start..start + len (all of them without sequence parallelism)
    pub(super) tok_start: usize,
    pub(super) tok_len: usize,
    pub(super) lr_peak: f64,
    /// layers per activation-checkpointing segment
    pub(super) seg: usize,
    pub(super) targets_per_step: f64,
    pub(super) flops_tok: f64,
    pub(super) pb: Option<indicatif::ProgressBar>,
}

impl Stage {
    /// Print a line above the progress bar (or plainly without one), on rank 0 only.
    pub(super) fn say(&self, r: &Run, line: String) {
        if r.mesh.rank() != 0 {
            return;
        }
        match &self.pb {
            Some(pb) => pb.println(line),
            None => println!("{line}"),
        }
    }

    /// Build stage `si`'s model from the run's weights, open its data (restoring the cursor when the
    /// run resumes inside it), and apply the stage boundary (optimizer reset) when it starts fresh.
    pub(super) fn open(r: &mut Run, si: usize) -> Result<Stage> {
        let cfg = &r.cfg;
        let seq_len = cfg.stages[si].seq_len;
        let (steps, tokens_per_step) = cfg.stage_steps(si);
        let mut mc = r.base_cfg.clone();
        if let Some(rope) = cfg.stage_rope(si) {
            mc.rope = rope;
        }
        mc.max_position_embeddings = mc.max_position_embeddings.max(seq_len);
        mc.validate(&format!("{}: stage {si}", r.origin))?;
        // the weights as the run's sharding places them (resident, or gathered per use)
        let (model, vars) = r.sharding().stage_model(&mc)?;
        // the attention seam: `[train] attention` on this device, inside the Ulysses exchange under sequence
        // parallelism
        let local = AttentionImpl::for_train(cfg.train.attention, &r.device, cfg.train.dtype.dtype(), mc.head_dim)
            .map_err(|e| anyhow!("{}: train.attention: {e}", r.origin))?;
        let attention = match &r.sp {
            Some(g) => AttentionImpl::Custom(Arc::new(Ulysses { group: g.clone(), inner: local })),
            None => local,
        };
        check_document_mask(&r.origin, cfg.train.document_mask, &attention)?;
        let model = model.with_attention(attention);
        // this rank's tokens (all of them without sequence parallelism) at their global positions
        let (tok_start, tok_len) = (r.mesh.sp_rank * seq_len / r.mesh.sp_size, seq_len / r.mesh.sp_size);
        let tables = model.rope_tables(Positions { start: tok_start, len: tok_len, seq_len })?;
        let mut loader = open_loader(r, si)?;
        if si == r.state.stage && r.state.stage_step > 0 {
            let cursor = serde_json::from_value(r.state.data_cursor.clone())
                .map_err(|e| anyhow!("state.json: data_cursor: {e}\nhint: the checkpoint is damaged"))?;
            loader.restore(&cursor)?;
        } else {
            r.state.stage = si;
            r.state.stage_step = 0;
            if si > 0 && cfg.stage_resets_optimizer(si) {
                r.optim.reset_moments()?;
            }
        }
        r.state.rope = mc.rope.clone();
        let stage_name = format!("stage {si}");
        let (mb, steps_mb) = (cfg.train.micro_batch_size, cfg.accumulation(si));
        let (bsz, accum) = rank_batching(&r.origin, &stage_name, steps_mb, mb, r.mesh.dp_size)?;
        Ok(Stage {
            si,
            sources: loader.manifest().source_names.clone(),
            // every parameter's gradients, or only this rank's shard of them
            grads: r.sharding().grad_buffer()?,
            steps,
            tokens_per_step,
            accum,
            bsz,
            seq_len,
            tok_start,
            tok_len,
            lr_peak: cfg.stage_lr(si),
            seg: cfg.train.activation_checkpointing.segment_len(mc.num_hidden_layers),
            // the GLOBAL step's targets: each rank's gradients are partial sums of one global mean
            targets_per_step: cfg.targets_per_step(si) as f64,
            flops_tok: crate::model::flops_per_token(r.layout.total, mc.num_hidden_layers, mc.hidden_size, seq_len),
            pb: progress_bar(cfg.log.progress && r.mesh.rank() == 0, si, steps, r.state.stage_step),
            mc,
            model,
            vars,
            tables,
            loader,
        })
    }

    /// Clear the progress bar.
    pub(super) fn close(&mut self) {
        if let Some(pb) = self.pb.take() {
            pb.finish_and_clear();
        }
    }
}

/// The dataset loader of stage `si` for this rank's data-parallel slice, checked against the tokenizer.
fn open_loader(r: &Run, si: usize) -> Result<Loader> {
    // rank 0 prepares a built-in dataset first; the others then find it
    let first =
        if r.mesh.rank() == 0 { stage_dataset(&r.cfg, si, &r.run_dir, &r.tokenizer).map(Some) } else { Ok(None) };
    if !r.comm.all_ok(first.is_ok())? {
        first?;
        bail!("stage {si}: rank 0 could not prepare the dataset");
    }
    let data_dir = match first? {
        Some(d) => d,
        None => stage_dataset(&r.cfg, si, &r.run_dir, &r.tokenizer)?,
    };
    let lcfg = LoaderConfig {
        seq_len: r.cfg.stages[si].seq_len,
        shuffle: r.cfg.data.shuffle,
        seed: r.cfg.train.seed,
        rank: r.mesh.dp_rank,
        world_size: r.mesh.dp_size,
    };
    let loader =
        Loader::open(&data_dir, lcfg).with_context(|| format!("stage {si}: opening dataset {}", data_dir.display()))?;
    let sha = &loader.manifest().tokenizer_sha256;
    if *sha != r.tok_sha {
        bail!(
            "stage {si}: dataset {} was tokenized with another tokenizer (sha256 {}) than {} ({})\nhint: prepare the data with the model's tokenizer.json",
            data_dir.display(),
            &sha[..12.min(sha.len())],
            r.tokenizer.display(),
            &r.tok_sha[..12]
        );
    }
    Ok(loader)
}

fn progress_bar(enabled: bool, stage: usize, steps: u64, pos: u64) -> Option<indicatif::ProgressBar> {
    if !enabled {
        return None;
    }
    let pb = indicatif::ProgressBar::new(steps);
    let style = indicatif::ProgressStyle::with_template(&format!(
        "stage {stage} [{{bar:30}}] {{pos}}/{{len}} steps, {{elapsed_precise}} elapsed, ETA {{eta_precise}}"
    ))
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    pb.set_style(style);
    pb.set_position(pos);
    Some(pb)
}
