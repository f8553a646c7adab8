//! Rotary position embedding with per-head cos/sin tables (HARPE) — CPU reference, backward, slow version.
//!
//! Reference: HF Llama `rotate_half` / `apply_rotary_pos_emb` (pairs (j, j + D/2)); HARPE Eq. 6-8.
//! x: (B, H, T, D); cos, sin: (Htab, T, D/2) with H % Htab == 0, head h reading table h / (H / Htab),
//! so one table (classic schemes), Hkv tables for keys or queries of a GQA model (HARPE) all work.
//!   y[j]       = x[j] cos[j] - x[j + D/2] sin[j]
//!   y[j + D/2] = x[j + D/2] cos[j] + x[j] sin[j]
//! Backward is the rotation by the opposite angle: dx = rope(dy, cos, -sin) (an attention factor on
//! cos and sin is a scale, so the same formula holds). The op computes in f32; on CPU `rope` upcasts
//! bf16/f16 inputs and casts back; on CUDA (kernels/rope.cu) f32 and bf16 x are read as they are and
//! rounded once at the store, which gives the same values without the two casts' memory traffic.
//! The CPU op runs `rotary_par`: rows in parallel, x read through its strides (no transpose copy); the
//! readable `rotary_cpu` is its reference. Not done here: building the tables (`model::rope`).
use crate::ops::for_overwrite;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// A contiguous f32 view of a CPU storage, or a clear error.
pub(crate) fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, op: &str, arg: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else { candle_core::bail!("{op}: `{arg}` must be f32") };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{op}: `{arg}` must be contiguous"),
    }
}

struct Rotary;

/// One row: y = x rotated by the angles of one table row (`cos`, `sin` of D/2 each).
#[inline]
fn rotate_row(x: &[f32], cos: &[f32], sin: &[f32], y: &mut [f32]) {
    let half = cos.len();
    let (x1, x2) = x.split_at(half);
    let (y1, y2) = y.split_at_mut(half);
    for j in 0..half {
        let (c, s) = (cos[j], sin[j]);
        y1[j] = x1[j] * c - x2[j] * s;
        y2[j] = x2[j] * c + x1[j] * s;
    }
}

/// The reference loops: one (b, h, t) row at a time.
pub fn rotary_cpu(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    (b, h, t, d): (usize, usize, usize, usize),
    htab: usize,
) -> Vec<f32> {
    let half = d / 2;
    let rep = h / htab;
    let mut y = vec![0f32; x.len()];
    for bi in 0..b {
        for hi in 0..h {
            let tab = hi / rep;
            for ti in 0..t {
                let row = ((bi * h + hi) * t + ti) * d;
                let trow = (tab * t + ti) * half;
                for j in 0..half {
                    let (c, s) = (cos[trow + j], sin[trow + j]);
                    let (x1, x2) = (x[row + j], x[row + j + half]);
                    y[row + j] = x1 * c - x2 * s;
                    y[row + j + half] = x2 * c + x1 * s;
                }
            }
        }
    }
    y
}

/// The op's CPU path: `rotary_cpu` with (b, h) rows in parallel, reading x through its strides (the
/// last one 1; element (b, h, t, j) at `x[b s0 + h s1 + t s2 + j]`), so the (B, T, H, D) -> (B, H, T, D)
/// transpose of the projections folds into the rotation instead of costing a copy. y is contiguous.
pub fn rotary_par(
    x: &[f32],
    strides: [usize; 3],
    cos: &[f32],
    sin: &[f32],
    (b, h, t, d): (usize, usize, usize, usize),
    htab: usize,
) -> Vec<f32> {
    let (half, rep) = (d / 2, h / htab);
    // SAFETY: every (b, h, t) row of y is rotated into below (rotate_row writes all d = 2 * half values).
    let mut y = unsafe { for_overwrite(b * h * t * d) };
    if y.is_empty() {
        return y;
    }
    y.par_chunks_mut(t * d).enumerate().for_each(|(bh, yh)| {
        let (bi, hi) = (bh / h, bh % h);
        let tab = hi / rep;
        for (ti, yr) in yh.chunks_mut(d).enumerate() {
            let at = bi * strides[0] + hi * strides[1] + ti * strides[2];
            let trow = (tab * t + ti) * half;
            rotate_row(&x[at..at + d], &cos[trow..trow + half], &sin[trow..trow + half], yr);
        }
    });
    y
}

/// x's f32 storage from its start offset, and its (B, H, T) strides, when its last dim is contiguous.
fn strided_rows<'a>(s: &'a CpuStorage, l: &Layout) -> Result<(&'a [f32], [usize; 3])> {
    let CpuStorage::F32(v) = s else { candle_core::bail!("rotary: `x` must be f32") };
    match l.stride() {
        &[s0, s1, s2, 1] => Ok((&v[l.start_offset()..], [s0, s1, s2])),
        _ => candle_core::bail!("rotary: `x` must have a contiguous last dimension"),
    }
}

impl CustomOp3 for Rotary {
    fn name(&self) -> &'static str {
        "harpe-rotary"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, h, t, d, htab) = check_shapes(l1, l2, l3)?;
        let (x, strides) = strided_rows(s1, l1)?;
        let cos = f32_slice(s2, l2, "rotary", "cos")?;
        let sin = f32_slice(s3, l3, "rotary", "sin")?;
        let y = rotary_par(x, strides, cos, sin, (b, h, t, d), htab);
        Ok((CpuStorage::F32(y), l1.shape().clone())) // contiguous, whatever x's strides
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::rotary(s1, l1, s2, l2, s3, l3, 1.0)
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dx = rows_contiguous(grad)?.apply_op3(cos, &sin.neg()?, Rotary)?; // itself differentiable
        Ok((Some(dx), None, None))
    }
}

/// Apply RoPE to x (B, H, T, D) with tables (Htab, T, D/2); differentiable in x.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    if x.device().is_cuda() && matches!(dtype, DType::F32 | DType::BF16) {
        return x.contiguous()?.apply_op3(&cos.contiguous()?, &sin.contiguous()?, Rotary);
    }
    // f32 on CPU goes in as it is (strided rows are fine); other dtypes are upcast (a contiguous copy)
    let y = rows_contiguous(&x.to_dtype(DType::F32)?)?.apply_op3(&cos.contiguous()?, &sin.contiguous()?, Rotary)?;
    y.to_dtype(dtype)
}

/// `t` itself when its last dimension is contiguous (what the CPU op reads), else a contiguous copy.
fn rows_contiguous(t: &Tensor) -> Result<Tensor> {
    if t.device().is_cpu() && t.stride().last() == Some(&1) {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// The same rotation from plain candle ops (rotate_half form), for tests.
pub fn rope_slow(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = x.dims4()?;
    let (htab, _, half) = cos.dims3()?;
    let rep = h / htab;
    // (Htab, T, D/2) -> (1, H, T, D) with each table repeated for its `rep` heads and both halves.
    let expand = |tab: &Tensor| -> Result<Tensor> {
        let full = Tensor::cat(&[tab, tab], 2)?; // (Htab, T, D)
        full.unsqueeze(1)?.expand((htab, rep, t, d))?.reshape((1, h, t, d))?.broadcast_as((b, h, t, d))
    };
    let (c, s) = (expand(cos)?, expand(sin)?);
    let x1 = x.narrow(3, 0, half)?;
    let x2 = x.narrow(3, half, half)?;
    let rot = Tensor::cat(&[&x2.neg()?, &x1], 3)?;
    x.broadcast_mul(&c)? + rot.broadcast_mul(&s)?
}

/// Check x (B, H, T, D) against tables (Htab, T, D/2); returns (B, H, T, D, Htab).
fn check_shapes(l1: &Layout, l2: &Layout, l3: &Layout) -> Result<(usize, usize, usize, usize, usize)> {
    let (b, h, t, d) = l1.shape().dims4()?;
    let (htab, tt, half) = l2.shape().dims3()?;
    if tt != t || half * 2 != d || htab == 0 || !h.is_multiple_of(htab) || l3.shape() != l2.shape() {
        candle_core::bail!(
            "rotary: x {:?} does not match tables cos {:?} sin {:?} (need (Htab, T, D/2) with H % Htab == 0)",
            l1.shape(),
            l2.shape(),
            l3.shape()
        );
    }
    Ok((b, h, t, d, htab))
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::check_shapes;
    use crate::ops::cuda::{cfg, dtype_suffix, grid_for, load_func, same_device, u32_arg, view, BLOCK, ROPE};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, DType, Layout, Result, Shape};
    use half::bf16;

    /// kernels/rope.cu on x f32/bf16 with f32 tables; `sin_sign` -1 rotates backwards.
    pub fn rotary(
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
        sin_sign: f32,
    ) -> Result<(CudaStorage, Shape)> {
        const OP: &str = "rotary";
        let (b, h, t, d, htab) = check_shapes(l1, l2, l3)?;
        let sfx = dtype_suffix(s1.dtype(), OP, "x")?;
        same_device(s1, s2, OP)?;
        same_device(s1, s3, OP)?;
        if s2.dtype() != DType::F32 || s3.dtype() != DType::F32 {
            candle_core::bail!("{OP}: cos/sin tables must be f32, got {:?}/{:?}", s2.dtype(), s3.dtype());
        }
        let rows = u32_arg(b * h * t, OP, "B*H*T")?;
        let (h32, t32, half, htab32) = (h as u32, t as u32, (d / 2) as u32, htab as u32);
        let dev = s1.device();
        let func = load_func(dev, &format!("rope_{sfx}"), &ROPE)?;
        let (cos, sin) = (view::<f32>(s2, l2, OP, "cos")?, view::<f32>(s3, l3, OP, "sin")?);
        let n = b * h * t * d;
        let grid = grid_for(n / 2, BLOCK);
        macro_rules! go {
            ($t:ty) => {{
                let x = view::<$t>(s1, l1, OP, "x")?;
                // SAFETY: written in full by the kernel.
                let y = unsafe { dev.alloc::<$t>(n)? };
                let mut bld = func.builder();
                bld.arg(&x)
                    .arg(&cos)
                    .arg(&sin)
                    .arg(&y)
                    .arg(&rows)
                    .arg(&h32)
                    .arg(&t32)
                    .arg(&half)
                    .arg(&htab32)
                    .arg(&sin_sign);
                // SAFETY: x, y hold B*H*T*D elements; cos, sin Htab*T*D/2 (checked above).
                unsafe { bld.launch(cfg(grid, BLOCK)) }.w()?;
                CudaStorage::wrap_cuda_slice(y, dev.clone())
            }};
        }
        let y = if s1.dtype() == DType::BF16 { go!(bf16) } else { go!(f32) };
        Ok((y, l1.shape().clone()))
    }
}
