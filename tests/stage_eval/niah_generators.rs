//! Each NIAH generator against samples from a line-by-line Python re-run of RULER
//! (`tests/data/niah_golden.py`, CPython `random`, wonderwords 2.2.0), plus hand-checked structure
//! of the essay tasks, the passkey prompt and the needle grid.
use harpe::eval::needle_grid;
use harpe::eval::niah::{Essays, HaystackKind, NeedleType, NiahGenerator, NiahTask, TaskSpec, DEPTHS};
use harpe::eval::niah_words::WordList;
use harpe::eval::passkey;
use serde_json::Value;

fn golden() -> Value {
    serde_json::from_str(include_str!("../data/niah_golden.json")).unwrap()
}

fn check(g: &mut NiahGenerator, n: usize, want: &Value) {
    let s = g.generate(n);
    assert_eq!(s.input, want[0].as_str().unwrap(), "prompt for num_haystack={n}");
    let ans: Vec<String> = want[1].as_array().unwrap().iter().map(|x| x.as_str().unwrap().to_string()).collect();
    assert_eq!(s.answers, ans);
}

#[test]
fn word_list_matches_python_sorted_set() {
    let g = golden();
    let w = WordList::get();
    assert_eq!(w.len() as u64, g["words"]["len"].as_u64().unwrap());
    assert_eq!(w.word(0), g["words"]["first"].as_str().unwrap());
    assert_eq!(w.word(w.len() - 1), g["words"]["last"].as_str().unwrap());
    assert_eq!(w.word(1_234_567), g["words"]["at_1234567"].as_str().unwrap());
    assert_eq!(w.word(3_000_000), g["words"]["at_3000000"].as_str().unwrap());
    // Strictly increasing everywhere = sorted and deduplicated, including the prefix families
    // (high / high-pitched / highfalutin, ...), in code-point order.
    let mut prev = w.word(0);
    for i in 1..w.len() {
        let cur = w.word(i);
        assert!(prev < cur, "word {i}: {prev:?} !< {cur:?}");
        prev = cur;
    }
}

#[test]
fn noise_and_needle_tasks_match_ruler() {
    let g = golden();
    // RULER's multikey_2 at seed 42 with num_haystack 3 (`spec_mk2_3`: the golden script's smallest case).
    let mut mk2 = NiahGenerator::new(NiahTask::Multikey2, 42, None).unwrap();
    check(&mut mk2, 3, &g["spec_mk2_3"]);
    for (task, key) in [(NiahTask::Single1, "s1"), (NiahTask::Multikey2, "mk2"), (NiahTask::Multikey3, "mk3")] {
        // Two calls in a row on one global RNG, as RULER's sizing and sample loop make them.
        let mut gen = NiahGenerator::new(task, 42, None).unwrap();
        check(&mut gen, 5, &g[key][0]);
        check(&mut gen, 9, &g[key][1]);
    }
}

#[test]
fn multi_needle_shapes_match_ruler() {
    let g = golden();
    let spec = |k, v, q| TaskSpec {
        haystack: HaystackKind::Noise,
        key: NeedleType::Words,
        value: NeedleType::Numbers,
        num_k: k,
        num_v: v,
        num_q: q,
    };
    // 4 keys all queried (Oxford-comma query, plural template), and 1 key with 4 values.
    for (s, key) in [(spec(4, 1, 4), "mq_noise"), (spec(1, 4, 1), "mv_noise")] {
        let mut gen = NiahGenerator::from_spec(s, key, 42, None).unwrap();
        check(&mut gen, 5, &g[key][0]);
        check(&mut gen, 9, &g[key][1]);
    }
    let mut gen = NiahGenerator::from_spec(spec(4, 1, 4), "mq", 42, None).unwrap();
    let s = gen.generate(5);
    assert!(s.input.contains(", and "), "Oxford comma query");
    assert!(s.input.starts_with("Some special magic numbers are hidden"));
}

fn essay_text() -> String {
    // 60 sentences of distinct numbered words, so every sentence is recognisable.
    (0..60)
        .map(|i| format!("Sentence number {i} says that essays about startups are long."))
        .collect::<Vec<_>>()
        .join("\n  ")
}

#[test]
fn essay_tasks_place_needles_at_sentence_depths() {
    let essays = Essays::from_text(essay_text(), "test".into());
    assert_eq!(essays.words.len(), 60 * 10);
    for task in [NiahTask::Single2, NiahTask::Single3, NiahTask::Multikey1, NiahTask::Multivalue, NiahTask::Multiquery]
    {
        let mut gen = NiahGenerator::new(task, 42, Some(&essays)).unwrap();
        let s = gen.generate(essays.words.len());
        let spec = task.spec();
        let n_needles = spec.num_k * spec.num_v;
        assert_eq!(s.depths.len(), n_needles);
        assert_eq!(s.answers.len(), spec.num_q * spec.num_v);
        for d in &s.depths {
            assert!(DEPTHS.contains(&(*d as u32)), "depth {d} not on the grid");
        }
        // Every answer appears in a needle sentence of the context, and the query names its key.
        for a in &s.answers {
            assert!(s.input.contains(&format!("is: {a}.")), "{task:?}: answer {a} not in a needle");
        }
        // The needles sit between whole sentences: removing them gives the essay back (single spaces).
        let ctx_start = s.input.find('\n').unwrap() + 1;
        let ctx_end = s.input.rfind("\nWhat ").unwrap();
        let mut ctx = s.input[ctx_start..ctx_end].to_string();
        let needle_re: Vec<String> = ctx
            .split("One of the special magic ")
            .skip(1)
            .map(|rest| format!("One of the special magic {}", &rest[..rest.find('.').unwrap() + 1]))
            .collect();
        assert_eq!(needle_re.len(), n_needles);
        for nd in &needle_re {
            ctx = ctx.replacen(nd, "", 1);
        }
        let squashed = ctx.split(' ').filter(|w| !w.is_empty()).collect::<Vec<_>>().join(" ");
        assert_eq!(squashed, essays.words.join(" "));
    }
}

#[test]
fn essay_tasks_without_essays_are_an_error_with_a_hint() {
    let e = NiahGenerator::new(NiahTask::Single2, 42, None).err().unwrap().to_string();
    assert!(e.contains("niah_single_2") && e.contains("hint:") && e.contains("--essays"), "{e}");
}

#[test]
fn passkey_prompt_matches_reference_layout() {
    let p = passkey::passkey_prompt(200, 0.25, 12345);
    let lines: Vec<&str> = p.split('\n').collect();
    assert_eq!(lines.len(), 5);
    assert!(lines[0].starts_with("There is an important info hidden inside a lot of irrelevant text."));
    // Prefix = garbage[:50], suffix = garbage[:150]: both from the start of the noise.
    assert_eq!(lines[1].len(), 50);
    assert_eq!(lines[3].len(), 150);
    assert!(lines[1].starts_with("The grass is green.") && lines[3].starts_with("The grass is green."));
    assert_eq!(lines[2], "The pass key is 12345. Remember it. 12345 is the pass key.");
    assert_eq!(lines[4], "What is the pass key? The pass key is");
}

#[test]
fn needle_grid_insertion_backs_up_to_a_period() {
    let periods = [9u32].into_iter().collect();
    // ids 9 are periods; the context has periods after positions 2 and 6.
    let ctx: Vec<u32> = vec![1, 2, 9, 3, 4, 5, 9, 6, 7, 8];
    let needle = vec![100, 101];
    // L = 212 leaves 12 tokens after the 200-token buffer: no trimming.
    assert_eq!(
        needle_grid::insert_needle(&ctx, &needle, 50.0, 212, &periods),
        vec![1, 2, 9, 100, 101, 3, 4, 5, 9, 6, 7, 8]
    );
    assert_eq!(needle_grid::insert_needle(&ctx, &needle, 0.0, 212, &periods)[..2], [100, 101]);
    assert_eq!(needle_grid::insert_needle(&ctx, &needle, 100.0, 212, &periods)[10..], [100, 101]);
    // L = 208: 8 tokens left, so the context is cut to 6 before inserting.
    assert_eq!(needle_grid::insert_needle(&ctx, &needle, 100.0, 208, &periods), vec![1, 2, 9, 3, 4, 5, 100, 101]);
    assert_eq!(needle_grid::linspace_round(0.0, 100.0, 10), vec![0, 11, 22, 33, 44, 56, 67, 78, 89, 100]);
    assert_eq!(needle_grid::linspace_round(0.0, 100.0, 40).iter().map(|&d| d as u32).collect::<Vec<_>>(), DEPTHS);
}
