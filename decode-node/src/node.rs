//! Builds what every model-running command shares: backend, model, layout, attention config.

use std::sync::Arc;

use anyhow::{Context, bail};
use attention::{
    AttentionConfig, BlockGeometry, BlockScorer, GroupScore, KvDType, Mode, PredictionGuard,
    RecallLimits, RecallPolicy,
};
use decode_node_proto::v1 as pb;
use kv_transfer::KvLayout;

use crate::backend::{Backend, CpuBackend};
use crate::cli::ModelArgs;
use crate::model::{self, LoadedModel};

/// The backend named by `--device`.
pub fn backend(device: &str) -> anyhow::Result<Arc<dyn Backend>> {
    match device {
        "cpu" => Ok(Arc::new(CpuBackend)),
        d if d == "cuda" || d.starts_with("cuda:") => cuda_backend(d),
        d => bail!("--device {d:?}: expected cpu, cuda or cuda:N"),
    }
}

/// The ordinal of `cuda` (0) or `cuda:N`.
pub fn cuda_ordinal(d: &str) -> anyhow::Result<usize> {
    match d.strip_prefix("cuda:") {
        Some(n) => n
            .parse()
            .with_context(|| format!("--device {d}: bad device ordinal")),
        None if d == "cuda" => Ok(0),
        None => bail!("--device {d:?}: expected cuda or cuda:N"),
    }
}

#[cfg(feature = "cuda")]
fn cuda_backend(d: &str) -> anyhow::Result<Arc<dyn Backend>> {
    let b = crate::backend::cuda::CudaBackend::new(cuda_ordinal(d)?)
        .with_context(|| format!("--device {d}"))?;
    Ok(Arc::new(b))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(d: &str) -> anyhow::Result<Arc<dyn Backend>> {
    cuda_ordinal(d)?;
    bail!(
        "--device {d}: this binary was built without CUDA support; rebuild with `--features cuda`"
    )
}

/// A model with everything derived from the flags.
#[derive(Debug)]
pub struct Node {
    /// The model and tokenizer.
    pub model: Arc<LoadedModel>,
    /// What pushes must match.
    pub layout: KvLayout,
    /// Attention policy.
    pub attention: AttentionConfig,
}

/// Reads `{"intervals": [..]}` (one per layer) as written by `bench recall-profile`.
fn read_intervals(path: &std::path::Path, layers: usize) -> anyhow::Result<Vec<u32>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let iv: Vec<u32> = v
        .get("intervals")
        .and_then(|x| x.as_array())
        .with_context(|| format!("{}: no \"intervals\" array", path.display()))?
        .iter()
        .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect::<Option<_>>()
        .with_context(|| {
            format!(
                "{}: intervals must be non-negative integers",
                path.display()
            )
        })?;
    anyhow::ensure!(
        iv.len() == layers,
        "{}: {} intervals for a model of {layers} layers",
        path.display(),
        iv.len()
    );
    Ok(iv)
}

/// The attention settings `args` ask for, for KV of `geom` in a model of `num_layers` layers
/// with `group` query heads per KV head.
pub(crate) fn attention_config(
    args: &ModelArgs,
    geom: BlockGeometry,
    num_layers: usize,
    group: usize,
) -> anyhow::Result<AttentionConfig> {
    let mode = Mode::parse(&args.attention)
        .with_context(|| format!("--attention {:?}", args.attention))?;
    if !(0.0..=1.0).contains(&args.recall_threshold) {
        bail!("--recall-threshold must be within [0, 1]");
    }
    if !(0.0..=1.0).contains(&args.recall_min_used) {
        bail!("--recall-min-used must be within [0, 1]");
    }
    if !(-1.0..=1.0).contains(&args.guard_min_cosine) {
        bail!("--guard-min-cosine must be within [-1, 1]");
    }
    let block_size = geom.block_size;
    let budget_tokens = (args.budget_tokens as usize).max(2 * block_size);
    let mut cfg = AttentionConfig {
        mode,
        budget_tokens,
        precompute: !args.no_precompute
            && match args.layer_ahead.as_str() {
                "on" => true,
                "off" => false,
                _ => args.device.starts_with("cuda"),
            },
        recall: match (&args.recall_profile, args.no_recall) {
            (_, true) => RecallPolicy::Off,
            (Some(path), false) => RecallPolicy::Intervals(read_intervals(path, num_layers)?),
            (None, false) => RecallPolicy::Adaptive {
                threshold: args.recall_threshold,
            },
        },
        recall_limits: RecallLimits {
            bytes_per_step: args
                .recall_budget_mib
                .checked_mul(1 << 20)
                .context("--recall-budget-mib is too large")?,
            min_used: args.recall_min_used,
        },
        exact: args.exact,
        profile: false,
        guard: if args.no_guard {
            PredictionGuard::OFF
        } else {
            PredictionGuard {
                min_cosine: args.guard_min_cosine,
                real_query_layers: (args.guard_real_query_layers as usize).max(1),
                device_real_query: !args.guard_predicted_device,
                predicted_cpu: args.guard_predicted_cpu,
            }
        },
        group_score: GroupScore::parse(&args.group_score)
            .with_context(|| format!("--group-score {:?}", args.group_score))?,
        local_window_tokens: args.local_window as usize,
        select_spans: args.select_spans,
        dense_layers: args.dense_layers as usize,
        scorer: BlockScorer::parse(
            scorer_for(&args.block_scorer, &args.device, geom.head_dim, group),
            match args.scorer_channels {
                0 => (geom.head_dim / 4).max(1),
                n => n as usize,
            },
            args.scorer_candidates as usize,
        )
        .with_context(|| format!("--block-scorer {:?}", args.block_scorer))?,
        shared_budget: false,
        device_blocks_per_head: device_blocks_per_head(
            args.device_blocks,
            budget_tokens,
            block_size,
        ),
    };
    // Quest's bounds are not shares of a head's attention: no common scale across heads.
    cfg.shared_budget = args.budget_split == "layer" && cfg.scorer != BlockScorer::Quest;
    Ok(cfg)
}

/// Device-resident blocks a (sequence, layer, KV head) may hold at a budget of
/// `budget_tokens` in blocks of `block_size`: `--device-blocks` (`arg`), where 0 is
/// [`DEVICE_BLOCKS_PER_BUDGET`] times the budget's blocks.
pub(crate) fn device_blocks_per_head(arg: u32, budget_tokens: usize, block_size: usize) -> usize {
    match arg {
        0 => DEVICE_BLOCKS_PER_BUDGET * budget_tokens.div_ceil(block_size.max(1)),
        n => n as usize,
    }
}

/// Device-resident blocks per budget block by default. Where the selection moves, a device
/// that holds only the budget's blocks misses what it dropped a few steps before; with room
/// for twice as many, SmolLM2-135M at 7.8k tokens (real text, `bench fidelity`, scout,
/// recall at its 12% threshold) sent 0.106 of the selected tokens to the CPU where the budget
/// alone sent 0.297 (budget 2048), with the same attention (KL from full 0.0015 both).
/// Admission reserves them, so a request's device memory doubles (Qwen3-14B at a 2048
/// budget: 671 MB), still a small share of its KV at long contexts (10.7 GB at 64k).
pub(crate) const DEVICE_BLOCKS_PER_BUDGET: usize = 2;

/// The block scorer `--block-scorer` names on `device` for heads of `head_dim` in groups of
/// `group`: `auto` is the sketch on the CPU (kept in host pool blocks: on SmolLM2-135M at
/// 7.8k tokens, budget 1024, as fast as sparq and half its KL divergence from full
/// attention) and on a GPU whose kernels take the shape (it scores there, reading no host
/// KV); sparq on a GPU that cannot, where host selection sits on the step's critical path
/// and sparq's cost follows the budget rather than the context.
fn scorer_for<'a>(flag: &'a str, device: &str, head_dim: usize, group: usize) -> &'a str {
    match flag {
        "auto" if !device.starts_with("cuda") || crate::backend::sketch_fits(head_dim, group) => {
            "sketch"
        }
        "auto" => "sparq",
        f => f,
    }
}

/// Dtype of the host pool: `--kv-dtype`, or the model's.
pub(crate) fn kv_dtype(flag: &str, torch_dtype: &str) -> anyhow::Result<KvDType> {
    if flag == "auto" {
        return Ok(KvDType::parse(torch_dtype)
            .filter(|d| !d.scaled())
            .unwrap_or(KvDType::F32));
    }
    KvDType::parse(flag)
        .with_context(|| format!("--kv-dtype {flag:?}: expected auto, f32, f16, bf16, int8 or fp8"))
}

impl Node {
    /// Loads the model and derives the layout and attention settings.
    pub fn build(args: &ModelArgs) -> anyhow::Result<Self> {
        let backend = backend(&args.device)?;
        let model = model::load(&args.model, backend)
            .with_context(|| format!("loading model {:?}", args.model))?;
        Self::of(args, Arc::new(model))
    }

    /// The layout and attention settings `args` give `model`, loaded already (by `args` too:
    /// a node that serves it, say).
    pub fn of(args: &ModelArgs, model: Arc<LoadedModel>) -> anyhow::Result<Self> {
        let cfg = &model.model.cfg;
        if let Some(w) = cfg
            .sliding_window
            .filter(|w| *w < cfg.max_position_embeddings)
        {
            tracing::warn!(
                window = w,
                "sliding-window attention is not implemented: contexts are capped at the window"
            );
        }
        let dtype = kv_dtype(&args.kv_dtype, &cfg.torch_dtype)?;
        let block_size = args.block_size as usize;
        let geom = BlockGeometry {
            block_size,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            dtype,
        };
        let layout = KvLayout {
            model_id: model.model.model_id.clone(),
            num_layers: cfg.num_layers,
            geom,
            vocab_size: cfg.vocab_size,
            max_context: cfg.max_context(),
        };
        let group = cfg.num_heads / cfg.num_kv_heads.max(1);
        let attention = attention_config(args, geom, cfg.num_layers, group)?;
        Ok(Self {
            model,
            layout,
            attention,
        })
    }

    /// The dtype pushes should send (`ModelInfo.kv_dtype`): the pool's, or for an int8 or fp8
    /// pool (never on the wire) the model's own float dtype, converted on ingest.
    pub fn wire_dtype(&self) -> KvDType {
        match self.layout.geom.dtype {
            KvDType::I8 | KvDType::F8E4M3 => {
                match KvDType::parse(&self.model.model.cfg.torch_dtype) {
                    Some(d @ (KvDType::F32 | KvDType::Bf16)) => d,
                    _ => KvDType::F16,
                }
            }
            d => d,
        }
    }

    /// `GetModelInfo`'s answer.
    pub fn info(&self) -> pb::ModelInfo {
        let c = &self.model.model.cfg;
        pb::ModelInfo {
            model_id: self.layout.model_id.clone(),
            num_layers: c.num_layers as u32,
            num_kv_heads: c.num_kv_heads as u32,
            head_dim: c.head_dim as u32,
            kv_dtype: match self.wire_dtype() {
                KvDType::F32 => pb::DType::DtypeF32,
                KvDType::Bf16 => pb::DType::DtypeBf16,
                KvDType::F16 | KvDType::I8 | KvDType::F8E4M3 => pb::DType::DtypeF16,
            } as i32,
            block_size: self.layout.geom.block_size as u32,
            vocab_size: c.vocab_size as u32,
            eos_token_ids: c.eos_token_ids.clone(),
            max_context: c.max_context() as u32,
            architecture: c.arch.model_type().into(),
            num_attention_heads: c.num_heads as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The attention config `flags` give SmolLM2's shape (30 layers, 3 KV heads of 64 in
    /// groups of 3, 32-token blocks).
    fn config_of(flags: &[&str]) -> AttentionConfig {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Args {
            #[command(flatten)]
            model: ModelArgs,
        }
        let geom = BlockGeometry {
            block_size: 32,
            num_kv_heads: 3,
            head_dim: 64,
            dtype: KvDType::Bf16,
        };
        let args = Args::parse_from(["t"].iter().chain(flags));
        attention_config(&args.model, geom, 30, 3).unwrap()
    }

    #[test]
    fn heads_share_a_layers_budget_by_default_where_scores_are_shares() {
        let shared = |flags: &[&str]| config_of(flags).shared_budget;
        assert!(shared(&[]));
        assert!(shared(&["--block-scorer", "sparq"]));
        assert!(!shared(&["--budget-split", "head"]));
        // Quest's bounds have no common scale across heads.
        assert!(!shared(&["--block-scorer", "quest"]));
        assert!(!shared(&[
            "--budget-split",
            "layer",
            "--block-scorer",
            "quest"
        ]));
    }

    #[test]
    fn the_device_holds_twice_the_budgets_blocks_unless_told() {
        let blocks = |flags: &[&str]| config_of(flags).resident_blocks_per_head();
        assert_eq!(blocks(&[]), 2 * 2048 / 32);
        assert_eq!(blocks(&["--budget-tokens", "1000"]), 2 * 32);
        assert_eq!(
            blocks(&["--budget-tokens", "1024", "--device-blocks", "40"]),
            40
        );
        assert_eq!(device_blocks_per_head(0, 512, 16), 64);
        assert_eq!(device_blocks_per_head(7, 512, 16), 7);
    }

    #[test]
    fn auto_scores_with_the_sketch_on_the_cpu_and_on_a_gpu_that_takes_the_shape() {
        let table = [
            // (flag, device, head_dim, group) -> scorer
            (("auto", "cuda", 128, 5), "sketch"),
            (("auto", "cuda:1", 64, 8), "sketch"),
            (("auto", "cpu", 128, 5), "sketch"),
            (("auto", "cpu", 80, 12), "sketch"),
            // Shapes the device kernels do not take: sparq.
            (("auto", "cuda", 80, 4), "sparq"),
            (("auto", "cuda", 256, 4), "sparq"),
            (("auto", "cuda", 128, 10), "sparq"),
            // A named scorer is kept wherever.
            (("sketch", "cpu", 96, 4), "sketch"),
            (("quest", "cuda", 128, 5), "quest"),
        ];
        for ((flag, device, d, g), want) in table {
            assert_eq!(
                scorer_for(flag, device, d, g),
                want,
                "{flag} {device} {d} {g}"
            );
        }
    }
}
