//! `harpe selftest` rows for flash attention (kernels/attention.cu, FMA and tensor-core tiles) and for the
//! tensor-core fragment probe (kernels/mma_probe.cu), against the CPU reference
//! (`ops::attention::{attention_fwd_cpu, attention_bwd_cpu}`), forward (O) and backward (dQ, dK, dV).
//!
//! Reference: flash-attention's tests (a bf16 bound of 2x the error of a naive implementation in the
//! same type, here `naive16`, every intermediate rounded) and the shapes: ragged T, GQA 1/4/8,
//! D 64 and 128, Tq < Tk, a document mask (packed sequences, random document starts), and on a GPU
//! T = 4096 + 37.
//! The non-obvious decision: on CUDA the tensor-core rows go through `ops::attention` with autograd (what
//! the model calls: the op's cuda_fwd, its packed O|lse layout and the backward op), the FMA rows
//! through the launchers with the FMA tiles asked for by name; on the emulated target both through
//! `kernels_emu::attention`. The probe's rows check the emulated mma/ldmatrix layouts against the
//! hardware's when run on a GPU.
//! `HARPE_SELFTEST_SMALL` (set by scripts/gpu-check.sh around compute-sanitizer) drops the T = 4133 case.
//! Does not: time anything (`harpe bench attention`), or test Hopper-specific tiles (there are none yet).
use super::{as_dt, check, ragged, uniform, Check, Dt, Target};
use crate::kernels_emu::attention::{self as ka, AttnFloat};
use crate::ops::attention::{attention_bwd_cpu, attention_fwd_cpu, DocStarts};
use crate::ops::attention_shape::{AttnDims, AttnKernel};
use anyhow::Result;
use half::{bf16, f16};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

/// Every attention row for one round.
pub fn checks(target: &Target, r: &mut ChaCha8Rng) -> Result<Vec<Check>> {
    let mut out = Vec::new();
    for dt in [Dt::Bf16, Dt::F16] {
        out.push(probe_check(target, dt, r)?);
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
        out.extend(case(target, dt, kernel, dims, causal, None, r)?);
        // Tq < Tk: a decode step or a prefill chunk against a longer cache
        let tq = if r.random_bool(0.5) { 1 } else { ragged(r, 2, t.max(3)) };
        let dims_c = AttnDims { tq, tk: t + ragged(r, 1, if big { 100 } else { 40 }), ..dims };
        out.extend(case(target, dt, kernel, dims_c, true, None, r)?);
        // a document mask: packed sequences with 1-4 random document starts each
        let t = ragged(r, 2, if big { 1000 } else { 80 });
        let dims = AttnDims { tq: t, tk: t, ..dims };
        let starts: Vec<Vec<usize>> =
            (0..dims.b).map(|_| (0..r.random_range(1..5)).map(|_| r.random_range(0..t)).collect()).collect();
        let starts: Vec<&[usize]> = starts.iter().map(|s| s.as_slice()).collect();
        let docs = DocStarts::from_starts(&starts, t, &candle_core::Device::Cpu)?;
        out.extend(case(target, dt, kernel, dims, true, Some(docs.host()), r)?);
    }
    if big && std::env::var_os("HARPE_SELFTEST_SMALL").is_none() {
        // the long ragged case of the issue on the tensor-core tiles (skipped under compute-sanitizer)
        // (two kv heads: the CPU reference's backward runs one task per kv head)
        let dims = AttnDims { b: 1, h: 2, hkv: 2, tq: 4096 + 37, tk: 4096 + 37, d: 128 };
        out.extend(case(target, Dt::Bf16, AttnKernel::TensorCore, dims, true, None, r)?);
    }
    Ok(out)
}

fn round_fn(dt: Dt) -> fn(f32) -> f32 {
    match dt {
        Dt::F32 => |x| x,
        Dt::Bf16 => |x| bf16::from_f32(x).to_f32(),
        Dt::F16 => |x| f16::from_f32(x).to_f32(),
    }
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
    Ok(check("mma probe (4 paths)", "16x16x16".into(), dt, &got, &want, None, 1e-5))
}

fn to_t<T: AttnFloat>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}
fn of_t<T: AttnFloat>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// One shape: O, dQ, dK, dV of the kernel against the CPU reference; `docs` a document mask (per key, the
/// start of its document).
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
    let q = as_dt(uniform(r, b * h * tq * d, 1.0), dt);
    let k = as_dt(uniform(r, b * hkv * tk * d, 1.0), dt);
    let v = as_dt(uniform(r, b * hkv * tk * d, 1.0), dt);
    let dout = as_dt(uniform(r, b * h * tq * d, 1.0), dt);
    let scale = 1.0 / (d as f32).sqrt();
    let got = match target {
        Target::Emulated => match dt {
            Dt::F32 => emu_run::<f32>(kernel, &q, &k, &v, &dout, dims, scale, causal, docs)?,
            Dt::Bf16 => emu_run::<bf16>(kernel, &q, &k, &v, &dout, dims, scale, causal, docs)?,
            Dt::F16 => emu_run::<f16>(kernel, &q, &k, &v, &dout, dims, scale, causal, docs)?,
        },
        Target::Cuda(dev) => cuda_run::run(dev, dt, kernel, &q, &k, &v, &dout, dims, scale, causal, docs)?,
    };
    let (o_ref, lse_ref) = attention_fwd_cpu(&q, &k, &v, dims, scale, causal, docs);
    let (dq_ref, dk_ref, dv_ref) = attention_bwd_cpu(&q, &k, &v, &o_ref, &lse_ref, &dout, dims, scale, causal, docs);
    let naive = (dt != Dt::F32).then(|| naive16(round_fn(dt), &q, &k, &v, &dout, dims, scale, causal, docs));
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
    let parts = [("O", &got[0], &o_ref), ("dQ", &got[1], &dq_ref), ("dK", &got[2], &dk_ref), ("dV", &got[3], &dv_ref)];
    Ok(parts
        .into_iter()
        .enumerate()
        .map(|(i, (what, g, exact))| {
            let nv = naive.as_ref().map(|n| &n[i][..]);
            check(&format!("{name} {what}"), label.clone(), dt, g, exact, nv, 1e-5)
        })
        .collect())
}

#[allow(clippy::too_many_arguments)]
fn emu_run<T: AttnFloat>(
    kernel: AttnKernel,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    dims: AttnDims,
    scale: f32,
    causal: bool,
    docs: Option<&[u32]>,
) -> Result<[Vec<f32>; 4]> {
    let (q, k, v, dout) = (to_t::<T>(q), to_t::<T>(k), to_t::<T>(v), to_t::<T>(dout));
    let (o, lse) = ka::attention_fwd(kernel, &q, &k, &v, dims, scale, causal, docs)?;
    let (dq, dk, dv) = ka::attention_bwd(kernel, &q, &k, &v, &o, &lse, &dout, dims, scale, causal, docs)?;
    Ok([of_t(&o), of_t(&dq), of_t(&dk), of_t(&dv)])
}

/// One query row of `naive16`: (O_i, dQ_i, p_i, dS_i).
type NaiveRow = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

/// Dense attention with every intermediate rounded by `rd` (the naive 16-bit implementation of the
/// bound): [O, dQ, dK, dV]. Rows in parallel (p and dS of a head are kept: O(Tq Tk) host memory), then
/// keys in parallel, each sum in the same order as a sequential loop over (head, row, key).
#[allow(clippy::too_many_arguments)]
fn naive16(
    rd: fn(f32) -> f32,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    dims: AttnDims,
    scale: f32,
    causal: bool,
    docs: Option<&[u32]>,
) -> [Vec<f32>; 4] {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let rep = h / hkv;
    let dot = |a: &[f32], c: &[f32]| rd(a.iter().zip(c).map(|(x, y)| rd(x * y)).fold(0.0, |s, p| rd(s + p)));
    let (mut o, mut dq) = (vec![0f32; q.len()], vec![0f32; q.len()]);
    let (mut dk, mut dv) = (vec![0f32; k.len()], vec![0f32; v.len()]);
    let lim = |i: usize| if causal { tk - tq + i + 1 } else { tk };
    for bi in 0..b {
        // first key of row i: its document's start (0 without a mask); p_i and dS_i are over lo(i)..lim(i)
        let lo = |i: usize| docs.map_or(0, |ds| ds[bi * tk + tk - tq + i] as usize);
        for hi in 0..h {
            let (bh, kvh) = (bi * h + hi, bi * hkv + hi / rep);
            let row = |x: &[f32], i: usize| x[(bh * tq + i) * d..(bh * tq + i + 1) * d].to_vec();
            let kj = |j: usize| &k[(kvh * tk + j) * d..(kvh * tk + j + 1) * d];
            let vj = |j: usize| &v[(kvh * tk + j) * d..(kvh * tk + j + 1) * d];
            // per row: (O_i, dQ_i, p_i, dS_i)
            let rows: Vec<NaiveRow> = (0..tq)
                .into_par_iter()
                .map(|i| {
                    let (qi, doi) = (row(q, i), row(dout, i));
                    let s: Vec<f32> = (lo(i)..lim(i)).map(|j| rd(dot(&qi, kj(j)) * scale)).collect();
                    let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = s.iter().map(|x| rd((x - m).exp())).collect();
                    let l = e.iter().fold(0.0, |a, x| rd(a + x));
                    let p: Vec<f32> = e.iter().map(|x| rd(x / l)).collect();
                    let lo = lo(i);
                    let oi: Vec<f32> =
                        (0..d).map(|c| (0..p.len()).fold(0.0, |a, j| rd(a + rd(p[j] * vj(lo + j)[c])))).collect();
                    let delta = dot(&doi, &oi);
                    let ds: Vec<f32> = (0..p.len()).map(|j| rd(p[j] * rd(dot(&doi, vj(lo + j)) - delta))).collect();
                    let mut dqi = vec![0f32; d];
                    for (j, &dsj) in ds.iter().enumerate() {
                        for (a, kc) in dqi.iter_mut().zip(kj(lo + j)) {
                            *a = rd(*a + rd(scale * rd(dsj * kc)));
                        }
                    }
                    (oi, dqi, p, ds)
                })
                .collect();
            for (i, (oi, dqi, _, _)) in rows.iter().enumerate() {
                o[(bh * tq + i) * d..(bh * tq + i + 1) * d].copy_from_slice(oi);
                dq[(bh * tq + i) * d..(bh * tq + i + 1) * d].copy_from_slice(dqi);
            }
            let kv_rows = (kvh * tk * d)..((kvh + 1) * tk * d);
            dk[kv_rows.clone()].par_chunks_mut(d).zip(dv[kv_rows].par_chunks_mut(d)).enumerate().for_each(
                |(j, (dkj, dvj))| {
                    for (i, (_, _, p, ds)) in rows.iter().enumerate() {
                        let lo = lo(i);
                        if j < lo || j >= lo + p.len() {
                            continue;
                        }
                        let (qi, doi) = (&q[(bh * tq + i) * d..], &dout[(bh * tq + i) * d..]);
                        for c in 0..d {
                            dvj[c] = rd(dvj[c] + rd(p[j - lo] * doi[c]));
                            dkj[c] = rd(dkj[c] + rd(scale * rd(ds[j - lo] * qi[c])));
                        }
                    }
                },
            );
        }
    }
    [o, dq, dk, dv]
}

#[cfg(not(feature = "cuda"))]
mod cuda_run {
    //! Without the `cuda` feature there is no device (`Target::Cuda` cannot be built); stubs keep the
    //! match arms total.
    use super::{AttnDims, AttnKernel, Dt};
    use anyhow::{bail, Result};
    use candle_core::Device;
    const MSG: &str = "this harpe was built without --features cuda";
    pub fn probe(_: &Device, _: Dt, _: &[f32], _: &[f32], _: &[f32]) -> Result<Vec<f32>> {
        bail!(MSG)
    }
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        _: &Device,
        _: Dt,
        _: AttnKernel,
        _: &[f32],
        _: &[f32],
        _: &[f32],
        _: &[f32],
        _: AttnDims,
        _: f32,
        _: bool,
        _: Option<&[u32]>,
    ) -> Result<[Vec<f32>; 4]> {
        bail!(MSG)
    }
}

#[cfg(feature = "cuda")]
mod cuda_run {
    //! The tensor-core rows through `ops::attention` with autograd; the FMA rows through the launchers.
    use super::{AttnDims, AttnKernel, Dt};
    use crate::ops::attention::DocStarts;
    use crate::ops::attention_cuda;
    use anyhow::{anyhow, bail, Result};
    use candle_core::{Device, Storage, Tensor, Var};

    use crate::selftest::cuda_run::{down, up};

    pub fn probe(dev: &Device, dt: Dt, a: &[f32], b: &[f32], bt: &[f32]) -> Result<Vec<f32>> {
        Ok(attention_cuda::mma_probe(dev.as_cuda_device()?, dt.dtype(), a, b, bt)?)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn run(
        dev: &Device,
        dt: Dt,
        kernel: AttnKernel,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        dout: &[f32],
        dims: AttnDims,
        scale: f32,
        causal: bool,
        docs: Option<&[u32]>,
    ) -> Result<[Vec<f32>; 4]> {
        let AttnDims { b, h, hkv, tq, tk, d } = dims;
        let (qs, ks) = ((b, h, tq, d), (b, hkv, tk, d));
        let (qt, kt, vt, dt_) = (up(q, qs, dt, dev)?, up(k, ks, dt, dev)?, up(v, ks, dt, dev)?, up(dout, qs, dt, dev)?);
        let docs = docs.map(|ds| DocStarts::from_per_token(ds.to_vec(), b, tk, dev)).transpose()?;
        match kernel {
            AttnKernel::TensorCore => {
                let (qv, kv, vv) = (Var::from_tensor(&qt)?, Var::from_tensor(&kt)?, Var::from_tensor(&vt)?);
                let (qa, ka, va) = (qv.as_tensor(), kv.as_tensor(), vv.as_tensor());
                let o = crate::ops::attention::attention(qa, ka, va, scale, causal, docs.as_ref())?;
                let g = (&o * &dt_)?.sum_all()?.backward()?;
                let grad = |x: &Var, n: &str| {
                    g.get(x.as_tensor()).cloned().ok_or_else(|| anyhow!("attention: no gradient reached {n}"))
                };
                Ok([down(&o)?, down(&grad(&qv, "q")?)?, down(&grad(&kv, "k")?)?, down(&grad(&vv, "v")?)?])
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
                let dtens = docs.as_ref().map(|ds| ds.tensor());
                let (o, lse, _) = attention_cuda::fwd(cq, lq, ck, lk, cv, lv, scale, causal, Some(kernel), dtens)?;
                let lo = candle_core::Layout::contiguous(qs);
                let (dq, dk, dv) = attention_cuda::bwd(
                    (cq, lq),
                    (ck, lk),
                    (cv, lv),
                    (&o, &lo),
                    &lse,
                    (cd, ld),
                    scale,
                    causal,
                    Some(kernel),
                    dtens,
                )?;
                let back = |s: candle_core::CudaStorage, shape: (usize, usize, usize, usize)| -> Result<Vec<f32>> {
                    let t = Tensor::from_storage(Storage::Cuda(s), shape, candle_core::op::BackpropOp::none(), false);
                    down(&t)
                };
                Ok([back(o, qs)?, back(dq, qs)?, back(dk, ks)?, back(dv, ks)?])
            }
        }
    }
}
