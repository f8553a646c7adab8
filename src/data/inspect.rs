//! `harpe inspect-data DIR`: the mixture table, the document-length histogram, and a decoded sequence.
//!
//! Reads only `manifest.json` (plus one shard row and the dataset's `tokenizer.json` copy for `--decode`).
//! The non-obvious decision: histograms come from counts recorded at preparation time (log2 buckets of
//! original document lengths, input vs selected), so inspecting a 6B-token dataset is instant.
//! What this file does not do: verify shard checksums unless `--verify` is given.
use anyhow::{Context, Result};
use std::path::PathBuf;

use super::loader::{Loader, LoaderConfig};
use super::shard::{Manifest, HIST_BUCKETS};
use super::tokenize::load_tokenizer;

/// `harpe inspect-data` flags.
#[derive(clap::Args, Debug)]
pub struct InspectDataArgs {
    /// Prepared dataset directory (holds manifest.json)
    pub dir: PathBuf,
    /// Decode sequence I (global index, dataset order) with the dataset's tokenizer.json copy
    #[arg(long, value_name = "I")]
    pub decode: Option<u64>,
    /// At most this many characters of decoded text are printed (0 = all)
    #[arg(long, default_value_t = 2000)]
    pub max_chars: usize,
    /// Tokenizer for --decode instead of DIR/tokenizer.json
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Check every shard against the manifest's checksums (CRC32C blocks; sha256 for an older dataset)
    #[arg(long)]
    pub verify: bool,
    /// Machine-readable output: the manifest, plus `decoded` when --decode is given
    #[arg(long)]
    pub json: bool,
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// The per-source mixture table (also printed at the end of prepare-data).
pub fn mixture_table(m: &Manifest) -> String {
    let tot_in: u64 = m.sources.values().map(|s| s.tokens_in).sum::<u64>().max(1);
    let tot_out: u64 = m.sources.values().map(|s| s.tokens_out).sum::<u64>().max(1);
    let mut s = format!(
        "{:<24} {:>9} {:>13} {:>7} {:>7} | {:>9} {:>13} {:>7} {:>7} {:>7} {:>10}\n",
        "source",
        "docs_in",
        "tokens_in",
        "share",
        "long",
        "docs_out",
        "tokens_out",
        "share",
        "target",
        "long",
        "topped_up"
    );
    for (name, st) in &m.sources {
        s += &format!(
            "{:<24} {:>9} {:>13} {:>7} {:>7} | {:>9} {:>13} {:>7} {:>7} {:>7} {:>10}\n",
            name,
            st.docs_in,
            st.tokens_in,
            pct(st.tokens_in as f64 / tot_in as f64),
            pct(st.long_token_share_in),
            st.docs_out,
            st.tokens_out,
            pct(st.tokens_out as f64 / tot_out as f64),
            st.target_share.map_or("-".to_string(), pct),
            pct(st.long_token_share_out),
            st.topped_up_tokens
        );
    }
    s += &format!(
        "strategy {}, seq_len {}, {} sequences ({} tokens), seed {}, threshold {}, bad lines {}",
        serde_json::to_value(m.strategy.name).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default(),
        m.seq_len,
        m.num_sequences,
        m.tokens_out(),
        m.seed,
        m.strategy.threshold,
        m.bad_lines
    );
    s
}

/// Document-length histogram over all sources: input vs selected documents.
pub fn length_histogram(m: &Manifest) -> String {
    let mut hin = [0u64; HIST_BUCKETS];
    let mut hout = [0u64; HIST_BUCKETS];
    for st in m.sources.values() {
        for (i, (a, b)) in st.hist_in.iter().zip(&st.hist_out).enumerate().take(HIST_BUCKETS) {
            hin[i] += a;
            hout[i] += b;
        }
    }
    let max = hin.iter().chain(hout.iter()).copied().max().unwrap_or(1).max(1);
    let (lo, hi) = match (hin.iter().position(|&c| c > 0), hin.iter().rposition(|&c| c > 0)) {
        (Some(a), Some(b)) => (a, b),
        _ => return "no documents\n".to_string(),
    };
    let mut s = format!("{:>17} {:>9} {:>9}  (# = input, * = selected)\n", "doc tokens", "in", "out");
    for i in lo..=hi {
        let bar = |c: u64, ch: char| ch.to_string().repeat(((c * 30).div_ceil(max)) as usize);
        s += &format!("[{:>7},{:>7}) {:>9} {:>9}  {}\n", 1u64 << i, 1u64 << (i + 1), hin[i], hout[i], bar(hin[i], '#'));
        s += &format!("{:>37}  {}\n", "", bar(hout[i], '*'));
    }
    s
}

/// `harpe inspect-data`.
pub fn run(a: InspectDataArgs) -> Result<()> {
    let m = Manifest::load(&a.dir)?;
    if a.verify {
        for sh in &m.shards {
            sh.verify(&a.dir)?;
        }
    }
    let decoded = match a.decode {
        Some(i) => {
            let l = Loader::open(
                &a.dir,
                LoaderConfig { seq_len: m.seq_len, shuffle: false, seed: 0, rank: 0, world_size: 1 },
            )?;
            let seq = l.get(i)?;
            let tpath = a.tokenizer.clone().unwrap_or_else(|| a.dir.join("tokenizer.json"));
            let tok = load_tokenizer(&tpath)?;
            let mut parts = Vec::new();
            for sp in &seq.sources {
                let text = tok
                    .decode(&seq.tokens[sp.start..sp.end], false)
                    .map_err(|e| anyhow::anyhow!("decoding sequence {i}: {e}"))
                    .with_context(|| format!("with tokenizer {}\nhint: pass --tokenizer", tpath.display()))?;
                let name = m.source_names.get(sp.source as usize).cloned().unwrap_or_default();
                parts.push(serde_json::json!({"source": name, "start": sp.start, "end": sp.end, "text": text}));
            }
            Some(serde_json::json!({"index": i, "doc_starts": seq.doc_starts, "spans": parts}))
        }
        None => None,
    };
    if a.json {
        let mut v = serde_json::to_value(&m)?;
        if let Some(d) = decoded {
            v["decoded"] = d;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("{}\n", mixture_table(&m));
    print!("{}", length_histogram(&m));
    for n in &m.notes {
        println!("note: {n}");
    }
    for b in m.bad_line_samples.iter().take(10) {
        println!("bad line {}:{}: {}", b.file, b.line, b.reason);
    }
    if a.verify {
        println!("verified the checksums of {} shards", m.shards.len());
    }
    if let Some(d) = decoded {
        println!("\nsequence {} (document starts at {})", d["index"], d["doc_starts"]);
        for sp in d["spans"].as_array().into_iter().flatten() {
            let text = sp["text"].as_str().unwrap_or_default();
            let shown: String =
                if a.max_chars == 0 { text.to_string() } else { text.chars().take(a.max_chars).collect() };
            println!("--- [{}..{}) {} ---\n{shown}", sp["start"], sp["end"], sp["source"].as_str().unwrap_or_default());
        }
    }
    Ok(())
}
