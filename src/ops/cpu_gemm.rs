//! The one single-threaded f32 GEMM call of the CPU ops (`ops::linear`'s bands, the attention's block
//! products): the `gemm` crate by default, Intel MKL's `cblas_sgemm` (sequential) with feature `mkl`.
//!
//! Reference: the BLAS sgemm contract (C := alpha A B + beta C; with beta = 0 C is not read); the readable
//! twins of the callers (`ops::linear::linear_slow`, `ops::attention::attention_fwd_cpu`) are what the tests
//! compare either backend against.
//! The non-obvious decision: why MKL at all. On 2 AVX-512 threads the gemm crate's microkernels reach
//! 213-235 GFLOP/s on the hidden-512/768 projections (`benches/linear_cpu.rs`), MKL (PyTorch's CPU
//! backend) 272-331: the gap PyTorch keeps on the large rows of the CPU benchmark grid. The threads stay
//! harpe's (rayon bands, one GEMM per band), so MKL is linked sequential and the results of a band do not
//! depend on how many threads run. MKL's strict CNR mode is set once (`MKL_CBWR=AUTO,STRICT` through
//! `mkl_cbwr_set`) so results do not depend on the buffers' alignment either: a resumed run must repeat
//! the bits of the run it continues.
//! Views MKL cannot take (neither stride 1, or a leading dimension below its row length) go to the gemm
//! crate in every build.
use gemm::{gemm, Parallelism};

/// A GEMM operand: element (r, c) at `ptr + r * rs + c * cs`.
#[derive(Clone, Copy, Debug)]
pub struct Mat {
    pub ptr: *const f32,
    pub rs: isize,
    pub cs: isize,
}

/// dst (m x n, unit column stride, row stride `dst_rs`) := (accumulate ? dst : 0) + beta * lhs (m x k) *
/// rhs (k x n). With `accumulate` false dst is written without being read (it may be uninitialised).
/// `par`: the gemm crate's own threads (MKL runs sequential whatever it says).
///
/// # Safety
/// Every operand view holds its m x k / k x n elements inside its allocation, dst points at m rows of n
/// writable values `dst_rs` apart, and dst aliases neither operand.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    lhs: Mat,
    rhs: Mat,
    beta: f32,
    par: Parallelism,
) {
    #[cfg(feature = "mkl")]
    {
        // SAFETY: forwarded from the caller's contract above.
        if unsafe { mkl::sgemm((m, n, k), dst, dst_rs, accumulate, lhs, rhs, beta) } {
            return;
        }
    }
    // SAFETY: forwarded from the caller's contract above.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            lhs.ptr,
            lhs.cs,
            lhs.rs,
            rhs.ptr,
            rhs.cs,
            rhs.rs,
            1.0,
            beta,
            false,
            false,
            false,
            par,
        )
    }
}

/// The name of the GEMM backend this build runs (`mkl` or `gemm`), for benchmark records.
pub fn backend() -> &'static str {
    if cfg!(feature = "mkl") {
        "mkl"
    } else {
        "gemm"
    }
}

#[cfg(feature = "mkl")]
mod mkl {
    use super::Mat;
    use cblas_sys::{cblas_sgemm, CBLAS_LAYOUT, CBLAS_TRANSPOSE};
    use std::os::raw::c_int;
    use std::sync::Once;

    extern "C" {
        /// MKL's conditional numerical reproducibility switch (mkl_service.h).
        fn MKL_CBWR_Set(setting: c_int) -> c_int;
    }
    /// MKL_CBWR_AUTO | MKL_CBWR_STRICT (mkl_types.h): the CPU's best code branch, with ?gemm results that
    /// depend neither on the operands' alignment nor on the thread count.
    const CBWR_AUTO_STRICT: c_int = 2 | 0x10000;
    static CBWR: Once = Once::new();

    /// (transpose, leading dimension) of a (rows x cols) row-major-addressed operand for CBLAS row-major
    /// calls, or None when MKL cannot read it in place.
    fn operand(v: Mat, rows: usize, cols: usize) -> Option<(CBLAS_TRANSPOSE, c_int)> {
        let fits = |ld: isize, min: usize| ld >= min.max(1) as isize && ld <= c_int::MAX as isize;
        if v.cs == 1 && fits(v.rs, cols) {
            Some((CBLAS_TRANSPOSE::CblasNoTrans, v.rs as c_int))
        } else if v.rs == 1 && fits(v.cs, rows) {
            Some((CBLAS_TRANSPOSE::CblasTrans, v.cs as c_int))
        } else {
            None
        }
    }

    /// `super::sgemm` on MKL; false (nothing done) when a view does not fit CBLAS.
    ///
    /// SAFETY: as `super::sgemm`.
    pub unsafe fn sgemm(
        (m, n, k): (usize, usize, usize),
        dst: *mut f32,
        dst_rs: usize,
        accumulate: bool,
        lhs: Mat,
        rhs: Mat,
        beta: f32,
    ) -> bool {
        let small = |x: usize| x <= c_int::MAX as usize;
        let (Some((ta, lda)), Some((tb, ldb))) = (operand(lhs, m, k), operand(rhs, k, n)) else { return false };
        if !(small(m) && small(n) && small(k) && small(dst_rs) && dst_rs >= n.max(1)) {
            return false;
        }
        // SAFETY: MKL_CBWR_Set only sets a process-wide mode; called once, before the first GEMM. A user's
        // own MKL_CBWR (environment) is left in charge.
        CBWR.call_once(|| {
            if std::env::var_os("MKL_CBWR").is_none() {
                let rc = unsafe { MKL_CBWR_Set(CBWR_AUTO_STRICT) };
                assert!(rc == 0, "MKL_CBWR_Set(AUTO | STRICT) failed with {rc}");
            }
        });
        let c_beta = if accumulate { 1.0 } else { 0.0 };
        // SAFETY: the caller's contract (views inside their allocations, dst m rows of n values dst_rs
        // apart, no aliasing); with c_beta = 0 BLAS does not read dst.
        unsafe {
            cblas_sgemm(
                CBLAS_LAYOUT::CblasRowMajor,
                ta,
                tb,
                m as c_int,
                n as c_int,
                k as c_int,
                beta,
                lhs.ptr,
                lda,
                rhs.ptr,
                ldb,
                c_beta,
                dst,
                dst_rs as c_int,
            )
        };
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeded values in [-1, 1) (ChaCha8, as the other ops' unit tests draw theirs).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| r.random::<f32>() * 2.0 - 1.0).collect()
    }

    /// An (rows x cols) operand stored three ways: row-major with a padded row stride, transposed
    /// (column-major, padded), or with no unit stride at all (every element 2 apart along columns).
    #[derive(Clone, Copy, Debug)]
    enum Store {
        Rows,
        Cols,
        Strided,
    }

    /// The operand's buffer (element (r, c) = `dense[r * cols + c]`) and its view strides.
    fn store(dense: &[f32], rows: usize, cols: usize, how: Store) -> (Vec<f32>, isize, isize) {
        let (rs, cs) = match how {
            Store::Rows => (cols + 3, 1),
            Store::Cols => (1, rows + 5),
            Store::Strided => (2 * cols + 1, 2),
        };
        let mut buf = vec![f32::NAN; rows.max(1) * rs + cols.max(1) * cs];
        for r in 0..rows {
            for c in 0..cols {
                buf[r * rs + c * cs] = dense[r * cols + c];
            }
        }
        (buf, rs as isize, cs as isize)
    }

    /// `sgemm` over every operand storage, with and without accumulation, scaled, into a padded
    /// destination, against a triple loop in f64: the result, the untouched padding, and (without
    /// accumulation) that the NaN the destination held is never read.
    #[test]
    fn matches_a_triple_loop_in_every_layout() {
        let stores = [Store::Rows, Store::Cols, Store::Strided];
        for (m, n, k) in [(1, 1, 1), (3, 5, 7), (33, 17, 64), (70, 130, 40), (1, 96, 300)] {
            let (a, b) = (values(m * k, 1), values(k * n, 2));
            for la in stores {
                for lb in stores {
                    for (accumulate, beta) in [(false, 1.0f32), (true, 0.5)] {
                        let (abuf, ars, acs) = store(&a, m, k, la);
                        let (bbuf, brs, bcs) = store(&b, k, n, lb);
                        let ld = n + 2;
                        let c0 = values(m * ld, 3);
                        let mut c = if accumulate { c0.clone() } else { vec![f32::NAN; m * ld] };
                        for r in 0..m {
                            c[r * ld + n..(r + 1) * ld].fill(7.0); // padding: must stay
                        }
                        // SAFETY: the views are inside their buffers, c holds m rows of ld >= n values.
                        unsafe {
                            sgemm(
                                (m, n, k),
                                c.as_mut_ptr(),
                                ld,
                                accumulate,
                                Mat { ptr: abuf.as_ptr(), rs: ars, cs: acs },
                                Mat { ptr: bbuf.as_ptr(), rs: brs, cs: bcs },
                                beta,
                                Parallelism::None,
                            )
                        };
                        for r in 0..m {
                            for j in 0..n {
                                let dot: f64 = (0..k).map(|i| a[r * k + i] as f64 * b[i * n + j] as f64).sum();
                                let want = if accumulate { c0[r * ld + j] as f64 } else { 0.0 } + beta as f64 * dot;
                                let got = c[r * ld + j] as f64;
                                assert!(
                                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * (k as f64).sqrt(),
                                    "({m}, {n}, {k}) {la:?} x {lb:?} acc {accumulate}: [{r}, {j}] = {got}, want {want}"
                                );
                            }
                            assert!(c[r * ld + n..(r + 1) * ld].iter().all(|&x| x == 7.0), "padding written");
                        }
                    }
                }
            }
        }
    }

    /// The same product at other alignments of its operands and destination gives the same bits: a
    /// resumed training run repeats the run it continues only if a GEMM's result does not depend on where
    /// its buffers happen to start (MKL's strict CNR mode; the gemm crate packs into its own buffers).
    #[test]
    fn results_do_not_depend_on_buffer_alignment() {
        let (m, n, k) = (67, 45, 130);
        let (a, b) = (values(m * k, 4), values(k * n, 5));
        let run = |shift: usize| -> Vec<u32> {
            let mut ab = vec![0f32; shift];
            ab.extend_from_slice(&a);
            let mut bb = vec![0f32; 2 * shift + 1];
            bb.extend_from_slice(&b);
            let mut c = vec![0f32; m * n + shift];
            // SAFETY: the views cover the copies of a and b; c holds m rows of n values after `shift`.
            unsafe {
                sgemm(
                    (m, n, k),
                    c[shift..].as_mut_ptr(),
                    n,
                    false,
                    Mat { ptr: ab[shift..].as_ptr(), rs: k as isize, cs: 1 },
                    Mat { ptr: bb[2 * shift + 1..].as_ptr(), rs: n as isize, cs: 1 },
                    1.0,
                    Parallelism::None,
                )
            };
            c[shift..].iter().map(|x| x.to_bits()).collect()
        };
        let first = run(0);
        for shift in 1..8 {
            assert!(run(shift) == first, "{} backend: shift {shift} changed the result bits", backend());
        }
    }
}
