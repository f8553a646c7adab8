//! eval-niah's reports: `results.json`, `summary.csv` (task x length, RULER's per-length summaries
//! beside the predictions), the RULER, needle-grid and passkey heatmaps, and the terminal table.
//!
//! Reference: `NVIDIA/RULER:scripts/eval/evaluate.py` (summary layout), Fu et al.'s `visualize.py` (the
//! needle grid's heatmap and title).
//!
//! The non-obvious decision: every report is a function of the scored cells alone, so a rerun that only
//! rescored cached predictions writes the same files.
//! Not here: scoring (`niah_run::score_cell`) or the heatmap drawing itself (`heatmap.rs`).
use crate::eval::heatmap::{self, Heatmap};
use crate::eval::niah_io;
use anyhow::{Context, Result};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Task name of the passkey suite.
pub const PASSKEY: &str = "passkey";
/// Task name of the needle-grid suite.
pub const NEEDLE_GRID: &str = "needle_grid";

/// One scored sample.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SampleResult {
    /// Line in the data file.
    pub line: usize,
    /// The data file's `index`.
    pub index: i64,
    /// Needle depth in percent, when the suite has one.
    pub depth: Option<f64>,
    /// sha256 of the prompt.
    pub prompt_sha256: String,
    /// Raw prediction.
    pub pred: String,
    /// Gold answers.
    pub outputs: Vec<String>,
    /// Score in [0, 1].
    pub score: f64,
    /// Needle grid only: the exact-phrase score.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exact: Option<f64>,
}

/// One scored cell.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CellResult {
    /// Task name.
    pub task: String,
    /// Length.
    pub length: usize,
    /// RULER-style score: `round(100 * mean, 2)`.
    pub score: f64,
    /// Predictions that are empty after postprocessing.
    pub nulls: usize,
    /// The samples.
    pub samples: Vec<SampleResult>,
}

fn is_ruler_task(task: &str) -> bool {
    task != PASSKEY && task != NEEDLE_GRID
}

/// The overall `summary.csv`: one row per task, one column per length, then the mean; plus a
/// `niah_average` row (unweighted mean of the NIAH tasks at each length, as HARPE's table).
pub fn summary_csv(results: &[CellResult]) -> String {
    let lengths: BTreeSet<usize> = results.iter().map(|r| r.length).collect();
    let mut tasks: Vec<&str> = Vec::new();
    for r in results {
        if !tasks.contains(&r.task.as_str()) {
            tasks.push(&r.task);
        }
    }
    let get = |t: &str, l: usize| results.iter().find(|r| r.task == t && r.length == l).map(|r| r.score);
    let mut s = format!("task,{},mean\n", lengths.iter().map(usize::to_string).collect::<Vec<_>>().join(","));
    let mut row = |name: &str, vals: Vec<Option<f64>>| {
        let present: Vec<f64> = vals.iter().flatten().copied().collect();
        let mean = if present.is_empty() {
            String::new()
        } else {
            format!("{:.2}", present.iter().sum::<f64>() / present.len() as f64)
        };
        let cols: Vec<String> = vals.iter().map(|v| v.map_or(String::new(), |x| format!("{x:.2}"))).collect();
        s.push_str(&format!("{name},{},{mean}\n", cols.join(",")));
    };
    for t in &tasks {
        row(t, lengths.iter().map(|&l| get(t, l)).collect());
    }
    let niah: Vec<&str> = tasks.iter().copied().filter(|t| t.starts_with("niah_")).collect();
    if niah.len() > 1 {
        let avg = lengths
            .iter()
            .map(|&l| {
                let v: Vec<f64> = niah.iter().filter_map(|t| get(t, l)).collect();
                (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
            })
            .collect();
        row("niah_average", avg);
    }
    s
}

/// Write `results.json`, `summary.csv`, RULER's per-length `pred/summary.csv` and the heatmaps.
/// Returns the paths written.
pub fn write_reports(results: &[CellResult], out: &Path, model_name: &str) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let results_path = out.join("results.json");
    let json = serde_json::json!({
        "format": "harpe-eval-niah-v1",
        "model": model_name,
        "cells": results,
    });
    let text = serde_json::to_string_pretty(&json).context("cannot serialise results")?;
    crate::util::write_atomic(&results_path, text.as_bytes())?;
    written.push(results_path);
    let summary = out.join("summary.csv");
    crate::util::write_atomic(&summary, summary_csv(results).as_bytes())?;
    written.push(summary);
    written.extend(write_ruler_summaries(results, out)?);
    written.extend(write_ruler_heatmap(results, out, model_name)?);
    for (task, title, file) in [
        (
            NEEDLE_GRID,
            format!("Pressure Testing {model_name}\nFact Retrieval Across Context Lengths (\"Needle In A HayStack\")"),
            "needle_grid.png",
        ),
        (PASSKEY, format!("Passkey retrieval: {model_name}"), "passkey.png"),
    ] {
        let cells: Vec<&CellResult> = results.iter().filter(|r| r.task == task).collect();
        if cells.is_empty() {
            continue;
        }
        let p = out.join(file);
        draw_depth_heatmap(&cells, title, &p)?;
        written.push(p);
    }
    Ok(written)
}

/// RULER's own summary per length (RULER tasks only), beside the predictions; the paths written.
fn write_ruler_summaries(results: &[CellResult], out: &Path) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let lengths: BTreeSet<usize> = results.iter().map(|r| r.length).collect();
    for &l in &lengths {
        let rows: Vec<(String, f64, usize, usize)> = results
            .iter()
            .filter(|r| r.length == l && is_ruler_task(&r.task))
            .map(|r| (r.task.clone(), r.score, r.nulls, r.samples.len()))
            .collect();
        if rows.is_empty() {
            continue;
        }
        let name = if rows.len() > 1 { "summary.csv".to_string() } else { format!("summary-{}.csv", rows[0].0) };
        let p = out.join(l.to_string()).join("pred").join(name);
        crate::util::write_atomic(&p, niah_io::ruler_summary_csv(&rows).as_bytes())?;
        written.push(p);
    }
    Ok(written)
}

/// `ruler_heatmap.png`: RULER task x length scores, when there are RULER cells; the path written.
fn write_ruler_heatmap(results: &[CellResult], out: &Path, model_name: &str) -> Result<Option<PathBuf>> {
    let ruler: Vec<&CellResult> = results.iter().filter(|r| is_ruler_task(&r.task)).collect();
    if ruler.is_empty() {
        return Ok(None);
    }
    let lens: Vec<usize> = ruler.iter().map(|r| r.length).collect::<BTreeSet<_>>().into_iter().collect();
    let mut tasks: Vec<&str> = Vec::new();
    for r in &ruler {
        if !tasks.contains(&r.task.as_str()) {
            tasks.push(&r.task);
        }
    }
    let values = tasks
        .iter()
        .map(|t| {
            lens.iter()
                .map(|&l| ruler.iter().find(|r| r.task == *t && r.length == l).map(|r| r.score / 100.0))
                .collect()
        })
        .collect();
    let p = out.join("ruler_heatmap.png");
    heatmap::draw(
        &Heatmap {
            title: format!("RULER needle tasks: {model_name}"),
            x_label: "Token Limit".into(),
            y_label: "Task".into(),
            x_ticks: lens.iter().map(usize::to_string).collect(),
            y_ticks: tasks.iter().map(|t| t.to_string()).collect(),
            values,
            marker_col: None,
        },
        &p,
    )?;
    Ok(Some(p))
}

/// A depth x length heatmap of one suite's cells (needle grid, passkey): the mean score per depth and length.
fn draw_depth_heatmap(cells: &[&CellResult], title: String, p: &Path) -> Result<()> {
    let lens: Vec<usize> = cells.iter().map(|r| r.length).collect::<BTreeSet<_>>().into_iter().collect();
    let mut depths: Vec<f64> = cells.iter().flat_map(|c| c.samples.iter().filter_map(|s| s.depth)).collect();
    depths.sort_by(f64::total_cmp);
    depths.dedup();
    let values = depths
        .iter()
        .map(|&d| {
            lens.iter()
                .map(|&l| {
                    let v: Vec<f64> = cells
                        .iter()
                        .filter(|c| c.length == l)
                        .flat_map(|c| c.samples.iter().filter(|s| s.depth == Some(d)).map(|s| s.score))
                        .collect();
                    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
                })
                .collect()
        })
        .collect();
    heatmap::draw(
        &Heatmap {
            title,
            x_label: "Token Limit".into(),
            y_label: "Depth Percent".into(),
            x_ticks: lens.iter().map(usize::to_string).collect(),
            y_ticks: depths.iter().map(|d| format!("{d:.0}")).collect(),
            values,
            marker_col: None,
        },
        p,
    )
}

/// A plain-text table of the summary for the terminal.
pub fn summary_table(results: &[CellResult]) -> String {
    let csv = summary_csv(results);
    let rows: Vec<Vec<&str>> = csv.lines().map(|l| l.split(',').collect()).collect();
    let ncol = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> =
        (0..ncol).map(|c| rows.iter().map(|r| r.get(c).map_or(0, |x| x.len())).max().unwrap_or(0)).collect();
    let mut s = String::new();
    for r in &rows {
        let cols: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(c, x)| if c == 0 { format!("{x:<w$}", w = widths[c]) } else { format!("{x:>w$}", w = widths[c]) })
            .collect();
        s.push_str(cols.join("  ").trim_end());
        s.push('\n');
    }
    s
}
