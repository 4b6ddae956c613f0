//! GPU ceilings and kernel timings for `docs/cuda-notes.md`: device-to-device copy bandwidth,
//! cuBLAS bf16 GEMM 8192³, the matmul kernels and the dequantize + SGEMM path at Llama-8B shapes (weight copies rotated so the
//! working set is several times the 50 MB L2), and paged decode attention over bf16 KV at
//! 32k context × batch 16. Each figure is the median over 7 rounds of CUDA-event-timed
//! repetitions after a warm-up; inputs are random (never zeros).
//!
//! `cargo bench -p tessera-kernels --bench cuda` (prints `skipped:` without a GPU).

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaView};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use tessera_kernels::cuda::attention::{paged_decode_attention, AttnWorkspace, KvLayerDesc, KvSide, PagedBatch};
use tessera_kernels::cuda::blas::gemm_bf16;
use tessera_kernels::linear::cuda::{matmul_dequant_gemm, matmul_direct, DeviceWeight};
use tessera_kernels::cuda::{test_device, CudaDevice};
use tessera_kernels::ggml::quantize::quantize_row;
use tessera_kernels::ggml::GgmlType;
use tessera_kernels::kv::{codec, CodecOptions, KvFormat, KvGeometry, KvRole};
use tessera_kernels::linear::{ActQuant, RowKernel, Int4Matrix};

/// A row-kernel matrix behind the trait object the driver takes.
fn rk(m: impl RowKernel) -> Arc<dyn RowKernel> {
    Arc::new(m)
}

/// Seconds per call of `f`: median over rounds of (event time of `reps` calls) / `reps`.
fn time(dev: &CudaDevice, reps: usize, mut f: impl FnMut(usize)) -> f64 {
    for i in 0..3 {
        f(i);
    }
    dev.synchronize().unwrap();
    let s = dev.stream();
    let mut per: Vec<f64> = (0..7)
        .map(|_| {
            let a = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
            for i in 0..reps {
                f(i);
            }
            let b = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
            a.elapsed_ms(&b).unwrap() as f64 / 1e3 / reps as f64
        })
        .collect();
    dev.synchronize().unwrap();
    per.sort_by(f64::total_cmp);
    per[3]
}

fn randn(r: &mut ChaCha8Rng, n: usize, sd: f32) -> Vec<f32> {
    (0..n).map(|_| (r.gen::<f32>() + r.gen::<f32>() + r.gen::<f32>() - 1.5) * 2.0 * sd).collect()
}

/// Random bytes on the device, `n` of them (a 16 MiB random pattern repeated).
fn random_bytes(dev: &CudaDevice, r: &mut ChaCha8Rng, n: usize) -> CudaSlice<u8> {
    let pattern: Vec<u8> = (0..(16 << 20).min(n)).map(|_| r.gen()).collect();
    upload_repeated(dev, &pattern, n)
}

fn upload_repeated(dev: &CudaDevice, pattern: &[u8], n: usize) -> CudaSlice<u8> {
    let s = dev.stream();
    let mut d = s.alloc_zeros::<u8>(n).unwrap();
    let mut at = 0;
    while at < n {
        let len = pattern.len().min(n - at);
        s.memcpy_htod(&pattern[..len], &mut d.slice_mut(at..at + len)).unwrap();
        at += len;
    }
    d
}

fn ceilings(dev: &CudaDevice, r: &mut ChaCha8Rng) -> f64 {
    let s = dev.stream();
    let n = 1usize << 30;
    let src = random_bytes(dev, r, n);
    let mut dst = s.alloc_zeros::<u8>(n).unwrap();
    let t = time(dev, 10, |_| s.memcpy_dtod(&src, &mut dst).unwrap());
    let copy_bw = 2.0 * n as f64 / t;
    println!("| device-to-device copy, 1 GiB | {:.3} ms | {:.2} TB/s (read + write) |", t * 1e3, copy_bw / 1e12);
    drop((src, dst));
    let d = 8192;
    let host: Vec<bf16> = randn(r, d * d, 1.0).into_iter().map(bf16::from_f32).collect();
    let (x, w) = (s.clone_htod(&host).unwrap(), s.clone_htod(&host).unwrap());
    let mut y = s.alloc_zeros::<f32>(d * d).unwrap();
    let t = time(dev, 5, |_| gemm_bf16(dev, &x.slice(..), &w.slice(..), d, d, d, &mut y.slice_mut(..)).unwrap());
    println!("| cuBLAS bf16 GEMM 8192³ (f32 out) | {:.3} ms | {:.0} TFLOP/s |", t * 1e3, 2.0 * (d as f64).powi(3) / t / 1e12);
    copy_bw
}

/// A weight of `kind` at `rows × cols`, and its bytes on the device.
fn weight(dev: &CudaDevice, r: &mut ChaCha8Rng, kind: &str, rows: usize, cols: usize) -> (DeviceWeight, usize) {
    let mut ggml = |ty: GgmlType| {
        let rb = ty.row_bytes(cols).unwrap();
        let mut data = vec![0u8; rows * rb];
        // Quantize a few distinct random rows and repeat them (quantizing 58M values per copy
        // would dominate the run); the kernel's speed does not depend on row contents.
        let distinct: Vec<Vec<u8>> = (0..16)
            .map(|_| {
                let mut b = vec![0u8; rb];
                quantize_row(ty, &randn(r, cols, 0.02), &mut b);
                b
            })
            .collect();
        for (i, row) in data.chunks_exact_mut(rb).enumerate() {
            row.copy_from_slice(&distinct[i % 16]);
        }
        (DeviceWeight::from_ggml(dev, ty, rows, cols, &data).unwrap(), data.len())
    };
    match kind {
        "Q4_0" => ggml(GgmlType::Q4_0),
        "Q4_1" => ggml(GgmlType::Q4_1),
        "Q8_0" => ggml(GgmlType::Q8_0),
        "W4A16 g128" | "W4A8 g128" => {
            let group = 128;
            let q: Vec<i8> = (0..rows * cols).map(|_| r.gen_range(-8..=7)).collect();
            let scales: Vec<f32> = (0..rows * cols / group).map(|_| r.gen_range(0.005f32..0.05)).collect();
            let bytes = rows * cols / 2 + scales.len() * 4;
            let m = rk(Int4Matrix::new(rows, cols, group, &q, scales, None).unwrap());
            let act = if kind == "W4A8 g128" { ActQuant::Int8PerToken } else { ActQuant::F32 };
            (m.upload(dev, act).unwrap(), bytes)
        }
        _ => unreachable!("{kind}"),
    }
}

fn matmuls(dev: &CudaDevice, r: &mut ChaCha8Rng, copy_bw: f64) {
    let s = dev.stream();
    println!("\n| weight | shape (rows × cols) | tokens | path | µs | GB/s | share of copy bandwidth | TFLOP/s |\n| --- | --- | --- | --- | --- | --- | --- | --- |");
    for kind in ["W4A16 g128", "W4A8 g128", "Q4_0", "Q4_1", "Q8_0"] {
        for (rows, cols) in [(14336, 4096), (4096, 14336)] {
            // Copies rotated so the working set is well past L2.
            let copies: Vec<(DeviceWeight, usize)> = (0..4).map(|_| weight(dev, r, kind, rows, cols)).collect();
            let bytes = copies[0].1;
            for m in [1, 8, 16, 32, 512] {
                let x = s.clone_htod(&randn(r, m * cols, 1.0)).unwrap();
                let mut y = s.alloc_zeros::<f32>(m * rows).unwrap();
                let reps = if m >= 512 { 5 } else { 50 };
                // The per-format kernel, and (where the format has it) the dequantize + SGEMM
                // path, side by side.
                let gemm = kind != "W4A8 g128" && m > 1;
                for (path, direct) in [("kernel", true), ("dequant + SGEMM", false)] {
                    if !direct && !gemm {
                        continue;
                    }
                    let t = time(dev, reps, |i| {
                        let (w, xv, mut yv) = (&copies[i % 4].0, x.slice(..), y.slice_mut(..));
                        if direct { matmul_direct(dev, w, &xv, m, &mut yv) } else { matmul_dequant_gemm(dev, w, &xv, m, &mut yv) }.unwrap()
                    });
                    let moved = (bytes + 4 * m * (rows + cols)) as f64;
                    println!(
                        "| {kind} | {rows} × {cols} | {m} | {path} | {:.1} | {:.0} | {:.0} % | {:.1} |",
                        t * 1e6,
                        moved / t / 1e9,
                        100.0 * moved / t / copy_bw,
                        2.0 * (m * rows * cols) as f64 / t / 1e12
                    );
                }
            }
        }
    }
}

fn attention(dev: &CudaDevice, r: &mut ChaCha8Rng, copy_bw: f64) {
    let (n_kv, hd, n_heads, bs) = (8, 128, 32, 16);
    println!("\n| KV | context | batch | ms | GB/s | share of copy bandwidth |\n| --- | --- | --- | --- | --- | --- |");
    for (ctx, batch) in [(32768usize, 16usize), (4096, 64), (1024, 1)] {
        let geom = KvGeometry { head_dim: hd, n_kv_heads: n_kv };
        let opts = CodecOptions { layer: 0, seed: 1, static_scale: None };
        let (k, v) = (codec(&KvFormat::BF16, geom, KvRole::Key, opts).unwrap(), codec(&KvFormat::BF16, geom, KvRole::Value, opts).unwrap());
        let (kp, vp) = (k.page_bytes(bs), v.page_bytes(bs));
        let block_bytes = (n_kv * (kp + vp)).next_multiple_of(64);
        let side = |offset, page_bytes| KvSide { format: KvFormat::BF16, offset, page_bytes, static_scale: None };
        let desc = KvLayerDesc::new(block_bytes, bs, n_kv, hd, side(0, kp), side(n_kv * kp, vp)).unwrap();
        let per_seq = ctx / bs;
        let n_blocks = batch * per_seq;
        // Random bf16 values in ±2 (a byte pattern of valid numbers, repeated).
        let pattern: Vec<u8> = randn(r, 8 << 20, 1.0).into_iter().flat_map(|v| bf16::from_f32(v).to_le_bytes()).collect();
        let pool = upload_repeated(dev, &pattern, n_blocks * block_bytes);
        let mut ids: Vec<i32> = (0..n_blocks as i32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, r.gen_range(0..=i));
        }
        let s = dev.stream();
        let tables = s.clone_htod(&ids).unwrap();
        let lens = s.clone_htod(&vec![ctx as i32; batch]).unwrap();
        let q = s.clone_htod(&randn(r, batch * n_heads * hd, 1.0)).unwrap();
        let mut out = s.alloc_zeros::<f32>(batch * n_heads * hd).unwrap();
        let mut ws = AttnWorkspace::new(dev, batch, n_heads, hd, 32).unwrap();
        let lens_view: CudaView<'_, i32> = lens.slice(..);
        let b = PagedBatch { pool: &pool, block_tables: tables.slice(..), max_blocks: per_seq, seq_lens: lens_view, max_seq_len: ctx };
        let t = time(dev, 20, |_| paged_decode_attention(dev, &desc, &b, &q.slice(..), n_heads, &mut out.slice_mut(..), &mut ws).unwrap());
        let moved = (n_blocks * block_bytes) as f64;
        println!("| bf16 | {ctx} | {batch} | {:.3} | {:.0} | {:.0} % |", t * 1e3, moved / t / 1e9, 100.0 * moved / t / copy_bw);
    }
}

fn main() {
    let Some(dev): Option<Arc<CudaDevice>> = test_device() else { return };
    println!("device: {}\n\n| ceiling | time | rate |\n| --- | --- | --- |", dev.describe());
    let mut r = ChaCha8Rng::seed_from_u64(7);
    let copy_bw = ceilings(&dev, &mut r);
    matmuls(&dev, &mut r, copy_bw);
    attention(&dev, &mut r, copy_bw);
}
