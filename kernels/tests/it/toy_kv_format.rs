//! The KV-format recipe (docs/architecture.md), proved from outside the crate: a toy 4-bit
//! format (per token and head: an f32 absmax scale, then `head_dim` 4-bit codes) implements
//! only `KvCodec`'s required methods (name, head dim, page size, encode, decode) and runs in
//! the paged attention kernel through the default score and accumulate hooks, beside a
//! built-in format. Registering it for `--kv-cache-dtype` is the one registry row the recipe
//! adds in `kv/format.rs` and `kv::codec`.

use crate::attention::Paged;
use crate::common::{assert_close, randn, rng};
use std::ops::Range;
use tessera_kernels::attention::{attention, AttnShape};
use tessera_kernels::kv::{codec, CodecOptions, KvCodec, KvFormat, KvGeometry, KvPage, KvPageMut, KvRole};
use tessera_kernels::reference;

/// Toy format: `[f32 scale][head_dim / 2 bytes]` per token, codes `round(x / scale) + 8` in
/// 0..=15 with `scale = absmax / 7`, two per byte (low nibble first).
struct Toy4 {
    head_dim: usize,
}

impl Toy4 {
    fn record(&self) -> usize {
        4 + self.head_dim / 2
    }
}

impl KvCodec for Toy4 {
    fn name(&self) -> String {
        "toy4".into()
    }
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn page_bytes(&self, tokens: usize) -> usize {
        tokens * self.record()
    }
    fn encode(&self, _head: usize, page: KvPageMut<'_>, first: usize, rows: &[f32]) {
        for (i, row) in rows.chunks_exact(self.head_dim).enumerate() {
            let rec = &mut page.bytes[(first + i) * self.record()..(first + i + 1) * self.record()];
            let absmax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
            let scale = if absmax > 0.0 { absmax / 7.0 } else { 1.0 };
            rec[..4].copy_from_slice(&scale.to_le_bytes());
            let code = |x: f32| ((x / scale).round().clamp(-8.0, 7.0) as i32 + 8) as u8;
            for (j, pair) in row.chunks_exact(2).enumerate() {
                rec[4 + j] = code(pair[0]) | (code(pair[1]) << 4);
            }
        }
    }
    fn decode(&self, _head: usize, page: KvPage<'_>, slots: Range<usize>, out: &mut [f32]) {
        for (i, slot) in slots.enumerate() {
            let rec = &page.bytes[slot * self.record()..(slot + 1) * self.record()];
            let scale = f32::from_le_bytes(rec[..4].try_into().unwrap());
            for (j, &b) in rec[4..].iter().enumerate() {
                out[i * self.head_dim + 2 * j] = ((b & 15) as i32 - 8) as f32 * scale;
                out[i * self.head_dim + 2 * j + 1] = ((b >> 4) as i32 - 8) as f32 * scale;
            }
        }
    }
}

const SHAPE: AttnShape = AttnShape { n_heads: 4, n_kv_heads: 2, head_dim: 64 };

/// Each stored value is within half a step (`absmax / 14`) of the original, plus f32
/// rounding of the division and product (1e-6 relative).
#[test]
fn toy_format_stores_each_value_within_half_a_step() {
    let mut r = rng(41);
    let keys = randn(&mut r, 37 * SHAPE.kv_width());
    let paged = Paged::with_codecs(SHAPE, Box::new(Toy4 { head_dim: 64 }), Box::new(Toy4 { head_dim: 64 }), &keys, &keys, &[16, 16, 5]);
    let (dk, _) = paged.decoded(SHAPE);
    for (row, got) in keys.chunks(64).zip(dk.chunks(64)) {
        let step = row.iter().fold(0f32, |m, x| m.max(x.abs())) / 7.0;
        for (x, y) in row.iter().zip(got) {
            assert!((x - y).abs() <= step / 2.0 + 1e-6 * x.abs().max(step), "{x} stored as {y} (step {step})");
        }
    }
}

/// Attention over toy keys and values, and over toy keys beside bf16 values, equals the f64
/// reference over the same pages decoded: prefill rows and a decode row, across tiles. The
/// default hooks decode then dot in f32, so only summation order differs: 1e-4, as for the
/// built-in compressed formats.
#[test]
fn attention_runs_a_format_defined_outside_the_crate() {
    let mut r = rng(42);
    let (total, kw) = (45, SHAPE.kv_width());
    let (keys, values) = (randn(&mut r, total * kw), randn(&mut r, total * kw));
    let geom = KvGeometry { head_dim: 64, n_kv_heads: 2 };
    let bf16 = || codec(&KvFormat::BF16, geom, KvRole::Value, CodecOptions { layer: 0, seed: 0, static_scale: None }).unwrap();
    let toy = || -> Box<dyn KvCodec> { Box::new(Toy4 { head_dim: 64 }) };
    for (name, v) in [("toy4/toy4", toy()), ("toy4/bf16", bf16())] {
        let paged = Paged::with_codecs(SHAPE, toy(), v, &keys, &values, &[16, 16, 13]);
        let (dk, dv) = paged.decoded(SHAPE);
        for (m, pos0) in [(20, 25), (1, 44)] {
            let q = randn(&mut r, m * SHAPE.q_width());
            let want = reference::attention(SHAPE, &q, m, pos0, &dk, &dv);
            let mut got = vec![f32::NAN; m * SHAPE.q_width()];
            attention(SHAPE, &q, m, pos0, &paged.view(SHAPE), &mut got);
            assert_close(&got, &want, 1e-4, 1e-4, &format!("{name} m={m} pos0={pos0}"));
        }
    }
}
