//! `harpe eval-loss`: next-token loss on a prepared validation set, by source and by position bucket
//! (Fu et al. 2024 Table 5: 0-4K, 4K-32K, 32K-128K).
//!
//! Each sequence of the dataset (dataset order, no shuffle) is one forward pass of seq_len tokens;
//! target t (1 <= t < T) is predicted from positions < t, attributed to the source span holding t and to
//! the bucket of t. Logits are made in chunks (never (T x V) at once). The dataset must have been
//! tokenized with the model's tokenizer.json (sha256 compared). Not done here: document masking.
use crate::data::loader::source_name;
use crate::data::{Loader, LoaderConfig, Sequence};
use crate::eval::ppl::{position_nlls, ScoringModel};
use crate::model::llama::Tokens;
use crate::model::Llama;
use anyhow::{bail, Result};
use candle_core::Tensor;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Loss by source and position bucket on a prepared dataset.
#[derive(clap::Args, Debug)]
pub struct EvalLossArgs {
    #[command(flatten)]
    pub scoring: ScoringModel,
    /// prepared dataset directory (from `harpe prepare-data`), e.g. a validation split
    #[arg(long)]
    pub data: PathBuf,
    /// upper ends of the position buckets in tokens, ascending (positions past the last form a final bucket)
    #[arg(long, value_delimiter = ',', default_value = "4096,32768,131072")]
    pub buckets: Vec<usize>,
    /// evaluate at most this many sequences (dataset order)
    #[arg(long)]
    pub max_sequences: Option<usize>,
    /// evaluate even if the dataset's tokenizer differs from the model's
    #[arg(long)]
    pub allow_tokenizer_mismatch: bool,
    /// print one JSON object instead of tables
    #[arg(long)]
    pub json: bool,
}

/// Mean loss over a group of tokens.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct LossCell {
    pub tokens: u64,
    pub loss: f64,
    #[serde(skip)]
    sum: f64,
}

impl LossCell {
    fn add(&mut self, nll: f64) {
        self.sum += nll;
        self.tokens += 1;
        self.loss = self.sum / self.tokens as f64;
    }
}

/// The report of one evaluation.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LossReport {
    pub sequences: usize,
    pub total: LossCell,
    pub by_source: BTreeMap<String, LossCell>,
    pub by_bucket: BTreeMap<String, LossCell>,
    /// (source, bucket) -> loss
    pub by_source_bucket: BTreeMap<String, BTreeMap<String, LossCell>>,
}

fn k(n: usize) -> String {
    if n > 0 && n.is_multiple_of(1024) {
        format!("{}K", n / 1024)
    } else {
        n.to_string()
    }
}

/// Bucket labels for boundaries b_0 < b_1 < ...: "0-4K", "4K-32K", ..., "128K+".
pub fn bucket_labels(bounds: &[usize]) -> Vec<String> {
    let mut v = vec![];
    let mut lo = 0;
    for &b in bounds {
        v.push(format!("{}-{}", k(lo), k(b)));
        lo = b;
    }
    v.push(format!("{}+", k(lo)));
    v
}

/// Evaluate.
pub fn evaluate(args: &EvalLossArgs) -> Result<LossReport> {
    crate::config::check_buckets(&args.buckets, "--buckets")?;
    let model = args.scoring.load()?;
    let seq_len = crate::data::Manifest::load(&args.data)?.seq_len;
    let loader = Loader::open(&args.data, LoaderConfig { seq_len, shuffle: false, seed: 0, rank: 0, world_size: 1 })?;
    let man = loader.manifest();
    let tok_sha = crate::data::tokenizer_sha256(&args.scoring.model.join("tokenizer.json"))?;
    if tok_sha != man.tokenizer_sha256 && !args.allow_tokenizer_mismatch {
        bail!(
            "{}: the dataset was tokenized with another tokenizer (sha256 {}) than {} ({})\nhint: prepare the data with the model's tokenizer.json, or pass --allow-tokenizer-mismatch",
            args.data.display(),
            &man.tokenizer_sha256[..12.min(man.tokenizer_sha256.len())],
            args.scoring.model.join("tokenizer.json").display(),
            &tok_sha[..12]
        );
    }
    if seq_len > model.max_context() {
        eprintln!("warning: sequences of {seq_len} tokens exceed max_position_embeddings {}", model.max_context());
    }
    loss_report(&model, &loader, &args.data, &args.buckets, args.max_sequences, args.scoring.loss_chunk)
}

/// Score the first `max_sequences` sequences of an opened (unshuffled) dataset under `model`, by source
/// and position bucket (shared by `eval-loss` and evaluation during training).
pub fn loss_report(
    model: &Llama,
    loader: &Loader,
    data: &Path,
    buckets: &[usize],
    max_sequences: Option<usize>,
    chunk: usize,
) -> Result<LossReport> {
    let n = report_sequences(loader, max_sequences);
    let mut tally = LossTally::new(loader, buckets, n);
    for g in 0..n {
        let seq = loader.get(g as u64)?;
        let nlls = sequence_nlls(model, &seq, data, chunk)?;
        tally.add(&seq, &nlls);
    }
    Ok(tally.report)
}

/// How many sequences a report scores: the first `max_sequences` of the dataset (all without it).
pub fn report_sequences(loader: &Loader, max_sequences: Option<usize>) -> usize {
    let n = loader.sequences_per_epoch() as usize;
    max_sequences.map_or(n, |m| m.min(n))
}

/// The per-target NLLs of one dataset sequence (targets 1..T, in order): one forward pass.
pub fn sequence_nlls(model: &Llama, seq: &Sequence, data: &Path, chunk: usize) -> Result<Vec<f64>> {
    if let Some(bad) = seq.tokens.iter().find(|&&i| i as usize >= model.cfg.vocab_size) {
        bail!(
            "{}: token id {bad} in sequence {} is >= vocab_size {}\nhint: the dataset does not belong to this model",
            data.display(),
            seq.index,
            model.cfg.vocab_size
        );
    }
    let x = Tensor::new(seq.tokens.as_slice(), model.device())?.unsqueeze(0)?; // (1, T)
    let hidden = model.forward(&x, Tokens::At(0))?; // (1, T, C)
    position_nlls(model, &hidden, &seq.tokens, 0, seq.tokens.len() - 1, chunk)
}

/// A report being summed, sequence by sequence in dataset order (target by target inside each), so
/// that the same NLLs give the same bits however they were computed (one rank or many).
pub struct LossTally {
    labels: Vec<String>,
    names: Vec<String>,
    buckets: Vec<usize>,
    pub report: LossReport,
}

impl LossTally {
    /// An empty report of `sequences` sequences of `loader`'s dataset.
    pub fn new(loader: &Loader, buckets: &[usize], sequences: usize) -> LossTally {
        LossTally {
            labels: bucket_labels(buckets),
            names: loader.manifest().source_names.clone(),
            buckets: buckets.to_vec(),
            report: LossReport { sequences, ..Default::default() },
        }
    }

    /// Add the NLLs of targets 1..T of `seq` (`sequence_nlls`).
    pub fn add(&mut self, seq: &Sequence, nlls: &[f64]) {
        let rep = &mut self.report;
        for (p, &nll) in nlls.iter().enumerate() {
            let target = p + 1;
            let src = source_name(&self.names, seq.source_of(target));
            let b = &self.labels[self.buckets.partition_point(|&e| e <= target)];
            rep.total.add(nll);
            rep.by_source.entry(src.clone()).or_default().add(nll);
            rep.by_bucket.entry(b.clone()).or_default().add(nll);
            rep.by_source_bucket.entry(src).or_default().entry(b.clone()).or_default().add(nll);
        }
    }
}

/// `harpe eval-loss`.
pub fn run(args: EvalLossArgs) -> Result<()> {
    let rep = evaluate(&args)?;
    if args.json {
        println!("{}", serde_json::to_string(&rep)?);
        return Ok(());
    }
    let labels: Vec<String> =
        bucket_labels(&args.buckets).into_iter().filter(|l| rep.by_bucket.contains_key(l)).collect();
    print!("{:<28} {:>10}", "source", "all");
    for l in &labels {
        print!(" {l:>12}");
    }
    println!();
    for (src, cell) in rep.by_source.iter().chain(std::iter::once((&"total".to_string(), &rep.total))) {
        print!("{src:<28} {:>10.4}", cell.loss);
        for l in &labels {
            let v = if src == "total" {
                rep.by_bucket.get(l)
            } else {
                rep.by_source_bucket.get(src).and_then(|m| m.get(l))
            };
            match v {
                Some(c) => print!(" {:>12.4}", c.loss),
                None => print!(" {:>12}", "-"),
            }
        }
        println!();
    }
    println!("{} sequences, {} tokens", rep.sequences, rep.total.tokens);
    Ok(())
}
