//! The parallelism applied from outside the training loop (as torchtitan's `parallelize` applies FSDP):
//! `Sharding` is the one owner of what the run's ZeRO stage (`config::ZeroStage`, chosen once per run)
//! does around a step: the model a stage computes with, the gradient buffer, where one micro-batch's
//! forward takes its weights and its backward puts the gradients (`Params`), the reduction of a step's
//! gradients, the publish of updated weights, and the full-weight gather of a checkpoint or an
//! evaluation. The loop and `step::forward_backward` read the same for every stage.
//!
//! Reference: Rajbhandari et al. 2020 (ZeRO 2: gradients reduce-scattered as their backward finishes;
//! ZeRO 3: each layer's weights gathered right before use and freed after).
//! The non-obvious decisions: the parameters are a `model::llama::WeightSource`, so the model's own
//! forward runs over gathered weights; the order in which the checkpointed step asks for layers is
//! known before it starts (`begin`), so ZeRO-3 starts the next layer's gather while this one computes;
//! the tied embedding is one group whose gradient is handed on twice (after the head's backward, and
//! after the embedding's), so the step never asks whether the model is tied.
//! What this file does not do: the rules themselves (`ZeroStage` answers them), the collectives and
//! the shard map (`comms::zero`).
use super::trainable::trainable_model_from;
use crate::comms::zero::{self, Shards, ZeroShards};
use crate::config::{GradReduce, ZeroStage};
use crate::flatbuf::Placement;
use crate::grads::{self, GradAccum};
use crate::model::config::LlamaConfig;
use crate::model::layout::ParamLayout;
use crate::model::llama::{
    layer_param_name, LayerWeights, OuterWeights, WeightSource, EMBED_TOKENS, FINAL_NORM, LAYER_PARAMS, LM_HEAD,
};
use crate::model::Llama;
use anyhow::{anyhow, bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use std::collections::VecDeque;
use std::ops::Range;

/// This rank's side of the run's ZeRO stage: the stage, where the weights are gathered from (every
/// rank's fp32 master shard) and in what dtype, onto which device, in buckets of how many elements.
/// Built by `Run::sharding` for each use; every question the loop had for the stage is a method here.
pub(super) struct Sharding<'a> {
    pub(super) zero: ZeroStage,
    pub(super) src: Shards<'a>,
    /// this rank (`Mesh::rank`): which part of a reduce-scattered buffer is its own
    pub(super) rank: usize,
    /// the compute dtype and device the weights are gathered in and onto
    pub(super) dtype: DType,
    pub(super) device: &'a Device,
    /// where the flat training state lives (the gradient buffer's placement)
    pub(super) placement: &'a Placement,
    /// elements per gather / reduce-scatter bucket (`dist.bucket_mb`)
    pub(super) bucket: usize,
}

impl<'a> Sharding<'a> {
    /// A stage's model of config `mc` and its `Var`s (layout order). ZeRO-3: a skeleton without weights
    /// (each layer is gathered per use) and no `Var`s; otherwise every rank's resident weights gathered
    /// from the master shards, bucket by bucket, in the compute dtype.
    pub(super) fn stage_model(&self, mc: &LlamaConfig) -> Result<(Llama, Vec<Var>)> {
        if self.zero.gathers_weights() {
            return Ok((Llama::skeleton(mc.clone(), self.dtype, self.device)?, vec![]));
        }
        trainable_model_from(mc, self.src.layout, self.gather(Some(self.device))?)
    }

    /// The buffer a step accumulates gradients in: every parameter's, or (ZeRO 2-3) this rank's shard's.
    pub(super) fn grad_buffer(&self) -> Result<GradAccum> {
        GradAccum::zeros_in(self.zero.gradient_elems(self.src.layout.total, self.src.master.len()), self.placement)
    }

    /// One micro-batch's weights and gradient hand-off over the stage's `vars` (empty under ZeRO-3) and
    /// gradient buffer `grads`: resident weights with gradients added into the full buffer (ZeRO 0-1),
    /// resident weights with each group's gradients reduce-scattered into the shard as its backward
    /// finishes (ZeRO-2), or each group also gathered right before use (ZeRO-3).
    pub(super) fn params(&self, vars: &'a [Var], grads: &'a mut GradAccum) -> Params<'a> {
        if !self.zero.shards_gradients() {
            return Params::resident(vars, self.src.layout, grads);
        }
        let z = ZeroShards::new(self.src, grads.buf_mut(), self.dtype, self.device.clone(), self.bucket);
        match self.zero.gathers_weights() {
            true => Params::sharded(z),
            false => Params::sharded_grads(vars, z),
        }
    }

    /// Sum the ranks' partial gradients in `grads` and return the global norm. ZeRO-0: all-reduce, every
    /// rank gets all of them (it updates all of them); ZeRO-1: reduce-scatter in place, each rank's own
    /// range of the full buffer gets its sum (the only part its optimizer shard reads), half the bytes of
    /// an all-reduce; ZeRO 2-3: already reduce-scattered layer by layer during the backward, the buffer
    /// is this rank's shard. Sharded, the norm sums the shards' squares.
    pub(super) fn reduce_grads(&self, grads: &mut GradAccum) -> Result<f64> {
        let comm = self.src.comm;
        let sq = match self.zero.grad_reduce() {
            GradReduce::AllReduce => {
                comm.all_reduce_sum(grads.buf_mut())?;
                return grads::global_norm(grads.buf());
            }
            GradReduce::ReduceScatterInPlace => {
                comm.reduce_scatter_sum_in_place(grads.buf_mut(), self.src.map)?;
                grads.buf().range_sum_squares(self.src.map.flat_range(self.rank))?
            }
            GradReduce::DoneInBackward => grads.buf().sum_squares()?,
        };
        let mut sq = [sq];
        comm.all_reduce_sum_f64(&mut sq)?;
        Ok(sq[0].sqrt())
    }

    /// After an optimizer update: the updated master shards all-gathered into every rank's resident
    /// `vars` (`zero::publish`); ZeRO-3 keeps no resident weights, so nothing is published.
    pub(super) fn publish(&self, vars: &[Var]) -> Result<()> {
        match self.zero.publishes_weights() {
            true => zero::publish(&self.src, vars, self.bucket),
            false => Ok(()),
        }
    }

    /// The full weights of a checkpoint or an evaluation, where no rank holds them (ZeRO-3): every rank
    /// joins the gather, and the ranks that want them keep them on `keep` (`gather`); `None` when the
    /// stage's resident model already holds them. An evaluation gathers the whole model to each rank's
    /// device rather than layer by layer as the training forward does: that is a collective per layer
    /// and forward, so every rank would have to run the same forwards in lockstep, but the ranks score
    /// different items (documents of different lengths, generations that stop at different tokens). The
    /// cost is one model copy per rank for the evaluation's duration.
    pub(super) fn full_weights(&self, keep: Option<&Device>) -> Result<Option<Vec<(String, Tensor)>>> {
        match self.zero.needs_full_gather() {
            true => Ok(Some(self.gather(keep)?)),
            false => Ok(None),
        }
    }

    /// The one full gather: every parameter from the ranks' master shards, group by group in the compute
    /// dtype (`zero::gather_params`), kept on `keep` by the ranks that pass one (the others only take
    /// part), named, in layout order.
    fn gather(&self, keep: Option<&Device>) -> Result<Vec<(String, Tensor)>> {
        zero::gather_params(&self.src, self.dtype, self.bucket, keep)
    }
}

/// A parameter group whose gradients are handed on (ZeRO 2-3): layout indices and their `Var`s, which
/// (ZeRO-3) keep the gathered weights alive while their graph is.
pub type Held = Option<(Range<usize>, Vec<Var>)>;

/// The weights outside the decoder layers, as the step names them when it hands gradients on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outer {
    Embed,
    Norm,
    /// the LM head: the embedding's group when the model is tied
    Head,
}

/// The parameters of one micro-batch under one ZeRO stage: `Sharding::params` makes the run's; tests and
/// benches build one directly.
pub struct Params<'a> {
    place: Place<'a>,
    /// ZeRO 2-3: the groups of the embedding, the final norm and (untied) the head, in that order,
    /// taken by `outer` for the whole micro-batch
    outer: Vec<(Range<usize>, Vec<Var>)>,
    /// whether the head is the embedding
    tied: bool,
    /// the layers the micro-batch will still ask for, in order (ZeRO-3 prefetches the front)
    order: VecDeque<usize>,
}

enum Place<'a> {
    /// every parameter resident in the model as `vars` (layout order, ZeRO 0-1); gradients added into
    /// the full-length `grads`
    Resident { vars: &'a [Var], layout: &'a ParamLayout, grads: &'a mut GradAccum },
    /// ZeRO-2: parameters resident (`vars`); each group's gradients reduce-scattered into this rank's
    /// shard as soon as the backward that produced them is done
    ShardedGrads { vars: &'a [Var], z: ZeroShards<'a> },
    /// ZeRO-3: each group also gathered right before use and dropped after
    Sharded(ZeroShards<'a>),
}

impl<'a> Params<'a> {
    /// ZeRO 0-1: every parameter is the model's own `Var` (`vars`, layout order); gradients are added
    /// into `grads`.
    pub fn resident(vars: &'a [Var], layout: &'a ParamLayout, grads: &'a mut GradAccum) -> Params<'a> {
        Params::new(Place::Resident { vars, layout, grads })
    }

    /// ZeRO-2: resident parameters, gradients reduce-scattered into `z`'s shard.
    fn sharded_grads(vars: &'a [Var], z: ZeroShards<'a>) -> Params<'a> {
        Params::new(Place::ShardedGrads { vars, z })
    }

    /// ZeRO-3: parameters gathered from `z`'s shards per group, gradients reduce-scattered into them.
    pub fn sharded(z: ZeroShards<'a>) -> Params<'a> {
        Params::new(Place::Sharded(z))
    }

    fn new(place: Place<'a>) -> Params<'a> {
        Params { place, outer: vec![], tied: false, order: VecDeque::new() }
    }

    /// Start a micro-batch whose checkpointed step runs `segments` (consecutive layer ranges): the
    /// forward takes every layer in order, then the backward recomputes each segment before the last,
    /// last to first.
    pub fn begin(&mut self, segments: &[Range<usize>]) {
        self.outer.clear();
        self.order = segments.iter().flat_map(|s| s.clone()).collect();
        let recompute = segments.iter().rev().skip(1);
        self.order.extend(recompute.flat_map(|s| s.clone()));
    }

    /// The shards the parameters live in (ZeRO 2-3).
    pub fn shards(&self) -> Option<&ZeroShards<'a>> {
        match &self.place {
            Place::Resident { .. } => None,
            Place::ShardedGrads { z, .. } | Place::Sharded(z) => Some(z),
        }
    }

    fn layout(&self) -> &ParamLayout {
        match &self.place {
            Place::Resident { layout, .. } => layout,
            Place::ShardedGrads { z, .. } | Place::Sharded(z) => z.layout,
        }
    }

    /// Hand on the gradients `store` holds: resident, every parameter's; ZeRO 2-3, those of the layers
    /// in `layers` (what `layer` returned for them) and of the `outer` groups, in that order.
    pub fn take_grads(&mut self, store: &GradStore, layers: &[Held], outer: &[Outer]) -> Result<()> {
        let z = match &mut self.place {
            Place::Resident { vars, layout, grads } => return grads.add_from(layout, vars, store),
            Place::ShardedGrads { z, .. } | Place::Sharded(z) => z,
        };
        for (idx, vars) in layers.iter().flatten() {
            z.scatter_grads(idx.clone(), vars, store, "grads")?;
        }
        for o in outer {
            let i = match o {
                Outer::Embed => 0,
                Outer::Norm => 1,
                Outer::Head if self.tied => 0,
                Outer::Head => 2,
            };
            let (idx, vars) = self.outer.get(i).ok_or_else(|| anyhow!("internal: {o:?} taken before `outer`"))?;
            z.scatter_grads(idx.clone(), vars, store, "grads")?;
        }
        Ok(())
    }

    /// Join the gradient exchanges still running (ZeRO 2-3 over NCCL): the shard is complete after this.
    pub fn finish(&mut self) -> Result<()> {
        self.outer.clear();
        match &mut self.place {
            Place::Resident { .. } => Ok(()),
            Place::ShardedGrads { z, .. } | Place::Sharded(z) => z.finish(),
        }
    }
}

impl WeightSource for Params<'_> {
    type Held = Held;

    fn outer(&mut self, model: &Llama) -> Result<OuterWeights> {
        self.tied = model.cfg.tie_word_embeddings;
        let mut names = vec![EMBED_TOKENS, FINAL_NORM];
        if !self.tied {
            names.push(LM_HEAD);
        }
        let groups: Vec<Range<usize>> =
            names.iter().map(|n| param_index(self.layout(), n).map(|i| i..i + 1)).collect::<Result<_>>()?;
        let resident = || OuterWeights {
            embed: model.embed_tokens.clone(),
            norm: model.norm.clone(),
            head: model.lm_head.clone(),
        };
        match &self.place {
            Place::Resident { .. } => Ok(resident()),
            Place::ShardedGrads { vars, .. } => {
                self.outer = groups.into_iter().map(|i| (i.clone(), vars[i].to_vec())).collect();
                Ok(resident())
            }
            Place::Sharded(z) => {
                self.outer = groups
                    .into_iter()
                    .map(|i| Ok((i.clone(), z.gather(i.clone(), &z.layout.params[i.start].name, None)?)))
                    .collect::<Result<_>>()?;
                let t = |i: usize| self.outer[i].1[0].as_tensor().clone();
                let head = if self.tied { t(0) } else { t(2) };
                Ok(OuterWeights { embed: t(0), norm: t(1), head })
            }
        }
    }

    fn layer(&mut self, model: &Llama, l: usize) -> Result<(LayerWeights, Held)> {
        if self.order.pop_front() != Some(l) {
            bail!("internal: layer {l} asked for out of the order `Params::begin` was given");
        }
        let next = self.order.front().copied();
        match &self.place {
            Place::Resident { .. } => Ok((model.layers[l].clone(), None)),
            Place::ShardedGrads { vars, z } => {
                let idx = layer_param_indices(z.layout, l)?;
                Ok((model.layers[l].clone(), Some((idx.clone(), vars[idx].to_vec()))))
            }
            Place::Sharded(z) => {
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

#[cfg(test)]
mod tests {
    /// The parallelism stays applied from outside: the loop and the stage never name the ZeRO stage (nor
    /// its type, its collectives or its shards), so a rule of it can only be written here, once.
    #[test]
    fn the_loop_and_the_stage_never_name_the_zero_stage() {
        let files = [("training_loop.rs", include_str!("training_loop.rs")), ("stage.rs", include_str!("stage.rs"))];
        for (name, text) in files {
            for (i, line) in text.lines().enumerate() {
                assert!(
                    !line.to_lowercase().contains("zero"),
                    "src/train/{name}:{}: names the ZeRO stage; ask `Sharding` (train/params.rs) instead: {line}",
                    i + 1
                );
            }
        }
    }
}
