//! config.json -> [`ModelConfig`] for the families Tessera runs: Llama/Mistral, Mixtral,
//! Qwen2-MoE, Qwen3-MoE and DeepSeek-V3/Kimi-K2 routing (keys as in checkpoint-formats.md §1).
//!
//! DeepSeek-V3 attention is MLA, which Tessera does not run: a config with `kv_lora_rank` or
//! `q_lora_rank` set is refused by name. A `deepseek_v3` config with both null (the form
//! `tessera convert upcycle-moe --family deepseek` writes) is read as GQA attention with Llama
//! tensor names (`num_key_value_heads`, `head_dim`).

use super::{Architecture, LoadError, ModelConfig, MoeConfig};
use super::routing::{Routing, Scoring};
use serde_json::Value;

fn config_err(key: &str, msg: impl Into<String>) -> LoadError {
    LoadError::Config { key: key.into(), msg: msg.into() }
}

fn cfg_usize(cfg: &Value, key: &str) -> Result<usize, LoadError> {
    cfg.get(key).and_then(Value::as_u64).map(|v| v as usize).ok_or_else(|| config_err(key, "missing or not an unsigned integer"))
}

fn cfg_usize_or(cfg: &Value, key: &str, default: usize) -> Result<usize, LoadError> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(_) => cfg_usize(cfg, key),
    }
}

fn cfg_f32(cfg: &Value, key: &str, default: f32) -> Result<f32, LoadError> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_f64().map(|x| x as f32).ok_or_else(|| config_err(key, format!("{v} is not a number"))),
    }
}

fn cfg_bool(cfg: &Value, key: &str, default: bool) -> Result<bool, LoadError> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_bool().ok_or_else(|| config_err(key, format!("{v} is not a boolean"))),
    }
}

/// The first of `keys` present (transformers re-saves Qwen3-MoE's `num_experts` as
/// `num_local_experts`; both are accepted).
fn cfg_usize_any(cfg: &Value, keys: &[&str]) -> Result<usize, LoadError> {
    match keys.iter().find(|k| cfg.get(**k).is_some_and(|v| !v.is_null())) {
        Some(k) => cfg_usize(cfg, k),
        None => Err(config_err(keys[0], "missing")),
    }
}

/// Parses config.json into a [`ModelConfig`].
pub(super) fn model_config(cfg: &Value) -> Result<ModelConfig, LoadError> {
    let model_type = cfg.get("model_type").and_then(Value::as_str).unwrap_or("");
    let arch = match model_type {
        "llama" | "mistral" => Architecture::Llama,
        "mixtral" => Architecture::Mixtral,
        "qwen2_moe" => Architecture::Qwen2Moe,
        "qwen3_moe" => Architecture::Qwen3Moe,
        "deepseek_v3" | "kimi_k2" => Architecture::DeepseekV3,
        other => return Err(LoadError::Architecture(other.to_string())),
    };
    if cfg.get("rope_scaling").is_some_and(|v| !v.is_null()) {
        return Err(config_err("rope_scaling", "RoPE scaling is not supported yet"));
    }
    if cfg_bool(cfg, "mlp_bias", false)? {
        return Err(config_err("mlp_bias", "MLP biases are not supported"));
    }
    // Qwen configs carry `sliding_window` with `use_sliding_window: false`.
    let sliding = cfg.get("sliding_window").is_some_and(|v| !v.is_null()) && cfg_bool(cfg, "use_sliding_window", true)?;
    if sliding {
        return Err(config_err("sliding_window", "sliding-window attention is not supported"));
    }
    if arch == Architecture::DeepseekV3 {
        for key in ["kv_lora_rank", "q_lora_rank"] {
            if cfg.get(key).is_some_and(|v| !v.is_null()) {
                return Err(config_err(key, "multi-head latent attention (MLA) is not supported; only deepseek_v3 configs with GQA attention (kv_lora_rank and q_lora_rank null) run"));
            }
        }
    }
    // Qwen2 always has Q/K/V biases; others say so with `attention_bias`.
    let attn_bias = arch == Architecture::Qwen2Moe || cfg_bool(cfg, "attention_bias", false)?;
    let hidden = cfg_usize(cfg, "hidden_size")?;
    let heads = cfg_usize(cfg, "num_attention_heads")?;
    // Checked before the MoE layer flags are sized by it.
    let num_layers = super::config_dim("num_hidden_layers", cfg_usize(cfg, "num_hidden_layers")?)?;
    let c = ModelConfig {
        arch,
        vocab_size: cfg_usize(cfg, "vocab_size")?,
        hidden_size: hidden,
        intermediate_size: cfg_usize(cfg, "intermediate_size")?,
        num_layers,
        num_heads: heads,
        num_kv_heads: cfg_usize_or(cfg, "num_key_value_heads", heads)?,
        head_dim: cfg_usize_or(cfg, "head_dim", hidden / heads.max(1))?,
        rope_theta: cfg_f32(cfg, "rope_theta", 10000.0)?,
        rms_norm_eps: cfg_f32(cfg, "rms_norm_eps", 1e-6)?,
        max_position_embeddings: cfg_usize(cfg, "max_position_embeddings")?,
        tie_word_embeddings: cfg_bool(cfg, "tie_word_embeddings", false)?,
        attn_bias,
        qk_norm: arch == Architecture::Qwen3Moe,
        moe: moe_config(cfg, arch, num_layers)?,
    };
    c.validate()?;
    Ok(c)
}

/// The MoE part of a config (`None` for dense families).
fn moe_config(cfg: &Value, arch: Architecture, num_layers: usize) -> Result<Option<MoeConfig>, LoadError> {
    let top_k = || cfg_usize(cfg, "num_experts_per_tok");
    let softmax = |n_experts, top_k, norm_topk| Routing { scoring: Scoring::Softmax, n_experts, top_k, norm_topk, n_group: 1, topk_group: 1, scaling: 1.0 };
    let moe = match arch {
        Architecture::Llama => return Ok(None),
        Architecture::Mixtral => MoeConfig {
            routing: softmax(cfg_usize(cfg, "num_local_experts")?, top_k()?, true),
            expert_ffn: cfg_usize(cfg, "intermediate_size")?,
            shared_ffn: 0,
            shared_gate: false,
            correction_bias: false,
            layers: vec![true; num_layers],
        },
        Architecture::Qwen2Moe | Architecture::Qwen3Moe => {
            let step = cfg_usize_or(cfg, "decoder_sparse_step", 1)?.max(1);
            let dense: std::collections::BTreeSet<u64> = match cfg.get("mlp_only_layers") {
                None | Some(Value::Null) => Default::default(),
                Some(Value::Array(a)) => a.iter().map(|v| v.as_u64().ok_or_else(|| config_err("mlp_only_layers", "expected layer indices"))).collect::<Result<_, _>>()?,
                Some(_) => return Err(config_err("mlp_only_layers", "expected a list")),
            };
            let qwen2 = arch == Architecture::Qwen2Moe;
            MoeConfig {
                routing: softmax(cfg_usize_any(cfg, &["num_experts", "num_local_experts"])?, top_k()?, cfg_bool(cfg, "norm_topk_prob", false)?),
                expert_ffn: cfg_usize(cfg, "moe_intermediate_size")?,
                shared_ffn: if qwen2 { cfg_usize_or(cfg, "shared_expert_intermediate_size", 0)? } else { 0 },
                shared_gate: qwen2,
                correction_bias: false,
                layers: (0..num_layers).map(|l| !dense.contains(&(l as u64)) && (l + 1).is_multiple_of(step)).collect(),
            }
        }
        Architecture::DeepseekV3 => {
            let scoring = match cfg.get("scoring_func").and_then(Value::as_str).unwrap_or("sigmoid") {
                "sigmoid" => Scoring::Sigmoid,
                "softmax" => Scoring::Softmax,
                other => return Err(config_err("scoring_func", format!("{other:?} (expected sigmoid or softmax)"))),
            };
            // (correction bias, group-limited)
            let (correction_bias, grouped) = match cfg.get("topk_method").and_then(Value::as_str).unwrap_or("noaux_tc") {
                "noaux_tc" => (true, true),
                "group_limited_greedy" => (false, true),
                "greedy" => (false, false),
                other => return Err(config_err("topk_method", format!("{other:?} (expected noaux_tc, greedy or group_limited_greedy)"))),
            };
            let expert_ffn = cfg_usize(cfg, "moe_intermediate_size")?;
            let first_dense = cfg_usize_or(cfg, "first_k_dense_replace", 0)?;
            let freq = cfg_usize_or(cfg, "moe_layer_freq", 1)?.max(1);
            MoeConfig {
                routing: Routing {
                    scoring,
                    n_experts: cfg_usize(cfg, "n_routed_experts")?,
                    top_k: top_k()?,
                    norm_topk: cfg_bool(cfg, "norm_topk_prob", false)?,
                    n_group: if grouped { cfg_usize_or(cfg, "n_group", 1)? } else { 1 },
                    topk_group: if grouped { cfg_usize_or(cfg, "topk_group", 1)? } else { 1 },
                    scaling: cfg_f32(cfg, "routed_scaling_factor", 1.0)?,
                },
                expert_ffn,
                shared_ffn: expert_ffn
                    .checked_mul(cfg_usize_or(cfg, "n_shared_experts", 0)?)
                    .ok_or_else(|| config_err("n_shared_experts", "times moe_intermediate_size overflows"))?,
                shared_gate: false,
                correction_bias,
                layers: (0..num_layers).map(|l| l >= first_dense && l.is_multiple_of(freq)).collect(),
            }
        }
    };
    Ok(Some(moe))
}
