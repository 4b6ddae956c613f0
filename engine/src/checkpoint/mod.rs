//! Checkpoint reading: GGUF files and Hugging Face directories, both turned into one
//! in-memory [`Checkpoint`]: architecture hyper-parameters, named tensors in their storage
//! type (still memory-mapped where possible), and the tokenizer's source.
//!
//! Tensor names are canonicalised to GGUF's short form (`blk.3.attn_q.weight`) whatever the
//! source, and Q/K rows are in Hugging Face order (the GGUF converter's permutation undone).
//!
//! The readers know no quantization scheme: a Hugging Face directory's `quantization_config`
//! is decoded above this module (`crate::weights`), which takes the quantized layers' tensors
//! from the [`TensorSet`] before `HfDir::finish` resolves the rest.

pub mod gguf;
pub mod gguf_write;
mod gguf_model;
mod hf_config;
mod hf_dir;
pub mod names;
pub mod routing;
mod tensor_set;

use memmap2::Mmap;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use routing::Routing;
use tessera_kernels::ggml::GgmlType;

pub use gguf::{GgufError, GgufFile, MetaValue};
pub use gguf_model::GgufVocab;
pub(crate) use gguf_model::{from_file as gguf_from_file, load as load_gguf};
pub(crate) use hf_dir::{HfDir, QuantizedLayers};
pub use tensor_set::{RawTensor, TensorSet};

/// Errors while loading a checkpoint. Messages name the file, key or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file or directory cannot be read.
    #[error("{path}: {msg}")]
    Io {
        /// Path at fault.
        path: PathBuf,
        /// What failed.
        msg: String,
    },
    /// The GGUF container is malformed.
    #[error("{path}: {error}")]
    Gguf {
        /// File at fault.
        path: PathBuf,
        /// Parse error.
        error: GgufError,
    },
    /// A required or malformed configuration value.
    #[error("config {key}: {msg}")]
    Config {
        /// Key at fault.
        key: String,
        /// What was wrong.
        msg: String,
    },
    /// A tensor that is missing or disagrees with the configuration.
    #[error("tensor {name}: {msg}")]
    Tensor {
        /// Tensor name (as in the checkpoint).
        name: String,
        /// What was wrong.
        msg: String,
    },
    /// An architecture Tessera does not run.
    #[error("unsupported architecture {0:?} (supported: llama, mistral, mixtral, qwen2_moe, qwen3_moe, deepseek_v3 and kimi_k2 without MLA)")]
    Architecture(String),
    /// Tokenizer construction failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

/// Model families the engine can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// Llama and its GQA descendants (SmolLM2, Mistral without sliding window, ...).
    Llama,
    /// Mixtral: Llama attention, softmax top-k experts (`block_sparse_moe`).
    Mixtral,
    /// Qwen2-MoE: Q/K/V biases, softmax top-k experts plus a sigmoid-gated shared expert.
    Qwen2Moe,
    /// Qwen3-MoE: per-head Q/K RMSNorm, softmax top-k experts.
    Qwen3Moe,
    /// DeepSeek-V3 / Kimi-K2 routing (sigmoid, correction bias, groups, shared experts, dense
    /// first layers) over GQA attention; MLA checkpoints are refused at load.
    DeepseekV3,
}

/// Where and how a model's mixture-of-experts layers route and what they hold.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// The routing rule.
    pub routing: Routing,
    /// Inner width of each routed expert.
    pub expert_ffn: usize,
    /// Inner width of the shared expert (0: none).
    pub shared_ffn: usize,
    /// The shared expert's output is scaled by `sigmoid(shared_expert_gate · x)` (Qwen2-MoE).
    pub shared_gate: bool,
    /// The router has an `e_score_correction_bias` (DeepSeek-V3 `noaux_tc`).
    pub correction_bias: bool,
    /// Per layer: MoE (`true`) or dense MLP of `intermediate_size`.
    pub layers: Vec<bool>,
}

/// Architecture hyper-parameters, from GGUF metadata or config.json.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Model family.
    pub arch: Architecture,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Hidden width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Decoder blocks.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Dimension per head.
    pub head_dim: usize,
    /// RoPE base.
    pub rope_theta: f32,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Trained context length.
    pub max_position_embeddings: usize,
    /// Output head shares the token embedding.
    pub tie_word_embeddings: bool,
    /// Q, K and V projections have biases (Qwen2).
    pub attn_bias: bool,
    /// Per-head RMSNorm on Q and K before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Mixture-of-experts layers (`None`: every layer is a dense MLP).
    pub moe: Option<MoeConfig>,
}

/// Largest size any one hyper-parameter may have (counts, widths, lengths).
pub const MAX_CONFIG_DIM: usize = 1 << 24;

/// A size read from a checkpoint's configuration, checked to be in `1..=MAX_CONFIG_DIM`
/// before anything is sized by it.
pub(crate) fn config_dim(key: &str, v: usize) -> Result<usize, LoadError> {
    if v == 0 || v > MAX_CONFIG_DIM {
        return Err(LoadError::Config { key: key.into(), msg: format!("{v} is out of range (1..={MAX_CONFIG_DIM})") });
    }
    Ok(v)
}

impl ModelConfig {
    /// Checks the shape relations the model code relies on.
    pub fn validate(&self) -> Result<(), LoadError> {
        let bad = |key: &str, msg: String| Err(LoadError::Config { key: key.into(), msg });
        for (k, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            config_dim(k, v)?;
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad("num_kv_heads", format!("{} does not divide num_heads {}", self.num_kv_heads, self.num_heads));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad("head_dim", format!("{} is odd", self.head_dim));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad("rope_theta", format!("{}", self.rope_theta));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad("rms_norm_eps", format!("{}", self.rms_norm_eps));
        }
        if let Some(moe) = &self.moe {
            moe.routing.validate().or_else(|(key, msg)| bad(key, msg))?;
            if moe.expert_ffn == 0 || moe.expert_ffn > MAX_CONFIG_DIM || moe.shared_ffn > MAX_CONFIG_DIM {
                return bad("moe_intermediate_size", format!("{} (shared {}) is out of range", moe.expert_ffn, moe.shared_ffn));
            }
            if moe.layers.len() != self.num_layers {
                return bad("num_hidden_layers", format!("{} MoE layer flags for {} layers", moe.layers.len(), self.num_layers));
            }
        }
        Ok(())
    }
}

/// Where a tensor's bytes live.
#[derive(Clone, Debug)]
pub enum TensorBytes {
    /// A range of a memory-mapped file.
    Mapped(Arc<Mmap>, Range<usize>),
    /// Bytes owned in memory (e.g. rows reordered at load).
    Owned(Arc<[u8]>),
}

impl TensorBytes {
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            TensorBytes::Mapped(m, r) => &m[r.clone()],
            TensorBytes::Owned(b) => b,
        }
    }

    /// Drops these bytes' pages from the process's resident set; for owned bytes, nothing.
    /// Called once a tensor has been repacked into memory of its own, so that its file pages
    /// do not count twice. Pages read again later come back from the file.
    pub fn release_pages(&self) {
        #[cfg(unix)]
        if let TensorBytes::Mapped(m, r) = self {
            // SAFETY: the map is a read-only file map: MADV_DONTNEED only drops this process's
            // page-table entries, and any later read faults the same bytes back in from the file.
            // Failure (an unsupported platform) just leaves the pages resident.
            let _ = unsafe { m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, r.start, r.len()) };
        }
    }

    /// Bytes `range` of these (still mapped when these are).
    pub fn slice(&self, range: Range<usize>) -> TensorBytes {
        match self {
            TensorBytes::Mapped(m, r) => TensorBytes::Mapped(m.clone(), r.start + range.start..r.start + range.end),
            TensorBytes::Owned(b) => TensorBytes::Owned(Arc::from(&b[range])),
        }
    }
}

/// Splits a stacked expert tensor `[E, rows, cols]` into one canonical matrix per expert and
/// part: `parts` are `(canonical kind, rows)` in row order (`[("ffn_gate_exps", I),
/// ("ffn_up_exps", I)]` for a fused gate-up stack), summing to `rows`.
fn split_experts(t: &TensorEntry, layer: usize, parts: &[(&str, usize)]) -> Result<Vec<(String, TensorEntry)>, LoadError> {
    let err = |msg: String| LoadError::Tensor { name: t.source_name.clone(), msg };
    let &[e, rows, cols] = t.shape.as_slice() else { return Err(err(format!("shape {:?} is not [experts, rows, cols]", t.shape))) };
    if parts.iter().map(|p| p.1).sum::<usize>() != rows {
        return Err(err(format!("{rows} rows do not split into {}", parts.iter().map(|p| format!("{} {}", p.0, p.1)).collect::<Vec<_>>().join(" + "))));
    }
    let rb = t.ty.row_bytes(cols).ok_or_else(|| err(format!("{cols} columns are not whole {} blocks", t.ty)))?;
    if t.data.bytes().len() != e * rows * rb {
        return Err(err(format!("{} bytes for shape {:?} of {}", t.data.bytes().len(), t.shape, t.ty)));
    }
    let mut out = Vec::with_capacity(e * parts.len());
    for x in 0..e {
        let mut row = x * rows;
        for &(kind, n) in parts {
            let data = t.data.slice(row * rb..(row + n) * rb);
            out.push((names::expert_name(layer, kind, x), TensorEntry { source_name: format!("{}[{x}]", t.source_name), ty: t.ty, shape: vec![n, cols], data }));
            row += n;
        }
    }
    Ok(out)
}

/// One named tensor in its storage type.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    /// Name in the source checkpoint (for messages).
    pub source_name: String,
    /// Storage type. Quantized Hugging Face formats will extend this seam.
    pub ty: GgmlType,
    /// Shape, outermost first (`[rows, cols]` for a matrix).
    pub shape: Vec<usize>,
    /// Data.
    pub data: TensorBytes,
}

impl TensorEntry {
    /// `(rows, cols)` of a 2-D tensor (1-D tensors are one row).
    pub fn matrix_dims(&self) -> (usize, usize) {
        match self.shape.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            s => (s[..s.len() - 1].iter().product(), s[s.len() - 1]),
        }
    }
}

/// The checkpoint's tokenizer, as found in it.
#[derive(Clone, Debug)]
pub enum TokenizerSource {
    /// Vocabulary embedded in GGUF metadata.
    Gguf(Box<gguf_model::GgufVocab>),
    /// A Hugging Face `tokenizer.json`, parsed at load (special tokens are resolved with it).
    HfJson(Box<tokenizers::Tokenizer>),
}

/// Special tokens and template from the checkpoint.
#[derive(Clone, Debug, Default)]
pub struct SpecialTokens {
    /// Beginning-of-sequence token.
    pub bos: Option<u32>,
    /// End-of-sequence tokens (generation stops on any).
    pub eos: Vec<u32>,
    /// Whether prompts get a BOS prepended.
    pub add_bos: bool,
    /// Jinja chat template.
    pub chat_template: Option<String>,
}

/// Which container a checkpoint came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointFormat {
    /// A single GGUF file.
    Gguf,
    /// A Hugging Face directory (config.json + safetensors).
    HfDir,
}

/// A loaded checkpoint.
#[derive(Debug)]
pub struct Checkpoint {
    /// Path it was loaded from.
    pub path: PathBuf,
    /// Container.
    pub format: CheckpointFormat,
    /// Display name.
    pub name: String,
    /// Hyper-parameters.
    pub config: ModelConfig,
    /// Tensors by canonical name (plain and GGML-quantized weights, norms, embeddings; not the
    /// layers a quantization scheme decodes).
    pub tensors: BTreeMap<String, TensorEntry>,
    /// Tokenizer source.
    pub tokenizer: TokenizerSource,
    /// Special tokens.
    pub special: SpecialTokens,
}

impl Checkpoint {
    /// A tensor by canonical name, or an error naming it.
    pub fn tensor(&self, name: &str) -> Result<&TensorEntry, LoadError> {
        self.tensors.get(name).ok_or_else(|| LoadError::Tensor { name: name.into(), msg: "missing".into() })
    }
}

/// Reorders the rows of a head-major Q/K matrix from llama.cpp's interleaved-RoPE order
/// back to Hugging Face's rotate-half order (the inverse of `convert_hf_to_gguf.permute`).
///
/// Within each head of `head_dim` rows, GGUF row `2j + p` holds HF row `p * head_dim/2 + j`.
pub fn unpermute_qk_rows(data: &[u8], rows: usize, head_dim: usize) -> Vec<u8> {
    let rb = data.len() / rows;
    let half = head_dim / 2;
    let mut out = vec![0u8; data.len()];
    for r in 0..rows {
        let (h, i) = (r / head_dim, r % head_dim);
        let (p, j) = (i / half, i % half);
        let src = h * head_dim + 2 * j + p;
        out[r * rb..(r + 1) * rb].copy_from_slice(&data[src * rb..(src + 1) * rb]);
    }
    out
}
