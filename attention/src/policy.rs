//! What the attention engine is asked to do: mode, budget, ablations and recall policy.

use crate::digest::GroupScore;

/// How attention is split between the device and the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// All KV on the device, dense attention: the reference.
    Full,
    /// HGCA-like: a dense recent window (and the sink) on the device, top-k sparse attention
    /// over the rest on the CPU, in parallel, no layer-ahead.
    Hgca,
    /// InfiniGen-like: selected blocks that are not resident are fetched to the device before
    /// attention; the CPU never attends.
    Recall,
    /// ScoutAttention: selected ∩ resident on the device, the rest of the top-k on the CPU
    /// (layer-ahead with the predicted query), periodic recall.
    Scout,
}

impl Mode {
    /// Parses `full`, `hgca`, `recall` or `scout`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "full" => Some(Mode::Full),
            "hgca" => Some(Mode::Hgca),
            "recall" => Some(Mode::Recall),
            "scout" => Some(Mode::Scout),
            _ => None,
        }
    }

    /// The name `parse` accepts.
    pub const fn name(self) -> &'static str {
        match self {
            Mode::Full => "full",
            Mode::Hgca => "hgca",
            Mode::Recall => "recall",
            Mode::Scout => "scout",
        }
    }
}

/// When the blocks the CPU has been attending are copied to the device.
#[derive(Debug, Clone, PartialEq)]
pub enum RecallPolicy {
    /// Never.
    Off,
    /// Every `n` steps for layer `i` (`intervals[i]`, 0 = never), from an offline profile.
    Intervals(Vec<u32>),
    /// Whenever a layer's CPU share of selected tokens passes `threshold` (0..1).
    Adaptive {
        /// CPU share above which the layer recalls.
        threshold: f32,
    },
}

/// How much recall may move, and when a layer backs off (`scout`).
///
/// Unbounded, recall re-queues every CPU block of a layer whose CPU share passed the
/// threshold: at a high share that is most of the budget per layer and step, and when the
/// selection moves on, the blocks it brought in are not used before they are evicted again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RecallLimits {
    /// Bytes one sequence may recall per decode step over all its layers (0: no limit). Each
    /// layer earns its share every step and may save up a few steps of it, so a small budget
    /// moves a layer's blocks over several steps rather than never.
    pub bytes_per_step: u64,
    /// A layer fewer than `min_used` of whose recalled blocks were selected at its next step
    /// waits twice as long before its next recall (up to [`RecallLimits::MAX_COOLDOWN`]
    /// steps); one whose recall paid off waits half as long again (down to every step).
    /// 0: no backoff.
    pub min_used: f32,
}

impl RecallLimits {
    /// The longest a layer waits between recalls under backoff, in steps.
    pub const MAX_COOLDOWN: u32 = 64;
    /// Steps of its byte share a layer may save up.
    pub const SAVED_STEPS: u64 = 4;
    /// No limit, no backoff: the paper's behaviour.
    pub const OFF: Self = Self {
        bytes_per_step: 0,
        min_used: 0.0,
    };
}

impl Default for RecallLimits {
    /// 64 MiB per step (a few milliseconds of PCIe per token, next to a step of tens of
    /// milliseconds at long context), backoff on.
    fn default() -> Self {
        Self {
            bytes_per_step: 64 << 20,
            min_used: 0.5,
        }
    }
}

/// Configuration of the attention engine, shared by every sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionConfig {
    /// Split policy.
    pub mode: Mode,
    /// Tokens attended per (layer, KV head) in sparse modes.
    pub budget_tokens: usize,
    /// Start the CPU part of layer i+1 during layer i from a predicted query (`scout`).
    pub precompute: bool,
    /// Periodic recall (`scout`).
    pub recall: RecallPolicy,
    /// Bounds on what recall moves (`scout`).
    pub recall_limits: RecallLimits,
    /// Redo every layer's selection (and a CPU part started ahead) with the real query, so
    /// any budget equals a plain block top-k.
    pub exact: bool,
    /// Device-resident blocks allowed per (sequence, layer, KV head) in sparse modes.
    pub device_blocks_per_head: usize,
    /// Record each layer's CPU share at every step (for `bench recall-profile`).
    pub profile: bool,
    /// When the layer-ahead prediction is not trusted (`scout`).
    pub guard: PredictionGuard,
    /// How a GQA group's heads combine into one block score.
    pub group_score: GroupScore,
    /// Newest tokens always selected (whole blocks; at least the newest block).
    pub local_window_tokens: usize,
    /// Each block chosen by score brings the block after it (at the same budget), so a span
    /// that crosses a block boundary stays whole.
    pub select_spans: bool,
    /// The first layers attend every block in sparse modes (device part over resident
    /// blocks, CPU part over the rest): their attention is broad, not sparse, so a top-k
    /// there costs most of the accuracy (Quest leaves its first two layers dense too).
    pub dense_layers: usize,
    /// How blocks are ranked for selection.
    pub scorer: BlockScorer,
    /// The KV heads of a layer share its budget: past each head's sink and window, the
    /// blocks of any head with the largest share of their head's attention.
    pub shared_budget: bool,
}

/// How sparse modes rank a (layer, KV head)'s blocks for selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockScorer {
    /// Quest's upper bound from the block digests (channel min/max): reads digests only.
    Quest,
    /// Each block's share of an approximate attention whose scores use every key but only
    /// each query head's `channels` largest channels (SparQ): reads that share of the keys.
    Sparq {
        /// Channels kept per query head (clamped to the head dimension).
        channels: usize,
        /// Blocks scored, as a multiple of the budget: the best by the digests' bound (0:
        /// every block). Bounds the keys read per step by the budget, not the context.
        candidates: usize,
    },
    /// Each block's share of an approximate attention over every key quantized to 4 bits
    /// per channel (`crate::sketch`), every block scored. A GPU keeps the sketch (an eighth
    /// of a 16-bit KV cache) and scores on the device; a CPU node keeps it in host pool
    /// blocks ([`crate::SeqAttention::keep_sketch`]); without either it quantizes every
    /// key it scores.
    Sketch,
}

impl BlockScorer {
    /// Parses `quest`, `sparq` (with `channels` and `candidates`) or `sketch`.
    pub fn parse(s: &str, channels: usize, candidates: usize) -> Option<Self> {
        match s {
            "quest" => Some(Self::Quest),
            "sketch" => Some(Self::Sketch),
            "sparq" => Some(Self::Sparq {
                channels,
                candidates,
            }),
            _ => None,
        }
    }

    /// The name [`BlockScorer::parse`] takes.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Quest => "quest",
            Self::Sparq { .. } => "sparq",
            Self::Sketch => "sketch",
        }
    }
}

/// The accuracy guard of layer-ahead pre-computation.
///
/// The real query of a layer is computed anyway, so how far the prediction was off is known
/// before its selection is used: a layer whose prediction is poor redoes its selection with the
/// real query, on the critical path. By default the CPU part is attended with the real query
/// in any case ([`PredictionGuard::predicted_cpu`]); the prediction only chooses blocks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PredictionGuard {
    /// A layer whose predicted query has a cosine below this with the real one (the lowest
    /// over its KV heads' query groups) has its selection (and a CPU part started ahead)
    /// redone with the real query. At or below -1 the guard is off.
    pub min_cosine: f32,
    /// The first layers attend with the real query from the start: their inputs change most
    /// across a layer, so the prediction is poor there (cosine 0.5-0.75 on SmolLM2's layers
    /// 1-2) and would only be redone.
    pub real_query_layers: usize,
    /// A prediction the guard accepts still leaves the device part to the real query: the
    /// device attends the resident blocks that rank best by the real query, in the budget
    /// the layer-ahead CPU part leaves. Only the CPU part's blocks stay predicted.
    pub device_real_query: bool,
    /// A prediction the guard accepts has its CPU part attended a layer ahead with the
    /// predicted query (the paper's behaviour). Off, the prediction only chooses the blocks:
    /// the CPU part is attended with the real query once it is known, alongside the device
    /// part. On SmolLM2-135M (3.8k tokens, budget 512, teacher-forced) the predicted query's
    /// CPU part cost 7.4 points of top-1 agreement with full, the predicted selection 1.2.
    pub predicted_cpu: bool,
}

impl PredictionGuard {
    /// Guard off: every prediction is used (the paper's behaviour).
    pub const OFF: Self = Self {
        min_cosine: -1.0,
        real_query_layers: 1,
        device_real_query: false,
        predicted_cpu: true,
    };

    /// Whether a layer predicted with `cosine` must be redone with the real query.
    pub fn rejects(&self, cosine: f32) -> bool {
        // NaN (a zero query) is rejected too while the guard is on: nothing says the
        // prediction is good.
        self.min_cosine > -1.0 && (cosine.is_nan() || cosine < self.min_cosine)
    }
}

impl Default for PredictionGuard {
    /// Redo below 0.95. On SmolLM2-135M (`bench fidelity`, 256 teacher-forced positions, block
    /// 32, the CPU part by the real query): at 3.8k tokens and budget 512, 0.95 redoes 29% of
    /// layer selections and keeps 0.816 top-1 agreement with full, 0.98 redoes 88% and keeps
    /// 0.832, the real-query top-k's; at 7.8k and budget 1024, 0.938 and 0.953.
    fn default() -> Self {
        Self {
            min_cosine: 0.95,
            real_query_layers: 3,
            device_real_query: true,
            predicted_cpu: false,
        }
    }
}

impl AttentionConfig {
    /// The defaults of the paper: budget 2048 tokens, layer-ahead on, adaptive recall at 12%.
    pub fn scout(block_size: usize) -> Self {
        let budget_tokens = 2048;
        Self {
            mode: Mode::Scout,
            budget_tokens,
            precompute: true,
            recall: RecallPolicy::Adaptive { threshold: 0.12 },
            recall_limits: RecallLimits::default(),
            exact: false,
            profile: false,
            guard: PredictionGuard::default(),
            group_score: GroupScore::Max,
            local_window_tokens: 0,
            select_spans: false,
            dense_layers: 0,
            scorer: BlockScorer::Quest,
            shared_budget: false,
            device_blocks_per_head: budget_tokens.div_ceil(block_size),
        }
    }

    /// Device-resident blocks one (sequence, layer, KV head) may hold: everything in `full`,
    /// `device_blocks_per_head` (at least the sink and the newest block) otherwise.
    pub fn resident_blocks_per_head(&self) -> usize {
        match self.mode {
            Mode::Full => usize::MAX,
            _ => self.device_blocks_per_head.max(2),
        }
    }

    /// Newest blocks always selected (at least 1).
    pub fn local_blocks(&self, block_size: usize) -> usize {
        self.local_window_tokens.div_ceil(block_size.max(1)).max(1)
    }

    /// Budget in blocks (at least the sink and the newest block).
    pub fn budget_blocks(&self, block_size: usize) -> usize {
        self.budget_tokens.div_ceil(block_size).max(2)
    }
}
