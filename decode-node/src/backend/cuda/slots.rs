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
    /// Changes that may leave a slot without tokens it held: a slot handed to another block,
    /// or fewer tokens recorded than before. A block's growth is not one.
    losses: u64,
    /// The last list placed for this head.
    placed: Placed,
}

/// A head's last placed list, kept so the next step's same blocks skip the table (#21: at
/// 64k, `full` placed 16k blocks per layer one by one, ~4 ms of a 7.5 ms step on an H200).
#[derive(Debug, Clone, Default)]
struct Placed {
    /// The list's leading blocks that were whole (`block_size` tokens) and held them all on
    /// the device once placed (only these are ever reused).
    blocks: Vec<DeviceBlock>,
    /// The arena slot of each of them.
    whole: Vec<u32>,
    /// `HeadSlots::losses` once placed: while it is unchanged, those blocks still hold their
    /// tokens in those slots.
    losses: u64,
    /// The sequence's tokens then (a shorter sequence has fewer whole blocks).
    tokens: usize,
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
            hs.losses += 1;
        }
        Ok((hs.arena[s], fill))
    }

    /// Records that `b` of head `lh` now holds `len` tokens on the device.
    pub(crate) fn set_valid(&mut self, lh: usize, b: DeviceBlock, len: usize) {
        let hs = &mut self.heads[lh];
        if let Some(h) = hs.holds.get_mut(b.slot as usize) {
            if h.0 != b.block || (len as u32) < h.1 {
                hs.losses += 1;
            }
            *h = (b.block, len as u32);
        }
    }

    /// The arena slots of the leading blocks of `list` that head `lh` placed last time as
    /// whole blocks and still holds: each is what [`Self::slot_for`] would answer, with
    /// [`Fill::Keep`], for `block_size` tokens.
    pub(crate) fn placed_before(&self, lh: usize, list: &[DeviceBlock], tokens: usize) -> &[u32] {
        let hs = &self.heads[lh];
        let p = &hs.placed;
        if p.losses != hs.losses || tokens < p.tokens {
            return &[];
        }
        let same = p
            .blocks
            .iter()
            .zip(list)
            .take_while(|(a, b)| a == b)
            .count();
        &p.whole[..same]
    }

    /// Remembers `list` as head `lh`'s placement, once every block of it has been through
    /// [`Self::slot_for`] and [`Self::set_valid`] for a sequence of `tokens` tokens (its first
    /// `reused` blocks through [`Self::placed_before`]).
    pub(crate) fn placed(
        &mut self,
        lh: usize,
        list: &[DeviceBlock],
        reused: usize,
        tokens: usize,
        block_size: usize,
    ) {
        let hs = &mut self.heads[lh];
        let p = &mut hs.placed;
        p.blocks.truncate(reused);
        p.whole.truncate(reused);
        for &b in &list[reused..] {
            let s = b.slot as usize;
            let whole = (b.block + 1) * block_size <= tokens
                && hs.holds.get(s) == Some(&(b.block, block_size as u32));
            if !whole {
                break;
            }
            p.blocks.push(b);
            p.whole.push(hs.arena[s]);
        }
        p.losses = hs.losses;
        p.tokens = tokens;
    }

    /// Residency slots per head.
    pub(crate) fn cap(&self) -> usize {
        self.cap
    }

    /// `cap` residency slots per head from now on; returns the arena slots behind those at
    /// or past it, which the table no longer holds. A slot below it keeps its block: where
    /// the residency moved another block there, [`Self::slot_for`] sees the change.
    pub(crate) fn set_cap(&mut self, cap: usize) -> Vec<u32> {
        self.cap = cap;
        let mut freed = Vec::new();
        for hs in &mut self.heads {
            if hs.arena.len() > cap {
                freed.extend(hs.arena.drain(cap..));
                hs.holds.truncate(cap);
                hs.losses += 1;
            }
        }
        freed
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

    #[test]
    fn a_cap_lent_takes_more_slots_and_one_given_back_frees_those_past_it() {
        let mut free = arena(16);
        let mut t = SlotTable::new(2, 2);
        assert_eq!(
            t.slot_for(0, at(9, 5), 32, &mut || free.pop()),
            Err(NoSlot::PastCap { slot: 5, cap: 2 })
        );
        assert!(t.set_cap(8).is_empty());
        for (lh, block, slot) in [(0, 9, 5), (1, 3, 1)] {
            let (_, fill) = t
                .slot_for(lh, at(block, slot), 32, &mut || free.pop())
                .unwrap();
            assert_eq!(fill, Fill::Whole);
            t.set_valid(lh, at(block, slot), 32);
        }
        assert_eq!(free.len(), 16 - 6 - 2);
        let list = [at(0, 0), at(1, 1)];
        place(&mut t, 0, &list, 4 * 32, &mut free);
        let kept = t.slot_for(0, at(1, 1), 32, &mut || free.pop()).unwrap();
        assert_eq!(kept.1, Fill::Keep);
        // Back to two: head 0's slots 2..6 go back, head 1's two stay; what slots 0 and 1
        // held stays there, but nothing placed before is reused without the table.
        let mut freed = t.set_cap(2);
        freed.sort_unstable();
        assert_eq!(freed.len(), 4);
        free.extend(&freed);
        assert_eq!(free.len(), 16 - 4);
        let mut held: Vec<u32> = t.held().collect();
        held.sort_unstable();
        assert_eq!(held.len(), 4);
        assert!(held.iter().all(|h| !freed.contains(h)));
        assert!(t.placed_before(0, &list, 4 * 32).is_empty());
        assert_eq!(t.slot_for(0, at(1, 1), 32, &mut || free.pop()), Ok(kept));
        assert_eq!(
            t.slot_for(0, at(9, 2), 32, &mut || free.pop()),
            Err(NoSlot::PastCap { slot: 2, cap: 2 })
        );
    }

    /// What `CudaSeq::place` does with the table for one head: the reused blocks, then
    /// `slot_for` and `set_valid` for the rest. Returns each block's (arena slot, tokens, fill)
    /// and how many were reused.
    fn place(
        t: &mut SlotTable,
        lh: usize,
        list: &[DeviceBlock],
        tokens: usize,
        free: &mut Vec<u32>,
    ) -> (Vec<(u32, usize, Fill)>, usize) {
        const BS: usize = 32;
        let mut out: Vec<_> = t
            .placed_before(lh, list, tokens)
            .iter()
            .map(|&s| (s, BS, Fill::Keep))
            .collect();
        let reused = out.len();
        for &b in list[reused..].iter().filter(|b| b.block * BS < tokens) {
            let len = (tokens - b.block * BS).min(BS);
            let (slot, fill) = t.slot_for(lh, b, len, &mut || free.pop()).unwrap();
            if fill != Fill::Keep {
                t.set_valid(lh, b, len);
            }
            out.push((slot, len, fill));
        }
        t.placed(lh, list, reused, tokens, BS);
        (out, reused)
    }

    #[test]
    fn a_heads_whole_blocks_placed_before_skip_the_table_until_a_slot_changes_hands() {
        let mut free = arena(64);
        let mut t = SlotTable::new(2, 16);
        // Blocks 0..4 in slots 0..4; the sequence has 4 whole blocks and 5 tokens of a fifth.
        let list: Vec<_> = (0..5).map(|b| at(b, b as u32)).collect();
        let (first, reused) = place(&mut t, 0, &list, 4 * 32 + 5, &mut free);
        assert_eq!(reused, 0);
        assert!(first.iter().all(|e| e.2 == Fill::Whole));
        // A token later: the whole blocks come back as they were, the newest grows by a tail.
        let (second, reused) = place(&mut t, 0, &list, 4 * 32 + 6, &mut free);
        assert_eq!(reused, 4);
        assert_eq!(
            second[..4],
            first[..4]
                .iter()
                .map(|e| (e.0, 32, Fill::Keep))
                .collect::<Vec<_>>()[..]
        );
        assert_eq!(second[4], (first[4].0, 6, Fill::Tail { from: 5 }));
        // The other head's placements are its own.
        assert!(t.placed_before(1, &list, 4 * 32 + 6).is_empty());
        // A list that differs at its third block reuses the two before it.
        let mut other = list.clone();
        other[2] = at(9, 2);
        assert_eq!(t.placed_before(0, &other, 4 * 32 + 6).len(), 2);
        let (third, reused) = place(&mut t, 0, &other, 10 * 32, &mut free);
        assert_eq!(reused, 2);
        assert_eq!(third[2].2, Fill::Whole);
        // Placed as a whole now: the old list shares its first two blocks with it.
        assert_eq!(t.placed_before(0, &other, 10 * 32).len(), 5);
        assert_eq!(t.placed_before(0, &list, 10 * 32).len(), 2);
        // A shorter sequence than the one placed reuses nothing.
        assert!(t.placed_before(0, &other, 4 * 32).is_empty());
        // Once a slot holds fewer tokens, or is handed to another block, nothing is reused:
        // the table decides again.
        t.set_valid(0, other[3], 31);
        assert!(t.placed_before(0, &other, 10 * 32).is_empty());
        place(&mut t, 0, &other, 10 * 32, &mut free);
        assert_eq!(t.placed_before(0, &other, 10 * 32).len(), 5);
        t.slot_for(0, at(7, 4), 32, &mut || free.pop()).unwrap();
        assert!(t.placed_before(0, &other, 10 * 32).is_empty());
    }

    proptest::proptest! {
        /// Reuse answers exactly what the table would: random lists over random residency
        /// slots, growing and (rarely) shrinking sequences, on two heads.
        #[test]
        fn reused_blocks_are_what_the_table_would_answer(
            steps in proptest::collection::vec(
                (0usize..2, proptest::collection::vec((0usize..12, 0u32..6), 0..10), 0usize..3, proptest::bool::ANY),
                1..40,
            )
        ) {
            let mut free = arena(64);
            let mut t = SlotTable::new(2, 6);
            let mut tokens = 100usize;
            for (lh, raw, grow, shrink) in steps {
                tokens = if shrink && tokens > 40 { tokens - 40 } else { tokens + grow };
                // Residency gives a block one slot of a head at a time: no slot twice.
                let mut seen = std::collections::HashSet::new();
                let list: Vec<_> = raw
                    .into_iter()
                    .filter(|&(_, s)| seen.insert(s))
                    .map(|(b, s)| at(b, s))
                    .collect();
                let reused = t.placed_before(lh, &list, tokens).to_vec();
                let mut copy = t.clone();
                for (k, &slot) in reused.iter().enumerate() {
                    let answer = copy.slot_for(lh, list[k], 32, &mut || None);
                    proptest::prop_assert_eq!(answer, Ok((slot, Fill::Keep)));
                }
                place(&mut t, lh, &list, tokens, &mut free);
            }
        }
    }
}
