//! Quantized linear layers on SmolLM2-135M's MLP shapes (gate/up 1536x576, down 576x1536) at
//! decode and prefill batch sizes, side by side in one run: W4A16 (int4 groups of 128, or 64
//! where 128 does not divide the 576 input columns; with f32 activations, and with bf16 ones
//! where the CPU has AVX-512 BF16), W4A8 (int4 per channel), W8A8 int8, W8A8
//! FP8 (per channel) through `RowwiseLinear`, and the GGML Q4_1 and F32 paths through
//! `LinearKernel` with the default policy.
//! Run: `cargo bench -p tessera-kernels --bench quant`.

#![allow(missing_docs)] // criterion's macros generate undocumented functions

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tessera_kernels::cpu::caps::bf16_dot_available;
use tessera_kernels::cpu::{CpuCaps, Isa};
use tessera_kernels::ggml::GgmlType;
use tessera_kernels::linear::ggml::interleaved::Interleaved;
use tessera_kernels::linear::ggml::{LinearKernel, Weight, WeightView};
use tessera_kernels::linear::LinearPolicy;
use tessera_kernels::e4m3::e4m3_is_nan;
use tessera_kernels::linear::{ActQuant, RowKernel, Fp8Matrix, Int4Matrix, Int8Matrix, RowwiseLinear};
use std::sync::Arc;

/// A row-kernel matrix behind the trait object the driver takes.
fn rk(m: impl RowKernel) -> Arc<dyn RowKernel> {
    Arc::new(m)
}

/// Random nonzero scales.
fn scales(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.gen_range(0.005..0.05)).collect()
}

/// Random Q4_1 blocks with realistic scales and mins.
fn q4_1(r: &mut ChaCha8Rng, rows: usize, cols: usize) -> Vec<u8> {
    let mut b: Vec<u8> = (0..rows * cols / 32 * 20).map(|_| r.gen()).collect();
    for blk in b.chunks_exact_mut(20) {
        blk[0..2].copy_from_slice(&half::f16::from_f32(r.gen_range(0.01..0.1)).to_le_bytes());
        blk[2..4].copy_from_slice(&half::f16::from_f32(r.gen_range(-0.5..0.0)).to_le_bytes());
    }
    b
}

/// One layer of each scheme on a `rows x cols` matrix.
fn layers(r: &mut ChaCha8Rng, rows: usize, cols: usize, isa: Isa) -> Vec<(&'static str, RowwiseLinear)> {
    let n = rows * cols;
    let q4: Vec<i8> = (0..n).map(|_| r.gen_range(-8..=7)).collect();
    let g = if cols.is_multiple_of(128) { 128 } else { 64 };
    let w4g = Int4Matrix::new(rows, cols, g, &q4, scales(r, n / g), None).unwrap();
    let w4c = Int4Matrix::new(rows, cols, cols, &q4, scales(r, rows), None).unwrap();
    let w8 = Int8Matrix::new(rows, cols, (0..n).map(|_| r.gen_range(-127..=127)).collect(), scales(r, rows)).unwrap();
    let f8 = (0..n).map(|_| loop {
        let b: u8 = r.gen();
        if !e4m3_is_nan(b) {
            break b;
        }
    });
    let f8 = Fp8Matrix::new(rows, cols, [1, cols], f8.collect(), scales(r, rows)).unwrap();
    let l = |w, a| RowwiseLinear::with_isa(w, a, isa).unwrap();
    let mut v = vec![("w4a16-g", l(rk(w4g.clone()), ActQuant::F32))];
    if isa != Isa::Scalar && bf16_dot_available() {
        v.push(("w4a16-g-bf16", l(rk(w4g), ActQuant::Bf16)));
    }
    v.extend([
        ("w4a8-ch", l(rk(w4c), ActQuant::Int8PerToken)),
        ("w8a8-int8", l(rk(w8), ActQuant::Int8PerToken)),
        ("w8a8-fp8", l(rk(f8), ActQuant::Fp8PerToken)),
    ]);
    v
}

/// Every path at every batch size, per shape.
fn quant(c: &mut Criterion) {
    let isa = CpuCaps::detect().best_isa();
    let mut r = ChaCha8Rng::seed_from_u64(7);
    for (name, rows, cols) in [("gate_up_1536x576", 1536, 576), ("down_576x1536", 576, 1536)] {
        let q4_1_bytes = q4_1(&mut r, rows, cols);
        let f32_bytes: Vec<u8> = (0..rows * cols).flat_map(|_| r.gen_range(-0.1f32..0.1).to_le_bytes()).collect();
        let q4_1_packed = Interleaved::pack(&WeightView::new(GgmlType::Q4_1, rows, cols, &q4_1_bytes).unwrap()).unwrap();
        let f32_view = WeightView::new(GgmlType::F32, rows, cols, &f32_bytes).unwrap();
        let q4_1_kernel = LinearKernel::with_isa(GgmlType::Q4_1, isa, LinearPolicy::DEFAULT);
        let f32_kernel = LinearKernel::with_isa(GgmlType::F32, isa, LinearPolicy::DEFAULT);
        let quant = layers(&mut r, rows, cols, isa);
        let mut g = c.benchmark_group(name);
        g.sample_size(10).warm_up_time(std::time::Duration::from_millis(300)).measurement_time(std::time::Duration::from_secs(1));
        for m in [1usize, 8, 64, 256] {
            let x: Vec<f32> = (0..m * cols).map(|_| r.gen_range(-1.0..1.0)).collect();
            let mut y = vec![0f32; m * rows];
            g.throughput(Throughput::Elements((m * rows * cols) as u64));
            for (path, l) in &quant {
                g.bench_with_input(BenchmarkId::new(*path, m), &m, |b, &m| b.iter(|| l.forward(&x, m, &mut y, rows)));
            }
            g.bench_with_input(BenchmarkId::new("ggml-q4_1", m), &m, |b, &m| {
                b.iter(|| q4_1_kernel.forward(Weight::Interleaved(&q4_1_packed), &x, m, &mut y, rows))
            });
            g.bench_with_input(BenchmarkId::new("ggml-f32", m), &m, |b, &m| b.iter(|| f32_kernel.forward(Weight::Rows(f32_view), &x, m, &mut y, rows)));
        }
        g.finish();
    }
}

criterion_group!(benches, quant);
criterion_main!(benches);
