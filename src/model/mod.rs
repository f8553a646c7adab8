//! The model: HF config, Llama weights and forward, RoPE schemes.
//!
//! Shape legend used in comments throughout: B batch, T tokens, C hidden, H heads, Hkv kv heads,
//! D head dim, V vocab, L layers, I intermediate (MLP) size.
pub mod attention;
pub mod base_plot;
pub mod base_search;
pub mod config;
pub mod inspect;
pub mod llama;
pub mod rope;
pub mod testing;
pub mod weights;

pub use llama::Llama;
pub use weights::load_model_dir;

use anyhow::{anyhow, Result};
use std::path::Path;

/// Load a `tokenizer.json` (a file, or a directory holding one) with a clear error.
pub fn load_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer> {
    let file = if path.is_dir() { path.join("tokenizer.json") } else { path.to_path_buf() };
    if !file.exists() {
        return Err(anyhow!(
            "{}: tokenizer.json not found\nhint: copy the model's tokenizer.json into the directory or pass --tokenizer FILE",
            file.display()
        ));
    }
    tokenizers::Tokenizer::from_file(&file).map_err(|e| {
        anyhow!("{}: cannot load tokenizer: {e}\nhint: harpe reads HF `tokenizers` JSON files", file.display())
    })
}
