//! kernels/attention.cu (flash attention forward and backward) compiled for the host against
//! kernels/emu.h, against the CPU reference `ops::attention::{attention_fwd_cpu, attention_bwd_cpu}` on
//! small ragged shapes: T in {1, 17, 70} (never a multiple of the 16/32-row tiles), GQA ratios 1/2/4,
//! Tq < Tk (decode, chunked prefill), every instantiated head dim, causal and full, f32 and bf16.
//! Bounds: f32 — 1e-5 x max(1, max |reference|); bf16 — the STYLE.md rule: the exact result is the f32
//! reference on the same bf16-rounded inputs, and the kernel's error is at most 2x that of a naive bf16
//! implementation (every intermediate rounded to bf16, `naive_bf16` below).
use half::bf16;
use harpe::kernels_emu::attention::{self as ka, AttnFloat};
use harpe::kernels_emu::EmuFloat;
use harpe::ops::attention::{attention_bwd_cpu, attention_fwd_cpu, AttnDims};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn r16(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

fn uniform(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random::<f32>() * 2.0 - 1.0).collect()
}

fn max_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).abs()).fold(0.0, |m, d| {
        if d.is_nan() {
            f64::INFINITY
        } else {
            m.max(d)
        }
    })
}

fn max_abs(a: &[f32]) -> f64 {
    a.iter().map(|x| x.abs() as f64).fold(0.0, f64::max)
}

fn to_t<T: EmuFloat>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

fn of_t<T: EmuFloat>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// Dense attention with every intermediate rounded to bf16: forward (O, lse) and backward (dQ, dK, dV).
#[allow(clippy::type_complexity)]
fn naive_bf16(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    dims: AttnDims,
    scale: f32,
    causal: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
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
                let qi = &q[(bh * tq + i) * d..(bh * tq + i + 1) * d];
                let kj = |j: usize| &k[(kvh * tk + j) * d..(kvh * tk + j + 1) * d];
                let vj = |j: usize| &v[(kvh * tk + j) * d..(kvh * tk + j + 1) * d];
                let s: Vec<f32> = (0..lim).map(|j| r16(dot16(qi, kj(j)) * scale)).collect();
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = s.iter().map(|x| r16((x - m).exp())).collect();
                let l = e.iter().fold(0.0, |a, x| r16(a + x));
                let p: Vec<f32> = e.iter().map(|x| r16(x / l)).collect();
                lse[bh * tq + i] = r16(m + l.ln());
                let oi = &mut o[(bh * tq + i) * d..(bh * tq + i + 1) * d];
                for (c, oc) in oi.iter_mut().enumerate() {
                    *oc = (0..lim).fold(0.0, |a, j| r16(a + r16(p[j] * vj(j)[c])));
                }
                let oi = oi.to_vec();
                let doi = &dout[(bh * tq + i) * d..(bh * tq + i + 1) * d];
                let delta = dot16(doi, &oi);
                for (j, &pj) in p.iter().enumerate() {
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

/// Forward and backward of the emulated kernel against the CPU reference; panics naming the case.
fn check_case<T: AttnFloat>(dims: AttnDims, causal: bool, bf: bool, seed: u64) {
    let AttnDims { b, h, hkv, tq, tk, d } = dims;
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let round = |x: Vec<f32>| if bf { x.into_iter().map(r16).collect() } else { x };
    let q = round(uniform(&mut r, b * h * tq * d));
    let k = round(uniform(&mut r, b * hkv * tk * d));
    let v = round(uniform(&mut r, b * hkv * tk * d));
    let dout = round(uniform(&mut r, b * h * tq * d));
    let scale = 1.0 / (d as f32).sqrt();
    let case = format!("{dims:?} causal={causal} bf16={bf}");

    let (o_ref, lse_ref) = attention_fwd_cpu(&q, &k, &v, dims, scale, causal);
    let (o_t, lse) = ka::attention_fwd::<T>(&to_t(&q), &to_t(&k), &to_t(&v), dims, scale, causal).unwrap();
    let o = of_t(&o_t);
    let (dq_ref, dk_ref, dv_ref) = attention_bwd_cpu(&q, &k, &v, &o_ref, &lse_ref, &dout, dims, scale, causal);
    let (dq, dk, dv) =
        ka::attention_bwd::<T>(&to_t(&q), &to_t(&k), &to_t(&v), &o_t, &lse, &to_t(&dout), dims, scale, causal).unwrap();
    let (dq, dk, dv) = (of_t(&dq), of_t(&dk), of_t(&dv));

    // lse is f32 in both dtypes: the f32 tolerance applies
    let e = max_err(&lse, &lse_ref);
    assert!(e <= 1e-5 * max_abs(&lse_ref).max(1.0), "{case}: lse err {e:e}");
    let naive = if bf { Some(naive_bf16(&q, &k, &v, &dout, dims, scale, causal)) } else { None };
    type Out<'a> = (&'a str, &'a [f32], &'a [f32], Option<&'a [f32]>);
    let outs: [Out; 4] = [
        ("O", &o, &o_ref, naive.as_ref().map(|n| &n.0[..])),
        ("dQ", &dq, &dq_ref, naive.as_ref().map(|n| &n.2[..])),
        ("dK", &dk, &dk_ref, naive.as_ref().map(|n| &n.3[..])),
        ("dV", &dv, &dv_ref, naive.as_ref().map(|n| &n.4[..])),
    ];
    for (name, got, exact, nv) in outs {
        let e = max_err(got, exact);
        let bound = match nv {
            Some(nv) => 2.0 * max_err(nv, exact).max(1e-30),
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
    let (o_full, lse_full) = ka::attention_fwd::<f32>(&q, &k, &v, dims, 0.25, true).unwrap();
    for n in [1usize, 3, 40] {
        let qs: Vec<f32> = (0..4).flat_map(|h| q[(h * 70 + 70 - n) * 16..(h + 1) * 70 * 16].to_vec()).collect();
        let (o, lse) = ka::attention_fwd::<f32>(&qs, &k, &v, dm(1, 4, 2, n, 70, 16), 0.25, true).unwrap();
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
        ka::attention_fwd::<f32>(&q, &kv, &kv, dims, 1.0, causal).unwrap_err().to_string()
    };
    let e = err(dm(1, 2, 1, 4, 4, 24), true);
    assert!(e.contains("D = 24") && e.contains("hint:"), "{e}");
    let e = err(dm(1, 3, 2, 4, 4, 16), true);
    assert!(e.contains("H = 3") && e.contains("Hkv = 2") && e.contains("hint:"), "{e}");
    let e = err(dm(1, 2, 1, 8, 4, 16), true);
    assert!(e.contains("Tq 8") && e.contains("Tk 4") && e.contains("hint:"), "{e}");
    // a buffer of the wrong length names the argument
    let dims = dm(1, 2, 1, 4, 4, 16);
    let e = ka::attention_fwd::<f32>(&[0.0; 10], &[0.0; 64], &[0.0; 64], dims, 1.0, true).unwrap_err().to_string();
    assert!(e.contains("`q`"), "{e}");
}
