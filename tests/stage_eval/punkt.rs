//! NLTK Punkt parity: `harpe::eval::punkt::Punkt::english()` against the splits NLTK 3.9.1 made of
//! essay-like texts, and RULER's five essay-haystack tasks against RULER's own `generate_input_output`
//! run with NLTK (both fixtures from `scripts/make_punkt_fixtures.py`).
use harpe::eval::niah::{Essays, NiahGenerator, NiahTask};
use harpe::eval::punkt::Punkt;
use serde_json::Value;

fn fixture(text: &str) -> Value {
    serde_json::from_str(text).unwrap()
}

#[test]
fn punkt_english_matches_nltk_on_every_fixture_text() {
    let f = fixture(include_str!("../data/punkt_nltk.json"));
    let cases = f["cases"].as_array().unwrap();
    assert!(cases.len() > 400, "fixture too small: {}", cases.len());
    let p = Punkt::english();
    let mut bad = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let text = c["text"].as_str().unwrap();
        let want: Vec<&str> = c["sents"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
        let got = p.tokenize(text);
        if got != want {
            bad.push(format!("case {i}: {text:?}\n  nltk:  {want:?}\n  harpe: {got:?}"));
        }
    }
    assert!(bad.is_empty(), "{} of {} texts split differently:\n{}", bad.len(), cases.len(), bad.join("\n"));
}

#[test]
fn punkt_keeps_abbreviations_and_initials_together() {
    // The cases a rule-based splitter gets wrong (values from NLTK 3.9.1 sent_tokenize).
    let t = "Dr. Smith went to Washington. He met Mr. J. Doe at 5 p.m. and left. Why? \"Because.\" It was e.g. fine!";
    assert_eq!(
        Punkt::english().tokenize(t),
        vec![
            "Dr. Smith went to Washington.",
            "He met Mr. J. Doe at 5 p.m. and left.",
            "Why?",
            "\"Because.\"",
            "It was e.g.",
            "fine!"
        ]
    );
    assert!(Punkt::english().tokenize("").is_empty());
    assert_eq!(Punkt::english().tokenize("  no period at all  "), vec!["  no period at all"]);
}

#[test]
fn essay_tasks_reproduce_ruler_byte_for_byte() {
    let g = fixture(include_str!("../data/niah_essay_golden.json"));
    let essays = Essays::from_text(g["essay_text"].as_str().unwrap().to_string(), "golden".into());
    let sizes: Vec<usize> = g["sizes"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    for task in [NiahTask::Single2, NiahTask::Single3, NiahTask::Multikey1, NiahTask::Multivalue, NiahTask::Multiquery]
    {
        let mut gen = NiahGenerator::new(task, 42, Some(&essays)).unwrap();
        for (k, &n) in sizes.iter().enumerate() {
            let want = &g[task.name()][k];
            let s = gen.generate(n);
            assert_eq!(s.input, want[0].as_str().unwrap(), "{} prompt, num_haystack={n}", task.name());
            let ans: Vec<&str> = want[1].as_array().unwrap().iter().map(|x| x.as_str().unwrap()).collect();
            assert_eq!(s.answers, ans, "{} answers, num_haystack={n}", task.name());
        }
    }
}
