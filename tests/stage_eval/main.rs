//! Evaluation: perplexity windows, loss by position, RULER NIAH generators and scoring, Punkt, CPython random, lm-evaluation-harness tasks, generate and the eval CLIs.
//!
//! One test binary per stage: as one binary per file, every file would link the whole crate; grouped,
//! the suite builds a handful of binaries. The shared helpers are in tests/common (what each holds: its
//! mod.rs; where a new test goes: docs/ARCHITECTURE.md).
#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod eval_loss;
mod eval_tasks;
mod niah_bos;
mod niah_budget;
mod niah_e2e;
mod niah_generators;
mod niah_pyrandom;
mod niah_scoring;
mod ppl_windows;
mod punkt;
mod cli_eval_loss;
mod cli_eval_ppl;
mod cli_attention;
mod cli_generate;
