//! `harpe selftest` rows for flash attention (kernels/attention.cu, FMA and tensor-core tiles) and for the
//! tensor-core fragment probe (kernels/mma_probe.cu): forward (O and lse) and backward (dQ, dK, dV).
//!
//! Reference: flash-attention's tests and the shapes training meets: ragged T, GQA 1/4/8, D 64 and 128,
//! Tq < Tk, a document mask (packed sequences, random document starts), and on a GPU T = 4096 + 37.
//! f32 rows compare with the f32 CPU op (`ops::attention::{attention_fwd_cpu, attention_bwd_cpu}`,
//! f32 tolerance); 16-bit rows with [`exact16`], dense attention in f64 from the kernel's own rounded
//! inputs under the bound derived in `selftest`'s header: M is sum_j p_j |v_j| for O (the operands the
//! tensor-core tiles round: P before P V, dS before dS K and dS^T Q, and P before P^T dO), M_f folds in
//! each score's magnitude a_j = scale sum |q k_j|; L = Tq + Tk + D. lse (f32 in every case) gets its own
//! row with the same f32 term. The backward's exact values start from the kernel's own forward outputs
//! (O in the storage type, lse): the backward kernel is checked on what it is given, the forward by its
//! own rows.
//! The non-obvious decision: on CUDA the tensor-core rows go through `ops::attention` with autograd (what
//! the model calls: the op's cuda_fwd, its packed O|lse layout and the backward op; lse from one more
//! launch of the same tiles), the FMA rows through the launchers with the FMA tiles asked for by name; on
//! the emulated target both through `ops::emu::attention`. The probe's rows check the emulated
//! mma/ldmatrix layouts against the hardware's when run on a GPU.
//! `HARPE_SELFTEST_SMALL` (a `testing::Hooks` hook; scripts/gpu-check.sh sets it around compute-sanitizer)
//! drops the T = 4133 case.
//! Does not: time anything (`harpe bench attention`), or test Hopper-specific tiles (there are none yet).
use super::check::{as_dt, check, check16, ragged, uniform, Bound16, Check, Dt, Exact, Target};
use crate::ops::attention::{attention_bwd_cpu, attention_fwd_cpu, DocStarts};
use crate::ops::attention_shape::{AttnDims, AttnKernel, AttnMask};
use crate::ops::emu::attention::{self as ka, AttnFloat};
use anyhow::Result;
use half::{bf16, f16};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

/// Every attention row for one round.
pub fn checks(target: &Target, r: &mut ChaCha8Rng) -> Result<Vec<Check>> {
    let mut out = Vec::new();
    checks_each(target, r, &mut |cs: &[Check]| out.extend_from_slice(cs))?;
    Ok(out)
}

/// `checks`, each case's rows handed to `sink` as soon as they are computed.
pub fn checks_each(target: &Target, r: &mut ChaCha8Rng, sink: &mut dyn FnMut(&[Check])) -> Result<()> {
    for dt in [Dt::Bf16, Dt::F16] {
        sink(&[probe_check(target, dt, r)?]);
    }
    let big = matches!(target, Target::Cuda(_));
    for (dt, kernel) in [
        (Dt::F32, AttnKernel::Fma),
        (Dt::Bf16, AttnKernel::Fma),
        (Dt::Bf16, AttnKernel::TensorCore),
        (Dt::F16, AttnKernel::TensorCore),
    ] {
        let d =
            if kernel == AttnKernel::TensorCore || r.random_bool(0.5) { [64, 128][r.random_range(0..2)] } else { 16 };
        let rep = if big { [1, 4, 8][r.random_range(0..3)] } else { [1, 2, 4][r.random_range(0..3)] };
        // the emulator runs one OS thread per GPU thread: small problems there
        let hkv = if big { r.random_range(1..3) } else { 1 };
        let t = ragged(r, 1, if big { 1000 } else { 80 });
        let causal = r.random_bool(0.75);
        let dims = AttnDims { b: if big { r.random_range(1..3) } else { 1 }, h: hkv * rep, hkv, tq: t, tk: t, d };
        sink(&case(target, dt, kernel, dims, causal, None, r)?);
        // Tq < Tk: a decode step or a prefill chunk against a longer cache
        let tq = if r.random_bool(0.5) { 1 } else { ragged(r, 2, t.max(3)) };
        let dims_c = AttnDims { tq, tk: t + ragged(r, 1, if big { 100 } else { 40 }), ..dims };
        sink(&case(target, dt, kernel, dims_c, true, None, r)?);
        // a document mask: packed sequences with 1-4 random document starts each
        let t = ragged(r, 2, if big { 1000 } else { 80 });
        let dims = AttnDims { tq: t, tk: t, ..dims };
        let docs = random_docs(r, dims.b, t)?;
        sink(&case(target, dt, kernel, dims, true, Some(docs.host()), r)?);
    }
    if big && !crate::testing::hooks().selftest_small {
        // the long ragged case on the tensor-core tiles (skipped under compute-sanitizer)
        // (two kv heads: the references run one task per row, then one per key)
        let dims = AttnDims { b: 1, h: 2, hkv: 2, tq: 4096 + 37, tk: 4096 + 37, d: 128 };
        sink(&case(target, Dt::Bf16, AttnKernel::TensorCore, dims, true, None, r)?);
    }
    Ok(())
}

/// A (16x16) B (16x16) through kernels/mma_probe.cu's four fragment paths against the plain product.
fn probe_check(target: &Target, dt: Dt, r: &mut ChaCha8Rng) -> Result<Check> {
    let a = as_dt(uniform(r, 256, 1.0), dt);
    let b = as_dt(uniform(r, 256, 1.0), dt);
    let bt: Vec<f32> = (0..256).map(|i| b[(i % 16) * 16 + i / 16]).collect();
    let got = match (target, dt) {
        (Target::Emulated, Dt::F16) => ka::mma_probe::<f16>(&to_t(&a), &to_t(&b), &to_t(&bt))?,
        (Target::Emulated, _) => ka::mma_probe::<bf16>(&to_t(&a), &to_t(&b), &to_t(&bt))?,
        (Target::Cuda(dev), _) => cuda_run::probe(dev, dt, &a, &b, &bt)?,
    };
    let mut want = vec![0f32; 1024];
    for way in 0..4 {
        for i in 0..16 {
            for j in 0..16 {
                want[way * 256 + i * 16 + j] =
                    (0..16).map(|k| a[i * 16 + k] as f64 * b[k * 16 + j] as f64).sum::<f64>() as f32;
            }
        }
    }
    // products of 16-bit values are exact in f32; only the f32 sums round
    Ok(check("mma probe (4 paths)", "16x16x16".into(), dt, &got, &want, 1e-5))
}

fn to_t<T: AttnFloat>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}
fn of_t<T: AttnFloat>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// Random q, k, v of `dims` (uniform in [-1, 1), rounded to `dt`), drawn in that order.
pub(super) fn qkv(r: &mut ChaCha8Rng, dims: AttnDims, dt: Dt) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let q = as_dt(uniform(r, b * h * tq * d, 1.0), dt);
    let k = as_dt(uniform(r, b * hkv * tk * d, 1.0), dt);
    let v = as_dt(uniform(r, b * hkv * tk * d, 1.0), dt);
    (q, k, v)
}

/// A document mask for `b` packed sequences of `t` tokens: 1-4 document starts each, anywhere.
pub(super) fn random_docs(r: &mut ChaCha8Rng, b: usize, t: usize) -> Result<DocStarts> {
    let starts: Vec<Vec<usize>> =
        (0..b).map(|_| (0..r.random_range(1..5)).map(|_| r.random_range(0..t)).collect()).collect();
    let starts: Vec<&[usize]> = starts.iter().map(|s| s.as_slice()).collect();
    Ok(DocStarts::from_starts(&starts, t, &candle_core::Device::Cpu)?)
}

/// One shape: O, lse, dQ, dK, dV of the kernel against the reference; `docs` a document mask (per key,
/// the start of its document).
fn case(
    target: &Target,
    dt: Dt,
    kernel: AttnKernel,
    dims: AttnDims,
    causal: bool,
    docs: Option<&[u32]>,
    r: &mut ChaCha8Rng,
) -> Result<Vec<Check>> {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let (q, k, v) = qkv(r, dims, dt);
    let dout = as_dt(uniform(r, b * h * tq * d, 1.0), dt);
    let scale = 1.0 / (d as f32).sqrt();
    let (inputs, mask) = ((&q[..], &k[..], &v[..], &dout[..]), AttnMask::new(scale, causal, docs));
    let got = match target {
        Target::Emulated => match dt {
            Dt::F32 => emu_run::<f32>(kernel, inputs, dims, mask)?,
            Dt::Bf16 => emu_run::<bf16>(kernel, inputs, dims, mask)?,
            Dt::F16 => emu_run::<f16>(kernel, inputs, dims, mask)?,
        },
        Target::Cuda(dev) => cuda_run::run(dev, dt, kernel, inputs, dims, mask)?,
    };
    let name = match kernel {
        AttnKernel::Fma => "attention fma",
        AttnKernel::TensorCore => "attention tc",
    };
    let ndocs = docs.map(|ds| ds.iter().enumerate().filter(|&(j, &s)| s as usize == j % tk).count());
    let label = format!(
        "B{b} H{h}/{hkv} T{tq}/{tk} D{d}{}{}",
        if causal { " causal" } else { "" },
        ndocs.map(|n| format!(" {n} docs")).unwrap_or_default()
    );
    let what = ["O", "lse", "dQ", "dK", "dV"];
    if dt == Dt::F32 {
        let (o_ref, lse_ref) = attention_fwd_cpu(&q, &k, &v, dims, scale, causal, docs);
        let (dq_ref, dk_ref, dv_ref) =
            attention_bwd_cpu((&q, &k, &v), (&o_ref, &lse_ref), &dout, dims, AttnMask::new(scale, causal, docs));
        let refs = [&o_ref, &lse_ref, &dq_ref, &dk_ref, &dv_ref];
        return Ok((0..5)
            .map(|i| check(&format!("{name} {}", what[i]), label.clone(), dt, &got[i], refs[i], 1e-5))
            .collect());
    }
    let inp = Inputs { q: &q, k: &k, v: &v, dout: &dout, o: &got[0], lse: &got[1], dims, scale, causal, docs };
    let exact = exact16(&inp);
    let len = tq + tk + d;
    let ops = (kernel == AttnKernel::TensorCore).then_some(dt);
    Ok((0..5)
        .map(|i| {
            let bd = match i {
                1 => Bound16 { out: Dt::F32, operands: None, len },
                _ => Bound16 { out: dt, operands: ops, len },
            };
            check16(&format!("{name} {}", what[i]), label.clone(), dt, &got[i], &exact[i], bd)
        })
        .collect())
}

/// q, k, v, dO (f32 host values) through the emulated kernels in `T`: [O, lse, dQ, dK, dV] as f32.
fn emu_run<T: AttnFloat>(
    kernel: AttnKernel,
    (q, k, v, dout): (&[f32], &[f32], &[f32], &[f32]),
    dims: AttnDims,
    mask: AttnMask<'_>,
) -> Result<[Vec<f32>; 5]> {
    let (q, k, v, dout) = (to_t::<T>(q), to_t::<T>(k), to_t::<T>(v), to_t::<T>(dout));
    let (o, lse) = ka::attention_fwd(kernel, (&q, &k, &v), dims, mask)?;
    let (dq, dk, dv) = ka::attention_bwd(kernel, (&q, &k, &v), (&o, &lse), &dout, dims, mask)?;
    Ok([of_t(&o), lse, of_t(&dq), of_t(&dk), of_t(&dv)])
}

/// What the exact 16-bit reference reads: the case's rounded inputs and the kernel's forward outputs.
pub(super) struct Inputs<'a> {
    pub(super) q: &'a [f32],
    pub(super) k: &'a [f32],
    pub(super) v: &'a [f32],
    pub(super) dout: &'a [f32],
    /// the kernel's O (storage-type values) and lse: the backward kernel's inputs
    pub(super) o: &'a [f32],
    pub(super) lse: &'a [f32],
    pub(super) dims: AttnDims,
    pub(super) scale: f32,
    pub(super) causal: bool,
    pub(super) docs: Option<&'a [u32]>,
}

impl Inputs<'_> {
    /// Keys query row `i` of batch `bi` sees: its document's start (0 without a mask) .. the causal limit.
    fn keys(&self, bi: usize, i: usize) -> std::ops::Range<usize> {
        let AttnDims { tq, tk, .. } = self.dims;
        let lo = self.docs.map_or(0, |ds| ds[bi * tk + tk - tq + i] as usize);
        lo..if self.causal { tk - tq + i + 1 } else { tk }
    }
}

/// One query row's exact values: O_i (D), lse_i, dQ_i (D), each with (M, M_f).
struct RowExact {
    o: Vec<(f64, f64, f64)>,
    lse: (f64, f64, f64),
    dq: Vec<(f64, f64, f64)>,
    /// dO_i . O_i (the kernel's O) and its magnitude: the backward's row term
    delta: (f64, f64),
}

/// The exact values of [O, lse, dQ, dK, dV] in f64 with the magnitudes of `selftest`'s bound: per query
/// row (in parallel) the forward and dQ, then per key (in parallel) dK and dV, recomputing each pair's
/// P and dS instead of keeping the (Tq, Tk) matrices. The backward uses the kernel's O and lse (see the
/// header); P = exp(s - lse), dS = P (dO.v - dO.O), with M = P (|dO||v| + |dO||O|).
pub(super) fn exact16(inp: &Inputs) -> [Exact; 5] {
    let AttnDims { b, h, hkv, tq, tk, d } = inp.dims;
    // per (batch, query head): rows in parallel
    let rows: Vec<RowExact> = (0..b * h * tq).into_par_iter().map(|row| exact_row(inp, row)).collect();
    let mut out: [Exact; 5] = [
        Exact::zeros(b * h * tq * d),
        Exact::zeros(b * h * tq),
        Exact::zeros(b * h * tq * d),
        Exact::zeros(b * hkv * tk * d),
        Exact::zeros(b * hkv * tk * d),
    ];
    for (row, re) in rows.iter().enumerate() {
        out[1].y[row] = re.lse.0;
        (out[1].mag[row], out[1].magf[row]) = (re.lse.1, re.lse.2);
        for c in 0..d {
            let e = row * d + c;
            (out[0].y[e], out[0].mag[e], out[0].magf[e]) = re.o[c];
            (out[2].y[e], out[2].mag[e], out[2].magf[e]) = re.dq[c];
        }
    }
    let per_key: Vec<[Vec<(f64, f64, f64)>; 2]> =
        (0..b * hkv * tk).into_par_iter().map(|krow| exact_key(inp, &rows, krow)).collect();
    for (krow, [dk, dv]) in per_key.iter().enumerate() {
        for c in 0..d {
            let e = krow * d + c;
            (out[3].y[e], out[3].mag[e], out[3].magf[e]) = dk[c];
            (out[4].y[e], out[4].mag[e], out[4].magf[e]) = dv[c];
        }
    }
    out
}

/// Row r of a (rows, D) buffer.
fn row_of(x: &[f32], r: usize, d: usize) -> &[f32] {
    &x[r * d..(r + 1) * d]
}

/// (sum a_c c_c, sum |a_c c_c|) in f64.
fn dot64(a: &[f32], c: &[f32]) -> (f64, f64) {
    a.iter().zip(c).map(|(&x, &y)| x as f64 * y as f64).fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()))
}

/// Query row `row` (over batch x query heads x Tq): its forward (O, lse) and its dQ, with magnitudes.
fn exact_row(inp: &Inputs, row: usize) -> RowExact {
    let AttnDims { h, hkv, tq, tk, d, .. } = inp.dims;
    let (rep, sc) = (h / hkv, inp.scale as f64);
    let (bh, i) = (row / tq, row % tq);
    let (bi, kvh) = (bh / h, (bh / h) * hkv + (bh % h) / rep);
    let (qi, doi, oi) = (row_of(inp.q, row, d), row_of(inp.dout, row, d), row_of(inp.o, row, d));
    let keys: Vec<(&[f32], &[f32])> =
        inp.keys(bi, i).map(|j| (row_of(inp.k, kvh * tk + j, d), row_of(inp.v, kvh * tk + j, d))).collect();
    let sa: Vec<(f64, f64)> = keys.iter().map(|(kj, _)| dot64(qi, kj)).map(|(s, a)| (s * sc, a * sc)).collect();
    let mx = sa.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max);
    let lse = mx + sa.iter().map(|x| (x.0 - mx).exp()).sum::<f64>().ln();
    let amax = sa.iter().map(|x| x.1).fold(0.0, f64::max);
    let mut o = vec![(0.0, 0.0, 0.0); d];
    let mut dq = vec![(0.0, 0.0, 0.0); d];
    let (delta, mdelta) = dot64(doi, oi);
    let lse_k = inp.lse[row] as f64;
    for ((s, a), (kj, vj)) in sa.iter().zip(&keys) {
        let p = (s - lse).exp();
        for (oc, &vc) in o.iter_mut().zip(*vj) {
            let vc = vc as f64;
            oc.0 += p * vc;
            oc.1 += p * vc.abs();
            oc.2 += p * vc.abs() * (1.0 + a);
        }
        let pk = (s - lse_k).exp();
        let (dp, mdp) = dot64(doi, vj);
        let ds = pk * (dp - delta);
        let mds = pk * (mdp + mdelta);
        let mfds = mds + (ds.abs() * (1.0 + a));
        for (qc, &kc) in dq.iter_mut().zip(*kj) {
            let kc = kc as f64;
            qc.0 += sc * ds * kc;
            qc.1 += sc * mds * kc.abs();
            qc.2 += sc * mfds * kc.abs();
        }
    }
    // lse: no rounded operands; its f32 error scales with the scores and the log of the sum
    if keys.len() == 1 {
        // one visible key: P = 1 and dS = 0 exactly, no operand is rounded
        o.iter_mut().chain(dq.iter_mut()).for_each(|e| e.1 = 0.0);
    }
    RowExact { o, lse: (lse, 0.0, 1.0 + amax + mx.abs()), dq, delta: (delta, mdelta) }
}

/// Key row `krow` of a kv head: dK_j = scale sum_i dS_ij q_i, dV_j = sum_i P_ij dO_i over the query rows
/// (of every query head of its group) that see j.
fn exact_key(inp: &Inputs, rows: &[RowExact], krow: usize) -> [Vec<(f64, f64, f64)>; 2] {
    let AttnDims { h, hkv, tq, tk, d, .. } = inp.dims;
    let (rep, sc) = (h / hkv, inp.scale as f64);
    let (bk, j) = (krow / tk, krow % tk);
    let (bi, g) = (bk / hkv, bk % hkv);
    let (kj, vj) = (row_of(inp.k, krow, d), row_of(inp.v, krow, d));
    let (mut dk, mut dv) = (vec![(0.0, 0.0, 0.0); d], vec![(0.0, 0.0, 0.0); d]);
    for hq in g * rep..(g + 1) * rep {
        for i in (0..tq).filter(|&i| inp.keys(bi, i).contains(&j)) {
            let row = (bi * h + hq) * tq + i;
            let (qi, doi) = (row_of(inp.q, row, d), row_of(inp.dout, row, d));
            let (s, a) = dot64(qi, kj);
            let (s, a) = (s * sc, a * sc);
            let pk = (s - inp.lse[row] as f64).exp();
            let ((dp, mdp), (delta, mdelta)) = (dot64(doi, vj), rows[row].delta);
            let ds = pk * (dp - delta);
            let mds = pk * (mdp + mdelta);
            let mfds = mds + ds.abs() * (1.0 + a);
            for c in 0..d {
                let (qc, dc) = (qi[c] as f64, doi[c] as f64);
                dk[c].0 += sc * ds * qc;
                dk[c].1 += sc * mds * qc.abs();
                dk[c].2 += sc * mfds * qc.abs();
                dv[c].0 += pk * dc;
                dv[c].1 += pk * dc.abs();
                dv[c].2 += pk * dc.abs() * (1.0 + a);
            }
        }
    }
    [dk, dv]
}

#[cfg(not(feature = "cuda"))]
mod cuda_run {
    //! Without the `cuda` feature there is no device (`Target::Cuda` cannot be built); stubs keep the
    //! match arms total.
    use super::{AttnDims, AttnKernel, AttnMask, Dt};
    use anyhow::{bail, Result};
    use candle_core::Device;
    const MSG: &str = "this harpe was built without --features cuda";
    pub fn probe(_: &Device, _: Dt, _: &[f32], _: &[f32], _: &[f32]) -> Result<Vec<f32>> {
        bail!(MSG)
    }
    pub fn run(
        _: &Device,
        _: Dt,
        _: AttnKernel,
        _: (&[f32], &[f32], &[f32], &[f32]),
        _: AttnDims,
        _: AttnMask<'_>,
    ) -> Result<[Vec<f32>; 5]> {
        bail!(MSG)
    }
}

#[cfg(feature = "cuda")]
mod cuda_run {
    //! The tensor-core rows through `ops::attention` with autograd; the FMA rows through the launchers.
    use super::{AttnDims, AttnKernel, AttnMask, Dt};
    use crate::ops::attention::DocStarts;
    use crate::ops::attention_cuda;
    use anyhow::{anyhow, bail, Result};
    use candle_core::{Device, Storage, Tensor, Var};

    use crate::tools::selftest::kernels::{down, up};

    pub fn probe(dev: &Device, dt: Dt, a: &[f32], b: &[f32], bt: &[f32]) -> Result<Vec<f32>> {
        Ok(attention_cuda::mma_probe(dev.as_cuda_device()?, dt.dtype(), a, b, bt)?)
    }

    /// q, k, v, dO (f32 host values) through the CUDA kernels in `dt`: [O, lse, dQ, dK, dV] as f32.
    pub fn run(
        dev: &Device,
        dt: Dt,
        kernel: AttnKernel,
        (q, k, v, dout): (&[f32], &[f32], &[f32], &[f32]),
        dims: AttnDims,
        AttnMask { scale, causal, docs }: AttnMask<'_>,
    ) -> Result<[Vec<f32>; 5]> {
        let AttnDims { b, h, hkv, tq, tk, d } = dims;
        let (qs, ks) = ((b, h, tq, d), (b, hkv, tk, d));
        let (qt, kt, vt, dt_) = (up(q, qs, dt, dev)?, up(k, ks, dt, dev)?, up(v, ks, dt, dev)?, up(dout, qs, dt, dev)?);
        let docs = docs.map(|ds| DocStarts::from_per_token(ds.to_vec(), b, tk, dev)).transpose()?;
        let cdev = dev.as_cuda_device()?;
        match kernel {
            AttnKernel::TensorCore => {
                // lse from one more launch of the tiles the op runs (the op keeps it packed inside)
                let lse = {
                    let (sq, lq) = qt.storage_and_layout();
                    let (sk, lk) = kt.storage_and_layout();
                    let (sv, lv) = vt.storage_and_layout();
                    let (Storage::Cuda(cq), Storage::Cuda(ck), Storage::Cuda(cv)) = (&*sq, &*sk, &*sv) else {
                        bail!("attention selftest: inputs are not on the CUDA device");
                    };
                    let mask = AttnMask::new(scale, causal, docs.as_ref().map(|ds| ds.tensor()));
                    let (_, lse, _) = attention_cuda::fwd((cq, lq), (ck, lk), (cv, lv), mask, Some(kernel))?;
                    cdev.clone_dtoh(&lse)?
                };
                let (qv, kv, vv) = (Var::from_tensor(&qt)?, Var::from_tensor(&kt)?, Var::from_tensor(&vt)?);
                let (qa, ka, va) = (qv.as_tensor(), kv.as_tensor(), vv.as_tensor());
                let o = crate::ops::attention::attention(qa, ka, va, scale, causal, docs.as_ref())?;
                let g = (&o * &dt_)?.sum_all()?.backward()?;
                let grad = |x: &Var, n: &str| {
                    g.get(x.as_tensor()).cloned().ok_or_else(|| anyhow!("attention: no gradient reached {n}"))
                };
                Ok([down(&o)?, lse, down(&grad(&qv, "q")?)?, down(&grad(&kv, "k")?)?, down(&grad(&vv, "v")?)?])
            }
            AttnKernel::Fma => {
                let (sq, lq) = qt.storage_and_layout();
                let (sk, lk) = kt.storage_and_layout();
                let (sv, lv) = vt.storage_and_layout();
                let (sd, ld) = dt_.storage_and_layout();
                let (Storage::Cuda(cq), Storage::Cuda(ck), Storage::Cuda(cv), Storage::Cuda(cd)) =
                    (&*sq, &*sk, &*sv, &*sd)
                else {
                    bail!("attention selftest: inputs are not on the CUDA device");
                };
                let mask = AttnMask::new(scale, causal, docs.as_ref().map(|ds| ds.tensor()));
                let (o, lse, _) = attention_cuda::fwd((cq, lq), (ck, lk), (cv, lv), mask, Some(kernel))?;
                let lo = candle_core::Layout::contiguous(qs);
                let (dq, dk, dv) =
                    attention_cuda::bwd((cq, lq), (ck, lk), (cv, lv), ((&o, &lo), &lse), (cd, ld), mask, Some(kernel))?;
                let back = |s: candle_core::CudaStorage, shape: (usize, usize, usize, usize)| -> Result<Vec<f32>> {
                    let t = Tensor::from_storage(Storage::Cuda(s), shape, candle_core::op::BackpropOp::none(), false);
                    down(&t)
                };
                Ok([back(o, qs)?, cdev.clone_dtoh(&lse)?, back(dq, qs)?, back(dk, ks)?, back(dv, ks)?])
            }
        }
    }
}
