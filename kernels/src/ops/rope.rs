//! Rotary position embedding, HF "rotate_half" layout (pairs `i` and `i + d/2`).
//!
//! GGUF Llama checkpoints store Q/K rows permuted for llama.cpp's interleaved variant;
//! the loader undoes that permutation so one layout serves every checkpoint.

/// Precomputed inverse frequencies for one head dimension.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    /// Frequencies `theta^(-2i/rot_dim)` for the first `rot_dim` dims of each head.
    pub fn new(rot_dim: usize, theta: f32) -> Self {
        let inv_freq = (0..rot_dim / 2).map(|i| theta.powf(-2.0 * i as f32 / rot_dim as f32)).collect();
        Rope { inv_freq }
    }

    /// `(sin, cos)` of every frequency at each position, `positions.len() * rot_dim/2` pairs.
    pub fn table(&self, positions: impl Iterator<Item = usize>) -> Vec<(f32, f32)> {
        positions.flat_map(|p| self.inv_freq.iter().map(move |&f| (p as f32 * f).sin_cos())).collect()
    }

    /// Rotates every head of one token's row `x` (`n_heads * head_dim`) by its `(sin, cos)` table row.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, sin_cos: &[(f32, f32)]) {
        let half = self.inv_freq.len();
        assert!(2 * half <= head_dim && sin_cos.len() == half);
        for head in x.chunks_exact_mut(head_dim) {
            let (a, b) = head[..2 * half].split_at_mut(half);
            for ((x0, x1), &(sin, cos)) in a.iter_mut().zip(b.iter_mut()).zip(sin_cos) {
                let (u, v) = (*x0, *x1);
                *x0 = u * cos - v * sin;
                *x1 = u * sin + v * cos;
            }
        }
    }

    /// Pairs per head (`rot_dim / 2`).
    pub fn half_dim(&self) -> usize {
        self.inv_freq.len()
    }
}
