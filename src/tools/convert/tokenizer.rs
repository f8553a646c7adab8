//! A `tokenizer.json` from a GGUF file's vocabulary: llama.cpp stores no tokenizer file, only the
//! tokens, merges or scores, token types and special-token ids under `tokenizer.ggml.*`.
//!
//! Reference: transformers' GGUF tokenizer building (`integrations/gguf/gguf_tokenizer_mapping.py`:
//! `byte_level_tokenizer`, `sentencepiece_tokenizer`, `get_merges`, `add_gguf_special_tokens`,
//! `set_split_regex`; `GPT2Tokenizer` and `LlamaTokenizer` for the pipelines; `TokenizersBackend.
//! update_post_processor` for the post-processor), transformers 5.25.
//!
//! The non-obvious decisions: the post-processor is the one transformers builds from
//! `tokenizer.ggml.add_bos_token` / `add_eos_token` (a SentencePiece vocabulary that says nothing adds
//! BOS, as llama.cpp does; a byte-level one adds nothing), so `encode(text, add_special_tokens = true)`
//! gives the ids transformers' tokenizer gives, and the evaluation's BOS rule can rely on it; a
//! SentencePiece file without merges gets them rebuilt from its scores with transformers'
//! `generate_merges` order (score, then the pieces' lengths, ties in vocabulary order).
//! Not here: llama.cpp's own pre-tokenizer names beyond the table transformers knows (the byte-level
//! default is used for the others, as transformers does), Unigram (T5) vocabularies.
use crate::model::gguf::{as_u64, Gguf};
use anyhow::{anyhow, bail, Result};
use candle_core::quantized::gguf_file::Value;
use std::collections::HashMap;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, DecoderWrapper, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

/// llama.cpp's token type of a control token (`<s>`, `<|endoftext|>`).
const CONTROL: i32 = 3;
/// llama.cpp's token type of a user-defined added token (`<think>`).
const USER_DEFINED: i32 = 4;

/// What `tokenizer.ggml.*` says.
#[derive(Clone, Debug)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `gpt2` (byte-level BPE) or `llama` (SentencePiece BPE)
    pub model: String,
    /// `tokenizer.ggml.pre`: llama.cpp's pre-tokenizer name
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub scores: Option<Vec<f64>>,
    pub token_types: Option<Vec<i32>>,
    pub merges: Option<Vec<String>>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
}

/// The array at metadata key `k` of `g` (None when absent), each element through `elem` (None: not an
/// element of the kind the array must hold, named by `kind`).
fn meta_array<T>(g: &Gguf, k: &str, kind: &str, elem: impl Fn(&Value) -> Option<T>) -> Result<Option<Vec<T>>> {
    let origin = g.path.display();
    match g.meta(k) {
        None => Ok(None),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                elem(v).ok_or_else(|| anyhow!("{origin}: `{k}` holds {v:?}, not {kind}\nhint: the file is damaged"))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(other) => {
            bail!("{origin}: `{k}` is {:?}, not an array\nhint: the file is damaged", other.value_type())
        }
    }
}

impl GgufVocab {
    /// Read the vocabulary from the file's metadata; an absent or foreign tokenizer model is an error
    /// naming `tokenizer.ggml.model`.
    pub fn read(g: &Gguf) -> Result<GgufVocab> {
        let origin = g.path.display().to_string();
        let key = "tokenizer.ggml.model";
        let model = match g.meta(key) {
            Some(Value::String(s)) => s.clone(),
            _ => bail!("{origin}: no string `{key}` in the metadata\nhint: the file carries no tokenizer; pass the model's own tokenizer.json with --tokenizer"),
        };
        if model != "gpt2" && model != "llama" {
            bail!(
                "{origin}: `{key}` is {model:?}, a tokenizer harpe does not build\nhint: harpe builds byte-level BPE \
                 (\"gpt2\") and SentencePiece BPE (\"llama\") tokenizers; pass the model's tokenizer.json with --tokenizer"
            );
        }
        let strings = |k: &str| {
            meta_array(g, k, "a string", |v| match v {
                Value::String(s) => Some(s.clone()),
                _ => None,
            })
        };
        let numbers = |k: &str| {
            meta_array(g, k, "a number", |v| match v {
                Value::F32(x) => Some(f64::from(*x)),
                Value::F64(x) => Some(*x),
                Value::I32(x) => Some(f64::from(*x)),
                _ => None,
            })
        };
        let tokens = strings("tokenizer.ggml.tokens")?
            .ok_or_else(|| anyhow!("{origin}: no `tokenizer.ggml.tokens`\nhint: the file carries no vocabulary"))?;
        let id = |k: &str| -> Result<Option<u32>> {
            let Some(v) = g.meta(k) else { return Ok(None) };
            let n = as_u64(v)
                .ok_or_else(|| anyhow!("{origin}: `{k}` is {v:?}, not a token id\nhint: the file is damaged"))?;
            if n as usize >= tokens.len() {
                bail!("{origin}: `{k}` = {n} is past the {} tokens\nhint: the file is damaged", tokens.len());
            }
            Ok(Some(n as u32))
        };
        let flag = |k: &str| match g.meta(k) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        };
        Ok(GgufVocab {
            pre: match g.meta("tokenizer.ggml.pre") {
                Some(Value::String(s)) => Some(s.clone()),
                _ => None,
            },
            scores: numbers("tokenizer.ggml.scores")?,
            token_types: numbers("tokenizer.ggml.token_type")?.map(|v| v.into_iter().map(|x| x as i32).collect()),
            merges: strings("tokenizer.ggml.merges")?,
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            unk: id("tokenizer.ggml.unknown_token_id")?,
            pad: id("tokenizer.ggml.padding_token_id")?,
            add_bos: flag("tokenizer.ggml.add_bos_token"),
            add_eos: flag("tokenizer.ggml.add_eos_token"),
            model,
            tokens,
        })
    }

    fn byte_level(&self) -> bool {
        self.model == "gpt2"
    }

    /// Whether the post-processor adds BOS / EOS: the file's flags; without one, BOS for SentencePiece
    /// vocabularies (llama.cpp adds it there) and nothing for byte-level ones; never a token the file lacks.
    pub fn adds(&self) -> (bool, bool) {
        let add_bos = self.add_bos.unwrap_or(!self.byte_level()) && self.bos.is_some();
        let add_eos = self.add_eos.unwrap_or(false) && self.eos.is_some();
        (add_bos, add_eos)
    }

    /// The tokenizer transformers builds from this vocabulary.
    pub fn build(&self) -> Result<Tokenizer> {
        let tokens: Vec<String> = if self.byte_level() {
            let spelling = bytes_to_unicode();
            let alphabet: std::collections::HashSet<char> = spelling.iter().copied().collect();
            self.tokens
                .iter()
                .map(|t| {
                    if t.chars().all(|c| alphabet.contains(&c)) {
                        t.clone()
                    } else {
                        t.bytes().map(|b| spelling[b as usize]).collect()
                    }
                })
                .collect()
        } else {
            self.tokens.clone()
        };
        let vocab: HashMap<String, u32> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let merges = self.merges_for(&tokens, &vocab)?;
        let mut bpe = BPE::builder()
            .vocab_and_merges(
                vocab.iter().map(|(t, &i)| (t.clone(), i)).collect::<tokenizers::models::bpe::Vocab>(),
                merges,
            )
            .fuse_unk(!self.byte_level())
            .byte_fallback(!self.byte_level());
        if self.byte_level() {
            // GPT2Tokenizer spells out the empty affixes (the file then equals transformers' byte for byte)
            bpe = bpe.continuing_subword_prefix(String::new()).end_of_word_suffix(String::new());
        }
        let bpe = bpe.build().map_err(|e| {
            anyhow!("the GGUF vocabulary does not make a BPE model: {e}\nhint: the file's merges name tokens it lacks")
        })?;
        let mut tok = Tokenizer::new(bpe);
        if self.byte_level() {
            let pre = match self.pre.as_deref().and_then(split_regex) {
                Some(re) => PreTokenizerWrapper::Sequence(PreSequence::new(vec![
                    Split::new(SplitPattern::Regex(re.to_string()), SplitDelimiterBehavior::Isolated, false)
                        .map_err(|e| anyhow!("pre-tokenizer regex: {e}"))?
                        .into(),
                    ByteLevel::new(false, true, false).into(),
                ])),
                None => ByteLevel::new(false, true, true).into(),
            };
            tok.with_pre_tokenizer(Some(pre));
            tok.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));
        } else {
            tok.with_pre_tokenizer(Some(PreTokenizerWrapper::Metaspace(Metaspace::new(
                '▁',
                PrependScheme::First,
                false,
            ))));
            let replace = Replace::new("▁", " ").map_err(|e| anyhow!("decoder: {e}"))?;
            tok.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(vec![
                DecoderWrapper::Replace(replace),
                DecoderWrapper::ByteFallback(ByteFallback::new()),
                DecoderWrapper::Fuse(Fuse::new()),
                DecoderWrapper::Strip(Strip::new(' ', 1, 0)),
            ]))));
        }
        // added tokens and the post-processor name tokens as the file spells them, as transformers does
        self.add_special_tokens(&mut tok, &self.tokens);
        tok.with_post_processor(Some(self.post_processor(&self.tokens)?));
        Ok(tok)
    }

    /// The merges the file gives, or (SentencePiece files without them) the ones its scores imply.
    fn merges_for(&self, tokens: &[String], vocab: &HashMap<String, u32>) -> Result<Vec<(String, String)>> {
        if let Some(m) = &self.merges {
            return m
                .iter()
                .map(|s| {
                    s.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())).ok_or_else(|| {
                        anyhow!("`tokenizer.ggml.merges` entry {s:?} is not two pieces\nhint: the file is damaged")
                    })
                })
                .collect();
        }
        let Some(scores) = &self.scores else {
            bail!("the GGUF vocabulary has neither `tokenizer.ggml.merges` nor `tokenizer.ggml.scores`\nhint: pass the model's tokenizer.json with --tokenizer");
        };
        Ok(generate_merges(tokens, scores, vocab))
    }

    /// Control tokens as special added tokens, user-defined ones as plain added tokens, then the named
    /// special tokens (BOS, EOS, UNK, PAD) as special, in transformers' order.
    fn add_special_tokens(&self, tok: &mut Tokenizer, tokens: &[String]) {
        let types = self.token_types.as_deref().unwrap_or(&[]);
        let alphabet: Option<std::collections::HashSet<char>> =
            self.byte_level().then(|| bytes_to_unicode().into_iter().collect());
        let spelled = |t: &str| alphabet.as_ref().is_none_or(|a| t.chars().all(|c| a.contains(&c)));
        let special = |t: &str| AddedToken::from(t.to_string(), true).normalized(false);
        let control: Vec<AddedToken> =
            tokens.iter().zip(types).filter(|(t, &ty)| ty == CONTROL && spelled(t)).map(|(t, _)| special(t)).collect();
        tok.add_special_tokens(&control);
        let user: Vec<AddedToken> = tokens
            .iter()
            .zip(types)
            .filter(|(_, &ty)| ty == USER_DEFINED)
            .map(|(t, _)| AddedToken::from(t.to_string(), false).normalized(false))
            .collect();
        tok.add_tokens(&user);
        let named: Vec<AddedToken> = [self.bos, self.eos, self.unk, self.pad]
            .into_iter()
            .flatten()
            .map(|i| special(&tokens[i as usize]))
            .collect();
        tok.add_special_tokens(&named);
    }

    /// transformers' template: `[BOS] $A [EOS]` for one sequence, `[BOS] $A [EOS] [BOS] $B [EOS]` for a pair.
    fn post_processor(&self, tokens: &[String]) -> Result<TemplateProcessing> {
        let (add_bos, add_eos) = self.adds();
        let name = |i: Option<u32>| i.map(|i| tokens[i as usize].clone()).unwrap_or_default();
        let (bos, eos) = (name(self.bos), name(self.eos));
        let opt = |add: bool, text: String| if add { text } else { String::new() };
        let single = format!("{}$A:0{}", opt(add_bos, format!("{bos}:0 ")), opt(add_eos, format!(" {eos}:0")));
        let pair = format!("{single}{} $B:1{}", opt(add_bos, format!(" {bos}:1")), opt(add_eos, format!(" {eos}:1")));
        let mut specials = vec![];
        if add_bos {
            specials.push((bos.clone(), self.bos.unwrap_or(0)));
        }
        if add_eos {
            specials.push((eos.clone(), self.eos.unwrap_or(0)));
        }
        TemplateProcessing::builder()
            .try_single(single.as_str())
            .and_then(|b| b.try_pair(pair.as_str()))
            .map_err(|e| anyhow!("post-processor template {single:?}: {e}"))?
            .special_tokens(specials)
            .build()
            .map_err(|e| anyhow!("post-processor: {e}"))
    }
}

/// GPT-2's reversible map from bytes to printable characters (`bytes_to_unicode`).
pub fn bytes_to_unicode() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or(' ')
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap_or(' ')
            }
        })
        .collect()
}

/// transformers' `generate_merges(vocab, scores)`: every split of every token into two vocabulary
/// pieces, ranked by the token's score (descending), then the pieces' lengths in characters
/// (descending), ties kept in vocabulary order (a stable sort, as Python's `sorted(reverse=True)`).
pub fn generate_merges(tokens: &[String], scores: &[f64], vocab: &HashMap<String, u32>) -> Vec<(String, String)> {
    // dict(zip(tokens, scores)): one entry per distinct token, at its first position, its last score
    let mut order: Vec<&str> = vec![];
    let mut score_of: HashMap<&str, f64> = HashMap::new();
    for (t, &s) in tokens.iter().zip(scores) {
        if score_of.insert(t.as_str(), s).is_none() {
            order.push(t);
        }
    }
    let mut merges: Vec<(String, String, f64)> = vec![];
    for t in order {
        let chars: Vec<(usize, char)> = t.char_indices().collect();
        let mut local: Vec<(&str, &str)> = chars
            .iter()
            .skip(1)
            .map(|&(at, _)| (&t[..at], &t[at..]))
            .filter(|(l, r)| vocab.contains_key(*l) && vocab.contains_key(*r))
            .collect();
        local.sort_by_key(|(l, r)| (vocab[*l], vocab[*r]));
        merges.extend(local.into_iter().map(|(l, r)| (l.to_string(), r.to_string(), score_of[t])));
    }
    let key = |m: &(String, String, f64)| (m.2, m.0.chars().count(), m.1.chars().count());
    merges.sort_by(|a, b| {
        let (ka, kb) = (key(a), key(b));
        kb.0.total_cmp(&ka.0).then(kb.1.cmp(&ka.1)).then(kb.2.cmp(&ka.2))
    });
    merges.into_iter().map(|(l, r, _)| (l, r)).collect()
}

/// transformers' split regex for a byte-level vocabulary by llama.cpp's pre-tokenizer name.
fn split_regex(pre: &str) -> Option<&'static str> {
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
        | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3,
        "tekken" => TEKKEN,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2,
        "qwen35" => QWEN35,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O,
        _ => return None,
    })
}
