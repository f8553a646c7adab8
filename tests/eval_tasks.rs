//! `harpe eval-tasks` against lm-evaluation-harness 0.4.13 itself: every prompt string, per-choice
//! log-likelihood (within 1e-4), greedy flag, generation, per-sample metric and aggregated result
//! (accuracies exactly, stderrs to 1e-12) of MMLU (with its groups), HellaSwag, ARC-Challenge, PIQA and
//! TriviaQA, zero-shot, 3-shot and HARPE Table 3's shots, on the fixtures of `scripts/make_tasks_golden.py`
//! (a tiny random transformers Llama with a Llama-layout tokenizer). Then resume, outputs and bad input.
use harpe::eval::ppl::ScoringModel;
use harpe::eval::tasks::results::Response;
use harpe::eval::tasks::run::{evaluate, EvalTasksArgs};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/eval_tasks")
}

fn args(tasks: &str, shots: usize, data: &Path) -> EvalTasksArgs {
    EvalTasksArgs {
        scoring: ScoringModel::new(&fixtures().join("model")),
        tasks: tasks.to_string(),
        data: data.to_path_buf(),
        shots,
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
    let path = fixtures().join(format!("golden/{task}_{shots}shot.json"));
    let g: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let (prepared, resp, res) = evaluate(&args(task, shots, &fixtures().join("data"))).unwrap();
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
