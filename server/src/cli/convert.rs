//! `tessera convert`: checkpoint conversions (`gguf-to-hf`, `upcycle-moe`) and synthetic
//! models (`random-llama`).

use anyhow::{Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use std::path::PathBuf;
use tessera_engine::convert::{to_hf_dir, ConvertOptions, ConvertSummary};
use tessera_engine::float_dtype::FloatDtype;
use tessera_engine::synthetic::{write_random_llama, LlamaShape, QuantMix, RandomLlamaOptions};
use tessera_engine::upcycle::{upcycle, MoeFamily, UpcycleOptions};
use tessera_engine::weights::ModelWeights;
use tessera_kernels::ggml::GgmlType;

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
    /// A dense Llama model (GGUF or HF directory) to a mixture-of-experts HF directory whose
    /// experts are copies of its MLP (identical experts compute the dense model's function).
    UpcycleMoe(UpcycleArgs),
    /// A Llama GGUF file with random weights at a real model's shapes (for benchmarks beyond
    /// the cache), quantized by Tessera's round-to-nearest quantizers, with the default
    /// model's tokenizer.
    RandomLlama(RandomLlamaArgs),
}

/// Shape presets of `random-llama`.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum PresetArg {
    /// 1.07B parameters: hidden 2048, 16 layers, 32 / 8 heads, FFN 8192.
    #[value(name = "1b")]
    L1b,
    /// Llama 3.2 3B's blocks: hidden 3072, 28 layers, 24 / 8 heads, FFN 8192.
    #[value(name = "3b")]
    L3b,
    /// Llama 3.1 8B's blocks: hidden 4096, 32 layers, 32 / 8 heads, FFN 14336.
    #[value(name = "8b")]
    L8b,
    /// Hidden 256, 2 layers (tests).
    Tiny,
}

/// Quantization mixes of `random-llama`.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum MixArg {
    /// llama.cpp's Q4_K_M mix (Q4_K, Q6_K for the embedding and some attn_v / ffn_down).
    #[value(name = "q4_k_m")]
    Q4KM,
    /// llama.cpp's Q3_K_M mix (Q3_K; Q4_K/Q5_K for attn_output, attn_v, some ffn_down; Q6_K
    /// embedding).
    #[value(name = "q3_k_m")]
    Q3KM,
    /// Q2_K everywhere but the Q6_K embedding.
    #[value(name = "q2_k")]
    Q2K,
    /// Q3_K everywhere but the Q6_K embedding.
    #[value(name = "q3_k")]
    Q3K,
    /// Q4_K everywhere but the Q6_K embedding.
    #[value(name = "q4_k")]
    Q4K,
    /// Q6_K everywhere.
    #[value(name = "q6_k")]
    Q6K,
    /// Q4_0 everywhere but the Q6_K embedding.
    #[value(name = "q4_0")]
    Q4_0,
    /// Q4_1 everywhere but the Q6_K embedding.
    #[value(name = "q4_1")]
    Q4_1,
    /// Q8_0 everywhere.
    #[value(name = "q8_0")]
    Q8_0,
}

/// Token-embedding types of `random-llama --embedding-type`.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum EmbeddingArg {
    /// Q8_0.
    #[value(name = "q8_0")]
    Q8_0,
    /// Q6_K.
    #[value(name = "q6_k")]
    Q6K,
}

/// Arguments of `tessera convert random-llama`.
#[derive(Args, Debug)]
struct RandomLlamaArgs {
    /// Output GGUF file.
    #[arg(long)]
    output: PathBuf,
    /// Shape.
    #[arg(long, value_enum, default_value = "1b")]
    preset: PresetArg,
    /// Quantization mix.
    #[arg(long = "type", value_enum, default_value = "q4_k_m")]
    mix: MixArg,
    /// Type of the tied token embedding instead of the mix's (q8_0 as in the default model;
    /// the CUDA backend has no K-quant kernels yet).
    #[arg(long, value_enum)]
    embedding_type: Option<EmbeddingArg>,
    /// Seed of the weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// GGUF file whose tokenizer the model takes (default: the project's default model).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
}

/// Output MoE family.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum FamilyArg {
    /// Mixtral (softmax top-k, renormalized).
    Mixtral,
    /// Qwen2-MoE (softmax top-k, sigmoid-gated shared expert, Q/K/V biases).
    QwenMoe,
    /// Qwen3-MoE (softmax top-k, per-head Q/K norms written as ones: not function-preserving).
    Qwen3Moe,
    /// DeepSeek-V3 routing (sigmoid, correction bias, group-limited, shared expert) over GQA.
    Deepseek,
}

/// Arguments of `tessera convert upcycle-moe`.
#[derive(Args, Debug)]
struct UpcycleArgs {
    /// Dense model (GGUF file or Hugging Face directory).
    #[arg(long)]
    input: PathBuf,
    /// Output directory (created if missing).
    #[arg(long)]
    output: PathBuf,
    /// Routed experts per layer.
    #[arg(long, default_value_t = 8)]
    experts: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 2)]
    top_k: usize,
    /// Output family (config keys, tensor names, routing).
    #[arg(long, value_enum, default_value = "mixtral")]
    family: FamilyArg,
    /// DeepSeek family: expert groups (`n_group`).
    #[arg(long, default_value_t = 4)]
    n_group: usize,
    /// DeepSeek family: groups kept per token (`topk_group`).
    #[arg(long, default_value_t = 2)]
    topk_group: usize,
    /// Relative noise on every expert copy (`σ · rms(W) · N(0,1)`); 0 keeps them identical.
    #[arg(long, default_value_t = 0.0)]
    perturb: f32,
    /// Seed of the router weights and the noise.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write experts stacked (`mlp.experts.gate_up_proj` / `down_proj`, transformers 5 layout).
    #[arg(long)]
    stacked: bool,
    /// Float type of every output tensor.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: DtypeArg,
    /// Split the weights into shards of at most this many MiB (default: one model.safetensors).
    #[arg(long)]
    max_shard_mib: Option<u64>,
}

impl DtypeArg {
    fn dtype(self) -> FloatDtype {
        match self {
            DtypeArg::Bf16 => FloatDtype::BF16,
            DtypeArg::F16 => FloatDtype::F16,
            DtypeArg::F32 => FloatDtype::F32,
        }
    }
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
    match args.command {
        ConvertCommand::GgufToHf(a) => {
            let ck = ModelWeights::open(&a.input)?.checkpoint;
            let opts = ConvertOptions { dtype: a.dtype.dtype(), max_shard_bytes: a.max_shard_mib.map(|m| m << 20) };
            let s = to_hf_dir(&ck, &a.output, &opts).with_context(|| format!("converting {}", a.input.display()))?;
            report(&a.output, &s, opts.dtype);
        }
        ConvertCommand::UpcycleMoe(a) => {
            let ck = ModelWeights::open(&a.input)?.checkpoint;
            let family = match a.family {
                FamilyArg::Mixtral => MoeFamily::Mixtral,
                FamilyArg::QwenMoe => MoeFamily::QwenMoe,
                FamilyArg::Qwen3Moe => MoeFamily::Qwen3Moe,
                FamilyArg::Deepseek => MoeFamily::Deepseek,
            };
            let opts = UpcycleOptions {
                family,
                experts: a.experts,
                top_k: a.top_k,
                groups: (a.n_group, a.topk_group),
                perturb: a.perturb,
                seed: a.seed,
                stacked: a.stacked,
                convert: ConvertOptions { dtype: a.dtype.dtype(), max_shard_bytes: a.max_shard_mib.map(|m| m << 20) },
            };
            let s = upcycle(&ck, &a.output, &opts).with_context(|| format!("upcycling {}", a.input.display()))?;
            report(&a.output, &s, opts.convert.dtype);
        }
        ConvertCommand::RandomLlama(a) => {
            let shape = match a.preset {
                PresetArg::L1b => LlamaShape::L1B,
                PresetArg::L3b => LlamaShape::L3B,
                PresetArg::L8b => LlamaShape::L8B,
                PresetArg::Tiny => LlamaShape::TINY,
            };
            let mix = match a.mix {
                MixArg::Q4KM => QuantMix::Q4KM,
                MixArg::Q3KM => QuantMix::Q3KM,
                MixArg::Q2K => QuantMix::Uniform(GgmlType::Q2K),
                MixArg::Q3K => QuantMix::Uniform(GgmlType::Q3K),
                MixArg::Q4K => QuantMix::Uniform(GgmlType::Q4K),
                MixArg::Q6K => QuantMix::Uniform(GgmlType::Q6K),
                MixArg::Q4_0 => QuantMix::Uniform(GgmlType::Q4_0),
                MixArg::Q4_1 => QuantMix::Uniform(GgmlType::Q4_1),
                MixArg::Q8_0 => QuantMix::Uniform(GgmlType::Q8_0),
            };
            let tokenizer = super::model_path::resolve(a.tokenizer.as_deref())?;
            let embedding = a.embedding_type.map(|e| match e {
                EmbeddingArg::Q8_0 => GgmlType::Q8_0,
                EmbeddingArg::Q6K => GgmlType::Q6K,
            });
            let opts = RandomLlamaOptions { shape, mix, embedding, seed: a.seed, tokenizer };
            let s = write_random_llama(&opts, &a.output).with_context(|| format!("writing {}", a.output.display()))?;
            println!(
                "wrote {}: {} tensors, {:.3}B parameters, {:.1} MiB of weights",
                a.output.display(),
                s.tensors,
                s.params as f64 / 1e9,
                s.bytes as f64 / (1u64 << 20) as f64
            );
        }
    }
    Ok(())
}

fn report(output: &std::path::Path, s: &ConvertSummary, dtype: FloatDtype) {
    println!(
        "wrote {}: {} tensors ({:.1} MiB, {}) in {}",
        output.display(),
        s.tensors,
        s.bytes as f64 / (1u64 << 20) as f64,
        dtype.torch_name(),
        s.shards.join(", ")
    );
}
