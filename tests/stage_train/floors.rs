//! `harpe train` on a GPU machine whose driver or glibc is older than the build needs: one line naming both
//! versions and the fix, before any weight is read. The versions are faked by test hooks (testing.rs), so
//! the CPU build rehearses the check at the place a CUDA run makes it.
use crate::common::harpe_cmd;
use harpe::model::rope::RopeScheme;
use std::path::Path;

/// configs/tiny-cpu.toml on a model directory whose weights file is garbage: a run that read a weight
/// would fail on it instead.
fn config_with_unreadable_weights(dir: &Path) -> std::path::PathBuf {
    let m = dir.join("model");
    harpe::model::testing::tiny_model_dir(&m, RopeScheme::Default { theta: 10000.0 }, 0).unwrap();
    std::fs::write(m.join("model.safetensors"), b"not a safetensors file").unwrap();
    let tiny = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny-cpu.toml")).unwrap();
    let (head, rest) = tiny.split_once("\n[model.init]\n").unwrap();
    let (_, rest) = rest.split_once("\n\n").unwrap();
    let cfg = dir.join("run.toml");
    std::fs::write(&cfg, format!("{head}\n[model]\npath = \"{}\"\n\n{rest}", m.display())).unwrap();
    cfg
}

fn train_with(dir: &Path, hooks: &[(&str, &str)]) -> (Option<i32>, String) {
    let cfg = config_with_unreadable_weights(dir);
    let mut c = harpe_cmd();
    c.arg("train").arg("--config").arg(&cfg).args(["--set", "train.device=\"cuda\""]).arg("--out").arg(dir.join("run"));
    for (k, v) in hooks {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    (o.status.code(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn an_old_driver_or_glibc_stops_train_in_one_line_before_a_weight_is_read() {
    let d = tempfile::tempdir().unwrap();
    let (code, err) = train_with(d.path(), &[("HARPE_TEST_CUDA_DRIVER", "12020"), ("HARPE_TEST_CUDA_BUILD", "13000")]);
    assert_eq!(code, Some(1), "{err}");
    let line = err.lines().find(|l| l.contains("CUDA driver")).unwrap_or_else(|| panic!("no driver line:\n{err}"));
    assert!(line.contains("CUDA 12.2") && line.contains("CUDA 13.0") && line.contains("hint:"), "{line}");
    assert!(line.contains("train.device"), "the line names the config field: {line}");
    assert!(
        !err.contains("safetensors") && !d.path().join("run").exists(),
        "a weight or the run dir came first:\n{err}"
    );

    let (code, err) = train_with(
        d.path(),
        &[("HARPE_TEST_CUDA_DRIVER", "13000"), ("HARPE_TEST_CUDA_BUILD", "13000"), ("HARPE_TEST_GLIBC", "2.28")],
    );
    assert_eq!(code, Some(1), "{err}");
    let line = err.lines().find(|l| l.contains("glibc")).unwrap_or_else(|| panic!("no glibc line:\n{err}"));
    assert!(line.contains("glibc is 2.28") && line.contains("2.34") && line.contains("hint:"), "{line}");
    assert!(!err.contains("safetensors"), "{err}");

    // versions that pass: the run goes on to the device, which a CPU build refuses with its rebuild hint
    let (code, err) = train_with(d.path(), &[("HARPE_TEST_CUDA_DRIVER", "13000"), ("HARPE_TEST_CUDA_BUILD", "12040")]);
    assert_eq!(code, Some(1), "{err}");
    assert!(!err.contains("CUDA driver") && err.contains("built without CUDA"), "{err}");
}
