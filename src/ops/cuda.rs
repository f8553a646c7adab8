//! CUDA plumbing for harpe's own kernels (kernels/*.cu): the embedded PTX, module loading, launch
//! shapes, the precondition checks every launcher shares, and the launchers that work on flat device
//! buffers rather than tensors (AdamW, the gradient norm) for the optimizer to call.
//!
//! Reference: ../shared/cuda-build.md §3 (`get_or_load_custom_func`, `builder().arg(..).launch(..)`).
//! The non-obvious decision: AdamW and the norm take cudarc slices, not candle tensors: the training
//! state is flat buffers (DESIGN §6, `FlatBuf`) that the optimizer updates in place, which candle's
//! immutable tensors cannot express. Only the norm's one f64 crosses to the host.
//! Does not: choose the device or own the training state (the optimizer does), run anything on CPU
//! (`kernels_emu` is the host twin of the same kernels).
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{bail, CudaStorage, DType, Layout, Result};
use half::bf16;
use std::ops::Range;

/// PTX of kernels/rope.cu (compute_80; the driver JIT-compiles it for newer GPUs).
pub const ROPE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rope.ptx"));
/// PTX of kernels/rms_norm.cu.
pub const RMS_NORM_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rms_norm.ptx"));
/// PTX of kernels/cross_entropy.cu.
pub const CROSS_ENTROPY_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/cross_entropy.ptx"));
/// PTX of kernels/adamw.cu.
pub const ADAMW_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/adamw.ptx"));

/// Threads per block of the row kernels (rms_norm, cross_entropy) and the elementwise ones.
pub const BLOCK: u32 = 256;
/// Upper bound of blocks for grid-stride kernels (enough to fill 132 SMs several times over).
pub const MAX_GRID: u32 = 65535;

/// A 1-D launch of `grid` blocks of `block` threads.
pub fn cfg(grid: u32, block: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid.max(1), 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

/// Blocks for `n` elements at one element per thread, capped for a grid-stride loop.
pub fn grid_for(n: usize, block: u32) -> u32 {
    n.div_ceil(block as usize).clamp(1, MAX_GRID as usize) as u32
}

/// The kernel-name suffix of a storage dtype, or an error naming the op and argument.
pub fn dtype_suffix(dtype: DType, op: &str, arg: &str) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        d => bail!("{op}: `{arg}` is {d:?}; the CUDA kernel takes f32 or bf16"),
    }
}

/// The contiguous range of a layout, or an error (kernels read dense row-major memory only).
pub fn contiguous(l: &Layout, op: &str, arg: &str) -> Result<Range<usize>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(a..b),
        None => bail!("{op}: `{arg}` must be contiguous (call .contiguous() first)"),
    }
}

/// A dense view of a tensor's storage of element type T.
pub fn view<'a, T: candle_core::cuda_backend::CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    op: &str,
    arg: &str,
) -> Result<CudaView<'a, T>> {
    let r = contiguous(l, op, arg)?;
    Ok(s.as_cuda_slice::<T>()?.slice(r))
}

/// Fail early, naming the op, when the storages live on different devices.
pub fn same_device(a: &CudaStorage, b: &CudaStorage, op: &str) -> Result<()> {
    if a.device().id() != b.device().id() {
        bail!("{op}: inputs are on different CUDA devices");
    }
    Ok(())
}

/// u32 kernel argument or an error naming it.
pub fn u32_arg(v: usize, op: &str, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("{op}: {what} = {v} exceeds the kernel's u32 index")))
}

/// Scalars of one AdamW step; `step_size = lr / (1 - b1^t)` and `bc2_sqrt = sqrt(1 - b2^t)` computed in
/// f64 by the caller exactly as `optim::adamw::AdamW::step` does.
#[derive(Clone, Copy, Debug)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub step_size: f32,
    pub bc2_sqrt: f32,
    /// clipping scale applied to the gradient (1.0 when not clipped)
    pub grad_scale: f32,
}

/// Compute weights written by the AdamW kernel beside the master update.
pub enum ComputeOut<'a> {
    None,
    F32(&'a mut CudaSlice<f32>),
    Bf16(&'a mut CudaSlice<bf16>),
}

/// One fused AdamW step on this rank's flat master/m/v (all `n` long) with gradient `grad`; `segments`
/// are (local range, weight decay) pieces covering 0..n (adjacent equal decays are launched together).
#[allow(clippy::too_many_arguments)]
pub fn adamw_step(
    dev: &CudaDevice,
    master: &mut CudaSlice<f32>,
    m: &mut CudaSlice<f32>,
    v: &mut CudaSlice<f32>,
    grad: &CudaSlice<f32>,
    mut out: ComputeOut<'_>,
    segments: &[(Range<usize>, f32)],
    s: AdamWStep,
) -> Result<()> {
    let n = master.len();
    let out_len = match &out {
        ComputeOut::None => n,
        ComputeOut::F32(o) => o.len(),
        ComputeOut::Bf16(o) => o.len(),
    };
    if m.len() != n || v.len() != n || grad.len() != n || out_len != n {
        bail!(
            "adamw: buffers differ in length (master {n}, m {}, v {}, grad {}, out {out_len})",
            m.len(),
            v.len(),
            grad.len()
        );
    }
    let merged = merge_segments(segments, n)?;
    let name = match out {
        ComputeOut::Bf16(_) => "adamw_bf16",
        _ => "adamw_f32",
    };
    let func = dev.get_or_load_custom_func(name, "harpe_adamw", ADAMW_PTX)?;
    for (r, wd) in merged {
        let len = (r.end - r.start) as u64;
        let (mut ms, mut mm, mut mv) = (master.slice_mut(r.clone()), m.slice_mut(r.clone()), v.slice_mut(r.clone()));
        let g = grad.slice(r.clone());
        let null = 0u64;
        let mut of;
        let mut ob;
        let mut b = func.builder();
        b.arg(&mut ms).arg(&mut mm).arg(&mut mv).arg(&g);
        match &mut out {
            ComputeOut::None => {
                b.arg(&null);
            }
            ComputeOut::F32(o) => {
                of = o.slice_mut(r.clone());
                b.arg(&mut of);
            }
            ComputeOut::Bf16(o) => {
                ob = o.slice_mut(r.clone());
                b.arg(&mut ob);
            }
        }
        b.arg(&len).arg(&s.lr).arg(&s.beta1).arg(&s.beta2).arg(&s.eps).arg(&wd);
        b.arg(&s.step_size).arg(&s.bc2_sqrt).arg(&s.grad_scale);
        // SAFETY: every buffer covers `len` elements of the launched range; out may be null.
        unsafe { b.launch(cfg(grid_for(len as usize, BLOCK), BLOCK)) }.w()?;
    }
    Ok(())
}

/// Adjacent segments with equal decay joined; an error unless they tile 0..n in order.
fn merge_segments(segments: &[(Range<usize>, f32)], n: usize) -> Result<Vec<(Range<usize>, f32)>> {
    let mut out: Vec<(Range<usize>, f32)> = Vec::new();
    let mut at = 0;
    for (r, wd) in segments {
        if r.start != at || r.end < r.start {
            bail!("adamw: segment {r:?} does not continue at {at}; segments must tile 0..{n} in order");
        }
        at = r.end;
        match out.last_mut() {
            Some((last, lwd)) if *lwd == *wd => last.end = r.end,
            _ => out.push((r.clone(), *wd)),
        }
    }
    if at != n {
        bail!("adamw: segments end at {at}, the buffers hold {n}");
    }
    Ok(out)
}

/// Sum of squares of a flat f32 gradient in f64 (two deterministic passes on the device); the one
/// scalar is copied to the host. Its square root is the global norm for clipping.
pub fn grad_sumsq(dev: &CudaDevice, grad: &CudaView<'_, f32>) -> Result<f64> {
    let n = grad.len() as u64;
    let grid = grid_for(grad.len(), BLOCK).min(1024);
    let partial = dev.alloc_zeros::<f64>(grid as usize)?;
    let out = dev.alloc_zeros::<f64>(1)?;
    let f1 = dev.get_or_load_custom_func("grad_sumsq_partial", "harpe_adamw", ADAMW_PTX)?;
    let mut b = f1.builder();
    b.arg(grad).arg(&n).arg(&partial);
    // SAFETY: `partial` has one slot per block.
    unsafe { b.launch(cfg(grid, BLOCK)) }.w()?;
    let f2 = dev.get_or_load_custom_func("grad_sumsq_finish", "harpe_adamw", ADAMW_PTX)?;
    let mut b = f2.builder();
    b.arg(&partial).arg(&grid).arg(&out);
    // SAFETY: one block reads `grid` partials and writes one f64.
    unsafe { b.launch(cfg(1, BLOCK)) }.w()?;
    Ok(dev.clone_dtoh(&out)?[0])
}

/// Copy a host slice to a new device buffer (tests, selftest, bench).
pub fn to_device<T: DeviceRepr + 'static>(dev: &CudaDevice, v: &[T]) -> Result<CudaSlice<T>> {
    dev.clone_htod(v)
}
