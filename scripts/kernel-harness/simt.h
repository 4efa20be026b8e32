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
