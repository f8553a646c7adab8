//! Parsers of user files never panic: arbitrary and mutated bytes fed to the config.json, safetensors,
//! dataset-manifest (and shard), run-TOML, jsonl-record and RULER-file parsers give `Ok` or an error
//! with a message. Property tests (proptest), bounded so the whole file runs in seconds on 2 cores;
//! mutations start from the real fixtures (tests/golden, configs/tiny-cpu.toml, a prepared dataset).
use crate::common::harpe_cmd;
use harpe::config::RunConfig;
use harpe::data::loader::{Loader, LoaderConfig};
use harpe::data::shard::Manifest;
use harpe::data::source::{parse_record, Fields, Raw};
use harpe::eval::niah_io::parse_data_line;
use harpe::model::config::LlamaConfig;
use proptest::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Cases per reader: at least 2,000 in every run (`PROPTEST_CASES` raises it for a longer run,
/// benches/results/fuzz.md).
pub const CASES: u32 = 2000;

/// Deterministic by default so CI cannot flake; `PROPTEST_RNG_SEED=N` explores other inputs.
pub fn cfg(cases: u32) -> ProptestConfig {
    let base = ProptestConfig::default();
    let rng_seed = if std::env::var_os("PROPTEST_RNG_SEED").is_some() {
        base.rng_seed
    } else {
        proptest::test_runner::RngSeed::Fixed(16)
    };
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(0).max(cases);
    ProptestConfig { cases, failure_persistence: None, rng_seed, ..base }
}

/// An error must say something (the user-facing ones also carry a hint; that is checked elsewhere).
fn check<T>(r: anyhow::Result<T>) {
    if let Err(e) = r {
        assert!(!format!("{e:#}").trim().is_empty(), "an error without a message");
    }
}

/// A mutation of `base`: flip bytes, cut, splice random bytes, or duplicate a slice.
pub fn mutate(base: &[u8], kind: u8, pos: usize, bytes: &[u8]) -> Vec<u8> {
    let mut v = base.to_vec();
    if v.is_empty() {
        return bytes.to_vec();
    }
    let p = pos % v.len();
    match kind % 4 {
        0 => {
            for (i, b) in bytes.iter().enumerate() {
                let j = (p + i * 7) % v.len();
                v[j] ^= b | 1;
            }
        }
        1 => v.truncate(p),
        2 => {
            v.splice(p..p, bytes.iter().copied());
        }
        _ => {
            let end = (p + bytes.len()).min(v.len());
            let dup = v[p..end].to_vec();
            v.splice(p..p, dup);
        }
    }
    v
}

/// Values that break assumptions: huge, negative, fractional, wrong type.
pub fn nasty_json() -> impl Strategy<Value = serde_json::Value> {
    prop_oneof![
        Just(serde_json::json!(0)),
        Just(serde_json::json!(-1)),
        Just(serde_json::json!(u64::MAX)),
        Just(serde_json::json!(1u64 << 60)),
        Just(serde_json::json!(i64::MIN)),
        Just(serde_json::json!(1e300)),
        Just(serde_json::json!(0.5)),
        Just(serde_json::json!(null)),
        Just(serde_json::json!("")),
        Just(serde_json::json!([])),
        Just(serde_json::json!({})),
        Just(serde_json::json!([1u64 << 40, 1u64 << 40])),
        any::<i64>().prop_map(|x| serde_json::json!(x)),
        "[a-z_]{0,8}".prop_map(|s| serde_json::json!(s)),
    ]
}

/// Replace the value of the `k`-th key (in document order, any depth) of a JSON value.
fn replace_nth(v: &mut serde_json::Value, k: &mut usize, new: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Object(m) => {
            for (_, x) in m.iter_mut() {
                if *k == 0 {
                    *x = new.clone();
                    return true;
                }
                *k -= 1;
                if replace_nth(x, k, new) {
                    return true;
                }
            }
            false
        }
        serde_json::Value::Array(a) => a.iter_mut().any(|x| replace_nth(x, k, new)),
        _ => false,
    }
}

pub fn with_replaced(text: &str, k: usize, new: &serde_json::Value) -> String {
    let mut v: serde_json::Value = serde_json::from_str(text).unwrap();
    let mut k = k;
    replace_nth(&mut v, &mut k, new);
    v.to_string()
}

// ------------------------------------------------------------------------------------------------
// config.json

fn config_text() -> &'static str {
    static T: OnceLock<String> = OnceLock::new();
    T.get_or_init(|| std::fs::read_to_string(root().join("tests/golden/harpe/model/config.json")).unwrap())
}

proptest! {
    #![proptest_config(cfg(CASES))]
    #[test]
    fn config_json_values_never_panic(k in 0usize..64, new in nasty_json()) {
        let text = with_replaced(config_text(), k, &new);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        check(LlamaConfig::from_json(&v, "config.json"));
    }

    #[test]
    fn config_json_bytes_never_panic(kind in any::<u8>(), pos in any::<usize>(), bytes in prop::collection::vec(any::<u8>(), 0..16)) {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("config.json");
        std::fs::write(&p, mutate(config_text().as_bytes(), kind, pos, &bytes)).unwrap();
        check(LlamaConfig::from_file(&p));
    }
}

// ------------------------------------------------------------------------------------------------
// safetensors headers

fn safetensors_bytes() -> &'static [u8] {
    static B: OnceLock<Vec<u8>> = OnceLock::new();
    B.get_or_init(|| std::fs::read(root().join("tests/golden/adamw/model/model.safetensors")).unwrap())
}

fn read_st(bytes: &[u8]) -> anyhow::Result<usize> {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("model.safetensors");
    std::fs::write(&p, bytes).unwrap();
    let t = harpe::model::weights::read_safetensors(&p, candle_core::DType::F32, &candle_core::Device::Cpu)?;
    Ok(t.len())
}

#[test]
fn safetensors_header_claiming_2_pow_60_bytes_is_refused() {
    // A header length of 2^60 bytes.
    let mut b = (1u64 << 60).to_le_bytes().to_vec();
    b.extend_from_slice(b"{}");
    let e = read_st(&b).unwrap_err();
    assert!(format!("{e:#}").contains("not a valid safetensors file"), "{e:#}");
    // A tensor whose offsets and shape claim 2^60 bytes of a 16-byte file.
    let header = r#"{"w":{"dtype":"F32","shape":[268435456,1073741824],"data_offsets":[0,1152921504606846976]}}"#;
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(&[0u8; 16]);
    let e = read_st(&b).unwrap_err();
    assert!(format!("{e:#}").contains("hint:"), "{e:#}");
    // The real file reads.
    assert!(read_st(safetensors_bytes()).unwrap() > 5);
}

proptest! {
    #![proptest_config(cfg(CASES))]
    #[test]
    fn safetensors_mutations_never_panic(kind in any::<u8>(), pos in 0usize..4096, bytes in prop::collection::vec(any::<u8>(), 1..16)) {
        // Mutate mostly the 8-byte length and the JSON header (the first few hundred bytes).
        let b = safetensors_bytes();
        let hlen = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let cut = &b[..(8 + hlen + 64).min(b.len())];
        let mut m = mutate(cut, kind, pos, &bytes);
        m.extend_from_slice(&b[cut.len()..]);
        check(read_st(&m));
    }

    #[test]
    fn safetensors_header_values_never_panic(k in 0usize..48, new in nasty_json()) {
        let b = safetensors_bytes();
        let hlen = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let header = std::str::from_utf8(&b[8..8 + hlen]).unwrap();
        let h = with_replaced(header.trim_end(), k, &new);
        let mut m = (h.len() as u64).to_le_bytes().to_vec();
        m.extend_from_slice(h.as_bytes());
        m.extend_from_slice(&b[8 + hlen..]);
        check(read_st(&m));
    }
}

// ------------------------------------------------------------------------------------------------
// dataset manifest and shards

/// A small prepared dataset (made once with the CLI).
fn dataset() -> &'static Path {
    static D: OnceLock<tempfile::TempDir> = OnceLock::new();
    D.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let input = tmp.path().join("in.txt");
        std::fs::write(&input, "the time of the state was one of the first and the most new state . ".repeat(8))
            .unwrap();
        let o = harpe_cmd()
            .args(["prepare-data", "--quiet", "--seq-len", "8", "--strategy", "original", "--tokenizer"])
            .arg(root().join("tests/golden/tokenizer.json"))
            .arg("--input")
            .arg(&input)
            .arg("--out")
            .arg(tmp.path().join("ds"))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        tmp
    })
    .path()
}

fn copy_dataset(to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(dataset().join("ds")).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

fn open_loader(dir: &Path) -> anyhow::Result<usize> {
    let m = Manifest::load(dir)?;
    let cfg = LoaderConfig { seq_len: m.seq_len, shuffle: true, seed: 1, rank: 0, world_size: 1 };
    let _ = Loader::open(dir, cfg)?;
    Ok(m.shards.len())
}

#[test]
fn prepared_dataset_opens() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dataset(tmp.path());
    assert!(open_loader(tmp.path()).unwrap() >= 1);
}

proptest! {
    #![proptest_config(cfg(CASES))]
    #[test]
    fn manifest_values_never_panic(k in 0usize..96, new in nasty_json()) {
        let tmp = tempfile::tempdir().unwrap();
        copy_dataset(tmp.path());
        let p = tmp.path().join("manifest.json");
        let text = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, with_replaced(&text, k, &new)).unwrap();
        check(open_loader(tmp.path()));
    }

    #[test]
    fn manifest_and_shard_bytes_never_panic(file in 0usize..8, kind in any::<u8>(), pos in any::<usize>(), bytes in prop::collection::vec(any::<u8>(), 1..12)) {
        let tmp = tempfile::tempdir().unwrap();
        copy_dataset(tmp.path());
        let mut files: Vec<PathBuf> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().path()).collect();
        files.sort();
        let p = &files[file % files.len()];
        let b = std::fs::read(p).unwrap();
        std::fs::write(p, mutate(&b, kind, pos, &bytes)).unwrap();
        check(open_loader(tmp.path()));
    }
}

// ------------------------------------------------------------------------------------------------
// run TOML (and --set overrides)

fn recipe() -> &'static str {
    static T: OnceLock<String> = OnceLock::new();
    T.get_or_init(|| std::fs::read_to_string(root().join("configs/tiny-cpu.toml")).unwrap())
}

/// TOML values at the edges of every type a recipe key may have.
const NASTY_TOML: [&str; 12] = [
    "0",
    "-1",
    "18446744073709551615",
    "9223372036854775807",
    "1e308",
    "nan",
    "inf",
    "-0.0",
    "\"\"",
    "[]",
    "{}",
    "true",
];

fn nasty_toml_value() -> impl Strategy<Value = String> {
    // each edge value as likely as a random integer or a random float
    prop_oneof![
        NASTY_TOML.len() as u32 => prop::sample::select(&NASTY_TOML[..]).prop_map(String::from),
        1 => any::<i64>().prop_map(|x| x.to_string()),
        1 => any::<f64>().prop_map(|x| format!("{x:e}")),
    ]
}

proptest! {
    #![proptest_config(cfg(CASES))]
    #[test]
    fn run_toml_values_never_panic(line in 0usize..80, value in nasty_toml_value()) {
        // Replace the value of the line-th `key = value` line of the shipped recipe.
        let lines: Vec<&str> = recipe().lines().collect();
        let keyed: Vec<usize> = (0..lines.len()).filter(|&i| lines[i].contains(" = ")).collect();
        let i = keyed[line % keyed.len()];
        let key = lines[i].split(" = ").next().unwrap();
        let text: String = lines
            .iter()
            .enumerate()
            .map(|(j, l)| if j == i { format!("{key} = {value}\n") } else { format!("{l}\n") })
            .collect();
        check(RunConfig::from_text(&text, "run.toml", &[]));
    }

    #[test]
    fn run_toml_bytes_and_overrides_never_panic(kind in any::<u8>(), pos in any::<usize>(), bytes in prop::collection::vec(any::<u8>(), 1..12), set in "[a-z_.0-9]{1,24}=[a-z0-9.\\[\\]\"-]{0,12}") {
        let m = mutate(recipe().as_bytes(), kind, pos, &bytes);
        check(RunConfig::from_text(&String::from_utf8_lossy(&m), "run.toml", &[]));
        check(RunConfig::from_text(recipe(), "run.toml", &[set]));
    }
}

// ------------------------------------------------------------------------------------------------
// jsonl records (prepare-data) and RULER data files (eval-niah)

fn record_json() -> impl Strategy<Value = String> {
    let leaf = nasty_json();
    let v = leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("text".to_string()),
                    Just("meta".to_string()),
                    Just("redpajama_set_name".to_string()),
                    "[a-z]{1,4}"
                ],
                inner,
                0..4
            )
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    });
    prop_oneof![v.prop_map(|v| v.to_string()), ".{0,40}"]
}

proptest! {
    #![proptest_config(cfg(CASES))]
    #[test]
    fn jsonl_records_never_panic(line in record_json(), raw in prop::collection::vec(any::<u8>(), 0..24)) {
        let fields = Fields::new("text", "meta.redpajama_set_name", None, None);
        let _ = parse_record(Raw::Line { line: 3, bytes: line.into_bytes() }, &fields);
        let fields = Fields::new("a.b.c", "meta", Some("web".into()), None);
        if let Err((l, msg)) = parse_record(Raw::Line { line: 4, bytes: raw }, &fields) {
            prop_assert_eq!(l, 4);
            prop_assert!(!msg.is_empty());
        }
    }

    #[test]
    fn ruler_lines_never_panic(line in record_json(), input in ".{0,20}", outs in prop::collection::vec(nasty_json(), 0..3)) {
        let p = Path::new("niah_single_1/validation.jsonl");
        check(parse_data_line(&line, 7, p));
        let l = serde_json::json!({"index": outs.first().cloned(), "input": input, "outputs": outs, "length": outs.get(1).cloned()});
        check(parse_data_line(&l.to_string(), 8, p));
    }
}

// ------------------------------------------------------------------------------------------------
// eval-tasks records: every value of a real record of each task replaced by nasty JSON

fn task_record(task: &str) -> (harpe::eval::tasks::TaskSpec, String) {
    let data = root().join("tests/fixtures/eval_tasks/data");
    let spec = harpe::eval::tasks::TaskSpec::new(task, &data).unwrap();
    let text = std::fs::read_to_string(spec.split_path(spec.eval_split)).unwrap();
    (spec, text.lines().next().unwrap().to_string())
}

proptest! {
    #![proptest_config(cfg(CASES))]
    #[test]
    fn eval_task_records_never_panic(t in 0usize..5, k in 0usize..40, new in nasty_json()) {
        let task = ["mmlu_anatomy", "hellaswag", "arc_challenge", "piqa", "triviaqa"][t];
        let (spec, line) = task_record(task);
        let value: serde_json::Value = serde_json::from_str(&with_replaced(&line, k, &new)).unwrap();
        let r = harpe::eval::tasks::data::Record { value, file: "x.jsonl".into(), line: 1, prefix: String::new() };
        check(spec.doc(&r));
        let s = harpe::eval::tasks::hellaswag_preprocess(&new.to_string());
        prop_assert!(s.len() <= new.to_string().len() + 1);
    }
}
