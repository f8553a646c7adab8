//! The launcher that starts the processes of a multi-process run (`--nproc-per-node N`), the `[dist]`
//! checks against the launcher's environment, and `harpe dist-check`.
//!
//! Reference: torchrun's worker contract (the variables it sets; `env.rs` reads them). The non-obvious decision: the spawner puts workers in their own process group, so a
//! terminal's Ctrl-C reaches them exactly once (forwarded by the launcher) — two SIGINTs would make
//! `train` skip its graceful stop — and on Linux each worker gets SIGTERM if the launcher dies.
//!
//! Several nodes: the same command on each node with torchrun's flags (`--nnodes`, `--node-rank`,
//! `--master-addr`, `--master-port`); node R starts ranks R·N..R·N+N-1, node 0 holds rank 0, and every
//! node must export the same `HARPE_RUN_TOKEN` (a token drawn per node would differ).
//!
//! What it does not do: elastic restarts (use torchrun or srun), GPU selection (the worker maps `LOCAL_RANK` to a device), or any collective (see
//! `rendezvous.rs`).
use crate::config::{Backend, DistSection};
use crate::launch::env::{free_port, LaunchEnv, TOKEN_VAR};
use anyhow::{bail, Context, Result};
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where this process sits once `[dist]` and the launcher environment are reconciled.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    /// The backend to build.
    pub backend: Backend,
    /// Ranks in total.
    pub world: usize,
    /// This process's rank (`local`: 0, the process runs every rank as a thread).
    pub rank: usize,
    /// The launcher's variables, when a launcher started this process.
    pub launch: Option<LaunchEnv>,
}

/// Reconcile `[dist]` with the launcher's environment (`LaunchEnv::from_env()`), before any work.
pub fn place(dist: &DistSection, origin: &str, launch: Option<LaunchEnv>) -> Result<Placement> {
    dist.check_keys(origin)?;
    let launched_many = launch.as_ref().is_some_and(|l| l.world_size > 1);
    let (world, rank) = match dist.backend {
        Backend::Single => {
            if dist.world_size > 1 {
                bail!(
                    "{origin}: dist.world_size = {} with dist.backend = \"single\"\nhint: use dist.backend = \
                     \"local\" (ranks as threads) or \"nccl\" (one process per GPU)",
                    dist.world_size
                );
            }
            if let Some(l) = launch.as_ref().filter(|_| launched_many) {
                bail!(
                    "{origin}: this process was started as rank {} of {} ({:?} environment), but dist.backend = \
                     \"single\"\nhint: set dist.backend = \"nccl\" for multi-process runs",
                    l.rank,
                    l.world_size,
                    l.source
                );
            }
            (1, 0)
        }
        Backend::Local => {
            if launched_many {
                bail!(
                    "{origin}: dist.backend = \"local\" runs every rank as a thread of one process, but a \
                     launcher started several processes\nhint: run one process with dist.backend = \"local\", \
                     or use dist.backend = \"nccl\" under the launcher"
                );
            }
            (dist.world_size, 0)
        }
        b @ (Backend::Nccl | Backend::Gloo) => {
            if b == Backend::Nccl && !cfg!(feature = "nccl") {
                bail!(
                    "{origin}: dist.backend = \"nccl\", but this harpe was built without NCCL\nhint: build with \
                     --features nccl (README \"Build for GPUs\"), or use dist.backend = \"local\" on CPU"
                );
            }
            if b == Backend::Gloo && !cfg!(feature = "gloo") {
                bail!(
                    "{origin}: dist.backend = \"gloo\", but this harpe was built without Gloo\nhint: apt-get install \
                     libgloo-dev, then build with --features gloo; or use dist.backend = \"local\" (ranks as threads)"
                );
            }
            match &launch {
                Some(l) => {
                    if dist.world_size != 0 {
                        l.check_world_size(dist.world_size)?;
                    }
                    (l.world_size, l.rank)
                }
                None if dist.world_size > 1 => bail!(
                    "{origin}: dist.world_size = {} with dist.backend = \"{}\", but no launcher started this \
                     process\nhint: harpe train --nproc-per-node {} ..., or torchrun / srun",
                    dist.world_size,
                    b.name(),
                    dist.world_size
                ),
                None => (1, 0),
            }
        }
    };
    Ok(Placement { backend: dist.backend, world, rank, launch })
}

/// The launcher's own flags, which workers must not see.
const LAUNCHER_FLAGS: [&str; 5] = ["--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port"];

/// Drop the launcher's flags (`--nproc-per-node N`, `--nnodes N`, ..., or `--flag=value`) from a command
/// line (what workers must not see).
pub fn strip_nproc_flag(args: &[OsString]) -> Vec<OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut skip = false;
    for a in args {
        if skip {
            skip = false;
            continue;
        }
        match a.to_str() {
            Some(s) if LAUNCHER_FLAGS.contains(&s) => skip = true,
            Some(s) if LAUNCHER_FLAGS.iter().any(|f| s.strip_prefix(f).is_some_and(|v| v.starts_with('='))) => {}
            _ => out.push(a.clone()),
        }
    }
    out
}

/// harpe's launcher across nodes, with torchrun's flags: the same command on every node, each with its
/// own `--node-rank`.
#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
pub struct NodeArgs {
    /// with --nproc-per-node: nodes in the run; start the same command on each node with its own
    /// --node-rank and the same HARPE_RUN_TOKEN exported
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub nnodes: usize,
    /// with --nnodes: this node's index, 0..N-1 (node 0 runs rank 0)
    #[arg(long, value_name = "R", default_value_t = 0)]
    pub node_rank: usize,
    /// with --nproc-per-node: rank 0's host, a name or address that every node (node 0 too) resolves to
    /// an address the other nodes reach [default: 127.0.0.1 on one node]
    #[arg(long, value_name = "HOST")]
    pub master_addr: Option<String>,
    /// with --nproc-per-node: rank 0's rendezvous port, free on node 0 [default: a free port on one node,
    /// 29500 across nodes]
    #[arg(long, value_name = "PORT")]
    pub master_port: Option<u16>,
}

impl Default for NodeArgs {
    fn default() -> Self {
        NodeArgs { nnodes: 1, node_rank: 0, master_addr: None, master_port: None }
    }
}

impl NodeArgs {
    /// The spawner's options for these flags, checked (`nproc`: the workers per node).
    fn spawn_options(&self, nproc: usize) -> Result<SpawnOptions> {
        let NodeArgs { nnodes, node_rank, .. } = *self;
        let mut opts = SpawnOptions { nnodes, node_rank, ..SpawnOptions::default() };
        if nnodes == 0 || node_rank >= nnodes {
            bail!("--nnodes {nnodes} --node-rank {node_rank}: node ranks are 0..nnodes-1\nhint: --node-rank 0 on the node that runs rank 0, 1 on the next, ...");
        }
        if nnodes == 1 {
            opts.master_addr = self.master_addr.clone().unwrap_or(opts.master_addr);
            opts.master_port = self.master_port;
            return Ok(opts);
        }
        let Some(addr) = &self.master_addr else {
            bail!("--nnodes {nnodes} needs --master-addr: node 0's host name or address, as every node reaches it\nhint: e.g. --master-addr node01 (the same on every node)");
        };
        let token = std::env::var(TOKEN_VAR).ok().filter(|t| !t.is_empty());
        let Some(token) = token else {
            bail!("--nnodes {nnodes}: the {} workers of all nodes must present one run token, and a token drawn on each node would differ\nhint: export {TOKEN_VAR}=$(openssl rand -hex 16) with the same value on every node first", nnodes * nproc);
        };
        (opts.master_addr, opts.master_port, opts.token) =
            (addr.clone(), Some(self.master_port.unwrap_or(29500)), Some(token));
        Ok(opts)
    }

    /// True when any flag differs from its default (they need --nproc-per-node).
    fn given(&self) -> bool {
        *self != NodeArgs::default()
    }
}

/// `--nproc-per-node N`: when `nproc` is given, start N workers (on this node of `nodes`) running this
/// process's command line without the launcher's flags and return how they ended (the caller exits with
/// `exit_code()`); `None` when there is nothing to spawn and this process should do the work itself.
pub fn launch_if_asked(nproc: Option<usize>, nodes: &NodeArgs) -> Result<Option<WorkersOutcome>> {
    let Some(n) = nproc else {
        if nodes.given() {
            bail!("--nnodes, --node-rank, --master-addr and --master-port describe harpe's own launcher\nhint: add --nproc-per-node N (workers per node); under torchrun or srun give these to the launcher instead");
        }
        return Ok(None);
    };
    if let Ok(r) = std::env::var("RANK") {
        bail!(
            "--nproc-per-node {n}, but this process is already rank {r} of a launched run (RANK is set)\nhint: drop \
             --nproc-per-node under torchrun/srun, or unset RANK and WORLD_SIZE to let harpe start the workers"
        );
    }
    let opts = nodes.spawn_options(n)?;
    let args = strip_nproc_flag(&std::env::args_os().skip(1).collect::<Vec<_>>());
    spawn_workers(n, &args, &opts).map(Some)
}

/// How the spawner starts workers.
#[derive(Clone, Debug)]
pub struct SpawnOptions {
    /// Binary to run (default: this executable).
    pub program: Option<PathBuf>,
    /// `MASTER_ADDR` for the workers (rank 0 binds it).
    pub master_addr: String,
    /// `MASTER_PORT`; `None` picks a free one.
    pub master_port: Option<u16>,
    /// After the first failure (or a forwarded signal), how long the others get before SIGKILL.
    pub grace: Duration,
    /// Nodes in the run (each runs its own spawner) and this node's index.
    pub nnodes: usize,
    /// This node's index: its workers are ranks `node_rank * n ..`.
    pub node_rank: usize,
    /// The run token of every node (`None`: one drawn here, for a run of one node).
    pub token: Option<String>,
}

impl Default for SpawnOptions {
    fn default() -> Self {
        SpawnOptions {
            program: None,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            grace: Duration::from_secs(30),
            nnodes: 1,
            node_rank: 0,
            token: None,
        }
    }
}

/// How the workers ended.
#[derive(Debug)]
pub struct WorkersOutcome {
    /// Exit status of each rank.
    pub statuses: Vec<ExitStatus>,
    /// The rank whose failure was seen first, if any failed.
    pub first_failure: Option<usize>,
    /// The signal forwarded to the workers, if the launcher received one.
    pub forwarded_signal: Option<i32>,
}

impl WorkersOutcome {
    /// True when every rank exited with status 0.
    pub fn success(&self) -> bool {
        self.statuses.iter().all(ExitStatus::success)
    }

    /// The launcher's exit code: 0, else the first failed rank's code (128 + signal when killed).
    pub fn exit_code(&self) -> i32 {
        match self.first_failure {
            None => 0,
            Some(r) => code_of(&self.statuses[r]),
        }
    }
}

fn code_of(s: &ExitStatus) -> i32 {
    if let Some(c) = s.code() {
        return c;
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = s.signal() {
            return 128 + sig;
        }
    }
    1
}

#[cfg(unix)]
fn send_signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) with a pid we spawned and have not reaped yet (we only signal children whose
    // try_wait returned None), so the pid cannot have been reused.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
}

#[cfg(not(unix))]
fn send_signal(child: &Child, _sig: i32) {
    let _ = child;
}

#[cfg(unix)]
fn configure(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // Own process group: the terminal's Ctrl-C reaches only the launcher, which forwards it once.
    cmd.process_group(0);
    #[cfg(target_os = "linux")]
    {
        // SAFETY: prctl and getppid are async-signal-safe; the closure allocates nothing.
        let parent = std::process::id() as libc::pid_t;
        unsafe {
            cmd.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                if libc::getppid() != parent {
                    libc::raise(libc::SIGTERM);
                }
                Ok(())
            });
        }
    }
}

#[cfg(not(unix))]
fn configure(_cmd: &mut Command) {}

/// Start `n` copies of the program with `args` and the torchrun-style variables (`RANK`,
/// `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `HARPE_RUN_TOKEN`),
/// forward SIGINT/SIGTERM to them, and wait. When a rank fails, print that it failed first and stop
/// the others (SIGTERM, then SIGKILL after `opts.grace`).
pub fn spawn_workers(n: usize, args: &[OsString], opts: &SpawnOptions) -> Result<WorkersOutcome> {
    if n == 0 {
        bail!("--nproc-per-node 0: nothing to start\nhint: give the number of processes (GPUs) on this node");
    }
    let program = match &opts.program {
        Some(p) => p.clone(),
        None => std::env::current_exe().context("finding this executable to start the workers")?,
    };
    let port = match opts.master_port {
        Some(p) => p,
        None => free_port(&opts.master_addr)?,
    };
    let token = opts.token.clone().unwrap_or_else(|| format!("{:032x}", rand::random::<u128>()));
    let pending = Arc::new(AtomicUsize::new(0));
    let mut sig_ids = Vec::new();
    #[cfg(unix)]
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        sig_ids.push(signal_hook::flag::register_usize(sig, Arc::clone(&pending), sig as usize)?);
    }
    let res = start_ranks(n, &program, args, opts, port, &token).and_then(|mut children| {
        let first = opts.node_rank * n;
        eprintln!(
            "harpe: started {n} workers (ranks {first}..{}), rendezvous at {}:{port}",
            first + n - 1,
            opts.master_addr
        );
        supervise(&mut children, opts, &pending)
    });
    for id in sig_ids {
        signal_hook::low_level::unregister(id);
    }
    res
}

/// Start ranks 0..n with torchrun's variables; on a failed start, kill those already started.
fn start_ranks(
    n: usize,
    program: &PathBuf,
    args: &[OsString],
    opts: &SpawnOptions,
    port: u16,
    token: &str,
) -> Result<Vec<Child>> {
    let mut children: Vec<Child> = Vec::with_capacity(n);
    for local in 0..n {
        let rank = opts.node_rank * n + local;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", (opts.nnodes * n).to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("GROUP_RANK", opts.node_rank.to_string())
            .env("MASTER_ADDR", &opts.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env(TOKEN_VAR, token);
        configure(&mut cmd);
        match cmd.spawn() {
            Ok(c) => children.push(c),
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                bail!(
                    "could not start rank {rank} ({}): {e}\nhint: check that the binary exists and is executable",
                    program.display()
                );
            }
        }
    }
    Ok(children)
}

/// Wait for every worker: forward a signal the launcher receives, stop the others when one fails, and
/// kill those that outlive the grace period.
fn supervise(children: &mut [Child], opts: &SpawnOptions, pending: &AtomicUsize) -> Result<WorkersOutcome> {
    let n = children.len();
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; n];
    let mut first_failure = None;
    let mut forwarded_signal = None;
    let mut kill_at: Option<Instant> = None;
    while statuses.iter().any(Option::is_none) {
        let sig = pending.swap(0, Ordering::Relaxed);
        if sig != 0 {
            forwarded_signal = Some(sig as i32);
            eprintln!("harpe: forwarding signal {sig} to the workers");
            for (c, s) in children.iter().zip(&statuses) {
                if s.is_none() {
                    send_signal(c, sig as i32);
                }
            }
            kill_at.get_or_insert(Instant::now() + opts.grace);
        }
        for rank in 0..n {
            if statuses[rank].is_some() {
                continue;
            }
            let Some(st) = children[rank].try_wait().with_context(|| format!("waiting for rank {rank}"))? else {
                continue;
            };
            statuses[rank] = Some(st);
            if !st.success() && first_failure.is_none() {
                first_failure = Some(rank);
                eprintln!("harpe: rank {rank} failed first ({st}); stopping the other ranks");
                for (c, s) in children.iter().zip(&statuses) {
                    if s.is_none() {
                        send_signal(c, libc_sigterm());
                    }
                }
                kill_at.get_or_insert(Instant::now() + opts.grace);
            }
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            for (rank, (c, s)) in children.iter_mut().zip(&statuses).enumerate() {
                if s.is_none() {
                    eprintln!("harpe: rank {rank} did not stop within {:.0}s; killing it", opts.grace.as_secs_f64());
                    let _ = c.kill();
                }
            }
            kill_at = None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let statuses: Vec<ExitStatus> = statuses.into_iter().flatten().collect();
    if first_failure.is_some() {
        let all: Vec<String> = statuses.iter().enumerate().map(|(r, s)| format!("rank {r}: {s}")).collect();
        eprintln!("harpe: worker exit statuses: {}", all.join("; "));
    }
    Ok(WorkersOutcome { statuses, first_failure, forwarded_signal })
}

fn libc_sigterm() -> i32 {
    #[cfg(unix)]
    {
        libc::SIGTERM
    }
    #[cfg(not(unix))]
    {
        15
    }
}

/// `harpe dist-check`: start (or join) a multi-process group, rendezvous, share a payload, barrier.
/// A smoke test for a cluster's launcher settings before a long run, and the tests' two-process probe.
#[derive(clap::Args, Debug, Clone)]
pub struct DistCheckArgs {
    /// start N local worker processes that each run this check (as `harpe train --nproc-per-node N`)
    #[arg(long, value_name = "N")]
    pub nproc_per_node: Option<usize>,
    /// several nodes under harpe's own launcher (as `harpe train`)
    #[command(flatten)]
    pub nodes: NodeArgs,
    /// text standing in for the resolved config: its hash must agree on every rank
    #[arg(long, value_name = "TEXT", default_value = "")]
    pub config_text: String,
    /// rendezvous and barrier timeout in seconds
    #[arg(long, value_name = "S", default_value_t = 60.0)]
    pub timeout_s: f64,
    /// make this rank exit with an error before the rendezvous (to see the failure report)
    #[arg(long, value_name = "RANK")]
    pub fail_rank: Option<usize>,
    /// after the rendezvous, stay in the group this long, watched as a training run is (a failure of
    /// any rank stops every rank, naming it)
    #[arg(long, value_name = "S", default_value_t = 0.0)]
    pub work_s: f64,
    /// make this rank report a failure half a second into --work-s (the others must stop naming it)
    #[arg(long, value_name = "RANK")]
    pub fail_after_rank: Option<usize>,
    /// make this rank kill itself (SIGKILL, no goodbye) half a second into --work-s
    #[arg(long, value_name = "RANK")]
    pub kill_rank: Option<usize>,
}

/// `--work-s`: keep the group under the failure watch (`launch::watch`) for that long, as a training run
/// does; the test hooks make one rank fail or vanish half a second in.
fn watched_work(rv: crate::launch::rendezvous::Rendezvous, a: &DistCheckArgs, rank: usize) -> Result<()> {
    use crate::launch::watch::Watch;
    let watch = Watch::start(rv, Box::new(|_| {}))?;
    let t0 = Instant::now();
    let mut step = 0u64;
    while t0.elapsed().as_secs_f64() < a.work_s {
        step += 1;
        watch.progress(&format!("in step {step}"));
        if let Some(f) = watch.wait_failure(Duration::from_millis(100)) {
            bail!("rank {rank}: stopping: {f}\nhint: the rank named failed first; its own log says more");
        }
        if t0.elapsed() >= Duration::from_millis(500) {
            if a.fail_after_rank == Some(rank) {
                watch.report(&format!("in step {step}"), "failing on purpose (--fail-after-rank)");
                bail!("rank {rank}: failing on purpose in step {step} (--fail-after-rank)");
            }
            if a.kill_rank == Some(rank) {
                #[cfg(unix)]
                // SAFETY: raise(2) on this process.
                unsafe {
                    libc::raise(libc::SIGKILL);
                }
            }
        }
    }
    watch.finish();
    Ok(())
}

/// Run `harpe dist-check`.
pub fn run_check(a: DistCheckArgs) -> Result<()> {
    use crate::launch::rendezvous::{rendezvous, RendezvousSpec};
    use sha2::{Digest, Sha256};
    if let Some(out) = launch_if_asked(a.nproc_per_node, &a.nodes)? {
        let n = out.statuses.len();
        if let Some(r) = out.first_failure {
            bail!("rank {r} failed first ({}); see its message above\nhint: run with the same flags in one process to debug it", out.statuses[r]);
        }
        println!("dist-check: all {n} ranks passed");
        return Ok(());
    }
    if !(a.timeout_s > 0.0 && a.timeout_s.is_finite()) {
        bail!("--timeout-s {} is not a positive number of seconds\nhint: e.g. --timeout-s 60", a.timeout_s);
    }
    let Some(env) = LaunchEnv::from_env()? else {
        println!(
            "dist-check: single process (no RANK/WORLD_SIZE or SLURM_PROCID in the environment); nothing to check"
        );
        return Ok(());
    };
    if a.fail_rank == Some(env.rank) {
        bail!("rank {}: failing on purpose (--fail-rank {})\nhint: drop --fail-rank", env.rank, env.rank);
    }
    let spec = RendezvousSpec::from_launch(&env, &a.config_text, Duration::from_secs_f64(a.timeout_s));
    let mut rv = rendezvous(&spec, || (0..128).map(|_| rand::random::<u8>()).collect())?;
    rv.barrier("dist-check")?;
    let digest = hex::encode(&Sha256::digest(rv.payload())[..8]);
    if a.work_s > 0.0 {
        watched_work(rv, &a, env.rank)?;
        println!(
            "dist-check: rank {}/{} stayed {:.1}s in the group; no rank failed",
            env.rank, env.world_size, a.work_s
        );
        return Ok(());
    }
    println!(
        "dist-check: rank {}/{} (local rank {}, {}) joined {}; payload {} bytes, sha256 {digest}",
        env.rank,
        env.world_size,
        env.local_rank,
        env.source.label(),
        rv.rank0_addr(),
        rv.payload().len()
    );
    Ok(())
}
