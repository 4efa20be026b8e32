//! The host side of one device attention call, apart from the driver: the slot list the
//! kernel walks, the split of the longest head's list across CUDA blocks, the one upload
//! that carries both with the query, and the partial results read back. Pure, so tested
//! without a GPU.

use attention::Partial;

/// CUDA blocks the split-K kernel aims for per call where the device's multiprocessors are
/// not known; `DECODE_NODE_ATTENTION_CTAS` sets another.
pub(super) const TARGET_CTAS: usize = 1024;

/// CUDA blocks an attention launch aims for on a device of `sms` multiprocessors: two per
/// multiprocessor. On an H200 (132), `bench kernels --device cuda` over every block of 8 KV
/// heads (G=5, D=128, bf16), a call took 28-29 us at 8k with 256 blocks against 36 with the
/// 512 that 1024 gave there (at least 4 blocks each), 115 against 119 us at 32k (1024), and
/// 199-204 against 194-199 us at 64k (1024): the short contexts gain, the long one is even.
pub(super) fn default_ctas(sms: Option<usize>) -> usize {
    sms.map_or(TARGET_CTAS, |n| (2 * n).clamp(2, 65535))
}

/// The kernels' flag that asks L2 for a lane's next batch of loads (kernels.cu's
/// `ATTEND_PREFETCH`).
pub(super) const ATTEND_PREFETCH: i32 = 1;
/// The attention kernels' flag that cuts each head's entries evenly over the splits (at least
/// the call's chunk a split; the kernels' `ATTEND_SPREAD`): set for a list `place_picks` lays
/// out, whose grid is sized for the longest a head may be.
pub(super) const ATTEND_SPREAD: i32 = 2;

/// The `flags` argument of a fast attention kernel (`attend_warps`, `attend_tc`) for calls of
/// `group` query heads per KV head, given the groups that prefetch (bit `g`).
pub(super) fn prefetch_flags(groups: u16, group: usize) -> i32 {
    if group < 16 && groups & (1 << group) != 0 {
        ATTEND_PREFETCH
    } else {
        0
    }
}

/// Most splits of one head `combine_splits` merges (its shared weights array).
pub(super) const MAX_SPLITS: usize = 1024;

/// The (slot, tokens) entries of one call, head after head.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct SlotList {
    /// Byte offset of each entry's slot in the arena.
    pub offs: Vec<i64>,
    /// Tokens valid in each entry's block.
    pub lens: Vec<i32>,
    /// Where each KV head's entries start (one more than the heads: the end).
    pub head_start: Vec<i32>,
    /// Sequences whose heads' entries `place_picks` lays out on the device before the
    /// attention reads them (#21 item 4), as `place_picks`' job words.
    pub picked: Vec<[i64; PLACE_WORDS]>,
    /// The most entries a head of a picked sequence may get (all of a shared cut's picks).
    pub longest_picked: usize,
}

/// Words of a `place_picks` job (the kernels' `PLACE_WORDS`).
pub(super) const PLACE_WORDS: usize = 12;
/// Most KV heads and fixed entries (sink and window, all heads) of a sequence `place_picks`
/// lays out (the kernels' `PLACE_MAX_HEADS`, `PLACE_MAX_FIXED`).
pub(super) const PLACE_MAX_HEADS: usize = 64;
pub(super) const PLACE_MAX_FIXED: usize = 1024;
/// Threads of a `place_picks` CUDA block (the kernels' `PLACE_THREADS`).
pub(super) const PLACE_THREADS: u32 = 256;

/// A sequence's heads laid out on the device by `place_picks` from its picks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Picked {
    /// Picks of each group of heads ranked together (`k`), and the heads of a group.
    pub k: usize,
    pub rows: usize,
    /// Blocks scored (a pick's place is `head in the group * blocks + block`).
    pub blocks: usize,
    /// The cut's range.
    pub from: usize,
    pub to: usize,
    /// Device addresses of the picks (`[heads / rows][k]` places) and of the layer's block
    /// table (`[heads][stride]` arena slots).
    pub picks: u64,
    pub table: u64,
    pub stride: usize,
}

impl SlotList {
    pub fn new() -> Self {
        Self {
            head_start: vec![0],
            ..Self::default()
        }
    }

    pub fn push(&mut self, offset: i64, len: usize) {
        self.offs.push(offset);
        self.lens.push(len as i32);
    }

    /// Appends whole blocks (`len` tokens each) in these arena slots of `slot_bytes` each.
    pub fn extend_whole(&mut self, slots: &[u32], slot_bytes: i64, len: usize) {
        self.offs
            .extend(slots.iter().map(|&s| i64::from(s) * slot_bytes));
        self.lens.resize(self.lens.len() + slots.len(), len as i32);
    }

    /// Closes the current head's entries.
    pub fn end_head(&mut self) {
        self.head_start.push(self.offs.len() as i32);
    }

    pub fn is_empty(&self) -> bool {
        self.offs.is_empty()
    }

    /// Appends `other`'s heads after these: one call then attends both (a batch's sequences,
    /// each KV head of each a head of the call).
    pub fn append(&mut self, other: &SlotList) {
        let at = self.offs.len() as i32;
        let heads = self.heads() as i64;
        self.offs.extend_from_slice(&other.offs);
        self.lens.extend_from_slice(&other.lens);
        self.head_start
            .extend(other.head_start.iter().skip(1).map(|s| s + at));
        self.picked.extend(other.picked.iter().map(|j| {
            let mut j = *j;
            j[0] += i64::from(at);
            j[1] += heads;
            j
        }));
        self.longest_picked = self.longest_picked.max(other.longest_picked);
    }

    /// The list of one sequence whose device lays out its heads from `p` (`place_picks`):
    /// `fixed`, every head's sink and window in head order (`fixed.heads()` heads of as many
    /// entries each), then a placeholder for each pick; each head's start is the kernel's
    /// to write, the end stays.
    pub fn picked(fixed: &SlotList, p: Picked) -> Option<Self> {
        let heads = fixed.heads();
        let each = fixed.head_start.get(1).copied().unwrap_or(0) as usize;
        let even = fixed
            .head_start
            .windows(2)
            .all(|w| (w[1] - w[0]) as usize == each);
        if heads == 0
            || heads > PLACE_MAX_HEADS
            || each == 0
            || !even
            || heads * each > PLACE_MAX_FIXED
            || p.rows == 0
            || !heads.is_multiple_of(p.rows)
            || p.k == 0
            || p.to > p.stride
        {
            return None;
        }
        let total = heads / p.rows * p.k;
        let mut list = fixed.clone();
        list.offs.resize(list.offs.len() + total, fixed.offs[0]);
        list.lens.resize(list.lens.len() + total, 0);
        // Provisional starts, none further apart than a head's most (`longest_picked`), so
        // that the launch's split is sized by the bound, not by them.
        let share = (each + total / heads) as i32;
        list.head_start = (0..heads as i32).map(|h| h * share).collect();
        list.head_start.push(list.offs.len() as i32);
        let words = |x: usize| i64::try_from(x).ok();
        list.picked.push([
            0,
            0,
            words(heads)?,
            words(each)?,
            words(p.k)?,
            words(p.rows)?,
            words(p.blocks)?,
            words(p.from)?,
            words(p.to)?,
            p.picks as i64,
            p.table as i64,
            words(p.stride)?,
        ]);
        list.longest_picked = each + p.k;
        Some(list)
    }

    /// KV heads in the list.
    pub fn heads(&self) -> usize {
        self.head_start.len() - 1
    }

    /// Entries of the head with the most (where `place_picks` lays a sequence out, the most
    /// it may give one).
    pub fn longest_head(&self) -> usize {
        self.head_start
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0)
            .max(self.longest_picked)
    }
}

/// How a head's list is cut across the kernel's grid: `splits` CUDA blocks per head, each
/// taking `chunk` entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SplitK {
    pub chunk: usize,
    pub splits: usize,
}

impl SplitK {
    /// About `target` blocks over `heads` heads, none of them empty.
    pub fn new(target: usize, heads: usize, longest: usize) -> Self {
        Self::at_least(target, heads, longest, 1)
    }

    /// As [`SplitK::new`], each CUDA block taking at least `min_chunk` entries where the list
    /// has them (a kernel whose warps walk blocks of their own leaves none idle), and no head
    /// cut in more than [`MAX_SPLITS`].
    pub fn at_least(target: usize, heads: usize, longest: usize, min_chunk: usize) -> Self {
        let longest = longest.max(1);
        let wanted = (target / heads.max(1)).clamp(1, longest.min(MAX_SPLITS));
        let chunk = longest.div_ceil(wanted).max(min_chunk.min(longest));
        Self {
            chunk,
            splits: longest.div_ceil(chunk),
        }
    }
}

/// The call's single upload and where each part of it starts (bytes).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Upload {
    pub bytes: Vec<u8>,
    pub at_lens: usize,
    pub at_heads: usize,
    /// 16-byte aligned, for the kernel's vector loads of the query.
    pub at_q: usize,
    /// `place_picks`' jobs, 8-byte aligned (none: the end).
    pub at_jobs: usize,
}

/// Offsets (i64), lengths (i32), head starts (i32), the query (f32), then `place_picks`' jobs
/// (i64), little-endian.
pub(super) fn pack(list: &SlotList, q: &[f32]) -> Upload {
    let total = list.offs.len();
    let at_lens = total * 8;
    let at_heads = at_lens + total * 4;
    let at_q = (at_heads + list.head_start.len() * 4).next_multiple_of(16);
    let at_jobs = (at_q + q.len() * 4).next_multiple_of(8);
    let mut bytes = Vec::with_capacity(at_jobs + list.picked.len() * PLACE_WORDS * 8);
    bytes.extend(list.offs.iter().flat_map(|o| o.to_le_bytes()));
    bytes.extend(list.lens.iter().flat_map(|l| l.to_le_bytes()));
    bytes.extend(list.head_start.iter().flat_map(|s| s.to_le_bytes()));
    bytes.resize(at_q, 0);
    bytes.extend(q.iter().flat_map(|x| x.to_le_bytes()));
    if !list.picked.is_empty() {
        bytes.resize(at_jobs, 0);
        bytes.extend(list.picked.iter().flatten().flat_map(|w| w.to_le_bytes()));
    }
    Upload {
        bytes,
        at_lens,
        at_heads,
        at_q,
        at_jobs,
    }
}

/// What `place_picks` makes of `list` (the definition `selftest` holds the device to): each
/// picked sequence's heads laid out as the sink, the head's picks in order and the window,
/// each pick in the arena slot its block table names (`slot_bytes` apart; a pick outside
/// the cut or without a slot is an empty entry over the head's sink), and the heads' starts.
/// `picks` and `table` read a job's picks (`[heads / rows][k]` places) and block table rows
/// (`[heads][stride]`) where the job's addresses point. The job list is left as it is.
pub(super) fn place_picks_host(
    list: &mut SlotList,
    picks: impl Fn(&[i64; PLACE_WORDS]) -> Vec<u32>,
    table: impl Fn(&[i64; PLACE_WORDS]) -> Vec<u32>,
    slot_bytes: i64,
    block_size: i32,
) {
    for job in list.picked.clone() {
        let w = |i: usize| job[i] as usize;
        let (start, h0, hk, each, k, rows) = (w(0), w(1), w(2), w(3), w(4), w(5));
        let (blocks, from, to, stride) = (w(6), w(7), w(8), w(11));
        let (picks, table) = (picks(&job), table(&job));
        let fixed: Vec<(i64, i32)> = (start..start + hk * each)
            .map(|i| (list.offs[i], list.lens[i]))
            .collect();
        let mut mine: Vec<Vec<(i64, i32)>> = vec![Vec::new(); hk];
        for (i, &place) in picks.iter().enumerate() {
            let within = (place as usize / blocks).min(rows - 1);
            let h = ((i / k) * rows + within).min(hk - 1);
            let b = place as usize % blocks;
            let slot = if (from..to).contains(&b) {
                table[h * stride + b]
            } else {
                super::slots::NOT_WHOLE
            };
            mine[h].push(if slot == super::slots::NOT_WHOLE {
                (fixed[h * each].0, 0)
            } else {
                (i64::from(slot) * slot_bytes, block_size)
            });
        }
        let mut at = start;
        for (h, picked) in mine.iter().enumerate() {
            list.head_start[h0 + h] = at as i32;
            let head = std::iter::once(fixed[h * each])
                .chain(picked.iter().copied())
                .chain(fixed[h * each + 1..(h + 1) * each].iter().copied());
            for (o, l) in head {
                list.offs[at] = o;
                list.lens[at] = l;
                at += 1;
            }
        }
    }
}

/// The combine kernel's output, `[heads][group][d]` outputs then `[heads][group]` base-2
/// log-sum-exps, as one partial per KV head.
pub(super) fn partials(host: &[f32], heads: usize, group: usize, d: usize) -> Vec<Partial> {
    let (outs, lses) = host.split_at(heads * group * d);
    (0..heads)
        .map(|h| Partial {
            out: outs[h * group * d..(h + 1) * group * d].to_vec(),
            lse2: lses[h * group..(h + 1) * group].to_vec(),
            num_heads: group,
            head_dim: d,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_upload_holds_each_part_where_the_kernel_reads_it() {
        let mut list = SlotList::new();
        list.push(4096, 32);
        list.push(0, 7);
        list.end_head();
        list.end_head(); // a head with nothing resident
        list.push(8192, 1);
        list.end_head();
        assert_eq!(list.longest_head(), 2);
        let q = [1.5f32, -2.0, 0.25];
        let u = pack(&list, &q);
        let i64_at = |i: usize| i64::from_le_bytes(u.bytes[i..i + 8].try_into().unwrap());
        let i32_at = |i: usize| i32::from_le_bytes(u.bytes[i..i + 4].try_into().unwrap());
        assert_eq!([i64_at(0), i64_at(8), i64_at(16)], [4096, 0, 8192]);
        assert_eq!(u.at_lens, 24);
        assert_eq!(
            [i32_at(24), i32_at(28), i32_at(32)],
            [32, 7, 1],
            "lengths follow the offsets"
        );
        assert_eq!(u.at_heads, 36);
        let starts: Vec<i32> = (0..4).map(|h| i32_at(36 + 4 * h)).collect();
        assert_eq!(starts, [0, 2, 2, 3]);
        assert_eq!(u.at_q % 16, 0);
        assert!(u.at_q >= 52);
        let qs: Vec<f32> = u.bytes[u.at_q..]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(qs, q);
    }

    #[test]
    fn a_picked_sequence_is_laid_out_on_the_device_as_the_host_plan_lists_it() {
        // A head before, then 2 KV heads whose fixed entries are the sink and one window
        // block; 3 picks each (own cut), then the same heads sharing 5 picks.
        let mut before = SlotList::new();
        before.push(9 * 100, 32);
        before.end_head();
        let mut fixed = SlotList::new();
        for h in 0..2i64 {
            fixed.push(h * 100, 32); // sink
            fixed.push((h + 50) * 100, 7); // the newest block, partial
            fixed.end_head();
        }
        // Block b of head h in arena slot 10 * h + b; block 4 held by none.
        let stride = 12;
        let table: Vec<u32> = (0..2 * stride as u32)
            .map(|i| {
                if i % 12 == 4 {
                    u32::MAX
                } else {
                    10 * (i / 12) + i % 12
                }
            })
            .collect();
        let own = Picked {
            k: 3,
            rows: 1,
            blocks: 10,
            from: 1,
            to: 9,
            picks: 0xaaa,
            table: 0xbbb,
            stride,
        };
        let shared = Picked {
            k: 5,
            rows: 2,
            picks: 0xccc,
            ..own
        };
        let mut all = SlotList::new();
        all.append(&before);
        all.append(&SlotList::picked(&fixed, own).unwrap());
        all.append(&SlotList::picked(&fixed, shared).unwrap());
        assert_eq!(all.heads(), 5);
        assert_eq!(all.offs.len(), 1 + (4 + 6) + (4 + 5));
        assert_eq!(
            all.longest_head(),
            2 + 5,
            "a head may take every shared pick"
        );
        assert_eq!(all.picked.len(), 2);
        assert_eq!((all.picked[0][0], all.picked[0][1]), (1, 1));
        assert_eq!((all.picked[1][0], all.picked[1][1]), (11, 3));
        // Each head's start past the fixed ones is the kernel's; the sequences' ends stay.
        assert_eq!(all.head_start[3], 11);
        assert_eq!(all.head_start[5], 20);
        let u = pack(&all, &[]);
        let words: Vec<i64> = u.bytes[u.at_jobs..]
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(words, all.picked.concat());
        // Own: head 0 picks 2, 5, 8; head 1 picks 1, 4 (no slot), 7. Shared: places of
        // head 0's 3 and head 1's 1, 2, 6, 8.
        let picks = |job: &[i64; PLACE_WORDS]| match job[9] {
            0xaaa => vec![2, 5, 8, 1, 4, 7],
            _ => vec![3, 11, 12, 16, 18],
        };
        let mut laid = all.clone();
        place_picks_host(&mut laid, picks, |_| table.clone(), 100, 32);
        assert_eq!(laid.head_start, [0, 1, 6, 11, 14, 20]);
        assert_eq!(&laid.offs[..1], [900]);
        assert_eq!(laid.offs[1..6], [0, 200, 500, 800, 5000]);
        assert_eq!(laid.lens[1..6], [32, 32, 32, 32, 7]);
        // Head 1's block 4 has no slot: an empty entry over its sink.
        assert_eq!(laid.offs[6..11], [100, 1100, 100, 1700, 5100]);
        assert_eq!(laid.lens[6..11], [32, 32, 0, 32, 7]);
        assert_eq!(
            laid.offs[11..20],
            [0, 300, 5000, 100, 1100, 1200, 1600, 1800, 5100]
        );
        assert_eq!(laid.lens[11..20], [32, 32, 7, 32, 32, 32, 32, 32, 7]);
        // What place_picks cannot take.
        let none = |p: Picked| SlotList::picked(&fixed, p).is_none();
        assert!(none(Picked { k: 0, ..own }));
        assert!(none(Picked { rows: 3, ..own }));
        assert!(none(Picked { stride: 8, ..own }));
        assert!(SlotList::picked(&SlotList::new(), own).is_none());
    }

    #[test]
    fn appended_lists_keep_each_head_its_own_entries() {
        let mut a = SlotList::new();
        a.push(0, 32);
        a.push(64, 5);
        a.end_head();
        a.end_head(); // nothing resident
        let mut b = SlotList::new();
        b.push(128, 32);
        b.end_head();
        b.push(256, 3);
        b.push(512, 1);
        b.end_head();
        let mut all = SlotList::new();
        all.append(&a);
        all.append(&SlotList::new()); // a sequence of no heads changes nothing
        all.append(&b);
        assert_eq!(all.heads(), 4);
        assert_eq!(all.head_start, [0, 2, 2, 3, 5]);
        assert_eq!(all.offs, [0, 64, 128, 256, 512]);
        assert_eq!(all.lens, [32, 5, 32, 3, 1]);
        assert_eq!(all.longest_head(), 2);
    }

    #[test]
    fn whole_blocks_extend_a_list_as_their_pushes_would() {
        let (mut a, mut b) = (SlotList::new(), SlotList::new());
        for l in [&mut a, &mut b] {
            l.push(8192, 7);
        }
        a.extend_whole(&[3, 0, u32::MAX], 8192, 32);
        for s in [3u32, 0, u32::MAX] {
            b.push(i64::from(s) * 8192, 32);
        }
        a.end_head();
        b.end_head();
        assert_eq!(a, b);
    }

    #[test]
    fn the_split_covers_the_longest_list_with_no_empty_block() {
        for heads in [1, 3, 8, 40] {
            for longest in [1, 2, 31, 128, 1000, 5000] {
                let s = SplitK::new(TARGET_CTAS, heads, longest);
                assert!(s.chunk * s.splits >= longest, "{heads} {longest} {s:?}");
                assert!(
                    s.chunk * (s.splits - 1) < longest,
                    "{heads} {longest} {s:?}"
                );
                assert!(
                    s.splits * heads <= TARGET_CTAS.max(heads),
                    "{heads} {longest}"
                );
            }
        }
        for longest in [1, 3, 4, 9, 256, 2048] {
            let s = SplitK::at_least(TARGET_CTAS, 8, longest, 4);
            assert!(s.chunk >= 4.min(longest), "{longest} {s:?}");
            assert!(s.chunk * s.splits >= longest && s.chunk * (s.splits - 1) < longest);
        }
        for target in [1, 264, 4096, 1 << 20] {
            for longest in [1, 700, 5000, 100_000] {
                let s = SplitK::new(target, 1, longest);
                assert!(s.splits <= MAX_SPLITS, "{target} {longest} {s:?}");
                assert!(s.chunk * s.splits >= longest, "{target} {longest} {s:?}");
            }
        }
        assert_eq!(
            SplitK::new(TARGET_CTAS, 8, 0),
            SplitK {
                chunk: 1,
                splits: 1
            }
        );
    }

    #[test]
    fn the_default_target_is_two_blocks_per_multiprocessor() {
        assert_eq!(default_ctas(Some(132)), 264);
        assert_eq!(
            default_ctas(Some(0)),
            2,
            "a device that says 0 still gets a grid"
        );
        assert_eq!(default_ctas(None), TARGET_CTAS);
        // Two per multiprocessor over Qwen3-14B's 8 KV heads at 64k (2048 blocks each).
        let s = SplitK::at_least(default_ctas(Some(132)), 8, 2048, 4);
        assert_eq!((s.splits, s.chunk), (33, 63));
    }

    #[test]
    fn only_the_groups_whose_bit_is_set_prefetch() {
        let groups = (1 << 5) | (1 << 8);
        assert_eq!(prefetch_flags(groups, 5), ATTEND_PREFETCH);
        assert_eq!(prefetch_flags(groups, 8), ATTEND_PREFETCH);
        assert_eq!(prefetch_flags(groups, 4), 0);
        assert_eq!(prefetch_flags(u16::MAX, 16), 0, "no bit past the mask");
        assert_eq!(prefetch_flags(u16::MAX, 1), ATTEND_PREFETCH);
        assert_eq!(prefetch_flags(0, 5), 0);
    }

    #[test]
    fn partials_are_cut_per_kv_head() {
        let (heads, group, d) = (2, 3, 4);
        let host: Vec<f32> = (0..heads * group * (d + 1)).map(|i| i as f32).collect();
        let p = partials(&host, heads, group, d);
        assert_eq!(p.len(), 2);
        assert_eq!(p[1].out[0], (group * d) as f32);
        assert_eq!(p[1].lse2, [27.0, 28.0, 29.0]);
        assert_eq!((p[0].num_heads, p[0].head_dim), (group, d));
    }
}
