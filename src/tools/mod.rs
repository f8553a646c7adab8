//! Tools around the pipeline: they use its stages, and nothing in the pipeline uses them.
//! `plan` (memory and step time before a run), `bench` (kernels, model, collectives, attention),
//! `selftest` (every kernel against its reference), `demo` (the paper's question at CPU scale),
//! `verify` (a checkpoint's or a dataset's files against their checksums), `convert` (a GGUF model
//! into an HF model directory).
pub mod bench;
pub mod convert;
pub mod demo;
pub mod plan;
pub mod selftest;
pub mod verify;
