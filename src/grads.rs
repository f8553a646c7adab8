//! Gradients as one flat fp32 buffer (`FlatBuf`): parameter layout, flattening HF-named tensors into
//! it, accumulation from candle's `GradStore`, global norm, clipping and the NaN/inf check.
//!
//! Reference: llm.c `train_gpt2.cu` (one contiguous grad buffer, `global_norm_squared`), torch
//! `clip_grad_norm_` (scale = max_norm / (norm + 1e-6), applied only when the norm exceeds max_norm).
//! The non-obvious decision: every parameter owns a fixed range of one flat buffer (HF order), so the
//! optimizer, the all-reduce and a ZeRO shard are all ranges of the same index space; the norm is
//! accumulated in f64 so it does not depend on summation order at the precision we log.
//! What this file does not do: decide what to do with a bad step (that is the loop's guard).
use crate::flatbuf::{FlatBuf, Placement};
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};

use crate::model::layout::ParamLayout;

/// Flatten HF-named tensors (in `order`) into one fp32 buffer (on the tensors' device) and its layout.
pub fn flatten_params(order: &[(String, Tensor)]) -> Result<(ParamLayout, FlatBuf)> {
    let device = order.first().map(|(_, t)| t.device().clone()).unwrap_or(Device::Cpu);
    flatten_params_in(order, &Placement::of(&device))
}

/// `flatten_params` into a buffer with placement `p` (the training state's; tensors may be anywhere).
pub fn flatten_params_in(order: &[(String, Tensor)], p: &Placement) -> Result<(ParamLayout, FlatBuf)> {
    let layout = ParamLayout::new(&order.iter().map(|(n, t)| (n.clone(), t.dims().to_vec())).collect::<Vec<_>>());
    let mut flat = FlatBuf::zeros_in(layout.total, p)?;
    for (p, (_, t)) in layout.params.iter().zip(order) {
        flat.set_tensor(p.range.clone(), t)?;
    }
    Ok((layout, flat))
}

/// Accumulated gradients of one optimizer step, fp32, flat in `ParamLayout` order.
#[derive(Debug)]
pub struct GradAccum {
    buf: FlatBuf,
}

impl GradAccum {
    /// Zeroed buffer for a layout on `device`.
    pub fn new(layout: &ParamLayout, device: &Device) -> Result<GradAccum> {
        Ok(GradAccum { buf: FlatBuf::zeros(layout.total, device)? })
    }

    /// A zeroed buffer of `n` values (ZeRO-3: this rank's shard of the flat space only).
    pub fn zeros(n: usize, device: &Device) -> Result<GradAccum> {
        GradAccum::zeros_in(n, &Placement::of(device))
    }

    /// A zeroed buffer of `n` values with placement `p` (the training state's).
    pub fn zeros_in(n: usize, p: &Placement) -> Result<GradAccum> {
        Ok(GradAccum { buf: FlatBuf::zeros_in(n, p)? })
    }

    /// The gradient buffer (whole flat space, or the shard for `zeros`).
    pub fn buf(&self) -> &FlatBuf {
        &self.buf
    }

    /// The gradient buffer, mutably (collectives and clipping).
    pub fn buf_mut(&mut self) -> &mut FlatBuf {
        &mut self.buf
    }

    /// Set every gradient to 0 (the start of a step).
    pub fn reset(&mut self) -> Result<()> {
        self.buf.fill(0.0)
    }

    /// Add the gradients that `store` holds for `vars` (same order as the layout); parameters that the
    /// backward did not reach are skipped (a layer-wise backward only touches one layer).
    pub fn add_from(&mut self, layout: &ParamLayout, vars: &[Var], store: &GradStore) -> Result<()> {
        for (p, var) in layout.params.iter().zip(vars) {
            if let Some(g) = store.get(var.as_tensor()) {
                if g.elem_count() != p.range.len() {
                    bail!("gradient of {} has {} elements, expected {}", p.name, g.elem_count(), p.range.len());
                }
                self.buf.add_tensor(p.range.clone(), g).map_err(|e| e.context(format!("gradient of {}", p.name)))?;
            }
        }
        Ok(())
    }
}

/// L2 norm of the whole gradient (sum of squares in f64, on the buffer's device; one scalar crosses).
pub fn global_norm(g: &FlatBuf) -> Result<f64> {
    Ok(g.sum_squares()?.sqrt())
}

/// Clip by global norm in place (torch semantics); returns the scale applied (1 when not clipped).
/// `max_norm <= 0` disables clipping.
pub fn clip_by_global_norm(g: &mut FlatBuf, norm: f64, max_norm: f64) -> Result<f32> {
    if max_norm <= 0.0 || norm <= max_norm {
        return Ok(1.0);
    }
    let scale = (max_norm / (norm + 1e-6)) as f32;
    g.scale(scale)?;
    Ok(scale)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layout::ParamGroup;
    use candle_core::{Device, Tensor};

    #[test]
    fn flatten_keeps_hf_order_and_values() {
        let a = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu).unwrap();
        let b = Tensor::new(&[5f32], &Device::Cpu).unwrap();
        let (l, flat) = flatten_params(&[("a".into(), a), ("b".into(), b)]).unwrap();
        assert_eq!((l.total, l.params[1].range.clone()), (5, 4..5));
        assert_eq!(flat.host().unwrap(), &[1., 2., 3., 4., 5.]);
    }

    #[test]
    fn layout_is_contiguous_and_grouped() {
        let l = ParamLayout::new(&[
            ("model.embed_tokens.weight".into(), vec![4, 3]),
            ("model.layers.0.input_layernorm.weight".into(), vec![3]),
            ("lm_head.weight".into(), vec![4, 3]),
        ]);
        assert_eq!(l.total, 27);
        assert_eq!(l.params[1].range, 12..15);
        assert_eq!(l.params[0].group, ParamGroup::Embedding);
        assert_eq!(l.params[1].group, ParamGroup::Norm);
        assert_eq!(l.params[2].group, ParamGroup::Matrix);
    }

    #[test]
    fn accumulates_only_reached_params_and_clips() {
        let l = ParamLayout::new(&[("a".into(), vec![2]), ("b".into(), vec![2])]);
        let a = Var::from_tensor(&Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::new(&[3f32, 4.], &Device::Cpu).unwrap()).unwrap();
        let mut acc = GradAccum::new(&l, &Device::Cpu).unwrap();
        for _ in 0..2 {
            // d/da sum(a^2) = 2a; b is not in the graph
            let loss = a.as_tensor().sqr().unwrap().sum_all().unwrap();
            let store = loss.backward().unwrap();
            acc.add_from(&l, &[a.clone(), b.clone()], &store).unwrap();
        }
        assert_eq!(acc.buf().host().unwrap(), &[4.0, 8.0, 0.0, 0.0]);
        let n = global_norm(acc.buf()).unwrap();
        assert!((n - 80f64.sqrt()).abs() < 1e-9);
        let s = clip_by_global_norm(acc.buf_mut(), n, 1.0).unwrap();
        assert!(s < 1.0);
        assert!((global_norm(acc.buf()).unwrap() - 1.0).abs() < 1e-5);
        assert!(acc.buf().all_finite().unwrap());
        acc.buf_mut().host_mut().unwrap()[0] = f32::NAN;
        assert!(!acc.buf().all_finite().unwrap());
    }

    #[test]
    fn device_variant_accumulates_norms_and_clips_like_the_host() {
        let l = ParamLayout::new(&[("a".into(), vec![3]), ("b".into(), vec![2])]);
        let a = Var::from_tensor(&Tensor::new(&[1f32, -2., 0.5], &Device::Cpu).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::new(&[3f32, 4.], &Device::Cpu).unwrap()).unwrap();
        let mut host = GradAccum::new(&l, &Device::Cpu).unwrap();
        let mut dev = GradAccum::zeros_in(l.total, &Placement::Device(Device::Cpu)).unwrap();
        for k in 1..=3 {
            let loss = ((a.as_tensor().sqr().unwrap() * k as f64).unwrap().sum_all().unwrap()
                + b.as_tensor().sum_all().unwrap())
            .unwrap();
            let store = loss.backward().unwrap();
            host.add_from(&l, &[a.clone(), b.clone()], &store).unwrap();
            dev.add_from(&l, &[a.clone(), b.clone()], &store).unwrap();
        }
        assert!(matches!(dev.buf(), FlatBuf::Device(_)));
        assert_eq!(host.buf(), dev.buf());
        let (nh, nd) = (global_norm(host.buf()).unwrap(), global_norm(dev.buf()).unwrap());
        assert_eq!(nh, nd);
        assert_eq!(
            clip_by_global_norm(host.buf_mut(), nh, 1.0).unwrap(),
            clip_by_global_norm(dev.buf_mut(), nd, 1.0).unwrap()
        );
        assert_eq!(host.buf(), dev.buf());
        dev.reset().unwrap();
        assert_eq!(dev.buf().sum_squares().unwrap(), 0.0);
    }
}
