//! `harpe sweep`'s flags and the executor they pick; apart from the sweep file (`spec.rs`), which says
//! what runs, these say where and how many at a time.
use std::path::PathBuf;

/// Where the runs of a sweep train.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Executor {
    /// child processes on this machine (`--jobs` at a time)
    #[default]
    Local,
    /// one `sbatch --array` job per resource shape of the `[slurm]` table; returns after submitting
    Slurm,
}

/// Train and evaluate every run of a sweep file.
#[derive(clap::Args, Debug, Clone)]
pub struct SweepArgs {
    /// sweep file: `base` recipe, `seeds`, `[axes]`, `[[arm]]` tables, `[eval]`, `[slurm]` (see
    /// configs/sweeps/harpe-vs-multistage.toml)
    #[arg(long, value_name = "FILE", required_unless_present = "status")]
    pub config: Option<PathBuf>,
    /// sweep directory: sweep.json and one run directory per run [default: runs/<sweep name>]
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// runs trained and evaluated at the same time (separate processes; CPU threads are split between them)
    #[arg(long, default_value_t = 1)]
    pub jobs: usize,
    /// print the runs, their overrides and token budgets and the estimated cost, then stop
    #[arg(long)]
    pub dry_run: bool,
    /// only runs whose id contains one of these strings (comma-separated), e.g. --only seed0,harpe
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// model FLOPs utilization assumed by --dry-run's time estimate
    #[arg(long, default_value_t = 0.4)]
    pub mfu: f64,
    /// peak TFLOP/s per device for --dry-run's estimate [default: the recipe's log.peak_tflops, else 312]
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// local: child processes here; slurm: submit array jobs (with --dry-run: print their scripts)
    #[arg(long, value_enum, default_value_t = Executor::Local)]
    pub executor: Executor,
    /// print where each run of the sweep directory DIR stands (Slurm task, state, last step) and stop
    #[arg(long, value_name = "DIR", conflicts_with_all = ["config", "dry_run", "task"])]
    pub status: Option<PathBuf>,
    /// evaluate the trained run RUN and mark it in sweep.json (what a Slurm array task runs after training)
    #[arg(long, value_name = "RUN", hide = true, requires = "out")]
    pub task: Option<String>,
}
