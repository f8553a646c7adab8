//! `harpe train` end to end on tiny models and built-in data: loss falls, 2N steps == N + resume + N
//! (weights, optimizer state and logged losses), bad input is refused clearly, NaN guard, SIGTERM.
use crate::common::harpe_cmd;
use crate::common::ops::max_abs_diff;
use harpe::train::metrics::read_records;
use harpe::train::{run, TrainArgs};
use std::path::{Path, PathBuf};

const TINY: &str = concat!(
    tiny_model!(),
    r#"micro_batch_size = 4
global_batch_tokens = 256
loss_chunk_tokens = 100

[optim]
lr = 3e-3
weight_decay = 0.1

[schedule]
kind = "cosine"
warmup_steps = 3
min_lr_ratio = 0.1

[checkpoint]
every = 2
keep_last = 10

[log]
progress = false
plot = true

[[stage]]
seq_len = 32
steps = 4

[[stage]]
seq_len = 64
steps = 3
rope = { scheme = "harpe", head_bases = [10000.0, 200000.0] }
"#
);

fn args(cfg: &Path, out: &Path) -> TrainArgs {
    TrainArgs::new(cfg, Some(out))
}

fn write_cfg(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("run.toml");
    std::fs::write(&p, text).unwrap();
    p
}

fn ckpt(out: &Path, step: u64) -> PathBuf {
    out.join("checkpoints").join(format!("step_{step:06}"))
}

#[test]
fn resume_is_bit_identical_across_a_stage_boundary() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path(), TINY);
    let (a, b) = (d.path().join("a"), d.path().join("b"));
    run(args(&cfg, &a)).unwrap();
    // N = 2 steps (mid stage 0), then resume to the end (crossing into the HARPE stage)
    run(TrainArgs { steps: Some(2), ..args(&cfg, &b) }).unwrap();
    assert!(ckpt(&b, 2).join("DONE").exists());
    assert!(!ckpt(&b, 3).exists());
    run(TrainArgs { resume: true, ..args(&cfg, &b) }).unwrap();
    for f in ["model.safetensors", "optim-00000-of-00001.safetensors", "config.json"] {
        let (x, y) = (std::fs::read(ckpt(&a, 7).join(f)).unwrap(), std::fs::read(ckpt(&b, 7).join(f)).unwrap());
        assert!(x == y, "{f} differs between the straight and the resumed run");
    }
    let key = |p: &Path| -> Vec<(u64, u64, u64, u64, usize)> {
        read_records(&p.join("metrics.jsonl"))
            .unwrap()
            .iter()
            .map(|r| (r.step, r.loss.to_bits(), r.grad_norm.to_bits(), r.tokens_seen, r.per_source.len()))
            .collect()
    };
    let (ka, kb) = (key(&a), key(&b));
    assert_eq!(ka.len(), 7);
    assert_eq!(ka, kb);
    assert_eq!(ka[0].4, 2, "per-source losses for the two built-in sources");
    // TensorBoard: every step's loss once, also across the resume (its START marker purges replays)
    for dir in [&a, &b] {
        let tb = harpe::train::tensorboard::read_scalars(&dir.join("tb")).unwrap();
        let losses: Vec<(i64, f32)> =
            tb.iter().filter(|(_, t, _)| t == "train/loss").map(|(s, _, v)| (*s, *v)).collect();
        let want: Vec<(i64, f32)> =
            read_records(&dir.join("metrics.jsonl")).unwrap().iter().map(|r| (r.step as i64, r.loss as f32)).collect();
        assert_eq!(losses, want, "{}", dir.display());
        for tag in ["train/lr", "train/grad_norm", "train/tokens_per_s", "memory/rss_bytes", "train/loss_by_source/"] {
            assert!(tb.iter().any(|(_, t, _)| t.starts_with(tag)), "no {tag} in {}", dir.display());
        }
    }
    assert_eq!(std::fs::read_dir(b.join("tb")).unwrap().count(), 2, "one event file per session");
    // the checkpoint is a self-describing HF model dir: HARPE bases in config.json, tokenizer beside it
    let cj = std::fs::read_to_string(ckpt(&a, 7).join("config.json")).unwrap();
    assert!(cj.contains("harpe") && cj.contains("200000"), "{cj}");
    assert!(ckpt(&a, 7).join("tokenizer.json").exists());
    assert!(a.join("loss.png").exists());
    let st = harpe::train::checkpoint::load_state(&ckpt(&a, 4)).unwrap();
    assert_eq!((st.step, st.stage, st.stage_step), (4, 1, 0), "stage-end checkpoint points at the next stage");
    // a finished run does not silently restart: without --resume the directory is refused
    let e = format!("{:#}", run(args(&cfg, &a)).unwrap_err());
    assert!(e.contains("--resume") && e.contains("hint:"), "{e}");
}

#[test]
fn loss_falls_on_builtin_text() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path(), &TINY.replace("steps = 4", "steps = 40").replace("every = 2", "every = 0"));
    let out = d.path().join("r");
    run(TrainArgs { set: vec!["stage.1.steps=1".into()], ..args(&cfg, &out) }).unwrap();
    let r = read_records(&out.join("metrics.jsonl")).unwrap();
    let first = r[0].loss;
    let last: f64 = r[35..40].iter().map(|r| r.loss).sum::<f64>() / 5.0;
    assert!((first - (259f64).ln()).abs() < 0.3, "initial loss {first} should be near ln(259)");
    assert!(last < 0.75 * first, "loss did not fall enough: {first} -> {last}");
}

#[test]
fn bad_input_is_refused_with_a_hint() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path(), TINY);
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    // the error of a run on a dataset of the built-in texts prepared at `seq_len` with tokenizer `tok_json`
    let on_dataset = |name: &str, tok_json: &str, seq_len: usize| {
        let (tok, ds) = (d.path().join(format!("{name}.json")), d.path().join(name));
        std::fs::write(&tok, tok_json).unwrap();
        let texts = harpe::data::builtin_texts(1);
        harpe::data::prepare_from_texts(&texts, &tok, &harpe::data::PrepareOptions::new(seq_len), &ds).unwrap();
        let data = set(&["data.source=\"prepared\"", &format!("data.path=\"{}\"", ds.display())]);
        format!("{:#}", run(TrainArgs { set: data, ..args(&cfg, &d.path().join(format!("{name}-run"))) }).unwrap_err())
    };
    let bytes = harpe::model::testing::byte_tokenizer_json();
    // a dataset whose sequence length does not match the stage
    let e = on_dataset("ds48", &bytes, 48);
    assert!(e.contains("seq_len") && e.contains("hint:"), "{e}");
    // a dataset made with another tokenizer
    let e = on_dataset("ds32", &bytes.replace("\"dropout\":null", "\"dropout\": null"), 32);
    assert!(e.contains("another tokenizer") && e.contains("hint:"), "{e}");
    // an output directory that cannot be created (its parent is a file)
    let file = d.path().join("plainfile");
    std::fs::write(&file, "x").unwrap();
    let e = format!("{:#}", run(args(&cfg, &file.join("run"))).unwrap_err());
    // (the run-directory lock, taken first, is what reports it)
    assert!(e.contains("cannot create") && e.contains("plainfile") && e.contains("hint:"), "{e}");
    // a run directory of another config
    let o3 = d.path().join("o3");
    run(TrainArgs { steps: Some(1), ..args(&cfg, &o3) }).unwrap();
    let e =
        format!("{:#}", run(TrainArgs { resume: true, set: set(&["optim.lr=1e-4"]), ..args(&cfg, &o3) }).unwrap_err());
    assert!(e.contains("different config") && e.contains("--force"), "{e}");
    // a wrong type from --set names the key
    let e = format!(
        "{:#}",
        run(TrainArgs { set: set(&["checkpoint.every=\"often\""]), ..args(&cfg, &d.path().join("o4")) }).unwrap_err()
    );
    assert!(e.contains("every") && e.contains("hint:"), "{e}");
    // data whose token ids exceed the model's vocabulary (the byte tokenizer has 259 ids, the model 100):
    // refused when the batch is built, naming the row, position and id, not as an index error of an op
    let v100 = d.path().join("v100");
    std::fs::create_dir_all(&v100).unwrap();
    let small = write_cfg(&v100, &TINY.replace("vocab_size = 259", "vocab_size = 100"));
    let e = format!("{:#}", run(args(&small, &d.path().join("o5"))).unwrap_err());
    assert!(e.contains("batch row 0, position ") && e.contains("outside the model's vocabulary of 100"), "{e}");
    assert!(e.contains("hint:") && e.contains("prepare-data"), "{e}");
}

#[test]
fn non_finite_steps_are_skipped_then_the_run_stops() {
    let d = tempfile::tempdir().unwrap();
    // a model directory with one NaN weight: every step's loss is NaN
    let mdir = d.path().join("model");
    let cfg = harpe::model::testing::tiny_config(harpe::model::rope::RopeScheme::Default { theta: 10000.0 });
    let mut t =
        harpe::model::weights::init_random(&cfg, 1, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let (name, w) = t.iter().find(|(n, _)| n == "model.norm.weight").cloned().unwrap();
    let mut v = w.to_vec1::<f32>().unwrap();
    v[3] = f32::NAN;
    for e in t.iter_mut().filter(|(n, _)| *n == name) {
        e.1 = candle_core::Tensor::from_vec(v.clone(), v.len(), &candle_core::Device::Cpu).unwrap();
    }
    harpe::model::weights::save_model_dir(&mdir, &cfg, &t, 1 << 30).unwrap();
    std::fs::write(mdir.join("tokenizer.json"), harpe::model::testing::byte_tokenizer_json()).unwrap();
    let text = TINY.replace("[model.init]\nvocab_size = 259\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 2\n", &format!("[model]\npath = \"{}\"\n", mdir.display()));
    let cfgp = write_cfg(d.path(), &format!("{text}\n").replace("[train]\n", "[train]\nmax_bad_steps = 3\n"));
    let out = d.path().join("r");
    let e = format!("{:#}", run(args(&cfgp, &out)).unwrap_err());
    assert!(
        e.contains("3 consecutive steps") && e.contains("Last good checkpoint: none") && e.contains("hint:"),
        "{e}"
    );
    let r = read_records(&out.join("metrics.jsonl")).unwrap();
    assert_eq!(r.len(), 3);
    assert!(r.iter().all(|r| r.skipped));
    assert!(
        harpe::train::checkpoint::latest_complete(&out.join("checkpoints")).unwrap().is_none(),
        "no checkpoint of bad weights"
    );
}

#[test]
fn sigterm_finishes_the_step_checkpoints_and_exits_0() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path(), &TINY.replace("steps = 4", "steps = 100000").replace("every = 2", "every = 0"));
    let out = d.path().join("r");
    let mut child = harpe_cmd()
        .args(["train", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let metrics = out.join("metrics.jsonl");
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map(|s| s.lines().count()).unwrap_or(0) < 2 {
        assert!(t0.elapsed().as_secs() < 120, "training did not start");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let st = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(st.success());
    let status = child.wait().unwrap();
    assert!(status.success(), "exit status {status:?}");
    let last = harpe::train::checkpoint::latest_complete(&out.join("checkpoints")).unwrap().expect("a checkpoint");
    let steps = read_records(&metrics).unwrap().len() as u64;
    assert_eq!(harpe::train::checkpoint::load_state(&last).unwrap().step, steps);
}

#[test]
fn a_backend_this_build_lacks_is_refused_with_a_hint() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path(), TINY);
    // nccl is not in this build; local without a world size has no ranks to start
    for (b, want) in [("nccl", "built without NCCL"), ("local", "dist.world_size is not set")] {
        let out = d.path().join(b);
        let set = vec![format!("dist.backend=\"{b}\"")];
        let e = format!("{:#}", run(TrainArgs { set, ..args(&cfg, &out) }).unwrap_err());
        assert!(e.contains("dist.backend") && e.contains(b) && e.contains(want) && e.contains("hint:"), "{e}");
        assert!(!out.exists(), "{b}: refused before the run directory is made");
    }
}

/// The GPU path's training state (`FlatBuf::Device`, here on a CPU tensor through the hidden
/// `--device-resident-state` knob) trains like the host state: the same losses (1e-6 relative) and
/// weights over both stages, single rank and ZeRO-3 over two thread ranks; and a host checkpoint
/// resumes into device state.
#[test]
fn device_resident_state_trains_like_host_state() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path(), TINY);
    let losses =
        |p: &Path| -> Vec<f64> { read_records(&p.join("metrics.jsonl")).unwrap().iter().map(|r| r.loss).collect() };
    let weights = |p: &Path| {
        let t = harpe::model::weights::load_tensors(&ckpt(p, 7), candle_core::DType::F32, &candle_core::Device::Cpu);
        let mut t: Vec<(String, Vec<f32>)> =
            t.unwrap().into_iter().map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect();
        t.sort_by(|a, b| a.0.cmp(&b.0));
        t
    };
    let zero3 = vec!["dist.backend=\"local\"".to_string(), "dist.world_size=2".into(), "dist.zero_stage=3".into()];
    for set in [vec![], zero3] {
        let (h, dv) = (d.path().join(format!("h{}", set.len())), d.path().join(format!("d{}", set.len())));
        run(TrainArgs { set: set.clone(), ..args(&cfg, &h) }).unwrap();
        run(TrainArgs { set: set.clone(), device_resident_state: true, ..args(&cfg, &dv) }).unwrap();
        let (lh, ld) = (losses(&h), losses(&dv));
        assert_eq!(lh.len(), 7);
        for (k, (a, b)) in lh.iter().zip(&ld).enumerate() {
            assert!((a - b).abs() <= 1e-6 * a.abs(), "{set:?} step {k}: host loss {a} vs device-state loss {b}");
        }
        for ((n, a), (_, b)) in weights(&h).iter().zip(&weights(&dv)) {
            let worst = max_abs_diff(a, b);
            assert!(worst < 1e-5, "{set:?} {n}: weights differ by {worst}");
        }
    }
    // host checkpoint at step 2 -> device state to the end == the straight host run
    let m = d.path().join("mixed");
    run(TrainArgs { steps: Some(2), ..args(&cfg, &m) }).unwrap();
    run(TrainArgs { resume: true, device_resident_state: true, ..args(&cfg, &m) }).unwrap();
    let (lh, lm) = (losses(&d.path().join("h0")), losses(&m));
    assert_eq!(lm.len(), 7);
    assert!(lh.iter().zip(&lm).all(|(a, b)| (a - b).abs() <= 1e-6 * a.abs()), "{lh:?} vs {lm:?}");
}
