//! The one table between Hugging Face Llama tensor names and the canonical (GGUF-style) names
//! that [`Checkpoint`](super::Checkpoint) uses, in both directions.

use super::LoadError;

/// Whole-model tensors: (Hugging Face name, canonical name).
const GLOBAL: [(&str, &str); 3] = [
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// Per-layer tensors: (suffix after `model.layers.N.`, canonical short name in `blk.N.<short>.weight`).
const LAYER: [(&str, &str); 9] = [
    ("input_layernorm.weight", "attn_norm"),
    ("post_attention_layernorm.weight", "ffn_norm"),
    ("self_attn.q_proj.weight", "attn_q"),
    ("self_attn.k_proj.weight", "attn_k"),
    ("self_attn.v_proj.weight", "attn_v"),
    ("self_attn.o_proj.weight", "attn_output"),
    ("mlp.gate_proj.weight", "ffn_gate"),
    ("mlp.up_proj.weight", "ffn_up"),
    ("mlp.down_proj.weight", "ffn_down"),
];

/// Maps a Hugging Face Llama tensor name to the canonical (GGUF-style) name.
/// `Ok(None)` for buffers that carry no weights (e.g. `rotary_emb.inv_freq`).
pub fn canonical_name(name: &str) -> Result<Option<String>, LoadError> {
    if let Some((_, c)) = GLOBAL.iter().find(|(hf, _)| *hf == name) {
        return Ok(Some(c.to_string()));
    }
    let unknown = || LoadError::Tensor { name: name.into(), msg: "not a Llama tensor name".into() };
    let rest = name.strip_prefix("model.layers.").ok_or_else(unknown)?;
    let (idx, suffix) = rest.split_once('.').ok_or_else(unknown)?;
    let idx: usize = idx.parse().map_err(|_| unknown())?;
    if suffix == "self_attn.rotary_emb.inv_freq" {
        return Ok(None);
    }
    let (_, short) = LAYER.iter().find(|(hf, _)| *hf == suffix).ok_or_else(unknown)?;
    Ok(Some(format!("blk.{idx}.{short}.weight")))
}

/// Maps a canonical tensor name back to its Hugging Face Llama name (`None` when the
/// canonical name has no Hugging Face counterpart).
pub fn hf_name(canonical: &str) -> Option<String> {
    if let Some((hf, _)) = GLOBAL.iter().find(|(_, c)| *c == canonical) {
        return Some(hf.to_string());
    }
    let rest = canonical.strip_prefix("blk.")?;
    let (idx, short) = rest.split_once('.')?;
    let idx: usize = idx.parse().ok()?;
    let short = short.strip_suffix(".weight")?;
    let (suffix, _) = LAYER.iter().find(|(_, s)| *s == short)?;
    Some(format!("model.layers.{idx}.{suffix}"))
}

/// Whether a canonical tensor name is the weight of a linear layer (a matmul the
/// quantization plan covers), as opposed to an embedding or a norm.
pub fn is_linear(canonical: &str) -> bool {
    canonical == "output.weight"
        || ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
            .iter()
            .any(|s| canonical.strip_suffix(".weight").is_some_and(|c| c.ends_with(&format!(".{s}"))))
}
