//! `harpe search-bases --plot FILE.png`: the waveforms of a base set with their peaks and valleys, and
//! how those extrema cover the distance range, one row per head.
//!
//! Reference: Attention Buckets' `plot_base_selection` figures (Chen et al. 2024b).
//! The non-obvious decision: a waveform has ~10^5 grid points and oscillates every few positions (its
//! j = 0 term is cos(m)), so each curve is drawn as its per-pixel-column min/max envelope: the image shows
//! exactly the range the raw values span in each column, in 2 points per column instead of 10^5.
//! What it does not do: choose bases or compute extrema (`bases::search`).
use crate::research::bases::search::{waveform_grid, Extrema, PvParams};
use anyhow::{anyhow, bail, Result};
use plotters::prelude::*;
use rayon::prelude::*;
use std::path::Path;

const WIDTH: u32 = 1600;
const TOP_HEIGHT: u32 = 640;
const ROW_HEIGHT: u32 = 18;

/// One base, ready to draw: its waveform envelope and its extrema as (m, w_b(m)) points.
struct Curve {
    env: Vec<(f64, f64, f64)>,
    peaks: Vec<(f64, f64)>,
    valleys: Vec<(f64, f64)>,
}

/// Per-column (min, max) of `f` in `cols` equal buckets: (cols, 2) as (x of the bucket centre, min, max).
pub fn envelope(f: &[f64], x0: f64, cols: usize) -> Vec<(f64, f64, f64)> {
    let cols = cols.clamp(1, f.len().max(1));
    let per = f.len().div_ceil(cols).max(1);
    f.chunks(per)
        .enumerate()
        .map(|(c, ch)| {
            let lo = ch.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = ch.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            (x0 + (c * per) as f64 + (ch.len() as f64 - 1.0) / 2.0, lo, hi)
        })
        .collect()
}

/// Axis label for a distance: "40k", "32.5k", or the plain number below 1000.
fn kilo(x: &f64) -> String {
    if x.abs() >= 1000.0 {
        format!("{}k", (x / 100.0).round() / 10.0)
    } else {
        format!("{x}")
    }
}

/// Draw `sets` (head order) into a PNG at `path`: waveform envelopes with peaks (▲) and valleys (●)
/// on top, and below one row per head with its peak and valley distances over the grid.
pub fn plot_waveforms(path: &Path, sets: &[Extrema], p: &PvParams) -> Result<()> {
    crate::plot_font::register()?;
    if sets.is_empty() {
        bail!("nothing to plot: the base set is empty\nhint: pass --heads N with N >= 1");
    }
    let plot_err = |e: String| {
        anyhow!("cannot draw {}: {e}\nhint: check that the directory exists and is writable", path.display())
    };
    let drawn = curves(sets, p);
    let height = TOP_HEIGHT + 120 + ROW_HEIGHT * sets.len() as u32;
    let root = BitMapBackend::new(path, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(e.to_string()))?;
    let (top, bottom) = root.split_vertically(TOP_HEIGHT);
    draw_waveforms(&top, &drawn, p).map_err(|e| plot_err(e.to_string()))?;
    draw_coverage(&bottom, sets, p).map_err(|e| plot_err(e.to_string()))?;
    root.present().map_err(|e| plot_err(e.to_string()))?;
    Ok(())
}

/// Each base's (grid) waveform, kept only as its envelope and its values at the extrema.
fn curves(sets: &[Extrema], p: &PvParams) -> Vec<Curve> {
    sets.par_iter()
        .map(|e| {
            let f = waveform_grid(e.base, p);
            let at = |m: &i64| (*m as f64, f[(m - p.grid_lo) as usize]);
            Curve {
                env: envelope(&f, p.grid_lo as f64, WIDTH as usize),
                peaks: e.peaks.iter().map(at).collect(),
                valleys: e.valleys.iter().map(at).collect(),
            }
        })
        .collect()
}

type Area<DB> = DrawingArea<DB, plotters::coord::Shift>;
type Drawn<DB> = std::result::Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// The top panel: every waveform's envelope with its peaks and valleys.
fn draw_waveforms<DB: DrawingBackend>(top: &Area<DB>, drawn: &[Curve], p: &PvParams) -> Drawn<DB> {
    let (ymin, ymax) = drawn
        .iter()
        .flat_map(|c| c.env.iter())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &(_, lo, hi)| (a.min(lo), b.max(hi)));
    let pad = 0.05 * (ymax - ymin).max(1e-9);
    let n = drawn.len();
    let mut chart = ChartBuilder::on(top)
        .caption(
            format!("RoPE waveforms w_b(m) = (2/sqrt(d)) sum_j cos(m b^(-2j/d)), d = {}, {} bases", p.head_dim, n),
            (crate::plot_font::FAMILY, 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(p.grid_lo as f64..p.grid_hi as f64, (ymin - pad)..(ymax + pad))?;
    chart
        .configure_mesh()
        .x_desc("relative distance m (tokens)")
        .x_label_formatter(&kilo)
        .y_desc("pre-softmax logit, q = k = 1")
        .draw()?;
    for (h, Curve { env, peaks, valleys }) in drawn.iter().enumerate() {
        let color = Palette99::pick(h);
        let zigzag = env.iter().flat_map(|&(x, lo, hi)| [(x, lo), (x, hi)]);
        chart.draw_series(LineSeries::new(zigzag, color.mix(0.35)))?;
        chart.draw_series(peaks.iter().map(|&(x, y)| TriangleMarker::new((x, y), 6, color.filled())))?;
        chart.draw_series(valleys.iter().map(|&(x, y)| Circle::new((x, y), 4, color.filled())))?;
    }
    Ok(())
}

/// The bottom panel: one row per head with its peak and valley distances.
fn draw_coverage<DB: DrawingBackend>(bottom: &Area<DB>, sets: &[Extrema], p: &PvParams) -> Drawn<DB> {
    let n = sets.len();
    let mut cov = ChartBuilder::on(bottom)
        .caption(
            "coverage: peaks (red triangles) and valleys (blue dots) of each head's base",
            (crate::plot_font::FAMILY, 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(110)
        .build_cartesian_2d(p.grid_lo as f64..p.grid_hi as f64, -0.5..(n as f64 - 0.5))?;
    let label = |y: &f64| {
        let h = y.round();
        if (y - h).abs() < 1e-6 && h >= 0.0 && (h as usize) < n {
            format!("h{} {:.2}m", h as usize, sets[h as usize].base / 1e6)
        } else {
            String::new()
        }
    };
    cov.configure_mesh()
        .x_desc("relative distance m (tokens)")
        .x_label_formatter(&kilo)
        .y_labels(n.min(64))
        .y_label_formatter(&label)
        .disable_y_mesh()
        .draw()?;
    for (h, e) in sets.iter().enumerate() {
        let y = h as f64;
        cov.draw_series(LineSeries::new([(p.grid_lo as f64, y), (p.grid_hi as f64, y)], BLACK.mix(0.15)))?;
        cov.draw_series(e.peaks.iter().map(|&m| TriangleMarker::new((m as f64, y), 5, RED.filled())))?;
        cov.draw_series(e.valleys.iter().map(|&m| Circle::new((m as f64, y), 4, BLUE.filled())))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_covers_every_value() {
        let f: Vec<f64> = (0..1000).map(|i| ((i * 7919) % 1000) as f64).collect();
        let env = envelope(&f, 50.0, 7);
        assert_eq!(env.len(), 7);
        let per = 1000usize.div_ceil(7);
        for (c, &(x, lo, hi)) in env.iter().enumerate() {
            let ch = &f[c * per..((c + 1) * per).min(1000)];
            assert_eq!(lo, ch.iter().copied().fold(f64::INFINITY, f64::min));
            assert_eq!(hi, ch.iter().copied().fold(f64::NEG_INFINITY, f64::max));
            assert!(x >= 50.0 + (c * per) as f64 && x <= 50.0 + ((c + 1) * per) as f64);
        }
        // fewer points than columns: one column per point
        assert_eq!(envelope(&[1.0, 2.0], 0.0, 100), vec![(0.0, 1.0, 1.0), (1.0, 2.0, 2.0)]);
    }
}
