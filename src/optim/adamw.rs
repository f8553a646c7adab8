//! AdamW on flat fp32 master weights and moments; the parameters this rank owns are one contiguous
//! slice (`range`) of the flat vector, so ZeRO-1 is "give each rank a different range".
//!
//! Reference: Loshchilov & Hutter (decoupled weight decay); torch `optim/adamw.py` `_single_tensor_adamw`
//! (the order of operations below is torch's: decay, lerp m, v, bias corrections, addcdiv).
//! The non-obvious decision: one step counter for all parameters (torch keeps one per tensor, always
//! equal in practice), and the per-group weight decay is resolved to per-range values at construction.
//! What this file does not do: gradient clipping or communication (grads.rs, comms/).
use crate::grads::{ParamGroup, ParamLayout};
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
    fn wd(&self, g: ParamGroup) -> f32 {
        match g {
            ParamGroup::Matrix => self.wd_matrix,
            ParamGroup::Embedding => self.wd_embedding,
            ParamGroup::Norm => self.wd_norm,
        }
    }
}

/// Optimizer state of one rank: fp32 master weights, first and second moments of `range`.
#[derive(Clone, Debug)]
pub struct AdamW {
    pub hp: AdamWHyper,
    /// the slice of the flat parameter vector owned here
    pub range: Range<usize>,
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// number of updates applied (torch's `step`)
    pub t: u64,
    /// (local range, weight decay) pieces covering `0..range.len()`
    segments: Vec<(Range<usize>, f32)>,
}

impl AdamW {
    /// New state for `range` of the flat vector, master weights copied from `full_params`.
    pub fn new(layout: &ParamLayout, full_params: &[f32], range: Range<usize>, hp: AdamWHyper) -> AdamW {
        let segments = layout
            .params
            .iter()
            .filter_map(|p| {
                let lo = p.range.start.max(range.start);
                let hi = p.range.end.min(range.end);
                (lo < hi).then(|| (lo - range.start..hi - range.start, hp.wd(p.group)))
            })
            .collect();
        let n = range.len();
        AdamW {
            hp,
            master: full_params[range.clone()].to_vec(),
            m: vec![0.0; n],
            v: vec![0.0; n],
            t: 0,
            range,
            segments,
        }
    }

    /// Forget the moments and the step count (a stage configured with `reset_optimizer`).
    pub fn reset_moments(&mut self) {
        self.m.iter_mut().for_each(|x| *x = 0.0);
        self.v.iter_mut().for_each(|x| *x = 0.0);
        self.t = 0;
    }

    /// One update with learning rate `lr`; `grad` is this rank's slice (same length as `range`).
    pub fn step(&mut self, grad: &[f32], lr: f64) {
        self.t += 1;
        let AdamWHyper { beta1, beta2, eps, .. } = self.hp;
        let bc1 = 1.0 - (beta1 as f64).powi(self.t as i32);
        let bc2_sqrt = (1.0 - (beta2 as f64).powi(self.t as i32)).sqrt();
        let step_size = (lr / bc1) as f32;
        let (bc2_sqrt, lr) = (bc2_sqrt as f32, lr as f32);
        for (seg, wd) in &self.segments {
            let decay = 1.0 - lr * wd;
            let p = &mut self.master[seg.clone()];
            let m = &mut self.m[seg.clone()];
            let v = &mut self.v[seg.clone()];
            let g = &grad[seg.clone()];
            for i in 0..p.len() {
                p[i] *= decay;
                m[i] += (1.0 - beta1) * (g[i] - m[i]);
                v[i] = v[i] * beta2 + (1.0 - beta2) * g[i] * g[i];
                let denom = v[i].sqrt() / bc2_sqrt + eps;
                p[i] -= step_size * m[i] / denom;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hp(wd: f32) -> AdamWHyper {
        AdamWHyper { beta1: 0.9, beta2: 0.95, eps: 1e-8, wd_matrix: wd, wd_embedding: wd, wd_norm: 0.0 }
    }

    #[test]
    fn first_step_moves_each_weight_by_lr_against_the_gradient_sign() {
        // With bias correction, |update| of step 1 is lr * |g| / (|g| + eps) ~= lr, whatever |g| is.
        let l = ParamLayout::new(&[("w".into(), vec![3])]);
        let mut o = AdamW::new(&l, &[1.0, 1.0, 1.0], 0..3, hp(0.0));
        o.step(&[0.5, -2.0, 1e-3], 0.1);
        let d: Vec<f32> = o.master.iter().map(|p| p - 1.0).collect();
        assert!((d[0] + 0.1).abs() < 1e-5 && (d[1] - 0.1).abs() < 1e-5 && (d[2] + 0.1).abs() < 1e-4, "{d:?}");
    }

    #[test]
    fn norms_get_no_decay_and_shards_equal_the_whole() {
        let l = ParamLayout::new(&[("a.weight".into(), vec![3]), ("model.norm.weight".into(), vec![2])]);
        let p0 = [1.0, 2.0, 3.0, 4.0, 5.0];
        let g = [0.0f32; 5];
        let mut o = AdamW::new(&l, &p0, 0..5, hp(0.5));
        o.step(&g, 0.1);
        // zero gradient: only decoupled decay acts, p *= 1 - lr * wd on matrices, norms untouched
        assert_eq!(o.master, vec![0.95, 1.9, 2.85, 4.0, 5.0]);
        // two shards cut through the middle of a parameter give the same result as the whole
        let g = [0.3, -0.1, 0.7, 0.2, -0.4];
        let mut whole = AdamW::new(&l, &p0, 0..5, hp(0.1));
        let mut s0 = AdamW::new(&l, &p0, 0..2, hp(0.1));
        let mut s1 = AdamW::new(&l, &p0, 2..5, hp(0.1));
        for _ in 0..3 {
            whole.step(&g, 0.01);
            s0.step(&g[0..2], 0.01);
            s1.step(&g[2..5], 0.01);
        }
        let joined: Vec<f32> = s0.master.iter().chain(&s1.master).copied().collect();
        assert_eq!(joined, whole.master);
    }
}
