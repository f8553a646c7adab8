//! `harpe prepare-data` flags no other test touches, through the binary: budget suffixes, the
//! SlimPajama mixture, separators none/eos, --text-field/--source-field, .txt inputs and globs.
//! Expected token streams are built here from the tokenizer's own vocabulary.
use crate::common::harpe_cmd;
use std::path::{Path, PathBuf};

fn tokenizer() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/tokenizer.json")
}

/// Word-level ids straight from tokenizer.json (unknown words are <unk>).
fn ids(text: &str) -> Vec<u32> {
    let t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(tokenizer()).unwrap()).unwrap();
    let vocab = &t["model"]["vocab"];
    text.split_whitespace().map(|w| vocab[w].as_u64().unwrap_or(vocab["<unk>"].as_u64().unwrap()) as u32).collect()
}

fn prepare(dir: &Path, out: &str, args: &[&str]) -> serde_json::Value {
    let o = harpe_cmd()
        .current_dir(dir)
        .args(["prepare-data", "--quiet", "--tokenizer"])
        .arg(tokenizer())
        .args(["--out", out])
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_str(&std::fs::read_to_string(dir.join(out).join("manifest.json")).unwrap()).unwrap()
}

fn tokens(dir: &Path, out: &str) -> Vec<u32> {
    let b = std::fs::read(dir.join(out).join("shard_00000.bin")).unwrap();
    b.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
}

#[test]
fn txt_globs_and_separators_none_and_eos() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("in")).unwrap();
    let (a, b) = ("the time of the state", "we said that they would");
    std::fs::write(d.path().join("in/a.txt"), a).unwrap();
    std::fs::write(d.path().join("in/b.txt"), b).unwrap();
    std::fs::write(d.path().join("in/skip.md"), "not matched by the glob").unwrap();
    let common = ["--input", "in/*.txt", "--strategy", "original", "--seq-len", "4"];

    let m = prepare(d.path(), "eos", &[&common[..], &["--separator", "eos"]].concat());
    assert_eq!(m["inputs"], serde_json::json!(["in/a.txt", "in/b.txt"]), "sorted glob, .txt only");
    let eos = m["eos_id"].as_u64().unwrap() as u32;
    let want: Vec<u32> = [ids(a), vec![eos], ids(b), vec![eos]].concat(); // 12 tokens = 3 x 4
    assert_eq!(tokens(d.path(), "eos"), want);
    assert_eq!(m["sources"]["text"]["docs_in"], 2);

    let m = prepare(d.path(), "none", &[&common[..], &["--separator", "none"]].concat());
    let want: Vec<u32> = [ids(a), ids(b)].concat(); // 10 tokens: 2 sequences, 2 dropped
    assert_eq!(tokens(d.path(), "none"), want[..8].to_vec());
    assert_eq!(m["tail_tokens_dropped"], 2);
    assert_eq!(m["bos_id"], serde_json::Value::Null);
}

#[test]
fn budget_suffixes_fields_and_the_slimpajama_mixture() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(
        d.path().join("r.jsonl"),
        "{\"body\": \"the of and to\", \"info\": {\"src\": \"web\"}}\n{\"body\": \"in is was for\", \"info\": {\"src\": \"code\"}}\n",
    )
    .unwrap();
    let fields = ["--input", "r.jsonl", "--text-field", "body", "--source-field", "info.src", "--seq-len", "2"];
    for (budget, want) in
        [("0.006k", serde_json::json!(6)), ("1_5K", serde_json::json!(15_000)), ("2m", serde_json::json!(2_000_000))]
    {
        let m = prepare(
            d.path(),
            &format!("b{want}"),
            &[&fields[..], &["--budget", budget, "--separator", "none"]].concat(),
        );
        assert_eq!(m["strategy"]["budget"], want, "--budget {budget}");
        assert_eq!(m["source_names"], serde_json::json!(["code", "web"]), "sources from info.src");
        assert_eq!(m["sources"]["web"]["tokens_in"], 4, "text from body");
    }
    let m = prepare(d.path(), "all", &[&fields[..], &["--budget", "all", "--strategy", "original"]].concat());
    assert_eq!(m["strategy"]["budget"], serde_json::Value::Null);

    std::fs::write(
        d.path().join("sp.jsonl"),
        "{\"text\": \"the of and to\", \"meta\": {\"redpajama_set_name\": \"RedPajamaC4\"}}\n\
         {\"text\": \"in is was for\", \"meta\": {\"redpajama_set_name\": \"RedPajamaGithub\"}}\n",
    )
    .unwrap();
    let m = prepare(
        d.path(),
        "sp",
        &["--input", "sp.jsonl", "--budget", "1000", "--source-weights", "slimpajama", "--seq-len", "2"],
    );
    assert_eq!(m["strategy"]["weights"], "slimpajama");
    // SlimPajama's published mix (Soboleva et al. 2023): CommonCrawl 52.2%, C4 26.7%, GitHub 5.2%,
    // ArXiv 4.6%, Books 4.2%, Wikipedia 3.8%, StackExchange 3.3% of tokens.
    let published = [
        ("RedPajamaCommonCrawl", 0.522),
        ("RedPajamaC4", 0.267),
        ("RedPajamaGithub", 0.052),
        ("RedPajamaArXiv", 0.046),
        ("RedPajamaBook", 0.042),
        ("RedPajamaWikipedia", 0.038),
        ("RedPajamaStackExchange", 0.033),
    ];
    let mut total = 0;
    for (name, share) in published {
        let s = &m["sources"][name];
        let got = s["target_share"].as_f64().unwrap_or_else(|| panic!("{name} missing: {s}"));
        assert!((got - share).abs() < 0.015, "{name}: target share {got} vs published {share}");
        total += s["budget"].as_u64().unwrap();
    }
    assert!((998..=1002).contains(&total), "per-source budgets add up to --budget: {total}");
}
