//! `harpe eval-ppl` and `harpe inspect` as a user runs them: JSON contract, several documents,
//! directories, --max-tokens, --aggregate, and errors that name the problem.
use std::path::{Path, PathBuf};
use std::process::Command;

fn harpe(args: &[&str]) -> (bool, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_harpe")).args(args).output().unwrap();
    (o.status.success(), String::from_utf8_lossy(&o.stdout).to_string(), String::from_utf8_lossy(&o.stderr).to_string())
}

fn golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn json_output_and_multiple_documents() {
    let model = golden().join("default/model");
    let text = golden().join("text.txt");
    let (ok, out, err) =
        harpe(&["eval-ppl", "--model", s(&model), "--input", s(&text), "--window", "12", "--stride", "5", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden().join("default/ppl.json")).unwrap()).unwrap();
    assert!((v["nll"].as_f64().unwrap() - want["nll"].as_f64().unwrap()).abs() < 1e-4);
    assert!((v["ppl"].as_f64().unwrap() - v["nll"].as_f64().unwrap().exp()).abs() < 1e-9);
    assert_eq!(v["tokens"], want["tokens"]);
    assert_eq!(v["windows"], want["windows"]);

    // a directory with two documents (.txt and a .jsonl line) gives per-document results and the total
    let tmp = tempfile::tempdir().unwrap();
    let body = std::fs::read_to_string(&text).unwrap();
    std::fs::write(tmp.path().join("a.txt"), &body).unwrap();
    std::fs::write(tmp.path().join("b.jsonl"), format!("{}\n", serde_json::json!({"text": body}))).unwrap();
    let (ok, out, err) = harpe(&[
        "eval-ppl",
        "--model",
        s(&model),
        "--input",
        s(tmp.path()),
        "--window",
        "12",
        "--stride",
        "5",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["documents"].as_array().unwrap().len(), 2);
    assert_eq!(v["tokens"].as_u64().unwrap(), 2 * want["tokens"].as_u64().unwrap());
    assert!((v["nll"].as_f64().unwrap() - want["nll"].as_f64().unwrap()).abs() < 1e-4);

    // --max-tokens cuts each document; --aggregate window-mean reports YaRN's mean of window means
    let (ok, out, _) = harpe(&[
        "eval-ppl",
        "--model",
        s(&model),
        "--input",
        s(&text),
        "--window",
        "12",
        "--stride",
        "5",
        "--json",
        "--max-tokens",
        "20",
        "--aggregate",
        "window-mean",
    ]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["tokens"], 19);
    assert_eq!(v["nll"], v["window_mean_nll"]);
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
    assert_eq!(v["params"], v["params_expected"]);
    assert_eq!(v["kv_heads"], 2);
    assert_eq!(v["rope"]["scheme"], "harpe");
    assert_eq!(v["rope"]["head_bases"], serde_json::json!([10000.0, 500000.0]));
    let (ok, out, _) = harpe(&["inspect", "--model", s(&golden().join("default/model"))]);
    assert!(ok && out.contains("default") && out.contains("files        6"), "{out}");
}
