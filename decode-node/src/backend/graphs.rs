//! CUDA graphs per batch-size bucket (#21 item 6), the host's half: which batch sizes get a
//! graph, and whether a piece of a step is replayed, captured or queued as it is.
//!
//! A step launches a dozen kernels a layer; at batch 1 the launches, not the device, set the
//! pace. A graph replays a piece's launches with one call. A piece qualifies only when
//! everything it reads and writes sits at device addresses fixed before it is queued and
//! nothing in it waits on the host: a resident layer's first half (norm, q|k|v, q/k-norm and
//! RoPE) and its second half (o, norm, gate|up, SiLU, down) are such pieces once their norm
//! weights, biases and the step's rotations live on the device. The attention between the
//! halves stays outside (its lists change with residency), as vLLM's piecewise graphs leave
//! attention out.
//!
//! A graph is keyed by everything its launches were built from ([`GraphKey`]: the piece, the
//! layer, the rows and every address and scalar), so a key that matches replays exactly
//! what queuing the piece would queue. Both halves run padded to the batch's bucket: the
//! residual's rows past the batch hold zeros, which the second half keeps at zero (no row
//! reads another); the first half's q, K and V of those rows are computed and never read.
//! The device side is `cuda::graph`.

use std::collections::HashMap;

/// Batch sizes that get a graph: 1, 2, 4, then every multiple of 8 up to the largest.
/// A batch runs padded to the smallest bucket that holds it; past the largest, no graph.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Buckets {
    sizes: Vec<usize>,
}

impl Buckets {
    /// Buckets up to `largest` rows (a multiple of 8 past 4; at least 1).
    pub fn up_to(largest: usize) -> Self {
        let mut sizes: Vec<usize> = [1, 2, 4].into_iter().filter(|&s| s <= largest).collect();
        sizes.extend((8..=largest).step_by(8));
        if sizes.is_empty() {
            sizes.push(1);
        }
        Self { sizes }
    }

    /// The rows a batch of `n` runs padded to: the smallest bucket of at least `n`; `None`
    /// for an empty batch or one past the largest bucket.
    pub fn rows(&self, n: usize) -> Option<usize> {
        if n == 0 {
            return None;
        }
        let i = self.sizes.partition_point(|&s| s < n);
        self.sizes.get(i).copied()
    }

    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }
}

impl Default for Buckets {
    /// Up to 256 rows, past any batch a decode node runs today.
    fn default() -> Self {
        Self::up_to(256)
    }
}

/// A piece of a step that can run as a graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Piece {
    /// A resident layer's first half: norm, q|k|v (and the next layer's predicted q)
    /// projections, `qkv_finish`.
    FirstHalf,
    /// A resident layer's second half: o projection into the residual, norm, gate|up,
    /// SiLU-mul, down projection into the residual.
    SecondHalf,
}

/// What a piece's launches are built from: the same key queues the same launches.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub piece: Piece,
    pub layer: usize,
    /// Rows the piece runs over (the bucket).
    pub rows: usize,
    /// Every device address, shape and scalar (as bits) its launches take.
    pub args: Vec<u64>,
}

/// What to do with a piece this time.
#[derive(Debug)]
pub enum Action<G> {
    /// Launch the graph captured for this key.
    Replay(G),
    /// Queue the piece inside a capture, keep the graph ([`GraphCache::captured`]) and launch it.
    Capture,
    /// Queue the piece as it is.
    Queue,
}

/// Captures that may fail before graphs are turned off for the process: a device that
/// refuses a capture once will refuse the next ones, and each try costs a step its time.
pub const MAX_FAILURES: u32 = 3;

#[derive(Debug)]
enum Entry<G> {
    /// Queued once as it is: the first run sizes every buffer and times every GEMM shape,
    /// neither of which may happen inside a capture. Captured at the next sighting.
    Seen,
    Graph {
        graph: G,
        used: u64,
    },
    /// Its capture failed: always queued as it is.
    Refused,
}

/// Counts of what the cache decided, for logs and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GraphStats {
    pub replays: u64,
    pub captures: u64,
    pub queued: u64,
    pub evicted: u64,
    pub failures: u32,
}

/// The graphs of one device, by key, at most `capacity` of them (the least recently replayed
/// dropped first), and whether graphs are on at all.
#[derive(Debug)]
pub struct GraphCache<G> {
    entries: HashMap<GraphKey, Entry<G>>,
    capacity: usize,
    graphs: usize,
    clock: u64,
    off: Option<String>,
    stats: GraphStats,
}

impl<G: Clone> GraphCache<G> {
    /// On, keeping at most `capacity` graphs.
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: HashMap::new(),
            capacity: capacity.max(1),
            graphs: 0,
            clock: 0,
            off: None,
            stats: GraphStats::default(),
        }
    }

    /// Off from the start, for `why`.
    pub fn off(why: impl Into<String>) -> Self {
        let mut c = Self::new(1);
        c.off = Some(why.into());
        c
    }

    /// Why graphs are off; `None` while they are on.
    pub fn why_off(&self) -> Option<&str> {
        self.off.as_deref()
    }

    pub fn stats(&self) -> GraphStats {
        self.stats
    }

    /// Graphs held now.
    pub fn len(&self) -> usize {
        self.graphs
    }

    pub fn is_empty(&self) -> bool {
        self.graphs == 0
    }

    /// What to do with the piece of `key` now.
    pub fn action(&mut self, key: &GraphKey) -> Action<G> {
        if self.off.is_some() {
            self.stats.queued += 1;
            return Action::Queue;
        }
        self.clock += 1;
        let clock = self.clock;
        let action = match self.entries.get_mut(key) {
            None => {
                // Keys that are never seen again (a batch that passed through) must not
                // pile up: forget the sightings once they outnumber the graphs' room.
                if self.entries.len() >= 4 * self.capacity {
                    self.entries.retain(|_, e| !matches!(e, Entry::Seen));
                }
                self.entries.insert(key.clone(), Entry::Seen);
                Action::Queue
            }
            Some(Entry::Seen) => Action::Capture,
            Some(Entry::Graph { graph, used }) => {
                *used = clock;
                Action::Replay(graph.clone())
            }
            Some(Entry::Refused) => Action::Queue,
        };
        match action {
            Action::Replay(_) => self.stats.replays += 1,
            Action::Queue => self.stats.queued += 1,
            Action::Capture => {}
        }
        action
    }

    /// Keeps `graph`, captured for `key`; drops the least recently used graph past capacity.
    pub fn captured(&mut self, key: GraphKey, graph: G) {
        self.stats.captures += 1;
        let old = self.entries.insert(
            key,
            Entry::Graph {
                graph,
                used: self.clock,
            },
        );
        if !matches!(old, Some(Entry::Graph { .. })) {
            self.graphs += 1;
        }
        while self.graphs > self.capacity {
            let Some(oldest) = self
                .entries
                .iter()
                .filter_map(|(k, e)| match e {
                    Entry::Graph { used, .. } => Some((*used, k)),
                    _ => None,
                })
                .min_by_key(|&(used, _)| used)
                .map(|(_, k)| k.clone())
            else {
                break;
            };
            self.entries.remove(&oldest);
            self.graphs -= 1;
            self.stats.evicted += 1;
        }
    }

    /// The capture of `key` failed (`why`): the piece is queued as it is from now on, and
    /// after [`MAX_FAILURES`] failures graphs are off.
    pub fn capture_failed(&mut self, key: GraphKey, why: &str) {
        self.stats.failures += 1;
        if let Some(Entry::Graph { .. }) = self.entries.insert(key, Entry::Refused) {
            self.graphs -= 1;
        }
        if self.stats.failures >= MAX_FAILURES {
            self.turn_off(format!("{MAX_FAILURES} captures failed, the last: {why}"));
        }
    }

    /// Graphs off for the rest of the process (a replay failed, or the start-up check found
    /// a replay disagreeing): every graph is dropped.
    pub fn turn_off(&mut self, why: impl Into<String>) {
        self.entries.clear();
        self.graphs = 0;
        self.off = Some(why.into());
    }

    /// Drops every graph and sighting (the buffers they name are about to be freed).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.graphs = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(layer: usize, rows: usize, addr: u64) -> GraphKey {
        GraphKey {
            piece: Piece::SecondHalf,
            layer,
            rows,
            args: vec![addr, 4096],
        }
    }

    #[test]
    fn a_batch_runs_in_the_smallest_bucket_that_holds_it() {
        let b = Buckets::up_to(32);
        assert_eq!(b.sizes(), [1, 2, 4, 8, 16, 24, 32]);
        let rows: Vec<Option<usize>> = [0, 1, 2, 3, 4, 5, 8, 9, 17, 24, 25, 32, 33]
            .iter()
            .map(|&n| b.rows(n))
            .collect();
        assert_eq!(
            rows,
            [
                None,
                Some(1),
                Some(2),
                Some(4),
                Some(4),
                Some(8),
                Some(8),
                Some(16),
                Some(24),
                Some(24),
                Some(32),
                Some(32),
                None
            ]
        );
        assert_eq!(Buckets::up_to(3).sizes(), [1, 2]);
        assert_eq!(Buckets::up_to(0).sizes(), [1]);
        assert_eq!(Buckets::up_to(12).sizes(), [1, 2, 4, 8]);
        assert_eq!(Buckets::default().rows(256), Some(256));
        assert_eq!(Buckets::default().rows(257), None);
        // Every bucket holds itself, and every batch up to the largest has one.
        let b = Buckets::default();
        for n in 1..=256 {
            let r = b.rows(n).unwrap();
            assert!(r >= n && b.sizes().contains(&r));
            assert!(r < 2 * n || n <= 4 || r - n < 8, "{n} padded to {r}");
        }
    }

    #[test]
    fn a_piece_is_queued_then_captured_then_replayed() {
        let mut c: GraphCache<u32> = GraphCache::new(8);
        let k = key(0, 4, 0x1000);
        assert!(matches!(c.action(&k), Action::Queue));
        assert!(matches!(c.action(&k), Action::Capture));
        c.captured(k.clone(), 7);
        assert!(matches!(c.action(&k), Action::Replay(7)));
        assert!(matches!(c.action(&k), Action::Replay(7)));
        // Another address (a buffer that grew) is another piece: queued first.
        assert!(matches!(c.action(&key(0, 4, 0x2000)), Action::Queue));
        let s = c.stats();
        assert_eq!((s.replays, s.captures, s.queued), (2, 1, 2));
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn past_capacity_the_least_recently_replayed_graph_goes() {
        let mut c: GraphCache<usize> = GraphCache::new(2);
        for layer in 0..3 {
            let k = key(layer, 1, 0x10);
            c.action(&k);
            assert!(matches!(c.action(&k), Action::Capture));
            c.captured(k, layer);
            if layer == 1 {
                // Layer 0 replayed after layer 1 was captured: layer 1 is the oldest now.
                assert!(matches!(c.action(&key(0, 1, 0x10)), Action::Replay(0)));
            }
        }
        assert_eq!(c.len(), 2);
        assert_eq!(c.stats().evicted, 1);
        assert!(matches!(c.action(&key(0, 1, 0x10)), Action::Replay(0)));
        assert!(matches!(c.action(&key(2, 1, 0x10)), Action::Replay(2)));
        // Evicted: seen again from the start.
        assert!(matches!(c.action(&key(1, 1, 0x10)), Action::Queue));
    }

    #[test]
    fn sightings_never_seen_again_do_not_pile_up() {
        let mut c: GraphCache<u8> = GraphCache::new(2);
        let kept = key(0, 1, 0);
        c.action(&kept);
        c.action(&kept);
        c.captured(kept.clone(), 1);
        for a in 1..1000 {
            c.action(&key(0, 1, a));
        }
        assert!(c.entries.len() <= 4 * 2 + 1, "{} entries", c.entries.len());
        assert!(matches!(c.action(&kept), Action::Replay(1)));
    }

    #[test]
    fn a_refused_capture_queues_and_repeated_refusals_turn_graphs_off() {
        let mut c: GraphCache<u8> = GraphCache::new(8);
        for layer in 0..MAX_FAILURES as usize {
            let k = key(layer, 2, 0x40);
            c.action(&k);
            assert!(matches!(c.action(&k), Action::Capture));
            c.capture_failed(k.clone(), "not permitted while capturing");
            if layer + 1 < MAX_FAILURES as usize {
                assert!(matches!(c.action(&k), Action::Queue));
                assert!(c.why_off().is_none());
            }
        }
        let why = c.why_off().expect("off after the failures");
        assert!(why.contains("not permitted"), "{why}");
        let k = key(9, 2, 0x40);
        for _ in 0..3 {
            assert!(matches!(c.action(&k), Action::Queue));
        }
        assert_eq!(c.len(), 0);
    }

    /// What padding a second half to its bucket rests on, with the host's ops: zero rows
    /// (residual and attention output) stay exactly zero, and the batch's rows come out as
    /// they do without the padding (no row reads another).
    #[test]
    fn padding_rows_stay_zero_and_leave_the_batch_as_it_is() {
        use crate::backend::{CpuBackend, LayerOut, finish_layer_unfused};
        use crate::model::random::SplitMix;
        use crate::tensor::Tensor;
        let (n, rows, hidden, attn_w, inter) = (3, 8, 64, 48, 96);
        let mut r = SplitMix(5);
        let mut random = |len: usize, amp: f32| -> Vec<f32> {
            (0..len)
                .map(|_| ((r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * amp)
                .collect()
        };
        let tensor = |v: Vec<f32>, rows: usize, cols: usize| Tensor::from_f32(vec![rows, cols], &v);
        let o = tensor(random(hidden * attn_w, 0.2), hidden, attn_w);
        let gate = tensor(random(inter * hidden, 0.2), inter, hidden);
        let up = tensor(random(inter * hidden, 0.2), inter, hidden);
        let down = tensor(random(hidden * inter, 0.2), hidden, inter);
        let norm = random(hidden, 2.0);
        let w = LayerOut {
            o: &o,
            post_norm: &norm,
            eps: 1e-6,
            gate: &gate,
            up: &up,
            down: &down,
        };
        let (x, attn) = (random(n * hidden, 2.0), random(n * attn_w, 2.0));
        let mut alone = x.clone();
        finish_layer_unfused(&CpuBackend, &mut alone, &attn, n, w).unwrap();
        let mut padded = x.clone();
        padded.resize(rows * hidden, 0.0);
        let mut attn_padded = attn.clone();
        attn_padded.resize(rows * attn_w, 0.0);
        // Three layers: the padding must stay zero for the next one as well.
        for _ in 0..3 {
            finish_layer_unfused(&CpuBackend, &mut padded, &attn_padded, rows, w).unwrap();
            assert!(padded[n * hidden..].iter().all(|&v| v == 0.0));
        }
        let mut batch = x;
        for _ in 0..3 {
            finish_layer_unfused(&CpuBackend, &mut batch, &attn, n, w).unwrap();
        }
        // The same sums, though a projection's kernel may block rows otherwise at 8 than at 3.
        let d = crate::backend::rel_diff(&padded[..n * hidden], &batch);
        assert!(d <= 1e-6, "{d}");
        assert_ne!(alone, batch, "the layers did something");
    }

    #[test]
    fn turned_off_drops_every_graph() {
        let mut c: GraphCache<u8> = GraphCache::new(8);
        let k = key(0, 1, 1);
        c.action(&k);
        c.action(&k);
        c.captured(k.clone(), 3);
        c.turn_off("a replay failed");
        assert!(c.is_empty());
        assert!(matches!(c.action(&k), Action::Queue));
        assert_eq!(c.why_off(), Some("a replay failed"));
        let off: GraphCache<u8> = GraphCache::off("DECODE_NODE_GRAPHS is not on");
        assert!(off.why_off().is_some());
    }
}
