//! RULER's haystack sizing: how many haystack units fit a target length with the model's tokenizer, and
//! the samples made at that size (`generate_samples` of `niah.py`).
//!
//! Reference: `NVIDIA/RULER:scripts/data/synthetic/niah.py` (R-Dec24's linear search, R-HEAD's binary
//! search), `NVIDIA/RULER:scripts/data/tokenizer.py` (`text_to_tokens`: no special tokens).
//!
//! The non-obvious decisions: every trial prompt draws from the task's one RNG, as RULER's global
//! `random` does, so the samples after sizing are RULER's bit for bit given the same token counts; token
//! counts carry no BOS (RULER's sizing counts none, whatever the model is later shown); an essay
//! haystack too short for a length is an error instead of RULER's silent cap (R-Dec24) or tiling (R-HEAD).
//! Not here: the prompts (`niah.rs`), running the model (`niah_run.rs`).
use crate::eval::niah::{HaystackKind, NiahGenerator, NIAH_TOKENS_TO_GENERATE};
use anyhow::{bail, Result};
use tokenizers::Tokenizer;

/// How the haystack size is searched for a target length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Sizing {
    /// RULER since 2025-06 (R-HEAD): binary search, about log2(T) trial prompts.
    Binary,
    /// RULER R-Dec24 (the code HARPE could have used): linear search in increments; slow at 128K.
    Linear,
}

/// Token count without BOS/EOS (RULER's `text_to_tokens`).
pub fn count_tokens(tok: &Tokenizer, text: &str) -> Result<usize> {
    let enc = tok
        .encode_fast(text, false)
        .map_err(|e| anyhow::anyhow!("tokenizer failed on a {}-byte prompt: {e}", text.len()))?;
    Ok(enc.len())
}

/// A sized sample as RULER writes it.
#[derive(Clone, Debug)]
pub struct SizedSample {
    /// The prompt (answer prefix included).
    pub input: String,
    /// Gold answers.
    pub outputs: Vec<String>,
    /// `tok(input) + tokens_to_generate`.
    pub length: usize,
    /// Needle depths in percent.
    pub depths: Vec<f64>,
}

/// `generate_samples`: size the haystack to `max_len` and make `num_samples` samples.
pub fn generate_samples(
    generator: &mut NiahGenerator,
    tok: &Tokenizer,
    max_len: usize,
    num_samples: usize,
    sizing: Sizing,
    task_name: &str,
) -> Result<Vec<SizedSample>> {
    let inc = match generator.haystack() {
        HaystackKind::Essay => 500,
        _ if max_len < 4096 => 5,
        _ => 25,
    };
    let n = match sizing {
        Sizing::Binary => size_binary(generator, tok, max_len, inc)?,
        Sizing::Linear => size_linear(generator, tok, max_len, inc)?,
    };
    let n = cap_to_essays(generator, tok, max_len, n)?;
    let mut out = Vec::with_capacity(num_samples);
    for _ in 0..num_samples {
        out.push(fitted_sample(generator, tok, max_len, n, inc, task_name)?);
    }
    Ok(out)
}

/// RULER R-HEAD's sizing: binary search for the largest haystack whose prompt fits `max_len`.
fn size_binary(generator: &mut NiahGenerator, tok: &Tokenizer, max_len: usize, inc: usize) -> Result<usize> {
    let g = NIAH_TOKENS_TO_GENERATE;
    let limit = generator.haystack_limit();
    let probe = generator.generate(limit.map_or(inc, |l| inc.min(l)));
    let est = count_tokens(tok, &probe.input)? as f64 / inc as f64;
    let mut lo = inc;
    let mut hi = ((max_len as f64 / est * 3.0) as usize).max(2 * inc);
    if let Some(l) = limit {
        hi = hi.min(l);
    }
    let mut best = None;
    while lo <= hi {
        let mid = (lo + hi) / 2;
        let s = generator.generate(mid);
        if count_tokens(tok, &s.input)? + g <= max_len {
            best = Some(mid);
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    Ok(best.unwrap_or(inc))
}

/// RULER R-Dec24's sizing: grow the haystack by `inc` until prompt and answers pass `max_len`.
fn size_linear(generator: &mut NiahGenerator, tok: &Tokenizer, max_len: usize, inc: usize) -> Result<usize> {
    let g = NIAH_TOKENS_TO_GENERATE;
    let limit = generator.haystack_limit();
    let cap = |n: usize| limit.map_or(n, |l| n.min(l));
    let mut n = inc;
    let mut total = 0;
    while total + g < max_len {
        let s = generator.generate(cap(n));
        total = count_tokens(tok, &format!("{} {}", s.input, s.answers.join(" ")))?;
        if total + g > max_len {
            n -= inc;
            break;
        }
        if limit.is_some_and(|l| n > l) {
            n = cap(n);
            break;
        }
        n += inc;
    }
    Ok(n.max(inc))
}

/// A haystack size at or past the essays' word count becomes that count, or an error when the whole
/// corpus is still shorter than `max_len`.
fn cap_to_essays(generator: &mut NiahGenerator, tok: &Tokenizer, max_len: usize, n: usize) -> Result<usize> {
    let g = NIAH_TOKENS_TO_GENERATE;
    let Some(l) = generator.haystack_limit() else { return Ok(n) };
    if n < l {
        return Ok(n);
    }
    let probe = generator.generate(l);
    let have = count_tokens(tok, &probe.input)?;
    if have + g < max_len {
        let per_word = have as f64 / l as f64;
        let need = ((max_len - g) as f64 / per_word).ceil() as usize;
        bail!(
            "the essay haystack {} is too short for length {max_len}: it has {l} words (a prompt of {have} \
             tokens), and {max_len} tokens need about {need} words\nhint: pass a longer --essays corpus, or \
             drop lengths above {}",
            generator.essays_origin(),
            have + g
        );
    }
    Ok(l)
}

/// One sample of haystack size `n`, shrunk by `inc` until its prompt fits `max_len` (as RULER does).
fn fitted_sample(
    generator: &mut NiahGenerator,
    tok: &Tokenizer,
    max_len: usize,
    n: usize,
    inc: usize,
    task_name: &str,
) -> Result<SizedSample> {
    let g = NIAH_TOKENS_TO_GENERATE;
    let mut used = n;
    let mut tries_at_floor = 0;
    loop {
        let s = generator.generate(used);
        let length = count_tokens(tok, &s.input)? + g;
        if length <= max_len {
            return Ok(SizedSample { input: s.input, outputs: s.answers, length, depths: s.depths });
        }
        if used > inc {
            used -= inc;
        } else {
            // RULER retries forever at the smallest step; new keys can change the length a little.
            tries_at_floor += 1;
            if tries_at_floor > 20 {
                bail!(
                    "length {max_len} is too short for task {task_name}: a haystack of {used} units (the smallest \
                     RULER step) already gives a prompt over {max_len} - {g} tokens\nhint: use a larger --lengths value"
                );
            }
        }
    }
}
