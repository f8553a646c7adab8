//! What a sweep writes down about its runs: `sweep.json` (every run's state, attempts and times, changed
//! under a lock because Slurm array tasks write it at the same time) and each run directory's
//! `sweep-run.json` (sweep, arm, seed, overrides, config hash), which `harpe report` reads and which
//! refuses a directory of another sweep or config. Apart from the executors, which both keep them.
use super::spec::{EvalSpec, RunPlan};
use crate::train::checkpoint::load_state;
use crate::train::RunDir;
use crate::util::read_json;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// `sweep-run.json` format tag.
pub const RUN_MARKER_FORMAT: &str = "harpe-sweep-run-v1";
/// `sweep.json` format tag.
pub const INDEX_FORMAT: &str = "harpe-sweep-v1";

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

/// A run not yet started, as sweep.json lists it.
pub(super) fn new_entry(p: &RunPlan) -> RunEntry {
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

/// Whether the run's newest checkpoint is past its last stage.
pub fn run_finished(dir: &Path, stages: usize) -> Result<bool> {
    match RunDir::new(dir).latest_checkpoint()? {
        Some(c) => Ok(load_state(&c)?.stage >= stages),
        None => Ok(false),
    }
}

/// Check a run directory before using it: it must be new, or belong to this sweep and config.
pub(super) fn check_run_dir(dir: &Path, sweep: &str, plan: &RunPlan) -> Result<()> {
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
    let m: RunMarker = read_json(&p, "the file is damaged; remove the run directory to retrain")?;
    if m.format != RUN_MARKER_FORMAT {
        bail!(
            "{}: format `{}` is not {RUN_MARKER_FORMAT}\nhint: written by another harpe version",
            p.display(),
            m.format
        );
    }
    Ok(m)
}

/// Create the run directory of `plan` under `out` with its `sweep-run.json`.
pub(super) fn write_marker(out: &Path, sweep: &str, eval: &EvalSpec, plan: &RunPlan) -> Result<PathBuf> {
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

/// Change `sweep.json` of `out` as it is on disk (`fresh` when there is none) while holding its lock,
/// so processes that update different runs at the same time do not undo each other's changes.
pub(super) fn update_index(out: &Path, fresh: &SweepIndex, f: impl FnOnce(&mut SweepIndex)) -> Result<()> {
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
pub(super) fn load_index(out: &Path, name: &str) -> Result<Option<SweepIndex>> {
    let p = out.join("sweep.json");
    if !p.exists() {
        return Ok(None);
    }
    let ix: SweepIndex = read_json(&p, "the file is damaged; remove it (run directories are kept and checked)")?;
    if ix.name != name {
        bail!("{} belongs to sweep `{}`, not `{name}`\nhint: use another --out for this sweep", out.display(), ix.name);
    }
    Ok(Some(ix))
}
