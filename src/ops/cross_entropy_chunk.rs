//! The fused per-chunk part of the chunked cross-entropy as ops: `ce_chunk_nll` (logits, targets) -> nll
//! and `ce_chunk_dlogits` (logits, targets, g) -> dlogits, with a CPU reference (readable row loops) and
//! a CUDA launch of kernels/cross_entropy.cu, so `loss.rs` can run the same chunk loop on either device.
//!
//! Reference: `model::loss::chunked_cross_entropy` (its chunk math: lse = logsumexp(l), nll = lse - l[y],
//! dl = g (softmax(l) - onehot(y)), IGNORE_INDEX rows give 0 and no gradient); Liger-Kernel.
//! The non-obvious decision: the ops take the chunk's logits as produced by the matmul (f32 or bf16,
//! (n, V)), so the lm-head matmuls stay on cuBLAS through candle and only the softmax part is fused:
//! forward = matmul + `ce_chunk_nll`; backward = matmul again + `ce_chunk_dlogits` + two matmuls.
//! Both ops are leaves for autograd (the caller's CustomOp owns the backward, as in loss.rs).
//! Does not: the matmuls, the chunk loop or the target range check against V (a kernel cannot return
//! an error: training checks ids when it builds the batch, `train::batch_tensors`; `check_targets` is
//! the host check for callers with their own targets, e.g. selftest; an unchecked target >= V gives NaN).
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use half::bf16;

/// Target value that is skipped (no loss, no gradient); `model::loss` skips the same value.
pub const IGNORE_INDEX: u32 = u32::MAX;

/// Per-row nll, lse and (with `g`) dlogits of logits (n, V) — the reference loops (f32 arithmetic).
pub fn ce_rows_cpu<T: Copy>(
    logits: &[T],
    targets: &[u32],
    g: Option<&[f32]>,
    v: usize,
    to_f32: impl Fn(T) -> f32,
    from_f32: impl Fn(f32) -> T,
) -> (Vec<f32>, Vec<f32>, Option<Vec<T>>) {
    let n = targets.len();
    let (mut nll, mut lse) = (vec![0f32; n], vec![0f32; n]);
    let mut dl = g.map(|_| Vec::with_capacity(n * v));
    for i in 0..n {
        let row: Vec<f32> = logits[i * v..(i + 1) * v].iter().map(|&x| to_f32(x)).collect();
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let l = row.iter().map(|&x| (x - m).exp()).sum::<f32>().ln() + m;
        let y = targets[i];
        let ignored = y == IGNORE_INDEX;
        lse[i] = l;
        nll[i] = if ignored { 0.0 } else { row.get(y as usize).map_or(f32::NAN, |&ly| l - ly) };
        if let (Some(d), Some(g)) = (dl.as_mut(), g) {
            let gi = if ignored { 0.0 } else { g[i] };
            d.extend(
                row.iter()
                    .enumerate()
                    .map(|(j, &x)| from_f32(gi * ((x - l).exp() - if j as u32 == y { 1.0 } else { 0.0 }))),
            );
        }
    }
    (nll, lse, dl)
}

/// `ce_rows_cpu` for f32 logits, the CPU fast path: rows in parallel on rayon, max and exp with
/// `cpu_vec`'s vectorised loops (libm's scalar `expf` was ~4% of a small training step), one exp pass per
/// row: with dlogits, e^(x - m) is written into the row's dlogits and scaled by g / sum (= g e^(x - lse)).
/// Same results as the reference up to the exp approximation and summation order (tests below).
pub fn ce_rows_f32(
    logits: &[f32],
    targets: &[u32],
    g: Option<&[f32]>,
    v: usize,
) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    use crate::ops::cpu_vec::{exp_sub_sum, max as vmax, scale_in_place};
    use rayon::prelude::*;
    let n = targets.len();
    let (mut nll, mut lse) = (vec![0f32; n], vec![0f32; n]);
    // one row: (nll, lse), its e^(x - m) left in `e`
    let row_stats = |i: usize, e: &mut [f32]| {
        let row = &logits[i * v..(i + 1) * v];
        let m = vmax(row);
        e.copy_from_slice(row);
        let sum = exp_sub_sum(e, m);
        let l = sum.ln() + m;
        let y = targets[i];
        let nll = if y == IGNORE_INDEX { 0.0 } else { row.get(y as usize).map_or(f32::NAN, |&ly| l - ly) };
        (nll, l, sum)
    };
    let rows = nll.par_iter_mut().zip(lse.par_iter_mut()).enumerate();
    let dl = match g {
        None => {
            rows.for_each_init(
                || vec![0f32; v],
                |e, (i, (nll_i, lse_i))| {
                    let (a, b, _) = row_stats(i, e);
                    (*nll_i, *lse_i) = (a, b);
                },
            );
            None
        }
        Some(g) => {
            // SAFETY: each row's chunk below is first the row's logits (copy_from_slice), then scaled.
            let mut dl = unsafe { crate::ops::for_overwrite(n * v) };
            rows.zip(dl.par_chunks_mut(v.max(1))).for_each(|((i, (nll_i, lse_i)), d)| {
                let (a, b, sum) = row_stats(i, d);
                (*nll_i, *lse_i) = (a, b);
                let y = targets[i];
                let gi = if y == IGNORE_INDEX { 0.0 } else { g[i] };
                scale_in_place(d, gi / sum);
                if let Some(dy) = d.get_mut(y as usize) {
                    *dy -= gi;
                }
            });
            Some(dl)
        }
    };
    (nll, lse, dl)
}

/// Every target is below `v` or IGNORE_INDEX; else an error naming the first bad one.
pub fn check_targets(targets: &Tensor, v: usize) -> Result<()> {
    let ys = targets.to_device(&candle_core::Device::Cpu)?.to_vec1::<u32>()?;
    if let Some((i, y)) = ys.iter().enumerate().find(|(_, &y)| y != IGNORE_INDEX && y as usize >= v) {
        candle_core::bail!("cross-entropy: target {i} is id {y}, outside the vocabulary of {v}");
    }
    Ok(())
}

fn dims(ll: &Layout, lt: &Layout) -> Result<(usize, usize)> {
    let (n, v) = ll.shape().dims2()?;
    let nt = lt.shape().dims1()?;
    if n != nt {
        candle_core::bail!("cross-entropy chunk: logits {:?} and targets {:?} differ in rows", ll.shape(), lt.shape());
    }
    Ok((n, v))
}

fn slice<'a, T>(v: &'a [T], l: &Layout, arg: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("cross-entropy chunk: `{arg}` must be contiguous"),
    }
}

struct CeNll;

impl CustomOp2 for CeNll {
    fn name(&self) -> &'static str {
        "harpe-ce-chunk-nll"
    }

    fn cpu_fwd(&self, sl: &CpuStorage, ll: &Layout, st: &CpuStorage, lt: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v) = dims(ll, lt)?;
        let CpuStorage::U32(t) = st else { candle_core::bail!("cross-entropy chunk: targets must be u32") };
        let t = slice(t, lt, "targets")?;
        let nll = match sl {
            CpuStorage::F32(l) => ce_rows_f32(slice(l, ll, "logits")?, t, None, v).0,
            CpuStorage::BF16(l) => ce_rows_cpu(slice(l, ll, "logits")?, t, None, v, bf16::to_f32, bf16::from_f32).0,
            _ => candle_core::bail!("cross-entropy chunk: logits must be f32 or bf16"),
        };
        Ok((CpuStorage::F32(nll), Shape::from_dims(&[n])))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sl: &candle_core::CudaStorage,
        ll: &Layout,
        st: &candle_core::CudaStorage,
        lt: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::launch(sl, ll, st, lt, None)
    }
}

struct CeDlogits;

impl CustomOp3 for CeDlogits {
    fn name(&self) -> &'static str {
        "harpe-ce-chunk-dlogits"
    }

    fn cpu_fwd(
        &self,
        sl: &CpuStorage,
        ll: &Layout,
        st: &CpuStorage,
        lt: &Layout,
        sg: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, v) = dims(ll, lt)?;
        let CpuStorage::U32(t) = st else { candle_core::bail!("cross-entropy chunk: targets must be u32") };
        let CpuStorage::F32(g) = sg else { candle_core::bail!("cross-entropy chunk: g must be f32") };
        let (t, g) = (slice(t, lt, "targets")?, slice(g, lg, "g")?);
        if g.len() != n {
            candle_core::bail!("cross-entropy chunk: g has {} entries for {n} rows", g.len());
        }
        let out = match sl {
            CpuStorage::F32(l) => ce_rows_f32(slice(l, ll, "logits")?, t, Some(g), v).2.map(CpuStorage::F32),
            CpuStorage::BF16(l) => ce_rows_cpu(slice(l, ll, "logits")?, t, Some(g), v, bf16::to_f32, bf16::from_f32)
                .2
                .map(CpuStorage::BF16),
            _ => candle_core::bail!("cross-entropy chunk: logits must be f32 or bf16"),
        };
        let out = out.ok_or_else(|| candle_core::Error::Msg("cross-entropy chunk: no dlogits".into()))?;
        Ok((out, Shape::from_dims(&[n, v])))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sl: &candle_core::CudaStorage,
        ll: &Layout,
        st: &candle_core::CudaStorage,
        lt: &Layout,
        sg: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::launch(sl, ll, st, lt, Some((sg, lg)))
    }
}

/// Per-token nll (n) f32 of one chunk of logits (n, V) f32/bf16 and targets (n) u32. It has no backward
/// of its own (the caller's op owns it): a gradient reaching it is an error, never a silent stop.
/// Targets must be below V or IGNORE_INDEX (checked by the caller; a bad one gives NaN).
pub fn ce_chunk_nll(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits.contiguous()?.apply_op2(&targets.contiguous()?, CeNll)
}

/// dlogits (n, V) in the logits' dtype: g (softmax(logits) - onehot(targets)), 0 on ignored rows.
pub fn ce_chunk_dlogits(logits: &Tensor, targets: &Tensor, g: &Tensor) -> Result<Tensor> {
    logits.contiguous()?.apply_op3(&targets.contiguous()?, &g.contiguous()?, CeDlogits)
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::dims;
    use crate::ops::cuda::{cfg, dtype_suffix, load_func, same_device, u32_arg, view, BLOCK, CROSS_ENTROPY, MAX_GRID};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, DType, Layout, Result, Shape};
    use half::bf16;

    /// nll (n) when `g` is None, else dlogits (n, V).
    pub fn launch(
        sl: &CudaStorage,
        ll: &Layout,
        st: &CudaStorage,
        lt: &Layout,
        g: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        const OP: &str = "cross-entropy chunk";
        let sfx = dtype_suffix(sl.dtype(), OP, "logits")?;
        same_device(sl, st, OP)?;
        if st.dtype() != DType::U32 {
            candle_core::bail!("{OP}: targets are {:?}, expected u32", st.dtype());
        }
        let (n, v) = dims(ll, lt)?;
        let (n32, v32) = (u32_arg(n, OP, "rows")?, u32_arg(v, OP, "V")?);
        let dev = sl.device();
        let func = load_func(dev, &format!("cross_entropy_{sfx}"), &CROSS_ENTROPY)?;
        let t = view::<u32>(st, lt, OP, "targets")?;
        let nll = dev.alloc_zeros::<f32>(n)?;
        let null = 0u64;
        let grid = n32.clamp(1, MAX_GRID);
        macro_rules! go {
            ($t:ty) => {{
                let l = view::<$t>(sl, ll, OP, "logits")?;
                match g {
                    None => {
                        let mut b = func.builder();
                        b.arg(&l).arg(&t).arg(&null).arg(&nll).arg(&null).arg(&null).arg(&n32).arg(&v32);
                        // SAFETY: logits n*V, targets and nll n; gout, lse, dlogits null.
                        unsafe { b.launch(cfg(grid, BLOCK)) }.w()?;
                        (CudaStorage::wrap_cuda_slice(nll, dev.clone()), Shape::from_dims(&[n]))
                    }
                    Some((sg, lg)) => {
                        same_device(sl, sg, OP)?;
                        if sg.dtype() != DType::F32 || lg.shape().elem_count() != n {
                            candle_core::bail!(
                                "{OP}: g must be f32 with {n} entries, got {:?} {:?}",
                                sg.dtype(),
                                lg.shape()
                            );
                        }
                        let gv = view::<f32>(sg, lg, OP, "g")?;
                        // SAFETY: written in full by the kernel.
                        let dl = unsafe { dev.alloc::<$t>(n * v)? };
                        let mut b = func.builder();
                        b.arg(&l).arg(&t).arg(&gv).arg(&nll).arg(&null).arg(&dl).arg(&n32).arg(&v32);
                        // SAFETY: logits, dl n*V; targets, g, nll n; lse null.
                        unsafe { b.launch(cfg(grid, BLOCK)) }.w()?;
                        (CudaStorage::wrap_cuda_slice(dl, dev.clone()), Shape::from_dims(&[n, v]))
                    }
                }
            }};
        }
        Ok(if sl.dtype() == DType::BF16 { go!(bf16) } else { go!(f32) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast f32 rows against the reference loops: nll, lse and dlogits, with an ignored row, a target
    /// outside the vocabulary (NaN nll, no one-hot), large logits and a vocabulary that is not a multiple
    /// of the vector width; on several thread counts.
    #[test]
    fn fast_rows_match_the_reference_loops() {
        let (n, v) = (37, 259);
        let mut state = 12345u64;
        let mut rnd = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let mut logits: Vec<f32> = (0..n * v).map(|_| 4.0 * rnd()).collect();
        logits[5 * v..6 * v].iter_mut().for_each(|x| *x *= 30.0); // logits up to ~120
        let mut targets: Vec<u32> = (0..n as u32).map(|i| (i * 97) % v as u32).collect();
        targets[3] = IGNORE_INDEX;
        targets[8] = v as u32 + 4;
        let g: Vec<f32> = (0..n).map(|_| rnd()).collect();
        let (nll_r, lse_r, dl_r) = ce_rows_cpu(&logits, &targets, Some(&g), v, |x| x, |x| x);
        let dl_r = dl_r.unwrap();
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let (nll, lse, dl) = pool.install(|| ce_rows_f32(&logits, &targets, Some(&g), v));
            let (nll_only, lse_only, none) = pool.install(|| ce_rows_f32(&logits, &targets, None, v));
            assert!(none.is_none());
            let dl = dl.unwrap();
            for i in 0..n {
                for (name, a, b) in
                    [("nll", nll[i], nll_r[i]), ("lse", lse[i], lse_r[i]), ("nll_only", nll_only[i], nll_r[i])]
                {
                    if i == 8 && name != "lse" {
                        assert!(a.is_nan() && b.is_nan(), "row 8 (target outside V): {name} {a} {b}");
                        continue;
                    }
                    assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{threads} threads row {i}: {name} {a} vs {b}");
                }
                assert_eq!(lse_only[i].to_bits(), lse[i].to_bits(), "row {i}: lse with and without dlogits");
            }
            assert_eq!(nll[3], 0.0, "ignored row: no loss");
            assert!(dl[3 * v..4 * v].iter().all(|&x| x == 0.0), "ignored row: no gradient");
            let worst = dl.iter().zip(&dl_r).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-6, "{threads} threads: dlogits differ by {worst}");
            // each row's dlogits sum to g (1 - 1) = 0 when the target is in range
            let s: f32 = dl[..v].iter().sum();
            assert!(s.abs() < 1e-5, "row 0: dlogits sum {s}");
        }
    }
}
