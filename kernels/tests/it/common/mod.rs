//! Random test data: weights as random GGML blocks with sane scales, activations as random normals.

use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tessera_kernels::ggml::GgmlType;
use tessera_kernels::linear::int4::Int4Matrix;

/// Seeded RNG.
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Random floats in roughly N(0, 1) (sum of uniforms; never all zero).
pub fn randn(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| (0..4).map(|_| r.gen::<f32>() - 0.5).sum::<f32>() * 1.7).collect()
}

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// `rows` rows of `cols` values of type `ty`: random payload bytes with finite random scales.
pub fn random_weights(r: &mut ChaCha8Rng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let n = rows * ty.row_bytes(cols).expect("whole blocks");
    let mut b: Vec<u8> = (0..n).map(|_| r.gen()).collect();
    let ts = ty.type_size();
    let scale = |r: &mut ChaCha8Rng| (r.gen::<f32>() * 0.09 + 0.01) * if r.gen() { 1.0 } else { -1.0 };
    match ty {
        GgmlType::F32 => {
            for (c, v) in b.chunks_exact_mut(4).zip(randn(r, n / 4)) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (c, v) in b.chunks_exact_mut(2).zip(randn(r, n / 2)) {
                c.copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (c, v) in b.chunks_exact_mut(2).zip(randn(r, n / 2)) {
                c.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
            }
        }
        _ => {
            // Offsets of the f16 scale fields in each block.
            let fields: &[usize] = match ty {
                GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q8_1 => &[0, 2],
                GgmlType::Q2K => &[80, 82],
                GgmlType::Q3K => &[108],
                GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
                GgmlType::Q6K => &[208],
                GgmlType::Q8K => &[],
                _ => unreachable!(),
            };
            for blk in b.chunks_exact_mut(ts) {
                for &f in fields {
                    let s = scale(r);
                    put_f16(blk, f, s);
                }
                if ty == GgmlType::Q8K {
                    let s = scale(r);
                    blk[0..4].copy_from_slice(&s.to_le_bytes());
                }
            }
        }
    }
    b
}

/// Asserts `|a - b| <= atol + rtol * |b|` elementwise, reporting the worst element.
pub fn assert_close(a: &[f32], b: &[f32], atol: f32, rtol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let mut worst = (0usize, 0f32);
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        assert!(x.is_finite(), "{what}: element {i} is {x}");
        let excess = (x - y).abs() - (atol + rtol * y.abs());
        if excess > worst.1 {
            worst = (i, excess);
        }
    }
    assert!(worst.1 <= 0.0, "{what}: element {} is {} vs reference {}", worst.0, a[worst.0], b[worst.0]);
}

/// Random nonzero scale with either sign.
pub fn scale(r: &mut ChaCha8Rng) -> f32 {
    r.gen_range(0.005f32..0.05) * if r.gen() { 1.0 } else { -1.0 }
}

/// Random int4 matrix (values and zero points over the full -8..=7 range), `ceil(cols / group)`
/// groups per row.
pub fn int4(r: &mut ChaCha8Rng, rows: usize, cols: usize, group: usize, asym: bool) -> Int4Matrix {
    let q: Vec<i8> = (0..rows * cols).map(|_| r.gen_range(-8..=7)).collect();
    let ng = rows * cols.div_ceil(group);
    let scales = (0..ng).map(|_| scale(r)).collect();
    let zeros = asym.then(|| (0..ng).map(|_| r.gen_range(-8..=7)).collect());
    Int4Matrix::new(rows, cols, group, &q, scales, zeros).unwrap()
}
