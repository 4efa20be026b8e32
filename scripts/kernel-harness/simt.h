// Host shims that run one CUDA block of kernels.cu with one std::thread per CUDA thread, so
// that kernels whose lanes hold different data (warp shuffles, per-warp work) run as on the
// device: `__syncthreads` and `__syncwarp` are barriers, `__shfl_xor_sync` exchanges through
// a per-warp mailbox between two warp barriers. Every lane of a warp must reach each shuffle
// and barrier (the kernels' control flow is warp-uniform there, as the device requires).
// Slow (a context switch per barrier); meant for small grids. shim.h is the one-thread shim.
#include "intrinsics.h"
#include <barrier>
#include <memory>
#include <thread>
#include <vector>
static thread_local D3 threadIdx{0, 0, 0};
static D3 blockIdx{0, 0, 0}, blockDim{1, 1, 1};

struct Simt {
    std::unique_ptr<std::barrier<>> block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<float> mailbox;  // [warp][lane]
    std::vector<unsigned> fragments;  // [warp][lane][6]: an MMA's a0..a3, b0, b1
};
static Simt simt;

static inline void __syncthreads() { simt.block->arrive_and_wait(); }
static inline void __syncwarp() { simt.warps[threadIdx.x / 32]->arrive_and_wait(); }
static inline float __shfl_xor_sync(unsigned, float v, int o) {
    const unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
    simt.mailbox[w * 32 + lane] = v;
    __syncwarp();
    const float r = simt.mailbox[w * 32 + (lane ^ (unsigned)o)];
    __syncwarp();
    return r;
}
static inline float __shfl_sync(unsigned, float v, int src) {
    const unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
    simt.mailbox[w * 32 + lane] = v;
    __syncwarp();
    const float r = simt.mailbox[w * 32 + ((unsigned)src & 31)];
    __syncwarp();
    return r;
}
static inline unsigned __shfl_sync(unsigned m, unsigned v, int src) {
    return __float_as_uint(__shfl_sync(m, __uint_as_float(v), src));
}
// The warp's predicates as a bit mask, lane i at bit i.
static inline unsigned __ballot_sync(unsigned, bool p) {
    const unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
    simt.mailbox[w * 32 + lane] = p ? 1.f : 0.f;
    __syncwarp();
    unsigned m = 0;
    for (unsigned l = 0; l < 32; l++) m |= (simt.mailbox[w * 32 + l] != 0.f ? 1u : 0u) << l;
    __syncwarp();
    return m;
}
// kernels.cu's, defined after this.
inline float f16_to_f32(unsigned short h);
inline float bf16_to_f32(unsigned short h);

// `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}` as the PTX ISA lays out its fragments, for
// lane (g = lane / 4, t = lane % 4): A's register j holds row g + 8 (j & 1), k 2t + 8 (j >> 1)
// and the next k (low half first); B's register j holds k 2t + 8j and the next, column g; C's
// c[i] is row g + 8 (i >> 1), column 2t + (i & 1). Each lane posts its registers, then
// computes its four sums from the warp's (in double: the device's rounding order is its own).
#define HAVE_MMA 1
static inline void mma_m16n8k16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                unsigned b1, int dtype) {
    const unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
    unsigned* box = &simt.fragments[w * 32 * 6];
    const unsigned mine[6] = {a0, a1, a2, a3, b0, b1};
    for (int i = 0; i < 6; i++) box[lane * 6 + i] = mine[i];
    __syncwarp();
    auto half = [&](unsigned reg, int k) {
        const unsigned short h = (k & 1) ? (unsigned short)(reg >> 16) : (unsigned short)(reg & 0xffffu);
        return (double)(dtype == 2 ? bf16_to_f32(h) : f16_to_f32(h));
    };
    auto a = [&](int row, int k) {
        const int l = (row % 8) * 4 + (k % 8) / 2, reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        return half(box[l * 6 + reg], k);
    };
    auto b = [&](int k, int n) {
        const int l = n * 4 + (k % 8) / 2, reg = 4 + (k >= 8 ? 1 : 0);
        return half(box[l * 6 + reg], k);
    };
    const int g = lane / 4, t = lane % 4;
    float out[4];
    for (int i = 0; i < 4; i++) {
        const int row = g + (i >= 2 ? 8 : 0), n = 2 * t + (i & 1);
        double s = c[i];
        for (int k = 0; k < 16; k++) s += a(row, k) * b(k, n);
        out[i] = (float)s;
    }
    __syncwarp();
    for (int i = 0; i < 4; i++) c[i] = out[i];
}

static inline unsigned atomicAdd(unsigned* p, unsigned v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
static inline unsigned atomicMin(unsigned* p, unsigned v) {
    unsigned old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}

// Runs `kernel` over `grid` with `threads` threads per block (a multiple of 32), one block
// after another.
template <class F>
static void launch(D3 grid, unsigned threads, F kernel) {
    blockDim = {threads, 1, 1};
    simt.block = std::make_unique<std::barrier<>>(threads);
    simt.warps.clear();
    for (unsigned w = 0; w < threads / 32; w++) simt.warps.push_back(std::make_unique<std::barrier<>>(32));
    simt.mailbox.assign(threads, 0.f);
    simt.fragments.assign(threads * 6, 0u);
    for (unsigned y = 0; y < grid.y; y++)
        for (unsigned x = 0; x < grid.x; x++) {
            blockIdx = {x, y, 0};
            std::vector<std::thread> ts;
            for (unsigned t = 0; t < threads; t++)
                ts.emplace_back([t, &kernel] {
                    threadIdx = {t, 0, 0};
                    kernel();
                });
            for (auto& t : ts) t.join();
        }
}
