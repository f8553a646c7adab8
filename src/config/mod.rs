//! The training recipe: one serde struct per TOML section, `[[stage]]` tables for multi-stage runs,
//! `--set section.key=value` overrides, validation, and the resolved config with its hash.
//!
//! Reference: torchtitan's one-TOML-per-recipe layout; the HARPE paper's §4.1/§4.4 for the recipes in
//! `configs/`. The non-obvious decisions: every default lives in this file and nowhere else;
//! overrides are applied to the parsed TOML value before deserializing, so a wrong type from the
//! command line is reported exactly like one in the file (naming the key); the config hash is the
//! sha256 of the resolved TOML text, which is what `state.json` and the run directory check against.
//! What this file does not do: build the model or the data (`train` does).
use crate::model::rope::RopeScheme;
use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The whole recipe (`harpe train --config FILE`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    #[serde(default)]
    pub model: ModelSection,
    #[serde(default)]
    pub data: DataSection,
    /// RoPE scheme of every stage that does not give its own (default: the model's config.json)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope: Option<RopeScheme>,
    #[serde(default)]
    pub train: TrainSection,
    #[serde(default)]
    pub optim: OptimSection,
    #[serde(default)]
    pub schedule: ScheduleSection,
    #[serde(default)]
    pub checkpoint: CheckpointSection,
    #[serde(default)]
    pub dist: DistSection,
    #[serde(default)]
    pub log: LogSection,
    /// evaluation during training (absent: none)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<EvalSection>,
    /// the stages, run in order
    #[serde(default, rename = "stage")]
    pub stages: Vec<StageSection>,
}

/// `[model]`: continue from an HF model directory, or initialize randomly from `[model.init]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// HF model directory (config.json, *.safetensors, tokenizer.json)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// architecture for random initialization (instead of `path`)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<ArchSection>,
    /// tokenizer.json; default `path/tokenizer.json`, or the built-in byte tokenizer with `[model.init]`
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
}

/// `[model.init]`: a Llama architecture, HF `config.json` field names.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArchSection {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// default: num_attention_heads (MHA)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    /// default: hidden_size / num_attention_heads
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "d_rms_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "d_init_range")]
    pub initializer_range: f64,
}

/// Where training sequences come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DataSource {
    /// a dataset written by `harpe prepare-data` (`[data] path` or the stage's `data`)
    #[default]
    Prepared,
    /// built-in English text, tokenized and packed by the run itself into RUN_DIR/data/
    Builtin,
}

/// `[data]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    #[serde(default)]
    pub source: DataSource,
    /// prepared dataset directory for stages that do not name their own
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// shuffle sequence order (seeded by `train.seed`)
    #[serde(default = "d_true")]
    pub shuffle: bool,
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection { source: DataSource::default(), path: None, shuffle: true }
    }
}

use crate::device::{ComputeDtype, DeviceSpec};

mod zero_stage;
pub use zero_stage::{GradReduce, ZeroStage};

/// Activation checkpointing: `"none"`, `"every-layer"`, or `{ every = k }` (one saved input per k layers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Checkpointing {
    None,
    #[default]
    EveryLayer,
    Every(usize),
}

impl Checkpointing {
    /// Layers per recomputed segment for a model with `n_layers` layers.
    pub fn segment_len(&self, n_layers: usize) -> usize {
        match self {
            Checkpointing::None => n_layers.max(1),
            Checkpointing::EveryLayer => 1,
            Checkpointing::Every(k) => (*k).clamp(1, n_layers.max(1)),
        }
    }
}

/// `[train]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    /// seed of the random initialization and the data order
    #[serde(default)]
    pub seed: u64,
    /// `cpu`, `cuda` or `cuda:N`
    #[serde(default)]
    pub device: DeviceSpec,
    #[serde(default)]
    pub dtype: ComputeDtype,
    /// sequences per forward/backward
    #[serde(default = "d_one")]
    pub micro_batch_size: usize,
    /// tokens per optimizer step (a multiple of micro_batch_size x seq_len of every stage);
    /// default: one micro-batch, no accumulation
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_batch_tokens: Option<usize>,
    #[serde(default)]
    pub activation_checkpointing: Checkpointing,
    /// tokens per chunk of the cross-entropy (bounds the (chunk x V) logits block)
    #[serde(default = "d_loss_chunk")]
    pub loss_chunk_tokens: usize,
    /// stop after this many consecutive skipped (NaN/inf) steps
    #[serde(default = "d_bad_steps")]
    pub max_bad_steps: u32,
    /// per-document causal attention inside packed sequences (documents from the dataset's segment table);
    /// left out of the resolved config at its default, so configs hashed before this key keep their hash
    #[serde(default, skip_serializing_if = "is_false")]
    pub document_mask: bool,
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            seed: 0,
            device: DeviceSpec::default(),
            dtype: ComputeDtype::default(),
            micro_batch_size: 1,
            global_batch_tokens: None,
            activation_checkpointing: Checkpointing::default(),
            loss_chunk_tokens: d_loss_chunk(),
            max_bad_steps: d_bad_steps(),
            document_mask: false,
        }
    }
}

/// `[optim]`: AdamW.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimSection {
    /// peak learning rate of stages that do not set their own
    #[serde(default = "d_lr")]
    pub lr: f64,
    #[serde(default = "d_beta1")]
    pub beta1: f64,
    #[serde(default = "d_beta2")]
    pub beta2: f64,
    #[serde(default = "d_eps")]
    pub eps: f64,
    /// decoupled weight decay of matrices (and of the embedding unless set below)
    #[serde(default)]
    pub weight_decay: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay_embedding: Option<f64>,
    #[serde(default)]
    pub weight_decay_norm: f64,
    /// clip the global gradient norm to this (0 = off)
    #[serde(default = "d_clip")]
    pub grad_clip: f64,
    /// zero the moments at every stage boundary (default: carry them over)
    #[serde(default)]
    pub reset_between_stages: bool,
}

impl OptimSection {
    /// Weight decay of the token embedding (default: that of the matrices).
    pub fn embedding_weight_decay(&self) -> f64 {
        self.weight_decay_embedding.unwrap_or(self.weight_decay)
    }
}

impl Default for OptimSection {
    fn default() -> Self {
        OptimSection {
            lr: d_lr(),
            beta1: d_beta1(),
            beta2: d_beta2(),
            eps: d_eps(),
            weight_decay: 0.0,
            weight_decay_embedding: None,
            weight_decay_norm: 0.0,
            grad_clip: d_clip(),
            reset_between_stages: false,
        }
    }
}

/// Shape of the learning-rate curve inside one stage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScheduleKind {
    /// the peak lr at every step (warm-up ignored)
    #[default]
    Constant,
    /// linear from lr/warmup to lr over `warmup_steps`, then constant
    LinearWarmup,
    /// linear warm-up, then cosine from lr to lr * min_lr_ratio at the stage's last step
    Cosine,
}

/// Which steps one schedule spans.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleSpan {
    /// each stage runs the schedule over its own steps (a multi-stage recipe re-warms per stage)
    #[default]
    Stage,
    /// one schedule over the whole run: the global step of the run's total steps
    Run,
}

/// `[schedule]`: the lr curve inside each stage (or over the run, `span = "run"`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSection {
    #[serde(default)]
    pub kind: ScheduleKind,
    #[serde(default)]
    pub warmup_steps: u64,
    #[serde(default)]
    pub min_lr_ratio: f64,
    /// the steps the schedule spans: "stage" (default) or "run"
    #[serde(default)]
    pub span: ScheduleSpan,
}

/// `[checkpoint]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// save every N optimizer steps (0 = only at stage ends and at the end)
    #[serde(default)]
    pub every: u64,
    /// complete checkpoints to keep (older ones are deleted after a new one is complete)
    #[serde(default = "d_keep")]
    pub keep_last: usize,
    /// largest model shard file in bytes (default 5 GiB = 5 x 2^30, `model::weights::DEFAULT_MAX_SHARD_BYTES`)
    #[serde(default = "d_shard")]
    pub max_shard_bytes: usize,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        CheckpointSection { every: 0, keep_last: d_keep(), max_shard_bytes: d_shard() }
    }
}

/// Communication backend; `comms::Comm` refuses the ones this build lacks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// `single`: one process, one device; collectives are no-ops
    #[default]
    Single,
    /// `local`: `dist.world_size` ranks as threads of this one process (tests, CPU equivalence runs)
    Local,
    /// `nccl`: one process per GPU, started by `--nproc-per-node`, torchrun or srun
    Nccl,
    /// `gloo`: one process per rank on the CPU over Gloo's TCP transport, started as `nccl` is (the
    /// process topology of a GPU run, without GPUs; a build with `--features gloo`)
    Gloo,
}

impl Backend {
    /// The name used in the TOML file.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Single => "single",
            Backend::Local => "local",
            Backend::Nccl => "nccl",
            Backend::Gloo => "gloo",
        }
    }

    /// Whether each rank is a process of its own, started by a launcher (`nccl`, `gloo`).
    pub fn is_multi_process(self) -> bool {
        matches!(self, Backend::Nccl | Backend::Gloo)
    }
}

/// `[dist]`, also the runtime type of the distribution: `validate` owns every world / sequence-parallel /
/// kv-head / seq-len / batch divisibility rule (`RunConfig::validate`, `harpe plan` and the training run
/// call it), `launch::spawn::place` reconciles it with a launcher's environment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DistSection {
    /// "single" | "local" | "nccl"
    #[serde(default)]
    pub backend: Backend,
    /// ranks in total; 0 = whatever the launcher started (1 without a launcher). `local` needs it
    /// explicitly; with a launcher a non-zero value must equal the launcher's
    #[serde(default)]
    pub world_size: usize,
    /// ZeRO stage 0-3 (`ZeroStage`: which state is sharded)
    #[serde(default)]
    pub zero_stage: ZeroStage,
    /// MiB of gradients per reduce(-scatter) bucket; changes speed, never results
    #[serde(default = "d_bucket_mb")]
    pub bucket_mb: f64,
    /// seconds a collective, barrier or the rendezvous waits for the slowest rank before every rank
    /// stops with an error naming it
    #[serde(default = "d_timeout_s")]
    pub timeout_s: f64,
    /// Ulysses sequence-parallel degree P: each sequence split over P ranks (divides world_size, the
    /// kv heads and every stage's seq_len)
    #[serde(default = "d_one")]
    pub sp_degree: usize,
    /// NCCL: compare every rank's collective signatures (seq, op, count, dtype) through rank 0 every
    /// 64 collectives and stop on a difference (`launch::signature`); `local` always checks
    #[serde(default)]
    pub check_collectives: bool,
}

fn d_bucket_mb() -> f64 {
    25.0
}
fn d_timeout_s() -> f64 {
    600.0
}

impl Default for DistSection {
    fn default() -> Self {
        DistSection {
            backend: Backend::Single,
            world_size: 0,
            zero_stage: ZeroStage::Replicated,
            bucket_mb: d_bucket_mb(),
            timeout_s: d_timeout_s(),
            sp_degree: 1,
            check_collectives: false,
        }
    }
}

/// One stage's batch as `[dist]`'s rules see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageBatch {
    /// tokens per sequence
    pub seq_len: usize,
    /// micro-batches per optimizer step (at one rank)
    pub micro_batches: usize,
    /// sequences per micro-batch (`train.micro_batch_size`)
    pub micro_batch: usize,
}

impl DistSection {
    /// Range checks of the keys themselves (no world, model or stage needed); `origin` names the config.
    pub fn check_keys(&self, origin: &str) -> Result<()> {
        if !(self.bucket_mb.is_finite() && self.bucket_mb > 0.0) {
            bail!("{origin}: dist.bucket_mb = {} must be a positive size in MiB\nhint: e.g. 25", self.bucket_mb);
        }
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0) {
            bail!("{origin}: dist.timeout_s = {} must be a positive number of seconds\nhint: e.g. 600", self.timeout_s);
        }
        if self.backend == Backend::Local && self.world_size == 0 {
            bail!(
                "{origin}: dist.backend = \"local\" needs dist.world_size >= 1 (it runs that many ranks as threads; dist.world_size is not set)\nhint: add --set dist.world_size=N (e.g. 2 or 4)"
            );
        }
        if self.check_collectives && self.backend == Backend::Single {
            bail!(
                "{origin}: dist.check_collectives = true with dist.backend = \"single\": one rank has no other rank to compare its collectives with\nhint: remove the key, or run several ranks (dist.backend = \"nccl\"; \"local\" always checks)"
            );
        }
        if self.sp_degree == 0 {
            bail!("{origin}: dist.sp_degree = 0: at least one rank holds each sequence\nhint: 1 (no sequence parallelism) or a divisor of dist.world_size");
        }
        Ok(())
    }

    /// Every divisibility rule of a run of `world` ranks (0: not known yet, the launcher decides; the
    /// world-dependent rules wait for it), a model with `kv_heads` kv heads (None: not known here) and
    /// `stages`: SP divides the world, the kv heads and every seq_len; each step's sequences split
    /// evenly over the data-parallel ranks.
    pub fn validate(&self, origin: &str, world: usize, kv_heads: Option<usize>, stages: &[StageBatch]) -> Result<()> {
        self.check_keys(origin)?;
        let p = self.sp_degree;
        // (what is wrong, hint) of each SP rule that fails: all are named at once
        let mut bad: Vec<(String, String)> = vec![];
        if p > 1 && world != 0 && !world.is_multiple_of(p) {
            let lo = world / p * p;
            let near = if lo > 0 { format!("{lo} or {}", lo + p) } else { format!("{p}") };
            bad.push((
                format!("dist.sp_degree = {p} must divide dist.world_size = {world} (world size {world} is not divisible by dist.sp_degree {p}: each sequence is split over {p} ranks)"),
                format!("nearest valid world size: --gpus {near} (dist.world_size), or an SP degree that divides {world}"),
            ));
        }
        if let Some(hkv) = kv_heads.filter(|&h| p > h || !h.is_multiple_of(p)) {
            let valid: Vec<usize> = (1..=hkv).filter(|d| hkv.is_multiple_of(*d)).collect();
            let nearest = valid.iter().min_by_key(|d| d.abs_diff(p)).copied().unwrap_or(1);
            bad.push((
                format!("dist.sp_degree {p} does not divide the model's {hkv} kv heads (Ulysses gives each rank whole kv heads)"),
                format!("the nearest valid degree is {nearest}; valid: {valid:?}"),
            ));
        }
        for (i, st) in stages.iter().enumerate().filter(|(_, st)| !st.seq_len.is_multiple_of(p)) {
            bad.push((
                format!("stage {i}: seq_len {} does not split into dist.sp_degree = {p} equal parts", st.seq_len),
                format!("use a seq_len divisible by {p} (harpe does not pad sequence-parallel sequences)"),
            ));
        }
        if !bad.is_empty() {
            let what: Vec<String> = bad.iter().map(|(w, _)| format!("{origin}: {w}")).collect();
            let hints: Vec<&str> = bad.iter().map(|(_, h)| h.as_str()).collect();
            bail!("{}\nhint: {}", what.join("\n"), hints.join("; "));
        }
        let dp = world / p;
        if dp > 1 {
            for (i, st) in stages.iter().enumerate() {
                rank_batching(origin, &format!("stage {i}"), st.micro_batches, st.micro_batch, dp)?;
            }
        }
        Ok(())
    }

    /// `dist.timeout_s` as a duration.
    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.timeout_s)
    }

    /// Elements of `elem_bytes` bytes per gradient bucket (at least 1).
    pub fn bucket_elems(&self, elem_bytes: usize) -> usize {
        ((self.bucket_mb * 1024.0 * 1024.0) as usize / elem_bytes.max(1)).max(1)
    }
}

/// Targets among positions `start..start + len` of sequences of `seq_len` tokens: every position
/// predicts the next token except the sequence's last (the one rule of targets: T tokens train T - 1;
/// a sequence-parallel rank's share is its positions' count, less one on the rank holding the last).
pub fn targets_in(start: usize, len: usize, seq_len: usize) -> usize {
    len - usize::from(start + len == seq_len)
}

/// How each data-parallel rank runs its part of an optimizer step of `micro_batches_per_step`
/// micro-batches of `micro_batch` sequences: (sequences per micro-batch, micro-batches), together
/// `micro_batches_per_step * micro_batch / dp_size` sequences. The step's sequences must split evenly
/// over the ranks (results must not depend on the world; the loader's stride gives the ranks exactly
/// one rank's sequences of the step); when a rank's share is not a multiple of `micro_batch`, it runs
/// smaller micro-batches (the largest common divisor), which changes memory and speed, never results.
pub fn rank_batching(
    origin: &str,
    stage: &str,
    micro_batches_per_step: usize,
    micro_batch: usize,
    dp_size: usize,
) -> Result<(usize, usize)> {
    let seqs = micro_batches_per_step * micro_batch;
    if dp_size == 0 || micro_batch == 0 || !seqs.is_multiple_of(dp_size) {
        bail!(
            "{origin}: {stage}: {seqs} sequences per optimizer step cannot be split evenly over \
             {dp_size} data-parallel ranks\nhint: make train.global_batch_tokens / seq_len a multiple of the \
             data-parallel world size"
        );
    }
    let per_rank = seqs / dp_size;
    let mut mb = micro_batch.min(per_rank);
    while !per_rank.is_multiple_of(mb) {
        mb -= 1;
    }
    Ok((mb, per_rank / mb))
}

/// `[log]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogSection {
    /// print a step line every N steps (metrics.jsonl gets every step)
    #[serde(default = "d_one_u64")]
    pub every: u64,
    /// show a progress bar with ETA per stage
    #[serde(default = "d_true")]
    pub progress: bool,
    /// write loss.png at the end
    #[serde(default = "d_true")]
    pub plot: bool,
    /// peak TFLOP/s of the device in the compute dtype, for the MFU column (0 = unknown, MFU not shown)
    #[serde(default)]
    pub peak_tflops: f64,
    /// write TensorBoard event files under RUN_DIR/tb/ (every step's scalars and every evaluation);
    /// left out of the resolved config at its default, so configs hashed before this key keep their hash
    #[serde(default = "d_true", skip_serializing_if = "is_true")]
    pub tensorboard: bool,
}

impl Default for LogSection {
    fn default() -> Self {
        LogSection { every: 1, progress: true, plot: true, peak_tflops: 0.0, tensorboard: true }
    }
}

/// `[eval]`: evaluate the training weights in place every `every` optimizer steps, at each stage's end
/// and at the end of the run. Each part runs only when its key is given.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalSection {
    /// evaluate every N optimizer steps (0 or absent: only at stage ends and at the end)
    #[serde(default)]
    pub every: u64,
    /// text inputs for sliding-window perplexity, as `eval-ppl --input` (.txt, .jsonl, directories)
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ppl_inputs: Vec<PathBuf>,
    /// perplexity window W (default: the current stage's seq_len)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ppl_window: Option<usize>,
    /// perplexity stride S (default: half the window)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ppl_stride: Option<usize>,
    /// cut each perplexity document to its first N tokens
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ppl_max_tokens: Option<usize>,
    /// passkey retrieval at these lengths in tokens
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub passkey_lengths: Vec<usize>,
    /// passkey samples per length
    #[serde(default = "d_passkey_samples")]
    pub passkey_samples: usize,
    /// BOS before each passkey prompt, as `eval-niah --bos` (auto: the tokenizer's own encoding)
    #[serde(default, skip_serializing_if = "crate::data::tokenize::PromptBos::is_auto")]
    pub passkey_bos: crate::data::tokenize::PromptBos,
    /// prepared dataset (from `harpe prepare-data`) for the loss by position bucket
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_data: Option<PathBuf>,
    /// upper ends of the loss position buckets, ascending (as `eval-loss --buckets`)
    #[serde(default = "d_loss_buckets")]
    pub loss_buckets: Vec<usize>,
    /// evaluate at most this many sequences of `loss_data`
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_max_sequences: Option<usize>,
    /// lm-evaluation-harness tasks scored once, on the final weights (as `eval-tasks --tasks`)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<String>,
    /// their files (as `eval-tasks --data`)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks_data: Option<PathBuf>,
    /// few-shot examples per prompt (as `eval-tasks --shots`): a count, or "mmlu=5,hellaswag=10,..."
    #[serde(default, skip_serializing_if = "TasksShots::is_default")]
    pub tasks_shots: TasksShots,
    /// the first N documents of each task (as `eval-tasks --limit`)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks_limit: Option<f64>,
}

impl Default for EvalSection {
    /// What an empty `[eval]` table gives.
    fn default() -> Self {
        EvalSection {
            every: 0,
            ppl_inputs: vec![],
            ppl_window: None,
            ppl_stride: None,
            ppl_max_tokens: None,
            passkey_lengths: vec![],
            passkey_samples: d_passkey_samples(),
            passkey_bos: Default::default(),
            loss_data: None,
            loss_buckets: d_loss_buckets(),
            loss_max_sequences: None,
            tasks: None,
            tasks_data: None,
            tasks_shots: TasksShots::default(),
            tasks_limit: None,
        }
    }
}

/// `[eval] tasks_shots`: `5` or `"mmlu=5,hellaswag=10"` (the syntax of `eval-tasks --shots`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TasksShots {
    Count(usize),
    PerTask(String),
}

impl Default for TasksShots {
    fn default() -> Self {
        TasksShots::Count(0)
    }
}

impl TasksShots {
    /// The default (0 shots), left out of the resolved config.
    pub fn is_default(&self) -> bool {
        *self == TasksShots::default()
    }

    /// As `eval-tasks --shots` reads it.
    pub fn arg(&self) -> String {
        match self {
            TasksShots::Count(n) => n.to_string(),
            TasksShots::PerTask(s) => s.clone(),
        }
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_true(b: &bool) -> bool {
    *b
}

fn d_passkey_samples() -> usize {
    10
}
fn d_loss_buckets() -> Vec<usize> {
    vec![4096, 32768, 131072]
}

impl EvalSection {
    /// Checks serde cannot express: the window rule, buckets, sample counts. The task list is checked
    /// against the task data by `eval::tasks::check_section` (`harpe train` calls it before it writes
    /// anything): config names no module above it.
    pub fn validate(&self, origin: &str) -> Result<()> {
        if let Some(w) = self.ppl_window {
            check_window(w, self.ppl_stride.unwrap_or((w / 2).max(1)))
                .map_err(|e| anyhow!("{origin}: [eval] ppl_window/ppl_stride: {e:#}"))?;
        } else if self.ppl_stride == Some(0) {
            bail!("{origin}: [eval] ppl_stride = 0 never advances\nhint: omit it (half the window) or give 1..=ppl_window");
        }
        if !self.passkey_lengths.is_empty() && self.passkey_samples == 0 {
            bail!("{origin}: [eval] passkey_samples = 0 with passkey_lengths set\nhint: e.g. passkey_samples = 10");
        }
        if self.tasks.is_some() != self.tasks_data.is_some() {
            bail!("{origin}: [eval] tasks and tasks_data go together\nhint: e.g. tasks = \"mmlu,hellaswag\" with tasks_data = \"data/tasks\"");
        }
        check_buckets(&self.loss_buckets, "[eval] loss_buckets").map_err(|e| anyhow!("{origin}: {e:#}"))
    }
}

/// The sliding-window rule of perplexity (`eval-ppl --window/--stride`, `[eval] ppl_window/ppl_stride`;
/// `eval::ppl::windows` applies it): a window holds at least 2 tokens and the stride advances.
pub fn check_window(window: usize, stride: usize) -> Result<()> {
    if window < 2 {
        bail!("--window {window} is too small\nhint: a window needs at least 2 tokens");
    }
    if stride == 0 {
        bail!("--stride 0 never advances\nhint: pass --stride between 1 and --window ({window})");
    }
    Ok(())
}

/// Position buckets of the loss report (`eval-loss --buckets`, `[eval] loss_buckets`): positive and
/// strictly ascending.
pub fn check_buckets(buckets: &[usize], what: &str) -> Result<()> {
    if buckets.is_empty() || buckets.windows(2).any(|w| w[0] >= w[1]) || buckets[0] == 0 {
        bail!("{what} {buckets:?} must be positive and strictly ascending\nhint: e.g. {what} 4096,32768,131072");
    }
    Ok(())
}

/// `[[stage]]`: one phase of training.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageSection {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// tokens per training sequence
    pub seq_len: usize,
    /// token budget (rounded up to whole optimizer steps)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// optimizer steps (instead of `tokens`)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<u64>,
    /// RoPE scheme of this stage (default: `[rope]`, then the model's own)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope: Option<RopeScheme>,
    /// prepared dataset of this stage (default: `[data] path`)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<PathBuf>,
    /// peak lr of this stage (default: `[optim] lr`)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// zero the AdamW moments at the start of this stage (default: `[optim] reset_between_stages`)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_optimizer: Option<bool>,
}

fn d_true() -> bool {
    true
}
fn d_one() -> usize {
    1
}
fn d_one_u64() -> u64 {
    1
}
fn d_max_pos() -> usize {
    4096
}
fn d_rms_eps() -> f64 {
    1e-5
}
fn d_init_range() -> f64 {
    0.02
}
fn d_loss_chunk() -> usize {
    4096
}
fn d_bad_steps() -> u32 {
    5
}
fn d_lr() -> f64 {
    2e-5
}
fn d_beta1() -> f64 {
    0.9
}
fn d_beta2() -> f64 {
    0.95
}
fn d_eps() -> f64 {
    1e-8
}
fn d_clip() -> f64 {
    1.0
}
fn d_keep() -> usize {
    3
}
fn d_shard() -> usize {
    crate::model::weights::DEFAULT_MAX_SHARD_BYTES
}

/// A loaded recipe: the config, its resolved TOML text and that text's sha256.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub cfg: RunConfig,
    pub toml: String,
    pub hash: String,
}

/// Apply one `a.b.c=value` override to a TOML table; `value` is parsed as a TOML value (a bare word
/// that is not valid TOML is taken as a string); numeric path segments index arrays (`stage.0.lr=1e-5`).
pub fn apply_override(root: &mut toml::Table, spec: &str) -> Result<()> {
    let (key, raw) = spec.split_once('=').ok_or_else(|| {
        anyhow!("--set `{spec}` has no `=`\nhint: write --set section.key=value, e.g. --set optim.lr=1e-5")
    })?;
    let key = key.trim();
    let raw = raw.trim();
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").ok_or_else(|| anyhow!("--set {key}: empty value"))?,
        Err(_) => toml::Value::String(raw.to_string()),
    };
    let parts: Vec<&str> = key.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        bail!("--set `{spec}`: empty key segment\nhint: write --set section.key=value");
    }
    let mut cur = root;
    for (i, part) in parts[..parts.len() - 1].iter().enumerate() {
        let path = parts[..=i].join(".");
        let entry = cur.entry(part.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = match entry {
            toml::Value::Table(t) => t,
            toml::Value::Array(a) => {
                let idx: usize = parts.get(i + 1).and_then(|s| s.parse().ok()).ok_or_else(|| {
                    anyhow!("--set {key}: `{path}` is a list\nhint: index it, e.g. --set {path}.0.<key>=value")
                })?;
                let len = a.len();
                let item = a
                    .get_mut(idx)
                    .ok_or_else(|| anyhow!("--set {key}: `{path}` has {len} entries, index {idx} is out of range\nhint: indices start at 0"))?;
                // the index segment is consumed here; the loop continues on the element
                return set_in_element(item, &parts[i + 2..], value, key);
            }
            _ => bail!("--set {key}: `{path}` is not a table\nhint: check the key path against the config file"),
        };
    }
    cur.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

fn set_in_element(item: &mut toml::Value, rest: &[&str], value: toml::Value, key: &str) -> Result<()> {
    let toml::Value::Table(t) = item else {
        bail!("--set {key}: the indexed entry is not a table\nhint: check the key path");
    };
    if rest.is_empty() {
        bail!("--set {key}: missing the key inside the entry\nhint: e.g. --set stage.0.lr=1e-5");
    }
    let mut sub = t.clone();
    apply_override(&mut sub, &format!("{}={}", rest.join("."), value))?;
    *t = sub;
    Ok(())
}

/// One step of a key path in a TOML document.
#[derive(Clone, Debug)]
enum Seg {
    Key(String),
    Index(usize),
}

/// `cfg` as a TOML table of only the keys that matter: a key is left out when the value its absence
/// gives (serde's default) is the value it has. Found by trial, deepest keys first, so a section left
/// with no keys is left out too where the section has a default (each section's `Default` is its empty
/// table, a test holds it); what serde cannot default stays. The basis of the config hash: a defaulted
/// key added to a section later does not change it.
pub fn without_defaults<T: Serialize + serde::de::DeserializeOwned + PartialEq>(cfg: &T) -> Result<toml::Table> {
    let full = toml::Table::try_from(cfg).context("cannot serialize the config")?;
    let same = |t: &toml::Table| toml::Value::Table(t.clone()).try_into::<T>().is_ok_and(|c| &c == cfg);
    fn paths(v: &toml::Value, at: &mut Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    at.push(Seg::Key(k.clone()));
                    out.push(at.clone());
                    paths(v, at, out);
                    at.pop();
                }
            }
            toml::Value::Array(a) => {
                for (i, v) in a.iter().enumerate().filter(|(_, v)| v.is_table()) {
                    at.push(Seg::Index(i));
                    paths(v, at, out); // the element itself is never removed: a list keeps its length
                    at.pop();
                }
            }
            _ => {}
        }
    }
    fn remove(v: &mut toml::Value, path: &[Seg]) -> bool {
        match (v, path) {
            (toml::Value::Table(t), [Seg::Key(k)]) => t.remove(k).is_some(),
            (toml::Value::Table(t), [Seg::Key(k), rest @ ..]) => t.get_mut(k).is_some_and(|v| remove(v, rest)),
            (toml::Value::Array(a), [Seg::Index(i), rest @ ..]) => a.get_mut(*i).is_some_and(|v| remove(v, rest)),
            _ => false,
        }
    }
    let root = toml::Value::Table(full);
    let mut all = vec![];
    paths(&root, &mut vec![], &mut all);
    all.sort_by_key(|p| std::cmp::Reverse(p.len())); // stable: document order within a depth
    let mut work = root;
    for p in &all {
        let mut trial = work.clone();
        if remove(&mut trial, p) && trial.as_table().is_some_and(&same) {
            work = trial;
        }
    }
    match work {
        toml::Value::Table(t) => Ok(t),
        _ => unreachable!("the root stays a table"),
    }
}

/// Deserialize TOML text into a `RunConfig`; errors name `origin` and the line/key toml points at.
fn parse(text: &str, origin: &str) -> Result<RunConfig> {
    toml::from_str::<RunConfig>(text).map_err(|e| {
        anyhow!("{origin}: {}\nhint: see configs/tiny-cpu.toml for every section and key", e.to_string().trim_end())
    })
}

impl RunConfig {
    /// Read a recipe file, apply `--set` overrides, validate, and resolve.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Resolved> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "cannot read config {}\nhint: pass an existing TOML recipe, e.g. configs/tiny-cpu.toml",
                path.display()
            )
        })?;
        let origin = path.display().to_string();
        Self::from_text(&text, &origin, overrides)
    }

    /// Like `load`, from text (`origin` names it in errors).
    pub fn from_text(text: &str, origin: &str, overrides: &[String]) -> Result<Resolved> {
        let cfg = if overrides.is_empty() {
            parse(text, origin)?
        } else {
            let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
                anyhow!("{origin}: {}\nhint: fix the TOML syntax", e.to_string().trim_end())
            })?;
            for o in overrides {
                apply_override(&mut table, o)?;
            }
            let merged = toml::to_string(&table)?;
            parse(&merged, &format!("{origin} with --set {}", overrides.join(" --set ")))?
        };
        cfg.validate(origin)?;
        let toml = toml::to_string_pretty(&cfg).context("cannot serialize the resolved config")?;
        let hash = cfg.hash(false)?;
        Ok(Resolved { cfg, toml, hash })
    }

    /// sha256 of the config's keys that differ from their defaults (`without_defaults`), so a key added
    /// to harpe with a default leaves the hash of every existing recipe as it was. `results_only`: the
    /// `[dist]` table left out (how a run is computed, never what it computes).
    pub fn hash(&self, results_only: bool) -> Result<String> {
        let mut t = without_defaults(self)?;
        if results_only {
            t.remove("dist");
        }
        Ok(crate::util::sha256_hex(toml::to_string(&t)?.as_bytes()))
    }

    /// Checks that serde cannot express.
    pub fn validate(&self, origin: &str) -> Result<()> {
        match (&self.model.path, &self.model.init) {
            (None, None) => bail!("{origin}: [model] needs `path` (an HF model directory) or a [model.init] table\nhint: see configs/tiny-cpu.toml for random initialization"),
            (Some(_), Some(_)) => bail!("{origin}: [model] has both `path` and [model.init]\nhint: keep one: continue from a checkpoint or initialize randomly"),
            _ => {}
        }
        if self.stages.is_empty() {
            bail!("{origin}: no [[stage]] table\nhint: add one, e.g.\n[[stage]]\nseq_len = 4096\ntokens = 1_000_000");
        }
        for (i, s) in self.stages.iter().enumerate() {
            let what = format!("{origin}: stage {i}{}", s.name.as_ref().map(|n| format!(" ({n})")).unwrap_or_default());
            match (s.tokens, s.steps) {
                (None, None) => bail!("{what} has no budget\nhint: give it `tokens = N` or `steps = N`"),
                (Some(_), Some(_)) => bail!("{what} has both `tokens` and `steps`\nhint: keep one budget"),
                (Some(0), _) | (_, Some(0)) => {
                    bail!("{what} has a zero budget\nhint: give a positive `tokens` or `steps`")
                }
                _ => {}
            }
            if s.seq_len < 2 {
                bail!("{what}: seq_len {} is too short\nhint: a training sequence needs at least 2 tokens", s.seq_len);
            }
            if let Some(lr) = s.lr {
                if !(lr.is_finite() && lr >= 0.0) {
                    bail!("{what}: lr {lr} is not a non-negative number\nhint: e.g. lr = 2e-5");
                }
            }
            // Checked: a huge or zero value must be an error, not an overflow or a division by 0.
            let Some(tokens_per_micro) = self.train.micro_batch_size.checked_mul(s.seq_len).filter(|&t| t > 0) else {
                bail!(
                    "{what}: train.micro_batch_size x seq_len = {} x {} is zero or out of range\nhint: e.g. micro_batch_size = 1",
                    self.train.micro_batch_size,
                    s.seq_len
                );
            };
            if let Some(g) = self.train.global_batch_tokens {
                if g == 0 || g % tokens_per_micro != 0 {
                    bail!(
                        "{what}: train.global_batch_tokens {g} is not a positive multiple of micro_batch_size x seq_len = {tokens_per_micro}\nhint: choose a global batch that every stage divides"
                    );
                }
            }
            if self.data.source == DataSource::Prepared && s.data.is_none() && self.data.path.is_none() {
                bail!("{what} has no dataset\nhint: set [data] path = \"DIR\" (from harpe prepare-data), `data = \"DIR\"` in the stage, or [data] source = \"builtin\"");
            }
        }
        if self.train.dtype == ComputeDtype::F16 {
            bail!("{origin}: train.dtype = \"f16\" is not supported for training (no loss scaling)\nhint: use \"bf16\" or \"f32\"");
        }
        if self.train.micro_batch_size == 0 {
            bail!("{origin}: train.micro_batch_size must be > 0\nhint: e.g. micro_batch_size = 1");
        }
        if self.train.loss_chunk_tokens == 0 {
            bail!("{origin}: train.loss_chunk_tokens must be > 0\nhint: e.g. loss_chunk_tokens = 4096");
        }
        if let Checkpointing::Every(0) = self.train.activation_checkpointing {
            bail!("{origin}: train.activation_checkpointing = {{ every = 0 }} is invalid\nhint: use \"none\", \"every-layer\" or {{ every = k }} with k >= 1");
        }
        for (k, v) in [("beta1", self.optim.beta1), ("beta2", self.optim.beta2)] {
            if !(0.0..1.0).contains(&v) {
                bail!("{origin}: optim.{k} = {v} must be in [0, 1)\nhint: the paper uses beta1 = 0.9, beta2 = 0.95");
            }
        }
        if !(self.optim.lr.is_finite() && self.optim.lr >= 0.0 && self.optim.eps > 0.0) {
            bail!("{origin}: optim.lr must be >= 0 and optim.eps > 0\nhint: e.g. lr = 2e-5, eps = 1e-8");
        }
        if let Some(e) = &self.eval {
            e.validate(origin)?;
        }
        if let Some(a) = &self.model.init {
            if a.num_hidden_layers == 0 || a.hidden_size == 0 || a.num_attention_heads == 0 || a.vocab_size == 0 {
                bail!("{origin}: [model.init] sizes must be > 0\nhint: see configs/tiny-cpu.toml");
            }
        }
        // the world-dependent rules again with the real world and model (`train` and `plan`)
        let kv_heads = self.model.init.as_ref().map(|a| a.kv_heads());
        self.dist.validate(origin, self.dist.world_size, kv_heads, &self.stage_batches())?;
        Ok(())
    }

    /// The perplexity window and stride of `[eval]` during stage `i` (defaults: seq_len and half of it).
    pub fn eval_ppl_window(&self, i: usize) -> Option<(usize, usize)> {
        let e = self.eval.as_ref()?;
        let w = e.ppl_window.unwrap_or(self.stages[i].seq_len);
        Some((w, e.ppl_stride.unwrap_or((w / 2).max(1))))
    }

    /// Optimizer steps of stage `i` and its tokens per step.
    pub fn stage_steps(&self, i: usize) -> (u64, u64) {
        let s = &self.stages[i];
        let per_step = self.tokens_per_step(i) as u64;
        let steps = match (s.steps, s.tokens) {
            (Some(n), _) => n,
            (None, Some(t)) => t.div_ceil(per_step).max(1),
            (None, None) => 0,
        };
        (steps, per_step)
    }

    /// Tokens in one optimizer step of stage `i`.
    pub fn tokens_per_step(&self, i: usize) -> usize {
        self.train.global_batch_tokens.unwrap_or(self.train.micro_batch_size * self.stages[i].seq_len)
    }

    /// Target tokens of one optimizer step of stage `i` over all ranks: the loss is their mean, so each
    /// micro-batch's nll sum is scaled by its inverse.
    pub fn targets_per_step(&self, i: usize) -> usize {
        let t = self.stages[i].seq_len;
        self.tokens_per_step(i) / t * targets_in(0, t, t)
    }

    /// Every stage's batch as `[dist]`'s rules see it.
    pub fn stage_batches(&self) -> Vec<StageBatch> {
        (0..self.stages.len())
            .map(|i| StageBatch {
                seq_len: self.stages[i].seq_len,
                micro_batches: self.accumulation(i),
                micro_batch: self.train.micro_batch_size,
            })
            .collect()
    }

    /// Micro-batches accumulated per optimizer step in stage `i`.
    pub fn accumulation(&self, i: usize) -> usize {
        self.tokens_per_step(i) / (self.train.micro_batch_size * self.stages[i].seq_len)
    }

    /// RoPE scheme of stage `i`: its own, else `[rope]`, else None (the model's own).
    pub fn stage_rope(&self, i: usize) -> Option<RopeScheme> {
        self.stages[i].rope.clone().or_else(|| self.rope.clone())
    }

    /// RoPE scheme a randomly initialized model starts with: `[rope]`, else the first stage's.
    pub fn initial_rope(&self) -> Option<RopeScheme> {
        self.rope.clone().or_else(|| self.stages.iter().find_map(|s| s.rope.clone()))
    }

    /// Peak learning rate of stage `i` (default: `[optim] lr`).
    pub fn stage_lr(&self, i: usize) -> f64 {
        self.stages[i].lr.unwrap_or(self.optim.lr)
    }

    /// Whether entering stage `i` zeroes the AdamW moments (default: `[optim] reset_between_stages`).
    pub fn stage_resets_optimizer(&self, i: usize) -> bool {
        self.stages[i].reset_optimizer.unwrap_or(self.optim.reset_between_stages)
    }
}

impl ArchSection {
    /// Key/value heads (default: num_attention_heads, i.e. MHA).
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Head dimension (default: hidden_size / num_attention_heads).
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `without_defaults` leaves out a section whose keys are all at their defaults, so a section's
    /// `Default` (what its absence gives) must be what an empty `[section]` gives, or a recipe with
    /// the empty section and one without it would hash alike while differing.
    #[test]
    fn an_absent_section_is_the_empty_section() {
        fn same<T: serde::de::DeserializeOwned + Default + PartialEq + std::fmt::Debug>(name: &str) {
            let empty: T = toml::from_str("").unwrap_or_else(|e| panic!("[{name}] = {{}}: {e}"));
            assert_eq!(empty, T::default(), "[{name}]: Default differs from the serde defaults of its keys");
        }
        same::<ModelSection>("model");
        same::<DataSection>("data");
        same::<TrainSection>("train");
        same::<OptimSection>("optim");
        same::<ScheduleSection>("schedule");
        same::<CheckpointSection>("checkpoint");
        same::<DistSection>("dist");
        same::<LogSection>("log");
        same::<EvalSection>("eval");
    }

    const BASE: &str = r#"
[model.init]
vocab_size = 300
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4

[data]
source = "builtin"

[[stage]]
seq_len = 64
steps = 3

[[stage]]
seq_len = 128
tokens = 1000
rope = { scheme = "default", theta = 500000.0 }
"#;

    #[test]
    fn defaults_stages_and_overrides() {
        let r = RunConfig::from_text(BASE, "t.toml", &[]).unwrap();
        assert_eq!(r.cfg.optim.lr, 2e-5);
        assert_eq!(r.cfg.train.activation_checkpointing, Checkpointing::EveryLayer);
        assert_eq!(r.cfg.stage_steps(0), (3, 64));
        assert_eq!(r.cfg.stage_steps(1), (8, 128));
        let o = RunConfig::from_text(
            BASE,
            "t.toml",
            &["optim.lr=1e-3".into(), "stage.1.lr=5e-4".into(), "train.activation_checkpointing={ every = 2 }".into()],
        )
        .unwrap();
        assert_eq!(o.cfg.optim.lr, 1e-3);
        assert_eq!(o.cfg.stages[1].lr, Some(5e-4));
        assert_eq!(o.cfg.train.activation_checkpointing, Checkpointing::Every(2));
        assert_ne!(o.hash, r.hash);
        // the resolved text parses back to the same config
        assert_eq!(RunConfig::from_text(&r.toml, "resolved", &[]).unwrap().cfg, r.cfg);
    }

    #[test]
    fn bad_input_names_the_key_and_hints() {
        let e = format!(
            "{:#}",
            RunConfig::from_text(BASE, "t.toml", &["train.micro_batch_size=\"two\"".into()]).unwrap_err()
        );
        assert!(e.contains("micro_batch_size") && e.contains("hint:"), "{e}");
        let e = format!(
            "{:#}",
            RunConfig::from_text(&format!("{BASE}\n[optim]\nlearning_rate = 1\n"), "t.toml", &[]).unwrap_err()
        );
        assert!(e.contains("learning_rate") && e.contains("t.toml"), "{e}");
        let nob = BASE.replace("steps = 3", "");
        let e = format!("{:#}", RunConfig::from_text(&nob, "t.toml", &[]).unwrap_err());
        assert!(e.contains("stage 0 has no budget") && e.contains("hint:"), "{e}");
        let e = format!("{:#}", RunConfig::from_text(BASE, "t.toml", &["stage.5.lr=1".into()]).unwrap_err());
        assert!(e.contains("out of range"), "{e}");
    }
}
