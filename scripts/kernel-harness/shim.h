// Host shims that let kernels.cu compile as C++ and run one CUDA block with ONE thread
// (blockDim.x == 1): every kernel strides its loops by blockDim.x, so the sequential run
// computes what the block does, and barriers and shared-memory atomics become plain code.
// What this checks is a kernel's logic (selection, sorting, the walk), not its concurrency.
#include "intrinsics.h"
static D3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0}, blockDim{1, 1, 1};
static inline void __syncthreads() {}
static inline void __syncwarp() {}
static inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p += v; return o; }
static inline unsigned atomicMin(unsigned* p, unsigned v) { unsigned o = *p; *p = v < o ? v : o; return o; }
static inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
static inline float __shfl_sync(unsigned, float v, int) { return v; }
static inline unsigned __shfl_sync(unsigned, unsigned v, int) { return v; }
// One lane: its own predicate. (top_blocks, a warp's work, runs under simt.h.)
static inline unsigned __ballot_sync(unsigned, bool p) { return p ? 1u : 0u; }
