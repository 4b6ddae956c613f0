#line 2 "kv_append.cu"
// Writes new tokens' K and V rows into the paged pool in the layer's formats (kv_pages.cuh),
// byte for byte as the CPU codecs encode them. k and v are [tokens, n_kv_heads, head_dim] f32;
// token i goes to slot slot_mapping[i] = block * block_size + offset. Negative slots (padding)
// and slots whose block is outside the pool are skipped. Formats are kernel arguments (TS_KV_*;
// ts_encode_row, generated from the registry, calls each format's own store):
// the kernel is tiny and memory bound. Grid (tokens, n_kv_heads), 64 threads: warp 0 writes K,
// warp 1 writes V.

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
