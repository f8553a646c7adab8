//! Collectives between training ranks: `Comm` with the operations the loop needs, the rank `Mesh`, and
//! ZeRO ownership (`zero`, and `ZeroStage`: which state a stage shards).
//!
//! Reference: llm.c `llmc/zero.cuh`
//! (ZeRO as a no-op at one process). The non-obvious decisions: the training loop always calls the
//! collectives (gradient all-reduce, master-weight all-gather, metric reduction, checkpoint barrier),
//! so one process and many processes run the same straight-line code and `train/` has no
//! `if distributed` branch; collectives take `FlatBuf`s (host or device), never host slices. `Single`
//! leaves device buffers where they are; `Local` (threads) copies a device buffer through the host and
//! back for each collective, which is correct but slow: the NCCL backend is the GPU path. The mesh
//! separates the data-parallel rank (which data a rank reads) from the sequence-parallel rank (which
//! part of a sequence it holds); the optimizer shard and the checkpoint file names use the global rank
//! `dp_rank * sp_size + sp_rank` of `dp_size * sp_size` (ZeRO shards over every rank, as DeepSpeed-Ulysses
//! does), which is `optim-00000-of-00001` at one rank, as before.
//! `Local` wraps one rank's `LocalComm` handle (ranks as threads, `local::spawn_local` starts them; the
//! training loop does that for `dist.backend = "local"`). A shard map of ONE rank used with N ranks
//! means "replicated" (ZeRO-0: every rank owns the whole flat space), so `all_gather` is then a no-op.
//! `sequence` holds the Ulysses all-to-all for `dist.sp_degree` > 1 (its own `SpGroup` per sequence-
//! parallel group; the mesh of `Local(c, P)` is (N/P) x P).
//! `Nccl` (`--features nccl`) wraps one process's `nccl::NcclComm` (one rank per GPU; its device is
//! the run's device, `open_device`); its collectives work on device buffers in place, and a host
//! buffer handed to it travels through the device. The ZeRO exchanges use the tensor variants
//! (`all_gather_v_tensor`, `reduce_scatter_v_sum_tensor`), which keep device data on the device under
//! `Single` and `Nccl` and go through the host under `Local`; their `_start` forms run beside the
//! compute under `Nccl` (its stream) and `Local` (each rank's communication thread, `local.rs`), in
//! the tensor's own dtype under both, so the CPU tests run the program NCCL runs (`Comm::overlaps`).
//! `signature` is the collective signature check both use (`dist.check_collectives` under NCCL).
//! What this file does not do: start the NCCL group (`NcclComm::join`, called by `harpe train`);
//! `Comm::from_config` builds only `Single`. A new backend is one more variant.
#[cfg(feature = "gloo")]
pub mod gloo;
pub mod local;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod sequence;
mod started;
mod warm_up;
pub mod zero;

pub use started::Started;

use crate::config::{Backend, DistSection};
use crate::device::DeviceSpec;
use crate::flatbuf::FlatBuf;
use crate::launch::signature::CollOp;
use anyhow::{bail, Result};
#[cfg(feature = "gloo")]
use candle_core::DType;
use candle_core::{Device, Tensor};
use local::{LocalComm, ReduceOp};
#[cfg(feature = "gloo")]
use started::gloo_start;
use started::local_start;
use std::sync::Arc;
use zero::ShardMap;

/// Who this process is among the training ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mesh {
    /// data-parallel rank: which slice of the data stream this rank reads
    pub dp_rank: usize,
    /// number of data-parallel ranks
    pub dp_size: usize,
    /// sequence-parallel rank: which part of each sequence this rank holds
    pub sp_rank: usize,
    /// ranks sharing one sequence (1 = no sequence parallelism)
    pub sp_size: usize,
}

impl Mesh {
    /// The mesh of one process.
    pub fn single() -> Mesh {
        Mesh { dp_rank: 0, dp_size: 1, sp_rank: 0, sp_size: 1 }
    }

    /// Global rank: the optimizer shard this rank owns and its checkpoint file.
    pub fn rank(&self) -> usize {
        self.dp_rank * self.sp_size + self.sp_rank
    }

    /// Number of ranks in total.
    pub fn world(&self) -> usize {
        self.dp_size * self.sp_size
    }

    /// The mesh of global rank `rank` of `world`, sequence-parallel groups of `sp` consecutive ranks.
    fn of(rank: usize, world: usize, sp: usize) -> Mesh {
        let sp = sp.max(1);
        Mesh { dp_rank: rank / sp, dp_size: world / sp, sp_rank: rank % sp, sp_size: sp }
    }
}

/// Run an in-place NCCL collective `f` on `buf`'s device tensor; a host buffer travels through the
/// device and back.
#[cfg(feature = "nccl")]
fn in_place_on_device(c: &nccl::NcclComm, buf: &mut FlatBuf, f: impl FnOnce(&Tensor) -> Result<()>) -> Result<()> {
    match buf {
        FlatBuf::Device(t) => f(t),
        FlatBuf::Host(v) => {
            let t = Tensor::from_slice(v, v.len(), c.device())?;
            f(&t)?;
            v.copy_from_slice(&t.to_vec1::<f32>()?);
            Ok(())
        }
    }
}

/// The communicator of this process.
#[derive(Clone, Debug)]
pub enum Comm {
    /// One process, one device: every collective is a no-op.
    Single,
    /// One of N ranks running as threads of this process, and the sequence-parallel degree P: ranks
    /// r*P..(r+1)*P share sequences (data-parallel rank r), so the mesh is (N/P) x P.
    Local(Arc<LocalComm>, usize),
    /// One rank of a multi-process NCCL group (one GPU per rank); the sequence-parallel degree is the
    /// communicator's.
    #[cfg(feature = "nccl")]
    Nccl(Arc<nccl::NcclComm>),
    /// One rank of a multi-process Gloo group on the CPU (the process topology of an NCCL run); the
    /// sequence-parallel degree is the communicator's.
    #[cfg(feature = "gloo")]
    Gloo(Arc<gloo::GlooComm>),
}

impl Comm {
    /// The communicator `[dist]` asks for; `origin` (the config file) names where the request came from.
    pub fn from_config(dist: &DistSection, origin: &str) -> Result<Comm> {
        match dist.backend {
            Backend::Single => Ok(Comm::Single),
            Backend::Local => bail!(
                "{origin}: dist.backend = \"local\" starts its ranks as threads inside `harpe train`; a lone communicator cannot be built for it\nhint: run `harpe train --set dist.backend=local --set dist.world_size=N`, or use comms::local::spawn_local in tests"
            ),
            b @ (Backend::Nccl | Backend::Gloo) => bail!(
                "{origin}: dist.backend = \"{}\" joins a group of processes inside `harpe train` (rendezvous, one process per rank); a lone communicator cannot be built for it\nhint: run `harpe train --nproc-per-node N --set dist.backend={}` (a build with --features {}), or torchrun / srun",
                b.name(),
                b.name(),
                b.name()
            ),
        }
    }

    /// This process's place in the rank mesh.
    pub fn mesh(&self) -> Mesh {
        match self {
            Comm::Single => Mesh::single(),
            Comm::Local(c, sp) => Mesh::of(c.rank(), c.world_size(), *sp),
            #[cfg(feature = "nccl")]
            Comm::Nccl(c) => Mesh::of(c.rank(), c.world_size(), c.sp_degree()),
            #[cfg(feature = "gloo")]
            Comm::Gloo(c) => Mesh::of(c.rank(), c.world_size(), c.sp_degree()),
        }
    }

    /// The training device of this rank: the configured one, except under NCCL, where each process
    /// trains on its own GPU (`cuda:LOCAL_RANK`, opened by the communicator).
    pub fn open_device(&self, spec: &DeviceSpec, what: &str) -> Result<Device> {
        match self {
            #[cfg(feature = "nccl")]
            Comm::Nccl(c) => {
                if !matches!(spec, DeviceSpec::Cuda(_)) {
                    bail!("{what} = \"{spec}\" with dist.backend = \"nccl\"\nhint: NCCL ranks train on GPUs: set train.device = \"cuda\" (each rank uses cuda:LOCAL_RANK)");
                }
                Ok(c.device().clone())
            }
            _ => Ok(spec.open(what)?),
        }
    }

    /// Tell the group what this rank is doing now (NCCL: named if this process dies; else nothing).
    pub fn progress(&self, doing: &str) {
        match self {
            #[cfg(feature = "nccl")]
            Comm::Nccl(c) => c.progress(doing),
            #[cfg(feature = "gloo")]
            Comm::Gloo(c) => c.progress(doing),
            _ => {
                let _ = doing;
            }
        }
    }

    /// Sum `buf` over all ranks (gradients already scaled by 1 / the global token count).
    pub fn all_reduce_sum(&self, buf: &mut FlatBuf) -> Result<()> {
        match self {
            Comm::Single => {
                let _ = buf;
                Ok(())
            }
            // threads exchange host slices: a device buffer is copied through the host (NCCL reduces
            // device memory in place)
            Comm::Local(c, _) => buf.with_host_mut(|v| c.all_reduce(v, ReduceOp::Sum, "grads")),
            #[cfg(feature = "nccl")]
            Comm::Nccl(c) => in_place_on_device(c, buf, |t| c.all_reduce_sum_inplace(t, "grads")),
            #[cfg(feature = "gloo")]
            Comm::Gloo(c) => buf.with_host_mut(|v| c.all_reduce_sum(v, "grads")),
        }
    }

    /// Sum `buf` over all ranks into each rank's own range of it (per `map`; ZeRO-1's gradients): on
    /// exit this rank's range holds the sum, the other ranges are left as partial values. Half the
    /// bytes of `all_reduce_sum`, which is a reduce-scatter plus an all-gather.
    pub fn reduce_scatter_sum_in_place(&self, buf: &mut FlatBuf, map: &ShardMap) -> Result<()> {
        if map.world() != self.mesh().world() {
            bail!("internal: a shard map for {} ranks used with {} ranks", map.world(), self.mesh().world());
        }
        let counts: Vec<usize> = (0..map.world()).map(|r| map.flat_range(r).len()).collect();
        match self {
            Comm::Single => Ok(()),
            // through the host for a device buffer, as all_reduce_sum
            Comm::Local(c, _) => buf.with_host_mut(|v| {
                let own = map.flat_range(c.rank());
                let mut mine = vec![0f32; own.len()];
                c.reduce_scatter_v(v, &mut mine, &counts, ReduceOp::Sum, "grads")?;
                v[own].copy_from_slice(&mine);
                Ok(())
            }),
            #[cfg(feature = "nccl")]
            Comm::Nccl(c) => in_place_on_device(c, buf, |t| c.reduce_scatter_v_inplace(t, &counts, "grads")),
            #[cfg(feature = "gloo")]
            Comm::Gloo(c) => buf.with_host_mut(|v| {
                let own = map.flat_range(c.rank());
                let mine = c.reduce_scatter_v_sum_start(v.to_vec(), &counts, "grads")?.wait()?;
                v[own].copy_from_slice(&mine);
                Ok(())
            }),
        }
    }

    /// Sum a few f64 scalars (loss sums, token counts, error flags) over all ranks.
    pub fn all_reduce_sum_f64(&self, vals: &mut [f64]) -> Result<()> {
        match self {
            Comm::Single => {
                let _ = vals;
                Ok(())
            }
            Comm::Local(c, _) => c.all_reduce(vals, ReduceOp::Sum, "scalars"),
            #[cfg(feature = "nccl")]
            Comm::Nccl(c) => c.all_reduce_sum_f64(vals),
            #[cfg(feature = "gloo")]
            Comm::Gloo(c) => c.all_reduce_sum(vals, "scalars"),
        }
    }

    /// On entry every rank's own range of `buf` (per `map`) is valid; on exit the whole buffer is.
    pub fn all_gather(&self, buf: &mut FlatBuf, map: &ShardMap) -> Result<()> {
        if map.world() == 1 {
            return Ok(()); // replicated ownership (ZeRO-0): every rank already holds everything
        }
        if map.world() != self.mesh().world() {
            bail!("internal: a shard map for {} ranks used with {} ranks", map.world(), self.mesh().world());
        }
        match self {
            Comm::Single => {
                let _ = buf;
                Ok(())
            }
            Comm::Local(c, _) => {
                let counts: Vec<usize> = (0..map.world()).map(|r| map.flat_range(r).len()).collect();
                // through the host for a device buffer, as all_reduce_sum
                buf.with_host_mut(|v| c.all_gather_v_inplace(v, &counts, "weights"))
            }
            #[cfg(feature = "nccl")]
            Comm::Nccl(c) => {
                let counts: Vec<usize> = (0..map.world()).map(|r| map.flat_range(r).len()).collect();
                in_place_on_device(c, buf, |t| c.all_gather_v_inplace(t, &counts, "weights"))
            }
            #[cfg(feature = "gloo")]
            Comm::Gloo(_) => {
                let counts: Vec<usize> = (0..map.world()).map(|r| map.flat_range(r).len()).collect();
                let own = map.flat_range(self.mesh().rank());
                buf.with_host_mut(|v| {
                    let mut out = vec![0f32; v.len()];
                    self.all_gather_v(&v[own.clone()], &mut out, &counts, "weights")?;
                    v.copy_from_slice(&out);
                    Ok(())
                })
            }
        }
    }

    /// Wait until every rank has arrived.
    pub fn barrier(&self) -> Result<()> {
        match self {
            Comm::Single => Ok(()),
            Comm::Local(c, _) => c.barrier("barrier"),
            #[cfg(feature = "nccl")]
            Comm::Nccl(c) => c.barrier("barrier"),
            #[cfg(feature = "gloo")]
            Comm::Gloo(c) => c.barrier("barrier"),
        }
    }

    /// All-gather of slices of lengths `counts` (rank order) into `output`, their concatenation; this
    /// rank contributes `input` (`counts[rank]` values). ZeRO-3 gathers one layer's weights with it.
    pub fn all_gather_v(&self, input: &[f32], output: &mut [f32], counts: &[usize], label: &str) -> Result<()> {
        match self {
            Comm::Single => {
                if input.len() != output.len() {
                    bail!("internal: all_gather \"{label}\" of {} values into {}", input.len(), output.len());
                }
                output.copy_from_slice(input);
                Ok(())
            }
            Comm::Local(c, _) => c.all_gather_v(input, output, counts, label),
            #[cfg(feature = "nccl")]
            Comm::Nccl(c) => {
                let t = c.all_gather_v(&Tensor::from_slice(input, input.len(), c.device())?, counts, label)?;
                output.copy_from_slice(&t.to_vec1::<f32>()?);
                Ok(())
            }
            #[cfg(feature = "gloo")]
            Comm::Gloo(c) => {
                let bytes: Vec<u8> = input.iter().flat_map(|x| x.to_le_bytes()).collect();
                let out = c.all_gather_v_bytes_start(bytes, counts, (4, DType::F32), label)?.wait()?;
                if out.len() != output.len() * 4 {
                    bail!("internal: all_gather \"{label}\" of {} bytes into {} values", out.len(), output.len());
                }
                for (o, c) in output.iter_mut().zip(out.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
                Ok(())
            }
        }
    }

    /// `all_gather_v` on a 1-D f32 tensor: the gathered values on the input's device. `Single` and
    /// `Nccl` keep device data on the device; `Local` goes through the host.
    pub fn all_gather_v_tensor(&self, input: &Tensor, counts: &[usize], label: &str) -> Result<Tensor> {
        match self {
            Comm::Single => {
                if counts.iter().sum::<usize>() != input.elem_count() {
                    bail!("internal: all_gather \"{label}\" of {} values with counts {counts:?}", input.elem_count());
                }
                Ok(input.copy()?)
            }
            // in the input's dtype, as NCCL (bf16 weights move as bf16)
            Comm::Local(..) => self.all_gather_v_tensor_start(input, counts, label)?.wait(),
            #[cfg(feature = "nccl")]
            Comm::Nccl(c) => c.all_gather_v(&input.contiguous()?, counts, label),
            #[cfg(feature = "gloo")]
            Comm::Gloo(_) => self.all_gather_v_tensor_start(input, counts, label)?.wait(),
        }
    }

    /// `all_gather_v_tensor`, started: under NCCL (its stream) and `Local` (the rank's communication
    /// thread) the exchange runs on while the compute goes on (the result is joined by
    /// `Started::wait`; ZeRO-3's prefetch of the next layer's weights); under `Single` it is complete on
    /// return.
    pub fn all_gather_v_tensor_start(&self, input: &Tensor, counts: &[usize], label: &str) -> Result<Started> {
        match self {
            Comm::Local(c, _) => local_start(c, CollOp::AllGather, input, counts, label),
            #[cfg(feature = "nccl")]
            Comm::Nccl(c) => {
                let input = input.contiguous()?;
                Ok(Started::nccl(c, c.all_gather_v_start(&input, counts, label)?, input))
            }
            #[cfg(feature = "gloo")]
            Comm::Gloo(c) => gloo_start(c, CollOp::AllGather, input, counts, label),
            _ => Ok(Started::ready(self.all_gather_v_tensor(input, counts, label)?)),
        }
    }

    /// Whether collectives run beside the compute (NCCL's own stream, `Local`'s communication
    /// thread): only then is starting one early (ZeRO-3's weight prefetch) worth the memory it holds,
    /// and only then do ZeRO 2-3 take the started (tensor) paths for host shards too.
    pub fn overlaps(&self) -> bool {
        match self {
            Comm::Single => false,
            Comm::Local(..) => true,
            #[cfg(feature = "nccl")]
            Comm::Nccl(_) => true,
            #[cfg(feature = "gloo")]
            Comm::Gloo(_) => true,
        }
    }

    /// `reduce_scatter_v_sum_tensor`, started: under NCCL and `Local` the exchange runs on while the
    /// compute goes on (its result is joined by `Started::wait`); under `Single` it is complete on
    /// return.
    pub fn reduce_scatter_v_sum_tensor_start(&self, input: &Tensor, counts: &[usize], label: &str) -> Result<Started> {
        match self {
            Comm::Local(c, _) => local_start(c, CollOp::ReduceScatter, input, counts, label),
            #[cfg(feature = "nccl")]
            Comm::Nccl(c) => {
                let input = input.contiguous()?;
                Ok(Started::nccl(c, c.reduce_scatter_v_sum_start(&input, counts, label)?, input))
            }
            #[cfg(feature = "gloo")]
            Comm::Gloo(c) => gloo_start(c, CollOp::ReduceScatter, input, counts, label),
            _ => Ok(Started::ready(self.reduce_scatter_v_sum_tensor(input, counts, label)?)),
        }
    }

    /// `reduce_scatter_v_sum_tensor_start` of host f32 values handed over as they are: `Local` deposits
    /// `input` itself (a tensor input is copied out of the tensor first: one group's copy fewer at the
    /// peak of ZeRO 2-3's backward on CPU); the other backends take it as a host tensor (no copy).
    pub fn reduce_scatter_v_sum_host_start(&self, input: Vec<f32>, counts: &[usize], label: &str) -> Result<Started> {
        match self {
            Comm::Local(c, _) => {
                Ok(Started::local(c.reduce_scatter_v_start(input, counts, ReduceOp::Sum, label)?, &Device::Cpu))
            }
            #[cfg(feature = "gloo")]
            Comm::Gloo(c) => {
                let issued = c.reduce_scatter_v_sum_start(input, counts, label)?;
                Ok(Started::deferred(Box::new(move || {
                    let out = issued.wait()?;
                    let n = out.len();
                    Ok(Tensor::from_vec(out, n, &Device::Cpu)?)
                })))
            }
            _ => {
                let n = input.len();
                self.reduce_scatter_v_sum_tensor_start(&Tensor::from_vec(input, n, &Device::Cpu)?, counts, label)
            }
        }
    }

    /// `reduce_scatter_v_sum` on a 1-D f32 tensor: this rank's summed slice on the input's device.
    pub fn reduce_scatter_v_sum_tensor(&self, input: &Tensor, counts: &[usize], label: &str) -> Result<Tensor> {
        match self {
            Comm::Single => {
                if counts.iter().sum::<usize>() != input.elem_count() {
                    bail!(
                        "internal: reduce_scatter \"{label}\" of {} values with counts {counts:?}",
                        input.elem_count()
                    );
                }
                Ok(input.copy()?)
            }
            // in the input's dtype, as NCCL
            Comm::Local(..) => self.reduce_scatter_v_sum_tensor_start(input, counts, label)?.wait(),
            #[cfg(feature = "nccl")]
            Comm::Nccl(c) => c.reduce_scatter_v_sum(&input.contiguous()?, counts, label),
            #[cfg(feature = "gloo")]
            Comm::Gloo(_) => self.reduce_scatter_v_sum_tensor_start(input, counts, label)?.wait(),
        }
    }

    /// Reduce-scatter (sum) of `input`, the concatenation of slices of lengths `counts`: this rank gets
    /// slice `rank` summed over ranks in `output`. ZeRO-3 hands one layer's gradients to their owners.
    pub fn reduce_scatter_v_sum(&self, input: &[f32], output: &mut [f32], counts: &[usize], label: &str) -> Result<()> {
        match self {
            Comm::Single => {
                if input.len() != output.len() {
                    bail!("internal: reduce_scatter \"{label}\" of {} values into {}", input.len(), output.len());
                }
                output.copy_from_slice(input);
                Ok(())
            }
            Comm::Local(c, _) => c.reduce_scatter_v(input, output, counts, ReduceOp::Sum, label),
            #[cfg(feature = "nccl")]
            Comm::Nccl(c) => {
                let t = c.reduce_scatter_v_sum(&Tensor::from_slice(input, input.len(), c.device())?, counts, label)?;
                output.copy_from_slice(&t.to_vec1::<f32>()?);
                Ok(())
            }
            #[cfg(feature = "gloo")]
            Comm::Gloo(c) => {
                let out = c.reduce_scatter_v_sum_start(input.to_vec(), counts, label)?.wait()?;
                if out.len() != output.len() {
                    bail!("internal: reduce_scatter \"{label}\" of {} values into {}", out.len(), output.len());
                }
                output.copy_from_slice(&out);
                Ok(())
            }
        }
    }

    /// Barrier that also agrees on success: true only when `ok` is true on every rank.
    pub fn all_ok(&self, ok: bool) -> Result<bool> {
        let mut bad = [if ok { 0.0 } else { 1.0 }];
        self.all_reduce_sum_f64(&mut bad)?;
        Ok(bad[0] == 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_rank_owns_everything_and_collectives_keep_values() {
        let c = Comm::from_config(&DistSection::default(), "test.toml").unwrap();
        assert_eq!(c.mesh(), Mesh::single());
        assert_eq!((c.mesh().rank(), c.mesh().world()), (0, 1));
        let mut g = FlatBuf::from_vec(vec![1.0f32, -2.0]);
        c.all_reduce_sum(&mut g).unwrap();
        assert_eq!(g.host().unwrap(), &[1.0, -2.0]);
        // device buffers stay on their device
        let mut d =
            g.try_clone().unwrap().placed(&crate::flatbuf::Placement::Device(candle_core::Device::Cpu)).unwrap();
        c.all_reduce_sum(&mut d).unwrap();
        let l = crate::model::layout::ParamLayout::new(&[("w".into(), vec![2])]);
        c.all_gather(&mut d, &ShardMap::new(&l, 1, zero::Split::Slices)).unwrap();
        assert!(matches!(d, FlatBuf::Device(_)) && d == g);
        assert!(c.all_ok(true).unwrap() && !c.all_ok(false).unwrap());
    }

    #[test]
    fn group_backends_are_not_built_alone_and_say_how_to_start_them() {
        for b in [Backend::Local, Backend::Nccl] {
            let d = DistSection { backend: b, ..Default::default() };
            let e = Comm::from_config(&d, "run.toml").unwrap_err().to_string();
            assert!(e.contains("run.toml: dist.backend") && e.contains(b.name()) && e.contains("hint:"), "{e}");
        }
    }

    #[test]
    fn tensor_collectives_equal_the_slice_ones() {
        use std::time::Duration;
        let counts = [3usize, 0, 2];
        let out = local::spawn_local(3, Duration::from_secs(20), |lc| {
            let c = Comm::Local(lc, 1);
            let r = c.mesh().rank();
            let mine: Vec<f32> = (0..counts[r]).map(|i| (10 * r + i) as f32).collect();
            let t = Tensor::from_slice(&mine, mine.len(), &Device::Cpu)?;
            let g = c.all_gather_v_tensor(&t, &counts, "w")?.to_vec1::<f32>()?;
            let mut g2 = vec![0f32; 5];
            c.all_gather_v(&mine, &mut g2, &counts, "w")?;
            let full: Vec<f32> = (0..5).map(|i| (i + r) as f32 * 0.5).collect();
            let ft = Tensor::from_slice(&full, 5, &Device::Cpu)?;
            let s = c.reduce_scatter_v_sum_tensor(&ft, &counts, "g")?.to_vec1::<f32>()?;
            let mut s2 = vec![0f32; counts[r]];
            c.reduce_scatter_v_sum(&full, &mut s2, &counts, "g")?;
            Ok((r, g, g2, s, s2))
        })
        .unwrap();
        for (r, g, g2, s, s2) in out {
            assert_eq!(g, vec![0.0, 1.0, 2.0, 20.0, 21.0]);
            assert_eq!((&g, &s), (&g2, &s2), "rank {r}");
            // slice r of sum over ranks of (i + rank) / 2 = 1.5 i + 1.5
            let want: Vec<f32> = [0usize, 3, 3][r..]
                .iter()
                .take(1)
                .flat_map(|&o| (o..o + counts[r]).map(|i| 1.5 * i as f32 + 1.5))
                .collect();
            assert_eq!(s, want, "rank {r}");
        }
        // one rank: a copy, and a mismatch is an error
        let t = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        assert_eq!(Comm::Single.all_gather_v_tensor(&t, &[2], "w").unwrap().to_vec1::<f32>().unwrap(), [1.0, 2.0]);
        assert!(Comm::Single.reduce_scatter_v_sum_tensor(&t, &[3], "g").is_err());
    }

    #[test]
    fn local_collectives_accept_device_buffers() {
        use crate::flatbuf::Placement;
        use std::time::Duration;
        let l = crate::model::layout::ParamLayout::new(&[("w".into(), vec![5])]);
        let map = ShardMap::new(&l, 2, zero::Split::Slices);
        let out = local::spawn_local(2, Duration::from_secs(20), |lc| {
            let c = Comm::Local(lc, 1);
            let r = c.mesh().rank() as f32;
            let dp = Placement::Device(candle_core::Device::Cpu);
            let mut g = FlatBuf::from_vec(vec![1.0 + r; 5]).placed(&dp)?;
            c.all_reduce_sum(&mut g)?;
            let mut w = FlatBuf::from_vec(vec![10.0 * (r + 1.0); 5]).placed(&dp)?;
            c.all_gather(&mut w, &map)?;
            // ZeRO-1's gradient exchange: each rank's own range summed, the rest left as it was
            let mut h = FlatBuf::from_vec((0..5).map(|i| i as f32 + 100.0 * r).collect()).placed(&dp)?;
            c.reduce_scatter_sum_in_place(&mut h, &map)?;
            anyhow::ensure!([&g, &w, &h].iter().all(|b| matches!(b, FlatBuf::Device(_))));
            Ok((g.to_host()?.to_vec(), w.to_host()?.to_vec(), h.to_host()?.to_vec()))
        })
        .unwrap();
        for (r, (g, w, h)) in out.into_iter().enumerate() {
            assert_eq!(g, vec![3.0; 5]);
            assert_eq!(w, vec![10.0, 10.0, 10.0, 20.0, 20.0]);
            // rank 0 owns 0..2 (sums 2i + 100), rank 1 owns 2..5
            let own = map.flat_range(r);
            for (i, &x) in h.iter().enumerate() {
                let want = if own.contains(&i) { 2.0 * i as f32 + 100.0 } else { i as f32 + 100.0 * r as f32 };
                assert_eq!(x, want, "rank {r} elem {i}");
            }
        }
        // one rank and a map of another world
        let mut b = FlatBuf::from_vec(vec![1.0; 5]);
        Comm::Single.reduce_scatter_sum_in_place(&mut b, &ShardMap::new(&l, 1, zero::Split::Slices)).unwrap();
        assert_eq!(b.host().unwrap(), &[1.0; 5]);
        assert!(Comm::Single.reduce_scatter_sum_in_place(&mut b, &map).is_err());
    }
}
