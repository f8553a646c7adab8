//! Rank 0's side of the rendezvous: bind (or, under torchrun, take a port and publish it in the agent's
//! store), admit the ranks concurrently with each hello judged (token first, then world, rank, binary and
//! config hash), refuse strays, abort the whole group on a rank of this run that differs, and send the
//! payload. The decisions are in the header of `rendezvous.rs`.
use super::spec::{host_port, remaining, Meeting, RendezvousSpec, STORE_KEY};
use super::wire::{decode_hello, frame, read_frame, short, Hello};
use crate::launch::env::TokenOrigin;
use crate::launch::store::StoreClient;
use anyhow::{anyhow, bail, Context, Result};
use std::io::{ErrorKind, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long an accepted connection may take to introduce itself before it is dropped.
pub const HANDSHAKE_WAIT: Duration = Duration::from_secs(10);
/// Handshakes in flight at once; further connections wait in the listen backlog.
const MAX_HANDSHAKES: usize = 256;

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
pub(super) struct Seat {
    pub(super) spec: RendezvousSpec,
    pub(super) loopback: Option<IpAddr>,
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

/// Rank 0: the listener and where the others meet it (under `AgentStore`: the address and port just
/// bound, and the token drawn, published in the agent's store).
pub(super) fn listen(spec: &RendezvousSpec, deadline: Instant) -> Result<(TcpListener, Seat)> {
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
pub(super) fn serve(
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
