//! `harpe train` under a real Slurm (the one-node cluster of scripts/slurm-test-cluster.sh) with the Gloo
//! backend on the CPU: `srun` of 2 tasks on configs/tiny-cpu.toml trains to the one-rank run's losses and
//! weights; `sbatch` of scripts/slurm-harpe-128k.sh itself, with the CPU overrides on sbatch's command
//! line and in its environment, trains; `scancel --signal=TERM` ends that job with a complete checkpoint,
//! and `scontrol requeue` resumes it to the same bytes as the uninterrupted srun run; the script's kind of
//! warning (`--signal=TERM@N` before `--time`) stops a run before its time limit with a complete checkpoint.
//!
//! README lines these run (on CPU: 2 tasks instead of 8 GPUs, gloo instead of nccl, tiny-cpu instead of
//! the 128K recipe, fewer steps): "Single node, torchrun, Slurm" — the `srun --nodes=1 --ntasks-per-node=8
//! ... harpe train` line and the `sbatch --nodes=1 scripts/slurm-harpe-128k.sh` line.
use super::train_dist::{assert_same_losses, assert_same_tensors, losses, losses_or_empty, train};
use crate::common::slurm::{
    assert_readme_line, cluster, ended, root, run_ok, sbatch_shipped_script, slurm_cmd, wait_job,
};
use std::path::Path;
use std::time::{Duration, Instant};

/// tiny-cpu shortened to 24 + 16 steps (the second stage at 128 tokens with HARPE bases) for the
/// comparison with one rank: 2 ranks sum in another order, and that noise grows with the steps (at step
/// 128 of the full recipe it passes the 1e-6 the losses are held to).
pub(super) const SHORT: &str = "stage.0.steps=24 stage.1.steps=16";
/// 120 + 80 steps for the job that is stopped and requeued: long enough (~10 s under srun here) that a
/// TERM sent at step 3 lands mid-run; compared bit for bit with a 2-rank run, so no noise to allow.
const LONG: &str = "stage.0.steps=120 stage.1.steps=80";
const LAST: usize = 200;

pub(super) fn sets(steps: &str) -> Vec<String> {
    steps.split(' ').flat_map(|kv| ["--set".to_string(), kv.to_string()]).collect()
}

pub(super) fn final_model(run: &Path, step: usize) -> std::path::PathBuf {
    run.join(format!("checkpoints/step_{step:06}/model.safetensors"))
}

fn complete_checkpoints(run: &Path) -> Vec<u64> {
    let mut v: Vec<u64> = std::fs::read_dir(run.join("checkpoints"))
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.path().join("DONE").is_file())
                .filter_map(|e| e.file_name().to_string_lossy().strip_prefix("step_").and_then(|s| s.parse().ok()))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn slurm_srun_equals_one_rank_and_sbatch_of_the_shipped_script_stops_on_term_and_resumes_after_requeue() {
    let Some((conf, _one_at_a_time)) = cluster() else { return };
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let cfg = root().join("configs/tiny-cpu.toml");
    let harpe = env!("CARGO_BIN_EXE_harpe");
    let t0 = Instant::now();

    // one rank, no launcher
    let one = dir.join("one");
    let short = sets(SHORT);
    let short: Vec<&str> = short.iter().map(String::as_str).collect();
    train(&cfg, &one, &short);
    let t_one = t0.elapsed();

    // README's srun line, with 2 tasks, no GPUs, gloo, tiny-cpu and fewer steps
    assert_readme_line(
        "srun --nodes=1 --ntasks-per-node=8 --gpus-per-node=8 --gpu-bind=none harpe train --config configs/harpe-128k.toml --set dist.backend=nccl",
    );
    let srun_train = |out: &Path, steps: &str| {
        let mut srun = slurm_cmd(&conf, "srun", dir);
        srun.args(["--nodes=1", "--ntasks-per-node=2", "--gpu-bind=none", "--time=10", harpe, "train", "--config"])
            .arg(&cfg)
            .arg("--out")
            .arg(out)
            .args(["--set", "dist.backend=gloo", "--set", "dist.zero_stage=3"])
            .args(sets(steps))
            .env("HARPE_RUN_TOKEN", "srun-test-token");
        run_ok(&mut srun);
    };
    let two = dir.join("srun");
    let t = Instant::now();
    srun_train(&two, SHORT);
    assert_same_losses(&one, &two, "srun -n 2 (Gloo, ZeRO-3) vs one rank");
    assert_same_tensors(&final_model(&one, 40), &final_model(&two, 40), "srun -n 2 vs one rank", 1e-5);
    let t_srun = t.elapsed();
    // the uninterrupted 2-rank run the stopped and requeued job must end equal to
    let full = dir.join("srun-full");
    srun_train(&full, LONG);

    // README's sbatch line, with the CPU overrides on sbatch's command line and in the environment
    assert_readme_line("sbatch --nodes=1 scripts/slurm-harpe-128k.sh");
    let job_dir = dir.join("sbatch");
    let t = Instant::now();
    // the script's TERM@1080 is longer than this 10-minute limit, so Slurm would send it at once
    let opts = ["--nodes=1", "--time=10", "--signal=TERM@30"].map(String::from);
    let output = format!("--output={}/job-%j.out", dir.display());
    let mut sbatch = sbatch_shipped_script(
        slurm_cmd(&conf, "sbatch", dir),
        &[&opts[..], std::slice::from_ref(&output)].concat(),
        &cfg,
        &job_dir,
        LONG,
    );
    let job = run_ok(&mut sbatch).trim().split(';').next().unwrap().to_string();
    let log = dir.join(format!("job-{job}.out"));
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    // stop it once a few steps are logged: every rank stops after the same step and checkpoints
    let t_wait = Instant::now();
    while losses_or_empty(&job_dir).len() < 3 {
        assert!(t_wait.elapsed() < Duration::from_secs(300), "the job trained no steps:\n{}", read_log());
        assert!(!ended(&crate::common::slurm::job_state(&conf, &job)), "the job ended early:\n{}", read_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    run_ok(slurm_cmd(&conf, "scancel", dir).args(["--signal=TERM", &job]));
    let state = wait_job(&conf, &job, Duration::from_secs(120), ended);
    assert_eq!(state, "COMPLETED", "a TERM'd run checkpoints and exits 0:\n{}", read_log());
    let stopped_at = *losses(&job_dir).last().map(|(s, _)| s).unwrap();
    assert!(stopped_at < LAST as u64, "the signal stopped the run before its end (step {stopped_at}):\n{}", read_log());
    assert_eq!(complete_checkpoints(&job_dir).last(), Some(&stopped_at), "a complete checkpoint of the last step");
    let t_term = t.elapsed();

    // scontrol requeue: the same job runs the script again and resumes from that checkpoint
    let t = Instant::now();
    run_ok(slurm_cmd(&conf, "scontrol", dir).args(["requeue", &job]));
    // slurmctld holds a requeued job back for a while (its begin time moves ahead); start it now
    std::thread::sleep(Duration::from_secs(1));
    run_ok(slurm_cmd(&conf, "scontrol", dir).args(["update", &format!("jobid={job}"), "starttime=now"]));
    let state = wait_job(&conf, &job, Duration::from_secs(400), |s| s == "COMPLETED" || s.contains("FAIL"));
    assert_eq!(state, "COMPLETED", "{}", read_log());
    assert!(read_log().contains("resuming from"), "the requeued job resumed:\n{}", read_log());
    assert_eq!(losses(&job_dir).len(), LAST, "one record per step across the stop");
    assert!(
        std::fs::read(final_model(&job_dir, LAST)).unwrap() == std::fs::read(final_model(&full, LAST)).unwrap(),
        "the stopped and requeued job ends bit-identical to the uninterrupted srun run"
    );
    let t_requeue = t.elapsed();

    // the time limit's own warning: with --time=1 (minute) and --signal=TERM@45 Slurm sends the TERM 15-45 s
    // in (its timer ticks every 30 s); a run far longer than that stops at a step with a complete checkpoint
    // and the job ends before its limit, COMPLETED (not TIMEOUT)
    let t = Instant::now();
    let limited = dir.join("limited");
    let opts = ["--nodes=1".into(), "--time=1".into(), "--signal=TERM@45".into(), output];
    let set = "stage.0.steps=1000000 stage.1.steps=1";
    let mut sbatch = sbatch_shipped_script(slurm_cmd(&conf, "sbatch", dir), &opts, &cfg, &limited, set);
    let job = run_ok(&mut sbatch).trim().split(';').next().unwrap().to_string();
    let state = wait_job(&conf, &job, Duration::from_secs(150), ended);
    let log = std::fs::read_to_string(dir.join(format!("job-{job}.out"))).unwrap_or_default();
    assert_eq!(state, "COMPLETED", "the time limit's TERM stopped the run in time:\n{log}");
    let last = *losses(&limited).last().map(|(s, _)| s).unwrap();
    assert_eq!(complete_checkpoints(&limited).last(), Some(&last), "a complete checkpoint of step {last}");
    eprintln!(
        "timings: one rank {:.1} s, srun -n 2 {:.1} s, sbatch to TERM'd checkpoint (step {stopped_at}) {:.1} s, \
         requeue to the end {:.1} s, --signal before the time limit (step {last}) {:.1} s",
        t_one.as_secs_f64(),
        t_srun.as_secs_f64(),
        t_term.as_secs_f64(),
        t_requeue.as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
}
