//! What a rank brings to the rendezvous (`RendezvousSpec`: where rank 0 is, `Meeting`, this rank, the
//! run token, the binary version, the resolved config's hash, the timeout) and how it is made from a
//! launcher's environment. The leaf the other rendezvous files build on.
use crate::launch::env::{LaunchEnv, LaunchSource, RunToken};
use sha2::{Digest, Sha256};
use std::time::{Duration, Instant};

/// How the ranks find rank 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Meeting {
    /// Rank 0 listens on the spec's `addr:port`; the others connect there.
    Listen,
    /// The spec's `addr:port` is torchrun's agent TCPStore: rank 0 listens on a port of its own and
    /// publishes it (and the token, when drawn) under `STORE_KEY`; the others read it there.
    AgentStore {
        /// `TORCHELASTIC_RESTART_COUNT`, this agent's count of restarts (named in messages only: agents
        /// may disagree on it, see `STORE_KEY`).
        restart: u32,
    },
}

/// The agent-store key under which every attempt's rank 0 publishes its rendezvous address. Not keyed
/// by `TORCHELASTIC_RESTART_COUNT`: that is each agent's own count, and torchrun's agents disagree on it
/// once one agent restarted its workers after a failure (the agents that restart theirs because the
/// group changed do not count it). Instead each attempt's rank 0 overwrites the one key, and a rank that
/// finds an address where nothing answers (the previous attempt's rank 0, gone) reads the key again
/// until the new rank 0 has replaced it (`join_via_store`).
pub const STORE_KEY: &str = "harpe/rendezvous/rank0";

/// What this rank brings to the rendezvous.
#[derive(Clone, Debug)]
pub struct RendezvousSpec {
    /// Rank 0's address (it binds exactly this; the others connect to it), or the agent store's.
    pub addr: String,
    /// Rank 0's port, or the agent store's.
    pub port: u16,
    /// What `addr:port` is: rank 0's own, or torchrun's agent store.
    pub meet: Meeting,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Per-run token; every rank must present the same one (see `RunToken::check`).
    pub token: RunToken,
    /// Binary version (see `binary_version`); every rank must run the same one.
    pub version: String,
    /// The rendezvous fingerprint of the config (`config_hash` says what it covers); every rank must have the same one.
    pub config_hash: [u8; 32],
    /// Give up (with an error naming who is missing) after this long.
    pub timeout: Duration,
    /// The launcher says the ranks run on more than one host (`LOCAL_WORLD_SIZE` below the world size):
    /// rank 0 must then be reachable from the other hosts.
    pub spans_hosts: bool,
}

/// This binary's version and the features that change numerics or transport.
pub fn binary_version() -> String {
    let mut feats = Vec::new();
    if cfg!(feature = "cuda") {
        feats.push("cuda");
    }
    if cfg!(feature = "nccl") {
        feats.push("nccl");
    }
    if cfg!(feature = "flash-attn") {
        feats.push("flash-attn");
    }
    format!("harpe {} [{}]", env!("CARGO_PKG_VERSION"), feats.join(","))
}

/// SHA-256 of the resolved config text (the `config.toml` a run writes: every key, `[dist]` included), so
/// the ranks agree on all of it; not the config hash of `RunConfig::hash`, which guards resume.
pub fn config_hash(resolved_config: &str) -> [u8; 32] {
    Sha256::digest(resolved_config.as_bytes()).into()
}

impl RendezvousSpec {
    /// The spec of this process under a launcher: address, port, how to meet, rank, world and token
    /// from `env`, this binary's version, and the hash of `resolved_config`.
    pub fn from_launch(env: &LaunchEnv, resolved_config: &str, timeout: Duration) -> Self {
        let meet = match env.source {
            LaunchSource::TorchrunAgentStore { restart } => Meeting::AgentStore { restart },
            LaunchSource::Torchrun | LaunchSource::Slurm => Meeting::Listen,
        };
        RendezvousSpec {
            addr: env.master_addr.clone(),
            port: env.master_port,
            meet,
            rank: env.rank,
            world: env.world_size,
            token: env.run_token.clone(),
            version: binary_version(),
            config_hash: config_hash(resolved_config),
            timeout,
            spans_hosts: env.local_world_size.is_some_and(|l| l < env.world_size),
        }
    }
}

/// `host:port`, with an IPv6 host in brackets.
pub(super) fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Time left until `deadline` (at least 1 ms, so a socket timeout is never zero).
pub(super) fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}
