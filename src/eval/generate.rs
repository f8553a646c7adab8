//! Greedy decoding with a per-layer KV cache; the prompt is prefilled in chunks so memory stays bounded.
//!
//! Reference: HF `generate(do_sample=False)` for base-model evaluation.
//! The non-obvious decision: prefill chunks reuse the same causal attention op with Tq < Tk, so a chunked
//! prefill computes exactly what one full forward would (tested against full recomputation). Dynamic
//! NTK rebuilds frequencies per call from the current length, as HF does, so cached keys of a dynamic
//! model keep the base they were written with (HF behaves the same). `harpe generate` runs it on token
//! ids and times it (the decode benchmark against transformers' `generate`). Not done here: sampling, beams.
use crate::data::tokenize::PromptBos;
use crate::eval::ppl::ScoringModel;
use crate::model::llama::{KvCache, Llama, Tokens};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, D};
use std::time::Instant;
use tokenizers::Tokenizer;

/// `harpe generate`: greedy continuation of token ids under a model directory, timed.
#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// the model flags of the scoring commands (--loss-chunk does not apply here)
    #[command(flatten)]
    pub scoring: ScoringModel,
    /// prompt token ids, comma-separated (e.g. 1,15043,29892)
    #[arg(long, value_name = "IDS")]
    pub prompt_ids: String,
    /// new tokens to generate (exactly this many: no stop token)
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// prompt tokens per prefill forward pass
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
}

/// Print one JSON line: the new tokens, seconds, and new tokens per second of the whole call.
pub fn run(a: GenerateArgs) -> Result<()> {
    let prompt: Vec<u32> = a
        .prompt_ids
        .split(',')
        .map(|s| s.trim().parse::<u32>())
        .collect::<std::result::Result<_, _>>()
        .with_context(|| format!("--prompt-ids `{}`\nhint: pass token ids as 1,2,3", a.prompt_ids))?;
    let model = a.scoring.load()?;
    let opts =
        GenerateOptions { max_new_tokens: a.max_new_tokens, stop_tokens: vec![], prefill_chunk: a.prefill_chunk };
    let t0 = Instant::now();
    let out = greedy_generate(&model, &prompt, &opts)?;
    let secs = t0.elapsed().as_secs_f64();
    let line = serde_json::json!({
        "prompt_tokens": prompt.len(),
        "new_tokens": out,
        "seconds": secs,
        "tokens_per_s": out.len() as f64 / secs,
    });
    println!("{line}");
    Ok(())
}

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
    // checked here, on the host: on CUDA an id past the embedding would be read out of bounds
    if let Some((pos, &id)) = prompt.iter().enumerate().find(|(_, &id)| id as usize >= model.cfg.vocab_size) {
        bail!(
            "the prompt's token {pos} is id {id}, outside the model's vocabulary of {}\nhint: the tokenizer does not belong to this model (check its tokenizer.json against config.json's vocab_size)",
            model.cfg.vocab_size
        );
    }
    let dev = model.device().clone();
    let mut cache = KvCache::new(model.cfg.num_hidden_layers);
    let mut last_hidden = None;
    for chunk in prompt.chunks(opts.prefill_chunk.max(1)) {
        let x = Tensor::new(chunk, &dev)?.unsqueeze(0)?; // (1, t)
        let h = model.forward(&x, Tokens::Cached(&mut cache))?; // (1, t, C)
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
        h = model.forward(&x, Tokens::Cached(&mut cache))?;
    }
    Ok(out)
}

/// The prediction rule of base-model evaluation: the prompt encoded under `bos` (`PromptBos::Auto`: the
/// tokenizer's own special tokens, as RULER's HF runner), greedy, stop at EOS (dropped), the new tokens
/// decoded with special tokens skipped. Shared by `eval-niah` and the passkey check during training.
pub fn predict_text(
    model: &Llama,
    tok: &Tokenizer,
    prompt: &str,
    max_new_tokens: usize,
    prefill_chunk: usize,
    bos: PromptBos,
) -> Result<String> {
    let eos = &model.cfg.eos_token_id;
    let ids = bos.encode(tok, prompt, model.cfg.bos_token_id)?;
    let opts = GenerateOptions { max_new_tokens, stop_tokens: eos.clone(), prefill_chunk: prefill_chunk.max(1) };
    let mut new = greedy_generate(model, &ids, &opts)?;
    if new.last().is_some_and(|t| eos.contains(t)) {
        new.pop();
    }
    tok.decode(&new, true).map_err(|e| anyhow::anyhow!("tokenizer cannot decode the generation: {e}"))
}
