//! `ops::cpu_vec` (the vectorised exp, max, dot, sums, axpy of the CPU fast paths) against their scalar
//! twins (`f32::exp`, plain folds) on ragged lengths, and exp's special values.
use harpe::ops::cpu_vec::*;

fn ulps(a: f32, b: f32) -> i64 {
    (a.to_bits() as i64 - b.to_bits() as i64).abs()
}

#[test]
fn exp_is_within_two_ulp_of_libm() {
    // both forms: separate multiply-adds (the baseline copy) and fused ones (the AVX2/AVX-512 copies; here
    // `mul_add` may be libm's fmaf, which rounds the same)
    for (form, exp) in [("plain", exp_lane_c::<false> as fn(f32) -> f32), ("fma", exp_lane_c::<true>)] {
        let mut worst = 0;
        let mut x = -86.5f32;
        while x < 88.6 {
            let (f, r) = (exp(x), x.exp());
            worst = worst.max(ulps(f, r));
            x += 0.001_37;
        }
        assert!(worst <= 2, "{form}: worst {worst} ulp");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0, "{form}");
        assert_eq!(exp(-100.0), 0.0, "{form}");
        assert_eq!(exp(0.0), 1.0, "{form}");
        assert_eq!(exp(100.0), f32::INFINITY, "{form}");
        assert!(exp(f32::NAN).is_nan(), "{form}");
    }
    assert_eq!(exp_lane(1.5).to_bits(), exp_lane_c::<false>(1.5).to_bits());
}

#[test]
fn vector_loops_match_their_references() {
    for n in [0, 1, 15, 16, 17, 100, 257] {
        let xs: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.1).collect();
        let ys: Vec<f32> = (0..n).map(|i| ((i * 53 % 89) as f32 - 44.0) * 0.05).collect();
        assert_eq!(max(&xs), max_ref(&xs), "max n={n}");
        let (mut a, mut b) = (xs.clone(), xs.clone());
        let m = max_ref(&xs);
        let (sa, sb) = (exp_sub_sum(&mut a, m), exp_sub_sum_ref(&mut b, m));
        assert!((sa - sb).abs() <= 1e-6 * sb.max(1.0), "exp_sub_sum n={n}: {sa} vs {sb}");
        assert!(a.iter().zip(&b).all(|(p, q)| ulps(*p, *q) <= 2), "exp values n={n}");
        // the one-pass form, around a reference below the max (scores above it give values above 1)
        let (mut c, mut e) = (xs.clone(), xs.clone());
        let m_low = m - 3.0;
        let ((sc, tc), (se, te)) = (exp_sub_sum_max(&mut c, m_low), exp_sub_sum_max_ref(&mut e, m_low));
        assert_eq!(tc, if n == 0 { f32::NEG_INFINITY } else { m }, "exp_sub_sum_max's max n={n}");
        assert_eq!(tc, te, "exp_sub_sum_max_ref's max n={n}");
        assert!((sc - se).abs() <= 1e-6 * se.max(1.0), "exp_sub_sum_max n={n}: {sc} vs {se}");
        assert!(c.iter().zip(&e).all(|(p, q)| ulps(*p, *q) <= 2), "exp_sub_sum_max values n={n}");
        let mut d = xs.clone();
        assert_eq!(exp_sub_sum(&mut d, m_low).to_bits(), sc.to_bits(), "the same lanes as exp_sub_sum n={n}");
        let (da, db) = (dot(&xs, &ys), dot_ref(&xs, &ys));
        assert!((da - db).abs() <= 1e-5 * db.abs().max(1.0), "dot n={n}: {da} vs {db}");
        let sq = dot_ref(&xs, &xs);
        assert!((sum_sq(&xs) - sq).abs() <= 1e-5 * sq.max(1.0), "sum_sq n={n}");
        let mut c = xs.clone();
        scale_in_place(&mut c, 0.5);
        assert!(c.iter().zip(&xs).all(|(p, q)| *p == q * 0.5), "scale n={n}");
    }
}

/// y += a times the rows of w (four rows per pass, then the rest one by one) against one row at a time,
/// for row counts on and off the multiple of four and y shorter than the stride (a band of columns).
#[test]
fn axpy_rows_matches_its_reference() {
    for (rows, n, stride) in [(0, 5, 5), (1, 17, 17), (4, 16, 16), (7, 33, 40), (9, 100, 257)] {
        let a: Vec<f32> = (0..rows).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.25).collect();
        let w: Vec<f32> = (0..rows * stride).map(|i| ((i * 29 % 61) as f32 - 30.0) * 0.05).collect();
        let y0: Vec<f32> = (0..n).map(|j| j as f32 * 0.01).collect();
        let (mut y, mut y_ref) = (y0.clone(), y0);
        axpy_rows(&a, &w, stride, &mut y);
        axpy_rows_ref(&a, &w, stride, &mut y_ref);
        for (j, (p, q)) in y.iter().zip(&y_ref).enumerate() {
            assert!((p - q).abs() <= 1e-5 * q.abs().max(1.0), "rows={rows} n={n} j={j}: {p} vs {q}");
        }
    }
}

/// The AVX-512 softmax loops (`cpu_vec::avx512`, what `exp_sub_sum` and `exp_sub_sum_max` run on such CPUs)
/// against the portable loops: the same exponentials bit for bit on [-86.6, 88.7] (the same polynomial;
/// only 2^n is applied another way), sums within rounding, the same max, and the ends of the range.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_softmax_loops_match_the_portable_ones() {
    if !std::is_x86_feature_detected!("avx512f") {
        eprintln!("this CPU has no AVX-512: nothing to compare (the portable loops are tested above)");
        return;
    }
    for n in [0, 1, 15, 16, 17, 33, 100, 257] {
        let xs: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 0.17).collect(); // -85..85
        let m = 0.25;
        let (mut a, mut b) = (xs.clone(), xs.clone());
        // SAFETY: the CPU has avx512f (checked above), and avx2 and fma with it on every such CPU.
        let sa = unsafe { avx512::exp_sub_sum(&mut a, m) };
        let sb = exp_sub_sum_lanes(&mut b, m);
        assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()), "exp values n={n}");
        assert!((sa - sb).abs() <= 1e-6 * sb.max(1.0), "exp_sub_sum n={n}: {sa} vs {sb}");
        let (mut c, mut e) = (xs.clone(), xs.clone());
        // SAFETY: as above.
        let (sc, tc) = unsafe { avx512::exp_sub_sum_max(&mut c, m) };
        let (se, te) = exp_sub_sum_max_lanes(&mut e, m);
        assert_eq!(tc, te, "max n={n}");
        assert!(c.iter().zip(&e).all(|(p, q)| p.to_bits() == q.to_bits()), "exp_sub_sum_max values n={n}");
        assert!((sc - se).abs() <= 1e-6 * se.max(1.0), "exp_sub_sum_max n={n}: {sc} vs {se}");
    }
    let mut ends = [f32::NEG_INFINITY, -200.0, -100.0, 0.0, 100.0, f32::INFINITY, f32::NAN];
    // SAFETY: as above.
    unsafe { avx512::exp_sub_sum(&mut ends, 0.0) };
    assert_eq!(ends[..2], [0.0, 0.0]);
    assert!((0.0..1e-43).contains(&ends[2]), "e^-100 is a denormal or 0: {}", ends[2]);
    assert_eq!(ends[3..6], [1.0, f32::INFINITY, f32::INFINITY]);
    assert!(ends[6].is_nan());
}
