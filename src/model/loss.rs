//! Chunked cross-entropy: per-token negative log-likelihood of `targets` under `hidden @ lm_head^T`,
//! computed `chunk` tokens at a time, with its own backward, so the (N x V) logits never exist at once.
//!
//! Reference: Liger-Kernel `fused_linear_cross_entropy`, Wijmans et al. "Cut Your Losses" (2024).
//! Forward per chunk of tokens: logits = h_c W^T (f32), lse = logsumexp(logits), nll = lse - logits[y].
//! Backward per chunk (upstream g (N) per token): dlogits = g * (softmax(logits) - onehot(y)),
//! dh_c = dlogits W, dW += dlogits^T h_c. Peak extra memory is one (chunk x V) f32 block plus dW.
//! The non-obvious decision: the op returns the per-token nll (N), not a scalar, so the loop can report
//! loss per data source and scale the sum by the number of target tokens of the whole optimizer step
//! (exact gradient accumulation). Targets equal to `IGNORE_INDEX` contribute 0 and get no gradient.
//! `chunked_nll` / `nll_rows` are the one NLL rule: eval-ppl calls them too (accumulating in f64).
//! The CPU path runs its GEMMs on chunks (the forward's logits through `ops::linear` on f32: MKL with
//! feature `mkl`; the backward's with candle's matmul), reading hidden and weight in place (the op's
//! node only carries the nll, so no copy of either is made). On CUDA the chunk's softmax part is the
//! fused kernel (kernels/cross_entropy.cu through `ops::cross_entropy_chunk`: nll forward, dlogits
//! backward) between the same cuBLAS matmuls; on the CPU the same ops' vectorised row loops; the logits
//! are f32 on both paths. `chunked_cross_entropy_with(.., fused)` picks the path explicitly (tests run
//! the fused path against the plain ops).
//! Not done here: z-loss, label smoothing.
use crate::ops::cross_entropy_chunk::IGNORE_INDEX;
use crate::ops::cross_entropy_chunk::{ce_chunk_dlogits, ce_chunk_nll};
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, D};

/// The loss's autograd node: input 0 is the nll (N) already computed from the detached hidden and weight
/// (`chunked_nll`, the GEMMs reading the tensors in place), inputs 1, 2 are hidden and weight, so
/// the backward gets them as tensors; the forward only passes the nll through (N floats).
struct ChunkedCe {
    chunk: usize,
    targets: Tensor,
    /// the chunk's softmax part by the fused ops (`ops::cross_entropy_chunk`), else by plain candle ops
    fused: bool,
}

/// Targets with ignored entries replaced by 0 (for gather) and the 0/1 validity mask, both (n, 1),
/// from device ops (compare with IGNORE_INDEX, `where_cond`): no device-to-host read per chunk.
fn targets_and_mask(t: &Tensor) -> Result<(Tensor, Tensor)> {
    let n = t.dims1()?;
    let dev = t.device();
    let keep = t.ne(&Tensor::full(IGNORE_INDEX, n, dev)?)?; // (n) u8, 1 where the target counts
    let idx = keep.where_cond(t, &Tensor::zeros(n, DType::U32, dev)?)?.reshape((n, 1))?; // (n, 1) u32
    let mask = keep.to_dtype(DType::F32)?.reshape((n, 1))?; // (n, 1) f32
    Ok((idx, mask))
}

/// Check sizes: hidden (N, C), weight (V, C), targets (N); returns (N, C, V).
fn check_shapes(h: &Tensor, w: &Tensor, t: &Tensor) -> Result<(usize, usize, usize)> {
    let (n, c) = h.dims2()?;
    let (v, c2) = w.dims2()?;
    let n2 = t.dims1()?;
    if c != c2 || n != n2 {
        candle_core::bail!(
            "chunked cross-entropy: hidden {:?}, weight {:?}, targets {:?} do not fit (N,C) (V,C) (N)",
            h.dims(),
            w.dims(),
            t.dims()
        );
    }
    Ok((n, c, v))
}

/// Every target below `v` or ignored — checked only where it is free, targets in host memory. On a GPU
/// reading them back would stall the stream once per micro-batch, so there the ids are checked where
/// they are still host data (`train::batch_tensors`), and the fused kernel (kernels/cross_entropy.cu)
/// writes NaN for a target >= V as the backstop (the loop's non-finite guard then skips the step).
fn check_target_ids(t: &Tensor, v: usize) -> Result<()> {
    if !t.device().is_cpu() {
        return Ok(());
    }
    if let Some(bad) = t.to_vec1::<u32>()?.into_iter().find(|&y| y != IGNORE_INDEX && y as usize >= v) {
        candle_core::bail!("chunked cross-entropy: target id {bad} is outside the vocabulary of {v}");
    }
    Ok(())
}

/// Row-wise logsumexp of f32 logits (n, V) -> (n, 1), accumulated in `acc` (f32 for training, f64 for
/// eval-ppl): max in f32, then ln(sum(exp(x - max))) + max.
pub fn logsumexp_rows(logits: &Tensor, acc: DType) -> Result<Tensor> {
    let m = logits.max_keepdim(D::Minus1)?; // (n, 1)
    logits.broadcast_sub(&m)?.to_dtype(acc)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m.to_dtype(acc)?
}

/// The one NLL rule: logsumexp(logits) - logits[target] per row, logits (n, V) f32, idx (n, 1) u32
/// -> (n, 1) in `acc`.
pub fn nll_rows(logits: &Tensor, idx: &Tensor, acc: DType) -> Result<Tensor> {
    logsumexp_rows(logits, acc)? - logits.gather(idx, 1)?.to_dtype(acc)?
}

/// The one chunked NLL (used by the training loss and eval-ppl): rows 0..n, `chunk` at a time,
/// `logits_of(start, len)` making that chunk's (len, V) f32 logits; targets (n) u32, rows whose target is
/// `IGNORE_INDEX` give 0. Returns (n) in `acc`; only one (chunk x V) block exists at a time.
pub fn chunked_nll(
    targets: &Tensor,
    chunk: usize,
    acc: DType,
    mut logits_of: impl FnMut(usize, usize) -> Result<Tensor>,
) -> Result<Tensor> {
    let n = targets.dims1()?;
    let chunk = chunk.max(1);
    let mut parts = Vec::with_capacity(n.div_ceil(chunk));
    for start in (0..n).step_by(chunk) {
        let len = chunk.min(n - start);
        let (idx, mask) = targets_and_mask(&targets.narrow(0, start, len)?)?;
        let nll = nll_rows(&logits_of(start, len)?, &idx, acc)?; // (len, 1)
        parts.push((nll * mask.to_dtype(acc)?)?);
    }
    if parts.is_empty() {
        return Tensor::zeros(0, acc, targets.device());
    }
    Tensor::cat(&parts, 0)?.flatten_all()
}

/// Logits of one chunk in f32 and their logsumexp: (n, V), (n, 1).
fn chunk_logits(h: &Tensor, w_t: &Tensor) -> Result<(Tensor, Tensor)> {
    let logits = h.matmul(w_t)?.to_dtype(DType::F32)?; // (n, V)
    let lse = logsumexp_rows(&logits, DType::F32)?; // (n, 1)
    Ok((logits, lse))
}

impl CustomOp3 for ChunkedCe {
    fn name(&self) -> &'static str {
        "harpe-chunked-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
        _s3: &CpuStorage,
        _l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let nll = match (s1, l1.contiguous_offsets()) {
            (CpuStorage::F32(v), Some((a, b))) => v[a..b].to_vec(),
            _ => candle_core::bail!("chunked cross-entropy: the nll must be contiguous f32"),
        };
        Ok((CpuStorage::F32(nll), l1.shape().clone()))
    }

    /// On CUDA the same pass-through: a device copy of the nll (computed by the fused chunk kernel).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        _s2: &candle_core::CudaStorage,
        _l2: &Layout,
        _s3: &candle_core::CudaStorage,
        _l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        match (s1.dtype(), l1.contiguous_offsets()) {
            // try_clone copies the whole storage: right when the nll starts at offset 0 (it is fresh)
            (DType::F32, Some((0, _))) => Ok((s1.try_clone(l1)?, l1.shape().clone())),
            _ => candle_core::bail!("chunked cross-entropy: the nll must be contiguous f32 from offset 0"),
        }
    }

    fn bwd(
        &self,
        _nll: &Tensor,
        hidden: &Tensor,
        weight: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // TODO(why): the backward keeps candle's matmuls because a CPU backward on `linear_bwd_cpu` made a
        // 25.6M-parameter run's resident memory grow 785 -> 985-1054 MB over its first 7-11 steps (each growing
        // step at half speed, on first touch of its pages), where this one stays at 790 MB; the cause is unknown.
        let (h, w, t) = (hidden.detach(), weight.detach(), self.targets.clone());
        let (n, c, v) = check_shapes(&h, &w, &t)?; // the ids were checked in the forward
        let g = grad.detach().to_dtype(DType::F32)?.reshape((n, 1))?; // (N, 1)
        let w32 = w.to_dtype(DType::F32)?; // (V, C)
        let w_t = w.t()?; // (C, V)
                          // dh is written chunk by chunk into its one buffer: chunks and their concatenation would be alive
                          // together (2 x N x C f32 at the peak of the loss backward)
        let dh = Tensor::zeros((n, c), hidden.dtype(), h.device())?; // (N, C)
        let mut dw = Tensor::zeros((v, c), DType::F32, h.device())?; // (V, C)
        for start in (0..n).step_by(self.chunk) {
            let len = self.chunk.min(n - start);
            let hc = h.narrow(0, start, len)?; // (n, C)
            let tc = t.narrow(0, start, len)?;
            let dlogits = if self.fused {
                let logits = hc.matmul(&w_t)?.to_dtype(DType::F32)?; // (n, V)
                ce_chunk_dlogits(&logits, &tc, &g.narrow(0, start, len)?.flatten_all()?)?
            // (n, V), 0 if ignored
            } else {
                let (idx, mask) = targets_and_mask(&tc)?;
                let gc = (g.narrow(0, start, len)? * mask)?; // (n, 1)
                let (logits, lse) = chunk_logits(&hc, &w_t)?;
                let p = logits.broadcast_sub(&lse)?.exp()?; // softmax (n, V)
                p.broadcast_mul(&gc)?.scatter_add(&idx, &gc.neg()?, 1)? // (n, V)
            };
            dh.slice_set(&dlogits.matmul(&w32)?.to_dtype(hidden.dtype())?, 0, start)?; // (n, C)
            dw = (dw + dlogits.t()?.matmul(&hc.to_dtype(DType::F32)?)?)?;
        }
        Ok((None, Some(dh), Some(dw.to_dtype(weight.dtype())?)))
    }
}

/// Per-token nll (N) f32 of hidden (N, C) under lm-head weight (V, C), `chunk` tokens at a time;
/// differentiable in `hidden` and `weight`. The chunk's softmax part is fused on every device: the CUDA
/// kernels, on the CPU the vectorised row loops (`ops::cross_entropy_chunk::ce_rows_f32`). The plain-op
/// path (`chunked_cross_entropy_with(.., false)`) is the readable twin the tests compare against; on the
/// CPU it made ~12 passes over each (chunk x V) block (max, subtract, exp with libm's scalar `expf`, sum,
/// log, gather, scatter_add, ...): ~10% of a training step of a 0.5M-parameter model (vocab 259) in `perf`.
pub fn chunked_cross_entropy(hidden: &Tensor, weight: &Tensor, targets: &Tensor, chunk: usize) -> Result<Tensor> {
    chunked_cross_entropy_with(hidden, weight, targets, chunk, true)
}

/// `chunked_cross_entropy` with the chunk's softmax part by the fused ops (`fused`: the CUDA kernels on
/// CUDA, their CPU reference loops on CPU) or by plain candle ops (`chunked_nll`, the one NLL rule).
pub fn chunked_cross_entropy_with(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    chunk: usize,
    fused: bool,
) -> Result<Tensor> {
    let chunk = chunk.max(1);
    let (h, w) = (hidden.contiguous()?, weight.contiguous()?);
    let targets = targets.contiguous()?.detach();
    let (hd, wd) = (h.detach(), w.detach());
    let (n, _, v) = check_shapes(&hd, &wd, &targets)?;
    check_target_ids(&targets, v)?; // on the CPU only: see there
    let logits_of = |start: usize, len: usize| {
        let hc = hd.narrow(0, start, len)?; // -> (len, V) logits; the plain-op twin keeps candle's matmul
        match fused {
            true => crate::ops::linear::linear_any(&hc, &wd)?.to_dtype(DType::F32),
            false => hc.matmul(&wd.t()?)?.to_dtype(DType::F32),
        }
    };
    let nll = if fused {
        let parts = (0..n)
            .step_by(chunk)
            .map(|start| {
                let len = chunk.min(n - start);
                ce_chunk_nll(&logits_of(start, len)?, &targets.narrow(0, start, len)?)
                // (len), 0 if ignored
            })
            .collect::<Result<Vec<_>>>()?;
        if parts.is_empty() {
            Tensor::zeros(0, DType::F32, hd.device())?
        } else {
            Tensor::cat(&parts, 0)?
        }
    } else {
        chunked_nll(&targets, chunk, DType::F32, logits_of)?
    }; // (N), outside the graph
    nll.apply_op3(&h, &w, ChunkedCe { chunk, targets, fused })
}

/// The same per-token nll from plain candle ops with the full (N, V) logits (tests, tiny shapes).
pub fn cross_entropy_slow(hidden: &Tensor, weight: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = hidden.matmul(&weight.t()?)?.to_dtype(DType::F32)?; // (N, V)
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let (idx, mask) = targets_and_mask(targets)?;
    (logp.gather(&idx, 1)?.neg()? * mask)?.flatten_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::backprop::GradStore;
    use candle_core::{Device, Var};

    fn setup(n: usize, c: usize, v: usize, seed: u64) -> (Var, Var, Tensor) {
        use rand::{Rng, SeedableRng};
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut f = |k: usize| (0..k).map(|_| r.random::<f32>() * 2.0 - 1.0).collect::<Vec<_>>();
        let h = Var::from_vec(f(n * c), (n, c), &Device::Cpu).unwrap();
        let w = Var::from_vec(f(v * c), (v, c), &Device::Cpu).unwrap();
        let mut ys: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % v as u32).collect();
        ys[1] = IGNORE_INDEX;
        (h, w, Tensor::from_vec(ys, n, &Device::Cpu).unwrap())
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    /// The gradients in each var of sum(nll ⊙ up) for nll `a` and its reference `b` agree within 1e-5, and
    /// the reference's are not all zero; returns `a`'s gradients.
    fn assert_same_grads(a: Tensor, b: Tensor, up: &Tensor, vars: [&Var; 2], what: &str) -> GradStore {
        let ga = (a * up).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (b * up).unwrap().sum_all().unwrap().backward().unwrap();
        for var in vars {
            let (x, y) = (ga.get(var.as_tensor()).unwrap(), gb.get(var.as_tensor()).unwrap());
            assert!(max_abs_diff(x, y) < 1e-5, "{what}: {}", max_abs_diff(x, y));
            assert!(y.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0, "{what}: zero gradient");
        }
        ga
    }

    #[test]
    fn forward_and_backward_match_the_slow_reference() {
        let (n, c, v) = (13, 8, 11);
        let (h, w, t) = setup(n, c, v, 1);
        // random upstream gradient per token, so every row of the backward is exercised differently
        let up = Tensor::from_vec((0..n).map(|i| 0.1 + i as f32 * 0.05).collect::<Vec<_>>(), n, &Device::Cpu).unwrap();
        let fast = chunked_cross_entropy(&h, &w, &t, 4).unwrap();
        let slow = cross_entropy_slow(&h, &w, &t).unwrap();
        assert!(max_abs_diff(&fast, &slow) < 1e-5);
        assert_eq!(fast.to_vec1::<f32>().unwrap()[1], 0.0);
        let gf = assert_same_grads(fast, slow, &up, [&h, &w], "slow reference");
        // the ignored token's hidden row gets no gradient
        let dh1 = gf.get(h.as_tensor()).unwrap().get(1).unwrap().abs().unwrap().sum_all().unwrap();
        assert_eq!(dh1.to_scalar::<f32>().unwrap(), 0.0);
    }

    /// The fused path (on the CPU the CE chunk ops' vectorised row loops, the default; the
    /// CUDA kernels' twin; on CPU f32 its forward GEMM is `ops::linear`'s) gives the plain-op path's nll and
    /// gradients: small chunks with a ragged last one, and chunks of 40 rows over a vocabulary of 70 (the
    /// GEMMs split into one band per thread).
    #[test]
    fn fused_chunk_path_matches_the_plain_op_path() {
        for (n, c, v, chunk, seed) in [(11, 6, 13, 4, 4), (90, 24, 70, 40, 6)] {
            let (h, w, t) = setup(n, c, v, seed);
            let up = Tensor::from_vec((0..n).map(|i| 0.3 - (i % 9) as f32 * 0.07).collect::<Vec<_>>(), n, &Device::Cpu)
                .unwrap();
            let a = chunked_cross_entropy_with(&h, &w, &t, chunk, true).unwrap();
            let b = chunked_cross_entropy_with(&h, &w, &t, chunk, false).unwrap();
            assert!(max_abs_diff(&a, &b) < 1e-5, "{}", max_abs_diff(&a, &b));
            assert_eq!(a.to_vec1::<f32>().unwrap()[1], 0.0, "the ignored token");
            assert_same_grads(a, b, &up, [&h, &w], &format!("plain ops, n {n}"));
        }
        let bad = Tensor::from_vec(vec![0u32, 99, 1], 3, &Device::Cpu).unwrap();
        let (h3, w3, _) = setup(3, 6, 13, 5);
        assert!(chunked_cross_entropy_with(&h3, &w3, &bad, 2, true).unwrap_err().to_string().contains("target id 99"));
    }

    /// The host loops `targets_and_mask` replaced (one device-to-host read per chunk): the reference.
    fn targets_and_mask_host(t: &Tensor) -> (Vec<u32>, Vec<f32>) {
        let ys = t.to_vec1::<u32>().unwrap();
        let idx = ys.iter().map(|&y| if y == IGNORE_INDEX { 0 } else { y }).collect();
        let mask = ys.iter().map(|&y| if y == IGNORE_INDEX { 0.0 } else { 1.0 }).collect();
        (idx, mask)
    }

    /// The device-op `targets_and_mask` gives the host version's index and mask exactly, on ragged
    /// lengths with ignored entries anywhere (first, last, runs) and on narrowed (offset) chunks.
    #[test]
    fn device_targets_and_mask_equal_the_host_version() {
        let ig = IGNORE_INDEX;
        let all: Vec<u32> = vec![ig, 5, 0, 31999, ig, ig, 7, 1, ig, 2, 3, 4, 65535, ig, 9, 10, 11];
        let t = Tensor::from_vec(all.clone(), all.len(), &Device::Cpu).unwrap();
        for (start, len) in [(0, all.len()), (0, 1), (1, 1), (3, 7), (4, 2), (5, 12), (16, 1), (0, 0)] {
            let tc = t.narrow(0, start, len).unwrap();
            let (idx, mask) = targets_and_mask(&tc).unwrap();
            assert_eq!((idx.dims(), mask.dims()), ([len, 1].as_slice(), [len, 1].as_slice()));
            assert_eq!((idx.dtype(), mask.dtype()), (DType::U32, DType::F32));
            let got = (
                idx.flatten_all().unwrap().to_vec1::<u32>().unwrap(),
                mask.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert_eq!(got, targets_and_mask_host(&tc), "chunk {start}+{len}");
        }
    }

    #[test]
    fn bad_target_is_an_error() {
        let (h, w, _) = setup(3, 4, 5, 3);
        let t = Tensor::from_vec(vec![0u32, 9, 1], 3, &Device::Cpu).unwrap();
        let e = chunked_cross_entropy(&h, &w, &t, 2).unwrap_err().to_string();
        assert!(e.contains("target id 9"), "{e}");
    }
}
