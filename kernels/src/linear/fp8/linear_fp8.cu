// Matmul over FP8 checkpoint weights with FP8 activations (W8A8 FP8, linear/fp8 layout, uploaded
// as stored): y[m, N] = x[m, K] · W[N, K]ᵀ, f32 output.
//   E4M3 weights and E4M3 activation codes (per token and column block). Per column block an
//   f32 sum of code products (exact products, summation order differs from the CPU), then
//   acc = acc + (s_w · s_x) · part in block order.
//
// Layout: [N, K] E4M3 bytes, scales f32 [ceil(N / bh), ceil(K / bw)] (bw passed as `group`).
// K is a multiple of 32 and bw a multiple of 32 or >= K.
//
// Work split: one output row per warp (TS_RW), TS_WARPS warps per CTA, up to TS_MT tokens per
// grid row (grid = (ceil(N / TS_WARPS), ceil(m / TS_MT)); linear/matmul.cuh). The activations
// are a quarter of the bytes of f32 ones and batch 1 needs every warp for parallelism
// (linear/fp8/cuda.rs sizes the grid to match).

#define TS_RW 1

__device__ __forceinline__ float ts_e4m3(uint32_t b) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
    return __half2float(__half(h));
}

extern "C" __global__ void __launch_bounds__(TS_WARPS * 32)
quant_matmul(const uint8_t* wq, const float* ws, const int8_t* wz, const void* xa, const float* xs,
             float* y, int n, int k, int m, int group, int bh) {
    const int lane = threadIdx.x % 32;
    const int row0 = (blockIdx.x * TS_WARPS + threadIdx.x / 32) * TS_RW;
    if (row0 >= n) return;  // whole warps leave; no CTA-wide barrier follows
    const int nr = min(TS_RW, n - row0);
    const int t0 = blockIdx.y * TS_MT;
    const int mt = min(TS_MT, m - t0);
    const int ng = (k + group - 1) / group;

    // The warp's rows one after another.
    for (int row = row0; row < row0 + nr; ++row) {
        float acc[TS_MT];
#pragma unroll
        for (int t = 0; t < TS_MT; ++t) acc[t] = 0.0f;
        // Column block by column block, in order; lanes split a block into 4-column units.
        const uint8_t* xq = reinterpret_cast<const uint8_t*>(xa) + (int64_t)t0 * k;
        const float* wsr = ws + (int64_t)(row / bh) * ng;
        for (int g = 0; g < ng; ++g) {
            const int c0 = g * group, c1 = min(k, c0 + group);
            float part[TS_MT];
#pragma unroll
            for (int t = 0; t < TS_MT; ++t) part[t] = 0.0f;
            for (int c = c0 + 4 * lane; c < c1; c += 4 * 32) {
                const uint32_t word = *reinterpret_cast<const uint32_t*>(wq + (int64_t)row * k + c);
                const float w0 = ts_e4m3(word & 0xffu), w1 = ts_e4m3((word >> 8) & 0xffu);
                const float w2 = ts_e4m3((word >> 16) & 0xffu), w3 = ts_e4m3(word >> 24);
#pragma unroll
                for (int t = 0; t < TS_MT; ++t) {
                    if (t < mt) {
                        const uint32_t a = *reinterpret_cast<const uint32_t*>(xq + (int64_t)t * k + c);
                        part[t] += w0 * ts_e4m3(a & 0xffu) + w1 * ts_e4m3((a >> 8) & 0xffu)
                                 + w2 * ts_e4m3((a >> 16) & 0xffu) + w3 * ts_e4m3(a >> 24);
                    }
                }
            }
#pragma unroll
            for (int t = 0; t < TS_MT; ++t) {
                const float p = ts_warp_sum(part[t]);
                if (t < mt) {
                    const float sx = xs[(int64_t)(t0 + t) * ng + g];
                    acc[t] = __fadd_rn(acc[t], __fmul_rn(__fmul_rn(wsr[g], sx), p));
                }
            }
        }
#pragma unroll
        for (int t = 0; t < TS_MT; ++t) {
            if (lane == 0 && t < mt) {
                y[(int64_t)(t0 + t) * n + row] = acc[t];
            }
        }
    }
}
