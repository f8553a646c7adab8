//! `[eval]` and checkpoints in multi-rank runs, through the `harpe` binary: every rank
//! scores its share of the items and the logged numbers are one rank's evaluation of the same weights
//! (the eval commands on the run's own final checkpoint, 1e-9 relative), within training's summation
//! noise of a one-rank run, also across a resume; an evaluation and a checkpoint commit that each
//! outlast `dist.timeout_s` (test hooks `HARPE_TEST_SLOW_EVAL` / `HARPE_TEST_SLOW_COMMIT` make them slow
//! deterministically) do not stop the run, while a rank left waiting longer than the timeout still does.
use super::train_dist::{ckpt, eval_lines, harpe_text, train, TINY};
use crate::common::harpe_cmd;
use std::path::{Path, PathBuf};
use std::process::Output;

/// `n` documents of different lengths (ppl_inputs).
fn docs(dir: &Path, n: usize) -> Vec<PathBuf> {
    (0..n)
        .map(|i| {
            let p = dir.join(format!("doc{i}.txt"));
            let text = format!("Doc {i}: a small fox counted {} stars, then {} more. ", 12 + i, 30 * i);
            std::fs::write(&p, text.repeat(2 + i)).unwrap();
            p
        })
        .collect()
}

/// A prepared loss dataset of 64-token sequences, tokenized as the run is (the byte tokenizer).
fn loss_data(dir: &Path) -> PathBuf {
    let tok = dir.join("tokenizer.json");
    std::fs::write(&tok, harpe::model::testing::byte_tokenizer_json()).unwrap();
    let out = dir.join("val64");
    let opts = harpe::data::PrepareOptions::new(64);
    harpe::data::prepare_from_texts(&harpe::data::builtin_texts(7), &tok, &opts, &out).unwrap();
    out
}

/// TINY with an `[eval]` table (`extra`: more keys) written to `dir/name`.
fn eval_cfg(dir: &Path, name: &str, docs: &[PathBuf], extra: &str) -> PathBuf {
    let inputs: Vec<String> = docs.iter().map(|p| format!("{:?}", p.display().to_string())).collect();
    let table = format!("\n[eval]\nppl_inputs = [{}]\nppl_max_tokens = 100\n{extra}", inputs.join(", "));
    let p = dir.join(name);
    std::fs::write(&p, format!("{TINY}{table}")).unwrap();
    p
}

fn rel(a: f64, b: f64) -> f64 {
    ((a - b) / b).abs()
}

/// Two runs' evaluations at the same steps agree: perplexity and loss buckets within `tol` relative,
/// token counts and passkey scores exactly.
fn assert_same_evals(a: &[serde_json::Value], b: &[serde_json::Value], tol: f64) {
    let steps = |v: &[serde_json::Value]| v.iter().map(|x| x["step"].as_u64().unwrap()).collect::<Vec<_>>();
    assert_eq!(steps(a), steps(b));
    for (x, y) in a.iter().zip(b) {
        let (ex, ey) = (&x["eval"], &y["eval"]);
        let at = x["step"].clone();
        let (nx, ny) = (ex["ppl"]["nll"].as_f64().unwrap(), ey["ppl"]["nll"].as_f64().unwrap());
        assert!(rel(nx, ny) <= tol, "step {at}: nll {nx} vs {ny}");
        assert_eq!(ex["ppl"]["tokens"], ey["ppl"]["tokens"], "step {at}");
        assert_eq!(ex["passkey"], ey["passkey"], "step {at}");
        let buckets = ex["loss_by_bucket"].as_object().cloned().unwrap_or_default();
        assert_eq!(buckets.len(), ey["loss_by_bucket"].as_object().map_or(0, |m| m.len()), "step {at}");
        for (k, v) in buckets {
            let (lx, ly) = (v.as_f64().unwrap(), ey["loss_by_bucket"][&k].as_f64().unwrap());
            assert!(rel(lx, ly) <= tol, "step {at} bucket {k}: {lx} vs {ly}");
        }
    }
}

/// `harpe CMD ... --json` on a checkpoint, parsed.
fn eval_json(args: &[&str]) -> serde_json::Value {
    let (ok, text) = harpe_text(args);
    assert!(ok, "harpe {args:?}:\n{text}");
    let line = text.lines().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("no JSON in:\n{text}"));
    serde_json::from_str(line).unwrap()
}

#[test]
fn eval_on_every_rank_gives_one_ranks_numbers_and_resumes_without_repeating() {
    let d = tempfile::tempdir().unwrap();
    let docs = docs(d.path(), 3); // 3 documents on 4 ranks: one rank scores none
    let loss = loss_data(d.path());
    let extra = format!(
        "every = 2\npasskey_lengths = [300]\npasskey_samples = 3\nloss_data = {:?}\nloss_buckets = [16, 48]\nloss_max_sequences = 5\n",
        loss.display().to_string()
    );
    let cfg = eval_cfg(d.path(), "eval.toml", &docs, &extra);
    let (one, many, resumed) = (d.path().join("one"), d.path().join("many"), d.path().join("resumed"));
    train(&cfg, &one, &[]);
    let dist = ["dist.backend=local", "dist.world_size=4", "dist.sp_degree=2", "dist.zero_stage=3"];
    let sets: Vec<&str> = dist.iter().flat_map(|s| ["--set", s]).collect();
    train(&cfg, &many, &sets);
    let (a, b) = (eval_lines(&one), eval_lines(&many));
    assert_eq!(b.len(), 4, "evaluations at 2, 3 (stage end), 4 and 5: {b:?}");
    // training sums gradients in another order on 4 ranks: the weights, and so the numbers, differ by noise
    assert_same_evals(&a, &b, 1e-4);

    // the 4-rank numbers are one rank's evaluation of the 4-rank weights: the eval commands on its final
    // checkpoint (f32 model files; stage 1's window 64, stride 32)
    let (model, last) = (ckpt(&many, 5), &b[3]["eval"]);
    let mut ppl = vec!["eval-ppl", "--model", model.to_str().unwrap(), "--window", "64", "--stride", "32"];
    ppl.extend(["--max-tokens", "100", "--json", "--input"]);
    ppl.extend(docs.iter().map(|p| p.to_str().unwrap()));
    let cmd = eval_json(&ppl);
    let (nll, want) = (last["ppl"]["nll"].as_f64().unwrap(), cmd["nll"].as_f64().unwrap());
    assert!(rel(nll, want) < 1e-9, "nll {nll} vs eval-ppl {want}");
    assert_eq!(last["ppl"]["tokens"], cmd["tokens"]);
    let el = ["eval-loss", "--model", model.to_str().unwrap(), "--data", loss.to_str().unwrap()];
    let cmd = eval_json(&[&el[..], &["--buckets", "16,48", "--max-sequences", "5", "--json"]].concat());
    let buckets = last["loss_by_bucket"].as_object().unwrap();
    assert_eq!(buckets.len(), 3);
    for (k, v) in buckets {
        let (got, want) = (v.as_f64().unwrap(), cmd["by_bucket"][k]["loss"].as_f64().unwrap());
        assert!(rel(got, want) < 1e-9, "bucket {k}: {got} vs eval-loss {want}");
    }

    // stopped after step 2 (evaluated) and resumed: rank 0 tells every rank the logged evaluations,
    // so none is repeated and the ranks stay in step; the same lines as the straight run
    train(&cfg, &resumed, &[&sets[..], &["--steps", "2"]].concat());
    train(&cfg, &resumed, &[&sets[..], &["--resume"]].concat());
    assert_same_evals(&b, &eval_lines(&resumed), 0.0);
}

/// `harpe train` of `cfg` on 2 `Local` ranks under ZeRO-3 with `dist.timeout_s = 5`, each evaluated item
/// taking `item_s` seconds longer and each commit 7 s longer (the test hooks).
fn slow_run(cfg: &Path, out: &Path, item_s: &str) -> Output {
    harpe_cmd()
        .args(["train", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .args(["--set", "dist.backend=local", "--set", "dist.world_size=2", "--set", "dist.zero_stage=3"])
        .args(["--set", "dist.timeout_s=5", "--set", "checkpoint.every=0"])
        .env("HARPE_TEST_SLOW_EVAL", item_s)
        .env("HARPE_TEST_SLOW_COMMIT", "7")
        .output()
        .unwrap()
}

#[test]
fn an_evaluation_and_a_commit_longer_than_dist_timeout_do_not_stop_the_run() {
    let d = tempfile::tempdir().unwrap();
    // 4 documents and 4 passkey samples at 2 s each: 16 s of evaluation, 8 s on each of 2 ranks, and
    // commits of 7 s, all longer than dist.timeout_s = 5 (rank 0 alone would evaluate for 16 s while
    // its peer waited in a collective)
    let docs4 = docs(d.path(), 4);
    let cfg = eval_cfg(d.path(), "slow.toml", &docs4, "passkey_lengths = [300]\npasskey_samples = 4\n");
    let (one, slow) = (d.path().join("one"), d.path().join("slow"));
    train(&cfg, &one, &["--set", "checkpoint.every=0"]);
    let t0 = std::time::Instant::now();
    let o = slow_run(&cfg, &slow, "2");
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{text}");
    assert!(t0.elapsed().as_secs_f64() > 2.0 * 8.0 + 2.0 * 7.0, "the hooks did not slow the run:\n{text}");
    let evs = eval_lines(&slow);
    assert_eq!(evs.iter().map(|v| v["step"].as_u64().unwrap()).collect::<Vec<_>>(), [3, 5], "{text}");
    assert_same_evals(&eval_lines(&one), &evs, 1e-4);
    for step in [3, 5] {
        let dir = ckpt(&slow, step);
        assert!(dir.join("DONE").is_file() && dir.join("optim-00001-of-00002.safetensors").is_file());
    }

    // the control: the timeout is live. 3 documents on 2 ranks leave rank 1 one item short, and an
    // item of 7 s keeps it waiting for rank 0 longer than dist.timeout_s: the run stops, saying so
    let docs3 = &docs4[..3];
    let cfg3 = eval_cfg(d.path(), "uneven.toml", docs3, "");
    let o = slow_run(&cfg3, &d.path().join("uneven"), "7");
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(!o.status.success(), "{text}");
    assert!(text.contains("dist.timeout_s"), "{text}");
}
