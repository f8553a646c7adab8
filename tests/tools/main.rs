//! The tools around the stages: bench, demo, sweep, report, `harpe plan`, `harpe search-bases`, the selftest's bounds
//! against perturbed kernels, gpu-check.sh, the allocator and linked libraries, and the import-cycle check of src/.
//!
//! One test binary per stage: as one binary per file, every file would link the whole crate; grouped,
//! the suite builds a handful of binaries. The shared helpers are in tests/common (what each holds: its
//! mod.rs; where a new test goes: docs/ARCHITECTURE.md).
#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod allocator;
mod cli_bench;
mod convert_gguf;
mod demo;
mod gpu_check;
mod import_cycles;
mod no_system_libs;
mod plan;
mod report;
mod search_bases;
mod selftest_perturbed;
mod sweep;
mod sweep_slurm;
