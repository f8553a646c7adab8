//! The prompt's BOS rule of eval-niah and the training passkey (`PromptBos`): `auto` encodes exactly as
//! `tokenizers` does with the tokenizer's own post-processor (RULER's HF runner: `tokenizer(prompt)`), so a
//! tokenizer without BOS gets none; on Llama-2's tokenizer it is the old rule (BOS + text) id for id; and a
//! prediction stored under one rule is recomputed under another.
use crate::common::harpe;
use harpe::data::tokenize::PromptBos;
use harpe::model::rope::RopeScheme;
use std::path::PathBuf;
use tokenizers::Tokenizer;

const PROMPTS: [&str; 3] = [
    "There is an important info hidden inside a lot of irrelevant text.\nThe pass key is 4211. Remember it.",
    "  leading spaces, <s> a literal BOS spelling, and </s> an EOS one",
    "",
];

/// The byte tokenizer of the tiny test models with its post-processor replaced by one that adds nothing
/// (as SmolLM2's or GPT-2's): `<s>` stays in the vocabulary, the tokenizer just never adds it.
fn no_bos_tokenizer_json() -> String {
    let mut v: serde_json::Value = serde_json::from_str(&harpe::model::testing::byte_tokenizer_json()).unwrap();
    v["post_processor"] = serde_json::json!({"type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {}});
    v.to_string()
}

/// Tokenizers that add BOS by their post-processor: the Llama-2 layout of the eval-tasks fixture (a small
/// SentencePiece-style BPE vocabulary) and the word-level golden one.
fn bos_tokenizers() -> Vec<Tokenizer> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    ["tests/fixtures/eval_tasks/model/tokenizer.json", "tests/golden/tokenizer.json"]
        .iter()
        .map(|p| harpe::data::tokenize::load_tokenizer(&root.join(p)).unwrap())
        .collect()
}

#[test]
fn auto_is_the_tokenizers_own_encoding_and_adds_no_bos_where_the_tokenizer_adds_none() {
    let tok: Tokenizer = no_bos_tokenizer_json().parse().unwrap();
    for p in PROMPTS {
        let own = tok.encode(p, true).unwrap().get_ids().to_vec();
        let plain = tok.encode(p, false).unwrap().get_ids().to_vec();
        assert_eq!(own, plain, "this tokenizer's post-processor adds nothing");
        assert_eq!(PromptBos::Auto.encode(&tok, p, Some(1)).unwrap(), own, "{p:?}");
        assert_ne!(own.first(), Some(&1), "{p:?}: no BOS first");
        assert_eq!(PromptBos::Always.encode(&tok, p, Some(1)).unwrap(), [vec![1], plain.clone()].concat());
        assert_eq!(PromptBos::Never.encode(&tok, p, Some(1)).unwrap(), plain);
    }
    assert!(!PromptBos::Auto.starts_with_bos(&tok, Some(1)).unwrap());
    assert!(PromptBos::Always.starts_with_bos(&tok, Some(1)).unwrap());
    let e = PromptBos::Always.encode(&tok, "x", None).unwrap_err().to_string();
    assert!(e.contains("bos_token_id") && e.contains("hint:"), "{e}");
}

#[test]
fn auto_on_a_bos_tokenizer_is_bos_then_the_text() {
    let byte: Tokenizer = harpe::model::testing::byte_tokenizer_json().parse().unwrap();
    for tok in bos_tokenizers().into_iter().chain([byte]) {
        for p in PROMPTS {
            let old_rule: Vec<u32> =
                std::iter::once(1).chain(tok.encode_fast(p, false).unwrap().get_ids().iter().copied()).collect();
            assert_eq!(PromptBos::Auto.encode(&tok, p, Some(1)).unwrap(), old_rule, "{p:?}");
            assert_eq!(PromptBos::Auto.encode(&tok, p, Some(1)).unwrap(), tok.encode(p, true).unwrap().get_ids());
            assert_eq!(PromptBos::Always.encode(&tok, p, Some(1)).unwrap(), old_rule, "{p:?}");
        }
        assert!(PromptBos::Auto.starts_with_bos(&tok, Some(1)).unwrap());
        assert!(!PromptBos::Never.starts_with_bos(&tok, Some(1)).unwrap());
    }
}

/// eval-niah on a tiny model whose tokenizer adds no BOS: the predictions are stored under a key that
/// says so, and a rerun under another `--bos` recomputes them instead of reusing them.
#[test]
fn eval_niah_keys_predictions_by_the_bos_rule() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    harpe::model::testing::tiny_model_dir(&model, RopeScheme::Default { theta: 1e4 }, 3).unwrap();
    std::fs::write(model.join("tokenizer.json"), no_bos_tokenizer_json()).unwrap();
    let out = tmp.path().join("out");
    let (m, o) = (model.display().to_string(), out.display().to_string());
    let run = |bos: &str| {
        let args =
            ["eval-niah", "--model", &m, "--out", &o, "--tasks", "passkey", "--lengths", "512", "--samples", "2"];
        let (ok, _, stderr) = harpe(&[&args[..], &["--bos", bos]].concat());
        assert!(ok, "{stderr}");
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
        let s = &r["cells"][0]["samples"][0];
        (s["prompt_sha256"].as_str().unwrap().to_string(), stderr)
    };
    let (auto_key, _) = run("auto");
    let (always_key, stderr) = run("always");
    assert_ne!(auto_key, always_key);
    assert!(!stderr.contains("resuming"), "a prediction made without BOS was reused with BOS: {stderr}");
    let (again, stderr) = run("always");
    assert_eq!(again, always_key);
    assert!(stderr.contains("resuming: 2 predictions already done"), "{stderr}");
}
