//! harpe command line: one subcommand -> one `run()`; nothing else lives here.
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "harpe",
    version,
    about = "Continual pretraining of Llama models to long context with head-adaptive RoPE, and its evaluation"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Read a SlimPajama-style corpus, tokenize, apply a length/mixture strategy, pack into shards
    PrepareData(Box<harpe::data::prepare::PrepareDataArgs>),
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
    SearchBases(harpe::bases::cli::SearchBasesArgs),
    /// Parameter count, shapes, dtypes, RoPE scheme and memory of a model directory
    Inspect(harpe::model::inspect::InspectArgs),
    /// A plain HF model plus one optimizer state file from a sharded (multi-rank) checkpoint
    Consolidate(harpe::train::checkpoint::ConsolidateArgs),
    /// Per-GPU memory by term, step time and tokens/s of a run before it starts; whether it fits
    Plan(harpe::plan::PlanArgs),
    /// Train and evaluate many runs (arms x grid x seeds) as one resumable sweep, in parallel processes
    Sweep(harpe::research::sweep::SweepArgs),
    /// One table of a sweep: mean ± std over seeds, paired differences with 95% intervals, curves, cost
    Report(harpe::research::report::ReportArgs),
    /// The whole pipeline on built-in data, on CPU (the README's first command)
    Demo(harpe::demo::DemoArgs),
    /// Start or join a multi-process group, rendezvous, share a payload, barrier (launcher smoke test)
    #[command(hide = true)]
    DistCheck(harpe::comms::launch::DistCheckArgs),
    /// Every harpe kernel against its CPU reference (fwd+bwd, f32/bf16, ragged sizes); exit 1 on FAIL
    Selftest(harpe::selftest::SelftestArgs),
    /// Time each harpe kernel on the GPU: GB/s, percent of copy bandwidth, and PyTorch side by side
    Bench(harpe::bench::BenchArgs),
}

fn main() {
    harpe::device::init_cpu_runtime();
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::PrepareData(a) => harpe::data::prepare::run(*a),
        Cmd::InspectData(a) => harpe::data::inspect::run(a),
        Cmd::Train(a) => harpe::train::run(a),
        Cmd::EvalPpl(a) => harpe::eval::ppl::run(a),
        Cmd::EvalLoss(a) => harpe::eval::eval_loss::run(a),
        Cmd::Generate(a) => harpe::eval::generate::run(a),
        Cmd::EvalNiah(a) => harpe::eval::niah_run::run(a),
        Cmd::EvalTasks(a) => harpe::eval::tasks::run::run(*a),
        Cmd::SearchBases(a) => harpe::bases::cli::run(a),
        Cmd::Inspect(a) => harpe::model::inspect::run(a),
        Cmd::Consolidate(a) => harpe::train::checkpoint::consolidate(a),
        Cmd::Plan(a) => harpe::plan::run(a),
        Cmd::Sweep(a) => harpe::research::sweep::run(a),
        Cmd::Report(a) => harpe::research::report::run(a),
        Cmd::Demo(a) => harpe::demo::run(a),
        Cmd::DistCheck(a) => harpe::comms::launch::run_check(a),
        Cmd::Selftest(a) => harpe::selftest::run(a),
        Cmd::Bench(a) => harpe::bench::run(a),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
