//! `harpe eval-niah`: build the RULER / passkey / needle-grid prompts, run the model on them, score,
//! and write RULER-compatible predictions (the reports: `niah_report.rs`).
//!
//! Reference: `NVIDIA/RULER:scripts/run.sh` (directory layout).
//!
//! The non-obvious decisions: every suite is reduced to cells (task x length) of `Record`s, so one
//! loop runs and resumes them all; a prediction is reused on a re-run only when the prompt hash
//! stored beside it matches the prompt of today (changed settings recompute, never mix); prepared
//! data are cached per cell under a settings key, because sizing a 128K haystack costs minutes of
//! tokenization. Running the model is one closure (`predict(prompt, max_new_tokens) -> text`); the model
//! sees each prompt as the tokenizer encodes it with its own special tokens (`--bos auto`, RULER's HF
//! rule), and the stored hash records whether a BOS came first, so predictions under another rule are
//! recomputed (`PromptKey`).
//! Not here: the generators (`niah.rs`, `passkey.rs`, `needle_grid.rs`), decoding and the prompt's
//! encoding (`generate::predict_text`), the reports (`niah_report.rs`).

use crate::eval::needle_grid;
use crate::eval::niah::{self, Essays, Metric, NiahGenerator, NiahTask};
use crate::eval::niah_io::{self, Record};
use crate::eval::niah_report;
pub use crate::eval::niah_report::{CellResult, SampleResult, NEEDLE_GRID, PASSKEY};
use crate::eval::niah_sizing::{self, Sizing};
use crate::eval::passkey;
use anyhow::{bail, Context, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// What one selected task is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum TaskSel {
    /// One of RULER's eight NIAH tasks.
    Niah(NiahTask),
    /// Passkey retrieval.
    Passkey,
    /// The gkamradt/Fu needle grid.
    NeedleGrid,
}

impl TaskSel {
    /// The task's name in file paths and reports.
    pub fn name(self) -> &'static str {
        match self {
            TaskSel::Niah(t) => t.name(),
            TaskSel::Passkey => PASSKEY,
            TaskSel::NeedleGrid => NEEDLE_GRID,
        }
    }
}

/// Parse `--tasks`: names, or the groups `ruler` (the 8 NIAH tasks), `noise` (the three without
/// essays) and `all` (ruler + passkey + needle_grid).
pub fn parse_tasks(s: &str) -> Result<Vec<TaskSel>> {
    let mut out = BTreeSet::new();
    for name in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        match name {
            "ruler" => out.extend(NiahTask::ALL.map(TaskSel::Niah)),
            "noise" => out.extend([NiahTask::Single1, NiahTask::Multikey2, NiahTask::Multikey3].map(TaskSel::Niah)),
            "all" => {
                out.extend(NiahTask::ALL.map(TaskSel::Niah));
                out.extend([TaskSel::Passkey, TaskSel::NeedleGrid]);
            }
            PASSKEY => {
                out.insert(TaskSel::Passkey);
            }
            NEEDLE_GRID => {
                out.insert(TaskSel::NeedleGrid);
            }
            other => match NiahTask::from_name(other) {
                Some(t) => {
                    out.insert(TaskSel::Niah(t));
                }
                None => bail!(
                    "--tasks: unknown task {other:?}\nhint: use ruler, noise, all, passkey, needle_grid or any of {}",
                    NiahTask::ALL.map(|t| t.name()).join(", ")
                ),
            },
        }
    }
    if out.is_empty() {
        bail!("--tasks selects nothing\nhint: e.g. --tasks ruler or --tasks niah_single_1,passkey");
    }
    Ok(out.into_iter().collect())
}

/// How a cell's predictions are scored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scorer {
    /// RULER's string match (all or part).
    Ruler(Metric),
    /// First integer equals the key.
    Passkey,
    /// Fu et al.'s word-set recall (the exact-phrase score is reported beside it).
    NeedleGrid,
}

impl Scorer {
    /// Per-sample score in [0, 1].
    pub fn score(self, pred: &str, outputs: &[String]) -> f64 {
        match self {
            Scorer::Ruler(m) => niah::score_sample(m, pred, outputs),
            Scorer::Passkey => outputs.first().map_or(0.0, |k| passkey::passkey_score(pred, k)),
            Scorer::NeedleGrid => needle_grid::fu_recall(pred),
        }
    }
}

/// One task at one length: its samples and how to run and score them.
#[derive(Clone, Debug)]
pub struct Cell {
    /// Task name (RULER's, `passkey` or `needle_grid`).
    pub task: String,
    /// Target length in tokens.
    pub length: usize,
    /// The samples, keyed by `line`.
    pub records: Vec<Record>,
    /// Generation budget.
    pub max_new_tokens: usize,
    /// Scoring rule.
    pub scorer: Scorer,
}

/// `DIR/<length>/data/<task>/validation.jsonl`.
pub fn data_path(out: &Path, length: usize, task: &str) -> PathBuf {
    out.join(length.to_string()).join("data").join(task).join("validation.jsonl")
}

/// `DIR/<length>/pred/<task>.jsonl`.
pub fn pred_path(out: &Path, length: usize, task: &str) -> PathBuf {
    out.join(length.to_string()).join("pred").join(format!("{task}.jsonl"))
}

/// Settings that define the prepared samples.
#[derive(Clone, Debug)]
pub struct NiahSampleOptions {
    /// Selected tasks.
    pub tasks: Vec<TaskSel>,
    /// RULER and passkey lengths.
    pub lengths: Vec<usize>,
    /// Needle-grid lengths.
    pub grid_lengths: Vec<usize>,
    /// Needle-grid depth count (`round(linspace(0, 100, n))`).
    pub grid_depths: usize,
    /// Passkey depth count (`linspace(0, 1, n)`).
    pub passkey_depths: usize,
    /// Samples per RULER/passkey cell.
    pub samples: usize,
    /// RULER's `random_seed`.
    pub seed: i64,
    /// Haystack sizing search.
    pub sizing: Sizing,
}

/// Build (or load from the per-cell cache) every cell's samples, writing the data files under `out`.
pub fn prepare_cells(
    opts: &NiahSampleOptions,
    tok: &Tokenizer,
    tokenizer_sha: &str,
    essays: Option<&Essays>,
    out: &Path,
) -> Result<Vec<Cell>> {
    let essays_sha = essays.map_or("none".to_string(), |e| crate::util::sha256_hex(e.text.as_bytes()));
    let mut cells = Vec::new();
    let grid_haystack = grid_haystack(opts, tok, essays)?;
    for &task in &opts.tasks {
        let lengths = if task == TaskSel::NeedleGrid { &opts.grid_lengths } else { &opts.lengths };
        for &length in lengths {
            let name = task.name();
            let key = format!(
                "harpe-prepare v1 task={name} length={length} samples={} seed={} sizing={:?} grid_depths={} \
                 passkey_depths={} tokenizer={tokenizer_sha} essays={essays_sha}",
                opts.samples, opts.seed, opts.sizing, opts.grid_depths, opts.passkey_depths
            );
            let data = data_path(out, length, name);
            let key_path = data.with_file_name("harpe_prepare.key");
            let cached = std::fs::read_to_string(&key_path).ok().is_some_and(|k| k == key) && data.is_file();
            let records = if cached {
                niah_io::read_data_file(&data)?
            } else {
                let t0 = std::time::Instant::now();
                let records = generate_records(task, length, opts, tok, essays, grid_haystack.as_deref())?;
                niah_io::write_data_file(&data, &records)?;
                crate::util::write_atomic(&key_path, key.as_bytes())?;
                eprintln!(
                    "prepared {name} @ {length}: {} samples, longest {} tokens ({:.1}s)",
                    records.len(),
                    records.iter().filter_map(|r| r.length).max().unwrap_or(0),
                    t0.elapsed().as_secs_f64()
                );
                records
            };
            let (max_new_tokens, scorer) = match task {
                TaskSel::Niah(_) => (niah::NIAH_TOKENS_TO_GENERATE, Scorer::Ruler(Metric::StringMatchAll)),
                TaskSel::Passkey => (passkey::PASSKEY_MAX_NEW_TOKENS, Scorer::Passkey),
                TaskSel::NeedleGrid => (needle_grid::GRID_MAX_NEW_TOKENS, Scorer::NeedleGrid),
            };
            cells.push(Cell { task: name.to_string(), length, records, max_new_tokens, scorer });
        }
    }
    Ok(cells)
}

/// The needle grid's essay haystack as token ids, long enough for its longest length (`None` without the grid).
fn grid_haystack(opts: &NiahSampleOptions, tok: &Tokenizer, essays: Option<&Essays>) -> Result<Option<Vec<u32>>> {
    if !opts.tasks.contains(&TaskSel::NeedleGrid) {
        return Ok(None);
    }
    let Some(e) = essays else {
        bail!(
            "the needle grid needs an essay haystack\nhint: pass --essays PATH (a .txt file or a directory of \
             .txt files, e.g. gkamradt's PaulGrahamEssays), or drop needle_grid from --tasks"
        );
    };
    let max = opts.grid_lengths.iter().copied().max().unwrap_or(0);
    Ok(Some(needle_grid::haystack_ids(tok, e, max)?))
}

/// Generate one cell's samples with its suite's generator.
fn generate_records(
    task: TaskSel,
    length: usize,
    opts: &NiahSampleOptions,
    tok: &Tokenizer,
    essays: Option<&Essays>,
    grid_haystack: Option<&[u32]>,
) -> Result<Vec<Record>> {
    Ok(match task {
        TaskSel::Niah(t) => {
            let mut g = NiahGenerator::new(t, opts.seed, essays)?;
            niah_sizing::generate_samples(&mut g, tok, length, opts.samples, opts.sizing, task.name())?
                .into_iter()
                .enumerate()
                .map(|(i, s)| Record {
                    line: i,
                    index: i as i64,
                    input: s.input,
                    answer_prefix: None,
                    outputs: s.outputs,
                    length: Some(s.length),
                    depth: None,
                })
                .collect()
        }
        TaskSel::Passkey => passkey::make_samples(tok, length, opts.samples, opts.passkey_depths, opts.seed)?,
        TaskSel::NeedleGrid => {
            let depths = needle_grid::linspace_round(0.0, 100.0, opts.grid_depths);
            needle_grid::make_samples(tok, grid_haystack.unwrap_or(&[]), length, &depths)?
        }
    })
}

/// Cells from RULER-prepared data under `root` (`<length>/data/<task>/validation.jsonl`), filtered by
/// task and length when given.
pub fn ruler_cells(root: &Path, tasks: Option<&[String]>, lengths: Option<&[usize]>) -> Result<Vec<Cell>> {
    let mut cells = Vec::new();
    for (length, task, path) in niah_io::discover_ruler_data(root)? {
        if tasks.is_some_and(|t| !t.contains(&task)) || lengths.is_some_and(|l| !l.contains(&length)) {
            continue;
        }
        let Some((max_new_tokens, metric)) = niah::ruler_task_settings(&task) else {
            bail!(
                "{}: unknown RULER task {task:?}, so its generation budget and metric are unknown\nhint: harpe reads \
                 the niah_* tasks, vt, cwe, fwe, qa_1 and qa_2; select others out with --tasks",
                path.display()
            );
        };
        let records = niah_io::read_data_file(&path)?;
        cells.push(Cell { task, length, records, max_new_tokens, scorer: Scorer::Ruler(metric) });
    }
    if cells.is_empty() {
        bail!(
            "no RULER data under {} matches --tasks/--lengths\nhint: list the directory to see what it holds",
            root.display()
        );
    }
    Ok(cells)
}

/// Run every sample that has no valid prediction yet (appending to `DIR/<length>/pred/<task>.jsonl`
/// as it goes), then score all cells.
pub fn run_cells(cells: &[Cell], out: &Path, predict: &mut Predictor) -> Result<Vec<CellResult>> {
    // Pass 1: what is already done (and still matches today's prompt).
    let key = predict.key;
    let mut done: Vec<BTreeMap<usize, String>> = Vec::with_capacity(cells.len());
    let mut todo = 0usize;
    for cell in cells {
        let valid = valid_predictions(cell, out, key)?;
        todo += cell.records.len() - valid.len();
        done.push(valid);
    }
    let skipped: usize = done.iter().map(BTreeMap::len).sum();
    if skipped > 0 {
        eprintln!("resuming: {skipped} predictions already done, {todo} to run");
    }
    let bar = indicatif::ProgressBar::new(todo as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:>28} [{bar:30}] {pos}/{len} eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    // Pass 2: run what is missing.
    for (cell, valid) in cells.iter().zip(done.iter_mut()) {
        if valid.len() == cell.records.len() {
            continue;
        }
        bar.set_message(format!("{} @ {}", cell.task, cell.length));
        predict_missing(cell, valid, out, predict, &bar)?;
    }
    bar.finish_and_clear();
    // Pass 3: score.
    Ok(cells.iter().zip(&done).map(|(cell, valid)| score_cell(cell, valid, key)).collect())
}

/// A cell's stored predictions whose prompt hash matches today's prompt, by line; the prediction file is
/// rewritten to hold only those when it held stale or foreign lines.
fn valid_predictions(cell: &Cell, out: &Path, key: PromptKey) -> Result<BTreeMap<usize, String>> {
    let path = pred_path(out, cell.length, &cell.task);
    let existing = niah_io::read_pred_file(&path)?;
    let mut valid = BTreeMap::new();
    for r in &cell.records {
        if let Some(p) = existing.get(&r.line) {
            let sha = key.sha256(&r.prompt());
            if p.prompt_sha256.as_deref().is_none_or(|h| h == sha) {
                valid.insert(r.line, p.pred.clone());
            }
        }
    }
    // Rewrite the file when it holds stale or foreign lines, so that it only has valid ones.
    if valid.len() != existing.len() {
        let mut s = String::new();
        for r in cell.records.iter().filter(|r| valid.contains_key(&r.line)) {
            let sha = key.sha256(&r.prompt());
            s.push_str(&niah_io::pred_line(r, &valid[&r.line], &sha));
            s.push('\n');
        }
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
        }
        crate::util::write_atomic(&path, s.as_bytes())?;
    }
    Ok(valid)
}

/// Predict a cell's samples missing from `valid`, appending each line to its prediction file as it comes.
fn predict_missing(
    cell: &Cell,
    valid: &mut BTreeMap<usize, String>,
    out: &Path,
    predict: &mut Predictor,
    bar: &indicatif::ProgressBar,
) -> Result<()> {
    let path = pred_path(out, cell.length, &cell.task);
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("cannot open {} for appending\nhint: check permissions", path.display()))?;
    let missing: Vec<&Record> = cell.records.iter().filter(|r| !valid.contains_key(&r.line)).collect();
    for r in missing {
        let prompt = r.prompt();
        let pred = (predict.predict)(&prompt, cell.max_new_tokens)
            .with_context(|| format!("generation failed on {} @ {} line {}", cell.task, cell.length, r.line + 1))?;
        let sha = predict.key.sha256(&prompt);
        writeln!(f, "{}", niah_io::pred_line(r, &pred, &sha))
            .and_then(|_| f.flush())
            .with_context(|| format!("cannot write {}\nhint: is the disk full?", path.display()))?;
        valid.insert(r.line, pred);
        bar.inc(1);
    }
    Ok(())
}

/// Score a cell's predictions (a missing one scores as empty).
fn score_cell(cell: &Cell, valid: &BTreeMap<usize, String>, key: PromptKey) -> CellResult {
    let mut samples = Vec::with_capacity(cell.records.len());
    for r in &cell.records {
        let pred = valid.get(&r.line).cloned().unwrap_or_default();
        samples.push(SampleResult {
            line: r.line,
            index: r.index,
            depth: r.depth,
            prompt_sha256: key.sha256(&r.prompt()),
            score: cell.scorer.score(&pred, &r.outputs),
            exact: (cell.scorer == Scorer::NeedleGrid).then(|| needle_grid::exact_phrase(&pred)),
            outputs: r.outputs.clone(),
            pred,
        });
    }
    let scores: Vec<f64> = samples.iter().map(|s| s.score).collect();
    let preds: Vec<&str> = samples.iter().map(|s| s.pred.as_str()).collect();
    CellResult {
        task: cell.task.clone(),
        length: cell.length,
        score: niah::task_score(&scores),
        nulls: niah::count_nulls(&preds),
        samples,
    }
}

/// Evaluate long-context retrieval: RULER's 8 needle tasks, passkey, the needle grid.
#[derive(clap::Args, Debug)]
pub struct EvalNiahArgs {
    /// HF model directory (config.json, *.safetensors, tokenizer.json); with --prepare-only it may
    /// hold just tokenizer.json
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// tokenizer.json to use instead of the model directory's (enough for --prepare-only)
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// comma-separated tasks: niah_single_1..3, niah_multikey_1..3, niah_multivalue, niah_multiquery,
    /// passkey, needle_grid, or the groups ruler (the 8 niah tasks), noise (the 3 that need no essays),
    /// all [default: ruler; with --ruler-data: every task found]
    #[arg(long)]
    pub tasks: Option<String>,
    /// comma-separated target lengths in tokens (prompt + generation budget) for RULER and passkey
    /// [default: 4096,8192,16384,32768,65536,131072; with --ruler-data: every length found]
    #[arg(long, value_delimiter = ',')]
    pub lengths: Option<Vec<usize>>,
    /// samples per task and length (RULER's default is 500)
    #[arg(long, default_value_t = 50)]
    pub samples: usize,
    /// RULER's random_seed: seeds the CPython-compatible generator (42 reproduces RULER)
    #[arg(long, default_value_t = 42)]
    pub seed: i64,
    /// essay haystack for the essay tasks and the needle grid: a .txt file, a directory of .txt files
    /// (concatenated in name order), or RULER's PaulGrahamEssays.json; nothing is downloaded
    #[arg(long)]
    pub essays: Option<PathBuf>,
    /// output directory: <length>/data/<task>/validation.jsonl, <length>/pred/<task>.jsonl,
    /// results.json, summary.csv, *.png [default with --ruler-data: that directory]
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// only write the prompts (RULER's layout) and stop; needs only a tokenizer
    #[arg(long)]
    pub prepare_only: bool,
    /// read RULER-prepared data (<length>/data/<task>/validation.jsonl, either RULER layout) instead
    /// of generating, and write RULER predictions beside it
    #[arg(long)]
    pub ruler_data: Option<PathBuf>,
    /// haystack sizing: binary (RULER since 2025, fast) or linear (RULER Dec 2024, slow at 128K)
    #[arg(long, value_enum, default_value = "binary")]
    pub sizing: Sizing,
    /// run lengths beyond what the model can address under its RoPE scheme (max_position_embeddings)
    #[arg(long)]
    pub force: bool,
    /// needle-grid context lengths, comma-separated [default: the --lengths values]
    #[arg(long, value_delimiter = ',')]
    pub grid_lengths: Option<Vec<usize>>,
    /// needle-grid depth count: round(linspace(0, 100, N)) percent (Fu et al. use 10)
    #[arg(long, default_value_t = 10)]
    pub grid_depths: usize,
    /// passkey depth count: sample i sits at depth (i mod N) / (N - 1)
    #[arg(long, default_value_t = 10)]
    pub passkey_depths: usize,
    /// compute dtype of weights and activations
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: crate::device::ComputeDtype,
    /// device to run the model on: cpu, cuda or cuda:N (CUDA needs a build with --features cuda)
    #[arg(long, default_value = "cpu")]
    pub device: crate::device::DeviceSpec,
    /// prompt tokens per prefill forward pass (bounds activation memory)
    #[arg(long, default_value_t = 2048)]
    pub prefill_chunk: usize,
    /// attention: harpe's kernels, or candle-flash-attn's forward (CUDA, --features flash-attn, bf16/f16,
    /// head dim 64/128) [default: candle-flash where built and the model fits it, else harpe]
    #[arg(long, value_enum)]
    pub attention: Option<crate::model::attention::AttentionChoice>,
    /// BOS before each prompt: auto = the tokenizer's own encoding (BOS only where its post-processor adds
    /// one, RULER's rule), always = the model's bos_token_id first, never = none
    #[arg(long, value_enum, default_value = "auto")]
    pub bos: crate::data::tokenize::PromptBos,
}

/// `predict(prompt, max_new_tokens) -> generated text`.
pub type PredictFn = dyn FnMut(&str, usize) -> Result<String>;

/// The model's `PredictFn`, and under which key its predictions are stored.
pub struct Predictor {
    /// run the model on a prompt
    pub predict: Box<PredictFn>,
    /// whether the model is shown BOS before every prompt (see `PromptKey`)
    pub key: PromptKey,
}

/// What a stored prediction's `prompt_sha256` hashes: the prompt text when the model saw BOS first (the
/// one rule harpe had before `--bos`, so those predictions stay valid), the text and a marker otherwise, so
/// that a prediction made under another BOS rule is recomputed, never mixed in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptKey {
    /// the model sees BOS before the prompt
    pub bos_first: bool,
}

impl PromptKey {
    /// The hash stored beside a prediction of `prompt`.
    pub fn sha256(self, prompt: &str) -> String {
        if self.bos_first {
            crate::util::sha256_hex(prompt.as_bytes())
        } else {
            crate::util::sha256_hex(format!("{prompt}\u{0}no BOS").as_bytes())
        }
    }
}

/// Load the model and return its predictor: the prompt encoded under `--bos`, greedy, stop at EOS
/// (dropped), the new tokens decoded with special tokens skipped (`generate::predict_text`).
fn model_predictor(dir: &Path, tok: Tokenizer, args: &EvalNiahArgs, max_length: usize) -> Result<Predictor> {
    let device = args.device.open("--device")?;
    let model = crate::model::load_model_dir(dir, args.dtype.dtype(), &device)?.with_inference_layout()?;
    let attention = crate::model::attention::AttentionImpl::for_eval(
        args.attention,
        &device,
        args.dtype.dtype(),
        model.cfg.head_dim,
    )?;
    let model = model.with_attention(attention);
    if max_length > model.max_context() {
        let msg = format!(
            "length {max_length} is beyond what {} can address under its RoPE scheme ({} positions)",
            dir.display(),
            model.max_context()
        );
        if !args.force {
            bail!("{msg}\nhint: drop the longer --lengths, or pass --force to measure extrapolation anyway");
        }
        eprintln!("warning: {msg}; running anyway (--force)");
    }
    let chunk = args.prefill_chunk.max(1);
    let bos = args.bos;
    let key = PromptKey { bos_first: bos.starts_with_bos(&tok, model.cfg.bos_token_id)? };
    let predict = Box::new(move |prompt: &str, max_new_tokens: usize| {
        crate::eval::generate::predict_text(&model, &tok, prompt, max_new_tokens, chunk, bos)
    });
    Ok(Predictor { predict, key })
}

/// `harpe eval-niah`.
pub fn run(args: EvalNiahArgs) -> Result<()> {
    // One writer per output directory (--out, else the --ruler-data root the predictions go to).
    let _lock = match args.out.as_ref().or(args.ruler_data.as_ref()) {
        Some(dir) => Some(crate::util::lock_dir(dir, "harpe eval-niah")?),
        None => None,
    };
    let (tok_path, tok) = eval_tokenizer(&args)?;
    // Load the model first (when running one) so that a bad model or length fails before sizing.
    let model_dir = match (&args.model, args.prepare_only) {
        (_, true) => None,
        (Some(m), false) => Some(m.clone()),
        (None, false) => {
            bail!("running the evaluation needs --model DIR\nhint: pass --prepare-only to only write the prompts")
        }
    };
    let ruler = match &args.ruler_data {
        Some(root) => {
            let tasks: Option<Vec<String>> = args
                .tasks
                .as_ref()
                .map(|t| t.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect());
            Some(ruler_cells(root, tasks.as_deref(), args.lengths.as_deref())?)
        }
        None => None,
    };
    let lengths = args.lengths.clone().unwrap_or_else(|| niah::DEFAULT_LENGTHS.to_vec());
    if lengths.is_empty() || lengths.contains(&0) {
        bail!("--lengths must list positive token counts\nhint: e.g. --lengths 4096,8192");
    }
    let grid_lengths = args.grid_lengths.clone().unwrap_or_else(|| lengths.clone());
    let tasks = if ruler.is_none() { parse_tasks(args.tasks.as_deref().unwrap_or("ruler"))? } else { vec![] };
    let max_length = match &ruler {
        Some(cells) => cells.iter().map(|c| c.length).max().unwrap_or(0),
        None => {
            let grid_max = if tasks.contains(&TaskSel::NeedleGrid) { grid_lengths.iter().copied().max() } else { None };
            lengths.iter().copied().max().into_iter().chain(grid_max).max().unwrap_or(0)
        }
    };
    let mut predict = match &model_dir {
        Some(dir) => Some(model_predictor(dir, tok.clone(), &args, max_length)?),
        None => None,
    };
    let (cells, out) = match ruler {
        Some(cells) => {
            let root = args.ruler_data.clone().unwrap_or_default();
            (cells, args.out.clone().unwrap_or(root))
        }
        None => {
            let Some(out) = args.out.clone() else {
                bail!("--out DIR is required\nhint: e.g. --out runs/niah");
            };
            let opts = NiahSampleOptions {
                tasks,
                grid_lengths,
                lengths,
                grid_depths: args.grid_depths,
                passkey_depths: args.passkey_depths,
                samples: args.samples,
                seed: args.seed,
                sizing: args.sizing,
            };
            (generated_cells(&args, &opts, &tok, &tok_path, &out)?, out)
        }
    };
    let (Some(predict), Some(model_dir)) = (predict.as_mut(), &model_dir) else {
        let n: usize = cells.iter().map(|c| c.records.len()).sum();
        println!("wrote {n} prompts in {} cells under {}", cells.len(), out.display());
        return Ok(());
    };
    let results = run_cells(&cells, &out, predict)?;
    let name = model_dir.file_name().map_or(model_dir.display().to_string(), |n| n.to_string_lossy().to_string());
    let written = niah_report::write_reports(&results, &out, &name)?;
    print!("{}", niah_report::summary_table(&results));
    for p in written {
        println!("wrote {}", p.display());
    }
    Ok(())
}

/// The tokenizer named by `--tokenizer`, else `--model`, with truncation and padding off; and its path.
fn eval_tokenizer(args: &EvalNiahArgs) -> Result<(PathBuf, Tokenizer)> {
    let tok_path = match (&args.tokenizer, &args.model) {
        (Some(t), _) => t.clone(),
        (None, Some(m)) => m.clone(),
        (None, None) => bail!("no tokenizer: pass --model DIR (with tokenizer.json) or --tokenizer FILE\nhint: --prepare-only needs only a tokenizer"),
    };
    let mut tok = crate::data::tokenize::load_tokenizer(&tok_path)?;
    tok.with_truncation(None).map_err(|e| anyhow::anyhow!("cannot disable truncation: {e}"))?;
    tok.with_padding(None);
    Ok((tok_path, tok))
}

/// Generate (or load from the cache) the cells of `opts` under `out`, keyed by the tokenizer file's and the
/// essays' hashes.
fn generated_cells(
    args: &EvalNiahArgs,
    opts: &NiahSampleOptions,
    tok: &Tokenizer,
    tok_path: &Path,
    out: &Path,
) -> Result<Vec<Cell>> {
    let essays = args.essays.as_deref().map(Essays::load).transpose()?;
    let tok_file = if tok_path.is_dir() { tok_path.join("tokenizer.json") } else { tok_path.to_path_buf() };
    let tok_sha = crate::util::sha256_file(&tok_file)?;
    prepare_cells(opts, tok, &tok_sha, essays.as_ref(), out)
}
