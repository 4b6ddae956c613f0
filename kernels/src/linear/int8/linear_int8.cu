// Matmul over int8 checkpoint weights with per-token int8 activations (W8A8 int8, linear/int8
// layout, uploaded as stored): y[m, N] = x[m, K] · W[N, K]ᵀ, f32 output.
//   An exact int32 sum of w·xq (dp4a) per row and token, then y = xs · (s[n] · sum), as the CPU.
//
// Layout: [N, K] int8, scales f32 [N]. K is a multiple of 32; `group` is K (one group per row).
//
// Work split: one output row per warp (TS_RW), TS_WARPS warps per CTA, up to TS_MT tokens per
// grid row (grid = (ceil(N / TS_WARPS), ceil(m / TS_MT)); linear/matmul.cuh). The activations
// are a quarter of the bytes of f32 ones and batch 1 needs every warp for parallelism
// (linear/int8/cuda.rs sizes the grid to match).

#define TS_RW 1

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
        // Group by group, in order; lanes split a group into 4-column units.
        const uint8_t* xq = reinterpret_cast<const uint8_t*>(xa) + (int64_t)t0 * k;
        (void)bh;
        for (int g = 0; g < ng; ++g) {
            const int c0 = g * group, c1 = min(k, c0 + group);
            int part[TS_MT];
#pragma unroll
            for (int t = 0; t < TS_MT; ++t) part[t] = 0;
            for (int c = c0 + 4 * lane; c < c1; c += 4 * 32) {
                const uint32_t word = *reinterpret_cast<const uint32_t*>(wq + (int64_t)row * k + c);
                ts_dp4a_tokens<TS_MT>(part, (int)word, xq, k, c, mt);
            }
#pragma unroll
            for (int t = 0; t < TS_MT; ++t) {
                const int p = __reduce_add_sync(0xffffffffu, part[t]);
                acc[t] = __fmul_rn(ws[row], (float)p);
            }
        }
#pragma unroll
        for (int t = 0; t < TS_MT; ++t) {
            if (lane == 0 && t < mt) {
                y[(int64_t)(t0 + t) * n + row] = __fmul_rn(xs[t0 + t], acc[t]);
            }
        }
    }
}
