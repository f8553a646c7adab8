//! `harpe demo`: the whole pipeline on built-in data, on CPU, in seconds to minutes — the README's first
//! command. Each stage is a named call into the real code paths (no demo-only shortcuts).
//!
//! Stages: build a tiny random Llama with HARPE per-head bases and save it as an HF directory -> reload
//! it -> sliding-window perplexity of built-in text -> greedy generation with the KV cache.
//! Not done here: anything that needs downloaded data or weights.
use crate::eval::generate::{greedy_generate, GenerateOptions};
use crate::eval::ppl::{eval_file, PplResult};
use crate::model::rope::{uniform_bases, BaseOrder, RopeScheme};
use crate::model::testing::{tiny_config, write_random_model_dir};
use crate::model::{load_model_dir, load_tokenizer};
use anyhow::{anyhow, Context, Result};
use candle_core::{DType, Device};
use std::path::PathBuf;
use std::time::Instant;

/// Built-in text for the demo (public-domain style prose, ~2 KB).
pub const DEMO_TEXT: &str = "It was the best of times, it was the worst of times, it was the age of wisdom, \
it was the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season \
of Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had \
everything before us, we had nothing before us, we were all going direct to Heaven, we were all going direct \
the other way. There were a king with a large jaw and a queen with a plain face, on the throne of England; \
there were a king with a large jaw and a queen with a fair face, on the throne of France. In both countries \
it was clearer than crystal to the lords of the State preserves of loaves and fishes, that things in general \
were settled for ever.\n";

/// Run the pipeline on built-in data.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// directory for the demo's outputs (model directory, text); default: runs/demo
    #[arg(long, default_value = "runs/demo")]
    pub out: PathBuf,
    /// seed of the random model
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// `harpe demo`.
pub fn run(args: DemoArgs) -> Result<()> {
    let t0 = Instant::now();
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}\nhint: pass a writable --out directory", args.out.display()))?;
    // 1. a tiny HARPE model: one base per kv head, uniform between 1e4 and 1e6
    let mut cfg = tiny_config(RopeScheme::Default { theta: 1e4 });
    cfg.rope = RopeScheme::Harpe {
        head_bases: uniform_bases(1e4, 1e6, cfg.num_key_value_heads, BaseOrder::Asc)?,
        layer_head_bases: None,
    };
    let model_dir = args.out.join("model");
    write_random_model_dir(&model_dir, &cfg, args.seed)?;
    println!(
        "[1/3] model     {} ({} params, rope {})",
        model_dir.display(),
        cfg.num_params(),
        serde_json::to_string(&cfg.rope)?
    );
    // 2. perplexity of built-in text
    let text = args.out.join("text.txt");
    std::fs::write(&text, DEMO_TEXT.repeat(2)).with_context(|| format!("cannot write {}", text.display()))?;
    let r: PplResult = eval_file(&model_dir, &text, 256, 128)?;
    println!("[2/3] eval-ppl  nll {:.4}  ppl {:.2}  tokens {}  windows {}", r.nll, r.ppl, r.tokens, r.windows);
    // 3. greedy generation with the KV cache
    let model = load_model_dir(&model_dir, DType::F32, &Device::Cpu)?;
    let tok = load_tokenizer(&model_dir)?;
    let prompt = tok.encode("It was the best of", true).map_err(|e| anyhow!("tokenize: {e}"))?.get_ids().to_vec();
    let opts = GenerateOptions { max_new_tokens: 16, stop_tokens: cfg.eos_token_id.clone(), prefill_chunk: 8 };
    let out = greedy_generate(&model, &prompt, &opts)?;
    let text_out = tok.decode(&out, true).map_err(|e| anyhow!("decode: {e}"))?;
    println!("[3/3] generate  {} new tokens: {:?}", out.len(), text_out);
    println!("done in {:.1}s; outputs in {}", t0.elapsed().as_secs_f64(), args.out.display());
    Ok(())
}
