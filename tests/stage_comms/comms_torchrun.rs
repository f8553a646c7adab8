//! harpe under the real torchrun (PyTorch's launcher; `scripts/install-torchrun.sh target/torch-venv`
//! installs it, `.ci/run` does so): `torchrun --no-python ... harpe dist-check` comes up as one
//! 2-process group in each rendezvous style — `--standalone`, static `--master-addr/--master-port`,
//! c10d `--rdzv-endpoint` — on one node and on two (two torchrun agents on this machine, each
//! `--nnodes 2`, stand in for two nodes), and a killed rank is named by the survivor.
//!
//! torchrun is looked for in `$HARPE_TORCHRUN`, then `target/torch-venv/bin/torchrun`, then `PATH`.
//! Without it each test fails when `CI` is set (CI must install it) and otherwise says how to install it
//! and returns. Every address is 127.0.0.1 (`--local-addr` keeps c10d's agents off the host's name).
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One torchrun at a time: each agent imports torch (seconds of CPU), and 2 cores are the norm here.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// torchrun and the turn to use it, or `None` after saying how to get it (a failure under CI).
fn need_torchrun() -> Option<(PathBuf, MutexGuard<'static, ()>)> {
    let t = crate::common::torchrun()?;
    Some((t, ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())))
}

fn free_port() -> String {
    harpe::launch::env::free_port("127.0.0.1").unwrap().to_string()
}

/// One torchrun agent running `harpe dist-check <check...>` with `--no-python`.
fn agent(torchrun: &PathBuf, launcher: &[&str], check: &[&str]) -> Child {
    Command::new(torchrun)
        .args(["--no-python", "--monitor-interval", "5"])
        .args(launcher)
        .arg(env!("CARGO_BIN_EXE_harpe"))
        .args(["dist-check", "--timeout-s", "60"])
        .args(check)
        .env_remove("HARPE_RUN_TOKEN")
        .env("OMP_NUM_THREADS", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Wait for all agents (killing them after 180 s); their outputs, stdout and stderr joined per agent.
fn wait_all(agents: Vec<Child>) -> Vec<(bool, String)> {
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut agents = agents;
    while agents.iter_mut().any(|c| c.try_wait().unwrap().is_none()) {
        if Instant::now() > deadline {
            for c in &mut agents {
                let _ = c.kill();
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    agents
        .into_iter()
        .map(|c| {
            let o: Output = c.wait_with_output().unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
            (o.status.success(), text)
        })
        .collect()
}

/// Every rank 0..2 reported joining through the agent's store, with one payload digest; `not_port`:
/// the agent store's port, which must not be where rank 0 listened.
fn assert_one_group(outs: &[(bool, String)], not_port: Option<&str>) {
    let all: String = outs.iter().map(|(_, t)| t.as_str()).collect();
    for (ok, text) in outs {
        assert!(ok, "an agent failed:\n{text}");
    }
    let lines: Vec<&str> = all.lines().filter(|l| l.starts_with("dist-check: rank ")).collect();
    assert_eq!(lines.len(), 2, "{all}");
    for r in 0..2 {
        assert!(lines.iter().any(|l| l.starts_with(&format!("dist-check: rank {r}/2 "))), "{all}");
    }
    for l in &lines {
        assert!(l.contains(", Torchrun, agent store) joined 127.0.0.1:"), "{l}");
        if let Some(p) = not_port {
            assert!(!l.contains(&format!("joined 127.0.0.1:{p};")), "rank 0 listened on the agent's port: {l}");
        }
    }
    let digests: Vec<&str> = lines.iter().filter_map(|l| l.split("sha256 ").nth(1)).collect();
    assert!(digests.len() == 2 && digests[0] == digests[1], "{all}");
}

#[test]
fn one_node_standalone() {
    let Some((t, _turn)) = need_torchrun() else { return };
    let outs = wait_all(vec![agent(&t, &["--standalone", "--nproc-per-node", "2"], &[])]);
    assert_one_group(&outs, None);
}

#[test]
fn one_node_static_master_port() {
    let Some((t, _turn)) = need_torchrun() else { return };
    let p = free_port();
    let launcher =
        ["--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", p.as_str()];
    let outs = wait_all(vec![agent(&t, &launcher, &[])]);
    assert_one_group(&outs, Some(&p));
}

#[test]
fn one_node_c10d_endpoint() {
    let Some((t, _turn)) = need_torchrun() else { return };
    let ep = format!("127.0.0.1:{}", free_port());
    let launcher = ["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", ep.as_str()];
    let outs = wait_all(vec![agent(&t, &[&launcher[..], &["--local-addr", "127.0.0.1"][..]].concat(), &[])]);
    assert_one_group(&outs, None);
}

#[test]
fn two_nodes_static_master_port() {
    let Some((t, _turn)) = need_torchrun() else { return };
    let p = free_port();
    let node = |rank: &'static str| {
        let launcher = ["--nnodes", "2", "--node-rank", rank, "--nproc-per-node", "1", "--master-addr", "127.0.0.1"];
        agent(&t, &[&launcher[..], &["--master-port", p.as_str()]].concat(), &[])
    };
    let outs = wait_all(vec![node("0"), node("1")]);
    assert_one_group(&outs, Some(&p));
}

#[test]
fn two_nodes_c10d_endpoint() {
    let Some((t, _turn)) = need_torchrun() else { return };
    let ep = format!("127.0.0.1:{}", free_port());
    let node = || {
        let launcher = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "harpe-2n"];
        agent(&t, &[&launcher[..], &["--rdzv-endpoint", ep.as_str(), "--local-addr", "127.0.0.1"][..]].concat(), &[])
    };
    let outs = wait_all(vec![node(), node()]);
    assert_one_group(&outs, None);
}

#[test]
fn a_killed_rank_is_named_by_the_survivor() {
    let Some((t, _turn)) = need_torchrun() else { return };
    // rank 1 SIGKILLs itself half a second into its work; rank 0's failure watch must name it before
    // torchrun's agent (checking every 5 s) tears the group down
    let outs =
        wait_all(vec![agent(&t, &["--standalone", "--nproc-per-node", "2"], &["--work-s", "60", "--kill-rank", "1"])]);
    let (ok, text) = &outs[0];
    assert!(!ok, "{text}");
    assert!(
        text.contains("rank 0: stopping: rank 1 failed while in step") && text.contains("its process is gone"),
        "{text}"
    );
}
