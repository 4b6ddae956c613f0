//! `tessera generate`: one prompt, streamed text, then prefill and decode speed.

use super::model_path::{ModelArg, TpArgs};
use super::kv_args::KvCacheArgs;
use super::perplexity::ComputePath;
use super::SamplingArgs;
use anyhow::{anyhow, Result};
use clap::Args;
use std::io::Write;
use tessera_engine::device::Device;
use tessera_engine::generate::{generate, generate_with, GenerateOptions, Generation};
use tessera_engine::kv_cache::KvLayout;
use tessera_engine::model::cuda::{CudaLlama, CudaStep};
use tessera_engine::tokenizer::Tokenizer;
use tessera_engine::kv_cache::DEFAULT_BLOCK_SIZE;
use tessera_engine::sample::Sampler;
use tessera_engine::weights::ModelWeights;
use tessera_kernels::cuda::CudaDevice;
use tessera_kernels::linear::LinearPolicy;
use std::sync::Arc;

/// Arguments of `tessera generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Prompt text (special tokens such as <|im_start|> are recognised).
    #[arg(long)]
    prompt: String,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Extra token ids that stop generation.
    #[arg(long, value_delimiter = ',')]
    stop_token_ids: Vec<u32>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    kv: KvCacheArgs,
    /// Where to run: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: Device,
    #[command(flatten)]
    tp: TpArgs,
    /// CPU arithmetic of the linear layers (default: `default`); `float` is the function the
    /// CUDA backend computes (f32 activations over dequantized weights), for comparing the two.
    #[arg(long, value_enum)]
    compute: Option<ComputePath>,
}

/// Runs the command.
pub fn run(args: GenerateArgs) -> Result<()> {
    let params = args.sampling.params()?;
    let mut stdout = std::io::stdout();
    let on_text = |t: &str| {
        let _ = stdout.write_all(t.as_bytes());
        let _ = stdout.flush();
    };
    let g = match args.device {
        Device::Cpu => {
            let lm = args.model.load_parallel(args.compute.map_or(LinearPolicy::DEFAULT, ComputePath::policy), &args.tp)?;
            let prompt = encode(&lm.tokenizer, &args.prompt)?;
            let dtype = args.kv.dtype()?;
            let on_text = std::sync::Mutex::new(on_text);
            // Every tensor-parallel rank runs the same loop (same logits, same samples); rank 0 prints.
            lm.run(|m| {
                let layout = lm.kv_layout_on(m, dtype, DEFAULT_BLOCK_SIZE, 0)?;
                let opts = options(&args, lm.eos_ids(), layout);
                let first = m.shard().is_none_or(|s| s.rank == 0);
                let print = |t: &str| {
                    if first {
                        (on_text.lock().unwrap_or_else(|e| e.into_inner()))(t)
                    }
                };
                anyhow::Ok(generate(m, &lm.tokenizer, &prompt, Sampler::new(params.clone(), &prompt), &opts, print)?)
            })?
        }
        Device::Cuda(_) if args.compute.is_some() => {
            return Err(anyhow!("--compute chooses the CPU's arithmetic; the CUDA backend has one (f32 activations over dequantized weights)"))
        }
        Device::Cuda(ordinal) => {
            let dev = CudaDevice::open(ordinal)?;
            eprintln!("device: {}", dev.describe());
            let weights = ModelWeights::open(&args.model.path()?)?;
            let ckpt = &weights.checkpoint;
            let tok = Tokenizer::from_checkpoint(ckpt)?;
            let prompt = encode(&tok, &args.prompt)?;
            let c = &ckpt.config;
            let layout = KvLayout::for_model(c, weights.kv_cache.as_ref(), args.kv.dtype()?, DEFAULT_BLOCK_SIZE, 0)?;
            let blocks = c.max_position_embeddings.div_ceil(DEFAULT_BLOCK_SIZE);
            let opts = options(&args, ckpt.special.eos.clone(), layout.clone());
            let mut model = CudaLlama::load(&weights, dev, layout, blocks)?;
            // The one sequence owns the whole pool, blocks in order.
            let table: Vec<u32> = (0..blocks as u32).collect();
            let mut cached = 0;
            let step = |tokens: &[u32], logits_from: Option<usize>| {
                let mut out = model.forward(&[CudaStep { tokens, blocks: &table, cached, logits_from }])?;
                cached += tokens.len();
                Ok::<_, tessera_engine::model::cuda::CudaModelError>(out.swap_remove(0))
            };
            let context = c.max_position_embeddings;
            generate_with(step, context, &tok, &prompt, Sampler::new(params, &prompt), &opts, on_text)?
        }
    };
    println!();
    report(&g);
    Ok(())
}

fn encode(tok: &Tokenizer, prompt: &str) -> Result<Vec<u32>> {
    let ids = tok.encode(prompt).map_err(|e| anyhow!("tokenizing the prompt: {e}"))?;
    if ids.is_empty() {
        anyhow::bail!("the prompt is empty");
    }
    Ok(ids)
}

fn options(args: &GenerateArgs, eos: Vec<u32>, layout: Arc<KvLayout>) -> GenerateOptions {
    let mut stop_ids = args.stop_token_ids.clone();
    if !args.ignore_eos {
        stop_ids.extend(eos);
    }
    eprintln!("kv cache: {}", layout.describe());
    GenerateOptions { max_tokens: args.max_tokens, stop_ids, prefill_chunk: 512, kv: Some(layout) }
}

fn report(g: &Generation) {
    let decoded = g.tokens.len().saturating_sub(1);
    eprintln!(
        "prefill: {} tokens in {:.3} s ({:.1} tok/s) | decode: {} tokens in {:.3} s ({:.1} tok/s) | finish: {:?}",
        g.prompt_tokens,
        g.prefill_secs,
        g.prompt_tokens as f64 / g.prefill_secs.max(1e-9),
        decoded,
        g.decode_secs,
        decoded as f64 / g.decode_secs.max(1e-9),
        g.finish
    );
}
