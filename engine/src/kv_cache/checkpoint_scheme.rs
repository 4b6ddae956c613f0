//! The checkpoint's quantized KV cache: `quantization_config.kv_cache_scheme` (as written by
//! compressed-tensors / llm-compressor) and the per-layer `k_scale` / `v_scale` tensors it
//! implies, read as vLLM reads them (value = stored code × scale).
//!
//! Supported: 8-bit, symmetric, static, per-tensor schemes: `type: float` (FP8 E4M3) and
//! `type: int` (int8). Anything else is a config error naming the key; a missing, non-scalar
//! or non-positive scale is a tensor error naming the tensor.

use super::KvCacheScheme;
use crate::checkpoint::{LoadError, RawTensor, TensorSet};
use serde_json::Value;
use tessera_kernels::kv::KvFormat;

/// A config error under `quantization_config.<key>`.
fn config_err(key: &str, msg: impl Into<String>) -> LoadError {
    LoadError::Config { key: format!("quantization_config.{key}"), msg: msg.into() }
}

/// The KV format `qc.kv_cache_scheme` asks for, `None` when absent or null.
pub fn parse_scheme(qc: &Value) -> Result<Option<KvFormat>, LoadError> {
    let Some(s) = qc.get("kv_cache_scheme").filter(|v| !v.is_null()) else { return Ok(None) };
    let key = |k: &str| format!("kv_cache_scheme.{k}");
    let field = |k: &str| s.get(k).filter(|v| !v.is_null());
    let bits = field("num_bits").and_then(Value::as_u64);
    if bits != Some(8) {
        return Err(config_err(&key("num_bits"), format!("{:?}: only 8-bit KV caches are supported", field("num_bits"))));
    }
    let format = match field("type").and_then(Value::as_str) {
        Some("float") => KvFormat::FP8_E4M3,
        Some("int") => KvFormat::INT8,
        other => return Err(config_err(&key("type"), format!("{other:?}: expected \"float\" or \"int\""))),
    };
    if let Some(st) = field("strategy").and_then(Value::as_str).filter(|&st| st != "tensor") {
        return Err(config_err(&key("strategy"), format!("{st:?}: only per-tensor k_scale / v_scale are supported")));
    }
    if field("dynamic").and_then(Value::as_bool) == Some(true) {
        return Err(config_err(&key("dynamic"), "dynamic KV scales are not in the checkpoint; use --kv-cache-dtype fp8_e4m3 or int8"));
    }
    if field("symmetric").and_then(Value::as_bool) == Some(false) {
        return Err(config_err(&key("symmetric"), "asymmetric (zero-point) KV caches are not supported"));
    }
    Ok(Some(format))
}

/// Takes every layer's scales from `set`: `model.layers.{i}.self_attn.{k,v}_scale`, or the
/// older `…self_attn.{k,v}_proj.output_scale`.
pub fn load_scales(format: KvFormat, set: &TensorSet, layers: usize) -> Result<KvCacheScheme, LoadError> {
    let scale = |i: usize, side: &str| -> Result<f32, LoadError> {
        let name = format!("model.layers.{i}.self_attn.{side}_scale");
        let old = format!("model.layers.{i}.self_attn.{side}_proj.output_scale");
        let why = "kv_cache_scheme needs a static scale per layer";
        let t: &RawTensor = if set.contains(&name) || !set.contains(&old) { set.take(&name, why)? } else { set.take(&old, why)? };
        t.expect_shape(&[&[], &[1]])?;
        let v = t.scalar_f32()?;
        if !(v.is_finite() && v > 0.0) {
            return Err(LoadError::Tensor { name: t.name.clone(), msg: format!("scale {v}: must be finite and positive") });
        }
        Ok(v)
    };
    let scales = (0..layers).map(|i| Ok((scale(i, "k")?, scale(i, "v")?))).collect::<Result<_, LoadError>>()?;
    Ok(KvCacheScheme { format, scales })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn schemes_map_to_formats_or_name_the_key() {
        let p = |s: Value| parse_scheme(&json!({ "kv_cache_scheme": s }));
        let fp8 = json!({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": false, "symmetric": true});
        assert_eq!(p(fp8).unwrap(), Some(KvFormat::FP8_E4M3));
        assert_eq!(p(json!({"num_bits": 8, "type": "int"})).unwrap(), Some(KvFormat::INT8));
        assert_eq!(p(Value::Null).unwrap(), None);
        assert_eq!(parse_scheme(&json!({})).unwrap(), None);
        for (bad, key) in [
            (json!({"num_bits": 4, "type": "int"}), "kv_cache_scheme.num_bits"),
            (json!({"num_bits": 8, "type": "mx"}), "kv_cache_scheme.type"),
            (json!({"num_bits": 8, "type": "float", "strategy": "channel"}), "kv_cache_scheme.strategy"),
            (json!({"num_bits": 8, "type": "float", "dynamic": true}), "kv_cache_scheme.dynamic"),
            (json!({"num_bits": 8, "type": "int", "symmetric": false}), "kv_cache_scheme.symmetric"),
        ] {
            let e = p(bad).unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
    }
}
