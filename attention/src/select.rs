//! Top-k block selection from digest scores.

/// Chooses which blocks of a sequence to attend.
///
/// `scores[b]` is the Quest score of block `b`; the sink (block 0) and the `recent` newest
/// blocks (at least the newest, possibly partly filled, whose score is ignored) are always
/// chosen: the local window that every token attends most. At most `budget_blocks` blocks are
/// returned (never fewer than the sink and the newest), sorted by index.
pub fn select_top_k(scores: &[f32], budget_blocks: usize, recent: usize) -> Vec<usize> {
    let n = scores.len();
    if n <= budget_blocks.max(2) {
        return (0..n).collect();
    }
    // The window never takes the whole budget: at least the sink stays in.
    let recent = recent.clamp(1, budget_blocks.max(2) - 1);
    let mut middle: Vec<usize> = (1..n - recent).collect();
    let k = budget_blocks.saturating_sub(1 + recent);
    if k < middle.len() {
        // NaN scores (from NaN KV) sort last instead of poisoning the order.
        let key = |i: &usize| {
            if scores[*i].is_nan() {
                f32::NEG_INFINITY
            } else {
                scores[*i]
            }
        };
        middle.select_nth_unstable_by(k, |a, b| key(b).total_cmp(&key(a)));
        middle.truncate(k);
    }
    let mut out = Vec::with_capacity(middle.len() + 1 + recent);
    out.push(0);
    out.extend(middle);
    out.extend(n - recent..n);
    out.sort_unstable();
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
    fn nan_scores_lose() {
        let s = [0.0, f32::NAN, 1.0, 0.5, 0.0];
        assert_eq!(select_top_k(&s, 3, 1), vec![0, 2, 4]);
    }
}
