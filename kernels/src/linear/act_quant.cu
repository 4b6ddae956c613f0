// Dynamic per-token activation quantization, bit-identical to linear/act.rs:
// - int8: scale = absmax / 127 (NaN ignored), q = round_half_even(x / scale) clamped to ±127,
//   NaN quotients to 0; an all-zero row gets scale 0 and zero codes.
// - FP8 E4M3, per token and block of `bw` columns: scale = absmax / 448, code = e4m3(x / scale)
//   rounded to nearest even and saturated to ±448 (NaN stays NaN); a zero block gets scale 0
//   and zero codes.
// Every division is IEEE round-to-nearest (__fdiv_rn), as Rust's `/`.

#define TS_ACT_THREADS 256

// x: [m, k] f32; q: [m, k] int8; scales: [m]. Grid (m), block TS_ACT_THREADS.
extern "C" __global__ void __launch_bounds__(TS_ACT_THREADS)
quantize_int8_rows(const float* x, int k, int8_t* q, float* scales) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const float* xr = x + row * k;
    int8_t* qr = q + row * k;
    float amax = 0.0f;
    for (int i = threadIdx.x; i < k; i += blockDim.x) amax = fmaxf(amax, fabsf(xr[i]));
    amax = ts_block_max(amax, scratch);
    const float scale = __fdiv_rn(amax, 127.0f);
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        int v = 0;
        if (scale != 0.0f) {
            const float r = rintf(__fdiv_rn(xr[i], scale));
            v = r != r ? 0 : (int)fminf(fmaxf(r, -127.0f), 127.0f);
        }
        qr[i] = (int8_t)v;
    }
    if (threadIdx.x == 0) scales[row] = scale;
}

// x: [m, k] f32; q: [m, k] E4M3 bytes; scales: [m, ceil(k / bw)]. Grid (ceil(k / bw), m),
// block TS_ACT_THREADS: one CTA per (token, column block).
extern "C" __global__ void __launch_bounds__(TS_ACT_THREADS)
quantize_fp8_rows(const float* x, int k, int bw, uint8_t* q, float* scales) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.y;
    const int b = blockIdx.x, nb = gridDim.x;
    const int c0 = b * bw, c1 = min(k, c0 + bw);
    const float* xr = x + row * k;
    uint8_t* qr = q + row * k;
    float amax = 0.0f;
    for (int i = c0 + threadIdx.x; i < c1; i += blockDim.x) amax = fmaxf(amax, fabsf(xr[i]));
    amax = ts_block_max(amax, scratch);
    const float scale = __fdiv_rn(amax, 448.0f);
    for (int i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
        qr[i] = scale == 0.0f ? (uint8_t)0
                              : (uint8_t)__nv_cvt_float_to_fp8(__fdiv_rn(xr[i], scale), __NV_SATFINITE, __NV_E4M3);
    }
    if (threadIdx.x == 0) scales[row * nb + b] = scale;
}
