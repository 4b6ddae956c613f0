// The tile shape every weight format's matmul kernel (linear/<format>/linear_<format>.cu) is
// launched with; linear/cuda.rs sizes the grid from the same numbers (TOKENS_PER_CTA,
// WARPS_PER_CTA) and from the format's rows per warp (TS_RW, defined by each kernel source):
// grid = (ceil(N / (TS_WARPS * TS_RW)), ceil(m / TS_MT)) CTAs of TS_WARPS warps.
// Each format's cuda.rs concatenates this header before its source.

#define TS_MT 8
#define TS_WARPS 8
