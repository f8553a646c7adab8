//! GGUF, llama.cpp's one-file model format, read as a harpe model: the config from the `llama.*`
//! metadata, every weight dequantized to f32 under its HF name.
//!
//! Reference: transformers' GGUF loader (`integrations/ggml.py` `GGUF_CONFIG_MAPPING`,
//! `modeling_gguf_pytorch_utils.py` `load_gguf_checkpoint` and `LlamaTensorProcessor`); llama.cpp's
//! `convert_hf_to_gguf.py` (the Q/K row permutation undone here). The file itself is read by candle's
//! `gguf_file` reader, which also dequantizes every block format (Q4_0..Q8_0, the K-quants).
//!
//! The non-obvious decision: llama.cpp stores `attn_q` / `attn_k` with the rows of each head reordered
//! from HF's rotate-half pairing (dimension i with i + D/2) to interleaved pairs (2i, 2i + 1), so the rows
//! are put back per head before a weight leaves this file; every config key follows transformers' mapping
//! and defaults, so `harpe convert` and transformers describe one file with the same config.
//! What this file does not do: the tokenizer (`tools::convert::tokenizer`) or writing a model directory
//! (`tools::convert`); an architecture other than Llama (and llama.cpp's Mistral) is refused, naming
//! `general.architecture`.
use crate::model::config::LlamaConfig;
use crate::model::llama::{layer_param_name, EMBED_TOKENS, FINAL_NORM, LM_HEAD};
use crate::model::rope::RopeScheme;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};
use std::path::{Path, PathBuf};

/// The architectures (`general.architecture`) whose layers are harpe's Llama.
pub const ARCHITECTURES: [&str; 2] = ["llama", "mistral"];

/// An open GGUF file: its metadata and tensor index; tensors are read on demand.
pub struct Gguf {
    /// where it was read from, for messages
    pub path: PathBuf,
    /// metadata and tensor index (candle's reader)
    pub content: Content,
    file: std::fs::File,
}

impl Gguf {
    /// Read the header, metadata and tensor index of `path`.
    pub fn open(path: &Path) -> Result<Gguf> {
        let mut file = std::fs::File::open(path)
            .with_context(|| format!("cannot open {}\nhint: pass the path of a .gguf file", path.display()))?;
        let content = Content::read(&mut file).map_err(|e| {
            anyhow!("{}: not a readable GGUF file: {e}\nhint: is the download complete?", path.display())
        })?;
        Ok(Gguf { path: path.to_path_buf(), content, file })
    }

    /// A metadata value.
    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    /// `general.architecture`, checked against `ARCHITECTURES`.
    pub fn architecture(&self) -> Result<String> {
        let key = "general.architecture";
        let arch = match self.meta(key) {
            Some(Value::String(s)) => s.clone(),
            Some(v) => bail!("{}: `{key}` is {v:?}, not a string\nhint: the file is damaged", self.path.display()),
            None => bail!("{}: no `{key}` in the metadata\nhint: is this a GGUF model file?", self.path.display()),
        };
        if !ARCHITECTURES.contains(&arch.as_str()) {
            bail!(
                "{}: `{key}` is {arch:?}, which harpe does not convert\nhint: harpe trains Llama-family models: \
                 convert a GGUF whose `{key}` is one of {ARCHITECTURES:?}",
                self.path.display()
            );
        }
        Ok(arch)
    }

    /// An unsigned integer metadata value (any GGUF integer type), or None when absent.
    pub fn meta_usize(&self, key: &str) -> Result<Option<usize>> {
        self.meta(key).map(|v| as_u64(v).map(|n| n as usize).ok_or_else(|| self.bad(key, v, "an integer"))).transpose()
    }

    /// A float metadata value as transformers reads it (an f32 widened to f64), or None when absent.
    pub fn meta_f64(&self, key: &str) -> Result<Option<f64>> {
        self.meta(key)
            .map(|v| match v {
                Value::F32(x) => Ok(f64::from(*x)),
                Value::F64(x) => Ok(*x),
                other => as_u64(other).map(|n| n as f64).ok_or_else(|| self.bad(key, other, "a number")),
            })
            .transpose()
    }

    fn bad(&self, key: &str, v: &Value, want: &str) -> anyhow::Error {
        anyhow!("{}: `{key}` is {v:?}, not {want}\nhint: the file's metadata is damaged", self.path.display())
    }

    /// Whether the file has a tensor of this (GGUF) name.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// The config transformers' GGUF loader derives from the metadata: `{arch}.*` keys renamed as
    /// `GGUF_CONFIG_MAPPING` does, LlamaConfig's defaults for absent keys, special-token ids from
    /// `tokenizer.ggml.*`, and tied embeddings exactly when there is no `output.weight`.
    pub fn config(&self) -> Result<LlamaConfig> {
        let arch = self.architecture()?;
        let origin = self.path.display().to_string();
        let key = |k: &str| format!("{arch}.{k}");
        let need = |k: &str| -> Result<usize> {
            self.meta_usize(&key(k))?.ok_or_else(|| {
                anyhow!("{origin}: no `{}` in the metadata\nhint: the file lacks a key every Llama GGUF has", key(k))
            })
        };
        for unsupported in ["expert_count", "rope.scaling.type"] {
            if let Some(v) = self.meta(&key(unsupported)) {
                let none = matches!(v, Value::String(s) if s == "none") || as_u64(v) == Some(0);
                if !none {
                    bail!(
                        "{origin}: `{}` = {v:?} is not taken: harpe converts dense Llama models with plain RoPE\nhint: \
                         convert the model from its HF checkpoint instead",
                        key(unsupported)
                    );
                }
            }
        }
        let hidden_size = need("embedding_length")?;
        let num_attention_heads = need("attention.head_count")?;
        let vocab_size = match self.meta_usize(&key("vocab_size"))? {
            Some(v) => v,
            None => match self.meta("tokenizer.ggml.tokens") {
                Some(Value::Array(a)) => a.len(),
                _ => bail!(
                    "{origin}: neither `{}` nor `tokenizer.ggml.tokens`\nhint: the file has no vocabulary",
                    key("vocab_size")
                ),
            },
        };
        // transformers' LlamaConfig defaults for what the file leaves out
        let theta = self.meta_f64(&key("rope.freq_base"))?.unwrap_or(10000.0);
        let mut cfg = LlamaConfig {
            model_type: arch.clone(),
            vocab_size,
            hidden_size,
            intermediate_size: need("feed_forward_length")?,
            num_hidden_layers: need("block_count")?,
            num_attention_heads,
            num_key_value_heads: self.meta_usize(&key("attention.head_count_kv"))?.unwrap_or(num_attention_heads),
            head_dim: self
                .meta_usize(&key("rope.dimension_count"))?
                .unwrap_or(hidden_size.checked_div(num_attention_heads).unwrap_or(0)),
            rms_norm_eps: self.meta_f64(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6),
            max_position_embeddings: self.meta_usize(&key("context_length"))?.unwrap_or(2048),
            tie_word_embeddings: !self.has_tensor("output.weight"),
            initializer_range: 0.02,
            bos_token_id: Some(self.meta_usize("tokenizer.ggml.bos_token_id")?.map_or(1, |b| b as u32)),
            eos_token_id: vec![self.meta_usize("tokenizer.ggml.eos_token_id")?.map_or(2, |e| e as u32)],
            torch_dtype: None,
            rope: RopeScheme::Default { theta },
        };
        cfg.validate(&origin)?;
        Ok(cfg)
    }

    /// One tensor dequantized to f32 on the CPU, in HF's (rows, cols) order.
    pub fn tensor_f32(&mut self, name: &str) -> Result<Tensor> {
        let q = self
            .content
            .tensor(&mut self.file, name, &Device::Cpu)
            .with_context(|| format!("{}: cannot read tensor `{name}`", self.path.display()))?;
        q.dequantize(&Device::Cpu)
            .with_context(|| format!("{}: cannot dequantize tensor `{name}` ({:?})", self.path.display(), q.dtype()))
    }

    /// Every weight of `cfg`'s model under its HF name, in `dtype`, in HF parameter order: dequantized,
    /// the Q/K rows put back in HF's per-head order, no `lm_head.weight` when the embeddings are tied.
    /// Tensors the file holds beyond the model's are an error naming them, except llama.cpp's
    /// `rope_freqs.weight` (transformers' loader drops it too; harpe says so).
    pub fn weights(&mut self, cfg: &LlamaConfig, dtype: DType) -> Result<Vec<(String, Tensor)>> {
        let mut names: Vec<(String, String)> = vec![("token_embd.weight".into(), EMBED_TOKENS.into())];
        for l in 0..cfg.num_hidden_layers {
            for (g, h) in LAYER_NAMES {
                names.push((format!("blk.{l}.{g}.weight"), layer_param_name(l, h)));
            }
        }
        names.push(("output_norm.weight".into(), FINAL_NORM.into()));
        if !cfg.tie_word_embeddings {
            names.push(("output.weight".into(), LM_HEAD.into()));
        }
        let known: std::collections::HashSet<&str> = names.iter().map(|(g, _)| g.as_str()).collect();
        let mut extra: Vec<&String> =
            self.content.tensor_infos.keys().filter(|k| !known.contains(k.as_str())).collect();
        extra.sort();
        if extra.iter().any(|k| *k == "rope_freqs.weight") {
            eprintln!(
                "warning: {}: `rope_freqs.weight` (llama.cpp's per-frequency RoPE factors) is not converted; \
                 transformers' loader drops it as well",
                self.path.display()
            );
            extra.retain(|k| *k != "rope_freqs.weight");
        }
        if !extra.is_empty() {
            bail!(
                "{}: tensors harpe's Llama has no place for: {extra:?}\nhint: the file is not a plain Llama \
                 (biases, MoE or another architecture under `general.architecture` = llama)",
                self.path.display()
            );
        }
        let mut out = Vec::with_capacity(names.len());
        for (g, h) in names {
            let mut t = self.tensor_f32(&g)?;
            if g.ends_with(".attn_q.weight") {
                t = unpermute_rows(&t, cfg.num_attention_heads)?;
            } else if g.ends_with(".attn_k.weight") {
                t = unpermute_rows(&t, cfg.num_key_value_heads)?;
            }
            out.push((h, t.to_dtype(dtype)?));
        }
        Ok(out)
    }
}

/// llama.cpp's GGUF tensor names of a layer's weights (`blk.N.<name>.weight`) and their HF names.
pub const LAYER_NAMES: [(&str, &str); 9] = [
    ("attn_q", "self_attn.q_proj.weight"),
    ("attn_k", "self_attn.k_proj.weight"),
    ("attn_v", "self_attn.v_proj.weight"),
    ("attn_output", "self_attn.o_proj.weight"),
    ("ffn_gate", "mlp.gate_proj.weight"),
    ("ffn_up", "mlp.up_proj.weight"),
    ("ffn_down", "mlp.down_proj.weight"),
    ("attn_norm", "input_layernorm.weight"),
    ("ffn_norm", "post_attention_layernorm.weight"),
];

/// Undo llama.cpp's permutation of a Q or K projection (rows = `heads` x D): within each head, llama.cpp
/// wrote HF row `j * D/2 + i` (half j, pair i) at row `2 i + j`; this reads it back, as transformers'
/// `_reverse_permute_weights`: reshape (heads, D/2, 2, cols), swap the middle axes.
pub fn unpermute_rows(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        bail!("a Q/K weight of {rows} rows does not split into {heads} heads of pairs\nhint: the config's head counts do not match the file");
    }
    let half = rows / heads / 2;
    Ok(w.reshape((heads, half, 2, cols))?.transpose(1, 2)?.contiguous()?.reshape((rows, cols))?)
}

/// Any GGUF integer (or bool) as u64; negative or non-integer values are None.
pub fn as_u64(v: &Value) -> Option<u64> {
    match *v {
        Value::U8(x) => Some(x.into()),
        Value::U16(x) => Some(x.into()),
        Value::U32(x) => Some(x.into()),
        Value::U64(x) => Some(x),
        Value::I8(x) => u64::try_from(x).ok(),
        Value::I16(x) => u64::try_from(x).ok(),
        Value::I32(x) => u64::try_from(x).ok(),
        Value::I64(x) => u64::try_from(x).ok(),
        Value::Bool(b) => Some(b.into()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's forward permutation (HF -> GGUF), written from its convert script, undone exactly.
    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        let (heads, d, cols) = (3usize, 8usize, 5usize);
        let hf: Vec<f32> = (0..heads * d * cols).map(|x| x as f32).collect();
        // permute: reshape(heads, 2, D/2, cols).swapaxes(1, 2)
        let mut gguf = vec![0f32; hf.len()];
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..d / 2 {
                    let src = h * d + j * d / 2 + i;
                    let dst = h * d + 2 * i + j;
                    gguf[dst * cols..(dst + 1) * cols].copy_from_slice(&hf[src * cols..(src + 1) * cols]);
                }
            }
        }
        let t = Tensor::from_vec(gguf, (heads * d, cols), &Device::Cpu).unwrap();
        let back = unpermute_rows(&t, heads).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(back, hf);
        assert!(unpermute_rows(&t, 5).is_err());
    }
}
