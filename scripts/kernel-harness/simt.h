// Host shims that run one CUDA block of kernels.cu with one std::thread per CUDA thread, so
// that kernels whose lanes hold different data (warp shuffles, per-warp work) run as on the
// device: `__syncthreads` and `__syncwarp` are barriers, `__shfl_xor_sync` exchanges through
// a per-warp mailbox between two warp barriers. Every lane of a warp must reach each shuffle
// and barrier (the kernels' control flow is warp-uniform there, as the device requires).
// Slow (a context switch per barrier); meant for small grids. shim.h is the one-thread shim.
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static
struct D3 { unsigned x, y, z; };
static thread_local D3 threadIdx{0, 0, 0};
static D3 blockIdx{0, 0, 0}, blockDim{1, 1, 1};

struct Simt {
    std::unique_ptr<std::barrier<>> block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<float> mailbox;  // [warp][lane]
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
static inline unsigned atomicAdd(unsigned* p, unsigned v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
static inline double __hiloint2double(int hi, int lo) {
    uint64_t b = ((uint64_t)(unsigned)hi << 32) | (unsigned)lo;
    double d;
    memcpy(&d, &b, 8);
    return d;
}
static inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
struct uint4 { unsigned x, y, z, w; };
using std::max;
using std::min;

// Runs `kernel` over `grid` with `threads` threads per block (a multiple of 32), one block
// after another.
template <class F>
static void launch(D3 grid, unsigned threads, F kernel) {
    blockDim = {threads, 1, 1};
    simt.block = std::make_unique<std::barrier<>>(threads);
    simt.warps.clear();
    for (unsigned w = 0; w < threads / 32; w++) simt.warps.push_back(std::make_unique<std::barrier<>>(32));
    simt.mailbox.assign(threads, 0.f);
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
