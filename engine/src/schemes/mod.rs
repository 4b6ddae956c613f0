//! Checkpoint quantization schemes: read a Hugging Face checkpoint's `quantization_config`,
//! decide for every linear layer how it is stored and how its activations are handled, and
//! turn the checkpoint's tensors into kernel matrices (`tessera_kernels::linear::WeightMatrix`).
//!
//! One module per `quant_method` implements [`QuantScheme`]; [`SCHEMES`] maps method names to
//! them. The model never sees which scheme a layer came from: it gets a [`QuantizedWeight`]
//! and picks the kernel for it (see `model::linear`), and the resulting plan prints per layer.
//!
//! Every mismatch between metadata and tensors (a missing scale, a wrong shape or dtype, a
//! spec with no kernel) is a load error naming the tensor or config key. Nothing falls back
//! silently: where Tessera deliberately runs a layer differently from what the metadata
//! records (e.g. W4A8 activations as int8 per token, as the seed's SGLang branch does,
//! although Quark records FP8 per tensor), the layer's plan entry carries a note saying so.

pub mod compressed_tensors;
pub mod fp8;
pub mod gptq;
mod int4_packing;
pub mod pattern;
pub mod quark;
pub mod transform;

use crate::checkpoint::{LoadError, RawTensor, TensorSet};
use serde_json::Value;
use std::fmt::Debug;
use std::sync::Arc;
use tessera_kernels::linear::{ActQuant, Fp8Matrix, WeightMatrix};

/// A linear layer's weights in their kernel format, ready for a kernel: as a scheme decoded
/// them, or a GGUF/float tensor as GGML rows (`model::linear::checkpoint_weight`).
#[derive(Clone, Debug)]
pub struct QuantizedWeight {
    /// The name in the checkpoint (the Hugging Face module, `model.layers.0.self_attn.q_proj`,
    /// or the tensor): errors name it.
    pub module: String,
    /// Scheme label, e.g. `compressed-tensors W4A16`.
    pub scheme: String,
    /// Values and scales in a kernel storage type (shared with the kernel built from it, so
    /// the checkpoint and the model hold one copy).
    pub matrix: SharedMatrix,
    /// Run-time activation handling.
    pub act: ActQuant,
    /// Input-column permutation (act-order checkpoints): column `c` of `matrix` multiplies
    /// input `perm[c]`.
    pub perm: Option<Vec<u32>>,
    /// Where Tessera runs the layer differently from what the metadata records, why.
    pub note: Option<String>,
}

/// One checkpoint quantization method (`quantization_config.quant_method`).
pub trait QuantScheme: Send + Sync + Debug {
    /// The `quant_method` value.
    fn method(&self) -> &'static str;

    /// One line describing the configuration (for logs and `/v1/models`).
    fn summary(&self) -> String;

    /// The quantized weights of linear module `module`, taking its tensors from `tensors`;
    /// `Ok(None)` when the config leaves this module unquantized (then its plain `.weight`
    /// is used).
    fn load_linear(&self, module: &str, tensors: &TensorSet) -> Result<Option<QuantizedWeight>, LoadError>;
}

/// Constructor of a scheme from its `quantization_config` object.
pub type SchemeParser = fn(&Value) -> Result<Box<dyn QuantScheme>, LoadError>;

/// Every supported `quant_method` and its parser.
pub const SCHEMES: &[(&str, SchemeParser)] = &[
    ("compressed-tensors", compressed_tensors::parse),
    ("quark", quark::parse),
    ("fp8", fp8::parse),
    ("gptq", gptq::parse_gptq),
    ("awq", gptq::parse_awq),
];

/// The scheme a `quantization_config` names.
pub fn from_config(qc: &Value) -> Result<Box<dyn QuantScheme>, LoadError> {
    let method = qc.get("quant_method").and_then(Value::as_str).unwrap_or("");
    let known: Vec<&str> = SCHEMES.iter().map(|(m, _)| *m).collect();
    let (_, parse) = SCHEMES.iter().find(|(m, _)| *m == method).ok_or_else(|| LoadError::Config {
        key: "quantization_config.quant_method".into(),
        msg: format!("{method:?} is not supported (supported: {})", known.join(", ")),
    })?;
    parse(qc)
}

/// A config error under `quantization_config.<key>`.
pub(crate) fn config_err(key: &str, msg: impl Into<String>) -> LoadError {
    LoadError::Config { key: format!("quantization_config.{key}"), msg: msg.into() }
}

/// A tensor error.
pub(crate) fn tensor_err(name: &str, msg: impl Into<String>) -> LoadError {
    LoadError::Tensor { name: name.into(), msg: msg.into() }
}

/// `(rows, cols)` of a module's `[rows, cols]` tensor `t`.
pub(crate) fn dims2(t: &RawTensor) -> Result<(usize, usize), LoadError> {
    match t.shape.as_slice() {
        [r, c] => Ok((*r, *c)),
        s => Err(tensor_err(&t.name, format!("shape {s:?}, expected 2 dimensions"))),
    }
}

/// An unsigned int from a JSON object (`key` for errors).
pub(crate) fn get_usize(v: &Value, key: &str, path: &str) -> Result<Option<usize>, LoadError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_u64().map(|n| Some(n as usize)).ok_or_else(|| config_err(&format!("{path}.{key}"), format!("{x} is not an unsigned integer"))),
    }
}

/// An [`Fp8Matrix`] or an error naming the tensor.
/// A decoded weight matrix in its kernel format.
pub type SharedMatrix = Arc<dyn WeightMatrix>;

/// `m` behind the shared trait object the model's layers take.
pub(crate) fn shared(m: impl WeightMatrix + 'static) -> SharedMatrix {
    Arc::new(m)
}

pub(crate) fn fp8_matrix(name: &str, rows: usize, cols: usize, block: [usize; 2], q: Vec<u8>, scales: Vec<f32>) -> Result<SharedMatrix, LoadError> {
    Fp8Matrix::new(rows, cols, block, q, scales).map(shared).map_err(|e| tensor_err(name, e))
}
