//! End to end on a tiny random model: `harpe eval-niah` writes every output, a re-run skips the
//! finished cells, --prepare-only needs only a tokenizer, RULER data round-trips, and bad input
//! (no tokenizer, a length beyond the model's context) fails with a hint.
use crate::common::harpe;
use harpe::model::rope::RopeScheme;
use std::path::Path;

fn essays(dir: &Path) -> String {
    let p = dir.join("essays");
    std::fs::create_dir_all(&p).unwrap();
    for f in 0..2 {
        let text: String = (0..60)
            .map(|i| format!("Essay {f} sentence {i} explains why a startup should do things that don't scale. "))
            .collect();
        std::fs::write(p.join(format!("{f}.txt")), text).unwrap();
    }
    p.display().to_string()
}

#[test]
fn tiny_model_run_writes_all_outputs_and_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    harpe::model::testing::tiny_model_dir(&model, RopeScheme::Default { theta: 1e4 }, 7).unwrap();
    let out = tmp.path().join("out");
    let es = essays(tmp.path());
    let (m, o) = (model.display().to_string(), out.display().to_string());
    let args = [
        "eval-niah",
        "--model",
        &m,
        "--out",
        &o,
        "--tasks",
        "niah_single_1,niah_multikey_3,passkey,needle_grid",
        "--lengths",
        "1536",
        "--samples",
        "2",
        "--grid-depths",
        "2",
        "--passkey-depths",
        "2",
        "--essays",
        &es,
    ];
    let (ok, stdout, stderr) = harpe(&args);
    assert!(ok, "{stderr}");
    for f in [
        "results.json",
        "summary.csv",
        "ruler_heatmap.png",
        "needle_grid.png",
        "passkey.png",
        "1536/data/niah_single_1/validation.jsonl",
        "1536/pred/niah_single_1.jsonl",
        "1536/pred/niah_multikey_3.jsonl",
        "1536/pred/passkey.jsonl",
        "1536/pred/needle_grid.jsonl",
        "1536/pred/summary.csv",
    ] {
        assert!(out.join(f).is_file(), "missing {f}");
    }
    assert_eq!(&std::fs::read(out.join("ruler_heatmap.png")).unwrap()[1..4], b"PNG");
    let results: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    let cells = results["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 4);
    for c in cells {
        let task = c["task"].as_str().unwrap();
        let mut sum = 0.0;
        for s in c["samples"].as_array().unwrap() {
            assert_eq!(s["prompt_sha256"].as_str().unwrap().len(), 64);
            let score = s["score"].as_f64().unwrap();
            let pred = s["pred"].as_str().unwrap().to_lowercase();
            let outs: Vec<String> =
                s["outputs"].as_array().unwrap().iter().map(|o| o.as_str().unwrap().to_lowercase()).collect();
            // Recomputed here: RULER's string_match_all; passkey: the first integer in the continuation.
            let want = match task {
                "passkey" => {
                    let digits: String =
                        pred.chars().skip_while(|c| !c.is_ascii_digit()).take_while(|c| c.is_ascii_digit()).collect();
                    f64::from(u8::from(!digits.is_empty() && digits.parse::<u64>().ok() == outs[0].parse::<u64>().ok()))
                }
                "needle_grid" => score, // F's recall is checked against its formula in niah_scoring.rs
                _ => outs.iter().filter(|o| pred.contains(o.as_str())).count() as f64 / outs.len() as f64,
            };
            assert_eq!(score, want, "{task}: pred {pred:?} outputs {outs:?}");
            sum += score;
        }
        // The cell score is RULER's round(100 * mean, 2).
        let n = c["samples"].as_array().unwrap().len() as f64;
        assert_eq!(c["score"].as_f64().unwrap(), (10000.0 * sum / n).round() / 100.0, "{task}");
    }
    assert!(stdout.contains("niah_single_1") && stdout.contains("passkey"), "{stdout}");
    let preds_before = std::fs::read_to_string(out.join("1536/pred/passkey.jsonl")).unwrap();
    assert_eq!(preds_before.lines().count(), 2);

    // A re-run finds every cell done and generates nothing.
    let (ok, _, stderr) = harpe(&args);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("8 predictions already done, 0 to run"), "{stderr}");
    assert_eq!(std::fs::read_to_string(out.join("1536/pred/passkey.jsonl")).unwrap(), preds_before);

    // Lengths beyond max_position_embeddings (4096) need --force.
    let (ok, _, stderr) = harpe(&["eval-niah", "--model", &m, "--out", &o, "--tasks", "passkey", "--lengths", "8192"]);
    assert!(!ok && stderr.contains("--force") && stderr.contains("hint:"), "{stderr}");

    // RULER interop: predictions for the prepared data, written beside it.
    let ruler = tmp.path().join("ruler");
    std::fs::create_dir_all(ruler.join("1536/data/niah_single_1")).unwrap();
    std::fs::copy(
        out.join("1536/data/niah_single_1/validation.jsonl"),
        ruler.join("1536/data/niah_single_1/validation.jsonl"),
    )
    .unwrap();
    let r = ruler.display().to_string();
    let (ok, _, stderr) = harpe(&["eval-niah", "--model", &m, "--ruler-data", &r]);
    assert!(ok, "{stderr}");
    let pred = std::fs::read_to_string(ruler.join("1536/pred/niah_single_1.jsonl")).unwrap();
    assert_eq!(pred.lines().count(), 2);
    assert!(pred.starts_with("{\"index\": 0, \"pred\": "));
    assert!(ruler.join("1536/pred/summary-niah_single_1.csv").is_file());
}

#[test]
fn prepare_only_needs_just_a_tokenizer_and_bad_input_has_hints() {
    let tmp = tempfile::tempdir().unwrap();
    let tokdir = tmp.path().join("tok");
    std::fs::create_dir_all(&tokdir).unwrap();
    std::fs::write(tokdir.join("tokenizer.json"), harpe::model::testing::byte_tokenizer_json()).unwrap();
    let out = tmp.path().join("prep");
    let (t, o) = (tokdir.display().to_string(), out.display().to_string());
    let (ok, stdout, stderr) = harpe(&[
        "eval-niah",
        "--model",
        &t,
        "--prepare-only",
        "--out",
        &o,
        "--tasks",
        "noise",
        "--lengths",
        "1536,2048",
        "--samples",
        "3",
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("wrote 18 prompts in 6 cells"), "{stdout}");
    let data = std::fs::read_to_string(out.join("2048/data/niah_multikey_2/validation.jsonl")).unwrap();
    assert_eq!(data.lines().count(), 3);
    assert!(data.starts_with("{\"index\": 0, \"input\": \"A special magic number is hidden"));

    // No tokenizer in the model directory.
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let (ok, _, stderr) = harpe(&["eval-niah", "--model", &empty.display().to_string(), "--prepare-only", "--out", &o]);
    assert!(!ok && stderr.contains("tokenizer.json") && stderr.contains("hint:"), "{stderr}");
    // Unknown task, and an essay task without essays.
    let (ok, _, stderr) = harpe(&["eval-niah", "--tokenizer", &t, "--prepare-only", "--out", &o, "--tasks", "niah_x"]);
    assert!(!ok && stderr.contains("unknown task") && stderr.contains("hint:"), "{stderr}");
    let (ok, _, stderr) = harpe(&[
        "eval-niah",
        "--tokenizer",
        &t,
        "--prepare-only",
        "--out",
        &o,
        "--tasks",
        "niah_single_2",
        "--lengths",
        "4096",
    ]);
    assert!(!ok && stderr.contains("--essays"), "{stderr}");
}
