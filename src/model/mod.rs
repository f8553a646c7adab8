//! The model: HF config, Llama weights and forward, RoPE schemes.
//!
//! Shape legend used in comments throughout: B batch, T tokens, C hidden, H heads, Hkv kv heads,
//! D head dim, V vocab, L layers, I intermediate (MLP) size.
pub mod base_plot;
pub mod base_search;
pub mod rope;
