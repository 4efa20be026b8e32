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

// RMSNorm of each row (one CUDA block per row), as HF computes it in f32.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int dim, float eps) {
    __shared__ float partial[32];
    const float* xr = x + (long long)blockIdx.x * dim;
    float* or_ = out + (long long)blockIdx.x * dim;
    float s = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i] * xr[i];
    s = warp_sum(s);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x + 31) / 32 ? partial[threadIdx.x] : 0.f;
        v = warp_sum(v);
        if (threadIdx.x == 0) partial[0] = v;
    }
    __syncthreads();
    float inv = rsqrtf(partial[0] / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) or_[i] = w[i] * (xr[i] * inv);
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
#define ATT_THREADS 128
#define ATT_WARPS 4
#define MAX_G 8
#define MAX_D 128
#define TILE 32
extern "C" __global__ void sparse_attention_split(
    const unsigned char* arena, const long long* offs, const int* lens, const int* head_start,
    const float* q, int group, int head_dim, int block_size, int dtype, float scale,
    int chunk, int splits, float* part_out, float* part_lse) {
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
    const int b0 = head_start[h] + s * chunk;
    const int b1 = min(b0 + chunk, head_start[h + 1]);
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

// Merges the splits of `sparse_attention_split`: one CUDA block per query head (h, g);
// out [h][group][head_dim], lse2 [h][group]. A head with no blocks gets (0, -inf).
extern "C" __global__ void combine_splits(const float* part_out, const float* part_lse, int splits,
                                          int group, int head_dim, float* out, float* lse2) {
    const int hg = blockIdx.x;
    const int h = hg / group, g = hg % group;
    float mx = NEG_INF;
    for (int s = 0; s < splits; s++) mx = fmaxf(mx, part_lse[((long long)h * splits + s) * group + g]);
    float total = 0.f;
    if (mx != NEG_INF)
        for (int s = 0; s < splits; s++) total += exp2f(part_lse[((long long)h * splits + s) * group + g] - mx);
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float o = 0.f;
        if (mx != NEG_INF)
            for (int s = 0; s < splits; s++) {
                const long long i = ((long long)h * splits + s) * group + g;
                const float w = exp2f(part_lse[i] - mx);
                if (w > 0.f) o += w * part_out[i * head_dim + c];
            }
        out[(long long)hg * head_dim + c] = mx != NEG_INF ? o / total : 0.f;
    }
    if (threadIdx.x == 0) lse2[hg] = mx != NEG_INF ? mx + log2f(total) : NEG_INF;
}

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
