//! W8A8 FP8 (E4M3): conversions against an independent ml_dtypes fixture, per-token activation
//! quantization, and the `Fp8Matrix` kernels (scalar, AVX2, AVX-512 BF16) against each other,
//! against an f64 reference and for batch invariance, and the AVX-512 BF16 kernel bit for bit
//! against a scalar emulation of its lanes.
//!
//! Error bounds used below (u = 2⁻²⁴, γ_n = n·u / (1 − n·u), the classic bound for n
//! roundings). Products of two E4M3 values have at most 8 significant bits and exponents far
//! from the f32 limits, so every product is exact in f32 and only the summation order differs
//! between paths. One output is `Σ_b fl(s_w·s_x)·part_b` summed over `nb` column blocks of
//! width `bw`, where `part_b` is summed sequentially (scalar: `bw − 1` roundings) or in 8 lanes
//! plus a 3-level tree (AVX2: `bw/8 + 2` roundings; its `·2⁸` is exact), or in 16 lanes plus a
//! 4-level tree (AVX-512 BF16: `bw/16 + 3`). Each product term
//! thus meets at most `bw + nb + 2` roundings, so with `A = Σ_c |W[r,c]|·|X[i,c]|`
//! (dequantized weight times code · scale):
//! - each kernel is within `γ_{bw+nb+2}·A` of the exact sum, hence AVX2 and scalar are within
//!   `2·γ_{bw+nb+2}·A` of each other (`bw + nb ≤ k + 1`, so about `k·eps·Σ|w x|`, eps = 2u);
//! - the f64 reference uses `dequantize_row`, itself one f32 rounding (`u·A`) away from the
//!   exact weights, so kernel and reference are within `(γ_{bw+nb+2} + u)·A` (the f64 sum's
//!   own error, about `k·2⁻⁵³·A`, is covered by a 1% margin on the bound).

use crate::common;

use common::{randn, rng};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use tessera_kernels::cpu::Isa;
use tessera_kernels::linear::act::quantize_fp8_row;
use tessera_kernels::e4m3::{e4m3_is_nan, e4m3_to_f32, f32_to_e4m3, E4M3_MAX};
use tessera_kernels::linear::{ActQuant, Fp8Kernel, Fp8Matrix, RowKernel, RowwiseLinear};
use std::sync::Arc;

/// A row-kernel matrix behind the trait object the driver takes.
fn rk(m: impl RowKernel) -> Arc<dyn RowKernel> {
    Arc::new(m)
}

const FIXTURE: &str = include_str!("../fixtures/fp8/e4m3.json");

/// The array under `"key":[...]` of the fixture (`null` entries as `None`).
fn fixture_array(key: &str) -> Vec<Option<u32>> {
    let start = FIXTURE.find(&format!("\"{key}\":[")).unwrap_or_else(|| panic!("fixture has no {key}")) + key.len() + 4;
    let len = FIXTURE[start..].find(']').expect("closing bracket");
    FIXTURE[start..start + len]
        .split(',')
        .map(|t| match t.trim() {
            "null" => None,
            n => Some(n.parse().unwrap_or_else(|_| panic!("{key}: bad entry {n:?}"))),
        })
        .collect()
}

fn fixture_field(key: &str) -> &'static str {
    let start = FIXTURE.find(&format!("\"{key}\":\"")).unwrap_or_else(|| panic!("fixture has no {key}")) + key.len() + 4;
    &FIXTURE[start..start + FIXTURE[start..].find('"').expect("closing quote")]
}

#[test]
fn fixture_header_names_its_generator() {
    assert_eq!(fixture_field("generator"), "kernels/tests/fixtures/make_fp8_fixture.py");
    for key in ["python", "numpy", "ml_dtypes"] {
        assert!(!fixture_field(key).is_empty(), "{key} version recorded");
    }
}

#[test]
fn e4m3_decode_matches_ml_dtypes_for_all_codes() {
    let values = fixture_array("code_value_bits");
    assert_eq!(values.len(), 256);
    for (b, v) in (0..=255u8).zip(values) {
        let got = e4m3_to_f32(b);
        match v {
            None => assert!(got.is_nan() && e4m3_is_nan(b), "code {b:#04x} is NaN"),
            Some(bits) => {
                assert!(!e4m3_is_nan(b), "code {b:#04x} is not NaN");
                assert_eq!(got.to_bits(), bits, "code {b:#04x}: {got} vs {}", f32::from_bits(bits));
            }
        }
    }
}

#[test]
fn e4m3_encode_matches_ml_dtypes() {
    let inputs = fixture_array("input_bits");
    let codes = fixture_array("input_code");
    assert!(inputs.len() >= 4000 && inputs.len() == codes.len(), "{} inputs, {} codes", inputs.len(), codes.len());
    let mut bad = Vec::new();
    for (x, c) in inputs.iter().zip(&codes) {
        let x = f32::from_bits(x.expect("input"));
        let want = c.expect("code") as u8;
        let got = f32_to_e4m3(x);
        if got != want {
            bad.push(format!("{x:e} ({:#010x}): {got:#04x} vs {want:#04x}", x.to_bits()));
        }
    }
    assert!(bad.is_empty(), "{} of {} inputs differ from ml_dtypes, e.g. {:?}", bad.len(), inputs.len(), &bad[..bad.len().min(8)]);
}

#[test]
fn e4m3_nan_and_round_trip() {
    assert_eq!(f32_to_e4m3(f32::NAN), 0x7F);
    assert_eq!(f32_to_e4m3(-f32::NAN), 0x7F);
    assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7E);
    assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xFE);
    for b in (0..=255u8).filter(|&b| !e4m3_is_nan(b)) {
        assert_eq!(f32_to_e4m3(e4m3_to_f32(b)), b, "code {b:#04x} round trip");
    }
}

/// The finite E4M3 value nearest to `v` (ties to the even code), by search over all codes.
fn nearest_e4m3(v: f32) -> f32 {
    let a = v.abs().min(E4M3_MAX) as f64;
    let best = (0..0x7Fu8).min_by(|&p, &q| {
        let (dp, dq) = ((e4m3_to_f32(p) as f64 - a).abs(), (e4m3_to_f32(q) as f64 - a).abs());
        dp.total_cmp(&dq).then((p & 1).cmp(&(q & 1)))
    });
    let m = e4m3_to_f32(best.expect("codes"));
    if v.is_sign_negative() {
        -m
    } else {
        m
    }
}

#[test]
fn quantize_fp8_row_matches_direct_computation() {
    let mut r = rng(11);
    let k = 512;
    for group in [32, 128, 512] {
        for t in 0..6 {
            let mut x = randn(&mut r, k);
            let mag = 10f32.powi(t - 3);
            for v in x.iter_mut() {
                *v *= mag * if r.gen::<f32>() < 0.02 { 30.0 } else { 1.0 };
            }
            if t == 5 {
                x[k - group..].fill(0.0); // an all-zero group: scale 0, codes 0
            }
            if t == 4 {
                x[3] = f32::NAN; // skipped by absmax, NaN code
            }
            let (mut codes, mut scales) = (vec![f32::NAN; k], vec![f32::NAN; k / group]);
            quantize_fp8_row(&x, group, &mut codes, &mut scales);
            for (g, ((xs, cs), &s)) in x.chunks_exact(group).zip(codes.chunks_exact(group)).zip(&scales).enumerate() {
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert_eq!(s.to_bits(), (amax / 448.0).to_bits(), "group {g} scale");
                if s == 0.0 {
                    assert!(cs.iter().all(|&c| c.to_bits() == 0), "zero group gives +0 codes");
                    continue;
                }
                for (&v, &c) in xs.iter().zip(cs) {
                    assert_eq!(c.to_bits(), e4m3_to_f32(f32_to_e4m3(v / s)).to_bits(), "code of {v}");
                    if !v.is_nan() {
                        assert_eq!(c.to_bits(), nearest_e4m3(v / s).to_bits(), "nearest E4M3 to {}", v / s);
                    }
                }
                assert!(cs.iter().any(|c| c.abs() == 448.0), "absmax maps to ±448");
            }
        }
    }
}

#[test]
fn quantize_fp8_row_matches_ml_dtypes_at_unit_scale() {
    // Groups of 31 fixture inputs (|x| <= 448) plus one 448: scale exactly 1, so each code is
    // the ml_dtypes value of its input, on whichever path (SIMD or scalar) this CPU takes.
    let inputs = fixture_array("input_bits");
    let codes = fixture_array("input_code");
    let (mut x, mut want) = (Vec::new(), Vec::new());
    for (xb, c) in inputs.iter().zip(&codes) {
        let v = f32::from_bits(xb.expect("input"));
        if v.abs() <= 448.0 {
            if x.len() % 32 == 31 {
                x.push(448.0);
                want.push(448f32);
            }
            x.push(v);
            want.push(e4m3_to_f32(c.expect("code") as u8));
        }
    }
    while x.len() % 32 != 0 {
        x.push(-448.0);
        want.push(-448.0);
    }
    let (mut got, mut scales) = (vec![0f32; x.len()], vec![0f32; x.len() / 32]);
    quantize_fp8_row(&x, 32, &mut got, &mut scales);
    assert!(scales.iter().all(|&s| s == 1.0), "unit scales");
    for ((v, g), w) in x.iter().zip(&got).zip(&want) {
        assert_eq!(g.to_bits(), w.to_bits(), "{v:e}: {g} vs ml_dtypes {w}");
    }
}

/// A random E4M3 matrix: mostly rounded normals (scale ~64), one code in eight a uniformly
/// random non-NaN byte (subnormals and ±448 included); scales positive in [2⁻¹², 2⁻⁶].
fn random_matrix(r: &mut ChaCha8Rng, rows: usize, cols: usize, block: [usize; 2]) -> Fp8Matrix {
    let q: Vec<u8> = randn(r, rows * cols)
        .into_iter()
        .map(|v| {
            if r.gen::<u8>() < 32 {
                let b: u8 = r.gen();
                if e4m3_is_nan(b) {
                    b - 1
                } else {
                    b
                }
            } else {
                f32_to_e4m3(v * 64.0)
            }
        })
        .collect();
    let n = rows.div_ceil(block[0]) * cols.div_ceil(block[1]);
    let scales = (0..n).map(|_| (r.gen::<f32>() * 6.0 - 12.0).exp2()).collect();
    Fp8Matrix::new(rows, cols, block, q, scales).expect("valid matrix")
}

/// Activations: normals, per-token magnitudes 1e-2..1e2, a few 30x outliers.
fn random_acts(r: &mut ChaCha8Rng, m: usize, k: usize) -> Vec<f32> {
    let mut x = randn(r, m * k);
    for row in x.chunks_exact_mut(k) {
        let mag = 10f32.powf(r.gen::<f32>() * 4.0 - 2.0);
        for v in row.iter_mut() {
            *v *= mag * if r.gen::<f32>() < 0.01 { 30.0 } else { 1.0 };
        }
    }
    x
}

/// (name, rows, cols, block): per-tensor, per-channel (odd rows), 128x128 blocks with a
/// partial row block, 128x128 blocks with a partial column block (320 = 2.5 blocks) and
/// fewer rows than one block, 64-wide column blocks.
const SHAPES: [(&str, usize, usize, [usize; 2]); 5] = [
    ("tensor", 96, 160, [96, 160]),
    ("channel", 37, 96, [1, 96]),
    ("block128", 200, 256, [128, 128]),
    ("block128-partial-cols", 64, 320, [128, 128]),
    ("block64x32", 75, 192, [64, 32]),
];

fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2].into_iter().filter(|i| i.available()).collect()
}

/// Every FP8 kernel this CPU runs.
fn kernels() -> Vec<Fp8Kernel> {
    [Fp8Kernel::Scalar, Fp8Kernel::Avx2, Fp8Kernel::Avx512Bf16].into_iter().filter(|k| k.available()).collect()
}

/// `x` quantized per token and block of `bw` columns: (codes, scales).
fn quantized(x: &[f32], k: usize, bw: usize) -> (Vec<f32>, Vec<f32>) {
    let (m, nb) = (x.len() / k, k.div_ceil(bw));
    let (mut codes, mut xs) = (vec![0f32; m * k], vec![0f32; m * nb]);
    for ((xi, c), s) in x.chunks_exact(k).zip(codes.chunks_exact_mut(k)).zip(xs.chunks_exact_mut(nb)) {
        quantize_fp8_row(xi, bw, c, s);
    }
    (codes, xs)
}

/// Rows `r0..r1` of `kernel`'s product, `[row][token]`.
fn rows_with(w: &Fp8Matrix, kernel: Fp8Kernel, r0: usize, r1: usize, x: &[f32], m: usize) -> Vec<f32> {
    let (codes, xs) = quantized(x, w.cols(), w.block()[1]);
    let mut out = vec![f32::NAN; (r1 - r0) * m];
    w.rows_fp8_with(kernel, r0, r1, &codes, &xs, m, &mut out);
    out
}

/// The AVX-512 BF16 kernel's arithmetic in scalar Rust, written from its contract: per
/// `(row, token)` sixteen f32 lanes; each 32 columns `c..c + 32`, lane `l` adds the exact
/// product of column `c + 2l + 1`, then of `c + 2l` (weights as `e4m3 · 2⁻⁸`); at each block
/// end the lanes are summed as `s_i = l_i + l_{i+8}`, `t_i = s_i + s_{i+4}`, `(t_0 + t_2) +
/// (t_1 + t_3)`, and `res += (s_w · s_x) · (sum · 2⁸)`.
fn bf16_lanes_reference(w: &Fp8Matrix, r0: usize, r1: usize, codes: &[f32], xs: &[f32], m: usize) -> Vec<f32> {
    let (k, bw) = (w.cols(), w.block()[1]);
    let nb = k.div_ceil(bw);
    let mut out = vec![0f32; (r1 - r0) * m];
    for r in r0..r1 {
        let wv: Vec<f32> = w.row(r).iter().map(|&b| e4m3_to_f32(b) / 256.0).collect();
        let sw = w.row_scales(r);
        for i in 0..m {
            let x = &codes[i * k..(i + 1) * k];
            let mut res = 0f32;
            for b in 0..nb {
                let mut lanes = [0f32; 16];
                for c in (b * bw..((b + 1) * bw).min(k)).step_by(32) {
                    for (l, lane) in lanes.iter_mut().enumerate() {
                        *lane += wv[c + 2 * l + 1] * x[c + 2 * l + 1];
                        *lane += wv[c + 2 * l] * x[c + 2 * l];
                    }
                }
                let s: [f32; 8] = std::array::from_fn(|j| lanes[j] + lanes[j + 8]);
                let t: [f32; 4] = std::array::from_fn(|j| s[j] + s[j + 4]);
                let part = ((t[0] + t[2]) + (t[1] + t[3])) * 256.0;
                res += sw[b] * xs[i * nb + b] * part;
            }
            out[(r - r0) * m + i] = res;
        }
    }
    out
}

#[test]
fn fp8_avx512_bf16_equals_its_lane_emulation_bitwise() {
    if !Fp8Kernel::Avx512Bf16.available() {
        return;
    }
    let mut r = rng(51);
    // The shapes above plus a row longer than the kernel's 1,024-column chunks, per channel
    // (a block spanning chunks) and in 128-wide blocks, and 32-wide blocks.
    let extra = [("channel-2080", 9, 2080, [1, 2080]), ("block128-2080", 10, 2080, [128, 128]), ("block32", 6, 128, [1, 32])];
    for (name, rows, cols, block) in SHAPES.into_iter().chain(extra) {
        let fm = random_matrix(&mut r, rows, cols, block);
        for m in [1, 2, 3, 4, 5, 9, 17] {
            let x = random_acts(&mut r, m, cols);
            let (codes, xs) = quantized(&x, cols, block[1]);
            for (r0, r1) in [(0, rows), (1, rows.min(8)), (rows / 2, rows)] {
                let got = rows_with(&fm, Fp8Kernel::Avx512Bf16, r0, r1, &x, m);
                let want = bf16_lanes_reference(&fm, r0, r1, &codes, &xs, m);
                for (e, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "{name} m={m} rows {r0}..{r1}, output {e}: {g} vs {w}");
                }
            }
        }
    }
}

fn forward(lin: &RowwiseLinear, x: &[f32], m: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; m * lin.rows()];
    lin.forward(x, m, &mut y, lin.rows());
    y
}

#[test]
fn fp8_every_kernel_is_batch_invariant_bitwise() {
    let mut r = rng(22);
    for (name, rows, cols, block) in SHAPES {
        let fm = random_matrix(&mut r, rows, cols, block);
        for kernel in kernels() {
            for m in [2, 5, 8, 13, 40] {
                let x = random_acts(&mut r, m, cols);
                let y = rows_with(&fm, kernel, 0, rows, &x, m);
                for (i, xi) in x.chunks_exact(cols).enumerate() {
                    let alone = rows_with(&fm, kernel, 0, rows, xi, 1);
                    for (j, a) in alone.iter().enumerate() {
                        assert_eq!(y[j * m + i].to_bits(), a.to_bits(), "{name} {kernel:?} m={m} token {i} row {j}");
                    }
                }
            }
        }
    }
}

#[test]
fn fp8_batch_invariance_bitwise() {
    let mut r = rng(21);
    for (name, rows, cols, block) in SHAPES {
        let w = rk(random_matrix(&mut r, rows, cols, block));
        for isa in isas() {
            let lin = RowwiseLinear::with_isa(w.clone(), ActQuant::Fp8PerToken, isa).expect("fp8 kernel");
            for m in [1, 2, 3, 5, 8, 13, 64, 100] {
                let x = random_acts(&mut r, m, cols);
                let y = forward(&lin, &x, m);
                for (i, (xi, yi)) in x.chunks_exact(cols).zip(y.chunks_exact(rows)).enumerate() {
                    let alone = forward(&lin, xi, 1);
                    for (j, (a, b)) in yi.iter().zip(&alone).enumerate() {
                        assert_eq!(a.to_bits(), b.to_bits(), "{name} {isa:?} m={m} token {i} row {j}: {a} in batch vs {b} alone");
                    }
                }
                // The same tokens in reverse order, among different neighbours.
                let rev: Vec<f32> = x.chunks_exact(cols).rev().flatten().copied().collect();
                let yr = forward(&lin, &rev, m);
                for (a, b) in y.chunks_exact(rows).zip(yr.chunks_exact(rows).rev()) {
                    assert!(a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits()), "{name} {isa:?} m={m} reversed batch");
                }
            }
        }
    }
}

/// Per output `(i, r)`: `A = Σ_c |W[r,c]|·|X[i,c]|` and the f64 reference `Σ_c W[r,c]·X[i,c]`,
/// with `W` from `dequantize_row` and `X` the activation codes times their scales.
fn reference(w: &Fp8Matrix, x: &[f32], m: usize) -> (Vec<f64>, Vec<f64>) {
    let (n, k, bw) = (w.rows(), w.cols(), w.block()[1]);
    let mut xd = vec![0f64; m * k];
    for (xi, xd) in x.chunks_exact(k).zip(xd.chunks_exact_mut(k)) {
        let (mut codes, mut scales) = (vec![0f32; k], vec![0f32; k.div_ceil(bw)]);
        quantize_fp8_row(xi, bw, &mut codes, &mut scales);
        for (c, v) in xd.iter_mut().enumerate() {
            *v = codes[c] as f64 * scales[c / bw] as f64; // exact: 4 x 24 significant bits
        }
    }
    let (mut refs, mut abs) = (vec![0f64; m * n], vec![0f64; m * n]);
    let mut row = vec![0f32; k];
    for j in 0..n {
        w.dequantize_row(j, &mut row);
        for (i, xi) in xd.chunks_exact(k).enumerate() {
            refs[i * n + j] = row.iter().zip(xi).map(|(&a, &b)| a as f64 * b).sum();
            abs[i * n + j] = row.iter().zip(xi).map(|(&a, &b)| (a as f64 * b).abs()).sum();
        }
    }
    (refs, abs)
}

fn gamma(n: usize) -> f64 {
    let u = f64::from(f32::EPSILON) / 2.0;
    n as f64 * u / (1.0 - n as f64 * u)
}

#[test]
fn fp8_matches_f64_reference_and_every_kernel_matches_scalar() {
    let mut r = rng(31);
    let u = f64::from(f32::EPSILON) / 2.0;
    for (name, rows, cols, block) in SHAPES {
        let fm = random_matrix(&mut r, rows, cols, block);
        let (bw, nb) = (block[1], cols.div_ceil(block[1]));
        let g = gamma(bw + nb + 2);
        for m in [1, 7, 64] {
            let x = random_acts(&mut r, m, cols);
            let (refs, abs) = reference(&fm, &x, m);
            let mut outs = Vec::new();
            for kernel in kernels() {
                // `[row][token]`, transposed to the reference's `[token][row]`.
                let t = rows_with(&fm, kernel, 0, rows, &x, m);
                let y: Vec<f32> = (0..m * rows).map(|e| t[(e % rows) * m + e / rows]).collect();
                for (e, ((&y, &rf), &a)) in y.iter().zip(&refs).zip(&abs).enumerate() {
                    let bound = (g + u) * a * 1.01;
                    assert!(a > 0.0, "{name}: zero product row");
                    assert!((y as f64 - rf).abs() <= bound, "{name} {kernel:?} m={m} out {e}: {y} vs f64 {rf} (bound {bound:e})");
                }
                outs.push((kernel, y));
            }
            let (_, s) = &outs[0];
            for (kernel, v) in &outs[1..] {
                for (e, ((&s, &v), &a)) in s.iter().zip(v).zip(&abs).enumerate() {
                    let bound = 2.0 * g * a * 1.01;
                    assert!(((s - v) as f64).abs() <= bound, "{name} m={m} out {e}: scalar {s} vs {kernel:?} {v} (bound {bound:e})");
                }
            }
        }
    }
}

#[test]
fn fp8_rows_fp8_tile_matches_forward() {
    // rows_fp8 on a sub-range of rows equals those rows of the full product, on each ISA.
    let mut r = rng(41);
    let (rows, cols, block) = (200, 256, [128, 128]);
    let fm = random_matrix(&mut r, rows, cols, block);
    let m = 5;
    let x = random_acts(&mut r, m, cols);
    let (mut codes, mut xs) = (vec![0f32; m * cols], vec![0f32; m * 2]);
    for ((xi, c), s) in x.chunks_exact(cols).zip(codes.chunks_exact_mut(cols)).zip(xs.chunks_exact_mut(2)) {
        quantize_fp8_row(xi, 128, c, s);
    }
    for isa in isas() {
        let lin = RowwiseLinear::with_isa(rk(fm.clone()), ActQuant::Fp8PerToken, isa).expect("fp8 kernel");
        let y = forward(&lin, &x, m);
        let (r0, r1) = (123, 133); // crosses the row-block boundary at 128
        let mut tile = vec![f32::NAN; (r1 - r0) * m];
        fm.rows_fp8(isa, r0, r1, &codes, &xs, m, &mut tile);
        for (j, vals) in tile.chunks_exact(m).enumerate() {
            for (i, v) in vals.iter().enumerate() {
                assert_eq!(v.to_bits(), y[i * rows + r0 + j].to_bits(), "{isa:?} row {} token {i}", r0 + j);
            }
        }
    }
}

#[test]
fn fp8_constructor_errors_are_clear() {
    let q = |n: usize| vec![0x38u8; n];
    let mut bad = q(4 * 64);
    bad[64 + 3] = 0xFF;
    let e = Fp8Matrix::new(4, 64, [1, 64], bad, vec![1.0; 4]).unwrap_err();
    assert!(e.contains("NaN code at row 1 column 3"), "{e}");
    let e = Fp8Matrix::new(4, 64, [1, 64], q(4 * 64), vec![1.0; 3]).unwrap_err();
    assert!(e.contains("3 scales, expected 4x1"), "{e}");
    let e = Fp8Matrix::new(200, 256, [128, 128], q(200 * 256), vec![1.0; 2]).unwrap_err();
    assert!(e.contains("2 scales, expected 2x2"), "{e}");
    let e = Fp8Matrix::new(4, 64, [1, 64], q(4 * 64), vec![1.0, f32::NAN, 1.0, 1.0]).unwrap_err();
    assert!(e.contains("non-finite scale"), "{e}");
    let e = Fp8Matrix::new(4, 64, [1, 64], q(100), vec![1.0; 4]).unwrap_err();
    assert!(e.contains("100 values for 4x64"), "{e}");
    let e = Fp8Matrix::new(4, 96, [1, 48], q(4 * 96), vec![1.0; 8]).unwrap_err();
    assert!(e.contains("block width 48"), "{e}");
    let e = Fp8Matrix::new(4, 64, [0, 64], q(4 * 64), vec![1.0]).unwrap_err();
    assert!(e.contains("block [0, 64] for 4x64"), "{e}");
    assert!(RowwiseLinear::with_isa(rk(Fp8Matrix::new(4, 64, [1, 64], q(256), vec![1.0; 4]).unwrap()), ActQuant::Int8PerToken, Isa::Scalar).is_err());
}
