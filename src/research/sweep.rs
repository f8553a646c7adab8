//! `harpe sweep`: many training runs of one question — a base recipe, named arms (override sets or
//! their own recipe), grid axes over any `--set` key, and seeds — trained and evaluated one after
//! another or as N parallel processes, resumable, indexed in `sweep.json`.
//!
//! Reference: the reviewers' request for several multi-stage schedules and seeds; the layout
//! follows torchtitan's one-TOML-per-recipe plus a sweep file on top.
//! The non-obvious decisions:
//! - Every run is a separate `harpe train` process (the same binary, `current_exe` or `$HARPE_BIN`), driven
//!   only through train's public contract (`--config --out --set --resume`), so `--jobs N` is N processes,
//!   a crash takes down one run, and a run directory is exactly what `harpe train` would have written.
//!   Training is always started with `--resume`, which continues a killed run from its newest complete
//!   checkpoint and starts a fresh one from scratch.
//! - A run is finished when its newest checkpoint's `state.json` is past the last stage — not when the
//!   process exited 0 (a signalled `harpe train` also exits 0 after checkpointing).
//! - Every run is resolved (`RunConfig::load` with all its overrides) before anything starts, so an axis
//!   key that is not a config key, a bad value or a clashing name fails at once, naming it.
//! - Each run directory carries `sweep-run.json` (sweep name, arm, seed, overrides, config hash, the eval
//!   settings); a directory that belongs to another sweep or another config is refused, and
//!   `harpe report` reads arms and seeds from it.
//! - Children get SIGTERM when the sweep dies (Linux `PR_SET_PDEATHSIG`), and a SIGINT/SIGTERM to the
//!   sweep is forwarded once, so every child checkpoints and a rerun resumes.
//!
//! - `--executor slurm` hands the same runs to Slurm as array jobs (`slurm.rs`); a task evaluates its
//!   run with `--task RUN`, which updates this run's entry of `sweep.json` under a lock, re-read from
//!   disk, because the other tasks write theirs at the same time.
//!
//! Not here: the Slurm scripts and `--status` (`slurm.rs`), the statistics (`report.rs`).
use crate::config::RunConfig;
use crate::research::slurm::{self, SlurmSpec};
use crate::train::checkpoint::load_state;
use crate::train::RunDir;
use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `sweep-run.json` format tag.
pub const RUN_MARKER_FORMAT: &str = "harpe-sweep-run-v1";
/// `sweep.json` format tag.
pub const INDEX_FORMAT: &str = "harpe-sweep-v1";

/// Where the runs of a sweep train.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Executor {
    /// child processes on this machine (`--jobs` at a time)
    #[default]
    Local,
    /// one `sbatch --array` job per resource shape of the `[slurm]` table; returns after submitting
    Slurm,
}

/// Train and evaluate every run of a sweep file.
#[derive(clap::Args, Debug, Clone)]
pub struct SweepArgs {
    /// sweep file: `base` recipe, `seeds`, `[axes]`, `[[arm]]` tables, `[eval]`, `[slurm]` (see
    /// configs/sweeps/harpe-vs-multistage.toml)
    #[arg(long, value_name = "FILE", required_unless_present = "status")]
    pub config: Option<PathBuf>,
    /// sweep directory: sweep.json and one run directory per run [default: runs/<sweep name>]
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// runs trained and evaluated at the same time (separate processes; CPU threads are split between them)
    #[arg(long, default_value_t = 1)]
    pub jobs: usize,
    /// print the runs, their overrides and token budgets and the estimated cost, then stop
    #[arg(long)]
    pub dry_run: bool,
    /// only runs whose id contains one of these strings (comma-separated), e.g. --only seed0,harpe
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// model FLOPs utilization assumed by --dry-run's time estimate
    #[arg(long, default_value_t = 0.4)]
    pub mfu: f64,
    /// peak TFLOP/s per device for --dry-run's estimate [default: the recipe's log.peak_tflops, else 312]
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// local: child processes here; slurm: submit array jobs (with --dry-run: print their scripts)
    #[arg(long, value_enum, default_value_t = Executor::Local)]
    pub executor: Executor,
    /// print where each run of the sweep directory DIR stands (Slurm task, state, last step) and stop
    #[arg(long, value_name = "DIR", conflicts_with_all = ["config", "dry_run", "task"])]
    pub status: Option<PathBuf>,
    /// evaluate the trained run RUN and mark it in sweep.json (what a Slurm array task runs after training)
    #[arg(long, value_name = "RUN", hide = true, requires = "out")]
    pub task: Option<String>,
}

/// The sweep file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepSpec {
    /// name of the sweep (default: the file name without .toml); run directories record it
    #[serde(default)]
    pub name: Option<String>,
    /// base recipe of arms that do not name their own (relative to the sweep file)
    #[serde(default)]
    pub base: Option<PathBuf>,
    /// overrides applied to every run, before the arm's and the axes'
    #[serde(default)]
    pub set: Vec<String>,
    /// seeds; each run sets `seed_key` to one of them
    #[serde(default = "d_seeds")]
    pub seeds: Vec<u64>,
    /// the config key a seed sets
    #[serde(default = "d_seed_key")]
    pub seed_key: String,
    /// full grid: `"optim.lr" = [1e-5, 2e-5]` (keys in sorted order, every combination, for every arm)
    #[serde(default)]
    pub axes: BTreeMap<String, Vec<toml::Value>>,
    /// named arms, compared against each other (default: one arm `base`)
    #[serde(default, rename = "arm")]
    pub arms: Vec<ArmSpec>,
    /// evaluation of every finished run
    #[serde(default)]
    pub eval: EvalSpec,
    /// `#SBATCH` options of `--executor slurm` (an arm's `slurm = {...}` overrides keys for its runs)
    #[serde(default)]
    pub slurm: SlurmSpec,
}

fn d_seeds() -> Vec<u64> {
    vec![0]
}
fn d_seed_key() -> String {
    "train.seed".into()
}

/// `[[arm]]`: one named recipe variant.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArmSpec {
    pub name: String,
    /// its own recipe instead of the sweep's `base` (relative to the sweep file)
    #[serde(default)]
    pub config: Option<PathBuf>,
    /// overrides, as `--set` takes them
    #[serde(default)]
    pub set: Vec<String>,
    /// `#SBATCH` options of this arm's runs, over the sweep's `[slurm]`
    #[serde(default)]
    pub slurm: Option<SlurmSpec>,
}

/// `[eval]`: what runs after training (paths relative to the working directory, as in recipes).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalSpec {
    /// `[[eval.ppl]]`: sliding-window perplexity of held-out text (`harpe eval-ppl`)
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ppl: Vec<PplEval>,
    /// `[eval.loss]`: loss by position bucket on a prepared dataset (`harpe eval-loss`)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<LossEval>,
    /// `[eval.niah]`: passkey / RULER / needle grid at given lengths (`harpe eval-niah`)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub niah: Option<NiahEval>,
}

/// One `eval-ppl` evaluation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PplEval {
    /// metric name (`ppl:<name>`, `nll:<name>`)
    pub name: String,
    pub input: Vec<PathBuf>,
    pub window: usize,
    pub stride: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
}

/// The `eval-loss` evaluation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LossEval {
    pub data: PathBuf,
    pub buckets: Vec<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sequences: Option<usize>,
}

/// The `eval-niah` evaluation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NiahEval {
    /// `--tasks`, e.g. "passkey" or "passkey,noise"
    pub tasks: String,
    pub lengths: Vec<usize>,
    #[serde(default = "d_samples")]
    pub samples: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub essays: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passkey_depths: Option<usize>,
    /// measure lengths beyond max_position_embeddings (extrapolation)
    #[serde(default)]
    pub force: bool,
}

fn d_samples() -> usize {
    20
}

/// One planned run.
#[derive(Clone, Debug)]
pub struct RunPlan {
    /// directory name under the sweep directory: `<group>__seed<k>`
    pub id: String,
    /// arm name plus axis values; what `harpe report` compares
    pub group: String,
    pub seed: u64,
    pub config: PathBuf,
    pub set: Vec<String>,
    pub resolved: RunConfig,
    pub hash: String,
    /// its `#SBATCH` options (`[slurm]` with the arm's keys over it)
    pub slurm: SlurmSpec,
}

/// `sweep-run.json` in a run directory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunMarker {
    pub format: String,
    pub sweep: String,
    pub id: String,
    /// arm (and axis values) this run belongs to
    pub arm: String,
    pub seed: u64,
    pub config: PathBuf,
    pub set: Vec<String>,
    pub config_hash: String,
    pub eval: EvalSpec,
}

/// Where a run stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RunState {
    Pending,
    Training,
    /// stopped by a signal with a checkpoint; the next sweep resumes it
    Interrupted,
    Evaluating,
    Done,
    Failed,
}

/// One run in `sweep.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunEntry {
    pub id: String,
    pub arm: String,
    pub seed: u64,
    pub dir: PathBuf,
    pub state: RunState,
    pub attempts: u32,
    /// wall seconds of training and of evaluation in this sweep's processes (all attempts)
    pub train_s: f64,
    pub eval_s: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `sweep.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SweepIndex {
    pub format: String,
    pub name: String,
    pub spec: PathBuf,
    pub eval: EvalSpec,
    pub runs: Vec<RunEntry>,
}

/// Keep letters, digits and `._=+-` (other characters become `-`).
fn sanitize(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || "._=+-".contains(c) { c } else { '-' }).collect()
}

/// An axis value as a `--set` value and as a name part.
fn value_text(v: &toml::Value) -> (String, String) {
    let set = v.to_string();
    let name = match v {
        toml::Value::String(s) => s.clone(),
        _ => set.clone(),
    };
    (set, name)
}

/// Every combination of the axes (key order), as (name suffix, overrides).
fn grid(axes: &BTreeMap<String, Vec<toml::Value>>) -> Vec<(String, Vec<String>)> {
    let mut out = vec![(String::new(), vec![])];
    for (k, vals) in axes {
        let mut next = vec![];
        for (name, set) in &out {
            for v in vals {
                let (sv, nv) = value_text(v);
                let mut s = set.clone();
                s.push(format!("{k}={sv}"));
                next.push((format!("{name}__{k}={nv}"), s));
            }
        }
        out = next;
    }
    out
}

impl SweepSpec {
    /// Read and check a sweep file.
    pub fn load(path: &Path) -> Result<SweepSpec> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "cannot read sweep file {}\nhint: pass an existing TOML file, e.g. configs/sweeps/harpe-vs-multistage.toml",
                path.display()
            )
        })?;
        let spec: SweepSpec = toml::from_str(&text).map_err(|e| {
            anyhow!(
                "{}: {}\nhint: see configs/sweeps/harpe-vs-multistage.toml for every key",
                path.display(),
                e.to_string().trim_end()
            )
        })?;
        Ok(spec)
    }

    /// The sweep's name.
    pub fn name_for(&self, path: &Path) -> String {
        self.name.clone().unwrap_or_else(|| {
            path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "sweep".into())
        })
    }

    /// Resolve every run; errors name the sweep file and the offending key, arm or value.
    pub fn plan(&self, path: &Path) -> Result<Vec<RunPlan>> {
        let origin = path.display().to_string();
        let here = path.parent().unwrap_or(Path::new("."));
        self.check_lists(&origin)?;
        let arms = self.arms_or_base();
        check_arm_names(&origin, &arms)?;
        self.slurm.check(&origin, "[slurm]")?;
        for a in &arms {
            if let Some(sl) = &a.slurm {
                sl.check(&origin, &format!("arm `{}` slurm", a.name))?;
            }
        }
        let mut plans = vec![];
        for a in &arms {
            let config = self.arm_config(a, here, &origin)?;
            self.check_keys(a, &config, &origin)?;
            plans.extend(self.arm_runs(a, &config, &origin)?);
        }
        check_distinct_ids(&origin, &plans)?;
        Ok(plans)
    }

    /// Seeds present and distinct, every axis with at least one value.
    fn check_lists(&self, origin: &str) -> Result<()> {
        if self.seeds.is_empty() {
            bail!("{origin}: `seeds` is empty\nhint: e.g. seeds = [0, 1, 2]");
        }
        if let Some(d) = self.seeds.iter().enumerate().find(|(i, s)| self.seeds[..*i].contains(s)) {
            bail!("{origin}: seed {} is listed twice\nhint: seeds must be distinct", d.1);
        }
        for (k, v) in &self.axes {
            if v.is_empty() {
                bail!("{origin}: axis `{k}` has no values\nhint: give a list, e.g. \"{k}\" = [a, b]");
            }
        }
        Ok(())
    }

    /// The `[[arm]]` tables, or one arm `base` without overrides when there are none.
    fn arms_or_base(&self) -> Vec<ArmSpec> {
        if self.arms.is_empty() {
            vec![ArmSpec { name: "base".into(), config: None, set: vec![], slurm: None }]
        } else {
            self.arms.clone()
        }
    }

    /// The recipe an arm trains: its own `config`, else the sweep's `base`, relative to the sweep file.
    fn arm_config(&self, a: &ArmSpec, here: &Path, origin: &str) -> Result<PathBuf> {
        match a.config.as_ref().or(self.base.as_ref()) {
            Some(c) => Ok(here.join(c)),
            None => bail!(
                "{origin}: arm `{}` has no recipe\nhint: set `base = \"../run.toml\"` at the top, or `config = ...` in the arm",
                a.name
            ),
        }
    }

    /// Apply each arm, axis and seed key alone first, so an unknown key is reported as that key.
    fn check_keys(&self, a: &ArmSpec, config: &Path, origin: &str) -> Result<()> {
        for (what, key, spec) in a
            .set
            .iter()
            .map(|s| ("arm", s.split('=').next().unwrap_or(s).to_string(), s.clone()))
            .chain(self.axes.iter().map(|(k, v)| ("axis", k.clone(), format!("{k}={}", value_text(&v[0]).0))))
            .chain(std::iter::once(("seed_key", self.seed_key.clone(), format!("{}={}", self.seed_key, self.seeds[0]))))
        {
            let mut base_set = self.set.clone();
            if what != "arm" {
                base_set.extend(a.set.iter().cloned());
            }
            base_set.push(spec);
            RunConfig::load(config, &base_set).map_err(|e| {
                anyhow!(
                    "{origin}: {what} key `{key}` (arm `{}`) does not apply to {}: {e:#}\nhint: axis, arm and seed keys are `harpe train --set` keys of the recipe, e.g. optim.lr or stage.0.tokens",
                    a.name,
                    config.display()
                )
            })?;
        }
        Ok(())
    }

    /// One resolved run per grid point and seed of arm `a`.
    fn arm_runs(&self, a: &ArmSpec, config: &Path, origin: &str) -> Result<Vec<RunPlan>> {
        let mut plans = vec![];
        for (suffix, axis_set) in grid(&self.axes) {
            let group = format!("{}{suffix}", a.name);
            for &seed in &self.seeds {
                let mut set = self.set.clone();
                set.extend(a.set.iter().cloned());
                set.extend(axis_set.iter().cloned());
                set.push(format!("{}={seed}", self.seed_key));
                let r = RunConfig::load(config, &set).map_err(|e| {
                    anyhow!("{origin}: run `{group}` seed {seed} does not resolve: {e:#}\nhint: check the arm's and the axes' values")
                })?;
                let id = format!("{}__seed{seed}", sanitize(&group));
                plans.push(RunPlan {
                    id,
                    group: group.clone(),
                    seed,
                    config: config.to_path_buf(),
                    set,
                    resolved: r.cfg,
                    hash: r.hash,
                    slurm: self.slurm.merged(a.slurm.as_ref()),
                });
            }
        }
        Ok(plans)
    }
}

/// Arm names are non-empty and name distinct directories.
fn check_arm_names(origin: &str, arms: &[ArmSpec]) -> Result<()> {
    let mut names: BTreeMap<String, String> = BTreeMap::new();
    for a in arms {
        let key = sanitize(&a.name);
        if a.name.is_empty() {
            bail!("{origin}: an [[arm]] has an empty name\nhint: give every arm a short unique name");
        }
        if let Some(prev) = names.insert(key.clone(), a.name.clone()) {
            bail!(
                "{origin}: arms `{prev}` and `{}` clash (both name the directory `{key}`)\nhint: give every [[arm]] a distinct name",
                a.name
            );
        }
    }
    Ok(())
}

/// No two runs share a directory.
fn check_distinct_ids(origin: &str, plans: &[RunPlan]) -> Result<()> {
    let mut seen = BTreeSet::new();
    for p in plans {
        if !seen.insert(p.id.clone()) {
            bail!(
                "{origin}: two runs would share the directory `{}`\nhint: make arm names and axis values distinct",
                p.id
            );
        }
    }
    Ok(())
}

/// The `harpe` binary that runs the children: `$HARPE_BIN`, else this executable.
pub fn harpe_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("HARPE_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()
        .context("cannot locate the running executable\nhint: set HARPE_BIN to the harpe binary")?;
    let stem = exe.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    if stem != "harpe" {
        bail!("{} is not the harpe binary (sweeps start `harpe train` processes)\nhint: set HARPE_BIN to the harpe binary", exe.display());
    }
    Ok(exe)
}

/// Whether the run's newest checkpoint is past its last stage.
pub fn run_finished(dir: &Path, stages: usize) -> Result<bool> {
    match RunDir::new(dir).latest_checkpoint()? {
        Some(c) => Ok(load_state(&c)?.stage >= stages),
        None => Ok(false),
    }
}

/// Check a run directory before using it: it must be new, or belong to this sweep and config.
fn check_run_dir(dir: &Path, sweep: &str, plan: &RunPlan) -> Result<()> {
    let marker = RunDir::new(dir).sweep_marker();
    if marker.exists() {
        let m = read_marker(dir)?;
        if m.sweep != sweep {
            bail!(
                "{} belongs to sweep `{}`, not `{sweep}`\nhint: use another --out for this sweep, or remove that directory",
                dir.display(),
                m.sweep
            );
        }
        if m.config_hash != plan.hash {
            bail!(
                "{} was trained with a different config (hash {} != {}); the sweep file or the recipe changed\nhint: use another --out, or remove that run directory to retrain it",
                dir.display(),
                &m.config_hash[..12.min(m.config_hash.len())],
                &plan.hash[..12]
            );
        }
    } else if RunDir::new(dir).is_started() {
        bail!(
            "{} holds a run that is not part of sweep `{sweep}` (no sweep-run.json)\nhint: use another --out, or remove that directory",
            dir.display()
        );
    }
    Ok(())
}

/// Read `sweep-run.json` of a run directory.
pub fn read_marker(dir: &Path) -> Result<RunMarker> {
    let p = RunDir::new(dir).sweep_marker();
    let text = std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
    let m: RunMarker = serde_json::from_str(&text)
        .map_err(|e| anyhow!("{}: {e}\nhint: the file is damaged; remove the run directory to retrain", p.display()))?;
    if m.format != RUN_MARKER_FORMAT {
        bail!(
            "{}: format `{}` is not {RUN_MARKER_FORMAT}\nhint: written by another harpe version",
            p.display(),
            m.format
        );
    }
    Ok(m)
}

/// Shared state of a running sweep.
struct Ctx {
    bin: PathBuf,
    out: PathBuf,
    name: String,
    eval: EvalSpec,
    threads: Option<usize>,
    index: Mutex<SweepIndex>,
    stop: Arc<AtomicBool>,
    /// other processes (Slurm array tasks) write sweep.json too: merge this run's entry into the file
    shared: bool,
}

impl Ctx {
    fn update(&self, id: &str, f: impl FnOnce(&mut RunEntry)) -> Result<()> {
        let mut ix = self.index.lock().map_err(|_| anyhow!("internal: sweep index lock poisoned"))?;
        if let Some(e) = ix.runs.iter_mut().find(|e| e.id == id) {
            f(e);
        }
        if self.shared {
            let mine = ix.runs.iter().find(|e| e.id == id).cloned();
            return update_index(&self.out, &ix.clone(), |disk| {
                if let Some(e) = mine {
                    match disk.runs.iter_mut().find(|d| d.id == e.id) {
                        Some(d) => *d = e,
                        None => disk.runs.push(e),
                    }
                }
            });
        }
        let text = serde_json::to_string_pretty(&*ix)?;
        crate::util::write_atomic(&self.out.join("sweep.json"), text.as_bytes())
    }

    fn command(&self, args: &[String]) -> Command {
        let mut c = Command::new(&self.bin);
        c.args(args).stdin(Stdio::null());
        if let Some(n) = self.threads {
            if std::env::var_os("RAYON_NUM_THREADS").is_none() {
                c.env("RAYON_NUM_THREADS", n.to_string());
            }
        }
        // own process group: a terminal's Ctrl-C reaches the sweep only, which forwards one SIGTERM
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt;
            c.process_group(0);
            #[cfg(target_os = "linux")]
            // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
            unsafe {
                c.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                    Ok(())
                });
            }
        }
        c
    }

    /// Run a child to completion with stdout (or `capture`) and stderr going to `log`; forward a stop.
    fn run_child(&self, args: &[String], log: &Path, capture: bool) -> Result<(bool, String)> {
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("cannot open {}", log.display()))?;
        let mut cmd = self.command(args);
        cmd.stderr(logf.try_clone()?);
        if capture {
            cmd.stdout(Stdio::piped());
        } else {
            cmd.stdout(logf);
        }
        let mut child: Child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}\nhint: set HARPE_BIN to the harpe binary", self.bin.display()))?;
        let mut out = String::new();
        let reader = child.stdout.take().map(|mut s| {
            std::thread::spawn(move || {
                let mut buf = String::new();
                let _ = std::io::Read::read_to_string(&mut s, &mut buf);
                buf
            })
        });
        let mut forwarded = false;
        let status = loop {
            if let Some(st) = child.try_wait()? {
                break st;
            }
            if self.stop.load(Ordering::SeqCst) && !forwarded {
                forwarded = true;
                #[cfg(unix)]
                // SAFETY: kill(2) on our own child's pid; no memory is touched.
                unsafe {
                    libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if let Some(r) = reader {
            out = r.join().map_err(|_| anyhow!("internal: output reader panicked"))?;
        }
        Ok((status.success(), out))
    }
}

fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// Train (or resume) one run; Ok(false) when it stopped before the end (signal).
fn train_run(ctx: &Ctx, plan: &RunPlan, dir: &Path) -> Result<bool> {
    if run_finished(dir, plan.resolved.stages.len())? {
        return Ok(true);
    }
    let mut args = vec!["train".into(), "--config".into(), s(&plan.config), "--out".into(), s(dir), "--resume".into()];
    for o in &plan.set {
        args.push("--set".into());
        args.push(o.clone());
    }
    let log = RunDir::new(dir).train_log();
    let t0 = Instant::now();
    let (ok, _) = ctx.run_child(&args, &log, false)?;
    let dt = t0.elapsed().as_secs_f64();
    ctx.update(&plan.id, |e| e.train_s += dt)?;
    if !ok {
        bail!("harpe train failed:\n{}\nhint: see {} (rerun the sweep to retry)", tail(&log, 15), log.display());
    }
    run_finished(dir, plan.resolved.stages.len())
}

/// Run one evaluation command unless its output exists; Ok(false) when stopped.
fn eval_step(ctx: &Ctx, dir: &Path, out: &Path, args: Vec<String>, capture: bool) -> Result<bool> {
    if out.exists() {
        return Ok(true);
    }
    if ctx.stop.load(Ordering::SeqCst) {
        return Ok(false);
    }
    let log = RunDir::new(dir).eval_log();
    let (ok, stdout) = ctx.run_child(&args, &log, capture)?;
    if !ok {
        if ctx.stop.load(Ordering::SeqCst) {
            return Ok(false);
        }
        bail!("harpe {} failed:\n{}\nhint: see {}", args[0], tail(&log, 15), log.display());
    }
    if capture {
        let v: serde_json::Value = serde_json::from_str(stdout.trim())
            .map_err(|e| anyhow!("harpe {} printed no JSON ({e})\nhint: see {}", args[0], log.display()))?;
        crate::util::write_atomic(out, serde_json::to_string_pretty(&v)?.as_bytes())?;
    }
    Ok(true)
}

/// Evaluate a finished run as `[eval]` says; writes `eval/*.json` and `eval/summary.json`.
fn eval_run(ctx: &Ctx, dir: &Path) -> Result<bool> {
    let ckpt = RunDir::new(dir)
        .latest_checkpoint()?
        .ok_or_else(|| anyhow!("{}: no complete checkpoint to evaluate\nhint: rerun the sweep", dir.display()))?;
    let ev = RunDir::new(dir).eval_dir();
    std::fs::create_dir_all(&ev).with_context(|| format!("cannot create {}", ev.display()))?;
    let model = s(&ckpt);
    for p in &ctx.eval.ppl {
        let mut a = vec!["eval-ppl".into(), "--model".into(), model.clone(), "--json".into()];
        a.extend(["--window".into(), p.window.to_string(), "--stride".into(), p.stride.to_string()]);
        if let Some(m) = p.max_tokens {
            a.extend(["--max-tokens".into(), m.to_string()]);
        }
        a.push("--input".into());
        a.extend(p.input.iter().map(|i| s(i)));
        if !eval_step(ctx, dir, &ev.join(format!("ppl-{}.json", sanitize(&p.name))), a, true)? {
            return Ok(false);
        }
    }
    if let Some(l) = &ctx.eval.loss {
        let buckets: Vec<String> = l.buckets.iter().map(usize::to_string).collect();
        let mut a =
            vec!["eval-loss".into(), "--model".into(), model.clone(), "--json".into(), "--data".into(), s(&l.data)];
        a.extend(["--buckets".into(), buckets.join(",")]);
        if let Some(m) = l.max_sequences {
            a.extend(["--max-sequences".into(), m.to_string()]);
        }
        if !eval_step(ctx, dir, &RunDir::new(dir).eval_loss(), a, true)? {
            return Ok(false);
        }
    }
    if let Some(n) = &ctx.eval.niah {
        let out = RunDir::new(dir).eval_niah();
        let lengths: Vec<String> = n.lengths.iter().map(usize::to_string).collect();
        let mut a = vec![
            "eval-niah".into(),
            "--model".into(),
            model,
            "--out".into(),
            s(&out),
            "--tasks".into(),
            n.tasks.clone(),
        ];
        a.extend(["--lengths".into(), lengths.join(","), "--samples".into(), n.samples.to_string()]);
        if let Some(e) = &n.essays {
            a.extend(["--essays".into(), s(e)]);
        }
        if let Some(d) = n.passkey_depths {
            a.extend(["--passkey-depths".into(), d.to_string()]);
        }
        if n.force {
            a.push("--force".into());
        }
        if !eval_step(ctx, dir, &out.join("results.json"), a, false)? {
            return Ok(false);
        }
    }
    let summary = eval_summary(&ev, &ctx.eval)?;
    crate::util::write_atomic(&RunDir::new(dir).eval_summary(), serde_json::to_string_pretty(&summary)?.as_bytes())?;
    Ok(true)
}

/// Flatten a run's evaluation outputs into `metric -> value`: `ppl:<name>`, `nll:<name>`,
/// `loss:<bucket>`, `loss:total`, `<task>@<length>` (score 0-100).
pub fn eval_summary(ev: &Path, spec: &EvalSpec) -> Result<BTreeMap<String, f64>> {
    let read = |p: &Path| -> Result<serde_json::Value> {
        let t = std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?;
        serde_json::from_str(&t).map_err(|e| anyhow!("{}: {e}\nhint: remove it to re-evaluate", p.display()))
    };
    let num = |v: &serde_json::Value, k: &str, p: &Path| -> Result<f64> {
        v.get(k)
            .and_then(|x| x.as_f64())
            .ok_or_else(|| anyhow!("{}: no number `{k}`\nhint: remove it to re-evaluate", p.display()))
    };
    let mut m = BTreeMap::new();
    for p in &spec.ppl {
        let f = ev.join(format!("ppl-{}.json", sanitize(&p.name)));
        let v = read(&f)?;
        m.insert(format!("ppl:{}", p.name), num(&v, "ppl", &f)?);
        m.insert(format!("nll:{}", p.name), num(&v, "nll", &f)?);
    }
    if spec.loss.is_some() {
        let f = ev.join("loss.json");
        let v = read(&f)?;
        if let Some(b) = v.get("by_bucket").and_then(|b| b.as_object()) {
            for (k, cell) in b {
                m.insert(format!("loss:{k}"), num(cell, "loss", &f)?);
            }
        }
        if let Some(t) = v.get("total") {
            m.insert("loss:total".into(), num(t, "loss", &f)?);
        }
    }
    if spec.niah.is_some() {
        let f = ev.join("niah").join("results.json");
        let v = read(&f)?;
        for c in v.get("cells").and_then(|c| c.as_array()).into_iter().flatten() {
            let task = c.get("task").and_then(|t| t.as_str()).unwrap_or("?");
            let len = c.get("length").and_then(|t| t.as_u64()).unwrap_or(0);
            m.insert(format!("{task}@{len}"), num(c, "score", &f)?);
        }
    }
    Ok(m)
}

/// Create the run directory of `plan` under `out` with its `sweep-run.json`.
fn write_marker(out: &Path, sweep: &str, eval: &EvalSpec, plan: &RunPlan) -> Result<PathBuf> {
    let dir = out.join(&plan.id);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let marker = RunMarker {
        format: RUN_MARKER_FORMAT.into(),
        sweep: sweep.to_string(),
        id: plan.id.clone(),
        arm: plan.group.clone(),
        seed: plan.seed,
        config: plan.config.clone(),
        set: plan.set.clone(),
        config_hash: plan.hash.clone(),
        eval: eval.clone(),
    };
    crate::util::write_atomic(&RunDir::new(&dir).sweep_marker(), serde_json::to_string_pretty(&marker)?.as_bytes())?;
    Ok(dir)
}

/// Train and evaluate one run; returns its final state.
fn do_run(ctx: &Ctx, plan: &RunPlan) -> Result<RunState> {
    let dir = write_marker(&ctx.out, &ctx.name, &ctx.eval, plan)?;
    let resuming = RunDir::new(&dir).latest_checkpoint()?.is_some();
    ctx.update(&plan.id, |e| {
        e.state = RunState::Training;
        e.attempts += 1;
        e.error = None;
    })?;
    println!("[sweep] {} {}", if resuming { "resume" } else { "train " }, plan.id);
    if !train_run(ctx, plan, &dir)? {
        ctx.update(&plan.id, |e| e.state = RunState::Interrupted)?;
        return Ok(RunState::Interrupted);
    }
    ctx.update(&plan.id, |e| e.state = RunState::Evaluating)?;
    let t0 = Instant::now();
    let done = eval_run(ctx, &dir)?;
    let dt = t0.elapsed().as_secs_f64();
    let state = if done { RunState::Done } else { RunState::Interrupted };
    ctx.update(&plan.id, |e| {
        e.eval_s += dt;
        e.state = state;
    })?;
    println!("[sweep] {} {}", if done { "done  " } else { "stopped" }, plan.id);
    Ok(state)
}

/// Print the plan and its cost.
fn print_plan(plans: &[RunPlan], args: &SweepArgs) {
    println!("{:<48} {:>6} {:>14} {:>12}  stages (seq_len x tokens)", "run", "seed", "tokens", "est. GPU-h");
    let mut total_tokens = 0u64;
    let mut total_h = 0.0;
    let mut have_cost = true;
    for p in plans {
        let c = &p.resolved;
        let mut tokens = 0u64;
        let mut flops = 0.0;
        let arch = model_arch(c);
        let mut stages = vec![];
        for i in 0..c.stages.len() {
            let (steps, per) = c.stage_steps(i);
            tokens += steps * per;
            stages.push(format!("{}x{}", c.stages[i].seq_len, crate::util::human_count(steps * per)));
            if let Some(m) = &arch {
                flops += (steps * per) as f64
                    * crate::model::flops_per_token(
                        m.num_params(),
                        m.num_hidden_layers,
                        m.hidden_size,
                        c.stages[i].seq_len,
                    );
            }
        }
        let peak = args.peak_tflops.unwrap_or(if c.log.peak_tflops > 0.0 { c.log.peak_tflops } else { 312.0 });
        let hours = flops / (peak * 1e12 * args.mfu) / 3600.0;
        have_cost &= arch.is_some();
        total_tokens += tokens;
        total_h += hours;
        let h = if arch.is_some() { format!("{hours:.0}") } else { "?".into() };
        println!(
            "{:<48} {:>6} {:>14} {:>12}  {}",
            p.id,
            p.seed,
            crate::util::human_count(tokens),
            h,
            stages.join(" -> ")
        );
    }
    println!(
        "{} runs, {} tokens, {} GPU-hours at {:.0}% MFU (6N + 12LCT FLOPs per token, no recompute){}",
        plans.len(),
        crate::util::human_count(total_tokens),
        if have_cost { format!("{total_h:.0}") } else { "?".into() },
        args.mfu * 100.0,
        if have_cost { "" } else { "; ? = the model's config.json is not readable here" }
    );
}

fn model_arch(c: &RunConfig) -> Option<crate::model::config::LlamaConfig> {
    if let Some(p) = &c.model.path {
        return crate::model::config::LlamaConfig::from_file(&p.join("config.json")).ok();
    }
    let a = c.model.init.as_ref()?;
    let rope = crate::model::rope::RopeScheme::Default { theta: 10000.0 };
    let mut m = crate::model::config::LlamaConfig::tiny(a.vocab_size, rope);
    m.hidden_size = a.hidden_size;
    m.intermediate_size = a.intermediate_size;
    m.num_hidden_layers = a.num_hidden_layers;
    m.num_attention_heads = a.num_attention_heads;
    m.num_key_value_heads = a.num_key_value_heads.unwrap_or(a.num_attention_heads);
    m.head_dim = a.head_dim.unwrap_or(a.hidden_size / a.num_attention_heads);
    m.tie_word_embeddings = a.tie_word_embeddings;
    Some(m)
}

/// Change `sweep.json` of `out` as it is on disk (`fresh` when there is none) while holding its lock,
/// so processes that update different runs at the same time do not undo each other's changes.
fn update_index(out: &Path, fresh: &SweepIndex, f: impl FnOnce(&mut SweepIndex)) -> Result<()> {
    let lock_path = out.join(".sweep-index.lock");
    let file =
        std::fs::OpenOptions::new().create(true).write(true).truncate(false).open(&lock_path).with_context(|| {
            format!("cannot open {}\nhint: the sweep directory must be writable", lock_path.display())
        })?;
    file.lock().with_context(|| {
        format!("cannot lock {}\nhint: the file system of the sweep directory must support flock", lock_path.display())
    })?;
    let mut ix = load_index(out, &fresh.name)?.unwrap_or_else(|| fresh.clone());
    f(&mut ix);
    let r = crate::util::write_atomic(&out.join("sweep.json"), serde_json::to_string_pretty(&ix)?.as_bytes());
    let _ = file.unlock();
    r
}

/// Load `sweep.json` of `out` if it exists, checking it belongs to this sweep.
fn load_index(out: &Path, name: &str) -> Result<Option<SweepIndex>> {
    let p = out.join("sweep.json");
    if !p.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
    let ix: SweepIndex = serde_json::from_str(&text).map_err(|e| {
        anyhow!("{}: {e}\nhint: the file is damaged; remove it (run directories are kept and checked)", p.display())
    })?;
    if ix.name != name {
        bail!("{} belongs to sweep `{}`, not `{name}`\nhint: use another --out for this sweep", out.display(), ix.name);
    }
    Ok(Some(ix))
}

/// `harpe sweep`.
pub fn run(args: SweepArgs) -> Result<()> {
    if let Some(dir) = &args.status {
        return print_status(dir);
    }
    let config = args.config.clone().ok_or_else(|| {
        anyhow!("no --config\nhint: pass the sweep file, e.g. --config configs/sweeps/harpe-vs-multistage.toml")
    })?;
    let spec = SweepSpec::load(&config)?;
    let name = spec.name_for(&config);
    if let Some(id) = &args.task {
        return run_task(&args, &config, &spec, &name, id);
    }
    let plans = selected_plans(&spec, &config, &args)?;
    if args.executor == Executor::Slurm {
        return submit_slurm(&args, &config, &spec, &name, &plans);
    }
    if args.dry_run {
        print_plan(&plans, &args);
        return Ok(());
    }
    if args.jobs == 0 {
        bail!("--jobs 0: nothing would run\nhint: --jobs 1 runs one after another");
    }
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(sanitize(&name)));
    std::fs::create_dir_all(&out)
        .with_context(|| format!("cannot create {}\nhint: choose a writable --out", out.display()))?;
    let old = load_index(&out, &name)?;
    for p in &plans {
        check_run_dir(&out.join(&p.id), &name, p)?;
    }
    let mut old_runs: BTreeMap<String, RunEntry> =
        old.map(|ix| ix.runs.into_iter().map(|r| (r.id.clone(), r)).collect()).unwrap_or_default();
    let mut runs = vec![];
    let mut queue = VecDeque::new();
    for (i, p) in plans.iter().enumerate() {
        let mut e = old_runs.get(&p.id).cloned().unwrap_or_else(|| new_entry(p));
        let complete = e.state == RunState::Done && RunDir::new(out.join(&p.id)).eval_summary().exists();
        if !complete {
            if e.state == RunState::Done {
                e.state = RunState::Pending;
            }
            queue.push_back(i);
        }
        runs.push(e);
    }
    // runs outside --only stay in the index as they were
    for p in &plans {
        old_runs.remove(&p.id);
    }
    runs.extend(old_runs.into_values());
    let jobs = args.jobs.min(queue.len()).max(1);
    announce(&name, &spec, &plans, queue.len(), jobs, &out);
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let ctx = Ctx {
        bin: harpe_binary()?,
        out: out.clone(),
        name: name.clone(),
        eval: spec.eval.clone(),
        threads: (jobs > 1).then(|| (cores / jobs).max(1)),
        index: Mutex::new(SweepIndex {
            format: INDEX_FORMAT.into(),
            name: name.clone(),
            spec: config.clone(),
            eval: spec.eval.clone(),
            runs,
        }),
        stop: Arc::clone(&stop),
        shared: false,
    };
    ctx.update("", |_| {})?;
    let failures = run_queue(&ctx, &plans, queue, jobs)?;
    let ix = ctx.index.into_inner().map_err(|_| anyhow!("internal: lock poisoned"))?;
    outcome(&name, &out, &ix, stop.load(Ordering::SeqCst), &failures)
}

/// A run not yet started, as sweep.json lists it.
fn new_entry(p: &RunPlan) -> RunEntry {
    RunEntry {
        id: p.id.clone(),
        arm: p.group.clone(),
        seed: p.seed,
        dir: PathBuf::from(&p.id),
        state: RunState::Pending,
        attempts: 0,
        train_s: 0.0,
        eval_s: 0.0,
        error: None,
    }
}

/// The sweep's runs, narrowed to `--only` when given.
fn selected_plans(spec: &SweepSpec, config: &Path, args: &SweepArgs) -> Result<Vec<RunPlan>> {
    let mut plans = spec.plan(config)?;
    if !args.only.is_empty() {
        plans.retain(|p| args.only.iter().any(|o| p.id.contains(o.as_str())));
        if plans.is_empty() {
            bail!("--only {} matches no run\nhint: run with --dry-run to list the run ids", args.only.join(","));
        }
    }
    Ok(plans)
}

/// The sweep's one-line plan: runs, arms, seeds, how many are done and to go, and where.
fn announce(name: &str, spec: &SweepSpec, plans: &[RunPlan], to_go: usize, jobs: usize, out: &Path) {
    let skipped = plans.len() - to_go;
    println!(
        "sweep `{name}`: {} runs ({} arms x grid x {} seeds), {skipped} already done, {to_go} to go, {jobs} at a time -> {}",
        plans.len(),
        plans.iter().map(|p| p.group.as_str()).collect::<BTreeSet<_>>().len(),
        spec.seeds.len(),
        out.display()
    );
}

/// Run the queued plans on `jobs` worker threads until the queue is empty or a stop; the failed runs' ids and errors.
fn run_queue(ctx: &Ctx, plans: &[RunPlan], queue: VecDeque<usize>, jobs: usize) -> Result<Vec<(String, String)>> {
    let queue = Mutex::new(queue);
    let failures: Mutex<Vec<(String, String)>> = Mutex::new(vec![]);
    std::thread::scope(|sc| {
        for _ in 0..jobs {
            sc.spawn(|| loop {
                if ctx.stop.load(Ordering::SeqCst) {
                    break;
                }
                let next = queue.lock().ok().and_then(|mut q| q.pop_front());
                let Some(i) = next else { break };
                let plan = &plans[i];
                if let Err(e) = do_run(ctx, plan) {
                    let msg = format!("{e:#}");
                    eprintln!("[sweep] FAILED {}: {msg}", plan.id);
                    let _ = ctx.update(&plan.id, |r| {
                        r.state = RunState::Failed;
                        r.error = Some(msg.clone());
                    });
                    if let Ok(mut f) = failures.lock() {
                        f.push((plan.id.clone(), msg));
                    }
                }
            });
        }
    });
    failures.into_inner().map_err(|_| anyhow!("internal: lock poisoned"))
}

/// The sweep's end: stopped by a signal, some runs failed, or all done.
fn outcome(name: &str, out: &Path, ix: &SweepIndex, stopped: bool, failures: &[(String, String)]) -> Result<()> {
    let done = ix.runs.iter().filter(|r| r.state == RunState::Done).count();
    if stopped {
        bail!(
            "sweep stopped by a signal: {done}/{} runs done, the others checkpointed\nhint: rerun the same command to resume",
            ix.runs.len()
        );
    }
    if !failures.is_empty() {
        let list: Vec<String> =
            failures.iter().map(|(id, m)| format!("  {id}: {}", m.lines().next().unwrap_or(""))).collect();
        bail!(
            "{} of {} runs failed:\n{}\nhint: see each run's train.log / eval.log; rerun the same command to retry them",
            failures.len(),
            ix.runs.len(),
            list.join("\n")
        );
    }
    println!("sweep `{name}`: all {done} runs done; next: harpe report {}", out.display());
    Ok(())
}

/// `path` made absolute against the working directory (what a Slurm task, started elsewhere, needs).
fn absolute(path: &Path) -> Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("cannot make {} absolute", path.display()))
}

/// `--executor slurm`: submit the runs that are neither complete nor still queued, one array job per
/// resource shape (`--dry-run`: print the scripts instead).
fn submit_slurm(args: &SweepArgs, config: &Path, spec: &SweepSpec, name: &str, plans: &[RunPlan]) -> Result<()> {
    let all = spec.plan(config)?;
    let out = absolute(&args.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(sanitize(name))))?;
    let paths = slurm::ScriptPaths {
        harpe: absolute(&harpe_binary()?)?,
        cwd: absolute(Path::new("."))?,
        out: out.clone(),
        sweep_file: absolute(config)?,
    };
    let jobs = slurm::read_jobs(&out)?;
    let queue = if jobs.jobs.is_empty() {
        BTreeMap::new()
    } else {
        slurm::squeue_states().ok_or_else(|| {
            anyhow!("cannot ask squeue which of this sweep's tasks are still queued\nhint: run on a Slurm login node")
        })?
    };
    let tasks = slurm::latest_tasks(&jobs);
    let (mut done, mut queued, mut todo) = (vec![], vec![], vec![]);
    for p in plans {
        let i = all.iter().position(|q| q.id == p.id).ok_or_else(|| anyhow!("internal: run {} not planned", p.id))?;
        if RunDir::new(out.join(&p.id)).eval_summary().exists() {
            done.push(i);
        } else if tasks.get(&p.id).and_then(|t| queue.get(t)).is_some_and(|s| slurm::is_queued(s)) {
            queued.push(i);
        } else {
            todo.push(i);
        }
    }
    let task_runs: Vec<slurm::TaskRun> = all.iter().map(task_run).collect::<Result<_>>()?;
    let array = slurm::array_jobs(&sanitize(name), &task_runs, &todo);
    println!(
        "sweep `{name}`: {} runs, {} already done, {} still queued, {} to submit as {} array job(s) -> {}",
        plans.len(),
        done.len(),
        queued.len(),
        todo.len(),
        array.len(),
        out.display()
    );
    let n0 = jobs.jobs.len();
    let script_path = |k: usize, j: &slurm::ArrayJob| out.join("slurm").join(format!("{}-{}.sbatch", j.name, n0 + k));
    if args.dry_run {
        for (k, j) in array.iter().enumerate() {
            println!("# --- {}", script_path(k, j).display());
            print!("{}", slurm::array_script(name, j, &paths));
        }
        return Ok(());
    }
    std::fs::create_dir_all(out.join("slurm"))
        .with_context(|| format!("cannot create {}\nhint: choose a writable --out", out.display()))?;
    for p in plans {
        check_run_dir(&out.join(&p.id), name, p)?;
    }
    for &i in &todo {
        write_marker(&out, name, &spec.eval, &all[i])?;
    }
    let fresh = SweepIndex {
        format: INDEX_FORMAT.into(),
        name: name.to_string(),
        spec: paths.sweep_file.clone(),
        eval: spec.eval.clone(),
        runs: vec![],
    };
    update_index(&out, &fresh, |ix| {
        for &i in done.iter().chain(&todo) {
            let p = &all[i];
            if !ix.runs.iter().any(|e| e.id == p.id) {
                ix.runs.push(new_entry(p));
            }
            if let Some(e) = ix.runs.iter_mut().find(|e| e.id == p.id) {
                if done.contains(&i) {
                    e.state = RunState::Done;
                } else {
                    e.state = RunState::Pending;
                    e.attempts += 1;
                    e.error = None;
                }
            }
        }
    })?;
    for (k, j) in array.iter().enumerate() {
        let path = script_path(k, j);
        crate::util::write_atomic(&path, slurm::array_script(name, j, &paths).as_bytes())?;
        let id = slurm::sbatch(&path)?;
        let submitted =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        slurm::record_job(
            &out,
            slurm::JobRecord {
                job_id: id.clone(),
                script: path.strip_prefix(&out).unwrap_or(&path).to_path_buf(),
                submitted,
                tasks: j.runs.iter().map(|(i, r)| (*i, r.id.clone())).collect(),
            },
        )?;
        let idx: Vec<usize> = j.runs.iter().map(|r| r.0).collect();
        println!(
            "submitted job {id}: array {} ({} run(s), {})",
            slurm::index_list(&idx),
            j.runs.len(),
            j.shape.describe()
        );
    }
    println!(
        "next: harpe sweep --status {0} (rerun this command to resubmit runs that stopped); when all are done: harpe report {0}",
        out.display()
    );
    Ok(())
}

/// What an array task trains: the run's overrides, then its `[slurm]` table's `dist.*` ones, checked here so
/// a bad value stops the submission instead of every task.
fn task_run(p: &RunPlan) -> Result<slurm::TaskRun> {
    let mut set = p.set.clone();
    set.extend(p.slurm.set.iter().cloned());
    if !p.slurm.set.is_empty() {
        RunConfig::load(&p.config, &set).map_err(|e| {
            anyhow!(
                "[slurm] `set` {:?} does not apply to run {}: {e:#}\nhint: [slurm] set takes `harpe train --set` keys of [dist]",
                p.slurm.set,
                p.id
            )
        })?;
    }
    Ok(slurm::TaskRun { id: p.id.clone(), config: p.config.clone(), set, shape: p.slurm.clone() })
}

/// `--task RUN`: evaluate one trained run inside a Slurm array task and mark it in sweep.json.
fn run_task(args: &SweepArgs, config: &Path, spec: &SweepSpec, name: &str, id: &str) -> Result<()> {
    let plans = spec.plan(config)?;
    let plan = plans.iter().find(|p| p.id == id).ok_or_else(|| {
        anyhow!("--task {id}: {} has no such run\nhint: run ids are printed by --dry-run", config.display())
    })?;
    let out = args.out.clone().ok_or_else(|| anyhow!("--task needs --out\nhint: the sweep directory"))?;
    let dir = out.join(id);
    check_run_dir(&dir, name, plan)?;
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }
    let fresh = SweepIndex {
        format: INDEX_FORMAT.into(),
        name: name.to_string(),
        spec: config.to_path_buf(),
        eval: spec.eval.clone(),
        runs: vec![new_entry(plan)],
    };
    let index = load_index(&out, name)?.unwrap_or(fresh);
    let ctx = Ctx {
        bin: harpe_binary()?,
        out: out.clone(),
        name: name.to_string(),
        eval: spec.eval.clone(),
        threads: None,
        index: Mutex::new(index),
        stop,
        shared: true,
    };
    if !run_finished(&dir, plan.resolved.stages.len())? {
        ctx.update(id, |e| e.state = RunState::Interrupted)?;
        bail!(
            "{id}: training stopped before its last step (a signal or the time limit); its newest checkpoint is kept\nhint: rerun `harpe sweep --executor slurm` with the same arguments to resubmit it; it resumes"
        );
    }
    ctx.update(id, |e| {
        e.state = RunState::Evaluating;
        e.error = None;
    })?;
    let t0 = Instant::now();
    let result = eval_run(&ctx, &dir);
    let dt = t0.elapsed().as_secs_f64();
    let state = match &result {
        Ok(true) => RunState::Done,
        Ok(false) => RunState::Interrupted,
        Err(_) => RunState::Failed,
    };
    let error = result.as_ref().err().map(|e| format!("{e:#}"));
    ctx.update(id, |e| {
        e.eval_s += dt;
        e.state = state;
        e.error = error;
    })?;
    if !result? {
        bail!("{id}: stopped by a signal during evaluation\nhint: rerun `harpe sweep --executor slurm` to finish it");
    }
    println!("[sweep] done   {id}");
    Ok(())
}

/// `--status DIR`: each run's state, newest Slurm task and last logged step.
fn print_status(dir: &Path) -> Result<()> {
    let p = dir.join("sweep.json");
    let text = std::fs::read_to_string(&p)
        .with_context(|| format!("cannot read {}\nhint: pass the --out directory of a `harpe sweep`", p.display()))?;
    let ix: SweepIndex =
        serde_json::from_str(&text).map_err(|e| anyhow!("{}: {e}\nhint: the file is damaged", p.display()))?;
    let jobs = slurm::read_jobs(dir)?;
    let mut notes = vec![];
    let queue = if jobs.jobs.is_empty() {
        BTreeMap::new()
    } else {
        slurm::squeue_states().unwrap_or_else(|| {
            notes.push("squeue cannot be asked here: states come from the run directories only".to_string());
            BTreeMap::new()
        })
    };
    let tasks = slurm::latest_tasks(&jobs);
    let gone: BTreeSet<String> = tasks
        .values()
        .filter(|t| !queue.contains_key(*t))
        .filter_map(|t| t.split('_').next().map(str::to_string))
        .collect();
    let sacct = slurm::sacct_states(&gone.into_iter().collect::<Vec<_>>()).unwrap_or_else(|| {
        notes.push(
            "sacct has no accounting data here: a task that left the queue unfinished shows as failed".to_string(),
        );
        BTreeMap::new()
    });
    let runs: Vec<(String, PathBuf, String)> = ix
        .runs
        .iter()
        .map(|r| {
            let state = serde_json::to_value(r.state).ok().and_then(|v| v.as_str().map(str::to_string));
            (r.id.clone(), r.dir.clone(), state.unwrap_or_default())
        })
        .collect();
    let rows = slurm::status_rows(dir, &runs, &jobs, &queue, &sacct);
    print!("{}", slurm::render_status(&rows, &notes));
    Ok(())
}
