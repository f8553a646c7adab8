//! Continual pretraining from the real model on the CPU: 4 steps of HARPE (one base per kv head) on real
//! text start at the model's own loss (not a random model's ln V), lower the loss on that text, and the
//! checkpoint loads back; and the shipped one-GPU recipe (configs/smollm2-harpe-32k.toml) runs 2 steps at a
//! reduced length, then eval-niah's passkey on the result.
use crate::common::{harpe, harpe_cmd, output};
use crate::{model, prepared_docs, root};
use std::path::Path;

fn losses(run: &Path) -> Vec<f64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64())
        .collect()
}

/// eval-loss's mean loss over the first `n` sequences of `data` under the model directory `dir`.
fn eval_loss(dir: &Path, data: &Path, n: usize) -> f64 {
    let args = ["eval-loss", "--model", &dir.display().to_string(), "--data", &data.display().to_string()];
    let (ok, stdout, stderr) = harpe(&[&args[..], &["--max-sequences", &n.to_string(), "--json"]].concat());
    assert!(ok, "{stderr}");
    serde_json::from_str::<serde_json::Value>(stdout.trim()).unwrap()["total"]["loss"].as_f64().unwrap()
}

#[test]
fn four_harpe_steps_start_at_the_models_loss_and_lower_it() {
    let Some(dir) = model() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let data = prepared_docs(dir, tmp.path(), 256);
    let cfg = tmp.path().join("run.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]\npath = {:?}\n[data]\nsource = \"prepared\"\npath = {:?}\n[rope]\nscheme = \"harpe\"\n\
             head_bases = [100000.0, 200000.0, 400000.0]\n[train]\ndevice = \"cpu\"\ndtype = \"f32\"\n\
             micro_batch_size = 2\nglobal_batch_tokens = 512\nloss_chunk_tokens = 512\n[optim]\nlr = 1e-4\n\
             weight_decay = 0.0\n[schedule]\nkind = \"constant\"\n[checkpoint]\nevery = 4\n[log]\nevery = 1\n\
             [[stage]]\nseq_len = 256\nsteps = 4\n",
            dir.display().to_string(),
            data.display().to_string()
        ),
    )
    .unwrap();
    let run = tmp.path().join("run");
    let before = eval_loss(dir, &data, 8);
    let t0 = std::time::Instant::now();
    let (ok, _, stderr) = output(harpe_cmd().args(["train", "--config"]).arg(&cfg).arg("--out").arg(&run));
    assert!(ok, "{stderr}");
    let l = losses(&run);
    eprintln!("4 HARPE steps: losses {l:?} ({:.0}s); eval-loss of the model {before:.4}", t0.elapsed().as_secs_f64());
    assert_eq!(l.len(), 4);
    let ln_v = (49152f64).ln();
    // the pretrained model's own loss (its RoPE bases changed, so not exactly eval-loss's), not ln V
    assert!(l[0] < 0.6 * ln_v && (l[0] - before).abs() < 1.5, "first loss {} (model {before}, ln V {ln_v})", l[0]);
    let ck = run.join("checkpoints/step_000004");
    let after = eval_loss(&ck, &data, 8);
    eprintln!("eval-loss on the first 8 sequences: {before:.4} -> {after:.4} after 4 steps");
    assert!(after < before, "training did not lower the loss on its own text: {before} -> {after}");
    let cfg_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg_json["rope_scaling"]["rope_type"], "harpe");
    assert_eq!(cfg_json["tie_word_embeddings"], true);
}

/// The one-GPU recipe's 2 steps on the CPU at a reduced length and batch (`--set`), then the passkey at the
/// lengths `HARPE_RECIPE_PASSKEY` names (default 4096; .ci/run asks 4096,8192, timed in benches/results/README.md).
#[test]
fn the_one_gpu_recipe_runs_two_steps_on_cpu_then_passkey() {
    let Some(dir) = model() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let data = prepared_docs(dir, tmp.path(), 512);
    let run = tmp.path().join("recipe");
    let recipe = root().join("configs/smollm2-harpe-32k.toml");
    let sets = [
        format!("model.path={:?}", dir.display().to_string()),
        format!("data.path={:?}", data.display().to_string()),
        "train.device=\"cpu\"".into(),
        "train.dtype=\"f32\"".into(),
        "train.global_batch_tokens=1024".into(),
        "stage.0.seq_len=512".into(),
        "checkpoint.every=2".into(),
    ];
    let mut cmd = harpe_cmd();
    cmd.args(["train", "--config"]).arg(&recipe).arg("--out").arg(&run).args(["--steps", "2"]);
    for s in &sets {
        cmd.args(["--set", s]);
    }
    let t0 = std::time::Instant::now();
    let (ok, _, stderr) = output(&mut cmd);
    assert!(ok, "{stderr}");
    let l = losses(&run);
    eprintln!("smollm2-harpe-32k, 2 steps at 512 tokens on CPU: losses {l:?} ({:.0}s)", t0.elapsed().as_secs_f64());
    assert_eq!(l.len(), 2);
    assert!(l.iter().all(|&x| x < 6.0), "{l:?}");
    let ck = run.join("checkpoints/step_000002");
    let lengths = std::env::var("HARPE_RECIPE_PASSKEY").unwrap_or_else(|_| "4096".into());
    let t0 = std::time::Instant::now();
    let out = tmp.path().join("niah");
    let args = ["eval-niah", "--model", &ck.display().to_string(), "--out", &out.display().to_string()];
    let (ok, stdout, stderr) = harpe(
        &[&args[..], &["--tasks", "passkey", "--lengths", &lengths, "--samples", "2", "--passkey-depths", "2"]]
            .concat(),
    );
    assert!(ok, "{stderr}");
    eprintln!("passkey at {lengths} on the 2-step checkpoint ({:.0}s):\n{stdout}", t0.elapsed().as_secs_f64());
    assert!(out.join("results.json").exists());
}
