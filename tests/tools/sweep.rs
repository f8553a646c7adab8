//! `harpe sweep`: a 2-arm x 2-seed sweep of tiny runs completes, survives a kill (the killed run resumes
//! from its checkpoint, finished runs are skipped), evaluates every run and reports; bad sweep files and
//! foreign run directories are refused with errors that name the key or the directory.
use crate::common::harpe_cmd;
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub(super) const BASE: &str = concat!(
    model_recipe!(16, 32, 2, 2, 2, "max_position_embeddings = 64"),
    r#"seed = 0
micro_batch_size = 2
global_batch_tokens = 64
activation_checkpointing = "none"
loss_chunk_tokens = 64

[optim]
lr = 3e-3

[schedule]
kind = "constant"

[checkpoint]
every = 4
keep_last = 1

[log]
every = 100
progress = false
plot = false

[[stage]]
seq_len = 32
steps = 40
"#
);

pub(super) fn sweep_toml(extra: &str) -> String {
    format!(
        r#"name = "tiny"
base = "base.toml"
seeds = [0, 1]

[[arm]]
name = "rope"

[[arm]]
name = "harpe"
set = ['rope={{ scheme = "harpe", head_bases = [10000.0, 40000.0] }}']

[[eval.ppl]]
name = "held"
input = ["held.txt"]
window = 32
stride = 16

[eval.niah]
tasks = "passkey"
lengths = [320]
samples = 1
force = true
{extra}"#
    )
}

pub(super) fn setup(dir: &Path, sweep: &str) {
    std::fs::write(dir.join("base.toml"), BASE).unwrap();
    std::fs::write(dir.join("sweep.toml"), sweep).unwrap();
    std::fs::write(dir.join("held.txt"), "Ada found a red box by the river. Then Ada went home. 3 + 4 = 7. ".repeat(3))
        .unwrap();
}

/// `harpe ARGS` run in `dir`.
pub(super) fn harpe_in(dir: &Path, args: &[&str]) -> std::process::Output {
    harpe_cmd().current_dir(dir).args(args).output().unwrap()
}

fn index(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("out/sweep.json")).unwrap()).unwrap()
}

fn state(ix: &Value, id: &str) -> String {
    ix["runs"].as_array().unwrap().iter().find(|r| r["id"] == id).unwrap()["state"].as_str().unwrap().to_string()
}

/// Pids of processes whose command line contains `needle` (Linux /proc).
fn processes_with(needle: &str) -> Vec<String> {
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.chars().all(|c| c.is_ascii_digit()) {
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmd).replace('\0', " ").contains(needle) {
                out.push(name);
            }
        }
    }
    out
}

/// A complete checkpoint (`step_N/DONE`, what `checkpoint::list_complete` resumes from). Not `.tmp-step_N`:
/// a save writes DONE there before its rename, and a kill in between can leave the victim with nothing to
/// resume, and the sweep then says `train` where this test expects `resume`.
pub(super) fn has_checkpoint(run: &Path) -> bool {
    std::fs::read_dir(run.join("checkpoints"))
        .map(|rd| {
            rd.flatten().any(|e| e.file_name().to_string_lossy().starts_with("step_") && e.path().join("DONE").exists())
        })
        .unwrap_or(false)
}

#[test]
fn sweep_runs_resumes_after_a_kill_and_reports() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    setup(d, &sweep_toml(""));
    let ids = ["rope__seed0", "rope__seed1", "harpe__seed0", "harpe__seed1"];

    // dry run: the four runs with their overrides, nothing written
    let o = harpe_in(d, &["sweep", "--config", "sweep.toml", "--out", "out", "--dry-run"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{text}{}", String::from_utf8_lossy(&o.stderr));
    for id in ids {
        assert!(text.contains(id), "{text}");
    }
    assert!(!d.join("out").exists());

    // start, and kill the sweep (SIGKILL) as soon as the second run has a checkpoint
    let mut child = harpe_cmd()
        .current_dir(d)
        .args(["sweep", "--config", "sweep.toml", "--out", "out"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let victim = d.join("out").join(ids[1]);
    let t0 = Instant::now();
    while !has_checkpoint(&victim) {
        assert!(t0.elapsed() < Duration::from_secs(300), "no checkpoint appeared in {}", victim.display());
        assert!(child.try_wait().unwrap().is_none(), "the sweep ended before it could be killed");
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    // the orphaned `harpe train` gets SIGTERM (parent-death signal) and checkpoints; wait until it is gone
    // (and end it if it is not gone within a minute: what matters here is the sweep's resume)
    let t0 = Instant::now();
    loop {
        let pids = processes_with(&format!("out/{} ", ids[1]));
        if pids.is_empty() {
            break;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            for pid in pids {
                let _ = Command::new("kill").args(["-9", &pid]).status();
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let ix = index(d);
    assert_eq!(state(&ix, ids[0]), "done", "{ix}");
    assert_eq!(state(&ix, ids[1]), "training", "{ix}");
    assert_eq!(state(&ix, ids[2]), "pending", "{ix}");
    let first_metrics = std::fs::read(d.join("out").join(ids[0]).join("metrics.jsonl")).unwrap();

    // rerun: the finished run is skipped, the killed one resumes, the rest run
    let o = harpe_in(d, &["sweep", "--config", "sweep.toml", "--out", "out"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{text}{}", String::from_utf8_lossy(&o.stderr));
    assert!(text.contains("1 already done, 3 to go"), "{text}");
    assert!(text.contains(&format!("[sweep] resume {}", ids[1])), "{text}");
    assert!(std::fs::read_to_string(victim.join("train.log")).unwrap().contains("resuming from"));
    assert_eq!(std::fs::read(d.join("out").join(ids[0]).join("metrics.jsonl")).unwrap(), first_metrics);
    let ix = index(d);
    for id in ids {
        assert_eq!(state(&ix, id), "done", "{ix}");
        let run = d.join("out").join(id);
        let steps = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap().lines().count();
        assert_eq!(steps, 40, "{id}: one record per step, also across the kill");
        let s: Value = serde_json::from_str(&std::fs::read_to_string(run.join("eval/summary.json")).unwrap()).unwrap();
        assert!(s["nll:held"].as_f64().unwrap() > 0.0 && s["ppl:held"].as_f64().unwrap() > 1.0, "{s}");
        assert!(s.get("passkey@320").is_some(), "{s}");
        let m: Value = serde_json::from_str(&std::fs::read_to_string(run.join("sweep-run.json")).unwrap()).unwrap();
        assert_eq!(m["sweep"], "tiny");
    }
    // the arms really differ: the HARPE run's checkpoint carries per-head bases
    let ckpt = std::fs::read_dir(d.join("out/harpe__seed0/checkpoints")).unwrap().flatten().next().unwrap().path();
    assert!(std::fs::read_to_string(ckpt.join("config.json")).unwrap().contains("harpe"));

    // a third run does nothing
    let o = harpe_in(d, &["sweep", "--config", "sweep.toml", "--out", "out"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("4 already done, 0 to go"));

    // report over the sweep
    let o = harpe_in(d, &["report", "out", "--baseline", "rope", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let arms: Vec<&str> = v["arms"].as_array().unwrap().iter().map(|a| a["arm"].as_str().unwrap()).collect();
    assert_eq!(arms, ["rope", "harpe"]);
    let h = &v["arms"][1];
    assert_eq!(h["metrics"]["nll:held"]["n"], 2);
    assert_eq!(h["diff"]["nll:held"]["n"], 2);
    assert!(h["diff"]["nll:held"]["ci"].is_array());
    assert!(d.join("out/report.md").exists() && d.join("out/loss_curves.png").exists());
}

#[test]
fn sweep_bad_input_names_the_key_or_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    // an axis key that is not a config key
    setup(d, &sweep_toml("\n[axes]\n\"optim.learning_rate\" = [1e-3, 2e-3]\n"));
    let o = harpe_in(d, &["sweep", "--config", "sweep.toml", "--dry-run"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("`optim.learning_rate`") && e.contains("hint:"), "{e}");

    // an axis over a real key is fine and multiplies the runs
    std::fs::write(d.join("sweep.toml"), sweep_toml("\n[axes]\n\"optim.lr\" = [1e-3, 2e-3]\n")).unwrap();
    let o = harpe_in(d, &["sweep", "--config", "sweep.toml", "--dry-run"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(text.contains("harpe__optim.lr=0.002__seed1") && text.contains("8 runs"), "{text}");

    // clashing arm names
    std::fs::write(d.join("sweep.toml"), sweep_toml("").replace("name = \"harpe\"", "name = \"rope\"")).unwrap();
    let o = harpe_in(d, &["sweep", "--config", "sweep.toml", "--dry-run"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("arms `rope` and `rope` clash"), "{e}");

    // an arm override with an unknown key
    std::fs::write(d.join("sweep.toml"), sweep_toml("").replace("set = ['rope=", "set = ['optim.nope=1', 'rope="))
        .unwrap();
    let o = harpe_in(d, &["sweep", "--config", "sweep.toml", "--dry-run"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("`optim.nope`") && e.contains("arm `harpe`"), "{e}");

    // a run directory from another sweep
    std::fs::write(d.join("sweep.toml"), sweep_toml("")).unwrap();
    let foreign = d.join("out/rope__seed0");
    std::fs::create_dir_all(&foreign).unwrap();
    let marker = serde_json::json!({"format": "harpe-sweep-run-v1", "sweep": "other", "id": "rope__seed0", "arm": "rope",
        "seed": 0, "config": "x.toml", "set": [], "config_hash": "ab".repeat(32), "eval": {}});
    std::fs::write(foreign.join("sweep-run.json"), marker.to_string()).unwrap();
    let o = harpe_in(d, &["sweep", "--config", "sweep.toml", "--out", "out"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("rope__seed0") && e.contains("sweep `other`") && e.contains("hint:"),
        "{e}"
    );
    assert!(!foreign.join("config.toml").exists(), "nothing was trained");

    // a plain run directory in the way
    std::fs::remove_file(foreign.join("sweep-run.json")).unwrap();
    std::fs::write(foreign.join("config.toml"), "x = 1").unwrap();
    let o = harpe_in(d, &["sweep", "--config", "sweep.toml", "--out", "out"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("rope__seed0") && e.contains("not part of sweep `tiny`"), "{e}");
}

#[test]
fn the_shipped_full_scale_sweeps_resolve() {
    // every recipe and override of configs/sweeps/ resolves (the model need not exist for --dry-run)
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (file, runs, arm) in [
        ("configs/sweeps/harpe-vs-multistage.toml", 30, "abf-ms-32k-64k-128k-split114__seed2"),
        ("configs/sweeps/data-strategies.toml", 15, "upsample-book__seed1"),
    ] {
        let o = harpe_in(root, &["sweep", "--config", file, "--dry-run"]);
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{file}: {}", String::from_utf8_lossy(&o.stderr));
        assert!(text.contains(&format!("{runs} runs")) && text.contains(arm), "{file}: {text}");
    }
    let o = harpe_in(
        root,
        &["sweep", "--config", "configs/sweeps/harpe-vs-multistage.toml", "--dry-run", "--only", "split114"],
    );
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("32768x1.00B -> 65536x1.00B -> 131072x4.00B") && text.contains("3 runs"), "{text}");
}
