// `top_blocks` run with a thread per CUDA thread (see simt.h) against the ranking of
// attention::select's best_of_rows written here from its definition: of blocks from .. to of
// `rows` heads together, the k best by score, NaN last, -0 below +0, equal scores by lower
// (head, block), as ascending (head, block). Each head alone and heads together (a layer's
// shared budget); candidates fewer than the CUDA block's threads, not a multiple of them, and
// up to TOP_MAX (every register of every thread); k of 1, half, all but one, all and more;
// scores drawn from a few values (ties across the k-th), with NaN, infinities and both zeros;
// rows longer than their ranges. Past TOP_MAX nothing is written. Exit status 1 on any
// difference.
#include "simt.h"
#include "../../attention/src/cuda/kernels.cu"
#include <cstdio>
#include <random>

static std::mt19937 rng(21);
static int bad = 0, cases = 0;

static unsigned key_of(float s) {
    unsigned u;
    memcpy(&u, &s, 4);
    if (s != s) return 0;
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

// Places h * nblocks + b of heads 0 .. rows.
static std::vector<unsigned> reference(const float* s, int nblocks, int rows, int from, int to, int k) {
    std::vector<int> idx;
    for (int h = 0; h < rows; h++)
        for (int i = from; i < to; i++) idx.push_back(h * nblocks + i);
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return key_of(s[a]) > key_of(s[b]); });
    idx.resize(std::min<size_t>(idx.size(), (size_t)std::max(k, 0)));
    std::sort(idx.begin(), idx.end());
    return std::vector<unsigned>(idx.begin(), idx.end());
}

// `kind`: 0 distinct random floats, 1 a few values (many ties), 2 a few values with NaN,
// infinities and both zeros among them.
static void check(int hk, int nblocks, int from, int to, int k, int kind, int rows = 1) {
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    const float few[] = {0.25f, 0.5f, -0.125f, 1e-9f, 0.5f};
    const float odd[] = {NAN, -NAN, INFINITY, -INFINITY, 0.f, -0.f, 0.5f, 0.5f, -1e-30f};
    std::vector<float> scores((size_t)hk * nblocks);
    for (auto& x : scores) {
        if (kind == 0) x = u(rng);
        else if (kind == 1) x = few[rng() % 5];
        else x = (rng() % 3 == 0) ? odd[rng() % 9] : few[rng() % 5];
    }
    cases++;
    const int groups = hk / rows, total = rows * std::max(to - from, 0);
    const int kk = total > TOP_MAX ? 0 : std::max(0, std::min(k, total));
    // Room past the last row, which must stay as it is.
    std::vector<unsigned> picks((size_t)groups * std::max(k, 0) + 64, 0xdeadbeefu);
    launch({(unsigned)groups, 1, 1}, TOP_THREADS,
           [&] { top_blocks(scores.data(), nblocks, from, to, rows, k, picks.data()); });
    for (int h = 0; h < groups; h++) {
        auto want = reference(&scores[(size_t)h * rows * nblocks], nblocks, rows, from, to, k);
        if (total > TOP_MAX) want.clear();
        bool ok = (int)want.size() == kk;
        for (int i = 0; ok && i < kk; i++) ok = picks[(size_t)h * k + i] == want[i];
        // Nothing written past the k picks of the row.
        for (int i = kk; ok && i < k; i++) ok = picks[(size_t)h * k + i] == 0xdeadbeefu;
        if (h == groups - 1)
            for (size_t i = (size_t)groups * std::max(k, 0); ok && i < picks.size(); i++) ok = picks[i] == 0xdeadbeefu;
        if (!ok) {
            bad = 1;
            printf("top_blocks: group %d of %d heads, %d heads together, blocks %d, range %d..%d, k %d, kind %d: differs\n",
                   h, hk, rows, nblocks, from, to, k, kind);
        }
    }
}

int main() {
    for (int kind = 0; kind < 3; kind++) {
        check(1, 50, 1, 49, 7, kind);               // shorter than the CUDA block
        check(2, 2047, 1, 2045, 61, kind);          // 64k tokens in 32-token blocks, budget 2048
        check(1, 700, 1, 600, 1, kind);             // one
        check(1, 700, 1, 600, 598, kind);           // all but one of the range
        check(2, 513, 1, 511, 255, kind);           // half, two CUDA blocks' worth
        check(1, 2 * TOP_THREADS + 2, 1, 2 * TOP_THREADS + 1, 100, kind);  // a partial last register
        check(8, 2047, 1, 2045, 8 * 61, kind, 8);   // the layer's budget over 8 heads at 64k
        check(4, 400, 1, 397, 300, kind, 2);        // two heads together, twice
    }
    check(1, TOP_MAX + 1, 0, TOP_MAX, 5, 0);        // every register of every thread
    check(2, TOP_MAX, 1, TOP_MAX / 2 + 1, 7, 1, 2); // the same over two heads
    check(2, TOP_MAX, 1, TOP_MAX / 2 + 2, 7, 1, 2); // one candidate too many: nothing
    check(1, 300, 1, 299, 298, 1);                  // the range exactly (k = m): every block
    check(1, 300, 5, 200, 500, 2);                  // more than the range
    check(1, 300, 1, 299, 0, 0);                    // none
    check(1, 300, 100, 100, 4, 0);                  // an empty range
    if (!bad) printf("PASS top_blocks: %d cases equal to the host's ranking\n", cases);
    return bad ? 1 : 0;
}
