//! How a Gloo rank names the cause of a failed collective (see the header of `gloo.rs`): the watch's
//! wait for a rank that failed first, else a roll call through the group's store naming the ranks (and
//! hosts) that do not answer, and Gloo's own timeout shortened by what that naming takes. Apart from
//! the collectives, which only call `GlooShared::blame`.
use crate::launch::store::StoreClient;
use crate::launch::watch::Watch;
use anyhow::Result;
use std::time::{Duration, Instant};

/// What the handle and its issued collectives share: the failure watch, and where to hold a roll call.
pub(super) struct GlooShared {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) watch: Watch,
    pub(super) roll: RollCall,
}

/// How long a roll call waits for the other ranks to answer through the store.
const ROLL_CALL: Duration = Duration::from_secs(3);

/// How long a failed collective waits for the failure watch to name a rank that failed first.
const WATCH_WAIT: Duration = Duration::from_secs(3);

/// Gloo's own timeout for a collective: `dist.timeout_s` less what naming the cause takes afterwards
/// (the watch's wait, then a roll call), so a rank that meets a silent peer has stopped, cause named,
/// within `dist.timeout_s` as the setting promises; never under half of it, for tiny timeouts.
pub(super) fn collective_timeout(timeout: Duration) -> Duration {
    timeout.saturating_sub(WATCH_WAIT + ROLL_CALL).max(timeout / 2)
}

/// The store the group met through, and its keys: each rank's Gloo host is published at the join, so a
/// roll call after a collective timed out can name the ranks that are unreachable and where they are.
pub(super) struct RollCall {
    pub(super) host: String,
    pub(super) port: u16,
    pub(super) prefix: String,
}

impl RollCall {
    pub(super) fn host_key(&self, r: usize) -> String {
        format!("{}host/{r}", self.prefix)
    }

    /// After a collective timed out with no failure named: mark this rank present in the store, wait
    /// `ROLL_CALL` for the others, and say who did not answer (and at which host), or that the store
    /// itself is out of reach.
    fn call(&self, rank: usize, world: usize) -> String {
        let deadline = Instant::now() + ROLL_CALL;
        let at = format!("{}:{}", self.host, self.port);
        let res = (|| -> Result<Vec<(usize, String)>> {
            let mut c = StoreClient::connect(&self.host, self.port, deadline)?;
            c.set(&format!("{}alive/{rank}", self.prefix), b"1")?;
            loop {
                let mut missing = vec![];
                for r in (0..world).filter(|&r| r != rank) {
                    if !c.check(&format!("{}alive/{r}", self.prefix))? {
                        let host = if c.check(&self.host_key(r))? { c.get(&self.host_key(r))? } else { vec![] };
                        missing.push((r, String::from_utf8_lossy(&host).into_owned()));
                    }
                }
                if missing.is_empty() || Instant::now() >= deadline {
                    return Ok(missing);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })();
        match res {
            Err(e) => format!(
                "rank {rank} cannot reach the group's store at {at} either ({e:#}): that host, or the link to it, is \
                 down or unreachable from here"
            ),
            Ok(m) if m.is_empty() => format!("every rank answered a roll call through the store at {at}"),
            Ok(m) => {
                let ranks: Vec<usize> = m.iter().map(|x| x.0).collect();
                let mut hosts: Vec<&str> = m.iter().map(|x| x.1.as_str()).filter(|h| !h.is_empty()).collect();
                hosts.dedup();
                format!(
                    "ranks {ranks:?} (at {}) did not answer a roll call through the store at {at} within {:.0}s: \
                     unreachable from here (their host, or the link to it, is down) or stopped",
                    hosts.join(", "),
                    ROLL_CALL.as_secs_f64()
                )
            }
        }
    }
}

impl GlooShared {
    /// A collective failed with `e`: when another rank failed first (the watch names it within a short
    /// wait) that is the cause; else this rank tells the group and returns its own error.
    pub(super) fn blame(&self, e: anyhow::Error) -> anyhow::Error {
        match self.watch.wait_failure(WATCH_WAIT) {
            Some(f) if f.rank != self.rank => e.context(format!(
                "{f}\nhint: rank {} failed first; this rank stopped because of it (its own log says more)",
                f.rank
            )),
            Some(_) => e,
            None => {
                let roll = self.roll.call(self.rank, self.world);
                self.watch.report("in a collective", &format!("{e:#}; {roll}"));
                e.context(format!(
                    "{roll}\nhint: check that every host of the group is up and that the network between the hosts \
                     passes the ports of the rendezvous, the store and Gloo; raise dist.timeout_s if a rank is \
                     legitimately slow"
                ))
            }
        }
    }
}
