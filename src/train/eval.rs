//! Evaluation during training (`[eval]`): perplexity, passkey and loss by position bucket of the
//! training weights, every `every` optimizer steps, at each stage's end and at the end of the run.
//!
//! Reference: the scoring rules are the eval commands' own
//! (`ppl::score_documents`, `passkey::make_samples` + `generate::predict_text` + `niah::task_score`,
//! `eval_loss::sequence_nlls` + `LossTally`, `tasks::run::respond_group`): this file only prepares their
//! inputs once, splits them over the ranks and packs their results into one `metrics.jsonl` line.
//! The non-obvious decisions: the model evaluated is the stage's training model itself (its `Var`s, on
//! the training device, in the training dtype and RoPE scheme; no checkpoint round trip), and nothing
//! here draws from a random state the training uses (passkey keys come from their own seeded
//! generator), so a run with `[eval]` trains bit-identically to one without. In a multi-rank run every
//! rank evaluates its share of the items (`eval::share`: item i on rank i mod world) and the results
//! are exchanged and summed in item order, so the logged numbers are a one-rank evaluation's bits and no
//! rank waits for a whole evaluation inside a collective bounded by `dist.timeout_s` (only for the
//! slowest rank's last item). Evaluations already logged (the lines `MetricsLog::open` kept on resume)
//! are never repeated: rank 0 reads `last_step` back from them and tells every rank
//! (`agree_logged`). Passkey uses seed 42 (eval-niah's default) and min(samples, 10) depths. `tasks`
//! (eval-tasks' harness benchmarks) are read and prompted when the run opens and scored once, on the
//! final weights, in eval-tasks' request groups (a group is one item).
//! What this file does not do: RULER tasks (run `harpe eval-niah` on a checkpoint).
use crate::comms::Comm;
use crate::config::EvalSection;
use crate::data::{Loader, LoaderConfig, Manifest};
use crate::eval::niah_io::Record;
use crate::eval::share::{response_row, row_response, test_delay, Share};
use crate::eval::{eval_loss, generate, niah, niah_run, passkey, ppl, tasks};
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

/// Where an evaluation is taken: after `step` of `stage`, with that stage's perplexity (window,
/// stride); `last` (the run's final weights) adds `[eval] tasks`.
pub struct EvalPoint {
    pub step: u64,
    pub stage: usize,
    pub window: (usize, usize),
    pub last: bool,
}

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
    /// sha256 (the loss dataset must match it); `metrics` holds the evaluations already logged (rank 0
    /// reads it; the other ranks pass None and learn its answer from `agree_logged`).
    pub fn open(
        cfg: Option<&EvalSection>,
        tokenizer: &Path,
        tok_sha: &str,
        metrics: Option<&Path>,
        loss_chunk: usize,
    ) -> Result<Option<TrainEval>> {
        let Some(cfg) = cfg else { return Ok(None) };
        let mut tok = crate::data::tokenize::load_tokenizer(tokenizer)?;
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
        let last_step = match metrics.filter(|m| m.exists()) {
            Some(m) => crate::train::metrics::read_evals(m)?.iter().map(|r| r.step).max(),
            None => None,
        };
        Ok(Some(TrainEval { cfg: cfg.clone(), tok, docs, passkey: pk, loss, loss_chunk, tasks: prepared, last_step }))
    }

    /// Tell every rank the step of the last evaluation rank 0 read back from metrics.jsonl, so that
    /// every rank's `due` gives the same answer (each evaluation is a set of collectives).
    pub fn agree_logged(&mut self, comm: &Comm) -> Result<()> {
        let mine = match comm.mesh().rank() {
            0 => self.last_step.map_or(0.0, |s| s as f64 + 1.0),
            _ => 0.0,
        };
        let mut v = [mine];
        comm.all_reduce_sum_f64(&mut v)?;
        self.last_step = (v[0] > 0.0).then(|| v[0] as u64 - 1);
        Ok(())
    }

    /// Whether to evaluate after `step`: every `every` steps, or at a stage's end / the run's end,
    /// unless this step was evaluated already.
    pub fn due(&self, step: u64, boundary: bool) -> bool {
        let periodic = self.cfg.every > 0 && step.is_multiple_of(self.cfg.every);
        (periodic || boundary) && self.last_step.is_none_or(|l| step > l)
    }

    /// Evaluate `model` (the training weights, whole on every rank) at `at`: every rank of `comm`'s group
    /// calls it and scores its share; every rank returns the whole record.
    pub fn evaluate(&mut self, model: &Llama, comm: &Comm, at: EvalPoint) -> Result<EvalRecord> {
        let share = Share::new(comm);
        let mut ev = EvalResults::default();
        if !self.docs.is_empty() {
            ev.ppl = Some(self.perplexity(model, &share, at.window).context("[eval] perplexity")?);
        }
        ev.passkey = self.passkey(model, &share)?;
        if let Some((dir, loader)) = &self.loss {
            ev.loss_by_bucket = self.loss_by_bucket(model, &share, dir, loader).context("[eval] loss_data")?;
        }
        if at.last && !self.tasks.is_empty() {
            ev.tasks = self.score_tasks(model, &share).context("[eval] tasks")?;
        }
        self.last_step = Some(at.step);
        Ok(EvalRecord { step: at.step, stage: at.stage, eval: ev })
    }

    /// Token-weighted perplexity of the documents: per-document sums, added in document order.
    fn perplexity(&self, model: &Llama, share: &Share, (window, stride): (usize, usize)) -> Result<PplSummary> {
        let idx: Vec<usize> = (0..self.docs.len()).filter(|&i| share.mine(i)).collect();
        let docs: Vec<(String, String)> = idx.iter().map(|&i| self.docs[i].clone()).collect();
        let (per_doc, _) =
            ppl::score_documents(model, &self.tok, &docs, window, stride, self.cfg.ppl_max_tokens, self.loss_chunk)?;
        test_delay(docs.len());
        let mut rows = vec![None; self.docs.len()];
        for (&i, (_, s)) in idx.iter().zip(&per_doc) {
            rows[i] = Some(vec![s.nll_sum, s.tokens as f64]);
        }
        // summed as `score_documents` sums one rank's documents: the same bits
        let mut total = ppl::WindowSums::default();
        for r in share.rows(rows)? {
            total.nll_sum += r[0];
            total.tokens += r[1] as usize;
        }
        let r = ppl::result("total", &total, ppl::Aggregate::Token);
        Ok(PplSummary { nll: r.nll, ppl: r.ppl, tokens: r.tokens })
    }

    /// Passkey accuracy by length: the samples of every length are one list of items.
    fn passkey(&self, model: &Llama, share: &Share) -> Result<BTreeMap<String, f64>> {
        let items: Vec<(usize, &Record)> =
            self.passkey.iter().flat_map(|(len, recs)| recs.iter().map(move |r| (*len, r))).collect();
        let mut rows = vec![None; items.len()];
        for (i, (len, r)) in items.iter().enumerate().filter(|(i, _)| share.mine(*i)) {
            let (max_new, bos) = (passkey::PASSKEY_MAX_NEW_TOKENS, self.cfg.passkey_bos);
            let pred = generate::predict_text(model, &self.tok, &r.prompt(), max_new, PREFILL_CHUNK, bos)
                .with_context(|| format!("[eval] passkey at length {len}"))?;
            rows[i] = Some(vec![niah_run::Scorer::Passkey.score(&pred, &r.outputs)]);
            test_delay(1);
        }
        let mut scores = share.rows(rows)?.into_iter().map(|r| r[0]);
        let mut out = BTreeMap::new();
        for (len, recs) in &self.passkey {
            let s: Vec<f64> = scores.by_ref().take(recs.len()).collect();
            out.insert(len.to_string(), niah::task_score(&s));
        }
        Ok(out)
    }

    /// Loss by position bucket: rounds of one sequence per rank (the exchange holds `world` sequences'
    /// NLLs at a time), tallied in dataset order as `eval_loss::loss_report` does.
    fn loss_by_bucket(
        &self,
        model: &Llama,
        share: &Share,
        dir: &Path,
        loader: &Loader,
    ) -> Result<BTreeMap<String, f64>> {
        let n = eval_loss::report_sequences(loader, self.cfg.loss_max_sequences);
        let mut tally = eval_loss::LossTally::new(loader, &self.cfg.loss_buckets, n);
        for round in (0..n).step_by(share.world) {
            let mut rows = vec![None; (n - round).min(share.world)];
            for (j, row) in rows.iter_mut().enumerate().filter(|(j, _)| share.mine(round + j)) {
                let seq = loader.get((round + j) as u64)?;
                *row = Some(eval_loss::sequence_nlls(model, &seq, dir, self.loss_chunk)?);
                test_delay(1);
            }
            for (j, nlls) in share.rows(rows)?.iter().enumerate() {
                tally.add(&loader.get((round + j) as u64)?, nlls);
            }
        }
        Ok(tally.report.by_bucket.into_iter().map(|(k, c)| (k, c.loss)).collect())
    }

    /// `[eval] tasks` on `model`: every numeric harness metric of every task (and MMLU group). The items
    /// are eval-tasks' request groups (a response depends on its group), so the responses are its own.
    fn score_tasks(&self, model: &Llama, share: &Share) -> Result<BTreeMap<String, BTreeMap<String, f64>>> {
        let sc = tasks::score::Scorer {
            model,
            tok: &self.tok,
            max_length: model.max_context(),
            batch: TASKS_BATCH,
            chunk: self.loss_chunk,
        };
        let mut resp = vec![];
        for p in &self.tasks {
            let mut rows = vec![None; p.requests.len()];
            // group g is this rank's when g mod world = rank (`Share::mine`)
            for group in tasks::run::request_groups(p, TASKS_BATCH).iter().skip(share.rank).step_by(share.world) {
                let reqs: Vec<&tasks::run::Request> = group.iter().map(|&i| &p.requests[i]).collect();
                for (&i, x) in group.iter().zip(tasks::run::respond_group(&sc, &p.spec, &reqs)?) {
                    rows[i] = Some(response_row(&x));
                }
                test_delay(1);
            }
            resp.push(share.rows(rows)?.iter().map(|r| row_response(r)).collect::<Result<Vec<_>>>()?);
        }
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
