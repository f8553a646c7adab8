//! Streaming corpus readers: SlimPajama-style jsonl / jsonl.zst, directory trees and globs of them,
//! plain text files (one document each) and in-memory texts.
//!
//! Reference: SlimPajama layout: one JSON object per line,
//! `{"text": str, "meta": {"redpajama_set_name": str}}`, where some re-uploads store `meta` as a JSON
//! string (both are accepted). The non-obvious decision: a reader only splits raw lines and reports
//! I/O problems (invalid UTF-8, truncated `.zst`); parsing happens in [`parse_record`] on the worker
//! threads, so JSON decoding is parallel with tokenization. Memory is bounded by one batch.
//! What this file does not do: decide which documents are kept (`mixture`).
use anyhow::{bail, Context, Result};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The seven RedPajama set names that SlimPajama's `meta.redpajama_set_name` can hold.
pub const SLIMPAJAMA_SOURCES: [&str; 7] = [
    "RedPajamaCommonCrawl",
    "RedPajamaC4",
    "RedPajamaGithub",
    "RedPajamaArXiv",
    "RedPajamaBook",
    "RedPajamaWikipedia",
    "RedPajamaStackExchange",
];

/// Default dotted path of the source field (SlimPajama).
pub const DEFAULT_SOURCE_FIELD: &str = "meta.redpajama_set_name";
const DEFAULT_SOURCE_FIELD_PARTS: [&str; 2] = ["meta", "redpajama_set_name"];

/// Kind of an input, from its file name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InputKind {
    /// one JSON object per line
    Jsonl,
    /// zstd-compressed jsonl
    JsonlZst,
    /// a plain text file = one document
    Text,
    /// documents given in code: (source, text)
    Memory(Arc<Vec<(String, String)>>),
}

/// One input of the corpus.
#[derive(Clone, Debug)]
pub struct InputFile {
    /// path (a label for in-memory inputs)
    pub path: PathBuf,
    /// how to read it
    pub kind: InputKind,
    /// size in bytes on disk (for progress)
    pub bytes: u64,
}

fn kind_of(path: &Path) -> Option<InputKind> {
    let name = path.file_name()?.to_string_lossy().to_lowercase();
    if name.ends_with(".jsonl.zst") || name.ends_with(".json.zst") || name.ends_with(".zst") {
        Some(InputKind::JsonlZst)
    } else if name.ends_with(".jsonl") || name.ends_with(".json") {
        Some(InputKind::Jsonl)
    } else if name.ends_with(".txt") || name.ends_with(".md") || name.ends_with(".text") {
        Some(InputKind::Text)
    } else {
        None
    }
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let rd = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list directory {}\nhint: check the --input path", dir.display()))?;
    for e in rd {
        let p = e.with_context(|| format!("cannot list directory {}", dir.display()))?.path();
        if p.is_dir() {
            walk(&p, out)?;
        } else if kind_of(&p).is_some() {
            out.push(p);
        }
    }
    Ok(())
}

/// Expand `--input` arguments (files, directories walked recursively, globs) into a sorted, de-duplicated
/// list of inputs. Files named explicitly must have a known extension.
pub fn expand_inputs(args: &[String]) -> Result<Vec<InputFile>> {
    let mut paths: BTreeSet<PathBuf> = BTreeSet::new();
    for a in args {
        let mut found = Vec::new();
        if a.contains(['*', '?', '[']) {
            let it = glob::glob(a)
                .with_context(|| format!("--input {a:?}: invalid glob pattern\nhint: quote the pattern"))?;
            for p in it {
                let p = p.with_context(|| format!("--input {a:?}: cannot read a match"))?;
                if p.is_dir() {
                    walk(&p, &mut found)?;
                } else if kind_of(&p).is_some() {
                    found.push(p);
                }
            }
        } else {
            let p = PathBuf::from(a);
            if p.is_dir() {
                walk(&p, &mut found)?;
            } else if p.is_file() {
                if kind_of(&p).is_none() {
                    bail!("--input {a}: unknown file type\nhint: use .jsonl, .jsonl.zst, .zst, .json or .txt/.md");
                }
                found.push(p);
            } else {
                bail!("--input {a}: no such file or directory\nhint: check the path (globs must be quoted)");
            }
        }
        if found.is_empty() {
            bail!("--input {a}: matches no .jsonl/.jsonl.zst/.txt file\nhint: check the path or pattern");
        }
        paths.extend(found);
    }
    let mut out = Vec::with_capacity(paths.len());
    for p in paths {
        let bytes = std::fs::metadata(&p).with_context(|| format!("cannot stat {}", p.display()))?.len();
        let kind = kind_of(&p).unwrap_or(InputKind::Text);
        out.push(InputFile { path: p, kind, bytes });
    }
    Ok(out)
}

/// One raw record from a reader, before parsing.
#[derive(Debug)]
pub enum Raw {
    /// a jsonl line (without the newline)
    Line {
        /// 1-based line number
        line: u64,
        /// its bytes
        bytes: Vec<u8>,
    },
    /// a whole document whose source is already known
    Doc {
        /// 1-based document number in the input
        line: u64,
        /// source name
        source: String,
        /// text
        text: String,
    },
    /// a record the reader could not produce
    Bad {
        /// 1-based line number (0: the file as a whole)
        line: u64,
        /// what went wrong
        reason: String,
    },
}

impl Raw {
    /// Approximate size in bytes (for batching).
    pub fn size(&self) -> usize {
        match self {
            Raw::Line { bytes, .. } => bytes.len(),
            Raw::Doc { text, .. } => text.len(),
            Raw::Bad { .. } => 1,
        }
    }
}

/// Reads `inner` and counts the bytes consumed (compressed bytes for `.zst`), for progress.
struct Counting<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Stream the records of `input` in batches of about `batch_bytes`, calling `sink` for each batch.
/// `bytes_read` advances with the on-disk bytes consumed. `text_source` names the source of plain text files.
pub fn read_batches(
    input: &InputFile,
    text_source: &str,
    batch_bytes: usize,
    bytes_read: Arc<AtomicU64>,
    mut sink: impl FnMut(Vec<Raw>) -> Result<()>,
) -> Result<()> {
    let path = &input.path;
    let open = || {
        std::fs::File::open(path).with_context(|| format!("cannot open {}\nhint: check permissions", path.display()))
    };
    match &input.kind {
        InputKind::Memory(docs) => {
            let mut batches = Batcher::new(batch_bytes, sink);
            for (i, (source, text)) in docs.iter().enumerate() {
                let doc = Raw::Doc { line: i as u64 + 1, source: source.clone(), text: text.clone() };
                batches.push(doc, text.len())?;
            }
            batches.finish()
        }
        InputKind::Text => {
            let mut bytes = Vec::new();
            Counting { inner: open()?, count: bytes_read }
                .read_to_end(&mut bytes)
                .with_context(|| format!("cannot read {}", path.display()))?;
            let rec = match String::from_utf8(bytes) {
                Ok(text) => Raw::Doc { line: 1, source: text_source.to_string(), text },
                Err(e) => {
                    Raw::Bad { line: 0, reason: format!("invalid UTF-8 at byte {}", e.utf8_error().valid_up_to()) }
                }
            };
            sink(vec![rec])
        }
        InputKind::Jsonl | InputKind::JsonlZst => {
            let counted = Counting { inner: open()?, count: bytes_read };
            let reader: Box<dyn BufRead> = if input.kind == InputKind::JsonlZst {
                let dec = zstd::stream::read::Decoder::new(counted)
                    .with_context(|| format!("{}: cannot start zstd decoding", path.display()))?;
                // small reads: on a truncated frame only the last 64 KiB of decoded text are lost
                Box::new(BufReader::with_capacity(1 << 16, dec))
            } else {
                Box::new(BufReader::with_capacity(1 << 20, counted))
            };
            read_lines(reader, batch_bytes, &mut sink)
        }
    }
}

fn read_lines(
    mut reader: Box<dyn BufRead>,
    batch_bytes: usize,
    sink: &mut impl FnMut(Vec<Raw>) -> Result<()>,
) -> Result<()> {
    let mut batches = Batcher::new(batch_bytes, sink);
    let mut line = 0u64;
    loop {
        let mut buf = Vec::new();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) => break,
            Ok(_) => {
                line += 1;
                while buf.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                    buf.pop();
                }
                if buf.iter().all(|b| b.is_ascii_whitespace()) {
                    continue; // blank lines (e.g. a trailing newline) are not records
                }
                let n = buf.len();
                batches.push(Raw::Line { line, bytes: buf }, n)?;
            }
            Err(e) => {
                // a truncated or corrupt .zst ends the file here; everything before it is kept
                let reason = format!("read error (truncated or corrupt file?): {e}");
                batches.push(Raw::Bad { line: line + 1, reason }, 0)?;
                break;
            }
        }
    }
    batches.finish()
}

/// Records gathered into batches of about `limit` bytes: each batch goes to `sink` once it holds
/// `limit` bytes, the last one (if any) at `finish`.
struct Batcher<F: FnMut(Vec<Raw>) -> Result<()>> {
    batch: Vec<Raw>,
    bytes: usize,
    limit: usize,
    sink: F,
}

impl<F: FnMut(Vec<Raw>) -> Result<()>> Batcher<F> {
    fn new(limit: usize, sink: F) -> Self {
        Batcher { batch: Vec::new(), bytes: 0, limit, sink }
    }

    /// Add `rec`, which counts `bytes` towards the batch's size.
    fn push(&mut self, rec: Raw, bytes: usize) -> Result<()> {
        self.bytes += bytes;
        self.batch.push(rec);
        if self.bytes >= self.limit {
            (self.sink)(std::mem::take(&mut self.batch))?;
            self.bytes = 0;
        }
        Ok(())
    }

    fn finish(mut self) -> Result<()> {
        if !self.batch.is_empty() {
            (self.sink)(self.batch)?;
        }
        Ok(())
    }
}

/// Which JSON fields hold the text and the source.
#[derive(Clone, Debug)]
pub struct Fields {
    /// dotted path of the text field
    pub text: Vec<String>,
    /// dotted path of the source field
    pub source: Vec<String>,
    /// source used when the record has no source field (None: such a record is a bad line)
    pub default_source: Option<String>,
    /// accepted source names (None: any; the SlimPajama field always requires a RedPajama set name)
    pub known: Option<BTreeSet<String>>,
}

impl Fields {
    /// Build from dotted paths.
    pub fn new(text: &str, source: &str, default_source: Option<String>, known: Option<BTreeSet<String>>) -> Self {
        let split = |s: &str| s.split('.').filter(|p| !p.is_empty()).map(str::to_string).collect();
        Fields { text: split(text), source: split(source), default_source, known }
    }
}

fn lookup<'a>(v: &'a serde_json::Value, path: &[String]) -> Option<std::borrow::Cow<'a, serde_json::Value>> {
    use std::borrow::Cow;
    let mut cur: Cow<'a, serde_json::Value> = Cow::Borrowed(v);
    for key in path {
        // `meta` may be a JSON object or a JSON string holding one (parquet re-uploads)
        if let serde_json::Value::String(s) = cur.as_ref() {
            cur = Cow::Owned(serde_json::from_str(s).ok()?);
        }
        cur = match cur {
            Cow::Borrowed(b) => Cow::Borrowed(b.get(key)?),
            Cow::Owned(o) => Cow::Owned(o.get(key)?.clone()),
        };
    }
    Some(cur)
}

/// Parse one raw record into `(source, text)`, or the reason it is a bad line.
pub fn parse_record(raw: Raw, fields: &Fields) -> std::result::Result<(String, String), (u64, String)> {
    let (line, source, text) = match raw {
        Raw::Bad { line, reason } => return Err((line, reason)),
        Raw::Doc { line, source, text } => (line, source, text),
        Raw::Line { line, bytes } => {
            let s = std::str::from_utf8(&bytes)
                .map_err(|e| (line, format!("invalid UTF-8 at byte {}", e.valid_up_to())))?;
            let v: serde_json::Value = serde_json::from_str(s).map_err(|e| (line, format!("malformed JSON: {e}")))?;
            let text = match lookup(&v, &fields.text).as_deref() {
                Some(serde_json::Value::String(t)) => t.clone(),
                Some(_) => return Err((line, format!("field {} is not a string", fields.text.join(".")))),
                None => return Err((line, format!("no text field {}", fields.text.join(".")))),
            };
            let source = match lookup(&v, &fields.source).as_deref() {
                Some(serde_json::Value::String(s)) => {
                    if fields.source == [DEFAULT_SOURCE_FIELD_PARTS[0], DEFAULT_SOURCE_FIELD_PARTS[1]]
                        && !SLIMPAJAMA_SOURCES.contains(&s.as_str())
                    {
                        return Err((line, format!("unknown source name {s:?} (not a RedPajama set name)")));
                    }
                    s.clone()
                }
                Some(_) => return Err((line, format!("field {} is not a string", fields.source.join(".")))),
                None => match &fields.default_source {
                    Some(d) => d.clone(),
                    None => return Err((line, format!("no source field {}", fields.source.join(".")))),
                },
            };
            (line, source, text)
        }
    };
    if text.trim().is_empty() {
        return Err((line, "empty text".to_string()));
    }
    if let Some(known) = &fields.known {
        if !known.contains(&source) {
            return Err((line, format!("unknown source name {source:?}")));
        }
    }
    Ok((source, text))
}
