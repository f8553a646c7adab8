//! `harpe train` paths no other test touches, through the binary: `--force` over a run directory of
//! another config, SIGINT (finish the step, checkpoint, exit 0), a bf16 run, and `reset_optimizer`.
use crate::common::{harpe_cmd, logged_losses, train_text};
use std::process::{Command, Stdio};

const TINY: &str = concat!(
    tiny_model!(),
    r#"micro_batch_size = 4
global_batch_tokens = 128
loss_chunk_tokens = 100

[optim]
lr = 3e-3

[checkpoint]
every = 0

[log]
progress = false
plot = false

[[stage]]
seq_len = 32
steps = 3

[[stage]]
seq_len = 32
steps = 3
"#
);

fn setup(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("run.toml");
    std::fs::write(&cfg, text).unwrap();
    (d, cfg)
}

#[test]
fn force_reuses_a_directory_of_another_config() {
    let (d, cfg) = setup(TINY);
    let out = d.path().join("r");
    let (ok, err) = train_text(&cfg, &out, &["--steps", "1"]);
    assert!(ok, "{err}");
    let (ok, err) = train_text(&cfg, &out, &["--resume", "--set", "optim.lr=1e-4"]);
    assert!(!ok && err.contains("different config") && err.contains("--force"), "{err}");
    let (ok, err) = train_text(&cfg, &out, &["--resume", "--force", "--set", "optim.lr=1e-4", "--steps", "2"]);
    assert!(ok, "{err}");
    let saved = std::fs::read_to_string(out.join("config.toml")).unwrap();
    let t: toml::Table = toml::from_str(&saved).unwrap();
    assert_eq!(t["optim"]["lr"].as_float(), Some(1e-4), "the directory now holds the new config");
    assert_eq!(logged_losses(&out).len(), 2, "resumed after step 1, ran step 2");
}

#[test]
fn sigint_finishes_the_step_checkpoints_and_exits_0() {
    let (d, cfg) = setup(&TINY.replace("steps = 3\n\n[[stage]]", "steps = 100000\n\n[[stage]]"));
    let out = d.path().join("r");
    let mut child = harpe_cmd()
        .args(["train", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let metrics = out.join("metrics.jsonl");
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map(|s| s.lines().count()).unwrap_or(0) < 2 {
        assert!(t0.elapsed().as_secs() < 120, "training did not start");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success());
    let status = child.wait().unwrap();
    assert!(status.success(), "exit status {status:?}");
    let last =
        harpe::train::checkpoint::latest_complete(&out.join("checkpoints")).unwrap().expect("a checkpoint on SIGINT");
    let steps = logged_losses(&out).len() as u64;
    assert!(last.ends_with(format!("step_{steps:06}")), "{} after {steps} logged steps", last.display());
}

/// The logged losses of TINY trained as it is and with `extra`, and the directory of both runs (the
/// second's is `changed`).
fn as_is_and_with(extra: &[&str]) -> (Vec<f64>, Vec<f64>, tempfile::TempDir) {
    let (d, cfg) = setup(TINY);
    let (as_is, changed) = (d.path().join("as-is"), d.path().join("changed"));
    for (out, args) in [(&as_is, &[][..]), (&changed, extra)] {
        let (ok, err) = train_text(&cfg, out, args);
        assert!(ok, "{args:?}: {err}");
    }
    (logged_losses(&as_is), logged_losses(&changed), d)
}

#[test]
fn a_bf16_run_trains_close_to_f32_but_not_identically() {
    let (a, b, d) = as_is_and_with(&["--set", "train.dtype=\"bf16\""]);
    assert_eq!(a.len(), 6);
    assert_eq!(b.len(), 6);
    for (x, y) in a.iter().zip(&b) {
        assert!(y.is_finite() && (x - y).abs() < 0.1, "bf16 loss {y} vs f32 {x}");
    }
    assert!(a.iter().zip(&b).any(|(x, y)| x != y), "bf16 gave the f32 losses exactly: dtype ignored");
    let saved = std::fs::read_to_string(d.path().join("changed/config.toml")).unwrap();
    assert!(saved.contains("dtype = \"bf16\""), "{saved}");
}

#[test]
fn reset_optimizer_changes_the_run_only_after_the_stage_boundary() {
    let (a, b, _d) = as_is_and_with(&["--set", "stage.1.reset_optimizer=true"]);
    // Steps 1..=4 (stage 0 and the first step of stage 1, whose loss is taken before its update) match
    // bit for bit; from step 5 on the fresh moments (and bias correction) change the trajectory.
    assert_eq!(a[..4], b[..4]);
    assert!(a[4..].iter().zip(&b[4..]).all(|(x, y)| x != y), "reset_optimizer had no effect: {a:?} vs {b:?}");
}
