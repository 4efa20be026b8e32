//! A byte string held as the buffers it arrived in.
//!
//! A pushed chunk's key and value arrive split across HTTP/2 DATA frames. Joining them into
//! one buffer would copy every byte of KV once more before it reaches the pool; a [`Payload`]
//! keeps the frames (reference-counted [`Bytes`]) and hands out ranges, borrowed where they
//! lie in one frame and gathered only where they straddle two.

use std::ops::Range;

use bytes::Bytes;

/// A byte string made of one or more [`Bytes`] parts, in order.
#[derive(Debug, Clone, Default)]
pub struct Payload {
    parts: Vec<Bytes>,
    /// `ends[i]`: offset just past `parts[i]`.
    ends: Vec<usize>,
}

impl Payload {
    /// An empty payload.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `b` (no copy; empty parts are skipped).
    pub fn push(&mut self, b: Bytes) {
        if b.is_empty() {
            return;
        }
        self.ends.push(self.len() + b.len());
        self.parts.push(b);
    }

    /// Bytes held.
    pub fn len(&self) -> usize {
        self.ends.last().copied().unwrap_or(0)
    }

    /// Offset of `parts[i]`.
    fn start(&self, i: usize) -> usize {
        if i == 0 { 0 } else { self.ends[i - 1] }
    }

    /// Whether no bytes are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The parts, in order.
    pub fn parts(&self) -> &[Bytes] {
        &self.parts
    }

    /// `range` as one slice: borrowed when it lies in one part, else gathered into `scratch`.
    ///
    /// # Panics
    /// If `range` is not within `0..self.len()`; callers check lengths first.
    pub fn slice<'a>(&'a self, range: Range<usize>, scratch: &'a mut Vec<u8>) -> &'a [u8] {
        assert!(
            range.start <= range.end && range.end <= self.len(),
            "range {range:?} outside a payload of {} bytes",
            self.len()
        );
        if range.is_empty() {
            return &[];
        }
        // The part holding `range.start`: the first one ending after it.
        let i = self.ends.partition_point(|&e| e <= range.start);
        let off = range.start - self.start(i);
        if range.end <= self.ends[i] {
            return &self.parts[i][off..off + range.len()];
        }
        scratch.clear();
        let mut at = range.start;
        for (j, p) in self.parts.iter().enumerate().skip(i) {
            let s = self.start(j);
            let take = (range.end - at).min(s + p.len() - at);
            scratch.extend_from_slice(&p[at - s..at - s + take]);
            at += take;
            if at == range.end {
                break;
            }
        }
        scratch
    }

    /// Asks the CPU to bring the cache lines of `range` (clamped to the payload) towards its
    /// caches ahead of their use: a hint, which does nothing where the target has none.
    pub fn prefetch(&self, range: Range<usize>) {
        let end = range.end.min(self.len());
        let mut at = range.start;
        while at < end {
            let i = self.ends.partition_point(|&e| e <= at);
            let s = self.start(i);
            let part = &self.parts[i][at - s..(end - s).min(self.parts[i].len())];
            for line in part.chunks(64) {
                prefetch_line(line);
            }
            at += part.len();
        }
    }

    /// The whole payload as one buffer: shared when it is one part, copied otherwise.
    pub fn to_bytes(&self) -> Bytes {
        match self.parts.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            many => {
                let mut v = Vec::with_capacity(self.len());
                for p in many {
                    v.extend_from_slice(p);
                }
                Bytes::from(v)
            }
        }
    }
}

/// Equal bytes, however they are split.
impl PartialEq for Payload {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.to_bytes() == other.to_bytes()
    }
}

impl Eq for Payload {}

impl From<Bytes> for Payload {
    fn from(b: Bytes) -> Self {
        let mut p = Payload::new();
        p.push(b);
        p
    }
}

impl From<Vec<Bytes>> for Payload {
    fn from(parts: Vec<Bytes>) -> Self {
        let mut p = Payload::new();
        for b in parts {
            p.push(b);
        }
        p
    }
}

/// Hints that the cache line holding `line`'s first byte will be read soon (into L2 and up).
#[inline(always)]
fn prefetch_line(line: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        // SAFETY: a prefetch reads nothing architecturally and never faults; the address is
        // one of `line`'s.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = line;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x9A71),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]
        #[test]
        fn any_range_of_any_split_reads_the_original_bytes(
            data in proptest::collection::vec(any::<u8>(), 0..300),
            cuts in proptest::collection::vec(0usize..300, 0..8),
            a in 0usize..300,
            b in 0usize..300,
        ) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(data.len())).collect();
            cuts.push(0);
            cuts.push(data.len());
            cuts.sort_unstable();
            let whole = Bytes::from(data.clone());
            let p = Payload::from(
                cuts.windows(2).map(|w| whole.slice(w[0]..w[1])).collect::<Vec<_>>(),
            );
            prop_assert_eq!(p.len(), data.len());
            prop_assert_eq!(p.to_bytes(), whole.clone());
            let (lo, hi) = (a.min(b).min(data.len()), a.max(b).min(data.len()));
            let mut scratch = Vec::new();
            prop_assert_eq!(p.slice(lo..hi, &mut scratch), &data[lo..hi]);
        }
    }

    #[test]
    fn a_range_inside_one_part_is_borrowed() {
        let p = Payload::from(vec![
            Bytes::from_static(b"abcd"),
            Bytes::from_static(b"efgh"),
        ]);
        let mut scratch = Vec::new();
        assert_eq!(p.slice(4..7, &mut scratch), b"efg");
        assert!(scratch.is_empty());
        assert_eq!(p.slice(2..6, &mut scratch), b"cdef");
        assert_eq!(scratch, b"cdef");
    }

    /// A hint over any range: within one part, across parts, past the end, empty.
    #[test]
    fn prefetch_takes_any_range() {
        let mut p = Payload::new();
        for n in [3usize, 64, 1, 130] {
            p.push(Bytes::from(vec![7u8; n]));
        }
        for a in 0..=p.len() + 2 {
            for b in a..=p.len() + 70 {
                p.prefetch(a..b);
            }
        }
        Payload::new().prefetch(0..10);
    }
}
