//! The shared helpers of the integration tests, one of each. Every test binary includes this directory
//! (`#[macro_use] #[path = "../common/mod.rs"] mod common;` in its main.rs):
//! - this file: the recipe's model part (`model_recipe!`, `tiny_model!`), the CLI wrapper (`harpe`,
//!   `harpe_cmd`, `output`) and its thin variants (`harpe_text`, `train_text`, `logged_losses`);
//! - `ops`: the op harness: deterministic inputs (`randv`, `randn`), the max-difference helpers
//!   (`max_abs_diff`, `max_abs`, `rel_err`), the fused-vs-reference check (`check_op`, `fwd_bwd`, `Tol`)
//!   and the one finite-difference checker (`fd_check`, `Fd`);
//! - `data`: the data tests' WordLevel tokenizer and synthetic corpora;
//! - `torchrun()`: PyTorch's launcher for the tests that run harpe under it.
#![allow(dead_code, unused_macros)]
pub mod data;
pub mod ops;
pub mod slurm;

use std::process::Command;

/// The model part every `harpe train` test recipe starts with: a byte-level Llama of the given shape
/// (hidden size, intermediate size, layers, attention heads, kv heads, then any further `[model.init]`
/// lines) on the built-in data, plain RoPE, f32, ending inside `[train]` so a recipe goes on with its own
/// `[train]` keys: `concat!(model_recipe!(256, 512, 4, 4, 2), "micro_batch_size = 2\n...")`.
macro_rules! model_recipe {
    ($hidden:literal, $inter:literal, $layers:literal, $heads:literal, $kv:literal $(, $init:literal)*) => {
        concat!(
            "\n[model.init]\n",
            "vocab_size = 259\n",
            "hidden_size = ", $hidden, "\n",
            "intermediate_size = ", $inter, "\n",
            "num_hidden_layers = ", $layers, "\n",
            "num_attention_heads = ", $heads, "\n",
            "num_key_value_heads = ", $kv, "\n",
            $($init, "\n",)*
            "\n[data]\n",
            "source = \"builtin\"\n",
            "\n[rope]\n",
            "scheme = \"default\"\n",
            "theta = 10000.0\n",
            "\n[train]\n",
            "dtype = \"f32\"\n",
        )
    };
}

/// The tiny model most `harpe train` test recipes use: `model_recipe!` at 2 layers, 32 wide, 4 heads
/// over 2 kv heads: `concat!(tiny_model!(), "micro_batch_size = 4\n...")`.
macro_rules! tiny_model {
    () => {
        model_recipe!(32, 64, 2, 4, 2)
    };
}

/// SIGKILLs `child` at a moment drawn from `frac` of `full` (an uninterrupted run's time), unless it has
/// ended by then, and reaps it: (whether it was killed, the moment).
pub fn kill_at_random_moment(
    child: &mut std::process::Child,
    rng: &mut impl rand::Rng,
    frac: std::ops::Range<f64>,
    full: std::time::Duration,
) -> (bool, std::time::Duration) {
    let at = std::time::Duration::from_secs_f64(rng.random_range(frac) * full.as_secs_f64());
    std::thread::sleep(at);
    let killed = child.try_wait().unwrap().is_none();
    if killed {
        child.kill().unwrap();
    }
    let _ = child.wait();
    (killed, at)
}

/// The `harpe` binary of this build, as a command to add arguments, environment or stdio to.
pub fn harpe_cmd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_harpe"))
}

/// Runs `cmd` to the end: (success, stdout, stderr), the streams as (lossy) UTF-8 text.
pub fn output(cmd: &mut Command) -> (bool, String, String) {
    let o = cmd.output().expect("run harpe");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// `harpe ARGS`: (success, stdout, stderr).
pub fn harpe(args: &[&str]) -> (bool, String, String) {
    output(harpe_cmd().args(args))
}

/// `harpe ARGS`: success, and stdout followed by stderr as one text.
pub fn harpe_text(args: &[&str]) -> (bool, String) {
    let (ok, out, err) = harpe(args);
    (ok, out + &err)
}

/// `harpe train --config CFG --out OUT EXTRA`: success, and stdout followed by stderr as one text.
pub fn train_text(cfg: &std::path::Path, out: &std::path::Path, extra: &[&str]) -> (bool, String) {
    let (ok, o, e) = output(harpe_cmd().args(["train", "--config"]).arg(cfg).arg("--out").arg(out).args(extra));
    (ok, o + &e)
}

/// The loss of every line of a run's metrics.jsonl (a run without `[eval]`: every line is a step).
pub fn logged_losses(out: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect()
}

/// torchrun, for the tests that run harpe under PyTorch's launcher: `$HARPE_TORCHRUN`, then
/// target/torch-venv (where `.ci/run` installs it), then PATH. `None` after saying how to get it,
/// and a failure instead under CI (`HARPE_CI` or `CI` set), where a skipped launcher test would pass unseen.
pub fn torchrun() -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    let found = std::env::var_os("HARPE_TORCHRUN").map(PathBuf::from).or_else(|| {
        let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/torch-venv/bin/torchrun");
        venv.exists().then_some(venv).or_else(|| {
            let path = std::env::var_os("PATH")?;
            std::env::split_paths(&path).map(|d| d.join("torchrun")).find(|p| p.exists())
        })
    });
    if found.is_none() {
        let how = "install it with `scripts/install-torchrun.sh target/torch-venv` (or set HARPE_TORCHRUN)";
        let ci = std::env::var_os("HARPE_CI").is_some() || std::env::var_os("CI").is_some();
        assert!(!ci, "torchrun not found, and this is CI: {how}");
        eprintln!("torchrun not found: test not run; {how}");
    }
    found
}
