//! Plain pages (f32, bf16, f16) as the CUDA kernels read and write them: `TS_KV_F32`,
//! `TS_KV_BF16` and `TS_KV_F16`, with their record load and store, in `kv_plain.cuh` beside this
//! file; `head_dim` values per token, no header, regions 8-byte aligned (the kernels load two
//! values at a time). A checkpoint's static scale does not apply, as on the CPU.

use super::Half16;
use crate::kv::KvCudaPage;

/// f32 pages (`TS_KV_F32`).
pub const F32: KvCudaPage = KvCudaPage { code: 0, elem_bytes: 4, header_bytes: 0, static_scale: false, align: 8 };

/// bf16 or f16 pages (`TS_KV_BF16`, `TS_KV_F16`).
pub fn half16(kind: Half16) -> KvCudaPage {
    let code = match kind {
        Half16::Bf16 => 1,
        Half16::F16 => 2,
    };
    KvCudaPage { code, elem_bytes: 2, header_bytes: 0, static_scale: false, align: 8 }
}
