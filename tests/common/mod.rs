//! Shared text of the integration tests (`#[macro_use] mod common;`).

/// The tiny model every `harpe train` test recipe starts with: a 2-layer, 32-wide byte-level Llama
/// on the built-in data, plain RoPE, f32, ending inside `[train]` so a recipe goes on with its own
/// `[train]` keys: `concat!(tiny_model!(), "micro_batch_size = 4\n...")`.
macro_rules! tiny_model {
    () => {
        r#"
[model.init]
vocab_size = 259
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2

[data]
source = "builtin"

[rope]
scheme = "default"
theta = 10000.0

[train]
dtype = "f32"
"#
    };
}
