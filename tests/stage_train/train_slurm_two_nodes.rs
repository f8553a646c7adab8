//! `harpe train` across two Slurm nodes (the two-namespace cluster of tests/common/slurm_two_nodes.rs) with
//! the Gloo backend on the CPU: README's 2-node `srun` line and `sbatch scripts/slurm-harpe-128k.sh` with the
//! script's own 2-node default, each with the CPU overrides (2 tasks a node instead of 8 GPUs, gloo, tiny-cpu,
//! fewer steps), train to the one-rank run's losses and weights. Rank 0's address is node01 as node02
//! resolves it, taken from `SLURM_JOB_NODELIST`; each node numbers its own 2 tasks by `SLURM_LOCALID`.
use super::slurm_two_nodes::TwoNodes;
use super::train_dist::{assert_same_losses, assert_same_tensors, train};
use super::train_slurm::{final_model, sets, SHORT};
use crate::common::slurm::{assert_readme_line, ended, root, run_ok, sbatch_shipped_script};
use std::time::{Duration, Instant};

#[test]
fn slurm_two_nodes_srun_and_sbatch_of_the_shipped_script_equal_one_rank() {
    let Some(c) = TwoNodes::up("slurm_two_nodes") else { return };
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let cfg = root().join("configs/tiny-cpu.toml");
    let harpe = env!("CARGO_BIN_EXE_harpe");
    let short = sets(SHORT);

    let t = Instant::now();
    let one = dir.join("one");
    train(&cfg, &one, &short.iter().map(String::as_str).collect::<Vec<_>>());
    let t_one = t.elapsed();

    // README's 2-node srun line: 2 tasks a node, no GPUs, gloo, tiny-cpu and fewer steps
    assert_readme_line(
        "srun --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --gpu-bind=none harpe train --config configs/harpe-128k.toml --set dist.backend=nccl",
    );
    let t = Instant::now();
    let two = dir.join("srun");
    let mut srun = c.cmd("srun", dir);
    srun.args([
        "--nodes=2",
        "--ntasks-per-node=2",
        "--gpus-per-node=0",
        "--gpu-bind=none",
        "--time=10",
        harpe,
        "train",
        "--config",
    ])
    .arg(&cfg)
    .arg("--out")
    .arg(&two)
    .args(["--set", "dist.backend=gloo", "--set", "dist.zero_stage=3"])
    .args(&short)
    .env("HARPE_RUN_TOKEN", "srun-two-nodes-token");
    run_ok(&mut srun);
    assert_same_losses(&one, &two, "srun --nodes=2 (Gloo, ZeRO-3) vs one rank");
    assert_same_tensors(&final_model(&one, 40), &final_model(&two, 40), "srun --nodes=2 vs one rank", 1e-5);
    let t_srun = t.elapsed();

    // README's 2-node sbatch line: the script's own --nodes=2, --time and --output; the CPU overrides on
    // sbatch's command line and in the environment
    assert_readme_line(
        "sbatch scripts/slurm-harpe-128k.sh    # its defaults: 2 nodes x 8 GPUs, ZeRO-3, dist-check first, resume on requeue",
    );
    let t = Instant::now();
    let job_dir = dir.join("sbatch");
    let mut sbatch = sbatch_shipped_script(c.cmd("sbatch", dir), &[], &cfg, &job_dir, SHORT);
    let job = run_ok(&mut sbatch).trim().split(';').next().unwrap().to_string();
    let log = dir.join(format!("slurm-harpe-128k-{job}.out"));
    let t_wait = Instant::now();
    let state = loop {
        let s = c.job_state(&job);
        if ended(&s) && !s.is_empty() {
            break s;
        }
        assert!(t_wait.elapsed() < Duration::from_secs(120), "job {job} is still `{s}`:\n{}", c.logs());
        std::thread::sleep(Duration::from_millis(250));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(state, "COMPLETED", "{text}\n{}", c.logs());
    assert!(text.contains("on node[01-02], 4 ranks"), "the job ran on both nodes:\n{text}");
    assert_same_losses(&one, &job_dir, "sbatch of the script on 2 nodes vs one rank");
    assert_same_tensors(&final_model(&one, 40), &final_model(&job_dir, 40), "sbatch on 2 nodes vs one rank", 1e-5);
    eprintln!(
        "timings: one rank {:.1} s, srun --nodes=2 {:.1} s, sbatch --nodes=2 (dist-check + train) {:.1} s",
        t_one.as_secs_f64(),
        t_srun.as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
}
