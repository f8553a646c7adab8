//! `harpe eval-tasks` against lm-evaluation-harness 0.4.13 itself: every prompt string, per-choice
//! log-likelihood (within 1e-4), greedy flag, generation, per-sample metric and aggregated result
//! (accuracies exactly, stderrs to 1e-12) of MMLU (with its groups), HellaSwag, ARC-Challenge, PIQA and
//! TriviaQA, zero-shot, 3-shot and HARPE Table 3's shots, on the fixtures of `scripts/make_tasks_golden.py`
//! (a tiny random transformers Llama with a Llama-layout tokenizer). Then resume, outputs and bad input.
use crate::common::harpe_cmd;
use harpe::eval::ppl::ScoringModel;
use harpe::eval::tasks::results::Response;
use harpe::eval::tasks::run::{evaluate, EvalTasksArgs};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/eval_tasks")
}

fn args(tasks: &str, shots: usize, data: &Path) -> EvalTasksArgs {
    // transformers' float32 RoPE arithmetic, as the harness ran the fixture model
    let mut scoring = ScoringModel::new(&fixtures().join("model"));
    scoring.rope_parity = harpe::model::rope::RopeParity::Hf;
    EvalTasksArgs {
        scoring,
        tasks: tasks.to_string(),
        data: data.to_path_buf(),
        shots: shots.to_string(),
        limit: None,
        seed: 1234,
        batch: 3,
        max_length: None,
        json: false,
        out: None,
        log_samples: false,
        tokenizer: None,
    }
}

/// Compare one golden file (task at k shots) with harpe's evaluation; returns the smallest gap between the
/// best and second-best choice score seen (how far the accuracies are from a tie).
fn check(task: &str, shots: usize) -> f64 {
    check_case(task, shots, None)
}

/// `check` of a golden made with the harness's `max_length` (inputs left-truncated).
fn check_case(task: &str, shots: usize, max_length: Option<usize>) -> f64 {
    let suffix = max_length.map(|n| format!("_len{n}")).unwrap_or_default();
    let path = fixtures().join(format!("golden/{task}_{shots}shot{suffix}.json"));
    let g: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut a = args(task, shots, &fixtures().join("data"));
    a.max_length = max_length;
    let (prepared, resp, res) = evaluate(&a).unwrap();
    let mut min_gap = f64::INFINITY;
    let mut max_diff = 0.0f64;
    let samples = g["samples"].as_object().unwrap();
    assert_eq!(samples.len(), prepared.len(), "{task}: tasks");
    for (p, r) in prepared.iter().zip(&resp) {
        let gs = samples[&p.spec.name].as_array().unwrap_or_else(|| panic!("{task}: no golden {}", p.spec.name));
        assert_eq!(gs.len(), p.requests.len(), "{}: documents", p.spec.name);
        for s in gs {
            let id = s["doc_id"].as_u64().unwrap() as usize;
            let (req, out) = (&p.requests[id], &r[id]);
            let at = format!("{} {shots}-shot doc {id}", p.spec.name);
            let gargs = s["arguments"].as_array().unwrap();
            assert_eq!(gargs[0][0].as_str().unwrap(), req.context, "{at}: context");
            match out {
                Response::Choices(c) => {
                    assert_eq!(gargs.len(), c.len(), "{at}: choices");
                    let mut lls = vec![];
                    for (j, (ga, gr)) in gargs.iter().zip(s["resps"].as_array().unwrap()).enumerate() {
                        assert_eq!(ga[1].as_str().unwrap(), req.continuations[j], "{at}: continuation {j}");
                        let (gll, gg) = (gr[0][0].as_f64().unwrap(), gr[0][1].as_bool().unwrap());
                        let d = (gll - c[j].loglik).abs();
                        max_diff = max_diff.max(d);
                        assert!(d < 1e-4, "{at} choice {j}: loglik {} vs harness {gll}", c[j].loglik);
                        assert_eq!(c[j].is_greedy, gg, "{at} choice {j}: is_greedy");
                        lls.push(c[j].loglik);
                    }
                    lls.sort_by(|a, b| b.total_cmp(a));
                    if lls.len() > 1 {
                        min_gap = min_gap.min(lls[0] - lls[1]);
                    }
                }
                Response::Generation(text) => {
                    assert_eq!(s["resps"][0][0].as_str().unwrap(), text, "{at}: generation");
                }
            }
            let (m, _) = harpe::eval::tasks::results::sample_metrics(&p.spec, &p.docs[id], out);
            for (k, v) in m {
                assert_eq!(s[k].as_f64(), Some(v), "{at}: {k}");
            }
        }
    }
    // aggregated results: every metric / stderr key and the sample counts
    let ours = res["results"].as_object().unwrap();
    for (name, gr) in g["results"].as_object().unwrap() {
        let o = ours.get(name).unwrap_or_else(|| panic!("{task}: no result for {name}"));
        for (k, gv) in gr.as_object().unwrap() {
            if !k.contains(',') && k != "sample_len" {
                continue;
            }
            let ov = &o[k];
            match (gv.as_f64(), ov.as_f64()) {
                (Some(a), Some(b)) if k.contains("_stderr") => assert!((a - b).abs() < 1e-12, "{name} {k}: {b} vs {a}"),
                _ => assert_eq!(ov, gv, "{name} {k}"),
            }
        }
    }
    eprintln!("{task} {shots}-shot: max |loglik - harness| = {max_diff:.2e}, smallest top-2 gap {min_gap:.3e}");
    min_gap
}

#[test]
fn mmlu_matches_the_harness() {
    for k in [0, 3, 5] {
        check("mmlu", k);
    }
}

#[test]
fn hellaswag_matches_the_harness() {
    for k in [0, 3, 10] {
        check("hellaswag", k);
    }
}

#[test]
fn arc_challenge_matches_the_harness() {
    for k in [0, 3, 25] {
        check("arc_challenge", k);
    }
}

#[test]
fn shots_per_task_give_each_task_its_own_count() {
    // HARPE Table 3's shots in one run: each task's prompts are those of its own k-shot golden
    let mut a = args("mmlu,piqa,arc_challenge", 0, &fixtures().join("data"));
    a.shots = "mmlu=5,arc_challenge=3".into();
    let (prepared, _, res) = evaluate(&a).unwrap();
    for p in &prepared {
        let (file, k) = match p.spec.name.as_str() {
            "piqa" => ("piqa", 0),
            "arc_challenge" => ("arc_challenge", 3),
            _ => ("mmlu", 5),
        };
        assert_eq!(p.shots, k, "{}", p.spec.name);
        let g: Value = serde_json::from_str(
            &std::fs::read_to_string(fixtures().join(format!("golden/{file}_{k}shot.json"))).unwrap(),
        )
        .unwrap();
        let s0 = g["samples"][&p.spec.name].as_array().unwrap().iter().find(|s| s["doc_id"] == 0).unwrap();
        let ctx = s0["arguments"][0][0].as_str().unwrap();
        assert_eq!(ctx, p.requests[0].context, "{}", p.spec.name);
    }
    assert_eq!(res["n-shot"]["mmlu"], 5);
    assert_eq!(res["n-shot"]["piqa"], 0);
}

#[test]
fn truncated_inputs_match_the_harness() {
    // max_length 48 / 64: 3-shot contexts are longer, so every request is cut from the left
    check_case("arc_challenge", 3, Some(48));
    check_case("hellaswag", 3, Some(64));
}

#[test]
fn piqa_matches_the_harness() {
    for k in [0, 3] {
        check("piqa", k);
    }
}

#[test]
fn triviaqa_matches_the_harness() {
    for k in [0, 3, 5] {
        check("triviaqa", k);
    }
}

/// A copy of the fixture data to break.
fn data_copy() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let src = fixtures().join("data");
    for e in glob::glob(&format!("{}/**/*.jsonl", src.display())).unwrap() {
        let p = e.unwrap();
        let dst = d.path().join(p.strip_prefix(&src).unwrap());
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(&p, &dst).unwrap();
    }
    d
}

fn err(a: &EvalTasksArgs) -> String {
    format!("{:#}", evaluate(a).err().expect("an error"))
}

fn edit_line(path: &Path, line: usize, f: impl Fn(&mut Value)) {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let mut v: Value = serde_json::from_str(&lines[line - 1]).unwrap();
    f(&mut v);
    lines[line - 1] = v.to_string();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

#[test]
fn bad_input_is_named_never_dropped() {
    let d = data_copy();
    let root = d.path();
    let e = err(&args("arc_challenge", 40, root));
    assert!(e.contains("40 few-shot examples asked from the `train` split, which has 26"), "{e}");
    // a missing split names the task, the split and the path
    std::fs::remove_file(root.join("hellaswag/validation.jsonl")).unwrap();
    let e = err(&args("hellaswag", 0, root));
    assert!(e.contains("hellaswag") && e.contains("split `validation` is missing") && e.contains("hint:"), "{e}");
    // the few-shot split is needed only with shots
    std::fs::remove_file(root.join("piqa/train.jsonl")).unwrap();
    let e = err(&args("piqa", 3, root));
    assert!(e.contains("split `train` is missing"), "{e}");
    // a malformed record: file:line
    let v = root.join("piqa/validation.jsonl");
    let mut text = std::fs::read_to_string(&v).unwrap();
    text = text.replacen('\n', "\n{\"goal\": \"broken\n", 1);
    std::fs::write(&v, &text).unwrap();
    let e = err(&args("piqa", 0, root));
    assert!(e.contains("piqa/validation.jsonl:2: malformed JSON") && e.contains("hint:"), "{e}");
    // a label out of range, a missing field, an answer key that is no label
    let p = root.join("arc_challenge/test.jsonl");
    edit_line(&p, 2, |v| v["answerKey"] = "Z".into());
    let e = err(&args("arc_challenge", 0, root));
    assert!(e.contains("test.jsonl:2") && e.contains("answerKey") && e.contains("\"Z\""), "{e}");
    let p = root.join("mmlu/anatomy/test.jsonl");
    edit_line(&p, 3, |v| v["answer"] = 4.into());
    let e = err(&args("mmlu_anatomy", 0, root));
    assert!(e.contains("anatomy/test.jsonl:3") && e.contains("`answer` = 4 is out of range for 4 choices"), "{e}");
    edit_line(&p, 3, |v| {
        v.as_object_mut().unwrap().remove("choices");
    });
    let e = err(&args("mmlu", 0, root));
    assert!(e.contains("anatomy/test.jsonl:3: no field `choices`"), "{e}");
    let p = root.join("hellaswag/train.jsonl");
    std::fs::copy(&p, root.join("hellaswag/validation.jsonl")).unwrap();
    edit_line(&root.join("hellaswag/validation.jsonl"), 1, |v| v["label"] = "".into());
    let e = err(&args("hellaswag", 0, root));
    assert!(e.contains("validation.jsonl:1") && e.contains("`label`"), "{e}");
    // too many shots for the pool, unknown task
    let e = err(&args("triviaqa", 50, root));
    assert!(e.contains("--shots 50 needs 51 records in the `train` split") && e.contains("hint:"), "{e}");
    let mut a = args("piqa", 0, root);
    a.shots = "hellaswag=3".into();
    let e = err(&a);
    assert!(e.contains("--shots names \"hellaswag\", which --tasks does not select"), "{e}");
    let e = err(&args("winogrande", 0, root));
    assert!(e.contains("unknown task \"winogrande\"") && e.contains("hint:"), "{e}");
}

#[test]
fn resumes_from_scored_documents_and_writes_the_harness_outputs() {
    let out = tempfile::tempdir().unwrap();
    let mut a = args("piqa,mmlu", 0, &fixtures().join("data"));
    a.out = Some(out.path().to_path_buf());
    a.log_samples = true;
    harpe::eval::tasks::run::run(a.clone()).unwrap();
    let res: Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("results.json")).unwrap()).unwrap();
    for k in ["results", "groups", "group_subtasks", "versions", "n-shot", "higher_is_better", "n-samples", "config"] {
        assert!(res.get(k).is_some(), "results.json has no {k}");
    }
    assert_eq!(res["n-samples"]["piqa"]["effective"], 5);
    assert!(res["results"]["mmlu"]["acc,none"].is_number() && res["groups"]["mmlu_stem"].is_object());
    let samples = std::fs::read_to_string(out.path().join("samples_piqa.jsonl")).unwrap();
    let first: Value = serde_json::from_str(samples.lines().next().unwrap()).unwrap();
    assert!(first["arguments"][0][0].as_str().unwrap().starts_with("Question: "));
    assert_eq!(first["resps"].as_array().unwrap().len(), 2);

    // a rerun reads the scored documents back: a doctored log-likelihood shows through
    let part = out.path().join("partial/piqa.jsonl");
    let text = std::fs::read_to_string(&part).unwrap();
    let mut lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let doc = lines[0]["doc_id"].as_u64().unwrap() as usize;
    let gold = {
        let (p, _, _) = evaluate(&args("piqa", 0, &fixtures().join("data"))).unwrap();
        match p[0].docs[doc].target {
            harpe::eval::tasks::Target::Index(i) => i,
            _ => unreachable!(),
        }
    };
    lines[0]["lls"][gold] = 0.0.into();
    lines[0]["lls"][1 - gold] = (-1e6).into();
    let mut body: String = lines.iter().map(|v| format!("{v}\n")).collect();
    body.push_str("{\"doc_id\": 3, \"ke"); // a torn last line from a killed run
    std::fs::write(&part, body).unwrap();
    let (_, resp, res2) = evaluate(&a).unwrap();
    let Response::Choices(c) = &resp[0][doc] else { panic!() };
    assert_eq!(c[gold].loglik, 0.0, "the resumed document was not read back");
    let acc = |r: &serde_json::Map<String, Value>| r["results"]["piqa"]["acc,none"].as_f64().unwrap();
    assert!(acc(&res2) >= res["results"]["piqa"]["acc,none"].as_f64().unwrap());
    // other settings (the seed changes nothing at 0 shots, the limit does not either: same prompts), but a
    // different prompt recomputes: 3 shots
    let mut b = a.clone();
    b.shots = "3".into();
    let (_, resp, _) = evaluate(&b).unwrap();
    let Response::Choices(c) = &resp[0][doc] else { panic!() };
    assert!(c[gold].loglik < 0.0, "a changed prompt must be scored again");
    // --limit: the first N documents, a fraction rounds up
    let mut l = args("piqa", 0, &fixtures().join("data"));
    l.limit = Some(0.5);
    let (p, _, res3) = evaluate(&l).unwrap();
    assert_eq!(p[0].requests.len(), 3);
    assert_eq!(res3["n-samples"]["piqa"]["original"], 5);
}

#[test]
fn cli_prints_the_harness_results_as_json() {
    let o = harpe_cmd()
        .args(["eval-tasks", "--model"])
        .arg(fixtures().join("model"))
        .args(["--tasks", "arc_challenge", "--data"])
        .arg(fixtures().join("data"))
        .args(["--shots", "3", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let g: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("golden/arc_challenge_3shot.json")).unwrap())
            .unwrap();
    for k in ["acc,none", "acc_norm,none", "acc_stderr,none", "acc_norm_stderr,none"] {
        assert_eq!(v["results"]["arc_challenge"][k], g["results"]["arc_challenge"][k], "{k}");
    }
    let o = harpe_cmd()
        .args(["eval-tasks", "--model"])
        .arg(fixtures().join("model"))
        .args(["--tasks", "hellaswag", "--data", "/nonexistent"])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("split `validation` is missing") && e.contains("hint:"), "{e}");
}

#[test]
fn string_rules_match_python_and_the_harness() {
    let text = std::fs::read_to_string(fixtures().join("golden/text_rules.json")).unwrap();
    let cases: Vec<Value> = serde_json::from_str(&text).unwrap();
    for c in &cases {
        let s = c["s"].as_str().unwrap();
        assert_eq!(harpe::eval::tasks::hellaswag_preprocess(s), c["preprocess"].as_str().unwrap(), "preprocess {s:?}");
        assert_eq!(harpe::eval::tasks::py_capitalize(s), c["capitalize"].as_str().unwrap(), "capitalize {s:?}");
        assert_eq!(harpe::eval::tasks::py_strip(s), c["strip"].as_str().unwrap(), "strip {s:?}");
        let g = c["gold"].as_str().unwrap();
        let em = harpe::eval::tasks::results::exact_match(s, g);
        assert_eq!(em, c["exact_match"].as_f64().unwrap() == 1.0, "exact_match {s:?} vs {g:?}");
    }
}
