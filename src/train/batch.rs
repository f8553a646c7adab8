//! A batch's tensors: ids and shifted targets, document starts.
//!
//! A sequence of T tokens trains T - 1 targets (`config::targets_in`, the one count): `batch_tensors`
//! marks the last position `IGNORE_INDEX`. The batch arithmetic (tokens, micro-batches and targets per
//! step, each rank's share) is src/config/batch.rs: config validation applies it, and config imports
//! nothing above it.
use crate::data::Sequence;
use crate::model::attention::AttentionImpl;
use crate::ops::attention::DocStarts;
use crate::ops::cross_entropy_chunk::IGNORE_INDEX;
use anyhow::{bail, Result};
use candle_core::{Device, Tensor};

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
