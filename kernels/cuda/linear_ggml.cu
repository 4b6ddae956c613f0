// y[m, n] = x[m, k] . W[n, k]^T over GGML-typed weights, dequantized in registers, f32 math.
// WTYPE (compile-time): 0 F32, 1 F16, 2 BF16, 3 Q4_0, 4 Q4_1, 5 Q8_0. Every type is walked in
// 32-element blocks (the float types' last block may be partial).
//
// One warp per output row; lane l takes blocks l, l+32, ...; each lane decodes a block's 32
// weights once and applies them to up to 8 activation rows at a time. A token's sum has the
// same order whatever m is (per lane in block order, then a fixed butterfly), so batching
// never changes a row's result.

#ifndef WTYPE
#error "WTYPE must be defined"
#endif

#define QK 32
#define ROWS_PER_PASS 8

__device__ __forceinline__ int64_t ts_row_bytes(int k) {
#if WTYPE == 0
    return (int64_t)k * 4;
#elif WTYPE == 1 || WTYPE == 2
    return (int64_t)k * 2;
#elif WTYPE == 3
    return (int64_t)(k / QK) * 18;
#elif WTYPE == 4
    return (int64_t)(k / QK) * 20;
#else
    return (int64_t)(k / QK) * 34;
#endif
}

__device__ __forceinline__ uint16_t ts_u16(const uint8_t* p) {
    return (uint16_t)p[0] | ((uint16_t)p[1] << 8);
}

// The 32 weights of block `b` of a row (zeros past column k for the float types).
__device__ __forceinline__ void ts_decode_block(const uint8_t* row, int b, int k, float* w) {
#if WTYPE == 0
    const float* r = (const float*)row;
#pragma unroll
    for (int j = 0; j < QK; j++) w[j] = b * QK + j < k ? r[b * QK + j] : 0.0f;
#elif WTYPE == 1
#pragma unroll
    for (int j = 0; j < QK; j++) w[j] = b * QK + j < k ? ts_f16_bits(ts_u16(row + 2 * (b * QK + j))) : 0.0f;
#elif WTYPE == 2
#pragma unroll
    for (int j = 0; j < QK; j++) w[j] = b * QK + j < k ? __uint_as_float((uint32_t)ts_u16(row + 2 * (b * QK + j)) << 16) : 0.0f;
#elif WTYPE == 3
    const uint8_t* blk = row + (int64_t)b * 18;
    const float d = ts_f16_bits(ts_u16(blk));
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const uint8_t q = blk[2 + j];
        w[j] = (float)((int)(q & 0x0F) - 8) * d;
        w[j + 16] = (float)((int)(q >> 4) - 8) * d;
    }
#elif WTYPE == 4
    const uint8_t* blk = row + (int64_t)b * 20;
    const float d = ts_f16_bits(ts_u16(blk)), mn = ts_f16_bits(ts_u16(blk + 2));
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const uint8_t q = blk[4 + j];
        w[j] = (float)(q & 0x0F) * d + mn;
        w[j + 16] = (float)(q >> 4) * d + mn;
    }
#else
    const uint8_t* blk = row + (int64_t)b * 34;
    const float d = ts_f16_bits(ts_u16(blk));
#pragma unroll
    for (int j = 0; j < QK; j++) w[j] = (float)(int8_t)blk[2 + j] * d;
#endif
}

extern "C" __global__ void ggml_matmul(const uint8_t* wt, const float* x, float* y, int n, int k, int m) {
    const int row = (int)((blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / TS_WARP);
    const int lane = threadIdx.x % TS_WARP;
    if (row >= n) return;
    const uint8_t* wr = wt + (int64_t)row * ts_row_bytes(k);
    const int blocks = (k + QK - 1) / QK;
    for (int t0 = 0; t0 < m; t0 += ROWS_PER_PASS) {
        float acc[ROWS_PER_PASS];
#pragma unroll
        for (int t = 0; t < ROWS_PER_PASS; t++) acc[t] = 0.0f;
        for (int b = lane; b < blocks; b += TS_WARP) {
            float w[QK];
            ts_decode_block(wr, b, k, w);
#pragma unroll
            for (int t = 0; t < ROWS_PER_PASS; t++) {
                if (t0 + t < m) {
                    const float* xr = x + (int64_t)(t0 + t) * k + b * QK;
                    float s = 0.0f;
#pragma unroll
                    for (int j = 0; j < QK; j++) s += b * QK + j < k ? w[j] * xr[j] : 0.0f;
                    acc[t] += s;
                }
            }
        }
#pragma unroll
        for (int t = 0; t < ROWS_PER_PASS; t++) {
            const float s = ts_warp_sum(acc[t]);
            if (lane == 0 && t0 + t < m) y[(int64_t)(t0 + t) * n + row] = s;
        }
    }
}

// Embedding lookup: out[t, :] = dequantized row ids[t] of the [vocab, k] table. An id outside
// the table writes NaN (host callers validate ids; the kernel never reads out of bounds).
extern "C" __global__ void ggml_embedding(const uint8_t* table, const int* ids, float* out, int k, int vocab) {
    const int64_t t = blockIdx.x;
    const int id = ids[t];
    float* o = out + t * k;
    const int blocks = (k + QK - 1) / QK;
    if (id < 0 || id >= vocab) {
        for (int i = threadIdx.x; i < k; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
        return;
    }
    const uint8_t* row = table + (int64_t)id * ts_row_bytes(k);
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) {
        float w[QK];
        ts_decode_block(row, b, k, w);
#pragma unroll
        for (int j = 0; j < QK; j++) {
            if (b * QK + j < k) o[b * QK + j] = w[j];
        }
    }
}
