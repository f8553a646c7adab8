//! What `--executor slurm` hands to Slurm and reads back, apart from when it does so (`slurm.rs`): the
//! `[slurm]` table (`#SBATCH` options, an arm's keys over the sweep's), the `sbatch --array` script of
//! each resource shape, the record of submitted jobs (`slurm-jobs.json`), and `sbatch` / `squeue` /
//! `sacct` themselves.
//!
//! The non-obvious decision: the script maps the array index to its run with a `case`, each run's
//! `harpe train` line written out with its own `--set` overrides and absolute paths, so the printed
//! script (`--dry-run`) is exactly what runs, wherever Slurm starts it.
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// `slurm-jobs.json` format tag.
pub const JOBS_FORMAT: &str = "harpe-slurm-jobs-v1";
/// The record of submitted jobs in a sweep directory.
pub const JOBS_FILE: &str = "slurm-jobs.json";

/// `[slurm]` of a sweep file, and `slurm = { ... }` of an `[[arm]]` over it: the `#SBATCH` options of
/// the array job its runs go to. Runs with equal options share one job.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlurmSpec {
    /// `--partition`
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<String>,
    /// `--account`
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    /// `--nodes` of one run [default 1]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<usize>,
    /// `--gpus-per-node` [default 0: none requested]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus_per_node: Option<usize>,
    /// `--ntasks-per-node`, harpe processes per node [default: gpus_per_node, at least 1]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ntasks_per_node: Option<usize>,
    /// `--cpus-per-task`
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus_per_task: Option<usize>,
    /// `--time` of one run, e.g. "72:00:00" or "2-00:00:00"
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<String>,
    /// `--signal=TERM@N`: seconds of warning before the time limit, so training checkpoints and the
    /// resubmitted task resumes (`harpe plan` prints the lead time a recipe needs)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal_lead_s: Option<u64>,
    /// further `#SBATCH` options, one per entry, e.g. ["--qos=long", "--constraint=a100"]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra: Vec<String>,
    /// `--set` overrides of `[dist]` keys for the tasks' `harpe train`, e.g. ["dist.backend=nccl"]: how a
    /// run is computed on the cluster, never what (other keys are refused, so a run trains to the same
    /// result under either executor and the run directory's config check still passes)
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub set: Vec<String>,
}

impl SlurmSpec {
    /// `over`'s keys replace this table's; its `extra` lines come after this table's.
    pub fn merged(&self, over: Option<&SlurmSpec>) -> SlurmSpec {
        let Some(o) = over else { return self.clone() };
        let mut extra = self.extra.clone();
        extra.extend(o.extra.iter().cloned());
        let mut set = self.set.clone();
        set.extend(o.set.iter().cloned());
        SlurmSpec {
            partition: o.partition.clone().or_else(|| self.partition.clone()),
            account: o.account.clone().or_else(|| self.account.clone()),
            nodes: o.nodes.or(self.nodes),
            gpus_per_node: o.gpus_per_node.or(self.gpus_per_node),
            ntasks_per_node: o.ntasks_per_node.or(self.ntasks_per_node),
            cpus_per_task: o.cpus_per_task.or(self.cpus_per_task),
            time: o.time.clone().or_else(|| self.time.clone()),
            signal_lead_s: o.signal_lead_s.or(self.signal_lead_s),
            extra,
            set,
        }
    }

    fn nodes_or_default(&self) -> usize {
        self.nodes.unwrap_or(1)
    }

    fn tasks_per_node(&self) -> usize {
        self.ntasks_per_node.unwrap_or(self.gpus_per_node.unwrap_or(0).max(1))
    }

    /// Values that would break the script or that Slurm would refuse late; `what` names the table.
    pub fn check(&self, origin: &str, what: &str) -> Result<()> {
        for (key, v) in
            [("nodes", self.nodes), ("ntasks_per_node", self.ntasks_per_node), ("cpus_per_task", self.cpus_per_task)]
        {
            if v == Some(0) {
                bail!("{origin}: {what} `{key}` = 0\nhint: at least 1 (or leave `{key}` out for the default)");
            }
        }
        for (key, v) in [("partition", &self.partition), ("account", &self.account), ("time", &self.time)] {
            if let Some(s) = v {
                if s.is_empty() || s.chars().any(|c| c.is_whitespace() || c == '\'' || c == '"') {
                    bail!(
                        "{origin}: {what} `{key}` = {s:?} is not one word\nhint: e.g. partition = \"gpu\", time = \"72:00:00\""
                    );
                }
            }
        }
        for o in &self.set {
            if !o.starts_with("dist.") || !o.contains('=') {
                bail!(
                    "{origin}: {what} `set` entry {o:?} is not a `dist.KEY=VALUE` override\nhint: [slurm] may only say how runs are computed (e.g. \"dist.backend=nccl\"); put other overrides in the sweep's or the arm's `set`"
                );
            }
        }
        for line in &self.extra {
            if !line.starts_with("--") || line.contains('\n') || line.contains('\r') {
                bail!(
                    "{origin}: {what} `extra` entry {line:?} is not one sbatch option\nhint: one `--option=value` per entry, e.g. extra = [\"--qos=long\"]"
                );
            }
        }
        Ok(())
    }

    /// The `#SBATCH` lines of this shape (without the array, name, output and directory lines).
    fn sbatch_lines(&self) -> Vec<String> {
        let mut l = vec![
            format!("--nodes={}", self.nodes_or_default()),
            format!("--ntasks-per-node={}", self.tasks_per_node()),
        ];
        if let Some(g) = self.gpus_per_node.filter(|&g| g > 0) {
            l.push(format!("--gpus-per-node={g}"));
        }
        if let Some(c) = self.cpus_per_task {
            l.push(format!("--cpus-per-task={c}"));
        }
        if let Some(t) = &self.time {
            l.push(format!("--time={t}"));
        }
        if let Some(p) = &self.partition {
            l.push(format!("--partition={p}"));
        }
        if let Some(a) = &self.account {
            l.push(format!("--account={a}"));
        }
        if let Some(s) = self.signal_lead_s {
            l.push(format!("--signal=TERM@{s}"));
        }
        l.extend(self.extra.iter().cloned());
        l
    }

    /// One line for messages: "1 node x 8 tasks, 8 GPUs/node, 72:00:00".
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{} node{} x {} task{}",
            self.nodes_or_default(),
            if self.nodes_or_default() == 1 { "" } else { "s" },
            self.tasks_per_node(),
            if self.tasks_per_node() == 1 { "" } else { "s" }
        );
        if let Some(g) = self.gpus_per_node.filter(|&g| g > 0) {
            let _ = write!(s, ", {g} GPUs/node");
        }
        if let Some(t) = &self.time {
            let _ = write!(s, ", {t}");
        }
        s
    }
}

/// Everything a generated script names, as absolute paths.
#[derive(Clone, Debug)]
pub struct ScriptPaths {
    /// the harpe binary the tasks run
    pub harpe: PathBuf,
    /// the working directory of every task (recipes' data, model and eval paths are relative to it)
    pub cwd: PathBuf,
    /// the sweep directory
    pub out: PathBuf,
    /// the sweep file
    pub sweep_file: PathBuf,
}

/// What a task's `harpe train` line needs of one run.
#[derive(Clone, Debug)]
pub struct TaskRun {
    /// the run directory's name under the sweep directory
    pub id: String,
    /// its recipe
    pub config: PathBuf,
    /// its `--set` overrides
    pub set: Vec<String>,
    /// its `#SBATCH` options
    pub shape: SlurmSpec,
}

/// One array job: its runs (array index = position in the sweep's run list) and their shared shape.
#[derive(Clone, Debug)]
pub struct ArrayJob<'a> {
    pub name: String,
    pub shape: SlurmSpec,
    pub runs: Vec<(usize, &'a TaskRun)>,
}

/// `s` as a POSIX shell word: single-quoted, `'` written as `'\''`.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "/._-=+:,@%".contains(c)) {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn abs(base: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

/// `1,3,4-6`: Slurm's array index list.
pub fn index_list(idx: &[usize]) -> String {
    let mut parts: Vec<String> = vec![];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && idx[j + 1] == idx[j] + 1 {
            j += 1;
        }
        match j - i {
            0 => parts.push(idx[i].to_string()),
            1 => parts.extend([idx[i].to_string(), idx[j].to_string()]),
            _ => parts.push(format!("{}-{}", idx[i], idx[j])),
        }
        i = j + 1;
    }
    parts.join(",")
}

/// The sbatch script of one array job.
pub fn array_script(sweep: &str, job: &ArrayJob, p: &ScriptPaths) -> String {
    let q = |x: &Path| shell_quote(&x.display().to_string());
    let mut s = String::new();
    let _ = writeln!(s, "#!/usr/bin/env bash");
    let _ = writeln!(
        s,
        "# harpe sweep `{sweep}`: {} run(s) as one array job, {} each; written by `harpe sweep --executor slurm`.",
        job.runs.len(),
        job.shape.describe()
    );
    let _ = writeln!(s, "# Each task trains its run (resuming from its newest checkpoint), then evaluates it.");
    let _ = writeln!(s, "#SBATCH --job-name={}", job.name);
    let idx: Vec<usize> = job.runs.iter().map(|r| r.0).collect();
    let _ = writeln!(s, "#SBATCH --array={}", index_list(&idx));
    for l in job.shape.sbatch_lines() {
        let _ = writeln!(s, "#SBATCH {l}");
    }
    let _ = writeln!(s, "#SBATCH --requeue");
    let _ = writeln!(s, "#SBATCH --open-mode=append");
    let _ = writeln!(s, "#SBATCH --output={}", p.out.join("slurm").join("%A_%a.out").display());
    let _ = writeln!(s, "#SBATCH --chdir={}", p.cwd.display());
    let _ = writeln!(s, "set -euo pipefail");
    let _ = writeln!(s, "cd {}", q(&p.cwd));
    let _ = writeln!(s, "HARPE={}", q(&p.harpe));
    let _ = writeln!(s, "OUT={}", q(&p.out));
    let _ = writeln!(s, "# one random rendezvous token per task, the same for every process srun starts");
    let _ = writeln!(s, "export HARPE_RUN_TOKEN=\"$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')\"");
    let _ = writeln!(s, "case \"${{SLURM_ARRAY_TASK_ID:?not a Slurm array task}}\" in");
    for (i, r) in &job.runs {
        let mut set = String::new();
        for o in &r.set {
            let _ = write!(set, " --set {}", shell_quote(o));
        }
        let _ = writeln!(
            s,
            "  {i}) RUN={}; CONFIG={}; SET=({}) ;;",
            shell_quote(&r.id),
            q(&abs(&p.cwd, &r.config)),
            set.trim_start()
        );
    }
    let _ = writeln!(s, "  *) echo \"no run has array index $SLURM_ARRAY_TASK_ID\" >&2; exit 1 ;;");
    let _ = writeln!(s, "esac");
    let _ = writeln!(
        s,
        "echo \"harpe sweep {sweep}: $RUN, job ${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}, restart ${{SLURM_RESTART_COUNT:-0}}\""
    );
    let _ = writeln!(
        s,
        "srun --kill-on-bad-exit=1 \"$HARPE\" train --config \"$CONFIG\" --out \"$OUT/$RUN\" --resume \"${{SET[@]}}\" >>\"$OUT/$RUN/train.log\" 2>&1"
    );
    let _ = writeln!(s, "\"$HARPE\" sweep --config {} --out \"$OUT\" --task \"$RUN\"", q(&p.sweep_file));
    s
}

/// Group the runs `todo` (indices into `runs`) into one array job per shape.
pub fn array_jobs<'a>(sweep: &str, runs: &'a [TaskRun], todo: &[usize]) -> Vec<ArrayJob<'a>> {
    let mut by_shape: BTreeMap<&SlurmSpec, Vec<(usize, &TaskRun)>> = BTreeMap::new();
    for &i in todo {
        by_shape.entry(&runs[i].shape).or_default().push((i, &runs[i]));
    }
    let many = by_shape.len() > 1;
    by_shape
        .into_iter()
        .enumerate()
        .map(|(k, (shape, runs))| ArrayJob {
            name: if many { format!("harpe-{sweep}-{k}") } else { format!("harpe-{sweep}") },
            shape: shape.clone(),
            runs,
        })
        .collect()
}

/// One submission in `slurm-jobs.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JobRecord {
    pub job_id: String,
    /// the script, relative to the sweep directory
    pub script: PathBuf,
    /// unix seconds
    pub submitted: u64,
    /// array index -> run id
    pub tasks: BTreeMap<usize, String>,
}

/// `slurm-jobs.json`: every submission of the sweep, oldest first.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JobsFile {
    pub format: String,
    pub jobs: Vec<JobRecord>,
}

/// Read the record of submitted jobs (empty when there is none).
pub fn read_jobs(out: &Path) -> Result<JobsFile> {
    let p = out.join(JOBS_FILE);
    if !p.exists() {
        return Ok(JobsFile { format: JOBS_FORMAT.into(), jobs: vec![] });
    }
    let f: JobsFile = crate::util::read_json(&p, "the file is damaged; --status cannot name job ids without it")?;
    if f.format != JOBS_FORMAT {
        bail!("{}: format `{}` is not {JOBS_FORMAT}\nhint: written by another harpe version", p.display(), f.format);
    }
    Ok(f)
}

/// The newest Slurm task id (`JOB_INDEX`) of each run.
pub fn latest_tasks(jobs: &JobsFile) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for j in &jobs.jobs {
        for (i, id) in &j.tasks {
            m.insert(id.clone(), format!("{}_{i}", j.job_id));
        }
    }
    m
}

/// `squeue`'s state of every array task it knows (`JOB_INDEX` -> "RUNNING", ...); None when squeue
/// cannot be asked.
pub fn squeue_states() -> Option<BTreeMap<String, String>> {
    let o = Command::new("squeue").args(["-h", "-r", "-t", "all", "-o", "%i|%T"]).output().ok()?;
    if !o.status.success() {
        return None;
    }
    Some(parse_pairs(&String::from_utf8_lossy(&o.stdout)))
}

/// `sacct`'s final state of the given jobs' tasks; None where accounting is off (`sacct` fails).
pub fn sacct_states(job_ids: &[String]) -> Option<BTreeMap<String, String>> {
    if job_ids.is_empty() {
        return Some(BTreeMap::new());
    }
    let o =
        Command::new("sacct").args(["-n", "-X", "-P", "-o", "JobID,State", "-j", &job_ids.join(",")]).output().ok()?;
    if !o.status.success() {
        return None;
    }
    Some(parse_pairs(&String::from_utf8_lossy(&o.stdout)))
}

fn parse_pairs(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('|'))
        .map(|(k, v)| (k.trim().to_string(), v.split_whitespace().next().unwrap_or("").to_string()))
        .collect()
}

/// Slurm states of a task that has not ended.
pub fn is_queued(state: &str) -> bool {
    matches!(
        state,
        "PENDING"
            | "REQUEUED"
            | "REQUEUE_HOLD"
            | "REQUEUE_FED"
            | "CONFIGURING"
            | "RUNNING"
            | "COMPLETING"
            | "SUSPENDED"
            | "RESIZING"
            | "SIGNALING"
            | "STAGE_OUT"
            | "STOPPED"
    )
}

/// Submit a script; the job id.
pub fn sbatch(script: &Path) -> Result<String> {
    let o = Command::new("sbatch").arg("--parsable").arg(script).output().with_context(|| {
        "cannot run sbatch\nhint: run on a Slurm login node (scripts/slurm-test-cluster.sh starts a one-node cluster for trying it)"
    })?;
    if !o.status.success() {
        bail!(
            "sbatch {} failed: {}\nhint: check the [slurm] table of the sweep file (partition, account, time)",
            script.display(),
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&o.stdout);
    let id = text.trim().split(';').next().unwrap_or("").to_string();
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_digit()) {
        bail!(
            "sbatch printed no job id ({:?})\nhint: this harpe expects `sbatch --parsable` to print JOBID",
            text.trim()
        );
    }
    Ok(id)
}

/// Append a submission to `slurm-jobs.json`.
pub fn record_job(out: &Path, rec: JobRecord) -> Result<()> {
    let mut f = read_jobs(out)?;
    f.jobs.push(rec);
    crate::util::write_atomic(&out.join(JOBS_FILE), serde_json::to_string_pretty(&f)?.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_lists_compress_runs_of_three_or_more() {
        assert_eq!(index_list(&[0, 1, 2, 3]), "0-3");
        assert_eq!(index_list(&[1, 3]), "1,3");
        assert_eq!(index_list(&[0, 1, 4, 5, 6, 9]), "0,1,4-6,9");
        assert_eq!(index_list(&[7]), "7");
    }

    #[test]
    fn shell_words_survive_quotes_and_spaces() {
        assert_eq!(shell_quote("train.seed=1"), "train.seed=1");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn an_arm_table_overrides_keys_and_appends_extra_lines() {
        let base = SlurmSpec {
            partition: Some("gpu".into()),
            nodes: Some(1),
            extra: vec!["--qos=a".into()],
            ..Default::default()
        };
        let arm = SlurmSpec { nodes: Some(2), extra: vec!["--exclusive".into()], ..Default::default() };
        let m = base.merged(Some(&arm));
        assert_eq!((m.partition.as_deref(), m.nodes), (Some("gpu"), Some(2)));
        assert_eq!(m.extra, ["--qos=a", "--exclusive"]);
        assert_eq!(base.merged(None), base);
        // 8 GPUs per node means 8 processes per node unless said otherwise
        let g = SlurmSpec { gpus_per_node: Some(8), ..Default::default() };
        assert!(g.sbatch_lines().contains(&"--ntasks-per-node=8".to_string()));
        assert!(SlurmSpec::default().sbatch_lines().contains(&"--ntasks-per-node=1".to_string()));
    }

    #[test]
    fn values_that_would_break_the_script_are_refused() {
        let bad = [
            SlurmSpec { extra: vec!["--qos=a\n#SBATCH --x".into()], ..Default::default() },
            SlurmSpec { partition: Some("a b".into()), ..Default::default() },
            SlurmSpec { cpus_per_task: Some(0), ..Default::default() },
        ];
        for b in bad {
            let e = b.check("s.toml", "[slurm]").unwrap_err().to_string();
            assert!(e.starts_with("s.toml: [slurm] `") && e.contains("hint:"), "{e}");
        }
    }

    #[test]
    fn the_script_maps_each_index_to_its_run_with_absolute_paths() {
        let runs = [
            TaskRun {
                id: "a__seed0".into(),
                config: "r.toml".into(),
                set: vec!["train.seed=0".into()],
                shape: SlurmSpec::default(),
            },
            TaskRun {
                id: "a__seed1".into(),
                config: "/x/r.toml".into(),
                set: vec!["x=\"y z\"".into()],
                shape: SlurmSpec::default(),
            },
        ];
        let jobs = array_jobs("s", &runs, &[1]);
        assert_eq!(jobs.len(), 1);
        let p = ScriptPaths {
            harpe: "/bin/harpe".into(),
            cwd: "/w".into(),
            out: "/w/out".into(),
            sweep_file: "/w/s.toml".into(),
        };
        let s = array_script("s", &jobs[0], &p);
        assert!(s.contains("#SBATCH --array=1\n"), "{s}");
        assert!(s.contains("  1) RUN=a__seed1; CONFIG=/x/r.toml; SET=(--set 'x=\"y z\"') ;;"), "{s}");
        assert!(!s.contains("a__seed0"), "only the runs submitted: {s}");
        let all = array_jobs("s", &runs, &[0, 1]);
        assert!(array_script("s", &all[0], &p).contains("  0) RUN=a__seed0; CONFIG=/w/r.toml;"));
    }
}
