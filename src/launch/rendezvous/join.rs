//! The other ranks' side of the rendezvous: find rank 0 (at `MASTER_ADDR:MASTER_PORT`, or where it
//! published itself in torchrun's agent store), connect with backoff until the deadline, introduce
//! this rank and wait for the payload or the reason it was refused.
use super::spec::{host_port, remaining, Meeting, RendezvousSpec, STORE_KEY};
use super::wire::{encode_hello, read_frame};
use crate::launch::env::TokenOrigin;
use crate::launch::store::StoreClient;
use anyhow::{anyhow, bail, Context, Result};
use std::io::{ErrorKind, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Ranks 1.. under `AgentStore`: read rank 0's address (and drawn token) from the agent's store, connect
/// and introduce this rank. An address where nothing answers is re-read until the deadline: it may be
/// the previous attempt's rank 0 (see `STORE_KEY`), which the new one replaces.
pub(super) fn join_via_store(spec: &RendezvousSpec, deadline: Instant) -> Result<(RendezvousSpec, TcpStream, Vec<u8>)> {
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
pub(super) fn join(spec: &RendezvousSpec, deadline: Instant) -> Result<(TcpStream, Vec<u8>)> {
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
