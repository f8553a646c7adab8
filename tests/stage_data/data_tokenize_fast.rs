//! The Llama-layout fast encoder gives exactly the ids of the tokenizer's own pipeline, and is not used
//! when a vocabulary token could merge across its word split.
use harpe::data::tokenize::Encoder;
use serde_json::json;
use tokenizers::Tokenizer;

/// A Llama-layout tokenizer (Prepend ▁ + Replace ' '->▁, no pre-tokenizer, BPE with byte fallback);
/// `extra` merges come first, with the highest priority.
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
    let words = [
        "the",
        "hello",
        "world",
        "ab",
        "a",
        "t",
        "théâtre",
        "ll",
        "or",
        "\n",
        "  ",
        "<s>",
        "42",
        "x",
        "the\tend",
        "▁",
        "日本",
    ];
    let mut out = vec![String::new(), " ".into(), "   ".into(), "the".into(), "  the  world ".into(), "▁▁the".into()];
    let mut s: u64 = 7;
    for n in 0..400 {
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

fn pipeline(tok: &Tokenizer, t: &str) -> Vec<u32> {
    tok.encode_fast(t, false).unwrap().get_ids().to_vec()
}

#[test]
fn fast_encoder_gives_identical_ids() {
    let tok = llama_like(&[]);
    let enc = Encoder::new(&tok);
    assert!(enc.is_fast(), "a Llama-layout tokenizer qualifies");
    for t in texts() {
        assert_eq!(enc.encode(&t).unwrap(), pipeline(&tok, &t), "{t:?}");
    }
    let long = "hello world the ab ".repeat(300);
    assert_eq!(enc.encode(&long).unwrap(), pipeline(&tok, &long));
}

#[test]
fn fast_encoder_is_not_used_when_a_token_spans_a_split() {
    // "e▁" + "t" would merge across the boundary before "▁t": splitting there would change ids
    let tok = llama_like(&[("e", "▁"), ("e▁", "t")]);
    let enc = Encoder::new(&tok);
    assert!(!enc.is_fast());
    for t in texts() {
        assert_eq!(enc.encode(&t).unwrap(), pipeline(&tok, &t), "{t:?}");
    }
    // An independent value: "▁the▁the" must use the cross-boundary token "e▁t" the merges make
    // (a word-split fast path could never produce it), and the pieces must concatenate to the normalized text.
    let ids = enc.encode("the the").unwrap();
    let et = tok.token_to_id("e\u{2581}t").expect("the merge's token is in the vocabulary");
    assert!(ids.contains(&et), "{ids:?} lacks e▁t ({et})");
    assert_eq!(tok.decode(&ids, false).unwrap(), "\u{2581}the\u{2581}the", "no decoder: the pieces concatenated");
    // the check is not vacuous: a forced split really differs on this tokenizer
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
    assert_ne!(pipeline(&tok, "the the"), pipeline(&split, "the the"));
    // another normalizer, or a pre-tokenizer, also disables the fast path
    let mut with_pre = llama_like(&[]);
    with_pre.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::Whitespace {}));
    assert!(!Encoder::new(&with_pre).is_fast());
    let byte = Tokenizer::from_bytes(harpe::model::testing::byte_tokenizer_json().as_bytes()).unwrap();
    assert!(!Encoder::new(&byte).is_fast());
}
