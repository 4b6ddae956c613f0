//! Tessera compute kernels.
//!
//! Kernels know buffers, shapes and storage types, never checkpoints or models:
//! - [`ggml`]: GGML block formats (types, dequantization, activation quantization);
//! - [`cpu`]: feature detection and SIMD row dot products;
//! - [`linear`]: `y = x·Wᵀ`, one folder per weight format (GGML blocks, int4, int8, FP8) behind
//!   the `WeightMatrix` / `LinearOp` traits, with a kernel chosen per layer;
//! - [`attention`]: causal GQA attention over cached K/V pages;
//! - [`kv`]: KV-cache storage formats (plain, fp8/int8, QJL, TQ3_0, HQMQ);
//! - [`ops`]: RMSNorm, RoPE, SwiGLU;
//! - [`e4m3`]: FP8 E4M3 conversions (the FP8 weight format and the fp8 KV cache);
//! - [`cuda`]: the CUDA backend (NVRTC-compiled sources, launched through `cudarc`);
//! - [`comm`]: collectives between tensor-parallel ranks (in-process shared memory, NCCL);
//! - [`reference`](mod@reference): scalar references the optimized kernels are tested against.

pub mod attention;
pub mod kv;
pub mod comm;
pub mod cpu;
pub mod cuda;
pub mod e4m3;
pub mod ggml;
pub mod linear;
pub mod ops;
pub mod reference;
