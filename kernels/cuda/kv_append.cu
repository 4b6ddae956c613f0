#line 2 "kv_append.cu"
// Writes new tokens' K and V rows into the paged pool in the layer's formats (kv_pages.cuh),
// byte for byte as the CPU codecs encode them. k and v are [tokens, n_kv_heads, head_dim] f32;
// token i goes to slot slot_mapping[i] = block * block_size + offset. Negative slots (padding)
// and slots whose block is outside the pool are skipped. Formats are kernel arguments (TS_KV_*):
// the kernel is tiny and memory bound. Grid (tokens, n_kv_heads), 64 threads: warp 0 writes K,
// warp 1 writes V.

__device__ __forceinline__ void ts_encode_row(const float* __restrict__ x, uint8_t* rec, int fmt,
                                              int head_dim, float static_scale, int lane) {
    if (fmt == TS_KV_F32) {
        float* o = reinterpret_cast<float*>(rec);
        for (int d = lane; d < head_dim; d += TS_WARP) o[d] = x[d];
        return;
    }
    if (fmt == TS_KV_BF16 || fmt == TS_KV_F16) {
        uint16_t* o = reinterpret_cast<uint16_t*>(rec);
        for (int d = lane; d < head_dim; d += TS_WARP)
            o[d] = fmt == TS_KV_BF16 ? ts_f32_to_bf16_bits(x[d]) : ts_f32_to_f16_bits(x[d]);
        return;
    }
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
}

extern "C" __global__ void __launch_bounds__(64)
kv_append(const float* __restrict__ k, const float* __restrict__ v,
          const int* __restrict__ slot_mapping, uint8_t* __restrict__ pool, const TsKvLayer L,
          int head_dim, int k_fmt, int v_fmt, int64_t pool_blocks) {
    const int64_t token = blockIdx.x;
    const int head = blockIdx.y;
    const int slot = slot_mapping[token];
    if (slot < 0) return;
    const int64_t blk = slot / L.block_size;
    if (blk >= pool_blocks) return;
    const int64_t off = slot % L.block_size;
    const int warp = threadIdx.x / TS_WARP, lane = threadIdx.x % TS_WARP;
    const int64_t row = (token * L.n_kv_heads + head) * head_dim;
    uint8_t* b = pool + blk * L.block_bytes;
    if (warp == 0) {
        uint8_t* rec = b + L.k_offset + head * L.k_page_bytes + off * ts_kv_record_bytes(k_fmt, head_dim);
        ts_encode_row(k + row, rec, k_fmt, head_dim, L.k_scale, lane);
    } else {
        uint8_t* rec = b + L.v_offset + head * L.v_page_bytes + off * ts_kv_record_bytes(v_fmt, head_dim);
        ts_encode_row(v + row, rec, v_fmt, head_dim, L.v_scale, lane);
    }
}
