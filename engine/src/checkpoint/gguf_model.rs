//! GGUF file -> [`Checkpoint`]: hyper-parameters from `{arch}.*` keys, tensors kept mapped
//! (Q/K rows un-permuted into owned buffers, stacked experts split per expert), tokenizer
//! vocabulary from `tokenizer.ggml.*`.

use super::gguf::{GgufFile, MetaValue};
use super::{
    split_experts, unpermute_qk_rows, Architecture, Checkpoint, CheckpointFormat, LoadError, ModelConfig, MoeConfig,
    SpecialTokens, TensorBytes, TensorEntry, TokenizerSource,
};
use super::routing::{Routing, Scoring};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// A tokenizer vocabulary as GGUF stores it.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model` (e.g. `gpt2`).
    pub model: String,
    /// `tokenizer.ggml.pre` (pre-tokenizer name, e.g. `smollm`).
    pub pre: Option<String>,
    /// Token strings by id.
    pub tokens: Vec<String>,
    /// llama.cpp token types by id (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
    pub token_types: Vec<i32>,
    /// BPE merges, `"a b"`.
    pub merges: Vec<String>,
}

fn meta<'a>(f: &'a GgufFile, key: &str) -> Result<&'a MetaValue, LoadError> {
    f.get(key).ok_or_else(|| LoadError::Config { key: key.into(), msg: "missing".into() })
}

fn meta_usize(f: &GgufFile, key: &str) -> Result<usize, LoadError> {
    let v = meta(f, key)?;
    v.as_u64()
        .and_then(|x| usize::try_from(x).ok())
        .ok_or_else(|| LoadError::Config { key: key.into(), msg: format!("expected an unsigned integer, got {v}") })
}

fn meta_f32_or(f: &GgufFile, key: &str, default: f32) -> Result<f32, LoadError> {
    match f.get(key) {
        None => Ok(default),
        Some(v) => v
            .as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| LoadError::Config { key: key.into(), msg: format!("expected a number, got {v}") }),
    }
}

fn string_array(f: &GgufFile, key: &str) -> Result<Vec<String>, LoadError> {
    let v = meta(f, key)?;
    let arr = v.as_array().ok_or_else(|| LoadError::Config { key: key.into(), msg: "expected an array".into() })?;
    arr.iter()
        .map(|x| {
            x.as_str()
                .map(str::to_owned)
                .ok_or_else(|| LoadError::Config { key: key.into(), msg: "expected strings".into() })
        })
        .collect()
}

fn token_id(f: &GgufFile, key: &str, vocab: usize) -> Result<Option<u32>, LoadError> {
    match f.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(id) if (id as usize) < vocab => Ok(Some(id as u32)),
            _ => Err(LoadError::Config { key: key.into(), msg: format!("{v} is not a token id below {vocab}") }),
        },
    }
}

/// `(layer, kind)` of llama.cpp's stacked expert tensors `blk.N.ffn_{gate,up,down}_exps.weight`.
fn stacked_gguf_experts(name: &str) -> Option<(usize, &'static str)> {
    let (idx, short) = name.strip_prefix("blk.")?.split_once('.')?;
    let kind = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"].into_iter().find(|k| short.strip_suffix(".weight") == Some(*k))?;
    Some((idx.parse().ok()?, kind))
}

/// Loads a GGUF checkpoint.
pub fn load(path: &Path) -> Result<Checkpoint, LoadError> {
    let f = GgufFile::open(path).map_err(|error| LoadError::Gguf { path: path.into(), error })?;
    from_file(f, path)
}

/// A checkpoint from an opened GGUF file (`path` names it in errors and gives the default name).
pub(crate) fn from_file(f: GgufFile, path: &Path) -> Result<Checkpoint, LoadError> {
    let arch_name = meta(&f, "general.architecture")?
        .as_str()
        .ok_or_else(|| LoadError::Config { key: "general.architecture".into(), msg: "expected a string".into() })?
        .to_owned();
    if arch_name != "llama" {
        return Err(LoadError::Architecture(arch_name));
    }
    let a = |k: &str| format!("{arch_name}.{k}");
    if let Some(t) = f.get(&a("rope.scaling.type")).and_then(MetaValue::as_str) {
        if t != "none" {
            return Err(LoadError::Config { key: a("rope.scaling.type"), msg: format!("RoPE scaling {t:?} is not supported yet") });
        }
    }

    let tokens = string_array(&f, "tokenizer.ggml.tokens")?;
    let hidden = meta_usize(&f, &a("embedding_length"))?;
    let num_heads = meta_usize(&f, &a("attention.head_count"))?;
    let head_dim = match f.get(&a("attention.key_length")) {
        Some(_) => meta_usize(&f, &a("attention.key_length"))?,
        None => hidden / num_heads.max(1),
    };
    if let Some(rot) = f.get(&a("rope.dimension_count")) {
        if rot.as_u64() != Some(head_dim as u64) {
            return Err(LoadError::Config { key: a("rope.dimension_count"), msg: format!("{rot} (partial rotary is not supported; head_dim {head_dim})") });
        }
    }
    // Checked before the MoE layer flags are sized by it.
    let num_layers = super::config_dim(&a("block_count"), meta_usize(&f, &a("block_count"))?)?;
    // Mixtral GGUFs are `llama` with experts: softmax top-k, renormalized, every layer MoE.
    let moe = match f.get(&a("expert_count")) {
        None => None,
        Some(_) => {
            let n_experts = meta_usize(&f, &a("expert_count"))?;
            let top_k = meta_usize(&f, &a("expert_used_count"))?;
            Some(MoeConfig {
                routing: Routing { scoring: Scoring::Softmax, n_experts, top_k, norm_topk: true, n_group: 1, topk_group: 1, scaling: 1.0 },
                expert_ffn: meta_usize(&f, &a("feed_forward_length"))?,
                shared_ffn: 0,
                shared_gate: false,
                correction_bias: false,
                layers: vec![true; num_layers],
            })
        }
    };
    let config = ModelConfig {
        arch: if moe.is_some() { Architecture::Mixtral } else { Architecture::Llama },
        vocab_size: match f.get(&a("vocab_size")) {
            Some(_) => meta_usize(&f, &a("vocab_size"))?,
            None => tokens.len(),
        },
        hidden_size: hidden,
        intermediate_size: meta_usize(&f, &a("feed_forward_length"))?,
        num_layers,
        num_heads,
        num_kv_heads: match f.get(&a("attention.head_count_kv")) {
            Some(_) => meta_usize(&f, &a("attention.head_count_kv"))?,
            None => num_heads,
        },
        head_dim,
        rope_theta: meta_f32_or(&f, &a("rope.freq_base"), 10000.0)?,
        rms_norm_eps: meta_f32_or(&f, &a("attention.layer_norm_rms_epsilon"), 1e-5)?,
        max_position_embeddings: meta_usize(&f, &a("context_length"))?,
        tie_word_embeddings: !f.tensors.iter().any(|t| t.name == "output.weight"),
        attn_bias: false,
        qk_norm: false,
        moe,
    };
    config.validate()?;

    let mut tensors = BTreeMap::new();
    for t in &f.tensors {
        let shape: Vec<usize> = t.dims.iter().rev().copied().collect();
        let range = t.offset..t.offset + t.nbytes;
        let is_q = t.name.ends_with(".attn_q.weight");
        let is_k = t.name.ends_with(".attn_k.weight");
        let data = if is_q || is_k {
            let rows = shape[0];
            if shape.len() != 2 || !rows.is_multiple_of(config.head_dim) {
                return Err(LoadError::Tensor {
                    name: t.name.clone(),
                    msg: format!("shape {shape:?} is not whole heads of {}", config.head_dim),
                });
            }
            TensorBytes::Owned(Arc::from(unpermute_qk_rows(f.tensor_data(t), rows, config.head_dim)))
        } else {
            TensorBytes::Mapped(f.map().clone(), range)
        };
        let entry = TensorEntry { source_name: t.name.clone(), ty: t.ty, shape, data };
        match stacked_gguf_experts(&t.name) {
            Some((layer, kind)) => tensors.extend(split_experts(&entry, layer, &[(kind, entry.shape.get(1).copied().unwrap_or(0))])?),
            None => {
                tensors.insert(t.name.clone(), entry);
            }
        }
    }

    let vocab = GgufVocab {
        model: meta(&f, "tokenizer.ggml.model")?.as_str().unwrap_or_default().to_owned(),
        pre: f.get("tokenizer.ggml.pre").and_then(MetaValue::as_str).map(str::to_owned),
        token_types: match f.get("tokenizer.ggml.token_type").and_then(MetaValue::as_array) {
            Some(arr) => arr
                .iter()
                .map(|v| match v {
                    MetaValue::I32(x) => Ok(*x),
                    other => other.as_u64().map(|x| x as i32).ok_or_else(|| LoadError::Config {
                        key: "tokenizer.ggml.token_type".into(),
                        msg: "expected integers".into(),
                    }),
                })
                .collect::<Result<_, _>>()?,
            None => vec![1; tokens.len()],
        },
        merges: if f.get("tokenizer.ggml.merges").is_some() { string_array(&f, "tokenizer.ggml.merges")? } else { vec![] },
        tokens,
    };
    if vocab.token_types.len() != vocab.tokens.len() {
        return Err(LoadError::Config {
            key: "tokenizer.ggml.token_type".into(),
            msg: format!("{} entries for {} tokens", vocab.token_types.len(), vocab.tokens.len()),
        });
    }
    let n = vocab.tokens.len();
    let special = SpecialTokens {
        bos: token_id(&f, "tokenizer.ggml.bos_token_id", n)?,
        eos: token_id(&f, "tokenizer.ggml.eos_token_id", n)?
            .into_iter()
            .chain(token_id(&f, "tokenizer.ggml.eot_token_id", n)?)
            .collect(),
        add_bos: f.get("tokenizer.ggml.add_bos_token").and_then(MetaValue::as_bool).unwrap_or(true),
        chat_template: f.get("tokenizer.chat_template").and_then(MetaValue::as_str).map(str::to_owned),
    };
    let name = f
        .get("general.name")
        .and_then(MetaValue::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default());
    Ok(Checkpoint {
        path: path.into(),
        format: CheckpointFormat::Gguf,
        name,
        config,
        tensors,
        tokenizer: TokenizerSource::Gguf(Box::new(vocab)),
        special,
    })
}
