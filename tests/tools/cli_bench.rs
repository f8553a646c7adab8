//! `harpe bench model` on the CPU at tiny sizes: it lists the decoder-layer and training-step rows in
//! the table and in `--json`, each with a positive time and throughput (no thresholds: times vary), and
//! `--model-rows` runs only the rows it names.
use crate::common::harpe_cmd;

fn bench(extra: &[&str]) -> String {
    let o = harpe_cmd()
        .args(["bench", "model", "--device", "cpu", "--iters", "1", "--hidden", "32", "--heads", "2"])
        .args(["--model-tokens", "24"])
        .args(extra)
        .output()
        .unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "harpe bench model failed: {out}\n{err}");
    out.to_string()
}

#[test]
fn bench_model_lists_and_runs_the_layer_and_step_rows() {
    let j: serde_json::Value = serde_json::from_str(&bench(&["--json"])).unwrap();
    let rows = j["rows"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["kernel"].as_str().unwrap()).collect();
    assert_eq!(names, ["decoder layer fwd+bwd", "train step"]);
    for r in rows {
        for k in ["ms", "gb_per_s", "tflops"] {
            assert!(r[k].as_f64().unwrap() > 0.0, "{k} of {r}");
        }
    }
    assert!(rows[0]["shape"].as_str().unwrap().contains("C32 H2"), "{}", rows[0]);
    assert!(rows[1]["shape"].as_str().unwrap().contains("T24"), "{}", rows[1]);
    assert!(j["copy_gb_per_s"].as_f64().unwrap() > 0.0);
    let table = bench(&["--step-layers", "1"]);
    assert!(table.contains("TFLOP/s"), "{table}");
    for name in ["decoder layer fwd+bwd", "train step"] {
        assert!(table.lines().any(|l| l.starts_with(name)), "no {name} row in:\n{table}");
    }
    assert!(table.contains("L1 C32"), "{table}");
    // --model-rows picks the rows (gpu-check times the 7B step apart); --step-iters times that many steps
    let names = |extra: &[&str]| -> Vec<String> {
        let j: serde_json::Value = serde_json::from_str(&bench(&[&["--json"], extra].concat())).unwrap();
        j["rows"].as_array().unwrap().iter().map(|r| r["kernel"].as_str().unwrap().to_string()).collect()
    };
    assert_eq!(names(&["--model-rows", "step", "--step-iters", "2"]), ["train step"]);
    assert_eq!(names(&["--model-rows", "layer"]), ["decoder layer fwd+bwd"]);
    let o = harpe_cmd().args(["bench", "model", "--model-rows", "steps"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("steps") && err.contains("layer"), "{err}");
}

/// `harpe bench comms` without a launcher: thread ranks on host memory, every collective and size a row
/// with a positive time and bus bandwidth; bad sizes are refused with a hint.
#[test]
fn bench_comms_times_every_collective_over_thread_ranks() {
    let run = |extra: &[&str]| {
        harpe_cmd().args(["bench", "comms", "--ranks", "3", "--comm-seconds", "0.02"]).args(extra).output().unwrap()
    };
    let o = run(&["--comm-mib", "0.01,0.25", "--json"]);
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{out}\n{err}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let ops: Vec<&str> = rows.iter().map(|r| r["op"].as_str().unwrap()).collect();
    assert_eq!(ops, ["all_reduce", "all_gather", "reduce_scatter"].repeat(2));
    for r in &rows {
        assert_eq!(r["ranks"], 3);
        assert!(r["ms"].as_f64().unwrap() > 0.0 && r["busbw"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert_eq!(rows[3]["bytes"], 262_140, "0.25 MiB rounded down to whole f32 per rank");
    let o = run(&["--comm-mib", "0"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--comm-mib 0") && err.contains("hint:"), "{err}");
}

#[test]
fn bench_attention_profiles_the_emulated_kernels_as_json() {
    let o = harpe_cmd().args(["bench", "attention", "--target", "emulated", "--profile", "--json"]).output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "harpe bench attention --target emulated failed: {out}\n{err}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["kernel"].as_str().unwrap()).collect();
    assert!(names.contains(&"attn_fwd_tc_bf16_d128") && names.contains(&"attn_bwd_tc_bf16_d64"), "{names:?}");
    for r in &rows {
        for k in ["global_sectors", "useful_bytes", "sector_efficiency", "bank_conflicts", "barriers", "atomics", "mma"]
        {
            assert!(r[k].is_number(), "{k} of {r}");
        }
        assert!(r["shape"].as_str().unwrap().contains("T256"), "{r}");
    }
    // the main kernels run mma and move memory; the backward adds dQ atomically, the forward does not
    let row = |n: &str| rows.iter().find(|r| r["kernel"] == n).unwrap();
    let (f, b) = (row("attn_fwd_tc_bf16_d128"), row("attn_bwd_tc_bf16_d128"));
    assert!(f["mma"].as_u64().unwrap() > 0 && f["global_sectors"].as_u64().unwrap() > 0, "{f}");
    assert_eq!(f["atomics"].as_u64(), Some(0), "{f}");
    assert!(b["atomics"].as_u64().unwrap() > 0, "{b}");
    assert!(f["predicted_tflops"]["h100"].as_f64().unwrap() > f["predicted_tflops"]["a100"].as_f64().unwrap(), "{f}");
    // without --profile it says what to add
    let o = harpe_cmd().args(["bench", "attention", "--target", "emulated"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--profile") && err.contains("hint:"), "{err}");
}
