//! `[eval]` during training: a run with `[eval]` trains bit-identically to one without;
//! the eval lines of metrics.jsonl have the documented keys and the values the eval commands compute on
//! the saved checkpoint (an independent path: weights read back from disk); a resumed run neither loses
//! nor repeats evaluations, also when it resumes from before an evaluation that was already logged.
use super::train_dist::eval_lines;
use harpe::eval::eval_loss::{self, EvalLossArgs};
use harpe::eval::ppl::{self, Aggregate, EvalPplArgs, ScoringModel};
use harpe::train::metrics::{read_evals, read_records, EvalRecord};
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

[checkpoint]
every = 2
keep_last = 10

[log]
progress = false

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

fn ckpt(out: &Path, step: u64) -> PathBuf {
    out.join("checkpoints").join(format!("step_{step:06}"))
}

fn keys(v: &serde_json::Value) -> Vec<String> {
    v.as_object().unwrap().keys().cloned().collect()
}

#[test]
fn eval_during_training_is_in_place_bit_neutral_and_resumable() {
    let d = tempfile::tempdir().unwrap();
    let tok = d.path().join("tokenizer.json");
    std::fs::write(&tok, harpe::model::testing::byte_tokenizer_json()).unwrap();
    let loss_ds = d.path().join("val64");
    harpe::data::prepare_from_texts(
        &harpe::data::builtin_texts(7),
        &tok,
        &harpe::data::PrepareOptions::new(64),
        &loss_ds,
    )
    .unwrap();
    let text = d.path().join("doc.txt");
    std::fs::write(
        &text,
        "Once upon a time a small fox counted the stars: 12 + 30 = 42, and 7 * 6 = 42 too. ".repeat(4),
    )
    .unwrap();
    let eval = format!(
        "\n[eval]\nevery = 2\nppl_inputs = [{:?}]\nppl_max_tokens = 100\npasskey_lengths = [300]\npasskey_samples = 2\n\
         loss_data = {:?}\nloss_buckets = [16, 48]\nloss_max_sequences = 4\n",
        text.display().to_string(),
        loss_ds.display().to_string()
    );
    let (plain, with) = (d.path().join("plain.toml"), d.path().join("eval.toml"));
    std::fs::write(&plain, TINY).unwrap();
    std::fs::write(&with, format!("{TINY}{eval}")).unwrap();
    let (a, b, c) = (d.path().join("a"), d.path().join("b"), d.path().join("c"));
    run(args(&plain, &a)).unwrap();
    run(args(&with, &b)).unwrap();

    // 1. Training is untouched: same weights, optimizer state and step lines with and without [eval].
    for f in ["model.safetensors", "optim-00000-of-00001.safetensors"] {
        let (x, y) = (std::fs::read(ckpt(&a, 7).join(f)).unwrap(), std::fs::read(ckpt(&b, 7).join(f)).unwrap());
        assert!(x == y, "{f} differs between the runs with and without [eval]");
    }
    let bits = |p: &Path| -> Vec<(u64, u64)> {
        read_records(&p.join("metrics.jsonl")).unwrap().iter().map(|r| (r.step, r.loss.to_bits())).collect()
    };
    assert_eq!(bits(&a), bits(&b));
    assert_eq!(bits(&b).len(), 7, "eval lines are not step records");
    assert!(eval_lines(&a).is_empty());

    // 2. The eval lines: every 2 steps, once at the stage end (4) and at the end (7), documented keys.
    let lines = eval_lines(&b);
    let at: Vec<(u64, u64)> =
        lines.iter().map(|v| (v["step"].as_u64().unwrap(), v["stage"].as_u64().unwrap())).collect();
    assert_eq!(at, vec![(2, 0), (4, 0), (6, 1), (7, 1)]);
    for v in &lines {
        assert_eq!(keys(v), ["eval", "stage", "step"]);
        assert_eq!(keys(&v["eval"]), ["loss_by_bucket", "passkey", "ppl"]);
        assert_eq!(keys(&v["eval"]["ppl"]), ["nll", "ppl", "tokens"]);
        assert_eq!(keys(&v["eval"]["passkey"]), ["300"]);
        // 100 tokens (BOS + 99 bytes) score 99 targets whatever the window
        assert_eq!(v["eval"]["ppl"]["tokens"].as_u64(), Some(99));
    }
    assert!(b.join("eval.png").exists() && b.join("loss.png").exists());
    // every evaluation metric is in TensorBoard too, at its step
    let tb = harpe::train::tensorboard::read_scalars(&b.join("tb")).unwrap();
    for (tag, step) in [("eval/ppl", 2), ("eval/nll", 7), ("eval/passkey/300", 4), ("eval/loss_by_bucket/", 6)] {
        assert!(tb.iter().any(|(s, t, _)| t.starts_with(tag) && *s == step), "no {tag} at step {step}");
    }
    let ppl7 = tb.iter().find(|(s, t, _)| t == "eval/ppl" && *s == 7).map(|x| x.2);
    assert_eq!(ppl7, lines[3]["eval"]["ppl"]["ppl"].as_f64().map(|x| x as f32));

    // 3. The values are the eval commands' on the saved checkpoint (weights read back from disk).
    let evs = read_evals(&b.join("metrics.jsonl")).unwrap();
    let last = &evs[3];
    let model_dir = ckpt(&b, 7);
    let pa = EvalPplArgs {
        scoring: ScoringModel::new(&model_dir),
        input: vec![text.clone()],
        window: 64, // stage 1's seq_len and half of it: the defaults
        stride: 32,
        max_tokens: Some(100),
        aggregate: Aggregate::Token,
        json: false,
        tokenizer: None,
    };
    let (_, tot) = ppl::evaluate(&pa).unwrap();
    let p = last.eval.ppl.as_ref().unwrap();
    assert!((p.nll - tot.nll).abs() < 1e-9 * tot.nll.abs().max(1.0), "{} vs eval-ppl {}", p.nll, tot.nll);
    assert_eq!(p.ppl.to_bits(), p.nll.exp().to_bits());
    let la = EvalLossArgs {
        scoring: ScoringModel::new(&model_dir),
        data: loss_ds.clone(),
        buckets: vec![16, 48],
        max_sequences: Some(4),
        allow_tokenizer_mismatch: false,
        json: false,
    };
    let rep = eval_loss::evaluate(&la).unwrap();
    assert_eq!(last.eval.loss_by_bucket.keys().collect::<Vec<_>>(), ["0-16", "16-48", "48+"]);
    for (k, cell) in &rep.by_bucket {
        let got = last.eval.loss_by_bucket[k];
        assert!((got - cell.loss).abs() < 1e-9, "bucket {k}: {got} vs eval-loss {}", cell.loss);
    }
    let model = ScoringModel::new(&model_dir).load().unwrap();
    let t = harpe::data::tokenize::load_tokenizer(&model_dir).unwrap();
    let recs = harpe::eval::passkey::make_samples(&t, 300, 2, 2, 42).unwrap();
    let scores: Vec<f64> = recs
        .iter()
        .map(|r| {
            let pred =
                harpe::eval::generate::predict_text(&model, &t, &r.prompt(), 10, 2048, Default::default()).unwrap();
            harpe::eval::passkey::passkey_score(&pred, &r.outputs[0])
        })
        .collect();
    assert_eq!(last.eval.passkey["300"], harpe::eval::niah::task_score(&scores));

    // 4. Resume: 4 steps (evals 2, 4), then resume from step 2's checkpoint (step 4's is gone, its eval
    //    line is dropped and redone) to the end: each evaluation once, equal to the straight run's.
    run(TrainArgs { steps: Some(4), ..args(&with, &c) }).unwrap();
    assert_eq!(read_evals(&c.join("metrics.jsonl")).unwrap().len(), 2);
    std::fs::remove_dir_all(ckpt(&c, 4)).unwrap();
    run(TrainArgs { resume: true, ..args(&with, &c) }).unwrap();
    let evc: Vec<EvalRecord> = read_evals(&c.join("metrics.jsonl")).unwrap();
    assert_eq!(evc, evs);
    // and a run resumed at its end evaluates nothing again
    assert!(run(TrainArgs { resume: true, ..args(&with, &c) }).is_ok());
    assert_eq!(read_evals(&c.join("metrics.jsonl")).unwrap(), evs);
}

#[test]
fn bad_eval_tables_are_refused_naming_the_key() {
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("r.toml");
    for (extra, want) in [
        ("[eval]\nevry = 2\n", "evry"),
        ("[eval]\nppl_window = 64\nppl_stride = 0\n", "ppl_stride"),
        ("[eval]\nloss_buckets = [64, 16]\n", "loss_buckets"),
        ("[eval]\nppl_inputs = [\"/nonexistent/x.txt\"]\n", "ppl_inputs"),
    ] {
        std::fs::write(&cfg, format!("{TINY}{extra}")).unwrap();
        let e = format!("{:#}", run(args(&cfg, &d.path().join(want))).unwrap_err());
        assert!(e.contains(want) && e.contains("hint:"), "{extra}: {e}");
    }
}

#[test]
fn eval_tasks_score_the_final_weights_as_harpe_eval_tasks_does() {
    let d = tempfile::tempdir().unwrap();
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/eval_tasks/data");
    let cfg = d.path().join("r.toml");
    let extra = format!(
        "\n[eval]\nevery = 2\ntasks = \"piqa,mmlu\"\ntasks_data = {:?}\ntasks_shots = \"mmlu=1,piqa=2\"\ntasks_limit = 2\n",
        data.display().to_string()
    );
    std::fs::write(&cfg, format!("{TINY}{extra}")).unwrap();
    let out = d.path().join("o");
    run(args(&cfg, &out)).unwrap();
    let evs = read_evals(&out.join("metrics.jsonl")).unwrap();
    // only the final evaluation carries the tasks
    assert!(evs[..evs.len() - 1].iter().all(|e| e.eval.tasks.is_empty()));
    let last = evs.last().unwrap();
    assert_eq!(last.step, 7);
    let keys: Vec<&String> = last.eval.tasks.keys().collect();
    for k in ["mmlu", "mmlu_stem", "mmlu_anatomy", "piqa"] {
        assert!(keys.iter().any(|x| *x == k), "{k} missing from {keys:?}");
    }
    // the same numbers as harpe eval-tasks on the final checkpoint
    let mut a = harpe::eval::tasks::run::EvalTasksArgs {
        scoring: ScoringModel::new(&ckpt(&out, 7)),
        tasks: "piqa,mmlu".into(),
        data: data.clone(),
        shots: "mmlu=1,piqa=2".into(),
        limit: Some(2.0),
        seed: 1234,
        batch: 8,
        max_length: None,
        json: false,
        out: None,
        log_samples: false,
        tokenizer: None,
    };
    a.scoring.loss_chunk = 100;
    let (_, _, res) = harpe::eval::tasks::run::evaluate(&a).unwrap();
    for (task, m) in &last.eval.tasks {
        for (k, v) in m {
            let w = res["results"][task][k].as_f64().unwrap();
            assert!((v - w).abs() < 1e-9, "{task} {k}: {v} in training vs {w} from the checkpoint");
        }
    }
    let tb = harpe::train::tensorboard::read_scalars(&out.join("tb")).unwrap();
    assert!(tb.iter().any(|(s, t, _)| *s == 7 && t == "eval/tasks/piqa/acc,none"));
    // a bad task name in [eval] is refused before training, naming the key
    std::fs::write(&cfg, format!("{TINY}\n[eval]\ntasks = \"piqa,winogrande\"\ntasks_data = \"/x\"\n")).unwrap();
    let e = format!("{:#}", run(args(&cfg, &d.path().join("bad"))).unwrap_err());
    assert!(e.contains("[eval] tasks") && e.contains("winogrande") && e.contains("hint:"), "{e}");
}
