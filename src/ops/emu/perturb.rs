//! A test-only switch that breaks one emulated kernel on purpose, so that the selftest's bounds and
//! scripts/gpu-check.sh's report can be shown to catch a wrong kernel (tests/tools/selftest_perturbed.rs,
//! tests/tools/gpu_check.rs).
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
