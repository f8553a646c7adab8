//! `harpe demo`: the whole pipeline on built-in data, on CPU, in well under a minute — the README's first
//! command. Each stage calls the same code the subcommands run (no demo-only shortcuts).
//!
//! Stages: train the `configs/tiny-cpu.toml` recipe (a tiny random Llama, plain RoPE at 64 tokens, then
//! HARPE per-head bases at 128; the data is prepared by the run itself from built-in text) -> perplexity of
//! held-out built-in text before and after training -> loss by source and position bucket on the prepared
//! dataset -> passkey retrieval at 512 tokens -> greedy generation with the KV cache.
//! Not done here: anything that needs downloaded data or weights; the tiny model is not expected to
//! retrieve passkeys (the stage shows the evaluation runs, with its honest score).
use crate::checkpoint::latest_complete;
use crate::data::builtin_texts;
use crate::eval::eval_loss::EvalLossArgs;
use crate::eval::generate::{greedy_generate, GenerateOptions};
use crate::eval::ppl::{eval_file, PplResult};
use crate::model::testing::write_random_model_dir;
use crate::model::{load_model_dir, load_tokenizer};
use crate::train::TrainArgs;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device};
use clap::Parser;
use std::path::PathBuf;
use std::time::Instant;

/// The recipe the demo trains (also shipped as configs/tiny-cpu.toml).
pub const TINY_CPU_TOML: &str = include_str!("../configs/tiny-cpu.toml");

/// Run the pipeline on built-in data.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// directory for the demo's outputs (run directory, evaluation outputs); replaced if it exists
    #[arg(long, default_value = "runs/demo")]
    pub out: PathBuf,
}

/// Parse a subcommand's flags exactly as the command line would.
#[derive(Parser)]
struct Flags<T: clap::Args> {
    #[command(flatten)]
    inner: T,
}

fn flags<T: clap::Args>(args: &[&str]) -> Result<T> {
    let argv = std::iter::once("harpe").chain(args.iter().copied());
    Ok(Flags::<T>::try_parse_from(argv).map_err(|e| anyhow!("demo: bad internal flags: {e}"))?.inner)
}

fn path(p: &std::path::Path) -> Result<&str> {
    p.to_str().ok_or_else(|| anyhow!("{}: not valid UTF-8\nhint: use a plain --out path", p.display()))
}

/// `harpe demo`.
pub fn run(args: DemoArgs) -> Result<()> {
    let t0 = Instant::now();
    let out = &args.out;
    if out.exists() {
        std::fs::remove_dir_all(out)
            .with_context(|| format!("cannot clear {}\nhint: pass another --out", out.display()))?;
    }
    std::fs::create_dir_all(out)
        .with_context(|| format!("cannot create {}\nhint: pass a writable --out", out.display()))?;
    let recipe = out.join("tiny-cpu.toml");
    std::fs::write(&recipe, TINY_CPU_TOML).with_context(|| format!("cannot write {}", recipe.display()))?;

    // 1. train (2 stages, data prepared from built-in text by the run)
    let run_dir = out.join("train");
    println!("== [1/5] harpe train --config {} (tiny Llama, RoPE@64 then HARPE@128)", recipe.display());
    let targs: TrainArgs = flags(&[
        "--config",
        path(&recipe)?,
        "--out",
        path(&run_dir)?,
        "--set",
        "model.init.max_position_embeddings=1024",
        "--set",
        "log.every=40",
    ])?;
    crate::train::run(targs)?;
    let ckpt = latest_complete(&run_dir.join("checkpoints"))?
        .ok_or_else(|| anyhow!("training wrote no checkpoint under {}", run_dir.display()))?;

    // 2. perplexity of held-out built-in text: the untrained initialization vs the trained checkpoint
    println!("== [2/5] harpe eval-ppl on held-out built-in text");
    let held_out: String =
        builtin_texts(12345).into_iter().filter(|(s, _)| s == "stories").take(8).map(|(_, t)| t).collect();
    let text = out.join("held_out.txt");
    std::fs::write(&text, held_out).with_context(|| format!("cannot write {}", text.display()))?;
    let init_dir = out.join("untrained");
    let cfg = load_model_dir(&ckpt, DType::F32, &Device::Cpu)?.cfg;
    write_random_model_dir(&init_dir, &cfg, 0)?;
    let before: PplResult = eval_file(&init_dir, &text, 128, 64)?;
    let after: PplResult = eval_file(&ckpt, &text, 128, 64)?;
    println!(
        "untrained: nll {:.4} ppl {:.2} | trained: nll {:.4} ppl {:.2} ({} tokens, {} windows)",
        before.nll, before.ppl, after.nll, after.ppl, after.tokens, after.windows
    );
    if after.nll.partial_cmp(&before.nll) != Some(std::cmp::Ordering::Less) {
        bail!(
            "training did not lower the held-out loss ({} -> {})\nhint: this is a bug; please report it",
            before.nll,
            after.nll
        );
    }

    // 3. loss by source and position bucket on the stage-1 dataset
    println!("== [3/5] harpe eval-loss on the prepared 128-token dataset");
    let data = run_dir.join("data").join("builtin_T128");
    let largs: EvalLossArgs =
        flags(&["--model", path(&ckpt)?, "--data", path(&data)?, "--buckets", "32,64", "--max-sequences", "16"])?;
    crate::eval::eval_loss::run(largs)?;

    // 4. passkey retrieval at 512 tokens (the tiny model is not expected to pass)
    println!("== [4/5] harpe eval-niah --tasks passkey --lengths 512");
    let niah_out = out.join("niah");
    let nargs: crate::eval::niah_run::EvalNiahArgs = flags(&[
        "--model",
        path(&ckpt)?,
        "--out",
        path(&niah_out)?,
        "--tasks",
        "passkey",
        "--lengths",
        "512",
        "--samples",
        "2",
    ])?;
    crate::eval::niah_run::run(nargs)?;

    // 5. greedy generation with the KV cache
    println!("== [5/5] greedy generation (KV cache, chunked prefill)");
    let model = load_model_dir(&ckpt, DType::F32, &Device::Cpu)?;
    let tok = load_tokenizer(&ckpt)?;
    let prompt_text = "Ada found a red box";
    let prompt = tok.encode(prompt_text, true).map_err(|e| anyhow!("tokenize: {e}"))?.get_ids().to_vec();
    let opts = GenerateOptions { max_new_tokens: 48, stop_tokens: cfg.eos_token_id.clone(), prefill_chunk: 8 };
    let gen = greedy_generate(&model, &prompt, &opts)?;
    let cont = tok.decode(&gen, true).map_err(|e| anyhow!("decode: {e}"))?;
    println!("{prompt_text}|{cont}");
    println!(
        "done in {:.1}s: run {} (metrics.jsonl, loss.png, checkpoints/), evaluations in {}",
        t0.elapsed().as_secs_f64(),
        run_dir.display(),
        niah_out.display()
    );
    Ok(())
}
