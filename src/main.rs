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
    /// Read a SlimPajama-style corpus, tokenize, apply a length/mixture strategy, pack into shards
    PrepareData(Box<harpe::data::prepare::PrepareDataArgs>),
    /// Summarise a prepared dataset: mixture table, length histogram, decode a sequence
    InspectData(harpe::data::inspect::InspectDataArgs),
}

fn main() {
    let cli = Cli::parse();
    let res: anyhow::Result<()> = match cli.cmd {
        Cmd::PrepareData(a) => harpe::data::prepare::run(*a),
        Cmd::InspectData(a) => harpe::data::inspect::run(a),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
