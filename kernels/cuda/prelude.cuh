// Prepended to every Tessera kernel source before NVRTC compiles it.
// NVRTC has no <cstdint>: the fixed-width types are declared here, once.
#pragma once
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#define TS_WARP 32
// NVRTC has no <cmath> INFINITY.
#define TS_INF __int_as_float(0x7f800000)

// Sum over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float ts_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Max over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float ts_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Reduces `v` over a whole block (blockDim.x a multiple of 32, at most 1024) with the warp
// reduction WarpOp; every thread gets the result. `scratch` holds 32 floats of shared memory;
// the call contains barriers.
template <float (*WarpOp)(float)>
__device__ __forceinline__ float ts_block_reduce(float v, float* scratch, float identity) {
    const int lane = threadIdx.x % TS_WARP, warp = threadIdx.x / TS_WARP;
    v = WarpOp(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = blockDim.x / TS_WARP;
    v = lane < warps ? scratch[lane] : identity;
    return WarpOp(v);
}

// Sum over a whole block (see ts_block_reduce).
__device__ __forceinline__ float ts_block_sum(float v, float* scratch) {
    return ts_block_reduce<ts_warp_sum>(v, scratch, 0.0f);
}

// Max over a whole block (see ts_block_reduce); fmaxf skips NaN like Rust's f32::max.
__device__ __forceinline__ float ts_block_max(float v, float* scratch) {
    return ts_block_reduce<ts_warp_max>(v, scratch, -TS_INF);
}

// IEEE half bits to float (GGUF block scales are stored as raw f16 bits).
__device__ __forceinline__ float ts_f16_bits(uint16_t bits) {
    return __half2float(__ushort_as_half(bits));
}
