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

// W8A8 int8 on ts_group_rows, with one group spanning the row: its scaled sum is the result.
struct Int8Groups : TsInt8Act {
    const uint8_t* wq;
    const float* ws;

    __device__ __forceinline__ int begin_group(int, int) const {
        return 0;
    }

    __device__ __forceinline__ void step(int (&part)[TS_MT], const uint8_t* xq, int row, int c, int) const {
        dot4(part, (int)*reinterpret_cast<const uint32_t*>(wq + (int64_t)row * k + c), xq, c);
    }

    __device__ __forceinline__ float fold(float, int p, int row, int, int) const {
        return __fmul_rn(ws[row], (float)p);
    }
};

extern "C" __global__ void __launch_bounds__(TS_WARPS * 32)
quant_matmul(const uint8_t* wq, const float* ws, const int8_t* wz, const void* xa, const float* xs,
             float* y, int n, int k, int m, int group, int bh) {
    (void)wz;
    (void)bh;
    TsTile tile;
    if (!ts_tile<TS_RW>(n, m, tile)) return;
    Int8Groups f;
    f.xs = xs; f.k = k; f.t0 = tile.t0; f.mt = tile.mt;
    f.wq = wq; f.ws = ws;
    ts_group_rows(f, tile, xa, y, n, k, group);
}
