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

// The matmul kernels' inner step for a warp owning RW rows and a tile of MT tokens:
// acc[t][r] += w[r][0..8) · x[t][0..8), where token t's 8 activations start at x + t·k
// (16-byte aligned), for the tile's first mt tokens.
template <int MT, int RW>
__device__ __forceinline__ void ts_tile_dot8(float (&acc)[MT][RW], const float (&w)[RW][8], const float* x, int64_t k, int mt) {
#pragma unroll
    for (int t = 0; t < MT; ++t) {
        if (t < mt) {
            const float4* xv = reinterpret_cast<const float4*>(x + t * k);
            const float4 a0 = xv[0], a1 = xv[1];
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                acc[t][r] += w[r][0] * a0.x + w[r][1] * a0.y + w[r][2] * a0.z + w[r][3] * a0.w
                           + w[r][4] * a1.x + w[r][5] * a1.y + w[r][6] * a1.z + w[r][7] * a1.w;
            }
        }
    }
}

// Reduces each lane's partial sums over the warp and stores y[t0 + t, row0 + r] for the tile's
// first mt tokens and the warp's first nr rows (y is [m, n]).
template <int MT, int RW>
__device__ __forceinline__ void ts_tile_store(const float (&acc)[MT][RW], float* y, int n, int t0, int mt, int row0, int nr) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            const float v = ts_warp_sum(acc[t][r]);
            if (lane == 0 && t < mt && r < nr) y[(int64_t)(t0 + t) * n + row0 + r] = v;
        }
}

// IEEE half bits to float (GGUF block scales are stored as raw f16 bits).
__device__ __forceinline__ float ts_f16_bits(uint16_t bits) {
    return __half2float(__ushort_as_half(bits));
}
