//! `harpe prepare-data` as a command: its flags, the `data.toml` file with the same keys (flags win over
//! the file, the file over the defaults), and `run`, which locks `--out` and calls `prepare`. Apart from
//! the passes (`prepare.rs`), which `harpe demo` and the tests call without any flags.
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

use super::mixture::{parse_budget, StrategyKind, StrategyParams, Weights};
use super::prepare::{prepare, PrepareOptions};
use super::source::expand_inputs;
use super::tokenize::Separator;

/// A TOML value that is either a string or an integer (budgets).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum StrOrInt {
    Int(u64),
    Str(String),
}

/// Source weights in TOML: a preset name / `a=0.5,b=0.5` string, or a table.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum WeightsToml {
    Str(String),
    Table(BTreeMap<String, f64>),
}

/// `data.toml`: the same settings as the flags (flags win).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PrepareConfig {
    input: Option<Vec<String>>,
    tokenizer: Option<PathBuf>,
    strategy: Option<StrategyKind>,
    seq_len: Option<usize>,
    budget: Option<StrOrInt>,
    out: Option<PathBuf>,
    seed: Option<u64>,
    threshold: Option<u64>,
    short_keep: Option<f64>,
    source_weights: Option<WeightsToml>,
    upsample_sources: Option<Vec<String>>,
    domain_weight: Option<f64>,
    cut_len: Option<u64>,
    separator: Option<Separator>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    text_field: Option<String>,
    source_field: Option<String>,
    default_source: Option<String>,
    max_bad_lines: Option<u64>,
    shard_tokens: Option<u64>,
    threads: Option<usize>,
}

/// `harpe prepare-data` flags.
#[derive(clap::Args, Debug, Default)]
pub struct PrepareDataArgs {
    /// TOML file with the same settings as the flags (keys as the flag names with `_`); flags override it
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Corpus: .jsonl / .jsonl.zst files (SlimPajama layout), plain .txt files (one document each),
    /// directories (walked recursively) or quoted globs; read in sorted path order
    #[arg(long, num_args = 1..)]
    pub input: Vec<String>,
    /// The model's tokenizer.json (its sha256 is recorded; `train` refuses a different tokenizer)
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Length/mixture strategy (Fu et al. Table 5) [default: per-source-upsample]
    #[arg(long, value_enum)]
    pub strategy: Option<StrategyKind>,
    /// Tokens per packed sequence, e.g. 131072 [default: 131072]
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Output token budget: 5B, 100M, 64k, 123456, or `all` (everything selected) [default: all]
    #[arg(long)]
    pub budget: Option<String>,
    /// Output dataset directory (created; a killed run restarts here without redoing finished work)
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Seed of every random choice (same seed + inputs = same bytes) [default: 0]
    #[arg(long)]
    pub seed: Option<u64>,
    /// Documents with at least this many tokens count as long and are always kept by the upsample
    /// strategies [default: 4096]
    #[arg(long)]
    pub threshold: Option<u64>,
    /// Probability of keeping a short document in the upsample strategies [default: 0.1]
    #[arg(long)]
    pub short_keep: Option<f64>,
    /// Target source shares for per-source strategies: `input` (share of input tokens read),
    /// `slimpajama` (Fu et al.'s preset) or `a=0.5,b=0.5` [default: input]
    #[arg(long)]
    pub source_weights: Option<String>,
    /// Sources whose weight domain-upsample raises, comma-separated (e.g. RedPajamaBook,RedPajamaArXiv)
    #[arg(long, value_delimiter = ',')]
    pub upsample_sources: Vec<String>,
    /// Raw weight domain-upsample gives those sources before renormalising [default: 0.6, as Fu et al.]
    #[arg(long)]
    pub domain_weight: Option<f64>,
    /// Piece length of the `cut` strategy (4096 reproduces Fu et al.'s "cut at 4K") [default: seq-len]
    #[arg(long)]
    pub cut_len: Option<u64>,
    /// Document separator tokens [default: bos, as Llama / Fu et al.]
    #[arg(long, value_enum)]
    pub separator: Option<Separator>,
    /// Spelling of the BOS token if not one of <s>, <|begin_of_text|>, <bos>, <|startoftext|>
    #[arg(long)]
    pub bos_token: Option<String>,
    /// Spelling of the EOS token if not one of </s>, <|end_of_text|>, <eos>, <|endoftext|>
    #[arg(long)]
    pub eos_token: Option<String>,
    /// Dotted path of the text field in jsonl records [default: text]
    #[arg(long)]
    pub text_field: Option<String>,
    /// Dotted path of the source field in jsonl records [default: meta.redpajama_set_name]
    #[arg(long)]
    pub source_field: Option<String>,
    /// Source name of plain text files and of records without a source field (without it such records
    /// are bad lines; text files default to `text`)
    #[arg(long)]
    pub default_source: Option<String>,
    /// Malformed records tolerated (reported and counted in the manifest) before the run fails [default: 0]
    #[arg(long)]
    pub max_bad_lines: Option<u64>,
    /// Target tokens per shard file, rounded to whole sequences [default: 67108864 = 256 MiB]
    #[arg(long)]
    pub shard_tokens: Option<u64>,
    /// Worker threads for tokenization [default: all cores]
    #[arg(long)]
    pub threads: Option<usize>,
    /// Discard whatever OUT holds (another or an unfinished preparation) and start over
    #[arg(long)]
    pub force: bool,
    /// Keep OUT/.work (the token spill of pass 1) after success
    #[arg(long)]
    pub keep_work: bool,
    /// No progress bars and no summary table
    #[arg(long)]
    pub quiet: bool,
}

/// Resolve flags over the config file over defaults: (inputs, tokenizer, out, options).
fn resolve(a: PrepareDataArgs) -> Result<(Vec<String>, PathBuf, PathBuf, PrepareOptions)> {
    let c: PrepareConfig = match &a.config {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read config {}\nhint: check the --config path", p.display()))?;
            toml::from_str(&text).with_context(|| {
                format!(
                    "{}: invalid prepare-data config\nhint: keys are the flag names with `_` (seq_len, budget, ...)",
                    p.display()
                )
            })?
        }
        None => PrepareConfig::default(),
    };
    let inputs = if a.input.is_empty() { c.input.unwrap_or_default() } else { a.input };
    if inputs.is_empty() {
        bail!("no input given\nhint: pass --input PATH... (files, directories or quoted globs) or `input = [...]` in the config");
    }
    let tokenizer =
        a.tokenizer.or(c.tokenizer).context("no tokenizer given\nhint: pass --tokenizer path/to/tokenizer.json")?;
    let out = a.out.or(c.out).context("no output directory given\nhint: pass --out DIR")?;
    let seq_len = a.seq_len.or(c.seq_len).unwrap_or(131072);
    if seq_len < 2 {
        bail!("--seq-len must be at least 2 (got {seq_len})\nhint: e.g. --seq-len 131072");
    }
    let mut o = PrepareOptions::new(seq_len);
    let budget = match (a.budget, c.budget) {
        (Some(s), _) | (None, Some(StrOrInt::Str(s))) => parse_budget(&s)?,
        (None, Some(StrOrInt::Int(n))) => Some(n),
        (None, None) => None,
    };
    let weights = match (a.source_weights, c.source_weights) {
        (Some(s), _) | (None, Some(WeightsToml::Str(s))) => Weights::parse(&s)?,
        (None, Some(WeightsToml::Table(t))) => {
            Weights::parse(&t.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(","))?
        }
        (None, None) => Weights::InputShare,
    };
    o.strategy = StrategyParams {
        name: a.strategy.or(c.strategy).unwrap_or(StrategyKind::PerSourceUpsample),
        budget,
        threshold: a.threshold.or(c.threshold).unwrap_or(4096),
        short_keep: a.short_keep.or(c.short_keep).unwrap_or(0.1),
        cut_len: a.cut_len.or(c.cut_len).unwrap_or(seq_len as u64),
        weights,
        upsample_sources: if a.upsample_sources.is_empty() {
            c.upsample_sources.unwrap_or_default()
        } else {
            a.upsample_sources
        },
        domain_weight: a.domain_weight.or(c.domain_weight).unwrap_or(0.6),
    };
    o.seed = a.seed.or(c.seed).unwrap_or(0);
    o.separator = a.separator.or(c.separator).unwrap_or(Separator::Bos);
    o.bos_token = a.bos_token.or(c.bos_token);
    o.eos_token = a.eos_token.or(c.eos_token);
    o.text_field = a.text_field.or(c.text_field).unwrap_or(o.text_field);
    o.source_field = a.source_field.or(c.source_field).unwrap_or(o.source_field);
    o.default_source = a.default_source.or(c.default_source);
    o.max_bad_lines = a.max_bad_lines.or(c.max_bad_lines).unwrap_or(0);
    o.shard_tokens = a.shard_tokens.or(c.shard_tokens).unwrap_or(o.shard_tokens);
    o.threads = a.threads.or(c.threads);
    o.force = a.force;
    o.keep_work = a.keep_work;
    o.quiet = a.quiet;
    Ok((inputs, tokenizer, out, o))
}

/// `harpe prepare-data`.
pub fn run(args: PrepareDataArgs) -> Result<()> {
    let (inputs, tokenizer, out, opts) = resolve(args)?;
    let _lock = crate::util::lock_dir(&out, "harpe prepare-data")?; // one writer per --out directory
    crate::util::remove_stale_temps(&out)?; // a killed run's half-written small files
    let files = expand_inputs(&inputs)?;
    let m = prepare(files, &tokenizer, &opts, &out)?;
    if !opts.quiet {
        println!("{}", super::inspect::mixture_table(&m));
        for n in &m.notes {
            println!("note: {n}");
        }
        println!("wrote {} sequences x {} tokens to {}", m.num_sequences, m.seq_len, out.display());
    }
    Ok(())
}
