//! Unpacking 4-bit fields from int32 words, in the orders checkpoints use, and building an
//! [`Int4Matrix`] from unsigned or signed values (with act-order column permutation).

use crate::checkpoint::LoadError;
use super::tensor_err;
use super::{shared, SharedMatrix};
use tessera_kernels::linear::Int4Matrix;

/// Where element `k` of a group of eight lives in a word: nibble `NIBBLE[k]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NibbleOrder {
    /// Element `k` in nibble `k` (compressed-tensors, GPTQ, Quark `pack_method: order`).
    Plain,
    /// Element `k` in nibble `[0, 4, 1, 5, 2, 6, 3, 7][k]` (AWQ, Quark `pack_method: reorder`).
    Interleaved,
}

impl NibbleOrder {
    fn nibble(self, k: usize) -> usize {
        match self {
            NibbleOrder::Plain => k,
            NibbleOrder::Interleaved => [0, 4, 1, 5, 2, 6, 3, 7][k],
        }
    }
}

/// Unpacks words packed along the last axis: `words` is `rows × wpr` (row-major), the result
/// `rows × n` fields (0..=15), `n <= 8 * wpr` (padding fields dropped).
pub fn unpack_last_axis(words: &[i32], rows: usize, wpr: usize, n: usize, order: NibbleOrder) -> Vec<u8> {
    let mut out = vec![0u8; rows * n];
    for r in 0..rows {
        for c in 0..n {
            let w = words[r * wpr + c / 8] as u32;
            out[r * n + c] = ((w >> (4 * order.nibble(c % 8))) & 0xF) as u8;
        }
    }
    out
}

/// Unpacks words packed along the first axis: `words` is `wrows × cols`, word `(r, c)` holds
/// elements `(8r + k, c)`; the result is `n × cols` fields (0..=15), `n <= 8 * wrows`.
pub fn unpack_first_axis(words: &[i32], cols: usize, n: usize, order: NibbleOrder) -> Vec<u8> {
    let mut out = vec![0u8; n * cols];
    for r in 0..n {
        for c in 0..cols {
            let w = words[(r / 8) * cols + c] as u32;
            out[r * cols + c] = ((w >> (4 * order.nibble(r % 8))) & 0xF) as u8;
        }
    }
    out
}

/// Transposes a row-major `rows × cols` matrix.
pub fn transpose<T: Copy + Default>(v: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut out = vec![T::default(); v.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = v[r * cols + c];
        }
    }
    out
}

/// Signed value of a two's-complement nibble.
pub fn twos_complement(u: u8) -> i8 {
    ((u << 4) as i8) >> 4
}

/// Builds the kernel matrix for `rows × cols` signed values `q` (-8..=7) with
/// `rows × ceil(cols / group)` scales and optional zero points (the last group may be short).
/// With `g_idx` (act-order: the group of each input column), columns are sorted by group and
/// the input permutation is returned alongside. `name` is the tensor errors name.
#[allow(clippy::too_many_arguments)]
pub fn int4_matrix(
    name: &str,
    rows: usize,
    cols: usize,
    group: usize,
    q: Vec<i8>,
    scales: Vec<f32>,
    zeros: Option<Vec<i8>>,
    g_idx: Option<&[i32]>,
) -> Result<(SharedMatrix, Option<Vec<u32>>), LoadError> {
    let group = group.min(cols);
    if group == 0 || scales.len() != rows * cols.div_ceil(group) {
        return Err(tensor_err(name, format!("{} scales for {rows} rows of {cols} columns in groups of {group}", scales.len())));
    }
    let (q, perm) = match g_idx.map(|g| act_order_permutation(name, g, cols, group)).transpose()?.flatten() {
        None => (q, None),
        Some(perm) => {
            let mut sorted = vec![0i8; q.len()];
            for r in 0..rows {
                for (c, &src) in perm.iter().enumerate() {
                    sorted[r * cols + c] = q[r * cols + src as usize];
                }
            }
            (sorted, Some(perm))
        }
    };
    let m = Int4Matrix::new(rows, cols, group, &q, scales, zeros).map_err(|e| tensor_err(name, e))?;
    Ok((shared(m), perm))
}

/// The column order that makes act-order groups contiguous, or `None` when `g_idx` is
/// already `c / group`. Each group must hold exactly as many columns as `c / group` gives it.
fn act_order_permutation(name: &str, g_idx: &[i32], cols: usize, group: usize) -> Result<Option<Vec<u32>>, LoadError> {
    if g_idx.len() != cols {
        return Err(tensor_err(name, format!("g_idx has {} entries for {cols} input columns", g_idx.len())));
    }
    if g_idx.iter().enumerate().all(|(c, &g)| g as usize == c / group && g >= 0) {
        return Ok(None);
    }
    let groups = cols.div_ceil(group);
    let mut counts = vec![0usize; groups];
    for &g in g_idx {
        let gi = usize::try_from(g).ok().filter(|&g| g < groups).ok_or_else(|| tensor_err(name, format!("g_idx entry {g} outside 0..{groups}")))?;
        counts[gi] += 1;
    }
    let size = |g: usize| group.min(cols - g * group);
    if let Some(g) = (0..groups).find(|&g| counts[g] != size(g)) {
        return Err(tensor_err(name, format!("act-order group {g} has {} columns, expected {}", counts[g], size(g))));
    }
    let mut perm: Vec<u32> = (0..cols as u32).collect();
    perm.sort_by_key(|&c| g_idx[c as usize]);
    Ok(Some(perm))
}
