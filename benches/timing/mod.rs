//! Timing helper shared by the hand-rolled benches (`harness = false`).
use std::time::Instant;

/// Median seconds of `reps` calls of `f` after one warm-up call.
pub fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(|a, b| a.total_cmp(b));
    t[t.len() / 2]
}
