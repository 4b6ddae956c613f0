//! GPU matmul (GGML-typed weights, checkpoint int4 W4A16) and embedding lookup against the
//! CPU's dequantization, on random blocks and codes (every code, random-signed scales) with
//! NaN-poisoned outputs. Skips, saying so, without a GPU.
//!
//! Tolerances: the GPU multiplies the same dequantized weights in f32 with another summation
//! order (and FMA contraction): 1e-5 normwise relative to an f64 reference over the CPU's
//! dequantized values; the lookup is the dequantization itself, 1 ulp (FMA in `q·d + m`).

#[allow(dead_code)] // shared helpers; this file uses rng, randn, random_weights and assert_close
mod common;

use common::{assert_close, randn, random_weights, rng};
use tessera_kernels::cuda::linear::{embedding, matmul, DeviceWeight};
use tessera_kernels::cuda::test_device;
use tessera_kernels::ggml::{dequantize_row, GgmlType};

const TYPES: [GgmlType; 6] = [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0];

fn dequantized(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Vec<f32> {
    let rb = ty.row_bytes(cols).unwrap();
    let mut out = vec![0f32; rows * cols];
    for (r, o) in out.chunks_exact_mut(cols).enumerate() {
        dequantize_row(ty, &bytes[r * rb..(r + 1) * rb], o);
    }
    out
}

#[test]
fn matmul_matches_the_dequantized_weights_for_every_type_and_batch() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(11);
    for ty in TYPES {
        // Float types also get a partial last 32-block (k = 70).
        let shapes: &[(usize, usize)] = if ty.is_float() { &[(70, 70), (576, 192)] } else { &[(70, 96), (192, 576)] };
        for &(n, k) in shapes {
            let bytes = random_weights(&mut r, ty, n, k);
            let w = dequantized(ty, n, k, &bytes);
            let dw = DeviceWeight::from_ggml(&dev, ty, n, k, &bytes).unwrap();
            for m in [1, 3, 8, 9, 17] {
                let x = randn(&mut r, m * k);
                let gx = dev.stream().clone_htod(&x).unwrap();
                let mut y = dev.stream().clone_htod(&vec![f32::NAN; m * n]).unwrap();
                matmul(&dev, &dw, &gx.as_view(), m, &mut y.as_view_mut()).unwrap();
                dev.synchronize().unwrap();
                let got = dev.stream().clone_dtoh(&y).unwrap();
                let (mut num, mut den) = (0f64, 0f64);
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum();
                        assert!(got[i * n + j].is_finite(), "{} m={m}: y[{i},{j}] not written", ty.name());
                        num += (got[i * n + j] as f64 - want).powi(2);
                        den += want * want;
                    }
                }
                let err = (num / den).sqrt();
                assert!(err < 1e-5, "{} [{n}x{k}] m={m}: relative error {err}", ty.name());
            }
        }
    }
}

#[test]
fn a_row_is_the_same_alone_and_in_a_batch() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(12);
    let (n, k) = (64, 576);
    let dw = DeviceWeight::from_ggml(&dev, GgmlType::Q4_1, n, k, &random_weights(&mut r, GgmlType::Q4_1, n, k)).unwrap();
    let x = randn(&mut r, 13 * k);
    let run = |rows: &[f32], m: usize| {
        let gx = dev.stream().clone_htod(rows).unwrap();
        let mut y = dev.stream().clone_htod(&vec![f32::NAN; m * n]).unwrap();
        matmul(&dev, &dw, &gx.as_view(), m, &mut y.as_view_mut()).unwrap();
        dev.synchronize().unwrap();
        dev.stream().clone_dtoh(&y).unwrap()
    };
    let all = run(&x, 13);
    for i in [0, 7, 8, 12] {
        assert_eq!(run(&x[i * k..(i + 1) * k], 1), all[i * n..(i + 1) * n], "row {i}: batched result differs");
    }
}

#[test]
fn embedding_rows_are_the_dequantized_rows() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(13);
    for ty in TYPES {
        let (vocab, k) = (300, if ty.is_float() { 70 } else { 96 });
        let bytes = random_weights(&mut r, ty, vocab, k);
        let table = DeviceWeight::from_ggml(&dev, ty, vocab, k, &bytes).unwrap();
        let ids = [0i32, 299, 17, 17, 150];
        let gids = dev.stream().clone_htod(&ids).unwrap();
        let mut out = dev.stream().clone_htod(&vec![f32::NAN; ids.len() * k]).unwrap();
        embedding(&dev, &table, &gids, &mut out.as_view_mut()).unwrap();
        dev.synchronize().unwrap();
        let got = dev.stream().clone_dtoh(&out).unwrap();
        let all = dequantized(ty, vocab, k, &bytes);
        let want: Vec<f32> = ids.iter().flat_map(|&i| all[i as usize * k..(i as usize + 1) * k].to_vec()).collect();
        assert_close(&got, &want, 0.0, 2.0 * f32::EPSILON, ty.name());
    }
}

#[test]
fn unsupported_types_and_wrong_sizes_are_refused_at_upload() {
    let Some(dev) = test_device() else { return };
    let e = DeviceWeight::from_ggml(&dev, GgmlType::Q4K, 2, 256, &[0u8; 2 * 144]).err().unwrap().to_string();
    assert!(e.contains("Q4_K") && e.contains("not yet on CUDA"), "{e}");
    let e = DeviceWeight::from_ggml(&dev, GgmlType::Q4_1, 2, 64, &[0u8; 79]).err().unwrap().to_string();
    assert!(e.contains("79 bytes, expected 80"), "{e}");
}

#[test]
fn w4a16_matches_the_dequantized_int4_weights() {
    use rand::Rng;
    use tessera_kernels::quant::{ActQuant, Int4Matrix, QuantMatrix};
    let Some(dev) = test_device() else { return };
    let mut r = rng(14);
    // Group sizes incl. a ragged last group (128 over 576 columns) and per-channel (group >= cols).
    for (n, k, group, asym) in [(70usize, 96usize, 32usize, false), (64, 576, 128, true), (33, 576, 64, false), (40, 192, 192, true)] {
        let groups = k.div_ceil(group);
        let q: Vec<i8> = (0..n * k).map(|_| r.gen_range(-8..=7)).collect();
        let scales: Vec<f32> = (0..n * groups).map(|_| r.gen_range(0.001f32..0.05) * if r.gen() { 1.0 } else { -1.0 }).collect();
        let zeros = asym.then(|| (0..n * groups).map(|_| r.gen_range(-8..=7)).collect::<Vec<i8>>());
        let m4 = Int4Matrix::new(n, k, group, &q, scales, zeros).unwrap();
        let w: Vec<f32> = (0..n).flat_map(|row| {
            let mut out = vec![0f32; k];
            m4.dequantize_row(row, &mut out);
            out
        }).collect();
        let qm = QuantMatrix::Int4(m4);
        let dw = DeviceWeight::from_quant(&dev, &qm, ActQuant::F32).unwrap();
        assert_eq!((dw.storage(), dw.kernel_id()), (qm.storage(), "cuda.gemv.warp-per-row.w4a16".to_string()));
        for m in [1, 5, 17] {
            let x = randn(&mut r, m * k);
            let gx = dev.stream().clone_htod(&x).unwrap();
            let mut y = dev.stream().clone_htod(&vec![f32::NAN; m * n]).unwrap();
            matmul(&dev, &dw, &gx.as_view(), m, &mut y.as_view_mut()).unwrap();
            dev.synchronize().unwrap();
            let got = dev.stream().clone_dtoh(&y).unwrap();
            let (mut num, mut den) = (0f64, 0f64);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum();
                    assert!(got[i * n + j].is_finite(), "w4a16 y[{i},{j}] not written");
                    num += (got[i * n + j] as f64 - want).powi(2);
                    den += want * want;
                }
            }
            let err = (num / den).sqrt();
            assert!(err < 1e-5, "w4a16 [{n}x{k}] g{group} m={m}: relative error {err}");
        }
    }
    // A combination without a CUDA kernel is refused by name.
    let m8 = tessera_kernels::quant::Int8Matrix::new(2, 32, vec![1; 64], vec![0.1; 2]).unwrap();
    let e = DeviceWeight::from_quant(&dev, &QuantMatrix::Int8(m8), ActQuant::F32).err().unwrap().to_string();
    assert!(e.contains("int8 channel") && e.contains("not yet on CUDA"), "{e}");
}

#[test]
fn int8_activation_kernels_give_the_cpu_kernels_bits() {
    use rand::Rng;
    use tessera_kernels::cpu::Isa;
    use tessera_kernels::cuda::linear::quantize_activations;
    use tessera_kernels::quant::act::quantize_int8_row_scalar;
    use tessera_kernels::quant::{ActQuant, Int4Matrix, Int8Matrix, QuantLinear, QuantMatrix};
    let Some(dev) = test_device() else { return };
    let mut r = rng(15);
    let (n, k) = (48, 576);
    // Activations: random rows, an all-zero row, a row with one large outlier.
    let m = 6;
    let mut x = randn(&mut r, m * k);
    x[2 * k..3 * k].fill(0.0);
    x[4 * k + 17] = 900.0;
    let gx = dev.stream().clone_htod(&x).unwrap();

    let (gq, gs) = quantize_activations(&dev, &gx.as_view(), m, k).unwrap();
    dev.synchronize().unwrap();
    let (q, s) = (dev.stream().clone_dtoh(&gq).unwrap(), dev.stream().clone_dtoh(&gs).unwrap());
    for i in 0..m {
        let mut want = vec![0i8; k];
        let scale = quantize_int8_row_scalar(&x[i * k..(i + 1) * k], &mut want);
        assert_eq!(s[i].to_bits(), scale.to_bits(), "row {i} scale");
        assert_eq!(&q[i * k..(i + 1) * k], &want[..], "row {i} codes");
    }

    let q4: Vec<i8> = (0..n * k).map(|_| r.gen_range(-8..=7)).collect();
    let groups = k.div_ceil(128);
    let s4: Vec<f32> = (0..n * groups).map(|_| r.gen_range(0.001f32..0.05)).collect();
    let z4: Vec<i8> = (0..n * groups).map(|_| r.gen_range(-8..=7)).collect();
    let q8: Vec<i8> = (0..n * k).map(|_| r.gen()).collect();
    let s8: Vec<f32> = (0..n).map(|_| r.gen_range(0.001f32..0.02)).collect();
    let cases = [
        ("w4a8 g128 asym", QuantMatrix::Int4(Int4Matrix::new(n, k, 128, &q4, s4.clone(), Some(z4)).unwrap()), "cuda.gemv.dp4a.w4a8"),
        ("w4a8 channel", QuantMatrix::Int4(Int4Matrix::new(n, k, k, &q4, (0..n).map(|i| s4[i]).collect(), None).unwrap()), "cuda.gemv.dp4a.w4a8"),
        ("w8a8 int8", QuantMatrix::Int8(Int8Matrix::new(n, k, q8, s8).unwrap()), "cuda.gemv.dp4a.w8a8-int8"),
    ];
    for (what, qm, kernel) in cases {
        let dw = DeviceWeight::from_quant(&dev, &qm, ActQuant::Int8PerToken).unwrap();
        assert_eq!(dw.kernel_id(), kernel);
        let mut y = dev.stream().clone_htod(&vec![f32::NAN; m * n]).unwrap();
        matmul(&dev, &dw, &gx.as_view(), m, &mut y.as_view_mut()).unwrap();
        dev.synchronize().unwrap();
        let got = dev.stream().clone_dtoh(&y).unwrap();
        let mut want = vec![0f32; m * n];
        QuantLinear::with_isa(qm, ActQuant::Int8PerToken, Isa::Scalar).unwrap().forward(&x, m, &mut want, n);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "{what}: GPU and CPU differ");
    }
}
