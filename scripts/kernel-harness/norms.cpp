// `rms_norm`, `rms_norm_half` and `silu_mul_stacked_half` run on the host (see shim.h) against
// the host path: `Backend::rms_norm` (f32, summed in order) and HF's SiLU-mul, then the
// rounding `f32_to_half` applies. One thread sums in the host's order, so every value must be
// bit-equal. Exit status 1 on any difference.
#include "shim.h"
#include "../../attention/src/cuda/kernels.cu"
#include <cstdio>
#include <random>
#include <vector>

static std::mt19937 rng(11);
static std::vector<float> rnd(size_t n, float amp) {
    std::uniform_real_distribution<float> u(-amp, amp);
    std::vector<float> v(n);
    for (auto& x : v) x = u(rng);
    return v;
}

static int bad = 0;
static void same_bits(const char* what, const void* got, const void* want, size_t bytes) {
    if (memcmp(got, want, bytes) != 0 && bad++ < 10) printf("%s differs\n", what);
}

static u16 to_half(float y, int dtype) { return dtype == 1 ? f32_to_f16(y) : f32_to_bf16(y); }

int main() {
    int cases = 0;
    for (int dim : {64, 576, 5120})
        for (int rows : {1, 3}) {
            std::vector<float> x = rnd((size_t)rows * dim, 3.f), w = rnd(dim, 2.f);
            float eps = 1e-5f;
            std::vector<float> want((size_t)rows * dim), got(want.size());
            for (int r = 0; r < rows; r++) {
                const float* xr = &x[(size_t)r * dim];
                float ms = 0.f;
                for (int i = 0; i < dim; i++) ms += xr[i] * xr[i];
                ms /= dim;
                float inv = 1.f / sqrtf(ms + eps);
                for (int i = 0; i < dim; i++) want[(size_t)r * dim + i] = w[i] * (xr[i] * inv);
            }
            for (unsigned r = 0; r < (unsigned)rows; r++) {
                blockIdx = {r, 0, 0};
                rms_norm(x.data(), w.data(), got.data(), dim, eps);
            }
            same_bits("rms_norm", got.data(), want.data(), want.size() * 4);
            for (int dtype : {1, 2}) {
                std::vector<u16> h(want.size()), wh(want.size());
                for (size_t i = 0; i < want.size(); i++) wh[i] = to_half(want[i], dtype);
                for (unsigned r = 0; r < (unsigned)rows; r++) {
                    blockIdx = {r, 0, 0};
                    rms_norm_half(x.data(), w.data(), h.data(), dim, eps, dtype);
                }
                same_bits("rms_norm_half", h.data(), wh.data(), h.size() * 2);
                cases++;
            }
        }
    for (int inter : {96, 1536})
        for (int rows : {1, 4})
            for (int dtype : {1, 2}) {
                long long n = (long long)rows * inter;
                std::vector<float> gu = rnd((size_t)n * 2, 6.f), f(n);
                std::vector<u16> h(n), wh(n);
                // One thread per element in the kernel: run the grid's threads one by one.
                for (long long j = 0; j < n; j++) {
                    blockIdx = {(unsigned)(j / 256), 0, 0};
                    threadIdx = {(unsigned)(j % 256), 0, 0};
                    blockDim = {256, 1, 1};
                    silu_mul_stacked(gu.data(), f.data(), inter, n);
                    silu_mul_stacked_half(gu.data(), h.data(), inter, n, dtype);
                }
                threadIdx = {0, 0, 0};
                blockDim = {1, 1, 1};
                for (long long j = 0; j < n; j++) {
                    long long row = j / inter, i = j % inter;
                    float g = gu[row * 2 * inter + i];
                    float want = g / (1.f + expf(-g)) * gu[row * 2 * inter + inter + i];
                    same_bits("silu_mul_stacked", &f[j], &want, 4);
                    wh[j] = to_half(want, dtype);
                }
                same_bits("silu_mul_stacked_half", h.data(), wh.data(), n * 2);
                cases++;
            }
    printf("norm and SiLU kernels: %d cases, %d differ\n", cases, bad);
    return bad ? 1 : 0;
}
