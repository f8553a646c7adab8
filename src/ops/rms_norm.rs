//! RMSNorm as one fused op — CPU reference loops, CUDA launch (kernels/rms_norm.cu), backward (dx and
//! dweight), and `rms_norm_slow` from plain candle ops.
//!
//! Reference: HF `LlamaRMSNorm` (`model::llama::rms_norm` is the same formula from plain ops):
//!   r = 1 / sqrt(mean(x^2) + eps) in f32; xhat = (x r) cast to x's dtype; y = xhat * w.
//! Backward with g = dy w: dx = r (g - xhat mean(g xhat)), dw = sum over rows of dy xhat.
//! The non-obvious decision: the backward is a second op (`RmsNormBwd`) whose output packs dx (N*C)
//! and dw (C) into one flat tensor, because a candle CustomOp returns one tensor; `bwd` splits it.
//! Nothing is saved between forward and backward except x: rstd is recomputed (one more read of x),
//! which keeps the op's memory equal to candle's plain-op version at long T.
//! The op's CPU path runs the reference's row code in parallel over rows (`rms_norm_par`, `rms_norm_bwd_par`).
//! Does not: fuse the residual add; give a second derivative (the backward op has no backward).
use crate::ops::{for_overwrite, Plain};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D};
use half::{bf16, f16};
use rayon::prelude::*;

/// A storage type of the reference loops (arithmetic is f32).
pub trait NormFloat: Copy + Default {
    fn f(self) -> f32;
    fn of(v: f32) -> Self;
}
impl NormFloat for f32 {
    fn f(self) -> f32 {
        self
    }
    fn of(v: f32) -> Self {
        v
    }
}
impl NormFloat for bf16 {
    fn f(self) -> f32 {
        self.to_f32()
    }
    fn of(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
impl NormFloat for f16 {
    fn f(self) -> f32 {
        self.to_f32()
    }
    fn of(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// 1 / sqrt(mean(x^2) + eps) of one row, in f32 (the kernel's expression).
fn rstd_of<T: NormFloat>(row: &[T], eps: f32) -> f32 {
    let ss: f32 = row.iter().map(|v| v.f() * v.f()).sum();
    1.0 / (ss / row.len() as f32 + eps).sqrt()
}

/// One row of the forward: y = (x / sqrt(mean(x^2) + eps) cast to T) * w; returns rstd.
fn norm_row<T: NormFloat>(xr: &[T], w: &[T], yr: &mut [T], eps: f32) -> f32 {
    let c = xr.len();
    let ss: f32 = xr.iter().map(|v| v.f() * v.f()).sum();
    let denom = (ss / c as f32 + eps).sqrt();
    for j in 0..c {
        let xhat = T::of(xr[j].f() / denom).f(); // cast back to the storage dtype before the weight
        yr[j] = T::of(xhat * w[j].f());
    }
    1.0 / denom
}

/// One row of the backward: writes dx, adds the row's dy xhat into `dw`.
fn norm_bwd_row<T: NormFloat>(dyr: &[T], xr: &[T], w: &[T], dxr: &mut [T], dw: &mut [f32], eps: f32) {
    let c = xr.len();
    let r = rstd_of(xr, eps);
    let dot: f32 = (0..c).map(|j| dyr[j].f() * w[j].f() * xr[j].f() * r).sum::<f32>() / c as f32;
    for j in 0..c {
        let xhat = xr[j].f() * r;
        dxr[j] = T::of(r * (dyr[j].f() * w[j].f() - xhat * dot));
        dw[j] += dyr[j].f() * T::of(xhat).f();
    }
}

/// Forward reference: x (N, C), w (C) -> (y (N, C), rstd (N)).
pub fn rms_norm_cpu<T: NormFloat>(x: &[T], w: &[T], c: usize, eps: f32) -> (Vec<T>, Vec<f32>) {
    let n = x.len() / c.max(1);
    let mut y = vec![T::default(); x.len()];
    let mut rstd = vec![0f32; n];
    for i in 0..n {
        rstd[i] = norm_row(&x[i * c..(i + 1) * c], w, &mut y[i * c..(i + 1) * c], eps);
    }
    (y, rstd)
}

/// Backward reference: (dx (N, C), dw (C)) from dy, x, w.
pub fn rms_norm_bwd_cpu<T: NormFloat>(dy: &[T], x: &[T], w: &[T], c: usize, eps: f32) -> (Vec<T>, Vec<T>) {
    let n = x.len() / c.max(1);
    let mut dx = vec![T::default(); x.len()];
    let mut dw = vec![0f32; c];
    for i in 0..n {
        let rows = i * c..(i + 1) * c;
        norm_bwd_row(&dy[rows.clone()], &x[rows.clone()], w, &mut dx[rows], &mut dw, eps);
    }
    (dx, dw.into_iter().map(T::of).collect())
}

/// Rows per rayon task of the parallel loops (a task stays well above rayon's ~1 us overhead at C >= 64).
const ROWS_PER_TASK: usize = 16;

/// `rms_norm_cpu`'s forward, rows in parallel (the op's CPU path): the same row code, so the same bits.
pub fn rms_norm_par<T: NormFloat + Plain>(x: &[T], w: &[T], c: usize, eps: f32) -> Vec<T> {
    // SAFETY: the row blocks below cover y, and norm_row writes each row's c values.
    let mut y = unsafe { for_overwrite(x.len()) };
    let blk = ROWS_PER_TASK * c.max(1);
    y.par_chunks_mut(blk).zip(x.par_chunks(blk)).for_each(|(yb, xb)| {
        for (yr, xr) in yb.chunks_mut(c).zip(xb.chunks(c)) {
            norm_row(xr, w, yr, eps);
        }
    });
    y
}

/// `rms_norm_bwd_cpu`, rows in parallel; dw is summed in a fixed number of contiguous row groups, then
/// over the groups in index order: another rounding order than the reference's one running sum (equal
/// within f32 rounding, not bit-equal), but the same on every run whatever rayon's work stealing does
/// (a `fold`/`reduce` tree follows the run-time splits and made training runs differ in the last bits).
pub fn rms_norm_bwd_par<T: NormFloat + Plain>(dy: &[T], x: &[T], w: &[T], c: usize, eps: f32) -> (Vec<T>, Vec<T>) {
    assert_eq!(dy.len(), x.len(), "rms_norm backward: dy and x differ in length");
    // SAFETY: the row groups below cover dx, and norm_bwd_row writes each row's c values.
    let mut dx = unsafe { for_overwrite(x.len()) };
    let c = c.max(1);
    let rows = x.len() / c;
    let per_group = rows.div_ceil(DW_GROUPS).max(ROWS_PER_TASK) * c;
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(per_group)
        .zip(x.par_chunks(per_group).zip(dy.par_chunks(per_group)))
        .map(|(dxg, (xg, dyg))| {
            let mut dw = vec![0f32; c];
            for ((dxr, xr), dyr) in dxg.chunks_mut(c).zip(xg.chunks(c)).zip(dyg.chunks(c)) {
                norm_bwd_row(dyr, xr, w, dxr, &mut dw, eps);
            }
            dw
        })
        .collect();
    let mut dw = vec![0f32; c];
    for part in &partials {
        dw.iter_mut().zip(part).for_each(|(p, q)| *p += q);
    }
    (dx, dw.into_iter().map(T::of).collect())
}

/// Row groups of the parallel backward's dw sums (fixed, so the summation order never depends on the
/// thread count or scheduling).
const DW_GROUPS: usize = 64;

/// Rows and width of x (N, C) against w (C), or a shape error naming both.
fn rows(lx: &Layout, lw: &Layout) -> Result<(usize, usize)> {
    let c = lw.shape().dims1()?;
    let dims = lx.shape().dims();
    if dims.last() != Some(&c) || c == 0 {
        candle_core::bail!("rms_norm: x {:?} does not end in the weight's width {c}", lx.shape());
    }
    Ok((lx.shape().elem_count() / c, c))
}

fn slice<'a, T>(v: &'a [T], l: &Layout, arg: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("rms_norm: `{arg}` must be contiguous"),
    }
}

struct RmsNorm {
    eps: f32,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "harpe-rms-norm"
    }

    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, c) = rows(lx, lw)?;
        let out = match (sx, sw) {
            (CpuStorage::F32(x), CpuStorage::F32(w)) => {
                CpuStorage::F32(rms_norm_par(slice(x, lx, "x")?, slice(w, lw, "w")?, c, self.eps))
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(w)) => {
                CpuStorage::BF16(rms_norm_par(slice(x, lx, "x")?, slice(w, lw, "w")?, c, self.eps))
            }
            (CpuStorage::F16(x), CpuStorage::F16(w)) => {
                CpuStorage::F16(rms_norm_par(slice(x, lx, "x")?, slice(w, lw, "w")?, c, self.eps))
            }
            _ => candle_core::bail!("rms_norm: x and w must share one dtype of f32, bf16, f16"),
        };
        Ok((out, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::fwd(self.eps, sx, lx, sw, lw)
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let c = w.dims1()?;
        let n = x.elem_count() / c;
        let packed = grad.contiguous()?.apply_op3(x, w, RmsNormBwd { eps: self.eps })?; // (N*C + C)
        let dx = packed.narrow(0, 0, n * c)?.reshape(x.shape())?;
        let dw = packed.narrow(0, n * c, c)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// The backward as an op: (dy, x, w) -> [dx (N*C) | dw (C)] flattened, in x's dtype.
struct RmsNormBwd {
    eps: f32,
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "harpe-rms-norm-bwd"
    }

    fn cpu_fwd(
        &self,
        sd: &CpuStorage,
        ld: &Layout,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, c) = rows(lx, lw)?;
        if ld.shape() != lx.shape() {
            candle_core::bail!("rms_norm backward: dy {:?} differs from x {:?}", ld.shape(), lx.shape());
        }
        fn pack<T: NormFloat>(dx: Vec<T>, dw: Vec<T>) -> Vec<T> {
            dx.into_iter().chain(dw).collect()
        }
        let out = match (sd, sx, sw) {
            (CpuStorage::F32(d), CpuStorage::F32(x), CpuStorage::F32(w)) => {
                let (dx, dw) =
                    rms_norm_bwd_par(slice(d, ld, "dy")?, slice(x, lx, "x")?, slice(w, lw, "w")?, c, self.eps);
                CpuStorage::F32(pack(dx, dw))
            }
            (CpuStorage::BF16(d), CpuStorage::BF16(x), CpuStorage::BF16(w)) => {
                let (dx, dw) =
                    rms_norm_bwd_par(slice(d, ld, "dy")?, slice(x, lx, "x")?, slice(w, lw, "w")?, c, self.eps);
                CpuStorage::BF16(pack(dx, dw))
            }
            (CpuStorage::F16(d), CpuStorage::F16(x), CpuStorage::F16(w)) => {
                let (dx, dw) =
                    rms_norm_bwd_par(slice(d, ld, "dy")?, slice(x, lx, "x")?, slice(w, lw, "w")?, c, self.eps);
                CpuStorage::F16(pack(dx, dw))
            }
            _ => candle_core::bail!("rms_norm backward: dy, x and w must share one dtype of f32, bf16, f16"),
        };
        Ok((out, Shape::from_dims(&[n * c + c])))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sd: &candle_core::CudaStorage,
        ld: &Layout,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::bwd(self.eps, sd, ld, sx, lx, sw, lw)
    }
}

/// RMSNorm over the last dimension of x (..., C) with weight w (C); differentiable in x and w.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps: eps as f32 })
}

/// The same from plain candle ops (`model::llama::rms_norm`'s formula), for tests.
pub fn rms_norm_slow(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(DType::F32)?;
    let var = xf.sqr()?.mean_keepdim(D::Minus1)?;
    let y = xf.broadcast_div(&(var + eps)?.sqrt()?)?.to_dtype(dtype)?;
    y.broadcast_mul(w)
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::rows;
    use crate::ops::cuda::{cfg, dtype_suffix, load_func, same_device, u32_arg, view, BLOCK, RMS_NORM};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, DType, Layout, Result, Shape};
    use half::bf16;

    fn check(sx: &CudaStorage, sw: &CudaStorage, op: &str) -> Result<&'static str> {
        same_device(sx, sw, op)?;
        if sx.dtype() != sw.dtype() {
            candle_core::bail!("{op}: x is {:?} but w is {:?}", sx.dtype(), sw.dtype());
        }
        dtype_suffix(sx.dtype(), op, "x")
    }

    pub fn fwd(eps: f32, sx: &CudaStorage, lx: &Layout, sw: &CudaStorage, lw: &Layout) -> Result<(CudaStorage, Shape)> {
        let sfx = check(sx, sw, "rms_norm")?;
        let (n, c) = rows(lx, lw)?;
        let (n32, c32) = (u32_arg(n, "rms_norm", "rows")?, u32_arg(c, "rms_norm", "C")?);
        let dev = sx.device();
        let func = load_func(dev, &format!("rms_norm_fwd_{sfx}"), &RMS_NORM)?;
        let null = 0u64;
        let grid = n32.clamp(1, crate::ops::cuda::MAX_GRID);
        macro_rules! go {
            ($t:ty) => {{
                let (x, w) = (view::<$t>(sx, lx, "rms_norm", "x")?, view::<$t>(sw, lw, "rms_norm", "w")?);
                // SAFETY: written in full by the kernel below.
                let y = unsafe { dev.alloc::<$t>(n * c)? };
                let mut b = func.builder();
                b.arg(&x).arg(&w).arg(&y).arg(&null).arg(&n32).arg(&c32).arg(&eps);
                // SAFETY: x, y hold n*c elements, w c; rstd is null (not kept).
                unsafe { b.launch(cfg(grid, BLOCK)) }.w()?;
                CudaStorage::wrap_cuda_slice(y, dev.clone())
            }};
        }
        let out = if sx.dtype() == DType::BF16 { go!(bf16) } else { go!(f32) };
        Ok((out, lx.shape().clone()))
    }

    pub fn bwd(
        eps: f32,
        sd: &CudaStorage,
        ld: &Layout,
        sx: &CudaStorage,
        lx: &Layout,
        sw: &CudaStorage,
        lw: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let sfx = check(sx, sw, "rms_norm backward")?;
        check(sd, sx, "rms_norm backward")?;
        let (n, c) = rows(lx, lw)?;
        if ld.shape() != lx.shape() {
            candle_core::bail!("rms_norm backward: dy {:?} differs from x {:?}", ld.shape(), lx.shape());
        }
        let (n32, c32) = (u32_arg(n, "rms_norm", "rows")?, u32_arg(c, "rms_norm", "C")?);
        let dev = sx.device();
        let fb = load_func(dev, &format!("rms_norm_bwd_{sfx}"), &RMS_NORM)?;
        let fw = load_func(dev, &format!("rms_norm_dw_{sfx}"), &RMS_NORM)?;
        // enough blocks to fill the GPU; each owns one row of dw partials
        let grid = n32.clamp(1, 1024);
        let partial = dev.alloc_zeros::<f32>(grid as usize * c)?;
        let null = 0u64;
        macro_rules! go {
            ($t:ty) => {{
                let d = view::<$t>(sd, ld, "rms_norm backward", "dy")?;
                let (x, w) = (view::<$t>(sx, lx, "rms_norm", "x")?, view::<$t>(sw, lw, "rms_norm", "w")?);
                // SAFETY: written in full by the two kernels below (dx, then dw).
                let mut out = unsafe { dev.alloc::<$t>(n * c + c)? };
                {
                    let mut dx = out.slice_mut(0..n * c);
                    let mut b = fb.builder();
                    b.arg(&d).arg(&x).arg(&w).arg(&null).arg(&mut dx).arg(&partial).arg(&n32).arg(&c32).arg(&eps);
                    // SAFETY: dy, x, dx hold n*c; partial grid*c; rstd null (recomputed from x).
                    unsafe { b.launch(cfg(grid, BLOCK)) }.w()?;
                }
                {
                    let mut dw = out.slice_mut(n * c..);
                    let mut b = fw.builder();
                    b.arg(&partial).arg(&mut dw).arg(&grid).arg(&c32);
                    // SAFETY: partial holds grid rows of c; dw c.
                    unsafe { b.launch(cfg(c32.div_ceil(BLOCK), BLOCK)) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let out = if sx.dtype() == DType::BF16 { go!(bf16) } else { go!(f32) };
        Ok((out, Shape::from_dims(&[n * c + c])))
    }
}
