//! SwiGLU's elementwise part, silu(gate) * up, as one fused op with its own backward op — CPU loops
//! (one pass, vectorised exp), and `swiglu_slow` from plain candle ops.
//!
//! Reference: HF `LlamaMLP.forward`: down_proj(act_fn(gate_proj(x)) * up_proj(x)), act_fn = SiLU.
//! With s = sigmoid(g) = 1 / (1 + e^-g): y = g s u. Backward with upstream dy:
//!   dg = dy u s (1 + g (1 - s)),   du = dy g s.
//! The non-obvious decision: candle's plain ops spend ~10 passes over (B, T, I) on this (silu's own exp,
//! the product, and in the backward silu's five-op derivative chain plus the product's two halves, each a
//! fresh tensor, each gradient then zero-filled and added by autograd); the fused op makes one pass
//! forward and one backward, which packs dg and du into one tensor (a CustomOp returns one) that `bwd`
//! splits, as `ops::rms_norm` does. Nothing is saved but gate and up.
//! The CPU loops run `cpu_vec::swiglu_fwd` / `swiglu_bwd` (the element code `cpu_vec::swiglu_lane` /
//! `swiglu_bwd_lane` with `exp_lane`, within 2 ulp of `f32::exp`) over chunks in parallel;
//! `swiglu_cpu` / `swiglu_bwd_cpu` are the scalar reference with `f32::exp`.
//! Other dtypes and CUDA: the forward is candle's own silu and product on the storages (the values of
//! `swiglu_slow`, bit for bit) inside the op, so the silu output is a temporary and the graph keeps only
//! gate and up (at 128K tokens on a 7B layer the silu output is 2.7 GiB of bf16); the backward is the
//! same formula from plain ops in f32, `BWD_BLOCK` elements at a time into dgate and dup in place, so its
//! f32 temporaries stay one block.
//! Does not: give a second derivative.
use crate::ops::{cpu_vec, for_overwrite};
use candle_core::backend::BackendStorage;
use candle_core::op::{Mul, Silu};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Forward reference: y = silu(gate) * up, elementwise.
pub fn swiglu_cpu(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter().zip(up).map(|(&g, &u)| cpu_vec::swiglu_lane(g, u, f32::exp)).collect()
}

/// Backward reference: (dgate, dup) from dy, gate, up.
pub fn swiglu_bwd_cpu(dy: &[f32], gate: &[f32], up: &[f32]) -> (Vec<f32>, Vec<f32>) {
    dy.iter().zip(gate).zip(up).map(|((&d, &g), &u)| cpu_vec::swiglu_bwd_lane(d, g, u, f32::exp)).unzip()
}

/// Elements per rayon task (a task of ~16K elements is ~10 us, well above rayon's overhead).
const PER_TASK: usize = 1 << 14;

/// The op's forward: `swiglu_cpu` with the vectorised exp, chunks in parallel.
pub fn swiglu_par(gate: &[f32], up: &[f32]) -> Vec<f32> {
    assert_eq!(gate.len(), up.len(), "swiglu: gate and up differ in length");
    // SAFETY: the chunks below cover y, and swiglu_fwd writes each of its values.
    let mut y = unsafe { for_overwrite(gate.len()) };
    y.par_chunks_mut(PER_TASK)
        .zip(gate.par_chunks(PER_TASK).zip(up.par_chunks(PER_TASK)))
        .for_each(|(y, (g, u))| cpu_vec::swiglu_fwd(g, u, y));
    y
}

/// The op's backward into one buffer [dgate (N) | dup (N)]: `swiglu_bwd_cpu` vectorised, in parallel.
pub fn swiglu_bwd_par(dy: &[f32], gate: &[f32], up: &[f32]) -> Vec<f32> {
    let n = gate.len();
    assert!(dy.len() == n && up.len() == n, "swiglu backward: dy, gate and up differ in length");
    // SAFETY: the chunks below cover both halves, and swiglu_bwd writes each of their values.
    let mut out = unsafe { for_overwrite(2 * n) };
    let (dg, du) = out.split_at_mut(n);
    dg.par_chunks_mut(PER_TASK)
        .zip(du.par_chunks_mut(PER_TASK))
        .zip(dy.par_chunks(PER_TASK).zip(gate.par_chunks(PER_TASK).zip(up.par_chunks(PER_TASK))))
        .for_each(|((dg, du), (d, (g, u)))| cpu_vec::swiglu_bwd(d, g, u, dg, du));
    out
}

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, arg: &str) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        (CpuStorage::F32(_), None) => candle_core::bail!("swiglu: `{arg}` must be contiguous"),
        _ => candle_core::bail!("swiglu: `{arg}` must be f32 (other dtypes take swiglu_slow)"),
    }
}

fn same_shape(a: &Layout, b: &Layout, what: &str) -> Result<()> {
    if a.shape() != b.shape() {
        candle_core::bail!("swiglu: {what} {:?} and {:?} differ", a.shape(), b.shape());
    }
    Ok(())
}

struct SwiGlu;

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "harpe-swiglu"
    }

    fn cpu_fwd(&self, sg: &CpuStorage, lg: &Layout, su: &CpuStorage, lu: &Layout) -> Result<(CpuStorage, Shape)> {
        same_shape(lg, lu, "gate and up")?;
        if !matches!(sg, CpuStorage::F32(_)) {
            return Ok((silu_mul(sg, lg, su, lu)?, lg.shape().clone()));
        }
        let y = swiglu_par(f32_slice(sg, lg, "gate")?, f32_slice(su, lu, "up")?);
        Ok((CpuStorage::F32(y), lg.shape().clone()))
    }

    /// candle's silu and product kernels on the device storages (no kernel of its own).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sg: &candle_core::CudaStorage,
        lg: &Layout,
        su: &candle_core::CudaStorage,
        lu: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        same_shape(lg, lu, "gate and up")?;
        Ok((silu_mul(sg, lg, su, lu)?, lg.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if !gate.device().is_cpu() || gate.dtype() != DType::F32 {
            let (dg, du) = swiglu_bwd_blocks(&grad.detach(), &gate.detach(), &up.detach())?;
            return Ok((Some(dg), Some(du)));
        }
        let n = gate.elem_count();
        let packed = grad.contiguous()?.apply_op3(gate, up, SwiGluBwd)?; // (2N)
        let dg = packed.narrow(0, 0, n)?.reshape(gate.shape())?;
        let du = packed.narrow(0, n, n)?.reshape(up.shape())?;
        Ok((Some(dg), Some(du)))
    }
}

/// The backward as an op: (dy, gate, up) -> [dgate (N) | dup (N)] flattened.
struct SwiGluBwd;

impl CustomOp3 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "harpe-swiglu-bwd"
    }

    fn cpu_fwd(
        &self,
        sd: &CpuStorage,
        ld: &Layout,
        sg: &CpuStorage,
        lg: &Layout,
        su: &CpuStorage,
        lu: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        same_shape(ld, lg, "dy and gate")?;
        same_shape(lg, lu, "gate and up")?;
        let out = swiglu_bwd_par(f32_slice(sd, ld, "dy")?, f32_slice(sg, lg, "gate")?, f32_slice(su, lu, "up")?);
        let n = out.len();
        Ok((CpuStorage::F32(out), Shape::from_dims(&[n])))
    }
}

/// silu(gate) then the product, by candle's own kernels on any backend's storage: `swiglu_slow`'s values.
fn silu_mul<S: BackendStorage>(sg: &S, lg: &Layout, su: &S, lu: &Layout) -> Result<S> {
    let s = sg.unary_impl::<Silu>(lg)?;
    s.binary_impl::<Mul>(su, &Layout::contiguous(lg.shape()), lu)
}

/// Elements of the plain-op backward per block of rows: its f32 temporaries (`BWD_LIVE_F32` at once)
/// stay ~160 MiB whatever the length, in a few hundred blocks at 128K tokens of a 7B MLP.
pub const BWD_BLOCK: usize = 1 << 22;
/// f32 values per element alive at the plain-op backward's widest point: dy, g, u, s, and in dg's
/// expression two partial products, its result and the cast's input (each by-value operator frees its
/// left operand as it goes).
pub const BWD_LIVE_F32: usize = 8;

/// The backward from plain ops (bf16/f16, CUDA): with s = sigmoid(g) in f32,
/// dg = dy u s (1 + g (1 - s)), du = dy g s, blocks of rows of `BWD_BLOCK` elements into (dgate, dup) in gate's dtype.
fn swiglu_bwd_blocks(dy: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
    let shape = gate.shape().clone();
    let width = *shape.dims().last().unwrap_or(&1);
    let rows = shape.elem_count() / width.max(1);
    let flat = |t: &Tensor| t.contiguous()?.reshape((rows, width));
    let (dy, g, u) = (flat(dy)?, flat(gate)?, flat(up)?); // (rows, I)
    let dg = Tensor::zeros((rows, width), gate.dtype(), gate.device())?;
    let du = Tensor::zeros((rows, width), up.dtype(), up.device())?;
    let block = (BWD_BLOCK / width.max(1)).max(1);
    for start in (0..rows).step_by(block) {
        let len = block.min(rows - start);
        let f = |t: &Tensor| t.narrow(0, start, len)?.to_dtype(DType::F32);
        let (d, g, u) = (f(&dy)?, f(&g)?, f(&u)?); // (len, I) f32
        let s = (g.neg()?.exp()? + 1.0)?.recip()?; // sigmoid(g)
        let dgs = ((&d * &u)? * &s)?.mul(&((&g * (1.0 - &s)?)? + 1.0)?)?;
        let dus = ((&d * &g)? * &s)?;
        dg.slice_set(&dgs.to_dtype(gate.dtype())?, 0, start)?;
        du.slice_set(&dus.to_dtype(up.dtype())?, 0, start)?;
    }
    Ok((dg.reshape(shape.clone())?, du.reshape(shape)?))
}

/// silu(gate) * up for tensors of one shape (B, T, I), any dtype, CPU or CUDA; differentiable in both.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

/// The same from plain candle ops (any device and dtype; the reference of the tests).
pub fn swiglu_slow(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.silu()? * up
}
