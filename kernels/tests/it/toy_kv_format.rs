//! The KV-format recipe (docs/architecture.md), proved from outside the crate: a toy 4-bit
//! format (per token and head: an f32 absmax scale, then `head_dim` 4-bit codes) implements
//! only `KvCodec`'s required methods (name, head dim, page size, encode, decode) and runs in
//! the paged attention kernel through the default score and accumulate hooks, beside a
//! built-in format. Its registry row is a `KvFamily` declared here too (names, check, codec,
//! CUDA pages and device code): a registry with it parses, prints, checks and builds it by
//! name, and the attention and KV append sources that registry assembles compile with it
//! (NVRTC, not run: that needs a GPU). Nothing in `tessera_kernels` changes.

use crate::attention::Paged;
use crate::common::{assert_close, randn, rng};
use std::fmt;
use std::ops::Range;
use tessera_kernels::attention::{attention, AttnShape};
use tessera_kernels::cuda::kv_source::kv_sources;
use tessera_kernels::kv::{
    codec, CodecOptions, KvCodec, KvCuda, KvFamily, KvFormat, KvFormatError, KvGeometry, KvPage, KvPageKind, KvPageMut, KvParams, KvRegistry, KvRole,
};
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

/// The toy's registry row: one format, `toy4`, any even head dimension, pages on CUDA.
struct Toy4Family;

impl KvFamily for Toy4Family {
    fn family(&self) -> &'static str {
        "toy4"
    }
    fn syntax(&self) -> &'static str {
        "toy4"
    }
    fn parse(&self, name: &str) -> Option<KvParams> {
        (name == "toy4").then_some(KvParams(0))
    }
    fn write_name(&self, _params: KvParams, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("toy4")
    }
    fn formats(&self) -> Vec<KvParams> {
        vec![KvParams(0)]
    }
    /// Two codes per byte.
    fn head_dim_multiple(&self, _params: KvParams) -> usize {
        2
    }
    fn codec(&self, _params: KvParams, geom: KvGeometry, _role: KvRole, _opts: CodecOptions) -> Box<dyn KvCodec> {
        Box::new(Toy4 { head_dim: geom.head_dim })
    }
    fn cuda(&self) -> Option<&'static KvCuda> {
        Some(&TOY4_CUDA)
    }
    fn cuda_page(&self, _params: KvParams, _static_scale: bool) -> Option<usize> {
        Some(0)
    }
}

/// The toy's pages on the GPU: the record above, its load (attention) and store (KV append).
static TOY4_CUDA: KvCuda = KvCuda {
    header: r#"
#line 2 "toy_kv4.cuh"
template <int FMT, int ELEMS>
__device__ __forceinline__ void ts_kv_toy4_load(const uint8_t* rec, int d0, float static_scale, float* out) {
    const float s = *reinterpret_cast<const float*>(rec);
    const uint8_t* c = rec + 4 + d0 / 2;
#pragma unroll
    for (int i = 0; i < ELEMS / 2; i++) {
        out[2 * i] = (float)((int)(c[i] & 15u) - 8) * s;
        out[2 * i + 1] = (float)((int)(c[i] >> 4) - 8) * s;
    }
}

__device__ __forceinline__ bool ts_kv_toy4_encode(const float* __restrict__ x, uint8_t* rec, int fmt, int head_dim,
                                                  float static_scale, int lane) {
    if (fmt != TS_KV_TOY4) return false;
    float amax = 0.0f;
    for (int d = lane; d < head_dim; d += TS_WARP) amax = fmaxf(amax, fabsf(x[d]));
    amax = ts_warp_max(amax);
    const float s = amax > 0.0f ? amax / 7.0f : 1.0f;
    if (lane == 0) *reinterpret_cast<float*>(rec) = s;
    for (int j = lane; j < head_dim / 2; j += TS_WARP) {
        const int lo = (int)fminf(fmaxf(roundf(x[2 * j] / s), -8.0f), 7.0f) + 8;
        const int hi = (int)fminf(fmaxf(roundf(x[2 * j + 1] / s), -8.0f), 7.0f) + 8;
        rec[4 + j] = (uint8_t)(lo | (hi << 4));
    }
    return true;
}
"#,
    load: "ts_kv_toy4_load",
    store: "ts_kv_toy4_encode",
    pages: &[KvPageKind { name: "TOY4", value_bits: 4, header_bytes: 4, static_scale: false, align: 4 }],
};

/// The built-in registry and the toy's row after it.
fn registry() -> KvRegistry {
    KvRegistry::builtin().with(&Toy4Family)
}

/// The toy by name, through the registry that has its row.
fn toy() -> KvFormat {
    registry().parse("TOY4").unwrap()
}

const SHAPE: AttnShape = AttnShape { n_heads: 4, n_kv_heads: 2, head_dim: 64 };

/// Each stored value is within half a step (`absmax / 14`) of the original, plus f32
/// rounding of the division and product (1e-6 relative).
#[test]
fn toy_format_stores_each_value_within_half_a_step() {
    let mut r = rng(41);
    let keys = randn(&mut r, 37 * SHAPE.kv_width());
    let geom = KvGeometry { head_dim: 64, n_kv_heads: 2 };
    let toy = || codec(&toy(), geom, KvRole::Key, CodecOptions::default()).unwrap();
    let paged = Paged::with_codecs(SHAPE, toy(), toy(), &keys, &keys, &[16, 16, 5]);
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
    let toy = || codec(&toy(), geom, KvRole::Key, CodecOptions::default()).unwrap();
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

/// The toy's row alone registers it: its registry parses, prints, lists, checks and builds it
/// by name and refuses what it refuses with the users' messages; the built-in registry does
/// not know it.
#[test]
fn a_registry_row_defined_outside_the_crate_names_checks_and_builds_the_format() {
    let reg = registry();
    let toy = toy();
    assert_eq!(toy, KvFormat::from_family(&Toy4Family));
    assert_eq!(toy.to_string(), "toy4");
    assert_eq!(reg.parse(" toy4 ").unwrap(), toy);
    assert!(reg.all().contains(&toy) && !KvFormat::all().contains(&toy));
    assert_eq!(reg.parse("int8").unwrap(), KvFormat::INT8);
    assert!(matches!("toy4".parse::<KvFormat>(), Err(KvFormatError::Unknown { .. })));
    let e = reg.parse("toy5").unwrap_err().to_string();
    assert!(e.ends_with("hqmq-s{24,48,96,192}-r{3,4,6}[-med3][-sink{1..16}] or toy4"), "{e}");
    assert!(!toy.keys_only() && toy.exact_keys().is_none());
    let geom = KvGeometry { head_dim: 64, n_kv_heads: 2 };
    assert!(toy.check(geom, KvRole::Value).is_ok());
    let odd = KvGeometry { head_dim: 63, n_kv_heads: 2 };
    let e = codec(&toy, odd, KvRole::Key, CodecOptions::default()).err().unwrap();
    assert_eq!(e.to_string(), "toy4 needs a head dimension that is a multiple of 2; this model's is 63");
    let c = codec(&toy, geom, KvRole::Value, CodecOptions::default()).unwrap();
    assert_eq!((c.name(), c.page_bytes(16)), ("toy4".to_string(), 16 * 36));
    // Its CUDA pages take the code after the built-in ones, with the codec's record size.
    let page = reg.cuda_page(&toy, false).unwrap();
    assert_eq!((page.code, page.kind.record_bytes(64)), (7, 36));
    assert!(tessera_kernels::kv::cuda_page(&toy, false).is_none(), "the built-in registry has no toy pages");
}

/// The attention and KV append sources assembled from the registry with the toy's row compile
/// with its device code for every gate target: attention with toy keys and values, and toy
/// keys beside bf16 values, at both head dims; KV append with the toy among its stores.
#[test]
fn the_toys_cuda_pages_compile_into_the_kv_kernels() {
    let reg = registry();
    let src = kv_sources(&reg);
    assert!(src.kv_append.code.contains("#define TS_KV_TOY4 7\n") && src.kv_append.code.contains("ts_kv_toy4_encode(x, rec, fmt"));
    assert!(src.attention.code.contains("((int64_t)head_dim * ts_kv_elem_bits(fmt) + 7) / 8"));
    let toy_variants: Vec<_> = src.attention.variants.iter().filter(|v| v.contains(&"K_FMT=7")).collect();
    assert_eq!(toy_variants.len(), 2);
    if !crate::cuda_compile::nvrtc_ready() {
        return;
    }
    use tessera_kernels::cuda::{compile::compile_cubin, CudaArch};
    for arch in CudaArch::GATE {
        for hd in ["HEAD_DIM=64", "HEAD_DIM=128"] {
            for v in ["V_FMT=7", "V_FMT=1"] {
                let cubin = compile_cubin(&src.attention, &[hd, "K_FMT=7", v], arch).unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(&cubin[..4], b"\x7fELF");
            }
        }
        let cubin = compile_cubin(&src.kv_append, &[], arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&cubin[..4], b"\x7fELF");
    }
}
