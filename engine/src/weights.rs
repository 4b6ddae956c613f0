//! Opening a checkpoint for a model: the reader's [`Checkpoint`] plus what its quantization
//! metadata decodes to, the linear layers of its `quantization_config` scheme ([`crate::schemes`])
//! and its quantized KV cache ([`crate::kv_cache::checkpoint_scheme`]).

use crate::checkpoint::names::{canonical_name, is_linear};
use crate::checkpoint::{load_gguf, Checkpoint, HfDir, LoadError, QuantizedLayers, TensorSet};
use crate::kv_cache::{checkpoint_scheme, KvCacheScheme};
use crate::schemes::transform::{self, Side};
use crate::schemes::{self, QuantScheme, QuantizedWeight};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use tessera_kernels::ops::BlockTransform;

/// A checkpoint with its quantization schemes decoded: what a model is built from.
#[derive(Debug)]
pub struct ModelWeights {
    /// Hyper-parameters, tensors in their storage types, tokenizer, special tokens.
    pub checkpoint: Checkpoint,
    /// Linear layers a checkpoint quantization scheme decoded, by canonical weight name.
    pub quantized: BTreeMap<String, QuantizedWeight>,
    /// The checkpoint's quantization scheme, summarized (`None` without `quantization_config`).
    pub quantization: Option<String>,
    /// The quantized KV cache its metadata asks for (`kv_cache_scheme` and per-layer scales).
    pub kv_cache: Option<KvCacheScheme>,
    /// Online input transforms (compressed-tensors `transform_config`), by canonical weight
    /// name of the linear layer that reads them.
    pub input_transforms: BTreeMap<String, Arc<BlockTransform>>,
    /// Online output transforms, by canonical weight name of the linear layer whose outputs
    /// they turn.
    pub output_transforms: BTreeMap<String, Arc<BlockTransform>>,
}

impl From<Checkpoint> for ModelWeights {
    /// A checkpoint without quantization metadata (GGUF, or made in memory).
    fn from(checkpoint: Checkpoint) -> Self {
        ModelWeights { checkpoint, quantized: BTreeMap::new(), quantization: None, kv_cache: None, input_transforms: BTreeMap::new(), output_transforms: BTreeMap::new() }
    }
}

impl ModelWeights {
    /// Loads a GGUF file or a Hugging Face directory.
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        if path.is_dir() {
            Self::open_hf_dir(path)
        } else if path.is_file() {
            load_gguf(path).map(Self::from)
        } else {
            Err(LoadError::Io { path: path.into(), msg: "no such file or directory".into() })
        }
    }

    /// Loads a Hugging Face directory, decoding its `quantization_config` (weights and KV
    /// cache) before the rest of its tensors are resolved.
    fn open_hf_dir(dir: &Path) -> Result<Self, LoadError> {
        let hf = HfDir::open(dir)?;
        let qc = hf.quantization_config();
        let scheme = qc.map(schemes::from_config).transpose()?;
        let set = hf.tensors()?;
        let kv_cache = match qc.map(checkpoint_scheme::parse_scheme).transpose()?.flatten() {
            Some(format) => Some(checkpoint_scheme::load_scales(format, &set, hf.config.num_layers)?),
            None => None,
        };
        let linears = linear_modules(&set);
        let quantized = match &scheme {
            Some(scheme) => decode_linears(&set, &linears, scheme.as_ref())?,
            None => BTreeMap::new(),
        };
        let transforms = match qc.filter(|q| q.get("quant_method").and_then(|m| m.as_str()) == Some("compressed-tensors")) {
            Some(q) => transform::parse(q.get("transform_config"))?,
            None => None,
        };
        // A side's width: the quantized matrix's, else the stored weight's.
        let width = |module: &str, canon: &str, side: Side| {
            let shape = |q: &QuantizedWeight| [q.matrix.rows(), q.matrix.cols()];
            let dims = quantized.get(canon).map(shape).or_else(|| set.peek(&format!("{module}.weight")).and_then(|w| w.shape[..].try_into().ok()));
            dims.map(|[rows, cols]: [usize; 2]| if side == Side::Input { cols } else { rows })
        };
        let (input_transforms, output_transforms) = match &transforms {
            Some(t) => (
                transform::decode(t, Side::Input, &linears, &set, |m, c| width(m, c, Side::Input))?,
                transform::decode(t, Side::Output, &linears, &set, |m, c| width(m, c, Side::Output))?,
            ),
            None => Default::default(),
        };
        let layers = scheme.as_ref().map(|s| QuantizedLayers {
            method: s.method(),
            modules: quantized.iter().map(|(canon, q)| (canon.as_str(), q.module.as_str())).collect(),
        });
        let checkpoint = hf.finish(&set, layers.as_ref())?;
        let quantization = scheme.map(|s| match &transforms {
            Some(t) => format!("{}; {}", s.summary(), t.summary()),
            None => s.summary(),
        });
        Ok(ModelWeights { checkpoint, quantized, quantization, kv_cache, input_transforms, output_transforms })
    }
}

/// The linear modules among `set`'s tensor names: `(module, canonical weight name)`.
fn linear_modules(set: &TensorSet) -> Vec<(&str, String)> {
    let modules: BTreeSet<&str> = set.names().filter_map(|n| n.rsplit_once('.').map(|(m, _)| m)).collect();
    modules
        .into_iter()
        .filter_map(|module| match canonical_name(&format!("{module}.weight")) {
            Ok(Some(canon)) if is_linear(&canon) => Some((module, canon)),
            _ => None,
        })
        .collect()
}

/// The linear layers (by canonical weight name) that `scheme` decodes, taking their tensors
/// from `set`.
fn decode_linears(set: &TensorSet, linears: &[(&str, String)], scheme: &dyn QuantScheme) -> Result<BTreeMap<String, QuantizedWeight>, LoadError> {
    let mut quantized = BTreeMap::new();
    for (module, canon) in linears {
        if let Some(q) = scheme.load_linear(module, set)? {
            quantized.insert(canon.clone(), q);
        }
    }
    Ok(quantized)
}
