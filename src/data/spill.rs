//! Pass 1's token spill in `OUT/.work`: per input file its token ids (`.tok`, u32), a (len, local source)
//! index (`.idx`) and a summary JSON (`FileSummary`), which marks the file finished — the two binary
//! files are written as `.tmp` and renamed first, so a killed run resumes at file granularity. Pass 2
//! reads them back memory-mapped. Apart from the passes (`prepare.rs`), which only call these.
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::shard::{hist_bucket, BadLine, HIST_BUCKETS};

/// Pass-1 result for one input file (its JSON is the file's "finished" marker).
#[derive(Serialize, Deserialize, Default)]
pub(super) struct FileSummary {
    pub(super) docs: u64,
    /// local source id -> name
    pub(super) sources: Vec<String>,
    /// per local source: [docs, tokens, long_tokens]
    pub(super) counts: Vec<[u64; 3]>,
    /// per local source: document-length histogram
    pub(super) hist: Vec<Vec<u64>>,
    pub(super) bad_lines: u64,
    pub(super) bad_samples: Vec<BadLine>,
}

/// The spill of input `i` in `work`: (token ids, index, summary JSON).
pub(super) fn spill_paths(work: &Path, i: usize) -> (PathBuf, PathBuf, PathBuf) {
    (work.join(format!("f{i:06}.tok")), work.join(format!("f{i:06}.idx")), work.join(format!("f{i:06}.json")))
}

impl FileSummary {
    /// Count one document of `len` tokens from `source` (numbering a new source locally); its local id.
    pub(super) fn add_doc(
        &mut self,
        local: &mut BTreeMap<String, u32>,
        source: String,
        len: u64,
        threshold: u64,
    ) -> u32 {
        let next = local.len() as u32;
        let id = *local.entry(source.clone()).or_insert(next);
        if id == next {
            self.sources.push(source);
            self.counts.push([0; 3]);
            self.hist.push(vec![0; HIST_BUCKETS]);
        }
        let c = &mut self.counts[id as usize];
        c[0] += 1;
        c[1] += len;
        if len >= threshold {
            c[2] += len;
        }
        self.hist[id as usize][hist_bucket(len)] += 1;
        self.docs += 1;
        id
    }
}

/// One input's spill being written: token ids and the (len, local source) index, both as `.tmp` files
/// until `finish` renames them (a renamed pair plus the summary JSON is a finished file).
pub(super) struct SpillWriter {
    tok: BufWriter<std::fs::File>,
    idx: BufWriter<std::fs::File>,
    tok_tmp: PathBuf,
    idx_tmp: PathBuf,
    tok_path: PathBuf,
    idx_path: PathBuf,
}

impl SpillWriter {
    /// Open both `.tmp` files of one input's spill.
    pub(super) fn create(tok_path: PathBuf, idx_path: PathBuf) -> Result<Self> {
        let tmp = |p: &Path| {
            p.with_extension(format!("{}.tmp", p.extension().map(|e| e.to_string_lossy()).unwrap_or_default()))
        };
        let (tok_tmp, idx_tmp) = (tmp(&tok_path), tmp(&idx_path));
        let create = |p: &Path| {
            std::fs::File::create(p)
                .map(|f| BufWriter::with_capacity(1 << 20, f))
                .with_context(|| format!("cannot create {}\nhint: is the output directory writable?", p.display()))
        };
        let (tok, idx) = (create(&tok_tmp)?, create(&idx_tmp)?);
        Ok(SpillWriter { tok, idx, tok_tmp, idx_tmp, tok_path, idx_path })
    }

    /// Append one document: its ids, and its (len, local source id) index entry.
    pub(super) fn push(&mut self, ids: &[u32], id: u32) -> Result<()> {
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        self.tok
            .write_all(&bytes)
            .with_context(|| format!("writing {}\nhint: is the disk full?", self.tok_tmp.display()))?;
        let mut idx = self.idx.write_all(&(ids.len() as u32).to_le_bytes());
        idx = idx.and_then(|_| self.idx.write_all(&id.to_le_bytes()));
        idx.with_context(|| format!("writing the index beside {}\nhint: is the disk full?", self.tok_tmp.display()))?;
        Ok(())
    }

    /// Flush both files and rename them to their final names.
    pub(super) fn finish(self) -> Result<()> {
        for (w, tmp, fin) in [(self.tok, &self.tok_tmp, &self.tok_path), (self.idx, &self.idx_tmp, &self.idx_path)] {
            w.into_inner().with_context(|| format!("writing {} failed\nhint: is the disk full? free space and rerun the same command: finished shards are kept", tmp.display()))?;
            std::fs::rename(tmp, fin).with_context(|| format!("cannot rename {}", tmp.display()))?;
        }
        Ok(())
    }
}

/// Read the (len, local source) index of a spilled file.
pub(super) fn read_index(path: &Path) -> Result<Vec<(u32, u32)>> {
    let b =
        std::fs::read(path).with_context(|| format!("cannot read {}\nhint: re-run with --force", path.display()))?;
    Ok(b.chunks_exact(8)
        .map(|c| (u32::from_le_bytes([c[0], c[1], c[2], c[3]]), u32::from_le_bytes([c[4], c[5], c[6], c[7]])))
        .collect())
}
