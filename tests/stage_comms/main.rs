//! Collectives and launch: thread ranks, the launcher environment, the spawner, the rendezvous and the failure watch.
//!
//! One test binary per stage: as one binary per file, every file would link the whole crate; grouped,
//! the suite builds a handful of binaries. The shared helpers are in tests/common (what each holds: its
//! mod.rs; where a new test goes: docs/ARCHITECTURE.md).
#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod comms_launch;
mod comms_local;
mod comms_torchrun;
