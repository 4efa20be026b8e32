//! One planner per attention mode: how a (layer, KV head)'s blocks split between the device
//! and the CPU this step. Each is a function of the head's selection (made for the whole layer
//! by [`crate::SeqAttention::select_layer`]) and residency alone, so it is tested on its own;
//! [`crate::SeqAttention::plan_layer`] picks one by mode. Every planner
//! leaves each device block resident (with a slot) in the head's one residency table.

use crate::policy::AttentionConfig;
use crate::residency::Residency;
use crate::sequence::HeadPlan;

/// Blocks per head from which a scan over blocks runs in parallel.
pub(crate) const PARALLEL_SELECT_BLOCKS: usize = 256;

/// `full`: every one of the `n` blocks on the device (nothing is ever evicted).
pub(crate) fn full(res: &mut Residency, n: usize, step: u64) -> HeadPlan {
    if res.count() < n {
        for b in 0..n {
            res.make_resident(b, step, usize::MAX);
        }
    }
    HeadPlan {
        device: (0..n).collect(),
        cpu: Vec::new(),
    }
}

/// Makes `plan`'s device blocks resident (used at `step`) within `cap`; a block that finds no
/// room (every other one is in use this step) is attended on the CPU instead.
fn place(res: &mut Residency, mut plan: HeadPlan, step: u64, cap: usize) -> HeadPlan {
    // Touched first, so placing one block of this step never evicts another.
    for &b in &plan.device {
        if res.is_resident(b) {
            res.touch(b, step);
        }
    }
    // The sink, then newest first: under a tight cap the recent blocks stay on the device.
    let (sink, rest) = plan
        .device
        .split_at(usize::from(plan.device.first() == Some(&0)));
    let (mut device, spill): (Vec<usize>, Vec<usize>) = sink
        .iter()
        .chain(rest.iter().rev())
        .partition(|b| res.make_resident(**b, step, cap));
    device.sort_unstable();
    if !spill.is_empty() {
        plan.cpu.extend(spill);
        plan.cpu.sort_unstable();
    }
    plan.device = device;
    plan
}

/// `hgca`: the sink and a recent window dense on the device ([`hgca_window`] blocks); the
/// rest of the selection `sel` (made with that window, see [`crate::select_spans`]) on the
/// CPU. Without a selection (a dense layer) all of the rest. Placed in `res` at `step` with
/// `cap` device slots.
pub(crate) fn hgca(
    cfg: &AttentionConfig,
    sel: Option<&[usize]>,
    block_size: usize,
    n: usize,
    (res, step, cap): (&mut Residency, u64, usize),
) -> HeadPlan {
    place(res, hgca_split(cfg, sel, block_size, n), step, cap)
}

/// Newest blocks `hgca` attends densely on the device: the local window where one is
/// configured, else half the budget; at least one, and never the whole budget.
pub(crate) fn hgca_window(cfg: &AttentionConfig, block_size: usize) -> usize {
    let budget = cfg.budget_blocks(block_size);
    if cfg.local_window_tokens > 0 {
        cfg.local_blocks(block_size)
    } else {
        budget / 2
    }
    .clamp(1, budget.saturating_sub(1).max(1))
}

/// The `hgca` split, before residency.
fn hgca_split(
    cfg: &AttentionConfig,
    sel: Option<&[usize]>,
    block_size: usize,
    n: usize,
) -> HeadPlan {
    let start = n.saturating_sub(hgca_window(cfg, block_size)).max(1).min(n);
    let mut device: Vec<usize> = (0..n.min(1)).chain(start..n).collect();
    device.dedup();
    let cpu = match sel {
        Some(sel) => sel
            .iter()
            .copied()
            .filter(|&b| b != 0 && b < start)
            .collect(),
        None => (1..start).collect(),
    };
    HeadPlan { device, cpu }
}

/// `recall` and `scout`: the selection `sel` split by residency (blocks recalled after the
/// last step are resident already). The first plan fills the device with the selection, and
/// `fill` (recall mode) fetches whatever is missing at every step. Returns the plan and the
/// blocks fetched by this plan.
pub(crate) fn by_residency(
    res: &mut Residency,
    sel: &[usize],
    step: u64,
    cap: usize,
    fill: bool,
) -> (HeadPlan, u64) {
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
    // Sized for the whole selection up front: `partition` grew both lists a push at a time,
    // 12% of a GPU host's plan of a 64k layer (8 KV heads, 64 blocks each; perf).
    let (mut device, mut cpu) = (Vec::with_capacity(sel.len()), Vec::with_capacity(sel.len()));
    for &b in sel {
        if res.is_resident(b) {
            device.push(b);
        } else {
            cpu.push(b);
        }
    }
    (HeadPlan { device, cpu }, fetched)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::{GroupQuery, HeadDigests};
    use crate::policy::AttentionConfig;

    #[test]
    fn full_puts_everything_on_the_device() {
        let mut res = Residency::new(3);
        let p = full(&mut res, 3, 0);
        assert_eq!(p.device, vec![0, 1, 2]);
        assert!(p.cpu.is_empty());
        assert!(res.device_blocks(&p.device).is_ok());
        res.push(1);
        assert_eq!(full(&mut res, 4, 1).device.len(), 4);
        assert_eq!(res.count(), 4);
    }

    #[test]
    fn by_residency_fills_once_then_splits_by_what_is_resident() {
        let mut res = Residency::new(10);
        // First plan: the selection is fetched up to the cap; what does not fit stays on the CPU.
        let (p, fetched) = by_residency(&mut res, &[0, 3, 5, 9], 0, 3, true);
        assert_eq!(fetched, 3);
        assert_eq!((p.device.len(), p.cpu.len()), (3, 1));
        // Later plans only split; a recall lands before the split.
        res.recall([p.cpu[0]], 0, 4);
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
        // What the sequence hands hgca: the top-k with its window.
        let sel = |cfg: &AttentionConfig, digests: &HeadDigests| -> Vec<usize> {
            let gq = GroupQuery::new(&[1.0; 4], d);
            let scores: Vec<f32> = (0..n).map(|b| digests.score(&gq, b)).collect();
            crate::select_spans(&scores, cfg.budget_blocks(16), hgca_window(cfg, 16), false)
        };
        let mut res = Residency::new(n);
        let p = hgca(
            &cfg,
            Some(&sel(&cfg, &digests)),
            16,
            n,
            (&mut res, 0, cfg.resident_blocks_per_head()),
        );
        assert!(res.device_blocks(&p.device).is_ok());
        // Budget 4 blocks: window 2 (8, 9) plus the sink on the device, 1 more on the CPU.
        assert_eq!(p.device, vec![0, 8, 9]);
        assert_eq!(p.cpu, vec![4]);
        let dense = hgca(
            &cfg,
            None,
            16,
            n,
            (&mut res, 1, cfg.resident_blocks_per_head()),
        );
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
        let p = hgca(
            &narrow,
            Some(&sel(&narrow, &digests)),
            16,
            n,
            (&mut res, 2, narrow.resident_blocks_per_head()),
        );
        assert_eq!(p.device, vec![0, 9]);
        assert_eq!(p.cpu, vec![4, 6]);
        // A window past the budget is cut to what the budget holds besides the sink.
        let wide = AttentionConfig {
            local_window_tokens: 1000,
            ..cfg
        };
        let p = hgca(
            &wide,
            Some(&sel(&wide, &digests)),
            16,
            n,
            (&mut res, 3, wide.resident_blocks_per_head()),
        );
        assert_eq!(p.device, vec![0, 7, 8, 9]);
        assert!(p.cpu.is_empty());
        // The window slid: what left it made room, and the device holds no more than its cap.
        assert!(res.count() <= wide.resident_blocks_per_head());
        assert!(res.device_blocks(&p.device).is_ok());
        // A cap below the window: what does not fit is attended on the CPU, nothing is lost.
        let tight = AttentionConfig {
            device_blocks_per_head: 2,
            ..wide
        };
        let mut res = Residency::new(n);
        let p = hgca(
            &tight,
            Some(&sel(&tight, &digests)),
            16,
            n,
            (&mut res, 0, tight.resident_blocks_per_head()),
        );
        assert_eq!(p.device, vec![0, 9]);
        assert_eq!(p.cpu, vec![7, 8]);
    }
}
