//! The exact word-split fast path for Llama-layout BPE tokenizers gives the same ids as the tokenizer
//! itself, and is refused when a vocabulary token could merge across a split.
use harpe::data::tokenize::exact_word_split;
use serde_json::json;
use tokenizers::Tokenizer;

/// A Llama-layout tokenizer (Prepend ▁ + Replace ' '->▁, no pre-tokenizer, BPE with byte fallback).
fn llama_like(extra: &[(&str, &str)]) -> Tokenizer {
    let mut vocab = serde_json::Map::new();
    let mut add = |t: &str| {
        if !vocab.contains_key(t) {
            let n = vocab.len();
            vocab.insert(t.to_string(), json!(n));
        }
    };
    for t in ["<unk>", "<s>", "</s>"] {
        add(t);
    }
    for b in 0..256 {
        add(&format!("<0x{b:02X}>"));
    }
    for c in "▁abcdehlnortw".chars() {
        add(&c.to_string());
    }
    // `extra` merges come first: they have the highest priority
    let mut merges: Vec<(&str, &str)> = extra.to_vec();
    merges.extend_from_slice(&[
        ("▁", "t"),
        ("h", "e"),
        ("▁t", "he"),
        ("▁", "▁"),
        ("▁▁", "▁▁"),
        ("▁", "a"),
        ("a", "b"),
        ("▁a", "b"),
        ("l", "l"),
        ("e", "ll"),
        ("h", "ell"),
        ("▁", "hell"),
        ("o", "r"),
        ("w", "or"),
        ("▁", "wor"),
        ("l", "d"),
        ("▁wor", "ld"),
        ("▁▁", "▁"),
        ("▁▁▁", "t"),
    ]);
    for (a, b) in &merges {
        add(&format!("{a}{b}"));
    }
    let merges: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
    let special = |id: u32, s: &str| json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let v = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null, "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab, "merges": merges}
    });
    Tokenizer::from_bytes(v.to_string().as_bytes()).unwrap()
}

fn texts() -> Vec<String> {
    let words =
        ["the", "hello", "world", "ab", "a", "t", "théâtre", "ll", "or", "\n", "  ", "<s>", "42", "x", "the\tend"];
    let mut out = vec![String::new(), " ".into(), "   ".into(), "the".into(), "  the  world ".into()];
    let mut s: u64 = 7;
    for n in 0..300 {
        let mut t = String::new();
        for _ in 0..(n % 40) {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            t.push_str(words[(s >> 33) as usize % words.len()]);
            for _ in 0..((s >> 20) % 4) {
                t.push(' ');
            }
        }
        out.push(t);
    }
    out
}

#[test]
fn fast_path_gives_identical_ids() {
    let tok = llama_like(&[]);
    let fast = exact_word_split(&tok).expect("a Llama-layout tokenizer qualifies");
    for t in texts() {
        let a = tok.encode_fast(t.as_str(), false).unwrap();
        let b = fast.encode_fast(t.as_str(), false).unwrap();
        assert_eq!(a.get_ids(), b.get_ids(), "{t:?}");
    }
    // the split really splits: a word-level cache sees many words, ids still equal
    let long = "hello world the ab ".repeat(200);
    assert_eq!(
        tok.encode_fast(long.as_str(), false).unwrap().get_ids(),
        fast.encode_fast(long.as_str(), false).unwrap().get_ids()
    );
}

#[test]
fn fast_path_is_refused_when_a_token_spans_a_split() {
    // "e▁" + "t" would merge across the boundary before "▁t": splitting there would change ids
    let tok = llama_like(&[("e", "▁"), ("e▁", "t")]);
    assert!(exact_word_split(&tok).is_none());
    // a tokenizer that already has a pre-tokenizer is left alone
    let mut with_pre = llama_like(&[]);
    with_pre.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::Whitespace {}));
    assert!(exact_word_split(&with_pre).is_none());
    // and the refused tokenizer really differs when split by force (the check is not vacuous)
    let t = "the the";
    let split = {
        let mut x = tok.clone();
        x.with_pre_tokenizer(Some(
            tokenizers::pre_tokenizers::split::Split::new(
                tokenizers::pre_tokenizers::split::SplitPattern::Regex("\u{2581}*[^\u{2581}]+|\u{2581}+".into()),
                tokenizers::SplitDelimiterBehavior::Isolated,
                false,
            )
            .unwrap(),
        ));
        x
    };
    assert_ne!(tok.encode_fast(t, false).unwrap().get_ids(), split.encode_fast(t, false).unwrap().get_ids());
}
