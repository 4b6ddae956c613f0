//! Every optimized kernel against the scalar reference on random data of awkward sizes.

#[allow(dead_code)] // shared helpers; the int4 ones serve the quantized-matrix tests
mod common;

use common::{assert_close, randn, random_weights, rng};
use tessera_kernels::cpu::dot::{axpy_f32, dot_f32, QuantDot, MULTI_TOKENS};
use tessera_kernels::cpu::Isa;
use tessera_kernels::ggml::act_quant::{quantize_q8, Q8Block};
use tessera_kernels::ggml::GgmlType;
use tessera_kernels::linear::{LinearKernel, LinearPolicy, WeightView};
use tessera_kernels::ops::Rope;
use tessera_kernels::reference;

fn simd_isas() -> Vec<Isa> {
    let isas: Vec<Isa> = [Isa::Avx2].into_iter().filter(|i| i.available()).collect();
    if isas.is_empty() {
        eprintln!("note: no SIMD ISA available on this CPU; only the scalar path is exercised");
    }
    isas
}

/// SIMD integer dots equal the scalar dot up to f32 summation order
/// (8-lane partial sums): relative 1e-5 of the sum of |terms|.
#[test]
fn quant_dot_simd_matches_scalar() {
    let mut r = rng(1);
    for q in [QuantDot::Q4_0, QuantDot::Q4_1, QuantDot::Q8_0] {
        let ty = match q {
            QuantDot::Q4_0 => GgmlType::Q4_0,
            QuantDot::Q4_1 => GgmlType::Q4_1,
            QuantDot::Q8_0 => GgmlType::Q8_0,
        };
        for k in [32, 64, 96, 544, 576, 1536, 32 * 37] {
            let w = random_weights(&mut r, ty, 1, k);
            let x = randn(&mut r, k);
            let mut a = vec![Q8Block::default(); k / 32];
            quantize_q8(&x, &mut a);
            let s = q.dot(Isa::Scalar, &w, &a);
            let scale: f32 = {
                let mut wf = vec![0f32; k];
                tessera_kernels::ggml::dequantize_row(ty, &w, &mut wf);
                wf.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum()
            };
            for isa in simd_isas() {
                let v = q.dot(isa, &w, &a);
                assert!((v - s).abs() <= 1e-5 * scale + 1e-6, "{} k={k} {:?}: {v} vs {s}", q.name(), isa);
            }
        }
    }
}

/// The multi-token and multi-row dots are bit-identical to the single dot for every row, at every ISA
/// and row count (what makes batched decode give the same tokens as decode alone).
#[test]
fn multi_token_dot_is_bit_identical_to_single() {
    let mut r = rng(8);
    for (q, ty) in [(QuantDot::Q4_0, GgmlType::Q4_0), (QuantDot::Q4_1, GgmlType::Q4_1), (QuantDot::Q8_0, GgmlType::Q8_0)] {
        for k in [32, 64, 96, 576] {
            let w = random_weights(&mut r, ty, 1, k);
            let acts: Vec<Vec<Q8Block>> = (0..MULTI_TOKENS)
                .map(|_| {
                    let mut a = vec![Q8Block::default(); k / 32];
                    quantize_q8(&randn(&mut r, k), &mut a);
                    a
                })
                .collect();
            for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
                for n in 1..=MULTI_TOKENS {
                    let w3: Vec<u8> = w.iter().chain(&w).chain(&w).copied().collect();
                    let mut rows_out = [f32::NAN; 3];
                    q.dot_rows(isa, &w3, &acts[0], &mut rows_out);
                    let single = q.dot(isa, &w, &acts[0]).to_bits();
                    assert!(rows_out.iter().all(|v| v.to_bits() == single), "{} {isa:?} dot_rows", q.name());
                    let refs: Vec<&[Q8Block]> = acts[..n].iter().map(|a| a.as_slice()).collect();
                    let mut out = vec![f32::NAN; n];
                    q.dot_multi(isa, &w, &refs, &mut out);
                    for (t, a) in refs.iter().enumerate() {
                        assert_eq!(out[t].to_bits(), q.dot(isa, &w, a).to_bits(), "{} {isa:?} k={k} n={n} row {t}", q.name());
                    }
                    // Three weight rows at once: out[row * n + t].
                    let mut out3 = vec![f32::NAN; 3 * n];
                    q.dot_multi_rows(isa, &w3, &refs, &mut out3);
                    for (i, v) in out3.iter().enumerate() {
                        assert_eq!(v.to_bits(), out[i % n].to_bits(), "{} {isa:?} k={k} n={n} dot_multi_rows", q.name());
                    }
                }
            }
        }
    }
}

/// The integer dot approximates the float dot within the activation quantization error:
/// per element at most d_a/2 = amax/254, so |error| <= Σ|w| · amax/254 per block.
#[test]
fn quant_dot_scalar_matches_float_reference() {
    let mut r = rng(2);
    for (q, ty) in [(QuantDot::Q4_0, GgmlType::Q4_0), (QuantDot::Q4_1, GgmlType::Q4_1), (QuantDot::Q8_0, GgmlType::Q8_0)] {
        let k = 576;
        let w = random_weights(&mut r, ty, 1, k);
        let x = randn(&mut r, k);
        let mut a = vec![Q8Block::default(); k / 32];
        quantize_q8(&x, &mut a);
        let mut wf = vec![0f32; k];
        tessera_kernels::ggml::dequantize_row(ty, &w, &mut wf);
        let exact: f64 = wf.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
        let bound: f64 = wf
            .chunks(32)
            .zip(x.chunks(32))
            .map(|(wb, xb)| {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                // Quantization error, plus the f16 rounding of d and s (2^-11 relative).
                wb.iter().map(|v| v.abs() as f64).sum::<f64>() * amax * (1.0 / 254.0 + 2.0 / 2048.0)
            })
            .sum();
        let got = q.dot(Isa::Scalar, &w, &a) as f64;
        assert!((got - exact).abs() <= bound, "{}: {got} vs {exact} (bound {bound})", q.name());
    }
}

#[test]
fn f32_axpy_simd_matches_scalar() {
    let mut r = rng(7);
    for n in [1, 7, 8, 9, 64, 67] {
        let x = randn(&mut r, n);
        let y0 = randn(&mut r, n);
        let mut want = y0.clone();
        axpy_f32(Isa::Scalar, 0.37, &x, &mut want);
        for isa in simd_isas() {
            let mut got = y0.clone();
            axpy_f32(isa, 0.37, &x, &mut got);
            // One FMA vs multiply-then-add: at most one rounding apart.
            assert_close(&got, &want, 1e-6, 1e-6, &format!("axpy n={n}"));
        }
    }
}

#[test]
fn f32_dot_simd_matches_scalar() {
    let mut r = rng(3);
    for n in [1, 7, 8, 31, 32, 33, 100, 576, 1537] {
        let a = randn(&mut r, n);
        let b = randn(&mut r, n);
        let s = dot_f32(Isa::Scalar, &a, &b);
        let mag: f32 = a.iter().zip(&b).map(|(x, y)| (x * y).abs()).sum();
        for isa in simd_isas() {
            let v = dot_f32(isa, &a, &b);
            assert!((v - s).abs() <= 1e-5 * mag, "n={n}: {v} vs {s}");
        }
    }
}

/// Every weight type (Q8_1 is an activation format only).
fn all_types() -> impl Iterator<Item = GgmlType> {
    GgmlType::ALL.into_iter().filter(|&t| t != GgmlType::Q8_1)
}

/// Both large-batch paths (the AVX2 dequantizing micro-kernel and the portable panel GEMM)
/// equal the f64 reference up to f32 accumulation: 1e-4 of the output's magnitude, for every
/// type, with partial micro-tiles (m % 6 != 0) and partial slivers (rows % 16 != 0).
#[test]
fn panel_gemm_matches_reference_for_every_type() {
    let mut r = rng(4);
    for ty in all_types() {
        let k = if ty.block_size() == 256 { 512 } else { 96 };
        for (rows, m) in [(1, 9), (17, 8), (70, 33), (150, 67)] {
            let w = random_weights(&mut r, ty, rows, k);
            let x = randn(&mut r, m * k);
            let want = reference::linear(ty, &w, rows, k, &x, m);
            let view = WeightView::new(ty, rows, k, &w).unwrap();
            for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
                let kern = LinearKernel::with_isa(ty, isa, LinearPolicy::ALWAYS_GEMM);
                let ldy = rows + 3;
                let mut y = vec![-7.0f32; m * ldy];
                kern.forward(&view, &x, m, &mut y, ldy);
                let got: Vec<f32> = y.chunks(ldy).flat_map(|r| r[..rows].to_vec()).collect();
                let mag = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                assert_close(&got, &want, 1e-4 * mag, 1e-4, &format!("{ty} {} gemm {rows}x{k} m={m}", kern.id()));
                assert!(y.chunks(ldy).all(|r| r[rows..].iter().all(|&v| v == -7.0)), "{ty}: wrote outside its columns");
            }
        }
    }
}

/// The small-batch path (quantized activations or dequant-dot) against the reference, at
/// every ISA, writing into a wider output (ldy > rows) whose other columns must be untouched.
#[test]
fn small_batch_path_matches_reference_for_every_type() {
    let mut r = rng(5);
    for ty in all_types() {
        let k = if ty.block_size() == 256 { 512 } else { 160 };
        let (rows, m, ldy) = (37, 3, 41);
        let w = random_weights(&mut r, ty, rows, k);
        let x = randn(&mut r, m * k);
        let want = reference::linear(ty, &w, rows, k, &x, m);
        let view = WeightView::new(ty, rows, k, &w).unwrap();
        for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
            let kern = LinearKernel::with_isa(ty, isa, LinearPolicy::ALWAYS_DOT);
            let mut y = vec![-7.0f32; m * ldy];
            kern.forward(&view, &x, m, &mut y, ldy);
            for i in 0..m {
                let got = &y[i * ldy..i * ldy + rows];
                let exp = &want[i * rows..(i + 1) * rows];
                // Int8 activations: error up to ~1% of the row magnitude (see the bound test above).
                let mag = exp.iter().fold(0f32, |a, v| a.max(v.abs()));
                let tol = if QuantDot::for_type(ty).is_some() { 2e-2 * mag } else { 1e-4 * mag };
                assert_close(got, exp, tol, 1e-4, &format!("{ty} {:?} token {i}", isa));
                assert!(y[i * ldy + rows..(i + 1) * ldy].iter().all(|&v| v == -7.0), "{ty}: wrote outside its columns");
            }
        }
    }
}

/// RoPE is a rotation: norms are kept, and q·k depends only on the position difference.
#[test]
fn rope_is_relative() {
    let mut r = rng(6);
    let (hd, rope) = (64, Rope::new(64, 10000.0));
    let q = randn(&mut r, hd);
    let k = randn(&mut r, hd);
    let rot = |v: &[f32], pos: usize| {
        let mut x = v.to_vec();
        rope.apply(&mut x, hd, &rope.table(std::iter::once(pos)));
        x
    };
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    let norm = |a: &[f32]| dot(a, a).sqrt();
    assert!((norm(&rot(&q, 123)) - norm(&q)).abs() < 1e-4 * norm(&q));
    let d1 = dot(&rot(&q, 10), &rot(&k, 3));
    let d2 = dot(&rot(&q, 107), &rot(&k, 100));
    assert!((d1 - d2).abs() < 1e-3 * norm(&q) * norm(&k), "{d1} vs {d2}");
    assert!((dot(&rot(&q, 0), &rot(&k, 0)) - dot(&q, &k)).abs() < 1e-5 * norm(&q) * norm(&k));
}

/// A check that the pairing is rotate-half (i, i + d/2), HF's layout, not interleaved.
#[test]
fn rope_pairs_first_and_second_half() {
    let (hd, rope) = (8, Rope::new(8, 10000.0));
    let mut x = vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    rope.apply(&mut x, hd, &rope.table(std::iter::once(1)));
    // Frequency 0 is 1 rad per position: element 0 rotates into element 4.
    assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[4] - 1f32.sin()).abs() < 1e-6, "{x:?}");
    assert!(x[1].abs() < 1e-7 && x[5].abs() < 1e-7);
}
