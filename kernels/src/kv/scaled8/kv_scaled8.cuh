#line 2 "kv/scaled8/kv_scaled8.cuh"
// 8-bit KV pages (FP8 E4M3, int8) on the GPU, as kernels/src/kv/scaled8/ lays them out:
//   dynamic: [f32 scale, LE][head_dim bytes]   (scale = absmax / 448 or / 127)
//   static:  [head_dim bytes]                  (scale = the layer's k/v scale)
// Its codes TS_KV_FP8, TS_KV_FP8_STATIC, TS_KV_INT8 and TS_KV_INT8_STATIC are defined ahead of it
// by the registry (Rust: kernels/src/kv/scaled8/cuda.rs, which names ts_kv_scaled8_load and
// ts_kv_scaled8_encode).

// Whether the records store their own scale (a 4-byte header).
__device__ __forceinline__ bool ts_kv_dynamic_scale(int fmt) {
    return fmt == TS_KV_FP8 || fmt == TS_KV_INT8;
}

// E4M3 byte to float, as the CPU table: NaN bytes (0x7F, 0xFF) read as 0.
__device__ __forceinline__ float ts_e4m3_to_f32(uint32_t b) {
    const uint32_t e = (b >> 3) & 15u, m = b & 7u;
    if (e == 15u && m == 7u) return 0.0f;
    const float v = e == 0u ? (float)m * (1.0f / 512.0f) : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -v : v;
}

// Float to E4M3 exactly as the CPU (e4m3::f32_to_e4m3): round to nearest even, saturate at
// +-448, NaN to 0x7F. Written out rather than cuda_fp8's conversion so the bytes provably match.
__device__ __forceinline__ uint8_t ts_f32_to_e4m3(float x) {
    if (x != x) return 0x7F;
    const uint32_t sign = (__float_as_uint(x) >> 24) & 0x80u;
    const float a = fminf(fabsf(x), 448.0f);
    if (a < 1.0f / 64.0f) return (uint8_t)(sign | (uint32_t)rintf(a * 512.0f));
    const uint32_t bits = __float_as_uint(a);
    int exp = (int)((bits >> 23) & 0xFFu) - 127;
    const uint32_t mant = bits & 0x7FFFFFu, rem = mant & 0xFFFFFu;
    uint32_t m = mant >> 20;
    if (rem > 0x80000u || (rem == 0x80000u && (m & 1u))) m++;
    if (m == 8u) { m = 0u; exp++; }
    return (uint8_t)(sign | ((uint32_t)(exp + 7) << 3) | m);
}

// Float to int8 as the CPU: round half away from zero, clamp to [-127, 127], NaN to 0.
__device__ __forceinline__ uint8_t ts_f32_to_i8(float x) {
    if (x != x) return 0;
    const float r = fminf(fmaxf(roundf(x), -127.0f), 127.0f);
    return (uint8_t)(int8_t)(int)r;
}

__device__ __forceinline__ float ts_i8_byte(uint32_t w, int i) { return (float)(int8_t)(uint8_t)(w >> (8 * i)); }

// ELEMS values of one 8-bit record starting at dim d0, as floats with the scale applied
// (attention's ts_load_row). Records are 4-byte aligned (the launcher checks).
template <int FMT, int ELEMS>
__device__ __forceinline__ void ts_kv_scaled8_load(const uint8_t* rec, int d0, float static_scale, float* out) {
    float s = static_scale;
    const uint8_t* e = rec;
    if constexpr (FMT == TS_KV_FP8 || FMT == TS_KV_INT8) {
        s = *reinterpret_cast<const float*>(rec);
        e = rec + 4;
    }
    const uint32_t* p = reinterpret_cast<const uint32_t*>(e + d0);
#pragma unroll
    for (int i = 0; i < ELEMS / 4; i++) {
        const uint32_t w = p[i];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if constexpr (FMT == TS_KV_FP8 || FMT == TS_KV_FP8_STATIC) {
                out[4 * i + j] = ts_e4m3_to_f32((w >> (8 * j)) & 0xFFu) * s;
            } else {
                out[4 * i + j] = ts_i8_byte(w, j) * s;
            }
        }
    }
}

// Writes one record from x (head_dim floats) if fmt is an 8-bit format, the warp's lanes striding
// over the dims (kv_append's ts_encode_row); false for other formats.
__device__ __forceinline__ bool ts_kv_scaled8_encode(const float* __restrict__ x, uint8_t* rec, int fmt, int head_dim,
                                                     float static_scale, int lane) {
    if (fmt != TS_KV_FP8 && fmt != TS_KV_FP8_STATIC && fmt != TS_KV_INT8 && fmt != TS_KV_INT8_STATIC) return false;
    const bool fp8 = fmt == TS_KV_FP8 || fmt == TS_KV_FP8_STATIC;
    float s = static_scale;
    uint8_t* e = rec;
    if (ts_kv_dynamic_scale(fmt)) {
        // absmax as the CPU folds it: max(acc, |v|) from 0, NaN ignored (fmaxf does the same).
        float amax = 0.0f;
        for (int d = lane; d < head_dim; d += TS_WARP) amax = fmaxf(amax, fabsf(x[d]));
        amax = ts_warp_max(amax);
        s = amax > 0.0f && amax < TS_INF ? amax / (fp8 ? 448.0f : 127.0f) : 1.0f;
        if (lane == 0) *reinterpret_cast<float*>(rec) = s;
        e = rec + 4;
    }
    const float inv = 1.0f / s;
    for (int d = lane; d < head_dim; d += TS_WARP) {
        const float y = x[d] * inv;
        e[d] = fp8 ? ts_f32_to_e4m3(y) : ts_f32_to_i8(y);
    }
    return true;
}
