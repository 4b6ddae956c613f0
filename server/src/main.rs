//! `tessera`: Tessera's command-line entry point.

mod cli;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// Tessera: an LLM serving stack for quantized models.
#[derive(Parser, Debug)]
#[command(name = "tessera", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Prefill (pp) and decode (tg) speed, measured like llama-bench.
    Bench(cli::bench::BenchArgs),
    /// Generate text from a prompt and report prefill/decode speed.
    Generate(cli::generate::GenerateArgs),
    /// Architecture, tensors and the per-layer kernel plan.
    Inspect(cli::inspect::InspectArgs),
    /// Perplexity of a text file, llama.cpp's method (ctx windows, second half scored).
    Perplexity(cli::perplexity::PerplexityArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(a) => cli::bench::run(a),
        Command::Generate(a) => cli::generate::run(a),
        Command::Inspect(a) => cli::inspect::run(a),
        Command::Perplexity(a) => cli::perplexity::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
