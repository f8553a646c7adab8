//! harpe command line: one subcommand -> one `run()`; nothing else lives here.
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "harpe", version, about = "Continual pretraining of Llama models to long context with head-adaptive RoPE, and its evaluation")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {}

fn main() {
    let cli = Cli::parse();
    let res: anyhow::Result<()> = match cli.cmd {};
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
