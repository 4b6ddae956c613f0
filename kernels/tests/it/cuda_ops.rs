//! The elementwise CUDA kernels (RMSNorm + residual, RoPE, SwiGLU, argmax) against the CPU ops
//! they replace, on random inputs with NaN-poisoned outputs. Skips, saying so, without a GPU.
//!
//! Tolerances: both sides compute in f32; the GPU sums in a different order (block reductions)
//! and uses its own `expf`/`rsqrtf`, so results agree to a few ulps: 1e-5 relative per element
//! (norm), 2e-6 absolute (RoPE of N(0,1) values), 1e-5 relative (SwiGLU).

use crate::common;

use common::{assert_close, randn, rng};
use tessera_kernels::cuda::{ops, test_device, CudaDevice};
use tessera_kernels::ops::{rms_norm, silu_mul, Rope};

fn upload(dev: &CudaDevice, v: &[f32]) -> cudarc::driver::CudaSlice<f32> {
    dev.stream().clone_htod(v).unwrap()
}

fn poisoned(dev: &CudaDevice, n: usize) -> cudarc::driver::CudaSlice<f32> {
    upload(dev, &vec![f32::NAN; n])
}

fn download(dev: &CudaDevice, s: &cudarc::driver::CudaSlice<f32>) -> Vec<f32> {
    dev.synchronize().unwrap();
    dev.stream().clone_dtoh(s).unwrap()
}

#[test]
fn rms_norm_with_and_without_residual() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(1);
    for (rows, d) in [(1, 576), (5, 576), (3, 4096), (2, 70)] {
        let x = randn(&mut r, rows * d);
        let res = randn(&mut r, rows * d);
        let w = randn(&mut r, d);
        let (mut gx, gw, gr) = (upload(&dev, &x), upload(&dev, &w), upload(&dev, &res));
        let mut out = poisoned(&dev, rows * d);
        ops::rms_norm(&dev, &mut gx, None, &gw, 1e-5, &mut out).unwrap();
        let mut want = vec![0f32; rows * d];
        rms_norm(&x, &w, 1e-5, &mut want);
        assert_close(&download(&dev, &out), &want, 1e-6, 1e-5, "rms_norm");

        ops::rms_norm(&dev, &mut gx, Some(&gr), &gw, 1e-5, &mut out).unwrap();
        let h: Vec<f32> = x.iter().zip(&res).map(|(a, b)| a + b).collect();
        rms_norm(&h, &w, 1e-5, &mut want);
        assert_close(&download(&dev, &out), &want, 1e-6, 1e-5, "rms_norm+residual");
        assert_close(&download(&dev, &gx), &h, 0.0, 0.0, "residual stream");
    }
}

#[test]
fn rope_matches_cpu() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(2);
    for (heads, hd, rot, positions) in [(9, 64, 64, vec![0usize, 1, 7, 8191]), (4, 128, 64, vec![3, 4000])] {
        let rope = Rope::new(rot, 100_000.0);
        let table = rope.table(positions.iter().copied());
        let half = rope.half_dim();
        let flat: Vec<f32> = table.iter().flat_map(|&(s, c)| [s, c]).collect();
        let x = randn(&mut r, positions.len() * heads * hd);
        let mut gx = upload(&dev, &x);
        ops::rope(&dev, &mut gx, &upload(&dev, &flat), heads, hd, half).unwrap();
        let mut want = x.clone();
        for (t, row) in want.chunks_exact_mut(heads * hd).enumerate() {
            rope.apply(row, hd, &table[t * half..(t + 1) * half]);
        }
        assert_close(&download(&dev, &gx), &want, 2e-6, 0.0, "rope");
    }
}

#[test]
fn silu_mul_matches_cpu() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(3);
    let (rows, n) = (3, 1536);
    let (g, u) = (randn(&mut r, rows * n), randn(&mut r, rows * n));
    let mut out = poisoned(&dev, rows * n);
    ops::silu_mul(&dev, &upload(&dev, &g), &upload(&dev, &u), &mut out).unwrap();
    let gu: Vec<f32> = (0..rows).flat_map(|i| g[i * n..(i + 1) * n].iter().chain(&u[i * n..(i + 1) * n]).copied()).collect();
    let mut want = vec![0f32; rows * n];
    silu_mul(&gu, n, &mut want);
    assert_close(&download(&dev, &out), &want, 1e-7, 1e-5, "silu_mul");
}

#[test]
fn argmax_takes_the_lowest_index_on_ties() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(4);
    let (rows, n) = (4, 49152);
    let mut l = randn(&mut r, rows * n);
    // Row 1: a tie between two positions; row 2: the maximum at the last index; row 3: NaNs.
    l[n + 100] = 50.0;
    l[n + 40000] = 50.0;
    l[3 * n - 1] = 60.0;
    for v in l[3 * n..3 * n + 1000].iter_mut() {
        *v = f32::NAN;
    }
    let mut out = dev.stream().clone_htod(&vec![-1i32; rows]).unwrap();
    ops::argmax_rows(&dev, &upload(&dev, &l), n, &mut out).unwrap();
    dev.synchronize().unwrap();
    let got = dev.stream().clone_dtoh(&out).unwrap();
    for (i, row) in l.chunks_exact(n).enumerate() {
        let want = row.iter().enumerate().filter(|(_, v)| !v.is_nan()).fold((0usize, f32::NEG_INFINITY), |b, (j, &v)| if v > b.1 { (j, v) } else { b }).0;
        assert_eq!(got[i] as usize, want, "row {i}");
    }
    assert_eq!(got[1], 100, "tie goes to the lowest index");
}

#[test]
fn shape_errors_are_reported_not_launched() {
    let Some(dev) = test_device() else { return };
    let x = upload(&dev, &[1.0; 10]);
    let mut out = poisoned(&dev, 9);
    let up = upload(&dev, &[1.0; 10]);
    assert!(ops::silu_mul(&dev, &x, &up, &mut out).unwrap_err().to_string().contains("silu_mul"));
}

/// `‖got − want‖ / ‖want‖` against an f64 `x · Wᵀ`.
fn gemm_rel_err(got: &[f32], x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for i in 0..m {
        for j in 0..n {
            let r: f64 = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum();
            num += (got[i * n + j] as f64 - r).powi(2);
            den += r * r;
        }
    }
    (num / den).sqrt()
}

#[test]
fn cublas_gemms_are_row_major_linear_layers() {
    let Some(dev) = test_device() else { return };
    let mut r = rng(5);
    // Non-square, non-symmetric shapes catch a wrong transpose or leading dimension.
    for (m, n, k) in [(1, 70, 96), (3, 192, 576), (33, 128, 64)] {
        let (x, w) = (randn(&mut r, m * k), randn(&mut r, n * k));
        let mut y = poisoned(&dev, m * n);
        tessera_kernels::cuda::blas::gemm_f32(&dev, &upload(&dev, &x).as_view(), &upload(&dev, &w).as_view(), m, n, k, &mut y.as_view_mut()).unwrap();
        // SGEMM without TF32 (cuBLAS's default math mode): f32 rounding only.
        let err = gemm_rel_err(&download(&dev, &y), &x, &w, m, n, k);
        assert!(err < 1e-5, "f32 {m}x{n}x{k}: {err}");

        let to_bf16 = |v: &[f32]| v.iter().map(|&a| half::bf16::from_f32(a)).collect::<Vec<_>>();
        let (xb, wb) = (to_bf16(&x), to_bf16(&w));
        let (xr, wr): (Vec<f32>, Vec<f32>) = (xb.iter().map(|v| v.to_f32()).collect(), wb.iter().map(|v| v.to_f32()).collect());
        let mut y = poisoned(&dev, m * n);
        let (gx, gw) = (dev.stream().clone_htod(&xb).unwrap(), dev.stream().clone_htod(&wb).unwrap());
        tessera_kernels::cuda::blas::gemm_bf16(&dev, &gx.as_view(), &gw.as_view(), m, n, k, &mut y.as_view_mut()).unwrap();
        // Products of bf16 values are exact in f32; only the f32 sums round.
        let err = gemm_rel_err(&download(&dev, &y), &xr, &wr, m, n, k);
        assert!(err < 1e-5, "bf16 {m}x{n}x{k}: {err}");
    }
    let e = tessera_kernels::cuda::blas::gemm_f32(&dev, &upload(&dev, &[1.0; 6]).as_view(), &upload(&dev, &[1.0; 6]).as_view(), 2, 2, 2, &mut poisoned(&dev, 4).as_view_mut());
    assert!(e.unwrap_err().to_string().contains("gemm"));
}
