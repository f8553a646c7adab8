//! Host twins of kernels/attention.cu (flash attention forward, delta pre-kernel, backward, dQ convert):
//! the kernels' own source compiled against kernels/emu.h, behind safe wrappers with the shapes of
//! `ops::attention` (q (B, H, Tq, D), k/v (B, Hkv, Tk, D), lse (B, H, Tq)).
//!
//! Reference: kernels/attention.cu (header: algorithm, tiles, what a block owns); the CPU reference
//! `ops::attention::{attention_fwd_cpu, attention_bwd_cpu}` it is tested against (tests/attention_emu.rs).
//! The non-obvious decision: the launch shape is not the caller's choice here (unlike the row kernels):
//! the kernels are written for exactly 128 threads per block and one block per (tile, head, batch), so
//! the wrapper derives the grid from the shapes exactly as the CUDA launcher does.
//! Does not: run fast (one OS thread per emulated GPU thread), or take f16 (f32 and bf16 only).
use super::{check_len, u32_of, EmuFloat};
use crate::ops::attention::AttnDims;
use candle_core::{bail, Result};
use half::bf16;

/// Threads per block of the attention kernels (`ATTN_NT` in kernels/attention.cu).
pub const ATTN_THREADS: u32 = 128;
/// Head dims the kernels are instantiated for.
pub const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Query (forward) and key (backward) tile height for head dim `d` (`AttnTile<D>` in the kernel).
pub fn tile(d: usize) -> usize {
    if d >= 128 {
        16
    } else {
        32
    }
}

type FwdFn<T> = unsafe extern "C" fn(
    u32,
    u32,
    usize,
    *const T,
    *const T,
    *const T,
    *mut T,
    *mut f32,
    u32,
    u32,
    u32,
    u32,
    u32,
    f32,
    i32,
);
type BwdFn<T> = unsafe extern "C" fn(
    u32,
    u32,
    usize,
    *const T,
    *const T,
    *const T,
    *const T,
    *const f32,
    *const f32,
    *mut f32,
    *mut T,
    *mut T,
    u32,
    u32,
    u32,
    u32,
    u32,
    f32,
    i32,
);
type DeltaFn<T> = unsafe extern "C" fn(u32, u32, usize, *const T, *const T, *mut f32, u32, u32);
type ConvFn<T> = unsafe extern "C" fn(u32, u32, usize, *const f32, *mut T, u64);

mod ffi {
    use super::bf16;
    macro_rules! decl {
        ($t:ty, $fwd:ident, $bwd:ident) => {
            pub fn $fwd(
                gx: u32,
                bx: u32,
                smem: usize,
                q: *const $t,
                k: *const $t,
                v: *const $t,
                o: *mut $t,
                lse: *mut f32,
                nb: u32,
                h: u32,
                hkv: u32,
                tq: u32,
                tk: u32,
                scale: f32,
                causal: i32,
            );
            pub fn $bwd(
                gx: u32,
                bx: u32,
                smem: usize,
                q: *const $t,
                k: *const $t,
                v: *const $t,
                dout: *const $t,
                lse: *const f32,
                delta: *const f32,
                dq_acc: *mut f32,
                dk: *mut $t,
                dv: *mut $t,
                nb: u32,
                h: u32,
                hkv: u32,
                tq: u32,
                tk: u32,
                scale: f32,
                causal: i32,
            );
        };
    }
    #[link(name = "harpe_kernels_emu", kind = "static")]
    extern "C" {
        decl!(f32, emu_attn_fwd_f32_d16, emu_attn_bwd_f32_d16);
        decl!(f32, emu_attn_fwd_f32_d32, emu_attn_bwd_f32_d32);
        decl!(f32, emu_attn_fwd_f32_d64, emu_attn_bwd_f32_d64);
        decl!(f32, emu_attn_fwd_f32_d128, emu_attn_bwd_f32_d128);
        decl!(bf16, emu_attn_fwd_bf16_d16, emu_attn_bwd_bf16_d16);
        decl!(bf16, emu_attn_fwd_bf16_d32, emu_attn_bwd_bf16_d32);
        decl!(bf16, emu_attn_fwd_bf16_d64, emu_attn_bwd_bf16_d64);
        decl!(bf16, emu_attn_fwd_bf16_d128, emu_attn_bwd_bf16_d128);
        pub fn emu_attn_bwd_delta_f32(
            gx: u32,
            bx: u32,
            smem: usize,
            o: *const f32,
            dout: *const f32,
            delta: *mut f32,
            rows: u32,
            d: u32,
        );
        pub fn emu_attn_bwd_delta_bf16(
            gx: u32,
            bx: u32,
            smem: usize,
            o: *const bf16,
            dout: *const bf16,
            delta: *mut f32,
            rows: u32,
            d: u32,
        );
        pub fn emu_attn_dq_convert_f32(gx: u32, bx: u32, smem: usize, acc: *const f32, dq: *mut f32, n: u64);
        pub fn emu_attn_dq_convert_bf16(gx: u32, bx: u32, smem: usize, acc: *const f32, dq: *mut bf16, n: u64);
    }
}

/// A storage type the attention kernels are instantiated for, with its entry points per head dim.
pub trait AttnFloat: EmuFloat {
    #[doc(hidden)]
    fn fwd_fn(d: usize) -> Option<FwdFn<Self>>;
    #[doc(hidden)]
    fn bwd_fn(d: usize) -> Option<BwdFn<Self>>;
    #[doc(hidden)]
    const DELTA: DeltaFn<Self>;
    #[doc(hidden)]
    const CONV: ConvFn<Self>;
}

macro_rules! attn_float {
    ($t:ty, $delta:ident, $conv:ident, [$(($d:literal, $fwd:ident, $bwd:ident)),*]) => {
        impl AttnFloat for $t {
            fn fwd_fn(d: usize) -> Option<FwdFn<Self>> {
                match d {
                    $($d => Some(ffi::$fwd as FwdFn<Self>),)*
                    _ => None,
                }
            }
            fn bwd_fn(d: usize) -> Option<BwdFn<Self>> {
                match d {
                    $($d => Some(ffi::$bwd as BwdFn<Self>),)*
                    _ => None,
                }
            }
            const DELTA: DeltaFn<Self> = ffi::$delta;
            const CONV: ConvFn<Self> = ffi::$conv;
        }
    };
}
attn_float!(
    f32,
    emu_attn_bwd_delta_f32,
    emu_attn_dq_convert_f32,
    [
        (16, emu_attn_fwd_f32_d16, emu_attn_bwd_f32_d16),
        (32, emu_attn_fwd_f32_d32, emu_attn_bwd_f32_d32),
        (64, emu_attn_fwd_f32_d64, emu_attn_bwd_f32_d64),
        (128, emu_attn_fwd_f32_d128, emu_attn_bwd_f32_d128)
    ]
);
attn_float!(
    bf16,
    emu_attn_bwd_delta_bf16,
    emu_attn_dq_convert_bf16,
    [
        (16, emu_attn_fwd_bf16_d16, emu_attn_bwd_bf16_d16),
        (32, emu_attn_fwd_bf16_d32, emu_attn_bwd_bf16_d32),
        (64, emu_attn_fwd_bf16_d64, emu_attn_bwd_bf16_d64),
        (128, emu_attn_fwd_bf16_d128, emu_attn_bwd_bf16_d128)
    ]
);

/// The shape checks the CUDA launcher makes too: head dim, GQA ratio, causal Tk >= Tq, sizes in u32.
pub fn check_dims(dims: AttnDims, causal: bool) -> Result<()> {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    if !HEAD_DIMS.contains(&d) {
        bail!("attention kernel: head dim D = {d} is not one of {HEAD_DIMS:?}\nhint: use the CPU reference (ops::attention) for other head dims");
    }
    if hkv == 0 || h % hkv != 0 {
        bail!("attention kernel: H = {h} query heads is not a multiple of Hkv = {hkv} kv heads\nhint: check num_key_value_heads in config.json");
    }
    if b == 0 || tq == 0 || tk == 0 {
        bail!("attention kernel: empty problem (B {b}, Tq {tq}, Tk {tk})\nhint: skip the call for empty batches");
    }
    if causal && tk < tq {
        bail!("attention kernel: causal attention needs Tk >= Tq, got Tq {tq}, Tk {tk}\nhint: the KV cache must hold the queries' own keys");
    }
    u32_of("B*H*Tq*D", b * h * tq * d)?;
    u32_of("B*Hkv*Tk*D", b * hkv * tk * d)?;
    Ok(())
}

/// Flash-attention forward on the emulator: (O (B, H, Tq, D), lse (B, H, Tq)).
pub fn attention_fwd<T: AttnFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    dims: AttnDims,
    scale: f32,
    causal: bool,
) -> Result<(Vec<T>, Vec<f32>)> {
    check_dims(dims, causal)?;
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    check_len("q", q.len(), b * h * tq * d)?;
    check_len("k", k.len(), b * hkv * tk * d)?;
    check_len("v", v.len(), b * hkv * tk * d)?;
    let Some(f) = T::fwd_fn(d) else { bail!("attention kernel: no instance for D = {d}") };
    let grid = u32_of("forward grid", tq.div_ceil(tile(d)) * b * h)?;
    let mut o = vec![T::default(); q.len()];
    let mut lse = vec![0f32; b * h * tq];
    // SAFETY: lengths checked above; the grid covers exactly the tiles the kernel decodes.
    unsafe {
        f(
            grid,
            ATTN_THREADS,
            0,
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            o.as_mut_ptr(),
            lse.as_mut_ptr(),
            b as u32,
            h as u32,
            hkv as u32,
            tq as u32,
            tk as u32,
            scale,
            causal as i32,
        )
    };
    Ok((o, lse))
}

/// Flash-attention backward on the emulator: (dQ, dK, dV) from q, k, v, the forward's O and lse, and dO.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd<T: AttnFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    lse: &[f32],
    dout: &[T],
    dims: AttnDims,
    scale: f32,
    causal: bool,
) -> Result<(Vec<T>, Vec<T>, Vec<T>)> {
    check_dims(dims, causal)?;
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    check_len("q", q.len(), b * h * tq * d)?;
    check_len("o", o.len(), b * h * tq * d)?;
    check_len("dout", dout.len(), b * h * tq * d)?;
    check_len("lse", lse.len(), b * h * tq)?;
    check_len("k", k.len(), b * hkv * tk * d)?;
    check_len("v", v.len(), b * hkv * tk * d)?;
    let Some(f) = T::bwd_fn(d) else { bail!("attention kernel: no instance for D = {d}") };
    let rows = b * h * tq;
    let mut delta = vec![0f32; rows];
    let mut dq_acc = vec![0f32; q.len()];
    let (mut dq, mut dk, mut dv) =
        (vec![T::default(); q.len()], vec![T::default(); k.len()], vec![T::default(); v.len()]);
    let wpb = (ATTN_THREADS / 32) as usize;
    let grid = u32_of("backward grid", tk.div_ceil(tile(d)) * b * hkv)?;
    // SAFETY: lengths checked above; dq_acc is zeroed (the backward adds into it); the convert kernel
    // reads and writes q.len() elements.
    unsafe {
        T::DELTA(
            rows.div_ceil(wpb).min(65535) as u32,
            ATTN_THREADS,
            0,
            o.as_ptr(),
            dout.as_ptr(),
            delta.as_mut_ptr(),
            rows as u32,
            d as u32,
        );
        f(
            grid,
            ATTN_THREADS,
            0,
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            dout.as_ptr(),
            lse.as_ptr(),
            delta.as_ptr(),
            dq_acc.as_mut_ptr(),
            dk.as_mut_ptr(),
            dv.as_mut_ptr(),
            b as u32,
            h as u32,
            hkv as u32,
            tq as u32,
            tk as u32,
            scale,
            causal as i32,
        );
        T::CONV(
            q.len().div_ceil(ATTN_THREADS as usize).min(65535) as u32,
            ATTN_THREADS,
            0,
            dq_acc.as_ptr(),
            dq.as_mut_ptr(),
            q.len() as u64,
        );
    }
    Ok((dq, dk, dv))
}
