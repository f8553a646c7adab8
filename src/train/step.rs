//! One micro-batch's forward and backward with activation checkpointing, over the weights and
//! gradients of any ZeRO stage (`Params`).
//!
//! Reference: Chen et al. 2016 (checkpointing every k layers); ZeRO-3's per-layer gather (Rajbhandari
//! et al. 2020). The non-obvious decision: checkpointing is done here on top of candle's autograd (see
//! mod.rs); under ZeRO-3 a layer is gathered for the forward and again for the recompute, the next
//! layer's gather prefetched while this one computes.
use crate::comms::zero::ZeroShards;
use crate::grads::{GradAccum, ParamLayout};
use crate::loss::chunked_cross_entropy;
use crate::model::llama::{layer_param_name, rms_norm, LayerWeights, EMBED_TOKENS, FINAL_NORM, LAYER_PARAMS, LM_HEAD};
use crate::model::rope::RopeTables;
use crate::model::Llama;
use crate::ops::attention::DocStarts;
use anyhow::{anyhow, bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use std::ops::Range;

/// What one micro-batch's forward/backward produced.
pub struct MicroOut {
    /// per-position nll (B*T) f32 on the model's device, 0 at ignored positions
    pub nll: Tensor,
}

/// One micro-batch's inputs.
pub struct MicroBatch<'a> {
    /// (B, T) u32 token ids
    pub ids: &'a Tensor,
    /// (B*T) u32 next-token targets (`IGNORE_INDEX` skips a position)
    pub targets: &'a Tensor,
    /// `tables[l]` the RoPE tables of layer l (or one shared table)
    pub tables: &'a [RopeTables],
    /// the document mask of every layer (forward and recompute), for the whole sequences
    pub docs: Option<&'a DocStarts>,
}

/// How a micro-batch is differentiated.
#[derive(Clone, Copy, Debug)]
pub struct Backward {
    /// layers per activation-checkpointing segment
    pub seg: usize,
    /// tokens per chunk of the cross-entropy
    pub loss_chunk: usize,
    /// the nll sum's factor: 1 / (targets of the whole optimizer step)
    pub scale: f64,
}

/// Forward and backward of one micro-batch with activation checkpointing; adds
/// `scale * d(sum nll)/d(param)` into `grads`. Every parameter is the model's own `Var` (`vars`, layout
/// order); ZeRO 2-3 call `forward_backward_with` instead.
pub fn forward_backward(
    model: &Llama,
    (vars, layout, grads): (&[Var], &ParamLayout, &mut GradAccum),
    batch: &MicroBatch,
    how: Backward,
) -> Result<MicroOut> {
    let mut params = Params::Resident { vars, layout, grads };
    forward_backward_with(model, &mut params, batch, how)
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
pub fn forward_backward_with(
    model: &Llama,
    params: &mut Params,
    batch: &MicroBatch,
    how: Backward,
) -> Result<MicroOut> {
    let MicroBatch { ids, targets, tables, docs } = *batch;
    let Backward { seg, loss_chunk, scale } = how;
    let (b, t) = ids.dims2()?;
    let c = model.cfg.hidden_size;
    let n_layers = model.cfg.num_hidden_layers;
    let table = |l: usize| &tables[l.min(tables.len() - 1)];
    let segments: Vec<(usize, usize)> =
        (0..n_layers).step_by(seg.max(1)).map(|s| (s, (s + seg).min(n_layers))).collect();
    // `after`: the layer gathered after the segment's last one (the next segment's first in the
    // forward; in the backward the first of the segment recomputed next), for ZeRO-3's prefetch
    // With `vjp = Some(g)` (a recompute) the last layer gives, instead of its output, the scalar whose
    // backward is that of sum(output ⊙ g) (`Llama::layer_vjp_with`: the down projection's forward skipped).
    let run_segment = |params: &Params,
                       x: &Tensor,
                       (lo, hi): (usize, usize),
                       after: Option<usize>,
                       held: &mut Vec<Held>,
                       vjp: Option<&Tensor>|
     -> Result<Tensor> {
        let mut x = x.clone();
        for l in lo..hi {
            let (w, h) = params.layer(model, l, if l + 1 < hi { Some(l + 1) } else { after })?;
            x = match vjp {
                Some(g) if l + 1 == hi => model.layer_vjp_with(l, &w, &x, g, table(l), docs)?, // ()
                _ => model.layer_forward_with(l, &w, &x, table(l), None, docs)?,               // (B, T, C)
            };
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
        x = run_segment(params, &x, s, first(Some(i + 1)), &mut vec![], None)?.detach();
        // gathered weights freed here
    }
    let last_in = Var::from_tensor(&x)?;
    let mut held = vec![];
    // after the last segment comes the recompute of the one before it
    let y =
        run_segment(params, last_in.as_tensor(), segments[n_seg - 1], first(n_seg.checked_sub(2)), &mut held, None)?; // (B, T, C)
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
        let vjp = run_segment(params, xin.as_tensor(), s, first(i.checked_sub(1)), &mut held, Some(&g))?; // ()
        let store = vjp.backward()?;
        params.take_grads(&store, &held.iter().collect::<Vec<_>>())?;
        g = store.get(xin.as_tensor()).cloned().ok_or_else(|| anyhow!("no gradient reached layer {}", s.0))?;
        saved.truncate(i);
    }
    let store = (x0 * g.detach())?.sum_all()?.backward()?;
    params.take_grads(&store, &outer.first().into_iter().collect::<Vec<_>>())?;
    params.finish()?;
    Ok(MicroOut { nll })
}
