//! QJL (`qjl1`): each key is stored as the signs of a 256-dimensional random sketch plus its
//! norm, and scored against a sketched query with the unbiased QJL inner-product estimator.
//! Keys only (values are refused by [`super::KvFormat::check`]; its registry row is in `family.rs`).
//!
//! Record layout per (token, head), `block_qjl1_256`, [`RECORD_BYTES`] = 34 bytes for any
//! `head_dim`: `[signs of s = kᵀΠ: 256 bits, 8 per byte, LSB first (32 bytes)][‖k‖: bf16 LE]`.
//! Bit `j` is 1 when `s_j > 0` (sign +1) and 0 otherwise (sign −1, so the zero key is all
//! zero bytes). Against bf16 keys that is 7.53× smaller at head_dim 128 (256 / 34 bytes) and
//! 3.76× at head_dim 64 (128 / 34 bytes), the default model's.
//!
//! `Π ∈ R^{head_dim × 256}` is drawn N(0, 1) (ChaCha8 seeded with the base seed, stream =
//! layer, Box-Muller) and its columns are orthogonalized in chunks of `head_dim`, as the QJL
//! reference does with its `rot` option; one matrix per layer, shared by all heads. Keys
//! decode to `k̂ = ‖k‖·c·Π·sign(s)`, so `<q, k̂> = ‖k‖·c·Σ_j sign(s_j)·(Πᵀq)_j`, the QJL
//! estimator of `<q, k>`, unbiased over Π for `c = 1/(256·E|<u, π_j>|)` (`sqrt(π/2)/256`
//! for Gaussian columns, 0.4% less at head_dim 64). Its variance is
//! `(π/2·‖q‖²‖k‖² − <q, k>²)/256` with i.i.d. Gaussian columns and, with full orthogonal
//! chunks (head_dim dividing 256), to leading order `((π/2 − 1)·‖q‖²‖k‖² − ½<q, k>²)/256`:
//! 0.36x for orthogonal q and k, about 0.12x for parallel ones (PPL with qjl1 keys at ctx
//! 1024: +223% → +64.5% against bf16). A last partial chunk (head_dim not dividing 256) or a
//! head wider than 256 gains less; the estimator stays unbiased. Queries are sketched once
//! per step ([`KvCodec::prepare_query`]); scoring a key is then a sign-flipped sum of 256
//! floats. The `qjl1` format's exact sink and window keys are not in these pages: the engine
//! keeps them per sequence and attention scores them ([`crate::attention::ExactKeys`]).

mod family;

pub use family::{format, Qjl1};

use super::{CodecOptions, KeyCalibration, KvCodec, KvGeometry, KvPage, KvPageMut};
use crate::cpu::Isa;
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::ops::Range;

/// Sketch dimension: columns of Π, sign bits per key, floats per prepared query.
pub const SKETCH_DIM: usize = 256;
/// Bytes of packed sign bits per key.
const SIGN_BYTES: usize = SKETCH_DIM / 8;
/// Bytes per (token, head) record: packed signs then the bf16 norm.
pub const RECORD_BYTES: usize = 34;
const _: () = assert!(SKETCH_DIM.is_multiple_of(8) && RECORD_BYTES == SIGN_BYTES + 2);

/// QJL key pages for one layer: the layer's projection Π and the kernels' ISA.
pub struct QjlCodec {
    head_dim: usize,
    /// Π row-major (`head_dim × 256`): row `d` is `Π[d, ·]`, read contiguously both by the
    /// sketch (`Σ_d x_d·Π[d, ·]`) and by decoding (`Σ_j sign_j·Π[d, j]` per row).
    proj: Vec<f32>,
    /// The estimator's scale per unit of key norm, [`estimator_scale`].
    scale: f32,
    /// Kernel level: detected in `new` (tests also run the portable kernels).
    isa: Isa,
}

impl QjlCodec {
    /// A codec for heads of `geom`, with Π drawn from (`opts.seed`, `opts.layer`).
    pub fn new(geom: KvGeometry, opts: CodecOptions) -> Self {
        assert!(geom.head_dim > 0, "QJL keys need a non-empty head");
        QjlCodec { head_dim: geom.head_dim, proj: projection(geom.head_dim, opts), scale: estimator_scale(geom.head_dim), isa: super::isa() }
    }

    /// `out = xᵀΠ` (256 floats). Every ISA sums over `d` in order with separate multiply and
    /// add roundings, so the signs written do not depend on the machine.
    fn sketch(&self, x: &[f32], out: &mut [f32]) {
        assert!(x.len() == self.head_dim && out.len() == SKETCH_DIM);
        match self.isa {
            Isa::Scalar => portable::sketch(x, &self.proj, out),
            Isa::Avx2 => {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa` is Avx2 only when the CPU has it (detected in `new`).
                unsafe {
                    avx2::sketch(x, &self.proj, out)
                }
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!()
            }
        }
    }

    /// `out[i] = Σ_j sign_j · vecs[i·256 + j]` for the signs in `bits`.
    fn sign_dots(&self, bits: &[u8; SIGN_BYTES], vecs: &[f32], out: &mut [f32]) {
        assert_eq!(vecs.len(), out.len() * SKETCH_DIM);
        match self.isa {
            Isa::Scalar => portable::sign_dots(bits, vecs, out),
            Isa::Avx2 => {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa` is Avx2 only when the CPU has it (detected in `new`).
                unsafe {
                    avx2::sign_dots(bits, vecs, out)
                }
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!()
            }
        }
    }
}

/// Π for `head_dim` rows and layer `opts.layer`: a N(0, 1) matrix (Box-Muller from ChaCha8
/// uniforms) whose columns are then orthogonalized in consecutive chunks of `head_dim`
/// ([`orthogonalize_chunks`]), as the QJL reference's `rot` option does with QR.
fn projection(head_dim: usize, opts: CodecOptions) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    rng.set_stream(opts.layer as u64);
    let mut p = Vec::with_capacity(head_dim * SKETCH_DIM);
    // head_dim × 256 is even: pairs fill it exactly.
    while p.len() < head_dim * SKETCH_DIM {
        let (u1, u2) = (rng.gen::<f32>() as f64, rng.gen::<f32>() as f64);
        let r = (-2.0 * (1.0 - u1).ln()).sqrt();
        let t = std::f64::consts::TAU * u2;
        p.push((r * t.cos()) as f32);
        p.push((r * t.sin()) as f32);
    }
    orthogonalize_chunks(&mut p, head_dim);
    p
}

/// Gram-Schmidt (modified, in f64) over the columns of row-major `p` (`rows × 256`), in
/// consecutive chunks of up to `rows` columns, each column then scaled to norm `sqrt(rows)`:
/// the QR factor with a positive diagonal, so each chunk is a Haar-random set of orthonormal
/// directions (times `sqrt(rows)`), each column as likely as a Gaussian one to point anywhere,
/// and the directions of a chunk no longer overlap. See the module docs for the variance.
fn orthogonalize_chunks(p: &mut [f32], rows: usize) {
    let mut start = 0;
    while start < SKETCH_DIM {
        let cols: Vec<usize> = (start..(start + rows).min(SKETCH_DIM)).collect();
        let mut basis: Vec<Vec<f64>> = Vec::with_capacity(cols.len());
        for &j in &cols {
            let mut v: Vec<f64> = (0..rows).map(|d| f64::from(p[d * SKETCH_DIM + j])).collect();
            for b in &basis {
                let dot: f64 = v.iter().zip(b).map(|(x, y)| x * y).sum();
                v.iter_mut().zip(b).for_each(|(x, y)| *x -= dot * y);
            }
            let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
            v.iter_mut().for_each(|x| *x /= norm);
            basis.push(v);
        }
        let len = (rows as f64).sqrt();
        for (&j, b) in cols.iter().zip(&basis) {
            for (d, x) in b.iter().enumerate() {
                p[d * SKETCH_DIM + j] = (x * len) as f32;
            }
        }
        start += rows;
    }
}

/// The estimator's scale per unit key norm: `1 / (256·E|<u, π_j>|)` for a unit `u`, so that
/// `‖k‖·scale·Σ_j sign(<k, π_j>)·<q, π_j>` has mean `<q, k>`. A column `π_j` is uniform on
/// the sphere of radius `sqrt(d)`, so `E|<u, π_j>| = sqrt(d)·Γ(d/2) / (sqrt(π)·Γ((d+1)/2))`
/// (→ `sqrt(2/π)`, the Gaussian value, as `d` grows; 0.4% above it at `d` = 64).
fn estimator_scale(d: usize) -> f32 {
    // Γ(n/2) / Γ((n+1)/2) from n = 1 (√π) and n = 2 (2/√π) by the step n → n + 2: × n/(n+1).
    let sqrt_pi = std::f64::consts::PI.sqrt();
    let mut ratio = if d % 2 == 1 { sqrt_pi } else { 2.0 / sqrt_pi };
    for n in (2 - d % 2..d).step_by(2) {
        ratio *= n as f64 / (n + 1) as f64;
    }
    let mean_abs = (d as f64).sqrt() * ratio / sqrt_pi;
    (1.0 / (SKETCH_DIM as f64 * mean_abs)) as f32
}

/// (sign bits, norm) of slot `slot`.
fn record(page: &[u8], slot: usize) -> (&[u8; SIGN_BYTES], f32) {
    let r = &page[slot * RECORD_BYTES..(slot + 1) * RECORD_BYTES];
    let bits = r[..SIGN_BYTES].try_into().expect("sign bytes");
    (bits, bf16::from_bits(u16::from_le_bytes([r[SIGN_BYTES], r[SIGN_BYTES + 1]])).to_f32())
}

impl KvCodec for QjlCodec {
    fn name(&self) -> String {
        "qjl1".into()
    }
    /// The projection spreads each key's error over all channels.
    fn key_calibration(&self) -> KeyCalibration {
        KeyCalibration::CenterAndBalance
    }
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn page_bytes(&self, tokens: usize) -> usize {
        tokens * RECORD_BYTES
    }
    fn encode(&self, _head: usize, page: KvPageMut<'_>, first: usize, rows: &[f32]) {
        let mut s = [0f32; SKETCH_DIM];
        for (t, x) in rows.chunks_exact(self.head_dim).enumerate() {
            let rec = &mut page.bytes[(first + t) * RECORD_BYTES..(first + t + 1) * RECORD_BYTES];
            self.sketch(x, &mut s);
            for (byte, s8) in rec[..SIGN_BYTES].iter_mut().zip(s.chunks_exact(8)) {
                *byte = s8.iter().enumerate().fold(0, |b, (i, &v)| b | (u8::from(v > 0.0) << i));
            }
            let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
            rec[SIGN_BYTES..].copy_from_slice(&bf16::from_f32(norm).to_bits().to_le_bytes());
        }
    }
    fn decode(&self, _head: usize, page: KvPage<'_>, slots: Range<usize>, out: &mut [f32]) {
        for (slot, o) in slots.zip(out.chunks_exact_mut(self.head_dim)) {
            let (bits, norm) = record(page.bytes, slot);
            self.sign_dots(bits, &self.proj, o);
            let scale = norm * self.scale;
            o.iter_mut().for_each(|v| *v *= scale);
        }
    }
    fn query_width(&self) -> usize {
        SKETCH_DIM
    }
    fn prepare_query(&self, _head: usize, q: &[f32], out: &mut [f32]) {
        self.sketch(q, out);
    }
    fn scores(&self, _head: usize, page: KvPage<'_>, slots: Range<usize>, queries: &[f32], out: &mut [f32]) {
        let n = slots.len();
        let mut dots = vec![0f32; queries.len() / SKETCH_DIM];
        for (j, slot) in slots.enumerate() {
            let (bits, norm) = record(page.bytes, slot);
            self.sign_dots(bits, queries, &mut dots);
            let scale = norm * self.scale;
            for (qi, d) in dots.iter().enumerate() {
                out[qi * n + j] = d * scale;
            }
        }
    }
}

/// Portable kernels (the compiler vectorizes the 8-lane loops).
mod portable {
    use super::{SIGN_BYTES, SKETCH_DIM};

    /// `out = xᵀ·proj`, summing over rows in order.
    pub fn sketch(x: &[f32], proj: &[f32], out: &mut [f32]) {
        out.fill(0.0);
        for (&xd, row) in x.iter().zip(proj.chunks_exact(SKETCH_DIM)) {
            out.iter_mut().zip(row).for_each(|(o, &p)| *o += xd * p);
        }
    }

    /// `out[i] = Σ_j sign_j · vecs[i·256 + j]`: a clear bit flips the float's sign bit.
    pub fn sign_dots(bits: &[u8; SIGN_BYTES], vecs: &[f32], out: &mut [f32]) {
        for (o, v) in out.iter_mut().zip(vecs.chunks_exact(SKETCH_DIM)) {
            let mut acc = [0f32; 8];
            for (&b, v8) in bits.iter().zip(v.chunks_exact(8)) {
                for (i, (a, &x)) in acc.iter_mut().zip(v8).enumerate() {
                    *a += f32::from_bits(x.to_bits() ^ ((u32::from(!b >> i) & 1) << 31));
                }
            }
            *o = acc.iter().sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use crate::cpu::simd::hsum;
    use super::{SIGN_BYTES, SKETCH_DIM};
    use std::arch::x86_64::*;

    /// `out = xᵀ·proj`, 64 outputs at a time, summing over rows in order with `mul` then `add`
    /// (no FMA): bit-identical to the portable sketch.
    #[target_feature(enable = "avx2")]
    pub fn sketch(x: &[f32], proj: &[f32], out: &mut [f32]) {
        assert!(proj.len() == x.len() * SKETCH_DIM && out.len() == SKETCH_DIM);
        for (c, o) in out.chunks_exact_mut(64).enumerate() {
            let mut acc = [_mm256_setzero_ps(); 8];
            for (&xd, row) in x.iter().zip(proj.chunks_exact(SKETCH_DIM)) {
                let (xv, p) = (_mm256_set1_ps(xd), &row[c * 64..(c + 1) * 64]);
                for (r, a) in acc.iter_mut().enumerate() {
                    // SAFETY: `p` holds 64 floats, lanes 8r..8r + 8 are in bounds.
                    let v = unsafe { _mm256_loadu_ps(p.as_ptr().add(8 * r)) };
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(xv, v));
                }
            }
            for (r, a) in acc.iter().enumerate() {
                // SAFETY: `o` holds 64 floats.
                unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(8 * r), *a) };
            }
        }
    }

    /// `out[i] = Σ_j sign_j · vecs[i·256 + j]`, four vectors per pass over the bits.
    #[target_feature(enable = "avx2")]
    pub fn sign_dots(bits: &[u8; SIGN_BYTES], vecs: &[f32], out: &mut [f32]) {
        let mut vc = vecs.chunks_exact(4 * SKETCH_DIM);
        let mut oc = out.chunks_exact_mut(4);
        for (v, o) in (&mut vc).zip(&mut oc) {
            block::<4>(bits, v, o);
        }
        let (v, o) = (vc.remainder(), oc.into_remainder());
        match o.len() {
            0 => {}
            1 => block::<1>(bits, v, o),
            2 => block::<2>(bits, v, o),
            3 => block::<3>(bits, v, o),
            _ => unreachable!(),
        }
    }

    /// [`sign_dots`] of `Q` vectors: each byte of signs becomes one sign-flip mask (bit `i`
    /// shifted to lane `i`'s sign bit, kept where the bit is clear) XORed into every vector;
    /// two accumulators per vector hide the add latency.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn block<const Q: usize>(bits: &[u8; SIGN_BYTES], vecs: &[f32], out: &mut [f32]) {
        let vecs = &vecs[..Q * SKETCH_DIM];
        let shifts = _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24);
        let sign = _mm256_set1_epi32(i32::MIN);
        let mut acc = [[_mm256_setzero_ps(); 2]; Q];
        for (c, &b) in bits.iter().enumerate() {
            let flip = _mm256_andnot_si256(_mm256_sllv_epi32(_mm256_set1_epi32(b as i32), shifts), sign);
            let flip = _mm256_castsi256_ps(flip);
            for (r, a) in acc.iter_mut().enumerate() {
                // SAFETY: r·256 + 8c + 8 <= Q·256 = vecs.len().
                let v = unsafe { _mm256_loadu_ps(vecs.as_ptr().add(r * SKETCH_DIM + 8 * c)) };
                a[c % 2] = _mm256_add_ps(a[c % 2], _mm256_xor_ps(v, flip));
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            // SAFETY: AVX is enabled by this function's target features.
            *o = unsafe { hsum(_mm256_add_ps(a[0], a[1])) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::tests_support::{check_attention_hooks, random_rows};

    /// The codec for `hd` and `opts` with each ISA this machine runs.
    fn codecs(hd: usize, opts: CodecOptions) -> Vec<QjlCodec> {
        [Isa::Scalar, Isa::Avx2]
            .into_iter()
            .filter(|isa| isa.available())
            .map(|isa| QjlCodec { isa, ..QjlCodec::new(KvGeometry { head_dim: hd, n_kv_heads: 2 }, opts) })
            .collect()
    }

    #[test]
    fn encode_matches_scalar_reference_bit_exactly() {
        let (hd, tokens) = (64, 24);
        let rows = random_rows(3, tokens, hd);
        for c in codecs(hd, CodecOptions { layer: 5, seed: 17, static_scale: None }) {
            assert_eq!(c.page_bytes(tokens), tokens * 34);
            let mut page = vec![0xAAu8; c.page_bytes(tokens)];
            c.encode(1, KvPageMut { bytes: &mut page, tokens }, 0, &rows);
            let mut decoded = vec![0f32; tokens * hd];
            c.decode(1, KvPage { bytes: &page, tokens }, 0..tokens, &mut decoded);
            for (t, k) in rows.chunks_exact(hd).enumerate() {
                // Reference: s_j = Σ_d k_d·Π[d][j] summed over d in order (the codec's
                // documented order, so the f32 signs agree exactly), bit j of byte j / 8.
                let mut want = [0u8; 34];
                let mut signs = [0f32; 256];
                for j in 0..256 {
                    let mut s = 0f32;
                    for (d, &kd) in k.iter().enumerate() {
                        s += kd * c.proj[d * 256 + j];
                    }
                    signs[j] = if s > 0.0 { 1.0 } else { -1.0 };
                    if s > 0.0 {
                        want[j / 8] |= 1 << (j % 8);
                    }
                }
                let mut sq = 0f32;
                for &v in k {
                    sq += v * v;
                }
                let norm = bf16::from_f32(sq.sqrt());
                want[32..].copy_from_slice(&norm.to_bits().to_le_bytes());
                assert_eq!(&page[t * 34..(t + 1) * 34], &want, "{:?}: token {t}", c.isa);
                // Decode is k̂_d = ‖k‖·scale·Σ_j Π[d][j]·sign_j (the scale is tested on its
                // own), to 1e-5 of the magnitude of the terms (the kernels reorder the 256-term
                // float sum).
                let scale = norm.to_f32() * c.scale;
                for d in 0..hd {
                    let row = &c.proj[d * 256..(d + 1) * 256];
                    let want: f32 = row.iter().zip(&signs).map(|(p, s)| p * s).sum::<f32>() * scale;
                    let mag: f32 = row.iter().map(|p| p.abs()).sum::<f32>() * scale;
                    let got = decoded[t * hd + d];
                    assert!((got - want).abs() <= 1e-5 * mag, "{:?}: k̂[{t}][{d}] {got} vs {want}", c.isa);
                }
            }
        }
    }

    #[test]
    fn sketch_scores_match_decoded_keys() {
        for hd in [64, 128] {
            for c in codecs(hd, CodecOptions { layer: 2, seed: 9, static_scale: None }) {
                check_attention_hooks(&c, 16, 3);
                // 5 queries: the AVX2 kernel's 4-wide pass plus a 1-query tail.
                check_attention_hooks(&c, 16, 5);
            }
        }
    }

    #[test]
    fn estimator_is_unbiased_over_projections() {
        let hd = 64;
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum::<f64>();
        // A query nearly orthogonal to the key, and the key itself (all of the variance then
        // comes from the spread of Σ|a_i| below, and the mean has a relative standard error of
        // about 3e-4, so a scale 0.4% off, such as the Gaussian sqrt(π/2)/256, fails).
        let k = random_rows(21, 1, hd);
        for (case, q) in [("random query", random_rows(22, 1, hd)), ("query = key", k.clone())] {
            let (qk, qq, kk) = (dot(&q, &k), dot(&q, &q), dot(&k, &k));
            let trials = 4000;
            let mut est = Vec::with_capacity(trials);
            let mut stored_norm = 0f64;
            for seed in 0..trials as u64 {
                let c = QjlCodec::new(KvGeometry { head_dim: hd, n_kv_heads: 1 }, CodecOptions { layer: 0, seed, static_scale: None });
                let mut page = [0u8; 34];
                c.encode(0, KvPageMut { bytes: &mut page, tokens: 1 }, 0, &k);
                let mut qs = [0f32; 256];
                c.prepare_query(0, &q, &mut qs);
                let mut s = [0f32];
                c.scores(0, KvPage { bytes: &page, tokens: 1 }, 0..1, &qs, &mut s);
                est.push(s[0] as f64);
                stored_norm = record(&page, 0).1 as f64;
            }
            // The estimator is unbiased for the stored (bf16-rounded) norm n: E = <q, k>·n/‖k‖
            // (rounding is ≤ 2^-9 relative, above the standard error here, so it is part of
            // the target rather than the tolerance).
            let r = stored_norm / kk.sqrt();
            let target = qk * r;
            let n = trials as f64;
            let mean = est.iter().sum::<f64>() / n;
            let var = est.iter().map(|e| (e - mean).powi(2)).sum::<f64>() / (n - 1.0);
            // Exact variance for full orthogonal chunks (d | 256), with m = E|a_1| for a
            // uniform on the unit sphere (so the scale is 1/(256·sqrt(d)·m)): with u = k/‖k‖,
            // a = Rᵀu and q = <q,u>u + q⊥, a chunk's sum is sqrt(d)·(<q,u>·Σ|a_i| +
            // <sign(a), Rᵀq⊥>); the two terms are uncorrelated, Var Σ|a_i| = 1 +
            // (2/π)(d − 1) − d²m² (E|a_i a_j| = 2/(πd) for i ≠ j), and Rᵀq⊥ is uniform on the
            // sphere orthogonal to a, which leaves sign(a) exactly d(1 − 2/π) of squared norm
            // off a. Over 256/d chunks: r²·((1 − 2/π)(‖q‖²‖k‖² − <q,k>²) + Var Σ|a_i|·<q,k>²)
            // / (256·d·m²), to leading order ((π/2 − 1)‖q‖²‖k‖² − ½<q,k>²)/256. Gaussian
            // columns give r²·(π/2·‖q‖²‖k‖² − <q,k>²)/256.
            let d = hd as f64;
            let m = 1.0 / (256.0 * d.sqrt() * f64::from(estimator_scale(hd)));
            let spread = 1.0 + std::f64::consts::FRAC_2_PI * (d - 1.0) - d * d * m * m;
            let theory = r * r * ((1.0 - std::f64::consts::FRAC_2_PI) * (qq * kk - qk * qk) + spread * qk * qk) / (256.0 * d * m * m);
            let gaussian = r * r * (std::f64::consts::FRAC_PI_2 * qq * kk - qk * qk) / 256.0;
            // 4 standard errors of the mean: a correct estimator fails this with p ≈ 6e-5.
            let se = (var / n).sqrt();
            assert!((mean - target).abs() < 4.0 * se, "{case}: mean {mean} vs <q,k> {target} (se {se})");
            // The sample variance of 4000 trials of a near-Gaussian sum has relative standard
            // error sqrt(2/3999) ≈ 2.2%: ±10% is 4.5 of them, and far from Gaussian columns'
            // 2.9x (random query) or 9x (query = key).
            eprintln!("{case}: variance {var:.4e}: {:.3} of the theory, {:.3} of the Gaussian", var / theory, var / gaussian);
            assert!((0.9..1.1).contains(&(var / theory)), "{case}: variance {var} vs theory {theory}");
        }
    }

    #[test]
    fn projection_is_reproducible_per_layer() {
        let geom = KvGeometry { head_dim: 64, n_kv_heads: 4 };
        let at = |layer, seed| QjlCodec::new(geom, CodecOptions { layer, seed, static_scale: None }).proj;
        let p = at(3, 7);
        assert_eq!(p, at(3, 7), "same seed and layer, same Π");
        for other in [at(4, 7), at(3, 8)] {
            // Independent draws: equal entries have probability 0 (up to f32 collisions), and
            // the correlation of 16384 pairs of near-N(0, 1) entries has standard error 1/128.
            let same = p.iter().zip(&other).filter(|(a, b)| a == b).count();
            assert!(same < 4, "{same} equal entries");
            let corr = p.iter().zip(&other).map(|(a, b)| a * b).sum::<f32>() / p.len() as f32;
            assert!(corr.abs() < 5.0 / 128.0, "correlation {corr}");
        }
        // Entries of Haar-random orthogonal chunks times sqrt(d) are close to N(0, 1): mean
        // within 5 standard errors (1/128). (Their mean square is exactly 1: every column has
        // squared norm d, which the orthogonality test checks.)
        let mean = p.iter().sum::<f32>() / p.len() as f32;
        assert!(mean.abs() < 5.0 / 128.0, "mean {mean}");
    }

    #[test]
    fn projection_chunks_are_orthogonal_with_norm_sqrt_d() {
        // 64: four full chunks; 96: two full chunks and one of 64 columns; 512: one chunk of
        // 256 columns in a larger space.
        for hd in [64, 96, 512] {
            let p = QjlCodec::new(KvGeometry { head_dim: hd, n_kv_heads: 1 }, CodecOptions { layer: 1, seed: 3, static_scale: None }).proj;
            let col = |j: usize| (0..hd).map(|d| f64::from(p[d * SKETCH_DIM + j])).collect::<Vec<_>>();
            let cols: Vec<Vec<f64>> = (0..SKETCH_DIM).map(col).collect();
            for i in 0..SKETCH_DIM {
                for j in i..SKETCH_DIM {
                    let dot: f64 = cols[i].iter().zip(&cols[j]).map(|(a, b)| a * b).sum::<f64>() / hd as f64;
                    if i == j {
                        assert!((dot - 1.0).abs() < 1e-5, "hd {hd}: |π_{i}|² = {dot}·d");
                    } else if i / hd == j / hd {
                        assert!(dot.abs() < 1e-5, "hd {hd}: π_{i}·π_{j} = {dot}·d in one chunk");
                    }
                }
            }
        }
    }

    #[test]
    fn estimator_scale_inverts_the_mean_projection() {
        // E|<u, π>| for a unit u and π uniform on the sphere of radius sqrt(d): exact for
        // d = 1 (|π| = 1), 2 (√2·2/π), 3 (√3·½, Archimedes), 4 (8/(3π)) and 5 (3√5/8), and
        // the asymptotic series sqrt(2/π)·(1 + 1/(4d) + 1/(32d²)) at 64, 65 and 128, whose
        // next term is below 1e-6 there.
        let mean_abs = |d: usize| 1.0 / (SKETCH_DIM as f64 * f64::from(estimator_scale(d)));
        let pi = std::f64::consts::PI;
        for (d, want) in [(1, 1.0), (2, 2f64.sqrt() * 2.0 / pi), (3, 3f64.sqrt() / 2.0), (4, 8.0 / (3.0 * pi)), (5, 3.0 * 5f64.sqrt() / 8.0)] {
            assert!((mean_abs(d) / want - 1.0).abs() < 1e-6, "d {d}: {} vs {want}", mean_abs(d));
        }
        for d in [64usize, 65, 128] {
            let x = d as f64;
            let want = (2.0 / pi).sqrt() * (1.0 + 1.0 / (4.0 * x) + 1.0 / (32.0 * x * x));
            assert!((mean_abs(d) / want - 1.0).abs() < 1e-6, "d {d}: {} vs {want}", mean_abs(d));
        }
    }

    #[test]
    fn zero_key_encodes_to_zero_norm_and_scores_zero() {
        let hd = 64;
        let mut rows = random_rows(5, 2, hd);
        rows[hd..].fill(0.0);
        for c in codecs(hd, CodecOptions::default()) {
            let mut page = vec![0xFFu8; c.page_bytes(2)];
            c.encode(0, KvPageMut { bytes: &mut page, tokens: 2 }, 0, &rows);
            assert!(page[34..].iter().all(|&b| b == 0), "zero key: all signs −1, norm +0");
            let mut decoded = vec![1f32; hd];
            c.decode(0, KvPage { bytes: &page, tokens: 2 }, 1..2, &mut decoded);
            assert!(decoded.iter().all(|&v| v == 0.0));
            let mut qs = vec![0f32; 2 * 256];
            for (q, p) in random_rows(6, 2, hd).chunks_exact(hd).zip(qs.chunks_exact_mut(256)) {
                c.prepare_query(0, q, p);
            }
            let mut s = [f32::NAN; 4];
            c.scores(0, KvPage { bytes: &page, tokens: 2 }, 0..2, &qs, &mut s);
            assert!(s[0] != 0.0 && s[0].is_finite() && s[2].is_finite(), "{s:?}");
            assert_eq!((s[1], s[3]), (0.0, 0.0));
        }
    }
}
