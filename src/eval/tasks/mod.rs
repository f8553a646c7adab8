//! `harpe eval-tasks`: the short-context regression benchmarks of HARPE's Table 3 (MMLU, HellaSwag,
//! ARC-Challenge/Easy, PIQA, TriviaQA) with EleutherAI lm-evaluation-harness's numbers, from local files.
//!
//! Reference: lm-evaluation-harness 0.4.13 (PyPI `lm-eval`), its task YAMLs `tasks/mmlu/default/`
//! (`_default_template_yaml`, `mmlu_<subject>.yaml`, `_mmlu*.yaml`, subject table in
//! `_generate_configs.py`), `tasks/hellaswag/{hellaswag.yaml,utils.py}`, `tasks/arc/arc_easy.yaml` +
//! `arc_challenge.yaml`, `tasks/piqa/piqa.yaml`, `tasks/triviaqa/default.yaml`, and `api/task.py`,
//! `api/samplers.py`, `api/metrics.py`, `api/group.py`, `models/huggingface.py`, `evaluator_utils.py`.
//! Where older harness versions differ (0.4.0-0.4.2 built few-shot contexts without `Message`s and
//! sampled n+1 only when the few-shot split was the evaluated split), harpe follows 0.4.13.
//!
//! The pipeline, one file per stage:
//! - `data.rs`: `DIR/<task>/<split>.jsonl` (MMLU `DIR/mmlu/<subject>/{dev,test}.jsonl`) into records,
//!   errors naming file:line and field;
//! - this file: the task table (splits, sampler, description, metrics) and each task's documents: its
//!   `doc_to_text`, `doc_to_choice`, `doc_to_target` and HellaSwag's `process_docs`;
//! - `prompt.rs`: few-shot selection (sampler + seed rule) and the context string;
//! - `score.rs`: requests -> tokens (`_encode_pair`), log-likelihoods with prefix reuse, greedy generation
//!   with stop strings;
//! - `results.rs`: per-sample metrics, aggregation, stderr, MMLU groups, the harness's results shape;
//! - `run.rs`: the command (progress, resume, outputs).
//!
//! The non-obvious decision: templates are written out per task in Rust (no Jinja engine), each next to
//! the YAML line it reproduces; the golden test (`tests/stage_eval/eval_tasks.rs`, fixtures from
//! `scripts/make_tasks_golden.py` running the harness itself) checks every prompt string, log-likelihood
//! and metric. Not done here: other harness tasks, chat templates, `.parquet` inputs (convert to JSONL).
pub mod data;
pub mod prompt;
pub mod results;
pub mod run;
pub mod score;

use anyhow::{anyhow, bail, Result};
use data::Record;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The harness version whose rules harpe reproduces.
pub const HARNESS_VERSION: &str = "0.4.13";

/// MMLU's 57 subjects and their category group (`tasks/mmlu/_generate_configs.py` SUBJECTS).
pub const MMLU_SUBJECTS: [(&str, &str); 57] = [
    ("abstract_algebra", "stem"),
    ("anatomy", "stem"),
    ("astronomy", "stem"),
    ("business_ethics", "other"),
    ("clinical_knowledge", "other"),
    ("college_biology", "stem"),
    ("college_chemistry", "stem"),
    ("college_computer_science", "stem"),
    ("college_mathematics", "stem"),
    ("college_medicine", "other"),
    ("college_physics", "stem"),
    ("computer_security", "stem"),
    ("conceptual_physics", "stem"),
    ("econometrics", "social_sciences"),
    ("electrical_engineering", "stem"),
    ("elementary_mathematics", "stem"),
    ("formal_logic", "humanities"),
    ("global_facts", "other"),
    ("high_school_biology", "stem"),
    ("high_school_chemistry", "stem"),
    ("high_school_computer_science", "stem"),
    ("high_school_european_history", "humanities"),
    ("high_school_geography", "social_sciences"),
    ("high_school_government_and_politics", "social_sciences"),
    ("high_school_macroeconomics", "social_sciences"),
    ("high_school_mathematics", "stem"),
    ("high_school_microeconomics", "social_sciences"),
    ("high_school_physics", "stem"),
    ("high_school_psychology", "social_sciences"),
    ("high_school_statistics", "stem"),
    ("high_school_us_history", "humanities"),
    ("high_school_world_history", "humanities"),
    ("human_aging", "other"),
    ("human_sexuality", "social_sciences"),
    ("international_law", "humanities"),
    ("jurisprudence", "humanities"),
    ("logical_fallacies", "humanities"),
    ("machine_learning", "stem"),
    ("management", "other"),
    ("marketing", "other"),
    ("medical_genetics", "other"),
    ("miscellaneous", "other"),
    ("moral_disputes", "humanities"),
    ("moral_scenarios", "humanities"),
    ("nutrition", "other"),
    ("philosophy", "humanities"),
    ("prehistory", "humanities"),
    ("professional_accounting", "other"),
    ("professional_law", "humanities"),
    ("professional_medicine", "other"),
    ("professional_psychology", "social_sciences"),
    ("public_relations", "social_sciences"),
    ("security_studies", "social_sciences"),
    ("sociology", "social_sciences"),
    ("us_foreign_policy", "social_sciences"),
    ("virology", "other"),
    ("world_religions", "humanities"),
];

/// MMLU's category groups in the order of `tasks/mmlu/default/_mmlu.yaml`, with their `group_alias`.
pub const MMLU_GROUPS: [(&str, &str); 4] =
    [("stem", "stem"), ("other", "other"), ("social_sciences", "social sciences"), ("humanities", "humanities")];

/// Which benchmark a task is.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// one MMLU subject (`mmlu_<subject>`)
    Mmlu(String),
    Hellaswag,
    ArcChallenge,
    ArcEasy,
    Piqa,
    Triviaqa,
}

/// How a few-shot pool is drawn (`fewshot_config.sampler`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sampler {
    /// `ContextSampler`: `Random(seed).sample(pool, n)` per document, one generator per task
    Random,
    /// `FirstNSampler`: the first n documents of the pool (MMLU's dev split)
    FirstN,
}

/// What the model is asked (`output_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// `multiple_choice` with `acc` and, when true, `acc_norm`
    MultipleChoice { acc_norm: bool },
    /// `generate_until` with TriviaQA's stop strings, `remove_whitespace` filter and `exact_match`
    Generate,
}

/// One harness task as configured by its YAML.
#[derive(Clone, Debug)]
pub struct TaskSpec {
    /// the harness's task name (`hellaswag`, `mmlu_anatomy`, ...)
    pub name: String,
    /// `task_alias` (MMLU subjects: the subject), else the name
    pub alias: String,
    pub kind: Kind,
    /// the directory holding `<split>.jsonl`
    pub dir: PathBuf,
    /// `test_split` if the YAML has one, else `validation_split` (the harness's `eval_docs`)
    pub eval_split: &'static str,
    /// `fewshot_split`, else `training_split` (the harness's `fewshot_docs`)
    pub fewshot_split: &'static str,
    /// whether the YAML's `fewshot_split` equals its `test_split` (both unset counts): then the sampler
    /// draws n + 1 and drops the evaluated document (`fewshot_context`, `ContextSampler.sample`)
    pub fewshot_excludes_doc: bool,
    pub sampler: Sampler,
    /// `description` (prepended to every context)
    pub description: String,
    pub output: Output,
    /// `metadata.version`
    pub version: f64,
    /// the harness's `dataset_path` / `dataset_name` this layout mirrors (for messages and results)
    pub dataset: &'static str,
}

/// The YAML facts of one non-MMLU task.
struct Row {
    name: &'static str,
    kind: Kind,
    eval_split: &'static str,
    fewshot_split: &'static str,
    excludes_doc: bool,
    output: Output,
    version: f64,
    dataset: &'static str,
}

const MC_NORM: Output = Output::MultipleChoice { acc_norm: true };

/// The harness's task YAMLs, one row each (test_split if set, else validation_split; few-shot from
/// training_split; `excludes_doc` where fewshot_split == test_split, both unset).
const TASK_TABLE: [Row; 5] = [
    // hellaswag.yaml: training_split train, validation_split validation, test_split null
    Row {
        name: "hellaswag",
        kind: Kind::Hellaswag,
        eval_split: "validation",
        fewshot_split: "train",
        excludes_doc: true,
        output: MC_NORM,
        version: 1.0,
        dataset: "Rowan/hellaswag",
    },
    // arc_easy.yaml (+ arc_challenge.yaml): train / validation / test
    Row {
        name: "arc_challenge",
        kind: Kind::ArcChallenge,
        eval_split: "test",
        fewshot_split: "train",
        excludes_doc: false,
        output: MC_NORM,
        version: 1.0,
        dataset: "allenai/ai2_arc ARC-Challenge",
    },
    Row {
        name: "arc_easy",
        kind: Kind::ArcEasy,
        eval_split: "test",
        fewshot_split: "train",
        excludes_doc: false,
        output: MC_NORM,
        version: 1.0,
        dataset: "allenai/ai2_arc ARC-Easy",
    },
    // piqa.yaml: train / validation, test_split null
    Row {
        name: "piqa",
        kind: Kind::Piqa,
        eval_split: "validation",
        fewshot_split: "train",
        excludes_doc: true,
        output: MC_NORM,
        version: 1.0,
        dataset: "baber/piqa",
    },
    // triviaqa/default.yaml: train / validation, no test_split; metadata.version 3.0
    Row {
        name: "triviaqa",
        kind: Kind::Triviaqa,
        eval_split: "validation",
        fewshot_split: "train",
        excludes_doc: true,
        output: Output::Generate,
        version: 3.0,
        dataset: "mandarjoshi/trivia_qa rc.nocontext",
    },
];

impl TaskSpec {
    /// The task of a harness name under the data root, or None for an unknown name.
    pub fn new(name: &str, data: &Path) -> Option<TaskSpec> {
        if let Some(r) = TASK_TABLE.iter().find(|r| r.name == name) {
            return Some(TaskSpec {
                name: name.to_string(),
                alias: name.to_string(),
                kind: r.kind.clone(),
                dir: data.join(name),
                eval_split: r.eval_split,
                fewshot_split: r.fewshot_split,
                fewshot_excludes_doc: r.excludes_doc,
                sampler: Sampler::Random,
                description: String::new(),
                output: r.output,
                version: r.version,
                dataset: r.dataset,
            });
        }
        let subject = name.strip_prefix("mmlu_")?;
        MMLU_SUBJECTS.iter().find(|(s, _)| *s == subject)?;
        // _default_template_yaml: test_split test, fewshot_split dev, sampler first_n; mmlu_<subject>.yaml:
        // description from _generate_configs.py ("_" -> " "), task_alias the subject
        Some(TaskSpec {
            name: name.to_string(),
            alias: subject.to_string(),
            kind: Kind::Mmlu(subject.to_string()),
            dir: data.join("mmlu").join(subject),
            eval_split: "test",
            fewshot_split: "dev",
            fewshot_excludes_doc: false,
            sampler: Sampler::FirstN,
            description: format!(
                "The following are multiple choice questions (with answers) about {}.\n\n",
                subject.replace('_', " ")
            ),
            output: Output::MultipleChoice { acc_norm: false },
            version: 1.0,
            dataset: "cais/mmlu",
        })
    }

    /// The MMLU category of an MMLU subject task.
    pub fn mmlu_category(&self) -> Option<&'static str> {
        match &self.kind {
            Kind::Mmlu(s) => MMLU_SUBJECTS.iter().find(|(x, _)| x == s).map(|(_, c)| *c),
            _ => None,
        }
    }

    /// The file of a split.
    pub fn split_path(&self, split: &str) -> PathBuf {
        self.dir.join(format!("{split}.jsonl"))
    }

    /// Turn one record of this task into a document (the YAML's templates), naming file:line on error.
    pub fn doc(&self, r: &Record) -> Result<Doc> {
        match &self.kind {
            Kind::Mmlu(_) => mmlu_doc(r),
            Kind::Hellaswag => hellaswag_doc(r),
            Kind::ArcChallenge | Kind::ArcEasy => arc_doc(r),
            Kind::Piqa => piqa_doc(r),
            Kind::Triviaqa => triviaqa_doc(r),
        }
    }
}

/// `[eval] tasks` and `tasks_shots` checked against the task data (the rest of `[eval]` is checked by
/// `EvalSection::validate` when the config loads): `harpe train` calls this before it writes anything.
pub fn check_section(sec: &crate::config::EvalSection, origin: &str) -> Result<()> {
    if let (Some(t), Some(d)) = (&sec.tasks, &sec.tasks_data) {
        let specs = parse_tasks(t, d).map_err(|e| anyhow!("{origin}: [eval] tasks: {e:#}"))?;
        run::shots_of(&sec.tasks_shots.arg(), &specs).map_err(|e| anyhow!("{origin}: [eval] tasks_shots: {e:#}"))?;
    }
    Ok(())
}

/// Expand `--tasks`: harness task names, `mmlu` (every subject present under DIR/mmlu, plus its groups)
/// and `mmlu_<subject>`. Returns the leaf tasks in order.
pub fn parse_tasks(list: &str, data: &Path) -> Result<Vec<TaskSpec>> {
    let mut out: Vec<TaskSpec> = vec![];
    let push = |t: TaskSpec, out: &mut Vec<TaskSpec>| {
        if !out.iter().any(|x| x.name == t.name) {
            out.push(t);
        }
    };
    for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if name == "mmlu" {
            let root = data.join("mmlu");
            let present: Vec<&str> = MMLU_SUBJECTS.iter().map(|(s, _)| *s).filter(|s| root.join(s).is_dir()).collect();
            if present.is_empty() {
                bail!(
                    "--tasks mmlu: no subject directory under {}\nhint: lay MMLU out as {}/<subject>/{{dev,test}}.jsonl \
                     (cais/mmlu's subjects, e.g. anatomy)",
                    root.display(),
                    root.display()
                );
            }
            for s in present {
                if let Some(t) = TaskSpec::new(&format!("mmlu_{s}"), data) {
                    push(t, &mut out);
                }
            }
            continue;
        }
        match TaskSpec::new(name, data) {
            Some(t) => push(t, &mut out),
            None => bail!(
                "--tasks: unknown task {name:?}\nhint: harpe knows mmlu, mmlu_<subject> (cais/mmlu's 57 subjects), \
                 hellaswag, arc_challenge, arc_easy, piqa and triviaqa"
            ),
        }
    }
    if out.is_empty() {
        bail!("--tasks selects nothing\nhint: e.g. --tasks mmlu,hellaswag,arc_challenge,piqa,triviaqa");
    }
    Ok(out)
}

/// The gold answer of a document (`doc_to_target`).
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    /// index into the choices
    Index(usize),
    /// TriviaQA's `answer.aliases` (the first one is the few-shot answer)
    Aliases(Vec<String>),
}

/// One document after the task's templates.
#[derive(Clone, Debug)]
pub struct Doc {
    /// `doc_to_text`
    pub text: String,
    /// `doc_to_choice` (empty for generation)
    pub choices: Vec<String>,
    /// `doc_to_target`
    pub target: Target,
    /// the record as read: the harness compares documents as whole rows (`x != doc`)
    pub raw: Value,
}

impl Doc {
    /// The answer text of a few-shot example (`build_qa_turn`: `c[a]`, or `a[0]` for a list).
    pub fn answer_text(&self) -> &str {
        match &self.target {
            Target::Index(i) => self.choices.get(*i).map(String::as_str).unwrap_or(""),
            Target::Aliases(a) => a.first().map(String::as_str).unwrap_or(""),
        }
    }
}

/// Python's `str.isspace` for one character (Rust's `char::is_whitespace` plus U+001C..U+001F).
pub fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip()`.
pub fn py_strip(s: &str) -> &str {
    s.trim_matches(py_isspace)
}

/// Unicode title case of one character (Python's `capitalize` uses it for the first one): the Latin
/// digraphs (ǅ ǈ ǋ ǲ) and Greek iota-subscript capitals have their own title forms; otherwise the
/// upper-case mapping with the rest of a multi-character expansion lower-cased (ß -> "Ss", ﬁ -> "Fi").
fn py_titlecase(c: char) -> String {
    let digraph = match c {
        '\u{1c4}'..='\u{1c6}' => Some('\u{1c5}'),
        '\u{1c7}'..='\u{1c9}' => Some('\u{1c8}'),
        '\u{1ca}'..='\u{1cc}' => Some('\u{1cb}'),
        '\u{1f1}'..='\u{1f3}' => Some('\u{1f2}'),
        '\u{1f80}'..='\u{1f87}' | '\u{1f90}'..='\u{1f97}' | '\u{1fa0}'..='\u{1fa7}' => char::from_u32(c as u32 + 8),
        '\u{1f88}'..='\u{1f8f}' | '\u{1f98}'..='\u{1f9f}' | '\u{1fa8}'..='\u{1faf}' => Some(c),
        '\u{1fb3}' => Some('\u{1fbc}'),
        '\u{1fc3}' => Some('\u{1fcc}'),
        '\u{1ff3}' => Some('\u{1ffc}'),
        _ => None,
    };
    if let Some(t) = digraph {
        return t.to_string();
    }
    let mut up = c.to_uppercase();
    match up.next() {
        Some(first) => std::iter::once(first).chain(up.flat_map(char::to_lowercase)).collect(),
        None => c.to_string(),
    }
}

/// Python's `str.capitalize()`: the first character title-cased, the rest lower-cased in the context
/// of the whole string (a final sigma after the first letter is "ς").
pub fn py_capitalize(s: &str) -> String {
    let Some(c) = s.chars().next() else { return String::new() };
    let lower = s.to_lowercase();
    let first: usize = c.to_lowercase().map(char::len_utf8).sum();
    py_titlecase(c) + lower.get(first..).unwrap_or_default()
}

/// A gold index checked against the number of choices (the harness only warns and scores 0; harpe
/// refuses, so nothing is silently wrong).
fn check_index(r: &Record, field: &str, i: i64, n: usize) -> Result<usize> {
    if i < 0 || i as usize >= n {
        bail!(
            "{}: `{field}` = {i} is out of range for {n} choices\nhint: the label must index the record's choices (0..{})",
            r.at(),
            n.saturating_sub(1)
        );
    }
    Ok(i as usize)
}

/// `_default_template_yaml`: "{{question.strip()}}\nA. {{choices[0]}}\nB. ...\nAnswer:", choices A-D,
/// target `answer`.
fn mmlu_doc(r: &Record) -> Result<Doc> {
    let q = r.str("question")?;
    let c = r.str_list("choices")?;
    if c.len() != 4 {
        bail!("{}: `choices` has {} entries, MMLU has 4\nhint: cais/mmlu records have four choices", r.at(), c.len());
    }
    let text = format!("{}\nA. {}\nB. {}\nC. {}\nD. {}\nAnswer:", py_strip(&q), c[0], c[1], c[2], c[3]);
    let choices: Vec<String> = ["A", "B", "C", "D"].iter().map(|s| s.to_string()).collect();
    let gold = check_index(r, "answer", r.int("answer")?, 4)?;
    Ok(Doc { text, choices, target: Target::Index(gold), raw: r.value.clone() })
}

/// `hellaswag/utils.py` `preprocess`: strip, " [title]" -> ". ", drop `\[.*?\]`, "  " -> " ".
pub fn hellaswag_preprocess(text: &str) -> String {
    let t = py_strip(text).replace(" [title]", ". ");
    // re.sub("\\[.*?\\]", "", t): the shortest [...] without a newline inside ('.' excludes '\n')
    let mut out = String::with_capacity(t.len());
    let mut rest = t.as_str();
    while let Some(i) = rest.find('[') {
        let after = &rest[i + 1..];
        let close = after.find(']').filter(|&j| !after[..j].contains('\n'));
        match close {
            Some(j) => {
                out.push_str(&rest[..i]);
                rest = &after[j + 1..];
            }
            None => {
                out.push_str(&rest[..i + 1]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out.replace("  ", " ")
}

/// `hellaswag.yaml` + `utils.process_docs`: query = preprocess(activity_label + ": " + ctx_a + " " +
/// ctx_b.capitalize()), choices = preprocess(endings), target `{{label}}` (a digit string).
fn hellaswag_doc(r: &Record) -> Result<Doc> {
    let ctx = format!("{} {}", r.str("ctx_a")?, py_capitalize(&r.str("ctx_b")?));
    let text = hellaswag_preprocess(&format!("{}: {ctx}", r.str("activity_label")?));
    let choices: Vec<String> = r.str_list("endings")?.iter().map(|e| hellaswag_preprocess(e)).collect();
    let label = match r.get("label")? {
        Value::String(s) if !s.is_empty() && s.chars().all(|c| c.is_ascii_digit()) => {
            s.parse::<i64>().unwrap_or(i64::MAX)
        }
        Value::Number(n) if n.is_i64() => n.as_i64().unwrap_or(-1),
        other => bail!(
            "{}: `label` is {other}, not a digit string\nhint: Rowan/hellaswag's test split has no labels; evaluate \
             validation.jsonl (records with label \"0\"..\"3\")",
            r.at()
        ),
    };
    let gold = check_index(r, "label", label, choices.len())?;
    Ok(Doc { text, choices, target: Target::Index(gold), raw: r.value.clone() })
}

/// `arc_easy.yaml`: "Question: {{question}}\nAnswer:", choices `choices.text`, target
/// `choices.label.index(answerKey)`.
fn arc_doc(r: &Record) -> Result<Doc> {
    let text = format!("Question: {}\nAnswer:", r.str("question")?);
    let sub = r.child("choices")?;
    let choices = sub.str_list("text")?;
    let labels = sub.str_list("label")?;
    let key = r.str("answerKey")?;
    let Some(gold) = labels.iter().position(|l| *l == key) else {
        bail!(
            "{}: `answerKey` {key:?} is not among choices.label {labels:?}\nhint: the label out of range: answerKey must be \
             one of the record's choice labels",
            r.at()
        );
    };
    if labels.len() != choices.len() {
        bail!(
            "{}: choices.text has {} entries but choices.label {}\nhint: allenai/ai2_arc records pair each text with a label",
            r.at(),
            choices.len(),
            labels.len()
        );
    }
    Ok(Doc { text, choices, target: Target::Index(gold), raw: r.value.clone() })
}

/// `piqa.yaml`: "Question: {{goal}}\nAnswer:", choices [sol1, sol2], target `label`.
fn piqa_doc(r: &Record) -> Result<Doc> {
    let text = format!("Question: {}\nAnswer:", r.str("goal")?);
    let choices = vec![r.str("sol1")?, r.str("sol2")?];
    let gold = check_index(r, "label", r.int("label")?, 2)?;
    Ok(Doc { text, choices, target: Target::Index(gold), raw: r.value.clone() })
}

/// `triviaqa/default.yaml`: "Question: {{question}}?\nAnswer:", target `answer.aliases`.
fn triviaqa_doc(r: &Record) -> Result<Doc> {
    let text = format!("Question: {}?\nAnswer:", r.str("question")?);
    let aliases = r.child("answer")?.str_list("aliases")?;
    if aliases.is_empty() {
        bail!("{}: `answer.aliases` is empty\nhint: a TriviaQA record needs at least one answer alias", r.at());
    }
    Ok(Doc { text, choices: vec![], target: Target::Aliases(aliases), raw: r.value.clone() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellaswag_preprocess_follows_utils_py() {
        assert_eq!(
            hellaswag_preprocess(" Home: [header] How to plant [title] Pick a spot. [step] Dig.  "),
            "Home: How to plant. Pick a spot. Dig."
        );
        // no ']' before a newline: the '[' stays
        assert_eq!(hellaswag_preprocess("a [b\nc] d"), "a [b\nc] d");
        assert_eq!(hellaswag_preprocess("x   y"), "x  y");
        assert_eq!(py_capitalize("the Eiffel tower"), "The eiffel tower");
        assert_eq!(py_strip("\u{1f} q \n"), "q");
    }

    #[test]
    fn task_names_follow_the_harness() {
        let d = Path::new("/data");
        assert_eq!(TaskSpec::new("mmlu_anatomy", d).unwrap().dir, Path::new("/data/mmlu/anatomy"));
        assert!(TaskSpec::new("mmlu_nonsense", d).is_none());
        let t = TaskSpec::new("mmlu_high_school_us_history", d).unwrap();
        assert!(t.description.ends_with("about high school us history.\n\n"));
        assert_eq!(TaskSpec::new("arc_challenge", d).unwrap().eval_split, "test");
        let e = parse_tasks("hellaswag,winogrande", d).unwrap_err().to_string();
        assert!(e.contains("winogrande") && e.contains("hint:"), "{e}");
    }
}
