//! `quant_method: "fp8"` (vLLM / DeepSeek-V3 style): E4M3 `weight` with a per-tensor
//! `weight_scale`, or with `weight_block_size` (`[128, 128]`) block multipliers
//! `weight_scale_inv` (despite the name, `W = e4m3 · weight_scale_inv[r / bh, c / bw]`).
//! Activations are E4M3 per token (per token and 128-column group with block weights).
//! Layers whose weight is stored in a float dtype are left unquantized only when listed in
//! `ignored_layers` / `modules_to_not_convert` (or for the output head).

use super::pattern::{parse_list, NamePattern};
use super::{config_err, dims2, fp8_matrix, tensor_err, QuantScheme, QuantizedWeight};
use crate::checkpoint::{LoadError, TensorSet};
use safetensors::Dtype;
use serde_json::Value;
use tessera_kernels::linear::ActQuant;

/// A parsed plain-FP8 configuration.
#[derive(Debug)]
pub struct Fp8 {
    block: Option<[usize; 2]>,
    static_act: bool,
    ignored: Vec<NamePattern>,
}

/// Parses `quantization_config` for `quant_method: "fp8"`.
pub fn parse(qc: &Value) -> Result<Box<dyn QuantScheme>, LoadError> {
    let block = match qc.get("weight_block_size") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_array().map(|a| a.iter().filter_map(Value::as_u64).collect::<Vec<_>>()).as_deref() {
            Some([h, w]) if *h > 0 && *w > 0 => Some([*h as usize, *w as usize]),
            _ => return Err(config_err("weight_block_size", format!("{v} is not [rows, cols]"))),
        },
    };
    let static_act = match qc.get("activation_scheme").and_then(Value::as_str).unwrap_or("dynamic") {
        "dynamic" => false,
        "static" if block.is_none() => true,
        "static" => return Err(config_err("activation_scheme", "static activations with block weights")),
        a => return Err(config_err("activation_scheme", format!("{a:?} (expected dynamic or static)"))),
    };
    if let Some(f) = qc.get("fmt").and_then(Value::as_str).filter(|f| *f != "e4m3") {
        return Err(config_err("fmt", format!("{f:?}: only e4m3 FP8 weights are supported")));
    }
    let mut ignored = parse_list(qc.get("ignored_layers"), "quantization_config.ignored_layers")?;
    ignored.extend(parse_list(qc.get("modules_to_not_convert"), "quantization_config.modules_to_not_convert")?);
    Ok(Box::new(Fp8 { block, static_act, ignored }))
}

impl QuantScheme for Fp8 {
    fn method(&self) -> &'static str {
        "fp8"
    }

    fn summary(&self) -> String {
        let w = self.block.map_or("per-tensor".to_string(), |[h, w]| format!("block {h}x{w}"));
        format!("fp8 e4m3 ({w} weights, {} activations; {} ignored)", if self.static_act { "static" } else { "dynamic" }, self.ignored.len())
    }

    fn load_linear(&self, module: &str, t: &TensorSet) -> Result<Option<QuantizedWeight>, LoadError> {
        let wname = format!("{module}.weight");
        let ignored = self.ignored.iter().any(|p| p.matches(module));
        let Some(wt) = t.take_opt(&wname) else { return Ok(None) };
        if wt.dtype != Dtype::F8_E4M3 {
            if ignored || module.ends_with("lm_head") {
                return Ok(None);
            }
            return Err(tensor_err(&wname, format!("dtype {:?}, but quant_method fp8 quantizes this layer (it is not in ignored_layers)", wt.dtype)));
        }
        if ignored {
            return Err(tensor_err(&wname, "stored as FP8 but listed in ignored_layers"));
        }
        let (rows, cols) = dims2(wt)?;
        let (block, scales) = match self.block {
            Some([bh, bw]) => {
                let s = t.take(&format!("{module}.weight_scale_inv"), "weight_block_size")?;
                s.expect_shape(&[&[rows.div_ceil(bh), cols.div_ceil(bw)]])?;
                ([bh, bw], s.to_f32()?)
            }
            None => ([rows, cols], vec![t.take(&format!("{module}.weight_scale"), "per-tensor FP8 weights")?.scalar_f32()?]),
        };
        let note = if self.static_act {
            t.take(&format!("{module}.input_scale"), "activation_scheme: static")?.scalar_f32()?;
            Some("checkpoint activations static per tensor; scaled per token".to_string())
        } else {
            None
        };
        let matrix = fp8_matrix(&wname, rows, cols, block, wt.data.bytes().to_vec(), scales)?;
        Ok(Some(QuantizedWeight { module: module.into(), scheme: "fp8 W8A8-FP8".into(), matrix, act: ActQuant::Fp8PerToken, perm: None, note }))
    }
}

