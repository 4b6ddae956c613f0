//! Online rotations of a linear layer (QuaRot's and SpinQuant's R4, QuIP's two sides): every
//! row of activations (or of outputs) is multiplied by a block-diagonal orthogonal matrix
//! before the layer reads it (after it writes them), whose inverse was folded into the layer's
//! weights offline. A Sylvester Hadamard block runs as a fast Walsh-Hadamard transform (`b log
//! b` adds per block); any other orthogonal block (a randomized Hadamard, a random rotation)
//! as a dense `b x b` matrix product (the `gemm` crate, rows in parallel tasks).

use crate::cpu::pool;
use crate::cpu::scratch::with_f32;

/// `x ↦ x · T` for each row of activations, `T` block-diagonal with equal square blocks.
#[derive(Clone, Debug, PartialEq)]
pub enum BlockTransform {
    /// The Sylvester Hadamard matrix of order `block` (a power of two), scaled by
    /// `1 / sqrt(block)` so it is orthogonal: `H[i][j] = (-1)^popcount(i & j) / sqrt(block)`.
    Hadamard {
        /// Block order.
        block: usize,
    },
    /// A dense orthogonal block, row-major: row `i` of the output block is `Σ_k x[k] m[k][i]`.
    Dense {
        /// Block order.
        block: usize,
        /// `block * block` values.
        m: Vec<f32>,
    },
}

/// Rows per parallel task of the dense form (each task one matrix product per block column).
const DENSE_ROWS_PER_TASK: usize = 64;

/// Rows per parallel task of the fast transform, and the input size from which it runs in
/// parallel (below, a task's start costs more than the transform).
const HADAMARD_ROWS_PER_TASK: usize = 32;
const PARALLEL_VALUES: usize = 1 << 16;

/// The Sylvester Hadamard matrix of order 8 (unnormalized).
const H8: [[f32; 8]; 8] = {
    let mut h = [[0f32; 8]; 8];
    let mut i = 0;
    while i < 8 {
        let mut j = 0;
        while j < 8 {
            h[i][j] = if (i & j).count_ones() % 2 == 0 { 1.0 } else { -1.0 };
            j += 1;
        }
        i += 1;
    }
    h
};

impl BlockTransform {
    /// The block order.
    pub fn block(&self) -> usize {
        match self {
            BlockTransform::Hadamard { block } | BlockTransform::Dense { block, .. } => *block,
        }
    }

    /// A short description for plans: `hadamard/512`, `dense/128`.
    pub fn describe(&self) -> String {
        match self {
            BlockTransform::Hadamard { block } => format!("hadamard/{block}"),
            BlockTransform::Dense { block, .. } => format!("dense/{block}"),
        }
    }

    /// Applies the transform in place to `x`, rows of `cols` values (`cols` a multiple of the
    /// block order).
    pub fn apply(&self, x: &mut [f32], cols: usize) {
        let b = self.block();
        assert!(cols.is_multiple_of(b) && x.len().is_multiple_of(cols), "{} values in rows of {cols} for blocks of {b}", x.len());
        match self {
            BlockTransform::Hadamard { .. } => {
                if x.len() >= PARALLEL_VALUES {
                    pool::for_each_chunk(x, HADAMARD_ROWS_PER_TASK * cols, |_, rows| rows.chunks_exact_mut(b).for_each(fwht))
                } else {
                    x.chunks_exact_mut(b).for_each(fwht)
                }
            }
            BlockTransform::Dense { m, .. } => {
                // Per task and block column, the task's rows' blocks times `m` as one product
                // (the matrix read once per task, not once per row: at 1536 it is 9 MiB).
                pool::for_each_chunk(x, DENSE_ROWS_PER_TASK * cols, |_, rows| {
                    let n = rows.len() / cols;
                    with_f32(n * b, |out| {
                        for j in (0..cols).step_by(b) {
                            // SAFETY: `out` is n x b row-major; the left operand is n rows of b
                            // values at stride `cols` from column j (in bounds: j + b <= cols,
                            // rows.len() = n * cols); `m` is b x b row-major; `dst = a · b`
                            // (`read_dst` false).
                            unsafe {
                                gemm::gemm(n, b, b, out.as_mut_ptr(), 1, b as isize, false, rows.as_ptr().add(j), 1, cols as isize, m.as_ptr(), 1, b as isize, 0.0, 1.0, false, false, false, gemm::Parallelism::None);
                            }
                            for (r, o) in out.chunks_exact(b).enumerate() {
                                rows[r * cols + j..r * cols + j + b].copy_from_slice(o);
                            }
                        }
                    })
                })
            }
        }
    }
}

/// The normalized fast Walsh-Hadamard transform of one block (its length a power of two).
/// The first three butterfly passes run at once as an 8 x 8 product per run of 8 values
/// (eight broadcast multiply-adds the compiler vectorizes; the butterflies of spans 1, 2 and
/// 4 would not vectorize), the later ones as vector adds over the two halves of each span.
fn fwht(v: &mut [f32]) {
    let n = v.len();
    let mut h = 1;
    if n >= 8 {
        for c in v.chunks_exact_mut(8) {
            let x: [f32; 8] = c.try_into().expect("a run of 8");
            let mut o = [0f32; 8];
            for (xk, hk) in x.iter().zip(&H8) {
                o.iter_mut().zip(hk).for_each(|(o, &s)| *o += xk * s);
            }
            c.copy_from_slice(&o);
        }
        h = 8;
    }
    while h < n {
        for start in (0..n).step_by(2 * h) {
            let (lo, hi) = v[start..start + 2 * h].split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (x, y) = (*a, *b);
                *a = x + y;
                *b = x - y;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    v.iter_mut().for_each(|x| *x *= s);
}

/// The Sylvester Hadamard matrix of order `n` (a power of two), normalized, row-major.
pub fn sylvester(n: usize) -> Vec<f32> {
    assert!(n.is_power_of_two(), "Sylvester Hadamard matrices have power-of-two orders, not {n}");
    let s = 1.0 / (n as f32).sqrt();
    (0..n * n).map(|ij| if ((ij / n) & (ij % n)).count_ones().is_multiple_of(2) { s } else { -s }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Scalar reference: each block times `m` in f64.
    fn reference(x: &[f32], cols: usize, b: usize, m: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; x.len()];
        for (xb, ob) in x.chunks_exact(b).zip(out.chunks_exact_mut(b)) {
            for (i, o) in ob.iter_mut().enumerate() {
                *o = (0..b).map(|k| xb[k] as f64 * m[k * b + i] as f64).sum::<f64>() as f32;
            }
        }
        assert_eq!(x.len() % cols, 0);
        out
    }

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| (0..4).map(|_| r.gen::<f32>() - 0.5).sum::<f32>() * 1.7).collect()
    }

    /// The fast transform equals the dense product with the Sylvester matrix, for every block
    /// order used in practice, on random rows (f32 sums of `log2 b` rounding steps against an
    /// f64 product: 1e-5 relative to the row's scale).
    #[test]
    fn fast_hadamard_is_the_sylvester_product() {
        for (b, cols) in [(1, 7), (2, 6), (64, 192), (128, 1536), (512, 1536)] {
            let x = random(3 * cols, b as u64);
            let mut y = x.clone();
            BlockTransform::Hadamard { block: b }.apply(&mut y, cols);
            let r = reference(&x, cols, b, &sylvester(b));
            let err = y.iter().zip(&r).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < 1e-5 * (b as f32).log2().max(1.0) * 4.0, "block {b}: max error {err}");
            assert!(y.iter().zip(&x).any(|(a, b)| a != b) || b == 1);
        }
    }

    /// The matrix is orthogonal and symmetric: applying it twice gives the input back.
    #[test]
    fn hadamard_is_its_own_inverse() {
        let h = sylvester(16);
        for i in 0..16 {
            for j in 0..16 {
                let d: f32 = (0..16).map(|k| h[i * 16 + k] * h[j * 16 + k]).sum();
                assert!((d - if i == j { 1.0 } else { 0.0 }).abs() < 1e-6);
                assert_eq!(h[i * 16 + j], h[j * 16 + i]);
            }
        }
        let x = random(4 * 256, 9);
        let mut y = x.clone();
        let t = BlockTransform::Hadamard { block: 256 };
        t.apply(&mut y, 256);
        t.apply(&mut y, 256);
        assert!(y.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-5));
    }

    /// The dense form equals the scalar reference for a random (non-symmetric) block, over
    /// enough rows to be split across tasks (the last one short).
    #[test]
    fn dense_block_is_the_matrix_product() {
        let (b, cols) = (24, 96);
        let m = random(b * b, 3);
        let x = random(150 * cols, 4);
        let mut y = x.clone();
        BlockTransform::Dense { block: b, m: m.clone() }.apply(&mut y, cols);
        let r = reference(&x, cols, b, &m);
        assert!(y.iter().zip(&r).all(|(a, b)| (a - b).abs() < 1e-4 * (1.0 + b.abs())), "dense block differs");
    }
}
