//! Tokenization with the `tokenizers` crate, document separators, and the tokenizer hash.
//!
//! Reference: Fu et al.'s packer calls the Llama tokenizer with its defaults, i.e. every document is
//! prefixed with BOS and gets no EOS; that is our default (`Separator::Bos`).
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
                None => names.iter().find_map(|n| tok.token_to_id(n)).ok_or_else(|| match own_separator(tok) {
                    Some(sep) if what == "BOS" => anyhow!(
                        "the tokenizer has no BOS token (none of {names:?}); its document separator is {sep:?}\nhint: \
                         pass --separator eos --eos-token {sep:?} (each document then ends with {sep:?})"
                    ),
                    _ => anyhow!(
                        "the tokenizer has none of the usual {what} tokens {names:?}\nhint: pass {flag} NAME, or \
                         --separator none"
                    ),
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

/// Whether a prompt the model is asked to continue starts with BOS (eval-niah's `--bos`, `[eval] passkey_bos`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PromptBos {
    /// the tokenizer's own encoding (`add_special_tokens = true`): BOS only where its post-processor adds
    /// one, as RULER's HF runner tokenizes (Llama-2: BOS; SmolLM2, GPT-2: none)
    #[default]
    Auto,
    /// the model's `bos_token_id`, then the text without special tokens (harpe's rule before RULER's)
    Always,
    /// the text without special tokens
    Never,
}

impl PromptBos {
    /// True for the default (a config omits it).
    pub fn is_auto(&self) -> bool {
        *self == PromptBos::Auto
    }

    /// The ids the model sees for `text` under this rule; `bos` is the model's `bos_token_id`.
    pub fn encode(self, tok: &Tokenizer, text: &str, bos: Option<u32>) -> Result<Vec<u32>> {
        let special = self == PromptBos::Auto;
        let enc = tok.encode_fast(text, special).map_err(|e| anyhow!("tokenizer failed on a prompt: {e}"))?;
        let ids = enc.get_ids();
        match self {
            PromptBos::Always => {
                let Some(b) = bos else {
                    bail!("--bos always: the model's config.json has no bos_token_id\nhint: use --bos auto (the tokenizer's own rule)");
                };
                Ok(std::iter::once(b).chain(ids.iter().copied()).collect())
            }
            PromptBos::Auto | PromptBos::Never => Ok(ids.to_vec()),
        }
    }

    /// Whether every prompt encoded under this rule starts with `bos` (the model's BOS id).
    pub fn starts_with_bos(self, tok: &Tokenizer, bos: Option<u32>) -> Result<bool> {
        Ok(bos.is_some() && self.encode(tok, "", bos)?.first().copied() == bos)
    }
}

/// The tokenizer's own end-of-document token: the first of the usual EOS spellings it has, else a
/// special token whose name says "end of text" (`<|endoftext|>`, `<|end_of_text|>`), for the hint of a
/// tokenizer without BOS.
fn own_separator(tok: &Tokenizer) -> Option<String> {
    if let Some(n) = EOS_NAMES.iter().find(|n| tok.token_to_id(n).is_some()) {
        return Some(n.to_string());
    }
    let mut specials: Vec<String> = tok
        .get_added_tokens_decoder()
        .values()
        .filter(|t| t.special && t.content.replace('_', "").to_lowercase().contains("endoftext"))
        .map(|t| t.content.clone())
        .collect();
    specials.sort();
    specials.into_iter().next()
}

/// Load a `tokenizer.json` (a file, or a directory holding one): the one tokenizer loader.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    let file = if path.is_dir() { path.join("tokenizer.json") } else { path.to_path_buf() };
    if !file.exists() {
        return Err(anyhow!(
            "{}: tokenizer.json not found\nhint: pass the model's tokenizer.json (or a model directory holding one; --tokenizer FILE where the command has it)",
            file.display()
        ));
    }
    let hint = "hint: pass the model's tokenizer.json (HF fast-tokenizer format)";
    let text = std::fs::read(&file).with_context(|| format!("cannot read {}\n{hint}", file.display()))?;
    // parsed as JSON first: the tokenizers crate panics (an `expect` in its decoder deserializer) on some
    // malformed JSON instead of returning an error, so it is only handed a well-formed document, and a
    // panic it still raises becomes this error too
    let json: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| anyhow!("{}: line {}: {e}\n{hint}", file.display(), e.line()))?;
    let built = std::panic::catch_unwind(|| serde_json::from_value::<Tokenizer>(json));
    match built {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(anyhow!("cannot load tokenizer {}: {e}\n{hint}", file.display())),
        Err(p) => {
            let msg = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
            Err(anyhow!("cannot load tokenizer {}: {}\n{hint}", file.display(), msg.unwrap_or_default()))
        }
    }
}

/// Hex sha256 of the tokenizer.json bytes; `train` refuses a dataset whose hash differs from the model's.
pub fn tokenizer_sha256(path: &Path) -> Result<String> {
    crate::util::sha256_file(path)
        .with_context(|| format!("hashing tokenizer {}\nhint: check that the file exists", path.display()))
}

/// The SentencePiece word-boundary marker.
const SPACE: char = '\u{2581}';

/// Words kept per thread by `Encoder` before its cache is cleared.
const WORD_CACHE_CAP: usize = 1 << 18;

thread_local! {
    /// (encoder id, word -> ids) of the fast path.
    static WORD_CACHE: std::cell::RefCell<(u64, std::collections::HashMap<String, Vec<u32>>)> =
        std::cell::RefCell::new((0, std::collections::HashMap::new()));
}

/// Encodes documents exactly as `Tokenizer::encode_fast(text, false)` does, faster for Llama-layout
/// tokenizers.
///
/// Llama-2 / Mistral `tokenizer.json` files normalize with `Prepend("▁")` + `Replace(" " -> "▁")` and have
/// no pre-tokenizer, so `tokenizers` tracks per-character alignments through the normalizer and runs BPE
/// over a whole document as one "word" (its cost grows faster than linearly and the word cache never
/// hits). When (1) the normalizer is exactly that pair, (2) there is no pre-tokenizer, truncation or
/// padding, (3) the model is BPE without dropout whose unknown tokens cannot fuse across pieces (byte
/// fallback or `fuse_unk = false`), and (4) no vocabulary token contains a `▁` preceded by another
/// character, the same ids come from: `"▁" + text.replace(' ', "▁")` split before every run of `▁`, each
/// piece tokenized by the BPE model (with its word cache). (4) makes the split exact: BPE merges only
/// produce vocabulary tokens, so no merge can cross such a split, and both sides merge independently in
/// the same order. A document containing an added token's text (e.g. a literal `<s>`) takes the full
/// pipeline, which treats it specially (added tokens must be non-normalized, as Llama's are). All
/// conditions are checked on the actual tokenizer.
pub struct Encoder<'a> {
    tok: &'a Tokenizer,
    /// identifies this encoder in the per-thread word cache
    id: u64,
    /// the Llama-layout fast path applies
    fast: bool,
    /// added tokens' text; a document containing one takes the full pipeline
    added: Vec<String>,
}

impl<'a> Encoder<'a> {
    /// Inspect `tok` once and decide whether the fast path is exact for it.
    pub fn new(tok: &'a Tokenizer) -> Encoder<'a> {
        let added = tok.get_added_tokens_decoder().values().map(|t| t.content.clone()).collect();
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Encoder { tok, id, fast: llama_layout(tok), added }
    }

    /// True when documents skip the generic pipeline (see the type's doc).
    pub fn is_fast(&self) -> bool {
        self.fast
    }

    /// Token ids of one document's text, without special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        use tokenizers::Model;
        if !self.fast || self.added.iter().any(|a| text.contains(a.as_str())) {
            return encode(self.tok, text);
        }
        let mut ids = Vec::with_capacity(text.len() / 3);
        if text.is_empty() {
            return Ok(ids);
        }
        let norm: String =
            std::iter::once(SPACE).chain(text.chars().map(|c| if c == ' ' { SPACE } else { c })).collect();
        let model = self.tok.get_model();
        // Word -> ids cache per thread (BPE without dropout is a pure function of the word); it saves
        // the model's per-token String allocations for repeated words.
        WORD_CACHE.with(|cell| -> Result<()> {
            let mut cache = cell.borrow_mut();
            if cache.0 != self.id || cache.1.len() > WORD_CACHE_CAP {
                cache.0 = self.id;
                cache.1.clear();
            }
            let mut piece = |w: &str, ids: &mut Vec<u32>| -> Result<()> {
                if let Some(v) = cache.1.get(w) {
                    ids.extend_from_slice(v);
                    return Ok(());
                }
                let v: Vec<u32> = model
                    .tokenize(w)
                    .map_err(|e| anyhow!("tokenizer failed: {e}"))?
                    .into_iter()
                    .map(|t| t.id)
                    .collect();
                ids.extend_from_slice(&v);
                cache.1.insert(w.to_string(), v);
                Ok(())
            };
            let mut start = 0;
            let mut prev_space = true;
            for (i, c) in norm.char_indices() {
                let space = c == SPACE;
                if space && !prev_space {
                    piece(&norm[start..i], &mut ids)?;
                    start = i;
                }
                prev_space = space;
            }
            piece(&norm[start..], &mut ids)
        })?;
        Ok(ids)
    }
}

/// The four conditions of `Encoder` for the Llama-layout fast path.
fn llama_layout(tok: &Tokenizer) -> bool {
    use tokenizers::Model;
    if tok.get_pre_tokenizer().is_some() || tok.get_truncation().is_some() || tok.get_padding().is_some() {
        return false;
    }
    // added tokens matched after normalization would need the normalized text: not on the fast path
    if tok.get_added_tokens_decoder().values().any(|t| t.normalized) {
        return false;
    }
    let norm = serde_json::to_value(tok.get_normalizer()).unwrap_or_default();
    let want = serde_json::json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u{2581}"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]});
    if norm != want {
        return false;
    }
    let model = serde_json::to_value(tok.get_model()).unwrap_or_default();
    let is_bpe = model.get("type").and_then(|t| t.as_str()) == Some("BPE");
    let no_dropout = model.get("dropout").is_none_or(|d| d.is_null());
    let byte_fallback = model.get("byte_fallback").and_then(|b| b.as_bool()).unwrap_or(false);
    let fuse_unk = model.get("fuse_unk").and_then(|b| b.as_bool()).unwrap_or(false);
    if !(is_bpe && no_dropout && (byte_fallback || !fuse_unk)) {
        return false;
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
    !tok.get_model().get_vocab().keys().any(|t| crosses(t))
}

/// Token ids of one document's text, without special tokens.
pub fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    match tok.encode_fast(text, false) {
        Ok(enc) => Ok(enc.get_ids().to_vec()),
        Err(e) => bail!("tokenizer failed: {e}"),
    }
}
