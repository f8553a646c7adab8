//! CUDA launchers of kernels/attention.cu (flash attention forward, delta pre-kernel, backward, dQ
//! convert; FMA or tensor-core tiles) on candle's CUDA storages, and the `ops::attention` custom ops'
//! `cuda_fwd` bodies (`fwd_packed`, `bwd_packed`: the same packed layouts as the CPU path).
//!
//! Reference: kernels/attention.cu (algorithm, tiles, what a block owns); `kernels_emu::attention`, the
//! host twin with the same launch shapes, which tests/stage_model/attention_emu.rs checks against the CPU reference.
//! The non-obvious decision: the shape rules (head dim, H % Hkv, causal Tk >= Tq, u32 sizes) are the
//! emulator's `check_dims` and the tile heights and kernel choice `AttnKernel`'s, one owner for both
//! targets; every check runs before anything is allocated or launched. The tensor-core tiles load 16
//! bytes at a time, so a 16-bit input whose storage offset is not 16-byte aligned runs the FMA tiles
//! (or, when the tensor-core tiles were asked for by name, is an error).
//! Document masks: the per-token starts (`ops::attention::DocStarts`, (B, Tk) u32 on the device) go to the
//! kernels as one pointer, null without a mask (`DocsArg`).
//! Does not: wgmma/TMA (Hopper-only) tiles, or keep O in the input dtype across the op boundary (the
//! packed O|lse is f32, as on CPU; `ops::attention` converts O back).
use crate::kernels_emu::attention::{check_dims, AttnKernel, ATTN_THREADS};
use crate::ops::attention::AttnDims;
use crate::ops::cuda::{cfg, contiguous, grid_for, same_device, u32_arg, view};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchArgs, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{bail, CudaStorage, DType, Layout, Result, Shape};
use half::{bf16, f16};

/// PTX of kernels/attention.cu (compute_80; JIT-compiled by the driver on Hopper).
pub const ATTENTION_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
/// PTX of kernels/mma_probe.cu (the fragment-layout probe `harpe selftest` runs).
pub const MMA_PROBE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/mma_probe.ptx"));
const MODULE: &str = "harpe_attention";

/// Run `$body` with `$t` the Rust element type of `$dtype` (f32, bf16, f16), or an error naming `$what`.
macro_rules! by_dtype {
    ($dtype:expr, $what:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::BF16 => {
                type $t = bf16;
                $body
            }
            DType::F16 => {
                type $t = f16;
                $body
            }
            d => bail!(
                "attention (cuda): `{}` is {d:?}; the kernels take f32, bf16 or f16\nhint: cast q, k, v first",
                $what
            ),
        }
    };
}

fn suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    }
}

/// The kernel to run: `want`, or the fastest one that takes these inputs (`AttnKernel::best`, falling back
/// to the FMA tiles when an input's storage offset is not 16-byte aligned).
pub fn choose(dtype: DType, d: usize, layouts: &[&Layout], want: Option<AttnKernel>) -> Result<AttnKernel> {
    let bytes = dtype.size_in_bytes();
    let aligned = layouts.iter().all(|l| (l.start_offset() * bytes).is_multiple_of(16));
    match want {
        Some(k) => {
            k.check(bytes, d)?;
            if k == AttnKernel::TensorCore && !aligned {
                bail!("attention (cuda): the tensor-core tiles need 16-byte aligned inputs (an input starts at an odd offset)\nhint: .contiguous() into a fresh tensor, or let the op choose (AttnKernel::Fma runs then)");
            }
            Ok(k)
        }
        None if aligned => Ok(AttnKernel::best(bytes, d)),
        None => Ok(AttnKernel::Fma),
    }
}

/// Shapes of q (B, H, Tq, D), k and v (B, Hkv, Tk, D), checked against each other and the kernels.
pub fn dims_of(lq: &Layout, lk: &Layout, lv: &Layout, causal: bool) -> Result<AttnDims> {
    let (b, h, tq, d) = lq.shape().dims4()?;
    let (bk, hkv, tk, dk) = lk.shape().dims4()?;
    if bk != b || dk != d || lk.shape() != lv.shape() {
        bail!(
            "attention (cuda): q {:?}, k {:?}, v {:?} do not fit (need q (B,H,Tq,D), k = v (B,Hkv,Tk,D))",
            lq.shape(),
            lk.shape(),
            lv.shape()
        );
    }
    let dims = AttnDims { b, h, hkv, tq, tk, d };
    check_dims(dims, causal)?;
    for (l, arg) in [(lq, "q"), (lk, "k"), (lv, "v")] {
        contiguous(l, "attention", arg)?;
    }
    Ok(dims)
}

/// The document-mask argument of a kernel: the per-token starts (B*Tk u32), or a null pointer.
pub type DocsArg<'a> = Option<CudaView<'a, u32>>;

/// Push `docs` (or a null device pointer) as the next kernel argument.
fn push_docs<'a>(bld: &mut LaunchArgs<'a>, docs: &'a DocsArg<'_>, null: &'a u64) {
    match docs {
        Some(d) => bld.arg(d),
        None => bld.arg(null),
    };
}

/// Run `f` with a device view of the document starts `docs` ((B, Tk) u32 on q's device), checked
/// against `dims`; None passes None.
fn with_docs<R>(
    docs: Option<&candle_core::Tensor>,
    dims: AttnDims,
    causal: bool,
    f: impl FnOnce(DocsArg<'_>) -> Result<R>,
) -> Result<R> {
    let Some(t) = docs else { return f(None) };
    if !causal {
        bail!("attention (cuda): a document mask needs causal attention\nhint: pass causal = true");
    }
    if t.dtype() != DType::U32 || t.dims() != [dims.b, dims.tk] {
        bail!(
            "attention (cuda): document starts are {:?} {:?}, expected (B {}, Tk {}) u32",
            t.dtype(),
            t.dims(),
            dims.b,
            dims.tk
        );
    }
    let (st, l) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*st else {
        bail!("attention (cuda): the document starts are not on the CUDA device\nhint: build DocStarts on the model's device")
    };
    f(Some(view::<u32>(cs, l, "attention", "docs")?))
}

fn same_dtype(a: &CudaStorage, b: &CudaStorage, what: &str) -> Result<()> {
    if a.dtype() != b.dtype() {
        bail!(
            "attention (cuda): {what} is {:?} but q is {:?}\nhint: cast q, k, v (and dO) to one dtype",
            b.dtype(),
            a.dtype()
        );
    }
    same_device(a, b, "attention")
}

/// The forward kernel on device views: (O (B*H*Tq*D) of T, lse (B*H*Tq) f32).
#[allow(clippy::too_many_arguments)]
fn fwd_t<T: DeviceRepr>(
    dev: &CudaDevice,
    kernel: AttnKernel,
    q: &CudaView<T>,
    k: &CudaView<T>,
    v: &CudaView<T>,
    dtype: DType,
    dims: AttnDims,
    scale: f32,
    causal: bool,
    docs: &DocsArg<'_>,
) -> Result<(CudaSlice<T>, CudaSlice<f32>)> {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let func =
        dev.get_or_load_custom_func(&format!("{}_{}_d{d}", kernel.stem("fwd"), suffix(dtype)), MODULE, ATTENTION_PTX)?;
    let grid = u32_arg(tq.div_ceil(kernel.fwd_rows(d)) * b * h, "attention", "forward blocks")?;
    let (b32, h32, hkv32, tq32, tk32) = (b as u32, h as u32, hkv as u32, tq as u32, tk as u32);
    let causal32 = causal as i32;
    // SAFETY: both written in full by the kernel (every valid row of every head, and its lse).
    let (o, lse) = unsafe { (dev.alloc::<T>(b * h * tq * d)?, dev.alloc::<f32>(b * h * tq)?) };
    let mut bld = func.builder();
    let null = 0u64;
    bld.arg(q).arg(k).arg(v).arg(&o).arg(&lse);
    push_docs(&mut bld, docs, &null);
    bld.arg(&b32).arg(&h32).arg(&hkv32).arg(&tq32).arg(&tk32).arg(&scale).arg(&causal32);
    // SAFETY: shapes checked by dims_of; the grid is the kernel's (q tile, head, batch) decode.
    unsafe { bld.launch(cfg(grid, ATTN_THREADS)) }.w()?;
    Ok((o, lse))
}

/// Device views of one backward's inputs and outputs.
struct BwdBufs<'a, 'b, T> {
    q: CudaView<'a, T>,
    k: CudaView<'a, T>,
    v: CudaView<'a, T>,
    o: CudaView<'a, T>,
    lse: CudaView<'a, f32>,
    dout: CudaView<'a, T>,
    dq: CudaViewMut<'b, T>,
    dk: CudaViewMut<'b, T>,
    dv: CudaViewMut<'b, T>,
}

/// delta pre-kernel, backward, dQ convert into the given outputs.
#[allow(clippy::too_many_arguments)]
fn bwd_t<T: DeviceRepr>(
    dev: &CudaDevice,
    kernel: AttnKernel,
    bufs: &mut BwdBufs<'_, '_, T>,
    dtype: DType,
    dims: AttnDims,
    scale: f32,
    causal: bool,
    docs: &DocsArg<'_>,
) -> Result<()> {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let sfx = suffix(dtype);
    let f_delta = dev.get_or_load_custom_func(&format!("attn_bwd_delta_{sfx}"), MODULE, ATTENTION_PTX)?;
    let f_bwd = dev.get_or_load_custom_func(&format!("{}_{sfx}_d{d}", kernel.stem("bwd")), MODULE, ATTENTION_PTX)?;
    let f_conv = dev.get_or_load_custom_func(&format!("attn_dq_convert_{sfx}"), MODULE, ATTENTION_PTX)?;
    let rows = b * h * tq;
    let (rows32, d32) = (u32_arg(rows, "attention", "rows")?, d as u32);
    let (b32, h32, hkv32, tq32, tk32) = (b as u32, h as u32, hkv as u32, tq as u32, tk as u32);
    let causal32 = causal as i32;
    let nq = (rows * d) as u64;
    let wpb = (ATTN_THREADS / 32) as usize;
    let grid_delta = rows.div_ceil(wpb).min(65535) as u32;
    let grid_bwd = u32_arg(tk.div_ceil(kernel.bwd_keys(d)) * b * hkv, "attention", "backward blocks")?;
    // SAFETY: written in full by the delta kernel; dq_acc is zeroed because the backward adds into it.
    let delta = unsafe { dev.alloc::<f32>(rows)? };
    let dq_acc = dev.alloc_zeros::<f32>(rows * d)?;
    let mut bld = f_delta.builder();
    bld.arg(&bufs.o).arg(&bufs.dout).arg(&delta).arg(&rows32).arg(&d32);
    // SAFETY: o, dout hold rows*d; delta rows.
    unsafe { bld.launch(cfg(grid_delta, ATTN_THREADS)) }.w()?;
    let mut bld = f_bwd.builder();
    let null = 0u64;
    bld.arg(&bufs.q).arg(&bufs.k).arg(&bufs.v).arg(&bufs.dout).arg(&bufs.lse).arg(&delta);
    push_docs(&mut bld, docs, &null);
    bld.arg(&dq_acc);
    bld.arg(&mut bufs.dk).arg(&mut bufs.dv);
    bld.arg(&b32).arg(&h32).arg(&hkv32).arg(&tq32).arg(&tk32).arg(&scale).arg(&causal32);
    // SAFETY: shapes checked by dims_of; the grid is the kernel's (key tile, kv head, batch) decode.
    unsafe { bld.launch(cfg(grid_bwd, ATTN_THREADS)) }.w()?;
    let mut bld = f_conv.builder();
    bld.arg(&dq_acc).arg(&mut bufs.dq).arg(&nq);
    // SAFETY: dq_acc and dq hold nq elements.
    unsafe { bld.launch(cfg(grid_for(rows * d, ATTN_THREADS), ATTN_THREADS)) }.w()?;
    Ok(())
}

/// Forward: (O with q's shape and dtype, lse (B*H*Tq) f32, the kernel that ran); `want` None chooses.
#[allow(clippy::too_many_arguments)]
pub fn fwd(
    sq: &CudaStorage,
    lq: &Layout,
    sk: &CudaStorage,
    lk: &Layout,
    sv: &CudaStorage,
    lv: &Layout,
    scale: f32,
    causal: bool,
    want: Option<AttnKernel>,
) -> Result<(CudaStorage, CudaSlice<f32>, AttnKernel)> {
    fwd_docs(sq, lq, sk, lk, sv, lv, scale, causal, want, None)
}

/// `fwd` with an optional document mask: `docs` the document starts ((B, Tk) u32, `DocStarts::tensor`).
#[allow(clippy::too_many_arguments)]
pub fn fwd_docs(
    sq: &CudaStorage,
    lq: &Layout,
    sk: &CudaStorage,
    lk: &Layout,
    sv: &CudaStorage,
    lv: &Layout,
    scale: f32,
    causal: bool,
    want: Option<AttnKernel>,
    docs: Option<&candle_core::Tensor>,
) -> Result<(CudaStorage, CudaSlice<f32>, AttnKernel)> {
    let dims = dims_of(lq, lk, lv, causal)?;
    same_dtype(sq, sk, "k")?;
    same_dtype(sq, sv, "v")?;
    let dtype = sq.dtype();
    by_dtype!(dtype, "q", T => {
        let kernel = choose(dtype, dims.d, &[lq, lk, lv], want)?;
        let dev = sq.device();
        let (q, k, v) = (view::<T>(sq, lq, "attention", "q")?, view::<T>(sk, lk, "attention", "k")?, view::<T>(sv, lv, "attention", "v")?);
        let (o, lse) = with_docs(docs, dims, causal, |dv| fwd_t(dev, kernel, &q, &k, &v, dtype, dims, scale, causal, &dv))?;
        Ok((CudaStorage::wrap_cuda_slice(o, dev.clone()), lse, kernel))
    })
}

/// Backward: (dQ, dK, dV) with the shapes and dtype of q, k, v, from the forward's O and lse and dO.
#[allow(clippy::too_many_arguments)]
pub fn bwd(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    o: (&CudaStorage, &Layout),
    lse: &CudaSlice<f32>,
    dout: (&CudaStorage, &Layout),
    scale: f32,
    causal: bool,
    want: Option<AttnKernel>,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    bwd_docs(q, k, v, o, lse, dout, scale, causal, want, None)
}

/// `bwd` with an optional document mask (`fwd_docs`'s `docs`).
#[allow(clippy::too_many_arguments)]
pub fn bwd_docs(
    (sq, lq): (&CudaStorage, &Layout),
    (sk, lk): (&CudaStorage, &Layout),
    (sv, lv): (&CudaStorage, &Layout),
    (so, lo): (&CudaStorage, &Layout),
    lse: &CudaSlice<f32>,
    (sd, ld): (&CudaStorage, &Layout),
    scale: f32,
    causal: bool,
    want: Option<AttnKernel>,
    docs: Option<&candle_core::Tensor>,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let dims = dims_of(lq, lk, lv, causal)?;
    for (s, l, what) in [(so, lo, "O"), (sd, ld, "dO")] {
        same_dtype(sq, s, what)?;
        if l.shape() != lq.shape() {
            bail!("attention backward (cuda): {what} {:?} differs from q {:?}", l.shape(), lq.shape());
        }
    }
    same_dtype(sq, sk, "k")?;
    same_dtype(sq, sv, "v")?;
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    if lse.len() != b * h * tq {
        bail!("attention backward (cuda): lse has {} values, expected B*H*Tq = {}", lse.len(), b * h * tq);
    }
    let dtype = sq.dtype();
    by_dtype!(dtype, "q", T => {
        let kernel = choose(dtype, d, &[lq, lk, lv, lo, ld], want)?;
        let dev = sq.device();
        // SAFETY: dq by the convert kernel, dk/dv by the backward (every valid key row), all in full.
        let (mut dq, mut dk, mut dv) =
            unsafe { (dev.alloc::<T>(b * h * tq * d)?, dev.alloc::<T>(b * hkv * tk * d)?, dev.alloc::<T>(b * hkv * tk * d)?) };
        {
            let mut bufs = BwdBufs {
                q: view::<T>(sq, lq, "attention", "q")?,
                k: view::<T>(sk, lk, "attention", "k")?,
                v: view::<T>(sv, lv, "attention", "v")?,
                o: view::<T>(so, lo, "attention", "O")?,
                lse: lse.slice(..),
                dout: view::<T>(sd, ld, "attention", "dO")?,
                dq: dq.slice_mut(..),
                dk: dk.slice_mut(..),
                dv: dv.slice_mut(..),
            };
            with_docs(docs, dims, causal, |dv| bwd_t(dev, kernel, &mut bufs, dtype, dims, scale, causal, &dv))?;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(dq, dev.clone()),
            CudaStorage::wrap_cuda_slice(dk, dev.clone()),
            CudaStorage::wrap_cuda_slice(dv, dev.clone()),
        ))
    })
}

/// `AttentionFwd::cuda_fwd`: q, k, v (one dtype: f32, bf16 or f16) -> O|lse packed (B, H, Tq, D + 1) f32.
#[allow(clippy::too_many_arguments)]
pub fn fwd_packed(
    sq: &CudaStorage,
    lq: &Layout,
    sk: &CudaStorage,
    lk: &Layout,
    sv: &CudaStorage,
    lv: &Layout,
    scale: f32,
    causal: bool,
    docs: Option<&candle_core::Tensor>,
) -> Result<(CudaStorage, Shape)> {
    let AttnDims { b, h, tq, d, .. } = dims_of(lq, lk, lv, causal)?;
    let rows = b * h * tq;
    let rows32 = u32_arg(rows, "attention", "rows")?;
    u32_arg(rows * (d + 1), "attention", "packed output")?;
    // the forward with its checks and kernel choice, then one pack kernel
    let (o, lse, _) = fwd_docs(sq, lq, sk, lk, sv, lv, scale, causal, None, docs)?;
    let dtype = sq.dtype();
    by_dtype!(dtype, "q", T => {
        let dev = sq.device();
        let o = o.as_cuda_slice::<T>()?;
        // SAFETY: written in full by the pack kernel.
        let packed = unsafe { dev.alloc::<f32>(rows * (d + 1))? };
        let func = dev.get_or_load_custom_func(&format!("attn_pack_fwd_{}", suffix(dtype)), MODULE, ATTENTION_PTX)?;
        let d32 = d as u32;
        let mut bld = func.builder();
        bld.arg(o).arg(&lse).arg(&packed).arg(&rows32).arg(&d32);
        // SAFETY: o holds rows*d, lse rows, packed rows*(d+1).
        unsafe { bld.launch(cfg(grid_for(rows * (d + 1), ATTN_THREADS), ATTN_THREADS)) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(packed, dev.clone()), Shape::from_dims(&[b, h, tq, d + 1])))
    })
}

/// `AttentionBwd::cuda_fwd`: packed (B, H, Tq, 3D + 2) f32 = [q | O | lse | dO | .], k, v of dtype T ->
/// dQ, dK, dV flattened one after the other (len q + len k + len v) in T.
#[allow(clippy::too_many_arguments)]
pub fn bwd_packed(
    sp: &CudaStorage,
    lp: &Layout,
    (sk, lk): (&CudaStorage, &Layout),
    (sv, lv): (&CudaStorage, &Layout),
    d: usize,
    scale: f32,
    causal: bool,
    docs: Option<&candle_core::Tensor>,
) -> Result<(CudaStorage, Shape)> {
    let (b, h, tq, w) = lp.shape().dims4()?;
    if w != 3 * d + 2 || sp.dtype() != DType::F32 {
        bail!(
            "attention backward (cuda): packed input is {:?} {:?}, expected (B, H, Tq, 3 * {d} + 2) f32",
            lp.shape(),
            sp.dtype()
        );
    }
    let lq = Layout::contiguous((b, h, tq, d));
    let dims = dims_of(&lq, lk, lv, causal)?;
    same_dtype(sk, sv, "v")?;
    same_device(sp, sk, "attention backward")?;
    let AttnDims { hkv, tk, .. } = dims;
    let rows = b * h * tq;
    let rows32 = u32_arg(rows, "attention", "rows")?;
    u32_arg(rows * w, "attention", "packed input")?;
    let dtype = sk.dtype();
    by_dtype!(dtype, "k", T => {
        let kernel = choose(dtype, d, &[lk, lv], None)?;
        let dev = sk.device();
        let packed = view::<f32>(sp, lp, "attention backward", "packed")?;
        let (nq, nkv) = (rows * d, b * hkv * tk * d);
        // SAFETY: written in full by the unpack kernel.
        let (q, o, dout, lse) = unsafe { (dev.alloc::<T>(nq)?, dev.alloc::<T>(nq)?, dev.alloc::<T>(nq)?, dev.alloc::<f32>(rows)?) };
        let func = dev.get_or_load_custom_func(&format!("attn_unpack_bwd_{}", suffix(dtype)), MODULE, ATTENTION_PTX)?;
        let d32 = d as u32;
        let mut bld = func.builder();
        bld.arg(&packed).arg(&q).arg(&o).arg(&dout).arg(&lse).arg(&rows32).arg(&d32);
        // SAFETY: packed holds rows*(3d+2); q, o, dout rows*d; lse rows.
        unsafe { bld.launch(cfg(grid_for(rows * w, ATTN_THREADS), ATTN_THREADS)) }.w()?;
        // SAFETY: dq, dk, dv (the three parts) are written in full by bwd_t.
        let mut flat = unsafe { dev.alloc::<T>(nq + 2 * nkv)? };
        {
            let (dq, mut rest) = flat.split_at_mut(nq);
            let (dk, dv) = rest.split_at_mut(nkv);
            let mut bufs = BwdBufs {
                q: q.slice(..),
                k: view::<T>(sk, lk, "attention", "k")?,
                v: view::<T>(sv, lv, "attention", "v")?,
                o: o.slice(..),
                lse: lse.slice(..),
                dout: dout.slice(..),
                dq,
                dk,
                dv,
            };
            with_docs(docs, dims, causal, |dv| bwd_t(dev, kernel, &mut bufs, dtype, dims, scale, causal, &dv))?;
        }
        Ok((CudaStorage::wrap_cuda_slice(flat, dev.clone()), Shape::from_dims(&[nq + 2 * nkv])))
    })
}

/// kernels/mma_probe.cu on the GPU: A (16x16) B (16x16) four ways (4 x 256 f32), inputs rounded to `dtype`
/// (bf16 or f16) — the hardware's side of the emulated fragment layouts.
pub fn mma_probe(dev: &CudaDevice, dtype: DType, a: &[f32], b: &[f32], bt: &[f32]) -> Result<Vec<f32>> {
    fn go<T: DeviceRepr + CudaDType + 'static>(
        dev: &CudaDevice,
        name: &str,
        conv: fn(f32) -> T,
        a: &[f32],
        b: &[f32],
        bt: &[f32],
    ) -> Result<Vec<f32>> {
        let up = |x: &[f32]| dev.clone_htod(&x.iter().map(|&v| conv(v)).collect::<Vec<T>>());
        let (da, db, dbt) = (up(a)?, up(b)?, up(bt)?);
        let out = dev.alloc_zeros::<f32>(1024)?;
        let func = dev.get_or_load_custom_func(name, "harpe_mma_probe", MMA_PROBE_PTX)?;
        let mut bld = func.builder();
        bld.arg(&da).arg(&db).arg(&dbt).arg(&out);
        // SAFETY: one warp reads 256 elements of each input and writes 1024 floats.
        unsafe { bld.launch(cfg(1, 32)) }.w()?;
        dev.clone_dtoh(&out)
    }
    for (x, what) in [(a, "a"), (b, "b"), (bt, "bt")] {
        if x.len() != 256 {
            bail!("mma probe: `{what}` has {} values, expected 256 (16x16)", x.len());
        }
    }
    match dtype {
        DType::BF16 => go::<bf16>(dev, "mma_probe_bf16", bf16::from_f32, a, b, bt),
        DType::F16 => go::<f16>(dev, "mma_probe_f16", f16::from_f32, a, b, bt),
        d => bail!("mma probe: {d:?}; the tensor-core instructions take bf16 or f16"),
    }
}
