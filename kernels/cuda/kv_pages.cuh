#line 2 "kv_pages.cuh"
// KV-cache pages as the CPU codecs lay them out, shared by the paged attention and KV append
// kernels. Included ahead of attention.cu and kv_append.cu, after the TS_KV_* codes and each
// format's header (conversions, record load and store), which lives in the format's folder
// (kernels/src/kv/plain/kv_plain.cuh, kernels/src/kv/scaled8/kv_scaled8.cuh); the record size
// and the load/store dispatch after it are generated from the registry (kernels/src/cuda/kv_source.rs).
//
// A block of the pool holds, per layer, a K region then a V region; each region is n_kv_heads
// pages of page_bytes bytes, one per KV head; a page is block_size records in token order, each
// in its format's layout (described in the format's header).

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
