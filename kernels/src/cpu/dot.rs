//! f32 row kernels: dot product and axpy, and their many-row forms for attention (every
//! query against every key, weighted sums of value rows), each with a scalar reference and
//! an AVX2 version (tests compare them on random data); the scores and the weighted sums
//! also have an AVX-512 form, the AVX2 one's bits. The integer kernels of quantized weights live in
//! [`crate::linear::ggml::interleaved`].

use super::caps::Isa;

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

/// `out[i * n + j] = q_i · k_j` for the rows `q_i` of `q` and `k_j` of `k`, each `d` wide
/// (`n = k.len() / d`): attention scores of a few queries against a run of keys.
///
/// With AVX2 and `d` a multiple of 8, eight keys are scored at a time against one query
/// load and their eight sums reduced together, instead of one reduction per key. With
/// AVX-512 two queries share each key load and each 512-bit FMA does two keys' 256-bit ones
/// (same lanes, same order, so the AVX2 form's bits). Each score's bits depend only on its
/// query and key, not on where the key sits in `k` or which queries share the call (tile and
/// block boundaries must not change attention).
pub fn dots_f32(isa: Isa, q: &[f32], k: &[f32], d: usize, out: &mut [f32]) {
    assert!(d > 0 && q.len().is_multiple_of(d) && k.len().is_multiple_of(d), "rows of {d}");
    let n = k.len() / d;
    assert_eq!(out.len(), q.len() / d * n, "output shape");
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && d.is_multiple_of(8) {
        assert!(isa.available(), "AVX2 kernel requested on a CPU without AVX2+FMA");
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F (and AVX2+FMA) present (checked); shapes checked above.
            unsafe { avx512::dots(q, k, d, out) };
        } else {
            // SAFETY: AVX2+FMA present (checked); shapes checked above.
            unsafe { avx2::dots(q, k, d, out) };
        }
        return;
    }
    for (qi, o) in q.chunks_exact(d).zip(out.chunks_exact_mut(n.max(1))) {
        for (kj, o) in k.chunks_exact(d).zip(o) {
            *o = dot_f32(isa, qi, kj);
        }
    }
}

/// `acc_i += Σ_j w[i * n + j] · v_j` for the rows `acc_i` of `acc` and `v_j` of `v`, each `d`
/// wide (`n = v.len() / d`): the value side of attention. Zero weights (masked keys) are
/// skipped.
///
/// With AVX2 and `d` a multiple of 8, each row's sums stay in registers across the keys
/// (64 columns at a time) instead of being loaded and stored once per key. With AVX-512 and
/// `d` a multiple of 64, four rows share each value load. Both SIMD forms add each nonzero term
/// into each sum in key order with one FMA, so they give the same bits (the scalar form
/// multiplies and adds, two roundings).
pub fn weighted_sum_f32(isa: Isa, w: &[f32], v: &[f32], d: usize, acc: &mut [f32]) {
    assert!(d > 0 && acc.len().is_multiple_of(d) && v.len().is_multiple_of(d), "rows of {d}");
    let n = v.len() / d;
    assert_eq!(w.len(), acc.len() / d * n, "weight shape");
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && d.is_multiple_of(8) {
        assert!(isa.available(), "AVX2 kernel requested on a CPU without AVX2+FMA");
        if d.is_multiple_of(avx512::COLUMNS) && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F present (checked); shapes checked above.
            unsafe { avx512::weighted_sum(w, v, d, acc) };
        } else {
            // SAFETY: AVX2+FMA present (checked); shapes checked above.
            unsafe { avx2::weighted_sum(w, v, d, acc) };
        }
        return;
    }
    for (a, wi) in acc.chunks_exact_mut(d).zip(w.chunks_exact(n.max(1))) {
        for (&wj, vj) in wi.iter().zip(v.chunks_exact(d)) {
            if wj != 0.0 {
                axpy_f32(isa, wj, vj, a);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::avx2::hsum8;
    use std::arch::x86_64::*;

    /// The scores of `Q` query rows from `qi` (at `pq`) against keys `j0..j0 + kn` (rows of `d`
    /// at `pk`), one vector of eight per query, with the bits of the AVX2 form's `key_block`:
    /// register `p` holds keys `2p` and `2p + 1` in its 256-bit halves, each half accumulating
    /// exactly as that form's register for the key, and the same reduction. Keys past `kn`
    /// keep zero sums; `FULL` fixes `kn` at 8.
    ///
    /// # Safety
    /// AVX-512F, AVX2 and FMA present; queries `qi..qi + Q` and keys `j0..j0 + kn` have `d`
    /// floats each, `d` a multiple of 8.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    unsafe fn key_block<const Q: usize, const FULL: bool>(pq: *const f32, pk: *const f32, qi: usize, j0: usize, kn: usize, d: usize) -> [__m256; Q] {
        let kn = if FULL { 8 } else { kn };
        let pairs = kn.div_ceil(2);
        let mut acc = [[_mm512_setzero_ps(); 4]; Q];
        for c in (0..d).step_by(8) {
            // SAFETY: caller's contract (query rows and keys below kn have d floats).
            unsafe {
                // Each query's eight floats in both halves.
                let qv: [__m512; Q] = std::array::from_fn(|u| {
                    _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(pq.add((qi + u) * d + c)))))
                });
                for p in 0..pairs {
                    let lo = _mm256_loadu_ps(pk.add((j0 + 2 * p) * d + c));
                    let hi = if FULL || 2 * p + 1 < kn { _mm256_loadu_ps(pk.add((j0 + 2 * p + 1) * d + c)) } else { _mm256_setzero_ps() };
                    let kv = _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi)));
                    for (a, q) in acc.iter_mut().zip(&qv) {
                        a[p] = _mm512_fmadd_ps(*q, kv, a[p]);
                    }
                }
            }
        }
        acc.map(|a| {
            let halves: [__m256; 8] = std::array::from_fn(|j| {
                let v = _mm512_castps_pd(a[j / 2]);
                _mm256_castpd_ps(if j % 2 == 0 { _mm512_castpd512_pd256(v) } else { _mm512_extractf64x4_pd::<1>(v) })
            });
            hsum8(&halves)
        })
    }

    /// The scores of `Q` queries from `qi` against every key, into their rows of `out`.
    ///
    /// # Safety
    /// As [`key_block`]; `out` has `n` floats per query row, `n = k.len() / d`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    unsafe fn query_rows<const Q: usize>(q: &[f32], k: &[f32], d: usize, qi: usize, out: &mut [f32]) {
        let n = k.len() / d;
        let (pq, pk) = (q.as_ptr(), k.as_ptr());
        let whole = n / 8 * 8;
        for j0 in (0..whole).step_by(8) {
            // SAFETY: queries qi..qi + Q and keys j0..j0 + 8 exist (caller's contract).
            let s = unsafe { key_block::<Q, true>(pq, pk, qi, j0, 8, d) };
            for (u, s) in s.iter().enumerate() {
                // SAFETY: row qi + u of `out` has columns j0..j0 + 8 (j0 + 8 <= n).
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add((qi + u) * n + j0), *s) };
            }
        }
        if whole < n {
            // SAFETY: queries qi..qi + Q and keys whole..n exist (caller's contract).
            let s = unsafe { key_block::<Q, false>(pq, pk, qi, whole, n - whole, d) };
            for (u, s) in s.iter().enumerate() {
                let mut sums = [0f32; 8];
                // SAFETY: `sums` is 8 floats.
                unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), *s) };
                out[(qi + u) * n + whole..(qi + u + 1) * n].copy_from_slice(&sums[..n - whole]);
            }
        }
    }

    /// See [`super::dots_f32`]; `d` is a multiple of 8. Queries two at a time, a last odd one
    /// alone (the same bits either way).
    ///
    /// # Safety
    /// AVX-512F, AVX2 and FMA present; shapes as [`super::dots_f32`] checks.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn dots(q: &[f32], k: &[f32], d: usize, out: &mut [f32]) {
        let rows = q.len() / d;
        let mut qi = 0;
        // SAFETY (both calls): the queries exist and `out` has their rows (checked shapes).
        while qi + 2 <= rows {
            unsafe { query_rows::<2>(q, k, d, qi, out) };
            qi += 2;
        }
        if qi < rows {
            unsafe { query_rows::<1>(q, k, d, qi, out) };
        }
    }

    /// Columns one pass keeps in registers per row (four vectors).
    pub const COLUMNS: usize = 64;
    /// Rows that share each value load.
    const ROWS: usize = 4;

    /// Columns `c0..c0 + 64` of `R` accumulator rows (`d` apart from `acc`) += Σ_j w_ij · v_j;
    /// a zero weight leaves its row's sums untouched (masked FMA), as the other forms skip it.
    ///
    /// # Safety
    /// AVX-512F present; `acc` has `R` rows of `d >= c0 + 64` floats, `w` `R` rows of `n`
    /// weights (`n` apart) and `v` `n` rows of `d` floats.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn rows_columns<const R: usize>(w: &[f32], n: usize, v: &[f32], d: usize, c0: usize, acc: &mut [f32]) {
        let pa = acc.as_mut_ptr();
        let mut sums = [[_mm512_setzero_ps(); 4]; R];
        // SAFETY (loads and stores of `acc` and `v`): inside the rows the caller vouches for.
        unsafe {
            for (r, s) in sums.iter_mut().enumerate() {
                for (u, x) in s.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(pa.add(r * d + c0 + 16 * u));
                }
            }
            for j in 0..n {
                let wj: [f32; R] = std::array::from_fn(|r| w[r * n + j]);
                if wj.iter().all(|&x| x == 0.0) {
                    continue;
                }
                let vj: [__m512; 4] = std::array::from_fn(|u| _mm512_loadu_ps(v.as_ptr().add(j * d + c0 + 16 * u)));
                for (s, &x) in sums.iter_mut().zip(&wj) {
                    let (k, b) = (if x != 0.0 { 0xFFFF } else { 0 }, _mm512_set1_ps(x));
                    for (su, vu) in s.iter_mut().zip(&vj) {
                        *su = _mm512_mask3_fmadd_ps(b, *vu, *su, k);
                    }
                }
            }
            for (r, s) in sums.iter().enumerate() {
                for (u, x) in s.iter().enumerate() {
                    _mm512_storeu_ps(pa.add(r * d + c0 + 16 * u), *x);
                }
            }
        }
    }

    /// See [`super::weighted_sum_f32`]; `d` is a multiple of [`COLUMNS`].
    ///
    /// # Safety
    /// AVX-512F present; shapes as [`super::weighted_sum_f32`] checks.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn weighted_sum(w: &[f32], v: &[f32], d: usize, acc: &mut [f32]) {
        let (n, rows) = (v.len() / d, acc.len() / d);
        let mut r0 = 0;
        while r0 < rows {
            let (wr, ar) = (&w[r0 * n..], &mut acc[r0 * d..]);
            for c0 in (0..d).step_by(COLUMNS) {
                // SAFETY: rows r0.. of `acc` and `w` exist as the calls need (shapes checked).
                unsafe {
                    if r0 + ROWS <= rows {
                        rows_columns::<ROWS>(wr, n, v, d, c0, ar);
                    } else {
                        rows_columns::<1>(wr, n, v, d, c0, ar);
                    }
                }
            }
            r0 += if r0 + ROWS <= rows { ROWS } else { 1 };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::simd::hsum;
    use std::arch::x86_64::*;

    /// The sums of eight vectors' lanes, in order, in one vector.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) fn hsum8(a: &[__m256; 8]) -> __m256 {
        let t = [_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]), _mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7])];
        let (u0, u1) = (_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
        _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(u0, u1), _mm256_permute2f128_ps::<0x31>(u0, u1))
    }

    /// The scores of query row `qi` (at `pq`) against keys `j0..j0 + kn` (rows of `d` at
    /// `pk`), in the lanes of one vector; the lanes past `kn` are reduced empty, so a key's
    /// score has the same bits wherever it falls in the run. `FULL` fixes `kn` at 8: whole
    /// blocks then run with fixed trip counts, no per-key test in the loop.
    ///
    /// # Safety
    /// AVX2 and FMA present; query `qi` and keys `j0..j0 + kn` have `d` floats each.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn key_block<const FULL: bool>(pq: *const f32, pk: *const f32, qi: usize, j0: usize, kn: usize, d: usize) -> __m256 {
        let kn = if FULL { 8 } else { kn };
        let mut acc = [_mm256_setzero_ps(); 8];
        for c in (0..d).step_by(8) {
            // SAFETY: caller's contract.
            unsafe {
                let qv = _mm256_loadu_ps(pq.add(qi * d + c));
                for (u, a) in acc.iter_mut().enumerate().take(kn) {
                    *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(pk.add((j0 + u) * d + c)), *a);
                }
            }
        }
        hsum8(&acc)
    }

    /// See [`super::dots_f32`]; `d` is a multiple of 8.
    ///
    /// # Safety
    /// AVX2 and FMA present; shapes as [`super::dots_f32`] checks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots(q: &[f32], k: &[f32], d: usize, out: &mut [f32]) {
        let n = k.len() / d;
        let (pq, pk) = (q.as_ptr(), k.as_ptr());
        let whole = n / 8 * 8;
        for (i, o) in out.chunks_exact_mut(n.max(1)).enumerate().take(q.len() / d) {
            for j0 in (0..whole).step_by(8) {
                let dst: &mut [f32; 8] = (&mut o[j0..j0 + 8]).try_into().expect("8 scores");
                // SAFETY: query i and keys j0..j0 + 8 exist (shapes checked); `dst` is 8 floats.
                unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), key_block::<true>(pq, pk, i, j0, 8, d)) };
            }
            if whole < n {
                let mut sums = [0f32; 8];
                // SAFETY: query i and keys whole..n exist (shapes checked); `sums` is 8 floats.
                unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), key_block::<false>(pq, pk, i, whole, n - whole, d)) };
                o[whole..].copy_from_slice(&sums[..n - whole]);
            }
        }
    }

    /// Columns `c0..c0 + 8U` of one accumulator row `a` += Σ_j w_j · v_j.
    ///
    /// # Safety
    /// AVX2 and FMA present; `a` has `c0 + 8U` floats and each value row (`d` apart) too.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn wsum_columns<const U: usize>(w: &[f32], v: &[f32], d: usize, c0: usize, a: &mut [f32]) {
        let pa = a.as_mut_ptr();
        let mut acc = [_mm256_setzero_ps(); U];
        // SAFETY: columns c0..c0 + 8U of `a` (caller's contract).
        unsafe {
            for (u, x) in acc.iter_mut().enumerate() {
                *x = _mm256_loadu_ps(pa.add(c0 + 8 * u));
            }
        }
        for (j, &wj) in w.iter().enumerate() {
            if wj == 0.0 {
                continue;
            }
            let wv = _mm256_set1_ps(wj);
            for (u, x) in acc.iter_mut().enumerate() {
                // SAFETY: value row j has d >= c0 + 8U floats (caller's contract).
                *x = unsafe { _mm256_fmadd_ps(wv, _mm256_loadu_ps(v.as_ptr().add(j * d + c0 + 8 * u)), *x) };
            }
        }
        // SAFETY: as the loads above.
        unsafe {
            for (u, x) in acc.iter().enumerate() {
                _mm256_storeu_ps(pa.add(c0 + 8 * u), *x);
            }
        }
    }

    /// See [`super::weighted_sum_f32`]; `d` is a multiple of 8.
    ///
    /// # Safety
    /// AVX2 and FMA present; shapes as [`super::weighted_sum_f32`] checks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn weighted_sum(w: &[f32], v: &[f32], d: usize, acc: &mut [f32]) {
        let n = v.len() / d;
        for (a, wi) in acc.chunks_exact_mut(d).zip(w.chunks_exact(n.max(1))) {
            let mut c0 = 0;
            // SAFETY (both calls): columns c0..c0 + 64 (or + 8) lie inside rows of d floats.
            while c0 + 64 <= d {
                unsafe { wsum_columns::<8>(wi, v, d, c0, a) };
                c0 += 64;
            }
            while c0 < d {
                unsafe { wsum_columns::<1>(wi, v, d, c0, a) };
                c0 += 8;
            }
        }
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

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use rand::{Rng, SeedableRng};

    /// The AVX-512 scores against the AVX2 ones, bit for bit: odd and even query counts (the
    /// last query alone), key counts with and without a partial block of eight (odd ones leave
    /// half a key pair empty), head widths of 8, 64 and 72 floats.
    #[test]
    fn dots_forms_agree_bit_for_bit() {
        if !(super::Isa::Avx2.available() && std::arch::is_x86_feature_detected!("avx512f")) {
            return;
        }
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(10);
        for (rows, n, d) in [(1, 8, 64), (2, 13, 64), (5, 21, 72), (4, 3, 8), (7, 64, 64), (3, 0, 64), (6, 17, 128)] {
            let q: Vec<f32> = (0..rows * d).map(|_| r.gen_range(-2.0f32..2.0)).collect();
            let k: Vec<f32> = (0..n * d).map(|_| r.gen_range(-2.0f32..2.0)).collect();
            let (mut s2, mut s512) = (vec![f32::NAN; rows * n], vec![f32::NAN; rows * n]);
            // SAFETY: AVX2+FMA and AVX-512F present (checked above); shapes consistent.
            unsafe {
                super::avx2::dots(&q, &k, d, &mut s2);
                super::avx512::dots(&q, &k, d, &mut s512);
            }
            assert!(s2.iter().all(|x| x.is_finite()), "{rows}x{n}x{d}: a score left unwritten");
            assert_eq!(s2.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), s512.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "{rows}x{n}x{d}");
        }
    }

    /// The AVX-512 weighted sum against the AVX2 one, bit for bit: row counts that fill the
    /// four-row blocks and leave a tail, 64 and 128 columns, a third of the weights zero and
    /// some keys zero in every row, a NaN value under weights zero in every row, and an
    /// infinite value under a weight zero in one row of a four-row block but not in the next
    /// (the masked FMA must leave the first untouched: 0 · inf would be NaN).
    #[test]
    fn weighted_sum_forms_agree_bit_for_bit() {
        if !(super::Isa::Avx2.available() && std::arch::is_x86_feature_detected!("avx512f")) {
            return;
        }
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        for (rows, n, d) in [(4, 16, 64), (7, 21, 64), (9, 5, 128), (1, 3, 64), (3, 0, 64)] {
            let mut v: Vec<f32> = (0..n * d).map(|_| r.gen_range(-2.0f32..2.0)).collect();
            let mut w: Vec<f32> = (0..rows * n).map(|_| r.gen::<f32>()).collect();
            w.iter_mut().step_by(3).for_each(|x| *x = 0.0);
            if n > 2 {
                (0..rows).for_each(|i| w[i * n + 1] = 0.0);
                v[d + 5] = f32::NAN;
                if rows > 1 {
                    v[2 * d + 7] = f32::INFINITY;
                    w[2] = 0.0;
                    w[n + 2] = 0.5;
                }
            }
            let acc0: Vec<f32> = (0..rows * d).map(|_| r.gen_range(-1.0f32..1.0)).collect();
            let (mut a2, mut a512) = (acc0.clone(), acc0);
            // SAFETY: AVX2+FMA and AVX-512F present (checked above); shapes consistent.
            unsafe {
                super::avx2::weighted_sum(&w, &v, d, &mut a2);
                super::avx512::weighted_sum(&w, &v, d, &mut a512);
            }
            assert!(a2.iter().all(|x| !x.is_nan()), "{rows}x{n}x{d}: a skipped NaN leaked");
            assert_eq!(a2.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), a512.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "{rows}x{n}x{d}");
        }
    }
}
