//! HF `config.json` for Llama-family models, in both the transformers-4 form (`rope_theta`,
//! `rope_scaling`) and the transformers-5 form (`rope_parameters`), to and from `LlamaConfig`.
//!
//! Reference: transformers `LlamaConfig`, `modeling_rope_utils.py` (`rope_config_validation`).
//! The non-obvious decision: unknown `rope_type`s are refused (never silently treated as default), and
//! harpe writes the v4 form so that every transformers version reads classic schemes, while HARPE's
//! `"rope_type": "harpe"` makes tools that do not know it refuse the config. Not done here: weights.
use crate::model::rope::RopeScheme;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Map, Value};
use std::path::Path;

/// Everything the model needs from `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub initializer_range: f64,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Vec<u32>,
    pub torch_dtype: Option<String>,
    pub rope: RopeScheme,
}

impl LlamaConfig {
    /// A small config for tests and the demo.
    pub fn tiny(vocab_size: usize, rope: RopeScheme) -> LlamaConfig {
        LlamaConfig {
            model_type: "llama".into(),
            vocab_size,
            hidden_size: 64,
            intermediate_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 4096,
            tie_word_embeddings: false,
            initializer_range: 0.02,
            bos_token_id: Some(1),
            eos_token_id: vec![2],
            torch_dtype: Some("float32".into()),
            rope,
        }
    }

    /// Query heads per kv head.
    pub fn n_rep(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Number of parameters (embeddings, layers, norm, untied head).
    pub fn num_params(&self) -> usize {
        let (c, i, d) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let (h, hkv) = (self.num_attention_heads, self.num_key_value_heads);
        let attn = c * h * d + 2 * c * hkv * d + h * d * c;
        let mlp = 3 * c * i;
        let layer = attn + mlp + 2 * c;
        let head = if self.tie_word_embeddings { 0 } else { self.vocab_size * c };
        self.vocab_size * c + self.num_hidden_layers * layer + c + head
    }

    /// Check sizes; reduce/validate the RoPE scheme against the head counts.
    pub fn validate(&mut self, origin: &str) -> Result<()> {
        let nz = |k: &str, v: usize| -> Result<()> {
            if v == 0 {
                bail!("{origin}: `{k}` must be > 0\nhint: fix the value in config.json");
            }
            Ok(())
        };
        nz("vocab_size", self.vocab_size)?;
        nz("hidden_size", self.hidden_size)?;
        nz("intermediate_size", self.intermediate_size)?;
        nz("num_hidden_layers", self.num_hidden_layers)?;
        nz("num_attention_heads", self.num_attention_heads)?;
        nz("num_key_value_heads", self.num_key_value_heads)?;
        nz("head_dim", self.head_dim)?;
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            bail!(
                "{origin}: num_attention_heads ({}) is not a multiple of num_key_value_heads ({})\nhint: GQA needs whole groups",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!("{origin}: head_dim {} is odd\nhint: RoPE rotates pairs of dimensions", self.head_dim);
        }
        self.rope
            .validate(self.num_attention_heads, self.num_key_value_heads, self.head_dim, self.num_hidden_layers)
            .with_context(|| format!("{origin}: invalid RoPE settings"))
    }

    /// Read `config.json` (either transformers form).
    pub fn from_file(path: &Path) -> Result<LlamaConfig> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!("cannot read {}\nhint: a model directory needs config.json (HF layout)", path.display())
        })?;
        let v: Value = serde_json::from_str(&text).map_err(|e| {
            anyhow!(
                "{}: malformed JSON at line {} column {}: {e}\nhint: fix the file",
                path.display(),
                e.line(),
                e.column()
            )
        })?;
        Self::from_json(&v, &path.display().to_string())
    }

    /// Parse an HF config JSON object; `origin` names the file in errors.
    pub fn from_json(v: &Value, origin: &str) -> Result<LlamaConfig> {
        let obj =
            v.as_object().ok_or_else(|| anyhow!("{origin}: expected a JSON object\nhint: is this a config.json?"))?;
        let model_type = check_architecture(obj, origin)?;
        let usize_of = |k: &str, default: Option<usize>| -> Result<usize> {
            match obj.get(k) {
                None | Some(Value::Null) => {
                    default.ok_or_else(|| anyhow!("{origin}: missing key `{k}`\nhint: add it to config.json"))
                }
                Some(x) => x.as_u64().map(|n| n as usize).ok_or_else(|| {
                    anyhow!("{origin}: `{k}` must be a non-negative integer, got {x}\nhint: fix config.json")
                }),
            }
        };
        let f64_of = |k: &str, default: f64| -> Result<f64> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_f64()
                    .ok_or_else(|| anyhow!("{origin}: `{k}` must be a number, got {x}\nhint: fix config.json")),
            }
        };
        let hidden_size = usize_of("hidden_size", None)?;
        let num_attention_heads = usize_of("num_attention_heads", None)?;
        let num_key_value_heads = usize_of("num_key_value_heads", Some(num_attention_heads))?;
        let head_dim = usize_of("head_dim", Some(hidden_size.checked_div(num_attention_heads).unwrap_or(0)))?;
        let max_position_embeddings = usize_of("max_position_embeddings", Some(2048))?;
        let eos_token_id = eos_token_ids(obj, origin)?;
        let bos_token_id = bos_token_id(obj, origin)?;
        let rope = parse_rope(obj, max_position_embeddings, origin)?;
        let mut cfg = LlamaConfig {
            model_type,
            vocab_size: usize_of("vocab_size", None)?,
            hidden_size,
            intermediate_size: usize_of("intermediate_size", None)?,
            num_hidden_layers: usize_of("num_hidden_layers", None)?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: f64_of("rms_norm_eps", 1e-6)?,
            max_position_embeddings,
            tie_word_embeddings: obj.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            initializer_range: f64_of("initializer_range", 0.02)?,
            bos_token_id,
            eos_token_id,
            torch_dtype: obj.get("torch_dtype").or_else(|| obj.get("dtype")).and_then(Value::as_str).map(String::from),
            rope,
        };
        cfg.validate(origin)?;
        Ok(cfg)
    }

    /// The transformers-4 form of this config (what harpe writes).
    pub fn to_json(&self) -> Value {
        let mut o = Map::new();
        o.insert("architectures".into(), json!(["LlamaForCausalLM"]));
        o.insert("model_type".into(), json!(self.model_type));
        o.insert("vocab_size".into(), json!(self.vocab_size));
        o.insert("hidden_size".into(), json!(self.hidden_size));
        o.insert("intermediate_size".into(), json!(self.intermediate_size));
        o.insert("num_hidden_layers".into(), json!(self.num_hidden_layers));
        o.insert("num_attention_heads".into(), json!(self.num_attention_heads));
        o.insert("num_key_value_heads".into(), json!(self.num_key_value_heads));
        o.insert("head_dim".into(), json!(self.head_dim));
        o.insert("hidden_act".into(), json!("silu"));
        o.insert("rms_norm_eps".into(), json!(self.rms_norm_eps));
        o.insert("max_position_embeddings".into(), json!(self.max_position_embeddings));
        o.insert("tie_word_embeddings".into(), json!(self.tie_word_embeddings));
        o.insert("initializer_range".into(), json!(self.initializer_range));
        o.insert("attention_bias".into(), json!(false));
        o.insert("mlp_bias".into(), json!(false));
        if let Some(b) = self.bos_token_id {
            o.insert("bos_token_id".into(), json!(b));
        }
        match self.eos_token_id.as_slice() {
            [] => {}
            [e] => {
                o.insert("eos_token_id".into(), json!(e));
            }
            es => {
                o.insert("eos_token_id".into(), json!(es));
            }
        }
        if let Some(d) = &self.torch_dtype {
            o.insert("torch_dtype".into(), json!(d));
        }
        let (theta, scaling) = rope_to_hf(&self.rope, self.head_dim);
        o.insert("rope_theta".into(), json!(theta));
        o.insert("rope_scaling".into(), scaling);
        Value::Object(o)
    }
}

/// (rope_theta, rope_scaling) in transformers-4 keys.
fn rope_to_hf(r: &RopeScheme, head_dim: usize) -> (f64, Value) {
    match r {
        RopeScheme::Default { theta } => (*theta, Value::Null),
        RopeScheme::Linear { theta, factor } => (*theta, json!({"rope_type": "linear", "factor": factor})),
        // Not an HF type: written as the equivalent plain base so every tool computes the same frequencies.
        RopeScheme::NtkStatic { theta, factor } => {
            let d = head_dim as f64;
            (theta * factor.powf(d / (d - 2.0)), Value::Null)
        }
        RopeScheme::Dynamic { theta, factor, .. } => (*theta, json!({"rope_type": "dynamic", "factor": factor})),
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
            let mut s = json!({"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original_max,
                "beta_fast": beta_fast, "beta_slow": beta_slow});
            if let Some(m) = mscale {
                s["mscale"] = json!(m);
            }
            if let Some(m) = mscale_all_dim {
                s["mscale_all_dim"] = json!(m);
            }
            if let Some(a) = attention_factor {
                s["attention_factor"] = json!(a);
            }
            if !truncate {
                s["truncate"] = json!(false);
            }
            (*theta, s)
        }
        RopeScheme::Llama3 { theta, factor, low_freq_factor, high_freq_factor, original_max } => (
            *theta,
            json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor, "original_max_position_embeddings": original_max}),
        ),
        RopeScheme::Longrope { theta, short_factor, long_factor, original_max, factor, attention_factor } => {
            let mut s = json!({"rope_type": "longrope", "short_factor": short_factor, "long_factor": long_factor,
                "original_max_position_embeddings": original_max, "factor": factor});
            if let Some(a) = attention_factor {
                s["attention_factor"] = json!(a);
            }
            (*theta, s)
        }
        RopeScheme::Harpe { head_bases, layer_head_bases } => {
            let mut s = json!({"rope_type": "harpe", "head_bases": head_bases});
            if let Some(lb) = layer_head_bases {
                s["layer_head_bases"] = json!(lb);
            }
            (head_bases.iter().cloned().fold(f64::INFINITY, f64::min), s)
        }
    }
}

/// The model type, after checking that the config describes the Llama harpe implements (silu, no biases).
fn check_architecture(obj: &Map<String, Value>, origin: &str) -> Result<String> {
    let model_type = obj.get("model_type").and_then(Value::as_str).unwrap_or("llama").to_string();
    if !["llama", "mistral"].contains(&model_type.as_str()) {
        bail!("{origin}: model_type `{model_type}` is not supported\nhint: harpe supports Llama-family models (model_type llama or mistral)");
    }
    if let Some(act) = obj.get("hidden_act").and_then(Value::as_str) {
        if act != "silu" {
            bail!("{origin}: hidden_act `{act}` is not supported\nhint: Llama models use silu");
        }
    }
    for k in ["attention_bias", "mlp_bias"] {
        if obj.get(k).and_then(Value::as_bool) == Some(true) {
            bail!("{origin}: `{k}: true` is not supported\nhint: harpe implements bias-free Llama projections");
        }
    }
    Ok(model_type)
}

/// `eos_token_id`: absent, one integer, or a list of integers.
fn eos_token_ids(obj: &Map<String, Value>, origin: &str) -> Result<Vec<u32>> {
    Ok(match obj.get("eos_token_id") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(a)) => {
            a.iter().map(|x| x.as_u64().map(|n| n as u32)).collect::<Option<Vec<_>>>().ok_or_else(|| {
                anyhow!("{origin}: `eos_token_id` must be an integer or a list of integers\nhint: fix config.json")
            })?
        }
        Some(x) => vec![x
            .as_u64()
            .ok_or_else(|| anyhow!("{origin}: `eos_token_id` must be an integer\nhint: fix config.json"))?
            as u32],
    })
}

/// `bos_token_id`: absent or one integer.
fn bos_token_id(obj: &Map<String, Value>, origin: &str) -> Result<Option<u32>> {
    Ok(match obj.get("bos_token_id") {
        None | Some(Value::Null) => None,
        Some(x) => Some(
            x.as_u64().ok_or_else(|| anyhow!("{origin}: `bos_token_id` must be an integer\nhint: fix config.json"))?
                as u32,
        ),
    })
}

/// The RoPE scheme from either config form.
fn parse_rope(obj: &Map<String, Value>, max_pos: usize, origin: &str) -> Result<RopeScheme> {
    // transformers-5: everything lives in `rope_parameters` (rope_theta included).
    let (params, key) = match (obj.get("rope_parameters"), obj.get("rope_scaling")) {
        (Some(p @ Value::Object(_)), _) => (Some(p), "rope_parameters"),
        (_, Some(s @ Value::Object(_))) => (Some(s), "rope_scaling"),
        (_, Some(Value::Null) | None) => (None, "rope_scaling"),
        (_, Some(other)) => {
            bail!("{origin}: `rope_scaling` must be an object or null, got {other}\nhint: fix config.json")
        }
    };
    let empty = Map::new();
    let p = params.and_then(Value::as_object).unwrap_or(&empty);
    let theta = match p.get("rope_theta").or_else(|| obj.get("rope_theta")) {
        None | Some(Value::Null) => 10000.0,
        Some(x) => x
            .as_f64()
            .ok_or_else(|| anyhow!("{origin}: `rope_theta` must be a number, got {x}\nhint: fix config.json"))?,
    };
    let rope_type = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
    let r = RopeKeys { obj, p, key, rope_type, max_pos, origin };
    Ok(match rope_type {
        "default" => RopeScheme::Default { theta },
        "linear" => RopeScheme::Linear { theta, factor: r.num("factor")? },
        "dynamic" => RopeScheme::Dynamic { theta, factor: r.num("factor")?, original_max: r.orig_max()? },
        "yarn" => RopeScheme::Yarn {
            theta,
            factor: r.num("factor")?,
            original_max: r.orig_max()?,
            beta_fast: r.opt("beta_fast")?.unwrap_or(32.0),
            beta_slow: r.opt("beta_slow")?.unwrap_or(1.0),
            mscale: r.opt("mscale")?,
            mscale_all_dim: r.opt("mscale_all_dim")?,
            attention_factor: r.opt("attention_factor")?,
            truncate: p.get("truncate").and_then(Value::as_bool).unwrap_or(true),
        },
        "llama3" => RopeScheme::Llama3 {
            theta,
            factor: r.num("factor")?,
            low_freq_factor: r.num("low_freq_factor")?,
            high_freq_factor: r.num("high_freq_factor")?,
            original_max: r.orig_max()?,
        },
        "longrope" => {
            let original_max = r.orig_max()?;
            let factor = match r.opt("factor")? {
                Some(f) => f,
                None => max_pos as f64 / original_max as f64,
            };
            RopeScheme::Longrope {
                theta,
                short_factor: r.list("short_factor")?,
                long_factor: r.list("long_factor")?,
                original_max,
                factor,
                attention_factor: r.opt("attention_factor")?,
            }
        }
        "harpe" => {
            let layer_head_bases = r.layer_head_bases()?;
            RopeScheme::Harpe { head_bases: r.list("head_bases")?, layer_head_bases }
        }
        other => bail!(
            "{origin}: unknown `{key}.rope_type` `{other}`\nhint: supported: default, linear, dynamic, yarn, llama3, longrope, harpe"
        ),
    })
}

/// The RoPE parameter object of a config (`rope_parameters` or `rope_scaling`, empty when absent), read key
/// by key with errors that name the file, the object and the rope type.
struct RopeKeys<'a> {
    /// The whole config object (for the top-level `original_max_position_embeddings`).
    obj: &'a Map<String, Value>,
    /// The parameter object.
    p: &'a Map<String, Value>,
    /// Its key in the config, as errors name it.
    key: &'static str,
    rope_type: &'a str,
    max_pos: usize,
    origin: &'a str,
}

impl RopeKeys<'_> {
    /// A required number.
    fn num(&self, k: &str) -> Result<f64> {
        let (origin, key, rope_type) = (self.origin, self.key, self.rope_type);
        self.p.get(k).and_then(Value::as_f64).ok_or_else(|| {
            anyhow!("{origin}: `{key}.{k}` is missing or not a number (rope_type `{rope_type}`)\nhint: add it, e.g. \"{k}\": 32.0")
        })
    }

    /// An optional number (absent or null is `None`).
    fn opt(&self, k: &str) -> Result<Option<f64>> {
        let (origin, key) = (self.origin, self.key);
        match self.p.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => {
                Ok(Some(x.as_f64().ok_or_else(|| {
                    anyhow!("{origin}: `{key}.{k}` must be a number, got {x}\nhint: fix config.json")
                })?))
            }
        }
    }

    /// A required list of numbers.
    fn list(&self, k: &str) -> Result<Vec<f64>> {
        let (origin, key) = (self.origin, self.key);
        self.p
            .get(k)
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_f64).collect::<Option<Vec<f64>>>())
            .ok_or_else(|| anyhow!("{origin}: `{key}.{k}` must be a list of numbers\nhint: fix config.json"))
    }

    /// `original_max_position_embeddings`: in the parameter object, else at the top level, else `max_pos`.
    fn orig_max(&self) -> Result<usize> {
        Ok(match self.opt("original_max_position_embeddings")? {
            Some(x) => x as usize,
            None => match self.obj.get("original_max_position_embeddings").and_then(Value::as_u64) {
                Some(x) => x as usize,
                None => self.max_pos,
            },
        })
    }

    /// HARPE's optional per-layer bases: a list of lists of numbers.
    fn layer_head_bases(&self) -> Result<Option<Vec<Vec<f64>>>> {
        let (origin, key) = (self.origin, self.key);
        Ok(match self.p.get("layer_head_bases") {
            None | Some(Value::Null) => None,
            Some(Value::Array(rows)) => Some(
                rows.iter()
                    .map(|r| r.as_array().and_then(|a| a.iter().map(Value::as_f64).collect::<Option<Vec<f64>>>()))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| anyhow!("{origin}: `{key}.layer_head_bases` must be a list of lists of numbers\nhint: fix config.json"))?,
            ),
            Some(_) => bail!("{origin}: `{key}.layer_head_bases` must be a list of lists\nhint: fix config.json"),
        })
    }
}
