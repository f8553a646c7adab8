//! The readers of a checkpoint and the other user files parsers_never_panic.rs does not cover never
//! panic, and their errors name the file: `state.json`, `checksums.json`, optimizer shards (with and
//! without their checksums), `tokenizer.json` and sweep files, from mutated real files (truncation, bit
//! flips, spliced bytes, huge or wrong-typed values, non-UTF-8, deep nesting). A counting allocator (this
//! test binary's global allocator) shows that headers claiming 2^60 bytes are refused without a large
//! allocation.
use crate::parsers_never_panic::{cfg, mutate, nasty_json, with_replaced, CASES};
use harpe::train::checkpoint;
use proptest::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The system allocator, recording the largest single request of each thread.
struct Counting;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = LARGEST.try_with(|c| c.set(c.get().max(size)));
}

// SAFETY: every call is forwarded to `System` unchanged; the bookkeeping touches a const-initialised
// thread-local `Cell` (no allocation, no destructor).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note(l.size());
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note(l.size());
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        note(new);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The largest single allocation `f` made on this thread.
fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|c| c.set(0));
    let out = f();
    (out, LARGEST.with(|c| c.get()))
}

/// An error names `file`.
fn check_named<T>(r: anyhow::Result<T>, file: &str) {
    if let Err(e) = r {
        let m = format!("{e:#}");
        assert!(m.contains(file), "the error does not name {file}: {m}");
    }
}

/// A checkpoint of the tiny-cpu recipe after one step (made once with the CLI).
fn checkpoint_dir() -> PathBuf {
    static D: OnceLock<tempfile::TempDir> = OnceLock::new();
    D.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_harpe"))
            .args(["train", "--steps", "1", "--set", "log.plot=false", "--config"])
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny-cpu.toml"))
            .arg("--out")
            .arg(tmp.path().join("run"))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        tmp
    })
    .path()
    .join("run/checkpoints/step_000001")
}

/// A copy of the checkpoint's files (the tokenizer and model files left out: other tests cover them).
fn copy_checkpoint(to: &Path) {
    for name in ["state.json", "checksums.json", "DONE", "optim-00000-of-00001.safetensors"] {
        std::fs::copy(checkpoint_dir().join(name), to.join(name)).unwrap();
    }
}

/// Every optimizer value of a checkpoint, as a resume reads it.
fn read_optimizer(dir: &Path) -> anyhow::Result<usize> {
    let shards = checkpoint::read_optim_shards(dir)?;
    let n = shards.iter().map(|s| s.range.end).max().unwrap_or(0);
    Ok(checkpoint::stitch_optim(dir, &shards, 0..n)?.0.len())
}

#[test]
fn headers_claiming_2_pow_60_bytes_are_refused_without_a_large_allocation() {
    let tmp = tempfile::tempdir().unwrap();
    // a safetensors file whose header length is 2^60
    let mut b = (1u64 << 60).to_le_bytes().to_vec();
    b.extend_from_slice(b"{}");
    let p = tmp.path().join("model.safetensors");
    std::fs::write(&p, &b).unwrap();
    let dev = candle_core::Device::Cpu;
    let (r, big) = largest_allocation(|| harpe::model::weights::read_safetensors(&p, candle_core::DType::F32, &dev));
    assert!(format!("{:#}", r.unwrap_err()).contains("model.safetensors"));
    assert!(big < 1 << 20, "{big} bytes allocated for a 10-byte file");
    // a tensor claiming 2^60 bytes of a 16-byte file
    let header = r#"{"w":{"dtype":"F32","shape":[268435456,1073741824],"data_offsets":[0,1152921504606846976]}}"#;
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(&[0u8; 16]);
    std::fs::write(&p, &b).unwrap();
    let (r, big) = largest_allocation(|| harpe::model::weights::read_safetensors(&p, candle_core::DType::F32, &dev));
    assert!(r.is_err() && big < 1 << 20, "{big}");
    // an optimizer shard whose range claims 2^60 values, and checksums claiming a 2^60-byte file
    let d = tmp.path().join("ckpt");
    std::fs::create_dir(&d).unwrap();
    copy_checkpoint(&d);
    std::fs::remove_file(d.join("checksums.json")).unwrap();
    let shard = d.join("optim-00000-of-00001.safetensors");
    let text = std::fs::read(&shard).unwrap();
    let hlen = u64::from_le_bytes(text[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(text[8..8 + hlen].to_vec()).unwrap();
    let end = header.split("range_end\\\":").nth(1).unwrap().split(|c: char| !c.is_ascii_digit()).next().unwrap();
    let huge = header.replacen(&format!("range_end\\\":{end}"), &format!("range_end\\\":{}", 1u64 << 60), 1);
    let mut m = (huge.len() as u64).to_le_bytes().to_vec();
    m.extend_from_slice(huge.as_bytes());
    m.extend_from_slice(&text[8 + hlen..]);
    std::fs::write(&shard, m).unwrap();
    let (r, big) = largest_allocation(|| read_optimizer(&d));
    assert!(format!("{:#}", r.unwrap_err()).contains("optim-00000-of-00001.safetensors"));
    assert!(big < 64 << 20, "{big} bytes allocated for a {}-byte shard", text.len());
    let sums = format!(
        r#"{{"format":1,"algorithm":"crc32c","files":{{"state.json":{{"bytes":{},"block_bytes":1,"crc32c":[]}}}}}}"#,
        1u64 << 60
    );
    std::fs::write(d.join("checksums.json"), sums).unwrap();
    let (r, big) = largest_allocation(|| checkpoint::load_state(&d));
    assert!(format!("{:#}", r.unwrap_err()).contains("checksums.json"));
    assert!(big < 1 << 20, "{big}");
}

proptest! {
    #![proptest_config(cfg(CASES))]
    #[test]
    fn state_and_checksums_values_never_panic(which in 0usize..2, k in 0usize..48, new in nasty_json()) {
        let tmp = tempfile::tempdir().unwrap();
        copy_checkpoint(tmp.path());
        let name = ["state.json", "checksums.json"][which];
        let p = tmp.path().join(name);
        let text = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, with_replaced(&text, k, &new)).unwrap();
        // state.json is checked against checksums.json: drop the sums to reach the parser
        if which == 0 {
            std::fs::remove_file(tmp.path().join("checksums.json")).unwrap();
        }
        check_named(checkpoint::load_state(tmp.path()), name);
    }

    #[test]
    fn checkpoint_file_bytes_never_panic(file in 0usize..3, sums in any::<bool>(), kind in any::<u8>(), pos in 0usize..4096, bytes in prop::collection::vec(any::<u8>(), 1..12)) {
        let tmp = tempfile::tempdir().unwrap();
        copy_checkpoint(tmp.path());
        let name = ["state.json", "checksums.json", "optim-00000-of-00001.safetensors"][file];
        let p = tmp.path().join(name);
        let b = std::fs::read(&p).unwrap();
        std::fs::write(&p, mutate(&b, kind, pos, &bytes)).unwrap();
        if !sums && file != 1 {
            std::fs::remove_file(tmp.path().join("checksums.json")).unwrap();
        }
        let r = checkpoint::load_state(tmp.path()).and_then(|_| read_optimizer(tmp.path()));
        // without checksums a damaged file is refused by its parser, naming it; with them, by the checksums,
        // naming the file whose bytes or recorded length disagree (a damaged checksums.json may make any
        // file of the checkpoint disagree)
        if let Err(e) = &r {
            let m = format!("{e:#}");
            let with_sums = sums || file == 1;
            assert!(m.contains(name) || (with_sums && m.contains(&tmp.path().display().to_string())), "{name}: {m}");
        }
    }

    #[test]
    fn tokenizer_json_never_panics(kind in any::<u8>(), pos in any::<usize>(), bytes in prop::collection::vec(any::<u8>(), 1..12), k in 0usize..64, new in nasty_json()) {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("tokenizer.json");
        let base = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/tokenizer.json")).unwrap();
        std::fs::write(&p, mutate(&base, kind, pos, &bytes)).unwrap();
        check_named(harpe::data::tokenize::load_tokenizer(&p).map(|_| ()), "tokenizer.json");
        std::fs::write(&p, with_replaced(std::str::from_utf8(&base).unwrap(), k, &new)).unwrap();
        check_named(harpe::data::tokenize::load_tokenizer(&p).map(|_| ()), "tokenizer.json");
    }

    #[test]
    fn sweep_files_never_panic(which in 0usize..2, kind in any::<u8>(), pos in any::<usize>(), bytes in prop::collection::vec(any::<u8>(), 1..12), depth in 0usize..200) {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("sweep.toml");
        let name = ["data-strategies.toml", "harpe-vs-multistage.toml"][which];
        let base: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/sweeps").join(name);
        let mut b = mutate(&std::fs::read(&base).unwrap(), kind, pos, &bytes);
        // deep nesting: an inline array `depth` levels deep
        b.extend_from_slice(format!("\nnested = {}{}\n", "[".repeat(depth), "]".repeat(depth)).as_bytes());
        std::fs::write(&p, b).unwrap();
        check_named(harpe::research::sweep::SweepSpec::load(&p), "sweep.toml");
    }
}
