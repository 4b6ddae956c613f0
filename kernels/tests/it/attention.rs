//! Attention over paged KV caches in every storage format, against the f64 reference over
//! the same pages decoded; batching and tile layout leave decode results bit-identical.

use crate::common;

use common::{assert_close, randn, rng};
use tessera_kernels::attention::{attention, attention_batch, AttnJob, AttnShape, ExactKeys, KvTile, KvView};
use tessera_kernels::kv::{codec, CodecOptions, KvCodec, KvFormat, KvGeometry, KvPage, KvPageMut, KvRole};
use tessera_kernels::reference;

/// A cache of `total` tokens in tiles of the given lengths, encoded with codecs `k`/`v`.
pub(crate) struct Paged {
    k: Box<dyn KvCodec>,
    v: Box<dyn KvCodec>,
    /// (start, len, key pages, value pages); pages in u32 words so f32 pages are aligned.
    tiles: Vec<(usize, usize, Vec<u32>, Vec<u32>)>,
}

fn bytes(words: &[u32]) -> &[u8] {
    // SAFETY: u32 has no padding; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, words.len() * 4) }
}

fn bytes_mut(words: &mut [u32]) -> &mut [u8] {
    // SAFETY: as above; exclusive borrow.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, words.len() * 4) }
}

impl Paged {
    fn new(shape: AttnShape, kf: KvFormat, vf: KvFormat, keys: &[f32], values: &[f32], tile_lens: &[usize]) -> Self {
        let geom = KvGeometry { head_dim: shape.head_dim, n_kv_heads: shape.n_kv_heads };
        let opts = CodecOptions { layer: 3, seed: 7, static_scale: None };
        let k = codec(&kf, geom, KvRole::Key, opts).unwrap();
        let v = codec(&vf, geom, KvRole::Value, opts).unwrap();
        Self::with_codecs(shape, k, v, keys, values, tile_lens)
    }

    /// [`Self::new`] over codecs of any origin (the toy format's test brings its own).
    pub(crate) fn with_codecs(shape: AttnShape, k: Box<dyn KvCodec>, v: Box<dyn KvCodec>, keys: &[f32], values: &[f32], tile_lens: &[usize]) -> Self {
        let (hd, kw) = (shape.head_dim, shape.kv_width());
        let mut tiles = Vec::new();
        let mut start = 0;
        for &len in tile_lens {
            let mut pages = Vec::new();
            for (c, src) in [(&k, keys), (&v, values)] {
                let pb = c.page_bytes(len);
                let mut words = vec![0u32; (shape.n_kv_heads * pb).div_ceil(4)];
                let all = bytes_mut(&mut words);
                for g in 0..shape.n_kv_heads {
                    let rows: Vec<f32> = (start..start + len).flat_map(|t| src[t * kw + g * hd..t * kw + (g + 1) * hd].to_vec()).collect();
                    c.encode(g, KvPageMut { bytes: &mut all[g * pb..(g + 1) * pb], tokens: len }, 0, &rows);
                }
                pages.push(words);
            }
            let vp = pages.pop().unwrap();
            tiles.push((start, len, pages.pop().unwrap(), vp));
            start += len;
        }
        Paged { k, v, tiles }
    }

    pub(crate) fn view(&self, shape: AttnShape) -> KvView<'_> {
        let n = shape.n_kv_heads;
        let tiles = self
            .tiles
            .iter()
            .map(|(start, len, kp, vp)| KvTile {
                start: *start,
                len: *len,
                slots: *len,
                keys: &bytes(kp)[..n * self.k.page_bytes(*len)],
                values: &bytes(vp)[..n * self.v.page_bytes(*len)],
            })
            .collect();
        KvView { k: self.k.as_ref(), v: self.v.as_ref(), tiles, query_scale: None, exact: None }
    }

    /// The view a sequence has of its cache while its first `end` tokens are written: the
    /// tiles that begin before `end`, the last one cut there (its pages keep their slots).
    fn view_until(&self, shape: AttnShape, end: usize) -> KvView<'_> {
        let mut v = self.view(shape);
        v.tiles.retain(|t| t.start < end);
        for t in &mut v.tiles {
            t.len = t.len.min(end - t.start);
        }
        v
    }

    /// Every token's keys and values as the format stores them (`total × kv_width`).
    pub(crate) fn decoded(&self, shape: AttnShape) -> (Vec<f32>, Vec<f32>) {
        let (hd, kw) = (shape.head_dim, shape.kv_width());
        let total: usize = self.tiles.iter().map(|t| t.1).sum();
        let (mut keys, mut values) = (vec![0f32; total * kw], vec![0f32; total * kw]);
        for (start, len, kp, vp) in &self.tiles {
            for (c, words, dst) in [(&self.k, kp, &mut keys), (&self.v, vp, &mut values)] {
                let pb = c.page_bytes(*len);
                for g in 0..shape.n_kv_heads {
                    let mut rows = vec![0f32; len * hd];
                    c.decode(g, KvPage { bytes: &bytes(words)[g * pb..(g + 1) * pb], tokens: *len }, 0..*len, &mut rows);
                    for t in 0..*len {
                        dst[(start + t) * kw + g * hd..(start + t) * kw + (g + 1) * hd].copy_from_slice(&rows[t * hd..(t + 1) * hd]);
                    }
                }
            }
        }
        (keys, values)
    }
}

fn formats() -> Vec<(KvFormat, KvFormat)> {
    let mut v: Vec<(KvFormat, KvFormat)> = ["f32", "bf16", "f16", "fp8_e4m3", "int8", "tq3_0", "hqmq-s96-r4", "hqmq-s192-r6-med3", "hqmq-s24-r3"]
        .iter()
        .map(|n| {
            let f: KvFormat = n.parse().unwrap();
            (f, f)
        })
        .collect();
    v.push(("qjl1".parse().unwrap(), KvFormat::BF16));
    v.push((KvFormat::INT8, "tq3_0".parse().unwrap()));
    v
}

fn check_attention(shape: AttnShape, m: usize, pos0: usize, tile_lens: &[usize], seed: u64) {
    let mut r = rng(seed);
    let kw = shape.kv_width();
    let q = randn(&mut r, m * shape.q_width());
    let total: usize = tile_lens.iter().sum();
    assert!(total >= pos0 + m);
    let keys = randn(&mut r, total * kw);
    let values = randn(&mut r, total * kw);
    for (kf, vf) in formats() {
        let paged = Paged::new(shape, kf, vf, &keys, &values, tile_lens);
        let (dk, dv) = paged.decoded(shape);
        let want = reference::attention(shape, &q, m, pos0, &dk, &dv);
        let mut got = vec![f32::NAN; m * shape.q_width()];
        attention(shape, &q, m, pos0, &paged.view(shape), &mut got);
        // Online vs full softmax in f32 over the same stored values: outputs are convex
        // combinations of values (|v| < ~4). Compressed formats score through their own hooks
        // (QJL's query sketch, TQ3's rotated space), which reorder the sums: 1e-4.
        let tol = if kf == KvFormat::F32 && vf == KvFormat::F32 { 2e-5 } else { 1e-4 };
        assert_close(&got, &want, tol, 1e-4, &format!("attention {kf}/{vf} m={m} pos0={pos0} tiles={tile_lens:?}"));
    }
}

#[test]
fn attention_matches_reference_in_every_format() {
    let gqa = AttnShape { n_heads: 9, n_kv_heads: 3, head_dim: 64 };
    check_attention(gqa, 1, 0, &[1], 10);
    check_attention(gqa, 1, 40, &[16, 16, 9], 11);
    check_attention(gqa, 7, 0, &[7], 12);
    check_attention(gqa, 5, 300, &[16, 16, 273], 13); // a tile longer than a sub-tile
    check_attention(gqa, 300, 0, &[16; 19], 14); // prefill across sub-tile and query-block boundaries
    check_attention(gqa, 130, 20, &[16, 16, 118], 16); // a later chunk over several tiles
    // Decode steps (flash-decoding path): several key splits, tiles that straddle them,
    // and keys past the last query that must stay invisible.
    check_attention(gqa, 1, 700, &[701], 17);
    check_attention(gqa, 2, 600, &[100, 300, 250, 16], 18);
    check_attention(gqa, 3, 257, &[260, 40], 19);
    check_attention(AttnShape { n_heads: 8, n_kv_heads: 8, head_dim: 32 }, 1, 0, &[5], 20);
    check_attention(AttnShape { n_heads: 4, n_kv_heads: 2, head_dim: 128 }, 3, 2, &[2, 3, 9], 15); // extra keys beyond the queries are masked
}

/// Decode attention over a paged cache's 16-token tiles is bit-identical to the same keys in
/// one large tile (key ranges span tiles, so the arithmetic order is the same) for formats
/// whose hooks work key by key.
#[test]
fn decode_attention_is_independent_of_the_tile_layout() {
    let shape = AttnShape { n_heads: 9, n_kv_heads: 3, head_dim: 64 };
    let mut r = rng(21);
    let (kw, total, m) = (shape.kv_width(), 600, 2);
    let q = randn(&mut r, m * shape.q_width());
    let keys = randn(&mut r, total * kw);
    let values = randn(&mut r, total * kw);
    let lens: Vec<usize> = (0..total).step_by(16).map(|s| 16.min(total - s)).collect();
    for f in [KvFormat::F32, KvFormat::BF16, KvFormat::INT8] {
        let one = Paged::new(shape, f, f, &keys, &values, &[total]);
        let paged = Paged::new(shape, f, f, &keys, &values, &lens);
        let mut a = vec![0f32; m * shape.q_width()];
        let mut b = a.clone();
        attention(shape, &q, m, total - m, &one.view(shape), &mut a);
        attention(shape, &q, m, total - m, &paged.view(shape), &mut b);
        assert_eq!(a, b, "{f}");
    }
}

/// A query row's attention has the same bits whatever chunk computes it: a prompt's queries
/// all at once, in chunks of 1 to 77 queries (decode steps, short and long prefill chunks,
/// chunks that start mid-tile and mid key range), each chunk seeing the cache as it is while
/// that chunk runs, in every format. This is what makes a prefix-cache hit's recomputed tail
/// equal to the whole prompt computed at once.
#[test]
fn a_rows_attention_does_not_depend_on_its_chunk() {
    let shape = AttnShape { n_heads: 9, n_kv_heads: 3, head_dim: 64 };
    let mut r = rng(23);
    let (kw, qw, total) = (shape.kv_width(), shape.q_width(), 600);
    let q = randn(&mut r, total * qw);
    let keys = randn(&mut r, total * kw);
    let values = randn(&mut r, total * kw);
    let lens: Vec<usize> = (0..total).step_by(16).map(|s| 16.min(total - s)).collect();
    let chunks = [1, 2, 3, 4, 63, 77, 5, 1, 250, 130, 64];
    assert_eq!(chunks.iter().sum::<usize>(), total);
    for (kf, vf) in formats() {
        let paged = Paged::new(shape, kf, vf, &keys, &values, &lens);
        let mut whole = vec![f32::NAN; total * qw];
        attention(shape, &q, total, 0, &paged.view(shape), &mut whole);
        let mut pieces = vec![f32::NAN; total * qw];
        let mut pos = 0;
        for m in chunks {
            let rows = pos * qw..(pos + m) * qw;
            attention(shape, &q[rows.clone()], m, pos, &paged.view_until(shape, pos + m), &mut pieces[rows]);
            pos += m;
        }
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for (t, (a, b)) in whole.chunks_exact(qw).zip(pieces.chunks_exact(qw)).enumerate() {
            assert!(bits(a) == bits(b), "{kf}/{vf}: query {t} differs between one chunk and many");
        }
    }
}

/// A batch of jobs (decodes sharing one parallel region, prefills on their own) gives each
/// job exactly what [`attention`] gives it alone, in every format.
#[test]
fn attention_batch_equals_jobs_alone() {
    let shape = AttnShape { n_heads: 9, n_kv_heads: 3, head_dim: 64 };
    let mut r = rng(22);
    let kw = shape.kv_width();
    // (queries, position of the first query, tile lengths)
    let specs: [(usize, usize, &[usize]); 4] = [(1, 299, &[16, 16, 268]), (2, 40, &[42]), (9, 0, &[9]), (1, 700, &[256, 256, 189])];
    for (kf, vf) in formats() {
        let data: Vec<(Vec<f32>, Paged)> = specs
            .iter()
            .map(|&(m, _, lens)| {
                let total: usize = lens.iter().sum();
                let (k, v) = (randn(&mut r, total * kw), randn(&mut r, total * kw));
                (randn(&mut r, m * shape.q_width()), Paged::new(shape, kf, vf, &k, &v, lens))
            })
            .collect();
        let mut alone = Vec::new();
        for (i, &(m, pos0, _)) in specs.iter().enumerate() {
            let mut out = vec![0f32; m * shape.q_width()];
            attention(shape, &data[i].0, m, pos0, &data[i].1.view(shape), &mut out);
            alone.push(out);
        }
        let mut outs: Vec<Vec<f32>> = specs.iter().map(|&(m, _, _)| vec![f32::NAN; m * shape.q_width()]).collect();
        let mut jobs: Vec<AttnJob> = outs
            .iter_mut()
            .enumerate()
            .map(|(i, out)| AttnJob { q: &data[i].0, m: specs[i].0, pos0: specs[i].1, kv: data[i].1.view(shape), out })
            .collect();
        attention_batch(shape, &mut jobs);
        drop(jobs);
        assert_eq!(outs, alone, "{kf}/{vf}");
    }
}

/// Keys stored divided per (KV head, channel) by factors given as the view's `query_scale`
/// give the attention of the undivided keys: on the decode path (1 and 3 queries), the prefill
/// path (4 and 70) and in a batch mixing both. f32 pages, so only rounding separates them: the
/// division and the query's multiplication each round once per element, moving scores by
/// ~1e-7 relative (bound 2e-5, as for f32 in `attention_matches_reference_in_every_format`).
#[test]
fn query_scale_undoes_keys_stored_divided_by_it() {
    let shape = AttnShape { n_heads: 9, n_kv_heads: 3, head_dim: 64 };
    let mut r = rng(23);
    let kw = shape.kv_width();
    let scale: Vec<f32> = randn(&mut r, kw).iter().map(|x| 2f32.powf(x.clamp(-2.0, 2.0))).collect();
    let specs: [(usize, usize); 4] = [(1, 40), (3, 100), (4, 60), (70, 30)];
    let mut cases = Vec::new();
    for &(m, pos0) in &specs {
        let total = pos0 + m;
        let keys = randn(&mut r, total * kw);
        let divided: Vec<f32> = keys.iter().enumerate().map(|(i, k)| k / scale[i % kw]).collect();
        let values = randn(&mut r, total * kw);
        let lens: Vec<usize> = (0..total).step_by(16).map(|s| 16.min(total - s)).collect();
        let plain = Paged::new(shape, KvFormat::F32, KvFormat::F32, &keys, &values, &lens);
        let stored = Paged::new(shape, KvFormat::F32, KvFormat::F32, &divided, &values, &lens);
        cases.push((randn(&mut r, m * shape.q_width()), plain, stored));
    }
    fn scaled_view<'a>(p: &'a Paged, shape: AttnShape, scale: &'a [f32]) -> KvView<'a> {
        KvView { query_scale: Some(scale), ..p.view(shape) }
    }
    let mut want = Vec::new();
    for (&(m, pos0), (q, plain, stored)) in specs.iter().zip(&cases) {
        let mut a = vec![0f32; m * shape.q_width()];
        let mut b = vec![f32::NAN; m * shape.q_width()];
        attention(shape, q, m, pos0, &plain.view(shape), &mut a);
        attention(shape, q, m, pos0, &scaled_view(stored, shape, &scale), &mut b);
        assert_close(&b, &a, 2e-5, 1e-4, &format!("query_scale m={m}"));
        want.push(a);
    }
    let mut outs: Vec<Vec<f32>> = specs.iter().map(|&(m, _)| vec![f32::NAN; m * shape.q_width()]).collect();
    let mut jobs: Vec<AttnJob> = outs
        .iter_mut()
        .zip(specs.iter().zip(&cases))
        .map(|(out, (&(m, pos0), (q, _, stored)))| AttnJob { q, m, pos0, kv: scaled_view(stored, shape, &scale), out })
        .collect();
    attention_batch(shape, &mut jobs);
    drop(jobs);
    for ((got, w), &(m, _)) in outs.iter().zip(&want).zip(&specs) {
        assert_close(got, w, 2e-5, 1e-4, &format!("query_scale in a batch, m={m}"));
    }
}

/// QJL keys with exact keys beside them ([`ExactKeys`]): a query at `t` scores exactly the
/// sink's keys and those at positions `> t - window` that the view holds, and every other key
/// through the codec. Checked against the f64 reference run per query over keys chosen by that
/// rule (exact or the codec's decoded key), on the decode path (1 and 3 queries), the prefill
/// path (40 queries, across tiles) and with recent keys that start after the window reaches
/// back (a prefix hit: the missing ones go through the codec), over several query blocks and
/// key sub-tiles; keys are stored as the layout's key transform stores them, centered (so each
/// query's scores all move by `q · center`, which softmax cancels) and, in two cases, divided by
/// a `query_scale` (exact rows in that space too). Tolerance 1e-4 as for the compressed formats in
/// `attention_matches_reference_in_every_format`.
#[test]
fn exact_keys_are_scored_exactly_and_only_those() {
    let shape = AttnShape { n_heads: 9, n_kv_heads: 3, head_dim: 64 };
    let (hd, kw, qw) = (shape.head_dim, shape.kv_width(), shape.q_width());
    let qjl: KvFormat = "qjl1-w0-s0".parse().unwrap();
    // (queries, first query's position, window, sink, first recent position, tile length,
    // keys stored divided by a query scale)
    let cases = [
        (1, 300, 16, 4, 0, 16, false),
        (3, 200, 5, 2, 0, 16, false),
        (40, 0, 7, 3, 0, 16, false),
        (1, 300, 16, 4, 290, 16, false),
        (40, 60, 20, 1, 70, 16, false),
        (130, 100, 150, 3, 0, 200, true),
        (2, 180, 30, 2, 0, 200, true),
    ];
    for (case, &(m, pos0, window, sink, recent_start, tile, scaled)) in cases.iter().enumerate() {
        let mut r = rng(30 + case as u64);
        let total = pos0 + m;
        let (keys, values) = (randn(&mut r, total * kw), randn(&mut r, total * kw));
        let scale: Vec<f32> = if scaled { randn(&mut r, kw).iter().map(|x| 2f32.powf(x.clamp(-1.0, 1.0))).collect() } else { vec![1.0; kw] };
        let center: Vec<f32> = randn(&mut r, kw).iter().map(|x| 3.0 * x).collect();
        let stored: Vec<f32> = keys.iter().enumerate().map(|(i, k)| (k - center[i % kw]) / scale[i % kw]).collect();
        // Larger queries than unit normals, so that the codec's noise moves the outputs well
        // past the tolerance wherever a key is scored the wrong way.
        let q: Vec<f32> = randn(&mut r, m * qw).iter().map(|x| 3.0 * x).collect();
        let lens: Vec<usize> = (0..total).step_by(tile).map(|s| tile.min(total - s)).collect();
        let paged = Paged::new(shape, qjl, KvFormat::F32, &stored, &values, &lens);
        let (decoded, dv) = paged.decoded(shape);
        // The codec's keys in the model's space (what its scores against scaled queries mean).
        let decoded: Vec<f32> = decoded.iter().enumerate().map(|(i, k)| k * scale[i % kw] + center[i % kw]).collect();
        let head_rows = |g: usize, range: std::ops::Range<usize>| -> Vec<f32> { range.flat_map(|t| stored[t * kw + g * hd..t * kw + (g + 1) * hd].to_vec()).collect() };
        let sink_rows: Vec<Vec<f32>> = (0..3).map(|g| head_rows(g, 0..sink.min(total))).collect();
        let recent_rows: Vec<Vec<f32>> = (0..3).map(|g| head_rows(g, recent_start..total)).collect();
        let exact = Some(ExactKeys { window, sink: &sink_rows, recent: &recent_rows, recent_start });
        let view = KvView { exact, query_scale: scaled.then_some(scale.as_slice()), ..paged.view(shape) };
        let mut got = vec![f32::NAN; m * qw];
        attention(shape, &q, m, pos0, &view, &mut got);
        let mut want = Vec::new();
        let mut differs = false;
        for i in 0..m {
            let t = pos0 + i;
            let chosen: Vec<f32> = (0..=t)
                .flat_map(|j| {
                    let exact = j < sink || (t - j < window && j >= recent_start);
                    if exact { &keys[j * kw..(j + 1) * kw] } else { &decoded[j * kw..(j + 1) * kw] }
                })
                .copied()
                .collect();
            want.extend(reference::attention(shape, &q[i * qw..(i + 1) * qw], 1, t, &chosen, &dv[..(t + 1) * kw]));
            let codec_only = reference::attention(shape, &q[i * qw..(i + 1) * qw], 1, t, &decoded[..(t + 1) * kw], &dv[..(t + 1) * kw]);
            differs |= codec_only.iter().zip(&want[i * qw..]).any(|(a, b)| (a - b).abs() > 1e-2);
        }
        assert!(differs, "case {case}: exact keys must change the result for this check to mean anything");
        assert_close(&got, &want, 1e-4, 1e-4, &format!("exact keys, case {case}"));
    }
}
