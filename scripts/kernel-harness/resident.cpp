// `qkv_finish` (its packed rows) and `merge_self` run on the host (see shim.h) against the host path they
// replace, written out again here from decode-node's model code: the bias add after a
// projection, `Backend::rms_norm` over each head, `Rotations::rotate`, and attention's
// `Partial::of_one_key` and `Partial::merge_from`. One thread sums in the host's order, so
// every float must be bit-equal. Exit status 1 on any difference.
#include "shim.h"
#include "../../attention/src/cuda/kernels.cu"
#include <cstdio>
#include <random>
#include <vector>

static std::mt19937 rng(7);
static std::vector<float> rnd(size_t n, float amp) {
    std::uniform_real_distribution<float> u(-amp, amp);
    std::vector<float> v(n);
    for (auto& x : v) x = u(rng);
    return v;
}

static int bad = 0;
static void same(const char* what, const float* got, const float* want, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&got[i], &want[i], 4) != 0) {
            if (bad++ < 10) printf("%s[%zu]: %.9g, want %.9g\n", what, i, got[i], want[i]);
        }
}

// The host path of one head of one row: bias, norm, rotation.
static void head_ref(float* x, const float* bias, const float* norm, const float* cs, int d, float eps,
                     bool rotate) {
    for (int c = 0; c < d; c++) x[c] = bias ? x[c] + bias[c] : x[c];
    if (norm) {
        float ms = 0.f;
        for (int c = 0; c < d; c++) ms += x[c] * x[c];
        ms /= d;
        float inv = 1.f / sqrtf(ms + eps);
        for (int c = 0; c < d; c++) x[c] = norm[c] * (x[c] * inv);
    }
    if (rotate) {
        int half = d / 2;
        for (int i = 0; i < half; i++) {
            float c = cs[2 * i], s = cs[2 * i + 1];
            float a = x[i], b = x[i + half];
            x[i] = a * c - b * s;
            x[i + half] = b * c + a * s;
        }
    }
}

static void check_qkv(int n, int hq, int hk, int d, bool biases, bool norms, bool stacked) {
    int qw = hq * d, kw = hk * d;
    // Stacked: one GEMM's rows [q | k | v]; else three runs one after another.
    std::vector<float> y = rnd((size_t)n * (qw + 2 * kw), 2.f);
    std::vector<float> want = y;
    const std::vector<float> y0 = y;
    float *q, *k, *v;
    int qs, ks, vs;
    if (stacked) {
        q = y.data(); k = q + qw; v = k + kw;
        qs = ks = vs = qw + 2 * kw;
    } else {
        q = y.data(); k = q + (size_t)n * qw; v = k + (size_t)n * kw;
        qs = qw; ks = vs = kw;
    }
    std::vector<float> bq = rnd(qw, 0.5f), bk = rnd(kw, 0.5f), bv = rnd(kw, 0.5f);
    std::vector<float> qn = rnd(d, 1.5f), kn = rnd(d, 1.5f);
    std::vector<float> cs((size_t)n * d);
    for (int r = 0; r < n; r++)
        for (int i = 0; i < d / 2; i++) {
            float a = (float)(r * 37 + 5) * powf(10000.f, -2.f * i / d);
            cs[((size_t)r * d / 2 + i) * 2] = cosf(a);
            cs[((size_t)r * d / 2 + i) * 2 + 1] = sinf(a);
        }
    float eps = 1e-6f;
    std::vector<float> keep_q((size_t)n * qw), keep_k((size_t)n * kw), keep_v((size_t)n * kw);
    std::vector<float> want_q((size_t)n * qw), want_k((size_t)n * kw), want_v((size_t)n * kw);
    float* wq = want.data() + (q - y.data());
    float* wk = want.data() + (k - y.data());
    float* wv = want.data() + (v - y.data());
    for (int r = 0; r < n; r++) {
        const float* csr = cs.data() + (size_t)r * d;
        for (int h = 0; h < hq; h++) {
            float* x = wq + (size_t)r * qs + h * d;
            head_ref(x, biases ? bq.data() + h * d : 0, norms ? qn.data() : 0, csr, d, eps, true);
            memcpy(&want_q[((size_t)r * hq + h) * d], x, d * 4);
        }
        for (int h = 0; h < hk; h++) {
            float* x = wk + (size_t)r * ks + h * d;
            head_ref(x, biases ? bk.data() + h * d : 0, norms ? kn.data() : 0, csr, d, eps, true);
            memcpy(&want_k[((size_t)r * hk + h) * d], x, d * 4);
            float* y2 = wv + (size_t)r * vs + h * d;
            head_ref(y2, biases ? bv.data() + h * d : 0, 0, csr, d, eps, false);
            memcpy(&want_v[((size_t)r * hk + h) * d], y2, d * 4);
        }
    }
    for (unsigned r = 0; r < (unsigned)n; r++)
        for (unsigned h = 0; h < (unsigned)(hq + 2 * hk); h++) {
            blockIdx = {h, r, 0};
            qkv_finish(q, k, v, qs, ks, vs, biases ? bq.data() : 0, biases ? bk.data() : 0,
                       biases ? bv.data() : 0, norms ? qn.data() : 0, norms ? kn.data() : 0, cs.data(), hq,
                       hk, d, eps, keep_q.data(), keep_k.data(), keep_v.data());
        }
    same("qkv rows read only", y.data(), y0.data(), y.size());
    same("keep_q", keep_q.data(), want_q.data(), keep_q.size());
    same("keep_k", keep_k.data(), want_k.data(), keep_k.size());
    same("keep_v", keep_v.data(), want_v.data(), keep_v.size());
}

static void check_merge(int hk, int group, int d, bool empty) {
    int hq = hk * group;
    std::vector<float> out = rnd((size_t)hq * d, 1.f), lse = rnd(hq, 8.f);
    if (!empty) lse[1 % hq] = NEG_INF;  // a head that saw no key
    std::vector<float> q = rnd((size_t)hq * d, 1.f), k = rnd((size_t)hk * d, 1.f), v = rnd((size_t)hk * d, 1.f);
    float scale = 1.f / sqrtf((float)d);
    std::vector<float> want = out, want_lse = lse;
    for (int hg = 0; hg < hq; hg++) {
        int h = hg / group;
        float s = 0.f;
        for (int c = 0; c < d; c++) s += q[(size_t)hg * d + c] * k[(size_t)h * d + c];
        float lb = s * scale * 1.4426950408889634f;
        float la = empty ? NEG_INF : lse[hg];
        float* o = &want[(size_t)hg * d];
        const float* vb = &v[(size_t)h * d];
        if (la == NEG_INF) {
            memcpy(o, vb, d * 4);
            want_lse[hg] = lb;
            continue;
        }
        float m = std::max(la, lb);
        float wa = exp2f(la - m), wb = exp2f(lb - m), total = wa + wb;
        wa /= total;
        wb /= total;
        for (int c = 0; c < d; c++) o[c] = o[c] * wa + vb[c] * wb;
        want_lse[hg] = m + log2f(total);
    }
    for (unsigned hg = 0; hg < (unsigned)hq; hg++) {
        blockIdx = {hg, 0, 0};
        merge_self(out.data(), lse.data(), q.data(), k.data(), v.data(), group, d, scale, empty ? 1 : 0);
    }
    same("merge out", out.data(), want.data(), out.size());
    same("merge lse", lse.data(), want_lse.data(), lse.size());
}

int main() {
    int cases = 0;
    for (int d : {8, 64, 128})
        for (int flags = 0; flags < 8; flags++) {
            check_qkv(3, 4, 2, d, flags & 1, flags & 2, flags & 4);
            cases++;
        }
    for (int d : {8, 64, 128})
        for (int group : {1, 3, 8})
            for (int empty = 0; empty < 2; empty++) {
                check_merge(2, group, d, empty);
                cases++;
            }
    printf("resident kernels: %d cases, %d floats differ\n", cases, bad);
    return bad ? 1 : 0;
}
