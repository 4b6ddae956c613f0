//! `quant_method: "compressed-tensors"` (llm-compressor): config groups with `targets`,
//! `weights` / `input_activations` args and a per-group `format`, plus an `ignore` list.
//!
//! Linear schemes with a CPU kernel:
//! - `pack-quantized` int4 weights (group or channel, symmetric or with zero points,
//!   optional act-order `weight_g_idx`), no activation quantization: W4A16;
//!   with int8 per-token dynamic activations: W4A8.
//! - `int-quantized` int8 symmetric channel/tensor weights with int8 activations: W8A8 int8.
//! - `float-quantized` E4M3 tensor/channel/block weights with FP8 activations: W8A8 FP8.
//!
//! Static activation scales (`input_scale`) are read and checked but activations are
//! quantized dynamically per token (more accurate; noted in the plan).

use super::int4_packing::{int4_matrix, unpack_first_axis, unpack_last_axis, NibbleOrder};
use super::pattern::{parse_list, NamePattern};
use super::{config_err, dims2, fp8_matrix, get_usize, tensor_err, QuantScheme, QuantizedWeight};
use crate::checkpoint::{LoadError, RawTensor, TensorSet};
use safetensors::Dtype;
use serde_json::Value;
use super::{shared, SharedMatrix};
use tessera_kernels::linear::{ActQuant, Int8Matrix};

/// Value type of quantization args.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ArgType {
    Int,
    Float,
}

/// Scale granularity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    Tensor,
    Channel,
    Group(usize),
    Block([usize; 2]),
    Token,
}

/// One `QuantizationArgs` object.
#[derive(Clone, Debug)]
struct Args {
    bits: usize,
    ty: ArgType,
    symmetric: bool,
    strategy: Strategy,
    dynamic: bool,
    actorder_group: bool,
}

impl Args {
    fn parse(v: &Value, path: &str) -> Result<Self, LoadError> {
        let bits = get_usize(v, "num_bits", path)?.unwrap_or(8);
        let ty = match v.get("type").and_then(Value::as_str).unwrap_or("int") {
            "int" => ArgType::Int,
            "float" => ArgType::Float,
            t => return Err(config_err(&format!("{path}.type"), format!("{t:?} (expected int or float)"))),
        };
        let group = match v.get("group_size") {
            None | Some(Value::Null) => None,
            Some(g) => Some(g.as_i64().ok_or_else(|| config_err(&format!("{path}.group_size"), format!("{g} is not an integer")))?),
        };
        let strategy = match v.get("strategy").and_then(Value::as_str) {
            Some("tensor") => Strategy::Tensor,
            Some("channel") => Strategy::Channel,
            Some("token") => Strategy::Token,
            Some("group") => match group {
                Some(g) if g > 0 => Strategy::Group(g as usize),
                _ => return Err(config_err(&format!("{path}.group_size"), "group strategy needs a positive group_size")),
            },
            Some("block") => {
                let b = v.get("block_structure").and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_u64).collect::<Vec<_>>());
                match b.as_deref() {
                    Some([h, w]) if *h > 0 && *w > 0 => Strategy::Block([*h as usize, *w as usize]),
                    _ => return Err(config_err(&format!("{path}.block_structure"), "block strategy needs [rows, cols]")),
                }
            }
            Some(s) => return Err(config_err(&format!("{path}.strategy"), format!("{s:?} has no CPU kernel (supported: tensor, channel, group, block, token)"))),
            None => match group {
                None => Strategy::Tensor,
                Some(-1) => Strategy::Channel,
                Some(g) if g > 0 => Strategy::Group(g as usize),
                Some(g) => return Err(config_err(&format!("{path}.group_size"), format!("{g}"))),
            },
        };
        let dynamic = match v.get("dynamic") {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Bool(true)) => true,
            Some(Value::String(s)) if s == "local" => true,
            Some(d) => return Err(config_err(&format!("{path}.dynamic"), format!("{d}"))),
        };
        let actorder_group = matches!(v.get("actorder").and_then(Value::as_str), Some("group" | "dynamic"));
        Ok(Args { bits, ty, symmetric: v.get("symmetric").and_then(Value::as_bool).unwrap_or(true), strategy, dynamic, actorder_group })
    }
}

/// One config group.
#[derive(Clone, Debug)]
struct Group {
    name: String,
    /// Name patterns among the targets.
    names: Vec<NamePattern>,
    /// Whether `Linear` (the class) is a target.
    any_linear: bool,
    weights: Option<Args>,
    input: Option<Args>,
    format: String,
}

/// A parsed compressed-tensors configuration.
#[derive(Debug)]
pub struct CompressedTensors {
    groups: Vec<Group>,
    ignore: Vec<NamePattern>,
    version: String,
}

/// Parses `quantization_config` for `quant_method: "compressed-tensors"`.
pub fn parse(qc: &Value) -> Result<Box<dyn QuantScheme>, LoadError> {
    // `transform_config` is read beside the scheme (`super::transform`).
    if qc.get("sparsity_config").is_some_and(|v| !v.is_null() && v.as_object().is_none_or(|o| !o.is_empty())) {
        return Err(config_err("sparsity_config", "sparse checkpoints are not supported"));
    }
    let global_format = qc.get("format").and_then(Value::as_str).map(str::to_owned);
    let groups_v = qc.get("config_groups").and_then(Value::as_object).ok_or_else(|| config_err("config_groups", "missing or not an object"))?;
    let mut groups = Vec::new();
    for (name, g) in groups_v {
        let path = format!("config_groups.{name}");
        let mut names = Vec::new();
        let mut any_linear = false;
        for t in g.get("targets").and_then(Value::as_array).ok_or_else(|| config_err(&format!("{path}.targets"), "missing or not a list"))? {
            let t = t.as_str().ok_or_else(|| config_err(&format!("{path}.targets"), format!("{t} is not a string")))?;
            if t == "Linear" {
                any_linear = true;
            } else {
                names.push(NamePattern::parse(t, &format!("{path}.targets"))?);
            }
        }
        let args = |k: &str| g.get(k).filter(|v| !v.is_null()).map(|v| Args::parse(v, &format!("{path}.{k}"))).transpose();
        let weights = args("weights")?;
        let input = args("input_activations")?;
        if args("output_activations")?.is_some() {
            return Err(config_err(&format!("{path}.output_activations"), "output activation quantization is not supported"));
        }
        let format = g
            .get("format")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .filter(|f| f != "mixed-precision")
            .or_else(|| global_format.clone().filter(|f| f != "mixed-precision"))
            .or_else(|| weights.as_ref().map(|w| infer_format(w, input.as_ref()).to_string()))
            .unwrap_or_else(|| "dense".into());
        groups.push(Group { name: name.clone(), names, any_linear, weights, input, format });
    }
    let ignore = parse_list(qc.get("ignore"), "quantization_config.ignore")?;
    let version = qc.get("version").and_then(Value::as_str).unwrap_or("?").to_string();
    Ok(Box::new(CompressedTensors { groups, ignore, version }))
}

/// The format older versions left implicit.
fn infer_format(w: &Args, input: Option<&Args>) -> &'static str {
    match (w.ty, w.bits, input) {
        (ArgType::Int, 4, None) => "pack-quantized",
        (ArgType::Float, ..) => "float-quantized",
        _ => "int-quantized",
    }
}

impl CompressedTensors {
    /// The group for a module: name targets first, then the `Linear` class (vLLM's order).
    fn group_for(&self, module: &str) -> Option<&Group> {
        self.groups
            .iter()
            .find(|g| g.names.iter().any(|p| p.matches(module)))
            .or_else(|| self.groups.iter().find(|g| g.any_linear))
    }
}

impl QuantScheme for CompressedTensors {
    fn method(&self) -> &'static str {
        "compressed-tensors"
    }

    fn summary(&self) -> String {
        let gs: Vec<String> = self.groups.iter().map(|g| format!("{}: {}", g.name, g.format)).collect();
        format!("compressed-tensors {} ({}; {} ignored)", self.version, gs.join(", "), self.ignore.len())
    }

    fn load_linear(&self, module: &str, t: &TensorSet) -> Result<Option<QuantizedWeight>, LoadError> {
        if self.ignore.iter().any(|p| p.matches(module)) {
            return Ok(None);
        }
        let Some(g) = self.group_for(module) else { return Ok(None) };
        let Some(w) = &g.weights else { return Ok(None) };
        if module.ends_with("lm_head") && !t.contains(&format!("{module}.weight_scale")) {
            // vLLM never quantizes the output head through compressed-tensors' Linear target.
            return Ok(None);
        }
        let act_note = |a: &Args| (!a.dynamic).then(|| format!("checkpoint activations are static ({:?}); quantized dynamically per token", a.strategy));
        let label = |s: &str| format!("compressed-tensors {s} ({}, {})", g.name, g.format);
        let (scheme, matrix, act, perm, note) = match (g.format.as_str(), w.ty, w.bits, &g.input) {
            ("pack-quantized", ArgType::Int, 4, None) => {
                let (m, perm) = load_packed(module, w, t)?;
                ("W4A16", m, ActQuant::F32, perm, None)
            }
            ("pack-quantized", ArgType::Int, 4, Some(a)) if a.ty == ArgType::Int && a.bits == 8 && a.symmetric => {
                let (m, perm) = load_packed(module, w, t)?;
                take_input_scale(module, a, t)?;
                ("W4A8", m, ActQuant::Int8PerToken, perm, act_note(a))
            }
            ("int-quantized" | "naive-quantized", ArgType::Int, 8, Some(a)) if a.ty == ArgType::Int && a.bits == 8 && a.symmetric => {
                let m = load_int8(module, w, t)?;
                take_input_scale(module, a, t)?;
                ("W8A8-int8", m, ActQuant::Int8PerToken, None, act_note(a))
            }
            ("float-quantized" | "naive-quantized", ArgType::Float, 8, Some(a)) if a.ty == ArgType::Float && a.bits == 8 => {
                let m = load_fp8(module, w, t)?;
                if let (Strategy::Block([_, bw]), Strategy::Group(ag)) = (w.strategy, a.strategy) {
                    if ag != bw {
                        return Err(config_err(&format!("config_groups.{}.input_activations.group_size", g.name), format!("{ag} differs from the weight block width {bw}")));
                    }
                }
                take_input_scale(module, a, t)?;
                ("W8A8-FP8", m, ActQuant::Fp8PerToken, None, act_note(a))
            }
            (f, ..) => {
                return Err(config_err(
                    &format!("config_groups.{}", g.name),
                    format!(
                        "format {f:?} with {}-bit {:?} weights and {} activations has no CPU kernel (layer {module})",
                        w.bits,
                        w.ty,
                        g.input.as_ref().map_or("unquantized".to_string(), |a| format!("{}-bit {:?}", a.bits, a.ty))
                    ),
                ))
            }
        };
        Ok(Some(QuantizedWeight { module: module.into(), scheme: label(scheme), matrix, act, perm, note }))
    }
}

/// Takes (and checks) a static `input_scale` when the activations are static.
fn take_input_scale(module: &str, a: &Args, t: &TensorSet) -> Result<(), LoadError> {
    if !a.dynamic {
        let s = t.take(&format!("{module}.input_scale"), "static input_activations")?;
        let v = s.scalar_f32()?;
        if !(v.is_finite() && v > 0.0) {
            return Err(tensor_err(&s.name, format!("input scale {v}")));
        }
    }
    if !a.symmetric {
        return Err(tensor_err(module, "asymmetric activation quantization is not supported"));
    }
    Ok(())
}

/// `weight_scale` of a per-row or per-tensor scheme as one value per row.
fn row_scales(module: &str, w: &Args, rows: usize, t: &TensorSet) -> Result<Vec<f32>, LoadError> {
    let s = t.take(&format!("{module}.weight_scale"), "quantized weights")?;
    match w.strategy {
        Strategy::Channel => s.expect_shape(&[&[rows, 1], &[rows]])?,
        Strategy::Tensor => s.expect_shape(&[&[1], &[]])?,
        other => return Err(tensor_err(&s.name, format!("strategy {other:?} for 8-bit weights (expected channel or tensor)"))),
    }
    s.per_row_f32(rows)
}

/// Fails unless an optional zero-point tensor is absent or all zero (symmetric schemes).
fn expect_zero(z: Option<&RawTensor>, packed_offset: bool) -> Result<(), LoadError> {
    let Some(z) = z else { return Ok(()) };
    let ok = match z.dtype {
        Dtype::I32 if packed_offset => z.to_i32()?.iter().all(|&w| w as u32 == 0x8888_8888),
        Dtype::I32 => z.to_i32()?.iter().all(|&w| w == 0),
        Dtype::I8 => z.to_i8()?.iter().all(|&w| w == 0),
        _ => z.to_f32()?.iter().all(|&w| w == 0.0),
    };
    if ok {
        Ok(())
    } else {
        Err(tensor_err(&z.name, "nonzero zero points in a symmetric scheme"))
    }
}

/// `pack-quantized` int4: `weight_packed`, `weight_shape`, `weight_scale`, optional
/// `weight_zero_point` (packed along the output dimension) and `weight_g_idx`.
fn load_packed(module: &str, w: &Args, t: &TensorSet) -> Result<(SharedMatrix, Option<Vec<u32>>), LoadError> {
    let shape = t.take(&format!("{module}.weight_shape"), "pack-quantized weights")?;
    let sv = shape.to_i64().or_else(|_| shape.to_i32().map(|v| v.into_iter().map(i64::from).collect()))?;
    let [rows, cols] = sv.as_slice() else { return Err(tensor_err(&shape.name, format!("{sv:?}, expected [out, in]"))) };
    let (rows, cols) = (usize::try_from(*rows).unwrap_or(0), usize::try_from(*cols).unwrap_or(0));
    let packed = t.take(&format!("{module}.weight_packed"), "pack-quantized weights")?;
    packed.expect_dtype(&[Dtype::I32])?;
    let wpr = cols.div_ceil(8);
    packed.expect_shape(&[&[rows, wpr]])?;
    let q: Vec<i8> = unpack_last_axis(&packed.to_i32()?, rows, wpr, cols, NibbleOrder::Plain).into_iter().map(|u| u as i8 - 8).collect();
    let group = match w.strategy {
        Strategy::Group(g) => g,
        Strategy::Channel => cols,
        s => return Err(tensor_err(&packed.name, format!("int4 strategy {s:?} (expected group or channel)"))),
    };
    let groups = cols.div_ceil(group);
    let scale = t.take(&format!("{module}.weight_scale"), "pack-quantized weights")?;
    scale.expect_shape(&[&[rows, groups]])?;
    let scales = scale.to_f32()?;
    let zname = format!("{module}.weight_zero_point");
    let zeros = if w.symmetric {
        expect_zero(t.take_opt(&zname), true)?;
        None
    } else {
        let z = t.take(&zname, "asymmetric weights")?;
        z.expect_dtype(&[Dtype::I32])?;
        z.expect_shape(&[&[rows.div_ceil(8), groups]])?;
        let u = unpack_first_axis(&z.to_i32()?, groups, rows, NibbleOrder::Plain);
        Some(u.into_iter().map(|u| u as i8 - 8).collect())
    };
    let g_idx = match t.take_opt(&format!("{module}.weight_g_idx")) {
        Some(g) if w.actorder_group => {
            g.expect_shape(&[&[cols]])?;
            Some(g.to_i32()?)
        }
        Some(g) => return Err(tensor_err(&g.name, "present but the weights args do not say actorder: group")),
        None if w.actorder_group => return Err(tensor_err(&format!("{module}.weight_g_idx"), "missing (required by actorder: group)")),
        None => None,
    };
    int4_matrix(&packed.name, rows, cols, group, q, scales, zeros, g_idx.as_deref())
}

/// `int-quantized` int8: `weight` I8 `[out, in]` and a channel or tensor `weight_scale`.
fn load_int8(module: &str, w: &Args, t: &TensorSet) -> Result<SharedMatrix, LoadError> {
    let wt = t.take(&format!("{module}.weight"), "int8 weights")?;
    wt.expect_dtype(&[Dtype::I8])?;
    let (rows, cols) = dims2(wt)?;
    if !w.symmetric {
        return Err(tensor_err(&wt.name, "asymmetric int8 weights are not supported"));
    }
    expect_zero(t.take_opt(&format!("{module}.weight_zero_point")), false)?;
    let scales = row_scales(module, w, rows, t)?;
    Int8Matrix::new(rows, cols, wt.to_i8()?, scales).map(shared).map_err(|e| tensor_err(&wt.name, e))
}

/// `float-quantized` E4M3: `weight` F8_E4M3 `[out, in]` and a tensor, channel or block scale.
fn load_fp8(module: &str, w: &Args, t: &TensorSet) -> Result<SharedMatrix, LoadError> {
    let wt = t.take(&format!("{module}.weight"), "FP8 weights")?;
    wt.expect_dtype(&[Dtype::F8_E4M3])?;
    let (rows, cols) = dims2(wt)?;
    let (block, scales) = match w.strategy {
        Strategy::Block([bh, bw]) => {
            let s = t.take(&format!("{module}.weight_scale"), "FP8 block weights")?;
            s.expect_shape(&[&[rows.div_ceil(bh), cols.div_ceil(bw)]])?;
            ([bh, bw], s.to_f32()?)
        }
        Strategy::Channel => ([1, cols], row_scales(module, w, rows, t)?),
        Strategy::Tensor => {
            let s = t.take(&format!("{module}.weight_scale"), "FP8 weights")?;
            ([rows, cols], vec![s.scalar_f32()?])
        }
        s => return Err(tensor_err(&wt.name, format!("FP8 weight strategy {s:?}"))),
    };
    fp8_matrix(&wt.name, rows, cols, block, wt.data.bytes().to_vec(), scales)
}
