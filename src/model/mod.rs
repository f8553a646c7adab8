//! The model: HF config, Llama weights and forward, RoPE schemes.
//!
//! Shape legend used in comments throughout: B batch, T tokens, C hidden, H heads, Hkv kv heads,
//! D head dim, V vocab, L layers, I intermediate (MLP) size.
pub mod attention;
pub mod config;
pub mod inspect;
pub mod llama;
pub mod rope;
pub mod testing;
pub mod weights;

pub use llama::Llama;
pub use weights::load_model_dir;

pub use crate::data::tokenize::load_tokenizer;
