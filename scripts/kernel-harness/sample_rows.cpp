// `sample_rows` run on the host (see shim.h) against the host's sampler, written out again
// here from decode-node's model/sampling.rs, logits.rs and pick.rs: a full sort (larger logit
// first in the total order, the lower id on ties), top-k, top-p, the draw's walk, and the
// log-probabilities. Every pick and every reported number must be bit-equal (one thread sums
// in the reference's order), and a row may be left to the host only where the head of
// SAMPLE_HEAD tokens cannot decide it. Then again with the row's first two passes made by
// `row_max_parts` and `row_sum_parts` (a slice of PART_LOGITS logits each, as on the device):
// the same picks and the same rows left, log-probabilities within two f32 ulps (their f64 sums
// add slice by slice). Exit status 1 on any difference.
#include "shim.h"
#include "../../attention/src/cuda/kernels.cu"
#include <cstdio>
#include <random>
#include <vector>

struct Want { int tok; float lp; std::vector<std::pair<unsigned, float>> top; };

static uint32_t order_key(float f) {
    uint32_t b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

static Want reference(const std::vector<float>& x, float temp, unsigned top_k, float top_p,
                      unsigned ntop, double r) {
    size_t n = x.size();
    float m = -INFINITY;
    for (float v : x) m = std::max(m, v);
    std::vector<size_t> idx(n);
    for (size_t i = 0; i < n; i++) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
        uint32_t ka = order_key(x[a]), kb = order_key(x[b]);
        return ka != kb ? ka > kb : a < b;
    });
    int tok = -1;
    if (!(temp > 0 && std::isfinite(temp))) {
        size_t best = 0;
        for (size_t i = 0; i < n; i++) if (x[i] > x[best]) best = i;
        tok = (int)best;
    } else {
        auto w = [&](size_t i) { return exp((double)((x[i] - m) / temp)); };
        size_t keep = top_k > 0 ? std::min((size_t)top_k, n) : n;
        double total = 0;
        if (keep < n) for (size_t j = 0; j < keep; j++) total += w(idx[j]);
        else for (size_t i = 0; i < n; i++) total += w(i);
        bool nucleus = top_p > 0 && top_p < 1;
        size_t len = keep;
        double kept = total;
        if (nucleus) {
            double acc = 0;
            len = 0;
            for (size_t j = 0; j < keep && !len; j++) {
                acc += w(idx[j]) / total;
                if (acc >= (double)top_p) len = j + 1;
            }
            if (!len) tok = (int)idx[keep - 1];
            else { kept = 0; for (size_t j = 0; j < len; j++) kept += w(idx[j]); }
        }
        if (tok < 0) {
            double rr = r * kept;
            for (size_t j = 0; j < len && tok < 0; j++) {
                double ww = w(idx[j]);
                if (rr < ww) tok = (int)idx[j];
                rr -= ww;
            }
            if (tok < 0) tok = (int)idx[len - 1];
        }
    }
    double se = 0;
    for (size_t i = 0; i < n; i++) se += exp((double)(x[i] - m));
    Want out{tok, (x[tok] - m) - (float)log(se), {}};
    float lse = m + (float)log(se);
    for (size_t j = 0; j < std::min((size_t)ntop, n); j++) out.top.push_back({(unsigned)idx[j], x[idx[j]] - lse});
    return out;
}

// `sample_rows` after `row_max_parts` and `row_sum_parts`, every part run as its own block.
static void sample_by_parts(const std::vector<float>& x, const unsigned* spec, unsigned* out) {
    const int n = (int)x.size(), np = (n + PART_LOGITS - 1) / PART_LOGITS;
    std::vector<unsigned> parts(3 * (size_t)np);
    std::vector<double> sums(2 * (size_t)np);
    blockIdx.y = 0;
    for (int p = 0; p < np; p++) {
        blockIdx.x = p;
        row_max_parts(x.data(), n, np, parts.data());
    }
    for (int p = 0; p < np; p++) {
        blockIdx.x = p;
        row_sum_parts(x.data(), spec, n, parts.data(), np, sums.data());
    }
    blockIdx.x = 0;
    sample_rows(x.data(), spec, out, n, parts.data(), sums.data(), np);
}

static bool near(float a, float b) {
    return a == b || fabsf(a - b) <= 2.f * 1.1920929e-7f * std::max(fabsf(a), fabsf(b));
}

int main() {
    std::mt19937_64 g(7);
    auto uniform = [&]() { return (g() >> 11) * (1.0 / 9007199254740992.0); };
    int picked = 0, left = 0, bad = 0, parts_wrong = 0;
    const int cases = 20000;
    for (int c = 0; c < cases; c++) {
        size_t n = 1 + g() % (c % 100 == 0 ? 40000 : c % 10 == 0 ? 5000 : 700);
        float spread = 0.1f + (g() % 3000) / 100.f;
        bool coarse = g() % 3 == 0;  // many ties
        std::vector<float> x(n);
        for (auto& v : x) { v = (float)(uniform() - 0.5) * spread; if (coarse) v = roundf(v); }
        if (g() % 50 == 0) x[g() % n] = g() % 2 ? NAN : INFINITY;
        if (g() % 20 == 0) x[g() % n] = -0.0f;
        float temp = g() % 4 == 0 ? 0.f : 0.05f + (g() % 300) / 100.f;
        unsigned top_k = g() % 2 ? 0 : 1 + g() % 600;
        float top_p = g() % 2 ? 0.f : 0.01f + (g() % 99) / 100.f;
        unsigned ntop = g() % (SAMPLE_TOP + 1);
        double r = uniform();
        uint64_t rb;
        memcpy(&rb, &r, 8);
        unsigned spec[SAMPLE_SPEC_WORDS] = {__float_as_uint(temp), top_k, __float_as_uint(top_p), ntop,
                                            (unsigned)rb, (unsigned)(rb >> 32)};
        unsigned out[SAMPLE_OUT_WORDS] = {0}, by_parts[SAMPLE_OUT_WORDS] = {0};
        sample_rows(x.data(), spec, out, (int)n, nullptr, nullptr, 0);
        sample_by_parts(x, spec, by_parts);
        bool same = by_parts[0] == out[0];
        if (same && out[0] == 0) {
            same = by_parts[1] == out[1] && near(__uint_as_float(by_parts[2]), __uint_as_float(out[2])) &&
                   by_parts[3] == out[3];
            for (unsigned j = 0; same && j < out[3]; j++)
                same = by_parts[4 + 2 * j] == out[4 + 2 * j] &&
                       near(__uint_as_float(by_parts[5 + 2 * j]), __uint_as_float(out[5 + 2 * j]));
        }
        if (!same) {
            parts_wrong++;
            if (++bad < 10)
                printf("by parts differs: n=%zu T=%g k=%u p=%g top=%u: status %u vs %u, token %u vs %u, logprob %g vs %g\n",
                       n, temp, top_k, top_p, ntop, by_parts[0], out[0], by_parts[1], out[1],
                       __uint_as_float(by_parts[2]), __uint_as_float(out[2]));
        }
        bool finite = true;
        for (float v : x) finite = finite && std::isfinite(v);
        size_t keep = top_k > 0 ? std::min((size_t)top_k, n) : n;
        bool may_leave = !finite || (temp > 0 && keep > SAMPLE_HEAD);
        if (out[0] != 0) {
            left++;
            if (!may_leave && ++bad < 10) printf("left to the host without cause: n=%zu T=%g k=%u p=%g\n", n, temp, top_k, top_p);
            continue;
        }
        if (!finite && ++bad < 10) printf("picked a row holding a non-finite logit\n");
        picked++;
        Want w = reference(x, temp, top_k, top_p, ntop, r);
        bool ok = (int)out[1] == w.tok && __uint_as_float(out[2]) == w.lp && out[3] == w.top.size();
        for (size_t j = 0; ok && j < w.top.size(); j++)
            ok = out[4 + 2 * j] == w.top[j].first && __uint_as_float(out[5 + 2 * j]) == w.top[j].second;
        if (!ok && ++bad < 10)
            printf("differs: n=%zu T=%g k=%u p=%g top=%u: token %u vs %d, logprob %g vs %g\n", n, temp, top_k,
                   top_p, ntop, out[1], w.tok, __uint_as_float(out[2]), w.lp);
    }
    printf("sample_rows: %d rows, %d picked, %d left to the host, %d wrong (%d by parts)\n", cases, picked, left,
           bad, parts_wrong);
    return bad != 0;
}
