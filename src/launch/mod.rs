//! The processes of a multi-process run, apart from the collectives they run (`comms`): starting them
//! (`spawn`: `--nproc-per-node N` and `harpe dist-check`), reading what a launcher (torchrun, srun,
//! harpe's own) tells each of them (`env`), meeting before any work (`rendezvous`, over the key-value
//! `store`), agreeing that every rank runs the same collectives (`signature`), and stopping all of them
//! when one fails (`watch`).
//!
//! The non-obvious decision: this room sits below `comms`: a communicator is built from a rendezvous and
//! watched by `watch`, never the other way round.
pub mod env;
pub mod rendezvous;
pub mod signature;
pub mod spawn;
pub mod store;
pub mod watch;
