//! Length / mixture strategies (Fu et al. 2024, Table 5): which documents go into the output, and how
//! many tokens of each.
//!
//! Reference: `FranxYao/Long-Context-Data-Engineering:data_engineering/slimpajama_packing.py`.
//! `per-source-upsample`: each source gets `budget x target_share` tokens; inside a source, documents
//! with at least `threshold` tokens are always taken and shorter ones with probability `short_keep`,
//! in stream order, until the source is full; the last document is cut so the source lands exactly on
//! its budget. A source that runs out is topped up with the short documents the coin rejected (recorded).
//! The non-obvious decisions: (1) lengths are real token counts, not Fu et al.'s `chars / 3.68`
//! estimate; (2) the keep/drop coin of a document is a hash of (seed, file index, document index), so
//! the selection does not depend on thread scheduling, batching or on where a killed run restarted.
//! What this file does not do: read, tokenize or pack.
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// SlimPajama source shares hard-coded in Fu et al.'s code (`SLIMPAJAMA_ORIGINAL_MIX`).
pub const SLIMPAJAMA_MIX: [(&str, f64); 7] = [
    ("RedPajamaCommonCrawl", 0.53374772),
    ("RedPajamaC4", 0.26609933),
    ("RedPajamaGithub", 0.05004782),
    ("RedPajamaArXiv", 0.04290379),
    ("RedPajamaBook", 0.0414836),
    ("RedPajamaWikipedia", 0.03402128),
    ("RedPajamaStackExchange", 0.03169647),
];

/// The strategies of Fu et al.'s Table 5.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum StrategyKind {
    /// documents cut into pieces of at most `cut_len` tokens (each piece its own document), original mixture
    Cut,
    /// documents in stream order, packed, no upsampling (Fu et al. "cut at 128K")
    Original,
    /// long documents always, short ones with probability `short_keep`, one global budget
    GlobalUpsample,
    /// named sources' weights raised to `domain_weight` before renormalising; no length filter
    DomainUpsample,
    /// per-source budgets, long documents upsampled inside each source (Fu et al.'s recipe)
    PerSourceUpsample,
}

/// Target source shares.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Weights {
    /// each source's share of the input tokens read
    InputShare,
    /// Fu et al.'s hard-coded SlimPajama mix
    Slimpajama,
    /// given shares (normalised to sum 1)
    Explicit(BTreeMap<String, f64>),
}

impl Weights {
    /// Parse `slimpajama`, `input`, or `a=0.5,b=0.5`.
    pub fn parse(s: &str) -> Result<Weights> {
        match s.trim() {
            "slimpajama" => return Ok(Weights::Slimpajama),
            "input" | "input-share" => return Ok(Weights::InputShare),
            _ => {}
        }
        let mut m = BTreeMap::new();
        for part in s.split(',').filter(|p| !p.trim().is_empty()) {
            let (k, v) = part.split_once('=').with_context(|| {
                format!("--source-weights: {part:?} is not NAME=WEIGHT\nhint: e.g. --source-weights a=0.5,b=0.5 or slimpajama")
            })?;
            let w: f64 = v.trim().parse().with_context(|| {
                format!("--source-weights: weight {v:?} of {k:?} is not a number\nhint: e.g. a=0.5,b=0.5")
            })?;
            if !(w.is_finite() && w >= 0.0) {
                bail!("--source-weights: weight of {k:?} must be >= 0 (got {w})\nhint: weights are relative shares");
            }
            m.insert(k.trim().to_string(), w);
        }
        if m.values().sum::<f64>() <= 0.0 {
            bail!("--source-weights {s:?}: no positive weight\nhint: e.g. a=0.5,b=0.5 or slimpajama");
        }
        Ok(Weights::Explicit(m))
    }

    /// Source names this weighting knows in advance (None for input shares).
    pub fn names(&self) -> Option<Vec<String>> {
        match self {
            Weights::InputShare => None,
            Weights::Slimpajama => Some(SLIMPAJAMA_MIX.iter().map(|(n, _)| n.to_string()).collect()),
            Weights::Explicit(m) => Some(m.keys().cloned().collect()),
        }
    }
}

/// Parse a token count: `5B`, `100M`, `64k`, `5e9`, `123456`, or `all` (None).
pub fn parse_budget(s: &str) -> Result<Option<u64>> {
    let t = s.trim().to_lowercase().replace('_', "");
    if t == "all" {
        return Ok(None);
    }
    let (num, mul) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1e3),
        Some('m') => (&t[..t.len() - 1], 1e6),
        Some('b') | Some('g') => (&t[..t.len() - 1], 1e9),
        Some('t') => (&t[..t.len() - 1], 1e12),
        _ => (t.as_str(), 1.0),
    };
    let v: f64 = num
        .parse()
        .with_context(|| format!("--budget {s:?} is not a token count\nhint: e.g. 5B, 100M, 64k, 123456 or all"))?;
    if !(v.is_finite() && v > 0.0) {
        bail!("--budget {s:?} must be positive\nhint: e.g. 5B, or all");
    }
    Ok(Some((v * mul).round() as u64))
}

/// A strategy with all its parameters (stored verbatim in the manifest).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StrategyParams {
    /// which strategy
    pub name: StrategyKind,
    /// output token budget (None: everything selected)
    pub budget: Option<u64>,
    /// documents with at least this many tokens are "long"
    pub threshold: u64,
    /// probability of keeping a short document (upsample strategies)
    pub short_keep: f64,
    /// piece length of `cut`
    pub cut_len: u64,
    /// target source shares (per-source strategies)
    pub weights: Weights,
    /// sources raised by `domain-upsample`
    pub upsample_sources: Vec<String>,
    /// raw weight given to those sources before renormalising (Fu et al.: 0.6)
    pub domain_weight: f64,
}

impl StrategyParams {
    /// Check the combination of parameters.
    pub fn validate(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.short_keep) {
            bail!("--short-keep must be in [0, 1] (got {})\nhint: Fu et al. use 0.1", self.short_keep);
        }
        if self.cut_len == 0 {
            bail!("--cut-len must be > 0\nhint: e.g. 4096 for Fu et al.'s 'cut at 4K'");
        }
        if self.per_source() && self.budget.is_none() {
            bail!("strategy {:?} needs a token budget\nhint: pass --budget, e.g. --budget 5B", self.name);
        }
        if self.name == StrategyKind::DomainUpsample && self.upsample_sources.is_empty() {
            bail!("strategy domain-upsample needs --upsample-sources\nhint: e.g. --upsample-sources RedPajamaBook");
        }
        Ok(())
    }

    /// True for strategies with one budget per source.
    pub fn per_source(&self) -> bool {
        matches!(self.name, StrategyKind::PerSourceUpsample | StrategyKind::DomainUpsample)
    }

    /// True for strategies that drop short documents with probability `1 - short_keep`.
    pub fn samples_short(&self) -> bool {
        matches!(self.name, StrategyKind::PerSourceUpsample | StrategyKind::GlobalUpsample)
    }

    /// True when every budget is known before reading (so reading can stop once they are full).
    pub fn budgets_known_upfront(&self) -> bool {
        if self.per_source() {
            self.weights != Weights::InputShare
        } else {
            self.budget.is_some()
        }
    }

    /// Output tokens of a whole document of `len` tokens, separators (`sep` per piece) included.
    pub fn out_len(&self, len: u64, sep: u64) -> u64 {
        let pieces = if self.name == StrategyKind::Cut { len.div_ceil(self.cut_len).max(1) } else { 1 };
        len + pieces * sep
    }

    /// Target share of every source. `tokens_in` is indexed by source id.
    pub fn target_shares(&self, names: &[String], tokens_in: &[u64]) -> Result<Vec<f64>> {
        let mut w: Vec<f64> = match &self.weights {
            Weights::InputShare => tokens_in.iter().map(|&t| t as f64).collect(),
            Weights::Slimpajama => {
                names.iter().map(|n| SLIMPAJAMA_MIX.iter().find(|(m, _)| m == n).map_or(0.0, |(_, v)| *v)).collect()
            }
            Weights::Explicit(m) => names.iter().map(|n| m.get(n).copied().unwrap_or(0.0)).collect(),
        };
        // base shares sum to 1 before domain-upsample replaces the named sources' weights (Fu et al.)
        let base: f64 = w.iter().sum();
        if base > 0.0 {
            w.iter_mut().for_each(|x| *x /= base);
        }
        if self.name == StrategyKind::DomainUpsample {
            for s in &self.upsample_sources {
                let Some(i) = names.iter().position(|n| n == s) else {
                    bail!("--upsample-sources: source {s:?} is not in the corpus (sources: {names:?})\nhint: check the name");
                };
                w[i] = self.domain_weight;
            }
        }
        let total: f64 = w.iter().sum();
        if total <= 0.0 {
            bail!(
                "no source has a positive weight (sources: {names:?})\nhint: check --source-weights against the corpus"
            );
        }
        Ok(w.iter().map(|x| x / total).collect())
    }
}

/// One document of the tokenized corpus, as the planner sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DocInfo {
    /// tokens (separators not included)
    pub len: u32,
    /// global source id
    pub source: u32,
}

/// Deterministic uniform draw in [0, 1) for document `doc` of input `file` (splitmix64 of the three).
pub fn coin(seed: u64, file: u64, doc: u64) -> f64 {
    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    let h = mix(mix(mix(seed) ^ file) ^ doc);
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// Streaming selector: offer documents in stream order, get how many output tokens to take.
pub struct Selector<'a> {
    params: &'a StrategyParams,
    seed: u64,
    sep: u64,
    /// pool of each source id (all 0 for global strategies)
    pool_of: Vec<usize>,
    /// budget of each pool (None: unlimited)
    pub budgets: Vec<Option<u64>>,
    /// tokens taken per pool so far
    pub used: Vec<u64>,
}

impl<'a> Selector<'a> {
    /// A selector for `n_sources` sources; `shares` (per source) is required for per-source strategies.
    pub fn new(params: &'a StrategyParams, seed: u64, sep: u64, n_sources: usize, shares: Option<&[f64]>) -> Self {
        let (pool_of, budgets) = match (params.per_source(), shares) {
            (true, Some(sh)) => {
                let b = params.budget.unwrap_or(0) as f64;
                ((0..n_sources).collect(), sh.iter().map(|s| Some((b * s).round() as u64)).collect())
            }
            _ => (vec![0; n_sources], vec![params.budget]),
        };
        let used = vec![0; budgets.len()];
        Selector { params, seed, sep, pool_of, budgets, used }
    }

    fn room(&self, pool: usize) -> u64 {
        self.budgets[pool].map_or(u64::MAX, |b| b.saturating_sub(self.used[pool]))
    }

    /// Output tokens to take of document `doc` of input `file` in the sampling pass (0 = skip).
    pub fn offer(&mut self, file: u64, doc: u64, d: DocInfo) -> u64 {
        let pool = self.pool_of[d.source as usize];
        let room = self.room(pool);
        if room == 0 {
            return 0;
        }
        let long = u64::from(d.len) >= self.params.threshold;
        if self.params.samples_short() && !long && coin(self.seed, file, doc) >= self.params.short_keep {
            return 0;
        }
        let take = self.params.out_len(u64::from(d.len), self.sep).min(room);
        self.used[pool] += take;
        take
    }

    /// Output tokens to take of a short document the sampling pass rejected, when its pool is not full.
    pub fn top_up(&mut self, d: DocInfo) -> u64 {
        let pool = self.pool_of[d.source as usize];
        let room = self.room(pool);
        if room == 0 || u64::from(d.len) >= self.params.threshold || self.budgets[pool].is_none() {
            return 0;
        }
        let take = self.params.out_len(u64::from(d.len), self.sep).min(room);
        self.used[pool] += take;
        take
    }

    /// True when every pool has a budget and it is full.
    pub fn full(&self) -> bool {
        (0..self.budgets.len()).all(|p| self.budgets[p].is_some() && self.room(p) == 0)
    }

    /// True when some pool with a budget is not full.
    pub fn any_short(&self) -> bool {
        (0..self.budgets.len()).any(|p| self.budgets[p].is_some() && self.room(p) > 0)
    }
}
