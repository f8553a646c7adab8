//! Who am I in a multi-process run, and the launcher that starts the processes.
//!
//! Reference: DESIGN.md §6; torchrun's environment contract (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_RUN_ID`) and Slurm's task
//! variables (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_JOB_NODELIST` in Slurm's
//! hostlist syntax, e.g. `node[01-03,07],gpu5`).
//!
//! The non-obvious decisions: (1) torchrun-style variables win over Slurm's, because `srun torchrun`
//! sets both and then `RANK` is the true global rank while `SLURM_PROCID` numbers the per-node
//! torchrun agents; (2) under Slurm without `MASTER_PORT` the port is `20000 + SLURM_JOB_ID % 10000`,
//! the same on every task of a job, different between most jobs sharing a node, and below Linux's
//! ephemeral range; (3) the spawner puts workers in their own process group, so a terminal's Ctrl-C
//! reaches them exactly once (forwarded by the launcher) — two SIGINTs would make `train` skip its
//! graceful stop — and on Linux each worker gets SIGTERM if the launcher dies.
//!
//! What it does not do: elastic restarts or multi-node spawning (use the cluster's launcher), GPU
//! selection (the worker maps `LOCAL_RANK` to a device), or any collective (see `rendezvous.rs`).
use crate::config::{Backend, DistSection};
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which launcher's variables described this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchSource {
    /// `RANK` / `WORLD_SIZE` / ... (torchrun, or `harpe ... --nproc-per-node N`).
    Torchrun,
    /// `SLURM_PROCID` / `SLURM_NTASKS` / ... (`srun harpe ...`).
    Slurm,
}

/// This process's place in a multi-process run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Which variables it came from.
    pub source: LaunchSource,
    /// Global rank, 0-based.
    pub rank: usize,
    /// Number of processes in the run.
    pub world_size: usize,
    /// Rank on this node (the GPU index).
    pub local_rank: usize,
    /// Processes on this node, when the launcher says.
    pub local_world_size: Option<usize>,
    /// Host of rank 0's rendezvous.
    pub master_addr: String,
    /// Port of rank 0's rendezvous.
    pub master_port: u16,
    /// Per-run token every rank must present at the rendezvous ("" when the launcher gives none).
    pub run_token: String,
}

/// Variable holding the per-run rendezvous token (set by the spawner; may be set by hand).
pub const TOKEN_VAR: &str = "HARPE_RUN_TOKEN";

fn get<'a>(env: &'a BTreeMap<String, String>, k: &str) -> Option<&'a str> {
    env.get(k).map(|s| s.trim()).filter(|s| !s.is_empty())
}

fn num(env: &BTreeMap<String, String>, k: &str, hint: &str) -> Result<Option<usize>> {
    match get(env, k) {
        None => Ok(None),
        Some(v) => match v.parse::<usize>() {
            Ok(n) => Ok(Some(n)),
            Err(_) => bail!("environment variable {k}={v:?} is not a non-negative integer\nhint: {hint}"),
        },
    }
}

fn need(env: &BTreeMap<String, String>, k: &str, why: &str, hint: &str) -> Result<usize> {
    match num(env, k, hint)? {
        Some(n) => Ok(n),
        None => bail!("environment variable {k} is not set, but {why}\nhint: {hint}"),
    }
}

fn port(env: &BTreeMap<String, String>, k: &str) -> Result<Option<u16>> {
    let hint = "MASTER_PORT is a TCP port in 1..=65535 that is free on rank 0's host";
    match num(env, k, hint)? {
        None => Ok(None),
        Some(p) if (1..=65535).contains(&p) => Ok(Some(p as u16)),
        Some(p) => bail!("environment variable {k}={p} is not a TCP port\nhint: {hint}"),
    }
}

impl LaunchEnv {
    /// Read the launcher's variables from this process's environment (`None`: not launched as one
    /// rank of several; run as a single process).
    pub fn from_env() -> Result<Option<LaunchEnv>> {
        let env: BTreeMap<String, String> = std::env::vars().collect();
        Self::from_map(&env)
    }

    /// Same as `from_env`, from an explicit variable map.
    pub fn from_map(env: &BTreeMap<String, String>) -> Result<Option<LaunchEnv>> {
        let e = if get(env, "RANK").is_some() || get(env, "WORLD_SIZE").is_some() {
            Self::torchrun(env)?
        } else if get(env, "SLURM_PROCID").is_some() {
            Self::slurm(env)?
        } else {
            return Ok(None);
        };
        e.validate()?;
        Ok(Some(e))
    }

    fn torchrun(env: &BTreeMap<String, String>) -> Result<LaunchEnv> {
        let hint = "torchrun and `harpe train --nproc-per-node N` set RANK, WORLD_SIZE, LOCAL_RANK, \
                    MASTER_ADDR and MASTER_PORT together; set all of them or none";
        let rank = need(env, "RANK", "WORLD_SIZE is", hint)?;
        let world_size = need(env, "WORLD_SIZE", "RANK is", hint)?;
        let local_world_size = num(env, "LOCAL_WORLD_SIZE", hint)?;
        let local_rank = match num(env, "LOCAL_RANK", hint)? {
            Some(l) => l,
            None if world_size == 1 => 0,
            None => bail!(
                "environment variable LOCAL_RANK is not set, but RANK={rank} and WORLD_SIZE={world_size} are\n\
                 hint: LOCAL_RANK picks this process's GPU on its node; {hint}"
            ),
        };
        let (master_addr, master_port) = if world_size == 1 {
            (get(env, "MASTER_ADDR").unwrap_or("127.0.0.1").to_string(), port(env, "MASTER_PORT")?.unwrap_or(29500))
        } else {
            let addr = get(env, "MASTER_ADDR").map(str::to_string);
            let p = port(env, "MASTER_PORT")?;
            match (addr, p) {
                (Some(a), Some(p)) => (a, p),
                (None, _) => bail!("environment variable MASTER_ADDR is not set, but WORLD_SIZE={world_size}\nhint: set MASTER_ADDR to rank 0's host name or address; {hint}"),
                (_, None) => bail!("environment variable MASTER_PORT is not set, but WORLD_SIZE={world_size}\nhint: set MASTER_PORT to a free TCP port on rank 0's host; {hint}"),
            }
        };
        let run_token = get(env, TOKEN_VAR).or(get(env, "TORCHELASTIC_RUN_ID")).unwrap_or("").to_string();
        Ok(LaunchEnv {
            source: LaunchSource::Torchrun,
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            run_token,
        })
    }

    fn slurm(env: &BTreeMap<String, String>) -> Result<LaunchEnv> {
        let hint = "srun sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_JOB_NODELIST for each task; \
                    launch harpe with srun (one task per GPU), not from inside a plain sbatch script";
        let rank = need(env, "SLURM_PROCID", "SLURM_PROCID is", hint)?;
        let world_size = match num(env, "SLURM_NTASKS", hint)? {
            Some(n) => n,
            None => need(env, "SLURM_NPROCS", "SLURM_PROCID is set", hint)?,
        };
        let local_rank = need(env, "SLURM_LOCALID", "SLURM_PROCID is set", hint)?;
        // SLURM_NTASKS_PER_NODE is a plain number only when --ntasks-per-node was given.
        let local_world_size = get(env, "SLURM_NTASKS_PER_NODE").and_then(|v| v.parse::<usize>().ok());
        let master_addr = match get(env, "MASTER_ADDR") {
            Some(a) => a.to_string(),
            None => {
                let (var, list) = match get(env, "SLURM_JOB_NODELIST") {
                    Some(l) => ("SLURM_JOB_NODELIST", l),
                    None => match get(env, "SLURM_NODELIST") {
                        Some(l) => ("SLURM_NODELIST", l),
                        None => bail!(
                            "neither MASTER_ADDR nor SLURM_JOB_NODELIST is set for Slurm task {rank}\nhint: {hint}, \
                             or export MASTER_ADDR=<rank 0's host>"
                        ),
                    },
                };
                first_host(list).with_context(|| format!("environment variable {var}={list:?}"))?
            }
        };
        let master_port = match port(env, "MASTER_PORT")? {
            Some(p) => p,
            None => {
                let job = need(env, "SLURM_JOB_ID", "MASTER_PORT is not set either", "export MASTER_PORT=<free port>")?;
                20000 + (job % 10000) as u16
            }
        };
        let run_token = match get(env, TOKEN_VAR) {
            Some(t) => t.to_string(),
            None => match get(env, "SLURM_JOB_ID") {
                Some(j) => format!("slurm-{j}.{}", get(env, "SLURM_STEP_ID").unwrap_or("0")),
                None => String::new(),
            },
        };
        Ok(LaunchEnv {
            source: LaunchSource::Slurm,
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            run_token,
        })
    }

    fn validate(&self) -> Result<()> {
        let (rv, wv, lv, lwv) = match self.source {
            LaunchSource::Torchrun => ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
            LaunchSource::Slurm => ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
        };
        if self.world_size == 0 {
            bail!("{wv}=0: a run needs at least one process\nhint: set {wv} to the number of processes");
        }
        if self.rank >= self.world_size {
            bail!(
                "{rv}={} is not below {wv}={}\nhint: ranks are 0-based: 0..{}",
                self.rank,
                self.world_size,
                self.world_size - 1
            );
        }
        if let Some(lw) = self.local_world_size {
            if lw == 0 || lw > self.world_size {
                bail!(
                    "{lwv}={lw} with {wv}={}\nhint: processes on one node are between 1 and the world size",
                    self.world_size
                );
            }
            if self.local_rank >= lw {
                bail!("{lv}={} is not below {lwv}={lw}\nhint: local ranks are 0-based per node", self.local_rank);
            }
        }
        if self.local_rank >= self.world_size {
            bail!(
                "{lv}={} is not below {wv}={}\nhint: the local rank counts processes on one node",
                self.local_rank,
                self.world_size
            );
        }
        Ok(())
    }

    /// Refuse a launcher world size that differs from `dist.world_size` in the config.
    pub fn check_world_size(&self, configured: usize) -> Result<()> {
        if configured != self.world_size {
            let var = match self.source {
                LaunchSource::Torchrun => "WORLD_SIZE",
                LaunchSource::Slurm => "SLURM_NTASKS",
            };
            bail!(
                "dist.world_size = {configured}, but the launcher started {} processes ({var}={})\n\
                 hint: set dist.world_size to the number of processes (or leave it at 0 to take it from the launcher)",
                self.world_size,
                self.world_size
            );
        }
        Ok(())
    }
}

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
        Backend::Nccl => {
            if !cfg!(feature = "nccl") {
                bail!(
                    "{origin}: dist.backend = \"nccl\", but this harpe was built without NCCL\nhint: build with \
                     --features nccl (README \"Build for GPUs\"), or use dist.backend = \"local\" on CPU"
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
                    "{origin}: dist.world_size = {} with dist.backend = \"nccl\", but no launcher started this \
                     process\nhint: harpe train --nproc-per-node {} ..., or torchrun / srun",
                    dist.world_size,
                    dist.world_size
                ),
                None => (1, 0),
            }
        }
    };
    Ok(Placement { backend: dist.backend, world, rank, launch })
}

/// Expand a Slurm hostlist (`node[01-03,07],gpu5`, `r[1-2]-n[1-2]`) into host names, in order.
pub fn expand_nodelist(list: &str) -> Result<Vec<String>> {
    let hint = "a Slurm hostlist is comma-separated names with optional [a-b,c] ranges, e.g. node[01-03,07],gpu5";
    let mut items = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, ch) in list.char_indices() {
        match ch {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            bail!("hostlist {list:?}: unbalanced or nested brackets\nhint: {hint}");
        }
    }
    if depth != 0 {
        bail!("hostlist {list:?}: unbalanced brackets\nhint: {hint}");
    }
    items.push(&list[start..]);
    let mut hosts = Vec::new();
    for item in items {
        let item = item.trim();
        if item.is_empty() {
            bail!("hostlist {list:?}: empty host name\nhint: {hint}");
        }
        expand_item(item, &mut hosts).map_err(|e| e.context(format!("hostlist {list:?}")))?;
        if hosts.len() > 1_000_000 {
            bail!("hostlist {list:?} expands to over a million hosts\nhint: {hint}");
        }
    }
    Ok(hosts)
}

/// Expand one item (no top-level commas): the first bracket group times the rest, recursively.
fn expand_item(item: &str, out: &mut Vec<String>) -> Result<()> {
    let hint = "ranges look like [01-03,07]: digits, '-' and ','";
    let Some(open) = item.find('[') else {
        out.push(item.to_string());
        return Ok(());
    };
    let close = match item[open..].find(']') {
        Some(c) => open + c,
        None => bail!("{item:?}: '[' without ']'\nhint: {hint}"),
    };
    let (prefix, ranges, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    let mut tails = Vec::new();
    expand_item(rest, &mut tails)?;
    for part in ranges.split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let bad = |s: &str| s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit());
        if bad(a) || bad(b) {
            bail!("{item:?}: bad range {part:?}\nhint: {hint}");
        }
        let (lo, hi): (u64, u64) = (a.parse()?, b.parse()?);
        if hi < lo || hi - lo > 1_000_000 {
            bail!("{item:?}: range {part:?} is empty or too large\nhint: {hint}");
        }
        for n in lo..=hi {
            for t in &tails {
                out.push(format!("{prefix}{n:0width$}{t}", width = a.len()));
            }
        }
    }
    Ok(())
}

/// The first host of a Slurm hostlist (where rank 0 runs under `srun`).
pub fn first_host(list: &str) -> Result<String> {
    let hosts = expand_nodelist(list)?;
    hosts.into_iter().next().context("empty hostlist\nhint: SLURM_JOB_NODELIST names the job's nodes")
}

/// A TCP port that was free on `addr` a moment ago (bind port 0, read it, release it).
pub fn free_port(addr: &str) -> Result<u16> {
    let l = TcpListener::bind((addr, 0))
        .with_context(|| format!("binding {addr}:0 to find a free port\nhint: is {addr} an address of this host?"))?;
    Ok(l.local_addr()?.port())
}

/// Drop `--nproc-per-node N` / `--nproc-per-node=N` from a command line (what workers must not see).
pub fn strip_nproc_flag(args: &[OsString]) -> Vec<OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut skip = false;
    for a in args {
        if skip {
            skip = false;
            continue;
        }
        match a.to_str() {
            Some("--nproc-per-node") => skip = true,
            Some(s) if s.starts_with("--nproc-per-node=") => {}
            _ => out.push(a.clone()),
        }
    }
    out
}

/// `--nproc-per-node N`: when `nproc` is given, start N workers running this process's command line
/// without the flag and return how they ended (the caller exits with `exit_code()`); `None` when
/// there is nothing to spawn and this process should do the work itself.
pub fn launch_if_asked(nproc: Option<usize>) -> Result<Option<WorkersOutcome>> {
    let Some(n) = nproc else { return Ok(None) };
    if let Ok(r) = std::env::var("RANK") {
        bail!(
            "--nproc-per-node {n}, but this process is already rank {r} of a launched run (RANK is set)\nhint: drop \
             --nproc-per-node under torchrun/srun, or unset RANK and WORLD_SIZE to let harpe start the workers"
        );
    }
    let args = strip_nproc_flag(&std::env::args_os().skip(1).collect::<Vec<_>>());
    spawn_workers(n, &args, &SpawnOptions::default()).map(Some)
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
}

impl Default for SpawnOptions {
    fn default() -> Self {
        SpawnOptions {
            program: None,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            grace: Duration::from_secs(30),
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
    let token = format!("{:032x}", rand::random::<u128>());
    let pending = Arc::new(AtomicUsize::new(0));
    let mut sig_ids = Vec::new();
    #[cfg(unix)]
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        sig_ids.push(signal_hook::flag::register_usize(sig, Arc::clone(&pending), sig as usize)?);
    }
    let res = run_workers(n, &program, args, opts, port, &token, &pending);
    for id in sig_ids {
        signal_hook::low_level::unregister(id);
    }
    res
}

fn run_workers(
    n: usize,
    program: &PathBuf,
    args: &[OsString],
    opts: &SpawnOptions,
    port: u16,
    token: &str,
    pending: &AtomicUsize,
) -> Result<WorkersOutcome> {
    let mut children: Vec<Child> = Vec::with_capacity(n);
    for rank in 0..n {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
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
    eprintln!("harpe: started {n} workers (ranks 0..{}), rendezvous at {}:{port}", n - 1, opts.master_addr);
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

/// `--work-s`: keep the group under the failure watch (`comms::watch`) for that long, as a training run
/// does; the test hooks make one rank fail or vanish half a second in.
fn watched_work(rv: crate::comms::rendezvous::Rendezvous, a: &DistCheckArgs, rank: usize) -> Result<()> {
    use crate::comms::watch::Watch;
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
    use crate::comms::rendezvous::{rendezvous, RendezvousSpec};
    use sha2::{Digest, Sha256};
    if let Some(out) = launch_if_asked(a.nproc_per_node)? {
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
        "dist-check: rank {}/{} (local rank {}, {:?}) joined {}:{}; payload {} bytes, sha256 {digest}",
        env.rank,
        env.world_size,
        env.local_rank,
        env.source,
        env.master_addr,
        env.master_port,
        rv.payload().len()
    );
    Ok(())
}
