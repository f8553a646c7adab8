//! `harpe eval-loss` through the binary: on a dataset prepared from tests/golden/text.txt (BOS, 12-token
//! sequences = transformers' first three disjoint 12-token windows), the total loss and the --buckets
//! losses equal transformers' per-position NLLs (`default/ppl_disjoint.json`, from make_golden.py).
use crate::common::{harpe_cmd, output};
use std::path::PathBuf;

fn golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

#[test]
fn total_and_bucket_losses_match_transformers() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("ds");
    let prepare = ["prepare-data", "--quiet", "--strategy", "original", "--seq-len", "12", "--input"];
    let (ok, _, err) = output(
        harpe_cmd()
            .args(prepare)
            .arg(golden().join("text.txt"))
            .arg("--tokenizer")
            .arg(golden().join("tokenizer.json"))
            .arg("--out")
            .arg(&data),
    );
    assert!(ok, "{err}");
    let eval = ["eval-loss", "--json", "--buckets", "4,8", "--model"];
    let (ok, out, err) = output(harpe_cmd().args(eval).arg(golden().join("default/model")).arg("--data").arg(&data));
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();

    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden().join("default/ppl_disjoint.json")).unwrap()).unwrap();
    // Window w, entry i: -log p(target i + 1 | its window); the dataset holds the first three windows.
    let nll: Vec<Vec<f64>> = g["position_nll"].as_array().unwrap()[..3]
        .iter()
        .map(|w| w.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect())
        .collect();
    let mean = |lo: usize, hi: usize| {
        let xs: Vec<f64> = nll.iter().flat_map(|w| w[lo - 1..hi - 1].to_vec()).collect();
        (xs.iter().sum::<f64>() / xs.len() as f64, xs.len() as u64)
    };
    assert_eq!(v["sequences"], 3);
    for (key, (lo, hi)) in [("0-4", (1, 4)), ("4-8", (4, 8)), ("8+", (8, 12))] {
        let (want, n) = mean(lo, hi);
        let b = &v["by_bucket"][key];
        assert_eq!(b["tokens"].as_u64().unwrap(), n, "bucket {key}: targets {lo}..{hi} of 3 sequences");
        assert!(
            (b["loss"].as_f64().unwrap() - want).abs() < 1e-4,
            "bucket {key}: {} vs transformers {want}",
            b["loss"]
        );
    }
    let (want, n) = mean(1, 12);
    assert_eq!(v["total"]["tokens"].as_u64().unwrap(), n);
    assert!((v["total"]["loss"].as_f64().unwrap() - want).abs() < 1e-4, "total {} vs {want}", v["total"]["loss"]);
    assert_eq!(v["by_source"]["text"]["tokens"].as_u64().unwrap(), n);

    // Bad --buckets are refused with a hint.
    let o = harpe_cmd()
        .args(["eval-loss", "--buckets", "8,4", "--model"])
        .arg(golden().join("default/model"))
        .arg("--data")
        .arg(&data)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--buckets") && err.contains("hint:"), "{err}");
}
