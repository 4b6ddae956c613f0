//! compressed-tensors `transform_config`: the rotations a checkpoint was made with
//! (llm-compressor's SpinQuant and QuIP modifiers). Each config group is one transform type
//! applied at several places:
//! - `weight_input` / `weight_output`: folded into the stored weights offline; nothing to do
//!   at load (their saved copies are taken and left unused);
//! - `input`: runs online, on the linear layer's input activations (`x ↦ x · T`, or `x · Tᵀ`
//!   with `inverse`), SpinQuant's R4 before `down_proj`. Its matrix is the tensor
//!   `{module}.{group}_input.weight`, `[b, b]` (`b` the group's `head_dim` for a block-diagonal
//!   transform, else the layer's input width), stored normalized or as ±1 entries. Where a
//!   layer stores none, another layer's copy of the same group and order is used
//!   (transformers saves tied copies once), else a `hadamard` group's matrix is generated
//!   (deterministic; Tessera's quantizer stores none). A Sylvester
//!   Hadamard matrix runs as the fast transform, anything else orthogonal as a dense block;
//! - `output`: runs online on the layer's outputs (`y ↦ y · U`, or `y · Uᵀ` with `inverse`),
//!   QuIP's `u` side; its matrix is `{module}.{group}_output.weight`, found, shared and
//!   generated as an input transform's (of the layer's output width);
//! - `attn_q`, `attn_k` (online in attention): refused by name.
//!
//! Every matrix is checked orthogonal at load (against random probes), so a transform that
//! would not undo its folded inverse fails with the tensor's name instead of serving garbage.

use super::config_err;
use super::pattern::{parse_list, NamePattern};
use crate::checkpoint::{LoadError, RawTensor, TensorSet};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;
use tessera_kernels::ops::transform::sylvester;
use tessera_kernels::ops::BlockTransform;

/// Where one group's transform applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Location {
    Input,
    WeightInput,
    WeightOutput,
    Output,
}

impl Location {
    fn as_str(self) -> &'static str {
        match self {
            Location::Input => "input",
            Location::WeightInput => "weight_input",
            Location::WeightOutput => "weight_output",
            Location::Output => "output",
        }
    }
}

/// The side of a linear layer an online transform runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Its input activations, before the product.
    Input,
    /// Its outputs, after the product.
    Output,
}

impl Side {
    fn location(self) -> Location {
        match self {
            Side::Input => Location::Input,
            Side::Output => Location::Output,
        }
    }
}

/// One `apply` entry.
#[derive(Debug)]
struct Apply {
    targets: Vec<NamePattern>,
    any_linear: bool,
    ignore: Vec<NamePattern>,
    location: Location,
    inverse: bool,
}

impl Apply {
    fn matches(&self, module: &str) -> bool {
        (self.any_linear || self.targets.iter().any(|p| p.matches(module))) && !self.ignore.iter().any(|p| p.matches(module))
    }
}

/// One config group (a transform type and where it applies).
#[derive(Debug)]
struct Group {
    name: String,
    ty: String,
    head_dim: Option<usize>,
    apply: Vec<Apply>,
}

/// A parsed `transform_config`.
#[derive(Debug)]
pub struct Transforms {
    groups: Vec<Group>,
}

/// The largest transform order accepted (a block of 65,536 would be a 16 GiB dense matrix).
const MAX_ORDER: usize = 1 << 16;

/// A layer's online transform on one side: its group, direction and stored matrix (if stored).
struct Online<'a> {
    group: &'a Group,
    inverse: bool,
    matrix: Option<Arc<BlockTransform>>,
}

/// The matrices layers stored, by group, side, direction and order: what a layer whose tied
/// copy was saved under another layer's name resolves to.
#[derive(Debug, Default)]
pub struct TiedCopies(Vec<(String, Side, bool, Arc<BlockTransform>)>);

/// Transform types compressed-tensors registers whose matrices are orthogonal.
const TYPES: &[&str] = &["hadamard", "random-hadamard", "random-matrix"];

/// Parses `quantization_config.transform_config` (`None` when absent, null or empty).
pub fn parse(tc: Option<&Value>) -> Result<Option<Transforms>, LoadError> {
    let Some(tc) = tc.filter(|v| !v.is_null() && v.as_object().is_none_or(|o| !o.is_empty())) else { return Ok(None) };
    let groups_v = tc.get("config_groups").and_then(Value::as_object).ok_or_else(|| config_err("transform_config.config_groups", "missing or not an object"))?;
    let mut groups = Vec::new();
    for (name, g) in groups_v {
        let path = format!("transform_config.config_groups.{name}");
        let ty = g.get("type").and_then(Value::as_str).unwrap_or("");
        if !TYPES.contains(&ty) {
            return Err(config_err(&format!("{path}.type"), format!("{ty:?} is not a supported transform (supported: {})", TYPES.join(", "))));
        }
        let head_dim = match g.get("head_dim") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().filter(|&d| d > 0 && d <= MAX_ORDER as u64).ok_or_else(|| config_err(&format!("{path}.head_dim"), format!("{v} is not an integer in 1..={MAX_ORDER}")))? as usize),
        };
        let mut apply = Vec::new();
        for (i, a) in g.get("apply").and_then(Value::as_array).ok_or_else(|| config_err(&format!("{path}.apply"), "missing or not a list"))?.iter().enumerate() {
            let at = format!("{path}.apply[{i}]");
            let location = match a.get("location").and_then(Value::as_str) {
                Some("input") => Location::Input,
                Some("weight_input") => Location::WeightInput,
                Some("weight_output") => Location::WeightOutput,
                Some("output") => Location::Output,
                Some(l @ ("attn_q" | "attn_k" | "q_attn" | "k_cache")) => {
                    return Err(config_err(&format!("{at}.location"), format!("online {l:?} transforms are not supported (online input and output transforms are)")))
                }
                other => return Err(config_err(&format!("{at}.location"), format!("{other:?} is not a transform location"))),
            };
            let one_or_list = |k: &str| match a.get(k) {
                Some(Value::String(s)) => Some(Value::Array(vec![Value::String(s.clone())])),
                v => v.cloned(),
            };
            let mut targets = parse_list(one_or_list("targets").as_ref(), &format!("{at}.targets"))?;
            let any_linear = targets.iter().any(|p| matches!(p, NamePattern::Exact(e) if e == "Linear"));
            targets.retain(|p| !matches!(p, NamePattern::Exact(e) if e == "Linear"));
            let ignore = parse_list(one_or_list("ignore").as_ref(), &format!("{at}.ignore"))?;
            let inverse = a.get("inverse").and_then(Value::as_bool).unwrap_or(false);
            apply.push(Apply { targets, any_linear, ignore, location, inverse });
        }
        groups.push(Group { name: name.clone(), ty: ty.to_string(), head_dim, apply });
    }
    Ok(Some(Transforms { groups }))
}

impl Transforms {
    /// The group names, for the checkpoint's summary line (`transforms R4`).
    pub fn summary(&self) -> String {
        let gs: Vec<&str> = self.groups.iter().map(|g| g.name.as_str()).collect();
        format!("transforms {}", gs.join(", "))
    }

    /// The group whose online transform on `side` applies to linear module `module` (and
    /// whether inverted), if any; the saved copies of its folded transforms are taken.
    fn online_group(&self, module: &str, side: Side, set: &TensorSet) -> Result<Option<(&Group, bool)>, LoadError> {
        let mut found: Option<(&Group, bool)> = None;
        for g in &self.groups {
            for a in g.apply.iter().filter(|a| a.matches(module)) {
                if matches!(a.location, Location::WeightInput | Location::WeightOutput) {
                    set.take_opt(&format!("{module}.{}_{}.weight", g.name, a.location.as_str()));
                }
                if a.location != side.location() {
                    continue;
                }
                if let Some((other, _)) = found {
                    let msg = format!("online {} transforms of groups {} and {} both apply to {module}", a.location.as_str(), other.name, g.name);
                    return Err(config_err(&format!("transform_config.config_groups.{}", g.name), msg));
                }
                found = Some((g, a.inverse));
            }
        }
        Ok(found)
    }

    /// The online transform on `side` of linear module `module` with its own stored matrix
    /// (`None` without a transform; `matrix: None` when its matrix is not stored).
    fn stored(&self, module: &str, side: Side, set: &TensorSet) -> Result<Option<Online<'_>>, LoadError> {
        let Some((group, inverse)) = self.online_group(module, side, set)? else { return Ok(None) };
        let at = side.location().as_str();
        let name = format!("{module}.{}_{at}.weight", group.name);
        let Some(t) = set.take_opt(&name) else { return Ok(Some(Online { group, inverse, matrix: None })) };
        let perm_name = format!("{module}.{}_{at}.perm", group.name);
        let perm = set.take_opt(&perm_name).map(|p| read_perm(p, t.shape[0])).transpose().map_err(|msg| LoadError::Tensor { name: perm_name, msg })?;
        let b = block_transform(t, perm, group.head_dim, inverse).map_err(|msg| LoadError::Tensor { name, msg })?;
        Ok(Some(Online { group, inverse, matrix: Some(Arc::new(b)) }))
    }

    /// The online transform on `side` of linear module `module`, `width` wide on that side if
    /// known (`None` when it has none), from its stored matrix; without one, from another
    /// layer's stored matrix of the same group, side, order and direction (transformers saves
    /// tied copies once, under one layer's name); else, for a `hadamard` group of a
    /// power-of-two order, generated (Tessera's quantizer stores none).
    pub fn online_for(&self, module: &str, side: Side, set: &TensorSet, width: Option<usize>, tied: &mut TiedCopies) -> Result<Option<Arc<BlockTransform>>, LoadError> {
        let Some(Online { group: g, inverse, matrix }) = self.stored(module, side, set)? else { return Ok(None) };
        let same = |n: &String, s: &Side, inv: &bool| *n == g.name && *s == side && *inv == inverse;
        if let Some(t) = matrix {
            if !tied.0.iter().any(|(n, s, inv, u)| same(n, s, inv) && u.block() == t.block()) {
                tied.0.push((g.name.clone(), side, inverse, t.clone()));
            }
            return Ok(Some(t));
        }
        let at = side.location().as_str();
        let order = g.head_dim.or(width).ok_or_else(|| LoadError::Tensor { name: format!("{module}.weight"), msg: format!("missing (its online {at} transform needs its width)") })?;
        if let Some((.., u)) = tied.0.iter().find(|(n, s, inv, u)| same(n, s, inv) && u.block() == order) {
            return Ok(Some(u.clone()));
        }
        match g.ty.as_str() {
            "hadamard" if order.is_power_of_two() => Ok(Some(Arc::new(BlockTransform::Hadamard { block: order }))),
            _ => Err(LoadError::Tensor {
                name: format!("{module}.{}_{at}.weight", g.name),
                msg: format!("missing, and no other layer stores its group's matrix of order {order} (only a hadamard transform of a power-of-two order can be generated)"),
            }),
        }
    }
}

/// A randomized transform's permutation (`randomize`: the library uses `W[perm][:, perm]`),
/// checked to be one of `0..n`.
fn read_perm(t: &RawTensor, n: usize) -> Result<Vec<usize>, String> {
    let p = t.to_i64().map_err(|e| e.to_string())?;
    let mut seen = vec![false; n];
    for &i in &p {
        match usize::try_from(i).ok().filter(|&i| i < n && !seen[i]) {
            Some(i) => seen[i] = true,
            None => return Err(format!("not a permutation of 0..{n} ({i} out of range or repeated)")),
        }
    }
    if p.len() != n {
        return Err(format!("{} entries for a matrix of order {n}", p.len()));
    }
    Ok(p.into_iter().map(|i| i as usize).collect())
}

/// The transform a stored `[b, b]` matrix gives (rows and columns permuted by `perm` when
/// given; `inverse`: its transpose), normalized.
fn block_transform(t: &RawTensor, perm: Option<Vec<usize>>, head_dim: Option<usize>, inverse: bool) -> Result<BlockTransform, String> {
    let b = match t.shape[..] {
        [r, c] if r == c && r > 0 => r,
        _ => return Err(format!("shape {:?}, expected a square matrix", t.shape)),
    };
    if head_dim.is_some_and(|d| d != b) {
        return Err(format!("order {b}, the group's head_dim is {}", head_dim.unwrap_or(0)));
    }
    let mut m = t.to_f32().map_err(|e| e.to_string())?;
    if let Some(p) = perm {
        m = (0..b * b).map(|ij| m[p[ij / b] * b + p[ij % b]]).collect();
    }
    // Stored normalized (entries ~1/sqrt(b)) or as ±1 (vLLM divides those by sqrt(b)).
    let sq = m[..b].iter().map(|v| v * v).sum::<f32>();
    if (sq - b as f32).abs() < 0.05 * b as f32 {
        let s = 1.0 / (b as f32).sqrt();
        m.iter_mut().for_each(|v| *v *= s);
    }
    // A bf16-stored Sylvester matrix is the Sylvester matrix to bf16's rounding of 1/sqrt(b)
    // (and so orthogonal, and symmetric: its inverse is itself).
    if b.is_power_of_two() && sylvester(b).iter().zip(&m).all(|(a, b)| (a - b).abs() <= a.abs() * 1e-2) {
        return Ok(BlockTransform::Hadamard { block: b });
    }
    check_orthogonal(&m, b)?;
    if inverse {
        m = (0..b * b).map(|ij| m[(ij % b) * b + ij / b]).collect();
    }
    Ok(BlockTransform::Dense { block: b, m })
}

/// Whether `m` (`b x b`, row-major) is orthogonal: `m mᵀ v = v` for two random `v`, to 1%
/// (bf16 storage rounds each entry by up to 2^-9 relative).
fn check_orthogonal(m: &[f32], b: usize) -> Result<(), String> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..2 {
        let v: Vec<f64> = (0..b)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 11) as f64 / (1u64 << 53) as f64) - 0.5
            })
            .collect();
        let mt_v: Vec<f64> = (0..b).map(|j| (0..b).map(|i| m[i * b + j] as f64 * v[i]).sum()).collect();
        let back: Vec<f64> = (0..b).map(|i| (0..b).map(|j| m[i * b + j] as f64 * mt_v[j]).sum()).collect();
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        let err = v.iter().zip(&back).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
        if err > 1e-2 * norm {
            return Err(format!("not an orthogonal matrix (m·mᵀ·v differs from v by {:.3} of its norm)", err / norm));
        }
    }
    Ok(())
}

/// The online transforms on `side` of `modules` (`(module, canonical name)` of linear
/// layers; `width(module, canonical)` their width on that side). Layers that store their
/// matrix come first, so layers whose tied copy was saved under another layer's name find
/// it. Equal transforms share one value, so layers reading one input (Q/K/V) transform it
/// once.
pub fn decode(transforms: &Transforms, side: Side, modules: &[(&str, String)], set: &TensorSet, width: impl Fn(&str, &str) -> Option<usize>) -> Result<BTreeMap<String, Arc<BlockTransform>>, LoadError> {
    let mut out = BTreeMap::new();
    let mut tied = TiedCopies::default();
    // `{module}.{group}_{location}.weight` -> module (not the folded `_weight_{location}` copies).
    let (at, folded) = (format!("_{}", side.location().as_str()), format!("_weight_{}", side.location().as_str()));
    let stores: std::collections::BTreeSet<&str> = set
        .names()
        .filter_map(|n| n.strip_suffix(".weight"))
        .filter_map(|n| n.rsplit_once('.'))
        .filter(|(_, g)| g.ends_with(&at) && !g.ends_with(&folded))
        .map(|(m, _)| m)
        .collect();
    let (storing, rest): (Vec<_>, Vec<_>) = modules.iter().partition(|(m, _)| stores.contains(m));
    let mut distinct: Vec<Arc<BlockTransform>> = Vec::new();
    for (module, canon) in storing.into_iter().chain(rest) {
        if let Some(t) = transforms.online_for(module, side, set, width(module, canon), &mut tied)? {
            let t = match distinct.iter().find(|d| ***d == *t) {
                Some(d) => d.clone(),
                None => {
                    distinct.push(t.clone());
                    t
                }
            };
            out.insert(canon.clone(), t);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::TensorBytes;
    use safetensors::Dtype;
    use serde_json::json;

    fn f32_tensor(name: &str, b: usize, v: &[f32]) -> RawTensor {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        RawTensor { name: name.into(), dtype: Dtype::F32, shape: vec![b, b], data: TensorBytes::Owned(Arc::from(bytes)) }
    }

    fn config(location: &str, ty: &str) -> Value {
        json!({"config_groups": {"R4": {"type": ty, "head_dim": null, "apply": [
            {"targets": ["re:.*down_proj$"], "location": location},
            {"targets": ["re:.*down_proj$"], "location": "weight_input", "inverse": true}]}}})
    }

    /// A stored ±1 Sylvester matrix becomes the fast transform; a non-orthogonal matrix, a
    /// bad permutation and transforms that would run online elsewhere are refused by name.
    #[test]
    fn transforms_load_checked_or_are_refused() {
        let t = parse(Some(&config("input", "hadamard"))).unwrap().unwrap();
        let module = "model.layers.0.mlp.down_proj";
        let ones: Vec<f32> = sylvester(8).iter().map(|v| v.signum()).collect();
        let mut set = TensorSet::default();
        set.insert(f32_tensor(&format!("{module}.R4_input.weight"), 8, &ones)).unwrap();
        assert_eq!(*t.online_for(module, Side::Input, &set, Some(8), &mut TiedCopies::default()).unwrap().unwrap(), BlockTransform::Hadamard { block: 8 });
        assert!(t.online_for("model.layers.0.mlp.up_proj", Side::Input, &set, Some(8), &mut TiedCopies::default()).unwrap().is_none());

        let mut skewed = ones.clone();
        skewed[3] *= 3.0;
        let mut set = TensorSet::default();
        set.insert(f32_tensor(&format!("{module}.R4_input.weight"), 8, &skewed)).unwrap();
        let e = t.online_for(module, Side::Input, &set, Some(8), &mut TiedCopies::default()).unwrap_err().to_string();
        assert!(e.contains("R4_input.weight") && e.contains("not an orthogonal matrix"), "{e}");

        let mut set = TensorSet::default();
        set.insert(f32_tensor(&format!("{module}.R4_input.weight"), 8, &ones)).unwrap();
        let perm = [0i64, 1, 2, 3, 4, 5, 6, 6];
        let bytes: Vec<u8> = perm.iter().flat_map(|x| x.to_le_bytes()).collect();
        set.insert(RawTensor { name: format!("{module}.R4_input.perm"), dtype: Dtype::I64, shape: vec![8], data: TensorBytes::Owned(Arc::from(bytes)) }).unwrap();
        let e = t.online_for(module, Side::Input, &set, Some(8), &mut TiedCopies::default()).unwrap_err().to_string();
        assert!(e.contains("R4_input.perm") && e.contains("not a permutation"), "{e}");

        // Without its matrix: a hadamard is generated (of its head_dim, else the layer's width).
        let mut with_dim = config("input", "hadamard");
        with_dim["config_groups"]["R4"]["head_dim"] = json!(64);
        let t64 = parse(Some(&with_dim)).unwrap().unwrap();
        assert_eq!(*t64.online_for(module, Side::Input, &TensorSet::default(), Some(1536), &mut TiedCopies::default()).unwrap().unwrap(), BlockTransform::Hadamard { block: 64 });
        assert_eq!(*t.online_for(module, Side::Input, &TensorSet::default(), Some(16), &mut TiedCopies::default()).unwrap().unwrap(), BlockTransform::Hadamard { block: 16 });
        // A random one comes from the layer that stores the group's tied copy, else is refused.
        let rt = parse(Some(&config("input", "random-hadamard"))).unwrap().unwrap();
        let flipped: Vec<f32> = ones.iter().enumerate().map(|(k, v)| if k % 8 == 0 { -v } else { *v }).collect();
        let mut set = TensorSet::default();
        set.insert(f32_tensor(&format!("{module}.R4_input.weight"), 8, &flipped)).unwrap();
        let mut tied = TiedCopies::default();
        let a = rt.online_for(module, Side::Input, &set, Some(8), &mut tied).unwrap().unwrap();
        let b = rt.online_for("model.layers.1.mlp.down_proj", Side::Input, &set, Some(8), &mut tied).unwrap().unwrap();
        assert!(matches!(*a, BlockTransform::Dense { block: 8, .. }));
        assert_eq!(a, b);
        let e = rt.online_for("model.layers.1.mlp.down_proj", Side::Input, &set, Some(8), &mut TiedCopies::default()).unwrap_err().to_string();
        assert!(e.contains("layers.1.mlp.down_proj.R4_input.weight") && e.contains("no other layer stores"), "{e}");

        // An output transform reads `{group}_output.weight` and runs on that side only.
        let out = parse(Some(&config("output", "hadamard"))).unwrap().unwrap();
        let mut set = TensorSet::default();
        set.insert(f32_tensor(&format!("{module}.R4_output.weight"), 8, &flipped)).unwrap();
        assert!(out.online_for(module, Side::Input, &set, Some(8), &mut TiedCopies::default()).unwrap().is_none());
        let u = out.online_for(module, Side::Output, &set, Some(8), &mut TiedCopies::default()).unwrap().unwrap();
        assert!(matches!(*u, BlockTransform::Dense { block: 8, .. }));
        assert!(set.untaken().is_empty());
        // A layer saving only its folded copy (`u_weight_output`) does not count as storing its
        // online matrix: the layer that does loads first, and the other takes its tied copy.
        let rout = parse(Some(&json!({"config_groups": {"u": {"type": "random-hadamard", "apply": [
            {"targets": ["re:.*down_proj$"], "location": "weight_output"},
            {"targets": ["re:.*down_proj$"], "location": "output", "inverse": true}]}}})))
        .unwrap()
        .unwrap();
        let (a, b) = ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj");
        let mut set = TensorSet::default();
        set.insert(f32_tensor(&format!("{a}.u_weight_output.weight"), 8, &flipped)).unwrap();
        set.insert(f32_tensor(&format!("{b}.u_output.weight"), 8, &flipped)).unwrap();
        let modules = [(a, "blk.0.ffn_down.weight".to_string()), (b, "blk.1.ffn_down.weight".to_string())];
        let got = decode(&rout, Side::Output, &modules, &set, |_, _| Some(8)).unwrap();
        assert_eq!(got.len(), 2);
        assert!(Arc::ptr_eq(&got["blk.0.ffn_down.weight"], &got["blk.1.ffn_down.weight"]));
        assert!(decode(&rout, Side::Input, &modules, &set, |_, _| Some(8)).unwrap().is_empty());
        let e = parse(Some(&config("attn_q", "hadamard"))).unwrap_err().to_string();
        assert!(e.contains("transform_config.config_groups.R4.apply[0].location") && e.contains("not supported"), "{e}");
        let e = parse(Some(&config("input", "learned"))).unwrap_err().to_string();
        assert!(e.contains("\"learned\" is not a supported transform"), "{e}");
        assert!(parse(Some(&json!({}))).unwrap().is_none());
    }
}
