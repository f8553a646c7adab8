//! Optimizer and learning-rate schedules. AdamW works on this rank's slice of the flat fp32 vectors.
pub mod adamw;
pub mod schedule;
