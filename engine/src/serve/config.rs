//! Engine limits and what the engine reports about itself.

use crate::checkpoint::ModelConfig;
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
    /// Seed of the KV formats' random state (QJL projections, HQMQ codebooks).
    pub kv_seed: u64,
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
            kv_seed: 0,
            device: Device::Cpu,
        }
    }
}

impl EngineConfig {
    /// This configuration with a block pool that holds `seqs` sequences of up to `tokens`
    /// tokens each in any KV format: sized for f32 records (the largest), with two blocks of
    /// slack per sequence. For the commands that run a known workload (generate, perplexity,
    /// bench) rather than a share of memory.
    pub fn with_pool_for(mut self, c: &ModelConfig, seqs: usize, tokens: usize) -> Self {
        let f32_bytes_per_token = c.num_layers * c.num_kv_heads * c.head_dim * 2 * 4;
        let per_seq = tokens.next_multiple_of(self.block_size) + 2 * self.block_size;
        self.kv_cache_bytes = seqs.max(1) * per_seq * f32_bytes_per_token;
        self
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
