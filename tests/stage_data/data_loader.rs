//! Loader: rank slices, shuffling, exact resume, world-size changes, validation; plus the CLI round trip.
use crate::common::data::*;
use harpe::data::{prepare_from_texts, Loader, LoaderConfig, PrepareOptions};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// A dataset of 50 sequences of 16 tokens.
fn dataset(tmp: &Path) -> PathBuf {
    let tok = write_tokenizer(tmp);
    let texts = one_source_docs(50, 15);
    let mut o = PrepareOptions::new(16);
    o.shard_tokens = 16 * 7;
    let out = tmp.join("ds");
    let m = prepare_from_texts(&texts, &tok, &o, &out).unwrap();
    assert_eq!(m.num_sequences, 50);
    out
}

fn cfg(shuffle: bool, seed: u64, rank: usize, world_size: usize) -> LoaderConfig {
    LoaderConfig { seq_len: 16, shuffle, seed, rank, world_size }
}

#[test]
fn rank_slices_are_disjoint_and_cover_each_epoch() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset(tmp.path());
    for shuffle in [false, true] {
        let w = 3;
        let mut seen: Vec<BTreeSet<u64>> = vec![BTreeSet::new(); 2];
        for r in 0..w {
            let mut l = Loader::open(&dir, cfg(shuffle, 5, r, w)).unwrap();
            assert_eq!(l.sequences_per_epoch(), 16);
            for (e, set) in seen.iter_mut().enumerate() {
                for _ in 0..16 {
                    let s = l.next_sequence().unwrap();
                    assert_eq!(s.epoch, e as u64);
                    assert!(set.insert(s.index), "sequence {} read twice in epoch {e}", s.index);
                }
            }
        }
        for set in &seen {
            assert_eq!(set.len(), 48); // 50 - 50 mod 3
        }
        if !shuffle {
            assert_eq!(seen[0], (0..48).collect());
        }
    }
    // shuffled epochs differ from each other and from another seed
    let order = |seed: u64| {
        let mut l = Loader::open(&dir, cfg(true, seed, 0, 1)).unwrap();
        (0..100).map(|_| l.next_sequence().unwrap().index).collect::<Vec<_>>()
    };
    let a = order(5);
    assert_ne!(a[..50], a[50..]);
    assert_ne!(a, order(6));
    assert_eq!(a, order(5));
    let mut first: Vec<u64> = a[..50].to_vec();
    first.sort();
    assert_eq!(first, (0..50).collect::<Vec<_>>());
}

#[test]
fn resume_cursor_is_exact_across_epochs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset(tmp.path());
    for (steps, w) in [(7usize, 2usize), (24, 2), (30, 1)] {
        let mut a = Loader::open(&dir, cfg(true, 11, 1 % w, w)).unwrap();
        for _ in 0..steps {
            a.next_sequence().unwrap();
        }
        let c = a.cursor();
        let json = serde_json::to_string(&c).unwrap();
        let want: Vec<_> = (0..40).map(|_| a.next_sequence().unwrap()).collect();
        let mut b = Loader::open(&dir, cfg(true, 11, 1 % w, w)).unwrap();
        b.restore(&serde_json::from_str(&json).unwrap()).unwrap();
        let got: Vec<_> = (0..40).map(|_| b.next_sequence().unwrap()).collect();
        assert_eq!(got, want);
    }
}

#[test]
fn world_size_change_is_exact_or_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset(tmp.path());
    // 2 ranks x 4 steps = global position 8; continue with 4 ranks = what 4 ranks would read from there
    let mut a = Loader::open(&dir, cfg(true, 3, 0, 2)).unwrap();
    for _ in 0..4 {
        a.next_sequence().unwrap();
    }
    let c = a.cursor();
    let mut reference = Loader::open(&dir, cfg(true, 3, 2, 4)).unwrap();
    for _ in 0..2 {
        reference.next_sequence().unwrap();
    }
    let mut b = Loader::open(&dir, cfg(true, 3, 2, 4)).unwrap();
    b.restore(&c).unwrap();
    for _ in 0..5 {
        assert_eq!(b.next_sequence().unwrap(), reference.next_sequence().unwrap());
    }
    // global position 6 is not divisible by 4: refused
    let mut a = Loader::open(&dir, cfg(true, 3, 0, 2)).unwrap();
    for _ in 0..3 {
        a.next_sequence().unwrap();
    }
    let err = format!("{:#}", b.restore(&a.cursor()).unwrap_err());
    assert!(err.contains("world size") && err.contains("hint:"), "{err}");
    // other seed refused
    let other = Loader::open(&dir, cfg(true, 4, 0, 2)).unwrap();
    assert!(b.restore(&other.cursor()).is_err());
}

#[test]
fn open_validates_seq_len_rank_and_shard_size() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset(tmp.path());
    let err = format!("{:#}", Loader::open(&dir, LoaderConfig { seq_len: 32, ..cfg(false, 0, 0, 1) }).err().unwrap());
    assert!(err.contains("seq_len 16") && err.contains("hint:"), "{err}");
    assert!(Loader::open(&dir, cfg(false, 0, 2, 2)).is_err());
    assert!(Loader::open(&dir, cfg(false, 0, 0, 51)).is_err());
    let l = Loader::open(&dir, cfg(false, 0, 0, 1)).unwrap();
    assert_eq!(
        l.manifest().tokenizer_sha256,
        harpe::data::tokenizer_sha256(&tmp.path().join("tokenizer.json")).unwrap()
    );
    let shard = dir.join("shard_00001.bin");
    let b = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &b[..b.len() - 4]).unwrap();
    let err = format!("{:#}", Loader::open(&dir, cfg(false, 0, 0, 1)).err().unwrap());
    assert!(err.contains("shard_00001.bin") && err.contains("truncated"), "{err}");
}

#[test]
fn cli_prepare_then_inspect() {
    let (tmp, tok) = tempdir_with_tokenizer();
    let input = tmp.path().join("in.jsonl");
    let lines: Vec<String> = (0..40)
        .map(|d| {
            slimpajama_line(&doc_text(d, if d % 5 == 0 { 300 } else { 30 }), ["RedPajamaBook", "RedPajamaC4"][d % 2])
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let cfg_path = tmp.path().join("data.toml");
    std::fs::write(
        &cfg_path,
        "strategy = \"per-source-upsample\"\nseq_len = 64\nbudget = 1000\nthreshold = 200\nshort_keep = 0.5\n",
    )
    .unwrap();
    let out = tmp.path().join("ds");
    let bin = env!("CARGO_BIN_EXE_harpe");
    let st = std::process::Command::new(bin)
        .args(["prepare-data", "--config", cfg_path.to_str().unwrap(), "--input", input.to_str().unwrap()])
        .args(["--tokenizer", tok.to_str().unwrap(), "--out", out.to_str().unwrap(), "--seq-len", "32", "--quiet"])
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    let m = harpe::data::Manifest::load(&out).unwrap();
    assert_eq!(m.seq_len, 32, "flags override the config file");
    assert_eq!(m.strategy.threshold, 200);
    let o = std::process::Command::new(bin)
        .args(["inspect-data", out.to_str().unwrap(), "--json", "--decode", "0"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["num_sequences"], m.num_sequences);
    let first = v["decoded"]["spans"][0]["text"].as_str().unwrap();
    assert!(first.starts_with("<s> w"), "{first}");
    let o = std::process::Command::new(bin).args(["inspect-data", out.to_str().unwrap(), "--verify"]).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && text.contains("RedPajamaBook") && text.contains("verified"), "{text}");
    let o =
        std::process::Command::new(bin).args(["prepare-data", "--input", input.to_str().unwrap()]).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("hint:"));
}
