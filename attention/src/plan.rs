//! One planner per attention mode: how a (layer, KV head)'s blocks split between the device
//! and the CPU this step. Each is a function of the head's digests or residency alone, so it
//! is tested on its own; [`crate::SeqAttention::plan_layer`] picks one by mode.

use crate::policy::AttentionConfig;
use crate::residency::Residency;
use crate::sequence::HeadPlan;

/// Blocks per head from which a scan over blocks runs in parallel.
pub(crate) const PARALLEL_SELECT_BLOCKS: usize = 256;

/// `full`: every one of the `n` blocks on the device.
pub(crate) fn full(n: usize) -> HeadPlan {
    HeadPlan {
        device: (0..n).collect(),
        cpu: Vec::new(),
    }
}

/// `hgca`: the sink and a recent window dense on the device (the local window where one is
/// configured, else half the budget); the top-k of the rest by `scores` (one per block), with
/// what is left of the budget, on the CPU. Without scores (a dense layer) all of the rest.
pub(crate) fn hgca(
    cfg: &AttentionConfig,
    scores: Option<&[f32]>,
    block_size: usize,
    n: usize,
) -> HeadPlan {
    let budget = cfg.budget_blocks(block_size);
    let window = if cfg.local_window_tokens > 0 {
        cfg.local_blocks(block_size)
    } else {
        budget / 2
    }
    .clamp(1, budget.saturating_sub(1).max(1));
    let start = n.saturating_sub(window).max(1).min(n);
    let mut device: Vec<usize> = (0..n.min(1)).chain(start..n).collect();
    device.dedup();
    let Some(scores) = scores else {
        return HeadPlan {
            device,
            cpu: (1..start).collect(),
        };
    };
    let mut rest: Vec<(usize, f32)> = (1..start).map(|b| (b, scores[b])).collect();
    let k = budget.saturating_sub(device.len());
    let mut cpu = crate::select::best_blocks(&mut rest, k, cfg.select_spans.then_some(start));
    cpu.sort_unstable();
    HeadPlan { device, cpu }
}

/// `recall` and `scout`: the selection `sel` split by residency. Recalled blocks scheduled at
/// the last step become resident first; the first plan fills the device with the selection,
/// and `fetch_missing` (recall mode) fetches whatever is missing at every step. Returns the
/// plan and the blocks fetched by this plan.
pub(crate) fn by_residency(
    res: &mut Residency,
    sel: &[usize],
    step: u64,
    cap: usize,
    fill: bool,
) -> (HeadPlan, u64) {
    res.apply_pending(step, cap);
    // Selected now: never evicted to make room during this step.
    for &b in sel {
        res.touch(b, step);
    }
    let mut fetched = 0u64;
    if fill {
        for &b in sel {
            if !res.is_resident(b) && res.make_resident(b, step, cap) {
                fetched += 1;
            }
        }
    }
    let (device, cpu) = sel.iter().partition(|b| res.is_resident(**b));
    (HeadPlan { device, cpu }, fetched)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::{GroupQuery, HeadDigests};
    use crate::policy::AttentionConfig;

    #[test]
    fn full_puts_everything_on_the_device() {
        assert_eq!(full(3).device, vec![0, 1, 2]);
        assert!(full(3).cpu.is_empty());
    }

    #[test]
    fn by_residency_fills_once_then_splits_by_what_is_resident() {
        let mut res = Residency::new(10);
        // First plan: the selection is fetched up to the cap; what does not fit stays on the CPU.
        let (p, fetched) = by_residency(&mut res, &[0, 3, 5, 9], 0, 3, true);
        assert_eq!(fetched, 3);
        assert_eq!((p.device.len(), p.cpu.len()), (3, 1));
        // Later plans only split; a scheduled recall lands before the split.
        res.schedule([p.cpu[0]]);
        let (p2, fetched) = by_residency(&mut res, &[0, 3, 5, 9], 1, 4, false);
        assert_eq!(fetched, 0);
        assert_eq!(p2.device, vec![0, 3, 5, 9]);
        assert!(p2.cpu.is_empty());
    }

    #[test]
    fn hgca_window_on_the_device_and_top_k_of_the_rest_on_the_cpu() {
        let cfg = AttentionConfig {
            budget_tokens: 64,
            ..AttentionConfig::scout(16)
        };
        let (d, n) = (4, 10);
        let mut digests = HeadDigests::new(n, d);
        for b in 0..n {
            // Block 4 has the largest keys along the query.
            let k = if b == 4 { [9.0; 4] } else { [0.1; 4] };
            digests.update(b, &k);
        }
        let scores = |digests: &HeadDigests| -> Vec<f32> {
            let gq = GroupQuery::new(&[1.0; 4], d);
            (0..n).map(|b| digests.score(&gq, b)).collect()
        };
        let p = hgca(&cfg, Some(&scores(&digests)), 16, n);
        // Budget 4 blocks: window 2 (8, 9) plus the sink on the device, 1 more on the CPU.
        assert_eq!(p.device, vec![0, 8, 9]);
        assert_eq!(p.cpu, vec![4]);
        let dense = hgca(&cfg, None, 16, n);
        assert_eq!(dense.cpu, (1..8).collect::<Vec<_>>());
        // A local window of one block leaves two blocks of the budget to the top-k.
        let narrow = AttentionConfig {
            local_window_tokens: 16,
            ..cfg.clone()
        };
        for b in 0..n {
            let k = if b == 6 { [5.0; 4] } else { [0.0; 4] };
            digests.update(b, &k);
        }
        let p = hgca(&narrow, Some(&scores(&digests)), 16, n);
        assert_eq!(p.device, vec![0, 9]);
        assert_eq!(p.cpu, vec![4, 6]);
        // A window past the budget is cut to what the budget holds besides the sink.
        let wide = AttentionConfig {
            local_window_tokens: 1000,
            ..cfg
        };
        let p = hgca(&wide, Some(&scores(&digests)), 16, n);
        assert_eq!(p.device, vec![0, 7, 8, 9]);
        assert!(p.cpu.is_empty());
    }
}
