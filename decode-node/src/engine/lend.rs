//! Spare device KV lent to running requests (`--spare-device-kv on`): which request may take
//! room for every block it can hold, and which loans go back so that a waiting request can
//! start. Pure, as admission is: the step loop gathers the shares, this decides, and the
//! tests below pin each rule.

use std::cmp::Reverse;

/// A running request's device KV as lending sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Share {
    /// What admission counted for it: its mode's resident blocks (and its sketch).
    pub base: u64,
    /// What every block it may ever hold takes (and its sketch).
    pub whole: u64,
    /// It holds a loan: `whole` is counted, not `base`.
    pub lent: bool,
}

impl Share {
    /// Bytes counted against the device now.
    pub(crate) fn counted(&self) -> u64 {
        if self.lent { self.whole } else { self.base }
    }

    /// Bytes a loan adds to what admission counted.
    pub(crate) fn extra(&self) -> u64 {
        self.whole.saturating_sub(self.base)
    }
}

/// Requests to lend to, in order (the oldest first): each without a loan whose every block
/// fits in what the others leave of `capacity`, counted as it is given.
pub(crate) fn lend_to(shares: &[Share], capacity: u64) -> Vec<usize> {
    let mut used: u64 = shares.iter().map(Share::counted).sum();
    let mut out = Vec::new();
    for (i, s) in shares.iter().enumerate() {
        if s.lent || s.extra() == 0 {
            continue;
        }
        if used.saturating_add(s.extra()) <= capacity {
            used += s.extra();
            out.push(i);
        }
    }
    out
}

/// Loans to call back so that `need` more bytes fit in `capacity`: the largest first, so as
/// few as that takes. `None` where calling back every loan would not make room (then none
/// should go back). Empty where `need` fits already.
pub(crate) fn call_back_for(shares: &[Share], capacity: u64, need: u64) -> Option<Vec<usize>> {
    let fits = |used: u64| used.saturating_add(need) <= capacity;
    let mut used: u64 = shares.iter().map(Share::counted).sum();
    let mut lent: Vec<usize> = (0..shares.len()).filter(|&i| shares[i].lent).collect();
    lent.sort_by_key(|&i| (Reverse(shares[i].extra()), i));
    let mut out = Vec::new();
    for i in lent {
        if fits(used) {
            break;
        }
        used -= shares[i].extra();
        out.push(i);
    }
    fits(used).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(base: u64, whole: u64, lent: bool) -> Share {
        Share { base, whole, lent }
    }

    #[test]
    fn loans_go_in_order_to_each_request_whose_every_block_fits_in_what_is_spare() {
        // 100 of capacity; 10 + 20 + 5 counted.
        let shares = [
            share(10, 50, false),
            share(20, 90, false),
            share(5, 30, false),
        ];
        // The first takes 40 more (75); the second's 70 does not fit, the third's 25 does.
        assert_eq!(lend_to(&shares, 100), vec![0, 2]);
        assert_eq!(lend_to(&shares, 75), vec![0]);
        // A loan that does not fit does not stop a smaller one behind it.
        assert_eq!(lend_to(&shares, 74), vec![2]);
        assert_eq!(lend_to(&shares, 34), Vec::<usize>::new());
        // One holding a loan is counted whole and gets nothing more; nor does one whose
        // base is every block already (a short request, or `full`).
        let shares = [
            share(10, 50, true),
            share(20, 20, false),
            share(5, 30, false),
        ];
        assert_eq!(lend_to(&shares, 100), vec![2]);
        assert_eq!(lend_to(&shares, 99), Vec::<usize>::new());
    }

    #[test]
    fn the_largest_loans_go_back_first_and_only_as_many_as_make_room() {
        let shares = [
            share(10, 30, true),
            share(10, 80, true),
            share(10, 10, false),
            share(10, 50, true),
        ];
        // 170 counted of 200.
        assert_eq!(call_back_for(&shares, 200, 30), Some(vec![]));
        assert_eq!(call_back_for(&shares, 200, 31), Some(vec![1]));
        // Back: 70 (index 1), then 40 (index 3), then 20 (index 0).
        assert_eq!(call_back_for(&shares, 200, 100), Some(vec![1]));
        assert_eq!(call_back_for(&shares, 200, 101), Some(vec![1, 3]));
        assert_eq!(call_back_for(&shares, 200, 160), Some(vec![1, 3, 0]));
        // Even with every loan back (40 counted), 161 does not fit: nothing goes back.
        assert_eq!(call_back_for(&shares, 200, 161), None);
        assert_eq!(call_back_for(&[], 0, 1), None);
        assert_eq!(call_back_for(&[], 0, 0), Some(vec![]));
    }
}
