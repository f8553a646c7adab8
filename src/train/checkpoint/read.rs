//! Reading a checkpoint's optimizer shards back: each resuming rank reads only the bytes of its own flat
//! range from the shards of whatever world size wrote them (`OptimShard`, `stitch_optim`,
//! `read_optim_range`), with positional reads rather than a memory map (`OptimShard` says why).
//!
//! A resume may use another world size than the run that wrote the checkpoint, so the shards are re-cut.
//! Split from checkpoint/mod.rs, which writes what this reads.

use crate::checksum::{self, Checksums, FileSum};
use crate::comms::Mesh;
use crate::flatbuf::FlatBuf;
use crate::optim::adamw::AdamW;
use anyhow::{anyhow, bail, Context, Result};
use std::path::{Path, PathBuf};

/// One rank's optimizer shard file: its flat range, AdamW step count and where its fp32 (master, m, v)
/// lie in the file. A resuming rank reads only the elements of its own range (`stitch_optim`), so
/// resuming N ranks reads each file's bytes about once in all, not N times into every rank's memory;
/// it reads them with positional reads in pieces of `READ_PIECE_BYTES`, not through a memory map,
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
    /// the blocks that hold the file's header (the safetensors header and the metadata with `range`
    /// and `t`): checked with the first values a reader takes from this file, so a rank that uses the
    /// file trusts its header only once it is checked, and a rank that does not use it never reads it
    header_blocks: std::ops::Range<usize>,
}

/// Bytes per positional read of a shard's values: pieces small enough to be hashed and converted while
/// still in the core's cache (`checksum::PIECE_BYTES`).
const READ_PIECE_BYTES: u64 = checksum::PIECE_BYTES;

/// The hint of a read error in a shard without checksums.
const READ_HINT: &str = "the file is damaged or truncated";

/// Little-endian f32 values from bytes that arrive in pieces (a value may straddle two pieces when
/// a range does not start on a piece's 4-byte grid; never in a file harpe wrote, whose data is
/// 4-aligned, but a reader does not rely on it).
#[derive(Default)]
struct LeF32 {
    part: [u8; 4],
    have: usize,
}

impl LeF32 {
    fn push(&mut self, mut bytes: &[u8], out: &mut Vec<f32>) {
        if self.have > 0 {
            let take = (4 - self.have).min(bytes.len());
            self.part[self.have..self.have + take].copy_from_slice(&bytes[..take]);
            (self.have, bytes) = (self.have + take, &bytes[take..]);
            if self.have < 4 {
                return;
            }
            out.push(f32::from_le_bytes(self.part));
            self.have = 0;
        }
        let whole = bytes.len() / 4 * 4;
        out.extend(bytes[..whole].chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        let rest = &bytes[whole..];
        self.part[..rest.len()].copy_from_slice(rest);
        self.have = rest.len();
    }
}

impl OptimShard {
    /// Append the (master, m, v) values at positions `local` (relative to `range.start`) to `outs`, in
    /// one pass over the file: with checksums, every block holding any of those bytes, and the blocks
    /// of the header their positions came from, is read whole, once (a block where one tensor ends and
    /// the next begins serves both), and checked; a damaged block's values are taken back out of `outs`
    /// before the error returns, so nothing unchecked is kept.
    pub fn copy_range(&self, local: std::ops::Range<usize>, mut outs: [&mut Vec<f32>; 3]) -> Result<()> {
        let want = self.offsets.map(|o| (o + 4 * local.start) as u64..(o + 4 * local.end) as u64);
        for o in outs.iter_mut() {
            o.reserve(local.len());
        }
        let mut buf = vec![0u8; READ_PIECE_BYTES as usize];
        let mut values: [LeF32; 3] = Default::default();
        // append the values of a piece's bytes that lie in `want[k]` to `outs[k]`
        let mut take = |outs: &mut [&mut Vec<f32>; 3], at: u64, piece: &[u8]| {
            let hi = at + piece.len() as u64;
            for k in 0..3 {
                let (lo, up) = (at.max(want[k].start), hi.min(want[k].end));
                if lo < up {
                    values[k].push(&piece[(lo - at) as usize..(up - at) as usize], outs[k]);
                }
            }
        };
        let file = (&self.file, self.path.as_path());
        let Some(s) = &self.sum else {
            // an older checkpoint without checksums: just the values
            for w in &want {
                checksum::read_pieces(file, w.clone(), &mut buf, READ_HINT, |at, p| take(&mut outs, at, p))?;
            }
            return Ok(());
        };
        let mut blocks: Vec<usize> =
            want.iter().flat_map(|w| s.blocks_of(w.clone())).chain(self.header_blocks.clone()).collect();
        blocks.sort_unstable();
        blocks.dedup();
        for b in blocks {
            let marks = outs.each_ref().map(|o| o.len());
            if let Err(e) = s.read_block(file, b, &mut buf, &self.hint, |at, p| take(&mut outs, at, p)) {
                for (o, m) in outs.iter_mut().zip(marks) {
                    o.truncate(m);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Attach the file's checksums (`hint` ends a mismatch's error).
    fn with_sum(mut self, sum: FileSum, hint: String) -> OptimShard {
        let header_end = self.offsets.iter().copied().min().unwrap_or(0) as u64;
        self.header_blocks = sum.blocks_of(0..header_end.max(1));
        (self.sum, self.hint) = (Some(sum), hint);
        self
    }

    /// Check the blocks of the file's header; run before an error that its `range` or `t` led to, so
    /// that damage is reported as damage.
    pub fn verify_header(&self) -> Result<()> {
        match &self.sum {
            Some(s) => s.verify_blocks(&self.path, &self.file, self.header_blocks.clone(), &self.hint),
            None => Ok(()),
        }
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
    Ok(OptimShard {
        path: p.to_path_buf(),
        range,
        t,
        file: f,
        offsets,
        sum: None,
        hint: String::new(),
        header_blocks: 0..0,
    })
}

/// The checksums of optimizer shard `p` in `sums` (of checkpoint `dir`) and the hint of a mismatch,
/// after checking the file's length (its blocks are checked as they are read: `copy_range`).
fn shard_sum(dir: &Path, p: &Path, sums: &Checksums) -> Result<(FileSum, String)> {
    let hint = super::damage_hint(dir);
    let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let sum = sums.files.get(&name).ok_or_else(|| {
        anyhow!("{}: not listed in {}\nhint: {hint}", p.display(), dir.join(super::CHECKSUMS).display())
    })?;
    let len = std::fs::metadata(p).with_context(|| format!("cannot stat {}\nhint: {hint}", p.display()))?.len();
    sum.check_len(p, len, &hint)?;
    Ok((sum.clone(), hint))
}

/// Check the headers of `shards` (`verify_header`), then return `err`.
fn refuse<T>(shards: &[OptimShard], err: anyhow::Error) -> Result<T> {
    for s in shards {
        s.verify_header()?;
    }
    Err(err)
}

/// Every optimizer shard of checkpoint `dir`, ordered by the start of its range.
pub fn read_optim_shards(dir: &Path) -> Result<Vec<OptimShard>> {
    let files = crate::util::sorted_entries(dir, "hint: pass a checkpoint directory (RUN/checkpoints/step_N)", |p| {
        let n = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        n.starts_with("optim-") && n.ends_with(".safetensors")
    })?;
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
        // The header is parsed before it is checked: which files a rank needs comes from their headers,
        // and reading every file's first block on every rank would cost N x 8 MiB per rank. A file a
        // rank takes values from has its header checked with them (`copy_range`); an error that a
        // header led to checks it first (`refuse`); a header that does not parse checks the file.
        let shard = match (read_optim_shard(p), sum) {
            (Ok(shard), Some((sum, hint))) => shard.with_sum(sum, hint),
            (Ok(shard), None) => shard,
            (Err(e), Some((sum, hint))) => {
                sum.verify_file(p, &hint)?;
                return Err(e);
            }
            (Err(e), None) => return Err(e),
        };
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
        return refuse(shards, anyhow!(
            "{}: {} is at optimizer step {} but {} at {t}\nhint: the checkpoint mixes shards of different saves; use another checkpoint",
            dir.display(),
            s.path.display(),
            s.t,
            shards[0].path.display()
        ));
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
        s.copy_range(local, [&mut master, &mut m, &mut v])?;
        pos = hi;
    }
    if pos < want.end {
        let end = shards.iter().map(|s| s.range.end).max().unwrap_or(0);
        return refuse(shards, anyhow!(
            "{}: the optimizer shards cover the flat parameters only up to {pos} of the needed {want:?} (shards end at {end})\nhint: the checkpoint is missing a shard, or the model has more parameters than the run that wrote it",
            dir.display()
        ));
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
        return refuse(&shards, anyhow!(
            "{}: the optimizer shards hold {total} parameters, rank {} needs {want:?}\nhint: the model differs from the run that wrote the checkpoint",
            dir.display(),
            mesh.rank()
        ));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum::Summer;
    use crate::model::weights::{write_safetensors_summed, StreamSrc};
    use std::collections::HashMap;

    /// An optimizer shard of `n` values per tensor, its values, and the sums of its bytes in blocks of
    /// `block` bytes (smaller than the product's, so a small file spans many blocks).
    fn shard(dir: &Path, n: usize, block: u64) -> (PathBuf, [Vec<f32>; 3], FileSum) {
        let vals: [Vec<f32>; 3] = std::array::from_fn(|k| (0..n).map(|i| (i * 3 + k) as f32 * 0.25 - 7.0).collect());
        let bufs: Vec<FlatBuf> = vals.iter().map(|v| FlatBuf::from_vec(v.clone())).collect();
        let srcs: Vec<(String, StreamSrc)> =
            ["master", "m", "v"].iter().zip(&bufs).map(|(k, b)| (k.to_string(), StreamSrc::Flat(b))).collect();
        let info = serde_json::json!({"format": super::super::FORMAT, "t": 3, "range_start": 10, "range_end": 10 + n});
        let meta: HashMap<String, String> = [("harpe_optim".to_string(), info.to_string())].into();
        let p = dir.join("optim-00000-of-00001.safetensors");
        write_safetensors_summed(&p, &srcs, Some(meta), 4096).unwrap();
        let mut s = Summer::new(block);
        s.update(&std::fs::read(&p).unwrap());
        (p, vals, s.finish())
    }

    fn read(sh: &OptimShard, local: std::ops::Range<usize>) -> Result<[Vec<f32>; 3]> {
        let (mut a, mut b, mut c) = (vec![], vec![], vec![]);
        sh.copy_range(local, [&mut a, &mut b, &mut c]).map(|_| [a, b, c])
    }

    #[test]
    fn one_pass_reads_every_range_of_all_three_tensors_and_keeps_nothing_of_a_damaged_block() {
        let d = tempfile::tempdir().unwrap();
        let n = 20_000; // 80 KB per tensor: ~60 blocks of 4 KiB, several pieces
        let (p, vals, sum) = shard(d.path(), n, 4096);
        let open = |sum: Option<FileSum>| {
            let sh = read_optim_shard(&p).unwrap();
            assert_eq!((sh.range.clone(), sh.t), (10..10 + n, 3));
            match sum {
                Some(sum) => sh.with_sum(sum, "use another".into()),
                None => sh,
            }
        };
        let (plain, summed) = (open(None), open(Some(sum.clone())));
        for local in [0..n, 0..1, 1..2, 1023..1025, 5..n - 3, n - 1..n, 7..7] {
            let want: [Vec<f32>; 3] = std::array::from_fn(|k| vals[k][local.clone()].to_vec());
            assert_eq!(read(&plain, local.clone()).unwrap(), want, "{local:?} without checksums");
            assert_eq!(read(&summed, local.clone()).unwrap(), want, "{local:?} with checksums");
        }
        // one flipped bit in the middle of `m`: a range that does not touch its block still reads
        let m_at = summed.offsets[1] + 4 * (n / 2);
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[m_at + 1] ^= 0x10;
        std::fs::write(&p, &bytes).unwrap();
        let summed = open(Some(sum.clone()));
        let bad = m_at as u64 / 4096;
        assert_eq!(read(&summed, 0..100).unwrap()[1], vals[1][..100]);
        let (mut a, mut b, mut c) = (vec![], vec![], vec![]);
        let e = format!("{:#}", summed.copy_range(0..n, [&mut a, &mut b, &mut c]).unwrap_err());
        assert!(e.contains(&format!("bytes {}..{} (block {bad}) are damaged", bad * 4096, (bad + 1) * 4096)), "{e}");
        assert!(e.ends_with("hint: use another"), "{e}");
        // what was kept is exactly the values of the blocks before the damaged one
        let before = bad * 4096;
        for (k, o) in [a, b, c].iter().enumerate() {
            let off = summed.offsets[k] as u64;
            let whole = (before.saturating_sub(off) / 4).min(n as u64) as usize;
            assert_eq!(o.len(), whole, "tensor {k}");
            assert_eq!(o[..], vals[k][..whole], "tensor {k}");
        }
        // without checksums the same damage goes through (an older checkpoint's reader)
        assert_ne!(read(&open(None), 0..n).unwrap()[1], vals[1]);
    }

    #[test]
    fn a_damaged_header_is_found_by_a_rank_that_reads_no_value_of_its_block() {
        let d = tempfile::tempdir().unwrap();
        let n = 20_000;
        let (p, vals, sum) = shard(d.path(), n, 4096);
        let mut sums = Checksums::new();
        sums.files.insert("optim-00000-of-00001.safetensors".into(), sum);
        std::fs::write(d.path().join(super::super::CHECKSUMS), serde_json::to_string(&sums).unwrap()).unwrap();
        let last = 10 + n - 1..10 + n; // flat positions: the shard holds 10..10 + n
        let shards = read_optim_shards(d.path()).unwrap();
        assert_eq!(stitch_optim(d.path(), &shards, last.clone()).unwrap().0, [vals[0][n - 1]]);
        let clean = std::fs::read(&p).unwrap();
        let at = |needle: &str| clean.windows(needle.len()).position(|w| w == needle.as_bytes()).unwrap();
        // the step count 3 -> 7: still a valid header, so only its checksum tells
        let mut bytes = clean.clone();
        bytes[at("\\\"t\\\":3") + 6] ^= 0x04;
        std::fs::write(&p, &bytes).unwrap();
        let shards = read_optim_shards(d.path()).unwrap();
        assert_eq!(shards[0].t, 7);
        let e = format!("{:#}", stitch_optim(d.path(), &shards, last).unwrap_err());
        assert!(e.contains("bytes 0..4096 (block 0) are damaged"), "{e}");
        // a header that no longer parses is reported as damage, not as a malformed file
        let mut bytes = clean.clone();
        bytes[at("harpe_optim")] ^= 0x20;
        std::fs::write(&p, &bytes).unwrap();
        let e = format!("{:#}", read_optim_shards(d.path()).err().unwrap());
        assert!(e.contains("(block 0) are damaged"), "{e}");
    }

    #[test]
    fn values_split_across_pieces_are_joined() {
        let vals: Vec<f32> = (0..9).map(|i| i as f32 - 3.5).collect();
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        for cuts in [vec![1usize, 2, 3, 30], vec![5, 6, 7], vec![3, 4, 11, 35]] {
            let (mut dec, mut out, mut at) = (LeF32::default(), vec![], 0);
            for c in cuts.into_iter().chain([bytes.len()]) {
                dec.push(&bytes[at..c.max(at)], &mut out);
                at = c.max(at);
            }
            assert_eq!(out, vals);
        }
    }
}
