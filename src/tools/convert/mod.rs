//! `harpe convert --from-gguf FILE --out DIR`: an HF model directory (config.json, safetensors,
//! tokenizer.json, tokenizer_config.json) from a llama.cpp GGUF file, so a model published only as GGUF
//! can be trained and evaluated like any other.
//!
//! Reference: transformers' `from_pretrained(..., gguf_file=...)`, whose config, weights and tokenizer
//! the directory reproduces (tests/real_model/convert.rs checks it tensor for tensor on SmolLM2-135M).
//!
//! The non-obvious decision: quantized weights are dequantized once, here, to the dtype asked for (f32 by
//! default: a Q4 value is exact in f32, and training keeps fp32 master weights anyway); the precision
//! the quantization lost is not coming back, so a converted model starts from the GGUF's own loss, not
//! from the original checkpoint's. Tied embeddings stay tied: no `lm_head.weight` is written.
//! What it does not do: keep weights quantized, or convert back to GGUF.
pub mod tokenizer;

use crate::device::ComputeDtype;
use crate::model::gguf::Gguf;
use crate::model::weights::{save_model_dir, DEFAULT_MAX_SHARD_BYTES};
use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Value;
use std::path::PathBuf;
use tokenizer::GgufVocab;

/// Convert a GGUF model (llama.cpp's format) into an HF model directory harpe and transformers load.
#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    /// the GGUF file of a Llama-family model (`general.architecture` llama), any llama.cpp quantization
    #[arg(long, value_name = "FILE")]
    pub from_gguf: PathBuf,
    /// the model directory to write: config.json, model.safetensors, tokenizer.json, tokenizer_config.json
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// dtype of the written weights (quantized blocks are dequantized to it)
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: ComputeDtype,
    /// write into a directory that already holds a model
    #[arg(long)]
    pub force: bool,
}

/// `harpe convert`.
pub fn run(args: ConvertArgs) -> Result<()> {
    let t0 = std::time::Instant::now();
    let mut g = Gguf::open(&args.from_gguf)?;
    let cfg = g.config()?;
    let vocab = GgufVocab::read(&g)?;
    if vocab.tokens.len() > cfg.vocab_size {
        bail!(
            "{}: the tokenizer has {} tokens, the model's embedding {} rows\nhint: the file's vocabulary and \
             weights disagree",
            g.path.display(),
            vocab.tokens.len(),
            cfg.vocab_size
        );
    }
    let tok = vocab.build()?;
    if args.out.join("config.json").exists() && !args.force {
        bail!(
            "{} already holds a model (config.json)\nhint: choose another --out, or pass --force to overwrite it",
            args.out.display()
        );
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}\nhint: check the path and permissions", args.out.display()))?;
    let _lock = crate::util::lock_dir(&args.out, "harpe convert")?;
    let weights = g.weights(&cfg, args.dtype.dtype())?;
    save_model_dir(&args.out, &cfg, &weights, DEFAULT_MAX_SHARD_BYTES)?;
    let json = tok.to_string(false).map_err(|e| anyhow::anyhow!("cannot serialise the tokenizer: {e}"))?;
    crate::util::write_atomic(&args.out.join("tokenizer.json"), json.as_bytes())?;
    let tcfg = tokenizer_config(&g, &vocab);
    crate::util::write_atomic(
        &args.out.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tcfg)?.as_bytes(),
    )?;
    let (add_bos, add_eos) = vocab.adds();
    let params: usize = weights.iter().map(|(_, t)| t.elem_count()).sum();
    println!(
        "converted {} -> {}: {} layers, hidden {}, {}/{} heads, vocab {}, {:.1}M parameters in {:?}{}; tokenizer {} \
         ({} BOS, {} EOS added); {:.1}s",
        g.path.display(),
        args.out.display(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.vocab_size,
        params as f64 / 1e6,
        args.dtype,
        if cfg.tie_word_embeddings { ", tied embeddings" } else { "" },
        vocab.model,
        if add_bos { "with" } else { "no" },
        if add_eos { "with" } else { "no" },
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `tokenizer_config.json` as transformers reads a GGUF tokenizer: the special tokens by name, whether
/// BOS / EOS are added, the chat template (harpe itself reads only tokenizer.json).
fn tokenizer_config(g: &Gguf, v: &GgufVocab) -> serde_json::Value {
    let name = |i: Option<u32>| i.map(|i| v.tokens[i as usize].clone());
    let (add_bos, add_eos) = v.adds();
    let mut o = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(v.bos),
        "eos_token": name(v.eos),
        "unk_token": name(v.unk),
        "pad_token": name(v.pad),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": false,
    });
    if let Some(Value::String(t)) = g.meta("tokenizer.chat_template") {
        o["chat_template"] = serde_json::json!(t);
    }
    o
}
