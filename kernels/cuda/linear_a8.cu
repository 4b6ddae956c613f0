// Linear layers with int8 activations quantized per token at run time (W4A8, W8A8 int8), bit for
// bit as the CPU kernels compute them (kernels/src/quant/{act,int4,int8}.rs):
//   scale = absmax / 127, q = round_half_even(x / scale) clamped to +-127 (NaN to 0), an
//   all-zero row gets scale 0 and zero codes;
//   W4A8:  acc = sum over groups, in order, of s[r, g] * (int32) sum_{c in g} (w - z) q_x; y = xs * acc
//   W8A8:  y = xs * (s[r] * (int32) sum_c w q_x)
// Integer sums are exact in any order (dp4a, warp reductions); the float epilogue uses _rn
// intrinsics so nothing is contracted into an FMA the CPU does not do.

// One CTA (a power-of-two number of threads <= 1024) per activation row.
extern "C" __global__ void quantize_int8_rows(const float* x, int8_t* q, float* scales, int k) {
    __shared__ float red[1024];
    const int64_t row = blockIdx.x;
    const float* xr = x + row * k;
    int8_t* qr = q + row * k;
    float amax = 0.0f;
    for (int i = threadIdx.x; i < k; i += blockDim.x) amax = fmaxf(amax, fabsf(xr[i]));
    red[threadIdx.x] = amax;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    const float scale = __fdiv_rn(red[0], 127.0f);
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        if (scale == 0.0f) {
            qr[i] = 0;
        } else {
            const float r = rintf(__fdiv_rn(xr[i], scale));
            qr[i] = isnan(r) ? 0 : (int8_t)(int)fminf(fmaxf(r, -127.0f), 127.0f);
        }
    }
    if (threadIdx.x == 0) scales[row] = scale;
}

__device__ __forceinline__ int ts_warp_isum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Four int8 values (w - 8 - z for unsigned nibbles u) packed for dp4a.
__device__ __forceinline__ int ts_pack_nibbles(uint32_t nibbles, int z) {
    int out = 0;
#pragma unroll
    for (int b = 0; b < 4; b++) {
        const int v = (int)((nibbles >> (8 * b)) & 0x0F) - 8 - z;
        out |= (v & 0xFF) << (8 * b);
    }
    return out;
}

// W4A8 over Tessera's int4 runs (16 bytes per 32 columns: column j in the low nibble of byte j,
// column j + 16 in its high nibble, as q + 8). One warp per output row.
extern "C" __global__ void int4_a8_matmul(const uint8_t* packed, const float* scales, const int8_t* zeros,
                                          const int8_t* xq, const float* xs, float* y,
                                          int n, int k, int m, int group) {
    const int row = (int)((blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / TS_WARP);
    const int lane = threadIdx.x % TS_WARP;
    if (row >= n) return;
    const int groups = (k + group - 1) / group;
    const uint8_t* wr = packed + (int64_t)row * (k / 2);
    const float* sr = scales + (int64_t)row * groups;
    const int8_t* zr = zeros ? zeros + (int64_t)row * groups : nullptr;
    for (int t = 0; t < m; t++) {
        const int8_t* xr = xq + (int64_t)t * k;
        float acc = 0.0f;
        for (int g = 0; g < groups; g++) {
            const int g0 = g * group, g1 = min(k, g0 + group);
            const int z = zr ? (int)zr[g] : 0;
            int sum = 0;
            for (int c = g0 + 4 * lane; c < g1; c += 4 * TS_WARP) {
                const int j = c % 32;
                const uint32_t word = *(const uint32_t*)(wr + (c / 32) * 16 + (j % 16));
                const uint32_t nib = j < 16 ? (word & 0x0F0F0F0Fu) : ((word >> 4) & 0x0F0F0F0Fu);
                sum = __dp4a(ts_pack_nibbles(nib, z), *(const int*)(xr + c), sum);
            }
            sum = ts_warp_isum(sum);
            acc = __fadd_rn(acc, __fmul_rn(sr[g], (float)sum));
        }
        if (lane == 0) y[(int64_t)t * n + row] = __fmul_rn(xs[t], acc);
    }
}

// W8A8 int8 with one scale per output row. One warp per output row.
extern "C" __global__ void int8_a8_matmul(const int8_t* w, const float* scales, const int8_t* xq,
                                          const float* xs, float* y, int n, int k, int m) {
    const int row = (int)((blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / TS_WARP);
    const int lane = threadIdx.x % TS_WARP;
    if (row >= n) return;
    const int8_t* wr = w + (int64_t)row * k;
    for (int t = 0; t < m; t++) {
        const int8_t* xr = xq + (int64_t)t * k;
        int sum = 0;
        for (int c = 4 * lane; c < k; c += 4 * TS_WARP) sum = __dp4a(*(const int*)(wr + c), *(const int*)(xr + c), sum);
        sum = ts_warp_isum(sum);
        if (lane == 0) y[(int64_t)t * n + row] = __fmul_rn(xs[t], __fmul_rn(scales[row], (float)sum));
    }
}
