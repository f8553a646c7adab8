//! `FlatBuf`: one fp32 buffer over the flat parameter index space (HF order), the single type of
//! training state: master weights, AdamW moments, gradients, and the gathered weights are all FlatBufs.
//!
//! Reference: llm.c `train_gpt2.cu` (one contiguous buffer per kind of state, parameters as offsets
//! into it), DESIGN.md §6 ("training state is FlatBufs over one flat index space").
//! The non-obvious decision: the interface speaks in flat ranges and 1-D candle tensors, never in host
//! slices, so a device variant (a `Cuda` 1-D f32 tensor, added by the GPU work) needs no change at the
//! call sites: a parameter view is `param_tensor(range, shape, ..)` (narrow + reshape on a device), a
//! gradient is added with `add_tensor`, and host access is explicit (`host` / `host_mut` borrow without
//! a copy on the host variant and refuse on a device one; `to_host` always works and copies only there).
//! Reductions accumulate in f64 in index order, exactly as the loops they replace, so the CPU path is
//! bit-identical to the `Vec<f32>` code it wraps.
//! What this file does not do: know which parameter lives where (`grads::ParamLayout`) or which rank
//! owns what (`comms::zero::ShardMap`).
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::borrow::Cow;
use std::ops::Range;

/// One fp32 buffer of training state, on the host (today) or on a device (the GPU variant).
#[derive(Clone, Debug, PartialEq)]
pub enum FlatBuf {
    /// host memory: the CPU build's training state, exactly today's `Vec<f32>`
    Host(Vec<f32>),
}

impl FlatBuf {
    /// `n` zeros on `device`.
    pub fn zeros(n: usize, device: &Device) -> Result<FlatBuf> {
        match device {
            Device::Cpu => Ok(FlatBuf::Host(vec![0.0; n])),
            d => bail!("FlatBuf on {d:?} is not implemented in this build\nhint: use train.device = \"cpu\""),
        }
    }

    /// Wrap host values (no copy).
    pub fn from_vec(v: Vec<f32>) -> FlatBuf {
        FlatBuf::Host(v)
    }

    /// The values of a tensor of any shape and float dtype, flattened, as fp32 on the tensor's device.
    pub fn from_tensor(t: &Tensor) -> Result<FlatBuf> {
        match t.device() {
            Device::Cpu => Ok(FlatBuf::Host(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)),
            d => bail!("FlatBuf on {d:?} is not implemented in this build\nhint: use train.device = \"cpu\""),
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            FlatBuf::Host(v) => v.len(),
        }
    }

    /// True when the buffer holds no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device the values live on.
    pub fn device(&self) -> Device {
        match self {
            FlatBuf::Host(_) => Device::Cpu,
        }
    }

    /// Borrow the values on the host (no copy); a device buffer refuses, use `to_host`.
    pub fn host(&self) -> Result<&[f32]> {
        match self {
            FlatBuf::Host(v) => Ok(v),
        }
    }

    /// Borrow the values on the host mutably (no copy); a device buffer refuses.
    pub fn host_mut(&mut self) -> Result<&mut [f32]> {
        match self {
            FlatBuf::Host(v) => Ok(v),
        }
    }

    /// The values on the host: borrowed for a host buffer, copied from a device one.
    pub fn to_host(&self) -> Result<Cow<'_, [f32]>> {
        match self {
            FlatBuf::Host(v) => Ok(Cow::Borrowed(v)),
        }
    }

    /// The values of `range` as a tensor of `shape` in `dtype` on `device` (a parameter's view).
    pub fn param_tensor(&self, range: Range<usize>, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        self.check_range(&range, "param_tensor")?;
        match self {
            FlatBuf::Host(v) => Ok(Tensor::from_slice(&v[range], shape, device)?.to_dtype(dtype)?),
        }
    }

    /// Add the values of `t` (any shape, `range.len()` elements) to `range`, in fp32.
    pub fn add_tensor(&mut self, range: Range<usize>, t: &Tensor) -> Result<()> {
        self.check_range(&range, "add_tensor")?;
        match self {
            FlatBuf::Host(v) => {
                let g = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>().context("reading a tensor to add")?;
                if g.len() != range.len() {
                    bail!("internal: adding {} values into a range of {}", g.len(), range.len());
                }
                for (acc, x) in v[range].iter_mut().zip(&g) {
                    *acc += x;
                }
                Ok(())
            }
        }
    }

    /// Overwrite `range` with the values of `t` (any shape and float dtype, `range.len()` elements).
    pub fn set_tensor(&mut self, range: Range<usize>, t: &Tensor) -> Result<()> {
        self.check_range(&range, "set_tensor")?;
        match self {
            FlatBuf::Host(v) => {
                let x = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>().context("reading a tensor")?;
                if x.len() != range.len() {
                    bail!("internal: writing {} values into a range of {}", x.len(), range.len());
                }
                v[range].copy_from_slice(&x);
                Ok(())
            }
        }
    }

    /// Copy `src[src_range]` into `self[dst_start..]` (same device).
    pub fn copy_from(&mut self, dst_start: usize, src: &FlatBuf, src_range: Range<usize>) -> Result<()> {
        src.check_range(&src_range, "copy_from (source)")?;
        self.check_range(&(dst_start..dst_start + src_range.len()), "copy_from (destination)")?;
        match (self, src) {
            (FlatBuf::Host(d), FlatBuf::Host(s)) => {
                d[dst_start..dst_start + src_range.len()].copy_from_slice(&s[src_range]);
                Ok(())
            }
        }
    }

    /// A new buffer holding a copy of `range`.
    pub fn slice_to_owned(&self, range: Range<usize>) -> Result<FlatBuf> {
        self.check_range(&range, "slice_to_owned")?;
        match self {
            FlatBuf::Host(v) => Ok(FlatBuf::Host(v[range].to_vec())),
        }
    }

    /// Set every value to `x`.
    pub fn fill(&mut self, x: f32) {
        match self {
            FlatBuf::Host(v) => v.iter_mut().for_each(|y| *y = x),
        }
    }

    /// Multiply every value by `s`.
    pub fn scale(&mut self, s: f32) {
        match self {
            FlatBuf::Host(v) => v.iter_mut().for_each(|x| *x *= s),
        }
    }

    /// Sum of squares, accumulated in f64 in index order.
    pub fn sum_squares(&self) -> f64 {
        match self {
            FlatBuf::Host(v) => v.iter().map(|&x| (x as f64) * (x as f64)).sum(),
        }
    }

    /// True when every value is finite.
    pub fn all_finite(&self) -> bool {
        match self {
            FlatBuf::Host(v) => v.iter().all(|x| x.is_finite()),
        }
    }

    fn check_range(&self, r: &Range<usize>, what: &str) -> Result<()> {
        if r.start > r.end || r.end > self.len() {
            bail!("internal: FlatBuf::{what}: range {r:?} outside a buffer of {}", self.len());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(z.sum_squares(), 61.0);
        z.scale(2.0);
        assert_eq!(z.slice_to_owned(1..3).unwrap(), FlatBuf::from_vec(vec![10., 12.]));
        z.host_mut().unwrap()[0] = f32::INFINITY;
        assert!(!z.all_finite());
        z.fill(0.0);
        assert!(z.all_finite() && z.sum_squares() == 0.0);
    }
}
