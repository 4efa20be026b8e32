//! KV transfer: the host KV block pool, ingest of pushed KV and the push client.
//!
//! - [`HostPool`]: fixed-size blocks allocated up front; [`Reservation`]s promise blocks and
//!   [`Block`]s own them, both freeing on drop.
//! - [`Ingest`]: the `PushKv` state machine (header → chunks → commit), strict about shape,
//!   range, CRC-32C and coverage, writing blocks in the attention kernels' layout and building
//!   digests as chunks arrive. A commit yields a [`CommittedKv`].
//! - [`Registry`]: request id → pushing / committed (under a lease) / awaited by a Generate.
//! - [`KvTransferService`]: the gRPC service; [`KvTransferRoute`] serves its `PushKv` straight
//!   from HTTP/2 frames ([`wire`]); [`client::push_kv`] the client side, likewise zero-copy.
//!
//! ```
//! use attention::{BlockGeometry, KvDType};
//! use kv_transfer::HostPool;
//! let geom = BlockGeometry { block_size: 32, num_kv_heads: 2, head_dim: 64, dtype: KvDType::F16 };
//! let pool = HostPool::new(geom, 1 << 20).unwrap();
//! let mut r = pool.reserve(2).unwrap();
//! let b = r.take().unwrap();
//! assert_eq!(b.bytes().len(), geom.block_bytes());
//! drop((b, r));
//! assert_eq!(pool.usage().used + pool.usage().reserved, 0);
//! ```
//!
//! Architecture invariant: this crate never decides what to attend; it stores and hands over.
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod client;
mod committed;
mod crc;
mod error;
mod group;
mod ingest;
mod metrics;
mod payload;
mod pool;
mod prefix;
mod registry;
mod route;
mod service;
pub mod wire;

pub use committed::CommittedKv;
pub use crc::crc32c;
pub use error::{Error, MAX_ECHO, clip, code_label};
pub use group::MAX_PUSH_STREAMS;
pub use ingest::{Ingest, MAX_REQUEST_ID_LEN, PromptInfo, validate_header};
pub use metrics::{CodeLabel, IngestMetrics, OutcomeLabel};
pub use payload::Payload;
pub use pool::{Block, HostPool, PoolUsage, Reclaimer, Reservation, map_huge};
pub use prefix::{CachedBlock, KvEvent, PrefixCache, PrefixUsage};
pub use registry::{Dropped, PushSlot, Registry, StopReason, StopSignal};
pub use route::KvTransferRoute;
pub use service::{ACK_EVERY_BYTES, KvTransferService, PushLimits, check_request_id};

use attention::BlockGeometry;

/// What a push must match: the node's model and KV layout.
#[derive(Debug, Clone, PartialEq)]
pub struct KvLayout {
    /// Fingerprint of the model config.
    pub model_id: String,
    /// Layers.
    pub num_layers: usize,
    /// Block shape and pool dtype.
    pub geom: BlockGeometry,
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// Prompt plus generated tokens at most.
    pub max_context: usize,
}

impl KvLayout {
    /// Largest encoded `KvHeader` a push may send: its token ids (at most 5 bytes each, a
    /// prompt shorter than the context) and its strings, with room for field tags. A bigger
    /// header is refused before it is decoded.
    pub fn max_header_bytes(&self) -> usize {
        4096 + self.model_id.len() + MAX_REQUEST_ID_LEN + 5 * self.max_context
    }
}
