//! selftest's rows of the kernels other than attention: RoPE (HARPE tables, GQA sharing), RMSNorm,
//! the fused cross-entropy chunk and AdamW with the gradient sum of squares, each on the emulator or
//! through the CUDA ops the model calls (`cuda_run`), against the CPU references under `check.rs`'s rules.
use super::check::{as_dt, check, check16, emu_dims, max_abs, max_abs_diff, of_t, ragged, to_t, uniform};
use super::check::{Bound16, Check, Dt, Exact, Target};
use crate::model::rope::{RopeParity, RopeScheme};
use crate::ops::cross_entropy_chunk::ce_rows_cpu;
use crate::ops::cross_entropy_chunk::IGNORE_INDEX;
use crate::ops::emu::{self as emu, Dims};
use crate::ops::rms_norm::{rms_norm_bwd_cpu, rms_norm_cpu};
use crate::ops::rotary::rotary_cpu;
use crate::optim::adamw::{AdamW, AdamWHyper};
use anyhow::{bail, Result};
use candle_core::Device;
use half::bf16;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

macro_rules! by_dtype {
    ($dt:expr, |$t:ident| $body:expr) => {
        match $dt {
            Dt::F32 => {
                type $t = f32;
                $body
            }
            Dt::Bf16 => {
                type $t = bf16;
                $body
            }
            Dt::F16 => bail!("selftest: only the attention kernels are instantiated for f16"),
        }
    };
}

/// RoPE forward and backward with HARPE tables (one row set per kv head, GQA sharing).
pub fn rope_checks(target: &Target, dt: Dt, r: &mut ChaCha8Rng) -> Result<Vec<Check>> {
    let big = matches!(target, Target::Cuda(_));
    let htab = r.random_range(1..4);
    let h = htab * r.random_range(1..4);
    let (b, t) = (r.random_range(1..3), ragged(r, 3, if big { 700 } else { 40 }));
    let d = 2 * r.random_range(3..if big { 70 } else { 20 });
    let bases: Vec<f64> = (0..htab).map(|i| 1e4 * 10f64.powi(i as i32)).collect();
    let scheme = if htab == 1 {
        RopeScheme::Default { theta: bases[0] }
    } else {
        RopeScheme::Harpe { head_bases: bases, layer_head_bases: None }
    };
    let start = r.random_range(0..200_000);
    let at = crate::model::rope::Positions::new(start, t);
    let tab = scheme.tables(d, 0, at, RopeParity::F64, &Device::Cpu)?;
    let cos = tab.cos.flatten_all()?.to_vec1::<f32>()?;
    let sin = tab.sin.flatten_all()?.to_vec1::<f32>()?;
    let nsin: Vec<f32> = sin.iter().map(|s| -s).collect();
    let x = as_dt(uniform(r, b * h * t * d, 1.0), dt);
    let dy = as_dt(uniform(r, b * h * t * d, 1.0), dt);
    let shape = (b, h, t, d);
    let (y, dx) = match target {
        Target::Emulated => {
            let dims = emu_dims(r);
            by_dtype!(dt, |T| (
                of_t(&emu::rope::<T>(&to_t::<T>(&x), &cos, &sin, shape, htab, 1.0, dims)?),
                of_t(&emu::rope::<T>(&to_t::<T>(&dy), &cos, &sin, shape, htab, -1.0, dims)?)
            ))
        }
        Target::Cuda(dev) => cuda_run::rope(dev, dt, &x, &dy, &tab.cos, &tab.sin, shape)?,
    };
    let case = format!("B{b} H{h} Htab{htab} T{t} D{d} pos{start}");
    if dt == Dt::F32 {
        let y_ref = rotary_cpu(&x, &cos, &sin, shape, htab);
        let dx_ref = rotary_cpu(&dy, &cos, &nsin, shape, htab);
        return Ok(vec![
            check("rope fwd", case.clone(), dt, &y, &y_ref, 1e-5),
            check("rope bwd", case, dt, &dx, &dx_ref, 1e-5),
        ]);
    }
    // exact: y1 = x1 c - x2 s, y2 = x2 c + x1 s from the rounded x and the f32 tables; M = |x1 c| + |x2 s|
    let exact = |inp: &[f32], s: &[f32]| -> Exact {
        let (half, rep) = (d / 2, h / htab);
        let mut ex = Exact::zeros(inp.len());
        for row in 0..b * h * t {
            let (ti, hi) = (row % t, (row / t) % h);
            let tr = ((hi / rep) * t + ti) * half;
            for j in 0..half {
                let (c, sn) = (cos[tr + j] as f64, s[tr + j] as f64);
                let (x1, x2) = (inp[row * d + j] as f64, inp[row * d + j + half] as f64);
                let m = (x1 * c).abs() + (x2 * sn).abs();
                ex.set(row * d + j, x1 * c - x2 * sn, m);
                ex.set(row * d + j + half, x2 * c + x1 * sn, m);
            }
        }
        ex
    };
    let bd = Bound16 { out: dt, operands: None, len: 2 };
    Ok(vec![
        check16("rope fwd", case.clone(), dt, &y, &exact(&x, &sin), bd),
        check16("rope bwd", case, dt, &dx, &exact(&dy, &nsin), bd),
    ])
}

/// RMSNorm forward (y) and backward (dx, dw).
pub fn rms_norm_checks(target: &Target, dt: Dt, r: &mut ChaCha8Rng) -> Result<Vec<Check>> {
    let big = matches!(target, Target::Cuda(_));
    let n = ragged(r, 2, if big { 300 } else { 12 });
    let c = ragged(r, 5, if big { 5000 } else { 200 });
    let eps = 1e-5f32;
    let x = as_dt(uniform(r, n * c, 2.0), dt);
    let w = as_dt(uniform(r, c, 1.5), dt);
    let dy = as_dt(uniform(r, n * c, 1.0), dt);
    let (y, dx, dw) = match target {
        Target::Emulated => {
            let dims = emu_dims(r);
            by_dtype!(dt, |T| {
                let (xt, wt, dyt) = (to_t::<T>(&x), to_t::<T>(&w), to_t::<T>(&dy));
                let (y, rstd) = emu::rms_norm_fwd::<T>(&xt, &wt, (n, c), eps, dims)?;
                // once with the forward's rstd, once recomputing it: both must agree
                let (dx, dw) = emu::rms_norm_bwd::<T>(&dyt, &xt, &wt, Some(&rstd), (n, c), eps, dims)?;
                let (dx2, dw2) = emu::rms_norm_bwd::<T>(&dyt, &xt, &wt, None, (n, c), eps, dims)?;
                if of_t(&dx) != of_t(&dx2) || of_t(&dw) != of_t(&dw2) {
                    bail!("rms_norm backward: saved and recomputed rstd give different gradients");
                }
                (of_t(&y), of_t(&dx), of_t(&dw))
            })
        }
        Target::Cuda(dev) => cuda_run::rms_norm(dev, dt, &x, &w, &dy, (n, c), eps)?,
    };
    let case = format!("N{n} C{c}");
    if dt == Dt::F32 {
        let (y_ref, _) = rms_norm_cpu(&x, &w, c, eps);
        let (dx_ref, dw_ref) = rms_norm_bwd_cpu(&dy, &x, &w, c, eps);
        return Ok(vec![
            check("rms_norm fwd", case.clone(), dt, &y, &y_ref, 1e-5),
            check("rms_norm bwd dx", case.clone(), dt, &dx, &dx_ref, 1e-5),
            check("rms_norm bwd dw", case, dt, &dw, &dw_ref, 1e-5),
        ]);
    }
    // exact, per row: r = 1/sqrt(sum x^2 / C + eps), xh = x r, y = round(xh) w, dot = sum dy w xh / C,
    // dx = r (dy w - xh dot), dw = sum over rows of dy round(xh): the op rounds xh (HF's order); where the
    // kernel's f32 xh (relative error <= 2 (C + 16) u32) may round the other way, M holds ulp(xh)/u |w|
    let (mut ey, mut edx, mut edw) = (Exact::zeros(n * c), Exact::zeros(n * c), Exact::zeros(c));
    let f = |v: &[f32], i: usize| v[i] as f64;
    let rel = 2.0 * (c + 16) as f64 * Dt::F32.unit();
    let round = |v: f64| as_dt(vec![v as f32], dt)[0] as f64;
    // (round(xh), ulp(xh)/u where the rounding is ambiguous, else 0)
    let rounded = |xh: f64| {
        let tie = round(xh - rel * xh.abs()) != round(xh + rel * xh.abs());
        (round(xh), if tie { 2.0 * dt.half_ulp(xh.abs()) / dt.unit() } else { 0.0 })
    };
    for i in 0..n {
        let rs = 1.0 / ((0..c).map(|j| f(&x, i * c + j).powi(2)).sum::<f64>() / c as f64 + eps as f64).sqrt();
        let xh = |j: usize| f(&x, i * c + j) * rs;
        let g = |j: usize| f(&dy, i * c + j) * f(&w, j);
        let dot = (0..c).map(|j| g(j) * xh(j)).sum::<f64>() / c as f64;
        let dot_m = (0..c).map(|j| (g(j) * xh(j)).abs()).sum::<f64>() / c as f64;
        for j in 0..c {
            let k = i * c + j;
            let (xr, amb) = rounded(xh(j));
            (ey.y[k], ey.mag[k], ey.magf[k]) = (xr * f(&w, j), amb * f(&w, j).abs(), (xr * f(&w, j)).abs());
            edx.set(k, rs * (g(j) - xh(j) * dot), rs * (g(j).abs() + xh(j).abs() * dot_m));
            edw.y[j] += f(&dy, k) * xr;
            edw.mag[j] += f(&dy, k).abs() * amb;
            edw.magf[j] += (f(&dy, k) * xr).abs();
        }
    }
    let bd = Bound16 { out: dt, operands: Some(dt), len: c };
    Ok(vec![
        check16("rms_norm fwd", case.clone(), dt, &y, &ey, bd),
        check16("rms_norm bwd dx", case.clone(), dt, &dx, &edx, Bound16 { operands: None, ..bd }),
        check16("rms_norm bwd dw", case, dt, &dw, &edw, Bound16 { len: c + n, ..bd }),
    ])
}

/// Fused cross-entropy on one logits chunk: nll (forward) and dlogits (backward), with ignored rows.
pub fn cross_entropy_checks(target: &Target, dt: Dt, r: &mut ChaCha8Rng) -> Result<Vec<Check>> {
    let big = matches!(target, Target::Cuda(_));
    let n = ragged(r, 3, if big { 100 } else { 10 });
    let v = ragged(r, 33, if big { 33_000 } else { 300 });
    let logits = as_dt(uniform(r, n * v, 6.0), dt);
    let mut targets: Vec<u32> = (0..n).map(|_| r.random_range(0..v as u32)).collect();
    targets[r.random_range(0..n)] = IGNORE_INDEX;
    let g: Vec<f32> = (0..n).map(|_| r.random::<f32>() + 0.1).collect();
    let (nll, dl) = match target {
        Target::Emulated => {
            let dims = emu_dims(r);
            by_dtype!(dt, |T| {
                let lt = to_t::<T>(&logits);
                let fwd = emu::cross_entropy::<T>(&lt, &targets, None, (n, v), false, dims)?;
                let bwd = emu::cross_entropy::<T>(&lt, &targets, Some(&g), (n, v), true, dims)?;
                let dl = bwd.dlogits.map(|d| of_t(&d)).unwrap_or_default();
                if fwd.nll != bwd.nll {
                    bail!("cross_entropy: nll differs between the forward and the in-place backward launch");
                }
                (fwd.nll, dl)
            })
        }
        Target::Cuda(dev) => cuda_run::cross_entropy(dev, dt, &logits, &targets, &g, (n, v))?,
    };
    let case = format!("n{n} V{v} (1 ignored)");
    if dt == Dt::F32 {
        let (nll_ref, _, dl_ref) = ce_rows_cpu(&logits, &targets, Some(&g), v, |x| x, |x| x);
        return Ok(vec![
            check("cross_entropy nll", case.clone(), dt, &nll, &nll_ref, 1e-5),
            check("cross_entropy dlogits", case, dt, &dl, &dl_ref.unwrap_or_default(), 1e-5),
        ]);
    }
    // exact, per row: lse = m + ln sum exp(l - m), nll = lse - l_y (an f32 output), dl = g (p - [j = y]) with
    // p = exp(l - lse); an error e in lse or l moves p by the relative e: M_f = g p (1 + |l| + |lse|)
    let (mut enll, mut edl) = (Exact::zeros(n), Exact::zeros(n * v));
    for i in 0..n {
        let row: Vec<f64> = logits[i * v..(i + 1) * v].iter().map(|&l| l as f64).collect();
        let y = targets[i];
        if y == IGNORE_INDEX {
            continue;
        }
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|l| (l - m).exp()).sum::<f64>().ln();
        let ly = row[y as usize];
        enll.set(i, lse - ly, 1.0 + m.abs() + lse.abs() + ly.abs());
        let gi = g[i] as f64;
        for (j, &l) in row.iter().enumerate() {
            let p = (l - lse).exp();
            let hot = if j as u32 == y { 1.0 } else { 0.0 };
            edl.set(i * v + j, gi * (p - hot), gi * (p + hot));
            edl.magf[i * v + j] = gi * (p * (1.0 + l.abs() + lse.abs()) + hot);
        }
    }
    Ok(vec![
        check16("cross_entropy nll", case.clone(), dt, &nll, &enll, Bound16 { out: Dt::F32, operands: None, len: v }),
        check16("cross_entropy dlogits", case, dt, &dl, &edl, Bound16 { out: dt, operands: None, len: v }),
    ])
}

/// Fused AdamW against `optim::adamw::AdamW` over three steps (decay on one segment, none on the
/// other, a clipping scale), and the gradient sum of squares against an f64 sum.
pub fn adamw_checks(target: &Target, dt: Dt, r: &mut ChaCha8Rng) -> Result<Vec<Check>> {
    let big = matches!(target, Target::Cuda(_));
    let n = ragged(r, 40, if big { 300_000 } else { 3000 });
    let split = r.random_range(1..n);
    let hp = AdamWHyper { beta1: 0.9, beta2: 0.95, eps: 1e-8, wd_matrix: 0.1, wd_embedding: 0.1, wd_norm: 0.0 };
    let layout = crate::model::layout::ParamLayout::new(&[
        ("model.layers.0.mlp.up_proj.weight".into(), vec![split]),
        ("model.layers.0.input_layernorm.weight".into(), vec![n - split]),
    ]);
    let p0 = uniform(r, n, 1.0);
    let one_rank = crate::comms::zero::ShardMap::new(&layout, 1, crate::comms::zero::Split::Slices);
    let mut reference = AdamW::new(&layout, &crate::flatbuf::FlatBuf::from_vec(p0.clone()), &one_rank, 0, hp)?;
    let segments = vec![(0..split, hp.wd_matrix), (split..n, hp.wd_norm)];
    let grads: Vec<Vec<f32>> = (0..3).map(|_| uniform(r, n, 0.05)).collect();
    let scales = [1.0f32, 0.5, 0.25];
    let lr = 3e-3;
    let run = AdamwRun { p0: &p0, grads: &grads, scales: &scales, segments: &segments, hp, lr };
    let (sumsq, master, out) = match target {
        Target::Emulated => emu_adamw(dt, run, emu_dims(r))?,
        Target::Cuda(dev) => cuda_run::adamw(dev, dt, run)?,
    };
    for (g, &s) in grads.iter().zip(&scales) {
        let gs: Vec<f32> = g.iter().map(|x| x * s).collect();
        reference.step(&crate::flatbuf::FlatBuf::from_vec(gs), lr)?;
    }
    let exact_ss: f64 = grads[0].iter().map(|&x| x as f64 * x as f64).sum();
    let case = format!("n{n} split{split} 3 steps");
    let ref_master: Vec<f32> = reference.master().to_host()?.into_owned();
    let mut checks = vec![check("adamw master", case.clone(), Dt::F32, &master, &ref_master, 1e-6)];
    // compute weights: within 2x the rounding error of a correctly rounded copy of the master
    let err = max_abs_diff(&out, &ref_master);
    let (bound, rule) = match dt {
        Dt::F32 => (1e-6 * max_abs(&ref_master).max(1.0), "f32 tolerance"),
        _ => (2.0 * max_abs_diff(&as_dt(ref_master.clone(), dt), &ref_master).max(1e-30), "<= 2x rounding"),
    };
    checks.push(Check::new("adamw compute copy", case.clone(), dt, err, bound, rule));
    let ss_err = (sumsq - exact_ss).abs();
    checks.push(Check::new("grad sum of squares", case, Dt::F32, ss_err, 1e-12 * exact_ss.max(1.0), "f64 tolerance"));
    Ok(checks)
}

/// torch's bias corrections for step t, as `AdamW::step` computes them (f64, then f32).
pub fn adamw_scalars(hp: AdamWHyper, lr: f64, t: u64, wd: f32, grad_scale: f32) -> emu::AdamWArgs {
    let bc1 = 1.0 - (hp.beta1 as f64).powi(t as i32);
    let bc2_sqrt = (1.0 - (hp.beta2 as f64).powi(t as i32)).sqrt();
    emu::AdamWArgs {
        lr: lr as f32,
        beta1: hp.beta1,
        beta2: hp.beta2,
        eps: hp.eps,
        wd,
        step_size: (lr / bc1) as f32,
        bc2_sqrt: bc2_sqrt as f32,
        grad_scale,
    }
}

type AdamwOut = (f64, Vec<f32>, Vec<f32>);

/// One AdamW check's inputs: initial weights, one gradient per step with its clipping scale, the weight-decay
/// segments, the hyper-parameters and the learning rate.
#[derive(Clone, Copy)]
struct AdamwRun<'a> {
    p0: &'a [f32],
    grads: &'a [Vec<f32>],
    scales: &'a [f32],
    segments: &'a [(std::ops::Range<usize>, f32)],
    hp: AdamWHyper,
    lr: f64,
}

/// `run` through the emulated kernels: (gradient sum of squares of step 1, master, compute weights).
fn emu_adamw(dt: Dt, run: AdamwRun<'_>, dims: Dims) -> Result<AdamwOut> {
    let AdamwRun { p0, grads, scales, segments, hp, lr } = run;
    let n = p0.len();
    let sumsq = emu::grad_sumsq(&grads[0], dims)?;
    let (mut master, mut m, mut v) = (p0.to_vec(), vec![0f32; n], vec![0f32; n]);
    let out = by_dtype!(dt, |T| {
        let mut out = vec![T::default(); n];
        for (t, (g, &s)) in grads.iter().zip(scales).enumerate() {
            for (rg, wd) in segments {
                let a = adamw_scalars(hp, lr, t as u64 + 1, *wd, s);
                let rg = rg.clone();
                emu::adamw::<T>(
                    &mut master[rg.clone()],
                    &mut m[rg.clone()],
                    &mut v[rg.clone()],
                    &g[rg.clone()],
                    Some(&mut out[rg]),
                    a,
                    dims,
                )?;
            }
        }
        of_t(&out)
    });
    Ok((sumsq, master, out))
}

#[cfg(not(feature = "cuda"))]
mod cuda_run {
    //! Without the `cuda` feature there is no device to run on; `Target::Cuda` cannot be built by
    //! `run`, and these stubs only keep the match arms total.
    use super::{AdamwOut, AdamwRun, Dt};
    use anyhow::{bail, Result};
    use candle_core::{Device, Tensor};
    const MSG: &str = "this harpe was built without --features cuda";
    pub fn rope(
        _: &Device,
        _: Dt,
        _: &[f32],
        _: &[f32],
        _: &Tensor,
        _: &Tensor,
        _: (usize, usize, usize, usize),
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        bail!(MSG)
    }
    pub fn rms_norm(
        _: &Device,
        _: Dt,
        _: &[f32],
        _: &[f32],
        _: &[f32],
        _: (usize, usize),
        _: f32,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        bail!(MSG)
    }
    pub fn cross_entropy(
        _: &Device,
        _: Dt,
        _: &[f32],
        _: &[u32],
        _: &[f32],
        _: (usize, usize),
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        bail!(MSG)
    }
    pub fn adamw(_: &Device, _: Dt, _: AdamwRun<'_>) -> Result<AdamwOut> {
        bail!(MSG)
    }
}

// The CUDA rows' upload and download helpers, which the attention rows use too.
#[cfg(feature = "cuda")]
pub(super) use cuda_run::{down, up};

#[cfg(feature = "cuda")]
mod cuda_run {
    //! The same cases through the ops the model calls (rope, rms_norm with autograd, the CE chunk ops)
    //! and the optimizer's flat-buffer launchers.
    use super::{adamw_scalars, AdamwOut, AdamwRun, Dt};
    use crate::ops::cuda::{adamw_step, grad_sumsq, AdamWBuffers, AdamWStep, ComputeOut};
    use anyhow::{anyhow, bail, Result};
    use candle_core::{DType, Device, Tensor, Var};

    /// Host values as a tensor of `dt` on `dev` (the GPU rows' inputs; `selftest::attention` too).
    pub(in crate::tools::selftest) fn up<S: Into<candle_core::Shape>>(
        v: &[f32],
        shape: S,
        dt: Dt,
        dev: &Device,
    ) -> Result<Tensor> {
        Ok(Tensor::from_slice(v, shape, &Device::Cpu)?.to_dtype(dt.dtype())?.to_device(dev)?)
    }
    /// A device tensor's values as host f32.
    pub(in crate::tools::selftest) fn down(t: &Tensor) -> Result<Vec<f32>> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<f32>()?)
    }

    pub fn rope(
        dev: &Device,
        dt: Dt,
        x: &[f32],
        dy: &[f32],
        cos: &Tensor,
        sin: &Tensor,
        (b, h, t, d): (usize, usize, usize, usize),
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let xv = Var::from_tensor(&up(x, &[b, h, t, d], dt, dev)?)?;
        let (c, s) = (cos.to_device(dev)?, sin.to_device(dev)?);
        let y = crate::ops::rotary::rope(xv.as_tensor(), &c, &s)?;
        let g = (&y * up(dy, &[b, h, t, d], dt, dev)?)?.sum_all()?.backward()?;
        let dx = g.get(xv.as_tensor()).ok_or_else(|| anyhow!("rope: no gradient reached x"))?;
        Ok((down(&y)?, down(dx)?))
    }

    pub fn rms_norm(
        dev: &Device,
        dt: Dt,
        x: &[f32],
        w: &[f32],
        dy: &[f32],
        (n, c): (usize, usize),
        eps: f32,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let xv = Var::from_tensor(&up(x, &[n, c], dt, dev)?)?;
        let wv = Var::from_tensor(&up(w, &[c], dt, dev)?)?;
        let y = crate::ops::rms_norm::rms_norm(xv.as_tensor(), wv.as_tensor(), eps as f64)?;
        let g = (&y * up(dy, &[n, c], dt, dev)?)?.sum_all()?.backward()?;
        let dx = g.get(xv.as_tensor()).ok_or_else(|| anyhow!("rms_norm: no gradient reached x"))?;
        let dw = g.get(wv.as_tensor()).ok_or_else(|| anyhow!("rms_norm: no gradient reached w"))?;
        Ok((down(&y)?, down(dx)?, down(dw)?))
    }

    pub fn cross_entropy(
        dev: &Device,
        dt: Dt,
        logits: &[f32],
        targets: &[u32],
        g: &[f32],
        (n, v): (usize, usize),
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        use crate::ops::cross_entropy_chunk::{ce_chunk_dlogits, ce_chunk_nll, check_targets};
        let l = up(logits, &[n, v], dt, dev)?;
        let t = Tensor::from_slice(targets, n, &Device::Cpu)?.to_device(dev)?;
        check_targets(&t, v)?;
        let gt = Tensor::from_slice(g, n, &Device::Cpu)?.to_device(dev)?;
        Ok((down(&ce_chunk_nll(&l, &t)?)?, down(&ce_chunk_dlogits(&l, &t, &gt)?)?))
    }

    /// `run` through the CUDA kernels: (gradient sum of squares of step 1, master, compute weights).
    pub fn adamw(dev: &Device, dt: Dt, run: AdamwRun<'_>) -> Result<AdamwOut> {
        let AdamwRun { p0, grads, scales, segments, hp, lr } = run;
        let cd = dev.as_cuda_device()?;
        let n = p0.len();
        let mut master = cd.clone_htod(p0)?;
        let mut m = cd.alloc_zeros::<f32>(n)?;
        let mut v = cd.alloc_zeros::<f32>(n)?;
        let g0 = cd.clone_htod(&grads[0])?;
        let sumsq = grad_sumsq(cd, &g0.slice(..))?;
        let mut of = cd.alloc_zeros::<f32>(n)?;
        let mut ob = cd.alloc_zeros::<half::bf16>(n)?;
        for (t, (g, &s)) in grads.iter().zip(scales).enumerate() {
            let gd = cd.clone_htod(g)?;
            let a = adamw_scalars(hp, lr, t as u64 + 1, 0.0, s);
            let step = AdamWStep {
                lr: a.lr,
                beta1: a.beta1,
                beta2: a.beta2,
                eps: a.eps,
                step_size: a.step_size,
                bc2_sqrt: a.bc2_sqrt,
                grad_scale: a.grad_scale,
            };
            let out = match dt {
                Dt::F32 => ComputeOut::F32(&mut of),
                Dt::Bf16 => ComputeOut::Bf16(&mut ob),
                Dt::F16 => bail!("adamw: no f16 compute weights"),
            };
            adamw_step(cd, AdamWBuffers { master: &mut master, m: &mut m, v: &mut v, grad: &gd }, out, segments, step)?;
        }
        let out = match dt {
            Dt::Bf16 => cd.clone_dtoh(&ob)?.into_iter().map(|x| x.to_f32()).collect(),
            _ => cd.clone_dtoh(&of)?,
        };
        Ok((sumsq, cd.clone_dtoh(&master)?, out))
    }
}
