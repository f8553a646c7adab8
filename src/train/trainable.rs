//! The model the loop trains: every parameter a candle `Var` in the compute dtype, built from the full
//! flat weights (a stage's start, `bench model`) or from the named tensors ZeRO gathers.
//!
//! The non-obvious decision: the model's parameter order is checked against the optimizer's layout
//! here, once, so the flat buffers and the `Var`s can be matched by index everywhere else.
use crate::flatbuf::FlatBuf;
use crate::model::config::LlamaConfig;
use crate::model::layout::ParamLayout;
use crate::model::Llama;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, Var};

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
