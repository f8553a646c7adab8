//! `harpe report`: one table per sweep (or any run directories) — final metrics and evaluation scores per
//! arm as mean ± std over seeds with n, paired differences against a baseline arm with 95% intervals,
//! per-length retrieval curves, the loss curves of all runs, and the cost of each arm.
//! Markdown + CSV + PNG + JSON.
//!
//! Why: a single run per arm cannot separate a schedule's effect from seed noise, so a fair comparison
//! needs several schedules and seeds with means and deviations;
//! statistics in `stats.rs`.
//! The non-obvious decisions:
//! - Differences are paired by seed (run k of an arm against run k of the baseline: same data order and
//!   initialization), which removes the seed-to-seed noise that both arms share; an arm's seeds without
//!   a baseline partner are left out of its difference, and n says how many pairs there are.
//! - Runs are comparable only with identical evaluation settings (from each run's `sweep-run.json`); a
//!   mix is an error that names two directories, never a silently mixed table.
//! - `train_loss` is the mean training loss of the last 10 logged steps (one step is too noisy); the cost
//!   is tokens seen and the summed step times from `metrics.jsonl` (so resumed runs count once).
//!
//! Not here: running anything (the sweep does), significance tests across many metrics.
use crate::research::stats::{paired_diff, summarize, IntervalMethod, PairedDiff, Summary};
use crate::research::sweep::{read_marker, EvalSpec, RunState, SweepIndex};
use crate::train::metrics::read_records;
use crate::train::RunDir;
use crate::util::human_count;
use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Tabulate runs: per-arm means and deviations over seeds, paired differences, curves, cost.
#[derive(clap::Args, Debug, Clone)]
pub struct ReportArgs {
    /// sweep directories (with sweep.json) and/or run directories (with sweep-run.json or metrics.jsonl)
    #[arg(required = true, value_name = "RUN_OR_SWEEP_DIR")]
    pub dirs: Vec<PathBuf>,
    /// arm the others are compared with (paired by seed) [default: the first arm]
    #[arg(long)]
    pub baseline: Option<String>,
    /// where report.md, report.csv, report.json and the PNGs go [default: the first directory]
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// 95% intervals from N bootstrap resamples of the paired differences instead of Student's t
    #[arg(long, value_name = "N")]
    pub bootstrap: Option<usize>,
    /// print report.json on stdout instead of the Markdown
    #[arg(long)]
    pub json: bool,
}

/// Everything the report knows about one run.
#[derive(Clone, Debug, Serialize)]
pub struct RunData {
    pub dir: PathBuf,
    pub arm: String,
    pub seed: u64,
    /// metric -> value (train_loss, eval metrics, cost:tokens, cost:train_s)
    pub metrics: BTreeMap<String, f64>,
    /// (tokens seen, loss) per logged step
    #[serde(skip)]
    pub curve: Vec<(f64, f64)>,
    #[serde(skip)]
    eval: Option<EvalSpec>,
}

/// One arm's row.
#[derive(Clone, Debug, Serialize)]
pub struct ArmStats {
    pub arm: String,
    pub seeds: Vec<u64>,
    pub metrics: BTreeMap<String, Summary>,
    /// metric -> difference to the baseline (absent for the baseline itself)
    pub diff: BTreeMap<String, PairedDiff>,
}

/// The whole report (`report.json`).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub baseline: String,
    pub interval: IntervalMethod,
    pub metrics: Vec<String>,
    pub arms: Vec<ArmStats>,
    pub runs: Vec<RunData>,
}

/// The seed of a plain `harpe train` run directory (its config.toml's train.seed).
fn plain_seed(dir: &Path) -> Result<u64> {
    let p = RunDir::new(dir).config();
    let text = std::fs::read_to_string(&p).with_context(|| {
        format!("{}: neither sweep.json, sweep-run.json nor config.toml\nhint: pass a sweep directory or a run directory of harpe train", dir.display())
    })?;
    let v: toml::Table = text.parse().map_err(|e| anyhow!("{}: {e}\nhint: the file is damaged", p.display()))?;
    Ok(v.get("train").and_then(|t| t.get("seed")).and_then(|s| s.as_integer()).unwrap_or(0) as u64)
}

/// Read one run directory.
pub fn load_run(dir: &Path) -> Result<RunData> {
    let (arm, seed, eval) = if RunDir::new(dir).sweep_marker().exists() {
        let m = read_marker(dir)?;
        (m.arm, m.seed, Some(m.eval))
    } else {
        let arm = dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "run".into());
        (arm, plain_seed(dir)?, None)
    };
    let mpath = RunDir::new(dir).metrics();
    let recs = read_records(&mpath)
        .with_context(|| format!("{}: no training log\nhint: has this run started training?", dir.display()))?;
    let good: Vec<_> = recs.iter().filter(|r| !r.skipped && r.loss.is_finite()).collect();
    if good.is_empty() {
        bail!("{}: metrics.jsonl has no finite step\nhint: the run has not trained yet (or diverged)", mpath.display());
    }
    let mut metrics = BTreeMap::new();
    let last = &good[good.len().saturating_sub(10)..];
    metrics.insert("train_loss".into(), last.iter().map(|r| r.loss).sum::<f64>() / last.len() as f64);
    metrics.insert("cost:tokens".into(), recs.last().map_or(0.0, |r| r.tokens_seen as f64));
    let secs: f64 = recs.iter().filter(|r| r.tokens_per_s > 0.0).map(|r| r.tokens as f64 / r.tokens_per_s).sum();
    metrics.insert("cost:train_s".into(), secs);
    if let Some(ev) = &eval {
        if *ev != EvalSpec::default() {
            let p = RunDir::new(dir).eval_summary();
            let text = std::fs::read_to_string(&p).with_context(|| {
                format!("{}: not evaluated yet\nhint: rerun the sweep to finish its evaluation", dir.display())
            })?;
            let m: BTreeMap<String, f64> = serde_json::from_str(&text)
                .map_err(|e| anyhow!("{}: {e}\nhint: remove it and rerun the sweep", p.display()))?;
            metrics.extend(m);
        }
    }
    metrics.extend(eval_task_metrics(dir)?);
    let curve = good.iter().map(|r| (r.tokens_seen as f64, r.loss)).collect();
    Ok(RunData { dir: dir.to_path_buf(), arm, seed, metrics, curve, eval })
}

/// `harpe eval-tasks` scores of a run as `task:metric` (`mmlu:acc`, `hellaswag:acc_norm`,
/// `triviaqa:exact_match`): from `RUN_DIR/eval-tasks/results.json` when present, else from the last
/// `[eval] tasks` line of metrics.jsonl. MMLU's subjects and categories are left to results.json when the
/// `mmlu` group is there (57 columns would bury the table).
pub fn eval_task_metrics(dir: &Path) -> Result<BTreeMap<String, f64>> {
    let mut by_task: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    let rj = RunDir::new(dir).eval_tasks_results();
    if rj.exists() {
        let v: serde_json::Value = crate::util::read_json(&rj, "rerun harpe eval-tasks")?;
        for (task, r) in v["results"].as_object().into_iter().flatten() {
            let m = r.as_object().into_iter().flatten().filter_map(|(k, x)| x.as_f64().map(|x| (k.clone(), x)));
            by_task.insert(task.clone(), m.collect());
        }
    } else if RunDir::new(dir).metrics().exists() {
        let evals = crate::train::metrics::read_evals(&RunDir::new(dir).metrics())?;
        if let Some(last) = evals.iter().rev().find(|e| !e.eval.tasks.is_empty()) {
            by_task = last.eval.tasks.clone();
        }
    }
    let grouped = by_task.contains_key("mmlu");
    let mut out = BTreeMap::new();
    for (task, m) in by_task {
        if grouped && task.starts_with("mmlu_") {
            continue;
        }
        for (key, v) in m {
            if let Some((metric, _filter)) = key.split_once(',').filter(|(m, _)| !m.ends_with("_stderr")) {
                out.insert(format!("{task}:{metric}"), v);
            }
        }
    }
    Ok(out)
}

/// Expand sweep directories into their finished runs; read every run.
pub fn collect_runs(dirs: &[PathBuf]) -> Result<Vec<RunData>> {
    let mut runs: Vec<RunData> = vec![];
    for d in dirs {
        let ix = d.join("sweep.json");
        if ix.exists() {
            let ix: SweepIndex = crate::util::read_json(&ix, "the file is damaged")?;
            let mut skipped = vec![];
            for r in &ix.runs {
                if r.state == RunState::Done {
                    runs.push(load_run(&d.join(&r.dir))?);
                } else {
                    skipped.push(format!("{} ({:?})", r.id, r.state));
                }
            }
            if !skipped.is_empty() {
                eprintln!(
                    "note: {} runs of {} are not done and left out: {}",
                    skipped.len(),
                    d.display(),
                    skipped.join(", ")
                );
            }
        } else if d.is_dir() {
            runs.push(load_run(d)?);
        } else {
            bail!("{}: not a directory\nhint: pass sweep directories (sweep.json) or run directories", d.display());
        }
    }
    if runs.is_empty() {
        bail!(
            "no finished runs in {}\nhint: run `harpe sweep` first",
            dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
        );
    }
    // one evaluation setting, one run per (arm, seed)
    let first = &runs[0];
    for r in &runs[1..] {
        if r.eval != first.eval {
            bail!(
                "{} and {} were evaluated with different settings ([eval] of their sweeps)\nhint: report runs of one evaluation setting together, or re-evaluate them with one sweep file",
                first.dir.display(),
                r.dir.display()
            );
        }
    }
    for (i, r) in runs.iter().enumerate() {
        if let Some(o) = runs[..i].iter().find(|o| o.arm == r.arm && o.seed == r.seed) {
            bail!(
                "{} and {} are both arm `{}` seed {}\nhint: pass each run once (a sweep directory already includes its runs)",
                o.dir.display(),
                r.dir.display(),
                r.arm,
                r.seed
            );
        }
    }
    Ok(runs)
}

/// Sort key of a metric: training loss, perplexities, losses, retrieval (task, length), cost.
fn metric_key(m: &str) -> (u8, String, u64) {
    if m == "train_loss" {
        return (0, String::new(), 0);
    }
    if let Some(c) = m.strip_prefix("cost:") {
        return (9, c.to_string(), 0);
    }
    if let Some((task, len)) = m.rsplit_once('@') {
        if let Ok(l) = len.parse::<u64>() {
            return (5, task.to_string(), l);
        }
    }
    let rank = if m.starts_with("ppl:") {
        1
    } else if m.starts_with("nll:") {
        2
    } else {
        3
    };
    (rank, m.to_string(), 0)
}

/// Compute the report from runs.
pub fn build(runs: Vec<RunData>, baseline: Option<&str>, interval: IntervalMethod) -> Result<Report> {
    let mut arms: Vec<String> = vec![];
    for r in &runs {
        if !arms.contains(&r.arm) {
            arms.push(r.arm.clone());
        }
    }
    let baseline = match baseline {
        Some(b) if arms.iter().any(|a| a == b) => b.to_string(),
        Some(b) => bail!("--baseline `{b}` is not an arm of these runs\nhint: arms are: {}", arms.join(", ")),
        None => arms[0].clone(),
    };
    let mut metrics: Vec<String> =
        runs.iter().flat_map(|r| r.metrics.keys().cloned()).collect::<BTreeSet<_>>().into_iter().collect();
    metrics.sort_by_key(|m| metric_key(m));
    let by_seed = |arm: &str, m: &str| -> BTreeMap<u64, f64> {
        runs.iter().filter(|r| r.arm == arm).filter_map(|r| r.metrics.get(m).map(|v| (r.seed, *v))).collect()
    };
    let mut out = vec![];
    for a in &arms {
        let mut seeds: Vec<u64> = runs.iter().filter(|r| &r.arm == a).map(|r| r.seed).collect();
        seeds.sort();
        let mut st = ArmStats { arm: a.clone(), seeds, metrics: BTreeMap::new(), diff: BTreeMap::new() };
        for m in &metrics {
            let vals = by_seed(a, m);
            if let Some(s) = summarize(&vals.values().copied().collect::<Vec<_>>()) {
                st.metrics.insert(m.clone(), s);
            }
            if *a != baseline {
                let base = by_seed(&baseline, m);
                let d: Vec<f64> = vals.iter().filter_map(|(s, v)| base.get(s).map(|b| v - b)).collect();
                if let Some(pd) = paired_diff(&d, interval) {
                    st.diff.insert(m.clone(), pd);
                }
            }
        }
        out.push(st);
    }
    Ok(Report { baseline, interval, metrics, arms: out, runs })
}

fn fmt_num(m: &str, v: f64) -> String {
    if m == "cost:tokens" {
        return human_count(v.max(0.0) as u64);
    }
    let a = v.abs();
    if a != 0.0 && !(1e-3..1e5).contains(&a) {
        format!("{v:.3e}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

fn mean_std(m: &str, s: &Summary) -> String {
    match s.std {
        Some(sd) => format!("{} ± {}", fmt_num(m, s.mean), fmt_num(m, sd)),
        None => fmt_num(m, s.mean),
    }
}

/// Retrieval metrics grouped as task -> lengths.
fn retrieval(metrics: &[String]) -> BTreeMap<String, Vec<u64>> {
    let mut t: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for m in metrics {
        if let (5, task, len) = metric_key(m) {
            t.entry(task).or_default().push(len);
        }
    }
    t
}

/// The Markdown report.
pub fn markdown(rep: &Report) -> String {
    let mut s = String::from("# harpe report\n\n");
    let ret = retrieval(&rep.metrics);
    let main: Vec<&String> = rep.metrics.iter().filter(|m| metric_key(m).0 != 5).collect();
    s.push_str("## Final metrics (mean ± std over seeds)\n\n| arm | n | ");
    s.push_str(&main.iter().map(|m| m.as_str()).collect::<Vec<_>>().join(" | "));
    s.push_str(" |\n|---|---|");
    s.push_str(&"---|".repeat(main.len()));
    s.push('\n');
    for a in &rep.arms {
        s.push_str(&format!("| {} | {} |", a.arm, a.seeds.len()));
        for m in &main {
            s.push_str(&format!(" {} |", a.metrics.get(*m).map_or("–".into(), |x| mean_std(m, x))));
        }
        s.push('\n');
    }
    for (task, lens) in &ret {
        s.push_str(&format!("\n## {task} by length (score 0-100, mean ± std over seeds)\n\n| arm | "));
        s.push_str(&lens.iter().map(u64::to_string).collect::<Vec<_>>().join(" | "));
        s.push_str(" |\n|---|");
        s.push_str(&"---|".repeat(lens.len()));
        s.push('\n');
        for a in &rep.arms {
            s.push_str(&format!("| {} |", a.arm));
            for l in lens {
                let m = format!("{task}@{l}");
                s.push_str(&format!(" {} |", a.metrics.get(&m).map_or("–".into(), |x| mean_std(&m, x))));
            }
            s.push('\n');
        }
    }
    let method = match rep.interval {
        IntervalMethod::T => "Student's t".to_string(),
        IntervalMethod::Bootstrap { resamples } => format!("percentile bootstrap, {resamples} resamples"),
    };
    s.push_str(&format!(
        "\n## Paired differences: arm − {} (same seed), 95% interval ({method})\n\n| arm | metric | n pairs | mean diff | 95% CI |\n|---|---|---|---|---|\n",
        rep.baseline
    ));
    for a in rep.arms.iter().filter(|a| a.arm != rep.baseline) {
        for m in &rep.metrics {
            if let Some(d) = a.diff.get(m) {
                let ci =
                    d.ci.map_or("– (n < 2)".into(), |(lo, hi)| format!("[{}, {}]", fmt_num(m, lo), fmt_num(m, hi)));
                s.push_str(&format!("| {} | {m} | {} | {} | {ci} |\n", a.arm, d.n, fmt_num(m, d.mean)));
            }
        }
    }
    s.push_str("\nMetrics: `train_loss` = mean training loss of the last 10 steps; `ppl:`/`nll:` = `harpe eval-ppl`; `loss:` = `harpe eval-loss` by position bucket; `task@length` = `harpe eval-niah` score; `task:metric` = `harpe eval-tasks` (lm-evaluation-harness rules) score; `cost:tokens` = training tokens, `cost:train_s` = summed step time in seconds.\n");
    s.push_str(&format!(
        "\nRuns: {}\n",
        rep.runs.iter().map(|r| r.dir.display().to_string()).collect::<Vec<_>>().join(", ")
    ));
    s
}

/// The long-format CSV: one row per (arm, metric).
pub fn csv_text(rep: &Report) -> Result<String> {
    let mut w = csv::Writer::from_writer(vec![]);
    w.write_record(["arm", "metric", "n", "mean", "std", "diff_n", "diff_mean", "diff_std", "ci_lo", "ci_hi"])?;
    let o = |v: Option<f64>| v.map_or(String::new(), |x| format!("{x}"));
    for a in &rep.arms {
        for m in &rep.metrics {
            let Some(st) = a.metrics.get(m) else { continue };
            let d = a.diff.get(m);
            w.write_record([
                a.arm.clone(),
                m.clone(),
                st.n.to_string(),
                format!("{}", st.mean),
                o(st.std),
                d.map_or(String::new(), |d| d.n.to_string()),
                o(d.map(|d| d.mean)),
                o(d.and_then(|d| d.std)),
                o(d.and_then(|d| d.ci.map(|c| c.0))),
                o(d.and_then(|d| d.ci.map(|c| c.1))),
            ])?;
        }
    }
    String::from_utf8(w.into_inner().map_err(|e| anyhow!("csv: {e}"))?).context("csv is not UTF-8")
}

fn plot_err(path: &Path) -> impl Fn(&dyn std::fmt::Display) -> anyhow::Error + '_ {
    move |e| {
        anyhow!(
            "drawing {} failed: {e}\nhint: check that the directory is writable and the disk not full",
            path.display()
        )
    }
}

/// Loss against tokens seen, every run, one colour per arm.
pub fn plot_curves(rep: &Report, path: &Path) -> Result<()> {
    crate::plot_font::register()?;
    use plotters::prelude::*;
    let pts: Vec<&(f64, f64)> = rep.runs.iter().flat_map(|r| r.curve.iter()).collect();
    if pts.is_empty() {
        return Ok(());
    }
    let err = plot_err(path);
    let x1 = pts.iter().map(|p| p.0).fold(1.0, f64::max);
    let lo = pts.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let hi = pts.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let root = BitMapBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("training loss, all runs", (crate::plot_font::FAMILY, 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x1, (lo - pad)..(hi + pad))
        .map_err(|e| err(&e))?;
    chart.configure_mesh().x_desc("tokens seen").y_desc("train loss").draw().map_err(|e| err(&e))?;
    for (k, a) in rep.arms.iter().enumerate() {
        let color = Palette99::pick(k).to_rgba();
        for (j, r) in rep.runs.iter().filter(|r| r.arm == a.arm).enumerate() {
            let s = chart
                .draw_series(LineSeries::new(r.curve.iter().copied(), color.stroke_width(1)))
                .map_err(|e| err(&e))?;
            if j == 0 {
                s.label(a.arm.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3)));
            }
        }
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Score against length for one retrieval task: mean per arm with ± std bars.
pub fn plot_task(rep: &Report, task: &str, lens: &[u64], path: &Path) -> Result<()> {
    crate::plot_font::register()?;
    use plotters::prelude::*;
    let err = plot_err(path);
    let root = BitMapBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let xs: Vec<f64> = lens.iter().map(|&l| (l as f64).log2()).collect();
    let (x0, x1) = (xs[0] - 0.3, xs[xs.len() - 1] + 0.3);
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{task}: score by length (mean ± std over seeds)"), (crate::plot_font::FAMILY, 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(x0..x1, -5.0..105.0)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("length (tokens)")
        .y_desc("score")
        .x_label_formatter(&|x| format!("{:.0}", 2f64.powf(*x)))
        .draw()
        .map_err(|e| err(&e))?;
    for (k, a) in rep.arms.iter().enumerate() {
        let color = Palette99::pick(k).to_rgba();
        let pts: Vec<(f64, f64, f64)> = lens
            .iter()
            .zip(&xs)
            .filter_map(|(l, x)| {
                a.metrics.get(&format!("{task}@{l}")).map(|s| (*x + 0.02 * k as f64, s.mean, s.std.unwrap_or(0.0)))
            })
            .collect();
        chart
            .draw_series(LineSeries::new(pts.iter().map(|p| (p.0, p.1)), color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(a.arm.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3)));
        chart
            .draw_series(
                pts.iter().map(|p| PathElement::new(vec![(p.0, p.1 - p.2), (p.0, p.1 + p.2)], color.stroke_width(2))),
            )
            .map_err(|e| err(&e))?;
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Write report.md, report.csv, report.json, loss_curves.png and one PNG per retrieval task; return paths.
pub fn write(rep: &Report, out: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out)
        .with_context(|| format!("cannot create {}\nhint: pass a writable --out", out.display()))?;
    let mut w = vec![];
    let md = out.join("report.md");
    crate::util::write_atomic(&md, markdown(rep).as_bytes())?;
    w.push(md);
    let csv = out.join("report.csv");
    crate::util::write_atomic(&csv, csv_text(rep)?.as_bytes())?;
    w.push(csv);
    let js = out.join("report.json");
    crate::util::write_atomic(&js, serde_json::to_string_pretty(rep)?.as_bytes())?;
    w.push(js);
    let png = out.join("loss_curves.png");
    plot_curves(rep, &png)?;
    w.push(png);
    for (task, lens) in retrieval(&rep.metrics) {
        let p = out.join(format!("{task}_by_length.png"));
        plot_task(rep, &task, &lens, &p)?;
        w.push(p);
    }
    Ok(w)
}

/// `harpe report`.
pub fn run(args: ReportArgs) -> Result<()> {
    let interval = match args.bootstrap {
        Some(0) => bail!("--bootstrap 0: no resamples\nhint: e.g. --bootstrap 10000"),
        Some(n) => IntervalMethod::Bootstrap { resamples: n },
        None => IntervalMethod::T,
    };
    let runs = collect_runs(&args.dirs)?;
    let rep = build(runs, args.baseline.as_deref(), interval)?;
    let out = args.out.clone().unwrap_or_else(|| args.dirs[0].clone());
    let written = write(&rep, &out)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rep)?);
    } else {
        print!("{}", markdown(&rep));
        for p in written {
            println!("wrote {}", p.display());
        }
    }
    Ok(())
}
