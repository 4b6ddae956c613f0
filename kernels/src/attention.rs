//! Causal grouped-query attention over cached K/V tiles with an online softmax.
//!
//! The cache hands attention a list of [`KvTile`]s (one for a contiguous cache, one per
//! block for a paged one); attention never needs the whole context as one buffer. Scores and
//! the value accumulation are small GEMMs per (head, key sub-tile); the softmax is the
//! streaming (flash-attention) form, so memory stays bounded by the sub-tile size.

use crate::cpu::dot::{axpy_f32, dot_f32};
use crate::cpu::{CpuCaps, SyncPtr};
use rayon::prelude::*;

/// Head geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (divides `n_heads`).
    pub n_kv_heads: usize,
    /// Dimension per head.
    pub head_dim: usize,
}

impl AttnShape {
    /// Width of a query row (`n_heads * head_dim`).
    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }
    /// Width of a key or value row (`n_kv_heads * head_dim`).
    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// `len` consecutive cached tokens starting at position `start`; rows of `kv_width` f32.
#[derive(Clone, Copy, Debug)]
pub struct KvTile<'a> {
    /// Position of the first token.
    pub start: usize,
    /// Tokens in the tile.
    pub len: usize,
    /// `len * kv_width` key values.
    pub keys: &'a [f32],
    /// `len * kv_width` value values.
    pub values: &'a [f32],
}

/// Keys scored per inner step.
const SUB_TILE: usize = 128;
/// Queries per task.
const QUERY_BLOCK: usize = 64;
/// Below this many queries (decode steps) attention uses [`decode_attention`]: direct
/// dot/axpy loops split over the keys (a GEMM call's setup costs more than the work).
const GEMM_MIN_QUERIES: usize = 4;
/// Keys per decode task.
const DECODE_SPLIT: usize = 256;


/// Attention for `m` query rows at positions `pos0..pos0 + m` (query `i` sees keys at
/// positions `<= pos0 + i`). `q` and `out` are `m × q_width`.
pub fn attention(shape: AttnShape, q: &[f32], m: usize, pos0: usize, tiles: &[KvTile<'_>], out: &mut [f32]) {
    let (hd, qw, kw) = (shape.head_dim, shape.q_width(), shape.kv_width());
    assert!(shape.n_kv_heads > 0 && shape.n_heads.is_multiple_of(shape.n_kv_heads));
    assert_eq!(q.len(), m * qw);
    assert_eq!(out.len(), m * qw);
    for t in tiles {
        assert!(t.keys.len() == t.len * kw && t.values.len() == t.len * kw, "kv tile shape");
    }
    let group = shape.n_heads / shape.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    if m < GEMM_MIN_QUERIES {
        let mut job = AttnJob { q, m, pos0, tiles: tiles.to_vec(), out };
        return decode_batch(shape, &mut [&mut job]);
    }
    let out_ptr = SyncPtr::new(out.as_mut_ptr());
    // Tasks are (head, block of queries): balances the pool, and each block stops at the keys
    // its last query can see (half the work of masking a full square for a causal prefill).
    let blocks = m.div_ceil(QUERY_BLOCK);
    (0..shape.n_heads * blocks).into_par_iter().for_each(|task| {
        let (h, qb) = (task / blocks, task % blocks);
        let i0 = qb * QUERY_BLOCK;
        let mq = QUERY_BLOCK.min(m - i0);
        let q0 = pos0 + i0; // position of this block's first query
        let kvh = h / group;
        let mut row_max = vec![f32::NEG_INFINITY; mq];
        let mut row_sum = vec![0f32; mq];
        let mut acc = vec![0f32; mq * hd];
        let mut s = vec![0f32; mq * SUB_TILE];
        let qp = &q[i0 * qw..];
        for tile in tiles {
            let mut off = 0;
            while off < tile.len {
                let start = tile.start + off;
                if start > q0 + mq - 1 {
                    break;
                }
                let n = SUB_TILE.min(tile.len - off);
                let keys = &tile.keys[(off * kw + kvh * hd)..];
                let values = &tile.values[(off * kw + kvh * hd)..];
                // SAFETY: s is mq x n (row stride n); q rows have stride qw; keys/values rows
                // have stride kw and n rows remain from `off` (asserted tile shapes).
                unsafe {
                    gemm::gemm(
                        mq, n, hd, s.as_mut_ptr(), 1, n as isize, false,
                        qp.as_ptr().add(h * hd), 1, qw as isize,
                        keys.as_ptr(), kw as isize, 1,
                        0.0, scale, false, false, false, gemm::Parallelism::None,
                    );
                }
                for i in 0..mq {
                    let row = &mut s[i * n..(i + 1) * n];
                    let visible = (q0 + i + 1).saturating_sub(start).min(n);
                    if visible == 0 {
                        row.fill(0.0);
                        continue;
                    }
                    let tmax = row[..visible].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                    let new_max = row_max[i].max(tmax);
                    let corr = (row_max[i] - new_max).exp();
                    let mut sum = 0f32;
                    for p in row[..visible].iter_mut() {
                        *p = (*p - new_max).exp();
                        sum += *p;
                    }
                    row[visible..].fill(0.0);
                    row_sum[i] = row_sum[i] * corr + sum;
                    row_max[i] = new_max;
                    if corr != 1.0 {
                        acc[i * hd..(i + 1) * hd].iter_mut().for_each(|a| *a *= corr);
                    }
                }
                // acc (mq x hd) += P (mq x n) · V (n x hd).
                // SAFETY: shapes as above.
                unsafe {
                    gemm::gemm(
                        mq, hd, n, acc.as_mut_ptr(), 1, hd as isize, true,
                        s.as_ptr(), 1, n as isize,
                        values.as_ptr(), 1, kw as isize,
                        1.0, 1.0, false, false, false, gemm::Parallelism::None,
                    );
                }
                off += n;
            }
        }
        for i in 0..mq {
            let inv = if row_sum[i] > 0.0 { 1.0 / row_sum[i] } else { 0.0 };
            for d in 0..hd {
                // SAFETY: (i0 + i, h*hd + d) is inside out (m x qw); each (head, block) belongs to one task.
                unsafe { *out_ptr.get().add((i0 + i) * qw + h * hd + d) = acc[i * hd + d] * inv };
            }
        }
    });
}

/// One sequence's attention: `m` query rows at positions `pos0..pos0 + m` over its tiles.
pub struct AttnJob<'a> {
    /// `m × q_width` queries.
    pub q: &'a [f32],
    /// Query rows.
    pub m: usize,
    /// Position of the first query.
    pub pos0: usize,
    /// The sequence's cached keys/values (including the queries' own).
    pub tiles: Vec<KvTile<'a>>,
    /// `m × q_width` output.
    pub out: &'a mut [f32],
}

/// Attention for several sequences. Long query blocks (prefill) run one after another, each
/// parallel inside; the short ones (decode steps) share a single parallel region, so a batch
/// of decodes costs one fork-join per layer rather than one per sequence. Each job's result is
/// bit-identical to [`attention`] on it alone.
pub fn attention_batch(shape: AttnShape, jobs: &mut [AttnJob<'_>]) {
    let (mut short, mut long): (Vec<&mut AttnJob<'_>>, Vec<&mut AttnJob<'_>>) = jobs.iter_mut().partition(|j| j.m < GEMM_MIN_QUERIES);
    for j in long.iter_mut() {
        attention(shape, j.q, j.m, j.pos0, &j.tiles, j.out);
    }
    if !short.is_empty() {
        decode_batch(shape, &mut short);
    }
}

/// One task's partial softmax state for every (query row, head of the group).
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

/// A decode job's key ranges: at most DECODE_SPLIT keys each, as tile pieces (tile index,
/// offset, len). A range spans tile boundaries, so a paged cache's small blocks cost no extra
/// tasks and the arithmetic matches a contiguous cache's exactly.
fn key_ranges(tiles: &[KvTile<'_>], end: usize) -> Vec<Vec<(usize, usize, usize)>> {
    let mut ranges: Vec<Vec<(usize, usize, usize)>> = vec![Vec::new()];
    let mut filled = 0;
    for (ti, t) in tiles.iter().enumerate() {
        let visible = end.saturating_sub(t.start).min(t.len);
        let mut off = 0;
        while off < visible {
            if filled == DECODE_SPLIT {
                ranges.push(Vec::new());
                filled = 0;
            }
            let n = (DECODE_SPLIT - filled).min(visible - off);
            ranges.last_mut().expect("non-empty").push((ti, off, n));
            filled += n;
            off += n;
        }
    }
    ranges
}

/// Flash-decoding for jobs with a few queries each: tasks are (job, KV head, key range); each
/// task scores all query heads sharing the KV head against each key it reads (the cache is
/// read once per KV head, not once per query head), and the partial softmax states are merged
/// per job at the end.
fn decode_batch(shape: AttnShape, jobs: &mut [&mut AttnJob<'_>]) {
    let (hd, qw, kw) = (shape.head_dim, shape.q_width(), shape.kv_width());
    let group = shape.n_heads / shape.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let isa = CpuCaps::detect().best_isa();
    for j in jobs.iter() {
        assert!(j.q.len() == j.m * qw && j.out.len() == j.m * qw, "attention job shape");
        for t in &j.tiles {
            assert!(t.keys.len() == t.len * kw && t.values.len() == t.len * kw, "kv tile shape");
        }
    }
    let ranges: Vec<_> = jobs.iter().map(|j| key_ranges(&j.tiles, j.pos0 + j.m)).collect();
    let tasks: Vec<(usize, usize, usize)> = (0..jobs.len())
        .flat_map(|ji| {
            let nr = ranges[ji].len();
            (0..shape.n_kv_heads).flat_map(move |g| (0..nr).map(move |r| (ji, g, r)))
        })
        .collect();
    let shared: Vec<(&[f32], usize, usize, &[KvTile<'_>])> = jobs.iter().map(|j| (j.q, j.m, j.pos0, &j.tiles[..])).collect();
    let partials: Vec<Partial> = tasks
        .par_iter()
        .map(|&(ji, g, r)| {
            let (q, m, pos0, tiles) = shared[ji];
            let pieces = &ranges[ji][r];
            let rows = m * group;
            let len: usize = pieces.iter().map(|p| p.2).sum();
            let mut p = Partial { max: vec![f32::NEG_INFINITY; rows], sum: vec![0.0; rows], acc: vec![0.0; rows * hd] };
            // Pass 1: all scores of this range (row-major: query row x key), masked keys -inf.
            let mut scores = vec![f32::NEG_INFINITY; rows * len];
            let mut base = 0;
            for &(ti, off, n) in pieces {
                let tile = &tiles[ti];
                for i in 0..m {
                    let visible = (pos0 + i + 1).saturating_sub(tile.start + off).min(n);
                    for hh in 0..group {
                        let h = g * group + hh;
                        let qh = &q[i * qw + h * hd..i * qw + (h + 1) * hd];
                        let row0 = (i * group + hh) * len + base;
                        for (jj, sc) in scores[row0..row0 + visible].iter_mut().enumerate() {
                            let j = off + jj;
                            *sc = dot_f32(isa, qh, &tile.keys[j * kw + g * hd..j * kw + (g + 1) * hd]) * scale;
                        }
                    }
                }
                base += n;
            }
            // Pass 2: one max and one exp per score, then the weighted sum of values.
            for row in 0..rows {
                let sc = &mut scores[row * len..(row + 1) * len];
                let mx = sc.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                if mx == f32::NEG_INFINITY {
                    continue;
                }
                let mut sum = 0f32;
                for v in sc.iter_mut() {
                    *v = (*v - mx).exp();
                    sum += *v;
                }
                p.max[row] = mx;
                p.sum[row] = sum;
                let acc = &mut p.acc[row * hd..(row + 1) * hd];
                let mut base = 0;
                for &(ti, off, n) in pieces {
                    let tile = &tiles[ti];
                    for (jj, &w) in sc[base..base + n].iter().enumerate() {
                        if w != 0.0 {
                            let j = off + jj;
                            axpy_f32(isa, w, &tile.values[j * kw + g * hd..j * kw + (g + 1) * hd], acc);
                        }
                    }
                    base += n;
                }
            }
            p
        })
        .collect();
    let mut first = 0;
    for (ji, job) in jobs.iter_mut().enumerate() {
        let nr = ranges[ji].len();
        let rows = job.m * group;
        for g in 0..shape.n_kv_heads {
            let parts = &partials[first + g * nr..first + (g + 1) * nr];
            for row in 0..rows {
                let (i, hh) = (row / group, row % group);
                let h = g * group + hh;
                let mx = parts.iter().fold(f32::NEG_INFINITY, |a, p| a.max(p.max[row]));
                let dst = &mut job.out[i * qw + h * hd..i * qw + (h + 1) * hd];
                dst.fill(0.0);
                let mut total = 0f32;
                for p in parts.iter().filter(|p| p.max[row] > f32::NEG_INFINITY) {
                    let c = (p.max[row] - mx).exp();
                    total += p.sum[row] * c;
                    dst.iter_mut().zip(&p.acc[row * hd..(row + 1) * hd]).for_each(|(d, a)| *d += a * c);
                }
                let inv = if total > 0.0 { 1.0 / total } else { 0.0 };
                dst.iter_mut().for_each(|d| *d *= inv);
            }
        }
        first += shape.n_kv_heads * nr;
    }
}
