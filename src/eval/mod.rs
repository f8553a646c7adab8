//! Evaluation: sliding-window perplexity, KV-cached generation, needle-in-a-haystack suites.
pub mod generate;
pub mod ppl;
