//! `harpe train`: THE training loop. `run` reads as the loop itself: open the run, then for every stage
//! `Stage::open`, and for every step `train_step` (data -> model -> chunked loss -> layer-wise backward
//! -> gradient all-reduce -> clip -> AdamW on this rank's fp32 shard -> all-gather + write-back),
//! `log_step`, `check_bad_streak`, `maybe_evaluate` (`[eval]`), `maybe_checkpoint`; a single `finish` at the end, also on a signal.
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
//!   master weights and moments of its shard (`FlatBuf`s); after each update the shards are all-gathered
//!   into one full fp32 `weights` buffer and every parameter is written back from it (`comms::zero`), so
//!   a stage's model is built from `weights`, never from a shard.
//! - The communicator comes from `[dist]` (`Comm::from_config`); with one rank every collective is a
//!   no-op, so there is no `if distributed` branch here.
//! - A sequence of T tokens trains T-1 targets (token t+1 from tokens <= t); the last position is ignored.
//!
//! What this file does not do: multi-rank backends (comms/ refuses them for now), document masks inside
//! packed sequences (Fu et al. train without them); the evaluation rules (eval/in_training.rs calls them).
use crate::checkpoint::{self, TrainState};
use crate::comms::zero::{self, ShardMap, Split};
use crate::comms::{Comm, Mesh};
use crate::config::{DataSource, RunConfig};
use crate::data::loader::source_name;
use crate::data::{
    builtin_texts, prepare_from_texts, tokenizer_sha256, Loader, LoaderConfig, PrepareOptions, Sequence,
};
use crate::eval::in_training::{eval_line, TrainEval};
use crate::flatbuf::FlatBuf;
use crate::grads::{self, flatten_params, GradAccum, ParamLayout};
use crate::loss::{chunked_cross_entropy, IGNORE_INDEX};
use crate::metrics::{self, mem, MetricsLog, StepRecord};
use crate::model::attention::AttentionImpl;
use crate::model::config::LlamaConfig;
use crate::model::llama::rms_norm;
use crate::model::rope::RopeTables;
use crate::model::weights::{init_random, load_tensors, save_model_dir};
use crate::model::Llama;
use crate::optim::adamw::{AdamW, AdamWHyper};
use crate::optim::schedule::Schedule;
use crate::tensorboard::{self, TbWriter};
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

impl TrainArgs {
    /// The run directory: `--out`, else `runs/<config file name without .toml>`.
    pub fn run_dir(&self) -> PathBuf {
        self.out.clone().unwrap_or_else(|| {
            let stem = self.config.file_stem().map(|s| s.to_string_lossy().to_string());
            PathBuf::from("runs").join(stem.unwrap_or_else(|| "run".into()))
        })
    }
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

/// A model whose parameters are `Var`s in the compute dtype, built from `weights`: ALL parameters, fp32,
/// over the whole flat space (the gathered weights, never one rank's shard).
pub fn trainable_model(
    cfg: &LlamaConfig,
    layout: &ParamLayout,
    weights: &FlatBuf,
    dtype: DType,
    device: &Device,
) -> Result<(Llama, Vec<Var>)> {
    if weights.len() != layout.total {
        bail!("internal: a model needs all {} parameters, got a buffer of {}", layout.total, weights.len());
    }
    let mut map = HashMap::new();
    for p in &layout.params {
        map.insert(p.name.clone(), weights.param_tensor(p.range.clone(), &p.shape, dtype, device)?);
    }
    let (model, named) = Llama::from_tensors(cfg.clone(), map, "training weights")?.into_trainable()?;
    if named.len() != layout.params.len() || named.iter().zip(&layout.params).any(|((n, _), p)| *n != p.name) {
        bail!("internal: the model's parameter order differs from the optimizer layout");
    }
    Ok((model, named.into_iter().map(|(_, v)| v).collect()))
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
    let rope = cfg.initial_rope().ok_or_else(|| {
        anyhow!("{origin}: a randomly initialized model needs a RoPE scheme\nhint: add a [rope] table, e.g. scheme = \"default\", theta = 10000.0")
    })?;
    let mut mc = LlamaConfig::tiny(a.vocab_size, rope);
    mc.hidden_size = a.hidden_size;
    mc.intermediate_size = a.intermediate_size;
    mc.num_hidden_layers = a.num_hidden_layers;
    mc.num_attention_heads = a.num_attention_heads;
    mc.num_key_value_heads = a.kv_heads();
    mc.head_dim = a.head_dim();
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
    let mut r = Run::open(&args)?;
    let mut ev = TrainEval::open(
        r.cfg.eval.as_ref(),
        &r.tokenizer,
        &r.tok_sha,
        &r.run_dir.join("metrics.jsonl"),
        r.cfg.train.loss_chunk_tokens,
    )?;
    let mut end = End::Done;
    'stages: for si in r.state.stage..r.cfg.stages.len() {
        let mut stage = Stage::open(&mut r, si)?;
        while r.state.stage_step < stage.steps {
            if r.state.step >= r.limit {
                break 'stages;
            }
            let out = train_step(&mut r, &mut stage)?;
            log_step(&mut r, &stage, &out)?;
            r.check_bad_streak()?;
            maybe_evaluate(&mut r, &stage, ev.as_mut())?;
            maybe_checkpoint(&mut r, &stage, &out)?;
            if r.stop.load(Ordering::SeqCst) {
                stage.close();
                end = End::Signal;
                break 'stages;
            }
        }
        stage.close();
    }
    finish(&r, end)
}

/// Everything a training session holds across stages.
struct Run {
    cfg: RunConfig,
    /// the config file, for error messages
    origin: String,
    run_dir: PathBuf,
    tokenizer: PathBuf,
    tok_sha: String,
    device: Device,
    dtype: DType,
    comm: Comm,
    mesh: Mesh,
    /// which rank owns which parameter slices (the optimizer shards)
    map: ShardMap,
    /// architecture of the initial model (stages change its RoPE)
    base_cfg: LlamaConfig,
    layout: ParamLayout,
    /// all parameters, fp32, gathered after every update: what a stage's model is built from
    weights: FlatBuf,
    optim: AdamW,
    state: TrainState,
    log: MetricsLog,
    /// TensorBoard events under RUN_DIR/tb/ (`log.tensorboard`)
    tb: Option<TbWriter>,
    /// stop after this many steps in total (`--steps`)
    limit: u64,
    total_steps: u64,
    sched: Schedule,
    t_start: Instant,
    bad_streak: u32,
    last_saved: Option<PathBuf>,
    /// set by SIGINT/SIGTERM: finish the step, checkpoint, exit 0
    stop: Arc<AtomicBool>,
    /// the run directory's advisory lock (released when the run ends or the process dies)
    _lock: crate::util::DirLock,
}

impl Run {
    /// Config, run directory, signals, device and communicator, initial weights, optimizer, resume.
    fn open(args: &TrainArgs) -> Result<Run> {
        let origin = args.config.display().to_string();
        let resolved = RunConfig::load(&args.config, &args.set)?;
        let cfg = resolved.cfg;
        let comm = Comm::from_config(&cfg.dist, &origin)?;
        let mesh = comm.mesh();
        let device = cfg.train.device.open(&format!("{origin}: train.device"))?;
        let dtype = cfg.train.dtype.dtype();
        let run_dir = args.run_dir();
        // one writer per run directory, held until the run ends (issue 16)
        let lock = crate::util::lock_dir(&run_dir, "harpe train")?;
        println!("# resolved config (sha256 {})\n{}", &resolved.hash[..12], resolved.toml);
        prepare_run_dir(&run_dir, &resolved.toml, &resolved.hash, args.force)?;
        let resume_from = resume_point(&run_dir.join("checkpoints"), args.resume)?;
        let stop = stop_flag()?;

        let (base_cfg, init) = initial_model(&cfg, &origin)?;
        let tokenizer = tokenizer_path(&cfg, &run_dir)?;
        let tok_sha = tokenizer_sha256(&tokenizer)?;
        let (layout, mut weights) = flatten_params(&init)?;
        drop(init);
        let map = ShardMap::new(&layout, mesh.world(), Split::Slices);
        let mut optim = AdamW::new(&layout, &weights, &map, mesh.rank(), AdamWHyper::from_config(&cfg.optim))?;
        let state = match &resume_from {
            Some(dir) => resume(dir, args.force, &resolved.hash, &comm, &map, &mut optim, &mut weights)?,
            None => TrainState::new(cfg.train.seed, &resolved.hash, base_cfg.rope.clone()),
        };
        Ok(Run {
            log: MetricsLog::open(&run_dir.join("metrics.jsonl"), state.step)?,
            tb: match cfg.log.tensorboard {
                true => Some(TbWriter::create(&run_dir.join("tb"), state.step)?),
                false => None,
            },
            limit: args.steps.unwrap_or(u64::MAX),
            total_steps: (0..cfg.stages.len()).map(|i| cfg.stage_steps(i).0).sum(),
            sched: cfg.schedule.schedule(),
            t_start: Instant::now(),
            bad_streak: 0,
            last_saved: resume_from,
            cfg,
            origin,
            run_dir,
            tokenizer,
            tok_sha,
            device,
            dtype,
            comm,
            mesh,
            map,
            base_cfg,
            layout,
            weights,
            optim,
            state,
            stop,
            _lock: lock,
        })
    }

    /// Stop the run after `max_bad_steps` consecutive non-finite steps, naming the last good checkpoint.
    fn check_bad_streak(&self) -> Result<()> {
        if self.bad_streak < self.cfg.train.max_bad_steps.max(1) {
            return Ok(());
        }
        let last = self
            .last_saved
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "none (no checkpoint was written yet)".into());
        bail!(
            "{} consecutive steps had a non-finite loss or gradient (last: step {}); training stopped. Last good checkpoint: {last}\nhint: lower the learning rate, keep optim.grad_clip on, or check the data; continue with --resume",
            self.bad_streak,
            self.state.step
        )
    }

    /// Print a line above the progress bar (or plainly without one).
    fn say(&self, stage: &Stage, line: String) {
        match &stage.pb {
            Some(pb) => pb.println(line),
            None => println!("{line}"),
        }
    }
}

/// One stage: its model (the run's weights with the stage's RoPE), data and step arithmetic.
struct Stage {
    si: usize,
    /// model config of this stage (its RoPE scheme), written into checkpoints
    mc: LlamaConfig,
    model: Llama,
    vars: Vec<Var>,
    tables: Vec<RopeTables>,
    loader: Loader,
    sources: Vec<String>,
    grads: GradAccum,
    steps: u64,
    tokens_per_step: u64,
    accum: usize,
    bsz: usize,
    seq_len: usize,
    lr_peak: f64,
    /// layers per activation-checkpointing segment
    seg: usize,
    targets_per_step: f64,
    flops_tok: f64,
    pb: Option<indicatif::ProgressBar>,
}

impl Stage {
    /// Build stage `si`'s model from the run's weights, open its data (restoring the cursor when the
    /// run resumes inside it), and apply the stage boundary (optimizer reset) when it starts fresh.
    fn open(r: &mut Run, si: usize) -> Result<Stage> {
        let cfg = &r.cfg;
        let seq_len = cfg.stages[si].seq_len;
        let (steps, tokens_per_step) = cfg.stage_steps(si);
        let mut mc = r.base_cfg.clone();
        if let Some(rope) = cfg.stage_rope(si) {
            mc.rope = rope;
        }
        mc.max_position_embeddings = mc.max_position_embeddings.max(seq_len);
        mc.validate(&format!("{}: stage {si}", r.origin))?;
        let (model, vars) = trainable_model(&mc, &r.layout, &r.weights, r.dtype, &r.device)?;
        let model = model.with_attention(AttentionImpl::for_device(&r.device)); // the attention seam
        let tables = rope_tables(&model, seq_len)?;
        let mut loader = open_loader(r, si)?;
        if si == r.state.stage && r.state.stage_step > 0 {
            let cursor = serde_json::from_value(r.state.data_cursor.clone())
                .map_err(|e| anyhow!("state.json: data_cursor: {e}\nhint: the checkpoint is damaged"))?;
            loader.restore(&cursor)?;
        } else {
            r.state.stage = si;
            r.state.stage_step = 0;
            if si > 0 && cfg.stage_resets_optimizer(si) {
                r.optim.reset_moments();
            }
        }
        r.state.rope = mc.rope.clone();
        let (accum, bsz) = (cfg.accumulation(si), cfg.train.micro_batch_size);
        Ok(Stage {
            si,
            sources: loader.manifest().source_names.clone(),
            grads: GradAccum::new(&r.layout, &r.weights.device())?,
            steps,
            tokens_per_step,
            accum,
            bsz,
            seq_len,
            lr_peak: cfg.stage_lr(si),
            seg: cfg.train.activation_checkpointing.segment_len(mc.num_hidden_layers),
            targets_per_step: (accum * bsz * (seq_len - 1)) as f64,
            flops_tok: metrics::flops_per_token(r.layout.total, mc.num_hidden_layers, mc.hidden_size, seq_len),
            pb: progress_bar(cfg.log.progress, si, steps, r.state.stage_step),
            mc,
            model,
            vars,
            tables,
            loader,
        })
    }

    /// Clear the progress bar.
    fn close(&mut self) {
        if let Some(pb) = self.pb.take() {
            pb.finish_and_clear();
        }
    }
}

/// The dataset loader of stage `si` for this rank's data-parallel slice, checked against the tokenizer.
fn open_loader(r: &Run, si: usize) -> Result<Loader> {
    let data_dir = stage_dataset(&r.cfg, si, &r.run_dir, &r.tokenizer)?;
    let lcfg = LoaderConfig {
        seq_len: r.cfg.stages[si].seq_len,
        shuffle: r.cfg.data.shuffle,
        seed: r.cfg.train.seed,
        rank: r.mesh.dp_rank,
        world_size: r.mesh.dp_size,
    };
    let loader =
        Loader::open(&data_dir, lcfg).with_context(|| format!("stage {si}: opening dataset {}", data_dir.display()))?;
    let sha = &loader.manifest().tokenizer_sha256;
    if *sha != r.tok_sha {
        bail!(
            "stage {si}: dataset {} was tokenized with another tokenizer (sha256 {}) than {} ({})\nhint: prepare the data with the model's tokenizer.json",
            data_dir.display(),
            &sha[..12.min(sha.len())],
            r.tokenizer.display(),
            &r.tok_sha[..12]
        );
    }
    Ok(loader)
}

/// What one optimizer step measured.
struct StepOut {
    loss: f64,
    grad_norm: f64,
    lr: f64,
    skipped: bool,
    per_source: BTreeMap<String, (f64, f64)>,
    seconds: f64,
    start_bytes: u64,
}

/// One optimizer step: `accum` micro-batches forward/backward, gradient all-reduce, norm, then either
/// a skip (non-finite loss or gradient) or clip + AdamW on this rank's shard + all-gather + write-back.
fn train_step(r: &mut Run, s: &mut Stage) -> Result<StepOut> {
    mem::reset_peak();
    let start_bytes = mem::rss_bytes();
    let t0 = Instant::now();
    s.grads.zero();
    let mut sums = [0f64; 2]; // nll sum, target count
    let mut per_source = BTreeMap::new();
    for _ in 0..s.accum {
        let seqs: Vec<Sequence> = (0..s.bsz).map(|_| s.loader.next_sequence()).collect::<Result<_>>()?;
        let toks: Vec<&[u32]> = seqs.iter().map(|q| q.tokens.as_slice()).collect();
        let (ids, targets) = batch_tensors(&toks, &r.device)?;
        let out = forward_backward(
            &s.model,
            &s.vars,
            &r.layout,
            &s.tables,
            &ids,
            &targets,
            s.seg,
            r.cfg.train.loss_chunk_tokens,
            1.0 / s.targets_per_step,
            &mut s.grads,
        )?;
        sums[0] += out.nll.iter().map(|&x| x as f64).sum::<f64>();
        sums[1] += (s.bsz * (s.seq_len - 1)) as f64;
        accumulate_per_source(&seqs, &out.nll, &s.sources, &mut per_source);
    }
    r.comm.all_reduce_mean(s.grads.buf_mut())?;
    r.comm.all_reduce_sum_f64(&mut sums)?;
    let loss = sums[0] / sums[1];
    let grad_norm = grads::global_norm(s.grads.buf());
    let lr = r.sched.lr_at(s.lr_peak, r.state.stage_step, s.steps);
    let skipped = !(loss.is_finite() && grad_norm.is_finite());
    if skipped {
        r.bad_streak += 1;
        r.state.skipped_steps += 1;
    } else {
        r.bad_streak = 0;
        grads::clip_by_global_norm(s.grads.buf_mut(), grad_norm, r.cfg.optim.grad_clip);
        r.optim.step(s.grads.buf(), lr)?;
        zero::gather_and_write_back(&r.comm, &r.map, &r.optim, &mut r.weights, &r.layout, &s.vars)?;
    }
    r.state.step += 1;
    r.state.stage_step += 1;
    r.state.tokens_seen += s.tokens_per_step;
    r.state.data_cursor = serde_json::to_value(s.loader.cursor())?;
    Ok(StepOut { loss, grad_norm, lr, skipped, per_source, seconds: t0.elapsed().as_secs_f64(), start_bytes })
}

/// Append the step's record to metrics.jsonl; print a line every `log.every` steps and on a skip.
fn log_step(r: &mut Run, s: &Stage, out: &StepOut) -> Result<()> {
    let tokens = s.tokens_per_step;
    let tflops = s.flops_tok * tokens as f64 / out.seconds / 1e12;
    let rec = StepRecord {
        step: r.state.step,
        stage: s.si,
        seq_len: s.seq_len,
        loss: out.loss,
        grad_norm: out.grad_norm,
        lr: out.lr,
        tokens,
        tokens_seen: r.state.tokens_seen,
        tokens_per_s: tokens as f64 / out.seconds,
        tflops,
        mfu: (r.cfg.log.peak_tflops > 0.0).then(|| tflops / r.cfg.log.peak_tflops),
        rss_bytes: mem::rss_bytes(),
        step_peak_bytes: mem::peak_bytes(),
        step_start_bytes: out.start_bytes,
        skipped: out.skipped,
        per_source: out.per_source.iter().map(|(k, (sum, n))| (k.clone(), sum / n.max(1.0))).collect(),
        elapsed_s: r.t_start.elapsed().as_secs_f64(),
    };
    r.log.write(&rec)?;
    if let Some(tb) = &mut r.tb {
        tb.scalars(rec.step, &tensorboard::step_scalars(&rec))?;
    }
    if r.state.step.is_multiple_of(r.cfg.log.every.max(1)) || out.skipped {
        r.say(s, metrics::step_line(&rec, r.total_steps));
    }
    if let Some(pb) = &s.pb {
        pb.set_position(r.state.stage_step);
    }
    Ok(())
}

/// Evaluate the training weights in place (`[eval]`) every `eval.every` steps, at a stage's end and at
/// `--steps`; log the line to metrics.jsonl (before the step's checkpoint, so a resume from that
/// checkpoint keeps it), print it, redraw eval.png.
fn maybe_evaluate(r: &mut Run, s: &Stage, ev: Option<&mut TrainEval>) -> Result<()> {
    let Some(ev) = ev else { return Ok(()) };
    let boundary = r.state.stage_step == s.steps || r.state.step >= r.limit;
    if !ev.due(r.state.step, boundary) {
        return Ok(());
    }
    let window = r.cfg.eval_ppl_window(s.si).ok_or_else(|| anyhow!("internal: [eval] without a table"))?;
    let rec = ev.evaluate(&s.model, r.state.step, s.si, window, r.state.step == r.total_steps)?;
    r.log.write_eval(&rec)?;
    if let Some(tb) = &mut r.tb {
        tb.scalars(rec.step, &tensorboard::eval_scalars(&rec))?;
    }
    r.say(s, eval_line(&rec));
    if r.cfg.log.plot {
        let recs = metrics::read_evals(&r.run_dir.join("metrics.jsonl"))?;
        metrics::plot_evals(&recs, &r.run_dir.join("eval.png"))?;
    }
    Ok(())
}

/// Save after a good step that ends the stage, hits `checkpoint.every`, reaches `--steps` or follows a
/// signal. A checkpoint at a stage's end already points at the next stage.
fn maybe_checkpoint(r: &mut Run, s: &Stage, out: &StepOut) -> Result<()> {
    let stage_end = r.state.stage_step == s.steps;
    let periodic = r.cfg.checkpoint.every > 0 && r.state.step.is_multiple_of(r.cfg.checkpoint.every);
    let stopping = r.stop.load(Ordering::SeqCst) || r.state.step >= r.limit;
    if !(periodic || stage_end || stopping) || out.skipped || r.bad_streak > 0 {
        return Ok(());
    }
    let mut snap = r.state.clone();
    if stage_end {
        snap.stage = s.si + 1;
        snap.stage_step = 0;
        snap.data_cursor = serde_json::Value::Null;
    }
    let write_model = |dir: &Path| -> Result<()> {
        let tensors: Vec<(String, Tensor)> =
            r.layout.params.iter().zip(&s.vars).map(|(p, v)| (p.name.clone(), v.as_tensor().clone())).collect();
        save_model_dir(dir, &s.mc, &tensors, r.cfg.checkpoint.max_shard_bytes)?;
        std::fs::copy(&r.tokenizer, dir.join("tokenizer.json"))
            .with_context(|| format!("copying {} into the checkpoint", r.tokenizer.display()))?;
        Ok(())
    };
    let root = r.run_dir.join("checkpoints");
    let p = checkpoint::save(&root, &snap, &r.optim, &r.comm, r.cfg.checkpoint.keep_last, &write_model)?;
    r.say(s, format!("saved {}", p.display()));
    r.last_saved = Some(p);
    Ok(())
}

/// How a session ended.
enum End {
    /// every stage done, or `--steps` reached
    Done,
    /// SIGINT/SIGTERM after a checkpoint
    Signal,
}

/// End of a session (the only one, on every path): the loss curve of the whole run, then a summary.
fn finish(r: &Run, end: End) -> Result<()> {
    if r.cfg.log.plot {
        let recs = metrics::read_records(&r.run_dir.join("metrics.jsonl"))?;
        metrics::plot_loss(&recs, &r.run_dir.join("loss.png"), "harpe train: loss")?;
    }
    match end {
        End::Signal => println!("stopped by signal after step {}; resume with --resume", r.state.step),
        End::Done => {
            let st = &r.state;
            println!(
                "done: {} steps, {} tokens, {} skipped; last checkpoint {}; {:.0} tokens/s this session",
                st.step,
                st.tokens_seen,
                st.skipped_steps,
                r.last_saved.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "none".into()),
                st.tokens_seen as f64 / r.t_start.elapsed().as_secs_f64().max(1e-9)
            );
        }
    }
    Ok(())
}

/// SIGINT/SIGTERM set the returned flag (the loop finishes the step, checkpoints, exits 0); a second
/// SIGINT kills at once.
fn stop_flag() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(sig, 1, Arc::clone(&stop))?;
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }
    Ok(stop)
}

/// Continue from checkpoint `dir`: its state (checked against the config hash unless `force`), this
/// rank's optimizer shard, and the weights gathered from every rank's shard.
fn resume(
    dir: &Path,
    force: bool,
    hash: &str,
    comm: &Comm,
    map: &ShardMap,
    optim: &mut AdamW,
    weights: &mut FlatBuf,
) -> Result<TrainState> {
    let state = checkpoint::load_state(dir)?;
    if state.config_hash != hash && !force {
        bail!(
            "{} was written by a different config\nhint: resume with the same config and --set values, or pass --force",
            dir.display()
        );
    }
    let mesh = comm.mesh();
    checkpoint::load_optim(dir, &mesh, optim)?;
    map.place(mesh.rank(), optim.master(), weights)?;
    comm.all_gather(weights, map)?;
    println!("resuming from {} (step {}, stage {})", dir.display(), state.step, state.stage);
    Ok(state)
}

/// The checkpoint to resume from (`--resume`), refusing to start over a run that already has one.
fn resume_point(ckpt_root: &Path, resume: bool) -> Result<Option<PathBuf>> {
    let latest = checkpoint::latest_complete(ckpt_root)?;
    if let (false, Some(p)) = (resume, &latest) {
        bail!(
            "{} already holds checkpoint {}\nhint: pass --resume to continue it, or choose another --out",
            ckpt_root.parent().unwrap_or(ckpt_root).display(),
            p.display()
        );
    }
    Ok(latest)
}

/// Add the nll of every predicted token to the source of that token (position p predicts p + 1).
fn accumulate_per_source(seqs: &[Sequence], nll: &[f32], names: &[String], acc: &mut BTreeMap<String, (f64, f64)>) {
    if names.len() < 2 {
        return;
    }
    for (i, s) in seqs.iter().enumerate() {
        let t = s.tokens.len();
        // position p predicts token p + 1; its source is that token's (Sequence::source_of, the one rule)
        for p in 0..t.saturating_sub(1) {
            if let Some(id) = s.source_of(p + 1) {
                let e = acc.entry(source_name(names, Some(id))).or_insert((0.0, 0.0));
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
