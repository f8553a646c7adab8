//! The model: HF config, Llama weights and forward, RoPE schemes.
//!
//! Shape legend used in comments throughout: B batch, T tokens, C hidden, H heads, Hkv kv heads,
//! D head dim, V vocab, L layers, I intermediate (MLP) size.
pub mod attention;
pub mod config;
pub mod gguf;
pub mod inspect;
pub mod layout;
pub mod llama;
pub mod loss;
pub mod rope;
pub mod testing;
pub mod weights;

pub use llama::Llama;
pub use weights::load_model_dir;

/// Model FLOPs per trained token: 6 N (matmuls, forward + backward) + 12 L C T (attention scores).
pub fn flops_per_token(n_params: usize, n_layers: usize, hidden: usize, seq_len: usize) -> f64 {
    6.0 * n_params as f64 + 12.0 * (n_layers * hidden * seq_len) as f64
}
