//! Checksummed checkpoints through the binary: a flipped exponent bit in the model file of the shipped
//! tiny-cpu run's checkpoint is refused by `--resume` (naming the file and the bytes) and found by
//! `harpe verify`; `--resume-from` continues from the checkpoint before it; a flip in an optimizer block
//! only one rank of a 2-rank run reads is found by that rank; a damaged model file that one rank checks
//! stops every rank before the first step is logged or saved; a checkpoint without checksums (an older
//! harpe's) still resumes, saying so.
use crate::common::{harpe_text as harpe, train_text as train};
use std::path::{Path, PathBuf};

/// Flip `mask` in byte `at` of `path`.
fn flip(path: &Path, at: usize, mask: u8) {
    let mut b = std::fs::read(path).unwrap();
    b[at] ^= mask;
    std::fs::write(path, b).unwrap();
}

/// Byte offset of the first value of the (name-ordered) first tensor of a safetensors file.
fn first_value_offset(path: &Path) -> usize {
    let b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let first = h.as_object().unwrap().iter().filter(|(k, _)| *k != "__metadata__").min_by_key(|(k, _)| *k).unwrap();
    8 + n + first.1["data_offsets"][0].as_u64().unwrap() as usize
}

fn ckpt(out: &Path, step: u64) -> PathBuf {
    out.join("checkpoints").join(format!("step_{step:06}"))
}

#[test]
fn a_flipped_weight_bit_is_refused_at_resume_and_found_by_verify() {
    let d = tempfile::tempdir().unwrap();
    let cfg = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny-cpu.toml");
    let out = d.path().join("run");
    assert!(train(&cfg, &out, &["--steps", "10"]).0);
    let (ok, text) = train(&cfg, &out, &["--steps", "20", "--resume"]);
    assert!(ok, "{text}");
    let (s10, s20) = (ckpt(&out, 10), ckpt(&out, 20));
    let (ok, text) = harpe(&["verify", s20.to_str().unwrap()]);
    assert!(ok && text.contains("ok:"), "{text}");
    // an exponent bit (bit 30) of the 6th f32 of the first tensor
    let model = s20.join("model.safetensors");
    let at = first_value_offset(&model) + 4 * 5 + 3;
    flip(&model, at, 0x40);
    let (ok, text) = train(&cfg, &out, &["--steps", "22", "--resume"]);
    assert!(!ok, "{text}");
    assert!(text.contains("step_000020/model.safetensors: bytes 0..") && text.contains("are damaged"), "{text}");
    assert!(
        text.contains(&format!(
            "hint: the checkpoint is damaged; resume from the previous one with --resume-from {}",
            s10.display()
        )),
        "{text}"
    );
    assert!(!ckpt(&out, 22).exists());
    // the model file is checked while the first step trains: the run stopped before logging it
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert!(metrics.contains("{\"step\":20,") && !metrics.contains("{\"step\":21,"), "{metrics}");
    let (ok, text) = harpe(&["verify", s20.to_str().unwrap()]);
    assert!(!ok && text.contains("model.safetensors: bytes 0..") && text.contains("1 damaged part(s)"), "{text}");
    assert!(harpe(&["verify", s10.to_str().unwrap()]).0);
    // the hint's command works: the damaged step_20 is moved aside, so pruning cannot delete step_10 for it
    let (ok, text) = train(&cfg, &out, &["--steps", "22", "--resume-from", s10.to_str().unwrap()]);
    assert!(ok && text.contains("resuming from") && text.contains("step_000020.abandoned"), "{text}");
    assert!(s10.join("DONE").is_file() && ckpt(&out, 22).join("DONE").is_file() && !s20.exists());
    // a checkpoint of an older harpe (no checksums.json) resumes, with one note
    std::fs::remove_file(ckpt(&out, 22).join("checksums.json")).unwrap();
    let (ok, text) = train(&cfg, &out, &["--steps", "23", "--resume"]);
    assert!(ok, "{text}");
    assert_eq!(text.matches("has no checksums.json (written by an older harpe)").count(), 1, "{text}");
    assert!(ckpt(&out, 23).join("checksums.json").is_file());
}

/// A model whose optimizer shards (2 ranks, ZeRO-1) span two checksum blocks each (8 MiB).
const WIDE: &str = concat!(
    model_recipe!(256, 512, 4, 4, 2),
    r#"micro_batch_size = 2
global_batch_tokens = 128
loss_chunk_tokens = 64

[checkpoint]
every = 0

[log]
progress = false
plot = false

[[stage]]
seq_len = 32
steps = 4
"#
);

#[test]
fn a_flip_in_an_optimizer_block_only_rank_1_reads_is_found_by_rank_1() {
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("wide.toml");
    std::fs::write(&cfg, WIDE).unwrap();
    let out = d.path().join("run");
    let dist = ["--set", "dist.backend=local", "--set", "dist.world_size=2", "--set", "dist.zero_stage=1"];
    let (ok, text) = train(&cfg, &out, &[&dist[..], &["--steps", "1"]].concat());
    assert!(ok, "{text}");
    let shard = ckpt(&out, 1).join("optim-00001-of-00002.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    assert!(len > 8 << 20, "the shard must span two blocks ({len} bytes)");
    flip(&shard, (8 << 20) + 4 * 1000 + 2, 0x01);
    let (ok, text) = train(&cfg, &out, &[&dist[..], &["--steps", "2", "--resume"]].concat());
    assert!(!ok, "{text}");
    assert!(text.contains("optim-00001-of-00002.safetensors: bytes 8388608..") && text.contains("(block 1)"), "{text}");
    assert!(text.contains("rank 1"), "the rank that read the block reports it: {text}");
    let (ok, text) = harpe(&["verify", ckpt(&out, 1).to_str().unwrap()]);
    assert!(!ok && text.contains("(block 1)"), "{text}");
}

#[test]
fn a_damaged_model_file_checked_by_rank_1_stops_both_ranks_after_the_first_step_trains() {
    let dist = ["--set", "dist.backend=local", "--set", "dist.world_size=2", "--set", "dist.zero_stage=1"];
    let text = damaged_model_file_run(&dist);
    assert!(text.contains("rank 1 failed") && text.contains("ranks [0] stopped because of it"), "{text}");
}

/// The same with 2 Gloo processes, the launch path of NCCL ranks: rank 1's process reports the damage, rank
/// 0's stops because of it.
#[cfg(feature = "gloo")]
#[test]
fn a_damaged_model_file_checked_by_process_1_stops_both_processes() {
    let dist = ["--nproc-per-node", "2", "--set", "dist.backend=gloo", "--set", "dist.zero_stage=1"];
    let text = damaged_model_file_run(&dist);
    assert!(text.contains("rank 1 failed first"), "{text}");
}

/// Train one step on 2 ranks (`dist`), flip a bit in the checkpoint's model file where rank 1 checks it,
/// resume: the run fails naming the file, before the first step is logged or saved. Its output.
fn damaged_model_file_run(dist: &[&str]) -> String {
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("wide.toml");
    std::fs::write(&cfg, WIDE).unwrap();
    let out = d.path().join("run");
    let (ok, text) = train(&cfg, &out, &[dist, &["--steps", "1"]].concat());
    assert!(ok, "{text}");
    // the checkpoint's non-optimizer files are checked in shares, block by block in name order:
    // config.json's one block is rank 0's, model.safetensors' first block rank 1's
    let sums: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ckpt(&out, 1).join("checksums.json")).unwrap()).unwrap();
    let names: Vec<&String> = sums["files"].as_object().unwrap().keys().filter(|n| !n.starts_with("optim-")).collect();
    assert_eq!(names[..2], ["config.json", "model.safetensors"]);
    assert_eq!(sums["files"]["config.json"]["crc32c"].as_array().unwrap().len(), 1);
    let model = ckpt(&out, 1).join("model.safetensors");
    flip(&model, first_value_offset(&model) + 3, 0x40);
    let (ok, text) = train(&cfg, &out, &[dist, &["--steps", "3", "--resume"]].concat());
    assert!(!ok, "{text}");
    assert!(
        text.contains("step_000001/model.safetensors: bytes 0..") && text.contains("(block 0) are damaged"),
        "{text}"
    );
    assert!(!text.contains("another rank found"), "the cause is shown, not rank 0's echo of it: {text}");
    assert!(text.contains("harpe verify"), "{text}");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert!(!metrics.contains("{\"step\":2,"), "{metrics}");
    assert!(!ckpt(&out, 2).exists() && !ckpt(&out, 3).exists());
    text
}
