// `sketch_lse` then `sketch_shares` run with a thread per CUDA thread (see simt.h) against the
// scores of attention::sketch computed here in double precision from its definition: head
// dims 64 and 128, groups 1, 5 and 8, 16-, 32- and 64-token blocks, one or several blocks a
// warp, a partial last block, tokens
// with scale 0, pages of a size that no block divides, scattered and in no order, with room
// past the tokens, two KV heads, group max and sum. Exit status 1 beyond float rounding.
// Each shape in floats and in integers (int8 = 1: against the definition with the query
// rounded as attention::sketch::round_query_i8 rounds it, and away from the unrounded one,
// so the integer loop is known to have run); a query with a NaN channel scored in floats by
// both. Also `scatter_runs`, which puts a step's new sketch rows in their pages.
#include "simt.h"
#include "../../attention/src/cuda/kernels.cu"
#include <cstdio>
#include <random>

static std::mt19937 rng(9);
static int bad = 0;

// q rounded per head of D channels as attention::sketch::round_query_i8 rounds it: step *
// q8, q8 = round(q * (1 / step)) clamped to 127, step = max |q| / 127 (in floats).
static std::vector<float> rounded(const std::vector<float>& q, int D) {
    std::vector<float> out(q.size());
    for (size_t h = 0; h < q.size() / D; h++) {
        float amax = 0.f;
        for (int c = 0; c < D; c++) amax = std::max(amax, fabsf(q[h * D + c]));
        const float step = amax / 127.f, inv = step > 0.f ? 1.f / step : 0.f;
        for (int c = 0; c < D; c++)
            out[h * D + c] = step * std::min(std::max(roundf(q[h * D + c] * inv), -127.f), 127.f);
    }
    return out;
}

static void check(int hk, int D, int G, int bs, int n, int page_tokens, int how, int int8, int per_warp = 1) {
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    const int nb = D / 2;
    const int nblocks = (n + bs - 1) / bs;
    const int max_pages = (n + page_tokens - 1) / page_tokens + 1;  // a spare, as the table may have
    // Every page its own allocation; the table lists them per head, in an order unrelated to
    // where they sit.
    const size_t page_bytes = (size_t)page_tokens * (nb + 4);
    std::vector<std::vector<uint4>> store((size_t)hk * max_pages, std::vector<uint4>(page_bytes / 16 + 1));
    std::vector<unsigned long long> pages((size_t)hk * max_pages);
    for (size_t i = 0; i < pages.size(); i++) pages[i] = (unsigned long long)store[(i * 7 + 3) % pages.size()].data();
    // The token-major sketch the reference reads, copied into the pages.
    std::vector<unsigned char> nib((size_t)hk * n * nb);
    std::vector<float> scl((size_t)hk * n), q((size_t)hk * G * D);
    for (auto& x : nib) x = (unsigned char)(rng() & 0xff);
    for (size_t i = 0; i < scl.size(); i++) scl[i] = (i % 11 == 3) ? 0.f : 0.05f + 0.2f * fabsf(u(rng));
    for (auto& x : q) x = 3.f * u(rng);
    for (int h = 0; h < hk; h++)
        for (int t = 0; t < n; t++) {
            unsigned char* page = (unsigned char*)pages[(size_t)h * max_pages + t / page_tokens];
            const int r = t % page_tokens;
            memcpy(page + (size_t)r * nb, &nib[((size_t)h * n + t) * nb], nb);
            memcpy(page + (size_t)page_tokens * nb + (size_t)r * 4, &scl[(size_t)h * n + t], 4);
        }
    const float temp = 0.125f * 1.4426950408889634f;
    std::vector<float> lse((size_t)hk * nblocks * G), scores((size_t)hk * nblocks);
    const int per_cta = SKETCH_WARPS * per_warp;
    launch({(unsigned)((nblocks + per_cta - 1) / per_cta), (unsigned)hk, 1}, SKETCH_WARPS * 32, [&] {
        sketch_lse(pages.data(), max_pages, page_tokens, n, bs, nblocks, q.data(), G, D, temp, int8, lse.data(),
                   per_warp);
    });
    launch({(unsigned)hk, 1, 1}, SHARES_THREADS, [&] { sketch_shares(lse.data(), nblocks, G, how, scores.data()); });
    // The integer loop's worst against the unrounded query too: it must show the rounding.
    double moved = 0;
    for (int pass = int8; pass >= 0; pass--) {
    const std::vector<float> qr = pass ? rounded(q, D) : q;
    double worst = 0;
    for (int h = 0; h < hk; h++) {
        std::vector<double> want(nblocks, how == 0 ? -INFINITY : 0.0);
        for (int g = 0; g < G; g++) {
            std::vector<double> l(nblocks);
            for (int b = 0; b < nblocks; b++) {
                std::vector<double> v;
                for (int t = b * bs; t < std::min(n, (b + 1) * bs); t++) {
                    double dot = 0;
                    for (int c = 0; c < D; c++) {
                        const int byte = nib[((size_t)h * n + t) * nb + c / 2];
                        const int x = ((byte >> (4 * (c % 2))) & 15) - 8;
                        dot += (double)qr[((size_t)h * G + g) * D + c] * x;
                    }
                    v.push_back((double)temp * scl[(size_t)h * n + t] * dot);
                }
                double m = -INFINITY, s = 0;
                for (double x : v) m = std::max(m, x);
                for (double x : v) s += exp2(x - m);
                l[b] = m + log2(s);
                const double got = lse[((size_t)h * nblocks + b) * G + g];
                worst = std::max(worst, fabs(got - l[b]) / (1.0 + fabs(l[b])));
            }
            double m = -INFINITY, s = 0;
            for (double x : l) m = std::max(m, x);
            for (double x : l) s += exp2(x - m);
            const double total = m + log2(s);
            for (int b = 0; b < nblocks; b++) {
                const double share = exp2(l[b] - total);
                want[b] = how == 0 ? std::max(want[b], share) : want[b] + share;
            }
        }
        for (int b = 0; b < nblocks; b++)
            worst = std::max(worst, fabs((double)scores[(size_t)h * nblocks + b] - want[b]));
    }
    if (pass == 0 && int8) {
        moved = worst;
        break;
    }
    const bool ok = worst < 2e-5 && !std::isnan(worst);
    if (!ok) bad++;
    printf("%s sketch %s hk=%d D=%d G=%d bs=%d n=%d page=%d %s, %d block(s) a warp: max err %.2e\n",
           ok ? "PASS" : "FAIL", int8 ? "int8" : "f32", hk, D, G, bs, n, page_tokens, how == 0 ? "max" : "sum",
           per_warp, worst);
    }
    if (int8) {
        const bool ok = moved > 1e-4;
        if (!ok) bad++;
        printf("%s sketch int8 differs from the unrounded query's scores: %.2e\n", ok ? "PASS" : "FAIL", moved);
    }
}

// A KV head whose query has a NaN channel: the integer mode scores it in floats, bit for bit
// as the float mode does (NaN where that gives NaN); the other head in integers.
static void check_nan_query() {
    const int hk = 2, D = 64, G = 3, bs = 16, n = 16 * 6 + 5, page_tokens = 40, nb = D / 2;
    const int nblocks = (n + bs - 1) / bs, max_pages = (n + page_tokens - 1) / page_tokens;
    std::vector<std::vector<uint4>> store((size_t)hk * max_pages, std::vector<uint4>(page_tokens * (nb + 4) / 16 + 1));
    std::vector<unsigned long long> pages(store.size());
    for (size_t i = 0; i < pages.size(); i++) {
        unsigned char* p = (unsigned char*)store[i].data();
        for (int t = 0; t < page_tokens; t++) {
            for (int j = 0; j < nb; j++) p[t * nb + j] = (unsigned char)(rng() & 0xff);
            const float sc = 0.1f;
            memcpy(p + page_tokens * nb + 4 * t, &sc, 4);
        }
        pages[i] = (unsigned long long)p;
    }
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    std::vector<float> q((size_t)hk * G * D);
    for (auto& x : q) x = 2.f * u(rng);
    q[G * D + D + 7] = NAN;  // head 1, query head 1
    std::vector<float> lse_f((size_t)hk * nblocks * G), lse_i(lse_f.size());
    for (int int8 = 0; int8 < 2; int8++)
        launch({(unsigned)((nblocks + SKETCH_WARPS - 1) / SKETCH_WARPS), (unsigned)hk, 1}, SKETCH_WARPS * 32, [&] {
            sketch_lse(pages.data(), max_pages, page_tokens, n, bs, nblocks, q.data(), G, D, 0.2f, int8,
                       (int8 ? lse_i : lse_f).data(), 1);
        });
    int same = 0, differ = 0;
    for (size_t i = 0; i < lse_f.size(); i++) {
        const bool eq = (std::isnan(lse_f[i]) && std::isnan(lse_i[i])) || lse_f[i] == lse_i[i];
        if (i >= (size_t)nblocks * G) same += eq;  // head 1: floats in both
        else differ += !eq;                        // head 0: integers, rounded
    }
    const bool ok = same == nblocks * G && differ > 0;
    if (!ok) bad++;
    printf("%s sketch int8 with a NaN query channel: %d of %d equal to floats, %d moved by rounding\n",
           ok ? "PASS" : "FAIL", same, nblocks * G, differ);
}

// `scatter_runs`: runs of 0 to 300 bytes (a token's scale, its nibble row, a page table) from
// one staged buffer to places in their own allocations, each written exactly, nothing around
// it touched.
static void check_scatter() {
    const int n = 40;
    std::vector<unsigned char> staged;
    std::vector<unsigned long long> runs(3 * n);
    std::vector<std::vector<unsigned char>> dst(n);
    for (int i = 0; i < n; i++) {
        const int len = i == 7 ? 0 : (i % 3 == 0 ? 4 : (int)(rng() % 300) + 1);
        runs[3 * i] = staged.size();
        for (int b = 0; b < len; b++) staged.push_back((unsigned char)(rng() & 0xff));
        dst[i].assign(len + 32, 0xA5);
        runs[3 * i + 1] = (unsigned long long)(dst[i].data() + 16);
        runs[3 * i + 2] = len;
    }
    launch({(unsigned)n, 1, 1}, 128, [&] { scatter_runs(staged.data(), runs.data(), n); });
    int wrong = 0;
    for (int i = 0; i < n; i++) {
        const int len = (int)runs[3 * i + 2];
        for (int b = 0; b < len + 32; b++) {
            const bool inside = b >= 16 && b < 16 + len;
            const unsigned char want = inside ? staged[runs[3 * i] + b - 16] : 0xA5;
            wrong += dst[i][b] != want;
        }
    }
    if (wrong) bad++;
    printf("%s scatter_runs n=%d: %d wrong bytes\n", wrong ? "FAIL" : "PASS", n, wrong);
}

int main() {
    check_scatter();
    for (int int8 = 0; int8 < 2; int8++) {
        check(2, 128, 5, 32, 32 * 9 + 7, 240, 0, int8);
        check(1, 64, 3, 16, 16 * 5 + 1, 27, 1, int8);
        check(2, 64, 8, 32, 32 * 4, 128, 0, int8);
        check(1, 128, 1, 16, 16 * 9 + 15, 61, 1, int8);
    }
    // More blocks than sketch_shares has threads: each thread takes several.
    check(1, 64, 3, 16, 16 * 600 + 3, 200, 0, 1);
    check(1, 32, 2, 32, 32 * 300, 96, 1, 0);
    // 64-token blocks: two tokens a lane, the second through the running (max, sum).
    check(2, 64, 5, 64, 64 * 7 + 40, 100, 0, 1);
    check(1, 128, 3, 64, 64 * 5 + 1, 130, 1, 0);
    // Several blocks a warp (a CUDA block's query set-up shared by more of them), the last
    // warp's run cut short by the end, and with 64-token blocks.
    check(2, 128, 5, 32, 32 * 45 + 7, 240, 0, 1, 3);
    check(1, 64, 8, 16, 16 * 37, 27, 1, 0, 4);
    check(2, 64, 5, 64, 64 * 13 + 40, 100, 1, 1, 2);
    check_nan_query();
    return bad ? 1 : 0;
}
