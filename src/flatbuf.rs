//! `FlatBuf`: one fp32 buffer over the flat parameter index space (HF order), the single type of
//! training state: master weights, AdamW moments, gradients, and the gathered weights are all FlatBufs.
//!
//! Reference: llm.c `train_gpt2.cu` (one contiguous buffer per kind of state, parameters as offsets
//! into it).
//! The non-obvious decisions: the interface speaks in flat ranges and 1-D candle tensors, never in host
//! slices, so the device variant (`Device`: a 1-D contiguous f32 tensor on the training device) needs no
//! change at the call sites: a parameter view is `param_tensor(range, shape, ..)` (narrow + reshape, a
//! copy), a gradient is added with `add_tensor` (narrow + add + `slice_set`, in place), and host access is
//! explicit (`host` / `host_mut` borrow without a copy on the host variant and refuse on a device one;
//! `to_host` always works and copies only there). Reductions accumulate in f64: in index order on the
//! host (bit-identical to the `Vec<f32>` loops it replaced), in the device kernel's fixed order on CUDA.
//! A `Device` buffer is never shared: `Clone` copies the values and every view handed out is a copy, so
//! the in-place updates (`slice_set`, the fused AdamW kernel) are seen by nobody else. The `Device`
//! variant also works on a CPU tensor (`Placement::Device(Device::Cpu)`): then the same candle ops run on
//! the CPU, which is how tests check the GPU path's logic against the host one without a GPU.
//! What this file does not do: know which parameter lives where (`grads::ParamLayout`) or which rank
//! owns what (`comms::zero::ShardMap`).
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::borrow::Cow;
use std::ops::Range;

/// Elements per piece of the chunked device loops (`fill`, `scale`, `sum_squares` on a CPU tensor): the
/// temporaries they make stay this small whatever the buffer's size.
const CHUNK: usize = 1 << 24;

/// Where a buffer's values live: host memory, or a 1-D tensor on a device (CUDA; a CPU tensor in tests).
#[derive(Clone, Debug)]
pub enum Placement {
    /// a `Vec<f32>`
    Host,
    /// a 1-D f32 tensor on this device
    Device(Device),
}

impl Placement {
    /// The training state's placement for a training device: host memory for the CPU, else on the device.
    pub fn of(device: &Device) -> Placement {
        match device {
            Device::Cpu => Placement::Host,
            d => Placement::Device(d.clone()),
        }
    }

    /// The device the values are on.
    pub fn device(&self) -> Device {
        match self {
            Placement::Host => Device::Cpu,
            Placement::Device(d) => d.clone(),
        }
    }
}

/// One fp32 buffer of training state, on the host or on a device.
#[derive(Debug)]
pub enum FlatBuf {
    /// host memory: the CPU build's training state, exactly the former `Vec<f32>`
    Host(Vec<f32>),
    /// a 1-D contiguous f32 tensor owned by this buffer alone (never shared; see the file header)
    Device(Tensor),
}

impl FlatBuf {
    /// A copy of the values (a device buffer is copied on its device, never shared); an error when the
    /// device cannot hold a second copy (out of memory), which `Clone` could not return.
    pub fn try_clone(&self) -> Result<FlatBuf> {
        Ok(match self {
            FlatBuf::Host(v) => FlatBuf::Host(v.clone()),
            FlatBuf::Device(t) => FlatBuf::Device(t.copy().context("copying a device buffer (out of device memory?)")?),
        })
    }
}

impl PartialEq for FlatBuf {
    /// Equal values (on any placement; a device buffer is read to the host for the comparison).
    fn eq(&self, other: &FlatBuf) -> bool {
        match (self.to_host(), other.to_host()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        }
    }
}

/// A flat f32 copy of `t` on `device`, never sharing storage with `t`.
fn owned_f32(t: &Tensor, device: &Device) -> Result<Tensor> {
    let flat = t.flatten_all()?;
    let x = if flat.dtype() == DType::F32 { flat.copy()? } else { flat.to_dtype(DType::F32)? };
    Ok(x.to_device(device)?)
}

/// A scalar as a 0-d f32 tensor for exact elementwise products (`broadcast_mul`), unlike `affine`.
fn scalar(x: f32, device: &Device) -> Result<Tensor> {
    Ok(Tensor::new(x, device)?)
}

impl FlatBuf {
    /// `n` zeros on `device`: host memory for the CPU, a device tensor elsewhere (`Placement::of`).
    pub fn zeros(n: usize, device: &Device) -> Result<FlatBuf> {
        FlatBuf::zeros_in(n, &Placement::of(device))
    }

    /// `n` zeros with the given placement (`Placement::Device(Device::Cpu)` forces the device variant on
    /// the CPU, for tests of the GPU path).
    pub fn zeros_in(n: usize, p: &Placement) -> Result<FlatBuf> {
        match p {
            Placement::Host => Ok(FlatBuf::Host(vec![0.0; n])),
            Placement::Device(d) => Ok(FlatBuf::Device(
                Tensor::zeros(n, DType::F32, d).with_context(|| format!("allocating {n} f32 values on {d:?}"))?,
            )),
        }
    }

    /// `n` zeros with the placement of `self`.
    pub fn zeros_like(&self, n: usize) -> Result<FlatBuf> {
        FlatBuf::zeros_in(n, &self.placement())
    }

    /// Wrap host values (no copy).
    pub fn from_vec(v: Vec<f32>) -> FlatBuf {
        FlatBuf::Host(v)
    }

    /// Host values placed like `self` (a checkpoint's state read into a buffer of this kind).
    pub fn like(&self, v: Vec<f32>) -> Result<FlatBuf> {
        FlatBuf::Host(v).placed(&self.placement())
    }

    /// These values with placement `p` (a move for the host variant when `p` is the host).
    pub fn placed(self, p: &Placement) -> Result<FlatBuf> {
        match (self, p) {
            (FlatBuf::Host(v), Placement::Host) => Ok(FlatBuf::Host(v)),
            (FlatBuf::Host(v), Placement::Device(d)) => {
                let n = v.len();
                Ok(FlatBuf::Device(Tensor::from_vec(v, n, d).with_context(|| format!("copying {n} values to {d:?}"))?))
            }
            (FlatBuf::Device(t), Placement::Host) => Ok(FlatBuf::Host(t.to_vec1::<f32>()?)),
            (FlatBuf::Device(t), Placement::Device(d)) => Ok(FlatBuf::Device(t.to_device(d)?)),
        }
    }

    /// The values of a tensor of any shape and float dtype, flattened, as fp32 on the tensor's device
    /// (host memory for a CPU tensor).
    pub fn from_tensor(t: &Tensor) -> Result<FlatBuf> {
        FlatBuf::from_tensor_in(t, &Placement::of(t.device()))
    }

    /// The values of a tensor, flattened, as fp32 with placement `p`.
    pub fn from_tensor_in(t: &Tensor, p: &Placement) -> Result<FlatBuf> {
        match p {
            Placement::Host => Ok(FlatBuf::Host(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)),
            Placement::Device(d) => Ok(FlatBuf::Device(owned_f32(t, d)?)),
        }
    }

    /// Where the values live.
    pub fn placement(&self) -> Placement {
        match self {
            FlatBuf::Host(_) => Placement::Host,
            FlatBuf::Device(t) => Placement::Device(t.device().clone()),
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            FlatBuf::Host(v) => v.len(),
            FlatBuf::Device(t) => t.elem_count(),
        }
    }

    /// True when the buffer holds no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device the values live on.
    pub fn device(&self) -> Device {
        self.placement().device()
    }

    /// Borrow the values on the host (no copy); a device buffer refuses, use `to_host`.
    pub fn host(&self) -> Result<&[f32]> {
        match self {
            FlatBuf::Host(v) => Ok(v),
            FlatBuf::Device(t) => bail!("internal: FlatBuf::host on a buffer on {:?}; use to_host", t.device()),
        }
    }

    /// Borrow the values on the host mutably (no copy); a device buffer refuses.
    pub fn host_mut(&mut self) -> Result<&mut [f32]> {
        match self {
            FlatBuf::Host(v) => Ok(v),
            FlatBuf::Device(t) => bail!("internal: FlatBuf::host_mut on a buffer on {:?}", t.device()),
        }
    }

    /// The values on the host: borrowed for a host buffer, copied from a device one.
    pub fn to_host(&self) -> Result<Cow<'_, [f32]>> {
        match self {
            FlatBuf::Host(v) => Ok(Cow::Borrowed(v)),
            FlatBuf::Device(t) => Ok(Cow::Owned(t.to_vec1::<f32>().context("copying a device buffer to the host")?)),
        }
    }

    /// The values of `range`, copied to the host.
    pub fn range_to_host(&self, range: Range<usize>) -> Result<Vec<f32>> {
        self.check_range(&range, "range_to_host")?;
        match self {
            FlatBuf::Host(v) => Ok(v[range].to_vec()),
            FlatBuf::Device(t) => Ok(t.narrow(0, range.start, range.len())?.to_vec1::<f32>()?),
        }
    }

    /// The values of `range` as a 1-D f32 tensor where they live (a CPU tensor for a host buffer; a
    /// copy in any case, so the buffer's in-place updates do not show through).
    pub fn range_tensor(&self, range: Range<usize>) -> Result<Tensor> {
        self.check_range(&range, "range_tensor")?;
        match self {
            FlatBuf::Host(v) => Ok(Tensor::from_slice(&v[range.clone()], range.len(), &Device::Cpu)?),
            FlatBuf::Device(t) => Ok(t.narrow(0, range.start, range.len())?.copy()?),
        }
    }

    /// Run `f` on the values as a host slice: borrowed for a host buffer; for a device one the values
    /// are copied to the host and back (the `Local` collectives on device buffers; NCCL needs no copy).
    pub fn with_host_mut<R>(&mut self, f: impl FnOnce(&mut [f32]) -> Result<R>) -> Result<R> {
        match self {
            FlatBuf::Host(v) => f(v),
            FlatBuf::Device(t) => {
                let mut v = t.to_vec1::<f32>()?;
                let r = f(&mut v)?;
                let n = v.len();
                *t = Tensor::from_vec(v, n, t.device())?;
                Ok(r)
            }
        }
    }

    /// The values of `range` as a tensor of `shape` in `dtype` on `device` (a parameter's view; a copy).
    pub fn param_tensor(&self, range: Range<usize>, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        self.check_range(&range, "param_tensor")?;
        match self {
            FlatBuf::Host(v) => Ok(Tensor::from_slice(&v[range], shape, device)?.to_dtype(dtype)?),
            FlatBuf::Device(t) => {
                let part = t.narrow(0, range.start, range.len())?;
                // a copy in any case: the in-place updates of this buffer must not show through
                let part = if dtype == DType::F32 { part.copy()? } else { part.to_dtype(dtype)? };
                Ok(part.reshape(shape)?.to_device(device)?)
            }
        }
    }

    /// Add the values of `t` (any shape, `range.len()` elements) to `range`, in fp32.
    pub fn add_tensor(&mut self, range: Range<usize>, t: &Tensor) -> Result<()> {
        self.check_fits(&range, t, "add_tensor")?;
        match self {
            FlatBuf::Host(v) => {
                let dst = &mut v[range];
                // An f32 CPU gradient (the training case) is added from its storage in place, on rayon;
                // anything else (another dtype or device, a strided view) is read out first.
                if t.dtype() == DType::F32 && t.device().is_cpu() {
                    let (st, l) = t.storage_and_layout();
                    if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(g)), Some((a, b))) =
                        (&*st, l.contiguous_offsets())
                    {
                        add_par(dst, &g[a..b]);
                        return Ok(());
                    }
                }
                let g = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>().context("reading a tensor to add")?;
                add_par(dst, &g);
                Ok(())
            }
            FlatBuf::Device(buf) => {
                let g = t.flatten_all()?.to_dtype(DType::F32)?.to_device(buf.device())?;
                let sum = (buf.narrow(0, range.start, range.len())? + g)?;
                Ok(buf.slice_set(&sum, 0, range.start)?)
            }
        }
    }

    /// Overwrite `range` with the values of `t` (any shape and float dtype, `range.len()` elements).
    pub fn set_tensor(&mut self, range: Range<usize>, t: &Tensor) -> Result<()> {
        self.check_fits(&range, t, "set_tensor")?;
        match self {
            FlatBuf::Host(v) => {
                let x = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>().context("reading a tensor")?;
                v[range].copy_from_slice(&x);
                Ok(())
            }
            FlatBuf::Device(buf) => {
                let x = owned_f32(t, buf.device())?;
                Ok(buf.slice_set(&x, 0, range.start)?)
            }
        }
    }

    /// Copy `src[src_range]` into `self[dst_start..]` (any placements; a device-to-device copy stays there).
    pub fn copy_from(&mut self, dst_start: usize, src: &FlatBuf, src_range: Range<usize>) -> Result<()> {
        src.check_range(&src_range, "copy_from (source)")?;
        self.check_range(&(dst_start..dst_start + src_range.len()), "copy_from (destination)")?;
        match (self, src) {
            (FlatBuf::Host(d), FlatBuf::Host(s)) => {
                d[dst_start..dst_start + src_range.len()].copy_from_slice(&s[src_range]);
                Ok(())
            }
            (FlatBuf::Host(d), s @ FlatBuf::Device(_)) => {
                d[dst_start..dst_start + src_range.len()].copy_from_slice(&s.range_to_host(src_range)?);
                Ok(())
            }
            (FlatBuf::Device(d), FlatBuf::Device(s)) => {
                let part = s.narrow(0, src_range.start, src_range.len())?.to_device(d.device())?;
                Ok(d.slice_set(&part, 0, dst_start)?)
            }
            (FlatBuf::Device(d), FlatBuf::Host(s)) => {
                let n = src_range.len();
                let part = Tensor::from_slice(&s[src_range], n, d.device())?;
                Ok(d.slice_set(&part, 0, dst_start)?)
            }
        }
    }

    /// A new buffer (same placement) holding a copy of `range`.
    pub fn slice_to_owned(&self, range: Range<usize>) -> Result<FlatBuf> {
        self.check_range(&range, "slice_to_owned")?;
        match self {
            FlatBuf::Host(v) => Ok(FlatBuf::Host(v[range].to_vec())),
            FlatBuf::Device(t) => Ok(FlatBuf::Device(t.narrow(0, range.start, range.len())?.copy()?)),
        }
    }

    /// The pieces `0..n` in steps of `CHUNK`.
    fn chunks(n: usize) -> impl Iterator<Item = Range<usize>> {
        (0..n).step_by(CHUNK).map(move |s| s..(s + CHUNK).min(n))
    }

    /// Set every value to `x`.
    pub fn fill(&mut self, x: f32) -> Result<()> {
        match self {
            FlatBuf::Host(v) => map_par(v, |y| *y = x),
            FlatBuf::Device(t) => {
                let n = t.elem_count();
                let piece = Tensor::full(x, n.min(CHUNK), t.device())?;
                for r in FlatBuf::chunks(n) {
                    t.slice_set(&piece.narrow(0, 0, r.len())?, 0, r.start)?;
                }
            }
        }
        Ok(())
    }

    /// Multiply every value by `s`.
    pub fn scale(&mut self, s: f32) -> Result<()> {
        match self {
            FlatBuf::Host(v) => map_par(v, |x| *x *= s),
            FlatBuf::Device(t) => {
                let k = scalar(s, t.device())?;
                for r in FlatBuf::chunks(t.elem_count()) {
                    let part = t.narrow(0, r.start, r.len())?.broadcast_mul(&k)?;
                    t.slice_set(&part, 0, r.start)?;
                }
            }
        }
        Ok(())
    }

    /// Sum of squares in f64: on the host in fixed pieces (`sum_squares_host`), by the device kernel's
    /// fixed-order reduction on CUDA (`ops::cuda::grad_sumsq`), in `CHUNK` pieces by candle ops on a CPU
    /// tensor. One scalar crosses.
    pub fn sum_squares(&self) -> Result<f64> {
        match self {
            FlatBuf::Host(v) => Ok(sum_squares_host(v)),
            FlatBuf::Device(t) => device_sum_squares(t),
        }
    }

    /// `sum_squares` of the values in `range` only (ZeRO-1: this rank's reduced slice of a full buffer).
    pub fn range_sum_squares(&self, range: Range<usize>) -> Result<f64> {
        self.check_range(&range, "range_sum_squares")?;
        match self {
            FlatBuf::Host(v) => Ok(sum_squares_host(&v[range])),
            FlatBuf::Device(t) => device_sum_squares(&t.narrow(0, range.start, range.len())?),
        }
    }

    /// True when every value is finite (on a device: the sum of squares is, which holds exactly then,
    /// since squares of finite f32 values cannot overflow an f64 sum).
    pub fn all_finite(&self) -> Result<bool> {
        match self {
            FlatBuf::Host(v) => Ok(v.iter().all(|x| x.is_finite())),
            FlatBuf::Device(_) => Ok(self.sum_squares()?.is_finite()),
        }
    }

    /// The device tensor (the fused AdamW launch reads and writes it in place); None on the host.
    pub fn device_tensor(&self) -> Option<&Tensor> {
        match self {
            FlatBuf::Host(_) => None,
            FlatBuf::Device(t) => Some(t),
        }
    }

    /// Replace the values of a device buffer with `t` (same length; the candle-op AdamW path).
    pub(crate) fn set_range_device(&mut self, start: usize, t: &Tensor) -> Result<()> {
        match self {
            FlatBuf::Device(buf) => Ok(buf.slice_set(t, 0, start)?),
            FlatBuf::Host(_) => bail!("internal: set_range_device on a host buffer"),
        }
    }

    fn check_range(&self, r: &Range<usize>, what: &str) -> Result<()> {
        if r.start > r.end || r.end > self.len() {
            bail!("internal: FlatBuf::{what}: range {r:?} outside a buffer of {}", self.len());
        }
        Ok(())
    }

    /// `check_range`, and `t` holds exactly `r.len()` values.
    fn check_fits(&self, r: &Range<usize>, t: &Tensor, what: &str) -> Result<()> {
        self.check_range(r, what)?;
        if t.elem_count() != r.len() {
            bail!("internal: FlatBuf::{what}: {} values for a range of {}", t.elem_count(), r.len());
        }
        Ok(())
    }
}

/// Sum of squares of a device buffer in f64: the CUDA kernel, or candle ops on a CPU tensor.
fn device_sum_squares(t: &Tensor) -> Result<f64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = t.device() {
        let (st, l) = t.storage_and_layout();
        let candle_core::Storage::Cuda(cs) = &*st else { bail!("internal: a CUDA tensor without CUDA storage") };
        let view = crate::ops::cuda::view::<f32>(cs, l, "sum_squares", "buffer")?;
        return Ok(crate::ops::cuda::grad_sumsq(dev, &view)?);
    }
    let mut s = 0f64;
    for r in FlatBuf::chunks(t.elem_count()) {
        s += t.narrow(0, r.start, r.len())?.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
    }
    Ok(s)
}

/// Values per rayon piece of the host loops below.
const PIECE: usize = 1 << 16;

/// `f` on every value, in pieces on rayon (the same bits as one loop). The per-step passes over the
/// whole gradient (zeroing, clipping) ran on one thread: `perf` of a 25.6M-parameter training step
/// (benchmark grid row 5) had the second thread idle a third of the step.
fn map_par(v: &mut [f32], f: impl Fn(&mut f32) + Sync) {
    use rayon::prelude::*;
    v.par_chunks_mut(PIECE).for_each(|c| c.iter_mut().for_each(&f));
}

/// Sum of squares in f64 in a fixed order that does not depend on the thread count: pieces of `PIECE`
/// values, each summed over 8 lanes (value i into lane i % 8, the lanes added in order), the pieces'
/// sums added in index order. One running sum in index order could not be vectorised (each add waits
/// for the one before): 3.9% of that step, on one thread.
fn sum_squares_host(v: &[f32]) -> f64 {
    use rayon::prelude::*;
    let piece = |c: &[f32]| {
        let mut lanes = [0f64; 8];
        let mut it = c.chunks_exact(8);
        for x in &mut it {
            for (l, &y) in lanes.iter_mut().zip(x) {
                *l += (y as f64) * (y as f64);
            }
        }
        for (l, &y) in lanes.iter_mut().zip(it.remainder()) {
            *l += (y as f64) * (y as f64);
        }
        lanes.iter().sum::<f64>()
    };
    let sums: Vec<f64> = v.par_chunks(PIECE).map(piece).collect();
    sums.iter().sum()
}

/// dst += src elementwise, in pieces on rayon (the same bits as one loop).
fn add_par(dst: &mut [f32], src: &[f32]) {
    use rayon::prelude::*;
    dst.par_chunks_mut(PIECE).zip(src.par_chunks(PIECE)).for_each(|(d, s)| {
        for (acc, x) in d.iter_mut().zip(s) {
            *acc += x;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer of `n` seeded values spread over six orders of magnitude (so the order of the sum matters).
    fn spread(n: usize) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        (0..n).map(|_| (r.random::<f32>() - 0.5) * 10f32.powi(r.random_range(-3..3))).collect()
    }

    #[test]
    fn host_sum_squares_is_the_sum_and_the_same_on_any_thread_count() {
        // pieces of PIECE values and a ragged last piece with a ragged last lane group
        for n in [0, 1, 7, 8, 9, PIECE - 1, PIECE, 3 * PIECE + 13] {
            let v = spread(n);
            let naive: f64 = v.iter().map(|&x| (x as f64) * (x as f64)).sum();
            let b = FlatBuf::Host(v.clone());
            let got = b.sum_squares().unwrap();
            assert!((got - naive).abs() <= 1e-12 * naive.max(1e-300), "n {n}: {got} vs {naive}");
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let again = pool.install(|| b.sum_squares().unwrap());
                assert_eq!(again.to_bits(), got.to_bits(), "n {n}, {threads} threads");
            }
            if n > 10 {
                let r = 5..n - 3;
                let part = b.range_sum_squares(r.clone()).unwrap();
                assert_eq!(part.to_bits(), FlatBuf::Host(v[r].to_vec()).sum_squares().unwrap().to_bits());
            }
        }
    }

    #[test]
    fn host_fill_and_scale_touch_every_value_as_one_loop_does() {
        let v = spread(2 * PIECE + 5);
        let mut b = FlatBuf::Host(v.clone());
        b.scale(0.37).unwrap();
        let FlatBuf::Host(scaled) = &b else { unreachable!() };
        assert!(scaled.iter().zip(&v).all(|(s, x)| s.to_bits() == (x * 0.37).to_bits()));
        b.fill(-2.5).unwrap();
        let FlatBuf::Host(filled) = &b else { unreachable!() };
        assert!(filled.len() == v.len() && filled.iter().all(|&x| x == -2.5));
    }

    #[test]
    fn host_views_round_trip_without_changing_values() {
        let t = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &Device::Cpu).unwrap();
        let mut b = FlatBuf::from_tensor(&t).unwrap();
        assert_eq!(b.host().unwrap(), &[1., 2., 3., 4., 5., 6.]);
        let p = b.param_tensor(2..6, &[2, 2], DType::F32, &Device::Cpu).unwrap();
        assert_eq!(p.to_vec2::<f32>().unwrap(), vec![vec![3., 4.], vec![5., 6.]]);
        b.add_tensor(0..2, &Tensor::new(&[0.5f32, -1.], &Device::Cpu).unwrap()).unwrap();
        assert_eq!(&b.host().unwrap()[..2], &[1.5, 1.0]);
        b.set_tensor(0..2, &Tensor::new(&[-0f32, 7.], &Device::Cpu).unwrap()).unwrap();
        assert_eq!(b.host().unwrap()[0].to_bits(), (-0f32).to_bits());
        assert!(b.add_tensor(5..7, &Tensor::new(&[0f32, 0.], &Device::Cpu).unwrap()).is_err());
        let mut z = FlatBuf::zeros(3, &Device::Cpu).unwrap();
        z.copy_from(1, &b, 4..6).unwrap();
        assert_eq!(z.to_host().unwrap().as_ref(), &[0., 5., 6.]);
        assert_eq!(z.sum_squares().unwrap(), 61.0);
        z.scale(2.0).unwrap();
        assert_eq!(z.slice_to_owned(1..3).unwrap(), FlatBuf::from_vec(vec![10., 12.]));
        z.host_mut().unwrap()[0] = f32::INFINITY;
        assert!(!z.all_finite().unwrap());
        z.fill(0.0).unwrap();
        assert!(z.all_finite().unwrap() && z.sum_squares().unwrap() == 0.0);
    }

    /// Ragged pseudo-random values (no two equal, signs mixed, some large).
    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32).map(|i| ((i * 7919 + seed * 104729) % 1009) as f32 / 97.0 - 5.0 + i as f32 * 1e-3).collect()
    }

    /// The same sequence of every method on a host buffer and on the device variant (a CPU tensor) gives
    /// the same values at every step.
    #[test]
    fn device_variant_equals_host_for_every_method() {
        let dev = Device::Cpu;
        let dp = Placement::Device(dev.clone());
        let n = 37;
        let src = Tensor::from_vec(values(n, 1), (n,), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let mut h = FlatBuf::from_tensor(&src).unwrap();
        let mut d = FlatBuf::from_tensor_in(&src, &dp).unwrap();
        assert!(matches!(d, FlatBuf::Device(_)) && matches!(h, FlatBuf::Host(_)));
        let same = |h: &FlatBuf, d: &FlatBuf, what: &str| {
            assert_eq!(h.len(), d.len(), "{what}");
            assert_eq!(h.host().unwrap(), d.to_host().unwrap().as_ref(), "{what}");
        };
        same(&h, &d, "from_tensor (bf16)");
        assert!(d.host().is_err() && d.host_mut().is_err(), "a device buffer refuses host borrows");
        let g = Tensor::from_vec(values(12, 2), (3, 4), &dev).unwrap();
        h.add_tensor(5..17, &g).unwrap();
        d.add_tensor(5..17, &g).unwrap();
        same(&h, &d, "add_tensor");
        let g16 = g.to_dtype(DType::BF16).unwrap();
        h.add_tensor(20..32, &g16).unwrap();
        d.add_tensor(20..32, &g16).unwrap();
        same(&h, &d, "add_tensor (bf16)");
        assert!(d.add_tensor(30..42, &g).is_err() && d.add_tensor(0..11, &g).is_err());
        h.set_tensor(1..13, &g).unwrap();
        d.set_tensor(1..13, &g).unwrap();
        same(&h, &d, "set_tensor");
        for (dtype, shape) in [(DType::F32, vec![2, 5]), (DType::BF16, vec![10])] {
            let a = h.param_tensor(3..13, &shape, dtype, &dev).unwrap();
            let b = d.param_tensor(3..13, &shape, dtype, &dev).unwrap();
            assert_eq!((a.dims(), a.dtype()), (b.dims(), b.dtype()));
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(f(&a), f(&b), "param_tensor {dtype:?}");
        }
        // a view is a copy: later in-place updates do not show through it
        let view = d.param_tensor(0..4, &[4], DType::F32, &dev).unwrap();
        let before = view.to_vec1::<f32>().unwrap();
        d.scale(3.0).unwrap();
        h.scale(3.0).unwrap();
        assert_eq!(view.to_vec1::<f32>().unwrap(), before);
        same(&h, &d, "scale");
        assert_eq!(h.sum_squares().unwrap(), d.sum_squares().unwrap(), "sum_squares");
        assert_eq!(h.range_to_host(4..9).unwrap(), d.range_to_host(4..9).unwrap());
        let (hs, ds) = (h.slice_to_owned(2..30).unwrap(), d.slice_to_owned(2..30).unwrap());
        assert!(matches!(ds, FlatBuf::Device(_)));
        same(&hs, &ds, "slice_to_owned");
        // copy_from between every pair of placements
        let mut hz = h.zeros_like(40).unwrap();
        let mut dz = d.zeros_like(40).unwrap();
        hz.copy_from(3, &hs, 5..20).unwrap();
        dz.copy_from(3, &ds, 5..20).unwrap();
        same(&hz, &dz, "copy_from device->device");
        hz.copy_from(20, &ds, 0..10).unwrap();
        dz.copy_from(20, &hs, 0..10).unwrap();
        same(&hz, &dz, "copy_from across placements");
        // a clone is independent of the original
        let mut dc = d.try_clone().unwrap();
        dc.fill(1.5).unwrap();
        same(&h, &d, "clone is a copy");
        assert_eq!(dc.to_host().unwrap().as_ref(), vec![1.5f32; n].as_slice());
        // collectives through the host, placement round trips
        d.with_host_mut(|v| {
            v[0] = 42.0;
            Ok(())
        })
        .unwrap();
        h.host_mut().unwrap()[0] = 42.0;
        same(&h, &d, "with_host_mut");
        let back = d.try_clone().unwrap().placed(&Placement::Host).unwrap();
        same(&h, &back, "placed(Host)");
        same(&h, &h.like(h.host().unwrap().to_vec()).unwrap(), "like (host)");
        assert!(matches!(d.like(vec![1.0]).unwrap(), FlatBuf::Device(_)));
        assert!(h.all_finite().unwrap() && d.all_finite().unwrap());
        d.set_tensor(7..8, &Tensor::new(&[f32::NAN], &dev).unwrap()).unwrap();
        assert!(!d.all_finite().unwrap());
        d.set_tensor(7..8, &Tensor::new(&[f32::NEG_INFINITY], &dev).unwrap()).unwrap();
        assert!(!d.all_finite().unwrap());
        h.fill(0.25).unwrap();
        d.fill(0.25).unwrap();
        same(&h, &d, "fill");
    }
}
