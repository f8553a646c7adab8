//! Passkey retrieval (Mohtashami & Jaggi 2023, as YaRN and LongLoRA run it): a 5-digit key hidden in
//! repeated noise, asked back at the end. The cheap sanity check before RULER.
//!
//! Reference: landmark-attention `run_test.py`, yarn `eval/passkey.py`.
//!
//! The non-obvious decisions: the garbage length is calibrated per target length in characters with
//! the model's own tokenizer so that BOS + prompt stays at or below `length - 16` tokens, and
//! depths come from a fixed grid (`n_prefix = round(depth * n_garbage)`) rather than YaRN's uniform
//! draw, so accuracy can be reported per depth. Prefix and suffix are both `garbage_inf[..n]`, as in
//! the reference code (both start at the beginning and may cut a word).
//! Not here: running the model; scoring beyond "first integer equals the key".

use crate::eval::niah::NOISE;
use crate::eval::niah_io::Record;
use crate::eval::niah_sizing::count_tokens;
use crate::eval::pyrandom::PyRandom;
use anyhow::{bail, Result};
use tokenizers::Tokenizer;

/// Tokens the model may generate for a passkey answer.
pub const PASSKEY_MAX_NEW_TOKENS: usize = 10;

/// Tokens kept free below the target length, so BOS + prompt never exceeds it.
const MARGIN: usize = 16;

const INTRO: &str = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you about the important information there.";

/// The passkey prompt with `n_garbage` characters of noise split at `depth` (0..=1).
pub fn passkey_prompt(n_garbage: usize, depth: f64, key: u32) -> String {
    let n_prefix = (depth * n_garbage as f64).round() as usize;
    let n_suffix = n_garbage - n_prefix.min(n_garbage);
    let garbage = garbage(n_garbage);
    [
        INTRO,
        &garbage[..n_prefix.min(n_garbage)],
        &format!("The pass key is {key}. Remember it. {key} is the pass key."),
        &garbage[..n_suffix],
        "What is the pass key? The pass key is",
    ]
    .join("\n")
}

/// `" ".join([NOISE] * R)` long enough for `n` characters.
fn garbage(n: usize) -> String {
    let reps = n / (NOISE.len() + 1) + 1;
    vec![NOISE; reps].join(" ")
}

/// Tokens the model may see for a prompt: the prompt and a BOS slot, whether or not the BOS rule
/// (`PromptBos`) adds one, so the prompts are the same under every rule.
fn prompt_tokens(tok: &Tokenizer, prompt: &str) -> Result<usize> {
    Ok(count_tokens(tok, prompt)? + 1)
}

/// Largest garbage length (characters) whose prompt keeps BOS + prompt <= `length - 16` tokens.
pub fn calibrate(tok: &Tokenizer, length: usize) -> Result<usize> {
    let budget = length.saturating_sub(MARGIN);
    let fits = |n: usize| -> Result<bool> { Ok(prompt_tokens(tok, &passkey_prompt(n, 0.5, 50000))? <= budget) };
    if !fits(0)? {
        let need = prompt_tokens(tok, &passkey_prompt(0, 0.5, 50000))? + MARGIN;
        bail!(
            "length {length} is too short for the passkey prompt: even without noise it needs more than {budget} \
             tokens\nhint: use --lengths of at least {need} with this tokenizer"
        );
    }
    let mut lo = 0;
    let mut hi = 1024;
    while fits(hi)? {
        lo = hi;
        hi *= 2;
    }
    // Invariant: fits(lo), !fits(hi).
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

/// `linspace(0, 1, n)`.
pub fn depth_grid(n: usize) -> Vec<f64> {
    match n {
        0 => vec![],
        1 => vec![0.5],
        _ => (0..n).map(|i| i as f64 / (n - 1) as f64).collect(),
    }
}

/// `samples` passkey prompts at `length` tokens: depth `i % depths`, key `randint(1, 50000)` from
/// `Random(seed)` (the same keys at every length).
pub fn make_samples(tok: &Tokenizer, length: usize, samples: usize, depths: usize, seed: i64) -> Result<Vec<Record>> {
    let n_garbage = calibrate(tok, length)?;
    let grid = depth_grid(depths.max(1));
    let mut rng = PyRandom::new(seed);
    let mut out = Vec::with_capacity(samples);
    for i in 0..samples {
        let depth = grid[i % grid.len()];
        let key = rng.randint(1, 50000) as u32;
        let mut n = n_garbage;
        let input = loop {
            let p = passkey_prompt(n, depth, key);
            if prompt_tokens(tok, &p)? + PASSKEY_MAX_NEW_TOKENS <= length || n == 0 {
                break p;
            }
            n = n.saturating_sub(128);
        };
        let length = count_tokens(tok, &input)? + PASSKEY_MAX_NEW_TOKENS;
        out.push(Record {
            line: i,
            index: i as i64,
            input,
            answer_prefix: None,
            outputs: vec![key.to_string()],
            length: Some(length),
            depth: Some(depth * 100.0),
        });
    }
    Ok(out)
}

/// 1.0 if the first run of digits in the prediction is the key as an integer, else 0.0.
pub fn passkey_score(pred: &str, key: &str) -> f64 {
    let start = pred.find(|c: char| c.is_ascii_digit());
    let Some(start) = start else { return 0.0 };
    let digits: &str = &pred[start..];
    let end = digits.find(|c: char| !c.is_ascii_digit()).unwrap_or(digits.len());
    let got = digits[..end].trim_start_matches('0');
    let want = key.trim_start_matches('0');
    f64::from(u8::from(got == want))
}
