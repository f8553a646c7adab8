//! Packing documents into fixed-length sequences and writing them as shards.
//!
//! Reference: Fu et al.'s writer concatenates tokenized documents and emits every full
//! chunk, splitting documents across chunk boundaries, with no padding. Differences: a sequence is
//! exactly `seq_len` tokens (the trainer predicts tokens 1..T from 0..T-1 inside it, instead of a separate
//! label token), and every sequence records its document pieces (source, start, length, doc start) so
//! training can report loss per source and mask across documents.
//! The non-obvious decision: shards are written to a temporary name and renamed, then a `.done` marker
//! with their hashes is written; a restarted run re-walks the same deterministic stream but skips writing
//! (and hashing) shards whose marker exists, so it produces the same bytes without redoing finished shards.
//! What this file does not do: choose documents (`mixture`).
use crate::checksum::{Summer, BLOCK_BYTES};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::shard::{hist_bucket, segments_file, shard_file, Segment, ShardInfo, SourceStats};

/// Marker of a finished shard (in the work directory).
#[derive(Serialize, Deserialize)]
struct ShardDone {
    info: ShardInfo,
}

/// A shard being written.
struct OpenShard {
    tokens: BufWriter<std::fs::File>,
    segs: BufWriter<std::fs::File>,
    tok_hash: Sha256,
    seg_hash: Sha256,
    tok_sum: Summer,
    seg_sum: Summer,
    tmp_tokens: PathBuf,
    tmp_segs: PathBuf,
}

/// A piece of a document waiting in the current sequence.
#[derive(Clone, Copy)]
struct Pending {
    seg: Segment,
    long: bool,
    /// original length of the document (for the output histogram)
    doc_len: u64,
}

/// Packs documents into sequences, writes shards, and counts per-source output.
pub struct Packer {
    dir: PathBuf,
    work: PathBuf,
    seq_len: usize,
    seqs_per_shard: u64,
    cur: Vec<u32>,
    pending: Vec<Pending>,
    shard: usize,
    seq_in_shard: u64,
    open: Option<OpenShard>,
    /// `true` while the current shard was already finished by an earlier run
    skipping: bool,
    /// finished shards
    pub shards: Vec<ShardInfo>,
    /// per-source output counters, indexed by source id
    pub stats: Vec<SourceStats>,
    /// sequences written (or skipped as already written)
    pub sequences: u64,
    /// called after every finished sequence
    pub on_sequence: Box<dyn FnMut()>,
}

impl Packer {
    /// A packer writing into `dir` (markers into `work`); `stats` carries the per-source input counts.
    pub fn new(dir: &Path, work: &Path, seq_len: usize, seqs_per_shard: u64, stats: Vec<SourceStats>) -> Self {
        Packer {
            dir: dir.to_path_buf(),
            work: work.to_path_buf(),
            seq_len,
            seqs_per_shard: seqs_per_shard.max(1),
            cur: Vec::with_capacity(seq_len),
            pending: Vec::new(),
            shard: 0,
            seq_in_shard: 0,
            open: None,
            skipping: false,
            shards: Vec::new(),
            stats,
            sequences: 0,
            on_sequence: Box::new(|| {}),
        }
    }

    /// Append one document's output tokens (separators included); `doc_len` is its original length.
    pub fn push_doc(&mut self, toks: &[u32], source: u32, long: bool, doc_len: u64) -> Result<()> {
        let mut rest = toks;
        let mut first = true;
        while !rest.is_empty() {
            let n = (self.seq_len - self.cur.len()).min(rest.len());
            let seg = Segment {
                seq: self.seq_in_shard as u32,
                start: self.cur.len() as u32,
                len: n as u32,
                source,
                doc_start: first,
            };
            self.pending.push(Pending { seg, long, doc_len });
            self.cur.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
            first = false;
            if self.cur.len() == self.seq_len {
                self.emit()?;
            }
        }
        Ok(())
    }

    fn done_marker(&self, k: usize) -> PathBuf {
        self.work.join(format!("shard_{k:05}.done"))
    }

    fn start_shard(&mut self) -> Result<()> {
        let marker = self.done_marker(self.shard);
        if marker.is_file() && self.dir.join(shard_file(self.shard)).is_file() {
            let text = std::fs::read_to_string(&marker).with_context(|| format!("cannot read {}", marker.display()))?;
            if let Ok(done) = serde_json::from_str::<ShardDone>(&text) {
                self.skipping = true;
                self.shards.push(done.info);
                return Ok(());
            }
        }
        self.skipping = false;
        let tmp_tokens = self.dir.join(format!("{}.tmp", shard_file(self.shard)));
        let tmp_segs = self.dir.join(format!("{}.tmp", segments_file(self.shard)));
        let create = |p: &Path| {
            std::fs::File::create(p)
                .map(|f| BufWriter::with_capacity(1 << 20, f))
                .with_context(|| format!("cannot create {}\nhint: is the output directory writable?", p.display()))
        };
        self.open = Some(OpenShard {
            tokens: create(&tmp_tokens)?,
            segs: create(&tmp_segs)?,
            tok_hash: Sha256::new(),
            seg_hash: Sha256::new(),
            tok_sum: Summer::new(BLOCK_BYTES),
            seg_sum: Summer::new(BLOCK_BYTES),
            tmp_tokens,
            tmp_segs,
        });
        Ok(())
    }

    fn emit(&mut self) -> Result<()> {
        if self.seq_in_shard == 0 {
            self.start_shard()?;
        }
        for p in &self.pending {
            let st = &mut self.stats[p.seg.source as usize];
            st.tokens_out += u64::from(p.seg.len);
            if p.long {
                st.long_tokens_out += u64::from(p.seg.len);
            }
            if p.seg.doc_start {
                st.docs_out += 1;
                st.hist_out[hist_bucket(p.doc_len)] += 1;
            }
        }
        if let Some(o) = self.open.as_mut() {
            let bytes: Vec<u8> = self.cur.iter().flat_map(|t| t.to_le_bytes()).collect();
            o.tok_hash.update(&bytes);
            o.tok_sum.update(&bytes);
            o.tokens
                .write_all(&bytes)
                .with_context(|| format!("writing {}\nhint: is the disk full?", o.tmp_tokens.display()))?;
            for p in &self.pending {
                let rec = p.seg.to_le_bytes();
                o.seg_hash.update(rec);
                o.seg_sum.update(&rec);
                o.segs
                    .write_all(&rec)
                    .with_context(|| format!("writing {}\nhint: is the disk full?", o.tmp_segs.display()))?;
            }
        }
        self.cur.clear();
        self.pending.clear();
        self.seq_in_shard += 1;
        self.sequences += 1;
        (self.on_sequence)();
        if self.seq_in_shard == self.seqs_per_shard {
            self.finish_shard()?;
        }
        Ok(())
    }

    fn finish_shard(&mut self) -> Result<()> {
        if self.seq_in_shard == 0 {
            return Ok(());
        }
        if let Some(o) = self.open.take() {
            let OpenShard { tokens, segs, tok_hash, seg_hash, tok_sum, seg_sum, tmp_tokens, tmp_segs } = o;
            for (w, tmp) in [(tokens, &tmp_tokens), (segs, &tmp_segs)] {
                let f = w.into_inner().with_context(|| format!("writing {} failed\nhint: is the disk full? free space and rerun the same command: finished shards are kept", tmp.display()))?;
                f.sync_all().with_context(|| format!("fsync {} failed\nhint: is the disk full? free space and rerun the same command: finished shards are kept", tmp.display()))?;
            }
            let info = ShardInfo {
                file: shard_file(self.shard),
                segments_file: segments_file(self.shard),
                sequences: self.seq_in_shard,
                sha256: hex::encode(tok_hash.finalize()),
                segments_sha256: hex::encode(seg_hash.finalize()),
                crc32c: Some(tok_sum.finish()),
                segments_crc32c: Some(seg_sum.finish()),
            };
            for (tmp, name) in [(&tmp_tokens, &info.file), (&tmp_segs, &info.segments_file)] {
                std::fs::rename(tmp, self.dir.join(name))
                    .with_context(|| format!("cannot rename {}", tmp.display()))?;
            }
            let marker = serde_json::to_vec(&ShardDone { info: info.clone() })?;
            crate::util::write_atomic(&self.done_marker(self.shard), &marker)?;
            self.shards.push(info);
        }
        self.shard += 1;
        self.seq_in_shard = 0;
        Ok(())
    }

    /// Close the last shard; returns the number of tokens dropped from the final partial sequence.
    pub fn finish(mut self) -> Result<(Vec<ShardInfo>, Vec<SourceStats>, u64)> {
        let dropped = self.cur.len() as u64;
        self.finish_shard()?;
        Ok((self.shards, self.stats, dropped))
    }
}
