//! `tessera perplexity`: llama.cpp's perplexity method over a text file.

use super::kv_args::KvCacheArgs;
use super::model_path::{ModelArg, TpArgs};
use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;
use tessera_engine::kv_cache::DEFAULT_BLOCK_SIZE;
use tessera_engine::perplexity::{available_chunks, perplexity, PerplexityOptions};
use tessera_kernels::linear::LinearPolicy;

/// Which arithmetic the linear layers use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ComputePath {
    /// Weights dequantized to f32 panels, f32 activations (compare with llama.cpp's F16 figure).
    Float,
    /// What `serve`, `generate` and `bench` run unless told otherwise: the integer GEMM for
    /// GGUF quantized types but Q2_K/Q3_K at every batch size, and bf16 activations for W4A16 checkpoint layers
    /// where the CPU has the AVX-512 BF16 dot.
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
    /// Arithmetic of the linear layers.
    #[arg(long, value_enum, default_value_t = ComputePath::Float)]
    compute: ComputePath,
    #[command(flatten)]
    kv: KvCacheArgs,
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
    let lm = args.model.load_parallel(args.compute.policy(), &args.tp)?;
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
        ctx: args.ctx,
        chunks: Some(n),
        seqs_per_batch: (args.batch / args.ctx).max(1),
        bos: if special.add_bos { special.bos } else { None },
        kv: None,
    };
    let dtype = args.kv.dtype()?;
    let kernel = lm.model.plan().first().map(|p| p.kernel.clone()).unwrap_or_default();
    let t0 = std::sync::Mutex::new(Instant::now());
    // Every tensor-parallel rank runs the same passes; rank 0 reports.
    let report = lm.run(|m| {
        let first = m.shard().is_none_or(|s| s.rank == 0);
        let layout = lm.kv_layout_on(m, dtype, DEFAULT_BLOCK_SIZE, args.kv_cache_seed)?;
        if first {
            eprintln!(
                "perplexity: {} tokens, {n} chunks of {} (n_seq {}), compute path {:?} ({kernel}), kv cache {}, tensor-parallel ranks {}",
                tokens.len(),
                args.ctx,
                opts.seqs_per_batch,
                args.compute,
                layout.describe(),
                lm.tensor_parallel_size()
            );
            *t0.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        }
        let opts = PerplexityOptions { kv: Some(layout), ..opts.clone() };
        anyhow::Ok(perplexity(m, &tokens, &opts, |r| {
            if first {
                print!("[{}]{:.4},", r.chunks, r.ppl());
                let _ = std::io::stdout().flush();
            }
        })?)
    })?;
    let t0 = t0.into_inner().unwrap_or_else(|e| e.into_inner());
    println!();
    let secs = t0.elapsed().as_secs_f64();
    println!("Final estimate: PPL = {:.4} +/- {:.5}", report.ppl(), report.stderr());
    eprintln!(
        "scored {} tokens in {:.1} s ({:.1} tok/s evaluated)",
        report.count,
        secs,
        (report.chunks * args.ctx) as f64 / secs
    );
    Ok(())
}
