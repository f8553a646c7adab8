//! `harpe convert` against transformers' GGUF loader on SmolLM2-135M: the config, every tensor (sha256 of
//! its f32 bytes, sums and 16 values), tied embeddings with no `lm_head.weight` written, and the tokenizer's
//! ids with and without its special tokens.
use crate::{golden, model};
use candle_core::{DType, Device};
use sha2::Digest;

#[test]
fn config_matches_transformers() {
    let Some(dir) = model() else { return };
    let want = golden("config.json");
    let got: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    for k in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rope_theta",
        "bos_token_id",
        "eos_token_id",
    ] {
        assert_eq!(got[k], want[k], "config.json `{k}`");
    }
    assert_eq!(got["tie_word_embeddings"], true);
}

#[test]
fn every_tensor_equals_transformers() {
    let Some(dir) = model() else { return };
    let want = golden("tensors.json");
    let want = want["tensors"].as_object().unwrap();
    let got = harpe::model::weights::load_tensors(dir, DType::F32, &Device::Cpu).unwrap();
    assert!(!got.contains_key("lm_head.weight"), "tied embeddings: no lm_head.weight is written");
    let mut names: Vec<&String> = got.keys().collect();
    names.sort();
    let mut want_names: Vec<&String> = want.keys().collect();
    want_names.sort();
    assert_eq!(names, want_names);
    let mut exact = 0;
    for (name, w) in want {
        let t = &got[name];
        let shape: Vec<usize> = w["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
        assert_eq!(t.dims(), shape.as_slice(), "{name}");
        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for s in w["samples"].as_array().unwrap() {
            let (i, x) = (s[0].as_u64().unwrap() as usize, s[1].as_f64().unwrap());
            assert_eq!(v[i] as f64, x, "{name}[{i}]");
        }
        let sum: f64 = v.iter().map(|&x| x as f64).sum();
        let sum_abs: f64 = v.iter().map(|&x| (x as f64).abs()).sum();
        let (ws, wa) = (w["sum"].as_f64().unwrap(), w["sum_abs"].as_f64().unwrap());
        assert!((sum - ws).abs() <= 1e-9 * wa.max(1.0), "{name}: sum {sum} vs {ws}");
        assert!((sum_abs - wa).abs() <= 1e-9 * wa.max(1.0), "{name}: sum |x| {sum_abs} vs {wa}");
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        exact += usize::from(hex::encode(sha2::Sha256::digest(&bytes)) == w["sha256"].as_str().unwrap());
    }
    // dequantization is `d * q + m` in f32 on both sides: every value equal, bit for bit
    assert_eq!(exact, want.len(), "tensors whose f32 bytes equal transformers' exactly");
}

#[test]
fn tokenizer_ids_equal_transformers() {
    let Some(dir) = model() else { return };
    let tok = harpe::data::tokenize::load_tokenizer(&dir.join("tokenizer.json")).unwrap();
    let cases = golden("tokenize.json");
    for c in cases["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
        };
        assert_eq!(
            tok.encode(text, true).unwrap().get_ids(),
            ids(&c["ids"]).as_slice(),
            "{text:?} with special tokens"
        );
        assert_eq!(tok.encode(text, false).unwrap().get_ids(), ids(&c["ids_plain"]).as_slice(), "{text:?}");
    }
    // SmolLM2's post-processor adds nothing: no BOS, no EOS
    assert_eq!(tok.encode("Hello", true).unwrap().get_ids(), tok.encode("Hello", false).unwrap().get_ids());
}
