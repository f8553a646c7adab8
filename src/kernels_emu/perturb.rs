//! A test-only switch that breaks one emulated kernel on purpose, so that the selftest's bounds and
//! scripts/gpu-check.sh's report can be shown to catch a wrong kernel (tests/stage_model/selftest_perturbed.rs,
//! tests/gpu_check_rehearse.rs).
//!
//! `HARPE_EMU_PERTURB=<kernel>` scales that kernel's output by 1.01 after the launch; `attention_fwd:mask`
//! instead runs the first query tile of (batch 0, head 0) with its diagonal key tile unmasked (as if the
//! causal mask of that one tile were wrong). Kernels: `rope`, `rms_norm_fwd`, `rms_norm_bwd` (dx),
//! `cross_entropy` (nll), `attention_fwd` (O).
//! The non-obvious decision: the switch sits in the emulated launchers (what `harpe selftest --target
//! emulated` calls), not in the selftest, so the selftest is tested as it runs; it is read per launch from
//! the environment, costs one lookup, and never touches the CUDA launchers.
//! Does not: perturb anything when the variable is unset (the default everywhere but those tests).

/// The environment variable naming the kernel to break.
pub const VAR: &str = "HARPE_EMU_PERTURB";
/// The factor a perturbed output is scaled by (1% off).
pub const FACTOR: f32 = 1.01;

/// The mode for `kernel`: Some("") to scale its output, Some("mask") for the wrong mask tile, else None.
pub fn mode(kernel: &str) -> Option<String> {
    let v = std::env::var(VAR).ok()?;
    let (name, mode) = v.split_once(':').unwrap_or((v.as_str(), ""));
    (name == kernel).then(|| mode.to_string())
}

/// Scale `out` by [`FACTOR`] when `HARPE_EMU_PERTURB` names `kernel` (without a mode).
pub fn scale<T: Copy>(kernel: &str, out: &mut [T], to_f32: impl Fn(T) -> f32, from_f32: impl Fn(f32) -> T) {
    if mode(kernel).as_deref() == Some("") {
        out.iter_mut().for_each(|x| *x = from_f32(to_f32(*x) * FACTOR));
    }
}

/// The `attention_fwd` hook of `kernels_emu::attention`'s forward launcher: scales O, or (`:mask`, causal
/// launches only, so the launch below is not perturbed again) recomputes the first query tile of
/// (batch 0, head 0) with every key up to the end of its diagonal tile visible.
pub fn attention_fwd<T: super::attention::AttnFloat>(
    kernel: crate::ops::attention_shape::AttnKernel,
    (q, k, v): (&[T], &[T], &[T]),
    dims: crate::ops::attention_shape::AttnDims,
    scale: f32,
    causal: bool,
    o: &mut [T],
    lse: &mut [f32],
) -> candle_core::Result<()> {
    match mode("attention_fwd").as_deref() {
        Some("") => self::scale("attention_fwd", o, T::to_f32, T::from_f32),
        Some("mask") if causal => {
            let crate::ops::attention_shape::AttnDims { tq, tk, d, .. } = dims;
            let rows = kernel.fwd_rows(d).min(tq);
            let keys = (tk - tq + rows).min(tk);
            let sub = crate::ops::attention_shape::AttnDims { b: 1, h: 1, hkv: 1, tq: rows, tk: keys, d };
            let (o2, l2) = super::attention::attention_fwd(
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
