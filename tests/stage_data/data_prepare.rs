//! prepare-data: round trip, strategies, determinism, resume, bad input (synthetic corpora, test tokenizer).
use crate::common::data::*;
use harpe::data::mixture::{StrategyKind, Weights};
use harpe::data::{prepare_from_texts, Loader, LoaderConfig, Manifest, PrepareOptions};
use std::io::Write;
use std::path::Path;

fn loader(dir: &Path, seq_len: usize) -> Loader {
    Loader::open(dir, LoaderConfig { seq_len, shuffle: false, seed: 0, rank: 0, world_size: 1 }).unwrap()
}

#[test]
fn original_round_trips_documents_in_order() {
    let (tmp, tok) = tempdir_with_tokenizer();
    let lens = [5usize, 130, 1, 64, 63, 200, 17, 90, 33, 8, 250];
    let texts: Vec<(String, String)> =
        lens.iter().enumerate().map(|(d, &l)| (["a", "b", "c"][d % 3].to_string(), doc_text(d, l))).collect();
    let mut o = PrepareOptions::new(64);
    o.shard_tokens = 64 * 3; // several shards
    let out = tmp.path().join("ds");
    let m = prepare_from_texts(&texts, &tok, &o, &out).unwrap();

    let mut expect = Vec::new();
    let mut starts = Vec::new();
    let mut src = Vec::new();
    for (d, &l) in lens.iter().enumerate() {
        starts.push(expect.len());
        expect.push(BOS);
        expect.extend(doc_ids(d, l));
        src.resize(expect.len(), (d % 3) as u32);
    }
    let n = expect.len() / 64;
    assert_eq!(m.num_sequences as usize, n);
    assert_eq!(m.tail_tokens_dropped as usize, expect.len() - n * 64);
    assert!(m.shards.len() > 1);
    assert_eq!(all_tokens(&out), expect[..n * 64]);

    // sequences from the loader: tokens, document starts and source spans match the documents
    let mut l = loader(&out, 64);
    for i in 0..n {
        let s = l.next_sequence().unwrap();
        assert_eq!(s.index as usize, i);
        assert_eq!(s.tokens, expect[i * 64..(i + 1) * 64]);
        let want_starts: Vec<usize> =
            starts.iter().filter(|&&p| p >= i * 64 && p < (i + 1) * 64).map(|p| p - i * 64).collect();
        assert_eq!(s.doc_starts, want_starts);
        assert_eq!(s.sources.first().unwrap().start, 0);
        assert_eq!(s.sources.last().unwrap().end, 64);
        for sp in &s.sources {
            for p in sp.start..sp.end {
                assert_eq!(src[i * 64 + p], sp.source);
            }
        }
    }
    // wraps to the next epoch in the same order
    assert_eq!(l.next_sequence().unwrap().tokens, expect[..64]);
    // counts per source
    let a = &m.sources["a"];
    assert_eq!(a.docs_in, 4);
    assert_eq!(a.tokens_in, (5 + 64 + 17 + 8) as u64);
    let total_out: u64 = m.sources.values().map(|s| s.tokens_out).sum();
    assert_eq!(total_out, m.num_sequences * 64);
}

/// Corpus with known per-source lengths: per source `n_long` documents of 600 tokens spread evenly among
/// `n_short` documents of 40 tokens; sources interleaved round-robin.
fn mixed_corpus(spec: &[(&str, usize, usize)]) -> Vec<(String, String)> {
    let mut texts = Vec::new();
    let mut d = 0;
    let mut longs = vec![0; spec.len()];
    for i in 0..spec.iter().map(|s| s.1 + s.2).max().unwrap() {
        for (k, &(name, n_long, n_short)) in spec.iter().enumerate() {
            if i >= n_long + n_short {
                continue;
            }
            let long = n_long > 0 && i % ((n_long + n_short) / n_long) == 0 && longs[k] < n_long;
            longs[k] += usize::from(long);
            texts.push((name.to_string(), doc_text(d, if long { 600 } else { 40 })));
            d += 1;
        }
    }
    texts
}

#[test]
fn per_source_upsample_meets_budgets_and_raises_long_share() {
    let (tmp, tok) = tempdir_with_tokenizer();
    // a: 30% long tokens, b: 70% long tokens, c: short only (will need a top-up)
    let texts = mixed_corpus(&[("a", 20, 700), ("b", 40, 250), ("c", 0, 800)]);
    let mut o = PrepareOptions::new(128);
    o.strategy.name = StrategyKind::PerSourceUpsample;
    o.strategy.threshold = 500;
    o.strategy.budget = Some(30_000);
    o.seed = 7;
    let out = tmp.path().join("ds");
    let m = prepare_from_texts(&texts, &tok, &o, &out).unwrap();
    let tot_in: u64 = m.sources.values().map(|s| s.tokens_in).sum();
    for (name, s) in &m.sources {
        let budget = s.budget.unwrap();
        let share = s.tokens_in as f64 / tot_in as f64;
        assert!((s.target_share.unwrap() - share).abs() < 1e-12, "{name}: target = input share");
        assert!((budget as f64 - 30_000.0 * share).abs() <= 1.0);
        assert!(s.tokens_out.abs_diff(budget) <= 128, "{name}: {} tokens out vs budget {budget}", s.tokens_out);
        assert_eq!(s.shortfall_tokens, 0);
    }
    for name in ["a", "b"] {
        let s = &m.sources[name];
        assert!(s.long_token_share_out > s.long_token_share_in + 0.05, "{name}: {s:?}");
        assert_eq!(s.topped_up_docs, 0);
    }
    // a keeps ~10% of its short docs: long share ~ 12000 / (12000 + 0.1 * 28000) ~= 0.81 before the budget cut
    assert!(m.sources["a"].long_token_share_out > 0.6);
    let c = &m.sources["c"];
    assert_eq!(c.long_token_share_out, 0.0);
    assert!(c.topped_up_docs > 0 && m.notes.iter().any(|n| n.contains("source c") && n.contains("topped up")));
}

#[test]
fn source_weights_and_shortfall_are_reported() {
    let (tmp, tok) = tempdir_with_tokenizer();
    let texts = mixed_corpus(&[("a", 10, 100), ("b", 2, 10)]);
    let mut o = PrepareOptions::new(64);
    o.strategy.name = StrategyKind::PerSourceUpsample;
    o.strategy.threshold = 500;
    o.strategy.budget = Some(10_000);
    o.strategy.weights = Weights::parse("a=0.5,b=0.5").unwrap();
    let m = prepare_from_texts(&texts, &tok, &o, &tmp.path().join("ds")).unwrap();
    let a = &m.sources["a"];
    assert_eq!(a.budget, Some(5000));
    assert!(a.tokens_out.abs_diff(5000) <= 64);
    let b = &m.sources["b"];
    assert!(b.shortfall_tokens > 0, "b has only ~1600 tokens: {b:?}");
    assert!(m.notes.iter().any(|n| n.contains("source b") && n.contains("less than its budget")));
}

#[test]
fn same_seed_same_bytes_other_seed_other_bytes() {
    let (tmp, tok) = tempdir_with_tokenizer();
    let texts = mixed_corpus(&[("a", 10, 300), ("b", 10, 300)]);
    let run = |seed: u64, name: &str, threads: usize| {
        let mut o = PrepareOptions::new(64);
        o.strategy.name = StrategyKind::GlobalUpsample;
        o.strategy.threshold = 500;
        o.seed = seed;
        o.threads = Some(threads);
        let m = prepare_from_texts(&texts, &tok, &o, &tmp.path().join(name)).unwrap();
        m.shards.iter().map(|s| s.sha256.clone()).collect::<Vec<_>>()
    };
    let a = run(1, "a", 1);
    assert_eq!(a, run(1, "b", 2), "thread count must not change the bytes");
    assert_ne!(a, run(2, "c", 2));
}

#[test]
fn cut_strategy_splits_documents() {
    let (tmp, tok) = tempdir_with_tokenizer();
    let texts = one_source_docs(6, 100);
    let mut o = PrepareOptions::new(32);
    o.strategy.name = StrategyKind::Cut;
    o.strategy.cut_len = 30;
    let out = tmp.path().join("ds");
    let m = prepare_from_texts(&texts, &tok, &o, &out).unwrap();
    // each 100-token document becomes 4 pieces (30, 30, 30, 10), each with its own BOS
    let mut expect = Vec::new();
    for d in 0..6 {
        for p in doc_ids(d, 100).chunks(30) {
            expect.push(BOS);
            expect.extend_from_slice(p);
        }
    }
    assert_eq!(m.sources["a"].docs_in, 6);
    assert_eq!(all_tokens(&out), expect[..expect.len() / 32 * 32]);
}

#[test]
fn budget_cuts_original_and_separator_policies() {
    let (tmp, tok) = tempdir_with_tokenizer();
    let texts = one_source_docs(20, 50);
    let mut o = PrepareOptions::new(16);
    o.strategy.budget = Some(100);
    o.separator = harpe::data::tokenize::Separator::BosEos;
    let out = tmp.path().join("ds");
    let m = prepare_from_texts(&texts, &tok, &o, &out).unwrap();
    assert_eq!(m.num_sequences, 6); // 100 tokens -> 6 full sequences of 16
    let mut expect = vec![BOS];
    expect.extend(doc_ids(0, 50));
    expect.push(EOS);
    expect.push(BOS);
    expect.extend(doc_ids(1, 50));
    assert_eq!(all_tokens(&out), expect[..96]);
    assert_eq!(m.bos_id, Some(BOS));
    assert_eq!(m.eos_id, Some(EOS));
}

fn write_zst(path: &Path, lines: &[String]) {
    let f = std::fs::File::create(path).unwrap();
    let mut e = zstd::stream::write::Encoder::new(f, 3).unwrap();
    for l in lines {
        writeln!(e, "{l}").unwrap();
    }
    e.finish().unwrap();
}

#[test]
fn slimpajama_tree_with_zst_and_meta_as_string() {
    let (tmp, tok) = tempdir_with_tokenizer();
    let tree = tmp.path().join("train/chunk1");
    std::fs::create_dir_all(&tree).unwrap();
    let l0: Vec<String> = (0..5).map(|d| slimpajama_line(&doc_text(d, 20), "RedPajamaBook")).collect();
    write_zst(&tree.join("example_train_0.jsonl.zst"), &l0);
    let meta_str =
        serde_json::json!({"text": doc_text(5, 20), "meta": "{\"redpajama_set_name\": \"RedPajamaC4\"}"}).to_string();
    std::fs::write(tree.join("example_train_1.jsonl"), format!("{meta_str}\n\n")).unwrap();
    let mut o = PrepareOptions::new(21);
    o.strategy.name = StrategyKind::Original;
    let files = harpe::data::source::expand_inputs(&[tmp.path().join("train").display().to_string()]).unwrap();
    assert_eq!(files.len(), 2);
    let out = tmp.path().join("ds");
    let m = harpe::data::prepare(files, &tok, &o, &out).unwrap();
    assert_eq!(m.num_sequences, 6);
    assert_eq!(m.sources["RedPajamaBook"].docs_in, 5);
    assert_eq!(m.sources["RedPajamaC4"].docs_in, 1);
    let toks = all_tokens(&out);
    assert_eq!(toks[21 * 5 + 1..21 * 6], doc_ids(5, 20));
}

/// Write `lines` to a jsonl file and prepare it; returns the error text or the manifest.
fn prepare_lines(dir: &Path, lines: &[&[u8]], max_bad: u64) -> Result<Manifest, String> {
    let tok = write_tokenizer(dir);
    let p = dir.join("in.jsonl");
    let mut f = std::fs::File::create(&p).unwrap();
    for l in lines {
        f.write_all(l).unwrap();
        f.write_all(b"\n").unwrap();
    }
    let files = harpe::data::source::expand_inputs(&[p.display().to_string()]).unwrap();
    let mut o = PrepareOptions::new(8);
    o.max_bad_lines = max_bad;
    harpe::data::prepare(files, &tok, &o, &dir.join("ds")).map_err(|e| format!("{e:#}"))
}

#[test]
fn bad_lines_are_fatal_with_file_and_line_unless_allowed() {
    let good = slimpajama_line(&doc_text(0, 30), "RedPajamaArXiv");
    let cases: [(&[u8], &str); 5] = [
        (b"{\"text\": \"w1 w2\", \"meta\": ", "malformed JSON"),
        (b"{\"meta\": {\"redpajama_set_name\": \"RedPajamaC4\"}}", "no text field"),
        (b"{\"text\": \"w1 \xff w2\", \"meta\": {\"redpajama_set_name\": \"RedPajamaC4\"}}", "invalid UTF-8"),
        (b"{\"text\": \"w1\", \"meta\": {\"redpajama_set_name\": \"RedPajamaFoo\"}}", "unknown source name"),
        (b"{\"text\": \"  \", \"meta\": {\"redpajama_set_name\": \"RedPajamaC4\"}}", "empty text"),
    ];
    for (bad, what) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let err = prepare_lines(tmp.path(), &[good.as_bytes(), bad, good.as_bytes()], 0).unwrap_err();
        assert!(err.contains("in.jsonl:2:") && err.contains(what) && err.contains("hint:"), "{err}");
        let tmp = tempfile::tempdir().unwrap();
        let m = prepare_lines(tmp.path(), &[good.as_bytes(), bad, good.as_bytes()], 1).unwrap();
        assert_eq!(m.bad_lines, 1);
        assert_eq!(m.bad_line_samples[0].line, 2);
        assert_eq!(m.sources["RedPajamaArXiv"].docs_in, 2);
    }
}

#[test]
fn truncated_zst_and_empty_corpus_are_reported() {
    let (tmp, tok) = tempdir_with_tokenizer();
    let p = tmp.path().join("x.jsonl.zst");
    // pseudo-random words, so the compressed stream has many blocks
    let word = |d: u64, j: u64| {
        (d.wrapping_mul(6364136223846793005).wrapping_add(j).wrapping_mul(1442695040888963407) >> 33) % 1000
    };
    let lines: Vec<String> = (0..3000u64)
        .map(|d| {
            slimpajama_line(&(0..50).map(|j| format!("w{}", word(d, j))).collect::<Vec<_>>().join(" "), "RedPajamaC4")
        })
        .collect();
    write_zst(&p, &lines);
    let len = std::fs::metadata(&p).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(len / 2).unwrap();
    let files = harpe::data::source::expand_inputs(&[p.display().to_string()]).unwrap();
    let o = PrepareOptions::new(8);
    let err = format!("{:#}", harpe::data::prepare(files.clone(), &tok, &o, &tmp.path().join("d1")).unwrap_err());
    assert!(err.contains("x.jsonl.zst:") && err.contains("truncated") && err.contains("hint:"), "{err}");
    let mut o2 = o.clone();
    o2.max_bad_lines = 5; // the cut line itself may also be malformed JSON
    let m = harpe::data::prepare(files, &tok, &o2, &tmp.path().join("d2")).unwrap();
    assert!((1..=2).contains(&m.bad_lines), "{:?}", m.bad_line_samples);
    assert!(m.bad_line_samples.iter().any(|b| b.reason.contains("truncated")));
    assert!(m.sources["RedPajamaC4"].docs_in > 0);

    let err = format!("{:#}", prepare_from_texts(&[], &tok, &o, &tmp.path().join("d3")).unwrap_err());
    assert!(err.contains("empty corpus") && err.contains("hint:"), "{err}");
}

#[test]
fn killed_run_resumes_without_redoing_shards_and_gives_same_bytes() {
    let (tmp, tok) = tempdir_with_tokenizer();
    let texts = mixed_corpus(&[("a", 10, 200), ("b", 10, 200)]);
    let mut o = PrepareOptions::new(64);
    o.strategy.name = StrategyKind::PerSourceUpsample;
    o.strategy.threshold = 500;
    o.strategy.budget = Some(6000);
    o.shard_tokens = 64 * 10;
    let full = prepare_from_texts(&texts, &tok, &o, &tmp.path().join("full")).unwrap();
    assert!(full.shards.len() >= 4);

    let out = tmp.path().join("killed");
    let mut keep = o.clone();
    keep.keep_work = true;
    prepare_from_texts(&texts, &tok, &keep, &out).unwrap();
    // simulate a kill during pass 2: no manifest, the last two shards unfinished
    std::fs::remove_file(out.join("manifest.json")).unwrap();
    let n = full.shards.len();
    for k in n - 2..n {
        std::fs::remove_file(out.join(format!(".work/shard_{k:05}.done"))).unwrap();
        std::fs::remove_file(out.join(format!("shard_{k:05}.bin"))).unwrap();
    }
    let first = out.join("shard_00000.bin");
    std::fs::write(&first, b"sentinel: a finished shard is not rewritten").unwrap();
    let m = prepare_from_texts(&texts, &tok, &o, &out).unwrap();
    assert_eq!(std::fs::read(&first).unwrap(), b"sentinel: a finished shard is not rewritten");
    assert_eq!(m.shards, full.shards);
    for k in 1..n {
        let f = format!("shard_{k:05}.bin");
        assert_eq!(std::fs::read(out.join(&f)).unwrap(), std::fs::read(tmp.path().join("full").join(&f)).unwrap());
    }
    assert!(!out.join(".work").exists());
    // a finished dataset with the same settings is returned as is; other settings are refused
    assert_eq!(prepare_from_texts(&texts, &tok, &o, &out).unwrap(), m);
    let mut other = o.clone();
    other.seed = 99;
    let err = format!("{:#}", prepare_from_texts(&texts, &tok, &other, &out).unwrap_err());
    assert!(err.contains("different settings") && err.contains("hint:"), "{err}");
}

#[test]
fn domain_upsample_raises_the_named_source() {
    let (tmp, tok) = tempdir_with_tokenizer();
    // a: 30000 tokens, b: 10000 tokens -> input shares 0.75 / 0.25; b raised to 0.6 -> 0.75/1.35, 0.6/1.35
    let texts = mixed_corpus(&[("a", 0, 750), ("b", 0, 250)]);
    let mut o = PrepareOptions::new(32);
    o.strategy.name = StrategyKind::DomainUpsample;
    o.strategy.upsample_sources = vec!["b".into()];
    o.strategy.budget = Some(9000);
    let m = prepare_from_texts(&texts, &tok, &o, &tmp.path().join("ds")).unwrap();
    let (a, b) = (&m.sources["a"], &m.sources["b"]);
    assert!((b.target_share.unwrap() - 0.6 / 1.35).abs() < 1e-9, "{b:?}");
    assert!(b.tokens_out.abs_diff(4000) <= 32 && a.tokens_out.abs_diff(5000) <= 32, "{a:?} {b:?}");
}

#[test]
fn reading_stops_once_known_budgets_are_full() {
    let (tmp, tok) = tempdir_with_tokenizer();
    let mut paths = Vec::new();
    for f in 0..3 {
        let p = tmp.path().join(format!("part{f}.jsonl"));
        let lines: Vec<String> = (0..20).map(|d| slimpajama_line(&doc_text(f * 20 + d, 30), "RedPajamaBook")).collect();
        std::fs::write(&p, lines.join("\n")).unwrap();
        paths.push(p.display().to_string());
    }
    let files = harpe::data::source::expand_inputs(&paths).unwrap();
    let mut o = PrepareOptions::new(31);
    o.strategy.budget = Some(31 * 25); // 25 documents: the first two files
    let m = harpe::data::prepare(files, &tok, &o, &tmp.path().join("ds")).unwrap();
    assert_eq!(m.inputs_read, 2);
    assert_eq!(m.num_sequences, 25);
    assert_eq!(m.sources["RedPajamaBook"].docs_in, 40);
}

/// A tokenizer without BOS (SmolLM2's, GPT-2's): the default separator's error names the tokenizer's own
/// end-of-document token and the flags that use it, and those flags then work.
#[test]
fn a_tokenizer_without_bos_is_told_its_own_separator() {
    use harpe::data::tokenize::{SepTokens, Separator};
    let tmp = tempfile::tempdir().unwrap();
    let path = write_tokenizer(tmp.path());
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    for (i, name) in [(1, "<|endoftext|>"), (2, "<|im_end|>")] {
        let vocab = json["model"]["vocab"].as_object_mut().unwrap();
        vocab.retain(|_, v| v.as_u64() != Some(i));
        vocab.insert(name.into(), i.into());
        json["added_tokens"][i as usize]["content"] = name.into();
    }
    let tok: tokenizers::Tokenizer = json.to_string().parse().unwrap();
    let e = SepTokens::resolve(&tok, Separator::Bos, None, None).unwrap_err().to_string();
    assert!(e.contains("no BOS token") && e.contains("--separator eos --eos-token \"<|endoftext|>\""), "{e}");
    let eos = SepTokens::resolve(&tok, Separator::Eos, None, Some("<|endoftext|>")).unwrap();
    assert_eq!(eos.eos, Some(1));
}
