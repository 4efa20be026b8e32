//! Which blocks of one (layer, KV head) are resident on the device, with LRU eviction under a
//! per-head cap and the recalls scheduled for the next step. The one residency table: a device
//! backend mirrors it slot for slot.

/// Residency of one (layer, KV head)'s blocks.
#[derive(Debug, Clone, Default)]
pub(crate) struct Residency {
    resident: Vec<bool>,
    /// The resident blocks (eviction scans these, not every block of a long context).
    list: Vec<usize>,
    last_used: Vec<u64>,
    /// Blocks recalled after the last step, resident from the next plan of this layer.
    pending: Vec<usize>,
}

impl Residency {
    /// `n` blocks, none resident.
    pub(crate) fn new(n: usize) -> Self {
        Self {
            resident: vec![false; n],
            list: Vec::new(),
            last_used: vec![0; n],
            pending: Vec::new(),
        }
    }

    /// Tracks one more block (a new block of the sequence), not resident, used at `step`.
    pub(crate) fn push(&mut self, step: u64) {
        self.resident.push(false);
        self.last_used.push(step);
    }

    /// Is `b` on the device?
    pub(crate) fn is_resident(&self, b: usize) -> bool {
        self.resident.get(b).copied().unwrap_or(false)
    }

    /// Resident blocks.
    pub(crate) fn count(&self) -> usize {
        self.list.len()
    }

    /// Marks `b` used at `step`: it is not evicted to make room during that step.
    pub(crate) fn touch(&mut self, b: usize, step: u64) {
        self.last_used[b] = step;
    }

    /// Makes `b` resident, evicting the least recently used block (never the sink, the newest,
    /// or one used this step) when `cap` blocks are already resident. Returns false when
    /// nothing could be evicted (`b` stays on the host).
    pub(crate) fn make_resident(&mut self, b: usize, step: u64, cap: usize) -> bool {
        if self.resident[b] {
            self.last_used[b] = step;
            return true;
        }
        if self.list.len() >= cap {
            let newest = self.resident.len() - 1;
            let victim = self
                .list
                .iter()
                .enumerate()
                .filter(|&(_, &i)| i != 0 && i != newest && i != b && self.last_used[i] < step)
                .min_by_key(|&(_, &i)| (self.last_used[i], i))
                .map(|(at, _)| at);
            let Some(at) = victim else { return false };
            let v = self.list.swap_remove(at);
            self.resident[v] = false;
        }
        self.resident[b] = true;
        self.list.push(b);
        self.last_used[b] = step;
        true
    }

    /// Schedules `blocks` to become resident at this layer's next plan.
    pub(crate) fn schedule(&mut self, blocks: impl IntoIterator<Item = usize>) {
        self.pending.extend(blocks);
    }

    /// The blocks scheduled and not yet made resident.
    pub(crate) fn pending(&self) -> &[usize] {
        &self.pending
    }

    /// Makes the scheduled blocks resident (a device copied them since they were scheduled).
    pub(crate) fn apply_pending(&mut self, step: u64, cap: usize) {
        for b in std::mem::take(&mut self.pending) {
            if b < self.resident.len() {
                self.make_resident(b, step, cap);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_eviction_spares_the_sink_the_newest_and_this_steps_blocks() {
        let mut r = Residency::new(8);
        for (step, b) in [0usize, 7, 3, 4].into_iter().enumerate() {
            assert!(r.make_resident(b, step as u64, 4));
        }
        assert_eq!(r.count(), 4);
        // Full: 3 is the least recently used block that may go (0 is the sink, 7 the newest).
        assert!(r.make_resident(5, 10, 4));
        assert!(!r.is_resident(3) && r.is_resident(5) && r.is_resident(0) && r.is_resident(7));
        // Everything evictable was used this step: nothing is evicted, 6 stays on the host.
        r.touch(4, 11);
        r.touch(5, 11);
        assert!(!r.make_resident(6, 11, 4));
        assert!(!r.is_resident(6));
        assert_eq!(r.count(), 4);
        // Already resident: only its use is recorded.
        assert!(r.make_resident(4, 12, 4));
        assert_eq!(r.count(), 4);
    }

    #[test]
    fn scheduled_blocks_become_resident_at_the_next_plan() {
        let mut r = Residency::new(4);
        r.push(0);
        assert!(!r.is_resident(4));
        r.schedule([1, 2, 9]);
        assert_eq!(r.pending(), &[1, 2, 9]);
        assert!(!r.is_resident(1));
        r.apply_pending(1, 8);
        assert!(r.is_resident(1) && r.is_resident(2) && !r.is_resident(9));
        assert!(r.pending().is_empty());
    }
}
