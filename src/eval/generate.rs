//! Greedy decoding with a per-layer KV cache; the prompt is prefilled in chunks so memory stays bounded.
//!
//! Reference: HF `generate(do_sample=False)` for base-model evaluation (spec `evaluation.md` §5).
//! The non-obvious decision: prefill chunks reuse the same causal attention op with Tq < Tk, so a chunked
//! prefill computes exactly what one full forward would (tested against full recomputation). Dynamic
//! NTK rebuilds frequencies per call from the current length, as HF does, so cached keys of a dynamic
//! model keep the base they were written with (HF behaves the same). Not done here: sampling, beams.
use crate::model::llama::{KvCache, Llama};
use anyhow::{bail, Result};
use candle_core::{DType, Tensor, D};

/// Decoding settings.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// at most this many new tokens
    pub max_new_tokens: usize,
    /// stop after emitting any of these (the stop token is included in the output)
    pub stop_tokens: Vec<u32>,
    /// prompt tokens per prefill forward pass
    pub prefill_chunk: usize,
}

/// Greedy continuation of `prompt`; returns the new tokens only.
pub fn greedy_generate(model: &Llama, prompt: &[u32], opts: &GenerateOptions) -> Result<Vec<u32>> {
    greedy_generate_until(model, prompt, opts, |_| Ok(false))
}

/// Greedy continuation that also stops once `stop(new tokens so far)` says so (eval-tasks' stop strings).
pub fn greedy_generate_until(
    model: &Llama,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut stop: impl FnMut(&[u32]) -> Result<bool>,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        bail!("cannot generate from an empty prompt\nhint: the prompt needs at least one token (e.g. BOS)");
    }
    let dev = model.device().clone();
    let mut cache = KvCache::new(model.cfg.num_hidden_layers);
    let mut last_hidden = None;
    for chunk in prompt.chunks(opts.prefill_chunk.max(1)) {
        let x = Tensor::new(chunk, &dev)?.unsqueeze(0)?; // (1, t)
        let h = model.forward_cached(&x, &mut cache)?; // (1, t, C)
        last_hidden = Some(h.narrow(1, chunk.len() - 1, 1)?);
    }
    let mut out = vec![];
    let mut h = match last_hidden {
        Some(h) => h,
        None => bail!("empty prompt"),
    };
    for _ in 0..opts.max_new_tokens {
        let logits = model.logits(&h)?.to_dtype(DType::F32)?.flatten_all()?; // (V)
        let next = logits.argmax(D::Minus1)?.to_scalar::<u32>()?;
        out.push(next);
        if opts.stop_tokens.contains(&next) || stop(&out)? {
            break;
        }
        let x = Tensor::new(&[next], &dev)?.unsqueeze(0)?;
        h = model.forward_cached(&x, &mut cache)?;
    }
    Ok(out)
}
