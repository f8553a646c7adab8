//! A device out of memory, named by the plan: which term of `harpe plan`'s memory model the failing phase
//! of the step allocates, and what the plan gave it.
//!
//! Why: by the time an allocation fails, candle's CUDA backend has already synchronised, trimmed the memory
//! pool and retried once (third_party/candle-core.patch), so what is left is a real shortage, and the raw
//! `CUDA_ERROR_OUT_OF_MEMORY` says nothing of what grew. The run checked its plan before it started
//! (train/launch.rs records the terms here); the phase that failed names the term to look at and the knob
//! that shrinks it.
use anyhow::Error;
use std::sync::Mutex;

/// The step's phases that allocate, and the plan term each one grows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// the stage's model and its weights (ZeRO-3: the gathered layer)
    Weights,
    /// a micro-batch's forward, recompute and backward
    Activations,
    /// the gradient reduction (buckets of the reduce-scatter / all-reduce)
    Reduction,
    /// AdamW on this rank's shard
    Optimizer,
}

impl Phase {
    /// (what the phase is, the plan's term, the knobs that shrink it)
    fn describe(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Phase::Weights => ("loading or gathering the weights", "weights", "a higher dist.zero_stage (3 shards the weights)"),
            Phase::Activations => (
                "a micro-batch's forward/backward",
                "working_set",
                "activation_checkpointing = \"every-layer\", a smaller micro_batch_size, dist.sp_degree > 1, or a shorter stage seq_len",
            ),
            Phase::Reduction => ("the gradient reduction", "comm_buckets", "a smaller dist.bucket_mb"),
            Phase::Optimizer => ("the optimizer step", "optimizer", "dist.zero_stage >= 1 (shards the AdamW state)"),
        }
    }
}

/// The plan's terms (name, bytes per rank) of this process's run, set once by the plan check.
static PLANNED: Mutex<Vec<(&'static str, u64)>> = Mutex::new(Vec::new());

/// Keep the plan's terms for naming a later out-of-memory error.
pub fn remember_plan(terms: &[(&'static str, u64)]) {
    *PLANNED.lock().unwrap_or_else(|p| p.into_inner()) = terms.to_vec();
}

/// Whether `e` is a device allocation that failed for lack of memory (the driver's code anywhere in its chain).
pub fn is_oom(e: &Error) -> bool {
    let text = format!("{e:#}");
    text.contains("CUDA_ERROR_OUT_OF_MEMORY") || text.contains("out of memory")
}

/// `e` with the phase and its plan term named when it is an out-of-memory error; any other error as it is.
pub fn name(e: Error, phase: Phase) -> Error {
    if !is_oom(&e) {
        return e;
    }
    let (what, term, knob) = phase.describe();
    let planned = PLANNED.lock().unwrap_or_else(|p| p.into_inner()).iter().find(|(n, _)| *n == term).map(|t| t.1);
    let planned = match planned {
        Some(b) => format!("the plan gave it {:.2} GiB per rank", b as f64 / (1u64 << 30) as f64),
        None => "the plan check recorded no such term for this run".to_string(),
    };
    e.context(format!(
        "the device ran out of memory during {what}, after the pool was trimmed and the allocation retried once: \
         the plan's term `{term}` grew beyond its share ({planned}; `harpe plan --config RUN.toml` lists every \
         term)\nhint: {knob}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_out_of_memory_error_names_the_phase_and_its_plan_term_and_others_pass_through() {
        remember_plan(&[("weights", 1 << 30), ("working_set", 3 << 30)]);
        let oom = anyhow::anyhow!("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")");
        let e = format!("{:#}", name(oom, Phase::Activations));
        assert!(e.contains("`working_set`") && e.contains("3.00 GiB") && e.contains("retried once"), "{e}");
        assert!(e.contains("activation_checkpointing") && e.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{e}");
        let e = format!("{:#}", name(anyhow::anyhow!("cuMemAllocAsync: out of memory"), Phase::Optimizer));
        assert!(e.contains("`optimizer`") && e.contains("recorded no such term"), "{e}");
        let other = format!("{:#}", name(anyhow::anyhow!("shape mismatch"), Phase::Activations));
        assert_eq!(other, "shape mismatch");
    }
}
