//! RoPE schemes: every classic extension and HARPE's per-head bases, as inverse frequencies and
//! cos/sin tables.
//!
//! Reference: HARPE (Lian et al., arXiv 2412.07171) §3; HF `modeling_rope_utils.py` for the baselines.
//! The non-obvious decision: angles `pos * inv_freq` are computed in f64 and only the final cos/sin are
//! stored in f32 (in f32 the angle at position 131072 is off by ~0.008 rad). `RopeParity::Hf` reproduces
//! transformers' f32 arithmetic instead, for checkpoint-equivalence tests. Tables have shape
//! (Htab, T, D/2) with Htab = 1 for schemes that share one frequency set across heads and Htab = Hkv for
//! HARPE (query heads of a GQA group share their kv head's base). What this file does not do: apply the
//! rotation (that is `ops::rotary`).
use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

/// HARPE Table 2 (Lian et al.): the 32 bases of the main results, head order, exact integers.
pub const TABLE2_BASES: [u64; 32] = [
    1_000_000, 1_150_000, 1_300_000, 1_450_000, 2_170_000, 2_200_000, 2_230_000, 2_470_000, 2_500_000, 2_650_000,
    2_680_000, 2_710_000, 2_740_000, 2_800_000, 2_830_000, 2_920_000, 3_010_000, 3_040_000, 3_100_000, 3_130_000,
    3_160_000, 3_220_000, 3_430_000, 3_460_000, 3_610_000, 3_880_000, 4_090_000, 4_150_000, 4_390_000, 4_450_000,
    4_510_000, 4_540_000,
];

/// Head order for uniform base sets (the HARPE paper's same-stride ascending/descending variants).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BaseOrder {
    /// head 0 gets the smallest base
    Asc,
    /// head 0 gets the largest base
    Desc,
}

/// Eq. 9: `n` bases evenly spaced over [min, max] (f64, no rounding), in the given head order.
pub fn uniform_bases(min: f64, max: f64, n: usize, order: BaseOrder) -> Result<Vec<f64>> {
    if !(min > 0.0 && max > min) {
        bail!("uniform bases need 0 < min < max (got min {min}, max {max})\nhint: e.g. --min 1e6 --max 5e6");
    }
    if n == 0 {
        bail!("uniform bases need at least one head\nhint: pass the number of kv heads");
    }
    let step = if n > 1 { (max - min) / (n - 1) as f64 } else { 0.0 };
    let mut b: Vec<f64> = (0..n).map(|h| min + h as f64 * step).collect();
    if order == BaseOrder::Desc {
        b.reverse();
    }
    Ok(b)
}

/// How cos/sin are computed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum RopeParity {
    /// f64 inverse frequencies, angles and cos/sin (accurate at 128K); the default
    #[default]
    F64,
    /// transformers' arithmetic: f32 inverse frequencies, f32 product, f32 cos/sin
    Hf,
}

/// One RoPE scheme with all of its parameters. `theta` is the (pre-scaling) base.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "scheme", rename_all = "kebab-case", deny_unknown_fields)]
pub enum RopeScheme {
    /// Plain RoPE; a changed `theta` is ABF (Xiong et al.).
    Default { theta: f64 },
    /// Position interpolation: inv_freq / factor.
    Linear { theta: f64, factor: f64 },
    /// NTK-aware static: base theta * factor^(d/(d-2)).
    NtkStatic { theta: f64, factor: f64 },
    /// Dynamic NTK: base recomputed from the sequence length above `original_max`.
    Dynamic { theta: f64, factor: f64, original_max: usize },
    /// YaRN: NTK-by-parts ramp between the correction dims plus an attention factor on cos and sin.
    Yarn {
        theta: f64,
        factor: f64,
        original_max: usize,
        #[serde(default = "default_beta_fast")]
        beta_fast: f64,
        #[serde(default = "default_beta_slow")]
        beta_slow: f64,
        #[serde(default)]
        mscale: Option<f64>,
        #[serde(default)]
        mscale_all_dim: Option<f64>,
        #[serde(default)]
        attention_factor: Option<f64>,
        #[serde(default = "default_true")]
        truncate: bool,
    },
    /// Llama-3.1 frequency-dependent scaling.
    Llama3 { theta: f64, factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max: usize },
    /// LongRoPE: per-dimension rescale factors, short below `original_max`, long above.
    Longrope {
        theta: f64,
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max: usize,
        /// max_position_embeddings / original_max (for the default attention factor)
        factor: f64,
        #[serde(default)]
        attention_factor: Option<f64>,
    },
    /// HARPE: one base per kv head (the same map in every layer unless `layer_head_bases` is given).
    Harpe {
        /// a list, `"table2"`, or `{ uniform = { min, max, heads, order } }` (resolved to a list on load)
        #[serde(deserialize_with = "de_head_bases")]
        head_bases: Vec<f64>,
        #[serde(default)]
        layer_head_bases: Option<Vec<Vec<f64>>>,
    },
}

/// How a HARPE base set may be written in a config file.
#[derive(Deserialize)]
#[serde(untagged)]
enum BasesSpec {
    List(Vec<f64>),
    Named(String),
    Uniform { uniform: UniformSpec },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UniformSpec {
    min: f64,
    max: f64,
    heads: usize,
    #[serde(default = "default_order")]
    order: BaseOrder,
}

fn default_order() -> BaseOrder {
    BaseOrder::Asc
}

/// `head_bases` as a list, as the paper's `"table2"`, or as `{ uniform = { min, max, heads, order } }`.
fn de_head_bases<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Vec<f64>, D::Error> {
    use serde::de::Error;
    match BasesSpec::deserialize(d)? {
        BasesSpec::List(v) => Ok(v),
        BasesSpec::Named(n) if n == "table2" => Ok(TABLE2_BASES.iter().map(|&b| b as f64).collect()),
        BasesSpec::Named(n) => Err(D::Error::custom(format!(
            "unknown base set `{n}` (hint: use \"table2\", a list of numbers, or {{ uniform = {{ min, max, heads, order }} }})"
        ))),
        BasesSpec::Uniform { uniform: u } => uniform_bases(u.min, u.max, u.heads, u.order).map_err(|e| D::Error::custom(format!("{e:#}"))),
    }
}

fn default_beta_fast() -> f64 {
    32.0
}
fn default_beta_slow() -> f64 {
    1.0
}
fn default_true() -> bool {
    true
}

/// HF `get_mscale` (YaRN attention temperature).
fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// The YaRN correction range (low, high) in dimension-pair index units, as HF computes it.
pub fn yarn_correction_range(
    theta: f64,
    head_dim: usize,
    original_max: usize,
    beta_fast: f64,
    beta_slow: f64,
    truncate: bool,
) -> (f64, f64) {
    let d = head_dim as f64;
    let dim_for = |rot: f64| d * (original_max as f64 / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
    let (mut low, mut high) = (dim_for(beta_fast), dim_for(beta_slow));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    (low.max(0.0), high.min(d - 1.0))
}

/// Frequencies of one scheme at one sequence length: per table, D/2 inverse frequencies.
#[derive(Clone, Debug)]
pub struct InvFreq {
    /// (Htab, D/2): one row when all heads share the frequencies, Hkv rows for HARPE
    pub rows: Vec<Vec<f64>>,
    /// multiplies both cos and sin (YaRN, LongRoPE); 1 elsewhere
    pub attention_factor: f64,
}

fn default_inv_freq(theta: f64, head_dim: usize) -> Vec<f64> {
    (0..head_dim / 2).map(|j| 1.0 / theta.powf((2 * j) as f64 / head_dim as f64)).collect()
}

impl RopeScheme {
    /// Short scheme name as used in configs and on the command line.
    pub fn name(&self) -> &'static str {
        match self {
            RopeScheme::Default { .. } => "default",
            RopeScheme::Linear { .. } => "linear",
            RopeScheme::NtkStatic { .. } => "ntk-static",
            RopeScheme::Dynamic { .. } => "dynamic",
            RopeScheme::Yarn { .. } => "yarn",
            RopeScheme::Llama3 { .. } => "llama3",
            RopeScheme::Longrope { .. } => "longrope",
            RopeScheme::Harpe { .. } => "harpe",
        }
    }

    /// Check the scheme against the model's head counts; per-head base lists must have Hkv entries
    /// (or H entries that agree within every GQA group, which are then reduced to Hkv).
    pub fn validate(&mut self, n_heads: usize, n_kv_heads: usize, head_dim: usize, n_layers: usize) -> Result<()> {
        let pos = |name: &str, v: f64| -> Result<()> {
            if !(v.is_finite() && v > 0.0) {
                bail!(
                    "rope {name} must be a positive finite number, got {v}\nhint: fix the rope section of the config"
                );
            }
            Ok(())
        };
        match self {
            RopeScheme::Default { theta } => pos("theta", *theta)?,
            RopeScheme::Linear { theta, factor }
            | RopeScheme::NtkStatic { theta, factor }
            | RopeScheme::Dynamic { theta, factor, .. } => {
                pos("theta", *theta)?;
                pos("factor", *factor)?;
            }
            RopeScheme::Yarn { theta, factor, .. } | RopeScheme::Llama3 { theta, factor, .. } => {
                pos("theta", *theta)?;
                pos("factor", *factor)?;
            }
            RopeScheme::Longrope { theta, short_factor, long_factor, .. } => {
                pos("theta", *theta)?;
                for (n, f) in [("short_factor", &short_factor), ("long_factor", &long_factor)] {
                    if f.len() != head_dim / 2 {
                        bail!(
                            "longrope {n} has {} entries, the model needs head_dim/2 = {}\nhint: give one factor per rotary dimension pair",
                            f.len(),
                            head_dim / 2
                        );
                    }
                }
            }
            RopeScheme::Harpe { head_bases, layer_head_bases } => {
                *head_bases = reduce_bases(head_bases, n_heads, n_kv_heads, "head_bases")?;
                if let Some(lb) = layer_head_bases {
                    if lb.len() != n_layers {
                        bail!(
                            "layer_head_bases has {} rows, the model has {n_layers} layers\nhint: give one base list per layer, or only head_bases",
                            lb.len()
                        );
                    }
                    for (l, row) in lb.iter_mut().enumerate() {
                        *row = reduce_bases(row, n_heads, n_kv_heads, &format!("layer_head_bases[{l}]"))?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Inverse frequencies for layer `layer` when the sequence being processed spans positions
    /// [0, seq_len) (dynamic NTK and LongRoPE depend on it, as in HF).
    pub fn inv_freq(&self, head_dim: usize, layer: usize, seq_len: usize) -> InvFreq {
        let d = head_dim as f64;
        let one = |rows: Vec<f64>| InvFreq { rows: vec![rows], attention_factor: 1.0 };
        match self {
            RopeScheme::Default { theta } => one(default_inv_freq(*theta, head_dim)),
            RopeScheme::Linear { theta, factor } => {
                one(default_inv_freq(*theta, head_dim).into_iter().map(|f| f / factor).collect())
            }
            RopeScheme::NtkStatic { theta, factor } => {
                one(default_inv_freq(theta * factor.powf(d / (d - 2.0)), head_dim))
            }
            RopeScheme::Dynamic { theta, factor, original_max } => {
                let l = seq_len.max(*original_max) as f64;
                let base = theta * ((factor * l / *original_max as f64) - (factor - 1.0)).powf(d / (d - 2.0));
                one(default_inv_freq(base, head_dim))
            }
            RopeScheme::Yarn {
                theta,
                factor,
                original_max,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let extrap = default_inv_freq(*theta, head_dim);
                let (low, mut high) =
                    yarn_correction_range(*theta, head_dim, *original_max, *beta_fast, *beta_slow, *truncate);
                if low == high {
                    high += 0.001;
                }
                let rows = extrap
                    .iter()
                    .enumerate()
                    .map(|(j, &e)| {
                        let ramp = ((j as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrap_w = 1.0 - ramp;
                        (e / factor) * (1.0 - extrap_w) + e * extrap_w
                    })
                    .collect();
                let af = attention_factor.unwrap_or_else(|| match (mscale, mscale_all_dim) {
                    (Some(m), Some(ma)) => yarn_get_mscale(*factor, *m) / yarn_get_mscale(*factor, *ma),
                    _ => yarn_get_mscale(*factor, 1.0),
                });
                InvFreq { rows: vec![rows], attention_factor: af }
            }
            RopeScheme::Llama3 { theta, factor, low_freq_factor, high_freq_factor, original_max } => {
                let old = *original_max as f64;
                let (low, high) = (*low_freq_factor, *high_freq_factor);
                one(default_inv_freq(*theta, head_dim)
                    .into_iter()
                    .map(|f| llama3_freq(f, *factor, low, high, old))
                    .collect())
            }
            RopeScheme::Longrope { theta, short_factor, long_factor, original_max, factor, attention_factor } => {
                let ext = if seq_len > *original_max { long_factor } else { short_factor };
                let rows = (0..head_dim / 2).map(|j| 1.0 / (ext[j] * theta.powf((2 * j) as f64 / d))).collect();
                let af = attention_factor.unwrap_or_else(|| {
                    if *factor <= 1.0 {
                        1.0
                    } else {
                        (1.0 + factor.ln() / (*original_max as f64).ln()).sqrt()
                    }
                });
                InvFreq { rows: vec![rows], attention_factor: af }
            }
            RopeScheme::Harpe { head_bases, layer_head_bases } => {
                let bases = layer_head_bases.as_ref().and_then(|lb| lb.get(layer)).unwrap_or(head_bases);
                InvFreq { rows: bases.iter().map(|&b| default_inv_freq(b, head_dim)).collect(), attention_factor: 1.0 }
            }
        }
    }

    /// Rows of one cos/sin table (`tables`) in a model with `kv_heads` kv heads: one per kv head's base
    /// under HARPE (the bases are reduced to one per kv head when the config is validated), else one
    /// row all heads share.
    pub fn table_rows(&self, kv_heads: usize) -> usize {
        match self {
            RopeScheme::Harpe { .. } => kv_heads,
            _ => 1,
        }
    }

    /// True when different layers use different frequencies (tables must be rebuilt per layer).
    pub fn per_layer(&self) -> bool {
        matches!(self, RopeScheme::Harpe { layer_head_bases: Some(_), .. })
    }

    /// cos/sin tables for the positions `at` (`at.seq_len` is the length the scheme adapts to).
    pub fn tables(
        &self,
        head_dim: usize,
        layer: usize,
        at: Positions,
        parity: RopeParity,
        device: &Device,
    ) -> Result<RopeTables> {
        let Positions { start, len, seq_len } = at;
        let inv = self.inv_freq(head_dim, layer, seq_len);
        let half = head_dim / 2;
        let htab = inv.rows.len();
        let mut cos = vec![0f32; htab * len * half];
        let mut sin = vec![0f32; htab * len * half];
        for (h, row) in inv.rows.iter().enumerate() {
            for t in 0..len {
                let pos = start + t;
                let o = (h * len + t) * half;
                for (j, &f) in row.iter().enumerate() {
                    let (c, s) = match parity {
                        RopeParity::F64 => {
                            let a = pos as f64 * f;
                            (a.cos() * inv.attention_factor, a.sin() * inv.attention_factor)
                        }
                        RopeParity::Hf => {
                            let a = pos as f32 * f as f32;
                            let af = inv.attention_factor as f32;
                            ((a.cos() * af) as f64, (a.sin() * af) as f64)
                        }
                    };
                    cos[o + j] = c as f32;
                    sin[o + j] = s as f32;
                }
            }
        }
        Ok(RopeTables {
            cos: Tensor::from_vec(cos, (htab, len, half), device)?,
            sin: Tensor::from_vec(sin, (htab, len, half), device)?,
        })
    }
}

/// Llama 3.1's smoothing of one inverse frequency: wavelengths shorter than `old / high` are kept, longer than
/// `old / low` divided by `factor`, those between interpolated.
fn llama3_freq(f: f64, factor: f64, low_freq_factor: f64, high_freq_factor: f64, old: f64) -> f64 {
    let low_wl = old / low_freq_factor;
    let high_wl = old / high_freq_factor;
    let wl = 2.0 * std::f64::consts::PI / f;
    if wl < high_wl {
        f
    } else if wl > low_wl {
        f / factor
    } else {
        let s = (old / wl - low_freq_factor) / (high_freq_factor - low_freq_factor);
        (1.0 - s) * f / factor + s * f
    }
}

/// Bring a per-head base list to one base per kv head.
fn reduce_bases(bases: &[f64], n_heads: usize, n_kv_heads: usize, what: &str) -> Result<Vec<f64>> {
    for (i, b) in bases.iter().enumerate() {
        if !(b.is_finite() && *b > 1.0) {
            bail!("{what}[{i}] = {b} is not a valid RoPE base\nhint: bases are numbers > 1, e.g. 1e6");
        }
    }
    if bases.len() == n_kv_heads {
        return Ok(bases.to_vec());
    }
    if bases.len() == n_heads {
        let rep = n_heads / n_kv_heads;
        let out: Vec<f64> = bases.chunks(rep).map(|g| g[0]).collect();
        for (g, chunk) in bases.chunks(rep).enumerate() {
            if chunk.iter().any(|&b| b != chunk[0]) {
                bail!(
                    "{what} gives different bases to query heads {}..{} that share kv head {g}\nhint: with GQA give one base per kv head ({n_kv_heads} values); q and k of a head must share a base",
                    g * rep,
                    g * rep + rep - 1
                );
            }
        }
        return Ok(out);
    }
    bail!(
        "{what} has {} bases, but the model has {n_heads} attention heads and {n_kv_heads} kv heads\nhint: give one base per kv head ({n_kv_heads} values)",
        bases.len()
    )
}

/// Positions `start..start + len` of a sequence of `seq_len` tokens (dynamic NTK and LongRoPE adapt to
/// `seq_len`; a sequence-parallel rank's part has `seq_len` > `start + len`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Positions {
    pub start: usize,
    pub len: usize,
    pub seq_len: usize,
}

impl Positions {
    /// Positions `start..start + len` of a sequence that ends with them (`seq_len = start + len`).
    pub fn new(start: usize, len: usize) -> Positions {
        Positions { start, len, seq_len: start + len }
    }
}

/// cos/sin of shape (Htab, T, D/2), f32, attention factor already multiplied in.
#[derive(Clone, Debug)]
pub struct RopeTables {
    pub cos: Tensor,
    pub sin: Tensor,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yarn(factor: f64) -> RopeScheme {
        RopeScheme::Yarn {
            theta: 10000.0,
            factor,
            original_max: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: None,
            mscale_all_dim: None,
            attention_factor: None,
            truncate: true,
        }
    }

    #[test]
    fn yarn_llama2_to_128k_matches_spec() {
        // YaRN: beta_fast 32, beta_slow 1 -> low 20, high 46 (raw 20.94 / 45.03); factor 1.3466
        let raw = yarn_correction_range(10000.0, 128, 4096, 32.0, 1.0, false);
        assert!((raw.0 - 20.94).abs() < 0.01 && (raw.1 - 45.03).abs() < 0.01, "{raw:?}");
        assert_eq!(yarn_correction_range(10000.0, 128, 4096, 32.0, 1.0, true), (20.0, 46.0));
        let inv = yarn(32.0).inv_freq(128, 0, 131072);
        assert!((inv.attention_factor - 1.3466).abs() < 1e-4);
        assert!((inv.attention_factor.powi(2) - 1.8133).abs() < 1e-3);
        let base = default_inv_freq(10000.0, 128);
        // below `low`: extrapolated (unchanged); above `high`: interpolated (divided by s)
        assert_eq!(inv.rows[0][10], base[10]);
        assert!((inv.rows[0][60] - base[60] / 32.0).abs() < 1e-18);
        assert!(inv.rows[0][33] < base[33] && inv.rows[0][33] > base[33] / 32.0);
    }

    #[test]
    fn ntk_dynamic_longrope_llama3_match_spec() {
        let ntk = RopeScheme::NtkStatic { theta: 10000.0, factor: 32.0 }.inv_freq(128, 0, 0);
        let b = 1.0 / ntk.rows[0][1].powf(64.0); // inv[1] = b^(-2/128)
        assert!((b - 338_097.0).abs() / 338_097.0 < 1e-4, "static NTK base {b}");
        let dynb = RopeScheme::Dynamic { theta: 10000.0, factor: 32.0, original_max: 4096 }.inv_freq(128, 0, 131072);
        let b = 1.0 / dynb.rows[0][1].powf(64.0);
        assert!((b - 1.108e7).abs() / 1.108e7 < 1e-3, "dynamic base {b}");
        // below the original length dynamic NTK is plain RoPE
        let short = RopeScheme::Dynamic { theta: 10000.0, factor: 32.0, original_max: 4096 }.inv_freq(128, 0, 100);
        assert_eq!(short.rows[0], default_inv_freq(10000.0, 128));
        let lr = RopeScheme::Longrope {
            theta: 10000.0,
            short_factor: vec![1.0; 64],
            long_factor: vec![2.0; 64],
            original_max: 4096,
            factor: 32.0,
            attention_factor: None,
        };
        assert!((lr.inv_freq(128, 0, 10).attention_factor - 1.19024).abs() < 1e-5);
        assert_eq!(lr.inv_freq(128, 0, 10).rows[0][5], default_inv_freq(10000.0, 128)[5]);
        assert_eq!(lr.inv_freq(128, 0, 5000).rows[0][5], default_inv_freq(10000.0, 128)[5] / 2.0);
        let l3 = RopeScheme::Llama3 {
            theta: 500000.0,
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max: 8192,
        };
        let (inv, base) = (l3.inv_freq(128, 0, 0).rows[0].clone(), default_inv_freq(500000.0, 128));
        assert_eq!(inv[0], base[0]); // high frequency: unchanged
        assert!((inv[63] - base[63] / 8.0).abs() < 1e-20); // low frequency: divided by factor
        let lin = RopeScheme::Linear { theta: 10000.0, factor: 32.0 }.inv_freq(128, 0, 0);
        assert_eq!(lin.rows[0][7], base_of(10000.0, 7) / 32.0);
    }

    fn base_of(theta: f64, j: usize) -> f64 {
        default_inv_freq(theta, 128)[j]
    }

    #[test]
    fn f64_tables_are_accurate_at_128k() {
        // |cos_f64 - cos_hf| < 0.01 at m = 131071, and f64 is the accurate one
        for b in [1e4, 5e5, 1e6, 5e6] {
            let s = RopeScheme::Default { theta: b };
            let at = Positions { start: 131071, len: 1, seq_len: 131072 };
            let f = s.tables(128, 0, at, RopeParity::F64, &Device::Cpu).unwrap();
            let h = s.tables(128, 0, at, RopeParity::Hf, &Device::Cpu).unwrap();
            let (cf, ch) = (
                f.cos.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                h.cos.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            let max = cf.iter().zip(&ch).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(max < 0.01, "base {b}: {max}");
            // exact reference for j = 0: angle = m
            assert!((cf[0] as f64 - 131071f64.cos()).abs() < 1e-6);
        }
    }

    #[test]
    fn table2_is_the_papers_integer_grid() {
        let k = [
            0, 5, 10, 15, 39, 40, 41, 49, 50, 55, 56, 57, 58, 60, 61, 64, 67, 68, 70, 71, 72, 74, 81, 82, 87, 96, 103,
            105, 113, 115, 117, 118,
        ];
        for (b, k) in TABLE2_BASES.iter().zip(k) {
            assert_eq!(*b, 1_000_000 + k * 30_000);
        }
    }

    #[test]
    fn uniform_bases_follow_eq9() {
        let b = uniform_bases(1e6, 5e6, 32, BaseOrder::Asc).unwrap();
        assert_eq!(b[0], 1e6);
        assert!((b[31] - 5e6).abs() < 1e-6);
        assert!((b[1] - 1_129_032.258).abs() < 1e-3);
        let d = uniform_bases(1e6, 5e6, 32, BaseOrder::Desc).unwrap();
        assert_eq!(d[0], b[31]);
        assert!(uniform_bases(5e6, 1e6, 32, BaseOrder::Asc).is_err());
    }

    #[test]
    fn harpe_bases_can_be_named_in_configs() {
        #[derive(Deserialize)]
        struct Doc {
            rope: RopeScheme,
        }
        let t2: Doc = toml::from_str("[rope]\nscheme = \"harpe\"\nhead_bases = \"table2\"\n").unwrap();
        let RopeScheme::Harpe { head_bases, .. } = t2.rope else { panic!() };
        assert_eq!(head_bases.len(), 32);
        assert_eq!(head_bases[4], 2_170_000.0);
        let u: Doc = toml::from_str(
            "[rope]\nscheme = \"harpe\"\nhead_bases = { uniform = { min = 1e6, max = 5e6, heads = 8, order = \"desc\" } }\n",
        )
        .unwrap();
        assert_eq!(
            u.rope,
            RopeScheme::Harpe {
                head_bases: uniform_bases(1e6, 5e6, 8, BaseOrder::Desc).unwrap(),
                layer_head_bases: None
            }
        );
        let bad = toml::from_str::<Doc>("[rope]\nscheme = \"harpe\"\nhead_bases = \"table3\"\n");
        assert!(bad.is_err());
        let l: Doc = toml::from_str("[rope]\nscheme = \"harpe\"\nhead_bases = [1e4, 2e4]\n").unwrap();
        assert_eq!(l.rope, RopeScheme::Harpe { head_bases: vec![1e4, 2e4], layer_head_bases: None });
    }

    #[test]
    fn harpe_base_lists_are_checked_against_heads() {
        let mut s = RopeScheme::Harpe { head_bases: vec![1e4, 2e4, 3e4], layer_head_bases: None };
        let e = s.validate(8, 2, 64, 2).unwrap_err().to_string();
        assert!(e.contains("3 bases") && e.contains("hint:"), "{e}");
        // H entries that agree per GQA group reduce to Hkv
        let mut s =
            RopeScheme::Harpe { head_bases: vec![1e4, 1e4, 1e4, 1e4, 2e4, 2e4, 2e4, 2e4], layer_head_bases: None };
        s.validate(8, 2, 64, 2).unwrap();
        assert_eq!(s, RopeScheme::Harpe { head_bases: vec![1e4, 2e4], layer_head_bases: None });
        let mut s =
            RopeScheme::Harpe { head_bases: vec![1e4, 2e4, 1e4, 1e4, 2e4, 2e4, 2e4, 2e4], layer_head_bases: None };
        assert!(s.validate(8, 2, 64, 2).unwrap_err().to_string().contains("share kv head 0"));
        let mut s = RopeScheme::Harpe { head_bases: vec![1e4, 2e4], layer_head_bases: Some(vec![vec![1e4, 2e4]]) };
        assert!(s.validate(4, 2, 64, 2).is_err());
        let s = RopeScheme::Harpe {
            head_bases: vec![1e4, 2e4],
            layer_head_bases: Some(vec![vec![1e4, 2e4], vec![3e4, 4e4]]),
        };
        assert_eq!(s.inv_freq(8, 1, 0).rows[0][1], 1.0 / 3e4f64.powf(0.25));
        let tab = s.tables(8, 1, Positions { start: 0, len: 3, seq_len: 3 }, RopeParity::F64, &Device::Cpu).unwrap();
        assert_eq!(tab.cos.dims(), &[2, 3, 4]);
    }
}
