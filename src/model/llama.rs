//! The Llama decoder as transformers implements it (Llama-2/3, Mistral-style GQA, tied or untied
//! embeddings), single device, differentiable end to end through candle's autograd.
//!
//! Reference: HF `modeling_llama.py` (LlamaRMSNorm, LlamaAttention, LlamaMLP, LlamaDecoderLayer).
//! The non-obvious decisions: RoPE and attention are our own ops with backward (`ops::rotary`,
//! `ops::attention`; candle's fused ones have none), RMSNorm is the fused op with its backward on every
//! device (`ops::rms_norm`), SiLU(gate) * up the fused op on every device (`ops::swiglu`). RoPE tables
//! come from `rope_tables` (one shared table, or one per layer when `layer_head_bases` makes layers
//! differ) and are passed into the forward: training builds them once per stage, inference per call.
//! Attention goes through `self.attention`, an `AttentionImpl` the caller sets (the CPU op on GEMM
//! blocks or its reference loops, the blocked reference, the CUDA kernels, or a sequence-parallel
//! wrapper from comms/), so `model/` never imports `comms/`.
//! The forward is written once, `forward_segments`: it asks a `WeightSource` for every weight in the
//! order it uses them and lets its caller cut the layers into segments, so parallelism is applied from
//! outside (ZeRO-3 gathers each layer right before use and activation checkpointing keeps each
//! segment's input: `train::params`, `train::step`); inference's `forward` is that forward over the
//! model's own weights. Packed sequences may carry document boundaries (`DocStarts`,
//! `train.document_mask`): every layer's attention is then causal within each document; positions stay
//! the packed ones (RoPE is not reset per document).
//! Not done here: the loss (`model::loss`; `loss_full` here is the full-logits reference of tests),
//! sampling.
use crate::model::attention::AttentionImpl;
use crate::model::config::LlamaConfig;
use crate::model::rope::{Positions, RopeParity, RopeTables};
use crate::ops::attention::DocStarts;
use crate::ops::linear::linear_any as linear;
use crate::ops::rotary::rope;
use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Device, Tensor, Var};
use std::collections::HashMap;
use std::ops::Range;

/// One decoder layer's parameters (HF names in comments).
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub q_proj: Tensor,                   // self_attn.q_proj.weight (H*D, C)
    pub k_proj: Tensor,                   // self_attn.k_proj.weight (Hkv*D, C)
    pub v_proj: Tensor,                   // self_attn.v_proj.weight (Hkv*D, C)
    pub o_proj: Tensor,                   // self_attn.o_proj.weight (C, H*D)
    pub gate_proj: Tensor,                // mlp.gate_proj.weight (I, C)
    pub up_proj: Tensor,                  // mlp.up_proj.weight (I, C)
    pub down_proj: Tensor,                // mlp.down_proj.weight (C, I)
    pub input_layernorm: Tensor,          // input_layernorm.weight (C)
    pub post_attention_layernorm: Tensor, // post_attention_layernorm.weight (C)
}

/// The whole model.
#[derive(Clone, Debug)]
pub struct Llama {
    pub cfg: LlamaConfig,
    pub embed_tokens: Tensor, // model.embed_tokens.weight (V, C)
    pub layers: Vec<LayerWeights>,
    pub norm: Tensor,    // model.norm.weight (C)
    pub lm_head: Tensor, // lm_head.weight (V, C); the same tensor as embed_tokens when tied
    pub parity: RopeParity,
    /// The attention every decoder layer calls; chosen by the caller (default: the attention op, GEMM blocks on CPU).
    pub attention: AttentionImpl,
}

/// The one table of a decoder layer's parameter names (after `model.layers.{i}.`), in HF order;
/// `LayerWeights::tensors`, `layer_shapes` and `LayerWeights::from_array` follow this order.
pub const LAYER_PARAMS: [&str; 9] = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
];
/// The token embedding's name.
pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
/// The final RMSNorm's name.
pub const FINAL_NORM: &str = "model.norm.weight";
/// The (untied) LM head's name.
pub const LM_HEAD: &str = "lm_head.weight";

/// The HF name of layer `l`'s parameter `local` (an entry of `LAYER_PARAMS`).
pub fn layer_param_name(l: usize, local: &str) -> String {
    format!("model.layers.{l}.{local}")
}

/// Shapes of one layer's parameters, in `LAYER_PARAMS` order.
fn layer_shapes(cfg: &LlamaConfig) -> [Vec<usize>; 9] {
    let (c, i, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let (h, hkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    [
        vec![h * d, c],
        vec![hkv * d, c],
        vec![hkv * d, c],
        vec![c, h * d],
        vec![i, c],
        vec![i, c],
        vec![c, i],
        vec![c],
        vec![c],
    ]
}

/// Every parameter name of a config, in HF order, with its shape.
pub fn param_shapes(cfg: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let c = cfg.hidden_size;
    let mut v = vec![(EMBED_TOKENS.to_string(), vec![cfg.vocab_size, c])];
    for l in 0..cfg.num_hidden_layers {
        v.extend(LAYER_PARAMS.iter().zip(layer_shapes(cfg)).map(|(n, s)| (layer_param_name(l, n), s)));
    }
    v.push((FINAL_NORM.to_string(), vec![c]));
    if !cfg.tie_word_embeddings {
        v.push((LM_HEAD.to_string(), vec![cfg.vocab_size, c]));
    }
    v
}

/// The one rule for which tensors a checkpoint of `cfg` must hold: every parameter of `param_shapes`
/// with its shape; besides them only a tied model's `lm_head.weight` and rotary `inv_freq` tables.
pub fn check_params(cfg: &LlamaConfig, found: &[(String, Vec<usize>)], origin: &str) -> Result<()> {
    let got: HashMap<&str, &[usize]> = found.iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
    for (name, shape) in param_shapes(cfg) {
        let dims = got.get(name.as_str()).ok_or_else(|| {
            anyhow!(
                "{origin}: tensor `{name}` is missing\nhint: is the checkpoint complete and does config.json match it?"
            )
        })?;
        if *dims != shape.as_slice() {
            bail!(
                "{origin}: tensor `{name}` has shape {dims:?}, config.json implies {shape:?}\nhint: config.json and the weights disagree"
            );
        }
    }
    let expected: std::collections::HashSet<String> = param_shapes(cfg).into_iter().map(|(n, _)| n).collect();
    let allowed = |k: &str| {
        expected.contains(k) || k.ends_with("rotary_emb.inv_freq") || (cfg.tie_word_embeddings && k == LM_HEAD)
    };
    let mut extra: Vec<&str> = got.keys().copied().filter(|k| !allowed(k)).collect();
    extra.sort();
    if let Some(first) = extra.first() {
        bail!(
            "{origin}: unexpected tensor `{first}` ({} unexpected in all)\nhint: the weights do not belong to a Llama model with this config.json",
            extra.len()
        );
    }
    Ok(())
}

/// True for parameters that are RMSNorm weights (the one norm rule: no weight decay by default).
pub fn is_norm_param(name: &str) -> bool {
    name.ends_with("layernorm.weight") || name == FINAL_NORM
}

impl LayerWeights {
    /// The layer's tensors in `LAYER_PARAMS` order.
    pub fn tensors(&self) -> [&Tensor; 9] {
        [
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.o_proj,
            &self.gate_proj,
            &self.up_proj,
            &self.down_proj,
            &self.input_layernorm,
            &self.post_attention_layernorm,
        ]
    }

    /// The layer from its tensors in `LAYER_PARAMS` order.
    pub fn from_array(t: [Tensor; 9]) -> LayerWeights {
        let [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, input_layernorm, post_attention_layernorm] =
            t;
        LayerWeights {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            gate_proj,
            up_proj,
            down_proj,
            input_layernorm,
            post_attention_layernorm,
        }
    }
}

/// RMSNorm (f32 statistics, HF order of casts): w * (x / sqrt(mean(x^2) + eps)). The fused op with its own
/// backward on every device (`ops::rms_norm`: rows in parallel on CPU, kernels/rms_norm.cu on CUDA);
/// its plain-op twin only for what the kernels do not take (x and w of different dtypes, f16 on CUDA).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let kernel_dtype = x.device().is_cpu() || matches!(x.dtype(), DType::F32 | DType::BF16);
    if x.dtype() == w.dtype() && kernel_dtype {
        crate::ops::rms_norm::rms_norm(x, w, eps)
    } else {
        crate::ops::rms_norm::rms_norm_slow(x, w, eps)
    }
}

/// silu(gate) * up: the fused op with its own backward (`ops::swiglu`), so the graph keeps gate and up only.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    crate::ops::swiglu::swiglu(gate, up)
}

/// The weights outside the decoder layers, as one forward uses them.
#[derive(Clone, Debug)]
pub struct OuterWeights {
    /// model.embed_tokens.weight (V, C)
    pub embed: Tensor,
    /// model.norm.weight (C)
    pub norm: Tensor,
    /// lm_head.weight (V, C); the embedding when tied
    pub head: Tensor,
}

/// Where a forward takes its weights from, asked in the order the forward uses them: the model's own
/// (`OwnWeights`), or what the training loop gathers per layer under ZeRO (`train::params`), which also
/// keeps, as `Held`, what it needs to hand the gradients on. A trait because `model/` does not know
/// the collectives.
pub trait WeightSource {
    /// What the source keeps per layer while that layer's graph is alive.
    type Held;
    /// The embedding, final norm and head of one forward.
    fn outer(&mut self, model: &Llama) -> Result<OuterWeights>;
    /// Decoder layer `l`'s weights.
    fn layer(&mut self, model: &Llama, l: usize) -> Result<(LayerWeights, Self::Held)>;
}

/// The model's own weights (inference's `forward`, the bench's decoder layer).
pub struct OwnWeights;

impl WeightSource for OwnWeights {
    type Held = ();
    fn outer(&mut self, model: &Llama) -> Result<OuterWeights> {
        Ok(OuterWeights { embed: model.embed_tokens.clone(), norm: model.norm.clone(), head: model.lm_head.clone() })
    }
    fn layer(&mut self, model: &Llama, l: usize) -> Result<(LayerWeights, ())> {
        Ok((model.layer(l)?.clone(), ()))
    }
}

/// What a forward's layers read besides the weights: RoPE tables (`tables[l]`, or one shared), the
/// document mask ((B, T) of the whole sequences: under sequence parallelism the global ones), and the
/// KV cache of generation.
pub struct Forward<'a> {
    pub tables: &'a [RopeTables],
    pub docs: Option<&'a DocStarts>,
    pub cache: Option<&'a mut KvCache>,
}

/// The output of `Llama::forward_segments`.
pub struct Segmented<H> {
    /// hidden states after the final norm (B, T, C)
    pub hidden: Tensor,
    /// the embedding, norm and head the forward used
    pub outer: OuterWeights,
    /// what the weight source handed out for the last segment's layers
    pub held: Vec<H>,
}

/// Per-layer key/value cache for generation: (B, Hkv, Tpast, D) each, after RoPE.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    pub kv: Vec<Option<(Tensor, Tensor)>>,
    /// tokens already in the cache
    pub pos: usize,
}

impl KvCache {
    pub fn new(n_layers: usize) -> KvCache {
        KvCache { kv: vec![None; n_layers], pos: 0 }
    }
}

/// Where the tokens of an inference forward (`Llama::forward`) sit.
pub enum Tokens<'a> {
    /// fresh sequences at positions start..
    At(usize),
    /// packed sequences at positions start.. under a document mask (positions not reset per document)
    Packed(usize, &'a DocStarts),
    /// after what a KV cache holds: positions continue at `cache.pos`, and the cache is extended
    Cached(&'a mut KvCache),
}

impl Llama {
    /// Build from HF-named tensors; every expected name must be there with its shape.
    /// `rotary_emb.inv_freq` buffers of old checkpoints are recomputed, so they are ignored.
    pub fn from_tensors(cfg: LlamaConfig, mut t: HashMap<String, Tensor>, origin: &str) -> Result<Llama> {
        let found: Vec<(String, Vec<usize>)> = t.iter().map(|(k, v)| (k.clone(), v.dims().to_vec())).collect();
        check_params(&cfg, &found, origin)?;
        if cfg.tie_word_embeddings {
            t.remove(LM_HEAD);
        }
        let mut take =
            |n: &str| -> Result<Tensor> { t.remove(n).ok_or_else(|| anyhow!("{origin}: tensor `{n}` is missing")) };
        let embed_tokens = take(EMBED_TOKENS)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let mut ts = Vec::with_capacity(LAYER_PARAMS.len());
            for n in LAYER_PARAMS {
                ts.push(take(&layer_param_name(l, n))?);
            }
            let ts: [Tensor; 9] = ts.try_into().map_err(|_| anyhow!("{origin}: layer {l}: wrong parameter count"))?;
            layers.push(LayerWeights::from_array(ts));
        }
        let norm = take(FINAL_NORM)?;
        let lm_head = if cfg.tie_word_embeddings { embed_tokens.clone() } else { take(LM_HEAD)? };
        Ok(Llama {
            cfg,
            embed_tokens,
            layers,
            norm,
            lm_head,
            parity: RopeParity::F64,
            attention: AttentionImpl::default(),
        })
    }

    /// The model's configuration without weights, for a forward whose `WeightSource` hands out every
    /// weight (ZeRO-3 gathers each group per use: `train::params`). It has no layers (asking `OwnWeights`
    /// for one is an error); its embedding, norm and head are empty (0, C) tensors that only carry the
    /// dtype and device.
    pub fn skeleton(cfg: LlamaConfig, dtype: DType, device: &Device) -> Result<Llama> {
        let empty = Tensor::zeros((0, cfg.hidden_size), dtype, device)?;
        Ok(Llama {
            cfg,
            embed_tokens: empty.clone(),
            layers: vec![],
            norm: empty.clone(),
            lm_head: empty,
            parity: RopeParity::F64,
            attention: AttentionImpl::default(),
        })
    }

    /// Wrap every parameter in a candle `Var` and rebuild the model from them, so `backward()` yields a
    /// gradient per parameter (tied embeddings are one Var used twice).
    pub fn into_trainable(self) -> Result<(Llama, Vec<(String, Var)>)> {
        let (parity, attention) = (self.parity, self.attention.clone());
        let mut vars = vec![];
        let mut map = HashMap::new();
        for (name, t) in self.tensors() {
            let v = Var::from_tensor(&t)?;
            map.insert(name.clone(), v.as_tensor().clone());
            vars.push((name, v));
        }
        let mut m = Llama::from_tensors(self.cfg, map, "trainable model")?;
        m.parity = parity;
        m.attention = attention;
        Ok((m, vars))
    }

    /// All parameters by HF name (tied models list the embedding once).
    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![(EMBED_TOKENS.to_string(), self.embed_tokens.clone())];
        for (l, w) in self.layers.iter().enumerate() {
            v.extend(LAYER_PARAMS.iter().zip(w.tensors()).map(|(n, t)| (layer_param_name(l, n), t.clone())));
        }
        v.push((FINAL_NORM.to_string(), self.norm.clone()));
        if !self.cfg.tie_word_embeddings {
            v.push((LM_HEAD.to_string(), self.lm_head.clone()));
        }
        v
    }

    /// The same model with every projection (q, k, v, o, gate, up, down; the LM head when untied) stored
    /// column-major on CPU f32: the same (Out, In) tensor and values, viewing a contiguous (In, Out) buffer
    /// (strides (1, Out)). `ops::linear`'s forward GEMM reads W^T, which in a checkpoint's row-major W is
    /// strided: the gemm crate then packs it with a scalar gather on every call and in every thread's band
    /// (27-30% of a `perf` of `harpe eval-ppl`, hidden 512, 8 layers, windows of 256). For models that only
    /// run forward (eval-ppl, generate, NIAH, RULER): training's backward reads W row-major as well, and
    /// `tensors()` of this model gives the strided views. Other devices and dtypes: unchanged.
    pub fn with_inference_layout(mut self) -> Result<Llama> {
        if !self.device().is_cpu() || self.dtype() != DType::F32 {
            return Ok(self);
        }
        let column_major = |w: &Tensor| -> Result<Tensor> { Ok(w.t()?.contiguous()?.t()?) };
        for l in &mut self.layers {
            let projections = [
                &mut l.q_proj,
                &mut l.k_proj,
                &mut l.v_proj,
                &mut l.o_proj,
                &mut l.gate_proj,
                &mut l.up_proj,
                &mut l.down_proj,
            ];
            for w in projections {
                *w = column_major(w)?;
            }
        }
        if !self.cfg.tie_word_embeddings {
            self.lm_head = column_major(&self.lm_head)?;
        }
        Ok(self)
    }

    /// The same model calling attention through `attention` (chosen outside `model/`).
    pub fn with_attention(mut self, attention: AttentionImpl) -> Llama {
        self.attention = attention;
        self
    }

    pub fn device(&self) -> &Device {
        self.embed_tokens.device()
    }

    pub fn dtype(&self) -> DType {
        self.embed_tokens.dtype()
    }

    /// The longest sequence the model is meant to address under its RoPE scheme.
    pub fn max_context(&self) -> usize {
        self.cfg.max_position_embeddings
    }

    /// The RoPE tables of every layer at positions `at` (a sequence-parallel rank's part has
    /// `at.seq_len` > `at.start + at.len`; dynamic schemes adapt to `seq_len`): one shared table, or one
    /// per layer when the scheme makes layers differ (`tables[l.min(len - 1)]` is layer l's).
    pub fn rope_tables(&self, at: Positions) -> Result<Vec<RopeTables>> {
        let c = &self.cfg;
        let n = if c.rope.per_layer() { c.num_hidden_layers } else { 1 };
        (0..n).map(|l| c.rope.tables(c.head_dim, l, at, self.parity, self.device())).collect()
    }

    /// Token embeddings from the table `embed_tokens` (V, C): ids (B, T) u32 -> (B, T, C).
    fn embed(&self, embed_tokens: &Tensor, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let x = embed_tokens.index_select(&ids.flatten_all()?, 0)?;
        Ok(x.reshape((b, t, self.cfg.hidden_size))?)
    }

    /// The model's own weights of decoder layer `layer` (an error on a `skeleton`).
    fn layer(&self, layer: usize) -> Result<&LayerWeights> {
        self.layers.get(layer).ok_or_else(|| {
            anyhow!("internal: this model holds no weights of layer {layer} (a skeleton's come from its weight source)")
        })
    }

    /// Decoder layer `layer` with parameters `w`: x (B, T, C) -> (B, T, C), at the positions of `tables`,
    /// optionally reading and extending a KV cache and under a document mask `docs` ((B, T) of the whole
    /// sequences: under sequence parallelism the global ones).
    fn layer_forward(
        &self,
        layer: usize,
        w: &LayerWeights,
        x: &Tensor,
        tables: &RopeTables,
        cache: Option<&mut KvCache>,
        docs: Option<&DocStarts>,
    ) -> Result<Tensor> {
        let (x, mlp) = self.layer_body(layer, w, x, tables, cache, docs)?;
        Ok((&x + linear(&mlp, &w.down_proj)?)?)
    }

    /// A scalar whose gradients (in x and the layer's weights) are those of sum(layer_forward(..) ⊙ g)
    /// for the upstream gradient `g` (B, T, C): the recompute of activation checkpointing, which needs the
    /// layer's gradients but not its output, so the down projection's forward GEMM is never run
    /// (`ops::linear::linear_vjp`; its value is not the dot product).
    fn layer_vjp(
        &self,
        layer: usize,
        w: &LayerWeights,
        x: &Tensor,
        g: &Tensor,
        tables: &RopeTables,
        docs: Option<&DocStarts>,
    ) -> Result<Tensor> {
        let (x, mlp) = self.layer_body(layer, w, x, tables, None, docs)?;
        let g = g.detach();
        Ok(((&x * &g)?.sum_all()? + crate::ops::linear::linear_vjp(&mlp, &w.down_proj, &g)?)?)
    }

    /// The decoder layer up to its last projection: (x + attention (B, T, C), swiglu(gate, up) (B, T, I)).
    fn layer_body(
        &self,
        layer: usize,
        w: &LayerWeights,
        x: &Tensor,
        tables: &RopeTables,
        cache: Option<&mut KvCache>,
        docs: Option<&DocStarts>,
    ) -> Result<(Tensor, Tensor)> {
        let cfg = &self.cfg;
        let (b, t, _c) = x.dims3()?;
        let (h, hkv, d) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let hs = rms_norm(x, &w.input_layernorm, cfg.rms_norm_eps)?;
        let q = linear(&hs, &w.q_proj)?.reshape((b, t, h, d))?.transpose(1, 2)?; // (B, H, T, D)
        let k = linear(&hs, &w.k_proj)?.reshape((b, t, hkv, d))?.transpose(1, 2)?; // (B, Hkv, T, D)
        let v = linear(&hs, &w.v_proj)?.reshape((b, t, hkv, d))?.transpose(1, 2)?; // (B, Hkv, T, D)
        let q = rope(&q, &tables.cos, &tables.sin)?;
        let mut k = rope(&k, &tables.cos, &tables.sin)?;
        let mut v = v.contiguous()?;
        if let Some(cache) = cache {
            if let Some((pk, pv)) = &cache.kv[layer] {
                k = Tensor::cat(&[pk, &k], 2)?; // (B, Hkv, Tpast + T, D)
                v = Tensor::cat(&[pv, &v], 2)?;
            }
            cache.kv[layer] = Some((k.clone(), v.clone()));
        }
        let scale = 1.0 / (d as f32).sqrt();
        let o = match docs {
            Some(ds) => self.attention.attend_doc(&q, &k, &v, scale, ds)?, // (B, H, T, D)
            None => self.attention.attend(&q, &k, &v, scale, true)?,
        };
        let o = o.transpose(1, 2)?.reshape((b, t, h * d))?;
        let x = (x + linear(&o, &w.o_proj)?)?;
        let hs = rms_norm(&x, &w.post_attention_layernorm, cfg.rms_norm_eps)?;
        let mlp = swiglu(&linear(&hs, &w.gate_proj)?, &linear(&hs, &w.up_proj)?)?; // (B, T, I)
        Ok((x, mlp))
    }

    /// Inference's forward (eval, generate, tests) over the model's own weights: ids (B, T) at the
    /// positions `tokens` says -> hidden states after the final RMSNorm (B, T, C). It is
    /// `forward_segments` with every layer in one segment, RoPE tables built for this call.
    pub fn forward(&self, ids: &Tensor, tokens: Tokens) -> Result<Tensor> {
        let t = ids.dim(1)?;
        let (start, docs, mut cache) = match tokens {
            Tokens::At(start) => (start, None, None),
            Tokens::Packed(start, docs) => (start, Some(docs), None),
            Tokens::Cached(cache) => (cache.pos, None, Some(cache)),
        };
        let tables = self.rope_tables(Positions::new(start, t))?;
        let all = 0..self.cfg.num_hidden_layers;
        let layers = std::slice::from_ref(&all); // one segment: nothing is cut
        let run = Forward { tables: &tables, docs, cache: cache.as_deref_mut() };
        let hidden = self.forward_segments(&mut OwnWeights, ids, layers, run, &mut |_, x| Ok(x))?.hidden;
        if let Some(cache) = cache {
            cache.pos += t;
        }
        Ok(hidden)
    }

    /// The model's forward, written once: embed -> decoder layers, cut into `segments` (consecutive
    /// ranges covering every layer) -> final RMSNorm, with every weight taken from `w` in the order the
    /// forward uses it. Before each segment, `cut(i, x)` sees the segment's input and returns what the
    /// segment starts from: the identity for a plain forward; activation checkpointing saves and detaches
    /// it. What `w` hands out for the segments before the last is dropped when the next one starts; the
    /// last segment's is returned (its graph is the one the backward runs first).
    pub fn forward_segments<W: WeightSource>(
        &self,
        w: &mut W,
        ids: &Tensor,
        segments: &[Range<usize>],
        mut run: Forward,
        cut: &mut dyn FnMut(usize, Tensor) -> Result<Tensor>,
    ) -> Result<Segmented<W::Held>> {
        let outer = w.outer(self)?;
        let mut x = self.embed(&outer.embed, ids)?; // (B, T, C)
        let mut held = vec![];
        for (i, layers) in segments.iter().enumerate() {
            x = cut(i, x)?;
            held.clear(); // the previous segment's weights are released before the next one's are taken
            let cache = run.cache.as_deref_mut();
            let step = Forward { tables: run.tables, docs: run.docs, cache };
            let (y, h) = self.run_layers(w, &x, layers.clone(), step, None)?;
            x = y;
            held = h;
        }
        let hidden = rms_norm(&x, &outer.norm, self.cfg.rms_norm_eps)?; // (B, T, C)
        Ok(Segmented { hidden, outer, held })
    }

    /// Decoder layers `layers` on x (B, T, C), weights from `w`; returns the output and what `w` handed
    /// out for them: the layers of `forward_segments`, and of the training step's recompute of a
    /// segment (`train::step`). With `vjp = Some(g)` (that recompute) the last layer
    /// gives, instead of its output, the scalar whose backward is that of sum(output ⊙ g)
    /// (`layer_vjp`: the down projection's forward skipped).
    pub fn run_layers<W: WeightSource>(
        &self,
        w: &mut W,
        x: &Tensor,
        layers: Range<usize>,
        mut run: Forward,
        vjp: Option<&Tensor>,
    ) -> Result<(Tensor, Vec<W::Held>)> {
        let mut x = x.clone();
        let mut held = Vec::with_capacity(layers.len());
        let last = layers.end.saturating_sub(1);
        for l in layers {
            let (lw, h) = w.layer(self, l)?;
            let tables = &run.tables[l.min(run.tables.len() - 1)];
            x = match vjp {
                Some(g) if l == last => self.layer_vjp(l, &lw, &x, g, tables, run.docs)?, // ()
                _ => self.layer_forward(l, &lw, &x, tables, run.cache.as_deref_mut(), run.docs)?, // (B, T, C)
            };
            held.push(h);
        }
        Ok((x, held))
    }

    /// Logits of hidden states: (..., C) -> (..., V). Use on chunks of tokens at long T.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(linear(hidden, &self.lm_head)?)
    }

    /// Token-mean cross-entropy of next-token prediction for ids (B, T), full logits (tests, tiny T).
    pub fn loss_full(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let hidden = self.forward(ids, Tokens::At(0))?;
        let logits = self.logits(&hidden.narrow(1, 0, t - 1)?)?.to_dtype(DType::F32)?; // (B, T-1, V)
        let targets = ids.narrow(1, 1, t - 1)?.flatten_all()?;
        let logits = logits.reshape((b * (t - 1), self.cfg.vocab_size))?;
        Ok(candle_nn::loss::cross_entropy(&logits, &targets)?)
    }
}
