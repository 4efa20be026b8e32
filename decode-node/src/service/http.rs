//! `/metrics`, `/live` and `/health` on the metrics port.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use kv_transfer::HostPool;

use crate::engine::Engine;
use crate::metrics::Metrics;

#[derive(Clone)]
pub(crate) struct HttpState {
    pub(crate) metrics: Metrics,
    pub(crate) serving: Arc<AtomicBool>,
    pub(crate) pool: HostPool,
    pub(crate) engine: Engine,
    pub(crate) prefix_cache: Option<Arc<kv_transfer::PrefixCache>>,
}

async fn metrics(
    axum::extract::State(s): axum::extract::State<HttpState>,
    headers: axum::http::HeaderMap,
) -> impl IntoResponse {
    let u = s.pool.usage();
    // Idle cached blocks are their own state: free for admission, but holding KV.
    let cached = super::decode::cached_idle(&s.prefix_cache);
    let u = kv_transfer::PoolUsage {
        used: u.used.saturating_sub(cached),
        ..u
    };
    Metrics::set_bytes(&s.metrics.host_kv_bytes, "cached", cached);
    Metrics::set_bytes(&s.metrics.host_kv_bytes, "used", u.used);
    Metrics::set_bytes(&s.metrics.host_kv_bytes, "reserved", u.reserved);
    Metrics::set_bytes(&s.metrics.host_kv_bytes, "capacity", u.capacity);
    let load = s.engine.load();
    Metrics::set_bytes(&s.metrics.device_kv_bytes, "used", load.device_bytes);
    Metrics::set_bytes(&s.metrics.device_kv_bytes, "capacity", load.device_capacity);
    Metrics::set_bytes(&s.metrics.device_kv_bytes, "lent", load.device_lent);
    let fraction = |used: u64, cap: u64| {
        if cap > 0 {
            used as f64 / cap as f64
        } else {
            0.0
        }
    };
    // Device KV on loan is not counted: it goes back as soon as a request needs the room, so
    // a lending node is not full to a router.
    s.metrics
        .kv_cache_usage
        .set(fraction(u.used + u.reserved, u.capacity).max(fraction(
            load.device_bytes - load.device_lent,
            load.device_capacity,
        )));
    // OpenMetrics to a scraper that asks for it (Prometheus does, first), the classic text
    // format to everything else.
    let open = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    if open {
        (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            s.metrics.render(),
        )
    } else {
        (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            s.metrics.render_text(),
        )
    }
}

async fn health(axum::extract::State(s): axum::extract::State<HttpState>) -> impl IntoResponse {
    if s.serving.load(Ordering::Acquire) {
        (StatusCode::OK, "serving\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not serving\n")
    }
}

pub(crate) fn router(state: HttpState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/live", get(|| async { "live\n" }))
        .route("/health", get(health))
        .with_state(state)
}
