//! `RunDir`: the layout of a run directory, owned in one place. `harpe train` writes it; `sweep`,
//! `report`, `demo` and `consolidate` read it; no other code spells one of its paths.
//!
//! ```text
//! RUN_DIR/
//!   .lock               exclusive flock of the process that trains into it (util::lock_dir)
//!   config.toml         the resolved config; its config hash (`RunConfig::hash`, without [dist]) guards resume
//!   tokenizer.json      the built-in byte tokenizer, when the config names none
//!   metrics.jsonl       one line per step and per evaluation
//!   loss.png eval.png   plots of metrics.jsonl
//!   tb/                 TensorBoard event files
//!   sweep-run.json train.log eval.log eval/{loss.json,niah/,summary.json}   written by harpe sweep
//!   eval-tasks/results.json                                                 harpe eval-tasks --out
//!   data/builtin_T<n>/  the built-in dataset of stages of n tokens
//!   checkpoints/step_<n>/  model directories + optimizer shards + state.json + DONE (train::checkpoint)
//! ```
//! What this file does not do: the checkpoint directories' inside (`train::checkpoint` owns it).
use crate::train::checkpoint;
use anyhow::Result;
use std::path::{Path, PathBuf};

/// A run directory (it need not exist yet).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunDir {
    root: PathBuf,
}

impl RunDir {
    /// The run directory at `root`.
    pub fn new(root: impl Into<PathBuf>) -> RunDir {
        RunDir { root: root.into() }
    }

    /// The directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The resolved config of the run.
    pub fn config(&self) -> PathBuf {
        self.root.join("config.toml")
    }

    /// The step and evaluation records.
    pub fn metrics(&self) -> PathBuf {
        self.root.join("metrics.jsonl")
    }

    /// The tokenizer written into the run when the config names none.
    pub fn tokenizer(&self) -> PathBuf {
        self.root.join("tokenizer.json")
    }

    /// TensorBoard's event directory.
    pub fn tensorboard(&self) -> PathBuf {
        self.root.join("tb")
    }

    /// The loss curve.
    pub fn loss_plot(&self) -> PathBuf {
        self.root.join("loss.png")
    }

    /// The in-training evaluation curves.
    pub fn eval_plot(&self) -> PathBuf {
        self.root.join("eval.png")
    }

    /// The built-in dataset of sequences of `seq_len` tokens.
    pub fn builtin_data(&self, seq_len: usize) -> PathBuf {
        self.root.join("data").join(format!("builtin_T{seq_len}"))
    }

    /// `harpe sweep`'s marker of the run it started here (arm, seed, evaluation spec).
    pub fn sweep_marker(&self) -> PathBuf {
        self.root.join("sweep-run.json")
    }

    /// `harpe sweep`'s capture of the training command's output.
    pub fn train_log(&self) -> PathBuf {
        self.root.join("train.log")
    }

    /// `harpe sweep`'s capture of the evaluation commands' output.
    pub fn eval_log(&self) -> PathBuf {
        self.root.join("eval.log")
    }

    /// `harpe sweep`'s evaluation of the final checkpoint: `loss.json`, `niah/`, `summary.json`.
    pub fn eval_dir(&self) -> PathBuf {
        self.root.join("eval")
    }

    /// The evaluation's loss by position (`harpe eval-loss --json`).
    pub fn eval_loss(&self) -> PathBuf {
        self.eval_dir().join("loss.json")
    }

    /// The evaluation's needle tasks (`harpe eval-niah --out`).
    pub fn eval_niah(&self) -> PathBuf {
        self.eval_dir().join("niah")
    }

    /// The evaluation's summary (`harpe report` reads it).
    pub fn eval_summary(&self) -> PathBuf {
        self.eval_dir().join("summary.json")
    }

    /// `harpe eval-tasks --out RUN_DIR/eval-tasks`'s results.
    pub fn eval_tasks_results(&self) -> PathBuf {
        self.root.join("eval-tasks").join("results.json")
    }

    /// The checkpoints' directory.
    pub fn checkpoints(&self) -> PathBuf {
        self.root.join("checkpoints")
    }

    /// The newest complete checkpoint, if any.
    pub fn latest_checkpoint(&self) -> Result<Option<PathBuf>> {
        checkpoint::latest_complete(&self.checkpoints())
    }

    /// Whether a run has started here (a config or a checkpoint directory exists).
    pub fn is_started(&self) -> bool {
        self.config().exists() || self.checkpoints().exists()
    }

    /// Hold the directory's exclusive lock for `command` until the returned guard drops.
    pub fn lock(&self, command: &str) -> Result<crate::util::DirLock> {
        crate::util::lock_dir(&self.root, command)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_is_under_the_root_and_distinct() {
        let d = RunDir::new("/runs/a");
        let paths = [
            d.config(),
            d.metrics(),
            d.tokenizer(),
            d.tensorboard(),
            d.loss_plot(),
            d.eval_plot(),
            d.builtin_data(128),
            d.checkpoints(),
            d.sweep_marker(),
            d.train_log(),
            d.eval_log(),
            d.eval_summary(),
            d.eval_loss(),
            d.eval_niah(),
            d.eval_tasks_results(),
        ];
        for (i, p) in paths.iter().enumerate() {
            assert!(p.starts_with("/runs/a") && p != Path::new("/runs/a"), "{p:?}");
            assert!(paths[i + 1..].iter().all(|q| q != p), "{p:?} twice");
        }
        assert_eq!(d.builtin_data(128), Path::new("/runs/a/data/builtin_T128"));
    }
}
