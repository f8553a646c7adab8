//! Two nodes × 2 Gloo processes on two hosts made of network namespaces (tests/common/netns.rs): real
//! addresses, host names resolved per host, and faults of the link between them. Under harpe's own
//! launcher (`--nnodes 2 --node-rank R --master-addr ...`, by host name and by address) and under
//! torchrun's c10d rendezvous (one agent per host) the run trains to the one-rank run's losses; with 1%
//! loss and added delay it trains to the same losses as without; a host name that resolves to 127.0.1.1
//! on its own host stops every rank at once, naming the address; the link taken down mid-run stops every
//! rank on both hosts within `dist.timeout_s`; a worker killed under `--max-restarts 1` makes torchrun
//! re-form the group, which resumes from the last checkpoint to the same losses.
use super::netns::{Hosts, Names, NAMES};
use super::train_dist::{assert_same_losses, losses, losses_or_empty, train, write_cfg};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A process started on one host, its output in `log`.
struct Proc {
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // a failed test must not leave its launcher (and, through it, its workers) behind
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `program args` on host `i`, output to `log`.
fn start(h: &Hosts, i: usize, program: &Path, args: &[String], env: &[(&str, &str)], log: PathBuf) -> Proc {
    let f = std::fs::File::create(&log).unwrap();
    let mut c = h.cmd(i, program);
    c.args(args).envs(env.iter().copied()).env("OMP_NUM_THREADS", "1");
    let child = c.stdout(f.try_clone().unwrap()).stderr(f).stdin(Stdio::null()).spawn().unwrap();
    Proc { child, log }
}

/// Wait for every process, at most `limit` in all: each one's exit status (`None`: killed at the limit).
fn wait_all(ps: &mut [Proc], limit: Duration) -> Vec<Option<ExitStatus>> {
    let t0 = Instant::now();
    let mut out = vec![None; ps.len()];
    while out.iter().any(Option::is_none) && t0.elapsed() < limit {
        for (p, s) in ps.iter_mut().zip(out.iter_mut()) {
            if s.is_none() {
                *s = p.child.try_wait().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    out
}

/// Both hosts' processes ended with status 0 (panics with their logs otherwise).
fn assert_all_succeed(ps: &mut [Proc], what: &str) {
    let st = wait_all(ps, Duration::from_secs(300));
    for (p, s) in ps.iter().zip(&st) {
        assert!(s.is_some_and(|s| s.success()), "{what}: {s:?}:\n{}", p.text());
    }
}

fn harpe_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_harpe"))
}

/// `harpe train` under harpe's own launcher on both hosts: 2 nodes × 2 processes, rank 0's host given as
/// `master` (a name or an address), then `extra`.
fn launcher_run(h: &Hosts, cfg: &Path, out: &Path, master: &str, extra: &[&str]) -> Vec<Proc> {
    let token = format!("two-hosts-{}", std::process::id());
    (0..2)
        .map(|i| {
            let mut a: Vec<String> = ["train", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()]
                .iter()
                .map(|s| s.to_string())
                .collect();
            let nr = i.to_string();
            let flags = ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", &nr, "--master-addr", master];
            a.extend(flags.iter().map(|s| s.to_string()));
            a.extend(
                ["--master-port", "29500", "--set", "dist.backend=gloo", "--set", "dist.zero_stage=1"]
                    .map(String::from),
            );
            a.extend(extra.iter().map(|s| s.to_string()));
            let log = out.with_extension(format!("node{i}.log"));
            start(h, i, &harpe_bin(), &a, &[("HARPE_RUN_TOKEN", token.as_str())], log)
        })
        .collect()
}

/// torchrun on both hosts: 2 agents × 2 processes, c10d rendezvous at node01:29400, then harpe `args`.
fn torchrun_run(h: &Hosts, torchrun: &Path, logs: &Path, launcher: &[&str], args: &[String]) -> Vec<Proc> {
    (0..2)
        .map(|i| {
            let mut a: Vec<String> =
                ["--no-python", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
            a.extend(["--rdzv-endpoint", &format!("{}:29400", NAMES[0]), "--rdzv-id", "two-hosts"].map(String::from));
            a.extend(launcher.iter().map(|s| s.to_string()));
            a.push(harpe_bin().to_str().unwrap().to_string());
            a.extend(args.iter().cloned());
            start(h, i, torchrun, &a, &[], logs.with_extension(format!("agent{i}.log")))
        })
        .collect()
}

#[test]
fn two_hosts_under_harpes_launcher_by_name_by_address_and_over_a_lossy_link_equal_one_rank() {
    let Some(h) = Hosts::make("two_hosts_under_harpes_launcher", Names::Cluster) else { return };
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    let one = d.path().join("one");
    train(&cfg, &one, &[]);
    for (name, master) in [("by name", NAMES[0]), ("by address", h.addr(0))] {
        let out = d.path().join(name.replace(' ', "-"));
        let mut ps = launcher_run(&h, &cfg, &out, master, &["--set", "dist.timeout_s=60"]);
        assert_all_succeed(&mut ps, &format!("2 hosts x 2 processes, --master-addr {master}"));
        assert_same_losses(&one, &out, &format!("2 hosts x 2 processes, MASTER_ADDR {name}"));
    }
    // delay and loss on the link: TCP retransmits, the collectives wait longer, the numbers do not change
    let how = h.impair(1);
    eprintln!("impaired link: {how}");
    let out = d.path().join("lossy");
    let mut ps = launcher_run(&h, &cfg, &out, NAMES[0], &["--set", "dist.timeout_s=120"]);
    assert_all_succeed(&mut ps, &format!("2 hosts over a link with {how}"));
    assert_eq!(losses(&out), losses(&d.path().join("by-name")), "losses over the link with {how} vs a clean link");
    if let Some(n) = h.dropped(1) {
        eprintln!("nftables dropped {n} packets on node02");
        assert!(n > 0, "the loss rules dropped nothing: the run did not cross an impaired link");
    }
}

#[test]
fn a_master_addr_resolving_to_loopback_on_its_own_host_stops_every_rank_at_once_naming_it() {
    let Some(h) = Hosts::make("loopback_master_addr", Names::OwnNameLoopback) else { return };
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    // a long timeout: stopping at once must not be the timeout's doing
    let timeout = ["--set", "dist.timeout_s=300"];
    let out = d.path().join("launcher");
    let t0 = Instant::now();
    let mut ps = launcher_run(&h, &cfg, &out, NAMES[0], &timeout);
    let st = wait_all(&mut ps, Duration::from_secs(60));
    for (p, s) in ps.iter().zip(&st) {
        let text = p.text();
        assert!(
            s.is_some_and(|s| !s.success()),
            "harpe's launcher, MASTER_ADDR node01 = 127.0.1.1 on node01: {s:?}:\n{text}"
        );
        assert!(
            text.contains("127.0.1.1") && text.contains("hint:"),
            "the error names neither the address nor a hint:\n{text}"
        );
    }
    eprintln!("harpe's launcher: every rank stopped after {:?}; node02 says:\n{}", t0.elapsed(), ps[1].text());
    let Some(torchrun) = crate::common::torchrun() else { return };
    // torchrun publishes node01 (its host name) as MASTER_ADDR; on node01 it is 127.0.1.1
    let out = d.path().join("torchrun");
    let mut args: Vec<String> =
        ["train", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()].map(String::from).to_vec();
    args.extend(["--set", "dist.backend=gloo"].map(String::from));
    args.extend(timeout.map(String::from));
    let t0 = Instant::now();
    let mut ps = torchrun_run(&h, &torchrun, &out, &[], &args);
    let st = wait_all(&mut ps, Duration::from_secs(90));
    for (p, s) in ps.iter().zip(&st) {
        let text = p.text();
        assert!(s.is_some_and(|s| !s.success()), "torchrun, node01 = 127.0.1.1 on node01: {s:?}:\n{text}");
        assert!(text.contains("loopback address") && text.contains("hint:"), "the error does not say why:\n{text}");
    }
    eprintln!("torchrun: every rank stopped after {:?}; node02 says:\n{}", t0.elapsed(), ps[1].text());
}

#[test]
fn the_link_taken_down_mid_run_stops_every_rank_on_both_hosts_after_the_timeout_naming_the_silent_ones() {
    let Some(h) = Hosts::make("link_down", Names::Cluster) else { return };
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    let out = d.path().join("run");
    let timeout_s = 20;
    let ts = format!("dist.timeout_s={timeout_s}");
    let extra = ["--set", &ts, "--set", "stage.0.steps=400", "--set", "checkpoint.every=0"];
    let mut ps = launcher_run(&h, &cfg, &out, NAMES[0], &extra);
    let t0 = Instant::now();
    while losses_or_empty(&out).len() < 3 {
        assert!(t0.elapsed() < Duration::from_secs(120), "the run never got going:\n{}", ps[0].text());
        assert!(ps.iter_mut().all(|p| p.child.try_wait().unwrap().is_none()), "a node ended early:\n{}", ps[0].text());
        std::thread::sleep(Duration::from_millis(50));
    }
    let down = Instant::now();
    h.link_down(1);
    let st = wait_all(&mut ps, Duration::from_secs(timeout_s + 60));
    let took = down.elapsed();
    for (i, (p, s)) in ps.iter().zip(&st).enumerate() {
        let text = p.text();
        assert!(s.is_some_and(|s| !s.success()), "node {i} after the link went down: {s:?}:\n{text}");
        // node01 names the ranks that went silent and their host; node02 cannot reach rank 0's host at all
        let want =
            if i == 0 { format!("ranks [2, 3] (at {})", h.addr(1)) } else { "cannot reach the group's store".into() };
        assert!(text.contains(&want) && text.contains("hint:"), "node {i} does not say {want:?}:\n{text}");
    }
    assert!(
        // the collective in flight started before the link went down, so its timeout ends no later; a few
        // seconds for the processes to exit on a loaded machine
        took < Duration::from_secs(timeout_s + 4),
        "the ranks took {took:?} to stop (dist.timeout_s = {timeout_s})"
    );
    let said: Vec<String> = ps
        .iter()
        .flat_map(|p| p.text().lines().filter(|l| l.starts_with("error:")).map(String::from).collect::<Vec<_>>())
        .collect();
    eprintln!("link down: every rank stopped after {took:?} (dist.timeout_s = {timeout_s}):\n{}", said.join("\n"));
}

#[test]
fn two_hosts_under_torchrun_equal_one_rank_and_re_form_after_a_killed_worker() {
    let Some(torchrun) = crate::common::torchrun() else { return };
    let Some(h) = Hosts::make("two_hosts_under_torchrun", Names::Cluster) else { return };
    let d = tempfile::tempdir().unwrap();
    let cfg = write_cfg(d.path());
    let one = d.path().join("one");
    train(&cfg, &one, &[]);
    let args = |out: &Path| -> Vec<String> {
        let a = ["train", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap(), "--resume"];
        let mut a: Vec<String> = a.map(String::from).to_vec();
        a.extend(
            ["--set", "dist.backend=gloo", "--set", "dist.zero_stage=2", "--set", "dist.timeout_s=60"]
                .map(String::from),
        );
        a
    };
    let out = d.path().join("torchrun");
    let mut ps = torchrun_run(&h, &torchrun, &out, &[], &args(&out));
    assert_all_succeed(&mut ps, "torchrun on 2 hosts x 2 processes");
    assert_same_losses(&one, &out, "torchrun on 2 hosts x 2 processes");

    // a worker on node02 killed after the first checkpoint: its agent restarts its workers, the other
    // agent follows, and the new group resumes from the newest complete checkpoint
    let out = d.path().join("restart");
    let mut ps = torchrun_run(&h, &torchrun, &out, &["--max-restarts", "1"], &args(&out));
    let t0 = Instant::now();
    while !out.join("checkpoints/step_000002/DONE").exists() {
        assert!(t0.elapsed() < Duration::from_secs(180), "no checkpoint yet:\n{}", ps[0].text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let worker = workers_of(ps[1].child.id()).into_iter().next().expect("node02's agent has workers");
    // SAFETY: a worker process this test started (a child of its torchrun agent)
    unsafe { libc::kill(worker as i32, libc::SIGKILL) };
    assert_all_succeed(&mut ps, "torchrun --max-restarts 1 after a killed worker");
    let text = format!("{}\n{}", ps[0].text(), ps[1].text());
    assert!(text.contains("failed while in step"), "the killed worker was not named:\n{text}");
    assert!(text.contains("resuming from"), "the re-formed group did not resume from a checkpoint:\n{text}");
    assert_same_losses(&one, &out, "torchrun, a worker killed and the group re-formed");
}

/// The pids of `pid`'s child processes that run harpe.
fn workers_of(pid: u32) -> Vec<u32> {
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
        // the field after the command's closing parenthesis: state, then the parent's pid
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let harpe = std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "harpe");
        if harpe && rest.split_whitespace().nth(1).and_then(|s| s.parse::<u32>().ok()) == Some(pid) {
            out.push(p);
        }
    }
    out
}
