//! `harpe prepare-data`: read a corpus, tokenize in parallel, apply a length/mixture strategy, pack,
//! and write a prepared dataset — streaming, deterministic from the seed, resumable.
//!
//! Reference: Fu et al. 2024. Two passes over a work directory `OUT/.work`:
//! 1. read + tokenize every input file (order-preserving rayon batches; a reader thread decompresses
//!    ahead) into a per-file token spill, marked finished by its summary JSON. When every budget is known
//!    in advance (global strategies, or given source weights) reading stops once the budgets are full.
//! 2. plan (sampling pass, then top-up of short sources) and pack from the memory-mapped spills into shards.
//!
//! `prepare_inner` reads as those steps: `open_output`, `pass1`, `input_stats`, `plan`, `pack`, `manifest`.
//!
//! The non-obvious decision: the spill makes default target shares ("each source's share of the input
//! tokens read") exact without tokenizing twice, and makes a killed run resumable at file granularity
//! in pass 1 and shard granularity in pass 2; the bytes are identical because every choice depends only
//! on (seed, file index, document index). Disk use of the spill: 8 bytes per input token at most
//! (4 for the token + the index), removed at the end unless `--keep-work`.
//! Not here: the command's flags and `data.toml` (`prepare_args.rs`), the spill's files (`spill.rs`).
//! What this file does not do: serve training batches (`loader`).
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::mixture::{DocInfo, Selector, StrategyKind, StrategyParams, Weights};
use super::pack::Packer;
use super::shard::ShardInfo;
use super::shard::{BadLine, Manifest, SourceStats, FORMAT, HIST_BUCKETS, VERSION};
use super::source::{parse_record, read_batches, Fields, InputFile, InputKind, DEFAULT_SOURCE_FIELD};
use super::spill::{read_index, spill_paths, FileSummary, SpillWriter};
use super::tokenize::{load_tokenizer, tokenizer_sha256, Encoder, SepTokens, Separator};

/// Bad-line samples kept in the manifest.
const MAX_BAD_SAMPLES: usize = 100;

/// Settings of one preparation (everything except the inputs, the tokenizer and the output directory).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrepareOptions {
    /// tokens per sequence
    pub seq_len: usize,
    /// strategy and its parameters
    pub strategy: StrategyParams,
    /// seed of every random choice
    pub seed: u64,
    /// document separator policy
    pub separator: Separator,
    /// BOS token spelling (None: the usual ones)
    pub bos_token: Option<String>,
    /// EOS token spelling (None: the usual ones)
    pub eos_token: Option<String>,
    /// dotted path of the text field in jsonl records
    pub text_field: String,
    /// dotted path of the source field in jsonl records
    pub source_field: String,
    /// source of plain text files and of jsonl records without a source field
    pub default_source: Option<String>,
    /// malformed records tolerated before the run fails
    pub max_bad_lines: u64,
    /// target tokens per shard file (rounded to whole sequences)
    pub shard_tokens: u64,
    /// worker threads (None: all cores)
    #[serde(skip)]
    pub threads: Option<usize>,
    /// restart from scratch even if OUT holds another preparation
    #[serde(skip)]
    pub force: bool,
    /// keep `OUT/.work` (the token spill) at the end
    #[serde(skip)]
    pub keep_work: bool,
    /// no progress bars or summary
    #[serde(skip)]
    pub quiet: bool,
}

impl PrepareOptions {
    /// Defaults for a sequence length: `original`, all tokens, BOS separators, seed 0.
    pub fn new(seq_len: usize) -> Self {
        PrepareOptions {
            seq_len,
            strategy: StrategyParams {
                name: StrategyKind::Original,
                budget: None,
                threshold: 4096,
                short_keep: 0.1,
                cut_len: seq_len as u64,
                weights: Weights::InputShare,
                upsample_sources: Vec::new(),
                domain_weight: 0.6,
            },
            seed: 0,
            separator: Separator::Bos,
            bos_token: None,
            eos_token: None,
            text_field: "text".into(),
            source_field: DEFAULT_SOURCE_FIELD.into(),
            default_source: None,
            max_bad_lines: 0,
            shard_tokens: 1 << 26,
            threads: None,
            force: false,
            keep_work: false,
            quiet: true,
        }
    }
}

/// Prepare a dataset from in-memory `(source, text)` documents (for `harpe demo`, `tiny-cpu` runs, tests).
pub fn prepare_from_texts(
    texts: &[(String, String)],
    tokenizer: &Path,
    opts: &PrepareOptions,
    out: &Path,
) -> Result<Manifest> {
    let input =
        InputFile { path: PathBuf::from("<memory>"), kind: InputKind::Memory(Arc::new(texts.to_vec())), bytes: 0 };
    prepare(vec![input], tokenizer, opts, out)
}

/// Everything that must be equal for a restarted run to continue the work of an earlier one.
#[derive(Serialize, Deserialize, PartialEq)]
struct Settings {
    inputs: Vec<(String, u64)>,
    tokenizer_sha256: String,
    options: PrepareOptions,
}

/// Shared state of pass 1.
struct Pass1<'a> {
    tok: &'a Encoder<'a>,
    fields: &'a Fields,
    opts: &'a PrepareOptions,
    work: &'a Path,
    bytes_read: Arc<AtomicU64>,
    bad_before: u64,
    bar: &'a ProgressBar,
    docs: &'a AtomicU64,
    tokens: &'a AtomicU64,
    t0: Instant,
}

impl Pass1<'_> {
    fn tokenize_file(&self, i: usize, input: &InputFile) -> Result<FileSummary> {
        let (tok_path, idx_path, sum_path) = spill_paths(self.work, i);
        let mut spill = SpillWriter::create(tok_path, idx_path)?;
        let mut s = FileSummary::default();
        let mut local: BTreeMap<String, u32> = BTreeMap::new();
        let text_source = self.opts.default_source.clone().unwrap_or_else(|| "text".to_string());
        let threshold = self.opts.strategy.threshold;
        let file_label = input.path.display().to_string();
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<super::source::Raw>>(2);
        std::thread::scope(|scope| -> Result<()> {
            let bytes_read = self.bytes_read.clone();
            let reader = scope.spawn(move || {
                read_batches(input, &text_source, 4 << 20, bytes_read, |b| {
                    tx.send(b).map_err(|_| anyhow::anyhow!("tokenizer stage stopped"))
                })
            });
            for batch in rx {
                let lines: Vec<u64> = batch.iter().map(raw_line).collect();
                let parsed: Vec<_> = batch
                    .into_par_iter()
                    .map(|raw| {
                        let (source, text) = parse_record(raw, self.fields)?;
                        let ids = self.tok.encode(&text).map_err(|e| (0, e.to_string()))?;
                        Ok::<_, (u64, String)>((source, ids))
                    })
                    .collect();
                let (mut nd, mut nt) = (0u64, 0u64);
                for (rec, line) in parsed.into_iter().zip(lines) {
                    match rec {
                        Ok((source, ids)) => {
                            let len = ids.len() as u64;
                            let id = s.add_doc(&mut local, source, len, threshold);
                            spill.push(&ids, id)?;
                            nd += 1;
                            nt += len;
                        }
                        Err((l, reason)) => {
                            let line = if l == 0 { line } else { l };
                            self.bad_record(&mut s, &file_label, line, reason)?;
                        }
                    }
                }
                self.progress(nd, nt);
            }
            reader.join().map_err(|_| anyhow::anyhow!("reader thread of {file_label} panicked"))??;
            Ok(())
        })?;
        spill.finish()?;
        crate::util::write_atomic(&sum_path, &serde_json::to_vec(&s)?)?;
        Ok(s)
    }

    /// Count a bad record in `s` (keeping the first few as samples); an error past `max_bad_lines`.
    fn bad_record(&self, s: &mut FileSummary, file_label: &str, line: u64, reason: String) -> Result<()> {
        s.bad_lines += 1;
        if s.bad_samples.len() < MAX_BAD_SAMPLES {
            s.bad_samples.push(BadLine { file: file_label.to_string(), line, reason: reason.clone() });
        }
        let total = self.bad_before + s.bad_lines;
        if total > self.opts.max_bad_lines {
            bail!(
                "{file_label}:{line}: {reason} ({total} bad record(s) so far, max_bad_lines = {})\nhint: fix \
                 the input, or tolerate such records with --max-bad-lines N (they are counted in the manifest)",
                self.opts.max_bad_lines
            );
        }
        Ok(())
    }

    fn progress(&self, nd: u64, nt: u64) {
        let d = self.docs.fetch_add(nd, Ordering::Relaxed) + nd;
        let t = self.tokens.fetch_add(nt, Ordering::Relaxed) + nt;
        let secs = self.t0.elapsed().as_secs_f64().max(1e-9);
        self.bar.set_position(self.bytes_read.load(Ordering::Relaxed));
        self.bar.set_message(format!("{d} docs {:.0} docs/s {:.3} Mtok/s", d as f64 / secs, t as f64 / secs / 1e6));
    }
}

fn raw_line(r: &super::source::Raw) -> u64 {
    match r {
        super::source::Raw::Line { line, .. }
        | super::source::Raw::Doc { line, .. }
        | super::source::Raw::Bad { line, .. } => *line,
    }
}

fn bar(quiet: bool, len: u64, template: &str) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template(template) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}

/// Prepare a dataset from `files` into `out` (the library entry point of `prepare-data`).
pub fn prepare(files: Vec<InputFile>, tokenizer_path: &Path, opts: &PrepareOptions, out: &Path) -> Result<Manifest> {
    opts.strategy.validate()?;
    if opts.seq_len < 2 {
        bail!("seq_len must be at least 2 (got {})\nhint: e.g. 131072", opts.seq_len);
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.threads.unwrap_or(0))
        .build()
        .context("cannot start the tokenizer thread pool")?;
    pool.install(|| prepare_inner(files, tokenizer_path, opts, out))
}

fn prepare_inner(files: Vec<InputFile>, tokenizer_path: &Path, opts: &PrepareOptions, out: &Path) -> Result<Manifest> {
    let tok = load_tokenizer(tokenizer_path)?;
    // Same ids as the tokenizer's own pipeline, faster for Llama-layout tokenizers (see `Encoder`).
    let encoder = Encoder::new(&tok);
    let sep = SepTokens::resolve(&tok, opts.separator, opts.bos_token.as_deref(), opts.eos_token.as_deref())?;
    let tok_sha = tokenizer_sha256(tokenizer_path)?;
    let settings = Settings {
        inputs: files.iter().map(|f| (f.path.display().to_string(), f.bytes)).collect(),
        tokenizer_sha256: tok_sha.clone(),
        options: opts.clone(),
    };
    if let Some(finished) = open_output(out, &settings, opts)? {
        return Ok(finished);
    }
    let work = out.join(".work");
    let read = pass1(&files, &encoder, &sep, opts, &work)?;
    let (names, stats) = input_stats(&read, files.len())?;
    let plan = plan(&read.summaries, &names, stats, &sep, opts, &work)?;
    let packed = pack(&plan, &sep, opts, out, &work)?;
    let done = Finished { files: &files, read: &read, names, notes: plan.notes, packed };
    let manifest = manifest(done, &sep, tok_sha, opts);
    std::fs::copy(tokenizer_path, out.join("tokenizer.json"))
        .with_context(|| format!("cannot copy {} into {}", tokenizer_path.display(), out.display()))?;
    crate::util::write_atomic(&out.join("manifest.json"), &serde_json::to_vec_pretty(&manifest)?)?;
    if !opts.keep_work {
        std::fs::remove_dir_all(&work).with_context(|| format!("cannot remove {}", work.display()))?;
    }
    Ok(manifest)
}

/// Make `out` ready: `--force` removes an earlier preparation; a finished one with the same settings is
/// returned as is; one with other settings is refused; otherwise the settings and `.work` are written.
fn open_output(out: &Path, settings: &Settings, opts: &PrepareOptions) -> Result<Option<Manifest>> {
    let settings_json = serde_json::to_vec_pretty(settings)?;
    let work = out.join(".work");
    let settings_path = out.join("settings.json");
    if opts.force && out.exists() {
        for e in std::fs::read_dir(out).with_context(|| format!("cannot list {}", out.display()))? {
            let p = e?.path();
            let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            let ours = name == ".work"
                || name == "manifest.json"
                || name == "settings.json"
                || name == "tokenizer.json"
                || name.starts_with("shard_");
            if ours {
                if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) }
                    .with_context(|| format!("--force: cannot remove {}", p.display()))?;
            }
        }
    }
    if settings_path.is_file() {
        let old = std::fs::read(&settings_path).with_context(|| format!("cannot read {}", settings_path.display()))?;
        if old != settings_json {
            bail!(
                "{} holds a preparation with different settings ({})\nhint: use another --out, or --force to discard it",
                out.display(),
                settings_path.display()
            );
        }
        if out.join("manifest.json").is_file() {
            return Manifest::load(out).map(Some); // already finished with the same settings
        }
    }
    std::fs::create_dir_all(&work).with_context(|| format!("cannot create {}\nhint: check --out", work.display()))?;
    crate::util::write_atomic(&settings_path, &settings_json)?;
    Ok(None)
}

/// What pass 1 read: one summary per input file read (a prefix of the inputs when the budgets filled
/// early) and the source names known before reading (given weights).
struct Read {
    summaries: Vec<FileSummary>,
    upfront_names: Vec<String>,
}

/// Pass 1: read + tokenize every input file into the spill (files already spilled are skipped); stop
/// early once every budget is full when the budgets are known up front.
fn pass1(files: &[InputFile], encoder: &Encoder, sep: &SepTokens, opts: &PrepareOptions, work: &Path) -> Result<Read> {
    // sources known in advance (per-source strategies with given weights); unknown names are bad lines
    let known: Option<BTreeSet<String>> =
        if opts.strategy.per_source() { opts.strategy.weights.names().map(|v| v.into_iter().collect()) } else { None };
    let fields = Fields::new(&opts.text_field, &opts.source_field, opts.default_source.clone(), known.clone());
    let total_bytes: u64 = files.iter().map(|f| f.bytes).sum();
    let pb = bar(
        opts.quiet,
        total_bytes,
        "tokenize [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} {msg} ETA {eta}",
    );
    let (docs, tokens) = (AtomicU64::new(0), AtomicU64::new(0));
    let bytes_read = Arc::new(AtomicU64::new(0));
    let mut summaries: Vec<FileSummary> = Vec::new();
    let upfront_names: Vec<String> = known.iter().flatten().cloned().collect();
    let upfront_shares = if opts.strategy.budgets_known_upfront() && opts.strategy.per_source() {
        Some(opts.strategy.target_shares(&upfront_names, &vec![0; upfront_names.len()])?)
    } else {
        None
    };
    let mut early = opts.strategy.budgets_known_upfront().then(|| {
        Selector::new(&opts.strategy, opts.seed, sep.len(), upfront_names.len().max(1), upfront_shares.as_deref())
    });
    let t0 = Instant::now();
    for (i, input) in files.iter().enumerate() {
        let (_, idx_path, sum_path) = spill_paths(work, i);
        let summary = match std::fs::read(&sum_path).ok().and_then(|b| serde_json::from_slice::<FileSummary>(&b).ok()) {
            Some(s) => {
                bytes_read.fetch_add(input.bytes, Ordering::Relaxed);
                s
            }
            None => {
                let p1 = Pass1 {
                    tok: encoder,
                    fields: &fields,
                    opts,
                    work,
                    bytes_read: bytes_read.clone(),
                    bad_before: summaries.iter().map(|s| s.bad_lines).sum(),
                    bar: &pb,
                    docs: &docs,
                    tokens: &tokens,
                    t0,
                };
                p1.tokenize_file(i, input)?
            }
        };
        if let Some(sel) = early.as_mut() {
            for (d, (len, local)) in read_index(&idx_path)?.into_iter().enumerate() {
                let name = &summary.sources[local as usize];
                let source = upfront_names.iter().position(|n| n == name).unwrap_or(0) as u32;
                sel.offer(i as u64, d as u64, DocInfo { len, source });
            }
        }
        summaries.push(summary);
        if early.as_ref().is_some_and(|s| s.full()) {
            break;
        }
    }
    pb.finish_and_clear();
    Ok(Read { summaries, upfront_names })
}

/// Global source ids (sorted names) and per-source input statistics; an empty corpus is an error.
fn input_stats(read: &Read, n_inputs: usize) -> Result<(Vec<String>, Vec<SourceStats>)> {
    let summaries = &read.summaries;
    let mut names: BTreeSet<String> = summaries.iter().flat_map(|s| s.sources.iter().cloned()).collect();
    names.extend(read.upfront_names.iter().cloned());
    let names: Vec<String> = names.into_iter().collect();
    let gid = |n: &str| names.iter().position(|m| m == n).unwrap_or(0) as u32;
    let mut stats: Vec<SourceStats> = (0..names.len())
        .map(|i| SourceStats {
            id: i as u32,
            hist_in: vec![0; HIST_BUCKETS],
            hist_out: vec![0; HIST_BUCKETS],
            ..Default::default()
        })
        .collect();
    for s in summaries {
        for (l, name) in s.sources.iter().enumerate() {
            let st = &mut stats[gid(name) as usize];
            st.docs_in += s.counts[l][0];
            st.tokens_in += s.counts[l][1];
            st.long_tokens_in += s.counts[l][2];
            for (b, h) in st.hist_in.iter_mut().zip(&s.hist[l]) {
                *b += h;
            }
        }
    }
    if stats.iter().map(|s| s.docs_in).sum::<u64>() == 0 {
        let bad_lines: u64 = summaries.iter().map(|s| s.bad_lines).sum();
        bail!(
            "empty corpus: no document could be read from {n_inputs} input(s) ({bad_lines} bad record(s))\nhint: check --input, \
             --text-field and --source-field"
        );
    }
    Ok((names, stats))
}

/// The selection: per input file read, per document (len, global source id, tokens taken).
struct Plan {
    docs: Vec<Vec<(u32, u32, u64)>>,
    stats: Vec<SourceStats>,
    notes: Vec<String>,
}

/// Plan the output: the sampling pass over every spilled document, then the top-up of short sources;
/// fills the per-source targets, budgets and shortfalls and the notes for the manifest.
fn plan(
    summaries: &[FileSummary],
    names: &[String],
    mut stats: Vec<SourceStats>,
    sep: &SepTokens,
    opts: &PrepareOptions,
    work: &Path,
) -> Result<Plan> {
    let gid = |n: &str| names.iter().position(|m| m == n).unwrap_or(0) as u32;
    let tokens_in: Vec<u64> = stats.iter().map(|s| s.tokens_in).collect();
    let shares = if opts.strategy.per_source() { Some(opts.strategy.target_shares(names, &tokens_in)?) } else { None };
    let mut sel = Selector::new(&opts.strategy, opts.seed, sep.len(), names.len(), shares.as_deref());
    let mut plan: Vec<Vec<(u32, u32, u64)>> = Vec::with_capacity(summaries.len());
    for (i, s) in summaries.iter().enumerate() {
        let map: Vec<u32> = s.sources.iter().map(|n| gid(n)).collect();
        let idx = read_index(&spill_paths(work, i).1)?;
        plan.push(
            idx.into_iter()
                .enumerate()
                .map(|(d, (len, l))| {
                    let source = map[l as usize];
                    (len, source, sel.offer(i as u64, d as u64, DocInfo { len, source }))
                })
                .collect(),
        );
    }
    if opts.strategy.samples_short() && sel.any_short() {
        for docs in plan.iter_mut() {
            for (len, source, take) in docs.iter_mut().filter(|d| d.2 == 0) {
                let t = sel.top_up(DocInfo { len: *len, source: *source });
                if t > 0 {
                    *take = t;
                    stats[*source as usize].topped_up_docs += 1;
                    stats[*source as usize].topped_up_tokens += t;
                }
            }
        }
    }
    let mut notes = Vec::new();
    for (i, st) in stats.iter_mut().enumerate() {
        if let Some(sh) = &shares {
            st.target_share = Some(sh[i]);
            st.budget = sel.budgets[i];
            st.shortfall_tokens = sel.budgets[i].unwrap_or(0).saturating_sub(sel.used[i]);
        }
        if st.topped_up_docs > 0 {
            notes.push(format!(
                "source {}: the sampling pass left it short; topped up with {} short documents ({} tokens)",
                names[i], st.topped_up_docs, st.topped_up_tokens
            ));
        }
        if st.shortfall_tokens > 0 {
            notes.push(format!(
                "source {}: all its documents give {} tokens less than its budget {}; its share of the output is lower than targeted",
                names[i],
                st.shortfall_tokens,
                st.budget.unwrap_or(0)
            ));
        }
    }
    if let (false, Some(b)) = (opts.strategy.per_source(), opts.strategy.budget) {
        if sel.used[0] < b {
            notes.push(format!("the corpus gives {} tokens, less than the budget {b}", sel.used[0]));
        }
    }
    Ok(Plan { docs: plan, stats, notes })
}

/// What pass 2 wrote.
struct Packed {
    shards: Vec<ShardInfo>,
    stats: Vec<SourceStats>,
    tail_tokens_dropped: u64,
}

/// Pass 2: pack the planned documents from the memory-mapped spills into shards; fills the output
/// statistics. Fewer tokens than one sequence is an error.
fn pack(plan: &Plan, sep: &SepTokens, opts: &PrepareOptions, out: &Path, work: &Path) -> Result<Packed> {
    let planned: u64 = plan.docs.iter().flatten().map(|d| d.2).sum();
    let seqs_per_shard = (opts.shard_tokens / opts.seq_len as u64).max(1);
    let pb2 =
        bar(opts.quiet, planned / opts.seq_len as u64, "pack     [{bar:30}] {pos}/{len} sequences {per_sec} ETA {eta}");
    let mut packer = Packer::new(out, work, opts.seq_len, seqs_per_shard, plan.stats.clone());
    let pb2c = pb2.clone();
    packer.on_sequence = Box::new(move || pb2c.inc(1));
    let threshold = opts.strategy.threshold;
    let mut buf: Vec<u32> = Vec::new();
    for (i, docs) in plan.docs.iter().enumerate() {
        if docs.iter().all(|d| d.2 == 0) {
            continue;
        }
        let tok_path = spill_paths(work, i).0;
        let file = std::fs::File::open(&tok_path).with_context(|| format!("cannot open {}", tok_path.display()))?;
        // SAFETY: the spill file is ours, complete (renamed into place after writing) and not modified while mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("cannot map {}", tok_path.display()))?;
        let mut off = 0usize;
        for &(len, source, take) in docs {
            let end = off + 4 * len as usize;
            if take > 0 {
                let toks: Vec<u32> =
                    map[off..end].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                buf.clear();
                let piece = if opts.strategy.name == StrategyKind::Cut {
                    opts.strategy.cut_len as usize
                } else {
                    toks.len().max(1)
                };
                for p in toks.chunks(piece.max(1)) {
                    sep.wrap_into(p, &mut buf);
                }
                if toks.is_empty() {
                    sep.wrap_into(&[], &mut buf);
                }
                buf.truncate(take as usize);
                if opts.strategy.name == StrategyKind::Cut {
                    for p in buf.chunks(piece + sep.len() as usize) {
                        packer.push_doc(p, source, u64::from(len) >= threshold, u64::from(len))?;
                    }
                } else {
                    packer.push_doc(&buf, source, u64::from(len) >= threshold, u64::from(len))?;
                }
            }
            off = end;
        }
    }
    let (shards, mut stats, tail) = packer.finish()?;
    pb2.finish_and_clear();
    for st in stats.iter_mut() {
        st.long_token_share_in = if st.tokens_in > 0 { st.long_tokens_in as f64 / st.tokens_in as f64 } else { 0.0 };
        st.long_token_share_out =
            if st.tokens_out > 0 { st.long_tokens_out as f64 / st.tokens_out as f64 } else { 0.0 };
    }
    if shards.is_empty() {
        bail!(
            "the selection gives {planned} tokens, less than one sequence of {}\nhint: raise --budget, add input, or lower --seq-len",
            opts.seq_len
        );
    }
    Ok(Packed { shards, stats, tail_tokens_dropped: tail })
}

/// What a finished preparation produced: the inputs and what pass 1 read of them, the source names, the
/// plan's notes, the packed shards.
struct Finished<'a> {
    files: &'a [InputFile],
    read: &'a Read,
    names: Vec<String>,
    notes: Vec<String>,
    packed: Packed,
}

/// The manifest of a finished preparation.
fn manifest(done: Finished, sep: &SepTokens, tokenizer_sha256: String, opts: &PrepareOptions) -> Manifest {
    let Finished { files, read, names, notes, packed } = done;
    let summaries = &read.summaries;
    let mut bad_line_samples: Vec<BadLine> = summaries.iter().flat_map(|s| s.bad_samples.iter().cloned()).collect();
    bad_line_samples.truncate(MAX_BAD_SAMPLES);
    Manifest {
        format: FORMAT.to_string(),
        version: VERSION,
        seq_len: opts.seq_len,
        strategy: opts.strategy.clone(),
        seed: opts.seed,
        tokenizer_sha256,
        separator: opts.separator,
        bos_id: sep.bos,
        eos_id: sep.eos,
        sources: names.iter().cloned().zip(packed.stats).collect(),
        source_names: names,
        inputs: files.iter().map(|f| f.path.display().to_string()).collect(),
        inputs_read: summaries.len(),
        bad_lines: summaries.iter().map(|s| s.bad_lines).sum(),
        bad_line_samples,
        tail_tokens_dropped: packed.tail_tokens_dropped,
        num_sequences: packed.shards.iter().map(|s| s.sequences).sum(),
        shards: packed.shards,
        notes,
    }
}
