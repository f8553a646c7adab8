//! `harpe sweep`: many training runs of one question — a base recipe, named arms (override sets or
//! their own recipe), grid axes over any `--set` key, and seeds — trained and evaluated one after
//! another or as N parallel processes, resumable, indexed in `sweep.json`.
//!
//! Reference: a fair comparison needs several multi-stage schedules and seeds; the layout
//! follows torchtitan's one-TOML-per-recipe plus a sweep file on top.
//! The non-obvious decisions:
//! - Every run is a separate `harpe train` process (the same binary, `current_exe` or `$HARPE_BIN`), driven
//!   only through train's public contract (`--config --out --set --resume`), so `--jobs N` is N processes,
//!   a crash takes down one run, and a run directory is exactly what `harpe train` would have written.
//!   Training is always started with `--resume`, which continues a killed run from its newest complete
//!   checkpoint and starts a fresh one from scratch.
//! - A run is finished when its newest checkpoint's `state.json` is past the last stage — not when the
//!   process exited 0 (a signalled `harpe train` also exits 0 after checkpointing).
//! - Every run is resolved (`RunConfig::load` with all its overrides) before anything starts, so an axis
//!   key that is not a config key, a bad value or a clashing name fails at once, naming it.
//! - Each run directory carries `sweep-run.json` (sweep name, arm, seed, overrides, config hash, the eval
//!   settings); a directory that belongs to another sweep or another config is refused, and
//!   `harpe report` reads arms and seeds from it.
//! - Children get SIGTERM when the sweep dies (Linux `PR_SET_PDEATHSIG`), and a SIGINT/SIGTERM to the
//!   sweep is forwarded once, so every child checkpoints and a rerun resumes.
//! - `--executor slurm` hands the same runs to Slurm as array jobs (`slurm.rs`); a task evaluates its
//!   run with `--task RUN`, which updates this run's entry of `sweep.json` under a lock, re-read from
//!   disk, because the other tasks write theirs at the same time.
//!
//! The files: `args.rs` (the flags), `spec.rs` (the sweep file and its runs), `index.rs` (`sweep.json`
//! and `sweep-run.json`), `local.rs` (the local executor and the evaluations), `slurm.rs` (the Slurm
//! executor: submission, `--task`, `--status`), `sbatch.rs` (the `[slurm]` table, the scripts, the
//! job record, Slurm's commands). This file only picks the path a command takes.
//!
//! Not here: the statistics (`report.rs`).
pub mod args;
pub mod index;
mod local;
pub mod sbatch;
mod slurm;
pub mod spec;

use anyhow::{anyhow, Result};

pub use args::{Executor, SweepArgs};
pub use index::{read_marker, RunState, SweepIndex};
pub use local::harpe_binary;
pub use spec::{EvalSpec, SweepSpec};

/// `harpe sweep`.
pub fn run(args: SweepArgs) -> Result<()> {
    if let Some(dir) = &args.status {
        return slurm::print_status(dir);
    }
    let config = args.config.clone().ok_or_else(|| {
        anyhow!("no --config\nhint: pass the sweep file, e.g. --config configs/sweeps/harpe-vs-multistage.toml")
    })?;
    let spec = SweepSpec::load(&config)?;
    let name = spec.name_for(&config);
    if let Some(id) = &args.task {
        return slurm::run_task(&args, &config, &spec, &name, id);
    }
    let plans = spec.selected(&config, &args.only)?;
    if args.executor == Executor::Slurm {
        return slurm::submit(&args, &config, &spec, &name, &plans);
    }
    if args.dry_run {
        local::print_plan(&plans, &args);
        return Ok(());
    }
    local::run(&args, &config, &spec, &name, plans)
}
