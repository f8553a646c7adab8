//! The research workflow on top of `harpe train` and the evaluations: `harpe sweep` runs many
//! configurations x seeds and evaluates them; `harpe report` turns them into one table with confidence
//! intervals and plots.
pub mod bases;
pub mod report;
pub mod stats;
pub mod sweep;
