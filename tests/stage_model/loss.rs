//! The chunked cross-entropy (`model::loss::chunked_cross_entropy`): its backward, dW and dh, against
//! finite differences of the loss in f64 (`common::ops::fd_check`, `Fd::F64`). Its forward and backward
//! against the slow reference and the plain-op path are the unit tests of src/model/loss.rs.
use crate::common::ops::{fd_check, fwd_bwd, projection, Fd};
use candle_core::{DType, Device, Tensor, D};
use harpe::model::loss::chunked_cross_entropy;
use harpe::ops::cross_entropy_chunk::IGNORE_INDEX;
use rand::{Rng, SeedableRng};

/// Hidden (n, c) and weight (v, c) uniform in [-1, 1), and targets with token 1 ignored.
fn setup(n: usize, c: usize, v: usize, seed: u64) -> (Tensor, Tensor, Tensor) {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut f = |k: usize| (0..k).map(|_| r.random::<f32>() * 2.0 - 1.0).collect::<Vec<_>>();
    let h = Tensor::from_vec(f(n * c), (n, c), &Device::Cpu).unwrap();
    let w = Tensor::from_vec(f(v * c), (v, c), &Device::Cpu).unwrap();
    let mut ys: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % v as u32).collect();
    ys[1] = IGNORE_INDEX;
    (h, w, Tensor::from_vec(ys, n, &Device::Cpu).unwrap())
}

#[test]
fn finite_differences_agree_with_backward() {
    let (n, c, v) = (5, 4, 7);
    let (h, w, t) = setup(n, c, v, 2);
    let g = fwd_bwd("chunked_cross_entropy", |x| chunked_cross_entropy(&x[0], &x[1], &t, 2), &[h.clone(), w.clone()]);
    let up = projection(g.out.shape(), DType::F64).to_vec1::<f64>().unwrap();
    // the counted tokens' nll times the projection, in f64 (log-softmax of the logits), so the quotient is
    // accurate
    let loss = |ht: &Tensor, wt: &Tensor| -> f64 {
        let (ht, wt) = (ht.to_dtype(DType::F64).unwrap(), wt.to_dtype(DType::F64).unwrap());
        let logits = ht.matmul(&wt.t().unwrap()).unwrap();
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap().to_vec2::<f64>().unwrap();
        let ys = t.to_vec1::<u32>().unwrap();
        ys.iter().enumerate().filter(|(_, &y)| y != IGNORE_INDEX).map(|(i, &y)| -logp[i][y as usize] * up[i]).sum()
    };
    fd_check("dw", &w, |wt| loss(&h, wt), &g.grads[1], Fd::F64);
    fd_check("dh", &h, |ht| loss(ht, &w), &g.grads[0], Fd::F64);
}
