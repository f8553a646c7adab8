//! The TCP rendezvous: rank 0 admits the other ranks, checks they belong to this run, and hands them
//! an opaque payload (NCCL's 128-byte unique id); the open connections then serve as a small barrier.
//!
//! Reference: DESIGN.md §6; the role of torch's `TCPStore` / `MASTER_ADDR:MASTER_PORT`, without its
//! key-value store. Wire format (all integers little-endian): a frame is `kind: u8, len: u32, body`.
//! A rank opens with `H` = magic `HARPERDV` + protocol u32 + rank u32 + world u32 + config hash
//! [32] + token (u32 len + bytes) + version (u32 len + bytes); rank 0 answers `W` + payload, or `R`
//! + a message (refused). Barrier: `B` + seq u64 from each rank, `b` + seq u64 back from rank 0.
//!
//! The non-obvious decision: any mismatch (token, binary version, config hash, world size, a rank out
//! of range or seen twice) aborts the *whole* rendezvous: rank 0 tells the offending rank and every
//! rank already admitted why, then returns the error itself, so no rank starts work with a mixed
//! group and none waits for the timeout. A connection that does not speak the protocol (a port
//! scanner, a stray client) is dropped with a warning and does not abort. Rank 0 binds only
//! `MASTER_ADDR` (never 0.0.0.0).
//!
//! What it does not do: carry training traffic (NCCL or `Local` do), authenticate (the token guards
//! against mixing runs, not against an attacker on the network), or reconnect after a drop.
use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"HARPERDV";
const PROTOCOL: u32 = 1;
/// Largest frame accepted (the payload is 128 bytes in practice).
const MAX_FRAME: usize = 1 << 20;

/// What this rank brings to the rendezvous.
#[derive(Clone, Debug)]
pub struct RendezvousSpec {
    /// Rank 0's address (it binds exactly this; the others connect to it).
    pub addr: String,
    /// Rank 0's port.
    pub port: u16,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Per-run token; every rank must present the same one.
    pub token: String,
    /// Binary version (see `binary_version`); every rank must run the same one.
    pub version: String,
    /// Hash of the resolved config (see `config_hash`); every rank must have the same one.
    pub config_hash: [u8; 32],
    /// Give up (with an error naming who is missing) after this long.
    pub timeout: Duration,
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

/// SHA-256 of the resolved config text (the `config.toml` a run writes).
pub fn config_hash(resolved_config: &str) -> [u8; 32] {
    Sha256::digest(resolved_config.as_bytes()).into()
}

/// An admitted rank's open connection(s) to the group, after the payload was shared.
pub struct Rendezvous {
    rank: usize,
    world: usize,
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
    put_str(&mut b, &spec.token);
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

/// What differs between rank 0 and an arriving rank, if anything.
fn mismatch(spec: &RendezvousSpec, h: &Hello, admitted: &[Option<SocketAddr>], peer: SocketAddr) -> Option<String> {
    let r = h.rank;
    if h.world != spec.world {
        return Some(format!("rank {r} has world size {}, rank 0 has {}", h.world, spec.world));
    }
    if r == 0 || r >= spec.world {
        return Some(format!("a process at {peer} claims rank {r}, outside 1..{}", spec.world));
    }
    if let Some(prev) = admitted[r] {
        return Some(format!("duplicate rank {r}: already admitted from {prev}, again from {peer}"));
    }
    if h.token != spec.token {
        return Some(format!(
            "rank {r} presents run token {:?}, rank 0 has {:?} (a worker of another run?)",
            h.token, spec.token
        ));
    }
    if h.version != spec.version {
        return Some(format!("rank {r} runs binary {:?}, rank 0 runs {:?}", h.version, spec.version));
    }
    if h.hash != spec.config_hash {
        return Some(format!(
            "rank {r} has a different resolved config (hash {}..., rank 0 has {}...)",
            short(&h.hash),
            short(&spec.config_hash)
        ));
    }
    None
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
    let mut rv = Rendezvous {
        rank: spec.rank,
        world: spec.world,
        payload: Vec::new(),
        links: Vec::new(),
        timeout: spec.timeout,
        barriers: 0,
    };
    if spec.world == 1 {
        rv.payload = make_payload();
        return Ok(rv);
    }
    if spec.rank == 0 {
        let (links, payload) = serve(spec, make_payload)?;
        rv.links = links;
        rv.payload = payload;
    } else {
        let (link, payload) = join(spec)?;
        rv.links = vec![link];
        rv.payload = payload;
    }
    Ok(rv)
}

fn bind(spec: &RendezvousSpec) -> Result<TcpListener> {
    let at = format!("{}:{}", spec.addr, spec.port);
    let hint = "set MASTER_PORT to a free port (or let `--nproc-per-node` choose one)";
    TcpListener::bind((spec.addr.as_str(), spec.port)).map_err(|e| match e.kind() {
        ErrorKind::AddrInUse => {
            anyhow!("rank 0 cannot listen on {at}: the port is in use (another run?)\nhint: {hint}")
        }
        ErrorKind::AddrNotAvailable => anyhow!(
            "rank 0 cannot listen on {at}: {} is not an address of this host\nhint: MASTER_ADDR must name the \
             host rank 0 runs on (under Slurm: the first node of the job)",
            spec.addr
        ),
        _ => anyhow!("rank 0 cannot listen on {at}: {e}\nhint: check MASTER_ADDR and MASTER_PORT; {hint}"),
    })
}

/// Rank 0: admit world-1 ranks, then send the payload to all of them.
fn serve(spec: &RendezvousSpec, make_payload: impl FnOnce() -> Vec<u8>) -> Result<(Vec<TcpStream>, Vec<u8>)> {
    let listener = bind(spec)?;
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + spec.timeout;
    let mut admitted: Vec<Option<SocketAddr>> = vec![None; spec.world];
    let mut streams: Vec<Option<TcpStream>> = (0..spec.world).map(|_| None).collect();
    let mut count = 1;
    while count < spec.world {
        let (mut s, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (1..spec.world).filter(|&r| admitted[r].is_none()).collect();
                    let msg = format!(
                        "rendezvous at {}:{} timed out after {:.0}s: ranks {missing:?} never connected\nhint: check \
                         that those ranks started, that they use the same MASTER_ADDR/MASTER_PORT, and that no \
                         firewall blocks the port; raise dist.timeout_s for slow starts",
                        spec.addr,
                        spec.port,
                        spec.timeout.as_secs_f64()
                    );
                    abort_all(&mut streams, &msg);
                    bail!(msg);
                }
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(e).context("rendezvous: accepting a connection"),
        };
        s.set_nonblocking(false)?;
        s.set_read_timeout(Some(remaining(deadline).min(Duration::from_secs(10))))?;
        let hello = match read_frame(&mut s).ok().and_then(|(k, b)| decode_hello(k, &b)) {
            Some(h) => h,
            None => {
                eprintln!("harpe: rendezvous: ignored a connection from {peer} that does not speak the protocol");
                continue;
            }
        };
        if let Some(why) = mismatch(spec, &hello, &admitted, peer) {
            let msg = format!(
                "rendezvous refused: {why}\nhint: every rank must run the same binary with the same \
                               config and run token (start them with one launcher command)"
            );
            let _ = s.write_all(&frame(b'R', msg.as_bytes()));
            abort_all(&mut streams, &format!("rank 0 aborted the rendezvous: {msg}"));
            bail!(msg);
        }
        s.set_nodelay(true)?;
        admitted[hello.rank] = Some(peer);
        streams[hello.rank] = Some(s);
        count += 1;
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
fn join(spec: &RendezvousSpec) -> Result<(TcpStream, Vec<u8>)> {
    let addrs: Vec<SocketAddr> = (spec.addr.as_str(), spec.port)
        .to_socket_addrs()
        .with_context(|| {
            format!(
                "rank {}: MASTER_ADDR {:?} does not resolve\nhint: set MASTER_ADDR to rank 0's host name or IP address",
                spec.rank, spec.addr
            )
        })?
        .collect();
    let deadline = Instant::now() + spec.timeout;
    let mut s = connect(spec, &addrs, deadline)?;
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

    /// The bytes rank 0 shared (the same on every rank).
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The open connections (rank 0: rank r's at index r - 1; others: the one to rank 0), handed to the
    /// failure watch (`comms::watch`), which owns them from then on.
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
    /// The spec of this process under a launcher: address, port, rank, world and token from `env`,
    /// this binary's version, and the hash of `resolved_config`.
    pub fn from_launch(env: &crate::comms::launch::LaunchEnv, resolved_config: &str, timeout: Duration) -> Self {
        RendezvousSpec {
            addr: env.master_addr.clone(),
            port: env.master_port,
            rank: env.rank,
            world: env.world_size,
            token: env.run_token.clone(),
            version: binary_version(),
            config_hash: config_hash(resolved_config),
            timeout,
        }
    }
}
