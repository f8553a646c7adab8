//! `harpe train`'s command-line arguments.
use super::RunDir;
use std::path::{Path, PathBuf};

/// `harpe train`: single- or multi-stage continual pretraining from a TOML recipe.
#[derive(clap::Args, Debug, Clone)]
pub struct TrainArgs {
    /// TOML recipe: [model] [data] [rope] [train] [optim] [schedule] [checkpoint] [dist] [log] and
    /// [[stage]] tables (see configs/tiny-cpu.toml)
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// run directory for config.toml, metrics.jsonl, loss.png and checkpoints/
    /// [default: runs/<config file name without .toml>]
    #[arg(long, value_name = "RUN_DIR")]
    pub out: Option<PathBuf>,
    /// stop after N optimizer steps in total (steps of a resumed run count) and write a final checkpoint
    #[arg(long, value_name = "N")]
    pub steps: Option<u64>,
    /// continue bit-identically from the newest complete checkpoint in the run directory
    /// (starts from scratch when there is none)
    #[arg(long)]
    pub resume: bool,
    /// continue from this complete checkpoint directory (RUN/checkpoints/step_N) instead of the newest,
    /// e.g. the one before a checkpoint that `--resume` found damaged; implies --resume
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    pub resume_from: Option<PathBuf>,
    /// override one config value, e.g. --set optim.lr=1e-5 or --set stage.0.steps=10 (repeatable)
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// use a run directory that already belongs to a different config (replaces its config.toml);
    /// also start a run that `harpe plan` says will not fit
    #[arg(long)]
    pub force: bool,
    /// start N worker processes (one per GPU, dist.backend = "nccl"; CPU processes with "gloo"); needs a
    /// build with --features nccl or gloo. On CPU without them use --set dist.backend=local --set
    /// dist.world_size=N instead
    #[arg(long, value_name = "N")]
    pub nproc_per_node: Option<usize>,
    /// several nodes under harpe's own launcher: --nnodes, --node-rank, --master-addr, --master-port
    #[command(flatten)]
    pub nodes: crate::launch::spawn::NodeArgs,
    /// test knob: keep the training state (weights, AdamW, gradients) in the device variant of
    /// `FlatBuf` even on the CPU, so the GPU path's candle-op logic runs and can be compared with the
    /// host path there (a CUDA run always uses it)
    #[arg(long, hide = true)]
    pub device_resident_state: bool,
    /// attention kernels on CUDA: flash2 (FlashAttention-2's forward and backward) or harpe; sets
    /// `[train] attention` (default "auto": flash2 where the build has it and it takes the model).
    /// candle-flash, the eval commands' forward-only choice, is refused
    #[arg(long, value_enum)]
    pub attention: Option<crate::model::attention::AttentionChoice>,
}

impl TrainArgs {
    /// The arguments of `harpe train --config CONFIG [--out OUT]` with every other flag at its default.
    pub fn new(config: &Path, out: Option<&Path>) -> TrainArgs {
        TrainArgs {
            config: config.to_path_buf(),
            out: out.map(Path::to_path_buf),
            steps: None,
            resume: false,
            resume_from: None,
            set: vec![],
            force: false,
            nproc_per_node: None,
            nodes: Default::default(),
            device_resident_state: false,
            attention: None,
        }
    }

    /// The `--set` overrides with `--attention` as the `train.attention` one it stands for (last, so it wins).
    pub fn sets(&self) -> Vec<String> {
        let mut sets = self.set.clone();
        if let Some(a) = self.attention.and_then(|c| c.for_train()) {
            let name = match a {
                crate::config::TrainAttention::Auto => "auto",
                crate::config::TrainAttention::Harpe => "harpe",
                crate::config::TrainAttention::Flash2 => "flash2",
            };
            sets.push(format!("train.attention=\"{name}\""));
        }
        sets
    }

    /// The run directory: `--out`, else `runs/<config file name without .toml>`.
    pub fn run_dir(&self) -> RunDir {
        RunDir::new(self.out.clone().unwrap_or_else(|| {
            let stem = self.config.file_stem().map(|s| s.to_string_lossy().to_string());
            PathBuf::from("runs").join(stem.unwrap_or_else(|| "run".into()))
        }))
    }
}
