//! `tessera bench`: llama-bench's two measurements, run through the serving engine (the one
//! the server drives) so they compare directly with llama-bench and with serving.
//! `pp N`: a request of N random prompt tokens, timed from submission to its first token (one
//! prefill pass from an empty cache).
//! `tg N`: N greedy decode steps after the first token (timed from the first token to the last).
//! With `--depth D`, each test's prompt starts with the same D random tokens, computed once
//! beforehand and served from the prefix cache (llama-bench's `-d`; a partial last block of the
//! D is recomputed); with `--batch B`, tg runs B requests that decode together in every step.
//! Each is repeated; mean ± sample standard deviation of tokens/s is reported, and the
//! process's peak resident memory.

use super::model_path::{ModelArg, TpArgs};
use super::perplexity::ComputePath;
use anyhow::{anyhow, bail, Result};
use clap::Args;
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};
use tessera_engine::device::Device;
use tessera_engine::sample::SamplingParams;
use tessera_engine::serve::{Engine, EngineConfig, Event, GenRequest, RequestStream};
use tessera_engine::LoadedModel;

/// Arguments of `tessera bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    tp: TpArgs,
    /// Prompt lengths to time (0 to skip).
    #[arg(short = 'p', long, value_delimiter = ',', default_value = "512")]
    pp: Vec<usize>,
    /// Generation lengths to time (0 to skip).
    #[arg(short = 'n', long, value_delimiter = ',', default_value = "128")]
    tg: Vec<usize>,
    /// Context depth: tokens already in the cache (prefilled, untimed) before each test, as llama-bench's `-d`.
    #[arg(short = 'd', long, default_value_t = 0)]
    depth: usize,
    /// Sequences decoding together in tg tests (aggregate tokens/s is reported).
    #[arg(short = 'b', long, default_value_t = 1)]
    batch: usize,
    /// Repetitions of each test.
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: usize,
    /// Force one arithmetic path on every linear layer (default: what `serve` runs).
    #[arg(long, value_enum)]
    compute: Option<ComputePath>,
    /// Where to run: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: Device,
}

/// The engine, its model, and the depth prefix every test's prompts start with.
struct Bench {
    engine: Engine,
    lm: std::sync::Arc<LoadedModel>,
    prefix: Vec<u32>,
    rng: rand::rngs::StdRng,
}

/// The next event that is not prompt logprobs, or why the request failed.
fn next_output(stream: &mut RequestStream) -> Result<Event> {
    loop {
        match stream.blocking_next() {
            None => bail!("the engine stopped"),
            Some(Event::Error(e)) => bail!("{e}"),
            Some(Event::PromptLogprobs(_)) => {}
            Some(e) => return Ok(e),
        }
    }
}

/// Reads `stream` to its end.
fn drain(stream: &mut RequestStream) -> Result<()> {
    while !matches!(next_output(stream)?, Event::Finished { .. }) {}
    Ok(())
}

impl Bench {
    /// Seconds each rank has spent inside collectives so far.
    fn comm_secs(&self) -> Vec<f64> {
        (0..self.lm.tensor_parallel_size()).map(|r| self.lm.rank(r).comm_stats().unwrap_or_default().nanos as f64 * 1e-9).collect()
    }

    /// A request for the depth prefix plus `n` random tokens, generating `max_tokens` greedily.
    fn request(&mut self, n: usize, max_tokens: usize) -> GenRequest {
        let vocab = self.lm.model.config().vocab_size as u32;
        let mut prompt = self.prefix.clone();
        prompt.extend((0..n).map(|_| self.rng.gen_range(0..vocab)));
        let mut r = GenRequest::new("bench", prompt, SamplingParams::greedy(), max_tokens);
        r.ignore_eos = true;
        r
    }

    /// Computes the depth prefix once, so later prompts find it in the prefix cache.
    fn fill_prefix(&mut self) -> Result<()> {
        if self.prefix.is_empty() {
            return Ok(());
        }
        let mut r = GenRequest::new("bench-depth", self.prefix.clone(), SamplingParams::greedy(), 1);
        r.ignore_eos = true;
        let mut stream = self.engine.submit(r)?;
        drain(&mut stream)?;
        Ok(())
    }

    /// One pp test: tokens/s of an `n`-token prefill, and each rank's share of it in collectives.
    fn pp(&mut self, n: usize) -> Result<(f64, Vec<f64>)> {
        let req = self.request(n, 1);
        let comm0 = self.comm_secs();
        let t = Instant::now();
        let mut stream = self.engine.submit(req)?;
        next_output(&mut stream)?;
        let secs = t.elapsed().as_secs_f64();
        let comm = self.comm_secs().iter().zip(comm0).map(|(a, b)| (a - b) / secs).collect();
        drain(&mut stream)?;
        Ok((n as f64 / secs, comm))
    }

    /// One tg test: aggregate tokens/s of `n` decode steps of `batch` requests together.
    fn tg(&mut self, n: usize, batch: usize) -> Result<(f64, Vec<f64>)> {
        let reqs: Vec<GenRequest> = (0..batch).map(|_| self.request(1, n + 1)).collect();
        let mut streams: Vec<RequestStream> = reqs.into_iter().map(|r| self.engine.submit(r)).collect::<Result<_, _>>()?;
        // Every request's first token comes from the same prefill step; decoding starts then.
        for s in &mut streams {
            next_output(s)?;
        }
        let (t, comm0) = (Instant::now(), self.comm_secs());
        for s in &mut streams {
            drain(s)?;
        }
        let secs = t.elapsed().as_secs_f64();
        let comm = self.comm_secs().iter().zip(comm0).map(|(a, b)| (a - b) / secs).collect();
        Ok(((n * batch) as f64 / secs, comm))
    }
}

fn mean_std(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = if v.len() > 1 { v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (mean, var.sqrt())
}

/// Peak resident set size of this process in MiB (Linux `VmHWM`).
fn peak_rss_mib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<f64>().ok()? / 1024.0)
}

/// Bytes of the model: the GGUF file, or a directory's safetensors shards.
fn model_bytes(path: &std::path::Path) -> u64 {
    let size = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    if !path.is_dir() {
        return size(path);
    }
    std::fs::read_dir(path)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| size(&p))
        .sum()
}

/// Runs the command.
pub fn run(args: BenchArgs) -> Result<()> {
    let path = args.model.path()?;
    let lm = args.model.load_for(&args.tp, args.device, args.compute)?;
    let tp = lm.tensor_parallel_size();
    let file_mib = model_bytes(&path) as f64 / (1 << 20) as f64;
    let (d, b) = (args.depth, args.batch.max(1));
    let pp_max = args.pp.iter().copied().max().unwrap_or(0);
    let longest = pp_max.max(args.tg.iter().map(|n| n + 1).max().unwrap_or(0));
    let context = lm.model.config().max_position_embeddings;
    if d + longest > context {
        bail!("depth {d} plus {longest} tokens exceeds the model's context of {context}");
    }
    let block_size = EngineConfig::default().block_size;
    // One prefill chunk holds the longest pp prompt (plus the depth's partial block), or every
    // tg request's first step at once.
    let config = EngineConfig {
        max_num_seqs: b,
        max_num_batched_tokens: pp_max.max(b * block_size) + block_size + b,
        max_waiting: b + 1,
        device: args.device,
        ..EngineConfig::default()
    }
    .with_pool_for(lm.model.config(), b + 1, d + longest);
    let engine = Engine::start(lm.clone(), config).map_err(|e| anyhow!(e))?;
    println!(
        "model: {} ({file_mib:.1} MiB) | threads: {} | tensor-parallel ranks: {tp} | device: {} | cpu: {}",
        path.display(),
        rayon::current_num_threads(),
        args.device,
        lm.caps
    );
    println!("| {:<13} | {:>16} | {:>14} |", "test", "t/s", "collectives");
    println!("| {:-<13} | {:->16} | {:->14} |", "", "", "");
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let vocab = lm.model.config().vocab_size as u32;
    let prefix = (0..d).map(|_| rng.gen_range(0..vocab)).collect();
    let mut bench = Bench { engine, lm, prefix, rng };
    bench.fill_prefix()?;
    let tests = args.pp.iter().filter(|&&n| n > 0).map(|&n| ("pp", n)).chain(args.tg.iter().filter(|&&n| n > 0).map(|&n| ("tg", n)));
    for (kind, n) in tests {
        let mut run = || if kind == "pp" { bench.pp(n) } else { bench.tg(n, b) };
        // One warm-up run (page faults, thread pool start), as llama-bench does.
        run()?;
        let v = (0..args.repetitions.max(1)).map(|_| run()).collect::<Result<Vec<_>>>()?;
        let (mean, sd) = mean_std(&v.iter().map(|r| r.0).collect::<Vec<_>>());
        let share: Vec<String> = (0..tp).map(|r| format!("{:.1}%", 100.0 * v.iter().map(|x| x.1[r]).sum::<f64>() / v.len() as f64)).collect();
        let mut name = if d > 0 { format!("{kind}{n} @ d{d}") } else { format!("{kind}{n}") };
        if kind == "tg" && b > 1 {
            name = format!("{name} x{b}");
        }
        let comm = if tp > 1 { share.join(" / ") } else { "-".into() };
        println!("| {name:<13} | {mean:>9.2} ± {sd:>4.2} | {comm:>14} |");
    }
    bench.engine.shutdown(Duration::ZERO);
    if let Some(peak) = peak_rss_mib() {
        println!("peak RSS: {peak:.1} MiB ({:.2}x the model's files)", peak / file_mib.max(1e-9));
    }
    Ok(())
}
