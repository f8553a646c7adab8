//! `harpe eval-ppl`: sliding-window perplexity of text files under a model directory.
//!
//! Reference: Press et al. sliding windows; YaRN `eval/perplexity.py`.
//! The rule, pinned: with N tokens, window k spans [kS, min(kS + W, N)) and scores the targets t with
//! max(end of window k-1, kS + 1) <= t < end of window k, each from the context inside its window; stop
//! after the window that reaches N. With S < W, x_1..x_{N-1} are each scored exactly once; S == W gives
//! disjoint windows whose first tokens are unscored (transformers' recipe); S > W is refused (see `windows`).
//! The NLL is `model::loss::chunked_nll` (the training loss's rule): f32 logits on chunks of `--loss-chunk`
//! positions (never (T x V) logits at once), log-sum-exp and sums in f64, only the NLLs leave the
//! device. `ScoringModel` (shared with eval-loss) opens `--device` and picks its attention. Not done here:
//! YaRN's BOS-per-window / truncate variant (pre-cut files with --max-tokens).
use crate::data::tokenize::load_tokenizer;
use crate::device::{ComputeDtype, DeviceSpec};
use crate::model::attention::{AttentionChoice, AttentionImpl};
use crate::model::llama::Tokens;
use crate::model::{load_model_dir, rope::RopeParity, Llama};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Tensor};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// How per-token NLLs are averaged into `nll`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Aggregate {
    /// token-weighted mean over every scored token (the standard perplexity)
    Token,
    /// YaRN's unweighted mean of per-window means over all windows of all documents
    WindowMean,
}

/// The model flags shared by the commands that score tokens (eval-ppl, eval-loss).
#[derive(clap::Args, Debug, Clone)]
pub struct ScoringModel {
    /// HF model directory (config.json, *.safetensors, tokenizer.json)
    #[arg(long)]
    pub model: PathBuf,
    /// compute dtype of weights and activations (log-softmax is always f32)
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: ComputeDtype,
    /// device to run the model on: cpu, cuda or cuda:N (CUDA needs a build with --features cuda)
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
    /// RoPE arithmetic: f64 angles (accurate at 128K) or transformers' f32 arithmetic
    #[arg(long, value_enum, default_value = "f64")]
    pub rope_parity: RopeParity,
    /// positions per chunk of the chunked log-softmax
    #[arg(long, default_value_t = 1024)]
    pub loss_chunk: usize,
    /// attention: harpe's kernels, or candle-flash-attn's forward (CUDA, --features flash-attn, bf16/f16,
    /// head dim 64/128) [default: candle-flash where built and the model fits it, else harpe]
    #[arg(long, value_enum)]
    pub attention: Option<AttentionChoice>,
}

impl ScoringModel {
    /// The defaults of the flags for a model directory.
    pub fn new(model: &Path) -> ScoringModel {
        ScoringModel {
            model: model.to_path_buf(),
            dtype: ComputeDtype::F32,
            device: DeviceSpec::Cpu,
            rope_parity: RopeParity::F64,
            loss_chunk: 1024,
            attention: None,
        }
    }

    /// Load the model on the chosen device in the chosen dtype, RoPE arithmetic and attention.
    pub fn load(&self) -> Result<Llama> {
        let device = self.device.open("--device")?;
        let mut model = load_model_dir(&self.model, self.dtype.dtype(), &device)?.with_inference_layout()?;
        model.parity = self.rope_parity;
        let attention = AttentionImpl::for_eval(self.attention, &device, self.dtype.dtype(), model.cfg.head_dim)?;
        Ok(model.with_attention(attention))
    }
}

/// Sliding-window perplexity of text under a model.
#[derive(clap::Args, Debug)]
pub struct EvalPplArgs {
    #[command(flatten)]
    pub scoring: ScoringModel,
    /// text inputs: .txt files (one document each), .jsonl files (one document per line, field `text`),
    /// or directories of them (sorted by name)
    #[arg(long, required = true, num_args = 1..)]
    pub input: Vec<PathBuf>,
    /// window length W in tokens (the model's context for each forward pass)
    #[arg(long, default_value_t = 4096)]
    pub window: usize,
    /// stride S between window starts; each window scores only tokens not scored before. S < W: every
    /// token after the first is scored once; S = W: disjoint windows, each window's first token unscored;
    /// S > W is refused unless the document fits in one window
    #[arg(long, default_value_t = 256)]
    pub stride: usize,
    /// cut each document to its first N tokens (after tokenization, BOS included)
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// what `nll`/`ppl` report: token-weighted mean, or YaRN's mean of window means
    #[arg(long, value_enum, default_value = "token")]
    pub aggregate: Aggregate,
    /// print one JSON object on stdout instead of a table
    #[arg(long)]
    pub json: bool,
    /// tokenizer.json to use instead of the model directory's
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

/// Result of one document (or of the total).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PplResult {
    pub name: String,
    pub nll: f64,
    pub ppl: f64,
    pub tokens: usize,
    pub windows: usize,
    pub token_nll: f64,
    pub window_mean_nll: f64,
}

/// Raw sums of one document.
#[derive(Clone, Debug, Default)]
pub struct WindowSums {
    pub nll_sum: f64,
    pub tokens: usize,
    pub window_means: Vec<f64>,
    /// per window in order: scored targets, and wall seconds of its forward pass and log-softmax
    pub window_tokens: Vec<usize>,
    pub window_seconds: Vec<f64>,
}

impl WindowSums {
    /// Adds another's sums and appends its windows.
    pub fn extend(&mut self, o: &WindowSums) {
        self.nll_sum += o.nll_sum;
        self.tokens += o.tokens;
        self.window_means.extend(o.window_means.iter().copied());
        self.window_tokens.extend(o.window_tokens.iter().copied());
        self.window_seconds.extend(o.window_seconds.iter().copied());
    }

    /// Scored targets per second over every window but the first (the first pays the one-time costs:
    /// the allocator's first touch of each buffer, rayon's thread start-up), or None with one window.
    pub fn warm_tokens_per_s(&self) -> Option<f64> {
        let secs: f64 = self.window_seconds.iter().skip(1).sum();
        let toks: usize = self.window_tokens.iter().skip(1).sum();
        (self.window_seconds.len() > 1 && secs > 0.0).then(|| toks as f64 / secs)
    }
}

/// The windows of the pinned rule: (begin, end, first scored target).
///
/// Window k spans [kS, min(kS + W, N)) and scores the targets t with
/// max(end of window k-1, kS + 1) <= t < end of window k. With S < W that is every target not scored
/// before; with S == W the windows are disjoint and each one's first token is context only (it has
/// nothing before it in its window), as in transformers' perplexity recipe with stride = max_length.
/// A document that fits in the first window (N <= W) is one window whatever S is; S > W is refused
/// only when a second window is needed (the tokens between windows would go unscored). A window
/// left with no target (the 1-token tail of S == W) is dropped.
pub fn windows(n: usize, window: usize, stride: usize) -> Result<Vec<(usize, usize, usize)>> {
    crate::config::check_window(window, stride)?;
    if n < 2 {
        return Ok(vec![]);
    }
    if n <= window {
        return Ok(vec![(0, n, 1)]);
    }
    if stride > window {
        bail!(
            "--stride {stride} is larger than --window {window}: a document of {n} tokens needs several windows and the \
             tokens between them would go unscored\nhint: pass --stride <= --window (--stride {window} scores disjoint \
             windows)"
        );
    }
    let mut out = vec![];
    let mut prev_end = 0;
    let mut k = 0;
    loop {
        let begin = k * stride;
        let end = (begin + window).min(n);
        let lo = prev_end.max(begin + 1);
        if lo < end {
            out.push((begin, end, lo));
        }
        prev_end = end;
        if end == n {
            return Ok(out);
        }
        k += 1;
    }
}

/// Per-position NLLs: for window positions p in [p0, p1), -ln p(ids[p + 1] | ids[..=p]) from the
/// final hidden states (1, L, C), by `model::loss::chunked_nll` (f32 logits, f64 sums; only the NLLs leave the device).
pub fn position_nlls(
    model: &Llama,
    hidden: &Tensor,
    ids: &[u32],
    p0: usize,
    p1: usize,
    chunk: usize,
) -> Result<Vec<f64>> {
    if p1 <= p0 {
        return Ok(vec![]);
    }
    let targets = Tensor::new(&ids[p0 + 1..p1 + 1], hidden.device())?; // (p1 - p0)
    let nll = crate::model::loss::chunked_nll(&targets, chunk, DType::F64, |start, len| {
        let logits =
            model.logits(&hidden.narrow(1, p0 + start, len)?).map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
        logits.squeeze(0)?.to_dtype(DType::F32) // (len, V)
    })?;
    Ok(nll.to_vec1::<f64>()?)
}

/// NLL sums of one token sequence under the pinned sliding-window rule.
pub fn window_nll(model: &Llama, ids: &[u32], window: usize, stride: usize, chunk: usize) -> Result<WindowSums> {
    let dev = model.device().clone();
    let mut sums = WindowSums::default();
    for (begin, end, lo) in windows(ids.len(), window, stride)? {
        let t0 = std::time::Instant::now();
        let x = Tensor::new(&ids[begin..end], &dev)?.unsqueeze(0)?; // (1, L)
        let hidden = model.forward(&x, Tokens::At(0))?; // (1, L, C)
                                                        // target t is predicted at window position t - 1 - begin
        let nlls = position_nlls(model, &hidden, &ids[begin..end], lo - 1 - begin, end - 1 - begin, chunk)?;
        let wsum: f64 = nlls.iter().sum();
        let n = end - lo;
        sums.nll_sum += wsum;
        sums.tokens += n;
        sums.window_means.push(wsum / n as f64);
        sums.window_tokens.push(n);
        sums.window_seconds.push(t0.elapsed().as_secs_f64());
    }
    Ok(sums)
}

/// Tokenize each document (BOS added), cut it to `max_tokens`, and score it under the pinned window rule:
/// per-document sums and their total (shared by `eval-ppl` and evaluation during training).
pub fn score_documents(
    model: &Llama,
    tok: &tokenizers::Tokenizer,
    docs: &[(String, String)],
    window: usize,
    stride: usize,
    max_tokens: Option<usize>,
    chunk: usize,
) -> Result<(Vec<(String, WindowSums)>, WindowSums)> {
    let mut per_doc = vec![];
    let mut total = WindowSums::default();
    for (name, text) in docs {
        let enc = tok.encode(text.as_str(), true).map_err(|e| anyhow!("{name}: tokenization failed: {e}"))?;
        let mut ids = enc.get_ids().to_vec();
        if let Some(m) = max_tokens {
            ids.truncate(m);
        }
        if ids.iter().any(|&i| i as usize >= model.cfg.vocab_size) {
            bail!("{name}: the tokenizer produced ids >= vocab_size {}\nhint: the tokenizer does not belong to this model", model.cfg.vocab_size);
        }
        let s = window_nll(model, &ids, window, stride, chunk)?;
        total.extend(&s);
        per_doc.push((name.clone(), s));
    }
    Ok((per_doc, total))
}

/// The reported numbers of one document's (or the total's) sums under an aggregate.
pub fn result(name: &str, s: &WindowSums, agg: Aggregate) -> PplResult {
    let token_nll = if s.tokens > 0 { s.nll_sum / s.tokens as f64 } else { f64::NAN };
    let window_mean_nll = if s.window_means.is_empty() {
        f64::NAN
    } else {
        s.window_means.iter().sum::<f64>() / s.window_means.len() as f64
    };
    let nll = match agg {
        Aggregate::Token => token_nll,
        Aggregate::WindowMean => window_mean_nll,
    };
    PplResult {
        name: name.to_string(),
        nll,
        ppl: nll.exp(),
        tokens: s.tokens,
        windows: s.window_means.len(),
        token_nll,
        window_mean_nll,
    }
}

/// Documents of the inputs: (name, text), in order.
pub fn read_documents(inputs: &[PathBuf]) -> Result<Vec<(String, String)>> {
    let mut files = vec![];
    for p in inputs {
        if p.is_dir() {
            let v = crate::util::sorted_entries(p, "hint: pass text files or a directory of them", |f| {
                matches!(f.extension().and_then(|e| e.to_str()), Some("txt" | "jsonl"))
            })?;
            if v.is_empty() {
                bail!(
                    "{}: no .txt or .jsonl files in this directory\nhint: pass text files or a directory of them",
                    p.display()
                );
            }
            files.extend(v);
        } else {
            files.push(p.clone());
        }
    }
    let mut docs = vec![];
    for f in files {
        let bytes =
            std::fs::read(&f).with_context(|| format!("cannot read {}\nhint: check the --input path", f.display()))?;
        let text = String::from_utf8(bytes).map_err(|e| {
            anyhow!(
                "{}: invalid UTF-8 at byte {}\nhint: eval-ppl reads UTF-8 text",
                f.display(),
                e.utf8_error().valid_up_to()
            )
        })?;
        if f.extension().and_then(|e| e.to_str()) == Some("jsonl") {
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
                    anyhow!(
                        "{}:{}: malformed JSON: {e}\nhint: one JSON object per line with a `text` field",
                        f.display(),
                        i + 1
                    )
                })?;
                let t = v.get("text").and_then(|t| t.as_str()).ok_or_else(|| {
                    anyhow!(
                        "{}:{}: no string field `text`\nhint: one JSON object per line with a `text` field",
                        f.display(),
                        i + 1
                    )
                })?;
                docs.push((format!("{}:{}", f.display(), i + 1), t.to_string()));
            }
        } else {
            docs.push((f.display().to_string(), text));
        }
    }
    Ok(docs)
}

/// Evaluate; returns per-document results and the total.
pub fn evaluate(args: &EvalPplArgs) -> Result<(Vec<PplResult>, PplResult)> {
    evaluate_timed(args).map(|(docs, total, _)| (docs, total))
}

/// Wall time of the scoring alone (the forward passes and log-softmax of every window; not loading the
/// model, reading or tokenizing the inputs): `--json`'s `seconds`, `tokens_per_s` and `warm_tokens_per_s`.
#[derive(Clone, Copy, Debug)]
pub struct ScoringTime {
    pub seconds: f64,
    /// `WindowSums::warm_tokens_per_s` of the total: every window after the first
    pub warm_tokens_per_s: Option<f64>,
}

/// `evaluate` plus the scoring's wall time.
pub fn evaluate_timed(args: &EvalPplArgs) -> Result<(Vec<PplResult>, PplResult, ScoringTime)> {
    windows(2, args.window, args.stride)?; // validate W, S before loading anything
    let model = args.scoring.load()?;
    let tok = load_tokenizer(args.tokenizer.as_deref().unwrap_or(&args.scoring.model))?;
    if args.window > model.max_context() {
        eprintln!(
            "warning: --window {} exceeds max_position_embeddings {} of {}",
            args.window,
            model.max_context(),
            args.scoring.model.display()
        );
    }
    let docs = read_documents(&args.input)?;
    let t0 = std::time::Instant::now();
    let (sums, total) =
        score_documents(&model, &tok, &docs, args.window, args.stride, args.max_tokens, args.scoring.loss_chunk)?;
    let secs = t0.elapsed().as_secs_f64();
    let per_doc = sums.iter().map(|(name, s)| result(name, s, args.aggregate)).collect();
    if total.tokens == 0 {
        bail!("no tokens to score (every document has fewer than 2 tokens)\nhint: check the --input files");
    }
    let tot = result("total", &total, args.aggregate);
    Ok((per_doc, tot, ScoringTime { seconds: secs, warm_tokens_per_s: total.warm_tokens_per_s() }))
}

/// `harpe eval-ppl`.
pub fn run(args: EvalPplArgs) -> Result<()> {
    let (docs, total, time) = evaluate_timed(&args)?;
    if args.json {
        let secs = time.seconds;
        let v = serde_json::json!({
            "nll": total.nll, "ppl": total.ppl, "tokens": total.tokens, "windows": total.windows,
            "seconds": secs, "tokens_per_s": total.tokens as f64 / secs, "warm_tokens_per_s": time.warm_tokens_per_s,
            "aggregate": args.aggregate, "token_nll": total.token_nll, "window_mean_nll": total.window_mean_nll,
            "window": args.window, "stride": args.stride, "model": args.scoring.model, "documents": docs,
        });
        println!("{}", serde_json::to_string(&v)?);
    } else {
        println!("{:<50} {:>10} {:>10} {:>8} {:>8}", "document", "nll", "ppl", "tokens", "windows");
        for r in docs.iter().chain(std::iter::once(&total)) {
            let name = if r.name.len() > 50 { &r.name[r.name.len() - 50..] } else { &r.name };
            println!("{:<50} {:>10.5} {:>10.4} {:>8} {:>8}", name, r.nll, r.ppl, r.tokens, r.windows);
        }
    }
    Ok(())
}

/// Path helper for tests and scripts: evaluate one text file with defaults.
pub fn eval_file(model: &Path, input: &Path, window: usize, stride: usize) -> Result<PplResult> {
    let args = EvalPplArgs {
        scoring: ScoringModel::new(model),
        input: vec![input.to_path_buf()],
        window,
        stride,
        max_tokens: None,
        aggregate: Aggregate::Token,
        json: false,
        tokenizer: None,
    };
    Ok(evaluate(&args)?.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The warm rate counts every window but the first; totals keep each document's windows in order.
    #[test]
    fn warm_rate_skips_the_first_window_of_the_total() {
        let a = WindowSums { window_tokens: vec![5, 10], window_seconds: vec![2.0, 0.5], ..Default::default() };
        let b = WindowSums { window_tokens: vec![10], window_seconds: vec![0.5], ..Default::default() };
        let mut total = WindowSums::default();
        total.extend(&a);
        total.extend(&b);
        assert_eq!(total.window_tokens, [5, 10, 10]);
        assert_eq!(total.warm_tokens_per_s(), Some(20.0));
        assert_eq!(b.warm_tokens_per_s(), None);
    }
}
