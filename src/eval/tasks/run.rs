//! `harpe eval-tasks`: read the tasks, build every request, score them (resumably, with a progress bar),
//! aggregate, and write the harness's `results.json` (+ per-sample logs with `--log-samples`).
//!
//! Reference: lm-evaluation-harness 0.4.13 `evaluator.py` (`simple_evaluate`: `limit` below 1.0 is a
//! fraction, `ceil(n * limit)`; first `limit` documents of the evaluated split; seeds 0/1234/1234 and
//! few-shot seed 1234), `__main__.py` / `utils.make_table` (the console table).
//! The non-obvious decisions: documents are scored longest first (as the harness sorts its requests, so
//! the ETA errs high and a memory failure comes at once), and each scored document is appended to
//! `--out/partial/<task>.jsonl` under a key hashing the model, the settings and the request strings: a
//! killed run re-reads the lines whose key still matches and scores only the rest (changed settings
//! recompute, never mix). One writer per `--out` (`util::lock_dir`). Not done here: batching
//! generation across documents, data-parallel sharding.
use crate::eval::ppl::ScoringModel;
use crate::eval::tasks::data::read_split;
use crate::eval::tasks::prompt::{context, FewshotSampler, TARGET_DELIMITER};
use crate::eval::tasks::results::{results_json, sample_metrics, table, Response, TaskOutcome};
use crate::eval::tasks::score::{ChoiceScore, Scorer};
use crate::eval::tasks::{parse_tasks, Doc, Output, TaskSpec, HARNESS_VERSION};
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// TriviaQA's `generation_kwargs.until`.
pub const TRIVIAQA_UNTIL: [&str; 3] = ["\n", ".", ","];

/// Short-context benchmarks with lm-evaluation-harness's prompts, few-shot rules and metrics.
#[derive(clap::Args, Debug, Clone)]
pub struct EvalTasksArgs {
    #[command(flatten)]
    pub scoring: ScoringModel,
    /// tasks, comma-separated: mmlu (every subject under DATA/mmlu, with its groups), mmlu_<subject>,
    /// hellaswag, arc_challenge, arc_easy, piqa, triviaqa
    #[arg(long)]
    pub tasks: String,
    /// task files: DATA/<task>/<split>.jsonl and DATA/mmlu/<subject>/{dev,test}.jsonl (HF record formats)
    #[arg(long)]
    pub data: PathBuf,
    /// few-shot examples per prompt: N for every task (the harness's default: 0), or per task as
    /// `mmlu=5,hellaswag=10,arc_challenge=25,piqa=0,triviaqa=5` (HARPE Table 3; `mmlu` covers its subjects;
    /// a bare N sets the rest)
    #[arg(long, default_value = "0")]
    pub shots: String,
    /// evaluate only the first N documents of each task (below 1.0: that fraction, rounded up)
    #[arg(long)]
    pub limit: Option<f64>,
    /// few-shot sampling seed (the harness's fewshot_random_seed)
    #[arg(long, default_value_t = crate::eval::tasks::prompt::DEFAULT_SEED)]
    pub seed: i64,
    /// continuation rows per forward pass (the choices of a question share one prefilled context)
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// the harness's max_length (default: the model's max_position_embeddings)
    #[arg(long)]
    pub max_length: Option<usize>,
    /// print {"results": ...} as JSON on stdout instead of the table
    #[arg(long)]
    pub json: bool,
    /// directory for results.json, samples and the resume files
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// write OUT/samples_<task>.jsonl: prompts, per-choice log-likelihoods, generations, metrics
    #[arg(long)]
    pub log_samples: bool,
    /// tokenizer.json to use instead of the model directory's
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

/// What `evaluate` returns: the prepared tasks, their per-document responses, the results object.
pub type Evaluation = (Vec<PreparedTask>, Vec<Vec<Response>>, serde_json::Map<String, Value>);

/// One document's request.
#[derive(Clone, Debug)]
pub struct Request {
    /// index in the evaluated split
    pub doc_id: usize,
    pub context: String,
    /// target_delimiter + choice, per choice (empty for generation)
    pub continuations: Vec<String>,
}

/// One task, read and prompted.
pub struct PreparedTask {
    pub spec: TaskSpec,
    pub docs: Vec<Doc>,
    pub requests: Vec<Request>,
    /// documents in the evaluated split (before `--limit`)
    pub original: usize,
    /// few-shot examples per prompt
    pub shots: usize,
}

/// `--shots`: the few-shot count of each task (`N`, or `task=N,...` with an optional bare `N` for the rest).
pub fn shots_of(arg: &str, specs: &[TaskSpec]) -> Result<Vec<usize>> {
    let mut default = 0;
    let mut per: Vec<(&str, usize)> = vec![];
    for part in arg.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || {
            anyhow!("--shots {arg:?}: {part:?} is not N or task=N\nhint: e.g. --shots 5 or --shots mmlu=5,hellaswag=10")
        };
        match part.split_once('=') {
            None => default = part.parse().map_err(|_| bad())?,
            Some((t, n)) => {
                let t = t.trim();
                let covers = |s: &TaskSpec| s.name == t || (t == "mmlu" && s.mmlu_category().is_some());
                if !specs.iter().any(covers) {
                    bail!(
                        "--shots names {t:?}, which --tasks does not select\nhint: name tasks of --tasks, e.g. mmlu=5"
                    );
                }
                per.push((t, n.trim().parse().map_err(|_| bad())?));
            }
        }
    }
    Ok(specs
        .iter()
        .map(|s| {
            per.iter()
                .rev()
                .find(|(t, _)| *t == s.name || (*t == "mmlu" && s.mmlu_category().is_some()))
                .map_or(default, |(_, n)| *n)
        })
        .collect())
}

/// `get_sample_size`: a limit below 1.0 is a fraction (rounded up), else a count.
pub fn effective_limit(n: usize, limit: Option<f64>) -> Result<usize> {
    match limit {
        None => Ok(n),
        Some(l) if l.is_nan() || l <= 0.0 || l.is_infinite() => {
            bail!("--limit {l} selects nothing\nhint: a count (e.g. --limit 100) or a fraction in (0, 1)")
        }
        Some(l) if l < 1.0 => Ok(((n as f64 * l).ceil() as usize).min(n)),
        Some(l) => Ok((l as usize).min(n)),
    }
}

/// Read a task's splits, build its documents and every request (few-shot draws in document order).
pub fn prepare_task(spec: &TaskSpec, shots: usize, limit: Option<f64>, seed: i64) -> Result<PreparedTask> {
    let eval = read_split(&spec.name, &spec.dir, spec.eval_split, spec.dataset)?;
    let original = eval.len();
    let n = effective_limit(original, limit)?;
    let docs: Vec<Doc> = eval[..n].iter().map(|r| spec.doc(r)).collect::<Result<_>>()?;
    let mut sampler = if shots > 0 {
        let pool = read_split(&spec.name, &spec.dir, spec.fewshot_split, spec.dataset)?;
        let pool: Vec<Doc> = pool.iter().map(|r| spec.doc(r)).collect::<Result<_>>()?;
        Some(FewshotSampler::new(spec, pool, seed))
    } else {
        None
    };
    let mut requests = Vec::with_capacity(docs.len());
    for (doc_id, doc) in docs.iter().enumerate() {
        let idx = match &mut sampler {
            Some(s) => s.sample(shots, doc)?,
            None => vec![],
        };
        let shot_docs: Vec<&Doc> =
            idx.iter().map(|&i| sampler.as_ref().map(|s| s.doc(i))).collect::<Option<_>>().unwrap_or_default();
        let ctx = context(&spec.description, &shot_docs, doc);
        let continuations = doc.choices.iter().map(|c| format!("{TARGET_DELIMITER}{c}")).collect();
        requests.push(Request { doc_id, context: ctx, continuations });
    }
    Ok(PreparedTask { spec: spec.clone(), docs, requests, original, shots })
}

/// Resume file of a task: `OUT/partial/<task>.jsonl`, one scored document per line.
struct Partial {
    done: HashMap<usize, (String, Response)>,
    file: Option<std::fs::File>,
}

fn response_json(r: &Response) -> Value {
    match r {
        Response::Choices(c) => json!({
            "lls": c.iter().map(|s| s.loglik).collect::<Vec<_>>(),
            "greedy": c.iter().map(|s| s.is_greedy).collect::<Vec<_>>(),
        }),
        Response::Generation(g) => json!({ "generation": g }),
    }
}

fn response_of(v: &Value) -> Option<Response> {
    if let Some(g) = v.get("generation").and_then(Value::as_str) {
        return Some(Response::Generation(g.to_string()));
    }
    let lls = v.get("lls")?.as_array()?;
    let greedy = v.get("greedy")?.as_array()?;
    let c = lls
        .iter()
        .zip(greedy)
        .map(|(l, g)| Some(ChoiceScore { loglik: l.as_f64()?, is_greedy: g.as_bool()? }))
        .collect::<Option<Vec<_>>>()?;
    Some(Response::Choices(c))
}

impl Partial {
    fn open(out: Option<&Path>, task: &str) -> Result<Partial> {
        let Some(out) = out else { return Ok(Partial { done: HashMap::new(), file: None }) };
        let dir = out.join("partial");
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}\nhint: choose a writable --out", dir.display()))?;
        let path = dir.join(format!("{task}.jsonl"));
        let mut done = HashMap::new();
        if path.exists() {
            let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
            let lines: Vec<&str> = text.lines().collect();
            for (i, line) in lines.iter().enumerate() {
                let parsed: Option<(usize, String, Response)> =
                    serde_json::from_str::<Value>(line).ok().and_then(|v| {
                        Some((
                            v.get("doc_id")?.as_u64()? as usize,
                            v.get("key")?.as_str()?.to_string(),
                            response_of(&v)?,
                        ))
                    });
                match parsed {
                    Some((id, key, r)) => {
                        done.insert(id, (key, r));
                    }
                    // a run killed while writing leaves a torn last line: that document is scored again
                    None if i + 1 == lines.len() => {
                        eprintln!("{}:{}: torn last line, rescoring it", path.display(), i + 1)
                    }
                    None => bail!(
                        "{}:{}: damaged resume line\nhint: delete {} to score the task again",
                        path.display(),
                        i + 1,
                        path.display()
                    ),
                }
            }
        }
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&path).with_context(|| {
            format!("cannot open {} for appending\nhint: check that --out is writable", path.display())
        })?;
        Ok(Partial { done, file: Some(file) })
    }

    fn get(&self, doc_id: usize, key: &str) -> Option<Response> {
        self.done.get(&doc_id).filter(|(k, _)| k == key).map(|(_, r)| r.clone())
    }

    fn put(&mut self, doc_id: usize, key: &str, r: &Response) -> Result<()> {
        let Some(f) = &mut self.file else { return Ok(()) };
        let mut v = response_json(r);
        v["doc_id"] = json!(doc_id);
        v["key"] = json!(key);
        writeln!(f, "{v}").and_then(|_| f.flush()).context("writing the resume file failed\nhint: is the disk full?")
    }
}

/// What identifies the model and the scoring settings in the resume keys.
fn run_fingerprint(args: &EvalTasksArgs, max_length: usize, tok_path: &Path) -> Result<String> {
    let mut s = format!(
        "harpe-eval-tasks v1 harness={HARNESS_VERSION} dtype={:?} rope={:?} max_length={max_length} tokenizer={}",
        args.scoring.dtype,
        args.scoring.rope_parity,
        crate::util::sha256_file(tok_path)?
    );
    let dir = &args.scoring.model;
    s.push_str(&format!(" config={}", crate::util::sha256_file(&dir.join("config.json"))?));
    let files = crate::util::sorted_entries(dir, "hint: --model takes an HF model directory", |p| {
        p.extension().is_some_and(|e| e == "safetensors")
    })?;
    for f in files {
        let m = std::fs::metadata(&f).with_context(|| format!("cannot stat {}", f.display()))?;
        let mtime =
            m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
        s.push_str(&format!(" {}:{}:{mtime}", f.display(), m.len()));
    }
    Ok(s)
}

fn request_key(fp: &str, r: &Request) -> String {
    let mut s = format!("{fp}\0{}", r.context);
    for c in &r.continuations {
        s.push('\0');
        s.push_str(c);
    }
    crate::util::sha256_hex(s.as_bytes())
}

/// A multiple-choice request as tokens: (context ids, continuation ids per choice).
fn encode_request(sc: &Scorer, spec: &TaskSpec, r: &Request) -> Result<(Vec<u32>, Vec<Vec<u32>>)> {
    let mut ctx_ids: Option<Vec<u32>> = None;
    let mut conts = Vec::with_capacity(r.continuations.len());
    for c in &r.continuations {
        let (ctx, cont) = sc.encode_pair(&r.context, c)?;
        if ctx_ids.as_ref().is_some_and(|x| *x != ctx) {
            bail!("internal: choices of one question encode different contexts");
        }
        ctx_ids = Some(ctx);
        conts.push(cont);
    }
    let ctx = ctx_ids.ok_or_else(|| anyhow!("{}: document {} has no choices", spec.name, r.doc_id))?;
    Ok((ctx, conts))
}

/// Score a group of requests of one task: one-token multiple-choice questions in one batch, other
/// questions each with their shared prefix, generations one by one.
pub fn respond_group(sc: &Scorer, spec: &TaskSpec, reqs: &[&Request]) -> Result<Vec<Response>> {
    let at = |r: &Request| format!("{}: document {} of the `{}` split", spec.name, r.doc_id, spec.eval_split);
    if spec.output == Output::Generate {
        return reqs
            .iter()
            .map(|r| Ok(Response::Generation(sc.generate_until(&r.context, &TRIVIAQA_UNTIL).with_context(|| at(r))?)))
            .collect();
    }
    let enc: Vec<(Vec<u32>, Vec<Vec<u32>>)> =
        reqs.iter().map(|r| encode_request(sc, spec, r).with_context(|| at(r))).collect::<Result<_>>()?;
    let mut out: Vec<Option<Response>> = vec![None; reqs.len()];
    let batchable: Vec<usize> = (0..enc.len()).filter(|&i| sc.single_token(&enc[i].0, &enc[i].1)).collect();
    if !batchable.is_empty() {
        let items: Vec<(Vec<u32>, Vec<Vec<u32>>)> = batchable.iter().map(|&i| enc[i].clone()).collect();
        let scores = sc.score_single_token_batch(&items).with_context(|| at(reqs[batchable[0]]))?;
        for (&i, s) in batchable.iter().zip(scores) {
            out[i] = Some(Response::Choices(s));
        }
    }
    for (i, (ctx, conts)) in enc.iter().enumerate() {
        if out[i].is_none() {
            out[i] = Some(Response::Choices(sc.score_choices(ctx, conts).with_context(|| at(reqs[i]))?));
        }
    }
    out.into_iter().map(|x| x.ok_or_else(|| anyhow!("internal: a request was not scored"))).collect()
}

/// Evaluate: every task's per-document responses (resumed where possible) and the results object.
pub fn evaluate(args: &EvalTasksArgs) -> Result<Evaluation> {
    let specs = parse_tasks(&args.tasks, &args.data)?;
    let with_groups = wants_groups(&args.tasks);
    if args.log_samples && args.out.is_none() {
        bail!("--log-samples writes OUT/samples_<task>.jsonl\nhint: pass --out DIR");
    }
    // read and prompt everything first: bad input fails before the model loads
    let prepared: Vec<PreparedTask> = specs
        .iter()
        .zip(shots_of(&args.shots, &specs)?)
        .map(|(s, k)| prepare_task(s, k, args.limit, args.seed))
        .collect::<Result<_>>()?;
    let model = args.scoring.load()?;
    let tok_path = args.tokenizer.clone().unwrap_or_else(|| args.scoring.model.join("tokenizer.json"));
    let mut tok = crate::data::tokenize::load_tokenizer(&tok_path)?;
    tok.with_truncation(None).map_err(|e| anyhow!("cannot disable truncation: {e}"))?;
    tok.with_padding(None);
    let max_length = args.max_length.unwrap_or(model.max_context());
    let sc = Scorer { model: &model, tok: &tok, max_length, batch: args.batch, chunk: args.scoring.loss_chunk };
    let fp = run_fingerprint(args, max_length, &tok_path)?;
    let all = score_tasks(&sc, &prepared, args.out.as_deref(), &fp)?;
    let mut res = results_of(&prepared, &all, with_groups);
    res.insert("config".into(), json!({
        "model": "harpe", "model_args": format!("pretrained={}", args.scoring.model.display()),
        "dtype": format!("{:?}", args.scoring.dtype), "device": args.scoring.device.to_string(), "batch_size": args.batch,
        "limit": args.limit, "max_length": max_length, "bootstrap_iters": 100000, "random_seed": 0,
        "numpy_seed": 1234, "torch_seed": 1234, "fewshot_seed": args.seed,
    }));
    res.insert("harness_rules".into(), json!(format!("lm-evaluation-harness {HARNESS_VERSION}")));
    res.insert("harpe_version".into(), json!(env!("CARGO_PKG_VERSION")));
    let date =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    res.insert("date".into(), json!(date));
    Ok((prepared, all, res))
}

/// The requests of a task in the groups they are scored in (indices into `requests`): longest first,
/// as the harness orders its requests, `batch` at a time. A request's response depends only on its
/// group (single-token questions of a group share one batched forward), so any scorer that keeps these
/// groups gives the same responses.
pub fn request_groups(p: &PreparedTask, batch: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..p.requests.len()).collect();
    let len = |r: &Request| r.context.len() + r.continuations.iter().map(String::len).max().unwrap_or(0);
    order.sort_by_key(|&i| std::cmp::Reverse(len(&p.requests[i])));
    order.chunks(batch.max(1)).map(<[usize]>::to_vec).collect()
}

/// Score every document of every task, longest first, with a progress bar; with `out`, documents already
/// in `out/partial/<task>.jsonl` under the same key are read back and new ones appended. `fp` identifies
/// the model and settings (part of every key).
pub fn score_tasks(sc: &Scorer, prepared: &[PreparedTask], out: Option<&Path>, fp: &str) -> Result<Vec<Vec<Response>>> {
    let total: usize = prepared.iter().map(|p| p.requests.len()).sum();
    let pb = indicatif::ProgressBar::new(total as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} docs, {elapsed} elapsed, ETA {eta}")
            .map_err(|e| anyhow!("progress bar: {e}"))?,
    );
    let mut all = vec![];
    for p in prepared {
        pb.set_prefix(p.spec.name.clone());
        let mut partial = Partial::open(out, &p.spec.name)?;
        let mut resp: Vec<Option<Response>> = vec![None; p.requests.len()];
        for group in request_groups(p, sc.batch) {
            let mut todo = vec![];
            for &i in &group {
                let r = &p.requests[i];
                let key = request_key(fp, r);
                match partial.get(r.doc_id, &key) {
                    Some(x) => resp[i] = Some(x),
                    None => todo.push((i, key)),
                }
            }
            let reqs: Vec<&Request> = todo.iter().map(|(i, _)| &p.requests[*i]).collect();
            for ((i, key), x) in todo.iter().zip(respond_group(sc, &p.spec, &reqs)?) {
                partial.put(p.requests[*i].doc_id, key, &x)?;
                resp[*i] = Some(x);
            }
            pb.inc(group.len() as u64);
        }
        all.push(
            resp.into_iter()
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| anyhow!("internal: a document was not scored"))?,
        );
    }
    pb.finish_and_clear();
    Ok(all)
}

/// The harness's results object of scored tasks (`with_groups`: MMLU's groups, as `--tasks mmlu` gives).
pub fn results_of(
    prepared: &[PreparedTask],
    resp: &[Vec<Response>],
    with_groups: bool,
) -> serde_json::Map<String, Value> {
    let outcomes: Vec<TaskOutcome> = prepared.iter().zip(resp).map(|(p, r)| outcome(p, r)).collect();
    results_json(&outcomes, with_groups)
}

/// Whether a `--tasks` list asks for MMLU's groups.
pub fn wants_groups(tasks: &str) -> bool {
    tasks.split(',').any(|t| t.trim() == "mmlu")
}

/// A task's per-sample metric values.
fn outcome(p: &PreparedTask, resp: &[Response]) -> TaskOutcome {
    let mut values: Vec<(&'static str, Vec<f64>)> = vec![];
    for (doc, r) in p.docs.iter().zip(resp) {
        for (m, v) in sample_metrics(&p.spec, doc, r).0 {
            match values.iter_mut().find(|(k, _)| *k == m) {
                Some((_, xs)) => xs.push(v),
                None => values.push((m, vec![v])),
            }
        }
    }
    TaskOutcome { spec: p.spec.clone(), shots: p.shots, original: p.original, values }
}

/// OUT/samples_<task>.jsonl: one line per document, in document order.
fn write_samples(out: &Path, p: &PreparedTask, resp: &[Response]) -> Result<()> {
    let mut text = String::new();
    for ((r, doc), x) in p.requests.iter().zip(&p.docs).zip(resp) {
        let (metrics, filtered) = sample_metrics(&p.spec, doc, x);
        // the harness's sample fields: doc_id, doc, target, arguments, resps (+ filtered_resps), metrics
        let mut v = json!({ "doc_id": r.doc_id, "doc": doc.raw });
        match x {
            Response::Choices(c) => {
                v["arguments"] = json!(r.continuations.iter().map(|c| [&r.context, c]).collect::<Vec<_>>());
                v["resps"] = json!(c.iter().map(|s| [json!(s.loglik), json!(s.is_greedy)]).collect::<Vec<_>>());
                v["target"] = json!(doc.answer_text());
            }
            Response::Generation(g) => {
                v["arguments"] =
                    json!([[&r.context, {"until": TRIVIAQA_UNTIL, "do_sample": false, "temperature": 0.0}]]);
                v["resps"] = json!([g]);
                v["filtered_resps"] = json!(filtered);
                v["target"] = json!(match &doc.target {
                    crate::eval::tasks::Target::Aliases(a) => json!(a),
                    crate::eval::tasks::Target::Index(i) => json!(i),
                });
            }
        }
        for (m, val) in metrics {
            v[m] = json!(val);
        }
        text.push_str(&v.to_string());
        text.push('\n');
    }
    crate::util::write_atomic(&out.join(format!("samples_{}.jsonl", p.spec.name)), text.as_bytes())
}

/// `harpe eval-tasks`.
pub fn run(args: EvalTasksArgs) -> Result<()> {
    let _lock = match &args.out {
        Some(d) => Some(crate::util::lock_dir(d, "harpe eval-tasks")?),
        None => None,
    };
    let (prepared, resp, res) = evaluate(&args)?;
    if let Some(out) = &args.out {
        crate::util::write_atomic(&out.join("results.json"), serde_json::to_string_pretty(&res)?.as_bytes())?;
        if args.log_samples {
            for (p, r) in prepared.iter().zip(&resp) {
                write_samples(out, p, r)?;
            }
        }
    }
    if args.json {
        println!("{}", serde_json::to_string(&json!({"results": res["results"]}))?);
    } else {
        print!("{}", table(&res));
        if let Some(out) = &args.out {
            println!("wrote {}", out.join("results.json").display());
        }
    }
    Ok(())
}
