//! 8-bit pages (FP8 E4M3, int8) as the CUDA kernels read and write them: `TS_KV_FP8`,
//! `TS_KV_INT8` (a 4-byte f32 scale before each token's `head_dim` bytes) and their static
//! variants `TS_KV_FP8_STATIC`, `TS_KV_INT8_STATIC` (bytes only; the layer's scale is a kernel
//! argument), with their record load and store, in `kv_scaled8.cuh` beside this file; regions
//! 4-byte aligned.

use crate::kv::{KvCuda, KvPageKind};

/// FP8 then int8 pages, each with a scale per token then with the static scale (page
/// `2 * parameter + static`).
pub static CUDA: KvCuda = KvCuda {
    header: include_str!("kv_scaled8.cuh"),
    load: "ts_kv_scaled8_load",
    store: "ts_kv_scaled8_encode",
    pages: &[page("FP8", false), page("FP8_STATIC", true), page("INT8", false), page("INT8_STATIC", true)],
};

const fn page(name: &'static str, static_scale: bool) -> KvPageKind {
    KvPageKind { name, value_bits: 8, header_bytes: if static_scale { 0 } else { 4 }, static_scale, align: 4 }
}
