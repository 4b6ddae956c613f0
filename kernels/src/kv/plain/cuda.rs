//! Plain pages (f32, bf16, f16) as the CUDA kernels read and write them: `TS_KV_F32`,
//! `TS_KV_BF16` and `TS_KV_F16`, with their record load and store, in `kv_plain.cuh` beside this
//! file; `head_dim` values per token, no header, regions 8-byte aligned (the kernels load two
//! values at a time). A checkpoint's static scale does not apply, as on the CPU.

use crate::kv::{KvCuda, KvPageKind};

/// f32, bf16 and f16 pages, in the order of the family's parameters.
pub static CUDA: KvCuda = KvCuda {
    header: include_str!("kv_plain.cuh"),
    load: "ts_kv_plain_load",
    store: "ts_kv_plain_encode",
    pages: &[page("F32", 32), page("BF16", 16), page("F16", 16)],
};

const fn page(name: &'static str, value_bits: usize) -> KvPageKind {
    KvPageKind { name, value_bits, header_bytes: 0, static_scale: false, align: 8 }
}
