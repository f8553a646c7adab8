//! Evaluation: sliding-window perplexity, evaluation during training, KV-cached generation, needle-in-a-haystack
//! suites, and the harness's short-context benchmarks (`tasks`).
pub mod eval_loss;
pub mod generate;
pub mod heatmap;
pub mod needle_grid;
pub mod niah;
pub mod niah_io;
pub mod niah_report;
pub mod niah_run;
pub mod niah_sizing;
pub mod niah_words;
pub mod passkey;
pub mod ppl;
pub mod punkt;
pub mod pyrandom;
pub mod share;
pub mod tasks;
