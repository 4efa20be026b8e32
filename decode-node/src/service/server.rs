//! `serve`: wires pool, registry, engine and services, and drains on shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use decode_node_proto::v1::decode_server::DecodeServer;
use decode_node_proto::v1::kv_transfer_server::KvTransferServer;
use kv_transfer::{
    HostPool, KvTransferRoute, KvTransferService, PrefixCache, PushLimits, Registry,
};
use tokio::sync::oneshot;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use tonic_health::ServingStatus;

use super::auth::{BearerCheck, Role, Tokens};
use super::decode::{DecodeService, NodeState};
use super::http::{HttpState, router};
use crate::cli::ServeArgs;
use crate::engine::{Control, Engine, EngineConfig};
use crate::metrics::{Metrics, ModelInfoLabels};
use crate::node::Node;

/// Largest `--max-push-message` (tonic and HTTP/2 framing use u32 lengths).
pub const MAX_PUSH_MESSAGE_LIMIT: u64 = 1 << 30;
/// Largest gRPC message accepted by Decode.
pub const MAX_DECODE_MESSAGE: usize = 1 << 20;

/// Where the node listens, once it does.
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    /// gRPC.
    pub grpc: SocketAddr,
    /// Metrics and probes.
    pub metrics: SocketAddr,
}

/// What `serve` reports once it listens: where, and the model it serves (benches read its
/// weight bytes and its device's bandwidth rather than load it a second time).
#[derive(Debug, Clone)]
pub struct Ready {
    /// Where it listens.
    pub bound: Bound,
    /// The model it serves.
    pub model: Arc<crate::model::LoadedModel>,
}

fn read(path: &std::path::Path, what: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {what} {}", path.display()))
}

/// Runs the node until `shutdown` resolves, then drains: refuses new work, lets running
/// requests finish up to `--drain-timeout`, cancels the rest and returns.
pub async fn serve(
    args: ServeArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
    ready: Option<oneshot::Sender<Ready>>,
) -> anyhow::Result<()> {
    let node = Node::build(&args.model)?;
    let tokens = match &args.auth_token_file {
        Some(p) => {
            let t = String::from_utf8(read(p, "auth token file")?)
                .context("auth token file is not UTF-8")?;
            Some(Tokens::parse(&t).with_context(|| format!("auth token file {}", p.display()))?)
        }
        None => None,
    };
    let metrics = Metrics::new();
    let served_model_name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| node.layout.model_id.clone());
    metrics
        .model_info
        .get_or_create(&ModelInfoLabels {
            model_id: node.layout.model_id.clone(),
            served_model_name: served_model_name.clone(),
            attention: node.attention.mode.name().to_string(),
            device: node.model.model.backend().name(),
        })
        .set(1);
    let pool = HostPool::with_prefault(node.layout.geom, args.host_kv_bytes, args.host_kv_prefault)
        .context("host KV pool")?;
    anyhow::ensure!(
        pool.num_blocks() > 0,
        "--host-kv-bytes {} holds no KV block of {} bytes",
        args.host_kv_bytes,
        node.layout.geom.block_bytes()
    );
    let prefix_cache = (args.prefix_cache_bytes > 0).then(|| {
        PrefixCache::new(
            &pool,
            &node.layout.model_id,
            node.layout.num_layers,
            args.prefix_cache_bytes,
        )
    });
    let registry = Registry::new(
        Duration::from_secs_f64(args.kv_lease.max(0.0)),
        metrics.ingest.clone(),
    )
    .with_require_lease(args.require_lease);
    let sweeper = registry.spawn_lease_sweeper(Duration::from_millis(250));
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (engine, engine_thread) = Engine::start(
        node.model.clone(),
        pool.clone(),
        EngineConfig {
            attention: node.attention.clone(),
            max_batch: args.max_batch.max(1) as usize,
            device_kv_bytes: args.device_kv_bytes,
            queue_timeout: Duration::from_secs(60),
            cpu_threads: match args.cpu_attention_threads {
                0 => default_cpu_threads(
                    cpus,
                    node.model.model.backend().parallel_on_rayon(),
                    node.attention.scorer == attention::BlockScorer::Sketch,
                ),
                n => n.min(1024),
            },
            prefix_cache: prefix_cache.clone(),
            lend_spare_device: args.model.spare_device_kv == "on",
        },
        metrics.clone(),
    )
    .context("starting the engine")?;
    let state = NodeState {
        registry: registry.clone(),
        pool: pool.clone(),
        engine: engine.clone(),
        info: node.info(),
        prefix_cache: prefix_cache.clone(),
        active: Arc::default(),
    };

    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<DecodeServer<DecodeService>>().await;
    health
        .set_serving::<KvTransferServer<KvTransferService>>()
        .await;
    health.set_service_status("", ServingStatus::Serving).await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(decode_node_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("gRPC reflection")?;

    anyhow::ensure!(
        (1 << 10..=MAX_PUSH_MESSAGE_LIMIT).contains(&args.max_push_message),
        "--max-push-message {} is outside 1 KiB..=1 GiB",
        args.max_push_message
    );
    let max_push_message = args.max_push_message as usize;
    let auth = BearerCheck::new(tokens);
    let kv = KvTransferService::new(node.layout.clone(), pool.clone(), registry.clone())
        .with_limits(PushLimits {
            idle: Duration::from_secs_f64(args.push_idle_timeout),
            deadline: Duration::from_secs_f64(args.push_deadline),
            max_streams: args.max_push_streams as usize,
        });
    let kv = match &prefix_cache {
        Some(c) => kv.with_prefix_cache(c.clone()),
        None => kv,
    };
    // PushKv is served from the HTTP/2 frames without joining them; DropKv by tonic.
    let kv_svc = tonic::service::interceptor::InterceptedService::new(
        KvTransferRoute::new(
            kv.clone(),
            KvTransferServer::new(kv).max_decoding_message_size(max_push_message),
            max_push_message,
        ),
        auth.for_role(Role::Push),
    );
    let decode_svc = tonic::service::interceptor::InterceptedService::new(
        DecodeServer::new(DecodeService::new(state.clone()))
            .max_decoding_message_size(MAX_DECODE_MESSAGE),
        auth.for_role(Role::Generate),
    );
    let reflection = tonic::service::interceptor::InterceptedService::new(reflection, auth);

    let mut builder = Server::builder()
        .initial_stream_window_size(Some(16 << 20))
        .initial_connection_window_size(Some(64 << 20))
        // Large frames: KV chunks are megabytes, and per-frame overhead dominated at 16 KiB.
        .max_frame_size(Some(1 << 20))
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        // A peer that stops answering pings is dropped with all it holds.
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        // Rapid-reset floods: streams a client opens and resets before we accept them, and
        // streams we must reset for its errors, end the connection (GOAWAY) past these.
        .http2_max_pending_accept_reset_streams(Some(32))
        .http2_max_local_error_reset_streams(Some(256))
        .max_concurrent_streams(Some(256))
        .http2_max_header_list_size(Some(64 << 10));
    if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
        let mut tls = ServerTlsConfig::new()
            .identity(Identity::from_pem(
                read(cert, "TLS certificate")?,
                read(key, "TLS key")?,
            ))
            .timeout(Duration::from_secs_f64(args.tls_handshake_timeout));
        if let Some(ca) = &args.tls_client_ca {
            tls = tls.client_ca_root(Certificate::from_pem(read(ca, "client CA")?));
        }
        builder = builder.tls_config(tls).context("TLS configuration")?;
    }

    // Nodelay must be set on the incoming stream: it is ignored on a pre-bound listener.
    let incoming = TcpIncoming::bind(args.grpc_addr)
        .map_err(|e| anyhow::anyhow!("binding gRPC address {}: {e}", args.grpc_addr))?
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(60)));
    let grpc_addr = incoming.local_addr().context("gRPC local address")?;
    let http_listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .with_context(|| format!("binding metrics address {}", args.metrics_addr))?;
    let metrics_addr = http_listener.local_addr()?;
    let serving = Arc::new(AtomicBool::new(true));
    let http_state = HttpState {
        metrics: metrics.clone(),
        serving: serving.clone(),
        pool: pool.clone(),
        engine: engine.clone(),
        prefix_cache: prefix_cache.clone(),
    };
    let http = tokio::spawn(async move { axum::serve(http_listener, router(http_state)).await });
    tracing::info!(%grpc_addr, %metrics_addr, model_id = %node.layout.model_id, attention = node.attention.mode.name(), "serving");
    if let Some(tx) = ready {
        let _ = tx.send(Ready {
            bound: Bound {
                grpc: grpc_addr,
                metrics: metrics_addr,
            },
            model: node.model.clone(),
        });
    }

    // A lost device cannot come back in this process: health says so at once (the orchestrator
    // stops routing here), and pushes are refused as when draining.
    let lost_watch = {
        let (registry, engine, serving, health) = (
            registry.clone(),
            engine.clone(),
            serving.clone(),
            health.clone(),
        );
        tokio::spawn(async move {
            while !engine.load().device_lost {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            tracing::error!(
                "device lost: health NOT_SERVING, new pushes refused; restart the node"
            );
            stop_serving(&registry, &serving, &health).await;
        })
    };
    let drain_timeout = Duration::from_secs_f64(args.drain_timeout.max(0.0));
    let drain = {
        let (registry, engine, state) = (registry.clone(), engine.clone(), state.clone());
        async move {
            shutdown.await;
            tracing::info!("draining: refusing new work, finishing running requests");
            stop_serving(&registry, &serving, &health).await;
            // Generates for KV already here are still served, until the drain timeout.
            let end = Instant::now() + drain_timeout;
            loop {
                let idle = state.active.lock().map(|a| a.is_empty()).unwrap_or(true);
                if (idle && registry.pending() == 0) || Instant::now() >= end {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            for (id, bytes) in registry.drop_all() {
                tracing::warn!(request_id = %kv_transfer::clip(&id), bytes, "drain timeout: KV never generated from is dropped");
            }
            engine.send(Control::Shutdown);
            // Let the streams carry their last events out.
            let end = Instant::now() + Duration::from_secs(2);
            while !state.active.lock().map(|a| a.is_empty()).unwrap_or(true) && Instant::now() < end
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    let result = builder
        .add_service(health_svc)
        .add_service(reflection)
        .add_service(kv_svc)
        .add_service(decode_svc)
        .serve_with_incoming_shutdown(incoming, drain)
        .await;
    engine.send(Control::Shutdown);
    sweeper.abort();
    lost_watch.abort();
    http.abort();
    let _ = tokio::task::spawn_blocking(move || engine_thread.join()).await;
    result.context("gRPC server")?;
    tracing::info!("drained, exiting");
    Ok(())
}

/// Threads of the CPU-attention pool where `--cpu-attention-threads` is 0. On the CPU device
/// the pool runs the whole step: every core. On a GPU whose sketch scores the blocks the host
/// only picks the top of the device's scores, and the CPU part of attention decides scout's
/// speed: every core but two (the step thread and the runtime). Where the host scores (SparQ,
/// Quest) selection runs on rayon's global pool, every core, beside this one: a quarter.
/// The H200's host (16 cores) read 42.8 GB/s with 4 threads and 132 with 16 (`bench
/// kernels`, 2026-11-26); with 4, scout's CPU part there waited 4 ms of a 13-15 ms step at
/// 64k (2026-11-27).
fn default_cpu_threads(cpus: usize, model_on_rayon: bool, device_scores: bool) -> usize {
    if model_on_rayon {
        cpus.max(1)
    } else if device_scores {
        cpus.saturating_sub(2).max(1)
    } else {
        (cpus / 4).max(1)
    }
}

/// A node served inside this process (the demo and the benches): where it listens and how to
/// stop it.
#[derive(Debug)]
pub struct InProcess {
    /// Its addresses.
    pub bound: Bound,
    /// The model it serves.
    pub model: Arc<crate::model::LoadedModel>,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl InProcess {
    /// Serve settings on ephemeral loopback ports, without auth or TLS.
    pub fn loopback_args(
        model: crate::cli::ModelArgs,
        host_kv_bytes: u64,
        device_kv_bytes: u64,
    ) -> ServeArgs {
        ServeArgs {
            model,
            served_model_name: None,
            grpc_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            metrics_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            host_kv_bytes,
            host_kv_prefault: false,
            prefix_cache_bytes: 0,
            device_kv_bytes,
            kv_lease: 60.0,
            push_idle_timeout: 10.0,
            push_deadline: 300.0,
            max_push_streams: 64,
            max_push_message: 64 << 20,
            max_batch: 8,
            cpu_attention_threads: 0,
            drain_timeout: 1.0,
            require_lease: false,
            auth_token_file: None,
            tls_cert: None,
            tls_key: None,
            tls_handshake_timeout: 10.0,
            tls_client_ca: None,
        }
    }

    /// Starts `serve` on a task and waits until it listens.
    pub async fn start(args: ServeArgs) -> anyhow::Result<Self> {
        let (ready_tx, ready_rx) = oneshot::channel();
        let (stop, stop_rx) = oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stop_rx.await;
        };
        let task = tokio::spawn(serve(args, shutdown, Some(ready_tx)));
        match ready_rx.await {
            Ok(Ready { bound, model }) => Ok(Self {
                bound,
                model,
                stop,
                task,
            }),
            Err(_) => task
                .await?
                .and_then(|()| anyhow::bail!("the node stopped before it listened")),
        }
    }

    /// `http://` URL of its gRPC port.
    pub fn target(&self) -> String {
        format!("http://{}", self.bound.grpc)
    }

    /// Drains it and waits for it to end.
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(());
        self.task.await?
    }
}

/// Takes the node out of rotation: pushes refused, gRPC and HTTP health NOT_SERVING.
async fn stop_serving(
    registry: &Registry,
    serving: &AtomicBool,
    health: &tonic_health::server::HealthReporter,
) {
    registry.set_draining();
    serving.store(false, Ordering::Release);
    health
        .set_service_status("", ServingStatus::NotServing)
        .await;
    health
        .set_not_serving::<DecodeServer<DecodeService>>()
        .await;
    health
        .set_not_serving::<KvTransferServer<KvTransferService>>()
        .await;
}

#[cfg(test)]
mod tests {
    use super::default_cpu_threads;

    #[test]
    fn the_cpu_pool_gets_the_cores_selection_does_not_need() {
        // The CPU device: the pool runs the step.
        assert_eq!(default_cpu_threads(16, true, false), 16);
        assert_eq!(default_cpu_threads(16, true, true), 16);
        // A GPU scoring the blocks: all but the step thread's and the runtime's core.
        assert_eq!(default_cpu_threads(16, false, true), 14);
        assert_eq!(default_cpu_threads(2, false, true), 1);
        assert_eq!(default_cpu_threads(1, false, true), 1);
        // The host scoring on rayon's global pool: a quarter, at least one.
        assert_eq!(default_cpu_threads(16, false, false), 4);
        assert_eq!(default_cpu_threads(3, false, false), 1);
    }
}
