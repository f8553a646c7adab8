//! `harpe verify DIR`: every file of a checkpoint (its `checksums.json`) or of a prepared dataset (the
//! shards' checksums in its `manifest.json`) read whole and checked block by block, without training.
//!
//! The non-obvious decision: it does not stop at the first damaged block; it reports every one (file,
//! byte range) so a user knows whether one file or the whole checkpoint is lost, then exits non-zero.
//! The checks are the ones `--resume` and the data loader run on the blocks they read
//! (`checksum::FileSum::check_block`). What this file does not do: repair anything.
use crate::checksum::FileSum;
use crate::data::shard::{Manifest, DAMAGED_HINT};
use crate::train::checkpoint;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// `harpe verify` flags.
#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// A checkpoint directory (RUN/checkpoints/step_N: checksums.json) or a prepared dataset (manifest.json)
    pub dir: PathBuf,
}

/// `harpe verify`.
pub fn run(a: VerifyArgs) -> Result<()> {
    let t0 = std::time::Instant::now();
    let (bytes, problems, hint) = if a.dir.join(checkpoint::CHECKSUMS).is_file()
        || a.dir.join(checkpoint::DONE).is_file()
    {
        verify_checkpoint(&a.dir)?
    } else if a.dir.join("manifest.json").is_file() {
        verify_dataset(&a.dir)?
    } else {
        bail!(
            "{}: neither a checkpoint (checksums.json, DONE) nor a prepared dataset (manifest.json)\nhint: pass RUN/checkpoints/step_N or a prepare-data --out directory",
            a.dir.display()
        );
    };
    if !problems.is_empty() {
        for p in &problems {
            eprintln!("damaged: {p}");
        }
        bail!("{}: {} damaged part(s), listed above\nhint: {hint}", a.dir.display(), problems.len());
    }
    let s = t0.elapsed().as_secs_f64();
    println!(
        "ok: {} verified, {} in {s:.1} s ({:.2} GB/s)",
        a.dir.display(),
        crate::util::human_bytes(bytes),
        bytes as f64 / s.max(1e-9) / 1e9
    );
    Ok(())
}

/// Every block of every file a checkpoint's `checksums.json` lists; returns the bytes read and one line
/// per damaged file or block. A checkpoint without `DONE` or without checksums is an error.
fn verify_checkpoint(dir: &Path) -> Result<(u64, Vec<String>, String)> {
    if !dir.join(checkpoint::DONE).is_file() {
        bail!(
            "{}: no {} file: the save of this checkpoint did not finish\nhint: verify a complete checkpoint; `--resume` never uses this one",
            dir.display(),
            checkpoint::DONE
        );
    }
    let sums = checkpoint::load_checksums(dir)?.ok_or_else(|| {
        anyhow::anyhow!(
            "{}: no {} (written by an older harpe): nothing to verify against\nhint: `harpe consolidate` or a resume reads it unverified; its next save records checksums",
            dir.display(),
            checkpoint::CHECKSUMS
        )
    })?;
    let hint = checkpoint::damage_hint(dir);
    let mut bytes = 0;
    let mut problems = vec![];
    for (name, sum) in &sums.files {
        bytes += check_all(&dir.join(name), sum, &hint, &mut problems);
    }
    Ok((bytes, problems, hint))
}

/// Every shard (tokens and segment table) of a prepared dataset.
fn verify_dataset(dir: &Path) -> Result<(u64, Vec<String>, String)> {
    let m = Manifest::load(dir)?;
    let mut bytes = 0;
    let mut problems = vec![];
    for sh in &m.shards {
        for (file, sum) in [(&sh.file, &sh.crc32c), (&sh.segments_file, &sh.segments_crc32c)] {
            let p = dir.join(file);
            match sum {
                Some(sum) => match sum
                    .validate(&format!("{}: shard {file}", dir.join("manifest.json").display()), DAMAGED_HINT)
                {
                    Ok(()) => bytes += check_all(&p, sum, DAMAGED_HINT, &mut problems),
                    Err(e) => problems.push(format!("{e:#}")),
                },
                None => {
                    // a dataset prepared before block checksums: its sha256, file by file
                    if let Err(e) = sh.verify(dir) {
                        problems.push(format!("{e:#}"));
                    }
                    bytes += std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
                    break;
                }
            }
        }
    }
    Ok((bytes, problems, DAMAGED_HINT.to_string()))
}

/// Check every block of `path`, recording each damaged one (or the unreadable file) in `problems`;
/// returns the bytes read.
fn check_all(path: &Path, sum: &FileSum, hint: &str, problems: &mut Vec<String>) -> u64 {
    let res = (|| -> Result<u64> {
        let f = std::fs::File::open(path).with_context(|| format!("cannot open {}\nhint: {hint}", path.display()))?;
        let len = f.metadata().with_context(|| format!("cannot stat {}", path.display()))?.len();
        sum.check_len(path, len, hint)?;
        for b in 0..sum.crc32c.len() {
            if let Err(e) = sum.verify_blocks(path, &f, b..b + 1, hint) {
                problems.push(format!("{e:#}"));
            }
        }
        Ok(len)
    })();
    res.unwrap_or_else(|e| {
        problems.push(format!("{e:#}"));
        0
    })
}
