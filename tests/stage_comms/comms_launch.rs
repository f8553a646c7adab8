//! The launcher environment (torchrun, Slurm, hostlists), the worker spawner, and the TCP rendezvous
//! (threads and real processes on localhost).
use crate::common::harpe_cmd;
use harpe::config::{rank_batching, Backend, DistSection};
use harpe::launch::env::{expand_nodelist, free_port, LaunchEnv, LaunchSource, RunToken, TokenOrigin};
use harpe::launch::rendezvous::{
    binary_version, config_hash, rendezvous, Meeting, Rendezvous, RendezvousSpec, HANDSHAKE_WAIT,
};
use harpe::launch::spawn::{place, spawn_workers, strip_nproc_flag, SpawnOptions};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write;
use std::net::TcpListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn err(pairs: &[(&str, &str)]) -> String {
    format!("{:#}", LaunchEnv::from_map(&env(pairs)).unwrap_err())
}

#[test]
fn torchrun_variables_give_the_rank_environment() {
    let e = LaunchEnv::from_map(&env(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "16"),
        ("LOCAL_RANK", "5"),
        ("LOCAL_WORLD_SIZE", "8"),
        ("MASTER_ADDR", "node01"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_RUN_ID", "job42"),
        ("SLURM_PROCID", "0"), // `srun torchrun`: torchrun's variables win
    ]))
    .unwrap()
    .unwrap();
    assert_eq!(
        e,
        LaunchEnv {
            source: LaunchSource::Torchrun,
            rank: 5,
            world_size: 16,
            local_rank: 5,
            local_world_size: Some(8),
            master_addr: "node01".into(),
            master_port: 29500,
            run_token: RunToken { value: "job42".into(), origin: TokenOrigin::JobId("TORCHELASTIC_RUN_ID") },
        }
    );
    assert!(LaunchEnv::from_map(&env(&[("PATH", "/bin")])).unwrap().is_none(), "no launcher: single process");
}

#[test]
fn slurm_variables_give_the_rank_environment_with_the_first_node_as_master() {
    let e = LaunchEnv::from_map(&env(&[
        ("SLURM_PROCID", "9"),
        ("SLURM_NTASKS", "16"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NTASKS_PER_NODE", "8"),
        ("SLURM_JOB_NODELIST", "gpu[07-08,11],login2"),
        ("SLURM_JOB_ID", "123456"),
        ("SLURM_STEP_ID", "3"),
    ]))
    .unwrap()
    .unwrap();
    assert_eq!(e.source, LaunchSource::Slurm);
    assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size), (9, 16, 1, Some(8)));
    assert_eq!(e.master_addr, "gpu07");
    assert_eq!(e.master_port, 20000 + 3456);
    assert_eq!(e.run_token, RunToken { value: "slurm-123456.3".into(), origin: TokenOrigin::JobId("SLURM_JOB_ID") });
    // MASTER_ADDR / MASTER_PORT / HARPE_RUN_TOKEN override the derived values
    let e = LaunchEnv::from_map(&env(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_JOB_NODELIST", "a[1-2]"),
        ("MASTER_ADDR", "10.0.0.9"),
        ("MASTER_PORT", "4000"),
        ("HARPE_RUN_TOKEN", "tok"),
    ]))
    .unwrap()
    .unwrap();
    assert_eq!((e.master_addr.as_str(), e.master_port), ("10.0.0.9", 4000));
    assert_eq!(e.run_token, RunToken { value: "tok".into(), origin: TokenOrigin::Given });
}

/// What torchrun (2.15, every rendezvous style) sets for a worker: MASTER_ADDR:MASTER_PORT is its agent's
/// TCPStore, so harpe meets through that store instead of listening there.
fn torchrun_worker(rank: &'static str, extra: &[(&'static str, &'static str)]) -> BTreeMap<String, String> {
    let mut v = vec![
        ("RANK", rank),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", rank),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "localhost"),
        ("MASTER_PORT", "41481"),
        ("TORCHELASTIC_RUN_ID", "2a869bbb-d3eb-4742-9912-8a21eb3585ba"),
        ("TORCHELASTIC_RESTART_COUNT", "2"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
    ];
    v.extend_from_slice(extra);
    env(&v)
}

#[test]
fn torchruns_agent_store_is_recognised_and_its_port_never_taken_as_harpes() {
    let e = LaunchEnv::from_map(&torchrun_worker("1", &[])).unwrap().unwrap();
    assert_eq!(e.source, LaunchSource::TorchrunAgentStore { restart: 2 });
    assert_eq!((e.master_addr.as_str(), e.master_port), ("localhost", 41481));
    assert_eq!(e.run_token, RunToken { value: String::new(), origin: TokenOrigin::AgentStore });
    let spec = RendezvousSpec::from_launch(&e, "cfg", Duration::from_secs(1));
    assert_eq!(spec.meet, Meeting::AgentStore { restart: 2 });
    // HARPE_RUN_TOKEN still wins; the store then carries only the address
    let e = LaunchEnv::from_map(&torchrun_worker("0", &[("HARPE_RUN_TOKEN", "mine")])).unwrap().unwrap();
    assert_eq!(e.run_token, RunToken { value: "mine".into(), origin: TokenOrigin::Given });
    // a torchrun that does not share its store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): MASTER_PORT is
    // a free port for rank 0, as before; the run id is the token, guessable
    let e = LaunchEnv::from_map(&torchrun_worker("0", &[("TORCHELASTIC_USE_AGENT_STORE", "False")])).unwrap().unwrap();
    assert_eq!(e.source, LaunchSource::Torchrun);
    assert_eq!(RendezvousSpec::from_launch(&e, "cfg", Duration::from_secs(1)).meet, Meeting::Listen);
    assert_eq!(e.run_token.origin, TokenOrigin::JobId("TORCHELASTIC_RUN_ID"));
}

#[test]
fn a_missing_token_is_refused_and_a_job_id_token_warned() {
    let missing = RunToken::from("");
    assert_eq!(missing.origin, TokenOrigin::Missing);
    let e = format!("{:#}", missing.check(2).unwrap_err());
    assert!(e.contains("no run token") && e.contains("hint: export HARPE_RUN_TOKEN="), "{e}");
    assert_eq!(missing.check(1).unwrap(), None, "one rank needs no token");
    let job = RunToken { value: "slurm-77.0".into(), origin: TokenOrigin::JobId("SLURM_JOB_ID") };
    let w = job.check(16).unwrap().expect("a job-id token is warned about");
    assert!(w.contains("derived from SLURM_JOB_ID") && w.contains("guess") && w.contains("hint:"), "{w}");
    assert_eq!(RunToken::from("3f9a").check(16).unwrap(), None);
    // the environments that give no token at all
    let hand = LaunchEnv::from_map(&env(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "1"),
    ]))
    .unwrap()
    .unwrap();
    assert_eq!(hand.run_token.origin, TokenOrigin::Missing);
}

#[test]
fn slurm_hostlists_expand_like_scontrol_show_hostnames() {
    let h = |s: &str| expand_nodelist(s).unwrap();
    assert_eq!(h("node[01-03,07],gpu5"), ["node01", "node02", "node03", "node07", "gpu5"]);
    assert_eq!(h("r[1-2]-n[8-9]"), ["r1-n8", "r1-n9", "r2-n8", "r2-n9"]);
    assert_eq!(h("a[9-11]"), ["a9", "a10", "a11"]);
    assert_eq!(h("x[098-100]y"), ["x098y", "x099y", "x100y"]);
    assert_eq!(h("solo"), ["solo"]);
    for bad in ["node[01-03", "node[3-1]", "node[a-b]", "n,,m", "n[1-2]]", "n[[1]]"] {
        let e = format!("{:#}", expand_nodelist(bad).unwrap_err());
        assert!(e.contains(bad) && e.contains("hint:"), "{bad}: {e}");
    }
}

#[test]
fn inconsistent_or_missing_launcher_variables_are_clear_errors() {
    let full = [("LOCAL_RANK", "0"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1234")];
    let with = |extra: &[(&'static str, &'static str)]| -> Vec<(&'static str, &'static str)> {
        full.iter().chain(extra).copied().collect()
    };
    let e = err(&with(&[("RANK", "4"), ("WORLD_SIZE", "4")]));
    assert!(e.contains("RANK=4 is not below WORLD_SIZE=4") && e.contains("hint:"), "{e}");
    let e = err(&with(&[("WORLD_SIZE", "4")]));
    assert!(e.contains("RANK is not set") && e.contains("hint:"), "{e}");
    let e = err(&with(&[("RANK", "one"), ("WORLD_SIZE", "4")]));
    assert!(e.contains("RANK=\"one\" is not a non-negative integer"), "{e}");
    let e = err(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("MASTER_PORT", "1")]);
    assert!(e.contains("MASTER_ADDR is not set") && e.contains("hint:"), "{e}");
    let e =
        err(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "70000")]);
    assert!(e.contains("MASTER_PORT=70000 is not a TCP port"), "{e}");
    assert!(LaunchEnv::from_map(&env(&with(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "1")]))).is_ok());
    let e = err(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "2"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "1"),
    ]);
    assert!(e.contains("LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"), "{e}");
    let e = err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_JOB_NODELIST", "n1"), ("SLURM_JOB_ID", "1")]);
    assert!(e.contains("SLURM_LOCALID is not set") && e.contains("srun"), "{e}");
    let e = err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "0"), ("SLURM_JOB_ID", "1")]);
    assert!(e.contains("SLURM_JOB_NODELIST") && e.contains("hint:"), "{e}");
    let e =
        err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "0"), ("SLURM_JOB_NODELIST", "n[1-")]);
    assert!(e.contains("SLURM_JOB_NODELIST=\"n[1-\"") && e.contains("hint:"), "{e}");
    // the config and the launcher must agree on the world size
    let ok = LaunchEnv::from_map(&env(&with(&[("RANK", "0"), ("WORLD_SIZE", "2")]))).unwrap().unwrap();
    let e = format!("{:#}", ok.check_world_size(4).unwrap_err());
    assert!(e.contains("dist.world_size = 4") && e.contains("WORLD_SIZE=2") && e.contains("hint:"), "{e}");
    ok.check_world_size(2).unwrap();
}

fn os(v: &[&str]) -> Vec<OsString> {
    v.iter().map(OsString::from).collect()
}

#[test]
fn the_nproc_flag_is_stripped_from_worker_command_lines() {
    let a = os(&["train", "--nproc-per-node", "4", "--config", "c.toml", "--nproc-per-node=2", "--steps", "3"]);
    assert_eq!(strip_nproc_flag(&a), os(&["train", "--config", "c.toml", "--steps", "3"]));
    // and the launcher's node flags
    let a = os(&[
        "train",
        "--nnodes",
        "2",
        "--node-rank=1",
        "--master-addr",
        "node01",
        "--master-port=29500",
        "--steps",
        "3",
    ]);
    assert_eq!(strip_nproc_flag(&a), os(&["train", "--steps", "3"]));
}

/// harpe's launcher across nodes refuses what cannot form one group: no rank-0 host, no shared token, a
/// node rank out of range, node flags without --nproc-per-node.
#[test]
fn the_launchers_node_flags_are_checked_before_anything_starts() {
    /// flags, extra environment, what the error must say
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 4] = [
        (&["--nproc-per-node", "1", "--nnodes", "2"], &[("HARPE_RUN_TOKEN", "t")], "needs --master-addr"),
        (&["--nproc-per-node", "1", "--nnodes", "2", "--master-addr", "127.0.0.1"], &[], "export HARPE_RUN_TOKEN"),
        (&["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "2"], &[], "node ranks are 0..nnodes-1"),
        (&["--nnodes", "2", "--node-rank", "1"], &[], "add --nproc-per-node"),
    ];
    for (flags, env, want) in cases {
        let mut c = harpe_cmd();
        c.arg("dist-check").args(flags).env_remove("HARPE_RUN_TOKEN").envs(env.iter().copied());
        let o = c.output().unwrap();
        let text = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && text.contains(want) && text.contains("hint:"), "{flags:?}: {text}");
    }
}

/// Two "nodes" of harpe's launcher on one machine form one group of 2 x 2 ranks.
#[test]
fn two_nodes_of_harpes_launcher_on_one_machine_form_one_group() {
    let port = free_port("127.0.0.1").unwrap().to_string();
    let nodes: Vec<_> = (0..2)
        .map(|r| {
            harpe_cmd()
                .args(["dist-check", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", &r.to_string()])
                .args(["--master-addr", "127.0.0.1", "--master-port", &port, "--timeout-s", "30"])
                .env("HARPE_RUN_TOKEN", format!("two-nodes-{port}"))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut all = String::new();
    for n in nodes {
        let o = n.wait_with_output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "{text}");
        all.push_str(&text);
    }
    for r in 0..4 {
        assert!(all.contains(&format!("dist-check: rank {r}/4")), "rank {r} missing:\n{all}");
    }
}

fn sh(script: &str) -> (SpawnOptions, Vec<OsString>) {
    let opts =
        SpawnOptions { program: Some(PathBuf::from("/bin/sh")), grace: Duration::from_secs(5), ..Default::default() };
    (opts, os(&["-c", script]))
}

#[test]
fn workers_get_the_torchrun_variables_and_succeed_together() {
    let (opts, args) = sh(r#"test "$WORLD_SIZE" = 3 && test "$LOCAL_RANK" = "$RANK" && test "$LOCAL_WORLD_SIZE" = 3 \
        && test "$MASTER_ADDR" = 127.0.0.1 && test "$MASTER_PORT" -gt 0 && test ${#HARPE_RUN_TOKEN} = 32"#);
    let out = spawn_workers(3, &args, &opts).unwrap();
    assert!(out.success(), "{out:?}");
    assert_eq!((out.first_failure, out.exit_code(), out.statuses.len()), (None, 0, 3));
}

#[test]
fn the_first_failing_rank_is_reported_and_the_others_are_stopped() {
    let (opts, args) = sh(r#"if [ "$RANK" = 1 ]; then exit 7; fi; exec sleep 60"#);
    let t0 = Instant::now();
    let out = spawn_workers(3, &args, &opts).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(30), "the sleeping ranks must be stopped, not waited for");
    assert_eq!(out.first_failure, Some(1));
    assert_eq!(out.exit_code(), 7);
    assert!(!out.statuses[0].success() && !out.statuses[2].success(), "{out:?}");
    assert_eq!(out.forwarded_signal, None);
}

#[test]
fn sigterm_to_the_launcher_is_forwarded_to_every_worker() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    // Each worker: trap TERM (record it, exit 0), say it is ready, then idle.
    let script =
        format!(r#"trap 'echo term > {d}/got$RANK; exit 0' TERM; touch {d}/ready$RANK; while :; do sleep 0.05; done"#);
    let (opts, args) = sh(&script);
    let path = dir.path().to_path_buf();
    let killer = std::thread::spawn(move || {
        let t0 = Instant::now();
        while !(0..2).all(|r| path.join(format!("ready{r}")).exists()) {
            assert!(t0.elapsed() < Duration::from_secs(30), "workers never became ready");
            std::thread::sleep(Duration::from_millis(20));
        }
        // SAFETY: signalling our own process; spawn_workers has registered its handler (the workers
        // only start after that), so SIGTERM is caught and forwarded rather than fatal.
        unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
    });
    let out = spawn_workers(2, &args, &opts).unwrap();
    killer.join().unwrap();
    assert_eq!(out.forwarded_signal, Some(libc::SIGTERM));
    assert!(out.success(), "workers exit 0 from their TERM trap: {out:?}");
    for r in 0..2 {
        assert_eq!(std::fs::read_to_string(dir.path().join(format!("got{r}"))).unwrap().trim(), "term");
    }
}

fn spec(port: u16, rank: usize, world: usize, timeout_ms: u64) -> RendezvousSpec {
    RendezvousSpec {
        addr: "127.0.0.1".into(),
        port,
        meet: Meeting::Listen,
        rank,
        world,
        token: "run-abc".into(),
        version: binary_version(),
        config_hash: config_hash("[train]\nlr = 1e-5\n"),
        timeout: Duration::from_millis(timeout_ms),
        spans_hosts: false,
    }
}

/// Run one rendezvous per spec on its own thread; results in spec order.
fn group(specs: Vec<RendezvousSpec>, then: fn(&mut Rendezvous) -> anyhow::Result<()>) -> Vec<Result<Vec<u8>, String>> {
    let hs: Vec<_> = specs
        .into_iter()
        .map(|s| {
            std::thread::spawn(move || {
                let mut rv = rendezvous(&s, || (0..128u8).map(|i| i.wrapping_mul(37)).collect())?;
                then(&mut rv)?;
                Ok(rv.payload().to_vec())
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap().map_err(|e: anyhow::Error| format!("{e:#}"))).collect()
}

#[test]
fn four_ranks_exchange_the_payload_and_pass_barriers() {
    let port = free_port("127.0.0.1").unwrap();
    let res = group((0..4).map(|r| spec(port, r, 4, 20_000)).collect(), |rv| {
        rv.barrier("after init")?;
        rv.barrier("after checkpoint")
    });
    let want: Vec<u8> = (0..128u8).map(|i| i.wrapping_mul(37)).collect();
    for (r, x) in res.iter().enumerate() {
        assert_eq!(x.as_ref().unwrap_or_else(|e| panic!("rank {r}: {e}")), &want);
    }
}

/// torchrun's agent store outlives an attempt of the workers, and its agents may number the attempt
/// differently: ranks of one attempt meet even when the store still holds the previous attempt's rank-0
/// address (nothing listens there any more) and their restart counts disagree.
#[test]
fn ranks_meet_through_an_agent_store_despite_a_stale_address_and_disagreeing_restart_counts() {
    use harpe::launch::rendezvous::STORE_KEY;
    use harpe::launch::store::{StoreClient, StoreServer};
    let server = StoreServer::bind("127.0.0.1").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut c = StoreClient::connect("127.0.0.1", server.port(), deadline).unwrap();
    let (_held, dead) = closed_port();
    assert!(std::net::TcpStream::connect(("127.0.0.1", dead)).is_err(), "nothing listens at the stale address");
    c.set(STORE_KEY, format!("127.0.0.1:{dead}\n").as_bytes()).unwrap();
    let spec_of = |r: usize| {
        let mut s = spec(server.port(), r, 3, 20_000);
        s.meet = Meeting::AgentStore { restart: [1, 0, 1][r] };
        s
    };
    // ranks 1 and 2 first: they read the stale address, find nothing there, and read again
    let others: Vec<_> = (1..3)
        .map(|r| {
            let s = spec_of(r);
            std::thread::spawn(move || rendezvous(&s, Vec::new).map(|rv| rv.rank0_addr().to_string()))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let rv0 = rendezvous(&spec_of(0), || vec![7]).unwrap();
    for (r, h) in others.into_iter().enumerate() {
        let at = h.join().unwrap().unwrap_or_else(|e| panic!("rank {}: {e:#}", r + 1));
        assert_eq!(at, rv0.rank0_addr(), "rank {} met rank 0 where it listens", r + 1);
        assert!(!at.ends_with(&format!(":{dead}")), "rank {} took the stale address", r + 1);
    }
}

/// A port on 127.0.0.1 where connections are refused for as long as the returned socket lives: it is bound
/// but never listens. A port released after binding (`free_port`) could be handed straight back to the next
/// listener on port 0, and then the "stale" address would be live.
fn closed_port() -> (std::os::fd::OwnedFd, u16) {
    use std::os::fd::FromRawFd;
    // SAFETY: a plain socket call; its result is checked before it is used as a descriptor.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let held = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_in is plain data, valid when zeroed.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    sa.sin_family = libc::AF_INET as libc::sa_family_t;
    sa.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // Port 0 and no SO_REUSEADDR: the kernel picks a port that no other socket may bind while this one holds it.
    // SAFETY: `sa` and `len` describe a sockaddr_in that outlives both calls.
    let rc = unsafe { libc::bind(fd, (&raw const sa).cast(), len) };
    assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
    // SAFETY: as above; getsockname writes at most `len` bytes into `sa`.
    let rc = unsafe { libc::getsockname(fd, (&raw mut sa).cast(), &mut len) };
    assert_eq!(rc, 0, "getsockname: {}", std::io::Error::last_os_error());
    (held, u16::from_be(sa.sin_port))
}

#[test]
fn a_rank_with_another_version_or_config_aborts_the_group_before_any_work() {
    type Tweak = fn(&mut RendezvousSpec);
    let cases: [(Tweak, &str); 3] = [
        (|s| s.version = "harpe 0.0.9 []".into(), "rank 1 runs binary \"harpe 0.0.9 []\""),
        (|s| s.config_hash = config_hash("[train]\nlr = 2e-5\n"), "rank 1 has a different resolved config"),
        (|s| s.world = 3, "rank 1 has world size 3, rank 0 has 2"),
    ];
    for (tweak, want) in cases {
        let port = free_port("127.0.0.1").unwrap();
        let mut bad = spec(port, 1, 2, 20_000);
        tweak(&mut bad);
        let res = group(vec![spec(port, 0, 2, 20_000), bad], |_| Ok(()));
        let e0 = res[0].as_ref().unwrap_err();
        let e1 = res[1].as_ref().unwrap_err();
        assert!(e0.contains(want) && e0.contains("hint:"), "rank 0: {e0}");
        assert!(e1.contains("rendezvous refused") && e1.contains(want), "rank 1: {e1}");
    }
}

/// Rank 0 of `world` on a thread (its result on join), with `timeout_ms`.
fn rank0(port: u16, world: usize, timeout_ms: u64) -> std::thread::JoinHandle<Result<Vec<u8>, String>> {
    let s = spec(port, 0, world, timeout_ms);
    std::thread::spawn(move || {
        rendezvous(&s, || vec![7; 128]).map(|rv| rv.payload().to_vec()).map_err(|e| format!("{e:#}"))
    })
}

#[test]
fn a_wrong_token_is_dropped_without_echo_and_the_group_still_forms() {
    let port = free_port("127.0.0.1").unwrap();
    let r0 = rank0(port, 2, 20_000);
    let mut bad = spec(port, 1, 2, 20_000);
    bad.token = "run-xyz".into();
    bad.world = 5; // a client without the token cannot abort the group by claiming another world size
    let e = format!("{:#}", rendezvous(&bad, Vec::new).err().expect("a wrong token is refused"));
    assert!(e.contains("rendezvous refused") && e.contains("different run token") && e.contains("hint:"), "{e}");
    assert!(!e.contains("run-abc"), "the expected token must never be sent to a client: {e}");
    // the real rank 1 still joins: the group was not aborted
    let ok = rendezvous(&spec(port, 1, 2, 20_000), Vec::new).unwrap();
    assert_eq!(ok.payload(), &[7; 128][..]);
    assert_eq!(r0.join().unwrap().unwrap(), vec![7; 128]);
}

#[test]
fn a_rank_seen_twice_is_dropped_and_named_when_the_rendezvous_times_out() {
    let port = free_port("127.0.0.1").unwrap();
    let r0 = rank0(port, 3, 3_000);
    // two processes claim rank 1: whichever arrives second is dropped; the first stays admitted
    let ones: Vec<_> = (0..2)
        .map(|_| {
            let s = spec(port, 1, 3, 20_000);
            std::thread::spawn(move || rendezvous(&s, Vec::new).map(|_| ()).map_err(|e| format!("{e:#}")))
        })
        .collect();
    let mut errs: Vec<String> = ones.into_iter().map(|h| h.join().unwrap().unwrap_err()).collect();
    errs.sort_by_key(|e| !e.contains("rendezvous refused: duplicate"));
    assert!(errs[0].contains("rendezvous refused: duplicate rank 1: already admitted from"), "{errs:?}");
    assert!(errs[1].contains("ranks [2] never connected"), "the admitted rank 1 learns why: {errs:?}");
    let e0 = r0.join().unwrap().unwrap_err();
    assert!(e0.contains("ranks [2] never connected") && e0.contains("hint:"), "{e0}");
    assert!(e0.contains("refused meanwhile: duplicate rank 1: already admitted from"), "{e0}");
}

#[test]
fn a_silent_or_garbage_connection_does_not_hold_the_door() {
    let port = free_port("127.0.0.1").unwrap();
    // rank 0 gives up well before a silent client's handshake would be given up on: connections must
    // be admitted concurrently for the real rank to get in
    let timeout_ms = (HANDSHAKE_WAIT.as_millis() / 2) as u64;
    let r0 = rank0(port, 2, timeout_ms);
    let connect = || loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    let silent = connect();
    let mut garbage = connect();
    garbage.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let rv = rendezvous(&spec(port, 1, 2, 20_000), Vec::new).unwrap();
    assert_eq!(rv.payload(), &[7; 128][..]);
    assert_eq!(r0.join().unwrap().unwrap(), vec![7; 128]);
    drop(silent);
}

#[test]
fn a_missing_rank_times_out_naming_it() {
    let port = free_port("127.0.0.1").unwrap();
    let res = group(vec![spec(port, 0, 3, 2_000), spec(port, 1, 3, 20_000)], |_| Ok(()));
    let e0 = res[0].as_ref().unwrap_err();
    assert!(e0.contains("timed out") && e0.contains("ranks [2] never connected") && e0.contains("hint:"), "{e0}");
    let e1 = res[1].as_ref().unwrap_err();
    assert!(e1.contains("ranks [2] never connected"), "rank 1 learns why from rank 0: {e1}");
}

#[test]
fn unreachable_unresolvable_busy_or_foreign_addresses_are_clear_errors() {
    let port = free_port("127.0.0.1").unwrap();
    let e = format!("{:#}", rendezvous(&spec(port, 1, 2, 300), Vec::new).err().unwrap());
    assert!(e.contains("could not reach rank 0 at 127.0.0.1") && e.contains("hint:"), "{e}");

    let mut s = spec(port, 1, 2, 300);
    s.addr = "nosuchhost.invalid".into();
    let e = format!("{:#}", rendezvous(&s, Vec::new).err().unwrap());
    assert!(e.contains("MASTER_ADDR \"nosuchhost.invalid\" does not resolve") && e.contains("hint:"), "{e}");

    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let e = format!("{:#}", rendezvous(&spec(busy.local_addr().unwrap().port(), 0, 2, 300), Vec::new).err().unwrap());
    assert!(e.contains("the port is in use") && e.contains("hint:"), "{e}");

    let mut s = spec(port, 0, 2, 300);
    s.addr = "192.0.2.1".into(); // TEST-NET-1: never an address of this host
    let e = format!("{:#}", rendezvous(&s, Vec::new).err().unwrap());
    assert!(e.contains("192.0.2.1 is not an address of this host") && e.contains("hint:"), "{e}");
}

#[test]
fn a_rank_gone_before_a_barrier_fails_it_on_the_others() {
    let port = free_port("127.0.0.1").unwrap();
    let res = group(vec![spec(port, 0, 3, 20_000), spec(port, 1, 3, 20_000), spec(port, 2, 3, 20_000)], |rv| {
        if rv.rank() == 2 {
            return Ok(()); // exits (drops its connection) instead of joining the barrier
        }
        rv.barrier("checkpoint written")
    });
    let e0 = res[0].as_ref().unwrap_err();
    assert!(e0.contains("barrier #1 \"checkpoint written\"") && e0.contains("rank 2 is gone"), "{e0}");
    let e1 = res[1].as_ref().unwrap_err();
    assert!(e1.contains("rank 2 is gone"), "{e1}");
}

#[test]
fn processes_started_by_the_launcher_rendezvous_and_share_one_payload() {
    let out = harpe_cmd().args(["dist-check", "--nproc-per-node", "3", "--timeout-s", "30"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let digests: Vec<&str> = stdout.lines().filter_map(|l| l.split("sha256 ").nth(1)).collect();
    assert_eq!(digests.len(), 3, "{stdout}");
    assert!(digests.iter().all(|d| *d == digests[0]), "{stdout}");
    for r in 0..3 {
        assert!(stdout.contains(&format!("rank {r}/3 (local rank {r}, Torchrun) joined 127.0.0.1:")), "{stdout}");
    }

    let out = harpe_cmd().args(["dist-check", "--nproc-per-node", "3", "--fail-rank", "1"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("rank 1: failing on purpose") && stderr.contains("rank 1 failed first"), "{stderr}");
}

#[test]
fn processes_with_different_configs_are_refused_before_any_work() {
    let port = free_port("127.0.0.1").unwrap().to_string();
    let run = |rank: &str, cfg: &str| {
        harpe_cmd()
            .args(["dist-check", "--config-text", cfg, "--timeout-s", "30"])
            .envs([("RANK", rank), ("WORLD_SIZE", "2"), ("LOCAL_RANK", rank), ("MASTER_ADDR", "127.0.0.1")])
            .envs([("MASTER_PORT", port.as_str()), ("HARPE_RUN_TOKEN", "t")])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let p0 = run("0", "lr = 1e-5");
    let p1 = run("1", "lr = 3e-5");
    let (o0, o1) = (p0.wait_with_output().unwrap(), p1.wait_with_output().unwrap());
    let (e0, e1) = (String::from_utf8_lossy(&o0.stderr), String::from_utf8_lossy(&o1.stderr));
    assert!(!o0.status.success() && !o1.status.success());
    assert!(e0.contains("rank 1 has a different resolved config") && e0.contains("hint:"), "{e0}");
    assert!(e1.contains("rendezvous refused"), "{e1}");
}

/// Two `harpe dist-check` processes with `vars(rank)` and the shared `common` variables; each rank's
/// (success, stdout, stderr).
fn two_by_hand(vars: fn(usize) -> Vec<(&'static str, String)>, common: &[(&str, &str)]) -> Vec<(bool, String, String)> {
    let procs: Vec<_> = (0..2)
        .map(|r| {
            harpe_cmd()
                .args(["dist-check", "--timeout-s", "30"])
                .env_remove("HARPE_RUN_TOKEN")
                .envs(vars(r))
                .envs(common.iter().copied())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    procs
        .into_iter()
        .map(|p| {
            let o = p.wait_with_output().unwrap();
            (o.status.success(), String::from_utf8_lossy(&o.stdout).into(), String::from_utf8_lossy(&o.stderr).into())
        })
        .collect()
}

#[test]
fn ranks_started_by_hand_without_a_token_are_refused_and_a_slurm_job_id_token_is_warned() {
    let port = free_port("127.0.0.1").unwrap().to_string();
    let torch = |r: usize| vec![("RANK", r.to_string()), ("WORLD_SIZE", "2".into()), ("LOCAL_RANK", r.to_string())];
    for (ok, _, err) in two_by_hand(torch, &[("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port.as_str())]) {
        assert!(!ok && err.contains("no run token") && err.contains("hint: export HARPE_RUN_TOKEN="), "{err}");
    }
    let slurm = |r: usize| vec![("SLURM_PROCID", r.to_string()), ("SLURM_LOCALID", r.to_string())];
    let common = [
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "127.0.0.1"),
        ("SLURM_JOB_ID", "4242"),
        ("MASTER_PORT", port.as_str()),
    ];
    let out = two_by_hand(slurm, &common);
    for (r, (ok, stdout, err)) in out.iter().enumerate() {
        assert!(*ok && stdout.contains(&format!("rank {r}/2 (local rank {r}, Slurm) joined 127.0.0.1:")), "{err}");
        let warned = err.contains("warning: the run token is derived from SLURM_JOB_ID");
        assert_eq!(warned, r == 0, "rank 0 warns, once: rank {r}: {err}");
    }
}

fn launched(rank: usize, world: usize) -> Option<LaunchEnv> {
    let (r, w) = (rank.to_string(), world.to_string());
    LaunchEnv::from_map(&env(&[
        ("RANK", &r),
        ("WORLD_SIZE", &w),
        ("LOCAL_RANK", &r),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ]))
    .unwrap()
}

#[test]
fn dist_config_is_reconciled_with_the_launcher_before_any_work() {
    let cfg = |backend, world_size| DistSection { backend, world_size, ..DistSection::default() };
    let placed = |c: DistSection, l| place(&c, "run.toml", l).map(|p| (p.backend, p.world, p.rank));
    let err = |c: DistSection, l| format!("{:#}", place(&c, "run.toml", l).unwrap_err());
    assert_eq!(placed(DistSection::default(), None).unwrap(), (Backend::Single, 1, 0));
    assert_eq!(placed(cfg(Backend::Local, 4), None).unwrap(), (Backend::Local, 4, 0));
    let e = err(cfg(Backend::Local, 0), None);
    assert!(e.contains("run.toml: dist.backend = \"local\" needs dist.world_size >= 1") && e.contains("hint:"), "{e}");
    let e = err(cfg(Backend::Local, 2), launched(1, 2));
    assert!(e.contains("several processes") && e.contains("hint:"), "{e}");
    let e = err(cfg(Backend::Single, 4), None);
    assert!(e.contains("dist.world_size = 4 with dist.backend = \"single\""), "{e}");
    let e = err(cfg(Backend::Single, 0), launched(3, 8));
    assert!(e.contains("started as rank 3 of 8") && e.contains("hint:"), "{e}");
    if cfg!(feature = "nccl") {
        assert_eq!(placed(cfg(Backend::Nccl, 0), launched(3, 8)).unwrap(), (Backend::Nccl, 8, 3));
        let e = err(cfg(Backend::Nccl, 4), launched(3, 8));
        assert!(e.contains("dist.world_size = 4") && e.contains("WORLD_SIZE=8"), "{e}");
    } else {
        let e = err(cfg(Backend::Nccl, 0), launched(3, 8));
        assert!(e.contains("built without NCCL") && e.contains("hint:"), "{e}");
    }
    for (c, want) in [
        (DistSection { bucket_mb: 0.0, ..DistSection::default() }, "dist.bucket_mb = 0 must be a positive size"),
        (DistSection { timeout_s: f64::NAN, ..DistSection::default() }, "dist.timeout_s = NaN must be a positive"),
        (
            DistSection { check_collectives: true, ..DistSection::default() },
            "dist.check_collectives = true with dist.backend = \"single\": one rank has no other rank",
        ),
    ] {
        let e = err(c, None);
        assert!(e.contains(want) && e.contains("hint:"), "{e}");
    }
    // the ZeRO stage is a type: a config naming another number does not parse, with the one message
    let e = toml::from_str::<DistSection>("zero_stage = 4").unwrap_err().to_string();
    assert!(e.contains("dist.zero_stage = 4 is not a ZeRO stage") && e.contains("hint:"), "{e}");
    assert_eq!(DistSection { bucket_mb: 1.0, ..DistSection::default() }.bucket_elems(4), 262_144);
    // 8 micro-batches of 2 over 4 ranks: 2 each; 2 micro-batches of 8 over 4 ranks: one of 4 each;
    // 3 of 4 over 2 ranks: 6 sequences each, in 2 micro-batches of 3
    assert_eq!(rank_batching("run.toml", "stage 0", 8, 2, 4).unwrap(), (2, 2));
    assert_eq!(rank_batching("run.toml", "stage 0", 2, 8, 4).unwrap(), (4, 1));
    assert_eq!(rank_batching("run.toml", "stage 0", 3, 4, 2).unwrap(), (3, 2));
    let e = format!("{:#}", rank_batching("run.toml", "stage 1", 3, 2, 4).unwrap_err());
    assert!(
        e.contains("stage 1: 6 sequences per optimizer step cannot be split evenly over 4") && e.contains("hint:"),
        "{e}"
    );
}

#[test]
fn nproc_per_node_inside_an_already_launched_rank_is_refused() {
    let out = harpe_cmd()
        .args(["dist-check", "--nproc-per-node", "2"])
        .envs([("RANK", "0"), ("WORLD_SIZE", "1")])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("already rank 0 of a launched run") && stderr.contains("hint:"), "{stderr}");
}

/// `world` processes in one group under the failure watch (`dist-check --work-s S`), started by hand so
/// that no launcher stops them: `extra` makes one rank fail or vanish; returns each rank's (success,
/// stdout, stderr) and how long the slowest took.
fn watched_group(world: usize, work_s: &str, extra: &[&str]) -> (Vec<(bool, String, String)>, Duration) {
    let port = free_port("127.0.0.1").unwrap().to_string();
    let w = world.to_string();
    let t0 = Instant::now();
    let procs: Vec<_> = (0..world)
        .map(|r| {
            let r = r.to_string();
            harpe_cmd()
                .args(["dist-check", "--timeout-s", "30", "--work-s", work_s])
                .args(extra)
                .envs([("RANK", r.as_str()), ("WORLD_SIZE", w.as_str()), ("LOCAL_RANK", r.as_str())])
                .envs([("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port.as_str()), ("HARPE_RUN_TOKEN", "w")])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let out = procs
        .into_iter()
        .map(|p| {
            let o = p.wait_with_output().unwrap();
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            (o.status.success(), text(&o.stdout), text(&o.stderr))
        })
        .collect();
    (out, t0.elapsed())
}

#[test]
fn a_rank_that_fails_or_is_killed_mid_run_stops_every_other_rank_naming_it() {
    // an error: rank 2 reports it; ranks 0 and 1 stop within seconds (the run would last 30 s)
    let (out, took) = watched_group(3, "30", &["--fail-after-rank", "2"]);
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert!(!out[2].0 && out[2].2.contains("failing on purpose"), "{}", out[2].2);
    for (ok, _, err) in &out[..2] {
        assert!(!ok && err.contains("rank 2 failed in step") && err.contains("failing on purpose"), "{err}");
    }
    // SIGKILL: rank 1 says nothing; its closed connection names it, with its last step
    let (out, took) = watched_group(3, "30", &["--kill-rank", "1"]);
    assert!(took < Duration::from_secs(20), "took {took:?}");
    for r in [0, 2] {
        let (ok, _, err) = &out[r];
        assert!(!ok && err.contains("rank 1 failed while in step") && err.contains("its process is gone"), "{err}");
    }
    // rank 0 killed: the others learn that rank 0 is gone
    let (out, _) = watched_group(3, "30", &["--kill-rank", "0"]);
    for (ok, _, err) in &out[1..] {
        assert!(!ok && err.contains("rank 0 failed") && err.contains("its process is gone"), "{err}");
    }
}

#[test]
fn a_watched_group_that_ends_normally_reports_no_failure() {
    let (out, _) = watched_group(2, "1", &[]);
    for (ok, stdout, stderr) in out {
        assert!(ok && stdout.contains("no rank failed"), "{stdout}\n{stderr}");
    }
}
