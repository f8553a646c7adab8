//! Cost of checkpoint checksums: writing and reading back a >= 1 GB optimizer shard with and without
//! the block CRC32Cs (`harpe::checksum`), as a save and a resume do it.
//!
//! Run: `CARGO_PROFILE_DEV_OPT_LEVEL=3 cargo bench --profile dev --bench checkpoint_checksums`
//! Env: `HARPE_BENCH_DIR` (default /tmp/harpe-bench-ckpt), `HARPE_BENCH_PARAMS` (flat parameters, default
//! 90M: a 1.08 GB shard of fp32 master, m and v), `HARPE_BENCH_REPEATS` (default 3).
//! Write: `write_safetensors_summed` (the save's writer: 32 MiB pieces copied from the buffers, summed as
//! they stream, fsync, rename) against the same loop without the `SumWriter` (this file's `write_plain`).
//! Read: `read_optim_shards` + `stitch_optim` of the whole range (the resume's reader: 256 KiB positional
//! reads, each hashed and converted while in cache) with `checksums.json` (every block checked as read)
//! and without it (an older checkpoint's path).
//! Also: the read with the check of a model file of `HARPE_BENCH_MODEL_BPP` bytes per parameter
//! (default 2 = bf16) before it, which a resume does not wait for (it runs beside the first step:
//! `ShareCheck` in src/train/session.rs), to show what that costs where it would.
//! The two sides alternate (and which goes first); medians. Reads come from the page cache (the file was
//! just written): the fastest the I/O gets, so the checksums' share is at its largest; `HARPE_BENCH_COLD=1`
//! (root) empties the page cache before each read instead. It is not a test and CI does not run it.
use anyhow::Result;
use harpe::checksum::{Checksums, FileSum};
use harpe::flatbuf::FlatBuf;
use harpe::model::weights::{write_safetensors_summed, StreamSrc, STREAM_CHUNK_BYTES};
use harpe::train::checkpoint;
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// The save's streaming loop without checksums: the same bytes (a placeholder header of the same
/// length), pieces, fsync and rename.
fn write_plain(path: &Path, bufs: &[&FlatBuf], header_len: usize) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let f = std::fs::File::create(&tmp)?;
    let mut w = std::io::BufWriter::new(f);
    w.write_all(&(header_len as u64).to_le_bytes())?;
    w.write_all(&vec![b' '; header_len])?;
    for b in bufs {
        let step = STREAM_CHUNK_BYTES / 4;
        for start in (0..b.len()).step_by(step) {
            let piece: Vec<u8> =
                b.range_to_host(start..(start + step).min(b.len()))?.into_iter().flat_map(f32::to_le_bytes).collect();
            w.write_all(&piece)?;
        }
    }
    let f = w.into_inner().map_err(|e| e.into_error())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// With `cold`, empty the page cache (root only) so the next read comes from the storage.
fn drop_caches(cold: bool) -> Result<()> {
    if cold {
        // SAFETY: sync(2) takes no arguments and cannot fail
        unsafe { libc::sync() };
        std::fs::write("/proc/sys/vm/drop_caches", "3")
            .map_err(|e| anyhow::anyhow!("HARPE_BENCH_COLD needs root to write /proc/sys/vm/drop_caches: {e}"))?;
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let dir = std::env::var("HARPE_BENCH_DIR").unwrap_or_else(|_| "/tmp/harpe-bench-ckpt".into());
    let n: usize = std::env::var("HARPE_BENCH_PARAMS").ok().and_then(|s| s.parse().ok()).unwrap_or(90_000_000);
    let repeats: usize = std::env::var("HARPE_BENCH_REPEATS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let cold = std::env::var_os("HARPE_BENCH_COLD").is_some();
    let model_bpp: usize = std::env::var("HARPE_BENCH_MODEL_BPP").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir)?;
    let bufs: Vec<FlatBuf> =
        (0..3).map(|k| FlatBuf::from_vec((0..n).map(|i| (i as f32 * 1e-3 + k as f32).sin()).collect())).collect();
    let srcs: Vec<(String, StreamSrc)> =
        ["master", "m", "v"].iter().zip(&bufs).map(|(k, b)| (k.to_string(), StreamSrc::Flat(b))).collect();
    let info = serde_json::json!({"format": checkpoint::FORMAT, "t": 1, "range_start": 0, "range_end": n});
    let meta: HashMap<String, String> = [("harpe_optim".to_string(), info.to_string())].into();
    let path = dir.join("optim-00000-of-00001.safetensors");
    let plain = dir.join("plain.safetensors");
    let bytes = 12 * n as u64 + 300;
    let (mut w_sum, mut w_plain, mut r_sum, mut r_plain) = (vec![], vec![], vec![], vec![]);
    let mut sum = None;
    // which side goes first alternates too (a write that follows another's fsync can find the disk busy)
    for r in 0..2 * repeats {
        if (r + r / 2) % 2 == 0 {
            let t = Instant::now();
            let (_, s) = write_safetensors_summed(&path, &srcs, Some(meta.clone()), STREAM_CHUNK_BYTES)?;
            w_sum.push(t.elapsed().as_secs_f64());
            sum = Some(s);
        } else {
            let header_len = sum.as_ref().map_or(296, |s: &FileSum| s.bytes as usize - 12 * n - 8);
            let t = Instant::now();
            write_plain(&plain, &bufs.iter().collect::<Vec<_>>(), header_len)?;
            w_plain.push(t.elapsed().as_secs_f64());
        }
    }
    std::fs::remove_file(&plain)?;
    let sum: FileSum = sum.unwrap_or_else(|| unreachable!());
    // the model file a resume checks but does not read (bf16: 2 bytes per parameter; its bytes do not
    // matter to the check)
    let model: Vec<u8> = (0..model_bpp * n).map(|i| (i * 7 + i / 13) as u8).collect();
    std::fs::write(dir.join("model.safetensors"), &model)?;
    let mut sums = Checksums::new();
    sums.files.insert("optim-00000-of-00001.safetensors".into(), sum.clone());
    sums.files.insert("model.safetensors".into(), FileSum::of_bytes(&model));
    drop(model);
    let sums_text = serde_json::to_string(&sums)?;
    // The resume's read of the range, with `checksums.json` or without; with `model_check`, the model
    // file's check (`verify_share`, which a resume runs beside its first step) before it, as a resume
    // would wait for it if the check came first.
    let read = |with: bool, model_check: bool| -> Result<f64> {
        let p = dir.join(checkpoint::CHECKSUMS);
        match with {
            true => std::fs::write(&p, &sums_text)?,
            false => {
                let _ = std::fs::remove_file(&p);
            }
        }
        drop_caches(cold)?;
        let t = Instant::now();
        if let (true, Some(s)) = (model_check, checkpoint::load_checksums(dir)?) {
            checkpoint::verify_share(dir, &s, 0, 1)?;
        }
        let shards = checkpoint::read_optim_shards(dir)?;
        let (master, _, _, _) = checkpoint::stitch_optim(dir, &shards, 0..n)?;
        let s = t.elapsed().as_secs_f64();
        assert_eq!(master.len(), n);
        Ok(s)
    };
    read(false, false)?; // warm the page cache
    read(true, true)?;
    let (mut res_sum, mut res_plain) = (vec![], vec![]);
    for r in 0..repeats {
        if r % 2 == 0 {
            r_sum.push(read(true, false)?);
            r_plain.push(read(false, false)?);
        } else {
            r_plain.push(read(false, false)?);
            r_sum.push(read(true, false)?);
        }
        res_sum.push(read(true, true)?);
        res_plain.push(read(false, true)?);
    }
    // the hash alone over the file's bytes, one core
    let data = std::fs::read(&path)?;
    let t = Instant::now();
    let again = FileSum::of_bytes(&data);
    let hash_s = t.elapsed().as_secs_f64();
    assert_eq!(again, sum);
    let gb = bytes as f64 / 1e9;
    let row = |what: &str, with: &[f64], without: &[f64]| {
        let (a, b) = (median(with.to_vec()), median(without.to_vec()));
        println!(
            "| {what} | {b:.3} s ({:.2} GB/s) | {a:.3} s ({:.2} GB/s) | {:+.1}% | {:?} / {:?} |",
            gb / b,
            gb / a,
            100.0 * (a / b - 1.0),
            with.iter().map(|x| (x * 1000.0).round() / 1000.0).collect::<Vec<_>>(),
            without.iter().map(|x| (x * 1000.0).round() / 1000.0).collect::<Vec<_>>()
        );
    };
    println!("shard: {} bytes ({n} parameters x 12 bytes), {repeats} repeats, medians", bytes);
    println!(
        "| step | without checksums | with checksums | overhead | runs with / without (s) |\n|---|---|---|---|---|"
    );
    row("write (save: stream, fsync, rename)", &w_sum, &w_plain);
    row("read (resume: every value of the range)", &r_sum, &r_plain);
    row(
        &format!("read + the model file's check ({model_bpp} B/param) before it (not what a resume does)"),
        &res_sum,
        &res_plain,
    );
    println!("CRC32C alone over the file, one core: {hash_s:.3} s ({:.2} GB/s)", gb / hash_s);
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
