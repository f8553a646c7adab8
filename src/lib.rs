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
pub mod config;
pub mod data;
pub mod model;
pub mod ops;
pub mod loss;
pub mod grads;
pub mod optim;
pub mod comms;
pub mod checkpoint;
pub mod metrics;
pub mod train;
pub mod eval;
pub mod research;
pub mod demo;
pub mod util;
