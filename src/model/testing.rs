//! Tiny self-contained models for tests, the demo and tiny-cpu runs: a byte-level tokenizer that encodes
//! any UTF-8 text (259 ids: `<unk>`, `<s>`, `</s>`, then one id per byte) and random HF model directories.
//!
//! The non-obvious decision: the tokenizer is an HF `tokenizers` BPE with no merges and byte fallback, so
//! it is a real tokenizer.json that transformers and the `tokenizers` crate both read, and BOS is added
//! by its post-processor as Llama's is. Not a stub: everything here is used by real runs on CPU.
use crate::model::config::LlamaConfig;
use crate::model::rope::RopeScheme;
use crate::model::weights::{init_random, save_model_dir, DEFAULT_MAX_SHARD_BYTES};
use anyhow::{Context, Result};
use candle_core::{DType, Device};
use serde_json::json;
use std::path::Path;

/// Vocabulary size of `byte_tokenizer_json`.
pub const BYTE_VOCAB: usize = 259;

/// The JSON of a byte-level tokenizer: `<unk>`=0, `<s>`=1 (added at the start), `</s>`=2, byte b = 3 + b.
pub fn byte_tokenizer_json() -> String {
    let special = |id: u32, s: &str| json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let mut vocab = serde_json::Map::new();
    for (i, s) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(s.to_string(), json!(i));
    }
    for b in 0..256 {
        vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
    }
    let v = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": null, "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab, "merges": []}
    });
    v.to_string()
}

/// The tiny config used by tests and the demo (GQA 4q/2kv heads, head_dim 16, 2 layers, byte vocab).
pub fn tiny_config(rope: RopeScheme) -> LlamaConfig {
    LlamaConfig::tiny(BYTE_VOCAB, rope)
}

/// Write a random model directory (config.json, model.safetensors, byte tokenizer.json) for `cfg`.
pub fn write_random_model_dir(dir: &Path, cfg: &LlamaConfig, seed: u64) -> Result<()> {
    let tensors = init_random(cfg, seed, DType::F32, &Device::Cpu)?;
    save_model_dir(dir, cfg, &tensors, DEFAULT_MAX_SHARD_BYTES)?;
    std::fs::write(dir.join("tokenizer.json"), byte_tokenizer_json())
        .with_context(|| format!("cannot write {}", dir.join("tokenizer.json").display()))?;
    Ok(())
}

/// A tiny random model directory with the given RoPE scheme.
pub fn tiny_model_dir(dir: &Path, rope: RopeScheme, seed: u64) -> Result<LlamaConfig> {
    let cfg = tiny_config(rope);
    write_random_model_dir(dir, &cfg, seed)?;
    Ok(cfg)
}
