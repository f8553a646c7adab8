//! Rotary position embedding with per-head cos/sin tables (HARPE) — CPU reference, backward, slow version.
//!
//! Reference: HF Llama `rotate_half` / `apply_rotary_pos_emb` (pairs (j, j + D/2)); HARPE Eq. 6-8.
//! x: (B, H, T, D); cos, sin: (Htab, T, D/2) with H % Htab == 0, head h reading table h / (H / Htab),
//! so one table (classic schemes), Hkv tables for keys or queries of a GQA model (HARPE) all work.
//!   y[j]       = x[j] cos[j] - x[j + D/2] sin[j]
//!   y[j + D/2] = x[j + D/2] cos[j] + x[j] sin[j]
//! Backward is the rotation by the opposite angle: dx = rope(dy, cos, -sin) (an attention factor on
//! cos and sin is a scale, so the same formula holds). The op computes in f32; `rope` upcasts
//! bf16/f16 inputs and casts back. Not done here: building the tables (`model::rope`).
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

/// A contiguous f32 view of a CPU storage, or a clear error.
pub(crate) fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, op: &str, arg: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else { candle_core::bail!("{op}: `{arg}` must be f32") };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{op}: `{arg}` must be contiguous"),
    }
}

struct Rotary;

/// The reference loops: one (b, h, t) row at a time.
pub fn rotary_cpu(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    (b, h, t, d): (usize, usize, usize, usize),
    htab: usize,
) -> Vec<f32> {
    let half = d / 2;
    let rep = h / htab;
    let mut y = vec![0f32; x.len()];
    for bi in 0..b {
        for hi in 0..h {
            let tab = hi / rep;
            for ti in 0..t {
                let row = ((bi * h + hi) * t + ti) * d;
                let trow = (tab * t + ti) * half;
                for j in 0..half {
                    let (c, s) = (cos[trow + j], sin[trow + j]);
                    let (x1, x2) = (x[row + j], x[row + j + half]);
                    y[row + j] = x1 * c - x2 * s;
                    y[row + j + half] = x2 * c + x1 * s;
                }
            }
        }
    }
    y
}

impl CustomOp3 for Rotary {
    fn name(&self) -> &'static str {
        "harpe-rotary"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, h, t, d) = l1.shape().dims4()?;
        let (htab, tt, half) = l2.shape().dims3()?;
        if tt != t || half * 2 != d || h % htab != 0 || l3.shape() != l2.shape() {
            candle_core::bail!(
                "rotary: x {:?} does not match tables cos {:?} sin {:?} (need (Htab, T, D/2) with H % Htab == 0)",
                l1.shape(),
                l2.shape(),
                l3.shape()
            );
        }
        let x = f32_slice(s1, l1, "rotary", "x")?;
        let cos = f32_slice(s2, l2, "rotary", "cos")?;
        let sin = f32_slice(s3, l3, "rotary", "sin")?;
        let y = rotary_cpu(x, cos, sin, (b, h, t, d), htab);
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dx = grad.contiguous()?.apply_op3(cos, &sin.neg()?, Rotary)?; // itself differentiable
        Ok((Some(dx), None, None))
    }
}

/// Apply RoPE to x (B, H, T, D) with tables (Htab, T, D/2); differentiable in x.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(DType::F32)?.contiguous()?;
    let y = xf.apply_op3(&cos.contiguous()?, &sin.contiguous()?, Rotary)?;
    y.to_dtype(dtype)
}

/// The same rotation from plain candle ops (rotate_half form), for tests.
pub fn rope_slow(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = x.dims4()?;
    let (htab, _, half) = cos.dims3()?;
    let rep = h / htab;
    // (Htab, T, D/2) -> (1, H, T, D) with each table repeated for its `rep` heads and both halves.
    let expand = |tab: &Tensor| -> Result<Tensor> {
        let full = Tensor::cat(&[tab, tab], 2)?; // (Htab, T, D)
        full.unsqueeze(1)?.expand((htab, rep, t, d))?.reshape((1, h, t, d))?.broadcast_as((b, h, t, d))
    };
    let (c, s) = (expand(cos)?, expand(sin)?);
    let x1 = x.narrow(3, 0, half)?;
    let x2 = x.narrow(3, half, half)?;
    let rot = Tensor::cat(&[&x2.neg()?, &x1], 3)?;
    x.broadcast_mul(&c)? + rot.broadcast_mul(&s)?
}
