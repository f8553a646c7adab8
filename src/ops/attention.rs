//! Causal GQA attention, flash-style: CPU reference forward and backward, and a slow version.
//!
//! Reference: FlashAttention-2 (Dao 2023) Algorithms 1-2; HF Llama `eager_attention_forward`.
//! q: (B, H, Tq, D); k, v: (B, Hkv, Tk, D) with H % Hkv == 0 (query head h reads kv head h / (H/Hkv),
//! no repeat_kv copy). Causal: query i sits at absolute position (Tk - Tq) + i and sees keys j <= that
//! (so a KV-cached decode step is the same op with Tq < Tk).
//! Forward, per query row: online softmax over key blocks of `BLOCK_K` (running max m, sum l, accumulator),
//! saving lse = m + ln l per row. Nothing of size (Tq x Tk) is ever allocated: memory is O(T D).
//! Backward, per (b, kv head) so that dK/dV have one owner: Δ_i = dO_i·O_i; for each allowed (i, j):
//! p = exp(s_ij - lse_i), dV_j += p dO_i, ds = p (dO_i·V_j - Δ_i), dQ_i += scale ds K_j,
//! dK_j += scale ds Q_i. The lse saved by the forward is kept in the op (recomputed if missing).
//! Not done here: dropout, sliding windows, document masks (later issues).
use crate::ops::rotary::f32_slice;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::sync::Mutex;

const BLOCK_K: usize = 64;

/// Problem sizes shared by forward and backward.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub b: usize,
    pub h: usize,
    pub hkv: usize,
    pub tq: usize,
    pub tk: usize,
    pub d: usize,
}

impl AttnDims {
    fn limit(&self, causal: bool, i: usize) -> usize {
        if causal {
            (self.tk - self.tq + i + 1).min(self.tk)
        } else {
            self.tk
        }
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Forward reference: returns (O (B,H,Tq,D), lse (B,H,Tq)).
pub fn attention_fwd_cpu(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    scale: f32,
    causal: bool,
) -> (Vec<f32>, Vec<f32>) {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let rep = h / hkv;
    let mut out = vec![0f32; b * h * tq * d];
    let mut lse = vec![0f32; b * h * tq];
    out.par_chunks_mut(tq * d).zip(lse.par_chunks_mut(tq)).enumerate().for_each(|(bh, (o, l_out))| {
        let (bi, hi) = (bh / h, bh % h);
        let g = hi / rep;
        let qh = &q[bh * tq * d..(bh + 1) * tq * d];
        let kh = &k[(bi * hkv + g) * tk * d..(bi * hkv + g + 1) * tk * d];
        let vh = &v[(bi * hkv + g) * tk * d..(bi * hkv + g + 1) * tk * d];
        let mut s = [0f32; BLOCK_K];
        for i in 0..tq {
            let qi = &qh[i * d..(i + 1) * d];
            let acc = &mut o[i * d..(i + 1) * d];
            let lim = dims.limit(causal, i);
            let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
            for kb in (0..lim).step_by(BLOCK_K) {
                let ke = (kb + BLOCK_K).min(lim);
                let mut bm = f32::NEG_INFINITY;
                for j in kb..ke {
                    let x = dot(qi, &kh[j * d..(j + 1) * d]) * scale;
                    s[j - kb] = x;
                    bm = bm.max(x);
                }
                let mnew = m.max(bm);
                let corr = if m == f32::NEG_INFINITY { 0.0 } else { (m - mnew).exp() };
                l *= corr;
                acc.iter_mut().for_each(|a| *a *= corr);
                for j in kb..ke {
                    let p = (s[j - kb] - mnew).exp();
                    l += p;
                    for (a, vv) in acc.iter_mut().zip(&vh[j * d..(j + 1) * d]) {
                        *a += p * vv;
                    }
                }
                m = mnew;
            }
            if l > 0.0 {
                acc.iter_mut().for_each(|a| *a /= l);
                l_out[i] = m + l.ln();
            } else {
                l_out[i] = f32::NEG_INFINITY;
            }
        }
    });
    (out, lse)
}

/// Backward reference: returns (dQ, dK, dV) with the shapes of q, k, v.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_cpu(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    lse: &[f32],
    dout: &[f32],
    dims: AttnDims,
    scale: f32,
    causal: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let AttnDims { h, hkv, tq, tk, d, .. } = dims;
    let rep = h / hkv;
    let mut dq = vec![0f32; q.len()];
    let mut dk = vec![0f32; k.len()];
    let mut dv = vec![0f32; v.len()];
    // One task per (b, kv head): it owns dK, dV of that head and dQ of its `rep` query heads.
    dq.par_chunks_mut(rep * tq * d).zip(dk.par_chunks_mut(tk * d).zip(dv.par_chunks_mut(tk * d))).enumerate().for_each(
        |(bg, (dq_g, (dk_g, dv_g)))| {
            let kh = &k[bg * tk * d..(bg + 1) * tk * d];
            let vh = &v[bg * tk * d..(bg + 1) * tk * d];
            let (bi, g) = (bg / hkv, bg % hkv);
            for r in 0..rep {
                let bh = bi * h + g * rep + r;
                let base = bh * tq * d;
                let dq_h = &mut dq_g[r * tq * d..(r + 1) * tq * d];
                for i in 0..tq {
                    let qi = &q[base + i * d..base + (i + 1) * d];
                    let doi = &dout[base + i * d..base + (i + 1) * d];
                    let delta = dot(doi, &o[base + i * d..base + (i + 1) * d]);
                    let li = lse[bh * tq + i];
                    if li == f32::NEG_INFINITY {
                        continue;
                    }
                    let dqi = &mut dq_h[i * d..(i + 1) * d];
                    for j in 0..dims.limit(causal, i) {
                        let kj = &kh[j * d..(j + 1) * d];
                        let vj = &vh[j * d..(j + 1) * d];
                        let p = (dot(qi, kj) * scale - li).exp();
                        let ds = p * (dot(doi, vj) - delta) * scale;
                        for c in 0..d {
                            dv_g[j * d + c] += p * doi[c];
                            dk_g[j * d + c] += ds * qi[c];
                            dqi[c] += ds * kj[c];
                        }
                    }
                }
            }
        },
    );
    (dq, dk, dv)
}

/// The custom op; keeps the forward's lse for the backward.
struct Attention {
    scale: f32,
    causal: bool,
    lse: Mutex<Option<Vec<f32>>>,
}

fn dims_of(lq: &Layout, lk: &Layout, lv: &Layout) -> Result<AttnDims> {
    let (b, h, tq, d) = lq.shape().dims4()?;
    let (bk, hkv, tk, dk) = lk.shape().dims4()?;
    if bk != b || dk != d || lk.shape() != lv.shape() || hkv == 0 || h % hkv != 0 {
        candle_core::bail!(
            "attention: q {:?}, k {:?}, v {:?} do not fit (need q (B,H,Tq,D), k = v (B,Hkv,Tk,D), H % Hkv == 0)",
            lq.shape(),
            lk.shape(),
            lv.shape()
        );
    }
    Ok(AttnDims { b, h, hkv, tq, tk, d })
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "harpe-attention"
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
        let dims = dims_of(l1, l2, l3)?;
        if self.causal && dims.tk < dims.tq {
            candle_core::bail!("attention: causal attention needs Tk >= Tq, got Tq {} Tk {}", dims.tq, dims.tk);
        }
        let q = f32_slice(s1, l1, "attention", "q")?;
        let k = f32_slice(s2, l2, "attention", "k")?;
        let v = f32_slice(s3, l3, "attention", "v")?;
        let (o, lse) = attention_fwd_cpu(q, k, v, dims, self.scale, self.causal);
        if let Ok(mut g) = self.lse.lock() {
            *g = Some(lse);
        }
        Ok((CpuStorage::F32(o), l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let vec = |t: &Tensor| -> Result<Vec<f32>> { t.contiguous()?.flatten_all()?.to_vec1::<f32>() };
        let (qv, kv, vv, ov, dov) = (vec(q)?, vec(k)?, vec(v)?, vec(res)?, vec(grad)?);
        let (b, h, tq, d) = q.dims4()?;
        let (_, hkv, tk, _) = k.dims4()?;
        let dims = AttnDims { b, h, hkv, tq, tk, d };
        let saved = self.lse.lock().ok().and_then(|mut g| g.take());
        let lse = match saved {
            Some(l) => l,
            None => attention_fwd_cpu(&qv, &kv, &vv, dims, self.scale, self.causal).1,
        };
        let (dq, dk, dv) = attention_bwd_cpu(&qv, &kv, &vv, &ov, &lse, &dov, dims, self.scale, self.causal);
        let dev = q.device();
        Ok((
            Some(Tensor::from_vec(dq, q.shape(), dev)?),
            Some(Tensor::from_vec(dk, k.shape(), dev)?),
            Some(Tensor::from_vec(dv, v.shape(), dev)?),
        ))
    }
}

/// Causal (or full) attention softmax(q k^T * scale) v with GQA; differentiable in q, k, v.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, causal: bool) -> Result<Tensor> {
    let dtype = q.dtype();
    let f = |t: &Tensor| -> Result<Tensor> { t.to_dtype(DType::F32)?.contiguous() };
    let op = Attention { scale, causal, lse: Mutex::new(None) };
    f(q)?.apply_op3(&f(k)?, &f(v)?, op)?.to_dtype(dtype)
}

/// The same attention from plain candle ops (materializes (Tq x Tk): tests and tiny shapes only).
pub fn attention_slow(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, causal: bool) -> Result<Tensor> {
    let (b, h, tq, d) = q.dims4()?;
    let (_, hkv, tk, _) = k.dims4()?;
    let rep = h / hkv;
    let repeat =
        |t: &Tensor| -> Result<Tensor> { t.unsqueeze(2)?.expand((b, hkv, rep, tk, d))?.reshape((b, h, tk, d)) };
    let (k, v) = (repeat(k)?, repeat(v)?);
    let mut s = (q.matmul(&k.t()?.contiguous()?)? * scale as f64)?; // (B, H, Tq, Tk)
    if causal {
        let off = tk - tq;
        let mask: Vec<f32> =
            (0..tq).flat_map(|i| (0..tk).map(move |j| if j <= off + i { 0.0 } else { f32::NEG_INFINITY })).collect();
        let mask = Tensor::from_vec(mask, (tq, tk), q.device())?.to_dtype(s.dtype())?;
        s = s.broadcast_add(&mask)?;
    }
    let m = s.max_keepdim(3)?;
    let e = s.broadcast_sub(&m)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(3)?)?;
    p.matmul(&v.contiguous()?)
}
