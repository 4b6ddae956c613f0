//! Every optimized kernel against the scalar reference on random data of awkward sizes.

use crate::common;

use common::{assert_close, randn, random_weights, rng};
use tessera_kernels::cpu::dot::{axpy_f32, dot_f32, dots_f32, weighted_sum_f32};
use tessera_kernels::cpu::GemmLevel;
use tessera_kernels::linear::ggml::interleaved::{Interleaved, GROUP};
use tessera_kernels::linear::ggml::kquant::{Q3K_RECORD, Q4K_RECORD, Q5K_RECORD};
use tessera_kernels::cpu::Isa;
use tessera_kernels::ggml::act_quant::{quantize_q8, quantize_q8_with, Q8Block};
use tessera_kernels::ggml::GgmlType;
use tessera_kernels::linear::ggml::{LinearKernel, Weight, WeightView};
use tessera_kernels::linear::LinearPolicy;
use tessera_kernels::ops::Rope;
use tessera_kernels::reference;

fn simd_isas() -> Vec<Isa> {
    let isas: Vec<Isa> = [Isa::Avx2].into_iter().filter(|i| i.available()).collect();
    if isas.is_empty() {
        eprintln!("note: no SIMD ISA available on this CPU; only the scalar path is exercised");
    }
    isas
}

/// The integer types with an interleaved layout.
const INTEGER_TYPES: [GgmlType; 10] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// A width of `k32` columns for 32-value types, scaled to whole 256-value super-blocks for
/// the k-quants (the same number of blocks per row).
fn cols(ty: GgmlType, k32: usize) -> usize {
    k32 * ty.block_size() / 32
}

/// The 6-bit codes of a GGML Q6_K block in value order, decoded from ggml's `block_q6_K`
/// (`ql` 128 bytes, `qh` 64, scales 16, `d`).
fn q6k_codes(b: &[u8]) -> Vec<i32> {
    (0..256)
        .map(|v| {
            let (n, quarter, l) = (v / 128, (v % 128) / 32, v % 32);
            let lb = b[n * 64 + l + (quarter & 1) * 32];
            let lo = if quarter >= 2 { lb >> 4 } else { lb & 15 };
            (lo | (((b[128 + n * 32 + l] >> (2 * quarter)) & 3) << 4)) as i32
        })
        .collect()
}

/// The signed 6-bit scales (-32..32) of a GGML Q3_K block's 12 packed bytes, unpacked as
/// llama.cpp's `dequantize_row_q3_K` does (four u32 words and two masks).
fn q3k_scales(raw: &[u8]) -> [i32; 16] {
    let (m1, m2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let w = |i: usize| u32::from_le_bytes(raw[4 * i..4 * i + 4].try_into().unwrap());
    let (a0, a1, tmp) = (w(0), w(1), w(2));
    let aux = [(a0 & m2) | ((tmp & m1) << 4), (a1 & m2) | (((tmp >> 2) & m1) << 4), ((a0 >> 4) & m2) | (((tmp >> 4) & m1) << 4), ((a1 >> 4) & m2) | (((tmp >> 6) & m1) << 4)];
    std::array::from_fn(|k| (aux[k / 4].to_le_bytes()[k % 4] as i8) as i32 - 32)
}

/// The reference of the Q2_K / Q3_K integer GEMM from one GGML block (84 or 110 bytes; `a`:
/// its 8 activation blocks): value `l` of 32-value block `s` has 2-bit code
/// `qs[32 (s / 4) + l] >> 2 (s % 4)`, Q3_K less 4 unless bit `s` of `hmask[l]` is set; per
/// 32-value block the exact `isum = sc_0 Σ_0 q·a + sc_1 Σ_1 q·a` over its 16-value halves,
/// `fma(isum, d * d_a, acc)`, and for Q2_K then `fma(dmin * d_a, -(m_0 Σ_0 a + m_1 Σ_1 a), acc)`.
fn low_kquant_block_dot(ty: GgmlType, b: &[u8], a: &[Q8Block], mut acc: f32) -> f32 {
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    let q3 = ty == GgmlType::Q3K;
    let (qs, d) = if q3 { (&b[32..96], f16(&b[108..])) } else { (&b[16..80], f16(&b[80..])) };
    let sc3 = q3.then(|| q3k_scales(&b[96..108]));
    for (s, ab) in a.iter().enumerate() {
        let (mut isum, mut msum) = (0i32, 0i32);
        for h in 0..2 {
            let k = 2 * s + h;
            let (sc, m) = sc3.map_or(((b[k] & 15) as i32, (b[k] >> 4) as i32), |sc| (sc[k], 0));
            let val = |l: usize| {
                let code = ((qs[32 * (s / 4) + l] >> (2 * (s % 4))) & 3) as i32;
                if q3 && (b[l] >> s) & 1 == 0 { code - 4 } else { code }
            };
            isum += sc * (16 * h..16 * h + 16).map(|l| val(l) * ab.qs[l] as i32).sum::<i32>();
            msum += m * ab.qs[16 * h..16 * h + 16].iter().map(|&x| x as i32).sum::<i32>();
        }
        acc = (isum as f32).mul_add(d * ab.d, acc);
        if !q3 {
            acc = (f16(&b[82..]) * ab.d).mul_add(-(msum as f32), acc);
        }
    }
    acc
}

/// The reference of the k-quant integer GEMM from one GGML super-block (`a`: its 8 activation
/// blocks), the documented operations in `linear::ggml::kquant`: per 32-value sub-block, Q4_K
/// `fma(isum, (d * sc) * d_a, acc)` then `fma(dmin * m, -(d_a * Σa), acc)`, Q6_K the exact
/// `sc_lo * isum_lo + sc_hi * isum_hi` then `fma(isum, d * d_a, acc)`.
fn kquant_block_dot(ty: GgmlType, b: &[u8], a: &[Q8Block], mut acc: f32) -> f32 {
    if matches!(ty, GgmlType::Q2K | GgmlType::Q3K) {
        return low_kquant_block_dot(ty, b, a, acc);
    }
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    for (s, ab) in a.iter().enumerate() {
        if ty != GgmlType::Q6K {
            let q = &b[4..16];
            let (sc, m) = if s < 4 {
                (q[s] & 63, q[s + 4] & 63)
            } else {
                ((q[s + 4] & 15) | ((q[s - 4] >> 6) << 4), (q[s + 4] >> 4) | ((q[s] >> 6) << 4))
            };
            // Q5_K: the fifth bit of value l of sub-block s is bit s of qh[l] (bytes 16..48).
            let (qs_at, high) = if ty == GgmlType::Q5K { (48, true) } else { (16, false) };
            let codes = &b[qs_at + 32 * (s / 2)..qs_at + 32 * (s / 2) + 32];
            let code = |l: usize| {
                let n = if s.is_multiple_of(2) { codes[l] & 15 } else { codes[l] >> 4 };
                n as i32 + if high { (((b[16 + l] >> s) & 1) as i32) << 4 } else { 0 }
            };
            let isum: i32 = (0..32).map(|l| code(l) * ab.qs[l] as i32).sum();
            acc = (isum as f32).mul_add(f16(b) * sc as f32 * ab.d, acc);
            acc = (f16(&b[2..]) * m as f32).mul_add(-(ab.d * ab.sum as f32), acc);
        } else {
            let q = q6k_codes(b);
            let half = |h: usize| (b[192 + 2 * s + h] as i8 as i32) * (0..16).map(|l| (q[32 * s + 16 * h + l] - 32) * ab.qs[16 * h + l] as i32).sum::<i32>();
            acc = ((half(0) + half(1)) as f32).mul_add(f16(&b[208..]) * ab.d, acc);
        }
    }
    acc
}

/// `n` tokens of random activations quantized to Q8 blocks, token-major.
fn q8_acts(r: &mut rand_chacha::ChaCha8Rng, k: usize, n: usize) -> (Vec<f32>, Vec<Q8Block>) {
    let x = randn(r, n * k);
    let mut a = vec![Q8Block::default(); n * k / 32];
    for (xs, ab) in x.chunks_exact(k).zip(a.chunks_exact_mut(k / 32)) {
        quantize_q8(xs, ab);
    }
    (x, a)
}

/// An independent reference from the original GGML block bytes: the documented per-block
/// operations (`acc = fma(isum, d_w * d_a, acc)`, then `fma(m_w, s_a, acc)` for Q4_1).
fn ggml_block_dot(ty: GgmlType, row: &[u8], a: &[Q8Block]) -> f32 {
    if ty.block_size() == 256 {
        return row.chunks_exact(ty.type_size()).zip(a.chunks_exact(8)).fold(0.0, |acc, (b, a)| kquant_block_dot(ty, b, a, acc));
    }
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    let bb = row.len() / a.len();
    let mut acc = 0f32;
    for (b, ab) in row.chunks_exact(bb).zip(a) {
        let isum = match ty {
            GgmlType::Q8_0 => b[2..34].iter().zip(&ab.qs).map(|(&w, &x)| w as i8 as i32 * x as i32).sum::<i32>(),
            _ => {
                // Codes after d (and m), and for Q5 after the 32 fifth bits qh.
                let (qs_at, qh) = match ty {
                    GgmlType::Q4_0 => (2, None),
                    GgmlType::Q4_1 => (4, None),
                    GgmlType::Q5_0 => (6, Some(u32::from_le_bytes(b[2..6].try_into().unwrap()))),
                    _ => (8, Some(u32::from_le_bytes(b[4..8].try_into().unwrap()))),
                };
                let off = match ty {
                    GgmlType::Q4_0 => 8,
                    GgmlType::Q5_0 => 16,
                    _ => 0,
                };
                let fifth = |v: usize| qh.map_or(0, |h| (((h >> v) & 1) as i32) << 4);
                let qs = &b[qs_at..qs_at + 16];
                (0..16)
                    .map(|c| {
                        ((qs[c] & 15) as i32 + fifth(c) - off) * ab.qs[c] as i32 + ((qs[c] >> 4) as i32 + fifth(c + 16) - off) * ab.qs[c + 16] as i32
                    })
                    .sum()
            }
        };
        acc = (isum as f32).mul_add(f16(b) * ab.d, acc);
        if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
            acc = f16(&b[2..4]).mul_add(ab.s, acc);
        }
    }
    acc
}

/// The AVX2 activation quantizer writes the scalar one's bytes, scales and sums, on random
/// blocks, on blocks whose scaled values land exactly on halves (rounded away from zero),
/// and on blocks at the edges of the f32 and f16 ranges.
#[test]
fn q8_quantizer_simd_matches_scalar() {
    let mut r = rng(3);
    let mut x = randn(&mut r, 32 * 50);
    // amax 127 makes the scale 1, so these values are rounded as written.
    let halves: Vec<f32> = (0..32).map(|i| if i == 0 { 127.0 } else { (i as f32 - 16.0) + 0.5 }).collect();
    x.extend(&halves);
    x.extend(halves.iter().map(|v| -v));
    x.extend([0f32; 32]);
    // A scale whose inverse overflows (zeros), one that f16 flushes to zero, and one
    // beyond f16's range (infinite d), each with a negative zero.
    // NaNs, which every level quantizes to 0 (so the block sums stay the sums of its values).
    x.extend((0..32).map(|i| if i % 5 == 2 { f32::NAN } else { i as f32 - 16.0 }));
    for amax in [1e-38f32, 1e-6, 1e7] {
        x.extend((0..32).map(|i| match i {
            0 => amax,
            1 => -0.0,
            _ => amax * (i as f32 / 32.0 - 0.5),
        }));
    }
    let n = x.len() / 32;
    let mut want = vec![Q8Block::default(); n];
    quantize_q8_with(Isa::Scalar, &x, &mut want);
    assert_eq!(want[50].qs[1..4], [-15, -14, -13], "halves round away from zero");
    for isa in simd_isas() {
        let mut got = vec![Q8Block::default(); n];
        quantize_q8_with(isa, &x, &mut got);
        for (b, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                (g.qs, g.sum, g.sum_lo, g.d.to_bits(), g.s.to_bits(), g.neg_dsum.to_bits()),
                (w.qs, w.sum, w.sum_lo, w.d.to_bits(), w.s.to_bits(), w.neg_dsum.to_bits()),
                "{isa:?} block {b}"
            );
        }
    }
}

/// Packing keeps every value: each row dequantizes from the interleaved layout exactly as
/// GGML dequantizes the original row (row counts that leave a partial last group included).
#[test]
fn interleaved_rows_dequantize_like_ggml() {
    let mut r = rng(1);
    for ty in INTEGER_TYPES {
        for (rows, k) in [(1, 32), (13, 96), (37, 576)] {
            let k = cols(ty, k);
            let w = random_weights(&mut r, ty, rows, k);
            let view = WeightView::new(ty, rows, k, &w).unwrap();
            let packed = Interleaved::pack(&view).unwrap();
            // Q4_K's and Q5_K's 6-bit scales and mins are unpacked to bytes: 32 more per
            // super-block of 8 rows.
            let record_extra = match ty {
                GgmlType::Q4K => Q4K_RECORD - GROUP * 144,
                GgmlType::Q5K => Q5K_RECORD - GROUP * 176,
                GgmlType::Q3K => Q3K_RECORD - GROUP * 110,
                _ => 0,
            };
            let want_bytes = rows.div_ceil(GROUP) * (GROUP * w.len() / rows + record_extra * k / 256);
            assert_eq!(packed.bytes(), want_bytes, "{ty}: GGML's bytes per row");
            let (mut want, mut got) = (vec![0f32; k], vec![f32::NAN; k]);
            for row in 0..rows {
                tessera_kernels::ggml::dequantize_row(ty, view.row(row), &mut want);
                packed.dequantize_row(row, &mut got);
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{ty} {rows}x{k} row {row}");
            }
        }
    }
    assert!(Interleaved::pack(&WeightView::new(GgmlType::F32, 1, 32, &[0; 128]).unwrap()).is_err());
    // The README's "every quantized type on an integer kernel": every GGML type but the floats
    // and the activation-only Q8_1 / Q8_K (no llama.cpp file stores weights in them).
    for ty in GgmlType::ALL {
        let weights_only = !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_1 | GgmlType::Q8K);
        assert_eq!(Interleaved::supports(ty), weights_only, "{ty}");
        assert_eq!(INTEGER_TYPES.contains(&ty), weights_only, "{ty}: INTEGER_TYPES lists every integer type");
    }
}

/// Every integer GEMM level this CPU has (scalar, AVX2, AVX-512 VNNI) equals the independent
/// per-block reference computed from the original GGML rows bit for bit, for token counts
/// that fill tiles (4 tokens for AVX2, 8 for AVX-512) and leave every partial size or span
/// two token blocks (37), over group counts that pair up (AVX-512 takes two groups at once,
/// including a zero-padded last group: 30 rows) and leave one over; a token run alone over one
/// group equals the same token in the batch: the property that makes batched decode give the
/// same tokens as decode alone.
#[test]
fn interleaved_gemm_is_bit_exact_and_batch_invariant() {
    let levels: Vec<GemmLevel> = GemmLevel::ALL.into_iter().filter(|l| l.available()).collect();
    if !levels.contains(&GemmLevel::Avx512Vnni) {
        eprintln!("note: no AVX-512 VNNI on this CPU; that integer GEMM is not exercised");
    }
    let mut r = rng(8);
    for ty in INTEGER_TYPES {
        for (rows, k) in [(8, 32), (21, 64), (30, 64), (40, 576)] {
            let k = cols(ty, k);
            let w = random_weights(&mut r, ty, rows, k);
            let view = WeightView::new(ty, rows, k, &w).unwrap();
            let packed = Interleaved::pack(&view).unwrap();
            let groups = rows.div_ceil(GROUP);
            let nb = k / 32;
            for tokens in [6, 7, 9, 10, 11, 12, 13, 37] {
                let (_, acts) = q8_acts(&mut r, k, tokens);
                for &level in &levels {
                    let mut all = vec![f32::NAN; tokens * groups * GROUP];
                    packed.gemm(level, 0, groups, &acts, tokens, &mut all);
                    for t in 0..tokens {
                        for row in 0..rows {
                            let want = ggml_block_dot(ty, view.row(row), &acts[t * nb..(t + 1) * nb]);
                            let got = all[t * groups * GROUP + row];
                            assert_eq!(got.to_bits(), want.to_bits(), "{ty} {level:?} {rows}x{k} token {t} row {row}: {got} vs {want}");
                        }
                        let mut alone = vec![f32::NAN; GROUP];
                        let g = t % groups;
                        packed.gemm(level, g, g + 1, &acts[t * nb..(t + 1) * nb], 1, &mut alone);
                        let batched = &all[t * groups * GROUP + g * GROUP..][..GROUP];
                        assert!(alone.iter().zip(batched).all(|(a, b)| a.to_bits() == b.to_bits()), "{ty} {level:?} token {t} alone");
                    }
                }
            }
        }
    }
}

/// Q6_K near its largest block sums: codes 0 (value -32) but the first of each 16-value half
/// at 1 (value -31), under scales of -127, against activations of +127 and of -127 (quantized
/// from +1 and -1). Each half's sum is ∓127 · 511, odd, each scaled half ±8,241,919 (odd) and
/// each 32-value block ±16,483,838, between 2^23 and 2^24, where f32 still holds every
/// integer. The AVX-512 kernel applies the scales in floats; every level must equal the
/// reference.
#[test]
fn q6k_kernels_are_exact_at_their_largest_sums() {
    let levels: Vec<GemmLevel> = GemmLevel::ALL.into_iter().filter(|l| l.available()).collect();
    let (rows, k) = (2 * GROUP, 512);
    let mut block = vec![0u8; 210];
    for v in (0..256).step_by(16) {
        // Value v's low nibble (GGML Q6_K: 128-value halves, 32-value quarters).
        let (n, quarter, l) = (v / 128, (v % 128) / 32, v % 32);
        block[n * 64 + l + (quarter & 1) * 32] |= if quarter < 2 { 0x01 } else { 0x10 };
    }
    block[192..208].fill(0x81);
    block[208..210].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
    let w = block.repeat(rows * k / 256);
    let view = WeightView::new(GgmlType::Q6K, rows, k, &w).unwrap();
    let packed = Interleaved::pack(&view).unwrap();
    let x: Vec<f32> = (0..2 * k).map(|i| if i < k { 1.0 } else { -1.0 }).collect();
    let mut acts = vec![Q8Block::default(); 2 * k / 32];
    quantize_q8(&x, &mut acts);
    assert!(acts.iter().all(|a| a.qs.iter().all(|&q| q.abs() == 127)));
    for &level in &levels {
        let mut out = vec![f32::NAN; 2 * rows];
        packed.gemm(level, 0, rows / GROUP, &acts, 2, &mut out);
        for t in 0..2 {
            let want = ggml_block_dot(GgmlType::Q6K, view.row(0), &acts[t * k / 32..(t + 1) * k / 32]);
            assert!(want.abs() > 1e7 * acts[t * k / 32].d, "{level:?}: the sums are near 2^24");
            for (row, got) in out[t * rows..(t + 1) * rows].iter().enumerate() {
                assert_eq!(got.to_bits(), want.to_bits(), "{level:?} token {t} row {row}: {got} vs {want}");
            }
        }
    }
}

/// The integer path approximates the float dot within the activation quantization error:
/// per element at most d_a/2 = amax/254, plus the f16 rounding of d_a and s_a (2^-11
/// relative), so |error| <= Σ|w| · amax · (1/254 + 2/2048) per block. The k-quants compute
/// exactly Σ w · d_a · q_a in exact arithmetic (Q4_K's min term uses d_a · Σq_a, not the
/// f16 s_a; Q6_K has none), so the same bound holds with room for their epilogue's f32
/// roundings (2^-24 each, against the 2^-11 slack).
#[test]
fn interleaved_gemm_matches_float_reference() {
    let mut r = rng(2);
    for ty in INTEGER_TYPES {
        let (rows, k) = (16, cols(ty, 576));
        let w = random_weights(&mut r, ty, rows, k);
        let view = WeightView::new(ty, rows, k, &w).unwrap();
        let packed = Interleaved::pack(&view).unwrap();
        let (x, acts) = q8_acts(&mut r, k, 1);
        let mut got = vec![0f32; rows];
        packed.gemm(GemmLevel::Scalar, 0, rows / GROUP, &acts, 1, &mut got);
        let mut wf = vec![0f32; k];
        for (row, &got) in got.iter().enumerate() {
            tessera_kernels::ggml::dequantize_row(ty, view.row(row), &mut wf);
            let exact: f64 = wf.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let bound: f64 = wf
                .chunks(32)
                .zip(x.chunks(32))
                .map(|(wb, xb)| {
                    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                    wb.iter().map(|v| v.abs() as f64).sum::<f64>() * amax * (1.0 / 254.0 + 2.0 / 2048.0)
                })
                .sum();
            assert!((got as f64 - exact).abs() <= bound, "{ty} row {row}: {got} vs {exact} (bound {bound})");
        }
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

/// The many-row attention kernels against f64 sums, at every ISA level: head widths that take
/// the SIMD path (64, 128, 8) and one that does not (20), key counts that fill blocks of eight
/// and leave a tail, and zero (masked) weights. Bound: 1e-5 of the sum of |products|, a few
/// f32 roundings of each sum in any order. A score does not depend on the key's place in the
/// run: each key scored alone gives the same bits.
#[test]
fn attention_row_kernels_match_f64() {
    let mut r = rng(12);
    for (rows, n, d) in [(3, 21, 64), (1, 8, 128), (6, 5, 8), (2, 13, 20), (4, 0, 64)] {
        let q = randn(&mut r, rows * d);
        let k = randn(&mut r, n * d);
        let mut w: Vec<f32> = randn(&mut r, rows * n).iter().map(|x| x.abs()).collect();
        w.iter_mut().step_by(3).for_each(|x| *x = 0.0);
        let acc0 = randn(&mut r, rows * d);
        for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
            let mut scores = vec![f32::NAN; rows * n];
            dots_f32(isa, &q, &k, d, &mut scores);
            // A key scored alone gets the bits it gets inside the run.
            for (j, kj) in k.chunks_exact(d).enumerate() {
                let mut alone = vec![f32::NAN; rows];
                dots_f32(isa, &q, kj, d, &mut alone);
                for (i, a) in alone.iter().enumerate() {
                    assert_eq!(a.to_bits(), scores[i * n + j].to_bits(), "{isa:?} {rows}x{n}x{d}: key {j} alone");
                }
            }
            let mut acc = acc0.clone();
            weighted_sum_f32(isa, &w, &k, d, &mut acc);
            for i in 0..rows {
                for j in 0..n {
                    let terms = (0..d).map(|c| q[i * d + c] as f64 * k[j * d + c] as f64);
                    let (want, mag) = terms.fold((0f64, 0f64), |(s, m), t| (s + t, m + t.abs()));
                    let got = scores[i * n + j] as f64;
                    assert!((got - want).abs() <= 1e-5 * mag, "{isa:?} {rows}x{n}x{d} score ({i}, {j}): {got} vs {want}");
                }
                for c in 0..d {
                    let terms = (0..n).map(|j| w[i * n + j] as f64 * k[j * d + c] as f64);
                    let (sum, mag) = terms.fold((0f64, 0f64), |(s, m), t| (s + t, m + t.abs()));
                    let want = acc0[i * d + c] as f64 + sum;
                    let got = acc[i * d + c] as f64;
                    let tol = 1e-5 * (mag + (acc0[i * d + c] as f64).abs());
                    assert!((got - want).abs() <= tol, "{isa:?} {rows}x{n}x{d} sum ({i}, {c}): {got} vs {want}");
                }
            }
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
            let packed = Interleaved::supports(ty).then(|| Interleaved::pack(&view).unwrap());
            let weights = std::iter::once(Weight::Rows(view)).chain(packed.as_ref().map(Weight::Interleaved));
            for (isa, weight) in [Isa::Scalar].into_iter().chain(simd_isas()).flat_map(|i| weights.clone().map(move |w| (i, w))) {
                let kern = LinearKernel::with_isa(ty, isa, LinearPolicy::ALWAYS_GEMM);
                let ldy = rows + 3;
                let mut y = vec![-7.0f32; m * ldy];
                kern.forward(weight, &x, m, &mut y, ldy);
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
        let packed = Interleaved::supports(ty).then(|| Interleaved::pack(&view).unwrap());
        let weight = packed.as_ref().map_or(Weight::Rows(view), Weight::Interleaved);
        for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
            let kern = LinearKernel::with_isa(ty, isa, LinearPolicy::ALWAYS_DOT);
            assert_eq!(kern.wants_interleaved(), packed.is_some(), "{ty}");
            let mut y = vec![-7.0f32; m * ldy];
            kern.forward(weight, &x, m, &mut y, ldy);
            for i in 0..m {
                let got = &y[i * ldy..i * ldy + rows];
                let exp = &want[i * rows..(i + 1) * rows];
                // Int8 activations: error up to ~1% of the row magnitude (see the bound test above).
                let mag = exp.iter().fold(0f32, |a, v| a.max(v.abs()));
                let tol = if packed.is_some() { 2e-2 * mag } else { 1e-4 * mag };
                assert_close(got, exp, tol, 1e-4, &format!("{ty} {:?} token {i}", isa));
                assert!(y[i * ldy + rows..(i + 1) * ldy].iter().all(|&v| v == -7.0), "{ty}: wrote outside its columns");
            }
        }
    }
}

/// The integer small-batch path over more tokens than one activation-quantization task
/// takes (16: the rows are quantized in parallel pieces) gives each token the bits it gets
/// alone, at every ISA and for both activation blockings of the k-quants.
#[test]
fn small_integer_path_is_batch_invariant_across_quantization_tasks() {
    let mut r = rng(13);
    for ty in [GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::Q4K, GgmlType::Q6K] {
        let k = if ty.block_size() == 256 { 512 } else { 160 };
        let (rows, m) = (40, 37);
        let w = random_weights(&mut r, ty, rows, k);
        let x = randn(&mut r, m * k);
        let packed = Interleaved::pack(&WeightView::new(ty, rows, k, &w).unwrap()).unwrap();
        for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
            let kern = LinearKernel::with_isa(ty, isa, LinearPolicy::ALWAYS_DOT);
            let mut y = vec![0f32; m * rows];
            kern.forward(Weight::Interleaved(&packed), &x, m, &mut y, rows);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for i in 0..m {
                let mut one = vec![0f32; rows];
                kern.forward(Weight::Interleaved(&packed), &x[i * k..(i + 1) * k], 1, &mut one, rows);
                assert_eq!(bits(&y[i * rows..(i + 1) * rows]), bits(&one), "{ty} {isa:?}: token {i} of {m}");
            }
        }
    }
}

/// The AVX2 small-batch path of float rows (F32, F16, BF16: converted in registers, four rows
/// a pass) gives the bits of dequantizing each row and `dot_f32` with each token, for row
/// counts that leave a partial pass, widths with 8-column steps and a scalar tail, and any
/// token subset (each token's result alone equals it in the batch).
#[test]
fn float_rows_small_path_equals_dequantize_then_dot() {
    let mut r = rng(12);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for (rows, k, m) in [(1, 32, 1), (6, 77, 3), (37, 160, 5), (9, 2051, 2)] {
            let w = random_weights(&mut r, ty, rows, k);
            let x = randn(&mut r, m * k);
            let view = WeightView::new(ty, rows, k, &w).unwrap();
            for isa in simd_isas() {
                let mut want = vec![0f32; m * rows];
                let mut row = vec![0f32; k];
                for j in 0..rows {
                    tessera_kernels::ggml::dequantize_row(ty, view.row(j), &mut row);
                    for i in 0..m {
                        want[i * rows + j] = dot_f32(isa, &row, &x[i * k..(i + 1) * k]);
                    }
                }
                let kern = LinearKernel::with_isa(ty, isa, LinearPolicy::ALWAYS_DOT);
                let mut y = vec![0f32; m * rows];
                kern.forward(Weight::Rows(view), &x, m, &mut y, rows);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&y), bits(&want), "{ty} {rows}x{k} m={m}");
                let mut one = vec![0f32; rows];
                kern.forward(Weight::Rows(view), &x[(m - 1) * k..], 1, &mut one, rows);
                assert_eq!(bits(&one), bits(&want[(m - 1) * rows..]), "{ty} {rows}x{k}: last token alone");
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

/// Matrices grouped in one call whose kernels switch paths at different lengths (Q4_1 stays
/// on the integer GEMM, F16 leaves its dequantizing dot at 32 tokens) give, per segment,
/// exactly what each matrix gives alone on that segment.
#[test]
fn grouped_matrices_with_different_switch_points() {
    let mut r = rng(11);
    let (k, segments) = (256, [3usize, 40, 1]);
    let m: usize = segments.iter().sum();
    let x = randn(&mut r, m * k);
    let q41 = random_weights(&mut r, GgmlType::Q4_1, 24, k);
    let f16w = random_weights(&mut r, GgmlType::F16, 16, k);
    let packed = Interleaved::pack(&WeightView::new(GgmlType::Q4_1, 24, k, &q41).unwrap()).unwrap();
    let view_f16 = WeightView::new(GgmlType::F16, 16, k, &f16w).unwrap();
    for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
        let (ka, kb) = (LinearKernel::with_isa(GgmlType::Q4_1, isa, LinearPolicy::DEFAULT), LinearKernel::with_isa(GgmlType::F16, isa, LinearPolicy::DEFAULT));
        let (wa, wb) = (Weight::Interleaved(&packed), Weight::Rows(view_f16));
        let ldy = 24 + 16;
        let mut y = vec![f32::NAN; m * ldy];
        tessera_kernels::linear::ggml::forward_group(&[(&ka, wa, 0), (&kb, wb, 24)], &x, &segments, &mut y, ldy);
        let mut t0 = 0;
        for &len in &segments {
            let xs = &x[t0 * k..(t0 + len) * k];
            let (mut ya, mut yb) = (vec![0f32; len * 24], vec![0f32; len * 16]);
            ka.forward(wa, xs, len, &mut ya, 24);
            kb.forward(wb, xs, len, &mut yb, 16);
            for i in 0..len {
                let row = &y[(t0 + i) * ldy..(t0 + i + 1) * ldy];
                let want: Vec<f32> = ya[i * 24..(i + 1) * 24].iter().chain(&yb[i * 16..(i + 1) * 16]).copied().collect();
                assert!(row.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?} segment of {len}, token {i}");
            }
            t0 += len;
        }
    }
}

/// Integer matrices grouped into a wider output (another matrix's columns and unowned
/// columns between and after them) are written in place by the parallel tasks: each gives
/// the bits it gives alone into an output of its own width, and the other columns are
/// untouched, for every integer type and ISA (rows whole groups, so no task needs a tile).
#[test]
fn grouped_integer_matrices_write_their_columns_in_place() {
    let mut r = rng(12);
    let m = 5;
    for ty in all_types().filter(|&t| Interleaved::supports(t)) {
        let k = if ty.block_size() == 256 { 512 } else { 192 };
        let (rows_a, rows_b, gap) = (48, 32, 3);
        let x = randn(&mut r, m * k);
        let pack = |rows: usize, r: &mut _| Interleaved::pack(&WeightView::new(ty, rows, k, &random_weights(r, ty, rows, k)).unwrap()).unwrap();
        let (pa, pb) = (pack(rows_a, &mut r), pack(rows_b, &mut r));
        for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
            let kern = LinearKernel::with_isa(ty, isa, LinearPolicy::DEFAULT);
            let (wa, wb) = (Weight::Interleaved(&pa), Weight::Interleaved(&pb));
            let ldy = rows_a + gap + rows_b + 2;
            let mut y = vec![-7.0f32; m * ldy];
            tessera_kernels::linear::ggml::forward_group(&[(&kern, wa, 0), (&kern, wb, rows_a + gap)], &x, &[m], &mut y, ldy);
            let (mut ya, mut yb) = (vec![0f32; m * rows_a], vec![0f32; m * rows_b]);
            kern.forward(wa, &x, m, &mut ya, rows_a);
            kern.forward(wb, &x, m, &mut yb, rows_b);
            for t in 0..m {
                let row = &y[t * ldy..(t + 1) * ldy];
                let want: Vec<f32> = ya[t * rows_a..(t + 1) * rows_a]
                    .iter()
                    .chain(&[-7.0; 3])
                    .chain(&yb[t * rows_b..(t + 1) * rows_b])
                    .chain(&[-7.0; 2])
                    .copied()
                    .collect();
                assert!(row.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{ty} {isa:?} token {t}");
            }
            // Segments of 40 and 3 tokens: where the 40 take the GEMM (the scalar level switches
            // at 32) the 3 are written in place from output row 40 on, as they are alone.
            let segments = [40usize, 3];
            let mt: usize = segments.iter().sum();
            let xs = randn(&mut r, mt * k);
            let mut y = vec![-7.0f32; mt * ldy];
            tessera_kernels::linear::ggml::forward_group(&[(&kern, wa, 0), (&kern, wb, rows_a + gap)], &xs, &segments, &mut y, ldy);
            let mut t0 = 0;
            for &len in &segments {
                let (mut ya, mut yb) = (vec![0f32; len * rows_a], vec![0f32; len * rows_b]);
                kern.forward(wa, &xs[t0 * k..(t0 + len) * k], len, &mut ya, rows_a);
                kern.forward(wb, &xs[t0 * k..(t0 + len) * k], len, &mut yb, rows_b);
                for t in 0..len {
                    let row = &y[(t0 + t) * ldy..(t0 + t + 1) * ldy];
                    let want: Vec<f32> = ya[t * rows_a..(t + 1) * rows_a].iter().chain(&[-7.0; 3]).chain(&yb[t * rows_b..(t + 1) * rows_b]).chain(&[-7.0; 2]).copied().collect();
                    assert!(row.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{ty} {isa:?} segment of {len}, token {t}");
                }
                t0 += len;
            }
        }
    }
}

/// An empty range of groups writes nothing and refuses nothing, at every level.
#[test]
fn an_empty_group_range_is_a_no_op() {
    let mut r = rng(14);
    let (k, rows, tokens) = (64, 16, 3);
    let packed = Interleaved::pack(&WeightView::new(GgmlType::Q8_0, rows, k, &random_weights(&mut r, GgmlType::Q8_0, rows, k)).unwrap()).unwrap();
    let mut acts = vec![Q8Block::default(); tokens * k / 32];
    quantize_q8(&randn(&mut r, tokens * k), &mut acts);
    for level in [GemmLevel::Scalar].into_iter().chain([GemmLevel::Avx2, GemmLevel::Avx512Vnni].into_iter().filter(|l| l.available())) {
        packed.gemm(level, 1, 1, &acts, tokens, &mut []);
    }
}

/// GGML matrices grouped onto overlapping output columns would have two tasks write the same
/// floats at once: refused.
#[test]
#[should_panic(expected = "output columns overlap")]
fn grouped_matrices_with_overlapping_outputs_are_refused() {
    let mut r = rng(13);
    let (k, rows) = (64, 16);
    let packed = Interleaved::pack(&WeightView::new(GgmlType::Q8_0, rows, k, &random_weights(&mut r, GgmlType::Q8_0, rows, k)).unwrap()).unwrap();
    let kern = LinearKernel::with_isa(GgmlType::Q8_0, Isa::Scalar, LinearPolicy::DEFAULT);
    let w = Weight::Interleaved(&packed);
    let mut y = vec![0f32; 24];
    tessera_kernels::linear::ggml::forward_group(&[(&kern, w, 0), (&kern, w, 8)], &randn(&mut r, k), &[1], &mut y, 24);
}

/// The round-to-nearest quantizers write blocks that GGML's dequantization (checked against
/// Python `gguf` in the engine's tests) reads back close to the input. On N(0, 1) values the
/// rounding error is about a uniform half-step: RMS = step / √12 relative to the RMS input,
/// with the step ~ range / levels: Q8_0 ~2·3/254 → 0.007, Q6_K ~2·2.5/62 → 0.023 (plus the
/// 8-bit scale), Q5_K ~4.5/31 → 0.042, Q4_0, Q4_1 and Q4_K ~4.5/15 → 0.087 (plus the k-quants'
/// 6-bit scales and their min at most 0), Q3_K ~(amax 1.8 / 4)/√12 → 0.13 (plus its 6-bit
/// scales), Q2_K ~(range 3.5 / 3)/√12 → 0.34. The bounds leave about 50% over those estimates
/// (20-30% for Q3_K and Q2_K, whose estimate already sits near the measurement); F32 is exact.
#[test]
fn quantizers_round_trip_within_rounding_error() {
    use tessera_kernels::ggml::quantize::{quantize_row, QUANTIZABLE};
    let mut r = rng(13);
    for ty in QUANTIZABLE {
        let n = 256 * 16;
        let x = randn(&mut r, n);
        let mut q = vec![0u8; ty.row_bytes(n).unwrap()];
        quantize_row(ty, &x, &mut q);
        let mut back = vec![0f32; n];
        tessera_kernels::ggml::dequantize_row(ty, &q, &mut back);
        let rms = |v: &mut dyn Iterator<Item = f32>| (v.map(|e| (e as f64).powi(2)).sum::<f64>() / n as f64).sqrt();
        let rel = rms(&mut x.iter().zip(&back).map(|(a, b)| a - b)) / rms(&mut x.iter().copied());
        let bound = match ty {
            GgmlType::F32 => 0.0,
            GgmlType::Q8_0 => 0.011,
            GgmlType::Q6K => 0.035,
            GgmlType::Q5K => 0.065,
            GgmlType::Q3K => 0.2,
            GgmlType::Q2K => 0.4,
            _ => 0.13,
        };
        eprintln!("{ty}: relative RMS error {rel:.4} (bound {bound})");
        assert!(rel <= bound, "{ty}: relative RMS error {rel} > {bound}");
    }
}
