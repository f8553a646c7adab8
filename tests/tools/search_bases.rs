//! CLI tests of `harpe search-bases`: JSON output, the `[rope]` TOML snippet, the waveform plot, model
//! head counts (GQA) and every bad-input error. The peak-valley runs use the Attention-Buckets scale
//! (`--orig-len 4096 --target-len 4096`, a 3091-point grid) so each takes well under a second; the
//! full 128K search is a unit test in `bases::search`.
use crate::common::harpe_cmd;
use harpe::model::rope::{RopeScheme, TABLE2_BASES};
use serde_json::Value;
use std::path::Path;
use std::process::Output;

/// `harpe search-bases ARGS`.
fn search_bases(args: &[&str]) -> Output {
    harpe_cmd().arg("search-bases").args(args).output().expect("run harpe")
}

fn json(args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.push("--json");
    let out = search_bases(&a);
    assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON object")
}

fn bases(v: &Value) -> Vec<f64> {
    v["bases"].as_array().expect("bases").iter().map(|b| b.as_f64().expect("number")).collect()
}

/// Runs `args`, expects exit code 1 and an `error:` message containing `needle` and a `hint:` line.
fn fails(args: &[&str], needle: &str) {
    let out = search_bases(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?} should fail, stderr: {err}");
    assert!(err.starts_with("error: "), "{args:?}: {err}");
    assert!(err.contains(needle), "{args:?}: expected {needle:?} in {err}");
    assert!(err.lines().any(|l| l.starts_with("hint:")), "{args:?}: no hint line in {err}");
    assert!(out.stdout.is_empty(), "{args:?}: nothing on stdout on error");
}

fn model_dir(config: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("config.json"), config).expect("write config");
    dir
}

fn read_rope(path: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(path).expect("snippet written");
    let doc: toml::Table = toml::from_str(&text).expect("snippet is valid TOML");
    assert_eq!(doc.len(), 1, "only a [rope] section: {text}");
    let rope = doc["rope"].as_table().expect("[rope] table");
    assert_eq!(rope["scheme"].as_str(), Some("harpe"));
    // the snippet is exactly what a run config's [rope] section deserializes into
    match toml::Value::Table(rope.clone()).try_into::<RopeScheme>().expect("parses as RopeScheme") {
        RopeScheme::Harpe { head_bases, layer_head_bases: None } => head_bases,
        other => panic!("expected harpe, got {other:?}"),
    }
}

#[test]
fn table2_json_and_toml_snippet() {
    let v = json(&["--method", "table2"]);
    assert_eq!(v["method"], "table2");
    let want: Vec<f64> = TABLE2_BASES.iter().map(|&b| b as f64).collect();
    assert_eq!(bases(&v), want);

    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("rope.toml");
    let o = search_bases(&["--method", "table2", "--order", "desc", "--out", out.to_str().expect("utf8")]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("4540000.0"), "text output lists the bases: {text}");
    let mut rev = want.clone();
    rev.reverse();
    assert_eq!(read_rope(&out), rev);
}

#[test]
fn uniform_bases_in_both_orders() {
    let v = json(&["--method", "uniform", "--heads", "4", "--min", "1e6", "--max", "4e6"]);
    assert_eq!(v["method"], "uniform");
    assert_eq!(bases(&v), vec![1e6, 2e6, 3e6, 4e6]);
    let v = json(&["--method", "uniform", "--heads", "3", "--order", "desc"]);
    assert_eq!(bases(&v), vec![5e6, 3e6, 1e6]);
    let v = json(&["--method", "uniform"]);
    let b = bases(&v);
    assert_eq!(b.len(), 32);
    approx::assert_relative_eq!(b[1] - b[0], 4e6 / 31.0, max_relative = 1e-12);
}

#[test]
fn peak_valley_json_snippet_and_plot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (out, png) = (dir.path().join("pv.toml"), dir.path().join("pv.png"));
    let args = [
        "--method",
        "peak-valley",
        "--heads",
        "5",
        "--min",
        "10000",
        "--max",
        "30000",
        "--stride",
        "500",
        "--orig-len",
        "4096",
        "--target-len",
        "4096",
        "--out",
        out.to_str().expect("utf8"),
        "--plot",
        png.to_str().expect("utf8"),
    ];
    let v = json(&args);
    assert_eq!(v["method"], "peak-valley");
    let b = bases(&v);
    assert_eq!(b.len(), 5);
    assert_eq!(b[0], 10000.0);
    assert!(b.windows(2).all(|w| w[0] < w[1]), "ascending, distinct: {b:?}");
    assert!(b.iter().all(|x| (x - 10000.0) % 500.0 == 0.0 && *x <= 30000.0), "{b:?}");
    assert_eq!(v["candidates"], 40);
    assert_eq!(v["params"]["grid_lo"], 1000);
    assert_eq!(v["params"]["grid_hi"], 4090);
    let picks = v["picks"].as_array().expect("picks");
    assert_eq!(picks.len(), 5);
    assert_eq!(picks[0]["base"], 10000.0);
    assert!(picks[0]["d"].is_null() && picks[1..].iter().all(|p| p["d"].is_u64()));
    // the start base's extrema are the values Attention Buckets' own peak/trough finders give at base 10000
    let e0 = &v["extrema"][0];
    assert_eq!(e0["peaks"], serde_json::json!([1030, 1189, 1375, 1589, 1835, 2118]));
    assert_eq!(e0["valleys"], serde_json::json!([1970, 2290, 2629, 3044, 3515, 4060]));
    assert_eq!(read_rope(&out), b);
    let img = std::fs::read(&png).expect("plot written");
    assert!(img.starts_with(b"\x89PNG\r\n\x1a\n") && img.len() > 10_000, "a real PNG, {} bytes", img.len());

    // deterministic, and --order desc only reverses the head assignment
    let mut desc = json(&args[..14].iter().copied().chain(["--order", "desc"]).collect::<Vec<_>>());
    let mut rb = bases(&desc);
    rb.reverse();
    assert_eq!(rb, b);
    desc["bases"] = v["bases"].clone();
    desc["order"] = v["order"].clone();
    assert_eq!(desc["picks"], v["picks"]);
}

#[test]
fn table2_and_uniform_plots() {
    let dir = tempfile::tempdir().expect("tempdir");
    let png = dir.path().join("u.png");
    let p = png.to_str().expect("utf8");
    let o = search_bases(&["--method", "uniform", "--heads", "3", "--target-len", "4096", "--plot", p]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read(&png).expect("plot").starts_with(b"\x89PNG"));
    fails(
        &["--method", "uniform", "--heads", "3", "--plot", "/nonexistent-dir/x.png", "--target-len", "4096"],
        "x.png",
    );
}

#[test]
fn model_head_counts() {
    // GQA: 32 query heads, 8 kv heads, head_dim from hidden_size
    let gqa = model_dir(r#"{"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}"#);
    let m = gqa.path().to_str().expect("utf8");
    for heads in [None, Some("8"), Some("32")] {
        let mut a = vec!["--method", "uniform", "--model", m];
        if let Some(h) = heads {
            a.extend(["--heads", h]);
        }
        let v = json(&a);
        assert_eq!(bases(&v).len(), 8, "{heads:?}");
        assert_eq!(v["heads"], 8);
    }
    fails(&["--method", "uniform", "--model", m, "--heads", "12"], "matches neither");
    fails(&["--method", "table2", "--model", m], "8 are needed");
    // MHA (num_key_value_heads absent): Table 2 fits
    let mha = model_dir(r#"{"num_attention_heads": 32, "hidden_size": 4096}"#);
    let v = json(&["--method", "table2", "--model", mha.path().to_str().expect("utf8")]);
    assert_eq!(bases(&v).len(), 32);
    // broken model directories name the file
    let empty = tempfile::tempdir().expect("tempdir");
    fails(&["--model", empty.path().to_str().expect("utf8")], "config.json");
    let bad = model_dir(r#"{"hidden_size": 4096}"#);
    fails(&["--model", bad.path().to_str().expect("utf8")], "num_attention_heads");
    let odd = model_dir(r#"{"num_attention_heads": 32, "num_key_value_heads": 5}"#);
    fails(&["--model", odd.path().to_str().expect("utf8")], "num_key_value_heads = 5");
}

#[test]
fn bad_input_errors() {
    let small = ["--orig-len", "4096", "--target-len", "4096"];
    let pv = |extra: &[&str]| -> Vec<String> {
        ["--method", "peak-valley"].iter().chain(&small).chain(extra).map(|s| s.to_string()).collect()
    };
    let run = |a: Vec<String>, needle: &str| fails(&a.iter().map(String::as_str).collect::<Vec<_>>(), needle);
    run(pv(&["--min", "5e6", "--max", "1e6"]), "smaller than --max");
    run(pv(&["--min", "1e6", "--max", "1e6"]), "smaller than --max");
    fails(&["--method", "uniform", "--min", "3e6", "--max", "2e6"], "smaller than --max");
    run(pv(&["--stride", "0"]), "--stride 0");
    run(pv(&["--stride=-30000"]), "positive");
    run(pv(&["--stride", "5000000"]), "larger than the range");
    run(pv(&["--min", "1e6", "--max", "1.1e6", "--heads", "5"]), "only 4");
    fails(&["--method", "uniform", "--heads", "0"], "--heads 0");
    fails(&["--method", "table2", "--heads", "16"], "16 are needed");
    fails(&["--method", "table2", "--stride", "1000"], "does not apply");
    fails(&["--method", "uniform", "--stride", "1000"], "does not apply");
    fails(&["--method", "uniform", "--head-dim", "127", "--heads", "2"], "even");
    fails(&["--method", "uniform", "--orig-len", "0"], "positive");
}

#[test]
fn help_documents_every_flag() {
    let out = harpe_cmd().args(["search-bases", "--help"]).output().expect("run");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--method",
        "--heads",
        "--model",
        "--min",
        "--max",
        "--stride",
        "--order",
        "--head-dim",
        "--orig-len",
        "--target-len",
        "--out",
        "--json",
        "--plot",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
    let flat = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(flat.contains("does not reproduce Table 2"), "{flat}");
}
