//! `harpe convert --from-gguf` on a tiny Llama GGUF written as llama.cpp's converter writes one
//! (tests/golden/gguf_tiny, scripts/make_gguf_golden.py --tiny): a SentencePiece vocabulary with scores and no
//! merges, weights in F32, F16, Q8_0, Q4_0, Q4_1 and Q5_0, Q and K permuted. Against transformers' GGUF loader:
//! the config, every tensor, the tokenizer's ids (BOS added by its post-processor) and decoding; the file's
//! model runs; a foreign architecture or tokenizer is an error naming its GGUF key.
use crate::common::harpe;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::{DType, Device};
use std::path::{Path, PathBuf};

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/gguf_tiny")
}

fn golden() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(tiny().join("golden.json")).unwrap()).unwrap()
}

fn convert(gguf: &Path, out: &Path) -> (bool, String, String) {
    harpe(&["convert", "--from-gguf", &gguf.display().to_string(), "--out", &out.display().to_string()])
}

#[test]
fn tiny_llama_gguf_converts_to_what_transformers_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("hf");
    let (ok, stdout, stderr) = convert(&tiny().join("tiny-llama.gguf"), &out);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("with BOS"), "{stdout}");
    let g = golden();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    for (k, v) in g["config"].as_object().unwrap() {
        assert_eq!(&cfg[k], v, "config.json `{k}`");
    }
    let got = harpe::model::weights::load_tensors(&out, DType::F32, &Device::Cpu).unwrap();
    let want = g["tensors"].as_object().unwrap();
    assert_eq!(got.len(), want.len());
    for (name, w) in want {
        let v = got[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let shape: Vec<usize> = w["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
        assert_eq!(got[name].dims(), shape.as_slice(), "{name}");
        for s in w["samples"].as_array().unwrap() {
            let i = s[0].as_u64().unwrap() as usize;
            assert_eq!(v[i] as f64, s[1].as_f64().unwrap(), "{name}[{i}]");
        }
        let sum: f64 = v.iter().map(|&x| x as f64).sum();
        assert!((sum - w["sum"].as_f64().unwrap()).abs() < 1e-9 * w["sum_abs"].as_f64().unwrap(), "{name}: sum");
    }
    let tok = harpe::data::tokenize::load_tokenizer(&out).unwrap();
    for c in g["tokenize"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
        };
        assert_eq!(tok.encode(text, true).unwrap().get_ids(), ids(&c["ids"]).as_slice(), "{text:?}");
        let plain = tok.encode(text, false).unwrap();
        assert_eq!(plain.get_ids(), ids(&c["ids_plain"]).as_slice(), "{text:?} without special tokens");
        assert_eq!(tok.decode(plain.get_ids(), false).unwrap(), c["decoded"].as_str().unwrap(), "{text:?} decoded");
    }
    // the converted directory is a model harpe runs
    let text = tmp.path().join("t.txt");
    std::fs::write(&text, "the keeper of the light").unwrap();
    let (ok, _, stderr) = harpe(&[
        "eval-ppl",
        "--model",
        &out.display().to_string(),
        "--input",
        &text.display().to_string(),
        "--window",
        "16",
        "--stride",
        "8",
    ]);
    assert!(ok, "{stderr}");
    // a second convert into the same directory needs --force; --dtype bf16 writes bf16 weights
    let (ok, _, stderr) = convert(&tiny().join("tiny-llama.gguf"), &out);
    assert!(!ok && stderr.contains("--force"), "{stderr}");
    let gguf = tiny().join("tiny-llama.gguf").display().to_string();
    let (ok, _, stderr) =
        harpe(&["convert", "--from-gguf", &gguf, "--out", &out.display().to_string(), "--force", "--dtype", "bf16"]);
    assert!(ok, "{stderr}");
    harpe::model::weights::visit_model_tensors(&out, &Device::Cpu, |name, t| {
        assert_eq!(t.dtype(), DType::BF16, "{name}");
        Ok(())
    })
    .unwrap();
}

/// The tiny file with metadata `key` set to `value` (candle's GGUF writer).
fn with_meta(dir: &Path, key: &str, value: Value) -> PathBuf {
    let src = tiny().join("tiny-llama.gguf");
    let mut f = std::fs::File::open(&src).unwrap();
    let c = gguf_file::Content::read(&mut f).unwrap();
    let mut names: Vec<&String> = c.tensor_infos.keys().collect();
    names.sort();
    let tensors: Vec<(String, candle_core::quantized::QTensor)> =
        names.iter().map(|n| ((*n).clone(), c.tensor(&mut f, n, &Device::Cpu).unwrap())).collect();
    let mut meta: Vec<(String, Value)> = c.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    meta.retain(|(k, _)| k != key);
    meta.push((key.to_string(), value));
    let out = dir.join(format!("{}.gguf", key.replace('.', "_")));
    let mut w = std::fs::File::create(&out).unwrap();
    let m: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t: Vec<(&str, &candle_core::quantized::QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut w, &m, &t).unwrap();
    out
}

#[test]
fn a_foreign_architecture_or_tokenizer_is_refused_naming_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    for (key, value, says) in [
        ("general.architecture", Value::String("gpt2".into()), "`general.architecture` is \"gpt2\""),
        ("tokenizer.ggml.model", Value::String("bert".into()), "`tokenizer.ggml.model` is \"bert\""),
        ("llama.expert_count", Value::U32(8), "`llama.expert_count`"),
    ] {
        let f = with_meta(tmp.path(), key, value);
        let (ok, _, stderr) = convert(&f, &tmp.path().join(format!("out-{key}")));
        assert!(!ok, "{key}");
        assert!(stderr.contains(says) && stderr.contains("hint:"), "{key}: {stderr}");
    }
}
