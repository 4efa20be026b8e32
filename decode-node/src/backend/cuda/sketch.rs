//! A sequence's 4-bit key sketch on the device (`attention::sketch`) and the block scores of
//! `--block-scorer sketch` computed from it: selection then reads no host KV and costs two
//! kernel launches and one small copy back per layer.
//!
//! The sketch lives in pages taken from the KV arena's slots (so admission's device bytes
//! count it, and it is freed with the sequence's slots): each (layer, KV head) has a page per
//! [`tokens_per_slot`] tokens, holding their nibble rows, then their f32 scales. Pages are
//! filled from the host pool as tokens arrive (the prompt on a layer's first scoring, then
//! the tokens appended since); a per-layer table of page addresses, `[num_kv_heads][pages]`,
//! goes up when a page is added.

use attention::sketch::{nibble_bytes, sketch_tokens, tokens_per_slot};
use attention::{BlockGeometry, GroupScore, KvSource};
use rayon::prelude::*;
use std::sync::atomic::Ordering::Relaxed;

use cudarc::driver::{result as drv, sys};

use super::driver::Pinned;
use super::store::CudaKvStore;
use super::{DevBuf, dev_err, f32_bytes, htod};
use crate::backend::{BackendError, Scored, SketchCall};

/// Blocks one `sketch_lse` CUDA block scores (one per warp: the kernels' `SKETCH_WARPS`).
pub(super) const SKETCH_WARPS: usize = 4;
/// Most blocks one warp of `sketch_lse` scores in a call.
pub(super) const MAX_BLOCKS_PER_WARP: usize = 16;

/// Warps a `sketch_lse` launch aims for on a device of `sms` multiprocessors: 32 each (eight
/// CUDA blocks of four warps, one wave); 4096 where the count is not known.
pub(super) fn target_warps(sms: Option<usize>) -> usize {
    sms.map_or(4096, |n| 32 * n.max(1))
}

/// Blocks each warp of `sketch_lse` scores over `blocks` blocks of each of `heads` KV heads:
/// `forced` where set (non-zero), else as many as bring the launch to about `target` warps,
/// from 1 to [`MAX_BLOCKS_PER_WARP`]. A CUDA block rounds the query once for all of its
/// warps' blocks, so at 64k (8 KV heads, 16k blocks) one block a warp paid that 4096 times.
pub(super) fn blocks_per_warp(blocks: usize, heads: usize, target: usize, forced: usize) -> usize {
    if forced > 0 {
        return forced.min(MAX_BLOCKS_PER_WARP);
    }
    (blocks * heads)
        .div_ceil(target.max(1))
        .clamp(1, MAX_BLOCKS_PER_WARP)
}

/// Threads of `sketch_shares`' one CUDA block per KV head (the kernels' `SHARES_THREADS`).
pub(super) const SHARES_THREADS: u32 = 256;
/// Threads of a `top_blocks` CUDA block (the kernels' `TOP_THREADS`).
pub(super) const TOP_THREADS: u32 = 512;
/// Most candidates one `top_blocks` CUDA block ranks (the kernels' `TOP_MAX`: 32 registers
/// a thread): 64k tokens of 32-token blocks for 8 KV heads sharing a budget.
pub(super) const TOP_MAX: usize = 512 * 32;
/// Tokens sketched per host task when a layer is filled: big enough to amortise a task,
/// small enough that a long prompt's layer spreads over every core.
const FILL_TOKENS: usize = 2048;
/// Fills up to this many tokens a head go up through page-locked staging, in the call's one
/// upload (then `scatter_runs`), so the copy does not wait for the stream's queued work (a
/// copy from pageable memory may); a longer fill (a prompt) is a one-off and goes straight
/// from the host buffers.
const STAGED_TOKENS: usize = 64;

/// Where a KV head's sketch rows sit in its pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pages {
    /// Tokens a page holds.
    pub(super) tokens: usize,
    /// Bytes of one token's nibble row.
    pub(super) row: usize,
}

/// A run of consecutive tokens inside one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Run {
    /// The page (its index in the head's list).
    pub(super) page: usize,
    /// First token of the run, and how many.
    pub(super) token: usize,
    pub(super) len: usize,
    /// Byte offsets in the page of the run's first nibble row and first scale.
    pub(super) rows_at: usize,
    pub(super) scales_at: usize,
}

impl Pages {
    pub(super) fn new(geom: &BlockGeometry) -> Self {
        Self {
            tokens: tokens_per_slot(geom.head_bytes(), geom.head_dim).max(1),
            row: nibble_bytes(geom.head_dim),
        }
    }

    /// Pages that hold `n` tokens.
    pub(super) fn for_tokens(&self, n: usize) -> usize {
        n.div_ceil(self.tokens)
    }

    /// Tokens `from .. to` cut at page boundaries (the layout `sketch_lse` reads).
    pub(super) fn runs(&self, from: usize, to: usize) -> impl Iterator<Item = Run> + '_ {
        let mut t = from;
        std::iter::from_fn(move || {
            if t >= to {
                return None;
            }
            let (page, r) = (t / self.tokens, t % self.tokens);
            let len = (self.tokens - r).min(to - t);
            let run = Run {
                page,
                token: t,
                len,
                rows_at: r * self.row,
                scales_at: self.tokens * self.row + r * 4,
            };
            t += len;
            Some(run)
        })
    }
}

/// One layer's sketch.
#[derive(Debug, Default)]
struct Layer {
    /// Per KV head, its pages' arena slots in token order.
    pages: Vec<Vec<u32>>,
    /// The page table as `sketch_lse` reads it, `[num_kv_heads][table_pages]` addresses.
    table: DevBuf,
    table_pages: usize,
    /// Tokens sketched so far.
    done: usize,
}

/// A sequence's sketch, every layer, and the scratch of its scoring.
#[derive(Debug)]
pub(super) struct SeqSketch {
    layers: Vec<Layer>,
    lse: DevBuf,
    scores: DevBuf,
    /// A call's picks (`top_blocks`), `k` places for each group of heads ranked together.
    picks: DevBuf,
    /// The query, then a short fill's rows and scales and a grown page table, on their way
    /// up in one copy. Reused once the last call's copy back (which follows every copy up in
    /// stream order) has finished.
    staging: Pinned,
    /// Where the staging lands: the query, then a short fill's runs and their bytes.
    up: DevBuf,
    /// The scoring queued without a wait ([`SeqSketch::queue`]): its own staging, which the
    /// stream reads until it reaches the call, and where its scores come back.
    ahead: Ahead,
    /// Per layer, the staging and the picks brought back of a layer its device planned alone
    /// ([`SeqSketch::plan`]): each used once a step, so the step's wait (the LM head's) has
    /// ended every copy from and into them before they are written again.
    planned: Vec<Planned>,
}

/// [`SeqSketch::plan`]'s buffers for one layer, and what its last call picked.
#[derive(Debug)]
struct Planned {
    staging: Pinned,
    back: Pinned,
    /// What the picks in `back` answer, until taken.
    made: Option<Back>,
}

/// Which page-locked staging a scoring's upload goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Staging {
    /// A call that waits for its answer.
    Call,
    /// The call queued without a wait.
    Ahead,
    /// A layer planned on the device.
    Layer(usize),
}

/// [`SeqSketch::queue`]'s buffers, its completion event and what it scored. The device
/// buffers are shared with the waiting calls: the stream orders their uses.
#[derive(Debug)]
struct Ahead {
    staging: Pinned,
    back: Pinned,
    done: Option<sys::CUevent>,
    pending: Option<Queued>,
}

// SAFETY: a CUevent is a handle usable from any thread of the context; the buffers are
// plain memory owned by this value.
unsafe impl Send for Ahead {}

/// A queued scoring: its layer, its KV heads and what comes back for each.
#[derive(Debug, Clone, Copy)]
struct Queued {
    layer: usize,
    hk: usize,
    back: Back,
}

/// What a call leaves on the device for the host, 4-byte words: every block's score
/// (`[hk][blocks]`), or `top_blocks`' picks of the call's cut, `k` for each group of `rows`
/// heads ranked together (`[hk / rows][k]`, each a place `head in the group * blocks + block`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Back {
    Scores {
        blocks: usize,
    },
    Picks {
        k: usize,
        rows: usize,
        blocks: usize,
    },
}

impl Back {
    /// Words of `hk` heads.
    fn words(self, hk: usize) -> usize {
        match self {
            Back::Scores { blocks } => hk * blocks,
            Back::Picks { k, rows, .. } => hk / rows.max(1) * k,
        }
    }

    /// The answer of `hk` heads in `words` (as copied back into floats: picks are their
    /// bits), each head's picks in ascending order.
    pub(super) fn answer(self, hk: usize, words: &[f32]) -> Scored {
        match self {
            Back::Scores { blocks } => Scored::Scores(
                words
                    .chunks_exact(blocks.max(1))
                    .map(<[f32]>::to_vec)
                    .collect(),
            ),
            Back::Picks { k, rows, blocks } => {
                let mut picks = vec![Vec::new(); hk];
                for (g, group) in words.chunks_exact(k.max(1)).enumerate() {
                    for w in group {
                        let place = w.to_bits() as usize;
                        // A place past the heads is kept where the host's check refuses it.
                        let h = (g * rows + place / blocks.max(1)).min(hk.saturating_sub(1));
                        picks[h].push(place % blocks.max(1));
                    }
                }
                Scored::Picks(picks)
            }
        }
    }
}

impl Default for SeqSketch {
    fn default() -> Self {
        Self {
            layers: Vec::new(),
            lse: DevBuf::default(),
            scores: DevBuf::default(),
            picks: DevBuf::default(),
            staging: Pinned::empty(),
            up: DevBuf::default(),
            ahead: Ahead {
                staging: Pinned::empty(),
                back: Pinned::empty(),
                done: None,
                pending: None,
            },
            planned: Vec::new(),
        }
    }
}

impl Ahead {
    /// Waits until the stream is past the queued call (its copies up have read the staging
    /// and its scores are in `back`), and returns what it scored.
    fn settle(&mut self) -> Result<Option<Queued>, BackendError> {
        let Some(queued) = self.pending.take() else {
            return Ok(None);
        };
        if let Some(e) = self.done {
            // SAFETY: a live event, recorded after the call's copy back.
            unsafe { drv::event::synchronize(e) }
                .map_err(|e| dev_err("waiting for queued sketch scores", e))?;
        }
        Ok(Some(queued))
    }
}

impl Drop for Ahead {
    fn drop(&mut self) {
        // The stream may still copy into `back` or read `staging`: both are freed after this.
        let _ = self.settle();
        if let Some(e) = self.done.take() {
            // SAFETY: created by `event::create`, destroyed once.
            let _ = unsafe { drv::event::destroy(e) };
        }
    }
}

/// The query a scoring reads: from the host (uploaded with the call), or rows already in
/// device memory (a resident layer's, before they come back), `len` floats at `addr`.
#[derive(Debug, Clone, Copy)]
pub(super) enum SketchQuery<'a> {
    Host(&'a [f32]),
    Device { addr: u64, len: usize },
}

impl SketchQuery<'_> {
    pub(super) fn len(&self) -> usize {
        match self {
            SketchQuery::Host(q) => q.len(),
            SketchQuery::Device { len, .. } => *len,
        }
    }
}

/// A short fill's copies, for one upload and one `scatter_runs`: each run's offset in
/// `data`, destination address and length.
#[derive(Debug, Default)]
struct Staged {
    data: Vec<u8>,
    runs: Vec<[u64; 3]>,
}

impl Staged {
    fn push(&mut self, dst: u64, bytes: &[u8]) {
        self.runs
            .push([self.data.len() as u64, dst, bytes.len() as u64]);
        self.data.extend_from_slice(bytes);
    }
}

/// True when the sketch kernels take this shape.
pub(super) fn supported(geom: &BlockGeometry, group: usize) -> bool {
    crate::backend::sketch_fits(geom.head_dim, group)
}

impl SeqSketch {
    /// Every arena slot the sketch holds, handed over (the sequence is going).
    pub(super) fn take_slots(&mut self) -> Vec<u32> {
        self.layers
            .iter_mut()
            .flat_map(|l| l.pages.drain(..).flatten())
            .collect()
    }

    /// Brings `layer`'s sketch up to `kv`'s tokens (pages taken as needed, the tokens not
    /// sketched yet quantized here) and returns its page table's address and width. A short
    /// fill's rows and scales, and a grown page table with them, are left in `staged` for
    /// the call's one upload; a long one (a prompt) is copied up from here at once.
    fn fill(
        &mut self,
        store: &CudaKvStore,
        kv: &dyn KvSource,
        layer: usize,
        staged: &mut Staged,
    ) -> Result<(u64, usize), BackendError> {
        let geom = *store.geom();
        let sh = store.shared();
        let hk = geom.num_kv_heads;
        let pg = Pages::new(&geom);
        if self.layers.len() <= layer {
            self.layers.resize_with(layer + 1, Layer::default);
        }
        let l = &mut self.layers[layer];
        l.pages.resize_with(hk, Vec::new);
        let (from, to) = (l.done, kv.num_tokens());
        // Pages first: a full arena fails the call before anything is copied.
        let want = pg.for_tokens(to);
        for pages in &mut l.pages {
            while pages.len() < want {
                let slot = store.take_slot().ok_or_else(|| store.full())?;
                pages.push(slot);
            }
        }
        let grown = want > l.table_pages;
        let table_pages = want.max(l.table_pages);
        let table_at = l.table.ptr(&sh.stream, (hk * table_pages).max(1) * 8)?;
        if from < to {
            let small = to - from <= STAGED_TOKENS;
            // Every head's new tokens, quantized in pieces; a prompt's on every core, a
            // step's token here (a parallel region costs more than its eight rows).
            let pieces: Vec<(usize, usize)> = (0..hk)
                .flat_map(|h| (from..to).step_by(FILL_TOKENS).map(move |t| (h, t)))
                .collect();
            let quantize = |(h, t): (usize, usize)| {
                let end = (t + FILL_TOKENS).min(to);
                let mut nib = vec![0u8; (end - t) * pg.row];
                let mut scales = vec![0f32; end - t];
                sketch_tokens(&geom, kv, layer, h, t, end, &mut nib, &mut scales);
                (h, t, nib, scales)
            };
            let made: Vec<(usize, usize, Vec<u8>, Vec<f32>)> = if small {
                pieces.into_iter().map(quantize).collect()
            } else {
                pieces.into_par_iter().map(quantize).collect()
            };
            for (h, t0, nib, scales) in &made {
                for run in pg.runs(*t0, t0 + scales.len()) {
                    let page = store.slot_addr(l.pages[*h][run.page]);
                    let i = run.token - t0;
                    let rows = &nib[i * pg.row..(i + run.len) * pg.row];
                    let sc = f32_bytes(&scales[i..i + run.len]);
                    let (rows_at, scales_at) =
                        (page + run.rows_at as u64, page + run.scales_at as u64);
                    if small {
                        staged.push(rows_at, rows);
                        staged.push(scales_at, sc);
                    } else {
                        htod(rows_at, rows, &sh.stream)?;
                        htod(scales_at, sc, &sh.stream)?;
                    }
                }
            }
            if grown {
                // `[num_kv_heads][table_pages]` page addresses.
                let bytes: Vec<u8> = l
                    .pages
                    .iter()
                    .flat_map(|p| {
                        p.iter()
                            .map(|&s| store.slot_addr(s))
                            .chain(std::iter::repeat(0))
                            .take(table_pages)
                    })
                    .flat_map(u64::to_ne_bytes)
                    .collect();
                if small {
                    staged.push(table_at, &bytes);
                } else {
                    htod(table_at, &bytes, &sh.stream)?;
                }
            }
        }
        l.table_pages = table_pages;
        l.done = to;
        Ok((table_at, table_pages))
    }

    /// Scores of blocks `0 .. blocks` of `layer` for every KV head (`q` is
    /// `[num_kv_heads][G][head_dim]`), as `attention::sketch::scores_from_sketch` gives them
    /// over `kv`'s tokens: one launch of each kernel and one wait for the copy back.
    pub(super) fn scores(
        &mut self,
        store: &CudaKvStore,
        kv: &dyn KvSource,
        q: &[f32],
        call: SketchCall,
    ) -> Result<Scored, BackendError> {
        let (out, hk, back) = self.launch(store, kv, SketchQuery::Host(q), call, Staging::Call)?;
        let mut host = vec![0f32; back.words(hk)];
        store.shared().read_back(&mut host, out)?;
        Ok(back.answer(hk, &host))
    }

    /// [`SeqSketch::scores`] queued without a wait: the scores come back into page-locked
    /// memory behind an event, for [`SeqSketch::take`]. A call still held is dropped first.
    pub(super) fn queue(
        &mut self,
        store: &CudaKvStore,
        kv: &dyn KvSource,
        q: SketchQuery<'_>,
        call: SketchCall,
    ) -> Result<(), BackendError> {
        // Its staging is about to be written again.
        self.ahead.settle()?;
        let (out, hk, back) = self.launch(store, kv, q, call, Staging::Ahead)?;
        let r = self.queue_back(store, out, hk, call.layer, back);
        if r.is_err() {
            // Nothing is held: the next call must find the stream past this one's copies.
            let _ = store.shared().stream.synchronize();
        }
        r
    }

    /// The copy back and the event of a queued call of `layer` whose kernels are queued
    /// (`out`: what comes back, on the device).
    fn queue_back(
        &mut self,
        store: &CudaKvStore,
        out: u64,
        hk: usize,
        layer: usize,
        what: Back,
    ) -> Result<(), BackendError> {
        let sh = store.shared();
        let words = what.words(hk);
        let back = &mut self.ahead.back.get(words)?[..words];
        // SAFETY: `out` holds `words` 4-byte words (the launch above); `back` is page-locked,
        // owned by this sketch and not read nor freed before the event below has passed
        // (`take`, `settle`, and `Ahead`'s drop wait for it).
        unsafe { drv::memcpy_dtoh_async(back, out, sh.stream.cu_stream()) }
            .map_err(|e| dev_err("copying sketch scores back", e))?;
        let ev = match self.ahead.done {
            Some(e) => e,
            None => {
                let e = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| dev_err("creating an event", e))?;
                self.ahead.done = Some(e);
                e
            }
        };
        // SAFETY: the event and the stream are live.
        unsafe { drv::event::record(ev, sh.stream.cu_stream()) }
            .map_err(|e| dev_err("recording queued sketch scores", e))?;
        self.ahead.pending = Some(Queued {
            layer,
            hk,
            back: what,
        });
        Ok(())
    }

    /// A layer its device plans alone (#21 item 4): queues the scoring of `call` by the query
    /// rows `q` where they are and `top_blocks`' picks, and the copy of the picks back into
    /// page-locked memory for [`SeqSketch::take_planned`] after the step's wait. Returns the
    /// picks' device address and what they answer, for `place_picks`. Nothing waits.
    pub(super) fn plan(
        &mut self,
        store: &CudaKvStore,
        kv: &dyn KvSource,
        q: SketchQuery<'_>,
        call: SketchCall,
    ) -> Result<(u64, Back), BackendError> {
        let layer = call.layer;
        while self.planned.len() <= layer {
            self.planned.push(Planned {
                staging: Pinned::empty(),
                back: Pinned::empty(),
                made: None,
            });
        }
        self.planned[layer].made = None;
        let (out, hk, back) = self.launch(store, kv, q, call, Staging::Layer(layer))?;
        if !matches!(back, Back::Picks { .. }) {
            return Err(BackendError::Unsupported(format!(
                "layer {layer} planned on the device, but its sketch call picks nothing here"
            )));
        }
        let words = back.words(hk);
        let dst = &mut self.planned[layer].back.get(words)?[..words];
        // SAFETY: `out` holds `words` 4-byte words (the launch above); `dst` is page-locked,
        // owned by this sketch and read only after the step's wait (`take_planned`), before
        // this layer is planned again.
        unsafe { drv::memcpy_dtoh_async(dst, out, store.shared().stream.cu_stream()) }
            .map_err(|e| dev_err("copying a planned layer's picks back", e))?;
        self.planned[layer].made = Some(back);
        Ok((out, back))
    }

    /// The picks [`SeqSketch::plan`] made for `layer` (per KV head, ascending), once the
    /// stream has passed them (after the step's wait); `None` where none were made since the
    /// last take.
    pub(super) fn take_planned(
        &mut self,
        layer: usize,
        hk: usize,
    ) -> Result<Option<Scored>, BackendError> {
        let Some(p) = self.planned.get_mut(layer) else {
            return Ok(None);
        };
        let Some(back) = p.made.take() else {
            return Ok(None);
        };
        let words = back.words(hk);
        Ok(Some(back.answer(hk, &p.back.get(words)?[..words])))
    }

    /// True while a layer planned on the device has picks not yet taken (their copy back
    /// may still be under way).
    pub(super) fn plans_pending(&self) -> bool {
        self.planned.iter().any(|p| p.made.is_some())
    }

    /// Waits until the stream is past a queued scoring, if any (dropping its scores).
    pub(super) fn settle(&mut self) -> Result<(), BackendError> {
        self.ahead.settle().map(drop)
    }

    /// The scores [`SeqSketch::queue`] queued for `layer`, waiting for them; `None` where none
    /// are (a call of another layer is dropped).
    pub(super) fn take(&mut self, layer: usize) -> Result<Option<Scored>, BackendError> {
        match self.ahead.settle()? {
            Some(Queued { layer: l, hk, back }) if l == layer => {
                let words = back.words(hk);
                Ok(Some(back.answer(hk, &self.ahead.back.get(words)?[..words])))
            }
            _ => Ok(None),
        }
    }

    /// Queues the sketch's fill and both kernels for blocks `0 .. blocks` of `layer` by `q`
    /// (uploaded through `staging`), and `top_blocks` where the call asks for
    /// picks and the device makes them; returns the device address of what comes back,
    /// `hk` and its shape. On a failure the stream is waited for: a copy queued from the
    /// staging must not read it once the next call writes it.
    fn launch(
        &mut self,
        store: &CudaKvStore,
        kv: &dyn KvSource,
        q: SketchQuery<'_>,
        call: SketchCall,
        staging: Staging,
    ) -> Result<(u64, usize, Back), BackendError> {
        let r = self.launch_unsettled(store, kv, q, call, staging);
        if r.is_err() {
            let _ = store.shared().stream.synchronize();
        }
        r
    }

    fn launch_unsettled(
        &mut self,
        store: &CudaKvStore,
        kv: &dyn KvSource,
        q: SketchQuery<'_>,
        SketchCall {
            layer,
            scale,
            how,
            blocks,
            pick,
        }: SketchCall,
        staging: Staging,
    ) -> Result<(u64, usize, Back), BackendError> {
        let geom = *store.geom();
        let sh = store.shared();
        let (hk, d, bs) = (geom.num_kv_heads, geom.head_dim, geom.block_size);
        let group = q.len() / (hk * d).max(1);
        if !supported(&geom, group) || q.len() != hk * group * d {
            return Err(BackendError::Unsupported(format!(
                "sketch scores with {} query floats for {hk} KV heads of head_dim {d} (kernels: head_dim a multiple of 32 up to 128, at most 8 query heads per KV head)",
                q.len()
            )));
        }
        let n = kv.num_tokens().min(blocks * bs);
        if blocks == 0 || n <= (blocks - 1) * bs {
            // Nothing to score, or a block past the tokens: the host answers that.
            return Err(BackendError::Unsupported(format!(
                "sketch scores of {blocks} blocks over {n} tokens"
            )));
        }
        sh.bind()?;
        sh.idle.busy();
        let mut staged = Staged::default();
        let (table, table_pages) = self.fill(store, kv, layer, &mut staged)?;
        // One upload: a host query, then the table of the fill's runs, then their bytes.
        let host_q = match q {
            SketchQuery::Host(q) => q,
            SketchQuery::Device { .. } => &[][..],
        };
        let runs_at = (host_q.len() * 4).next_multiple_of(8);
        let data_at = runs_at + staged.runs.len() * 24;
        let total = data_at + staged.data.len();
        let up_at = if total > 0 {
            let staging = match staging {
                Staging::Call => &mut self.staging,
                Staging::Ahead => &mut self.ahead.staging,
                Staging::Layer(l) => match self.planned.get_mut(l) {
                    Some(p) => &mut p.staging,
                    None => &mut self.staging,
                },
            };
            let up = staging.bytes(total)?;
            up[..host_q.len() * 4].copy_from_slice(f32_bytes(host_q));
            for (dst, run) in up[runs_at..data_at].chunks_exact_mut(24).zip(&staged.runs) {
                for (d, w) in dst.chunks_exact_mut(8).zip(run) {
                    d.copy_from_slice(&w.to_ne_bytes());
                }
            }
            up[data_at..].copy_from_slice(&staged.data);
            let at = self.up.ptr(&sh.stream, total)?;
            htod(at, up, &sh.stream)?;
            at
        } else {
            0
        };
        let qp = match q {
            SketchQuery::Host(_) => up_at,
            SketchQuery::Device { addr, .. } => addr,
        };
        if !staged.runs.is_empty() {
            let n_runs = i32::try_from(staged.runs.len())
                .map_err(|_| BackendError::Unsupported("sketch fill runs".into()))?;
            let (data, runs) = (up_at + data_at as u64, up_at + runs_at as u64);
            // SAFETY: the upload above holds the run table at `runs` and their bytes at
            // `data`; each run's destination is a page or page table of this sketch with room
            // for its bytes (`fill`).
            unsafe {
                sh.launch(
                    &sh.k.scatter_runs,
                    (n_runs as u32, 1),
                    128,
                    &[&data, &runs, &n_runs],
                )?;
            }
        }
        let lse = self.lse.ptr(&sh.stream, hk * blocks * group * 4)?;
        let out = self.scores.ptr(&sh.stream, hk * blocks * 4)?;
        let temp = scale * std::f32::consts::LOG2_E;
        let as_i32 = |x: usize, what: &str| {
            i32::try_from(x).map_err(|_| BackendError::Unsupported(format!("{what} {x}")))
        };
        let (n32, bs32, blocks32) = (
            as_i32(n, "tokens")?,
            as_i32(bs, "block size")?,
            as_i32(blocks, "blocks")?,
        );
        let (g32, d32) = (as_i32(group, "group")?, as_i32(d, "head_dim")?);
        let (pages32, page_tokens32) = (
            as_i32(table_pages, "sketch pages")?,
            as_i32(Pages::new(&geom).tokens, "tokens per sketch page")?,
        );
        let how32: i32 = match how {
            GroupScore::Max => 0,
            GroupScore::Sum => 1,
        };
        let per_warp = blocks_per_warp(
            blocks,
            hk,
            sh.sketch_target_warps,
            sh.sketch_blocks_per_warp
                .load(std::sync::atomic::Ordering::Relaxed),
        );
        let per_warp32 = per_warp as i32;
        let grid_x = u32::try_from(blocks.div_ceil(SKETCH_WARPS * per_warp))
            .map_err(|_| BackendError::Unsupported(format!("{blocks} blocks")))?;
        let hk32 = hk as u32;
        let int8 = i32::from(sh.sketch_int8);
        // SAFETY: the page table lists hk x table_pages pages holding every token below n
        // (filled above), q holds [hk][G][D] floats (uploaded above, or the caller's rows in
        // device memory, written before this in stream order), lse [hk][blocks][G] and scores
        // [hk][blocks]; the argument types are the kernels'.
        unsafe {
            sh.launch(
                &sh.k.sketch_lse,
                (grid_x, hk32),
                (SKETCH_WARPS * 32) as u32,
                &[
                    &table,
                    &pages32,
                    &page_tokens32,
                    &n32,
                    &bs32,
                    &blocks32,
                    &qp,
                    &g32,
                    &d32,
                    &temp,
                    &int8,
                    &lse,
                    &per_warp32,
                ],
            )?;
            sh.launch(
                &sh.k.sketch_shares,
                (hk32, 1),
                SHARES_THREADS,
                &[&lse, &blocks32, &g32, &how32, &out],
            )?;
        }
        let Some(cut) = pick.filter(|c| picks_fit(c, blocks, hk) && sh.sketch_picks.load(Relaxed))
        else {
            return Ok((out, hk, Back::Scores { blocks }));
        };
        let rows = if cut.shared { hk } else { 1 };
        let k = cut.picks(rows);
        let picks = self.picks.ptr(&sh.stream, hk / rows * k * 4)?;
        let (from32, to32, rows32, k32) = (
            as_i32(cut.from, "first block")?,
            as_i32(cut.to, "end block")?,
            as_i32(rows, "heads ranked together")?,
            as_i32(k, "picks")?,
        );
        // SAFETY: `out` holds [hk][blocks] scores (above) and `picks` room for k words of
        // each of the hk / rows groups; the cut lies inside the scored blocks (`picks_fit`).
        unsafe {
            sh.launch(
                &sh.k.top_blocks,
                ((hk / rows) as u32, 1),
                TOP_THREADS,
                &[&out, &blocks32, &from32, &to32, &rows32, &k32, &picks],
            )?;
        }
        Ok((picks, hk, Back::Picks { k, rows, blocks }))
    }
}

/// True when `top_blocks` can answer `cut` over `blocks` scored blocks of `hk` heads: a
/// range inside them, something to pick, and at most [`TOP_MAX`] candidates a CUDA block
/// (a longer context comes back as scores, and the host picks).
pub(super) fn picks_fit(cut: &attention::TopCut, blocks: usize, hk: usize) -> bool {
    let rows = if cut.shared { hk } else { 1 };
    cut.from <= cut.to
        && cut.to <= blocks
        && cut.k > 0
        && rows * (cut.to - cut.from) <= TOP_MAX
        && u32::try_from(hk * blocks).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use attention::KvDType;

    #[test]
    fn a_warp_scores_enough_blocks_to_fill_the_device_once() {
        let target = target_warps(Some(132));
        assert_eq!(target, 4224);
        // 64k tokens, 8 KV heads: 16k blocks, four a warp (1024 CUDA blocks, ~8 an SM).
        assert_eq!(blocks_per_warp(2048, 8, target, 0), 4);
        assert_eq!(blocks_per_warp(1024, 8, target, 0), 2);
        // 8k: fewer blocks than the target's warps: one each, as before.
        assert_eq!(blocks_per_warp(256, 8, target, 0), 1);
        assert_eq!(blocks_per_warp(0, 8, target, 0), 1);
        assert_eq!(blocks_per_warp(1 << 20, 8, target, 0), MAX_BLOCKS_PER_WARP);
        assert_eq!(blocks_per_warp(2048, 8, target, 3), 3, "forced");
        assert_eq!(blocks_per_warp(2048, 8, target, 99), MAX_BLOCKS_PER_WARP);
        assert_eq!(
            blocks_per_warp(10, 1, 0, 0),
            10,
            "a zero target is one warp"
        );
        assert_eq!(target_warps(None), 4096);
    }

    #[test]
    fn picks_come_back_to_their_heads_in_order() {
        let word = |place: u32| f32::from_bits(place);
        // Each head its own two picks: blocks as they are.
        let own = Back::Picks {
            k: 2,
            rows: 1,
            blocks: 100,
        };
        assert_eq!(own.words(3), 6);
        let got = own.answer(3, &[3, 9, 1, 2, 50, 99].map(word));
        assert_eq!(
            got,
            Scored::Picks(vec![vec![3, 9], vec![1, 2], vec![50, 99]])
        );
        // Three heads sharing five picks: places head * blocks + block, ascending.
        let shared = Back::Picks {
            k: 5,
            rows: 3,
            blocks: 100,
        };
        assert_eq!(shared.words(3), 5);
        let got = shared.answer(3, &[4, 7, 201, 205, 299].map(word));
        assert_eq!(got, Scored::Picks(vec![vec![4, 7], vec![], vec![1, 5, 99]]));
        // Scores as they are; NaN's bits kept.
        let scores = Back::Scores { blocks: 2 };
        let Scored::Scores(s) = scores.answer(2, &[0.5, f32::NAN, -0.0, 1.0]) else {
            panic!("scores");
        };
        assert!(s[0][1].is_nan() && s[1][0].to_bits() == (-0.0f32).to_bits());
    }

    #[test]
    fn a_cut_goes_to_top_blocks_only_where_it_fits() {
        let cut = |to, k, shared| attention::TopCut {
            from: 1,
            to,
            k,
            shared,
        };
        assert!(picks_fit(&cut(2045, 61, false), 2047, 8));
        // 64k tokens of 32-token blocks over 8 heads together: just fits.
        assert!(picks_fit(&cut(2045, 488, true), 2047, 8));
        assert!(
            !picks_fit(&cut(4093, 976, true), 4095, 8),
            "128k shared: the host picks"
        );
        assert!(
            picks_fit(&cut(4093, 61, false), 4095, 8),
            "128k, each head its own"
        );
        assert!(
            !picks_fit(&cut(2048, 61, false), 2047, 8),
            "past the scored blocks"
        );
        assert!(!picks_fit(&cut(2045, 0, false), 2047, 8), "nothing to pick");
    }

    #[test]
    fn runs_put_each_token_where_the_kernel_reads_it() {
        // The kernel's address of token t: page t / tokens, row t % tokens, scales after the
        // page's rows. Runs written into fake pages must land every token there.
        let pg = Pages { tokens: 7, row: 16 };
        let page_bytes = pg.tokens * (pg.row + 4);
        let mut pages = vec![vec![0u8; page_bytes]; pg.for_tokens(40)];
        let (from, to) = (3, 40);
        for run in pg.runs(from, to) {
            assert!(run.len > 0 && run.page == run.token / pg.tokens);
            assert!(run.token % pg.tokens + run.len <= pg.tokens, "{run:?}");
            for i in 0..run.len {
                let t = (run.token + i) as u8;
                let p = &mut pages[run.page];
                p[run.rows_at + i * pg.row..run.rows_at + (i + 1) * pg.row].fill(t);
                p[run.scales_at + i * 4..run.scales_at + (i + 1) * 4].fill(t);
            }
        }
        for t in from..to {
            let (p, r) = (&pages[t / pg.tokens], t % pg.tokens);
            assert!(
                p[r * pg.row..(r + 1) * pg.row]
                    .iter()
                    .all(|&b| b == t as u8)
            );
            let s = pg.tokens * pg.row + r * 4;
            assert!(p[s..s + 4].iter().all(|&b| b == t as u8), "token {t}");
        }
        let total: usize = pg.runs(from, to).map(|r| r.len).sum();
        assert_eq!(total, to - from);
        assert_eq!(pg.runs(5, 5).count(), 0);
    }

    #[test]
    fn a_page_is_one_arena_slot_and_keeps_the_kernels_alignment() {
        for (dtype, bs, d) in [
            (KvDType::Bf16, 32, 128),
            (KvDType::F16, 16, 64),
            (KvDType::I8, 32, 128),
            (KvDType::F8E4M3, 16, 64),
            (KvDType::F32, 32, 96),
        ] {
            let geom = BlockGeometry {
                block_size: bs,
                num_kv_heads: 2,
                head_dim: d,
                dtype,
            };
            let pg = Pages::new(&geom);
            assert!(pg.tokens * (pg.row + 4) <= geom.head_bytes(), "{geom:?}");
            assert!(pg.tokens >= bs, "{geom:?}: {} tokens a page", pg.tokens);
            // 16-byte rows from 16-byte aligned slots, 4-byte aligned scales.
            assert_eq!(geom.head_bytes() % 16, 0);
            assert_eq!(pg.row % 16, 0);
        }
    }
}
