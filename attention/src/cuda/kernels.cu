// Device kernels of ScoutAttention, compiled at run time with NVRTC.
//
// NVRTC ships no cuda_fp16.h / cuda_bf16.h, so halves are kept as `unsigned short` and
// converted by hand. KV block layout (per KV head, as on the host): K transposed
// [head_dim][block_size], then V [block_size][head_dim]. Log-sum-exp is base 2 everywhere
// (`lse2`), like the CPU side, so partials merge without a base mix-up.

typedef unsigned short u16;

// NVRTC has no math.h: the constants we need, by bit pattern.
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float f16_to_f32(u16 h) {
    unsigned int sign = (h & 0x8000u) << 16;
    unsigned int exp = (h >> 10) & 0x1fu;
    unsigned int man = h & 0x3ffu;
    unsigned int bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            // Subnormal: normalise.
            int e = -1;
            do { man <<= 1; e++; } while ((man & 0x400u) == 0);
            bits = sign | ((unsigned int)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    return __uint_as_float(bits);
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40u);  // NaN stays NaN
    unsigned int rounding = 0x7fffu + ((x >> 16) & 1u);                     // nearest even
    return (u16)((x + rounding) >> 16);
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    unsigned int x = __float_as_uint(f);
    unsigned int sign = (x >> 16) & 0x8000u;
    int exp = (int)((x >> 23) & 0xffu) - 127 + 15;
    unsigned int man = x & 0x7fffffu;
    if (((x >> 23) & 0xffu) == 0xffu) return (u16)(sign | 0x7c00u | (man ? 0x200u : 0u));
    if (exp >= 31) return (u16)(sign | 0x7c00u);
    if (exp <= 0) {
        if (exp < -10) return (u16)sign;
        man |= 0x800000u;
        unsigned int shift = (unsigned int)(14 - exp);
        unsigned int half = man >> shift;
        unsigned int rem = man & ((1u << shift) - 1u);
        unsigned int mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1u))) half++;
        return (u16)(sign | half);
    }
    unsigned int half = sign | ((unsigned int)exp << 10) | (man >> 13);
    unsigned int rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) half++;
    return (u16)half;
}

// fp8 e4m3 (OCP, as CUDA's __nv_fp8_e4m3): bias 7, no infinities, S.1111.111 is NaN.
__device__ __forceinline__ float e4m3_to_f32(unsigned char c) {
    unsigned int sign = ((unsigned int)c & 0x80u) << 24;
    unsigned int exp = (c >> 3) & 0xfu;
    unsigned int man = c & 0x7u;
    if (exp == 0xfu && man == 0x7u) return __uint_as_float(sign | 0x7fc00000u);
    if (exp == 0) {
        // Subnormal: man / 8 * 2^-6, exact in f32.
        float v = (float)man * 0.001953125f;  // 2^-9
        return __uint_as_float(sign | __float_as_uint(v));
    }
    return __uint_as_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// dtype: 0 = f32, 1 = f16, 2 = bf16, 3 = int8, 4 = fp8 e4m3. The 8-bit types are codes of a
// per-token scale stored after the head block's V, which the caller applies.
__device__ __forceinline__ float load_kv(const unsigned char* p, long long i, int dtype) {
    if (dtype == 0) return ((const float*)p)[i];
    if (dtype == 3) return (float)((const signed char*)p)[i];
    if (dtype == 4) return e4m3_to_f32(p[i]);
    u16 h = ((const u16*)p)[i];
    return dtype == 1 ? f16_to_f32(h) : bf16_to_f32(h);
}

// Bytes of one stored element.
__device__ __forceinline__ int kv_elem_size(int dtype) {
    return dtype == 0 ? 4 : (dtype >= 3 ? 1 : 2);
}

__device__ __forceinline__ void store_kv(unsigned char* p, long long i, int dtype, float v) {
    if (dtype == 0) ((float*)p)[i] = v;
    else ((u16*)p)[i] = dtype == 1 ? f32_to_f16(v) : f32_to_bf16(v);
}

// Largest head_dim of the per-head kernels (the attention kernel's MAX_D).
#define MAX_HEAD 128

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Quest scores of one (sequence, layer, KV head): one thread per block.
// scores[b] = sum_g sum_d max(q[g][d] * min[b][d], q[g][d] * max[b][d]); unscaled, f32.
extern "C" __global__ void quest_scores(const float* q, const float* dmin, const float* dmax,
                                        int num_blocks, int group, int head_dim, float* scores) {
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= num_blocks) return;
    const float* lo = dmin + (long long)b * head_dim;
    const float* hi = dmax + (long long)b * head_dim;
    float s = 0.f;
    for (int g = 0; g < group; g++) {
        const float* qg = q + g * head_dim;
        for (int d = 0; d < head_dim; d++) s += fmaxf(qg[d] * lo[d], qg[d] * hi[d]);
    }
    scores[b] = s;
}

// Merges partial (out_b, lse2_b) into (out_a, lse2_a), in place; empty partials are no-ops.
extern "C" __global__ void lse2_merge(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                                      int heads, int head_dim) {
    int h = blockIdx.x;
    if (h >= heads) return;
    float la = lse_a[h], lb = lse_b[h];
    if (lb == NEG_INF) return;
    float wa = 0.f, wb = 1.f, lse = lb;
    if (la != NEG_INF) {
        float mx = fmaxf(la, lb);
        float ea = exp2f(la - mx), eb = exp2f(lb - mx);
        wa = ea / (ea + eb);
        wb = eb / (ea + eb);
        lse = mx + log2f(ea + eb);
    }
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        long long i = (long long)h * head_dim + c;
        out_a[i] = out_a[i] * wa + out_b[i] * wb;
    }
    __syncthreads();
    if (threadIdx.x == 0) lse_a[h] = lse;
}

// Sum of every thread's `v` over the CUDA block, in `red` (blockDim.x floats, a power of two);
// every thread gets it. A tree in shared memory, so one thread per block (the host harness)
// computes the same.
__device__ __forceinline__ float block_sum(float v, float* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
        __syncthreads();
    }
    float s = red[0];
    __syncthreads();
    return s;
}

// 1 / sqrt(mean(x^2) + eps) of one row, summed with `block_sum` (so one thread, the host
// harness, sums in the host's order). `red` holds blockDim.x floats.
__device__ __forceinline__ float rms_inv(const float* xr, int dim, float eps, float* red) {
    float s = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i] * xr[i];
    return rsqrtf(block_sum(s, red) / dim + eps);
}

// RMSNorm of each row (one CUDA block per row of `dim`, blockDim.x a power of two <=
// NORM_THREADS), as HF computes it in f32. A row is one block's, so the block is wide: with 256
// threads a 5120-wide row took 20 us on an H200 (each thread's loads one after another).
#define NORM_THREADS 1024
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    rms_norm(const float* x, const float* w, float* out, int dim, float eps) {
    __shared__ float red[NORM_THREADS];
    const float* xr = x + (long long)blockIdx.x * dim;
    float* or_ = out + (long long)blockIdx.x * dim;
    const float inv = rms_inv(xr, dim, eps, red);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) or_[i] = w[i] * (xr[i] * inv);
}

// `rms_norm` written straight in the next projection's half type (1 = f16, 2 = bf16): the
// rounding `f32_to_half` would do, without the f32 rows and their pass (#21 item 1).
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    rms_norm_half(const float* x, const float* w, u16* out, int dim, float eps, int dtype) {
    __shared__ float red[NORM_THREADS];
    const float* xr = x + (long long)blockIdx.x * dim;
    u16* or_ = out + (long long)blockIdx.x * dim;
    const float inv = rms_inv(xr, dim, eps, red);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float y = w[i] * (xr[i] * inv);
        or_[i] = dtype == 1 ? f32_to_f16(y) : f32_to_bf16(y);
    }
}

// Rotate-half RoPE of `heads` heads of one token at `pos`; one thread per (head, i < dim/2).
extern "C" __global__ void rope(float* x, const float* inv_freq, int pos, int heads, int head_dim) {
    int half = head_dim / 2;
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= heads * half) return;
    int h = idx / half, i = idx % half;
    float s, c;
    sincosf((float)pos * inv_freq[i], &s, &c);
    float* v = x + (long long)h * head_dim;
    float a = v[i], b = v[i + half];
    v[i] = a * c - b * s;
    v[i + half] = b * c + a * s;
}

// gate[i] = silu(gate[i]) * up[i].
extern "C" __global__ void silu_mul(float* gate, const float* up, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        gate[i] = g / (1.f + expf(-g)) * up[i];
    }
}

// out[b][i] = silu(gu[b][i]) * gu[b][inter + i]: gate|up of n rows from one GEMM over weights
// stacked at load ([n][2 * inter]); the same arithmetic as silu_mul.
extern "C" __global__ void silu_mul_stacked(const float* gu, float* out, int inter, long long n) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n) {
        long long row = j / inter, i = j % inter;
        const float* r = gu + row * 2 * inter;
        float g = r[i];
        out[j] = g / (1.f + expf(-g)) * r[inter + i];
    }
}

// `silu_mul_stacked` written straight in the down projection's half type (1 = f16, 2 = bf16).
extern "C" __global__ void silu_mul_stacked_half(const float* gu, u16* out, int inter, long long n, int dtype) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n) {
        long long row = j / inter, i = j % inter;
        const float* r = gu + row * 2 * inter;
        float g = r[i];
        const float y = g / (1.f + expf(-g)) * r[inter + i];
        out[j] = dtype == 1 ? f32_to_f16(y) : f32_to_bf16(y);
    }
}

// Appends one token's K and V (f32, [head_dim]) of one KV head at `slot` of its head block,
// and folds K into the block's digest. One thread per channel. Float dtypes only (0..2): an
// 8-bit block needs the token's scale over all channels first.
extern "C" __global__ void kv_append(unsigned char* head_block, const float* k, const float* v, int slot,
                                     int head_dim, int block_size, int dtype, float* dmin, float* dmax) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= head_dim || dtype > 2) return;
    int es = kv_elem_size(dtype);
    store_kv(head_block, (long long)c * block_size + slot, dtype, k[c]);
    store_kv(head_block + (long long)block_size * head_dim * es, (long long)slot * head_dim + c, dtype, v[c]);
    dmin[c] = fminf(dmin[c], k[c]);
    dmax[c] = fmaxf(dmax[c], k[c]);
}

// A resident layer's q, k and v rows after their projections (#21 item 1), read at their
// strides from the GEMM's output and written packed: bias, then for q and k the per-head
// RMSNorm (where `qn`/`kn` is given, Qwen3) and rotate-half RoPE from the host's table
// cos_sin [row][head_dim / 2][cos, sin]. q goes to keep_q [row][hq][head_dim] (the batch's
// attention reads it as one [row * hk][group][head_dim] query), k and v to keep_k / keep_v
// [row][hk][head_dim] (the attention's own-key merge, the host pool). CUDA block (head, row)
// with heads 0..hq of q, then hk of k, then hk of v; blockDim.x a power of two <= 128. The
// same arithmetic as the model's host path (bias add, `rms_norm`, `Rotations::rotate`).
extern "C" __global__ void qkv_finish(const float* q, const float* k, const float* v, int q_stride,
                                      int k_stride, int v_stride, const float* bq, const float* bk,
                                      const float* bv, const float* qn, const float* kn, const float* cos_sin,
                                      int hq, int hk, int head_dim, float eps, float* keep_q, float* keep_k,
                                      float* keep_v) {
    __shared__ float xs[MAX_HEAD];
    __shared__ float red[128];
    const int head = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
    const float* x;
    const float* bias;
    const float* norm = 0;
    float* keep;
    bool rotate = true;
    if (head < hq) {
        x = q + (long long)row * q_stride + (long long)head * head_dim;
        bias = bq ? bq + (long long)head * head_dim : 0;
        norm = qn;
        keep = keep_q + ((long long)row * hq + head) * head_dim;
    } else if (head < hq + hk) {
        const int h = head - hq;
        x = k + (long long)row * k_stride + (long long)h * head_dim;
        bias = bk ? bk + (long long)h * head_dim : 0;
        norm = kn;
        keep = keep_k + ((long long)row * hk + h) * head_dim;
    } else {
        const int h = head - hq - hk;
        x = v + (long long)row * v_stride + (long long)h * head_dim;
        bias = bv ? bv + (long long)h * head_dim : 0;
        keep = keep_v + ((long long)row * hk + h) * head_dim;
        rotate = false;
    }
    for (int c = tid; c < head_dim; c += blockDim.x) xs[c] = bias ? x[c] + bias[c] : x[c];
    __syncthreads();
    if (norm) {
        float s = 0.f;
        for (int c = tid; c < head_dim; c += blockDim.x) s += xs[c] * xs[c];
        const float inv = rsqrtf(block_sum(s, red) / head_dim + eps);
        for (int c = tid; c < head_dim; c += blockDim.x) xs[c] = norm[c] * (xs[c] * inv);
        __syncthreads();
    }
    if (rotate) {
        const int half = head_dim / 2;
        const float* cs = cos_sin + (long long)row * half * 2;
        for (int i = tid; i < half; i += blockDim.x) {
            const float c = cs[2 * i], sn = cs[2 * i + 1];
            const float a = xs[i], b = xs[i + half];
            keep[i] = a * c - b * sn;
            keep[i + half] = b * c + a * sn;
        }
    } else {
        for (int c = tid; c < head_dim; c += blockDim.x) keep[c] = xs[c];
    }
}

// Merges the decoded token's own key into a resident layer's attention, in place: for query
// head (h, g) (h over every sequence's KV heads, [row * hk]), out [h][group][head_dim] /
// lse2 [h][group] (from `combine_splits`; ignored where `empty`: no sequence had a block) take
// in the partial of the one key k[h] with value v[h]; `Partial::of_one_key` and
// `Partial::merge_from` are the definition. One CUDA block per query head; blockDim.x a power
// of two <= 128.
extern "C" __global__ void merge_self(float* out, float* lse2, const float* q, const float* k, const float* v,
                                      int group, int head_dim, float scale, int empty) {
    __shared__ float red[128];
    const int hg = blockIdx.x, h = hg / group, tid = threadIdx.x;
    const float* qr = q + (long long)hg * head_dim;
    const float* kr = k + (long long)h * head_dim;
    const float* vr = v + (long long)h * head_dim;
    float* o = out + (long long)hg * head_dim;
    float s = 0.f;
    for (int c = tid; c < head_dim; c += blockDim.x) s += qr[c] * kr[c];
    const float lb = block_sum(s, red) * scale * 1.4426950408889634f;
    const float la = empty ? NEG_INF : lse2[hg];
    float wa = 0.f, wb = 1.f, l = lb;
    if (la != NEG_INF) {
        const float m = fmaxf(la, lb);
        const float ea = exp2f(la - m), eb = exp2f(lb - m);
        const float total = ea + eb;
        wa = ea / total;
        wb = eb / total;
        l = m + log2f(total);
    }
    for (int c = tid; c < head_dim; c += blockDim.x) o[c] = la != NEG_INF ? o[c] * wa + vr[c] * wb : vr[c];
    __syncthreads();
    if (tid == 0) lse2[hg] = l;
}

// f32 activations to the weights' half type for the cuBLAS projections (1 = f16, 2 = bf16).
extern "C" __global__ void f32_to_half(const float* x, u16* y, long long n, int dtype) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = dtype == 1 ? f32_to_f16(x[i]) : f32_to_bf16(x[i]);
}

// Split-K block-sparse decode attention for every KV head of one (sequence, layer).
//
// Blocks of KV head h are entries head_start[h] .. head_start[h+1] of offs/lens: byte offset
// of the head block in `arena` and its tokens. CUDA block (s, h) attends entries
// [head_start[h] + s*chunk, +chunk) for all `group` query heads of h at once, so each K/V
// element is read from memory once per group. Each 32-token tile of K and V is first loaded
// into shared memory by all threads at once (many independent loads in flight: a warp
// walking K^T row by row would wait on memory latency at every row), then scored and
// accumulated from there. It writes a partial (out, lse2) per query head to
// part_out [h][splits][group][head_dim] / part_lse [h][splits][group]; `combine_splits`
// merges the splits. 128 threads; group <= 8, head_dim <= 128. An 8-bit head block (dtype 3
// or 4) ends with each token's K scale and V scale (f32, block_size each), applied as its
// tiles load: the host pool's bytes are attended as they are, no dequantized copy.
// Bit 1 of the attention kernels' `flags`: each head's entries are cut evenly over the splits
// (at least `chunk` a split) instead of `chunk` at a time from its start. A list laid out on
// the device (`place_picks`: heads whose lengths the host does not know) sizes the grid for
// the longest a head may be; cut by `chunk`, the actual heads would fill only their first
// splits.
#define ATTEND_SPREAD 2

// Entries [*b0, *b1) of head h that split s of `splits` takes (none where *b0 >= *b1).
__device__ __forceinline__ void split_range(const int* head_start, int h, int s, int chunk, int splits, int flags,
                                            int* b0, int* b1) {
    const int start = head_start[h], end = head_start[h + 1];
    int c = chunk;
    if (flags & ATTEND_SPREAD) {
        const int even = (end - start + splits - 1) / splits;
        c = even > chunk ? even : chunk;
    }
    *b0 = start + s * c;
    *b1 = min(*b0 + c, end);
}

#define ATT_THREADS 128
#define ATT_WARPS 4
#define MAX_G 8
#define MAX_D 128
#define TILE 32
extern "C" __global__ void sparse_attention_split(
    const unsigned char* arena, const long long* offs, const int* lens, const int* head_start,
    const float* q, int group, int head_dim, int block_size, int dtype, float scale,
    int chunk, int splits, float* part_out, float* part_lse, int flags) {
    // Staged through shared memory tile by tile: nothing to prefetch ahead (bit 0 unread).
    const int s = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    __shared__ float q_sh[MAX_G * MAX_D];
    __shared__ float k_sh[MAX_D * TILE];  // K^T tile: [c][t]
    __shared__ float v_sh[TILE * MAX_D];  // V tile: [t][c]
    __shared__ float p_sh[MAX_G][TILE];
    __shared__ float m_sh[MAX_G], l_sh[MAX_G], a_sh[MAX_G];
    const float qscale = scale * 1.4426950408889634f;  // log2(e): exp becomes exp2
    const float* qh = q + (long long)h * group * head_dim;
    for (int i = tid; i < group * head_dim; i += ATT_THREADS) q_sh[i] = qh[i] * qscale;
    if (tid < MAX_G) { m_sh[tid] = NEG_INF; l_sh[tid] = 0.f; a_sh[tid] = 1.f; }
    int b0, b1;
    split_range(head_start, h, s, chunk, splits, flags, &b0, &b1);
    const int es = kv_elem_size(dtype);
    const bool scaled = dtype >= 3;
    float acc[MAX_G];
#pragma unroll
    for (int g = 0; g < MAX_G; g++) acc[g] = 0.f;
    __syncthreads();
    for (int bi = b0; bi < b1; bi++) {
        const unsigned char* kt = arena + offs[bi];
        const unsigned char* vs = kt + (long long)block_size * head_dim * es;
        const float* k_scale = (const float*)(vs + (long long)block_size * head_dim * es);
        const float* v_scale = k_scale + block_size;
        const int len = lens[bi];
        for (int t0 = 0; t0 < len; t0 += TILE) {
            const int n = min(TILE, len - t0);
            // Load: consecutive threads read consecutive addresses of K^T rows and V; every
            // thread has 2 * head_dim / 4 independent loads in flight.
            {
                const int t = tid & (TILE - 1);
                const long long krow = (long long)t0 + t;
                const float ks = (scaled && t < n) ? k_scale[krow] : 1.f;
                for (int c = tid / TILE; c < head_dim; c += ATT_THREADS / TILE)
                    k_sh[c * TILE + t] = t < n ? load_kv(kt, (long long)c * block_size + krow, dtype) * ks : 0.f;
            }
            for (int t = 0; t < TILE; t++) {
                const long long vrow = (long long)(t0 + t) * head_dim;
                const float vsc = (scaled && t < n) ? v_scale[t0 + t] : 1.f;
                for (int c = tid; c < head_dim; c += ATT_THREADS)
                    v_sh[t * head_dim + c] = t < n ? load_kv(vs, vrow + c, dtype) * vsc : 0.f;
            }
            __syncthreads();
            // Scores: warp w takes query heads w, w+4, ...; lane = token.
            for (int g = warp; g < group; g += ATT_WARPS) {
                float sc = NEG_INF;
                if (lane < n) {
                    sc = 0.f;
                    const float* qg = q_sh + g * head_dim;
                    for (int c = 0; c < head_dim; c++) sc += qg[c] * k_sh[c * TILE + lane];
                }
                const float m_old = m_sh[g];
                const float m_new = fmaxf(m_old, warp_max(sc));
                const float p = (lane < n && m_new != NEG_INF) ? exp2f(sc - m_new) : 0.f;
                const float sum = warp_sum(p);
                p_sh[g][lane] = p;
                __syncwarp();
                if (lane == 0) {
                    const float alpha = m_old == NEG_INF ? 0.f : exp2f(m_old - m_new);
                    a_sh[g] = alpha;
                    l_sh[g] = l_sh[g] * alpha + sum;
                    m_sh[g] = m_new;
                }
            }
            __syncthreads();
            if (tid < head_dim) {
#pragma unroll
                for (int g = 0; g < MAX_G; g++)
                    if (g < group) acc[g] *= a_sh[g];
                for (int j = 0; j < n; j++) {
                    const float v = v_sh[j * head_dim + tid];
#pragma unroll
                    for (int g = 0; g < MAX_G; g++)
                        if (g < group) acc[g] += p_sh[g][j] * v;
                }
            }
            __syncthreads();
        }
    }
    const long long base = ((long long)h * splits + s) * group;
    if (tid < head_dim) {
#pragma unroll
        for (int g = 0; g < MAX_G; g++)
            if (g < group) {
                const float l = l_sh[g];
                part_out[(base + g) * head_dim + tid] = l > 0.f ? acc[g] / l : 0.f;
            }
    }
    if (tid < group) {
        const float l = l_sh[tid];
        part_lse[base + tid] = l > 0.f ? m_sh[tid] + log2f(l) : NEG_INF;
    }
}

// Merges the splits of `sparse_attention_split`: one CUDA block of 128 threads per query head
// (h, g); out [h][group][head_dim], lse2 [h][group]. A head with no blocks gets (0, -inf).
// The splits' weights are computed once into shared memory; then each warp sums every fourth
// split with lane l holding dims l, l+32, .. (coalesced loads, several splits in flight per
// lane) and the four warps' sums are added. A thread per dim looping over every split in turn
// made this a chain of dependent L2 reads: at 128 splits as long as the attention itself.
// splits <= COMBINE_MAX_SPLITS and head_dim <= 128 (the caller checks).
#define COMBINE_MAX_SPLITS 1024
extern "C" __global__ void __launch_bounds__(128) combine_splits(const float* part_out, const float* part_lse,
                                                                  int splits, int group, int head_dim, float* out,
                                                                  float* lse2) {
    __shared__ float w_sh[COMBINE_MAX_SPLITS];
    __shared__ float red_sh[4];
    __shared__ float o_sh[4][128];
    const int hg = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int h = hg / group, g = hg % group;
    const long long base = (long long)h * splits;
    float mx = NEG_INF;
    for (int s = tid; s < splits; s += 128) mx = fmaxf(mx, part_lse[(base + s) * group + g]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) red_sh[warp] = mx;
    __syncthreads();
    mx = fmaxf(fmaxf(red_sh[0], red_sh[1]), fmaxf(red_sh[2], red_sh[3]));
    __syncthreads();  // red_sh is reused for the sum
    float total = 0.f;
    for (int s = tid; s < splits; s += 128) {
        const float w = mx == NEG_INF ? 0.f : exp2f(part_lse[(base + s) * group + g] - mx);
        w_sh[s] = w;
        total += w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    if (lane == 0) red_sh[warp] = total;
    __syncthreads();
    total = (red_sh[0] + red_sh[1]) + (red_sh[2] + red_sh[3]);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int s = warp; s < splits; s += 4) {
        const float w = w_sh[s];
        const float* po = part_out + ((base + s) * group + g) * head_dim;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int c = lane + 32 * j;
            // A split with no weight adds nothing, whatever its output holds.
            if (c < head_dim && w > 0.f) acc[j] += w * po[c];
        }
    }
#pragma unroll
    for (int j = 0; j < 4; j++) o_sh[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    for (int c = tid; c < head_dim; c += 128) {
        const float o = (o_sh[0][c] + o_sh[1][c]) + (o_sh[2][c] + o_sh[3][c]);
        out[(long long)hg * head_dim + c] = mx != NEG_INF ? o / total : 0.f;
    }
    if (tid == 0) lse2[hg] = mx != NEG_INF ? mx + log2f(total) : NEG_INF;
}

// One f16 (bits) as f32: the hardware conversion on the device, the exact bit walk elsewhere.
__device__ __forceinline__ float half_bits_to_f32(u16 h) {
#ifdef __CUDACC_RTC__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return f16_to_f32(h);
#endif
}

// Eight 16-bit KV elements (one 16-byte load, lowest address first) as f32; dtype 1 = f16,
// 2 = bf16.
__device__ __forceinline__ void unpack8(uint4 w, int dtype, float* f) {
    const unsigned int u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (dtype == 2) {
            f[2 * i] = __uint_as_float(u[i] << 16);
            f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
        } else {
            f[2 * i] = half_bits_to_f32((u16)(u[i] & 0xffffu));
            f[2 * i + 1] = half_bits_to_f32((u16)(u[i] >> 16));
        }
    }
}

// `unpack8` with the dtype DT known at compile time. Kept apart rather than `unpack8` calling
// it: written that way, `gemv_b1` (which the H200 measured) compiled to other code (44
// registers where it has 34).
template <int DT>
__device__ __forceinline__ void unpack8_as(uint4 w, float* f) {
    const unsigned int u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (DT == 2) {
            f[2 * i] = __uint_as_float(u[i] << 16);
            f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
        } else {
            f[2 * i] = half_bits_to_f32((u16)(u[i] & 0xffffu));
            f[2 * i + 1] = half_bits_to_f32((u16)(u[i] >> 16));
        }
    }
}

// A use of every word of `r` behind a branch the compiler cannot decide (`len` is never
// negative): the code after it waits for all of the loads, so all of them are issued before
// any of the work on them. Without it the scheduler interleaves loads with the FMAs on earlier
// ones and keeps only ~5 of a tile's 16 in flight per lane.
template <int N>
__device__ __forceinline__ void all_loaded(const uint4 (&r)[N], int len, float& sink) {
    unsigned int x = 0;
#pragma unroll
    for (int i = 0; i < N; i++) x |= r[i].x | r[i].y | r[i].z | r[i].w;
    if (len < 0) sink = __uint_as_float(x);
}

// Bit 0 of the attention kernels' `flags`: as a lane issues a batch of its loads, it asks L2 for
// the lines of its next batch (`prefetch_l2`), so two batches are on their way where its
// registers hold one. `attend_warps` and `attend_tc` keep ~4 KB a warp in flight and wait for
// it batch by batch: on an H200 attend_tc read 0.63 of the copy bandwidth at 64k, 0.51 at 32k.
// Whether it pays is the device's to say: the node times both at start (`attend_pick`).
#define ATTEND_PREFETCH 1

// Asks L2 for the line holding `p` (a hint: never a fault, whatever the address). The kernel
// harness defines HARNESS_PREFETCH to record the addresses.
__device__ __forceinline__ void prefetch_l2(const unsigned char* p) {
#if defined(__CUDA_ARCH__)
    asm volatile("prefetch.L2 [%0];" ::"l"(p));
#elif defined(HARNESS_PREFETCH)
    HARNESS_PREFETCH(p);
#else
    (void)p;
#endif
}

// The partial of a split from its 4 warps' running (max, sum, output), held in shared memory
// as m[w * GS + g], l[w * GS + g] and o[(w * GS + g) * D + c] for the first `group` of GS heads:
// `part_out[base + g][c]` and its base-2 log-sum-exp `part_lse[base + g]`, as
// `sparse_attention_split` writes them. After a barrier; every thread of the block takes part.
template <int GS, int D, int G>
__device__ __forceinline__ void merge_warps(const float* m, const float* l, const float* o, int group,
                                            long long base, float* part_out, float* part_lse) {
    constexpr int NW = 4;
    const int heads = G > 0 ? G : group;
    for (int i = threadIdx.x; i < heads * D; i += NW * 32) {
        const int g = i / D, c = i % D;
        float mx = NEG_INF;
        for (int w = 0; w < NW; w++) mx = fmaxf(mx, m[w * GS + g]);
        float sum = 0.f, out = 0.f;
        if (mx != NEG_INF)
            for (int w = 0; w < NW; w++) {
                const float e = m[w * GS + g] == NEG_INF ? 0.f : exp2f(m[w * GS + g] - mx);
                sum += l[w * GS + g] * e;
                out += o[(w * GS + g) * D + c] * e;
            }
        part_out[(base + g) * D + c] = sum > 0.f ? out / sum : 0.f;
        if (c == 0) part_lse[base + g] = sum > 0.f ? mx + log2f(sum) : NEG_INF;
    }
}

// Compile-time tunables of `attend_warps`, set through NVRTC (`DECODE_NODE_KERNEL_DEFINES`) to
// A/B them on a device in one run. MIN_BLOCKS: CUDA blocks an SM must hold at once (its
// `__launch_bounds__` minimum; 1 lets the compiler take every register it wants: 254 a thread
// at G = 5, D = 128 on an H200, so two blocks, 8 warps, an SM). LOADS: 16-byte loads a lane
// keeps in flight per tile batch where G <= 5 (half that above).
#ifndef ATTEND_WARPS_MIN_BLOCKS
#define ATTEND_WARPS_MIN_BLOCKS 1
#endif
#ifndef ATTEND_WARPS_LOADS
#define ATTEND_WARPS_LOADS 16
#endif

// The shared memory of one `attend_warps` CUDA block, declared once by its entry (each dtype's
// body would otherwise get its own copy).
template <int G, int D, int BS>
struct WarpsShared {
    float q[G * D];
    float p[4][G][BS];
    float m[4][G], l[4][G];
    float o[4][G][D];
};

// `sparse_attention_split` for the common case, 16-bit KV of dtype DT (1 = f16, 2 = bf16) in
// blocks of BS = 16 or 32 tokens with head_dim D = 64 or 128 and G query heads per KV head: the
// same grid, arguments and partials, so `combine_splits` merges either. The general kernel
// stages every tile in shared memory behind three block-wide barriers and then does two shared
// loads per FMA; here each of the 4 warps walks its own blocks with 16-byte loads straight into
// registers. For the scores, lane l holds tokens 8*(l%TPR).. of K^T rows l/TPR, l/TPR+RPS, ...
// (one row is BS*2 bytes: TPR = BS/8 lanes), multiplies them by every query head at once, and
// the RPS lanes that share its tokens sum by shuffles. For P.V, lane l holds dims 8*(l%(D/8))..
// of V rows l/(D/8), ... The 4 warps' running (max, sum, output) merge once at the end. 128
// threads; 16-byte aligned head blocks (the caller checks). Other shapes take the general kernel.
//
// A lane issues all of a tile's loads (LB at a time: 16 where G <= 5, else 8 to stay within
// the registers) and waits for them together (`all_loaded`). As the compiler scheduled the
// loads before, a block's K^T tile was read ~5 loads deep and its V tile one load at a time
// (each behind its `t < len` test): ~19 memory round trips per block and warp, which is
// what an H200 measured, 0.27-0.32 of its copy bandwidth at 8-64k (`bench kernels --device
// cuda`). Now two. The dtype is a template parameter, so each body is straight-line code.
template <int G, int D, int BS, int DT>
__device__ __forceinline__ void attend_warps(WarpsShared<G, D, BS>& sm, const unsigned char* arena,
                                             const long long* offs, const int* lens,
                                             const int* head_start, const float* q, float scale,
                                             int chunk, int splits, float* part_out,
                                             float* part_lse, int flags) {
    static_assert(BS == 16 || BS == 32, "blocks of 16 or 32 tokens");
    constexpr int TPR = BS / 8;    // lanes per K^T row (8 tokens each)
    constexpr int RPS = 32 / TPR;  // K^T rows per warp step
    constexpr int CPR = D / 8;     // 16-byte chunks per V row
    constexpr int TPS = 32 / CPR;  // V rows per warp step
    constexpr int NW = 4;          // warps per CUDA block
    constexpr int KI = D / RPS;    // K^T rows per lane
    constexpr int VI = BS / TPS;   // V rows per lane
    constexpr int LB = G <= 5 ? ATTEND_WARPS_LOADS : ATTEND_WARPS_LOADS / 2;
    constexpr int KB = KI < LB ? KI : LB;  // loads in flight per batch
    constexpr int VB = VI < LB ? VI : LB;
    static_assert(KI % KB == 0 && VI % VB == 0, "whole load batches");
    const int s = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    int b0, b1;
    split_range(head_start, h, s, chunk, splits, flags, &b0, &b1);
    const int tg = lane % TPR, r0 = lane / TPR;  // scores: tokens 8*tg.., rows r0 + RPS*i
    const int cc = lane % CPR, tt = lane / CPR;  // P.V: dims 8*cc.., rows tt + TPS*j
    // This lane's K^T load i and V load j of a block (kt: its K^T, vs: its V).
    auto k_at = [&](const unsigned char* kt, int i) { return kt + ((r0 + RPS * i) * BS + tg * 8) * 2; };
    auto v_at = [&](const unsigned char* vs, int j) { return vs + ((tt + TPS * j) * D + cc * 8) * 2; };
    const bool pf = flags & ATTEND_PREFETCH;
    if (pf && b0 + warp < b1) {
        // The first batch, on its way while the query is staged.
        const unsigned char* first = arena + offs[b0 + warp];
#pragma unroll
        for (int i = 0; i < KB; i++) prefetch_l2(k_at(first, i));
    }
    const float qscale = scale * 1.4426950408889634f;  // log2(e): exp becomes exp2
    const float* qh = q + (long long)h * G * D;
    for (int i = tid; i < G * D; i += NW * 32) sm.q[i] = qh[i] * qscale;
    __syncthreads();
    float m[G], l[G], acc[G][8];
#pragma unroll
    for (int g = 0; g < G; g++) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++) acc[g][j] = 0.f;
    }
    for (int bi = b0 + warp; bi < b1; bi += NW) {
        const unsigned char* kt = arena + offs[bi];
        const unsigned char* vs = kt + BS * D * 2;
        const int len = lens[bi];
        float sc[G][8];
#pragma unroll
        for (int g = 0; g < G; g++)
#pragma unroll
            for (int j = 0; j < 8; j++) sc[g][j] = 0.f;
#pragma unroll
        for (int i0 = 0; i0 < KI; i0 += KB) {
            uint4 kr[KB];
#pragma unroll
            for (int i = 0; i < KB; i++) kr[i] = *(const uint4*)k_at(kt, i0 + i);
            if (pf) {
                // The next batch: K's, else the block's first of V.
                if (i0 + KB < KI) {
#pragma unroll
                    for (int i = 0; i < KB; i++) prefetch_l2(k_at(kt, i0 + KB + i));
                } else {
#pragma unroll
                    for (int j = 0; j < VB; j++) prefetch_l2(v_at(vs, j));
                }
            }
            all_loaded(kr, len, sc[0][0]);
#pragma unroll
            for (int i = 0; i < KB; i++) {
                const int c = r0 + RPS * (i0 + i);
                float k[8];
                unpack8_as<DT>(kr[i], k);
#pragma unroll
                for (int g = 0; g < G; g++) {
                    const float qv = sm.q[g * D + c];
#pragma unroll
                    for (int j = 0; j < 8; j++) sc[g][j] += qv * k[j];
                }
            }
        }
#pragma unroll
        for (int o = TPR; o < 32; o <<= 1)
#pragma unroll
            for (int g = 0; g < G; g++)
#pragma unroll
                for (int j = 0; j < 8; j++) sc[g][j] += __shfl_xor_sync(0xffffffffu, sc[g][j], o);
        // Online softmax per query head; every lane ends with the same (m, l). Tokens past
        // `len` (the newest block's unwritten tail) are masked before anything reads them.
#pragma unroll
        for (int g = 0; g < G; g++) {
            float bm = NEG_INF;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (tg * 8 + j >= len) sc[g][j] = NEG_INF;
                bm = fmaxf(bm, sc[g][j]);
            }
#pragma unroll
            for (int o = 1; o < TPR; o <<= 1) bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, o));
            const float mn = fmaxf(m[g], bm);
            float ps = 0.f;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float p = (mn == NEG_INF || sc[g][j] == NEG_INF) ? 0.f : exp2f(sc[g][j] - mn);
                sc[g][j] = p;
                ps += p;
            }
#pragma unroll
            for (int o = 1; o < TPR; o <<= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
            const float alpha = m[g] == NEG_INF ? 0.f : exp2f(m[g] - mn);
            l[g] = l[g] * alpha + ps;
            m[g] = mn;
#pragma unroll
            for (int j = 0; j < 8; j++) acc[g][j] *= alpha;
            if (r0 == 0)
#pragma unroll
                for (int j = 0; j < 8; j++) sm.p[warp][g][tg * 8 + j] = sc[g][j];
        }
        __syncwarp();
#pragma unroll
        for (int j0 = 0; j0 < VI; j0 += VB) {
            // Rows past `len` are loaded (they lie inside the slot) but never used: the tail
            // may hold anything, NaN included.
            uint4 vr[VB];
#pragma unroll
            for (int j = 0; j < VB; j++) vr[j] = *(const uint4*)v_at(vs, j0 + j);
            if (pf) {
                // The next batch: V's, else the first of K of this warp's next block.
                if (j0 + VB < VI) {
#pragma unroll
                    for (int j = 0; j < VB; j++) prefetch_l2(v_at(vs, j0 + VB + j));
                } else if (bi + NW < b1) {
                    const unsigned char* next = arena + offs[bi + NW];
#pragma unroll
                    for (int i = 0; i < KB; i++) prefetch_l2(k_at(next, i));
                }
            }
            all_loaded(vr, len, acc[0][0]);
#pragma unroll
            for (int j = 0; j < VB; j++) {
                const int t = tt + TPS * (j0 + j);
                if (t < len) {
                    float v[8];
                    unpack8_as<DT>(vr[j], v);
#pragma unroll
                    for (int g = 0; g < G; g++) {
                        const float p = sm.p[warp][g][t];
#pragma unroll
                        for (int e = 0; e < 8; e++) acc[g][e] += p * v[e];
                    }
                }
            }
        }
        __syncwarp();  // the next block rewrites sm.p
    }
    // Lanes that share `cc` hold the same dims of different rows.
#pragma unroll
    for (int o = CPR; o < 32; o <<= 1)
#pragma unroll
        for (int g = 0; g < G; g++)
#pragma unroll
            for (int j = 0; j < 8; j++) acc[g][j] += __shfl_xor_sync(0xffffffffu, acc[g][j], o);
    if (tt == 0)
#pragma unroll
        for (int g = 0; g < G; g++)
#pragma unroll
            for (int j = 0; j < 8; j++) sm.o[warp][g][cc * 8 + j] = acc[g][j];
    if (lane == 0)
#pragma unroll
        for (int g = 0; g < G; g++) {
            sm.m[warp][g] = m[g];
            sm.l[warp][g] = l[g];
        }
    __syncthreads();
    merge_warps<G, D, G>(&sm.m[0][0], &sm.l[0][0], &sm.o[0][0][0], G, ((long long)h * splits + s) * G, part_out,
                         part_lse);
}

// The entry points of `attend_warps`, `attend_warps_g{G}_d{D}` for 32-token blocks and
// `attend_warps_g{G}_d{D}_b16` for 16: the arguments of `sparse_attention_split` (group,
// head_dim and block_size are the name's; dtype 1 = f16, anything else bf16, as the caller
// only launches these for 16-bit KV).
#define ATTEND_WARPS_ENTRY(NAME, G, D, BS)                                                          \
    extern "C" __global__ void __launch_bounds__(128, ATTEND_WARPS_MIN_BLOCKS) NAME(                \
        const unsigned char* arena, const long long* offs, const int* lens, const int* head_start, \
        const float* q, int group, int head_dim, int block_size, int dtype, float scale,           \
        int chunk, int splits, float* part_out, float* part_lse, int flags) {                      \
        __shared__ WarpsShared<G, D, BS> sm;                                                        \
        if (dtype == 1)                                                                             \
            attend_warps<G, D, BS, 1>(sm, arena, offs, lens, head_start, q, scale, chunk, splits,  \
                                      part_out, part_lse, flags);                                   \
        else                                                                                        \
            attend_warps<G, D, BS, 2>(sm, arena, offs, lens, head_start, q, scale, chunk, splits,  \
                                      part_out, part_lse, flags);                                   \
    }
#define ATTEND_WARPS(G, D)                                          \
    ATTEND_WARPS_ENTRY(attend_warps_g##G##_d##D, G, D, 32)          \
    ATTEND_WARPS_ENTRY(attend_warps_g##G##_d##D##_b16, G, D, 16)
ATTEND_WARPS(1, 64)
ATTEND_WARPS(2, 64)
ATTEND_WARPS(3, 64)
ATTEND_WARPS(4, 64)
ATTEND_WARPS(5, 64)
ATTEND_WARPS(6, 64)
ATTEND_WARPS(7, 64)
ATTEND_WARPS(8, 64)
ATTEND_WARPS(1, 128)
ATTEND_WARPS(2, 128)
ATTEND_WARPS(3, 128)
ATTEND_WARPS(4, 128)
ATTEND_WARPS(5, 128)
ATTEND_WARPS(6, 128)
ATTEND_WARPS(7, 128)
ATTEND_WARPS(8, 128)

// Row-major y[b][r] = sum_c w[r][c] * x[b][c] (+ beta * y[b][r]) for a decode batch of B <= 8
// rows, in place of a cuBLAS GEMM whose small-batch shapes read the weights at about half the
// memory bandwidth: one warp per row of w (GEMV_WARPS rows per CUDA block) reading it with
// 16-byte loads, four in flight per lane; the batch's x rows (small, shared by every row of w)
// come through L1/L2. 16-bit w and x (dtype 1 = f16, 2 = bf16), 16-byte aligned, cols a
// multiple of 8 (the caller checks); f32 sums and output. y is not read where beta is 0.
#define GEMV_WARPS 8
template <int B>
__device__ __forceinline__ void gemv_body(const unsigned char* w, const unsigned char* x, float* y, int rows,
                                          int cols, int dtype, float beta) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = blockIdx.x * GEMV_WARPS + warp;
    if (r >= rows) return;  // a whole warp
    const uint4* wr = (const uint4*)(w + (long long)r * cols * 2);
    const int chunks = cols >> 3;
    float acc[B];
#pragma unroll
    for (int b = 0; b < B; b++) acc[b] = 0.f;
    int c = lane;
    for (; c + 96 < chunks; c += 128) {
        uint4 wv[4];
#pragma unroll
        for (int u = 0; u < 4; u++) wv[u] = wr[c + 32 * u];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            float wf[8];
            unpack8(wv[u], dtype, wf);
#pragma unroll
            for (int b = 0; b < B; b++) {
                float xf[8];
                unpack8(((const uint4*)(x + (long long)b * cols * 2))[c + 32 * u], dtype, xf);
#pragma unroll
                for (int j = 0; j < 8; j++) acc[b] += wf[j] * xf[j];
            }
        }
    }
    for (; c < chunks; c += 32) {
        float wf[8];
        unpack8(wr[c], dtype, wf);
#pragma unroll
        for (int b = 0; b < B; b++) {
            float xf[8];
            unpack8(((const uint4*)(x + (long long)b * cols * 2))[c], dtype, xf);
#pragma unroll
            for (int j = 0; j < 8; j++) acc[b] += wf[j] * xf[j];
        }
    }
#pragma unroll
    for (int b = 0; b < B; b++) acc[b] = warp_sum(acc[b]);
    if (lane == 0)
#pragma unroll
        for (int b = 0; b < B; b++) {
            float* yb = y + (long long)b * rows + r;
            *yb = beta != 0.f ? acc[b] + beta * *yb : acc[b];
        }
}

// The entry points of `gemv_body`, `gemv_b{B}`: GEMV_WARPS * 32 threads, ceil(rows /
// GEMV_WARPS) blocks.
#define GEMV(B)                                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_b##B(                        \
        const unsigned char* w, const unsigned char* x, float* y, int rows, int cols, int dtype,    \
        float beta) {                                                                              \
        gemv_body<B>(w, x, y, rows, cols, dtype, beta);                                            \
    }
GEMV(1)
GEMV(2)
GEMV(3)
GEMV(4)
GEMV(5)
GEMV(6)
GEMV(7)
GEMV(8)

// `gemv_b{B}` on the tensor cores, for a batch of 1 to 8 rows of x (sm_80 and later):
// y[b][r] = sum_c w[r][c] x[b][c] (+ beta y[b][r]). At batch 8 `gemv_b8` loads and widens
// eight x chunks per w chunk and issues 64 FMAs on them: it ran at 0.6 of cuBLAS on an H200.
// Here each 32 columns of 16 rows of w are two m16n8k16 MMAs whose n is the batch (rows of
// x past it are zeros), so a w byte costs the same at batch 8 as at batch 1.
//
// Where a lane's registers sit in k is the MMA's business, but a sum over k is the same sum
// in any order of k, as long as A and B agree on it. So lane (g = lane / 4, t = lane % 4)
// loads 16 contiguous bytes, columns 8t .. 8t + 7 of a 32-column chunk, of w's rows g and
// g + 8 and of x's row g, and hands the first half of each to one MMA and the second half to
// the other, in the places where the MMA's A (row, k) and B (k, n) fragments meet at the
// same k: every byte is loaded once, 16 at a time, with no shuffles nor shared memory.
//
// One CUDA block per 16 rows of w; its GEMV_TC_WARPS warps take a contiguous share of the
// chunks each, GEMV_TC_CHUNKS chunks' loads in flight per lane, and add their sums through
// shared memory in a fixed order (the result does not depend on timing). w and x 16-byte
// aligned, cols a multiple of 8, dtype 1 = f16, 2 = bf16. Built for an older device (or for
// none in particular), the kernel writes NaN: the start-up check against cuBLAS then keeps
// it out.
#ifndef GEMV_TC_WARPS
#define GEMV_TC_WARPS 8
#endif
#ifndef GEMV_TC_CHUNKS
#define GEMV_TC_CHUNKS 4
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define HAVE_MMA 1
// c += A (16 x 16, row-major fragments a0..a3) . B (16 x 8, column fragments b0, b1), f32 sums.
__device__ __forceinline__ void mma_m16n8k16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                             unsigned b0, unsigned b1, int dtype) {
    if (dtype == 2)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif

extern "C" __global__ void __launch_bounds__(GEMV_TC_WARPS * 32)
    gemv_tc(const unsigned char* w, const unsigned char* x, float* y, int rows, int cols, int batch, int dtype,
            float beta) {
    __shared__ float part[GEMV_TC_WARPS][32][4];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#ifdef HAVE_MMA
    float acc2[4] = {0.f, 0.f, 0.f, 0.f};
    const int g = lane >> 2, t = lane & 3;
    const long long r_lo = (long long)blockIdx.x * 16 + g, r_hi = r_lo + 8;
    const bool has_lo = r_lo < rows, has_hi = r_hi < rows, has_x = g < batch;
    const uint4* w_lo = (const uint4*)(w + (has_lo ? r_lo : 0) * cols * 2);
    const uint4* w_hi = (const uint4*)(w + (has_hi ? r_hi : 0) * cols * 2);
    const uint4* xr = (const uint4*)(x + (has_x ? (long long)g : 0) * cols * 2);
    const int units = cols >> 3;  // 16-byte units of a row; chunk c holds units 4c .. 4c + 3
    const int chunks = (units + 3) >> 2;
    const int per = (chunks + GEMV_TC_WARPS - 1) / GEMV_TC_WARPS;
    const int c0 = warp * per, c1 = min(chunks, c0 + per);
    const uint4 zero = {0u, 0u, 0u, 0u};
    for (int c = c0; c < c1; c += GEMV_TC_CHUNKS) {
        uint4 lo[GEMV_TC_CHUNKS], hi[GEMV_TC_CHUNKS], xv[GEMV_TC_CHUNKS];
#pragma unroll
        for (int u = 0; u < GEMV_TC_CHUNKS; u++) {
            const int unit = (c + u) * 4 + t;
            const bool in = c + u < c1 && unit < units;
            lo[u] = in && has_lo ? w_lo[unit] : zero;
            hi[u] = in && has_hi ? w_hi[unit] : zero;
            xv[u] = in && has_x ? xr[unit] : zero;
        }
        // Every load issued before the first MMA waits (as the compiler had it, one chunk's
        // loads were in flight at a time).
        all_loaded(lo, cols, acc[0]);
        all_loaded(hi, cols, acc[1]);
        all_loaded(xv, cols, acc[2]);
#pragma unroll
        for (int u = 0; u < GEMV_TC_CHUNKS; u++) {
            // A: (row g, k 2t..2t+1), (row g+8, same k), (row g, k 2t+8..), (row g+8, k 2t+8..);
            // B: (k 2t.., n g), (k 2t+8.., n g). Columns 8t, 8t+1 are k 2t, 2t+1 of the first
            // MMA and columns 8t+2, 8t+3 its k 2t+8, 2t+9; the second MMA takes 8t+4 .. 8t+7.
            // Two accumulators: each MMA waits for the one before it on the same sums.
            mma_m16n8k16(acc, lo[u].x, hi[u].x, lo[u].y, hi[u].y, xv[u].x, xv[u].y, dtype);
            mma_m16n8k16(acc2, lo[u].z, hi[u].z, lo[u].w, hi[u].w, xv[u].z, xv[u].w, dtype);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) acc[i] += acc2[i];
#else
    acc[0] = acc[1] = acc[2] = acc[3] = NEG_INF - NEG_INF;  // NaN: no MMA here
#endif
#pragma unroll
    for (int i = 0; i < 4; i++) part[warp][lane][i] = acc[i];
    __syncthreads();
    // C: (row g, n 2t, 2t+1), (row g+8, n 2t, 2t+1) of lane g * 4 + t.
    if (threadIdx.x < 128) {
        const int l = threadIdx.x >> 2, i = threadIdx.x & 3;
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < GEMV_TC_WARPS; k++) s += part[k][l][i];
        const long long r = (long long)blockIdx.x * 16 + (l >> 2) + (i >= 2 ? 8 : 0);
        const int b = (l & 3) * 2 + (i & 1);
        if (r < rows && b < batch) {
            float* yb = y + (long long)b * rows + r;
            *yb = beta != 0.f ? s + beta * *yb : s;
        }
    }
}

// Compile-time tunables of `attend_tc` (as `attend_warps`'): MIN_BLOCKS, the CUDA blocks an SM
// must hold at once; KSTEPS, the 16-dim steps of K whose loads (four 16-byte loads a lane each)
// are issued together; VSTEPS, the same for the 16-token steps of P.V (4 or 8 loads each).
#ifndef ATTEND_TC_MIN_BLOCKS
#define ATTEND_TC_MIN_BLOCKS 3
#endif
#ifndef ATTEND_TC_KSTEPS
#define ATTEND_TC_KSTEPS 2
#endif
#ifndef ATTEND_TC_VSTEPS
#define ATTEND_TC_VSTEPS 2
#endif

// Two floats as a pair of 16-bit values of dtype DT (1 = f16, 2 = bf16), `lo` in the low half,
// each rounded to nearest even.
template <int DT>
__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
#ifdef __CUDACC_RTC__
    unsigned r;
    if (DT == 2)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    const unsigned a = DT == 2 ? f32_to_bf16(lo) : f32_to_f16(lo);
    const unsigned b = DT == 2 ? f32_to_bf16(hi) : f32_to_f16(hi);
    return a | (b << 16);
#endif
}

// The low and the high value of a pair of 16-bit values of dtype DT, as f32.
template <int DT>
__device__ __forceinline__ float half2_lo(unsigned u) {
    return DT == 2 ? __uint_as_float(u << 16) : half_bits_to_f32((u16)(u & 0xffffu));
}
template <int DT>
__device__ __forceinline__ float half2_hi(unsigned u) {
    return DT == 2 ? __uint_as_float(u & 0xffff0000u) : half_bits_to_f32((u16)(u >> 16));
}

// (a, b) as two pairs of 16-bit values whose sum is (a, b) to about 16 significant bits (bf16)
// or 22 (f16): the first rounded, the second what the first missed, rounded. An MMA takes its
// operands in 16 bits; the query and the softmax weights are f32, so each goes in as two.
template <int DT>
__device__ __forceinline__ uint2 split_half2(float a, float b) {
    const unsigned hi = pack_half2<DT>(a, b);
    return make_uint2(hi, pack_half2<DT>(a - half2_lo<DT>(hi), b - half2_hi<DT>(hi)));
}

// (a, b) as three such pairs (about 24 significant bits for bf16): the last rounds what the
// first two missed.
template <int DT>
__device__ __forceinline__ uint3 split3_half2(float a, float b) {
    const uint2 two = split_half2<DT>(a, b);
    const float ra = a - half2_lo<DT>(two.x) - half2_lo<DT>(two.y);
    const float rb = b - half2_hi<DT>(two.x) - half2_hi<DT>(two.y);
    return make_uint3(two.x, two.y, pack_half2<DT>(ra, rb));
}

// The shared memory of one `attend_tc` CUDA block.
template <int D>
struct TcShared {
    // Per 16-dim step of the query and lane: its A fragment (rows 8-15 are zero) as rounded
    // pairs (x: a0, y: a2) and the remainders (z, w).
    uint4 qf[D / 16][32];
    uint2 qf3[D / 16][32];  // what those two missed, rounded
    // Per warp, P.V step and lane: the weights' B fragments, rounded (x, y) and remainders.
    uint4 pf[4][4][32];
    float m[4][8], l[4][8];
    float o[4][8][D];
};

// `attend_warps` on the tensor cores (sm_80 on), for up to 8 query heads per KV head (`group`),
// 16-bit KV of dtype DT in blocks of BS = 16 or 32 tokens, head_dim D = 64 or 128: the same
// grid, arguments and partials, so `combine_splits` merges either. Each of the 4 warps takes 64
// tokens at a time (64 / BS blocks of its split) and computes, per 16 dims, S = Q K^T with
// m16n8k16 MMAs (the heads, padded to 16 rows, as A; K^T as B, eight MMAs for the 64 tokens),
// then O^T += V^T P^T (V^T as A, 16 dims a row tile; the weights as B). Per 64 tokens at
// D = 128 a lane issues 256 MMAs (192 for f16), 256 byte permutes and 64 16-byte loads: about
// a fifth of what `attend_warps` spends on FMAs, unpacking and shuffles of partial scores.
//
// No shared memory or shuffles carry K or V: a sum over k does not depend on which k is which,
// and an MMA's rows and columns may stand for any tokens and dims as long as every lane agrees
// (as in `gemv_tc`). Lane (g, t) loads 16 bytes of K^T rows 16e + 4t .. + 3 at tokens 8g .. 8g+7
// and `__byte_perm` pairs two rows' values of one token into the B fragment: MMA j's column g
// is token 8g + j, k 2t and 2t + 1 are dims 16e + 4t and + 1, k 2t + 8 and 2t + 9 the next
// two (the query's A fragment is laid out to match). So lane (g, t) ends with head g's scores
// of tokens 16t .. 16t + 15 (C's columns 2t and 2t + 1 of the eight MMAs): the softmax runs
// over four lanes, and the weights are already where the P.V MMAs take them as B (k 2t, 2t + 1
// as tokens 16t + 4f, + 1; k 2t + 8, 2t + 9 as + 2, + 3, for f = 0 .. 3). For V, the same lane
// loads those four tokens' dims 8g .. 8g+7 (and 64 + 8g .. for D = 128); a row tile's rows g and
// g + 8 are dims 8g + 2i and 8g + 2i + 1.
//
// The query and the weights are f32: each enters as a rounded 16-bit part and the remainder
// (two MMAs where one would round them to 8 or 11 bits), and a bf16 query as three parts (the
// third rounds what two missed: with two, scores of large keys drifted to 9e-6 of the output in
// the harness, near the 1e-5 tolerance; with three, 2.8e-6), so the result stays within the f32
// kernels' tolerance. Tokens past a block's `len` (the newest block's unwritten tail, which may
// hold NaN) are masked in the scores and loaded as zeros for V; a missing block, as zeros.
// Built for a device without MMAs (or for none in particular), the kernel writes NaN: the
// start-up check keeps it out. ptxas for sm_90 at the defaults: 164 registers a thread at
// D = 128, no spills (three CUDA blocks, 12 warps, an SM; `attend_warps_g5_d128` takes 255).
template <int D, int BS, int DT>
__device__ __forceinline__ void attend_tc(TcShared<D>& sm, const unsigned char* arena, const long long* offs,
                                          const int* lens, const int* head_start, const float* q, int group,
                                          float scale, int chunk, int splits, float* part_out, float* part_lse,
                                          int flags) {
    static_assert(BS == 16 || BS == 32, "blocks of 16 or 32 tokens");
    static_assert(D == 64 || D == 128, "head_dim 64 or 128");
    constexpr int NW = 4;          // warps per CUDA block
    constexpr int KS = D / 16;     // 16-dim steps of S = Q K^T
    constexpr int VH = D / 64;     // 16-byte V loads a lane per token
    constexpr int MT = 4 * VH;     // row tiles of O^T
    constexpr int BPS = 64 / BS;   // blocks a warp takes at a time
    constexpr int KB = ATTEND_TC_KSTEPS < KS ? ATTEND_TC_KSTEPS : KS;
    constexpr int VB = ATTEND_TC_VSTEPS < 4 ? ATTEND_TC_VSTEPS : 4;
    static_assert(KS % KB == 0 && 4 % VB == 0, "whole load batches");
    const int s = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
#ifdef HAVE_MMA
    int b0, b1;
    split_range(head_start, h, s, chunk, splits, flags, &b0, &b1);
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    // This lane's K load i of the batch from 16-dim step e0 (kt: its tokens' K^T rows), and its
    // V load x of token tok (vs: the token's block's V).
    auto k_at = [&](const unsigned char* kt, int e0, int i) {
        return kt + (16 * (e0 + i / 4) + 4 * t + i % 4) * BS * 2;
    };
    auto v_at = [&](const unsigned char* vs, int tok, int x) { return vs + (tok * D + 8 * (g + 8 * x)) * 2; };
    const int stok = 16 * t % BS;  // this lane's first score token (16t) within its block
    // f(e, u, x, tok) for each of this lane's V loads of P.V batch f0: token tok = 16t + 4f + u
    // of step f = f0 + e, its 16 bytes x.
    auto each_v = [&](int f0, auto&& f) {
#pragma unroll
        for (int e = 0; e < VB; e++)
#pragma unroll
            for (int u = 0; u < 4; u++)
#pragma unroll
                for (int x = 0; x < VH; x++) f(e, u, x, stok + 4 * (f0 + e) + u);
    };
    const bool pf = flags & ATTEND_PREFETCH;
    {
        // The first batch of this lane's K, on its way while the query is split.
        const int kb = b0 + BPS * warp + 8 * g / BS;
        if (pf && kb < b1) {
            const unsigned char* kt = arena + offs[kb] + (8 * g % BS) * 2;
#pragma unroll
            for (int i = 0; i < KB * 4; i++) prefetch_l2(k_at(kt, 0, i));
        }
    }
    const float qscale = scale * 1.4426950408889634f;  // log2(e): exp becomes exp2
    const float* qh = q + (long long)h * group * D;
    for (int i = tid; i < KS * 32; i += NW * 32) {
        const int e = i >> 5, l = i & 31, hg = l >> 2, c = 16 * e + 4 * (l & 3);
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; j++) v[j] = hg < group ? qh[hg * D + c + j] * qscale : 0.f;
        const uint3 a0 = split3_half2<DT>(v[0], v[1]), a2 = split3_half2<DT>(v[2], v[3]);
        sm.qf[e][l] = make_uint4(a0.x, a2.x, a0.y, a2.y);
        sm.qf3[e][l] = make_uint2(a0.z, a2.z);
    }
    __syncthreads();
    float m = NEG_INF, l = 0.f;  // head g's running max and sum
    float acc[MT][4];            // O^T: rows dims, columns heads 2t, 2t + 1
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.f;
    for (int bi = b0 + BPS * warp; bi < b1; bi += NW * BPS) {
        // This lane's K tokens 8g .. 8g + 7, and its score tokens 16t .. 16t + 15 (one block).
        const int kb = bi + 8 * g / BS, sb = bi + 16 * t / BS;
        const bool k_in = kb < b1;
        const unsigned char* kt = arena + offs[k_in ? kb : bi] + (8 * g % BS) * 2;
        const int slen = sb < b1 ? lens[sb] : 0;
        // The lines of P.V batch f0 this lane loads (the block's V address found again here,
        // not kept in a register through the K loop).
        auto prefetch_v = [&](int f0) {
            const unsigned char* vs = arena + offs[sb < b1 ? sb : bi] + BS * D * 2;
            each_v(f0, [&](int, int, int x, int tok) {
                if (tok < slen) prefetch_l2(v_at(vs, tok, x));
            });
        };
        float sc[8][4];  // MMA j: c0 = token 16t + j, c1 = 16t + 8 + j (rows 8-15: padding)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) sc[j][i] = 0.f;
        // One batch of loads at a time: unrolled, the compiler issued every batch's loads first
        // (255 registers and spills at D = 128).
#pragma unroll 1
        for (int e0 = 0; e0 < KS; e0 += KB) {
            uint4 kr[KB * 4];
#pragma unroll
            for (int i = 0; i < KB * 4; i++) kr[i] = k_in ? *(const uint4*)k_at(kt, e0, i) : zero;
            if (pf) {
                // The next batch: K's, else the first of P.V.
                if (e0 + KB < KS) {
                    if (k_in)
#pragma unroll
                        for (int i = 0; i < KB * 4; i++) prefetch_l2(k_at(kt, e0 + KB, i));
                } else {
                    prefetch_v(0);
                }
            }
            all_loaded(kr, slen, sc[0][2]);
#pragma unroll
            for (int e = 0; e < KB; e++) {
                const uint4 qa = sm.qf[e0 + e][lane];
                const uint2 qa3 = sm.qf3[e0 + e][lane];
                const unsigned w[4][4] = {
                    {kr[4 * e].x, kr[4 * e].y, kr[4 * e].z, kr[4 * e].w},
                    {kr[4 * e + 1].x, kr[4 * e + 1].y, kr[4 * e + 1].z, kr[4 * e + 1].w},
                    {kr[4 * e + 2].x, kr[4 * e + 2].y, kr[4 * e + 2].z, kr[4 * e + 2].w},
                    {kr[4 * e + 3].x, kr[4 * e + 3].y, kr[4 * e + 3].z, kr[4 * e + 3].w}};
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    // Token 8g + j is word j / 2 of each row's load, low half where j is even.
                    const unsigned sel = (j & 1) ? 0x7632u : 0x5410u;
                    const unsigned kb0 = __byte_perm(w[0][j / 2], w[1][j / 2], sel);
                    const unsigned kb1 = __byte_perm(w[2][j / 2], w[3][j / 2], sel);
                    mma_m16n8k16(sc[j], qa.x, 0u, qa.y, 0u, kb0, kb1, DT);
                    mma_m16n8k16(sc[j], qa.z, 0u, qa.w, 0u, kb0, kb1, DT);
                    // bf16's two parts keep 16 bits of the query; f16's keep 22.
                    if (DT == 2) mma_m16n8k16(sc[j], qa3.x, 0u, qa3.y, 0u, kb0, kb1, DT);
                }
            }
        }
        // Online softmax of head g over the four lanes that hold its 64 scores. Tokens past
        // `len` are masked before anything reads them.
        float bm = NEG_INF;
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                if (stok + 8 * c + j >= slen) sc[j][c] = NEG_INF;
                bm = fmaxf(bm, sc[j][c]);
            }
        bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 1));
        bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 2));
        const float mn = fmaxf(m, bm);
        float ps = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const float p = (mn == NEG_INF || sc[j][c] == NEG_INF) ? 0.f : exp2f(sc[j][c] - mn);
                sc[j][c] = p;
                ps += p;
            }
        ps += __shfl_xor_sync(0xffffffffu, ps, 1);
        ps += __shfl_xor_sync(0xffffffffu, ps, 2);
        const float alpha = m == NEG_INF ? 0.f : exp2f(m - mn);
        l = l * alpha + ps;
        m = mn;
        // O^T's columns are heads 2t and 2t + 1, whose factors lanes 8t and 8t + 4 hold.
        const float al0 = __shfl_sync(0xffffffffu, alpha, 8 * t);
        const float al1 = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);
#pragma unroll
        for (int i = 0; i < MT; i++) {
            acc[i][0] *= al0;
            acc[i][1] *= al1;
            acc[i][2] *= al0;
            acc[i][3] *= al1;
        }
        // The weights of tokens 16t + 4f .. + 3 (scores c0 of MMAs 4f .. 4f + 3, then c1) as
        // the B fragments of P.V step f, kept by the lane in shared memory: the steps then run
        // one at a time, each with only its own loads in registers.
#pragma unroll
        for (int f = 0; f < 4; f++) {
            const int j = (4 * f) % 8, c = f / 2;
            const uint2 p0 = split_half2<DT>(sc[j][c], sc[j + 1][c]);
            const uint2 p1 = split_half2<DT>(sc[j + 2][c], sc[j + 3][c]);
            sm.pf[warp][f][lane] = make_uint4(p0.x, p1.x, p0.y, p1.y);
        }
        const unsigned char* vs = arena + offs[sb < b1 ? sb : bi] + BS * D * 2;
#pragma unroll 1
        for (int f0 = 0; f0 < 4; f0 += VB) {
            // Tokens 16t + 4f + u, u = 0 .. 3, of VB steps f: rows past `len` (or of a missing
            // block) as zeros, whatever the slot holds.
            uint4 vr[VB][4 * VH];
            each_v(f0, [&](int e, int u, int x, int tok) {
                vr[e][u * VH + x] = tok < slen ? *(const uint4*)v_at(vs, tok, x) : zero;
            });
            if (pf) {
                // The next batch: P.V's, else the first of K of this warp's next 64 tokens.
                const int nkb = bi + NW * BPS + 8 * g / BS;
                if (f0 + VB < 4) {
                    prefetch_v(f0 + VB);
                } else if (nkb < b1) {
                    const unsigned char* nkt = arena + offs[nkb] + (8 * g % BS) * 2;
#pragma unroll
                    for (int i = 0; i < KB * 4; i++) prefetch_l2(k_at(nkt, 0, i));
                }
            }
#pragma unroll
            for (int e = 0; e < VB; e++) all_loaded(vr[e], slen, acc[0][0]);
#pragma unroll
            for (int e = 0; e < VB; e++) {
                const uint4 pb = sm.pf[warp][f0 + e][lane];
#pragma unroll
                for (int x = 0; x < VH; x++) {
                    const uint4 v0 = vr[e][x], v1 = vr[e][VH + x], v2 = vr[e][2 * VH + x], v3 = vr[e][3 * VH + x];
                    const unsigned w0[4] = {v0.x, v0.y, v0.z, v0.w}, w1[4] = {v1.x, v1.y, v1.z, v1.w};
                    const unsigned w2[4] = {v2.x, v2.y, v2.z, v2.w}, w3[4] = {v3.x, v3.y, v3.z, v3.w};
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        // Rows g and g + 8 of tile 4x + i: dims 8(g + 8x) + 2i and the next.
                        const unsigned a0 = __byte_perm(w0[i], w1[i], 0x5410u);
                        const unsigned a1 = __byte_perm(w0[i], w1[i], 0x7632u);
                        const unsigned a2 = __byte_perm(w2[i], w3[i], 0x5410u);
                        const unsigned a3 = __byte_perm(w2[i], w3[i], 0x7632u);
                        mma_m16n8k16(acc[4 * x + i], a0, a1, a2, a3, pb.x, pb.y, DT);
                        mma_m16n8k16(acc[4 * x + i], a0, a1, a2, a3, pb.z, pb.w, DT);
                    }
                }
            }
        }
    }
    // O^T tile 4x + i: c0, c1 = dim 8(g + 8x) + 2i of heads 2t, 2t + 1; c2, c3 the next dim.
#pragma unroll
    for (int x = 0; x < VH; x++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int c = 8 * (g + 8 * x) + 2 * i;
            sm.o[warp][2 * t][c] = acc[4 * x + i][0];
            sm.o[warp][2 * t + 1][c] = acc[4 * x + i][1];
            sm.o[warp][2 * t][c + 1] = acc[4 * x + i][2];
            sm.o[warp][2 * t + 1][c + 1] = acc[4 * x + i][3];
        }
    if (t == 0) {
        sm.m[warp][g] = m;
        sm.l[warp][g] = l;
    }
#else
    // NaN: no MMA here.
    (void)flags;
    for (int i = tid; i < 4 * 8 * D; i += NW * 32) (&sm.o[0][0][0])[i] = NEG_INF - NEG_INF;
    if (tid < 4 * 8) {
        (&sm.m[0][0])[tid] = 0.f;
        (&sm.l[0][0])[tid] = 1.f;
    }
#endif
    __syncthreads();
    merge_warps<8, D, 0>(&sm.m[0][0], &sm.l[0][0], &sm.o[0][0][0], group, ((long long)h * splits + s) * group,
                         part_out, part_lse);
}

// The entry points of `attend_tc`, `attend_tc_d{D}` for 32-token blocks and `attend_tc_d{D}_b16`
// for 16: the arguments of `sparse_attention_split` (group at most 8; head_dim and block_size
// are the name's; dtype 1 = f16, anything else bf16).
#define ATTEND_TC_ENTRY(NAME, D, BS)                                                                    \
    extern "C" __global__ void __launch_bounds__(128, ATTEND_TC_MIN_BLOCKS) NAME(                        \
        const unsigned char* arena, const long long* offs, const int* lens, const int* head_start,     \
        const float* q, int group, int head_dim, int block_size, int dtype, float scale, int chunk,    \
        int splits, float* part_out, float* part_lse, int flags) {                                     \
        __shared__ TcShared<D> sm;                                                                      \
        if (dtype == 1)                                                                                 \
            attend_tc<D, BS, 1>(sm, arena, offs, lens, head_start, q, group, scale, chunk, splits,     \
                                part_out, part_lse, flags);                                             \
        else                                                                                            \
            attend_tc<D, BS, 2>(sm, arena, offs, lens, head_start, q, group, scale, chunk, splits,     \
                                part_out, part_lse, flags);                                             \
    }
ATTEND_TC_ENTRY(attend_tc_d64, 64, 32)
ATTEND_TC_ENTRY(attend_tc_d128, 128, 32)
ATTEND_TC_ENTRY(attend_tc_d64_b16, 64, 16)
ATTEND_TC_ENTRY(attend_tc_d128_b16, 128, 16)

// Copies n ranges of `bytes` bytes (a multiple of 16) from src[i] to dst[i]; one CUDA block
// per range. Sources are page-locked host memory mapped into the device's address space:
// one launch gathers scattered KV blocks over PCIe, where one DMA call per 16 KiB block
// would cost microseconds of driver time each.
extern "C" __global__ void gather_copy(const unsigned long long* src, const unsigned long long* dst,
                                       int n, long long bytes) {
    const int i = blockIdx.x;
    if (i >= n) return;
    const uint4* s = (const uint4*)src[i];
    uint4* d = (uint4*)dst[i];
    const long long words = bytes / 16;
    for (long long w = threadIdx.x; w < words; w += blockDim.x) d[w] = s[w];
}

// Writes n byte runs of `staged` (one upload) to their places: run i is `runs[3i]` bytes on
// from staged's start, to device address `runs[3i + 1]`, `runs[3i + 2]` bytes long. One CUDA
// block per run. A step's new sketch rows and scales are a few bytes per KV head, each in a
// page of its own: one upload and this launch replace two copies per head.
extern "C" __global__ void scatter_runs(const unsigned char* staged, const unsigned long long* runs, int n) {
    const int i = blockIdx.x;
    if (i >= n) return;
    const unsigned char* s = staged + runs[3 * i];
    unsigned char* d = (unsigned char*)runs[3 * i + 1];
    const long long bytes = (long long)runs[3 * i + 2];
    for (long long b = threadIdx.x; b < bytes; b += blockDim.x) d[b] = s[b];
}

// Copies tokens [from[i], to[i]) of n head blocks from src[i] (the mapped host pool) to dst[i]
// (arena slots that hold the tokens before them): the K^T column of each token, its V row and,
// for an 8-bit dtype, its two scales. One CUDA block per head block. The newest block of a
// sequence grows by a token each step; a whole copy would move `block_size` times its bytes.
extern "C" __global__ void copy_tokens(const unsigned long long* table, int n, int head_dim,
                                       int block_size, int dtype) {
    const int i = blockIdx.x;
    if (i >= n) return;
    const unsigned char* s = (const unsigned char*)table[i];
    unsigned char* d = (unsigned char*)table[n + i];
    const int t0 = (int)table[2 * n + i], t1 = (int)table[3 * n + i];
    const int nt = t1 - t0;
    if (nt <= 0) return;
    const int es = kv_elem_size(dtype);
    // K^T [c][t]: token t of channel c, es bytes.
    for (int idx = threadIdx.x; idx < head_dim * nt * es; idx += blockDim.x) {
        const int byte = idx % es, e = idx / es;
        const int c = e / nt, t = t0 + e % nt;
        const long long off = ((long long)c * block_size + t) * es + byte;
        d[off] = s[off];
    }
    // V [t][c]: the rows t0..t1, contiguous.
    const long long vbase = (long long)block_size * head_dim * es;
    const long long v0 = vbase + (long long)t0 * head_dim * es, v1 = vbase + (long long)t1 * head_dim * es;
    for (long long b = v0 + threadIdx.x; b < v1; b += blockDim.x) d[b] = s[b];
    if (dtype >= 3) {
        // Per-token f32 scales after V: K's [block_size], then V's.
        const float* ss = (const float*)(s + 2 * vbase);
        float* ds = (float*)(d + 2 * vbase);
        for (int t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
            ds[t] = ss[t];
            ds[block_size + t] = ss[block_size + t];
        }
    }
}

// Device sampling (#21 item 2): the token of each row of the LM head's logits, picked where
// they are, so a step brings back a few words per row instead of the vocabulary's logits.
// One CUDA block of SAMPLE_THREADS threads per row (as many as a block may have: each
// thread's passes over the vocabulary are chains of dependent loads, 440 us a greedy row of
// 152k with 256 threads on an H200); with `nparts` > 0 the first two passes (the largest
// logit, the sums of exponentials) come from `row_max_parts` and `row_sum_parts`, and only a
// row's radix select (tempered rows, top log-probabilities) reads it here. The pick is the
// host's for the same draw
// (decode-node's `model::pick::pick_row` is the definition): greedy is the first largest
// logit; a tempered pick walks the SAMPLE_HEAD most likely tokens (by logit, the lower id
// first on ties) with weights exp((x - max) / T) in f64, under top-k and top-p as the host
// does. Where that needs tokens past the head, or the row holds a non-finite logit, the row is
// left to the host (status 1), which then reads its logits.
//
// spec [n][SAMPLE_SPEC_WORDS]: temperature (f32 bits), top_k (0 = off), top_p (f32 bits),
// top logprobs wanted (<= SAMPLE_TOP), the draw (f64, low word then high; ignored unless
// tempered). out [n][SAMPLE_OUT_WORDS]: status, token, logprob (f32 bits), top count, then
// (id, logprob bits) per top token, most likely first.
#define SAMPLE_THREADS 1024
#define SAMPLE_HEAD 256
#define SAMPLE_TOP 20
#define SAMPLE_SPEC_WORDS 6
#define SAMPLE_OUT_WORDS (4 + 2 * SAMPLE_TOP)

__device__ __forceinline__ bool finite_f32(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// Orders tokens as the host's sort does: larger logit first in the total order (-0 < +0),
// then the lower id; so every key is distinct.
__device__ __forceinline__ unsigned long long sample_key(float x, unsigned int id) {
    unsigned int b = __float_as_uint(x);
    unsigned int k = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)k << 32) | (unsigned long long)(0xffffffffu - id);
}

__device__ __forceinline__ unsigned int sample_id(unsigned long long key) {
    return 0xffffffffu - (unsigned int)(key & 0xffffffffull);
}

// A row's first two passes for `sample_rows`, spread over the device: one CUDA block of
// PART_THREADS per PART_LOGITS logits of a row (blockIdx.x) and row (blockIdx.y). One block a
// row made them alone: 1024 threads, and 148 f64 exponentials each, for a greedy row of 152k.
//
// Pass 1: the slice's largest logit, its first id, and whether the slice holds a non-finite
// logit, into parts[row][part][3].
#define PART_THREADS 256
#define PART_LOGITS 4096

// Keeps (v, i) in (bv, bi) where it comes first: the larger logit, the lower id on ties; an
// id of 0xffffffff is no entry.
__device__ __forceinline__ void keep_best(float& bv, unsigned int& bi, float v, unsigned int i) {
    if (i != 0xffffffffu && (bi == 0xffffffffu || v > bv || (v == bv && i < bi))) {
        bv = v;
        bi = i;
    }
}

// This thread's largest logit of x[from, to) (its first id: the thread's ids increase) by a
// stride of nt; sets *bad on a non-finite logit.
__device__ __forceinline__ void thread_best(const float* x, unsigned int from, unsigned int to, int nt,
                                            int* bad, float& bv, unsigned int& bi) {
    for (unsigned int i = from; i < to; i += nt) {
        float v = x[i];
        if (!finite_f32(v)) *bad = 1;
        if (v > bv || bi == 0xffffffffu) { bv = v; bi = i; }
    }
}

// The block's first largest logit into best_v[0], best_i[0] (nt a power of two).
__device__ __forceinline__ void block_best(float* best_v, unsigned int* best_i, int tid, int nt) {
    for (int s = nt / 2; s > 0; s >>= 1) {
        if (tid < s) keep_best(best_v[tid], best_i[tid], best_v[tid + s], best_i[tid + s]);
        __syncthreads();
    }
}

// This thread's sums of exp(x - m) and, tempered, exp((x - m) / T) over x[from, to) by a
// stride of nt, in f64.
__device__ __forceinline__ void thread_exp_sums(const float* x, unsigned int from, unsigned int to, int nt,
                                                float m, float temp, bool tempered, double& se, double& st) {
    for (unsigned int i = from; i < to; i += nt) {
        float v = x[i];
        se += exp((double)(v - m));
        if (tempered) st += exp((double)((v - m) / temp));
    }
}

// Both arrays' block sums into [0] (nt a power of two).
__device__ __forceinline__ void block_sum2(double* a, double* b, int tid, int nt) {
    for (int s = nt / 2; s > 0; s >>= 1) {
        if (tid < s) {
            a[tid] += a[tid + s];
            b[tid] += b[tid + s];
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(PART_THREADS)
    row_max_parts(const float* logits, int vocab, int nparts, unsigned int* parts) {
    __shared__ float best_v[PART_THREADS];
    __shared__ unsigned int best_i[PART_THREADS];
    __shared__ int bad;
    const int tid = threadIdx.x, nt = blockDim.x;
    const unsigned int n = (unsigned int)vocab;
    const float* x = logits + (long long)blockIdx.y * vocab;
    const unsigned int from = blockIdx.x * (unsigned int)PART_LOGITS;
    const unsigned int to = min(from + (unsigned int)PART_LOGITS, n);
    if (tid == 0) bad = 0;
    __syncthreads();
    float bv = NEG_INF;
    unsigned int bi = 0xffffffffu;
    thread_best(x, from + tid, to, nt, &bad, bv, bi);
    best_v[tid] = bv;
    best_i[tid] = bi;
    __syncthreads();
    block_best(best_v, best_i, tid, nt);
    if (tid == 0) {
        unsigned int* o = parts + ((long long)blockIdx.y * nparts + blockIdx.x) * 3;
        o[0] = __float_as_uint(best_v[0]);
        o[1] = best_i[0];
        o[2] = bad;
    }
}

// Pass 2: with the row's largest logit m (from every part of pass 1), the slice's sums of
// exp(x - m) and, for a tempered row, exp((x - m) / T), in f64, into sums[row][part][2]. A
// row holding a non-finite logit is left to the host: nothing summed.
extern "C" __global__ void __launch_bounds__(PART_THREADS)
    row_sum_parts(const float* logits, const unsigned int* spec, int vocab, const unsigned int* parts, int nparts,
                  double* sums) {
    __shared__ double sum_e[PART_THREADS];
    __shared__ double sum_t[PART_THREADS];
    const int tid = threadIdx.x, nt = blockDim.x;
    const unsigned int n = (unsigned int)vocab;
    const long long row = blockIdx.y;
    const float* x = logits + row * vocab;
    const unsigned int* pp = parts + row * nparts * 3;
    const float temp = __uint_as_float(spec[row * SAMPLE_SPEC_WORDS]);
    const bool tempered = temp > 0.f && finite_f32(temp);
    float m = NEG_INF;
    int bad = 0;
    for (int p = 0; p < nparts; p++) {
        m = fmaxf(m, __uint_as_float(pp[3 * p]));
        bad |= (int)pp[3 * p + 2];
    }
    const unsigned int from = blockIdx.x * (unsigned int)PART_LOGITS;
    const unsigned int to = bad ? from : min(from + (unsigned int)PART_LOGITS, n);
    double se = 0.0, st = 0.0;
    thread_exp_sums(x, from + tid, to, nt, m, temp, tempered, se, st);
    sum_e[tid] = se;
    sum_t[tid] = st;
    __syncthreads();
    block_sum2(sum_e, sum_t, tid, nt);
    if (tid == 0) {
        double* o = sums + (row * nparts + blockIdx.x) * 2;
        o[0] = sum_e[0];
        o[1] = sum_t[0];
    }
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(const float* logits, const unsigned int* spec, unsigned int* out, int vocab,
                const unsigned int* parts, const double* part_sums, int nparts) {
    __shared__ float best_v[SAMPLE_THREADS];
    __shared__ unsigned int best_i[SAMPLE_THREADS];
    __shared__ double sum_e[SAMPLE_THREADS];
    __shared__ double sum_t[SAMPLE_THREADS];
    __shared__ unsigned int hist[256];
    __shared__ unsigned long long head[SAMPLE_HEAD];
    __shared__ unsigned long long prefix;
    __shared__ unsigned int want, taken;
    __shared__ int cut_found;
    __shared__ int bad;
    const int tid = threadIdx.x, nt = blockDim.x;
    const unsigned int n = (unsigned int)vocab;
    const float* x = logits + (long long)blockIdx.x * vocab;
    const unsigned int* sp = spec + (long long)blockIdx.x * SAMPLE_SPEC_WORDS;
    unsigned int* o = out + (long long)blockIdx.x * SAMPLE_OUT_WORDS;
    const float temp = __uint_as_float(sp[0]);
    const unsigned int top_k = sp[1];
    const float top_p = __uint_as_float(sp[2]);
    const unsigned int ntop = min(min(sp[3], (unsigned int)SAMPLE_TOP), n);
    const double draw = __hiloint2double((int)sp[5], (int)sp[4]);
    // The host's greedy test: temperature <= 0 or not finite.
    const bool tempered = temp > 0.f && finite_f32(temp);

    // The largest logit and its first id (`>`: -0 and +0 tie, as in the host's argmax).
    if (tid == 0) bad = 0;
    __syncthreads();
    float bv = NEG_INF;
    unsigned int bi = 0xffffffffu;
    if (nparts > 0) {
        // From `row_max_parts`.
        const unsigned int* pp = parts + (long long)blockIdx.x * nparts * 3;
        for (int p = tid; p < nparts; p += nt) {
            if (pp[3 * p + 2]) bad = 1;
            keep_best(bv, bi, __uint_as_float(pp[3 * p]), pp[3 * p + 1]);
        }
    } else {
        thread_best(x, tid, n, nt, &bad, bv, bi);
    }
    best_v[tid] = bv;
    best_i[tid] = bi;
    __syncthreads();
    block_best(best_v, best_i, tid, nt);
    if (bad || n == 0) {
        if (tid == 0) o[0] = 1;
        return;
    }
    const float m = best_v[0];

    // sum exp(x - m) for the log-probabilities, sum exp((x - m) / T) for the draw.
    double se = 0.0, st = 0.0;
    if (nparts > 0) {
        // From `row_sum_parts`.
        const double* ps = part_sums + (long long)blockIdx.x * nparts * 2;
        for (int p = tid; p < nparts; p += nt) {
            se += ps[2 * p];
            st += ps[2 * p + 1];
        }
    } else {
        thread_exp_sums(x, tid, n, nt, m, temp, tempered, se, st);
    }
    sum_e[tid] = se;
    sum_t[tid] = st;
    __syncthreads();
    block_sum2(sum_e, sum_t, tid, nt);

    // The head: the `h` largest keys, by a radix select of the h-th largest (a byte a pass,
    // most significant first), then gathered and sorted.
    const unsigned int keep = tempered ? (top_k > 0 ? min(top_k, n) : n) : 0;
    const unsigned int walk = min(keep, (unsigned int)SAMPLE_HEAD);
    const unsigned int h = min(max(walk, ntop), n);
    if (h > 0) {
        if (tid == 0) {
            prefix = 0ull;
            want = h;
            cut_found = 0;
        }
        unsigned long long mask = 0ull;
        for (int shift = 56; shift >= 0; shift -= 8) {
            for (int i = tid; i < 256; i += nt) hist[i] = 0;
            __syncthreads();
            const unsigned long long pre = prefix;
            for (unsigned int i = tid; i < n; i += nt) {
                unsigned long long k = sample_key(x[i], i);
                if ((k & mask) == pre) atomicAdd(&hist[(k >> shift) & 255ull], 1u);
            }
            __syncthreads();
            if (tid == 0) {
                unsigned int above = 0;
                for (int b = 255; b >= 0; b--) {
                    if (above + hist[b] >= want) {
                        want -= above;
                        prefix |= (unsigned long long)b << shift;
                        // Every key of this byte is wanted: the cut is found (keys below the
                        // prefix's lower bits, all zero, are none of them).
                        cut_found = hist[b] == want;
                        break;
                    }
                    above += hist[b];
                }
            }
            __syncthreads();
            mask |= 255ull << shift;
            // Keys are distinct, so a pass or three usually isolates the cut, where all eight
            // ran before: each pass reads the whole row (a greedy row's two passes over 152k
            // logits took 0.44 ms with 256 threads on an H200).
            if (cut_found) break;
        }
        if (tid == 0) taken = 0;
        for (int i = tid; i < SAMPLE_HEAD; i += nt) head[i] = 0ull;
        __syncthreads();
        const unsigned long long kth = prefix;
        for (unsigned int i = tid; i < n; i += nt) {
            unsigned long long k = sample_key(x[i], i);
            if (k >= kth) head[atomicAdd(&taken, 1u)] = k;
        }
        __syncthreads();
        // Bitonic sort, largest first; the zero padding sorts last.
        for (unsigned int size = 2; size <= SAMPLE_HEAD; size <<= 1) {
            for (unsigned int stride = size >> 1; stride > 0; stride >>= 1) {
                for (unsigned int i = tid; i < SAMPLE_HEAD; i += nt) {
                    unsigned int j = i ^ stride;
                    if (j > i) {
                        unsigned long long a = head[i], b = head[j];
                        bool largest_first = (i & size) == 0;
                        if (largest_first ? a < b : a > b) {
                            head[i] = b;
                            head[j] = a;
                        }
                    }
                }
                __syncthreads();
            }
        }
    }
    if (tid != 0) return;

    // The walk, as the host's: one thread over at most SAMPLE_HEAD tokens.
    unsigned int status = 0, tok = best_i[0];
    if (tempered) {
        double total = sum_t[0];
        if (keep < n) {
            if (keep > walk) status = 1;  // the top-k's mass reaches past the head
            total = 0.0;
            for (unsigned int j = 0; j < walk; j++) total += exp((double)((x[sample_id(head[j])] - m) / temp));
        }
        const bool nucleus = top_p > 0.f && top_p < 1.f;
        unsigned int len = walk;
        double kept = total;
        bool done = status != 0;
        if (!done && nucleus) {
            double acc = 0.0;
            bool found = false;
            for (unsigned int j = 0; j < walk; j++) {
                acc += exp((double)((x[sample_id(head[j])] - m) / temp)) / total;
                if (acc >= (double)top_p) {
                    len = j + 1;
                    found = true;
                    break;
                }
            }
            if (!found) {
                done = true;
                if (walk == keep) tok = sample_id(head[keep - 1]);
                else status = 1;
            } else {
                kept = 0.0;
                for (unsigned int j = 0; j < len; j++) kept += exp((double)((x[sample_id(head[j])] - m) / temp));
            }
        }
        if (!done) {
            double r = draw * kept;
            bool picked = false;
            for (unsigned int j = 0; j < len; j++) {
                unsigned int id = sample_id(head[j]);
                double w = exp((double)((x[id] - m) / temp));
                if (r < w) {
                    tok = id;
                    picked = true;
                    break;
                }
                r -= w;
            }
            if (!picked) {
                if (nucleus || len == keep) tok = sample_id(head[len - 1]);
                else status = 1;
            }
        }
    }
    o[0] = status;
    if (status != 0) return;
    const float ln_sum = (float)log(sum_e[0]);
    const float lse = m + ln_sum;
    o[1] = tok;
    o[2] = __float_as_uint((x[tok] - m) - ln_sum);
    o[3] = ntop;
    for (unsigned int j = 0; j < ntop; j++) {
        unsigned int id = sample_id(head[j]);
        o[4 + 2 * j] = id;
        o[5 + 2 * j] = __float_as_uint(x[id] - lse);
    }
}

// Block scores from a 4-bit sketch of every key (attention::sketch), step 1: each query
// head's log2-sum-exp2 over each block's tokens of temp * scale_t * sum_c q[c] * (nibble_c - 8).
// The sketch lives in pages (arena slots of the KV store): pages[h * max_pages + p] is the
// address of KV head h's page p, holding tokens p * page_tokens onwards: page_tokens rows of
// D/2 bytes (channel 2j in the low nibble of byte j), then their f32 scales. q: [hk][G][D] f32,
// lse: [hk][nblocks][G]. One warp per `per_warp` consecutive blocks (SKETCH_WARPS warps a
// CUDA block, blockIdx.y the KV head), one block at a time; each lane takes tokens lane,
// lane + 32, ... of the block and keeps a running (max, sum) per query head, merged across
// the warp at the block's end. D a multiple of 32 (whole 16-byte
// loads), at most MAX_HEAD; G at most 8; pages 16-byte aligned.
//
// With int8 = 1 the sums are taken in integers, as the host sketch's AVX2 path takes them
// (attention::sketch::round_query_i8): each query head rounded to int8 (step = max |q| / 127,
// q8 = round(q * (1 / step)) clamped to 127), each token's sum_c q8[c] * nibble_c exact by
// __dp4a, four channels an instruction (a row word's low nibbles against the even channels'
// bytes, its high nibbles against the odd ones'), then temp * step * scale_t * (sum - 8 sum
// q8) in the host's order of products. Against the float loop that is a quarter of the
// multiply-adds, no nibble conversions, and half the shared-memory loads of the query (a
// quarter of its bytes).
// A KV head whose query has a NaN or infinite channel is scored by the float loop, as the
// host scores it.
// One token's score by each of G query heads in integers (sketch_lse's int8 mode): row holds
// its D / 2 nibble bytes; q8w each head's D / 8 pairs of words (even channels' bytes, odd
// channels' bytes), q8z its 8 sum(q8), q8t its temp * step; scale the token's key scale.
__device__ __forceinline__ void sketch_token_i8(const uint4* row, int D, int G, const int* q8w, const int* q8z,
                                                const float* q8t, float scale, float v[8]) {
    int acc[8];
#pragma unroll
    for (int g = 0; g < 8; g++) acc[g] = 0;
    for (int w = 0; w < (D >> 5); w++) {
        const uint4 x = row[w];
        const unsigned words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int lo = (int)(words[k] & 0x0f0f0f0fu);
            const int hi = (int)((words[k] >> 4) & 0x0f0f0f0fu);
            const int at = 2 * (w * 4 + k);
#pragma unroll
            for (int g = 0; g < 8; g++)
                if (g < G) {
                    const int2 pair = *reinterpret_cast<const int2*>(&q8w[g * (D >> 2) + at]);
                    acc[g] = __dp4a(lo, pair.x, acc[g]);
                    acc[g] = __dp4a(hi, pair.y, acc[g]);
                }
        }
    }
#pragma unroll
    for (int g = 0; g < 8; g++) v[g] = g < G ? (float)(acc[g] - q8z[g]) * (q8t[g] * scale) : 0.f;
}

// The same in floats against the query itself (qs: [G][D], 16-byte aligned); ts is temp times
// the token's key scale. Per head, channels in order: the sum is the same whatever the loads'
// width. Nibbles become floats by their bits (2^23 + nibble, less 2^23 + 8: exact), not by
// integer conversion, which an SM does at a quarter of the FMA rate; the query comes four
// channels a shared load. On an H200 the scalar form read the sketch at 0.08 of copy
// bandwidth (109 us a layer at 64k, 8 KV heads).
__device__ __forceinline__ void sketch_token_f32(const uint4* row, int D, int G, const float* qs, float ts,
                                                 float v[8]) {
    float acc[8];
#pragma unroll
    for (int g = 0; g < 8; g++) acc[g] = 0.f;
    for (int w = 0; w < (D >> 5); w++) {
        const uint4 x4 = row[w];
        const unsigned words[4] = {x4.x, x4.y, x4.z, x4.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float x[8];
#pragma unroll
            for (int j = 0; j < 8; j++) x[j] = __uint_as_float(0x4B000000u | ((words[k] >> (4 * j)) & 15u)) - 8388616.f;
            const int c = w * 32 + k * 8;
#pragma unroll
            for (int g = 0; g < 8; g++)
                if (g < G) {
                    const float4 lo = *reinterpret_cast<const float4*>(&qs[g * D + c]);
                    const float4 hi = *reinterpret_cast<const float4*>(&qs[g * D + c + 4]);
                    float a = acc[g];
                    a = fmaf(lo.x, x[0], a);
                    a = fmaf(lo.y, x[1], a);
                    a = fmaf(lo.z, x[2], a);
                    a = fmaf(lo.w, x[3], a);
                    a = fmaf(hi.x, x[4], a);
                    a = fmaf(hi.y, x[5], a);
                    a = fmaf(hi.z, x[6], a);
                    a = fmaf(hi.w, x[7], a);
                    acc[g] = a;
                }
        }
    }
#pragma unroll
    for (int g = 0; g < 8; g++) v[g] = ts * acc[g];
}

#define SKETCH_WARPS 4
extern "C" __global__ void __launch_bounds__(SKETCH_WARPS * 32)
    sketch_lse(const unsigned long long* pages, int max_pages, int page_tokens, int n_tokens, int block_size,
               int nblocks, const float* q, int G, int D, float temp, int int8, float* lse, int per_warp) {
    // 16-byte aligned: each head's query is read four channels a load (D a multiple of 32).
    __shared__ __align__(16) float qs[8 * MAX_HEAD];
    // int8: per head, D / 8 pairs of words (even channels' bytes, odd channels' bytes) of
    // channels 8k .. 8k + 7; temp * step; 8 sum(q8); and whether any channel is not finite.
    __shared__ __align__(16) int q8w[8 * (MAX_HEAD / 4)];
    __shared__ float q8t[8];
    __shared__ int q8z[8];
    __shared__ float q8bad;
    const int h = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nb = D >> 1;
    // This warp's blocks: `per_warp` in a row, so a CUDA block's query set-up below is paid
    // once for that many (at 64k, 8 KV heads and one block a warp: 4096 CUDA blocks, each
    // rounding the query for 128 tokens' rows).
    const int b_first = (blockIdx.x * SKETCH_WARPS + warp) * per_warp;
    const int b_end = min(b_first + per_warp, nblocks);
    // Asks L2 for the row of this lane's first token of block b (a block of this warp's).
    auto prefetch_block = [&](int b) {
        const int t = b * block_size + lane;
        if (b < b_end && t < n_tokens) {
            const int p = t / page_tokens, r = t - p * page_tokens;
            const unsigned char* page = (const unsigned char*)pages[(long long)h * max_pages + p];
            prefetch_l2(page + (long long)r * nb);
        }
    };
    prefetch_block(b_first);  // on its way while the query is set up
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) qs[i] = q[(long long)h * G * D + i];
    if (threadIdx.x == 0) q8bad = 0.f;
    __syncthreads();
    if (int8) {
        for (int g = warp; g < G; g += SKETCH_WARPS) {
            float amax = 0.f, bad = 0.f;
            for (int c = lane; c < D; c += 32) {
                const float x = qs[g * D + c];
                if (!isfinite(x)) bad = 1.f;
                amax = fmaxf(amax, fabsf(x));
            }
            amax = warp_max(amax);
            bad = warp_max(bad);
            const float step = amax / 127.f;
            const float inv = step > 0.f ? 1.f / step : 0.f;
            float zero = 0.f;  // sums of at most 127 D: exact in floats
            for (int k = lane; k < (D >> 3); k += 32) {
                unsigned even = 0, odd = 0;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int a = (int)fminf(fmaxf(roundf(qs[g * D + 8 * k + 2 * j] * inv), -127.f), 127.f);
                    const int b = (int)fminf(fmaxf(roundf(qs[g * D + 8 * k + 2 * j + 1] * inv), -127.f), 127.f);
                    even |= ((unsigned)a & 0xffu) << (8 * j);
                    odd |= ((unsigned)b & 0xffu) << (8 * j);
                    zero += (float)(a + b);
                }
                q8w[g * (D >> 2) + 2 * k] = (int)even;
                q8w[g * (D >> 2) + 2 * k + 1] = (int)odd;
            }
            zero = warp_sum(zero);
            if (lane == 0) {
                q8t[g] = temp * step;
                q8z[g] = 8 * (int)zero;
                if (bad > 0.f) q8bad = 1.f;
            }
        }
        __syncthreads();
    }
    const bool ints = int8 && q8bad == 0.f;
    for (int b = b_first; b < b_end; b++) {
        prefetch_block(b + 1);  // while this one is scored
        float m[8], s[8];
#pragma unroll
        for (int g = 0; g < 8; g++) {
            m[g] = NEG_INF;
            s[g] = 0.f;
        }
        const int first = b * block_size;
        const int end = min(first + block_size, n_tokens);
        for (int t0 = first; t0 < end; t0 += 32) {
            const int t = t0 + lane;
            if (t < end) {
                const int p = t / page_tokens, r = t - p * page_tokens;
                const unsigned char* page = (const unsigned char*)pages[(long long)h * max_pages + p];
                const uint4* row = (const uint4*)(page + (long long)r * nb);
                const float scale = ((const float*)(page + (long long)page_tokens * nb))[r];
                float v[8];
                if (ints)
                    sketch_token_i8(row, D, G, q8w, q8z, q8t, scale, v);
                else
                    sketch_token_f32(row, D, G, qs, temp * scale, v);
                // A lane's first token starts its (max, sum) as (v, 1): with 32-token blocks it is
                // the lane's only one, and the update's two exp2f (the SFU's, an eighth of the
                // FMA rate) would be two of the three a token and head costs.
                const bool first_here = t0 == first;
#pragma unroll
                for (int g = 0; g < 8; g++)
                    if (g < G) {
                        if (first_here) {
                            m[g] = v[g];
                            s[g] = 1.f;
                        } else {
                            const float mn = fmaxf(m[g], v[g]);
                            s[g] = s[g] * exp2f(m[g] - mn) + exp2f(v[g] - mn);
                            m[g] = mn;
                        }
                    }
            }
        }
        // Lanes without tokens hold (-inf, 0): they add nothing.
#pragma unroll
        for (int g = 0; g < 8; g++) {
            if (g >= G) break;
            const float mx = warp_max(m[g]);
            const float sum = warp_sum(mx == NEG_INF ? 0.f : s[g] * exp2f(m[g] - mx));
            if (lane == 0) lse[((long long)h * nblocks + b) * G + g] = sum > 0.f ? mx + log2f(sum) : NEG_INF;
        }
    }
}

// Step 2: each KV head's block scores from step 1's lse: per query head, its share of every
// block (exp2(lse - total), total the log2-sum-exp2 over the blocks; 0 where it is not
// finite), combined over the group by max (how 0) or sum (how 1). One CUDA block of 256
// threads per KV head (blockIdx.x); scores: [hk][nblocks]. Every head of the group in one
// pass over the blocks for the maxima, one for the sums and one for the shares, each thread's
// figures reduced across its warp by shuffles and across the 8 warps in shared memory: two
// barriers in all, where a tree per head and figure took 16 per head (80 for a group of 5).
#define SHARES_THREADS 256
extern "C" __global__ void __launch_bounds__(SHARES_THREADS)
    sketch_shares(const float* lse, int nblocks, int G, int how, float* scores) {
    __shared__ float red[2][SHARES_THREADS / 32][8];
    const int h = blockIdx.x;
    const float* l = lse + (long long)h * nblocks * G;
    float* out = scores + (long long)h * nblocks;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float mx[8], sum[8];
#pragma unroll
    for (int g = 0; g < 8; g++) {
        mx[g] = NEG_INF;
        sum[g] = 0.f;
    }
    for (int b = threadIdx.x; b < nblocks; b += SHARES_THREADS)
#pragma unroll
        for (int g = 0; g < 8; g++)
            if (g < G) mx[g] = fmaxf(mx[g], l[(long long)b * G + g]);
#pragma unroll
    for (int g = 0; g < 8; g++)
        if (g < G) {
            const float m = warp_max(mx[g]);
            if (lane == 0) red[0][warp][g] = m;
        }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < 8; g++)
        if (g < G) {
            float m = NEG_INF;
            for (int w = 0; w < SHARES_THREADS / 32; w++) m = fmaxf(m, red[0][w][g]);
            mx[g] = m;
        }
    for (int b = threadIdx.x; b < nblocks; b += SHARES_THREADS)
#pragma unroll
        for (int g = 0; g < 8; g++)
            if (g < G && mx[g] != NEG_INF) sum[g] += exp2f(l[(long long)b * G + g] - mx[g]);
#pragma unroll
    for (int g = 0; g < 8; g++)
        if (g < G) {
            const float s = warp_sum(sum[g]);
            if (lane == 0) red[1][warp][g] = s;
        }
    __syncthreads();
    float total[8];
#pragma unroll
    for (int g = 0; g < 8; g++) {
        float s = 0.f;
        if (g < G)
            for (int w = 0; w < SHARES_THREADS / 32; w++) s += red[1][w][g];
        total[g] = mx[g] + log2f(s);
    }
    for (int b = threadIdx.x; b < nblocks; b += SHARES_THREADS) {
        float o = how == 0 ? NEG_INF : 0.f;
#pragma unroll
        for (int g = 0; g < 8; g++)
            if (g < G) {
                const float share = isfinite(total[g]) ? exp2f(l[(long long)b * G + g] - total[g]) : 0.f;
                o = how == 0 ? fmaxf(o, share) : o + share;
            }
        out[b] = o;
    }
}

// A score as an unsigned key in the same order, NaN lowest (below -inf) and -0 below +0, as
// attention::select's score_key makes it: the bits with the sign flipped for positives and
// every bit flipped for negatives.
__device__ __forceinline__ unsigned score_key(float s) {
    const unsigned u = __float_as_uint(s);
    return s != s ? 0u : u ^ ((unsigned)((int)u >> 31) | 0x80000000u);
}

// Step 3 (optional): the best blocks of `from .. to` by the step-2 scores (scores [hk][nblocks]),
// ranked as attention::select ranks them on the host: higher score first, NaN last, -0 below
// +0, and of equal scores the lower (head, block). Each CUDA block takes `rows` heads together
// (1: each head its own k; every head: the layer's shared budget) and writes its k picks, as
// (head - its first head) * nblocks + block, ascending: picks [gridDim.x][k] (k is cut to the
// candidates). Only these come back to the host, not every score. The candidates, at most
// TOP_MAX (64k tokens of 32-token blocks for 8 heads together), sit in registers; a radix
// select finds the k-th best key 8 bits a pass (a 256-bin histogram of the keys that match
// the bits found so far; warp 0 finds the bin where the count from the top reaches k), then
// one pass in candidate order keeps every key above it and the first of those equal to it,
// written at their rank by warp ballots.
#define TOP_THREADS 512
#define TOP_PER_THREAD 32
#define TOP_MAX (TOP_THREADS * TOP_PER_THREAD)
// How many of the CUDA block's threads whose `p` holds come before this one, in thread order;
// `*all`: how many in all. `counts`: a word a warp. One barrier; the caller's next one must
// come before `counts` is written again.
__device__ __forceinline__ unsigned top_rank(bool p, unsigned* counts, unsigned* all) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned b = __ballot_sync(0xffffffffu, p);
    if (lane == 0) counts[warp] = __popc(b);
    __syncthreads();
    unsigned before = __popc(b & ((1u << lane) - 1u)), sum = 0;
    for (int w = 0; w < TOP_THREADS / 32; w++) {
        before += w < warp ? counts[w] : 0u;
        sum += counts[w];
    }
    *all = sum;
    return before;
}
extern "C" __global__ void __launch_bounds__(TOP_THREADS)
    top_blocks(const float* scores, int nblocks, int from, int to, int rows, int k, unsigned* picks) {
    __shared__ unsigned hist[256];
    __shared__ unsigned found[2];
    __shared__ unsigned counts[2][TOP_THREADS / 32];
    const float* s = scores + (long long)blockIdx.x * rows * nblocks;
    unsigned* out = picks + (long long)blockIdx.x * k;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int m = to - from, total = rows * m;
    if (m <= 0 || k <= 0 || total > TOP_MAX) return;
    // Candidate i = j * TOP_THREADS + tid: head i / m, block from + i % m.
    unsigned key[TOP_PER_THREAD];
#pragma unroll
    for (int j = 0; j < TOP_PER_THREAD; j++) {
        const int i = j * TOP_THREADS + tid;
        key[j] = i < total ? score_key(s[(long long)(i / m) * nblocks + from + i % m]) : 0u;
    }
    // Every candidate taken where k covers them: above key 0, and all of those at 0.
    unsigned prefix = 0, mask = 0, want = k < total ? k : total;
    for (int shift = 24; shift >= 0 && k < total; shift -= 8) {
        if (tid < 256) hist[tid] = 0;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < TOP_PER_THREAD; j++)
            if (j * TOP_THREADS + tid < total && (key[j] & mask) == prefix)
                atomicAdd(&hist[(key[j] >> shift) & 255u], 1u);
        __syncthreads();
        if (warp == 0) {
            // Lane l counts bins 255 - 8l down to 248 - 8l: the lanes in order, from the top.
            unsigned c[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                c[j] = hist[255 - 8 * lane - j];
                sum += c[j];
            }
            unsigned incl = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned v = __shfl_sync(0xffffffffu, incl, lane - o);
                if (lane >= o) incl += v;
            }
            unsigned acc = incl - sum;
            if (acc < want && want <= incl) {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    if (acc + c[j] >= want) {
                        found[0] = 255u - 8u * lane - j;
                        found[1] = want - acc;
                        break;
                    }
                    acc += c[j];
                }
            }
        }
        __syncthreads();
        // Read before the next pass's second barrier, after which warp 0 writes them again.
        prefix |= found[0] << shift;
        mask |= 255u << shift;
        want = found[1];
    }
    // prefix: the k-th best key; `want` of the keys equal to it are taken, the first ones.
    unsigned eq_seen = 0, written = 0;
#pragma unroll
    for (int j = 0; j < TOP_PER_THREAD; j++) {
        if (j * TOP_THREADS >= total) break;
        const int i = j * TOP_THREADS + tid;
        const bool in = i < total;
        const bool eq = in && key[j] == prefix;
        unsigned eq_all, all;
        const unsigned eq_rank = eq_seen + top_rank(eq, counts[0], &eq_all);
        const bool take = in && (key[j] > prefix || (eq && eq_rank < want));
        const unsigned at = written + top_rank(take, counts[1], &all);
        if (take) out[at] = (unsigned)((i / m) * nblocks + from + i % m);
        eq_seen += eq_all;
        written += all;
        __syncthreads();
    }
}

// place_picks (#21 item 4): the list of a resident layer's sequence whose device plans it
// alone. One CUDA block per such sequence lays out its KV heads' entries of the attention's
// list: each head's sink, its picks (`top_blocks`' places, ascending) and its window, each
// pick's arena slot read from the sequence's block table of the layer (`[head][stride]`: the
// arena slot of each block the device holds whole, PLACE_NONE elsewhere), and the heads'
// starts. The host leaves the sequence's range as every head's fixed entries (the sink, then
// the window) in head order, then one placeholder a pick. A pick outside the cut or without a
// slot becomes an empty entry over the head's sink (the host refuses such picks after the
// step); picks out of order stay inside their head's range. Job words (i64): entry start,
// first head, heads, fixed entries a head, picks a group (k), heads a group (rows), scored
// blocks, cut from, cut to, picks address, table address, table stride.
#define PLACE_WORDS 12
#define PLACE_THREADS 256
#define PLACE_MAX_HEADS 64
#define PLACE_MAX_FIXED 1024
#define PLACE_NONE 0xffffffffu
// The head of pick `i` (place `place`, in group i / k of `rows` heads): as the host reads it,
// kept inside the group and the heads.
__device__ __forceinline__ int place_head(unsigned place, int i, int k, int rows, long long blocks, int hk) {
    const long long within = (long long)place / blocks;
    const int h = (i / k) * rows + (int)(within < rows - 1 ? within : rows - 1);
    return h < hk - 1 ? h : hk - 1;
}
extern "C" __global__ void __launch_bounds__(PLACE_THREADS)
    place_picks(long long* offs, int* lens, int* head_start, const long long* jobs, long long slot_bytes,
                int block_size) {
    __shared__ long long f_off[PLACE_MAX_FIXED];
    __shared__ int f_len[PLACE_MAX_FIXED];
    __shared__ unsigned count[PLACE_MAX_HEADS], first[PLACE_MAX_HEADS];
    __shared__ int base[PLACE_MAX_HEADS];
    const long long* j = jobs + (long long)blockIdx.x * PLACE_WORDS;
    const int start = (int)j[0], h0 = (int)j[1], hk = (int)j[2], w1 = (int)j[3], k = (int)j[4], rows = (int)j[5];
    const long long blocks = j[6], from = j[7], to = j[8], stride = j[11];
    const unsigned* picks = (const unsigned*)j[9];
    const unsigned* table = (const unsigned*)j[10];
    const int tid = threadIdx.x, nf = hk * w1;
    // The host sends none of these (each block returns as a whole: no barrier is left waiting).
    if (hk <= 0 || hk > PLACE_MAX_HEADS || w1 <= 0 || nf > PLACE_MAX_FIXED || rows <= 0 || hk % rows != 0 ||
        k <= 0 || blocks <= 0 || to > stride)
        return;
    const int total = hk / rows * k;
    for (int i = tid; i < nf; i += blockDim.x) {
        f_off[i] = offs[start + i];
        f_len[i] = lens[start + i];
    }
    if (tid < hk) {
        count[tid] = 0;
        first[tid] = 0xffffffffu;
    }
    __syncthreads();
    for (int i = tid; i < total; i += blockDim.x) {
        const int h = place_head(picks[i], i, k, rows, blocks, hk);
        atomicAdd(&count[h], 1u);
        atomicMin(&first[h], (unsigned)i);
    }
    __syncthreads();
    if (tid == 0) {
        int at = start;
        for (int h = 0; h < hk; h++) {
            base[h] = at;
            head_start[h0 + h] = at;
            at += w1 + (int)count[h];
        }
    }
    __syncthreads();
    for (int i = tid; i < nf; i += blockDim.x) {
        const int h = i / w1, e = i % w1;
        const int at = base[h] + (e == 0 ? 0 : (int)count[h] + e);
        offs[at] = f_off[i];
        lens[at] = f_len[i];
    }
    for (int i = tid; i < total; i += blockDim.x) {
        const unsigned place = picks[i];
        const int h = place_head(place, i, k, rows, blocks, hk);
        const long long b = (long long)place % blocks;
        const unsigned rank = min((unsigned)i - first[h], count[h] - 1u);
        const int at = base[h] + 1 + (int)rank;
        const unsigned slot = (b >= from && b < to) ? table[(long long)h * stride + b] : PLACE_NONE;
        offs[at] = slot == PLACE_NONE ? f_off[h * w1] : (long long)slot * slot_bytes;
        lens[at] = slot == PLACE_NONE ? 0 : block_size;
    }
}
