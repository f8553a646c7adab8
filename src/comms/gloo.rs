//! `Gloo`: one rank per process on the CPU, collectives through Gloo's TCP transport (the library
//! PyTorch uses for CPU tensors), through the C interface in native/gloo_shim.cc.
//!
//! What it is for: the process topology of a multi-GPU NCCL run — one process per rank, started by
//! `--nproc-per-node`, torchrun or srun; the same rendezvous (token, binary version and config hash
//! checked), the same failure watch over the rendezvous connections, the same collective-signature
//! check — with every piece running, on machines without GPUs.
//!
//! Reference: Gloo's `rendezvous::Context::connectFullMesh` (every pair of ranks connected, addresses
//! exchanged through a key-value `Store`) and its options-style collectives (`gloo/allreduce.h`,
//! `reduce.h`, `allgatherv.h`, `alltoall.h`, `broadcast.h`, `barrier.h`); torch's ProcessGroupGloo.
//! The non-obvious decisions:
//! - The store Gloo's rendezvous needs is the one the launch already has: torchrun's agent TCPStore
//!   under torchrun, and under harpe's own launcher or Slurm a TCPStore that rank 0 serves
//!   (`launch::store::StoreServer`), its port handed to the others as the rendezvous payload (where
//!   NCCL hands its unique id). Each rank's Gloo listener binds the address it reaches the store from,
//!   the interface the other hosts can reach it on.
//! - Every collective runs on one communication thread per rank, in the order the rank issues them
//!   (Gloo's contexts are not thread-safe), so the `_start` forms run beside the compute exactly as
//!   `Local`'s do and ZeRO 2-3 take the same overlapped paths as under NCCL. Each collective has its
//!   own tag (its sequence number).
//! - Gloo has no reduce-scatter over uneven slices: it is one `reduce` per root, each root receiving its
//!   own slice summed (NCCL's reduce-scatter-v here is one ncclReduce per root too). Sums are in f32
//!   (bf16 inputs are widened, summed and rounded once) and f64 for the per-step scalars.
//! - A failure: Gloo returns an error when a peer's connection breaks and times out after
//!   `dist.timeout_s` less the few seconds naming the cause takes (`collective_timeout`, so the rank
//!   has stopped within `dist.timeout_s`); it then waits briefly for the watch to name the rank that failed first
//!   (its own error otherwise, told to the group), so every rank stops naming the cause. A timeout
//!   that no failure explains (a host or the link to it gone silent: no connection breaks) adds a roll
//!   call through the store: the ranks that do not answer are named with their hosts, and a rank that
//!   cannot reach the store says so.
//!
//! What it does not do: device memory (a CUDA buffer travels through the host), or abort a collective
//! under way (Gloo has no abort: the peer's closed connection or the timeout ends it).
//!
//! The files: `gloo/context.rs` (the C interface, the store callbacks, one context's collectives),
//! `gloo/failure.rs` (naming the cause of a failure: the watch, the roll call, the timeout); this file
//! joins the group and runs the collectives on the communication thread.
mod context;
mod failure;

pub use context::GlooSum;

use crate::launch::env::LaunchEnv;
use crate::launch::rendezvous::{rendezvous, Meeting, RendezvousSpec};
use crate::launch::signature::{CollOp, GroupFailure, SigLog};
use crate::launch::store::{StoreClient, StoreServer};
use crate::launch::watch::Watch;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::DType;
use context::{Ctx, StoreAdapter};
use failure::{collective_timeout, GlooShared, RollCall};
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The contexts the communication thread owns: the world's and (sequence parallelism) this rank's group's.
struct Lanes {
    world: Ctx,
    sp: Option<Ctx>,
}

type Job = Box<dyn FnOnce(&Lanes) + Send>;

/// A collective issued to the communication thread; `wait` gives its result.
pub struct Issued<R> {
    rx: mpsc::Receiver<Result<R>>,
    comm: Arc<GlooShared>,
}

impl<R> Issued<R> {
    /// Block until the collective completed (or failed: at most `dist.timeout_s`), naming the rank
    /// that failed first when another one did.
    pub fn wait(self) -> Result<R> {
        let r = self.rx.recv().unwrap_or_else(|_| Err(anyhow!("internal: the communication thread ended early")));
        r.map_err(|e| self.comm.blame(e))
    }
}

/// One rank of a Gloo group (see the file header).
pub struct GlooComm {
    rank: usize,
    world: usize,
    sp: usize,
    shared: Arc<GlooShared>,
    lane: Mutex<Option<(mpsc::Sender<Job>, JoinHandle<()>)>>,
    seq: AtomicU64,
    sigs: Mutex<SigLog>,
}

impl std::fmt::Debug for GlooComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GlooComm(rank {} of {}, sp {})", self.rank, self.world, self.sp)
    }
}

impl GlooComm {
    /// Join the group this process's launcher describes (`env`): the rendezvous (token, binary and
    /// config hash checked), the failure watch, then Gloo's full mesh (and one per sequence-parallel
    /// group of `sp` consecutive ranks) through the launch's store.
    pub fn join(
        env: &LaunchEnv,
        resolved_config: &str,
        timeout: Duration,
        sp: usize,
        check_every: u64,
    ) -> Result<GlooComm> {
        let (rank, world) = (env.rank, env.world_size);
        let sp = sp.max(1);
        if !world.is_multiple_of(sp) {
            bail!("dist.sp_degree = {sp} does not divide the world size {world}\nhint: choose a divisor of {world}");
        }
        let deadline = Instant::now() + timeout;
        let spec = RendezvousSpec::from_launch(env, resolved_config, timeout);
        // rank 0 serves the store (unless torchrun's agent already does) and hands its port out as the payload
        let mut server = None;
        let mut serve_err = None;
        let rv = rendezvous(&spec, || match spec.meet {
            // torchrun's store outlives an attempt of the workers, and its agents may disagree on the attempt's
            // number: rank 0 names this attempt's Gloo keys itself
            Meeting::AgentStore { .. } => rand::random::<u64>().to_le_bytes().to_vec(),
            Meeting::Listen => match StoreServer::bind(&spec.addr) {
                Ok(s) => {
                    let port = s.port().to_le_bytes().to_vec();
                    server = Some(s);
                    port
                }
                Err(e) => {
                    serve_err = Some(e);
                    vec![]
                }
            },
        })?;
        if let Some(e) = serve_err {
            return Err(e.context("rank 0 could not serve the rendezvous store"));
        }
        let (store_host, store_port, prefix) = match spec.meet {
            Meeting::AgentStore { .. } => {
                let attempt = hex::encode(rv.payload());
                (spec.addr.clone(), spec.port, format!("harpe/gloo/{attempt}/"))
            }
            Meeting::Listen => {
                let p = rv.payload();
                if p.len() != 2 {
                    bail!("rank {rank}: the rendezvous delivered no store address (rank 0 could not serve one; its log says why)");
                }
                // rank 0's address as the rendezvous reached it ("host:port"; "[v6]:port")
                let at = rv.rank0_addr();
                let host = at.rsplit_once(':').map_or(at, |(h, _)| h).trim_start_matches('[').trim_end_matches(']');
                (host.to_string(), u16::from_le_bytes([p[0], p[1]]), "harpe/gloo/".to_string())
            }
        };
        let mut client = StoreClient::connect(&store_host, store_port, deadline)
            .with_context(|| format!("rank {rank}: reaching the rendezvous store at {store_host}:{store_port}"))?;
        let host = client.local_ip()?.to_string();
        let roll = RollCall { host: store_host.clone(), port: store_port, prefix: prefix.clone() };
        client.set(&roll.host_key(rank), host.as_bytes())?;
        let watch = Watch::start(rv, Box::new(|_f: &GroupFailure| {}))?;
        let shared = Arc::new(GlooShared { rank, world, watch, roll });
        let fail = |doing: &str, e: anyhow::Error| -> anyhow::Error {
            shared.watch.report(doing, &format!("{e:#}"));
            e
        };
        let mut store = StoreAdapter { client, deadline, last: vec![], err: CString::default() };
        let world_ctx = Ctx::connect(rank, world, &host, &prefix, &mut store, collective_timeout(timeout))
            .map_err(|e| fail("connecting the Gloo group", e))?;
        let sp_ctx = if sp > 1 {
            let group = rank / sp;
            let p = format!("{prefix}sp{group}/");
            Some(
                Ctx::connect(rank % sp, sp, &host, &p, &mut store, collective_timeout(timeout))
                    .map_err(|e| fail("connecting its sequence-parallel group", e))?,
            )
        } else {
            None
        };
        let _ = server; // rank 0's store is served from its own thread for the life of the process
        let (tx, rx) = mpsc::channel::<Job>();
        let lanes = Lanes { world: world_ctx, sp: sp_ctx };
        let thread = std::thread::Builder::new().name(format!("harpe-gloo-{rank}")).spawn(move || {
            for job in rx {
                job(&lanes);
            }
        })?;
        Ok(GlooComm {
            rank,
            world,
            sp,
            shared,
            lane: Mutex::new(Some((tx, thread))),
            seq: AtomicU64::new(0),
            sigs: Mutex::new(SigLog::new(check_every)),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The sequence-parallel degree the contexts were built for.
    pub fn sp_degree(&self) -> usize {
        self.sp
    }

    /// Tell rank 0 what this rank is doing now (named if this process dies).
    pub fn progress(&self, doing: &str) {
        self.shared.watch.progress(doing);
    }

    /// The first failure in the group, if any.
    pub fn failure(&self) -> Option<GroupFailure> {
        self.shared.watch.failure()
    }

    /// This rank failed `doing` something: tell the group.
    pub fn report_failure(&self, doing: &str, reason: &str) {
        self.shared.watch.report(doing, reason);
    }

    /// Leave the group normally (the watch's peers are told).
    pub fn finish(&self) {
        self.shared.watch.finish();
    }

    /// Issue `f` to the communication thread as collective `(op, count, dtype)`: recorded in the
    /// signature log, given the next tag; refused at once after a failure in the group.
    fn issue<R: Send + 'static>(
        &self,
        (op, count, dtype): (CollOp, usize, DType),
        label: &str,
        f: impl FnOnce(&Lanes, u32, &str) -> Result<R> + Send + 'static,
    ) -> Result<Issued<R>> {
        if let Some(f) = self.shared.watch.failure() {
            bail!("{f}\nhint: rank {} failed first; this rank stopped because of it", f.rank);
        }
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let window = self.sigs.lock().unwrap_or_else(|p| p.into_inner()).record(op, count, dtype);
        if let Some(w) = window {
            self.shared.watch.check_signatures(w);
        }
        let what = format!("rank {}: collective #{seq} {} \"{label}\"", self.rank, op.name());
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move |lanes| {
            let _ = tx.send(f(lanes, seq as u32, &what));
        });
        let lane = self.lane.lock().unwrap_or_else(|p| p.into_inner());
        let (sender, _) = lane.as_ref().ok_or_else(|| anyhow!("internal: the Gloo group was closed"))?;
        sender.send(job).map_err(|_| anyhow!("internal: the communication thread of rank {} ended", self.rank))?;
        Ok(Issued { rx, comm: Arc::clone(&self.shared) })
    }

    /// Sum f32 values (gradients) or f64 values (the per-step scalars) over all ranks in place.
    pub fn all_reduce_sum<T: GlooSum>(&self, v: &mut [T], label: &str) -> Result<()> {
        let data = v.to_vec();
        let out = self
            .issue((CollOp::AllReduce, v.len(), T::DTYPE), label, move |l, tag, what| {
                let mut data = data;
                l.world.all_reduce(&mut data, tag, what)?;
                Ok(data)
            })?
            .wait()?;
        v.copy_from_slice(&out);
        Ok(())
    }

    /// Check that `counts` has one entry per rank summing to `n`.
    fn check_counts(&self, counts: &[usize], n: usize, what: &str) -> Result<()> {
        if counts.len() != self.world || counts.iter().sum::<usize>() != n {
            bail!("internal: {what}: counts {counts:?} for {n} values over {} ranks", self.world);
        }
        Ok(())
    }

    /// Reduce-scatter-v (sum) of f32: `input` the concatenation of slices of `counts`; this rank gets
    /// slice `rank` summed over ranks. One `reduce` per root that owns values.
    pub fn reduce_scatter_v_sum_start(
        &self,
        input: Vec<f32>,
        counts: &[usize],
        label: &str,
    ) -> Result<Issued<Vec<f32>>> {
        self.check_counts(counts, input.len(), &format!("reduce_scatter \"{label}\""))?;
        let (counts, me) = (counts.to_vec(), self.rank);
        self.issue((CollOp::ReduceScatter, input.len(), DType::F32), label, move |l, tag, what| {
            let mut out = vec![0f32; counts[me]];
            let mut off = 0;
            for (root, &c) in counts.iter().enumerate() {
                if c > 0 {
                    let sub = tag.wrapping_mul(256).wrapping_add(root as u32 % 256);
                    let mut scratch = [0f32; 0];
                    let dst: &mut [f32] = if root == me { &mut out } else { &mut scratch };
                    l.world.reduce(&input[off..off + c], dst, root, sub, what)?;
                }
                off += c;
            }
            Ok(out)
        })
    }

    /// All-gather-v of raw elements (`counts[r]` elements of `size` bytes from rank r), in rank order.
    pub fn all_gather_v_bytes_start(
        &self,
        input: Vec<u8>,
        counts: &[usize],
        (size, dtype): (usize, DType),
        label: &str,
    ) -> Result<Issued<Vec<u8>>> {
        let n: usize = counts.iter().sum();
        self.check_counts(counts, n, &format!("all_gather \"{label}\""))?;
        if counts.get(self.rank).map(|c| c * size) != Some(input.len()) {
            bail!(
                "internal: all_gather \"{label}\": {} bytes in, {} elements of {size} bytes expected",
                input.len(),
                counts[self.rank]
            );
        }
        let bytes: Vec<usize> = counts.iter().map(|c| c * size).collect();
        self.issue((CollOp::AllGather, n, dtype), label, move |l, tag, what| {
            let mut out = vec![0u8; n * size];
            if n > 0 {
                l.world.all_gather_v(&input, &mut out, &bytes, tag, what)?;
            }
            Ok(out)
        })
    }

    /// Equal-chunk all-to-all within this rank's sequence-parallel group (Ulysses), of raw elements.
    pub fn sp_all_to_all_bytes(&self, input: Vec<u8>, (count, dtype): (usize, DType), label: &str) -> Result<Vec<u8>> {
        if self.sp < 2 {
            bail!("internal: all_to_all \"{label}\" without a sequence-parallel group");
        }
        if !input.len().is_multiple_of(self.sp) {
            bail!("rank {}: all_to_all \"{label}\": {} bytes do not split into {} chunks\nhint: split the sequence/heads into equal chunks", self.rank, input.len(), self.sp);
        }
        self.issue((CollOp::AllToAll, count, dtype), label, move |l, tag, what| {
            let ctx = l.sp.as_ref().ok_or_else(|| anyhow!("internal: no sequence-parallel context"))?;
            let mut out = vec![0u8; input.len()];
            ctx.all_to_all(&input, &mut out, tag, what)?;
            Ok(out)
        })?
        .wait()
    }

    /// `buf` of rank `root` copied into `buf` on every rank.
    pub fn broadcast(&self, buf: &mut [u8], root: usize, label: &str) -> Result<()> {
        let data = buf.to_vec();
        let out = self
            .issue((CollOp::Broadcast, buf.len(), DType::U8), label, move |l, tag, what| {
                let mut data = data;
                l.world.broadcast(&mut data, root, tag, what)?;
                Ok(data)
            })?
            .wait()?;
        buf.copy_from_slice(&out);
        Ok(())
    }

    /// Wait until every rank arrived (and every collective issued before is done).
    pub fn barrier(&self, label: &str) -> Result<()> {
        self.issue((CollOp::Barrier, 0, DType::U8), label, |l, tag, what| l.world.barrier(tag, what))?.wait()
    }
}

impl Drop for GlooComm {
    fn drop(&mut self) {
        // the queue closes: the thread finishes what was issued, then frees the contexts
        if let Some((tx, thread)) = self.lane.lock().unwrap_or_else(|p| p.into_inner()).take() {
            drop(tx);
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::env::{rank_threads, LaunchSource, RunToken};

    /// `world` ranks of one Gloo group as threads of this test (each its own contexts, as processes
    /// would be), each running `f`; the results in rank order.
    fn group<R: Send + 'static>(
        world: usize,
        sp: usize,
        f: impl Fn(&GlooComm) -> Result<R> + Send + Sync + 'static,
    ) -> Vec<R> {
        rank_threads(world, move |rank, port| {
            let env = LaunchEnv {
                source: LaunchSource::Torchrun,
                rank,
                world_size: world,
                local_rank: rank,
                local_world_size: Some(world),
                master_addr: "127.0.0.1".into(),
                master_port: port,
                run_token: RunToken::from(format!("unit-{port}").as_str()),
            };
            let c = GlooComm::join(&env, "config", Duration::from_secs(30), sp, 1).unwrap();
            let r = f(&c).unwrap();
            c.finish();
            r
        })
    }

    #[test]
    fn every_collective_gives_the_values_of_its_definition() {
        let world = 3;
        let out = group(world, 1, move |c| {
            let r = c.rank();
            // all-reduce f32 and f64
            let mut a: Vec<f32> = (0..5).map(|i| (i * 10 + r) as f32).collect();
            c.all_reduce_sum(&mut a, "a")?;
            let mut s = [r as f64 + 0.5, 1e-300];
            c.all_reduce_sum(&mut s, "s")?;
            // reduce-scatter over uneven counts, one of them empty
            let counts = [2usize, 0, 3];
            let input: Vec<f32> = (0..5).map(|i| (100 * r + i) as f32).collect();
            let mine = c.reduce_scatter_v_sum_start(input, &counts, "rs")?.wait()?;
            // all-gather of bf16 values over uneven counts
            let vals: Vec<half::bf16> = (0..counts[r]).map(|i| half::bf16::from_f32((r * 10 + i) as f32)).collect();
            let bytes: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
            let g = c.all_gather_v_bytes_start(bytes, &counts, (2, DType::BF16), "ag")?.wait()?;
            let g: Vec<f32> = g.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
            // broadcast from rank 2, then a barrier
            let mut b = vec![r as u8; 4];
            c.broadcast(&mut b, 2, "b")?;
            c.barrier("end")?;
            Ok((a, s, mine, g, b))
        });
        for (r, (a, s, mine, g, b)) in out.into_iter().enumerate() {
            assert_eq!(a, (0..5).map(|i| (30 * i + 3) as f32).collect::<Vec<_>>(), "rank {r}: all-reduce");
            assert_eq!(s, [0.5 + 1.5 + 2.5, 3e-300], "rank {r}: f64 all-reduce");
            let offs = [0usize, 2, 2];
            let want: Vec<f32> = (0..[2, 0, 3][r]).map(|i| (300 + 3 * (offs[r] + i)) as f32).collect();
            assert_eq!(mine, want, "rank {r}: reduce-scatter-v");
            assert_eq!(g, [0.0, 1.0, 20.0, 21.0, 22.0], "rank {r}: all-gather-v");
            assert_eq!(b, [2u8; 4], "rank {r}: broadcast");
        }
    }

    #[test]
    fn sequence_parallel_groups_exchange_within_themselves() {
        // 4 ranks, SP 2: groups {0, 1} and {2, 3}; chunk j of rank i's input goes to rank j of its group
        let out = group(4, 2, |c| {
            let r = c.rank() as u8;
            c.sp_all_to_all_bytes(vec![r * 10, r * 10 + 1], (2, DType::U8), "a2a")
        });
        assert_eq!(out, [vec![0, 10], vec![1, 11], vec![20, 30], vec![21, 31]]);
    }

    #[test]
    fn a_rank_that_leaves_mid_collective_is_an_error_that_names_it() {
        let out = group(2, 1, |c| {
            c.barrier("joined")?; // both ends of every pair are up before rank 1 leaves
            if c.rank() == 1 {
                c.report_failure("in a test", "leaving on purpose");
                return Ok(String::new());
            }
            std::thread::sleep(Duration::from_millis(300));
            let e = c.barrier("after").err().map(|e| format!("{e:#}")).unwrap_or_default();
            Ok(e)
        });
        assert!(out[0].contains("rank 1") && out[0].contains("leaving on purpose"), "{}", out[0]);
    }
}
