//! Legacy int4 formats: GPTQ (`quant_method: "gptq"`) and AWQ (`quant_method: "awq"`),
//! both run as W4A16 with zero points.
//!
//! - GPTQ: `qweight` I32 `[in/8, out]` packed along the input, `qzeros` I32
//!   `[groups, out/8]`, `scales` `[groups, out]`, `g_idx` `[in]` (act-order groups; columns
//!   are sorted by group at load and the input is permuted at run time). Checkpoint format
//!   `gptq` (v1) stores `zero - 1`; `gptq_v2` the true zero.
//! - AWQ (`version: gemm`): `qweight` I32 `[in, out/8]` packed along the output in the
//!   interleaved nibble order, `qzeros` `[in/g, out/8]`, `scales` `[in/g, out]`.
//!
//! `W[o, i] = (q[i, o] - z[g, o]) · s[g, o]` with unsigned 4-bit `q` and `z`. Every linear
//! layer is quantized except the output head, AWQ's `modules_to_not_convert` and layers
//! outside GPTQ's `modules_in_block_to_quantize`; a quantized layer stored as a plain weight
//! is an error.

use super::int4_packing::{int4_matrix, transpose, unpack_first_axis, unpack_last_axis, NibbleOrder};
use super::pattern::{parse_list, NamePattern};
use super::{config_err, dims2, get_usize, tensor_err, QuantScheme, QuantizedWeight};
use crate::checkpoint::{LoadError, TensorSet};
use safetensors::Dtype;
use serde_json::Value;
use tessera_kernels::linear::ActQuant;

/// Which legacy layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flavor {
    /// GPTQ; `true` for v1 (`zero - 1` stored).
    Gptq { v1: bool },
    Awq,
}

/// A parsed GPTQ or AWQ configuration.
#[derive(Debug)]
pub struct LegacyInt4 {
    flavor: Flavor,
    group: Option<usize>,
    not_converted: Vec<NamePattern>,
    /// GPTQ's `modules_in_block_to_quantize` (module-name suffixes), when given.
    only: Option<Vec<String>>,
}

fn check_bits(qc: &Value, keys: &[&str]) -> Result<(), LoadError> {
    for k in keys {
        if let Some(b) = get_usize(qc, k, "")? {
            if b != 4 {
                return Err(config_err(k, format!("{b}-bit weights: only 4-bit GPTQ/AWQ is supported")));
            }
        }
    }
    Ok(())
}

fn group_size(qc: &Value, keys: &[&str]) -> Result<Option<usize>, LoadError> {
    for k in keys {
        if let Some(v) = qc.get(*k).and_then(Value::as_i64) {
            return match v {
                -1 => Ok(None),
                g if g > 0 => Ok(Some(g as usize)),
                g => Err(config_err(k, format!("{g}"))),
            };
        }
    }
    Ok(Some(128))
}

/// Parses `quantization_config` for `quant_method: "gptq"`.
pub fn parse_gptq(qc: &Value) -> Result<Box<dyn QuantScheme>, LoadError> {
    check_bits(qc, &["bits"])?;
    if qc.get("dynamic").and_then(Value::as_object).is_some_and(|d| !d.is_empty()) {
        return Err(config_err("dynamic", "per-module overrides are not supported"));
    }
    let v1 = match qc.get("checkpoint_format").and_then(Value::as_str).unwrap_or("gptq") {
        "gptq" => true,
        "gptq_v2" => false,
        f => return Err(config_err("checkpoint_format", format!("{f:?} (expected gptq or gptq_v2)"))),
    };
    let only = match qc.get("modules_in_block_to_quantize") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let names: Option<Vec<String>> = v.as_array().map(|groups| {
                groups.iter().flat_map(|g| g.as_array().into_iter().flatten().chain(std::iter::once(g))).filter_map(Value::as_str).map(str::to_owned).collect()
            });
            Some(names.ok_or_else(|| config_err("modules_in_block_to_quantize", format!("{v} is not a list of lists of names")))?)
        }
    };
    Ok(Box::new(LegacyInt4 { flavor: Flavor::Gptq { v1 }, group: group_size(qc, &["group_size"])?, not_converted: Vec::new(), only }))
}

/// Parses `quantization_config` for `quant_method: "awq"`.
pub fn parse_awq(qc: &Value) -> Result<Box<dyn QuantScheme>, LoadError> {
    check_bits(qc, &["bits", "w_bit"])?;
    if let Some(v) = qc.get("version").and_then(Value::as_str).filter(|v| !v.eq_ignore_ascii_case("gemm")) {
        return Err(config_err("version", format!("{v:?}: only the GEMM layout is supported")));
    }
    if qc.get("zero_point").and_then(Value::as_bool) == Some(false) {
        return Err(config_err("zero_point", "false: symmetric AWQ is not supported"));
    }
    let not_converted = parse_list(qc.get("modules_to_not_convert"), "quantization_config.modules_to_not_convert")?;
    Ok(Box::new(LegacyInt4 { flavor: Flavor::Awq, group: group_size(qc, &["group_size", "q_group_size"])?, not_converted, only: None }))
}

impl QuantScheme for LegacyInt4 {
    fn method(&self) -> &'static str {
        match self.flavor {
            Flavor::Gptq { .. } => "gptq",
            Flavor::Awq => "awq",
        }
    }

    fn summary(&self) -> String {
        let g = self.group.map_or("channel".into(), |g| format!("group {g}"));
        match self.flavor {
            Flavor::Gptq { v1 } => format!("gptq int4 {g} ({})", if v1 { "v1 zeros" } else { "v2 zeros" }),
            Flavor::Awq => format!("awq int4 {g} ({} not converted)", self.not_converted.len()),
        }
    }

    fn load_linear(&self, module: &str, t: &TensorSet) -> Result<Option<QuantizedWeight>, LoadError> {
        let qname = format!("{module}.qweight");
        let skipped = self.not_converted.iter().any(|p| p.matches(module))
            || module.ends_with("lm_head")
            || self.only.as_ref().is_some_and(|o| !o.iter().any(|n| module.ends_with(&format!(".{n}"))));
        if !t.contains(&qname) {
            if skipped {
                return Ok(None);
            }
            return Err(tensor_err(&qname, format!("missing: quant_method {} quantizes this layer, but it is stored unquantized", self.method())));
        }
        let qw = t.take(&qname, "GPTQ/AWQ weights")?;
        qw.expect_dtype(&[Dtype::I32])?;
        let (a, b) = dims2(qw)?;
        let (rows, cols, u) = match self.flavor {
            Flavor::Gptq { .. } => {
                let (cols, rows) = (a * 8, b);
                (rows, cols, transpose(&unpack_first_axis(&qw.to_i32()?, rows, cols, NibbleOrder::Plain), cols, rows))
            }
            Flavor::Awq => {
                let (cols, rows) = (a, b * 8);
                (rows, cols, transpose(&unpack_last_axis(&qw.to_i32()?, cols, b, rows, NibbleOrder::Interleaved), cols, rows))
            }
        };
        let group = self.group.unwrap_or(cols);
        let groups = cols.div_ceil(group);
        let scales = t.take(&format!("{module}.scales"), "GPTQ/AWQ weights")?;
        scales.expect_shape(&[&[groups, rows]])?;
        let zt = t.take(&format!("{module}.qzeros"), "GPTQ/AWQ weights")?;
        zt.expect_dtype(&[Dtype::I32])?;
        zt.expect_shape(&[&[groups, rows.div_ceil(8)]])?;
        let order = if self.flavor == Flavor::Awq { NibbleOrder::Interleaved } else { NibbleOrder::Plain };
        let bump = i8::from(self.flavor == (Flavor::Gptq { v1: true }));
        let z = unpack_last_axis(&zt.to_i32()?, groups, rows.div_ceil(8), rows, order);
        let zeros: Vec<i8> = transpose(&z, groups, rows).into_iter().map(|z| z as i8 + bump - 8).collect();
        if let Some(bad) = zeros.iter().find(|&&z| z > 7) {
            return Err(tensor_err(&zt.name, format!("zero point {} does not fit 4 bits (v1 stored 15 + 1)", bad + 8)));
        }
        let q: Vec<i8> = u.into_iter().map(|u| u as i8 - 8).collect();
        let g_idx = match (self.flavor, t.take_opt(&format!("{module}.g_idx"))) {
            (Flavor::Gptq { .. }, Some(g)) => {
                g.expect_shape(&[&[cols]])?;
                Some(g.to_i32()?)
            }
            (_, Some(g)) => return Err(tensor_err(&g.name, "unexpected in an AWQ checkpoint")),
            (_, None) => None,
        };
        if let Some(bias) = t.take_opt(&format!("{module}.bias")) {
            if bias.to_f32()?.iter().any(|&v| v != 0.0) {
                return Err(tensor_err(&bias.name, "linear biases are not supported"));
            }
        }
        let (matrix, perm) = int4_matrix(&qw.name, rows, cols, group, q, transpose(&scales.to_f32()?, groups, rows), Some(zeros), g_idx.as_deref())?;
        let scheme = format!("{} W4A16", self.method());
        Ok(Some(QuantizedWeight { module: module.into(), scheme, matrix, act: ActQuant::F32, perm, note: None }))
    }
}
