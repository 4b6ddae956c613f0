//! `tessera convert`: checkpoint format conversions (`gguf-to-hf`).

use anyhow::{Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use std::path::PathBuf;
use tessera_engine::checkpoint::Checkpoint;
use tessera_engine::convert::{to_hf_dir, ConvertOptions};
use tessera_engine::float_dtype::FloatDtype;

/// Arguments of `tessera convert`.
#[derive(Args, Debug)]
pub struct ConvertArgs {
    #[command(subcommand)]
    command: ConvertCommand,
}

#[derive(Subcommand, Debug)]
enum ConvertCommand {
    /// A GGUF Llama model to a Hugging Face directory (config.json, safetensors, tokenizer files).
    GgufToHf(GgufToHfArgs),
}

/// Output float type.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum DtypeArg {
    Bf16,
    F16,
    F32,
}

/// Arguments of `tessera convert gguf-to-hf`.
#[derive(Args, Debug)]
struct GgufToHfArgs {
    /// GGUF file.
    #[arg(long)]
    input: PathBuf,
    /// Output directory (created if missing).
    #[arg(long)]
    output: PathBuf,
    /// Float type of every output tensor (quantized GGUF tensors are dequantized, then rounded).
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: DtypeArg,
    /// Split the weights into shards of at most this many MiB (default: one model.safetensors).
    #[arg(long)]
    max_shard_mib: Option<u64>,
}

/// Runs the command.
pub fn run(args: ConvertArgs) -> Result<()> {
    let ConvertCommand::GgufToHf(a) = args.command;
    let ck = Checkpoint::open(&a.input)?;
    let dtype = match a.dtype {
        DtypeArg::Bf16 => FloatDtype::BF16,
        DtypeArg::F16 => FloatDtype::F16,
        DtypeArg::F32 => FloatDtype::F32,
    };
    let opts = ConvertOptions { dtype, max_shard_bytes: a.max_shard_mib.map(|m| m << 20) };
    let s = to_hf_dir(&ck, &a.output, &opts).with_context(|| format!("converting {}", a.input.display()))?;
    println!(
        "wrote {}: {} tensors ({:.1} MiB, {}) in {}",
        a.output.display(),
        s.tensors,
        s.bytes as f64 / (1u64 << 20) as f64,
        dtype.torch_name(),
        s.shards.join(", ")
    );
    Ok(())
}
