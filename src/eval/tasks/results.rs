//! Per-sample metrics, their aggregation and standard errors, MMLU's groups, and the harness's
//! `results.json` shape.
//!
//! Reference: lm-evaluation-harness 0.4.13 `api/task.py` `ConfigurableTask.process_results`
//! (multiple_choice: pred = argmax(lls), pred_norm = argmax(lls / len(choice)) with the length in
//! characters, first index on ties as `np.argmax`; generate_until with a list of golds: 1 if any alias
//! matches), `api/metrics.py` (`exact_match_hf_evaluate` with ignore_case then ignore_punctuation =
//! `string.punctuation`; `mean`; `mean_stderr` = sample stddev (n - 1) / sqrt(n); `pooled_sample_stderr`;
//! `aggregate_subtask_metrics` weighted by size), `evaluator_utils.py` (stderr "N/A" for one sample),
//! `api/group.py` `Group.aggregate` (a group's metric over its *leaf* tasks), `filters/extraction.py`
//! `WhitespaceFilter` (`strip()`), `tasks/triviaqa/default.yaml` (filter `remove_whitespace`).
//! The non-obvious decision: `acc_norm` divides by the choice's length in characters (Python `len(str)`),
//! as the harness's `acc_norm` does; the per-byte variant is its `acc_bytes`, which these tasks do not ask.
//! Not done here: bootstrap stderrs (none of these metrics uses one), other aggregations.
use crate::eval::tasks::score::ChoiceScore;
use crate::eval::tasks::{py_strip, Doc, Output, Target, TaskSpec, MMLU_GROUPS};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// Filter key of multiple-choice metrics.
pub const FILTER_NONE: &str = "none";
/// TriviaQA's filter name.
pub const FILTER_WS: &str = "remove_whitespace";

/// The model's answer to one document.
#[derive(Clone, Debug, PartialEq)]
pub enum Response {
    Choices(Vec<ChoiceScore>),
    Generation(String),
}

/// `np.argmax`: the first index of the maximum (NaN wins, as in numpy).
pub fn argmax(x: &[f64]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if x[best].is_nan() {
            break;
        }
        if v.is_nan() || v > x[best] {
            best = i;
        }
    }
    best
}

/// `exact_match_hf_evaluate(ignore_case=True, ignore_punctuation=True)` of a prediction against every
/// gold alias (the harness scores 1 when any matches), as numpy computes it: `np.char.lower` keeps each
/// array's fixed width in code points, so a lower-case form longer than its input ("İ" -> "i̇") is cut at
/// the width (the prediction's length; the longest alias for the aliases); then ASCII punctuation
/// (`string.punctuation`) is dropped and trailing NULs do not count.
pub fn exact_match_any(pred: &str, golds: &[String]) -> bool {
    let norm = |s: &str, width: usize| -> String {
        let t: String = s.to_lowercase().chars().take(width).filter(|c| !c.is_ascii_punctuation()).collect();
        t.trim_end_matches('\0').to_string()
    };
    let p = norm(pred, pred.chars().count());
    let width = golds.iter().map(|g| g.chars().count()).max().unwrap_or(0);
    golds.iter().any(|g| norm(g, width) == p)
}

/// `exact_match_any` against one gold.
pub fn exact_match(pred: &str, gold: &str) -> bool {
    exact_match_any(pred, &[gold.to_string()])
}

/// The per-sample metrics of one document: (metric name, value) in the YAML's `metric_list` order, and
/// the filtered response (TriviaQA).
pub fn sample_metrics(spec: &TaskSpec, doc: &Doc, resp: &Response) -> (Vec<(&'static str, f64)>, Option<String>) {
    match (spec.output, resp, &doc.target) {
        (Output::MultipleChoice { acc_norm }, Response::Choices(s), Target::Index(gold)) => {
            let lls: Vec<f64> = s.iter().map(|c| c.loglik).collect();
            let norm: Vec<f64> = lls.iter().zip(&doc.choices).map(|(ll, c)| ll / c.chars().count() as f64).collect();
            let hit = |p: usize| if p == *gold { 1.0 } else { 0.0 };
            let mut m = vec![("acc", hit(argmax(&lls)))];
            if acc_norm {
                m.push(("acc_norm", hit(argmax(&norm))));
            }
            (m, None)
        }
        (Output::Generate, Response::Generation(g), Target::Aliases(aliases)) => {
            let filtered = py_strip(g).to_string();
            let em = if exact_match_any(&filtered, aliases) { 1.0 } else { 0.0 };
            (vec![("exact_match", em)], Some(filtered))
        }
        _ => (vec![], None),
    }
}

/// The metric key with its filter, as in the harness's results (`acc,none`, `exact_match,remove_whitespace`).
pub fn metric_key(spec: &TaskSpec, metric: &str) -> String {
    let filter = if spec.output == Output::Generate { FILTER_WS } else { FILTER_NONE };
    format!("{metric},{filter}")
}

/// The stderr key of a metric key (`acc_stderr,none`).
pub fn stderr_key(key: &str) -> String {
    match key.split_once(',') {
        Some((m, f)) => format!("{m}_stderr,{f}"),
        None => format!("{key}_stderr"),
    }
}

/// `mean(arr)` = sum / n (summed left to right, as Python's `sum`).
pub fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len() as f64
}

/// `mean_stderr`: sample stddev (n - 1) / sqrt(n); None (the harness's "N/A") for fewer than 2 samples.
pub fn mean_stderr(x: &[f64]) -> Option<f64> {
    if x.len() < 2 {
        return None;
    }
    let mu = mean(x);
    let ss: f64 = x.iter().map(|v| (v - mu).powi(2)).sum();
    Some((ss / (x.len() - 1) as f64).sqrt() / (x.len() as f64).sqrt())
}

/// `pooled_sample_stderr(stderrs, sizes)`.
pub fn pooled_sample_stderr(stderrs: &[f64], sizes: &[usize]) -> f64 {
    let num: f64 = sizes.iter().zip(stderrs).map(|(&n, &s)| (n as f64 - 1.0) * s.powi(2) * n as f64).sum();
    let total: usize = sizes.iter().sum();
    (num / (total - sizes.len()) as f64 / total as f64).sqrt()
}

/// One task's evaluated samples.
#[derive(Clone, Debug)]
pub struct TaskOutcome {
    pub spec: TaskSpec,
    pub shots: usize,
    /// documents in the evaluated split
    pub original: usize,
    /// per metric name (in order), the per-sample values
    pub values: Vec<(&'static str, Vec<f64>)>,
}

impl TaskOutcome {
    /// Evaluated samples.
    pub fn len(&self) -> usize {
        self.values.first().map_or(0, |(_, v)| v.len())
    }

    /// Whether no sample was evaluated.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `{name, alias, sample_len, <metric>,<filter>: mean, <metric>_stderr,<filter>: stderr | "N/A"}`.
    pub fn entry(&self) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("name".into(), json!(self.spec.name));
        m.insert("alias".into(), json!(self.spec.alias));
        m.insert("sample_len".into(), json!(self.len()));
        for (metric, v) in &self.values {
            let key = metric_key(&self.spec, metric);
            m.insert(stderr_key(&key), mean_stderr(v).map_or(json!("N/A"), |s| json!(s)));
            m.insert(key, json!(mean(v)));
        }
        m
    }
}

/// A group over leaf tasks (MMLU and its categories): `Group.aggregate` with `weight_by_size: True`.
pub fn group_entry(name: &str, alias: &str, leaves: &[&TaskOutcome], metric: &str) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("name".into(), json!(name));
    m.insert("alias".into(), json!(alias));
    let sizes: Vec<usize> = leaves.iter().map(|t| t.len()).collect();
    let total: usize = sizes.iter().sum();
    m.insert("sample_len".into(), json!(total));
    let mut vals = vec![];
    let mut errs = vec![];
    for t in leaves {
        if let Some((_, v)) = t.values.iter().find(|(k, _)| *k == metric) {
            vals.push(mean(v));
            errs.push(mean_stderr(v));
        }
    }
    if vals.len() == leaves.len() && total > 0 {
        let key = format!("{metric},{FILTER_NONE}");
        let value = vals.iter().zip(&sizes).map(|(v, &n)| v * n as f64).sum::<f64>() / total as f64;
        let se = if errs.iter().all(Option::is_some) && total > sizes.len() {
            let e: Vec<f64> = errs.iter().flatten().copied().collect();
            json!(pooled_sample_stderr(&e, &sizes))
        } else {
            json!("N/A")
        };
        m.insert(stderr_key(&key), se);
        m.insert("sample_count".into(), json!({ key.clone(): total }));
        m.insert(key, json!(value));
    }
    m
}

/// MMLU's groups present among the outcomes: (group name, alias, leaf indices), categories first, then
/// `mmlu` over every subject.
pub fn mmlu_groups(outcomes: &[TaskOutcome]) -> Vec<(String, String, Vec<usize>)> {
    let mut out = vec![];
    let mut all = vec![];
    for (cat, alias) in MMLU_GROUPS {
        let leaves: Vec<usize> =
            outcomes.iter().enumerate().filter(|(_, t)| t.spec.mmlu_category() == Some(cat)).map(|(i, _)| i).collect();
        if !leaves.is_empty() {
            all.extend(leaves.iter().copied());
            out.push((format!("mmlu_{cat}"), alias.to_string(), leaves));
        }
    }
    if !all.is_empty() {
        all.sort();
        out.push(("mmlu".to_string(), "mmlu".to_string(), all));
    }
    out
}

/// The `results` / `groups` / `group_subtasks` / `versions` / `n-shot` / `higher_is_better` / `n-samples`
/// parts of the harness's results.json (`with_groups`: `--tasks mmlu` asked for the MMLU groups).
pub fn results_json(outcomes: &[TaskOutcome], with_groups: bool) -> Map<String, Value> {
    let mut results = Map::new();
    let mut groups = Map::new();
    let mut group_subtasks = Map::new();
    let mut versions = Map::new();
    let mut nshot = Map::new();
    let mut hib = Map::new();
    let mut nsamples = Map::new();
    let gs = if with_groups { mmlu_groups(outcomes) } else { vec![] };
    for (name, alias, leaves) in &gs {
        let ls: Vec<&TaskOutcome> = leaves.iter().map(|&i| &outcomes[i]).collect();
        let e = group_entry(name, alias, &ls, "acc");
        results.insert(name.clone(), Value::Object(e.clone()));
        groups.insert(name.clone(), Value::Object(e));
        let subs: Vec<String> = if name == "mmlu" {
            gs.iter().filter(|(n, _, _)| n != "mmlu").map(|(n, _, _)| n.clone()).collect()
        } else {
            ls.iter().map(|t| t.spec.name.clone()).collect()
        };
        group_subtasks.insert(name.clone(), json!(subs));
        versions.insert(name.clone(), json!(2.0));
        nshot.insert(name.clone(), json!(ls.first().map_or(0, |t| t.shots)));
        hib.insert(name.clone(), json!({"acc": true}));
    }
    for t in outcomes {
        let n = &t.spec.name;
        results.insert(n.clone(), Value::Object(t.entry()));
        if t.spec.mmlu_category().is_none() || !with_groups {
            group_subtasks.insert(n.clone(), json!([]));
        }
        versions.insert(n.clone(), json!(t.spec.version));
        nshot.insert(n.clone(), json!(t.shots));
        let h: BTreeMap<&str, bool> = t.values.iter().map(|(m, _)| (*m, true)).collect();
        hib.insert(n.clone(), json!(h));
        nsamples.insert(n.clone(), json!({"original": t.original, "effective": t.len()}));
    }
    let mut out = Map::new();
    out.insert("results".into(), Value::Object(results));
    out.insert("groups".into(), Value::Object(groups));
    out.insert("group_subtasks".into(), Value::Object(group_subtasks));
    out.insert("versions".into(), Value::Object(versions));
    out.insert("n-shot".into(), Value::Object(nshot));
    out.insert("higher_is_better".into(), Value::Object(hib));
    out.insert("n-samples".into(), Value::Object(nsamples));
    out
}

/// The console table (the harness's `make_table` columns): Tasks, Version, Filter, n-shot, Metric,
/// Value, Stderr; groups first, subjects indented under them.
pub fn table(res: &Map<String, Value>) -> String {
    let mut rows = vec![["Tasks", "Version", "Filter", "n-shot", "Metric", "Value", "Stderr"].map(String::from)];
    let empty = Map::new();
    let results = res.get("results").and_then(Value::as_object).unwrap_or(&empty);
    let versions = res.get("versions").and_then(Value::as_object).unwrap_or(&empty);
    let nshot = res.get("n-shot").and_then(Value::as_object).unwrap_or(&empty);
    let mut order: Vec<(String, usize)> = vec![];
    if let Some(g) = res.get("group_subtasks").and_then(Value::as_object) {
        if g.contains_key("mmlu") {
            order.push(("mmlu".into(), 0));
            for sub in g["mmlu"].as_array().into_iter().flatten().filter_map(Value::as_str) {
                order.push((sub.to_string(), 1));
                for leaf in g.get(sub).and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str) {
                    order.push((leaf.to_string(), 2));
                }
            }
        }
    }
    for k in results.keys() {
        if !order.iter().any(|(n, _)| n == k) {
            order.push((k.clone(), 0));
        }
    }
    for (name, depth) in order {
        let Some(r) = results.get(&name).and_then(Value::as_object) else { continue };
        let alias = r.get("alias").and_then(Value::as_str).unwrap_or(&name);
        let label = if depth == 0 { alias.to_string() } else { format!("{}- {alias}", "  ".repeat(depth - 1)) };
        let mut first = true;
        for (k, v) in r {
            let Some((metric, filter)) = k.split_once(',') else { continue };
            if metric.ends_with("_stderr") {
                continue;
            }
            let se = r.get(&stderr_key(k)).map(fmt_num).unwrap_or_default();
            rows.push([
                if first { label.clone() } else { String::new() },
                if first { versions.get(&name).map(|v| v.to_string()).unwrap_or_default() } else { String::new() },
                filter.to_string(),
                nshot.get(&name).map(fmt_num).unwrap_or_default(),
                metric.to_string(),
                fmt_num(v),
                format!("± {se}"),
            ]);
            first = false;
        }
    }
    let w: Vec<usize> = (0..7).map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0)).collect();
    let mut s = String::new();
    for (i, r) in rows.iter().enumerate() {
        let cells: Vec<String> = r.iter().zip(&w).map(|(c, &w)| format!("{c:<w$}")).collect();
        s.push_str(&format!("|{}|\n", cells.join("|")));
        if i == 0 {
            s.push_str(&format!("|{}|\n", w.iter().map(|&w| "-".repeat(w)).collect::<Vec<_>>().join("|")));
        }
    }
    s
}

fn fmt_num(v: &Value) -> String {
    match v {
        Value::Number(n) if n.is_f64() => format!("{:.4}", n.as_f64().unwrap_or(f64::NAN)),
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_and_pooling_follow_the_harness() {
        assert_eq!(mean_stderr(&[1.0]), None);
        // the golden MMLU-stem group: anatomy [1,0,0,0] and astronomy [0,0,0]
        let a = [1.0, 0.0, 0.0, 0.0];
        let p = pooled_sample_stderr(&[mean_stderr(&a).unwrap(), 0.0], &[4, 3]);
        assert!((p - 0.14638501094227999).abs() < 1e-15, "{p}");
        assert_eq!(argmax(&[-1.0, -0.5, -0.5]), 1);
        assert!(exact_match("PARIS!", "paris") && !exact_match("Paris.", "Pari"));
    }
}
