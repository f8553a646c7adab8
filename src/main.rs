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
    /// Sliding-window perplexity of text files under a model directory
    EvalPpl(harpe::eval::ppl::EvalPplArgs),
    /// Parameter count, shapes, dtypes, RoPE scheme and memory of a model directory
    Inspect(harpe::model::inspect::InspectArgs),
    /// Train (continual pretraining, single- or multi-stage) from a TOML recipe; checkpoint, resume, log
    Train(harpe::train::TrainArgs),
}

fn main() {
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::EvalPpl(a) => harpe::eval::ppl::run(a),
        Cmd::Inspect(a) => harpe::model::inspect::run(a),
        Cmd::Train(a) => harpe::train::run(a),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
