//! Host twins of kernels/attention.cu (flash attention forward, delta pre-kernel, backward, dQ convert; the
//! FMA tiles and the tensor-core tiles) and of kernels/mma_probe.cu: the kernels' own source compiled
//! against kernels/emu.h, behind safe wrappers with the shapes of `ops::attention` (q (B, H, Tq, D), k/v
//! (B, Hkv, Tk, D), lse (B, H, Tq)); `attention_{fwd,bwd}` take an optional document mask (per key, the
//! start of its document: `ops::attention::DocStarts::host`; None passes a null pointer).
//!
//! Reference: kernels/attention.cu (header: algorithm, tiles, what a block owns), kernels/mma.cuh (the
//! fragment layouts the emulated mma/ldmatrix reproduce); the CPU reference
//! `ops::attention::{attention_fwd_cpu, attention_bwd_cpu}` they are tested against (tests/stage_model/attention_emu.rs).
//! The non-obvious decision: the launch shape is not the caller's choice here (unlike the row kernels):
//! the kernels are written for exactly `AttnKernel::threads` per block and one block per (tile, head, batch), so
//! the wrapper derives the grid from the shapes exactly as the CUDA launcher does — and both take the
//! tile heights and the kernel choice from `ops::attention_shape::AttnKernel`, one owner for both targets
//! (this file depends on the op's types, never the op on this file).
//! Does not: run fast (one OS thread per emulated GPU thread; every mma is a warp barrier).
use super::{check_len, perturb, u32_of};
use crate::ops::attention_shape::{
    attention_workspace, check_dims, AttnDims, AttnKernel, AttnMask, PackedRows, ATTN_THREADS,
};
use candle_core::{bail, Result};
use half::{bf16, f16};

use ffi::{BwdFn, ConvFn, DeltaFn, FwdFn, ProbeFn};

mod ffi {
    use super::{bf16, f16};
    emu_kernels! {
        /// The forward: O and lse rows `ldo` / `ldl` apart.
        FwdFn<T>(
            gx: u32,
            bx: u32,
            smem: usize,
            q: *const T,
            k: *const T,
            v: *const T,
            o: *mut T,
            lse: *mut f32,
            docs: *const u32,
            nb: u32,
            h: u32,
            hkv: u32,
            tq: u32,
            tk: u32,
            scale: f32,
            causal: i32,
            ldo: u32,
            ldl: u32,
        ) for {
            emu_attn_fwd_f32_d16: f32,
            emu_attn_fwd_f32_d32: f32,
            emu_attn_fwd_f32_d64: f32,
            emu_attn_fwd_f32_d128: f32,
            emu_attn_fwd_bf16_d16: bf16,
            emu_attn_fwd_bf16_d32: bf16,
            emu_attn_fwd_bf16_d64: bf16,
            emu_attn_fwd_bf16_d128: bf16,
            emu_attn_fwd_tc_bf16_d64: bf16,
            emu_attn_fwd_tc_bf16_d128: bf16,
            emu_attn_fwd_tc_early_bf16_d64: bf16,
            emu_attn_fwd_f16_d16: f16,
            emu_attn_fwd_f16_d32: f16,
            emu_attn_fwd_f16_d64: f16,
            emu_attn_fwd_f16_d128: f16,
            emu_attn_fwd_tc_f16_d64: f16,
            emu_attn_fwd_tc_f16_d128: f16,
        }
        /// The backward: dK, dV and dQ accumulated in f32 rows `ldq` apart.
        BwdFn<T>(
            gx: u32,
            bx: u32,
            smem: usize,
            q: *const T,
            k: *const T,
            v: *const T,
            dout: *const T,
            lse: *const f32,
            delta: *const f32,
            docs: *const u32,
            dq_acc: *mut f32,
            dk: *mut T,
            dv: *mut T,
            nb: u32,
            h: u32,
            hkv: u32,
            tq: u32,
            tk: u32,
            scale: f32,
            causal: i32,
            ldq: u32,
            ldl: u32,
        ) for {
            emu_attn_bwd_f32_d16: f32,
            emu_attn_bwd_f32_d32: f32,
            emu_attn_bwd_f32_d64: f32,
            emu_attn_bwd_f32_d128: f32,
            emu_attn_bwd_bf16_d16: bf16,
            emu_attn_bwd_bf16_d32: bf16,
            emu_attn_bwd_bf16_d64: bf16,
            emu_attn_bwd_bf16_d128: bf16,
            emu_attn_bwd_tc_bf16_d64: bf16,
            emu_attn_bwd_tc_bf16_d128: bf16,
            emu_attn_bwd_tc_early_bf16_d64: bf16,
            emu_attn_bwd_f16_d16: f16,
            emu_attn_bwd_f16_d32: f16,
            emu_attn_bwd_f16_d64: f16,
            emu_attn_bwd_f16_d128: f16,
            emu_attn_bwd_tc_f16_d64: f16,
            emu_attn_bwd_tc_f16_d128: f16,
        }
        /// The backward's pre-kernel: delta_i = dO_i . O_i per query row.
        DeltaFn<T>(gx: u32, bx: u32, smem: usize, o: *const T, dout: *const T, delta: *mut f32, rows: u32, d: u32, ld: u32)
            for { emu_attn_bwd_delta_f32: f32, emu_attn_bwd_delta_bf16: bf16, emu_attn_bwd_delta_f16: f16 }
        /// dQ from its f32 accumulator to the storage type.
        ConvFn<T>(gx: u32, bx: u32, smem: usize, acc: *const f32, dq: *mut T, n: u64)
            for { emu_attn_dq_convert_f32: f32, emu_attn_dq_convert_bf16: bf16, emu_attn_dq_convert_f16: f16 }
        /// kernels/mma_probe.cu: one 16x16x16 product through the fragments.
        ProbeFn<T>(gx: u32, bx: u32, smem: usize, a: *const T, b: *const T, bt: *const T, out: *mut f32)
            for { emu_mma_probe_bf16: bf16, emu_mma_probe_f16: f16 }
    }
}

/// A storage type the attention kernels are instantiated for (f32, bf16, f16), with its entry points.
pub trait AttnFloat: Copy + Default + Send + Sync + std::fmt::Debug + 'static {
    /// The value as f32 (exact).
    fn to_f32(self) -> f32;
    /// The nearest value (round to nearest even).
    fn from_f32(v: f32) -> Self;
    #[doc(hidden)]
    fn fwd_fn(kernel: AttnKernel, d: usize) -> Option<FwdFn<Self>>;
    #[doc(hidden)]
    fn bwd_fn(kernel: AttnKernel, d: usize) -> Option<BwdFn<Self>>;
    #[doc(hidden)]
    const DELTA: DeltaFn<Self>;
    #[doc(hidden)]
    const CONV: ConvFn<Self>;
    #[doc(hidden)]
    const PROBE: Option<ProbeFn<Self>>;
}

macro_rules! attn_float {
    ($t:ty, $to:expr, $from:expr, $delta:ident, $conv:ident, $probe:expr,
     fma [$(($d:literal, $fwd:ident, $bwd:ident)),*], tc [$(($dt:literal, $tfwd:ident, $tbwd:ident)),*]) => {
        impl AttnFloat for $t {
            fn to_f32(self) -> f32 {
                $to(self)
            }
            fn from_f32(v: f32) -> Self {
                $from(v)
            }
            fn fwd_fn(kernel: AttnKernel, d: usize) -> Option<FwdFn<Self>> {
                match (kernel, d) {
                    $((AttnKernel::Fma, $d) => Some(ffi::$fwd as FwdFn<Self>),)*
                    $((AttnKernel::TensorCore, $dt) => Some(ffi::$tfwd as FwdFn<Self>),)*
                    _ => None,
                }
            }
            fn bwd_fn(kernel: AttnKernel, d: usize) -> Option<BwdFn<Self>> {
                match (kernel, d) {
                    $((AttnKernel::Fma, $d) => Some(ffi::$bwd as BwdFn<Self>),)*
                    $((AttnKernel::TensorCore, $dt) => Some(ffi::$tbwd as BwdFn<Self>),)*
                    _ => None,
                }
            }
            const DELTA: DeltaFn<Self> = ffi::$delta;
            const CONV: ConvFn<Self> = ffi::$conv;
            const PROBE: Option<ProbeFn<Self>> = $probe;
        }
    };
}
attn_float!(
    f32,
    |x: f32| x,
    |x: f32| x,
    emu_attn_bwd_delta_f32,
    emu_attn_dq_convert_f32,
    None,
    fma [
        (16, emu_attn_fwd_f32_d16, emu_attn_bwd_f32_d16),
        (32, emu_attn_fwd_f32_d32, emu_attn_bwd_f32_d32),
        (64, emu_attn_fwd_f32_d64, emu_attn_bwd_f32_d64),
        (128, emu_attn_fwd_f32_d128, emu_attn_bwd_f32_d128)
    ],
    tc []
);
attn_float!(
    bf16,
    |x: bf16| x.to_f32(),
    bf16::from_f32,
    emu_attn_bwd_delta_bf16,
    emu_attn_dq_convert_bf16,
    Some(ffi::emu_mma_probe_bf16 as ProbeFn<bf16>),
    fma [
        (16, emu_attn_fwd_bf16_d16, emu_attn_bwd_bf16_d16),
        (32, emu_attn_fwd_bf16_d32, emu_attn_bwd_bf16_d32),
        (64, emu_attn_fwd_bf16_d64, emu_attn_bwd_bf16_d64),
        (128, emu_attn_fwd_bf16_d128, emu_attn_bwd_bf16_d128)
    ],
    tc [(64, emu_attn_fwd_tc_bf16_d64, emu_attn_bwd_tc_bf16_d64), (128, emu_attn_fwd_tc_bf16_d128, emu_attn_bwd_tc_bf16_d128)]
);
attn_float!(
    f16,
    |x: f16| x.to_f32(),
    f16::from_f32,
    emu_attn_bwd_delta_f16,
    emu_attn_dq_convert_f16,
    Some(ffi::emu_mma_probe_f16 as ProbeFn<f16>),
    fma [
        (16, emu_attn_fwd_f16_d16, emu_attn_bwd_f16_d16),
        (32, emu_attn_fwd_f16_d32, emu_attn_bwd_f16_d32),
        (64, emu_attn_fwd_f16_d64, emu_attn_bwd_f16_d64),
        (128, emu_attn_fwd_f16_d128, emu_attn_bwd_f16_d128)
    ],
    tc [(64, emu_attn_fwd_tc_f16_d64, emu_attn_bwd_tc_f16_d64), (128, emu_attn_fwd_tc_f16_d128, emu_attn_bwd_tc_f16_d128)]
);

/// The shape rule of a document mask: one start per key of every sequence.
pub fn check_docs(dims: AttnDims, causal: bool, docs: Option<&[u32]>) -> Result<()> {
    if let Some(ds) = docs {
        if !causal {
            bail!("attention kernel: a document mask needs causal attention\nhint: pass causal = true");
        }
        check_len("docs", ds.len(), dims.b * dims.tk)?;
    }
    Ok(())
}

/// Where a forward writes: O rows `ldo` elements apart, lse values `ldl` floats apart.
struct FwdOut<T> {
    o: *mut T,
    lse: *mut f32,
    ldo: usize,
    ldl: usize,
}

/// What a backward reads besides k and v: q, O and dO rows `ldq` elements apart, lse `ldl` floats apart.
struct BwdIn<T> {
    q: *const T,
    o: *const T,
    dout: *const T,
    lse: *const f32,
    ldq: usize,
    ldl: usize,
}

/// Flash-attention forward on the emulator with the given tiles: (O (B, H, Tq, D), lse (B, H, Tq)); `docs`
/// an optional document mask (causal only): per key position (B*Tk), the start of its document
/// (`ops::attention::DocStarts::host`).
pub fn attention_fwd<T: AttnFloat>(
    kernel: AttnKernel,
    (q, k, v): (&[T], &[T], &[T]),
    dims: AttnDims,
    AttnMask { scale, causal, docs }: AttnMask<'_>,
) -> Result<(Vec<T>, Vec<f32>)> {
    let AttnDims { b, h, tq, d, .. } = dims;
    let mut o = vec![T::default(); b * h * tq * d];
    let mut lse = vec![0f32; b * h * tq];
    let out = FwdOut { o: o.as_mut_ptr(), lse: lse.as_mut_ptr(), ldo: d, ldl: 1 };
    // SAFETY: o holds B*H*Tq rows of D, lse B*H*Tq values, as `out` says.
    unsafe { fwd_launch(T::fwd_fn(kernel, dims.d), kernel, (q, k, v), dims, AttnMask::new(scale, causal, docs), out)? };
    perturb_attention_fwd(kernel, (q, k, v), dims, scale, causal, &mut o, &mut lse)?; // test-only switch
    Ok((o, lse))
}

/// The `attention_fwd` hook of the forward launcher (`perturb`, test-only): scales O, or (`:mask`, causal
/// launches only, so the launch below is not perturbed again) recomputes the first query tile of
/// (batch 0, head 0) with every key up to the end of its diagonal tile visible.
fn perturb_attention_fwd<T: AttnFloat>(
    kernel: crate::ops::attention_shape::AttnKernel,
    (q, k, v): (&[T], &[T], &[T]),
    dims: crate::ops::attention_shape::AttnDims,
    scale: f32,
    causal: bool,
    o: &mut [T],
    lse: &mut [f32],
) -> candle_core::Result<()> {
    match perturb::mode("attention_fwd").as_deref() {
        Some("") => perturb::scale("attention_fwd", o, T::to_f32, T::from_f32),
        Some("mask") if causal => {
            let crate::ops::attention_shape::AttnDims { tq, tk, d, .. } = dims;
            let rows = kernel.fwd_rows(d).min(tq);
            let keys = (tk - tq + rows).min(tk);
            let sub = crate::ops::attention_shape::AttnDims { b: 1, h: 1, hkv: 1, tq: rows, tk: keys, d };
            let (o2, l2) = attention_fwd(
                kernel,
                (&q[..rows * d], &k[..keys * d], &v[..keys * d]),
                sub,
                crate::ops::attention_shape::AttnMask::new(scale, false, None),
            )?;
            o[..rows * d].copy_from_slice(&o2);
            lse[..rows].copy_from_slice(&l2);
        }
        _ => {}
    }
    Ok(())
}

/// The CUDA launcher's `fwd_packed` on the emulator: the op's forward output, rows of O | lse | pad
/// (`PackedRows::fwd_width` elements of T; lse's f32 in the first slots after O, `packed_lse` reads it).
pub fn attention_fwd_packed<T: AttnFloat>(
    kernel: AttnKernel,
    (q, k, v): (&[T], &[T], &[T]),
    dims: AttnDims,
    AttnMask { scale, causal, docs }: AttnMask<'_>,
) -> Result<Vec<T>> {
    let AttnDims { b, h, tq, d, .. } = dims;
    let lay = PackedRows { d, elem_bytes: std::mem::size_of::<T>() };
    let mut packed = vec![T::default(); b * h * tq * lay.fwd_width()];
    check_aligned("packed output", packed.as_ptr())?;
    let out = FwdOut {
        // SAFETY (both adds): within the buffer (row 0 has fwd_width >= D + 1 elements)
        o: packed.as_mut_ptr(),
        lse: unsafe { packed.as_mut_ptr().add(d) } as *mut f32,
        ldo: lay.fwd_width(),
        ldl: lay.floats(lay.fwd_width()),
    };
    // SAFETY: B*H*Tq rows of fwd_width elements; the lse float of row r lies at byte (r * width + D) * size
    // of T, 4-byte aligned because the buffer is 16-byte aligned and D is even.
    unsafe { fwd_launch(T::fwd_fn(kernel, d), kernel, (q, k, v), dims, AttnMask::new(scale, causal, docs), out)? };
    Ok(packed)
}

/// An error unless `p` is 16-byte aligned (the tensor-core tiles' copy16 and the f32 lse slots need it).
fn check_aligned<T>(what: &str, p: *const T) -> Result<()> {
    if !(p as usize).is_multiple_of(16) {
        bail!("emulated kernel: `{what}` is not 16-byte aligned\nhint: pass a buffer from a fresh Vec");
    }
    Ok(())
}

/// The checks and the launch of one forward through `f` (`T::fwd_fn`, or a test-only variant of `kernel`).
/// SAFETY: `out` must address B*H*Tq rows of O (D elements each, `ldo` apart) and B*H*Tq lse floats
/// (`ldl` apart), valid for writes and overlapping no input.
unsafe fn fwd_launch<T: AttnFloat>(
    f: Option<FwdFn<T>>,
    kernel: AttnKernel,
    (q, k, v): (&[T], &[T], &[T]),
    dims: AttnDims,
    AttnMask { scale, causal, docs }: AttnMask<'_>,
    out: FwdOut<T>,
) -> Result<()> {
    check_dims(dims, causal)?;
    check_docs(dims, causal, docs)?;
    kernel.check(std::mem::size_of::<T>(), dims.d)?;
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    check_len("q", q.len(), b * h * tq * d)?;
    check_len("k", k.len(), b * hkv * tk * d)?;
    check_len("v", v.len(), b * hkv * tk * d)?;
    let Some(f) = f else { bail!("attention kernel: no {kernel:?} instance for D = {d}") };
    let grid = u32_of("forward grid", tq.div_ceil(kernel.fwd_rows(d)) * b * h)?;
    // SAFETY: input lengths checked above, the outputs are the caller's promise; the grid covers exactly
    // the tiles the kernel decodes.
    unsafe {
        f(
            grid,
            kernel.threads(),
            0,
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            out.o,
            out.lse,
            docs.map_or(std::ptr::null(), |ds| ds.as_ptr()),
            b as u32,
            h as u32,
            hkv as u32,
            tq as u32,
            tk as u32,
            scale,
            causal as i32,
            u32_of("ldo", out.ldo)?,
            u32_of("ldl", out.ldl)?,
        )
    };
    Ok(())
}

/// Flash-attention backward on the emulator with the given tiles: (dQ, dK, dV) from q, k, v, the forward's
/// O and lse, and dO, under `attention_fwd`'s optional document mask `docs`.
pub fn attention_bwd<T: AttnFloat>(
    kernel: AttnKernel,
    (q, k, v): (&[T], &[T], &[T]),
    (o, lse): (&[T], &[f32]),
    dout: &[T],
    dims: AttnDims,
    AttnMask { scale, causal, docs }: AttnMask<'_>,
) -> Result<(Vec<T>, Vec<T>, Vec<T>)> {
    let AttnDims { b, h, tq, d, .. } = dims;
    check_len("q", q.len(), b * h * tq * d)?;
    check_len("o", o.len(), b * h * tq * d)?;
    check_len("dout", dout.len(), b * h * tq * d)?;
    check_len("lse", lse.len(), b * h * tq)?;
    let inp = BwdIn { q: q.as_ptr(), o: o.as_ptr(), dout: dout.as_ptr(), lse: lse.as_ptr(), ldq: d, ldl: 1 };
    // SAFETY: q, o, dout hold B*H*Tq rows of D and lse B*H*Tq values (checked), as `inp` says.
    let (flat, _) =
        unsafe { bwd_launch(T::bwd_fn(kernel, dims.d), kernel, inp, k, v, dims, AttnMask::new(scale, causal, docs))? };
    let (nq, nkv) = (q.len(), k.len());
    Ok((flat[..nq].to_vec(), flat[nq..nq + nkv].to_vec(), flat[nq + nkv..].to_vec()))
}

/// What `attention_bwd_packed` returns: dQ | dK | dV flattened (the op's backward output) and the bytes of
/// the scratch it allocated (delta and the dQ accumulator; `AttnWorkspace::bwd_scratch` by construction).
#[derive(Debug)]
pub struct BwdPacked<T> {
    pub grads: Vec<T>,
    pub scratch_bytes: usize,
}

/// The CUDA launcher's `bwd_packed` on the emulator: from the op's backward rows [q | O | lse | dO | .]
/// (`PackedRows::bwd_width` elements of T, read in place; `bwd_rows` builds them) and k, v.
pub fn attention_bwd_packed<T: AttnFloat>(
    kernel: AttnKernel,
    packed: &[T],
    k: &[T],
    v: &[T],
    dims: AttnDims,
    AttnMask { scale, causal, docs }: AttnMask<'_>,
) -> Result<BwdPacked<T>> {
    let AttnDims { b, h, tq, d, .. } = dims;
    let lay = PackedRows { d, elem_bytes: std::mem::size_of::<T>() };
    let w = lay.bwd_width();
    check_len("packed", packed.len(), b * h * tq * w)?;
    check_aligned("packed", packed.as_ptr())?;
    let p = packed.as_ptr();
    // SAFETY (the adds): offsets inside row 0 (width 3D + 2E)
    let inp = unsafe {
        BwdIn {
            q: p,
            o: p.add(d),
            dout: p.add(lay.dout_at()),
            lse: p.add(2 * d) as *const f32,
            ldq: w,
            ldl: lay.floats(w),
        }
    };
    // SAFETY: B*H*Tq rows of width w (checked); the lse float of a row lies at byte (r * w + 2D) * size of T,
    // 4-byte aligned (16-byte aligned buffer, even D, even w for 16-bit types).
    let (grads, scratch_bytes) =
        unsafe { bwd_launch(T::bwd_fn(kernel, d), kernel, inp, k, v, dims, AttnMask::new(scale, causal, docs))? };
    Ok(BwdPacked { grads, scratch_bytes })
}

/// The checks and the launches of one backward (delta pre-kernel, backward through `f` (`T::bwd_fn`, or a
/// test-only variant of `kernel`), dQ convert): dQ | dK | dV flattened, and the scratch bytes allocated
/// (`attention_workspace(..).bwd_scratch`, one buffer).
/// SAFETY: `inp` must address B*H*Tq rows of q, O and dO (D elements each, `ldq` apart) and B*H*Tq lse
/// floats (`ldl` apart), valid for reads.
unsafe fn bwd_launch<T: AttnFloat>(
    f: Option<BwdFn<T>>,
    kernel: AttnKernel,
    inp: BwdIn<T>,
    k: &[T],
    v: &[T],
    dims: AttnDims,
    AttnMask { scale, causal, docs }: AttnMask<'_>,
) -> Result<(Vec<T>, usize)> {
    check_dims(dims, causal)?;
    check_docs(dims, causal, docs)?;
    kernel.check(std::mem::size_of::<T>(), dims.d)?;
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    check_len("k", k.len(), b * hkv * tk * d)?;
    check_len("v", v.len(), b * hkv * tk * d)?;
    let Some(f) = f else { bail!("attention kernel: no {kernel:?} instance for D = {d}") };
    let rows = b * h * tq;
    let (nq, nkv) = (rows * d, b * hkv * tk * d);
    // one scratch buffer, as the CUDA launcher allocates it: delta (rows) then the dQ accumulator (zeroed)
    let ws = attention_workspace(dims, std::mem::size_of::<T>());
    let mut scratch = vec![0f32; ws.scratch_floats()];
    let (delta, dq_acc) = scratch.split_at_mut(rows);
    let mut flat = vec![T::default(); nq + 2 * nkv];
    let (dq, rest) = flat.split_at_mut(nq);
    let (dk, dv) = rest.split_at_mut(nkv);
    let wpb = (ATTN_THREADS / 32) as usize;
    let grid = u32_of("backward grid", tk.div_ceil(kernel.bwd_keys(d)) * b * hkv)?;
    let (ldq, ldl) = (u32_of("ldq", inp.ldq)?, u32_of("ldl", inp.ldl)?);
    // SAFETY: the inputs are the caller's promise, k and v checked; delta holds rows, dq_acc rows * D
    // (zeroed: the backward adds into it); the convert kernel reads and writes nq elements.
    unsafe {
        T::DELTA(
            rows.div_ceil(wpb).min(65535) as u32,
            ATTN_THREADS,
            0,
            inp.o,
            inp.dout,
            delta.as_mut_ptr(),
            u32_of("rows", rows)?,
            d as u32,
            ldq,
        );
        f(
            grid,
            kernel.threads(),
            0,
            inp.q,
            k.as_ptr(),
            v.as_ptr(),
            inp.dout,
            inp.lse,
            delta.as_ptr(),
            docs.map_or(std::ptr::null(), |ds| ds.as_ptr()),
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
            ldq,
            ldl,
        );
        T::CONV(
            nq.div_ceil(ATTN_THREADS as usize).min(65535) as u32,
            ATTN_THREADS,
            0,
            dq_acc.as_ptr(),
            dq.as_mut_ptr(),
            nq as u64,
        );
    }
    Ok((flat, scratch.len() * 4))
}

/// Test-only: the tensor-core tiles with each cp.async wait moved after its reads (`early_read.rs`).
pub mod early_read;

/// The rows the op's backward concatenates (`Tensor::cat([q, forward output, grad of it], 3)`): per row
/// q (D) | the forward's O | lse | pad row (`PackedRows::fwd_width`) | dO (D) | E zeros.
pub fn bwd_rows<T: AttnFloat>(q: &[T], fwd: &[T], dout: &[T], d: usize) -> Result<Vec<T>> {
    let lay = PackedRows { d, elem_bytes: std::mem::size_of::<T>() };
    let rows = q.len() / d.max(1);
    check_len("q", q.len(), rows * d)?;
    check_len("fwd", fwd.len(), rows * lay.fwd_width())?;
    check_len("dout", dout.len(), rows * d)?;
    let mut out = Vec::with_capacity(rows * lay.bwd_width());
    for r in 0..rows {
        out.extend_from_slice(&q[r * d..(r + 1) * d]);
        out.extend_from_slice(&fwd[r * lay.fwd_width()..(r + 1) * lay.fwd_width()]);
        out.extend_from_slice(&dout[r * d..(r + 1) * d]);
        out.extend(std::iter::repeat_n(T::default(), lay.lse_slots()));
    }
    Ok(out)
}

/// The lse values of packed rows of `width` elements whose f32 lse sits right after D elements of O.
pub fn packed_lse<T: AttnFloat>(rows: &[T], width: usize, d: usize) -> Vec<f32> {
    rows.chunks_exact(width)
        .map(|row| {
            // SAFETY: a whole row holds width >= D + 4 / size_of::<T>() elements (`PackedRows`); the read
            // is unaligned-safe.
            unsafe { std::ptr::read_unaligned(row.as_ptr().add(d) as *const f32) }
        })
        .collect()
}

/// kernels/mma_probe.cu on the emulator: A (16x16) times B (16x16, row-major; `bt` its transpose) through
/// the four ldmatrix/mma fragment paths, 4 x 256 f32 (row-major products). 16-bit types only.
pub fn mma_probe<T: AttnFloat>(a: &[T], b: &[T], bt: &[T]) -> Result<Vec<f32>> {
    let Some(f) = T::PROBE else { bail!("mma probe: the tensor-core instructions take bf16 or f16") };
    check_len("a", a.len(), 256)?;
    check_len("b", b.len(), 256)?;
    check_len("bt", bt.len(), 256)?;
    let mut out = vec![0f32; 1024];
    // SAFETY: lengths checked; one block of one warp, as the kernel is written.
    unsafe { f(1, 32, 0, a.as_ptr(), b.as_ptr(), bt.as_ptr(), out.as_mut_ptr()) };
    Ok(out)
}
