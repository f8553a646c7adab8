//! A client of PyTorch's TCPStore, just enough to meet through torchrun's agent store: set, check and
//! get of a key.
//!
//! Reference: torch's `TCPStore.cpp` (client), `store/TCPStoreBackend.hpp` (`QueryType`,
//! `validationMagicNumber`) and `TCPStoreLibUvBackend.cpp` (the server torchrun runs), torch 2.15;
//! tested against the real server under torchrun (tests/stage_comms/comms_torchrun.rs). Wire format, in the
//! machine's byte order (little-endian on every platform torch ships for): a request is a `QueryType`
//! byte and its arguments; a key or value is a u64 length and its bytes. A new connection first sends
//! `VALIDATE` + u32 magic `0x3C85F7CE` (no reply; the server drops a connection that sends anything
//! else first). `SET key value`: no reply. `CHECK u64 n, n keys`: a byte, 0 = all present, 1 = not.
//! `GET key`: u64 length + bytes. `PING u32 nonce`: the nonce back.
//!
//! The non-obvious decisions: keys go out with torch's client prefix `/`, as torch's own clients send
//! them, so Python's `store.get("harpe/rendezvous/0")` reads what harpe wrote; waiting for a key polls
//! `CHECK` (every 50 ms, bounded by the caller's deadline) rather than sending `WAIT`, whose reply never
//! comes when the key is never set and would leave the connection inside a request at our timeout; a
//! `PING` right after connecting proves that the port really is a TCPStore, so a wrong
//! `MASTER_ADDR:MASTER_PORT` fails with a clear message instead of a confusing read later.
//!
//! `StoreServer` serves the same requests (and only those), so a launch without torchrun (harpe's own
//! `--nproc-per-node`, Slurm) gives Gloo's rendezvous the store it would have under torchrun: rank 0
//! serves it, every rank is a `StoreClient` of it.
//!
//! What it does not do: any request beyond these (compare-set, add, delete, queues, WAIT).
use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const CHECK: u8 = 5;
const PING: u8 = 13;
const MAGIC: u32 = 0x3C85_F7CE;
/// torch's TCPStore client puts this before every key (`keyPrefix_`).
const KEY_PREFIX: &str = "/";
/// Largest value accepted from the store (ours are a few dozen bytes).
const MAX_VALUE: u64 = 1 << 20;
/// How long one request may wait for its reply.
const REPLY_WAIT: Duration = Duration::from_secs(10);

/// An open, validated connection to a TCPStore.
pub struct StoreClient {
    s: TcpStream,
    /// `host:port` as given, for messages.
    at: String,
}

fn put_bytes(b: &mut Vec<u8>, v: &[u8]) {
    b.extend_from_slice(&(v.len() as u64).to_le_bytes());
    b.extend_from_slice(v);
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

impl StoreClient {
    /// Connect to the TCPStore at `host:port` (retrying until `deadline`), validate, and ping it.
    pub fn connect(host: &str, port: u16, deadline: Instant) -> Result<StoreClient> {
        let at = format!("{host}:{port}");
        let hint = "under torchrun MASTER_ADDR:MASTER_PORT is the agent's TCPStore \
                    (TORCHELASTIC_USE_AGENT_STORE=True); check that the agent on the first node is running";
        let addrs: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .with_context(|| format!("torchrun's store {at}: {host:?} does not resolve\nhint: {hint}"))?
            .collect();
        let mut backoff = Duration::from_millis(50);
        loop {
            let mut last = None;
            for a in &addrs {
                match TcpStream::connect_timeout(a, remaining(deadline).min(Duration::from_secs(5))) {
                    Ok(s) => {
                        let mut c = StoreClient { s, at: at.clone() };
                        c.s.set_nodelay(true)?;
                        c.s.set_write_timeout(Some(REPLY_WAIT))?;
                        c.handshake()
                            .with_context(|| format!("{at} does not answer as a PyTorch TCPStore\nhint: {hint}"))?;
                        return Ok(c);
                    }
                    Err(e) => last = Some(e),
                }
            }
            if Instant::now() >= deadline {
                let why = last.map(|e| e.to_string()).unwrap_or_else(|| "no address".into());
                bail!("could not reach torchrun's store at {at} ({why})\nhint: {hint}");
            }
            std::thread::sleep(backoff.min(remaining(deadline)));
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    /// VALIDATE, then PING with a nonce that must come back.
    fn handshake(&mut self) -> Result<()> {
        let mut b = vec![VALIDATE];
        b.extend_from_slice(&MAGIC.to_le_bytes());
        let nonce = std::process::id() ^ 0x5a5a_0000;
        b.push(PING);
        b.extend_from_slice(&nonce.to_le_bytes());
        self.s.write_all(&b)?;
        let mut back = [0u8; 4];
        self.read_reply(&mut back)?;
        if u32::from_le_bytes(back) != nonce {
            bail!("the ping came back as {:?}, not the nonce sent", back);
        }
        Ok(())
    }

    fn read_reply(&mut self, buf: &mut [u8]) -> Result<()> {
        self.s.set_read_timeout(Some(REPLY_WAIT))?;
        self.s.read_exact(buf).with_context(|| format!("reading a reply from torchrun's store at {}", self.at))
    }

    /// The address this host uses to reach the store: the interface the other nodes, which reach the
    /// same store, can most likely reach this host on.
    pub fn local_ip(&self) -> Result<IpAddr> {
        Ok(self.s.local_addr()?.ip())
    }

    /// The store's address as this host reaches it.
    pub fn peer_ip(&self) -> Result<IpAddr> {
        Ok(self.s.peer_addr()?.ip())
    }

    /// Set `key` to `value`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let mut b = vec![SET];
        put_bytes(&mut b, format!("{KEY_PREFIX}{key}").as_bytes());
        put_bytes(&mut b, value);
        self.s.write_all(&b).with_context(|| format!("setting {key:?} in torchrun's store at {}", self.at))
    }

    /// Whether `key` is set.
    pub fn check(&mut self, key: &str) -> Result<bool> {
        let mut b = vec![CHECK];
        b.extend_from_slice(&1u64.to_le_bytes());
        put_bytes(&mut b, format!("{KEY_PREFIX}{key}").as_bytes());
        self.s.write_all(&b).with_context(|| format!("asking torchrun's store at {} for {key:?}", self.at))?;
        let mut r = [0u8; 1];
        self.read_reply(&mut r)?;
        match r[0] {
            0 => Ok(true),
            1 => Ok(false),
            x => bail!("torchrun's store at {} answered CHECK with {x}\nhint: is it a PyTorch TCPStore?", self.at),
        }
    }

    /// The value of `key` (which must be set: the server's answer to a missing key differs by backend).
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>> {
        let mut b = vec![GET];
        put_bytes(&mut b, format!("{KEY_PREFIX}{key}").as_bytes());
        self.s.write_all(&b).with_context(|| format!("reading {key:?} from torchrun's store at {}", self.at))?;
        let mut n = [0u8; 8];
        self.read_reply(&mut n)?;
        let n = u64::from_le_bytes(n);
        if n > MAX_VALUE {
            bail!("torchrun's store at {} sent a {n}-byte value for {key:?}\nhint: is it a PyTorch TCPStore?", self.at);
        }
        let mut v = vec![0u8; n as usize];
        self.read_reply(&mut v)?;
        Ok(v)
    }

    /// Wait until `key` is set and return its value; `None` when `deadline` passes first.
    pub fn wait_get(&mut self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>> {
        loop {
            if self.check(key)? {
                return self.get(key).map(Some);
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(50).min(remaining(deadline)));
        }
    }
}

/// A TCPStore server of the requests `StoreClient` sends (VALIDATE, SET, GET, CHECK, PING), one thread
/// per connection, keys and values in memory until the process ends. A connection that breaks the
/// protocol (wrong magic, an unknown request, a key or value over `MAX_VALUE`, a GET of a missing key)
/// is dropped; the server goes on.
pub struct StoreServer {
    port: u16,
}

impl StoreServer {
    /// Serve on `addr` at a port the kernel picks.
    pub fn bind(addr: &str) -> Result<StoreServer> {
        let l = TcpListener::bind((addr, 0)).with_context(|| {
            format!(
                "cannot serve the rendezvous store on {addr}\nhint: MASTER_ADDR must be an address of rank 0's host"
            )
        })?;
        let port = l.local_addr()?.port();
        let kv: Arc<Mutex<HashMap<Vec<u8>, Vec<u8>>>> = Arc::default();
        std::thread::Builder::new().name("harpe-store".into()).spawn(move || {
            for s in l.incoming().flatten() {
                let kv = Arc::clone(&kv);
                let _ = std::thread::Builder::new().name("harpe-store-conn".into()).spawn(move || serve(s, &kv));
            }
        })?;
        Ok(StoreServer { port })
    }

    /// The port it serves on.
    pub fn port(&self) -> u16 {
        self.port
    }
}

/// One connection's requests until it closes or breaks the protocol.
fn serve(mut s: TcpStream, kv: &Mutex<HashMap<Vec<u8>, Vec<u8>>>) -> Option<()> {
    let _ = s.set_nodelay(true);
    fn byte(s: &mut TcpStream) -> Option<u8> {
        let mut b = [0u8; 1];
        s.read_exact(&mut b).ok().map(|_| b[0])
    }
    fn u64_of(s: &mut TcpStream) -> Option<u64> {
        let mut n = [0u8; 8];
        s.read_exact(&mut n).ok().map(|_| u64::from_le_bytes(n))
    }
    fn bytes(s: &mut TcpStream) -> Option<Vec<u8>> {
        let n = u64_of(s).filter(|&n| n <= MAX_VALUE)?;
        let mut v = vec![0u8; n as usize];
        s.read_exact(&mut v).ok().map(|_| v)
    }
    let mut m = [0u8; 4];
    if byte(&mut s)? != VALIDATE || s.read_exact(&mut m).is_err() || u32::from_le_bytes(m) != MAGIC {
        return None;
    }
    let lock = || kv.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        match byte(&mut s)? {
            PING => {
                s.read_exact(&mut m).ok()?;
                s.write_all(&m).ok()?;
            }
            SET => {
                let (k, v) = (bytes(&mut s)?, bytes(&mut s)?);
                lock().insert(k, v);
            }
            CHECK => {
                let n = u64_of(&mut s).filter(|&n| n <= 1024)?;
                let keys: Vec<Vec<u8>> = (0..n).map(|_| bytes(&mut s)).collect::<Option<_>>()?;
                let all = keys.iter().all(|k| lock().contains_key(k));
                s.write_all(&[if all { 0 } else { 1 }]).ok()?;
            }
            GET => {
                let v = lock().get(&bytes(&mut s)?).cloned()?;
                s.write_all(&(v.len() as u64).to_le_bytes()).ok()?;
                s.write_all(&v).ok()?;
            }
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::net::TcpListener;

    /// A TCPStore server of our own reading of the protocol (one connection at a time), to test the
    /// client's framing without torch; the real server is tested under torchrun.
    fn fake_store() -> u16 {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let mut kv: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
            for s in l.incoming() {
                let mut s = s.unwrap();
                let byte = |s: &mut TcpStream| -> Option<u8> {
                    let mut b = [0u8; 1];
                    s.read_exact(&mut b).ok().map(|_| b[0])
                };
                let bytes = |s: &mut TcpStream| -> Vec<u8> {
                    let mut n = [0u8; 8];
                    s.read_exact(&mut n).unwrap();
                    let mut v = vec![0u8; u64::from_le_bytes(n) as usize];
                    s.read_exact(&mut v).unwrap();
                    v
                };
                assert_eq!(byte(&mut s), Some(VALIDATE));
                let mut m = [0u8; 4];
                s.read_exact(&mut m).unwrap();
                assert_eq!(u32::from_le_bytes(m), MAGIC);
                while let Some(q) = byte(&mut s) {
                    match q {
                        PING => {
                            s.read_exact(&mut m).unwrap();
                            s.write_all(&m).unwrap();
                        }
                        SET => {
                            let k = bytes(&mut s);
                            let v = bytes(&mut s);
                            kv.insert(k, v);
                        }
                        CHECK => {
                            let mut n = [0u8; 8];
                            s.read_exact(&mut n).unwrap();
                            let k = bytes(&mut s);
                            s.write_all(&[if kv.contains_key(&k) { 0 } else { 1 }]).unwrap();
                        }
                        GET => {
                            let v = kv[&bytes(&mut s)].clone();
                            s.write_all(&(v.len() as u64).to_le_bytes()).unwrap();
                            s.write_all(&v).unwrap();
                        }
                        _ => panic!("unexpected query {q}"),
                    }
                }
            }
        });
        port
    }

    #[test]
    fn set_check_get_round_trip_with_torchs_key_prefix() {
        let port = fake_store();
        let soon = || Instant::now() + Duration::from_secs(5);
        let mut c = StoreClient::connect("127.0.0.1", port, soon()).unwrap();
        assert!(!c.check("harpe/k").unwrap());
        assert_eq!(c.wait_get("harpe/k", Instant::now() + Duration::from_millis(120)).unwrap(), None);
        c.set("harpe/k", b"127.0.0.1:5\nabc").unwrap();
        assert!(c.check("harpe/k").unwrap());
        assert_eq!(c.get("harpe/k").unwrap(), b"127.0.0.1:5\nabc");
        assert_eq!(c.local_ip().unwrap().to_string(), "127.0.0.1");
    }

    #[test]
    fn the_server_answers_the_client_and_survives_a_bad_connection() {
        let server = StoreServer::bind("127.0.0.1").unwrap();
        // a connection that does not speak the protocol is dropped; the server goes on
        let mut junk = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
        junk.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let soon = || Instant::now() + Duration::from_secs(5);
        let mut a = StoreClient::connect("127.0.0.1", server.port(), soon()).unwrap();
        let mut b = StoreClient::connect("127.0.0.1", server.port(), soon()).unwrap();
        assert!(!b.check("k").unwrap());
        a.set("k", &[7u8; 300]).unwrap();
        assert_eq!(b.wait_get("k", soon()).unwrap(), Some(vec![7u8; 300]));
        a.set("k", b"v2").unwrap();
        // a SET has no reply: a's next request (served in order on its connection) proves it landed
        assert!(a.check("k").unwrap());
        assert_eq!(b.get("k").unwrap(), b"v2");
    }

    #[test]
    fn a_port_that_is_not_a_tcpstore_is_a_clear_error() {
        // a server that accepts and answers the ping with something else
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut b = [0u8; 10];
            s.read_exact(&mut b).unwrap();
            s.write_all(b"HTTP").unwrap();
        });
        let e = StoreClient::connect("127.0.0.1", port, Instant::now() + Duration::from_secs(5)).err().unwrap();
        let e = format!("{e:#}");
        assert!(e.contains("does not answer as a PyTorch TCPStore") && e.contains("hint:"), "{e}");
    }
}
