//! compressed-tensors output (checkpoint-formats.md §2): tensors per quantized linear `P` and
//! the `quantization_config` that vLLM and Tessera's loader read.
//!
//! - `pack-quantized` int4: `P.weight_packed` I32 `[out, in/8]` (value `q + 8` in nibble `j` of
//!   word `w` = column `8w + j`, low nibble first), `P.weight_scale` in the input's float type
//!   `[out, in/group]` (`[out, 1]` per channel), `P.weight_shape` I64 `[out, in]`; asymmetric
//!   also `P.weight_zero_point` I32 `[ceil(out/8), groups]` (`zp + 8` of output row `8r + j` in
//!   nibble `j` of word row `r`, packed along the output dimension).
//! - `int-quantized` int8: `P.weight` I8 `[out, in]`, `P.weight_scale` `[out, 1]`.
//! - `float-quantized` FP8: `P.weight` F8_E4M3 `[out, in]`, `P.weight_scale` `[out, 1]`.
//!
//! Symmetric schemes write no zero points. Dequantization: `w = (q − zp) · scale` (`zp = 0`
//! when symmetric).

use super::math::{int_codes, CodeKind, Grid};
use super::{find, OutTensor};
use crate::float_dtype::FloatDtype;
use safetensors::Dtype;
use serde_json::{json, Value};
use tessera_kernels::e4m3::e4m3_to_f32;

/// Packs int4 values (`[rows, cols]`, cols a multiple of 8) into little-endian I32 words:
/// `q + 8` of column `8w + j` in bits `4j..4j+3` of word `w`.
pub fn pack_int4(q: &[i8]) -> Vec<u8> {
    q.chunks_exact(8)
        .flat_map(|g| {
            let word = g.iter().enumerate().fold(0u32, |acc, (j, &v)| acc | ((((v as i32) + 8) as u32 & 0xF) << (4 * j)));
            word.to_le_bytes()
        })
        .collect()
}

/// The int4 values of `pack_int4`'s words.
fn unpack_int4(bytes: &[u8]) -> Vec<i8> {
    bytes
        .chunks_exact(4)
        .flat_map(|c| {
            let word = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            (0..8).map(move |j| ((word >> (4 * j)) & 0xF) as i8 - 8)
        })
        .collect()
}

/// Packs int4 zero points (`[rows, groups]`) along the rows: `zp + 8` of row `8r + j` in bits
/// `4j..4j+3` of word `[r, g]`; rows past the end leave their nibbles 0.
fn pack_int4_rows(z: &[i8], rows: usize, groups: usize) -> Vec<u8> {
    let mut words = vec![0u32; rows.div_ceil(8) * groups];
    for (i, &v) in z.iter().enumerate() {
        let (r, g) = (i / groups, i % groups);
        words[(r / 8) * groups + g] |= (((v as i32) + 8) as u32 & 0xF) << (4 * (r % 8));
    }
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// int4 `pack-quantized` tensors for `prefix` from `codes` on `grid` (zero points when the
/// grid has them).
pub fn int4_tensors(prefix: &str, grid: &Grid, codes: &[u8], rows: usize, cols: usize, scale_dtype: FloatDtype) -> Vec<OutTensor<'static>> {
    let groups = grid.per_row();
    let shape = [rows as i64, cols as i64].iter().flat_map(|d| d.to_le_bytes()).collect::<Vec<u8>>();
    let mut out = vec![
        OutTensor::owned(format!("{prefix}.weight_packed"), Dtype::I32, vec![rows, cols / 8], pack_int4(&int_codes(codes))),
        OutTensor::owned(format!("{prefix}.weight_scale"), scale_dtype.safetensors(), vec![rows, groups], scale_dtype.encode(&grid.scales)),
        OutTensor::owned(format!("{prefix}.weight_shape"), Dtype::I64, vec![2], shape),
    ];
    if let Some(z) = &grid.zeros {
        out.push(OutTensor::owned(format!("{prefix}.weight_zero_point"), Dtype::I32, vec![rows.div_ceil(8), groups], pack_int4_rows(z, rows, groups)));
    }
    out
}

/// int8 `int-quantized` or FP8 `float-quantized` tensors (one code byte per value, per-row
/// scales) from `codes` on `grid`.
pub fn byte_tensors(prefix: &str, grid: &Grid, codes: Vec<u8>, rows: usize, cols: usize, scale_dtype: FloatDtype) -> Vec<OutTensor<'static>> {
    let dtype = if grid.kind == CodeKind::Fp8 { Dtype::F8_E4M3 } else { Dtype::I8 };
    vec![
        OutTensor::owned(format!("{prefix}.weight"), dtype, vec![rows, cols], codes),
        OutTensor::owned(format!("{prefix}.weight_scale"), scale_dtype.safetensors(), vec![rows, 1], scale_dtype.encode(&grid.scales)),
    ]
}

/// The float scales of `P.weight_scale`, whatever float type they were written in.
fn scales(prefix: &str, tensors: &[OutTensor<'_>]) -> Result<(Vec<f32>, Vec<usize>), String> {
    let t = find(tensors, &format!("{prefix}.weight_scale"))?;
    let dtype = FloatDtype::from_safetensors(t.dtype).ok_or_else(|| format!("{}: dtype {:?} is not a float", t.name, t.dtype))?;
    Ok((dtype.decode(&t.data), t.shape.clone()))
}

/// Dequantizes a layer's written tensors (any of the three formats, with `weight_zero_point`
/// when present) back to `[rows, cols]` f32; `group` is the columns per scale (`cols` for
/// per-channel scales).
pub fn decode(prefix: &str, tensors: &[OutTensor<'_>], rows: usize, cols: usize, group: usize) -> Result<Vec<f32>, String> {
    let (s, s_shape) = scales(prefix, tensors)?;
    let per_row = *s_shape.get(1).ok_or_else(|| format!("{prefix}.weight_scale is not 2-D"))?;
    if per_row != cols.div_ceil(group) {
        return Err(format!("{prefix}.weight_scale has {per_row} columns for groups of {group} over {cols}"));
    }
    let values: Vec<f32> = if let Ok(packed) = find(tensors, &format!("{prefix}.weight_packed")) {
        unpack_int4(&packed.data).into_iter().map(f32::from).collect()
    } else {
        let w = find(tensors, &format!("{prefix}.weight"))?;
        match w.dtype {
            Dtype::I8 => w.data.iter().map(|&b| b as i8 as f32).collect(),
            Dtype::F8_E4M3 => w.data.iter().map(|&b| e4m3_to_f32(b)).collect(),
            other => return Err(format!("{}: unexpected dtype {other:?}", w.name)),
        }
    };
    if values.len() != rows * cols || s.len() != rows * per_row {
        return Err(format!("{prefix}: {} values and {} scales for [{rows}, {cols}]", values.len(), s.len()));
    }
    let zeros = match find(tensors, &format!("{prefix}.weight_zero_point")) {
        Ok(z) if z.shape != [rows.div_ceil(8), per_row] => return Err(format!("{}: shape {:?} for [{rows}, {cols}]", z.name, z.shape)),
        Ok(z) => {
            // Nibble r % 8 of word [r / 8, g] is row r's zero point for group g.
            let u = unpack_int4(&z.data);
            (0..rows * per_row).map(|k| u[((k / per_row / 8) * per_row + k % per_row) * 8 + (k / per_row) % 8]).collect()
        }
        Err(_) => vec![0i8; rows * per_row],
    };
    Ok(values
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let k = (i / cols) * per_row + (i % cols) / group;
            (v - f32::from(zeros[k])) * s[k]
        })
        .collect())
}

/// One `config_groups` entry's quantization arguments for integer weights.
fn int_weights(bits: u32, symmetric: bool, strategy: &str, group: Option<usize>) -> Value {
    json!({
        "num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
        "group_size": group, "dynamic": false, "actorder": null, "observer": "minmax",
    })
}

/// Dynamic per-token activation arguments (`int` or `float`).
fn token_activations(ty: &str) -> Value {
    json!({ "num_bits": 8, "type": ty, "symmetric": true, "strategy": "token", "dynamic": true, "observer": null })
}

/// The weights/activation arguments and format of a compressed-tensors scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// int4 `pack-quantized`: group size (`None`: per channel) and whether activations are
    /// dynamic int8 per token (W4A8) rather than left in 16 bits (W4A16).
    Int4 {
        /// Columns per scale, `None` for one scale per row.
        group: Option<usize>,
        /// W4A8 (int8 per-token activations) instead of W4A16.
        int8_act: bool,
        /// Zero points per scale (W4A16_ASYM) instead of symmetric weights.
        asymmetric: bool,
    },
    /// W8A8 int8, `int-quantized`.
    Int8,
    /// W8A8 FP8, `float-quantized`.
    Fp8,
}

/// The format name and the `config_groups` entry of `scheme` for `targets`.
fn config_group(scheme: &Scheme, targets: &[&str]) -> (&'static str, Value) {
    let (format, weights, input) = match scheme {
        Scheme::Int4 { group, int8_act, asymmetric } => (
            "pack-quantized",
            match group {
                Some(g) => int_weights(4, !asymmetric, "group", Some(*g)),
                None => int_weights(4, !asymmetric, "channel", None),
            },
            if *int8_act { token_activations("int") } else { Value::Null },
        ),
        Scheme::Int8 => ("int-quantized", int_weights(8, true, "channel", None), token_activations("int")),
        Scheme::Fp8 => (
            "float-quantized",
            json!({ "num_bits": 8, "type": "float", "symmetric": true, "strategy": "channel", "group_size": null, "dynamic": false, "observer": "minmax" }),
            token_activations("float"),
        ),
    };
    (format, json!({ "targets": targets, "format": format, "weights": weights, "input_activations": input, "output_activations": null }))
}

/// `quantization_config` for a scheme with the given ignored (unquantized) module names, and
/// `head`'s scheme as a second group targeting `lm_head` when the output head is quantized
/// (the top-level `format` is then `mixed-precision` if the two differ, as
/// compressed-tensors writes it).
pub fn quantization_config(scheme: &Scheme, head: Option<&Scheme>, ignore: &[String]) -> Value {
    let (format, body) = config_group(scheme, &["Linear"]);
    let mut groups = serde_json::Map::from_iter([("group_0".to_string(), body)]);
    let mut top = format;
    if let Some(h) = head {
        let (head_format, group) = config_group(h, &["lm_head"]);
        if head_format != format {
            top = "mixed-precision";
        }
        groups.insert("group_1".into(), group);
    }
    json!({
        "quant_method": "compressed-tensors",
        "version": "0.20.0",
        "format": top,
        "quantization_status": "compressed",
        "global_compression_ratio": null,
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": null,
        "sparsity_config": {},
        "transform_config": {},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nibble_order_matches_the_documented_example() {
        // checkpoint-formats.md §2.4: [-2,-3,-1,-1,2,2,-1,-5] -> nibbles [6,5,7,7,10,10,7,3].
        let b = pack_int4(&[-2, -3, -1, -1, 2, 2, -1, -5]);
        let word = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let nibbles: Vec<u32> = (0..8).map(|j| (word >> (4 * j)) & 0xF).collect();
        assert_eq!(nibbles, vec![6, 5, 7, 7, 10, 10, 7, 3]);
        assert_eq!(unpack_int4(&b), vec![-2, -3, -1, -1, 2, 2, -1, -5]);
    }

    #[test]
    fn zero_points_pack_along_rows_with_zero_padding() {
        // 9 rows, 2 groups: word [0, g] holds rows 0..8, word [1, g] row 8 then zero nibbles.
        let z: Vec<i8> = (0..18).map(|i| (i % 16) as i8 - 8).collect();
        let b = pack_int4_rows(&z, 9, 2);
        let words: Vec<u32> = b.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(words, vec![0xECA8_6420, 0xFDB9_7531, 0x0, 0x1]);
    }
}
