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
        let out = &mut out[..src.len() / 2];
        #[cfg(target_arch = "x86_64")]
        if super::isa() == crate::cpu::Isa::Avx2 {
            // SAFETY: AVX2 and F16C present (the AVX2 level includes F16C); `out` has one
            // float per two bytes of `src`.
            unsafe { avx2::widen(self.kind, src, out) };
            return;
        }
        for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
            *o = self.to_f32([b[0], b[1]]);
        }
    }
}

/// 16-bit floats widened eight at a time. Both conversions are exact (bf16 is the top half of
/// an f32; F16C widens f16 exactly), so the floats are the scalar path's. The scalar loop made
/// bf16 decode attention 3.8x slower than f32 pages (criterion, 1k context, Zen 5).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Half16;
    use std::arch::x86_64::*;

    /// `out[i]` = the 16-bit float at bytes `2i..2i + 2` of `src` (little-endian).
    ///
    /// # Safety
    /// AVX2 and F16C present; `out.len() == src.len() / 2`.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn widen(kind: Half16, src: &[u8], out: &mut [f32]) {
        let whole = out.len() / 8 * 8;
        for (o, b) in out[..whole].chunks_exact_mut(8).zip(src.chunks_exact(16)) {
            // SAFETY: `b` is 16 readable bytes, `o` 8 writable floats.
            unsafe {
                let h = _mm_loadu_si128(b.as_ptr() as *const __m128i);
                let f = match kind {
                    Half16::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h))),
                    Half16::F16 => _mm256_cvtph_ps(h),
                };
                _mm256_storeu_ps(o.as_mut_ptr(), f);
            }
        }
        for (o, b) in out[whole..].iter_mut().zip(src[2 * whole..].chunks_exact(2)) {
            let bits = u16::from_le_bytes([b[0], b[1]]);
            *o = match kind {
                Half16::Bf16 => f32::from_bits(u32::from(bits) << 16),
                Half16::F16 => half::f16::from_bits(bits).to_f32(),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SIMD widening gives the scalar conversion's floats bit for bit, for every 16-bit
    /// pattern but NaNs (those stay NaN), with a partial last group of eight.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn widening_matches_the_scalar_conversion() {
        if !crate::cpu::Isa::Avx2.available() {
            return;
        }
        let bytes: Vec<u8> = (0..=u16::MAX).chain([1, 2, 3]).flat_map(u16::to_le_bytes).collect();
        for (kind, scalar) in [(Half16::Bf16, (|b: u16| bf16::from_bits(b).to_f32()) as fn(u16) -> f32), (Half16::F16, |b: u16| f16::from_bits(b).to_f32())] {
            let mut out = vec![0f32; bytes.len() / 2];
            // SAFETY: AVX2 (with F16C) present (checked); lengths match.
            unsafe { avx2::widen(kind, &bytes, &mut out) };
            for (i, (b, &got)) in bytes.chunks_exact(2).zip(&out).enumerate() {
                let want = scalar(u16::from_le_bytes([b[0], b[1]]));
                assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{kind:?} value {i}: {got} vs {want}");
            }
        }
    }

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
