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
    /// By block of the sequence, the arena slot that holds it whole (`block_size` tokens) or
    /// [`NOT_WHOLE`]: what the device's block table of this head says (`place_picks` reads
    /// each pick's slot there, #21 item 4).
    whole: Vec<u32>,
    /// Blocks held whole.
    whole_count: usize,
    /// The range of `whole` changed since [`SlotTable::take_dirty`] last took it.
    dirty: Option<(usize, usize)>,
}

/// No arena slot holds the block whole (the kernels' `PLACE_NONE`).
pub(crate) const NOT_WHOLE: u32 = u32::MAX;

impl HeadSlots {
    /// Records that arena slot `arena` holds `block` whole, or (`NOT_WHOLE`) that none does.
    fn set_whole(&mut self, block: usize, arena: u32) {
        if self.whole.len() <= block {
            if arena == NOT_WHOLE {
                return;
            }
            self.whole.resize(block + 1, NOT_WHOLE);
        }
        let was = std::mem::replace(&mut self.whole[block], arena);
        if was == arena {
            return;
        }
        match (was == NOT_WHOLE, arena == NOT_WHOLE) {
            (true, false) => self.whole_count += 1,
            (false, true) => self.whole_count -= 1,
            _ => {}
        }
        self.dirty = Some(match self.dirty {
            Some((lo, hi)) => (lo.min(block), hi.max(block + 1)),
            None => (block, block + 1),
        });
    }

    /// Arena slot `arena` no longer holds `block` (handed to another block, or given back):
    /// it is not whole there, though it may be in the slot it moved to.
    fn lose(&mut self, block: usize, arena: u32) {
        if self.whole.get(block) == Some(&arena) {
            self.set_whole(block, NOT_WHOLE);
        }
    }
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
    /// Tokens of a whole block.
    block_size: usize,
}

impl SlotTable {
    /// A table for `heads` (layer, KV head) pairs with `cap` residency slots each, of blocks
    /// of `block_size` tokens.
    pub(crate) fn new(heads: usize, cap: usize, block_size: usize) -> Self {
        Self {
            heads: vec![HeadSlots::default(); heads],
            cap,
            block_size,
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
            let arena = hs.arena[s];
            hs.lose(block, arena);
        }
        Ok((hs.arena[s], fill))
    }

    /// Records that `b` of head `lh` now holds `len` tokens on the device.
    pub(crate) fn set_valid(&mut self, lh: usize, b: DeviceBlock, len: usize) {
        let bs = self.block_size;
        let hs = &mut self.heads[lh];
        let s = b.slot as usize;
        let (Some(h), Some(&arena)) = (hs.holds.get_mut(s), hs.arena.get(s)) else {
            return;
        };
        let was = h.0;
        if was != b.block || (len as u32) < h.1 {
            hs.losses += 1;
        }
        *h = (b.block, len as u32);
        if was != b.block {
            hs.lose(was, arena);
        }
        if len == bs {
            hs.set_whole(b.block, arena);
        } else {
            hs.lose(b.block, arena);
        }
    }

    /// True when head `lh` holds every block below `upto` whole, where the blocks of the
    /// sequence below `whole_blocks` are whole (its newest may be partial); each of those
    /// blocks' arena slots is then in the device's table ([`SlotTable::take_dirty`]).
    pub(crate) fn holds_whole_below(&self, lh: usize, upto: usize, whole_blocks: usize) -> bool {
        let hs = &self.heads[lh];
        let above = hs
            .whole
            .get(upto.min(whole_blocks)..)
            .map_or(0, |w| w.iter().filter(|&&a| a != NOT_WHOLE).count());
        upto <= whole_blocks && hs.whole_count.checked_sub(above) == Some(upto)
    }

    /// Head `lh`'s table entries that changed since it was last taken, and where they start
    /// (all of them after [`SlotTable::all_dirty`]), for the device's copy.
    pub(crate) fn take_dirty(&mut self, lh: usize) -> Option<(usize, &[u32])> {
        let hs = &mut self.heads[lh];
        let (lo, hi) = hs.dirty.take()?;
        let hi = hi.min(hs.whole.len());
        (lo < hi).then(|| (lo, &hs.whole[lo..hi]))
    }

    /// Every head's table as changed: the device's copy was made anew.
    pub(crate) fn all_dirty(&mut self) {
        for hs in &mut self.heads {
            hs.dirty = (!hs.whole.is_empty()).then_some((0, hs.whole.len()));
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
                let gone: Vec<(usize, u32)> = hs.holds[cap..]
                    .iter()
                    .zip(&hs.arena[cap..])
                    .map(|(h, &a)| (h.0, a))
                    .collect();
                for (block, arena) in gone {
                    hs.lose(block, arena);
                }
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
        let mut t = SlotTable::new(2, 4, 32);
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
        let mut t = SlotTable::new(1, 4, 32);
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
        let mut t = SlotTable::new(2, 2, 32);
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
        let mut t = SlotTable::new(2, 16, 32);
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
            let mut t = SlotTable::new(2, 6, 32);
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
                check_whole(&t)?;
            }
        }

        /// The block table the device keeps (`whole`) says of each block an arena slot that
        /// holds it whole, or that none does, through fills, tails, slots handed to other
        /// blocks, copies that failed (`slot_for` without `set_valid`), and caps lent and
        /// given back; the copy brought up to date from `take_dirty` equals it.
        #[test]
        fn the_block_table_names_a_slot_holding_each_block_whole(
            steps in proptest::collection::vec(
                (0usize..2, 0usize..14, 0u32..8, 1usize..=32, 0u8..10),
                1..80,
            )
        ) {
            let mut free = arena(64);
            let mut t = SlotTable::new(2, 8, 32);
            let mut copy: Vec<Vec<u32>> = vec![Vec::new(); 2];
            for (lh, block, slot, len, what) in steps {
                let b = at(block, slot);
                match what {
                    0 => {
                        let freed = t.set_cap(if t.cap() == 8 { 4 } else { 8 });
                        free.extend(freed);
                    }
                    1 => {
                        let _ = t.slot_for(lh, b, len, &mut || free.pop());
                    }
                    _ => {
                        if let Ok((arena, _)) = t.slot_for(lh, b, len, &mut || free.pop()) {
                            let len = if what < 6 { 32 } else { len };
                            t.set_valid(lh, b, len);
                            // A block filled whole is in the table at once, in its slot.
                            let entry = t.heads[lh].whole.get(block).copied();
                            proptest::prop_assert_eq!(entry == Some(arena), len == 32);
                        }
                    }
                }
                check_whole(&t)?;
                for (h, c) in copy.iter_mut().enumerate() {
                    if let Some((from, entries)) = t.take_dirty(h) {
                        if c.len() < from + entries.len() {
                            c.resize(from + entries.len(), NOT_WHOLE);
                        }
                        c[from..from + entries.len()].copy_from_slice(entries);
                    }
                    let mut want = t.heads[h].whole.clone();
                    want.resize(c.len().max(want.len()), NOT_WHOLE);
                    c.resize(want.len(), NOT_WHOLE);
                    proptest::prop_assert_eq!(&*c, &want);
                }
            }
        }
    }

    /// `whole` against the slots' own record: each block's entry is `NOT_WHOLE` or the arena
    /// slot of a residency slot holding it with every token (a slot the residency table
    /// moved it away from may still hold it: the entry may then say none, never a wrong
    /// slot); the count and `holds_whole_below` agree with the entries.
    fn check_whole(t: &SlotTable) -> Result<(), proptest::test_runner::TestCaseError> {
        for (lh, hs) in t.heads.iter().enumerate() {
            let holding = |b: usize| -> Vec<u32> {
                hs.holds
                    .iter()
                    .zip(&hs.arena)
                    .filter(|(h, _)| **h == (b, 32))
                    .map(|(_, &a)| a)
                    .collect()
            };
            for b in 0..16 {
                let entry = hs.whole.get(b).copied().unwrap_or(NOT_WHOLE);
                let held = holding(b);
                proptest::prop_assert!(
                    entry == NOT_WHOLE || held.contains(&entry),
                    "block {b}: {entry} of {held:?}"
                );
            }
            let whole: Vec<bool> = (0..16)
                .map(|b| hs.whole.get(b).is_some_and(|&a| a != NOT_WHOLE))
                .collect();
            proptest::prop_assert_eq!(hs.whole_count, whole.iter().filter(|w| **w).count());
            for upto in 0..16 {
                for whole_blocks in upto..16 {
                    proptest::prop_assert_eq!(
                        t.holds_whole_below(lh, upto, whole_blocks),
                        whole[..upto].iter().all(|w| *w),
                        "upto {} of {}",
                        upto,
                        whole_blocks
                    );
                }
            }
        }
        Ok(())
    }
}
