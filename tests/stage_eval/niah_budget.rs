//! Every prepared prompt stays within its token budget, for two different tokenizers built here
//! (a whitespace WordLevel and the byte-level BPE of `model::testing`), and essays that are too short
//! are refused with the length they would need.
use harpe::eval::niah::{Essays, NIAH_TOKENS_TO_GENERATE};
use harpe::eval::niah_run::{data_path, parse_tasks, prepare_cells, NiahSampleOptions};
use harpe::eval::niah_sizing::{count_tokens, Sizing};
use tokenizers::Tokenizer;

fn word_level() -> Tokenizer {
    let mut vocab = serde_json::Map::new();
    for (i, w) in ["[UNK]", "the", "special", "magic", "number", "is", ".", "grass", "green", "sky"].iter().enumerate()
    {
        vocab.insert(w.to_string(), serde_json::json!(i));
    }
    let j = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    Tokenizer::from_bytes(j.to_string().as_bytes()).unwrap()
}

fn byte_bpe() -> Tokenizer {
    Tokenizer::from_bytes(harpe::model::testing::byte_tokenizer_json().as_bytes()).unwrap()
}

fn essay_task(t: &str) -> bool {
    !["niah_single_1", "niah_multikey_2", "niah_multikey_3", "passkey", "needle_grid"].contains(&t)
}

/// RULER sampling of `tasks` at one `length`, no needle grid, seed 42.
fn one_length(tasks: &str, length: usize, samples: usize, sizing: Sizing) -> NiahSampleOptions {
    NiahSampleOptions {
        tasks: parse_tasks(tasks).unwrap(),
        lengths: vec![length],
        grid_lengths: vec![],
        grid_depths: 0,
        passkey_depths: 1,
        samples,
        seed: 42,
        sizing,
    }
}

fn essays(sentences: usize) -> Essays {
    let text = (0..sentences)
        .map(|i| format!("Essay sentence {i} tells how founders of startups learn to write.\n"))
        .collect::<String>();
    Essays::from_text(text, "test essays".into())
}

#[test]
fn every_prompt_fits_its_budget_for_two_tokenizers() {
    let es = essays(1500);
    for (name, tok) in [("wordlevel", word_level()), ("bytes", byte_bpe())] {
        let dir = tempfile::tempdir().unwrap();
        let opts = NiahSampleOptions {
            tasks: parse_tasks("all").unwrap(),
            lengths: vec![4096, 8192],
            grid_lengths: vec![4096],
            grid_depths: 3,
            passkey_depths: 3,
            samples: 2,
            seed: 42,
            sizing: Sizing::Binary,
        };
        let cells = prepare_cells(&opts, &tok, name, Some(&es), dir.path()).unwrap();
        let step = count_tokens(&tok, &es.words[..500].join(" ")).unwrap();
        assert_eq!(cells.len(), 10 * 2 - 1, "8 niah + passkey at two lengths, the grid at one");
        for c in &cells {
            assert!(data_path(dir.path(), c.length, &c.task).is_file());
            for r in &c.records {
                let n = count_tokens(&tok, &r.prompt()).unwrap();
                let budget = c.max_new_tokens + if c.task == "passkey" { 1 } else { 0 };
                assert!(n + budget <= c.length, "{name} {} @ {}: {n} + {budget} tokens", c.task, c.length);
                if c.task.starts_with("niah_") {
                    assert_eq!(r.length, Some(n + NIAH_TOKENS_TO_GENERATE));
                }
                // The haystack is sized to the length, not left small: within one RULER step (500 essay
                // words; a sample that overflows drops a whole step, as in RULER) or half the length.
                let slack = if essay_task(&c.task) { step + 64 } else { c.length / 2 };
                assert!(n + c.max_new_tokens + slack > c.length, "{name} {} @ {}: only {n} tokens", c.task, c.length);
            }
        }
        // Re-preparing with the same settings loads the cached files and gives the same prompts.
        let again = prepare_cells(&opts, &tok, name, Some(&es), dir.path()).unwrap();
        for (a, b) in cells.iter().zip(&again) {
            assert_eq!(a.records, b.records);
        }
    }
}

#[test]
fn linear_sizing_also_fits() {
    let tok = byte_bpe();
    let dir = tempfile::tempdir().unwrap();
    let opts = one_length("noise", 2048, 2, Sizing::Linear);
    for c in prepare_cells(&opts, &tok, "bytes", None, dir.path()).unwrap() {
        for r in &c.records {
            let n = count_tokens(&tok, &r.input).unwrap();
            // The step at T < 4096 is 5 units (about 450-650 bytes here).
            assert!(n + 128 <= 2048 && n + 128 + 700 > 2048, "{} uses {n} tokens", c.task);
        }
    }
}

#[test]
fn short_essays_say_how_long_they_must_be() {
    let tok = byte_bpe();
    let dir = tempfile::tempdir().unwrap();
    let opts = one_length("niah_single_2", 8192, 1, Sizing::Binary);
    let e = format!("{:#}", prepare_cells(&opts, &tok, "bytes", Some(&essays(40)), dir.path()).unwrap_err());
    assert!(e.contains("too short for length 8192") && e.contains("words") && e.contains("hint:"), "{e}");
    let e = format!("{:#}", prepare_cells(&opts, &tok, "bytes", None, dir.path()).unwrap_err());
    assert!(e.contains("--essays"), "{e}");
}
