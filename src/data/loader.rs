//! Training loader over a prepared dataset: memory-mapped shards, deterministic shuffling, disjoint
//! rank slices, and an exact resume cursor.
//!
//! Use from `train`:
//! ```text
//! let mut l = Loader::open(dir, LoaderConfig { seq_len, shuffle: true, seed, rank, world_size })?;
//! let s = l.next_sequence()?;          // s.tokens.len() == seq_len; predict tokens 1..T from 0..T-1
//! state.data_cursor = l.cursor();      // store in the checkpoint; later: l.restore(&cursor)?
//! ```
//! Order: epoch `e` visits all `N` sequences in the order `perm_e` (identity without shuffle, else a
//! Fisher-Yates permutation seeded by (seed, e)); rank `r` of `W` takes positions `r, r+W, r+2W, ...`
//! of it, and the last `N mod W` positions of each epoch are skipped so every rank yields the same number.
//! The non-obvious decision: the cursor is (epoch, global position) rather than RNG state, because the
//! permutation is a pure function of (seed, epoch); that also makes a resume with another world size
//! exact whenever the global position is divisible by the new world size (it is refused otherwise).
//! Integrity: a shard whose manifest entry has block checksums is checked block by block the first time a
//! sequence in that block is read (the segment table, read whole at open, at open), so a damaged byte
//! stops the run naming the file and offset instead of training on it, and a rank reads nothing twice.
//! What this file does not do: batching, device transfer or document masks (the trainer builds those
//! from `Sequence::doc_starts`).
use anyhow::{bail, Context, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use std::path::Path;

use super::shard::{Manifest, Segment, DAMAGED_HINT};
use crate::checksum::FileSum;
use std::sync::atomic::{AtomicBool, Ordering};

/// How a rank reads the dataset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoaderConfig {
    /// must equal the dataset's `seq_len`
    pub seq_len: usize,
    /// shuffle sequences each epoch
    pub shuffle: bool,
    /// seed of the shuffle
    pub seed: u64,
    /// this data-parallel rank
    pub rank: usize,
    /// number of data-parallel ranks
    pub world_size: usize,
}

/// A range of positions of one sequence that come from one source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceSpan {
    /// source id (index into `Manifest::source_names`)
    pub source: u32,
    /// first position
    pub start: usize,
    /// one past the last position
    pub end: usize,
}

/// One training sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sequence {
    /// exactly `seq_len` token ids
    pub tokens: Vec<u32>,
    /// source spans tiling `0..seq_len` (adjacent pieces of different documents of one source are merged)
    pub sources: Vec<SourceSpan>,
    /// positions where a document starts (its separator token, if any)
    pub doc_starts: Vec<usize>,
    /// global index of this sequence in the dataset
    pub index: u64,
    /// epoch it was drawn in
    pub epoch: u64,
}

impl Sequence {
    /// Source id of the token at `target` (the one rule attributing a predicted token to a source:
    /// the span holding it; spans are sorted and tile the sequence). None outside every span.
    pub fn source_of(&self, target: usize) -> Option<u32> {
        let i = self.sources.partition_point(|s| s.end <= target);
        self.sources.get(i).filter(|s| s.start <= target).map(|s| s.source)
    }
}

/// Display name of a source id from `Manifest::source_names`: `source{id}` for an id without a name,
/// `unknown` for a token in no span.
pub fn source_name(names: &[String], id: Option<u32>) -> String {
    match id {
        Some(i) => names.get(i as usize).cloned().unwrap_or_else(|| format!("source{i}")),
        None => "unknown".to_string(),
    }
}

/// Where a rank is in the stream; stored in checkpoints.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    /// current epoch
    pub epoch: u64,
    /// global position in the epoch order of the next sequence this rank reads minus this rank's offset
    /// (= steps taken this epoch x world_size)
    pub position: u64,
    /// shuffle seed
    pub seed: u64,
    /// whether the order is shuffled
    pub shuffle: bool,
    /// world size the cursor was taken with
    pub world_size: usize,
    /// rank the cursor was taken from
    pub rank: usize,
    /// number of sequences of the dataset (a guard against resuming on another dataset)
    pub num_sequences: u64,
    /// sha256 of the first shard's tokens (a second guard)
    pub dataset_sha256: String,
}

/// One memory-mapped shard with its segment table (CSR by sequence).
struct Shard {
    tokens: memmap2::Mmap,
    /// the token file, for errors
    path: std::path::PathBuf,
    /// its block checksums (none in an older dataset) and which blocks were checked already
    sum: Option<(FileSum, Vec<AtomicBool>)>,
    segs: Vec<Segment>,
    /// `seg_off[s]..seg_off[s+1]` are the segments of sequence `s`
    seg_off: Vec<usize>,
}

/// Memory-mapped prepared dataset.
pub struct Loader {
    manifest: Manifest,
    cfg: LoaderConfig,
    shards: Vec<Shard>,
    /// first global sequence index of each shard
    shard_start: Vec<u64>,
    n: u64,
    epoch: u64,
    position: u64,
    perm: Vec<u64>,
}

impl Loader {
    /// Open `dir`, validate the manifest and shard sizes, and position at the start of epoch 0.
    pub fn open(dir: &Path, cfg: LoaderConfig) -> Result<Loader> {
        let manifest = Manifest::load(dir)?;
        if cfg.seq_len != manifest.seq_len {
            bail!(
                "{}: the dataset has seq_len {} but training asks for {}\nhint: prepare the data with --seq-len {} or \
                 set the run's seq_len to {}",
                dir.display(),
                manifest.seq_len,
                cfg.seq_len,
                cfg.seq_len,
                manifest.seq_len
            );
        }
        if cfg.world_size == 0 || cfg.rank >= cfg.world_size {
            bail!(
                "loader: rank {} is not in 0..world_size {}\nhint: check RANK / WORLD_SIZE",
                cfg.rank,
                cfg.world_size
            );
        }
        let mut shards = Vec::with_capacity(manifest.shards.len());
        let mut shard_start = Vec::with_capacity(manifest.shards.len());
        let mut n = 0u64;
        for info in &manifest.shards {
            let path = dir.join(&info.file);
            let f = std::fs::File::open(&path).with_context(|| {
                format!("cannot open shard {}\nhint: the dataset directory is incomplete", path.display())
            })?;
            // SAFETY: shards are written once (renamed into place) and never modified afterwards.
            let tokens = unsafe { memmap2::Mmap::map(&f) }.with_context(|| format!("cannot map {}", path.display()))?;
            // Checked: the manifest is user input (a corrupt count must be an error, not an overflow).
            let want = info.sequences.checked_mul(manifest.seq_len as u64).and_then(|t| t.checked_mul(4));
            if want != Some(tokens.len() as u64) {
                let want = want.map_or("more than 2^64".to_string(), |w| w.to_string());
                bail!(
                    "{}: {} bytes, the manifest says {} sequences x {} tokens x 4 = {want}\nhint: the shard is truncated or \
                     from another preparation; re-run prepare-data",
                    path.display(),
                    tokens.len(),
                    info.sequences,
                    manifest.seq_len
                );
            }
            let origin = format!("{}: shard {}", dir.join("manifest.json").display(), info.file);
            let sum = match &info.crc32c {
                Some(sum) => {
                    sum.validate(&origin, DAMAGED_HINT)?;
                    sum.check_len(&path, tokens.len() as u64, DAMAGED_HINT)?;
                    Some((sum.clone(), (0..sum.crc32c.len()).map(|_| AtomicBool::new(false)).collect()))
                }
                None => None,
            };
            let seg_path = dir.join(&info.segments_file);
            let bytes = std::fs::read(&seg_path).with_context(|| format!("cannot read {}", seg_path.display()))?;
            if let Some(ss) = &info.segments_crc32c {
                ss.validate(&origin, DAMAGED_HINT)?;
                ss.check_len(&seg_path, bytes.len() as u64, DAMAGED_HINT)?;
                for b in 0..ss.crc32c.len() {
                    let r = ss.block_range(b);
                    ss.check_block(&seg_path, b, &bytes[r.start as usize..r.end as usize], DAMAGED_HINT)?;
                }
            }
            let segs = Segment::parse_all(&bytes, &seg_path)?;
            let mut seg_off = vec![0usize; info.sequences as usize + 1];
            for s in &segs {
                if u64::from(s.seq) >= info.sequences {
                    bail!(
                        "{}: segment of sequence {} beyond {} sequences\nhint: re-run prepare-data",
                        seg_path.display(),
                        s.seq,
                        info.sequences
                    );
                }
                seg_off[s.seq as usize + 1] += 1;
            }
            for i in 0..info.sequences as usize {
                seg_off[i + 1] += seg_off[i];
            }
            shard_start.push(n);
            n += info.sequences;
            shards.push(Shard { tokens, path, sum, segs, seg_off });
        }
        if n < cfg.world_size as u64 {
            bail!(
                "{}: {n} sequences cannot feed {} ranks\nhint: prepare more data or use fewer ranks",
                dir.display(),
                cfg.world_size
            );
        }
        let mut l = Loader { manifest, cfg, shards, shard_start, n, epoch: 0, position: 0, perm: Vec::new() };
        l.set_epoch(0);
        Ok(l)
    }

    /// The dataset manifest (tokenizer hash, seq_len, sources, ...).
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Sequences this rank reads per epoch.
    pub fn sequences_per_epoch(&self) -> u64 {
        self.n / self.cfg.world_size as u64
    }

    fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.perm = if self.cfg.shuffle {
            let mut p: Vec<u64> = (0..self.n).collect();
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(self.cfg.seed);
            rng.set_stream(epoch);
            p.shuffle(&mut rng);
            p
        } else {
            Vec::new()
        };
    }

    /// Read global sequence `g` (in dataset order).
    pub fn get(&self, g: u64) -> Result<Sequence> {
        if g >= self.n {
            bail!("sequence {g} out of range (the dataset has {})\nhint: inspect-data shows the count", self.n);
        }
        let k = self.shard_start.partition_point(|&s| s <= g) - 1;
        let s = (g - self.shard_start[k]) as usize;
        let sh = &self.shards[k];
        let t = self.manifest.seq_len;
        let bytes = &sh.tokens[s * t * 4..(s + 1) * t * 4];
        if let Some((sum, checked)) = &sh.sum {
            for b in sum.blocks_of((s * t * 4) as u64..((s + 1) * t * 4) as u64) {
                if !checked[b].load(Ordering::Relaxed) {
                    let r = sum.block_range(b);
                    sum.check_block(&sh.path, b, &sh.tokens[r.start as usize..r.end as usize], DAMAGED_HINT)?;
                    checked[b].store(true, Ordering::Relaxed);
                }
            }
        }
        let tokens: Vec<u32> = bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let mut sources: Vec<SourceSpan> = Vec::new();
        let mut doc_starts = Vec::new();
        for seg in &sh.segs[sh.seg_off[s]..sh.seg_off[s + 1]] {
            let (start, end) = (seg.start as usize, (seg.start + seg.len) as usize);
            if seg.doc_start {
                doc_starts.push(start);
            }
            match sources.last_mut() {
                Some(last) if last.source == seg.source && last.end == start => last.end = end,
                _ => sources.push(SourceSpan { source: seg.source, start, end }),
            }
        }
        Ok(Sequence { tokens, sources, doc_starts, index: g, epoch: self.epoch })
    }

    /// The next sequence of this rank; wraps to the next epoch (with a new shuffle) at the end.
    pub fn next_sequence(&mut self) -> Result<Sequence> {
        let w = self.cfg.world_size as u64;
        if self.position + w > self.sequences_per_epoch() * w {
            self.set_epoch(self.epoch + 1);
            self.position = 0;
        }
        let pos = self.position + self.cfg.rank as u64;
        let g = if self.cfg.shuffle { self.perm[pos as usize] } else { pos };
        self.position += w;
        self.get(g)
    }

    /// The current position, for checkpoints.
    pub fn cursor(&self) -> Cursor {
        Cursor {
            epoch: self.epoch,
            position: self.position,
            seed: self.cfg.seed,
            shuffle: self.cfg.shuffle,
            world_size: self.cfg.world_size,
            rank: self.cfg.rank,
            num_sequences: self.n,
            dataset_sha256: self.manifest.shards.first().map(|s| s.sha256.clone()).unwrap_or_default(),
        }
    }

    /// Continue from a cursor taken by any rank of a run on the same dataset with the same seed and shuffle.
    /// A different world size is accepted when the cursor's position is divisible by it (then exact), else refused.
    pub fn restore(&mut self, c: &Cursor) -> Result<()> {
        let me = self.cursor();
        if c.num_sequences != me.num_sequences || c.dataset_sha256 != me.dataset_sha256 {
            bail!(
                "data cursor is from another dataset ({} sequences, first shard {}) than {} sequences, first shard {}\nhint: \
                 resume with the dataset the run was started with",
                c.num_sequences,
                c.dataset_sha256,
                me.num_sequences,
                me.dataset_sha256
            );
        }
        if c.seed != me.seed || c.shuffle != me.shuffle {
            bail!(
                "data cursor has seed {} shuffle {}, the loader seed {} shuffle {}\nhint: keep the data seed and shuffle of the run",
                c.seed,
                c.shuffle,
                me.seed,
                me.shuffle
            );
        }
        let w = self.cfg.world_size as u64;
        if c.world_size != self.cfg.world_size && !c.position.is_multiple_of(w) {
            bail!(
                "data cursor at global position {} of epoch {} (world size {}) cannot be continued exactly with world size {}\n\
                 hint: resume with world size {}, or with one that divides {}",
                c.position,
                c.epoch,
                c.world_size,
                w,
                c.world_size,
                c.position
            );
        }
        self.set_epoch(c.epoch);
        self.position = c.position;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_of_finds_the_span_holding_a_target() {
        let span = |source, start, end| SourceSpan { source, start, end };
        let seq = Sequence {
            tokens: vec![0; 10],
            sources: vec![span(2, 0, 3), span(0, 3, 4), span(1, 4, 10)],
            doc_starts: vec![0, 3, 4],
            index: 0,
            epoch: 0,
        };
        let got: Vec<Option<u32>> = (0..11).map(|t| seq.source_of(t)).collect();
        let s = Some;
        assert_eq!(got, [s(2), s(2), s(2), s(0), s(1), s(1), s(1), s(1), s(1), s(1), None]);
        let names = ["a".to_string(), "b".to_string()];
        assert_eq!(source_name(&names, Some(1)), "b");
        assert_eq!(source_name(&names, Some(2)), "source2");
        assert_eq!(source_name(&names, None), "unknown");
    }
}
