//! RULER's eight needle-in-a-haystack tasks: generators, haystacks, sizing, prompts and scoring.
//!
//! Reference: `NVIDIA/RULER:scripts/data/synthetic/niah.py`, `constants.py`, `synthetic.yaml`,
//! `eval/evaluate.py` (RULER commit dd4c2ad, byte-identical to the first public NIAH code). Sample
//! generation consumes a CPython-compatible MT19937 in RULER's call order, so all eight tasks are
//! bit-exact given the same token counts (and, for the essay tasks, the same essay text).
//!
//! The non-obvious decisions: essays are split into sentences by a port of NLTK's Punkt with its
//! English model (`punkt.rs`), as RULER's `sent_tokenize`, and needle positions use RULER's float
//! arithmetic `int(len(sents) * (depth / 100))`, so the essay tasks are bit-exact too
//! (`tests/data/niah_essay_golden.json`).
//! Not here: the word keys (`niah_words.rs`), sizing a haystack to a length (`niah_sizing.rs`), running
//! the model (`niah_run.rs`), the needle grid (`needle_grid.rs`), passkey (`passkey.rs`).

use crate::eval::niah_words::WordList;
use crate::eval::punkt::Punkt;
use crate::eval::pyrandom::PyRandom;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// RULER's token budget for the answer (`tokens_to_generate` of the `niah` base task).
pub const NIAH_TOKENS_TO_GENERATE: usize = 128;

/// The noise haystack unit (also the passkey garbage sentence).
pub const NOISE: &str = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";

/// Needle sentence; `{type_needle_v}` is always the plural form.
const NEEDLE: &str = "One of the special magic {type_needle_v} for {key} is: {value}.";

const TEMPLATE: &str = "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?";
const ANSWER_PREFIX: &str = " The special magic {type_needle_v} for {query} mentioned in the provided text are";

/// Essay depth grid: `round_half_even(linspace(0, 100, 40))`.
pub const DEPTHS: [u32; 40] = [
    0, 3, 5, 8, 10, 13, 15, 18, 21, 23, 26, 28, 31, 33, 36, 38, 41, 44, 46, 49, 51, 54, 56, 59, 62, 64, 67, 69, 72, 74,
    77, 79, 82, 85, 87, 90, 92, 95, 97, 100,
];

/// RULER's default `SEQ_LENGTHS`, ascending.
pub const DEFAULT_LENGTHS: [usize; 6] = [4096, 8192, 16384, 32768, 65536, 131072];

// ------------------------------------------------------------------------------------------------
// Tasks

/// Haystack kind (`type_haystack`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HaystackKind {
    /// The repeated noise sentence (RULER R-Dec24 calls it `repeat`).
    Noise,
    /// Whitespace words of the essay corpus, split into sentences.
    Essay,
    /// Distractor needles of the same form as the real one.
    Needle,
}

/// Needle key/value type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NeedleType {
    /// 7-digit numbers.
    Numbers,
    /// adjective-noun words.
    Words,
    /// uuid4 strings.
    Uuids,
}

impl NeedleType {
    fn plural(self) -> &'static str {
        match self {
            NeedleType::Numbers => "numbers",
            NeedleType::Words => "words",
            NeedleType::Uuids => "uuids",
        }
    }

    fn generate(self, rng: &mut PyRandom) -> String {
        match self {
            NeedleType::Numbers => rng.randint(1_000_000, 9_999_999).to_string(),
            NeedleType::Words => {
                let w = WordList::get();
                w.word(rng.choice_index(w.len()))
            }
            NeedleType::Uuids => rng.uuid4(),
        }
    }
}

/// The eight RULER NIAH tasks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NiahTask {
    /// noise haystack, word key, number value.
    Single1,
    /// essay haystack, word key, number value.
    Single2,
    /// essay haystack, word key, uuid value.
    Single3,
    /// essay haystack, 4 keys, 1 queried.
    Multikey1,
    /// needle haystack (distractors), word key, number value.
    Multikey2,
    /// needle haystack, uuid key, uuid value.
    Multikey3,
    /// essay haystack, 1 key with 4 values.
    Multivalue,
    /// essay haystack, 4 keys, all 4 queried.
    Multiquery,
}

/// One task's configuration (`synthetic.yaml`).
#[derive(Clone, Copy, Debug)]
pub struct TaskSpec {
    /// Haystack kind.
    pub haystack: HaystackKind,
    /// Key type.
    pub key: NeedleType,
    /// Value type.
    pub value: NeedleType,
    /// Keys (already `max(k, q)`).
    pub num_k: usize,
    /// Values per key.
    pub num_v: usize,
    /// Queried keys.
    pub num_q: usize,
}

impl NiahTask {
    /// All eight, in RULER's order.
    pub const ALL: [NiahTask; 8] = [
        NiahTask::Single1,
        NiahTask::Single2,
        NiahTask::Single3,
        NiahTask::Multikey1,
        NiahTask::Multikey2,
        NiahTask::Multikey3,
        NiahTask::Multivalue,
        NiahTask::Multiquery,
    ];

    /// RULER's task name (`niah_single_1`, ...).
    pub fn name(self) -> &'static str {
        match self {
            NiahTask::Single1 => "niah_single_1",
            NiahTask::Single2 => "niah_single_2",
            NiahTask::Single3 => "niah_single_3",
            NiahTask::Multikey1 => "niah_multikey_1",
            NiahTask::Multikey2 => "niah_multikey_2",
            NiahTask::Multikey3 => "niah_multikey_3",
            NiahTask::Multivalue => "niah_multivalue",
            NiahTask::Multiquery => "niah_multiquery",
        }
    }

    /// Parse a RULER task name.
    pub fn from_name(s: &str) -> Option<NiahTask> {
        NiahTask::ALL.into_iter().find(|t| t.name() == s)
    }

    /// The task's configuration.
    pub fn spec(self) -> TaskSpec {
        use HaystackKind::*;
        use NeedleType::*;
        let (haystack, key, value, num_k, num_v, num_q) = match self {
            NiahTask::Single1 => (Noise, Words, Numbers, 1, 1, 1),
            NiahTask::Single2 => (Essay, Words, Numbers, 1, 1, 1),
            NiahTask::Single3 => (Essay, Words, Uuids, 1, 1, 1),
            NiahTask::Multikey1 => (Essay, Words, Numbers, 4, 1, 1),
            NiahTask::Multikey2 => (Needle, Words, Numbers, 1, 1, 1),
            NiahTask::Multikey3 => (Needle, Uuids, Uuids, 1, 1, 1),
            NiahTask::Multivalue => (Essay, Words, Numbers, 1, 4, 1),
            NiahTask::Multiquery => (Essay, Words, Numbers, 4, 1, 4),
        };
        TaskSpec { haystack, key, value, num_k: num_k.max(num_q), num_v, num_q }
    }
}

/// Python `str.format` for the named fields used here, substituting in one pass.
fn format_named(template: &str, fields: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(template.len() + fields.iter().map(|f| f.1.len()).sum::<usize>());
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match after.find('}').and_then(|close| fields.iter().find(|f| f.0 == &after[..close]).map(|f| (close, f.1))) {
            Some((close, value)) => {
                out.push_str(value);
                rest = &after[close + 1..];
            }
            None => {
                out.push('{');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The task's full prompt template (base model: template + answer prefix), singularised as RULER does.
pub fn prompt_template(spec: &TaskSpec) -> (String, String) {
    let mut template = format!("{TEMPLATE}{ANSWER_PREFIX}");
    let mut tv = spec.value.plural().to_string();
    if spec.num_q * spec.num_v == 1 {
        for (from, to) in [("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")] {
            template = template.replace(from, to);
        }
        tv.pop();
    }
    (template, tv)
}

// ------------------------------------------------------------------------------------------------
// Essays

/// An essay haystack: whitespace-separated words of the concatenated corpus.
pub struct Essays {
    /// `re.sub(r'\s+', ' ', text).split(' ')`.
    pub words: Vec<String>,
    /// The raw concatenated text (the needle grid tokenizes it directly).
    pub text: String,
    /// Where it came from, for messages.
    pub origin: String,
}

fn is_py_space(c: char) -> bool {
    // Python's `\s` on str = str.isspace(): Unicode White_Space plus the ASCII separators 0x1c-0x1f.
    c.is_whitespace() || ('\x1c'..='\x1f').contains(&c)
}

impl Essays {
    /// Build from text (RULER's preprocessing).
    pub fn from_text(text: String, origin: String) -> Essays {
        let mut norm = String::with_capacity(text.len());
        let mut in_space = false;
        for c in text.chars() {
            if is_py_space(c) {
                if !in_space {
                    norm.push(' ');
                }
                in_space = true;
            } else {
                norm.push(c);
                in_space = false;
            }
        }
        let words = norm.split(' ').map(str::to_string).collect();
        Essays { words, text, origin }
    }

    /// Read `--essays PATH`: a `.txt` file, RULER's `PaulGrahamEssays.json` (`{"text": ...}`), or a
    /// directory whose `*.txt` files are concatenated in sorted name order with no separator.
    pub fn load(path: &Path) -> Result<Essays> {
        let hint = "hint: --essays takes a .txt file, a directory of .txt files, or RULER's PaulGrahamEssays.json";
        let text = if path.is_dir() {
            let files = crate::util::sorted_entries(path, hint, |p| p.extension().is_some_and(|e| e == "txt"))?;
            if files.is_empty() {
                bail!("{} holds no .txt files\n{hint}", path.display());
            }
            let mut text = String::new();
            for f in &files {
                text.push_str(
                    &std::fs::read_to_string(f)
                        .with_context(|| format!("cannot read essay {} as UTF-8 text\n{hint}", f.display()))?,
                );
            }
            text
        } else {
            let raw = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read essays {} as UTF-8 text\n{hint}", path.display()))?;
            if path.extension().is_some_and(|e| e == "json") {
                let v: serde_json::Value = serde_json::from_str(&raw)
                    .with_context(|| format!("{} is not valid JSON\n{hint}", path.display()))?;
                match v.get("text").and_then(|t| t.as_str()) {
                    Some(t) => t.to_string(),
                    None => bail!("{} has no string field \"text\"\n{hint}", path.display()),
                }
            } else {
                raw
            }
        };
        if text.trim().is_empty() {
            bail!("essays {} are empty\n{hint}", path.display());
        }
        Ok(Essays::from_text(text, path.display().to_string()))
    }
}

// ------------------------------------------------------------------------------------------------
// Sample generation (`generate_input_output`)

/// One generated prompt.
#[derive(Clone, Debug)]
pub struct Generated {
    /// The full prompt: template with context and answer prefix (RULER R-Dec24 `input`).
    pub input: String,
    /// Gold answers in query order.
    pub answers: Vec<String>,
    /// Needle depths in percent of the haystack, in insertion order.
    pub depths: Vec<f64>,
}

/// RULER's generator for one task, holding the global RNG (`random.seed(seed)`).
pub struct NiahGenerator<'a> {
    spec: TaskSpec,
    template: String,
    type_v: String,
    essays: Option<&'a Essays>,
    seed: i64,
    /// The process-global RNG, consumed by sizing trials and samples alike.
    pub rng: PyRandom,
}

impl<'a> NiahGenerator<'a> {
    /// A generator for `task`; essay tasks need `essays`.
    pub fn new(task: NiahTask, seed: i64, essays: Option<&'a Essays>) -> Result<NiahGenerator<'a>> {
        Self::from_spec(task.spec(), task.name(), seed, essays)
    }

    /// A generator for any task configuration (`name` is for messages).
    pub fn from_spec(spec: TaskSpec, name: &str, seed: i64, essays: Option<&'a Essays>) -> Result<NiahGenerator<'a>> {
        if spec.haystack == HaystackKind::Essay && essays.is_none() {
            bail!(
                "task {name} uses the essay haystack, but no essays were given\nhint: pass --essays PATH (a .txt file, a \
                 directory of .txt files, or RULER's PaulGrahamEssays.json), or choose the noise/needle tasks with \
                 --tasks niah_single_1,niah_multikey_2,niah_multikey_3",
            );
        }
        let spec = TaskSpec { num_k: spec.num_k.max(spec.num_q), ..spec };
        let (template, type_v) = prompt_template(&spec);
        Ok(NiahGenerator { spec, template, type_v, essays, seed, rng: PyRandom::new(seed) })
    }

    /// Units in the haystack source (essay words), or None when unbounded.
    pub fn haystack_limit(&self) -> Option<usize> {
        match self.spec.haystack {
            HaystackKind::Essay => self.essays.map(|e| e.words.len()),
            _ => None,
        }
    }

    /// The task's haystack kind.
    pub fn haystack(&self) -> HaystackKind {
        self.spec.haystack
    }

    /// Where the essays came from (empty without essays), for messages.
    pub fn essays_origin(&self) -> &str {
        self.essays.map_or("", |e| e.origin.as_str())
    }

    fn needle(&self, key: &str, value: &str) -> String {
        format_named(NEEDLE, &[("type_needle_v", self.spec.value.plural()), ("key", key), ("value", value)])
    }

    /// `generate_input_output(num_haystack)`.
    pub fn generate(&mut self, num_haystack: usize) -> Generated {
        let s = self.spec;
        let mut keys = Vec::with_capacity(s.num_k);
        let mut values: Vec<Vec<String>> = Vec::with_capacity(s.num_k);
        let mut needles = Vec::new();
        for _ in 0..s.num_k {
            let key = s.key.generate(&mut self.rng);
            let mut vals = Vec::with_capacity(s.num_v);
            for _ in 0..s.num_v {
                let v = s.value.generate(&mut self.rng);
                needles.push(self.needle(&key, &v));
                vals.push(v);
            }
            keys.push(key);
            values.push(vals);
        }
        // A fresh Random(seed): the permutation depends only on the number of needles.
        PyRandom::new(self.seed).shuffle(&mut needles);

        let (context, depths) = match s.haystack {
            HaystackKind::Essay => {
                let words = self.essays.map_or(&[][..], |e| &e.words[..]);
                let text = words[..num_haystack.min(words.len())].join(" ");
                let sents = Punkt::english().tokenize(text.trim_matches(' '));
                let ds = self.rng.sample(&DEPTHS, needles.len());
                // RULER: int(len(sents) * (depth / 100)), in f64 (29% of 100 sentences is 28 there).
                let mut pos: Vec<usize> =
                    ds.iter().map(|&d| (sents.len() as f64 * (f64::from(d) / 100.0)) as usize).collect();
                pos.sort_unstable();
                let mut sorted_ds = ds.clone();
                sorted_ds.sort_unstable();
                let bounds: Vec<usize> = std::iter::once(0).chain(pos).chain(std::iter::once(sents.len())).collect();
                let mut parts = Vec::with_capacity(2 * bounds.len());
                for i in 1..bounds.len() {
                    parts.push(sents[bounds[i - 1]..bounds[i]].join(" "));
                    if i - 1 < needles.len() {
                        parts.push(needles[i - 1].clone());
                    }
                }
                (parts.join(" "), sorted_ds.into_iter().map(f64::from).collect())
            }
            HaystackKind::Noise | HaystackKind::Needle => {
                let mut sents: Vec<String> = if s.haystack == HaystackKind::Noise {
                    vec![NOISE.to_string(); num_haystack]
                } else {
                    (0..num_haystack)
                        .map(|_| {
                            let k = s.key.generate(&mut self.rng);
                            let v = s.value.generate(&mut self.rng);
                            self.needle(&k, &v)
                        })
                        .collect()
                };
                let mut idx = self.rng.sample_indices(num_haystack, needles.len());
                idx.sort_unstable_by(|a, b| b.cmp(a));
                let depths = idx.iter().map(|&i| 100.0 * i as f64 / num_haystack.max(1) as f64).collect();
                for (&i, nd) in idx.iter().zip(&needles) {
                    sents.insert(i, nd.clone());
                }
                (sents.join("\n"), depths)
            }
        };

        let ind = self.rng.sample_indices(s.num_k, s.num_q);
        let queries: Vec<&str> = ind.iter().map(|&i| keys[i].as_str()).collect();
        let answers: Vec<String> = ind.iter().flat_map(|&i| values[i].iter().cloned()).collect();
        let query = match queries.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{}, and {last}", rest.join(", ")),
            _ => queries.first().map_or(String::new(), |q| q.to_string()),
        };
        let input =
            format_named(&self.template, &[("type_needle_v", &self.type_v), ("context", &context), ("query", &query)]);
        Generated { input, answers, depths }
    }
}

// ------------------------------------------------------------------------------------------------
// ------------------------------------------------------------------------------------------------
// Scoring

/// RULER metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Fraction of gold answers contained in the prediction.
    StringMatchAll,
    /// 1 if any gold answer is contained.
    StringMatchPart,
}

/// `postprocess(pred)`: strip, control characters to newlines, strip.
pub fn postprocess(pred: &str) -> String {
    let s: String = pred.trim().chars().map(|c| if (c as u32) < 0x20 { '\n' } else { c }).collect();
    s.trim().to_string()
}

/// Per-sample score in [0, 1] (RULER multiplies the mean by 100).
pub fn score_sample(metric: Metric, pred: &str, refs: &[String]) -> f64 {
    let p = postprocess(pred).to_lowercase();
    let hits = refs.iter().filter(|r| p.contains(&r.to_lowercase()));
    match metric {
        Metric::StringMatchAll if refs.is_empty() => 0.0,
        Metric::StringMatchAll => hits.count() as f64 / refs.len() as f64,
        Metric::StringMatchPart => f64::from(u8::from(hits.count() > 0)),
    }
}

/// RULER's task score: `round(100 * mean, 2)`.
pub fn task_score(per_sample: &[f64]) -> f64 {
    if per_sample.is_empty() {
        return 0.0;
    }
    (100.0 * per_sample.iter().sum::<f64>() / per_sample.len() as f64 * 100.0).round() / 100.0
}

/// RULER's `Nulls` count: predictions empty after postprocess.
pub fn count_nulls(preds: &[&str]) -> usize {
    preds.iter().filter(|p| postprocess(p).is_empty()).count()
}

/// `tokens_to_generate` and metric for any RULER synthetic task name, for reading RULER files.
pub fn ruler_task_settings(task: &str) -> Option<(usize, Metric)> {
    if NiahTask::from_name(task).is_some() {
        return Some((NIAH_TOKENS_TO_GENERATE, Metric::StringMatchAll));
    }
    match task {
        "vt" => Some((30, Metric::StringMatchAll)),
        "cwe" => Some((120, Metric::StringMatchAll)),
        "fwe" => Some((50, Metric::StringMatchAll)),
        "qa_1" | "qa_2" => Some((32, Metric::StringMatchPart)),
        _ => None,
    }
}

/// RULER leaderboard aggregates over lengths ascending: (Avg, wAvg inc, wAvg dec).
pub fn length_averages(scores: &[f64]) -> (f64, f64, f64) {
    let n = scores.len();
    if n == 0 {
        return (0.0, 0.0, 0.0);
    }
    let avg = scores.iter().sum::<f64>() / n as f64;
    let wsum = (n * (n + 1) / 2) as f64;
    let inc = scores.iter().enumerate().map(|(i, s)| (i + 1) as f64 * s).sum::<f64>() / wsum;
    let dec = scores.iter().enumerate().map(|(i, s)| (n - i) as f64 * s).sum::<f64>() / wsum;
    (avg, inc, dec)
}
