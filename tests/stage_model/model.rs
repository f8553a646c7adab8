//! Model-level behaviour: gradients reach every parameter, KV-cached decoding equals recomputation,
//! save/load round trips (sharded, bf16, transformers-4/5 configs), and clear errors on bad inputs.
use crate::common::ops::{max_abs_diff, rel_err};
use candle_core::{DType, Device, Tensor};
use harpe::eval::generate::{greedy_generate, GenerateOptions};
use harpe::model::config::LlamaConfig;
use harpe::model::llama::{KvCache, Tokens};
use harpe::model::rope::RopeScheme;
use harpe::model::testing::{tiny_config, tiny_model_dir, write_random_model_dir};
use harpe::model::weights::{init_random, save_model_dir};
use harpe::model::{load_model_dir, Llama};

fn tiny(rope: RopeScheme, tied: bool) -> Llama {
    let mut cfg = tiny_config(rope);
    cfg.tie_word_embeddings = tied;
    cfg.initializer_range = 0.2;
    let t = init_random(&cfg, 7, DType::F32, &Device::Cpu).unwrap();
    Llama::from_tensors(cfg, t.into_iter().collect(), "test").unwrap()
}

fn ids(b: usize, t: usize) -> Tensor {
    let v: Vec<u32> = (0..b * t).map(|i| ((i * 37 + 11) % 259) as u32).collect();
    Tensor::from_vec(v, (b, t), &Device::Cpu).unwrap()
}

#[test]
fn every_parameter_receives_a_nonzero_gradient() {
    for (rope, tied) in [
        (RopeScheme::Default { theta: 1e4 }, false),
        (RopeScheme::Harpe { head_bases: vec![1e4, 1e6], layer_head_bases: None }, true),
    ] {
        let (m, vars) = tiny(rope, tied).into_trainable().unwrap();
        let grads = m.loss_full(&ids(2, 12)).unwrap().backward().unwrap();
        let expected = harpe::model::llama::param_shapes(&m.cfg).len();
        assert_eq!(vars.len(), expected);
        for (name, v) in &vars {
            let g = grads.get(v.as_tensor()).unwrap_or_else(|| panic!("no gradient for {name}"));
            let n = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(n > 0.0 && n.is_finite(), "{name}: |g|^2 = {n}");
        }
    }
}

#[test]
fn kv_cached_decoding_equals_full_recomputation() {
    for rope in [
        RopeScheme::Harpe { head_bases: vec![1e4, 3e5], layer_head_bases: None },
        RopeScheme::Yarn {
            theta: 1e4,
            factor: 4.0,
            original_max: 16,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: None,
            mscale_all_dim: None,
            attention_factor: None,
            truncate: true,
        },
    ] {
        let m = tiny(rope, false);
        let x = ids(1, 23);
        let full = m.logits(&m.forward(&x, Tokens::At(0)).unwrap()).unwrap(); // (1, 23, V)
                                                                              // chunked prefill 10 + 10 + 3 single-token steps
        let mut cache = KvCache::new(m.cfg.num_hidden_layers);
        let mut parts = vec![];
        for (s, l) in [(0, 10), (10, 10), (20, 1), (21, 1), (22, 1)] {
            let h = m.forward(&x.narrow(1, s, l).unwrap(), Tokens::Cached(&mut cache)).unwrap();
            parts.push(m.logits(&h).unwrap());
        }
        let cached = Tensor::cat(&parts, 1).unwrap();
        let e = max_abs_diff(&full, &cached);
        assert!(e < 1e-4, "cached vs full logits differ by {e}");
    }
}

/// The inference layout (every projection column-major, `Llama::with_inference_layout`) keeps each
/// tensor's shape and the model's outputs: full-sequence logits, KV-cached steps and greedy tokens, for
/// an untied and a tied model (whose LM head stays the embedding).
#[test]
fn inference_layout_keeps_shapes_logits_and_generations() {
    for tied in [false, true] {
        let m = tiny(RopeScheme::Default { theta: 1e4 }, tied);
        let c = m.clone().with_inference_layout().unwrap();
        for ((name, a), (_, b)) in m.tensors().iter().zip(c.tensors().iter()) {
            assert_eq!(a.dims(), b.dims(), "{name}");
        }
        assert_eq!(c.layers[0].q_proj.stride(), &[1, c.layers[0].q_proj.dims()[0]][..], "q_proj not column-major");
        let x = ids(2, 19);
        let (la, lb) = (
            m.logits(&m.forward(&x, Tokens::At(0)).unwrap()).unwrap(),
            c.logits(&c.forward(&x, Tokens::At(0)).unwrap()).unwrap(),
        );
        let e = max_abs_diff(&la, &lb);
        assert!(e < 1e-4, "tied={tied}: logits differ by {e}");
        let prompt: Vec<u32> = (0..9).map(|i| (i * 29 % 250) as u32 + 3).collect();
        let opts = GenerateOptions { max_new_tokens: 12, stop_tokens: vec![], prefill_chunk: 4 };
        assert_eq!(
            greedy_generate(&m, &prompt, &opts).unwrap(),
            greedy_generate(&c, &prompt, &opts).unwrap(),
            "tied={tied}"
        );
    }
}

#[test]
fn greedy_generation_is_prefill_chunk_invariant_and_stops() {
    let m = tiny(RopeScheme::Default { theta: 1e4 }, false);
    let prompt: Vec<u32> = (0..17).map(|i| (i * 13 % 250) as u32 + 3).collect();
    let run = |chunk| {
        greedy_generate(&m, &prompt, &GenerateOptions { max_new_tokens: 8, stop_tokens: vec![], prefill_chunk: chunk })
            .unwrap()
    };
    let a = run(4);
    assert_eq!(a.len(), 8);
    assert_eq!(a, run(17));
    // the same tokens as argmax of full recomputation, step by step
    let mut seq = prompt.clone();
    for &tok in &a {
        let x = Tensor::new(seq.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let h = m.forward(&x, Tokens::At(0)).unwrap();
        let l = m.logits(&h.narrow(1, seq.len() - 1, 1).unwrap()).unwrap().flatten_all().unwrap();
        assert_eq!(l.argmax(0).unwrap().to_scalar::<u32>().unwrap(), tok);
        seq.push(tok);
    }
    let stopped =
        greedy_generate(&m, &prompt, &GenerateOptions { max_new_tokens: 8, stop_tokens: vec![a[2]], prefill_chunk: 5 })
            .unwrap();
    assert_eq!(stopped, a[..a.iter().position(|&t| t == a[2]).unwrap() + 1].to_vec());
}

#[test]
fn save_load_round_trip_sharded_bf16_and_harpe_config() {
    let dir = tempfile::tempdir().unwrap();
    let rope = RopeScheme::Harpe { head_bases: vec![1e6, 2.5e6], layer_head_bases: None };
    let m = tiny(rope.clone(), false);
    // shards of at most 40 KB -> several files + index
    save_model_dir(dir.path(), &m.cfg, &m.tensors(), 40_000).unwrap();
    assert!(dir.path().join("model.safetensors.index.json").exists());
    let n_shards = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".safetensors"))
        .count();
    assert!(n_shards > 2, "{n_shards} shards");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["rope_scaling"]["rope_type"], "harpe");
    assert_eq!(cfg["rope_scaling"]["head_bases"], serde_json::json!([1e6, 2.5e6]));
    let back = load_model_dir(dir.path(), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(back.cfg.rope, rope);
    for ((n, a), (_, b)) in m.tensors().iter().zip(back.tensors()) {
        let d = max_abs_diff(a, &b);
        assert_eq!(d, 0.0, "{n}");
    }
    // bf16 on disk, loaded as bf16 and as f32
    let dir2 = tempfile::tempdir().unwrap();
    let bf: Vec<(String, Tensor)> =
        m.tensors().into_iter().map(|(n, t)| (n, t.to_dtype(DType::BF16).unwrap())).collect();
    save_model_dir(dir2.path(), &m.cfg, &bf, usize::MAX).unwrap();
    assert!(dir2.path().join("model.safetensors").exists());
    let b16 = load_model_dir(dir2.path(), DType::BF16, &Device::Cpu).unwrap();
    assert_eq!(b16.dtype(), DType::BF16);
    let x = ids(1, 9);
    let l16 = b16.logits(&b16.forward(&x, Tokens::At(0)).unwrap()).unwrap().to_dtype(DType::F32).unwrap();
    let l32 = m.logits(&m.forward(&x, Tokens::At(0)).unwrap()).unwrap();
    let e = rel_err(&l16, &l32, 0.0);
    assert!(e < 0.05, "bf16 logits relative error {e}");
}

#[test]
fn config_forms_v4_and_v5_parse_to_the_same_scheme() {
    let v4 = serde_json::json!({"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}, "max_position_embeddings": 131072});
    let mut v5 = v4.clone();
    let o = v5.as_object_mut().unwrap();
    o.remove("rope_scaling");
    o.remove("rope_theta");
    o.insert("rope_parameters".into(), serde_json::json!({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "original_max_position_embeddings": 4096}));
    let a = LlamaConfig::from_json(&v4, "v4").unwrap();
    let b = LlamaConfig::from_json(&v5, "v5").unwrap();
    assert_eq!(a.rope, b.rope);
    assert_eq!(a.head_dim, 16);
    // what harpe writes reads back identically
    assert_eq!(LlamaConfig::from_json(&a.to_json(), "rt").unwrap(), a);
}

fn err_of(dir: &std::path::Path) -> String {
    format!("{:#}", load_model_dir(dir, DType::F32, &Device::Cpu).unwrap_err())
}

#[test]
fn bad_model_directories_get_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("m");
    tiny_model_dir(&d, RopeScheme::Default { theta: 1e4 }, 1).unwrap();
    load_model_dir(&d, DType::F32, &Device::Cpu).unwrap();
    let cfg_path = d.join("config.json");
    let good_cfg = std::fs::read_to_string(&cfg_path).unwrap();

    std::fs::write(&cfg_path, "{\n  \"vocab_size\": 259,\n  oops\n}").unwrap();
    let e = err_of(&d);
    assert!(e.contains("config.json") && e.contains("line 3") && e.contains("hint:"), "{e}");

    let mut v: serde_json::Value = serde_json::from_str(&good_cfg).unwrap();
    v["rope_scaling"] = serde_json::json!({"rope_type": "magic", "factor": 2.0});
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    let e = err_of(&d);
    assert!(e.contains("rope_type") && e.contains("magic") && e.contains("hint:"), "{e}");

    v["rope_scaling"] = serde_json::json!({"rope_type": "harpe", "head_bases": [1e4, 2e4, 3e4]});
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    let e = err_of(&d);
    assert!(e.contains("3 bases") && e.contains("kv heads"), "{e}");

    v["rope_scaling"] = serde_json::Value::Null;
    v["hidden_size"] = serde_json::json!(32);
    v["head_dim"] = serde_json::json!(8);
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    let e = err_of(&d);
    assert!(e.contains("model.embed_tokens.weight") && e.contains("shape") && e.contains("hint:"), "{e}");

    let mut v: serde_json::Value = serde_json::from_str(&good_cfg).unwrap();
    v.as_object_mut().unwrap().remove("num_hidden_layers");
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    assert!(err_of(&d).contains("num_hidden_layers"));

    std::fs::write(&cfg_path, &good_cfg).unwrap();
    let st = d.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    let e = err_of(&d);
    assert!(e.contains("model.safetensors") && e.contains("truncated"), "{e}");
    std::fs::remove_file(&st).unwrap();
    let e = err_of(&d);
    assert!(e.contains("no model.safetensors"), "{e}");
    std::fs::remove_file(&cfg_path).unwrap();
    assert!(err_of(&d).contains("config.json"));

    // sharded: a missing shard is named
    let d2 = tmp.path().join("sharded");
    let cfg = tiny_config(RopeScheme::Default { theta: 1e4 });
    let t = init_random(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    save_model_dir(&d2, &cfg, &t, 60_000).unwrap();
    let mut shards: Vec<String> = std::fs::read_dir(&d2)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with("model-") && n.ends_with(".safetensors"))
        .collect();
    shards.sort();
    assert!(shards.len() >= 2, "{shards:?}");
    std::fs::remove_file(d2.join(&shards[1])).unwrap();
    let e = err_of(&d2);
    assert!(e.contains(&shards[1]) && e.contains("missing") && e.contains("hint:"), "{e}");
    // an unknown tensor is refused
    let d3 = tmp.path().join("extra");
    let mut t = init_random(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    t.push(("model.layers.0.self_attn.q_proj.bias".into(), Tensor::zeros(64, DType::F32, &Device::Cpu).unwrap()));
    save_model_dir(&d3, &cfg, &t, usize::MAX).unwrap();
    assert!(err_of(&d3).contains("unexpected tensor"));
    // random model dir writes a tokenizer that round-trips text
    let d4 = tmp.path().join("tok");
    write_random_model_dir(&d4, &cfg, 1).unwrap();
    let tok = harpe::data::tokenize::load_tokenizer(&d4).unwrap();
    let enc = tok.encode("héllo 7", true).unwrap();
    assert_eq!(enc.get_ids()[0], 1);
    assert_eq!(tok.decode(&enc.get_ids()[1..], false).unwrap(), "héllo 7");
}

#[test]
fn attention_seam_blocked_reference_gives_the_same_loss_and_gradients() {
    use harpe::model::attention::AttentionImpl;
    let rope = RopeScheme::Harpe { head_bases: vec![1e4, 1e6], layer_head_bases: None };
    let (op, vars) = tiny(rope, false).into_trainable().unwrap();
    let blocked = op.clone().with_attention(AttentionImpl::Blocked { block: 5 });
    let x = ids(2, 12);
    let (la, lb) = (op.loss_full(&x).unwrap(), blocked.loss_full(&x).unwrap());
    let (a, b) = (la.to_scalar::<f32>().unwrap(), lb.to_scalar::<f32>().unwrap());
    assert!((a - b).abs() < 1e-5, "loss {a} vs {b}");
    let (ga, gb) = (la.backward().unwrap(), lb.backward().unwrap());
    for (name, v) in &vars {
        let e = max_abs_diff(ga.get(v.as_tensor()).unwrap(), gb.get(v.as_tensor()).unwrap());
        assert!(e < 1e-4, "{name}: gradients differ by {e}");
    }
}
