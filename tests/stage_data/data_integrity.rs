//! Checksummed shards: prepare-data records block checksums of every shard; one flipped byte is
//! refused by the loader when it first reads that block (naming the file and the bytes), while the other
//! shards still read, and `inspect-data --verify` and `harpe verify` find it.
use crate::common::data::*;
use harpe::data::{prepare_from_texts, Loader, LoaderConfig, PrepareOptions};
use std::process::Command;

#[test]
fn a_flipped_shard_byte_is_refused_by_the_loader_and_found_by_verify() {
    let (tmp, tok) = tempdir_with_tokenizer();
    let texts = one_source_docs(40, 15);
    let mut o = PrepareOptions::new(16);
    o.shard_tokens = 16 * 10;
    let dir = tmp.path().join("ds");
    let m = prepare_from_texts(&texts, &tok, &o, &dir).unwrap();
    assert!(m.shards.len() >= 2 && m.shards.iter().all(|s| s.crc32c.is_some() && s.segments_crc32c.is_some()));
    let bin = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_harpe")).args(args).output().unwrap();
        (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
    };
    let d = dir.to_str().unwrap();
    assert!(bin(&["verify", d]).0);
    assert!(bin(&["inspect-data", d, "--verify"]).0);
    // one bit of sequence 3 of shard 1
    let shard = dir.join(&m.shards[1].file);
    let mut b = std::fs::read(&shard).unwrap();
    b[3 * 16 * 4 + 5] ^= 0x10;
    std::fs::write(&shard, b).unwrap();
    let cfg = LoaderConfig { seq_len: 16, shuffle: false, seed: 0, rank: 0, world_size: 1 };
    let l = Loader::open(&dir, cfg).unwrap();
    let first_of_1 = m.shards[0].sequences;
    l.get(0).unwrap();
    let e = format!("{:#}", l.get(first_of_1).unwrap_err());
    assert!(e.contains("shard_00001.bin: bytes 0..") && e.contains("damaged") && e.contains("hint:"), "{e}");
    for args in [vec!["inspect-data", d, "--verify"], vec!["verify", d]] {
        let (ok, text) = bin(&args);
        assert!(!ok && text.contains("shard_00001.bin: bytes 0..") && text.contains("hint:"), "{args:?}: {text}");
    }
}
