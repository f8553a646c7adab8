//! The data stage: sources, tokenization, mixture and packing, the loader and its resume cursor, prepare-data flags, run-directory locks, shipped configs, parsers on hostile input, shard checksums, full disks, kills during prepare.
//!
//! One test binary per stage: as one binary per file, every file would link the whole crate; grouped,
//! the suite builds a handful of binaries. The shared helpers are in tests/common (what each holds: its
//! mod.rs; where a new test goes: docs/ARCHITECTURE.md).
#[macro_use]
#[path = "../common/mod.rs"]
mod common;
#[path = "../common/tmpfs.rs"]
mod tmpfs;

mod cli_prepare_flags;
mod configs_shipped;
mod data_integrity;
mod data_loader;
mod data_prepare;
mod data_tokenize_fast;
mod dir_lock;
mod full_disk;
mod kill_during_prepare;
mod parsers_never_panic;
mod readers_never_panic;
