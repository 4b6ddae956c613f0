//! Linear-layer paths on a Q4_1 1536x576 matrix (SmolLM2's gate/up shape, interleaved as the
//! engine stores it) at several batch sizes: the int8-activation integer GEMM, the AVX2 dequantizing micro-kernel, and the
//! portable gemm-crate panel path. This is the data behind `LinearPolicy::DEFAULT`'s switch.
//! Then the integer GEMV of every interleaved GGUF type on 8192x2048 matrices (a 1B model's
//! FFN gate/up), cycling over enough of them (> 64 MiB) that the weights stream from DRAM as
//! in decode: throughput in bytes of weights per second; the checkpoint int4 formats (W4A16,
//! W4A8) on the same shape beside them. Then prefill-shaped calls: 128 tokens through one
//! 2048x2048 matrix per type and scheme, in multiply-adds per second (bound by arithmetic;
//! the matrix fits the last-level cache, not L2). Last, the roofline those figures are
//! read against: summing a 512 MiB buffer on the kernel thread pool (every core reading), in
//! bytes per second.
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
use tessera_kernels::linear::ggml::{ActBlocks, LinearKernel, Weight, WeightView};
use tessera_kernels::linear::{ActQuant, Int4Matrix, LinearPolicy, RowKernel, RowwiseLinear};
use std::sync::Arc;

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
        let mats: Vec<Interleaved> = (0..count).map(|_| random_interleaved(&mut r, ty, rows, cols)).collect();
        for k in both_blockings(LinearKernel::with_isa(ty, isa, LinearPolicy::DEFAULT)) {
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
    }
    int4_bandwidth(&mut g, rows, cols, &mut r);
    g.finish();
}

/// `k`, and for the k-quants also `k` with the other activation blocking (per-32 and per-256
/// activations side by side).
fn both_blockings(k: LinearKernel) -> Vec<LinearKernel> {
    let mut v = vec![k.with_blocks(ActBlocks::Of32), k.with_blocks(ActBlocks::Of256)];
    v.dedup();
    v
}

/// A `rows x cols` matrix of type `ty` in the interleaved layout, quantized from uniform random
/// weights in ±0.03.
fn random_interleaved(r: &mut ChaCha8Rng, ty: GgmlType, rows: usize, cols: usize) -> Interleaved {
    let row_bytes = ty.row_bytes(cols).unwrap();
    let mut w = vec![0u8; rows * row_bytes];
    for row in w.chunks_exact_mut(row_bytes) {
        let x: Vec<f32> = (0..cols).map(|_| r.gen_range(-0.03f32..0.03)).collect();
        quantize_row(ty, &x, row);
    }
    Interleaved::pack(&WeightView::new(ty, rows, cols, &w).unwrap()).unwrap()
}

/// A random int4 matrix: codes uniform in -8..=7, scales in 0.005..0.05, zero points when
/// `zeros`.
fn random_int4(r: &mut ChaCha8Rng, rows: usize, cols: usize, group: usize, zeros: bool) -> Int4Matrix {
    let ng = rows * cols.div_ceil(group);
    let q: Vec<i8> = (0..rows * cols).map(|_| r.gen_range(-8..=7)).collect();
    let s: Vec<f32> = (0..ng).map(|_| r.gen_range(0.005..0.05)).collect();
    let z = zeros.then(|| (0..ng).map(|_| r.gen_range(-8..=7)).collect());
    Int4Matrix::new(rows, cols, group, &q, s, z).unwrap()
}

/// The int4 schemes the benches run (name, group, zero points, activations): W4A16 g128 with
/// zero points on f32 activations and on the 16-bit ones the serving default picks on this
/// CPU (bf16 with the AVX-512 BF16 dot, int16 per group on AVX2), W4A8 per channel.
fn int4_cases(caps: &CpuCaps, cols: usize) -> Vec<(&'static str, usize, bool, ActQuant)> {
    let probe = random_int4(&mut ChaCha8Rng::seed_from_u64(0), 16, 128, 128, true);
    let a16 = RowKernel::activations(&probe, ActQuant::F32, caps, LinearPolicy::DEFAULT).0;
    let mut v = vec![("w4a16-g128-asym", 128, true, ActQuant::F32)];
    if a16 != ActQuant::F32 {
        v.push(("w4a16-g128-asym", 128, true, a16));
    }
    v.push(("w4a8-channel", cols, false, ActQuant::Int8PerToken));
    v
}

/// Prefill-shaped calls: 128 tokens through one 2048x2048 matrix (in the last-level cache;
/// prefill is bound by arithmetic), per GGUF type and checkpoint int4 scheme; throughput in
/// multiply-adds.
fn prefill(c: &mut Criterion) {
    let (rows, cols, m) = (2048, 2048, 128);
    let caps = CpuCaps::detect();
    let mut r = ChaCha8Rng::seed_from_u64(4);
    let x: Vec<f32> = (0..m * cols).map(|_| r.gen_range(-1.0..1.0)).collect();
    let mut y = vec![0f32; m * rows];
    let mut g = c.benchmark_group("prefill_2048x2048");
    g.sample_size(10).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    g.throughput(Throughput::Elements((m * rows * cols) as u64));
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        let w = random_interleaved(&mut r, ty, rows, cols);
        for k in both_blockings(LinearKernel::with_isa(ty, caps.best_isa(), LinearPolicy::DEFAULT)) {
            g.bench_with_input(BenchmarkId::new(k.id(), m), &m, |b, &m| b.iter(|| k.forward(Weight::Interleaved(&w), &x, m, &mut y, rows)));
        }
    }
    for (name, group, zeros, act) in int4_cases(&caps, cols) {
        let l = RowwiseLinear::new(Arc::new(random_int4(&mut r, rows, cols, group, zeros)), act, &caps).unwrap();
        g.bench_with_input(BenchmarkId::new(format!("{name}.{}", l.id()), m), &m, |b, &m| b.iter(|| l.forward(&x, m, &mut y, rows)));
    }
    g.finish();
}

/// The checkpoint int4 GEMVs on the same shape at 1, 2, 4 and 8 tokens (the W4A16 kernel's
/// pass shape changes with the token count), streaming like [`gemv_bandwidth`]'s: W4A16
/// (groups of 128 with zero points, as `tessera quantize --scheme w4a16` writes, on f32 and on
/// the default 16-bit activations: [`int4_cases`]) and W4A8 (per channel, int8
/// per-token activations); throughput in bytes of packed weights, scales and zero points.
fn int4_bandwidth(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>, rows: usize, cols: usize, r: &mut ChaCha8Rng) {
    let caps = CpuCaps::detect();
    for (name, group, zeros, act) in int4_cases(&caps, cols) {
        let ng = rows * cols.div_ceil(group);
        let make = |r: &mut ChaCha8Rng| random_int4(r, rows, cols, group, zeros);
        let first = make(r);
        // What a call streams: the codes, and one f32 scale (and one zero point) per row and group.
        let bytes = rows * cols / 2 + ng * (4 + usize::from(zeros));
        let count = (64usize << 20).div_ceil(first.bytes()) + 1;
        let mats: Vec<RowwiseLinear> = std::iter::once(first)
            .chain((1..count).map(|_| make(r)))
            .map(|m| RowwiseLinear::new(Arc::new(m), act, &caps).unwrap())
            .collect();
        for m in [1usize, 2, 4, 8] {
            let x: Vec<f32> = (0..m * cols).map(|_| r.gen_range(-1.0..1.0)).collect();
            let mut y = vec![0f32; m * rows];
            g.throughput(Throughput::Bytes(bytes as u64));
            let mut next = 0;
            g.bench_with_input(BenchmarkId::new(format!("{name}.{}", mats[0].id()), m), &m, |b, &m| {
                b.iter(|| {
                    next = (next + 1) % count;
                    mats[next].forward(&x, m, &mut y, rows)
                })
            });
        }
    }
}

/// The wrapping sum of `w` (a multiple of 16 words), with 256-bit loads where the CPU has AVX2.
fn sum_words(w: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present.
        return unsafe { sum_words_avx2(w) };
    }
    w.iter().fold(0u64, |a, &x| a.wrapping_add(x))
}

/// [`sum_words`] with four 256-bit accumulators, so the adds keep up with the loads.
///
/// # Safety
/// AVX2 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_words_avx2(w: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 4];
    for c in w.chunks_exact(16) {
        for (k, a) in acc.iter_mut().enumerate() {
            // SAFETY: words 4k..4k + 4 of a 16-word chunk.
            *a = _mm256_add_epi64(*a, unsafe { _mm256_loadu_si256(c.as_ptr().add(4 * k) as *const __m256i) });
        }
    }
    let mut out = [0u64; 4];
    let total = _mm256_add_epi64(_mm256_add_epi64(acc[0], acc[1]), _mm256_add_epi64(acc[2], acc[3]));
    // SAFETY: `out` is 32 writable bytes.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, total) };
    out.iter().fold(0u64, |a, &x| a.wrapping_add(x))
}

/// DRAM read bandwidth as the kernels see it: a 512 MiB buffer summed in 1 MiB tasks on the
/// kernels' thread pool (`RAYON_NUM_THREADS` threads), the decode roofline's denominator.
fn read_bandwidth(c: &mut Criterion) {
    const TASK: usize = 1 << 20;
    let words = (512usize << 20) / 8;
    let mut r = ChaCha8Rng::seed_from_u64(3);
    let buf: Vec<u64> = (0..words).map(|_| r.gen()).collect();
    let mut g = c.benchmark_group("dram_read");
    g.sample_size(10).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(3));
    g.throughput(Throughput::Bytes((words * 8) as u64));
    g.bench_function("sum_512MiB", |b| {
        b.iter(|| {
            let chunks: Vec<&[u64]> = buf.chunks(TASK / 8).collect();
            let sums = tessera_kernels::cpu::pool::map(chunks.len(), |i| sum_words(chunks[i]));
            std::hint::black_box(sums)
        })
    });
    g.finish();
}

criterion_group!(benches, linear, gemv_bandwidth, prefill, read_bandwidth);
criterion_main!(benches);
