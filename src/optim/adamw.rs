//! AdamW on flat fp32 master weights and moments (`FlatBuf`s) of the part of the flat parameter space
//! this rank owns; ownership comes from `comms::zero::ShardMap`, so ZeRO-1 is "each rank its shard".
//!
//! Reference: Loshchilov & Hutter (decoupled weight decay); torch `optim/adamw.py` `_single_tensor_adamw`
//! (the order of operations below is torch's: decay, lerp m, v, bias corrections, addcdiv).
//! The non-obvious decisions: one step counter for all parameters (torch keeps one per tensor, always
//! equal in practice); the per-group weight decay is resolved to per-slice values at construction from
//! the shard map's (parameter, element range) slices; `step` reads this rank's part of the full-length
//! gradient buffer, so a ZeRO-2 reduce-scatter can fill that part in place. State is private: the
//! checkpoint code reads it through `master/m/v/t` and restores it with `restore`.
//! The state lives where `params` does (`FlatBuf` placement): host loops for the host variant (the
//! reference), the fused kernel kernels/adamw.cu for a CUDA buffer (`ops::cuda::adamw_step_tensors`, in
//! place, one launch per run of equal weight decay), and the same arithmetic as candle ops for a device
//! buffer on a CPU tensor (`step_candle`: how tests check the device path without a GPU; bit-identical
//! to the host loops, as every operation is the same f32 operation in the same order).
//! What this file does not do: gradient clipping, communication or the write-back of updated weights
//! into the model (grads.rs, comms/).
use crate::comms::zero::ShardMap;
use crate::config::OptimSection;
use crate::flatbuf::{FlatBuf, Placement};
use crate::model::layout::{ParamGroup, ParamLayout};
use anyhow::{bail, Result};
use candle_core::Tensor;
use rayon::prelude::*;
use std::ops::Range;

/// AdamW hyper-parameters (the learning rate comes from the schedule each step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWHyper {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub wd_matrix: f32,
    pub wd_embedding: f32,
    pub wd_norm: f32,
}

impl AdamWHyper {
    /// Hyper-parameters from `[optim]`.
    pub fn from_config(o: &OptimSection) -> AdamWHyper {
        AdamWHyper {
            beta1: o.beta1 as f32,
            beta2: o.beta2 as f32,
            eps: o.eps as f32,
            wd_matrix: o.weight_decay as f32,
            wd_embedding: o.embedding_weight_decay() as f32,
            wd_norm: o.weight_decay_norm as f32,
        }
    }

    fn wd(&self, g: ParamGroup) -> f32 {
        match g {
            ParamGroup::Matrix => self.wd_matrix,
            ParamGroup::Embedding => self.wd_embedding,
            ParamGroup::Norm => self.wd_norm,
        }
    }
}

/// Optimizer state of one rank: fp32 master weights, first and second moments of its shard.
#[derive(Debug)]
pub struct AdamW {
    hp: AdamWHyper,
    /// the slice of the flat parameter space owned here (a shard is contiguous, see `ShardMap`)
    range: Range<usize>,
    master: FlatBuf,
    m: FlatBuf,
    v: FlatBuf,
    /// number of updates applied (torch's `step`)
    t: u64,
    /// (local range, weight decay) pieces covering `0..range.len()`, one per owned parameter slice
    segments: Vec<(Range<usize>, f32)>,
}

/// (local range, weight decay) of each parameter slice `rank` owns in `map`.
fn segments(layout: &ParamLayout, map: &ShardMap, rank: usize, hp: AdamWHyper) -> Vec<(Range<usize>, f32)> {
    let start = map.flat_range(rank).start;
    map.slices(rank)
        .iter()
        .map(|s| (s.flat.start - start..s.flat.end - start, hp.wd(layout.params[s.param].group)))
        .collect()
}

impl AdamW {
    /// State for the shard `rank` owns in `map`, master weights copied from `params` (the whole flat
    /// space, on the device the state should live on).
    pub fn new(layout: &ParamLayout, params: &FlatBuf, map: &ShardMap, rank: usize, hp: AdamWHyper) -> Result<AdamW> {
        let range = map.flat_range(rank);
        Ok(AdamW {
            hp,
            master: params.slice_to_owned(range.clone())?,
            m: params.zeros_like(range.len())?,
            v: params.zeros_like(range.len())?,
            t: 0,
            segments: segments(layout, map, rank, hp),
            range,
        })
    }

    /// State for the shard `rank` owns in `map` from saved values (a resume): fp32 `master`, `m`, `v` of
    /// exactly that range after `t` updates, moved to placement `p`. No initial weights are needed.
    pub fn from_state(
        (layout, map, rank): (&ParamLayout, &ShardMap, usize),
        hp: AdamWHyper,
        [master, m, v]: [FlatBuf; 3],
        t: u64,
        p: &Placement,
    ) -> Result<AdamW> {
        let range = map.flat_range(rank);
        let n = range.len();
        if master.len() != n || m.len() != n || v.len() != n {
            bail!("internal: restoring {}/{}/{} values into a shard of {n}", master.len(), m.len(), v.len());
        }
        let segments = segments(layout, map, rank, hp);
        Ok(AdamW { hp, master: master.placed(p)?, m: m.placed(p)?, v: v.placed(p)?, t, range, segments })
    }

    /// The slice of the flat parameter space this state covers.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// fp32 master weights of the shard.
    pub fn master(&self) -> &FlatBuf {
        &self.master
    }

    /// First moments of the shard.
    pub fn m(&self) -> &FlatBuf {
        &self.m
    }

    /// Second moments of the shard.
    pub fn v(&self) -> &FlatBuf {
        &self.v
    }

    /// Number of updates applied so far.
    pub fn t(&self) -> u64 {
        self.t
    }

    /// Replace the state with values read from a checkpoint (lengths must match the shard); they are
    /// moved to this state's placement (a host checkpoint resumes into device state and back).
    pub fn restore(&mut self, master: FlatBuf, m: FlatBuf, v: FlatBuf, t: u64) -> Result<()> {
        let n = self.range.len();
        if master.len() != n || m.len() != n || v.len() != n {
            bail!("internal: restoring {}/{}/{} values into a shard of {n}", master.len(), m.len(), v.len());
        }
        let p = self.master.placement();
        (self.master, self.m, self.v, self.t) = (master.placed(&p)?, m.placed(&p)?, v.placed(&p)?, t);
        Ok(())
    }

    /// Forget the moments and the step count (a stage configured with `reset_optimizer`).
    pub fn reset_moments(&mut self) -> Result<()> {
        self.m.fill(0.0)?;
        self.v.fill(0.0)?;
        self.t = 0;
        Ok(())
    }

    /// One update with learning rate `lr`; `grads` is either the full-length flat gradient buffer, of
    /// which this rank reads its own range, or exactly this rank's shard of it (ZeRO-3).
    pub fn step(&mut self, grads: &FlatBuf, lr: f64) -> Result<()> {
        // a shard-length buffer starts at this rank's range (a full one is longer unless range = 0..n)
        let off = if grads.len() == self.range.len() { 0 } else { self.range.start };
        if grads.len() < off + self.range.len() {
            bail!("internal: a gradient buffer of {} values for a shard ending at {}", grads.len(), self.range.end);
        }
        self.t += 1;
        let AdamWHyper { beta1, beta2, eps, .. } = self.hp;
        let bc1 = 1.0 - (beta1 as f64).powi(self.t as i32);
        let bc2_sqrt = (1.0 - (beta2 as f64).powi(self.t as i32)).sqrt();
        let step_size = (lr / bc1) as f32;
        let (bc2_sqrt, lr) = (bc2_sqrt as f32, lr as f32);
        if let FlatBuf::Device(g) = grads {
            return self.step_device(g, off, lr, step_size, bc2_sqrt);
        }
        let grad = &grads.host()?[off..off + self.range.len()];
        let (master, m, v) = (self.master.host_mut()?, self.m.host_mut()?, self.v.host_mut()?);
        for (seg, wd) in &self.segments {
            let decay = 1.0 - lr * wd;
            let c = StepConsts { decay, beta1, beta2, eps, step_size, bc2_sqrt };
            let (p, m, v, g) = (&mut master[seg.clone()], &mut m[seg.clone()], &mut v[seg.clone()], &grad[seg.clone()]);
            // Elementwise, so the pieces on rayon give the same bits as one loop (7 f32 streams: at 25M
            // parameters one thread's loop was ~5% of a CPU step).
            p.par_chunks_mut(PAR_CHUNK)
                .zip(m.par_chunks_mut(PAR_CHUNK))
                .zip(v.par_chunks_mut(PAR_CHUNK))
                .zip(g.par_chunks(PAR_CHUNK))
                .for_each(|(((p, m), v), g)| adamw_loop(p, m, v, g, c));
        }
        Ok(())
    }

    /// The step on device buffers: the fused kernel on CUDA, `step_candle` on a CPU tensor.
    fn step_device(&mut self, grad: &Tensor, off: usize, lr: f32, step_size: f32, bc2_sqrt: f32) -> Result<()> {
        let (Some(master), Some(m), Some(v)) =
            (self.master.device_tensor(), self.m.device_tensor(), self.v.device_tensor())
        else {
            bail!("internal: a device gradient buffer for optimizer state in host memory");
        };
        #[cfg(feature = "cuda")]
        if master.device().is_cuda() {
            let AdamWHyper { beta1, beta2, eps, .. } = self.hp;
            let s = crate::ops::cuda::AdamWStep { lr, beta1, beta2, eps, step_size, bc2_sqrt, grad_scale: 1.0 };
            crate::ops::cuda::adamw_step_tensors(master, m, v, grad, off, &self.segments, s)?;
            return Ok(());
        }
        let _ = (master, m, v);
        self.step_candle(grad, off, lr, step_size, bc2_sqrt)
    }

    /// The host loops' arithmetic as candle ops on a segment at a time, written back with `slice_set`.
    fn step_candle(&mut self, grad: &Tensor, off: usize, lr: f32, step_size: f32, bc2_sqrt: f32) -> Result<()> {
        let AdamWHyper { beta1, beta2, eps, .. } = self.hp;
        let dev = grad.device().clone();
        let k = |x: f32| Tensor::new(x, &dev);
        for (seg, wd) in self.segments.clone() {
            let (s, n) = (seg.start, seg.len());
            let part = |b: &FlatBuf| -> Result<Tensor> {
                let t = b.device_tensor().ok_or_else(|| anyhow::anyhow!("internal: host optimizer state"))?;
                Ok(t.narrow(0, s, n)?)
            };
            let g = grad.narrow(0, off + s, n)?;
            let p = part(&self.master)?.broadcast_mul(&k(1.0 - lr * wd)?)?;
            let m0 = part(&self.m)?;
            let m = (&m0 + (&g - &m0)?.broadcast_mul(&k(1.0 - beta1)?)?)?;
            let v = (part(&self.v)?.broadcast_mul(&k(beta2)?)? + g.broadcast_mul(&k(1.0 - beta2)?)?.mul(&g)?)?;
            let denom = v.sqrt()?.broadcast_div(&k(bc2_sqrt)?)?.broadcast_add(&k(eps)?)?;
            let p = (p - m.broadcast_mul(&k(step_size)?)?.div(&denom)?)?;
            self.master.set_range_device(s, &p)?;
            self.m.set_range_device(s, &m)?;
            self.v.set_range_device(s, &v)?;
        }
        Ok(())
    }
}

/// Elements per rayon task of the host step.
const PAR_CHUNK: usize = 1 << 16;

/// The per-slice constants of one host step.
#[derive(Clone, Copy)]
struct StepConsts {
    decay: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    step_size: f32,
    bc2_sqrt: f32,
}

/// The host step on one piece: torch's order (decay, lerp m, v, bias corrections, addcdiv).
fn adamw_loop(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], c: StepConsts) {
    let StepConsts { decay, beta1, beta2, eps, step_size, bc2_sqrt } = c;
    for i in 0..p.len() {
        p[i] *= decay;
        m[i] += (1.0 - beta1) * (g[i] - m[i]);
        v[i] = v[i] * beta2 + (1.0 - beta2) * g[i] * g[i];
        let denom = v[i].sqrt() / bc2_sqrt + eps;
        p[i] -= step_size * m[i] / denom;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comms::zero::Split;

    fn hp(wd: f32) -> AdamWHyper {
        AdamWHyper { beta1: 0.9, beta2: 0.95, eps: 1e-8, wd_matrix: wd, wd_embedding: wd, wd_norm: 0.0 }
    }

    fn opt(l: &ParamLayout, p: &[f32], world: usize, rank: usize, wd: f32) -> AdamW {
        let map = ShardMap::new(l, world, Split::Slices);
        AdamW::new(l, &FlatBuf::from_vec(p.to_vec()), &map, rank, hp(wd)).unwrap()
    }

    #[test]
    fn first_step_moves_each_weight_by_lr_against_the_gradient_sign() {
        // With bias correction, |update| of step 1 is lr * |g| / (|g| + eps) ~= lr, whatever |g| is.
        let l = ParamLayout::new(&[("w".into(), vec![3])]);
        let mut o = opt(&l, &[1.0, 1.0, 1.0], 1, 0, 0.0);
        o.step(&FlatBuf::from_vec(vec![0.5, -2.0, 1e-3]), 0.1).unwrap();
        let d: Vec<f32> = o.master().host().unwrap().iter().map(|p| p - 1.0).collect();
        assert!((d[0] + 0.1).abs() < 1e-5 && (d[1] - 0.1).abs() < 1e-5 && (d[2] + 0.1).abs() < 1e-4, "{d:?}");
    }

    #[test]
    fn norms_get_no_decay_and_shards_equal_the_whole() {
        let l = ParamLayout::new(&[("a.weight".into(), vec![3]), ("model.norm.weight".into(), vec![2])]);
        let p0 = [1.0, 2.0, 3.0, 4.0, 5.0];
        let g = FlatBuf::from_vec(vec![0.0f32; 5]);
        let mut o = opt(&l, &p0, 1, 0, 0.5);
        o.step(&g, 0.1).unwrap();
        // zero gradient: only decoupled decay acts, p *= 1 - lr * wd on matrices, norms untouched
        assert_eq!(o.master().host().unwrap(), &[0.95, 1.9, 2.85, 4.0, 5.0]);
        // two shards that cut through the middle of a parameter give the same result as the whole
        let g = FlatBuf::from_vec(vec![0.3, -0.1, 0.7, 0.2, -0.4]);
        let mut whole = opt(&l, &p0, 1, 0, 0.1);
        let mut s0 = opt(&l, &p0, 2, 0, 0.1);
        let mut s1 = opt(&l, &p0, 2, 1, 0.1);
        assert_eq!((s0.range(), s1.range()), (0..3, 3..5));
        // a 3-way split cuts `a.weight` after its second element
        let map3 = ShardMap::new(&l, 3, Split::Slices);
        let mut t: Vec<AdamW> =
            (0..3).map(|r| AdamW::new(&l, &FlatBuf::from_vec(p0.to_vec()), &map3, r, hp(0.1)).unwrap()).collect();
        for _ in 0..3 {
            whole.step(&g, 0.01).unwrap();
            s0.step(&g, 0.01).unwrap();
            s1.step(&g, 0.01).unwrap();
            t.iter_mut().for_each(|o| o.step(&g, 0.01).unwrap());
        }
        let joined: Vec<f32> = [&s0, &s1].iter().flat_map(|o| o.master().host().unwrap().to_vec()).collect();
        assert_eq!(joined, whole.master().host().unwrap());
        let joined3: Vec<f32> = t.iter().flat_map(|o| o.master().host().unwrap().to_vec()).collect();
        assert_eq!(joined3, whole.master().host().unwrap());
    }

    #[test]
    fn device_state_steps_like_the_host_and_resumes_across_placements() {
        use crate::flatbuf::Placement;
        use candle_core::Device;
        let l = ParamLayout::new(&[("a.weight".into(), vec![4, 3]), ("model.norm.weight".into(), vec![5])]);
        let p0: Vec<f32> = (0..l.total).map(|i| 0.5 - i as f32 * 0.03).collect();
        let dp = Placement::Device(Device::Cpu);
        for world in [1, 3] {
            let map = ShardMap::new(&l, world, Split::Slices);
            for rank in 0..world {
                let host_p = FlatBuf::from_vec(p0.clone());
                let dev_p = host_p.try_clone().unwrap().placed(&dp).unwrap();
                let mut h = AdamW::new(&l, &host_p, &map, rank, hp(0.1)).unwrap();
                let mut d = AdamW::new(&l, &dev_p, &map, rank, hp(0.1)).unwrap();
                assert!(matches!(d.master(), FlatBuf::Device(_)) && matches!(d.m(), FlatBuf::Device(_)));
                for step in 0..4 {
                    let g: Vec<f32> = (0..l.total).map(|i| ((i * 5 + step * 3) % 7) as f32 * 0.1 - 0.3).collect();
                    let gd = FlatBuf::from_vec(g.clone()).placed(&dp).unwrap();
                    h.step(&FlatBuf::from_vec(g), 1e-2).unwrap();
                    d.step(&gd, 1e-2).unwrap();
                }
                assert_eq!(h.master(), d.master(), "world {world} rank {rank}");
                assert_eq!((h.m(), h.v(), h.t()), (d.m(), d.v(), d.t()));
                // host state restored into device state and the reverse, then one more equal step
                let mut d2 = AdamW::new(&l, &dev_p, &map, rank, hp(0.1)).unwrap();
                let mut h2 = AdamW::new(&l, &host_p, &map, rank, hp(0.1)).unwrap();
                let restore = |to: &mut AdamW, from: &AdamW| {
                    let copy = |b: &FlatBuf| b.try_clone().unwrap();
                    to.restore(copy(from.master()), copy(from.m()), copy(from.v()), from.t()).unwrap()
                };
                restore(&mut d2, &h);
                restore(&mut h2, &d);
                assert!(matches!(d2.master(), FlatBuf::Device(_)) && matches!(h2.master(), FlatBuf::Host(_)));
                let g = FlatBuf::from_vec(vec![0.2; l.total]);
                d2.step(&g.try_clone().unwrap().placed(&dp).unwrap(), 1e-2).unwrap();
                h2.step(&g, 1e-2).unwrap();
                assert_eq!(d2.master(), h2.master());
                d2.reset_moments().unwrap();
                assert_eq!((d2.m().sum_squares().unwrap(), d2.t()), (0.0, 0));
            }
        }
    }
}
