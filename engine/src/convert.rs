//! A loaded checkpoint (in practice a GGUF Llama file) written out as a Hugging Face directory
//! that transformers and Tessera's own HF loader read: `config.json` (`LlamaForCausalLM`),
//! safetensors weights under Hugging Face names, every tensor dequantized and rounded to one
//! float type, `tokenizer.json` (the tokenizer the engine builds from the GGUF vocabulary),
//! `tokenizer_config.json` and `generation_config.json`.
//!
//! Q/K rows come out in Hugging Face (rotate-half) order: the checkpoint loader has already
//! undone llama.cpp's permutation. Shards are written one at a time, so memory holds one
//! output shard (plus the mapped input).

use crate::checkpoint::{names, Checkpoint, LoadError};
use crate::float_dtype::FloatDtype;
use crate::tokenizer::Tokenizer;
use safetensors::tensor::TensorView;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use tessera_kernels::ggml::dequantize_row;

/// Errors while converting. Messages name the file or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// The input checkpoint could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// A tensor that cannot be converted.
    #[error("tensor {name}: {msg}")]
    Tensor {
        /// Canonical tensor name.
        name: String,
        /// What was wrong.
        msg: String,
    },
    /// Writing an output file failed.
    #[error("{path}: {msg}")]
    Io {
        /// File at fault.
        path: PathBuf,
        /// What failed.
        msg: String,
    },
}

fn io(path: &Path, e: impl std::fmt::Display) -> ConvertError {
    ConvertError::Io { path: path.into(), msg: e.to_string() }
}

/// Options of [`to_hf_dir`].
#[derive(Clone, Copy, Debug)]
pub struct ConvertOptions {
    /// Float type of every output tensor.
    pub dtype: FloatDtype,
    /// Start a new shard when the current one would exceed this many bytes (`None`: one file).
    pub max_shard_bytes: Option<u64>,
}

/// What was written.
#[derive(Clone, Debug)]
pub struct ConvertSummary {
    /// Tensors written.
    pub tensors: usize,
    /// Shard file names, in order.
    pub shards: Vec<String>,
    /// Bytes of tensor data written.
    pub bytes: u64,
}

/// A JSON number holding the shortest decimal that round-trips `x` as an f32 (so `1e-5`
/// stays `1e-5`, not `9.999999747378752e-6`).
fn f32_json(x: f32) -> Value {
    x.to_string().parse::<f64>().ok().and_then(serde_json::Number::from_f64).map_or(Value::Null, Value::Number)
}

/// One id as a JSON number, several as a list, none as null (transformers' convention).
fn ids_json(ids: &[u32]) -> Value {
    match ids {
        [] => Value::Null,
        [one] => json!(one),
        many => json!(many),
    }
}

fn write_json(path: &Path, v: &Value) -> Result<(), ConvertError> {
    let text = serde_json::to_string_pretty(v).map_err(|e| io(path, e))?;
    std::fs::write(path, text + "\n").map_err(|e| io(path, e))
}

/// `config.json` for a checkpoint: Llama architecture, every hyper-parameter, special ids.
pub fn hf_config(ck: &Checkpoint, dtype: FloatDtype) -> Value {
    let c = &ck.config;
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": f32_json(c.rms_norm_eps),
        "rope_theta": f32_json(c.rope_theta),
        "rope_scaling": null,
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": ck.special.bos,
        "eos_token_id": ids_json(&ck.special.eos),
        "torch_dtype": dtype.torch_name(),
        "use_cache": true,
    })
}

/// `tokenizer_config.json`: chat template, BOS/EOS token strings and the BOS policy.
fn tokenizer_config(ck: &Checkpoint, tok: &Tokenizer) -> Value {
    let content = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i)).map_or(Value::Null, Value::String);
    let mut m = Map::new();
    m.insert("add_bos_token".into(), json!(ck.special.add_bos));
    m.insert("add_eos_token".into(), json!(false));
    m.insert("bos_token".into(), content(ck.special.bos));
    m.insert("eos_token".into(), content(ck.special.eos.first().copied()));
    if let Some(t) = &ck.special.chat_template {
        m.insert("chat_template".into(), json!(t));
    }
    m.insert("clean_up_tokenization_spaces".into(), json!(false));
    m.insert("model_max_length".into(), json!(ck.config.max_position_embeddings));
    m.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    Value::Object(m)
}

/// A tensor dequantized to f32, checking its byte length first (no panics on bad files).
pub fn dequantize(name: &str, t: &crate::checkpoint::TensorEntry) -> Result<Vec<f32>, ConvertError> {
    let n: usize = t.shape.iter().product();
    let bytes = t.data.bytes();
    if t.ty.row_bytes(n) != Some(bytes.len()) {
        return Err(ConvertError::Tensor {
            name: name.into(),
            msg: format!("{} bytes do not hold {n} {} values", bytes.len(), t.ty),
        });
    }
    let mut out = vec![0f32; n];
    dequantize_row(t.ty, bytes, &mut out);
    Ok(out)
}

/// One output tensor: its Hugging Face name, shape, and how to compute its values (called
/// when its shard is written, so only one shard's values are in memory at a time).
pub struct OutTensor<'a> {
    /// Hugging Face name.
    pub name: String,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Produces the values (row-major, `shape`'s product of them).
    pub values: Box<dyn Fn() -> Result<Vec<f32>, ConvertError> + 'a>,
}

/// Splits tensors into shards of at most `max` bytes each (a tensor larger than `max` gets a
/// shard of its own).
fn plan_shards(tensors: Vec<OutTensor<'_>>, bytes_per_value: u64, max: Option<u64>) -> Vec<Vec<OutTensor<'_>>> {
    let mut shards: Vec<Vec<OutTensor>> = vec![Vec::new()];
    let mut size = 0u64;
    for t in tensors {
        let bytes = t.shape.iter().map(|&d| d as u64).product::<u64>() * bytes_per_value;
        let last = shards.last_mut().expect("at least one shard");
        if max.is_some_and(|m| size + bytes > m) && !last.is_empty() {
            shards.push(Vec::new());
            size = 0;
        }
        size += bytes;
        shards.last_mut().expect("at least one shard").push(t);
    }
    shards
}

/// Writes `ck` as a Hugging Face Llama directory in `output` (created if missing).
pub fn to_hf_dir(ck: &Checkpoint, output: &Path, opts: &ConvertOptions) -> Result<ConvertSummary, ConvertError> {
    if ck.config.moe.is_some() {
        return Err(ConvertError::Tensor { name: "<model>".into(), msg: format!("{:?} is a mixture of experts; only dense Llama models convert", ck.config.arch) });
    }
    let mut tensors = Vec::with_capacity(ck.tensors.len());
    for (canon, t) in &ck.tensors {
        let hf = names::hf_name(canon).ok_or_else(|| ConvertError::Tensor {
            name: canon.clone(),
            msg: "has no Hugging Face Llama name".into(),
        })?;
        tensors.push(OutTensor { name: hf, shape: t.shape.clone(), values: Box::new(move || dequantize(canon, t)) });
    }
    write_hf_dir(ck, output, opts, &hf_config(ck, opts.dtype), tensors)
}

/// Writes a Hugging Face directory: `tensors` rounded to `opts.dtype` into safetensors shards
/// (with an index when there are several), `config`, and `ck`'s tokenizer, tokenizer config and
/// generation config.
pub fn write_hf_dir(ck: &Checkpoint, output: &Path, opts: &ConvertOptions, config: &Value, tensors: Vec<OutTensor<'_>>) -> Result<ConvertSummary, ConvertError> {
    let tok = Tokenizer::from_checkpoint(ck)?;
    std::fs::create_dir_all(output).map_err(|e| io(output, e))?;
    let n_tensors = tensors.len();
    let shards = plan_shards(tensors, opts.dtype.size() as u64, opts.max_shard_bytes);
    let count = shards.len();
    let mut weight_map = BTreeMap::new();
    let mut files = Vec::with_capacity(count);
    let mut total = 0u64;
    let metadata = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    for (i, shard) in shards.iter().enumerate() {
        let file = if count == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{count:05}.safetensors", i + 1) };
        let mut data = Vec::with_capacity(shard.len());
        for t in shard {
            let values = (t.values)()?;
            let n: usize = t.shape.iter().product();
            if values.len() != n {
                return Err(ConvertError::Tensor { name: t.name.clone(), msg: format!("{} values for shape {:?}", values.len(), t.shape) });
            }
            data.push((t.name.clone(), t.shape.clone(), opts.dtype.encode(&values)));
            weight_map.insert(t.name.clone(), file.clone());
        }
        let views = data
            .iter()
            .map(|(n, s, b)| TensorView::new(opts.dtype.safetensors(), s.clone(), b).map(|v| (n.clone(), v)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| io(&output.join(&file), e))?;
        total += data.iter().map(|d| d.2.len() as u64).sum::<u64>();
        let path = output.join(&file);
        safetensors::serialize_to_file(views, &metadata, &path).map_err(|e| io(&path, e))?;
        files.push(file);
    }
    if count > 1 {
        let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        write_json(&output.join("model.safetensors.index.json"), &index)?;
    }

    write_json(&output.join("config.json"), config)?;
    let tok_path = output.join("tokenizer.json");
    tok.inner().save(&tok_path, false).map_err(|e| io(&tok_path, e))?;
    write_json(&output.join("tokenizer_config.json"), &tokenizer_config(ck, &tok))?;
    let generation = json!({
        "bos_token_id": ck.special.bos,
        "eos_token_id": ids_json(&ck.special.eos),
    });
    write_json(&output.join("generation_config.json"), &generation)?;
    Ok(ConvertSummary { tensors: n_tensors, shards: files, bytes: total })
}
