//! Local task files: `DIR/<task>/<split>.jsonl` (MMLU `DIR/mmlu/<subject>/<split>.jsonl`), one record of
//! the HF dataset per line, with the split names and fields of the datasets the harness loads.
//!
//! Reference: the harness reads these through `datasets.load_dataset(dataset_path, dataset_name)`; a
//! `json` dataset over the same files (`dataset_kwargs.data_files`) gives it the same rows, which is how
//! `scripts/make_tasks_golden.py` runs it. The non-obvious decision: a record keeps its whole JSON value,
//! because the harness compares documents as whole rows when it drops the evaluated document from its
//! few-shot draw. Errors name the file, the 1-based line and the field. Not done here: `.parquet`
//! (refused with a conversion hint), the HF cache layout.
use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// One line of a split file.
#[derive(Clone, Debug)]
pub struct Record {
    pub value: Value,
    pub file: PathBuf,
    /// 1-based line number
    pub line: usize,
    /// field path of `value` inside the line's record ("" at top level, "choices." for a nested object)
    pub prefix: String,
}

impl Record {
    /// "file:line" for messages.
    pub fn at(&self) -> String {
        format!("{}:{}", self.file.display(), self.line)
    }

    /// A field, or an error naming it.
    pub fn get(&self, field: &str) -> Result<&Value> {
        self.value.get(field).ok_or_else(|| {
            anyhow!(
                "{}: no field `{}{field}`\nhint: the record must have the fields of the HF dataset the harness reads",
                self.at(),
                self.prefix
            )
        })
    }

    /// A nested object field as a record of its own (messages name `field.<inner>`).
    pub fn child(&self, field: &str) -> Result<Record> {
        let value = self.get(field)?.clone();
        Ok(Record { value, file: self.file.clone(), line: self.line, prefix: format!("{}{field}.", self.prefix) })
    }

    /// A string field.
    pub fn str(&self, field: &str) -> Result<String> {
        match self.get(field)? {
            Value::String(s) => Ok(s.clone()),
            other => bail!(
                "{}: `{}{field}` is {other}, not a string\nhint: check the record's format",
                self.at(),
                self.prefix
            ),
        }
    }

    /// An integer field.
    pub fn int(&self, field: &str) -> Result<i64> {
        match self.get(field)? {
            Value::Number(n) if n.is_i64() => Ok(n.as_i64().unwrap_or_default()),
            other => bail!(
                "{}: `{}{field}` is {other}, not an integer\nhint: check the record's format",
                self.at(),
                self.prefix
            ),
        }
    }

    /// A list-of-strings field.
    pub fn str_list(&self, field: &str) -> Result<Vec<String>> {
        let bad = |v: &Value| {
            anyhow!(
                "{}: `{}{field}` is {v}, not a list of strings\nhint: check the record's format",
                self.at(),
                self.prefix
            )
        };
        match self.get(field)? {
            Value::Array(a) => a.iter().map(|x| x.as_str().map(str::to_string).ok_or_else(|| bad(x))).collect(),
            other => Err(bad(other)),
        }
    }
}

/// Every record of one split file, or an error naming a missing split or a malformed line.
pub fn read_split(task: &str, dir: &Path, split: &str, dataset: &str) -> Result<Vec<Record>> {
    let path = dir.join(format!("{split}.jsonl"));
    if !path.is_file() {
        if dir.join(format!("{split}.parquet")).is_file() {
            bail!(
                "{task}: {} exists but harpe reads JSONL\nhint: convert it once, e.g. python -c \"import pandas as p; \
                 p.read_parquet('{split}.parquet').to_json('{split}.jsonl', orient='records', lines=True, force_ascii=False)\"",
                dir.join(format!("{split}.parquet")).display()
            );
        }
        bail!(
            "{task}: split `{split}` is missing: no {}\nhint: the harness evaluates and samples few-shot examples from \
             fixed splits; write {dataset}'s `{split}` split there, one JSON record per line",
            path.display()
        );
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("{task}: cannot read {} as UTF-8\nhint: one JSON record per line", path.display()))?;
    let mut out = vec![];
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(line).map_err(|e| {
            anyhow!(
                "{}:{}: malformed JSON: {e}\nhint: one JSON object per line ({dataset} records)",
                path.display(),
                i + 1
            )
        })?;
        if !value.is_object() {
            bail!(
                "{}:{}: not a JSON object\nhint: one JSON object per line ({dataset} records)",
                path.display(),
                i + 1
            );
        }
        out.push(Record { value, file: path.clone(), line: i + 1, prefix: String::new() });
    }
    if out.is_empty() {
        bail!("{task}: {} has no records\nhint: write the `{split}` split's records there", path.display());
    }
    Ok(out)
}
