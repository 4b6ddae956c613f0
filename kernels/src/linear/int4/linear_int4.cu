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

#if INT4_ACT_INT8 == 0
    (void)xs;
    (void)bh;
    // Lane per 32-column run of the warp's TS_RW rows: TS_RW 16-byte weight loads in flight, values
    // dequantized 8 at a time ((q - z)·s, as the CPU dequantizes) and dotted with every token, so
    // each activation value read serves TS_RW rows.
    const float* x = reinterpret_cast<const float*>(xa) + (int64_t)t0 * k;
    float acc[TS_MT][TS_RW];
#pragma unroll
    for (int t = 0; t < TS_MT; ++t)
#pragma unroll
        for (int r = 0; r < TS_RW; ++r) acc[t][r] = 0.0f;
    for (int run = lane; run < k / 32; run += 32) {
        const int g = run * 32 / group;
        uint32_t words[TS_RW][4];
        float s[TS_RW];
        int z[TS_RW];
#pragma unroll
        for (int r = 0; r < TS_RW; ++r) {
            // Rows past the end repeat the last row (in bounds); their sums are not stored.
            const int64_t rr = row0 + min(r, nr - 1);
            s[r] = ws[rr * ng + g];
            z[r] = wz ? (int)wz[rr * ng + g] : 0;
            const uint4 v = *reinterpret_cast<const uint4*>(wq + rr * (k / 2) + run * 16);
            words[r][0] = v.x; words[r][1] = v.y; words[r][2] = v.z; words[r][3] = v.w;
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float w[TS_RW][8];
#pragma unroll
            for (int r = 0; r < TS_RW; ++r)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    // Value v of the run: low nibble of byte v for v < 16, else high nibble of byte v - 16.
                    const int v = 8 * c + j, byte = v & 15;
                    const uint32_t b = (words[r][byte / 4] >> (8 * (byte % 4))) & 0xffu;
                    const int q = (int)(v < 16 ? (b & 0xfu) : (b >> 4)) - 8;
                    w[r][j] = __fmul_rn((float)(q - z[r]), s[r]);
                }
            ts_tile_dot8<TS_MT, TS_RW>(acc, w, x + run * 32 + c * 8, k, mt);
        }
    }
    ts_tile_store<TS_MT, TS_RW>(acc, y, n, t0, mt, row0, nr);
#else
    // The warp's rows one after another.
    for (int row = row0; row < row0 + nr; ++row) {
        float acc[TS_MT];
#pragma unroll
        for (int t = 0; t < TS_MT; ++t) acc[t] = 0.0f;
        // Group by group, in order; lanes split a group into 4-column units.
        const uint8_t* xq = reinterpret_cast<const uint8_t*>(xa) + (int64_t)t0 * k;
        (void)bh;
        for (int g = 0; g < ng; ++g) {
            const int c0 = g * group, c1 = min(k, c0 + group);
            int part[TS_MT];
#pragma unroll
            for (int t = 0; t < TS_MT; ++t) part[t] = 0;
            const int zb = 8 + (wz ? (int)wz[(int64_t)row * ng + g] : 0);  // code offset, 0..15
            for (int c = c0 + 4 * lane; c < c1; c += 4 * 32) {
                // Columns c..c+3 sit in the low (c % 32 < 16) or high nibbles of 4 bytes of the run.
                const int off = c % 32;
                const uint32_t word = *reinterpret_cast<const uint32_t*>(wq + (int64_t)row * (k / 2) + (c / 32) * 16 + (off & 15));
                const uint32_t nib = (off < 16 ? word : word >> 4) & 0x0f0f0f0fu;
                const int wv = (int)__vsub4(nib, 0x01010101u * (uint32_t)zb);  // bytes q - z in -15..15
                ts_dp4a_tokens<TS_MT>(part, wv, xq, k, c, mt);
            }
#pragma unroll
            for (int t = 0; t < TS_MT; ++t) {
                const int p = __reduce_add_sync(0xffffffffu, part[t]);
                acc[t] = __fadd_rn(acc[t], __fmul_rn(ws[(int64_t)row * ng + g], (float)p));
            }
        }
#pragma unroll
        for (int t = 0; t < TS_MT; ++t) {
            if (lane == 0 && t < mt) {
                y[(int64_t)(t0 + t) * n + row] = __fmul_rn(xs[t0 + t], acc[t]);
            }
        }
    }
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
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int val = 8 * c + j, byte = val & 15;
        const uint32_t b = (words[byte / 4] >> (8 * (byte % 4))) & 0xffu;
        w[j] = __fmul_rn((float)((int)(val < 16 ? (b & 0xfu) : (b >> 4)) - 8 - z), s);
    }
    float4* o = reinterpret_cast<float4*>(out + i * 8);
    o[0] = make_float4(w[0], w[1], w[2], w[3]);
    o[1] = make_float4(w[4], w[5], w[6], w[7]);
}
#endif
