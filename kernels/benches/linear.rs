//! Linear-layer paths on a Q4_1 1536x576 matrix (SmolLM2's gate/up shape, interleaved as the
//! engine stores it) at several batch sizes: the int8-activation integer GEMM, the AVX2 dequantizing micro-kernel, and the
//! portable gemm-crate panel path. This is the data behind `LinearPolicy::DEFAULT`'s switch.
//! Then the integer GEMV of every interleaved GGUF type on 8192x2048 matrices (a 1B model's
//! FFN gate/up), cycling over enough of them (> 64 MiB) that the weights stream from DRAM as
//! in decode: throughput in bytes of weights per second.
//! Run: `cargo bench -p tessera-kernels --bench linear`.

#![allow(missing_docs)] // criterion's macros generate undocumented functions

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tessera_kernels::cpu::Isa;
use tessera_kernels::ggml::quantize::quantize_row;
use tessera_kernels::ggml::GgmlType;
use tessera_kernels::linear::ggml::interleaved::Interleaved;
use tessera_kernels::cpu::CpuCaps;
use tessera_kernels::linear::ggml::{LinearKernel, Weight, WeightView};
use tessera_kernels::linear::LinearPolicy;

/// Random Q4_1 blocks with realistic scales and mins.
fn q4_1_weights(r: &mut ChaCha8Rng, rows: usize, cols: usize) -> Vec<u8> {
    let mut b: Vec<u8> = (0..rows * cols / 32 * 20).map(|_| r.gen()).collect();
    for blk in b.chunks_exact_mut(20) {
        blk[0..2].copy_from_slice(&half::f16::from_f32(r.gen_range(0.01..0.1)).to_le_bytes());
        blk[2..4].copy_from_slice(&half::f16::from_f32(r.gen_range(-0.5..0.0)).to_le_bytes());
    }
    b
}

/// Every path at every batch size.
fn linear(c: &mut Criterion) {
    let (rows, cols) = (1536, 576);
    let mut r = ChaCha8Rng::seed_from_u64(1);
    let w = q4_1_weights(&mut r, rows, cols);
    let view = WeightView::new(GgmlType::Q4_1, rows, cols, &w).unwrap();
    let packed = Interleaved::pack(&view).unwrap();
    let mut paths = vec![("gemm-crate", LinearKernel::with_isa(GgmlType::Q4_1, Isa::Scalar, LinearPolicy::ALWAYS_GEMM))];
    if Isa::Avx2.available() {
        paths.push(("int8-dot", LinearKernel::with_isa(GgmlType::Q4_1, Isa::Avx2, LinearPolicy::ALWAYS_DOT)));
        paths.push(("sgemm-6x16", LinearKernel::with_isa(GgmlType::Q4_1, Isa::Avx2, LinearPolicy::ALWAYS_GEMM)));
    }
    let mut g = c.benchmark_group("q4_1_1536x576");
    g.sample_size(10).measurement_time(std::time::Duration::from_secs(2));
    for m in [1usize, 4, 8, 16, 32, 64, 512] {
        let x: Vec<f32> = (0..m * cols).map(|_| r.gen_range(-1.0..1.0)).collect();
        let mut y = vec![0f32; m * rows];
        g.throughput(Throughput::Elements((m * rows * cols) as u64));
        for (name, k) in &paths {
            g.bench_with_input(BenchmarkId::new(*name, m), &m, |b, &m| b.iter(|| k.forward(Weight::Interleaved(&packed), &x, m, &mut y, rows)));
        }
    }
    g.finish();
}

/// The integer GEMV (and an 8-token GEMM) per interleaved type, weights streaming from DRAM.
fn gemv_bandwidth(c: &mut Criterion) {
    let (rows, cols) = (8192, 2048);
    let isa = CpuCaps::detect().best_isa();
    let mut r = ChaCha8Rng::seed_from_u64(2);
    let mut g = c.benchmark_group("gemv_8192x2048");
    g.sample_size(10).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q2K, GgmlType::Q3K, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        let row_bytes = ty.row_bytes(cols).unwrap();
        let count = (64usize << 20).div_ceil(rows * row_bytes) + 1;
        let mats: Vec<Interleaved> = (0..count)
            .map(|_| {
                let mut w = vec![0u8; rows * row_bytes];
                for row in w.chunks_exact_mut(row_bytes) {
                    let x: Vec<f32> = (0..cols).map(|_| r.gen_range(-0.03f32..0.03)).collect();
                    quantize_row(ty, &x, row);
                }
                Interleaved::pack(&WeightView::new(ty, rows, cols, &w).unwrap()).unwrap()
            })
            .collect();
        let k = LinearKernel::with_isa(ty, isa, LinearPolicy::DEFAULT);
        for m in [1usize, 8] {
            let x: Vec<f32> = (0..m * cols).map(|_| r.gen_range(-1.0..1.0)).collect();
            let mut y = vec![0f32; m * rows];
            g.throughput(Throughput::Bytes((rows * row_bytes) as u64));
            let mut next = 0;
            g.bench_with_input(BenchmarkId::new(k.id(), m), &m, |b, &m| {
                b.iter(|| {
                    next = (next + 1) % count;
                    k.forward(Weight::Interleaved(&mats[next]), &x, m, &mut y, rows)
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, linear, gemv_bandwidth);
criterion_main!(benches);
