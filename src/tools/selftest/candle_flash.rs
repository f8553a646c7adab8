//! `harpe selftest` rows comparing harpe's flash forward (kernels/attention.cu, tensor-core tiles, through
//! `ops::attention`) with candle-flash-attn's FlashAttention-2 forward (`ops::candle_flash`) on the same
//! inputs on the same GPU: an independent implementation as the GPU reference (CUDA, `--features
//! flash-attn`; no rows elsewhere).
//!
//! Reference: flash-attention's tests; the bound is selftest's derived 16-bit bound against an f64 exact
//! reference (`selftest::check16`, `selftest::attention::exact16`). Cases: bf16 causal GQA (D 128 and 64), a document mask
//! (packed sequences through the crate's varlen entry), f16 with Tq < Tk (a prefill chunk or decode step
//! against a longer cache), and bf16 at T = 4096 + 37 unless `HARPE_SELFTEST_SMALL`.
//! The non-obvious decision: each case gives two rows, candle-flash-attn against the f32 reference (the
//! crate is checked too, with the same bound as harpe's own rows), and harpe against candle-flash-attn
//! with that same bound: two FA2 forwards that each round O once from f32 agree far closer than a naive
//! 16-bit implementation does with the exact result, so a wrong tile in either shows up here even where
//! the f32 reference is too slow to run.
//! Does not: compare backward (the crate has none), f32 (the crate takes none), or time anything
//! (`harpe bench attention` has a candle-flash-attn column).
use super::attention::{exact16, qkv, random_docs, Inputs};
use super::check::{check16, ragged, Bound16, Check, Dt, Exact, Target};
use crate::ops::attention_shape::AttnDims;
use anyhow::Result;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// The comparison rows on `target` (none unless it is CUDA and the build has candle-flash-attn).
pub fn checks(target: &Target, r: &mut ChaCha8Rng) -> Result<Vec<Check>> {
    let Target::Cuda(dev) = target else {
        return Ok(vec![]);
    };
    if !cfg!(feature = "flash-attn") {
        return Ok(vec![]);
    }
    let mut out = Vec::new();
    let t = ragged(r, 100, 1000);
    let gqa = AttnDims { b: 2, h: 8, hkv: 2, tq: t, tk: t, d: 128 };
    out.extend(case(dev, Dt::Bf16, gqa, None, r)?);
    out.extend(case(dev, Dt::Bf16, AttnDims { h: 8, hkv: 1, d: 64, ..gqa }, None, r)?);
    // a document mask: 1-4 random document starts per sequence
    let docs = random_docs(r, gqa.b, t)?;
    out.extend(case(dev, Dt::Bf16, AttnDims { d: 64, ..gqa }, Some(docs.host()), r)?);
    // Tq < Tk: a prefill chunk or a decode step against a longer cache, f16
    let tq = if r.random_bool(0.5) { 1 } else { ragged(r, 2, t) };
    out.extend(case(dev, Dt::F16, AttnDims { tq, tk: t + ragged(r, 1, 100), ..gqa }, None, r)?);
    if !crate::testing::hooks().selftest_small {
        let long = AttnDims { b: 1, h: 2, hkv: 1, tq: 4096 + 37, tk: 4096 + 37, d: 128 };
        out.extend(case(dev, Dt::Bf16, long, None, r)?);
    }
    Ok(out)
}

/// One shape, causal: candle-flash-attn's O and harpe's O, each against the f64 exact value on the same
/// 16-bit inputs under selftest's derived bound (tensor-core operand roundings, as both round P to the
/// storage type before the PV product), and harpe against candle-flash-attn under the sum of the two
/// bounds (both lie within their bound of the exact value).
fn case(
    dev: &candle_core::Device,
    dt: Dt,
    dims: AttnDims,
    docs: Option<&[u32]>,
    r: &mut ChaCha8Rng,
) -> Result<Vec<Check>> {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let (q, k, v) = qkv(r, dims, dt);
    let scale = 1.0 / (d as f32).sqrt();
    let (harpe, cflash) = cuda_run::run(dev, dt, (&q, &k, &v), dims, scale, docs)?;
    // the forward's exact values (the backward inputs are unused: dO = 0)
    let (zeros, lse0) = (vec![0f32; q.len()], vec![0f32; b * h * tq]);
    let inp = Inputs { q: &q, k: &k, v: &v, dout: &zeros, o: &cflash, lse: &lse0, dims, scale, causal: true, docs };
    let [exact, ..] = exact16(&inp);
    let ndocs = docs.map(|ds| ds.iter().enumerate().filter(|&(j, &s)| s as usize == j % tk).count());
    let label =
        format!("B{b} H{h}/{hkv} T{tq}/{tk} D{d} causal{}", ndocs.map(|n| format!(" {n} docs")).unwrap_or_default());
    let bd = Bound16 { out: dt, operands: Some(dt), len: tq + tk + d };
    // harpe vs the crate: the crate's values as the reference, every error term and the rounding doubled
    let pair = Exact {
        y: cflash.iter().map(|&x| x as f64).collect(),
        mag: exact.mag.iter().map(|m| 2.0 * m).collect(),
        magf: exact.magf.iter().map(|m| 2.0 * m).collect(),
    };
    let mut vs = check16("attention tc O vs candle-flash-attn", label.clone(), dt, &harpe, &pair, bd);
    vs.bound *= 2.0;
    vs.ratio /= 2.0;
    vs.pass = vs.ratio <= 1.0;
    Ok(vec![
        check16("candle-flash-attn O", label.clone(), dt, &cflash, &exact, bd),
        check16("attention tc O", label, dt, &harpe, &exact, bd),
        vs,
    ])
}

#[cfg(not(feature = "flash-attn"))]
mod cuda_run {
    //! Without candle-flash-attn `checks` returns before calling this.
    use super::{AttnDims, Dt};
    use anyhow::{bail, Result};
    pub fn run(
        _: &candle_core::Device,
        _: Dt,
        _: (&[f32], &[f32], &[f32]),
        _: AttnDims,
        _: f32,
        _: Option<&[u32]>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        bail!(crate::ops::candle_flash::NOT_BUILT)
    }
}

#[cfg(feature = "flash-attn")]
mod cuda_run {
    //! Both forwards on the same device tensors.
    use super::{AttnDims, Dt};
    use crate::ops::attention::DocStarts;
    use crate::ops::{attention, candle_flash};
    use crate::tools::selftest::kernels::{down, up};
    use anyhow::Result;
    use candle_core::Device;

    /// (harpe's O, candle-flash-attn's O) as host f32, (B, H, Tq, D).
    pub fn run(
        dev: &Device,
        dt: Dt,
        (q, k, v): (&[f32], &[f32], &[f32]),
        dims: AttnDims,
        scale: f32,
        docs: Option<&[u32]>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let AttnDims { b, h, hkv, tq, tk, d } = dims;
        let (qs, ks) = ((b, h, tq, d), (b, hkv, tk, d));
        let (qt, kt, vt) = (up(q, qs, dt, dev)?, up(k, ks, dt, dev)?, up(v, ks, dt, dev)?);
        let (harpe, cflash) = match docs {
            Some(ds) => {
                let ds = DocStarts::from_per_token(ds.to_vec(), b, tk, dev)?;
                (
                    attention::attention(&qt, &kt, &vt, scale, true, Some(&ds))?,
                    candle_flash::attention_doc(&qt, &kt, &vt, scale, &ds)?,
                )
            }
            None => (
                attention::attention(&qt, &kt, &vt, scale, true, None)?,
                candle_flash::attention(&qt, &kt, &vt, scale, true)?,
            ),
        };
        Ok((down(&harpe)?, down(&cflash)?))
    }
}
