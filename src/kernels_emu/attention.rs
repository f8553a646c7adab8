//! Host twins of kernels/attention.cu (flash attention forward, delta pre-kernel, backward, dQ convert; the
//! FMA tiles and the tensor-core tiles) and of kernels/mma_probe.cu: the kernels' own source compiled
//! against kernels/emu.h, behind safe wrappers with the shapes of `ops::attention` (q (B, H, Tq, D), k/v
//! (B, Hkv, Tk, D), lse (B, H, Tq)); `attention_{fwd,bwd}_doc` pass a document mask (per key, the start of
//! its document: `ops::attention::DocStarts::host`), the others a null pointer.
//!
//! Reference: kernels/attention.cu (header: algorithm, tiles, what a block owns), kernels/mma.cuh (the
//! fragment layouts the emulated mma/ldmatrix reproduce); the CPU reference
//! `ops::attention::{attention_fwd_cpu, attention_bwd_cpu}` they are tested against (tests/stage_model/attention_emu.rs).
//! The non-obvious decision: the launch shape is not the caller's choice here (unlike the row kernels):
//! the kernels are written for exactly 128 threads per block and one block per (tile, head, batch), so
//! the wrapper derives the grid from the shapes exactly as the CUDA launcher does — and both take the
//! tile heights and the kernel choice from `AttnKernel`, one owner for both targets.
//! Does not: run fast (one OS thread per emulated GPU thread; every mma is a warp barrier).
use super::{check_len, u32_of};
use crate::ops::attention::AttnDims;
use candle_core::{bail, Result};
use half::{bf16, f16};

/// Threads per block of the attention kernels (`ATTN_NT` in kernels/attention.cu).
pub const ATTN_THREADS: u32 = 128;
/// Head dims the kernels are instantiated for (FMA tiles; the tensor-core tiles take 64 and 128).
pub const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];
/// Head dims of the tensor-core kernels.
pub const TC_HEAD_DIMS: [usize; 2] = [64, 128];

/// Which tiles of kernels/attention.cu run: the FMA reference tiles or the tensor-core (mma.sync) tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKernel {
    /// plain FMA loops over shared memory (every dtype and head dim; the readable reference)
    Fma,
    /// sm_80 mma.sync m16n8k16 + ldmatrix (bf16/f16 inputs, D = 64 or 128, 16-byte aligned inputs)
    TensorCore,
}

impl AttnKernel {
    /// The fastest kernel for a storage type of `elem_bytes` bytes and head dim `d`.
    pub fn best(elem_bytes: usize, d: usize) -> AttnKernel {
        if elem_bytes == 2 && TC_HEAD_DIMS.contains(&d) {
            AttnKernel::TensorCore
        } else {
            AttnKernel::Fma
        }
    }

    /// Query rows per forward block (`AttnTile<D>::BQ` / `AttnTc<D>::BQ` in the kernel).
    pub fn fwd_rows(self, d: usize) -> usize {
        match self {
            AttnKernel::Fma => fma_tile(d),
            AttnKernel::TensorCore => 64,
        }
    }

    /// Keys per backward block (`AttnTile<D>::BK` / `AttnTc<D>::BKB`).
    pub fn bwd_keys(self, d: usize) -> usize {
        match self {
            AttnKernel::Fma => fma_tile(d),
            AttnKernel::TensorCore => 64,
        }
    }

    /// Kernel-name stem: `attn_fwd` or `attn_fwd_tc` (and `attn_bwd`, `attn_bwd_tc`).
    pub fn stem(self, pass: &str) -> String {
        match self {
            AttnKernel::Fma => format!("attn_{pass}"),
            AttnKernel::TensorCore => format!("attn_{pass}_tc"),
        }
    }

    /// An error unless this kernel is instantiated for `elem_bytes`-byte inputs and head dim `d`.
    pub fn check(self, elem_bytes: usize, d: usize) -> Result<()> {
        if self == AttnKernel::TensorCore && (elem_bytes != 2 || !TC_HEAD_DIMS.contains(&d)) {
            bail!(
                "attention kernel: the tensor-core tiles take bf16/f16 inputs with D in {TC_HEAD_DIMS:?}, got {elem_bytes}-byte elements and D = {d}\nhint: use AttnKernel::Fma (or AttnKernel::best)"
            );
        }
        Ok(())
    }
}

/// Query (forward) and key (backward) tile height of the FMA kernels for head dim `d` (`AttnTile<D>`).
pub fn fma_tile(d: usize) -> usize {
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
    *const u32,
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
    *const u32,
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
type PackFn<T> = unsafe extern "C" fn(u32, u32, usize, *const T, *const f32, *mut f32, u32, u32);
type UnpackFn<T> = unsafe extern "C" fn(u32, u32, usize, *const f32, *mut T, *mut T, *mut T, *mut f32, u32, u32);
type ProbeFn<T> = unsafe extern "C" fn(u32, u32, usize, *const T, *const T, *const T, *mut f32);

mod ffi {
    use super::{bf16, f16};
    macro_rules! decl {
        ($t:ty, $($fwd:ident, $bwd:ident),*) => {$(
            pub fn $fwd(
                gx: u32,
                bx: u32,
                smem: usize,
                q: *const $t,
                k: *const $t,
                v: *const $t,
                o: *mut $t,
                lse: *mut f32,
                docs: *const u32,
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
                docs: *const u32,
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
        )*};
    }
    macro_rules! decl_rows {
        ($t:ty, $delta:ident, $conv:ident, $pack:ident, $unpack:ident) => {
            pub fn $delta(
                gx: u32,
                bx: u32,
                smem: usize,
                o: *const $t,
                dout: *const $t,
                delta: *mut f32,
                rows: u32,
                d: u32,
            );
            pub fn $conv(gx: u32, bx: u32, smem: usize, acc: *const f32, dq: *mut $t, n: u64);
            pub fn $pack(
                gx: u32,
                bx: u32,
                smem: usize,
                o: *const $t,
                lse: *const f32,
                packed: *mut f32,
                rows: u32,
                d: u32,
            );
            pub fn $unpack(
                gx: u32,
                bx: u32,
                smem: usize,
                packed: *const f32,
                q: *mut $t,
                o: *mut $t,
                dout: *mut $t,
                lse: *mut f32,
                rows: u32,
                d: u32,
            );
        };
    }
    #[link(name = "harpe_kernels_emu", kind = "static")]
    extern "C" {
        decl!(
            f32,
            emu_attn_fwd_f32_d16,
            emu_attn_bwd_f32_d16,
            emu_attn_fwd_f32_d32,
            emu_attn_bwd_f32_d32,
            emu_attn_fwd_f32_d64,
            emu_attn_bwd_f32_d64,
            emu_attn_fwd_f32_d128,
            emu_attn_bwd_f32_d128
        );
        decl!(
            bf16,
            emu_attn_fwd_bf16_d16,
            emu_attn_bwd_bf16_d16,
            emu_attn_fwd_bf16_d32,
            emu_attn_bwd_bf16_d32,
            emu_attn_fwd_bf16_d64,
            emu_attn_bwd_bf16_d64,
            emu_attn_fwd_bf16_d128,
            emu_attn_bwd_bf16_d128,
            emu_attn_fwd_tc_bf16_d64,
            emu_attn_bwd_tc_bf16_d64,
            emu_attn_fwd_tc_bf16_d128,
            emu_attn_bwd_tc_bf16_d128
        );
        decl!(
            f16,
            emu_attn_fwd_f16_d16,
            emu_attn_bwd_f16_d16,
            emu_attn_fwd_f16_d32,
            emu_attn_bwd_f16_d32,
            emu_attn_fwd_f16_d64,
            emu_attn_bwd_f16_d64,
            emu_attn_fwd_f16_d128,
            emu_attn_bwd_f16_d128,
            emu_attn_fwd_tc_f16_d64,
            emu_attn_bwd_tc_f16_d64,
            emu_attn_fwd_tc_f16_d128,
            emu_attn_bwd_tc_f16_d128
        );
        decl_rows!(f32, emu_attn_bwd_delta_f32, emu_attn_dq_convert_f32, emu_attn_pack_fwd_f32, emu_attn_unpack_bwd_f32);
        decl_rows!(
            bf16,
            emu_attn_bwd_delta_bf16,
            emu_attn_dq_convert_bf16,
            emu_attn_pack_fwd_bf16,
            emu_attn_unpack_bwd_bf16
        );
        decl_rows!(f16, emu_attn_bwd_delta_f16, emu_attn_dq_convert_f16, emu_attn_pack_fwd_f16, emu_attn_unpack_bwd_f16);
        pub fn emu_mma_probe_bf16(
            gx: u32,
            bx: u32,
            smem: usize,
            a: *const bf16,
            b: *const bf16,
            bt: *const bf16,
            out: *mut f32,
        );
        pub fn emu_mma_probe_f16(
            gx: u32,
            bx: u32,
            smem: usize,
            a: *const f16,
            b: *const f16,
            bt: *const f16,
            out: *mut f32,
        );
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
    const PACK: PackFn<Self>;
    #[doc(hidden)]
    const UNPACK: UnpackFn<Self>;
    #[doc(hidden)]
    const PROBE: Option<ProbeFn<Self>>;
}

macro_rules! attn_float {
    ($t:ty, $to:expr, $from:expr, $delta:ident, $conv:ident, $pack:ident, $unpack:ident, $probe:expr,
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
            const PACK: PackFn<Self> = ffi::$pack;
            const UNPACK: UnpackFn<Self> = ffi::$unpack;
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
    emu_attn_pack_fwd_f32,
    emu_attn_unpack_bwd_f32,
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
    emu_attn_pack_fwd_bf16,
    emu_attn_unpack_bwd_bf16,
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
    emu_attn_pack_fwd_f16,
    emu_attn_unpack_bwd_f16,
    Some(ffi::emu_mma_probe_f16 as ProbeFn<f16>),
    fma [
        (16, emu_attn_fwd_f16_d16, emu_attn_bwd_f16_d16),
        (32, emu_attn_fwd_f16_d32, emu_attn_bwd_f16_d32),
        (64, emu_attn_fwd_f16_d64, emu_attn_bwd_f16_d64),
        (128, emu_attn_fwd_f16_d128, emu_attn_bwd_f16_d128)
    ],
    tc [(64, emu_attn_fwd_tc_f16_d64, emu_attn_bwd_tc_f16_d64), (128, emu_attn_fwd_tc_f16_d128, emu_attn_bwd_tc_f16_d128)]
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

/// Flash-attention forward on the emulator with the fastest kernel for T and D (`AttnKernel::best`).
pub fn attention_fwd<T: AttnFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    dims: AttnDims,
    scale: f32,
    causal: bool,
) -> Result<(Vec<T>, Vec<f32>)> {
    attention_fwd_with(AttnKernel::best(std::mem::size_of::<T>(), dims.d), q, k, v, dims, scale, causal)
}

/// Flash-attention forward on the emulator with the given tiles: (O (B, H, Tq, D), lse (B, H, Tq)).
pub fn attention_fwd_with<T: AttnFloat>(
    kernel: AttnKernel,
    q: &[T],
    k: &[T],
    v: &[T],
    dims: AttnDims,
    scale: f32,
    causal: bool,
) -> Result<(Vec<T>, Vec<f32>)> {
    fwd_impl(kernel, q, k, v, dims, scale, causal, None)
}

/// `attention_fwd_with` under a document mask (causal): `docs` (B*Tk) per key position, the start of its
/// document (`ops::attention::DocStarts::host`).
pub fn attention_fwd_doc<T: AttnFloat>(
    kernel: AttnKernel,
    q: &[T],
    k: &[T],
    v: &[T],
    dims: AttnDims,
    scale: f32,
    docs: &[u32],
) -> Result<(Vec<T>, Vec<f32>)> {
    fwd_impl(kernel, q, k, v, dims, scale, true, Some(docs))
}

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

#[allow(clippy::too_many_arguments)]
fn fwd_impl<T: AttnFloat>(
    kernel: AttnKernel,
    q: &[T],
    k: &[T],
    v: &[T],
    dims: AttnDims,
    scale: f32,
    causal: bool,
    docs: Option<&[u32]>,
) -> Result<(Vec<T>, Vec<f32>)> {
    check_dims(dims, causal)?;
    check_docs(dims, causal, docs)?;
    kernel.check(std::mem::size_of::<T>(), dims.d)?;
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    check_len("q", q.len(), b * h * tq * d)?;
    check_len("k", k.len(), b * hkv * tk * d)?;
    check_len("v", v.len(), b * hkv * tk * d)?;
    let Some(f) = T::fwd_fn(kernel, d) else { bail!("attention kernel: no {kernel:?} instance for D = {d}") };
    let grid = u32_of("forward grid", tq.div_ceil(kernel.fwd_rows(d)) * b * h)?;
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
            docs.map_or(std::ptr::null(), |ds| ds.as_ptr()),
            b as u32,
            h as u32,
            hkv as u32,
            tq as u32,
            tk as u32,
            scale,
            causal as i32,
        )
    };
    super::perturb::attention_fwd(kernel, (q, k, v), dims, scale, causal, &mut o, &mut lse)?; // test-only switch
    Ok((o, lse))
}

/// Flash-attention backward on the emulator with the fastest kernel for T and D (`AttnKernel::best`).
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
    let kernel = AttnKernel::best(std::mem::size_of::<T>(), dims.d);
    attention_bwd_with(kernel, q, k, v, o, lse, dout, dims, scale, causal)
}

/// Flash-attention backward on the emulator: (dQ, dK, dV) from q, k, v, the forward's O and lse, and dO.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_with<T: AttnFloat>(
    kernel: AttnKernel,
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
    bwd_impl(kernel, q, k, v, o, lse, dout, dims, scale, causal, None)
}

/// `attention_bwd_with` under a document mask (`attention_fwd_doc`'s `docs`).
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_doc<T: AttnFloat>(
    kernel: AttnKernel,
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    lse: &[f32],
    dout: &[T],
    dims: AttnDims,
    scale: f32,
    docs: &[u32],
) -> Result<(Vec<T>, Vec<T>, Vec<T>)> {
    bwd_impl(kernel, q, k, v, o, lse, dout, dims, scale, true, Some(docs))
}

#[allow(clippy::too_many_arguments)]
fn bwd_impl<T: AttnFloat>(
    kernel: AttnKernel,
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    lse: &[f32],
    dout: &[T],
    dims: AttnDims,
    scale: f32,
    causal: bool,
    docs: Option<&[u32]>,
) -> Result<(Vec<T>, Vec<T>, Vec<T>)> {
    check_dims(dims, causal)?;
    check_docs(dims, causal, docs)?;
    kernel.check(std::mem::size_of::<T>(), dims.d)?;
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    check_len("q", q.len(), b * h * tq * d)?;
    check_len("o", o.len(), b * h * tq * d)?;
    check_len("dout", dout.len(), b * h * tq * d)?;
    check_len("lse", lse.len(), b * h * tq)?;
    check_len("k", k.len(), b * hkv * tk * d)?;
    check_len("v", v.len(), b * hkv * tk * d)?;
    let Some(f) = T::bwd_fn(kernel, d) else { bail!("attention kernel: no {kernel:?} instance for D = {d}") };
    let rows = b * h * tq;
    let mut delta = vec![0f32; rows];
    let mut dq_acc = vec![0f32; q.len()];
    let (mut dq, mut dk, mut dv) =
        (vec![T::default(); q.len()], vec![T::default(); k.len()], vec![T::default(); v.len()]);
    let wpb = (ATTN_THREADS / 32) as usize;
    let grid = u32_of("backward grid", tk.div_ceil(kernel.bwd_keys(d)) * b * hkv)?;
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

/// The forward op's output layout (kernels/attention.cu `attn_pack_fwd_*`): O (rows, D) and lse (rows) as
/// f32 rows of D + 1.
pub fn pack_fwd<T: AttnFloat>(o: &[T], lse: &[f32], d: usize) -> Result<Vec<f32>> {
    let rows = lse.len();
    check_len("o", o.len(), rows * d)?;
    let mut packed = vec![0f32; rows * (d + 1)];
    let grid = u32_of("pack grid", packed.len().div_ceil(ATTN_THREADS as usize).min(65535))?;
    // SAFETY: lengths checked; a grid-stride loop over rows * (d + 1).
    unsafe {
        T::PACK(grid, ATTN_THREADS, 0, o.as_ptr(), lse.as_ptr(), packed.as_mut_ptr(), u32_of("rows", rows)?, d as u32)
    };
    Ok(packed)
}

/// The backward op's input split (`attn_unpack_bwd_*`): rows of 3D + 2 f32 [q | O | lse | dO | .] ->
/// (q, O, dO, lse).
#[allow(clippy::type_complexity)]
pub fn unpack_bwd<T: AttnFloat>(packed: &[f32], d: usize) -> Result<(Vec<T>, Vec<T>, Vec<T>, Vec<f32>)> {
    let w = 3 * d + 2;
    if !packed.len().is_multiple_of(w) {
        bail!("attention unpack: {} values are not rows of 3 * {d} + 2", packed.len());
    }
    let rows = packed.len() / w;
    let (mut q, mut o, mut dout) =
        (vec![T::default(); rows * d], vec![T::default(); rows * d], vec![T::default(); rows * d]);
    let mut lse = vec![0f32; rows];
    let grid = u32_of("unpack grid", packed.len().div_ceil(ATTN_THREADS as usize).min(65535))?;
    // SAFETY: every buffer holds `rows` rows of its width; a grid-stride loop over rows * w.
    unsafe {
        T::UNPACK(
            grid,
            ATTN_THREADS,
            0,
            packed.as_ptr(),
            q.as_mut_ptr(),
            o.as_mut_ptr(),
            dout.as_mut_ptr(),
            lse.as_mut_ptr(),
            u32_of("rows", rows)?,
            d as u32,
        )
    };
    Ok((q, o, dout, lse))
}
