//! The eval commands on SmolLM2-135M against transformers: eval-ppl's sliding-window NLL of a text the tests
//! ship; eval-niah's passkey at 1K-4K, whose prompts encode to transformers' ids under RULER's rule (the
//! tokenizer's own encoding: no BOS for this tokenizer) and whose answers equal transformers' greedy ones on
//! those ids; eval-tasks runs on it.
use crate::common::harpe;
use crate::{golden, model, root};
use harpe::data::tokenize::PromptBos;
use sha2::Digest;

fn ids_sha(ids: &[u32]) -> String {
    let bytes: Vec<u8> = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
    hex::encode(sha2::Sha256::digest(&bytes))
}

#[test]
fn eval_ppl_equals_transformers() {
    let Some(dir) = model() else { return };
    let want = golden("ppl.json");
    let text = root().join(want["input"].as_str().unwrap());
    for w in want["windows"].as_array().unwrap() {
        let (window, stride) = (w["window"].as_u64().unwrap().to_string(), w["stride"].as_u64().unwrap().to_string());
        let args = ["eval-ppl", "--model", &dir.display().to_string(), "--input", &text.display().to_string()];
        let (ok, stdout, stderr) = harpe(&[&args[..], &["--window", &window, "--stride", &stride, "--json"]].concat());
        assert!(ok, "{stderr}");
        let got: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(got["tokens"].as_u64(), w["scored"].as_u64(), "window {window}: scored tokens");
        let (nll, want_nll) = (got["nll"].as_f64().unwrap(), w["nll"].as_f64().unwrap());
        eprintln!("eval-ppl window {window} stride {stride}: nll {nll:.6} (transformers {want_nll:.6})");
        assert!((nll - want_nll).abs() < 1e-4, "window {window}: nll {nll} vs transformers {want_nll}");
        // a pretrained model, not a random one: far below ln(49152) = 10.8
        assert!(nll < 0.5 * 49152f64.ln(), "nll {nll}");
    }
}

#[test]
fn passkey_prompts_and_answers_equal_transformers() {
    let Some(dir) = model() else { return };
    let want = golden("passkey.json");
    let cases = want["cases"].as_array().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("niah");
    let t0 = std::time::Instant::now();
    let args = ["eval-niah", "--model", &dir.display().to_string(), "--out", &out.display().to_string()];
    let run = ["--tasks", "passkey", "--lengths", "1024,2048,4096", "--samples", "2", "--passkey-depths", "2"];
    let (ok, _, stderr) = harpe(&[&args[..], &run].concat());
    assert!(ok, "{stderr}");
    eprintln!("eval-niah passkey 1K-4K, 2 samples each: {:.0}s", t0.elapsed().as_secs_f64());
    let res: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let tok = harpe::data::tokenize::load_tokenizer(&dir.join("tokenizer.json")).unwrap();
    let bos = Some(1);
    let mut checked = 0;
    let mut differ = 0;
    for cell in res["cells"].as_array().unwrap() {
        let length = cell["length"].as_u64().unwrap();
        let data = out.join(format!("{length}/data/passkey/validation.jsonl"));
        let prompts: Vec<String> = std::fs::read_to_string(&data)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["input"].as_str().unwrap().to_string())
            .collect();
        for s in cell["samples"].as_array().unwrap() {
            let line = s["line"].as_u64().unwrap();
            let c = cases.iter().find(|c| c["length"] == length && c["line"] == line).unwrap();
            let prompt = &prompts[line as usize];
            let at = format!("passkey @ {length} line {line}");
            assert_eq!(
                hex::encode(sha2::Sha256::digest(prompt.as_bytes())),
                c["prompt_sha256"].as_str().unwrap(),
                "{at}: prompt"
            );
            let auto = PromptBos::Auto.encode(&tok, prompt, bos).unwrap();
            assert_eq!(ids_sha(&auto), c["auto"]["ids_sha256"].as_str().unwrap(), "{at}: ids under RULER's rule");
            assert_ne!(auto.first(), Some(&1), "{at}: no BOS for this tokenizer");
            let always = PromptBos::Always.encode(&tok, prompt, bos).unwrap();
            assert_eq!(ids_sha(&always), c["always"]["ids_sha256"].as_str().unwrap(), "{at}: ids with BOS prepended");
            assert_eq!(s["pred"].as_str().unwrap(), c["auto"]["text"].as_str().unwrap(), "{at}: answer");
            let score =
                harpe::eval::passkey::passkey_score(c["auto"]["text"].as_str().unwrap(), c["key"].as_str().unwrap());
            assert_eq!(s["score"].as_f64().unwrap(), score, "{at}: score");
            differ += usize::from(c["auto"]["text"] != c["always"]["text"]);
            checked += 1;
        }
    }
    assert_eq!(checked, cases.len());
    eprintln!("{checked} passkey answers equal transformers'; {differ} of them differ when BOS is prepended");
}

#[test]
fn eval_tasks_runs_on_the_real_model() {
    let Some(dir) = model() else { return };
    let data = root().join("tests/fixtures/eval_tasks/data");
    let args = ["eval-tasks", "--model", &dir.display().to_string(), "--data", &data.display().to_string()];
    let (ok, stdout, stderr) =
        harpe(&[&args[..], &["--tasks", "arc_challenge,piqa", "--limit", "4", "--json"]].concat());
    assert!(ok, "{stderr}");
    let r: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    for task in ["arc_challenge", "piqa"] {
        let acc = r["results"][task]["acc,none"].as_f64().unwrap_or_else(|| panic!("{task}: {r}"));
        assert!((0.0..=1.0).contains(&acc), "{task}: acc {acc}");
    }
}
