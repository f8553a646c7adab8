//! Numerics against HF transformers: logits, loss, every parameter's gradient and sliding-window NLL,
//! from fixtures written by `scripts/make_golden.py` (tiny random Llama, GQA 4q/2kv heads).
use crate::common::ops::rel_err;
use candle_core::{DType, Device, Tensor};
use harpe::model::llama::Tokens;
use harpe::model::load_model_dir;
use std::path::PathBuf;

fn golden(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(case)
}

struct Case {
    ids: Tensor,
    fix: std::collections::HashMap<String, Tensor>,
    model: harpe::model::Llama,
}

fn load(case: &str) -> Case {
    let fix = candle_core::safetensors::load(golden(case).join("golden.safetensors"), &Device::Cpu).unwrap();
    let ids = fix["input_ids"].to_dtype(DType::U32).unwrap();
    let model = load_model_dir(&golden(case).join("model"), DType::F32, &Device::Cpu).unwrap();
    Case { ids, fix, model }
}

fn check_logits(case: &str) -> harpe::model::Llama {
    let c = load(case);
    let logits = c.model.logits(&c.model.forward(&c.ids, Tokens::At(0)).unwrap()).unwrap();
    let e = rel_err(&logits, &c.fix["logits"], 0.0);
    assert!(e < 1e-4, "{case}: logits rel err {e}");
    let loss = c.model.loss_full(&c.ids).unwrap();
    let e = rel_err(&loss.reshape(1).unwrap(), &c.fix["loss"], 0.0);
    assert!(e < 1e-5, "{case}: loss rel err {e}");
    c.model
}

fn check_grads(case: &str) {
    let c = load(case);
    let (model, vars) = c.model.into_trainable().unwrap();
    let loss = model.loss_full(&c.ids).unwrap();
    let grads = loss.backward().unwrap();
    let mut n = 0;
    for (name, var) in &vars {
        let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("{case}: no gradient for {name}"));
        let want = &c.fix[&format!("grad.{name}")];
        let e = rel_err(g, want, 0.0);
        assert!(e < 1e-4, "{case}: grad {name} rel err {e}");
        n += 1;
    }
    assert_eq!(n, c.fix.keys().filter(|k| k.starts_with("grad.")).count(), "{case}: every HF gradient compared");
}

#[test]
fn default_scheme_matches_transformers() {
    check_logits("default");
    check_grads("default");
}

#[test]
fn per_head_bases_match_patched_transformers() {
    let m = check_logits("harpe");
    assert_eq!(m.cfg.rope.name(), "harpe");
    check_grads("harpe");
    // The per-head bases matter: the same weights under one shared base give other logits.
    let c = load("harpe");
    let mut plain = c.model.clone();
    plain.cfg.rope = harpe::model::rope::RopeScheme::Default { theta: 10000.0 };
    let logits = plain.logits(&plain.forward(&c.ids, Tokens::At(0)).unwrap()).unwrap();
    assert!(rel_err(&logits, &c.fix["logits"], 0.0) > 1e-3);
}

#[test]
fn mha_tied_embeddings_with_per_head_bases_match() {
    let m = check_logits("harpe_mha_tied");
    assert!(m.cfg.tie_word_embeddings && m.cfg.num_key_value_heads == 4);
    check_grads("harpe_mha_tied");
}

#[test]
fn classic_schemes_match_transformers() {
    for case in ["linear", "dynamic", "yarn", "llama3", "longrope"] {
        check_logits(case);
    }
}

#[test]
fn eval_ppl_matches_transformers_sliding_windows() {
    let text = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/text.txt");
    for case in ["default", "harpe", "harpe_mha_tied", "linear", "dynamic", "yarn", "llama3", "longrope"] {
        let want: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(golden(case).join("ppl.json")).unwrap()).unwrap();
        let (w, s) = (want["window"].as_u64().unwrap() as usize, want["stride"].as_u64().unwrap() as usize);
        let got = harpe::eval::ppl::eval_file(&golden(case).join("model"), &text, w, s).unwrap();
        let nll = want["nll"].as_f64().unwrap();
        assert!((got.nll - nll).abs() < 1e-4, "{case}: nll {} vs transformers {nll}", got.nll);
        assert_eq!(got.tokens as u64, want["tokens"].as_u64().unwrap(), "{case}");
        assert_eq!(got.windows as u64, want["windows"].as_u64().unwrap(), "{case}");
        let wm = want["window_mean_nll"].as_f64().unwrap();
        assert!((got.window_mean_nll - wm).abs() < 1e-4, "{case}: window mean {} vs {wm}", got.window_mean_nll);
    }
}

#[test]
fn rope_parity_hf_reproduces_transformers_float32_angles() {
    // transformers computes RoPE angles in float32; at position 100000 they are off by ~1e-2 rad, so
    // only `--rope-parity hf` matches its logits tightly, and the f64 default measurably does not.
    let fix =
        candle_core::safetensors::load(golden("rope_parity_hf").join("golden.safetensors"), &Device::Cpu).unwrap();
    let ids = fix["input_ids"].to_dtype(DType::U32).unwrap();
    let start = fix["start"].to_vec1::<i64>().unwrap()[0] as usize;
    let mut model = load_model_dir(&golden("default").join("model"), DType::F32, &Device::Cpu).unwrap();
    let err = |m: &harpe::model::Llama| {
        rel_err(&m.logits(&m.forward(&ids, Tokens::At(start)).unwrap()).unwrap(), &fix["logits"], 0.0)
    };
    model.parity = harpe::model::rope::RopeParity::Hf;
    let hf = err(&model);
    model.parity = harpe::model::rope::RopeParity::F64;
    let f64_err = err(&model);
    assert!(hf < 1e-5, "--rope-parity hf: logits rel err {hf} vs transformers");
    assert!(f64_err > 20.0 * hf.max(1e-7), "f64 angles should differ from transformers' f32 ones: {f64_err} vs {hf}");
}

#[test]
fn eval_ppl_disjoint_windows_match_transformers_recipe() {
    // stride = window: transformers' documented recipe (labels shift inside each window).
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden("default").join("ppl_disjoint.json")).unwrap()).unwrap();
    let text = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/text.txt");
    let w = want["window"].as_u64().unwrap() as usize;
    assert_eq!(w, want["stride"].as_u64().unwrap() as usize);
    let got = harpe::eval::ppl::eval_file(&golden("default").join("model"), &text, w, w).unwrap();
    let nll = want["nll"].as_f64().unwrap();
    assert!((got.nll - nll).abs() < 1e-4, "nll {} vs transformers {nll}", got.nll);
    assert_eq!(got.tokens as u64, want["tokens"].as_u64().unwrap());
    assert_eq!(got.windows as u64, want["windows"].as_u64().unwrap());
}
