//! `tessera generate`: one prompt through the serving engine, streamed text, then prefill and
//! decode speed.

use super::kv_args::KvCacheArgs;
use super::model_path::{ModelArg, TpArgs};
use super::perplexity::ComputePath;
use super::SamplingArgs;
use anyhow::{anyhow, bail, Result};
use clap::Args;
use std::io::Write;
use std::time::Instant;
use tessera_engine::device::Device;
use tessera_engine::serve::{Engine, EngineConfig, Event, GenRequest};

/// Arguments of `tessera generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Prompt text (special tokens such as <|im_start|> are recognised).
    #[arg(long)]
    prompt: String,
    /// Most tokens to generate (fewer when the context fills first).
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
    let lm = args.model.load_for(&args.tp, args.device, args.compute)?;
    let prompt = lm.tokenizer.encode(&args.prompt).map_err(|e| anyhow!("tokenizing the prompt: {e}"))?;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let context = lm.model.config().max_position_embeddings;
    let max_tokens = args.max_tokens.min(context.saturating_sub(prompt.len()));
    let config = EngineConfig {
        max_num_seqs: 1,
        max_num_batched_tokens: 513,
        prefix_caching: false,
        max_waiting: 1,
        kv_dtype: args.kv.dtype()?,
        device: args.device,
        ..EngineConfig::default()
    }
    .with_pool_for(lm.model.config(), 1, prompt.len() + max_tokens);
    let engine = Engine::start(lm, config).map_err(|e| anyhow!(e))?;
    eprintln!("kv cache: {}", engine.info().kv_cache_type);
    let mut req = GenRequest::new("generate", prompt.clone(), params, max_tokens);
    req.stop_token_ids = args.stop_token_ids.clone();
    req.ignore_eos = args.ignore_eos;
    let t0 = Instant::now();
    let mut stream = engine.submit(req)?;
    let mut first = None;
    let mut stdout = std::io::stdout();
    let mut end = None;
    while let Some(event) = stream.blocking_next() {
        match event {
            Event::Delta { text, .. } => {
                first.get_or_insert_with(Instant::now);
                stdout.write_all(text.as_bytes())?;
                stdout.flush()?;
            }
            Event::Finished { reason, usage, .. } => end = Some((reason, usage)),
            Event::Error(e) => bail!("generation failed: {e}"),
            Event::PromptLogprobs(_) => {}
        }
    }
    let t_end = Instant::now();
    engine.shutdown(std::time::Duration::ZERO);
    println!();
    let (reason, usage) = end.ok_or_else(|| anyhow!("the engine stopped before the request finished"))?;
    let first = first.unwrap_or(t_end);
    let prefill = (first - t0).as_secs_f64();
    let decode = (t_end - first).as_secs_f64();
    let decoded = usage.completion_tokens.saturating_sub(1);
    eprintln!(
        "prefill: {} tokens in {prefill:.3} s ({:.1} tok/s) | decode: {decoded} tokens in {decode:.3} s ({:.1} tok/s) | finish: {}",
        usage.prompt_tokens,
        usage.prompt_tokens as f64 / prefill.max(1e-9),
        decoded as f64 / decode.max(1e-9),
        reason.as_str()
    );
    Ok(())
}
