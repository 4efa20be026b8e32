// `attend_warps_g{G}_d{D}` and `_b16` (and, as a check of the SIMT shim itself, the general
// `sparse_attention_split`) run with 128 threads per block on the host (see simt.h), their
// splits merged by `combine_splits`, against attention computed here in double precision from
// the definition: softmax(scale * q.K) V over each head's listed tokens, and its base-2
// log-sum-exp. Heads with a partial newest block (its tail holds NaN), several splits and no
// blocks at all. With ATTEND_PREFETCH in the flags, the same results and the lines asked of L2
// checked: each inside a block the split attends (of V, a written token where the kernel loads
// only those), and every 16 bytes the kernel loads among them. Exit status 1 on any difference
// beyond float rounding.
#include "simt.h"
#include <mutex>
#include <vector>
static std::mutex prefetch_mu;
static std::vector<const unsigned char*> prefetched;
#define HARNESS_PREFETCH(p)                                 \
    do {                                                    \
        std::lock_guard<std::mutex> lock(prefetch_mu);      \
        prefetched.push_back(p);                            \
    } while (0)
#include "../../attention/src/cuda/kernels.cu"
#include <cstdio>
#include <random>
#include <set>

static std::mt19937 rng(11);
static int bad = 0;

typedef void (*Attend)(const unsigned char*, const long long*, const int*, const int*, const float*, int,
                       int, int, int, float, int, int, float*, float*, int);

// How a kernel prefetches, for the checks of its prefetches: 0 flags, none.
struct Prefetching {
    int flags = 0;
    bool v_written = false;  // V loaded (and prefetched) only at tokens below the block's len
};

static void check(const char* name, Attend kernel, int G, int D, int dtype, int BS = 32, int chunk = 4,
                  double tol = 1e-5, Prefetching pf = {}, int splits_given = 0) {
    const int hk = 3;
    const int head_bytes = 2 * BS * D * 2;
    // Per head: its blocks' tokens. Head 0 ends in a partial block, head 2 has none.
    const int F = BS;
    const std::vector<std::vector<int>> lens = {{F, F, F, F, F, F, F, F, 5}, {F, F, F}, {}};
    int total = 0;
    for (auto& l : lens) total += (int)l.size();
    std::vector<uint4> store((size_t)total * head_bytes / 16 + 1);
    unsigned char* arena = (unsigned char*)store.data();
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    // Decoded values, as the kernel must read them: [block][K^T c*BS+t | V t*D+c].
    std::vector<std::vector<float>> kv(total, std::vector<float>(2 * BS * D));
    std::vector<long long> offs;
    std::vector<int> blens, head_start = {0};
    int b = 0;
    for (auto& l : lens) {
        for (int len : l) {
            u16* p = (u16*)(arena + (size_t)b * head_bytes);
            for (int i = 0; i < 2 * BS * D; i++) {
                const int t = i < BS * D ? i % BS : (i - BS * D) / D;
                u16 h;
                if (t >= len) {
                    h = dtype == 2 ? 0x7fc0 : 0x7e00;  // unwritten tail: NaN
                } else {
                    // Keys grow with the block, so each step of a warp moves its heads'
                    // running maxima, each by its own amount (the rescale is exercised).
                    const float x = u(rng) * 2.f * (i < BS * D ? 1.f + 0.25f * b : 1.f);
                    h = dtype == 2 ? f32_to_bf16(x) : f32_to_f16(x);
                }
                p[i] = h;
                kv[b][i] = dtype == 2 ? bf16_to_f32(h) : f16_to_f32(h);
            }
            offs.push_back((long long)b * head_bytes);
            blens.push_back(len);
            b++;
        }
        head_start.push_back(b);
    }
    std::vector<float> q((size_t)hk * G * D);
    for (auto& x : q) x = u(rng);
    const float scale = 1.f / sqrtf((float)D);
    // chunk 4: head 0 in 3 splits, head 1 in 1 (+2 empty), head 2 none; 9: one split each.
    // Given (with ATTEND_SPREAD): each head cut over them, at least `chunk` entries a split.
    const int splits = splits_given ? splits_given : (9 + chunk - 1) / chunk;
    std::vector<float> part_out((size_t)hk * splits * G * D), part_lse((size_t)hk * splits * G);
    prefetched.clear();
    launch({(unsigned)splits, (unsigned)hk, 1}, 128, [&] {
        kernel(arena, offs.data(), blens.data(), head_start.data(), q.data(), G, D, BS, dtype, scale, chunk,
               splits, part_out.data(), part_lse.data(), pf.flags);
    });
    // Where each prefetch landed, in 16-byte units of the arena (a lane prefetches what it
    // will load, 16 bytes a load).
    std::set<long long> asked;
    int stray = 0;
    for (const unsigned char* p : prefetched) {
        const long long at = p - arena;
        const long long bi = at / head_bytes, in = at % head_bytes;
        const bool v = in >= BS * D * 2;
        const bool ok = at >= 0 && bi < total && at % 16 == 0 &&
                        (!v || !pf.v_written || (in - BS * D * 2) / (D * 2) < blens[bi]);
        if (!ok) stray++;
        asked.insert(at / 16);
    }
    int missed = 0;
    if (pf.flags & ATTEND_PREFETCH)
        for (int h = 0; h < hk; h++)
            for (int bi = head_start[h]; bi < head_start[h + 1]; bi++) {
                const int len = blens[bi];
                for (int u = 0; u < head_bytes / 16; u++) {
                    const bool v = u * 16 >= BS * D * 2;
                    const bool want = !v || !pf.v_written || (u * 16 - BS * D * 2) / (D * 2) < len;
                    if (want && !asked.count(((long long)bi * head_bytes) / 16 + u)) missed++;
                }
            }
    if (stray || missed || (!(pf.flags & ATTEND_PREFETCH) && !prefetched.empty())) {
        bad++;
        printf("FAIL %s G=%d D=%d BS=%d chunk %d flags %d: %zu prefetches, %d outside what it loads, %d of its "
               "loads not prefetched\n",
               name, G, D, BS, chunk, pf.flags, prefetched.size(), stray, missed);
    }
    std::vector<float> out((size_t)hk * G * D), lse((size_t)hk * G);
    launch({(unsigned)(hk * G), 1, 1}, 128,
           [&] { combine_splits(part_out.data(), part_lse.data(), splits, G, D, out.data(), lse.data()); });
    double worst = 0;
    for (int h = 0; h < hk; h++)
        for (int g = 0; g < G; g++) {
            std::vector<double> s, o(D, 0.0);
            std::vector<std::pair<int, int>> toks;
            for (int bi = head_start[h]; bi < head_start[h + 1]; bi++)
                for (int t = 0; t < blens[bi]; t++) {
                    double d = 0;
                    for (int c = 0; c < D; c++) d += (double)q[(h * G + g) * D + c] * kv[bi][c * BS + t];
                    s.push_back(d * scale);
                    toks.push_back({bi, t});
                }
            const float* got = &out[(h * G + g) * D];
            const float got_lse = lse[h * G + g];
            if (s.empty()) {
                for (int c = 0; c < D; c++)
                    if (got[c] != 0.f && bad++ < 10) printf("%s h%d g%d: out %g, want 0\n", name, h, g, got[c]);
                if (got_lse != NEG_INF && bad++ < 10) printf("%s h%d g%d: lse %g, want -inf\n", name, h, g, got_lse);
                continue;
            }
            const double m = *std::max_element(s.begin(), s.end());
            double l = 0;
            for (size_t i = 0; i < s.size(); i++) {
                const double p = exp(s[i] - m);
                l += p;
                for (int c = 0; c < D; c++) o[c] += p * kv[toks[i].first][BS * D + toks[i].second * D + c];
            }
            double err = fabs(got_lse - (m + log(l)) / log(2.0)) / (1.0 + fabs((m + log(l)) / log(2.0)));
            for (int c = 0; c < D; c++) err = std::max(err, fabs(got[c] - o[c] / l) / (1.0 + fabs(o[c] / l)));
            worst = std::max(worst, err);
        }
    const bool ok = worst < tol && !std::isnan(worst);
    if (!ok) bad++;
    printf("%s %s G=%d D=%d BS=%d %s chunk %d splits %d%s%s: max rel err %.2e\n", ok ? "PASS" : "FAIL", name, G, D,
           BS, dtype == 2 ? "bf16" : "f16", chunk, splits, pf.flags & ATTEND_PREFETCH ? " prefetch" : "",
           pf.flags & ATTEND_SPREAD ? " spread" : "", worst);
}

static void split(const unsigned char* a, const long long* o, const int* l, const int* hs, const float* q, int g,
                  int d, int bs, int dt, float sc, int ch, int sp, float* po, float* pl, int flags) {
    sparse_attention_split(a, o, l, hs, q, g, d, bs, dt, sc, ch, sp, po, pl, flags);
}

// `combine_splits` alone over more splits than its 128 threads (the strided loops wrap), some
// empty (lse -inf, NaN output that must not leak in), against the merge in double precision.
static void check_combine(int heads, int splits, int G, int D) {
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    std::vector<float> part_out((size_t)heads * splits * G * D), part_lse((size_t)heads * splits * G);
    for (auto& x : part_out) x = u(rng);
    for (size_t i = 0; i < part_lse.size(); i++) {
        part_lse[i] = i % 7 == 3 ? NEG_INF : u(rng) * 40.f;
        if (part_lse[i] == NEG_INF)
            for (int c = 0; c < D; c++) part_out[i * D + c] = NAN;
    }
    // The last head: every split empty.
    for (int s = 0; s < splits * G; s++) part_lse[(size_t)(heads - 1) * splits * G + s] = NEG_INF;
    std::vector<float> out((size_t)heads * G * D), lse((size_t)heads * G);
    launch({(unsigned)(heads * G), 1, 1}, 128,
           [&] { combine_splits(part_out.data(), part_lse.data(), splits, G, D, out.data(), lse.data()); });
    double worst = 0;
    for (int h = 0; h < heads; h++)
        for (int g = 0; g < G; g++) {
            double mx = -INFINITY;
            for (int s = 0; s < splits; s++) mx = std::max(mx, (double)part_lse[((size_t)h * splits + s) * G + g]);
            const float* got = &out[((size_t)h * G + g) * D];
            if (mx == -INFINITY) {
                for (int c = 0; c < D; c++)
                    if (got[c] != 0.f && bad++ < 10) printf("combine h%d g%d: out %g, want 0\n", h, g, got[c]);
                if (lse[h * G + g] != NEG_INF && bad++ < 10) printf("combine h%d g%d: lse not -inf\n", h, g);
                continue;
            }
            double total = 0;
            std::vector<double> o(D, 0.0);
            for (int s = 0; s < splits; s++) {
                const size_t i = ((size_t)h * splits + s) * G + g;
                if (part_lse[i] == NEG_INF) continue;
                const double w = exp2(part_lse[i] - mx);
                total += w;
                for (int c = 0; c < D; c++) o[c] += w * part_out[i * D + c];
            }
            const double want_lse = mx + log2(total);
            double err = fabs(lse[h * G + g] - want_lse) / (1.0 + fabs(want_lse));
            for (int c = 0; c < D; c++) err = std::max(err, fabs(got[c] - o[c] / total) / (1.0 + fabs(o[c] / total)));
            worst = std::max(worst, err);
        }
    const bool ok = worst < 1e-5 && !std::isnan(worst);
    if (!ok) bad++;
    printf("%s combine_splits heads=%d splits=%d G=%d D=%d: max rel err %.2e\n", ok ? "PASS" : "FAIL", heads,
           splits, G, D, worst);
}

int main() {
    check_combine(2, 300, 2, 128);
    check_combine(3, 5, 3, 64);
    check_combine(2, 1024, 1, 80);
    check("sparse_attention_split", split, 5, 128, 2);
    check("attend_warps", attend_warps_g5_d128, 5, 128, 2);
    check("attend_warps", attend_warps_g5_d128, 5, 128, 1);
    check("attend_warps", attend_warps_g3_d64, 3, 64, 1);
    check("attend_warps", attend_warps_g8_d128, 8, 128, 2);
    check("attend_warps", attend_warps_g1_d64, 1, 64, 2);
    check("attend_warps", attend_warps_g4_d64, 4, 64, 2);
    check("sparse_attention_split", split, 5, 128, 2, 16);
    check("attend_warps_b16", attend_warps_g5_d128_b16, 5, 128, 2, 16);
    check("attend_warps_b16", attend_warps_g3_d64_b16, 3, 64, 1, 16);
    check("attend_warps_b16", attend_warps_g8_d128_b16, 8, 128, 1, 16);
    check("attend_warps_b16", attend_warps_g1_d64_b16, 1, 64, 2, 16);
    // The tensor-core kernel: groups of one to eight heads (padded rows, odd and even counts),
    // both dtypes, head dims and block sizes, and a warp taking more than one step (chunk 9).
    const Attend tc[2][2] = {{attend_tc_d64, attend_tc_d128}, {attend_tc_d64_b16, attend_tc_d128_b16}};
    for (int bs = 0; bs < 2; bs++)
        for (int d = 0; d < 2; d++)
            for (int G : {1, 2, 3, 5, 8})
                for (int chunk : {4, 9})
                    // Half the others' tolerance: what the MMAs' split operands keep (a bf16
                    // query in two parts, not three, reached 9e-6 here).
                    check(bs ? "attend_tc_b16" : "attend_tc", tc[bs][d], G, d ? 128 : 64, 1 + (G + d + chunk) % 2,
                          bs ? 16 : 32, chunk, 5e-6);
    // Prefetching the next batch of loads: the same results, and the lines asked for are the
    // ones loaded next. Chunk 9 gives warp 0 a second step (and attend_warps a third).
    for (int chunk : {4, 9}) {
        const Prefetching warps{ATTEND_PREFETCH, false};
        check("attend_warps", attend_warps_g5_d128, 5, 128, 2, 32, chunk, 1e-5, warps);
        check("attend_warps", attend_warps_g3_d64, 3, 64, 1, 32, chunk, 1e-5, warps);
        check("attend_warps_b16", attend_warps_g8_d128_b16, 8, 128, 1, 16, chunk, 1e-5, warps);
        for (int bs = 0; bs < 2; bs++)
            for (int d = 0; d < 2; d++)
                check(bs ? "attend_tc_b16" : "attend_tc", tc[bs][d], 5, d ? 128 : 64, 2 - d, bs ? 16 : 32, chunk,
                      5e-6, Prefetching{ATTEND_PREFETCH, true});
    }
    // Each head spread over the splits (a list laid out on the device): over more splits
    // than its entries (at least `chunk` each, the rest empty), and over fewer than `chunk`
    // would cover (2 splits of chunk 1: without the spread, head 0's 9 entries would lose 7).
    for (auto [chunk, splits] : {std::pair{1, 2}, std::pair{2, 7}, std::pair{4, 20}}) {
        const Prefetching spread{ATTEND_SPREAD, false};
        check("sparse_attention_split", split, 5, 128, 2, 32, chunk, 1e-5, spread, splits);
        check("attend_warps", attend_warps_g5_d128, 5, 128, 2, 32, chunk, 1e-5, spread, splits);
        check("attend_warps_b16", attend_warps_g3_d64_b16, 3, 64, 1, 16, chunk, 1e-5, spread, splits);
        check("attend_tc", attend_tc_d128, 5, 128, 2, 32, chunk, 5e-6, spread, splits);
        check("attend_tc_b16", attend_tc_d64_b16, 8, 64, 1, 16, chunk, 5e-6,
              Prefetching{ATTEND_SPREAD | ATTEND_PREFETCH, true}, splits);
    }
    return bad ? 1 : 0;
}
