//! harpe: continual pretraining of Llama-family models to long context with head-adaptive RoPE.
//!
//! Modules follow the data flow (DESIGN.md §1):
//!
//! ```text
//!  jsonl(.zst) ──prepare-data──▶ shards+manifest ──▶ data::loader ──▶ model (llama + rope) ──▶ loss
//!                                                                      ▲                     │
//!                                       optim ◀── comms ◀── grads ◀──── backward ◀───────────┘
//!                                         │
//!                                         ▼
//!                               checkpoint (HF layout) ──▶ eval (ppl, niah)
//! ```
//!
//! Training state (fp32 master weights, AdamW moments, gradients) is `flatbuf::FlatBuf`s over one flat
//! index space in HF parameter order, shared by `grads`, `optim`, `comms` and `train::checkpoint`.
//! `train/` is the training stage (loop, step, checkpoint, loss, metrics, run directory); the tools
//! (`plan`, `bench`, `selftest`, `demo`, `kernels_emu`) sit apart and may use any stage.
pub mod config;
pub mod device;
pub mod data;
pub mod model;
pub mod ops;
pub mod flatbuf;
pub mod grads;
pub mod loss;
pub mod optim;
pub mod comms;
pub mod plot_font;
pub mod plan;
pub mod train;
pub mod eval;
pub mod bases;
pub mod research;
pub mod demo;
pub mod selftest;
pub mod bench;
pub mod util;
#[doc(hidden)]
pub mod kernels_emu;
