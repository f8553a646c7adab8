//! What a rank leaves the rendezvous with: `Rendezvous`, the open connection(s) to the group (rank 0: one
//! per rank; the others: the one to rank 0), the shared payload, and the barrier over them.
use super::spec::remaining;
use super::wire::{frame, read_frame};
use anyhow::{bail, Context, Result};
use std::io::{ErrorKind, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// An admitted rank's open connection(s) to the group, after the payload was shared.
pub struct Rendezvous {
    pub(super) rank: usize,
    pub(super) world: usize,
    /// `host:port` where rank 0 admitted the group.
    pub(super) at: String,
    pub(super) payload: Vec<u8>,
    /// Rank 0: the stream of rank r at index r - 1. Others: the stream to rank 0.
    pub(super) links: Vec<TcpStream>,
    pub(super) timeout: Duration,
    pub(super) barriers: u64,
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
