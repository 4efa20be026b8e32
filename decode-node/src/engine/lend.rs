//! Spare device KV lent to running requests (`--spare-device-kv on`): which request may take
//! more device slots than admission counted for it, and which loans shrink so that a waiting
//! request can start. Pure, as admission is: the step loop gathers the shares, this decides,
//! and the tests below pin each rule.
//!
//! The rules, in order:
//! - A share of what is spare is held back: as much as the largest share admission counted
//!   for a running request. The next request like those running then starts without calling
//!   a loan back, so a busy node does not shrink and grow its loans at every arrival.
//! - Room for every block a request may hold goes first, oldest request first: such a request
//!   attends no block on the CPU once its prompt is up.
//! - What is left after those is shared out evenly, in blocks per (layer, KV head), among
//!   the requests that could not take every block: each keeps more of the blocks it
//!   attended on the device, and its CPU part shrinks with it.
//! - A waiting request that would start with some of the loaned room gets it: the largest
//!   loans shrink first, by as many blocks as it needs and no more, each keeping its most
//!   recently used blocks.

use std::cmp::Reverse;

/// A running request's device KV as lending sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Share {
    /// Bytes that do not depend on its device slots (its sketch on the device).
    pub fixed: u64,
    /// Bytes one more device slot per (layer, KV head) takes.
    pub per_block: u64,
    /// Slots per (layer, KV head) admission counted for it.
    pub base: usize,
    /// Slots per (layer, KV head) that hold every block it may ever have (prompt, and
    /// the tokens it may generate).
    pub whole: usize,
    /// Slots per (layer, KV head) lent beyond `base`: at most `whole - base`.
    pub lent: usize,
}

impl Share {
    /// Bytes of `slots` per (layer, KV head).
    fn bytes(&self, slots: usize) -> u64 {
        self.fixed
            .saturating_add(self.per_block.saturating_mul(slots as u64))
    }

    /// Bytes admission counted.
    pub(crate) fn base_bytes(&self) -> u64 {
        self.bytes(self.base)
    }

    /// Bytes counted against the device now.
    pub(crate) fn counted(&self) -> u64 {
        self.bytes(self.base + self.lent)
    }

    /// Bytes its loan adds to what admission counted.
    pub(crate) fn lent_bytes(&self) -> u64 {
        self.per_block.saturating_mul(self.lent as u64)
    }

    /// The same share with `lent` slots lent.
    pub(crate) fn with_lent(self, lent: usize) -> Self {
        Self { lent, ..self }
    }

    /// Slots per (layer, KV head) it holds now.
    pub(crate) fn slots(&self) -> usize {
        self.base + self.lent
    }

    /// Slots a loan may still add.
    fn room(&self) -> usize {
        self.whole.saturating_sub(self.base + self.lent)
    }

    /// Bytes `blocks` more slots per (layer, KV head) take.
    fn cost(&self, blocks: usize) -> u64 {
        self.per_block.saturating_mul(blocks as u64)
    }
}

/// A loan's new size: request `index` is to hold `lent` slots per (layer, KV head) beyond
/// its base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loan {
    pub index: usize,
    pub lent: usize,
}

/// What lending holds back of `capacity`: the largest share admission counted for a running
/// request (see the module's rules).
fn reserve(shares: &[Share]) -> u64 {
    shares.iter().map(Share::base_bytes).max().unwrap_or(0)
}

/// Loans to make now from what the running `shares` leave of `capacity` (less the reserve):
/// each grows, none shrinks. First, oldest first, room for every block of each request
/// whose remaining blocks fit; then the rest evenly, to the same number of lent slots per
/// (layer, KV head) where each can take it, the fewest lent raised first, and what is less
/// than a level for all a slot each for the fewest lent. Everything spare past the reserve
/// that a slot of a request short of its whole fits in is lent.
pub(crate) fn lend_to(shares: &[Share], capacity: u64) -> Vec<Loan> {
    let used: u64 = shares.iter().map(Share::counted).sum();
    let mut spare = capacity
        .saturating_sub(used)
        .saturating_sub(reserve(shares));
    let mut lent: Vec<usize> = shares.iter().map(|s| s.lent).collect();
    let room = |i: usize, lent: &[usize]| {
        let s = &shares[i];
        s.whole.saturating_sub(s.base + lent[i])
    };
    for (i, s) in shares.iter().enumerate() {
        let more = s.room();
        if more > 0 && s.cost(more) <= spare {
            spare -= s.cost(more);
            lent[i] += more;
        }
    }
    // Levels of lent slots: the highest whose cost over every request still short of its
    // whole fits in what is left (the cost grows with the level, so bisect).
    let short: Vec<usize> = (0..shares.len())
        .filter(|&i| room(i, &lent) > 0 && shares[i].per_block > 0)
        .collect();
    let cost = |level: usize| -> u64 {
        short
            .iter()
            .map(|&i| {
                let s = &shares[i];
                let to = level.min(s.whole.saturating_sub(s.base));
                s.cost(to.saturating_sub(lent[i]))
            })
            .fold(0u64, u64::saturating_add)
    };
    let (mut lo, mut hi) = (
        0usize,
        short.iter().map(|&i| shares[i].whole).max().unwrap_or(0),
    );
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if cost(mid) <= spare {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let mut left = spare.saturating_sub(cost(lo));
    for &i in &short {
        let s = &shares[i];
        lent[i] = lent[i].max(lo.min(s.whole.saturating_sub(s.base)));
    }
    // What is left is less than a level for all: a slot more each for as many as it pays
    // for, the fewest lent first (then the oldest), again while any takes one (slots cost
    // the same for every request of one model, so once).
    loop {
        let mut order: Vec<usize> = short
            .iter()
            .copied()
            .filter(|&i| room(i, &lent) > 0 && shares[i].per_block <= left)
            .collect();
        if order.is_empty() {
            break;
        }
        order.sort_by_key(|&i| (lent[i], i));
        for i in order {
            if shares[i].per_block <= left {
                left -= shares[i].per_block;
                lent[i] += 1;
            }
        }
    }
    lent.iter()
        .enumerate()
        .filter(|&(i, &l)| l != shares[i].lent)
        .map(|(index, &lent)| Loan { index, lent })
        .collect()
}

/// Loans to shrink so that `need` more bytes fit in `capacity`: the largest first, each by
/// as many slots as the room still missing takes and no more. `None` where taking every
/// loan back would not make room (then none should shrink). Empty where `need` fits
/// already.
pub(crate) fn call_back_for(shares: &[Share], capacity: u64, need: u64) -> Option<Vec<Loan>> {
    let used: u64 = shares.iter().map(Share::counted).sum();
    let mut missing = used.saturating_add(need).saturating_sub(capacity);
    let all: u64 = shares.iter().map(Share::lent_bytes).sum();
    if missing > all {
        return None;
    }
    let mut order: Vec<usize> = (0..shares.len()).filter(|&i| shares[i].lent > 0).collect();
    order.sort_by_key(|&i| (Reverse(shares[i].lent_bytes()), i));
    let mut out = Vec::new();
    for i in order {
        if missing == 0 {
            break;
        }
        let s = &shares[i];
        let back = missing.div_ceil(s.per_block.max(1)).min(s.lent as u64) as usize;
        missing = missing.saturating_sub(s.cost(back));
        out.push(Loan {
            index: i,
            lent: s.lent - back,
        });
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 10 bytes a slot and none fixed: `base`, `whole` and `lent` in slots.
    fn share(base: usize, whole: usize, lent: usize) -> Share {
        Share {
            fixed: 0,
            per_block: 10,
            base,
            whole,
            lent,
        }
    }

    fn loans(v: &[(usize, usize)]) -> Vec<Loan> {
        v.iter()
            .map(|&(index, lent)| Loan { index, lent })
            .collect()
    }

    #[test]
    fn a_share_counts_its_fixed_bytes_and_its_slots() {
        let s = Share {
            fixed: 7,
            per_block: 10,
            base: 2,
            whole: 9,
            lent: 3,
        };
        assert_eq!(
            (s.base_bytes(), s.counted(), s.lent_bytes(), s.slots()),
            (27, 57, 30, 5)
        );
    }

    #[test]
    fn every_block_goes_first_oldest_first_beside_the_reserve() {
        // 2 + 1 + 1 slots counted (40 bytes); the reserve is the largest base (20).
        let shares = [share(2, 6, 0), share(1, 9, 0), share(1, 3, 0)];
        // 40 + 20 + the first's 4 slots + the second's 8 + the third's 2.
        assert_eq!(lend_to(&shares, 200), loans(&[(0, 4), (1, 8), (2, 2)]));
        // The second's 8 do not fit beside the first's 4, but the third's 2 do, and the
        // second takes what is left: 1 slot.
        assert_eq!(lend_to(&shares, 130), loans(&[(0, 4), (1, 1), (2, 2)]));
        // Nothing past the reserve: nothing lent.
        assert_eq!(lend_to(&shares, 60), vec![]);
        // One already whole, or whose base is every block (`full`, a short request), gets
        // nothing more.
        let shares = [share(2, 6, 4), share(3, 3, 0), share(1, 3, 0)];
        // 60 + 30 + 10 counted, 30 reserved: 10 spare takes one of the third's two.
        assert_eq!(lend_to(&shares, 140), loans(&[(2, 1)]));
        assert_eq!(lend_to(&shares, 150), loans(&[(2, 2)]));
    }

    #[test]
    fn what_every_block_cannot_take_is_shared_evenly_the_fewest_lent_raised_first() {
        // Nobody's every block fits; 150 spare past the 100 counted and 50 reserved.
        let shares = [share(5, 40, 0), share(5, 30, 6), share(5, 40, 1)];
        // The first and third rise to the second's 6 lent (11 slots, 110 bytes), then all
        // three by one (30): 7 each; the 10 left is one more slot, for the oldest.
        let counted: u64 = shares.iter().map(Share::counted).sum();
        assert_eq!(counted, 220);
        assert_eq!(
            lend_to(&shares, 220 + 50 + 150),
            loans(&[(0, 8), (1, 7), (2, 7)])
        );
        // 139: one short of the round to 7, so the level stays at 6, and the 29 left is a
        // slot more for the two oldest; 110: the level alone.
        assert_eq!(
            lend_to(&shares, 220 + 50 + 139),
            loans(&[(0, 7), (1, 7), (2, 6)])
        );
        assert_eq!(lend_to(&shares, 220 + 50 + 110), loans(&[(0, 6), (2, 6)]));
        // One whose every block fits takes them first; another shares what is left.
        let shares = [share(1, 3, 0), share(1, 20, 0)];
        assert_eq!(lend_to(&shares, 20 + 10 + 100), loans(&[(0, 2), (1, 8)]));
    }

    /// Running shares as admission could leave them: each within its whole, loans on top.
    fn shares_strategy() -> impl proptest::strategy::Strategy<Value = Vec<Share>> {
        use proptest::prelude::*;
        proptest::collection::vec(
            (0u64..50, 1u64..40, 1usize..20, 0usize..60, 0usize..60),
            0..8,
        )
        .prop_map(|v| {
            v.into_iter()
                .map(|(fixed, per_block, base, more, lent)| Share {
                    fixed,
                    per_block,
                    base,
                    whole: base + more,
                    lent: lent.min(more),
                })
                .collect()
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 2000,
            rng_seed: proptest::test_runner::RngSeed::Fixed(59),
            ..proptest::prelude::ProptestConfig::default()
        })]
        /// Lending only grows loans, never past a request's whole, and leaves the reserve
        /// spare where it was spare; taking back shrinks only loans, by no more than the room
        /// missing takes, and the waiting request then fits.
        #[test]
        fn loans_respect_the_capacity_the_reserve_and_each_whole(
            shares in shares_strategy(),
            extra in 0u64..4000,
            need in 0u64..3000,
        ) {
            let used: u64 = shares.iter().map(Share::counted).sum();
            let capacity = used + extra;
            let mut after = shares.clone();
            for l in lend_to(&shares, capacity) {
                let s = &shares[l.index];
                proptest::prop_assert!(l.lent > s.lent && s.base + l.lent <= s.whole, "{l:?} {s:?}");
                after[l.index].lent = l.lent;
            }
            let lent_used: u64 = after.iter().map(Share::counted).sum();
            let spare_before = capacity - used;
            proptest::prop_assert!(
                lent_used <= used + spare_before.saturating_sub(reserve(&shares)),
                "{lent_used} {used} {capacity}"
            );
            // Nothing left that one more slot of a short request would fit in, past the
            // reserve: what is spare is lent.
            let left = capacity.saturating_sub(lent_used).saturating_sub(reserve(&shares));
            for s in &after {
                if s.room() > 0 {
                    proptest::prop_assert!(s.per_block > left, "{s:?} {left}");
                }
            }
            match call_back_for(&after, capacity, need) {
                None => {
                    let base: u64 = after.iter().map(Share::base_bytes).sum();
                    proptest::prop_assert!(base + need > capacity);
                }
                Some(back) => {
                    let mut shrunk = after.clone();
                    for l in &back {
                        let s = &after[l.index];
                        proptest::prop_assert!(l.lent < s.lent, "{l:?} {s:?}");
                        shrunk[l.index].lent = l.lent;
                    }
                    let total: u64 = shrunk.iter().map(Share::counted).sum();
                    proptest::prop_assert!(total + need <= capacity, "{total} {need} {capacity}");
                    // No loan shrank by a slot more than it had to: one slot back on the
                    // last loan that shrank would not fit.
                    if let Some(l) = back.last() {
                        let s = &after[l.index];
                        proptest::prop_assert!(total + s.per_block + need > capacity, "{back:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn loans_shrink_largest_first_by_what_the_waiting_request_needs() {
        let shares = [
            share(1, 4, 2),
            share(1, 9, 7),
            share(1, 1, 0),
            share(1, 6, 4),
        ];
        // 30 + 80 + 10 + 50 = 170 counted of 200.
        assert_eq!(call_back_for(&shares, 200, 30), Some(vec![]));
        // 1 byte short: the largest loan gives one slot back.
        assert_eq!(call_back_for(&shares, 200, 31), Some(loans(&[(1, 6)])));
        assert_eq!(call_back_for(&shares, 200, 100), Some(loans(&[(1, 0)])));
        // Past the largest loan: the next largest gives what is still missing.
        assert_eq!(
            call_back_for(&shares, 200, 115),
            Some(loans(&[(1, 0), (3, 2)]))
        );
        assert_eq!(
            call_back_for(&shares, 200, 160),
            Some(loans(&[(1, 0), (3, 0), (0, 0)]))
        );
        // Even with every loan back (40 counted), 161 does not fit: nothing shrinks.
        assert_eq!(call_back_for(&shares, 200, 161), None);
        assert_eq!(call_back_for(&[], 0, 1), None);
        assert_eq!(call_back_for(&[], 0, 0), Some(vec![]));
    }
}
