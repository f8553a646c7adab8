//! `--attention harpe|candle-flash|flash2` as a user meets it: every evaluation command (eval-ppl, eval-loss,
//! eval-niah, eval-tasks, generate) takes the flag; where candle-flash-attn or FlashAttention-2's own kernels
//! cannot run (a build without `--features flash-attn`, or a CPU device) asking for them is an error that says
//! why, with a hint, and the default falls back to harpe's attention; `--attention harpe` is what the CPU
//! default computes; `harpe train` refuses candle-flash before reading anything (the crate has no backward),
//! takes flash2 and harpe, and `[train] attention = "auto"` trains on harpe's attention on a CPU.
//! The GPU side (both forwards, and FA2's backward, against harpe's) is `harpe selftest` on CUDA.
use crate::common::harpe;
use harpe::config::TrainAttention;
use harpe::model::attention::{refuse_for_training, AttentionChoice, AttentionImpl};
use std::path::{Path, PathBuf};

fn golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// What a CPU run says when asked for candle-flash: the build lacks the feature, or the device is no GPU.
fn refusal_of_this_build() -> &'static str {
    if cfg!(feature = "flash-attn") {
        "runs on CUDA only"
    } else {
        "built without --features flash-attn"
    }
}

#[test]
fn every_evaluation_command_takes_the_flag() {
    for cmd in ["eval-ppl", "eval-loss", "eval-niah", "eval-tasks", "generate"] {
        let (ok, out, err) = harpe(&[cmd, "--help"]);
        assert!(ok, "{cmd}: {err}");
        assert!(out.contains("--attention <ATTENTION>") && out.contains("candle-flash"), "{cmd} --help:\n{out}");
    }
    let (ok, _, err) = harpe(&["generate", "--model", "m", "--prompt-ids", "1", "--attention", "flash"]);
    assert!(!ok);
    assert!(err.contains("possible values: harpe, candle-flash, flash2"), "{err}");
}

#[test]
fn candle_flash_where_it_cannot_run_is_an_error_with_a_hint() {
    let model = golden().join("default/model");
    let text = golden().join("text.txt");
    let (ok, _, err) = harpe(&["eval-ppl", "--model", s(&model), "--input", s(&text), "--attention", "candle-flash"]);
    assert!(!ok);
    assert!(err.contains("--attention candle-flash") && err.contains(refusal_of_this_build()), "{err}");
    assert!(err.contains("hint:") && err.contains("--attention harpe"), "{err}");
    let (ok, _, err) = harpe(&["generate", "--model", s(&model), "--prompt-ids", "1,2", "--attention", "candle-flash"]);
    assert!(!ok);
    assert!(err.contains(refusal_of_this_build()) && err.contains("hint:"), "{err}");
    // eval-niah (its own flags): refused when the model is loaded, before any prompt runs
    let out = tempfile::tempdir().unwrap();
    let (ok, _, err) = harpe(&[
        "eval-niah",
        "--model",
        s(&model),
        "--tasks",
        "passkey",
        "--lengths",
        "64",
        "--samples",
        "1",
        "--force",
        "--out",
        s(out.path()),
        "--attention",
        "candle-flash",
    ]);
    assert!(!ok);
    assert!(err.contains(refusal_of_this_build()) && err.contains("hint:"), "{err}");
}

#[test]
fn harpe_attention_scores_what_the_default_scores_on_cpu() {
    let model = golden().join("default/model");
    let text = golden().join("text.txt");
    let run = |extra: &[&str]| {
        let mut a = vec!["eval-ppl", "--model", s(&model), "--input", s(&text), "--window", "12", "--stride", "5"];
        a.extend_from_slice(extra);
        a.push("--json");
        let (ok, out, err) = harpe(&a);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        v["nll"].as_f64().unwrap()
    };
    assert_eq!(run(&["--attention", "harpe"]), run(&[]));
}

#[test]
fn train_refuses_candle_flash_before_reading_the_config() {
    let (ok, _, err) = harpe(&["train", "--config", "no/such/run.toml", "--attention", "candle-flash"]);
    assert!(!ok);
    assert!(err.contains("no backward") && err.contains("hint: train with --attention flash2"), "{err}");
    assert!(!err.contains("no/such/run.toml"), "refused before the config is read: {err}");
    // --attention harpe and flash2 parse and go on to the config
    for a in ["harpe", "flash2"] {
        let (ok, _, err) = harpe(&["train", "--config", "no/such/run.toml", "--attention", a]);
        assert!(!ok);
        assert!(err.contains("no/such/run.toml") && !err.contains("no backward"), "{a}: {err}");
    }
    assert!(refuse_for_training(Some(AttentionChoice::Harpe)).is_ok());
    assert!(refuse_for_training(Some(AttentionChoice::Flash2)).is_ok());
    assert!(refuse_for_training(None).is_ok());
}

/// What a CPU run says when asked for flash2.
fn flash2_refusal_of_this_build() -> &'static str {
    if cfg!(feature = "flash-attn") {
        "--attention flash2 runs on CUDA only"
    } else {
        "--attention flash2: this harpe was built without --features flash-attn"
    }
}

#[test]
fn for_train_on_a_cpu_device() {
    let cpu = candle_core::Device::Cpu;
    for dtype in [candle_core::DType::F32, candle_core::DType::BF16] {
        // auto and harpe: the device's attention
        for want in [TrainAttention::Auto, TrainAttention::Harpe] {
            let imp = AttentionImpl::for_train(want, &cpu, dtype, 64).unwrap();
            assert!(matches!(imp, AttentionImpl::Cpu), "{want:?}: {imp:?}");
        }
        // flash2 asked for where it cannot run: an error naming why
        let e = AttentionImpl::for_train(TrainAttention::Flash2, &cpu, dtype, 64).unwrap_err().to_string();
        assert!(e.contains(flash2_refusal_of_this_build()) && e.contains("hint:"), "{e}");
        let e = AttentionImpl::for_eval(Some(AttentionChoice::Flash2), &cpu, dtype, 64).unwrap_err().to_string();
        assert!(e.contains(flash2_refusal_of_this_build()) && e.contains("hint:"), "{e}");
    }
}

#[test]
fn for_eval_on_a_cpu_device() {
    let cpu = candle_core::Device::Cpu;
    for dtype in [candle_core::DType::F32, candle_core::DType::BF16] {
        // the default falls back to the device's attention wherever candle-flash cannot run
        let imp = AttentionImpl::for_eval(None, &cpu, dtype, 64).unwrap();
        assert!(matches!(imp, AttentionImpl::Cpu), "{imp:?}");
        let imp = AttentionImpl::for_eval(Some(AttentionChoice::Harpe), &cpu, dtype, 64).unwrap();
        assert!(matches!(imp, AttentionImpl::Cpu), "{imp:?}");
        let e = AttentionImpl::for_eval(Some(AttentionChoice::CandleFlash), &cpu, dtype, 64).unwrap_err().to_string();
        assert!(e.contains(refusal_of_this_build()) && e.contains("hint:"), "{e}");
    }
}
