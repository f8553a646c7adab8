//! Collectives and launch: thread ranks, the launcher environment, the spawner, the rendezvous and the failure watch.
//!
//! One test binary per stage: as one binary per file, every file would link the whole crate; grouped,
//! the suite builds a handful of binaries. Shared helpers live in
//! tests/common (the tiny recipe), tests/data_common and tests/ops_common.

mod comms_launch;
mod comms_local;
mod comms_torchrun;
