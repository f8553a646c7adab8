//! The training stage: one step against torch, runs and resume, N ranks equal one, ZeRO-3 prefetch, document masks, in-training evaluation, memory against the plan, the memory model of the plan, the train CLI.
//!
//! One test binary per stage: as one binary per file, every file would link the whole crate; grouped,
//! the suite builds a handful of binaries. The shared helpers are in tests/common (what each holds: its
//! mod.rs; where a new test goes: docs/ARCHITECTURE.md).
#[macro_use]
#[path = "../common/mod.rs"]
mod common;
#[cfg(feature = "gloo")]
#[path = "../common/netns.rs"]
mod netns;
#[cfg(feature = "gloo")]
#[path = "../common/slurm_two_nodes.rs"]
mod slurm_two_nodes;
#[path = "../common/tmpfs.rs"]
mod tmpfs;

mod train_dist;
mod train_dist_eval;
mod train_document_mask;
mod train_eval;
#[cfg(feature = "gloo")]
mod train_gloo;
#[cfg(feature = "gloo")]
mod train_two_hosts;
#[cfg(feature = "gloo")]
mod train_slurm;
#[cfg(feature = "gloo")]
mod train_slurm_two_nodes;
mod train_memory;
mod train_run;
mod train_step;
mod zero3_prefetch;
mod checkpoint_integrity;
mod cli_train;
mod floors;
mod full_disk;
mod kill_during_write;
mod plan_largest_t;
mod plan_memory;
