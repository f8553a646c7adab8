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
//! index space in HF parameter order, shared by `grads`, `optim`, `comms` and `checkpoint`.
pub mod config;
pub mod device;
pub mod data;
pub mod model;
pub mod ops;
pub mod loss;
pub mod flatbuf;
pub mod grads;
pub mod optim;
pub mod comms;
pub mod checkpoint;
pub mod metrics;
pub mod plot_font;
pub mod tensorboard;
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
