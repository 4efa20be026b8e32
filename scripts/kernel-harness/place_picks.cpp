// `place_picks` run with a thread per CUDA thread (see simt.h) against the lists the host
// would hand the attention for a layer it planned itself (engine::attend, SeqAttention's
// device part): per KV head the sink, the head's picks of the cut in ascending order, then
// the window, each pick in the arena slot the sequence's block table names. Picks each head's
// own (`rows` 1) and shared by the layer's heads (places head * blocks + block), several
// sequences in one launch after other heads, windows of one and more blocks, a head with no
// pick, more picks than a CUDA block's threads. Malformed picks (outside the cut, a block
// without a slot, out of order, a head past the group): the kernel writes only inside the
// sequence's range, every head's start stays in it, and a pick without a slot is an empty
// entry. Exit status 1 on any difference.
#include "simt.h"
#include "../../attention/src/cuda/kernels.cu"
#include <algorithm>
#include <cstdio>
#include <random>

static std::mt19937 rng(29);
static int bad = 0, cases = 0;
static const long long SLOT_BYTES = 4096;
static const int BS = 32;

struct Seq {
    int hk, rows, k, w1, blocks, from, to;
    std::vector<unsigned> picks;  // [hk / rows][k] places
    std::vector<unsigned> table;  // [hk][stride]
    int stride;
    std::vector<long long> fixed_off;  // [hk][w1]
    std::vector<int> fixed_len;
};

// Per head, (offset, len) of each entry: what the host's plan would attend, in order.
static std::vector<std::vector<std::pair<long long, int>>> reference(const Seq& s) {
    std::vector<std::vector<std::pair<long long, int>>> out(s.hk);
    std::vector<std::vector<unsigned>> mine(s.hk);
    for (int i = 0; i < (int)s.picks.size(); i++) {
        const int g = i / s.k;
        const int h = g * s.rows + (int)(s.picks[i] / s.blocks);
        mine[h].push_back(s.picks[i] % s.blocks);
    }
    for (int h = 0; h < s.hk; h++) {
        out[h].push_back({s.fixed_off[h * s.w1], s.fixed_len[h * s.w1]});
        for (unsigned b : mine[h]) out[h].push_back({(long long)s.table[(size_t)h * s.stride + b] * SLOT_BYTES, BS});
        for (int e = 1; e < s.w1; e++) out[h].push_back({s.fixed_off[h * s.w1 + e], s.fixed_len[h * s.w1 + e]});
    }
    return out;
}

// A sequence: `rows` 1 or hk; picks drawn as the best of random scores would be (distinct
// blocks of the cut, ascending by place), every block of the cut in a slot.
static Seq make(int hk, int rows, int k, int w1, int blocks) {
    Seq s{hk, rows, k, w1, blocks, 1, blocks - (w1 - 1), {}, {}, blocks + 3, {}, {}};
    std::vector<unsigned> slots((size_t)hk * blocks);
    for (size_t i = 0; i < slots.size(); i++) slots[i] = (unsigned)i;
    std::shuffle(slots.begin(), slots.end(), rng);
    s.table.assign((size_t)hk * s.stride, PLACE_NONE);
    for (int h = 0; h < hk; h++)
        for (int b = 0; b < blocks; b++) s.table[(size_t)h * s.stride + b] = slots[(size_t)h * blocks + b];
    for (int g = 0; g < hk / rows; g++) {
        std::vector<unsigned> cand;
        for (int r = 0; r < rows; r++)
            for (int b = s.from; b < s.to; b++) cand.push_back((unsigned)(r * blocks + b));
        std::shuffle(cand.begin(), cand.end(), rng);
        cand.resize(k);
        std::sort(cand.begin(), cand.end());
        s.picks.insert(s.picks.end(), cand.begin(), cand.end());
    }
    for (int h = 0; h < hk; h++)
        for (int e = 0; e < w1; e++) {
            const int b = e == 0 ? 0 : s.to + e - 1;
            s.fixed_off.push_back((long long)s.table[(size_t)h * s.stride + b] * SLOT_BYTES);
            // The newest block may be partial.
            s.fixed_len.push_back(e == w1 - 1 ? 1 + (int)(rng() % BS) : BS);
        }
    return s;
}

// Lays out `seqs` after `before` heads of one entry each, runs the kernel, and checks each
// sequence's heads against the reference (`exact`) or only that its writes stayed in range.
static void check(std::vector<Seq> seqs, bool exact, const char* what) {
    cases++;
    const int before = 3;
    std::vector<long long> offs;
    std::vector<int> lens, head_start;
    for (int h = 0; h < before; h++) {
        head_start.push_back((int)offs.size());
        offs.push_back(777 * SLOT_BYTES);
        lens.push_back(5);
    }
    std::vector<long long> jobs;
    std::vector<int> starts, firsts;
    for (auto& s : seqs) {
        const int start = (int)offs.size(), first = (int)head_start.size();
        starts.push_back(start);
        firsts.push_back(first);
        for (int h = 0; h < s.hk; h++) {
            head_start.push_back(-1);  // provisional: the kernel writes it
            for (int e = 0; e < s.w1; e++) {
                offs.push_back(s.fixed_off[h * s.w1 + e]);
                lens.push_back(s.fixed_len[h * s.w1 + e]);
            }
        }
        for (size_t i = 0; i < s.picks.size(); i++) {
            offs.push_back(-1);
            lens.push_back(-1);
        }
        const long long w[PLACE_WORDS] = {start, first, s.hk, s.w1, s.k, s.rows, s.blocks, s.from, s.to,
                                          (long long)(size_t)s.picks.data(), (long long)(size_t)s.table.data(),
                                          s.stride};
        jobs.insert(jobs.end(), w, w + PLACE_WORDS);
    }
    head_start.push_back((int)offs.size());
    // One head after every sequence, which must stay as it is.
    offs.push_back(888 * SLOT_BYTES);
    lens.push_back(6);
    head_start.push_back((int)offs.size());
    const auto offs0 = offs;
    const auto lens0 = lens;
    launch({(unsigned)seqs.size(), 1, 1}, PLACE_THREADS, [&] {
        place_picks(offs.data(), lens.data(), head_start.data(), jobs.data(), SLOT_BYTES, BS);
    });
    bool ok = true;
    // Outside the sequences: untouched.
    for (int i = 0; i < before; i++) ok = ok && offs[i] == offs0[i] && lens[i] == lens0[i] && head_start[i] == i;
    ok = ok && offs.back() == offs0.back() && lens.back() == lens0.back();
    for (size_t q = 0; q < seqs.size(); q++) {
        const Seq& s = seqs[q];
        const int start = starts[q], end = start + s.hk * s.w1 + (int)s.picks.size();
        ok = ok && head_start[firsts[q]] == start && head_start[firsts[q] + s.hk] == end;
        for (int h = 0; h < s.hk; h++) {
            const int a = head_start[firsts[q] + h], b = head_start[firsts[q] + h + 1];
            ok = ok && start <= a && a < b && b <= end;
        }
        for (int i = start; i < end; i++) ok = ok && lens[i] >= 0 && lens[i] <= BS;
        if (!ok || !exact) continue;
        const auto want = reference(s);
        for (int h = 0; h < s.hk; h++) {
            const int a = head_start[firsts[q] + h], b = head_start[firsts[q] + h + 1];
            ok = ok && b - a == (int)want[h].size();
            for (int e = 0; ok && e < b - a; e++)
                ok = ok && offs[a + e] == want[h][e].first && lens[a + e] == want[h][e].second;
        }
    }
    if (!ok) {
        bad++;
        fprintf(stderr, "place_picks differs: %s\n", what);
    }
}

int main() {
    // Each head its own picks; shared by the layer's heads; one head; windows of 1 and 4.
    for (int hk : {1, 2, 8}) {
        for (int w1 : {2, 5}) {
            check({make(hk, 1, 3, w1, 40)}, true, "own picks");
            check({make(hk, hk, 3 * hk, w1, 40)}, true, "shared picks");
        }
    }
    // More picks than threads, several sequences in one launch.
    check({make(8, 8, 600, 2, 120), make(4, 1, 70, 3, 90), make(2, 2, 5, 2, 9)}, true, "batch");
    // A shared budget that leaves a head without a pick: every pick in head 0's blocks.
    {
        Seq s = make(4, 4, 6, 2, 30);
        for (int i = 0; i < 6; i++) s.picks[i] = (unsigned)(s.from + i);
        check({s}, true, "a head with no pick");
    }
    // Malformed: outside the cut, a block without a slot (an empty entry), out of order, a
    // head past the group.
    {
        Seq s = make(4, 1, 5, 2, 30);
        s.picks[0] = (unsigned)s.to;          // the window's block
        s.table[(size_t)1 * s.stride + s.picks[7]] = PLACE_NONE;
        std::swap(s.picks[10], s.picks[12]);  // head 2 out of order
        s.picks[16] = 5 * 30 + 3;             // head 3 names a head past its group
        check({s}, false, "malformed");
        // Shared picks whose heads interleave: head 3's two picks apart, the last at the end.
        Seq u = make(4, 4, 8, 2, 30);
        for (int i = 0; i < 8; i++) u.picks[i] = (unsigned)(i == 0 || i == 7 ? 3 * 30 + 2 + i : 1 + i);
        check({u, make(2, 1, 3, 2, 20)}, false, "interleaved heads");
        // The empty entry of head 1's pick without a slot.
        Seq t = make(2, 1, 4, 2, 20);
        t.table[(size_t)1 * t.stride + t.picks[5]] = PLACE_NONE;
        std::vector<long long> offs(2 * 2 + 8, -1);
        std::vector<int> lens(offs.size(), -1), hs(3, -1);
        for (int h = 0; h < 2; h++)
            for (int e = 0; e < 2; e++) {
                offs[h * 2 + e] = t.fixed_off[h * 2 + e];
                lens[h * 2 + e] = t.fixed_len[h * 2 + e];
            }
        hs[2] = (int)offs.size();
        const long long w[PLACE_WORDS] = {0, 0, 2, 2, 4, 1, t.blocks, t.from, t.to,
                                          (long long)(size_t)t.picks.data(), (long long)(size_t)t.table.data(), t.stride};
        launch({1, 1, 1}, PLACE_THREADS,
               [&] { place_picks(offs.data(), lens.data(), hs.data(), w, SLOT_BYTES, BS); });
        cases++;
        // Head 1: sink at 6, its picks at 7..10; the second of them has no slot.
        if (hs[1] != 6 || lens[8] != 0 || offs[8] != t.fixed_off[2] || lens[7] != BS) {
            bad++;
            fprintf(stderr, "place_picks: a pick without a slot is not an empty entry over the sink\n");
        }
    }
    printf("place_picks: %d cases, %d differ\n", cases, bad);
    return bad ? 1 : 0;
}
