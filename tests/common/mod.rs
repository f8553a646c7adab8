//! The shared helpers of the integration tests, one of each. Every test binary includes this directory
//! (`#[macro_use] #[path = "../common/mod.rs"] mod common;` in its main.rs):
//! - this file: the tiny recipe (`tiny_model!`) and the CLI wrapper (`harpe`, `harpe_cmd`, `output`);
//! - `ops`: the op harness: deterministic inputs (`randv`, `randn`), the max-difference helpers
//!   (`max_abs_diff`, `max_abs`, `rel_err`) and the one finite-difference checker (`fd_check`, `Fd`);
//! - `data`: the data tests' WordLevel tokenizer and synthetic corpora;
//! - `torchrun()`: PyTorch's launcher for the tests that run harpe under it.
#![allow(dead_code, unused_macros)]
pub mod data;
pub mod ops;
pub mod slurm;

use std::process::Command;

/// The tiny model every `harpe train` test recipe starts with: a 2-layer, 32-wide byte-level Llama
/// on the built-in data, plain RoPE, f32, ending inside `[train]` so a recipe goes on with its own
/// `[train]` keys: `concat!(tiny_model!(), "micro_batch_size = 4\n...")`.
macro_rules! tiny_model {
    () => {
        r#"
[model.init]
vocab_size = 259
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2

[data]
source = "builtin"

[rope]
scheme = "default"
theta = 10000.0

[train]
dtype = "f32"
"#
    };
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
