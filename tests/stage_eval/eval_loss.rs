//! `harpe eval-loss`: loss by source and position bucket on a prepared dataset, cross-checked against
//! the model's full cross-entropy, and the tokenizer-mismatch refusal.
use candle_core::{DType, Device, Tensor};
use harpe::data::{prepare_from_texts, PrepareOptions};
use harpe::eval::eval_loss::{evaluate, EvalLossArgs};
use harpe::eval::ppl::ScoringModel;
use harpe::model::rope::RopeScheme;
use harpe::model::testing::tiny_model_dir;

fn args(model: &std::path::Path, data: &std::path::Path) -> EvalLossArgs {
    EvalLossArgs {
        scoring: ScoringModel { loss_chunk: 7, ..ScoringModel::new(model) },
        data: data.to_path_buf(),
        buckets: vec![16, 32],
        max_sequences: None,
        allow_tokenizer_mismatch: false,
        json: false,
    }
}

#[test]
fn loss_by_source_and_bucket() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model_dir(&model, RopeScheme::Harpe { head_bases: vec![1e4, 1e5], layer_head_bases: None }, 3).unwrap();
    let texts: Vec<(String, String)> = (0..6)
        .map(|i| {
            (
                if i % 2 == 0 { "books" } else { "code" }.to_string(),
                format!("document {i}: {}", "lorem ipsum ".repeat(5 + i)),
            )
        })
        .collect();
    let mut opts = PrepareOptions::new(64);
    opts.quiet = true;
    let data = tmp.path().join("data");
    prepare_from_texts(&texts, &model.join("tokenizer.json"), &opts, &data).unwrap();
    let rep = evaluate(&args(&model, &data)).unwrap();
    assert!(rep.sequences >= 2);
    assert_eq!(rep.total.tokens, rep.sequences as u64 * 63);
    assert_eq!(rep.by_bucket["0-16"].tokens, rep.sequences as u64 * 15);
    assert_eq!(rep.by_bucket["16-32"].tokens, rep.sequences as u64 * 16);
    assert_eq!(rep.by_bucket["32+"].tokens, rep.sequences as u64 * 32);
    assert_eq!(rep.by_source.keys().cloned().collect::<Vec<_>>(), vec!["books", "code"]);
    let src_tokens: u64 = rep.by_source.values().map(|c| c.tokens).sum();
    assert_eq!(src_tokens, rep.total.tokens);
    let weighted: f64 = rep.by_source.values().map(|c| c.loss * c.tokens as f64).sum::<f64>() / src_tokens as f64;
    assert!((weighted - rep.total.loss).abs() < 1e-9);
    // the total equals the model's own full cross-entropy over the same sequences
    let m = harpe::model::load_model_dir(&model, DType::F32, &Device::Cpu).unwrap();
    let loader = harpe::data::Loader::open(
        &data,
        harpe::data::LoaderConfig { seq_len: 64, shuffle: false, seed: 0, rank: 0, world_size: 1 },
    )
    .unwrap();
    let rows: Vec<u32> = (0..rep.sequences as u64).flat_map(|g| loader.get(g).unwrap().tokens).collect();
    let ids = Tensor::from_vec(rows, (rep.sequences, 64), &Device::Cpu).unwrap();
    let full = m.loss_full(&ids).unwrap().to_scalar::<f32>().unwrap() as f64;
    assert!((full - rep.total.loss).abs() < 1e-4, "{full} vs {}", rep.total.loss);
}

#[test]
fn a_dataset_from_another_tokenizer_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model_dir(&model, RopeScheme::Default { theta: 1e4 }, 3).unwrap();
    let other = tmp.path().join("other.json");
    let mut tok = harpe::model::testing::byte_tokenizer_json();
    tok.push(' '); // same tokenizer, other bytes: another sha256
    std::fs::write(&other, tok).unwrap();
    let mut opts = PrepareOptions::new(32);
    opts.quiet = true;
    let data = tmp.path().join("data");
    prepare_from_texts(&[("web".into(), "hello world ".repeat(20))], &other, &opts, &data).unwrap();
    let e = format!("{:#}", evaluate(&args(&model, &data)).unwrap_err());
    assert!(e.contains("another tokenizer") && e.contains("hint:"), "{e}");
    let mut a = args(&model, &data);
    a.allow_tokenizer_mismatch = true;
    a.buckets = vec![8, 8];
    assert!(format!("{:#}", evaluate(&a).unwrap_err()).contains("ascending"));
    a.buckets = vec![8];
    assert_eq!(evaluate(&a).unwrap().total.tokens, 31 * evaluate(&a).unwrap().sequences as u64);
}
