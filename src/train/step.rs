//! One micro-batch's forward and backward with activation checkpointing, over the weights and
//! gradients of any ZeRO stage (`params::Params`).
//!
//! Reference: Chen et al. 2016 (checkpointing every k layers). The non-obvious decision: checkpointing
//! is done here on top of candle's autograd (see mod.rs), around the model's own forward
//! (`Llama::forward_segments`): the forward keeps only each segment's detached input, and the backward
//! recomputes each earlier segment from it (`Llama::run_layers`). Which weights each ZeRO stage gathers,
//! prefetches and frees, and where the gradients go, is `Params`' business (`params::Sharding` makes
//! the one of a run's stage): this file reads the same for every stage.
use super::params::{Outer, Params};
use crate::model::llama::Forward;
use crate::model::loss::chunked_cross_entropy;
use crate::model::rope::RopeTables;
use crate::model::Llama;
use crate::ops::attention::DocStarts;
use anyhow::{anyhow, Result};
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

/// The layers cut into segments of `seg` layers (the last one may be shorter).
fn segments(n_layers: usize, seg: usize) -> Vec<Range<usize>> {
    let seg = seg.max(1);
    (0..n_layers).step_by(seg).map(|s| s..(s + seg).min(n_layers)).collect()
}

/// Forward and backward of one micro-batch with activation checkpointing, weights taken from and
/// `scale * d(sum nll)/d(param)` handed on to `params` (every ZeRO stage; `Params::resident` for a
/// model's own `Var`s): the forward keeps only the (detached) input of every segment (the last one
/// keeps its graph), the backward recomputes each earlier segment from its input and hands every
/// segment's gradients on as soon as its backward is done. The collectives `Params` runs come in the
/// same order on every rank.
pub fn forward_backward(model: &Llama, params: &mut Params, batch: &MicroBatch, how: Backward) -> Result<MicroOut> {
    let MicroBatch { ids, targets, tables, docs } = *batch;
    let Backward { seg, loss_chunk, scale } = how;
    let (b, t) = ids.dims2()?;
    let segs = segments(model.cfg.num_hidden_layers, seg);
    let n_seg = segs.len();
    params.begin(&segs);

    // Forward: keep only the (detached) input of every segment; the last one keeps its graph.
    let mut x0 = None; // the embedding's output (B, T, C), graph into embed_tokens
    let mut saved: Vec<Tensor> = Vec::with_capacity(n_seg); // segment inputs (B, T, C), detached
    let mut last_in = None; // the last segment's input as a leaf
    let fwd = model.forward_segments(params, ids, &segs, Forward { tables, docs, cache: None }, &mut |i, x| {
        if i == 0 {
            x0 = Some(x.clone());
        }
        let x = x.detach();
        if i + 1 < n_seg {
            saved.push(x.clone());
            return Ok(x);
        }
        let v = Var::from_tensor(&x)?;
        last_in = Some(v.clone());
        Ok(v.as_tensor().clone())
    })?;
    let (Some(x0), Some(last_in)) = (x0, last_in) else { anyhow::bail!("internal: a model without layers") };
    let h = fwd.hidden.reshape((b * t, model.cfg.hidden_size))?; // (B*T, C)
    let nll = chunked_cross_entropy(&h, &fwd.outer.head, targets, loss_chunk)?; // (B*T)
    let store = (nll.sum_all()? * scale)?.backward()?;
    params.take_grads(&store, &fwd.held, &[Outer::Norm, Outer::Head])?;
    let mut g =
        store.get(last_in.as_tensor()).cloned().ok_or_else(|| anyhow!("no gradient reached the last layers"))?;
    // The nll, h and the forward's output each hold the last segment's whole graph: a shadowing `let`
    // would keep it alive through every recompute below (one layer's graph, ~25 GiB at 128K on 7B).
    let nll_graph = nll;
    let nll = nll_graph.detach(); // (B*T), stays on the device (`LossSums`)
    drop((nll_graph, h, fwd, store));

    // Backward through the earlier segments, last to first, recomputing each from its saved input.
    for i in (0..n_seg - 1).rev() {
        let xin = Var::from_tensor(&saved[i])?;
        let run = Forward { tables, docs, cache: None };
        let (vjp, held) = model.run_layers(params, xin.as_tensor(), segs[i].clone(), run, Some(&g))?; // ()
        let store = vjp.backward()?;
        params.take_grads(&store, &held, &[])?;
        let first = segs[i].start;
        g = store.get(xin.as_tensor()).cloned().ok_or_else(|| anyhow!("no gradient reached layer {first}"))?;
        saved.truncate(i);
    }
    let store = (x0 * g.detach())?.sum_all()?.backward()?;
    params.take_grads(&store, &[], &[Outer::Embed])?;
    params.finish()?;
    Ok(MicroOut { nll })
}
