//! `harpe train` as separate processes over Gloo (`--features gloo`): the process topology of a
//! multi-GPU NCCL run, on the CPU. 2 and 4 processes under `--nproc-per-node` (with `dist.world_size`
//! left to the launcher) and under the real torchrun train to the one-rank run's losses at every ZeRO
//! stage and with sequence parallelism; one process killed with SIGKILL mid-run stops the others naming
//! it; two processes started with different configs are refused before any work; a 4-process ZeRO-3
//! checkpoint resumes on 2 processes and on 1 `Local` rank.
//! The tolerance is the one train_dist.rs holds thread ranks to (a few times the measured noise floor
//! of f32 summation order): processes sum the same partial gradients, in Gloo's order.
use super::train_dist::{
    assert_equals_one_rank, assert_same_losses, assert_same_tensors, baseline, bf16_ranks_within_the_noise_floor, ckpt,
    harpe_text as harpe, losses_or_empty, model, rank_env, shards_and_done, train, train_ranks, write_cfg,
    write_endless_cfg,
};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `train` as `n` processes under harpe's own launcher, Gloo, ZeRO stage `z`, then `extra`.
fn train_procs(cfg: &Path, out: &Path, (n, z): (usize, u8), extra: &[&str]) {
    let (np, zs) = (n.to_string(), format!("dist.zero_stage={z}"));
    let mut a =
        vec!["--nproc-per-node", &np, "--set", "dist.backend=gloo", "--set", &zs, "--set", "dist.bucket_mb=0.01"];
    a.extend_from_slice(extra);
    train(cfg, out, &a);
}

#[test]
fn gloo_processes_at_every_zero_stage_equal_one_rank() {
    let d = tempfile::tempdir().unwrap();
    let (cfg, one, tol) = baseline(d.path());
    for (n, z) in [(2, 0), (2, 1), (2, 2), (2, 3), (4, 1), (4, 3)] {
        let out = d.path().join(format!("p{n}z{z}"));
        train_procs(&cfg, &out, (n, z), &[]);
        assert_equals_one_rank(&one, &out, n, &format!("{n} Gloo processes, ZeRO-{z}"), tol);
    }
    // the same-size thread run: processes and threads differ only in the order Gloo sums
    let local = d.path().join("w4z3-local");
    train_ranks(&cfg, &local, (4, 3), &[]);
    assert_same_losses(&local, &d.path().join("p4z3"), "4 Gloo processes vs 4 Local ranks, ZeRO-3");
    assert_same_tensors(&model(&local), &model(&d.path().join("p4z3")), "4 processes vs 4 Local ranks", tol);

    // sequence parallelism across processes: SP 2 x DP 2 x ZeRO-3 on 4 processes (Ulysses all-to-alls
    // on each group's own Gloo context)
    let out = d.path().join("p4sp2z3");
    train_procs(&cfg, &out, (4, 3), &["--set", "dist.sp_degree=2"]);
    assert_same_losses(&one, &out, "4 Gloo processes, SP 2, ZeRO-3");
    assert_same_tensors(&model(&one), &model(&out), "4 Gloo processes, SP 2, ZeRO-3", tol);

    // a 4-process ZeRO-3 checkpoint (after step 2) resumes on 2 processes and on 1 Local rank
    for (name, resume) in [
        ("on 2 processes", vec!["--nproc-per-node", "2", "--set", "dist.backend=gloo", "--set", "dist.zero_stage=1"]),
        ("on 1 rank", vec![]),
    ] {
        let run = d.path().join(format!("resume-{}", name.replace(' ', "-")));
        train_procs(&cfg, &run, (4, 3), &["--steps", "2"]);
        assert!(ckpt(&run, 2).join("DONE").is_file(), "{name}: the 4-process checkpoint is complete");
        let mut a = resume.clone();
        a.push("--resume");
        train(&cfg, &run, &a);
        assert_same_losses(&one, &run, &format!("4-process ZeRO-3 checkpoint resumed {name}"));
        assert_same_tensors(&model(&one), &model(&run), &format!("resumed {name}"), tol);
    }
}

/// Start `world` ranks of `harpe train` by hand (as a launcher would), rank r with `per_rank(r)` extra
/// arguments; stdout and stderr to files under `logs`.
fn start_ranks(
    world: usize,
    logs: &Path,
    args: &[&str],
    per_rank: impl Fn(usize) -> Vec<String>,
) -> Vec<std::process::Child> {
    std::fs::create_dir_all(logs).unwrap();
    let port = harpe::launch::env::free_port("127.0.0.1").unwrap();
    (0..world)
        .map(|r| {
            let log = std::fs::File::create(logs.join(format!("rank{r}.log"))).unwrap();
            Command::new(env!("CARGO_BIN_EXE_harpe"))
                .args(args)
                .args(per_rank(r))
                .envs(rank_env(r, world, port))
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .stdin(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect()
}

fn log_of(logs: &Path, r: usize) -> String {
    std::fs::read_to_string(logs.join(format!("rank{r}.log"))).unwrap_or_default()
}

/// Wait for `child` to exit, at most `limit`; its exit status (None: still running, then killed).
fn wait_for(child: &mut std::process::Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// A temporary directory (kept while the first value lives) with the TINY recipe in it: (directory,
/// recipe, run directory, logs directory).
fn run_and_logs() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    let (out, logs) = (d.path().join("run"), d.path().join("logs"));
    (d, cfg, out, logs)
}

#[test]
fn a_process_killed_mid_run_stops_every_other_naming_it() {
    let (_d, cfg, out, logs) = run_and_logs();
    let timeout_s = 20;
    let cfg_s = cfg.to_str().unwrap().to_string();
    let out_s = out.to_str().unwrap().to_string();
    let ts = format!("dist.timeout_s={timeout_s}");
    // many steps, so the run is surely under way when rank 2 is killed
    let args = [
        "train",
        "--config",
        &cfg_s,
        "--out",
        &out_s,
        "--set",
        "dist.backend=gloo",
        "--set",
        "dist.zero_stage=3",
        "--set",
        &ts,
        "--set",
        "stage.0.steps=400",
        "--set",
        "checkpoint.every=0",
    ];
    let mut ranks = start_ranks(4, &logs, &args, |_| vec![]);
    // kill rank 2 once rank 0 has logged a few steps
    let t0 = Instant::now();
    while !std::fs::read_to_string(out.join("metrics.jsonl")).is_ok_and(|m| m.lines().count() >= 3) {
        assert!(t0.elapsed() < Duration::from_secs(120), "the run never got going:\n{}", log_of(&logs, 0));
        assert!(ranks[0].try_wait().unwrap().is_none(), "rank 0 ended early:\n{}", log_of(&logs, 0));
        std::thread::sleep(Duration::from_millis(50));
    }
    let killed = Instant::now();
    ranks[2].kill().unwrap(); // SIGKILL
    let _ = ranks[2].wait();
    for r in [0, 1, 3] {
        let status = wait_for(&mut ranks[r], Duration::from_secs(timeout_s + 30));
        let log = log_of(&logs, r);
        let status =
            status.unwrap_or_else(|| panic!("rank {r} still ran {} s after rank 2 was killed:\n{log}", timeout_s + 30));
        assert!(!status.success(), "rank {r} exited 0 after rank 2 was killed:\n{log}");
        assert!(log.contains("rank 2"), "rank {r}'s error does not name rank 2:\n{log}");
    }
    assert!(
        killed.elapsed() < Duration::from_secs(timeout_s + 10),
        "the others took {:?} to stop (dist.timeout_s = {timeout_s})",
        killed.elapsed()
    );
}

#[test]
fn processes_with_different_configs_are_refused_before_any_work() {
    let (_d, cfg, out, logs) = run_and_logs();
    let (cfg_s, out_s) = (cfg.to_str().unwrap().to_string(), out.to_str().unwrap().to_string());
    let args = ["train", "--config", &cfg_s, "--out", &out_s, "--set", "dist.backend=gloo"];
    // rank 1 trains with another learning rate
    let mut ranks =
        start_ranks(2, &logs, &args, |r| if r == 1 { vec!["--set".into(), "optim.lr=1e-2".into()] } else { vec![] });
    for (r, p) in ranks.iter_mut().enumerate() {
        let status = wait_for(p, Duration::from_secs(60)).unwrap_or_else(|| panic!("rank {r} did not stop"));
        assert!(!status.success(), "rank {r} ran with a mixed group:\n{}", log_of(&logs, r));
    }
    let all = format!("{}\n{}", log_of(&logs, 0), log_of(&logs, 1));
    assert!(all.contains("different resolved config"), "the refusal does not name the cause:\n{all}");
    assert!(!out.join("metrics.jsonl").exists(), "a step ran before the refusal");
}

#[test]
fn gloo_processes_under_torchrun_equal_one_rank() {
    let Some(torchrun) = crate::common::torchrun() else { return };
    let d = tempfile::tempdir().unwrap();
    let (cfg, one, tol) = baseline(d.path());
    let out = d.path().join("torchrun");
    let o = Command::new(&torchrun)
        .args(["--no-python", "--standalone", "--nproc-per-node", "2"])
        .arg(env!("CARGO_BIN_EXE_harpe"))
        .args(["train", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .args(["--set", "dist.backend=gloo", "--set", "dist.zero_stage=2"])
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "torchrun ... harpe train failed:\n{text}");
    assert_same_losses(&one, &out, "2 Gloo processes under torchrun");
    assert_same_tensors(&model(&one), &model(&out), "2 Gloo processes under torchrun", tol);
    // two torchrun agents as two nodes (c10d rendezvous, one process each): the agent store under
    // TORCHELASTIC_USE_AGENT_STORE carries the rendezvous and Gloo's addresses
    let out2 = d.path().join("two-agents");
    let port = harpe::launch::env::free_port("127.0.0.1").unwrap();
    let ep = format!("127.0.0.1:{port}");
    let agents: Vec<_> = (0..2)
        .map(|_| {
            Command::new(&torchrun)
                .args(["--no-python", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"])
                .args(["--rdzv-id", "harpe-gloo-2n", "--rdzv-endpoint", &ep, "--local-addr", "127.0.0.1"])
                .arg(env!("CARGO_BIN_EXE_harpe"))
                .args(["train", "--config", cfg.to_str().unwrap(), "--out", out2.to_str().unwrap()])
                .args(["--set", "dist.backend=gloo", "--set", "dist.zero_stage=3"])
                .env("OMP_NUM_THREADS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for a in agents {
        let o = a.wait_with_output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "a torchrun agent of two failed:\n{text}");
    }
    assert_same_losses(&one, &out2, "2 Gloo processes under two c10d torchrun agents");
    assert_same_tensors(&model(&one), &model(&out2), "2 Gloo processes under two torchrun agents", tol);
    // the same command line without a launcher is one process: it trains alone
    let (ok, text) = harpe(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        d.path().join("alone").to_str().unwrap(),
        "--set",
        "dist.backend=gloo",
    ]);
    assert!(ok, "a lone Gloo process failed:\n{text}");
}

#[test]
fn gloo_processes_in_bf16_stay_within_the_bf16_noise_floor() {
    bf16_ranks_within_the_noise_floor("Gloo processes", train_procs);
}

#[test]
fn sigterm_to_every_process_at_random_moments_ends_in_an_agreed_stop_with_a_complete_checkpoint() {
    use rand::{Rng, SeedableRng};
    let d = tempfile::tempdir().unwrap();
    let cfg = write_endless_cfg(d.path());
    let out = d.path().join("r");
    let (cfg_s, out_s) = (cfg.to_str().unwrap().to_string(), out.to_str().unwrap().to_string());
    let args = [
        "train",
        "--config",
        &cfg_s,
        "--out",
        &out_s,
        "--resume",
        "--set",
        "dist.backend=gloo",
        "--set",
        "dist.zero_stage=3",
        "--set",
        "dist.timeout_s=60",
        "--set",
        "log.progress=false",
    ];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(44);
    let mut last_step = 0;
    for round in 0..8 {
        let logs = d.path().join(format!("logs{round}"));
        let mut ranks = start_ranks(4, &logs, &args, |_| vec![]);
        let t0 = Instant::now();
        while losses_or_empty(&out).last().map(|l| l.0).unwrap_or(0) <= last_step {
            assert!(t0.elapsed().as_secs() < 120, "round {round}: training did not start:\n{}", log_of(&logs, 0));
            std::thread::sleep(Duration::from_millis(20));
        }
        // each process gets its signal at its own moment, as a cluster's stop reaches nodes
        for p in &ranks {
            std::thread::sleep(Duration::from_millis(rng.random_range(0..150)));
            // SAFETY: signalling a child of this test by its pid
            unsafe { libc::kill(p.id() as i32, libc::SIGTERM) };
        }
        for (r, p) in ranks.iter_mut().enumerate() {
            let status = wait_for(p, Duration::from_secs(90)).unwrap_or_else(|| panic!("round {round}: rank {r} hung"));
            assert!(status.success(), "round {round}: rank {r} exited {status:?}:\n{}", log_of(&logs, r));
        }
        let steps = losses_or_empty(&out).last().map(|l| l.0).unwrap();
        assert_eq!(shards_and_done(&ckpt(&out, steps)), (4, true), "round {round}: the checkpoint of step {steps}");
        assert!(steps > last_step, "round {round} trained");
        last_step = steps;
    }
}
