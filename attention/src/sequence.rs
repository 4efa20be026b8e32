//! Per-sequence attention state: digests, device residency, planning and recall.
//!
//! A [`SeqAttention`] owns, for every (layer, KV head) of one request, the Quest digests of its
//! blocks and which blocks are resident on the device. Each decode step, for each layer, the
//! engine asks for a [`HeadPlan`] (which blocks the device attends and which the CPU attends),
//! runs both parts with [`attend_head`], merges them and calls [`SeqAttention::finish_layer`],
//! which updates the statistics and recalls blocks: they are resident at once, in slots the
//! residency table chose, and [`SeqAttention::recalled`] names them for the device to copy
//! before the layer attends again.

use crate::block::{BlockGeometry, HeadBlock};
use crate::digest::{GroupQuery, HeadDigests};
use crate::host_sketch::{HeadSketch, SketchPage};
use crate::kernel::{Scratch, attend_blocks};
use crate::merge::Partial;
use crate::plan::{self, PARALLEL_SELECT_BLOCKS};
use crate::policy::{AttentionConfig, BlockScorer, Mode, RecallLimits, RecallPolicy};
use crate::residency::{DeviceBlock, Residency};
use crate::select::{TopCut, select_shared, select_spans};
use crate::sketch;
use crate::sparq;
use rayon::prelude::*;
use std::sync::Mutex;

/// Read access to one sequence's KV blocks (the host pool implements it).
pub trait KvSource: Sync {
    /// Whole block `block` of `layer` (every KV head, [`BlockGeometry::block_bytes`] bytes).
    fn block(&self, layer: usize, block: usize) -> &[u8];
    /// Tokens stored.
    fn num_tokens(&self) -> usize;
}

/// What block scoring may read besides the digests: the sequence's KV (for
/// [`BlockScorer::Sparq`]) and the model's softmax scale.
#[derive(Clone, Copy)]
pub struct BlockKeys<'a> {
    /// The sequence's KV blocks.
    pub src: &'a dyn KvSource,
    /// Softmax scale of `q·k`.
    pub scale: f32,
}

impl std::fmt::Debug for BlockKeys<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockKeys")
            .field("tokens", &self.src.num_tokens())
            .field("scale", &self.scale)
            .finish()
    }
}

/// A device part named a block the residency table does not hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("layer {layer} KV head {head}: block {block} is in the device part but not resident")]
pub struct NotResident {
    /// Layer.
    pub layer: usize,
    /// KV head.
    pub head: usize,
    /// Block.
    pub block: usize,
}

/// Which blocks of one (layer, KV head) each side attends.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeadPlan {
    /// Blocks attended on the device (sorted).
    pub device: Vec<usize>,
    /// Blocks attended on the CPU (sorted).
    pub cpu: Vec<usize>,
}

impl HeadPlan {
    /// All selected blocks, sorted.
    pub fn selected(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.device.iter().chain(&self.cpu).copied().collect();
        v.sort_unstable();
        v
    }
}

/// A layer a device plans alone ([`SeqAttention::device_plan`]): each KV head attends its
/// fixed blocks and its picks of `cut`, every one on the device.
#[derive(Debug, Clone, PartialEq)]
pub struct DevicePlan {
    /// What the device picks of: each KV head's own, or (`cut.shared`) the layer's.
    pub cut: TopCut,
    /// Per KV head, the blocks attended whatever the picks, with their slots: the sink, then
    /// the window (`cut.to ..`). A head's list is the sink, its picks (ascending, all in
    /// `cut.from .. cut.to`), then the window: ascending, as a host plan's device part.
    pub fixed: Vec<Vec<DeviceBlock>>,
}

/// Counters of one sequence, read by the engine for metrics and `Finish` stats.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SeqStats {
    /// Selected tokens over all steps and layers.
    pub selected_tokens: u64,
    /// Of those, tokens attended on the CPU.
    pub cpu_tokens: u64,
    /// Blocks copied host → device by recall (periodic or on demand).
    pub recall_blocks: u64,
    /// Bytes of those copies.
    pub recall_bytes: u64,
    /// Blocks a periodic recall moved that the layer selected at its next step: what the
    /// copies were worth (`scout`).
    pub recall_used_blocks: u64,
    /// Blocks selected by the real query that the predicted query also selected.
    pub prediction_hits: u64,
    /// Blocks selected by the real query, where a prediction was made.
    pub prediction_total: u64,
    /// Sum of cosine(predicted query, real query) over layers with a prediction.
    pub query_cosine_sum: f64,
    /// Number of cosines summed.
    pub query_cosine_count: u64,
    /// Layers whose prediction the guard checked.
    pub guard_checks: u64,
    /// Of those, layers redone with the real query.
    pub guard_fallbacks: u64,
}

impl SeqStats {
    /// Share of selected tokens attended on the CPU.
    pub fn cpu_ratio(&self) -> f64 {
        ratio(self.cpu_tokens, self.selected_tokens)
    }
    /// Share of the real selection that the predicted query found.
    pub fn hit_ratio(&self) -> f64 {
        ratio(self.prediction_hits, self.prediction_total)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

#[derive(Debug)]
struct HeadState {
    digests: HeadDigests,
    res: Residency,
    /// The CPU part of this head's last plan (sorted): blocks selected on the CPU twice in a
    /// row go first when recall cannot move them all.
    prev_cpu: Vec<usize>,
    /// The key sketch kept on the host ([`SeqAttention::keep_sketch`]); locked per head so
    /// heads score (and catch up) in parallel.
    sketch: Option<Mutex<HeadSketch>>,
}

#[derive(Debug, Clone, Default)]
struct LayerState {
    initialised: bool,
    steps_since_recall: u32,
    /// Steps this layer waits between recalls (0 counts as 1), under backoff.
    cooldown: u32,
    /// A recall ran after the last step: the next plan judges whether it was used.
    judge_recall: bool,
    /// Bytes this layer may still recall (under `RecallLimits::bytes_per_step`).
    recall_credit: u64,
    cpu_tokens: u64,
    selected_tokens: u64,
    /// CPU share at each step, when profiling.
    history: Vec<f32>,
}

/// Attention state of one sequence.
#[derive(Debug)]
pub struct SeqAttention {
    geom: BlockGeometry,
    heads: Vec<HeadState>,
    layers: Vec<LayerState>,
    num_tokens: usize,
    step: u64,
    stats: SeqStats,
    /// Device slots per (layer, KV head) where they differ from the config's
    /// (`AttentionConfig::resident_blocks_per_head`): spare device memory lent to it.
    device_cap: Option<usize>,
}

impl SeqAttention {
    /// State for a sequence of `num_tokens` tokens whose digests are
    /// `digests[layer * num_kv_heads + head]`.
    pub fn new(
        geom: BlockGeometry,
        num_layers: usize,
        num_tokens: usize,
        digests: Vec<HeadDigests>,
    ) -> Self {
        debug_assert_eq!(digests.len(), num_layers * geom.num_kv_heads);
        let heads = digests
            .into_iter()
            .map(|d| {
                let n = d.len();
                HeadState {
                    digests: d,
                    res: Residency::new(n),
                    prev_cpu: Vec::new(),
                    sketch: None,
                }
            })
            .collect();
        Self {
            geom,
            heads,
            layers: vec![LayerState::default(); num_layers],
            num_tokens,
            step: 0,
            stats: SeqStats::default(),
            device_cap: None,
        }
    }

    /// Device-resident blocks each (layer, KV head) may hold: the config's share, or the one
    /// [`SeqAttention::set_device_cap`] gave it.
    pub fn device_cap(&self, cfg: &AttentionConfig) -> usize {
        self.device_cap
            .unwrap_or_else(|| cfg.resident_blocks_per_head())
    }

    /// Gives the sequence `cap` device slots per (layer, KV head) instead of the config's
    /// share (`None`: back to it). More lets it keep more blocks on the device: where they
    /// hold every block, each [`SeqAttention::finish_layer`] brings up more of the rest
    /// (within the recall budget) until none is left on the host. Fewer drops blocks, the
    /// least recently used first, and moves the kept ones into the slots below the new cap: a
    /// device must follow with the same number (`DeviceSeq::set_slots_per_head`) before the
    /// next step. Returns true when any block left the device.
    pub fn set_device_cap(&mut self, cfg: &AttentionConfig, cap: Option<usize>) -> bool {
        self.device_cap = cap;
        let cap = self.device_cap(cfg);
        let mut dropped = false;
        for st in &mut self.heads {
            dropped |= st.res.shrink(cap);
        }
        dropped
    }

    /// Keeps the key sketch of `cfg`'s scored layers (past the dense ones) on the host in
    /// `pages` of `tokens_per_page` tokens ([`crate::host_sketch`]), so the sketch scorer
    /// reads it instead of quantizing the keys it scores at every step. The pages are shared
    /// out evenly over those layers' KV heads; where a head's run short (more tokens than
    /// the caller planned for), it scores as without a kept sketch.
    pub fn keep_sketch(
        &mut self,
        cfg: &AttentionConfig,
        pages: Vec<Box<dyn SketchPage>>,
        tokens_per_page: usize,
    ) {
        let (hk, bs) = (self.geom.num_kv_heads, self.geom.block_size.max(1));
        let first = cfg.dense_layers.min(self.layers.len()) * hk;
        let heads = self.heads.len() - first;
        // Whole blocks, and no more than the smallest page holds.
        let fits = pages.iter().map(|p| p.bytes().len()).min().unwrap_or(0);
        let tokens_per_page = tokens_per_page.min(crate::host_sketch::tokens_per_page(
            fits,
            self.geom.head_dim,
            bs,
        )) / bs
            * bs;
        if heads == 0 || tokens_per_page == 0 {
            return;
        }
        let each = pages.len() / heads;
        let mut pages = pages.into_iter();
        for st in &mut self.heads[first..] {
            let mine: Vec<_> = pages.by_ref().take(each).collect();
            st.sketch = Some(Mutex::new(HeadSketch::new(mine, tokens_per_page)));
        }
    }

    /// Tokens in the sequence.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// The digests, `[layer * num_kv_heads + head]`, with every appended token folded in
    /// (for the prefix cache, when the sequence ends).
    pub fn into_digests(self) -> Vec<HeadDigests> {
        self.heads.into_iter().map(|h| h.digests).collect()
    }

    /// Decode steps taken.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Counters so far.
    pub fn stats(&self) -> &SeqStats {
        &self.stats
    }

    /// Blocks resident on the device, over all layers and heads.
    pub fn resident_blocks(&self) -> usize {
        self.heads.iter().map(|h| h.res.count()).sum()
    }

    /// Whether `block` of (`layer`, `head`) is device-resident.
    pub fn is_resident(&self, layer: usize, head: usize, block: usize) -> bool {
        self.heads[layer * self.geom.num_kv_heads + head]
            .res
            .is_resident(block)
    }

    /// Bytes of device KV this sequence holds (resident blocks only).
    pub fn device_bytes(&self) -> usize {
        self.resident_blocks() * self.geom.head_bytes()
    }

    /// Adds one token's keys for `layer` (`[num_kv_heads][head_dim]`): extends digests and
    /// keeps the newest block device-resident (decode writes new KV to the device).
    /// Call for every layer, then [`SeqAttention::advance`].
    pub fn append_token(&mut self, cfg: &AttentionConfig, layer: usize, keys: &[f32]) {
        let d = self.geom.head_dim;
        let blk = self.num_tokens / self.geom.block_size;
        let cap = self.device_cap(cfg);
        for h in 0..self.geom.num_kv_heads {
            let st = &mut self.heads[layer * self.geom.num_kv_heads + h];
            if st.digests.len() <= blk {
                st.digests.push_empty();
                st.res.push(self.step);
            }
            st.digests.update(blk, &keys[h * d..(h + 1) * d]);
            st.res.make_resident(blk, self.step, cap);
        }
    }

    /// Ends a decode step after [`SeqAttention::append_token`] ran for every layer.
    pub fn advance(&mut self) {
        self.num_tokens += 1;
        self.step += 1;
    }

    /// Number of blocks (the last may be partly filled).
    pub fn num_blocks(&self) -> usize {
        self.geom.blocks_for(self.num_tokens)
    }

    /// Selection scores of every block of (`layer`, `head`) for the group query `q_group`
    /// (`[G][head_dim]`), by `cfg.scorer`; the newest block (always selected) scores 0.
    pub fn block_scores(
        &self,
        cfg: &AttentionConfig,
        layer: usize,
        head: usize,
        q_group: &[f32],
        keys: BlockKeys<'_>,
    ) -> Vec<f32> {
        let n = self.num_blocks();
        let older = n.saturating_sub(1);
        let st = &self.heads[layer * self.geom.num_kv_heads + head];
        let quest = |blocks: std::ops::Range<usize>| -> Vec<f32> {
            let gq = GroupQuery::with(q_group, self.geom.head_dim, cfg.group_score);
            let score = |b: usize| st.digests.score(&gq, b);
            if blocks.len() >= PARALLEL_SELECT_BLOCKS {
                blocks.into_par_iter().map(score).collect()
            } else {
                blocks.map(score).collect()
            }
        };
        let mut scores = match cfg.scorer {
            BlockScorer::Quest => quest(0..older),
            BlockScorer::Sparq {
                channels: _,
                candidates,
            } => {
                let pool = candidates.saturating_mul(cfg.budget_blocks(self.geom.block_size));
                let (mut scores, blocks) = if candidates == 0 || older <= pool {
                    (vec![0f32; older], (0..older).collect::<Vec<_>>())
                } else {
                    // The rest rank below every candidate.
                    let bound = quest(0..older);
                    let mut c: Vec<(usize, f32)> = bound.into_iter().enumerate().collect();
                    let mut blocks = crate::select::best_blocks(&mut c, pool, None);
                    blocks.sort_unstable();
                    (vec![f32::NEG_INFINITY; older], blocks)
                };
                let approx = self.scores_of(cfg, layer, head, q_group, keys, &blocks);
                for (b, a) in blocks.into_iter().zip(approx) {
                    scores[b] = a;
                }
                scores
            }
            BlockScorer::Sketch => self.scores_of(
                cfg,
                layer,
                head,
                q_group,
                keys,
                &(0..older).collect::<Vec<_>>(),
            ),
        };
        scores.resize(n, 0.0);
        scores
    }

    /// Scores of `blocks` of (`layer`, `head`) only, by `cfg.scorer` (no candidate
    /// pre-filter: the caller's list is already short).
    fn scores_of(
        &self,
        cfg: &AttentionConfig,
        layer: usize,
        head: usize,
        q_group: &[f32],
        keys: BlockKeys<'_>,
        blocks: &[usize],
    ) -> Vec<f32> {
        let st = &self.heads[layer * self.geom.num_kv_heads + head];
        match cfg.scorer {
            BlockScorer::Quest => {
                let gq = GroupQuery::with(q_group, self.geom.head_dim, cfg.group_score);
                blocks.iter().map(|&b| st.digests.score(&gq, b)).collect()
            }
            BlockScorer::Sparq { channels, .. } => sparq::block_scores(
                &self.geom,
                keys.src,
                layer,
                head,
                q_group,
                channels,
                keys.scale,
                cfg.group_score,
                blocks,
            ),
            BlockScorer::Sketch => {
                // The kept sketch, brought up to the last block scored; else the keys read
                // (also where the head is busy: never wait on a lock inside a rayon pool).
                let to = blocks.iter().max().map_or(0, |&b| {
                    ((b + 1) * self.geom.block_size).min(keys.src.num_tokens())
                });
                if let Some(mut kept) = st.sketch.as_ref().and_then(|m| m.try_lock().ok())
                    && (kept.tokens() >= to || kept.catch_up(&self.geom, keys.src, layer, head, to))
                {
                    return kept.block_scores(
                        &self.geom,
                        q_group,
                        keys.scale,
                        cfg.group_score,
                        blocks,
                    );
                }
                sketch::block_scores(
                    &self.geom,
                    keys.src,
                    layer,
                    head,
                    q_group,
                    keys.scale,
                    cfg.group_score,
                    blocks,
                )
            }
        }
    }

    /// Chooses the device part of plans made a layer ahead with a predicted query again,
    /// with the real query `q` (`[num_kv_heads][G][head_dim]`): each head keeps its CPU
    /// blocks (their partial is already under way) and the device attends the sink, the
    /// local window and the resident blocks that rank best, in the rest of the budget. So
    /// only the CPU part's share of the selection depends on the prediction. Scores only
    /// resident blocks: a device does the same from the digests it holds.
    pub fn reselect_device(
        &mut self,
        cfg: &AttentionConfig,
        layer: usize,
        q: &[f32],
        keys: BlockKeys<'_>,
        plans: &mut [HeadPlan],
    ) {
        let per_head = q.len() / self.geom.num_kv_heads.max(1);
        let this = &*self;
        let scored: Vec<Reselect> = (0..plans.len().min(self.geom.num_kv_heads))
            .map(|h| {
                let (device, cands) = this.reselect_candidates(cfg, layer, h, &plans[h]);
                let room = cfg.budget_blocks(this.geom.block_size).max(2);
                // (A shared budget ranks every head's candidates against each other.)
                if !cfg.shared_budget && cands.len() + device.len() + plans[h].cpu.len() <= room {
                    // All of them fit: no scores needed.
                    return (device, cands.into_iter().map(|b| (b, 0.0)).collect());
                }
                let q_group = &q[h * per_head..(h + 1) * per_head];
                let scores = this.scores_of(cfg, layer, h, q_group, keys, &cands);
                (device, cands.into_iter().zip(scores).collect())
            })
            .collect();
        self.reselect_device_with(cfg, layer, plans, scored);
    }

    /// [`SeqAttention::reselect_device`] from block scores made elsewhere (a device's, by the
    /// real query): `scores[h]` holds every block of head `h`, as
    /// [`SeqAttention::block_scores`] returns them.
    pub fn reselect_device_scored(
        &mut self,
        cfg: &AttentionConfig,
        layer: usize,
        scores: &[Vec<f32>],
        plans: &mut [HeadPlan],
    ) {
        let scored: Vec<Reselect> = (0..plans.len().min(self.geom.num_kv_heads))
            .map(|h| {
                let (device, cands) = self.reselect_candidates(cfg, layer, h, &plans[h]);
                let s = scores.get(h).map(Vec::as_slice).unwrap_or_default();
                let cands = cands
                    .into_iter()
                    .map(|b| (b, s.get(b).copied().unwrap_or(f32::NEG_INFINITY)))
                    .collect();
                (device, cands)
            })
            .collect();
        self.reselect_device_with(cfg, layer, plans, scored);
    }

    /// Head `h`'s resident blocks outside its CPU part: those the device attends whatever
    /// the query (sink, local window), and the candidates for the rest of the budget.
    fn reselect_candidates(
        &self,
        cfg: &AttentionConfig,
        layer: usize,
        h: usize,
        plan: &HeadPlan,
    ) -> (Vec<usize>, Vec<usize>) {
        let n = self.num_blocks();
        let bs = self.geom.block_size;
        let budget = cfg.budget_blocks(bs).max(2);
        if layer < cfg.dense_layers || n <= budget {
            return (Vec::new(), Vec::new());
        }
        let recent = cfg.local_blocks(bs).clamp(1, budget - 1);
        let res = &self.heads[layer * self.geom.num_kv_heads + h].res;
        let (mut device, mut cands) = (Vec::new(), Vec::new());
        for b in (0..n).filter(|b| res.is_resident(*b) && plan.cpu.binary_search(b).is_err()) {
            if b == 0 || b >= n - recent {
                device.push(b);
            } else {
                cands.push(b);
            }
        }
        (device, cands)
    }

    /// The body of the two `reselect_device`s: per head, the blocks its device part keeps
    /// whatever the query ([`SeqAttention::reselect_candidates`]) and its candidates with
    /// their scores by the real query.
    fn reselect_device_with(
        &mut self,
        cfg: &AttentionConfig,
        layer: usize,
        plans: &mut [HeadPlan],
        scored: Vec<Reselect>,
    ) {
        let n = self.num_blocks();
        let bs = self.geom.block_size;
        let budget = cfg.budget_blocks(bs).max(2);
        if layer < cfg.dense_layers || n <= budget {
            // Every block is selected whatever the query.
            return;
        }
        let hk = self.geom.num_kv_heads;
        let (mut kept, mut scored): (Vec<_>, Vec<_>) = scored.into_iter().unzip();
        if cfg.shared_budget {
            // The layer's room, to the best candidates of any head (candidate `h * n + b`).
            let used: usize = (plans.iter().zip(&kept))
                .map(|(p, d)| p.cpu.len() + d.len())
                .sum();
            let k = (budget * kept.len()).saturating_sub(used);
            let mut all: Vec<(usize, f32)> = (scored.iter().enumerate())
                .flat_map(|(h, c)| c.iter().map(move |&(b, s)| (h * n + b, s)))
                .collect();
            for p in crate::select::best_blocks(&mut all, k, None) {
                kept[p / n].push(p % n);
            }
        } else {
            for ((plan, device), scored) in plans.iter().zip(&mut kept).zip(&mut scored) {
                let k = budget.saturating_sub(plan.cpu.len() + device.len());
                device.extend(crate::select::best_blocks(scored, k, None));
            }
        }
        for ((h, plan), mut device) in plans.iter_mut().enumerate().take(hk).zip(kept) {
            device.sort_unstable();
            let res = &mut self.heads[layer * hk + h].res;
            for &b in &device {
                res.touch(b, self.step);
            }
            plan.device = device;
        }
    }

    /// Top-k selection for one head with its own budget (no residency change): what
    /// `bench select` times; a layer is selected by [`SeqAttention::select_layer`].
    pub fn select(
        &self,
        cfg: &AttentionConfig,
        layer: usize,
        head: usize,
        q_group: &[f32],
        keys: BlockKeys<'_>,
    ) -> Vec<usize> {
        let n = self.num_blocks();
        if layer < cfg.dense_layers {
            return (0..n).collect();
        }
        let scores = self.block_scores(cfg, layer, head, q_group, keys);
        let bs = self.geom.block_size;
        select_spans(
            &scores,
            cfg.budget_blocks(bs),
            cfg.local_blocks(bs),
            cfg.select_spans,
        )
    }

    /// The selections of every KV head of `layer` from their block scores (as
    /// [`SeqAttention::block_scores`] returns them, made here or on a device): the sink, the
    /// mode's window of newest blocks and the best of the rest. Each head has its own budget,
    /// or with `cfg.shared_budget` the heads share the layer's. Every block in a dense layer.
    pub fn select_layer(
        &self,
        cfg: &AttentionConfig,
        layer: usize,
        scores: &[Vec<f32>],
    ) -> Vec<Vec<usize>> {
        let hk = self.geom.num_kv_heads;
        if layer < cfg.dense_layers {
            return vec![(0..self.num_blocks()).collect(); hk];
        }
        let bs = self.geom.block_size;
        let window = select_window(cfg, bs);
        let all: Vec<&[f32]> = (0..hk)
            .map(|h| scores.get(h).map(Vec::as_slice).unwrap_or_default())
            .collect();
        let budget = cfg.budget_blocks(bs);
        if cfg.shared_budget {
            select_shared(&all, budget, window, cfg.select_spans)
        } else {
            all.iter()
                .map(|s| select_spans(s, budget, window, cfg.select_spans))
                .collect()
        }
    }

    /// Plans `layer`: for each KV head, the blocks the device and the CPU attend, given
    /// the query (`[num_kv_heads][G][head_dim]`) used for selection.
    pub fn plan_layer(
        &mut self,
        cfg: &AttentionConfig,
        layer: usize,
        q: &[f32],
        keys: BlockKeys<'_>,
    ) -> Vec<HeadPlan> {
        let hk = self.geom.num_kv_heads;
        let per_head = q.len() / hk;
        let n = self.num_blocks();
        let q_of = |h: usize| &q[h * per_head..(h + 1) * per_head];
        // Scores first, heads in parallel when the context is long enough to pay for it:
        // scoring every block of every head is the step thread's largest job in sparse modes.
        let this = &*self;
        // Sparq and the sketch read keys: a few dozen blocks per head already pay for a
        // thread each.
        let reads_keys = !matches!(cfg.scorer, BlockScorer::Quest);
        let par = n >= PARALLEL_SELECT_BLOCKS || (reads_keys && n >= PARALLEL_SPARQ_BLOCKS);
        let scores = if self.needs_scores(cfg, layer) {
            each_head(par, hk, |h| this.block_scores(cfg, layer, h, q_of(h), keys))
        } else {
            Vec::new()
        };
        self.plan_layer_scored(cfg, layer, &scores)
    }

    /// Where `layer`'s selection is each KV head's sink and window, and the best blocks of a
    /// range by score (each head's own, or with `cfg.shared_budget` the layer's), so a device
    /// that scores the blocks can choose those itself and send back only them
    /// ([`SeqAttention::plan_layer_picked`]): a sparse mode past the dense layers, no spans,
    /// and more blocks than the budget. `None`: the selection reads every score.
    pub fn top_cut(&self, cfg: &AttentionConfig, layer: usize) -> Option<TopCut> {
        if !self.needs_scores(cfg, layer) || cfg.select_spans {
            return None;
        }
        let bs = self.geom.block_size;
        let (n, budget, window) = (
            self.num_blocks(),
            cfg.budget_blocks(bs),
            select_window(cfg, bs),
        );
        if cfg.shared_budget {
            TopCut::shared_of(n, budget, window, self.geom.num_kv_heads)
        } else {
            TopCut::of(n, budget, window)
        }
    }

    /// [`SeqAttention::plan_layer_scored`] from each KV head's picks of
    /// [`SeqAttention::top_cut`] (its best blocks of the range, ascending) made elsewhere:
    /// the same plans as from the scores they were picked from. `None`, with nothing
    /// planned, where the picks are not such an answer (see [`TopCut::selections`]).
    pub fn plan_layer_picked(
        &mut self,
        cfg: &AttentionConfig,
        layer: usize,
        picks: &[Vec<usize>],
    ) -> Option<Vec<HeadPlan>> {
        let cut = self.top_cut(cfg, layer)?;
        if picks.len() != self.geom.num_kv_heads {
            return None;
        }
        let sels = cut.selections(self.num_blocks(), picks)?;
        Some(self.plan_layer_selected(cfg, layer, &sels))
    }

    /// Where a device that picks blocks ([`SeqAttention::top_cut`]) can plan `layer` alone
    /// (#21 item 4): `recall` or `scout`, a layer with a cut, planned before, and every KV
    /// head holding every block of the sequence on the device. The plan of
    /// such a layer is the sink, the head's picks and the window, all on the device; making
    /// it changes only recency and counters (nothing is fetched, evicted or recalled), so
    /// the host may make it after the attention ran, from the picks the device sends back
    /// ([`SeqAttention::plan_layer_picked`], then [`SeqAttention::finish_layer`]), with the
    /// same result. `None`: the host plans `layer` before its attention.
    pub fn device_plan(&self, cfg: &AttentionConfig, layer: usize) -> Option<DevicePlan> {
        let cut = self.device_cut(cfg, layer)?;
        let (hk, n) = (self.geom.num_kv_heads, self.num_blocks());
        let heads = &self.heads[layer * hk..(layer + 1) * hk];
        let fixed: Vec<usize> = std::iter::once(0).chain(cut.to..n).collect();
        let fixed = heads
            .iter()
            .map(|st| st.res.device_blocks(&fixed).ok())
            .collect::<Option<Vec<_>>>()?;
        Some(DevicePlan { cut, fixed })
    }

    /// [`SeqAttention::device_plan`]'s cut where it has one, without its lists: the test
    /// alone, for a caller that asks more often than it plans.
    pub fn device_cut(&self, cfg: &AttentionConfig, layer: usize) -> Option<TopCut> {
        if !matches!(cfg.mode, Mode::Recall | Mode::Scout) || !self.layers.get(layer)?.initialised {
            return None;
        }
        let cut = self.top_cut(cfg, layer)?;
        let (hk, n) = (self.geom.num_kv_heads, self.num_blocks());
        let heads = &self.heads[layer * hk..(layer + 1) * hk];
        (cut.to <= n && heads.iter().all(|st| st.res.count() >= n)).then_some(cut)
    }

    /// True when planning `layer` reads block scores (a sparse mode past the dense layers):
    /// else [`SeqAttention::plan_layer_scored`] takes none.
    pub fn needs_scores(&self, cfg: &AttentionConfig, layer: usize) -> bool {
        layer >= cfg.dense_layers && matches!(cfg.mode, Mode::Hgca | Mode::Recall | Mode::Scout)
    }

    /// [`SeqAttention::plan_layer`] from block scores made elsewhere (a device's):
    /// `scores[h]` holds every block of KV head `h` as [`SeqAttention::block_scores`] returns
    /// them, or nothing where [`SeqAttention::needs_scores`] says none are read.
    pub fn plan_layer_scored(
        &mut self,
        cfg: &AttentionConfig,
        layer: usize,
        scores: &[Vec<f32>],
    ) -> Vec<HeadPlan> {
        let sels = match cfg.mode {
            Mode::Full => Vec::new(),
            Mode::Hgca | Mode::Recall | Mode::Scout => self.select_layer(cfg, layer, scores),
        };
        self.plan_layer_selected(cfg, layer, &sels)
    }

    /// Plans `layer` from each KV head's selection (`sels`, nothing in `full`).
    fn plan_layer_selected(
        &mut self,
        cfg: &AttentionConfig,
        layer: usize,
        sels: &[Vec<usize>],
    ) -> Vec<HeadPlan> {
        let hk = self.geom.num_kv_heads;
        let n = self.num_blocks();
        let bs = self.geom.block_size;
        let cap = self.device_cap(cfg);
        let step = self.step;
        let first = !self.layers[layer].initialised;
        self.layers[layer].initialised = true;
        let mut plans = Vec::with_capacity(hk);
        for h in 0..hk {
            let st = &mut self.heads[layer * hk + h];
            let plan = match cfg.mode {
                Mode::Full => plan::full(&mut st.res, n, step),
                Mode::Hgca => plan::hgca(
                    cfg,
                    sels.get(h).map(Vec::as_slice),
                    bs,
                    n,
                    (&mut st.res, step, cap),
                ),
                Mode::Recall | Mode::Scout => {
                    // The first plan fills the device with the prompt's top-k (sink and recent
                    // block included); recall mode fetches whatever is missing, every step.
                    let fill = first || cfg.mode == Mode::Recall;
                    let sel = sels.get(h).map(Vec::as_slice).unwrap_or_default();
                    let (p, fetched) = plan::by_residency(&mut st.res, sel, step, cap, fill);
                    if !first {
                        self.stats.recall_blocks += fetched;
                        self.stats.recall_bytes += fetched * self.geom.head_bytes() as u64;
                    }
                    p
                }
            };
            plans.push(plan);
        }
        if cfg.mode == Mode::Scout {
            self.judge_recall(cfg, layer, &plans);
        }
        plans
    }

    /// The first plan of `layer` after a recall: counts the recalled blocks it put on the
    /// device, and under backoff lengthens the layer's wait between recalls when too few were
    /// (the selection moved on: the copies were wasted), or shortens it again.
    fn judge_recall(&mut self, cfg: &AttentionConfig, layer: usize, plans: &[HeadPlan]) {
        if !std::mem::take(&mut self.layers[layer].judge_recall) {
            return;
        }
        let hk = self.geom.num_kv_heads;
        let (mut moved, mut used) = (0u64, 0u64);
        for (st, p) in self.heads[layer * hk..(layer + 1) * hk].iter().zip(plans) {
            let recalled = st.res.recalled();
            moved += recalled.len() as u64;
            used += recalled
                .iter()
                .filter(|b| p.device.binary_search(b).is_ok())
                .count() as u64;
        }
        self.stats.recall_used_blocks += used;
        let min_used = cfg.recall_limits.min_used;
        if min_used > 0.0 && moved > 0 {
            let ls = &mut self.layers[layer];
            let c = ls.cooldown.max(1);
            ls.cooldown = if (used as f32) < min_used * moved as f32 {
                (2 * c).min(RecallLimits::MAX_COOLDOWN)
            } else {
                c / 2
            };
        }
    }

    /// Records a layer's plans after its attention ran; recalls its CPU blocks when due
    /// (`scout`), resident as of the next step ([`SeqAttention::recalled`]).
    pub fn finish_layer(&mut self, cfg: &AttentionConfig, layer: usize, plans: &[HeadPlan]) {
        let n = self.num_tokens;
        let bs = self.geom.block_size;
        // Slice by slice, so each sum is one plain loop (`full` sums every block of the layer).
        let tokens =
            |blocks: &[usize]| -> u64 { blocks.iter().map(|b| (n - b * bs).min(bs) as u64).sum() };
        let cpu: u64 = plans.iter().map(|p| tokens(&p.cpu)).sum();
        let sel: u64 = cpu + plans.iter().map(|p| tokens(&p.device)).sum::<u64>();
        self.stats.selected_tokens += sel;
        self.stats.cpu_tokens += cpu;
        let hk = self.geom.num_kv_heads;
        for st in &mut self.heads[layer * hk..(layer + 1) * hk] {
            st.res.clear_recalled();
        }
        let num_layers = self.layers.len() as u64;
        let ls = &mut self.layers[layer];
        ls.selected_tokens += sel;
        ls.cpu_tokens += cpu;
        ls.steps_since_recall += 1;
        if cfg.profile {
            ls.history.push(if sel == 0 {
                0.0
            } else {
                cpu as f32 / sel as f32
            });
        }
        if cfg.mode != Mode::Scout {
            return;
        }
        let (cap, nb) = (self.device_cap(cfg), self.num_blocks());
        // Where the device's share holds every block of a head (a short context, a large
        // `--device-blocks`, or spare device KV lent), the blocks still on the host go up at
        // every step within the byte budget, whatever the CPU share, until none is left: the
        // CPU part shrinks to nothing within a few steps, with no step waiting on a whole
        // prompt's copies, and nothing is judged (they are not a bet on the selection).
        let whole = cap >= nb;
        let ls = &mut self.layers[layer];
        let limits = cfg.recall_limits;
        let head_bytes = self.geom.head_bytes() as u64;
        if limits.bytes_per_step > 0 {
            let share = limits.bytes_per_step / num_layers.max(1);
            // Savings reach at least one block per head, or a budget below that never moves.
            let ceiling = (share * RecallLimits::SAVED_STEPS).max(hk as u64 * head_bytes);
            ls.recall_credit = (ls.recall_credit + share).min(ceiling);
        }
        let due = whole
            || match &cfg.recall {
                RecallPolicy::Off => false,
                RecallPolicy::Intervals(iv) => {
                    let i = iv.get(layer).copied().unwrap_or(0);
                    i > 0 && ls.steps_since_recall >= i
                }
                RecallPolicy::Adaptive { threshold } => {
                    sel > 0 && (cpu as f32 / sel as f32) > *threshold
                }
            } && ls.steps_since_recall >= ls.cooldown.max(1);
        let allowance = if limits.bytes_per_step > 0 {
            (ls.recall_credit / head_bytes.max(1)) as usize
        } else {
            usize::MAX
        };
        let heads = &mut self.heads[layer * hk..(layer + 1) * hk];
        let missing = if whole {
            heads.iter().any(|st| st.res.count() < nb)
        } else {
            cpu > 0
        };
        if due && missing && allowance > 0 {
            let picks = recall_picks(heads, plans, allowance, whole.then_some(nb));
            let mut moved = 0u64;
            for (st, pick) in heads.iter_mut().zip(picks) {
                moved += st.res.recall(pick, self.step, cap) as u64;
            }
            ls.steps_since_recall = 0;
            ls.judge_recall = moved > 0 && !whole;
            if limits.bytes_per_step > 0 {
                ls.recall_credit = ls.recall_credit.saturating_sub(moved * head_bytes);
            }
            self.stats.recall_blocks += moved;
            self.stats.recall_bytes += moved * head_bytes;
        }
        for (st, p) in heads.iter_mut().zip(plans) {
            st.prev_cpu.clone_from(&p.cpu);
        }
    }

    /// Blocks of (`layer`, `head`) that the last [`SeqAttention::finish_layer`] of `layer`
    /// recalled, with their slots: resident from now on, so a device copies them before
    /// `layer` attends again.
    pub fn recalled(&self, layer: usize, head: usize) -> Vec<DeviceBlock> {
        let res = &self.heads[layer * self.geom.num_kv_heads + head].res;
        // Recalled blocks are resident by construction.
        res.device_blocks(res.recalled()).unwrap_or_default()
    }

    /// `blocks` of (`layer`, `head`) with the device slots that hold them: a plan's device
    /// part, for a device that follows this sequence's residency. `Err` names a block that is
    /// not resident (a planning defect, never a client's doing).
    pub fn device_blocks(
        &self,
        layer: usize,
        head: usize,
        blocks: &[usize],
    ) -> Result<Vec<DeviceBlock>, NotResident> {
        self.heads[layer * self.geom.num_kv_heads + head]
            .res
            .device_blocks(blocks)
            .map_err(|block| NotResident { layer, head, block })
    }

    /// Records how well the predicted selection matched the real one, and the query cosine.
    pub fn record_prediction(
        &mut self,
        predicted: &[usize],
        real: &[usize],
        q_pred: &[f32],
        q_real: &[f32],
    ) {
        self.stats.prediction_total += real.len() as u64;
        self.stats.prediction_hits += real
            .iter()
            .filter(|b| predicted.binary_search(b).is_ok())
            .count() as u64;
        let c = cosine(q_pred, q_real);
        if !c.is_nan() {
            self.stats.query_cosine_sum += c as f64;
            self.stats.query_cosine_count += 1;
        }
    }

    /// Records one guard check of a layer's prediction, and whether it was redone.
    pub fn record_guard(&mut self, fell_back: bool) {
        self.stats.guard_checks += 1;
        self.stats.guard_fallbacks += u64::from(fell_back);
    }

    /// Each layer's CPU share at every step so far (recorded with `AttentionConfig::profile`).
    pub fn layer_history(&self) -> Vec<Vec<f32>> {
        self.layers.iter().map(|l| l.history.clone()).collect()
    }
}

/// One head's reselection: the blocks its device part keeps whatever the query, and its
/// other resident blocks with their scores.
type Reselect = (Vec<usize>, Vec<(usize, f32)>);

/// Blocks from which sparq scoring runs heads in parallel.
const PARALLEL_SPARQ_BLOCKS: usize = 32;

/// Which CPU blocks of a layer's plans a recall of at most `allowance` blocks moves, per head:
/// the heads take turns, and each offers first the blocks its CPU part attended at the
/// previous step too (a selection that persists is what a copy pays off on). With `whole`
/// (the layer's blocks, where the device holds them all), each then offers every other block
/// still on the host, the newest first.
fn recall_picks(
    heads: &[HeadState],
    plans: &[HeadPlan],
    allowance: usize,
    whole: Option<usize>,
) -> Vec<Vec<usize>> {
    // Each queue pops its next pick from the end: the plan's CPU blocks that persist, then its
    // other CPU blocks (each class in block order), then (`whole`) the rest, the newest first.
    let mut queues: Vec<Vec<usize>> = heads
        .iter()
        .zip(plans)
        .map(|(st, p)| {
            let mut q: Vec<usize> = p
                .cpu
                .iter()
                .copied()
                .filter(|&b| !st.res.is_resident(b))
                .collect();
            q.sort_by_key(|b| st.prev_cpu.binary_search(b).is_err());
            q.reverse();
            if let Some(nb) = whole {
                let rest =
                    (0..nb).filter(|&b| !st.res.is_resident(b) && p.cpu.binary_search(&b).is_err());
                q.splice(0..0, rest);
            }
            q
        })
        .collect();
    let mut picks = vec![Vec::new(); queues.len()];
    let mut left = allowance;
    while left > 0 {
        let mut took = false;
        for (q, pick) in queues.iter_mut().zip(&mut picks) {
            if left == 0 {
                break;
            }
            if let Some(b) = q.pop() {
                pick.push(b);
                left -= 1;
                took = true;
            }
        }
        if !took {
            break;
        }
    }
    picks
}

/// `f` of every head `0..hk`, in parallel when `par`.
/// The newest blocks `cfg.mode`'s selection always takes: HGCA's window, else the local one.
fn select_window(cfg: &AttentionConfig, block_size: usize) -> usize {
    match cfg.mode {
        Mode::Hgca => plan::hgca_window(cfg, block_size),
        _ => cfg.local_blocks(block_size),
    }
}

fn each_head<T: Send>(par: bool, hk: usize, f: impl Fn(usize) -> T + Sync + Send) -> Vec<T> {
    if par {
        (0..hk).into_par_iter().map(f).collect()
    } else {
        (0..hk).map(f).collect()
    }
}

/// Cosine of two vectors (f64 sums); NaN when either is zero.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let (mut dot, mut na, mut nb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (*x as f64, *y as f64);
        dot += x * y;
        na += x * x;
        nb += y * y;
    }
    if na > 0.0 && nb > 0.0 {
        (dot / (na * nb).sqrt()) as f32
    } else {
        f32::NAN
    }
}

/// Per-layer recall intervals from a profile taken with recall off: for each layer, the
/// number of steps its CPU share stays at or under `threshold` after the device was filled
/// (at least 1, so a layer that drifts at once recalls every step).
pub fn recall_intervals(history: &[Vec<f32>], threshold: f32) -> Vec<u32> {
    history
        .iter()
        .map(|h| {
            // Step 0 is the fill itself; drift is measured from the step after.
            let steps = h.iter().skip(1).take_while(|r| **r <= threshold).count();
            steps.max(1) as u32
        })
        .collect()
}

/// Which head a query belongs to, the query itself and its softmax scale.
#[derive(Debug, Clone, Copy)]
pub struct HeadQuery<'a> {
    /// Layer.
    pub layer: usize,
    /// KV head.
    pub head: usize,
    /// `[G][head_dim]`: the GQA group's query heads.
    pub q: &'a [f32],
    /// Softmax scale.
    pub scale: f32,
}

/// Attends `blocks` of the query's (layer, KV head) from `src`.
pub fn attend_head(
    geom: &BlockGeometry,
    src: &dyn KvSource,
    query: HeadQuery<'_>,
    blocks: &[usize],
    scratch: &mut Scratch,
) -> Partial {
    let n = src.num_tokens();
    let bs = geom.block_size;
    let range = geom.head_range(query.head);
    let iter = blocks.iter().filter(|b| **b * bs < n).map(|&b| HeadBlock {
        bytes: &src.block(query.layer, b)[range.clone()],
        len: (n - b * bs).min(bs),
    });
    attend_blocks(geom, query.q, query.scale, iter, scratch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::KvDType;
    use crate::kernel::tests::values;

    /// A single-layer sequence kept in plain vectors.
    struct Mem {
        geom: BlockGeometry,
        blocks: Vec<Vec<u8>>,
        n: usize,
    }
    impl KvSource for Mem {
        fn block(&self, _layer: usize, block: usize) -> &[u8] {
            &self.blocks[block]
        }
        fn num_tokens(&self) -> usize {
            self.n
        }
    }

    fn setup(n: usize, hk: usize, d: usize, seed: u64) -> (Mem, Vec<HeadDigests>, Vec<f32>) {
        let geom = BlockGeometry {
            block_size: 16,
            num_kv_heads: hk,
            head_dim: d,
            dtype: KvDType::F32,
        };
        let keys = values(seed, n * hk * d, 1.0);
        let vals = values(seed + 1, n * hk * d, 1.0);
        let nb = geom.blocks_for(n);
        let mut blocks = vec![vec![0u8; geom.block_bytes()]; nb];
        let mut digests = vec![HeadDigests::new(nb, d); hk];
        for t in 0..n {
            for h in 0..hk {
                let k = &keys[(t * hk + h) * d..(t * hk + h + 1) * d];
                let v = &vals[(t * hk + h) * d..(t * hk + h + 1) * d];
                geom.write_token(&mut blocks[t / 16], h, t % 16, k, v);
                digests[h].update(t / 16, k);
            }
        }
        (Mem { geom, blocks, n }, digests, keys)
    }

    fn keys(mem: &Mem) -> BlockKeys<'_> {
        BlockKeys {
            src: mem,
            scale: 0.125,
        }
    }

    fn run(cfg: &AttentionConfig, mem: &Mem, seq: &mut SeqAttention, q: &[f32]) -> Vec<Partial> {
        let plans = seq.plan_layer(cfg, 0, q, keys(mem));
        let hk = mem.geom.num_kv_heads;
        let per = q.len() / hk;
        let mut s = Scratch::default();
        let out = plans
            .iter()
            .enumerate()
            .map(|(h, p)| {
                let qg = &q[h * per..(h + 1) * per];
                let hq = HeadQuery {
                    layer: 0,
                    head: h,
                    q: qg,
                    scale: 0.125,
                };
                let mut a = attend_head(&mem.geom, mem, hq, &p.device, &mut s);
                a.merge_from(&attend_head(&mem.geom, mem, hq, &p.cpu, &mut s));
                a
            })
            .collect();
        seq.finish_layer(cfg, 0, &plans);
        out
    }

    #[test]
    fn scout_with_full_budget_equals_full() {
        let (mem, digests, _) = setup(200, 2, 16, 3);
        let q = values(9, 2 * 4 * 16, 1.0);
        let full = AttentionConfig {
            mode: Mode::Full,
            ..AttentionConfig::scout(16)
        };
        let mut scout = AttentionConfig::scout(16);
        scout.budget_tokens = 200;
        // A small device so that part of the selection lands on the CPU.
        scout.device_blocks_per_head = 4;
        let a = run(
            &full,
            &mem,
            &mut SeqAttention::new(mem.geom, 1, 200, digests.clone()),
            &q,
        );
        let mut seq = SeqAttention::new(mem.geom, 1, 200, digests);
        let b = run(&scout, &mem, &mut seq, &q);
        assert!(
            seq.stats().cpu_tokens > 0,
            "test must exercise the CPU side"
        );
        for (x, y) in a.iter().zip(&b) {
            for (u, v) in x.out.iter().zip(&y.out) {
                assert!((u - v).abs() <= 1e-5 * u.abs().max(1.0), "{u} {v}");
            }
        }
    }

    #[test]
    fn planted_needle_block_is_selected() {
        let (mut mem, mut digests, _) = setup(512, 1, 16, 5);
        let q = values(77, 16, 1.0);
        // Plant a key aligned with q in block 17.
        let needle: Vec<f32> = q.iter().map(|x| x * 8.0).collect();
        let geom = mem.geom;
        geom.write_token(&mut mem.blocks[17], 0, 5, &needle, &[0.0; 16]);
        digests[0].update(17, &needle);
        let mut cfg = AttentionConfig::scout(16);
        cfg.budget_tokens = 64;
        let seq = SeqAttention::new(geom, 1, 512, digests);
        let sparq = |candidates| BlockScorer::Sparq {
            channels: 4,
            candidates,
        };
        for scorer in [BlockScorer::Quest, sparq(0), sparq(2), BlockScorer::Sketch] {
            cfg.scorer = scorer;
            let sel = seq.select(&cfg, 0, 0, &q, keys(&mem));
            assert!(sel.contains(&17), "{scorer:?}: {sel:?}");
            assert!(sel.contains(&0) && sel.contains(&31));
            assert_eq!(sel.len(), 4);
        }
    }

    #[test]
    fn a_device_that_holds_every_block_takes_the_prompt_after_the_first_plan() {
        // 300 tokens in blocks of 16: 19 blocks a head, 2 heads; a budget of 4 blocks.
        let (mem, digests, _) = setup(300, 2, 16, 41);
        for (cap, whole) in [(19, true), (40, true), (18, false)] {
            let mut cfg = AttentionConfig::scout(16);
            cfg.budget_tokens = 64;
            cfg.device_blocks_per_head = cap;
            let mut seq = SeqAttention::new(mem.geom, 1, 300, digests.clone());
            let q = values(5, 2 * 3 * 16, 1.0);
            let first = seq.plan_layer(&cfg, 0, &q, keys(&mem));
            assert!(first.iter().all(|p| p.device.len() + p.cpu.len() == 4));
            seq.finish_layer(&cfg, 0, &first);
            let recalled: Vec<usize> = (0..2).map(|h| seq.recalled(0, h).len()).collect();
            seq.step += 1;
            let q = values(6, 2 * 3 * 16, 1.0);
            let next = seq.plan_layer(&cfg, 0, &q, keys(&mem));
            if whole {
                // What the first plan did not fetch: the other 15 of each head, at once.
                assert_eq!(recalled, vec![15, 15], "cap {cap}");
                assert_eq!(seq.resident_blocks(), 2 * 19);
                assert!(next.iter().all(|p| p.cpu.is_empty() && p.device.len() == 4));
            } else {
                assert!(recalled.iter().all(|&r| r < 15), "cap {cap}: {recalled:?}");
            }
        }
    }

    #[test]
    fn a_prompt_the_device_can_hold_goes_up_within_the_recall_budget() {
        // 19 blocks a head of 2 heads, all of which the device's share holds; 3 blocks a step
        // for the layer (a step's credit; it saves up to four steps, all spent each step).
        let (mem, digests, _) = setup(300, 2, 16, 47);
        let mut cfg = AttentionConfig::scout(16);
        cfg.budget_tokens = 64;
        cfg.device_blocks_per_head = 19;
        cfg.recall_limits.bytes_per_step = 3 * mem.geom.head_bytes() as u64;
        let mut seq = SeqAttention::new(mem.geom, 1, 300, digests);
        let mut resident = Vec::new();
        let mut cpu_first = 0;
        for step in 0..20u64 {
            let q = values(100 + step, 2 * 3 * 16, 1.0);
            let p = seq.plan_layer(&cfg, 0, &q, keys(&mem));
            let before = seq.resident_blocks();
            seq.finish_layer(&cfg, 0, &p);
            let recalled: Vec<Vec<usize>> = (0..2)
                .map(|h| seq.recalled(0, h).iter().map(|d| d.block).collect())
                .collect();
            assert!(
                recalled.iter().map(Vec::len).sum::<usize>() <= 3,
                "{recalled:?}"
            );
            // A plan's CPU blocks go before the rest.
            for (h, r) in recalled.iter().enumerate() {
                if r.iter().any(|b| !p[h].cpu.contains(b)) {
                    assert!(p[h].cpu.iter().all(|&b| seq.is_resident(0, h, b)), "{r:?}");
                }
                cpu_first += r.iter().filter(|b| p[h].cpu.contains(b)).count();
            }
            resident.push(before);
            seq.step += 1;
        }
        assert!(cpu_first > 0);
        // Three a step until all 38 are up, then nothing left to move.
        assert_eq!(seq.resident_blocks(), 2 * 19);
        let q = values(999, 2 * 3 * 16, 1.0);
        let p = seq.plan_layer(&cfg, 0, &q, keys(&mem));
        assert!(p.iter().all(|p| p.cpu.is_empty()));
        assert!(
            resident
                .windows(2)
                .all(|w| w[1] >= w[0] && w[1] - w[0] <= 4)
        );
    }

    #[test]
    fn a_lent_device_share_takes_the_prompt_and_gives_it_back_below_the_cap() {
        // 19 blocks a head; the config's share (8) cannot hold them, the lent one (19) can.
        let (mem, digests, _) = setup(300, 2, 16, 43);
        let mut cfg = AttentionConfig::scout(16);
        cfg.budget_tokens = 64;
        cfg.device_blocks_per_head = 8;
        let mut seq = SeqAttention::new(mem.geom, 1, 300, digests);
        let plan = |seq: &mut SeqAttention, seed: u64| {
            let q = values(seed, 2 * 3 * 16, 1.0);
            let p = seq.plan_layer(&cfg, 0, &q, keys(&mem));
            seq.finish_layer(&cfg, 0, &p);
            seq.step += 1;
            p
        };
        plan(&mut seq, 1);
        assert!(seq.resident_blocks() <= 2 * 8);
        assert!(!seq.set_device_cap(&cfg, Some(19)));
        assert_eq!(seq.device_cap(&cfg), 19);
        // The next finish of the layer brings up every block still on the host.
        plan(&mut seq, 2);
        assert_eq!(seq.resident_blocks(), 2 * 19);
        // (The whole recall counts as used at the step after it: one more step to tell the
        // last plan's blocks from the rest.)
        for seed in [3, 4] {
            let p = plan(&mut seq, seed);
            assert!(p.iter().all(|p| p.cpu.is_empty() && p.device.len() == 4));
        }
        let p = plan(&mut seq, 5);
        // Given back: eight a head, the sink, the newest and the last plan's among them, in
        // slots below eight, and plans place into those slots only.
        assert!(seq.set_device_cap(&cfg, None));
        assert_eq!(seq.device_cap(&cfg), 8);
        assert_eq!(seq.resident_blocks(), 2 * 8);
        for (h, hp) in p.iter().enumerate() {
            for &b in hp.device.iter().chain([&0, &18]) {
                assert!(seq.is_resident(0, h, b), "head {h} block {b}");
            }
            let slots = seq.device_blocks(0, h, &hp.device).unwrap();
            assert!(slots.iter().all(|d| d.slot < 8), "{slots:?}");
        }
        for seed in 6..11 {
            let p = plan(&mut seq, seed);
            assert!(seq.resident_blocks() <= 2 * 8);
            for (h, hp) in p.iter().enumerate() {
                let slots = seq.device_blocks(0, h, &hp.device).unwrap();
                assert!(slots.iter().all(|d| d.slot < 8));
                assert!(seq.recalled(0, h).iter().all(|d| d.slot < 8));
            }
        }
    }

    #[test]
    fn plans_from_scores_made_elsewhere_equal_the_ones_made_here() {
        // What a device scoring the blocks hands back: `plan_layer_scored` and
        // `reselect_device_scored` must plan as `plan_layer` and `reselect_device` do.
        let (mem, digests, _) = setup(700, 2, 16, 21);
        for (mode, scorer, shared) in [
            (Mode::Scout, BlockScorer::Quest, false),
            (Mode::Scout, BlockScorer::Quest, true),
            (Mode::Scout, BlockScorer::Sketch, false),
            (Mode::Scout, BlockScorer::Sketch, true),
            (Mode::Recall, BlockScorer::Sketch, true),
            (Mode::Hgca, BlockScorer::Quest, false),
            (Mode::Hgca, BlockScorer::Sketch, true),
        ] {
            let mut cfg = AttentionConfig::scout(16);
            cfg.mode = mode;
            cfg.scorer = scorer;
            cfg.shared_budget = shared;
            cfg.budget_tokens = 160;
            cfg.device_blocks_per_head = 12;
            let mut here = SeqAttention::new(mem.geom, 1, 700, digests.clone());
            let mut there = SeqAttention::new(mem.geom, 1, 700, digests.clone());
            // And a device that also picks each head's best blocks (`top_blocks`).
            let mut picked = SeqAttention::new(mem.geom, 1, 700, digests.clone());
            for (step, seed) in [31u64, 32, 33].into_iter().enumerate() {
                let q = values(seed, 2 * 3 * 16, 1.0);
                let scores: Vec<Vec<f32>> = (0..2)
                    .map(|h| there.block_scores(&cfg, 0, h, &q[h * 48..(h + 1) * 48], keys(&mem)))
                    .collect();
                assert!(there.needs_scores(&cfg, 0));
                let mut a = here.plan_layer(&cfg, 0, &q, keys(&mem));
                let mut b = there.plan_layer_scored(&cfg, 0, &scores);
                assert_eq!(a, b, "{mode:?} {scorer:?} {shared} step {step}");
                let cut = picked.top_cut(&cfg, 0);
                assert_eq!(cut.map(|c| c.shared), Some(shared), "{mode:?} {shared}");
                let mut c = cut.and_then(|cut| {
                    let refs: Vec<&[f32]> = scores.iter().map(Vec::as_slice).collect();
                    let picks = crate::best_in(&refs, cut);
                    let mut wrong = picks.clone();
                    wrong[1].push(cut.to);
                    assert_eq!(picked.plan_layer_picked(&cfg, 0, &wrong), None);
                    assert_eq!(picked.plan_layer_picked(&cfg, 0, &picks[..1]), None);
                    picked.plan_layer_picked(&cfg, 0, &picks)
                });
                if cut.is_some() {
                    assert_eq!(
                        c.as_ref(),
                        Some(&a),
                        "{mode:?} {scorer:?} picked, step {step}"
                    );
                }
                // Ten blocks a head, shared or not: the layer's budget holds.
                let attended = |p: &[HeadPlan]| -> usize {
                    p.iter().map(|p| p.device.len() + p.cpu.len()).sum()
                };
                assert_eq!(attended(&a), 2 * 10, "{mode:?} {scorer:?} {shared}");
                if mode == Mode::Scout && scorer == BlockScorer::Quest {
                    // Quest's scores do not depend on which blocks are scored together.
                    let q2 = values(seed + 100, 2 * 3 * 16, 1.0);
                    let s2: Vec<Vec<f32>> = (0..2)
                        .map(|h| {
                            there.block_scores(&cfg, 0, h, &q2[h * 48..(h + 1) * 48], keys(&mem))
                        })
                        .collect();
                    here.reselect_device(&cfg, 0, &q2, keys(&mem), &mut a);
                    there.reselect_device_scored(&cfg, 0, &s2, &mut b);
                    assert_eq!(a, b, "reselected, {shared} step {step}");
                    if let Some(c) = &mut c {
                        picked.reselect_device_scored(&cfg, 0, &s2, c);
                    }
                    assert!(attended(&a) <= 2 * 10, "{shared}");
                }
                here.finish_layer(&cfg, 0, &a);
                there.finish_layer(&cfg, 0, &b);
                if let Some(c) = &c {
                    assert_eq!(c, &a, "{mode:?} {scorer:?} picked, step {step}");
                    picked.finish_layer(&cfg, 0, c);
                }
                here.step += 1;
                there.step += 1;
                picked.step += 1;
            }
        }
    }

    #[test]
    fn a_layer_whose_every_block_is_resident_is_planned_by_the_device_as_the_host_plans_it() {
        // 700 tokens in blocks of 16: 44 blocks a head, 2 heads; a budget of 10 blocks.
        let (mem, digests, _) = setup(700, 2, 16, 61);
        for (mode, shared, cap) in [
            (Mode::Scout, false, 44),
            (Mode::Recall, false, 60),
            (Mode::Scout, true, 44),
            (Mode::Scout, false, 43),
        ] {
            let mut cfg = AttentionConfig::scout(16);
            cfg.mode = mode;
            cfg.scorer = BlockScorer::Sketch;
            cfg.shared_budget = shared;
            cfg.budget_tokens = 160;
            cfg.device_blocks_per_head = cap;
            cfg.recall_limits.bytes_per_step = 0;
            let mut host = SeqAttention::new(mem.geom, 1, 700, digests.clone());
            let mut dev = SeqAttention::new(mem.geom, 1, 700, digests.clone());
            let what = format!("{mode:?} shared {shared} cap {cap}");
            assert_eq!(dev.device_plan(&cfg, 0), None, "{what}: never planned");
            let mut planned = 0;
            for seed in 70u64..76 {
                let q = values(seed, 2 * 3 * 16, 1.0);
                let scores: Vec<Vec<f32>> = (0..2)
                    .map(|h| host.block_scores(&cfg, 0, h, &q[h * 48..(h + 1) * 48], keys(&mem)))
                    .collect();
                let refs: Vec<&[f32]> = scores.iter().map(Vec::as_slice).collect();
                let cut = host.top_cut(&cfg, 0).unwrap();
                let picks = crate::best_in(&refs, cut);
                let a = host.plan_layer_picked(&cfg, 0, &picks).unwrap();
                let ahead = dev.device_plan(&cfg, 0);
                assert_eq!(
                    dev.device_cut(&cfg, 0),
                    ahead.as_ref().map(|p| p.cut),
                    "{what}"
                );
                if let Some(p) = &ahead {
                    planned += 1;
                    assert_eq!(p.cut, cut, "{what}");
                    // The device's lists: the sink, the picks, the window; all resident.
                    for (h, plan) in a.iter().enumerate() {
                        let (sink, window) = p.fixed[h].split_first().unwrap();
                        let list: Vec<usize> = std::iter::once(sink.block)
                            .chain(picks[h].iter().copied())
                            .chain(window.iter().map(|b| b.block))
                            .collect();
                        assert_eq!(list, plan.device, "{what}");
                        assert!(plan.cpu.is_empty(), "{what}");
                        for b in &p.fixed[h] {
                            assert_eq!(dev.heads[h].res.slot(b.block), Some(b.slot), "{what}");
                        }
                    }
                }
                let b = dev.plan_layer_picked(&cfg, 0, &picks).unwrap();
                assert_eq!(a, b, "{what}");
                host.finish_layer(&cfg, 0, &a);
                dev.finish_layer(&cfg, 0, &b);
                assert_eq!(host.stats(), dev.stats(), "{what}");
                host.step += 1;
                dev.step += 1;
            }
            // In `scout` the prompt goes up after the first plan: every later step is the
            // device's, where each head's share holds every block. `recall` fetches only what
            // it selects, so never the whole prompt here.
            let want = if cap < 44 || mode == Mode::Recall {
                0
            } else {
                5
            };
            assert_eq!(planned, want, "{what}");
        }
    }

    #[test]
    fn a_kept_sketch_plans_as_the_keys_read_at_every_step() {
        // Head_dim 64 takes the SIMD scoring where the CPU has it: scores agree to rounding,
        // plans exactly, with the query as that scoring rounds it (to int8 on AVX2). A
        // sequence whose pages run short scores from the keys, by the query itself, past them.
        let (mut mem, digests, keys_all) = setup(330, 2, 64, 5);
        let mut cfg = AttentionConfig::scout(16);
        cfg.scorer = BlockScorer::Sketch;
        cfg.budget_tokens = 96;
        cfg.device_blocks_per_head = 4;
        mem.n = 250;
        let page_bytes = 48 * (crate::sketch::nibble_bytes(64) + 4);
        let tpp = crate::host_sketch::tokens_per_page(page_bytes, 64, 16);
        let pages = |n: usize| -> Vec<Box<dyn SketchPage>> {
            (0..n)
                .map(|_| Box::new(vec![0u8; page_bytes]) as Box<dyn SketchPage>)
                .collect()
        };
        let mut read = SeqAttention::new(mem.geom, 1, 250, digests.clone());
        let mut kept = SeqAttention::new(mem.geom, 1, 250, digests.clone());
        kept.keep_sketch(
            &cfg,
            pages(2 * crate::host_sketch::pages_for(330, tpp)),
            tpp,
        );
        let mut short = SeqAttention::new(mem.geom, 1, 250, digests.clone());
        short.keep_sketch(&cfg, pages(2 * 6), tpp);
        // A page size that is no whole number of blocks, or more than a page holds, is cut
        // down to what the pages hold in whole blocks.
        let mut loose = SeqAttention::new(mem.geom, 1, 250, digests);
        loose.keep_sketch(&cfg, pages(2 * 8), tpp + 7);
        let agree = |want: &[f32], got: &[f32], what: &str| {
            assert_eq!(want.len(), got.len());
            for (w, g) in want.iter().zip(got) {
                assert!(
                    (w - g).abs() <= 1e-5 * (1.0 + w.abs()),
                    "{what}: {w} vs {g}"
                );
            }
        };
        for step in 0..70u64 {
            let q = values(400 + step, 2 * 3 * 64, 1.0);
            let rounded = crate::host_sketch::query_scored(&q, 64, 16);
            // `short` holds 288 tokens; the newest block is never scored.
            let short_covers = (mem.n - 1) / 16 * 16 <= 288;
            for h in 0..2 {
                let (qh, rh) = (&q[h * 192..(h + 1) * 192], &rounded[h * 192..(h + 1) * 192]);
                let want = read.block_scores(&cfg, 0, h, rh, keys(&mem));
                agree(
                    &want,
                    &kept.block_scores(&cfg, 0, h, qh, keys(&mem)),
                    "kept",
                );
                agree(
                    &want,
                    &loose.block_scores(&cfg, 0, h, qh, keys(&mem)),
                    "loose",
                );
                let short_got = short.block_scores(&cfg, 0, h, qh, keys(&mem));
                if short_covers {
                    agree(&want, &short_got, "short");
                } else {
                    agree(
                        &read.block_scores(&cfg, 0, h, qh, keys(&mem)),
                        &short_got,
                        "short, past its pages",
                    );
                }
            }
            let a = read.plan_layer(&cfg, 0, &rounded, keys(&mem));
            assert_eq!(a, kept.plan_layer(&cfg, 0, &q, keys(&mem)), "step {step}");
            assert_eq!(a, loose.plan_layer(&cfg, 0, &q, keys(&mem)), "step {step}");
            let short_plan = short.plan_layer(&cfg, 0, &q, keys(&mem));
            if short_covers {
                assert_eq!(a, short_plan, "step {step}");
            }
            // The next token, as decode appends it.
            let t = mem.n;
            let k = &keys_all[t * 2 * 64..(t + 1) * 2 * 64];
            mem.n += 1;
            for seq in [&mut read, &mut kept, &mut short, &mut loose] {
                seq.finish_layer(&cfg, 0, &a);
                seq.append_token(&cfg, 0, k);
                seq.advance();
            }
        }
        let sketched = |seq: &SeqAttention| {
            seq.heads[0]
                .sketch
                .as_ref()
                .map(|m| m.lock().unwrap().tokens())
        };
        // Whole blocks only: the newest (partial) block is never scored.
        assert_eq!(sketched(&kept), Some(304));
        assert_eq!(sketched(&short), Some(288));
        assert_eq!(sketched(&loose), Some(304));
        assert_eq!(sketched(&read), None);
    }

    #[test]
    fn adaptive_recall_moves_cpu_blocks_to_the_device() {
        let (mem, digests, _) = setup(512, 1, 16, 8);
        let mut cfg = AttentionConfig::scout(16);
        cfg.budget_tokens = 128;
        cfg.device_blocks_per_head = 8;
        let mut seq = SeqAttention::new(mem.geom, 1, 512, digests);
        // First step fills the device from query a; query b selects other blocks.
        run(&cfg, &mem, &mut seq, &values(1, 16, 1.0));
        seq.step += 1;
        let qb = values(2, 16, 1.0);
        run(&cfg, &mem, &mut seq, &qb);
        seq.step += 1;
        let cpu_before = seq.stats().cpu_tokens;
        assert!(cpu_before > 0);
        assert!(seq.stats().recall_blocks > 0);
        // Same query again: recalled blocks are resident now, so the CPU does nothing.
        run(&cfg, &mem, &mut seq, &qb);
        assert_eq!(seq.stats().cpu_tokens, cpu_before);
        assert!(seq.resident_blocks() <= 8);
    }

    /// Scout over `steps` steps of one layer, a new query each step from `query(step)`.
    fn scout_steps(
        cfg: &AttentionConfig,
        mem: &Mem,
        digests: &[HeadDigests],
        steps: u64,
        query: impl Fn(u64) -> Vec<f32>,
    ) -> SeqAttention {
        let mut seq = SeqAttention::new(mem.geom, 1, mem.n, digests.to_vec());
        for s in 0..steps {
            run(cfg, mem, &mut seq, &query(s));
            seq.step += 1;
        }
        seq
    }

    fn small_device(budget_tokens: usize) -> AttentionConfig {
        let mut cfg = AttentionConfig::scout(16);
        cfg.budget_tokens = budget_tokens;
        cfg.device_blocks_per_head = budget_tokens / 16;
        cfg
    }

    #[test]
    fn recall_backs_off_where_its_blocks_go_unused_and_returns_where_they_are_used() {
        let (mem, digests, _) = setup(1024, 1, 16, 21);
        let mut cfg = small_device(128);
        // A selection that moves on every step: most recalled blocks are not selected again.
        let wandering = |s: u64| values(1000 + s, 16, 1.0);
        cfg.recall_limits = RecallLimits::OFF;
        let unbounded = scout_steps(&cfg, &mem, &digests, 40, wandering);
        let u = unbounded.stats();
        assert!(
            u.recall_blocks > 40 && 2 * u.recall_used_blocks < u.recall_blocks,
            "the test must thrash: {u:?}"
        );
        cfg.recall_limits = RecallLimits::default();
        let mut seq = scout_steps(&cfg, &mem, &digests, 40, wandering);
        let b = *seq.stats();
        assert!(
            4 * b.recall_blocks < u.recall_blocks,
            "backoff: {b:?}, unbounded: {u:?}"
        );
        assert!(seq.layers[0].cooldown >= 8, "{}", seq.layers[0].cooldown);
        // The same query step after step: what a recall brings is used, and the wait shrinks.
        let before = seq.layers[0].cooldown;
        let steady = values(7, 16, 1.0);
        let base = seq.step;
        while seq.step < base + 200 && seq.layers[0].cooldown >= before {
            run(&cfg, &mem, &mut seq, &steady);
            seq.step += 1;
        }
        assert!(
            seq.layers[0].cooldown < before,
            "{}",
            seq.layers[0].cooldown
        );
        assert!(seq.stats().recall_used_blocks > b.recall_used_blocks);
    }

    #[test]
    fn recall_moves_at_most_its_byte_budget_and_still_moves_everything_in_time() {
        let (mem, digests, _) = setup(1024, 1, 16, 22);
        let mut cfg = small_device(128);
        let head_bytes = mem.geom.head_bytes() as u64;
        cfg.recall_limits.bytes_per_step = 2 * head_bytes;
        let mut seq = SeqAttention::new(mem.geom, 1, mem.n, digests);
        // Step 0 fills the device from query a; query b then leaves blocks on the CPU.
        let qa = values(30, 16, 1.0);
        run(&cfg, &mem, &mut seq, &qa);
        seq.step += 1;
        let qb: Vec<f32> = qa.iter().map(|x| -x).collect();
        let mut cpu_last = u64::MAX;
        for step in 1..=8u64 {
            let cpu_before = seq.stats().cpu_tokens;
            run(&cfg, &mem, &mut seq, &qb);
            seq.step += 1;
            cpu_last = seq.stats().cpu_tokens - cpu_before;
            // What a step moves averages out at the budget: steps 0..=step earned it.
            assert!(
                seq.stats().recall_bytes <= (step + 1) * 2 * head_bytes,
                "step {step}: {:?}",
                seq.stats()
            );
        }
        assert!(seq.stats().recall_blocks >= 4, "{:?}", seq.stats());
        assert_eq!(cpu_last, 0, "every selected block is resident in the end");
    }

    #[test]
    fn recall_takes_turns_across_heads_and_persisting_blocks_first() {
        let head = |prev_cpu: Vec<usize>| HeadState {
            digests: HeadDigests::new(8, 4),
            res: Residency::new(8),
            prev_cpu,
            sketch: None,
        };
        let heads = [head(vec![3, 7]), head(vec![])];
        let plan = |cpu: Vec<usize>| HeadPlan {
            device: vec![],
            cpu,
        };
        let plans = [plan(vec![1, 2, 3]), plan(vec![4, 5])];
        assert_eq!(
            recall_picks(&heads, &plans, 3, None),
            vec![vec![3, 1], vec![4]]
        );
        assert_eq!(
            recall_picks(&heads, &plans, 100, None),
            vec![vec![3, 1, 2], vec![4, 5]]
        );
        assert_eq!(
            recall_picks(&heads, &plans, 0, None),
            vec![Vec::<usize>::new(); 2]
        );
        // Every block of 8, where the device holds them all: the plan's first, then the rest
        // still on the host, the newest first (block 6 of head 1 is resident already).
        let mut heads = heads;
        assert!(heads[1].res.make_resident(6, 0, 8));
        assert_eq!(
            recall_picks(&heads, &plans, 9, Some(8)),
            vec![vec![3, 1, 2, 7, 6], vec![4, 5, 7, 3]]
        );
        assert_eq!(
            recall_picks(&heads, &plans, 100, Some(8)),
            vec![vec![3, 1, 2, 7, 6, 5, 4, 0], vec![4, 5, 7, 3, 2, 1, 0]]
        );
    }

    #[test]
    fn hgca_covers_window_on_device_and_rest_on_cpu() {
        let (mem, digests, _) = setup(320, 1, 8, 4);
        let mut cfg = AttentionConfig {
            mode: Mode::Hgca,
            ..AttentionConfig::scout(16)
        };
        cfg.budget_tokens = 128;
        let geom = BlockGeometry {
            block_size: 16,
            num_kv_heads: 1,
            head_dim: 8,
            dtype: KvDType::F32,
        };
        let mut seq = SeqAttention::new(geom, 1, 320, digests);
        let p = &seq.plan_layer(&cfg, 0, &values(3, 8, 1.0), keys(&mem))[0];
        assert_eq!(p.device, vec![0, 16, 17, 18, 19]);
        assert_eq!(p.cpu.len(), 3);
        assert!(p.cpu.iter().all(|b| (1..16).contains(b)));
    }

    #[test]
    fn recall_mode_attends_everything_on_the_device() {
        let (mem, digests, _) = setup(512, 1, 16, 9);
        let mut cfg = AttentionConfig {
            mode: Mode::Recall,
            ..AttentionConfig::scout(16)
        };
        cfg.budget_tokens = 128;
        cfg.device_blocks_per_head = 8;
        let mut seq = SeqAttention::new(mem.geom, 1, 512, digests);
        for s in 0..6u64 {
            run(&cfg, &mem, &mut seq, &values(100 + s, 16, 1.0));
            seq.step += 1;
        }
        assert_eq!(seq.stats().cpu_tokens, 0);
        assert!(seq.stats().recall_blocks > 0, "new selections were fetched");
        assert!(seq.resident_blocks() <= 8);
    }

    #[test]
    fn intervals_from_a_profile() {
        let h = vec![
            vec![0.0, 0.05, 0.1, 0.2, 0.3],
            vec![0.0, 0.5],
            vec![0.0, 0.0, 0.0],
        ];
        assert_eq!(recall_intervals(&h, 0.12), vec![2, 1, 2]);
    }
}
