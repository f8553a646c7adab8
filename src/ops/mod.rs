//! Fused ops: each file has a CPU reference (`cpu_fwd`, readable loops), its backward, and a `_slow`
//! version from plain candle ops; CUDA launches slot in beside the CPU path.
pub mod attention;
pub mod attention_gemm;
pub mod attention_shape;
pub mod candle_flash;
pub mod cpu_gemm;
pub mod cpu_vec;
pub mod cross_entropy_chunk;
pub mod linear;
pub mod rms_norm;
pub mod rotary;
pub mod swiglu;
#[cfg(feature = "cuda")]
pub mod attention_cuda;
#[cfg(feature = "cuda")]
pub mod cuda;
