//! THE training loop of one rank (`run_rank`), read top to bottom like llm.c's training section: for
//! every stage `Stage::open`; for every step `train_step`, `log_step`, `check_bad_streak`,
//! `maybe_evaluate`, `agree_stop`, `maybe_checkpoint`; one `finish` at the end, also on a signal.
//!
//! The non-obvious decision (STYLE 18): whether to stop is decided once per step through a collective
//! (`agree_stop`), and everything after it acts on that agreed answer only: a signal that lands on one
//! rank after the agreement is seen by every rank at the next step's agreement, never by one rank
//! alone (which would leave its peers waiting in the next step's collectives).
use super::args::TrainArgs;
use super::batch::{batch_tensors, doc_starts};
use super::eval::{eval_line, EvalPoint, TrainEval};
use super::loss_sums::LossSums;
use super::oom::{self, Phase};
use super::session::Run;
use super::stage::Stage;
use super::step::{forward_backward, Backward, MicroBatch};
use crate::checksum::FileSum;
use crate::comms::sequence::SpGroup;
use crate::comms::Comm;
use crate::config::targets_in;
use crate::data::loader::source_name;
use crate::data::Sequence;
use crate::grads;
use crate::model::attention::AttentionImpl;
use crate::model::weights::{save_model_dir, WrittenFiles};
use crate::model::Llama;
use crate::optim::schedule::Progress;
use crate::testing::hooks;
use crate::train::checkpoint;
use crate::train::metrics::{self, mem, StepRecord};
use crate::train::tensorboard;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// The training loop of one rank.
pub(super) fn run_rank(args: &TrainArgs, comm: Comm, sp: Option<SpGroup>) -> Result<()> {
    let mut r = Run::open(args, comm, sp)?;
    // `[eval]` runs on every rank, each scoring its share of the items (`eval::share`); rank 0 alone
    // reads the evaluations already logged and tells the others
    let metrics = r.run_dir.metrics();
    let logged = (r.mesh.rank() == 0).then_some(metrics.as_path());
    let mut ev = TrainEval::open(r.cfg.eval.as_ref(), &r.tokenizer, &r.tok_sha, logged, r.cfg.train.loss_chunk_tokens)?;
    if let Some(ev) = ev.as_mut() {
        ev.agree_logged(&r.comm)?;
    }
    let mut end = End::Done;
    'stages: for si in r.state.stage..r.cfg.stages.len() {
        let mut stage = Stage::open(&mut r, si).map_err(|e| oom::name(e, Phase::Weights))?;
        while r.state.stage_step < stage.steps {
            if r.state.step >= r.limit {
                break 'stages;
            }
            r.comm.progress(&format!("in step {}", r.state.step + 1));
            let out = train_step(&mut r, &mut stage)?;
            r.settle_share_check()?;
            log_step(&mut r, &stage, &out)?;
            r.check_bad_streak()?;
            maybe_evaluate(&mut r, &stage, ev.as_mut())?;
            let stop = agree_stop(&r)?;
            maybe_checkpoint(&mut r, &stage, &out, stop)?;
            if stop {
                stage.close();
                end = End::Signal;
                break 'stages;
            }
        }
        stage.close();
    }
    r.settle_share_check()?;
    finish(&r, end)
}

/// The one stop decision of a step: whether any rank has seen SIGINT/SIGTERM, agreed through a
/// collective. The loop acts on this answer only, never on the raw flag.
fn agree_stop(r: &Run) -> Result<bool> {
    let stop = !r.comm.all_ok(!r.stop.load(Ordering::SeqCst))?;
    injected_late_signal(r);
    Ok(stop)
}

/// Test hook of the stop decision (`testing::LATE_SIGNAL`): raise the stop flag on the chosen rank
/// right after the chosen step's agreement; every rank must still stop together, one step later.
fn injected_late_signal(r: &Run) {
    if let Some((rank, step)) = hooks().late_signal {
        if rank == r.mesh.rank() && step == r.state.step {
            r.stop.store(true, Ordering::SeqCst);
        }
    }
}

/// What one optimizer step measured.
struct StepOut {
    loss: f64,
    grad_norm: f64,
    lr: f64,
    skipped: bool,
    per_source: BTreeMap<String, (f64, f64)>,
    seconds: f64,
    start_bytes: u64,
    /// every rank's device peak of the step, (allocated, reserved); empty off CUDA
    device_peaks: Vec<(u64, u64)>,
}

/// One optimizer step: `accum` micro-batches forward/backward, gradient reduction, norm, then either
/// a skip (non-finite loss or gradient) or clip + AdamW on this rank's shard + publish of the weights.
fn train_step(r: &mut Run, s: &mut Stage) -> Result<StepOut> {
    if r.leads_process() {
        mem::reset_peak(); // process-wide: one reset per step and process (rank threads share one)
        crate::device::reset_device_peak(&r.device)?; // likewise per device: every GPU rank resets its own
    }
    let start_bytes = mem::rss_bytes();
    let t0 = Instant::now();
    s.grads.reset()?;
    let mut sums = LossSums::new(s.sources.len(), &r.device)?;
    let mut targets_seen = 0f64;
    for _ in 0..s.accum {
        targets_seen += micro_step(r, s, &mut sums).map_err(|e| oom::name(e, Phase::Activations))?;
    }
    let grad_norm = r.sharding().reduce_grads(&mut s.grads).map_err(|e| oom::name(e, Phase::Reduction))?;
    // nll sum, target count, then (nll sum, count) per source id, summed over ranks
    let (nll_sum, by_source) = sums.read()?;
    let mut reduced: Vec<f64> = [nll_sum, targets_seen].iter().chain(&by_source).copied().collect();
    r.comm.all_reduce_sum_f64(&mut reduced)?;
    let loss = reduced[0] / reduced[1];
    let per_source: BTreeMap<String, (f64, f64)> = reduced[2..]
        .chunks_exact(2)
        .enumerate()
        .filter(|(_, c)| c[1] > 0.0)
        .map(|(i, c)| (source_name(&s.sources, Some(i as u32)), (c[0], c[1])))
        .collect();
    let at = Progress {
        stage_step: r.state.stage_step,
        stage_steps: s.steps,
        step: r.state.step,
        total_steps: r.total_steps,
    };
    let lr = r.sched.lr(s.lr_peak, at);
    let skipped = !(loss.is_finite() && grad_norm.is_finite());
    if skipped {
        r.bad_streak += 1;
        r.state.skipped_steps += 1;
    } else {
        r.bad_streak = 0;
        grads::clip_by_global_norm(s.grads.buf_mut(), grad_norm, r.cfg.optim.grad_clip)?;
        r.optim.step(s.grads.buf(), lr).map_err(|e| oom::name(e, Phase::Optimizer))?;
        r.sharding().publish(&s.vars)?;
    }
    r.state.step += 1;
    r.state.stage_step += 1;
    r.state.tokens_seen += s.tokens_per_step;
    r.state.data_cursor = serde_json::to_value(s.loader.cursor())?;
    let seconds = t0.elapsed().as_secs_f64();
    let device_peaks = r.device_peaks()?;
    Ok(StepOut { loss, grad_norm, lr, skipped, per_source, seconds, start_bytes, device_peaks })
}

/// One micro-batch: this rank's sequences and tokens, forward and backward (gradients scaled by the
/// whole step's target count), its loss added to `sums`; returns its target count.
fn micro_step(r: &mut Run, s: &mut Stage, sums: &mut LossSums) -> Result<f64> {
    let seqs: Vec<Sequence> = (0..s.bsz).map(|_| s.loader.next_sequence()).collect::<Result<_>>()?;
    let toks: Vec<&[u32]> = seqs.iter().map(|q| q.tokens.as_slice()).collect();
    let (ids, targets) = batch_tensors(&toks, r.base_cfg.vocab_size, &r.device).with_context(|| {
        let idx: Vec<u64> = seqs.iter().map(|q| q.index).collect();
        format!("stage {} step {}: dataset sequences {idx:?} (in batch row order)", s.si, r.state.step + 1)
    })?;
    // the document mask is over the whole (global) sequences, also under sequence parallelism
    let docs = if r.cfg.train.document_mask { Some(doc_starts(&seqs, &r.device)?) } else { None };
    // sequence parallelism: this rank's tokens and their targets (the last rank's last one is ignored)
    let (ids, targets) = if s.tok_len == s.seq_len {
        (ids, targets)
    } else {
        let tg = targets.reshape((s.bsz, s.seq_len))?.narrow(1, s.tok_start, s.tok_len)?;
        (ids.narrow(1, s.tok_start, s.tok_len)?.contiguous()?, tg.flatten_all()?.contiguous()?)
    };
    let mut params = r.sharding().params(&s.vars, &mut s.grads);
    let batch = MicroBatch { ids: &ids, targets: &targets, tables: &s.tables, docs: docs.as_ref() };
    let how = Backward { seg: s.seg, loss_chunk: r.cfg.train.loss_chunk_tokens, scale: 1.0 / s.targets_per_step };
    let out = forward_backward(&s.model, &mut params, &batch, how)?;
    injected_fault(r.mesh.rank(), r.state.step)?;
    sums.add(&out.nll, &seqs, s.tok_start, s.tok_len)?;
    Ok((s.bsz * targets_in(s.tok_start, s.tok_len, s.seq_len)) as f64)
}

/// The test hook of the multi-rank failure paths (`testing::FAULT`): the chosen rank fails after a
/// micro-batch of the chosen step (0-based, before that step's gradient collectives), so tests can check
/// that the other ranks stop, naming it, and that the last checkpoint stays intact.
fn injected_fault(rank: usize, step: u64) -> Result<()> {
    match hooks().fault {
        Some(f) if f.rank == rank && f.step == step && f.panic => {
            panic!("HARPE_FAULT: injected panic on rank {rank} at step {step}")
        }
        Some(f) if f.rank == rank && f.step == step => {
            bail!("HARPE_FAULT: injected error on rank {rank} at step {step}")
        }
        _ => Ok(()),
    }
}

/// Append the step's record to metrics.jsonl; print a line every `log.every` steps and on a skip.
fn log_step(r: &mut Run, s: &Stage, out: &StepOut) -> Result<()> {
    let tokens = s.tokens_per_step;
    let tflops = s.flops_tok * tokens as f64 / out.seconds / 1e12;
    let rec = StepRecord {
        step: r.state.step,
        stage: s.si,
        seq_len: s.seq_len,
        loss: out.loss,
        grad_norm: out.grad_norm,
        lr: out.lr,
        tokens,
        tokens_seen: r.state.tokens_seen,
        tokens_per_s: tokens as f64 / out.seconds,
        tflops,
        mfu: (r.cfg.log.peak_tflops > 0.0).then(|| tflops / r.cfg.log.peak_tflops),
        rss_bytes: mem::rss_bytes(),
        step_peak_bytes: mem::peak_bytes(),
        device_peak_bytes: out.device_peaks.iter().map(|p| p.0).max(),
        device_reserved_peak_bytes: out.device_peaks.iter().map(|p| p.1).max(),
        device_peaks_by_rank: out.device_peaks.clone(),
        step_start_bytes: out.start_bytes,
        skipped: out.skipped,
        per_source: out.per_source.iter().map(|(k, (sum, n))| (k.clone(), sum / n.max(1.0))).collect(),
        elapsed_s: r.t_start.elapsed().as_secs_f64(),
    };
    if let Some(log) = r.log.as_mut() {
        log.write(&rec)?;
    }
    if let Some(tb) = &mut r.tb {
        tb.scalars(rec.step, &tensorboard::step_scalars(&rec))?;
    }
    if r.state.step.is_multiple_of(r.cfg.log.every.max(1)) || out.skipped {
        s.say(r, metrics::step_line(&rec, r.total_steps));
    }
    if let Some(pb) = &s.pb {
        pb.set_position(r.state.stage_step);
    }
    Ok(())
}

/// Evaluate the training weights in place (`[eval]`) every `eval.every` steps, at a stage's end and at
/// `--steps`, on every rank (each scores its share; `TrainEval::evaluate`); rank 0 logs the line to
/// metrics.jsonl (before the step's checkpoint, so a resume from that checkpoint keeps it), prints it,
/// redraws eval.png. Every rank decides alike: `due` reads only the step and the agreed last evaluation.
fn maybe_evaluate(r: &mut Run, s: &Stage, ev: Option<&mut TrainEval>) -> Result<()> {
    let boundary = r.state.stage_step == s.steps || r.state.step >= r.limit;
    let Some(ev) = ev.filter(|e| e.due(r.state.step, boundary)) else { return Ok(()) };
    // the stage's model, or, where no rank holds the whole weights, every rank's gathered copy of them
    // on its device, freed after the evaluation (`Sharding::full_weights` says why not layer by layer)
    let model = match r.sharding().full_weights(Some(&r.device))? {
        Some(w) => Llama::from_tensors(s.mc.clone(), w.into_iter().collect(), "the gathered training weights")?,
        None => s.model.clone(),
    };
    // with the run's attention on this device (never the sequence-parallel exchange: each rank scores alone)
    let local = AttentionImpl::for_train(r.cfg.train.attention, &r.device, r.cfg.train.dtype.dtype(), s.mc.head_dim)?;
    let model = &model.with_attention(local);
    let window = r.cfg.eval_ppl_window(s.si).ok_or_else(|| anyhow!("internal: [eval] without a table"))?;
    let at = EvalPoint { step: r.state.step, stage: s.si, window, last: r.state.step == r.total_steps };
    let rec = ev.evaluate(model, &r.comm, at)?;
    if r.mesh.rank() != 0 {
        return Ok(());
    }
    if let Some(log) = r.log.as_mut() {
        log.write_eval(&rec)?;
    }
    if let Some(tb) = &mut r.tb {
        tb.scalars(rec.step, &tensorboard::eval_scalars(&rec))?;
    }
    s.say(r, eval_line(&rec));
    if r.cfg.log.plot {
        let recs = metrics::read_evals(&r.run_dir.metrics())?;
        metrics::plot_evals(&recs, &r.run_dir.eval_plot())?;
    }
    Ok(())
}

/// Save after a good step that ends the stage, hits `checkpoint.every`, reaches `--steps` or follows the
/// agreed stop (`stop`). A checkpoint at a stage's end already points at the next stage.
fn maybe_checkpoint(r: &mut Run, s: &Stage, out: &StepOut, stop: bool) -> Result<()> {
    let stage_end = r.state.stage_step == s.steps;
    let periodic = r.cfg.checkpoint.every > 0 && r.state.step.is_multiple_of(r.cfg.checkpoint.every);
    let stopping = stop || r.state.step >= r.limit;
    if !(periodic || stage_end || stopping) || out.skipped || r.bad_streak > 0 {
        return Ok(());
    }
    let mut snap = r.state.clone();
    if stage_end {
        snap.stage = s.si + 1;
        snap.stage_step = 0;
        snap.data_cursor = serde_json::Value::Null;
    }
    // where no rank holds the whole weights, every rank joins the gather of those rank 0 writes, group
    // by group into rank 0's host memory (in the compute dtype: what the model files hold), so no device
    // holds a full copy; otherwise they are the stage's own `vars`
    let keep = (r.mesh.rank() == 0).then_some(&Device::Cpu);
    let full = r.sharding().full_weights(keep)?;
    // rank 0 runs this on a thread of its own while it meets the others (`checkpoint::agree_within`):
    // it borrows only what it writes
    let (layout, vars, mc) = (&r.layout, &s.vars, &s.mc);
    let (tokenizer, max_shard) = (&r.tokenizer, r.cfg.checkpoint.max_shard_bytes);
    let write_model = |dir: &Path| -> Result<WrittenFiles> {
        let tensors: Vec<(String, Tensor)> = match &full {
            Some(w) => w.clone(),
            None => layout.params.iter().zip(vars).map(|(p, v)| (p.name.clone(), v.as_tensor().clone())).collect(),
        };
        let mut written = save_model_dir(dir, mc, &tensors, max_shard)?;
        // the tokenizer's bytes are summed as they are copied (a small file, read once)
        let text = std::fs::read(tokenizer).with_context(|| format!("cannot read {}", tokenizer.display()))?;
        std::fs::write(dir.join("tokenizer.json"), &text)
            .with_context(|| format!("copying {} into the checkpoint", tokenizer.display()))?;
        written.push(("tokenizer.json".into(), FileSum::of_bytes(&text)));
        Ok(written)
    };
    let root = r.run_dir.checkpoints();
    // rank 0's commit writes the model files (compute dtype): its wait bound is sized by their bytes
    let opts = checkpoint::SaveOpts {
        keep_last: r.cfg.checkpoint.keep_last,
        timeout: r.cfg.dist.timeout(),
        model_bytes: (r.layout.total * r.dtype.size_in_bytes()) as u64,
    };
    let p = checkpoint::save(&root, &snap, &r.optim, &r.comm, &opts, &write_model)?;
    s.say(r, format!("saved {}", p.display()));
    r.last_saved = Some(p);
    Ok(())
}

/// How a session ended.
enum End {
    /// every stage done, or `--steps` reached
    Done,
    /// SIGINT/SIGTERM after a checkpoint
    Signal,
}

/// End of a session (the only one, on every path): the loss curve of the whole run, then a summary.
fn finish(r: &Run, end: End) -> Result<()> {
    if r.mesh.rank() != 0 {
        return Ok(());
    }
    if r.cfg.log.plot {
        let recs = metrics::read_records(&r.run_dir.metrics())?;
        metrics::plot_loss(&recs, &r.run_dir.loss_plot(), "harpe train: loss")?;
    }
    match end {
        End::Signal => println!("stopped by signal after step {}; resume with --resume", r.state.step),
        End::Done => {
            let st = &r.state;
            println!(
                "done: {} steps, {} tokens, {} skipped; last checkpoint {}; {:.0} tokens/s this session",
                st.step,
                st.tokens_seen,
                st.skipped_steps,
                r.last_saved.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "none".into()),
                (st.tokens_seen - r.tokens_at_start) as f64 / r.t_start.elapsed().as_secs_f64().max(1e-9)
            );
        }
    }
    Ok(())
}
