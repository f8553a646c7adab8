//! One serde struct per TOML section of the recipe, each key's default beside it (the `d_*` functions;
//! a section's `Default` is what its empty table gives, a test in `hash.rs` holds it), and the small
//! questions a section answers about itself (a stage's RoPE scheme or lr, a model's kv heads).
//!
//! Apart from the rules that need several sections at once (`validate.rs`) and the batch arithmetic
//! (`batch.rs`), so a reader sees what a run can be told in one place and nothing else there.
use super::zero_stage::ZeroStage;
use crate::device::{ComputeDtype, DeviceSpec};
use crate::model::rope::RopeScheme;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

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

/// `[train] attention` (defined beside the attention seam it chooses for, `model::attention`).
pub use crate::model::attention::TrainAttention;

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
    /// attention kernels on CUDA: "auto" (FlashAttention-2's where built and the model fits them, else
    /// harpe's), "harpe" or "flash2"; `harpe train --attention` sets it
    #[serde(default, skip_serializing_if = "TrainAttention::is_auto")]
    pub attention: TrainAttention,
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
            attention: TrainAttention::Auto,
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

impl DistSection {
    /// `dist.timeout_s` as a duration.
    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.timeout_s)
    }

    /// Elements of `elem_bytes` bytes per gradient bucket (at least 1).
    pub fn bucket_elems(&self, elem_bytes: usize) -> usize {
        ((self.bucket_mb * 1024.0 * 1024.0) as usize / elem_bytes.max(1)).max(1)
    }
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

/// The values serde fills in for absent keys (`#[serde(default = "d_...")]`), one function each as
/// serde asks.
macro_rules! defaults {
    ($($name:ident: $t:ty = $v:expr;)*) => {
        $(fn $name() -> $t {
            $v
        })*
    };
}
defaults! {
    d_true: bool = true;
    d_one: usize = 1;
    d_one_u64: u64 = 1;
    d_max_pos: usize = 4096;
    d_rms_eps: f64 = 1e-5;
    d_init_range: f64 = 0.02;
    d_loss_chunk: usize = 4096;
    d_bad_steps: u32 = 5;
    d_lr: f64 = 2e-5;
    d_beta1: f64 = 0.9;
    d_beta2: f64 = 0.95;
    d_eps: f64 = 1e-8;
    d_clip: f64 = 1.0;
    d_keep: usize = 3;
    d_shard: usize = crate::model::weights::DEFAULT_MAX_SHARD_BYTES;
}

impl RunConfig {
    /// The perplexity window and stride of `[eval]` during stage `i` (defaults: seq_len and half of it).
    pub fn eval_ppl_window(&self, i: usize) -> Option<(usize, usize)> {
        let e = self.eval.as_ref()?;
        let w = e.ppl_window.unwrap_or(self.stages[i].seq_len);
        Some((w, e.ppl_stride.unwrap_or((w / 2).max(1))))
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
