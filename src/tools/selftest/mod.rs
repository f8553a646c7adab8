//! `harpe selftest`: every harpe kernel against its reference on fresh random ragged inputs, forward and
//! backward, f32, bf16 and f16 (attention); a PASS/FAIL table with each row's worst error / bound ratio,
//! printed row by row as the rows are computed; exit code 1 on any FAIL.
//!
//! Reference: ggml `test-backend-ops` and flash-attention's tests (one harness, every op). Targets: `cuda`
//! (the CUDA kernels through the ops the model calls, on the GPU) and `emulated` (the same kernel source
//! compiled for the host against kernels/emu.h — what a CPU build runs, and what `cargo test` checks).
//! Sizes are drawn per run (seeded) and are never multiples of 32.
//!
//! Bounds. f32 rows: max |kernel - reference| <= tol * max(1, max |reference|), tol 1e-5 (1e-6 for AdamW),
//! the reference being the f32 CPU op. 16-bit rows (bf16/f16 storage; [`check16`]): the exact value y of
//! every output element is computed in f64 from the same 16-bit-rounded inputs the kernel reads, and the
//! kernel's output must satisfy, element by element,
//!
//!   |kernel - y| <= B = 2 h(|y| + E) + E,    E = 2 u_op M + 2 L u32 M_f
//!
//! - h(x): half an ulp of x in the output's type, 2^(e-p) with e = floor(log2 x) (at least the smallest
//!   normal exponent) and p = 8 (bf16), 11 (f16), 24 (f32): the output's one rounding at the store,
//!   |round(z) - z| <= h(|z|), applied to z = the kernel's f32 value, |z| <= |y| + E. The bound allows two
//!   of them (a full ulp), and twice the operand roundings below, so that a correct kernel, whose worst
//!   element among thousands does round by almost h, still shows an err/bound ratio of about 0.5 and not 1:
//!   the margin the table prints.
//! - M: the same computation on absolute values (sum |a_k b_k| for a dot product, and so on through the
//!   op): every rounding error below is relative to it. M_f: M with, in attention, each score's own
//!   magnitude folded in (an absolute error e in a score s changes exp(s) by the relative e).
//! - The f32 term 2 L u32 M_f, u32 = 2^-24, L = the length of the longest f32 reduction feeding the
//!   element plus the head dim plus 16: summing L terms in f32, in any order (sequential, tree, by tiles
//!   with rescaling), errs by at most gamma_L sum|terms| <= 1.01 L u32 sum|terms| (Higham, "Accuracy and
//!   Stability of Numerical Algorithms", 2nd ed., Lemma 3.1 and §3.1); the +16 and the factor 2 cover the
//!   elementwise steps (expf, logf, rsqrtf, divisions: a few ulps each) and second-order terms. Products of
//!   16-bit values are exact in f32, so the inputs add nothing.
//! - 2 u_op M (twice the bound, as for h): u_op = 2^-8 (bf16) or 2^-11 (f16) where the kernel rounds an intermediate operand to the
//!   storage type, else 0: operands a_k(1 + d_k), |d_k| <= u, move sum a_k b_k by at most u sum |a_k b_k|
//!   = u M. Attention's tensor-core tiles round P and dS before their MMAs (FA2's choice); a row with one
//!   visible key has P = 1 and dS = 0, exact, so M counts only rows with two or more keys. RMSNorm rounds
//!   the normalised row before the weight (HF's order): that rounding is part of the op, so the reference
//!   applies it too, and M holds ulp(xhat)/u |w| only where xhat lies so close to a rounding midpoint that
//!   the kernel's f32 xhat may round the other way.
//!
//! This is a correct kernel's worst-case error, to first order in u32. It does not grow with a 16-bit
//! accumulator: the former rule ("at most 2x a naive 16-bit implementation that rounds every partial
//! sum") was about as large as the output itself on a 33K-term row, so a kernel off by several percent
//! passed. A kernel off by 1% fails wherever E is small against |y| and |y|'s significand is large (RoPE,
//! RMSNorm, the dlogits, single-key rows of causal attention: at |y| = 1.9 x 2^e in bf16, B = 2^(e-7) =
//! 0.41% of |y| while the error is 1% of |y| less half an ulp);
//! tests/tools/selftest_perturbed.rs checks that with kernels perturbed through `HARPE_EMU_PERTURB`
//! (ops::emu::perturb) and that every unperturbed row passes with margin.
//! Not done here: the CPU-vs-GPU training run (scripts/gpu-check.sh), timing (`harpe bench`).
//!
//! The files: `check.rs` (targets, dtypes, a row and the bounds it is held to), `kernels.rs` (RoPE,
//! RMSNorm, cross-entropy and AdamW rows), `attention.rs`, `candle_flash.rs` and `flash2.rs` (the attention
//! rows);
//! this file runs them and prints the table.
pub mod attention;
pub mod candle_flash;
pub mod check;
pub mod flash2;
pub mod kernels;

pub use check::{check16, Bound16, Check, Dt, Exact, Target};
pub use kernels::{adamw_checks, adamw_scalars, cross_entropy_checks, rms_norm_checks, rope_checks};

use anyhow::{bail, Result};
use candle_core::Device;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Every check on `target` with inputs drawn from `seed`, each group handed to `sink` as soon as it is
/// computed (so a run cut short still shows the rows it made).
pub fn run_all(target: &Target, seed: u64, sink: &mut dyn FnMut(&[Check])) -> Result<()> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    for dt in [Dt::F32, Dt::Bf16] {
        sink(&rope_checks(target, dt, &mut r)?);
        sink(&rms_norm_checks(target, dt, &mut r)?);
        sink(&cross_entropy_checks(target, dt, &mut r)?);
        sink(&adamw_checks(target, dt, &mut r)?);
    }
    attention::checks_each(target, &mut r, sink)?;
    sink(&candle_flash::checks(target, &mut r)?);
    sink(&flash2::checks(target, &mut r)?);
    Ok(())
}

/// The rows of the checks above as one Vec (tests).
pub fn all_checks(target: &Target, seed: u64) -> Result<Vec<Check>> {
    let mut out = Vec::new();
    run_all(target, seed, &mut |cs: &[Check]| out.extend_from_slice(cs))?;
    Ok(out)
}

/// The table's header line.
fn print_header(target: &Target) {
    println!("harpe selftest — target: {}", target.name());
    println!(
        "{:<26} {:<5} {:<32} {:>10} {:>10} {:>9}  {:<24} result",
        "kernel", "dtype", "case", "err", "bound", "err/bound", "rule"
    );
}

/// One row of the table (printed, and flushed by stdout's line buffering, as soon as it is known).
fn print_row(c: &Check) {
    println!(
        "{:<26} {:<5} {:<32} {:>10.3e} {:>10.3e} {:>9.3}  {:<24} {}",
        c.kernel,
        c.dtype.name(),
        c.case,
        c.max_err,
        c.bound,
        c.ratio,
        c.rule,
        if c.pass { "PASS" } else { "FAIL" }
    );
}

/// Print the table; true when every check passed.
pub fn print_table(target: &Target, checks: &[Check]) -> bool {
    print_header(target);
    checks.iter().for_each(print_row);
    print_summary(checks)
}

/// The closing lines: counts and the largest ratio of a passing row (the margin); true when all passed.
fn print_summary(checks: &[Check]) -> bool {
    let failed = checks.iter().filter(|c| !c.pass).count();
    let margin = checks.iter().filter(|c| c.pass).map(|c| c.ratio).fold(0.0, f64::max);
    println!("{} checks, {} failed; largest err/bound of a passing row {margin:.3}", checks.len(), failed);
    failed == 0
}

/// Check every kernel against its CPU reference.
#[derive(clap::Args, Debug)]
pub struct SelftestArgs {
    /// where the kernels run: `cuda` (needs a build with --features cuda and a GPU) or `emulated` (the
    /// kernels' source compiled for the host; the default in a CPU build)
    #[arg(long)]
    pub target: Option<String>,
    /// seed of the random inputs and sizes (default: from the clock, printed)
    #[arg(long)]
    pub seed: Option<u64>,
    /// how many rounds of fresh inputs
    #[arg(long, default_value_t = 2)]
    pub rounds: u64,
    /// print the results as JSON instead of a table
    #[arg(long)]
    pub json: bool,
    /// only list the devices this harpe sees (CUDA: name, free and total memory; a CPU build: the host's
    /// cores and available memory) and exit: scripts/gpu-check.sh's preflight
    #[arg(long)]
    pub devices: bool,
}

/// `harpe selftest --devices`.
fn print_devices() -> Result<()> {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let build = if cfg!(feature = "cuda") { "CUDA" } else { "CPU" };
    println!("harpe {} ({build} build)", env!("CARGO_PKG_VERSION"));
    if cfg!(feature = "cuda") {
        let mut n = 0;
        // device_memory asks the driver through the device's primary context; the first index that
        // cannot be opened ends the list (an error on device 0 is the answer: no usable GPU)
        for i in 0..64 {
            match crate::device::device_memory(&crate::device::DeviceSpec::Cuda(i), "--devices") {
                Ok(Some(m)) => {
                    println!("cuda:{i} {}: {:.1} GiB free of {:.1} GiB", m.name, gib(m.free), gib(m.total));
                    n += 1;
                }
                Err(e) if i == 0 => return Err(e),
                _ => break,
            }
        }
        println!("{n} CUDA device(s)");
    } else {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let avail = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?.to_string();
                line.split_whitespace().nth(1)?.parse::<u64>().ok()
            })
            .map_or("unknown".to_string(), |kib| format!("{:.1} GiB", gib(kib * 1024)));
        println!("no CUDA in this build; host: {cores} cores, {avail} of memory available");
    }
    Ok(())
}

/// `harpe selftest`.
pub fn run(args: SelftestArgs) -> Result<()> {
    if args.devices {
        return print_devices();
    }
    let target = match args.target.as_deref() {
        Some("emulated") => Target::Emulated,
        Some("cuda") => Target::Cuda(open_cuda()?),
        None if cfg!(feature = "cuda") => Target::Cuda(open_cuda()?),
        None => {
            eprintln!(
                "note: this is a CPU build; running the host-emulated kernels (build with --features cuda for the GPU)"
            );
            Target::Emulated
        }
        Some(o) => bail!("--target {o}: unknown\nhint: use --target cuda or --target emulated"),
    };
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
    });
    let mut all = Vec::new();
    if !args.json {
        println!("seed {seed} (rerun with --seed {seed})");
        print_header(&target);
    }
    for round in 0..args.rounds.max(1) {
        run_all(&target, seed.wrapping_add(round), &mut |cs: &[Check]| {
            if !args.json {
                cs.iter().for_each(print_row);
            }
            all.extend_from_slice(cs);
        })?;
    }
    if let (false, Some(n)) = (args.json, flash2::note(&target)) {
        println!("{n}");
    }
    let ok = if args.json {
        println!("{}", serde_json::json!({"target": target.name(), "seed": seed, "checks": all}));
        all.iter().all(|c| c.pass)
    } else {
        print_summary(&all)
    };
    if !ok {
        bail!("selftest: some kernels disagree with their CPU reference (FAIL rows above)\nhint: rerun with the printed --seed; report the table with the GPU name and driver version");
    }
    Ok(())
}

/// CUDA device 0 or an error that names what is missing.
pub fn open_cuda() -> Result<Device> {
    if !cfg!(feature = "cuda") {
        bail!("--target cuda: this harpe was built without CUDA\nhint: build with `cargo build --release --features cuda` (README: Build for GPUs), or use --target emulated");
    }
    let dev = Device::new_cuda(0).map_err(|e| {
        anyhow::anyhow!("cannot open CUDA device 0: {e}\nhint: check `nvidia-smi`; the driver must support CUDA 13 and the GPU must be sm_80 or newer")
    })?;
    crate::device::keep_freed_device_memory(&dev)?;
    Ok(dev)
}
