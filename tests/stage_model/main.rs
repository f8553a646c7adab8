//! The model and its ops: Llama against HF goldens, RoPE schemes, every fused op forward and backward against its reference, the emulated CUDA kernels, attention (GEMM, emulated, documents), devices, random init, base search.
//!
//! One test binary per stage: as one binary per file, every file would link the whole crate; grouped,
//! the suite builds a handful of binaries. Shared helpers live in
//! tests/common (the tiny recipe), tests/data_common and tests/ops_common.
#[path = "../ops_common/mod.rs"]
mod ops_common;

mod model;
mod ops;
mod ops_rms_norm;
mod ops_swiglu;
mod attention_docs;
mod attention_emu;
mod attention_gemm;
mod cpu_vec;
mod kernels_emu;
mod emu_profile;
mod golden;
mod import_cycles;
mod init_random;
mod device;
mod search_bases;
mod selftest_perturbed;
