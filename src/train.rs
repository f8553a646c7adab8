//! `harpe train`: THE training loop. `run` reads as the loop itself: open the run, then for every stage
//! `Stage::open`, and for every step `train_step` (data -> model -> chunked loss -> layer-wise backward
//! -> gradient all-reduce -> clip -> AdamW on this rank's fp32 shard -> all-gather + write-back),
//! `log_step`, `check_bad_streak`, `maybe_evaluate` (`[eval]`), `maybe_checkpoint`; a single `finish` at the end, also on a signal.
//!
//! Reference: llm.c `train_gpt2.cu` "TRAINING SECTION" (one straight loop), HARPE §4 and spec §3
//! (multi-stage ABF, constant lr 2e-5, AdamW 0.9/0.95), Chen et al. 2016 (activation checkpointing).
//! The non-obvious decisions:
//! - Activation checkpointing is done here, by hand, on top of candle's autograd: the forward keeps only
//!   the input of every segment of k layers (detached), then the backward walks the segments from the
//!   last to the first, recomputing each one from a fresh `Var` of its input and back-propagating
//!   `sum(out * grad_out)`, whose gradient is exactly `grad_out`. The last segment keeps its graph from
//!   the forward, so "none" (one segment) never recomputes anything.
//! - Loss is token-mean over all target tokens of the optimizer step, so each micro-batch's nll sum is
//!   scaled by 1 / (tokens of the whole step): k micro-batches give the gradient of one k-times batch.
//! - Weights the model computes with are candle `Var`s in the compute dtype; the optimizer owns fp32
//!   master weights and moments of its shard (`FlatBuf`s); after each update the shards are all-gathered
//!   bucket by bucket in the compute dtype straight into every parameter's `Var` (`zero::publish`), and
//!   a stage's model is built the same way from the master shards (`zero::gather_params`): no rank keeps
//!   a full fp32 copy of the weights beside the compute weights.
//! - The communicator comes from `[dist]`: `run` starts `dist.world_size` rank threads for `local`, each
//!   running `run_rank`, the same loop; with one rank every collective is a no-op. `plan_check` runs
//!   `harpe plan`'s arithmetic first and refuses a CPU run that cannot fit (unless `--force`). Rank 0
//!   alone writes the run directory and evaluates. ZeRO changes only where parameters and gradients live
//!   (`Params`: resident Vars and a full gradient buffer for 0-1; per-layer reduce-scatter into a
//!   gradient shard for 2; layers also gathered before each use for 3), never the order of the loop.
//! - Sequence parallelism (`dist.sp_degree` = P): the P ranks of a group read the same sequences; each
//!   computes tokens sp_rank*T/P.. with RoPE tables at those global positions, attention goes through
//!   the Ulysses exchange (`comms::sequence`), and the loss counts each rank's own targets, so the
//!   gradient sum over all ranks is the one-rank gradient.
//! - A sequence of T tokens trains T-1 targets (token t+1 from tokens <= t); the last position is ignored.
//! - `train.document_mask` (default off: Fu et al. train without it): each micro-batch's document starts
//!   (`Sequence::doc_starts`, from the dataset's segment table) become a `DocStarts` of the WHOLE sequences,
//!   passed to every layer's attention in the forward and in every recompute (ZeRO-3 included); under
//!   Ulysses each rank builds the same global one. RoPE positions stay the packed ones.
//!
//! What this file does not do: the NCCL backend (comms/ refuses it for now); the evaluation rules
//! (eval/in_training.rs calls them).
use crate::checkpoint::{self, TrainState};
use crate::comms::launch::{launch_if_asked, rank_batching, BackendKind};
use crate::comms::local::{spawn_local, LocalComm, LocalGroup};
use crate::comms::sequence::{SpGroup, Ulysses};
use crate::comms::zero::{self, ShardMap, Split, ZeroShards};
use crate::comms::{Comm, Mesh};
use crate::config::{DataSource, RunConfig};
use crate::data::loader::source_name;
use crate::data::{
    builtin_texts, prepare_from_texts, tokenizer_sha256, Loader, LoaderConfig, PrepareOptions, Sequence,
};
use crate::eval::in_training::{eval_line, TrainEval};
use crate::flatbuf::{FlatBuf, Placement};
use crate::grads::{self, GradAccum, ParamLayout};
use crate::loss::{chunked_cross_entropy, IGNORE_INDEX};
use crate::metrics::{self, mem, MetricsLog, StepRecord};
use crate::model::attention::AttentionImpl;
use crate::model::config::LlamaConfig;
use crate::model::llama::{layer_param_name, rms_norm, LayerWeights, EMBED_TOKENS, FINAL_NORM, LAYER_PARAMS, LM_HEAD};
use crate::model::rope::RopeTables;
use crate::model::weights::{init_flat, load_flat, save_model_dir};
use crate::model::Llama;
use crate::ops::attention::DocStarts;
use crate::optim::adamw::{AdamW, AdamWHyper};
use crate::optim::schedule::Schedule;
use crate::tensorboard::{self, TbWriter};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// `harpe train`: single- or multi-stage continual pretraining from a TOML recipe.
#[derive(clap::Args, Debug, Clone)]
pub struct TrainArgs {
    /// TOML recipe: [model] [data] [rope] [train] [optim] [schedule] [checkpoint] [dist] [log] and
    /// [[stage]] tables (see configs/tiny-cpu.toml)
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// run directory for config.toml, metrics.jsonl, loss.png and checkpoints/
    /// [default: runs/<config file name without .toml>]
    #[arg(long, value_name = "RUN_DIR")]
    pub out: Option<PathBuf>,
    /// stop after N optimizer steps in total (steps of a resumed run count) and write a final checkpoint
    #[arg(long, value_name = "N")]
    pub steps: Option<u64>,
    /// continue bit-identically from the newest complete checkpoint in the run directory
    /// (starts from scratch when there is none)
    #[arg(long)]
    pub resume: bool,
    /// override one config value, e.g. --set optim.lr=1e-5 or --set stage.0.steps=10 (repeatable)
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// use a run directory that already belongs to a different config (replaces its config.toml);
    /// also start a run that `harpe plan` says will not fit
    #[arg(long)]
    pub force: bool,
    /// start N worker processes (one per GPU, dist.backend = "nccl"); needs a build with
    /// --features nccl. On CPU use --set dist.backend=local --set dist.world_size=N instead
    #[arg(long, value_name = "N")]
    pub nproc_per_node: Option<usize>,
    /// test knob: keep the training state (weights, AdamW, gradients) in the device variant of
    /// `FlatBuf` even on the CPU, so the GPU path's candle-op logic runs and can be compared with the
    /// host path there (a CUDA run always uses it)
    #[arg(long, hide = true)]
    pub device_resident_state: bool,
    /// attention: harpe's kernels only (candle-flash, the eval commands' other choice, has no backward)
    #[arg(long, value_enum, default_value = "harpe")]
    pub attention: crate::model::attention::AttentionChoice,
}

impl TrainArgs {
    /// The arguments of `harpe train --config CONFIG [--out OUT]` with every other flag at its default.
    pub fn new(config: &Path, out: Option<&Path>) -> TrainArgs {
        TrainArgs {
            config: config.to_path_buf(),
            out: out.map(Path::to_path_buf),
            steps: None,
            resume: false,
            set: vec![],
            force: false,
            nproc_per_node: None,
            device_resident_state: false,
            attention: crate::model::attention::AttentionChoice::Harpe,
        }
    }

    /// The run directory: `--out`, else `runs/<config file name without .toml>`.
    pub fn run_dir(&self) -> PathBuf {
        self.out.clone().unwrap_or_else(|| {
            let stem = self.config.file_stem().map(|s| s.to_string_lossy().to_string());
            PathBuf::from("runs").join(stem.unwrap_or_else(|| "run".into()))
        })
    }
}

/// What one micro-batch's forward/backward produced.
pub struct MicroOut {
    /// per-position nll (B*T) f32 on the model's device, 0 at ignored positions
    pub nll: Tensor,
}

/// Forward and backward of one micro-batch with activation checkpointing every `seg` layers; adds
/// `scale * d(sum nll)/d(param)` into `grads`. ids (B, T) u32, targets (B*T) u32 (IGNORE_INDEX skips),
/// `tables[l]` the RoPE tables of layer l (or one shared table). Every parameter is the model's own
/// `Var` (`vars`, layout order); ZeRO-3 calls `forward_backward_with` instead.
#[allow(clippy::too_many_arguments)]
pub fn forward_backward(
    model: &Llama,
    vars: &[Var],
    layout: &ParamLayout,
    tables: &[RopeTables],
    ids: &Tensor,
    targets: &Tensor,
    seg: usize,
    loss_chunk: usize,
    scale: f64,
    grads: &mut GradAccum,
) -> Result<MicroOut> {
    let mut params = Params::Resident { vars, layout, grads };
    forward_backward_with(model, &mut params, tables, ids, targets, None, seg, loss_chunk, scale)
}

/// Where `forward_backward_with` takes the parameters from and puts their gradients.
pub enum Params<'a> {
    /// every parameter resident in the model as `vars` (layout order, ZeRO 0-1); gradients added into
    /// the full-length `grads`
    Resident { vars: &'a [Var], layout: &'a ParamLayout, grads: &'a mut GradAccum },
    /// ZeRO-2: parameters resident (`vars`); each group's gradients reduce-scattered into this rank's
    /// shard as soon as the backward that produced them is done
    ShardedGrads { vars: &'a [Var], z: ZeroShards<'a> },
    /// ZeRO-3: each group also gathered right before use and dropped after
    Sharded(ZeroShards<'a>),
}

/// A parameter group whose gradients are handed on (ZeRO 2-3): layout indices and their `Var`s, which
/// (ZeRO-3) keep the gathered weights alive while their graph is.
type Held = (Range<usize>, Vec<Var>);

impl Params<'_> {
    /// Decoder layer `l`'s weights and, ZeRO 2-3, the group whose gradients go to the shards. `next`:
    /// the layer gathered after this one (ZeRO-3 starts its gather now, `ZeroShards::prefetch`).
    fn layer(&self, model: &Llama, l: usize, next: Option<usize>) -> Result<(LayerWeights, Option<Held>)> {
        match self {
            Params::Resident { .. } => Ok((model.layers[l].clone(), None)),
            Params::ShardedGrads { vars, z } => {
                let idx = layer_param_indices(z.layout, l)?;
                Ok((model.layers[l].clone(), Some((idx.clone(), vars[idx].to_vec()))))
            }
            Params::Sharded(z) => {
                let idx = layer_param_indices(z.layout, l)?;
                let label = next.map(|n| format!("layer {n} weights")).unwrap_or_default();
                let next = match next {
                    Some(n) => Some((layer_param_indices(z.layout, n)?, label.as_str())),
                    None => None,
                };
                let vars = z.gather(idx.clone(), &format!("layer {l} weights"), next)?;
                let t: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
                let arr: [Tensor; 9] = t.try_into().map_err(|_| anyhow!("internal: layer {l} has not 9 parameters"))?;
                Ok((LayerWeights::from_array(arr), Some((idx, vars))))
            }
        }
    }

    /// (embedding, final norm, head) for one micro-batch, and (ZeRO 2-3) their groups in that order
    /// (the head's only when untied).
    fn outer(&self, model: &Llama) -> Result<(Tensor, Tensor, Tensor, Vec<Held>)> {
        let resident = (model.embed_tokens.clone(), model.norm.clone(), model.lm_head.clone());
        let groups = |layout: &ParamLayout| -> Result<Vec<Range<usize>>> {
            let mut names = vec![EMBED_TOKENS, FINAL_NORM];
            if !model.cfg.tie_word_embeddings {
                names.push(LM_HEAD);
            }
            names.iter().map(|n| param_index(layout, n).map(|i| i..i + 1)).collect()
        };
        match self {
            Params::Resident { .. } => Ok((resident.0, resident.1, resident.2, vec![])),
            Params::ShardedGrads { vars, z } => {
                let held = groups(z.layout)?.into_iter().map(|i| (i.clone(), vars[i].to_vec())).collect();
                Ok((resident.0, resident.1, resident.2, held))
            }
            Params::Sharded(z) => {
                let held: Vec<Held> = groups(z.layout)?
                    .into_iter()
                    .map(|i| Ok((i.clone(), z.gather(i.clone(), &z.layout.params[i.start].name, None)?)))
                    .collect::<Result<_>>()?;
                let t = |h: &Held| h.1[0].as_tensor().clone();
                let head = held.get(2).map(t).unwrap_or_else(|| t(&held[0]));
                Ok((t(&held[0]), t(&held[1]), head, held))
            }
        }
    }

    /// Join the gradient exchanges still running (ZeRO 2-3 over NCCL): the shard is complete after this.
    fn finish(&mut self) -> Result<()> {
        match self {
            Params::Resident { .. } => Ok(()),
            Params::ShardedGrads { z, .. } | Params::Sharded(z) => z.finish(),
        }
    }

    /// Take the gradients `store` holds: resident, every parameter's; ZeRO 2-3, those of `held`.
    fn take_grads(&mut self, store: &GradStore, held: &[&Held]) -> Result<()> {
        let z = match self {
            Params::Resident { vars, layout, grads } => return grads.add_from(layout, vars, store),
            Params::ShardedGrads { z, .. } | Params::Sharded(z) => z,
        };
        for (idx, vars) in held {
            z.scatter_grads(idx.clone(), vars, store, "grads")?;
        }
        Ok(())
    }
}

/// Index of parameter `name` in `layout`.
fn param_index(layout: &ParamLayout, name: &str) -> Result<usize> {
    layout
        .params
        .iter()
        .position(|p| p.name == name)
        .ok_or_else(|| anyhow!("internal: no parameter {name} in the layout"))
}

/// Layout indices of decoder layer `l`'s parameters (consecutive, `LAYER_PARAMS` order).
fn layer_param_indices(layout: &ParamLayout, l: usize) -> Result<Range<usize>> {
    let i = param_index(layout, &layer_param_name(l, LAYER_PARAMS[0]))?;
    let idx = i..i + LAYER_PARAMS.len();
    let ok = layout
        .params
        .get(idx.clone())
        .is_some_and(|ps| ps.iter().zip(LAYER_PARAMS).all(|(p, n)| p.name == layer_param_name(l, n)));
    if !ok {
        bail!("internal: layer {l}'s parameters are not consecutive in the layout");
    }
    Ok(idx)
}

/// `forward_backward` over any `Params`: the forward keeps only the (detached) input of every segment
/// of `seg` layers (the last one keeps its graph), the backward recomputes each earlier segment from
/// its input. Under ZeRO-3 a layer is gathered for the forward and again for the recompute, and every
/// backward hands its gradients on at once; the collectives run in the same order on every rank.
/// `docs`: the document mask of every layer (forward and recompute), for the whole sequences.
#[allow(clippy::too_many_arguments)]
pub fn forward_backward_with(
    model: &Llama,
    params: &mut Params,
    tables: &[RopeTables],
    ids: &Tensor,
    targets: &Tensor,
    docs: Option<&DocStarts>,
    seg: usize,
    loss_chunk: usize,
    scale: f64,
) -> Result<MicroOut> {
    let (b, t) = ids.dims2()?;
    let c = model.cfg.hidden_size;
    let n_layers = model.cfg.num_hidden_layers;
    let table = |l: usize| &tables[l.min(tables.len() - 1)];
    let segments: Vec<(usize, usize)> =
        (0..n_layers).step_by(seg.max(1)).map(|s| (s, (s + seg).min(n_layers))).collect();
    // `after`: the layer gathered after the segment's last one (the next segment's first in the
    // forward; in the backward the first of the segment recomputed next), for ZeRO-3's prefetch
    let run_segment = |params: &Params,
                       x: &Tensor,
                       (lo, hi): (usize, usize),
                       after: Option<usize>,
                       held: &mut Vec<Held>|
     -> Result<Tensor> {
        let mut x = x.clone();
        for l in lo..hi {
            let (w, h) = params.layer(model, l, if l + 1 < hi { Some(l + 1) } else { after })?;
            x = model.layer_forward_with(l, &w, &x, table(l), None, docs)?; // (B, T, C)
            held.extend(h);
        }
        Ok(x)
    };
    let (embed, norm, head, outer) = params.outer(model)?;

    // Forward: keep only the (detached) input of every segment; the last one keeps its graph.
    let x0 = model.embed_with(&embed, ids)?; // (B, T, C), graph into embed_tokens
    let mut saved: Vec<Tensor> = Vec::with_capacity(segments.len()); // segment inputs (B, T, C)
    let mut x = x0.detach();
    // the first layer of segment i (the one gathered after the previous segment)
    let first = |i: Option<usize>| i.and_then(|i| segments.get(i)).map(|s| s.0);
    let n_seg = segments.len();
    for (i, &s) in segments[..n_seg - 1].iter().enumerate() {
        saved.push(x.clone());
        x = run_segment(params, &x, s, first(Some(i + 1)), &mut vec![])?.detach();
        // gathered weights freed here
    }
    let last_in = Var::from_tensor(&x)?;
    let mut held = vec![];
    // after the last segment comes the recompute of the one before it
    let y = run_segment(params, last_in.as_tensor(), segments[n_seg - 1], first(n_seg.checked_sub(2)), &mut held)?; // (B, T, C)
    let h = rms_norm(&y, &norm, model.cfg.rms_norm_eps)?.reshape((b * t, c))?; // (B*T, C)
    let nll = chunked_cross_entropy(&h, &head, targets, loss_chunk)?; // (B*T)
    let store = (nll.sum_all()? * scale)?.backward()?;
    // the head (the embedding when tied) and the final norm, then the last segment's layers
    let head_groups: Vec<&Held> =
        outer.iter().skip(1).chain(if model.cfg.tie_word_embeddings { outer.first() } else { None }).collect();
    params.take_grads(&store, &held.iter().chain(head_groups).collect::<Vec<_>>())?;
    drop(held);
    let mut g =
        store.get(last_in.as_tensor()).cloned().ok_or_else(|| anyhow!("no gradient reached the last layers"))?;
    let nll = nll.detach(); // (B*T), stays on the device (`LossSums`)
    drop(store);

    // Backward through the earlier segments, last to first, recomputing each from its saved input.
    for (i, &s) in segments[..n_seg - 1].iter().enumerate().rev() {
        let xin = Var::from_tensor(&saved[i])?;
        let mut held = vec![];
        let y = run_segment(params, xin.as_tensor(), s, first(i.checked_sub(1)), &mut held)?; // (B, T, C)
        let store = (y * g.detach())?.sum_all()?.backward()?;
        params.take_grads(&store, &held.iter().collect::<Vec<_>>())?;
        g = store.get(xin.as_tensor()).cloned().ok_or_else(|| anyhow!("no gradient reached layer {}", s.0))?;
        saved.truncate(i);
    }
    let store = (x0 * g.detach())?.sum_all()?.backward()?;
    params.take_grads(&store, &outer.first().into_iter().collect::<Vec<_>>())?;
    params.finish()?;
    Ok(MicroOut { nll })
}

/// RoPE tables for positions 0..t of every layer (one shared table unless layers differ).
pub fn rope_tables(model: &Llama, t: usize) -> Result<Vec<RopeTables>> {
    rope_tables_at(model, 0, t, t)
}

/// RoPE tables for the global positions start..start+len of sequences of `total` tokens (a
/// sequence-parallel rank's part; `total` decides dynamic schemes), every layer or one shared.
pub fn rope_tables_at(model: &Llama, start: usize, len: usize, total: usize) -> Result<Vec<RopeTables>> {
    let c = &model.cfg;
    let n = if c.rope.per_layer() { c.num_hidden_layers } else { 1 };
    (0..n).map(|l| c.rope.tables(c.head_dim, l, start, len, total, model.parity, model.device())).collect()
}

/// An error naming `train.document_mask` when it is on and `attention` cannot apply a document mask.
pub fn check_document_mask(origin: &str, on: bool, attention: &AttentionImpl) -> Result<()> {
    if on && !attention.supports_document_mask() {
        bail!(
            "{origin}: train.document_mask = true, but the attention {attention:?} cannot apply a document mask\nhint: set train.document_mask = false"
        );
    }
    Ok(())
}

/// The document starts of a batch's sequences (`Sequence::doc_starts`; a sequence that opens inside a
/// document has that piece as its first document).
pub fn doc_starts(seqs: &[Sequence], device: &Device) -> Result<DocStarts> {
    let t = seqs.first().map(|s| s.tokens.len()).unwrap_or(0);
    let starts: Vec<&[usize]> = seqs.iter().map(|s| s.doc_starts.as_slice()).collect();
    Ok(DocStarts::from_starts(&starts, t, device)?)
}

/// Input ids (B, T) and shifted targets (B*T, last position of each sequence ignored) of sequences,
/// every id checked against the model's vocabulary `vocab` here, while it is host data: an id >= V would
/// read past the embedding on CUDA and poison the loss (the loss checks ids only on the CPU).
pub fn batch_tensors(seqs: &[&[u32]], vocab: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let b = seqs.len();
    let t = seqs.first().map(|s| s.len()).unwrap_or(0);
    let mut ids = Vec::with_capacity(b * t);
    let mut tg = Vec::with_capacity(b * t);
    for (row, s) in seqs.iter().enumerate() {
        if s.len() != t {
            bail!("sequences of one batch differ in length ({} vs {t})", s.len());
        }
        if let Some((pos, &id)) = s.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            bail!(
                "batch row {row}, position {pos}: token id {id} is outside the model's vocabulary of {vocab}\nhint: the data was tokenized with a different tokenizer than the model's vocabulary; re-run prepare-data with the model's tokenizer.json"
            );
        }
        ids.extend_from_slice(s);
        tg.extend_from_slice(&s[1..]);
        tg.push(IGNORE_INDEX);
    }
    Ok((Tensor::from_vec(ids, (b, t), device)?, Tensor::from_vec(tg, b * t, device)?))
}

/// A model whose parameters are `Var`s in the compute dtype, built from `weights`: ALL parameters, fp32,
/// over the whole flat space (the gathered weights, never one rank's shard).
pub fn trainable_model(
    cfg: &LlamaConfig,
    layout: &ParamLayout,
    weights: &FlatBuf,
    dtype: DType,
    device: &Device,
) -> Result<(Llama, Vec<Var>)> {
    if weights.len() != layout.total {
        bail!("internal: a model needs all {} parameters, got a buffer of {}", layout.total, weights.len());
    }
    let named = layout
        .params
        .iter()
        .map(|p| Ok((p.name.clone(), weights.param_tensor(p.range.clone(), &p.shape, dtype, device)?)))
        .collect::<Result<_>>()?;
    trainable_model_from(cfg, layout, named)
}

/// `trainable_model` from every parameter as a named tensor in the compute dtype (`zero::gather_params`).
pub fn trainable_model_from(
    cfg: &LlamaConfig,
    layout: &ParamLayout,
    named: Vec<(String, Tensor)>,
) -> Result<(Llama, Vec<Var>)> {
    let (model, named) =
        Llama::from_tensors(cfg.clone(), named.into_iter().collect(), "training weights")?.into_trainable()?;
    if named.len() != layout.params.len() || named.iter().zip(&layout.params).any(|((n, _), p)| *n != p.name) {
        bail!("internal: the model's parameter order differs from the optimizer layout");
    }
    Ok((model, named.into_iter().map(|(_, v)| v).collect()))
}

/// The run's model architecture, parameter layout and initial fp32 weights (HF order) with placement
/// `p`: a checkpoint streams from its memory map into the buffer one tensor at a time (`load_flat`: on a
/// GPU straight to the device, host memory far below the model size); a random init is drawn piece by piece
/// straight into it (`init_flat`: the same values for a seed on every device).
fn initial_model(cfg: &RunConfig, origin: &str, p: &Placement) -> Result<(LlamaConfig, ParamLayout, FlatBuf)> {
    if let Some(dir) = &cfg.model.path {
        let mut mc = LlamaConfig::from_file(&dir.join("config.json"))?;
        mc.validate(&dir.join("config.json").display().to_string())?;
        let (layout, flat) = load_flat(dir, &mc, p)?;
        return Ok((mc, layout, flat));
    }
    let a = cfg.model.init.as_ref().ok_or_else(|| anyhow!("{origin}: [model] has neither path nor init"))?;
    let rope = cfg.initial_rope().ok_or_else(|| {
        anyhow!("{origin}: a randomly initialized model needs a RoPE scheme\nhint: add a [rope] table, e.g. scheme = \"default\", theta = 10000.0")
    })?;
    let mut mc = LlamaConfig::tiny(a.vocab_size, rope);
    mc.hidden_size = a.hidden_size;
    mc.intermediate_size = a.intermediate_size;
    mc.num_hidden_layers = a.num_hidden_layers;
    mc.num_attention_heads = a.num_attention_heads;
    mc.num_key_value_heads = a.kv_heads();
    mc.head_dim = a.head_dim();
    mc.max_position_embeddings = a.max_position_embeddings;
    mc.rms_norm_eps = a.rms_norm_eps;
    mc.tie_word_embeddings = a.tie_word_embeddings;
    mc.initializer_range = a.initializer_range;
    mc.validate(&format!("{origin} [model.init]"))?;
    let (layout, flat) = init_flat(&mc, cfg.train.seed, p)?; // straight into the training state's placement
    Ok((mc, layout, flat))
}

/// Make sure the run directory exists, is writable, and belongs to this config (unless `force`).
fn prepare_run_dir(dir: &Path, toml: &str, hash: &str, force: bool) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create run directory {}\nhint: choose a writable --out", dir.display()))?;
    let probe = dir.join(".write-test");
    std::fs::write(&probe, b"ok")
        .with_context(|| format!("run directory {} is not writable\nhint: choose a writable --out", dir.display()))?;
    let _ = std::fs::remove_file(&probe);
    let cfg_path = dir.join("config.toml");
    if cfg_path.exists() && !force {
        let old = std::fs::read_to_string(&cfg_path).with_context(|| format!("cannot read {}", cfg_path.display()))?;
        let old_hash = results_hash(&old)?;
        if old_hash != hash {
            bail!(
                "{} belongs to a run with a different config (config hash {} != {})\nhint: use another --out, or pass --force to reuse the directory",
                dir.display(),
                &old_hash[..12],
                &hash[..12]
            );
        }
    }
    crate::util::write_atomic(&cfg_path, toml.as_bytes())
}

/// The hash that guards a run directory and its resume: sha256 of the resolved TOML without its
/// `[dist]` table, whose keys (backend, world size, ZeRO stage, buckets, timeout) change how the run is
/// computed, never its results, so a checkpoint continues on another world size.
pub fn results_hash(toml_text: &str) -> Result<String> {
    let mut t: toml::Table = toml_text.parse().map_err(|e: toml::de::Error| {
        anyhow!("config.toml: {}\nhint: the run directory's config.toml is damaged", e.to_string().trim_end())
    })?;
    t.remove("dist");
    Ok(crate::util::sha256_hex(toml::to_string(&t)?.as_bytes()))
}

/// The dataset directory of stage `i`, preparing the built-in one on first use.
fn stage_dataset(cfg: &RunConfig, i: usize, run_dir: &Path, tokenizer: &Path) -> Result<PathBuf> {
    let s = &cfg.stages[i];
    if let Some(d) = s.data.as_ref().or(cfg.data.path.as_ref()) {
        if cfg.data.source == DataSource::Prepared || s.data.is_some() {
            return Ok(d.clone());
        }
    }
    let dir = run_dir.join("data").join(format!("builtin_T{}", s.seq_len));
    if !dir.join("manifest.json").exists() {
        let mut opts = PrepareOptions::new(s.seq_len);
        opts.seed = cfg.train.seed;
        prepare_from_texts(&builtin_texts(cfg.train.seed), tokenizer, &opts, &dir)
            .with_context(|| format!("preparing the built-in dataset in {}", dir.display()))?;
    }
    Ok(dir)
}

/// Resolve the tokenizer file of the run (the built-in byte tokenizer is written into the run dir).
fn tokenizer_path(cfg: &RunConfig, run_dir: &Path) -> Result<PathBuf> {
    if let Some(t) = &cfg.model.tokenizer {
        return Ok(t.clone());
    }
    if let Some(d) = &cfg.model.path {
        return Ok(d.join("tokenizer.json"));
    }
    let p = run_dir.join("tokenizer.json");
    crate::util::write_atomic(&p, crate::model::testing::byte_tokenizer_json().as_bytes())?;
    Ok(p)
}

/// Run `harpe train`: one rank in this thread (`single`), or `dist.world_size` rank threads sharing a
/// `Local` group (`local`), each running the same loop on its slice of every global batch.
pub fn run(args: TrainArgs) -> Result<()> {
    crate::model::attention::refuse_for_training(args.attention)?;
    let origin = args.config.display().to_string();
    let cfg = RunConfig::load(&args.config, &args.set)?.cfg;
    let dist = cfg.dist.dist_config(&origin)?;
    if let Some(n) = args.nproc_per_node {
        return spawn_nccl_workers(&origin, n, dist.backend);
    }
    plan_check(&cfg, &origin, &dist, args.force)?;
    match dist.backend {
        BackendKind::Local => {
            let world = dist.world_size.max(1);
            let sp = cfg.dist.sp_degree.max(1);
            // one more Local group per sequence-parallel group (ranks d*P..(d+1)*P) for the all-to-alls
            let mut sp_handles: Vec<Option<LocalComm>> = vec![];
            if sp > 1 {
                for _ in 0..world / sp {
                    sp_handles.extend(LocalGroup::new(sp, dist.timeout())?.handles().into_iter().map(Some));
                }
            }
            let sp_handles = std::sync::Mutex::new(sp_handles);
            let rank_main = |lc: Arc<LocalComm>| {
                let taken = sp_handles
                    .lock()
                    .map_err(|_| anyhow!("internal: poisoned lock"))?
                    .get_mut(lc.rank())
                    .and_then(Option::take);
                let group = taken.map(|h| SpGroup::Local(Arc::new(h)));
                let res = run_rank(&args, Comm::Local(lc, sp), group.clone());
                if let (Err(e), Some(g)) = (&res, &group) {
                    g.abort(&format!("returned an error: {e:#}")); // its sequence-parallel peers stop too
                }
                res
            };
            spawn_local(world, dist.timeout(), rank_main).map_err(|e| {
                anyhow!(
                    "{e}\nhint: the error of the rank that failed first is the cause; the others stopped because of it"
                )
            })?;
            Ok(())
        }
        BackendKind::Single => run_rank(&args, Comm::from_config(&cfg.dist, &origin)?, None),
        BackendKind::Nccl => run_nccl_rank(&args, &cfg, &origin, &dist),
    }
}

/// One process of an NCCL group (started by `--nproc-per-node`, torchrun or srun; alone it is a group
/// of one): join the group, run the loop, and tell the group how it ended — a normal end, or this
/// rank's error or panic, so the other ranks stop naming it instead of waiting for the timeout.
#[cfg(feature = "nccl")]
fn run_nccl_rank(
    args: &TrainArgs,
    cfg: &RunConfig,
    origin: &str,
    dist: &crate::comms::launch::DistConfig,
) -> Result<()> {
    use crate::comms::launch::{free_port, LaunchEnv, LaunchSource};
    use crate::comms::nccl::NcclComm;
    let placed = dist.place(origin, LaunchEnv::from_env()?)?;
    let env = match placed.launch {
        Some(env) => env,
        None => LaunchEnv {
            source: LaunchSource::Torchrun,
            rank: 0,
            world_size: 1,
            local_rank: match cfg.train.device {
                crate::device::DeviceSpec::Cuda(n) => n,
                crate::device::DeviceSpec::Cpu => 0,
            },
            local_world_size: Some(1),
            master_addr: "127.0.0.1".into(),
            master_port: free_port("127.0.0.1")?,
            run_token: "single".into(),
        },
    };
    let resolved = RunConfig::load(&args.config, &args.set)?.toml;
    let comm = Arc::new(
        NcclComm::join(&env, &resolved, dist.timeout(), cfg.dist.sp_degree.max(1))
            .with_context(|| format!("{origin}: joining the NCCL group as rank {} of {}", env.rank, env.world_size))?,
    );
    let sp = (cfg.dist.sp_degree > 1).then(|| SpGroup::Nccl(Arc::clone(&comm)));
    let res =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_rank(args, Comm::Nccl(Arc::clone(&comm)), sp)));
    match res {
        Ok(Ok(())) => {
            comm.finish();
            Ok(())
        }
        Ok(Err(e)) => match comm.failure() {
            // another rank failed first: its failure is the cause of this error
            Some(f) if f.rank != comm.rank() => Err(e.context(format!(
                "{f}\nhint: rank {} failed first; this rank stopped because of it (its own log says more)",
                f.rank
            ))),
            _ => {
                comm.report_failure("in the training loop", &format!("{e:#}"));
                Err(e)
            }
        },
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".into());
            comm.report_failure("in the training loop", &format!("panicked: {msg}"));
            std::panic::resume_unwind(panic)
        }
    }
}

#[cfg(not(feature = "nccl"))]
fn run_nccl_rank(
    _args: &TrainArgs,
    _cfg: &RunConfig,
    origin: &str,
    dist: &crate::comms::launch::DistConfig,
) -> Result<()> {
    dist.place(origin, None)?; // refuses: this build has no NCCL
    bail!("{origin}: dist.backend = \"nccl\" needs a build with --features nccl")
}

/// `harpe plan` before any work: refuse (unless `--force`) a CPU run whose peak memory per rank, as the
/// plan computes it for this config, ZeRO stage and SP degree, does not fit this machine's memory
/// shared by the `Local` ranks. GPU runs are planned with `harpe plan --gpu ...` (the device's memory
/// is not queried here yet).
fn plan_check(cfg: &RunConfig, origin: &str, dist: &crate::comms::launch::DistConfig, force: bool) -> Result<()> {
    use crate::device::DeviceSpec;
    use crate::plan::{plan_for, Gpu, GpuKind, World};
    let ranks = dist.world_size.max(1);
    // ranks that share one device's memory: threads of one process (the host, or one GPU under `local`)
    let sharing = if dist.backend == BackendKind::Nccl { 1 } else { ranks };
    let (mut gpu, what) = match cfg.train.device {
        DeviceSpec::Cpu => (Gpu::new(GpuKind::Cpu), "this machine".to_string()),
        DeviceSpec::Cuda(_) => {
            let Some(m) = crate::device::device_memory(&cfg.train.device, &format!("{origin}: train.device"))? else {
                return Ok(());
            };
            let (gpu, _) = Gpu::measured(&m);
            let what = format!(
                "{} ({:.1} of {:.1} GiB free)",
                m.name,
                m.free as f64 / (1u64 << 30) as f64,
                m.total as f64 / (1u64 << 30) as f64
            );
            (gpu, what)
        }
    };
    gpu.mem_bytes /= sharing as u64;
    let world = World { gpus: ranks, zero_stage: dist.zero_stage, sp_degree: cfg.dist.sp_degree.max(1) };
    let plan = plan_for(cfg, &world, &gpu).with_context(|| format!("{origin}: planning the run (harpe plan)"))?;
    if plan.fits || force {
        return Ok(());
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    bail!(
        "{origin}: the run needs {:.2} GiB per rank at its peak (stage {}), more than the {:.2} GiB each of {sharing} rank(s) can use on {what}\nhint: see `harpe plan --config {origin}` for the terms (ZeRO-3, activation checkpointing and shorter stages shrink them); pass --force to start anyway",
        gib(plan.total_bytes),
        plan.stage,
        gib(plan.usable_bytes)
    )
}

/// `--nproc-per-node N`: N worker processes of this command line (without the flag), one per GPU, each
/// joining an NCCL group. Checked before anything starts: N >= 1, `dist.backend = "nccl"`, and a build
/// with NCCL (a CPU build refuses the flag and names the thread backend instead of spawning workers
/// that would all fail the same way).
fn spawn_nccl_workers(origin: &str, n: usize, backend: BackendKind) -> Result<()> {
    if n == 0 {
        bail!(
            "--nproc-per-node 0: at least one worker is needed\nhint: --nproc-per-node = number of GPUs on this node"
        );
    }
    if !cfg!(feature = "nccl") {
        bail!(
            "--nproc-per-node {n} starts one process per GPU over NCCL, but this harpe was built without NCCL\nhint: on CPU run the ranks as threads: --set dist.backend=local --set dist.world_size={n}; for GPUs build with --features nccl (README \"Build for GPUs\")"
        );
    }
    if backend != BackendKind::Nccl {
        bail!(
            "{origin}: --nproc-per-node {n} needs dist.backend = \"nccl\" (the workers are separate processes)\nhint: add --set dist.backend=nccl"
        );
    }
    let outcome = launch_if_asked(Some(n))?.ok_or_else(|| anyhow!("internal: no workers were started"))?;
    if !outcome.success() {
        bail!(
            "worker rank {} failed first (exit code {})\nhint: its own error is printed above; the other workers were stopped because of it",
            outcome.first_failure.unwrap_or(0),
            outcome.exit_code()
        );
    }
    Ok(())
}

/// The training loop of one rank.
fn run_rank(args: &TrainArgs, comm: Comm, sp: Option<SpGroup>) -> Result<()> {
    let mut r = Run::open(args, comm, sp)?;
    // `[eval]` runs on rank 0 alone, on its full copy of the weights (ZeRO 0-2); the other ranks wait
    // for it at the next collective, so `dist.timeout_s` must cover one evaluation
    let eval_cfg = if r.mesh.rank() == 0 { r.cfg.eval.as_ref() } else { None };
    let mut ev = TrainEval::open(
        eval_cfg,
        &r.tokenizer,
        &r.tok_sha,
        &r.run_dir.join("metrics.jsonl"),
        r.cfg.train.loss_chunk_tokens,
    )?;
    let mut end = End::Done;
    'stages: for si in r.state.stage..r.cfg.stages.len() {
        let mut stage = Stage::open(&mut r, si)?;
        while r.state.stage_step < stage.steps {
            if r.state.step >= r.limit {
                break 'stages;
            }
            r.comm.progress(&format!("in step {}", r.state.step + 1));
            let out = train_step(&mut r, &mut stage)?;
            log_step(&mut r, &stage, &out)?;
            r.check_bad_streak()?;
            maybe_evaluate(&mut r, &stage, ev.as_mut())?;
            maybe_checkpoint(&mut r, &stage, &out)?;
            if r.stop.load(Ordering::SeqCst) {
                stage.close();
                end = End::Signal;
                break 'stages;
            }
        }
        stage.close();
    }
    finish(&r, end)
}

/// Everything a training session holds across stages.
struct Run {
    cfg: RunConfig,
    /// the config file, for error messages
    origin: String,
    run_dir: PathBuf,
    tokenizer: PathBuf,
    tok_sha: String,
    device: Device,
    /// where the flat training state lives (`FlatBuf` placement)
    placement: Placement,
    dtype: DType,
    comm: Comm,
    mesh: Mesh,
    /// which rank owns which parameter slices (the optimizer shards)
    map: ShardMap,
    /// architecture of the initial model (stages change its RoPE)
    base_cfg: LlamaConfig,
    layout: ParamLayout,
    optim: AdamW,
    state: TrainState,
    /// metrics.jsonl, written by rank 0 only
    log: Option<MetricsLog>,
    /// TensorBoard events under RUN_DIR/tb/ (`log.tensorboard`), written by rank 0 only
    tb: Option<TbWriter>,
    /// stop after this many steps in total (`--steps`)
    limit: u64,
    total_steps: u64,
    sched: Schedule,
    t_start: Instant,
    bad_streak: u32,
    last_saved: Option<PathBuf>,
    /// set by SIGINT/SIGTERM: finish the step, checkpoint, exit 0
    stop: Arc<AtomicBool>,
    /// the run directory's advisory lock, held by rank 0 (released when the run ends or the process dies)
    _lock: Option<crate::util::DirLock>,
    /// `dist.zero_stage` (every stage is the same computation at one rank)
    zero_stage: u8,
    /// gradient elements per reduce-scatter bucket (`dist.bucket_mb`)
    bucket: usize,
    /// the sequence-parallel group this rank shares its sequences with (`dist.sp_degree` > 1)
    sp: Option<SpGroup>,
    /// tokens trained before this session (a resume), for the session's tokens/s
    tokens_at_start: u64,
}

impl Run {
    /// Where this rank's weight gathers read from: the ranks' master shards.
    fn shards(&self) -> zero::Shards<'_> {
        zero::Shards { comm: &self.comm, map: &self.map, layout: &self.layout, master: self.optim.master() }
    }

    /// Config, run directory, signals, device and communicator, initial weights, optimizer, resume.
    /// Rank 0 alone locks and writes the run directory; the other ranks wait for it (a barrier).
    fn open(args: &TrainArgs, comm: Comm, sp: Option<SpGroup>) -> Result<Run> {
        let origin = args.config.display().to_string();
        let resolved = RunConfig::load(&args.config, &args.set)?;
        let cfg = resolved.cfg;
        let dist = cfg.dist.dist_config(&origin)?;
        let hash = results_hash(&resolved.toml)?;
        let mesh = comm.mesh();
        let lead = mesh.rank() == 0;
        let device = comm.open_device(&cfg.train.device, &format!("{origin}: train.device"))?;
        let dtype = cfg.train.dtype.dtype();
        let run_dir = args.run_dir();
        // one writer per run directory, held until the run ends (issue 16): rank 0 prepares it first
        let mut lock = None;
        let (mut tokenizer, mut first) = (None, Ok(()));
        if lead {
            first = (|| -> Result<()> {
                lock = Some(crate::util::lock_dir(&run_dir, "harpe train")?);
                println!("# resolved config (sha256 {})\n{}", &resolved.hash[..12], resolved.toml);
                prepare_run_dir(&run_dir, &resolved.toml, &hash, args.force)?;
                tokenizer = Some(tokenizer_path(&cfg, &run_dir)?);
                Ok(())
            })();
        }
        if !comm.all_ok(first.is_ok())? {
            first?;
            bail!("rank 0 could not prepare the run directory {}", run_dir.display());
        }
        // the other ranks read what rank 0 resolved (and wrote) instead of writing it again
        let tokenizer = match tokenizer {
            Some(t) => t,
            None => cfg.model.tokenizer.clone().unwrap_or_else(|| match &cfg.model.path {
                Some(d) => d.join("tokenizer.json"),
                None => run_dir.join("tokenizer.json"),
            }),
        };
        let resume_from = resume_point(&run_dir.join("checkpoints"), args.resume)?;
        let stop = stop_flag()?;

        // the training state's home: the device (a CUDA run, or the CPU test knob), else host memory
        let placement = match args.device_resident_state {
            true => Placement::Device(device.clone()),
            false => Placement::of(&device),
        };
        // the initial weights live only until the optimizer has its master (shard) of them
        let (base_cfg, layout, weights) = initial_model(&cfg, &origin, &placement)?;
        // the one rule for which world / ZeRO / SP combinations a model allows (also for CUDA runs,
        // which `plan_check` does not plan)
        let world = crate::plan::World { gpus: mesh.world(), zero_stage: dist.zero_stage, sp_degree: mesh.sp_size };
        crate::plan::validate_world(&world, &crate::plan::Arch::of_run(&cfg, &origin)?)
            .with_context(|| format!("{origin}: [dist]"))?;
        let tok_sha = tokenizer_sha256(&tokenizer)?;
        // ZeRO-0 replicates the optimizer (a one-rank map: every rank owns everything); 1-2 shard it
        let (owners, my_shard) = if dist.zero_stage == 0 { (1, 0) } else { (mesh.world(), mesh.rank()) };
        let map = ShardMap::new(&layout, owners, Split::Slices);
        let mut optim = AdamW::new(&layout, &weights, &map, my_shard, AdamWHyper::from_config(&cfg.optim))?;
        let state = match &resume_from {
            Some(dir) => resume(dir, args.force, &hash, &comm, &mut optim)?,
            None => TrainState::new(cfg.train.seed, &hash, base_cfg.rope.clone()),
        };
        drop(weights); // a stage builds its model from the master shards (`Stage::open`)
        let tokens_at_start = state.tokens_seen;
        Ok(Run {
            log: if lead { Some(MetricsLog::open(&run_dir.join("metrics.jsonl"), state.step)?) } else { None },
            tb: match lead && cfg.log.tensorboard {
                true => Some(TbWriter::create(&run_dir.join("tb"), state.step)?),
                false => None,
            },
            zero_stage: dist.zero_stage,
            bucket: dist.bucket_elems(4),
            limit: args.steps.unwrap_or(u64::MAX),
            total_steps: (0..cfg.stages.len()).map(|i| cfg.stage_steps(i).0).sum(),
            sched: cfg.schedule.schedule(),
            t_start: Instant::now(),
            bad_streak: 0,
            last_saved: resume_from,
            cfg,
            origin,
            run_dir,
            tokenizer,
            tok_sha,
            device,
            placement,
            dtype,
            comm,
            mesh,
            map,
            base_cfg,
            layout,
            optim,
            state,
            stop,
            _lock: lock,
            sp,
            tokens_at_start,
        })
    }

    /// Stop the run after `max_bad_steps` consecutive non-finite steps, naming the last good checkpoint.
    fn check_bad_streak(&self) -> Result<()> {
        if self.bad_streak < self.cfg.train.max_bad_steps.max(1) {
            return Ok(());
        }
        let last = self
            .last_saved
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "none (no checkpoint was written yet)".into());
        bail!(
            "{} consecutive steps had a non-finite loss or gradient (last: step {}); training stopped. Last good checkpoint: {last}\nhint: lower the learning rate, keep optim.grad_clip on, or check the data; continue with --resume",
            self.bad_streak,
            self.state.step
        )
    }

    /// Print a line above the progress bar (or plainly without one).
    fn say(&self, stage: &Stage, line: String) {
        if self.mesh.rank() != 0 {
            return;
        }
        match &stage.pb {
            Some(pb) => pb.println(line),
            None => println!("{line}"),
        }
    }
}

/// One stage: its model (the run's weights with the stage's RoPE), data and step arithmetic.
struct Stage {
    si: usize,
    /// model config of this stage (its RoPE scheme), written into checkpoints
    mc: LlamaConfig,
    model: Llama,
    vars: Vec<Var>,
    tables: Vec<RopeTables>,
    loader: Loader,
    sources: Vec<String>,
    grads: GradAccum,
    steps: u64,
    tokens_per_step: u64,
    accum: usize,
    bsz: usize,
    seq_len: usize,
    /// this rank's tokens of every sequence: start..start + len (all of them without sequence parallelism)
    tok_start: usize,
    tok_len: usize,
    lr_peak: f64,
    /// layers per activation-checkpointing segment
    seg: usize,
    targets_per_step: f64,
    flops_tok: f64,
    pb: Option<indicatif::ProgressBar>,
}

impl Stage {
    /// Build stage `si`'s model from the run's weights, open its data (restoring the cursor when the
    /// run resumes inside it), and apply the stage boundary (optimizer reset) when it starts fresh.
    fn open(r: &mut Run, si: usize) -> Result<Stage> {
        let cfg = &r.cfg;
        let seq_len = cfg.stages[si].seq_len;
        let (steps, tokens_per_step) = cfg.stage_steps(si);
        let mut mc = r.base_cfg.clone();
        if let Some(rope) = cfg.stage_rope(si) {
            mc.rope = rope;
        }
        mc.max_position_embeddings = mc.max_position_embeddings.max(seq_len);
        mc.validate(&format!("{}: stage {si}", r.origin))?;
        let (model, vars) = if r.zero_stage == 3 {
            (Llama::skeleton(mc.clone(), r.dtype, &r.device)?, vec![]) // layers are gathered per use
        } else {
            // every rank's weights from the master shards, bucket by bucket, in the compute dtype
            let named = zero::gather_params(&r.shards(), r.dtype, r.bucket, Some(&r.device))?;
            trainable_model_from(&mc, &r.layout, named)?
        };
        // the attention seam: the device's attention, inside the Ulysses exchange under sequence parallelism
        let attention = match &r.sp {
            Some(g) => AttentionImpl::Custom(Arc::new(Ulysses {
                group: g.clone(),
                inner: AttentionImpl::for_device(&r.device),
            })),
            None => AttentionImpl::for_device(&r.device),
        };
        check_document_mask(&r.origin, cfg.train.document_mask, &attention)?;
        let model = model.with_attention(attention);
        // this rank's tokens (all of them without sequence parallelism) at their global positions
        let (tok_start, tok_len) = (r.mesh.sp_rank * seq_len / r.mesh.sp_size, seq_len / r.mesh.sp_size);
        let tables = rope_tables_at(&model, tok_start, tok_len, seq_len)?;
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
            // ZeRO 2-3 accumulate only this rank's shard of the gradients
            grads: if r.zero_stage >= 2 {
                GradAccum::zeros_in(r.optim.range().len(), &r.placement)?
            } else {
                GradAccum::zeros_in(r.layout.total, &r.placement)?
            },
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
            targets_per_step: (steps_mb * mb * (seq_len - 1)) as f64,
            flops_tok: metrics::flops_per_token(r.layout.total, mc.num_hidden_layers, mc.hidden_size, seq_len),
            pb: progress_bar(cfg.log.progress && r.mesh.rank() == 0, si, steps, r.state.stage_step),
            mc,
            model,
            vars,
            tables,
            loader,
        })
    }

    /// Clear the progress bar.
    fn close(&mut self) {
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

/// What one optimizer step measured.
struct StepOut {
    loss: f64,
    grad_norm: f64,
    lr: f64,
    skipped: bool,
    per_source: BTreeMap<String, (f64, f64)>,
    seconds: f64,
    start_bytes: u64,
}

/// One optimizer step: `accum` micro-batches forward/backward, gradient all-reduce, norm, then either
/// a skip (non-finite loss or gradient) or clip + AdamW on this rank's shard + all-gather + write-back.
fn train_step(r: &mut Run, s: &mut Stage) -> Result<StepOut> {
    if r.mesh.rank() == 0 {
        mem::reset_peak(); // process-wide: one reset per step (rank threads share the process)
        crate::device::reset_device_peak(&r.device)?; // likewise per device
    }
    let start_bytes = mem::rss_bytes();
    let t0 = Instant::now();
    s.grads.zero()?;
    let mut sums = LossSums::new(s.sources.len(), &r.device)?;
    let mut targets_seen = 0f64;
    for _ in 0..s.accum {
        let seqs: Vec<Sequence> = (0..s.bsz).map(|_| s.loader.next_sequence()).collect::<Result<_>>()?;
        let toks: Vec<&[u32]> = seqs.iter().map(|q| q.tokens.as_slice()).collect();
        let (ids, targets) = batch_tensors(&toks, r.base_cfg.vocab_size, &r.device).with_context(|| {
            let idx: Vec<u64> = seqs.iter().map(|q| q.index).collect();
            format!("stage {} step {}: dataset sequences {idx:?} (in batch row order)", s.si, r.state.step + 1)
        })?;
        // the document mask is over the whole (global) sequences, also under sequence parallelism
        let docs = if r.cfg.train.document_mask { Some(doc_starts(&seqs, &r.device)?) } else { None };
        // sequence parallelism: this rank's tokens and their targets (the last rank's last one is ignored)
        let (ids, targets) = if s.tok_len == s.seq_len {
            (ids, targets)
        } else {
            let tg = targets.reshape((s.bsz, s.seq_len))?.narrow(1, s.tok_start, s.tok_len)?;
            (ids.narrow(1, s.tok_start, s.tok_len)?.contiguous()?, tg.flatten_all()?.contiguous()?)
        };
        let mut params = if r.zero_stage < 2 {
            Params::Resident { vars: &s.vars, layout: &r.layout, grads: &mut s.grads }
        } else {
            let z = ZeroShards::new(
                &r.comm,
                &r.map,
                &r.layout,
                r.optim.master(),
                s.grads.buf_mut(),
                r.dtype,
                r.device.clone(),
                r.bucket,
            );
            if r.zero_stage == 2 {
                Params::ShardedGrads { vars: &s.vars, z }
            } else {
                Params::Sharded(z)
            }
        };
        let (chunk, scale) = (r.cfg.train.loss_chunk_tokens, 1.0 / s.targets_per_step);
        let out = forward_backward_with(
            &s.model,
            &mut params,
            &s.tables,
            &ids,
            &targets,
            docs.as_ref(),
            s.seg,
            chunk,
            scale,
        )?;
        injected_fault(r.mesh.rank(), r.state.step)?;
        sums.add(&out.nll, &seqs, s.tok_start, s.tok_len)?;
        let last = (s.tok_start + s.tok_len == s.seq_len) as usize; // holds the ignored last position
        targets_seen += (s.bsz * (s.tok_len - last)) as f64;
    }
    let grad_norm = reduce_gradients(r, s)?;
    // nll sum, target count, then (nll sum, count) per source id, summed over ranks
    let (nll_sum, by_source) = sums.read()?;
    let mut reduced: Vec<f64> = [nll_sum, targets_seen].iter().chain(&by_source).copied().collect();
    r.comm.all_reduce_sum_f64(&mut reduced)?;
    let loss = reduced[0] / reduced[1];
    let per_source: BTreeMap<String, (f64, f64)> = reduced[2..]
        .chunks_exact(2)
        .enumerate()
        .filter(|(_, c)| c[1] > 0.0)
        .map(|(i, c)| (source_name(&s.sources, Some(i as u32)), (c[0], c[1])))
        .collect();
    let lr = r.sched.lr_at(s.lr_peak, r.state.stage_step, s.steps);
    let skipped = !(loss.is_finite() && grad_norm.is_finite());
    if skipped {
        r.bad_streak += 1;
        r.state.skipped_steps += 1;
    } else {
        r.bad_streak = 0;
        grads::clip_by_global_norm(s.grads.buf_mut(), grad_norm, r.cfg.optim.grad_clip)?;
        r.optim.step(s.grads.buf(), lr)?;
        if r.zero_stage < 3 {
            zero::publish(&r.shards(), &s.vars, r.bucket)?;
        }
    }
    r.state.step += 1;
    r.state.stage_step += 1;
    r.state.tokens_seen += s.tokens_per_step;
    r.state.data_cursor = serde_json::to_value(s.loader.cursor())?;
    Ok(StepOut { loss, grad_norm, lr, skipped, per_source, seconds: t0.elapsed().as_secs_f64(), start_bytes })
}

/// The test hook of the multi-rank failure paths: `HARPE_FAULT=RANK:STEP:error|panic` makes rank RANK
/// fail after a micro-batch of step STEP (0-based, before that step's gradient collectives), so tests
/// can check that the other ranks stop, naming it, and that the last checkpoint stays intact.
fn injected_fault(rank: usize, step: u64) -> Result<()> {
    let Ok(spec) = std::env::var("HARPE_FAULT") else { return Ok(()) };
    let parts: Vec<&str> = spec.split(':').collect();
    let (Some(r), Some(st), Some(kind)) = (parts.first(), parts.get(1), parts.get(2)) else {
        bail!("HARPE_FAULT={spec}: expected RANK:STEP:error|panic\nhint: unset HARPE_FAULT (it is a test hook)");
    };
    if r.parse::<usize>().ok() != Some(rank) || st.parse::<u64>().ok() != Some(step) {
        return Ok(());
    }
    match *kind {
        "panic" => panic!("HARPE_FAULT: injected panic on rank {rank} at step {step}"),
        "error" => bail!("HARPE_FAULT: injected error on rank {rank} at step {step}"),
        k => bail!("HARPE_FAULT={spec}: unknown kind {k:?}\nhint: error or panic"),
    }
}

/// Sum the ranks' partial gradients and return the global norm. ZeRO-0: all-reduce, every rank gets
/// all of them (it updates all of them); ZeRO-1: reduce-scatter in place, each rank's own range of the
/// full buffer gets its sum (the only part its optimizer shard reads), half the bytes of an
/// all-reduce; ZeRO 2-3: already reduce-scattered layer by layer during the backward, the buffer is
/// this rank's shard. Sharded, the norm sums the shards' squares.
fn reduce_gradients(r: &Run, s: &mut Stage) -> Result<f64> {
    let sq = match r.zero_stage {
        0 => {
            r.comm.all_reduce_sum(s.grads.buf_mut())?;
            return grads::global_norm(s.grads.buf());
        }
        1 => {
            r.comm.reduce_scatter_sum_in_place(s.grads.buf_mut(), &r.map)?;
            s.grads.buf().range_sum_squares(r.map.flat_range(r.mesh.rank()))?
        }
        _ => s.grads.buf().sum_squares()?,
    };
    let mut sq = [sq];
    r.comm.all_reduce_sum_f64(&mut sq)?;
    Ok(sq[0].sqrt())
}

/// Append the step's record to metrics.jsonl; print a line every `log.every` steps and on a skip.
fn log_step(r: &mut Run, s: &Stage, out: &StepOut) -> Result<()> {
    let tokens = s.tokens_per_step;
    let tflops = s.flops_tok * tokens as f64 / out.seconds / 1e12;
    let rec = StepRecord {
        step: r.state.step,
        stage: s.si,
        seq_len: s.seq_len,
        loss: out.loss,
        grad_norm: out.grad_norm,
        lr: out.lr,
        tokens,
        tokens_seen: r.state.tokens_seen,
        tokens_per_s: tokens as f64 / out.seconds,
        tflops,
        mfu: (r.cfg.log.peak_tflops > 0.0).then(|| tflops / r.cfg.log.peak_tflops),
        rss_bytes: mem::rss_bytes(),
        step_peak_bytes: mem::peak_bytes(),
        device_peak_bytes: crate::device::device_peak_bytes(&r.device)?,
        step_start_bytes: out.start_bytes,
        skipped: out.skipped,
        per_source: out.per_source.iter().map(|(k, (sum, n))| (k.clone(), sum / n.max(1.0))).collect(),
        elapsed_s: r.t_start.elapsed().as_secs_f64(),
    };
    if let Some(log) = r.log.as_mut() {
        log.write(&rec)?;
    }
    if let Some(tb) = &mut r.tb {
        tb.scalars(rec.step, &tensorboard::step_scalars(&rec))?;
    }
    if r.state.step.is_multiple_of(r.cfg.log.every.max(1)) || out.skipped {
        r.say(s, metrics::step_line(&rec, r.total_steps));
    }
    if let Some(pb) = &s.pb {
        pb.set_position(r.state.stage_step);
    }
    Ok(())
}

/// Evaluate the training weights in place (`[eval]`) every `eval.every` steps, at a stage's end and at
/// `--steps`; log the line to metrics.jsonl (before the step's checkpoint, so a resume from that
/// checkpoint keeps it), print it, redraw eval.png.
fn maybe_evaluate(r: &mut Run, s: &Stage, ev: Option<&mut TrainEval>) -> Result<()> {
    let boundary = r.state.stage_step == s.steps || r.state.step >= r.limit;
    let due = ev.as_ref().is_some_and(|e| e.due(r.state.step, boundary));
    // ZeRO-3: rank 0's decision is shared, and every rank joins the gather of the weights it
    // evaluates (group by group; only rank 0 keeps them, on its device, in the compute dtype)
    let full = if r.zero_stage == 3 && !r.comm.all_ok(!due)? {
        let keep = (r.mesh.rank() == 0).then_some(&r.device);
        Some(zero::gather_params(&r.shards(), r.dtype, r.bucket, keep)?)
    } else {
        None
    };
    let Some(ev) = ev.filter(|_| due) else { return Ok(()) };
    // rank 0 alone evaluates: with the device's own attention (never the sequence-parallel exchange)
    let model = match full {
        Some(w) => Llama::from_tensors(s.mc.clone(), w.into_iter().collect(), "the gathered training weights")?,
        None => s.model.clone(),
    };
    let model = &model.with_attention(AttentionImpl::for_device(&r.device));
    let window = r.cfg.eval_ppl_window(s.si).ok_or_else(|| anyhow!("internal: [eval] without a table"))?;
    let rec = ev.evaluate(model, r.state.step, s.si, window, r.state.step == r.total_steps)?;
    if let Some(log) = r.log.as_mut() {
        log.write_eval(&rec)?;
    }
    if let Some(tb) = &mut r.tb {
        tb.scalars(rec.step, &tensorboard::eval_scalars(&rec))?;
    }
    r.say(s, eval_line(&rec));
    if r.cfg.log.plot {
        let recs = metrics::read_evals(&r.run_dir.join("metrics.jsonl"))?;
        metrics::plot_evals(&recs, &r.run_dir.join("eval.png"))?;
    }
    Ok(())
}

/// Save after a good step that ends the stage, hits `checkpoint.every`, reaches `--steps` or follows a
/// signal. A checkpoint at a stage's end already points at the next stage.
fn maybe_checkpoint(r: &mut Run, s: &Stage, out: &StepOut) -> Result<()> {
    let stage_end = r.state.stage_step == s.steps;
    let periodic = r.cfg.checkpoint.every > 0 && r.state.step.is_multiple_of(r.cfg.checkpoint.every);
    // every rank must agree on a signal, or they would disagree on whether to save
    let signalled = !r.comm.all_ok(!r.stop.load(Ordering::SeqCst))?;
    if signalled {
        r.stop.store(true, Ordering::SeqCst);
    }
    let stopping = signalled || r.state.step >= r.limit;
    if !(periodic || stage_end || stopping) || out.skipped || r.bad_streak > 0 {
        return Ok(());
    }
    let mut snap = r.state.clone();
    if stage_end {
        snap.stage = s.si + 1;
        snap.stage_step = 0;
        snap.data_cursor = serde_json::Value::Null;
    }
    // ZeRO-3: every rank joins the gather of the weights rank 0 writes, group by group into rank 0's
    // host memory (in the compute dtype: what the model files hold), so no device holds a full copy
    let full = if r.zero_stage == 3 {
        let keep = (r.mesh.rank() == 0).then_some(&Device::Cpu);
        Some(zero::gather_params(&r.shards(), r.dtype, r.bucket, keep)?)
    } else {
        None
    };
    let write_model = |dir: &Path| -> Result<()> {
        let tensors: Vec<(String, Tensor)> = match &full {
            Some(w) => w.clone(),
            None => r.layout.params.iter().zip(&s.vars).map(|(p, v)| (p.name.clone(), v.as_tensor().clone())).collect(),
        };
        save_model_dir(dir, &s.mc, &tensors, r.cfg.checkpoint.max_shard_bytes)?;
        std::fs::copy(&r.tokenizer, dir.join("tokenizer.json"))
            .with_context(|| format!("copying {} into the checkpoint", r.tokenizer.display()))?;
        Ok(())
    };
    let root = r.run_dir.join("checkpoints");
    let p = checkpoint::save(&root, &snap, &r.optim, &r.comm, r.cfg.checkpoint.keep_last, &write_model)?;
    r.say(s, format!("saved {}", p.display()));
    r.last_saved = Some(p);
    Ok(())
}

/// How a session ended.
enum End {
    /// every stage done, or `--steps` reached
    Done,
    /// SIGINT/SIGTERM after a checkpoint
    Signal,
}

/// End of a session (the only one, on every path): the loss curve of the whole run, then a summary.
fn finish(r: &Run, end: End) -> Result<()> {
    if r.mesh.rank() != 0 {
        return Ok(());
    }
    if r.cfg.log.plot {
        let recs = metrics::read_records(&r.run_dir.join("metrics.jsonl"))?;
        metrics::plot_loss(&recs, &r.run_dir.join("loss.png"), "harpe train: loss")?;
    }
    match end {
        End::Signal => println!("stopped by signal after step {}; resume with --resume", r.state.step),
        End::Done => {
            let st = &r.state;
            println!(
                "done: {} steps, {} tokens, {} skipped; last checkpoint {}; {:.0} tokens/s this session",
                st.step,
                st.tokens_seen,
                st.skipped_steps,
                r.last_saved.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "none".into()),
                (st.tokens_seen - r.tokens_at_start) as f64 / r.t_start.elapsed().as_secs_f64().max(1e-9)
            );
        }
    }
    Ok(())
}

/// SIGINT/SIGTERM set the returned flag (the loop finishes the step, checkpoints, exits 0); a second
/// SIGINT kills at once.
fn stop_flag() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(sig, 1, Arc::clone(&stop))?;
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }
    Ok(stop)
}

/// Continue from checkpoint `dir`: its state (checked against the config hash unless `force`), this
/// rank's optimizer shard, and the weights gathered from every rank's shard.
fn resume(dir: &Path, force: bool, hash: &str, comm: &Comm, optim: &mut AdamW) -> Result<TrainState> {
    let state = checkpoint::load_state(dir)?;
    if state.config_hash != hash && !force {
        bail!(
            "{} was written by a different config\nhint: resume with the same config and --set values, or pass --force",
            dir.display()
        );
    }
    let mesh = comm.mesh();
    checkpoint::load_optim(dir, &mesh, optim)?;
    if mesh.rank() == 0 {
        println!("resuming from {} (step {}, stage {})", dir.display(), state.step, state.stage);
    }
    Ok(state)
}

/// The checkpoint to resume from (`--resume`), refusing to start over a run that already has one.
fn resume_point(ckpt_root: &Path, resume: bool) -> Result<Option<PathBuf>> {
    let latest = checkpoint::latest_complete(ckpt_root)?;
    if let (false, Some(p)) = (resume, &latest) {
        bail!(
            "{} already holds checkpoint {}\nhint: pass --resume to continue it, or choose another --out",
            ckpt_root.parent().unwrap_or(ckpt_root).display(),
            p.display()
        );
    }
    Ok(latest)
}

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
            for p in start..(start + len).min(t.saturating_sub(1)) {
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
