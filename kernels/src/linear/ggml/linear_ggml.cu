// Weight-in-storage matmul and embedding gather for GGUF tensor types, f32 activations:
//   y[m, N] = x[m, K] · W[N, K]ᵀ   (W never expanded to f32 in memory).
//
// Specialized by GGML_TYPE (the GGUF type id): 0 F32, 1 F16, 30 BF16 (row-major [N, K] as
// stored), 2 Q4_0, 3 Q4_1, 8 Q8_0. The block types are repacked at upload (linear/ggml/cuda.rs) into two
// planes so a block's codes are 16-byte aligned:
//   qs: [N, K/32, QS] bytes, the block's code bytes as in the GGUF block (QS = 16 for 4-bit:
//       byte j = code j in the low nibble, code j + 16 in the high nibble; QS = 32 for Q8_0);
//   sc: [N, K/32] raw f16 `d` (Q4_0, Q8_0) or [N, K/32] pairs (f16 `d`, f16 `m`) (Q4_1).
// Dequantized values are computed as the CPU does (ggml/dequant.rs): Q4_0 (q - 8)·d,
// Q4_1 q·d + m (separately rounded, no FMA), Q8_0 q·d.
//
// Work split (ggml_matmul): a CTA of TS_WARPS warps, TS_RW output rows per warp, one tile of up
// to TS_MT tokens per grid row (grid = (ceil(N / (TS_WARPS * TS_RW)), ceil(m / TS_MT))). Each
// lane walks the rows' 32-value blocks with stride 32, dequantizes them in registers and dots
// them with every token of the tile (f32 accumulation), then the warp reduces by shuffles.

#ifndef GGML_TYPE
#error "GGML_TYPE must be defined"
#endif

#define TS_BLOCKED (GGML_TYPE == 2 || GGML_TYPE == 3 || GGML_TYPE == 8)
// Rows per warp: 4 for block types (activation reuse), 1 for float types (linear/cuda.rs
// sizes the grid to match).
#if TS_BLOCKED
#define TS_RW 4
#else
#define TS_RW 1
#endif

#if GGML_TYPE == 2 || GGML_TYPE == 3
#define TS_QS 16
#elif GGML_TYPE == 8
#define TS_QS 32
#elif GGML_TYPE == 0
typedef float ts_w_t;
#elif GGML_TYPE == 1 || GGML_TYPE == 30
typedef uint16_t ts_w_t;
#else
#error "unsupported GGML_TYPE"
#endif

#if TS_BLOCKED
// Value of code `q` (the raw nibble or byte) of a block with scale words `d` (and `m`).
__device__ __forceinline__ float ts_dequant(uint32_t q, float d, float m) {
#if GGML_TYPE == 2
    return __fmul_rn((float)((int)q - 8), d);
#elif GGML_TYPE == 3
    return __fadd_rn(__fmul_rn((float)q, d), m);
#else
    return __fmul_rn((float)(int8_t)q, d);
#endif
}

// Scale words of block `blk` (a flat block index over the whole matrix).
__device__ __forceinline__ void ts_block_scales(const uint8_t* sc, int64_t blk, float& d, float& m) {
#if GGML_TYPE == 3
    const uint32_t dm = reinterpret_cast<const uint32_t*>(sc)[blk];
    d = ts_f16_bits((uint16_t)(dm & 0xffffu));
    m = ts_f16_bits((uint16_t)(dm >> 16));
#else
    d = ts_f16_bits(reinterpret_cast<const uint16_t*>(sc)[blk]);
    m = 0.0f;
#endif
}

// Element `c` of row `r` (embedding gather).
__device__ __forceinline__ float ts_element(const uint8_t* qs, const uint8_t* sc, int64_t r, int k, int c) {
    const int64_t blk = r * (k / 32) + c / 32;
    const int j = c % 32;
    float d, m;
    ts_block_scales(sc, blk, d, m);
#if TS_QS == 16
    const uint32_t b = qs[blk * TS_QS + (j & 15)];
    return ts_dequant(j < 16 ? (b & 0xfu) : (b >> 4), d, m);
#else
    return ts_dequant(qs[blk * TS_QS + j], d, m);
#endif
}
#else
__device__ __forceinline__ float ts_float(float v) { return v; }
__device__ __forceinline__ float ts_float(uint16_t v) {
#if GGML_TYPE == 1
    return ts_f16_bits(v);
#else
    return __uint_as_float(((uint32_t)v) << 16);
#endif
}

__device__ __forceinline__ float ts_element(const uint8_t* qs, const uint8_t*, int64_t r, int k, int c) {
    return ts_float(reinterpret_cast<const ts_w_t*>(qs)[r * k + c]);
}
#endif

#if TS_BLOCKED
// Code bytes of block `blk` as words (4 for 4-bit types, 8 for Q8_0), 16-byte loads.
__device__ __forceinline__ void ts_block_words(const uint8_t* qs, int64_t blk, uint32_t w[TS_QS / 4]) {
    const uint4* p = reinterpret_cast<const uint4*>(qs + blk * TS_QS);
#pragma unroll
    for (int i = 0; i < TS_QS / 16; ++i) {
        const uint4 v = p[i];
        w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
}

// Values 8c..8c+8 of a block from its code words (4-bit: value j is the low nibble of byte j for
// j < 16, the high nibble of byte j - 16 otherwise; Q8_0: value j is byte j).
__device__ __forceinline__ void ts_chunk8(const uint32_t* words, int c, float d, float m, float w[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#if TS_QS == 16
        const int v = 8 * c + j, byte = v & 15;
        const uint32_t b = (words[byte / 4] >> (8 * (byte % 4))) & 0xffu;
        w[j] = ts_dequant(v < 16 ? (b & 0xfu) : (b >> 4), d, m);
#else
        const int byte = 8 * c + j;
        w[j] = ts_dequant((words[byte / 4] >> (8 * (byte % 4))) & 0xffu, d, m);
#endif
    }
}
#endif

// x: [m, k] f32, 16-byte aligned (checked by the launcher); y: [m, n] f32. For block types
// k is a multiple of 32; float types take any k (8-wide vector loads when k % 8 == 0).
//
// Block types: TS_RW rows per warp on ts_run_tile (linear/matmul.cuh), a run being one block
// (its 16-byte code loads and scale words), so each activation value read serves TS_RW rows (the
// activations, not the weights, were the traffic that bounded the one-row-per-warp version at
// batch 8: ~64x the weight bytes).
#if TS_BLOCKED
struct GgmlRuns {
    struct Run {
        uint32_t words[TS_QS / 4];
        float d, m;
    };
    const uint8_t* qs;
    const uint8_t* sc;
    int nb;  // blocks per row

    __device__ __forceinline__ void load(Run& r, int row, int run) const {
        const int64_t blk = (int64_t)row * nb + run;
        ts_block_words(qs, blk, r.words);
        ts_block_scales(sc, blk, r.d, r.m);
    }

    __device__ __forceinline__ void chunk8(const Run& r, int c, float (&w)[8]) const {
        ts_chunk8(r.words, c, r.d, r.m, w);
    }
};
#endif

extern "C" __global__ void __launch_bounds__(TS_WARPS * 32)
ggml_matmul(const uint8_t* qs, const uint8_t* sc, const float* x, float* y, int n, int k, int m) {
    TsTile tile;
    if (!ts_tile<TS_RW>(n, m, tile)) return;
    const float* xt = x + (int64_t)tile.t0 * k;

#if TS_BLOCKED
    const GgmlRuns f = {qs, sc, k / 32};
    ts_run_tile<TS_RW>(f, tile, xt, y, n, k);
#else
    // Float types: the warp's rows one after another.
    for (int row = tile.row0; row < tile.row0 + tile.nr; ++row) {
        float acc[TS_MT];
#pragma unroll
        for (int t = 0; t < TS_MT; ++t) acc[t] = 0.0f;
        const ts_w_t* wr = reinterpret_cast<const ts_w_t*>(qs) + (int64_t)row * k;
        if (k % 8 == 0) {
            for (int c = tile.lane * 8; c < k; c += 32 * 8) {
                float w[8];
#if GGML_TYPE == 0
                const float4 w0 = *reinterpret_cast<const float4*>(wr + c);
                const float4 w1 = *reinterpret_cast<const float4*>(wr + c + 4);
                w[0] = w0.x; w[1] = w0.y; w[2] = w0.z; w[3] = w0.w;
                w[4] = w1.x; w[5] = w1.y; w[6] = w1.z; w[7] = w1.w;
#else
                const uint4 v = *reinterpret_cast<const uint4*>(wr + c);
                const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    w[2 * j] = ts_float((uint16_t)(words[j] & 0xffffu));
                    w[2 * j + 1] = ts_float((uint16_t)(words[j] >> 16));
                }
#endif
#pragma unroll
                for (int t = 0; t < TS_MT; ++t) {
                    if (t < tile.mt) {
                        const float4* xv = reinterpret_cast<const float4*>(xt + (int64_t)t * k + c);
                        const float4 a = xv[0], b = xv[1];
                        acc[t] += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w
                                + w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;
                    }
                }
            }
        } else {
            for (int c = tile.lane; c < k; c += 32) {
                const float w = ts_float(wr[c]);
#pragma unroll
                for (int t = 0; t < TS_MT; ++t) {
                    if (t < tile.mt) acc[t] += w * xt[(int64_t)t * k + c];
                }
            }
        }
#pragma unroll
        for (int t = 0; t < TS_MT; ++t) {
            const float v = ts_warp_sum(acc[t]);
            if (tile.lane == 0 && t < tile.mt) y[(int64_t)(tile.t0 + t) * n + row] = v;
        }
    }
#endif
}

// Embedding gather: out[i, :] = table[ids[i], :] as f32 (table [rows, k] in the layout above).
// One CTA per id. An id outside [0, rows) reads nothing and yields a row of zeros (host callers
// validate ids; the kernel only guarantees no out-of-bounds read).
extern "C" __global__ void embedding_rows(const uint8_t* qs, const uint8_t* sc, const int* ids, int rows,
                                          int k, float* out) {
    const int64_t i = blockIdx.x;
    const int id = ids[i];
    const bool ok = id >= 0 && id < rows;
    float* o = out + i * k;
    for (int c = threadIdx.x; c < k; c += blockDim.x) o[c] = ok ? ts_element(qs, sc, id, k, c) : 0.0f;
}

#if TS_BLOCKED
// Dequantization of a whole matrix to f32 (`out` [n, k], k a multiple of 32), for the prefill
// path that hands large batches to cuBLAS: one thread per 8 values (a warp writes 1 KB
// contiguously), values exactly as the CPU's dequantize_row. `chunks` = n·k / 8.
extern "C" __global__ void ggml_dequant_rows(const uint8_t* qs, const uint8_t* sc, float* out, int64_t chunks) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= chunks) return;
    const int64_t blk = i / 4;  // flat block index: row-major blocks are row-major values
    uint32_t words[TS_QS / 4];
    float d, m, w[8];
    ts_block_words(qs, blk, words);
    ts_block_scales(sc, blk, d, m);
    ts_chunk8(words, (int)(i % 4), d, m, w);
    float4* o = reinterpret_cast<float4*>(out + i * 8);
    o[0] = make_float4(w[0], w[1], w[2], w[3]);
    o[1] = make_float4(w[4], w[5], w[6], w[7]);
}
#endif
