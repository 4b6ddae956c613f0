#line 2 "kv/plain/kv_plain.cuh"
// Plain KV pages (f32, bf16, f16) on the GPU, as kernels/src/kv/plain/ lays them out: a record
// is head_dim values (little-endian), no header; a checkpoint's static scale does not apply.
// Its codes TS_KV_F32, TS_KV_BF16 and TS_KV_F16 are defined ahead of it by the registry (Rust:
// kernels/src/kv/plain/cuda.rs, which names ts_kv_plain_load and ts_kv_plain_encode).

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

// ELEMS values of one plain record starting at dim d0, as floats (attention's ts_load_row; no
// scale applies). Records are 8-byte aligned (the launcher checks).
template <int FMT, int ELEMS>
__device__ __forceinline__ void ts_kv_plain_load(const uint8_t* rec, int d0, float static_scale, float* out) {
    if constexpr (FMT == TS_KV_F32) {
        const float2* p = reinterpret_cast<const float2*>(rec + 4 * d0);
#pragma unroll
        for (int i = 0; i < ELEMS / 2; i++) {
            const float2 v = p[i];
            out[2 * i] = v.x;
            out[2 * i + 1] = v.y;
        }
    } else {
        const uint2* p = reinterpret_cast<const uint2*>(rec + 2 * d0);
#pragma unroll
        for (int i = 0; i < ELEMS / 4; i++) {
            const uint2 w = p[i];
            if constexpr (FMT == TS_KV_BF16) {
                out[4 * i] = ts_bf16_lo(w.x);
                out[4 * i + 1] = ts_bf16_hi(w.x);
                out[4 * i + 2] = ts_bf16_lo(w.y);
                out[4 * i + 3] = ts_bf16_hi(w.y);
            } else {
                out[4 * i] = ts_f16_lo(w.x);
                out[4 * i + 1] = ts_f16_hi(w.x);
                out[4 * i + 2] = ts_f16_lo(w.y);
                out[4 * i + 3] = ts_f16_hi(w.y);
            }
        }
    }
}

// Writes one record from x (head_dim floats) if fmt is a plain format, the warp's lanes striding
// over the dims (kv_append's ts_encode_row); false for other formats.
__device__ __forceinline__ bool ts_kv_plain_encode(const float* __restrict__ x, uint8_t* rec, int fmt, int head_dim,
                                                   float static_scale, int lane) {
    if (fmt == TS_KV_F32) {
        float* o = reinterpret_cast<float*>(rec);
        for (int d = lane; d < head_dim; d += TS_WARP) o[d] = x[d];
        return true;
    }
    if (fmt == TS_KV_BF16 || fmt == TS_KV_F16) {
        uint16_t* o = reinterpret_cast<uint16_t*>(rec);
        for (int d = lane; d < head_dim; d += TS_WARP)
            o[d] = fmt == TS_KV_BF16 ? ts_f32_to_bf16_bits(x[d]) : ts_f32_to_f16_bits(x[d]);
        return true;
    }
    return false;
}
