//! `harpe demo --quick` (what CI runs): corpus -> pretraining -> the untreated model's passkey -> a
//! 4-arm x 2-seed extension sweep with evaluations -> report; every file is produced and the report's
//! numbers are the runs' own (recomputed here from the run directories).
use crate::common::harpe_cmd;
use serde_json::Value;
use std::path::Path;

fn json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

#[test]
fn demo_quick_runs_the_comparison_end_to_end() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("demo");
    let o = harpe_cmd().args(["demo", "--quick", "--out", out.to_str().unwrap()]).output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    for f in [
        "demo.md",
        "base/model.safetensors",
        "base/config.json",
        "base-passkey/results.json",
        "sweep.toml",
        "sweep/sweep.json",
        "report/report.md",
        "report/report.csv",
        "report/report.json",
        "report/loss_curves.png",
        "report/passkey_by_length.png",
    ] {
        assert!(out.join(f).exists(), "missing {f}");
    }
    assert!(stdout.contains("Untreated base model, passkey accuracy: 384:"), "{stdout}");
    // the shipped base retrieves at its own length (else the comparison says nothing)
    let base = json(&out.join("base-passkey/results.json"));
    let at = |len: u64| {
        base["cells"].as_array().unwrap().iter().find(|c| c["length"] == len).unwrap()["score"].as_f64().unwrap()
    };
    assert!(at(384) >= 50.0, "the untreated base scores {} at 384: {base}", at(384));

    let ix = json(&out.join("sweep/sweep.json"));
    let runs = ix["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 8, "4 arms x 2 seeds");
    let rep = json(&out.join("report/report.json"));
    assert_eq!(rep["baseline"], "abf-multistage");
    let arms = rep["arms"].as_array().unwrap();
    let names: Vec<&str> = arms.iter().map(|a| a["arm"].as_str().unwrap()).collect();
    assert_eq!(names, ["harpe", "abf-multistage", "abf", "pi"]);

    // the report's numbers are the runs' own: recompute each arm's mean from the run directories
    let metric = "nll:heldout-1536";
    let mut per_arm: Vec<(String, Vec<f64>)> = vec![];
    for r in runs {
        assert_eq!(r["state"], "done", "{r}");
        let dir = out.join("sweep").join(r["dir"].as_str().unwrap());
        let s = json(&dir.join("eval/summary.json"));
        for k in [metric, "ppl:heldout-1536", "loss:0-384", "loss:384-768", "loss:768+", "passkey@384", "passkey@1536"]
        {
            assert!(s.get(k).and_then(Value::as_f64).is_some(), "{k} missing in {s}");
        }
        let arm = r["arm"].as_str().unwrap().to_string();
        let v = s[metric].as_f64().unwrap();
        assert!(v.is_finite() && v > 0.0);
        match per_arm.iter_mut().find(|(a, _)| *a == arm) {
            Some((_, vs)) => vs.push(v),
            None => per_arm.push((arm, vec![v])),
        }
    }
    for (arm, vs) in &per_arm {
        let got = arms.iter().find(|a| a["arm"] == arm.as_str()).unwrap()["metrics"][metric]["mean"].as_f64().unwrap();
        let want = vs.iter().sum::<f64>() / vs.len() as f64;
        assert!((got - want).abs() < 1e-9, "{arm}: {got} vs {want}");
    }
    // the arms are different models: their held-out losses are not all equal
    let means: Vec<f64> = per_arm.iter().map(|(_, v)| v[0]).collect();
    assert!(means.iter().any(|m| (m - means[0]).abs() > 1e-6), "{means:?}");
    // multi-stage really ran two stages (2T then 4T), the others one at 4T
    let ms = std::fs::read_to_string(out.join("sweep/abf-multistage__seed0/metrics.jsonl")).unwrap();
    let lens: std::collections::BTreeSet<u64> =
        ms.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["seq_len"].as_u64().unwrap()).collect();
    assert_eq!(lens.into_iter().collect::<Vec<_>>(), [768, 1536]);
    let md = std::fs::read_to_string(out.join("demo.md")).unwrap();
    assert!(md.contains("Paired differences") && md.contains("| harpe | 2 |"), "{md}");
}

/// `harpe demo --make-base` (what scripts/make_demo_base.sh runs), reduced: the files `harpe demo`
/// ships come out, loadable, with the provenance of the run that made them.
#[test]
fn make_base_quick_writes_a_loadable_base() {
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("base");
    let o = harpe_cmd()
        .args([
            "demo",
            "--quick",
            "--make-base",
            dest.to_str().unwrap(),
            "--out",
            tmp.path().join("w").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    let cfg = json(&dest.join("config.json"));
    assert_eq!(cfg["hidden_size"], 128);
    assert_eq!(cfg["num_attention_heads"], 4);
    let prov = json(&dest.join("provenance.json"));
    assert_eq!(prov["recipe"]["steps"], 6);
    assert_eq!(prov["tokens"], 6 * 8 * 384);
    assert!(prov["final_train_loss"].as_f64().unwrap().is_finite());
    assert!(prov["passkey"]["384"].as_f64().is_some(), "{prov}");
    // the written weights load and score: eval-ppl on a few bytes of text
    std::fs::write(dest.join("tokenizer.json"), std::fs::read(tmp.path().join("w/tokenizer.json")).unwrap()).unwrap();
    let text = tmp.path().join("t.txt");
    std::fs::write(&text, "The grass is green. The sky is blue. ".repeat(8)).unwrap();
    let o = harpe_cmd()
        .args([
            "eval-ppl",
            "--model",
            dest.to_str().unwrap(),
            "--input",
            text.to_str().unwrap(),
            "--window",
            "128",
            "--stride",
            "64",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ppl: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(ppl["ppl"].as_f64().is_some_and(|p| p.is_finite() && p > 1.0), "{ppl}");
}
