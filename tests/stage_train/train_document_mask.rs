//! `train.document_mask = true` through the `harpe` binary on built-in data (several documents packed per
//! 64-token sequence): the run trains with activation checkpointing (every layer recomputed) and its losses
//! differ from the unmasked run's; 2 ranks under ZeRO-3 (layers gathered for forward and recompute) and
//! Ulysses SP 2 (each rank holds half of every sequence; the mask must be the whole sequence's) give the
//! one-rank masked losses; the resolved config records the key; a bad value names the key.
use crate::common::ops::max_abs_diff;
use crate::common::{logged_losses, train_text};
use std::path::{Path, PathBuf};

const TINY: &str = concat!(
    tiny_model!(),
    r#"micro_batch_size = 2
global_batch_tokens = 512
loss_chunk_tokens = 100
activation_checkpointing = "every-layer"

[optim]
lr = 3e-3

[checkpoint]
every = 0

[log]
progress = false
plot = false

[[stage]]
seq_len = 64
steps = 4
"#
);

fn train(cfg: &Path, out: &Path, extra: &[&str]) -> Vec<f64> {
    let (ok, log) = train_text(cfg, out, extra);
    assert!(ok, "harpe train {extra:?} failed:\n{log}");
    logged_losses(out)
}

fn setup() -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("run.toml");
    std::fs::write(&cfg, TINY).unwrap();
    (d, cfg)
}

fn assert_close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: step counts");
    for (s, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "{what}: step {s} loss {y} vs one rank's {x}");
    }
}

#[test]
fn document_mask_trains_and_equals_one_rank_under_zero3_and_ulysses() {
    let (d, cfg) = setup();
    let on = ["--set", "train.document_mask=true"];
    let masked = train(&cfg, &d.path().join("mask"), &on);
    assert_eq!(masked.len(), 4);
    assert!(masked.iter().all(|l| l.is_finite()), "{masked:?}");
    assert!(masked[3] < masked[0], "the masked run does not train: {masked:?}");
    let saved = std::fs::read_to_string(d.path().join("mask").join("config.toml")).unwrap();
    assert!(saved.contains("document_mask = true"), "{saved}");
    let plain = train(&cfg, &d.path().join("plain"), &[]);
    let saved = std::fs::read_to_string(d.path().join("plain").join("config.toml")).unwrap();
    assert!(!saved.contains("document_mask"), "the default is left out of the resolved config:\n{saved}");
    // the same batches: the mask is what differs (built-in sequences pack several documents; at the random
    // init attention barely moves the loss, so the trained steps show it)
    let diff = max_abs_diff(&plain, &masked);
    assert!(diff > 1e-4, "the mask changed nothing: {plain:?} vs {masked:?}");

    for (name, sets) in [
        ("2 ranks ZeRO-3", ["dist.world_size=2", "dist.sp_degree=1", "dist.zero_stage=3"]),
        ("Ulysses SP 2", ["dist.world_size=2", "dist.sp_degree=2", "dist.zero_stage=1"]),
    ] {
        let mut a = on.to_vec();
        a.extend(["--set", "dist.backend=local"]);
        for s in &sets {
            a.extend(["--set", s]);
        }
        let got = train(&cfg, &d.path().join(name.replace(' ', "-")), &a);
        assert_close(&masked, &got, name);
    }
}

#[test]
fn a_bad_document_mask_value_names_the_key() {
    let (d, cfg) = setup();
    let (ok, log) = train_text(&cfg, &d.path().join("r"), &["--set", "train.document_mask=3"]);
    assert!(!ok);
    assert!(log.contains("document_mask"), "{log}");
}
