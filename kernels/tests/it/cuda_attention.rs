//! CUDA paged decode attention and KV append against the CPU: pages encoded by the CPU codecs
//! into a host pool laid out as the engine's `KvLayout` (two layers; the test reads layer 1),
//! shuffled non-contiguous block tables, every unused byte 0xFF (NaN in every float format), and
//! the f64 reference attention over the CPU-decoded K/V.
//!
//! The GPU tests skip, saying why, where there is no driver or device. The harness itself (pool
//! layout, descriptor offsets) is checked on the CPU, so CI runs something real everywhere.

use crate::common;

use common::{assert_close, randn, rng};
use rand::seq::SliceRandom;
use rand::Rng;
use std::sync::Arc;
use tessera_kernels::attention::AttnShape;
use tessera_kernels::cuda::attention::{kv_append, paged_decode_attention, AttnWorkspace, KvLayerDesc, KvSide, PagedBatch};
use tessera_kernels::cuda::{test_device, CudaDevice};
use tessera_kernels::kv::{codec, CodecOptions, KvCodec, KvFormat, KvGeometry, KvPage, KvPageMut, KvRole};
use tessera_kernels::reference;

/// Attention output tolerance: `|gpu - ref| <= ATOL + RTOL * |ref|`. Both sides see the same
/// decoded K/V (the kernel decodes exactly as the CPU codecs); the difference is fp32 vs f64
/// softmax and summation order.
const ATOL: f32 = 1e-4;
const RTOL: f32 = 1e-4;

/// A (format, static scale) side of a layer.
type Fmt = (KvFormat, Option<f32>);

/// A two-layer cache laid out as `engine/src/kv_cache/layout.rs` does; tests use layer 1.
struct Layout {
    shape: AttnShape,
    bs: usize,
    block_bytes: usize,
    k: Box<dyn KvCodec>,
    v: Box<dyn KvCodec>,
    desc: KvLayerDesc,
    /// Layer 1's (K offset, V offset).
    offsets: (usize, usize),
}

impl Layout {
    fn new(shape: AttnShape, bs: usize, kf: Fmt, vf: Fmt) -> Self {
        let geom = KvGeometry { head_dim: shape.head_dim, n_kv_heads: shape.n_kv_heads };
        let k = codec(&kf.0, geom, KvRole::Key, CodecOptions { layer: 1, seed: 3, static_scale: kf.1 }).unwrap();
        let v = codec(&vf.0, geom, KvRole::Value, CodecOptions { layer: 1, seed: 3, static_scale: vf.1 }).unwrap();
        let (kp, vp) = (k.page_bytes(bs), v.page_bytes(bs));
        let mut at = 0;
        let mut offsets = (0, 0);
        for _layer in 0..2 {
            let ko = at;
            at = (at + shape.n_kv_heads * kp).next_multiple_of(8);
            let vo = at;
            at = (at + shape.n_kv_heads * vp).next_multiple_of(8);
            offsets = (ko, vo);
        }
        let block_bytes = at.next_multiple_of(64);
        let desc = KvLayerDesc::new(
            block_bytes,
            bs,
            shape.n_kv_heads,
            shape.head_dim,
            KvSide { format: kf.0, offset: offsets.0, page_bytes: kp, static_scale: kf.1 },
            KvSide { format: vf.0, offset: offsets.1, page_bytes: vp, static_scale: vf.1 },
        )
        .unwrap();
        Layout { shape, bs, block_bytes, k, v, desc, offsets }
    }

    /// Byte range of (block, K or V, head)'s page.
    fn page(&self, block: usize, value: bool, head: usize) -> std::ops::Range<usize> {
        let (c, off) = if value { (&self.v, self.offsets.1) } else { (&self.k, self.offsets.0) };
        let pb = c.page_bytes(self.bs);
        let at = block * self.block_bytes + off + head * pb;
        at..at + pb
    }

    /// Encodes token row `row` (`n_kv_heads × head_dim`) of K or V into slot `slot` of `block`.
    fn encode(&self, pool: &mut [u8], block: usize, slot: usize, value: bool, row: &[f32]) {
        let hd = self.shape.head_dim;
        let c = if value { &self.v } else { &self.k };
        for h in 0..self.shape.n_kv_heads {
            let r = self.page(block, value, h);
            c.encode(h, KvPageMut { bytes: &mut pool[r], tokens: self.bs }, slot, &row[h * hd..(h + 1) * hd]);
        }
    }

    /// Token `slot` of `block` decoded (`n_kv_heads × head_dim`).
    fn decode(&self, pool: &[u8], block: usize, slot: usize, value: bool) -> Vec<f32> {
        let hd = self.shape.head_dim;
        let c = if value { &self.v } else { &self.k };
        let mut out = vec![0f32; self.shape.kv_width()];
        for h in 0..self.shape.n_kv_heads {
            let r = self.page(block, value, h);
            c.decode(h, KvPage { bytes: &pool[r], tokens: self.bs }, slot..slot + 1, &mut out[h * hd..(h + 1) * hd]);
        }
        out
    }
}

/// A decode batch on the host: the pool (unused bytes 0xFF), block tables (unused entries -1),
/// queries, and per sequence the reference output over the decoded pages.
struct Batch {
    pool: Vec<u8>,
    tables: Vec<i32>,
    max_blocks: usize,
    lens: Vec<i32>,
    q: Vec<f32>,
    want: Vec<f32>,
}

fn build(l: &Layout, lens: &[usize], seed: u64) -> Batch {
    let mut r = rng(seed);
    let (shape, bs) = (l.shape, l.bs);
    let max_blocks = lens.iter().map(|n| n.div_ceil(bs)).max().unwrap_or(0).max(1) + 1;
    let used: usize = lens.iter().map(|n| n.div_ceil(bs)).sum();
    let n_blocks = used + 5; // a few blocks nobody owns
    let mut ids: Vec<usize> = (0..n_blocks).collect();
    ids.shuffle(&mut r);
    let mut pool = vec![0xFFu8; n_blocks * l.block_bytes];
    let mut tables = vec![-1i32; lens.len() * max_blocks];
    let q = randn(&mut r, lens.len() * shape.q_width());
    let mut want = Vec::new();
    let mut next = ids.into_iter();
    for (s, &len) in lens.iter().enumerate() {
        let blocks: Vec<usize> = (0..len.div_ceil(bs)).map(|_| next.next().unwrap()).collect();
        for (j, &b) in blocks.iter().enumerate() {
            tables[s * max_blocks + j] = b as i32;
        }
        let keys = randn(&mut r, len * shape.kv_width());
        let values = randn(&mut r, len * shape.kv_width());
        let (mut dk, mut dv) = (Vec::new(), Vec::new());
        for t in 0..len {
            let (b, slot) = (blocks[t / bs], t % bs);
            let kw = shape.kv_width();
            l.encode(&mut pool, b, slot, false, &keys[t * kw..(t + 1) * kw]);
            l.encode(&mut pool, b, slot, true, &values[t * kw..(t + 1) * kw]);
            dk.extend(l.decode(&pool, b, slot, false));
            dv.extend(l.decode(&pool, b, slot, true));
        }
        let qs = &q[s * shape.q_width()..(s + 1) * shape.q_width()];
        if len == 0 {
            want.extend(vec![0f32; shape.q_width()]);
        } else {
            want.extend(reference::attention(shape, qs, 1, len - 1, &dk, &dv));
        }
    }
    Batch { pool, tables, max_blocks, lens: lens.iter().map(|&n| n as i32).collect(), q, want }
}

/// Runs the GPU attention on `batch` with `splits` forced (or planned) and returns the output.
fn run_gpu(dev: &Arc<CudaDevice>, l: &Layout, b: &Batch, splits: Option<usize>) -> Vec<f32> {
    let st = dev.stream();
    let pool = st.clone_htod(&b.pool).unwrap();
    let tables = st.clone_htod(&b.tables).unwrap();
    let lens = st.clone_htod(&b.lens).unwrap();
    let q = st.clone_htod(&b.q).unwrap();
    let mut out = st.clone_htod(&vec![f32::NAN; b.q.len()]).unwrap();
    let seqs = b.lens.len();
    let mut ws = AttnWorkspace::new(dev, seqs, l.shape.n_heads, l.shape.head_dim, 16).unwrap();
    ws.force_splits(splits);
    let max_seq_len = b.lens.iter().copied().max().unwrap_or(0) as usize;
    let batch = PagedBatch { pool: &pool, block_tables: tables.slice(..), max_blocks: b.max_blocks, seq_lens: lens.slice(..), max_seq_len };
    paged_decode_attention(dev, &l.desc, &batch, &q.slice(..), l.shape.n_heads, &mut out.slice_mut(..), &mut ws).unwrap();
    dev.synchronize().unwrap();
    st.clone_dtoh(&out).unwrap()
}

const F32: Fmt = (KvFormat::F32, None);
const BF16: Fmt = (KvFormat::BF16, None);
const F16: Fmt = (KvFormat::F16, None);
const FP8: Fmt = (KvFormat::FP8_E4M3, None);
const INT8: Fmt = (KvFormat::INT8, None);
const FP8_STATIC: Fmt = (KvFormat::FP8_E4M3, Some(0.02));
const INT8_STATIC: Fmt = (KvFormat::INT8, Some(0.05));

/// Every format on both sides, static scales, and mixed pairs.
const PAIRS: [(Fmt, Fmt); 9] = [
    (F32, F32),
    (BF16, BF16),
    (F16, F16),
    (FP8, FP8),
    (INT8, INT8),
    (FP8_STATIC, FP8_STATIC),
    (INT8_STATIC, INT8_STATIC),
    (FP8, BF16),
    (BF16, INT8_STATIC),
];

/// Sequence lengths around block edges (block size 16), one empty, one long.
const LENS: [usize; 7] = [1, 15, 16, 17, 0, 53, 300];

/// The harness on the CPU alone: pages written through the layer-1 offsets decode back to what
/// the CPU attention (tiles built from the same pages) computes, and every byte outside the
/// written records is still 0xFF. Guards the layout the GPU tests (and the engine) rely on.
#[test]
fn harness_pool_layout_matches_cpu_attention() {
    use tessera_kernels::attention::{attention, KvTile, KvView};
    let shape = AttnShape { n_heads: 6, n_kv_heads: 2, head_dim: 64 };
    // (f32 pages are left out: the CPU reads them in place and these host copies are not
    // guaranteed 4-byte aligned.)
    for (kf, vf) in [(BF16, F16), (FP8, BF16), (INT8_STATIC, INT8)] {
        let l = Layout::new(shape, 16, kf, vf);
        let b = build(&l, &[37], 5);
        // The CPU attention over tiles that are copies of the pool's pages (whole blocks).
        let blocks: Vec<usize> = (0..3).map(|j| b.tables[j] as usize).collect();
        let pages = |value: bool| -> Vec<Vec<u8>> {
            blocks.iter().map(|&blk| (0..2).flat_map(|h| b.pool[l.page(blk, value, h)].to_vec()).collect()).collect()
        };
        let (kp, vp) = (pages(false), pages(true));
        let tiles = (0..3)
            .map(|j| KvTile { start: 16 * j, len: 16.min(37 - 16 * j), slots: 16, keys: &kp[j], values: &vp[j] })
            .collect();
        let view = KvView { k: l.k.as_ref(), v: l.v.as_ref(), tiles, query_scale: None, exact: None };
        let mut got = vec![f32::NAN; shape.q_width()];
        attention(shape, &b.q, 1, 36, &view, &mut got);
        assert_close(&got, &b.want, 1e-5, 1e-5, "CPU attention over the harness pool");
        // Only the 37 tokens' records (2 heads, K and V) were written.
        let written = 37 * 2 * (l.k.page_bytes(1) + l.v.page_bytes(1));
        let touched = b.pool.iter().filter(|&&x| x != 0xFF).count();
        assert!(touched <= written && touched > written / 2, "{touched} bytes written, expected about {written}");
    }
}

#[test]
fn decode_matches_the_reference_in_every_format() {
    let Some(dev) = test_device() else { return };
    for hd in [64, 128] {
        for (group, n_kv) in [(1, 2), (3, 2), (4, 1)] {
            let shape = AttnShape { n_heads: group * n_kv, n_kv_heads: n_kv, head_dim: hd };
            for (i, (kf, vf)) in PAIRS.into_iter().enumerate() {
                let l = Layout::new(shape, 16, kf, vf);
                let b = build(&l, &LENS, 100 + i as u64);
                let what = format!("hd {hd}, group {group}, {:?}/{:?}", kf, vf);
                let one = run_gpu(&dev, &l, &b, Some(1));
                assert_close(&one, &b.want, ATOL, RTOL, &format!("{what}, 1 split"));
                let many = run_gpu(&dev, &l, &b, Some(7));
                assert_close(&many, &b.want, ATOL, RTOL, &format!("{what}, 7 splits"));
                assert_close(&many, &one, 1e-5, 1e-5, &format!("{what}, 7 splits vs 1"));
                let planned = run_gpu(&dev, &l, &b, None);
                assert_close(&planned, &b.want, ATOL, RTOL, &format!("{what}, planned splits"));
            }
        }
    }
}

/// Big groups (two CTAs of query heads per KV head), a long context, planned splits, more
/// splits than tokens in short sequences (empty splits), and a block size that is not a power
/// of two.
#[test]
fn large_groups_long_contexts_and_empty_splits() {
    let Some(dev) = test_device() else { return };
    let shape = AttnShape { n_heads: 32, n_kv_heads: 2, head_dim: 128 };
    for (kf, vf) in [(BF16, BF16), (FP8, FP8)] {
        let l = Layout::new(shape, 16, kf, vf);
        let b = build(&l, &[2000, 3, 700], 9);
        for splits in [None, Some(1), Some(16)] {
            let got = run_gpu(&dev, &l, &b, splits);
            assert_close(&got, &b.want, ATOL, RTOL, &format!("{kf:?}/{vf:?}, splits {splits:?}"));
        }
    }
    let shape = AttnShape { n_heads: 12, n_kv_heads: 4, head_dim: 64 };
    let l = Layout::new(shape, 12, INT8, F16);
    let b = build(&l, &[1, 11, 12, 13, 500], 10);
    for splits in [Some(1), Some(9), None] {
        assert_close(&run_gpu(&dev, &l, &b, splits), &b.want, ATOL, RTOL, &format!("block size 12, splits {splits:?}"));
    }
}

/// Rows of `n_kv_heads × head_dim` with the values that test rounding and saturation edges
/// (ties, subnormals, huge values, signed zero, inf, NaN) mixed into random ones.
fn nasty_rows(seed: u64, tokens: usize, width: usize) -> Vec<f32> {
    let mut r = rng(seed);
    let mut x = randn(&mut r, tokens * width);
    let specials = [
        0.0,
        -0.0,
        f32::from_bits(0x3F80_8000), // bf16 tie, even: down
        f32::from_bits(0x3F81_8000), // bf16 tie, odd: up
        f32::from_bits(0x3F80_1000), // f16 tie
        1.0 / 1024.0,                // fp8 subnormal range (after unit scale)
        3.0 / 1024.0,                // fp8 subnormal tie
        1e-30,
        65520.0, // f16 rounds to inf
        1e6,
        -3.0e38,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        2.5, // int8 tie: away from zero
        -0.5,
    ];
    // Token 0 gets specials at random places; token 1 is all specials (amax inf or NaN).
    for (i, &s) in specials.iter().enumerate() {
        let at = r.gen_range(0..width);
        x[at] = s;
        if tokens > 1 {
            x[width + i % width] = s;
        }
    }
    // Token 2 (if any): small values so a unit static scale hits the fp8 subnormals.
    if tokens > 2 {
        for v in &mut x[2 * width..3 * width] {
            *v *= 1e-3;
        }
    }
    x
}

#[test]
fn kv_append_writes_the_cpu_codec_bytes() {
    let Some(dev) = test_device() else { return };
    let st = dev.stream();
    let all = [F32, BF16, F16, FP8, INT8, (KvFormat::FP8_E4M3, Some(1.0)), (KvFormat::INT8, Some(0.03))];
    for hd in [64, 128] {
        for (i, &kf) in all.iter().enumerate() {
            let vf = all[(i + 3) % all.len()];
            let shape = AttnShape { n_heads: 3, n_kv_heads: 3, head_dim: hd };
            let l = Layout::new(shape, 16, kf, vf);
            let n_blocks = 6;
            let mut r = rng(40 + i as u64);
            let before: Vec<u8> = (0..n_blocks * l.block_bytes).map(|_| r.gen()).collect();
            // Distinct slots in shuffled order, one padding entry (-1).
            let mut slots: Vec<i32> = (0..(n_blocks * 16) as i32).collect();
            slots.shuffle(&mut r);
            slots.truncate(40);
            slots[7] = -1;
            let kw = shape.kv_width();
            let k = nasty_rows(50 + i as u64, slots.len(), kw);
            let v = nasty_rows(60 + i as u64, slots.len(), kw);
            let mut want = before.clone();
            for (t, &s) in slots.iter().enumerate() {
                if s >= 0 {
                    let (b, slot) = (s as usize / 16, s as usize % 16);
                    l.encode(&mut want, b, slot, false, &k[t * kw..(t + 1) * kw]);
                    l.encode(&mut want, b, slot, true, &v[t * kw..(t + 1) * kw]);
                }
            }
            let mut pool = st.clone_htod(&before).unwrap();
            let (kd, vd, sd) = (st.clone_htod(&k).unwrap(), st.clone_htod(&v).unwrap(), st.clone_htod(&slots).unwrap());
            kv_append(&dev, &l.desc, &mut pool, &kd.slice(..), &vd.slice(..), &sd.slice(..)).unwrap();
            dev.synchronize().unwrap();
            let got = st.clone_dtoh(&pool).unwrap();
            if let Some(at) = got.iter().zip(&want).position(|(a, b)| a != b) {
                let (blk, off) = (at / l.block_bytes, at % l.block_bytes);
                panic!("hd {hd}, K {kf:?}, V {vf:?}: byte {at} (block {blk}, offset {off}) is {:#04x}, CPU wrote {:#04x}", got[at], want[at]);
            }
        }
    }
}

/// Appending on the GPU then attending on the GPU agrees with the CPU reference over the same
/// tokens (the path the engine takes each decode step).
#[test]
fn append_then_attend_round_trip() {
    let Some(dev) = test_device() else { return };
    let st = dev.stream();
    let shape = AttnShape { n_heads: 8, n_kv_heads: 2, head_dim: 128 };
    for (kf, vf) in [(F32, F32), (FP8, INT8)] {
        let l = Layout::new(shape, 16, kf, vf);
        let len = 45;
        let mut r = rng(77);
        let kw = shape.kv_width();
        let (k, v) = (randn(&mut r, len * kw), randn(&mut r, len * kw));
        let q = randn(&mut r, shape.q_width());
        let blocks = [4i32, 1, 6];
        let slots: Vec<i32> = (0..len).map(|t| blocks[t / 16] * 16 + (t % 16) as i32).collect();
        let mut pool = st.clone_htod(&vec![0xFFu8; 8 * l.block_bytes]).unwrap();
        let (kd, vd, sd) = (st.clone_htod(&k).unwrap(), st.clone_htod(&v).unwrap(), st.clone_htod(&slots).unwrap());
        kv_append(&dev, &l.desc, &mut pool, &kd.slice(..), &vd.slice(..), &sd.slice(..)).unwrap();
        let host = st.clone_dtoh(&pool).unwrap();
        let (mut dk, mut dv) = (Vec::new(), Vec::new());
        for t in 0..len {
            dk.extend(l.decode(&host, blocks[t / 16] as usize, t % 16, false));
            dv.extend(l.decode(&host, blocks[t / 16] as usize, t % 16, true));
        }
        let want = reference::attention(shape, &q, 1, len - 1, &dk, &dv);
        let b = Batch { pool: host, tables: blocks.to_vec(), max_blocks: 3, lens: vec![len as i32], q, want };
        assert_close(&run_gpu(&dev, &l, &b, None), &b.want, ATOL, RTOL, &format!("{kf:?}/{vf:?} append + attend"));
    }
}

#[test]
fn launchers_reject_bad_shapes_and_formats() {
    let Some(dev) = test_device() else { return };
    let st = dev.stream();
    let shape = AttnShape { n_heads: 4, n_kv_heads: 2, head_dim: 64 };
    let l = Layout::new(shape, 16, BF16, BF16);
    let b = build(&l, &[20], 1);
    let pool = st.clone_htod(&b.pool).unwrap();
    let tables = st.clone_htod(&b.tables).unwrap();
    let lens = st.clone_htod(&b.lens).unwrap();
    let q = st.clone_htod(&b.q).unwrap();
    let mut out = st.clone_htod(&b.q).unwrap();
    let mut ws = AttnWorkspace::new(&dev, 1, 4, 64, 4).unwrap();
    let batch = PagedBatch { pool: &pool, block_tables: tables.slice(..), max_blocks: b.max_blocks, seq_lens: lens.slice(..), max_seq_len: 20 };
    // 3 query heads do not group over 2 KV heads; q of the wrong length; too many forced splits.
    let e = paged_decode_attention(&dev, &l.desc, &batch, &q.slice(..), 3, &mut out.slice_mut(..), &mut ws).unwrap_err();
    assert!(e.to_string().contains("groups"), "{e}");
    let e = paged_decode_attention(&dev, &l.desc, &batch, &q.slice(..64), 4, &mut out.slice_mut(..), &mut ws).unwrap_err();
    assert!(e.to_string().contains("attention q"), "{e}");
    ws.force_splits(Some(5));
    let e = paged_decode_attention(&dev, &l.desc, &batch, &q.slice(..), 4, &mut out.slice_mut(..), &mut ws).unwrap_err();
    assert!(e.to_string().contains("splits"), "{e}");
    let mut pool = pool;
    let e = kv_append(&dev, &l.desc, &mut pool, &q.slice(..), &q.slice(..), &lens.slice(..)).unwrap_err();
    assert!(e.to_string().contains("kv_append k"), "{e}");
}
