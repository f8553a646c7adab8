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
//! The GEMMs are `ops::cpu_gemm::sgemm` (the `gemm` crate's microkernels, or MKL with feature `mkl`) on
//! rayon's threads, one band per thread.
//! Does not: run on CUDA or in bf16/f16, take a bias, or give a second derivative (`linear_any`
//! calls `linear_slow` for what it does not take).
use crate::ops::cpu_gemm::{sgemm, Mat};
use crate::ops::rotary::f32_slice;
use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

/// A strided matrix view (one GEMM operand, or the weight): element (r, c) at data[r * rs + c * cs].
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> View<'a> {
    /// A row-major (rows x cols) matrix.
    pub fn row_major(data: &'a [f32], cols: usize) -> View<'a> {
        View { data, rs: cols, cs: 1 }
    }

    /// Index of element (r, c).
    fn at(&self, r: usize, c: usize) -> usize {
        r * self.rs + c * self.cs
    }

    /// The transpose (the same data).
    fn t(self) -> View<'a> {
        View { rs: self.cs, cs: self.rs, ..self }
    }
}

/// Weight elements (In x Out) from which a 1-row product is split over threads (below: one thread, where
/// waking the pool cost more than it saved: hidden 128 decoded at 884 tok/s split, 1630 whole).
const PAR_DECODE_WEIGHTS: usize = 1 << 17;
/// Output columns per task of a split 1-row product.
const DECODE_CHUNK: usize = 64;

/// (rs, cs) of W (Out, In) with strides `strides` when it is row-major (strides (In, 1), as checkpoints
/// store it) or column-major (strides (1, Out), the inference layout of `Llama::with_inference_layout`);
/// None for any other layout. A size-1 dimension's stride is free.
fn weight_strides((out, inp): (usize, usize), strides: &[usize]) -> Option<(usize, usize)> {
    match *strides {
        [rs, 1] if rs == inp || out <= 1 => Some((inp, 1)),
        [1, cs] if cs == out || inp <= 1 => Some((1, out)),
        _ => None,
    }
}

/// W (Out, In) of a CPU storage as a view in either layout of `weight_strides`; any other layout is an
/// error (`linear` makes such a weight contiguous before it gets here).
fn weight_view<'a>(s: &'a CpuStorage, l: &Layout) -> Result<View<'a>> {
    let CpuStorage::F32(v) = s else { candle_core::bail!("linear: `w` must be f32") };
    let (out, inp) = l.shape().dims2()?;
    let Some((rs, cs)) = weight_strides((out, inp), l.stride()) else {
        candle_core::bail!("linear: w {:?} with strides {:?} is neither row- nor column-major", l.shape(), l.stride())
    };
    let start = l.start_offset();
    if start + out * inp > v.len() {
        candle_core::bail!("linear: w {:?} at offset {start} runs past its storage ({} values)", l.shape(), v.len());
    }
    Ok(View { data: &v[start..start + out * inp], rs, cs })
}

/// True when `w` (2-D) is in a layout `weight_view` reads without a copy.
fn weight_layout_ok(w: &Tensor) -> bool {
    matches!(w.dims(), &[out, inp] if weight_strides((out, inp), w.stride()).is_some())
}

/// Fewest rows (columns) of the output one thread's band takes (below twice this, the GEMM is not split).
const MIN_BAND: usize = 16;

/// lhs (m x k) * rhs (k x n) into a new row-major (m x n) buffer.
///
/// Threads: the output is cut into one band per rayon thread, each band a single-threaded GEMM. The
/// `gemm` crate's own `Parallelism::Rayon` splits inside every k-block and meets its threads again after
/// each one; for the weight gradients (dW = dy^T x: a few hundred rows, k = all tokens) that ran at
/// 70-135 GFLOP/s on 2 AVX2 threads where bands ran 140-165; on 2 AVX-512 threads (medians of 15, (m, k, n)
/// of the hidden-384 and hidden-768 linears and their gradients, `cargo bench --bench linear_cpu`) bands
/// 215-292 GFLOP/s against 159-237, equal at 2048 x 768 x 2048; the grid they feed: benches/results/train-cpu-grid.md.
/// A band packs its own part of one operand and all of the other, so the split runs along the larger of
/// m and n: bands of rows (each packs all of rhs, k x n) when m >= n, bands of columns (each packs all of
/// lhs, m x k) when m < n. A forward over a 256-token window (m = 256, n = 768-2048 outputs) cut into rows
/// packed every weight once per thread; `perf` of eval-ppl (hidden 768, 8 layers) had that packing at 13%.
/// Fewer than 2 * MIN_BAND rows and columns keep the crate's own split.
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
    let by_rows = m >= n;
    let bands = threads.min(m.max(n) / MIN_BAND).max(1);
    let mut dst: Vec<f32> = Vec::with_capacity(m * n);
    if bands == 1 {
        let par = if threads > 1 { Parallelism::Rayon(threads) } else { Parallelism::None };
        // SAFETY: the views are inside their slices (asserted above) and dst has room for m * n values.
        unsafe { gemm_into((m, n, k), dst.as_mut_ptr(), n, lhs, rhs, par) };
    } else if by_rows {
        let band = m.div_ceil(bands);
        dst.spare_capacity_mut().par_chunks_mut(band * n).enumerate().for_each(|(i, out)| {
            let lhs_band = View { data: &lhs.data[i * band * lhs.rs..], ..lhs };
            // SAFETY: this band's rows i*band.. of lhs are inside lhs (the whole view is, asserted
            // above), `out` holds exactly its rows of dst, and bands do not overlap.
            unsafe { gemm_into((out.len() / n, n, k), out.as_mut_ptr().cast(), n, lhs_band, rhs, Parallelism::None) };
        });
    } else {
        // Column bands of a multiple of MIN_BAND (whole SIMD lanes of the microkernel's output columns).
        let band = n.div_ceil(bands).next_multiple_of(MIN_BAND);
        let base = SendPtr(dst.as_mut_ptr());
        (0..n.div_ceil(band)).into_par_iter().for_each(|i| {
            let (c0, width) = (i * band, band.min(n - i * band));
            let rhs_band = View { data: &rhs.data[c0 * rhs.cs..], ..rhs };
            // SAFETY: columns c0..c0 + width of rhs are inside rhs (the whole view is); the band writes
            // only columns c0..c0 + width of each of dst's m rows (row stride n), which no other band
            // writes, and dst has room for m * n values.
            unsafe { gemm_into((m, width, k), base.get().add(c0), n, lhs, rhs_band, Parallelism::None) };
        });
    }
    // SAFETY: the GEMMs above wrote every one of the m * n values (read_dst = false, alpha = 0).
    unsafe { dst.set_len(m * n) };
    dst
}

/// A raw output pointer the column bands share (each writes its own columns).
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: only `matmul`'s column bands use it, each writing a disjoint set of elements.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// dst (m x n, row stride `dst_rs`, uninitialised) := lhs (m x k) * rhs (k x n).
///
/// SAFETY (caller): the views hold m x k and k x n elements inside their slices; `dst` points at m rows
/// of n writable values, `dst_rs` apart. `sgemm` without accumulation writes every element of dst without
/// reading any.
unsafe fn gemm_into(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    lhs: View,
    rhs: View,
    par: Parallelism,
) {
    let view = |v: View| Mat { ptr: v.data.as_ptr(), rs: v.rs as isize, cs: v.cs as isize };
    // SAFETY: forwarded from the caller's contract above (read_dst = false: dst is written, never read).
    unsafe { sgemm((m, n, k), dst, dst_rs, false, view(lhs), view(rhs), 1.0, par) }
}

/// Forward: x (rows, In) row-major, w (Out, In) in either layout of `weight_view` -> x W^T (rows, Out).
///
/// The GEMM reads W^T (In x Out). Over row-major W its rows are strided, and the gemm crate packs them
/// with a scalar gather per call and per thread band: `perf` of `harpe eval-ppl` (hidden 512, 8 layers,
/// windows of 256) had that packing at 27-30% of the samples. Inference models store W column-major
/// (`Llama::with_inference_layout`), where W^T's rows are contiguous and packing is a copy.
///
/// One row (a decode step) skips the gemm crate, which packs all of W for a 1-row product on AVX-512 and
/// runs it on one thread whatever `Parallelism` says (`perf` of `harpe generate`, hidden 512, 8 layers: the
/// packing at 55%; decode speed now: benches/results/infer-cpu-grid.md): row-major W gives y_j = x · w_j with
/// `cpu_vec::dot` over W's rows, column-major W gives y = sum_i x_i W^T_i with `cpu_vec::axpy_rows` over W^T's
/// rows, either split over rayon threads by output columns when W is large enough to pay for the split.
pub fn linear_fwd_cpu(x: &[f32], w: View, (rows, inp, out): (usize, usize, usize)) -> Vec<f32> {
    if rows == 1 && inp > 0 {
        use crate::ops::cpu_vec::{axpy_rows, dot};
        let x = &x[..inp];
        let mut y = vec![0f32; out];
        let chunk = if inp * out < PAR_DECODE_WEIGHTS {
            out.max(1) // one task
        } else if w.cs == 1 {
            DECODE_CHUNK
        } else {
            // one band of columns per thread: each streams its part of every row of W^T once
            out.div_ceil(rayon::current_num_threads()).next_multiple_of(16)
        };
        if w.cs == 1 {
            y.par_chunks_mut(chunk).enumerate().for_each(|(c, yc)| {
                for (i, yj) in yc.iter_mut().enumerate() {
                    let j = c * chunk + i;
                    *yj = dot(x, &w.data[j * w.rs..j * w.rs + inp]);
                }
            });
        } else {
            y.par_chunks_mut(chunk).enumerate().for_each(|(c, yc)| axpy_rows(x, &w.data[c * chunk..], w.cs, yc));
        }
        return y;
    }
    matmul((rows, out, inp), View { data: x, rs: inp, cs: 1 }, w.t())
}

/// Backward: (dx (rows, In), dW (Out, In)) from dy (rows, Out), x and w.
pub fn linear_bwd_cpu(dy: &[f32], x: &[f32], w: View, (rows, inp, out): (usize, usize, usize)) -> (Vec<f32>, Vec<f32>) {
    let dx = matmul((rows, inp, out), View { data: dy, rs: out, cs: 1 }, w);
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
        let y = linear_fwd_cpu(f32_slice(sx, lx, "linear", "x")?, weight_view(sw, lw)?, (rows, inp, out));
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
            weight_view(sw, lw)?,
            (rows, inp, out),
        );
        let dx = Tensor::from_vec(dx, x.shape(), &Device::Cpu)?;
        let dw = Tensor::from_vec(dw, w.shape(), &Device::Cpu)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// x (..., In) @ w^T for f32 CPU tensors, w (Out, In): differentiable in both.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&weight_operand(w)?, Linear)
}

/// w as it is when `weight_view` reads it (row- or column-major), else a contiguous copy.
fn weight_operand(w: &Tensor) -> Result<Tensor> {
    if weight_layout_ok(w) {
        Ok(w.clone())
    } else {
        w.contiguous()
    }
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
        x.contiguous()?.apply_op2(&weight_operand(w)?, LinearVjp { g: g.detach() })
    } else {
        linear_vjp_slow(x, w, g)
    }
}

/// sum(linear(x, w) ⊙ g) from plain candle ops: `linear_vjp`'s reference (its gradients are the same; its
/// value is the real dot product).
pub fn linear_vjp_slow(x: &Tensor, w: &Tensor, g: &Tensor) -> Result<Tensor> {
    (linear_slow(x, w)? * g.detach())?.sum_all()
}

/// x (..., In) @ w^T with w (Out, In) on any device and dtype: `linear` (the one-node op with its own
/// backward) on CPU in f32, `linear_slow` elsewhere (cuBLAS on CUDA). The model's projections and the
/// loss's logits call this.
pub fn linear_any(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 && w.dtype() == DType::F32 {
        linear(x, w)
    } else {
        linear_slow(x, w)
    }
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

    /// rows x cols values of `t` (any layout) in row-major order.
    fn vals(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// The band splits (rows when rows >= Out, columns below; one single-threaded GEMM per rayon thread)
    /// at band counts that do not divide the sizes, the 1-row decode path (small W on one thread, large W
    /// split), each over a row-major and a column-major W, forward and backward (dx = dy W, dW = dy^T x)
    /// against candle's matmul.
    #[test]
    fn bands_and_layouts_match_plain_ops_on_any_thread_count() {
        let cases = [
            (1, 101, 40, 67), // row bands
            (3, 101, 40, 67),
            (4, 101, 40, 67),
            (3, 20, 40, 67), // column bands (20 rows < 67 outputs): 32 + 32 + 3 columns
            (2, 20, 40, 67),
            (1, 1, 40, 67), // decode, one thread
            (3, 1, 40, 67),
            (3, 1, 300, 450), // decode, W large enough to split: 64-column chunks / 160-column bands
        ];
        for (threads, rows, inp, out) in cases {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let (x, w, dy) = (randn(&[rows, inp], 11), randn(&[out, inp], 12), randn(&[rows, out], 13));
                let y_ref = x.matmul(&w.t().unwrap()).unwrap();
                let (dx_ref, dw_ref) = (dy.matmul(&w).unwrap(), dy.t().unwrap().matmul(&x).unwrap());
                let (xs, ws, dys) = (vals(&x), vals(&w), vals(&dy));
                let wt = vals(&w.t().unwrap()); // (In, Out) row-major: W column-major
                let layouts =
                    [("row-major", View::row_major(&ws, inp)), ("column-major", View { data: &wt, rs: 1, cs: out })];
                for (layout, wv) in layouts {
                    let what = format!("{threads} threads, {rows} x {inp} -> {out}, W {layout}");
                    let close = |got: Vec<f32>, want: &Tensor, name: &str| {
                        let got = Tensor::from_vec(got, want.shape(), &Device::Cpu).unwrap();
                        let d = max_diff(&got, want);
                        assert!(d < 1e-4, "{what}: {name} off by {d}");
                    };
                    close(linear_fwd_cpu(&xs, wv, (rows, inp, out)), &y_ref, "y");
                    let (dx, dw) = linear_bwd_cpu(&dys, &xs, wv, (rows, inp, out));
                    close(dx, &dx_ref, "dx");
                    close(dw, &dw_ref, "dW");
                }
            });
        }
    }

    /// The op over a column-major weight (a transposed view of a contiguous (In, Out) tensor, as
    /// `Llama::with_inference_layout` stores it) reads it in place and gives the plain ops' values and
    /// gradients; a weight in neither layout (a narrowed view) is copied first, with the same answer.
    #[test]
    fn linear_takes_column_major_and_strided_weights() {
        let x = Var::from_tensor(&randn(&[2, 9, 24], 31)).unwrap();
        let w = Var::from_tensor(&randn(&[40, 24], 32)).unwrap();
        let up = randn(&[2, 9, 40], 33);
        let w_col = w.as_tensor().t().unwrap().contiguous().unwrap().t().unwrap();
        assert_eq!((w_col.dims(), w_col.stride()), (&[40, 24][..], &[1, 40][..]));
        assert!(weight_layout_ok(&w_col));
        let y = linear(x.as_tensor(), &w_col).unwrap();
        let y_ref = linear_slow(x.as_tensor(), w.as_tensor()).unwrap();
        assert!(max_diff(&y, &y_ref) < 1e-4, "forward {}", max_diff(&y, &y_ref));
        let g = (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g_ref = (y_ref * &up).unwrap().sum_all().unwrap().backward().unwrap();
        for (name, v) in [("x", &x), ("w", &w)] {
            let d = max_diff(g.get(v.as_tensor()).unwrap(), g_ref.get(v.as_tensor()).unwrap());
            assert!(d < 1e-4, "d{name} through the column-major weight: {d}");
        }
        let wide = randn(&[40, 30], 34);
        let narrow = wide.narrow(1, 0, 24).unwrap(); // strides (30, 1): neither layout
        assert!(!weight_layout_ok(&narrow));
        let d = max_diff(&linear(x.as_tensor(), &narrow).unwrap(), &linear_slow(x.as_tensor(), &narrow).unwrap());
        assert!(d < 1e-4, "narrowed weight: {d}");
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
