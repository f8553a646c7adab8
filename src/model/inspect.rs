//! `harpe inspect --model DIR`: parameter count, shapes, dtypes, RoPE scheme and memory of a model.
//!
//! Reads tensor headers only (no weights are converted), so it is instant on a 7B checkpoint.
//! Not done here: training-memory planning (`harpe plan`).
use crate::model::config::LlamaConfig;
use crate::model::llama::param_shapes;
use crate::model::weights::weight_files;
use crate::util::human_bytes;
use anyhow::{anyhow, Context, Result};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Describe a model directory.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// HF model directory (config.json + safetensors)
    #[arg(long)]
    pub model: PathBuf,
    /// print one JSON object instead of text
    #[arg(long)]
    pub json: bool,
    /// list every tensor with its shape and dtype
    #[arg(long)]
    pub tensors: bool,
}

/// `harpe inspect`.
pub fn run(args: InspectArgs) -> Result<()> {
    let cfg = LlamaConfig::from_file(&args.model.join("config.json"))?;
    let (files, _) = weight_files(&args.model)?;
    let mut tensors: BTreeMap<String, (String, Vec<usize>)> = BTreeMap::new();
    let mut bytes_on_disk = 0u64;
    for f in &files {
        let data = std::fs::read(f).with_context(|| format!("cannot read {}", f.display()))?;
        bytes_on_disk += data.len() as u64;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&data).map_err(|e| {
            anyhow!("{}: not a valid safetensors file: {e}\nhint: the file is truncated or corrupt", f.display())
        })?;
        for (name, info) in meta.tensors() {
            tensors.insert(name, (format!("{:?}", info.dtype), info.shape.clone()));
        }
    }
    let n_params: usize = tensors.values().map(|(_, s)| s.iter().product::<usize>()).sum();
    let expected = cfg.num_params();
    let missing: Vec<String> =
        param_shapes(&cfg).into_iter().map(|(n, _)| n).filter(|n| !tensors.contains_key(n)).collect();
    let inv = cfg.rope.inv_freq(cfg.head_dim, 0, cfg.max_position_embeddings);
    if args.json {
        let v = serde_json::json!({
            "model": args.model, "params": n_params, "params_expected": expected, "bytes_on_disk": bytes_on_disk,
            "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "vocab": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings, "tied": cfg.tie_word_embeddings,
            "rope": cfg.rope, "rope_attention_factor": inv.attention_factor, "missing": missing,
            "dtypes": tensors.values().map(|(d, _)| d.clone()).collect::<std::collections::BTreeSet<_>>(),
            "tensors": if args.tensors { serde_json::to_value(&tensors)? } else { serde_json::Value::Null },
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("model        {}", args.model.display());
    println!("params       {n_params} ({:.3} B; config implies {expected})", n_params as f64 / 1e9);
    println!(
        "layers {}  hidden {}  intermediate {}  heads {}  kv heads {}  head_dim {}  vocab {}  tied {}",
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.vocab_size,
        cfg.tie_word_embeddings
    );
    println!("context      max_position_embeddings {}", cfg.max_position_embeddings);
    println!("rope         {} {}", cfg.rope.name(), serde_json::to_string(&cfg.rope)?);
    if inv.attention_factor != 1.0 {
        println!("             attention factor {:.6} on cos and sin", inv.attention_factor);
    }
    let dtypes: std::collections::BTreeSet<_> = tensors.values().map(|(d, _)| d.clone()).collect();
    println!("dtypes       {dtypes:?}");
    println!("files        {} ({} on disk)", files.len(), human_bytes(bytes_on_disk));
    println!(
        "memory       weights bf16 {}  f32 {}  training (bf16 w+g, fp32 master/m/v) {}",
        human_bytes(n_params as u64 * 2),
        human_bytes(n_params as u64 * 4),
        human_bytes(n_params as u64 * 16)
    );
    if !missing.is_empty() {
        println!("MISSING      {} tensors, first: {}", missing.len(), missing[0]);
    }
    if args.tensors {
        for (n, (d, s)) in &tensors {
            println!("  {n:<60} {d:<5} {s:?}");
        }
    }
    Ok(())
}
