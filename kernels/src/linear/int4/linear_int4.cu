// Matmul over int4 checkpoint weights (linear/int4 layout, uploaded as stored):
//   y[m, N] = x[m, K] · W[N, K]ᵀ, f32 output.
//
// Specialized by INT4_ACT_INT8:
//   0 W4A16: f32 activations: dequantized (q - z)·s as the CPU does, dotted in f32
//            (the CPU's summation order is not kept: a tolerance, not bit-equality).
//   1 W4A8:  per-token int8 activations. Per group an exact int32 sum of
//            (q - z)·xq (dp4a), then, in group order, acc = acc + s[g]·sum and y = xs·acc in
//            separately rounded f32 operations: the CPU's scalar epilogue operation for operation.
//
// Layout: [N, K/2] bytes; each 32-column run is 16 bytes, byte j = (q[j] + 8) | (q[j + 16] + 8) << 4;
// scales f32 [N, G] and optional zero points int8 [N, G], G = ceil(K / group).
// K is a multiple of 32 and group a multiple of 32 or >= K.
//
// Work split: TS_RW output rows per warp, TS_WARPS warps per CTA, up to TS_MT tokens per grid row
// (grid = (ceil(N / (TS_WARPS * TS_RW)), ceil(m / TS_MT)); linear/matmul.cuh).

#ifndef INT4_ACT_INT8
#error "INT4_ACT_INT8 must be defined"
#endif

// Rows per warp: 4 for W4A16 (activation reuse); 1 for W4A8, whose activations are a quarter of
// the bytes and which needs every warp for parallelism at batch 1 (linear/int4/cuda.rs sizes the
// grid to match).
#if INT4_ACT_INT8 == 0
#define TS_RW 4
#else
#define TS_RW 1
#endif

// Values 8c..8c+8 of a 32-column run from its four code words, dequantized as the CPU does:
// (q - z)·s, where value v is the low nibble of byte v for v < 16, else the high nibble of byte
// v - 16 (stored as q + 8).
__device__ __forceinline__ void ts_int4_chunk8(const uint32_t (&words)[4], int c, int z, float s, float (&w)[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int v = 8 * c + j, byte = v & 15;
        const uint32_t b = (words[byte / 4] >> (8 * (byte % 4))) & 0xffu;
        const int q = (int)(v < 16 ? (b & 0xfu) : (b >> 4)) - 8;
        w[j] = __fmul_rn((float)(q - z), s);
    }
}

#if INT4_ACT_INT8 == 0
// W4A16 on ts_run_tile: a run is one 16-byte load of codes with its group's scale and zero point.
struct Int4Runs {
    struct Run {
        uint32_t words[4];
        float s;
        int z;
    };
    const uint8_t* wq;
    const float* ws;
    const int8_t* wz;
    int k, group, ng;

    __device__ __forceinline__ void load(Run& r, int row, int run) const {
        const int64_t rr = row;
        const int g = run * 32 / group;
        r.s = ws[rr * ng + g];
        r.z = wz ? (int)wz[rr * ng + g] : 0;
        const uint4 v = *reinterpret_cast<const uint4*>(wq + rr * (k / 2) + run * 16);
        r.words[0] = v.x; r.words[1] = v.y; r.words[2] = v.z; r.words[3] = v.w;
    }

    __device__ __forceinline__ void chunk8(const Run& r, int c, float (&w)[8]) const {
        ts_int4_chunk8(r.words, c, r.z, r.s, w);
    }
};
#else
// W4A8 on ts_group_rows: per group, the codes minus the group's zero point (bytes q - z in
// -15..15) dotted with the int8 activations; acc = acc + s[g]·sum in separately rounded f32.
struct Int4Groups : TsInt8Act {
    const uint8_t* wq;
    const float* ws;
    const int8_t* wz;
    int ng;

    // The group's zero point (0 when symmetric).
    __device__ __forceinline__ int begin_group(int row, int g) const {
        return wz ? (int)wz[(int64_t)row * ng + g] : 0;
    }

    __device__ __forceinline__ void step(int (&part)[TS_MT], const uint8_t* xq, int row, int c, int z) const {
        // Columns c..c+3 sit in the low (c % 32 < 16) or high nibbles of 4 bytes of the run,
        // stored as q + 8: less the code offset 8 + z, bytes q - z in -15..15.
        const int off = c % 32;
        const uint32_t word = *reinterpret_cast<const uint32_t*>(wq + (int64_t)row * (k / 2) + (c / 32) * 16 + (off & 15));
        const uint32_t nib = (off < 16 ? word : word >> 4) & 0x0f0f0f0fu;
        dot4(part, (int)__vsub4(nib, 0x01010101u * (uint32_t)(8 + z)), xq, c);
    }

    __device__ __forceinline__ float fold(float acc, int p, int row, int g, int) const {
        return __fadd_rn(acc, __fmul_rn(ws[(int64_t)row * ng + g], (float)p));
    }
};
#endif

extern "C" __global__ void __launch_bounds__(TS_WARPS * 32)
quant_matmul(const uint8_t* wq, const float* ws, const int8_t* wz, const void* xa, const float* xs,
             float* y, int n, int k, int m, int group, int bh) {
    (void)bh;
    TsTile tile;
    if (!ts_tile<TS_RW>(n, m, tile)) return;
    const int ng = (k + group - 1) / group;
#if INT4_ACT_INT8 == 0
    (void)xs;
    const Int4Runs f = {wq, ws, wz, k, group, ng};
    ts_run_tile<TS_RW>(f, tile, reinterpret_cast<const float*>(xa) + (int64_t)tile.t0 * k, y, n, k);
#else
    Int4Groups f;
    f.xs = xs; f.k = k; f.t0 = tile.t0; f.mt = tile.mt;
    f.wq = wq; f.ws = ws; f.wz = wz; f.ng = ng;
    ts_group_rows(f, tile, xa, y, n, k, group);
#endif
}

#if INT4_ACT_INT8 == 0
// Dequantization of a whole int4 matrix to f32 (`out` [n, k]): (q - z)·s per value, as the CPU's
// dequantize_row, for the prefill path that hands large batches to cuBLAS. One thread per 8
// values (a warp writes 1 KB contiguously); `chunks` = n·k / 8.
extern "C" __global__ void int4_dequant_rows(const uint8_t* wq, const float* ws, const int8_t* wz, int k, int group,
                                             float* out, int64_t chunks) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= chunks) return;
    const int64_t run = i / 4;  // flat 32-value run index (16 bytes each)
    const int c = (int)(i % 4), runs = k / 32;
    const int64_t r = run / runs;
    const int ng = (k + group - 1) / group, g = (int)(run % runs) * 32 / group;
    const float s = ws[r * ng + g];
    const int z = wz ? (int)wz[r * ng + g] : 0;
    const uint4 v = *reinterpret_cast<const uint4*>(wq + run * 16);
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    float w[8];
    ts_int4_chunk8(words, c, z, s, w);
    float4* o = reinterpret_cast<float4*>(out + i * 8);
    o[0] = make_float4(w[0], w[1], w[2], w[3]);
    o[1] = make_float4(w[4], w[5], w[6], w[7]);
}
#endif
