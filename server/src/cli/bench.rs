//! `tessera bench`: llama-bench's two measurements on this engine, so they compare directly.
//! `pp N`: one forward pass over N random prompt tokens from an empty cache.
//! `tg N`: N single-token decode steps (greedy) after one start token.
//! With `--depth D`, each test starts from a cache already holding D tokens (llama-bench's `-d`);
//! with `--batch B`, tg runs B sequences in lockstep through the batched forward pass.
//! Each is repeated; mean ± sample standard deviation of tokens/s is reported, and the
//! process's peak resident memory.

use super::model_path::{ModelArg, TpArgs};
use super::perplexity::ComputePath;
use anyhow::Result;
use clap::Args;
use rand::{Rng, SeedableRng};
use std::time::Instant;
use tessera_engine::kv_cache::LocalKv;
use tessera_engine::model::{LlamaModel, SeqInput};
use tessera_engine::sample::argmax;
use tessera_kernels::linear::LinearPolicy;

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
}

/// A cache already holding `depth` random tokens.
fn cache(m: &LlamaModel, depth: usize, rng: &mut rand::rngs::StdRng) -> Result<LocalKv> {
    let c = m.config();
    let mut kv = m.local_kv(c.max_position_embeddings);
    if depth > 0 {
        let tokens: Vec<u32> = (0..depth).map(|_| rng.gen_range(0..c.vocab_size as u32)).collect();
        for chunk in tokens.chunks(512) {
            m.forward(&mut [SeqInput { tokens: chunk, kv: &mut kv, logits_from: None }])?;
        }
    }
    Ok(kv)
}

fn time_pp(m: &LlamaModel, n: usize, depth: usize, rng: &mut rand::rngs::StdRng) -> Result<f64> {
    let vocab = m.config().vocab_size as u32;
    let mut kv = cache(m, depth, rng)?;
    let tokens: Vec<u32> = (0..n).map(|_| rng.gen_range(0..vocab)).collect();
    let t = Instant::now();
    m.forward(&mut [SeqInput { tokens: &tokens, kv: &mut kv, logits_from: Some(n - 1) }])?;
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

/// `n` decode steps of `batch` sequences in lockstep; aggregate tokens/s.
fn time_tg(m: &LlamaModel, n: usize, depth: usize, batch: usize, rng: &mut rand::rngs::StdRng) -> Result<f64> {
    let mut kvs = (0..batch).map(|_| cache(m, depth, rng)).collect::<Result<Vec<_>>>()?;
    let mut toks: Vec<u32> = (0..batch).map(|_| rng.gen_range(0..m.config().vocab_size as u32)).collect();
    let t = Instant::now();
    for _ in 0..n {
        let mut inputs: Vec<SeqInput<'_>> = toks
            .iter()
            .zip(kvs.iter_mut())
            .map(|(tok, kv)| SeqInput { tokens: std::slice::from_ref(tok), kv, logits_from: Some(0) })
            .collect();
        let logits = m.forward(&mut inputs)?;
        toks = logits.iter().map(|l| argmax(l)).collect();
    }
    Ok((n * batch) as f64 / t.elapsed().as_secs_f64())
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
    let lm = args.model.load_parallel(args.compute.map_or(LinearPolicy::DEFAULT, ComputePath::policy), &args.tp)?;
    let tp = lm.tensor_parallel_size();
    let file_mib = model_bytes(&path) as f64 / (1 << 20) as f64;
    println!("model: {} ({file_mib:.1} MiB) | threads: {} | tensor-parallel ranks: {tp} | cpu: {}", path.display(), rayon::current_num_threads(), lm.caps);
    println!("| {:<13} | {:>16} | {:>14} |", "test", "t/s", "collectives");
    println!("| {:-<13} | {:->16} | {:->14} |", "", "", "");
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let tests = args.pp.iter().filter(|&&n| n > 0).map(|&n| ("pp", n)).chain(args.tg.iter().filter(|&&n| n > 0).map(|&n| ("tg", n)));
    for (kind, n) in tests {
        let (d, b) = (args.depth, args.batch.max(1));
        let tokens = if kind == "pp" { n } else { n * b } as f64;
        // Every rank runs the same passes on the same random tokens; rank 0's clock is
        // reported, and each rank's share of it spent inside collectives (all-reduce, logit
        // gather; waiting for a slower rank counts).
        let run = |seed: u64| -> Result<(f64, Vec<f64>)> {
            let per_rank = lm.run_all(|m| {
                let rng = &mut rand::rngs::StdRng::seed_from_u64(seed);
                let before = m.comm_stats().unwrap_or_default();
                let rate = if kind == "pp" { time_pp(m, n, d, rng) } else { time_tg(m, n, d, b, rng) }?;
                let comm = m.comm_stats().unwrap_or_default().nanos - before.nanos;
                Ok((rate, comm as f64 * 1e-9 * rate / tokens))
            });
            let per_rank = per_rank.into_iter().collect::<Result<Vec<_>>>()?;
            Ok((per_rank[0].0, per_rank.iter().map(|r| r.1).collect()))
        };
        // One warm-up run (page faults, thread pool start), as llama-bench does.
        run(rng.gen())?;
        let v = (0..args.repetitions.max(1)).map(|_| run(rng.gen())).collect::<Result<Vec<_>>>()?;
        let (mean, sd) = mean_std(&v.iter().map(|r| r.0).collect::<Vec<_>>());
        let share: Vec<String> = (0..tp).map(|r| format!("{:.1}%", 100.0 * v.iter().map(|x| x.1[r]).sum::<f64>() / v.len() as f64)).collect();
        let mut name = if d > 0 { format!("{kind}{n} @ d{d}") } else { format!("{kind}{n}") };
        if kind == "tg" && b > 1 {
            name = format!("{name} x{b}");
        }
        let comm = if tp > 1 { share.join(" / ") } else { "-".into() };
        println!("| {name:<13} | {mean:>9.2} ± {sd:>4.2} | {comm:>14} |");
    }
    if let Some(peak) = peak_rss_mib() {
        println!("peak RSS: {peak:.1} MiB ({:.2}x the model's files)", peak / file_mib.max(1e-9));
    }
    Ok(())
}
