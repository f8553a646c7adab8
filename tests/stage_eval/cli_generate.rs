//! `harpe generate` as a user runs it: the JSON line's tokens equal `greedy_generate` in process, on the
//! GEMM attention (the CPU default) and on the reference loops alike; a bad `--prompt-ids` (unparsable, or
//! past the vocabulary) is an error with a hint.
use crate::common::harpe;
use harpe::eval::generate::{greedy_generate, GenerateOptions};
use harpe::eval::ppl::ScoringModel;
use harpe::model::attention::AttentionImpl;
use harpe::model::rope::RopeScheme;
use harpe::model::testing::tiny_model_dir;

#[test]
fn generate_prints_the_greedy_tokens_of_the_library() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model_dir(dir.path(), RopeScheme::Default { theta: 10000.0 }, 7).unwrap();
    let (ok, out, err) = harpe(&[
        "generate",
        "--model",
        dir.path().to_str().unwrap(),
        "--prompt-ids",
        "1,2,3,40,41",
        "--max-new-tokens",
        "9",
        "--prefill-chunk",
        "2",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let cli: Vec<u32> = v["new_tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    assert_eq!(cli.len(), 9, "exactly --max-new-tokens tokens: {out}");
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0);
    let model = ScoringModel::new(dir.path()).load().unwrap();
    let opts = GenerateOptions { max_new_tokens: 9, stop_tokens: vec![], prefill_chunk: 2 };
    let prompt = [1, 2, 3, 40, 41];
    assert_eq!(greedy_generate(&model, &prompt, &opts).unwrap(), cli);
    let reference = model.with_attention(AttentionImpl::CpuReference);
    assert_eq!(greedy_generate(&reference, &prompt, &opts).unwrap(), cli, "reference loops decode the same");
}

#[test]
fn bad_prompt_ids_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model_dir(dir.path(), RopeScheme::Default { theta: 10000.0 }, 7).unwrap();
    let (ok, _, err) = harpe(&["generate", "--model", dir.path().to_str().unwrap(), "--prompt-ids", "1,x"]);
    assert!(!ok);
    assert!(err.contains("--prompt-ids `1,x`") && err.contains("hint:"), "{err}");
    // an id past the model's vocabulary: refused on the host (on CUDA the embedding would read out of
    // bounds), naming the position and the id
    let (ok, _, err) = harpe(&["generate", "--model", dir.path().to_str().unwrap(), "--prompt-ids", "1,2,999999"]);
    assert!(!ok);
    assert!(err.contains("token 2 is id 999999, outside the model's vocabulary") && err.contains("hint:"), "{err}");
}
