//! The kernels of kernels/*.cu compiled by the host C++ compiler against kernels/emu.h (build.rs), with
//! safe wrappers: the same source that runs on the GPU runs here on CPU, so `cargo test` checks it
//! against the CPU references without a GPU (tests/stage_model/kernels_emu.rs, `harpe selftest` in a CPU build).
//!
//! Reference: kernels/emu.h (blocks in sequence, a block's threads as std::threads, barriers, warp
//! exchange). The non-obvious decision: the wrappers take the launch shape (`Dims`) from the caller, so
//! tests can use odd grids (fewer blocks than rows, partial warps are not allowed: blocks are multiples
//! of 32) and exercise the grid-stride loops. Each wrapper checks lengths before it passes raw pointers.
//! Does not: run fast (hundreds of OS threads per launch) — it is a correctness tool, not a CPU backend.
use candle_core::{bail, Result};
use half::bf16;

/// Declares each kernel entry point's signature once: as the pointer type `$alias<T>` that the
/// storage-type traits (`EmuFloat`, `attention::AttnFloat`) hold, and as one extern function per listed
/// instantiation, with `T` the listed type. Rust has no generic extern functions, so each instantiation
/// is declared in a module of its own where `T` is a type alias, and re-exported under its C name.
macro_rules! emu_kernels {
    ($($(#[$doc:meta])* $alias:ident<$T:ident> $args:tt for { $($name:ident: $t:ty),* $(,)? })*) => {$(
        $(#[$doc])*
        pub type $alias<$T> = unsafe extern "C" fn $args;
        $(
            mod $name {
                #[allow(unused_imports)]
                use super::*;
                type $T = $t;
                #[link(name = "harpe_kernels_emu", kind = "static")]
                extern "C" {
                    pub fn $name $args;
                }
            }
            pub use $name::$name;
        )*
    )*};
}

pub mod attention;
pub mod perturb;
pub mod profile;

/// A launch shape: `grid` blocks of `block` threads (1-D; block a multiple of 32, at most 1024).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub grid: u32,
    pub block: u32,
}

mod ffi {
    use half::bf16;
    emu_kernels! {
        /// kernels/rope.cu
        RopeFn<T>(
            gx: u32,
            bx: u32,
            smem: usize,
            x: *const T,
            cos: *const f32,
            sin: *const f32,
            y: *mut T,
            rows: u32,
            h: u32,
            t: u32,
            half: u32,
            htab: u32,
            sin_sign: f32,
        ) for { emu_rope_f32: f32, emu_rope_bf16: bf16 }
        /// kernels/rms_norm.cu, forward
        RmsFwdFn<T>(
            gx: u32,
            bx: u32,
            smem: usize,
            x: *const T,
            w: *const T,
            y: *mut T,
            rstd: *mut f32,
            n: u32,
            c: u32,
            eps: f32,
        ) for { emu_rms_norm_fwd_f32: f32, emu_rms_norm_fwd_bf16: bf16 }
        /// kernels/rms_norm.cu, dx and per-block dw partials
        RmsBwdFn<T>(
            gx: u32,
            bx: u32,
            smem: usize,
            dy: *const T,
            x: *const T,
            w: *const T,
            rstd: *const f32,
            dx: *mut T,
            dw_partial: *mut f32,
            n: u32,
            c: u32,
            eps: f32,
        ) for { emu_rms_norm_bwd_f32: f32, emu_rms_norm_bwd_bf16: bf16 }
        /// kernels/rms_norm.cu, dw from the partials in a fixed order
        RmsDwFn<T>(gx: u32, bx: u32, smem: usize, dw_partial: *const f32, dw: *mut T, parts: u32, c: u32)
            for { emu_rms_norm_dw_f32: f32, emu_rms_norm_dw_bf16: bf16 }
        /// kernels/cross_entropy.cu
        CeFn<T>(
            gx: u32,
            bx: u32,
            smem: usize,
            logits: *const T,
            targets: *const u32,
            gout: *const f32,
            nll: *mut f32,
            lse: *mut f32,
            dlogits: *mut T,
            n: u32,
            v: u32,
        ) for { emu_cross_entropy_f32: f32, emu_cross_entropy_bf16: bf16 }
        /// kernels/adamw.cu, the fused step
        AdamWFn<T>(
            gx: u32,
            bx: u32,
            smem: usize,
            master: *mut f32,
            m: *mut f32,
            v: *mut f32,
            grad: *const f32,
            out: *mut T,
            n: u64,
            lr: f32,
            beta1: f32,
            beta2: f32,
            eps: f32,
            wd: f32,
            step_size: f32,
            bc2_sqrt: f32,
            grad_scale: f32,
        ) for { emu_adamw_f32: f32, emu_adamw_bf16: bf16 }
    }
    #[link(name = "harpe_kernels_emu", kind = "static")]
    extern "C" {
        pub fn emu_grad_sumsq_partial(gx: u32, bx: u32, smem: usize, g: *const f32, n: u64, partial: *mut f64);
        pub fn emu_grad_sumsq_finish(gx: u32, bx: u32, smem: usize, partial: *const f64, parts: u32, out: *mut f64);
    }
}

/// The entry points of the row kernels for one storage type `T`.
#[doc(hidden)]
pub struct Kernels<T> {
    rope: ffi::RopeFn<T>,
    rms_fwd: ffi::RmsFwdFn<T>,
    rms_bwd: ffi::RmsBwdFn<T>,
    rms_dw: ffi::RmsDwFn<T>,
    ce: ffi::CeFn<T>,
    adamw: ffi::AdamWFn<T>,
}

/// A storage type the kernels are instantiated for (f32, bf16), with its entry points.
pub trait EmuFloat: Copy + Default + Send + Sync + std::fmt::Debug + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    #[doc(hidden)]
    const KERNELS: Kernels<Self>;
}

impl EmuFloat for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
    const KERNELS: Kernels<f32> = Kernels {
        rope: ffi::emu_rope_f32,
        rms_fwd: ffi::emu_rms_norm_fwd_f32,
        rms_bwd: ffi::emu_rms_norm_bwd_f32,
        rms_dw: ffi::emu_rms_norm_dw_f32,
        ce: ffi::emu_cross_entropy_f32,
        adamw: ffi::emu_adamw_f32,
    };
}

impl EmuFloat for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    const KERNELS: Kernels<bf16> = Kernels {
        rope: ffi::emu_rope_bf16,
        rms_fwd: ffi::emu_rms_norm_fwd_bf16,
        rms_bwd: ffi::emu_rms_norm_bwd_bf16,
        rms_dw: ffi::emu_rms_norm_dw_bf16,
        ce: ffi::emu_cross_entropy_bf16,
        adamw: ffi::emu_adamw_bf16,
    };
}

fn check_dims(d: Dims) -> Result<()> {
    if d.grid == 0 || d.block == 0 || !d.block.is_multiple_of(32) || d.block > 1024 {
        bail!("emulated launch {d:?}: need grid >= 1 and a block that is a multiple of 32 up to 1024");
    }
    Ok(())
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        bail!("emulated kernel: `{what}` has {got} elements, expected {want}");
    }
    Ok(())
}

fn u32_of(what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("emulated kernel: {what} = {v} does not fit u32")))
}

/// RoPE (kernels/rope.cu) on x (B, H, T, D) with tables (Htab, T, D/2); `sin_sign` -1 is the backward.
pub fn rope<T: EmuFloat>(
    x: &[T],
    cos: &[f32],
    sin: &[f32],
    (b, h, t, d): (usize, usize, usize, usize),
    htab: usize,
    sin_sign: f32,
    dims: Dims,
) -> Result<Vec<T>> {
    check_dims(dims)?;
    if !d.is_multiple_of(2) || htab == 0 || !h.is_multiple_of(htab) {
        bail!("rope: D = {d} must be even and H = {h} a multiple of Htab = {htab}");
    }
    check_len("x", x.len(), b * h * t * d)?;
    check_len("cos", cos.len(), htab * t * d / 2)?;
    check_len("sin", sin.len(), htab * t * d / 2)?;
    let mut y = vec![T::default(); x.len()];
    let (rows, h32, t32, half, htab32) =
        (u32_of("B*H*T", b * h * t)?, u32_of("H", h)?, u32_of("T", t)?, u32_of("D/2", d / 2)?, u32_of("Htab", htab)?);
    // SAFETY: every pointer covers the element counts checked above; the call returns after the launch.
    unsafe {
        (T::KERNELS.rope)(
            dims.grid,
            dims.block,
            0,
            x.as_ptr(),
            cos.as_ptr(),
            sin.as_ptr(),
            y.as_mut_ptr(),
            rows,
            h32,
            t32,
            half,
            htab32,
            sin_sign,
        )
    };
    perturb::scale("rope", &mut y, T::to_f32, T::from_f32);
    Ok(y)
}

/// RMSNorm forward (kernels/rms_norm.cu): x (N, C), w (C) -> (y (N, C), rstd (N)).
pub fn rms_norm_fwd<T: EmuFloat>(
    x: &[T],
    w: &[T],
    (n, c): (usize, usize),
    eps: f32,
    dims: Dims,
) -> Result<(Vec<T>, Vec<f32>)> {
    check_dims(dims)?;
    check_len("x", x.len(), n * c)?;
    check_len("w", w.len(), c)?;
    let mut y = vec![T::default(); n * c];
    let mut rstd = vec![0f32; n];
    // SAFETY: lengths checked above.
    unsafe {
        (T::KERNELS.rms_fwd)(
            dims.grid,
            dims.block,
            0,
            x.as_ptr(),
            w.as_ptr(),
            y.as_mut_ptr(),
            rstd.as_mut_ptr(),
            u32_of("N", n)?,
            u32_of("C", c)?,
            eps,
        )
    };
    perturb::scale("rms_norm_fwd", &mut y, T::to_f32, T::from_f32);
    Ok((y, rstd))
}

/// RMSNorm backward: (dx (N, C), dw (C)) from dy, x, w and the forward's rstd (recomputed from x with
/// `eps` when `None`).
pub fn rms_norm_bwd<T: EmuFloat>(
    dy: &[T],
    x: &[T],
    w: &[T],
    rstd: Option<&[f32]>,
    (n, c): (usize, usize),
    eps: f32,
    dims: Dims,
) -> Result<(Vec<T>, Vec<T>)> {
    check_dims(dims)?;
    check_len("dy", dy.len(), n * c)?;
    check_len("x", x.len(), n * c)?;
    check_len("w", w.len(), c)?;
    if let Some(r) = rstd {
        check_len("rstd", r.len(), n)?;
    }
    let rstd_ptr = rstd.map_or(std::ptr::null(), |r| r.as_ptr());
    let mut dx = vec![T::default(); n * c];
    let mut partial = vec![0f32; dims.grid as usize * c];
    let mut dw = vec![T::default(); c];
    let (n32, c32) = (u32_of("N", n)?, u32_of("C", c)?);
    // SAFETY: lengths checked above; `partial` has grid rows of C as the kernel indexes it.
    unsafe {
        (T::KERNELS.rms_bwd)(
            dims.grid,
            dims.block,
            0,
            dy.as_ptr(),
            x.as_ptr(),
            w.as_ptr(),
            rstd_ptr,
            dx.as_mut_ptr(),
            partial.as_mut_ptr(),
            n32,
            c32,
            eps,
        );
        (T::KERNELS.rms_dw)(
            c32.div_ceil(dims.block).max(1),
            dims.block,
            0,
            partial.as_ptr(),
            dw.as_mut_ptr(),
            dims.grid,
            c32,
        );
    }
    perturb::scale("rms_norm_bwd", &mut dx, T::to_f32, T::from_f32);
    Ok((dx, dw))
}

/// Output of the fused cross-entropy kernel on one chunk of logits.
#[derive(Clone, Debug)]
pub struct CeOut<T> {
    pub nll: Vec<f32>,
    pub lse: Vec<f32>,
    /// g (softmax - onehot) per row, when an upstream gradient was given
    pub dlogits: Option<Vec<T>>,
}

/// Cross-entropy on logits (n, V) with targets (n) (`cross_entropy_chunk::IGNORE_INDEX` skipped); with `gout` (n) also
/// dlogits. `in_place` writes dlogits over a copy of the logits buffer (the aliasing the GPU path uses).
pub fn cross_entropy<T: EmuFloat>(
    logits: &[T],
    targets: &[u32],
    gout: Option<&[f32]>,
    (n, v): (usize, usize),
    in_place: bool,
    dims: Dims,
) -> Result<CeOut<T>> {
    check_dims(dims)?;
    check_len("logits", logits.len(), n * v)?;
    check_len("targets", targets.len(), n)?;
    if let Some(g) = gout {
        check_len("gout", g.len(), n)?;
    }
    let (mut nll, mut lse) = (vec![0f32; n], vec![0f32; n]);
    let mut buf = logits.to_vec();
    let mut dl = if gout.is_some() && !in_place { Some(vec![T::default(); n * v]) } else { None };
    let dl_ptr = match (&mut dl, gout.is_some()) {
        (Some(d), _) => d.as_mut_ptr(),
        (None, true) => buf.as_mut_ptr(),
        (None, false) => std::ptr::null_mut(),
    };
    let g_ptr = gout.map_or(std::ptr::null(), |g| g.as_ptr());
    // SAFETY: lengths checked above; in place, logits and dlogits are the same buffer, which the kernel
    // allows (each element is rewritten only by the thread that read it).
    unsafe {
        (T::KERNELS.ce)(
            dims.grid,
            dims.block,
            0,
            buf.as_ptr(),
            targets.as_ptr(),
            g_ptr,
            nll.as_mut_ptr(),
            lse.as_mut_ptr(),
            dl_ptr,
            u32_of("n", n)?,
            u32_of("V", v)?,
        )
    };
    let dlogits = match (dl, gout.is_some()) {
        (Some(d), _) => Some(d),
        (None, true) => Some(buf),
        (None, false) => None,
    };
    perturb::scale("cross_entropy", &mut nll, |x| x, |x| x);
    Ok(CeOut { nll, lse, dlogits })
}

/// Scalars of one AdamW step (as `optim::adamw::AdamW::step` derives them from lr and t).
#[derive(Clone, Copy, Debug)]
pub struct AdamWArgs {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub wd: f32,
    pub step_size: f32,
    pub bc2_sqrt: f32,
    pub grad_scale: f32,
}

/// One fused AdamW step in place on master, m, v; writes `out` (compute weights) when given.
pub fn adamw<T: EmuFloat>(
    master: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grad: &[f32],
    out: Option<&mut [T]>,
    a: AdamWArgs,
    dims: Dims,
) -> Result<()> {
    check_dims(dims)?;
    let n = master.len();
    check_len("m", m.len(), n)?;
    check_len("v", v.len(), n)?;
    check_len("grad", grad.len(), n)?;
    let out_ptr = match out {
        Some(o) => {
            check_len("out", o.len(), n)?;
            o.as_mut_ptr()
        }
        None => std::ptr::null_mut(),
    };
    // SAFETY: lengths checked above; `out` may be null (the kernel skips it).
    unsafe {
        (T::KERNELS.adamw)(
            dims.grid,
            dims.block,
            0,
            master.as_mut_ptr(),
            m.as_mut_ptr(),
            v.as_mut_ptr(),
            grad.as_ptr(),
            out_ptr,
            n as u64,
            a.lr,
            a.beta1,
            a.beta2,
            a.eps,
            a.wd,
            a.step_size,
            a.bc2_sqrt,
            a.grad_scale,
        )
    };
    Ok(())
}

/// Sum of squares of `g` in f64 (kernels/adamw.cu: per-block partials, then one block in fixed order).
pub fn grad_sumsq(g: &[f32], dims: Dims) -> Result<f64> {
    check_dims(dims)?;
    let mut partial = vec![0f64; dims.grid as usize];
    let mut out = [0f64];
    // SAFETY: `partial` has one slot per block; `out` one.
    unsafe {
        ffi::emu_grad_sumsq_partial(dims.grid, dims.block, 0, g.as_ptr(), g.len() as u64, partial.as_mut_ptr());
        ffi::emu_grad_sumsq_finish(1, dims.block, 0, partial.as_ptr(), dims.grid, out.as_mut_ptr());
    }
    Ok(out[0])
}
