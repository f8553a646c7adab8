//! Vectorised row primitives of the CPU fast paths (attention's softmax, RMSNorm, cross-entropy): exp,
//! max, sums and scaled dot products over f32 slices, each with its readable scalar twin (`*_ref`).
//!
//! Reference: Cephes `expf` (range reduction x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial, 2^n from
//! the exponent bits); the twins use `f32::exp` and plain folds.
//! The non-obvious decision: harpe is built for baseline x86-64 (SSE2), where `f32::exp` is a libm call per
//! element, which made the softmax, not the GEMMs, the cost of attention at small head dims. The same
//! plain-Rust loop bodies (`#[inline(always)]`, branch-free, written in lanes of 16 so they vectorise) are
//! compiled again under `#[target_feature(enable = "avx2,fma")]` and `"avx512f"` and chosen at run time. Each
//! body is generic over `const FMA: bool`: the two FMA copies evaluate `exp`'s polynomial with `mul_add`
//! (one vfmadd per step instead of a multiply and an add; Rust never contracts `a * b + c` itself), the
//! baseline copy with separate operations (there `mul_add` would be a libm call).
//! Accuracy: `exp` (either form) is within 2 ulp of `f32::exp` on [-86.6, 88.7], 0 below -86.6 (so -inf gives 0), +inf
//! above 88.7, NaN stays NaN. Sums run in 16 lanes, so their rounding differs from a left fold by
//! ~1e-7 relative. Tested in tests/stage_model/cpu_vec.rs. One exception to "the compiler picks the
//! instructions": the two softmax loops (`exp_sub_sum`, `exp_sub_sum_max`) have an AVX-512 form in
//! intrinsics (`avx512`), where `vscalefps` applies 2^n: the same values on [-86.6, 88.7], libm's denormals
//! down to -104 instead of 0. Does not: f64.

/// Lanes of the split accumulators (one AVX-512 register, two AVX2 ones).
const LANES: usize = 16;

/// True when the AVX2 + FMA copies of these loops can run (checked once per call; the check is cached).
#[inline]
fn have_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// True when the AVX-512 copies can run: built with them (feature `avx512`) and on a CPU that has them.
#[inline]
fn have_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        cfg!(feature = "avx512") && std::is_x86_feature_detected!("avx512f") && have_avx2()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The vector ISA the CPU kernels run with on this CPU (`harpe --version`; benchmark records name it).
pub fn isa() -> &'static str {
    if have_avx512() {
        "AVX-512"
    } else if have_avx2() {
        "AVX2 + FMA"
    } else {
        "baseline"
    }
}

/// Defines `pub fn $name` running `$body` compiled for AVX-512, else AVX2 + FMA, when the CPU has them,
/// else for the baseline target.
macro_rules! dispatch {
    ($(#[$doc:meta])* $name:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty $body:block) => {
        $(#[$doc])*
        pub fn $name($($arg: $ty),*) -> $ret {
            // FMA: the body may use `mul_add` (through `exp_lane_c::<FMA>`); true only in the FMA copies
            #[inline(always)]
            fn body<const FMA: bool>($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($arg: $ty),*) -> $ret {
                body::<true>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx2,fma")]
            fn avx512($($arg: $ty),*) -> $ret {
                body::<true>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            if have_avx512() {
                // SAFETY: the CPU supports avx512f, avx2 and fma (checked just above).
                return unsafe { avx512($($arg),*) };
            }
            #[cfg(target_arch = "x86_64")]
            if have_avx2() {
                // SAFETY: the CPU supports avx2 and fma (checked just above).
                return unsafe { avx2($($arg),*) };
            }
            body::<false>($($arg),*)
        }
    };
}

/// e^x, branch-free, the baseline form (`exp_lane_c::<false>`).
#[inline(always)]
pub fn exp_lane(x: f32) -> f32 {
    exp_lane_c::<false>(x)
}

/// a b + c: fused (one rounding) when `FMA`, else a multiply and an add.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// e^x, branch-free (inlined into the loops below); `FMA`: the polynomial and range reduction with fused
/// multiply-adds (only inside functions compiled with the `fma` target feature).
#[inline(always)]
pub fn exp_lane_c<const FMA: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer held in the mantissa
    let xc = x.clamp(-86.6, 88.7);
    let t = madd::<FMA>(xc, LOG2E, ROUND);
    let n = t - ROUND;
    let r = madd::<FMA>(-n, LN2_LO, madd::<FMA>(-n, LN2_HI, xc)); // n * LN2_HI is exact (LN2_HI: 9 significant bits)
    let mut p = 1.987_569_1e-4f32;
    p = madd::<FMA>(p, r, 1.398_199_9e-3);
    p = madd::<FMA>(p, r, 8.333_452e-3);
    p = madd::<FMA>(p, r, 4.166_579_6e-2);
    p = madd::<FMA>(p, r, 1.666_666_5e-1);
    p = madd::<FMA>(p, r, 0.5); // Cephes: 5.0000001201e-1, which is 0.5 in f32
    let p = madd::<FMA>(p, r * r, r) + 1.0;
    let ni = t.to_bits() as i32 - ROUND.to_bits() as i32; // n as an integer, -125..=128
    let y = p * f32::from_bits(((ni + 126) as u32) << 23) * 2.0; // 2^n without overflowing at n = 128
    let y = if x < -86.6 { 0.0 } else { y }; // e^-86.6 = 2.4e-38: below it, flush to 0
    let y = if x > 88.7 { f32::INFINITY } else { y };
    if x.is_nan() {
        x
    } else {
        y
    }
}

dispatch!(
    /// `exp_sub_sum` of the AVX2 and baseline copies (and of any AVX-512 CPU, in the tests).
    exp_sub_sum_lanes(xs: &mut [f32], m: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c.iter_mut()) {
            *x = exp_lane_c::<FMA>(*x - m);
            *a += *x;
        }
    }
    let mut tail = 0f32;
    for x in chunks.into_remainder() {
        *x = exp_lane_c::<FMA>(*x - m);
        tail += *x;
    }
    acc.iter().sum::<f32>() + tail
});

dispatch!(
    /// `exp_sub_sum_max` of the AVX2 and baseline copies (and of any AVX-512 CPU, in the tests).
    exp_sub_sum_max_lanes(xs: &mut [f32], m: f32) -> (f32, f32) {
    let mut acc = [0f32; LANES];
    let mut top = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for ((a, t), x) in acc.iter_mut().zip(top.iter_mut()).zip(c.iter_mut()) {
            *t = if *x > *t { *x } else { *t };
            *x = exp_lane_c::<FMA>(*x - m);
            *a += *x;
        }
    }
    let (mut tail, mut tail_top) = (0f32, f32::NEG_INFINITY);
    for x in chunks.into_remainder() {
        tail_top = tail_top.max(*x);
        *x = exp_lane_c::<FMA>(*x - m);
        tail += *x;
    }
    (acc.iter().sum::<f32>() + tail, top.iter().fold(tail_top, |a, &t| a.max(t)))
});

/// xs[i] = e^(xs[i] - m) in place; returns the sum of the new values (vectorised `exp_sub_sum_ref`).
/// On AVX-512 CPUs `avx512::exp_sub_sum` (2^n by `vscalefps`), elsewhere `exp_sub_sum_lanes`.
pub fn exp_sub_sum(xs: &mut [f32], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if have_avx512() {
        // SAFETY: the CPU supports avx512f, avx2 and fma (checked just above).
        return unsafe { avx512::exp_sub_sum(xs, m) };
    }
    exp_sub_sum_lanes(xs, m)
}

/// `exp_sub_sum` that also returns the largest value xs held before (-inf for an empty slice; NaN
/// handling unspecified): (sum of the new values, old max), in one pass (vectorised
/// `exp_sub_sum_max_ref`). On AVX-512 CPUs `avx512::exp_sub_sum_max`, elsewhere `exp_sub_sum_max_lanes`.
pub fn exp_sub_sum_max(xs: &mut [f32], m: f32) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if have_avx512() {
        // SAFETY: the CPU supports avx512f, avx2 and fma (checked just above).
        return unsafe { avx512::exp_sub_sum_max(xs, m) };
    }
    exp_sub_sum_max_lanes(xs, m)
}

/// The softmax loops written with AVX-512 intrinsics: `exp_lane_c`'s range reduction and polynomial (the
/// same operations, so the same values on [-86.6, 88.7]), with 2^n applied by `vscalefps`, which also
/// gives 0 and +inf past the ends of f32's range, in place of the exponent-bit arithmetic, the two
/// multiplies and the three selects of the portable form: 22 vector instructions per 16 values against 29 in
/// the compiled `exp_sub_sum_max_lanes` loop. Inputs are clamped to [-104, 89] first (so -inf gives 0,
/// +inf gives +inf; NaN stays NaN): between -104 and -86.6 the result is libm's denormal rather than 0.
/// Ragged tails run through masked loads and stores, so there is no scalar loop.
#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    use std::arch::x86_64::*;

    /// e^x of 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn exp16(x: __m512) -> __m512 {
        // max/min return their second operand when either is NaN: x last, so NaN passes through
        let xc = _mm512_min_ps(_mm512_set1_ps(89.0), _mm512_max_ps(_mm512_set1_ps(-104.0), x));
        let round = _mm512_set1_ps(12_582_912.0); // 1.5 * 2^23: adding it rounds to an integer
        let t = _mm512_fmadd_ps(xc, _mm512_set1_ps(std::f32::consts::LOG2_E), round);
        let n = _mm512_sub_ps(t, round);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), xc);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0));
        _mm512_scalef_ps(p, n)
    }

    /// `super::exp_sub_sum` on AVX-512: `exp_sub_sum_max`'s loop, whose extra `vmaxps` per 16 values costs
    /// less than a second copy of it.
    ///
    /// # Safety
    /// The CPU must support avx512f, avx2 and fma.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn exp_sub_sum(xs: &mut [f32], m: f32) -> f32 {
        // SAFETY: the same CPU features (this function's own contract).
        unsafe { exp_sub_sum_max(xs, m) }.0
    }

    /// `super::exp_sub_sum_max` on AVX-512.
    ///
    /// # Safety
    /// The CPU must support avx512f, avx2 and fma.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn exp_sub_sum_max(xs: &mut [f32], m: f32) -> (f32, f32) {
        let (mv, mut acc, mut top) = (_mm512_set1_ps(m), _mm512_setzero_ps(), _mm512_set1_ps(f32::NEG_INFINITY));
        let mut chunks = xs.chunks_exact_mut(16);
        for c in &mut chunks {
            // SAFETY: c holds 16 values (unaligned loads and stores).
            unsafe {
                let x = _mm512_loadu_ps(c.as_ptr());
                top = _mm512_max_ps(top, x);
                let e = exp16(_mm512_sub_ps(x, mv));
                _mm512_storeu_ps(c.as_mut_ptr(), e);
                acc = _mm512_add_ps(acc, e);
            }
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let k: __mmask16 = (1u16 << tail.len()) - 1; // tail.len() < 16
                                                         // SAFETY: the masked lanes are the tail's values; the others are neither read nor written.
            unsafe {
                let x = _mm512_maskz_loadu_ps(k, tail.as_ptr());
                top = _mm512_mask_max_ps(top, k, top, x);
                let e = exp16(_mm512_sub_ps(x, mv));
                _mm512_mask_storeu_ps(tail.as_mut_ptr(), k, e);
                acc = _mm512_mask_add_ps(acc, k, acc, e);
            }
        }
        (_mm512_reduce_add_ps(acc), _mm512_reduce_max_ps(top))
    }
}

/// xs[i] = e^(xs[i] - m) in place; returns (the sum of the new values, the largest old value).
pub fn exp_sub_sum_max_ref(xs: &mut [f32], m: f32) -> (f32, f32) {
    let top = max_ref(xs);
    (exp_sub_sum_ref(xs, m), top)
}

/// xs[i] = e^(xs[i] - m) in place; returns the sum of the new values (softmax numerator and denominator).
pub fn exp_sub_sum_ref(xs: &mut [f32], m: f32) -> f32 {
    xs.iter_mut().fold(0.0, |s, x| {
        *x = (*x - m).exp();
        s + *x
    })
}

dispatch!(
    /// The largest element, -inf for an empty slice (vectorised `max_ref`; NaN handling unspecified).
    max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = if x > *a { x } else { *a };
        }
    }
    let m = chunks.remainder().iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
    acc.iter().fold(m, |a, &x| a.max(x))
});

/// The largest element (-inf for an empty slice).
pub fn max_ref(xs: &[f32]) -> f32 {
    xs.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x))
}

dispatch!(
    /// sum a[i] b[i] over the shorter length (vectorised `dot_ref`).
    dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (mut ca, mut cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    for (x, y) in (&mut ca).zip(&mut cb) {
        for ((s, &p), &q) in acc.iter_mut().zip(x).zip(y) {
            *s += p * q;
        }
    }
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(p, q)| p * q).sum();
    acc.iter().sum::<f32>() + tail
});

/// sum a[i] b[i] over the shorter length.
pub fn dot_ref(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

dispatch!(
    /// xs[i] *= s.
    scale_in_place(xs: &mut [f32], s: f32) -> () {
    xs.iter_mut().for_each(|x| *x *= s);
});

dispatch!(
    /// dp[i] = p[i] (dp[i] - delta) scale: the softmax backward of one attention row (dS from P and dP).
    softmax_grad(dp: &mut [f32], p: &[f32], delta: f32, scale: f32) -> () {
    dp.iter_mut().zip(p).for_each(|(x, p)| *x = p * (*x - delta) * scale);
});

dispatch!(
    /// sum xs[i]^2 (vectorised `dot_ref(xs, xs)`).
    sum_sq(xs: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x * x;
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().map(|x| x * x).sum::<f32>()
});

/// silu(g) u of one element, with `exp` passed in (`exp_lane` in the loops, `f32::exp` in references).
#[inline(always)]
pub fn swiglu_lane(g: f32, u: f32, exp: impl Fn(f32) -> f32) -> f32 {
    g / (1.0 + exp(-g)) * u
}

/// (dg, du) of silu(g) u given dy: with s = sigmoid(g), dg = dy u s (1 + g (1 - s)), du = dy g s.
#[inline(always)]
pub fn swiglu_bwd_lane(dy: f32, g: f32, u: f32, exp: impl Fn(f32) -> f32) -> (f32, f32) {
    let s = 1.0 / (1.0 + exp(-g));
    (dy * u * s * (1.0 + g * (1.0 - s)), dy * g * s)
}

dispatch!(
    /// y[i] = silu(g[i]) u[i] (`ops::swiglu`'s forward, vectorised).
    swiglu_fwd(g: &[f32], u: &[f32], y: &mut [f32]) -> () {
    y.iter_mut().zip(g.iter().zip(u)).for_each(|(y, (&g, &u))| *y = swiglu_lane(g, u, exp_lane_c::<FMA>));
});

dispatch!(
    /// (dg[i], du[i]) of silu(g) u given dy (`ops::swiglu`'s backward, vectorised).
    swiglu_bwd(dy: &[f32], g: &[f32], u: &[f32], dg: &mut [f32], du: &mut [f32]) -> () {
    let ins = dy.iter().zip(g.iter().zip(u));
    dg.iter_mut().zip(du.iter_mut()).zip(ins).for_each(|((dg, du), (&d, (&g, &u)))| {
        (*dg, *du) = swiglu_bwd_lane(d, g, u, exp_lane_c::<FMA>);
    });
});

dispatch!(
    /// y[j] += sum_i a[i] w[i * stride + j] for j < y.len(): y plus a times the rows of a row-major w (the
    /// rows a.len(), `stride` apart, each at least y.len() long). Four rows per pass over y, so y is read
    /// and written a quarter as often as row-by-row axpy.
    axpy_rows(a: &[f32], w: &[f32], stride: usize, y: &mut [f32]) -> () {
    let n = y.len();
    let mut quads = a.chunks_exact(4);
    let mut i = 0;
    for q in &mut quads {
        let (w0, w1) = (&w[i * stride..i * stride + n], &w[(i + 1) * stride..(i + 1) * stride + n]);
        let (w2, w3) = (&w[(i + 2) * stride..(i + 2) * stride + n], &w[(i + 3) * stride..(i + 3) * stride + n]);
        for j in 0..n {
            y[j] += q[0] * w0[j] + q[1] * w1[j] + q[2] * w2[j] + q[3] * w3[j];
        }
        i += 4;
    }
    for &ai in quads.remainder() {
        let wi = &w[i * stride..i * stride + n];
        y.iter_mut().zip(wi).for_each(|(y, &x)| *y += ai * x);
        i += 1;
    }
});

/// y[j] += sum_i a[i] w[i * stride + j]: `axpy_rows`' reference, one row at a time.
pub fn axpy_rows_ref(a: &[f32], w: &[f32], stride: usize, y: &mut [f32]) {
    for (i, &ai) in a.iter().enumerate() {
        for (j, yj) in y.iter_mut().enumerate() {
            *yj += ai * w[i * stride + j];
        }
    }
}
