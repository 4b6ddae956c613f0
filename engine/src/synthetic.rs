//! Synthetic Llama models: random weights at a real model's shapes, written as GGUF in a
//! chosen quantization mix, with another GGUF file's tokenizer. They make benchmarks possible
//! on shapes whose weights do not fit in cache (the default model's 94 MB do) without
//! downloading a model; their outputs are meaningless text.
//!
//! Weights are uniform in ±0.02·√3 (standard deviation 0.02, a common initializer), norms are
//! ones, the token embedding is tied to the output (as in SmolLM2 and Llama 3.2 1B/3B), and
//! every tensor comes from its own seeded stream, so a file is reproducible.

use crate::checkpoint::gguf::{GgufFile, MetaValue};
use crate::checkpoint::gguf_write::{write_gguf, TensorSpec};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use tessera_kernels::ggml::quantize::quantize_row;
use tessera_kernels::ggml::GgmlType;

/// A Llama shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlamaShape {
    /// Hidden size.
    pub hidden: usize,
    /// Transformer layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// MLP intermediate size.
    pub ffn: usize,
    /// Context length recorded in the metadata.
    pub context: usize,
}

impl LlamaShape {
    /// A 1.07B-parameter Llama with SmolLM2's 49152-token vocabulary: hidden 2048, 16 layers,
    /// 32 heads / 8 KV heads, FFN 8192 (Llama 3.2 1B's blocks).
    pub const L1B: LlamaShape = LlamaShape { hidden: 2048, layers: 16, heads: 32, kv_heads: 8, ffn: 8192, context: 8192 };
    /// Llama 3.2 3B's blocks: hidden 3072, 28 layers, 24 heads / 8 KV heads, FFN 8192.
    pub const L3B: LlamaShape = LlamaShape { hidden: 3072, layers: 28, heads: 24, kv_heads: 8, ffn: 8192, context: 8192 };
    /// Llama 3.1 8B's blocks: hidden 4096, 32 layers, 32 heads / 8 KV heads, FFN 14336 (the
    /// vocabulary stays the tokenizer's, and the embedding tied).
    pub const L8B: LlamaShape = LlamaShape { hidden: 4096, layers: 32, heads: 32, kv_heads: 8, ffn: 14336, context: 8192 };
    /// A tiny model for tests: hidden 256, 2 layers, 4 heads / 2 KV heads, FFN 512.
    pub const TINY: LlamaShape = LlamaShape { hidden: 256, layers: 2, heads: 4, kv_heads: 2, ffn: 512, context: 2048 };
}

/// Which GGML type each tensor gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMix {
    /// llama.cpp's Q4_K_M: Q4_K, with Q6_K for the (tied) token embedding and for `attn_v` and
    /// `ffn_down` in the layers llama.cpp gives more bits (the first and last eighth and every
    /// third layer between).
    Q4KM,
    /// llama.cpp's Q3_K_M: Q3_K, with Q6_K for the embedding, Q4_K for `attn_output`, `attn_v`
    /// in Q5_K for the first two layers and Q4_K after, `ffn_down` in Q5_K for the first
    /// sixteenth of the layers and Q4_K in the layers that get more bits.
    Q3KM,
    /// Every matrix in one type; the tied token embedding in Q6_K unless the type is Q8_0 (what
    /// `llama-quantize` does for a tied output).
    Uniform(GgmlType),
}

impl QuantMix {
    /// The type of matrix `kind` (`token_embd`, `attn_q`, ..., `ffn_down`) in layer `layer`
    /// of `layers`.
    pub fn tensor_type(self, kind: &str, layer: usize, layers: usize) -> GgmlType {
        let first = layers / 8;
        let more_bits = layer < first || layer >= 7 * layers / 8 || (layer - first) % 3 == 2;
        match (self, kind) {
            (QuantMix::Uniform(GgmlType::Q8_0), _) => GgmlType::Q8_0,
            (_, "token_embd") => GgmlType::Q6K,
            (QuantMix::Q4KM, "attn_v" | "ffn_down") if more_bits => GgmlType::Q6K,
            (QuantMix::Q4KM, _) => GgmlType::Q4K,
            (QuantMix::Q3KM, "attn_v") => if layer < 2 { GgmlType::Q5K } else { GgmlType::Q4K },
            (QuantMix::Q3KM, "attn_output") => GgmlType::Q4K,
            (QuantMix::Q3KM, "ffn_down") if layer < layers / 16 => GgmlType::Q5K,
            (QuantMix::Q3KM, "ffn_down") if more_bits => GgmlType::Q4K,
            (QuantMix::Q3KM, _) => GgmlType::Q3K,
            (QuantMix::Uniform(t), _) => t,
        }
    }

    /// llama.cpp's `general.file_type` for the mix.
    fn file_type(self) -> u32 {
        match self {
            QuantMix::Q4KM => 15,
            QuantMix::Q3KM => 12,
            QuantMix::Uniform(GgmlType::Q2K) => 10,
            QuantMix::Uniform(GgmlType::Q4_0) => 2,
            QuantMix::Uniform(GgmlType::Q4_1) => 3,
            QuantMix::Uniform(GgmlType::Q8_0) => 7,
            QuantMix::Uniform(GgmlType::Q4K) => 14,
            QuantMix::Uniform(GgmlType::Q6K) => 18,
            QuantMix::Uniform(_) => 0,
        }
    }
}

/// What to write.
#[derive(Clone, Debug)]
pub struct RandomLlamaOptions {
    /// Shape.
    pub shape: LlamaShape,
    /// Quantization mix.
    pub mix: QuantMix,
    /// Type of the (tied) token embedding instead of the mix's choice (`Some(Q8_0)` for a
    /// legacy-quant file like the default model, whose embedding is Q8_0).
    pub embedding: Option<GgmlType>,
    /// Seed of every tensor's stream.
    pub seed: u64,
    /// GGUF file whose `tokenizer.*` metadata (and vocabulary size) the model takes.
    pub tokenizer: PathBuf,
}

/// Errors while writing.
#[derive(Debug, thiserror::Error)]
pub enum SyntheticError {
    /// The tokenizer file could not be read.
    #[error("tokenizer {path}: {msg}")]
    Tokenizer {
        /// File at fault.
        path: PathBuf,
        /// What was wrong.
        msg: String,
    },
    /// A shape or type that cannot be written.
    #[error("{0}")]
    Shape(String),
    /// Writing the output failed.
    #[error("{path}: {source}")]
    Io {
        /// File at fault.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// What was written.
#[derive(Clone, Debug)]
pub struct RandomLlamaSummary {
    /// Parameters.
    pub params: usize,
    /// Bytes of tensor data.
    pub bytes: usize,
    /// Tensors.
    pub tensors: usize,
}

/// Writes a random Llama GGUF file to `output`.
pub fn write_random_llama(opts: &RandomLlamaOptions, output: &Path) -> Result<RandomLlamaSummary, SyntheticError> {
    let tok_err = |msg: String| SyntheticError::Tokenizer { path: opts.tokenizer.clone(), msg };
    let tok = GgufFile::open(&opts.tokenizer).map_err(|e| tok_err(e.to_string()))?;
    let vocab = tok.get("tokenizer.ggml.tokens").and_then(MetaValue::as_array).map(<[MetaValue]>::len).ok_or_else(|| tok_err("no tokenizer.ggml.tokens".into()))?;
    let s = opts.shape;
    if !s.hidden.is_multiple_of(s.heads) || !s.heads.is_multiple_of(s.kv_heads) {
        return Err(SyntheticError::Shape(format!("{} heads / {} KV heads do not divide hidden {}", s.heads, s.kv_heads, s.hidden)));
    }
    let head_dim = s.hidden / s.heads;
    let kv = s.kv_heads * head_dim;
    let mut tensors = vec![TensorSpec { name: "token_embd.weight".into(), ty: opts.embedding.unwrap_or(opts.mix.tensor_type("token_embd", 0, s.layers)), shape: vec![vocab, s.hidden] }];
    tensors.push(TensorSpec { name: "output_norm.weight".into(), ty: GgmlType::F32, shape: vec![s.hidden] });
    for l in 0..s.layers {
        let mat = |kind: &str, rows: usize, cols: usize| TensorSpec { name: format!("blk.{l}.{kind}.weight"), ty: opts.mix.tensor_type(kind, l, s.layers), shape: vec![rows, cols] };
        let norm = |kind: &str| TensorSpec { name: format!("blk.{l}.{kind}.weight"), ty: GgmlType::F32, shape: vec![s.hidden] };
        tensors.extend([
            norm("attn_norm"),
            mat("attn_q", s.hidden, s.hidden),
            mat("attn_k", kv, s.hidden),
            mat("attn_v", kv, s.hidden),
            mat("attn_output", s.hidden, s.hidden),
            norm("ffn_norm"),
            mat("ffn_gate", s.ffn, s.hidden),
            mat("ffn_up", s.ffn, s.hidden),
            mat("ffn_down", s.hidden, s.ffn),
        ]);
    }
    for t in &tensors {
        let cols = *t.shape.last().expect("a dimension");
        if !cols.is_multiple_of(t.ty.block_size()) {
            return Err(SyntheticError::Shape(format!("{}: {cols} columns are not whole {} blocks", t.name, t.ty)));
        }
    }
    let a = |k: &str| format!("llama.{k}");
    let mut meta: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), MetaValue::String("llama".into())),
        ("general.name".into(), MetaValue::String(format!("random-llama h{} l{} seed {}", s.hidden, s.layers, opts.seed))),
        ("general.file_type".into(), MetaValue::U32(opts.mix.file_type())),
        (a("block_count"), MetaValue::U32(s.layers as u32)),
        (a("context_length"), MetaValue::U32(s.context as u32)),
        (a("embedding_length"), MetaValue::U32(s.hidden as u32)),
        (a("feed_forward_length"), MetaValue::U32(s.ffn as u32)),
        (a("attention.head_count"), MetaValue::U32(s.heads as u32)),
        (a("attention.head_count_kv"), MetaValue::U32(s.kv_heads as u32)),
        (a("rope.dimension_count"), MetaValue::U32(head_dim as u32)),
        (a("rope.freq_base"), MetaValue::F32(500000.0)),
        (a("attention.layer_norm_rms_epsilon"), MetaValue::F32(1e-5)),
        (a("vocab_size"), MetaValue::U32(vocab as u32)),
    ];
    meta.extend(tok.metadata.iter().filter(|(k, _)| k.starts_with("tokenizer.")).map(|(k, v)| (k.clone(), v.clone())));
    let io_err = |source| SyntheticError::Io { path: output.to_path_buf(), source };
    let file = std::fs::File::create(output).map_err(io_err)?;
    let amp = 0.02 * 3f32.sqrt();
    write_gguf(BufWriter::with_capacity(1 << 20, file), &meta, &tensors, |i, buf| {
        let t = &tensors[i];
        let cols = *t.shape.last().expect("a dimension");
        if t.shape.len() == 1 {
            quantize_row(t.ty, &vec![1.0; cols], buf);
            return Ok(());
        }
        let rb = buf.len() / t.shape[0];
        // 64-row chunks, each from its own stream (seed, tensor, chunk): reproducible and parallel.
        buf.par_chunks_mut(64 * rb).enumerate().for_each(|(c, rows)| {
            let mut r = ChaCha8Rng::seed_from_u64(opts.seed ^ ((i as u64) << 40) ^ c as u64);
            let mut x = vec![0f32; cols];
            for row in rows.chunks_exact_mut(rb) {
                x.iter_mut().for_each(|v| *v = (r.gen::<f32>() * 2.0 - 1.0) * amp);
                quantize_row(t.ty, &x, row);
            }
        });
        Ok(())
    })
    .map_err(io_err)?;
    let params = tensors.iter().map(|t| t.shape.iter().product::<usize>()).sum();
    Ok(RandomLlamaSummary { params, bytes: tensors.iter().map(TensorSpec::nbytes).sum(), tensors: tensors.len() })
}
