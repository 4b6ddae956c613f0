// W4A16: y[m, n] = x[m, k] . W[n, k]^T with W in Tessera's int4 layout (kernels/src/quant/int4.rs):
// per row, each run of 32 columns is 16 bytes, byte j holding column j in its low nibble and
// column j + 16 in its high nibble, as q + 8; W[r, c] = (q - z[r, g]) * s[r, g], g = c / group
// (group a multiple of 32, so a run never straddles groups). f32 activations and math.
//
// One warp per output row, lane l takes runs l, l+32, ...; per run the lane forms
// sum_j (q_j - z) x_j and adds s * sum; a token's result has the same order whatever m is.

#define RUN 32
#define ROWS_PER_PASS 8

extern "C" __global__ void int4_matmul(const uint8_t* packed, const float* scales, const int8_t* zeros,
                                       const float* x, float* y, int n, int k, int m, int group) {
    const int row = (int)((blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / TS_WARP);
    const int lane = threadIdx.x % TS_WARP;
    if (row >= n) return;
    const int runs = k / RUN;
    const int groups = (k + group - 1) / group;
    const uint8_t* wr = packed + (int64_t)row * (k / 2);
    const float* sr = scales + (int64_t)row * groups;
    const int8_t* zr = zeros ? zeros + (int64_t)row * groups : nullptr;
    for (int t0 = 0; t0 < m; t0 += ROWS_PER_PASS) {
        float acc[ROWS_PER_PASS];
#pragma unroll
        for (int t = 0; t < ROWS_PER_PASS; t++) acc[t] = 0.0f;
        for (int r = lane; r < runs; r += TS_WARP) {
            const int g = r * RUN / group;
            const int z = zr ? (int)zr[g] : 0;
            const float s = sr[g];
            const uint4 bytes = *(const uint4*)(wr + (int64_t)r * 16);
            const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
            float w[RUN];
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const uint32_t b = (words[j / 4] >> (8 * (j % 4))) & 0xFF;
                w[j] = (float)((int)(b & 0x0F) - 8 - z);
                w[j + 16] = (float)((int)(b >> 4) - 8 - z);
            }
#pragma unroll
            for (int t = 0; t < ROWS_PER_PASS; t++) {
                if (t0 + t < m) {
                    const float* xr = x + (int64_t)(t0 + t) * k + r * RUN;
                    float part = 0.0f;
#pragma unroll
                    for (int j = 0; j < RUN; j++) part += w[j] * xr[j];
                    acc[t] += s * part;
                }
            }
        }
#pragma unroll
        for (int t = 0; t < ROWS_PER_PASS; t++) {
            const float v = ts_warp_sum(acc[t]);
            if (lane == 0 && t0 + t < m) y[(int64_t)(t0 + t) * n + row] = v;
        }
    }
}
