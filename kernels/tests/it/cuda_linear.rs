//! CUDA matmul and embedding kernels (`linear::cuda`) against the CPU. Needs a GPU: every test
//! prints `skipped: ...` and passes where the driver or a device is missing (CI compiles the
//! kernels in `cuda_compile.rs` instead).
//!
//! Tolerances:
//! - f32-math paths (GGUF types, W4A16, FP8 after its exact products): per element
//!   `|gpu - ref| <= 2 (K + 8) u Σ_k |w x|` with `u = 2^-24` and `ref` the f64 product of the
//!   same (CPU-dequantized) values: the worst-case bound of a K-term f32 dot product with a few
//!   extra roundings (scale products, FMA contraction and any summation order), so it holds
//!   whatever order the GPU sums in, yet is ~1e-5 relative for these K, far below a wrong
//!   index or a wrong scale.
//! - integer paths (W4A8, W8A8 int8): equal to the CPU's scalar `RowwiseLinear` (exact int32 sums,
//!   the same f32 epilogue operations), and the activation codes and scales bit-identical.
//! - embedding: bit-identical to `ggml::dequantize_row`.
//!
//! Outputs are poisoned with NaN before each launch and checked fully written.

use crate::common;

use common::{int4, randn, random_weights, rng, scale};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use tessera_kernels::cpu::Isa;
use tessera_kernels::linear::cuda::{embedding, matmul, matmul_dequant_gemm, matmul_direct, matmul_with, quantize_fp8_rows, quantize_int8_rows, ActScratch, DeviceWeight};
use tessera_kernels::cuda::{test_device, CudaDevice};
use tessera_kernels::ggml::{dequantize_row, GgmlType};
use tessera_kernels::linear::act::{quantize_fp8_row, quantize_int8_row_scalar};
use tessera_kernels::e4m3::e4m3_to_f32;
use tessera_kernels::linear::{ActQuant, RowKernel, Fp8Matrix, Int8Matrix, RowwiseLinear};
use std::sync::Arc;

/// A row-kernel matrix behind the trait object the driver takes.
fn rk(m: impl RowKernel) -> Arc<dyn RowKernel> {
    Arc::new(m)
}

const TOKENS: [usize; 7] = [1, 2, 3, 8, 17, 64, 257];

/// Which entry point a test runs.
#[derive(Clone, Copy, Debug)]
enum Path {
    /// `matmul` (the batch size picks).
    Auto,
    /// `matmul_direct` (the per-format kernel).
    Kernel,
    /// `matmul_dequant_gemm` (dequantize to f32, cuBLAS SGEMM).
    DequantGemm,
}

/// `matmul` on the GPU into a NaN-poisoned output; asserts every output was written.
fn gpu_matmul(dev: &CudaDevice, w: &DeviceWeight, x: &[f32], m: usize) -> Vec<f32> {
    gpu_matmul_by(dev, w, x, m, Path::Auto)
}

/// [`gpu_matmul`] through the entry point `path`.
fn gpu_matmul_by(dev: &CudaDevice, w: &DeviceWeight, x: &[f32], m: usize, path: Path) -> Vec<f32> {
    let s = dev.stream();
    let xd = s.clone_htod(x).unwrap();
    let mut yd = s.clone_htod(&vec![f32::NAN; m * w.rows()]).unwrap();
    {
        let (xv, mut yv) = (xd.slice(..), yd.slice_mut(..));
        match path {
            Path::Auto => matmul(dev, w, &xv, m, &mut yv),
            Path::Kernel => matmul_direct(dev, w, &xv, m, &mut yv),
            Path::DequantGemm => matmul_dequant_gemm(dev, w, &xv, m, &mut yv),
        }
        .unwrap();
    }
    dev.synchronize().unwrap();
    let y = s.clone_dtoh(&yd).unwrap();
    if let Some(i) = y.iter().position(|v| !v.is_finite()) {
        panic!("{}: output {i} (token {}, row {}) not written: {}", w.kernel_id(), i / w.rows(), i % w.rows(), y[i]);
    }
    y
}

/// Checks `y` (`[m, n]`) against the f64 product of `x` (`[m, k]`) and the dequantized rows
/// `wd` (`[n, k]`), with the f32 dot-product bound of the module docs.
fn check_f32_math(y: &[f32], x: &[f32], wd: &[f32], m: usize, n: usize, k: usize, what: &str) {
    let u = 2f64.powi(-24);
    for i in 0..m {
        for j in 0..n {
            let (xr, wr) = (&x[i * k..(i + 1) * k], &wd[j * k..(j + 1) * k]);
            let exact: f64 = xr.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = xr.iter().zip(wr).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            let got = y[i * n + j] as f64;
            let bound = 2.0 * (k as f64 + 8.0) * u * mag + 1e-30;
            assert!((got - exact).abs() <= bound, "{what}: m {m} token {i} row {j}: {got} vs {exact} (bound {bound:e})");
        }
    }
}

fn dequantized_ggml(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Vec<f32> {
    let rb = ty.row_bytes(cols).unwrap();
    let mut out = vec![0f32; rows * cols];
    for (o, src) in out.chunks_exact_mut(cols).zip(data.chunks_exact(rb)) {
        dequantize_row(ty, src, o);
    }
    out
}

fn dequantized_quant(w: &Arc<dyn RowKernel>) -> Vec<f32> {
    let (rows, cols) = (w.rows(), w.cols());
    let mut out = vec![0f32; rows * cols];
    for (r, o) in out.chunks_exact_mut(cols).enumerate() {
        w.dequantize_row(r, o);
    }
    out
}

#[test]
fn ggml_matmul_matches_f64_reference() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(1);
    let types = [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0];
    for ty in types {
        // K not a multiple of 64 (blocks) or of 8 (float types' vector path), N not a multiple of 8.
        let shapes: &[(usize, usize)] = if ty.is_float() { &[(37, 100), (13, 96), (5, 1)] } else { &[(37, 544), (9, 32)] };
        for &(n, k) in shapes {
            let data = random_weights(&mut r, ty, n, k);
            let wd = dequantized_ggml(ty, n, k, &data);
            let w = DeviceWeight::from_ggml(&dev, ty, n, k, &data).unwrap();
            assert_eq!((w.rows(), w.cols(), w.storage()), (n, k, ty.name().to_string()));
            // Block types have both paths; each is checked at every batch size.
            let paths: &[Path] = if ty.is_float() { &[Path::Auto] } else { &[Path::Kernel, Path::DequantGemm] };
            for m in TOKENS {
                let x = randn(&mut r, m * k);
                for &path in paths {
                    let y = gpu_matmul_by(&dev, &w, &x, m, path);
                    check_f32_math(&y, &x, &wd, m, n, k, &format!("{} {path:?} {n}x{k}", w.kernel_id()));
                }
            }
        }
    }
}

#[test]
fn ggml_refuses_types_without_a_kernel() {
    let Some(dev) = test_device() else { return };
    let data = vec![0u8; GgmlType::Q4K.row_bytes(256).unwrap()];
    let err = DeviceWeight::from_ggml(&dev, GgmlType::Q4K, 1, 256, &data).err().expect("Q4_K has no kernel").to_string();
    assert!(err.contains("Q4_K"), "{err}");
    assert!(DeviceWeight::from_ggml(&dev, GgmlType::Q8_0, 2, 32, &[0; 33]).is_err(), "short data");
}

#[test]
fn embedding_gathers_rows_exactly() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(2);
    for ty in [GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::Q4_0, GgmlType::F16, GgmlType::BF16, GgmlType::F32] {
        let (rows, cols) = (23, 96);
        let data = random_weights(&mut r, ty, rows, cols);
        let wd = dequantized_ggml(ty, rows, cols, &data);
        let table = DeviceWeight::from_ggml(&dev, ty, rows, cols, &data).unwrap();
        let mut ids: Vec<i32> = (0..40).map(|_| r.gen_range(0..rows as i32)).collect();
        ids.extend([-1, rows as i32, i32::MAX, 0, rows as i32 - 1]);
        let s = dev.stream();
        let idd = s.clone_htod(&ids).unwrap();
        let mut out = s.clone_htod(&vec![f32::NAN; ids.len() * cols]).unwrap();
        embedding(&dev, &table, &idd, &mut out.slice_mut(..)).unwrap();
        dev.synchronize().unwrap();
        let out = s.clone_dtoh(&out).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            let got = &out[i * cols..(i + 1) * cols];
            if (0..rows as i32).contains(&id) {
                let want = &wd[id as usize * cols..(id as usize + 1) * cols];
                assert!(got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "{ty} id {id}");
            } else {
                assert!(got.iter().all(|&v| v == 0.0), "{ty} out-of-range id {id} gives zeros");
            }
        }
    }
}



/// Int4 layouts: groups of 32, 128 (544 = 4 × 128 + a short 32) and per channel; sym and asym.
fn int4_cases(r: &mut ChaCha8Rng) -> Vec<Arc<dyn RowKernel>> {
    let mut v = Vec::new();
    for group in [32, 128, 4096] {
        for asym in [false, true] {
            v.push(rk(int4(r, 37, 544, group, asym)));
        }
    }
    v
}

/// Activations with an all-zero row and a row of exact rounding ties (scale 1).
fn activations(r: &mut ChaCha8Rng, m: usize, k: usize) -> Vec<f32> {
    let mut x = randn(r, m * k);
    if m >= 3 {
        x[k..2 * k].fill(0.0);
        for (c, v) in x[2 * k..3 * k].iter_mut().enumerate() {
            *v = if c == 0 { 127.0 } else { (c % 200) as f32 - 100.5 };
        }
    }
    x
}

fn cpu_forward(w: &Arc<dyn RowKernel>, act: ActQuant, x: &[f32], m: usize) -> Vec<f32> {
    let lin = RowwiseLinear::with_isa(w.clone(), act, Isa::Scalar).unwrap();
    let mut y = vec![0f32; m * w.rows()];
    lin.forward(x, m, &mut y, w.rows());
    y
}

#[test]
fn w4a16_matches_f64_reference() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(3);
    for wq in int4_cases(&mut r) {
        let (n, k) = (wq.rows(), wq.cols());
        let wd = dequantized_quant(&wq);
        let w = wq.upload(&dev, ActQuant::F32).unwrap();
        assert_eq!(w.kernel_id(), "cuda.w4a16.int4xf32");
        for m in TOKENS {
            let x = activations(&mut r, m, k);
            for path in [Path::Kernel, Path::DequantGemm] {
                let y = gpu_matmul_by(&dev, &w, &x, m, path);
                check_f32_math(&y, &x, &wd, m, n, k, &format!("w4a16 {path:?} {}", wq.storage()));
            }
        }
    }
}

#[test]
fn int8_activation_quantization_is_bit_exact() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(4);
    for (m, k) in [(1, 32), (3, 544), (17, 4128), (64, 96)] {
        let x = activations(&mut r, m, k);
        let s = dev.stream();
        let xd = s.clone_htod(&x).unwrap();
        let mut q = s.clone_htod(&vec![0x55u8; m * k]).unwrap();
        let mut sc = s.clone_htod(&vec![f32::NAN; m]).unwrap();
        quantize_int8_rows(&dev, &xd.slice(..), m, k, &mut q.slice_mut(..), &mut sc.slice_mut(..)).unwrap();
        dev.synchronize().unwrap();
        let (q, sc) = (s.clone_dtoh(&q).unwrap(), s.clone_dtoh(&sc).unwrap());
        for i in 0..m {
            let mut want = vec![0i8; k];
            let ws = quantize_int8_row_scalar(&x[i * k..(i + 1) * k], &mut want);
            assert_eq!(sc[i].to_bits(), ws.to_bits(), "scale of token {i}");
            let got: Vec<i8> = q[i * k..(i + 1) * k].iter().map(|&b| b as i8).collect();
            assert_eq!(got, want, "codes of token {i} ({m}x{k})");
        }
    }
}

#[test]
fn fp8_activation_quantization_is_bit_exact() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(5);
    for (m, k, bw) in [(1, 32, 32), (3, 544, 128), (17, 544, 544), (8, 96, 64)] {
        let mut x = activations(&mut r, m, k);
        x[0] = 1e-9; // a tiny value: rounds to zero next to the row maximum
        let nb = k.div_ceil(bw);
        let s = dev.stream();
        let xd = s.clone_htod(&x).unwrap();
        let mut q = s.clone_htod(&vec![0x7fu8; m * k]).unwrap();
        let mut sc = s.clone_htod(&vec![f32::NAN; m * nb]).unwrap();
        quantize_fp8_rows(&dev, &xd.slice(..), m, k, bw, &mut q.slice_mut(..), &mut sc.slice_mut(..)).unwrap();
        dev.synchronize().unwrap();
        let (q, sc) = (s.clone_dtoh(&q).unwrap(), s.clone_dtoh(&sc).unwrap());
        for i in 0..m {
            let (mut codes, mut scales) = (vec![0f32; k], vec![0f32; nb]);
            quantize_fp8_row(&x[i * k..(i + 1) * k], bw, &mut codes, &mut scales);
            for b in 0..nb {
                assert_eq!(sc[i * nb + b].to_bits(), scales[b].to_bits(), "scale of token {i} block {b}");
            }
            for c in 0..k {
                assert_eq!(e4m3_to_f32(q[i * k + c]), codes[c], "code of token {i} column {c} (x {})", x[i * k + c]);
            }
        }
    }
}

/// Integer-accumulating paths: equal to the CPU's scalar `RowwiseLinear` (same int32 sums, same
/// f32 epilogue operations), for every batch size and layout.
#[test]
fn int8_activation_matmuls_equal_the_cpu() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(6);
    let mut cases: Vec<(Arc<dyn RowKernel>, &str)> = int4_cases(&mut r).into_iter().map(|w| (w, "cuda.w4a8.int4xint8.dp4a")).collect();
    for (n, k) in [(37, 544), (9, 4128)] {
        let q: Vec<i8> = (0..n * k).map(|_| r.gen_range(-128..=127)).collect();
        let scales = (0..n).map(|_| scale(&mut r)).collect();
        cases.push((rk(Int8Matrix::new(n, k, q, scales).unwrap()), "cuda.w8a8.int8xint8.dp4a"));
    }
    for (wq, id) in cases {
        let w = wq.upload(&dev, ActQuant::Int8PerToken).unwrap();
        assert_eq!(w.kernel_id(), id);
        for m in TOKENS {
            let x = activations(&mut r, m, wq.cols());
            let y = gpu_matmul(&dev, &w, &x, m);
            let want = cpu_forward(&wq, ActQuant::Int8PerToken, &x, m);
            for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                assert!(a == b, "{id} {} m {m}: output {i}: gpu {a} cpu {b}", wq.storage());
            }
        }
    }
}

fn fp8_matrix(r: &mut ChaCha8Rng, rows: usize, cols: usize, block: [usize; 2]) -> Fp8Matrix {
    let q = (0..rows * cols)
        .map(|_| loop {
            let b: u8 = r.gen();
            if b & 0x7f != 0x7f {
                break b;
            }
        })
        .collect();
    let n = rows.div_ceil(block[0]) * cols.div_ceil(block[1]);
    Fp8Matrix::new(rows, cols, block, q, (0..n).map(|_| scale(r) * 0.01).collect()).unwrap()
}

#[test]
fn fp8_matmul_matches_reference_and_cpu() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(7);
    let (n, k) = (37, 544);
    for block in [[n, k], [1, k], [16, 128], [128, 64]] {
        let wq = rk(fp8_matrix(&mut r, n, k, block));
        let wd = dequantized_quant(&wq);
        let w = wq.upload(&dev, ActQuant::Fp8PerToken).unwrap();
        assert_eq!(w.kernel_id(), "cuda.w8a8.fp8xfp8");
        let bw = block[1].min(k);
        let nb = k.div_ceil(bw);
        for m in TOKENS {
            let x = activations(&mut r, m, k);
            let y = gpu_matmul(&dev, &w, &x, m);
            // Reference input: the CPU's quantized activations (bit-identical to the GPU's).
            let mut xq = vec![0f32; m * k];
            for (xi, qi) in x.chunks_exact(k).zip(xq.chunks_exact_mut(k)) {
                let mut scales = vec![0f32; nb];
                quantize_fp8_row(xi, bw, qi, &mut scales);
                for (b, c) in qi.chunks_mut(bw).enumerate() {
                    c.iter_mut().for_each(|v| *v *= scales[b]);
                }
            }
            check_f32_math(&y, &xq, &wd, m, n, k, &format!("fp8 {}", wq.storage()));
            let cpu = cpu_forward(&wq, ActQuant::Fp8PerToken, &x, m);
            check_f32_math(&cpu, &xq, &wd, m, n, k, "cpu fp8 (same bound)");
        }
    }
}

#[test]
fn shared_scratch_and_refusals() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(8);
    let wq = rk(int4(&mut r, 16, 64, 32, true));
    let w = wq.upload(&dev, ActQuant::Int8PerToken).unwrap();
    let (m, k) = (5, 64);
    let x = randn(&mut r, m * k);
    let s = dev.stream();
    let xd = s.clone_htod(&x).unwrap();
    let mut yd = s.clone_htod(&vec![f32::NAN; m * 16]).unwrap();
    let mut small = ActScratch::new(&dev, 4, 64).unwrap();
    assert!(matmul_with(&dev, &w, &xd.slice(..), m, &mut yd.slice_mut(..), &mut small).is_err(), "scratch too small");
    let mut scratch = ActScratch::new(&dev, 8, 128).unwrap();
    matmul_with(&dev, &w, &xd.slice(..), m, &mut yd.slice_mut(..), &mut scratch).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(s.clone_dtoh(&yd).unwrap(), cpu_forward(&wq, ActQuant::Int8PerToken, &x, m));
    // Misaligned activations, wrong lengths and pairs without a kernel are refused.
    let mut y1 = s.clone_htod(&vec![0f32; 16]).unwrap();
    assert!(matmul(&dev, &w, &xd.slice(1..65), 1, &mut y1.slice_mut(..)).is_err(), "misaligned x");
    assert!(matmul(&dev, &w, &xd.slice(..63), 1, &mut y1.slice_mut(..)).is_err(), "short x");
    assert!(wq.upload(&dev, ActQuant::Fp8PerToken).is_err());
    let table = wq.upload(&dev, ActQuant::F32).unwrap();
    let ids = s.clone_htod(&[0i32]).unwrap();
    assert!(embedding(&dev, &table, &ids, &mut y1.slice_mut(..)).is_err(), "quantized tables are GGUF-only");
}
