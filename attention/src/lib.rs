//! ScoutAttention: GPU–CPU collaborative block-sparse decode attention.
//!
//! The pieces, bottom up:
//! - [`KvDType`] and [`BlockGeometry`]: how a KV block is laid out (per head, K transposed
//!   then V), shared with the host pool in `kv-transfer`.
//! - [`Digest`]: Quest's channel-wise min/max of post-RoPE K per block and head, and its score.
//! - [`BlockScorer`]: how blocks are ranked: by the digests' bound, or by an approximate
//!   attention over each query head's largest key channels (`sparq`), read from the host KV,
//!   or over every key quantized to 4 bits ([`sketch`], kept on a GPU).
//! - [`select_top_k`]: the budgeted block selection (sink and a local window always in); a
//!   GQA group scores a block by the sum or the max of its heads' bounds ([`GroupScore`]).
//! - [`attend_blocks`]: the CPU kernel (one KV head, its whole GQA group, online softmax in
//!   base 2), producing a [`Partial`]; [`Partial::merge_from`] merges partials exactly.
//! - [`SeqAttention`]: per-request digests and device residency; plans each layer into a
//!   device part and a CPU part according to [`AttentionConfig`] ([`Mode`]), and runs
//!   periodic recall. [`PredictionGuard`] says when `scout`'s layer-ahead prediction is not
//!   trusted (its query cosine with the real one is low, or the layer is among the first).
//!
//! ```
//! use attention::{AttentionConfig, BlockGeometry, KvDType, Partial};
//! let geom = BlockGeometry { block_size: 32, num_kv_heads: 8, head_dim: 128, dtype: KvDType::Bf16 };
//! assert_eq!(geom.block_bytes(), 8 * 2 * 32 * 128 * 2);
//! let cfg = AttentionConfig::scout(32);
//! assert_eq!(cfg.budget_blocks(32), 64);
//! let mut a = Partial::empty(4, 128);
//! a.merge_from(&Partial::empty(4, 128));
//! assert!(a.is_empty());
//! ```
//!
//! Architecture invariant: this crate never touches the network or a model's weights; it
//! is told queries and KV blocks and answers which blocks to attend where, and the result.
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]
#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(target_arch = "x86_64")]
pub mod avx2;
mod block;
#[cfg(feature = "cuda")]
pub mod cuda;
mod digest;
mod dtype;
#[cfg(target_arch = "x86_64")]
mod fold_avx2;
pub mod host_sketch;
mod kernel;
#[cfg(target_arch = "x86_64")]
mod kernel_amx;
#[cfg(target_arch = "x86_64")]
mod kernel_avx2;
#[cfg(target_arch = "x86_64")]
mod kernel_avx512;
#[cfg(target_arch = "x86_64")]
mod kernel_bf16;
#[cfg(target_arch = "aarch64")]
mod kernel_neon;
mod merge;
mod peak;
mod plan;
mod policy;
mod residency;
mod select;
mod sequence;
pub mod sketch;
mod sparq;

pub use block::{BlockGeometry, HeadBlock, Rows, WireTokens};
pub use digest::{Digest, GroupQuery, GroupScore, HeadDigests};
pub use dtype::{KvDType, decode_rows, decode_to_f32, encode_from_f32};
pub use kernel::{KernelPath, Scratch, attend_blocks, attend_blocks_on, force_kernel_path};
#[cfg(target_arch = "x86_64")]
pub use kernel_avx512::{avx512_enabled, avx512_factors};
pub use merge::Partial;
pub use peak::{amx_peak, bf16_dot_peak, fma_burst_on, fma_peak, fma_peak_on};
pub use policy::{AttentionConfig, BlockScorer, Mode, PredictionGuard, RecallLimits, RecallPolicy};
pub use residency::DeviceBlock;
pub use select::{TopCut, best_in, select_shared, select_spans, select_top_k};
pub use sequence::{
    BlockKeys, DevicePlan, HeadPlan, HeadQuery, KvSource, NotResident, SeqAttention, SeqStats,
    attend_head, cosine, recall_intervals,
};
pub use sparq::rows_read as sparq_rows_read;
