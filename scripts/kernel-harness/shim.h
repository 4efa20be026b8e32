// Host shims that let kernels.cu compile as C++ and run one CUDA block with ONE thread
// (blockDim.x == 1): every kernel strides its loops by blockDim.x, so the sequential run
// computes what the block does, and barriers and shared-memory atomics become plain code.
// What this checks is a kernel's logic (selection, sorting, the walk), not its concurrency.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static
struct D3 { unsigned x, y, z; };
static D3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0}, blockDim{1, 1, 1};
static inline void __syncthreads() {}
static inline void __syncwarp() {}
static inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p += v; return o; }
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
static inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
static inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
struct uint4 { unsigned x, y, z, w; };
using std::max;
using std::min;
