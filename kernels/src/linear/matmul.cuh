// The skeleton every weight format's matmul kernel (linear/<format>/linear_<format>.cu) is built
// on: the tile shape it is launched with, the warp's share of the output (ts_tile), and the two
// loops the formats instantiate with their own weight decoding (ts_run_tile: several rows per
// warp over 32-column runs, f32 activations; ts_group_rows: one row at a time, group by group
// over 4-column units, quantized activations). Each format's cuda.rs concatenates this header
// before its source.
//
// linear/cuda.rs sizes the grid from the same numbers (TOKENS_PER_CTA, WARPS_PER_CTA) and from
// the format's rows per warp (TS_RW, defined by each kernel source):
// grid = (ceil(N / (TS_WARPS * TS_RW)), ceil(m / TS_MT)) CTAs of TS_WARPS warps.

#define TS_MT 8
#define TS_WARPS 8

// A warp's share of y [m, n]: rows row0..row0+nr (nr <= RW) for tokens t0..t0+mt of its grid
// row, and the warp's lane.
struct TsTile {
    int lane, row0, nr, t0, mt;
};

// The calling warp's tile for RW rows per warp; false when the warp has no rows (whole warps
// leave; no CTA-wide barrier follows in any matmul kernel).
template <int RW>
__device__ __forceinline__ bool ts_tile(int n, int m, TsTile& tile) {
    tile.lane = threadIdx.x % 32;
    tile.row0 = (blockIdx.x * TS_WARPS + threadIdx.x / 32) * RW;
    if (tile.row0 >= n) return false;
    tile.nr = min(RW, n - tile.row0);
    tile.t0 = blockIdx.y * TS_MT;
    tile.mt = min(TS_MT, m - tile.t0);
    return true;
}

// Several rows per warp over f32 activations x (the tile's first token at x, k per token): each
// lane takes a 32-column run of all RW rows (rows past the end repeat the last row, in bounds;
// their sums are not stored), loads them together (RW independent loads in flight), then
// dequantizes 8 values at a time and dots them with every token of the tile, so each activation
// value read serves RW rows; the warp reduces and stores y. The format F provides:
//   F::Run                          a run's loaded weight state (codes, scales)
//   load(Run&, row, run)            loads run `run` (columns 32·run..) of row `row`
//   chunk8(const Run&, c, w[8])     dequantizes values 8c..8c+8 of a loaded run
template <int RW, class F>
__device__ __forceinline__ void ts_run_tile(const F& f, const TsTile& tile, const float* x, float* y, int n, int k) {
    float acc[TS_MT][RW];
#pragma unroll
    for (int t = 0; t < TS_MT; ++t)
#pragma unroll
        for (int r = 0; r < RW; ++r) acc[t][r] = 0.0f;
    for (int run = tile.lane; run < k / 32; run += 32) {
        typename F::Run loaded[RW];
#pragma unroll
        for (int r = 0; r < RW; ++r) f.load(loaded[r], tile.row0 + min(r, tile.nr - 1), run);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float w[RW][8];
#pragma unroll
            for (int r = 0; r < RW; ++r) f.chunk8(loaded[r], c, w[r]);
            ts_tile_dot8<TS_MT, RW>(acc, w, x + run * 32 + c * 8, k, tile.mt);
        }
    }
    ts_tile_store<TS_MT, RW>(acc, y, n, tile.t0, tile.mt, tile.row0, tile.nr);
}

// Sums of a partial over the warp's 32 lanes: exact for int32, by shuffles for f32.
__device__ __forceinline__ int ts_lanes_sum(int v) {
    return __reduce_add_sync(0xffffffffu, v);
}
__device__ __forceinline__ float ts_lanes_sum(float v) {
    return ts_warp_sum(v);
}

// The warp's rows one after another over one-byte activations (W4A8, W8A8 int8, W8A8 FP8; xa
// holds k bytes per token, the tile's first token at xq): per row, group by group in order
// (`group` columns each, the last one may be short), lanes split a group into 4-column units and
// sum per token; each group's sums are reduced over the warp and folded into the token's f32
// accumulator; lane 0 stores each token's result. The format F provides:
//   F::Part                         a token's partial sum over a group (int or float)
//   begin_row(row)                  per-row setup
//   begin_group(row, g)             the group's own state, handed to each step (int4: its zero point)
//   step(part, xq, row, c, at)      part[t] += token t's dot with weight columns c..c+3 (t < mt)
//   fold(acc, p, row, g, t)         token t's accumulator after group g, whose warp sum is p
//   out(acc, t)                     token t's stored value from its accumulator
template <class F>
__device__ __forceinline__ void ts_group_rows(F& f, const TsTile& tile, const void* xa, float* y, int n, int k, int group) {
    const int ng = (k + group - 1) / group;
    for (int row = tile.row0; row < tile.row0 + tile.nr; ++row) {
        float acc[TS_MT];
#pragma unroll
        for (int t = 0; t < TS_MT; ++t) acc[t] = 0.0f;
        const uint8_t* xq = reinterpret_cast<const uint8_t*>(xa) + (int64_t)tile.t0 * k;
        f.begin_row(row);
        for (int g = 0; g < ng; ++g) {
            const int c0 = g * group, c1 = min(k, c0 + group);
            typename F::Part part[TS_MT];
#pragma unroll
            for (int t = 0; t < TS_MT; ++t) part[t] = 0;
            const auto at = f.begin_group(row, g);
            for (int c = c0 + 4 * tile.lane; c < c1; c += 4 * 32) f.step(part, xq, row, c, at);
#pragma unroll
            for (int t = 0; t < TS_MT; ++t) acc[t] = f.fold(acc[t], ts_lanes_sum(part[t]), row, g, t);
        }
#pragma unroll
        for (int t = 0; t < TS_MT; ++t) {
            if (tile.lane == 0 && t < tile.mt) {
                y[(int64_t)(tile.t0 + t) * n + row] = f.out(acc[t], t);
            }
        }
    }
}

// Per-token int8 activations (W4A8, W8A8 int8) with scales xs: exact int32 group sums by dp4a,
// and y = xs · acc, one rounding.
struct TsInt8Act {
    typedef int Part;
    const float* xs;
    int k, t0, mt;

    // part[t] += the exact int32 dot (dp4a) of the 4 signed weight bytes w with activation
    // columns c..c+3 of token t (whose int8 activations start at xq + t·k), for the tile's first
    // mt tokens.
    __device__ __forceinline__ void dot4(int (&part)[TS_MT], int w, const uint8_t* xq, int c) const {
#pragma unroll
        for (int t = 0; t < TS_MT; ++t) {
            if (t < mt) {
                const uint32_t a = *reinterpret_cast<const uint32_t*>(xq + (int64_t)t * k + c);
                part[t] = __dp4a(w, (int)a, part[t]);
            }
        }
    }

    // No per-row state by default.
    __device__ __forceinline__ void begin_row(int) {}

    __device__ __forceinline__ float out(float acc, int t) const {
        return __fmul_rn(xs[t0 + t], acc);
    }
};
