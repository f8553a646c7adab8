//! `harpe demo`: a real CPU-scale version of the paper's question, end to end, on built-in data — the
//! README's first command. A tiny Llama pretrained at a short context T on a corpus with long-range
//! retrieval structure (shipped in `assets/demo-base/`, made by `scripts/make_demo_base.sh`; or
//! pretrained here with `--pretrain`) is extended to 4T at equal token budgets by (a) HARPE
//! single-stage, (b) ABF multi-stage (2T -> 4T), (c) ABF single-stage and (d) PI, several seeds each,
//! evaluated per length (passkey retrieval, perplexity, loss by position), and tabulated by `harpe report`.
//!
//! Reference: HARPE (Lian et al. 2024) §4 for the arms; Fu et al. 2024 for per-source upsampling; the
//! passkey task of Mohtashami & Jaggi 2023 as `harpe eval-niah` runs it; associative recall as in
//! Zoology (Arora et al. 2023).
//! The non-obvious decisions:
//! - The corpus teaches the retrieval task at the short length: passkey documents in exactly the
//!   evaluation's format (noise, the key, noise, the question, the answer), associative-recall and
//!   "facts" documents (values stated early and asked back later), and the built-in stories/arithmetic.
//! - The base must retrieve at its own length T, or the comparison says nothing: with this corpus a
//!   3-layer, hidden-128 model needs thousands of steps for that (it copies the key's leading digits at
//!   2400 steps, all of them by 3000), far more than the demo's 10 minutes allow. So the base is made
//!   once by `scripts/make_demo_base.sh` (`--make-base`, the same code path as `--pretrain`), shipped
//!   (2.8 MB, compiled into the binary) and its provenance (recipe, tokens, loss, passkey scores, the
//!   exact pretrain.toml) printed with the results. The demo measures the base's passkey score itself.
//! - Every stage goes through the same code paths a user runs: `harpe train` and the evaluations as
//!   processes started by `harpe sweep`, then `harpe report`; numbers are whatever the runs produce.
//! - One pretrained base is shared by all arms (continual pretraining, as in the paper); seeds change the
//!   extension's data order.
//!
//! Not here: anything that needs downloads; claims about 7B models (the tiny model's ranking need not
//! match the paper's).
mod corpus;
use crate::data::mixture::{StrategyKind, Weights};
use crate::data::prepare::prepare_from_texts;
use crate::data::PrepareOptions;
use crate::research::report;
use crate::research::sweep::{harpe_binary, SweepArgs};
use anyhow::{anyhow, bail, Context, Result};
use corpus::corpus;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Run the CPU-scale comparison on built-in data.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// directory for every output (datasets, runs, sweep, report); replaced if it exists
    #[arg(long, default_value = "runs/demo")]
    pub out: PathBuf,
    /// the reduced size CI runs (fewer steps, 2 seeds, fewer samples): checks the pipeline, not the question
    #[arg(long)]
    pub quick: bool,
    /// extension runs trained at the same time
    #[arg(long, default_value_t = 1)]
    pub jobs: usize,
    /// pretrain the base model here (the recipe of `scripts/make_demo_base.sh`, tens of minutes on 2
    /// cores) instead of starting from the checkpoint shipped in `assets/demo-base/`
    #[arg(long)]
    pub pretrain: bool,
    /// only make the base model: prepare its corpus, pretrain it, score its passkey retrieval and write
    /// config.json, model.safetensors and provenance.json to this directory (what
    /// `scripts/make_demo_base.sh` runs; with --quick a few steps, a pipeline check)
    #[arg(long, hide = true, value_name = "DIR")]
    pub make_base: Option<PathBuf>,
}

/// The pretraining recipe of the demo's base model: a tiny Llama on byte tokens at `t0` with plain
/// RoPE. Sized so that passkey retrieval is learned at `t0` (the untreated model must retrieve at its
/// own length, or the extension comparison says nothing); that takes far longer than the demo's other
/// steps, so the result is shipped (`assets/demo-base/`, made by `scripts/make_demo_base.sh`).
#[derive(Clone, Debug, serde::Serialize)]
struct BaseRecipe {
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    steps: u64,
    warmup: u64,
    lr: f64,
    /// documents per source of the pretraining corpus
    docs: usize,
    /// passkey samples per depth when scoring the made base
    samples: usize,
}

impl BaseRecipe {
    fn new(quick: bool) -> BaseRecipe {
        let full = BaseRecipe {
            hidden: 128,
            intermediate: 384,
            layers: 3,
            heads: 4,
            steps: 3000,
            warmup: 100,
            lr: 2e-3,
            docs: 4000,
            samples: 10,
        };
        if quick {
            BaseRecipe { steps: 6, warmup: 2, docs: 40, samples: 1, ..full }
        } else {
            full
        }
    }
}

/// The demo's sizes.
#[derive(Clone, Debug)]
struct Size {
    /// short (pretraining) context; the extension goes to 4 x t0
    t0: usize,
    /// tokens of every extension run
    ext_tokens: u64,
    seeds: Vec<u64>,
    /// passkey samples per length
    samples: usize,
    /// documents per source in the training corpora
    docs: usize,
    /// held-out documents for eval-ppl and sequences for eval-loss
    heldout_docs: usize,
    loss_seqs: usize,
}

impl Size {
    fn new(quick: bool) -> Size {
        let t0 = 384;
        if quick {
            let ext_tokens = 2 * step_tokens(t0) as u64;
            Size { t0, ext_tokens, seeds: vec![0, 1], samples: 2, docs: 40, heldout_docs: 3, loss_seqs: 2 }
        } else {
            let ext_tokens = 48 * step_tokens(t0) as u64;
            Size { t0, ext_tokens, seeds: vec![0, 1, 2], samples: 20, docs: 1200, heldout_docs: 8, loss_seqs: 8 }
        }
    }
}

/// Tokens per optimizer step in every run: 8 x t0 (2 sequences at 4 t0, 4 at 2 t0, 8 at t0).
fn step_tokens(t0: usize) -> usize {
    8 * t0
}

/// Prepare `corpus` at `seq_len` with per-source upsampling (Fu et al.) into `dir`.
fn prepare(texts: &[(String, String)], seq_len: usize, tokenizer: &Path, dir: &Path) -> Result<()> {
    let mut o = PrepareOptions::new(seq_len);
    o.strategy.name = StrategyKind::PerSourceUpsample;
    let total: usize = texts.iter().map(|(_, t)| t.len() + 1).sum();
    o.strategy.budget = Some((total as u64 * 9 / 10 / seq_len as u64).max(1) * seq_len as u64);
    o.strategy.threshold = (seq_len / 2) as u64;
    o.strategy.short_keep = 0.5;
    o.strategy.weights = Weights::parse("passkey=0.3,recall=0.2,copy=0.2,facts=0.1,stories=0.1,arithmetic=0.1")?;
    let m = prepare_from_texts(texts, tokenizer, &o, dir).with_context(|| format!("preparing {}", dir.display()))?;
    let seqs: u64 = m.sources.values().map(|s| s.tokens_out).sum::<u64>() / seq_len as u64;
    println!("   {} : {seqs} sequences of {seq_len} tokens", dir.display());
    Ok(())
}

fn p(path: &Path) -> Result<String> {
    path.to_str()
        .map(|s| s.replace('\\', "/"))
        .ok_or_else(|| anyhow!("{}: not valid UTF-8\nhint: use a plain --out path", path.display()))
}

/// Run `harpe ARGS...` (this binary), failing with its output.
fn harpe(args: &[&str], log: &Path) -> Result<()> {
    let bin = harpe_binary()?;
    let o = Command::new(&bin).args(args).output().with_context(|| format!("cannot start {}", bin.display()))?;
    let mut text = o.stdout.clone();
    text.extend_from_slice(&o.stderr);
    std::fs::write(log, &text).with_context(|| format!("cannot write {}", log.display()))?;
    if !o.status.success() {
        let t = String::from_utf8_lossy(&text);
        let tail: Vec<&str> = t.lines().rev().take(12).collect();
        bail!(
            "harpe {} failed:\n{}\nhint: see {}",
            args[0],
            tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
            log.display()
        );
    }
    Ok(())
}

/// The `[data]`, `[rope]` and `[train]` tables both demo recipes share: the prepared dataset `data`,
/// plain RoPE, f32 on the CPU, `mb` sequences per micro-batch and `gb` tokens per step.
fn data_and_train_toml(data: &Path, mb: usize, gb: usize) -> Result<String> {
    Ok(format!(
        r#"
[data]
source = "prepared"
path = "{data}"

[rope]
scheme = "default"
theta = 10000.0

[train]
seed = 0
device = "cpu"
dtype = "f32"
micro_batch_size = {mb}
global_batch_tokens = {gb}
activation_checkpointing = "none"
loss_chunk_tokens = 2048
"#,
        data = p(data)?,
    ))
}

fn pretrain_toml(out: &Path, t0: usize, b: &BaseRecipe) -> Result<String> {
    Ok(format!(
        r#"# harpe demo: pretraining of a tiny Llama at {t0} tokens with plain RoPE (written by `harpe demo`)
[model]
tokenizer = "{tok}"

[model.init]
vocab_size = 259
hidden_size = {hidden}
intermediate_size = {inter}
num_hidden_layers = {layers}
num_attention_heads = {heads}
num_key_value_heads = {heads}
max_position_embeddings = {t0}
{data_and_train}
[optim]
lr = {lr:e}
weight_decay = 0.1
grad_clip = 1.0

[schedule]
kind = "cosine"
warmup_steps = {warmup}
min_lr_ratio = 0.1

[checkpoint]
every = {ckpt}
keep_last = 1

[log]
every = {logevery}
progress = false

[[stage]]
name = "pretrain"
seq_len = {t0}
steps = {steps}
"#,
        tok = p(&out.join("tokenizer.json"))?,
        data_and_train = data_and_train_toml(&out.join("data").join(format!("train_T{t0}")), 4, step_tokens(t0))?,
        steps = b.steps,
        hidden = b.hidden,
        inter = b.intermediate,
        layers = b.layers,
        heads = b.heads,
        lr = b.lr,
        warmup = b.warmup,
        ckpt = (b.steps / 10).max(1),
        logevery = (b.steps / 60).max(1),
    ))
}

fn extend_toml(out: &Path, base: &Path, sz: &Size) -> Result<String> {
    let t = 4 * sz.t0;
    Ok(format!(
        r#"# harpe demo: extension of the pretrained tiny Llama to {t} tokens (written by `harpe demo`);
# the sweep's arms replace [rope] or the stages
[model]
path = "{base}"
{data_and_train}
[optim]
lr = 1e-3
weight_decay = 0.1
grad_clip = 1.0

[schedule]
kind = "constant"
warmup_steps = 2

[checkpoint]
every = 16
keep_last = 1

[log]
every = 16
progress = false
plot = false

[[stage]]
name = "extend-4x"
seq_len = {t}
tokens = {tokens}
"#,
        base = p(base)?,
        data_and_train = data_and_train_toml(&out.join("data").join(format!("train_T{t}")), 1, step_tokens(sz.t0))?,
        tokens = sz.ext_tokens,
    ))
}

fn sweep_toml(out: &Path, sz: &Size) -> Result<String> {
    let (t0, t2, t4) = (sz.t0, 2 * sz.t0, 4 * sz.t0);
    let half = sz.ext_tokens / 2;
    let seeds = sz.seeds.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
    Ok(format!(
        r#"# harpe demo: single-stage HARPE vs multi-stage ABF and single-stage baselines at equal tokens
# (written by `harpe demo`; rerun with `harpe sweep --config {me}`)
name = "demo"
base = "extend.toml"
seeds = [{seeds}]

[[arm]]
name = "harpe"
set = ['rope={{ scheme = "harpe", head_bases = [20000.0, 40000.0, 60000.0, 80000.0] }}']

[[arm]]
name = "abf-multistage"
set = ['stage=[{{ name = "abf-2x", seq_len = {t2}, tokens = {half}, data = "{d2}", rope = {{ scheme = "default", theta = 40000.0 }} }}, {{ name = "abf-4x", seq_len = {t4}, tokens = {half}, rope = {{ scheme = "default", theta = 80000.0 }} }}]']

[[arm]]
name = "abf"
set = ['rope={{ scheme = "default", theta = 80000.0 }}']

[[arm]]
name = "pi"
set = ['rope={{ scheme = "linear", theta = 10000.0, factor = 4.0 }}']

[[eval.ppl]]
name = "heldout-{t4}"
input = ["{held}"]
window = {t4}
stride = {t0}

[eval.loss]
data = "{dheld}"
buckets = [{t0}, {t2}]
max_sequences = {loss_seqs}

[eval.niah]
tasks = "passkey"
lengths = [{t0}, {t2}, {t4}]
samples = {samples}
passkey_depths = 5
"#,
        me = p(&out.join("sweep.toml"))?,
        d2 = p(&out.join("data").join(format!("train_T{t2}")))?,
        held = p(&out.join("heldout.txt"))?,
        dheld = p(&out.join("data").join(format!("heldout_T{t4}")))?,
        samples = sz.samples,
        loss_seqs = sz.loss_seqs,
    ))
}

/// Passkey score per length of a model directory (runs `harpe eval-niah`).
fn passkey_scores(model: &Path, out: &Path, lengths: &[usize], samples: usize) -> Result<Vec<(usize, f64)>> {
    let lens: Vec<String> = lengths.iter().map(usize::to_string).collect();
    let args = [
        "eval-niah",
        "--model",
        &p(model)?,
        "--out",
        &p(out)?,
        "--tasks",
        "passkey",
        "--lengths",
        &lens.join(","),
        "--samples",
        &samples.to_string(),
        "--passkey-depths",
        "5",
        "--force",
    ];
    harpe(&args, &out.with_extension("log"))?;
    let text = std::fs::read_to_string(out.join("results.json")).context("eval-niah wrote no results.json")?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let mut s = vec![];
    for c in v.get("cells").and_then(|c| c.as_array()).into_iter().flatten() {
        let l = c.get("length").and_then(|x| x.as_u64()).unwrap_or(0) as usize;
        s.push((l, c.get("score").and_then(|x| x.as_f64()).unwrap_or(f64::NAN)));
    }
    s.sort_by_key(|x| x.0);
    Ok(s)
}

/// Remove and recreate `out`; its canonical path.
fn fresh_dir(out: &Path) -> Result<PathBuf> {
    if out.exists() {
        std::fs::remove_dir_all(out)
            .with_context(|| format!("cannot clear {}\nhint: pass another --out", out.display()))?;
    }
    std::fs::create_dir_all(out.join("data"))
        .with_context(|| format!("cannot create {}\nhint: pass a writable --out", out.display()))?;
    let out = std::fs::canonicalize(out).with_context(|| format!("cannot resolve {}", out.display()))?;
    std::fs::write(out.join("tokenizer.json"), crate::model::testing::byte_tokenizer_json())?;
    Ok(out)
}

/// Prepare the pretraining corpus at `t0` and pretrain the base by `harpe train` in `out/pretrain`;
/// the final checkpoint's directory.
fn pretrain_base(out: &Path, t0: usize, b: &BaseRecipe) -> Result<PathBuf> {
    let tok = out.join("tokenizer.json");
    prepare(&corpus(1, t0, b.docs), t0, &tok, &out.join("data").join(format!("train_T{t0}")))?;
    let pre_cfg = out.join("pretrain.toml");
    std::fs::write(&pre_cfg, pretrain_toml(out, t0, b)?)?;
    let pre_dir = out.join("pretrain");
    harpe(&["train", "--config", &p(&pre_cfg)?, "--out", &p(&pre_dir)?], &out.join("pretrain.log"))?;
    crate::train::RunDir::new(&pre_dir)
        .latest_checkpoint()?
        .ok_or_else(|| anyhow!("pretraining wrote no checkpoint\nhint: see {}", out.join("pretrain.log").display()))
}

/// `harpe demo --make-base DIR`: pretrain the base and write what `assets/demo-base/` ships.
fn make_base(args: &DemoArgs, dest: &Path) -> Result<()> {
    let t_start = Instant::now();
    let (t0, b) = (Size::new(args.quick).t0, BaseRecipe::new(args.quick));
    let out = fresh_dir(&args.out)?;
    println!("== harpe train: pretrain the demo's base at {t0} tokens ({} steps, {b:?})", b.steps);
    let ckpt = pretrain_base(&out, t0, &b)?;
    let train_s = t_start.elapsed().as_secs_f64();
    println!("   {train_s:.0}s, checkpoint {}", ckpt.display());
    let scores = passkey_scores(&ckpt, &out.join("base-passkey"), &[t0, 2 * t0], b.samples)?;
    for (l, sc) in &scores {
        println!("   passkey@{l}: {sc:.1}");
    }
    std::fs::create_dir_all(dest).with_context(|| format!("cannot create {}", dest.display()))?;
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(ckpt.join(f), dest.join(f))
            .with_context(|| format!("cannot copy {} to {}", ckpt.join(f).display(), dest.display()))?;
    }
    let provenance = serde_json::json!({
        "made_by": "scripts/make_demo_base.sh (harpe demo --make-base)",
        "harpe_version": env!("CARGO_PKG_VERSION"),
        "seq_len": t0,
        "recipe": b,
        "tokens": b.steps * step_tokens(t0) as u64,
        "final_train_loss": crate::train::metrics::read_records(&crate::train::RunDir::new(out.join("pretrain")).metrics())?.last().map(|r| r.loss),
        "train_seconds": train_s.round(),
        "passkey": scores.iter().map(|(l, s)| (l.to_string(), serde_json::json!(s))).collect::<serde_json::Map<_, _>>(),
        "pretrain_toml": std::fs::read_to_string(out.join("pretrain.toml"))?,
    });
    std::fs::write(dest.join("provenance.json"), serde_json::to_string_pretty(&provenance)? + "\n")?;
    println!("wrote {} (config.json, model.safetensors, provenance.json)", dest.display());
    Ok(())
}

/// "3 layers, 4 heads, hidden 128, byte tokens" from a model directory's config.json.
fn model_summary(dir: &Path) -> Result<String> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let g = |k: &str| v.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
    Ok(format!(
        "{} layers, {} heads, hidden {}, byte tokens",
        g("num_hidden_layers"),
        g("num_attention_heads"),
        g("hidden_size")
    ))
}

/// The shipped base (`assets/demo-base/`, written by `scripts/make_demo_base.sh`), compiled in so the
/// binary runs the demo anywhere.
const BASE_CONFIG: &str = include_str!("../../../assets/demo-base/config.json");
const BASE_WEIGHTS: &[u8] = include_bytes!("../../../assets/demo-base/model.safetensors");
const BASE_PROVENANCE: &str = include_str!("../../../assets/demo-base/provenance.json");

/// Write the shipped base into `out/base` (a model directory with the byte tokenizer).
fn shipped_base(out: &Path) -> Result<PathBuf> {
    let dir = out.join("base");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    std::fs::write(dir.join("config.json"), BASE_CONFIG)?;
    std::fs::write(dir.join("model.safetensors"), BASE_WEIGHTS)?;
    std::fs::write(dir.join("provenance.json"), BASE_PROVENANCE)?;
    std::fs::write(dir.join("tokenizer.json"), crate::model::testing::byte_tokenizer_json())?;
    Ok(dir)
}

/// "3000 steps, 9.2M tokens, final loss 0.37" from the shipped base's provenance.
fn shipped_summary() -> String {
    let v: serde_json::Value = serde_json::from_str(BASE_PROVENANCE).unwrap_or_default();
    format!(
        "{} steps, {:.1}M tokens, final training loss {:.3}",
        v["recipe"]["steps"],
        v["tokens"].as_f64().unwrap_or(f64::NAN) / 1e6,
        v["final_train_loss"].as_f64().unwrap_or(f64::NAN)
    )
}

/// The demo's data under `out`: the training corpora at 2·t0 and 4·t0 tokens, the held-out set prepared and
/// as `heldout.txt`.
fn prepare_corpora(out: &Path, sz: &Size) -> Result<()> {
    let (t0, t4) = (sz.t0, 4 * sz.t0);
    let tok = out.join("tokenizer.json");
    for (len, seed) in [(2 * t0, 2u64), (t4, 3)] {
        prepare(&corpus(seed, len, sz.docs), len, &tok, &out.join("data").join(format!("train_T{len}")))?;
    }
    let held = corpus(99, t4, sz.docs / 8 + 4);
    prepare(&held, t4, &tok, &out.join("data").join(format!("heldout_T{t4}")))?;
    let held_text: String =
        held.iter().filter(|(s, _)| s != "passkey").map(|(_, t)| format!("{t}\n")).take(sz.heldout_docs).collect();
    std::fs::write(out.join("heldout.txt"), held_text)?;
    Ok(())
}

/// Step 2: the base model, pretrained here (`--pretrain`) or the shipped one; its directory and a note
/// saying where it came from.
fn base_model(args: &DemoArgs, out: &Path, t0: usize) -> Result<(PathBuf, String)> {
    let t = Instant::now();
    Ok(if args.pretrain {
        let b = BaseRecipe::new(args.quick);
        println!("== [2/5] harpe train: pretrain a tiny Llama at {t0} tokens (plain RoPE, {} steps)", b.steps);
        let base = pretrain_base(out, t0, &b)?;
        println!("   {:.0}s, checkpoint {}", t.elapsed().as_secs_f64(), base.display());
        (base, format!("pretrained here at {t0} tokens for {} steps", b.steps))
    } else {
        println!("== [2/5] the shipped base: a tiny Llama pretrained at {t0} tokens (assets/demo-base/)");
        let base = shipped_base(out)?;
        (base, format!("pretrained at {t0} tokens by scripts/make_demo_base.sh ({})", shipped_summary()))
    })
}

/// `harpe demo`.
pub fn run(args: DemoArgs) -> Result<()> {
    if let Some(dest) = &args.make_base {
        return make_base(&args, dest);
    }
    let t_start = Instant::now();
    let sz = Size::new(args.quick);
    let out = &fresh_dir(&args.out)?;
    let (t0, t4) = (sz.t0, 4 * sz.t0);

    println!("== [1/5] built-in corpus (passkey, recall, facts, stories, arithmetic), per-source upsampling");
    prepare_corpora(out, &sz)?;
    let (base, base_note) = base_model(&args, out, t0)?;

    let lengths = [t0, 2 * t0, t4];
    println!("== [3/5] harpe eval-niah: the untreated model's passkey accuracy (trained at {t0})");
    let base_scores = passkey_scores(&base, &out.join("base-passkey"), &lengths, sz.samples)?;
    for (l, s) in &base_scores {
        println!("   passkey@{l}: {s:.1}{}", if *l > t0 { " (beyond the trained length)" } else { "" });
    }

    println!(
        "== [4/5] harpe sweep: extend to {t4} tokens, 4 arms x {} seeds, {} tokens each",
        sz.seeds.len(),
        sz.ext_tokens
    );
    let t = Instant::now();
    std::fs::write(out.join("extend.toml"), extend_toml(out, &base, &sz)?)?;
    let sweep_cfg = out.join("sweep.toml");
    std::fs::write(&sweep_cfg, sweep_toml(out, &sz)?)?;
    crate::research::sweep::run(SweepArgs {
        config: Some(sweep_cfg),
        out: Some(out.join("sweep")),
        jobs: args.jobs,
        dry_run: false,
        only: vec![],
        mfu: 0.4,
        peak_tflops: None,
        executor: crate::research::sweep::Executor::Local,
        status: None,
        task: None,
    })?;
    println!("   {:.0}s", t.elapsed().as_secs_f64());

    println!("== [5/5] harpe report");
    let rep_dir = out.join("report");
    let runs = report::collect_runs(&[out.join("sweep")])?;
    let rep = report::build(runs, Some("abf-multistage"), crate::research::stats::IntervalMethod::T)?;
    report::write(&rep, &rep_dir)?;
    let mut md = format!(
        "# harpe demo ({})\n\nTiny Llama ({}), {base_note}, then extended to {t4} tokens with {} tokens per arm and seed.\n\nUntreated base model, passkey accuracy: {}\n\n",
        if args.quick { "--quick" } else { "full" },
        model_summary(&base)?,
        sz.ext_tokens,
        base_scores.iter().map(|(l, s)| format!("{l}: {s:.1}")).collect::<Vec<_>>().join(", ")
    );
    md.push_str(&report::markdown(&rep).replacen("# harpe report\n\n", "", 1));
    std::fs::write(out.join("demo.md"), &md)?;
    print!("{md}");
    println!(
        "done in {:.0}s: {} (report.md, report.csv, report.json, loss_curves.png, passkey_by_length.png), demo.md",
        t_start.elapsed().as_secs_f64(),
        rep_dir.display()
    );
    Ok(())
}
