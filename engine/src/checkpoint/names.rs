//! The one table between Hugging Face tensor names (Llama, Mixtral, Qwen2/3-MoE, DeepSeek-V3)
//! and the canonical (GGUF-style) names that [`Checkpoint`](super::Checkpoint) uses, in both
//! directions.
//!
//! Canonical MoE names follow llama.cpp's: router `blk.N.ffn_gate_inp.weight`, correction bias
//! `blk.N.exp_probs_b.bias`, shared expert `blk.N.ffn_{gate,up,down}_shexp.weight` and its gate
//! `blk.N.ffn_gate_inp_shexp.weight`; routed expert `E` is `blk.N.ffn_{gate,up,down}_exps.E.weight`
//! (llama.cpp stacks all experts in `blk.N.ffn_gate_exps.weight`; loaders split stacks per expert).

use super::LoadError;

/// Whole-model tensors: (Hugging Face name, canonical name).
const GLOBAL: [(&str, &str); 3] = [
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// Per-layer tensors: (suffix after `model.layers.N.`, canonical suffix after `blk.N.`). Where
/// two families name one tensor differently, the first row is the name written back.
const LAYER: [(&str, &str); 21] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
    ("mlp.gate.weight", "ffn_gate_inp.weight"),
    ("block_sparse_moe.gate.weight", "ffn_gate_inp.weight"),
    ("mlp.gate.e_score_correction_bias", "exp_probs_b.bias"),
    ("mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"),
    ("mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"),
    ("mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"),
    ("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
];

/// DeepSeek's plural shared-expert names (read only; Qwen's singular ones are written back).
const LAYER_DEEPSEEK_SHARED: [(&str, &str); 3] = [
    ("mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight"),
];

/// Per-expert projections: (Hugging Face leaf after `experts.E.`, canonical kind). Qwen/DeepSeek
/// names first, then Mixtral's `w1` (gate), `w3` (up), `w2` (down).
const EXPERT: [(&str, &str); 6] = [
    ("gate_proj", "ffn_gate_exps"),
    ("up_proj", "ffn_up_exps"),
    ("down_proj", "ffn_down_exps"),
    ("w1", "ffn_gate_exps"),
    ("w3", "ffn_up_exps"),
    ("w2", "ffn_down_exps"),
];

/// A stacked expert tensor (transformers 5's fused layout: one 3-D tensor for all experts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stacked {
    /// `mlp.experts.gate_up_proj` `[E, 2·I, hidden]`: gate rows, then up rows.
    GateUp,
    /// `mlp.experts.down_proj` `[E, hidden, I]`.
    Down,
}

/// `(layer, kind)` when `name` is a stacked expert tensor.
pub fn stacked_experts(name: &str) -> Option<(usize, Stacked)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (idx, suffix) = rest.split_once('.')?;
    let kind = match suffix {
        "mlp.experts.gate_up_proj" => Stacked::GateUp,
        "mlp.experts.down_proj" => Stacked::Down,
        _ => return None,
    };
    Some((idx.parse().ok()?, kind))
}

/// Canonical name of routed expert `expert`'s projection `kind` (`ffn_gate_exps`, ...) in `layer`.
pub fn expert_name(layer: usize, kind: &str, expert: usize) -> String {
    format!("blk.{layer}.{kind}.{expert}.weight")
}

/// Maps a Hugging Face tensor name to the canonical (GGUF-style) name.
/// `Ok(None)` for buffers that carry no weights (e.g. `rotary_emb.inv_freq`).
pub fn canonical_name(name: &str) -> Result<Option<String>, LoadError> {
    if let Some((_, c)) = GLOBAL.iter().find(|(hf, _)| *hf == name) {
        return Ok(Some(c.to_string()));
    }
    let unknown = || LoadError::Tensor { name: name.into(), msg: "not a tensor name of a supported architecture".into() };
    let rest = name.strip_prefix("model.layers.").ok_or_else(unknown)?;
    let (idx, suffix) = rest.split_once('.').ok_or_else(unknown)?;
    let idx: usize = idx.parse().map_err(|_| unknown())?;
    if suffix == "self_attn.rotary_emb.inv_freq" {
        return Ok(None);
    }
    if let Some((_, c)) = LAYER.iter().chain(&LAYER_DEEPSEEK_SHARED).find(|(hf, _)| *hf == suffix) {
        return Ok(Some(format!("blk.{idx}.{c}")));
    }
    let experts = suffix.strip_prefix("mlp.experts.").or_else(|| suffix.strip_prefix("block_sparse_moe.experts."));
    let (e, leaf) = experts.and_then(|r| r.split_once('.')).ok_or_else(unknown)?;
    let e: usize = e.parse().map_err(|_| unknown())?;
    let leaf = leaf.strip_suffix(".weight").ok_or_else(unknown)?;
    let (_, kind) = EXPERT.iter().find(|(hf, _)| *hf == leaf).ok_or_else(unknown)?;
    Ok(Some(expert_name(idx, kind, e)))
}

/// Maps a canonical tensor name back to its Hugging Face name (Llama / Qwen naming; `None`
/// when the canonical name has no Hugging Face counterpart).
pub fn hf_name(canonical: &str) -> Option<String> {
    if let Some((hf, _)) = GLOBAL.iter().find(|(_, c)| *c == canonical) {
        return Some(hf.to_string());
    }
    let rest = canonical.strip_prefix("blk.")?;
    let (idx, short) = rest.split_once('.')?;
    let idx: usize = idx.parse().ok()?;
    if let Some((suffix, _)) = LAYER.iter().find(|(_, s)| *s == short) {
        return Some(format!("model.layers.{idx}.{suffix}"));
    }
    let (kind, rest) = short.split_once('.')?;
    let e: usize = rest.strip_suffix(".weight")?.parse().ok()?;
    let (leaf, _) = EXPERT.iter().find(|(_, k)| *k == kind)?;
    Some(format!("model.layers.{idx}.mlp.experts.{e}.{leaf}.weight"))
}

/// Whether a canonical tensor name is the weight of a linear layer a checkpoint quantization
/// scheme may cover: attention and MLP projections (dense, routed and shared experts) and the
/// output head. Routers are linear layers too but run in float, as in vLLM and SGLang.
pub fn is_linear(canonical: &str) -> bool {
    if canonical == "output.weight" {
        return true;
    }
    let Some(rest) = canonical.strip_prefix("blk.").and_then(|r| r.split_once('.')).map(|(_, s)| s) else { return false };
    const DENSE: [&str; 10] = [
        "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
    ];
    match rest.strip_suffix(".weight") {
        Some(short) if DENSE.contains(&short) => true,
        Some(short) => short
            .split_once('.')
            .is_some_and(|(kind, e)| kind.ends_with("_exps") && EXPERT.iter().any(|(_, k)| *k == kind) && e.parse::<usize>().is_ok()),
        None => false,
    }
}
