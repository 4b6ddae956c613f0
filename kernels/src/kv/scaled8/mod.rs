//! 8-bit pages: FP8 E4M3 or int8, with a scale per (token, head) stored before each vector
//! (f32, absmax / 448 or absmax / 127), or no stored scale when the checkpoint gives a static
//! per-tensor one (`k_scale` / `v_scale`, as vLLM reads them).
//!
//! Record layout per token: `[scale: f32 LE, if dynamic][head_dim bytes]`.

pub mod cuda;
mod family;

pub use family::Scaled8;

use super::{KvCodec, KvGeometry, KvPage, KvPageMut};
use crate::e4m3::{e4m3_to_f32, f32_to_e4m3, E4M3_MAX};
use std::ops::Range;
use std::sync::OnceLock;

/// The 8-bit element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Byte8 {
    /// OCP FP8 E4M3 (saturating at ±448).
    Fp8E4m3,
    /// Symmetric int8 in [-127, 127].
    Int8,
}

impl Byte8 {
    fn max(self) -> f32 {
        match self {
            Byte8::Fp8E4m3 => E4M3_MAX,
            Byte8::Int8 => 127.0,
        }
    }

    fn encode(self, x: f32) -> u8 {
        match self {
            Byte8::Fp8E4m3 => f32_to_e4m3(x),
            Byte8::Int8 => x.round().clamp(-127.0, 127.0) as i8 as u8,
        }
    }

    /// The value of every byte.
    fn table(self) -> &'static [f32; 256] {
        static FP8: OnceLock<[f32; 256]> = OnceLock::new();
        static INT8: OnceLock<[f32; 256]> = OnceLock::new();
        match self {
            // NaN bytes are never written (encoding saturates); they decode as 0 to keep a
            // corrupted page from poisoning a whole softmax.
            Byte8::Fp8E4m3 => FP8.get_or_init(|| std::array::from_fn(|b| {
                let v = e4m3_to_f32(b as u8);
                if v.is_nan() { 0.0 } else { v }
            })),
            Byte8::Int8 => INT8.get_or_init(|| std::array::from_fn(|b| b as u8 as i8 as f32)),
        }
    }
}

/// FP8 / int8 pages with a per-(token, head) or static scale.
pub struct Scaled8Codec {
    head_dim: usize,
    kind: Byte8,
    static_scale: Option<f32>,
}

impl Scaled8Codec {
    /// A codec for heads of `geom`; `static_scale` fixes the scale for every vector.
    pub fn new(geom: KvGeometry, kind: Byte8, static_scale: Option<f32>) -> Self {
        Scaled8Codec { head_dim: geom.head_dim, kind, static_scale }
    }

    fn record(&self) -> usize {
        self.head_dim + if self.static_scale.is_some() { 0 } else { 4 }
    }

    /// (scale, element bytes) of slot `slot`.
    fn slot<'a>(&self, page: &'a [u8], slot: usize) -> (f32, &'a [u8]) {
        let r = &page[slot * self.record()..(slot + 1) * self.record()];
        match self.static_scale {
            Some(s) => (s, r),
            None => (f32::from_le_bytes([r[0], r[1], r[2], r[3]]), &r[4..]),
        }
    }
}

impl KvCodec for Scaled8Codec {
    fn name(&self) -> String {
        let base = match self.kind {
            Byte8::Fp8E4m3 => "fp8_e4m3",
            Byte8::Int8 => "int8",
        };
        if self.static_scale.is_some() { format!("{base} (static scale)") } else { base.into() }
    }
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn page_bytes(&self, tokens: usize) -> usize {
        tokens * self.record()
    }
    fn encode(&self, _head: usize, page: KvPageMut<'_>, first: usize, rows: &[f32]) {
        let (hd, rec) = (self.head_dim, self.record());
        for (t, x) in rows.chunks_exact(hd).enumerate() {
            let dst = &mut page.bytes[(first + t) * rec..(first + t + 1) * rec];
            let (scale, elems) = match self.static_scale {
                Some(s) => (s, dst),
                None => {
                    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let s = if amax > 0.0 && amax.is_finite() { amax / self.kind.max() } else { 1.0 };
                    dst[..4].copy_from_slice(&s.to_le_bytes());
                    (s, &mut dst[4..])
                }
            };
            let inv = 1.0 / scale;
            for (e, v) in elems.iter_mut().zip(x) {
                *e = self.kind.encode(v * inv);
            }
        }
    }
    fn decode(&self, _head: usize, page: KvPage<'_>, slots: Range<usize>, out: &mut [f32]) {
        let table = self.kind.table();
        #[cfg(target_arch = "x86_64")]
        let simd = super::isa() == crate::cpu::Isa::Avx2;
        for (slot, o) in slots.zip(out.chunks_exact_mut(self.head_dim)) {
            let (s, e) = self.slot(page.bytes, slot);
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: AVX2 present; `o` and `e` are one row of head_dim values each.
                unsafe { avx2::widen(self.kind, table, e, s, o) };
                continue;
            }
            o.iter_mut().zip(e).for_each(|(o, &b)| *o = table[b as usize] * s);
        }
    }
}

/// A row of codes decoded eight at a time: int8 codes converted, E4M3 ones rebuilt from
/// their bits, each times the row's scale: the scalar path's floats (each code's value is the
/// table's, exactly, and the product the same). The scalar loop made int8 decode attention
/// 2.7x slower than f32 pages (criterion, 1k context, Zen 5).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Byte8;
    use std::arch::x86_64::*;

    /// `out[i] = table[codes[i]] * scale`.
    ///
    /// # Safety
    /// AVX2 present; `out.len() == codes.len()`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn widen(kind: Byte8, table: &[f32; 256], codes: &[u8], scale: f32, out: &mut [f32]) {
        let s = _mm256_set1_ps(scale);
        let whole = out.len() / 8 * 8;
        for (o, c) in out[..whole].chunks_exact_mut(8).zip(codes.chunks_exact(8)) {
            // SAFETY: `c` is 8 readable bytes, `o` 8 writable floats.
            unsafe {
                let b = _mm_loadl_epi64(c.as_ptr() as *const __m128i);
                let v = match kind {
                    Byte8::Int8 => _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                    Byte8::Fp8E4m3 => e4m3(_mm256_cvtepu8_epi32(b)),
                };
                _mm256_storeu_ps(o.as_mut_ptr(), _mm256_mul_ps(v, s));
            }
        }
        for (o, &b) in out[whole..].iter_mut().zip(&codes[whole..]) {
            *o = table[b as usize] * scale;
        }
    }

    /// Eight E4M3 codes (one per i32 lane) as f32, built from their bits (a gather from the
    /// table measured no faster than the scalar loop): a normal code's exponent rebiased from
    /// 7 to 127 with its three mantissa bits on top, a subnormal one `m · 2^-9` (exact), the
    /// sign on either, and the NaN codes `S.1111.111` zero, as the table decodes them.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn e4m3(b: __m256i) -> __m256 {
        let mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
        let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(b, _mm256_set1_epi32(0x80)));
        let normal = _mm256_add_epi32(_mm256_slli_epi32::<20>(mag), _mm256_set1_epi32((127 - 7) << 23));
        let sub = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0 / 512.0)));
        let is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag);
        let v = _mm256_or_si256(_mm256_blendv_epi8(normal, sub, is_sub), sign);
        let nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F));
        _mm256_castsi256_ps(_mm256_andnot_si256(nan, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::tests_support::{check_attention_hooks, random_rows};

    /// The SIMD decode equals the scalar one bit for bit: every code of both formats, a
    /// partial last group of eight, a scale that is not a power of two.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn widening_matches_the_scalar_decode() {
        if !crate::cpu::Isa::Avx2.available() {
            return;
        }
        let codes: Vec<u8> = (0..=255u8).chain([7, 200, 129]).collect();
        for kind in [Byte8::Fp8E4m3, Byte8::Int8] {
            let (table, scale) = (kind.table(), 0.0371f32);
            let mut out = vec![0f32; codes.len()];
            // SAFETY: AVX2 present (checked); lengths match.
            unsafe { avx2::widen(kind, table, &codes, scale, &mut out) };
            for (&c, &got) in codes.iter().zip(&out) {
                let want = table[c as usize] * scale;
                assert_eq!(got.to_bits(), want.to_bits(), "{kind:?} code {c}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn dynamic_scales_bound_the_error_per_element() {
        let geom = KvGeometry { head_dim: 64, n_kv_heads: 1 };
        let rows = random_rows(7, 16, 64);
        // E4M3 keeps 3 mantissa bits: relative error <= 2^-4 of the value, plus the subnormal
        // step 2^-9 x scale. int8: half a step of absmax/127.
        for kind in [Byte8::Fp8E4m3, Byte8::Int8] {
            let c = Scaled8Codec::new(geom, kind, None);
            let mut page = vec![0u8; c.page_bytes(16)];
            c.encode(0, KvPageMut { bytes: &mut page, tokens: 16 }, 0, &rows);
            let mut out = vec![0f32; rows.len()];
            c.decode(0, KvPage { bytes: &page, tokens: 16 }, 0..16, &mut out);
            for (x, o) in rows.chunks_exact(64).zip(out.chunks_exact(64)) {
                let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (a, b) in x.iter().zip(o) {
                    let tol = match kind {
                        Byte8::Fp8E4m3 => a.abs() / 16.0 + amax / 448.0 / 512.0,
                        Byte8::Int8 => amax / 127.0 * 0.5001,
                    };
                    assert!((a - b).abs() <= tol, "{kind:?}: {a} vs {b}");
                }
            }
            check_attention_hooks(&c, 16, 3);
        }
    }

    #[test]
    fn static_scale_stores_no_scale_and_saturates() {
        let geom = KvGeometry { head_dim: 4, n_kv_heads: 1 };
        let c = Scaled8Codec::new(geom, Byte8::Int8, Some(0.5));
        assert_eq!(c.page_bytes(2), 8);
        let mut page = vec![0u8; 8];
        c.encode(0, KvPageMut { bytes: &mut page, tokens: 2 }, 0, &[1.0, -2.0, 100.0, 0.26, 0.0, 0.1, -0.3, 7.0]);
        let mut out = vec![0f32; 8];
        c.decode(0, KvPage { bytes: &page, tokens: 2 }, 0..2, &mut out);
        assert_eq!(out, vec![1.0, -2.0, 63.5, 0.5, 0.0, 0.0, -0.5, 7.0]);
    }
}
