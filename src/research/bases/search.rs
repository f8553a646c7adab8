//! The maths of HARPE base sets: the RoPE waveform, its peaks and valleys, and the deterministic
//! peak–valley search "HARPE-PV v1" (`harpe search-bases` itself is `bases::cli`).
//!
//! Reference: Lian et al. (arXiv 2412.07171) Algorithm 1 and Table 2;
//! the peak/valley finders are a port of Chen et al.'s Attention Buckets
//! (`AlibabaResearch/DAMO-ConvAI:attention-buckets/basic.py`, `find_peak_points`, `find_trough_points`).
//!
//! The non-obvious decision: the paper leaves its peak and valley functions undefined, so the search is
//! our reconstruction: the f64 waveform `w_b(m) = (2/√d) Σ_j cos(m·b^(−2j/d))` on the integer
//! grid `[round(1000ρ), round(4090ρ)]` with `ρ = target_len / orig_len`, the Attention-Buckets chains of
//! running maxima/minima with their windows scaled by ρ, and Algorithm 1's objective with
//! nearest-neighbour pairing, integer scores, ties to the smaller base. Each candidate's peaks and valleys
//! do not depend on what has been chosen, so they are computed once (in parallel with rayon) and the
//! greedy loop only does integer arithmetic. It does NOT reproduce Table 2 (its picks overlap Table 2's
//! in about 8 of 32, chance level; no public HARPE code was found), so Table 2 stays the default.
//! What this file does not do: apply bases to a model (`model::rope`), draw (`bases::plot`), parse
//! flags or print (`bases::cli`).
use anyhow::{bail, Result};
use rayon::prelude::*;
use serde::Serialize;

/// Attention Buckets' reference distance grid and windows (4K model), before scaling by ρ.
const AB_GRID: (f64, f64) = (1000.0, 4090.0);
const AB_SEP: f64 = 50.0;
const AB_WIN: f64 = 500.0;
const AB_SEP_VALLEY: f64 = 60.0;

/// Parameters of the peak/valley finders. Positions and windows are in distance units;
/// the grid has step 1, so index offsets and distance offsets coincide.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PvParams {
    /// rotary head dimension d (even)
    pub head_dim: usize,
    /// first distance of the grid (inclusive)
    pub grid_lo: i64,
    /// last distance of the grid (inclusive)
    pub grid_hi: i64,
    /// number of peaks / valleys kept per base
    pub k: usize,
    /// peaks: minimum gap between accepted peaks and the offset where the next window starts
    pub sep_peak: i64,
    /// peaks: length of the window whose maximum becomes the next target level
    pub win: usize,
    /// valleys: offset to the left of an accepted valley where the next search range ends
    pub sep_excl: i64,
    /// valleys: minimum gap between accepted valleys
    pub sep_valley: i64,
    /// a local extremum matches the target level when it is within `tol` of it
    pub tol: f64,
}

impl PvParams {
    /// Attention Buckets' parameters scaled by ρ = `target_len / orig_len`, each rounded to an integer.
    pub fn scaled(head_dim: usize, orig_len: usize, target_len: usize) -> Result<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            bail!("--head-dim {head_dim} must be a positive even number\nhint: Llama-2-7B has head_dim 128");
        }
        if orig_len == 0 || target_len == 0 {
            bail!("--orig-len and --target-len must be positive (got {orig_len}, {target_len})\nhint: e.g. --orig-len 4096 --target-len 131072");
        }
        let rho = target_len as f64 / orig_len as f64;
        let r = |x: f64| (x * rho).round() as i64;
        let p = PvParams {
            head_dim,
            grid_lo: r(AB_GRID.0),
            grid_hi: r(AB_GRID.1),
            k: 6,
            sep_peak: r(AB_SEP),
            win: r(AB_WIN).max(1) as usize,
            sep_excl: r(AB_SEP),
            sep_valley: r(AB_SEP_VALLEY),
            tol: 1e-3,
        };
        if p.grid_hi - p.grid_lo < 2 {
            bail!(
                "the distance grid [{}, {}] (ρ = {rho}) is too short to have local extrema\nhint: use a larger --target-len / --orig-len ratio (ρ = 32 for 4K -> 128K)",
                p.grid_lo,
                p.grid_hi
            );
        }
        Ok(p)
    }

    /// Number of grid points.
    pub fn grid_len(&self) -> usize {
        (self.grid_hi - self.grid_lo + 1) as usize
    }
}

/// The waveform of base `b` at distance `m`: the pre-softmax logit `q^T R_m k / √d` for q = k = 1.
pub fn waveform(base: f64, head_dim: usize, m: f64) -> f64 {
    waveform_with(&thetas(base, head_dim), m)
}

/// θ_j = b^(−2j/d), j = 0..d/2, computed as Attention Buckets' `theta(j, base)`.
fn thetas(base: f64, head_dim: usize) -> Vec<f64> {
    (0..head_dim / 2).map(|j| base.powf(-2.0 * j as f64 / head_dim as f64)).collect()
}

/// Sequential sum of 2cos(mθ_j), divided by √d (d = 2 · thetas.len()).
fn waveform_with(thetas: &[f64], m: f64) -> f64 {
    let mut s = 0.0;
    for &t in thetas {
        s += 2.0 * (m * t).cos();
    }
    s / ((2 * thetas.len()) as f64).sqrt()
}

/// The waveform over the integer grid of `p`: (grid_len,).
pub fn waveform_grid(base: f64, p: &PvParams) -> Vec<f64> {
    let th = thetas(base, p.head_dim);
    (p.grid_lo..=p.grid_hi).map(|m| waveform_with(&th, m as f64)).collect()
}

/// Indices i with 1 ≤ i ≤ n−2 and f[i−1] < f[i] > f[i+1] (scipy `argrelextrema(f, np.greater)`).
pub fn local_maxima(f: &[f64]) -> Vec<usize> {
    (1..f.len().saturating_sub(1)).filter(|&i| f[i - 1] < f[i] && f[i] > f[i + 1]).collect()
}

/// Indices i with 1 ≤ i ≤ n−2 and f[i−1] > f[i] < f[i+1] (scipy `argrelextrema(f, np.less)`).
pub fn local_minima(f: &[f64]) -> Vec<usize> {
    (1..f.len().saturating_sub(1)).filter(|&i| f[i - 1] > f[i] && f[i] < f[i + 1]).collect()
}

/// Attention Buckets' `find_peak_points` on a waveform: a chain of running maxima scanned left to right.
/// Returns grid indices, ascending. Stops early (returning what it has) when fewer than 2 local maxima
/// are left, where the Python original raises IndexError.
pub fn peak_chain(f: &[f64], p: &PvParams) -> Vec<usize> {
    let maxima = local_maxima(f);
    let Some(mut node) = maxima.iter().map(|&i| f[i]).reduce(f64::max) else {
        return Vec::new();
    };
    let mut res: Vec<usize> = Vec::with_capacity(p.k);
    let mut q = 0; // maxima[q..] are the local maxima still to scan
    while res.len() < p.k && maxima.len() - q >= 2 {
        let i = maxima[q];
        if (f[i] - node).abs() <= p.tol {
            if res.last().is_none_or(|&last| (i - last) as i64 > p.sep_peak) {
                res.push(i);
            }
            let start = (i + p.sep_peak as usize).min(maxima[q + 1]);
            let end = (start + p.win).min(f.len());
            node = f[start..end].iter().copied().fold(f64::NEG_INFINITY, f64::max);
        }
        q += 1;
    }
    res
}

/// Attention Buckets' `find_trough_points` on a waveform: a chain of running minima scanned right to
/// left. Returns grid indices, ascending. Stops early like [`peak_chain`].
pub fn valley_chain(f: &[f64], p: &PvParams) -> Vec<usize> {
    let mut minima = local_minima(f);
    let Some(mut node) = minima.iter().map(|&i| f[i]).reduce(f64::min) else {
        return Vec::new();
    };
    let mut res: Vec<usize> = Vec::with_capacity(p.k);
    while res.len() < p.k && minima.len() >= 2 {
        let t = minima[minima.len() - 1];
        if (f[t] - node).abs() <= p.tol {
            if res.last().is_none_or(|&last| (last - t) as i64 > p.sep_valley) {
                res.push(t);
            }
            let end = (t as i64 - p.sep_excl).min(minima[minima.len() - 2] as i64);
            if end <= 0 {
                break;
            }
            node = f[..end as usize].iter().copied().fold(f64::INFINITY, f64::min);
        }
        minima.pop();
    }
    res.reverse();
    res
}

/// fp(b) and fv(b): peak and valley distances of one base, ascending.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Extrema {
    pub base: f64,
    pub peaks: Vec<i64>,
    pub valleys: Vec<i64>,
}

/// fp and fv of one base on the grid of `p`.
pub fn extrema(base: f64, p: &PvParams) -> Extrema {
    let f = waveform_grid(base, p);
    let pos = |idx: Vec<usize>| idx.into_iter().map(|i| p.grid_lo + i as i64).collect();
    Extrema { base, peaks: pos(peak_chain(&f, p)), valleys: pos(valley_chain(&f, p)) }
}

/// Eq. 10: `b_min + i·s` for i = 1..⌊(b_max − b_min)/s⌋, ascending.
pub fn candidates(min: f64, max: f64, stride: f64) -> Result<Vec<f64>> {
    check_range(min, max)?;
    if !(stride.is_finite() && stride > 0.0) {
        bail!("--stride {stride} must be a positive number\nhint: the paper uses --stride 30000");
    }
    if stride > max - min {
        bail!(
            "--stride {stride} is larger than the range --max {max} − --min {min} = {}, so there are no candidates\nhint: use a stride below {}, e.g. 30000 for 1e6..5e6",
            max - min,
            max - min
        );
    }
    let n = ((max - min) / stride).floor() as usize;
    Ok((1..=n).map(|i| min + i as f64 * stride).collect())
}

pub(crate) fn check_range(min: f64, max: f64) -> Result<()> {
    if !(min.is_finite() && min > 1.0) {
        bail!("--min {min} is not a valid RoPE base\nhint: bases are numbers > 1, e.g. --min 1e6");
    }
    if !(max.is_finite() && min < max) {
        bail!("--min {min} must be smaller than --max {max}\nhint: e.g. --min 1e6 --max 5e6");
    }
    Ok(())
}

/// Algorithm 1's d_j with nearest-neighbour pairing:
/// `Σ_{p∈P_j} min_{v∈V_s}|p−v| + Σ_{v∈V_j} min_{p∈P_s}|v−p|`. `sel_*` must be sorted and non-empty.
pub fn score(cand: &Extrema, sel_peaks: &[i64], sel_valleys: &[i64]) -> u64 {
    let nearest = |x: i64, sorted: &[i64]| -> u64 {
        let k = sorted.partition_point(|&y| y < x);
        let right = sorted.get(k).map(|&y| y.abs_diff(x));
        let left = k.checked_sub(1).map(|k| sorted[k].abs_diff(x));
        right.into_iter().chain(left).min().unwrap_or(0)
    };
    cand.peaks.iter().map(|&p| nearest(p, sel_valleys)).sum::<u64>()
        + cand.valleys.iter().map(|&v| nearest(v, sel_peaks)).sum::<u64>()
}

/// One greedy step: the base added and its score (`None` for the starting base b_min).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Pick {
    pub base: f64,
    pub d: Option<u64>,
}

/// Result of the peak–valley search.
#[derive(Clone, Debug)]
pub struct PvSearch {
    /// the chosen bases, ascending (= head order for `--order asc`)
    pub bases: Vec<f64>,
    /// the bases in the order they were chosen, with their scores
    pub picks: Vec<Pick>,
    /// fp/fv of the chosen bases, ascending by base
    pub extrema: Vec<Extrema>,
    /// candidates that were never eligible because they have no peaks or no valleys on the grid
    pub skipped: Vec<f64>,
}

/// HARPE-PV v1: fp/fv of `b_min` and every candidate (computed once, in
/// parallel), then [`greedy_select`] up to `n` bases. Duplicate candidates and `b_min` itself are dropped.
pub fn peak_valley_search(b_min: f64, cands: &[f64], n: usize, p: &PvParams) -> Result<PvSearch> {
    let mut pool_bases: Vec<f64> = cands.iter().copied().filter(|&b| b != b_min).collect();
    pool_bases.sort_by(f64::total_cmp);
    pool_bases.dedup();
    if n == 0 {
        bail!("the search needs at least one head\nhint: pass --heads N");
    }
    if n > pool_bases.len() + 1 {
        bail!(
            "{n} heads need {n} distinct bases, but there are only {} (b_min and {} candidates)\nhint: lower --stride or widen --min/--max",
            pool_bases.len() + 1,
            pool_bases.len()
        );
    }
    // fp/fv of every base, once: (1 + |B_c|,) — the waveforms dominate the run time.
    let start = extrema(b_min, p);
    if start.peaks.is_empty() || start.valleys.is_empty() {
        bail!(
            "the waveform of b_min = {b_min} has {} peaks and {} valleys on the distance grid [{}, {}], the search needs both\nhint: use a larger --target-len (a wider grid) or a smaller --min",
            start.peaks.len(),
            start.valleys.len(),
            p.grid_lo,
            p.grid_hi
        );
    }
    let pool: Vec<Extrema> = pool_bases.par_iter().map(|&b| extrema(b, p)).collect();
    let (eligible, skipped): (Vec<Extrema>, Vec<Extrema>) =
        pool.into_iter().partition(|e| !e.peaks.is_empty() && !e.valleys.is_empty());
    let (picks, mut chosen) = greedy_select(&start, &eligible, n);
    if picks.len() < n {
        bail!(
            "only {} bases could be chosen, {n} were asked for: {} candidates have no peaks or no valleys on the grid [{}, {}]\nhint: lower --heads, lower --stride or use a larger --target-len",
            picks.len(),
            skipped.len(),
            p.grid_lo,
            p.grid_hi
        );
    }
    let mut extrema: Vec<Extrema> =
        std::iter::once(start).chain(chosen.drain(..).map(|i| eligible[i].clone())).collect();
    extrema.sort_by(|a, b| a.base.total_cmp(&b.base));
    Ok(PvSearch {
        bases: extrema.iter().map(|e| e.base).collect(),
        picks,
        extrema,
        skipped: skipped.iter().map(|e| e.base).collect(),
    })
}

/// Algorithm 1's greedy loop on precomputed fp/fv: starting from `start`, repeatedly add the pool entry
/// with the smallest d_j (ties: smaller base, whatever the pool order) until there are `n` picks or the
/// pool is exhausted. `P_s`, `V_s` are multisets (no Attention-Buckets `fliter`). Returns the picks in
/// choice order and the pool indices chosen. `start` must have peaks and valleys.
pub fn greedy_select(start: &Extrema, pool: &[Extrema], n: usize) -> (Vec<Pick>, Vec<usize>) {
    let mut sel_peaks = start.peaks.clone();
    let mut sel_valleys = start.valleys.clone();
    let mut taken = vec![false; pool.len()];
    let mut picks = vec![Pick { base: start.base, d: None }];
    let mut chosen = Vec::new();
    while picks.len() < n {
        // score every remaining candidate in parallel; (d, base) order makes the pick order-independent
        let best = pool
            .par_iter()
            .enumerate()
            .filter(|(i, _)| !taken[*i])
            .map(|(i, e)| (score(e, &sel_peaks, &sel_valleys), e.base, i))
            .min_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
        let Some((d, base, i)) = best else { break };
        taken[i] = true;
        chosen.push(i);
        sel_peaks.extend_from_slice(&pool[i].peaks);
        sel_peaks.sort_unstable();
        sel_valleys.extend_from_slice(&pool[i].valleys);
        sel_valleys.sort_unstable();
        picks.push(Pick { base, d: Some(d) });
    }
    (picks, chosen)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::rope::TABLE2_BASES;

    fn ab() -> PvParams {
        PvParams::scaled(128, 4096, 4096).unwrap()
    }
    fn k128() -> PvParams {
        PvParams::scaled(128, 4096, 131072).unwrap()
    }

    #[test]
    fn waveform_values() {
        approx::assert_abs_diff_eq!(waveform(1e6, 128, 0.0), 11.31370849898476, epsilon = 1e-9);
        approx::assert_abs_diff_eq!(waveform(1e6, 128, 4096.0), 3.140721576733135, epsilon = 1e-9);
        // w_b(0) = √d for any base and head dim
        approx::assert_abs_diff_eq!(waveform(5e6, 64, 0.0), 8.0, epsilon = 1e-12);
    }

    #[test]
    fn scaled_parameters() {
        let p = k128();
        assert_eq!((p.grid_lo, p.grid_hi, p.k), (32000, 130880, 6));
        assert_eq!((p.sep_peak, p.win, p.sep_excl, p.sep_valley), (1600, 16000, 1600, 1920));
        let a = ab();
        assert_eq!((a.grid_lo, a.grid_hi, a.sep_peak, a.win, a.sep_valley), (1000, 4090, 50, 500, 60));
    }

    #[test]
    fn local_extrema_are_strict_and_skip_endpoints() {
        let f = [3.0, 1.0, 2.0, 2.0, 1.0, 5.0, 0.0, 4.0];
        assert_eq!(local_maxima(&f), vec![5]);
        assert_eq!(local_minima(&f), vec![1, 4, 6]);
        assert!(local_maxima(&[1.0, 2.0]).is_empty());
    }

    /// Each (base, peaks, valleys) row: `extrema` of that base under `p` gives those peaks and valleys.
    fn assert_extrema(p: &PvParams, rows: [(f64, [i64; 6], [i64; 6]); 3]) {
        for (b, fp, fv) in rows {
            let e = extrema(b, p);
            assert_eq!(e.peaks, fp, "fp({b})");
            assert_eq!(e.valleys, fv, "fv({b})");
        }
    }

    #[test]
    fn attention_buckets_golden_table() {
        assert_extrema(
            &ab(),
            [
                (10000.0, [1030, 1189, 1375, 1589, 1835, 2118], [1970, 2290, 2629, 3044, 3515, 4060]),
                (18000.0, [1068, 1244, 1451, 1690, 1970, 2295], [1805, 2103, 2428, 2830, 3298, 3843]),
                (20000.0, [1130, 1540, 1798, 2098, 2450, 2860], [2666, 2994, 3113, 3496, 3634, 4081]),
            ],
        );
    }

    #[test]
    fn extrema_at_128k_scale() {
        assert_extrema(
            &k128(),
            [
                (1e6, [32007, 36787, 39718, 44905, 55725, 61161], [64299, 79792, 99018, 103399, 122876, 128312]),
                (4.54e6, [32817, 45283, 57537, 67325, 82655, 84427], [74132, 78399, 94194, 99616, 119685, 126591]),
                (2.17e6, [37598, 47225, 59318, 74506, 88254, 93583], [38903, 48863, 61377, 77092, 96832, 121626]),
            ],
        );
    }

    #[test]
    fn chains_stop_when_extrema_run_out() {
        let p = ab();
        // one local maximum and one local minimum: the Python original raises, we return nothing
        let f = [0.0, 1.0, 0.0, -1.0, 0.0];
        assert!(peak_chain(&f, &p).is_empty());
        assert!(valley_chain(&f, &p).is_empty());
        assert!(peak_chain(&[], &p).is_empty());
    }

    #[test]
    fn candidate_set_eq10() {
        let c = candidates(1e6, 5e6, 30000.0).unwrap();
        assert_eq!(c.len(), 133);
        assert_eq!((c[0], c[132]), (1_030_000.0, 4_990_000.0));
        // every Table 2 base but b_min is a candidate
        for b in &TABLE2_BASES[1..] {
            assert!(c.contains(&(*b as f64)), "{b}");
        }
        // an exact division includes b_max
        assert_eq!(candidates(1e6, 2e6, 250000.0).unwrap(), vec![1.25e6, 1.5e6, 1.75e6, 2e6]);
        assert!(candidates(5e6, 1e6, 30000.0).is_err());
        assert!(candidates(1e6, 5e6, 0.0).is_err());
        assert!(candidates(1e6, 5e6, -1.0).is_err());
        assert!(candidates(1e6, 5e6, 5e6).is_err());
    }

    #[test]
    fn score_is_nearest_neighbour_sum() {
        let cand = Extrema { base: 2.0, peaks: vec![10, 50], valleys: vec![30] };
        // peaks to nearest selected valley: |10-12| + |50-40| = 12; valley to nearest selected peak: |30-25| = 5
        assert_eq!(score(&cand, &[0, 25, 100], &[12, 40]), 17);
        // duplicates in the selected multisets do not change nearest distances
        assert_eq!(score(&cand, &[0, 25, 25, 100], &[12, 12, 40]), 17);
    }

    #[test]
    fn full_32_base_search() {
        let p = k128();
        let cands = candidates(1e6, 5e6, 30000.0).unwrap();
        let r = peak_valley_search(1e6, &cands, 32, &p).unwrap();
        let want_m = [
            1.00, 1.12, 1.15, 1.18, 1.63, 1.66, 1.69, 1.72, 1.78, 1.84, 1.87, 1.90, 2.35, 2.38, 2.44, 2.53, 2.62, 2.65,
            2.77, 2.92, 3.25, 3.28, 3.31, 3.37, 3.43, 3.46, 3.58, 3.61, 3.70, 3.76, 3.97, 4.39,
        ];
        let want: Vec<f64> = want_m.iter().map(|m| (m * 100.0_f64).round() * 10000.0).collect();
        assert_eq!(r.bases, want);
        assert_eq!(r.picks[0], Pick { base: 1e6, d: None });
        assert_eq!(r.picks[1], Pick { base: 3.97e6, d: Some(121323) });
        assert_eq!(r.picks[2], Pick { base: 3.25e6, d: Some(20937) });
        assert_eq!(r.picks[3], Pick { base: 1.63e6, d: Some(22580) });
        // properties: N distinct bases from {b_min} ∪ B_c, b_min included, extrema match the bases
        let overlap = r.bases.iter().filter(|b| TABLE2_BASES.contains(&(**b as u64))).count();
        assert_eq!(overlap, 8);
        assert!(r.skipped.is_empty());
        assert_eq!(r.extrema.iter().map(|e| e.base).collect::<Vec<_>>(), r.bases);
        assert_eq!(r.extrema[0], extrema(1e6, &p));
    }

    #[test]
    fn search_properties_on_small_grid() {
        // AB scale keeps this fast; 8 heads out of 20 candidates
        let p = ab();
        let cands = candidates(10000.0, 30000.0, 1000.0).unwrap();
        let r = peak_valley_search(10000.0, &cands, 8, &p).unwrap();
        assert_eq!(r.bases.len(), 8);
        assert_eq!(r.bases[0], 10000.0);
        assert!(r.bases.windows(2).all(|w| w[0] < w[1]), "distinct and ascending: {:?}", r.bases);
        assert!(r.bases[1..].iter().all(|b| cands.contains(b)));
        // scores are not computed against the candidate's own extrema: recompute each pick's d
        let mut sp = extrema(10000.0, &p).peaks;
        let mut sv = extrema(10000.0, &p).valleys;
        for pk in &r.picks[1..] {
            sp.sort_unstable();
            sv.sort_unstable();
            let e = extrema(pk.base, &p);
            assert_eq!(pk.d, Some(score(&e, &sp, &sv)));
            sp.extend(e.peaks);
            sv.extend(e.valleys);
        }
        // permuting the candidate order does not change the result (ties broken by value)
        let mut rev = cands.clone();
        rev.reverse();
        let mut shuffled = cands.clone();
        shuffled.rotate_left(7);
        for order in [rev, shuffled] {
            let r2 = peak_valley_search(10000.0, &order, 8, &p).unwrap();
            assert_eq!(r2.bases, r.bases);
            assert_eq!(r2.picks, r.picks);
        }
    }

    #[test]
    fn greedy_ties_go_to_the_smaller_base() {
        let start = Extrema { base: 1.0, peaks: vec![100], valleys: vec![200] };
        let e = |base: f64, peaks: Vec<i64>, valleys: Vec<i64>| Extrema { base, peaks, valleys };
        // 7 and 3 tie at d = 0 + 0; 5 scores 10 + 10
        let pool = vec![e(7.0, vec![200], vec![100]), e(5.0, vec![210], vec![110]), e(3.0, vec![200], vec![100])];
        let (picks, chosen) = greedy_select(&start, &pool, 3);
        assert_eq!(chosen, vec![2, 0]);
        assert_eq!(picks[1], Pick { base: 3.0, d: Some(0) });
        assert_eq!(picks[2], Pick { base: 7.0, d: Some(0) });
        // the multiset grew: 5 is now 10 from 200 and 10 from 100 → still 20, never chosen
        let (picks, _) = greedy_select(&start, &pool, 10);
        assert_eq!(picks.len(), 4);
        assert_eq!(picks[3], Pick { base: 5.0, d: Some(20) });
    }

    #[test]
    fn too_many_heads_is_an_error() {
        let e = peak_valley_search(10000.0, &[20000.0], 3, &ab()).unwrap_err().to_string();
        assert!(e.contains("only 2") && e.contains("hint:"), "{e}");
    }
}
