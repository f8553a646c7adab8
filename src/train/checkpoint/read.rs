//! Reading a checkpoint's optimizer shards back: each resuming rank reads only the bytes of its own flat
//! range from the shards of whatever world size wrote them (`OptimShard`, `stitch_optim`,
//! `read_optim_range`), with positional reads rather than a memory map (`OptimShard` says why).
//!
//! A resume may use another world size than the run that wrote the checkpoint, so the shards are re-cut.
//! Split from checkpoint/mod.rs, which writes what this reads.

use crate::checksum::{Checksums, FileSum};
use crate::comms::Mesh;
use crate::flatbuf::FlatBuf;
use crate::optim::adamw::AdamW;
use anyhow::{anyhow, bail, Context, Result};
use std::path::{Path, PathBuf};

/// One rank's optimizer shard file: its flat range, AdamW step count and where its fp32 (master, m, v)
/// lie in the file. A resuming rank reads only the elements of its own range (`stitch_optim`), so
/// resuming N ranks reads each file's bytes about once in all, not N times into every rank's memory;
/// it reads them with positional reads in pieces of `READ_CHUNK_BYTES`, not through a memory map,
/// because the mapped pages a copy touches count as the process's resident memory until it unmaps
/// (the whole checkpoint at once when the ranks are threads of one process), while read pages stay in
/// the kernel's page cache.
pub struct OptimShard {
    /// the file it came from
    pub path: PathBuf,
    /// the flat range it holds
    pub range: std::ops::Range<usize>,
    /// AdamW step count
    pub t: u64,
    /// the open file
    file: std::fs::File,
    /// byte offsets of the little-endian f32 data of master, m and v in the file
    offsets: [usize; 3],
    /// the file's block checksums from the checkpoint's `checksums.json` (none in an older checkpoint)
    sum: Option<FileSum>,
    /// the hint of a checksum mismatch (`damage_hint`)
    hint: String,
}

/// Bytes per positional read of a shard's values: one checksum block, so a checked read reads each
/// block once and whole.
const READ_CHUNK_BYTES: u64 = crate::checksum::BLOCK_BYTES;

/// Which of a shard's three tensors.
#[derive(Clone, Copy, Debug)]
pub enum OptimPart {
    Master = 0,
    M = 1,
    V = 2,
}

impl OptimShard {
    /// Append the values of `part` at positions `local` (relative to `range.start`) to `out`. With
    /// checksums, every block holding any of those bytes is read whole and checked before its values
    /// are used.
    pub fn copy_into(&self, part: OptimPart, local: std::ops::Range<usize>, out: &mut Vec<f32>) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let start = (self.offsets[part as usize] + 4 * local.start) as u64;
        let end = start + 4 * local.len() as u64;
        let grid = self.sum.as_ref().map_or(READ_CHUNK_BYTES, |s| s.block_bytes);
        let mut buf = Vec::new();
        // bytes of a value split by a block boundary (never in a file harpe wrote: its data is 4-aligned)
        let mut carry = Vec::new();
        out.reserve(local.len());
        let mut at = start;
        while at < end {
            let b = at / grid;
            let hi = ((b + 1) * grid).min(end);
            let (rs, re) = match &self.sum {
                Some(s) => (s.block_range(b as usize).start, s.block_range(b as usize).end),
                None => (at, hi),
            };
            buf.resize((re - rs) as usize, 0);
            self.file.read_exact_at(&mut buf, rs).with_context(|| {
                format!("cannot read {} at byte {rs}\nhint: the file is damaged or truncated", self.path.display())
            })?;
            if let Some(s) = &self.sum {
                s.check_block(&self.path, b as usize, &buf, &self.hint)?;
            }
            carry.extend_from_slice(&buf[(at - rs) as usize..(hi - rs) as usize]);
            let whole = carry.len() / 4 * 4;
            out.extend(carry[..whole].chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
            carry.drain(..whole);
            at = hi;
        }
        Ok(())
    }

    /// Every value of `part`.
    pub fn values(&self, part: OptimPart) -> Result<Vec<f32>> {
        let mut v = Vec::with_capacity(self.range.len());
        self.copy_into(part, 0..self.range.len(), &mut v)?;
        Ok(v)
    }
}

/// Check one `optim-*.safetensors` file (its metadata and tensor sizes, parsed from a memory map that
/// touches only the header; values are read later).
pub fn read_optim_shard(p: &Path) -> Result<OptimShard> {
    let f = std::fs::File::open(p)
        .with_context(|| format!("cannot read {}\nhint: the checkpoint is incomplete or not readable", p.display()))?;
    // SAFETY: the file is opened read-only; a checkpoint directory is complete (DONE) and never written
    // again (new saves go to a temp directory that is renamed), so it does not change while mapped.
    let map = unsafe { memmap2::Mmap::map(&f) }.with_context(|| format!("cannot map {}", p.display()))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&map[..])
        .map_err(|e| anyhow!("{}: {e}\nhint: the file is damaged", p.display()))?;
    let info: serde_json::Value = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("harpe_optim"))
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or_default();
    let num = |k: &str| -> Result<u64> {
        info[k].as_u64().ok_or_else(|| {
            anyhow!("{}: metadata `{k}` missing\nhint: the file is damaged or not written by harpe", p.display())
        })
    };
    let range = num("range_start")? as usize..num("range_end")? as usize;
    let st = safetensors::SafeTensors::deserialize(&map[..])
        .map_err(|e| anyhow!("{}: {e}\nhint: the file is damaged", p.display()))?;
    let n = range.len();
    let offset = |k: &str| -> Result<usize> {
        let t = st.tensor(k).map_err(|e| anyhow!("{}: tensor `{k}`: {e}\nhint: the file is damaged", p.display()))?;
        let d = t.data();
        if d.len() != n * 4 || t.dtype() != safetensors::Dtype::F32 {
            bail!(
                "{}: tensor `{k}` has {} bytes of {:?}, its range {range:?} needs {n} f32 values\nhint: the file is damaged",
                p.display(),
                d.len(),
                t.dtype()
            );
        }
        Ok(d.as_ptr() as usize - map.as_ptr() as usize)
    };
    let offsets = [offset("master")?, offset("m")?, offset("v")?];
    let t = num("t")?;
    drop(st);
    Ok(OptimShard { path: p.to_path_buf(), range, t, file: f, offsets, sum: None, hint: String::new() })
}

/// The checksums of optimizer shard `p` in `sums` (of checkpoint `dir`) and the hint of a mismatch,
/// after checking the file's length and its first block (where the header every reader parses lies;
/// the values are checked as they are read).
fn shard_sum(dir: &Path, p: &Path, sums: &Checksums) -> Result<(FileSum, String)> {
    let hint = super::damage_hint(dir);
    let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let sum = sums.files.get(&name).ok_or_else(|| {
        anyhow!("{}: not listed in {}\nhint: {hint}", p.display(), dir.join(super::CHECKSUMS).display())
    })?;
    let f = std::fs::File::open(p).with_context(|| format!("cannot open {}\nhint: {hint}", p.display()))?;
    sum.check_len(p, f.metadata().with_context(|| format!("cannot stat {}", p.display()))?.len(), &hint)?;
    sum.verify_blocks(p, &f, sum.blocks_of(0..1), &hint)?;
    Ok((sum.clone(), hint))
}

/// Every optimizer shard of checkpoint `dir`, ordered by the start of its range.
pub fn read_optim_shards(dir: &Path) -> Result<Vec<OptimShard>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| {
            format!("cannot list {}\nhint: pass a checkpoint directory (RUN/checkpoints/step_N)", dir.display())
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let n = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            n.starts_with("optim-") && n.ends_with(".safetensors")
        })
        .collect();
    files.sort();
    if files.is_empty() {
        bail!(
            "{} holds no optimizer shard (optim-*.safetensors)\nhint: pass a complete harpe checkpoint directory",
            dir.display()
        );
    }
    let sums = super::load_checksums(dir)?;
    let mut shards = Vec::with_capacity(files.len());
    for p in &files {
        let sum = sums.as_ref().map(|s| shard_sum(dir, p, s)).transpose()?;
        let mut shard = read_optim_shard(p)?;
        if let Some((sum, hint)) = sum {
            // the header's remaining blocks (block 0 was checked before parsing)
            let header_end = shard.offsets.iter().copied().min().unwrap_or(0) as u64;
            let more = sum.blocks_of(0..header_end).filter(|&b| b > 0);
            sum.verify_blocks(&shard.path, &shard.file, more, &hint)?;
            (shard.sum, shard.hint) = (Some(sum), hint);
        }
        shards.push(shard);
    }
    shards.sort_by_key(|s| (s.range.start, s.range.end));
    Ok(shards)
}

/// fp32 (master, m, v) of a flat range and the AdamW step count.
pub type Stitched = (Vec<f32>, Vec<f32>, Vec<f32>, u64);

/// The optimizer state of the flat range `want`, stitched from `shards` (any world size: re-sharding is
/// a slice computation). Replicated shards (ZeRO-0) may overlap: the first covering one is used. Refuses
/// a gap in the covered range, or shards at different AdamW steps.
pub fn stitch_optim(dir: &Path, shards: &[OptimShard], want: std::ops::Range<usize>) -> Result<Stitched> {
    let t = shards.first().map(|s| s.t).unwrap_or(0);
    if let Some(s) = shards.iter().find(|s| s.t != t) {
        bail!(
            "{}: {} is at optimizer step {} but {} at {t}\nhint: the checkpoint mixes shards of different saves; use another checkpoint",
            dir.display(),
            s.path.display(),
            s.t,
            shards[0].path.display()
        );
    }
    let (mut master, mut m, mut v) =
        (Vec::with_capacity(want.len()), Vec::with_capacity(want.len()), Vec::with_capacity(want.len()));
    let mut pos = want.start;
    for s in shards {
        if pos >= want.end {
            break;
        }
        if s.range.end <= pos {
            continue;
        }
        if s.range.start > pos {
            break; // a gap: reported below
        }
        let hi = s.range.end.min(want.end);
        let local = pos - s.range.start..hi - s.range.start;
        s.copy_into(OptimPart::Master, local.clone(), &mut master)?;
        s.copy_into(OptimPart::M, local.clone(), &mut m)?;
        s.copy_into(OptimPart::V, local, &mut v)?;
        pos = hi;
    }
    if pos < want.end {
        let end = shards.iter().map(|s| s.range.end).max().unwrap_or(0);
        bail!(
            "{}: the optimizer shards cover the flat parameters only up to {pos} of the needed {want:?} (shards end at {end})\nhint: the checkpoint is missing a shard, or the model has more parameters than the run that wrote it",
            dir.display()
        );
    }
    Ok((master, m, v, t))
}

/// This rank's optimizer state (the flat range `want`) from the shards of checkpoint `dir`, whatever
/// world size wrote them (the flat index space is the same; this rank takes its range). `mesh` only
/// names the rank in errors.
pub fn read_optim_range(dir: &Path, mesh: &Mesh, want: std::ops::Range<usize>) -> Result<Stitched> {
    let shards = read_optim_shards(dir)?;
    let total = shards.iter().map(|s| s.range.end).max().unwrap_or(0);
    if want.end > total {
        bail!(
            "{}: the optimizer shards hold {total} parameters, rank {} needs {want:?}\nhint: the model differs from the run that wrote the checkpoint",
            dir.display(),
            mesh.rank()
        );
    }
    stitch_optim(dir, &shards, want)
}

/// Load this rank's optimizer state into `optim` from the shards of checkpoint `dir` (`read_optim_range`
/// of its range).
pub fn load_optim(dir: &Path, mesh: &Mesh, optim: &mut AdamW) -> Result<()> {
    let (master, m, v, t) = read_optim_range(dir, mesh, optim.range())?;
    // restore moves the host values to the optimizer's placement (a host checkpoint resumes on a device)
    optim.restore(FlatBuf::from_vec(master), FlatBuf::from_vec(m), FlatBuf::from_vec(v), t)
}
