//! Tokenization with the `tokenizers` crate, document separators, and the tokenizer hash.
//!
//! Reference: Fu et al.'s packer calls the Llama tokenizer with its defaults, i.e. every document is
//! prefixed with BOS and gets no EOS (spec §4.1); that is our default (`Separator::Bos`).
//! The non-obvious decision: we always encode with `add_special_tokens = false` and add the separator
//! ourselves, so the policy is the same for every tokenizer (Llama, GPT-style, test WordLevel) and the
//! separator is counted in the budget. What this file does not do: parallelism (the caller maps
//! batches with rayon) or any text normalisation beyond the tokenizer's own.
use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use tokenizers::Tokenizer;

/// How documents are separated in the packed stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Separator {
    /// BOS before each document (Llama / Fu et al. default)
    Bos,
    /// EOS after each document (GPT-style)
    Eos,
    /// BOS before and EOS after each document
    #[value(name = "bos+eos")]
    #[serde(rename = "bos+eos")]
    BosEos,
    /// no separator tokens
    None,
}

/// Separator token ids resolved against a tokenizer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SepTokens {
    /// the policy
    pub policy: Separator,
    /// BOS id when the policy uses it
    pub bos: Option<u32>,
    /// EOS id when the policy uses it
    pub eos: Option<u32>,
}

/// BOS spellings tried in order when no `--bos-token` is given.
const BOS_NAMES: [&str; 4] = ["<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"];
/// EOS spellings tried in order when no `--eos-token` is given.
const EOS_NAMES: [&str; 4] = ["</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>"];

impl SepTokens {
    /// Resolve the policy's token ids; `bos_name`/`eos_name` override the usual spellings.
    pub fn resolve(tok: &Tokenizer, policy: Separator, bos_name: Option<&str>, eos_name: Option<&str>) -> Result<Self> {
        let find = |given: Option<&str>, names: &[&str], what: &str, flag: &str| -> Result<u32> {
            match given {
                Some(n) => tok.token_to_id(n).ok_or_else(|| {
                    anyhow!("the tokenizer has no token {n:?} (given as {flag})\nhint: check the spelling in tokenizer.json")
                }),
                None => names.iter().find_map(|n| tok.token_to_id(n)).ok_or_else(|| {
                    anyhow!(
                        "the tokenizer has none of the usual {what} tokens {names:?}\nhint: pass {flag} NAME, or \
                         --separator none"
                    )
                }),
            }
        };
        let uses_bos = matches!(policy, Separator::Bos | Separator::BosEos);
        let uses_eos = matches!(policy, Separator::Eos | Separator::BosEos);
        let bos = if uses_bos { Some(find(bos_name, &BOS_NAMES, "BOS", "--bos-token")?) } else { None };
        let eos = if uses_eos { Some(find(eos_name, &EOS_NAMES, "EOS", "--eos-token")?) } else { None };
        Ok(SepTokens { policy, bos, eos })
    }

    /// Number of separator tokens added per document (or per piece, for `cut`).
    pub fn len(&self) -> u64 {
        u64::from(self.bos.is_some()) + u64::from(self.eos.is_some())
    }

    /// True when no separator tokens are added.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Append `piece` wrapped in the separators to `out`.
    pub fn wrap_into(&self, piece: &[u32], out: &mut Vec<u32>) {
        out.extend(self.bos);
        out.extend_from_slice(piece);
        out.extend(self.eos);
    }
}

/// Load a `tokenizer.json`.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    Tokenizer::from_file(path).map_err(|e| {
        anyhow!(
            "cannot load tokenizer {}: {e}\nhint: pass the model's tokenizer.json (HF fast-tokenizer format)",
            path.display()
        )
    })
}

/// Hex sha256 of the tokenizer.json bytes; `train` refuses a dataset whose hash differs from the model's.
pub fn tokenizer_sha256(path: &Path) -> Result<String> {
    crate::util::sha256_file(path)
        .with_context(|| format!("hashing tokenizer {}\nhint: check that the file exists", path.display()))
}

/// The SentencePiece word-boundary marker.
const SPACE: char = '\u{2581}';

/// An exactly equivalent, faster tokenizer for Llama-layout BPE tokenizers, or `None`.
///
/// Llama-2 / Mistral `tokenizer.json` files have no pre-tokenizer, so `tokenizers` runs BPE over a whole
/// document as one "word" (cost grows faster than linearly with its length and the word cache never
/// hits). Splitting the normalized text before every run of `▁` changes no result when no vocabulary
/// token contains a `▁` preceded by another character: BPE merges only ever produce vocabulary tokens,
/// so no merge can cross such a split and both sides merge independently, in the same order. That
/// property is checked on the actual vocabulary here (it holds for Llama-2 and Mistral); the split is
/// then installed as a `Split` pre-tokenizer with the pattern `▁*[^▁]+|▁+` (each piece = a run of `▁`
/// plus the following non-`▁` characters). Also required: a BPE model without dropout, and no fusing
/// of unknown tokens across pieces (byte fallback or `fuse_unk = false`).
pub fn exact_word_split(tok: &Tokenizer) -> Option<Tokenizer> {
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::{Model, SplitDelimiterBehavior};
    if tok.get_pre_tokenizer().is_some() {
        return None;
    }
    let model = serde_json::to_value(tok.get_model()).ok()?;
    let is_bpe = model.get("type").and_then(|t| t.as_str()) == Some("BPE");
    let no_dropout = model.get("dropout").is_none_or(|d| d.is_null());
    let byte_fallback = model.get("byte_fallback").and_then(|b| b.as_bool()).unwrap_or(false);
    let fuse_unk = model.get("fuse_unk").and_then(|b| b.as_bool()).unwrap_or(false);
    if !(is_bpe && no_dropout && (byte_fallback || !fuse_unk)) {
        return None;
    }
    let crosses = |t: &str| {
        let mut prev: Option<char> = None;
        for c in t.chars() {
            if c == SPACE && prev.is_some_and(|p| p != SPACE) {
                return true;
            }
            prev = Some(c);
        }
        false
    };
    if tok.get_model().get_vocab().keys().any(|t| crosses(t)) {
        return None;
    }
    let split = Split::new(
        SplitPattern::Regex("\u{2581}*[^\u{2581}]+|\u{2581}+".into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .ok()?;
    let mut fast = tok.clone();
    fast.with_pre_tokenizer(Some(split));
    Some(fast)
}

/// Token ids of one document's text, without special tokens.
pub fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    match tok.encode_fast(text, false) {
        Ok(enc) => Ok(enc.get_ids().to_vec()),
        Err(e) => bail!("tokenizer failed: {e}"),
    }
}
