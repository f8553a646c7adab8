//! `harpe bench`: time each harpe kernel on the GPU and say how close it is to the hardware — GB/s and
//! the percent of the measured device-to-device copy bandwidth (all these kernels are memory-bound) —
//! and, when `python3 -c "import torch"` works, beside PyTorch doing the same work in the same run
//! (scripts/bench_kernels_torch.py; ratios > 1 mean harpe is faster).
//!
//! Reference: llm.c `dev/cuda/*.cu` benchmarks (bytes moved / time vs the memcpy ceiling).
//! The non-obvious decision: bytes are the minimum each kernel must move (inputs read once, outputs
//! written once), so a kernel that re-reads (rms_norm backward recomputes rstd, cross-entropy reads the
//! logits twice) shows that as a lower percentage instead of hiding it.
//! Shapes are Llama-2-7B's: C = 4096, H = 32 heads of D = 128, V = 32000, at T = 4096 tokens.
//! `harpe bench model` adds the model-level rows on `--device` (CPU too): one decoder layer
//! forward+backward and one full training step with AdamW (`bench::model`; on CUDA the 32-layer 7B at
//! the largest T that fits, or a row with a note saying why not), same table and JSON rows, with TFLOP/s.
use crate::device::DeviceSpec;
use anyhow::{bail, Result};
use serde::Serialize;

pub mod attention;
pub mod comms;
pub mod model;

/// One timed kernel.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub kernel: String,
    pub shape: String,
    pub ms: f64,
    /// minimum bytes the kernel must move
    pub bytes: u64,
    pub gb_per_s: f64,
    /// percent of the measured copy bandwidth
    pub pct_of_copy: f64,
    /// PyTorch's time for the same work, when measured
    pub torch_ms: Option<f64>,
    /// matmul TFLOP/s, for the compute-bound model rows (`bench::model`)
    pub tflops: Option<f64>,
    /// why the row was not timed (e.g. the 7B step does not fit the device); its numbers are then NaN
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Row {
    /// A row from a time and a byte count against the copy bandwidth `copy_gbps`.
    pub fn new(kernel: &str, shape: &str, ms: f64, bytes: u64, copy_gbps: f64) -> Row {
        let gb_per_s = bytes as f64 / (ms * 1e-3) / 1e9;
        Row {
            kernel: kernel.into(),
            shape: shape.into(),
            ms,
            bytes,
            gb_per_s,
            pct_of_copy: 100.0 * gb_per_s / copy_gbps,
            torch_ms: None,
            tflops: None,
            note: None,
        }
    }

    /// A row that was not timed, with the reason in `note` (NaN numbers: null in JSON).
    pub fn skipped(kernel: &str, shape: &str, note: String) -> Row {
        Row { note: Some(note), ..Row::new(kernel, shape, f64::NAN, 0, f64::NAN) }
    }
}

/// Print rows as a table (torch columns when measured).
pub fn print_table(device: &str, copy_gbps: f64, rows: &[Row]) {
    let flops = rows.iter().any(|r| r.tflops.is_some());
    print_header(device, copy_gbps, flops);
    for r in rows {
        print_row(r, flops);
    }
}

/// The table's title and column line (`flops`: with the TFLOP/s column of the model rows).
pub fn print_header(device: &str, copy_gbps: f64, flops: bool) {
    println!("harpe bench — {device}; device copy bandwidth {copy_gbps:.0} GB/s (the 100% line)");
    let tf_head = if flops { format!(" {:>9}", "TFLOP/s") } else { String::new() };
    println!(
        "{:<22} {:<34} {:>9} {:>9} {:>7} {:>10} {:>8}{tf_head}",
        "kernel", "shape", "ms", "GB/s", "%copy", "torch ms", "x torch"
    );
    flush_stdout();
}

/// One line of the table, flushed: a run stopped by a timeout keeps every row printed before it.
pub fn print_row(r: &Row, flops: bool) {
    if let Some(note) = &r.note {
        println!("{:<22} {:<34} not timed: {note}", r.kernel, r.shape);
        flush_stdout();
        return;
    }
    let (t, x) = match r.torch_ms {
        Some(t) => (format!("{t:.3}"), format!("{:.2}", t / r.ms)),
        None => ("-".into(), "-".into()),
    };
    let tf = match (flops, r.tflops) {
        (false, _) => String::new(),
        (true, Some(f)) => format!(" {f:>9.4}"),
        (true, None) => format!(" {:>9}", "-"),
    };
    println!(
        "{:<22} {:<34} {:>9.3} {:>9.0} {:>6.0}% {:>10} {:>8}{tf}",
        r.kernel, r.shape, r.ms, r.gb_per_s, r.pct_of_copy, t, x
    );
    flush_stdout();
}

/// Stdout is a pipe under scripts/gpu-check.sh (block-buffered): a row waits in the buffer until flushed,
/// and `timeout` killing the process would drop it.
pub(crate) fn flush_stdout() {
    use std::io::Write;
    let _ = std::io::stdout().flush();
}

/// `HARPE_TEST_SLOW_BENCH_ROW`: after each printed row, sleep (a benchmark that a step limit stops half-way).
pub(crate) fn after_row() {
    if let Some(d) = crate::testing::hooks().slow_bench_row {
        std::thread::sleep(d);
    }
}

/// Time the kernels on the GPU.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// what to time: `kernels` (the row kernels, the default), `attention` (flash attention fwd/bwd at
    /// T = 8K, 32K, 128K against PyTorch SDPA; `bench::attention`) or `model` (a decoder layer
    /// fwd+bwd and a full training step on --device, CPU too; `bench::model`) or `comms` (all-reduce,
    /// all-gather, reduce-scatter time and bus bandwidth: NCCL or Gloo processes with --nproc-per-node,
    /// else --ranks thread ranks on host memory; `bench::comms`)
    #[arg(value_parser = ["kernels", "attention", "model", "comms"])]
    pub what: Option<String>,
    /// `comms`: start N processes, one per rank, over --backend
    #[arg(long, value_name = "N")]
    pub nproc_per_node: Option<usize>,
    /// `comms` under a launcher: `nccl` (one process per GPU, --features nccl) or `gloo` (CPU processes,
    /// --features gloo) [default: nccl in an NCCL build, else gloo]
    #[arg(long, value_parser = ["nccl", "gloo"])]
    pub backend: Option<String>,
    /// `comms` without a launcher: rank threads (`Local`, host memory)
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// `comms`: buffer sizes in MiB (per rank for all-reduce, gathered for all-gather / reduce-scatter)
    #[arg(long, value_delimiter = ',', default_value = "1,16,256")]
    pub comm_mib: Vec<f64>,
    /// `comms`: seconds of timed calls per row
    #[arg(long, default_value_t = 0.5)]
    pub comm_seconds: f64,
    /// device of the `model` rows: cpu, cuda or cuda:N [default: cuda in a CUDA build, else cpu]
    #[arg(long)]
    pub device: Option<DeviceSpec>,
    /// hidden size C of the `model` rows [default: 4096 on CUDA, 64 on the CPU]
    #[arg(long)]
    pub hidden: Option<usize>,
    /// attention heads of the `model` rows (head dim C / heads) [default: 32 on CUDA, 4 on the CPU]
    #[arg(long)]
    pub heads: Option<usize>,
    /// tokens T of the `model` rows [default: 4096 and 16384 for the layer on CUDA, 128 on the CPU; the
    /// CUDA step row: the largest multiple of 1024 whose memory plan fits the device's free memory]
    #[arg(long)]
    pub model_tokens: Option<usize>,
    /// decoder layers of the `model` training-step row [default: 32 (Llama-2-7B) on CUDA, 2 on the CPU]
    #[arg(long)]
    pub step_layers: Option<usize>,
    /// timed steps of the `model` training-step row, after one warm-up [default: 2 on CUDA, --iters on the CPU]
    #[arg(long)]
    pub step_iters: Option<usize>,
    /// which `model` rows to run: `layer` (the decoder layer), `step` (the training step), or both
    #[arg(long, value_delimiter = ',', default_value = "layer,step", value_parser = ["layer", "step"])]
    pub model_rows: Vec<String>,
    /// seconds of timed calls per attention row (at least one call after one warm-up)
    #[arg(long, default_value_t = 2.0)]
    pub attn_seconds: f64,
    /// `attention`: the sequence lengths T of the rows (scripts/gpu-check.sh runs 8K and 32K first, 128K in
    /// its second run)
    #[arg(long, value_delimiter = ',', default_value = "8192,32768,131072")]
    pub attn_tokens: Vec<usize>,
    /// timed repetitions per kernel (after 3 warm-up runs)
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// tokens per timed call (rope, rms_norm, cross-entropy chunk rows)
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
    /// skip the PyTorch comparison even when torch is importable
    #[arg(long)]
    pub no_torch: bool,
    /// print JSON instead of a table
    #[arg(long)]
    pub json: bool,
    /// `attention`: run the kernels on `cuda` (timed) or `emulated` (the host emulation; needs --profile)
    #[arg(long, default_value = "cuda", value_parser = ["cuda", "emulated"])]
    pub target: String,
    /// `attention --target emulated`: measure each kernel (sectors, bank conflicts, barriers, atomics, mma)
    #[arg(long)]
    pub profile: bool,
}

/// `harpe bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    if args.what.as_deref() == Some("model") {
        return run_model(&args);
    }
    if args.what.as_deref() == Some("comms") {
        return comms::run(&args);
    }
    if args.what.as_deref() == Some("attention") && args.target == "emulated" {
        return attention::run_emulated(&args);
    }
    if !cfg!(feature = "cuda") {
        bail!("harpe bench times the CUDA kernels, and this harpe was built without CUDA\nhint: build with `cargo build --release --features cuda` (README: Build for GPUs); on CPU, `harpe selftest` checks the kernels' source through the host emulation");
    }
    if args.what.as_deref() == Some("attention") {
        return attention::run(&args);
    }
    #[cfg(feature = "cuda")]
    {
        gpu::run(args)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = args;
        Ok(())
    }
}

/// `harpe bench model`: the decoder-layer and training-step rows on `--device`, each printed as it is
/// measured (the JSON object, which needs them all, at the end).
fn run_model(args: &BenchArgs) -> Result<()> {
    crate::testing::hooks().check()?;
    let spec = args.device.unwrap_or(if cfg!(feature = "cuda") { DeviceSpec::Cuda(0) } else { DeviceSpec::Cpu });
    let dev = spec.open("--device")?;
    let copy_gbps = model::copy_bandwidth(&dev, args.iters.max(1))?;
    let name = format!("{spec}");
    if !args.json {
        print_header(&name, copy_gbps, true);
    }
    let rows = model::rows(args, &dev, copy_gbps, &mut |r| {
        if !args.json {
            print_row(r, true);
            after_row();
        }
    })?;
    if args.json {
        println!("{}", serde_json::json!({"device": name, "copy_gb_per_s": copy_gbps, "rows": rows}));
    }
    Ok(())
}

/// Mean seconds of `f` over `iters` calls after `warmup` calls, the device synchronised before and after
/// the timed ones (a GPU's queued work is inside the time).
fn mean_seconds(
    dev: &candle_core::Device,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let t0 = std::time::Instant::now();
    for _ in 0..iters {
        f()?;
    }
    dev.synchronize()?;
    Ok(t0.elapsed().as_secs_f64() / iters as f64)
}

/// PyTorch's times for the same shapes, from scripts/bench_kernels_torch.py (None when torch is absent).
pub fn torch_times(tokens: usize, iters: usize) -> Option<serde_json::Value> {
    torch_script("bench_kernels_torch.py", &["--tokens", &tokens.to_string(), "--iters", &iters.to_string()])
}

/// The JSON that a PyTorch timing script of scripts/ prints, or None when python3 has no CUDA torch or
/// the script fails (its stderr is shown as a warning): the torch comparisons are optional rows.
pub(crate) fn torch_script(name: &str, args: &[&str]) -> Option<serde_json::Value> {
    // asked once per process (an import of torch costs seconds; `bench model` calls a script per row)
    static CUDA_TORCH: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *CUDA_TORCH.get_or_init(|| {
        std::process::Command::new("python3")
            .args(["-c", "import torch; assert torch.cuda.is_available()"])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if !ok {
        return None;
    }
    let script = locate_named(name)?;
    let out = std::process::Command::new("python3").arg(script).args(args).output().ok()?;
    if !out.status.success() {
        eprintln!("warning: the torch comparison ({name}) failed: {}", String::from_utf8_lossy(&out.stderr));
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

/// scripts/<name> beside the binary's checkout or in the gpu-check bundle.
fn locate_named(name: &str) -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let mut cands = vec![std::path::PathBuf::from("scripts").join(name)];
    if let Some(dir) = exe.parent() {
        cands.push(dir.join(name));
        cands.push(dir.join("../../scripts").join(name));
    }
    cands.into_iter().find(|p| p.exists())
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::{print_table, torch_times, BenchArgs, Row};
    use crate::ops::cuda::{adamw_step, grad_sumsq, AdamWBuffers, AdamWStep, ComputeOut};
    use anyhow::Result;
    use candle_core::cuda_backend::CudaDevice;
    use candle_core::{DType, Device, Tensor};

    /// Mean milliseconds of `f` over `iters` calls after 3 warm-up calls, synchronised.
    fn time(dev: &Device, iters: usize, f: impl FnMut() -> Result<()>) -> Result<f64> {
        Ok(super::mean_seconds(dev, 3, iters, f)? * 1e3)
    }

    pub fn run(args: BenchArgs) -> Result<()> {
        let dev = crate::tools::selftest::open_cuda()?;
        let cd = dev.as_cuda_device()?.clone();
        let iters = args.iters.max(1);
        let t = args.tokens.max(1);
        let copy_gbps = copy_bandwidth(&dev, &cd, iters)?;
        let mut rows = Vec::new();
        rows.extend(rope_rows(&dev, iters, t, copy_gbps)?);
        rows.extend(rms_norm_rows(&dev, iters, t, copy_gbps)?);
        rows.extend(cross_entropy_rows(&dev, iters, t, copy_gbps)?);
        rows.extend(optimizer_rows(&dev, &cd, iters, copy_gbps)?);
        if !args.no_torch {
            if let Some(tj) = torch_times(t, iters) {
                for r in rows.iter_mut() {
                    r.torch_ms = tj.get(&r.kernel).and_then(|v| v.as_f64());
                }
            }
        }
        let name = "CUDA device 0";
        if args.json {
            println!("{}", serde_json::json!({"device": name, "copy_gb_per_s": copy_gbps, "rows": rows}));
        } else {
            print_table(name, copy_gbps, &rows);
        }
        Ok(())
    }

    /// Copy bandwidth in GB/s: 512 MiB device-to-device, read + write counted.
    fn copy_bandwidth(dev: &Device, cd: &CudaDevice, iters: usize) -> Result<f64> {
        let n_copy = 128usize << 20;
        let src = cd.alloc_zeros::<f32>(n_copy)?;
        let mut dst = cd.alloc_zeros::<f32>(n_copy)?;
        let copy_ms = time(dev, iters, || Ok(cd.memcpy_dtod(&src, &mut dst)?))?;
        Ok((2 * 4 * n_copy) as f64 / (copy_ms * 1e-3) / 1e9)
    }

    /// rope: q of Llama-2-7B, 32 heads, HARPE tables per kv head (32 for MHA); forward and forward+backward.
    fn rope_rows(dev: &Device, iters: usize, t: usize, copy_gbps: f64) -> Result<Vec<Row>> {
        let bf = DType::BF16;
        let (h, d) = (32usize, 128usize);
        let x = Tensor::randn(0f32, 1.0, (1, h, t, d), dev)?.to_dtype(bf)?;
        let cos = Tensor::randn(0f32, 1.0, (h, t, d / 2), dev)?;
        let sin = Tensor::randn(0f32, 1.0, (h, t, d / 2), dev)?;
        let rope_bytes = (2 * 2 * h * t * d + 2 * 4 * h * t * d / 2) as u64;
        let mut rows = Vec::new();
        let ms = time(dev, iters, || Ok(crate::ops::rotary::rope(&x, &cos, &sin).map(|_| ())?))?;
        rows.push(Row::new("rope fwd bf16", &format!("(1,{h},{t},{d}) Htab {h}"), ms, rope_bytes, copy_gbps));
        let var = candle_core::Var::from_tensor(&x)?;
        let ms = time(dev, iters, || {
            let y = crate::ops::rotary::rope(var.as_tensor(), &cos, &sin)?;
            Ok(y.sum_all()?.backward().map(|_| ())?)
        })?;
        rows.push(Row::new("rope fwd+bwd bf16", &format!("(1,{h},{t},{d}) + sum"), ms, 2 * rope_bytes, copy_gbps));
        Ok(rows)
    }

    /// rms_norm on (T, 4096): forward and forward+backward.
    fn rms_norm_rows(dev: &Device, iters: usize, t: usize, copy_gbps: f64) -> Result<Vec<Row>> {
        let bf = DType::BF16;
        let c = 4096usize;
        let xn = Tensor::randn(0f32, 1.0, (t, c), dev)?.to_dtype(bf)?;
        let w = Tensor::randn(0f32, 1.0, c, dev)?.to_dtype(bf)?;
        let mut rows = Vec::new();
        let ms = time(dev, iters, || Ok(crate::ops::rms_norm::rms_norm(&xn, &w, 1e-5).map(|_| ())?))?;
        rows.push(Row::new("rms_norm fwd bf16", &format!("({t},{c})"), ms, (2 * 2 * t * c + 2 * c) as u64, copy_gbps));
        let xv = candle_core::Var::from_tensor(&xn)?;
        let wv = candle_core::Var::from_tensor(&w)?;
        let ms = time(dev, iters, || {
            let y = crate::ops::rms_norm::rms_norm(xv.as_tensor(), wv.as_tensor(), 1e-5)?;
            Ok(y.sum_all()?.backward().map(|_| ())?)
        })?;
        rows.push(Row::new(
            "rms_norm fwd+bwd bf16",
            &format!("({t},{c}) + sum"),
            ms,
            (5 * 2 * t * c) as u64,
            copy_gbps,
        ));
        Ok(rows)
    }

    /// cross-entropy on one chunk of logits (rows x 32000): the NLL and the logit gradient.
    fn cross_entropy_rows(dev: &Device, iters: usize, t: usize, copy_gbps: f64) -> Result<Vec<Row>> {
        use crate::ops::cross_entropy_chunk::{ce_chunk_dlogits, ce_chunk_nll};
        let bf = DType::BF16;
        let (rows_ce, v) = (t.min(4096), 32000usize);
        let logits = Tensor::randn(0f32, 2.0, (rows_ce, v), dev)?.to_dtype(bf)?;
        let targets = Tensor::arange(0u32, rows_ce as u32, dev)?;
        let g = Tensor::ones(rows_ce, DType::F32, dev)?;
        let mut rows = Vec::new();
        let ms = time(dev, iters, || Ok(ce_chunk_nll(&logits, &targets).map(|_| ())?))?;
        rows.push(Row::new("ce nll bf16", &format!("({rows_ce},{v})"), ms, (2 * rows_ce * v) as u64, copy_gbps));
        let ms = time(dev, iters, || Ok(ce_chunk_dlogits(&logits, &targets, &g).map(|_| ())?))?;
        rows.push(Row::new(
            "ce dlogits bf16",
            &format!("({rows_ce},{v})"),
            ms,
            (2 * 2 * rows_ce * v) as u64,
            copy_gbps,
        ));
        Ok(rows)
    }

    /// AdamW over 64M parameters writing bf16 weights; the grad norm.
    fn optimizer_rows(dev: &Device, cd: &CudaDevice, iters: usize, copy_gbps: f64) -> Result<Vec<Row>> {
        let n = 64usize << 20;
        let mut master = cd.alloc_zeros::<f32>(n)?;
        let mut m = cd.alloc_zeros::<f32>(n)?;
        let mut vv = cd.alloc_zeros::<f32>(n)?;
        let grad = cd.alloc_zeros::<f32>(n)?;
        let mut out = cd.alloc_zeros::<half::bf16>(n)?;
        let step =
            AdamWStep { lr: 1e-4, beta1: 0.9, beta2: 0.95, eps: 1e-8, step_size: 1e-3, bc2_sqrt: 0.3, grad_scale: 1.0 };
        let seg = [(0..n, 0.1f32)];
        let mut rows = Vec::new();
        let ms = time(dev, iters, || {
            let bufs = AdamWBuffers { master: &mut master, m: &mut m, v: &mut vv, grad: &grad };
            Ok(adamw_step(cd, bufs, ComputeOut::Bf16(&mut out), &seg, step)?)
        })?;
        rows.push(Row::new("adamw f32->bf16", &format!("{n} params"), ms, (30 * n) as u64, copy_gbps));
        let ms = time(dev, iters, || Ok(grad_sumsq(cd, &grad.slice(..)).map(|_| ())?))?;
        rows.push(Row::new("grad sum of squares", &format!("{n} f32"), ms, (4 * n) as u64, copy_gbps));
        Ok(rows)
    }
}
