//! Which arena slot backs each residency slot of a sequence, and which block of which length
//! it holds now: one table per sequence, indexed by `layer * num_kv_heads + head` and the slot
//! the sequence's residency table (`attention::SeqAttention`) assigned. The residency table
//! decides every placement and eviction; this one only follows it, so the device never keeps
//! a block the planner thinks is gone, nor misses one it thinks is there.
//!
//! Pure bookkeeping (no CUDA), so it is tested without a GPU. Arena slots come from the shared
//! arena's free list, handed in as a closure, the first time a residency slot is used.

use attention::DeviceBlock;

/// The arena slots of one (layer, KV head), by residency slot.
#[derive(Debug, Clone, Default)]
struct HeadSlots {
    /// Arena slot of each residency slot taken so far.
    arena: Vec<u32>,
    /// The block each residency slot holds and its tokens on the device (0: not filled).
    holds: Vec<(usize, u32)>,
}

/// What a slot needs before it is attended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fill {
    /// It holds the block's tokens already.
    Keep,
    /// A copy of the whole head block (the slot held another block, or nothing yet).
    Whole,
    /// It holds the block's first `from` tokens: only the tokens after them are new (the
    /// newest block grows by one token a step).
    Tail {
        /// Tokens the slot holds already.
        from: usize,
    },
}

/// Why a block found no arena slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NoSlot {
    /// The arena is empty.
    ArenaFull,
    /// The residency slot is past what the sequence was created with (a caller defect).
    PastCap { slot: u32, cap: usize },
}

/// A sequence's slot table.
#[derive(Debug, Clone)]
pub(crate) struct SlotTable {
    heads: Vec<HeadSlots>,
    /// Residency slots per head.
    cap: usize,
}

impl SlotTable {
    /// A table for `heads` (layer, KV head) pairs with `cap` residency slots each.
    pub(crate) fn new(heads: usize, cap: usize) -> Self {
        Self {
            heads: vec![HeadSlots::default(); heads],
            cap,
        }
    }

    /// The arena slot for `b` of head `lh` and what it needs to hold `len` tokens: the whole
    /// block where the residency slot held another block (or none), the tokens past those it
    /// holds where this block has grown. Arena slots are taken from `free` as residency slots
    /// are first used.
    pub(crate) fn slot_for(
        &mut self,
        lh: usize,
        b: DeviceBlock,
        len: usize,
        free: &mut dyn FnMut() -> Option<u32>,
    ) -> Result<(u32, Fill), NoSlot> {
        let s = b.slot as usize;
        if s >= self.cap {
            return Err(NoSlot::PastCap {
                slot: b.slot,
                cap: self.cap,
            });
        }
        let hs = &mut self.heads[lh];
        while hs.arena.len() <= s {
            hs.arena.push(free().ok_or(NoSlot::ArenaFull)?);
            hs.holds.push((usize::MAX, 0));
        }
        let (block, valid) = hs.holds[s];
        let valid = valid as usize;
        let fill = if block != b.block || valid == 0 {
            Fill::Whole
        } else if valid < len {
            Fill::Tail { from: valid }
        } else {
            Fill::Keep
        };
        if block != b.block {
            hs.holds[s] = (b.block, 0);
        }
        Ok((hs.arena[s], fill))
    }

    /// Records that `b` of head `lh` now holds `len` tokens on the device.
    pub(crate) fn set_valid(&mut self, lh: usize, b: DeviceBlock, len: usize) {
        if let Some(h) = self.heads[lh].holds.get_mut(b.slot as usize) {
            *h = (b.block, len as u32);
        }
    }

    /// Every arena slot held.
    pub(crate) fn held(&self) -> impl Iterator<Item = u32> + '_ {
        self.heads.iter().flat_map(|h| h.arena.iter().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A free list of `n` slots.
    fn arena(n: u32) -> Vec<u32> {
        (0..n).rev().collect()
    }

    fn at(block: usize, slot: u32) -> DeviceBlock {
        DeviceBlock { block, slot }
    }

    #[test]
    fn blocks_are_filled_once_then_by_their_new_tokens_and_again_when_their_slot_changes_hands() {
        let mut free = arena(8);
        let mut t = SlotTable::new(2, 4);
        let (s, fill) = t.slot_for(0, at(5, 0), 32, &mut || free.pop()).unwrap();
        assert_eq!(fill, Fill::Whole);
        t.set_valid(0, at(5, 0), 32);
        assert_eq!(
            t.slot_for(0, at(5, 0), 32, &mut || free.pop()),
            Ok((s, Fill::Keep))
        );
        // The newest block grows by a token: only that token is copied.
        let (s7, _) = t.slot_for(0, at(7, 1), 3, &mut || free.pop()).unwrap();
        t.set_valid(0, at(7, 1), 3);
        assert_eq!(
            t.slot_for(0, at(7, 1), 4, &mut || free.pop()),
            Ok((s7, Fill::Tail { from: 3 }))
        );
        t.set_valid(0, at(7, 1), 4);
        assert_eq!(
            t.slot_for(0, at(7, 1), 4, &mut || free.pop()),
            Ok((s7, Fill::Keep))
        );
        // Residency gave slot 0 to block 9: same arena slot, filled whole, then settled.
        assert_eq!(
            t.slot_for(0, at(9, 0), 32, &mut || free.pop()),
            Ok((s, Fill::Whole))
        );
        t.set_valid(0, at(9, 0), 32);
        assert_eq!(
            t.slot_for(0, at(9, 0), 32, &mut || free.pop()),
            Ok((s, Fill::Keep))
        );
        // A slot handed over and not filled (the copy failed) is filled whole at the next use,
        // never by a tail over another block's tokens.
        assert_eq!(
            t.slot_for(0, at(5, 0), 32, &mut || free.pop()),
            Ok((s, Fill::Whole))
        );
        assert_eq!(
            t.slot_for(0, at(5, 0), 32, &mut || free.pop()),
            Ok((s, Fill::Whole))
        );
        // Heads do not share arena slots.
        let (other, fill) = t.slot_for(1, at(5, 0), 32, &mut || free.pop()).unwrap();
        assert!(fill == Fill::Whole && other != s);
        assert_eq!(free.len(), 5);
    }

    #[test]
    fn arena_slots_are_taken_once_per_residency_slot_and_all_given_back() {
        let mut free = arena(3);
        let mut t = SlotTable::new(1, 4);
        // Slot 2 first: the slots below it are taken too (residency numbers them densely).
        t.slot_for(0, at(40, 2), 32, &mut || free.pop()).unwrap();
        assert!(free.is_empty());
        assert_eq!(
            t.slot_for(0, at(41, 3), 32, &mut || free.pop()),
            Err(NoSlot::ArenaFull)
        );
        assert_eq!(
            t.slot_for(0, at(42, 4), 32, &mut || free.pop()),
            Err(NoSlot::PastCap { slot: 4, cap: 4 })
        );
        let mut held: Vec<u32> = t.held().collect();
        held.sort_unstable();
        assert_eq!(held, vec![0, 1, 2]);
    }
}
