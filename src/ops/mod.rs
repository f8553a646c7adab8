//! Fused ops: each file has a CPU reference (`cpu_fwd`, readable loops), its backward, and a `_slow`
//! version from plain candle ops; CUDA launches slot in beside the CPU path.
pub mod attention;
pub mod attention_gemm;
pub mod attention_shape;
pub mod candle_flash;
pub mod cpu_gemm;
pub mod cpu_vec;
pub mod cross_entropy_chunk;
pub mod emu;
pub mod flash2;
pub mod flash2_params;
pub mod linear;
pub mod rms_norm;
pub mod rotary;
pub mod swiglu;
#[cfg(feature = "cuda")]
pub mod attention_cuda;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "flash-attn")]
pub mod flash2_cuda;

/// Element types an output buffer may start uninitialised for (`for_overwrite`).
///
/// # Safety
/// Every bit pattern of the type is a value, and it has no drop (f32, bf16, f16).
pub unsafe trait Plain: Copy + Send + Sync {
    /// What debug builds fill a fresh buffer with, so that a value a kernel failed to write shows in the
    /// tests' comparisons with the references.
    const POISON: Self;
}

// SAFETY: any 32 bits are an f32; no drop.
unsafe impl Plain for f32 {
    const POISON: Self = f32::NAN;
}
// SAFETY: any 16 bits are a bf16; no drop.
unsafe impl Plain for half::bf16 {
    const POISON: Self = half::bf16::NAN;
}
// SAFETY: any 16 bits are an f16; no drop.
unsafe impl Plain for half::f16 {
    const POISON: Self = half::f16::NAN;
}

/// An output buffer of n values for a kernel that writes every one of them before anything reads it.
///
/// `vec![0.0; n]` zeroes memory the kernel overwrites next: jemalloc hands back reused pages
/// (`src/main.rs`), which calloc must clear with memset. `perf` of training grid row 3 (hidden 128,
/// 2048 tokens a step) had that memset at 5% of the step (the SwiGLU, RoPE and RMSNorm outputs, the
/// attention's block scratch). Release builds skip it; debug builds (`cargo test`) fill the buffer with
/// NaN, so a value left unwritten fails the reference comparisons instead of reading as 0.
///
/// # Safety
/// The caller writes every value of the buffer before anything reads it.
#[allow(clippy::uninit_vec)]
pub unsafe fn for_overwrite<T: Plain>(n: usize) -> Vec<T> {
    if cfg!(debug_assertions) {
        return vec![T::POISON; n];
    }
    let mut v = Vec::with_capacity(n);
    // SAFETY: T is `Plain` (every bit pattern is a value, nothing to drop), and the caller writes every
    // value before it is read (this function's contract; debug builds check it through the NaN fill).
    unsafe { v.set_len(n) };
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn for_overwrite_has_the_length_asked_and_debug_builds_poison_it() {
        for n in [0, 1, 17, 1 << 16] {
            // SAFETY: only the length is read, and the values in debug builds, where they are the NaN fill.
            let (a, b, c): (Vec<f32>, Vec<half::bf16>, Vec<half::f16>) =
                unsafe { (for_overwrite(n), for_overwrite(n), for_overwrite(n)) };
            assert_eq!((a.len(), b.len(), c.len()), (n, n, n));
            if cfg!(debug_assertions) {
                assert!(a.iter().all(|x| x.is_nan()) && b.iter().all(|x| x.is_nan()) && c.iter().all(|x| x.is_nan()));
            }
        }
    }
}
