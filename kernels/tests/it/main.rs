//! `kernels`'s integration tests: one binary (one link) for all of them, one module per
//! area; `cargo test -p tessera-kernels --test it MODULE::` runs one area.

mod common;
mod attention;
mod cuda_attention;
mod cuda_comm;
mod cuda_compile;
mod cuda_linear;
mod cuda_ops;
mod kernels;
mod quant_fp8;
mod q8k;
mod quant_int;
mod toy_format;
mod toy_kv_format;
