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
pub mod checkpoint;
pub mod comms;
pub mod config;
pub mod eval;
pub mod grads;
pub mod loss;
pub mod metrics;
pub mod model;
pub mod ops;
pub mod optim;
pub mod train;
pub mod util;
