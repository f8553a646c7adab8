//! The rendezvous wire format (see the header of `rendezvous.rs`): frames of `kind: u8, len: u32, body`,
//! little-endian, and the `H` hello every rank opens with. Also what the failure watch speaks over the
//! same connections (`frame`, `read_frame`, `put_str`).
use super::spec::RendezvousSpec;
use std::io::{ErrorKind, Read};
use std::net::TcpStream;

const MAGIC: &[u8; 8] = b"HARPERDV";
const PROTOCOL: u32 = 1;
/// Largest frame accepted (the payload is 128 bytes in practice).
const MAX_FRAME: usize = 1 << 20;

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
pub(super) struct Hello {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) hash: [u8; 32],
    pub(super) token: String,
    pub(super) version: String,
}

pub(super) fn encode_hello(spec: &RendezvousSpec) -> Vec<u8> {
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
pub(super) fn decode_hello(kind: u8, b: &[u8]) -> Option<Hello> {
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

pub(super) fn short(h: &[u8; 32]) -> String {
    hex::encode(&h[..6])
}
