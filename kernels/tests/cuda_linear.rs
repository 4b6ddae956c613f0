//! GPU matmul and embedding lookup over GGML-typed weights against the CPU's dequantization,
//! on random blocks (every code, random-signed scales) with NaN-poisoned outputs. Skips, saying
//! so, without a GPU.
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
