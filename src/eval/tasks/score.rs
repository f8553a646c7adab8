//! Running the model on the harness's requests: multiple-choice log-likelihoods with the shared context
//! computed once, and greedy generation with stop strings.
//!
//! Reference: lm-evaluation-harness 0.4.13 `api/model.py` `TemplateLM._encode_pair` / `loglikelihood`,
//! `models/huggingface.py` `HFLM.tok_encode` (the tokenizer's own special tokens: BOS for Llama),
//! `_loglikelihood_tokens` (input (context + continuation)[-(max_length + 1):][:-1], log-softmax, the
//! continuation's summed log-probabilities and whether each was the argmax), `generate_until` (context
//! left-truncated to max_length - max_gen_toks, `max_gen_toks` 256, EOS added to the stop strings,
//! `tok_decode(skip_special_tokens=True)`, `postprocess_generated_text`: cut at each stop string in turn).
//! The rules, pinned:
//! - trailing whitespace of the context moves to the continuation; context = encode(context),
//!   continuation = encode(context + continuation)[len(context):] (the harness's split, not encode(cont));
//! - one prefill of the context (KV cache) serves every choice; the choices' continuations run together
//!   as one right-padded batch of up to `--batch` rows on a copy of that cache (causal attention: padding
//!   after a row never reaches it), so the log-probabilities are those of the full sequence; questions
//!   whose continuations are single tokens (MMLU's " A".." D") need no continuation pass at all and run
//!   `--batch` questions per right-padded forward;
//! - log-probabilities by `model::loss::nll_rows` (the one NLL rule: f32 logits, f64 log-sum-exp), `--loss-chunk`
//!   positions at a time; a request longer than max_length + 1 tokens is left-truncated and scored alone.
//!
//! Not done here: rolling log-likelihoods, sampling, batched generation (one prompt at a time).
use crate::eval::generate::{greedy_generate_until, GenerateOptions};
use crate::eval::tasks::py_isspace;
use crate::model::llama::{KvCache, Tokens};
use crate::model::Llama;
use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Tensor, D};
use tokenizers::Tokenizer;

/// `HFLM.max_gen_toks`.
pub const MAX_GEN_TOKS: usize = 256;
/// Prompt tokens per prefill forward.
const PREFILL_CHUNK: usize = 2048;

/// One continuation's score: `(float(logits.sum()), bool(max_equal))`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChoiceScore {
    pub loglik: f64,
    pub is_greedy: bool,
}

/// The model, its tokenizer and the harness's length settings.
pub struct Scorer<'a> {
    pub model: &'a Llama,
    pub tok: &'a Tokenizer,
    /// the harness's `max_length` (the model's `max_position_embeddings` unless `--max-length`)
    pub max_length: usize,
    /// continuation rows per forward
    pub batch: usize,
    /// positions per chunk of the log-softmax
    pub chunk: usize,
}

impl Scorer<'_> {
    /// `tok_encode(s)`: the tokenizer's own special tokens (BOS for Llama).
    pub fn encode(&self, s: &str) -> Result<Vec<u32>> {
        let enc = self.tok.encode(s, true).map_err(|e| anyhow!("tokenization failed: {e}"))?;
        let ids = enc.get_ids().to_vec();
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.model.cfg.vocab_size) {
            bail!(
                "the tokenizer produced id {bad} >= vocab_size {}\nhint: the tokenizer does not belong to this model",
                self.model.cfg.vocab_size
            );
        }
        Ok(ids)
    }

    /// `_encode_pair(context, continuation)`: (context ids, continuation ids).
    pub fn encode_pair(&self, context: &str, continuation: &str) -> Result<(Vec<u32>, Vec<u32>)> {
        let trimmed = context.trim_end_matches(py_isspace);
        let (ctx, cont) = (trimmed, format!("{}{continuation}", &context[trimmed.len()..]));
        if ctx.is_empty() {
            bail!("internal: empty context\nhint: every task here has a non-empty prompt");
        }
        let whole = self.encode(&format!("{ctx}{cont}"))?;
        let ctx_ids = self.encode(ctx)?;
        let cont_ids = whole.get(ctx_ids.len()..).unwrap_or_default().to_vec();
        if cont_ids.is_empty() {
            bail!(
                "continuation {continuation:?} encodes to no tokens after its context (the harness asserts the same)\n\
                 hint: the tokenizer merges it into the context's last tokens; this task cannot be scored with it"
            );
        }
        Ok((ctx_ids, cont_ids))
    }

    /// Log-likelihood and greedy flag of `targets` from the hidden states predicting them, (n, C).
    fn score_rows(&self, hidden: &Tensor, targets: &[u32]) -> Result<ChoiceScore> {
        let dev = hidden.device();
        let (mut ll, mut greedy) = (0.0f64, true);
        for start in (0..targets.len()).step_by(self.chunk.max(1)) {
            let len = self.chunk.max(1).min(targets.len() - start);
            let logits = self.model.logits(&hidden.narrow(0, start, len)?)?.to_dtype(DType::F32)?; // (len, V)
            let idx = Tensor::new(&targets[start..start + len], dev)?.unsqueeze(1)?; // (len, 1)
            let nll = crate::model::loss::nll_rows(&logits, &idx, DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            ll -= nll.iter().sum::<f64>();
            let am = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
            greedy &= am.iter().zip(&targets[start..start + len]).all(|(a, t)| a == t);
        }
        Ok(ChoiceScore { loglik: ll, is_greedy: greedy })
    }

    /// A request scored alone on its left-truncated input (longer than max_length + 1 tokens).
    fn score_truncated(&self, ctx: &[u32], cont: &[u32]) -> Result<ChoiceScore> {
        let all: Vec<u32> = ctx.iter().chain(cont).copied().collect();
        let inp = &all[all.len().saturating_sub(self.max_length + 1)..all.len() - 1];
        let x = Tensor::new(inp, self.model.device())?.unsqueeze(0)?; // (1, T)
        let h = self.model.forward(&x, Tokens::At(0))?.squeeze(0)?; // (T, C)
        let n = cont.len().min(inp.len());
        self.score_rows(&h.narrow(0, inp.len() - n, n)?, &cont[cont.len() - n..])
    }

    /// Scores of every continuation after one shared context: the context prefilled once, the
    /// continuations batched on copies of its KV cache.
    pub fn score_choices(&self, ctx: &[u32], conts: &[Vec<u32>]) -> Result<Vec<ChoiceScore>> {
        let dev = self.model.device().clone();
        let mut out = vec![None; conts.len()];
        let fits = |c: &Vec<u32>| ctx.len() + c.len() <= self.max_length + 1;
        for (i, c) in conts.iter().enumerate().filter(|(_, c)| !fits(c)) {
            out[i] = Some(self.score_truncated(ctx, c)?);
        }
        let todo: Vec<usize> = (0..conts.len()).filter(|&i| fits(&conts[i])).collect();
        if !todo.is_empty() {
            let mut cache = KvCache::new(self.model.cfg.num_hidden_layers);
            let mut last = None;
            for part in ctx.chunks(PREFILL_CHUNK) {
                let x = Tensor::new(part, &dev)?.unsqueeze(0)?; // (1, t)
                let h = self.model.forward(&x, Tokens::Cached(&mut cache))?; // (1, t, C)
                last = Some(h.narrow(1, part.len() - 1, 1)?.squeeze(0)?); // (1, C)
            }
            let last = last.ok_or_else(|| anyhow!("internal: empty context"))?;
            for group in todo.chunks(self.batch.max(1)) {
                let longest = group.iter().map(|&i| conts[i].len()).max().unwrap_or(1);
                let hidden = if longest > 1 {
                    // continuation tokens but the last, right-padded: (B, longest - 1)
                    let (b, t) = (group.len(), longest - 1);
                    let mut ids = vec![0u32; b * t];
                    for (r, &i) in group.iter().enumerate() {
                        let c = &conts[i][..conts[i].len() - 1];
                        ids[r * t..r * t + c.len()].copy_from_slice(c);
                    }
                    let x = Tensor::from_vec(ids, (b, t), &dev)?;
                    let mut bc = broadcast_cache(&cache, b)?;
                    Some(self.model.forward(&x, Tokens::Cached(&mut bc))?) // (B, t, C)
                } else {
                    None
                };
                for (r, &i) in group.iter().enumerate() {
                    let n = conts[i].len();
                    let rows = match (&hidden, n) {
                        (Some(h), n) if n > 1 => Tensor::cat(&[&last, &h.get(r)?.narrow(0, 0, n - 1)?], 0)?, // (n, C)
                        _ => last.clone(),
                    };
                    out[i] = Some(self.score_rows(&rows, &conts[i])?);
                }
            }
        }
        out.into_iter().map(|s| s.ok_or_else(|| anyhow!("internal: a continuation was not scored"))).collect()
    }

    /// Whether a question can join a batch of one-token questions (MMLU's " A" .. " D"): every
    /// continuation is one token and nothing is truncated.
    pub fn single_token(&self, ctx: &[u32], conts: &[Vec<u32>]) -> bool {
        conts.iter().all(|c| c.len() == 1) && ctx.len() < self.max_length + 1
    }

    /// Scores of several one-token questions at once: their contexts right-padded into one (B, T) batch
    /// (causal attention: the padding after a row never reaches it), each row's last context position
    /// scoring every choice.
    pub fn score_single_token_batch(&self, items: &[(Vec<u32>, Vec<Vec<u32>>)]) -> Result<Vec<Vec<ChoiceScore>>> {
        let (b, t) = (items.len(), items.iter().map(|(c, _)| c.len()).max().unwrap_or(0));
        if b == 0 || t == 0 {
            return Ok(vec![]);
        }
        let mut ids = vec![0u32; b * t];
        for (r, (ctx, _)) in items.iter().enumerate() {
            ids[r * t..r * t + ctx.len()].copy_from_slice(ctx);
        }
        let x = Tensor::from_vec(ids, (b, t), self.model.device())?;
        let h = self.model.forward(&x, Tokens::At(0))?; // (B, T, C)
        let mut out = Vec::with_capacity(b);
        for (r, (ctx, conts)) in items.iter().enumerate() {
            let last = h.get(r)?.narrow(0, ctx.len() - 1, 1)?; // (1, C)
            out.push(conts.iter().map(|c| self.score_rows(&last, c)).collect::<Result<Vec<_>>>()?);
        }
        Ok(out)
    }

    /// `generate_until(context, until)`: greedy decoding of at most 256 tokens, stopping at EOS or once
    /// the decoded text holds a stop string, then cut at each stop string in turn.
    pub fn generate_until(&self, context: &str, until: &[&str]) -> Result<String> {
        let mut ids = self.encode(context)?;
        let max_ctx = self.max_length.checked_sub(MAX_GEN_TOKS).filter(|&m| m > 0).ok_or_else(|| {
            anyhow!(
                "max_length {} leaves no room for the prompt after {MAX_GEN_TOKS} generated tokens\nhint: pass a larger \
                 --max-length",
                self.max_length
            )
        })?;
        if ids.len() > max_ctx {
            ids.drain(..ids.len() - max_ctx);
        }
        let eos = self.model.cfg.eos_token_id.clone();
        // handle_stop_sequences: the EOS token's text (decoded with special tokens) is a stop string too
        let eos_text = match eos.first() {
            Some(&e) => self.tok.decode(&[e], false).map_err(|e| anyhow!("cannot decode EOS: {e}"))?,
            None => String::new(),
        };
        let mut until: Vec<&str> = until.to_vec();
        if !eos_text.is_empty() && !until.contains(&eos_text.as_str()) {
            until.push(&eos_text);
        }
        let opts = GenerateOptions { max_new_tokens: MAX_GEN_TOKS, stop_tokens: eos, prefill_chunk: PREFILL_CHUNK };
        let decode = |t: &[u32]| self.tok.decode(t, true).map_err(|e| anyhow!("cannot decode the generation: {e}"));
        let new = greedy_generate_until(self.model, &ids, &opts, |t| {
            let s = decode(t)?;
            Ok(until.iter().any(|u| !u.is_empty() && s.contains(u)))
        })?;
        let mut s = decode(&new)?;
        for term in until.iter().filter(|u| !u.is_empty()) {
            if let Some(i) = s.find(term) {
                s.truncate(i);
            }
        }
        Ok(s)
    }
}

/// A copy of a batch-1 KV cache for `b` rows (every row sees the same context).
fn broadcast_cache(cache: &KvCache, b: usize) -> Result<KvCache> {
    let mut kv = Vec::with_capacity(cache.kv.len());
    for e in &cache.kv {
        kv.push(match e {
            Some((k, v)) if b > 1 => Some((k.repeat((b, 1, 1, 1))?, v.repeat((b, 1, 1, 1))?)),
            other => other.clone(),
        });
    }
    Ok(KvCache { kv, pos: cache.pos })
}
