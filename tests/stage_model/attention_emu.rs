//! kernels/attention.cu (flash attention forward and backward) compiled for the host against
//! kernels/emu.h, against the CPU reference `ops::attention::{attention_fwd_cpu, attention_bwd_cpu}` on
//! small ragged shapes. FMA tiles: T in {1, 17, 70} (never a multiple of the 16/32-row tiles), GQA ratios
//! 1/2/4, Tq < Tk (decode, chunked prefill), every instantiated head dim, causal and full, f32, bf16, f16.
//! Tensor-core tiles (the emulated mma.sync/ldmatrix of kernels/emu.h, first checked alone through
//! kernels/mma_probe.cu): T in {1, 17, 100, 130}, GQA 1/2/4, D 64 and 128, causal and full, Tq < Tk,
//! bf16 and f16, forward and backward.
//! Document masks (packed sequences): documents of lengths 1, 17 and uneven ones, documents crossing tile
//! boundaries, query tiles that skip whole key tiles, GQA; FMA and tensor-core tiles against the CPU
//! reference under the same mask (itself checked against the dense-mask slow op in tests/stage_model/attention_docs.rs);
//! one document per sequence gives the causal kernels' output bit for bit.
//! Bounds: f32 — 1e-5 x max(1, max |reference|); bf16/f16 — the project's rule: the exact result is the f32
//! reference on the same rounded inputs, and the kernel's error is at most 2x that of a naive
//! implementation in that type (every intermediate rounded, `naive16` below).
use crate::common::ops::{max_abs, max_abs_diff};
use half::{bf16, f16};
use harpe::ops::attention::{attention_bwd_cpu, attention_fwd_cpu, DocStarts};
use harpe::ops::attention_shape::{attention_workspace, AttnDims, AttnKernel, AttnMask, PackedRows};
use harpe::ops::emu::attention::{self as ka, AttnFloat};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn uniform(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random::<f32>() * 2.0 - 1.0).collect()
}

fn to_t<T: AttnFloat>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

fn of_t<T: AttnFloat>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// Random q, k, v and dO of `dims` in T, drawn in that order from `seed`.
fn inputs<T: AttnFloat>(dims: AttnDims, seed: u64) -> [Vec<T>; 4] {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    [b * h * tq * d, b * hkv * tk * d, b * hkv * tk * d, b * h * tq * d].map(|n| to_t(&uniform(&mut r, n)))
}

/// Dense attention with every intermediate rounded to T (bf16 or f16): forward (O, lse) and backward
/// (dQ, dK, dV).
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
fn naive16<T: AttnFloat>(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    dims: AttnDims,
    scale: f32,
    causal: bool,
    docs: Option<&[u32]>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let r16 = |x: f32| T::from_f32(x).to_f32();
    let rep = h / hkv;
    let (mut o, mut lse) = (vec![0f32; q.len()], vec![0f32; b * h * tq]);
    let (mut dq, mut dk, mut dv) = (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; v.len()]);
    let dot16 = |a: &[f32], c: &[f32]| r16(a.iter().zip(c).map(|(x, y)| r16(x * y)).fold(0.0, |s, p| r16(s + p)));
    for bi in 0..b {
        for hi in 0..h {
            let bh = bi * h + hi;
            let kvh = bi * hkv + hi / rep;
            for i in 0..tq {
                let lim = if causal { tk - tq + i + 1 } else { tk };
                let lo = docs.map_or(0, |ds| ds[bi * tk + tk - tq + i] as usize);
                let qi = &q[(bh * tq + i) * d..(bh * tq + i + 1) * d];
                let kj = |j: usize| &k[(kvh * tk + j) * d..(kvh * tk + j + 1) * d];
                let vj = |j: usize| &v[(kvh * tk + j) * d..(kvh * tk + j + 1) * d];
                let s: Vec<f32> = (lo..lim).map(|j| r16(dot16(qi, kj(j)) * scale)).collect();
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = s.iter().map(|x| r16((x - m).exp())).collect();
                let l = e.iter().fold(0.0, |a, x| r16(a + x));
                let p: Vec<f32> = e.iter().map(|x| r16(x / l)).collect();
                lse[bh * tq + i] = r16(m + l.ln());
                let oi = &mut o[(bh * tq + i) * d..(bh * tq + i + 1) * d];
                for (c, oc) in oi.iter_mut().enumerate() {
                    *oc = (lo..lim).fold(0.0, |a, j| r16(a + r16(p[j - lo] * vj(j)[c])));
                }
                let oi = oi.to_vec();
                let doi = &dout[(bh * tq + i) * d..(bh * tq + i + 1) * d];
                let delta = dot16(doi, &oi);
                for (j, &pj) in (lo..lim).zip(&p) {
                    let ds = r16(pj * r16(dot16(doi, vj(j)) - delta));
                    for c in 0..d {
                        let kk = (kvh * tk + j) * d + c;
                        dv[kk] = r16(dv[kk] + r16(pj * doi[c]));
                        dk[kk] = r16(dk[kk] + r16(scale * r16(ds * qi[c])));
                        let qq = (bh * tq + i) * d + c;
                        dq[qq] = r16(dq[qq] + r16(scale * r16(ds * kj(j)[c])));
                    }
                }
            }
        }
    }
    (o, lse, dq, dk, dv)
}

/// Forward and backward of the emulated FMA kernel against the CPU reference; `bf` says T is 16-bit.
fn check_case<T: AttnFloat>(dims: AttnDims, causal: bool, bf: bool, seed: u64) {
    assert_eq!(bf, std::mem::size_of::<T>() == 2);
    check_kernel::<T>(AttnKernel::Fma, dims, causal, seed);
}

/// Forward and backward of one emulated kernel against the CPU reference; panics naming the case.
fn check_kernel<T: AttnFloat>(kernel: AttnKernel, dims: AttnDims, causal: bool, seed: u64) {
    check_kernel_docs::<T>(kernel, dims, causal, None, seed);
}

/// `check_kernel` under an optional document mask (`docs`: per key, its document's start).
fn check_kernel_docs<T: AttnFloat>(kernel: AttnKernel, dims: AttnDims, causal: bool, docs: Option<&[u32]>, seed: u64) {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let bf = std::mem::size_of::<T>() == 2;
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let round = |x: Vec<f32>| -> Vec<f32> { x.into_iter().map(|v| T::from_f32(v).to_f32()).collect() };
    let q = round(uniform(&mut r, b * h * tq * d));
    let k = round(uniform(&mut r, b * hkv * tk * d));
    let v = round(uniform(&mut r, b * hkv * tk * d));
    let dout = round(uniform(&mut r, b * h * tq * d));
    let scale = 1.0 / (d as f32).sqrt();
    let case = format!("{kernel:?} {dims:?} causal={causal} docs={} {}", docs.is_some(), std::any::type_name::<T>());

    let (o_ref, lse_ref) = attention_fwd_cpu(&q, &k, &v, dims, scale, causal, docs);
    let (qt, kt, vt, dt) = (to_t::<T>(&q), to_t::<T>(&k), to_t::<T>(&v), to_t::<T>(&dout));
    let (o_t, lse) = ka::attention_fwd::<T>(kernel, (&qt, &kt, &vt), dims, AttnMask::new(scale, causal, docs)).unwrap();
    let o = of_t(&o_t);
    let (dq_ref, dk_ref, dv_ref) =
        attention_bwd_cpu((&q, &k, &v), (&o_ref, &lse_ref), &dout, dims, AttnMask::new(scale, causal, docs));
    let (dq, dk, dv) =
        ka::attention_bwd::<T>(kernel, (&qt, &kt, &vt), (&o_t, &lse), &dt, dims, AttnMask::new(scale, causal, docs))
            .unwrap();
    let (dq, dk, dv) = (of_t(&dq), of_t(&dk), of_t(&dv));

    // lse is f32 in both dtypes: the f32 tolerance applies
    let e = max_abs_diff(&lse, &lse_ref);
    assert!(e <= 1e-5 * max_abs(&lse_ref).max(1.0), "{case}: lse err {e:e}");
    let naive = if bf { Some(naive16::<T>(&q, &k, &v, &dout, dims, scale, causal, docs)) } else { None };
    type Out<'a> = (&'a str, &'a [f32], &'a [f32], Option<&'a [f32]>);
    let outs: [Out; 4] = [
        ("O", &o, &o_ref, naive.as_ref().map(|n| &n.0[..])),
        ("dQ", &dq, &dq_ref, naive.as_ref().map(|n| &n.2[..])),
        ("dK", &dk, &dk_ref, naive.as_ref().map(|n| &n.3[..])),
        ("dV", &dv, &dv_ref, naive.as_ref().map(|n| &n.4[..])),
    ];
    for (name, got, exact, nv) in outs {
        let e = max_abs_diff(got, exact);
        let bound = match nv {
            Some(nv) => 2.0 * max_abs_diff(nv, exact).max(1e-30),
            None => 1e-5 * max_abs(exact).max(1.0),
        };
        assert!(e <= bound, "{case}: {name} err {e:e} > bound {bound:e}");
    }
}

const fn dm(b: usize, h: usize, hkv: usize, tq: usize, tk: usize, d: usize) -> AttnDims {
    AttnDims { b, h, hkv, tq, tk, d }
}

/// T in {1, 17, 70}, GQA 1/2/4, batch 2; D = 16 (the emulator's small dim).
const TRAIN_SHAPES: [AttnDims; 5] = [
    dm(1, 2, 2, 1, 1, 16),
    dm(1, 2, 2, 17, 17, 16),
    dm(2, 4, 2, 70, 70, 16),
    dm(1, 4, 1, 70, 70, 16),
    dm(1, 4, 1, 17, 17, 16),
];
/// Tq < Tk: one-token decode, a chunk of prefill, a chunk that straddles key tiles.
const CACHE_SHAPES: [AttnDims; 3] = [dm(1, 4, 1, 1, 70, 16), dm(1, 4, 2, 17, 70, 16), dm(2, 2, 1, 5, 37, 16)];

#[test]
fn forward_and_backward_match_the_cpu_reference_f32() {
    for (n, &dims) in TRAIN_SHAPES.iter().chain(&CACHE_SHAPES).enumerate() {
        check_case::<f32>(dims, true, false, n as u64);
    }
}

#[test]
fn forward_and_backward_match_the_cpu_reference_bf16() {
    for (n, &dims) in TRAIN_SHAPES.iter().chain(&CACHE_SHAPES).enumerate() {
        check_case::<bf16>(dims, true, true, 100 + n as u64);
    }
}

#[test]
fn every_head_dim_and_full_attention_match() {
    // D = 32, 64, 128 (tiles of 32, 32, 16 rows), ragged T, GQA 2; and non-causal with Tq != Tk
    for (n, dims) in
        [dm(1, 2, 1, 19, 19, 32), dm(1, 2, 1, 33, 45, 64), dm(1, 2, 1, 17, 21, 128)].into_iter().enumerate()
    {
        check_case::<f32>(dims, true, false, 200 + n as u64);
        check_case::<bf16>(dims, true, true, 300 + n as u64);
    }
    check_case::<f32>(dm(1, 4, 2, 23, 40, 16), false, false, 400);
    check_case::<bf16>(dm(1, 4, 2, 40, 23, 16), false, true, 401);
}

#[test]
fn decode_rows_equal_the_full_recomputation_bit_for_bit() {
    // the last n query rows with Tq = n < Tk give exactly the rows of the Tq = Tk run: same key tiles in
    // the same order per row; tiles beyond a row's causal limit contribute nothing (p = 0, corr = 1).
    let dims = dm(1, 4, 2, 70, 70, 16);
    let mut r = ChaCha8Rng::seed_from_u64(7);
    let q = uniform(&mut r, 4 * 70 * 16);
    let k = uniform(&mut r, 2 * 70 * 16);
    let v = uniform(&mut r, 2 * 70 * 16);
    let (o_full, lse_full) =
        ka::attention_fwd::<f32>(AttnKernel::Fma, (&q, &k, &v), dims, AttnMask::new(0.25, true, None)).unwrap();
    for n in [1usize, 3, 40] {
        let qs: Vec<f32> = (0..4).flat_map(|h| q[(h * 70 + 70 - n) * 16..(h + 1) * 70 * 16].to_vec()).collect();
        let (o, lse) = ka::attention_fwd::<f32>(
            AttnKernel::Fma,
            (&qs, &k, &v),
            dm(1, 4, 2, n, 70, 16),
            AttnMask::new(0.25, true, None),
        )
        .unwrap();
        for h in 0..4 {
            assert_eq!(
                &o[h * n * 16..(h + 1) * n * 16],
                &o_full[(h * 70 + 70 - n) * 16..(h + 1) * 70 * 16],
                "n={n} h={h}"
            );
            assert_eq!(&lse[h * n..(h + 1) * n], &lse_full[h * 70 + 70 - n..(h + 1) * 70], "n={n} h={h}");
        }
    }
}

#[test]
fn bad_shapes_are_refused_before_any_launch() {
    let err = |dims: AttnDims, causal: bool| {
        let AttnDims { b, h, hkv, tq, tk, d } = dims;
        let q = vec![0f32; b * h * tq * d];
        let kv = vec![0f32; b * hkv * tk * d];
        ka::attention_fwd::<f32>(AttnKernel::Fma, (&q, &kv, &kv), dims, AttnMask::new(1.0, causal, None))
            .unwrap_err()
            .to_string()
    };
    let e = err(dm(1, 2, 1, 4, 4, 24), true);
    assert!(e.contains("D = 24") && e.contains("hint:"), "{e}");
    let e = err(dm(1, 3, 2, 4, 4, 16), true);
    assert!(e.contains("H = 3") && e.contains("Hkv = 2") && e.contains("hint:"), "{e}");
    let e = err(dm(1, 2, 1, 8, 4, 16), true);
    assert!(e.contains("Tq 8") && e.contains("Tk 4") && e.contains("hint:"), "{e}");
    // a buffer of the wrong length names the argument
    let dims = dm(1, 2, 1, 4, 4, 16);
    let e = ka::attention_fwd::<f32>(
        AttnKernel::Fma,
        (&[0.0; 10], &[0.0; 64], &[0.0; 64]),
        dims,
        AttnMask::new(1.0, true, None),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`q`"), "{e}");
}

#[test]
fn fma_tiles_take_f16() {
    for (n, dims) in [dm(1, 4, 2, 17, 17, 16), dm(1, 2, 1, 5, 37, 64)].into_iter().enumerate() {
        check_case::<f16>(dims, true, true, 500 + n as u64);
    }
}

/// A (16x16) B (16x16) through the emulated ldmatrix/mma fragments equals the plain product, four ways.
fn probe_case<T: AttnFloat>(seed: u64) {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let a: Vec<T> = to_t(&uniform(&mut r, 256));
    let b: Vec<T> = to_t(&uniform(&mut r, 256));
    let bt: Vec<T> = (0..256).map(|i| b[(i % 16) * 16 + i / 16]).collect();
    let out = ka::mma_probe(&a, &b, &bt).unwrap();
    let mut want = vec![0f64; 256];
    for i in 0..16 {
        for j in 0..16 {
            want[i * 16 + j] = (0..16).map(|k| a[i * 16 + k].to_f32() as f64 * b[k * 16 + j].to_f32() as f64).sum();
        }
    }
    for way in 0..4 {
        for (e, w) in want.iter().enumerate() {
            let got = out[way * 256 + e] as f64;
            assert!(
                (got - w).abs() <= 1e-5,
                "{} way {way} element ({}, {}): {got} vs {w}",
                std::any::type_name::<T>(),
                e / 16,
                e % 16
            );
        }
    }
    // an input that is not symmetric in any layout: a permuted A must permute the rows of the product
    assert!(want.iter().any(|w| w.abs() > 0.1));
}

#[test]
fn emulated_mma_and_ldmatrix_reproduce_the_ptx_fragment_layouts() {
    probe_case::<bf16>(1);
    probe_case::<f16>(2);
    assert!(ka::mma_probe::<f32>(&[0.0; 256], &[0.0; 256], &[0.0; 256]).is_err());
}

/// Ragged training shapes (T in {1, 17, 100, 130}, GQA 1/2/4) and Tq < Tk, D = 64 and 128.
const TC_SHAPES: [(AttnDims, bool); 8] = [
    (dm(1, 2, 2, 1, 1, 64), true),
    (dm(1, 2, 1, 17, 17, 64), true),
    (dm(1, 4, 1, 100, 100, 64), true),
    (dm(2, 2, 1, 130, 130, 64), true),
    (dm(1, 4, 2, 130, 130, 128), true),
    (dm(1, 2, 2, 17, 17, 128), false),
    (dm(1, 4, 1, 1, 130, 128), true),
    (dm(1, 4, 2, 37, 100, 64), false),
];

#[test]
fn tensor_core_tiles_match_the_cpu_reference_bf16() {
    for (n, &(dims, causal)) in TC_SHAPES.iter().enumerate() {
        check_kernel::<bf16>(AttnKernel::TensorCore, dims, causal, 600 + n as u64);
    }
}

#[test]
fn tensor_core_tiles_match_the_cpu_reference_f16() {
    for (n, &(dims, causal)) in TC_SHAPES.iter().enumerate() {
        check_kernel::<f16>(AttnKernel::TensorCore, dims, causal, 700 + n as u64);
    }
}

#[test]
fn tensor_core_decode_chunks() {
    // chunked prefill: Tq < Tk with Tk - Tq not a multiple of any tile, GQA 4
    check_kernel::<bf16>(AttnKernel::TensorCore, dm(1, 4, 1, 17, 100, 128), true, 800);
    check_kernel::<f16>(AttnKernel::TensorCore, dm(1, 4, 1, 70, 130, 64), true, 801);
}

/// The cp.async waits guard real reads: the tensor-core tiles built with each wait moved after the reads it
/// guards (`ka::early_read`, the same source with `EARLY`) read the emulator's poison, so the comparison
/// `check_kernel` makes fails for them (an infinite error), while the same case passes with the waits in place.
#[test]
fn a_cp_async_wait_after_its_reads_fails_the_reference_check() {
    let dims = dm(1, 2, 1, 100, 100, 64);
    check_kernel::<bf16>(AttnKernel::TensorCore, dims, true, 990);
    let [q, k, v, dout] = inputs::<bf16>(dims, 991);
    let (qf, kf, vf, df) = (of_t(&q), of_t(&k), of_t(&v), of_t(&dout));
    let (o_ref, lse_ref) = attention_fwd_cpu(&qf, &kf, &vf, dims, 0.125, true, None);
    let (o, lse) =
        ka::attention_fwd(AttnKernel::TensorCore, (&q, &k, &v), dims, AttnMask::new(0.125, true, None)).unwrap();
    assert!(max_abs_diff(&of_t(&o), &o_ref) < 0.02, "the correct forward");
    let (ob, lseb) = ka::early_read::fwd(&q, &k, &v, dims, 0.125, true).unwrap();
    // poisoned scores make every row's sum NaN, which the epilogue writes as a row that saw no key: O = 0,
    // lse = -inf — far outside any bound
    assert!(max_abs_diff(&of_t(&ob), &o_ref) > 0.5, "a forward reading K/V before its wait must fail");
    assert_eq!(max_abs_diff(&lseb, &lse_ref), f64::INFINITY, "a forward reading K/V before its wait must fail (lse)");
    let refs = attention_bwd_cpu((&qf, &kf, &vf), (&o_ref, &lse_ref), &df, dims, AttnMask::new(0.125, true, None));
    let good = ka::attention_bwd(
        AttnKernel::TensorCore,
        (&q, &k, &v),
        (&o, &lse),
        &dout,
        dims,
        AttnMask::new(0.125, true, None),
    )
    .unwrap();
    let bad = ka::early_read::bwd((&q, &k, &v), (&o, &lse), &dout, dims, 0.125, true).unwrap();
    for (name, g, x, want) in
        [("dQ", &good.0, &bad.0, &refs.0), ("dK", &good.1, &bad.1, &refs.1), ("dV", &good.2, &bad.2, &refs.2)]
    {
        assert!(max_abs_diff(&of_t(g), want) < 0.05, "the correct backward's {name}");
        assert_eq!(
            max_abs_diff(&of_t(x), want),
            f64::INFINITY,
            "a backward reading Q/dO before its wait must fail ({name})"
        );
    }
}

#[test]
fn tensor_core_tiles_refuse_what_they_do_not_take() {
    let dims = dm(1, 2, 1, 4, 4, 32);
    let q = vec![bf16::ZERO; 2 * 4 * 32];
    let kv = vec![bf16::ZERO; 4 * 32];
    let e = ka::attention_fwd(AttnKernel::TensorCore, (&q, &kv, &kv), dims, AttnMask::new(1.0, true, None))
        .unwrap_err()
        .to_string();
    assert!(e.contains("D = 32") && e.contains("hint:"), "{e}");
    let dims = dm(1, 2, 1, 4, 4, 64);
    let q = vec![0f32; 2 * 4 * 64];
    let kv = vec![0f32; 4 * 64];
    let e = ka::attention_fwd(AttnKernel::TensorCore, (&q, &kv, &kv), dims, AttnMask::new(1.0, true, None))
        .unwrap_err()
        .to_string();
    assert!(e.contains("4-byte") && e.contains("hint:"), "{e}");
    assert_eq!(AttnKernel::best(2, 128), AttnKernel::TensorCore);
    assert_eq!(AttnKernel::best(4, 128), AttnKernel::Fma);
    assert_eq!(AttnKernel::best(2, 16), AttnKernel::Fma);
}

/// The op's launchers (`fwd_packed`/`bwd_packed`, here their emulated twins): O and lse written straight into
/// the packed output rows, q/O/lse/dO read in place from the backward rows, give exactly the plain buffers'
/// results, and the backward allocates exactly the op's workspace function's scratch.
fn check_packed<T: AttnFloat + PartialEq>(kernel: AttnKernel, dims: AttnDims, docs: Option<&[u32]>, seed: u64) {
    let AttnDims { b, h, tq, d, .. } = dims;
    let [q, k, v, dout] = inputs::<T>(dims, seed);
    let case = format!("{kernel:?} {dims:?} docs={} {}", docs.is_some(), std::any::type_name::<T>());
    let eb = std::mem::size_of::<T>();
    let lay = PackedRows { d, elem_bytes: eb };
    let (o, lse) = ka::attention_fwd(kernel, (&q, &k, &v), dims, AttnMask::new(0.3, true, docs)).unwrap();
    let fwd = ka::attention_fwd_packed(kernel, (&q, &k, &v), dims, AttnMask::new(0.3, true, docs)).unwrap();
    assert_eq!(fwd.len(), b * h * tq * lay.fwd_width(), "{case}");
    for (i, row) in fwd.chunks(lay.fwd_width()).enumerate() {
        assert!(row[..d] == o[i * d..(i + 1) * d], "{case}: O row {i}");
        assert!(row[d + 4 / eb..].iter().all(|x| x.to_f32() == 0.0), "{case}: pad of row {i}");
    }
    let lse_p = ka::packed_lse(&fwd, lay.fwd_width(), d);
    assert_eq!(
        lse_p.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        lse.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "{case}: lse"
    );
    let rows = ka::bwd_rows(&q, &fwd, &dout, d).unwrap();
    let ws = attention_workspace(dims, eb);
    assert_eq!(rows.len() * eb, ws.bwd_packed, "{case}: the packing copy is the workspace's");
    assert_eq!(ka::packed_lse(&rows[2 * d..], lay.bwd_width(), 0)[..], lse[..lse.len() - 1], "{case}: bwd lse");
    let (dq, dk, dv) =
        ka::attention_bwd(kernel, (&q, &k, &v), (&o, &lse), &dout, dims, AttnMask::new(0.3, true, docs)).unwrap();
    let got = ka::attention_bwd_packed(kernel, &rows, &k, &v, dims, AttnMask::new(0.3, true, docs)).unwrap();
    assert_eq!(got.scratch_bytes, ws.bwd_scratch, "{case}: the launcher allocates the op's scratch");
    assert_eq!(ws.bwd_scratch, b * h * tq * (d + 1) * 4, "{case}");
    let want: Vec<T> = dq.into_iter().chain(dk).chain(dv).collect();
    assert!(got.grads == want, "{case}: gradients differ from the plain buffers'");
}

#[test]
fn packed_launchers_read_and_write_the_op_rows_in_place() {
    check_packed::<f32>(AttnKernel::Fma, dm(1, 4, 2, 17, 17, 16), None, 960);
    check_packed::<bf16>(AttnKernel::Fma, dm(2, 2, 1, 33, 33, 32), None, 961);
    check_packed::<bf16>(AttnKernel::TensorCore, dm(1, 4, 2, 70, 70, 64), None, 962);
    check_packed::<f16>(AttnKernel::TensorCore, dm(1, 2, 1, 40, 40, 128), None, 963);
    let docs = docs_of(1, 70, &[&[0, 9, 40]]);
    check_packed::<bf16>(AttnKernel::TensorCore, dm(1, 2, 2, 70, 70, 64), Some(&docs), 964);
}

#[test]
fn packed_rows_keep_16_bit_parts_aligned_and_f32_rows_as_before() {
    for d in [64usize, 128] {
        let lay = PackedRows { d, elem_bytes: 2 };
        assert_eq!((lay.fwd_width(), lay.bwd_width(), lay.dout_at()), (d + 8, 3 * d + 16, 2 * d + 8));
        // every row and every part of it starts on 16 bytes (copy16 of q and dO rows; lse's f32 slot)
        for at in [lay.bwd_width(), d, 2 * d, lay.dout_at(), lay.fwd_width()] {
            assert_eq!(at * 2 % 16, 0, "D {d}: element {at}");
        }
    }
    let f = PackedRows { d: 64, elem_bytes: 4 };
    assert_eq!((f.fwd_width(), f.bwd_width(), f.dout_at()), (65, 194, 129));
    // Llama-2-7B at 4K tokens, bf16: 32 heads x (3 x 128 + 16) x 2 B + 32 x 129 x 4 B per token
    let ws = attention_workspace(dm(1, 32, 32, 4096, 4096, 128), 2);
    assert_eq!((ws.bwd_packed, ws.bwd_scratch), (4096 * 32 * 400 * 2, 4096 * 32 * 129 * 4));
    assert_eq!(ws.total(), ws.bwd_packed + ws.bwd_scratch);
}

#[test]
fn selftest_attention_rows_pass_on_the_emulator() {
    use harpe::tools::selftest::{attention, Target};
    for seed in [1u64, 2] {
        let checks = attention::checks(&Target::Emulated, &mut ChaCha8Rng::seed_from_u64(seed)).unwrap();
        // 2 probe rows + 4 (dtype, kernel) pairs x 3 shapes (one with a document mask) x 5 outputs (O, lse, dQ, dK, dV)
        assert_eq!(checks.len(), 2 + 4 * 3 * 5, "seed {seed}");
        assert!(checks.iter().any(|c| c.case.contains("docs")), "seed {seed}: no document-mask row");
        for c in &checks {
            assert!(c.pass, "seed {seed}: {} {} {:?}: {:e} > {:e}", c.kernel, c.case, c.dtype, c.max_err, c.bound);
        }
    }
}

/// Per-key document starts of `b` sequences of `t` tokens, sequence i with the starts `starts[i % len]`.
fn docs_of(b: usize, t: usize, starts: &[&[usize]]) -> Vec<u32> {
    let per: Vec<&[usize]> = (0..b).map(|i| starts[i % starts.len()]).collect();
    DocStarts::from_starts(&per, t, &candle_core::Device::Cpu).unwrap().host().to_vec()
}

/// FMA tiles (32 rows at D = 16): documents of lengths 1, 17, 22 and 30 (18..40 crosses the tile boundary
/// at 32; the tile 64.. starts at key tile 32, skipping tile 0; the backward's key tile 0 stops before
/// query tile 64); a one-token sequence; GQA 4 and 2 with two different packings in one batch.
#[test]
fn document_masks_fma_tiles_match_the_reference() {
    let cases: [(AttnDims, &[&[usize]]); 4] = [
        (dm(1, 4, 1, 70, 70, 16), &[&[0, 1, 18, 40]]),
        (dm(2, 4, 2, 70, 70, 16), &[&[0, 1, 18, 40], &[17, 69]]),
        (dm(1, 2, 2, 1, 1, 16), &[&[0]]),
        (dm(1, 2, 1, 45, 45, 32), &[&[3, 20, 21, 22]]),
    ];
    for (n, (dims, starts)) in cases.into_iter().enumerate() {
        let docs = docs_of(dims.b, dims.tk, starts);
        check_kernel_docs::<f32>(AttnKernel::Fma, dims, true, Some(&docs), 900 + n as u64);
        check_kernel_docs::<bf16>(AttnKernel::Fma, dims, true, Some(&docs), 910 + n as u64);
    }
    // D = 128 (16-row tiles): many tile boundaries inside one document
    let dims = dm(1, 2, 1, 37, 37, 128);
    check_kernel_docs::<f16>(AttnKernel::Fma, dims, true, Some(&docs_of(1, 37, &[&[0, 17, 18]])), 920);
}

/// Tensor-core tiles (forward 128 query rows, backward 64 keys): warps whose rows' documents start at 65 skip
/// key tile 0 (D = 64: 64-key tiles), a document of length 1 at the end, documents crossing 64, GQA 4, D 64/128.
#[test]
fn document_masks_tensor_core_tiles_match_the_reference() {
    let cases: [(AttnDims, &[&[usize]]); 4] = [
        (dm(1, 4, 1, 130, 130, 64), &[&[65, 129]]),
        (dm(2, 2, 1, 100, 100, 64), &[&[37, 38, 99], &[1, 18, 60]]),
        (dm(1, 4, 2, 130, 130, 128), &[&[17, 34, 100]]),
        (dm(1, 2, 2, 17, 17, 128), &[&[0]]),
    ];
    for (n, (dims, starts)) in cases.into_iter().enumerate() {
        let docs = docs_of(dims.b, dims.tk, starts);
        check_kernel_docs::<bf16>(AttnKernel::TensorCore, dims, true, Some(&docs), 930 + n as u64);
        check_kernel_docs::<f16>(AttnKernel::TensorCore, dims, true, Some(&docs), 940 + n as u64);
    }
}

/// One document per sequence is plain causal attention: the masked kernels give the causal kernels'
/// O, lse, dQ, dK, dV bit for bit (same tiles, same order; the extra bound is never active).
#[test]
fn one_document_equals_causal_bit_for_bit() {
    fn go<T: AttnFloat + PartialEq>(kernel: AttnKernel, dims: AttnDims, seed: u64) {
        let [q, k, v, dout] = inputs::<T>(dims, seed);
        let docs = vec![0u32; dims.b * dims.tk];
        let (o, lse) = ka::attention_fwd(kernel, (&q, &k, &v), dims, AttnMask::new(0.3, true, None)).unwrap();
        let (od, lsed) = ka::attention_fwd(kernel, (&q, &k, &v), dims, AttnMask::new(0.3, true, Some(&docs))).unwrap();
        assert!(o == od && lse == lsed, "{kernel:?} {dims:?}: forward differs");
        let g =
            ka::attention_bwd(kernel, (&q, &k, &v), (&o, &lse), &dout, dims, AttnMask::new(0.3, true, None)).unwrap();
        let gd =
            ka::attention_bwd(kernel, (&q, &k, &v), (&o, &lse), &dout, dims, AttnMask::new(0.3, true, Some(&docs)))
                .unwrap();
        assert!(g == gd, "{kernel:?} {dims:?}: backward differs");
    }
    go::<f32>(AttnKernel::Fma, dm(2, 4, 2, 70, 70, 16), 950);
    go::<bf16>(AttnKernel::TensorCore, dm(1, 4, 1, 130, 130, 64), 951);
}

#[test]
fn document_masks_refuse_bad_input() {
    let dims = dm(1, 2, 1, 4, 4, 16);
    let (q, kv) = (vec![0f32; 2 * 4 * 16], vec![0f32; 4 * 16]);
    let e = ka::attention_fwd(AttnKernel::Fma, (&q, &kv, &kv), dims, AttnMask::new(1.0, true, Some(&[0; 3])))
        .unwrap_err()
        .to_string();
    assert!(e.contains("`docs`"), "{e}");
}
