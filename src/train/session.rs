//! `Run`: everything a training session holds across stages, opened once per process and rank: the
//! config, the run directory (rank 0 locks and writes it), the device and communicator, the optimizer
//! over this rank's shard of the initial weights, and the state a checkpoint resumes.
//!
//! The non-obvious decision: the initial weights live only until the optimizer has its master shard of
//! them; a stage builds its model from the master shards (`Stage::open`), so no rank keeps a full fp32
//! copy of the weights beside the compute weights.
use super::args::TrainArgs;
use super::params::Sharding;
use super::RunDir;
use crate::comms::sequence::SpGroup;
use crate::comms::zero::{self, ShardMap, Split};
use crate::comms::{Comm, Mesh};
use crate::config::ZeroStage;
use crate::config::{DataSource, RunConfig};
use crate::data::{builtin_texts, prepare_from_texts, tokenizer_sha256, PrepareOptions};
use crate::flatbuf::{FlatBuf, Placement};
use crate::model::config::LlamaConfig;
use crate::model::layout::ParamLayout;
use crate::model::llama::param_shapes;
use crate::model::weights::{init_flat, load_flat};
use crate::optim::adamw::{AdamW, AdamWHyper};
use crate::optim::schedule::Schedule;
use crate::train::checkpoint::{self, TrainState};
use crate::train::metrics::MetricsLog;
use crate::train::tensorboard::TbWriter;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

/// Everything a training session holds across stages.
pub(super) struct Run {
    pub(super) cfg: RunConfig,
    /// the config file, for error messages
    pub(super) origin: String,
    pub(super) run_dir: RunDir,
    pub(super) tokenizer: PathBuf,
    pub(super) tok_sha: String,
    pub(super) device: Device,
    /// where the flat training state lives (`FlatBuf` placement)
    pub(super) placement: Placement,
    pub(super) dtype: DType,
    pub(super) comm: Comm,
    pub(super) mesh: Mesh,
    /// which rank owns which parameter slices (the optimizer shards)
    pub(super) map: ShardMap,
    /// architecture of the initial model (stages change its RoPE)
    pub(super) base_cfg: LlamaConfig,
    pub(super) layout: ParamLayout,
    pub(super) optim: AdamW,
    pub(super) state: TrainState,
    /// metrics.jsonl, written by rank 0 only
    pub(super) log: Option<MetricsLog>,
    /// TensorBoard events under RUN_DIR/tb/ (`log.tensorboard`), written by rank 0 only
    pub(super) tb: Option<TbWriter>,
    /// stop after this many steps in total (`--steps`)
    pub(super) limit: u64,
    pub(super) total_steps: u64,
    pub(super) sched: Schedule,
    pub(super) t_start: Instant,
    pub(super) bad_streak: u32,
    pub(super) last_saved: Option<PathBuf>,
    /// set by SIGINT/SIGTERM: finish the step, checkpoint, exit 0
    pub(super) stop: Arc<AtomicBool>,
    /// the run directory's advisory lock, held by rank 0 (released when the run ends or the process dies)
    pub(super) _lock: Option<crate::util::DirLock>,
    /// `dist.zero_stage` (every stage is the same computation at one rank)
    pub(super) zero: ZeroStage,
    /// gradient elements per reduce-scatter bucket (`dist.bucket_mb`)
    pub(super) bucket: usize,
    /// the sequence-parallel group this rank shares its sequences with (`dist.sp_degree` > 1)
    pub(super) sp: Option<SpGroup>,
    /// tokens trained before this session (a resume), for the session's tokens/s
    pub(super) tokens_at_start: u64,
    /// a resume's check of the checkpoint files training does not read, still running (`ShareCheck`)
    pub(super) share_check: Option<ShareCheck>,
}

impl Run {
    /// Whether this rank is the first of its process: every rank of a process group (NCCL, Gloo: one
    /// process each), rank 0 alone among rank threads. Process-wide measures (the RSS and device peaks) are
    /// reset by it once per step.
    pub(super) fn leads_process(&self) -> bool {
        !matches!(self.comm, Comm::Local(..)) || self.mesh.rank() == 0
    }

    /// Every rank's (allocated, reserved) device peak of the step in rank order, gathered by one small
    /// all-reduce; empty off CUDA (every rank decides alike: the device kind is the run's).
    pub(super) fn device_peaks(&self) -> Result<Vec<(u64, u64)>> {
        let (Some(a), Some(res)) =
            (crate::device::device_peak_bytes(&self.device)?, crate::device::device_reserved_peak_bytes(&self.device)?)
        else {
            return Ok(vec![]);
        };
        let world = self.mesh.world();
        let mut v = vec![0f64; 2 * world];
        (v[2 * self.mesh.rank()], v[2 * self.mesh.rank() + 1]) = (a as f64, res as f64);
        self.comm.all_reduce_sum_f64(&mut v)?;
        Ok(v.chunks(2).map(|p| (p[0] as u64, p[1] as u64)).collect())
    }
    /// Wait for a resume's `ShareCheck` and agree on it with every rank (one collective, every rank at
    /// the same point: after the session's first step, or at its end when it trains none). A damaged
    /// file stops the run on every rank before that step is logged or saved.
    pub(super) fn settle_share_check(&mut self) -> Result<()> {
        let Some(c) = self.share_check.take() else {
            return Ok(());
        };
        let mine = c.handle.join().unwrap_or_else(|_| bail!("internal: the checksum thread panicked"));
        let all = self.comm.all_ok(mine.is_ok())?;
        mine?;
        if !all {
            // The rank that found the damage returns its error, which ends the group naming that rank
            // and this collective with it: so the cause, not this rank's echo of it, is what is shown.
            self.comm.all_ok(true)?;
            bail!(
                "another rank found a damaged file in {} (its error names it)\nhint: {}",
                c.dir.display(),
                checkpoint::damage_hint(&c.dir)
            );
        }
        Ok(())
    }

    /// This rank's side of the ZeRO stage (`Sharding`): its weight gathers read from the ranks' master
    /// shards.
    pub(super) fn sharding(&self) -> Sharding<'_> {
        Sharding {
            zero: self.zero,
            src: zero::Shards { comm: &self.comm, map: &self.map, layout: &self.layout, master: self.optim.master() },
            rank: self.mesh.rank(),
            dtype: self.dtype,
            device: &self.device,
            placement: &self.placement,
            bucket: self.bucket,
        }
    }

    /// Config, run directory, signals, device and communicator, initial weights, optimizer, resume.
    /// Rank 0 alone locks and writes the run directory; the other ranks wait for it (a barrier).
    /// Kept whole (a little over 80 lines): it reads top to bottom as the run's opening, and its last
    /// half is the `Run` literal itself.
    pub(super) fn open(args: &TrainArgs, comm: Comm, sp: Option<SpGroup>) -> Result<Run> {
        let origin = args.config.display().to_string();
        let resolved = RunConfig::load(&args.config, &args.sets())?;
        if let Some(e) = &resolved.cfg.eval {
            crate::eval::tasks::check_section(e, &origin)?;
        }
        let cfg = resolved.cfg;
        let hash = results_hash(&resolved.toml)?;
        let mesh = comm.mesh();
        let lead = mesh.rank() == 0;
        let device = comm.open_device(&cfg.train.device, &format!("{origin}: train.device"))?;
        comm.warm_up(&device, sp.as_ref())?; // NCCL's buffers before the weights and the pool (comms/warm_up.rs)
        let dtype = cfg.train.dtype.dtype();
        let run_dir = args.run_dir();
        let tokenizer = tokenizer_of(&cfg, &run_dir);
        let lock = prepare_as_lead(&comm, args, (&resolved.toml, &resolved.hash), &hash, &tokenizer)?;
        let resume_from = match &args.resume_from {
            Some(dir) => Some(agreed_named_checkpoint(&comm, dir, &run_dir)?),
            None => agreed_resume_point(&comm, &run_dir, args.resume, &hash)?,
        };
        let stop = stop_flag()?;

        // the training state's home: the device (a CUDA run, or the CPU test knob), else host memory
        let placement = match args.device_resident_state {
            true => Placement::Device(device.clone()),
            false => Placement::of(&device),
        };
        let base_cfg = initial_config(&cfg, &origin)?;
        let layout = ParamLayout::new(&param_shapes(&base_cfg));
        // `[dist]`'s rules with this run's world and model (also for CUDA runs, which `plan_check` does
        // not plan)
        let dist = &cfg.dist;
        dist.validate(&origin, mesh.world(), Some(base_cfg.num_key_value_heads), &cfg.stage_batches())?;
        let tok_sha = tokenizer_sha256(&tokenizer)?;
        let zero = dist.zero_stage;
        // a replicated optimizer is a one-owner map: every rank owns everything
        let map = ShardMap::new(&layout, zero.optimizer_owners(mesh.world()), Split::Slices);
        let my_shard = if zero.shards_optimizer() { mesh.rank() } else { 0 };
        let hp = AdamWHyper::from_config(&cfg.optim);
        let (optim, state, share_check) = match &resume_from {
            // a resume builds the optimizer from the checkpoint alone: no initial weights drawn or read
            Some(dir) => resume(dir, (args.force, &hash), &comm, (&layout, &map, my_shard), (hp, &placement))?,
            None => {
                // the initial weights live only until the optimizer has its master (shard) of them; a
                // stage builds its model from the master shards (`Stage::open`)
                let weights = initial_weights(&cfg, &base_cfg, &placement)?;
                let optim = AdamW::new(&layout, &weights, &map, my_shard, hp)?;
                (optim, TrainState::new(cfg.train.seed, &hash, base_cfg.rope.clone()), None)
            }
        };
        let tokens_at_start = state.tokens_seen;
        Ok(Run {
            log: if lead { Some(MetricsLog::open(&run_dir.metrics(), state.step)?) } else { None },
            tb: match lead && cfg.log.tensorboard {
                true => Some(TbWriter::create(&run_dir.tensorboard(), state.step)?),
                false => None,
            },
            zero,
            bucket: dist.bucket_elems(4),
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
            placement,
            dtype,
            comm,
            mesh,
            map,
            base_cfg,
            layout,
            optim,
            state,
            stop,
            _lock: lock,
            sp,
            tokens_at_start,
            share_check,
        })
    }

    /// Stop the run after `max_bad_steps` consecutive non-finite steps, naming the last good checkpoint.
    pub(super) fn check_bad_streak(&self) -> Result<()> {
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
}

/// The run's model architecture: the model directory's `config.json`, or `[model.init]`'s shape.
pub(super) fn initial_config(cfg: &RunConfig, origin: &str) -> Result<LlamaConfig> {
    if let Some(dir) = &cfg.model.path {
        let mut mc = LlamaConfig::from_file(&dir.join("config.json"))?;
        mc.validate(&dir.join("config.json").display().to_string())?;
        return Ok(mc);
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
    Ok(mc)
}

/// The initial fp32 weights of architecture `mc` (HF order, `param_shapes` layout) with placement `p`:
/// a checkpoint streams from its memory map into the buffer one tensor at a time (`load_flat`: on a GPU
/// straight to the device, host memory far below the model size); a random init is drawn piece by piece
/// straight into it (`init_flat`: the same values for a seed on every device).
pub(super) fn initial_weights(cfg: &RunConfig, mc: &LlamaConfig, p: &Placement) -> Result<FlatBuf> {
    let (_, flat) = match &cfg.model.path {
        Some(dir) => load_flat(dir, mc, p)?,
        None => init_flat(mc, cfg.train.seed, p)?,
    };
    Ok(flat)
}

/// Make sure the run directory exists, is writable, and belongs to this config (unless `force`).
pub(super) fn prepare_run_dir(run_dir: &RunDir, toml: &str, hash: &str, force: bool) -> Result<()> {
    let dir = run_dir.root();
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create run directory {}\nhint: choose a writable --out", dir.display()))?;
    let probe = dir.join(".write-test");
    std::fs::write(&probe, b"ok")
        .with_context(|| format!("run directory {} is not writable\nhint: choose a writable --out", dir.display()))?;
    let _ = std::fs::remove_file(&probe);
    let cfg_path = run_dir.config();
    if cfg_path.exists() && !force {
        let old = std::fs::read_to_string(&cfg_path).with_context(|| format!("cannot read {}", cfg_path.display()))?;
        let old_hash = results_hash(&old)?;
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

/// The hash that guards a run directory and its resume: `RunConfig::hash(true)` of the config read back
/// from the resolved TOML, so without its `[dist]` table, whose keys (backend, world size, ZeRO stage,
/// buckets, timeout) change how the run is computed, never its results: a checkpoint continues on another
/// world size.
pub fn results_hash(toml_text: &str) -> Result<String> {
    let cfg: RunConfig = toml::from_str(toml_text).map_err(|e: toml::de::Error| {
        anyhow!("config.toml: {}\nhint: the run directory's config.toml is damaged", e.to_string().trim_end())
    })?;
    cfg.hash(true)
}

/// The dataset directory of stage `i`, preparing the built-in one on first use.
pub(super) fn stage_dataset(cfg: &RunConfig, i: usize, run_dir: &RunDir, tokenizer: &Path) -> Result<PathBuf> {
    let s = &cfg.stages[i];
    if let Some(d) = s.data.as_ref().or(cfg.data.path.as_ref()) {
        if cfg.data.source == DataSource::Prepared || s.data.is_some() {
            return Ok(d.clone());
        }
    }
    let dir = run_dir.builtin_data(s.seq_len);
    if !dir.join("manifest.json").exists() {
        let mut opts = PrepareOptions::new(s.seq_len);
        opts.seed = cfg.train.seed;
        prepare_from_texts(&builtin_texts(cfg.train.seed), tokenizer, &opts, &dir)
            .with_context(|| format!("preparing the built-in dataset in {}", dir.display()))?;
    }
    Ok(dir)
}

/// The run's tokenizer file (the one rule): `[model] tokenizer`, else the model directory's, else the
/// built-in byte tokenizer, which rank 0 writes into the run directory.
pub(super) fn tokenizer_of(cfg: &RunConfig, run_dir: &RunDir) -> PathBuf {
    match (&cfg.model.tokenizer, &cfg.model.path) {
        (Some(t), _) => t.clone(),
        (None, Some(d)) => d.join("tokenizer.json"),
        (None, None) => run_dir.tokenizer(),
    }
}

/// SIGINT/SIGTERM set the returned flag (the loop finishes the step, checkpoints, exits 0); a second
/// SIGINT kills at once.
pub(super) fn stop_flag() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(sig, 1, Arc::clone(&stop))?;
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }
    Ok(stop)
}

/// Continue from checkpoint `dir`: its state (checked against the config hash unless `force`) and this
/// rank's optimizer shard (`rank`'s range of `map` over `layout`), read from the checkpoint's shards
/// into a new optimizer with hyper-parameters `hp` placed at `p`; and the check of the files training
/// does not read, started (`ShareCheck`).
pub(super) fn resume(
    dir: &Path,
    (force, hash): (bool, &str),
    comm: &Comm,
    (layout, map, rank): (&ParamLayout, &ShardMap, usize),
    (hp, p): (AdamWHyper, &Placement),
) -> Result<(AdamW, TrainState, Option<ShareCheck>)> {
    let mesh = comm.mesh();
    let state = checkpoint::load_state(dir)?;
    if state.config_hash != hash && !force {
        bail!(
            "{} was written by a different config\nhint: resume with the same config and --set values, or pass --force",
            dir.display()
        );
    }
    let sums = checkpoint::load_checksums(dir)?;
    if sums.is_none() && mesh.rank() == 0 {
        println!(
            "note: {} has no {} (written by an older harpe): resuming without verifying its files",
            dir.display(),
            checkpoint::CHECKSUMS
        );
    }
    let check = sums.map(|sums| ShareCheck::start(dir, sums, mesh.rank(), mesh.world()));
    let (master, m, v, t) = checkpoint::read_optim_range(dir, &mesh, map.flat_range(rank))?;
    let optim = AdamW::from_state((layout, map, rank), hp, [master, m, v].map(FlatBuf::from_vec), t, p)?;
    if mesh.rank() == 0 {
        println!("resuming from {} (step {}, stage {})", dir.display(), state.step, state.stage);
    }
    Ok((optim, state, check))
}

/// The check of a resumed checkpoint's files that no rank reads (model files, config, tokenizer,
/// state: `checkpoint::verify_share`, this rank's share), on a thread of its own while the session's
/// first step trains. Training never reads them (a resume builds the model from the optimizer's
/// verified master weights), so nothing waits for them: reading them before the first step would add
/// their bytes to every resume (2 per 12 of the optimizer's in bf16; +42% to +54% measured on a cold disk,
/// benches/results/checkpoint-checksums.md), while a step at the sizes harpe is for outlasts the check.
/// `Run::settle_share_check` ends it before anything of the first step is logged or saved.
pub(super) struct ShareCheck {
    dir: PathBuf,
    handle: std::thread::JoinHandle<Result<()>>,
}

impl ShareCheck {
    fn start(dir: &Path, sums: crate::checksum::Checksums, rank: usize, world: usize) -> ShareCheck {
        let owned = dir.to_path_buf();
        let handle = std::thread::spawn(move || checkpoint::verify_share(&owned, &sums, rank, world));
        ShareCheck { dir: dir.to_path_buf(), handle }
    }
}

/// The checkpoint every rank resumes from, chosen by rank 0 alone and told to all: rank 0
/// takes the newest complete checkpoint (refusing to start over one without `--resume`) and sends its
/// step and the first 48 bits of its config hash; every rank checks that its own view of the run
/// directory has the same newest complete checkpoint and that its config hashes the same. A rank that
/// differs (a stale or non-shared file system, another config) stops every rank, and each names the
/// ranks and the path: resuming some ranks from a checkpoint and others from the initial weights would
/// run with matching collective sizes and be silently wrong.
fn agreed_resume_point(comm: &Comm, run_dir: &RunDir, resume: bool, hash: &str) -> Result<Option<PathBuf>> {
    let mesh = comm.mesh();
    let root = checkpoint_view(run_dir, mesh.rank());
    let mine = checkpoint::latest_complete(&root);
    let chosen = match (mesh.rank(), &mine) {
        (1.., _) => Ok(None),
        (0, Err(e)) => Err(anyhow!("{e:#}")),
        (0, Ok(Some(p))) if !resume => Err(anyhow!(
            "{} already holds checkpoint {}\nhint: pass --resume to continue it, or choose another --out",
            run_dir.root().display(),
            p.display()
        )),
        (0, Ok(p)) => Ok(p.clone()),
    };
    if !comm.all_ok(chosen.is_ok())? {
        chosen?;
        bail!("rank 0 could not choose the checkpoint to resume from in {}", root.display());
    }
    let chosen = chosen?;
    let step_of = |p: &Option<PathBuf>| -> Result<f64> {
        match p {
            None => Ok(-1.0),
            Some(p) => checkpoint::load_state(p).map(|s| s.step as f64),
        }
    };
    let hash48 = u64::from_str_radix(&hash[..12], 16).map_err(|e| anyhow!("internal: config hash {hash}: {e}"))? as f64;
    // [step, hash] from rank 0 (the others add zeros)
    let mut told = if mesh.rank() == 0 { [step_of(&chosen)?, hash48] } else { [0.0, 0.0] };
    comm.all_reduce_sum_f64(&mut told)?;
    let [step, hash0] = told;
    let path = (step >= 0.0).then(|| root.join(checkpoint::step_dir_name(step as u64)));
    let mine = mine.and_then(|m| step_of(&m));
    // what every rank sees, told to all so that each rank's error names every disagreeing rank and what
    // it sees: [code per rank] with code = 0 agrees, 1 unreadable, 2 another config, 3 no checkpoint,
    // 4 + its newest step
    let code = match &mine {
        Err(_) => 1.0,
        Ok(_) if hash0 != hash48 => 2.0,
        Ok(s) if *s == step => 0.0,
        Ok(s) if *s < 0.0 => 3.0,
        Ok(s) => 4.0 + s,
    };
    let mut seen = vec![0.0; mesh.world()];
    seen[mesh.rank()] = code;
    comm.all_reduce_sum_f64(&mut seen)?;
    let chosen = path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "none (a fresh start)".into());
    let lines: Vec<String> = (0..seen.len())
        .filter(|&r| seen[r] != 0.0)
        .map(|r| match seen[r] {
            1.0 => format!("rank {r} cannot read its checkpoints directory"),
            2.0 => format!("rank {r}: its config differs from rank 0's (another config hash)"),
            3.0 => format!("rank {r} sees none as the newest complete checkpoint, but rank 0 resumes from {chosen}"),
            c => format!(
                "rank {r} sees {} as the newest complete checkpoint, but rank 0 resumes from {chosen}",
                checkpoint::step_dir_name((c - 4.0) as u64)
            ),
        })
        .collect();
    if let Err(e) = &mine {
        bail!(
            "rank {} cannot read {}: {e:#}\nhint: every rank must see the run directory",
            mesh.rank(),
            root.display()
        );
    }
    if !lines.is_empty() {
        bail!(
            "{}; every rank stopped\nhint: {} must be one shared directory that every rank sees the same (a stale or node-local file system?), and every rank must run the same config and --set values",
            lines.join("; "),
            root.display()
        );
    }
    Ok(path)
}

/// `--resume-from DIR`: every rank checks that `dir` is a complete checkpoint (`DONE`) and reads the
/// same step in it; any rank that cannot stops every rank. Rank 0 first moves the run's newer complete
/// checkpoints aside (`step_N.abandoned`): they belong to the history this resume abandons (typically a
/// damaged one), and left in place they would be what a later `--resume` picks and what pruning by
/// `keep_last` keeps, deleting `dir`.
fn agreed_named_checkpoint(comm: &Comm, dir: &Path, run_dir: &RunDir) -> Result<PathBuf> {
    let mine = (|| -> Result<u64> {
        if !dir.join(checkpoint::DONE).is_file() {
            bail!(
                "--resume-from {}: not a complete checkpoint (no {} file)\nhint: pass a directory RUN/checkpoints/step_N that holds {}",
                dir.display(),
                checkpoint::DONE,
                checkpoint::DONE
            );
        }
        let step = checkpoint::load_state(dir)?.step;
        if comm.mesh().rank() == 0 {
            abandon_newer(&run_dir.checkpoints(), step)?;
        }
        Ok(step)
    })();
    if !comm.all_ok(mine.is_ok())? {
        mine?;
        bail!(
            "another rank cannot resume from {}\nhint: every rank must see the same checkpoint directory",
            dir.display()
        );
    }
    let step = mine? as f64;
    let mut told = [if comm.mesh().rank() == 0 { step } else { 0.0 }];
    comm.all_reduce_sum_f64(&mut told)?;
    if told[0] != step {
        bail!(
            "rank {} reads step {step} in {}, rank 0 step {}\nhint: every rank must see the same checkpoint directory",
            comm.mesh().rank(),
            dir.display(),
            told[0]
        );
    }
    Ok(dir.to_path_buf())
}

/// Rename every complete checkpoint under `root` newer than `step` to `step_N.abandoned` (which no
/// resume or pruning touches).
fn abandon_newer(root: &Path, step: u64) -> Result<()> {
    for (s, p) in checkpoint::list_complete(root)? {
        if s > step {
            let mut to = p.clone().into_os_string();
            to.push(".abandoned");
            std::fs::rename(&p, &to).with_context(|| {
                format!("cannot move aside {}\nhint: check that the run directory is writable", p.display())
            })?;
            println!("moved {} aside to {} (newer than the checkpoint resumed)", p.display(), to.to_string_lossy());
        }
    }
    Ok(())
}

/// The checkpoints directory rank `rank` looks at: the run directory's, except under the test hook
/// `testing::CHECKPOINT_VIEW`, which shows one rank another directory (a stale or node-local file
/// system, in one process of thread ranks).
fn checkpoint_view(run_dir: &RunDir, rank: usize) -> PathBuf {
    match &crate::testing::hooks().checkpoint_view {
        Some((r, dir)) if *r == rank => dir.clone(),
        _ => run_dir.checkpoints(),
    }
}

/// One writer per run directory, held until the run ends: rank 0 locks and prepares it (the
/// resolved config, the tokenizer of a byte-level run), then every rank learns whether it could.
fn prepare_as_lead(
    comm: &Comm,
    args: &TrainArgs,
    (toml, toml_sha): (&str, &str),
    hash: &str,
    tokenizer: &Path,
) -> Result<Option<crate::util::DirLock>> {
    let run_dir = args.run_dir();
    let mut lock = None;
    let mut first = Ok(());
    if comm.mesh().rank() == 0 {
        first = (|| -> Result<()> {
            lock = Some(run_dir.lock("harpe train")?);
            crate::util::remove_stale_temps(run_dir.root())?; // a killed run's half-written small files
            println!("# resolved config (sha256 {})\n{toml}", &toml_sha[..12]);
            prepare_run_dir(&run_dir, toml, hash, args.force)?;
            if tokenizer == run_dir.tokenizer() {
                let text = crate::model::testing::byte_tokenizer_json();
                crate::util::write_atomic(tokenizer, text.as_bytes())?;
            }
            Ok(())
        })();
    }
    if !comm.all_ok(first.is_ok())? {
        first?;
        bail!("rank 0 could not prepare the run directory {}", run_dir.root().display());
    }
    Ok(lock)
}
