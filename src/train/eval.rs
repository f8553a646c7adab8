//! Evaluation during training (`[eval]`): perplexity, passkey and loss by position bucket of the
//! training weights, every `every` optimizer steps, at each stage's end and at the end of the run.
//!
//! Reference: issue 16 item 2; the scoring rules are the eval commands' own (`ppl::score_documents`,
//! `passkey::make_samples` + `niah_run::predict_text` + `niah::task_score`, `eval_loss::loss_report`):
//! this file only prepares their inputs once and packs their results into one `metrics.jsonl` line.
//! The non-obvious decisions: the model evaluated is the stage's training model itself (its `Var`s, on
//! the training device, in the training dtype and RoPE scheme; no checkpoint round trip), and nothing
//! here draws from a random state the training uses (passkey keys come from their own seeded
//! generator), so a run with `[eval]` trains bit-identically to one without. Evaluations already logged
//! (the lines `MetricsLog::open` kept on resume) are never repeated: `last_step` is read back from them.
//! Passkey uses seed 42 (eval-niah's default) and min(samples, 10) depths. `tasks` (eval-tasks'
//! harness benchmarks) are read and prompted when the run opens and scored once, on the final weights.
//! What this file does not do: RULER tasks (run `harpe eval-niah` on a checkpoint), multi-rank sharding
//! of the evaluation (every rank evaluates; rank 0's line is the one logged).
use crate::config::EvalSection;
use crate::data::{Loader, LoaderConfig, Manifest};
use crate::eval::niah_io::Record;
use crate::eval::{eval_loss, niah, niah_run, passkey, ppl, tasks};
use crate::model::Llama;
use crate::train::metrics::{EvalRecord, EvalResults, PplSummary};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// Passkey generator seed (eval-niah's `--seed` default).
const PASSKEY_SEED: i64 = 42;
/// Prompt tokens per prefill pass of the passkey generation (eval-niah's default).
const PREFILL_CHUNK: usize = 2048;
/// Continuation rows per forward of `[eval] tasks` (eval-tasks' `--batch` default).
const TASKS_BATCH: usize = 8;

/// What `[eval]` scores, prepared once when the run opens.
pub struct TrainEval {
    cfg: EvalSection,
    tok: Tokenizer,
    docs: Vec<(String, String)>,
    /// (length, samples)
    passkey: Vec<(usize, Vec<Record>)>,
    loss: Option<(PathBuf, Loader)>,
    loss_chunk: usize,
    /// `[eval] tasks`, read and prompted (scored on the final weights only)
    tasks: Vec<tasks::run::PreparedTask>,
    /// the step of the last evaluation logged (this session or a resumed one)
    last_step: Option<u64>,
}

impl TrainEval {
    /// Read the inputs of `[eval]` (None when the table is absent). `tok_sha` is the run tokenizer's
    /// sha256 (the loss dataset must match it); `metrics` holds the evaluations already logged.
    pub fn open(
        cfg: Option<&EvalSection>,
        tokenizer: &Path,
        tok_sha: &str,
        metrics: &Path,
        loss_chunk: usize,
    ) -> Result<Option<TrainEval>> {
        let Some(cfg) = cfg else { return Ok(None) };
        let mut tok = crate::model::load_tokenizer(tokenizer)?;
        tok.with_truncation(None).map_err(|e| anyhow!("cannot disable truncation: {e}"))?;
        tok.with_padding(None);
        let docs = if cfg.ppl_inputs.is_empty() {
            vec![]
        } else {
            ppl::read_documents(&cfg.ppl_inputs).context("[eval] ppl_inputs")?
        };
        let mut pk = vec![];
        for &len in &cfg.passkey_lengths {
            let depths = cfg.passkey_samples.min(10);
            let recs = passkey::make_samples(&tok, len, cfg.passkey_samples, depths, PASSKEY_SEED)
                .with_context(|| format!("[eval] passkey_lengths: {len}"))?;
            pk.push((len, recs));
        }
        let loss = match &cfg.loss_data {
            None => None,
            Some(dir) => Some((dir.clone(), open_loss_data(dir, tok_sha)?)),
        };
        let mut prepared = vec![];
        if let (Some(t), Some(d)) = (&cfg.tasks, &cfg.tasks_data) {
            let specs = tasks::parse_tasks(t, d).context("[eval] tasks")?;
            let shots = tasks::run::shots_of(&cfg.tasks_shots.arg(), &specs).context("[eval] tasks_shots")?;
            for (spec, k) in specs.iter().zip(shots) {
                prepared.push(
                    tasks::run::prepare_task(spec, k, cfg.tasks_limit, tasks::prompt::DEFAULT_SEED)
                        .context("[eval] tasks")?,
                );
            }
        }
        let last_step = if metrics.exists() {
            crate::train::metrics::read_evals(metrics)?.iter().map(|r| r.step).max()
        } else {
            None
        };
        Ok(Some(TrainEval { cfg: cfg.clone(), tok, docs, passkey: pk, loss, loss_chunk, tasks: prepared, last_step }))
    }

    /// Whether to evaluate after `step`: every `every` steps, or at a stage's end / the run's end,
    /// unless this step was evaluated already.
    pub fn due(&self, step: u64, boundary: bool) -> bool {
        let periodic = self.cfg.every > 0 && step.is_multiple_of(self.cfg.every);
        (periodic || boundary) && self.last_step.is_none_or(|l| step > l)
    }

    /// Evaluate `model` (the training weights) after `step` of `stage`, with the perplexity window
    /// and stride of that stage; `last` (the run's final weights) adds `[eval] tasks`.
    pub fn evaluate(
        &mut self,
        model: &Llama,
        step: u64,
        stage: usize,
        window: (usize, usize),
        last: bool,
    ) -> Result<EvalRecord> {
        let mut ev = EvalResults::default();
        if !self.docs.is_empty() {
            let (_, total) = ppl::score_documents(
                model,
                &self.tok,
                &self.docs,
                window.0,
                window.1,
                self.cfg.ppl_max_tokens,
                self.loss_chunk,
            )
            .context("[eval] perplexity")?;
            let r = ppl::result("total", &total, ppl::Aggregate::Token);
            ev.ppl = Some(PplSummary { nll: r.nll, ppl: r.ppl, tokens: r.tokens });
        }
        for (len, recs) in &self.passkey {
            let mut scores = Vec::with_capacity(recs.len());
            for r in recs {
                let pred = niah_run::predict_text(
                    model,
                    &self.tok,
                    &r.prompt(),
                    passkey::PASSKEY_MAX_NEW_TOKENS,
                    PREFILL_CHUNK,
                )
                .with_context(|| format!("[eval] passkey at length {len}"))?;
                scores.push(niah_run::Scorer::Passkey.score(&pred, &r.outputs));
            }
            ev.passkey.insert(len.to_string(), niah::task_score(&scores));
        }
        if let Some((dir, loader)) = &self.loss {
            let rep = eval_loss::loss_report(
                model,
                loader,
                dir,
                &self.cfg.loss_buckets,
                self.cfg.loss_max_sequences,
                self.loss_chunk,
            )
            .context("[eval] loss_data")?;
            ev.loss_by_bucket = rep.by_bucket.into_iter().map(|(k, c)| (k, c.loss)).collect();
        }
        if last && !self.tasks.is_empty() {
            ev.tasks = self.score_tasks(model).context("[eval] tasks")?;
        }
        self.last_step = Some(step);
        Ok(EvalRecord { step, stage, eval: ev })
    }

    /// `[eval] tasks` on `model`: every numeric harness metric of every task (and MMLU group).
    fn score_tasks(&self, model: &Llama) -> Result<BTreeMap<String, BTreeMap<String, f64>>> {
        let sc = tasks::score::Scorer {
            model,
            tok: &self.tok,
            max_length: model.max_context(),
            batch: TASKS_BATCH,
            chunk: self.loss_chunk,
        };
        let resp = tasks::run::score_tasks(&sc, &self.tasks, None, "")?;
        let groups = self.cfg.tasks.as_deref().is_some_and(tasks::run::wants_groups);
        let res = tasks::run::results_of(&self.tasks, &resp, groups);
        let mut out = BTreeMap::new();
        for (task, r) in res["results"].as_object().into_iter().flatten() {
            let m: BTreeMap<String, f64> = r
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(k, _)| k.contains(','))
                .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
                .collect();
            out.insert(task.clone(), m);
        }
        Ok(out)
    }
}

/// The console line of one evaluation.
pub fn eval_line(r: &EvalRecord) -> String {
    let mut parts = vec![format!("eval   {:>6} | stage {}", r.step, r.stage)];
    if let Some(p) = &r.eval.ppl {
        parts.push(format!("ppl {:.4} (nll {:.4}, {} tokens)", p.ppl, p.nll, p.tokens));
    }
    if !r.eval.passkey.is_empty() {
        let v: Vec<String> = r.eval.passkey.iter().map(|(l, s)| format!("{l}: {s:.0}%")).collect();
        parts.push(format!("passkey {}", v.join(" ")));
    }
    if !r.eval.loss_by_bucket.is_empty() {
        let v: Vec<String> = r.eval.loss_by_bucket.iter().map(|(b, l)| format!("{b}: {l:.4}")).collect();
        parts.push(format!("loss {}", v.join(" ")));
    }
    for (task, m) in &r.eval.tasks {
        let v: Vec<String> =
            m.iter().filter(|(k, _)| !k.contains("_stderr")).map(|(k, x)| format!("{k} {x:.4}")).collect();
        parts.push(format!("{task} {}", v.join(" ")));
    }
    parts.join(" | ")
}

/// Open the loss dataset (dataset order, no shuffle), checking its tokenizer against the run's.
fn open_loss_data(dir: &Path, tok_sha: &str) -> Result<Loader> {
    let seq_len = Manifest::load(dir).with_context(|| format!("[eval] loss_data = {}", dir.display()))?.seq_len;
    let loader = Loader::open(dir, LoaderConfig { seq_len, shuffle: false, seed: 0, rank: 0, world_size: 1 })
        .with_context(|| format!("[eval] loss_data = {}", dir.display()))?;
    let sha = &loader.manifest().tokenizer_sha256;
    if sha != tok_sha {
        bail!(
            "[eval] loss_data = {}: tokenized with another tokenizer (sha256 {}) than the run's ({})\nhint: prepare the data with the model's tokenizer.json",
            dir.display(),
            &sha[..12.min(sha.len())],
            &tok_sha[..12.min(tok_sha.len())]
        );
    }
    Ok(loader)
}
