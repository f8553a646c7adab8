//! The prepared-dataset format: `manifest.json`, token shards and segment tables.
//!
//! Layout of a dataset directory:
//! - `manifest.json` — [`Manifest`]: format tag + version, tokenizer hash, sequence length, strategy,
//!   per-source counts before/after, shard list with sha256. Written last and atomically, so a
//!   directory without it is an unfinished preparation.
//! - `shard_NNNNN.bin` — little-endian `u32` token ids, `sequences x seq_len`, no header:
//!   `np.fromfile("shard_00000.bin", dtype="<u4").reshape(-1, seq_len)`.
//! - `shard_NNNNN.seg` — little-endian `u32` records of 5 fields, one per contiguous piece of one
//!   document inside one sequence: `[sequence_in_shard, start, len, source_id, flags]`, flags bit 0 =
//!   the piece starts its document. Sorted by (sequence, start); pieces of a sequence tile it exactly.
//! - `tokenizer.json` — a copy of the tokenizer used, so `inspect-data` can decode without the model.
//!
//! The non-obvious decision: the format lives in the manifest (tag + version), not in a shard header,
//! so shards stay plain arrays anyone can memory-map. What this file does not do: choose or pack
//! documents (`mixture`, `pack`), or serve batches (`loader`).
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

use super::mixture::StrategyParams;
use super::tokenize::Separator;
use crate::checksum::FileSum;

/// Value of `Manifest::format`.
pub const FORMAT: &str = "harpe-dataset";
/// Current `Manifest::version`.
pub const VERSION: u32 = 1;
/// Number of `u32` fields per segment record in a `.seg` file.
pub const SEG_FIELDS: usize = 5;
/// Number of log2 buckets of the document-length histograms (bucket i = [2^i, 2^(i+1)) tokens).
pub const HIST_BUCKETS: usize = 24;

/// File name of shard `k`'s tokens.
pub fn shard_file(k: usize) -> String {
    format!("shard_{k:05}.bin")
}

/// File name of shard `k`'s segment table.
pub fn segments_file(k: usize) -> String {
    format!("shard_{k:05}.seg")
}

/// Log2 histogram bucket of a document length.
pub fn hist_bucket(len: u64) -> usize {
    (63 - len.max(1).leading_zeros() as usize).min(HIST_BUCKETS - 1)
}

/// One contiguous piece of one document inside one sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// sequence index inside its shard
    pub seq: u32,
    /// first token position inside the sequence
    pub start: u32,
    /// number of tokens
    pub len: u32,
    /// index into `Manifest::source_names`
    pub source: u32,
    /// true when this piece holds the first token of its document (its separator, if any)
    pub doc_start: bool,
}

impl Segment {
    /// The 5 little-endian `u32` fields of the on-disk record.
    pub fn to_le_bytes(&self) -> [u8; 4 * SEG_FIELDS] {
        let mut out = [0u8; 4 * SEG_FIELDS];
        let fields = [self.seq, self.start, self.len, self.source, u32::from(self.doc_start)];
        for (i, f) in fields.iter().enumerate() {
            out[4 * i..4 * i + 4].copy_from_slice(&f.to_le_bytes());
        }
        out
    }

    /// Parse a segment table file (the whole `.seg` contents).
    pub fn parse_all(bytes: &[u8], path: &Path) -> Result<Vec<Segment>> {
        if !bytes.len().is_multiple_of(4 * SEG_FIELDS) {
            bail!(
                "{}: {} bytes is not a whole number of {}-byte segment records\nhint: the file is truncated; \
                 re-run prepare-data into a fresh directory",
                path.display(),
                bytes.len(),
                4 * SEG_FIELDS
            );
        }
        let word = |c: &[u8], i: usize| u32::from_le_bytes([c[4 * i], c[4 * i + 1], c[4 * i + 2], c[4 * i + 3]]);
        Ok(bytes
            .chunks_exact(4 * SEG_FIELDS)
            .map(|c| Segment {
                seq: word(c, 0),
                start: word(c, 1),
                len: word(c, 2),
                source: word(c, 3),
                doc_start: word(c, 4) & 1 == 1,
            })
            .collect())
    }
}

/// Per-source counts before (`_in`) and after (`_out`) the strategy.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct SourceStats {
    /// id used in segment tables (index into `Manifest::source_names`)
    pub id: u32,
    /// documents read
    pub docs_in: u64,
    /// tokens read (document tokens, separators not included)
    pub tokens_in: u64,
    /// tokens of documents with at least `threshold` tokens
    pub long_tokens_in: u64,
    /// documents whose first token is in the output
    pub docs_out: u64,
    /// output tokens (separators included), after the final partial sequence was dropped
    pub tokens_out: u64,
    /// output tokens that come from long documents
    pub long_tokens_out: u64,
    /// `long_tokens_in / tokens_in`
    pub long_token_share_in: f64,
    /// `long_tokens_out / tokens_out`
    pub long_token_share_out: f64,
    /// the source's share of the output the strategy aimed at (null for global strategies)
    pub target_share: Option<f64>,
    /// the source's token budget (null for global strategies)
    pub budget: Option<u64>,
    /// short documents added after the sampling pass because the source ran out
    pub topped_up_docs: u64,
    /// tokens of those documents
    pub topped_up_tokens: u64,
    /// budget minus tokens selected when even all documents of the source were not enough
    pub shortfall_tokens: u64,
    /// document-length histogram of the input (log2 buckets, see `HIST_BUCKETS`)
    pub hist_in: Vec<u64>,
    /// the same histogram over the documents selected (by original length)
    pub hist_out: Vec<u64>,
}

/// One malformed input record.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BadLine {
    /// input file
    pub file: String,
    /// 1-based line number (0 when the problem is the file itself)
    pub line: u64,
    /// what was wrong
    pub reason: String,
}

/// One shard of the dataset.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ShardInfo {
    /// token file name, relative to the dataset directory
    pub file: String,
    /// segment table file name
    pub segments_file: String,
    /// number of sequences
    pub sequences: u64,
    /// sha256 of the token file
    pub sha256: String,
    /// sha256 of the segment table
    pub segments_sha256: String,
    /// block checksums of the token file (`checksum::FileSum`), checked by the loader block by block as
    /// it reads; absent in a dataset prepared before harpe recorded them
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32c: Option<FileSum>,
    /// block checksums of the segment table
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segments_crc32c: Option<FileSum>,
}

/// The hint of a damaged shard.
pub const DAMAGED_HINT: &str = "the dataset is damaged; `harpe verify DIR` lists every damaged block; re-run prepare-data into a fresh directory or restore the dataset from a copy";

impl ShardInfo {
    /// Check both files of this shard in dataset `dir` whole: block checksums when recorded, else the
    /// sha256 (what `inspect-data --verify` and `harpe verify` run).
    pub fn verify(&self, dir: &Path) -> Result<()> {
        for (file, sum, sha) in [
            (&self.file, &self.crc32c, &self.sha256),
            (&self.segments_file, &self.segments_crc32c, &self.segments_sha256),
        ] {
            let p = dir.join(file);
            match sum {
                Some(sum) => {
                    sum.validate(&format!("{}: shard {file}", dir.join("manifest.json").display()), DAMAGED_HINT)?;
                    sum.verify_file(&p, DAMAGED_HINT)?
                }
                None => {
                    let got = crate::util::sha256_file(&p)?;
                    if &got != sha {
                        bail!("{}: sha256 {got} differs from the manifest's {sha}\nhint: {DAMAGED_HINT}", p.display());
                    }
                }
            }
        }
        Ok(())
    }
}

/// `manifest.json` of a prepared dataset.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    /// always `harpe-dataset`
    pub format: String,
    /// format version, `VERSION`
    pub version: u32,
    /// tokens per sequence
    pub seq_len: usize,
    /// strategy and all its parameters
    pub strategy: StrategyParams,
    /// seed of every random choice
    pub seed: u64,
    /// sha256 of the tokenizer.json bytes
    pub tokenizer_sha256: String,
    /// document separator policy
    pub separator: Separator,
    /// id of the BOS token, when the separator uses it
    pub bos_id: Option<u32>,
    /// id of the EOS token, when the separator uses it
    pub eos_id: Option<u32>,
    /// source names, in id order
    pub source_names: Vec<String>,
    /// per-source statistics, by name
    pub sources: BTreeMap<String, SourceStats>,
    /// input files (in reading order) and how many of them were read before the budgets were full
    pub inputs: Vec<String>,
    /// number of input files actually read
    pub inputs_read: usize,
    /// malformed records seen (all of them were skipped and are counted here)
    pub bad_lines: u64,
    /// the first malformed records, for the report
    pub bad_line_samples: Vec<BadLine>,
    /// tokens of the final partial sequence, dropped because sequences are never padded
    pub tail_tokens_dropped: u64,
    /// total sequences over all shards
    pub num_sequences: u64,
    /// shards in order
    pub shards: Vec<ShardInfo>,
    /// human-readable notes (top-ups, shortfalls); empty when nothing unusual happened
    pub notes: Vec<String>,
}

impl Manifest {
    /// Read and validate `dir/manifest.json`.
    pub fn load(dir: &Path) -> Result<Manifest> {
        let path = dir.join("manifest.json");
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "cannot read {}\nhint: is this a dataset written by `harpe prepare-data`? An unfinished run has no manifest yet",
                path.display()
            )
        })?;
        let m: Manifest = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a valid dataset manifest\nhint: re-run prepare-data", path.display()))?;
        if m.format != FORMAT || m.version != VERSION {
            bail!(
                "{}: format {:?} version {} is not supported (expected {FORMAT:?} version {VERSION})\nhint: re-run \
                 prepare-data with this harpe version",
                path.display(),
                m.format,
                m.version
            );
        }
        if m.seq_len == 0 {
            bail!("{}: field seq_len is 0\nhint: the manifest is corrupt; re-run prepare-data", path.display());
        }
        Ok(m)
    }

    /// Total output tokens over all sources.
    pub fn tokens_out(&self) -> u64 {
        self.num_sequences * self.seq_len as u64
    }
}
