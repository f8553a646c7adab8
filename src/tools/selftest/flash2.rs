//! `harpe selftest` rows for FlashAttention-2's own forward and backward (`ops::flash2`, the training
//! attention of a `--features flash-attn` build): FA2's O, lse, dQ, dK, dV against the f64 exact values,
//! and harpe's own kernels (`ops::attention`, tensor-core tiles) against FA2 on the same inputs on the same
//! GPU, forward and backward through autograd, as training runs them.
//!
//! Reference: flash-attention's tests (compare with a reference and with a second implementation); the
//! bound is selftest's derived 16-bit bound (`check16`, `attention::exact16`). Cases: bf16 causal GQA at D 128
//! and 64, a document mask (FA2's varlen entry), f16 at D 128, and bf16 at T = 4096 + 37 unless
//! `HARPE_SELFTEST_SMALL`.
//! The non-obvious decision: the exact backward is computed from FA2's own O and lse (as for harpe's rows),
//! and harpe against FA2 is held to the sum of the two kernels' bounds (both lie within theirs of the exact
//! value), so a wrong tile in either kernel shows up twice.
//! Does not: the sampled rows at T 32K and 128K (the f64 reference here computes every row), time anything
//! (`harpe bench attention` has FA2 rows), or run anywhere but CUDA with the feature (`note` says so).
use super::attention::{exact16, qkv, random_docs, Inputs};
use super::check::{as_dt, check16, ragged, uniform, Bound16, Check, Dt, Exact, Target};
use crate::ops::attention_shape::AttnDims;
use anyhow::Result;
use rand_chacha::ChaCha8Rng;

/// FA2's [O, lse, dQ, dK, dV] and harpe's [O, dQ, dK, dV] of one case, host f32.
type Outputs = ([Vec<f32>; 5], [Vec<f32>; 4]);

/// Why `checks` gives no rows on `target`, for the table (None: it gives them).
pub fn note(target: &Target) -> Option<&'static str> {
    match target {
        Target::Cuda(_) if cfg!(feature = "flash-attn") => None,
        _ => Some("flash2 rows (FlashAttention-2 forward+backward vs f64 exact and vs harpe's kernels): not on this target; they run on CUDA in a --features flash-attn build"),
    }
}

/// The rows on `target` (none unless it is CUDA and the build has FA2's kernels).
pub fn checks(target: &Target, r: &mut ChaCha8Rng) -> Result<Vec<Check>> {
    let Target::Cuda(dev) = target else {
        return Ok(vec![]);
    };
    if note(target).is_some() {
        return Ok(vec![]);
    }
    let mut out = Vec::new();
    let t = ragged(r, 100, 1000);
    let gqa = AttnDims { b: 2, h: 8, hkv: 2, tq: t, tk: t, d: 128 };
    out.extend(case(dev, Dt::Bf16, gqa, None, r)?);
    out.extend(case(dev, Dt::Bf16, AttnDims { h: 8, hkv: 1, d: 64, ..gqa }, None, r)?);
    let docs = random_docs(r, gqa.b, t)?;
    out.extend(case(dev, Dt::Bf16, AttnDims { d: 64, ..gqa }, Some(docs.host()), r)?);
    out.extend(case(dev, Dt::F16, gqa, None, r)?);
    if !crate::testing::hooks().selftest_small {
        let long = AttnDims { b: 1, h: 2, hkv: 1, tq: 4096 + 37, tk: 4096 + 37, d: 128 };
        out.extend(case(dev, Dt::Bf16, long, None, r)?);
    }
    Ok(out)
}

/// One causal shape: FA2's [O, lse, dQ, dK, dV] against the exact values, harpe's [O, dQ, dK, dV] against
/// FA2's.
fn case(
    dev: &candle_core::Device,
    dt: Dt,
    dims: AttnDims,
    docs: Option<&[u32]>,
    r: &mut ChaCha8Rng,
) -> Result<Vec<Check>> {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let (q, k, v) = qkv(r, dims, dt);
    let dout = as_dt(uniform(r, b * h * tq * d, 1.0), dt);
    let scale = 1.0 / (d as f32).sqrt();
    let (fa2, harpe) = cuda_run::run(dev, dt, (&q, &k, &v, &dout), dims, scale, docs)?;
    let inp = Inputs { q: &q, k: &k, v: &v, dout: &dout, o: &fa2[0], lse: &fa2[1], dims, scale, causal: true, docs };
    let exact = exact16(&inp);
    let ndocs = docs.map(|ds| ds.iter().enumerate().filter(|&(j, &s)| s as usize == j % tk).count());
    let label =
        format!("B{b} H{h}/{hkv} T{tq}/{tk} D{d} causal{}", ndocs.map(|n| format!(" {n} docs")).unwrap_or_default());
    let len = tq + tk + d;
    let what = ["O", "lse", "dQ", "dK", "dV"];
    let mut rows: Vec<Check> = (0..5)
        .map(|i| {
            let bd = match i {
                1 => Bound16 { out: Dt::F32, operands: None, len },
                _ => Bound16 { out: dt, operands: Some(dt), len },
            };
            check16(&format!("flash2 {}", what[i]), label.clone(), dt, &fa2[i], &exact[i], bd)
        })
        .collect();
    // harpe vs FA2: FA2's values as the reference, every error term and the rounding doubled
    for (i, got) in [(0usize, &harpe[0]), (2, &harpe[1]), (3, &harpe[2]), (4, &harpe[3])] {
        let pair = Exact {
            y: fa2[i].iter().map(|&x| x as f64).collect(),
            mag: exact[i].mag.iter().map(|m| 2.0 * m).collect(),
            magf: exact[i].magf.iter().map(|m| 2.0 * m).collect(),
        };
        let bd = Bound16 { out: dt, operands: Some(dt), len };
        let mut vs = check16(&format!("attention tc {} vs flash2", what[i]), label.clone(), dt, got, &pair, bd);
        vs.bound *= 2.0;
        vs.ratio /= 2.0;
        vs.pass = vs.ratio <= 1.0;
        rows.push(vs);
    }
    Ok(rows)
}

#[cfg(not(feature = "flash-attn"))]
mod cuda_run {
    //! Without FA2's kernels `checks` returns before calling this.
    use super::{AttnDims, Dt};
    use anyhow::{bail, Result};

    pub fn run(
        _: &candle_core::Device,
        _: Dt,
        _: (&[f32], &[f32], &[f32], &[f32]),
        _: AttnDims,
        _: f32,
        _: Option<&[u32]>,
    ) -> Result<super::Outputs> {
        bail!(crate::ops::flash2::NOT_BUILT)
    }
}

#[cfg(feature = "flash-attn")]
mod cuda_run {
    //! Both attentions forward and backward (autograd, dO as the upstream gradient) on the same tensors.
    use super::{AttnDims, Dt};
    use crate::ops::attention::DocStarts;
    use crate::ops::{attention, flash2};
    use crate::tools::selftest::kernels::{down, up};
    use anyhow::{anyhow, Result};
    use candle_core::{Device, Tensor, Var};

    /// (FA2's [O, lse, dQ, dK, dV], harpe's [O, dQ, dK, dV]) as host f32, q-shaped (B, H, Tq, D) and
    /// k-shaped (B, Hkv, Tk, D); lse (B, H, Tq).
    pub fn run(
        dev: &Device,
        dt: Dt,
        (q, k, v, dout): (&[f32], &[f32], &[f32], &[f32]),
        dims: AttnDims,
        scale: f32,
        docs: Option<&[u32]>,
    ) -> Result<super::Outputs> {
        let AttnDims { b, h, hkv, tq, tk, d } = dims;
        let (qs, ks) = ((b, h, tq, d), (b, hkv, tk, d));
        let (qt, kt, vt, dot) = (up(q, qs, dt, dev)?, up(k, ks, dt, dev)?, up(v, ks, dt, dev)?, up(dout, qs, dt, dev)?);
        let docs = docs.map(|ds| DocStarts::from_per_token(ds.to_vec(), b, tk, dev)).transpose()?;
        let (_, lse) = flash2::attention_with_lse(&qt, &kt, &vt, scale, docs.as_ref())?;
        let grads = |f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>| -> Result<[Vec<f32>; 4]> {
            let (qv, kv, vv) = (Var::from_tensor(&qt)?, Var::from_tensor(&kt)?, Var::from_tensor(&vt)?);
            let o = f(qv.as_tensor(), kv.as_tensor(), vv.as_tensor())?;
            let g = (&o * &dot)?.sum_all()?.backward()?;
            let grad = |x: &Var, n: &str| {
                g.get(x.as_tensor()).cloned().ok_or_else(|| anyhow!("attention: no gradient reached {n}"))
            };
            Ok([down(&o)?, down(&grad(&qv, "q")?)?, down(&grad(&kv, "k")?)?, down(&grad(&vv, "v")?)?])
        };
        let [o, dq, dk, dv] =
            grads(&|q: &Tensor, k: &Tensor, v: &Tensor| flash2::attention(q, k, v, scale, docs.as_ref()))?;
        let harpe =
            grads(&|q: &Tensor, k: &Tensor, v: &Tensor| attention::attention(q, k, v, scale, true, docs.as_ref()))?;
        Ok(([o, lse, dq, dk, dv], harpe))
    }
}
