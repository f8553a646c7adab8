//! `harpe search-bases`: HARPE base sets — the paper's Table 2, uniform sets (Eq. 9) and the
//! peak–valley search (`bases::search`) — printed as JSON or a `[rope]` TOML snippet, with the
//! waveform plot (`bases::plot`).
//!
//! Reference: Lian et al. (arXiv 2412.07171) §4.2 and Table 2. The non-obvious decision: with `--model`
//! the head count comes from its config.json and one base per kv head is produced (query heads of a GQA
//! group share their kv head's base). Not done here: the search maths (`bases::search`), drawing
//! (`bases::plot`), applying bases to a model (`model::rope`).
use crate::model::rope::{uniform_bases, BaseOrder, TABLE2_BASES};
use crate::research::bases::plot;
use crate::research::bases::search::*;
use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Which base set `harpe search-bases` produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// the paper's Table 2: 32 bases from 1.00m to 4.54m (needs 32 heads)
    Table2,
    /// Eq. 9: N bases evenly spaced over [--min, --max]
    Uniform,
    /// HARPE-PV v1: deterministic peak–valley search (a reconstruction; does not reproduce Table 2)
    PeakValley,
}

/// Defaults of the paper's §4.2 setting.
const DEFAULT_MIN: f64 = 1e6;
const DEFAULT_MAX: f64 = 5e6;
const DEFAULT_STRIDE: f64 = 30000.0;
const DEFAULT_HEADS: usize = 32;
const DEFAULT_HEAD_DIM: usize = 128;

/// `harpe search-bases`: choose HARPE's per-head RoPE bases.
#[derive(clap::Args, Debug)]
#[command(after_help = "The bases are per kv head; query heads of a GQA group share their kv head's base.\n\
HARPE-PV v1 (peak-valley) is our documented reconstruction of the paper's Algorithm 1 and does not reproduce \
Table 2.\nExamples:\n  harpe search-bases --method table2 --out rope.toml\n  \
harpe search-bases --method peak-valley --heads 32 --json --plot bases.png\n  \
harpe search-bases --method uniform --model ./Llama-2-7b-hf --order desc")]
pub struct SearchBasesArgs {
    /// Which base set: table2 (the paper's 32 bases), uniform (evenly spaced, Eq. 9) or peak-valley (the
    /// HARPE-PV v1 search)
    #[arg(long, value_enum, default_value_t = Method::Table2)]
    pub method: Method,
    /// Number of bases (one per kv head). Default: the model's kv heads with --model, else 32. With
    /// --model it must equal the model's attention heads or its kv heads
    #[arg(long, value_name = "N")]
    pub heads: Option<usize>,
    /// HF model directory: reads num_attention_heads, num_key_value_heads and head_dim from its
    /// config.json; one base per kv head
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Smallest base, b_min (uniform, peak-valley) [default: 1e6]
    #[arg(long, value_name = "BASE")]
    pub min: Option<f64>,
    /// Largest base, b_max (uniform, peak-valley) [default: 5e6]
    #[arg(long, value_name = "BASE")]
    pub max: Option<f64>,
    /// Candidate spacing s of Eq. 10: candidates are b_min + i·s up to b_max (peak-valley) [default: 30000]
    #[arg(long, value_name = "S")]
    pub stride: Option<f64>,
    /// Head assignment: asc gives head 0 the smallest base, desc the largest
    #[arg(long, value_enum, default_value_t = BaseOrder::Asc)]
    pub order: BaseOrder,
    /// Rotary head dimension d of the waveform (peak-valley, --plot) [default: 128, or the model's]
    #[arg(long, value_name = "D")]
    pub head_dim: Option<usize>,
    /// Original context length L0; the search scales Attention Buckets' windows by ρ = target / orig
    #[arg(long, value_name = "TOKENS", default_value_t = 4096)]
    pub orig_len: usize,
    /// Target context length L (peak-valley, --plot)
    #[arg(long, value_name = "TOKENS", default_value_t = 131072)]
    pub target_len: usize,
    /// Write a TOML snippet with the [rope] section of a run config (scheme = "harpe", head_bases)
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Print one JSON object on stdout (method, bases in head order, parameters, picks) instead of text
    #[arg(long)]
    pub json: bool,
    /// Draw the waveforms of the chosen bases, their peaks and valleys, and their coverage of the
    /// distance range into a PNG
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
}

/// The head counts of an HF model directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelHeads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

#[derive(Deserialize)]
struct HfHeads {
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    hidden_size: Option<usize>,
    head_dim: Option<usize>,
}

/// Read the head counts from `dir/config.json` (num_key_value_heads defaults to num_attention_heads).
pub fn read_model_heads(dir: &Path) -> Result<ModelHeads> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "cannot read {}\nhint: --model takes a Hugging Face model directory containing config.json",
            path.display()
        )
    })?;
    let c: HfHeads = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a valid model config\nhint: check the JSON syntax", path.display()))?;
    let Some(heads) = c.num_attention_heads.filter(|&h| h > 0) else {
        bail!(
            "{}: field num_attention_heads is missing or 0\nhint: is this a Llama-family config.json?",
            path.display()
        );
    };
    let kv_heads = c.num_key_value_heads.unwrap_or(heads);
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        bail!(
            "{}: num_key_value_heads = {kv_heads} does not divide num_attention_heads = {heads}\nhint: fix config.json",
            path.display()
        );
    }
    let head_dim = match (c.head_dim, c.hidden_size) {
        (Some(d), _) => d,
        (None, Some(h)) if h.is_multiple_of(heads) => h / heads,
        _ => DEFAULT_HEAD_DIM,
    };
    Ok(ModelHeads { heads, kv_heads, head_dim })
}

/// Number of bases to produce: the model's kv heads (checking `--heads` against the model), else
/// `--heads`, else 32.
pub fn resolve_heads(heads: Option<usize>, model: Option<(&Path, ModelHeads)>) -> Result<usize> {
    match (heads, model) {
        (Some(0), _) => bail!("--heads 0: at least one head is needed\nhint: Llama-2-7B has --heads 32"),
        (Some(n), Some((dir, m))) if n != m.heads && n != m.kv_heads => bail!(
            "--heads {n} matches neither num_attention_heads = {} nor num_key_value_heads = {} of {}\nhint: drop --heads; with --model one base per kv head ({}) is produced",
            m.heads,
            m.kv_heads,
            dir.join("config.json").display(),
            m.kv_heads
        ),
        (_, Some((_, m))) => Ok(m.kv_heads),
        (Some(n), None) => Ok(n),
        (None, None) => Ok(DEFAULT_HEADS),
    }
}

/// The `[rope]` section of a run config for these bases, as TOML text with a comment header.
pub fn rope_toml(bases: &[f64], comment: &str) -> Result<String> {
    #[derive(Serialize)]
    struct Rope<'a> {
        scheme: &'static str,
        head_bases: &'a [f64],
    }
    #[derive(Serialize)]
    struct Snippet<'a> {
        rope: Rope<'a>,
    }
    let body = toml::to_string(&Snippet { rope: Rope { scheme: "harpe", head_bases: bases } })
        .context("cannot serialize the [rope] snippet")?;
    let nl = if body.ends_with('\n') { "" } else { "\n" };
    Ok(format!("# {comment}\n{body}{nl}"))
}

/// Run `harpe search-bases`.
pub fn run(a: SearchBasesArgs) -> Result<()> {
    let model = match &a.model {
        Some(dir) => Some((dir.as_path(), read_model_heads(dir)?)),
        None => None,
    };
    let n = resolve_heads(a.heads, model)?;
    if let (Some(h), Some((_, m))) = (a.heads, model) {
        if h != m.kv_heads {
            eprintln!(
                "note: the model has {} attention heads and {} kv heads; producing {n} bases, one per kv head",
                m.heads, m.kv_heads
            );
        }
    }
    let head_dim = a.head_dim.or(model.map(|(_, m)| m.head_dim)).unwrap_or(DEFAULT_HEAD_DIM);
    let params = PvParams::scaled(head_dim, a.orig_len, a.target_len)?;
    let mut json = serde_json::json!({ "method": a.method, "heads": n, "order": a.order });
    let Chosen { mut bases, comment, found } = match a.method {
        Method::Table2 => table2(&a, n)?,
        Method::Uniform => uniform(&a, n, &mut json)?,
        Method::PeakValley => peak_valley(&a, n, &params, &mut json)?,
    };
    if a.order == BaseOrder::Desc {
        bases.reverse();
    }
    json["bases"] = serde_json::to_value(&bases)?;
    let comment =
        format!("{comment}; head order {}", if a.order == BaseOrder::Asc { "ascending" } else { "descending" });
    if let Some(out) = &a.out {
        crate::util::write_atomic(out, rope_toml(&bases, &comment)?.as_bytes())?;
        eprintln!("wrote the [rope] snippet to {}", out.display());
    }
    if let Some(png) = &a.plot {
        // (N,) fp/fv in head order; table2 and uniform compute them here, the search already has them
        let ex: Vec<Extrema> = match found {
            Some(mut e) => {
                if a.order == BaseOrder::Desc {
                    e.reverse();
                }
                e
            }
            None => bases.par_iter().map(|&b| extrema(b, &params)).collect(),
        };
        plot::plot_waveforms(png, &ex, &params)?;
        eprintln!("wrote the waveform plot to {}", png.display());
    }
    if a.json {
        println!("{}", serde_json::to_string(&json)?);
    } else {
        print_text(&comment, &bases, &json);
    }
    Ok(())
}

/// A produced base set in ascending order, its comment line, and the search's extrema when it ran.
struct Chosen {
    bases: Vec<f64>,
    comment: String,
    found: Option<Vec<Extrema>>,
}

/// `--method table2`: the paper's 32 fixed bases.
fn table2(a: &SearchBasesArgs, n: usize) -> Result<Chosen> {
    for (flag, v) in [("--min", a.min), ("--max", a.max), ("--stride", a.stride)] {
        if v.is_some() {
            bail!("{flag} does not apply to --method table2 (its 32 bases are fixed)\nhint: use --method uniform or peak-valley to choose a range");
        }
    }
    if n != TABLE2_BASES.len() {
        bail!(
            "--method table2 has {} bases, but {n} are needed (one per kv head)\nhint: use --method uniform or peak-valley for {n} heads",
            TABLE2_BASES.len()
        );
    }
    Ok(Chosen {
        bases: TABLE2_BASES.iter().map(|&b| b as f64).collect::<Vec<f64>>(),
        comment: "HARPE Table 2 (Lian et al.)".to_string(),
        found: None,
    })
}

/// `--method uniform`: N bases evenly spaced over [min, max] (Eq. 9); records the range in `json`.
fn uniform(a: &SearchBasesArgs, n: usize, json: &mut serde_json::Value) -> Result<Chosen> {
    if a.stride.is_some() {
        bail!("--stride does not apply to --method uniform (the spacing is (max - min)/(N - 1))\nhint: drop --stride, or use --method peak-valley");
    }
    let (min, max) = (a.min.unwrap_or(DEFAULT_MIN), a.max.unwrap_or(DEFAULT_MAX));
    check_range(min, max)?;
    json["min"] = min.into();
    json["max"] = max.into();
    let b = uniform_bases(min, max, n, BaseOrder::Asc)?;
    Ok(Chosen { bases: b, comment: format!("uniform bases (Eq. 9), min {min}, max {max}"), found: None })
}

/// `--method peak-valley`: the HARPE-PV v1 search; records its range, parameters and picks in `json`.
fn peak_valley(a: &SearchBasesArgs, n: usize, params: &PvParams, json: &mut serde_json::Value) -> Result<Chosen> {
    let (min, max) = (a.min.unwrap_or(DEFAULT_MIN), a.max.unwrap_or(DEFAULT_MAX));
    let stride = a.stride.unwrap_or(DEFAULT_STRIDE);
    let cands = candidates(min, max, stride)?;
    let t0 = std::time::Instant::now();
    let r = peak_valley_search(min, &cands, n, params)?;
    if !a.json {
        eprintln!("searched {} candidates in {:.2} s", cands.len(), t0.elapsed().as_secs_f64());
    }
    json["min"] = min.into();
    json["max"] = max.into();
    json["stride"] = stride.into();
    json["candidates"] = cands.len().into();
    json["params"] = serde_json::to_value(params)?;
    json["picks"] = serde_json::to_value(&r.picks)?;
    json["extrema"] = serde_json::to_value(&r.extrema)?;
    json["skipped"] = serde_json::to_value(&r.skipped)?;
    let comment = format!(
        "HARPE-PV v1 peak-valley search (a reconstruction; does not reproduce Table 2): min {min}, max {max}, stride {stride}, head_dim {}, grid [{}, {}]",
        params.head_dim, params.grid_lo, params.grid_hi
    );
    Ok(Chosen { bases: r.bases, comment, found: Some(r.extrema) })
}

/// The text output: the comment, one line per head, and the search's pick order when there is one.
fn print_text(comment: &str, bases: &[f64], json: &serde_json::Value) {
    println!("# {comment}");
    println!("{:>5}  {:>14}", "head", "base");
    for (h, b) in bases.iter().enumerate() {
        println!("{h:>5}  {b:>14.1}");
    }
    if let Some(picks) = json.get("picks").and_then(|p| p.as_array()) {
        let order: Vec<String> = picks
            .iter()
            .map(|p| match p["d"].as_u64() {
                Some(d) => format!("{} (d={d})", p["base"]),
                None => format!("{} (start)", p["base"]),
            })
            .collect();
        println!("pick order: {}", order.join(", "));
    }
}
