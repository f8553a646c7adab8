//! `harpe train`, the training stage as a folder. Read it in this order:
//!
//! - `training_loop.rs` — THE loop (`run_rank`): for every stage `Stage::open`, for every step
//!   `train_step` (data -> model -> chunked loss -> layer-wise backward -> gradient reduction -> clip ->
//!   AdamW on this rank's fp32 shard -> weights published), `log_step`, `check_bad_streak`,
//!   `maybe_evaluate` (`[eval]`), `maybe_checkpoint`; a single `finish` at the end, also on a signal.
//!   Reference: llm.c `train_gpt2.cu` "TRAINING SECTION" (one straight loop).
//! - `step.rs` — `forward_backward`: one micro-batch's forward and backward with activation
//!   checkpointing (`Params`: where the weights come from and where the gradients go).
//! - `params.rs` — `Sharding`, the one owner of the ZeRO stage (applied from outside: the loop, the stage
//!   and the step read the same for every stage): the stage's model and gradient buffer, which weights
//!   each micro-batch gathers, prefetches and frees and where its gradients go (`Params`), the step's
//!   gradient reduction, the publish of updated weights, the full-weight gather of a checkpoint or an
//!   evaluation.
//! - `batch.rs` — a batch's tensors (ids, targets, document starts); `trainable.rs` — the model as
//!   `Var`s; `loss_sums.rs` — the step's loss sums on the device.
//! - `session.rs` — `Run`: everything a session holds (config, run directory, device, communicator,
//!   optimizer, state), opened once, resumed from a checkpoint.
//! - `stage.rs` — `Stage`: one stage's model, data and step arithmetic.
//! - `launch.rs` — `run`: the backend (one rank, `Local` rank threads, an NCCL process), the plan check
//!   and the `--nproc-per-node` spawner.
//! - `run_dir.rs` — `RunDir`, the run directory's layout; `checkpoint/`, `metrics.rs`,
//!   `tensorboard.rs` — what the loop writes (the loss it computes is `model::loss`).
//!
//! The non-obvious decisions (the HARPE paper's §4 recipe: multi-stage ABF, constant lr 2e-5, AdamW 0.9/0.95):
//! - Activation checkpointing is done by hand on top of candle's autograd (Chen et al. 2016): the
//!   forward keeps only the input of every segment of k layers (detached), then the backward walks the
//!   segments from the last to the first, recomputing each one from a fresh `Var` of its input and
//!   back-propagating `sum(out * grad_out)`, whose gradient is exactly `grad_out`. The last segment
//!   keeps its graph from the forward, so "none" (one segment) never recomputes anything.
//! - Loss is token-mean over all target tokens of the optimizer step (`RunConfig::targets_per_step`,
//!   the one count), so each micro-batch's nll sum is scaled by 1 / (targets of the whole step): k
//!   micro-batches give the gradient of one k-times batch, N ranks the gradient of one rank.
//! - Weights the model computes with are candle `Var`s in the compute dtype; the optimizer owns fp32
//!   master weights and moments of its shard (`FlatBuf`s); after each update the shards are all-gathered
//!   bucket by bucket in the compute dtype straight into every parameter's `Var` (`zero::publish`), and
//!   a stage's model is built the same way from the master shards (`zero::gather_params`, through
//!   `Sharding`): no rank keeps a full fp32 copy of the weights beside the compute weights.
//! - The communicator comes from `[dist]`; with one rank every collective is a no-op, so the loop has no
//!   `if distributed` branches. `config::ZeroStage` changes only where parameters and gradients live,
//!   never the order of the loop: the loop and `Stage` ask `Sharding` and never name the stage. Rank 0
//!   alone writes the run directory.
//! - Sequence parallelism (`dist.sp_degree` = P): the P ranks of a group read the same sequences; each
//!   computes tokens sp_rank*T/P.. with RoPE tables at those global positions, attention goes through
//!   the Ulysses exchange (`comms::sequence`), and the loss counts each rank's own targets, so the
//!   gradient sum over all ranks is the one-rank gradient.
//! - `train.document_mask` (default off: Fu et al. train without it): each micro-batch's document starts
//!   become a `DocStarts` of the WHOLE sequences, passed to every layer's attention in the forward and
//!   in every recompute (ZeRO-3 included). RoPE positions stay the packed ones.
//!
//! What this folder does not do: the evaluation rules (eval/: `eval.rs` here only calls the eval commands'
//! scoring on the training weights), the collectives (comms/), the flat training-state buffers, the
//! gradient buffers and the loss (`flatbuf`, `grads`, `loss`: shared with `optim`, `comms`, `eval` and
//! `model`, so they live below this folder; the parameter layout is `model::layout`).
mod args;
mod batch;
pub mod checkpoint;
mod eval;
mod launch;
mod loss_sums;
pub mod metrics;
pub mod oom;
pub mod plan;
mod run_dir;
mod session;
mod stage;
mod params;
mod step;
mod trainable;
pub mod tensorboard;
mod training_loop;

pub use args::TrainArgs;
pub use batch::{batch_tensors, check_document_mask, doc_starts};
pub use launch::run;
pub use loss_sums::LossSums;
pub use params::Params;
pub use run_dir::RunDir;
pub use session::results_hash;
pub use step::{forward_backward, Backward, MicroBatch, MicroOut};
pub use trainable::{trainable_model, trainable_model_from};
