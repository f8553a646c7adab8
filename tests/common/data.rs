//! The data tests' helpers (`common::data`): a WordLevel tokenizer built in code, the token ids and text of
//! synthetic documents, SlimPajama-style lines, and a prepared dataset read back as one token stream.
use std::path::{Path, PathBuf};

/// Vocabulary size of the test tokenizer (words `w0`..`w{VOCAB-1}`).
pub const VOCAB: usize = 1000;
/// Ids of the special tokens.
pub const BOS: u32 = 1;
pub const EOS: u32 = 2;

/// Write a WordLevel tokenizer.json (whitespace split; `<unk>`=0, `<s>`=1, `</s>`=2, `wI` = 3+I).
pub fn write_tokenizer(dir: &Path) -> PathBuf {
    let mut vocab = serde_json::Map::new();
    vocab.insert("<unk>".into(), 0.into());
    vocab.insert("<s>".into(), 1.into());
    vocab.insert("</s>".into(), 2.into());
    for i in 0..VOCAB {
        vocab.insert(format!("w{i}"), (3 + i).into());
    }
    let special = |id: u32, c: &str| {
        serde_json::json!({"id": id, "content": c, "single_word": false, "lstrip": false, "rstrip": false,
                           "normalized": false, "special": true})
    };
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    let p = dir.join("tokenizer.json");
    std::fs::write(&p, serde_json::to_vec(&tok).unwrap()).unwrap();
    p
}

/// A temporary directory (removed when the first value drops) holding the test tokenizer, and its path.
pub fn tempdir_with_tokenizer() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let tok = write_tokenizer(tmp.path());
    (tmp, tok)
}

/// Token ids of document `doc` of length `len` (deterministic content).
pub fn doc_ids(doc: usize, len: usize) -> Vec<u32> {
    (0..len).map(|j| 3 + ((doc * 7919 + j * 31) % VOCAB) as u32).collect()
}

/// Text whose test-tokenizer encoding is `doc_ids(doc, len)`.
pub fn doc_text(doc: usize, len: usize) -> String {
    doc_ids(doc, len).iter().map(|i| format!("w{}", i - 3)).collect::<Vec<_>>().join(" ")
}

/// `n` documents of `len` tokens each (`doc_text(0, len)`, ...), all of source "a".
pub fn one_source_docs(n: usize, len: usize) -> Vec<(String, String)> {
    (0..n).map(|d| ("a".to_string(), doc_text(d, len))).collect()
}

/// A SlimPajama-style jsonl line.
pub fn slimpajama_line(text: &str, source: &str) -> String {
    serde_json::json!({"text": text, "meta": {"redpajama_set_name": source}}).to_string()
}

/// Read all shards of a dataset as one token stream (in dataset order).
pub fn all_tokens(dir: &Path) -> Vec<u32> {
    let m = harpe::data::Manifest::load(dir).unwrap();
    let mut out = Vec::new();
    for s in &m.shards {
        let b = std::fs::read(dir.join(&s.file)).unwrap();
        out.extend(b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])));
    }
    out
}
