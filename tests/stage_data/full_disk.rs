//! prepare-data on a full disk (a real size-limited tmpfs, tests/common/tmpfs.rs): it stops with an
//! error naming the file and a hint, and once space is freed the same command completes the dataset,
//! byte for byte the one prepared without interruption.
use crate::common::data::*;
use crate::tmpfs::Tmpfs;
use harpe::data::{prepare_from_texts, PrepareOptions};

#[test]
fn prepare_data_on_a_full_disk_stops_clearly_and_a_rerun_completes() {
    let (tmp, tok) = tempdir_with_tokenizer();
    let texts = one_source_docs(400, 500);
    let mut o = PrepareOptions::new(64);
    o.shard_tokens = 64 * 200;
    let reference = tmp.path().join("reference");
    let want = prepare_from_texts(&texts, &tok, &o, &reference).unwrap();
    let bytes: u64 = want.shards.iter().map(|s| s.sequences * 64 * 4).sum();
    assert!(bytes > 600 << 10, "the dataset must not fit the small file system ({bytes} bytes)");
    let Some(fs) = Tmpfs::mount(256 << 10, "full_disk::prepare_data_on_a_full_disk") else { return };
    let out = fs.path().join("ds");
    let e = format!("{:#}", prepare_from_texts(&texts, &tok, &o, &out).unwrap_err());
    assert!(e.contains("No space left on device") && e.contains(out.to_str().unwrap()) && e.contains("hint:"), "{e}");
    assert!(!out.join("manifest.json").exists());
    fs.resize(64 << 20);
    let got = prepare_from_texts(&texts, &tok, &o, &out).unwrap();
    assert_eq!(got.shards, want.shards);
    for s in &want.shards {
        assert_eq!(std::fs::read(out.join(&s.file)).unwrap(), std::fs::read(reference.join(&s.file)).unwrap());
    }
}
