//! The training stage: one step against torch, runs and resume, N ranks equal one, ZeRO-3 prefetch, document masks, in-training evaluation, memory against the plan, the plan itself, the train CLI.
//!
//! One test binary per stage: as one binary per file, every file would link the whole crate; grouped,
//! the suite builds a handful of binaries. Shared helpers live in
//! tests/common (the tiny recipe), tests/data_common and tests/ops_common.
#[macro_use]
#[path = "../common/mod.rs"]
mod common;
#[path = "../common/tmpfs.rs"]
mod tmpfs;

mod train_dist;
mod train_dist_eval;
mod train_document_mask;
mod train_eval;
mod train_memory;
mod train_run;
mod train_step;
mod zero3_prefetch;
mod checkpoint_integrity;
mod cli_train;
mod full_disk;
mod kill_during_write;
mod plan;
mod plan_largest_t;
mod plan_memory;
