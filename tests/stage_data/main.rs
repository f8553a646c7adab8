//! The data stage: sources, tokenization, mixture and packing, the loader and its resume cursor, prepare-data flags, run-directory locks, shipped configs, parsers on hostile input.
//!
//! One test binary per stage: as one binary per file, every file would link the whole crate; grouped,
//! the suite builds a handful of binaries. Shared helpers live in
//! tests/common (the tiny recipe), tests/data_common and tests/ops_common.
#[path = "../data_common/mod.rs"]
mod data_common;
#[path = "../common/tmpfs.rs"]
mod tmpfs;
mod full_disk;
mod kill_during_prepare;

mod data_integrity;
mod data_loader;
mod data_prepare;
mod data_tokenize_fast;
mod cli_prepare_flags;
mod parsers_never_panic;
mod readers_never_panic;
mod dir_lock;
mod configs_shipped;
