// `gemv_b{B}` and `gemv_tc` run with 256 threads per block on the host (see simt.h; the
// MMAs of `gemv_tc` as the PTX ISA lays out their fragments) against the product computed
// here in double precision: every batch size, f16 and bf16, a width that leaves a tail after
// the four-loads-per-lane loop (for `gemv_tc`, a part of a 32-column chunk and warps with no
// chunk), a row count that leaves warps (or half a 16-row tile) idle, and beta 0 (y holds
// NaN and must not be read) and 1 (a residual add). Exit status 1 beyond float rounding.
#include "simt.h"
#include "../../attention/src/cuda/kernels.cu"
#include <cstdio>
#include <random>

static std::mt19937 rng(5);
static int bad = 0;
typedef void (*Gemv)(const unsigned char*, const unsigned char*, float*, int, int, int, float);
static const Gemv kernels[8] = {gemv_b1, gemv_b2, gemv_b3, gemv_b4, gemv_b5, gemv_b6, gemv_b7, gemv_b8};

// tc: `gemv_tc` (one launch for any batch) rather than `gemv_b{batch}`.
static void check(int batch, int rows, int cols, int dtype, float beta, bool tc = false) {
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    // Exactly n elements (cols is a multiple of 8): a read past a row's end is outside the
    // allocation, which a build with -fsanitize=address reports.
    auto make = [&](size_t n, std::vector<float>& vals) {
        std::vector<uint4> store(n / 8);
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
    if (tc)
        launch({(unsigned)((rows + 15) / 16), 1, 1}, GEMV_TC_WARPS * 32, [&] {
            gemv_tc((const unsigned char*)w.data(), (const unsigned char*)x.data(), y.data(), rows, cols, batch,
                    dtype, beta);
        });
    else
        launch({(unsigned)((rows + GEMV_WARPS - 1) / GEMV_WARPS), 1, 1}, GEMV_WARPS * 32, [&] {
            kernels[batch - 1]((const unsigned char*)w.data(), (const unsigned char*)x.data(), y.data(), rows, cols,
                               dtype, beta);
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
    printf("%s %s batch=%d rows=%d cols=%d %s beta=%g: max err %.2e\n", ok ? "PASS" : "FAIL",
           tc ? "gemv_tc" : "gemv_b", batch, rows, cols, dtype == 2 ? "bf16" : "f16", beta, worst);
}

int main() {
    for (int b = 1; b <= 8; b++) check(b, 19, 1064, b % 2 ? 2 : 1, b % 3 ? 0.f : 1.f);
    check(1, 8, 8, 2, 0.f);
    check(4, 9, 2048, 1, 1.f);
    // gemv_tc: 1064 columns are 33 chunks and a quarter (8 warps of 5: the seventh has 4,
    // the eighth none); 40 rows are two tiles and half of a third.
    for (int b = 1; b <= 8; b++) check(b, 40, 1064, b % 2 ? 2 : 1, b % 3 ? 0.f : 1.f, true);
    check(8, 16, 8, 2, 0.f, true);
    check(3, 7, 4096, 1, 1.f, true);
    check(8, 33, 40, 2, 1.f, true);
    return bad ? 1 : 0;
}
