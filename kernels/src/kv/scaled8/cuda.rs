//! 8-bit pages (FP8 E4M3, int8) as the CUDA kernels read and write them: `TS_KV_FP8`,
//! `TS_KV_INT8` (a 4-byte f32 scale before each token's `head_dim` bytes) and their static
//! variants `TS_KV_FP8_STATIC`, `TS_KV_INT8_STATIC` (bytes only; the layer's scale is a kernel
//! argument), with their record load and store, in `kv_scaled8.cuh` beside this file; regions
//! 4-byte aligned.

use super::Byte8;
use crate::kv::KvCudaPage;

/// Pages of `kind`, with the checkpoint's static scale or a scale per token and head.
pub fn page(kind: Byte8, static_scale: bool) -> KvCudaPage {
    let code = match (kind, static_scale) {
        (Byte8::Fp8E4m3, false) => 3,
        (Byte8::Fp8E4m3, true) => 4,
        (Byte8::Int8, false) => 5,
        (Byte8::Int8, true) => 6,
    };
    KvCudaPage { code, elem_bytes: 1, header_bytes: if static_scale { 0 } else { 4 }, static_scale, align: 4 }
}
