//! harpe command line: one subcommand -> one `run()`; nothing else lives here.
use clap::{Parser, Subcommand};
use harpe::device::as_pool_worker;

/// jemalloc, not glibc malloc: activations and gradients are fresh buffers of up to hundreds of MB every
/// step (candle's backward alone allocates a zeroed gradient per node). glibc returned each one over its
/// 32 MiB mmap threshold to the kernel on free, and the next step faulted in zeroed pages again: 2.6M page
/// faults in 5 steps of a hidden-768 model, `clear_page_erms` ~8% of the samples (CPU measurements:
/// benches/results/README.md).
#[cfg(all(unix, not(target_env = "musl")))]
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options (the `_RJEM_MALLOC_CONF` environment variable overrides them):
/// - `dirty_decay_ms:-1,muzzy_decay_ms:-1`: freed pages stay with the process for the next step's buffers
///   (the footprint stays at the step's peak, which the next step reaches again anyway);
/// - `oversize_threshold:0`: no separate arena that returns allocations over 8 MiB to the kernel at once;
/// - `thp:always`: besides huge pages where the kernel allows them, a `calloc` (every `vec![0.0; n]`) of
///   reused memory is zeroed with memset; otherwise jemalloc zeroes it by MADV_DONTNEED and the page
///   faults come back (3.97M in those 5 steps; 2992 with these options);
/// - `narenas:1`: one arena, so a buffer one thread frees serves the next allocation of any thread; with
///   jemalloc's 4 arenas per CPU the process peak rose 17-24% above `harpe plan`'s CPU prediction
///   (tests/stage_train/plan_memory.rs), with one it stays within that test's 15%.
#[cfg(all(unix, not(target_env = "musl")))]
#[allow(non_upper_case_globals)]
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static malloc_conf: &[u8] = b"dirty_decay_ms:-1,muzzy_decay_ms:-1,oversize_threshold:0,thp:always,narenas:1\0";

/// `harpe --version`: the package version, the cargo features the binary was built with, the CUDA release it
/// was built for with the oldest driver branch that runs it (a CUDA build), its CPU GEMM backend and the
/// vector ISA its CPU kernels take on this CPU (benchmark records name the build they measured: scripts/bench_train_torch.py reads this line).
fn version() -> &'static str {
    static V: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    V.get_or_init(|| {
        let features = [
            ("cuda", cfg!(feature = "cuda")),
            ("nccl", cfg!(feature = "nccl")),
            ("flash-attn", cfg!(feature = "flash-attn")),
            ("mkl", cfg!(feature = "mkl")),
            ("avx512", cfg!(feature = "avx512")),
        ];
        let on: Vec<&str> = features.iter().filter(|f| f.1).map(|f| f.0).collect();
        let on = if on.is_empty() { "none".to_string() } else { on.join(", ") };
        let cuda = match harpe::floors::build_cuda_version() {
            Some(v) => format!(
                "; CUDA {} (driver {} or newer)",
                harpe::floors::cuda_version_text(v),
                harpe::floors::driver_branch(v)
            ),
            None => String::new(),
        };
        format!(
            "{} (features: {on}{cuda}; CPU GEMM: {}; CPU kernels: {})",
            env!("CARGO_PKG_VERSION"),
            harpe::ops::cpu_gemm::backend(),
            harpe::ops::cpu_vec::isa()
        )
    })
}

#[derive(Parser)]
#[command(
    name = "harpe",
    version = version(),
    about = "Continual pretraining of Llama models to long context with head-adaptive RoPE, and its evaluation"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Read a SlimPajama-style corpus, tokenize, apply a length/mixture strategy, pack into shards
    PrepareData(Box<harpe::data::prepare_args::PrepareDataArgs>),
    /// Summarise a prepared dataset: mixture table, length histogram, decode a sequence
    InspectData(harpe::data::inspect::InspectDataArgs),
    /// Train (continual pretraining, single- or multi-stage) from a TOML recipe; checkpoint, resume, log
    Train(harpe::train::TrainArgs),
    /// Sliding-window perplexity of text files under a model directory
    EvalPpl(harpe::eval::ppl::EvalPplArgs),
    /// Next-token loss on a prepared dataset by source and by position bucket (Fu et al. Table 5)
    EvalLoss(harpe::eval::eval_loss::EvalLossArgs),
    /// Greedy continuation of token ids with a KV cache, timed (tokens/s as one JSON line)
    Generate(harpe::eval::generate::GenerateArgs),
    /// RULER's needle tasks, passkey and the needle grid: prompts, generation, scores, heatmaps
    EvalNiah(harpe::eval::niah_run::EvalNiahArgs),
    /// MMLU, HellaSwag, ARC, PIQA, TriviaQA from local files with lm-evaluation-harness's prompts and metrics
    EvalTasks(Box<harpe::eval::tasks::run::EvalTasksArgs>),
    /// Choose HARPE's per-head RoPE bases: the paper's Table 2, uniform sets, or the peak-valley search
    SearchBases(harpe::research::bases::cli::SearchBasesArgs),
    /// Parameter count, shapes, dtypes, RoPE scheme and memory of a model directory
    Inspect(harpe::model::inspect::InspectArgs),
    /// Check a checkpoint or a prepared dataset against its recorded checksums, naming every damaged block
    Verify(harpe::tools::verify::VerifyArgs),
    /// A plain HF model plus one optimizer state file from a sharded (multi-rank) checkpoint
    Consolidate(harpe::train::checkpoint::consolidate::ConsolidateArgs),
    /// An HF model directory (config, safetensors, tokenizer.json) from a llama.cpp GGUF file
    Convert(harpe::tools::convert::ConvertArgs),
    /// Per-GPU memory by term, step time and tokens/s of a run before it starts; whether it fits
    Plan(harpe::tools::plan::PlanArgs),
    /// Train and evaluate many runs (arms x grid x seeds) as one resumable sweep, in parallel processes
    Sweep(harpe::research::sweep::SweepArgs),
    /// One table of a sweep: mean ± std over seeds, paired differences with 95% intervals, curves, cost
    Report(harpe::research::report::ReportArgs),
    /// The whole pipeline on built-in data, on CPU (the README's first command)
    Demo(harpe::tools::demo::DemoArgs),
    /// Start or join a multi-process group, rendezvous, share a payload, barrier (launcher smoke test)
    #[command(hide = true)]
    DistCheck(harpe::launch::spawn::DistCheckArgs),
    /// Every harpe kernel against its CPU reference (fwd+bwd, f32/bf16, ragged sizes); exit 1 on FAIL
    Selftest(harpe::tools::selftest::SelftestArgs),
    /// Time each harpe kernel on the GPU: GB/s, percent of copy bandwidth, and PyTorch side by side
    Bench(harpe::tools::bench::BenchArgs),
}

fn main() {
    harpe::device::init_cpu_runtime();
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::PrepareData(a) => harpe::data::prepare_args::run(*a),
        Cmd::InspectData(a) => harpe::data::inspect::run(a),
        Cmd::Train(a) => harpe::train::run(a),
        Cmd::EvalPpl(a) => as_pool_worker(|| harpe::eval::ppl::run(a)),
        Cmd::EvalLoss(a) => as_pool_worker(|| harpe::eval::eval_loss::run(a)),
        Cmd::Generate(a) => as_pool_worker(|| harpe::eval::generate::run(a)),
        Cmd::EvalNiah(a) => as_pool_worker(|| harpe::eval::niah_run::run(a)),
        Cmd::EvalTasks(a) => as_pool_worker(|| harpe::eval::tasks::run::run(*a)),
        Cmd::SearchBases(a) => harpe::research::bases::cli::run(a),
        Cmd::Inspect(a) => harpe::model::inspect::run(a),
        Cmd::Verify(a) => harpe::tools::verify::run(a),
        Cmd::Consolidate(a) => harpe::train::checkpoint::consolidate::run(a),
        Cmd::Convert(a) => harpe::tools::convert::run(a),
        Cmd::Plan(a) => harpe::tools::plan::run(a),
        Cmd::Sweep(a) => harpe::research::sweep::run(a),
        Cmd::Report(a) => harpe::research::report::run(a),
        Cmd::Demo(a) => harpe::tools::demo::run(a),
        Cmd::DistCheck(a) => harpe::launch::spawn::run_check(a),
        Cmd::Selftest(a) => harpe::tools::selftest::run(a),
        Cmd::Bench(a) => harpe::tools::bench::run(a),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
