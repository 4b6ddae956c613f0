// Elementwise and row-wise ops of a Llama layer, f32 activations (the engine's compute type).
// Shapes are row-major; one CTA per row for the row-wise ops.

// Residual add fused with RMSNorm: h = x + r (written back to x when r is given), then
// out = h * rsqrt(mean(h^2) + eps) * w. r may be null (plain RMSNorm of x).
extern "C" __global__ void rms_norm_residual(float* x, const float* r, const float* w,
                                             float* out, int d, float eps) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    float* xr = x + row * d;
    const float* rr = r ? r + row * d : nullptr;
    float* o = out + row * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float h = xr[i];
        if (rr) { h += rr[i]; xr[i] = h; }
        ss += h * h;
    }
    ss = ts_block_sum(ss, scratch);
    const float scale = rsqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = xr[i] * scale * w[i];
}

// Rotary embedding, HF rotate-half pairs (i, i + half) for the first 2*half dims of each head.
// x: [tokens, heads * head_dim]; sin_cos: [tokens, half] pairs (sin, cos) computed on the host
// in the same precision as the CPU path. Grid (tokens), block over heads * half pairs.
extern "C" __global__ void rope_rotate_half(float* x, const float2* sin_cos, int heads,
                                            int head_dim, int half) {
    const int64_t t = blockIdx.x;
    float* xt = x + t * (int64_t)heads * head_dim;
    const float2* sc = sin_cos + t * half;
    for (int k = threadIdx.x; k < heads * half; k += blockDim.x) {
        const int h = k / half, i = k % half;
        float* p = xt + h * head_dim;
        const float2 s = sc[i];
        const float u = p[i], v = p[i + half];
        p[i] = u * s.y - v * s.x;
        p[i + half] = u * s.x + v * s.y;
    }
}

// SwiGLU: out[i] = silu(gate[i]) * up[i] over `n` values (gate, up and out all [rows, width]).
extern "C" __global__ void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float a = gate[i];
        out[i] = a / (1.0f + expf(-a)) * up[i];
    }
}

// Greedy sampling: per row of logits [rows, n], the index of the largest value, lowest index on
// ties (as the CPU sampler). NaN is never the maximum. One CTA (blockDim a power of two) per row.
extern "C" __global__ void argmax_rows(const float* logits, int n, int* out) {
    __shared__ float best_v[1024];
    __shared__ int best_i[1024];
    const int64_t row = blockIdx.x;
    const float* l = logits + row * n;
    float bv = -TS_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = l[i];
        if (v > bv) { bv = v; bi = i; }
    }
    best_v[threadIdx.x] = bv;
    best_i[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float ov = best_v[threadIdx.x + s];
            const int oi = best_i[threadIdx.x + s];
            if (ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
                best_v[threadIdx.x] = ov;
                best_i[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[row] = best_i[0] == 0x7fffffff ? 0 : best_i[0];
}
