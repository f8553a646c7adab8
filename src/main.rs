//! harpe command line: one subcommand -> one `run()`; nothing else lives here.
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "harpe", version, about = "Continual pretraining of Llama models to long context with head-adaptive RoPE, and its evaluation")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Choose HARPE's per-head RoPE bases: the paper's Table 2, uniform sets, or the peak-valley search
    SearchBases(harpe::model::base_search::SearchBasesArgs),
}

fn main() {
    let cli = Cli::parse();
    let res: anyhow::Result<()> = match cli.cmd {
        Cmd::SearchBases(a) => harpe::model::base_search::run(a),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
