//! One device chooser: `--device` on eval-ppl / eval-loss / eval-niah and `train.device` parse `cpu`,
//! `cuda`, `cuda:N`; asking for CUDA from a CPU build fails with the rebuild hint, naming the flag or
//! the config field; the one dtype enum refuses f16 for training.
use crate::common::harpe;
use harpe::config::RunConfig;
use harpe::device::DeviceSpec;

// the two tests that read it run in a CPU build only
#[cfg(not(feature = "cuda"))]
fn golden() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

const CFG: &str = r#"
[model.init]
vocab_size = 259
hidden_size = 16
intermediate_size = 32
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1

[data]
source = "builtin"

[train]
dtype = "f32"
device = "cuda:1"

[[stage]]
seq_len = 16
steps = 1
"#;

#[cfg(not(feature = "cuda"))]
#[test]
fn eval_commands_refuse_cuda_in_a_cpu_build_with_the_hint() {
    let model = golden().join("default/model");
    let text = golden().join("text.txt");
    let (m, t) = (model.to_str().unwrap(), text.to_str().unwrap());
    let (ok, _, err) =
        harpe(&["eval-ppl", "--model", m, "--input", t, "--window", "8", "--stride", "4", "--device", "cuda"]);
    assert!(!ok, "eval-ppl --device cuda succeeded in a CPU build");
    assert!(err.contains("--device = \"cuda\"") && err.contains("built without CUDA"), "{err}");
    assert!(err.contains("hint:") && err.contains("--features cuda") && err.contains("Build for GPUs"), "{err}");
    // the same flag on CPU runs (and is the default)
    let (ok, out, err) =
        harpe(&["eval-ppl", "--model", m, "--input", t, "--window", "8", "--stride", "4", "--device", "cpu", "--json"]);
    assert!(ok && out.contains("\"nll\""), "{err}");
    // a device that is not one
    let (ok, _, err) = harpe(&["eval-ppl", "--model", m, "--input", t, "--device", "gpu0"]);
    assert!(!ok && err.contains("gpu0") && err.contains("cpu, cuda or cuda:N"), "{err}");
}

#[test]
fn train_device_is_parsed_once_and_printed_back() {
    let r = RunConfig::from_text(CFG, "run.toml", &[]).unwrap();
    assert_eq!(r.cfg.train.device, DeviceSpec::Cuda(1));
    assert!(r.toml.contains("device = \"cuda:1\""), "{}", r.toml);
    let r = RunConfig::from_text(CFG, "run.toml", &["train.device=\"cpu\"".into()]).unwrap();
    assert_eq!(r.cfg.train.device, DeviceSpec::Cpu);
    let e = format!("{:#}", RunConfig::from_text(CFG, "run.toml", &["train.device=\"tpu\"".into()]).unwrap_err());
    assert!(e.contains("run.toml") && e.contains("unknown device `tpu`") && e.contains("hint:"), "{e}");
    let e = format!("{:#}", RunConfig::from_text(CFG, "run.toml", &["train.dtype=\"f16\"".into()]).unwrap_err());
    assert!(e.contains("train.dtype = \"f16\"") && e.contains("hint:"), "{e}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn train_with_cuda_in_a_cpu_build_fails_with_the_hint() {
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("run.toml");
    std::fs::write(&cfg, CFG).unwrap();
    let args = harpe::train::TrainArgs::new(&cfg, Some(&d.path().join("out")));
    let e = format!("{:#}", harpe::train::run(args).unwrap_err());
    assert!(e.contains("run.toml: train.device = \"cuda:1\""), "{e}");
    assert!(e.contains("hint: this harpe was built without CUDA: rebuild with --features cuda"), "{e}");
}
