//! CPU fast path of the attention op: FlashAttention-2 tiling with every block product one single-threaded
//! `ops::cpu_gemm::sgemm` call (the gemm crate, or MKL with feature `mkl`; the tasks are the parallelism),
//! the online softmax between the GEMMs.
//!
//! Reference: FlashAttention-2 (Dao 2023) Algorithms 1-2; the readable scalar loops this must match are
//! `ops::attention::{attention_fwd_cpu, attention_bwd_cpu}` (tests/stage_model/attention_gemm.rs compares them,
//! forward and backward, ragged, GQA, Tq < Tk).
//! Forward: one task per (b, h, query block of `BQ` rows) on rayon; for each key block of `BK` keys up
//! to the block's causal limit: S = scale Q_b K_j^T (GEMM), per row the exponentials and their sum
//! against the row's reference max in one pass (the reference moves, rescaling sum and acc, only when a
//! block's scores rise `REBASE_ABOVE` past it), acc += P V_j (GEMM); O and lse are written straight into
//! the packed (B, H, Tq, D + 1) rows the op returns. Backward: one task per (b, kv head) (it alone owns
//! dK, dV of that head and dQ of its query heads, as in the reference); per block pair 5 GEMMs: S = scale Q K^T, P = exp(S - lse), dV += P^T dO,
//! dP = dO V^T, dS = scale P (dP - Δ), dQ += dS K, dK += dS^T Q; q, O, lse and dO are read in place from
//! the packed backward input through GEMM row strides (no unpacking copies). The row work between the
//! GEMMs (max, exp, sums, dS) runs on `ops::cpu_vec`'s vectorised loops: with libm's scalar `expf` the
//! softmax, not the GEMMs, was the cost at head dim 32.
//! The non-obvious decision: the backward keeps the reference's one-owner-per-(b, kv head) split
//! (no atomics, no second pass recomputing S for dQ); when B * Hkv tasks would leave threads idle
//! (B = 1, few kv heads) each head's keys are cut into ranges that own their rows of dK, dV and add
//! their part of dQ into a private buffer, summed after (O(T D) more memory per range). The forward,
//! which also serves decode and prefill, splits over query blocks.
//! Document masks (`docs`, per key the start of its document: `ops::attention::DocStarts`): row i sees
//! keys docs[p_i]..=p_i, so a block's key loop starts at its first row's document start (earlier key
//! blocks are skipped) and each row's scores outside its range are zero probabilities (tests/stage_model/attention_docs.rs).
//! Memory: O(T D) plus one (BQ x BK) score block (two in the backward) per task. Not done here: bf16
//! compute (inputs arrive as f32), dropout, sliding windows.
use crate::ops::attention_shape::AttnDims;
use crate::ops::cpu_gemm::{sgemm, Mat};
use crate::ops::cpu_vec::{dot, exp_sub_sum, exp_sub_sum_max, max as vmax, scale_in_place, softmax_grad};
use crate::ops::for_overwrite;
use gemm::Parallelism;
use rayon::prelude::*;

/// Query rows per block. 128 x 256 against the earlier 64 x 128 (`benches/attention_cpu.rs`, 2 threads,
/// AVX-512, interleaved runs): (B,H,Hkv,T,D) = (1,6,2,4096,64) forward 71-95 ms against 91-110,
/// forward + backward 254-325 against 284-377; (1,4,4,1024,32) fwd+bwd 13.6-13.9 against 14.5-15.7; at T = 256
/// and 512 within the run-to-run spread (128 x 128, 128 x 512, 256 x 256 and 256 x 512 no better than 128 x 256).
/// Fewer, larger block GEMMs: the gemm crate packs both operands on every call.
const BQ: usize = 128;
/// Keys per block.
const BK: usize = 256;

/// How far (in units of the scaled scores) a key block's scores may rise above a row's softmax reference
/// before the row is rebased on them. Between rebases the exponentials are taken against the old
/// reference in the pass that also finds the block's max (`cpu_vec::exp_sub_sum_max`), so there is no
/// separate max pass and no rescaling of the accumulator each time the running max creeps up. e^16 = 8.9e6:
/// the row sum stays far from f32's 3.4e38 (4096 keys at e^16: 3.6e10), and the result is the same
/// softmax up to rounding (floating point does not care which reference scales it). Attention forward
/// (`benches/attention_cpu.rs --fwd-only`, (1, 8, 8, 4096, 4096, D 64), 2 AVX-512 threads, 4 interleaved
/// runs): 113-140 ms with the max pass, 110-120 without; the training grid measured with it:
/// benches/results/train-cpu-grid.md.
const REBASE_ABOVE: f32 = 16.0;

/// Row-major view of `rows` at `ptr` with row stride `rs` (unit column stride).
fn rows(ptr: *const f32, rs: usize) -> Mat {
    Mat { ptr, rs: rs as isize, cs: 1 }
}

/// Transposed view of a row-major block at `ptr` with row stride `rs`.
fn transposed(ptr: *const f32, rs: usize) -> Mat {
    Mat { ptr, rs: 1, cs: rs as isize }
}

/// Fewest query rows for which the forward transposes K first (below: decode and short prefill chunks,
/// where the transposition would cost as much as the block products it speeds up).
const TRANSPOSE_MIN_TQ: usize = 64;
/// Fewest keys for which K (and in the backward V) is transposed first. Measured on 2 AVX-512 threads,
/// interleaved `harpe train` runs (noisy VM: 3-4 processes each): T 4096 (grid row 9) 2037-2482 tok/s
/// without, 2253-2494 with; T 256 (row 5: hidden 512, 8 heads of 64) 687-759 without, 546-707 with (the
/// padded row stride did not change that), so below this length the gather-packed view stays.
const TRANSPOSE_MIN_TK: usize = 1024;

/// Row stride of a transposed key or value matrix (`transpose`) of t keys: t plus 16, so that a power of two
/// t (256, 4096: the usual lengths) does not put the d rows a GEMM walks down into the same few cache sets.
fn t_ld(t: usize) -> usize {
    t + 16
}

/// (d x t) with row stride `t_ld(t)`: the transpose of `x` (t x d, row-major); the padding is zero.
fn transpose(x: &[f32], t: usize, d: usize) -> Vec<f32> {
    let mut y = vec![0f32; d * t_ld(t)];
    transpose_into(x, t, d, &mut y);
    y
}

/// `transpose` into `y` (d rows of `t_ld(t)`; the padding is left as it is).
fn transpose_into(x: &[f32], t: usize, d: usize, y: &mut [f32]) {
    for (c, yc) in y.chunks_mut(t_ld(t)).enumerate() {
        yc[..t].iter_mut().zip(x[c..].iter().step_by(d)).for_each(|(o, &v)| *o = v);
    }
}

/// The operand K_j^T (d x n) of the score GEMM S = Q K_j^T for keys kb.. of one head (or V_j^T of the
/// backward's dP = dO V_j^T): a column slice of the transposed keys `kt` (d rows of `t_ld(tk)`) when they
/// were made, else a transposed view of the keys' rows `kh`.
///
/// Why both: the gemm crate packs its operands on every call, and for a row-major S it packs K_j^T
/// along the keys; from K's rows (stride d) that is a scalar gather, from K^T's rows a copy. `perf` of a
/// T = 4096 training step had the packing at 12%.
fn keys_t(kh: &[f32], kt: Option<&[f32]>, kb: usize, tk: usize, d: usize) -> Mat {
    match kt {
        Some(kt) => rows(kt[kb..].as_ptr(), t_ld(tk)),
        None => transposed(kh[kb * d..].as_ptr(), d),
    }
}

/// Forward: returns the op's packed output, rows of D + 1 = [O | lse] for (B, H, Tq).
/// `docs`: an optional document mask (B*Tk, per key the start of its document; causal only).
pub fn attention_fwd_gemm(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    scale: f32,
    causal: bool,
    docs: Option<&[u32]>,
) -> Vec<f32> {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    // invariant (dims_of checked the shapes); the unsafe GEMM views below rely on it
    assert!(q.len() == b * h * tq * d && k.len() == b * hkv * tk * d && v.len() == k.len(), "attention: sizes");
    let (rep, w) = (h / hkv, d + 1);
    // SAFETY: the query blocks below cover out, and fwd_block writes all d + 1 values of each row.
    let mut out = unsafe { for_overwrite(b * h * tq * w) };
    if tq == 0 {
        return out;
    }
    // K^T per (b, kv head), made once and read by every query block of the head's query heads
    // (written in place: collecting a `flat_map_iter` pushed element by element, 2.4% of a T 4096 forward)
    let kt: Option<Vec<f32>> = (tq >= TRANSPOSE_MIN_TQ && tk >= TRANSPOSE_MIN_TK && d > 0).then(|| {
        let mut kt = vec![0f32; b * hkv * d * t_ld(tk)];
        kt.par_chunks_mut(d * t_ld(tk)).zip(k.par_chunks(tk * d)).for_each(|(y, kh)| transpose_into(kh, tk, d, y));
        kt
    });
    out.par_chunks_mut(tq * w).enumerate().for_each(|(bh, out_h)| {
        let (bi, g) = (bh / h, (bh % h) / rep);
        let qh = &q[bh * tq * d..(bh + 1) * tq * d];
        let hi = bi * hkv + g; // this query head's (b, kv head)
        let kv = hi * tk * d..(hi + 1) * tk * d;
        let (kh, vh) = (&k[kv.clone()], &v[kv]);
        let kth = kt.as_ref().map(|kt| &kt[hi * d * t_ld(tk)..(hi + 1) * d * t_ld(tk)]);
        out_h.par_chunks_mut(BQ * w).enumerate().for_each(|(qb, out_b)| {
            let i0 = qb * BQ;
            let lo = |i: usize| dims.first_key(causal, docs, bi, i);
            fwd_block((&qh[i0 * d..], kh, kth, vh), out_b, i0, dims, scale, causal, &lo);
        });
    });
    out
}

/// A query block's rows, its head's keys, their transpose (when made: `keys_t`) and values.
type BlockInputs<'a> = (&'a [f32], &'a [f32], Option<&'a [f32]>, &'a [f32]);

/// One query block: rows i0.. of one head (`qb` starts at row i0), `out_b` its packed output rows.
fn fwd_block(
    (qb, kh, kt, vh): BlockInputs<'_>,
    out_b: &mut [f32],
    i0: usize,
    dims: AttnDims,
    scale: f32,
    causal: bool,
    lo: &dyn Fn(usize) -> usize,
) {
    let d = dims.d;
    let nr = out_b.len() / (d + 1);
    let lim_last = dims.limit(causal, i0 + nr - 1);
    let mut acc = vec![0f32; nr * d];
    // SAFETY: each key block's score GEMM (accumulate false) writes the nr x n values read after it.
    let mut s = unsafe { for_overwrite(nr * BK) };
    let (mut m, mut l) = (vec![f32::NEG_INFINITY; nr], vec![0f32; nr]);
    // (row, its block max) of the rows to put on a new reference, and the block's scores once more for them
    let mut rebase: Vec<(usize, f32)> = Vec::new();
    let mut s_again: Vec<f32> = Vec::new();
    // keys before the first row's document start are seen by no row of the block
    for kb in (lo(i0)..lim_last).step_by(BK) {
        let n = BK.min(lim_last - kb);
        // this row's keys in the block: first..valid
        let keys = |r: usize| {
            let valid = dims.limit(causal, i0 + r).saturating_sub(kb).min(n);
            (lo(i0 + r).saturating_sub(kb).min(valid), valid)
        };
        // SAFETY (both calls): qb holds nr rows of d, kh/vh hold rows kb..kb+n of d (kt its columns
        // kb..kb+n of d rows of tk), dst holds nr x n; no aliasing.
        let scores = |dst: &mut [f32]| unsafe {
            sgemm(
                (nr, n, d),
                dst.as_mut_ptr(),
                n,
                false,
                rows(qb.as_ptr(), d),
                keys_t(kh, kt, kb, dims.tk, d),
                scale,
                Parallelism::None,
            )
        };
        scores(&mut s);
        for r in 0..nr {
            let (first, valid) = keys(r);
            let sr = &mut s[r * n..(r + 1) * n];
            // m[r] is the row's reference, not its running max: the exponentials are taken against it
            // in the pass that also finds the block's max, and it moves only at the row's first keys or
            // when a block's scores rise more than REBASE_ABOVE above it
            let sum = if m[r] == f32::NEG_INFINITY {
                let top = vmax(&sr[first..valid]);
                if top == f32::NEG_INFINITY {
                    sr.fill(0.0); // no key of this row so far
                    continue;
                }
                m[r] = top;
                exp_sub_sum(&mut sr[first..valid], top)
            } else {
                let (sum, top) = exp_sub_sum_max(&mut sr[first..valid], m[r]);
                if top > m[r] + REBASE_ABOVE {
                    rebase.push((r, top)); // its exponentials may have overflowed: below
                    continue;
                }
                sum
            };
            sr[..first].fill(0.0);
            sr[valid..].fill(0.0);
            l[r] += sum;
        }
        if !rebase.is_empty() {
            // the pass above overwrote these rows' scores: the same block product again (the same bits),
            // then each row and what it summed so far moved to its new reference
            s_again.resize(nr * n, 0.0);
            scores(&mut s_again);
            for &(r, top) in &rebase {
                let (first, valid) = keys(r);
                let sr = &mut s[r * n..(r + 1) * n];
                sr.copy_from_slice(&s_again[r * n..(r + 1) * n]);
                let corr = (m[r] - top).exp();
                scale_in_place(&mut acc[r * d..(r + 1) * d], corr);
                l[r] = l[r] * corr + exp_sub_sum(&mut sr[first..valid], top);
                m[r] = top;
                sr[..first].fill(0.0);
                sr[valid..].fill(0.0);
            }
            rebase.clear();
        }
        // SAFETY: s is nr x n, vh rows kb..kb+n of d, acc nr x d; no aliasing.
        unsafe {
            sgemm(
                (nr, d, n),
                acc.as_mut_ptr(),
                d,
                true,
                rows(s.as_ptr(), n),
                rows(vh[kb * d..].as_ptr(), d),
                1.0,
                Parallelism::None,
            )
        };
    }
    for (r, row) in out_b.chunks_mut(d + 1).enumerate() {
        if l[r] > 0.0 {
            let inv = 1.0 / l[r];
            row[..d].iter_mut().zip(&acc[r * d..(r + 1) * d]).for_each(|(o, a)| *o = a * inv);
            row[d] = m[r] + l[r].ln();
        } else {
            row[..d].fill(0.0); // no key: O = 0, lse = -inf
            row[d] = f32::NEG_INFINITY;
        }
    }
}

/// Backward: `packed` rows of 3D + 2 = [q | O | lse | dO | unused] for (B, H, Tq); returns
/// dQ, dK, dV flattened one after the other (the `AttentionBwd` op's output).
/// `docs`: as in `attention_fwd_gemm`.
pub fn attention_bwd_gemm(
    packed: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    scale: f32,
    causal: bool,
    docs: Option<&[u32]>,
) -> Vec<f32> {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let (rep, w) = (h / hkv, 3 * d + 2);
    // invariant (dims_of checked the shapes); the unsafe GEMM views below rely on it
    assert!(
        packed.len() == b * h * tq * w && k.len() == b * hkv * tk * d && v.len() == k.len(),
        "attention bwd: sizes"
    );
    let (nq, nk) = (b * h * tq * d, k.len());
    let mut grads = vec![0f32; nq + 2 * nk];
    if tq == 0 || tk == 0 {
        return grads;
    }
    let (dq, dkv) = grads.split_at_mut(nq);
    let (dk, dv) = dkv.split_at_mut(nk);
    let keys = key_range_len(b * hkv, tk);
    dq.par_chunks_mut(rep * tq * d).zip(dk.par_chunks_mut(tk * d).zip(dv.par_chunks_mut(tk * d))).enumerate().for_each(
        |(bg, (dq_g, (dk_g, dv_g)))| {
            let (kh, vh) = (&k[bg * tk * d..(bg + 1) * tk * d], &v[bg * tk * d..(bg + 1) * tk * d]);
            let (kt, vt) = match tk >= TRANSPOSE_MIN_TK {
                true => (Some(transpose(kh, tk, d)), Some(transpose(vh, tk, d))),
                false => (None, None),
            };
            let head =
                BwdHead { packed, k: kh, v: vh, kt: kt.as_deref(), vt: vt.as_deref(), bg, dims, scale, causal, docs };
            if keys >= tk {
                head.run(0, dq_g, dk_g, dv_g);
                return;
            }
            // several key ranges: each owns its rows of dK, dV and sums its part of dQ privately; the
            // parts are added in range order (a `reduce` tree would follow rayon's run-time splits and
            // make two runs differ in the last bits)
            let parts: Vec<Vec<f32>> = dk_g
                .par_chunks_mut(keys * d)
                .zip(dv_g.par_chunks_mut(keys * d))
                .enumerate()
                .map(|(p, (dk_p, dv_p))| {
                    let mut dq_p = vec![0f32; dq_g.len()];
                    head.run(p * keys, &mut dq_p, dk_p, dv_p);
                    dq_p
                })
                .collect();
            dq_g.fill(0.0);
            for part in &parts {
                dq_g.iter_mut().zip(part).for_each(|(x, y)| *x += y);
            }
        },
    );
    grads
}

/// Keys per range of the backward's split: all `tk` when the B * Hkv tasks fill rayon's threads, else
/// ranges (whole key blocks) enough for about two tasks per thread.
fn key_range_len(tasks: usize, tk: usize) -> usize {
    let threads = rayon::current_num_threads();
    if tasks >= threads {
        return tk;
    }
    let parts = (2 * threads).div_ceil(tasks);
    tk.div_ceil(parts).div_ceil(BK).max(1) * BK
}

/// The backward of one (b, kv head): its `rep` query heads' packed rows, its k and v.
struct BwdHead<'a> {
    packed: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    /// K^T and V^T (d rows of `t_ld(tk)`) when made: the score and dP GEMMs read K_j^T and V_j^T from them
    /// (see `keys_t`)
    kt: Option<&'a [f32]>,
    vt: Option<&'a [f32]>,
    bg: usize,
    dims: AttnDims,
    scale: f32,
    causal: bool,
    docs: Option<&'a [u32]>,
}

impl BwdHead<'_> {
    /// First key query row i may see (its document's start; 0 without a mask).
    fn lo(&self, i: usize) -> usize {
        self.dims.first_key(self.causal, self.docs, self.bg / self.dims.hkv, i)
    }

    /// Adds into dQ of the head's query heads (`dq_g`) the part from keys k0.. (`dk_p`, `dv_p`: those
    /// keys' rows, which this call owns; k0 is a multiple of BK).
    fn run(&self, k0: usize, dq_g: &mut [f32], dk_p: &mut [f32], dv_p: &mut [f32]) {
        let AttnDims { h, hkv, tq, d, .. } = self.dims;
        let (rep, w) = (h / hkv, 3 * d + 2);
        let (bi, g) = (self.bg / hkv, self.bg % hkv);
        let k1 = k0 + dk_p.len() / d;
        for r in 0..rep {
            let bh = bi * h + g * rep + r;
            let ph = &self.packed[bh * tq * w..(bh + 1) * tq * w];
            let dq_h = &mut dq_g[r * tq * d..(r + 1) * tq * d];
            for i0 in (0..tq).step_by(BQ) {
                let nr = BQ.min(tq - i0);
                if self.dims.limit(self.causal, i0 + nr - 1) <= k0 || self.lo(i0) >= k1 {
                    continue; // the block sees none of these keys
                }
                self.block(&ph[i0 * w..(i0 + nr) * w], i0, k0..k1, &mut dq_h[i0 * d..(i0 + nr) * d], dk_p, dv_p);
            }
        }
    }

    /// One query block: packed rows `p` (nr x (3D + 2)) from query row i0. Adds its dQ rows into `dq_b`
    /// and its part of dK, dV for the keys in `keys` into `dk_p`, `dv_p` (rows keys.start..keys.end).
    fn block(
        &self,
        p: &[f32],
        i0: usize,
        keys: std::ops::Range<usize>,
        dq_b: &mut [f32],
        dk_p: &mut [f32],
        dv_p: &mut [f32],
    ) {
        let d = self.dims.d;
        let w = 3 * d + 2;
        let nr = p.len() / w;
        let (qp, dop) = (p.as_ptr(), p[2 * d + 1..].as_ptr());
        // Δ_i = dO_i · O_i, and lse_i, per row
        let (delta, lse): (Vec<f32>, Vec<f32>) =
            p.chunks(w).map(|row| (dot(&row[d..2 * d], &row[2 * d + 1..3 * d + 1]), row[2 * d])).unzip();
        let lim_last = self.dims.limit(self.causal, i0 + nr - 1).min(keys.end);
        // SAFETY: each key block's score and dP GEMMs (accumulate false) write the nr x n values read after.
        let (mut s, mut dp) = unsafe { (for_overwrite(nr * BK), for_overwrite(nr * BK)) };
        for kb in (keys.start.max(self.lo(i0))..lim_last).step_by(BK) {
            let n = BK.min(lim_last - kb);
            let at = (kb - keys.start) * d; // row kb in dK, dV of this key range
            let tk = self.dims.tk;
            let (kj, kjt, vjt) =
                (self.k[kb * d..].as_ptr(), keys_t(self.k, self.kt, kb, tk, d), keys_t(self.v, self.vt, kb, tk, d));
            // SAFETY (all GEMMs below): q/dO views are nr rows of stride w inside `p`; kj is rows kb..kb+n
            // of d, kjt/vjt columns kb..kb+n of d rows of tk, the dK/dV destinations those rows of this key
            // range (lim_last <= keys.end); s, dp are nr x n; destinations alias no input.
            unsafe { sgemm((nr, n, d), s.as_mut_ptr(), n, false, rows(qp, w), kjt, self.scale, Parallelism::None) };
            for r in 0..nr {
                let valid = self.dims.limit(self.causal, i0 + r).saturating_sub(kb).min(n);
                let first = self.lo(i0 + r).saturating_sub(kb).min(valid); // this row's keys: first..valid
                let sr = &mut s[r * n..(r + 1) * n];
                if lse[r] == f32::NEG_INFINITY {
                    sr.fill(0.0);
                    continue;
                }
                exp_sub_sum(&mut sr[first..valid], lse[r]);
                sr[..first].fill(0.0);
                sr[valid..].fill(0.0);
            }
            unsafe {
                sgemm(
                    (n, d, nr),
                    dv_p[at..].as_mut_ptr(),
                    d,
                    true,
                    transposed(s.as_ptr(), n),
                    rows(dop, w),
                    1.0,
                    Parallelism::None,
                )
            };
            unsafe { sgemm((nr, n, d), dp.as_mut_ptr(), n, false, rows(dop, w), vjt, 1.0, Parallelism::None) };
            for r in 0..nr {
                let (pr, dpr) = (&s[r * n..(r + 1) * n], &mut dp[r * n..(r + 1) * n]);
                softmax_grad(dpr, pr, delta[r], self.scale);
            }
            unsafe {
                sgemm((nr, d, n), dq_b.as_mut_ptr(), d, true, rows(dp.as_ptr(), n), rows(kj, d), 1.0, Parallelism::None)
            };
            unsafe {
                sgemm(
                    (n, d, nr),
                    dk_p[at..].as_mut_ptr(),
                    d,
                    true,
                    transposed(dp.as_ptr(), n),
                    rows(qp, w),
                    1.0,
                    Parallelism::None,
                )
            };
        }
    }
}
