//! Scorers on crafted predictions, and RULER file interop (both data layouts, predictions, summary).
use harpe::eval::needle_grid::{exact_phrase, fu_recall};
use harpe::eval::niah::{length_averages, postprocess, score_sample, task_score, Metric};
use harpe::eval::niah_io::{self, py_json_str, read_data_file, read_pred_file, Record};
use harpe::eval::niah_report::summary_csv;
use harpe::eval::niah_run::CellResult;
use harpe::eval::passkey::passkey_score;
use std::path::Path;

fn refs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn ruler_string_match() {
    let r = refs(&["2867825", "Tenuous-Hospice"]);
    assert_eq!(score_sample(Metric::StringMatchAll, " 2867825 and tenuous-hospice.", &r), 1.0);
    assert_eq!(score_sample(Metric::StringMatchAll, "2867825", &r), 0.5);
    assert_eq!(score_sample(Metric::StringMatchAll, "nothing", &r), 0.0);
    assert_eq!(score_sample(Metric::StringMatchPart, "only 2867825", &r), 1.0);
    assert_eq!(score_sample(Metric::StringMatchPart, "none", &r), 0.0);
    // Substring semantics are kept: 12867825 contains 2867825.
    assert_eq!(score_sample(Metric::StringMatchAll, "12867825", &refs(&["2867825"])), 1.0);
    // Control characters become newlines; a prediction of whitespace is a null.
    assert_eq!(postprocess("  a\tb\u{1}c \n"), "a\nb\nc");
    assert_eq!(postprocess(" \n\t "), "");
    // round(100 * mean, 2)
    assert_eq!(task_score(&[1.0, 0.0, 0.0]), 33.33);
    assert_eq!(task_score(&[1.0, 1.0]), 100.0);
    // RULER README row for Jamba-1.5-large: Avg 96.0, wAvg inc 95.7, wAvg dec 96.3 (4K..128K).
    let (a, inc, dec) = length_averages(&[96.7, 96.6, 96.4, 96.0, 95.4, 95.1]);
    assert_eq!(((a * 10.0).round(), (inc * 10.0).round(), (dec * 10.0).round()), (960.0, 957.0, 963.0));
}

#[test]
fn passkey_and_fu_scores() {
    assert_eq!(passkey_score(" 12345. Remember it.", "12345"), 1.0);
    assert_eq!(passkey_score("The key is 123 and 12345", "12345"), 0.0); // first integer only
    assert_eq!(passkey_score("012345", "12345"), 1.0); // int() drops leading zeros
    assert_eq!(passkey_score("no digits", "12345"), 0.0);
    // F's recall: 11 distinct expected words over 12, so a perfect answer scores 11/12.
    let perfect = "Eat a sandwich and sit in Dolores Park on a sunny day.";
    assert!((fu_recall(perfect) - 11.0 / 12.0).abs() < 1e-12);
    assert!((fu_recall("eat a sandwich") - 3.0 / 12.0).abs() < 1e-12);
    assert!((fu_recall("sunny day") - 1.0 / 12.0).abs() < 1e-12); // "day." keeps its period
    assert_eq!(exact_phrase(perfect), 1.0);
    assert_eq!(exact_phrase("The answer: eat a sandwich and sit in\nDolores park on a sunny day"), 1.0);
    assert_eq!(exact_phrase("eat a sandwich in Dolores Park"), 0.0);
}

#[test]
fn python_json_escaping() {
    assert_eq!(py_json_str("jalapeño \"x\"\n\\"), r#""jalape\u00f1o \"x\"\n\\""#);
    assert_eq!(py_json_str("😀"), r#""\ud83d\ude00""#);
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn reads_both_ruler_layouts() {
    let dir = tempfile::tempdir().unwrap();
    // R-Dec24: the answer prefix is inside input.
    let dec = write(
        dir.path(),
        "dec.jsonl",
        "{\"index\": 0, \"input\": \"Q? The answer is\", \"outputs\": [\"7\"], \"length\": 140}\n\n{\"index\": 1, \"input\": \"jalape\\u00f1o\", \"outputs\": [\"1\", \"2\"], \"length\": 130}\n",
    );
    let r = read_data_file(&dec).unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].prompt(), "Q? The answer is");
    assert_eq!(r[1].input, "jalapeño");
    assert_eq!(r[1].line, 1);
    // Writing gives RULER's bytes back.
    assert_eq!(
        r[1].to_data_line(),
        "{\"index\": 1, \"input\": \"jalape\\u00f1o\", \"outputs\": [\"1\", \"2\"], \"length\": 130}"
    );
    // R-HEAD: answer_prefix apart, and index is a character offset that can repeat.
    let head = write(
        dir.path(),
        "head.jsonl",
        "{\"index\": 57, \"input\": \"ctx\", \"outputs\": [\"7\"], \"length\": 140, \"length_w_model_temp\": 140, \"answer_prefix\": \" The answer is\", \"token_position_answer\": 12}\n{\"index\": 57, \"input\": \"ctx2\", \"outputs\": [\"8\"], \"length\": 141, \"answer_prefix\": \" The answer is\"}\n",
    );
    let r = read_data_file(&head).unwrap();
    assert_eq!(r[0].prompt(), "ctx The answer is");
    assert_eq!((r[0].index, r[1].index, r[0].line, r[1].line), (57, 57, 0, 1));
}

#[test]
fn malformed_ruler_files_name_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    for (body, want) in [
        (
            "{\"index\": 0, \"input\": \"a\", \"outputs\": [\"1\"]}\n{\"index\": 1, \"outputs\": [\"1\"]}\n",
            ":2: missing field \"input\"",
        ),
        ("{\"input\": \"a\", \"outputs\": \"1\"}\n", ":1: field \"outputs\" is not a list"),
        ("{\"input\": \"a\", \"outputs\": [1]}\n", ":1: field \"outputs\" holds a non-string"),
        ("not json\n", ":1: not valid JSON"),
        ("", "holds no samples"),
    ] {
        let p = write(dir.path(), "bad.jsonl", body);
        let e = format!("{:#}", read_data_file(&p).unwrap_err());
        assert!(e.contains(want) && e.contains("hint:") && e.contains("bad.jsonl"), "{e}");
    }
}

#[test]
fn prediction_lines_round_trip_and_tolerate_a_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Record {
        line: 3,
        index: 99,
        input: "in".into(),
        answer_prefix: None,
        outputs: vec!["7".into()],
        length: Some(10),
        depth: None,
    };
    let line = niah_io::pred_line(&rec, "pred ñ", "abc");
    assert_eq!(
        line,
        "{\"index\": 99, \"pred\": \"pred \\u00f1\", \"input\": \"in\", \"outputs\": [\"7\"], \"others\": {\"line\": 3, \"prompt_sha256\": \"abc\"}, \"truncation\": -1, \"length\": 10}"
    );
    let p = write(dir.path(), "p.jsonl", &format!("{line}\n{{\"index\": 1, \"pr"));
    let got = read_pred_file(&p).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[&3].pred, "pred ñ");
    assert_eq!(got[&3].prompt_sha256.as_deref(), Some("abc"));
}

#[test]
fn summaries_have_rulers_shape() {
    let csv =
        niah_io::ruler_summary_csv(&[("niah_single_1".into(), 100.0, 0, 500), ("niah_single_2".into(), 99.8, 1, 500)]);
    assert_eq!(csv, "0,1,2\nTasks,niah_single_1,niah_single_2\nScore,100.0,99.8\nNulls,0/500,1/500\n");
    let cell = |task: &str, length, score| CellResult { task: task.into(), length, score, nulls: 0, samples: vec![] };
    let s = summary_csv(&[
        cell("niah_single_1", 4096, 100.0),
        cell("niah_single_1", 8192, 50.0),
        cell("niah_multikey_2", 4096, 80.0),
        cell("passkey", 4096, 90.0),
    ]);
    assert_eq!(
        s,
        "task,4096,8192,mean\nniah_single_1,100.00,50.00,75.00\nniah_multikey_2,80.00,,80.00\npasskey,90.00,,90.00\nniah_average,90.00,50.00,70.00\n"
    );
}
