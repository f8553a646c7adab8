//! SIGKILL at 20 seeded random moments (each in a run of its own) of a 4-rank run (thread ranks, ZeRO-1) that checkpoints every step:
//! each following `--resume` finds a consistent state, and the run ends with the same final checkpoint,
//! byte for byte (model, every optimizer shard, state), as the run that was never killed.
use crate::common::kill_at_random_moment;
use rand::SeedableRng;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

const RECIPE: &str = concat!(
    tiny_model!(),
    r#"micro_batch_size = 2
global_batch_tokens = 256
loss_chunk_tokens = 64

[checkpoint]
every = 1
keep_last = 2

[dist]
backend = "local"
world_size = 4
zero_stage = 1

[log]
progress = false
plot = false

[[stage]]
seq_len = 32
steps = 12
"#
);

fn start(cfg: &Path, out: &Path) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_harpe"))
        .args(["train", "--resume", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// The bytes of the final checkpoint's files that a resume reads or a user keeps.
fn final_files(out: &Path) -> Vec<(String, Vec<u8>)> {
    let dir = out.join("checkpoints/step_000012");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".safetensors") || n == "state.json" || n == "checksums.json")
        .collect();
    names.sort();
    names.into_iter().map(|n| (n.clone(), std::fs::read(dir.join(&n)).unwrap())).collect()
}

#[test]
fn sigkill_at_random_moments_then_resume_ends_bit_identical() {
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("run.toml");
    std::fs::write(&cfg, RECIPE).unwrap();
    let reference = d.path().join("reference");
    let t0 = Instant::now();
    assert!(start(&cfg, &reference).wait().unwrap().success());
    let full = t0.elapsed();
    let want = final_files(&reference);
    assert!(want.len() >= 6, "model, 4 shards, state, checksums: {:?}", want.iter().map(|f| &f.0).collect::<Vec<_>>());
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(47);
    let (mut kills, mut mid_write) = (0, 0);
    // 20 kills; a draw that comes after the run has ended (its start is slower than the reference's) is
    // still resumed and compared, then drawn again
    for k in 0..40 {
        if kills == 20 {
            break;
        }
        let out = d.path().join(format!("killed-{k}"));
        // anywhere in a whole run's time: the process start, steps, and (every step) checkpoint writes
        let (killed, at) = kill_at_random_moment(&mut start(&cfg, &out), &mut rng, 0.05..0.9, full);
        kills += usize::from(killed);
        // a save in flight leaves its temporary directory (or a shard's temporary file) behind
        let ckpts = out.join("checkpoints");
        let names: Vec<String> = std::fs::read_dir(&ckpts)
            .map(|r| r.map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect())
            .unwrap_or_default();
        mid_write += usize::from(names.iter().any(|n| n.starts_with(".tmp-")));
        assert!(start(&cfg, &out).wait().unwrap().success(), "the --resume after kill {k} failed");
        let got = final_files(&out);
        assert_eq!(got.len(), want.len());
        for ((n, a), (_, b)) in got.iter().zip(&want) {
            assert!(a == b, "after kill {k} at {at:?}: {n} differs from the uninterrupted run's");
        }
        std::fs::remove_dir_all(&out).unwrap();
    }
    eprintln!("{kills} runs killed, {mid_write} of them inside a checkpoint save");
    assert!(kills == 20 && mid_write >= 1, "{kills} kills, {mid_write} inside a save");
}
