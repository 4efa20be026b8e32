//! Top-k block selection from digest scores.

/// Chooses which blocks of a sequence to attend.
///
/// `scores[b]` is the Quest score of block `b`; the sink (block 0) and the `recent` newest
/// blocks (at least the newest, possibly partly filled, whose score is ignored) are always
/// chosen: the local window that every token attends most. At most `budget_blocks` blocks are
/// returned (never fewer than the sink and the newest), sorted by index.
pub fn select_top_k(scores: &[f32], budget_blocks: usize, recent: usize) -> Vec<usize> {
    select_spans(scores, budget_blocks, recent, false)
}

/// [`select_top_k`], where with `spans` each block chosen by score brings its right neighbour
/// too (when the budget has room): a span of text that crosses a block boundary (a number, a
/// name) stays whole, at the cost of fewer distinct places at the same budget.
pub fn select_spans(
    scores: &[f32],
    budget_blocks: usize,
    recent: usize,
    spans: bool,
) -> Vec<usize> {
    let n = scores.len();
    let Some(cut) = TopCut::of(n, budget_blocks, recent) else {
        return (0..n).collect();
    };
    let (k, end) = (cut.k, cut.to);
    let mut out = Vec::with_capacity(k + 1 + n - end);
    out.push(0);
    if spans {
        let mut middle: Vec<(usize, f32)> = (1..end).map(|b| (b, scores[b])).collect();
        let below_window = |b: usize| b + 1 < end;
        out.extend(best_blocks(&mut middle, k, Some(&below_window)));
    } else {
        out.extend(best_in(&[scores], cut).concat());
    }
    out.extend(end..n);
    out.sort_unstable();
    out
}

/// Where [`select_top_k`] chooses by score among `n` blocks: the `k` best of blocks
/// `from .. to`, beside the sink (block 0) and the window `to .. n`, which are always taken;
/// with `shared`, the `k` best of every head's `from .. to` together (the layer's budget,
/// [`select_shared`]). A device that scores the blocks can choose those itself (the
/// `top_blocks` kernel) and send back only them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopCut {
    /// First block chosen by score (1: the sink is always taken).
    pub from: usize,
    /// Past the last block chosen by score: the window starts here.
    pub to: usize,
    /// How many of `from .. to` are chosen: a head's, or with `shared` the layer's.
    pub k: usize,
    /// The heads share `k`.
    pub shared: bool,
}

impl TopCut {
    /// Each head's cut of `n` blocks at `budget_blocks` with `recent` newest blocks always
    /// taken; `None` where the budget takes every block.
    pub fn of(n: usize, budget_blocks: usize, recent: usize) -> Option<TopCut> {
        if n <= budget_blocks.max(2) {
            return None;
        }
        // The window never takes the whole budget: at least the sink stays in.
        let recent = recent.clamp(1, budget_blocks.max(2) - 1);
        Some(TopCut {
            from: 1,
            to: n - recent,
            k: budget_blocks.saturating_sub(1 + recent),
            shared: false,
        })
    }

    /// [`TopCut::of`] with `heads` heads sharing their budgets.
    pub fn shared_of(
        n: usize,
        budget_blocks: usize,
        recent: usize,
        heads: usize,
    ) -> Option<TopCut> {
        TopCut::of(n, budget_blocks, recent).map(|c| TopCut {
            k: c.k * heads,
            shared: true,
            ..c
        })
    }

    /// Picks a head gets, or the layer's `heads` get together with `shared`: `k`, or every
    /// candidate where there are fewer.
    pub fn picks(&self, heads: usize) -> usize {
        let per = self.to.saturating_sub(self.from);
        self.k.min(if self.shared { heads * per } else { per })
    }

    /// Each head's selection of `n` blocks (as [`select_top_k`] or [`select_shared`] give
    /// them) from `picks`, each head's picks of the cut in ascending order; `None` where
    /// `picks` are not that (a count, an order or a block out of place): a device's answer is
    /// checked, not trusted.
    pub fn selections(&self, n: usize, picks: &[Vec<usize>]) -> Option<Vec<Vec<usize>>> {
        if self.to > n || self.from == 0 || self.from > self.to {
            return None;
        }
        let well_placed = |p: &Vec<usize>| {
            p.windows(2).all(|w| w[0] < w[1])
                && p.first()
                    .is_none_or(|&b| b >= self.from && p[p.len() - 1] < self.to)
        };
        let want = self.picks(picks.len());
        let counted = if self.shared {
            picks.iter().map(Vec::len).sum::<usize>() == want
        } else {
            picks.iter().all(|p| p.len() == want)
        };
        if !counted || !picks.iter().all(well_placed) {
            return None;
        }
        let sels = picks.iter().map(|p| {
            let mut out = Vec::with_capacity(1 + p.len() + n - self.to);
            out.push(0);
            out.extend_from_slice(p);
            out.extend(self.to..n);
            out
        });
        Some(sels.collect())
    }
}

/// Each row's picks of `cut` (a head's scores each, all as long) in ascending order, ranked
/// as [`select_top_k`] and [`select_shared`] rank them (score first, NaN last, -0 below +0,
/// of equal scores the lower (head, block)): what a device's `top_blocks` must answer.
pub fn best_in(rows: &[&[f32]], cut: TopCut) -> Vec<Vec<usize>> {
    // Rows as long as the shortest: a device's scores stop before the newest block.
    let len = rows.iter().map(|r| r.len()).min().unwrap_or(0);
    let rows: Vec<&[f32]> = rows.iter().map(|r| &r[..len]).collect();
    let to = cut.to.min(len);
    let range = cut.from.min(to)..to;
    let mut out = vec![Vec::new(); rows.len()];
    if cut.shared {
        for (h, b) in best_of_rows(&rows, range, cut.k) {
            out[h].push(b);
        }
    } else {
        for (h, row) in rows.iter().enumerate() {
            out[h] = best_of_rows(&[row], range.clone(), cut.k)
                .into_iter()
                .map(|(_, b)| b)
                .collect();
        }
    }
    for p in &mut out {
        p.sort_unstable();
    }
    out
}

/// [`select_spans`] for every KV head of a layer at once, the heads sharing the layer's
/// budget: each head keeps its sink and local window, and the rest of the layer's budget
/// (`heads x` what one head would get) goes to the best blocks of any head. `scores[h]` must
/// be comparable across heads (each head's share of its attention), so a head whose
/// attention is spread over the context takes more blocks than one whose attention is
/// concentrated in a few (Ada-KV's allocation).
pub fn select_shared(
    scores: &[&[f32]],
    budget_blocks: usize,
    recent: usize,
    spans: bool,
) -> Vec<Vec<usize>> {
    let n = scores.first().map_or(0, |s| s.len());
    let cut = TopCut::shared_of(n, budget_blocks, recent, scores.len());
    let Some(cut) = cut.filter(|_| scores.iter().all(|s| s.len() == n)) else {
        return scores
            .iter()
            .map(|s| select_spans(s, budget_blocks, recent, spans))
            .collect();
    };
    let (k, end) = (cut.k, cut.to);
    let mut out: Vec<Vec<usize>> = (0..scores.len()).map(|_| vec![0]).collect();
    if spans {
        let mut middle: Vec<(usize, f32)> = Vec::with_capacity(scores.len() * n);
        for (h, s) in scores.iter().enumerate() {
            middle.extend((1..end).map(|b| (h * n + b, s[b])));
        }
        // Candidate `h * n + b`: a span stays inside its head, below the window.
        let below_window = |p: usize| p % n + 1 < end;
        for p in best_blocks(&mut middle, k, Some(&below_window)) {
            out[p / n].push(p % n);
        }
    } else {
        for (sel, picks) in out.iter_mut().zip(best_in(scores, cut)) {
            sel.extend(picks);
        }
    }
    for sel in &mut out {
        sel.extend(end..n);
        sel.sort_unstable();
    }
    out
}

/// The `k` best of `cands` (block, score), unordered. NaN scores (from NaN KV) rank last
/// instead of poisoning the order. With `spans: Some(next_ok)`, each pick `b` also takes
/// `b + 1` when `next_ok(b)`, it is not yet taken, and `k` has room.
pub(crate) fn best_blocks(
    cands: &mut [(usize, f32)],
    k: usize,
    spans: Option<&dyn Fn(usize) -> bool>,
) -> Vec<usize> {
    let key = |s: f32| if s.is_nan() { f32::NEG_INFINITY } else { s };
    let by_score = |a: &(usize, f32), b: &(usize, f32)| key(b.1).total_cmp(&key(a.1));
    let Some(next_ok) = spans else {
        if k < cands.len() {
            cands.select_nth_unstable_by(k, by_score);
        }
        return cands.iter().take(k).map(|c| c.0).collect();
    };
    cands.sort_unstable_by(by_score);
    let mut taken = std::collections::HashSet::with_capacity(k);
    let mut out = Vec::with_capacity(k);
    for &(b, _) in cands.iter() {
        if out.len() >= k {
            break;
        }
        if taken.insert(b) {
            out.push(b);
        }
        if out.len() < k && next_ok(b) && taken.insert(b + 1) {
            out.push(b + 1);
        }
    }
    out
}

/// The `k` best of blocks `range` of every row of `rows` (a head's scores each, all as long),
/// as (row, block), unordered: by score, NaN last (as [`best_blocks`] ranks), and of equal
/// scores the lower (row, block) first. A layer's shared budget picks ~500 of ~16k candidates
/// at 64k tokens (8 KV heads, blocks of 32), on a GPU host for every layer of every step. Each
/// candidate is packed into one `u64` whose ascending order is the ranking; a sample of them
/// bounds the `k`-th, so one pass keeps the ~1,500 at or above the bound and the selection
/// runs on those: 15 µs where a `select_nth_unstable_by` on (block, score) pairs took 43 (Zen
/// 4, AVX2 build, 8 x 2047 candidates, k = 496).
fn best_of_rows(rows: &[&[f32]], range: std::ops::Range<usize>, k: usize) -> Vec<(usize, usize)> {
    let n = rows.first().map_or(0, |r| r.len());
    let per = range.len();
    let total = rows.len() * per;
    let place = |p: u64| {
        let p = (p & u64::from(u32::MAX)) as usize;
        (p / n, p % n)
    };
    if k >= total {
        return (0..rows.len())
            .flat_map(|h| range.clone().map(move |b| (h, b)))
            .collect();
    }
    if u32::try_from(rows.len() * n).is_err() {
        // Beyond a packed place's 32 bits (never at today's contexts): the pairs themselves
        // (equal scores then in no particular order).
        let mut c: Vec<(usize, f32)> = (0..rows.len())
            .flat_map(|h| range.clone().map(move |b| (h * n + b, rows[h][b])))
            .collect();
        return best_blocks(&mut c, k, None)
            .into_iter()
            .map(|p| (p / n, p % n))
            .collect();
    }
    // High word: the score's key inverted (best first); low word: the place (earlier first).
    let pack = |h: usize, b: usize| (u64::from(!score_key(rows[h][b])) << 32) | (h * n + b) as u64;
    let all = || -> Vec<u64> {
        (0..rows.len())
            .flat_map(|h| range.clone().map(move |b| pack(h, b)))
            .collect()
    };
    let mut kept = match sampled_bound(total, k, |i| pack(i / per, range.start + i % per)) {
        // Every candidate whose score is at least the bound's (one float compare a score, 16
        // into a mask, whose set bits alone are packed): ties with the bound's score and -0
        // against +0 may keep a few more, never fewer. A bound among NaNs cuts nothing.
        Some(bound) if bound >> 32 != u64::from(u32::MAX) => {
            let least = score_of_key(!((bound >> 32) as u32));
            let mut kept = Vec::with_capacity(4 * k);
            for (h, row) in rows.iter().enumerate() {
                let row = &row[range.clone()];
                let mut keep = |m: u32, at: usize| {
                    let mut m = m;
                    while m != 0 {
                        let b = range.start + at + m.trailing_zeros() as usize;
                        kept.push(pack(h, b));
                        m &= m - 1;
                    }
                };
                let chunks = row.chunks_exact(16);
                let tail = chunks.remainder();
                for (c, chunk) in chunks.enumerate() {
                    keep(at_least_16(chunk, least), c * 16);
                }
                let m = (tail.iter().enumerate())
                    .fold(0u32, |m, (i, &x)| m | (u32::from(x >= least) << i));
                keep(m, row.len() - tail.len());
            }
            if kept.len() >= k { kept } else { all() }
        }
        _ => all(),
    };
    if k < kept.len() {
        kept.select_nth_unstable(k);
    }
    kept[..k].iter().map(|&p| place(p)).collect()
}

/// A bound at or above the `k`-th smallest of `total` distinct values (`value(i)` the `i`-th)
/// read off an evenly strided sample, four of the sample's standard deviations past its `k`-th
/// quantile: the values at most it are a few times `k`, and at least `k` unless the data is
/// far from what the sample shows (the caller checks). `None` where the set is small or the
/// bound would cut little.
fn sampled_bound(total: usize, k: usize, value: impl Fn(usize) -> u64) -> Option<u64> {
    if total < SAMPLED_FROM {
        return None;
    }
    let stride = total / SAMPLES;
    let mut sample: Vec<u64> = (0..SAMPLES).map(|j| value(j * stride)).collect();
    let rank = k * SAMPLES / total;
    let at = rank + 4 * (rank as f64).sqrt().ceil() as usize + 4;
    // One value's rank, not the whole order: a sort of the sample was a sixth of a 64k
    // layer's selection (perf).
    (at < sample.len()).then(|| *sample.select_nth_unstable(at).1)
}

/// Bit `i` set where `chunk[i] >= least` (NaN: clear), for 16 scores.
#[inline]
fn at_least_16(chunk: &[f32], least: f32) -> u32 {
    debug_assert_eq!(chunk.len(), 16);
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        // SSE2 is part of x86-64. Four compares and their sign masks where the fold below
        // compiled to a compare, a shift and an or a score: 15% of a 64k layer's selection
        // (perf), ~5 µs.
        // SAFETY: 16 readable floats (asserted by the callers' `chunks_exact(16)`).
        unsafe {
            let l = _mm_set1_ps(least);
            let p = chunk.as_ptr();
            let m = |i: usize| _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(p.add(4 * i)), l)) as u32;
            m(0) | m(1) << 4 | m(2) << 8 | m(3) << 12
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    chunk
        .iter()
        .enumerate()
        .fold(0u32, |m, (i, &x)| m | (u32::from(x >= least) << i))
}

/// A score as a `u32` in the same order (NaN lowest, below negative infinity): the float's
/// bits with the sign bit flipped for positives and every bit for negatives.
fn score_key(s: f32) -> u32 {
    let u = s.to_bits();
    // All ones where the sign is set, else just the sign bit.
    let flip = ((u as i32 >> 31) as u32) | 0x8000_0000;
    if s.is_nan() { 0 } else { u ^ flip }
}

/// The score whose [`score_key`] is `key` (`key` not 0, NaN's).
fn score_of_key(key: u32) -> f32 {
    f32::from_bits(if key & 0x8000_0000 != 0 {
        key ^ 0x8000_0000
    } else {
        !key
    })
}

/// Sets of at least this many are first cut down by a sampled bound ([`sampled_bound`]).
const SAMPLED_FROM: usize = 2048;
/// Values the bound is estimated from.
const SAMPLES: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_sink_and_newest() {
        let s = [0.0, 9.0, 1.0, 8.0, 2.0, 7.0, -5.0];
        assert_eq!(select_top_k(&s, 4, 1), vec![0, 1, 3, 6]);
        assert_eq!(select_top_k(&s, 2, 1), vec![0, 6]);
        assert_eq!(select_top_k(&s, 1, 1), vec![0, 6]);
        assert_eq!(select_top_k(&s, 100, 1), (0..7).collect::<Vec<_>>());
        assert_eq!(select_top_k(&[1.0], 0, 1), vec![0]);
        assert_eq!(select_top_k(&[], 4, 1), Vec::<usize>::new());
    }

    #[test]
    fn keeps_a_local_window() {
        let s = [0.0, 9.0, 1.0, 8.0, 2.0, 7.0, -5.0];
        assert_eq!(select_top_k(&s, 4, 2), vec![0, 1, 5, 6]);
        assert_eq!(select_top_k(&s, 5, 3), vec![0, 1, 4, 5, 6]);
        // A window as large as the budget still leaves the sink in.
        assert_eq!(select_top_k(&s, 3, 9), vec![0, 5, 6]);
        assert_eq!(select_top_k(&s, 3, 0), vec![0, 1, 6]);
    }

    #[test]
    fn spans_bring_the_next_block_at_the_same_budget() {
        let s = [0.0, 9.0, 1.0, 8.0, 2.0, 7.0, 3.0, -5.0];
        // Budget 5: sink, newest, and three by score: 1 (+2), 3.
        assert_eq!(select_spans(&s, 5, 1, true), vec![0, 1, 2, 3, 7]);
        assert_eq!(select_spans(&s, 5, 1, false), vec![0, 1, 3, 5, 7]);
        // A pick next to the window brings no window block twice.
        let s = [0.0, 0.0, 0.0, 0.0, 1.0, 9.0, -5.0];
        assert_eq!(select_spans(&s, 4, 1, true), vec![0, 4, 5, 6]);
        // Without spans, the same as select_top_k.
        for b in 1..10 {
            assert_eq!(select_spans(&s, b, 1, false), select_top_k(&s, b, 1));
        }
    }

    #[test]
    fn a_shared_budget_goes_where_attention_is_spread() {
        // Head 0 attends one block, head 1 spreads over eight: budget 4 a head, window 1.
        let mut concentrated = [0.01f32; 10];
        concentrated[3] = 0.9;
        let spread = [0.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.0];
        let own: Vec<Vec<usize>> = [&concentrated[..], &spread]
            .iter()
            .map(|s| select_top_k(s, 4, 1))
            .collect();
        assert_eq!(own[0].len() + own[1].len(), 8);
        let shared = select_shared(&[&concentrated, &spread], 4, 1, false);
        assert_eq!(shared[0], vec![0, 3, 9]);
        assert_eq!(shared[1].len(), 5);
        assert!(shared[1].starts_with(&[0]) && shared[1].ends_with(&[9]));
        // A context within the budget: every block of every head.
        let all = select_shared(&[&[1.0; 4], &[2.0; 4]], 4, 1, true);
        assert_eq!(all, vec![vec![0, 1, 2, 3]; 2]);
    }

    #[test]
    fn a_shared_budget_keeps_the_most_attention_a_layer_can_at_its_size() {
        // Random shares: per head, each head's own top-k; shared, the layer's, which holds
        // at least as much of the scores (the largest sum of that many), the same number of
        // blocks, and every head's sink and window. One head alone: the per-head top-k.
        let mut seed = 0x5eed_u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32
        };
        for case in 0..200 {
            let (hk, n) = (1 + case % 4, 3 + case % 37);
            let (budget, recent, spans) = (2 + case % 9, 1 + case % 3, case % 5 == 0);
            let scores: Vec<Vec<f32>> = (0..hk)
                .map(|_| (0..n).map(|_| next().powi(4)).collect())
                .collect();
            let rows: Vec<&[f32]> = scores.iter().map(Vec::as_slice).collect();
            let own: Vec<Vec<usize>> = rows
                .iter()
                .map(|s| select_spans(s, budget, recent, spans))
                .collect();
            let shared = select_shared(&rows, budget, recent, spans);
            let total = |sel: &[Vec<usize>]| -> (usize, f32) {
                let blocks = sel.iter().map(Vec::len).sum();
                let mass = (sel.iter().zip(&scores))
                    .map(|(sel, s)| sel.iter().map(|&b| s[b]).sum::<f32>())
                    .sum();
                (blocks, mass)
            };
            let ((own_blocks, own_mass), (blocks, mass)) = (total(&own), total(&shared));
            assert_eq!(blocks, own_blocks, "case {case}");
            if !spans {
                assert!(mass >= own_mass - 1e-5, "case {case}: {mass} < {own_mass}");
            }
            let window = recent.clamp(1, budget.max(2) - 1).min(n);
            for sel in &shared {
                assert!(sel.windows(2).all(|w| w[0] < w[1]), "case {case}: {sel:?}");
                assert_eq!(sel[0], 0);
                assert!(sel.ends_with(&((n - window)..n).collect::<Vec<_>>()));
            }
            if hk == 1 {
                assert_eq!(shared, own, "case {case}");
            }
        }
    }

    /// A fixed-seed stream of 31-bit numbers (Knuth's MMIX LCG, its high bits).
    fn lcg(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            seed >> 33
        }
    }

    /// The ranking `best_of_rows` promises, by a full sort: score descending (NaN last, -0
    /// below +0 as their keys order them), then the lower (row, block).
    fn ranked(rows: &[&[f32]], range: std::ops::Range<usize>, k: usize) -> Vec<(usize, usize)> {
        let mut all: Vec<(usize, usize)> = (0..rows.len())
            .flat_map(|h| range.clone().map(move |b| (h, b)))
            .collect();
        all.sort_by(|&(ha, ba), &(hb, bb)| {
            score_key(rows[hb][bb])
                .cmp(&score_key(rows[ha][ba]))
                .then((ha, ba).cmp(&(hb, bb)))
        });
        all.truncate(k);
        all.sort_unstable();
        all
    }

    #[test]
    fn the_sampled_top_k_is_the_exact_top_k() {
        let mut next = lcg(0xb0b);
        for case in 0..300 {
            let (hk, n) = (1 + case % 8, 2 + (next() % 3000) as usize);
            let specials = [f32::NAN, 0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY];
            let rows: Vec<Vec<f32>> = (0..hk)
                .map(|_| {
                    (0..n)
                        .map(|_| match case % 5 {
                            // Few distinct values: ties everywhere.
                            0 => (next() % 7) as f32,
                            // Special values among the others.
                            1 if next().is_multiple_of(10) => specials[(next() % 5) as usize],
                            3 => -((next() % 100000) as f32),
                            _ => next() as f32 / (1u64 << 31) as f32,
                        })
                        .collect()
                })
                .collect();
            let mut rows = rows;
            let lo = (next() as usize % 3).min(n - 1);
            let range = lo..n - (next() as usize % 2).min(n - 1 - lo);
            let k = next() as usize % (hk * range.len() + 2);
            if case % 5 == 2 {
                // High where the stride sample looks, low elsewhere: the bound keeps too few
                // (where k is above the sample's size) and the exact path answers.
                let (per, stride) = (range.len(), (hk * range.len() / SAMPLES).max(1));
                for i in 0..hk * per {
                    rows[i / per][range.start + i % per] = if i % stride == 0 {
                        1.0
                    } else {
                        -1.0 - (i % 3) as f32
                    };
                }
            }
            let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
            let mut got = best_of_rows(&refs, range.clone(), k);
            got.sort_unstable();
            assert_eq!(got, ranked(&refs, range, k), "case {case}, k {k}");
        }
    }

    #[test]
    fn a_score_key_orders_as_the_scores_with_nan_lowest() {
        let order = [
            f32::NAN,
            f32::NEG_INFINITY,
            -1e30,
            -1.0,
            -1e-45,
            -0.0,
            0.0,
            1e-45,
            1.0,
            1e30,
            f32::INFINITY,
        ];
        for w in order.windows(2) {
            assert!(score_key(w[0]) < score_key(w[1]), "{w:?}");
        }
        for &x in &order[1..] {
            assert_eq!(score_of_key(score_key(x)).to_bits(), x.to_bits());
        }
    }

    #[test]
    fn a_device_s_picks_of_the_cut_select_as_the_scores_do() {
        let mut next = lcg(0x70b);
        for case in 0..300 {
            let (n, hk) = (1 + (next() % 400) as usize, 1 + (next() % 8) as usize);
            let (budget, recent) = (2 + (next() % 60) as usize, (next() % 9) as usize);
            let rows: Vec<Vec<f32>> = (0..hk)
                .map(|_| {
                    (0..n)
                        .map(|_| match case % 3 {
                            0 => (next() % 5) as f32,
                            1 if next().is_multiple_of(7) => f32::NAN,
                            _ => next() as f32 / (1u64 << 31) as f32,
                        })
                        .collect()
                })
                .collect();
            let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
            // A device's scores stop before the newest block: the same picks.
            let short: Vec<&[f32]> = refs.iter().map(|r| &r[..n - 1]).collect();
            let own: Vec<Vec<usize>> = refs
                .iter()
                .map(|s| select_top_k(s, budget, recent))
                .collect();
            match TopCut::of(n, budget, recent) {
                None => assert!(own.iter().all(|s| *s == (0..n).collect::<Vec<_>>())),
                Some(cut) => {
                    let picks = best_in(&refs, cut);
                    assert!(
                        picks.iter().all(|p| p.len() == cut.picks(hk)),
                        "case {case}"
                    );
                    assert_eq!(cut.selections(n, &picks), Some(own), "case {case}");
                    assert_eq!(best_in(&short, cut), picks, "case {case}");
                }
            }
            let shared = select_shared(&refs, budget, recent, false);
            match TopCut::shared_of(n, budget, recent, hk) {
                None => assert!(shared.iter().all(|s| *s == (0..n).collect::<Vec<_>>())),
                Some(cut) => {
                    let picks = best_in(&refs, cut);
                    let total: usize = picks.iter().map(Vec::len).sum();
                    assert_eq!(total, cut.picks(hk), "case {case}");
                    assert_eq!(cut.selections(n, &picks), Some(shared), "case {case}");
                    assert_eq!(best_in(&short, cut), picks, "case {case}");
                }
            }
        }
    }

    #[test]
    fn picks_that_are_not_the_cut_s_answer_are_refused() {
        let cut = TopCut::of(10, 5, 2).unwrap();
        assert_eq!(
            cut,
            TopCut {
                from: 1,
                to: 8,
                k: 2,
                shared: false
            }
        );
        let one = |p: &[usize]| cut.selections(10, &[p.to_vec()]);
        assert_eq!(one(&[3, 5]), Some(vec![vec![0, 3, 5, 8, 9]]));
        for bad in [
            &[3][..],
            &[3, 5, 6],
            &[5, 3],
            &[3, 3],
            &[0, 5],
            &[3, 8],
            &[],
        ] {
            assert_eq!(one(bad), None, "{bad:?}");
        }
        assert_eq!(
            cut.selections(7, &[vec![3, 5]]),
            None,
            "a cut past the blocks"
        );
        assert_eq!(TopCut::of(5, 5, 2), None, "the budget takes every block");
        // Shared: any split of the layer's four picks, none out of place.
        let cut = TopCut::shared_of(10, 5, 2, 2).unwrap();
        assert_eq!((cut.k, cut.shared), (4, true));
        assert_eq!(
            cut.selections(10, &[vec![1, 2, 3], vec![7]]),
            Some(vec![vec![0, 1, 2, 3, 8, 9], vec![0, 7, 8, 9]])
        );
        assert!(cut.selections(10, &[vec![], vec![1, 2, 3, 4]]).is_some());
        assert_eq!(cut.selections(10, &[vec![1, 2], vec![7]]), None, "three");
        assert_eq!(
            cut.selections(10, &[vec![1, 2, 9], vec![7]]),
            None,
            "in the window"
        );
    }

    #[test]
    fn nan_scores_lose() {
        let s = [0.0, f32::NAN, 1.0, 0.5, 0.0];
        assert_eq!(select_top_k(&s, 3, 1), vec![0, 2, 4]);
    }
}
