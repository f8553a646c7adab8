//! A batch's tensors (ids and shifted targets, document starts, RoPE tables at global positions), the
//! trainable model built from weights, and the step's loss sums kept on the device.
//!
//! A sequence of T tokens trains T - 1 targets (`config::targets_in`, the one count): `batch_tensors`
//! marks the last position `IGNORE_INDEX`.
use crate::config::targets_in;
use crate::data::Sequence;
use crate::flatbuf::FlatBuf;
use crate::model::attention::AttentionImpl;
use crate::model::config::LlamaConfig;
use crate::model::layout::ParamLayout;
use crate::model::rope::RopeTables;
use crate::model::Llama;
use crate::ops::attention::DocStarts;
use crate::ops::cross_entropy_chunk::IGNORE_INDEX;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, Var};

/// RoPE tables for positions 0..t of every layer (one shared table unless layers differ).
pub fn rope_tables(model: &Llama, t: usize) -> Result<Vec<RopeTables>> {
    rope_tables_at(model, 0, t, t)
}

/// RoPE tables for the global positions start..start+len of sequences of `total` tokens (a
/// sequence-parallel rank's part; `total` decides dynamic schemes), every layer or one shared.
pub fn rope_tables_at(model: &Llama, start: usize, len: usize, total: usize) -> Result<Vec<RopeTables>> {
    let c = &model.cfg;
    let n = if c.rope.per_layer() { c.num_hidden_layers } else { 1 };
    let at = crate::model::rope::Positions { start, len, seq_len: total };
    (0..n).map(|l| c.rope.tables(c.head_dim, l, at, model.parity, model.device())).collect()
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
