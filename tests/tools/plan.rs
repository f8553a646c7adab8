//! `harpe plan` reproduces the memory budget harpe was designed against (Llama-2-7B, 128K, 8 x 80 GB A100:
//! bf16 weights and gradients, fp32 master/m/v, one checkpoint per layer; below, "the design budget") for
//! the model state, counts the activations as candle's autograd keeps them (ZeRO-3 then needs Ulysses over
//! 2 GPUs at 128K), refuses bad worlds with the
//! nearest valid choice, and prints the same plan as JSON. Expected values are derived here from the
//! architecture, not read back from the plan.
use crate::common::harpe_cmd;
use harpe::config::ZeroStage;
use harpe::tools::plan::load_config;
use harpe::train::plan::{plan_for, AttnKernelKind, Gpu, GpuKind, Plan, World, FA2_A100_TFLOPS, HARPE_PEAK_FRACTION};
use harpe::util::parse_bytes;
use std::path::Path;

const MISSION: &str = "configs/harpe-128k.toml";
const LLAMA2_7B: &str = "model.path=configs/arch/llama-2-7b";

// Llama-2-7B: V 32000, C 4096, I 11008, L 32, H = Hkv = 32, untied head.
const V: u64 = 32000;
const C: u64 = 4096;
const I: u64 = 11008;
const L: u64 = 32;
const T: u64 = 131072;

fn n_params() -> u64 {
    let layer = 4 * C * C + 3 * C * I + 2 * C;
    2 * V * C + L * layer + C
}

fn plan(zero: u8, sp: usize, extra: &[&str]) -> Plan {
    let mut sets = vec![LLAMA2_7B.to_string()];
    sets.extend(extra.iter().map(|s| s.to_string()));
    let (cfg, _) = load_config(Path::new(MISSION), &sets).unwrap();
    plan_for(
        &cfg,
        &World { gpus: 8, zero_stage: ZeroStage::from_number(zero.into()).unwrap(), sp_degree: sp },
        &Gpu::new(GpuKind::A100),
    )
    .unwrap()
}

fn state(p: &Plan) -> u64 {
    p.term("weights") + p.term("gradients") + p.term("optimizer")
}

#[test]
fn design_section_5_state_per_zero_stage() {
    let n = n_params();
    assert_eq!(n, 6_738_415_616);
    // The design budget counts bf16 gradients (16 B/param: 5.5 / 3.75 / 2 B per GPU for ZeRO-1/2/3); harpe
    // accumulates and reduce-scatters gradients in fp32 (Megatron's main_grad), 18 B/param:
    // 2 + 4 + 12/8 = 7.5 B/param (ZeRO-1), 2 + 16/8 = 4 (ZeRO-2), 18/8 = 2.25 (ZeRO-3)
    let (z1, z2, z3) = (plan(1, 1, &[]), plan(2, 1, &[]), plan(3, 1, &[]));
    assert_eq!(state(&z1), 2 * n + 4 * n + 12 * n / 8);
    assert_eq!(state(&z2), 2 * n + (4 * n + 12 * n) / 8);
    assert_eq!(state(&z3), 18 * n / 8);
    let gb = |b: u64| b as f64 / 1e9;
    assert!((gb(state(&z1)) - 50.5).abs() < 0.5, "ZeRO-1 {:.2} GB", gb(state(&z1)));
    assert!((gb(state(&z2)) - 27.0).abs() < 0.5, "ZeRO-2 {:.2} GB", gb(state(&z2)));
    assert!((gb(state(&z3)) - 15.2).abs() < 0.1, "ZeRO-3 {:.2} GB", gb(state(&z3)));
    // plus, at ZeRO-3 only, what stays gathered for a micro-batch (train/step.rs): the embedding, the
    // final norm and the untied head (2 x 32000 x 4096 + 4096), the one layer of an every-layer
    // checkpoint segment (~0.4 GB in the design budget) and on GPUs the next layer's prefetch beside it (NCCL
    // overlaps it with this layer's compute): bf16, 1.33 GB
    let layer = 4 * C * C + 3 * C * I + 2 * C;
    let outer = 2 * 32000 * C + C;
    assert_eq!(z3.term("gathered_weights"), 2 * (outer + 2 * layer));
    assert!((gb(z3.term("gathered_weights")) - 1.33).abs() < 0.01, "{}", gb(z3.term("gathered_weights")));
    assert_eq!(z1.term("gathered_weights"), 0);
    // without checkpointing the last (only) segment is the whole model, held from its forward to its
    // backward: ZeRO-3 then gathers every weight at once (no prefetch left to overlap)
    let none = plan(3, 1, &["train.activation_checkpointing=\"none\""]);
    assert_eq!(none.term("gathered_weights"), 2 * (outer + 32 * layer));
    // ZeRO-0 replicates everything: 18 B/param
    assert_eq!(state(&plan(0, 1, &[])), 18 * n);
}

/// One recomputed layer's working set on the CUDA path, counted here op by op from `Llama::layer_body`
/// (bf16): the tensors candle's autograd keeps (norm outputs, q/k/v, RoPE's contiguous copies and
/// outputs, v's copy, the flash op's packed O|lse rows of D + 8, o's (B, T, H*D) rows, o and down
/// projections with their residuals, gate, up and the fused SwiGLU output), the MLP backward's gradients
/// (3I + 2C), the SwiGLU backward's f32 block and the segment's weight gradients.
/// Under Ulysses the graph also keeps `copies` copies of q, k, v and o per token (`sp_copies`).
fn working_set_128k() -> u64 {
    working_set(T, 0)
}

fn working_set(tokens: u64, sp_copies: u64) -> u64 {
    let graph = 15 * C + 32 * (128 + 8) + 3 * I + sp_copies * 4 * C; // values per token
    let bwd = 3 * I + 2 * C;
    let block = (4_194_304 / I) * I * 8 * 4;
    let grads = (4 * C * C + 3 * C * I + 2 * C) * 2 + V * C * 2;
    (graph + bwd) * tokens * 2 + block + grads
}

#[test]
fn design_section_5_activations_totals_and_sp() {
    let z3 = plan(3, 1, &[]);
    // one checkpoint per layer: 32 x T x 4096 x 2 B = 32 GiB
    assert_eq!(z3.term("layer_inputs"), L * T * C * 2);
    assert_eq!(z3.term("layer_inputs"), 32 << 30);
    // one layer's recompute working set at 128K: ~98.8K values a token kept by candle's autograd + the
    // backward's gradients, ~35 GiB (the design budget's flash-style 42.5K values a token was not what the
    // autograd graph keeps)
    let ws = z3.term("working_set");
    assert!(ws.abs_diff(working_set_128k()) < 1 << 20, "working set {ws} vs {}", working_set_128k());
    // one layer's flash-attention backward: the op's packed bf16 rows [q | O | lse | dO | .] (3 x 128 + 16
    // elements) and its f32 scratch (delta + dQ accumulator, 129 floats) per head and token — the op's own
    // function (ops::attention_shape::attention_workspace), 5.5 GB at 128K
    assert_eq!(z3.term("attention_workspace"), T * 32 * (400 * 2 + 129 * 4));
    // plain ZeRO-3 at batch 1 x 128K does not fit 80 GB: ~91 GiB; the cheapest change is Ulysses over 2 GPUs,
    // which halves every activation term
    let total = z3.total_bytes as f64 / (1u64 << 30) as f64;
    assert!((85.0..=95.0).contains(&total), "ZeRO-3 total {total:.2} GiB");
    assert!(!z3.fits);
    assert_eq!(z3.suggestion.as_ref().expect("a fix").change, "dist.sp_degree = 2");
    let e = format!("{:#}", z3.check_fits().unwrap_err());
    assert!(e.contains("dist.sp_degree = 2") && e.contains("--force") && e.contains("hint:"), "{e}");
    let sp2 = plan(3, 2, &[]);
    assert!(sp2.fits && sp2.check_fits().is_ok());
    // HARPE's cos/sin tables (f32, one row per kv head, D/2 columns) for a rank's positions: 2 GiB at
    // 128K, 1 GiB at SP 2 — the same for two sequences a micro-batch (the same positions)
    assert_eq!(z3.term("rope_tables"), 2 * 32 * T * 64 * 4);
    assert_eq!(sp2.term("rope_tables") * 2, z3.term("rope_tables"));
    let mb2 = plan(3, 2, &["train.micro_batch_size=2"]);
    assert_eq!(mb2.term("rope_tables"), sp2.term("rope_tables"));
    // the exchange's copies of q, k, v and o as `comms::sequence` makes them: two at micro-batch 1 (one
    // re-layout of each exchange is a view), three with two sequences
    let ws2 = sp2.term("working_set");
    assert!(ws2.abs_diff(working_set(T / 2, 2)) < 1 << 20, "SP 2 working set {ws2} vs {}", working_set(T / 2, 2));
    let ws = mb2.term("working_set");
    assert!(ws.abs_diff(working_set(T, 3)) < 1 << 20, "SP 2 x 2 sequences: working set {ws} vs {}", working_set(T, 3));
    // at least 5% of the A100's 79.1 usable GiB left
    assert!((sp2.total_bytes as f64) < 0.95 * 79.1 * (1u64 << 30) as f64, "{}", sp2.total_bytes);
    // ZeRO-1 does not fit, at SP 1 or 2, nor ZeRO-2 at SP 1
    for (z, p) in [(1, 1), (2, 1), (1, 2)] {
        assert!(!plan(z, p, &[]).fits, "ZeRO-{z} SP {p}");
    }
    // Ulysses P = 8 divides the layer inputs by 8; the working set less (each rank's graph also keeps the
    // exchange's copies of q, k, v and o, and at 16K tokens a rank the loss phase's T-independent chunk
    // and head terms are its peak)
    let sp = plan(3, 8, &[]);
    assert_eq!(sp.term("layer_inputs") * 8, z3.term("layer_inputs"));
    let r = z3.term("working_set") as f64 / sp.term("working_set") as f64;
    assert!((3.0..=8.0).contains(&r), "working set ratio {r:.2}");
    assert_eq!(sp.term("attention_workspace") * 8, z3.term("attention_workspace"), "H / 8 heads per rank");
    let total = sp.total_bytes as f64 / 1e9;
    assert!((17.0..=40.0).contains(&total), "SP 8 total {total:.2} GB");
    // ... which leaves room for 512K
    let long = plan(3, 8, &["stage.0.seq_len=524288"]);
    assert!(long.fits, "512K with SP 8: {:.1} GB", long.total_bytes as f64 / 1e9);
    assert!(!plan(3, 1, &["stage.0.seq_len=524288"]).fits);
}

#[test]
fn step_time_from_flops_with_recompute() {
    let z3 = plan(3, 1, &[]);
    let n = n_params() as f64;
    // executed FLOPs per token: 6N + causal attention 6·L·C·T, plus the recomputed forward of 31 of 32 layers
    let model = 6.0 * n + 12.0 * (L * C * T) as f64;
    let executed = (6.0 * n + 6.0 * (L * C * T) as f64) * (1.0 + 31.0 / 32.0 / 3.0);
    assert!((z3.flops_per_token / model - 1.0).abs() < 1e-9);
    assert!((z3.hw_flops_per_token / executed - 1.0).abs() < 1e-9);
    // the attention's share (6·L·C·T, recompute included) at harpe's kernels' rate (a bare A100's plan), in
    // FlashAttention's count (3.5 forwards of 2·L·C·T a layer, one more per recomputed layer); the rest at 40%
    let lct = (L * C * T) as f64;
    let attn = 6.0 * lct * (1.0 + 31.0 / 32.0 / 3.0);
    let rated = 2.0 * lct * (3.5 + 31.0 / 32.0);
    let compute =
        4_194_304.0 * ((executed - attn) / (8.0 * 312e12 * 0.4) + rated / (8.0 * 312e12 * HARPE_PEAK_FRACTION));
    assert!((z3.compute_s / compute - 1.0).abs() < 1e-9);
    assert!(z3.step_time_s >= z3.compute_s);
    assert!((z3.tokens_per_s - 4_194_304.0 / z3.step_time_s).abs() < 1e-6);
    // ZeRO-3 moves 2 x bf16 weights + fp32 grads per micro-batch (4 per rank per step): (7/8) N (2+2+4) B x 4
    assert!((z3.zero_comm_bytes / (7.0 / 8.0 * n * 8.0 * 4.0) - 1.0).abs() < 1e-9);
    // SP adds all-to-all time on the critical path
    let sp = plan(3, 8, &[]);
    assert!(sp.sp_comm_s > 0.0 && sp.step_time_s > sp.compute_s);
    // 6B tokens at that speed
    assert!((z3.run_hours - 6e9 / z3.tokens_per_s / 3600.0).abs() / z3.run_hours < 1e-3);
}

/// The attention kernel the plan counts: FA2's workspace (f32 dq_accum of D rounded to 32 and rows rounded to
/// 128, f32 softmax_d, dO made contiguous; no dK/dV per query head for MHA) instead of harpe's packed rows,
/// and the attention's share of the step at the kernel's forward+backward rate.
#[test]
fn the_attention_kernel_sets_its_workspace_and_rate() {
    let (cfg, _) = load_config(Path::new(MISSION), &[LLAMA2_7B.to_string()]).unwrap();
    let world = World { gpus: 8, zero_stage: ZeroStage::Parameters, sp_degree: 2 };
    let harpe_gpu = Gpu::new(GpuKind::A100);
    assert_eq!(harpe_gpu.attention.kernel, AttnKernelKind::Harpe, "a bare device plans harpe's kernels");
    assert!((harpe_gpu.attention.tflops - 312.0 * HARPE_PEAK_FRACTION).abs() < 1e-9);
    let fa2_gpu = Gpu::new(GpuKind::A100).with_attention_prior(AttnKernelKind::Flash2);
    assert_eq!(fa2_gpu.attention.tflops, FA2_A100_TFLOPS);
    let (h, f) = (plan_for(&cfg, &world, &harpe_gpu).unwrap(), plan_for(&cfg, &world, &fa2_gpu).unwrap());
    // SP 2: 16 heads of 128 over the whole 128K sequence, one sequence
    assert_eq!(f.term("attention_workspace"), T * 16 * (128 * 4 + 4 + 128 * 2));
    assert_eq!(h.term("attention_workspace"), T * 16 * (400 * 2 + 129 * 4));
    // everything else alike
    assert_eq!(f.total_bytes + h.term("attention_workspace"), h.total_bytes + f.term("attention_workspace"));
    // the same FLOPs; the faster attention shortens the step
    assert_eq!(f.hw_flops_per_token, h.hw_flops_per_token);
    assert!(f.tokens_per_s > 1.4 * h.tokens_per_s, "flash2 {} vs harpe {} tokens/s", f.tokens_per_s, h.tokens_per_s);
}

#[test]
fn bad_worlds_name_the_numbers_and_the_nearest_valid_choice() {
    let (cfg, _) = load_config(Path::new(MISSION), &[LLAMA2_7B.to_string()]).unwrap();
    let a100 = Gpu::new(GpuKind::A100);
    let err = |w: World| format!("{:#}", plan_for(&cfg, &w, &a100).unwrap_err());
    let e = err(World { gpus: 8, zero_stage: ZeroStage::Parameters, sp_degree: 3 });
    assert!(e.contains("sp_degree 3") && e.contains("32 kv heads") && e.contains("nearest valid degree is 2"), "{e}");
    let e = err(World { gpus: 64, zero_stage: ZeroStage::Parameters, sp_degree: 64 });
    assert!(e.contains("sp_degree 64") && e.contains("nearest valid degree is 32"), "{e}");
    let e = err(World { gpus: 6, zero_stage: ZeroStage::Parameters, sp_degree: 4 });
    assert!(e.contains("world size 6") && e.contains("--gpus 4 or 8") && e.contains("hint:"), "{e}");
    // a stage that does not exist cannot be a `World`: the config and --set are refused, one message
    let e = format!("{:#}", load_config(Path::new(MISSION), &["dist.zero_stage=4".into()]).unwrap_err());
    assert!(e.contains("dist.zero_stage = 4 is not a ZeRO stage") && e.contains("hint:"), "{e}");
    let e = format!("{:#}", GpuKind::parse("v100").unwrap_err());
    assert!(e.contains("v100") && e.contains("nearest known name is `a100`"), "{e}");
    assert_eq!(GpuKind::parse("H200").unwrap(), GpuKind::H200);
    // train's start-up check names the device by the driver's name
    assert_eq!(GpuKind::from_device_name("NVIDIA A100-SXM4-80GB"), Some(GpuKind::A100));
    assert_eq!(GpuKind::from_device_name("NVIDIA H200"), Some(GpuKind::H200));
    assert_eq!(GpuKind::from_device_name("NVIDIA H100 80GB HBM3"), Some(GpuKind::H100));
    assert_eq!(GpuKind::from_device_name("NVIDIA L40S"), None);
    // a step's sequences must split over the data-parallel ranks: 4 sequences on 8 ranks do not, on 4 do
    let (cfg4, _) =
        load_config(Path::new(MISSION), &[LLAMA2_7B.into(), "train.global_batch_tokens=524288".into()]).unwrap();
    let e = format!(
        "{:#}",
        plan_for(&cfg4, &World { gpus: 8, zero_stage: ZeroStage::Parameters, sp_degree: 1 }, &a100).unwrap_err()
    );
    assert!(e.contains("4 sequences") && e.contains("8 data-parallel ranks") && e.contains("hint:"), "{e}");
    assert!(plan_for(&cfg4, &World { gpus: 8, zero_stage: ZeroStage::Parameters, sp_degree: 2 }, &a100).is_ok());
    // a model directory without config.json
    let d = tempfile::tempdir().unwrap();
    let (cfg, _) = load_config(Path::new(MISSION), &[format!("model.path=\"{}\"", d.path().display())]).unwrap();
    let e = format!(
        "{:#}",
        plan_for(&cfg, &World { gpus: 8, zero_stage: ZeroStage::Parameters, sp_degree: 1 }, &a100).unwrap_err()
    );
    assert!(
        e.contains("has no config.json") && e.contains(&d.path().display().to_string()) && e.contains("hint:"),
        "{e}"
    );
}

#[test]
fn memory_sizes_and_dist_keys_from_the_config() {
    assert_eq!(parse_bytes("80GiB").unwrap(), 80 << 30);
    assert_eq!(parse_bytes("80GB").unwrap(), 80_000_000_000);
    assert_eq!(parse_bytes("81920MiB").unwrap(), 80 << 30);
    assert_eq!(parse_bytes("40").unwrap(), 40 << 30);
    assert!(format!("{:#}", parse_bytes("80 gigs").unwrap_err()).contains("hint:"));
    assert!(parse_bytes("-1GB").is_err());
    let (_, keys) = load_config(
        Path::new(MISSION),
        &[LLAMA2_7B.into(), "dist.zero_stage=3".into(), "dist.sp_degree=4".into(), "dist.world_size=16".into()],
    )
    .unwrap();
    assert_eq!((keys.zero_stage, keys.sp_degree, keys.world_size), (Some(ZeroStage::Parameters), Some(4), Some(16)));
}

#[test]
fn cli_json_has_the_contract_fields() {
    let out = harpe_cmd()
        .args(["plan", "--config", MISSION, "--set", LLAMA2_7B, "--set", "dist.zero_stage=3", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // the recipe's dist.sp_degree; `auto` attention plans FlashAttention-2 for a GPU
    let (cfg, _) = load_config(Path::new(MISSION), &[LLAMA2_7B.to_string()]).unwrap();
    let fa2 = Gpu::new(GpuKind::A100).with_attention_prior(AttnKernelKind::Flash2);
    let lib = plan_for(&cfg, &World { gpus: 8, zero_stage: ZeroStage::Parameters, sp_degree: 2 }, &fa2).unwrap();
    assert_eq!(v["gpu"]["attention"]["kernel"].as_str(), Some("flash2"));
    assert_eq!(v["total_bytes"].as_u64(), Some(lib.total_bytes));
    assert_eq!(v["fits"].as_bool(), Some(true));
    assert_eq!(v["terms"]["layer_inputs"].as_u64(), Some(16 << 30));
    let sum: u64 = v["terms"].as_object().unwrap().values().map(|x| x.as_u64().unwrap()).sum();
    assert_eq!(sum, lib.total_bytes);
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0);
    // the recipe's log.peak_tflops (312, A100) is used for its own device, not for another --gpu
    assert_eq!(v["gpu"]["peak_tflops"].as_f64(), Some(312.0));
    let out = harpe_cmd()
        .args(["plan", "--config", MISSION, "--set", LLAMA2_7B, "--gpu", "h100", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["gpu"]["peak_tflops"].as_f64(), Some(989.0));
    // the table names every term and the verdict; an unknown GPU is an error with a hint
    let harpe_kernels = ["--set", "train.attention=\"harpe\""];
    let mut cmd = harpe_cmd();
    let out = cmd
        .args(["plan", "--config", MISSION, "--set", LLAMA2_7B, "--zero", "1"])
        .args(harpe_kernels)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && text.contains("DOES NOT FIT")
            && text.contains("cheapest change that fits: dist.zero_stage = 2"),
        "{text}"
    );
    assert!(text.contains("attention: harpe's kernels (harpe) at 90 TFLOP/s"), "{text}");
    // ZeRO-1 at SP 2 does not fit with either kernel; ZeRO-2 does (harpe's: 71.5 of 72.0 usable GiB;
    // FlashAttention-2's backward workspace, 1.5 GiB against 2.6, leaves more)
    let out = harpe_cmd().args(["plan", "--config", MISSION, "--set", LLAMA2_7B, "--zero", "1"]).output().unwrap();
    let fa2 = String::from_utf8_lossy(&out.stdout);
    assert!(fa2.contains("DOES NOT FIT") && fa2.contains("cheapest change that fits: dist.zero_stage = 2"), "{fa2}");
    assert!(fa2.contains("attention: FlashAttention-2's kernels (flash2) at 185 TFLOP/s"), "{fa2}");
    // the ZeRO traffic's time as a share of the step's compute: how much of it the overlap must hide
    assert!(text.contains("ZeRO traffic") && text.contains("% of the compute, overlapped"), "{text}");
    let out = harpe_cmd().args(["plan", "--config", MISSION, "--set", LLAMA2_7B, "--gpu", "b200"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("b200") && err.contains("hint:"), "{err}");
}

#[test]
fn the_slurm_scripts_stop_warning_is_the_plans_lead_time() {
    // scripts/slurm-harpe-128k.sh: 2 nodes x 8 GPUs, ZeRO-3, the 128K stage of configs/harpe-128k.toml
    let (cfg, _) = load_config(Path::new(MISSION), &[LLAMA2_7B.to_string()]).unwrap();
    let world = World { gpus: 16, zero_stage: ZeroStage::from_number(3).unwrap(), sp_degree: 1 };
    let p = plan_for(&cfg, &world, &Gpu::new(GpuKind::A100)).unwrap();
    let c = &p.checkpoint;
    // rank 0 writes its 12 B/param shard and the bf16 weights
    let n = n_params() as f64;
    assert!((c.rank0_bytes - (12.0 * n / 16.0 + 2.0 * n)).abs() < 1.0, "{}", c.rank0_bytes);
    // a stop needs up to 2 steps + the write, with a quarter to spare, in whole minutes
    let need = 2.0 * p.step_time_s + c.write_s;
    assert!(c.stop_lead_s as f64 >= 1.25 * need && c.stop_lead_s as f64 - 60.0 < 1.25 * need, "{c:?} {need}");
    assert!(c.stop_lead_s > 600, "one 128K step alone is longer than the old TERM@600: {:.0} s", p.step_time_s);
    // the number in the script is the plan's, and `harpe plan` prints it
    let script = std::fs::read_to_string("scripts/slurm-harpe-128k.sh").unwrap();
    let line = format!("#SBATCH --signal=TERM@{}\n", c.stop_lead_s);
    assert!(script.contains(&line), "scripts/slurm-harpe-128k.sh should have `{}`", line.trim());
    let o = harpe_cmd()
        .args(["plan", "--config", MISSION, "--set", LLAMA2_7B, "--gpus", "16", "--zero", "3"])
        .args(["--set", "train.attention=\"harpe\""])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains(&format!("-> Slurm --signal=TERM@{}", c.stop_lead_s)), "{text}");
}
