//! N ranks train as one, through the `harpe` binary: `--set dist.backend=local --set dist.world_size=N`
//! with ZeRO 0/1/2 reaches the same weights and logged losses as one rank with the same global batch
//! (f32, 1e-6 relative), with gradient accumulation on every rank; a 4-rank checkpoint resumes on 2
//! ranks and on 1; `harpe consolidate` of a 4-rank checkpoint equals the 1-rank run's files; bad
//! `[dist]` values and `--nproc-per-node` on a CPU build are refused before any work.
//! The non-obvious choice: weights are compared per tensor by relative L2 distance (elementwise relative
//! error is meaningless for weights near 0); the summation order of the gradient differs with N, so
//! bit-identity is not expected.
use crate::common::{self, harpe_cmd};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Two stages (seq 32 then 64, HARPE bases in the second) so accumulation differs per stage:
/// 8 micro-batches of 2 x 32 per step, then 4 of 2 x 64.
pub(super) const TINY: &str = concat!(
    tiny_model!(),
    r#"micro_batch_size = 2
global_batch_tokens = 512
loss_chunk_tokens = 100

[optim]
lr = 3e-3

[checkpoint]
every = 2
keep_last = 5

[log]
progress = false
plot = false

[[stage]]
seq_len = 32
steps = 3

[[stage]]
seq_len = 64
steps = 2
rope = { scheme = "harpe", head_bases = [10000.0, 80000.0] }
"#
);

pub(super) use crate::common::harpe_text;

pub(super) fn write_cfg(dir: &Path) -> PathBuf {
    let p = dir.join("tiny.toml");
    std::fs::write(&p, TINY).unwrap();
    p
}

/// `write_cfg` with a first stage that never ends on its own (the signal tests stop it).
pub(super) fn write_endless_cfg(dir: &Path) -> PathBuf {
    let p = dir.join("tiny.toml");
    std::fs::write(&p, TINY.replace("seq_len = 32\nsteps = 3", "seq_len = 32\nsteps = 100000")).unwrap();
    p
}

/// Train `cfg` into `out` with extra `--set`s (and other flags); panics with the output on failure.
pub(super) fn train(cfg: &Path, out: &Path, extra: &[&str]) {
    let (ok, text) = common::train_text(cfg, out, extra);
    assert!(ok, "harpe train --config {} --out {} {extra:?} failed:\n{text}", cfg.display(), out.display());
}

/// `train` with `n` `Local` ranks at ZeRO stage `z`, then `extra`.
pub(super) fn train_ranks(cfg: &Path, out: &Path, (n, z): (usize, u8), extra: &[&str]) {
    let (ws, zs) = (format!("dist.world_size={n}"), format!("dist.zero_stage={z}"));
    let mut a = vec!["--set", "dist.backend=local", "--set", &ws, "--set", &zs];
    a.extend_from_slice(extra);
    train(cfg, out, &a);
}

pub(super) fn losses(run: &Path) -> Vec<(u64, f64)> {
    series(run, "loss")
}

/// The eval lines of a run's metrics.jsonl, as JSON values.
pub(super) fn eval_lines(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("eval").is_some())
        .collect()
}

/// Every step line's (step, `key`) of a finished run's metrics.jsonl.
fn series(run: &Path, key: &str) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v[key].as_f64().unwrap())
        })
        .collect()
}

/// Every tensor of a safetensors file (f32 or bf16) as f32 values, by name.
fn tensors(file: &Path) -> BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, t)| {
            let v = match t.dtype() {
                safetensors::Dtype::F32 => {
                    t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
                }
                safetensors::Dtype::BF16 => {
                    t.data().chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
                }
                d => panic!("{n}: unexpected dtype {d:?}"),
            };
            (n, v)
        })
        .collect()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>().sqrt();
    let n: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    d / n.max(1e-30)
}

/// The largest per-tensor relative L2 distance between two safetensors files (same tensor names).
pub(super) fn max_rel_l2(a: &Path, b: &Path, what: &str) -> f64 {
    let (ta, tb) = (tensors(a), tensors(b));
    assert_eq!(ta.keys().collect::<Vec<_>>(), tb.keys().collect::<Vec<_>>(), "{what}");
    ta.iter().map(|(k, va)| rel_l2(va, &tb[k])).fold(0.0, f64::max)
}

pub(super) fn assert_same_tensors(a: &Path, b: &Path, what: &str, tol: f64) {
    let r = max_rel_l2(a, b, what);
    assert!(r <= tol, "{what}: a tensor differs by {r:e} (relative L2), allowed {tol:e}");
}

/// Byte-identical files.
fn assert_identical(a: &Path, b: &Path, what: &str) {
    assert!(
        std::fs::read(a).unwrap() == std::fs::read(b).unwrap(),
        "{what}: {} and {} differ",
        a.display(),
        b.display()
    );
}

/// How far two one-rank runs that differ only in the order gradients are summed (micro-batches of 1
/// instead of 2 sequences, the same global batch) end apart: the rounding noise floor of f32 training.
/// AdamW's normalization turns a sign flip of a near-zero gradient sum into a full-size update, so
/// weights after k steps differ by ~1e-6 relative from summation order alone, and N ranks (which sum
/// rank-local partial sums) cannot be held to less than a small multiple of this floor.
fn noise_floor(cfg: &Path, one: &Path, dir: &Path) -> f64 {
    let alt = dir.join("one-mb1");
    train(cfg, &alt, &["--set", "train.micro_batch_size=1"]);
    assert_same_losses(one, &alt, "micro-batch 1 vs 2");
    max_rel_l2(&ckpt(one, 5).join("model.safetensors"), &ckpt(&alt, 5).join("model.safetensors"), "noise floor")
}

/// Every step's logged gradient norm (before clipping) by step.
fn grad_norms(run: &Path) -> Vec<(u64, f64)> {
    series(run, "grad_norm")
}

/// The same steps with the same losses and the same gradient norms (1e-6 relative): the norm sees the
/// gradient's scale, which clipping and AdamW's normalization would hide from the weights (a rank that
/// divided by its own target count instead of the step's would be N times off here).
pub(super) fn assert_same_losses(a: &Path, b: &Path, what: &str) {
    let (la, lb) = (losses(a), losses(b));
    assert_eq!(la.iter().map(|x| x.0).collect::<Vec<_>>(), lb.iter().map(|x| x.0).collect::<Vec<_>>(), "{what}");
    for ((s, x), (_, y)) in la.iter().zip(&lb) {
        assert!(((x - y) / x).abs() <= 1e-6, "{what}: step {s} loss {x} vs {y}");
    }
    for ((s, x), (_, y)) in grad_norms(a).iter().zip(&grad_norms(b)) {
        assert!(((x - y) / x).abs() <= 1e-6, "{what}: step {s} grad_norm {x} vs {y}");
    }
}

/// `out`, a 5-step run of `n` ranks, trained like the one-rank run `one` (losses, and weights within `tol`);
/// every rank wrote its optimizer shard, and rank 0 alone the metrics lines.
pub(super) fn assert_equals_one_rank(one: &Path, out: &Path, n: usize, what: &str, tol: f64) {
    assert_same_losses(one, out, what);
    assert_same_tensors(&model(one), &model(out), what, tol);
    let shards: Vec<_> = (0..n).map(|r| ckpt(out, 5).join(format!("optim-{r:05}-of-{n:05}.safetensors"))).collect();
    assert!(shards.iter().all(|p| p.is_file()), "{what}: every rank wrote its shard: {shards:?}");
    assert_eq!(losses(out).len(), 5, "{what}: one metrics line per step (rank 0 only)");
}

/// The variables a launcher gives rank `rank` of `world` processes meeting at 127.0.0.1:`port` (the Gloo
/// tests start processes by hand).
#[cfg(feature = "gloo")]
pub(super) fn rank_env(rank: usize, world: usize, port: u16) -> Vec<(String, String)> {
    [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
        ("HARPE_RUN_TOKEN", format!("test-{port}")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

pub(super) fn ckpt(run: &Path, step: u64) -> PathBuf {
    run.join("checkpoints").join(format!("step_{step:06}"))
}

/// The final model file of a run of `TINY`.
pub(super) fn model(run: &Path) -> PathBuf {
    ckpt(run, 5).join("model.safetensors")
}

/// The one-rank run of `TINY` in `dir` and the tolerance N ranks are held to: N ranks may differ from
/// one rank by summation order only, so a few times the measured noise floor, never more than 1e-5.
pub(super) fn baseline(dir: &Path) -> (PathBuf, PathBuf, f64) {
    let cfg = write_cfg(dir);
    let one = dir.join("one");
    train(&cfg, &one, &[]);
    let floor = noise_floor(&cfg, &one, dir);
    (cfg, one, (4.0 * floor).clamp(1e-6, 1e-5))
}

#[test]
fn n_ranks_and_each_zero_stage_equal_one_rank() {
    let d = tempfile::tempdir().unwrap();
    let (cfg, one, tol) = baseline(d.path());
    for (n, z) in [(1, 3), (2, 0), (2, 1), (2, 2), (2, 3), (4, 0), (4, 1), (4, 2), (4, 3)] {
        let out = d.path().join(format!("w{n}z{z}"));
        let (ws, zs) = (format!("dist.world_size={n}"), format!("dist.zero_stage={z}"));
        // a small bucket so ZeRO-2 runs several reduce-scatter rounds
        train(&cfg, &out, &["--set", "dist.backend=local", "--set", &ws, "--set", &zs, "--set", "dist.bucket_mb=0.01"]);
        assert_equals_one_rank(&one, &out, n, &format!("{n} ranks, ZeRO-{z}"), tol);
    }
    // the same ranks sum the same partial gradients in the same order under ZeRO 0 and 1 (one all-reduce
    // per step) and under ZeRO 2 and 3 (per-layer reduce-scatters per micro-batch): bit-identical
    for n in [2, 4] {
        for (a, b) in [(0, 1), (2, 3)] {
            let what = format!("{n} ranks, ZeRO-{b} vs ZeRO-{a}");
            let run = |z: u8| d.path().join(format!("w{n}z{z}"));
            assert_identical(&model(&run(a)), &model(&run(b)), &what);
        }
    }
    // ZeRO-3's gather-per-layer path at one rank computes exactly what the resident model computes
    assert_identical(&model(&one), &model(&d.path().join("w1z3")), "1 rank, ZeRO-3 vs ZeRO-0");
    assert_eq!(losses(&one), losses(&d.path().join("w1z3")), "1 rank, ZeRO-3 vs ZeRO-0: losses");
}

#[test]
fn n_ranks_equal_one_rank_with_clipping_out_of_the_way() {
    // grad_clip far above the gradient norm: the update is AdamW's of the raw gradient, whose scale
    // the logged norm shows (with clipping at 1.0 a wrong scale would be clipped away)
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    let noclip = ["--set", "optim.grad_clip=1e9"];
    let one = d.path().join("one");
    train(&cfg, &one, &noclip);
    for (n, z) in [(2, 1), (4, 3)] {
        let out = d.path().join(format!("w{n}z{z}"));
        train_ranks(&cfg, &out, (n, z), &noclip);
        assert_same_losses(&one, &out, &format!("{n} ranks, ZeRO-{z}, no clipping"));
    }
}

#[test]
fn a_four_rank_checkpoint_resumes_on_two_ranks_and_on_one_and_consolidates() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    let one = d.path().join("one");
    train(&cfg, &one, &[]);
    let four = d.path().join("four");
    train(
        &cfg,
        &four,
        &["--set", "dist.backend=local", "--set", "dist.world_size=4", "--set", "dist.zero_stage=3", "--steps", "2"],
    );
    for (name, sets) in [
        ("two", vec!["--set", "dist.backend=local", "--set", "dist.world_size=2", "--set", "dist.zero_stage=1"]),
        ("single", vec![]),
    ] {
        let run = d.path().join(name);
        copy_dir(&four, &run);
        let mut a = sets.clone();
        a.push("--resume");
        train(&cfg, &run, &a);
        assert_same_losses(&one, &run, &format!("4 ranks -> {name}"));
        let what = format!("4 ranks -> {name}");
        assert_same_tensors(
            &ckpt(&one, 5).join("model.safetensors"),
            &ckpt(&run, 5).join("model.safetensors"),
            &what,
            1e-5,
        );
    }
    // consolidate the 4-rank step-2 checkpoint: the 1-rank run's model and optimizer state
    let out = d.path().join("cons");
    let (ok, text) = harpe_text(&["consolidate", ckpt(&four, 2).to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(ok && text.contains("4 optimizer shard(s)"), "{text}");
    assert_same_tensors(
        &ckpt(&one, 2).join("model.safetensors"),
        &out.join("model.safetensors"),
        "consolidated model",
        1e-5,
    );
    let opt = "optim-00000-of-00001.safetensors";
    assert_same_tensors(&ckpt(&one, 2).join(opt), &out.join(opt), "consolidated optimizer", 1e-5);
    assert!(out.join("config.json").is_file() && out.join("tokenizer.json").is_file());
    // an existing --out and a directory that is not a complete checkpoint are refused
    let (ok, text) = harpe_text(&["consolidate", ckpt(&four, 2).to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(!ok && text.contains("already exists") && text.contains("hint:"), "{text}");
    let (ok, text) = harpe_text(&["consolidate", d.path().to_str().unwrap()]);
    assert!(!ok && text.contains("DONE") && text.contains("hint:"), "{text}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let p = e.path();
        if p.is_dir() {
            copy_dir(&p, &to.join(e.file_name()));
        } else if e.file_name() != ".lock" {
            std::fs::copy(&p, to.join(e.file_name())).unwrap();
        }
    }
}

#[test]
fn bad_dist_values_and_nproc_on_cpu_are_refused_before_any_work() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    let out = d.path().join("bad");
    let cases: [(&[&str], &[&str]); 7] = [
        (&["--set", "dist.zero_stage=4"], &["dist.zero_stage = 4", "hint:"]),
        (&["--set", "dist.bucket_mb=0"], &["dist.bucket_mb", "hint:"]),
        (
            &["--set", "dist.backend=local", "--set", "dist.world_size=4", "--set", "dist.sp_degree=3"],
            &["dist.sp_degree = 3 must divide dist.world_size = 4", "hint:"],
        ),
        // 2 kv heads cannot be split over 4 sequence-parallel ranks
        (
            &["--set", "dist.backend=local", "--set", "dist.world_size=4", "--set", "dist.sp_degree=4"],
            &["dist.sp_degree 4 does not divide the model's 2 kv heads", "hint:"],
        ),
        (
            &["--set", "dist.backend=local", "--set", "dist.world_size=3", "--set", "dist.sp_degree=3"],
            &["seq_len 32", "dist.sp_degree = 3", "hint:"],
        ),
        // 8 micro-batches per step in stage 0 do not split over 3 ranks
        (&["--set", "dist.backend=local", "--set", "dist.world_size=3"], &["3 data-parallel ranks", "hint:"]),
        (&["--nproc-per-node", "2"], &["--nproc-per-node 2", "dist.backend=local", "hint:"]),
    ];
    for (extra, want) in cases {
        let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()];
        a.extend_from_slice(extra);
        let (ok, text) = harpe_text(&a);
        assert!(!ok, "{extra:?} was accepted:\n{text}");
        for w in want {
            assert!(text.contains(w), "{extra:?}: missing {w:?} in:\n{text}");
        }
        assert!(!out.join("metrics.jsonl").exists(), "{extra:?} started work");
    }
}

#[test]
fn a_rank_that_fails_stops_the_others_naming_it() {
    // rank 0 cannot lock a run directory that is a file: the others stop and the error names rank 0
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    let out = d.path().join("a-file");
    std::fs::write(&out, b"not a directory").unwrap();
    let (ok, text) = harpe_text(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--set",
        "dist.backend=local",
        "--set",
        "dist.world_size=2",
    ]);
    assert!(!ok && text.contains("rank 0") && text.contains("hint:"), "{text}");
}

#[test]
fn a_rank_that_errors_or_panics_mid_step_stops_every_rank_naming_it_and_keeps_the_last_checkpoint() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    for (kind, z) in [("panic", "1"), ("error", "3")] {
        let out = d.path().join(format!("fault-{kind}"));
        let o = harpe_cmd()
            .args(["train", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()])
            .args([
                "--set",
                "dist.backend=local",
                "--set",
                "dist.world_size=4",
                "--set",
                &format!("dist.zero_stage={z}"),
            ])
            .args(["--set", "dist.timeout_s=20"])
            .env("HARPE_FAULT", "2:3:".to_string() + kind) // rank 2, in the 4th step (stage 1's first)
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(!o.status.success(), "{kind}: the run succeeded:\n{text}");
        assert!(text.contains("rank 2") && text.contains("failed first") && text.contains("hint:"), "{kind}:\n{text}");
        assert!(text.contains(&format!("injected {kind} on rank 2 at step 3")), "{kind}:\n{text}");
        // the last complete checkpoint (step 3, stage 0's end) is intact and resumable; nothing of step 4
        assert!(ckpt(&out, 3).join("DONE").is_file(), "{kind}");
        assert!(!ckpt(&out, 4).exists(), "{kind}");
        assert_eq!(losses(&out).len(), 3, "{kind}: steps 1-3 logged");
        train(&cfg, &out, &["--set", "dist.backend=local", "--set", "dist.world_size=2", "--resume"]);
        assert_eq!(losses(&out).iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2, 3, 4, 5], "{kind}");
    }
}

/// Sequence parallelism through `harpe train`: each sequence split over P ranks (global RoPE positions,
/// each head's own HARPE base travelling with it through the all-to-all), composed with data
/// parallelism, ZeRO and gradient accumulation, equals one rank.
#[test]
fn sequence_parallel_ranks_equal_one_rank() {
    let d = tempfile::tempdir().unwrap();
    let (cfg, one, tol) = baseline(d.path());
    // (world, sp, zero): SP alone; SP x DP; SP x DP x ZeRO-3
    for (n, p, z) in [(2, 2, 0), (4, 2, 1), (4, 2, 3)] {
        let out = d.path().join(format!("w{n}sp{p}z{z}"));
        let sets = [format!("dist.world_size={n}"), format!("dist.sp_degree={p}"), format!("dist.zero_stage={z}")];
        train(&cfg, &out, &["--set", "dist.backend=local", "--set", &sets[0], "--set", &sets[1], "--set", &sets[2]]);
        let what = format!("{n} ranks, SP {p}, ZeRO-{z}");
        assert_same_losses(&one, &out, &what);
        assert_same_tensors(&model(&one), &model(&out), &what, tol);
    }
    // SP 4 needs 4 kv heads: MHA, with four per-head bases in the HARPE stage
    let mha = ["--set", "model.init.num_key_value_heads=4", "--set", "stage.1.rope.head_bases=[1e4, 2e4, 4e4, 8e4]"];
    let one4 = d.path().join("one-mha");
    train(&cfg, &one4, &mha);
    for z in [1, 3] {
        let out = d.path().join(format!("w4sp4z{z}"));
        train_ranks(&cfg, &out, (4, z), &[&mha[..], &["--set", "dist.sp_degree=4"]].concat());
        let what = format!("4 ranks, SP 4, ZeRO-{z}");
        assert_same_losses(&one4, &out, &what);
        assert_same_tensors(&model(&one4), &model(&out), &what, tol);
    }
    // checkpoint and resume under SP: stopped after step 2 (inside stage 0), resumed with SP 4 x ZeRO-3
    // from the SP 2 x DP 2 checkpoint, it ends where one rank ends
    let run = d.path().join("sp-resume");
    let local4 = ["--set", "dist.backend=local", "--set", "dist.world_size=4"];
    train(&cfg, &run, &[&mha[..], &local4, &["--set", "dist.sp_degree=2", "--steps", "2"]].concat());
    let resume = ["--set", "dist.sp_degree=4", "--set", "dist.zero_stage=3", "--resume"];
    train(&cfg, &run, &[&mha[..], &local4, &resume].concat());
    assert_same_losses(&one4, &run, "SP 2 x DP 2 -> SP 4 resume");
    assert_same_tensors(&model(&one4), &model(&run), "SP 2 x DP 2 -> SP 4 resume", tol);
}

#[test]
fn a_run_that_does_not_fit_this_machine_is_refused_before_any_work() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    let out = d.path().join("big");
    // Llama-2-7B's shape, randomly initialized: its fp32 training state alone is ~100 GiB
    let sets = [
        "model.init.hidden_size=4096",
        "model.init.intermediate_size=11008",
        "model.init.num_hidden_layers=32",
        "model.init.vocab_size=32000",
    ];
    let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()];
    a.extend(sets.iter().flat_map(|s| ["--set", s]));
    let (ok, text) = harpe_text(&a);
    assert!(!ok && text.contains("GiB per rank") && text.contains("harpe plan") && text.contains("--force"), "{text}");
    assert!(!out.exists(), "refused before the run directory is made");
}

/// A rank's share of a step that is not a whole number of configured micro-batches runs in smaller
/// micro-batches (1 micro-batch of 8 sequences in stage 1 over 4 ranks: 2 sequences each); the result
/// is the one-rank result.
#[test]
fn ranks_split_a_micro_batch_when_the_step_has_fewer_micro_batches_than_ranks() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    let (one, four) = (d.path().join("one"), d.path().join("four"));
    train(&cfg, &one, &["--set", "train.micro_batch_size=8"]);
    let dist = ["train.micro_batch_size=8", "dist.backend=local", "dist.world_size=4", "dist.zero_stage=2"];
    train(&cfg, &four, &dist.iter().flat_map(|s| ["--set", s]).collect::<Vec<_>>());
    assert_same_losses(&one, &four, "4 ranks, micro-batch 8 split");
    assert_same_tensors(
        &ckpt(&one, 5).join("model.safetensors"),
        &ckpt(&four, 5).join("model.safetensors"),
        "4 ranks, micro-batch 8 split",
        1e-5,
    );
}

/// Tied embeddings (the head is the embedding): under ZeRO 2-3 and SP the embedding's group takes its
/// gradient from the loss and from the input side, and the run equals one rank.
#[test]
fn tied_embeddings_under_zero_2_3_and_sp_equal_one_rank() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    let tied = "model.init.tie_word_embeddings=true";
    let one = d.path().join("one-tied");
    train(&cfg, &one, &["--set", tied]);
    assert!(!tensors(&model(&one)).contains_key("lm_head.weight"), "a tied model saves no lm_head");
    for (n, z, p) in [(4, 2, 1), (4, 3, 1), (2, 3, 2)] {
        let out = d.path().join(format!("tied-w{n}z{z}sp{p}"));
        let sets = [format!("dist.world_size={n}"), format!("dist.zero_stage={z}"), format!("dist.sp_degree={p}")];
        let mut a = vec!["--set", tied, "--set", "dist.backend=local"];
        a.extend(sets.iter().flat_map(|s| ["--set", s.as_str()]));
        train(&cfg, &out, &a);
        let what = format!("tied, {n} ranks, ZeRO-{z}, SP {p}");
        assert_same_losses(&one, &out, &what);
        assert_same_tensors(&model(&one), &model(&out), &what, 1e-5);
    }
}

/// The number of optimizer shards a checkpoint holds (one per rank) and whether it is complete.
pub(super) fn shards_and_done(dir: &Path) -> (usize, bool) {
    let n = std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("optim-"))
        .count();
    (n, dir.join("DONE").is_file())
}

#[test]
fn a_signal_after_the_stop_agreement_on_one_rank_stops_every_rank_together_one_step_later() {
    // rank 1's flag rises right after step 2's agreement (the test hook): with the loop acting on the
    // raw flag rank 1 would leave while rank 0 waits in step 3's collectives until the timeout
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    let out = d.path().join("late");
    let o = harpe_cmd()
        .args(["train", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .args(["--set", "dist.backend=local", "--set", "dist.world_size=2", "--set", "dist.timeout_s=30"])
        .env("HARPE_TEST_LATE_SIGNAL", "1:2")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{text}");
    assert!(text.contains("stopped by signal after step 3"), "{text}");
    assert_eq!(losses(&out).len(), 3, "every rank ran step 3, then all stopped:\n{text}");
    assert_eq!(shards_and_done(&ckpt(&out, 3)), (2, true), "the stop's checkpoint holds both ranks' shards");
}

#[test]
fn sigterms_at_random_moments_into_a_four_rank_run_always_end_cleanly_with_a_complete_checkpoint() {
    use rand::{Rng, SeedableRng};
    let d = tempfile::tempdir().unwrap();
    let cfg = write_endless_cfg(d.path());
    let out = d.path().join("r");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(25);
    let mut last_step = 0;
    for round in 0..4 {
        let mut child = harpe_cmd()
            .args(["train", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap(), "--resume"])
            .args(["--set", "dist.backend=local", "--set", "dist.world_size=4", "--set", "dist.zero_stage=3"])
            .args(["--set", "dist.timeout_s=60"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // wait for this session's first step (a signal before the handlers exist would be fatal)
        let t0 = std::time::Instant::now();
        while losses_or_empty(&out).last().map(|l| l.0).unwrap_or(0) <= last_step {
            assert!(t0.elapsed().as_secs() < 120, "round {round}: training did not start");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        std::thread::sleep(std::time::Duration::from_millis(rng.random_range(0..400)));
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = child.wait().unwrap();
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert!(status.success(), "round {round}: exit {status:?}\n{err}");
        let steps = losses_or_empty(&out).last().map(|l| l.0).unwrap();
        assert_eq!(
            shards_and_done(&ckpt(&out, steps)),
            (4, true),
            "round {round}: the final checkpoint of step {steps}"
        );
        assert!(steps > last_step, "round {round} trained");
        last_step = steps;
    }
}

/// The logged (step, loss) lines so far of a run that may be writing (a torn last line is skipped).
pub(super) fn losses_or_empty(run: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v["step"].as_u64()?, v["loss"].as_f64()?)))
        .collect()
}

#[test]
fn n_ranks_equal_one_rank_in_bf16_within_the_bf16_noise_floor() {
    bf16_ranks_within_the_noise_floor("ranks", train_ranks);
}

/// bf16 compute weights (gathered and published in bf16 under ZeRO): N ranks may differ from one rank by
/// summation order only; the floor is what the order alone makes at one rank (micro-batches of 1 instead
/// of 2), measured in this run, and N ranks — started by `run(cfg, out, (n, zero), extra)`, `kind` in
/// messages — are held to 4x it at 2 ranks ZeRO-1 and 4 ranks ZeRO-3.
pub(super) fn bf16_ranks_within_the_noise_floor(kind: &str, run: impl Fn(&Path, &Path, (usize, u8), &[&str])) {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    let bf16 = ["--set", "train.dtype=\"bf16\""];
    let one = d.path().join("one");
    train(&cfg, &one, &bf16);
    let alt = d.path().join("one-mb1");
    let mut a = bf16.to_vec();
    a.extend(["--set", "train.micro_batch_size=1"]);
    train(&cfg, &alt, &a);
    let floor_loss = max_rel_diff(&losses(&one), &losses(&alt));
    let floor_w = max_rel_l2(&model(&one), &model(&alt), "bf16 noise floor");
    assert!(floor_loss > 0.0 || floor_w > 0.0, "bf16 at one rank is order-independent?");
    for (n, z) in [(2, 1), (4, 3)] {
        let out = d.path().join(format!("w{n}z{z}"));
        run(&cfg, &out, (n, z), &bf16);
        let what = format!("bf16, {n} {kind}, ZeRO-{z}");
        let dl = max_rel_diff(&losses(&one), &losses(&out));
        assert!(dl <= 4.0 * floor_loss.max(1e-4), "{what}: losses differ by {dl:e}, floor {floor_loss:e}");
        let dw = max_rel_l2(&model(&one), &model(&out), &what);
        assert!(dw <= 4.0 * floor_w.max(1e-3), "{what}: weights differ by {dw:e}, floor {floor_w:e}");
    }
}

/// The largest relative difference of two runs' logged losses, step by step (same steps).
pub(super) fn max_rel_diff(a: &[(u64, f64)], b: &[(u64, f64)]) -> f64 {
    assert_eq!(a.iter().map(|x| x.0).collect::<Vec<_>>(), b.iter().map(|x| x.0).collect::<Vec<_>>());
    a.iter().zip(b).map(|((_, x), (_, y))| ((x - y) / x).abs()).fold(0.0, f64::max)
}

#[test]
fn ranks_that_see_another_newest_checkpoint_are_refused_naming_rank_and_path() {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    let out = d.path().join("run");
    let two = ["--set", "dist.backend=local", "--set", "dist.world_size=2", "--set", "dist.zero_stage=1"];
    let mut a = two.to_vec();
    a.extend(["--steps", "2"]);
    train(&cfg, &out, &a);
    let before = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    // rank 1's view: the same checkpoints plus a newer one (a stale or node-local file system)
    let extra = d.path().join("view-extra");
    copy_dir(&out.join("checkpoints"), &extra);
    copy_dir(&ckpt(&out, 2), &extra.join("step_000004"));
    let state = extra.join("step_000004").join("state.json");
    let s = std::fs::read_to_string(&state).unwrap().replace("\"step\": 2,", "\"step\": 4,");
    std::fs::write(&state, s).unwrap();
    // the forged state.json no longer matches the copied checksums: drop them, as an older harpe's
    // checkpoint has none (a damaged file would be refused for its own reason, tested elsewhere)
    std::fs::remove_file(extra.join("step_000004").join("checksums.json")).unwrap();
    // rank 1's view: no checkpoint at all
    let empty = d.path().join("view-empty");
    std::fs::create_dir_all(&empty).unwrap();
    for (view, sees) in [(&extra, "step_000004"), (&empty, "sees none")] {
        let mut args = vec!["train", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap(), "--resume"];
        args.extend(two);
        let o = harpe_cmd()
            .args(&args)
            .env("HARPE_TEST_CHECKPOINT_VIEW", format!("1:{}", view.display()))
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(!o.status.success(), "{view:?} was accepted:\n{text}");
        for want in ["rank 1", sees, "step_000002", "hint:"] {
            assert!(text.contains(want), "{view:?}: missing {want:?} in:\n{text}");
        }
        assert_eq!(std::fs::read_to_string(out.join("metrics.jsonl")).unwrap(), before, "nothing was trained");
    }
}
