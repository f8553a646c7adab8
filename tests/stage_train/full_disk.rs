//! A full disk costs nothing, on a real size-limited tmpfs (tests/common/tmpfs.rs): a checkpoint save
//! that runs out of space leaves the previous checkpoint byte-identical, removes its partial directory
//! and stops with exit != 0 naming the path and the bytes it needed; after space is freed `--resume`
//! completes the run. metrics.jsonl and TensorBoard writes that fail say so once and training goes on.
use crate::tmpfs::Tmpfs;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn train(out: &Path, more: &[&str]) -> (bool, String) {
    let cfg = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny-cpu.toml");
    let logs = ["--set", "log.plot=false", "--set", "log.tensorboard=true"];
    crate::common::train_text(&cfg, out, &[more, &logs[..]].concat())
}

/// Every file under `dir` with its bytes.
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| (p.clone(), std::fs::read(&p).unwrap()))
        .collect()
}

#[test]
fn a_checkpoint_that_fills_the_disk_keeps_the_previous_one_and_resume_completes() {
    let Some(fs) = Tmpfs::mount(64 << 20, "full_disk::a_checkpoint_that_fills_the_disk") else { return };
    let out = fs.path().join("run");
    let (ok, text) = train(&out, &["--steps", "10"]);
    assert!(ok, "{text}");
    let s10 = out.join("checkpoints/step_000010");
    let before = files(&s10);
    // room for the next steps' log lines but not for a second checkpoint (~2 MiB)
    fs.resize(fs.used() + (1 << 20));
    let (ok, text) = train(&out, &["--steps", "20", "--resume"]);
    assert!(!ok, "{text}");
    assert!(text.contains("saving checkpoint") && text.contains("step_000020 failed"), "{text}");
    assert!(text.contains("step_000010 is intact") && text.contains("No space left on device"), "{text}");
    assert!(
        text.contains("a checkpoint of this run needs about") && text.contains("free on its file system"),
        "{text}"
    );
    assert_eq!(files(&s10), before, "the previous checkpoint changed");
    let left: Vec<String> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(left, ["step_000010"], "partial directories left");
    fs.resize(64 << 20);
    let (ok, text) = train(&out, &["--steps", "20", "--resume"]);
    assert!(ok && text.contains("resuming from") && text.contains("step_000010"), "{text}");
    let (ok, text) = crate::common::harpe_text(&["verify", out.join("checkpoints/step_000020").to_str().unwrap()]);
    assert!(ok, "{text}");
}

#[test]
fn a_full_disk_under_the_logs_is_reported_once_and_training_goes_on() {
    use harpe::train::metrics::{MetricsLog, StepRecord};
    use harpe::train::tensorboard::TbWriter;
    let Some(fs) = Tmpfs::mount(1 << 20, "full_disk::a_full_disk_under_the_logs") else { return };
    let path = fs.path().join("metrics.jsonl");
    let mut log = MetricsLog::open(&path, 0).unwrap();
    let rec: StepRecord = serde_json::from_value(serde_json::json!({
        "step": 1, "stage": 0, "seq_len": 64, "loss": 5.0, "grad_norm": 1.0, "lr": 1e-3, "tokens": 1024,
        "tokens_seen": 1024, "tokens_per_s": 1.0, "tflops": 0.0, "rss_bytes": 0, "step_peak_bytes": 0,
        "step_start_bytes": 0, "skipped": false, "elapsed_s": 1.0
    }))
    .unwrap();
    let mut tb = TbWriter::create(&fs.path().join("tb"), 0).unwrap();
    log.write(&rec).unwrap();
    // fill the file system
    let filler = fs.path().join("filler");
    let mut f = std::fs::File::create(&filler).unwrap();
    use std::io::Write;
    while f.write_all(&[0u8; 65536]).is_ok() {}
    for _ in 0..100 {
        log.write(&rec).unwrap();
        tb.scalars(1, &[("train/loss".into(), 5.0)]).unwrap();
    }
    assert!(log.failed());
    // the event file keeps whole records only: it reads back
    harpe::train::tensorboard::read_events(tb.path()).unwrap();
    // the lines that fitted (the file's last page had room for some), then nothing torn
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.ends_with('\n') && text.lines().count() < 101, "{}", text.lines().count());
    assert!(text.lines().all(|l| serde_json::from_str::<StepRecord>(l).is_ok()), "a torn line is left");
    drop(f);
    std::fs::remove_file(&filler).unwrap();
}
