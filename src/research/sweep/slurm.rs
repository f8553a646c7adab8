//! `harpe sweep --executor slurm`: a sweep's runs as the tasks of `sbatch --array` jobs, one job per
//! distinct resource shape, and `harpe sweep --status DIR`, where each run stands.
//!
//! Reference: Slurm's job arrays (`--array`, `SLURM_ARRAY_TASK_ID`), `--requeue`, `--signal`; the
//! local executor (`local.rs`) for what a run is and when it is finished.
//! The non-obvious decisions:
//! - The array index of a run is its position in the sweep's full run list, so `%a` in a log name and
//!   the index in `squeue` mean the same run in every submission, and a resubmission lists only the
//!   indices still to do (`--array=1,3`). The script maps the index to the run with a `case`, each run's
//!   `harpe train` line written out with its own `--set` overrides, so the printed script (`--dry-run`)
//!   is exactly what runs (`sbatch.rs` writes it).
//! - A task trains with `srun harpe train ... --resume` (one process per task of the allocation, the
//!   launcher environment harpe reads), then evaluates on one process with `harpe sweep --task RUN`,
//!   which marks the run in sweep.json under a lock (array tasks end at the same time) — so
//!   `harpe report` reads the result as it reads a local sweep. A task stopped by its time limit or a
//!   requeue resumes from its newest checkpoint; a second `harpe sweep --executor slurm` resubmits
//!   exactly the runs that are neither complete nor still queued.
//! - Which job ran which run is harpe's own record, `slurm-jobs.json` in the sweep directory, written at
//!   submission: a cluster without accounting (no slurmdbd, `sacct` disabled) still answers
//!   `--status` from that record, `squeue` and the run directories; `sacct` adds the final state of
//!   finished tasks where it works.
//! - Every path in the script is absolute (binary, recipes, sweep directory, working directory), since
//!   a task starts wherever Slurm starts it.
//!
//! Not here: the `[slurm]` table, the scripts and Slurm's commands (`sbatch.rs`), what a run is
//! (`spec.rs`) and its evaluation (`local.rs`), the statistics (`report.rs`).
use super::args::SweepArgs;
use super::index::{check_run_dir, load_index, new_entry, run_finished, update_index, write_marker};
use super::index::{RunState, SweepIndex, INDEX_FORMAT};
use super::local::{eval_run, harpe_binary, Ctx};
use super::sbatch::{self, JobsFile};
use super::spec::{sanitize, RunPlan, SweepSpec};
use crate::config::RunConfig;
use crate::train::RunDir;
use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// `path` made absolute against the working directory (what a Slurm task, started elsewhere, needs).
fn absolute(path: &Path) -> Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("cannot make {} absolute", path.display()))
}

/// `--executor slurm`: submit the runs that are neither complete nor still queued, one array job per
/// resource shape (`--dry-run`: print the scripts instead).
pub(super) fn submit(args: &SweepArgs, config: &Path, spec: &SweepSpec, name: &str, plans: &[RunPlan]) -> Result<()> {
    let all = spec.plan(config)?;
    let out = absolute(&args.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(sanitize(name))))?;
    let paths = sbatch::ScriptPaths {
        harpe: absolute(&harpe_binary()?)?,
        cwd: absolute(Path::new("."))?,
        out: out.clone(),
        sweep_file: absolute(config)?,
    };
    let jobs = sbatch::read_jobs(&out)?;
    let queue = if jobs.jobs.is_empty() {
        BTreeMap::new()
    } else {
        sbatch::squeue_states().ok_or_else(|| {
            anyhow!("cannot ask squeue which of this sweep's tasks are still queued\nhint: run on a Slurm login node")
        })?
    };
    let tasks = sbatch::latest_tasks(&jobs);
    let (mut done, mut queued, mut todo) = (vec![], vec![], vec![]);
    for p in plans {
        let i = all.iter().position(|q| q.id == p.id).ok_or_else(|| anyhow!("internal: run {} not planned", p.id))?;
        if RunDir::new(out.join(&p.id)).eval_summary().exists() {
            done.push(i);
        } else if tasks.get(&p.id).and_then(|t| queue.get(t)).is_some_and(|s| sbatch::is_queued(s)) {
            queued.push(i);
        } else {
            todo.push(i);
        }
    }
    let task_runs: Vec<sbatch::TaskRun> = all.iter().map(task_run).collect::<Result<_>>()?;
    let array = sbatch::array_jobs(&sanitize(name), &task_runs, &todo);
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
    let script_path = |k: usize, j: &sbatch::ArrayJob| out.join("slurm").join(format!("{}-{}.sbatch", j.name, n0 + k));
    if args.dry_run {
        for (k, j) in array.iter().enumerate() {
            println!("# --- {}", script_path(k, j).display());
            print!("{}", sbatch::array_script(name, j, &paths));
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
        crate::util::write_atomic(&path, sbatch::array_script(name, j, &paths).as_bytes())?;
        let id = sbatch::sbatch(&path)?;
        let submitted =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        sbatch::record_job(
            &out,
            sbatch::JobRecord {
                job_id: id.clone(),
                script: path.strip_prefix(&out).unwrap_or(&path).to_path_buf(),
                submitted,
                tasks: j.runs.iter().map(|(i, r)| (*i, r.id.clone())).collect(),
            },
        )?;
        let idx: Vec<usize> = j.runs.iter().map(|r| r.0).collect();
        println!(
            "submitted job {id}: array {} ({} run(s), {})",
            sbatch::index_list(&idx),
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
fn task_run(p: &RunPlan) -> Result<sbatch::TaskRun> {
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
    Ok(sbatch::TaskRun { id: p.id.clone(), config: p.config.clone(), set, shape: p.slurm.clone() })
}

/// `--task RUN`: evaluate one trained run inside a Slurm array task and mark it in sweep.json.
pub(super) fn run_task(args: &SweepArgs, config: &Path, spec: &SweepSpec, name: &str, id: &str) -> Result<()> {
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
pub(super) fn print_status(dir: &Path) -> Result<()> {
    let p = dir.join("sweep.json");
    let text = std::fs::read_to_string(&p)
        .with_context(|| format!("cannot read {}\nhint: pass the --out directory of a `harpe sweep`", p.display()))?;
    let ix: SweepIndex =
        serde_json::from_str(&text).map_err(|e| anyhow!("{}: {e}\nhint: the file is damaged", p.display()))?;
    let jobs = sbatch::read_jobs(dir)?;
    let mut notes = vec![];
    let queue = if jobs.jobs.is_empty() {
        BTreeMap::new()
    } else {
        sbatch::squeue_states().unwrap_or_else(|| {
            notes.push("squeue cannot be asked here: states come from the run directories only".to_string());
            BTreeMap::new()
        })
    };
    let tasks = sbatch::latest_tasks(&jobs);
    let gone: BTreeSet<String> = tasks
        .values()
        .filter(|t| !queue.contains_key(*t))
        .filter_map(|t| t.split('_').next().map(str::to_string))
        .collect();
    let sacct = sbatch::sacct_states(&gone.into_iter().collect::<Vec<_>>()).unwrap_or_else(|| {
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
    let rows = status_rows(dir, &runs, &jobs, &queue, &sacct);
    print!("{}", render_status(&rows, &notes));
    Ok(())
}

/// The last step `metrics.jsonl` of a run logged (0 when none).
pub fn last_step(run: &Path) -> u64 {
    let text = std::fs::read_to_string(RunDir::new(run).metrics()).unwrap_or_default();
    text.lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v.get("step").and_then(|s| s.as_u64()).filter(|_| v.get("loss").is_some()))
        .unwrap_or(0)
}

/// One row of `--status`.
#[derive(Clone, Debug, Serialize)]
pub struct RunStatus {
    pub id: String,
    /// pending, running, done, failed; for a run no Slurm task ran, sweep.json's state (a local sweep's)
    /// or unsubmitted
    pub state: String,
    /// `JOB_INDEX` of the newest submission
    pub slurm: Option<String>,
    /// Slurm's own state of that task, when squeue or sacct knows it
    pub slurm_state: Option<String>,
    pub last_step: u64,
}

/// Where each run stands: done from its run directory, pending/running from squeue, failed when its
/// newest task ended (or left the queue) without finishing it. `runs`: id, directory and sweep.json's
/// state (what a local executor wrote; "pending" there for a Slurm sweep's unsubmitted run).
pub fn status_rows(
    out: &Path,
    runs: &[(String, PathBuf, String)],
    jobs: &JobsFile,
    queue: &BTreeMap<String, String>,
    sacct: &BTreeMap<String, String>,
) -> Vec<RunStatus> {
    let tasks = sbatch::latest_tasks(jobs);
    runs.iter()
        .map(|(id, dir, local)| {
            let run = out.join(dir);
            let slurm = tasks.get(id).cloned();
            let slurm_state = slurm.as_ref().and_then(|t| queue.get(t).or_else(|| sacct.get(t)).cloned());
            let state = if RunDir::new(&run).eval_summary().exists() {
                "done"
            } else {
                match (&slurm, slurm_state.as_deref()) {
                    (None, _) if local != "pending" => local.as_str(),
                    (None, _) => "unsubmitted",
                    (Some(_), Some(s)) if s == "RUNNING" || s == "COMPLETING" => "running",
                    (Some(_), Some(s)) if sbatch::is_queued(s) => "pending",
                    _ => "failed",
                }
            };
            RunStatus { id: id.clone(), state: state.into(), slurm, slurm_state, last_step: last_step(&run) }
        })
        .collect()
}

/// `--status` as a table.
pub fn render_status(rows: &[RunStatus], notes: &[String]) -> String {
    let mut s =
        format!("{:<40} {:<12} {:<14} {:<12} {:>10}\n", "run", "state", "slurm task", "slurm state", "last step");
    for r in rows {
        let _ = writeln!(
            s,
            "{:<40} {:<12} {:<14} {:<12} {:>10}",
            r.id,
            r.state,
            r.slurm.as_deref().unwrap_or("-"),
            r.slurm_state.as_deref().unwrap_or("-"),
            r.last_step
        );
    }
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for r in rows {
        *count.entry(r.state.as_str()).or_default() += 1;
    }
    let summary: Vec<String> = count.iter().map(|(k, v)| format!("{v} {k}")).collect();
    let _ = writeln!(s, "{} runs: {}", rows.len(), summary.join(", "));
    for n in notes {
        let _ = writeln!(s, "note: {n}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::research::sweep::sbatch::{JobRecord, JOBS_FORMAT};

    #[test]
    fn status_reads_squeue_then_the_run_directories() {
        let d = tempfile::tempdir().unwrap();
        for id in ["a", "b", "c", "e"] {
            std::fs::create_dir_all(d.path().join(id)).unwrap();
        }
        std::fs::create_dir_all(d.path().join("e/eval")).unwrap();
        std::fs::write(RunDir::new(d.path().join("e")).eval_summary(), "{}").unwrap();
        std::fs::write(d.path().join("b/metrics.jsonl"), "{\"step\":1,\"loss\":2.0}\n{\"step\":2,\"loss\":1.5}\n")
            .unwrap();
        let tasks = ["a", "b", "c", "e"].iter().enumerate().map(|(i, r)| (i, r.to_string())).collect();
        let jobs = JobsFile {
            format: JOBS_FORMAT.into(),
            jobs: vec![JobRecord { job_id: "7".into(), script: "s".into(), submitted: 0, tasks }],
        };
        let queue: BTreeMap<String, String> = [("7_0", "PENDING"), ("7_1", "RUNNING"), ("7_2", "TIMEOUT")]
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        let mut runs: Vec<(String, PathBuf, String)> =
            ["a", "b", "c", "e", "f"].iter().map(|r| (r.to_string(), PathBuf::from(r), "pending".into())).collect();
        // a run of a local sweep: sweep.json's word
        runs.push(("g".into(), "g".into(), "training".into()));
        let rows = status_rows(d.path(), &runs, &jobs, &queue, &BTreeMap::new());
        let got: Vec<(&str, &str, u64)> = rows.iter().map(|r| (r.id.as_str(), r.state.as_str(), r.last_step)).collect();
        assert_eq!(
            got,
            [
                ("a", "pending", 0),
                ("b", "running", 2),
                ("c", "failed", 0),
                ("e", "done", 0),
                ("f", "unsubmitted", 0),
                ("g", "training", 0)
            ]
        );
        assert!(render_status(&rows, &[])
            .contains("6 runs: 1 done, 1 failed, 1 pending, 1 running, 1 training, 1 unsubmitted"));
    }
}
