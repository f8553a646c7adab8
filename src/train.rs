//! `harpe train`: THE training loop, top to bottom: data -> model -> chunked loss -> layer-wise
//! backward -> gradient reduction -> clip -> AdamW on fp32 master weights -> checkpoint -> log.
//!
//! Reference: llm.c `train_gpt2.cu` "TRAINING SECTION" (one straight loop), HARPE §4 and spec §3
//! (multi-stage ABF, constant lr 2e-5, AdamW 0.9/0.95), Chen et al. 2016 (activation checkpointing).
//! The non-obvious decisions:
//! - Activation checkpointing is done here, by hand, on top of candle's autograd: the forward keeps only
//!   the input of every segment of k layers (detached), then the backward walks the segments from the
//!   last to the first, recomputing each one from a fresh `Var` of its input and back-propagating
//!   `sum(out * grad_out)`, whose gradient is exactly `grad_out`. The last segment keeps its graph from
//!   the forward, so "none" (one segment) never recomputes anything.
//! - Loss is token-mean over all target tokens of the optimizer step, so each micro-batch's nll sum is
//!   scaled by 1 / (tokens of the whole step): k micro-batches give the gradient of one k-times batch.
//! - Weights the model computes with are candle `Var`s in the compute dtype; the optimizer owns fp32
//!   master weights and moments as flat vectors and writes the updated weights back into the `Var`s.
//! - A sequence of T tokens trains T-1 targets (token t+1 from tokens <= t); the last position is ignored.
//!
//! What this file does not do: multi-GPU (comms/ is called, but only `Comm::Single` exists), document
//! masks inside packed sequences (Fu et al. train without them), evaluation during training.
use crate::checkpoint::{self, TrainState};
use crate::comms::Comm;
use crate::config::{ComputeDtype, DataSource, DeviceKind, RunConfig};
use crate::data::{prepare_from_texts, tokenizer_sha256, Loader, LoaderConfig, PrepareOptions, Sequence};
use crate::grads::{self, GradAccum, ParamLayout};
use crate::loss::{chunked_cross_entropy, IGNORE_INDEX};
use crate::metrics::{self, mem, MetricsLog, StepRecord};
use crate::model::config::LlamaConfig;
use crate::model::llama::rms_norm;
use crate::model::rope::RopeTables;
use crate::model::weights::{init_random, load_tensors, save_model_dir};
use crate::model::Llama;
use crate::optim::adamw::{AdamW, AdamWHyper};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// `harpe train`: single- or multi-stage continual pretraining from a TOML recipe.
#[derive(clap::Args, Debug, Clone)]
pub struct TrainArgs {
    /// TOML recipe: [model] [data] [rope] [train] [optim] [schedule] [checkpoint] [dist] [log] and
    /// [[stage]] tables (see configs/tiny-cpu.toml)
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// run directory for config.toml, metrics.jsonl, loss.png and checkpoints/
    /// [default: runs/<config file name without .toml>]
    #[arg(long, value_name = "RUN_DIR")]
    pub out: Option<PathBuf>,
    /// stop after N optimizer steps in total (steps of a resumed run count) and write a final checkpoint
    #[arg(long, value_name = "N")]
    pub steps: Option<u64>,
    /// continue bit-identically from the newest complete checkpoint in the run directory
    /// (starts from scratch when there is none)
    #[arg(long)]
    pub resume: bool,
    /// override one config value, e.g. --set optim.lr=1e-5 or --set stage.0.steps=10 (repeatable)
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// use a run directory that already belongs to a different config (replaces its config.toml)
    #[arg(long)]
    pub force: bool,
}

/// What one micro-batch's forward/backward produced.
pub struct MicroOut {
    /// per-position nll (B*T), 0 at ignored positions
    pub nll: Vec<f32>,
}

/// Forward and backward of one micro-batch with activation checkpointing every `seg` layers; adds
/// `scale * d(sum nll)/d(param)` into `grads`. ids (B, T) u32, targets (B*T) u32 (IGNORE_INDEX skips),
/// `tables[l]` the RoPE tables of layer l (or one shared table).
#[allow(clippy::too_many_arguments)]
pub fn forward_backward(
    model: &Llama,
    vars: &[Var],
    layout: &ParamLayout,
    tables: &[RopeTables],
    ids: &Tensor,
    targets: &Tensor,
    seg: usize,
    loss_chunk: usize,
    scale: f64,
    grads: &mut GradAccum,
) -> Result<MicroOut> {
    let (b, t) = ids.dims2()?;
    let c = model.cfg.hidden_size;
    let n_layers = model.layers.len();
    let table = |l: usize| &tables[l.min(tables.len() - 1)];
    let segments: Vec<(usize, usize)> =
        (0..n_layers).step_by(seg.max(1)).map(|s| (s, (s + seg).min(n_layers))).collect();
    let run_segment = |x: &Tensor, (lo, hi): (usize, usize)| -> Result<Tensor> {
        let mut x = x.clone();
        for l in lo..hi {
            x = model.layer_forward(l, &x, table(l), None)?; // (B, T, C)
        }
        Ok(x)
    };

    // Forward: keep only the (detached) input of every segment; the last one keeps its graph.
    let x0 = model.embed(ids)?; // (B, T, C), graph into embed_tokens
    let mut saved: Vec<Tensor> = Vec::with_capacity(segments.len()); // segment inputs (B, T, C)
    let mut x = x0.detach();
    for &s in &segments[..segments.len() - 1] {
        saved.push(x.clone());
        x = run_segment(&x, s)?.detach();
    }
    let last_in = Var::from_tensor(&x)?;
    let y = run_segment(last_in.as_tensor(), segments[segments.len() - 1])?; // (B, T, C)
    let h = rms_norm(&y, &model.norm, model.cfg.rms_norm_eps)?.reshape((b * t, c))?; // (B*T, C)
    let nll = chunked_cross_entropy(&h, &model.lm_head, targets, loss_chunk)?; // (B*T)
    let store = (nll.sum_all()? * scale)?.backward()?;
    grads.add_from(layout, vars, &store)?;
    let mut g =
        store.get(last_in.as_tensor()).cloned().ok_or_else(|| anyhow!("no gradient reached the last layers"))?;
    let nll = nll.to_vec1::<f32>()?;
    drop(store);

    // Backward through the earlier segments, last to first, recomputing each from its saved input.
    for (i, &s) in segments[..segments.len() - 1].iter().enumerate().rev() {
        let xin = Var::from_tensor(&saved[i])?;
        let y = run_segment(xin.as_tensor(), s)?; // (B, T, C)
        let store = (y * g.detach())?.sum_all()?.backward()?;
        grads.add_from(layout, vars, &store)?;
        g = store.get(xin.as_tensor()).cloned().ok_or_else(|| anyhow!("no gradient reached layer {}", s.0))?;
        saved.truncate(i);
    }
    let store = (x0 * g.detach())?.sum_all()?.backward()?;
    grads.add_from(layout, vars, &store)?;
    Ok(MicroOut { nll })
}

/// RoPE tables for positions 0..t of every layer (one shared table unless layers differ).
pub fn rope_tables(model: &Llama, t: usize) -> Result<Vec<RopeTables>> {
    let n = if model.cfg.rope.per_layer() { model.layers.len() } else { 1 };
    (0..n).map(|l| model.rope_tables(l, 0, t)).collect()
}

/// Input ids (B, T) and shifted targets (B*T, last position of each sequence ignored) of sequences.
pub fn batch_tensors(seqs: &[&[u32]], device: &Device) -> Result<(Tensor, Tensor)> {
    let b = seqs.len();
    let t = seqs.first().map(|s| s.len()).unwrap_or(0);
    let mut ids = Vec::with_capacity(b * t);
    let mut tg = Vec::with_capacity(b * t);
    for s in seqs {
        if s.len() != t {
            bail!("sequences of one batch differ in length ({} vs {t})", s.len());
        }
        ids.extend_from_slice(s);
        tg.extend_from_slice(&s[1..]);
        tg.push(IGNORE_INDEX);
    }
    Ok((Tensor::from_vec(ids, (b, t), device)?, Tensor::from_vec(tg, b * t, device)?))
}

/// Write fp32 master values (`master` covers `range` of the flat vector) into the model's Vars.
pub fn write_back(vars: &[Var], layout: &ParamLayout, master: &[f32], range: std::ops::Range<usize>) -> Result<()> {
    for (p, v) in layout.params.iter().zip(vars) {
        if p.range.start >= range.start && p.range.end <= range.end {
            let src = &master[p.range.start - range.start..p.range.end - range.start];
            let t = Tensor::from_slice(src, p.shape.as_slice(), v.device())?.to_dtype(v.dtype())?;
            v.set(&t)?;
        }
    }
    Ok(())
}

/// A model whose parameters are `Var`s, built from flat fp32 master weights in the compute dtype.
pub fn trainable_model(
    cfg: &LlamaConfig,
    layout: &ParamLayout,
    master: &[f32],
    dtype: DType,
    device: &Device,
) -> Result<(Llama, Vec<Var>)> {
    let mut map = HashMap::new();
    for p in &layout.params {
        let t = Tensor::from_slice(&master[p.range.clone()], p.shape.as_slice(), device)?.to_dtype(dtype)?;
        map.insert(p.name.clone(), t);
    }
    let (model, named) = Llama::from_tensors(cfg.clone(), map, "training weights")?.into_trainable()?;
    if named.len() != layout.params.len() || named.iter().zip(&layout.params).any(|((n, _), p)| *n != p.name) {
        bail!("internal: the model's parameter order differs from the optimizer layout");
    }
    Ok((model, named.into_iter().map(|(_, v)| v).collect()))
}

/// Flatten HF-named tensors (in `order`) to one fp32 vector and its layout.
pub fn flatten_params(order: &[(String, Tensor)]) -> Result<(ParamLayout, Vec<f32>)> {
    let layout = ParamLayout::new(&order.iter().map(|(n, t)| (n.clone(), t.dims().to_vec())).collect::<Vec<_>>());
    let mut flat = Vec::with_capacity(layout.total);
    for (_, t) in order {
        flat.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
    }
    Ok((layout, flat))
}

/// AdamW hyper-parameters from `[optim]`.
pub fn adamw_hyper(cfg: &RunConfig) -> AdamWHyper {
    let o = &cfg.optim;
    AdamWHyper {
        beta1: o.beta1 as f32,
        beta2: o.beta2 as f32,
        eps: o.eps as f32,
        wd_matrix: o.weight_decay as f32,
        wd_embedding: o.weight_decay_embedding.unwrap_or(o.weight_decay) as f32,
        wd_norm: o.weight_decay_norm as f32,
    }
}

/// Built-in training text for runs with `[data] source = "builtin"`: two deterministic synthetic
/// sources ("stories": templated English sentences; "arithmetic": sums with their results), enough
/// structure for a tiny model's loss to fall within a minute.
pub fn builtin_texts(seed: u64) -> Vec<(String, String)> {
    use rand::{Rng, SeedableRng};
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let names = ["Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana"];
    let verbs = ["found", "painted", "carried", "lost", "sold", "built", "opened", "cleaned"];
    let things = ["a red box", "the old boat", "a small lamp", "the green door", "a long rope", "the blue cup"];
    let places = ["by the river", "in the garden", "at the market", "near the hill", "in the kitchen"];
    let mut docs = Vec::new();
    for _ in 0..240 {
        let mut s = String::new();
        for _ in 0..r.random_range(6..14) {
            let (n, v) = (names[r.random_range(0..names.len())], verbs[r.random_range(0..verbs.len())]);
            let (t, p) = (things[r.random_range(0..things.len())], places[r.random_range(0..places.len())]);
            s.push_str(&format!("{n} {v} {t} {p}. Then {n} went home. "));
        }
        docs.push(("stories".to_string(), s));
        let mut a = String::new();
        for _ in 0..r.random_range(10..30) {
            let (x, y) = (r.random_range(0..50u32), r.random_range(0..50u32));
            a.push_str(&format!("{x} + {y} = {}. ", x + y));
        }
        docs.push(("arithmetic".to_string(), a));
    }
    docs
}

/// The run's model architecture and initial fp32 weights (HF order).
fn initial_model(cfg: &RunConfig, origin: &str) -> Result<(LlamaConfig, Vec<(String, Tensor)>)> {
    let cpu = Device::Cpu;
    if let Some(dir) = &cfg.model.path {
        let mut mc = LlamaConfig::from_file(&dir.join("config.json"))?;
        mc.validate(&dir.join("config.json").display().to_string())?;
        let t = load_tensors(dir, DType::F32, &cpu)?;
        let model = Llama::from_tensors(mc.clone(), t, &dir.display().to_string())?;
        return Ok((mc, model.tensors()));
    }
    let a = cfg.model.init.as_ref().ok_or_else(|| anyhow!("{origin}: [model] has neither path nor init"))?;
    let rope = cfg.rope.clone().or_else(|| cfg.stages.iter().find_map(|s| s.rope.clone())).ok_or_else(|| {
        anyhow!("{origin}: a randomly initialized model needs a RoPE scheme\nhint: add a [rope] table, e.g. scheme = \"default\", theta = 10000.0")
    })?;
    let mut mc = LlamaConfig::tiny(a.vocab_size, rope);
    mc.hidden_size = a.hidden_size;
    mc.intermediate_size = a.intermediate_size;
    mc.num_hidden_layers = a.num_hidden_layers;
    mc.num_attention_heads = a.num_attention_heads;
    mc.num_key_value_heads = a.num_key_value_heads.unwrap_or(a.num_attention_heads);
    mc.head_dim = a.head_dim.unwrap_or(a.hidden_size / a.num_attention_heads);
    mc.max_position_embeddings = a.max_position_embeddings;
    mc.rms_norm_eps = a.rms_norm_eps;
    mc.tie_word_embeddings = a.tie_word_embeddings;
    mc.initializer_range = a.initializer_range;
    mc.validate(&format!("{origin} [model.init]"))?;
    let t = init_random(&mc, cfg.train.seed, DType::F32, &cpu)?;
    Ok((mc, t))
}

/// Make sure the run directory exists, is writable, and belongs to this config (unless `force`).
fn prepare_run_dir(dir: &Path, toml: &str, hash: &str, force: bool) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create run directory {}\nhint: choose a writable --out", dir.display()))?;
    let probe = dir.join(".write-test");
    std::fs::write(&probe, b"ok")
        .with_context(|| format!("run directory {} is not writable\nhint: choose a writable --out", dir.display()))?;
    let _ = std::fs::remove_file(&probe);
    let cfg_path = dir.join("config.toml");
    if cfg_path.exists() && !force {
        let old = std::fs::read_to_string(&cfg_path).with_context(|| format!("cannot read {}", cfg_path.display()))?;
        let old_hash = crate::util::sha256_hex(old.as_bytes());
        if old_hash != hash {
            bail!(
                "{} belongs to a run with a different config (config hash {} != {})\nhint: use another --out, or pass --force to reuse the directory",
                dir.display(),
                &old_hash[..12],
                &hash[..12]
            );
        }
    }
    crate::util::write_atomic(&cfg_path, toml.as_bytes())
}

/// The dataset directory of stage `i`, preparing the built-in one on first use.
fn stage_dataset(cfg: &RunConfig, i: usize, run_dir: &Path, tokenizer: &Path) -> Result<PathBuf> {
    let s = &cfg.stages[i];
    if let Some(d) = s.data.as_ref().or(cfg.data.path.as_ref()) {
        if cfg.data.source == DataSource::Prepared || s.data.is_some() {
            return Ok(d.clone());
        }
    }
    let dir = run_dir.join("data").join(format!("builtin_T{}", s.seq_len));
    if !dir.join("manifest.json").exists() {
        let mut opts = PrepareOptions::new(s.seq_len);
        opts.seed = cfg.train.seed;
        prepare_from_texts(&builtin_texts(cfg.train.seed), tokenizer, &opts, &dir)
            .with_context(|| format!("preparing the built-in dataset in {}", dir.display()))?;
    }
    Ok(dir)
}

/// Resolve the tokenizer file of the run (the built-in byte tokenizer is written into the run dir).
fn tokenizer_path(cfg: &RunConfig, run_dir: &Path) -> Result<PathBuf> {
    if let Some(t) = &cfg.model.tokenizer {
        return Ok(t.clone());
    }
    if let Some(d) = &cfg.model.path {
        return Ok(d.join("tokenizer.json"));
    }
    let p = run_dir.join("tokenizer.json");
    crate::util::write_atomic(&p, crate::model::testing::byte_tokenizer_json().as_bytes())?;
    Ok(p)
}

/// Run `harpe train`.
pub fn run(args: TrainArgs) -> Result<()> {
    let origin = args.config.display().to_string();
    let resolved = RunConfig::load(&args.config, &args.set)?;
    let cfg = &resolved.cfg;
    let run_dir = args.out.clone().unwrap_or_else(|| {
        PathBuf::from("runs")
            .join(args.config.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "run".into()))
    });
    let _lock = crate::util::lock_dir(&run_dir, "harpe train")?; // issue 16: one writer per run directory (held to the end)
    println!("# resolved config (sha256 {})\n{}", &resolved.hash[..12], resolved.toml);
    prepare_run_dir(&run_dir, &resolved.toml, &resolved.hash, args.force)?;
    let ckpt_root = run_dir.join("checkpoints");
    let resume_from = if args.resume { checkpoint::latest_complete(&ckpt_root)? } else { None };
    if !args.resume {
        if let Some(p) = checkpoint::latest_complete(&ckpt_root)? {
            bail!(
                "{} already holds checkpoint {}\nhint: pass --resume to continue it, or choose another --out",
                run_dir.display(),
                p.display()
            );
        }
    }

    // SIGINT/SIGTERM: finish the step, checkpoint, exit 0 (a second SIGINT kills at once).
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(sig, 1, Arc::clone(&stop))?;
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }

    let device = match cfg.train.device {
        DeviceKind::Cpu => Device::Cpu,
        DeviceKind::Cuda => Device::new_cuda(0)
            .map_err(|e| anyhow!("{origin}: train.device = \"cuda\" is not available: {e}\nhint: build with --features cuda on a GPU machine, or set train.device = \"cpu\""))?,
    };
    let dtype = match cfg.train.dtype {
        ComputeDtype::Bf16 => DType::BF16,
        ComputeDtype::F32 => DType::F32,
    };
    let comm = Comm::Single;
    let (rank, world) = (comm.rank(), comm.world_size());

    let (base_cfg, init) = initial_model(cfg, &origin)?;
    let tokenizer = tokenizer_path(cfg, &run_dir)?;
    let tok_sha = tokenizer_sha256(&tokenizer)?;
    let (layout, flat) = flatten_params(&init)?;
    drop(init);
    let n_params = layout.total;
    let mut optim = AdamW::new(&layout, &flat, comm.shard_range(layout.total), adamw_hyper(cfg));
    drop(flat);

    let mut state = TrainState {
        format: checkpoint::FORMAT,
        step: 0,
        stage: 0,
        stage_step: 0,
        tokens_seen: 0,
        data_cursor: serde_json::Value::Null,
        seed: cfg.train.seed,
        config_hash: resolved.hash.clone(),
        rope: base_cfg.rope.clone(),
        skipped_steps: 0,
    };
    if let Some(dir) = &resume_from {
        state = checkpoint::load_state(dir)?;
        if state.config_hash != resolved.hash && !args.force {
            bail!(
                "{} was written by a different config\nhint: resume with the same config and --set values, or pass --force",
                dir.display()
            );
        }
        checkpoint::load_optim(dir, (rank, world), &mut optim)?;
        println!("resuming from {} (step {}, stage {})", dir.display(), state.step, state.stage);
    }
    let mut log = MetricsLog::open(&run_dir.join("metrics.jsonl"), state.step)?;
    let total_steps: u64 = (0..cfg.stages.len()).map(|i| cfg.stage_steps(i).0).sum();
    let limit = args.steps.unwrap_or(u64::MAX);
    let sched = cfg.schedule.schedule();
    let t_start = Instant::now();
    let mut bad_streak = 0u32;
    let mut last_saved: Option<PathBuf> = resume_from.clone();

    'stages: for si in state.stage..cfg.stages.len() {
        let st = &cfg.stages[si];
        let (steps, tokens_per_step) = cfg.stage_steps(si);
        let accum = cfg.accumulation(si);
        let bsz = cfg.train.micro_batch_size;
        let mut mc = base_cfg.clone();
        if let Some(r) = st.rope.clone().or_else(|| cfg.rope.clone()) {
            mc.rope = r;
        }
        mc.max_position_embeddings = mc.max_position_embeddings.max(st.seq_len);
        mc.validate(&format!("{origin}: stage {si}"))?;
        let (model, vars) = trainable_model(&mc, &layout, &optim.master, dtype, &device)?;
        let tables = rope_tables(&model, st.seq_len)?;
        let data_dir = stage_dataset(cfg, si, &run_dir, &tokenizer)?;
        let lcfg = LoaderConfig {
            seq_len: st.seq_len,
            shuffle: cfg.data.shuffle,
            seed: cfg.train.seed,
            rank,
            world_size: world,
        };
        let mut loader = Loader::open(&data_dir, lcfg)
            .with_context(|| format!("stage {si}: opening dataset {}", data_dir.display()))?;
        if loader.manifest().tokenizer_sha256 != tok_sha {
            bail!(
                "stage {si}: dataset {} was tokenized with another tokenizer (sha256 {}) than {} ({})\nhint: prepare the data with the model's tokenizer.json",
                data_dir.display(),
                &loader.manifest().tokenizer_sha256[..12.min(loader.manifest().tokenizer_sha256.len())],
                tokenizer.display(),
                &tok_sha[..12]
            );
        }
        let sources = loader.manifest().source_names.clone();
        if si == state.stage && state.stage_step > 0 {
            let cursor = serde_json::from_value(state.data_cursor.clone())
                .map_err(|e| anyhow!("state.json: data_cursor: {e}\nhint: the checkpoint is damaged"))?;
            loader.restore(&cursor)?;
        } else {
            state.stage = si;
            state.stage_step = 0;
            if si > 0 && st.reset_optimizer.unwrap_or(cfg.optim.reset_between_stages) {
                optim.reset_moments();
            }
        }
        state.rope = mc.rope.clone();
        let lr_peak = st.lr.unwrap_or(cfg.optim.lr);
        let seg = cfg.train.activation_checkpointing.segment_len(mc.num_hidden_layers);
        let targets_per_step = (accum * bsz * (st.seq_len - 1)) as f64;
        let flops_tok = metrics::flops_per_token(n_params, mc.num_hidden_layers, mc.hidden_size, st.seq_len);
        let pb = progress_bar(cfg.log.progress, si, steps, state.stage_step);
        let mut grads = GradAccum::new(&layout);
        let save = |state: &TrainState, optim: &AdamW, vars: &[Var]| -> Result<PathBuf> {
            let write_model = |dir: &Path| -> Result<()> {
                let tensors: Vec<(String, Tensor)> =
                    layout.params.iter().zip(vars).map(|(p, v)| (p.name.clone(), v.as_tensor().clone())).collect();
                save_model_dir(dir, &mc, &tensors, cfg.checkpoint.max_shard_bytes)?;
                std::fs::copy(&tokenizer, dir.join("tokenizer.json"))
                    .with_context(|| format!("copying {} into the checkpoint", tokenizer.display()))?;
                Ok(())
            };
            checkpoint::save(&ckpt_root, state, optim, (rank, world), cfg.checkpoint.keep_last, &write_model)
        };

        while state.stage_step < steps {
            if state.step >= limit {
                break 'stages;
            }
            // ---- one optimizer step ----
            mem::reset_peak();
            let step_start_bytes = mem::rss_bytes();
            let t0 = Instant::now();
            grads.zero();
            let mut sums = [0f64; 2]; // nll sum, target count
            let mut per_src: BTreeMap<String, (f64, f64)> = BTreeMap::new();
            for _ in 0..accum {
                let seqs: Vec<Sequence> = (0..bsz).map(|_| loader.next_sequence()).collect::<Result<_>>()?;
                let toks: Vec<&[u32]> = seqs.iter().map(|s| s.tokens.as_slice()).collect();
                let (ids, targets) = batch_tensors(&toks, &device)?;
                let out = forward_backward(
                    &model,
                    &vars,
                    &layout,
                    &tables,
                    &ids,
                    &targets,
                    seg,
                    cfg.train.loss_chunk_tokens,
                    1.0 / targets_per_step,
                    &mut grads,
                )?;
                sums[0] += out.nll.iter().map(|&x| x as f64).sum::<f64>();
                sums[1] += (bsz * (st.seq_len - 1)) as f64;
                accumulate_per_source(&seqs, &out.nll, &sources, &mut per_src);
            }
            comm.all_reduce_mean(&mut grads.flat)?;
            comm.all_reduce_sum_f64(&mut sums)?;
            let loss = sums[0] / sums[1];
            let gnorm = grads::global_norm(&grads.flat);
            let lr = sched.lr_at(lr_peak, state.stage_step, steps);
            let skipped = !(loss.is_finite() && gnorm.is_finite());
            if skipped {
                bad_streak += 1;
                state.skipped_steps += 1;
            } else {
                bad_streak = 0;
                grads::clip_by_global_norm(&mut grads.flat, gnorm, cfg.optim.grad_clip);
                let range = optim.range.clone();
                optim.step(&grads.flat[range.clone()], lr);
                write_back(&vars, &layout, &optim.master, range)?;
            }
            state.step += 1;
            state.stage_step += 1;
            state.tokens_seen += tokens_per_step;
            state.data_cursor = serde_json::to_value(loader.cursor())?;
            let dt = t0.elapsed().as_secs_f64();
            let tflops = flops_tok * tokens_per_step as f64 / dt / 1e12;
            let rec = StepRecord {
                step: state.step,
                stage: si,
                seq_len: st.seq_len,
                loss,
                grad_norm: gnorm,
                lr,
                tokens: tokens_per_step,
                tokens_seen: state.tokens_seen,
                tokens_per_s: tokens_per_step as f64 / dt,
                tflops,
                mfu: (cfg.log.peak_tflops > 0.0).then(|| tflops / cfg.log.peak_tflops),
                rss_bytes: mem::rss_bytes(),
                step_peak_bytes: mem::peak_bytes(),
                step_start_bytes,
                skipped,
                per_source: per_src.into_iter().map(|(k, (s, n))| (k, s / n.max(1.0))).collect(),
                elapsed_s: t_start.elapsed().as_secs_f64(),
            };
            log.write(&rec)?;
            if state.step.is_multiple_of(cfg.log.every.max(1)) || skipped {
                let line = metrics::step_line(&rec, total_steps);
                match &pb {
                    Some(pb) => pb.println(line),
                    None => println!("{line}"),
                }
            }
            if let Some(pb) = &pb {
                pb.set_position(state.stage_step);
            }
            if bad_streak >= cfg.train.max_bad_steps.max(1) {
                let last = last_saved
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "none (no checkpoint was written yet)".into());
                bail!(
                    "{bad_streak} consecutive steps had a non-finite loss or gradient (last: step {}); training stopped. Last good checkpoint: {last}\nhint: lower the learning rate, keep optim.grad_clip on, or check the data; continue with --resume",
                    state.step
                );
            }
            let stage_end = state.stage_step == steps;
            let periodic = cfg.checkpoint.every > 0 && state.step.is_multiple_of(cfg.checkpoint.every);
            let stopping = stop.load(Ordering::SeqCst) || state.step >= limit;
            if (periodic || stage_end || stopping) && !skipped && bad_streak == 0 {
                let mut snap = state.clone();
                if stage_end {
                    snap.stage = si + 1;
                    snap.stage_step = 0;
                    snap.data_cursor = serde_json::Value::Null;
                }
                let p = save(&snap, &optim, &vars)?;
                if let Some(pb) = &pb {
                    pb.println(format!("saved {}", p.display()));
                } else {
                    println!("saved {}", p.display());
                }
                last_saved = Some(p);
            }
            if stop.load(Ordering::SeqCst) {
                if let Some(pb) = &pb {
                    pb.finish_and_clear();
                }
                println!("stopped by signal after step {}; resume with --resume", state.step);
                finish(cfg, &run_dir)?;
                return Ok(());
            }
        }
        if let Some(pb) = &pb {
            pb.finish_and_clear();
        }
    }
    finish(cfg, &run_dir)?;
    let tok_s = state.tokens_seen as f64 / t_start.elapsed().as_secs_f64().max(1e-9);
    println!(
        "done: {} steps, {} tokens, {} skipped; last checkpoint {}; {:.0} tokens/s this session",
        state.step,
        state.tokens_seen,
        state.skipped_steps,
        last_saved.map(|p| p.display().to_string()).unwrap_or_else(|| "none".into()),
        tok_s
    );
    Ok(())
}

/// End of a session: the loss curve of the whole run (all records in metrics.jsonl).
fn finish(cfg: &RunConfig, run_dir: &Path) -> Result<()> {
    if cfg.log.plot {
        let recs = metrics::read_records(&run_dir.join("metrics.jsonl"))?;
        metrics::plot_loss(&recs, &run_dir.join("loss.png"), "harpe train: loss")?;
    }
    Ok(())
}

/// Add the nll of every predicted token to the source of that token (position p predicts p + 1).
fn accumulate_per_source(seqs: &[Sequence], nll: &[f32], names: &[String], acc: &mut BTreeMap<String, (f64, f64)>) {
    if names.len() < 2 {
        return;
    }
    for (i, s) in seqs.iter().enumerate() {
        let t = s.tokens.len();
        for span in &s.sources {
            let name = names.get(span.source as usize).cloned().unwrap_or_else(|| format!("source{}", span.source));
            let e = acc.entry(name).or_insert((0.0, 0.0));
            // targets at positions max(start,1)-1 .. end-1 predict tokens start..end
            for p in span.start.max(1) - 1..span.end.min(t) - 1 {
                e.0 += nll[i * t + p] as f64;
                e.1 += 1.0;
            }
        }
    }
}

fn progress_bar(enabled: bool, stage: usize, steps: u64, pos: u64) -> Option<indicatif::ProgressBar> {
    if !enabled {
        return None;
    }
    let pb = indicatif::ProgressBar::new(steps);
    let style = indicatif::ProgressStyle::with_template(&format!(
        "stage {stage} [{{bar:30}}] {{pos}}/{{len}} steps, {{elapsed_precise}} elapsed, ETA {{eta_precise}}"
    ))
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    pb.set_style(style);
    pb.set_position(pos);
    Some(pb)
}
