#line 2 "attention.cu"
// Paged decode attention for one layer: one query token per sequence against its cached K/V,
// read in place from the byte pool (kv_pages.cuh layout), flash-decoding style.
//
// Specialized by HEAD_DIM (64 or 128), K_FMT and V_FMT (TS_KV_* codes; ts_load_row, generated
// from the registry, picks the format's own load; alignment the launcher guarantees: plain records
// 8-byte aligned, 8-bit records 4-byte aligned). Grid:
//   x = sequence, y = KV head x head chunk (chunks of up to TS_GMAX query heads of the KV head's
//   group, so each K/V element is loaded once per chunk), z = split (a token range).
// A CTA of TS_THREADS threads splits into sub-groups of TS_TPT lanes; a sub-group takes one token
// at a time, each lane TS_ELEMS consecutive dims. Scores and the softmax are fp32 with an online
// (running max, running sum) update; sub-groups are merged in shared memory at the end. With one
// split the CTA writes the output; otherwise it writes (o, m, l) partials that
// paged_attention_merge combines. Positions >= seq_len are never read (masking by skipping), so
// unused slots and pages may hold anything, NaN included.

#if !defined(HEAD_DIM) || !defined(K_FMT) || !defined(V_FMT)
#error "attention.cu needs HEAD_DIM, K_FMT and V_FMT"
#endif
#if HEAD_DIM != 64 && HEAD_DIM != 128
#error "HEAD_DIM must be 64 or 128"
#endif

#define TS_ELEMS 8
#define TS_TPT (HEAD_DIM / TS_ELEMS)
#define TS_THREADS 128
#define TS_SUBS (TS_THREADS / TS_TPT)
#define TS_GMAX 8

extern "C" __global__ void __launch_bounds__(TS_THREADS)
paged_decode_attention(const float* __restrict__ q, const uint8_t* __restrict__ pool,
                       const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                       const TsKvLayer L, int n_heads, int max_blocks, int64_t pool_blocks,
                       int head_chunks, int tokens_per_split, int n_splits,
                       float* __restrict__ out, float* __restrict__ part_o,
                       float* __restrict__ part_ml) {
    __shared__ float s_q[TS_GMAX][HEAD_DIM];
    __shared__ float s_m[TS_SUBS][TS_GMAX];
    __shared__ float s_l[TS_SUBS][TS_GMAX];
    __shared__ float s_acc[TS_SUBS][TS_GMAX][HEAD_DIM];

    const int seq = blockIdx.x;
    const int kvh = blockIdx.y / head_chunks;
    const int chunk = blockIdx.y % head_chunks;
    const int split = blockIdx.z;
    const int group = n_heads / L.n_kv_heads;
    const int g0 = chunk * TS_GMAX;
    const int gc = min(TS_GMAX, group - g0);
    const int h0 = kvh * group + g0;  // first query head of this CTA

    // Tokens [t_begin, t_end) of this split; the last split runs to seq_len whatever the plan,
    // so an underestimated plan costs time, never tokens.
    const int len = min(seq_lens[seq], max_blocks * L.block_size);
    const int t_begin = split * tokens_per_split;
    const int t_end = split == n_splits - 1 ? len : min(len, t_begin + tokens_per_split);

    for (int i = threadIdx.x; i < gc * HEAD_DIM; i += TS_THREADS)
        s_q[i / HEAD_DIM][i % HEAD_DIM] = q[((int64_t)seq * n_heads + h0) * HEAD_DIM + i];
    __syncthreads();

    const int sub = threadIdx.x / TS_TPT;
    const int d0 = (threadIdx.x % TS_TPT) * TS_ELEMS;
    const float scale = 1.0f / sqrtf((float)HEAD_DIM);
    const int64_t k_rec = ts_kv_record_bytes(K_FMT, HEAD_DIM);
    const int64_t v_rec = ts_kv_record_bytes(V_FMT, HEAD_DIM);
    const int* table = block_tables + (int64_t)seq * max_blocks;

    float m[TS_GMAX], l[TS_GMAX], acc[TS_GMAX][TS_ELEMS];
#pragma unroll
    for (int g = 0; g < TS_GMAX; g++) {
        m[g] = -TS_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < TS_ELEMS; i++) acc[g][i] = 0.0f;
    }

    // Every thread runs the same number of iterations (the shuffles below need whole warps);
    // a sub-group past the end only skips its loads and updates.
    for (int base = t_begin; base < t_end; base += TS_SUBS) {
        const int t = base + sub;
        bool valid = t < t_end;
        float k[TS_ELEMS], v[TS_ELEMS];
        if (valid) {
            const int64_t blk = table[t / L.block_size];
            valid = blk >= 0 && blk < pool_blocks;  // out-of-range ids are never dereferenced
            if (valid) {
                const int64_t slot = t % L.block_size;
                const uint8_t* b = pool + blk * L.block_bytes;
                ts_load_row<K_FMT, TS_ELEMS>(b + L.k_offset + kvh * L.k_page_bytes + slot * k_rec, d0, L.k_scale, k);
                ts_load_row<V_FMT, TS_ELEMS>(b + L.v_offset + kvh * L.v_page_bytes + slot * v_rec, d0, L.v_scale, v);
            }
        }
#pragma unroll
        for (int g = 0; g < TS_GMAX; g++) {
            if (g >= gc) break;  // gc is uniform over the CTA
            float dot = 0.0f;
            if (valid) {
#pragma unroll
                for (int i = 0; i < TS_ELEMS; i++) dot = fmaf(s_q[g][d0 + i], k[i], dot);
            }
#pragma unroll
            for (int o = TS_TPT / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
            if (!valid) continue;
            const float s = dot * scale;
            if (s > m[g]) {
                const float c = expf(m[g] - s);  // expf(-inf) = 0 on the first key
                l[g] = l[g] * c + 1.0f;
#pragma unroll
                for (int i = 0; i < TS_ELEMS; i++) acc[g][i] = fmaf(acc[g][i], c, v[i]);
                m[g] = s;
            } else {
                const float p = expf(s - m[g]);
                l[g] += p;
#pragma unroll
                for (int i = 0; i < TS_ELEMS; i++) acc[g][i] = fmaf(p, v[i], acc[g][i]);
            }
        }
    }

    // Merge the sub-groups: every lane of a sub-group holds the same (m, l).
#pragma unroll
    for (int g = 0; g < TS_GMAX; g++) {
        if (g >= gc) break;
        if (d0 == 0) {
            s_m[sub][g] = m[g];
            s_l[sub][g] = l[g];
        }
#pragma unroll
        for (int i = 0; i < TS_ELEMS; i++) s_acc[sub][g][d0 + i] = acc[g][i];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < gc * HEAD_DIM; i += TS_THREADS) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        float mx = -TS_INF;
        for (int s = 0; s < TS_SUBS; s++) mx = fmaxf(mx, s_m[s][g]);
        float o = 0.0f, sum = 0.0f;
        if (mx > -TS_INF) {
            for (int s = 0; s < TS_SUBS; s++) {
                if (s_m[s][g] == -TS_INF) continue;  // a sub-group that saw no token
                const float w = expf(s_m[s][g] - mx);
                o = fmaf(w, s_acc[s][g][d], o);
                sum = fmaf(w, s_l[s][g], sum);
            }
        }
        const int64_t row = (int64_t)seq * n_heads + h0 + g;
        if (n_splits == 1) {
            out[row * HEAD_DIM + d] = sum > 0.0f ? o / sum : 0.0f;
        } else {
            const int64_t at = row * n_splits + split;
            part_o[at * HEAD_DIM + d] = o;
            if (d == 0) {
                part_ml[2 * at] = mx;
                part_ml[2 * at + 1] = sum;
            }
        }
    }
}

// Combines the splits' partials of each (sequence, head) row: out = sum_s e^(m_s - M) o_s /
// sum_s e^(m_s - M) l_s over splits that saw a token; rows with no token get 0. Grid (rows).
extern "C" __global__ void __launch_bounds__(HEAD_DIM)
paged_attention_merge(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                      int n_splits, float* __restrict__ out) {
    const int64_t row = blockIdx.x;
    const int d = threadIdx.x;
    const float* ml = part_ml + row * n_splits * 2;
    float mx = -TS_INF;
    for (int s = 0; s < n_splits; s++) mx = fmaxf(mx, ml[2 * s]);
    float o = 0.0f, sum = 0.0f;
    if (mx > -TS_INF) {
        for (int s = 0; s < n_splits; s++) {
            if (ml[2 * s] == -TS_INF) continue;
            const float w = expf(ml[2 * s] - mx);
            o = fmaf(w, part_o[(row * n_splits + s) * HEAD_DIM + d], o);
            sum = fmaf(w, ml[2 * s + 1], sum);
        }
    }
    out[row * HEAD_DIM + d] = sum > 0.0f ? o / sum : 0.0f;
}
