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
use crate::launch::env::{LaunchEnv, LaunchSource, RunToken, TokenOrigin};
use crate::launch::store::StoreClient;
use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"HARPERDV";
const PROTOCOL: u32 = 1;
/// Largest frame accepted (the payload is 128 bytes in practice).
const MAX_FRAME: usize = 1 << 20;
/// How long an accepted connection may take to introduce itself before it is dropped.
pub const HANDSHAKE_WAIT: Duration = Duration::from_secs(10);
/// Handshakes in flight at once; further connections wait in the listen backlog.
const MAX_HANDSHAKES: usize = 256;

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
    /// Hash of the resolved config (see `config_hash`); every rank must have the same one.
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

/// An admitted rank's open connection(s) to the group, after the payload was shared.
pub struct Rendezvous {
    rank: usize,
    world: usize,
    /// `host:port` where rank 0 admitted the group.
    at: String,
    payload: Vec<u8>,
    /// Rank 0: the stream of rank r at index r - 1. Others: the stream to rank 0.
    links: Vec<TcpStream>,
    timeout: Duration,
    barriers: u64,
}

pub(crate) fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(5 + body.len());
    v.push(kind);
    v.extend_from_slice(&(body.len() as u32).to_le_bytes());
    v.extend_from_slice(body);
    v
}

pub(crate) fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    s.read_exact(&mut head)?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(ErrorKind::InvalidData, format!("frame of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    Ok((head[0], body))
}

pub(crate) fn put_str(v: &mut Vec<u8>, s: &str) {
    v.extend_from_slice(&(s.len() as u32).to_le_bytes());
    v.extend_from_slice(s.as_bytes());
}

/// A parsed `H` frame.
struct Hello {
    rank: usize,
    world: usize,
    hash: [u8; 32],
    token: String,
    version: String,
}

fn encode_hello(spec: &RendezvousSpec) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&PROTOCOL.to_le_bytes());
    b.extend_from_slice(&(spec.rank as u32).to_le_bytes());
    b.extend_from_slice(&(spec.world as u32).to_le_bytes());
    b.extend_from_slice(&spec.config_hash);
    put_str(&mut b, &spec.token.value);
    put_str(&mut b, &spec.version);
    frame(b'H', &b)
}

/// Parse a hello body; `None` when it is not our protocol.
fn decode_hello(kind: u8, b: &[u8]) -> Option<Hello> {
    struct Cur<'a>(&'a [u8]);
    impl Cur<'_> {
        fn take(&mut self, n: usize) -> Option<&[u8]> {
            if self.0.len() < n {
                return None;
            }
            let (a, rest) = self.0.split_at(n);
            self.0 = rest;
            Some(a)
        }
        fn u32(&mut self) -> Option<u32> {
            self.take(4).map(|a| u32::from_le_bytes([a[0], a[1], a[2], a[3]]))
        }
        fn string(&mut self) -> Option<String> {
            let n = self.u32()? as usize;
            String::from_utf8(self.take(n)?.to_vec()).ok()
        }
    }
    let mut c = Cur(b);
    if kind != b'H' || c.take(8)? != MAGIC || c.u32()? != PROTOCOL {
        return None;
    }
    let rank = c.u32()? as usize;
    let world = c.u32()? as usize;
    let hash: [u8; 32] = c.take(32)?.try_into().ok()?;
    let token = c.string()?;
    let version = c.string()?;
    Some(Hello { rank, world, hash, token, version })
}

fn short(h: &[u8; 32]) -> String {
    hex::encode(&h[..6])
}

/// What rank 0 does with an arriving rank's hello.
enum Verdict {
    /// Admit it.
    Admit,
    /// Not (verifiably) of this run, or a rank already taken: drop that connection only.
    Drop(String),
    /// A rank of this run that differs from rank 0: abort the whole rendezvous.
    Abort(String),
    /// A rank of this run on another host, while rank 0 sits at a loopback address: abort the whole
    /// rendezvous with this message (its own hint).
    Unreachable(String),
}

/// Rank 0 as the others see it: the spec with the address and port it listens on, and `loopback`, the
/// loopback address the group should have met at when rank 0 listens on the wildcard address only to
/// turn away ranks from other hosts (see the file header).
struct Seat {
    spec: RendezvousSpec,
    loopback: Option<IpAddr>,
}

/// Why a rank from another host cannot join a group whose rank 0 sits at loopback address `ip`.
fn unreachable_message(spec: &RendezvousSpec, ip: IpAddr, r: usize, peer: SocketAddr) -> String {
    let how = match spec.meet {
        Meeting::Listen => format!("MASTER_ADDR {:?} resolves to {ip} on rank 0's host", spec.addr),
        Meeting::AgentStore { .. } => format!(
            "rank 0 reaches torchrun's store {} from {ip} (MASTER_ADDR {:?} resolves to it on rank 0's host)",
            host_port(&spec.addr, spec.port),
            spec.addr
        ),
    };
    format!(
        "rank {r} arrived from {peer}, another host, but {how}, a loopback address: the other hosts cannot reach \
         rank 0's rendezvous, store and collectives there\nhint: MASTER_ADDR must resolve on every node, rank 0's \
         own included, to an address the other nodes reach (Debian's /etc/hosts maps a host's own name to \
         127.0.1.1: map it to the host's network address, or give MASTER_ADDR / --master-addr as that IP \
         address; torchrun's c10d rendezvous: --local-addr <that address>)"
    )
}

/// Judge `h`, from `peer`. The token comes first: a client that cannot present it may not abort the
/// group with whatever else it claims, and it is never told the token it should have presented.
fn judge(spec: &Seat, h: &Hello, admitted: &[Option<SocketAddr>], peer: SocketAddr) -> Verdict {
    let (r, loopback, spec) = (h.rank, spec.loopback, &spec.spec);
    if h.token != spec.token.value {
        return Verdict::Drop(format!(
            "a process at {peer} claiming rank {r} presents a different run token (a worker of another run, or a \
             stray client)"
        ));
    }
    if let Some(ip) = loopback.filter(|_| !peer.ip().is_loopback()) {
        return Verdict::Unreachable(unreachable_message(spec, ip, r, peer));
    }
    if h.world != spec.world {
        return Verdict::Abort(format!("rank {r} has world size {}, rank 0 has {}", h.world, spec.world));
    }
    if r == 0 || r >= spec.world {
        return Verdict::Drop(format!("a process at {peer} claims rank {r}, outside 1..{}", spec.world));
    }
    if let Some(prev) = admitted[r] {
        return Verdict::Drop(format!("duplicate rank {r}: already admitted from {prev}, again from {peer}"));
    }
    if h.version != spec.version {
        return Verdict::Abort(format!("rank {r} runs binary {:?}, rank 0 runs {:?}", h.version, spec.version));
    }
    if h.hash != spec.config_hash {
        return Verdict::Abort(format!(
            "rank {r} has a different resolved config (hash {}..., rank 0 has {}...)",
            short(&h.hash),
            short(&spec.config_hash)
        ));
    }
    Verdict::Admit
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

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
                let (link, payload) = join(spec, deadline)?;
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

/// `host:port`, with an IPv6 host in brackets.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Rank 0: the listener and where the others meet it (under `AgentStore`: the address and port just
/// bound, and the token drawn, published in the agent's store).
fn listen(spec: &RendezvousSpec, deadline: Instant) -> Result<(TcpListener, Seat)> {
    let Meeting::AgentStore { .. } = spec.meet else {
        let (listener, loopback) = bind(spec)?;
        return Ok((listener, Seat { spec: spec.clone(), loopback }));
    };
    let mut store = StoreClient::connect(&spec.addr, spec.port, deadline).context("rank 0")?;
    let ip = store.local_ip()?;
    // Port 0: the kernel hands out a port no one holds, and this listener holds it from now on.
    let loopback = (ip.is_loopback() && spec.spans_hosts).then_some(ip);
    let bind_ip = if loopback.is_some() { unspecified(ip) } else { ip };
    let listener = TcpListener::bind((bind_ip, 0)).map_err(|e| {
        anyhow!(
            "rank 0 cannot listen on {bind_ip} (for the address it reaches torchrun's store {} from, {ip}): \
             {e}\nhint: check the host's network configuration",
            host_port(&spec.addr, spec.port)
        )
    })?;
    let at = SocketAddr::new(ip, listener.local_addr()?.port());
    let mut mine = spec.clone();
    (mine.addr, mine.port) = (ip.to_string(), at.port());
    if mine.token.origin == TokenOrigin::AgentStore {
        mine.token.value = format!("{:032x}", rand::random::<u128>());
    }
    let published = match mine.token.origin {
        TokenOrigin::AgentStore => format!("{at}\n{}", mine.token.value),
        _ => format!("{at}\n"),
    };
    store.set(STORE_KEY, published.as_bytes()).context("rank 0: publishing its rendezvous address")?;
    Ok((listener, Seat { spec: mine, loopback }))
}

/// The wildcard address of `ip`'s family.
fn unspecified(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

/// Ranks 1.. under `AgentStore`: read rank 0's address (and drawn token) from the agent's store, connect
/// and introduce this rank. An address where nothing answers is re-read until the deadline: it may be
/// the previous attempt's rank 0 (see `STORE_KEY`), which the new one replaces.
fn join_via_store(spec: &RendezvousSpec, deadline: Instant) -> Result<(RendezvousSpec, TcpStream, Vec<u8>)> {
    let r = spec.rank;
    let at_store = host_port(&spec.addr, spec.port);
    let mut store = StoreClient::connect(&spec.addr, spec.port, deadline).with_context(|| format!("rank {r}"))?;
    let mut backoff = Duration::from_millis(50);
    loop {
        let Some(v) = store.wait_get(STORE_KEY, deadline)? else {
            bail!(
                "rank {r}: rank 0 did not publish its rendezvous address under {STORE_KEY:?} in torchrun's store at \
                 {at_store} within {:.0}s\nhint: rank 0's log says why it did not start; raise dist.timeout_s for \
                 slow starts",
                spec.timeout.as_secs_f64()
            );
        };
        let found = rank0_from_store(spec, &v, &store)?;
        let a = SocketAddr::new(found.addr.parse()?, found.port);
        match TcpStream::connect_timeout(&a, remaining(deadline).min(Duration::from_secs(2))) {
            Ok(s) => {
                let (link, payload) = introduce(&found, s, deadline)?;
                return Ok((found, link, payload));
            }
            Err(e) if Instant::now() >= deadline => bail!(
                "rank {r}: rank 0's rendezvous address {a}, read from torchrun's store at {at_store}, did not answer \
                 within {:.0}s ({e})\nhint: rank 0's log says why it stopped; check that no firewall blocks the \
                 ports between the nodes",
                spec.timeout.as_secs_f64()
            ),
            Err(_) => {
                std::thread::sleep(backoff.min(remaining(deadline)));
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        }
    }
}

/// The spec with rank 0's address and token as published in the agent's store (`v`). A loopback address
/// read by a rank that reaches the store from another host means rank 0 sits on the store's host at an
/// address no other host reaches: this rank goes to the store's host instead, where rank 0 tells it why
/// the group cannot form (see the file header).
fn rank0_from_store(spec: &RendezvousSpec, v: &[u8], store: &StoreClient) -> Result<RendezvousSpec> {
    let r = spec.rank;
    let text = String::from_utf8_lossy(v);
    let (at, token) = text.split_once('\n').unwrap_or((&text, ""));
    let mut at: SocketAddr = at.parse().map_err(|_| {
        anyhow!(
            "rank {r}: torchrun's store holds {text:?} under {STORE_KEY:?}, not a rendezvous address\nhint: does \
             every rank run the same harpe binary?"
        )
    })?;
    let store_ip = store.peer_ip()?;
    if at.ip().is_loopback() && !store_ip.is_loopback() {
        at.set_ip(store_ip);
    }
    let mut found = spec.clone();
    (found.addr, found.port, found.meet) = (at.ip().to_string(), at.port(), Meeting::Listen);
    if found.token.origin == TokenOrigin::AgentStore {
        found.token.value = token.to_string();
    }
    Ok(found)
}

/// Rank 0 under `Listen`: bind `MASTER_ADDR:MASTER_PORT`, or the wildcard address at that port when
/// `MASTER_ADDR` is a loopback address of a group that spans hosts (returned: that address).
fn bind(spec: &RendezvousSpec) -> Result<(TcpListener, Option<IpAddr>)> {
    let at = host_port(&spec.addr, spec.port);
    let hint = "set MASTER_PORT to a free port (or let `--nproc-per-node` choose one)";
    let resolved = (spec.addr.as_str(), spec.port).to_socket_addrs().ok().and_then(|mut a| a.next());
    let loopback = resolved.map(|a| a.ip()).filter(|ip| ip.is_loopback() && spec.spans_hosts);
    let bound = match loopback {
        Some(ip) => TcpListener::bind((unspecified(ip), spec.port)),
        None => TcpListener::bind((spec.addr.as_str(), spec.port)),
    };
    let listener = bound.map_err(|e| match e.kind() {
        ErrorKind::AddrInUse => {
            anyhow!("rank 0 cannot listen on {at}: the port is in use (another run?)\nhint: {hint}")
        }
        ErrorKind::AddrNotAvailable => anyhow!(
            "rank 0 cannot listen on {at}: {} is not an address of this host\nhint: MASTER_ADDR must name the \
             host rank 0 runs on (under Slurm: the first node of the job)",
            spec.addr
        ),
        _ => anyhow!("rank 0 cannot listen on {at}: {e}\nhint: check MASTER_ADDR and MASTER_PORT; {hint}"),
    })?;
    Ok((listener, loopback))
}

/// What a handshake thread hands back: the peer, its stream, and its hello (`None`: it did not
/// speak the protocol within `HANDSHAKE_WAIT`).
type Arrival = (SocketAddr, TcpStream, Option<Hello>);

/// Read one connection's hello on a thread of its own, bounded by `HANDSHAKE_WAIT`.
fn handshake(mut s: TcpStream, peer: SocketAddr, deadline: Instant, tx: mpsc::Sender<Arrival>) {
    let hello = (|| {
        s.set_nonblocking(false).ok()?;
        s.set_read_timeout(Some(remaining(deadline).min(HANDSHAKE_WAIT))).ok()?;
        read_frame(&mut s).ok().and_then(|(k, b)| decode_hello(k, &b))
    })();
    let _ = tx.send((peer, s, hello)); // the rendezvous may be over: then the connection just closes
}

/// Rank 0: admit world-1 ranks, then send the payload to all of them.
fn serve(
    seat: &Seat,
    listener: TcpListener,
    deadline: Instant,
    make_payload: impl FnOnce() -> Vec<u8>,
) -> Result<(Vec<TcpStream>, Vec<u8>)> {
    let spec = &seat.spec;
    listener.set_nonblocking(true)?;
    let (tx, rx) = mpsc::channel::<Arrival>();
    let mut in_flight = 0usize;
    let mut admitted: Vec<Option<SocketAddr>> = vec![None; spec.world];
    let mut streams: Vec<Option<TcpStream>> = (0..spec.world).map(|_| None).collect();
    let mut refused: Vec<String> = Vec::new();
    let mut count = 1;
    while count < spec.world {
        in_flight += accept_handshakes(&listener, MAX_HANDSHAKES.saturating_sub(in_flight), deadline, &tx)?;
        let (peer, mut s, hello) = match rx.recv_timeout(Duration::from_millis(10)) {
            Ok(a) => a,
            Err(_) => {
                if Instant::now() >= deadline {
                    let msg = timeout_message(spec, &admitted, &refused);
                    abort_all(&mut streams, &msg);
                    bail!(msg);
                }
                continue;
            }
        };
        in_flight -= 1;
        let Some(hello) = hello else {
            eprintln!(
                "harpe: rendezvous: ignored a connection from {peer} that did not speak the protocol within {:.0}s",
                HANDSHAKE_WAIT.as_secs_f64()
            );
            continue;
        };
        match judge(seat, &hello, &admitted, peer) {
            Verdict::Admit => {
                s.set_nodelay(true)?;
                admitted[hello.rank] = Some(peer);
                streams[hello.rank] = Some(s);
                count += 1;
            }
            Verdict::Drop(why) => {
                eprintln!("harpe: rendezvous: refused {why}; waiting for the real ranks");
                let msg = format!(
                    "rendezvous refused: {why}\nhint: every rank must present the run token of the run it belongs \
                     to ({} or the launcher's), with a rank in 1..{} that no other process holds",
                    crate::launch::env::TOKEN_VAR,
                    spec.world
                );
                let _ = s.write_all(&frame(b'R', msg.as_bytes()));
                refused.push(why);
            }
            Verdict::Abort(why) => {
                let msg = format!(
                    "rendezvous refused: {why}\nhint: every rank must run the same binary with the same config \
                     (start them with one launcher command)"
                );
                let _ = s.write_all(&frame(b'R', msg.as_bytes()));
                abort_all(&mut streams, &format!("rank 0 aborted the rendezvous: {msg}"));
                bail!(msg);
            }
            Verdict::Unreachable(msg) => {
                eprintln!("harpe: rendezvous: {msg}");
                let _ = s.write_all(&frame(b'R', format!("rank 0 aborted the rendezvous: {msg}").as_bytes()));
                abort_all(&mut streams, &format!("rank 0 aborted the rendezvous: {msg}"));
                bail!(msg);
            }
        }
    }
    let payload = make_payload();
    let welcome = frame(b'W', &payload);
    let mut links = Vec::with_capacity(spec.world - 1);
    for (r, s) in streams.into_iter().enumerate().skip(1) {
        let mut s = s.context("internal: admitted rank without a stream")?;
        s.write_all(&welcome).with_context(|| format!("rendezvous: sending the payload to rank {r}"))?;
        links.push(s);
    }
    Ok((links, payload))
}

/// Accept up to `room` waiting connections, each handshaken on its own thread (bounded by `deadline`),
/// its arrival sent to `tx`; returns how many were started.
fn accept_handshakes(
    listener: &TcpListener,
    room: usize,
    deadline: Instant,
    tx: &mpsc::Sender<Arrival>,
) -> Result<usize> {
    let mut started = 0;
    while started < room {
        match listener.accept() {
            Ok((s, peer)) => {
                let tx = tx.clone();
                std::thread::Builder::new()
                    .name("harpe-rdzv-hello".into())
                    .spawn(move || handshake(s, peer, deadline, tx))
                    .context("rendezvous: starting a handshake thread")?;
                started += 1;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => return Err(e).context("rendezvous: accepting a connection"),
        }
    }
    Ok(started)
}

/// Rank 0's timeout: who never arrived, and what was refused on the way.
fn timeout_message(spec: &RendezvousSpec, admitted: &[Option<SocketAddr>], refused: &[String]) -> String {
    let missing: Vec<usize> = (1..spec.world).filter(|&r| admitted[r].is_none()).collect();
    let also = if refused.is_empty() { String::new() } else { format!("; refused meanwhile: {}", refused.join("; ")) };
    format!(
        "rendezvous at {}:{} timed out after {:.0}s: ranks {missing:?} never connected{also}\nhint: check that \
         those ranks started, that they use the same MASTER_ADDR/MASTER_PORT and run token, and that no firewall \
         blocks the port; raise dist.timeout_s for slow starts",
        spec.addr,
        spec.port,
        spec.timeout.as_secs_f64()
    )
}

fn abort_all(streams: &mut [Option<TcpStream>], msg: &str) {
    for s in streams.iter_mut().flatten() {
        let _ = s.write_all(&frame(b'R', msg.as_bytes()));
    }
}

/// Connect to one of `addrs`, retrying with backoff until `deadline`.
fn connect(spec: &RendezvousSpec, addrs: &[SocketAddr], deadline: Instant) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(50);
    loop {
        let mut last = None;
        for a in addrs {
            match TcpStream::connect_timeout(a, remaining(deadline).min(Duration::from_secs(5))) {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        if Instant::now() >= deadline {
            let why = last.map(|e| e.to_string()).unwrap_or_else(|| "no address".into());
            bail!(
                "rank {}: could not reach rank 0 at {}:{} within {:.0}s (last error: {why})\nhint: check that rank 0 \
                 started (its log says why it stopped), that MASTER_ADDR/MASTER_PORT match, and that no firewall \
                 blocks the port",
                spec.rank,
                spec.addr,
                spec.port,
                spec.timeout.as_secs_f64()
            );
        }
        std::thread::sleep(backoff.min(remaining(deadline)));
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// Ranks 1..: connect (retrying until the deadline), introduce ourselves, receive the payload.
fn join(spec: &RendezvousSpec, deadline: Instant) -> Result<(TcpStream, Vec<u8>)> {
    let addrs: Vec<SocketAddr> = (spec.addr.as_str(), spec.port)
        .to_socket_addrs()
        .with_context(|| {
            format!(
                "rank {}: MASTER_ADDR {:?} does not resolve\nhint: set MASTER_ADDR to rank 0's host name or IP address",
                spec.rank, spec.addr
            )
        })?
        .collect();
    let s = connect(spec, &addrs, deadline)?;
    introduce(spec, s, deadline)
}

/// Send this rank's hello on `s` and wait for rank 0's answer: the payload, or why it refused.
fn introduce(spec: &RendezvousSpec, mut s: TcpStream, deadline: Instant) -> Result<(TcpStream, Vec<u8>)> {
    s.set_nodelay(true)?;
    s.write_all(&encode_hello(spec)).with_context(|| format!("rank {}: introducing itself to rank 0", spec.rank))?;
    s.set_read_timeout(Some(remaining(deadline)))?;
    match read_frame(&mut s) {
        Ok((b'W', payload)) => Ok((s, payload)),
        Ok((b'R', msg)) => bail!("rank {}: {}", spec.rank, String::from_utf8_lossy(&msg)),
        Ok((k, _)) => {
            bail!("rank {}: unexpected reply {k:?} from rank 0\nhint: do both ranks run the same binary?", spec.rank)
        }
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => bail!(
            "rank {}: rank 0 admitted the connection but the rendezvous did not complete within {:.0}s\nhint: \
             some other rank did not arrive; rank 0's log names it",
            spec.rank,
            spec.timeout.as_secs_f64()
        ),
        Err(e) => bail!(
            "rank {}: lost the connection to rank 0 during the rendezvous: {e}\nhint: rank 0's log says why",
            spec.rank
        ),
    }
}

impl Rendezvous {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// `host:port` where rank 0 admitted the group (under torchrun: the port it published in the
    /// agent's store, not `MASTER_PORT`).
    pub fn rank0_addr(&self) -> &str {
        &self.at
    }

    /// The bytes rank 0 shared (the same on every rank).
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The open connections (rank 0: rank r's at index r - 1; others: the one to rank 0), handed to the
    /// failure watch (`launch::watch`), which owns them from then on.
    pub(crate) fn into_links(self) -> Vec<TcpStream> {
        self.links
    }

    /// Wait until every rank reached this barrier (or fail within the timeout naming who did not).
    pub fn barrier(&mut self, label: &str) -> Result<()> {
        self.barriers += 1;
        let seq = self.barriers;
        if self.world == 1 {
            return Ok(());
        }
        let what = format!("barrier #{seq} {label:?}");
        let deadline = Instant::now() + self.timeout;
        if self.rank == 0 {
            let res = self.serve_barrier(seq, &what, deadline);
            if let Err(e) = &res {
                let msg = format!("rank 0 aborted {what}: {e:#}");
                for s in &mut self.links {
                    let _ = s.write_all(&frame(b'R', msg.as_bytes()));
                }
            }
            return res;
        }
        let r = self.rank;
        let s = &mut self.links[0];
        s.write_all(&frame(b'B', &seq.to_le_bytes()))
            .with_context(|| format!("rank {r}: {what}: rank 0 is gone\nhint: rank 0's log says why"))?;
        s.set_read_timeout(Some(remaining(deadline)))?;
        match read_frame(s) {
            Ok((b'b', body)) if body == seq.to_le_bytes() => Ok(()),
            Ok((b'R', msg)) => bail!("rank {r}: {}", String::from_utf8_lossy(&msg)),
            Ok((k, _)) => {
                bail!("rank {r}: {what}: unexpected message {k:?} from rank 0\nhint: ranks called different barriers")
            }
            Err(e) => bail!(
                "rank {r}: {what}: no answer from rank 0 within {:.0}s ({e})\nhint: a rank is stuck or gone; rank 0's \
                 log names it; raise dist.timeout_s if the work between barriers is legitimately long",
                self.timeout.as_secs_f64()
            ),
        }
    }

    fn serve_barrier(&mut self, seq: u64, what: &str, deadline: Instant) -> Result<()> {
        for (i, s) in self.links.iter_mut().enumerate() {
            let r = i + 1;
            s.set_read_timeout(Some(remaining(deadline)))?;
            match read_frame(s) {
                Ok((b'B', body)) if body == seq.to_le_bytes() => {}
                Ok((k, body)) => bail!(
                    "rank 0: {what}: rank {r} sent {k:?} {body:?} instead\nhint: every rank must call the same barriers \
                     in the same order"
                ),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => bail!(
                    "rank 0: {what}: rank {r} did not arrive within {:.0}s\nhint: rank {r} is stuck or much slower; \
                     raise dist.timeout_s if the work between barriers is legitimately long",
                    self.timeout.as_secs_f64()
                ),
                Err(e) => bail!("rank 0: {what}: rank {r} is gone ({e})\nhint: rank {r}'s log says why it stopped"),
            }
        }
        let ack = frame(b'b', &seq.to_le_bytes());
        for (i, s) in self.links.iter_mut().enumerate() {
            s.write_all(&ack).with_context(|| format!("rank 0: {what}: releasing rank {}", i + 1))?;
        }
        Ok(())
    }
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
