//! `tessera`: Tessera's command-line entry point.

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use tessera_server::cli;

/// Tessera: an LLM serving stack for quantized models.
#[derive(Parser, Debug)]
#[command(name = "tessera", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log format (logs go to stderr; the level comes from $RUST_LOG).
    #[arg(long, global = true, value_enum)]
    log_format: Option<cli::LogFormat>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Prefill (pp) and decode (tg) speed, measured like llama-bench.
    Bench(cli::bench::BenchArgs),
    /// Convert a checkpoint to another format (gguf-to-hf, upcycle-moe) or write a random Llama (random-llama).
    Convert(cli::convert::ConvertArgs),
    /// Generate text from a prompt and report prefill/decode speed.
    Generate(cli::generate::GenerateArgs),
    /// Architecture, tensors and the per-layer kernel plan.
    Inspect(cli::inspect::InspectArgs),
    /// Perplexity of a text file, llama.cpp's method (ctx windows, second half scored).
    Perplexity(cli::perplexity::PerplexityArgs),
    /// Quantize a Hugging Face directory file to file (compressed-tensors or Quark).
    Quantize(cli::quantize::QuantizeArgs),
    /// OpenAI-compatible HTTP server (continuous batching over a paged KV cache).
    Serve(Box<cli::serve::ServeArgs>),
}

/// Pins glibc's mmap threshold at 1 MiB and raises its trim threshold to 32 MiB.
///
/// By default glibc raises the mmap threshold to the size of each freed mmapped block, so
/// after one long prefill its multi-MiB activation buffers are served from, and kept in, the
/// heap; pinned, they go back to the OS when freed and resident memory tracks the model plus
/// the KV cache. Only blocks under 1 MiB then come from the heap, and with the default 128 KiB
/// trim threshold every decode step handed the top of each thread's heap back with `madvise`
/// and faulted it in again on the next: TLB-shootdown interrupts and page faults that cost
/// batch-8 decode 12% (`perf`; `tessera bench -b 8` 385 -> 435 tok/s side by side). Each
/// thread's heap (arena) keeps at most the 32 MiB, and only what its sub-MiB buffers once held.
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt is called once, before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 32 << 20);
    }
}

fn main() -> ExitCode {
    tune_malloc();
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Serve(_)) {
        // The other commands print their results; logs stay quiet unless $RUST_LOG asks.
        cli::init_logging(cli.log_format.unwrap_or_default(), "error");
    }
    let result = match cli.command {
        Command::Bench(a) => cli::bench::run(a),
        Command::Convert(a) => cli::convert::run(a),
        Command::Generate(a) => cli::generate::run(a),
        Command::Inspect(a) => cli::inspect::run(a),
        Command::Perplexity(a) => cli::perplexity::run(a),
        Command::Quantize(a) => cli::quantize::run(a),
        Command::Serve(a) => cli::serve::run(*a, cli.log_format),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
