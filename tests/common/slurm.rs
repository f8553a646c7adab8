//! The one-node Slurm cluster of scripts/slurm-test-cluster.sh, for the tests that submit real jobs:
//! whether it is up (under CI a cluster that is down fails the test; elsewhere the test is skipped with
//! a message), `SLURM_CONF` for the commands, and waiting for a job to leave the queue.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The test cluster's slurm.conf and a guard that keeps the cluster to one test at a time
/// (`one_at_a_time`), or None when the cluster is down outside CI.
pub fn cluster() -> Option<(PathBuf, MutexGuard<'static, ()>)> {
    let o = Command::new(root().join("scripts/slurm-test-cluster.sh")).arg("status").output().unwrap();
    if !o.status.success() {
        let why = String::from_utf8_lossy(&o.stderr).trim().to_string();
        if std::env::var("HARPE_CI").is_ok_and(|v| v == "1") {
            panic!("the Slurm test cluster is not up ({why})\nhint: .ci/run starts it; by hand: scripts/slurm-test-cluster.sh up");
        }
        eprintln!("skipped: the Slurm test cluster is not up ({why}); scripts/slurm-test-cluster.sh up starts it");
        return None;
    }
    let env = Command::new(root().join("scripts/slurm-test-cluster.sh")).arg("env").output().unwrap();
    let line = String::from_utf8_lossy(&env.stdout);
    let conf = line.trim().strip_prefix("export SLURM_CONF=").expect("slurm-test-cluster.sh env").to_string();
    Some((PathBuf::from(conf), one_at_a_time()))
}

/// Held by each test that runs a Slurm cluster (this one or tests/common/slurm_two_nodes.rs), so only one
/// runs at a time: two at once would queue behind each other on 2 CPUs and blur their timings.
pub fn one_at_a_time() -> MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// `prog` with the cluster's `SLURM_CONF`, run in `dir`.
pub fn slurm_cmd(conf: &Path, prog: &str, dir: &Path) -> Command {
    let mut c = Command::new(prog);
    c.env("SLURM_CONF", conf).current_dir(dir);
    c
}

/// Run `cmd`; its stdout, or a panic with both streams.
pub fn run_ok(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout).to_string(), String::from_utf8_lossy(&o.stderr).to_string());
    assert!(o.status.success(), "{cmd:?} failed: {}\n{out}\n{err}", o.status);
    out
}

/// squeue's state of job `id` (or of its array tasks, space-separated), "" once it left the queue.
pub fn job_state(conf: &Path, id: &str) -> String {
    squeue_state(slurm_cmd(conf, "squeue", Path::new("/")), id)
}

/// `job_state` as asked through `squeue`, a command that runs squeue against the cluster.
pub fn squeue_state(mut squeue: Command, id: &str) -> String {
    let o = squeue.args(["-h", "-r", "-t", "all", "-o", "%T", "-j", id]).output().unwrap();
    String::from_utf8_lossy(&o.stdout).split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Wait until `done(state)` holds for job `id`'s squeue state, at most `limit`; the last state.
pub fn wait_job(conf: &Path, id: &str, limit: Duration, done: impl Fn(&str) -> bool) -> String {
    let t0 = Instant::now();
    loop {
        let s = job_state(conf, id);
        if done(&s) {
            return s;
        }
        assert!(t0.elapsed() < limit, "job {id} is still `{s}` after {limit:?}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Whether every task of a job has ended (left the queue or holds an end state; a job being signalled,
/// completing or requeued has not).
pub fn ended(state: &str) -> bool {
    state.split_whitespace().all(|s| {
        matches!(
            s,
            "COMPLETED"
                | "FAILED"
                | "CANCELLED"
                | "TIMEOUT"
                | "NODE_FAIL"
                | "PREEMPTED"
                | "OUT_OF_MEMORY"
                | "BOOT_FAIL"
                | "DEADLINE"
        )
    })
}

/// `sbatch` (a command made for the caller's cluster) of the shipped scripts/slurm-harpe-128k.sh as
/// the GPU-less test clusters run it: 2 Gloo tasks per node, no GPUs, one CPU each, then `opts` (before
/// the script); the config, run directory, binary and `--set` values through the script's environment,
/// and a 60 s collective timeout.
pub fn sbatch_shipped_script(mut sbatch: Command, opts: &[String], cfg: &Path, run_dir: &Path, set: &str) -> Command {
    sbatch
        .args(["--parsable", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"])
        .args(opts)
        .arg(root().join("scripts/slurm-harpe-128k.sh"))
        .env("BACKEND", "gloo")
        .env("CONFIG", cfg)
        .env("RUN_DIR", run_dir)
        .env("HARPE", env!("CARGO_BIN_EXE_harpe"))
        .env("TIMEOUT_S", "60")
        .env("HARPE_SET", set);
    sbatch
}

/// Fail unless README.md has `line` as one of its lines (a test that runs a README line says which,
/// and this keeps the two from drifting apart).
pub fn assert_readme_line(line: &str) {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    assert!(readme.lines().any(|l| l.trim_end() == line), "README.md no longer has the line this test runs:\n{line}");
}
