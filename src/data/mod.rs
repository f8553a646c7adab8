//! Data: corpus -> tokens -> strategy -> packed shards -> training loader.
//!
//! `source` (readers) -> `tokenize` -> `mixture` (Fu et al. strategies) -> `pack` -> `shard` (format)
//! -> `loader` (what `train` calls). `prepare` (`prepare_args` its flags) and `inspect` are the two commands;
//! `spill` is `prepare`'s token spill.
//! The non-obvious decision: every random choice is a pure function of (seed, file, document) or
//! (seed, epoch), so preparation and loading are reproducible and resumable byte for byte.
//! What this module does not do: tokenization training, deduplication or quality filtering.
pub mod builtin;
pub mod inspect;
pub mod loader;
pub mod mixture;
pub mod pack;
pub mod prepare;
pub mod prepare_args;
pub mod shard;
pub mod source;
mod spill;
pub mod tokenize;

pub use builtin::builtin_texts;
pub use loader::{Cursor, Loader, LoaderConfig, Sequence, SourceSpan};
pub use prepare::{prepare, prepare_from_texts, PrepareOptions};
pub use shard::Manifest;
pub use tokenize::tokenizer_sha256;
