//! What a KV format family declares in its folder: the [`KvFamily`] trait (names, the formats a
//! user can name, checks, codec, exact keys, CUDA side), the parameter value its formats carry
//! ([`KvParams`]) and its CUDA description ([`KvCuda`]). The registry
//! ([`KvRegistry`](super::KvRegistry)) holds one row per family.

use super::{CodecOptions, KvCodec, KvGeometry, KvRole};
use std::fmt;

/// A format's parameters inside its family, packed by the family into 64 bits (opaque to
/// everything else; e.g. which float a plain format stores, QJL's window and sink).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KvParams(pub u64);

/// The longest sink of exact keys a format's name may ask for (it must also fit the cache's
/// first block, which the layout checks).
pub const MAX_SINK: u16 = 16;

/// Keys a format keeps exactly beside its pages (the engine holds them per sequence and
/// attention scores them exactly): the first `sink` positions of the sequence and the
/// `window` positions before each query.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExactKeyParams {
    /// Positions before (and including) a query whose keys it scores exactly.
    pub window: u16,
    /// Leading positions of the sequence whose keys every query scores exactly.
    pub sink: u16,
}

/// A family of KV-cache formats, declared in its folder (`kv/<family>/`) and registered by one
/// row of [`KvRegistry`](super::KvRegistry): how its formats are named, which of them a user can
/// name, what they can store, their codec, and optionally their CUDA pages.
pub trait KvFamily: Send + Sync {
    /// The family's name, unique in a registry (`plain`, `qjl1`, ...).
    fn family(&self) -> &'static str;
    /// Its names as the unknown-name error lists them (`tq3_0`, `qjl1[-w{0..8192}-s{0..16}]`).
    fn syntax(&self) -> &'static str;
    /// The parameters of the format `name` names (trimmed, lower case, `_` written `-`), or
    /// `None` if it names none of this family's formats.
    fn parse(&self, name: &str) -> Option<KvParams>;
    /// Writes the canonical name of its format with `params`.
    fn write_name(&self, params: KvParams, f: &mut fmt::Formatter<'_>) -> fmt::Result;
    /// Every format of the family a user can name, for tests, tables and benchmarks.
    fn formats(&self) -> Vec<KvParams>;
    /// Whether the format stores keys only (values are refused).
    fn keys_only(&self, params: KvParams) -> bool {
        let _ = params;
        false
    }
    /// The number the head dimension must be a multiple of.
    fn head_dim_multiple(&self, params: KvParams) -> usize {
        let _ = params;
        1
    }
    /// The codec for one layer and role (after the checks passed).
    fn codec(&self, params: KvParams, geom: KvGeometry, role: KvRole, opts: CodecOptions) -> Box<dyn KvCodec>;
    /// The keys the format keeps exactly as keys, if any.
    fn exact_keys(&self, params: KvParams) -> Option<ExactKeyParams> {
        let _ = params;
        None
    }
    /// Its CUDA side, if its pages are on CUDA.
    fn cuda(&self) -> Option<&'static KvCuda> {
        None
    }
    /// Which of [`KvCuda::pages`] stores the format (with the checkpoint's static scale if
    /// `static_scale`); `None` where the CUDA kernels do not read it.
    fn cuda_page(&self, params: KvParams, static_scale: bool) -> Option<usize> {
        let _ = (params, static_scale);
        None
    }
}

/// A family's pages on the GPU: its device code and the kinds of page it reads and writes. The
/// kernels' dispatch, record size and format codes are generated from the registered families
/// (`cuda::kv_source`).
#[derive(Debug)]
pub struct KvCuda {
    /// Its header (`kv/<family>/kv_<family>.cuh`), compiled after the generated `TS_KV_*` codes
    /// and ahead of `kernels/cuda/kv_pages.cuh`: conversions, the record load and the store.
    pub header: &'static str,
    /// The record load: `template <int FMT, int ELEMS> void load(const uint8_t* rec, int d0,
    /// float static_scale, float* out)`, `ELEMS` values from dim `d0` as floats, scale applied.
    pub load: &'static str,
    /// The record store: `bool store(const float* x, uint8_t* rec, int fmt, int head_dim, float
    /// static_scale, int lane)`: writes one record if `fmt` is one of its codes, the warp's lanes
    /// striding over the dims, and says whether it was.
    pub store: &'static str,
    /// Its kinds of page; the registry numbers them (`TS_KV_<name>` is the code of each).
    pub pages: &'static [KvPageKind],
}

/// One kind of page on the GPU: its code's name and its record layout, as the CPU codec lays
/// pages out.
#[derive(Debug, PartialEq, Eq)]
pub struct KvPageKind {
    /// The code's name in device code, `TS_KV_<name>`.
    pub name: &'static str,
    /// Bits per value (a record's values take whole bytes together: `ceil(bits × head_dim / 8)`).
    pub value_bits: usize,
    /// Bytes before each token's values (a stored scale).
    pub header_bytes: usize,
    /// Whether the pages use the checkpoint's static scale (passed to the kernels) instead of
    /// storing one per token.
    pub static_scale: bool,
    /// Byte alignment the kernels load a region with (its offset and the block size).
    pub align: usize,
}

impl KvPageKind {
    /// Bytes of one token's record for heads of `head_dim`.
    pub fn record_bytes(&self, head_dim: usize) -> usize {
        self.header_bytes + (self.value_bits * head_dim).div_ceil(8)
    }
}
