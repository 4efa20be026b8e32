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
    out.extend(best_blocks(&mut middle, k, spans.then_some(n - recent)));
    out.extend(n - recent..n);
    out.sort_unstable();
    out
}

/// The `k` best of `cands` (block, score), unordered. NaN scores (from NaN KV) rank last
/// instead of poisoning the order. With `spans_below: Some(end)`, each pick also takes the
/// block after it when that block is below `end`, not yet taken, and `k` has room.
pub(crate) fn best_blocks(
    cands: &mut [(usize, f32)],
    k: usize,
    spans_below: Option<usize>,
) -> Vec<usize> {
    let key = |s: f32| if s.is_nan() { f32::NEG_INFINITY } else { s };
    let by_score = |a: &(usize, f32), b: &(usize, f32)| key(b.1).total_cmp(&key(a.1));
    let Some(end) = spans_below else {
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
        if out.len() < k && b + 1 < end && taken.insert(b + 1) {
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
    fn nan_scores_lose() {
        let s = [0.0, f32::NAN, 1.0, 0.5, 0.0];
        assert_eq!(select_top_k(&s, 3, 1), vec![0, 2, 4]);
    }
}
