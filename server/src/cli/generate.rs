//! `tessera generate`: one prompt, streamed text, then prefill and decode speed.

use super::model_path::ModelArg;
use super::kv_args::KvCacheArgs;
use super::SamplingArgs;
use anyhow::{anyhow, Result};
use clap::Args;
use std::io::Write;
use tessera_engine::generate::{generate, GenerateOptions};
use tessera_engine::kv::DEFAULT_BLOCK_SIZE;
use tessera_engine::sample::Sampler;
use tessera_kernels::linear::LinearPolicy;

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
}

/// Runs the command.
pub fn run(args: GenerateArgs) -> Result<()> {
    let lm = args.model.load(LinearPolicy::DEFAULT)?;
    let params = args.sampling.params()?;
    let prompt = lm.tokenizer.encode(&args.prompt).map_err(|e| anyhow!("tokenizing the prompt: {e}"))?;
    if prompt.is_empty() {
        anyhow::bail!("the prompt is empty");
    }
    let mut stop_ids = args.stop_token_ids.clone();
    if !args.ignore_eos {
        stop_ids.extend(lm.eos_ids());
    }
    let layout = lm.model.kv_layout(args.kv.dtype()?, DEFAULT_BLOCK_SIZE, 0)?;
    eprintln!("kv cache: {}", layout.describe());
    let opts = GenerateOptions { max_tokens: args.max_tokens, stop_ids, prefill_chunk: 512, kv: Some(layout) };
    let sampler = Sampler::new(params, &prompt);
    let mut stdout = std::io::stdout();
    let g = generate(&lm.model, &lm.tokenizer, &prompt, sampler, &opts, |t| {
        let _ = stdout.write_all(t.as_bytes());
        let _ = stdout.flush();
    })?;
    println!();
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
    Ok(())
}
