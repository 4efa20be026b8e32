// `gemv_b{B}` run with 256 threads per block on the host (see simt.h) against the product
// computed here in double precision: every batch size, f16 and bf16, a width that leaves a
// tail after the four-loads-per-lane loop, a row count that leaves warps idle, and beta 0
// (y holds NaN and must not be read) and 1 (a residual add). Exit status 1 beyond float
// rounding.
#include "simt.h"
#include "../../attention/src/cuda/kernels.cu"
#include <cstdio>
#include <random>

static std::mt19937 rng(5);
static int bad = 0;
typedef void (*Gemv)(const unsigned char*, const unsigned char*, float*, int, int, int, float);
static const Gemv kernels[8] = {gemv_b1, gemv_b2, gemv_b3, gemv_b4, gemv_b5, gemv_b6, gemv_b7, gemv_b8};

static void check(int batch, int rows, int cols, int dtype, float beta) {
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    auto make = [&](size_t n, std::vector<float>& vals) {
        std::vector<uint4> store(n / 8 + 1);
        u16* p = (u16*)store.data();
        vals.resize(n);
        for (size_t i = 0; i < n; i++) {
            const float v = u(rng);
            p[i] = dtype == 2 ? f32_to_bf16(v) : f32_to_f16(v);
            vals[i] = dtype == 2 ? bf16_to_f32(p[i]) : f16_to_f32(p[i]);
        }
        return store;
    };
    std::vector<float> wv, xv;
    auto w = make((size_t)rows * cols, wv);
    auto x = make((size_t)batch * cols, xv);
    std::vector<float> y((size_t)batch * rows), y0(y.size());
    for (auto& v : y0) v = beta != 0.f ? u(rng) : NAN;
    y = y0;
    launch({(unsigned)((rows + GEMV_WARPS - 1) / GEMV_WARPS), 1, 1}, GEMV_WARPS * 32, [&] {
        kernels[batch - 1]((const unsigned char*)w.data(), (const unsigned char*)x.data(), y.data(), rows, cols, dtype,
                           beta);
    });
    double worst = 0;
    for (int b = 0; b < batch; b++)
        for (int r = 0; r < rows; r++) {
            double want = beta != 0.f ? beta * (double)y0[(size_t)b * rows + r] : 0.0;
            double mag = fabs(want);
            for (int c = 0; c < cols; c++) {
                const double t = (double)wv[(size_t)r * cols + c] * xv[(size_t)b * cols + c];
                want += t;
                mag += fabs(t);
            }
            worst = std::max(worst, fabs(y[(size_t)b * rows + r] - want) / (1.0 + mag));
        }
    const bool ok = worst < 1e-6 && !std::isnan(worst);
    if (!ok) bad++;
    printf("%s gemv_b%d rows=%d cols=%d %s beta=%g: max err %.2e\n", ok ? "PASS" : "FAIL", batch, rows, cols,
           dtype == 2 ? "bf16" : "f16", beta, worst);
}

int main() {
    for (int b = 1; b <= 8; b++) check(b, 19, 1064, b % 2 ? 2 : 1, b % 3 ? 0.f : 1.f);
    check(1, 8, 8, 2, 0.f);
    check(4, 9, 2048, 1, 1.f);
    return bad ? 1 : 0;
}
