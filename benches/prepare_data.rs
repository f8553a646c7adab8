//! Benchmark of `prepare-data` (per-source-upsample) against the bare tokenizer and the Python reference.
//!
//! Run: `HARPE_BENCH_TOKENIZER=path/to/llama2/tokenizer.json HARPE_BENCH_PYTHON=/path/to/python \
//!       cargo bench --profile dev --bench prepare_data`
//! Env: `HARPE_BENCH_DIR` (default /tmp/harpe-bench; the corpus is generated there once),
//! `HARPE_BENCH_MB` (uncompressed corpus size, default 200), `HARPE_BENCH_SEQ_LEN` (default 4096).
//! It measures, one core each (rayon pool of 1; the zstd reader thread of prepare-data runs beside it):
//! (1) bare `encode_fast` over every document already decompressed in memory — the floor;
//! (2) `harpe::data::prepare` end to end (read .zst, parse, tokenize, spill, plan, pack, write shards);
//! (3) `scripts/prepare_data_ref.py` (same recipe on the `tokenizers` Python package), whose output
//!     token stream must have the same sha256 as (2); then (4) prepare-data with all cores.
//! The corpus is synthetic SlimPajama: words drawn Zipf-like from the tokenizer's own word pieces, the
//! seven RedPajama sources with Fu et al.'s token shares and log-normal document lengths per source.
//! It is not a test and is not timed by CI.
use anyhow::{Context, Result};
use rand::{Rng, SeedableRng};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use harpe::data::mixture::{StrategyKind, SLIMPAJAMA_MIX};
use harpe::data::source::expand_inputs;
use harpe::data::PrepareOptions;

/// Median document length in words and log-normal sigma per source (rough SlimPajama shapes).
const SHAPES: [(&str, f64, f64); 7] = [
    ("RedPajamaCommonCrawl", 700.0, 1.0),
    ("RedPajamaC4", 350.0, 0.8),
    ("RedPajamaGithub", 900.0, 1.3),
    ("RedPajamaArXiv", 7000.0, 0.6),
    ("RedPajamaBook", 50000.0, 0.6),
    ("RedPajamaWikipedia", 450.0, 1.0),
    ("RedPajamaStackExchange", 350.0, 0.9),
];

fn generate(dir: &Path, tokenizer: &Path, mb: usize) -> Result<()> {
    let tok = harpe::data::tokenize::load_tokenizer(tokenizer)?;
    let mut words: Vec<(u32, String)> = tok
        .get_vocab(false)
        .into_iter()
        .filter_map(|(w, id)| {
            let s = w.strip_prefix('\u{2581}')?;
            (s.len() >= 2 && s.chars().all(|c| c.is_ascii_alphabetic())).then(|| (id, s.to_string()))
        })
        .collect();
    words.sort();
    let cdf: Vec<f64> = words
        .iter()
        .enumerate()
        .scan(0.0, |acc, (r, _)| {
            *acc += 1.0 / (r as f64 + 20.0);
            Some(*acc)
        })
        .collect();
    let total_w = *cdf.last().context("no word pieces in the tokenizer")?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(42);
    // pick a source per document with probability share / mean length, so token shares follow the mix
    let probs: Vec<f64> = SHAPES
        .iter()
        .zip(SLIMPAJAMA_MIX.iter())
        .map(|((_, med, sig), (_, share))| share / (med * (sig * sig / 2.0).exp()))
        .collect();
    let psum: f64 = probs.iter().sum();
    std::fs::create_dir_all(dir)?;
    let (mut written, mut file_no) = (0usize, 0usize);
    while written < mb << 20 {
        let path = dir.join(format!("example_train_{file_no}.jsonl.zst"));
        let mut enc = zstd::stream::write::Encoder::new(std::fs::File::create(&path)?, 3)?;
        let mut in_file = 0usize;
        while in_file < 20 << 20 && written + in_file < mb << 20 {
            let mut u = rng.random::<f64>() * psum;
            let k = probs.iter().position(|p| {
                u -= p;
                u <= 0.0
            });
            let (name, med, sig) = SHAPES[k.unwrap_or(0)];
            let z: f64 = (0..12).map(|_| rng.random::<f64>()).sum::<f64>() - 6.0;
            let n_words = (med * (sig * z).exp()).clamp(5.0, 400_000.0) as usize;
            let mut text = String::with_capacity(n_words * 7);
            for i in 0..n_words {
                let x = rng.random::<f64>() * total_w;
                let w = &words[cdf.partition_point(|&c| c < x).min(words.len() - 1)].1;
                text.push_str(w);
                text.push_str(match i % 17 {
                    16 => ".\n",
                    7 => ", ",
                    _ => " ",
                });
            }
            let line = serde_json::json!({"text": text, "meta": {"redpajama_set_name": name}}).to_string();
            writeln!(enc, "{line}")?;
            in_file += line.len() + 1;
        }
        enc.finish()?;
        written += in_file;
        file_no += 1;
    }
    Ok(())
}

fn texts(files: &[PathBuf]) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for f in files {
        let r = std::io::BufReader::new(zstd::stream::read::Decoder::new(std::fs::File::open(f)?)?);
        for line in r.lines() {
            let v: serde_json::Value = serde_json::from_str(&line?)?;
            out.push(v["text"].as_str().unwrap_or_default().to_string());
        }
    }
    Ok(out)
}

fn main() -> Result<()> {
    let Ok(tokenizer) = std::env::var("HARPE_BENCH_TOKENIZER").map(PathBuf::from) else {
        println!("prepare_data bench: set HARPE_BENCH_TOKENIZER=path/to/tokenizer.json (Llama-2) to run it");
        return Ok(());
    };
    let dir = PathBuf::from(std::env::var("HARPE_BENCH_DIR").unwrap_or_else(|_| "/tmp/harpe-bench".into()));
    let mb: usize = std::env::var("HARPE_BENCH_MB").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let seq_len: usize = std::env::var("HARPE_BENCH_SEQ_LEN").ok().and_then(|s| s.parse().ok()).unwrap_or(4096);
    let corpus = dir.join(format!("corpus_{mb}mb"));
    if !corpus.is_dir() {
        eprintln!("generating {mb} MB of synthetic SlimPajama in {}", corpus.display());
        generate(&corpus, &tokenizer, mb)?;
    }
    let files = expand_inputs(&[corpus.display().to_string()])?;
    let paths: Vec<PathBuf> = files.iter().map(|f| f.path.clone()).collect();
    let zst_bytes: u64 = files.iter().map(|f| f.bytes).sum();
    let docs = texts(&paths)?;
    let raw_bytes: usize = docs.iter().map(|d| d.len()).sum();
    let tok = harpe::data::tokenize::load_tokenizer(&tokenizer)?;

    // (1) bare tokenizer, one core
    let t = Instant::now();
    let mut n_tok = 0u64;
    for d in &docs {
        n_tok += harpe::data::tokenize::encode(&tok, d)?.len() as u64;
    }
    let bare = t.elapsed().as_secs_f64();
    drop(docs);
    println!(
        "corpus: {} files, {:.1} MB jsonl.zst, {:.1} MB text, {n_tok} tokens",
        files.len(),
        zst_bytes as f64 / 1e6,
        raw_bytes as f64 / 1e6
    );
    println!("bare encode_fast, 1 core: {:.2} s, {:.3} Mtok/s", bare, n_tok as f64 / bare / 1e6);

    // (2) prepare-data, one core
    let budget = n_tok / 4;
    let mut o = PrepareOptions::new(seq_len);
    o.strategy.name = StrategyKind::PerSourceUpsample;
    o.strategy.budget = Some(budget);
    o.threads = Some(1);
    o.force = true;
    let out = dir.join("out_rust");
    let t = Instant::now();
    let m = harpe::data::prepare(files.clone(), &tokenizer, &o, &out)?;
    let rust1 = t.elapsed().as_secs_f64();
    println!(
        "harpe prepare-data, 1 core: {:.2} s, {:.3} Mtok/s ({:.0}% of bare encode)",
        rust1,
        n_tok as f64 / rust1 / 1e6,
        100.0 * bare / rust1
    );
    let mut h = <sha2::Sha256 as sha2::Digest>::new();
    for s in &m.shards {
        sha2::Digest::update(&mut h, std::fs::read(out.join(&s.file))?);
    }
    let rust_sha = hex::encode(sha2::Digest::finalize(h));

    // (3) Python reference, one core
    if let Ok(py) = std::env::var("HARPE_BENCH_PYTHON") {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/prepare_data_ref.py");
        let t = Instant::now();
        let res = std::process::Command::new(py)
            .env("RAYON_NUM_THREADS", "1")
            .env("TOKENIZERS_PARALLELISM", "false")
            .arg(&script)
            .args(["--tokenizer", &tokenizer.display().to_string(), "--seq-len", &seq_len.to_string()])
            .args(["--budget", &budget.to_string(), "--out", &dir.join("out_py.bin").display().to_string()])
            .args(&paths)
            .output()?;
        let wall = t.elapsed().as_secs_f64();
        let report: serde_json::Value = serde_json::from_slice(&res.stdout)
            .with_context(|| format!("python failed: {}", String::from_utf8_lossy(&res.stderr)))?;
        let py_secs = report["seconds"].as_f64().unwrap_or(wall);
        println!(
            "python reference, 1 core: {:.2} s ({wall:.2} s wall), {:.3} Mtok/s; harpe is {:.2}x faster; same output: {}",
            py_secs,
            n_tok as f64 / py_secs / 1e6,
            py_secs / rust1,
            report["sha256"].as_str() == Some(rust_sha.as_str())
        );
    }

    // (4) prepare-data, all cores
    o.threads = None;
    let t = Instant::now();
    harpe::data::prepare(files, &tokenizer, &o, &out)?;
    let all = t.elapsed().as_secs_f64();
    println!(
        "harpe prepare-data, {} cores: {:.2} s, {:.3} Mtok/s",
        rayon::current_num_threads(),
        all,
        n_tok as f64 / all / 1e6
    );
    Ok(())
}
