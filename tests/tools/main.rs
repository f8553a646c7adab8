//! The tools around the stages: bench, demo, sweep and report.
//!
//! One test binary per stage: as one binary per file, every file would link the whole crate; grouped,
//! the suite builds a handful of binaries. Shared helpers live in
//! tests/common (the tiny recipe), tests/data_common and tests/ops_common.

mod allocator;
mod cli_bench;
mod demo;
mod gpu_check;
mod no_system_libs;
mod report;
mod sweep;
