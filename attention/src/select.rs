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
    if n <= budget_blocks.max(2) {
        return (0..n).collect();
    }
    // The window never takes the whole budget: at least the sink stays in.
    let recent = recent.clamp(1, budget_blocks.max(2) - 1);
    let mut middle: Vec<(usize, f32)> = (1..n - recent).map(|b| (b, scores[b])).collect();
    let k = budget_blocks.saturating_sub(1 + recent);
    let mut out = Vec::with_capacity(k + 1 + recent);
    out.push(0);
    let end = n - recent;
    let below_window = |b: usize| b + 1 < end;
    out.extend(best_blocks(
        &mut middle,
        k,
        spans.then_some(&below_window as &dyn Fn(usize) -> bool),
    ));
    out.extend(n - recent..n);
    out.sort_unstable();
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
    if n <= budget_blocks.max(2) || scores.iter().any(|s| s.len() != n) {
        return scores
            .iter()
            .map(|s| select_spans(s, budget_blocks, recent, spans))
            .collect();
    }
    let recent = recent.clamp(1, budget_blocks.max(2) - 1);
    let per_head = budget_blocks.saturating_sub(1 + recent);
    let mut middle: Vec<(usize, f32)> = Vec::with_capacity(scores.len() * n);
    for (h, s) in scores.iter().enumerate() {
        middle.extend((1..n - recent).map(|b| (h * n + b, s[b])));
    }
    let k = per_head * scores.len();
    // Candidate `h * n + b`: a span stays inside its head, below the window.
    let below_window = |p: usize| p % n + 1 < n - recent;
    let picks = best_blocks(
        &mut middle,
        k,
        spans.then_some(&below_window as &dyn Fn(usize) -> bool),
    );
    let mut out: Vec<Vec<usize>> = (0..scores.len()).map(|_| vec![0]).collect();
    for p in picks {
        out[p / n].push(p % n);
    }
    for sel in &mut out {
        sel.extend(n - recent..n);
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

    #[test]
    fn nan_scores_lose() {
        let s = [0.0, f32::NAN, 1.0, 0.5, 0.0];
        assert_eq!(select_top_k(&s, 3, 1), vec![0, 2, 4]);
    }
}
