//! Ingest metrics; `decode-node` registers them under its `decode_node_` prefix.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Label of `kv_ingest_errors_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    /// gRPC code in snake case (`invalid_argument`, …).
    pub code: String,
}

/// Label of `kv_push_ends_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// How the push ended (`committed`, `idle_timeout`, `deadline`, `dropped`, `cancelled`,
    /// `client_gone`, `refused`, `incomplete`, `stream_failed`: another stream of the same push
    /// failed).
    pub outcome: String,
}

/// Handles to the ingest metrics (cheap clones of shared counters).
#[derive(Debug, Clone)]
pub struct IngestMetrics {
    /// Payload bytes accepted.
    pub bytes: Counter,
    /// Chunks accepted.
    pub chunks: Counter,
    /// Pushes refused, by gRPC code.
    pub errors: Family<CodeLabel, Counter>,
    /// Seconds from header to commit of successful pushes.
    pub push_duration: Histogram,
    /// Committed KV freed because no Generate claimed it in time.
    pub leases_expired: Counter,
    /// Push streams ended, by how.
    pub ends: Family<OutcomeLabel, Counter>,
    /// Prompt tokens pushes did not send because the prefix cache held them.
    pub reused_tokens: Counter,
}

impl Default for IngestMetrics {
    fn default() -> Self {
        Self {
            bytes: Counter::default(),
            chunks: Counter::default(),
            errors: Family::default(),
            push_duration: Histogram::new([
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0,
            ]),
            leases_expired: Counter::default(),
            ends: Family::default(),
            reused_tokens: Counter::default(),
        }
    }
}

/// Every `outcome` of `kv_push_ends_total`, rendered from the start (at 0) so dashboards and
/// alerts see the series before the first push of each kind ends.
pub(crate) const PUSH_OUTCOMES: [&str; 9] = [
    "committed",
    "idle_timeout",
    "deadline",
    "dropped",
    "cancelled",
    "client_gone",
    "refused",
    "incomplete",
    "stream_failed",
];

impl IngestMetrics {
    /// Counts one refused push.
    pub fn error(&self, code: &str) {
        self.errors
            .get_or_create(&CodeLabel { code: code.into() })
            .inc();
    }

    /// Counts one push stream ended with `outcome`.
    pub fn push_end(&self, outcome: &str) {
        self.ends
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .inc();
    }

    /// Registers every metric (names without prefix; counters get `_total`).
    pub fn register(&self, r: &mut Registry) {
        for outcome in PUSH_OUTCOMES {
            let _ = self.ends.get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            });
        }
        r.register(
            "kv_ingest_bytes",
            "KV payload bytes accepted by PushKv",
            self.bytes.clone(),
        );
        r.register(
            "kv_ingest_chunks",
            "KV chunks accepted by PushKv",
            self.chunks.clone(),
        );
        r.register(
            "kv_ingest_errors",
            "PushKv streams refused, by gRPC code",
            self.errors.clone(),
        );
        r.register(
            "kv_push_duration_seconds",
            "Seconds from a push's header to its commit",
            self.push_duration.clone(),
        );
        r.register(
            "kv_leases_expired",
            "Committed KV freed because no Generate claimed it within the lease",
            self.leases_expired.clone(),
        );
        r.register(
            "kv_prefix_reused_tokens",
            "Prompt tokens pushes did not send because the node's prefix cache held them",
            self.reused_tokens.clone(),
        );
        r.register(
            "kv_push_ends",
            "PushKv streams ended, by outcome (committed, idle_timeout, deadline, dropped, cancelled, client_gone, refused, incomplete, stream_failed)",
            self.ends.clone(),
        );
    }
}
