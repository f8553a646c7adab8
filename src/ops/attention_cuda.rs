//! CUDA launchers of kernels/attention.cu (flash attention forward, delta pre-kernel, backward, dQ
//! convert; FMA or tensor-core tiles) on candle's CUDA storages, and the `ops::attention` custom ops'
//! `cuda_fwd` bodies (`fwd_packed`, `bwd_packed`: the same packed layouts as the CPU path).
//!
//! Reference: kernels/attention.cu (algorithm, tiles, what a block owns); `ops::emu::attention`, the
//! host twin with the same launch shapes, which tests/stage_model/attention_emu.rs checks against the CPU reference.
//! The non-obvious decision: the shape rules (head dim, H % Hkv, causal Tk >= Tq, u32 sizes) are
//! `ops::attention_shape::check_dims` and the tile heights and kernel choice `AttnKernel`'s, one owner for
//! this launcher and the emulator; every check runs before anything is allocated or launched. The tensor-core tiles load 16
//! bytes at a time, so a 16-bit input whose storage offset is not 16-byte aligned runs the FMA tiles
//! (or, when the tensor-core tiles were asked for by name, is an error).
//! Document masks: the per-token starts (`ops::attention::DocStarts`, (B, Tk) u32 on the device) go to the
//! kernels as one pointer, null without a mask (`DocsArg`).
//! The op's layouts (`ops::attention_shape::PackedRows`): the forward writes O and lse straight into its
//! packed output rows in the input type, the backward reads q, O, lse and dO in place from its packed input
//! rows; the only other allocation is the scratch of `attention_workspace` (delta and the f32 dQ
//! accumulator), so nothing of q/k/v/O/dO is ever copied to f32.
//! Does not: wgmma/TMA (Hopper-only) tiles.
use crate::ops::attention_shape::{
    attention_workspace, check_dims, AttnDims, AttnKernel, AttnMask, PackedRows, ATTN_THREADS,
};
use crate::ops::cuda::{cfg, contiguous, grid_for, kernel_file, load_func, same_device, u32_arg, view, KernelFile};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchArgs, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{bail, CudaStorage, DType, Layout, Result, Shape};
use half::{bf16, f16};

/// kernels/attention.cu.
pub const ATTENTION: KernelFile = kernel_file!("attention");
/// kernels/mma_probe.cu (the fragment-layout probe `harpe selftest` runs).
pub const MMA_PROBE: KernelFile = kernel_file!("mma_probe");

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

/// Where a forward writes: O rows `ldo` elements apart and lse values `ldl` floats apart (two plain buffers,
/// or one buffer of the op's packed rows with lse viewed from element D on: `L` is then T).
struct FwdOut<'a, T, L> {
    o: CudaView<'a, T>,
    lse: CudaView<'a, L>,
    ldo: u32,
    ldl: u32,
}

/// What one launch runs besides its buffers: the tiles, the element type, the shapes, the scale and the
/// causal flag.
#[derive(Clone, Copy)]
struct Spec {
    kernel: AttnKernel,
    dtype: DType,
    dims: AttnDims,
    scale: f32,
    causal: bool,
}

/// The forward kernel on device views, writing into `out`.
fn fwd_t<T: DeviceRepr, L>(
    dev: &CudaDevice,
    Spec { kernel, dtype, dims, scale, causal }: Spec,
    (q, k, v): (&CudaView<T>, &CudaView<T>, &CudaView<T>),
    out: &FwdOut<'_, T, L>,
    docs: &DocsArg<'_>,
) -> Result<()> {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let func = load_func(dev, &format!("{}_{}_d{d}", kernel.stem("fwd"), suffix(dtype)), &ATTENTION)?;
    let grid = u32_arg(tq.div_ceil(kernel.fwd_rows(d)) * b * h, "attention", "forward blocks")?;
    let (b32, h32, hkv32, tq32, tk32) = (b as u32, h as u32, hkv as u32, tq as u32, tk as u32);
    let causal32 = causal as i32;
    let mut bld = func.builder();
    let null = 0u64;
    bld.arg(q).arg(k).arg(v).arg(&out.o).arg(&out.lse);
    push_docs(&mut bld, docs, &null);
    bld.arg(&b32).arg(&h32).arg(&hkv32).arg(&tq32).arg(&tk32).arg(&scale).arg(&causal32);
    bld.arg(&out.ldo).arg(&out.ldl);
    // SAFETY: shapes checked by dims_of; `out` holds every row (the callers size it); the grid is the
    // kernel's (q tile, head, batch) decode.
    unsafe { bld.launch(cfg(grid, kernel.threads())) }.w()?;
    Ok(())
}

/// Device views of one backward's inputs and outputs: q, O and dO rows `ldq` elements apart, lse values
/// `ldl` floats apart (plain buffers, or views into the op's packed rows with `L` = T).
struct BwdBufs<'a, 'b, T, L> {
    q: CudaView<'a, T>,
    k: CudaView<'a, T>,
    v: CudaView<'a, T>,
    o: CudaView<'a, T>,
    lse: CudaView<'a, L>,
    dout: CudaView<'a, T>,
    ldq: u32,
    ldl: u32,
    dq: CudaViewMut<'b, T>,
    dk: CudaViewMut<'b, T>,
    dv: CudaViewMut<'b, T>,
}

/// delta pre-kernel, backward, dQ convert into the given outputs; the only allocation is the op's scratch
/// (`attention_workspace(..).bwd_scratch`: delta, then the zeroed dQ accumulator).
fn bwd_t<T: DeviceRepr, L>(
    dev: &CudaDevice,
    Spec { kernel, dtype, dims, scale, causal }: Spec,
    bufs: &mut BwdBufs<'_, '_, T, L>,
    docs: &DocsArg<'_>,
) -> Result<()> {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let sfx = suffix(dtype);
    let f_delta = load_func(dev, &format!("attn_bwd_delta_{sfx}"), &ATTENTION)?;
    let f_bwd = load_func(dev, &format!("{}_{sfx}_d{d}", kernel.stem("bwd")), &ATTENTION)?;
    let f_conv = load_func(dev, &format!("attn_dq_convert_{sfx}"), &ATTENTION)?;
    let rows = b * h * tq;
    let (rows32, d32) = (u32_arg(rows, "attention", "rows")?, d as u32);
    let (b32, h32, hkv32, tq32, tk32) = (b as u32, h as u32, hkv as u32, tq as u32, tk as u32);
    let causal32 = causal as i32;
    let nq = (rows * d) as u64;
    let wpb = (ATTN_THREADS / 32) as usize;
    let grid_delta = rows.div_ceil(wpb).min(65535) as u32;
    let grid_bwd = u32_arg(tk.div_ceil(kernel.bwd_keys(d)) * b * hkv, "attention", "backward blocks")?;
    // zeroed because the backward adds into dq_acc (delta is written in full by its kernel)
    let ws = attention_workspace(dims, dtype.size_in_bytes());
    let scratch = dev.alloc_zeros::<f32>(ws.scratch_floats())?;
    let (delta, dq_acc) = (part(&scratch, 0..rows)?, part(&scratch, rows..ws.scratch_floats())?);
    let mut bld = f_delta.builder();
    bld.arg(&bufs.o).arg(&bufs.dout).arg(&delta).arg(&rows32).arg(&d32).arg(&bufs.ldq);
    // SAFETY: o, dout hold rows rows of d, ldq apart; delta rows.
    unsafe { bld.launch(cfg(grid_delta, ATTN_THREADS)) }.w()?;
    let mut bld = f_bwd.builder();
    let null = 0u64;
    bld.arg(&bufs.q).arg(&bufs.k).arg(&bufs.v).arg(&bufs.dout).arg(&bufs.lse).arg(&delta);
    push_docs(&mut bld, docs, &null);
    bld.arg(&dq_acc);
    bld.arg(&mut bufs.dk).arg(&mut bufs.dv);
    bld.arg(&b32).arg(&h32).arg(&hkv32).arg(&tq32).arg(&tk32).arg(&scale).arg(&causal32);
    bld.arg(&bufs.ldq).arg(&bufs.ldl);
    // SAFETY: shapes checked by dims_of; the grid is the kernel's (key tile, kv head, batch) decode.
    unsafe { bld.launch(cfg(grid_bwd, kernel.threads())) }.w()?;
    let mut bld = f_conv.builder();
    bld.arg(&dq_acc).arg(&mut bufs.dq).arg(&nq);
    // SAFETY: dq_acc and dq hold nq elements.
    unsafe { bld.launch(cfg(grid_for(rows * d, ATTN_THREADS), ATTN_THREADS)) }.w()?;
    Ok(())
}

/// Elements `r` of a device buffer as a view, or an error (cudarc's `slice` would panic).
fn part<T>(s: &CudaSlice<T>, r: std::ops::Range<usize>) -> Result<CudaView<'_, T>> {
    let (lo, hi) = (r.start, r.end.min(s.len()));
    s.try_slice(lo..hi)
        .ok_or_else(|| candle_core::Error::Msg(format!("attention (cuda): buffer of {} has no {lo}..{hi}", s.len())))
}

/// Elements `at..` of a device view, or an error.
fn from<'a, T>(v: &CudaView<'a, T>, at: usize) -> Result<CudaView<'a, T>> {
    v.try_slice(at..)
        .ok_or_else(|| candle_core::Error::Msg(format!("attention (cuda): view of {} has no element {at}", v.len())))
}

/// Forward: (O with q's shape and dtype, lse (B*H*Tq) f32, the kernel that ran); `want` None chooses;
/// `docs` an optional document mask, the document starts ((B, Tk) u32, `DocStarts::tensor`).
pub fn fwd(
    (sq, lq): (&CudaStorage, &Layout),
    (sk, lk): (&CudaStorage, &Layout),
    (sv, lv): (&CudaStorage, &Layout),
    AttnMask { scale, causal, docs }: AttnMask<'_, candle_core::Tensor>,
    want: Option<AttnKernel>,
) -> Result<(CudaStorage, CudaSlice<f32>, AttnKernel)> {
    let dims = dims_of(lq, lk, lv, causal)?;
    same_dtype(sq, sk, "k")?;
    same_dtype(sq, sv, "v")?;
    let dtype = sq.dtype();
    by_dtype!(dtype, "q", T => {
        let kernel = choose(dtype, dims.d, &[lq, lk, lv], want)?;
        let dev = sq.device();
        let (q, k, v) = (view::<T>(sq, lq, "attention", "q")?, view::<T>(sk, lk, "attention", "k")?, view::<T>(sv, lv, "attention", "v")?);
        let rows = dims.b * dims.h * dims.tq;
        // SAFETY: both written in full by the kernel (every valid row of every head, and its lse).
        let (o, lse) = unsafe { (dev.alloc::<T>(rows * dims.d)?, dev.alloc::<f32>(rows)?) };
        let out = FwdOut { o: o.slice(..), lse: lse.slice(..), ldo: dims.d as u32, ldl: 1 };
        let spec = Spec { kernel, dtype, dims, scale, causal };
        with_docs(docs, dims, causal, |dv| fwd_t(dev, spec, (&q, &k, &v), &out, &dv))?;
        Ok((CudaStorage::wrap_cuda_slice(o, dev.clone()), lse, kernel))
    })
}

/// Backward: (dQ, dK, dV) with the shapes and dtype of q, k, v, from the forward's O and lse and dO, under
/// `fwd`'s optional document mask `docs`.
pub fn bwd(
    (sq, lq): (&CudaStorage, &Layout),
    (sk, lk): (&CudaStorage, &Layout),
    (sv, lv): (&CudaStorage, &Layout),
    ((so, lo), lse): ((&CudaStorage, &Layout), &CudaSlice<f32>),
    (sd, ld): (&CudaStorage, &Layout),
    AttnMask { scale, causal, docs }: AttnMask<'_, candle_core::Tensor>,
    want: Option<AttnKernel>,
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
                ldq: d as u32,
                ldl: 1,
                dq: dq.slice_mut(..),
                dk: dk.slice_mut(..),
                dv: dv.slice_mut(..),
            };
            let spec = Spec { kernel, dtype, dims, scale, causal };
            with_docs(docs, dims, causal, |dv| bwd_t(dev, spec, &mut bufs, &dv))?;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(dq, dev.clone()),
            CudaStorage::wrap_cuda_slice(dk, dev.clone()),
            CudaStorage::wrap_cuda_slice(dv, dev.clone()),
        ))
    })
}

/// `AttentionFwd::cuda_fwd`: q, k, v (one dtype T: f32, bf16 or f16) -> the op's packed rows O | lse | pad
/// (B, H, Tq, D + E) in T (`PackedRows`): O written in place, lse's f32 in the slots after it. No f32 O.
pub fn fwd_packed(
    (sq, lq): (&CudaStorage, &Layout),
    (sk, lk): (&CudaStorage, &Layout),
    (sv, lv): (&CudaStorage, &Layout),
    AttnMask { scale, causal, docs }: AttnMask<'_, candle_core::Tensor>,
) -> Result<(CudaStorage, Shape)> {
    let dims = dims_of(lq, lk, lv, causal)?;
    same_dtype(sq, sk, "k")?;
    same_dtype(sq, sv, "v")?;
    let AttnDims { b, h, tq, d, .. } = dims;
    let dtype = sq.dtype();
    let lay = PackedRows { d, elem_bytes: dtype.size_in_bytes() };
    let w = lay.fwd_width();
    let rows = b * h * tq;
    u32_arg(rows * w, "attention", "packed output")?;
    by_dtype!(dtype, "q", T => {
        let kernel = choose(dtype, d, &[lq, lk, lv], None)?;
        let dev = sq.device();
        let (q, k, v) = (view::<T>(sq, lq, "attention", "q")?, view::<T>(sk, lk, "attention", "k")?, view::<T>(sv, lv, "attention", "v")?);
        // zeroed: the pad slots after lse are never written by the kernel
        let packed = dev.alloc_zeros::<T>(rows * w)?;
        let all = packed.slice(..);
        let out = FwdOut { o: from(&all, 0)?, lse: from(&all, d)?, ldo: w as u32, ldl: lay.floats(w) as u32 };
        let spec = Spec { kernel, dtype, dims, scale, causal };
        with_docs(docs, dims, causal, |dv| fwd_t(dev, spec, (&q, &k, &v), &out, &dv))?;
        Ok((CudaStorage::wrap_cuda_slice(packed, dev.clone()), Shape::from_dims(&[b, h, tq, w])))
    })
}

/// `AttentionBwd::cuda_fwd`: the op's backward rows (B, H, Tq, 3D + 2E) in T = [q | O | lse | dO | .]
/// (`PackedRows`, read in place: no unpacking, no f32 copies), k, v of dtype T -> dQ, dK, dV flattened one
/// after the other (len q + len k + len v) in T.
pub fn bwd_packed(
    (sp, lp): (&CudaStorage, &Layout),
    (sk, lk): (&CudaStorage, &Layout),
    (sv, lv): (&CudaStorage, &Layout),
    d: usize,
    AttnMask { scale, causal, docs }: AttnMask<'_, candle_core::Tensor>,
) -> Result<(CudaStorage, Shape)> {
    let (b, h, tq, w) = lp.shape().dims4()?;
    let dtype = sk.dtype();
    let lay = PackedRows { d, elem_bytes: dtype.size_in_bytes() };
    if w != lay.bwd_width() || sp.dtype() != dtype {
        bail!(
            "attention backward (cuda): packed input is {:?} {:?}, expected (B, H, Tq, {}) {dtype:?}\nhint: the rows are [q | O | lse | dO | .] (ops::attention_shape::PackedRows)",
            lp.shape(),
            sp.dtype(),
            lay.bwd_width()
        );
    }
    let lq = Layout::contiguous((b, h, tq, d));
    let dims = dims_of(&lq, lk, lv, causal)?;
    same_dtype(sk, sv, "v")?;
    same_device(sp, sk, "attention backward")?;
    let AttnDims { hkv, tk, .. } = dims;
    let rows = b * h * tq;
    u32_arg(rows * w, "attention", "packed input")?;
    by_dtype!(dtype, "k", T => {
        let kernel = choose(dtype, d, &[lk, lv, lp], None)?;
        let dev = sk.device();
        let packed = view::<T>(sp, lp, "attention backward", "packed")?;
        let (nq, nkv) = (rows * d, b * hkv * tk * d);
        // SAFETY: dq, dk, dv (the three parts) are written in full by bwd_t.
        let mut flat = unsafe { dev.alloc::<T>(nq + 2 * nkv)? };
        {
            let (dq, mut rest) = flat.split_at_mut(nq);
            let (dk, dv) = rest.split_at_mut(nkv);
            let mut bufs = BwdBufs {
                q: from(&packed, 0)?,
                k: view::<T>(sk, lk, "attention", "k")?,
                v: view::<T>(sv, lv, "attention", "v")?,
                o: from(&packed, d)?,
                lse: from(&packed, 2 * d)?,
                dout: from(&packed, lay.dout_at())?,
                ldq: w as u32,
                ldl: lay.floats(w) as u32,
                dq,
                dk,
                dv,
            };
            let spec = Spec { kernel, dtype, dims, scale, causal };
            with_docs(docs, dims, causal, |dv| bwd_t(dev, spec, &mut bufs, &dv))?;
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
        let func = load_func(dev, name, &MMA_PROBE)?;
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
