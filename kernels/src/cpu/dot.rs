//! Row dot products: quantized weight row · quantized activation row, and f32 · f32.
//!
//! Each kernel has a scalar reference and an AVX2 version; tests compare them on
//! random data. Accumulation order follows llama.cpp (integer sum per block, then
//! `d_w * d_a` in f32), so results agree with its CPU backend to rounding.

use super::caps::Isa;
use crate::ggml::act_quant::{Q8Block, Q8_BLOCK};
use crate::ggml::GgmlType;
use half::f16;

/// A weight block type that has an integer dot product against [`Q8Block`] activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantDot {
    /// Q4_0 weights (offset -8).
    Q4_0,
    /// Q4_1 weights (scale and min); uses the activation block sums.
    Q4_1,
    /// Q8_0 weights.
    Q8_0,
}

impl QuantDot {
    /// The integer-dot kernel for a weight type, if there is one.
    pub fn for_type(ty: GgmlType) -> Option<Self> {
        match ty {
            GgmlType::Q4_0 => Some(QuantDot::Q4_0),
            GgmlType::Q4_1 => Some(QuantDot::Q4_1),
            GgmlType::Q8_0 => Some(QuantDot::Q8_0),
            _ => None,
        }
    }

    /// Kernel name, e.g. `q4_1*q8_1`.
    pub fn name(self) -> &'static str {
        match self {
            QuantDot::Q4_0 => "q4_0*q8_0",
            QuantDot::Q4_1 => "q4_1*q8_1",
            QuantDot::Q8_0 => "q8_0*q8_0",
        }
    }

    /// Bytes per 32-value weight block.
    fn block_bytes(self) -> usize {
        match self {
            QuantDot::Q4_0 => 18,
            QuantDot::Q4_1 => 20,
            QuantDot::Q8_0 => 34,
        }
    }

    /// `Σ w·a` over one row: `w` holds `a.len()` weight blocks.
    ///
    /// # Panics
    /// If `isa` is not available on this CPU or the lengths disagree.
    pub fn dot(self, isa: Isa, w: &[u8], a: &[Q8Block]) -> f32 {
        assert_eq!(w.len(), a.len() * self.block_bytes(), "{} row length", self.name());
        match isa {
            Isa::Scalar => self.dot_scalar(w, a),
            Isa::Avx2 => {
                assert!(isa.available(), "AVX2 kernel requested on a CPU without AVX2+FMA");
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2+FMA presence checked above; lengths checked above.
                unsafe {
                    match self {
                        QuantDot::Q4_0 => avx2::q4_0(w, a),
                        QuantDot::Q4_1 => avx2::q4_1(w, a),
                        QuantDot::Q8_0 => avx2::q8_0(w, a),
                    }
                }
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!()
            }
        }
    }

    /// `out[j] = self.dot(isa, row j of w, a)` for `out.len()` consecutive rows stored
    /// back to back in `w`: checks once, then runs the same per-row kernel (bit-identical to
    /// [`Self::dot`]) without per-row dispatch.
    pub fn dot_rows(self, isa: Isa, w: &[u8], a: &[Q8Block], out: &mut [f32]) {
        let rb = a.len() * self.block_bytes();
        assert_eq!(w.len(), rb * out.len(), "{} rows length", self.name());
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                assert!(isa.available(), "AVX2 kernel requested on a CPU without AVX2+FMA");
                // SAFETY: AVX2+FMA presence and lengths checked above.
                unsafe { avx2::rows(self, w, rb, a, out) }
            }
            _ => {
                for (o, row) in out.iter_mut().zip(w.chunks_exact(rb)) {
                    *o = self.dot_scalar(row, a);
                }
            }
        }
    }

    /// `out[t] = self.dot(isa, w, acts[t])` for up to [`MULTI_TOKENS`] activation rows, each
    /// weight block unpacked once for all of them. Bit-identical to calling [`Self::dot`] per
    /// row (same operations in the same order per row), so batching never changes a result.
    pub fn dot_multi(self, isa: Isa, w: &[u8], acts: &[&[Q8Block]], out: &mut [f32]) {
        assert!(acts.len() <= MULTI_TOKENS && out.len() == acts.len());
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx2 && self != QuantDot::Q4_0 {
            assert!(isa.available(), "AVX2 kernel requested on a CPU without AVX2+FMA");
            for a in acts {
                assert_eq!(w.len(), a.len() * self.block_bytes(), "{} row length", self.name());
            }
            // SAFETY: AVX2+FMA presence and lengths checked above.
            unsafe {
                match acts.len() {
                    4 => out.copy_from_slice(&avx2::multi::<4>(self, w, acts.try_into().expect("4"))),
                    3 => out.copy_from_slice(&avx2::multi::<3>(self, w, acts.try_into().expect("3"))),
                    2 => out.copy_from_slice(&avx2::multi::<2>(self, w, acts.try_into().expect("2"))),
                    1 => out[0] = self.dot(isa, w, acts[0]),
                    _ => {}
                }
            }
            return;
        }
        for (o, a) in out.iter_mut().zip(acts) {
            *o = self.dot(isa, w, a);
        }
    }

    /// [`Self::dot_multi`] over consecutive weight rows: `out` is `rows × acts.len()`
    /// (row-major), one checked call for a whole task instead of one per weight row.
    /// Bit-identical to `dot_multi` per row.
    pub fn dot_multi_rows(self, isa: Isa, w: &[u8], acts: &[&[Q8Block]], out: &mut [f32]) {
        let t = acts.len();
        assert!(t > 0 && t <= MULTI_TOKENS && out.len().is_multiple_of(t), "1..={MULTI_TOKENS} activation rows");
        let rb = acts[0].len() * self.block_bytes();
        assert!(acts.iter().all(|a| a.len() == acts[0].len()), "activation rows differ in length");
        assert_eq!(w.len(), out.len() / t * rb, "{} rows length", self.name());
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx2 && self != QuantDot::Q4_0 {
            assert!(isa.available(), "AVX2 kernel requested on a CPU without AVX2+FMA");
            // SAFETY: AVX2+FMA presence and all lengths checked above.
            unsafe {
                match t {
                    4 => avx2::multi_rows::<4>(self, w, rb, acts.try_into().expect("4"), out),
                    3 => avx2::multi_rows::<3>(self, w, rb, acts.try_into().expect("3"), out),
                    2 => avx2::multi_rows::<2>(self, w, rb, acts.try_into().expect("2"), out),
                    _ => avx2::rows(self, w, rb, acts[0], out),
                }
            }
            return;
        }
        for (row, o) in w.chunks_exact(rb).zip(out.chunks_exact_mut(t)) {
            self.dot_multi(isa, row, acts, o);
        }
    }

    fn dot_scalar(self, w: &[u8], a: &[Q8Block]) -> f32 {
        let bb = self.block_bytes();
        let mut sum = 0f32;
        for (b, ab) in w.chunks_exact(bb).zip(a) {
            let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
            match self {
                QuantDot::Q4_0 => {
                    let qs = &b[2..18];
                    let mut s = 0i32;
                    let (lo, hi) = ab.qs.split_at(Q8_BLOCK / 2);
                    for ((&q, &a0), &a1) in qs.iter().zip(lo).zip(hi) {
                        s += ((q & 0x0F) as i32 - 8) * a0 as i32 + ((q >> 4) as i32 - 8) * a1 as i32;
                    }
                    sum += s as f32 * d * ab.d;
                }
                QuantDot::Q4_1 => {
                    let m = f16::from_le_bytes([b[2], b[3]]).to_f32();
                    let qs = &b[4..20];
                    let mut s = 0i32;
                    let (lo, hi) = ab.qs.split_at(Q8_BLOCK / 2);
                    for ((&q, &a0), &a1) in qs.iter().zip(lo).zip(hi) {
                        s += (q & 0x0F) as i32 * a0 as i32 + (q >> 4) as i32 * a1 as i32;
                    }
                    sum += s as f32 * d * ab.d + m * ab.s;
                }
                QuantDot::Q8_0 => {
                    let s: i32 =
                        b[2..34].iter().zip(&ab.qs).map(|(&w, &x)| w as i8 as i32 * x as i32).sum();
                    sum += s as f32 * d * ab.d;
                }
            }
        }
        sum
    }
}

/// Most activation rows [`QuantDot::dot_multi`] takes at once.
pub const MULTI_TOKENS: usize = 4;

/// `Σ a·b` in f32.
pub fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    match isa {
        Isa::Scalar => a.iter().zip(b).map(|(x, y)| x * y).sum(),
        Isa::Avx2 => {
            assert!(isa.available(), "AVX2 kernel requested on a CPU without AVX2+FMA");
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2+FMA presence checked above; equal lengths checked above.
            unsafe {
                avx2::f32_dot(a, b)
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!()
        }
    }
}

/// `y += a · x`.
pub fn axpy_f32(isa: Isa, a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    match isa {
        Isa::Scalar => y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x),
        Isa::Avx2 => {
            assert!(isa.available(), "AVX2 kernel requested on a CPU without AVX2+FMA");
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2+FMA presence checked above; equal lengths checked above.
            unsafe {
                avx2::f32_axpy(a, x, y)
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!()
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::simd::hsum;
    use crate::ggml::act_quant::Q8Block;
    use std::arch::x86_64::*;

    /// Two consecutive f16 values at `b[0..4]` as f32, converted inline with F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn f16_pair(b: &[u8]) -> (f32, f32) {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }

    /// One f16 value at `b[0..2]` as f32.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn f16_one(b: &[u8]) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes([b[0], b[1]]) as i32)))
    }

    /// Unpacks 16 bytes of nibbles into 32 unsigned bytes (low nibbles first).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn nibbles(b: &[u8]) -> __m256i {
        let b: &[u8; 16] = b[..16].try_into().expect("16 bytes");
        // SAFETY: `b` is 16 readable bytes.
        let raw = unsafe { _mm_loadu_si128(b.as_ptr() as *const __m128i) };
        let mask = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(raw, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        _mm256_set_m128i(hi, lo)
    }

    /// 32 bytes as a vector.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn load32(b: &[u8]) -> __m256i {
        let b: &[u8; 32] = b[..32].try_into().expect("32 bytes");
        // SAFETY: `b` is 32 readable bytes.
        unsafe { _mm256_loadu_si256(b.as_ptr() as *const __m256i) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn acts(ab: &Q8Block) -> __m256i {
        // SAFETY: qs is 32 bytes.
        unsafe { _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i) }
    }

    /// Signed i8 x i8 products summed pairwise into 8 i32 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn dot_i8(x: __m256i, y: __m256i) -> __m256i {
        let ax = _mm256_sign_epi8(x, x);
        let sy = _mm256_sign_epi8(y, x);
        _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
    }

    /// Unsigned (weights) x signed (activations) i8 products summed into 8 i32 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn dot_u8_i8(w: __m256i, x: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
    }

    /// Runs `block(weight_block, act_block, acc)` over pairs of blocks with two independent
    /// accumulators (hides FMA latency), then the odd tail.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn blocks2(w: &[u8], bb: usize, a: &[Q8Block], mut block: impl FnMut(&[u8], &Q8Block, __m256) -> __m256) -> __m256 {
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut wc = w.chunks_exact(2 * bb);
        let mut ac = a.chunks_exact(2);
        for (wp, ap) in (&mut wc).zip(&mut ac) {
            acc0 = block(&wp[..bb], &ap[0], acc0);
            acc1 = block(&wp[bb..], &ap[1], acc1);
        }
        if let (Some(ab), true) = (ac.remainder().first(), wc.remainder().len() == bb) {
            acc0 = block(wc.remainder(), ab, acc0);
        }
        _mm256_add_ps(acc0, acc1)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn q4_1(w: &[u8], a: &[Q8Block]) -> f32 {
        let mut mins = 0f32;
        let acc = blocks2(w, 20, a, |b, ab, acc| {
            let (d, m) = f16_pair(b);
            mins += m * ab.s;
            let p = dot_u8_i8(nibbles(&b[4..]), acts(ab));
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * ab.d), acc)
        });
        // SAFETY: AVX is enabled by this function's target features.
        unsafe { hsum(acc) + mins }
    }

    /// Consecutive weight rows of `rb` bytes against one activation row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn rows(kind: super::QuantDot, w: &[u8], rb: usize, a: &[Q8Block], out: &mut [f32]) {
        let rows = w.chunks_exact(rb);
        match kind {
            super::QuantDot::Q4_1 => out.iter_mut().zip(rows).for_each(|(o, r)| *o = q4_1(r, a)),
            super::QuantDot::Q4_0 => out.iter_mut().zip(rows).for_each(|(o, r)| *o = q4_0(r, a)),
            super::QuantDot::Q8_0 => out.iter_mut().zip(rows).for_each(|(o, r)| *o = q8_0(r, a)),
        }
    }

    /// Consecutive weight rows of `rb` bytes against T activation rows into `out[row * T + t]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn multi_rows<const T: usize>(kind: super::QuantDot, w: &[u8], rb: usize, a: [&[Q8Block]; T], out: &mut [f32]) {
        for (row, o) in w.chunks_exact(rb).zip(out.chunks_exact_mut(T)) {
            o.copy_from_slice(&multi::<T>(kind, row, a));
        }
    }

    /// Q4_1 or Q8_0 weights against T activation rows; per row the exact operation sequence of
    /// [`q4_1`] / [`q8_0`] (two accumulators alternating by block parity, mins summed in block order).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub fn multi<const T: usize>(kind: super::QuantDot, w: &[u8], a: [&[Q8Block]; T]) -> [f32; T] {
        let bb = kind.block_bytes();
        let nb = w.len() / bb;
        let q4_1 = kind == super::QuantDot::Q4_1;
        let mut mins = [0f32; T];
        let mut acc0 = [_mm256_setzero_ps(); T];
        let mut acc1 = [_mm256_setzero_ps(); T];
        // Block `$bi` against every row into accumulator set `$acc`; a macro so that both
        // accumulator sets stay in registers (a helper function or closure is not inlined).
        macro_rules! block {
            ($bi:expr, $acc:ident) => {{
                let bi = $bi;
                let b = &w[bi * bb..(bi + 1) * bb];
                if q4_1 {
                    let (d, m) = f16_pair(b);
                    let q = nibbles(&b[4..]);
                    for t in 0..T {
                        let ab = &a[t][bi];
                        mins[t] += m * ab.s;
                        let p = dot_u8_i8(q, acts(ab));
                        $acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * ab.d), $acc[t]);
                    }
                } else {
                    let d = f16_one(b);
                    let q = load32(&b[2..]);
                    for t in 0..T {
                        let ab = &a[t][bi];
                        let p = dot_i8(q, acts(ab));
                        $acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * ab.d), $acc[t]);
                    }
                }
            }};
        }
        let mut bi = 0;
        while bi + 1 < nb {
            block!(bi, acc0);
            block!(bi + 1, acc1);
            bi += 2;
        }
        if bi < nb {
            block!(bi, acc0);
        }
        let mut out = [0f32; T];
        for t in 0..T {
            // SAFETY: AVX is enabled by this function's target features.
            let h = unsafe { hsum(_mm256_add_ps(acc0[t], acc1[t])) };
            out[t] = if q4_1 { h + mins[t] } else { h };
        }
        out
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn q4_0(w: &[u8], a: &[Q8Block]) -> f32 {
        let acc = blocks2(w, 18, a, |b, ab, acc| {
            let d = f16_one(b);
            let q = _mm256_sub_epi8(nibbles(&b[2..]), _mm256_set1_epi8(8));
            let p = dot_i8(q, acts(ab));
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * ab.d), acc)
        });
        // SAFETY: AVX is enabled by this function's target features.
        unsafe { hsum(acc) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn q8_0(w: &[u8], a: &[Q8Block]) -> f32 {
        let acc = blocks2(w, 34, a, |b, ab, acc| {
            let d = f16_one(b);
            let p = dot_i8(load32(&b[2..]), acts(ab));
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * ab.d), acc)
        });
        // SAFETY: AVX is enabled by this function's target features.
        unsafe { hsum(acc) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f32_axpy(a: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len();
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        // SAFETY: every access is within 0..n, checked by the loop bounds.
        unsafe {
            while i + 8 <= n {
                let v = _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(y.as_ptr().add(i)));
                _mm256_storeu_ps(y.as_mut_ptr().add(i), v);
                i += 8;
            }
        }
        for j in i..n {
            y[j] += a * x[j];
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f32_dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load is within 0..n, checked by the loop bounds.
        unsafe {
            while i + 32 <= n {
                for (u, acc) in acc.iter_mut().enumerate() {
                    let o = i + 8 * u;
                    *acc = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(o)), _mm256_loadu_ps(pb.add(o)), *acc);
                }
                i += 32;
            }
            while i + 8 <= n {
                acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]);
                i += 8;
            }
            let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            let mut total = hsum(s);
            while i < n {
                total += *pa.add(i) * *pb.add(i);
                i += 1;
            }
            total
        }
    }
}
