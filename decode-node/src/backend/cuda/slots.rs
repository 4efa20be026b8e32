//! Which device slot holds which block: one table per sequence, indexed by
//! `layer * num_kv_heads + head` and block, with least-recently-used eviction.
//!
//! Pure bookkeeping (no CUDA), so it is tested without a GPU. Slots themselves come from the
//! shared arena's free list, handed in as a closure.

/// No slot.
const NO_SLOT: u32 = u32::MAX;

/// The slots of one (layer, KV head), indexed by block: a lookup per attended block is an
/// array read (full attention at long context attends thousands of blocks per layer).
#[derive(Debug, Clone, Default)]
struct HeadSlots {
    /// Slot of each block, or [`NO_SLOT`].
    slot: Vec<u32>,
    /// Tokens each slot holds.
    valid: Vec<u32>,
    /// Tick of the last use of each block.
    last: Vec<u64>,
    /// Blocks that hold a slot.
    held: Vec<usize>,
}

impl HeadSlots {
    fn grow(&mut self, block: usize) {
        if self.slot.len() <= block {
            let n = (block + 1).next_power_of_two();
            self.slot.resize(n, NO_SLOT);
            self.valid.resize(n, 0);
            self.last.resize(n, 0);
        }
    }

    /// Frees the least recently used slot not touched at `tick`; returns it.
    fn evict(&mut self, tick: u64) -> Option<u32> {
        let (i, _) = self
            .held
            .iter()
            .enumerate()
            .filter(|(_, b)| self.last[**b] < tick)
            .min_by_key(|(_, b)| (self.last[**b], **b))?;
        let b = self.held.swap_remove(i);
        self.valid[b] = 0;
        Some(std::mem::replace(&mut self.slot[b], NO_SLOT))
    }
}

/// A sequence's slot table.
#[derive(Debug, Clone)]
pub(crate) struct SlotTable {
    heads: Vec<HeadSlots>,
    /// Slots one head keeps before it recycles its own least recently used.
    cap: usize,
    /// Advanced once per attention call: blocks used in the current call are never evicted.
    tick: u64,
}

impl SlotTable {
    /// A table for `heads` (layer, KV head) pairs keeping up to `cap` slots each.
    pub(crate) fn new(heads: usize, cap: usize) -> Self {
        Self {
            heads: vec![HeadSlots::default(); heads],
            cap: cap.max(2),
            tick: 0,
        }
    }

    /// Starts a new call: what it touches is protected from eviction until the next one.
    pub(crate) fn next_tick(&mut self) {
        self.tick += 1;
    }

    /// The slot of `block` of head `lh` and whether it must be (re)filled to hold `len` tokens
    /// (new to the device, or grown since it was copied). A head at capacity recycles its
    /// least recently used slot not touched in this call; otherwise a slot comes from `free`,
    /// and when that is empty the head gives up its own least recently used one. `None`:
    /// nothing can be freed.
    pub(crate) fn slot_for(
        &mut self,
        lh: usize,
        block: usize,
        len: usize,
        free: &mut dyn FnMut() -> Option<u32>,
    ) -> Option<(u32, bool)> {
        let tick = self.tick;
        let hs = &mut self.heads[lh];
        hs.grow(block);
        if hs.slot[block] != NO_SLOT {
            hs.last[block] = tick;
            return Some((hs.slot[block], (hs.valid[block] as usize) < len));
        }
        let reuse = if hs.held.len() >= self.cap {
            hs.evict(tick)
        } else {
            None
        };
        let slot = match reuse.or_else(&mut *free) {
            Some(s) => s,
            None => hs.evict(tick)?,
        };
        hs.slot[block] = slot;
        hs.valid[block] = 0;
        hs.last[block] = tick;
        hs.held.push(block);
        Some((slot, true))
    }

    /// Records that `block` of head `lh` now holds `len` tokens on the device.
    pub(crate) fn set_valid(&mut self, lh: usize, block: usize, len: usize) {
        if let Some(v) = self.heads[lh].valid.get_mut(block) {
            *v = len as u32;
        }
    }

    /// Every slot held.
    pub(crate) fn held(&self) -> impl Iterator<Item = u32> + '_ {
        self.heads
            .iter()
            .flat_map(|h| h.held.iter().map(|b| h.slot[*b]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A free list of `n` slots.
    fn arena(n: u32) -> Vec<u32> {
        (0..n).rev().collect()
    }

    #[test]
    fn new_blocks_are_filled_once_and_refilled_when_they_grow() {
        let mut free = arena(8);
        let mut t = SlotTable::new(2, 4);
        t.next_tick();
        let (s, fill) = t.slot_for(0, 5, 32, &mut || free.pop()).unwrap();
        assert!(fill);
        t.set_valid(0, 5, 32);
        assert_eq!(t.slot_for(0, 5, 32, &mut || free.pop()), Some((s, false)));
        // The newest block grows by a token: copied again.
        t.set_valid(0, 7, 3);
        let (s7, _) = t.slot_for(0, 7, 3, &mut || free.pop()).unwrap();
        t.set_valid(0, 7, 3);
        assert_eq!(t.slot_for(0, 7, 4, &mut || free.pop()), Some((s7, true)));
        // Heads do not share slots.
        let (other, fill) = t.slot_for(1, 5, 32, &mut || free.pop()).unwrap();
        assert!(fill && other != s);
    }

    #[test]
    fn a_full_head_recycles_its_least_recently_used_block_not_used_now() {
        let mut free = arena(100);
        let mut t = SlotTable::new(1, 3);
        for b in 0..3 {
            t.next_tick();
            t.slot_for(0, b, 32, &mut || free.pop()).unwrap();
            t.set_valid(0, b, 32);
        }
        t.next_tick();
        // Block 0 is used again now; block 1 is the oldest untouched: its slot is reused.
        let s0 = t.slot_for(0, 0, 32, &mut || free.pop()).unwrap().0;
        let s1 = t.heads[0].slot[1];
        let (s, fill) = t.slot_for(0, 9, 32, &mut || free.pop()).unwrap();
        assert_eq!((s, fill), (s1, true));
        assert_eq!(t.heads[0].slot[1], NO_SLOT);
        assert_ne!(s, s0);
        assert_eq!(free.len(), 97, "no new slot taken at capacity");
        // Everything touched in this call: over capacity from the free list instead.
        t.slot_for(0, 2, 32, &mut || free.pop()).unwrap();
        t.slot_for(0, 11, 32, &mut || free.pop()).unwrap();
        assert_eq!(free.len(), 96);
    }

    #[test]
    fn a_full_arena_takes_from_the_head_itself_or_says_so() {
        let mut free = arena(2);
        let mut t = SlotTable::new(1, 10);
        t.next_tick();
        t.slot_for(0, 0, 8, &mut || free.pop()).unwrap();
        t.slot_for(0, 1, 8, &mut || free.pop()).unwrap();
        // Arena empty and both slots used in this call: nothing to give.
        assert_eq!(t.slot_for(0, 2, 8, &mut || free.pop()), None);
        t.next_tick();
        let (s, fill) = t.slot_for(0, 2, 8, &mut || free.pop()).unwrap();
        assert!(fill);
        let mut held: Vec<u32> = t.held().collect();
        held.sort_unstable();
        assert_eq!(held, vec![0, 1]);
        assert!(held.contains(&s));
    }
}
