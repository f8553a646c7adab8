//! CUDA plumbing for harpe's own kernels (kernels/*.cu): the embedded fatbins, module loading, launch
//! shapes, the precondition checks every launcher shares, and the launchers that work on flat device
//! buffers rather than tensors (AdamW, the gradient norm) for the optimizer to call.
//!
//! Reference: candle's and cudarc's kernel loading and launch API (`get_or_load_custom_func`,
//! `builder().arg(..).launch(..)`); `load_func` is candle's loader for a binary image (a fatbin with
//! SASS for sm_80 and sm_90, build.rs), which candle's takes only as PTX text.
//! The non-obvious decision: AdamW and the norm work on raw device memory, not through candle ops: the
//! training state is flat buffers (`FlatBuf::Device`) that the optimizer updates in place,
//! which candle's immutable tensors cannot express; `adamw_step_tensors` takes the device pointers of
//! those buffers' tensors (never shared, see flatbuf.rs), `adamw_step` those of cudarc slices (selftest,
//! bench). Only the norm's one f64 crosses to the host.
//! Does not: choose the device or own the training state (the optimizer does), run anything on CPU
//! (`ops::emu` is the host twin of the same kernels).
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, DeviceRepr, LaunchArgs,
    LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{bail, CudaStorage, DType, Device, Layout, Result, Storage, Tensor};
use half::bf16;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// One kernels/*.cu file as build.rs compiled it: a fatbin with SASS for sm_80 and sm_90 and the PTX of
/// both, so an A100 or H100/H200 runs without a JIT compile and a newer GPU JIT-compiles the PTX.
pub struct KernelFile {
    /// the file's stem, naming its module
    pub name: &'static str,
    /// the fatbin image
    pub image: &'static [u8],
}

/// The `KernelFile` of kernels/$name.cu.
macro_rules! kernel_file {
    ($name:literal) => {
        $crate::ops::cuda::KernelFile {
            name: $name,
            image: include_bytes!(concat!(env!("OUT_DIR"), "/", $name, ".fatbin")),
        }
    };
}
pub(crate) use kernel_file;

/// kernels/rope.cu.
pub const ROPE: KernelFile = kernel_file!("rope");
/// kernels/rms_norm.cu.
pub const RMS_NORM: KernelFile = kernel_file!("rms_norm");
/// kernels/cross_entropy.cu.
pub const CROSS_ENTROPY: KernelFile = kernel_file!("cross_entropy");
/// kernels/adamw.cu.
pub const ADAMW: KernelFile = kernel_file!("adamw");

/// A kernel of a `KernelFile`, launched on its device's stream (what candle's `CudaFunc` is for its own).
pub struct Func {
    func: CudaFunction,
    stream: Arc<CudaStream>,
}

impl Func {
    /// A launch of this kernel on the device's stream: `.arg(..)` each argument, then `.launch(cfg)`.
    pub fn builder(&self) -> LaunchArgs<'_> {
        self.stream.launch_builder(&self.func)
    }
}

/// The kernel `name` of `file` on `dev`. A file's module is loaded once per CUDA context and kept for
/// the process: candle's devices on one GPU share its primary context, so `Local` ranks sharing a GPU
/// load (and, on a GPU without SASS here, JIT-compile) each file once, not once per rank.
pub fn load_func(dev: &CudaDevice, name: &str, file: &KernelFile) -> Result<Func> {
    static MODULES: Mutex<BTreeMap<(usize, &str), Arc<CudaModule>>> = Mutex::new(BTreeMap::new());
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let module = {
        let mut loaded = MODULES.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match loaded.get(&(ctx.cu_ctx() as usize, file.name)) {
            Some(m) => m.clone(),
            None => {
                let m = ctx.load_module(Ptx::from_binary(file.image.to_vec())).map_err(|e| {
                    candle_core::Error::Msg(format!(
                        "cannot load kernels/{}.cu on cuda:{} ({e})\nhint: the build holds SASS and PTX for the \
                         archs of HARPE_CUDA_ARCHS (default 80,90): a GPU below the lowest cannot run it; build \
                         with its arch added, or update the driver if it is older than the CUDA toolchain",
                        file.name,
                        ctx.ordinal()
                    ))
                })?;
                loaded.insert((ctx.cu_ctx() as usize, file.name), m.clone());
                m
            }
        }
    };
    let func = module
        .load_function(name)
        .map_err(|e| candle_core::Error::Msg(format!("kernels/{}.cu has no kernel {name} ({e})", file.name)))?;
    Ok(Func { func, stream })
}

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

/// This rank's flat AdamW state on the device, all `n` long: master weights and moments (updated in
/// place) and the gradient.
pub struct AdamWBuffers<'a> {
    pub master: &'a mut CudaSlice<f32>,
    pub m: &'a mut CudaSlice<f32>,
    pub v: &'a mut CudaSlice<f32>,
    pub grad: &'a CudaSlice<f32>,
}

/// One fused AdamW step on this rank's flat master/m/v (all `n` long) with gradient `grad`; `segments`
/// are (local range, weight decay) pieces covering 0..n (adjacent equal decays are launched together).
pub fn adamw_step(
    dev: &CudaDevice,
    bufs: AdamWBuffers<'_>,
    out: ComputeOut<'_>,
    segments: &[(Range<usize>, f32)],
    s: AdamWStep,
) -> Result<()> {
    let AdamWBuffers { master, m, v, grad } = bufs;
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
    let stream = dev.cuda_stream();
    let (pm, _s1) = master.device_ptr_mut(&stream);
    let (mm, _s2) = m.device_ptr_mut(&stream);
    let (vm, _s3) = v.device_ptr_mut(&stream);
    let (gm, _s4) = grad.device_ptr(&stream);
    let (outp, _s5, bf) = match out {
        ComputeOut::None => (0, None, false),
        ComputeOut::F32(o) => {
            let (p, g) = o.device_ptr_mut(&stream);
            (p, Some(g), false)
        }
        ComputeOut::Bf16(o) => {
            let (p, g) = o.device_ptr_mut(&stream);
            (p, Some(g), true)
        }
    };
    // SAFETY: the four buffers and `out` (when not null) hold `n` elements each (checked above) and are
    // borrowed mutably (read-only for grad) for the whole launch.
    unsafe { launch_adamw(dev, [pm, mm, vm, gm], outp, bf, n, segments, s) }
}

/// `adamw_step` on the 1-D f32 device tensors of `FlatBuf::Device` buffers, updated in place:
/// master, m, v (`n` each) and `grad[grad_off..grad_off + n]` (a full-length gradient buffer or the
/// shard itself); no compute-weight output (the write-back copies the parameters).
pub fn adamw_step_tensors(
    master: &Tensor,
    m: &Tensor,
    v: &Tensor,
    grad: &Tensor,
    grad_off: usize,
    segments: &[(Range<usize>, f32)],
    s: AdamWStep,
) -> Result<()> {
    let n = master.elem_count();
    if m.elem_count() != n || v.elem_count() != n || grad.elem_count() < grad_off + n {
        bail!(
            "adamw: master {n}, m {}, v {} values and a gradient of {} read from {grad_off}",
            m.elem_count(),
            v.elem_count(),
            grad.elem_count()
        );
    }
    let Device::Cuda(dev) = master.device() else { bail!("adamw: the optimizer state is not on a CUDA device") };
    let stream = dev.cuda_stream();
    let ptr = |t: &Tensor, what: &str| -> Result<u64> {
        let (st, l) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*st else { bail!("adamw: `{what}` is not on a CUDA device") };
        if cs.device().id() != dev.id() {
            bail!("adamw: `{what}` is on another CUDA device than the master weights");
        }
        let r = contiguous(l, "adamw", what)?;
        let (p, _sync) = cs.as_cuda_slice::<f32>()?.device_ptr(&stream);
        Ok(p + (r.start * std::mem::size_of::<f32>()) as u64)
    };
    let g = ptr(grad, "grad")? + (grad_off * std::mem::size_of::<f32>()) as u64;
    let ptrs = [ptr(master, "master")?, ptr(m, "m")?, ptr(v, "v")?, g];
    // SAFETY: each tensor is a dense f32 buffer of at least `n` elements past its pointer (checked
    // above); master/m/v belong to `FlatBuf::Device` buffers that are never shared (their views are
    // copies) and whose owner holds them mutably for this call, so writing them in place on candle's
    // one stream is seen by nobody else; the storages stay alive in the tensors held by the caller.
    unsafe { launch_adamw(dev, ptrs, 0, false, n, segments, s) }
}

/// Launch `adamw_<dtype>` over `[master, m, v, grad]` device pointers (`out` 0 = no compute copy), one
/// launch per run of equal weight decay.
///
/// # Safety
/// Every pointer must address `n` valid elements (f32; `out` bf16 when `out_bf16`, else f32).
unsafe fn launch_adamw(
    dev: &CudaDevice,
    [pm, mm, vm, gm]: [u64; 4],
    out: u64,
    out_bf16: bool,
    n: usize,
    segments: &[(Range<usize>, f32)],
    s: AdamWStep,
) -> Result<()> {
    let merged = merge_segments(segments, n)?;
    let name = if out_bf16 { "adamw_bf16" } else { "adamw_f32" };
    let out_size = if out_bf16 { 2 } else { 4 };
    let func = load_func(dev, name, &ADAMW)?;
    for (r, wd) in merged {
        let len = (r.end - r.start) as u64;
        let at = |p: u64| p + 4 * r.start as u64;
        let (p, m, v, g) = (at(pm), at(mm), at(vm), at(gm));
        let o = if out == 0 { 0 } else { out + out_size * r.start as u64 };
        let mut b = func.builder();
        b.arg(&p).arg(&m).arg(&v).arg(&g).arg(&o);
        b.arg(&len).arg(&s.lr).arg(&s.beta1).arg(&s.beta2).arg(&s.eps).arg(&wd);
        b.arg(&s.step_size).arg(&s.bc2_sqrt).arg(&s.grad_scale);
        // SAFETY: the caller guarantees `n` elements behind every pointer; this range is inside 0..n.
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
    let f1 = load_func(dev, "grad_sumsq_partial", &ADAMW)?;
    let mut b = f1.builder();
    b.arg(grad).arg(&n).arg(&partial);
    // SAFETY: `partial` has one slot per block.
    unsafe { b.launch(cfg(grid, BLOCK)) }.w()?;
    let f2 = load_func(dev, "grad_sumsq_finish", &ADAMW)?;
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
