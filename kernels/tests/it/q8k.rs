//! The k-quant kernels against per-256 activations (`linear::ggml::q8k`): the activation
//! quantizer, and every level against a reference computed from the GGML blocks' bytes.

use crate::common::{randn, random_weights, rng};
use tessera_kernels::cpu::{GemmLevel, Isa};
use tessera_kernels::ggml::act_quant::{quantize_q8k, quantize_q8k_with, Q8KBlock, Q8K_BLOCK, Q8K_MAX_SHIFT};
use tessera_kernels::ggml::GgmlType;
use tessera_kernels::linear::ggml::interleaved::{Interleaved, GROUP};
use tessera_kernels::linear::ggml::{forward_group, ActBlocks, LinearKernel, Weight, WeightView};
use tessera_kernels::linear::LinearPolicy;

/// The k-quants.
const KQUANTS: [GgmlType; 5] = [GgmlType::Q2K, GgmlType::Q3K, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K];

/// One GGML k-quant super-block as integers, decoded from ggml's block layouts: the signed
/// value codes (Q4_K 0..16, Q5_K 0..32, Q6_K -32..32, Q3_K -4..4, Q2_K 0..4), scale and min
/// per 16 values (Q4_K's and Q5_K's per-32 ones twice), `d` and `dmin` (0 without mins).
struct Ints {
    codes: [i32; 256],
    sc: [i32; 16],
    m: [i32; 16],
    d: f32,
    dmin: f32,
}

fn f16(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

fn decode(ty: GgmlType, b: &[u8]) -> Ints {
    let mut x = Ints { codes: [0; 256], sc: [0; 16], m: [0; 16], d: 0.0, dmin: 0.0 };
    match ty {
        GgmlType::Q4K | GgmlType::Q5K => {
            (x.d, x.dmin) = (f16(b), f16(&b[2..]));
            let q = &b[4..16];
            let qs = if ty == GgmlType::Q5K { &b[48..176] } else { &b[16..144] };
            for s in 0..8 {
                let (sc, m) = if s < 4 { (q[s] & 63, q[s + 4] & 63) } else { ((q[s + 4] & 15) | ((q[s - 4] >> 6) << 4), (q[s + 4] >> 4) | ((q[s] >> 6) << 4)) };
                (x.sc[2 * s], x.sc[2 * s + 1], x.m[2 * s], x.m[2 * s + 1]) = (sc as i32, sc as i32, m as i32, m as i32);
                for l in 0..32 {
                    let byte = qs[32 * (s / 2) + l];
                    let n = if s % 2 == 0 { byte & 15 } else { byte >> 4 } as i32;
                    // Q5_K: the fifth bit of value l of sub-block s is bit s of qh[l].
                    x.codes[32 * s + l] = n + if ty == GgmlType::Q5K { (((b[16 + l] >> s) & 1) as i32) << 4 } else { 0 };
                }
            }
        }
        GgmlType::Q6K => {
            x.d = f16(&b[208..]);
            for v in 0..256 {
                let (n, quarter, l) = (v / 128, (v % 128) / 32, v % 32);
                let lb = b[n * 64 + l + (quarter & 1) * 32];
                let lo = if quarter >= 2 { lb >> 4 } else { lb & 15 };
                x.codes[v] = (lo | (((b[128 + n * 32 + l] >> (2 * quarter)) & 3) << 4)) as i32 - 32;
            }
            for k in 0..16 {
                x.sc[k] = b[192 + k] as i8 as i32;
            }
        }
        _ => {
            let q3 = ty == GgmlType::Q3K;
            let qs = if q3 { &b[32..96] } else { &b[16..80] };
            if q3 {
                x.d = f16(&b[108..]);
                // llama.cpp's `dequantize_row_q3_K`: four u32 words of 6-bit scales, less 32.
                let (m1, m2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
                let w = |i: usize| u32::from_le_bytes(b[96 + 4 * i..100 + 4 * i].try_into().unwrap());
                let (a0, a1, tmp) = (w(0), w(1), w(2));
                let aux = [(a0 & m2) | ((tmp & m1) << 4), (a1 & m2) | (((tmp >> 2) & m1) << 4), ((a0 >> 4) & m2) | (((tmp >> 4) & m1) << 4), ((a1 >> 4) & m2) | (((tmp >> 6) & m1) << 4)];
                x.sc = std::array::from_fn(|k| (aux[k / 4].to_le_bytes()[k % 4] as i8) as i32 - 32);
            } else {
                (x.d, x.dmin) = (f16(&b[80..]), f16(&b[82..]));
                x.sc = std::array::from_fn(|k| (b[k] & 15) as i32);
                x.m = std::array::from_fn(|k| (b[k] >> 4) as i32);
            }
            for v in 0..256 {
                let (s, l) = (v / 32, v % 32);
                let code = ((qs[32 * (s / 4) + l] >> (2 * (s % 4))) & 3) as i32;
                // Q3_K: less 4 unless bit s of hmask[l] is set.
                x.codes[v] = if q3 && (b[l] >> s) & 1 == 0 { code - 4 } else { code };
            }
        }
    }
    x
}

/// The reference from a row's GGML bytes: per super-block the exact `I = Σ_k sc_k 2^shift Σ
/// code · a.qs` and `M = Σ_k m_k 2^shift Σ a.qs` over 16-value sub-blocks (`shift` of the
/// sub-block's 32-value block; the activation sums taken from `qs`, not from the block's
/// sums), then `fma(I, d · d_a, acc)` and, with mins,
/// `fma(M, -(dmin · d_a), acc)`: `linear::ggml::q8k`'s numerics.
fn reference(ty: GgmlType, row: &[u8], a: &[Q8KBlock]) -> f32 {
    row.chunks_exact(ty.type_size()).zip(a).fold(0f32, |acc, (b, a)| {
        let x = decode(ty, b);
        let (mut i, mut m) = (0i64, 0i64);
        for k in 0..16 {
            let vals = 16 * k..16 * k + 16;
            let unit = 1i64 << a.shift[k / 2];
            i += x.sc[k] as i64 * unit * vals.clone().map(|v| x.codes[v] as i64 * a.qs[v] as i64).sum::<i64>();
            m += x.m[k] as i64 * unit * vals.map(|v| a.qs[v] as i64).sum::<i64>();
        }
        let (i, m) = (i32::try_from(i).expect("I fits i32"), i32::try_from(m).expect("M fits i32"));
        let acc = (i as f32).mul_add(x.d * a.d, acc);
        if matches!(ty, GgmlType::Q2K | GgmlType::Q4K | GgmlType::Q5K) {
            (m as f32).mul_add(-(x.dmin * a.d), acc)
        } else {
            acc
        }
    })
}

fn levels() -> Vec<GemmLevel> {
    GemmLevel::ALL.into_iter().filter(|l| l.available()).collect()
}

/// Every level's results for `tokens` rows of `acts` equal the reference bit for bit, and a
/// token alone over one group equals the same token in the batch.
fn check(ty: GgmlType, rows: usize, k: usize, w: &[u8], acts: &[Q8KBlock], tokens: usize, what: &str) {
    let view = WeightView::new(ty, rows, k, w).unwrap();
    let packed = Interleaved::pack(&view).unwrap();
    let (groups, nsb) = (rows.div_ceil(GROUP), k / Q8K_BLOCK);
    for level in levels() {
        let mut all = vec![f32::NAN; tokens * groups * GROUP];
        packed.gemm_q8k(level, 0, groups, acts, tokens, &mut all);
        for t in 0..tokens {
            let a = &acts[t * nsb..(t + 1) * nsb];
            for row in 0..rows {
                let (got, want) = (all[t * groups * GROUP + row], reference(ty, view.row(row), a));
                assert_eq!(got.to_bits(), want.to_bits(), "{ty} {level:?} {what} {rows}x{k} token {t} row {row}: {got} vs {want}");
            }
            let g = t % groups;
            let mut alone = vec![f32::NAN; GROUP];
            packed.gemm_q8k(level, g, g + 1, a, 1, &mut alone);
            let batched = &all[t * groups * GROUP + g * GROUP..][..GROUP];
            assert!(alone.iter().zip(batched).all(|(a, b)| a.to_bits() == b.to_bits()), "{ty} {level:?} token {t} alone");
        }
    }
}

/// Random rows and activations (blocks of different ranges), for token counts that fill the AVX2 tile of four, leave each
/// partial size, and span two token blocks of 32 (37), over group counts of one, of three with
/// a zero-padded last group (21 rows) and of five.
#[test]
fn q8k_gemm_is_bit_exact_and_batch_invariant() {
    let mut r = rng(28);
    for ty in KQUANTS {
        for (rows, k) in [(8, 256), (21, 512), (40, 768)] {
            let w = random_weights(&mut r, ty, rows, k);
            for tokens in [1, 2, 3, 4, 5, 6, 7, 37] {
                // Blocks at ranges 2^-e apart (e in 0..7), so every block shift occurs.
                let mut x = randn(&mut r, tokens * k);
                for (b, blk) in x.chunks_exact_mut(32).enumerate() {
                    let scale = 0.5f32.powi(((b * 5 + tokens) % 7) as i32);
                    blk.iter_mut().for_each(|v| *v *= scale);
                }
                let mut acts = vec![Q8KBlock::default(); tokens * k / Q8K_BLOCK];
                quantize_q8k(&x, &mut acts);
                check(ty, rows, k, &w, &acts, tokens, "random");
            }
        }
    }
}

/// Every weight byte 0xFF (the largest codes: Q4_K 15, Q5_K 31, Q6_K 63, Q3_K and Q2_K 3,
/// with Q4_K's and Q5_K's largest scales and mins) under scales of 1.0, against activations of
/// +127 and -127: the i16 sums of `vpmaddubsw` products at their largest, where a kernel
/// summing one product too many in i16 would saturate.
#[test]
fn q8k_kernels_hold_the_largest_sums() {
    let one = half::f16::from_f32(1.0).to_le_bytes();
    let (rows, k) = (2 * GROUP, 512);
    for ty in KQUANTS {
        let mut block = vec![0xFFu8; ty.type_size()];
        let scale_at: &[usize] = match ty {
            GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q6K => &[208],
            GgmlType::Q3K => &[108],
            _ => &[80, 82],
        };
        for &at in scale_at {
            block[at..at + 2].copy_from_slice(&one);
        }
        let w = block.repeat(rows * k / 256);
        let x: Vec<f32> = (0..2 * k).map(|i| if i < k { 1.0 } else { -1.0 }).collect();
        let mut acts = vec![Q8KBlock::default(); 2 * k / Q8K_BLOCK];
        quantize_q8k(&x, &mut acts);
        assert!(acts.iter().all(|a| a.qs.iter().all(|&q| q.abs() == 127)));
        check(ty, rows, k, &w, &acts, 2, "largest");
    }
}

/// The quantizer's promises, on random super-blocks, on super-blocks whose blocks' ranges
/// differ by powers of two up to 2^6 (one outlier block, the others small), on one whose
/// values land on halves (rounded away from zero), zeros, NaNs (quantized to 0) and a scale
/// whose inverse overflows (zeros): each block's scale is the finest power-of-two multiple
/// of the unit (up to 8) that keeps its values within ±127 (so a block with a shift above 0
/// reaches at least 64 in magnitude), values come back within half a step of that scale, the
/// sums are the shifted sums of the bytes, and the AVX2 quantizer writes the scalar one's bytes.
#[test]
fn q8k_quantizer_simd_matches_scalar() {
    let mut r = rng(29);
    let mut x = randn(&mut r, Q8K_BLOCK * 6);
    for b in 0..6 {
        // Block s of super-block b ranges over ±2^-(s + b) · 20 (s = 0 the outlier).
        for s in 0..8 {
            let scale = 20.0 * 0.5f32.powi((s + b) as i32 % 7);
            x[b * Q8K_BLOCK + 32 * s..][..32].iter_mut().for_each(|v| *v *= scale);
        }
    }
    x.extend((0..Q8K_BLOCK).map(|i| if i == 0 { 1016.0 } else { (i % 64) as f32 - 32.0 + 0.5 }));
    x.extend([0f32; Q8K_BLOCK]);
    x.extend((0..Q8K_BLOCK).map(|i| if i % 5 == 2 { f32::NAN } else { i as f32 - 128.0 }));
    x.extend((0..Q8K_BLOCK).map(|i| if i == 0 { 1e-38 } else { 1e-39 }));
    let n = x.len() / Q8K_BLOCK;
    let mut want = vec![Q8KBlock::default(); n];
    quantize_q8k_with(Isa::Scalar, &x, &mut want);
    // amax 1016 makes the unit 1 and the other blocks' values (below 64) take shift 0.
    let w6 = &want[6];
    assert_eq!((w6.d, w6.shift[1], w6.shift[2], &w6.qs[32..35], &w6.qs[64..67]), (1.0, 0, 0, &[1, 2, 3][..], &[-32, -31, -30][..]), "halves round away from zero");
    let mut shifts = std::collections::BTreeSet::new();
    for (b, w) in want.iter().enumerate() {
        for s in 0..8 {
            let qs = &w.qs[32 * s..32 * s + 32];
            let shift = w.shift[s];
            shifts.insert(shift);
            assert!((0..=Q8K_MAX_SHIFT).contains(&shift), "block {b}.{s}");
            let sum = |r: std::ops::Range<usize>| qs[r].iter().map(|&q| q as i32).sum::<i32>() << shift;
            assert_eq!((i32::from(w.sums[2 * s]), i32::from(w.sums[2 * s + 1]), i32::from(w.sums32[s])), (sum(0..16), sum(16..32), sum(0..32)), "block {b}.{s} sums");
            if b < 6 {
                let step = w.d * (1 << shift) as f32;
                let xs = &x[b * Q8K_BLOCK + 32 * s..][..32];
                assert!(xs.iter().zip(qs).all(|(&v, &q)| (v - step * q as f32).abs() <= step * 0.5 * (1.0 + 1e-5)), "block {b}.{s} round trip");
                assert!(shift == 0 || qs.iter().any(|q| q.abs() >= 64), "block {b}.{s}: a finer scale would do");
            }
        }
    }
    assert_eq!(shifts.len(), 4, "every shift 0..=3 occurs");
    for isa in [Isa::Avx2].into_iter().filter(|i| i.available()) {
        let mut got = vec![Q8KBlock::default(); n];
        quantize_q8k_with(isa, &x, &mut got);
        for (b, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!((g.qs, g.sums, g.sums32, g.shift, g.d.to_bits()), (w.qs, w.sums, w.sums32, w.shift, w.d.to_bits()), "{isa:?} block {b}");
        }
    }
}

/// A fused group whose matrices take different activation blockings (a Q4_K on per-256
/// super-blocks beside a Q5_0 on blocks of 32, as llama.cpp's mixes put fallback types beside
/// K-quants) quantizes the input both ways and gives each matrix the bits it gives alone, on
/// every ISA, over segments of several lengths; and the plan names the blocking.
#[test]
fn a_group_mixing_blockings_equals_its_parts() {
    let mut r = rng(30);
    let (k, segments) = (512, [3usize, 5, 1]);
    let m: usize = segments.iter().sum();
    let x = randn(&mut r, m * k);
    let (rows_a, rows_b) = (24, 16);
    let (wa, wb) = (random_weights(&mut r, GgmlType::Q4K, rows_a, k), random_weights(&mut r, GgmlType::Q5_0, rows_b, k));
    let pa = Interleaved::pack(&WeightView::new(GgmlType::Q4K, rows_a, k, &wa).unwrap()).unwrap();
    let pb = Interleaved::pack(&WeightView::new(GgmlType::Q5_0, rows_b, k, &wb).unwrap()).unwrap();
    for isa in [Isa::Scalar, Isa::Avx2].into_iter().filter(|i| i.available()) {
        let ka = LinearKernel::with_isa(GgmlType::Q4K, isa, LinearPolicy::DEFAULT).with_blocks(ActBlocks::Of256);
        let kb = LinearKernel::with_isa(GgmlType::Q5_0, isa, LinearPolicy::DEFAULT).with_blocks(ActBlocks::Of256);
        assert!(ka.id().contains("*q8_k.") && kb.id().contains("*q8_0."), "{} / {}", ka.id(), kb.id());
        let ldy = rows_a + rows_b;
        let mut y = vec![f32::NAN; m * ldy];
        forward_group(&[(&ka, Weight::Interleaved(&pa), 0), (&kb, Weight::Interleaved(&pb), rows_a)], &x, &segments, &mut y, ldy);
        let (mut ya, mut yb) = (vec![0f32; m * rows_a], vec![0f32; m * rows_b]);
        ka.forward(Weight::Interleaved(&pa), &x, m, &mut ya, rows_a);
        kb.forward(Weight::Interleaved(&pb), &x, m, &mut yb, rows_b);
        for t in 0..m {
            let want: Vec<f32> = ya[t * rows_a..(t + 1) * rows_a].iter().chain(&yb[t * rows_b..(t + 1) * rows_b]).copied().collect();
            assert!(y[t * ldy..(t + 1) * ldy].iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?} token {t}");
        }
    }
}
