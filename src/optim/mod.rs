//! Optimizer and learning-rate schedules. AdamW works on this rank's shard (`comms::zero::ShardMap`) of
//! the flat fp32 training state (`FlatBuf`s).
pub mod adamw;
pub mod schedule;
