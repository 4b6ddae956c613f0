//! Uncompressed pages: f32 (the compute type) and 16-bit floats (bf16, f16), each page
//! `tokens × head_dim` values in token order.

pub mod cuda;
mod family;

pub use family::Plain;

use super::{KvCodec, KvGeometry, KvPage, KvPageMut};
use half::{bf16, f16};
use std::ops::Range;

/// f32 pages: read in place, no decoding.
pub struct F32Codec {
    head_dim: usize,
}

impl F32Codec {
    /// A codec for heads of `geom`.
    pub fn new(geom: KvGeometry) -> Self {
        F32Codec { head_dim: geom.head_dim }
    }
}

/// The f32 values of a page (pages are 4-byte aligned by the pool).
fn floats(bytes: &[u8]) -> &[f32] {
    assert!(bytes.as_ptr().align_offset(4) == 0 && bytes.len().is_multiple_of(4), "f32 page misaligned");
    // SAFETY: aligned (asserted), length a multiple of 4, any bit pattern is a valid f32.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const f32, bytes.len() / 4) }
}

impl KvCodec for F32Codec {
    fn name(&self) -> String {
        "f32".into()
    }
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn page_bytes(&self, tokens: usize) -> usize {
        tokens * self.head_dim * 4
    }
    fn encode(&self, _head: usize, page: KvPageMut<'_>, first: usize, rows: &[f32]) {
        let at = first * self.head_dim * 4;
        for (dst, v) in page.bytes[at..at + rows.len() * 4].chunks_exact_mut(4).zip(rows) {
            dst.copy_from_slice(&v.to_ne_bytes());
        }
    }
    fn decode(&self, _head: usize, page: KvPage<'_>, slots: Range<usize>, out: &mut [f32]) {
        let hd = self.head_dim;
        let src = &page.bytes[slots.start * hd * 4..slots.end * hd * 4];
        for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
            *o = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
    fn as_f32<'a>(&self, page: KvPage<'a>) -> Option<&'a [f32]> {
        Some(floats(page.bytes))
    }
}

/// Which 16-bit float a [`Half16Codec`] stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half16 {
    /// bfloat16 (8 exponent bits: the f32 range, 8 significant bits).
    Bf16,
    /// IEEE binary16 (range ±65504, 11 significant bits).
    F16,
}

/// 16-bit float pages, round to nearest even.
pub struct Half16Codec {
    head_dim: usize,
    kind: Half16,
}

impl Half16Codec {
    /// A codec for heads of `geom`.
    pub fn new(geom: KvGeometry, kind: Half16) -> Self {
        Half16Codec { head_dim: geom.head_dim, kind }
    }

    fn to_f32(&self, b: [u8; 2]) -> f32 {
        let bits = u16::from_le_bytes(b);
        match self.kind {
            Half16::Bf16 => bf16::from_bits(bits).to_f32(),
            Half16::F16 => f16::from_bits(bits).to_f32(),
        }
    }
}

impl KvCodec for Half16Codec {
    fn name(&self) -> String {
        match self.kind {
            Half16::Bf16 => "bf16".into(),
            Half16::F16 => "f16".into(),
        }
    }
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn page_bytes(&self, tokens: usize) -> usize {
        tokens * self.head_dim * 2
    }
    fn encode(&self, _head: usize, page: KvPageMut<'_>, first: usize, rows: &[f32]) {
        let at = first * self.head_dim * 2;
        for (dst, &v) in page.bytes[at..at + rows.len() * 2].chunks_exact_mut(2).zip(rows) {
            let bits = match self.kind {
                Half16::Bf16 => bf16::from_f32(v).to_bits(),
                Half16::F16 => f16::from_f32(v).to_bits(),
            };
            dst.copy_from_slice(&bits.to_le_bytes());
        }
    }
    fn decode(&self, _head: usize, page: KvPage<'_>, slots: Range<usize>, out: &mut [f32]) {
        let hd = self.head_dim;
        let src = &page.bytes[slots.start * hd * 2..slots.end * hd * 2];
        for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
            *o = self.to_f32([b[0], b[1]]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_formats_round_trip_to_their_precision() {
        let geom = KvGeometry { head_dim: 8, n_kv_heads: 1 };
        let rows: Vec<f32> = (0..24).map(|i| ((i * 37 % 11) as f32 - 5.3) * 0.37).collect();
        for (codec, tol) in [
            (Box::new(F32Codec::new(geom)) as Box<dyn KvCodec>, 0.0),
            (Box::new(Half16Codec::new(geom, Half16::Bf16)), 1.0 / 256.0),
            (Box::new(Half16Codec::new(geom, Half16::F16)), 1.0 / 2048.0),
        ] {
            let mut bytes = vec![0u8; codec.page_bytes(4)];
            codec.encode(0, KvPageMut { bytes: &mut bytes, tokens: 4 }, 1, &rows);
            let mut out = vec![0f32; 24];
            codec.decode(0, KvPage { bytes: &bytes, tokens: 4 }, 1..4, &mut out);
            for (a, b) in rows.iter().zip(&out) {
                assert!((a - b).abs() <= tol * a.abs(), "{}: {a} vs {b}", codec.name());
            }
        }
    }
}
