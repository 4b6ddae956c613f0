//! `quant_method: "quark"` (AMD Quark): a global layer config, per-name
//! (`layer_quant_config`, fnmatch keys, first match in file order) and per-class
//! (`layer_type_quant_config`) overrides, and an `exclude` list.
//!
//! Linear specs with a CPU kernel:
//! - W4A8, the seed's two-stage ProgressiveSpec: `weight` is a list
//!   `[fp8_e4m3 per_tensor, int4 per_channel ch_axis 0 symmetric]`; tensors `weight` (int4 in
//!   int32, `export.pack_method` nibble order), `weight_scale` (stage-0 FP8 scale, scalar) and
//!   `weight_scale_2` (stage-1 per-row scale); `W = q · weight_scale_2[row] · weight_scale`,
//!   both folded into one per-row scale. Activations run as int8 per token, as the seed's
//!   SGLang branch hard-codes (`QuantType.per_Token`), although Quark records FP8 per tensor.
//! - Single-stage int4 (per channel, or per group in Quark's transposed AWQ-style layout):
//!   W4A16 without activation spec, W4A8 with one. A single-stage spec is never mistaken for
//!   the two-stage one: the plan names what each layer runs.
//! - `fp8_e4m3` per_tensor / per_channel weights with FP8 activations: W8A8 FP8 (per-token
//!   activation scales).
//! - `int8` per_tensor / per_channel symmetric weights with int8 activations: W8A8 int8.

use super::int4_packing::{int4_matrix, transpose, twos_complement, unpack_last_axis, NibbleOrder};
use super::pattern::{fnmatch, parse_list, NamePattern};
use super::{config_err, dims2, tensor_err, QuantScheme, QuantizedWeight};
use crate::checkpoint::{LoadError, TensorSet};
use safetensors::Dtype;
use serde_json::Value;
use super::{shared, SharedMatrix};
use tessera_kernels::linear::{ActQuant, Int8Matrix};

/// One Quark tensor spec (`weight`, `input_tensors` entries).
#[derive(Clone, Debug, PartialEq)]
struct Spec {
    dtype: String,
    qscheme: String,
    ch_axis: Option<i64>,
    group_size: Option<usize>,
    symmetric: bool,
    dynamic: bool,
}

impl Spec {
    fn parse(v: &Value, path: &str) -> Result<Self, LoadError> {
        let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
        Ok(Spec {
            dtype: s("dtype").ok_or_else(|| config_err(&format!("{path}.dtype"), "missing"))?,
            qscheme: s("qscheme").unwrap_or_default(),
            ch_axis: v.get("ch_axis").and_then(Value::as_i64),
            group_size: v.get("group_size").and_then(Value::as_u64).map(|g| g as usize),
            symmetric: v.get("symmetric").and_then(Value::as_bool).unwrap_or(true),
            dynamic: v.get("is_dynamic").and_then(Value::as_bool).unwrap_or(false),
        })
    }

    fn describe(&self) -> String {
        format!("{} {}{}", self.dtype, self.qscheme, if self.dynamic { " dynamic" } else { "" })
    }
}

/// A layer config: weight stages and input spec.
#[derive(Clone, Debug)]
struct LayerConfig {
    path: String,
    weight: Vec<Spec>,
    input: Option<Spec>,
}

impl LayerConfig {
    fn parse(v: &Value, path: &str) -> Result<Self, LoadError> {
        for k in ["output_tensors", "bias"] {
            if v.get(k).is_some_and(|x| !x.is_null()) {
                let what = if k == "output_tensors" { "output (KV-cache) quantization" } else { "bias quantization" };
                return Err(config_err(&format!("{path}.{k}"), format!("{what} is not supported")));
            }
        }
        let weight = match v.get("weight") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a.iter().enumerate().map(|(i, s)| Spec::parse(s, &format!("{path}.weight[{i}]"))).collect::<Result<_, _>>()?,
            Some(w @ Value::Object(_)) => vec![Spec::parse(w, &format!("{path}.weight"))?],
            Some(w) => return Err(config_err(&format!("{path}.weight"), format!("{w} is neither a spec nor a list of specs"))),
        };
        let input = match v.get("input_tensors") {
            None | Some(Value::Null) => None,
            Some(i @ Value::Object(_)) => Some(Spec::parse(i, &format!("{path}.input_tensors"))?),
            Some(i) => return Err(config_err(&format!("{path}.input_tensors"), format!("{i}: multi-stage input specs (NVFP4) are not supported"))),
        };
        Ok(LayerConfig { path: path.into(), weight, input })
    }
}

/// A parsed Quark configuration.
#[derive(Debug)]
pub struct Quark {
    global: LayerConfig,
    by_name: Vec<(String, LayerConfig)>,
    linear: Option<LayerConfig>,
    exclude: Vec<NamePattern>,
    order: NibbleOrder,
}

/// Parses `quantization_config` for `quant_method: "quark"`.
pub fn parse(qc: &Value) -> Result<Box<dyn QuantScheme>, LoadError> {
    let export = qc.get("export").ok_or_else(|| config_err("export", "missing (Quark exports always carry it)"))?;
    if let Some(f) = export.get("weight_format").and_then(Value::as_str).filter(|f| *f != "real_quantized") {
        return Err(config_err("export.weight_format", format!("{f:?}: only real_quantized exports hold quantized tensors")));
    }
    if export.get("kv_cache_group").and_then(Value::as_array).is_some_and(|a| !a.is_empty()) {
        return Err(config_err("export.kv_cache_group", "KV-cache quantization from the checkpoint is not supported yet"));
    }
    let order = match export.get("pack_method").and_then(Value::as_str).unwrap_or("reorder") {
        "reorder" => NibbleOrder::Interleaved,
        "order" => NibbleOrder::Plain,
        p => return Err(config_err("export.pack_method", format!("{p:?} (expected reorder or order)"))),
    };
    let global = LayerConfig::parse(qc.get("global_quant_config").unwrap_or(&Value::Null), "global_quant_config")?;
    let mut by_name = Vec::new();
    if let Some(m) = qc.get("layer_quant_config").and_then(Value::as_object) {
        for (k, v) in m {
            by_name.push((k.clone(), LayerConfig::parse(v, &format!("layer_quant_config.{k}"))?));
        }
    }
    let linear = qc
        .get("layer_type_quant_config")
        .and_then(|m| m.get("Linear"))
        .map(|v| LayerConfig::parse(v, "layer_type_quant_config.Linear"))
        .transpose()?;
    let exclude = parse_list(qc.get("exclude"), "quantization_config.exclude")?;
    Ok(Box::new(Quark { global, by_name, linear, exclude, order }))
}

impl Quark {
    /// SGLang's `_find_matched_config`: fnmatch over `layer_quant_config` keys in file
    /// order, then the `Linear` type config, then the global one.
    fn config_for(&self, module: &str) -> &LayerConfig {
        self.by_name
            .iter()
            .find(|(k, _)| fnmatch(k.as_bytes(), module.as_bytes()) || k == module)
            .map(|(_, c)| c)
            .or(self.linear.as_ref())
            .unwrap_or(&self.global)
    }
}

impl QuantScheme for Quark {
    fn method(&self) -> &'static str {
        "quark"
    }

    fn summary(&self) -> String {
        let w: Vec<String> = self.global.weight.iter().map(Spec::describe).collect();
        format!(
            "quark (global weight [{}], input {}; {} per-layer configs; {} excluded)",
            w.join(" -> "),
            self.global.input.as_ref().map_or("none".into(), Spec::describe),
            self.by_name.len(),
            self.exclude.len()
        )
    }

    fn load_linear(&self, module: &str, t: &TensorSet) -> Result<Option<QuantizedWeight>, LoadError> {
        if self.exclude.iter().any(|p| p.matches(module)) {
            return Ok(None);
        }
        let c = self.config_for(module);
        if c.weight.is_empty() {
            return Ok(None);
        }
        let bad = |msg: String| config_err(&c.path, format!("{msg} (layer {module})"));
        let int8_act = |i: &Option<Spec>| -> Result<(ActQuant, Option<String>), LoadError> {
            match i {
                None => Ok((ActQuant::F32, None)),
                Some(s) if s.dtype == "int8" && s.dynamic => Ok((ActQuant::Int8PerToken, None)),
                Some(s) if matches!(s.dtype.as_str(), "fp8_e4m3" | "int8") => Ok((
                    ActQuant::Int8PerToken,
                    Some(format!("checkpoint activations {}; run as int8 per token (the seed's SGLang W4A8 path)", s.describe())),
                )),
                Some(s) => Err(bad(format!("int4 weights with {} activations have no CPU kernel", s.describe()))),
            }
        };
        let w = &c.weight;
        let (scheme, matrix, act, perm, note) = match w.as_slice() {
            [s0, s1] => {
                let two_stage = s0.dtype == "fp8_e4m3"
                    && s0.qscheme == "per_tensor"
                    && !s0.dynamic
                    && s1.dtype == "int4"
                    && s1.qscheme == "per_channel"
                    && s1.symmetric
                    && s1.ch_axis.unwrap_or(0) == 0
                    && !s1.dynamic;
                if !two_stage {
                    return Err(bad(format!(
                        "two-stage weight spec [{}, {}] is not the W4A8 recipe [fp8_e4m3 per_tensor, int4 per_channel symmetric ch_axis 0]",
                        s0.describe(),
                        s1.describe()
                    )));
                }
                let (act, note) = int8_act(&c.input)?;
                let m = self.load_w4a8_two_stage(module, t)?;
                (if act == ActQuant::F32 { "W4A16 (two-stage int4)" } else { "W4A8 (fp8 -> int4 two-stage)" }, m, act, None, note)
            }
            [s] if matches!(s.dtype.as_str(), "int4" | "uint4") => {
                let (act, note) = int8_act(&c.input)?;
                let (m, perm) = self.load_int4(module, s, t)?;
                let label = if act == ActQuant::F32 { "W4A16" } else { "W4A8 (single-stage int4)" };
                (label, m, act, perm, note)
            }
            [s] if s.dtype == "fp8_e4m3" => {
                match &c.input {
                    Some(i) if i.dtype == "fp8_e4m3" => {}
                    other => return Err(bad(format!("FP8 weights with {} activations have no CPU kernel", other.as_ref().map_or("unquantized".into(), Spec::describe)))),
                }
                let m = self.load_fp8(module, s, t)?;
                let input = c.input.as_ref().expect("matched above");
                let note = (input.qscheme != "per_token" || !input.dynamic)
                    .then(|| format!("checkpoint activations {}; scaled per token", input.describe()));
                if !input.dynamic {
                    t.take(&format!("{module}.input_scale"), "static input_tensors")?.scalar_f32()?;
                }
                ("W8A8-FP8", m, ActQuant::Fp8PerToken, None, note)
            }
            [s] if s.dtype == "int8" && s.symmetric && matches!(&c.input, Some(i) if i.dtype == "int8") => {
                let m = self.load_int8(module, s, t)?;
                let input = c.input.as_ref().expect("matched above");
                if !input.dynamic {
                    t.take(&format!("{module}.input_scale"), "static input_tensors")?.scalar_f32()?;
                    t.take_opt(&format!("{module}.input_zero_point"));
                }
                let note = (!input.dynamic).then(|| format!("checkpoint activations {}; quantized dynamically per token", input.describe()));
                ("W8A8-int8", m, ActQuant::Int8PerToken, None, note)
            }
            specs => {
                let d: Vec<String> = specs.iter().map(Spec::describe).collect();
                return Err(bad(format!(
                    "weight spec [{}] with input {} has no CPU kernel",
                    d.join(", "),
                    c.input.as_ref().map_or("none".into(), Spec::describe)
                )));
            }
        };
        Ok(Some(QuantizedWeight { module: module.into(), scheme: format!("quark {scheme}"), matrix, act, perm, note }))
    }
}

impl Quark {
    /// Unpacks `weight` I32 `[out, in/8]` of int4 values (two's complement) or uint4 values.
    fn int4_rows(&self, module: &str, t: &TensorSet, unsigned: bool) -> Result<(String, usize, usize, Vec<i8>), LoadError> {
        let wt = t.take(&format!("{module}.weight"), "int4 weights")?;
        wt.expect_dtype(&[Dtype::I32])?;
        let (rows, wpr) = dims2(wt)?;
        let cols = wpr * 8;
        let u = unpack_last_axis(&wt.to_i32()?, rows, wpr, cols, self.order);
        let q = u.into_iter().map(|u| if unsigned { u as i8 - 8 } else { twos_complement(u) }).collect();
        Ok((wt.name.clone(), rows, cols, q))
    }

    /// The two-stage W4A8 layer: per-row scale `weight_scale_2[r] · weight_scale`.
    fn load_w4a8_two_stage(&self, module: &str, t: &TensorSet) -> Result<SharedMatrix, LoadError> {
        let (name, rows, cols, q) = self.int4_rows(module, t, false)?;
        let s0 = t.take(&format!("{module}.weight_scale"), "the FP8 stage of the two-stage weight spec")?.scalar_f32()?;
        let s2 = t.take(&format!("{module}.weight_scale_2"), "the INT4 stage of the two-stage weight spec")?;
        s2.expect_shape(&[&[rows], &[rows, 1]])?;
        let scales: Vec<f32> = s2.to_f32()?.into_iter().map(|s| s * s0).collect();
        for z in ["weight_zero_point", "weight_zero_point_2"] {
            if let Some(zt) = t.take_opt(&format!("{module}.{z}")) {
                if zt.to_i32().map_or(true, |v| v.iter().any(|&w| w != 0)) {
                    return Err(tensor_err(&zt.name, "nonzero zero points in a symmetric spec"));
                }
            }
        }
        Ok(int4_matrix(&name, rows, cols, cols, q, scales, None, None)?.0)
    }

    /// A single-stage int4 / uint4 layer, per channel (`[out, in/8]`) or per group
    /// (Quark/AWQ layout: weight `[in, out/8]`, scale `[in/g, out]`, zero point `[in/g, out/8]`).
    fn load_int4(&self, module: &str, s: &Spec, t: &TensorSet) -> Result<(SharedMatrix, Option<Vec<u32>>), LoadError> {
        let unsigned = s.dtype == "uint4";
        let zname = format!("{module}.weight_zero_point");
        match s.qscheme.as_str() {
            "per_channel" => {
                let (name, rows, cols, q) = self.int4_rows(module, t, unsigned)?;
                let scales = t.take(&format!("{module}.weight_scale"), "int4 weights")?.per_row_f32(rows)?;
                let zeros = self.zero_points(&zname, t, s, 1, rows.div_ceil(8), rows)?;
                int4_matrix(&name, rows, cols, cols, q, scales, zeros, None)
            }
            "per_group" => {
                let g = s.group_size.ok_or_else(|| config_err("weight.group_size", format!("missing for per_group int4 (layer {module})")))?;
                let wt = t.take(&format!("{module}.weight"), "int4 weights")?;
                wt.expect_dtype(&[Dtype::I32])?;
                let (cols, wpr) = dims2(wt)?;
                let rows = wpr * 8;
                let u = transpose(&unpack_last_axis(&wt.to_i32()?, cols, wpr, rows, self.order), cols, rows);
                let q = u.into_iter().map(|u| if unsigned { u as i8 - 8 } else { twos_complement(u) }).collect();
                let groups = cols.div_ceil(g);
                let st = t.take(&format!("{module}.weight_scale"), "int4 weights")?;
                st.expect_shape(&[&[groups, rows], &[rows, groups]])?;
                let scales = if st.shape == [groups, rows] { transpose(&st.to_f32()?, groups, rows) } else { st.to_f32()? };
                let zeros = self.zero_points(&zname, t, s, groups, rows.div_ceil(8), rows)?.map(|z| transpose(&z, groups, rows));
                int4_matrix(&wt.name, rows, cols, g, q, scales, zeros, None)
            }
            q => Err(config_err("weight.qscheme", format!("{q:?} for int4 weights (layer {module})"))),
        }
    }

    /// Zero points packed along the output dimension (`zr × zw` words, `n` per word row):
    /// `None` for symmetric specs (present zero points must be zero), signed offsets for uint4.
    fn zero_points(&self, name: &str, t: &TensorSet, s: &Spec, zr: usize, zw: usize, n: usize) -> Result<Option<Vec<i8>>, LoadError> {
        if s.symmetric {
            if let Some(z) = t.take_opt(name) {
                if z.to_i32()?.iter().any(|&w| w != 0) {
                    return Err(tensor_err(name, "nonzero zero points in a symmetric spec"));
                }
            }
            return Ok(None);
        }
        let z = t.take(name, "asymmetric int4 weights")?;
        z.expect_dtype(&[Dtype::I32])?;
        if z.numel() != zr * zw {
            return Err(tensor_err(name, format!("shape {:?}, expected {zr}x{zw} packed words", z.shape)));
        }
        let u = unpack_last_axis(&z.to_i32()?, zr, zw, n, self.order);
        Ok(Some(u.into_iter().map(|u| u as i8 - 8).collect()))
    }

    fn load_fp8(&self, module: &str, s: &Spec, t: &TensorSet) -> Result<SharedMatrix, LoadError> {
        let wt = t.take(&format!("{module}.weight"), "FP8 weights")?;
        wt.expect_dtype(&[Dtype::F8_E4M3])?;
        let (rows, cols) = dims2(wt)?;
        let st = t.take(&format!("{module}.weight_scale"), "FP8 weights")?;
        let (block, scales) = match s.qscheme.as_str() {
            "per_tensor" => ([rows, cols], vec![st.scalar_f32()?]),
            "per_channel" => ([1, cols], st.per_row_f32(rows)?),
            q => return Err(config_err("weight.qscheme", format!("{q:?} for FP8 weights (layer {module})"))),
        };
        super::fp8_matrix(&wt.name, rows, cols, block, wt.data.bytes().to_vec(), scales)
    }

    fn load_int8(&self, module: &str, s: &Spec, t: &TensorSet) -> Result<SharedMatrix, LoadError> {
        let wt = t.take(&format!("{module}.weight"), "int8 weights")?;
        wt.expect_dtype(&[Dtype::I8])?;
        let (rows, cols) = dims2(wt)?;
        let st = t.take(&format!("{module}.weight_scale"), "int8 weights")?;
        let scales = match s.qscheme.as_str() {
            "per_tensor" => vec![st.scalar_f32()?; rows],
            "per_channel" => st.per_row_f32(rows)?,
            q => return Err(config_err("weight.qscheme", format!("{q:?} for int8 weights (layer {module})"))),
        };
        if let Some(z) = t.take_opt(&format!("{module}.weight_zero_point")) {
            if z.data.bytes().iter().any(|&b| b != 0) {
                return Err(tensor_err(&z.name, "nonzero zero points in a symmetric spec"));
            }
        }
        Int8Matrix::new(rows, cols, wt.to_i8()?, scales).map(shared).map_err(|e| tensor_err(&wt.name, e))
    }
}
