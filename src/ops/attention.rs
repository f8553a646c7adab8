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
//! dK_j += scale ds Q_i. The backward is its own op (`AttentionBwd`, with its `cpu_fwd` and `cuda_fwd`),
//! fed by tensors only: the forward's output packs O with lse as a (B, H, Tq, D + E) tensor in the run dtype
//! (`ops::attention_shape::PackedRows`: E = 1 for f32, lse's f32 plus a pad in 8 slots for bf16/f16), so the
//! lse autograd saves lives where O lives (no host copy, no state in the op, no f32 copy of O on CUDA).
//! `attention_blocked` (query blocks against all keys, plain candle ops) and `attention_slow` (full
//! (Tq x Tk) scores) are the references; `model::attention::AttentionImpl` chooses among them.
//! The op runs either the scalar loops below (`CpuKernel::Reference` through `attention_with`) or the
//! same algorithm on GEMM blocks (`CpuKernel::Gemm`, `ops::attention_gemm`, what `attention` runs); on a
//! CUDA device its `cuda_fwd`s launch kernels/attention.cu (`ops::attention_cuda`) with the same packed
//! layouts, in the inputs' dtype (bf16/f16: the tensor-core tiles).
//! One public entry per level, each taking the document mask as `Option<&DocStarts>`: `attention` (the op;
//! `attention_with` chooses its CPU loops), `attention_blocked` and `attention_slow` (candle-op references),
//! `attention_fwd_cpu` / `attention_bwd_cpu` (the scalar loops on slices).
//! Document masks (packed sequences, `docs: Some(..)`): query i sees key j only if j <= i and both lie in
//! one document. Documents are given as `DocStarts`, per token the position its document starts at, a
//! (B, Tk) u32 tensor — not cu_seqlens offsets, because (1) the allowed keys of row i are then one range
//! `doc_start[i] ..= i`, so every loop below (and every kernel tile loop) just gets a lower bound beside the
//! causal upper one, and a tile whose keys all lie before its first row's document start is skipped
//! without a search; (2) our batches are fixed (B, T), not one flat ragged sequence, so a per-sequence
//! tensor keeps the op's (B, H, T, D) layouts; (3) under Ulysses every rank holds the same tensor for the
//! whole (global) sequence. The GEMM blocks (`ops::attention_gemm`) take the same mask.
//! Not done here: dropout, sliding windows.
use crate::ops::attention_gemm::{attention_bwd_gemm, attention_fwd_gemm};
use crate::ops::attention_shape::{AttnDims, AttnMask, PackedRows};
use crate::ops::rotary::f32_slice;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::sync::Arc;

const BLOCK_K: usize = 64;

/// Document boundaries of packed sequences: for sequence b and token j, the position where j's document
/// starts (`<= j`; equal to the previous token's start or to j itself). (B, T) u32 on the compute device,
/// with its host copy (the CPU loops read that one).
#[derive(Clone, Debug)]
pub struct DocStarts {
    b: usize,
    t: usize,
    host: Arc<Vec<u32>>,
    tensor: Tensor, // (B, T) u32
}

impl DocStarts {
    /// From each sequence's document start positions (cu_seqlens-style offsets within the sequence, sorted
    /// or not; 0 is implied: a sequence that opens mid-document has its first piece as a document).
    pub fn from_starts(starts: &[&[usize]], t: usize, device: &Device) -> Result<DocStarts> {
        let mut host = Vec::with_capacity(starts.len() * t);
        for (bi, st) in starts.iter().enumerate() {
            let mut st: Vec<usize> = st.to_vec();
            st.sort_unstable();
            if let Some(&bad) = st.iter().find(|&&s| s >= t) {
                candle_core::bail!("document starts: sequence {bi} has a start at {bad}, past its {t} tokens\nhint: starts are positions inside each sequence");
            }
            let (mut cur, mut n) = (0u32, 0);
            for j in 0..t {
                while n < st.len() && st[n] <= j {
                    cur = st[n] as u32;
                    n += 1;
                }
                host.push(cur);
            }
        }
        Self::from_per_token(host, starts.len(), t, device)
    }

    /// From the per-token starts themselves ((B*T) values, row-major), checked.
    pub fn from_per_token(host: Vec<u32>, b: usize, t: usize, device: &Device) -> Result<DocStarts> {
        if host.len() != b * t || b == 0 || t == 0 {
            candle_core::bail!(
                "document starts: {} values for B {b} x T {t}\nhint: one start per token of every sequence",
                host.len()
            );
        }
        for (bi, row) in host.chunks(t).enumerate() {
            for (j, &s) in row.iter().enumerate() {
                let prev = if j == 0 { 0 } else { row[j - 1] };
                if s as usize != j && (j == 0 || s != prev) {
                    candle_core::bail!(
                        "document starts: sequence {bi}, token {j} starts at {s}, but a token's document starts at itself or where the previous token's did ({prev})\nhint: build them with DocStarts::from_starts"
                    );
                }
            }
        }
        let tensor = Tensor::from_slice(&host, (b, t), device)?;
        Ok(DocStarts { b, t, host: Arc::new(host), tensor })
    }

    /// (B, T).
    pub fn dims(&self) -> (usize, usize) {
        (self.b, self.t)
    }

    /// The per-token starts, (B*T) row-major.
    pub fn host(&self) -> &[u32] {
        &self.host
    }

    /// The per-token starts on the compute device, (B, T) u32.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// An error unless these starts fit attention with batch `b` over `tk` keys (causal only).
    fn check(&self, b: usize, tk: usize, causal: bool) -> Result<()> {
        if !causal {
            candle_core::bail!(
                "attention: a document mask needs causal attention\nhint: pass causal = true with a document mask"
            );
        }
        if (self.b, self.t) != (b, tk) {
            candle_core::bail!(
                "attention: document starts are for (B {}, T {}) but k has B {b}, Tk {tk}\nhint: build DocStarts from the whole (global) sequences of the batch",
                self.b,
                self.t
            );
        }
        Ok(())
    }
}

/// Keys query row `i` of sequence `bi` may see: `lo..hi` (causal limit, and its document's start).
#[inline]
fn key_range(dims: &AttnDims, causal: bool, docs: Option<&[u32]>, bi: usize, i: usize) -> (usize, usize) {
    (dims.first_key(causal, docs, bi, i), dims.limit(causal, i))
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Forward reference: returns (O (B,H,Tq,D), lse (B,H,Tq)). `docs` an optional document mask: (B*Tk) per key
/// position, the start of its document (`DocStarts::host`); query row i (at key position p) sees keys
/// docs[p]..=p.
pub fn attention_fwd_cpu(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    scale: f32,
    causal: bool,
    docs: Option<&[u32]>,
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
            let (lo, lim) = key_range(&dims, causal, docs, bi, i);
            let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
            for kb in (lo..lim).step_by(BLOCK_K) {
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

/// Backward reference: returns (dQ, dK, dV) with the shapes of q, k, v, under `attention_fwd_cpu`'s optional
/// document mask `docs`.
pub fn attention_bwd_cpu(
    (q, k, v): (&[f32], &[f32], &[f32]),
    (o, lse): (&[f32], &[f32]),
    dout: &[f32],
    dims: AttnDims,
    AttnMask { scale, causal, docs }: AttnMask<'_>,
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
                    let (lo, hi) = key_range(&dims, causal, docs, bi, i);
                    for j in lo..hi {
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

/// The forward op. Its output packs O and the log-sum-exp as one (B, H, Tq, D + E) tensor in the run dtype
/// (`[.., ..D]` = O, lse's f32 in the slots after it: `PackedRows`), so the lse the backward needs is a
/// tensor autograd keeps for us (on the device of the op), not state inside the op.
struct AttentionFwd {
    scale: f32,
    causal: bool,
    kernel: CpuKernel,
    docs: Option<DocStarts>,
}

/// Which CPU loops the attention op (forward and backward) runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuKernel {
    /// The readable scalar reference loops of this file.
    Reference,
    /// The same algorithm on GEMM blocks (`ops::attention_gemm`): the fast default.
    Gemm,
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

/// Interleave O (rows of D) and lse (one per row) into rows of D + 1.
fn pack_o_lse(o: &[f32], lse: &[f32], d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(o.len() + lse.len());
    for (row, l) in o.chunks(d).zip(lse) {
        out.extend_from_slice(row);
        out.push(*l);
    }
    out
}

impl CustomOp3 for AttentionFwd {
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
        if let Some(ds) = &self.docs {
            ds.check(dims.b, dims.tk, self.causal)?;
        }
        let q = f32_slice(s1, l1, "attention", "q")?;
        let k = f32_slice(s2, l2, "attention", "k")?;
        let v = f32_slice(s3, l3, "attention", "v")?;
        let AttnDims { b, h, tq, d, .. } = dims;
        let docs = self.docs.as_ref().map(|ds| ds.host());
        let packed = match self.kernel {
            CpuKernel::Gemm => attention_fwd_gemm(q, k, v, dims, self.scale, self.causal, docs),
            CpuKernel::Reference => {
                let (o, lse) = attention_fwd_cpu(q, k, v, dims, self.scale, self.causal, docs);
                pack_o_lse(&o, &lse, d)
            }
        };
        Ok((CpuStorage::F32(packed), Shape::from_dims(&[b, h, tq, d + 1])))
    }

    /// The flash kernels of kernels/attention.cu (tensor-core tiles for aligned bf16/f16 at D = 64, 128;
    /// FMA tiles otherwise) with the same packed O|lse f32 output as `cpu_fwd`.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let docs = self.docs.as_ref().map(|ds| ds.tensor());
        let mask = crate::ops::attention_shape::AttnMask::new(self.scale, self.causal, docs);
        crate::ops::attention_cuda::fwd_packed((s1, l1), (s2, l2), (s3, l3), mask)
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = q.dim(3)?;
        // (B, H, Tq, 3D + 2E) in the run dtype: q | O | lse | dO | d(lse) (zero: lse is not an output of
        // `attention`) — the op's one packing copy (`AttnWorkspace::bwd_packed`), read in place by the kernels
        let run = res.dtype();
        let packed = Tensor::cat(&[&q.detach().to_dtype(run)?, &res.detach(), &grad.detach().to_dtype(run)?], 3)?;
        let flat = packed.apply_op3(
            &k.detach(),
            &v.detach(),
            AttentionBwd { scale: self.scale, causal: self.causal, d, kernel: self.kernel, docs: self.docs.clone() },
        )?;
        let (nq, nk) = (q.elem_count(), k.elem_count());
        let part = |at: usize, t: &Tensor| flat.narrow(0, at, t.elem_count())?.reshape(t.shape());
        Ok((Some(part(0, q)?), Some(part(nq, k)?), Some(part(nq + nk, v)?)))
    }
}

/// The backward op: inputs `packed` (B, H, Tq, 3D + 2E) = [q | O | lse | dO | unused] (`PackedRows`; f32 on
/// CPU: E = 1), k, v; output dQ, dK, dV flattened one after the other (len q + len k + len v) in k's dtype.
struct AttentionBwd {
    scale: f32,
    causal: bool,
    d: usize,
    kernel: CpuKernel,
    docs: Option<DocStarts>,
}

impl CustomOp3 for AttentionBwd {
    fn name(&self) -> &'static str {
        "harpe-attention-bwd"
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
        let (b, h, tq, w) = l1.shape().dims4()?;
        let d = self.d;
        let rows_layout = PackedRows { d, elem_bytes: 4 };
        if w != rows_layout.bwd_width() {
            candle_core::bail!("attention backward: packed input has last dim {w}, expected 3 * {d} + 2");
        }
        let q_layout = Layout::contiguous((b, h, tq, d));
        let dims = dims_of(&q_layout, l2, l3)?;
        let packed = f32_slice(s1, l1, "attention backward", "packed")?;
        let k = f32_slice(s2, l2, "attention backward", "k")?;
        let v = f32_slice(s3, l3, "attention backward", "v")?;
        if let Some(ds) = &self.docs {
            ds.check(dims.b, dims.tk, self.causal)?;
        }
        let docs = self.docs.as_ref().map(|ds| ds.host());
        if self.kernel == CpuKernel::Gemm {
            let grads = attention_bwd_gemm(packed, k, v, dims, self.scale, self.causal, docs);
            let n = grads.len();
            return Ok((CpuStorage::F32(grads), Shape::from_dims(&[n])));
        }
        let rows = b * h * tq;
        let (mut q, mut o, mut dout) =
            (Vec::with_capacity(rows * d), Vec::with_capacity(rows * d), Vec::with_capacity(rows * d));
        let mut lse = Vec::with_capacity(rows);
        for row in packed.chunks(w) {
            q.extend_from_slice(&row[..d]);
            o.extend_from_slice(&row[d..2 * d]);
            lse.push(row[2 * d]);
            dout.extend_from_slice(&row[2 * d + 1..3 * d + 1]);
        }
        let (mut dq, dk, dv) =
            attention_bwd_cpu((&q, k, v), (&o, &lse), &dout, dims, AttnMask::new(self.scale, self.causal, docs));
        dq.reserve(dk.len() + dv.len());
        dq.extend(dk);
        dq.extend(dv);
        let n = dq.len();
        Ok((CpuStorage::F32(dq), Shape::from_dims(&[n])))
    }

    /// The flash backward of kernels/attention.cu (delta pre-kernel, backward, dQ convert) on the same
    /// packed layout as `cpu_fwd`; the gradients come out in k's dtype.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let docs = self.docs.as_ref().map(|ds| ds.tensor());
        let mask = crate::ops::attention_shape::AttnMask::new(self.scale, self.causal, docs);
        crate::ops::attention_cuda::bwd_packed((s1, l1), (s2, l2), (s3, l3), self.d, mask)
    }
}

/// Causal (or full) attention softmax(q k^T * scale) v with GQA; differentiable in q, k, v. With `docs`
/// (causal only) a document mask of packed sequences: query i sees keys j <= i of its own document.
/// On CPU it runs the GEMM-block kernel (`CpuKernel::Gemm`); on CUDA the flash kernels (kernels/attention.cu).
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    causal: bool,
    docs: Option<&DocStarts>,
) -> Result<Tensor> {
    attention_with(q, k, v, scale, causal, docs, CpuKernel::Gemm)
}

/// `attention` with the CPU loops chosen explicitly (`CpuKernel::Reference`: the scalar reference loops, the
/// readable twin of every kernel); on CUDA the kernel is chosen by dtype and head dim.
pub fn attention_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    causal: bool,
    docs: Option<&DocStarts>,
    kernel: CpuKernel,
) -> Result<Tensor> {
    let dtype = q.dtype();
    let d = q.dim(3)?;
    // the CPU loops are f32; the CUDA kernels take f32, bf16 and f16 as they are
    let run_as = match (q.device().is_cuda(), dtype) {
        (true, DType::BF16 | DType::F16) => dtype,
        _ => DType::F32,
    };
    let f = |t: &Tensor| -> Result<Tensor> { t.to_dtype(run_as)?.contiguous() };
    let packed = f(q)?.apply_op3(&f(k)?, &f(v)?, AttentionFwd { scale, causal, kernel, docs: docs.cloned() })?; // (B, H, Tq, D + 1)
    packed.narrow(3, 0, d)?.to_dtype(dtype)
}

/// Query blocks of `block` rows against all keys, from plain candle ops (autograd gives the
/// backward): O(block x Tk) scores at a time in the forward. The twin of a GPU kernel's tiling; `docs` as in
/// `attention`.
pub fn attention_blocked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    causal: bool,
    docs: Option<&DocStarts>,
    block: usize,
) -> Result<Tensor> {
    let (b, _h, tq, _d) = q.dims4()?;
    let (_, _, tk, _) = k.dims4()?;
    if causal && tk < tq {
        candle_core::bail!("attention: causal attention needs Tk >= Tq, got Tq {tq} Tk {tk}");
    }
    let block = block.max(1);
    let mut outs = vec![];
    for start in (0..tq).step_by(block) {
        let len = block.min(tq - start);
        // rows start.. of the query sit at absolute positions (tk - tq) + start..; a causal block
        // sees keys up to its last row
        let q_blk = q.narrow(2, start, len)?; // (B, H, len, D)
        let keys = if causal { tk - tq + start + len } else { tk };
        let (kk, vv) = (k.narrow(2, 0, keys)?, v.narrow(2, 0, keys)?); // (B, Hkv, keys, D)
        let mask = match docs {
            Some(ds) => {
                ds.check(b, tk, causal)?;
                Some(dense_mask(ds, tk - tq + start, len, keys, q.device())?)
            }
            None => None,
        };
        outs.push(slow_masked(&q_blk, &kk, &vv, scale, causal, mask.as_ref())?);
        // (B, H, len, D)
    }
    Tensor::cat(&outs, 2)
}

/// The same attention from plain candle ops (materializes (Tq x Tk): tests and tiny shapes only); with
/// `docs` (causal only) the dense (B, 1, Tq, Tk) mask of "same document and j <= i", built from the per-token
/// starts.
pub fn attention_slow(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    causal: bool,
    docs: Option<&DocStarts>,
) -> Result<Tensor> {
    let Some(docs) = docs else { return slow_masked(q, k, v, scale, causal, None) };
    let (b, _h, tq, _d) = q.dims4()?;
    let tk = k.dim(2)?;
    docs.check(b, tk, causal)?;
    if tk < tq {
        candle_core::bail!("attention: causal attention needs Tk >= Tq, got Tq {tq} Tk {tk}");
    }
    let mask = dense_mask(docs, tk - tq, tq, tk, q.device())?;
    slow_masked(q, k, v, scale, true, Some(&mask))
}

/// Additive mask (B, 1, rows, keys) for query rows at key positions p0..p0 + rows against keys 0..keys:
/// 0 where key j is in row p's document (docs[j] == docs[p]) and j <= p, -inf elsewhere.
fn dense_mask(docs: &DocStarts, p0: usize, rows: usize, keys: usize, dev: &Device) -> Result<Tensor> {
    let (b, t) = docs.dims();
    let ds = docs.host();
    let mut m = Vec::with_capacity(b * rows * keys);
    for bi in 0..b {
        let row = &ds[bi * t..(bi + 1) * t];
        for p in p0..p0 + rows {
            m.extend((0..keys).map(|j| if j <= p && row[j] == row[p] { 0f32 } else { f32::NEG_INFINITY }));
        }
    }
    Tensor::from_vec(m, (b, 1, rows, keys), dev)
}

fn slow_masked(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, causal: bool, mask: Option<&Tensor>) -> Result<Tensor> {
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
    if let Some(mask) = mask {
        s = s.broadcast_add(&mask.to_dtype(s.dtype())?)?;
    }
    let m = s.max_keepdim(3)?;
    let e = s.broadcast_sub(&m)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(3)?)?;
    p.matmul(&v.contiguous()?)
}
