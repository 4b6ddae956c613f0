//! AMD Quark output (checkpoint-formats.md §4, as Quark 0.13's file-to-file export writes it).
//!
//! - W4A8 (`ProgressiveSpec` FP8 per-tensor → INT4 per-channel): `P.weight` I32 `[out, in/8]`
//!   holding int4 two's-complement nibbles in the "reorder" order (element `k` of each group of
//!   8 in nibble `[0, 4, 1, 5, 2, 6, 3, 7][k]`), `P.weight_scale` F32 0-rank (the FP8 stage's
//!   scale), `P.weight_scale_2` F32 `[out]` (the INT4 stage's row scales, in FP8 units); no
//!   zero-point tensors. `W ≈ q · weight_scale_2[row] · weight_scale`.
//! - W8A8 FP8 per channel: `P.weight` F8_E4M3 `[out, in]`, `P.weight_scale` F32 `[out]`.
//! - W8A8 int8 per channel: `P.weight` I8 `[out, in]`, `P.weight_scale` F32 `[out]`, with
//!   dynamic per-token int8 activations (`per_channel` on `ch_axis` 1, as Quark writes
//!   per-token specs).

use super::math::{int_codes, CodeKind, Grid};
use super::{find, OutTensor};
use crate::float_dtype::FloatDtype;
use safetensors::Dtype;
use serde_json::{json, Value};
use tessera_kernels::e4m3::e4m3_to_f32;

/// Nibble that holds element `k` of a group of 8 under `pack_method: "reorder"`.
const REORDER_NIBBLE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// Packs int4 values (two's complement, no offset) 8 per little-endian I32 word in the
/// "reorder" nibble order.
pub fn pack_int4_reorder(q: &[i8]) -> Vec<u8> {
    q.chunks_exact(8)
        .flat_map(|g| {
            let word = g.iter().zip(REORDER_NIBBLE).fold(0u32, |acc, (&v, nib)| acc | (((v as u32) & 0xF) << (4 * nib)));
            word.to_le_bytes()
        })
        .collect()
}

/// The int4 values of `pack_int4_reorder`'s words.
fn unpack_int4_reorder(bytes: &[u8]) -> Vec<i8> {
    bytes
        .chunks_exact(4)
        .flat_map(|c| {
            let word = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            // Shift the nibble to the top of an i32, then arithmetic-shift back: sign extension.
            REORDER_NIBBLE.map(|nib| ((((word >> (4 * nib)) & 0xF) << 28) as i32 >> 28) as i8)
        })
        .collect()
}

/// W4A8 tensors for `prefix` from `codes` on a progressive `grid`, or W8A8 FP8 / int8
/// per-channel tensors from `codes` on an FP8 / int8 `grid`.
pub fn tensors(prefix: &str, grid: &Grid, codes: Vec<u8>, rows: usize, cols: usize) -> Vec<OutTensor<'static>> {
    let scales = FloatDtype::F32.encode(&grid.scales);
    match grid.kind {
        CodeKind::Progressive { fp8_scale } => vec![
            OutTensor::owned(format!("{prefix}.weight"), Dtype::I32, vec![rows, cols / 8], pack_int4_reorder(&int_codes(&codes))),
            OutTensor::owned(format!("{prefix}.weight_scale"), Dtype::F32, vec![], fp8_scale.to_le_bytes().to_vec()),
            OutTensor::owned(format!("{prefix}.weight_scale_2"), Dtype::F32, vec![rows], scales),
        ],
        kind @ (CodeKind::Fp8 | CodeKind::Int(_)) => vec![
            OutTensor::owned(format!("{prefix}.weight"), if kind == CodeKind::Fp8 { Dtype::F8_E4M3 } else { Dtype::I8 }, vec![rows, cols], codes),
            OutTensor::owned(format!("{prefix}.weight_scale"), Dtype::F32, vec![rows], scales),
        ],
    }
}

fn f32s(t: &OutTensor<'_>) -> Result<Vec<f32>, String> {
    match t.dtype {
        Dtype::F32 => Ok(FloatDtype::F32.decode(&t.data)),
        other => Err(format!("{}: dtype {other:?}, expected F32", t.name)),
    }
}

/// Dequantizes a layer's written tensors (W4A8, FP8 or int8) back to `[rows, cols]` f32.
pub fn decode(prefix: &str, tensors: &[OutTensor<'_>], rows: usize, cols: usize) -> Result<Vec<f32>, String> {
    let w = find(tensors, &format!("{prefix}.weight"))?;
    let s = f32s(find(tensors, &format!("{prefix}.weight_scale"))?)?;
    // `q · row_scale · tensor_scale`, in that order (W4A8: weight_scale_2, then weight_scale).
    let (values, row_scales, tensor_scale): (Vec<f32>, Vec<f32>, f32) = match w.dtype {
        Dtype::I32 => {
            let s2 = f32s(find(tensors, &format!("{prefix}.weight_scale_2"))?)?;
            let [s0] = s[..] else { return Err(format!("{prefix}.weight_scale: {} values, expected 1", s.len())) };
            (unpack_int4_reorder(&w.data).into_iter().map(f32::from).collect(), s2, s0)
        }
        Dtype::F8_E4M3 => (w.data.iter().map(|&b| e4m3_to_f32(b)).collect(), s, 1.0),
        Dtype::I8 => (w.data.iter().map(|&b| b as i8 as f32).collect(), s, 1.0),
        other => return Err(format!("{}: unexpected dtype {other:?}", w.name)),
    };
    if values.len() != rows * cols || row_scales.len() != rows {
        return Err(format!("{prefix}: {} values and {} row scales for [{rows}, {cols}]", values.len(), row_scales.len()));
    }
    Ok(values.iter().enumerate().map(|(i, v)| v * row_scales[i / cols] * tensor_scale).collect())
}

/// A Quark tensor spec with every key Quark 0.13 writes.
fn spec(dtype: &str, qscheme: &str, ch_axis: Option<i64>, dynamic: bool, round: Option<&str>, observer: &str) -> Value {
    json!({
        "dtype": dtype, "qscheme": qscheme, "ch_axis": ch_axis, "group_size": null,
        "symmetric": true, "is_dynamic": dynamic, "round_method": round,
        "scale_type": "float32", "scale_format": null, "scale_calculation_mode": null,
        "observer_cls": observer, "mx_element_dtype": null, "zero_point_type": "int32",
        "is_scale_quant": false,
    })
}

/// The Quark schemes Tessera writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// W4A8: FP8 per-tensor then INT4 per-channel weights, dynamic FP8 per-tensor activations.
    W4A8,
    /// W8A8 FP8: per-channel FP8 weights, dynamic FP8 per-tensor activations.
    Fp8,
    /// W8A8 int8: per-channel int8 weights, dynamic int8 per-token activations.
    Int8,
}

/// A layer's quantization config (`weight`, `input_tensors`, ...) for a scheme.
fn layer_config(scheme: &Scheme) -> Value {
    let (weight, input) = match scheme {
        Scheme::W4A8 => (
            json!([
                spec("fp8_e4m3", "per_tensor", None, false, None, "PerTensorMinMaxObserver"),
                spec("int4", "per_channel", Some(0), false, Some("half_even"), "PerChannelMinMaxObserver"),
            ]),
            spec("fp8_e4m3", "per_tensor", None, true, None, "PerTensorMinMaxObserver"),
        ),
        Scheme::Fp8 => (
            spec("fp8_e4m3", "per_channel", Some(0), false, None, "PerChannelMinMaxObserver"),
            spec("fp8_e4m3", "per_tensor", None, true, None, "PerTensorMinMaxObserver"),
        ),
        Scheme::Int8 => (
            spec("int8", "per_channel", Some(0), false, Some("half_even"), "PerChannelMinMaxObserver"),
            // Quark has no per-token qscheme: it writes per-token as per_channel on axis 1, dynamic.
            spec("int8", "per_channel", Some(1), true, Some("half_even"), "PerChannelMinMaxObserver"),
        ),
    };
    json!({ "weight": weight, "input_tensors": input, "output_tensors": null, "bias": null, "target_device": null })
}

/// `quantization_config` for a scheme with the given excluded module names, and `head`'s
/// scheme as the `layer_quant_config` of `lm_head` when the output head is quantized.
pub fn quantization_config(scheme: &Scheme, head: Option<&Scheme>, exclude: &[String]) -> Value {
    let layers: serde_json::Map<String, Value> = head.map(|h| ("lm_head".to_string(), layer_config(h))).into_iter().collect();
    json!({
        "quant_method": "quark",
        "version": "0.13",
        "quant_mode": "eager_mode",
        "global_quant_config": layer_config(scheme),
        "layer_quant_config": layers,
        "layer_type_quant_config": {},
        "exclude": exclude,
        "kv_cache_quant_config": {},
        "softmax_quant_spec": null,
        "algo_config": null,
        "export": {
            "kv_cache_group": [],
            "min_kv_scale": 0.0,
            "pack_method": "reorder",
            "weight_format": "real_quantized",
            "weight_merge_groups": null,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reorder_matches_the_documented_examples() {
        // checkpoint-formats.md §4.3: elements -8..-1 -> nibbles [8,10,12,14,9,11,13,15];
        // elements 0..7 -> [0,2,4,6,1,3,5,7].
        for (elems, want) in [([-8i8, -7, -6, -5, -4, -3, -2, -1], [8u32, 10, 12, 14, 9, 11, 13, 15]), ([0, 1, 2, 3, 4, 5, 6, 7], [0, 2, 4, 6, 1, 3, 5, 7])] {
            let b = pack_int4_reorder(&elems);
            let word = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            let nibbles: Vec<u32> = (0..8).map(|j| (word >> (4 * j)) & 0xF).collect();
            assert_eq!(nibbles, want);
            assert_eq!(unpack_int4_reorder(&b), elems);
        }
    }
}
