//! The model and its ops: Llama against HF goldens, RoPE schemes, every fused op forward and backward against its reference, the emulated CUDA kernels, attention (GEMM, emulated, documents), devices, random init.
//!
//! One test binary per stage: as one binary per file, every file would link the whole crate; grouped,
//! the suite builds a handful of binaries. The shared helpers are in tests/common (what each holds: its
//! mod.rs; where a new test goes: docs/ARCHITECTURE.md).
#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod model;
mod ops;
mod ops_rms_norm;
mod ops_swiglu;
mod ops_harness;
mod loss;
mod attention_docs;
mod attention_emu;
mod attention_gemm;
mod cpu_vec;
mod kernels_emu;
mod emu_profile;
mod golden;
mod init_random;
mod device;
