//! The conventional needle-in-a-haystack heatmap as a PNG: rows (depth or task) top to bottom,
//! context lengths left to right, red -> amber -> green for 0 -> 0.5 -> 1.
//!
//! Reference: gkamradt `viz/CreateVizFromLLMTesting.ipynb` and Fu et al. `eval/needle/visualize.py`
//! (seaborn heatmap, colormap `#F0496E -> #EBB839 -> #0CD79F`, vmin 0, vmax 1, grey grid lines).
//!
//! The non-obvious decision: cells are drawn directly on a plotters drawing area (rectangles and
//! text) instead of through a chart with axes, which keeps categorical ticks and the optional
//! training-length marker exact. Each cell also prints its value, so the PNG is readable in grey.
//! Not here: seaborn's automatic figure sizing; any interactive output.

use anyhow::{Context, Result};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;

/// What to draw.
pub struct Heatmap {
    /// Title (may hold one `\n`).
    pub title: String,
    /// Label under the x axis.
    pub x_label: String,
    /// Label left of the y axis.
    pub y_label: String,
    /// Column labels, left to right.
    pub x_ticks: Vec<String>,
    /// Row labels, top to bottom.
    pub y_ticks: Vec<String>,
    /// `values[row][col]` in [0, 1]; `None` is drawn grey (not run).
    pub values: Vec<Vec<Option<f64>>>,
    /// Draw a white dashed line left of this column (the first length beyond training), if any.
    pub marker_col: Option<usize>,
}

fn lerp(a: (u8, u8, u8), b: (u8, u8, u8), t: f64) -> RGBColor {
    let f = |x: u8, y: u8| (x as f64 + (y as f64 - x as f64) * t).round() as u8;
    RGBColor(f(a.0, b.0), f(a.1, b.1), f(a.2, b.2))
}

/// The 3-stop colormap at `v` in [0, 1].
pub fn color(v: f64) -> RGBColor {
    let (red, amber, green) = ((0xF0, 0x49, 0x6E), (0xEB, 0xB8, 0x39), (0x0C, 0xD7, 0x9F));
    let v = v.clamp(0.0, 1.0);
    if v < 0.5 {
        lerp(red, amber, v * 2.0)
    } else {
        lerp(amber, green, (v - 0.5) * 2.0)
    }
}

/// Where things go on the canvas (pixels).
struct Layout {
    rows: usize,
    cols: usize,
    left: i32,
    top: i32,
    cell_w: i32,
    cell_h: i32,
    width: u32,
    height: u32,
}

impl Layout {
    fn of(h: &Heatmap) -> Layout {
        let rows = h.y_ticks.len().max(1);
        let cols = h.x_ticks.len().max(1);
        let (left, right, top, bottom) = (150i32, 130i32, 90i32, 110i32);
        let cell_w = (1100 / cols as i32).clamp(40, 120);
        let cell_h = (560 / rows as i32).clamp(24, 60);
        Layout {
            rows,
            cols,
            left,
            top,
            cell_w,
            cell_h,
            // at least wide enough for the two-line title
            width: ((left + right + cell_w * cols as i32) as u32).max(900),
            height: (top + bottom + cell_h * rows as i32) as u32,
        }
    }

    fn grid_bottom(&self) -> i32 {
        self.top + self.rows as i32 * self.cell_h
    }
}

type Area<DB> = DrawingArea<DB, plotters::coord::Shift>;
type Drawn<DB> = std::result::Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

fn font(size: f64) -> FontDesc<'static> {
    (crate::plot_font::FAMILY, size).into_font()
}

/// Render `h` to a PNG at `path`.
pub fn draw(h: &Heatmap, path: &Path) -> Result<()> {
    crate::plot_font::register()?;
    let lay = Layout::of(h);
    let err = |e: &dyn std::fmt::Display| {
        anyhow::anyhow!("cannot draw heatmap {}: {e}\nhint: check that the directory is writable", path.display())
    };
    {
        let root = BitMapBackend::new(path, (lay.width, lay.height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        for (i, line) in h.title.lines().enumerate() {
            let style = font(20.0).color(&BLACK).pos(Pos::new(HPos::Center, VPos::Top));
            root.draw_text(line, &style, (lay.width as i32 / 2, 12 + 24 * i as i32)).map_err(|e| err(&e))?;
        }
        draw_cells(&root, h, &lay).map_err(|e| err(&e))?;
        draw_axes(&root, h, &lay).map_err(|e| err(&e))?;
        draw_colour_bar(&root, &lay).map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    std::fs::metadata(path).with_context(|| format!("heatmap {} was not written", path.display()))?;
    Ok(())
}

/// The cells: colour, grey border, the value in percent (`-` for a cell not run).
fn draw_cells<DB: DrawingBackend>(root: &Area<DB>, h: &Heatmap, lay: &Layout) -> Drawn<DB> {
    for (r, row) in h.values.iter().enumerate() {
        for c in 0..lay.cols {
            let v = row.get(c).copied().flatten();
            let x0 = lay.left + c as i32 * lay.cell_w;
            let y0 = lay.top + r as i32 * lay.cell_h;
            let corners = [(x0, y0), (x0 + lay.cell_w, y0 + lay.cell_h)];
            let fill = v.map_or(RGBColor(0xDD, 0xDD, 0xDD), color);
            root.draw(&Rectangle::new(corners, fill.filled()))?;
            root.draw(&Rectangle::new(corners, RGBColor(0x80, 0x80, 0x80).stroke_width(1)))?;
            let label = v.map_or("-".to_string(), |v| format!("{:.0}", v * 100.0));
            let style = font(13.0).color(&BLACK).pos(Pos::new(HPos::Center, VPos::Center));
            root.draw_text(&label, &style, (x0 + lay.cell_w / 2, y0 + lay.cell_h / 2))?;
        }
    }
    Ok(())
}

/// Tick labels, axis labels and the dashed training-length marker.
fn draw_axes<DB: DrawingBackend>(root: &Area<DB>, h: &Heatmap, lay: &Layout) -> Drawn<DB> {
    let (left, top, cell_w, cell_h) = (lay.left, lay.top, lay.cell_w, lay.cell_h);
    for (r, t) in h.y_ticks.iter().enumerate() {
        let style = font(13.0).color(&BLACK).pos(Pos::new(HPos::Right, VPos::Center));
        root.draw_text(t, &style, (left - 8, top + r as i32 * cell_h + cell_h / 2))?;
    }
    let grid_bottom = lay.grid_bottom();
    for (c, t) in h.x_ticks.iter().enumerate() {
        let style =
            font(13.0).transform(FontTransform::Rotate270).color(&BLACK).pos(Pos::new(HPos::Right, VPos::Center));
        root.draw_text(t, &style, (left + c as i32 * cell_w + cell_w / 2, grid_bottom + 8))?;
    }
    let style = font(16.0).color(&BLACK).pos(Pos::new(HPos::Center, VPos::Bottom));
    root.draw_text(&h.x_label, &style, (left + lay.cols as i32 * cell_w / 2, lay.height as i32 - 8))?;
    let style = font(16.0).transform(FontTransform::Rotate270).color(&BLACK).pos(Pos::new(HPos::Center, VPos::Top));
    root.draw_text(&h.y_label, &style, (10, top + lay.rows as i32 * cell_h / 2))?;
    if let Some(mc) = h.marker_col.filter(|&c| c < lay.cols) {
        let x = left + mc as i32 * cell_w;
        let mut y = top;
        while y < grid_bottom {
            let y1 = (y + 10).min(grid_bottom);
            root.draw(&PathElement::new(vec![(x, y), (x, y1)], WHITE.stroke_width(4)))?;
            y += 18;
        }
    }
    Ok(())
}

/// The colour bar 0..1 right of the grid.
fn draw_colour_bar<DB: DrawingBackend>(root: &Area<DB>, lay: &Layout) -> Drawn<DB> {
    let bx = lay.left + lay.cols as i32 * lay.cell_w + 40;
    let steps = 50;
    let bar_h = lay.rows as i32 * lay.cell_h;
    let top = lay.top;
    for i in 0..steps {
        let v = 1.0 - i as f64 / (steps - 1) as f64;
        let y0 = top + bar_h * i / steps;
        let y1 = top + bar_h * (i + 1) / steps;
        root.draw(&Rectangle::new([(bx, y0), (bx + 20, y1)], color(v).filled()))?;
    }
    for (v, y) in [(1.0, top), (0.5, top + bar_h / 2), (0.0, top + bar_h)] {
        let style = font(12.0).color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center));
        root.draw_text(&format!("{v:.1}"), &style, (bx + 26, y))?;
    }
    Ok(())
}
