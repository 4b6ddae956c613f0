//! Hugging Face directory -> [`Checkpoint`]: config.json, `*.safetensors` (single file or
//! sharded via `model.safetensors.index.json`), tokenizer.json, tokenizer_config.json and
//! generation_config.json. Weights are F32/F16/BF16, or quantized as the config's
//! `quantization_config` says (decoded by the scheme in [`crate::quant`]).

use super::hf_config::model_config;
use super::names::{canonical_name, is_linear, stacked_experts, Stacked};
use crate::quant::tensors::TensorSet;
use crate::quant::{self, QuantScheme, QuantizedWeight};
use super::{
    split_experts, Checkpoint, CheckpointFormat, LoadError, SpecialTokens, TensorEntry, TokenizerSource,
};
use safetensors::Dtype;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use tessera_kernels::ggml::GgmlType;

fn io(path: &Path, e: impl std::fmt::Display) -> LoadError {
    LoadError::Io { path: path.into(), msg: e.to_string() }
}

fn read_json(path: &Path) -> Result<Value, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    serde_json::from_str(&text).map_err(|e| io(path, format!("invalid JSON: {e}")))
}

fn read_json_opt(path: &Path) -> Result<Option<Value>, LoadError> {
    if path.exists() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

fn storage_type(name: &str, dtype: Dtype, quantized: bool) -> Result<GgmlType, LoadError> {
    match dtype {
        Dtype::F32 => Ok(GgmlType::F32),
        Dtype::F16 => Ok(GgmlType::F16),
        Dtype::BF16 => Ok(GgmlType::BF16),
        other => Err(LoadError::Tensor {
            name: name.into(),
            msg: if quantized {
                format!("dtype {other:?} for a tensor the quantization scheme does not cover")
            } else {
                format!("dtype {other:?} in a checkpoint without quantization_config")
            },
        }),
    }
}

/// The safetensors shard files of a directory.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let v = read_json(&index)?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| io(&index, "no weight_map object"))?;
        let files: BTreeSet<&str> = map.values().filter_map(Value::as_str).collect();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(io(dir, "no model.safetensors or model.safetensors.index.json"))
}

/// Quantized linear layers (by canonical name) as the scheme decodes them, then every
/// remaining tensor under its canonical name. A tensor neither the scheme nor the model
/// uses is an error.
type Tensors = (BTreeMap<String, TensorEntry>, BTreeMap<String, QuantizedWeight>);

fn resolve_tensors(set: &TensorSet, scheme: Option<&dyn QuantScheme>) -> Result<Tensors, LoadError> {
    let mut quantized = BTreeMap::new();
    if let Some(scheme) = scheme {
        let modules: BTreeSet<&str> = set.names().filter_map(|n| n.rsplit_once('.').map(|(m, _)| m)).collect();
        for module in modules {
            let Ok(Some(canon)) = canonical_name(&format!("{module}.weight")) else { continue };
            if !is_linear(&canon) {
                continue;
            }
            if let Some(q) = scheme.load_linear(module, set)? {
                quantized.insert(canon, q);
            }
        }
    }
    let mut tensors = BTreeMap::new();
    for t in set.untaken() {
        if let Some((layer, kind)) = stacked_experts(&t.name) {
            let entry = TensorEntry { source_name: t.name.clone(), ty: storage_type(&t.name, t.dtype, scheme.is_some())?, shape: t.shape.clone(), data: t.data.clone() };
            let rows = t.shape.get(1).copied().unwrap_or(0);
            let parts: &[(&str, usize)] = match kind {
                Stacked::GateUp => &[("ffn_gate_exps", rows / 2), ("ffn_up_exps", rows - rows / 2)],
                Stacked::Down => &[("ffn_down_exps", rows)],
            };
            tensors.extend(split_experts(&entry, layer, parts)?);
            continue;
        }
        let Some(canon) = canonical_name(&t.name).map_err(|e| match scheme {
            Some(s) if quantized.values().any(|q: &QuantizedWeight| t.name.starts_with(&format!("{}.", q.module))) => {
                LoadError::Tensor { name: t.name.clone(), msg: format!("not used by the {} scheme of its layer", s.method()) }
            }
            _ => e,
        })?
        else {
            continue;
        };
        if quantized.contains_key(&canon) {
            return Err(LoadError::Tensor { name: t.name.clone(), msg: "plain weight next to quantized tensors of the same layer".into() });
        }
        let ty = storage_type(&t.name, t.dtype, scheme.is_some())?;
        tensors.insert(canon, TensorEntry { source_name: t.name.clone(), ty, shape: t.shape.clone(), data: t.data.clone() });
    }
    Ok((tensors, quantized))
}

/// Resolves a token given as a string or `{"content": ...}` to its id.
fn token_ref(v: Option<&Value>, tok: &tokenizers::Tokenizer) -> Option<u32> {
    let s = match v? {
        Value::String(s) => s.as_str(),
        Value::Object(o) => o.get("content")?.as_str()?,
        _ => return None,
    };
    tok.token_to_id(s)
}

fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => vec![],
    }
}

/// Loads a Hugging Face model directory.
pub fn load(dir: &Path) -> Result<Checkpoint, LoadError> {
    let cfg = read_json(&dir.join("config.json"))?;
    let config = model_config(&cfg)?;
    let qc = cfg.get("quantization_config").filter(|q| !q.is_null());
    let scheme = qc.map(quant::from_config).transpose()?;
    let set = TensorSet::open(&shard_files(dir)?)?;
    let kv_cache = match qc.map(quant::kv_cache::parse_scheme).transpose()?.flatten() {
        Some(format) => Some(quant::kv_cache::load_scales(format, &set, config.num_layers)?),
        None => None,
    };
    let (tensors, quantized) = resolve_tensors(&set, scheme.as_deref())?;

    let tok_path = dir.join("tokenizer.json");
    let tok = tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| LoadError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
    let tcfg = read_json_opt(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
    let gcfg = read_json_opt(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);
    let chat_template = match tcfg.get("chat_template") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or(named.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_owned),
        _ => None,
    };
    let mut eos = ids(gcfg.get("eos_token_id"));
    if eos.is_empty() {
        eos = ids(cfg.get("eos_token_id"));
    }
    if let Some(e) = token_ref(tcfg.get("eos_token"), &tok) {
        if !eos.contains(&e) {
            eos.push(e);
        }
    }
    let special = SpecialTokens {
        bos: token_ref(tcfg.get("bos_token"), &tok).or_else(|| ids(cfg.get("bos_token_id")).first().copied()),
        eos,
        add_bos: tcfg.get("add_bos_token").and_then(Value::as_bool).unwrap_or(false),
        chat_template,
    };
    let name = dir.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(Checkpoint {
        path: dir.into(),
        format: CheckpointFormat::HfDir,
        name,
        config,
        tensors,
        quantized,
        quantization: scheme.map(|s| s.summary()),
        kv_cache,
        tokenizer: TokenizerSource::HfJson(Box::new(tok)),
        special,
    })
}
