//! Engine limits and what the engine reports about itself.

use crate::device::Device;
use crate::kv_cache::KvRequest;
use crate::model::PlanEntry;

/// Scheduler and KV-cache settings.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Most sequences in one step (running plus newly admitted).
    pub max_num_seqs: usize,
    /// Most tokens (prefill chunks plus decodes) in one step.
    pub max_num_batched_tokens: usize,
    /// Tokens per KV-cache block.
    pub block_size: usize,
    /// Bytes for the KV-cache block pool.
    pub kv_cache_bytes: usize,
    /// Reuse cached blocks of identical prompt prefixes.
    pub prefix_caching: bool,
    /// Most requests waiting for admission; more are refused ([`super::SubmitError::QueueFull`]).
    pub max_waiting: usize,
    /// Cap on prompt + output tokens (default: the model's context, bounded by the pool).
    pub max_model_len: Option<usize>,
    /// KV-cache formats of keys and values as asked for (auto: the checkpoint's scheme, else f32).
    pub kv_dtype: KvRequest,
    /// Where the forward passes run.
    pub device: Device,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_seqs: 16,
            max_num_batched_tokens: 512,
            block_size: 16,
            kv_cache_bytes: 1 << 30,
            prefix_caching: true,
            max_waiting: 256,
            max_model_len: None,
            kv_dtype: KvRequest::default(),
            device: Device::Cpu,
        }
    }
}

/// What a running engine serves.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    /// Longest prompt + output, in tokens.
    pub max_model_len: usize,
    /// Vocabulary size (token ids must be below it).
    pub vocab_size: usize,
    /// KV-cache formats (e.g. `f32`, `k=qjl1,v=bf16`).
    pub kv_cache_type: String,
    /// KV-cache bytes per token (all layers, keys and values).
    pub kv_bytes_per_token: f64,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Weight storage types, most common first (e.g. `q4_1,q8_0`).
    pub quantization: String,
    /// The checkpoint's `quantization_config`, summarized (`None` when it has none).
    pub quantization_config: Option<String>,
    /// Kernel plan, one entry per linear layer.
    pub plan: Vec<PlanEntry>,
    /// Tensor-parallel ranks (the plan lists each rank's layers, rank after rank).
    pub tensor_parallel_size: usize,
    /// The effective configuration.
    pub config: EngineConfig,
}
