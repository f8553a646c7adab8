//! The TCP rendezvous: rank 0 admits the other ranks, checks they belong to this run, and hands them
//! an opaque payload (NCCL's 128-byte unique id); the open connections then serve as a small barrier.
//!
//! Reference: the role of torch's `TCPStore` / `MASTER_ADDR:MASTER_PORT`, without its
//! key-value store. Wire format (all integers little-endian): a frame is `kind: u8, len: u32, body`.
//! A rank opens with `H` = magic `HARPERDV` + protocol u32 + rank u32 + world u32 + config hash
//! [32] + token (u32 len + bytes) + version (u32 len + bytes); rank 0 answers `W` + payload, or `R`
//! + a message (refused). Barrier: `B` + seq u64 from each rank, `b` + seq u64 back from rank 0.
//!
//! Where rank 0 listens (`Meeting`): on `MASTER_ADDR:MASTER_PORT` itself (harpe's spawner, Slurm,
//! variables set by hand), or — under torchrun, whose agent already serves its TCPStore on
//! `MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE=True`) — on a port the kernel hands out (bind port 0:
//! taken and held in one call, so it cannot collide with the agent's store or anything else) at the
//! address this host reaches the store from, published with a random run token under `STORE_KEY` in
//! the agent's store (`store.rs`), where the other ranks read it. That is the store torch's own workers
//! use for the same purpose; a port derived from `MASTER_PORT` (+1, ...) could be taken, and a fixed one
//! could not serve two runs on one node.
//!
//! A group that spans hosts needs rank 0 at an address the other hosts reach. When the address rank 0
//! would bind is a loopback one (`MASTER_ADDR` is a host name that the host's own /etc/hosts maps to
//! 127.0.1.1, as Debian's does, or 127.0.0.1 given by mistake) and the launcher says the world spans
//! more than this node, rank 0 listens on the wildcard address instead, only so that a rank arriving
//! from another host is told why the group cannot form: rank 0 aborts the whole rendezvous naming the
//! address, instead of every rank waiting for the timeout. Ranks on rank 0's own host (several "nodes"
//! on one machine) still meet over loopback. A rank reading a loopback address from the agent's store
//! while it reaches the store itself from another host connects to the store's host instead, for the
//! same answer.
//!
//! The non-obvious decisions: rank 0 admits connections concurrently (each handshake on its own
//! thread, bounded by `HANDSHAKE_WAIT`), so a silent or slow client cannot hold the door for the real
//! ranks. Who may abort the group: only a client that presents this run's token. A wrong token, a rank
//! out of range or a rank seen twice is logged, told it was refused (never what the expected token
//! is) and dropped, and the rendezvous goes on; a timeout then lists these refusals beside the missing
//! ranks. A rank of this run (right token) whose binary version, config hash or world size differs
//! aborts the *whole* rendezvous: rank 0 tells it and every rank already admitted why, then returns the
//! error itself, so no rank starts work with a mixed group and none waits for the timeout. A
//! connection that does not speak the protocol (a port scanner) is dropped with a warning. Rank 0
//! binds one address (`MASTER_ADDR`, or the one it reaches torchrun's store from), never 0.0.0.0 —
//! except in the loopback case above, where it admits loopback peers only.
//!
//! What it does not do: carry training traffic (NCCL or `Local` do), authenticate (the token guards
//! against mixing runs and stray clients, not against an attacker who can read the launcher's
//! environment or the network), or reconnect after a drop.
//!
//! The files: `rendezvous/spec.rs` (what a rank brings), `rendezvous/wire.rs` (frames, the hello),
//! `rendezvous/rank0.rs` (admitting the group), `rendezvous/join.rs` (joining it),
//! `rendezvous/group.rs` (what a rank leaves with: the connections, the payload, the barrier); this
//! file is the one entry, `rendezvous`.
mod group;
mod join;
mod rank0;
mod spec;
mod wire;

pub use group::Rendezvous;
pub use rank0::HANDSHAKE_WAIT;
pub use spec::{binary_version, config_hash, Meeting, RendezvousSpec, STORE_KEY};
pub(crate) use wire::{frame, put_str, read_frame};

use anyhow::{bail, Context, Result};
use join::join_via_store;
use rank0::{listen, serve};
use spec::host_port;
use std::time::Instant;

/// Join the group described by `spec`. Rank 0 calls `make_payload` once, after every rank was
/// admitted, and sends the bytes to all; every rank returns them (`Rendezvous::payload`).
pub fn rendezvous(spec: &RendezvousSpec, make_payload: impl FnOnce() -> Vec<u8>) -> Result<Rendezvous> {
    if spec.world == 0 || spec.rank >= spec.world {
        bail!("rendezvous: rank {} of world {}\nhint: ranks are 0..world-1", spec.rank, spec.world);
    }
    let warning = spec.token.check(spec.world).with_context(|| format!("rank {}", spec.rank))?;
    if let (Some(w), 0) = (warning, spec.rank) {
        eprintln!("{w}");
    }
    let mut rv = Rendezvous {
        rank: spec.rank,
        world: spec.world,
        at: host_port(&spec.addr, spec.port),
        payload: Vec::new(),
        links: Vec::new(),
        timeout: spec.timeout,
        barriers: 0,
    };
    if spec.world == 1 {
        rv.payload = make_payload();
        return Ok(rv);
    }
    let deadline = Instant::now() + spec.timeout;
    if spec.rank == 0 {
        let (listener, seat) = listen(spec, deadline)?;
        rv.at = host_port(&seat.spec.addr, seat.spec.port);
        let (links, payload) = serve(&seat, listener, deadline, make_payload)?;
        rv.links = links;
        rv.payload = payload;
    } else {
        let (spec, link, payload) = match spec.meet {
            Meeting::Listen => {
                let (link, payload) = join::join(spec, deadline)?;
                (spec.clone(), link, payload)
            }
            Meeting::AgentStore { .. } => join_via_store(spec, deadline)?,
        };
        rv.at = host_port(&spec.addr, spec.port);
        rv.links = vec![link];
        rv.payload = payload;
    }
    Ok(rv)
}
