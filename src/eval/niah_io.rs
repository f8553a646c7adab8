//! RULER file interop: `validation.jsonl` data files (both layouts), `{task}.jsonl` predictions,
//! `summary.csv`, written byte-compatible with RULER's Python.
//!
//! Reference: `NVIDIA/RULER:scripts/data/prepare.py`, `NVIDIA/RULER:scripts/pred/call_api.py`,
//! `NVIDIA/RULER:scripts/eval/evaluate.py`.
//!
//! The non-obvious decisions: JSON lines are written by hand the way Python's `json.dumps` does
//! (`", "`/`": "` separators, `ensure_ascii=True`, so `jalapeño` becomes `jalape\u00f1o`), so files
//! diff cleanly against RULER's; samples are keyed by line number, never by `index`, because R-HEAD
//! NIAH files store a character offset there that can repeat; the prompt is `input + answer_prefix`.
//! Not here: generating samples (`niah.rs`), running the model (`niah_run.rs`).

use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Python `json.dumps(s)` for a string (ensure_ascii, lowercase hex escapes, surrogate pairs).
pub fn py_json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Python `json.dumps` of a list of strings.
pub fn py_json_str_list(items: &[String]) -> String {
    format!("[{}]", items.iter().map(|s| py_json_str(s)).collect::<Vec<_>>().join(", "))
}

/// Python `repr(float)` for the finite values written here (`100.0`, `33.33`).
pub fn py_float(x: f64) -> String {
    let s = format!("{x}");
    if s.contains(['.', 'e', 'E']) || !x.is_finite() {
        s
    } else {
        format!("{s}.0")
    }
}

/// One sample of a data file.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// 0-based line number in the file: the key harpe uses.
    pub line: usize,
    /// The `index` field as given (R-HEAD NIAH files put a character offset here).
    pub index: i64,
    /// The `input` field.
    pub input: String,
    /// R-HEAD's separate `answer_prefix`, if present.
    pub answer_prefix: Option<String>,
    /// Gold answers.
    pub outputs: Vec<String>,
    /// `length` (prompt tokens + generation budget), if present.
    pub length: Option<usize>,
    /// Needle depth in percent (harpe's passkey and grid files; RULER files have none).
    pub depth: Option<f64>,
}

impl Record {
    /// The text the model continues: `input + answer_prefix`.
    pub fn prompt(&self) -> String {
        match &self.answer_prefix {
            Some(p) => format!("{}{p}", self.input),
            None => self.input.clone(),
        }
    }

    /// The data line in RULER R-Dec24's layout (plus `depth` when set).
    pub fn to_data_line(&self) -> String {
        let mut s = format!(
            "{{\"index\": {}, \"input\": {}, \"outputs\": {}, \"length\": {}",
            self.index,
            py_json_str(&self.input),
            py_json_str_list(&self.outputs),
            self.length.unwrap_or(0)
        );
        if let Some(p) = &self.answer_prefix {
            let _ = write!(s, ", \"answer_prefix\": {}", py_json_str(p));
        }
        if let Some(d) = self.depth {
            let _ = write!(s, ", \"depth\": {}", py_float(d));
        }
        s.push('}');
        s
    }
}

fn field_err(path: &Path, line: usize, msg: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "{}:{}: {msg}\nhint: RULER data lines are JSON objects with \"input\" (string), \"outputs\" (list of strings) \
         and optionally \"index\", \"length\", \"answer_prefix\"; regenerate the file with RULER's prepare.py or \
         `harpe eval-niah --prepare-only`",
        path.display(),
        line + 1
    )
}

/// Parse one data line (either RULER layout, or harpe's).
pub fn parse_data_line(text: &str, line: usize, path: &Path) -> Result<Record> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| field_err(path, line, &format!("not valid JSON ({e})")))?;
    let obj = v.as_object().ok_or_else(|| field_err(path, line, "not a JSON object"))?;
    let input = match obj.get("input") {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(_) => return Err(field_err(path, line, "field \"input\" is not a string")),
        None => return Err(field_err(path, line, "missing field \"input\"")),
    };
    let outputs = match (obj.get("outputs"), obj.get("output")) {
        (Some(serde_json::Value::Array(a)), _) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| field_err(path, line, "field \"outputs\" holds a non-string"))?,
        (Some(_), _) => return Err(field_err(path, line, "field \"outputs\" is not a list")),
        (None, Some(serde_json::Value::String(s))) => vec![s.clone()],
        _ => return Err(field_err(path, line, "missing field \"outputs\"")),
    };
    let index = match obj.get("index") {
        None => line as i64,
        Some(x) => x.as_i64().ok_or_else(|| field_err(path, line, "field \"index\" is not an integer"))?,
    };
    let length = match obj.get("length") {
        None => None,
        Some(x) => {
            Some(x.as_u64().ok_or_else(|| field_err(path, line, "field \"length\" is not an integer"))? as usize)
        }
    };
    let answer_prefix = match obj.get("answer_prefix") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(field_err(path, line, "field \"answer_prefix\" is not a string")),
    };
    let depth = obj.get("depth").and_then(|d| d.as_f64());
    Ok(Record { line, index, input, answer_prefix, outputs, length, depth })
}

/// Read a `validation.jsonl` file; blank lines are skipped, any other bad line is an error.
pub fn read_data_file(path: &Path) -> Result<Vec<Record>> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!("cannot read RULER data file {}\nhint: check the path and that the file is UTF-8", path.display())
    })?;
    let mut out = Vec::new();
    for (i, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        let mut r = parse_data_line(l, i, path)?;
        r.line = out.len();
        out.push(r);
    }
    if out.is_empty() {
        bail!("{} holds no samples\nhint: regenerate it (RULER prepare.py or harpe --prepare-only)", path.display());
    }
    Ok(out)
}

/// Write a data file (atomically).
pub fn write_data_file(path: &Path, records: &[Record]) -> Result<()> {
    let mut s = String::new();
    for r in records {
        s.push_str(&r.to_data_line());
        s.push('\n');
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    crate::util::write_atomic(path, s.as_bytes())
}

/// One finished prediction, as found in a prediction file.
#[derive(Clone, Debug)]
pub struct Prediction {
    /// Raw generated text.
    pub pred: String,
    /// sha256 of the prompt it answered (harpe's own files), to detect changed data.
    pub prompt_sha256: Option<String>,
}

/// A prediction line in RULER's key order; `others` carries harpe's line key and prompt hash.
pub fn pred_line(r: &Record, pred: &str, prompt_sha256: &str) -> String {
    format!(
        "{{\"index\": {}, \"pred\": {}, \"input\": {}, \"outputs\": {}, \"others\": {{\"line\": {}, \"prompt_sha256\": \
         {}}}, \"truncation\": -1, \"length\": {}}}",
        r.index,
        py_json_str(pred),
        py_json_str(&r.input),
        py_json_str_list(&r.outputs),
        r.line,
        py_json_str(prompt_sha256),
        r.length.unwrap_or(0)
    )
}

/// Read a prediction file into line -> prediction. A truncated last line (a killed run) is ignored;
/// lines without harpe's `others.line` are keyed by their position.
pub fn read_pred_file(path: &Path) -> Result<HashMap<usize, Prediction>> {
    let mut out = HashMap::new();
    if !path.exists() {
        return Ok(out);
    }
    let text = std::fs::read_to_string(path).with_context(|| {
        format!("cannot read predictions {}\nhint: delete it to start this cell over", path.display())
    })?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    for (i, l) in lines.iter().enumerate() {
        let v: serde_json::Value = match serde_json::from_str(l) {
            Ok(v) => v,
            Err(_) if i + 1 == lines.len() => break,
            Err(e) => bail!(
                "{}:{}: not valid JSON ({e})\nhint: delete the file to recompute this cell",
                path.display(),
                i + 1
            ),
        };
        let Some(pred) = v.get("pred").and_then(|p| p.as_str()) else {
            bail!(
                "{}:{}: missing string field \"pred\"\nhint: delete the file to recompute this cell",
                path.display(),
                i + 1
            );
        };
        let others = v.get("others");
        let line = others.and_then(|o| o.get("line")).and_then(|x| x.as_u64()).map_or(i, |x| x as usize);
        let prompt_sha256 = others.and_then(|o| o.get("prompt_sha256")).and_then(|x| x.as_str()).map(str::to_string);
        out.insert(line, Prediction { pred: pred.to_string(), prompt_sha256 });
    }
    Ok(out)
}

/// RULER's `summary.csv`: `pandas.DataFrame([Tasks.., Score.., Nulls..]).to_csv(index=False)`.
pub fn ruler_summary_csv(rows: &[(String, f64, usize, usize)]) -> String {
    let n = rows.len();
    let header: Vec<String> = (0..=n).map(|i| i.to_string()).collect();
    let mut s = header.join(",") + "\n";
    s.push_str(
        &std::iter::once("Tasks".to_string()).chain(rows.iter().map(|r| r.0.clone())).collect::<Vec<_>>().join(","),
    );
    s.push('\n');
    s.push_str(
        &std::iter::once("Score".to_string()).chain(rows.iter().map(|r| py_float(r.1))).collect::<Vec<_>>().join(","),
    );
    s.push('\n');
    s.push_str(
        &std::iter::once("Nulls".to_string())
            .chain(rows.iter().map(|r| format!("{}/{}", r.2, r.3)))
            .collect::<Vec<_>>()
            .join(","),
    );
    s.push('\n');
    s
}

/// Find RULER data files under `root`: `root/<length>/data/<task>/validation.jsonl`.
pub fn discover_ruler_data(root: &Path) -> Result<Vec<(usize, String, PathBuf)>> {
    let hint = "hint: --ruler-data takes the directory that holds <length>/data/<task>/validation.jsonl \
                (RULER's ROOT/<model>/synthetic)";
    let entries = std::fs::read_dir(root).with_context(|| format!("cannot list {}\n{hint}", root.display()))?;
    let mut out = Vec::new();
    for e in entries.flatten() {
        let Some(len) = e.file_name().to_str().and_then(|s| s.parse::<usize>().ok()) else { continue };
        let data = e.path().join("data");
        let Ok(tasks) = std::fs::read_dir(&data) else { continue };
        for t in tasks.flatten() {
            let f = t.path().join("validation.jsonl");
            if f.is_file() {
                out.push((len, t.file_name().to_string_lossy().to_string(), f));
            }
        }
    }
    out.sort();
    if out.is_empty() {
        bail!("no <length>/data/<task>/validation.jsonl files under {}\n{hint}", root.display());
    }
    Ok(out)
}
