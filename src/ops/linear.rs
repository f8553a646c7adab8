//! The linear layer y = x W^T (no bias, as every Llama projection) as one op with its own backward on
//! CPU f32: each of its three GEMMs straight from the operands' storage into a fresh, unfilled buffer.
//!
//! Reference: `linear_slow` (candle's reshape, transpose and matmul, the model's projection before this
//! op), which the tests compare forward and backward. With upstream dy (rows, Out):
//!   dx = dy W        (rows, Out) (Out, In),   dW = dy^T x   (Out, rows) (rows, In).
//! The non-obvious decision: candle's plain form is four autograd nodes (reshape, transpose, matmul,
//! reshape) and its backward fills a zeroed gradient for each and adds into it; dW comes out as (In, Out)
//! and is added transposed (a strided, scalar pass over the weight) before the parameter sees it. Here
//! the op is one node whose backward writes dx and dW in their final layouts; at small shapes (hidden
//! 128-512, a few hundred tokens) that overhead was a sizeable part of a CPU step.
//! The GEMMs are the `gemm` crate's (the microkernels candle's matmul calls), on rayon's threads.
//! Does not: run on CUDA or in bf16/f16, take a bias, or give a second derivative (`model::llama::linear`
//! calls `linear_slow` for what it does not take).
use crate::ops::rotary::f32_slice;
use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Tensor};
use gemm::{gemm, Parallelism};
use rayon::prelude::*;

/// A row-major operand view for one GEMM: data at (0, 0), `rs` between rows, `cs` between columns.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl View<'_> {
    /// Index of element (r, c).
    fn at(&self, r: usize, c: usize) -> usize {
        r * self.rs + c * self.cs
    }
}

/// Fewest rows of the output one thread's band takes (below twice this, the GEMM is not split by rows).
const MIN_BAND_ROWS: usize = 16;

/// lhs (m x k) * rhs (k x n) into a new row-major (m x n) buffer.
///
/// Threads: the output's rows are cut into one band per rayon thread, each band a single-threaded GEMM
/// (it packs its own rows of lhs and all of rhs). The `gemm` crate's own `Parallelism::Rayon` splits
/// inside every k-block and meets its threads again after each one; for the weight gradients
/// (dW = dy^T x: a few hundred rows, k = all tokens) that ran at 70-135 GFLOP/s on 2 AVX2 threads where
/// bands ran 140-165; on 2 AVX-512 threads (2026-12-03, medians of 15, (m, k, n) of the hidden-384 and
/// hidden-768 linears and their gradients) bands 215-292 GFLOP/s against 159-237, equal at 2048 x 768 x 2048
/// (benches/results/train-cpu-grid-avx512_20261203.md). Fewer than 2 * MIN_BAND_ROWS rows (decoding) keep
/// the crate's split over columns.
fn matmul((m, n, k): (usize, usize, usize), lhs: View, rhs: View) -> Vec<f32> {
    if m == 0 || n == 0 {
        return Vec::new();
    }
    if k == 0 {
        return vec![0f32; m * n];
    }
    // Every operand view must stay inside its slice: gemm reads through raw pointers.
    assert!(
        lhs.at(m - 1, k - 1) < lhs.data.len() && rhs.at(k - 1, n - 1) < rhs.data.len(),
        "linear: GEMM view out of range"
    );
    let threads = rayon::current_num_threads();
    let bands = threads.min(m / MIN_BAND_ROWS).max(1);
    let mut dst: Vec<f32> = Vec::with_capacity(m * n);
    if bands == 1 {
        let par = if threads > 1 { Parallelism::Rayon(threads) } else { Parallelism::None };
        // SAFETY: the views are inside their slices (asserted above) and dst has room for m * n values.
        unsafe { gemm_into((m, n, k), dst.spare_capacity_mut(), lhs, rhs, par) };
    } else {
        let band = m.div_ceil(bands);
        dst.spare_capacity_mut().par_chunks_mut(band * n).enumerate().for_each(|(i, out)| {
            let lhs_band = View { data: &lhs.data[i * band * lhs.rs..], ..lhs };
            // SAFETY: this band's rows i*band.. of lhs are inside lhs (the whole view is, asserted
            // above), `out` holds exactly its rows of dst, and bands do not overlap.
            unsafe { gemm_into((out.len() / n, n, k), out, lhs_band, rhs, Parallelism::None) };
        });
    }
    // SAFETY: the GEMMs above wrote every one of the m * n values (read_dst = false, alpha = 0).
    unsafe { dst.set_len(m * n) };
    dst
}

/// dst (m x n, row-major, uninitialised) := lhs (m x k) * rhs (k x n).
///
/// SAFETY (caller): the views hold m x k and k x n elements inside their slices; `dst` holds m * n.
/// With read_dst = false and alpha = 0 gemm writes every element of dst without reading any.
unsafe fn gemm_into(
    (m, n, k): (usize, usize, usize),
    dst: &mut [std::mem::MaybeUninit<f32>],
    lhs: View,
    rhs: View,
    par: Parallelism,
) {
    debug_assert!(dst.len() >= m * n);
    // SAFETY: forwarded from the caller's contract above.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().cast::<f32>(),
            1,
            n as isize,
            false,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

/// Forward: x (rows, In) row-major, w (Out, In) -> x W^T (rows, Out).
///
/// One row (a decode step): y_j = x · w_j with `cpu_vec::dot` over W's contiguous rows, split over rayon
/// threads. The gemm crate packs all of W for a 1-row product on AVX-512 and runs it on one thread whatever
/// `Parallelism` says: `perf` of `harpe generate` (hidden 512, 8 layers) had its packing at 55% of the samples
/// (benches/results/infer-cpu-grid-avx512_20261203.md).
pub fn linear_fwd_cpu(x: &[f32], w: &[f32], (rows, inp, out): (usize, usize, usize)) -> Vec<f32> {
    if rows == 1 && inp > 0 {
        use crate::ops::cpu_vec::dot;
        let x = &x[..inp];
        let mut y = vec![0f32; out];
        y.par_chunks_mut(64).enumerate().for_each(|(c, yc)| {
            for (i, yj) in yc.iter_mut().enumerate() {
                let j = c * 64 + i;
                *yj = dot(x, &w[j * inp..(j + 1) * inp]);
            }
        });
        return y;
    }
    matmul((rows, out, inp), View { data: x, rs: inp, cs: 1 }, View { data: w, rs: 1, cs: inp })
}

/// Backward: (dx (rows, In), dW (Out, In)) from dy (rows, Out), x and w.
pub fn linear_bwd_cpu(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    (rows, inp, out): (usize, usize, usize),
) -> (Vec<f32>, Vec<f32>) {
    let dx = matmul((rows, inp, out), View { data: dy, rs: out, cs: 1 }, View { data: w, rs: inp, cs: 1 });
    let dw = matmul((out, inp, rows), View { data: dy, rs: 1, cs: out }, View { data: x, rs: inp, cs: 1 });
    (dx, dw)
}

/// (rows, In, Out) of x (..., In) and w (Out, In), or an error naming the mismatch.
fn dims(x: &Shape, w: &Shape) -> Result<(usize, usize, usize)> {
    let (out, inp) = w.dims2()?;
    let xd = x.dims();
    match xd.last() {
        Some(&last) if last == inp => Ok((xd[..xd.len() - 1].iter().product(), inp, out)),
        _ => candle_core::bail!("linear: x {x:?} does not end in w's input size {inp} (w {w:?})"),
    }
}

/// The forward shape: x's with its last size replaced by Out.
fn out_shape(x: &Shape, out: usize) -> Shape {
    let mut d = x.dims().to_vec();
    if let Some(last) = d.last_mut() {
        *last = out;
    }
    Shape::from_dims(&d)
}

struct Linear;

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "harpe-linear"
    }

    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, inp, out) = dims(lx.shape(), lw.shape())?;
        let y = linear_fwd_cpu(f32_slice(sx, lx, "linear", "x")?, f32_slice(sw, lw, "linear", "w")?, (rows, inp, out));
        Ok((CpuStorage::F32(y), out_shape(lx.shape(), out)))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (rows, inp, out) = dims(x.shape(), w.shape())?;
        let grad = grad.contiguous()?;
        let (sg, lg) = grad.storage_and_layout();
        let (sx, lx) = x.storage_and_layout();
        let (sw, lw) = w.storage_and_layout();
        let (candle_core::Storage::Cpu(sg), candle_core::Storage::Cpu(sx), candle_core::Storage::Cpu(sw)) =
            (&*sg, &*sx, &*sw)
        else {
            candle_core::bail!("linear: the op runs on CPU tensors only (other devices take linear_slow)")
        };
        let (dx, dw) = linear_bwd_cpu(
            f32_slice(sg, lg, "linear", "dy")?,
            f32_slice(sx, lx, "linear", "x")?,
            f32_slice(sw, lw, "linear", "w")?,
            (rows, inp, out),
        );
        let dx = Tensor::from_vec(dx, x.shape(), &Device::Cpu)?;
        let dw = Tensor::from_vec(dw, w.shape(), &Device::Cpu)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// x (..., In) @ w^T for f32 CPU tensors, w (Out, In): differentiable in both.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, Linear)
}

/// The backward half of `linear` alone: a scalar node whose gradients in x and w are those of
/// sum(linear(x, w) ⊙ g) for a fixed upstream `g` (rows, Out): dx = g W, dW = g^T x. For a recompute
/// (activation checkpointing) that needs a projection's gradients but not its output: the forward GEMM
/// x W^T is never run. Its value is 0, not the dot product (nothing reads it; it only seeds `backward`).
struct LinearVjp {
    g: Tensor,
}

impl CustomOp2 for LinearVjp {
    fn name(&self) -> &'static str {
        "harpe-linear-vjp"
    }

    fn cpu_fwd(&self, _sx: &CpuStorage, lx: &Layout, _sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, _, out) = dims(lx.shape(), lw.shape())?;
        if self.g.dims() != out_shape(lx.shape(), out).dims() {
            candle_core::bail!("linear_vjp: g {:?} is not the shape of x W^T ({rows} rows of {out})", self.g.shape())
        }
        Ok((CpuStorage::F32(vec![0.0]), Shape::from_dims(&[])))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let up = (&self.g * grad.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64)?;
        Linear.bwd(x, w, &up, &up)
    }
}

/// A scalar with the gradients of sum(linear(x, w) ⊙ g) in x and w, without forming linear(x, w) on CPU
/// f32 (`LinearVjp`; its value is 0); elsewhere the plain product (`linear_vjp_slow`).
pub fn linear_vjp(x: &Tensor, w: &Tensor, g: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && [x.dtype(), w.dtype(), g.dtype()] == [DType::F32; 3] {
        x.contiguous()?.apply_op2(&w.contiguous()?, LinearVjp { g: g.detach() })
    } else {
        linear_vjp_slow(x, w, g)
    }
}

/// sum(linear(x, w) ⊙ g) from plain candle ops: `linear_vjp`'s reference (its gradients are the same; its
/// value is the real dot product).
pub fn linear_vjp_slow(x: &Tensor, w: &Tensor, g: &Tensor) -> Result<Tensor> {
    (linear_slow(x, w)? * g.detach())?.sum_all()
}

/// The same from plain candle ops (any device and dtype; the reference of the tests).
pub fn linear_slow(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let inner = dims[dims.len() - 1];
    let rows: usize = dims[..dims.len() - 1].iter().product();
    let y = x.reshape((rows, inner))?.matmul(&w.t()?)?;
    let mut out = dims;
    let last = out.len() - 1;
    out[last] = w.dim(0)?;
    y.reshape(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        // a fixed, seed-dependent pattern (candle's CPU randn is not seedable per call)
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0) - 1.0).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    /// Forward and both gradients of the op against the plain-op reference, for a 3-D and a 2-D input
    /// (odd sizes, so no GEMM tile is full).
    #[test]
    fn linear_matches_plain_ops_forward_and_backward() {
        for (xs, out) in [(vec![2usize, 37, 45], 29usize), (vec![70, 64], 96), (vec![1, 1, 8], 3)] {
            let inp = *xs.last().unwrap();
            let x = Var::from_tensor(&randn(&xs, 1)).unwrap();
            let w = Var::from_tensor(&randn(&[out, inp], 2)).unwrap();
            let up = randn(&[xs[..xs.len() - 1].to_vec(), vec![out]].concat(), 3);
            let y = linear(x.as_tensor(), w.as_tensor()).unwrap();
            let y_ref = linear_slow(x.as_tensor(), w.as_tensor()).unwrap();
            assert_eq!(y.dims(), y_ref.dims());
            assert!(max_diff(&y, &y_ref) < 1e-4, "forward {xs:?} x {out}: {}", max_diff(&y, &y_ref));
            let g = (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let g_ref = (y_ref * &up).unwrap().sum_all().unwrap().backward().unwrap();
            for (name, v) in [("x", &x), ("w", &w)] {
                let (a, b) = (g.get(v.as_tensor()).unwrap(), g_ref.get(v.as_tensor()).unwrap());
                assert_eq!(a.dims(), b.dims(), "d{name}");
                let scale = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
                assert!(max_diff(a, b) <= 1e-5 * scale.max(1.0), "d{name} {xs:?} x {out}: {}", max_diff(a, b));
            }
        }
    }

    /// The row-band split (one single-threaded GEMM per rayon thread) at band counts that do not divide
    /// the rows, forward and backward (dW's rows are Out, dx's the tokens), against the plain ops.
    #[test]
    fn row_bands_match_plain_ops_on_any_thread_count() {
        // 101 rows: row bands; 1 row: the decode path (dot products over W's rows, 67 = 64 + 3 outputs)
        for (threads, rows) in [(1, 101), (3, 101), (4, 101), (1, 1), (3, 1)] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let (x, w, up) = (randn(&[rows, 40], 11), randn(&[67, 40], 12), randn(&[rows, 67], 13));
                let (xv, wv) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap());
                let y = linear(xv.as_tensor(), wv.as_tensor()).unwrap();
                let y_ref = linear_slow(&x, &w).unwrap();
                assert!(max_diff(&y, &y_ref) < 1e-4, "{threads} threads: forward {}", max_diff(&y, &y_ref));
                let g = (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
                let (dx_ref, dw_ref) = (up.matmul(&w).unwrap(), up.t().unwrap().matmul(&x).unwrap());
                for (name, v, r) in [("x", &xv, &dx_ref), ("w", &wv, &dw_ref)] {
                    let d = max_diff(g.get(v.as_tensor()).unwrap(), r);
                    assert!(d < 1e-4, "{threads} threads: d{name} {d}");
                }
            });
        }
    }

    /// linear_vjp: the gradients of sum(linear(x, w) ⊙ g) without the product, against the plain form
    /// (and a scaled upstream gradient reaches both); its value is 0 (documented), the plain form's the
    /// dot product.
    #[test]
    fn linear_vjp_gives_the_gradients_of_the_plain_product() {
        for (xs, out) in [(vec![2usize, 37, 45], 29usize), (vec![70, 64], 96)] {
            let inp = *xs.last().unwrap();
            let x = Var::from_tensor(&randn(&xs, 21)).unwrap();
            let w = Var::from_tensor(&randn(&[out, inp], 22)).unwrap();
            let g = randn(&[xs[..xs.len() - 1].to_vec(), vec![out]].concat(), 23);
            let s = linear_vjp(x.as_tensor(), w.as_tensor(), &g).unwrap();
            assert_eq!(s.to_scalar::<f32>().unwrap(), 0.0);
            let s_ref = linear_vjp_slow(x.as_tensor(), w.as_tensor(), &g).unwrap();
            let gr = (s * 3.0).unwrap().backward().unwrap();
            let gr_ref = (s_ref * 3.0).unwrap().backward().unwrap();
            for (name, v) in [("x", &x), ("w", &w)] {
                let (a, b) = (gr.get(v.as_tensor()).unwrap(), gr_ref.get(v.as_tensor()).unwrap());
                assert_eq!(a.dims(), b.dims(), "d{name}");
                let scale = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
                assert!(max_diff(a, b) <= 1e-5 * scale.max(1.0), "d{name} {xs:?} x {out}: {}", max_diff(a, b));
            }
        }
        let err = linear_vjp(&randn(&[4, 6], 1), &randn(&[3, 6], 2), &randn(&[4, 5], 3)).unwrap_err().to_string();
        assert!(err.contains("linear_vjp") && err.contains("4 rows of 3"), "{err}");
    }

    /// A strided x (a transposed view) is made contiguous first; the answer does not change.
    #[test]
    fn linear_takes_a_strided_input() {
        let x = randn(&[16, 12], 4).t().unwrap(); // (12, 16), strided
        let w = randn(&[5, 16], 5);
        let d = max_diff(&linear(&x, &w).unwrap(), &linear_slow(&x, &w).unwrap());
        assert!(d < 1e-5, "{d}");
    }

    /// Bad input names the op and the mismatch.
    #[test]
    fn linear_refuses_mismatched_and_non_f32_inputs() {
        let x = randn(&[4, 6], 6);
        let err = linear(&x, &randn(&[3, 5], 7)).unwrap_err().to_string();
        assert!(err.contains("linear") && err.contains("input size 5"), "{err}");
        let err = linear(&x.to_dtype(DType::F64).unwrap(), &randn(&[3, 6], 7).to_dtype(DType::F64).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("must be f32"), "{err}");
    }
}
