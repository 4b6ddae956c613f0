//! Hugging Face directory -> [`Checkpoint`]: config.json, `*.safetensors` (single file or
//! sharded via `model.safetensors.index.json`), tokenizer.json, tokenizer_config.json and
//! generation_config.json. Weights are F32/F16/BF16, or quantized as the config's
//! `quantization_config` says: the scheme (decoded above this module) takes its layers'
//! tensors from the [`TensorSet`] before [`HfDir::finish`] resolves the rest.

use super::hf_config::model_config;
use super::names::{canonical_name, stacked_experts, Stacked};
use super::tensor_set::TensorSet;
use super::{
    split_experts, Checkpoint, CheckpointFormat, LoadError, ModelConfig, SpecialTokens, TensorEntry, TokenizerSource,
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

/// The linear layers a checkpoint's quantization scheme decoded (taking their tensors from the
/// [`TensorSet`]), as [`HfDir::finish`] resolves the other tensors around them.
#[derive(Debug)]
pub struct QuantizedLayers<'a> {
    /// The scheme's `quant_method` (for messages).
    pub method: &'a str,
    /// Hugging Face module name of each decoded layer, by canonical weight name.
    pub modules: BTreeMap<&'a str, &'a str>,
}

/// Every tensor the quantization scheme (if any) has not taken, under its canonical name. A
/// tensor neither the scheme nor the model uses is an error.
fn resolve_tensors(set: &TensorSet, scheme: Option<&QuantizedLayers>) -> Result<BTreeMap<String, TensorEntry>, LoadError> {
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
            Some(s) if s.modules.values().any(|module| t.name.starts_with(&format!("{module}."))) => {
                LoadError::Tensor { name: t.name.clone(), msg: format!("not used by the {} scheme of its layer", s.method) }
            }
            _ => e,
        })?
        else {
            continue;
        };
        if scheme.is_some_and(|s| s.modules.contains_key(canon.as_str())) {
            return Err(LoadError::Tensor { name: t.name.clone(), msg: "plain weight next to quantized tensors of the same layer".into() });
        }
        let ty = storage_type(&t.name, t.dtype, scheme.is_some())?;
        tensors.insert(canon, TensorEntry { source_name: t.name.clone(), ty, shape: t.shape.clone(), data: t.data.clone() });
    }
    Ok(tensors)
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

/// A Hugging Face model directory being read, in the order its parts depend on:
/// [`HfDir::open`] reads config.json, [`HfDir::tensors`] maps the safetensors shards (from
/// which a quantization scheme takes its layers' tensors), and [`HfDir::finish`] resolves the
/// other tensors and reads the tokenizer files.
#[derive(Debug)]
pub struct HfDir {
    dir: PathBuf,
    cfg: Value,
    /// Hyper-parameters from config.json.
    pub config: ModelConfig,
}

impl HfDir {
    /// Reads the directory's config.json.
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let cfg = read_json(&dir.join("config.json"))?;
        let config = model_config(&cfg)?;
        Ok(HfDir { dir: dir.into(), cfg, config })
    }

    /// The config's `quantization_config` (`None` when absent or null).
    pub fn quantization_config(&self) -> Option<&Value> {
        self.cfg.get("quantization_config").filter(|q| !q.is_null())
    }

    /// Maps the safetensors shards and indexes their tensors by name.
    pub fn tensors(&self) -> Result<TensorSet, LoadError> {
        TensorSet::open(&shard_files(&self.dir)?)
    }

    /// The checkpoint: every tensor of `set` that `quantized` (the layers the config's
    /// quantization scheme decoded; `None` without `quantization_config`) did not take, under
    /// its canonical name, and the tokenizer files.
    pub fn finish(self, set: &TensorSet, quantized: Option<&QuantizedLayers>) -> Result<Checkpoint, LoadError> {
        let tensors = resolve_tensors(set, quantized)?;
        with_tokenizer(&self.dir, &self.cfg, self.config, tensors)
    }
}

/// The checkpoint of directory `dir` (config.json `cfg`, hyper-parameters `config`) holding
/// `tensors`, with the tokenizer, special tokens and chat template its files give.
fn with_tokenizer(dir: &Path, cfg: &Value, config: ModelConfig, tensors: BTreeMap<String, TensorEntry>) -> Result<Checkpoint, LoadError> {
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
        tokenizer: TokenizerSource::HfJson(Box::new(tok)),
        special,
    })
}
