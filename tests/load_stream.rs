//! Loading a sharded bf16 checkpoint streams it: `visit_model_tensors` (the loader under `load_flat`,
//! `load_tensors` and `load_model_dir`) holds about one tensor of host memory at a time, whatever the
//! checkpoint's size (measured: resident-memory growth while visiting ~256 MB of shards), and
//! `load_flat` (training's initial weights) puts every tensor into its range of the flat state, host or
//! device variant, checked like `Llama::from_tensors`. One test per process-wide measurement: this file.
use candle_core::{DType, Device, Tensor};
use harpe::flatbuf::{FlatBuf, Placement};
use harpe::grads::flatten_params;
use harpe::model::config::LlamaConfig;
use harpe::model::llama::Llama;
use harpe::model::rope::RopeScheme;
use harpe::model::weights::{init_random, load_flat, load_tensors, save_model_dir, visit_model_tensors, TensorBytes};
use harpe::train::metrics::mem::rss_bytes;
use std::collections::{BTreeMap, HashMap};

/// `shards` files of `per_shard` bf16 tensors of `elems` values each, plus the HF index; written one
/// shard at a time so the writer's own memory stays small. Returns the total bytes of tensor data.
fn write_sharded(dir: &std::path::Path, shards: usize, per_shard: usize, elems: usize) -> usize {
    let mut map = BTreeMap::new();
    for s in 0..shards {
        let fname = format!("model-{:05}-of-{shards:05}.safetensors", s + 1);
        let views: Vec<(String, TensorBytes)> = (0..per_shard)
            .map(|i| {
                let k = s * per_shard + i;
                let t = Tensor::full(half::bf16::from_f32(k as f32), elems, &Device::Cpu).unwrap();
                (format!("t{k}"), TensorBytes::from_tensor(&t).unwrap())
            })
            .collect();
        let bytes = safetensors::tensor::serialize(views.iter().map(|(k, v)| (k.clone(), v)), None).unwrap();
        std::fs::write(dir.join(&fname), &bytes).unwrap();
        views.iter().for_each(|(k, _)| {
            map.insert(k.clone(), fname.clone());
        });
    }
    let index = serde_json::json!({"metadata": {"total_size": shards * per_shard * elems * 2}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    shards * per_shard * elems * 2
}

#[test]
fn a_sharded_checkpoint_streams_one_tensor_at_a_time() {
    let d = tempfile::tempdir().unwrap();
    // 4 shards x 8 tensors x 4 Mi bf16 values (8 MiB each) = 256 MiB
    let total = write_sharded(d.path(), 4, 8, 4 << 20);
    let base = rss_bytes();
    let (mut peak, mut count, mut sum) = (0u64, 0usize, 0f64);
    visit_model_tensors(d.path(), &Device::Cpu, |name, t| {
        assert_eq!(t.dtype(), DType::BF16, "{name} keeps the file's dtype");
        let k: f64 = name[1..].parse().unwrap();
        let first = t.get(0).unwrap().to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap() as f64;
        assert_eq!(first, k, "{name}");
        sum += first;
        count += 1;
        peak = peak.max(rss_bytes());
        Ok(())
    })
    .unwrap();
    assert_eq!((count, sum), (32, (0..32).sum::<usize>() as f64), "every tensor once");
    let grew = peak.saturating_sub(base);
    eprintln!(
        "streaming {} MiB of shards: resident memory grew by {:.1} MiB at most",
        total >> 20,
        grew as f64 / 1048576.0
    );
    assert!(grew < total as u64 / 8, "visiting {total} bytes of shards grew resident memory by {grew} bytes");
    // the measurement can see a checkpoint held whole: loading every tensor at once grows by ~its size
    let all = load_tensors(d.path(), DType::BF16, &Device::Cpu).unwrap();
    let held = rss_bytes().saturating_sub(base);
    assert_eq!(all.len(), 32);
    assert!(held > total as u64 * 3 / 4, "holding all {total} bytes grew resident memory by only {held}");
}

#[test]
fn load_flat_fills_every_parameter_on_either_placement_and_checks_names() {
    let d = tempfile::tempdir().unwrap();
    let mut cfg = LlamaConfig::tiny(67, RopeScheme::Default { theta: 10000.0 });
    cfg.tie_word_embeddings = false;
    let t = init_random(&cfg, 7, DType::BF16, &Device::Cpu).unwrap();
    save_model_dir(d.path(), &cfg, &t, 4096).unwrap(); // many shards
    assert!(d.path().join("model.safetensors.index.json").exists());
    let want = {
        let m = Llama::from_tensors(cfg.clone(), load_tensors(d.path(), DType::F32, &Device::Cpu).unwrap(), "x");
        flatten_params(&m.unwrap().tensors()).unwrap()
    };
    for p in [Placement::Host, Placement::Device(Device::Cpu)] {
        let (layout, flat) = load_flat(d.path(), &cfg, &p).unwrap();
        assert_eq!(matches!(flat, FlatBuf::Device(_)), matches!(p, Placement::Device(_)));
        assert_eq!(
            layout.params.iter().map(|q| q.range.clone()).collect::<Vec<_>>(),
            want.0.params.iter().map(|q| q.range.clone()).collect::<Vec<_>>()
        );
        assert_eq!(flat, want.1, "{p:?}");
    }
    // a tied config ignores the file's lm_head; a missing or misshapen tensor is named with a hint
    let mut tied = cfg.clone();
    tied.tie_word_embeddings = true;
    let (lt, ft) = load_flat(d.path(), &tied, &Placement::Host).unwrap();
    assert_eq!(ft.len(), want.1.len() - 67 * cfg.hidden_size);
    assert!(!lt.params.iter().any(|q| q.name == "lm_head.weight"));
    let mut t2: HashMap<String, Tensor> = t.into_iter().collect();
    t2.remove("model.layers.1.mlp.up_proj.weight");
    let e = tempfile::tempdir().unwrap();
    save_model_dir(e.path(), &cfg, &t2.into_iter().collect::<Vec<_>>(), 4096).unwrap();
    let err = format!("{:#}", load_flat(e.path(), &cfg, &Placement::Host).unwrap_err());
    assert!(
        err.contains("model.layers.1.mlp.up_proj.weight") && err.contains("missing") && err.contains("hint:"),
        "{err}"
    );
    let mut wide = cfg.clone();
    wide.intermediate_size += 1;
    let err = format!("{:#}", load_flat(d.path(), &wide, &Placement::Host).unwrap_err());
    assert!(err.contains("has shape") && err.contains("hint:"), "{err}");
}
