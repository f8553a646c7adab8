//! Who this process is in a multi-process run, read from the launcher's environment: torchrun's
//! variables, Slurm's task variables, or `harpe ... --nproc-per-node N`'s (which copies torchrun's).
//!
//! Reference: torchrun's environment contract (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_RUN_ID`,
//! `TORCHELASTIC_RESTART_COUNT`, `TORCHELASTIC_USE_AGENT_STORE`) and Slurm's task variables
//! (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_JOB_NODELIST` in Slurm's hostlist syntax,
//! e.g. `node[01-03,07],gpu5`).
//!
//! The non-obvious decisions: (1) torchrun-style variables win over Slurm's, because `srun torchrun`
//! sets both and then `RANK` is the true global rank while `SLURM_PROCID` numbers the per-node
//! torchrun agents; (2) under Slurm without `MASTER_PORT` the port is `20000 + SLURM_JOB_ID % 10000`,
//! the same on every task of a job, different between most jobs sharing a node, and below Linux's
//! ephemeral range; (3) torchrun's agent serves its own TCPStore on `MASTER_ADDR:MASTER_PORT` when it
//! sets `TORCHELASTIC_USE_AGENT_STORE=True` (its default in every rendezvous style), so that port is
//! never harpe's: `LaunchSource::TorchrunAgentStore` tells the rendezvous to use that store instead
//! (see `rendezvous.rs`); (4) the run token's origin is kept (`TokenOrigin`), because a token derived
//! from a job id is guessable (warned) and none at all is refused, while `HARPE_RUN_TOKEN` is taken as
//! given.
//!
//! This file sits below `rendezvous.rs` and `watch.rs` (it imports neither), so the launcher
//! (`launch.rs`), the rendezvous and the watch all read it without an import circle.
//!
//! What it does not do: start processes (`launch.rs`), talk to anyone (`rendezvous.rs`, `store.rs`), or
//! pick a GPU (the worker maps `LOCAL_RANK` to a device).
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::net::TcpListener;

/// Which launcher's variables described this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchSource {
    /// `RANK` / `WORLD_SIZE` / ... set by `harpe ... --nproc-per-node N`, by hand, or by a torchrun
    /// that does not share its store: rank 0 listens on `MASTER_ADDR:MASTER_PORT` itself.
    Torchrun,
    /// torchrun with `TORCHELASTIC_USE_AGENT_STORE=True` (its default): `MASTER_ADDR:MASTER_PORT` is the
    /// agent's TCPStore, already listening; rank 0 publishes a rendezvous address of its own there.
    TorchrunAgentStore {
        /// `TORCHELASTIC_RESTART_COUNT`: the agent's store outlives a restart of the workers, so each
        /// attempt uses its own keys.
        restart: u32,
    },
    /// `SLURM_PROCID` / `SLURM_NTASKS` / ... (`srun harpe ...`).
    Slurm,
}

impl LaunchSource {
    /// Short name for messages: "Torchrun", "Torchrun, agent store" or "Slurm".
    pub fn label(&self) -> &'static str {
        match self {
            LaunchSource::Torchrun => "Torchrun",
            LaunchSource::TorchrunAgentStore { .. } => "Torchrun, agent store",
            LaunchSource::Slurm => "Slurm",
        }
    }
}

/// Where a run token came from: how far it can be trusted to keep runs apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenOrigin {
    /// `HARPE_RUN_TOKEN` (random from `--nproc-per-node` and scripts/slurm-harpe-128k.sh), or given
    /// in code: used as it is.
    Given,
    /// Derived from the launcher's job or run id (the variable named): anyone on the cluster can
    /// guess it, so rank 0 warns.
    JobId(&'static str),
    /// torchrun's agent store is shared by exactly this run's workers: rank 0 draws a random token
    /// and publishes it there with its address (the value is empty until then).
    AgentStore,
    /// No token at all: refused for more than one rank.
    Missing,
}

/// The per-run token every rank must present at the rendezvous.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunToken {
    /// The token ("" for `AgentStore` before the rendezvous, and for `Missing`).
    pub value: String,
    /// Where it came from.
    pub origin: TokenOrigin,
}

impl From<&str> for RunToken {
    /// A token given in code: `Given`, or `Missing` when empty.
    fn from(v: &str) -> RunToken {
        let origin = if v.is_empty() { TokenOrigin::Missing } else { TokenOrigin::Given };
        RunToken { value: v.to_string(), origin }
    }
}

impl RunToken {
    /// Refuse a group of `world` > 1 ranks without a token; otherwise the warning to print (on rank 0)
    /// when the token is guessable.
    pub fn check(&self, world: usize) -> Result<Option<String>> {
        if world <= 1 {
            return Ok(None);
        }
        match self.origin {
            TokenOrigin::Missing => bail!(
                "no run token: {world} ranks would admit any process that connects to rank 0's rendezvous port \
                 (the launcher set neither {TOKEN_VAR} nor a job id)\nhint: export {TOKEN_VAR}=$(openssl rand -hex 16) \
                 with the same value for every rank, or start the ranks with `harpe ... --nproc-per-node N`, \
                 torchrun or srun"
            ),
            TokenOrigin::JobId(var) => Ok(Some(format!(
                "harpe: warning: the run token is derived from {var}, which others on the cluster can guess; \
                 a process that knows it can join or disturb this run's rendezvous\nhint: export \
                 {TOKEN_VAR}=$(openssl rand -hex 16) before srun/torchrun (scripts/slurm-harpe-128k.sh does)"
            ))),
            TokenOrigin::Given | TokenOrigin::AgentStore => Ok(None),
        }
    }
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
    /// Host of rank 0's rendezvous (`TorchrunAgentStore`: of the agent's TCPStore).
    pub master_addr: String,
    /// Port of rank 0's rendezvous (`TorchrunAgentStore`: of the agent's TCPStore, never harpe's).
    pub master_port: u16,
    /// Per-run token every rank must present at the rendezvous, and where it came from.
    pub run_token: RunToken,
}

/// Variable holding the per-run rendezvous token (set by the spawner and the shipped Slurm script;
/// may be set by hand; wins over every launcher's own id).
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
        // torchrun's agent serves its TCPStore on MASTER_PORT (torch/distributed/rendezvous.py reads the
        // same variable to decide that every worker is a client of it)
        let agent_store = get(env, "TORCHELASTIC_USE_AGENT_STORE") == Some("True") && world_size > 1;
        let source = if agent_store {
            let restart = num(env, "TORCHELASTIC_RESTART_COUNT", hint)?.unwrap_or(0);
            LaunchSource::TorchrunAgentStore { restart: u32::try_from(restart).unwrap_or(u32::MAX) }
        } else {
            LaunchSource::Torchrun
        };
        let run_token = match (get(env, TOKEN_VAR), get(env, "TORCHELASTIC_RUN_ID")) {
            (Some(t), _) => RunToken::from(t),
            _ if agent_store => RunToken { value: String::new(), origin: TokenOrigin::AgentStore },
            (None, Some(id)) => RunToken { value: id.to_string(), origin: TokenOrigin::JobId("TORCHELASTIC_RUN_ID") },
            (None, None) => RunToken::from(""),
        };
        Ok(LaunchEnv { source, rank, world_size, local_rank, local_world_size, master_addr, master_port, run_token })
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
        let run_token = match (get(env, TOKEN_VAR), get(env, "SLURM_JOB_ID")) {
            (Some(t), _) => RunToken::from(t),
            (None, Some(j)) => RunToken {
                value: format!("slurm-{j}.{}", get(env, "SLURM_STEP_ID").unwrap_or("0")),
                origin: TokenOrigin::JobId("SLURM_JOB_ID"),
            },
            (None, None) => RunToken::from(""),
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
            LaunchSource::Torchrun | LaunchSource::TorchrunAgentStore { .. } => {
                ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
            }
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
                LaunchSource::Torchrun | LaunchSource::TorchrunAgentStore { .. } => "WORLD_SIZE",
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

/// `world` threads standing in for the ranks of a group, thread r running `f(r, port)` with one port of
/// 127.0.0.1 that was free for their group to meet at; the results in rank order.
#[cfg(test)]
pub(crate) fn rank_threads<T: Send + 'static>(
    world: usize,
    f: impl Fn(usize, u16) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let port = free_port("127.0.0.1").unwrap();
    let f = std::sync::Arc::new(f);
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let f = std::sync::Arc::clone(&f);
            std::thread::spawn(move || f(rank, port))
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}
