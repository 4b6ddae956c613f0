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

// W8A8 FP8 on ts_group_rows, column block by column block: per block an f32 sum of E4M3
// products, then acc = acc + (s_w · s_x) · part with the row's and the token's block scales.
struct Fp8Groups {
    typedef float Part;
    const uint8_t* wq;
    const float* ws;
    const float* xs;
    int k, t0, mt, ng, bh;
    const float* wsr;  // the row's block scales

    __device__ __forceinline__ void begin_row(int row) {
        wsr = ws + (int64_t)(row / bh) * ng;
    }

    __device__ __forceinline__ int begin_group(int, int) const {
        return 0;
    }

    __device__ __forceinline__ void step(float (&part)[TS_MT], const uint8_t* xq, int row, int c, int) const {
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

    // Tokens past the tile have no activation scale to read; their accumulators are not stored.
    __device__ __forceinline__ float fold(float acc, float p, int, int g, int t) const {
        if (t >= mt) return acc;
        const float sx = xs[(int64_t)(t0 + t) * ng + g];
        return __fadd_rn(acc, __fmul_rn(__fmul_rn(wsr[g], sx), p));
    }

    __device__ __forceinline__ float out(float acc, int) const {
        return acc;
    }
};

extern "C" __global__ void __launch_bounds__(TS_WARPS * 32)
quant_matmul(const uint8_t* wq, const float* ws, const int8_t* wz, const void* xa, const float* xs,
             float* y, int n, int k, int m, int group, int bh) {
    (void)wz;
    TsTile tile;
    if (!ts_tile<TS_RW>(n, m, tile)) return;
    Fp8Groups f;
    f.wq = wq; f.ws = ws; f.xs = xs; f.k = k; f.t0 = tile.t0; f.mt = tile.mt; f.bh = bh;
    f.ng = (k + group - 1) / group;
    ts_group_rows(f, tile, xa, y, n, k, group);
}
