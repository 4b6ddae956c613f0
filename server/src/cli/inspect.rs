//! `tessera inspect`: architecture, every tensor with its storage type, and the kernel plan.

use super::kv_args::KvCacheArgs;
use super::model_path::{ModelArg, TpArgs};
use anyhow::Result;
use tessera_engine::kv_cache::DEFAULT_BLOCK_SIZE;
use clap::Args;
use tessera_engine::model::PlanEntry;
use tessera_kernels::linear::LinearPolicy;

/// Arguments of `tessera inspect`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Only the summary and the kernel plan, not every tensor.
    #[arg(long)]
    brief: bool,
    #[command(flatten)]
    kv: KvCacheArgs,
    #[command(flatten)]
    tp: TpArgs,
}

/// Runs the command.
pub fn run(args: InspectArgs) -> Result<()> {
    let lm = args.model.load_parallel(LinearPolicy::DEFAULT, &args.tp)?;
    let weights = &lm.weights;
    let ck = &weights.checkpoint;
    let c = &ck.config;
    println!("model: {} ({:?}, {})", ck.name, ck.format, ck.path.display());
    println!(
        "architecture: {:?}  layers {}  hidden {}  ffn {}  heads {} (kv {})  head_dim {}  vocab {}  context {}",
        c.arch, c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size, c.max_position_embeddings
    );
    println!(
        "rope_theta {}  rms_eps {:e}  tied embeddings {}  bos {:?}  eos {:?}  add_bos {}",
        c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings, ck.special.bos, ck.special.eos, ck.special.add_bos
    );
    println!("cpu: {}", lm.caps);
    let mut counts = std::collections::BTreeMap::new();
    let mut bytes = 0usize;
    for t in ck.tensors.values() {
        *counts.entry(t.ty.name().to_string()).or_insert(0) += 1;
        bytes += t.data.bytes().len();
    }
    for q in weights.quantized.values() {
        *counts.entry(q.matrix.storage()).or_insert(0) += 1;
        bytes += q.matrix.bytes();
    }
    println!("tensors: {} ({:.1} MiB): {:?}", ck.tensors.len() + weights.quantized.len(), bytes as f64 / (1 << 20) as f64, counts);
    if !args.brief {
        for (name, t) in &ck.tensors {
            println!("  {name:<28} {:<5} {:?}", t.ty.name(), t.shape);
        }
    }
    println!("embedding lookup: token_embd.weight ({}), dequantized row by row", lm.model.embedding_type());
    println!("quantization: {}", weights.quantization.as_deref().unwrap_or("none (weights as stored)"));
    let layouts = lm.kv_layouts(args.kv.dtype()?, DEFAULT_BLOCK_SIZE, 0)?;
    let per_token: f64 = layouts.iter().map(|l| l.bytes_per_token()).sum();
    println!("kv cache: {}, {:.0} tokens per GiB", layouts[0].describe(), (1u64 << 30) as f64 / per_token);
    if layouts.len() > 1 {
        let heads: Vec<usize> = layouts.iter().map(|l| l.geometry().n_kv_heads).collect();
        println!("tensor-parallel ranks: {} (KV heads per rank {heads:?}; the GiB above is all ranks together)", layouts.len());
    }
    if let Some(s) = &weights.kv_cache {
        println!("checkpoint kv_cache_scheme: {} with static per-layer k_scale/v_scale (used by auto and by sides given as {})", s.format, s.format);
    }
    let ranks = lm.tensor_parallel_size();
    let plan: Vec<(usize, PlanEntry)> = (0..ranks).flat_map(|r| lm.rank(r).plan().into_iter().map(move |e| (r, e))).collect();
    let w = |f: fn(&PlanEntry) -> usize| plan.iter().map(|(_, e)| f(e)).max().unwrap_or(0);
    let (ws, wst, wa) = (w(|e| e.scheme.len()).max(6), w(|e| e.storage.len()).max(7), w(|e| e.activations.len()).max(11));
    println!("\n{:<28} {:<ws$} {:<wst$} {:<wa$} {:<10} kernel", "layer", "scheme", "storage", "activations", "shape");
    for (r, e) in &plan {
        let rank = if ranks > 1 { format!("[{r}] ") } else { String::new() };
        println!(
            "{:<28} {:<ws$} {:<wst$} {:<wa$} {:<10} {}{}",
            format!("{rank}{}", e.tensor),
            e.scheme,
            e.storage,
            e.activations,
            format!("{}x{}", e.shape[0], e.shape[1]),
            e.kernel,
            e.shard.as_ref().map(|s| format!("  ({s})")).unwrap_or_default()
        );
        if let Some(n) = &e.note {
            println!("{:<28} note: {n}", "");
        }
    }
    Ok(())
}
