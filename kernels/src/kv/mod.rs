//! KV-cache storage formats ("codecs") and the interface attention reads them through.
//!
//! A paged cache stores, for every (block, layer, K|V, KV head), one *page*: the encoded
//! vectors of the block's tokens for that head, in a layout the codec owns. Attention never
//! asks for a dense K/V of the whole context: it asks a codec for the scores of a run of
//! keys against prepared queries ([`KvCodec::scores`]) and for the weighted sum of a run of
//! values ([`KvCodec::accumulate`]), page by page. Prefill may decode one page at a time
//! into a dense scratch ([`KvCodec::decode`]).
//!
//! Formats: [`plain`] (f32, bf16, f16), [`scaled8`] (fp8 e4m3 and int8 with a scale per
//! token and head, or a static per-tensor scale), [`qjl`] (1-bit JL sketches of keys),
//! [`tq3`] (TQ3_0: WHT32 + 2-bit codebook + residual signs) and [`hqmq`] (Hurwitz
//! quaternion multiplicative quantization, optionally with Med3x outliers), one folder each.
//! Each folder declares its family ([`KvFamily`]: names, checks, codec, CUDA side); the
//! registry is one row per family in [`FAMILIES`], read through [`KvRegistry`]: [`KvFormat`]
//! is a family and its parameters, nothing here matches on formats.

pub mod bits;
pub mod family;
pub mod format;
mod heads;
pub mod hqmq;
pub mod plain;
pub mod qjl;
pub mod registry;
pub mod scaled8;
pub mod tq3;

pub use family::{ExactKeyParams, KvCuda, KvFamily, KvPageKind, KvParams, MAX_SINK};
pub use format::{KvFormat, KvFormatError};
pub use heads::HeadOffset;
pub use registry::{KvCudaPage, KvCudaRow, KvRegistry};

/// The registry: one row per format family, each declared in its folder. Parsing tries them in
/// this order and their CUDA pages are numbered in it (`TS_KV_*` codes).
pub static FAMILIES: &[&dyn KvFamily] = &[&plain::Plain, &scaled8::Scaled8, &qjl::Qjl1, &tq3::Tq3_0, &hqmq::Hqmq];

use crate::cpu::dot::{dots_f32, weighted_sum_f32};
use crate::cpu::{CpuCaps, Isa};
use std::sync::OnceLock;
use std::ops::Range;

/// Whether a codec stores keys or values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvRole {
    /// Keys (scored against queries).
    Key,
    /// Values (summed with attention weights).
    Value,
}

/// What a codec needs to know about the tensor it stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Floats per head vector.
    pub head_dim: usize,
    /// KV heads per layer.
    pub n_kv_heads: usize,
}

/// Per-layer construction options.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CodecOptions {
    /// Layer index (seeds per-layer random state: QJL projections, HQMQ codebooks).
    pub layer: usize,
    /// Base seed for random state (the same seed reproduces the same cache).
    pub seed: u64,
    /// A static per-tensor scale from the checkpoint (`k_scale` / `v_scale`), used by the
    /// 8-bit formats instead of a scale per token.
    pub static_scale: Option<f32>,
}

/// One head's page: `tokens` slots in the codec's layout.
#[derive(Clone, Copy, Debug)]
pub struct KvPage<'a> {
    /// The page's bytes ([`KvCodec::page_bytes`] of `tokens`).
    pub bytes: &'a [u8],
    /// Slots in the page.
    pub tokens: usize,
}

/// A mutable page being written.
#[derive(Debug)]
pub struct KvPageMut<'a> {
    /// The page's bytes.
    pub bytes: &'a mut [u8],
    /// Slots in the page.
    pub tokens: usize,
}

/// What calibrating the keys before storing them (`k' = (k - center) / scale` per channel,
/// fitted on a built-in text at load) does for a key format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyCalibration {
    /// Nothing: the format's error does not grow with the key's offset (floats, 8-bit).
    None,
    /// Centering: the error grows with the key's norm, and post-RoPE keys carry a
    /// per-channel mean worth much of their energy.
    Center,
    /// Centering, and balancing the channels against the queries: the format spreads a
    /// key's coding error over all of a head's channels.
    CenterAndBalance,
}

/// A KV-cache storage format for one layer and role (K or V), all of its heads.
///
/// Codecs are stateless across calls except for random state fixed at construction
/// (projections, codebooks), so any number of threads may use one at once.
pub trait KvCodec: Send + Sync {
    /// The format's canonical name (`bf16`, `hqmq-s96-r4`, ...).
    fn name(&self) -> String;
    /// Floats per head vector.
    fn head_dim(&self) -> usize;
    /// What key calibration does for this format as keys (values are never calibrated).
    fn key_calibration(&self) -> KeyCalibration {
        KeyCalibration::None
    }
    /// Bytes of one head's page of `tokens` slots.
    fn page_bytes(&self, tokens: usize) -> usize;
    /// Encodes `rows` (`n × head_dim`, row-major) of head `head` into slots `first..first + n`.
    /// Slots before `first` hold earlier tokens of the same sequence (formats with per-page
    /// side data read them); slots after are unspecified.
    fn encode(&self, head: usize, page: KvPageMut<'_>, first: usize, rows: &[f32]);
    /// Decodes slots `slots` of head `head` into `out` (`slots.len() × head_dim`).
    fn decode(&self, head: usize, page: KvPage<'_>, slots: Range<usize>, out: &mut [f32]);

    /// Floats per prepared query ([`Self::prepare_query`]); `head_dim` unless the codec scores
    /// in another space.
    fn query_width(&self) -> usize {
        self.head_dim()
    }
    /// Maps a query of head `head`'s group (`head_dim`) into the space [`Self::scores`] works in
    /// (once per query per step, not per key).
    fn prepare_query(&self, head: usize, q: &[f32], out: &mut [f32]) {
        let _ = head;
        out.copy_from_slice(q);
    }
    /// `out[i * n + j] = <query i, key at slot slots.start + j>` for prepared `queries`
    /// (`nq × query_width`), `n = slots.len()`. Unscaled (attention applies 1/sqrt(d)).
    fn scores(&self, head: usize, page: KvPage<'_>, slots: Range<usize>, queries: &[f32], out: &mut [f32]) {
        let (hd, n, isa) = (self.head_dim(), slots.len(), isa());
        let mut scratch = Vec::new();
        let keys = dense(self, head, page, slots, &mut scratch);
        dots_f32(isa, queries, keys, hd, &mut out[..queries.len() / hd * n]);
    }
    /// `acc[i] += sum_j weights[i * n + j] * value(slot slots.start + j)` for `nq` rows
    /// (`acc` is `nq × head_dim`), in the codec's value space: attention passes each finished
    /// row through [`Self::finish_values`] once.
    fn accumulate(&self, head: usize, page: KvPage<'_>, slots: Range<usize>, weights: &[f32], acc: &mut [f32]) {
        let (hd, n, isa) = (self.head_dim(), slots.len(), isa());
        let mut scratch = Vec::new();
        let values = dense(self, head, page, slots, &mut scratch);
        weighted_sum_f32(isa, &weights[..acc.len() / hd * n], values, hd, acc);
    }
    /// Maps rows of value sums built by [`Self::accumulate`] (`rows.len() / head_dim` rows)
    /// from the codec's value space to values. A linear map, so it can wait until the key
    /// ranges' sums are merged: once per output row rather than once per page. Identity
    /// unless the codec sums values in another space (TQ3_0 sums them rotated).
    fn finish_values(&self, head: usize, rows: &mut [f32]) {
        let _ = (head, rows);
    }
    /// The page as `tokens × head_dim` f32 when that is its layout (no decoding needed).
    fn as_f32<'a>(&self, page: KvPage<'a>) -> Option<&'a [f32]> {
        let _ = page;
        None
    }
}

/// The SIMD level the hooks use, detected once (the hooks run per block in the decode loop).
pub(crate) fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| CpuCaps::detect().best_isa())
}

/// Slots `slots` of a page as f32 rows (`slots.len() × head_dim`): in place for f32 pages,
/// otherwise decoded into `scratch`.
pub fn dense<'a, C: KvCodec + ?Sized>(codec: &C, head: usize, page: KvPage<'a>, slots: Range<usize>, scratch: &'a mut Vec<f32>) -> &'a [f32] {
    let hd = codec.head_dim();
    if let Some(f) = codec.as_f32(page) {
        return &f[slots.start * hd..slots.end * hd];
    }
    scratch.resize(slots.len() * hd, 0.0);
    codec.decode(head, page, slots, scratch);
    scratch
}

/// Builds the codec of `format` for one layer and role, after checking that it can store
/// `role` for heads of `geom`.
pub fn codec(format: &KvFormat, geom: KvGeometry, role: KvRole, opts: CodecOptions) -> Result<Box<dyn KvCodec>, KvFormatError> {
    format.check(geom, role)?;
    Ok(format.family().codec(format.params(), geom, role, opts))
}

/// The CUDA page description of a built-in `format` (with the checkpoint's static scale if
/// `static_scale`, for the formats that use one), or `None` where the CUDA kernels have no
/// such pages yet ([`KvRegistry::cuda_page`] on the built-in registry).
pub fn cuda_page(format: &KvFormat, static_scale: bool) -> Option<KvCudaPage> {
    KvRegistry::builtin().cuda_page(format, static_scale)
}

/// Shared checks every codec's tests run.
#[cfg(test)]
pub(crate) mod tests_support {
    use super::{KvCodec, KvPage, KvPageMut};
    use rand::{Rng, SeedableRng};

    /// `n × hd` values like real keys/values: Gaussian-ish with a few larger channels.
    pub fn random_rows(seed: u64, n: usize, hd: usize) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n * hd)
            .map(|i| {
                let g: f32 = (0..4).map(|_| rng.gen::<f32>() - 0.5).sum::<f32>() * 1.7;
                if i % hd == 5 { g * 6.0 } else { g }
            })
            .collect()
    }

    /// Checks a codec's attention hooks against its own decode on random data: encoding one
    /// token at a time writes the same page as all at once; `scores` equals the dot with the
    /// decoded keys and `accumulate` the weighted sum of decoded values (to 1e-5 relative to
    /// the magnitudes involved: the hooks reorder float sums).
    pub fn check_attention_hooks(codec: &dyn KvCodec, tokens: usize, nq: usize) {
        let hd = codec.head_dim();
        let rows = random_rows(11, tokens, hd);
        for head in 0..2 {
            let mut once = vec![0u8; codec.page_bytes(tokens)];
            codec.encode(head, KvPageMut { bytes: &mut once, tokens }, 0, &rows);
            let mut stepwise = vec![0u8; codec.page_bytes(tokens)];
            for t in 0..tokens {
                codec.encode(head, KvPageMut { bytes: &mut stepwise, tokens }, t, &rows[t * hd..(t + 1) * hd]);
            }
            assert!(once == stepwise, "{}: token-at-a-time encoding differs", codec.name());
            let page = KvPage { bytes: &once, tokens };
            let (lo, hi) = (1, tokens);
            let n = hi - lo;
            let mut decoded = vec![0f32; n * hd];
            codec.decode(head, page, lo..hi, &mut decoded);
            let queries = random_rows(12, nq, hd);
            let qw = codec.query_width();
            let mut prepared = vec![0f32; nq * qw];
            for (q, p) in queries.chunks_exact(hd).zip(prepared.chunks_exact_mut(qw)) {
                codec.prepare_query(head, q, p);
            }
            let mut scores = vec![0f32; nq * n];
            codec.scores(head, page, lo..hi, &prepared, &mut scores);
            for (qi, q) in queries.chunks_exact(hd).enumerate() {
                for (j, k) in decoded.chunks_exact(hd).enumerate() {
                    let want: f32 = q.iter().zip(k).map(|(a, b)| a * b).sum();
                    let mag: f32 = q.iter().zip(k).map(|(a, b)| (a * b).abs()).sum();
                    let got = scores[qi * n + j];
                    assert!((got - want).abs() <= 1e-5 * mag + 1e-6, "{}: score {got} vs {want}", codec.name());
                }
            }
            let weights = random_rows(13, nq, n);
            // Two runs of slots summed into the same rows, then finished once, as attention
            // sums a key range's pages.
            let mut acc = vec![0f32; nq * hd];
            let cut = lo + n / 2;
            let (w1, w2): (Vec<f32>, Vec<f32>) = (
                weights.chunks_exact(n).flat_map(|w| w[..cut - lo].to_vec()).collect(),
                weights.chunks_exact(n).flat_map(|w| w[cut - lo..].to_vec()).collect(),
            );
            codec.accumulate(head, page, lo..cut, &w1, &mut acc);
            codec.accumulate(head, page, cut..hi, &w2, &mut acc);
            for row in acc.chunks_exact_mut(hd) {
                codec.finish_values(head, row);
            }
            for qi in 0..nq {
                for d in 0..hd {
                    let want: f32 = (0..n).map(|j| weights[qi * n + j] * decoded[j * hd + d]).sum::<f32>();
                    let mag: f32 = 1e-3 + (0..n).map(|j| (weights[qi * n + j] * decoded[j * hd + d]).abs()).sum::<f32>();
                    let got = acc[qi * hd + d];
                    assert!((got - want).abs() <= 1e-5 * mag, "{}: accumulate {got} vs {want}", codec.name());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each format's CUDA pages are the bytes its CPU codec lays out, under a code of its own
    /// (the `TS_KV_*` values, numbered by the registry), and the codes name every page kind once.
    #[test]
    fn cuda_pages_match_the_codecs() {
        let mut codes = Vec::new();
        for format in KvFormat::all() {
            for static_scale in [false, true] {
                let Some(page) = cuda_page(&format, static_scale) else { continue };
                for head_dim in [64, 128] {
                    let geom = KvGeometry { head_dim, n_kv_heads: 2 };
                    let opts = CodecOptions { static_scale: static_scale.then_some(0.5), ..Default::default() };
                    let c = codec(&format, geom, KvRole::Key, opts).unwrap();
                    assert_eq!(16 * page.kind.record_bytes(head_dim), c.page_bytes(16), "{format} static {static_scale}");
                }
                codes.push((page.code, page.kind.name));
            }
        }
        codes.sort();
        codes.dedup();
        let want = ["F32", "BF16", "F16", "FP8", "FP8_STATIC", "INT8", "INT8_STATIC"];
        assert_eq!(codes, want.iter().enumerate().map(|(i, n)| (i as u8, *n)).collect::<Vec<_>>());
        assert_eq!(KvRegistry::builtin().cuda_pages().iter().map(|p| p.kind.name).collect::<Vec<_>>(), want);
        assert!(cuda_page(&KvFormat::TQ3_0, false).is_none());
    }

    /// Every family in the table has a name of its own and at least one format it can build.
    #[test]
    fn every_family_builds_its_formats() {
        let geom = KvGeometry { head_dim: 128, n_kv_heads: 2 };
        for family in FAMILIES {
            let formats: Vec<KvFormat> = KvFormat::all().into_iter().filter(|f| f.family().family() == family.family()).collect();
            assert!(!formats.is_empty(), "{}", family.family());
            for f in formats {
                assert_eq!(f.to_string().parse::<KvFormat>().unwrap(), f);
                assert!(codec(&f, geom, KvRole::Key, CodecOptions::default()).is_ok(), "{f}");
            }
        }
    }
}
