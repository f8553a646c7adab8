//! Shared helper of the op tests (and benches/attention_cpu.rs): deterministic pseudo-random tensors.
#![allow(dead_code)]
use candle_core::{Device, Tensor};

/// Deterministic pseudo-random f32 values in [-amp, amp) of `shape` on the CPU (an LCG from `seed`).
pub fn randn(shape: &[usize], seed: u64, amp: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0) * amp
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}
