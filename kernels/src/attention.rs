//! Causal grouped-query attention over cached K/V tiles with an online softmax.
//!
//! The cache hands attention a [`KvView`]: the layer's K and V formats and a list of
//! [`KvTile`]s (one per block), each holding one page per KV head in the format's own layout.
//! Prefill and decode read compressed pages directly through the formats' score/accumulate
//! hooks and never materialize a dense K/V. The keys a query sees are cut into fixed ranges at
//! absolute positions, each softmaxed on its own and merged in order (flash-decoding), and
//! every query row is computed that one way, whether it is one decode token or one of a
//! prefill chunk's: a row's result never depends on the chunk or batch it runs in (see
//! [`attention_batch`]). Keys a sequence also keeps exactly ([`ExactKeys`]: QJL's sink and
//! recent window) replace the codec's scores for the positions they cover.

use crate::cpu::{pool, SyncPtr};
use crate::cpu::dot::dots_f32;
use crate::cpu::exp::{exp, exp_shifted};
use crate::cpu::softmax::{add_by_position, max_of, SUM_LANES};
use crate::kv::{isa, KvCodec, KvPage};
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

    /// Multiplies one query head of KV head `g`'s group by the group's [`Self::query_scale`].
    fn scale_query(&self, g: usize, x: &mut [f32]) {
        if let Some(scale) = self.query_scale {
            let hd = x.len();
            x.iter_mut().zip(&scale[g * hd..(g + 1) * hd]).for_each(|(v, f)| *v *= f);
        }
    }
}

/// Queries per prefill task: a task scores one block of a long job's queries against every
/// key range they see, one range after another.
const QUERY_BLOCK: usize = 64;
/// Below this many queries (decode steps) a job's tasks split its keys instead of its queries
/// (flash-decoding), so one token's attention still spreads over the pool.
const SPLIT_KEYS_BELOW: usize = 4;
/// Keys per key range. Ranges start at absolute positions (multiples of this), whatever the
/// job: every query row meets the same ranges and folds them the same way, so its result
/// does not depend on how many queries share its call (prefill chunk, prefix-cache hit, decode
/// step).
const KEY_RANGE: usize = 256;

/// Attention for `m` query rows at positions `pos0..pos0 + m` (query `i` sees keys at
/// positions `<= pos0 + i`). `q` and `out` are `m × q_width`.
pub fn attention(shape: AttnShape, q: &[f32], m: usize, pos0: usize, kv: &KvView<'_>, out: &mut [f32]) {
    let mut job = AttnJob { q, m, pos0, kv: kv.clone(), out };
    attention_batch(shape, std::slice::from_mut(&mut job));
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

/// Attention for several sequences, prefill chunks and decode steps alike, in one parallel
/// region.
///
/// Every query row is computed one way, whatever its job: the keys it sees are cut into
/// [`KEY_RANGE`] ranges at absolute positions; per range its scores come from the key codec,
/// then one max, the exps summed in key order and the values accumulated through the value
/// codec; the ranges' states are merged in range order. Long jobs split their queries into
/// blocks (a task per (KV head, query block) walks every range the block sees and writes its
/// rows); short ones (decode steps) split their keys (a task per (KV head, key range), merged
/// after the parallel region). So a row's bits do not depend on what else is batched, on the
/// prefill chunk it falls in, or on whether the rows before it came from the prefix cache.
pub fn attention_batch(shape: AttnShape, jobs: &mut [AttnJob<'_>]) {
    let (hd, qw) = (shape.head_dim, shape.q_width());
    assert!(shape.n_kv_heads > 0 && shape.n_heads.is_multiple_of(shape.n_kv_heads));
    let group = shape.n_heads / shape.n_kv_heads;
    for j in jobs.iter() {
        assert!(j.q.len() == j.m * qw && j.out.len() == j.m * qw, "attention job shape");
        j.kv.check(shape);
    }
    let mut tasks = Vec::new();
    for (ji, j) in jobs.iter().enumerate() {
        for g in 0..shape.n_kv_heads {
            if j.m < SPLIT_KEYS_BELOW {
                let ranges = key_ranges(&j.kv.tiles, j.pos0 + j.m);
                tasks.extend(ranges.into_iter().map(|r| Task { job: ji, g, rows: 0..j.m, ranges: vec![r], split_keys: true }));
            } else {
                for i0 in (0..j.m).step_by(QUERY_BLOCK) {
                    let rows = i0..(i0 + QUERY_BLOCK).min(j.m);
                    let ranges = key_ranges(&j.kv.tiles, j.pos0 + rows.end);
                    tasks.push(Task { job: ji, g, rows, ranges, split_keys: false });
                }
            }
        }
    }
    let shared: Vec<(&[f32], usize, &KvView<'_>, SyncPtr)> = jobs.iter_mut().map(|j| (j.q, j.pos0, &j.kv, SyncPtr::new(j.out.as_mut_ptr()))).collect();
    let partials: Vec<Vec<Partial>> = pool::map(tasks.len(), |ti| {
        let t = &tasks[ti];
        let (q, pos0, kv, out) = shared[t.job];
        let (i0, mq) = (t.rows.start, t.rows.len());
        let q = &q[i0 * qw..(i0 + mq) * qw];
        let prepared = Prepared::new(shape, q, mq, kv, t.g);
        let parts: Vec<Partial> = t.ranges.iter().map(|r| range_task(shape, (mq, pos0 + i0, kv), t.g, &prepared, r)).collect();
        if t.split_keys {
            return parts;
        }
        let parts: Vec<&Partial> = parts.iter().collect();
        for row in 0..mq * group {
            let (i, h) = (row / group, t.g * group + row % group);
            // SAFETY: head h of query row i0 + i lies inside the job's `m × q_width` output;
            // each (KV head, query block), hence each (row, head), belongs to one task.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.get().add((i0 + i) * qw + h * hd), hd) };
            merge_row(&parts, row, hd, dst);
            kv.v.finish_values(t.g, dst);
        }
        Vec::new()
    });
    // The key-split tasks' partial states, merged per job, KV head and row in range order.
    let mut ti = 0;
    while ti < tasks.len() {
        let t = &tasks[ti];
        let n = tasks[ti..].iter().take_while(|u| u.split_keys && u.job == t.job && u.g == t.g).count();
        if n == 0 {
            ti += 1;
            continue;
        }
        let parts: Vec<&Partial> = partials[ti..ti + n].iter().flatten().collect();
        let job = &mut jobs[t.job];
        for row in 0..job.m * group {
            let (i, h) = (row / group, t.g * group + row % group);
            let dst = &mut job.out[i * qw + h * hd..i * qw + (h + 1) * hd];
            merge_row(&parts, row, hd, dst);
            job.kv.v.finish_values(t.g, dst);
        }
        ti += n;
    }
}

/// One parallel task of [`attention_batch`]: the queries `rows` of job `job` and KV head `g`
/// over `ranges` (all the ranges the rows see, or one of them when the job splits its keys).
struct Task {
    job: usize,
    g: usize,
    rows: Range<usize>,
    ranges: Vec<Vec<Piece>>,
    split_keys: bool,
}

/// Softmax-merges the partial states of one row (a query and a head of the group) over
/// consecutive key ranges, in order, into that head's output `dst`.
fn merge_row(parts: &[&Partial], row: usize, hd: usize, dst: &mut [f32]) {
    let mx = parts.iter().fold(f32::NEG_INFINITY, |a, p| a.max(p.max[row]));
    dst.fill(0.0);
    let mut total = 0f32;
    for p in parts.iter().filter(|p| p.max[row] > f32::NEG_INFINITY) {
        let c = exp(p.max[row] - mx);
        total += p.sum[row] * c;
        dst.iter_mut().zip(&p.acc[row * hd..(row + 1) * hd]).for_each(|(d, a)| *d += a * c);
    }
    let inv = if total > 0.0 { 1.0 / total } else { 0.0 };
    dst.iter_mut().for_each(|d| *d *= inv);
}

/// One key range's partial softmax state for every (query row, head of the group).
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

/// A run of keys inside one tile: (tile index, first slot, count).
type Piece = (usize, usize, usize);

/// The keys before `end` as ranges of tile pieces, cut at absolute positions that are
/// multiples of [`KEY_RANGE`] (a range spans tile boundaries, so a paged cache's small blocks
/// cost no extra tasks). Always at least one range, possibly empty.
fn key_ranges(tiles: &[KvTile<'_>], end: usize) -> Vec<Vec<Piece>> {
    let mut ranges: Vec<Vec<Piece>> = vec![Vec::new()];
    for (ti, t) in tiles.iter().enumerate() {
        let visible = end.saturating_sub(t.start).min(t.len);
        let mut off = 0;
        while off < visible {
            let pos = t.start + off;
            if pos.is_multiple_of(KEY_RANGE) && !ranges.last().expect("non-empty").is_empty() {
                ranges.push(Vec::new());
            }
            let n = (KEY_RANGE - pos % KEY_RANGE).min(visible - off);
            ranges.last_mut().expect("non-empty").push((ti, off, n));
            off += n;
        }
    }
    ranges
}

/// A task's queries of KV head `g`'s group, one row per (query, head of the group): prepared
/// for the key codec, and (when there is a query scale to apply or exact keys to score) as the
/// keys are stored. Made once per task, whatever the number of key ranges it walks.
struct Prepared {
    /// `rows × query_width` for [`KvCodec::scores`].
    codec: Vec<f32>,
    /// `rows × head_dim`, or empty.
    scaled: Vec<f32>,
}

impl Prepared {
    fn new(shape: AttnShape, q: &[f32], m: usize, kv: &KvView<'_>, g: usize) -> Prepared {
        let (hd, qw) = (shape.head_dim, shape.q_width());
        let group = shape.n_heads / shape.n_kv_heads;
        let (rows, pw) = (m * group, kv.k.query_width());
        let mut codec = vec![0f32; rows * pw];
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
                kv.k.prepare_query(g, qh, &mut codec[row * pw..(row + 1) * pw]);
            }
        }
        Prepared { codec, scaled }
    }
}

/// One task's work on one key range: scores of the `m` queries at `pos0..` (prepared) of KV
/// head `g`'s group against the keys of `pieces`, softmax, and the weighted sum of values.
/// Every row's arithmetic depends on its own query and the range's keys only.
fn range_task(shape: AttnShape, (m, pos0, kv): (usize, usize, &KvView<'_>), g: usize, q: &Prepared, pieces: &[Piece]) -> Partial {
    let hd = shape.head_dim;
    let group = shape.n_heads / shape.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let rows = m * group;
    let (prepared, scaled) = (&q.codec, &q.scaled);
    let pw = kv.k.query_width();
    // The rows before `seen(first)` belong to queries before a piece's first key: they see
    // none of it, so they are not scored (left at -inf), exponentiated or accumulated, and
    // a prefill's query block skips the pieces past its diagonal. The other rows' arithmetic
    // is the same either way.
    let seen = |first: usize| first.saturating_sub(pos0).min(m) * group;
    // Scores piece by piece (each block rows x n, pieces one after another), masked -inf.
    let len: usize = pieces.iter().map(|p| p.2).sum();
    let mut scores = vec![0f32; rows * len];
    let mut base = 0;
    for &(ti, off, n) in pieces {
        let tile = &kv.tiles[ti];
        let block = &mut scores[base * rows..(base + n) * rows];
        let first = tile.start + off;
        let r0 = seen(first);
        block[..r0 * n].fill(f32::NEG_INFINITY);
        if r0 < rows {
            kv.k.scores(g, kv.key_page(tile, g), off..off + n, &prepared[r0 * pw..], &mut block[r0 * n..]);
        }
        for (row, r) in block.chunks_exact_mut(n).enumerate().skip(r0) {
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
            p.max[row] = max_of(r, p.max[row]);
            base += n;
        }
    }
    // One exp per score, then the weighted sum of values. Each row's exps are summed in eight
    // lanes chosen by the key's absolute position, folded in a fixed order at the end: the
    // same rounding whatever the tile layout, without one long chain of dependent adds.
    let mut lanes = vec![[0f32; SUM_LANES]; rows];
    let mut base = 0;
    for &(ti, off, n) in pieces {
        let block = &mut scores[base * rows..(base + n) * rows];
        let first = kv.tiles[ti].start + off;
        let r0 = seen(first);
        for (row, r) in block.chunks_exact_mut(n).enumerate().skip(r0) {
            let mx = p.max[row];
            if mx == f32::NEG_INFINITY {
                r.fill(0.0);
                continue;
            }
            exp_shifted(r, mx);
            add_by_position(&mut lanes[row], first, r);
        }
        if r0 < rows {
            kv.v.accumulate(g, kv.value_page(&kv.tiles[ti], g), off..off + n, &block[r0 * n..], &mut p.acc[r0 * hd..]);
        }
        base += n;
    }
    for (s, l) in p.sum.iter_mut().zip(&lanes) {
        *s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    }
    p
}
