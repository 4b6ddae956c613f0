//! Causal grouped-query attention over cached K/V tiles with an online softmax.
//!
//! The cache hands attention a [`KvView`]: the layer's K and V formats and a list of
//! [`KvTile`]s (one per block), each holding one page per KV head in the format's own layout.
//! Decode reads compressed pages directly through the formats' score/accumulate hooks and
//! never materializes a dense K/V; prefill decodes one sub-tile at a time into a scratch. Scores and
//! the value accumulation are small GEMMs per (head, key sub-tile); the softmax is the
//! streaming (flash-attention) form, so memory stays bounded by the sub-tile size. Keys a
//! sequence also keeps exactly ([`ExactKeys`]: QJL's sink and recent window) replace the
//! codec's scores for the positions they cover.

use crate::cpu::{pool, SyncPtr};
use crate::cpu::dot::dots_f32;
use crate::kv::{dense, isa, KvCodec, KvPage};
use std::ops::Range;

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

/// `len` consecutive cached tokens starting at position `start`: one page per KV head for
/// the keys (`n_kv_heads` pages of `k.page_bytes(slots)` bytes, head after head) and the
/// same for the values. The tile's first token is in slot 0 of its pages.
#[derive(Clone, Copy, Debug)]
pub struct KvTile<'a> {
    /// Position of the first token.
    pub start: usize,
    /// Tokens in the tile (valid slots).
    pub len: usize,
    /// Slots per page (`>= len`).
    pub slots: usize,
    /// Key pages.
    pub keys: &'a [u8],
    /// Value pages.
    pub values: &'a [u8],
}

/// One layer's cache as attention reads it: the formats of K and V and the tiles.
#[derive(Clone)]
pub struct KvView<'a> {
    /// Key format.
    pub k: &'a dyn KvCodec,
    /// Value format.
    pub v: &'a dyn KvCodec,
    /// The cached tokens, in position order.
    pub tiles: Vec<KvTile<'a>>,
    /// Per KV head, `head_dim` factors the keys were divided by, channel by channel, before
    /// they were encoded (balancing a lossy key format's error against the queries); attention
    /// multiplies every query of the head's group by them, which leaves the scores unchanged
    /// in exact arithmetic. `None`: keys stored as they are.
    pub query_scale: Option<&'a [f32]>,
    /// Keys scored exactly instead of through the key codec (QJL's sink and recent window);
    /// `None`: every key through the codec.
    pub exact: Option<ExactKeys<'a>>,
}

/// Keys a lossy key format's sequence also keeps exactly, in the space the codec stores keys
/// in (after the layout's key transform): the first positions (the attention sink) and the
/// most recent ones. A query at position `t` scores exactly every key it sees that is here
/// and either in the sink or at a position `> t - window`; the rest go through the codec.
#[derive(Clone, Copy, Debug)]
pub struct ExactKeys<'a> {
    /// How far back from a query its keys are scored exactly (the query's own key included).
    pub window: usize,
    /// Per KV head, the keys of positions `0..` (rows of `head_dim`).
    pub sink: &'a [Vec<f32>],
    /// Per KV head, the keys of positions `recent_start..` (rows of `head_dim`).
    pub recent: &'a [Vec<f32>],
    /// Position of the first row of `recent`.
    pub recent_start: usize,
}

impl ExactKeys<'_> {
    /// Calls `f(positions, rows)` for each run of keys of head `g` in `keys` that a query at
    /// position `t` scores exactly. Runs may overlap (a key in both the sink and the window);
    /// both give the same rows.
    fn runs(&self, g: usize, hd: usize, t: usize, keys: Range<usize>, mut f: impl FnMut(Range<usize>, &[f32])) {
        let seen = keys.start..keys.end.min(t + 1);
        let sink = &self.sink[g];
        let s = seen.start..seen.end.min(sink.len() / hd);
        if !s.is_empty() {
            f(s.clone(), &sink[s.start * hd..s.end * hd]);
        }
        let recent = &self.recent[g];
        let lo = seen.start.max((t + 1).saturating_sub(self.window)).max(self.recent_start);
        let hi = seen.end.min(self.recent_start + recent.len() / hd);
        if lo < hi {
            f(lo..hi, &recent[(lo - self.recent_start) * hd..(hi - self.recent_start) * hd]);
        }
    }
}

/// Replaces the scores of `row` (queries' scores against the keys at positions `keys`, one
/// per key) that the view keeps exactly with `scale · <query, key>`, for a query of KV head
/// `g` at position `t`.
fn exact_scores(kv: &KvView<'_>, g: usize, t: usize, query: &[f32], keys: Range<usize>, scale: f32, row: &mut [f32]) {
    let Some(exact) = &kv.exact else { return };
    let hd = query.len();
    exact.runs(g, hd, t, keys.clone(), |run, rows| {
        let dst = &mut row[run.start - keys.start..run.end - keys.start];
        dots_f32(isa(), query, rows, hd, dst);
        dst.iter_mut().for_each(|x| *x *= scale);
    });
}

impl<'a> KvView<'a> {
    /// Head `g`'s key page in `tile`.
    fn key_page(&self, tile: &KvTile<'a>, g: usize) -> KvPage<'a> {
        let n = self.k.page_bytes(tile.slots);
        KvPage { bytes: &tile.keys[g * n..(g + 1) * n], tokens: tile.slots }
    }

    /// Head `g`'s value page in `tile`.
    fn value_page(&self, tile: &KvTile<'a>, g: usize) -> KvPage<'a> {
        let n = self.v.page_bytes(tile.slots);
        KvPage { bytes: &tile.values[g * n..(g + 1) * n], tokens: tile.slots }
    }

    fn check(&self, shape: AttnShape) {
        assert!(self.k.head_dim() == shape.head_dim && self.v.head_dim() == shape.head_dim, "kv codec head dim");
        for t in &self.tiles {
            assert!(t.len <= t.slots, "kv tile longer than its pages");
            assert_eq!(t.keys.len(), shape.n_kv_heads * self.k.page_bytes(t.slots), "kv tile key bytes");
            assert_eq!(t.values.len(), shape.n_kv_heads * self.v.page_bytes(t.slots), "kv tile value bytes");
        }
        assert!(self.query_scale.is_none_or(|s| s.len() == shape.kv_width()), "kv query scale width");
        if let Some(e) = &self.exact {
            let whole = |v: &[Vec<f32>]| v.len() == shape.n_kv_heads && v.iter().all(|r| r.len().is_multiple_of(shape.head_dim));
            assert!(whole(e.sink) && whole(e.recent), "exact keys: one run of whole rows per KV head");
        }
    }

    /// `q` (rows of `q_width`) as the keys' storage expects it: each query head multiplied by
    /// its KV head's [`Self::query_scale`] (borrowed unchanged when there is none).
    fn scaled_queries<'q>(&self, shape: AttnShape, q: &'q [f32]) -> std::borrow::Cow<'q, [f32]> {
        if self.query_scale.is_none() {
            return q.into();
        }
        let (hd, group) = (shape.head_dim, shape.n_heads / shape.n_kv_heads);
        let mut out = q.to_vec();
        for row in out.chunks_exact_mut(shape.q_width()) {
            for (h, x) in row.chunks_exact_mut(hd).enumerate() {
                self.scale_query(h / group, x);
            }
        }
        out.into()
    }

    /// Multiplies one query head of KV head `g`'s group by the group's [`Self::query_scale`].
    fn scale_query(&self, g: usize, x: &mut [f32]) {
        if let Some(scale) = self.query_scale {
            let hd = x.len();
            x.iter_mut().zip(&scale[g * hd..(g + 1) * hd]).for_each(|(v, f)| *v *= f);
        }
    }
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
pub fn attention(shape: AttnShape, q: &[f32], m: usize, pos0: usize, kv: &KvView<'_>, out: &mut [f32]) {
    let (hd, qw) = (shape.head_dim, shape.q_width());
    assert!(shape.n_kv_heads > 0 && shape.n_heads.is_multiple_of(shape.n_kv_heads));
    assert_eq!(q.len(), m * qw);
    assert_eq!(out.len(), m * qw);
    kv.check(shape);
    let group = shape.n_heads / shape.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    if m < GEMM_MIN_QUERIES {
        let mut job = AttnJob { q, m, pos0, kv: kv.clone(), out };
        return decode_batch(shape, &mut [&mut job]);
    }
    let q = &*kv.scaled_queries(shape, q);
    let out_ptr = SyncPtr::new(out.as_mut_ptr());
    // Tasks are (KV head, block of queries): balances the pool, each block stops at the keys
    // its last query can see (half the work of masking a full square for a causal prefill),
    // and a compressed page is decoded once for all the query heads that share it.
    let blocks = m.div_ceil(QUERY_BLOCK);
    pool::for_each(shape.n_kv_heads * blocks, |task| {
        let (g, qb) = (task / blocks, task % blocks);
        let i0 = qb * QUERY_BLOCK;
        let mq = QUERY_BLOCK.min(m - i0);
        let q0 = pos0 + i0; // position of this block's first query
        let mut row_max = vec![f32::NEG_INFINITY; group * mq];
        let mut row_sum = vec![0f32; group * mq];
        let mut acc = vec![0f32; group * mq * hd];
        let mut s = vec![0f32; mq * SUB_TILE];
        let (mut kscratch, mut vscratch) = (Vec::new(), Vec::new());
        let qp = &q[i0 * qw..];
        for tile in &kv.tiles {
            let mut off = 0;
            while off < tile.len {
                let start = tile.start + off;
                if start > q0 + mq - 1 {
                    break;
                }
                let n = SUB_TILE.min(tile.len - off);
                let keys = dense(kv.k, g, kv.key_page(tile, g), off..off + n, &mut kscratch);
                let values = dense(kv.v, g, kv.value_page(tile, g), off..off + n, &mut vscratch);
                for hh in 0..group {
                    let h = g * group + hh;
                    let (rmax, rsum) = (&mut row_max[hh * mq..(hh + 1) * mq], &mut row_sum[hh * mq..(hh + 1) * mq]);
                    let acc = &mut acc[hh * mq * hd..(hh + 1) * mq * hd];
                    // SAFETY: s is mq x n (row stride n); q rows have stride qw; keys are n x hd
                    // (row stride hd), as `dense` returns them.
                    unsafe {
                        gemm::gemm(
                            mq, n, hd, s.as_mut_ptr(), 1, n as isize, false,
                            qp.as_ptr().add(h * hd), 1, qw as isize,
                            keys.as_ptr(), hd as isize, 1,
                            0.0, scale, false, false, false, gemm::Parallelism::None,
                        );
                    }
                    for i in 0..mq {
                        let query = &qp[i * qw + h * hd..i * qw + (h + 1) * hd];
                        exact_scores(kv, g, q0 + i, query, start..start + n, scale, &mut s[i * n..(i + 1) * n]);
                    }
                    for i in 0..mq {
                        let row = &mut s[i * n..(i + 1) * n];
                        let visible = (q0 + i + 1).saturating_sub(start).min(n);
                        if visible == 0 {
                            row.fill(0.0);
                            continue;
                        }
                        let tmax = row[..visible].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                        let new_max = rmax[i].max(tmax);
                        let corr = (rmax[i] - new_max).exp();
                        let mut sum = 0f32;
                        for p in row[..visible].iter_mut() {
                            *p = (*p - new_max).exp();
                            sum += *p;
                        }
                        row[visible..].fill(0.0);
                        rsum[i] = rsum[i] * corr + sum;
                        rmax[i] = new_max;
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
                            values.as_ptr(), 1, hd as isize,
                            1.0, 1.0, false, false, false, gemm::Parallelism::None,
                        );
                    }
                }
                off += n;
            }
        }
        for hh in 0..group {
            let h = g * group + hh;
            for i in 0..mq {
                let sum = row_sum[hh * mq + i];
                let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
                for d in 0..hd {
                    // SAFETY: (i0 + i, h*hd + d) is inside out (m x qw); each (head, block)
                    // belongs to one task.
                    unsafe { *out_ptr.get().add((i0 + i) * qw + h * hd + d) = acc[(hh * mq + i) * hd + d] * inv };
                }
            }
        }
    });
}

/// One sequence's attention: `m` query rows at positions `pos0..pos0 + m` over its cache.
pub struct AttnJob<'a> {
    /// `m × q_width` queries.
    pub q: &'a [f32],
    /// Query rows.
    pub m: usize,
    /// Position of the first query.
    pub pos0: usize,
    /// The sequence's cached keys/values for this layer (including the queries' own).
    pub kv: KvView<'a>,
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
        attention(shape, j.q, j.m, j.pos0, &j.kv, j.out);
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

/// A run of keys inside one tile: (tile index, first slot, count).
type Piece = (usize, usize, usize);

/// A decode job's key ranges: at most DECODE_SPLIT keys each, as tile pieces. A range spans
/// tile boundaries, so a paged cache's small blocks cost no extra tasks.
fn key_ranges(tiles: &[KvTile<'_>], end: usize) -> Vec<Vec<Piece>> {
    let mut ranges: Vec<Vec<Piece>> = vec![Vec::new()];
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

/// One decode task: scores of the queries of KV head `g`'s group against the keys of
/// `pieces`, softmax, and the weighted sum of values. Scores go through the key codec's
/// prepared queries (each query is prepared once per task, not per key).
fn decode_task(shape: AttnShape, job: (&[f32], usize, usize, &KvView<'_>), g: usize, pieces: &[Piece]) -> Partial {
    let (q, m, pos0, kv) = job;
    let (hd, qw) = (shape.head_dim, shape.q_width());
    let group = shape.n_heads / shape.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let rows = m * group;
    let pw = kv.k.query_width();
    let mut prepared = vec![0f32; rows * pw];
    // The queries as the keys are stored (scaled), one row per (query, head of the group),
    // when there is a scale to apply or exact keys to score against them.
    let copy = kv.query_scale.is_some() || kv.exact.is_some();
    let mut scaled = vec![0f32; if copy { rows * hd } else { 0 }];
    for i in 0..m {
        for hh in 0..group {
            let h = g * group + hh;
            let row = i * group + hh;
            let mut qh = &q[i * qw + h * hd..i * qw + (h + 1) * hd];
            if copy {
                let head = &mut scaled[row * hd..(row + 1) * hd];
                head.copy_from_slice(qh);
                kv.scale_query(g, head);
                qh = head;
            }
            kv.k.prepare_query(g, qh, &mut prepared[row * pw..(row + 1) * pw]);
        }
    }
    // Scores piece by piece (each block rows x n, pieces one after another), masked -inf.
    let len: usize = pieces.iter().map(|p| p.2).sum();
    let mut scores = vec![0f32; rows * len];
    let mut base = 0;
    for &(ti, off, n) in pieces {
        let tile = &kv.tiles[ti];
        let block = &mut scores[base * rows..(base + n) * rows];
        kv.k.scores(g, kv.key_page(tile, g), off..off + n, &prepared, block);
        let first = tile.start + off;
        for (row, r) in block.chunks_exact_mut(n).enumerate() {
            let i = row / group;
            let visible = (pos0 + i + 1).saturating_sub(first).min(n);
            r.iter_mut().for_each(|x| *x *= scale);
            if kv.exact.is_some() {
                exact_scores(kv, g, pos0 + i, &scaled[row * hd..(row + 1) * hd], first..first + n, scale, r);
            }
            r[visible..].fill(f32::NEG_INFINITY);
        }
        base += n;
    }
    let mut p = Partial { max: vec![f32::NEG_INFINITY; rows], sum: vec![0.0; rows], acc: vec![0.0; rows * hd] };
    for row in 0..rows {
        let mut base = 0;
        for &(_, _, n) in pieces {
            let r = &scores[base * rows + row * n..base * rows + (row + 1) * n];
            p.max[row] = r.iter().fold(p.max[row], |a, &b| a.max(b));
            base += n;
        }
    }
    // One exp per score, then the weighted sum of values.
    let mut base = 0;
    for &(ti, off, n) in pieces {
        let block = &mut scores[base * rows..(base + n) * rows];
        for (row, r) in block.chunks_exact_mut(n).enumerate() {
            let mx = p.max[row];
            if mx == f32::NEG_INFINITY {
                r.fill(0.0);
                continue;
            }
            // One running sum across pieces: the same rounding whatever the tile layout.
            let mut sum = p.sum[row];
            for v in r.iter_mut() {
                *v = (*v - mx).exp();
                sum += *v;
            }
            p.sum[row] = sum;
        }
        kv.v.accumulate(g, kv.value_page(&kv.tiles[ti], g), off..off + n, block, &mut p.acc);
        base += n;
    }
    p
}

/// Flash-decoding for jobs with a few queries each: tasks are (job, KV head, key range); each
/// task scores all query heads sharing the KV head against each key it reads (the cache is
/// read once per KV head, not once per query head), and the partial softmax states are merged
/// per job at the end.
fn decode_batch(shape: AttnShape, jobs: &mut [&mut AttnJob<'_>]) {
    let (hd, qw) = (shape.head_dim, shape.q_width());
    let group = shape.n_heads / shape.n_kv_heads;
    for j in jobs.iter() {
        assert!(j.q.len() == j.m * qw && j.out.len() == j.m * qw, "attention job shape");
        j.kv.check(shape);
    }
    let ranges: Vec<_> = jobs.iter().map(|j| key_ranges(&j.kv.tiles, j.pos0 + j.m)).collect();
    let tasks: Vec<(usize, usize, usize)> = (0..jobs.len())
        .flat_map(|ji| {
            let nr = ranges[ji].len();
            (0..shape.n_kv_heads).flat_map(move |g| (0..nr).map(move |r| (ji, g, r)))
        })
        .collect();
    let shared: Vec<(&[f32], usize, usize, &KvView<'_>)> = jobs.iter().map(|j| (j.q, j.m, j.pos0, &j.kv)).collect();
    let partials: Vec<Partial> = pool::map(tasks.len(), |i| {
        let (ji, g, r) = tasks[i];
        decode_task(shape, shared[ji], g, &ranges[ji][r])
    });
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
