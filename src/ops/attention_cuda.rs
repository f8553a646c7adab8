//! CUDA launchers of kernels/attention.cu (flash attention forward, delta pre-kernel, backward, dQ
//! convert) on candle's CUDA storages, for `ops::attention`'s `cuda_fwd` and backward to call.
//!
//! Reference: kernels/attention.cu (algorithm, tiles, what a block owns); `kernels_emu::attention`, the
//! host twin with the same launch shapes, which tests/attention_emu.rs checks against the CPU reference.
//! The non-obvious decision: the shape rules (head dim, H % Hkv, causal Tk >= Tq, u32 sizes) are the
//! emulator's `check_dims`, one owner for both targets; every check runs before anything is allocated
//! or launched. The forward returns lse as a raw f32 device slice for the op to keep for the backward.
//! Does not: wire itself into `ops::attention` (the op's cuda_fwd places call `fwd`/`bwd`), f16 inputs,
//! or choose a tensor-core variant (the kernels are FMA tiles for now).
use crate::kernels_emu::attention::{check_dims, tile, ATTN_THREADS};
use crate::ops::attention::AttnDims;
use crate::ops::cuda::{cfg, contiguous, dtype_suffix, same_device, u32_arg, view};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, DType, Layout, Result};
use half::bf16;

/// PTX of kernels/attention.cu (compute_80; JIT-compiled by the driver on Hopper).
pub const ATTENTION_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
const MODULE: &str = "harpe_attention";

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

/// Forward: (O with q's shape and dtype, lse (B*H*Tq) f32).
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
) -> Result<(CudaStorage, CudaSlice<f32>)> {
    let dims = dims_of(lq, lk, lv, causal)?;
    same_dtype(sq, sk, "k")?;
    same_dtype(sq, sv, "v")?;
    let sfx = dtype_suffix(sq.dtype(), "attention", "q")?;
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let dev = sq.device();
    let func = dev.get_or_load_custom_func(&format!("attn_fwd_{sfx}_d{d}"), MODULE, ATTENTION_PTX)?;
    let grid = u32_arg(tq.div_ceil(tile(d)) * b * h, "attention", "forward blocks")?;
    let (b32, h32, hkv32, tq32, tk32) = (b as u32, h as u32, hkv as u32, tq as u32, tk as u32);
    let causal32 = causal as i32;
    // SAFETY: written in full by the kernel (every valid row's lse).
    let lse = unsafe { dev.alloc::<f32>(b * h * tq)? };
    macro_rules! go {
        ($t:ty) => {{
            let (q, k, v) = (
                view::<$t>(sq, lq, "attention", "q")?,
                view::<$t>(sk, lk, "attention", "k")?,
                view::<$t>(sv, lv, "attention", "v")?,
            );
            // SAFETY: written in full by the kernel (every valid row of every head).
            let o = unsafe { dev.alloc::<$t>(b * h * tq * d)? };
            let mut bld = func.builder();
            bld.arg(&q).arg(&k).arg(&v).arg(&o).arg(&lse);
            bld.arg(&b32).arg(&h32).arg(&hkv32).arg(&tq32).arg(&tk32).arg(&scale).arg(&causal32);
            // SAFETY: shapes checked by dims_of; the grid is the kernel's (q tile, head, batch) decode.
            unsafe { bld.launch(cfg(grid, ATTN_THREADS)) }.w()?;
            CudaStorage::wrap_cuda_slice(o, dev.clone())
        }};
    }
    let o = match sq.dtype() {
        DType::BF16 => go!(bf16),
        _ => go!(f32),
    };
    Ok((o, lse))
}

/// Backward: (dQ, dK, dV) with the shapes and dtype of q, k, v, from the forward's O and lse and dO.
#[allow(clippy::too_many_arguments)]
pub fn bwd(
    (sq, lq): (&CudaStorage, &Layout),
    (sk, lk): (&CudaStorage, &Layout),
    (sv, lv): (&CudaStorage, &Layout),
    (so, lo): (&CudaStorage, &Layout),
    lse: &CudaSlice<f32>,
    (sd, ld): (&CudaStorage, &Layout),
    scale: f32,
    causal: bool,
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
    let sfx = dtype_suffix(sq.dtype(), "attention", "q")?;
    let dev = sq.device();
    let f_delta = dev.get_or_load_custom_func(&format!("attn_bwd_delta_{sfx}"), MODULE, ATTENTION_PTX)?;
    let f_bwd = dev.get_or_load_custom_func(&format!("attn_bwd_{sfx}_d{d}"), MODULE, ATTENTION_PTX)?;
    let f_conv = dev.get_or_load_custom_func(&format!("attn_dq_convert_{sfx}"), MODULE, ATTENTION_PTX)?;
    let rows = b * h * tq;
    let (rows32, d32) = (u32_arg(rows, "attention", "rows")?, d as u32);
    let (b32, h32, hkv32, tq32, tk32) = (b as u32, h as u32, hkv as u32, tq as u32, tk as u32);
    let causal32 = causal as i32;
    let nq = (b * h * tq * d) as u64;
    let wpb = (ATTN_THREADS / 32) as usize;
    let grid_delta = rows.div_ceil(wpb).min(65535) as u32;
    let grid_bwd = u32_arg(tk.div_ceil(tile(d)) * b * hkv, "attention", "backward blocks")?;
    let grid_conv = (b * h * tq * d).div_ceil(ATTN_THREADS as usize).min(65535) as u32;
    // SAFETY: written in full by the delta kernel; dq_acc is zeroed because the backward adds into it.
    let delta = unsafe { dev.alloc::<f32>(rows)? };
    let dq_acc = dev.alloc_zeros::<f32>(b * h * tq * d)?;
    macro_rules! go {
        ($t:ty) => {{
            let (q, k, v) = (
                view::<$t>(sq, lq, "attention", "q")?,
                view::<$t>(sk, lk, "attention", "k")?,
                view::<$t>(sv, lv, "attention", "v")?,
            );
            let (o, dout) = (view::<$t>(so, lo, "attention", "O")?, view::<$t>(sd, ld, "attention", "dO")?);
            // SAFETY: dq by the convert kernel, dk/dv by the backward (every valid key row), all in full.
            let (dq, dk, dv) = unsafe {
                (dev.alloc::<$t>(nq as usize)?, dev.alloc::<$t>(b * hkv * tk * d)?, dev.alloc::<$t>(b * hkv * tk * d)?)
            };
            let mut bld = f_delta.builder();
            bld.arg(&o).arg(&dout).arg(&delta).arg(&rows32).arg(&d32);
            // SAFETY: o, dout hold rows*d; delta rows.
            unsafe { bld.launch(cfg(grid_delta, ATTN_THREADS)) }.w()?;
            let mut bld = f_bwd.builder();
            bld.arg(&q).arg(&k).arg(&v).arg(&dout).arg(lse).arg(&delta).arg(&dq_acc).arg(&dk).arg(&dv);
            bld.arg(&b32).arg(&h32).arg(&hkv32).arg(&tq32).arg(&tk32).arg(&scale).arg(&causal32);
            // SAFETY: shapes checked by dims_of; the grid is the kernel's (key tile, kv head, batch) decode.
            unsafe { bld.launch(cfg(grid_bwd, ATTN_THREADS)) }.w()?;
            let mut bld = f_conv.builder();
            bld.arg(&dq_acc).arg(&dq).arg(&nq);
            // SAFETY: dq_acc and dq hold nq elements.
            unsafe { bld.launch(cfg(grid_conv, ATTN_THREADS)) }.w()?;
            (
                CudaStorage::wrap_cuda_slice(dq, dev.clone()),
                CudaStorage::wrap_cuda_slice(dk, dev.clone()),
                CudaStorage::wrap_cuda_slice(dv, dev.clone()),
            )
        }};
    }
    Ok(match sq.dtype() {
        DType::BF16 => go!(bf16),
        _ => go!(f32),
    })
}
