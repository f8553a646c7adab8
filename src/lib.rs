//! harpe: continual pretraining of Llama-family models to long context with head-adaptive RoPE.
//!
//! Modules in pipeline order, each using only those declared before it (checked by
//! tests/tools/import_cycles.rs):
//!
//! ```text
//!  jsonl(.zst) ──prepare-data──▶ shards+manifest ──▶ data::loader ──▶ model (llama + rope) ──▶ loss
//!                                                                      ▲                     │
//!                                       optim ◀── comms ◀── grads ◀──── backward ◀───────────┘
//!                                         │
//!                                         ▼
//!                               checkpoint (HF layout) ──▶ eval (ppl, niah) ──▶ research (sweep, report)
//! ```
//!
//! Training state (fp32 master weights, AdamW moments, gradients) is `flatbuf::FlatBuf`s over one flat
//! index space in HF parameter order, shared by `grads`, `optim`, `comms` and `train::checkpoint`.
//! `launch` starts and watches the processes of a multi-process run; `comms` holds the collectives
//! between them. The tools (`plan`, `bench`, `selftest`, `demo`) sit apart under `tools` and may use any
//! stage; nothing in the pipeline uses them. docs/ARCHITECTURE.md has the reading order and every file.

// Foundations: small shared helpers, devices, the ops every stage computes with.
pub mod testing;
pub mod util;
pub mod checksum;
pub mod plot_font;
pub mod device;
pub mod floors;
pub mod ops;
pub mod flatbuf;
// The pipeline: data, the model, the recipe, training state, processes and collectives, evaluation
// (which training also runs), training, the research workflow.
pub mod data;
pub mod model;
pub mod config;
pub mod grads;
pub mod launch;
pub mod comms;
pub mod optim;
pub mod eval;
pub mod train;
pub mod research;
// Around the pipeline.
pub mod tools;
