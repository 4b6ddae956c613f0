//! `tessera inspect`: architecture, every tensor with its storage type, and the kernel plan.

use super::model_path::ModelArg;
use anyhow::Result;
use clap::Args;
use tessera_kernels::linear::LinearPolicy;

/// Arguments of `tessera inspect`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Only the summary and the kernel plan, not every tensor.
    #[arg(long)]
    brief: bool,
}

/// Runs the command.
pub fn run(args: InspectArgs) -> Result<()> {
    let lm = args.model.load(LinearPolicy::DEFAULT)?;
    let ck = &lm.checkpoint;
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
        *counts.entry(t.ty.name()).or_insert(0) += 1;
        bytes += t.data.bytes().len();
    }
    println!("tensors: {} ({:.1} MiB): {:?}", ck.tensors.len(), bytes as f64 / (1 << 20) as f64, counts);
    if !args.brief {
        for (name, t) in &ck.tensors {
            println!("  {name:<28} {:<5} {:?}", t.ty.name(), t.shape);
        }
    }
    println!("embedding lookup: token_embd.weight ({}), dequantized row by row", lm.model.embedding_type());
    println!("\n{:<28} {:<6} {:<12} kernel", "layer", "type", "shape");
    for e in lm.model.plan() {
        println!("{:<28} {:<6} {:<12} {}", e.tensor, e.storage.name(), format!("{}x{}", e.shape[0], e.shape[1]), e.kernel);
    }
    Ok(())
}
