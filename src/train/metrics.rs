//! Training metrics: one JSON object per optimizer step in `metrics.jsonl` (plus one per evaluation
//! during training, told apart by its `eval` key), the console step line, process memory from /proc,
//! the loss-curve PNG drawn at the end and the evaluation PNG.
//!
//! Reference: nanoGPT's step line; PaLM appendix B for MFU (model FLOPs = 6 N + 12 L C T per token,
//! counted without the activation recompute). The non-obvious decision: memory is measured, not
//! estimated: the peak resident set of each step is read from /proc/self/status (VmHWM) after resetting
//! it through /proc/self/clear_refs at the start of the step, so `step_peak_bytes` is the real extra
//! memory a step needed. On systems without /proc these read as 0.
//! A failed write of `metrics.jsonl` (a full disk, a quota, an I/O error) does not stop training: the
//! log says so once on stderr, cuts the file back to its last whole line and writes no more lines this
//! session. The rule: only what a resume needs (checkpoints) may stop a run; the log is a record, and a
//! later `--resume` rewrites it from the lines up to its checkpoint. TensorBoard's event file
//! (`tensorboard.rs`) follows the same rule.
//! What this file does not do: aggregate across ranks (the loop reduces before logging).
use anyhow::{anyhow, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::Path;

/// One optimizer step as written to `metrics.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    pub stage: usize,
    pub seq_len: usize,
    /// token-mean cross-entropy of the step (all micro-batches); NaN/inf are written as null
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    /// global gradient norm before clipping
    #[serde(deserialize_with = "nan_if_null")]
    pub grad_norm: f64,
    pub lr: f64,
    /// target tokens in this step
    pub tokens: u64,
    pub tokens_seen: u64,
    pub tokens_per_s: f64,
    /// achieved model TFLOP/s (6N + 12 L C T per token, no recompute)
    pub tflops: f64,
    /// model FLOPs utilization against `log.peak_tflops`, when that is set
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    /// resident memory at the end of the step
    pub rss_bytes: u64,
    /// peak resident memory during the step
    pub step_peak_bytes: u64,
    /// resident memory when the step started
    pub step_start_bytes: u64,
    /// peak device memory allocated during the step (CUDA: the memory pool's high-water mark), the
    /// largest over the ranks; absent on the CPU
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_peak_bytes: Option<u64>,
    /// peak device memory the pool reserved during the step (allocated plus its free fragments: what the
    /// device could not give to anything else), the largest over the ranks; absent on the CPU
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_reserved_peak_bytes: Option<u64>,
    /// every rank's (allocated, reserved) device peak of the step, in rank order; absent on the CPU
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_peaks_by_rank: Vec<(u64, u64)>,
    /// true when the step was skipped for a NaN/inf loss or gradient
    pub skipped: bool,
    /// token-mean loss per data source, when the data carries source labels
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty", deserialize_with = "nan_map_if_null")]
    pub per_source: BTreeMap<String, f64>,
    pub elapsed_s: f64,
}

/// JSON has no NaN: serde_json writes non-finite floats as null, read back as NaN.
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

fn nan_map_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<BTreeMap<String, f64>, D::Error> {
    let m = BTreeMap::<String, Option<f64>>::deserialize(d)?;
    Ok(m.into_iter().map(|(k, v)| (k, v.unwrap_or(f64::NAN))).collect())
}

/// The console line of one step.
pub fn step_line(r: &StepRecord, total_steps: u64) -> String {
    let mfu = r.mfu.map(|m| format!(" mfu {:.1}%", 100.0 * m)).unwrap_or_default();
    let skip = if r.skipped { " SKIPPED (non-finite)" } else { "" };
    let dev = match (r.device_peak_bytes, r.device_reserved_peak_bytes) {
        (Some(a), Some(res)) => {
            format!(" | device peak {} (reserved {})", crate::util::human_bytes(a), crate::util::human_bytes(res))
        }
        _ => String::new(),
    };
    format!(
        "step {:>6}/{total_steps} | stage {} T={} | loss {:.4} | gnorm {:.3} | lr {:.3e} | {:.0} tok/s | {:.3} TFLOP/s{mfu} | mem {} (step peak {}){dev}{skip}",
        r.step,
        r.stage,
        r.seq_len,
        r.loss,
        r.grad_norm,
        r.lr,
        r.tokens_per_s,
        r.tflops,
        crate::util::human_bytes(r.rss_bytes),
        crate::util::human_bytes(r.step_peak_bytes),
    )
}

/// Appends records to `metrics.jsonl`, one line each, flushed per step.
pub struct MetricsLog {
    out: crate::util::AppendFile,
}

impl MetricsLog {
    /// Open for appending, keeping only lines with `step <= keep_upto` (the ones before a resume point;
    /// later ones are replayed by the resumed run). Step and evaluation lines are kept verbatim.
    pub fn open(path: &Path, keep_upto: u64) -> Result<MetricsLog> {
        let mut text = String::new();
        if path.exists() {
            for (i, line) in read_lines(path)? {
                let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| damaged(path, i, &e))?;
                let step = v.get("step").and_then(|s| s.as_u64()).ok_or_else(|| {
                    anyhow!(
                        "{}:{i}: no integer `step`\nhint: the metrics file is damaged; delete the bad line",
                        path.display()
                    )
                })?;
                if step <= keep_upto {
                    text.push_str(&line);
                    text.push('\n');
                }
            }
        }
        crate::util::write_atomic(path, text.as_bytes())?;
        let file = std::fs::OpenOptions::new().append(true).open(path).with_context(|| {
            format!("cannot open {} for appending\nhint: check that the run directory is writable", path.display())
        })?;
        Ok(MetricsLog { out: crate::util::AppendFile::new(file, path.to_path_buf(), text.len() as u64) })
    }

    /// Append one step record.
    pub fn write(&mut self, r: &StepRecord) -> Result<()> {
        self.write_line(&serde_json::to_string(r)?)
    }

    /// Append one evaluation record.
    pub fn write_eval(&mut self, r: &EvalRecord) -> Result<()> {
        self.write_line(&serde_json::to_string(r)?)
    }

    fn write_line(&mut self, line: &str) -> Result<()> {
        self.out.append(
            format!("{line}\n").as_bytes(),
            "training goes on, with no more metrics lines this session\nhint: free disk space; a later --resume rewrites the file from the lines up to its checkpoint",
        );
        Ok(())
    }

    /// Whether a write failed (no more lines are written this session).
    pub fn failed(&self) -> bool {
        self.out.failed()
    }
}

/// One evaluation during training, a line of `metrics.jsonl` beside the step lines:
/// `{"step": N, "stage": S, "eval": {...}}` (readers tell the two apart by the `eval` key).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    /// optimizer steps done when the weights were evaluated
    pub step: u64,
    pub stage: usize,
    pub eval: EvalResults,
}

/// The configured parts of one evaluation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EvalResults {
    /// sliding-window perplexity of `[eval] ppl_inputs` (token-weighted, as `eval-ppl`)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ppl: Option<PplSummary>,
    /// passkey accuracy in percent by length in tokens
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub passkey: BTreeMap<String, f64>,
    /// mean loss of `[eval] loss_data` by position bucket ("0-4K", ...)
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty", deserialize_with = "nan_map_if_null")]
    pub loss_by_bucket: BTreeMap<String, f64>,
    /// `[eval] tasks` on the final weights: task -> harness metric key (`acc,none`, ...) -> value
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tasks: BTreeMap<String, BTreeMap<String, f64>>,
}

/// `eval-ppl`'s headline numbers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PplSummary {
    #[serde(deserialize_with = "nan_if_null")]
    pub nll: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub ppl: f64,
    pub tokens: usize,
}

fn damaged(path: &Path, line: usize, e: &dyn std::fmt::Display) -> anyhow::Error {
    anyhow!("{}:{line}: {e}\nhint: the metrics file is damaged; delete the bad line", path.display())
}

/// Non-empty lines of a file with their 1-based numbers.
fn read_lines(path: &Path) -> Result<Vec<(usize, String)>> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut out = vec![];
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.with_context(|| format!("{}:{}: cannot read", path.display(), i + 1))?;
        if !line.trim().is_empty() {
            out.push((i + 1, line));
        }
    }
    Ok(out)
}

/// Whether a metrics line is an evaluation line (the one rule readers use to tell lines apart).
pub fn is_eval_line(line: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(line).is_ok_and(|v| v.get("eval").is_some())
}

/// Read every step record of a `metrics.jsonl` (evaluation lines are skipped).
pub fn read_records(path: &Path) -> Result<Vec<StepRecord>> {
    let mut out = vec![];
    for (i, line) in read_lines(path)? {
        if !is_eval_line(&line) {
            out.push(serde_json::from_str(&line).map_err(|e| damaged(path, i, &e))?);
        }
    }
    Ok(out)
}

/// Read every evaluation record of a `metrics.jsonl` (step lines are skipped).
pub fn read_evals(path: &Path) -> Result<Vec<EvalRecord>> {
    let mut out = vec![];
    for (i, line) in read_lines(path)? {
        if is_eval_line(&line) {
            out.push(serde_json::from_str(&line).map_err(|e| damaged(path, i, &e))?);
        }
    }
    Ok(out)
}

/// Process memory from /proc (Linux); zeros elsewhere.
pub mod mem {
    fn status_kb(key: &str) -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with(key))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse().ok())
            })
            .unwrap_or(0)
    }

    /// Current resident set size in bytes.
    pub fn rss_bytes() -> u64 {
        status_kb("VmRSS:") * 1024
    }

    /// Peak resident set size since the last `reset_peak` (or process start), in bytes.
    pub fn peak_bytes() -> u64 {
        status_kb("VmHWM:") * 1024
    }

    /// Reset the peak to the current RSS (writes 5 to /proc/self/clear_refs); false when not possible.
    pub fn reset_peak() -> bool {
        std::fs::write("/proc/self/clear_refs", "5").is_ok()
    }
}

/// Draw loss against step (one series per stage) into a PNG.
pub fn plot_loss(records: &[StepRecord], path: &Path, title: &str) -> Result<()> {
    crate::plot_font::register()?;
    use plotters::prelude::*;
    let pts: Vec<&StepRecord> = records.iter().filter(|r| !r.skipped && r.loss.is_finite()).collect();
    if pts.is_empty() {
        return Ok(());
    }
    let (x0, x1) = (pts[0].step as f64, pts[pts.len() - 1].step as f64);
    let lo = pts.iter().map(|r| r.loss).fold(f64::INFINITY, f64::min);
    let hi = pts.iter().map(|r| r.loss).fold(f64::NEG_INFINITY, f64::max);
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let err = |e: &dyn std::fmt::Display| {
        anyhow!(
            "drawing {} failed: {e}\nhint: check that the directory is writable and the disk not full",
            path.display()
        )
    };
    let root = BitMapBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (crate::plot_font::FAMILY, 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1.max(x0 + 1.0), (lo - pad)..(hi + pad))
        .map_err(|e| err(&e))?;
    chart.configure_mesh().x_desc("optimizer step").y_desc("train loss").draw().map_err(|e| err(&e))?;
    let stages: std::collections::BTreeSet<usize> = pts.iter().map(|r| r.stage).collect();
    for (k, s) in stages.into_iter().enumerate() {
        let color = Palette99::pick(k).to_rgba();
        let series: Vec<(f64, f64)> = pts.iter().filter(|r| r.stage == s).map(|r| (r.step as f64, r.loss)).collect();
        let t = pts.iter().find(|r| r.stage == s).map(|r| r.seq_len).unwrap_or(0);
        chart
            .draw_series(LineSeries::new(series, color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(format!("stage {s} (T={t})"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Draw the evaluations over steps into a PNG: NLLs (perplexity inputs, loss buckets) on the left,
/// passkey accuracy on the right; a panel with nothing to show is left out.
pub fn plot_evals(records: &[EvalRecord], path: &Path) -> Result<()> {
    crate::plot_font::register()?;
    use plotters::prelude::*;
    type Series = BTreeMap<String, Vec<(f64, f64)>>;
    let (mut nll, mut acc): (Series, Series) = Default::default();
    for r in records {
        let x = r.step as f64;
        if let Some(p) = r.eval.ppl.as_ref().filter(|p| p.nll.is_finite()) {
            nll.entry("ppl inputs (nll)".into()).or_default().push((x, p.nll));
        }
        for (b, v) in r.eval.loss_by_bucket.iter().filter(|(_, v)| v.is_finite()) {
            nll.entry(format!("loss {b}")).or_default().push((x, *v));
        }
        for (l, v) in &r.eval.passkey {
            acc.entry(format!("passkey {l}")).or_default().push((x, *v));
        }
    }
    let panels: Vec<(&str, Series)> =
        [("nll", nll), ("passkey accuracy %", acc)].into_iter().filter(|(_, s)| !s.is_empty()).collect();
    if panels.is_empty() {
        return Ok(());
    }
    let err = |e: &dyn std::fmt::Display| {
        anyhow!(
            "drawing {} failed: {e}\nhint: check that the directory is writable and the disk not full",
            path.display()
        )
    };
    let root = BitMapBackend::new(path, (600 * panels.len() as u32, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let areas = root.split_evenly((1, panels.len()));
    for ((desc, series), area) in panels.iter().zip(&areas) {
        let pts = series.values().flatten();
        let (x0, x1) = pts.clone().fold((f64::INFINITY, f64::NEG_INFINITY), |a, p| (a.0.min(p.0), a.1.max(p.0)));
        let (lo, hi) = pts.fold((f64::INFINITY, f64::NEG_INFINITY), |a, p| (a.0.min(p.1), a.1.max(p.1)));
        let pad = ((hi - lo) * 0.05).max(1e-3);
        let mut chart = ChartBuilder::on(area)
            .caption(format!("harpe train: eval {desc}"), (crate::plot_font::FAMILY, 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1.max(x0 + 1.0), (lo - pad)..(hi + pad))
            .map_err(|e| err(&e))?;
        chart.configure_mesh().x_desc("optimizer step").y_desc(*desc).draw().map_err(|e| err(&e))?;
        for (k, (name, pts)) in series.iter().enumerate() {
            let color = Palette99::pick(k).to_rgba();
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(step: u64, loss: f64) -> StepRecord {
        StepRecord {
            step,
            stage: (step > 2) as usize,
            seq_len: 64,
            loss,
            grad_norm: 1.0,
            lr: 1e-3,
            tokens: 64,
            tokens_seen: 64 * step,
            tokens_per_s: 100.0,
            tflops: 0.1,
            mfu: None,
            rss_bytes: 1 << 20,
            step_peak_bytes: 1 << 20,
            device_peak_bytes: None,
            device_reserved_peak_bytes: None,
            device_peaks_by_rank: vec![],
            step_start_bytes: 1 << 19,
            skipped: false,
            per_source: BTreeMap::new(),
            elapsed_s: 0.1,
        }
    }

    #[test]
    fn log_truncates_on_resume_and_plot_writes_a_png() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("metrics.jsonl");
        let mut log = MetricsLog::open(&p, 0).unwrap();
        for s in 1..=4 {
            log.write(&rec(s, 5.0 - s as f64)).unwrap();
        }
        drop(log);
        let mut log = MetricsLog::open(&p, 2).unwrap();
        log.write(&rec(3, 1.5)).unwrap();
        let r = read_records(&p).unwrap();
        assert_eq!(r.iter().map(|r| (r.step, r.loss)).collect::<Vec<_>>(), vec![(1, 4.0), (2, 3.0), (3, 1.5)]);
        let png = d.path().join("loss.png");
        plot_loss(&r, &png, "test").unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(mem::rss_bytes() > 0);
    }
}
