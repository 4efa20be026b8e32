// CUDA's bit casts and the few intrinsics kernels.cu uses, as host C++, for both shims
// (shim.h: one thread per block; simt.h: a thread per CUDA thread).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
struct D3 { unsigned x, y, z; };
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
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct uint3 { unsigned x, y, z; };
static inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return {x, y, z}; }
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
static inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
// Byte i of the result is byte (s >> 4i) & 7 of the eight bytes y:x (x's lowest first).
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long b = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)((b >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
struct alignas(8) int2 { int x, y; };
// c plus the products of a's and b's bytes as signed 8-bit integers.
static inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
}
struct alignas(16) float4 { float x, y, z, w; };
#define __align__(n) __attribute__((aligned(n)))
using std::max;
using std::min;
using std::isfinite;
