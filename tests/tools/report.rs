//! `harpe report` on synthetic run directories: means, sample deviations, paired differences and their
//! 95% intervals against values computed here independently (t quantiles from a printed table), the
//! output files, and the bad-input errors (mixed eval settings, unknown baseline, duplicate runs).
use crate::common::harpe_cmd;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// t(0.975, df) from a printed table (not from the crate under test).
const T975: [f64; 5] = [f64::NAN, 12.706204736, 4.302652730, 3.182446305, 2.776445105];

fn eval_spec(samples: u64) -> Value {
    json!({ "niah": { "tasks": "passkey", "lengths": [512, 2048], "samples": samples, "force": false } })
}

/// A run directory as `harpe sweep` leaves it: sweep-run.json, metrics.jsonl, eval/summary.json.
fn write_run(root: &Path, arm: &str, seed: u64, losses: &[f64], eval: &[(&str, f64)], spec: &Value) -> PathBuf {
    let dir = root.join(format!("{arm}__seed{seed}"));
    std::fs::create_dir_all(dir.join("eval")).unwrap();
    let marker = json!({
        "format": "harpe-sweep-run-v1", "sweep": "synthetic", "id": format!("{arm}__seed{seed}"), "arm": arm,
        "seed": seed, "config": "base.toml", "set": [], "config_hash": "0".repeat(64), "eval": spec,
    });
    std::fs::write(dir.join("sweep-run.json"), marker.to_string()).unwrap();
    let mut lines = String::new();
    for (i, l) in losses.iter().enumerate() {
        let step = i as u64 + 1;
        let r = json!({
            "step": step, "stage": 0, "seq_len": 64, "loss": l, "grad_norm": 1.0, "lr": 1e-3, "tokens": 1000,
            "tokens_seen": 1000 * step, "tokens_per_s": 500.0, "tflops": 0.0, "rss_bytes": 1, "step_peak_bytes": 1,
            "step_start_bytes": 1, "skipped": false, "elapsed_s": step as f64,
        });
        lines.push_str(&format!("{r}\n"));
    }
    std::fs::write(dir.join("metrics.jsonl"), lines).unwrap();
    let summary: serde_json::Map<String, Value> = eval.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
    std::fs::write(dir.join("eval/summary.json"), Value::Object(summary).to_string()).unwrap();
    dir
}

fn report(args: &[&str]) -> std::process::Output {
    harpe_cmd().arg("report").args(args).output().unwrap()
}

fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len() as f64
}
fn sd(x: &[f64]) -> f64 {
    let m = mean(x);
    (x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (x.len() - 1) as f64).sqrt()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + b.abs())
}

#[test]
fn report_statistics_match_independent_computation() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = eval_spec(20);
    // arm "ms" (baseline) and "harpe", seeds 0..3; "harpe" lacks seed 2 for the paired part of one metric
    let ms_pk = [50.0, 40.0, 75.0];
    let hp_pk = [80.0, 60.0, 70.0];
    let ms_long = [10.0, 0.0, 5.0];
    let hp_long = [35.0, 20.0, 40.0];
    let mut dirs = vec![];
    for s in 0..3u64 {
        let i = s as usize;
        // last-10 mean of the training loss: losses 20 steps, the last ten are 2.0 + i/10 + k/100
        let ms_loss: Vec<f64> =
            (0..20).map(|k| if k < 10 { 5.0 } else { 2.0 + i as f64 / 10.0 + k as f64 / 100.0 }).collect();
        let hp_loss: Vec<f64> =
            (0..20).map(|k| if k < 10 { 5.0 } else { 1.9 + i as f64 / 20.0 + k as f64 / 100.0 }).collect();
        dirs.push(write_run(
            tmp.path(),
            "ms",
            s,
            &ms_loss,
            &[("passkey@512", ms_pk[i]), ("passkey@2048", ms_long[i])],
            &spec,
        ));
        dirs.push(write_run(
            tmp.path(),
            "harpe",
            s,
            &hp_loss,
            &[("passkey@512", hp_pk[i]), ("passkey@2048", hp_long[i])],
            &spec,
        ));
    }
    let out = tmp.path().join("rep");
    let mut args: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    args.extend(["--baseline".into(), "ms".into(), "--json".into(), "--out".into(), out.display().to_string()]);
    let o = report(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["baseline"], "ms");
    let arm = |name: &str| v["arms"].as_array().unwrap().iter().find(|a| a["arm"] == name).unwrap().clone();
    let (ms, hp) = (arm("ms"), arm("harpe"));
    assert_eq!(ms["seeds"], json!([0, 1, 2]));

    // per-arm mean and sample std
    for (a, vals, m) in [(&ms, ms_pk, "passkey@512"), (&hp, hp_pk, "passkey@512"), (&hp, hp_long, "passkey@2048")] {
        let s = &a["metrics"][m];
        assert_eq!(s["n"], 3);
        assert!(close(s["mean"].as_f64().unwrap(), mean(&vals)), "{m}: {s}");
        assert!(close(s["std"].as_f64().unwrap(), sd(&vals)), "{m}: {s}");
    }
    // train_loss = mean of the last 10 steps
    let want: Vec<f64> =
        (0..3).map(|i| mean(&(10..20).map(|k| 1.9 + i as f64 / 20.0 + k as f64 / 100.0).collect::<Vec<_>>())).collect();
    assert!(close(hp["metrics"]["train_loss"]["mean"].as_f64().unwrap(), mean(&want)));
    // cost: tokens seen and summed step time (1000 tokens at 500 tok/s per step, 20 steps)
    assert!(close(hp["metrics"]["cost:tokens"]["mean"].as_f64().unwrap(), 20000.0));
    assert!(close(hp["metrics"]["cost:train_s"]["mean"].as_f64().unwrap(), 40.0));

    // paired differences (harpe - ms by seed) with t intervals
    for (m, a, b) in [("passkey@512", hp_pk, ms_pk), ("passkey@2048", hp_long, ms_long)] {
        let d: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
        let h = T975[2] * sd(&d) / 3f64.sqrt();
        let got = &hp["diff"][m];
        assert_eq!(got["n"], 3);
        assert!(close(got["mean"].as_f64().unwrap(), mean(&d)), "{m}: {got}");
        assert!((got["ci"][0].as_f64().unwrap() - (mean(&d) - h)).abs() < 1e-6, "{m}: {got}");
        assert!((got["ci"][1].as_f64().unwrap() - (mean(&d) + h)).abs() < 1e-6, "{m}: {got}");
    }
    assert!(ms["diff"].as_object().unwrap().is_empty(), "the baseline has no difference to itself");

    // files: Markdown, CSV (one row per arm x metric), JSON, loss curves, one plot per retrieval task
    for f in ["report.md", "report.csv", "report.json", "loss_curves.png", "passkey_by_length.png"] {
        assert!(out.join(f).exists(), "missing {f}");
    }
    let png = std::fs::read(out.join("passkey_by_length.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("| harpe | 3 |") && md.contains("passkey by length"), "{md}");
    let csv = std::fs::read_to_string(out.join("report.csv")).unwrap();
    let row = csv.lines().find(|l| l.starts_with("harpe,passkey@512,")).unwrap();
    let cols: Vec<&str> = row.split(',').collect();
    assert_eq!(cols[2], "3");
    assert!(close(cols[3].parse().unwrap(), mean(&hp_pk)));
    assert!(close(cols[6].parse().unwrap(), 15.0), "{row}");

    // bootstrap: a deterministic percentile interval inside the range of the differences
    let mut bargs = args.clone();
    bargs.extend(["--bootstrap".into(), "4000".into()]);
    let run_b = || {
        let o = report(&bargs.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<Value>(&o.stdout).unwrap()
    };
    let (b1, b2) = (run_b(), run_b());
    let harpe_b = b1["arms"].as_array().unwrap().iter().find(|a| a["arm"] == "harpe").unwrap().clone();
    let ci = &harpe_b["diff"]["passkey@512"]["ci"];
    let (lo, hi) = (ci[0].as_f64().unwrap(), ci[1].as_f64().unwrap());
    assert!((-5.0..=30.0).contains(&lo) && (-5.0..=30.0).contains(&hi) && lo < 15.0 && hi > 15.0, "{lo} {hi}");
    assert_eq!(b1["arms"], b2["arms"]);
}

#[test]
fn report_reads_a_sweep_index_and_pairs_by_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = eval_spec(5);
    let root = tmp.path().join("sw");
    // baseline has seeds 0, 1, 2; the other arm 1, 2 only (and an unfinished seed 0 left out)
    let mut runs = vec![];
    for (arm, seed, v) in [("b", 0, 1.0), ("b", 1, 2.0), ("b", 2, 4.0), ("a", 1, 3.0), ("a", 2, 7.0)] {
        write_run(&root, arm, seed, &[3.0, 2.0], &[("nll:held", v)], &spec);
        runs.push(
            json!({"id": format!("{arm}__seed{seed}"), "arm": arm, "seed": seed, "dir": format!("{arm}__seed{seed}"),
            "state": "done", "attempts": 1, "train_s": 1.0, "eval_s": 1.0}),
        );
    }
    runs.push(json!({"id": "a__seed0", "arm": "a", "seed": 0, "dir": "a__seed0", "state": "training", "attempts": 1, "train_s": 0.0, "eval_s": 0.0}));
    let ix = json!({"format": "harpe-sweep-v1", "name": "synthetic", "spec": "s.toml", "eval": spec, "runs": runs});
    std::fs::write(root.join("sweep.json"), ix.to_string()).unwrap();
    let o = report(&[root.to_str().unwrap(), "--baseline", "b", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let a = v["arms"].as_array().unwrap().iter().find(|a| a["arm"] == "a").unwrap().clone();
    assert_eq!(a["seeds"], json!([1, 2]));
    let d = &a["diff"]["nll:held"];
    // pairs: seed 1: 3 - 2 = 1, seed 2: 7 - 4 = 3 -> mean 2, sd sqrt(2), half width t(1) * sqrt(2) / sqrt(2)
    assert_eq!(d["n"], 2);
    assert!(close(d["mean"].as_f64().unwrap(), 2.0));
    assert!((d["ci"][0].as_f64().unwrap() - (2.0 - T975[1])).abs() < 1e-6, "{d}");
    assert!(root.join("report.md").exists(), "default --out is the first directory");
    assert!(String::from_utf8_lossy(&o.stderr).contains("a__seed0"), "the unfinished run is named as left out");
}

#[test]
fn report_bad_input_names_the_directory_or_arm() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write_run(tmp.path(), "x", 0, &[1.0], &[("passkey@512", 1.0)], &eval_spec(20));
    let b = write_run(tmp.path(), "y", 0, &[1.0], &[("passkey@512", 1.0)], &eval_spec(50));
    let o = report(&[a.to_str().unwrap(), b.to_str().unwrap()]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        e.contains("different settings") && e.contains("x__seed0") && e.contains("y__seed0") && e.contains("hint:"),
        "{e}"
    );

    let c = write_run(tmp.path(), "z", 0, &[1.0], &[("passkey@512", 1.0)], &eval_spec(20));
    let o = report(&[a.to_str().unwrap(), c.to_str().unwrap(), "--baseline", "nope"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("`nope`") && e.contains("x, z"), "{e}");

    let o = report(&[a.to_str().unwrap(), a.to_str().unwrap()]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("both arm `x` seed 0"), "{e}");

    let o = report(&[tmp.path().join("missing").to_str().unwrap()]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("missing") && e.contains("hint:"), "{e}");
}

#[test]
fn report_shows_eval_tasks_columns_when_present() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = eval_spec(5);
    let mut dirs = vec![];
    for (arm, seed, acc) in [("b", 0, 0.25), ("b", 1, 0.5), ("a", 0, 0.5), ("a", 1, 1.0)] {
        let d = write_run(tmp.path(), arm, seed, &[3.0, 2.0], &[("nll:held", 1.0)], &spec);
        // results.json as `harpe eval-tasks --out RUN_DIR/eval-tasks` writes it (the harness's shape)
        std::fs::create_dir_all(d.join("eval-tasks")).unwrap();
        let r = json!({"results": {
            "mmlu": {"alias": "mmlu", "acc,none": acc, "acc_stderr,none": 0.1},
            "mmlu_anatomy": {"alias": "anatomy", "acc,none": 0.0, "acc_stderr,none": "N/A"},
            "hellaswag": {"alias": "hellaswag", "acc,none": 0.3, "acc_norm,none": acc, "acc_stderr,none": 0.1}}});
        std::fs::write(d.join("eval-tasks/results.json"), r.to_string()).unwrap();
        dirs.push(d.to_str().unwrap().to_string());
    }
    let mut a: Vec<&str> = dirs.iter().map(String::as_str).collect();
    a.extend(["--baseline", "b", "--json"]);
    let o = report(&a);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let metrics: Vec<&str> = v["metrics"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    for m in ["mmlu:acc", "hellaswag:acc", "hellaswag:acc_norm"] {
        assert!(metrics.contains(&m), "{m} missing from {metrics:?}");
    }
    assert!(!metrics.iter().any(|m| m.contains("stderr") || m.starts_with("mmlu_")), "{metrics:?}");
    let arm = v["arms"].as_array().unwrap().iter().find(|x| x["arm"] == "a").unwrap();
    assert!(close(arm["metrics"]["mmlu:acc"]["mean"].as_f64().unwrap(), 0.75));
}
