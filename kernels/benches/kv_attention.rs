//! Decode attention (one query token, SmolLM2-135M's 9 query / 3 KV heads of 64) over a paged
//! cache of 16-token blocks at 1k, 4k and 8k context, for every KV-cache format side by side
//! in one run, plus the encode cost per token. Compressed formats read fewer bytes; this shows
//! what their decoding costs in exchange. Prefill attention: a 512-query chunk at the start of
//! a sequence and at the end of a 4k one, for the plain and 8-bit formats and QJL.
//! Run: `cargo bench -p tessera-kernels --bench kv_attention`.

#![allow(missing_docs)] // criterion's macros generate undocumented functions

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Duration;
use tessera_kernels::attention::{attention, AttnShape, ExactKeys, KvTile, KvView};
use tessera_kernels::kv::{codec, CodecOptions, KvCodec, KvFormat, KvGeometry, KvPageMut, KvRole};

const SHAPE: AttnShape = AttnShape { n_heads: 9, n_kv_heads: 3, head_dim: 64 };
const BLOCK: usize = 16;

fn randn(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| (0..4).map(|_| r.gen::<f32>() - 0.5).sum::<f32>() * 1.7).collect()
}

/// A cache of `ctx` tokens in one format: per block, key pages then value pages (u64 words so
/// f32 pages are aligned).
struct Cache {
    k: Box<dyn KvCodec>,
    v: Box<dyn KvCodec>,
    blocks: Vec<(Vec<u64>, Vec<u64>)>,
    /// QJL's exact keys, as a sequence's store holds them.
    exact: Option<Exact>,
}

/// Per KV head the sink's and the window's rows, the first recent position, the window.
struct Exact {
    sink: Vec<Vec<f32>>,
    recent: Vec<Vec<f32>>,
    recent_start: usize,
    window: usize,
}

fn as_bytes(w: &[u64]) -> &[u8] {
    // SAFETY: u64 has no padding; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(w.as_ptr() as *const u8, w.len() * 8) }
}

fn encode_pages(c: &dyn KvCodec, rows: &[f32]) -> Vec<u64> {
    let (hd, pb) = (SHAPE.head_dim, c.page_bytes(BLOCK));
    let mut words = vec![0u64; (SHAPE.n_kv_heads * pb).div_ceil(8)];
    // SAFETY: as above, exclusive borrow.
    let bytes = unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, words.len() * 8) };
    for g in 0..SHAPE.n_kv_heads {
        let head: Vec<f32> = rows.chunks_exact(SHAPE.kv_width()).flat_map(|t| t[g * hd..(g + 1) * hd].to_vec()).collect();
        c.encode(g, KvPageMut { bytes: &mut bytes[g * pb..(g + 1) * pb], tokens: BLOCK }, 0, &head);
    }
    words
}

impl Cache {
    fn new(kf: KvFormat, vf: KvFormat, ctx: usize, r: &mut ChaCha8Rng) -> Cache {
        let geom = KvGeometry { head_dim: SHAPE.head_dim, n_kv_heads: SHAPE.n_kv_heads };
        let opts = CodecOptions { layer: 0, seed: 1, static_scale: None };
        let k = codec(&kf, geom, KvRole::Key, opts).unwrap();
        let v = codec(&vf, geom, KvRole::Value, opts).unwrap();
        let blocks = (0..ctx / BLOCK)
            .map(|_| {
                let (kr, vr) = (randn(r, BLOCK * SHAPE.kv_width()), randn(r, BLOCK * SHAPE.kv_width()));
                (encode_pages(k.as_ref(), &kr), encode_pages(v.as_ref(), &vr))
            })
            .collect();
        let exact = match kf.exact_keys() {
            Some(p) if p.window > 0 => {
                let (w, s, hd) = (usize::from(p.window), usize::from(p.sink), SHAPE.head_dim);
                let heads = |n: usize, r: &mut ChaCha8Rng| (0..SHAPE.n_kv_heads).map(|_| randn(r, n * hd)).collect::<Vec<_>>();
                Some(Exact { sink: heads(s, r), recent: heads(w, r), recent_start: ctx - w, window: w })
            }
            _ => None,
        };
        Cache { k, v, blocks, exact }
    }

    fn view(&self) -> KvView<'_> {
        let n = SHAPE.n_kv_heads;
        let tiles = self
            .blocks
            .iter()
            .enumerate()
            .map(|(b, (kp, vp))| KvTile {
                start: b * BLOCK,
                len: BLOCK,
                slots: BLOCK,
                keys: &as_bytes(kp)[..n * self.k.page_bytes(BLOCK)],
                values: &as_bytes(vp)[..n * self.v.page_bytes(BLOCK)],
            })
            .collect();
        let exact = self.exact.as_ref().map(|e| ExactKeys { window: e.window, sink: &e.sink, recent: &e.recent, recent_start: e.recent_start });
        KvView { k: self.k.as_ref(), v: self.v.as_ref(), tiles, query_scale: None, exact }
    }
}

fn formats() -> Vec<(String, KvFormat, KvFormat)> {
    let p = |s: &str| s.parse::<KvFormat>().unwrap();
    vec![
        ("f32".into(), KvFormat::F32, KvFormat::F32),
        ("bf16".into(), KvFormat::BF16, KvFormat::BF16),
        ("fp8_e4m3".into(), KvFormat::FP8_E4M3, KvFormat::FP8_E4M3),
        ("int8".into(), KvFormat::INT8, KvFormat::INT8),
        ("k=qjl1-w0-s0,v=bf16".into(), p("qjl1-w0-s0"), KvFormat::BF16),
        ("k=qjl1-w0-s0,v=int8".into(), p("qjl1-w0-s0"), KvFormat::INT8),
        ("k=qjl1,v=bf16".into(), p("qjl1"), KvFormat::BF16),
        ("tq3_0".into(), p("tq3_0"), p("tq3_0")),
        ("hqmq-s96-r4".into(), p("hqmq-s96-r4"), p("hqmq-s96-r4")),
        ("hqmq-s192-r6-med3".into(), p("hqmq-s192-r6-med3"), p("hqmq-s192-r6-med3")),
    ]
}

fn decode_attention(c: &mut Criterion) {
    let mut r = ChaCha8Rng::seed_from_u64(5);
    let q = randn(&mut r, SHAPE.q_width());
    let mut out = vec![0f32; SHAPE.q_width()];
    for ctx in [1024, 4096, 8192] {
        let mut g = c.benchmark_group(format!("decode_attention_ctx{ctx}"));
        g.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
        g.throughput(Throughput::Elements(ctx as u64));
        for (name, kf, vf) in formats() {
            let cache = Cache::new(kf, vf, ctx, &mut r);
            let view = cache.view();
            g.bench_function(BenchmarkId::from_parameter(&name), |b| b.iter(|| attention(SHAPE, &q, 1, ctx - 1, &view, &mut out)));
        }
        g.finish();
    }
}

fn prefill_attention(c: &mut Criterion) {
    const CHUNK: usize = 512;
    let mut r = ChaCha8Rng::seed_from_u64(7);
    let q = randn(&mut r, CHUNK * SHAPE.q_width());
    let mut out = vec![0f32; CHUNK * SHAPE.q_width()];
    for ctx in [CHUNK, 4096] {
        let mut g = c.benchmark_group(format!("prefill_attention_{CHUNK}_queries_ctx{ctx}"));
        g.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));
        g.throughput(Throughput::Elements(CHUNK as u64));
        for (name, kf, vf) in formats().into_iter().filter(|(n, _, _)| ["f32", "bf16", "int8", "k=qjl1,v=bf16", "tq3_0"].contains(&n.as_str())) {
            let cache = Cache::new(kf, vf, ctx, &mut r);
            let view = cache.view();
            g.bench_function(BenchmarkId::from_parameter(&name), |b| b.iter(|| attention(SHAPE, &q, CHUNK, ctx - CHUNK, &view, &mut out)));
        }
        g.finish();
    }
}

fn encode(c: &mut Criterion) {
    let mut r = ChaCha8Rng::seed_from_u64(6);
    let rows = randn(&mut r, BLOCK * SHAPE.kv_width());
    let mut g = c.benchmark_group("encode_block_16_tokens_3_heads");
    g.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
    g.throughput(Throughput::Elements(BLOCK as u64));
    for (name, kf, _) in formats() {
        let geom = KvGeometry { head_dim: SHAPE.head_dim, n_kv_heads: SHAPE.n_kv_heads };
        let k = codec(&kf, geom, KvRole::Key, CodecOptions::default()).unwrap();
        g.bench_function(BenchmarkId::from_parameter(&name), |b| b.iter(|| encode_pages(k.as_ref(), &rows)));
    }
    g.finish();
}

criterion_group!(benches, decode_attention, prefill_attention, encode);
criterion_main!(benches);
