//! Summary statistics for `harpe report`: mean, sample standard deviation, and the 95% confidence
//! interval of a mean paired difference (Student's t, or a percentile bootstrap).
//!
//! Reference: any statistics text (e.g. Wasserman, "All of Statistics", §7 and §8); the t quantile
//! comes from `statrs` (`StudentsT::inverse_cdf`).
//! The non-obvious decision: the standard deviation is the sample one (divisor n - 1), because seeds are
//! a sample of the run-to-run noise; with n = 1 it and every interval are undefined (None), never 0.
//! The bootstrap resamples the paired differences with a fixed-seed generator, so a report is
//! reproducible byte for byte.
//!
//! Not here: multiple-comparison corrections, unpaired (Welch) tests.
use rand::{Rng, SeedableRng};
use statrs::distribution::{ContinuousCDF, StudentsT};

/// n, mean and sample standard deviation of a set of values.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Summary {
    pub n: usize,
    pub mean: f64,
    /// sample standard deviation (n - 1); None for n < 2
    pub std: Option<f64>,
}

/// Summary of `xs` (None when empty).
pub fn summarize(xs: &[f64]) -> Option<Summary> {
    let n = xs.len();
    if n == 0 {
        return None;
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    let std = (n > 1).then(|| (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt());
    Some(Summary { n, mean, std })
}

/// How the interval of a mean difference is computed.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum IntervalMethod {
    /// mean ± t(0.975, n-1) · sd / sqrt(n)
    T,
    /// 2.5th and 97.5th percentiles of the mean over `resamples` resamples with replacement
    Bootstrap { resamples: usize },
}

/// A mean paired difference with its 95% interval.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct PairedDiff {
    pub n: usize,
    pub mean: f64,
    pub std: Option<f64>,
    /// 95% interval; None for n < 2
    pub ci: Option<(f64, f64)>,
}

/// The two-sided 97.5% quantile of Student's t with `df` degrees of freedom.
pub fn t_quantile_975(df: usize) -> f64 {
    match StudentsT::new(0.0, 1.0, df as f64) {
        Ok(t) => t.inverse_cdf(0.975),
        Err(_) => f64::NAN,
    }
}

/// Mean of `d` (the per-seed differences arm - baseline) and its 95% interval.
pub fn paired_diff(d: &[f64], method: IntervalMethod) -> Option<PairedDiff> {
    let s = summarize(d)?;
    let ci = match (s.std, method) {
        (None, _) => None,
        (Some(sd), IntervalMethod::T) => {
            let h = t_quantile_975(s.n - 1) * sd / (s.n as f64).sqrt();
            Some((s.mean - h, s.mean + h))
        }
        (Some(_), IntervalMethod::Bootstrap { resamples }) => Some(bootstrap_ci(d, resamples.max(1))),
    };
    Some(PairedDiff { n: s.n, mean: s.mean, std: s.std, ci })
}

/// Percentile bootstrap 95% interval of the mean (seeded: the same input gives the same interval).
pub fn bootstrap_ci(d: &[f64], resamples: usize) -> (f64, f64) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed);
    let n = d.len();
    let mut means: Vec<f64> =
        (0..resamples).map(|_| (0..n).map(|_| d[rng.random_range(0..n)]).sum::<f64>() / n as f64).collect();
    means.sort_by(f64::total_cmp);
    let at = |q: f64| means[((q * (resamples - 1) as f64).round() as usize).min(resamples - 1)];
    (at(0.025), at(0.975))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn t_quantiles_match_tables() {
        // two-sided 95% critical values from standard t tables
        for (df, want) in [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423)] {
            assert!((t_quantile_975(df) - want).abs() < 1e-3, "df {df}: {}", t_quantile_975(df));
        }
    }

    #[test]
    fn summary_and_interval() {
        let s = summarize(&[1.0, 2.0, 4.0]).unwrap();
        assert_eq!(s.n, 3);
        assert!((s.mean - 7.0 / 3.0).abs() < 1e-12);
        // sum of squares around 7/3: 16/9 + 1/9 + 25/9 = 42/9; / 2
        assert!((s.std.unwrap() - (42.0f64 / 18.0).sqrt()).abs() < 1e-12);
        assert_eq!(summarize(&[5.0]).unwrap().std, None);
        assert!(paired_diff(&[0.5], IntervalMethod::T).unwrap().ci.is_none());
        let b = paired_diff(&[1.0, 2.0, 3.0, 4.0], IntervalMethod::Bootstrap { resamples: 2000 }).unwrap();
        let (lo, hi) = b.ci.unwrap();
        assert!(lo >= 1.0 && hi <= 4.0 && lo < 2.5 && hi > 2.5, "{lo} {hi}");
        assert_eq!(b.ci, paired_diff(&[1.0, 2.0, 3.0, 4.0], IntervalMethod::Bootstrap { resamples: 2000 }).unwrap().ci);
    }
}
