#line 2 "kv_pages.cuh"
// KV-cache pages as the CPU codecs lay them out (kernels/src/kv/plain/, scaled8/), shared by
// the paged attention and KV append kernels. Included ahead of attention.cu and kv_append.cu.
//
// A block of the pool holds, per layer, a K region then a V region; each region is n_kv_heads
// pages of page_bytes bytes, one per KV head; a page is block_size records in token order:
//   f32 / bf16 / f16:         head_dim values (little-endian)
//   fp8_e4m3 / int8:          [f32 scale, LE][head_dim bytes]   (scale = absmax / 448 or / 127)
//   fp8_e4m3 / int8, static:  [head_dim bytes]                  (scale = the layer's k/v scale)

// Format codes (Rust: each format's kernels/src/kv/<format>/cuda.rs, `KvCudaPage::code`).
#define TS_KV_F32 0
#define TS_KV_BF16 1
#define TS_KV_F16 2
#define TS_KV_FP8 3
#define TS_KV_FP8_STATIC 4
#define TS_KV_INT8 5
#define TS_KV_INT8_STATIC 6

// One layer's page layout (Rust: `KvLayerRaw`, same field order; sizes asserted on both sides).
struct TsKvLayer {
    int64_t block_bytes;   // bytes of one block (all layers)
    int64_t k_offset;      // this layer's K region inside a block
    int64_t v_offset;      // this layer's V region inside a block
    int64_t k_page_bytes;  // one KV head's K page
    int64_t v_page_bytes;  // one KV head's V page
    int32_t block_size;    // tokens per block
    int32_t n_kv_heads;
    float k_scale;         // static K scale (static 8-bit formats only)
    float v_scale;         // static V scale (static 8-bit formats only)
};
static_assert(sizeof(TsKvLayer) == 56, "TsKvLayer must match the Rust KvLayerRaw");

__device__ __forceinline__ bool ts_kv_dynamic_scale(int fmt) {
    return fmt == TS_KV_FP8 || fmt == TS_KV_INT8;
}

__device__ __forceinline__ int ts_kv_elem_bytes(int fmt) {
    return fmt == TS_KV_F32 ? 4 : (fmt == TS_KV_BF16 || fmt == TS_KV_F16) ? 2 : 1;
}

// Bytes of one token's record.
__device__ __forceinline__ int64_t ts_kv_record_bytes(int fmt, int head_dim) {
    return (int64_t)head_dim * ts_kv_elem_bytes(fmt) + (ts_kv_dynamic_scale(fmt) ? 4 : 0);
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

// Float to bf16 bits as the CPU (`half` crate): round to nearest even, NaN keeps its high
// mantissa bits with the quiet bit set.
__device__ __forceinline__ uint16_t ts_f32_to_bf16_bits(float x) {
    const uint32_t b = __float_as_uint(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x40u);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// Float to f16 bits as the CPU (`half` crate): IEEE round to nearest even (overflow to inf),
// NaN as sign | 0x7E00 | the top mantissa bits.
__device__ __forceinline__ uint16_t ts_f32_to_f16_bits(float x) {
    const uint32_t b = __float_as_uint(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)(((b >> 16) & 0x8000u) | 0x7E00u | ((b & 0x7FFFFFu) >> 13));
    return __half_as_ushort(__float2half_rn(x));
}

__device__ __forceinline__ float ts_bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float ts_bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
__device__ __forceinline__ float ts_f16_lo(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w & 0xFFFFu))); }
__device__ __forceinline__ float ts_f16_hi(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w >> 16))); }
__device__ __forceinline__ float ts_i8_byte(uint32_t w, int i) { return (float)(int8_t)(uint8_t)(w >> (8 * i)); }
