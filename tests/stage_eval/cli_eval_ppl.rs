//! `harpe eval-ppl` and `harpe inspect` as a user runs them: JSON contract, several documents,
//! directories, --max-tokens, --aggregate, and errors that name the problem.
use crate::common::harpe;
use std::path::{Path, PathBuf};

fn golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `harpe eval-ppl` of the default golden model on `input` with `--json` and `args` (the window, the
/// stride and any other flag): the JSON it prints.
fn eval_ppl(input: &Path, args: &[&str]) -> serde_json::Value {
    let model = golden().join("default/model");
    let mut all = vec!["eval-ppl", "--model", s(&model), "--input", s(input), "--json"];
    all.extend_from_slice(args);
    let (ok, out, err) = harpe(&all);
    assert!(ok, "{args:?}: {err}");
    serde_json::from_str(out.trim()).unwrap()
}

/// transformers' values for the default golden model on tests/golden/text.txt (window 12, stride 5).
fn transformers_ppl() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(golden().join("default/ppl.json")).unwrap()).unwrap()
}

const WINDOW_12_STRIDE_5: [&str; 4] = ["--window", "12", "--stride", "5"];

#[test]
fn json_output_and_multiple_documents() {
    let text = golden().join("text.txt");
    let v = eval_ppl(&text, &WINDOW_12_STRIDE_5);
    let want = transformers_ppl();
    assert!((v["nll"].as_f64().unwrap() - want["nll"].as_f64().unwrap()).abs() < 1e-4);
    assert!((v["ppl"].as_f64().unwrap() - v["nll"].as_f64().unwrap().exp()).abs() < 1e-9);
    assert_eq!(v["tokens"], want["tokens"]);
    assert_eq!(v["windows"], want["windows"]);

    // a directory with two documents (.txt and a .jsonl line) gives per-document results and the total
    let tmp = tempfile::tempdir().unwrap();
    let body = std::fs::read_to_string(&text).unwrap();
    std::fs::write(tmp.path().join("a.txt"), &body).unwrap();
    std::fs::write(tmp.path().join("b.jsonl"), format!("{}\n", serde_json::json!({"text": body}))).unwrap();
    let v = eval_ppl(tmp.path(), &WINDOW_12_STRIDE_5);
    assert_eq!(v["documents"].as_array().unwrap().len(), 2);
    assert_eq!(v["tokens"].as_u64().unwrap(), 2 * want["tokens"].as_u64().unwrap());
    assert!((v["nll"].as_f64().unwrap() - want["nll"].as_f64().unwrap()).abs() < 1e-4);

    // --max-tokens cuts each document
    let v = eval_ppl(&text, &[&WINDOW_12_STRIDE_5[..], &["--max-tokens", "20", "--aggregate", "window-mean"]].concat());
    assert_eq!(v["tokens"], 19, "20 tokens (BOS included) leave 19 targets");

    // --aggregate window-mean reports YaRN's mean of window means: transformers' value, not the token mean.
    let v = eval_ppl(&text, &[&WINDOW_12_STRIDE_5[..], &["--aggregate", "window-mean"]].concat());
    let wm = want["window_mean_nll"].as_f64().unwrap();
    assert!((v["nll"].as_f64().unwrap() - wm).abs() < 1e-4, "window mean {} vs transformers {wm}", v["nll"]);
    // the scoring's own time (the inference benchmark reads it): positive, and tokens_per_s = tokens / seconds
    let (secs, tps, tokens) =
        (v["seconds"].as_f64().unwrap(), v["tokens_per_s"].as_f64().unwrap(), v["tokens"].as_f64().unwrap());
    assert!(
        secs > 0.0 && (tps * secs - tokens).abs() < 1e-6 * tokens,
        "seconds {secs}, tokens_per_s {tps}, tokens {tokens}"
    );
    // several windows: the windows after the first are timed on their own (warm_tokens_per_s)
    assert!(v["windows"].as_u64().unwrap() > 1);
    let warm = v["warm_tokens_per_s"].as_f64().expect("warm_tokens_per_s with several windows");
    assert!(warm > 0.0 && warm.is_finite(), "warm_tokens_per_s {warm}");
    // one window (the whole document fits): nothing is warm
    let v = eval_ppl(&text, &["--window", "4096", "--stride", "256"]);
    assert_eq!(v["windows"], 1);
    assert!(v["warm_tokens_per_s"].is_null(), "one window has no warm rate: {}", v["warm_tokens_per_s"]);
    assert!((wm - want["nll"].as_f64().unwrap()).abs() > 1e-3, "the fixture must tell the aggregates apart");
}

/// eval-ppl's nll with extra flags, against transformers' f32 value for the default model.
fn ppl_with(extra: &[&str]) -> (f64, f64) {
    let v = eval_ppl(&golden().join("text.txt"), &[&WINDOW_12_STRIDE_5[..], extra].concat());
    (v["nll"].as_f64().unwrap(), transformers_ppl()["nll"].as_f64().unwrap())
}

#[test]
fn loss_chunk_and_bf16_change_only_what_they_should() {
    // Any chunking of the log-softmax gives transformers' value.
    for chunk in ["1", "3", "1000"] {
        let (nll, hf) = ppl_with(&["--loss-chunk", chunk]);
        assert!((nll - hf).abs() < 1e-4, "--loss-chunk {chunk}: {nll} vs transformers {hf}");
    }
    // bf16 weights and activations: near the f32 reference, but not it (bf16 really ran).
    let (bf, hf) = ppl_with(&["--dtype", "bf16"]);
    assert!((bf - hf).abs() < 0.05, "bf16 nll {bf} vs f32 transformers {hf}");
    assert!((bf - hf).abs() > 1e-6, "bf16 gave the f32 value exactly ({bf}): --dtype was ignored");
}

#[test]
fn bad_inputs_are_reported() {
    let model = golden().join("default/model");
    let text = golden().join("text.txt");
    let (ok, _, err) =
        harpe(&["eval-ppl", "--model", s(&model), "--input", s(&text), "--window", "8", "--stride", "9"]);
    assert!(!ok && err.contains("--stride 9") && err.contains("unscored") && err.contains("hint:"), "{err}");
    let (ok, _, err) = harpe(&["eval-ppl", "--model", "/nonexistent/model", "--input", s(&text)]);
    assert!(!ok && err.contains("/nonexistent/model") && err.contains("hint:"), "{err}");
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"ok\"}\n{\"txt\": 1}\n").unwrap();
    let (ok, _, err) = harpe(&["eval-ppl", "--model", s(&model), "--input", s(&bad), "--window", "8", "--stride", "4"]);
    assert!(!ok && err.contains("bad.jsonl:2") && err.contains("text"), "{err}");
    let (ok, _, err) = harpe(&["eval-ppl", "--model", s(&model), "--input", s(&tmp.path().join("missing.txt"))]);
    assert!(!ok && err.contains("missing.txt"), "{err}");
}

#[test]
fn inspect_reports_the_model() {
    let (ok, out, err) = harpe(&["inspect", "--model", s(&golden().join("harpe/model")), "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    // Parameter count from config.json by the Llama formula (not from harpe's own code).
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden().join("harpe/model/config.json")).unwrap()).unwrap();
    let g = |k: &str| c[k].as_u64().unwrap();
    let (vocab, h, layers, inter) = (g("vocab_size"), g("hidden_size"), g("num_hidden_layers"), g("intermediate_size"));
    let (q, kv) = (g("num_attention_heads") * g("head_dim"), g("num_key_value_heads") * g("head_dim"));
    let tied = c["tie_word_embeddings"].as_bool().unwrap_or(false);
    let per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h;
    let want = vocab * h * if tied { 1 } else { 2 } + layers * per_layer + h;
    assert_eq!(v["params"], want);
    assert_eq!(v["params_expected"], want);
    assert_eq!(v["kv_heads"], 2);
    assert_eq!(v["rope"]["scheme"], "harpe");
    assert_eq!(v["rope"]["head_bases"], serde_json::json!([10000.0, 500000.0]));
    let (ok, out, _) = harpe(&["inspect", "--model", s(&golden().join("default/model"))]);
    assert!(ok && out.contains("default") && out.contains("files        6"), "{out}");
}

#[test]
fn inspect_tensors_lists_every_tensor_of_the_files() {
    // Names, dtypes and shapes as the safetensors headers say (read here with the safetensors crate).
    let dir = golden().join("default/model");
    let (ok, out, err) = harpe(&["inspect", "--model", s(&dir), "--json", "--tensors"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let listed = v["tensors"].as_object().unwrap();
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&p).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (name, view) in st.tensors() {
                let row = &listed[&name];
                assert_eq!(row[0], format!("{:?}", view.dtype()), "{name}");
                assert_eq!(row[1], serde_json::json!(view.shape()), "{name}");
                n += 1;
            }
        }
    }
    assert_eq!(listed.len(), n, "every tensor once");
    let (ok, text, _) = harpe(&["inspect", "--model", s(&dir), "--tensors"]);
    assert!(ok && text.contains("model.layers.1.self_attn.k_proj.weight") && text.contains("[16, 32]"), "{text}");
}
