//! `tessera perplexity`: llama.cpp's perplexity method over a text file.

use super::kv_args::KvCacheArgs;
use super::model_path::{ModelArg, TpArgs};
use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use std::io::Write;
use std::path::PathBuf;
use tessera_engine::device::Device;
use tessera_engine::perplexity::{available_chunks, perplexity, PerplexityOptions};
use tessera_kernels::linear::LinearPolicy;

/// Which arithmetic the linear layers use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ComputePath {
    /// Weights dequantized to f32 panels, f32 activations (compare with llama.cpp's F16 figure).
    Float,
    /// What `serve`, `generate` and `bench` run unless told otherwise: the integer GEMM for
    /// GGUF quantized types at every batch size, and bf16 activations for W4A16 checkpoint
    /// layers where the CPU has the AVX-512 BF16 dot.
    Default,
    /// Activations quantized per token to 8-bit blocks, integer dots (llama.cpp's Q4_1
    /// kernels); W4A16 checkpoint layers take int8 per-token activations and the W4A8 kernel.
    Int8Act,
}

impl ComputePath {
    /// The kernel policy that forces this path on every linear layer.
    pub fn policy(self) -> LinearPolicy {
        match self {
            ComputePath::Float => LinearPolicy::ALWAYS_GEMM,
            ComputePath::Default => LinearPolicy::DEFAULT,
            ComputePath::Int8Act => LinearPolicy::ALWAYS_DOT,
        }
    }
}

/// Arguments of `tessera perplexity`.
#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Text file to score.
    #[arg(long)]
    file: PathBuf,
    /// Window length in tokens.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Most windows to score (default: all).
    #[arg(long)]
    chunks: Option<usize>,
    /// Tokens per batched forward pass (windows are batched as whole sequences, like llama.cpp's n_batch).
    #[arg(long, default_value_t = 2048)]
    batch: usize,
    /// Arithmetic of the linear layers (the CUDA backend computes `float` only).
    #[arg(long, value_enum, default_value_t = ComputePath::Float)]
    compute: ComputePath,
    #[command(flatten)]
    kv: KvCacheArgs,
    /// Where to run: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: Device,
    #[command(flatten)]
    tp: TpArgs,
    /// Seed of the QJL projections and HQMQ codebooks.
    #[arg(long, default_value_t = 0)]
    kv_cache_seed: u64,
}

/// Runs the command.
pub fn run(args: PerplexityArgs) -> Result<()> {
    if args.ctx < 4 {
        bail!("--ctx must be at least 4");
    }
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let lm = args.model.load_for(&args.tp, args.device, Some(args.compute))?;
    if args.ctx > lm.model.config().max_position_embeddings {
        bail!("--ctx {} exceeds the model's context {}", args.ctx, lm.model.config().max_position_embeddings);
    }
    let tokens = lm.tokenizer.encode(&text).map_err(|e| anyhow!("tokenizing: {e}"))?;
    let avail = available_chunks(tokens.len(), args.ctx);
    if avail == 0 {
        bail!("{} tokens is less than one window of {}", tokens.len(), args.ctx);
    }
    let n = args.chunks.unwrap_or(avail).min(avail);
    let special = lm.tokenizer.special();
    let opts = PerplexityOptions {
        chunks: Some(n),
        bos: if special.add_bos { special.bos } else { None },
        kv: args.kv.dtype()?,
        kv_seed: args.kv_cache_seed,
        device: args.device,
        ..PerplexityOptions::new(args.ctx, (args.batch / args.ctx).max(1))
    };
    let kernel = lm.model.plan().first().map(|p| p.kernel.clone()).unwrap_or_default();
    eprintln!(
        "perplexity: {} tokens, {n} chunks of {} (n_seq {}), compute path {:?} ({kernel}), kv cache {}, device {}, tensor-parallel ranks {}",
        tokens.len(),
        args.ctx,
        opts.seqs_per_batch,
        args.compute,
        opts.kv,
        args.device,
        lm.tensor_parallel_size()
    );
    let t0 = std::time::Instant::now();
    let report = perplexity(lm, &tokens, &opts, |r| {
        print!("[{}]{:.4},", r.chunks, r.ppl());
        let _ = std::io::stdout().flush();
    })
    .map_err(|e| anyhow!(e))?;
    println!();
    println!("Final estimate: PPL = {:.4} +/- {:.5}", report.ppl(), report.stderr());
    let secs = t0.elapsed().as_secs_f64();
    eprintln!("scored {} tokens in {secs:.1} s ({:.1} tok/s evaluated, engine start included)", report.count, (report.chunks * args.ctx) as f64 / secs);
    Ok(())
}
