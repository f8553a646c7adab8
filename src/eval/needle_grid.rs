//! The gkamradt needle-in-a-haystack grid in Fu et al. (2024)'s form: one needle sentence at a
//! grid of context lengths x depth percents in Paul Graham essays, scored by word-set recall.
//!
//! Reference: FranxYao/Long-Context-Data-Engineering `eval/needle/needle_in_haystack.py` and
//! `visualize.py`; gkamradt/LLMTest_NeedleInAHaystack.
//!
//! The non-obvious decisions: insertion works on token ids and backs up to just after a period token
//! (any vocabulary piece that is `.` once a leading `▁`/`Ġ` is dropped), like F's hard-coded Llama ids;
//! the essay files are read in sorted order and repeated until the longest length is covered (F and G
//! repeat too, in unsorted glob order); special tokens are never spliced into the text (F's `<s>`
//! artefacts: a literal `<s>` at the start and before the needle). Both F's headline score (word-set
//! recall, at most 11/12) and a clean exact-phrase score are reported.
//! Not here: ROUGE (F's stored JSON score), the LLM judge of G.

use crate::eval::niah::Essays;
use crate::eval::niah_io::Record;
use crate::eval::niah_sizing::count_tokens;
use anyhow::{bail, Result};
use std::collections::HashSet;
use tokenizers::Tokenizer;

/// The needle sentence, with its surrounding newlines.
pub const NEEDLE: &str =
    "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n";
/// The question asked after the haystack.
pub const QUESTION: &str = "What is the best thing to do in San Francisco?";
/// The expected answer F scores against.
pub const EXPECTED: &str = "eat a sandwich and sit in Dolores Park on a sunny day.";
/// Tokens left free below each length (`final_context_length_buffer`).
pub const BUFFER: usize = 200;
/// Tokens generated per cell (F: `max_new_tokens=50`).
pub const GRID_MAX_NEW_TOKENS: usize = 50;

/// `np.round(np.linspace(start, end, n))`, half to even.
pub fn linspace_round(start: f64, end: f64, n: usize) -> Vec<u64> {
    match n {
        0 => vec![],
        1 => vec![start.round_ties_even() as u64],
        _ => (0..n).map(|i| (start + (end - start) * i as f64 / (n - 1) as f64).round_ties_even() as u64).collect(),
    }
}

/// F's prompt around a context.
pub fn grid_prompt(context: &str) -> String {
    format!(
        "<|im_start|> This is a very long story book: <book> {context} </book>.\n Based on the content of the book, \
         Question: {QUESTION}\nAnswer:"
    )
}

/// Token ids of the period pieces (`.`, `▁.`, `Ġ.`) in the tokenizer's vocabulary.
pub fn period_ids(tok: &Tokenizer) -> HashSet<u32> {
    tok.get_vocab(true)
        .into_iter()
        .filter(|(piece, _)| piece.trim_start_matches(['▁', 'Ġ']) == ".")
        .map(|(_, id)| id)
        .collect()
}

/// F's `insert_needle` on token ids: trim the context to `length - BUFFER - needle`, then insert the
/// needle at `depth` percent, backed up to just after a period token (or at the end for depth 100).
pub fn insert_needle(context: &[u32], needle: &[u32], depth: f64, length: usize, periods: &HashSet<u32>) -> Vec<u32> {
    let budget = length.saturating_sub(BUFFER);
    let mut tc = &context[..context.len().min(length)];
    if tc.len() + needle.len() > budget {
        tc = &tc[..budget.saturating_sub(needle.len())];
    }
    if depth >= 100.0 {
        return [tc, needle].concat();
    }
    let mut p = (tc.len() as f64 * depth / 100.0) as usize;
    while p > 0 && !periods.contains(&tc[p - 1]) {
        p -= 1;
    }
    [&tc[..p], needle, &tc[p..]].concat()
}

/// The haystack token ids: the essays, repeated whole until they cover `max_len` tokens.
pub fn haystack_ids(tok: &Tokenizer, essays: &Essays, max_len: usize) -> Result<Vec<u32>> {
    let one = count_tokens(tok, &essays.text)?;
    if one == 0 {
        bail!("the essays {} tokenize to nothing\nhint: pass a real text corpus with --essays", essays.origin);
    }
    let passes = max_len.div_ceil(one).max(1);
    let text = essays.text.repeat(passes);
    let enc = tok
        .encode_fast(text.as_str(), false)
        .map_err(|e| anyhow::anyhow!("tokenizer failed on the essays {}: {e}", essays.origin))?;
    Ok(enc.get_ids().to_vec())
}

/// One grid cell per depth at `length`: prompt, the expected phrase, depth.
pub fn make_samples(tok: &Tokenizer, haystack: &[u32], length: usize, depths: &[u64]) -> Result<Vec<Record>> {
    if length <= BUFFER + 64 {
        bail!(
            "needle-grid length {length} is too short: it must exceed {} tokens\nhint: use larger --grid-lengths",
            BUFFER + 64
        );
    }
    let periods = period_ids(tok);
    let needle = tok
        .encode_fast(NEEDLE, false)
        .map_err(|e| anyhow::anyhow!("tokenizer failed on the needle: {e}"))?
        .get_ids()
        .to_vec();
    let mut out = Vec::with_capacity(depths.len());
    for (i, &d) in depths.iter().enumerate() {
        // F's construction; a tokenizer whose decode/encode round trip is lossy can overshoot, and then
        // the haystack is cut further (binary search) until the prompt fits `length - 50`.
        let build = |cap: usize| -> Result<(String, usize)> {
            let ids = insert_needle(&haystack[..cap.min(haystack.len())], &needle, d as f64, length, &periods);
            let context =
                tok.decode(&ids, true).map_err(|e| anyhow::anyhow!("tokenizer cannot decode the haystack: {e}"))?;
            let input = grid_prompt(&context);
            let n = count_tokens(tok, &input)?;
            Ok((input, n))
        };
        let fits = |n: usize| n + GRID_MAX_NEW_TOKENS <= length;
        let (mut input, mut n) = build(length)?;
        if !fits(n) {
            let (mut lo, mut hi) = (0usize, length);
            let (i0, n0) = build(0)?;
            if !fits(n0) {
                bail!("needle-grid length {length} cannot hold even the bare prompt ({n0} tokens)\nhint: use larger --grid-lengths");
            }
            (input, n) = (i0, n0);
            while hi - lo > 1 {
                let mid = (lo + hi) / 2;
                let (im, nm) = build(mid)?;
                if fits(nm) {
                    (lo, input, n) = (mid, im, nm);
                } else {
                    hi = mid;
                }
            }
        }
        out.push(Record {
            line: i,
            index: i as i64,
            input,
            answer_prefix: None,
            outputs: vec![EXPECTED.to_string()],
            length: Some(n + GRID_MAX_NEW_TOKENS),
            depth: Some(d as f64),
        });
    }
    Ok(out)
}

/// F's heatmap score: `|set(pred.lower().split()) ∩ set(expected)| / len(expected)`, at most 11/12.
pub fn fu_recall(pred: &str) -> f64 {
    let expected: Vec<String> = EXPECTED.to_lowercase().split_whitespace().map(str::to_string).collect();
    let got: HashSet<String> = pred.to_lowercase().split_whitespace().map(str::to_string).collect();
    let uniq: HashSet<&String> = expected.iter().collect();
    uniq.iter().filter(|w| got.contains(w.as_str())).count() as f64 / expected.len() as f64
}

/// Clean score: 1.0 if the answer phrase (lowercase, whitespace-normalised, no final period) occurs.
pub fn exact_phrase(pred: &str) -> f64 {
    let norm = |s: &str| s.to_lowercase().split_whitespace().collect::<Vec<_>>().join(" ");
    let want = norm(EXPECTED.trim_end_matches('.'));
    f64::from(u8::from(norm(pred).contains(&want)))
}
