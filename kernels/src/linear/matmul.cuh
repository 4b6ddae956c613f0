// The tile shape every weight format's matmul kernel (linear/<format>/linear_<format>.cu) is
// launched with; linear/cuda.rs sizes the grid from the same numbers (TOKENS_PER_CTA,
// WARPS_PER_CTA) and from the format's rows per warp (TS_RW, defined by each kernel source):
// grid = (ceil(N / (TS_WARPS * TS_RW)), ceil(m / TS_MT)) CTAs of TS_WARPS warps.
// Each format's cuda.rs concatenates this header before its source. Also the int8-activation
// dot step the W4A8 and W8A8 int8 kernels share.

#define TS_MT 8
#define TS_WARPS 8

// The int8-activation kernels' inner step (W4A8, W8A8 int8): for the tile's first mt tokens,
// part[t] += the exact int32 dot (dp4a) of the 4 signed weight bytes w with activation columns
// c..c+3 of token t, where token t's int8 activations start at xq + t·k.
template <int MT>
__device__ __forceinline__ void ts_dp4a_tokens(int (&part)[MT], int w, const uint8_t* xq, int k, int c, int mt) {
#pragma unroll
    for (int t = 0; t < MT; ++t) {
        if (t < mt) {
            const uint32_t a = *reinterpret_cast<const uint32_t*>(xq + (int64_t)t * k + c);
            part[t] = __dp4a(w, (int)a, part[t]);
        }
    }
}
