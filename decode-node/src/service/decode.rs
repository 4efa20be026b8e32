//! The `Decode` gRPC service: the gRPC layer only sees the engine's event stream.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use decode_node_proto::v1 as pb;
use decode_node_proto::v1::decode_server::Decode;
use kv_transfer::{HostPool, Registry, StopReason};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::engine::{
    Control, Engine, EngineError, Event, FinishReason, Job, JobSpec, OutputOptions, RequestStats,
};
use crate::model::Sampling;

/// Default wait for a request's KV when `kv_timeout_ms` is 0.
pub const DEFAULT_KV_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for a request's KV a client may ask for.
pub const MAX_KV_TIMEOUT: Duration = Duration::from_secs(600);
/// Most stop tokens one request may name.
pub const MAX_STOP_TOKENS: usize = 64;
/// Most stop strings a Generate may carry, and their longest length in bytes.
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_STRING_BYTES: usize = 256;
/// Most `top_logprobs` a Generate may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Shared state of the node's services.
#[derive(Debug, Clone)]
pub struct NodeState {
    /// Pushed KV, awaiting claims.
    pub registry: Registry,
    /// The host pool.
    pub pool: HostPool,
    /// The engine.
    pub engine: Engine,
    /// `GetModelInfo`'s answer.
    pub info: pb::ModelInfo,
    /// The prefix cache, whose idle blocks count as free in the load report.
    pub prefix_cache: Option<Arc<kv_transfer::PrefixCache>>,
    /// Requests with a live Generate stream.
    pub active: Arc<Mutex<HashMap<String, Active>>>,
}

/// The stream a Generate's events go out on.
type Out = mpsc::Sender<Result<pb::GenerateResponse, Status>>;

/// A live Generate, as Cancel and a retry of its id see it.
#[derive(Debug, Clone, Default)]
pub struct Active {
    /// The lease it presented; once it holds the KV, the KV's own.
    lease: String,
    /// A Cancel came before the job reached the engine.
    cancelled: bool,
    /// Its client's stream: closed once the client has gone.
    client: Option<Out>,
    /// Ends (its sender is dropped) once its task has ended and removed this entry.
    ended: Option<watch::Receiver<()>>,
}

/// How long a retry waits for the task of a Generate whose client has gone to end.
const GONE_TASK_WAIT: Duration = Duration::from_secs(5);

impl NodeState {
    fn active(&self) -> std::sync::MutexGuard<'_, HashMap<String, Active>> {
        self.active.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// `Decode` implementation.
#[derive(Debug, Clone)]
pub struct DecodeService {
    state: NodeState,
}

impl DecodeService {
    /// Over `state`.
    pub fn new(state: NodeState) -> Self {
        Self { state }
    }
}

fn engine_status(e: &EngineError) -> Status {
    match e {
        EngineError::Exhausted(m) => Status::resource_exhausted(m.clone()),
        EngineError::ShuttingDown => Status::unavailable("the node is shutting down"),
        EngineError::Input(m) => Status::invalid_argument(m.clone()),
        // The device failed under this node: another node may serve the request.
        EngineError::Device(_) | EngineError::DeviceLost(_) => Status::unavailable(e.to_string()),
        EngineError::Attention(_) | EngineError::Internal(_) => Status::internal(e.to_string()),
        // The request's data is corrupt: retrying it as is cannot help.
        EngineError::NonFinite(m) => Status::data_loss(m.clone()),
    }
}

fn finish_reason(r: FinishReason) -> pb::FinishReason {
    match r {
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Eos => pb::FinishReason::Eos,
        FinishReason::Cancelled => pb::FinishReason::Cancelled,
        FinishReason::ContextFull => pb::FinishReason::ContextFull,
    }
}

fn to_response(ev: Event) -> Result<pb::GenerateResponse, Status> {
    use pb::generate_response::Event as E;
    Ok(pb::GenerateResponse {
        event: Some(match ev {
            Event::Token {
                index,
                id,
                text,
                logprob,
                top_logprobs,
            } => E::Token(pb::Token {
                index,
                id,
                text,
                logprob,
                top_logprobs: top_logprobs
                    .into_iter()
                    .map(|t| pb::TopLogprob {
                        id: t.id,
                        text: t.text,
                        logprob: t.logprob,
                    })
                    .collect(),
            }),
            Event::Finish {
                reason,
                generated,
                stats,
            } => E::Finish(pb::Finish {
                reason: finish_reason(reason) as i32,
                generated_tokens: generated,
                stats: Some(pb::RequestStats {
                    queue_seconds: stats.queue_seconds,
                    first_token_seconds: stats.first_token_seconds,
                    total_seconds: stats.total_seconds,
                    cpu_attention_ratio: stats.cpu_attention_ratio,
                    recalled_blocks: stats.recalled_blocks,
                    prediction_hit_ratio: stats.prediction_hit_ratio,
                    prompt_tokens: stats.prompt_tokens,
                    device_wait_seconds: stats.device_wait_seconds,
                    device_idle_seconds: stats.device_idle_seconds,
                    recalled_bytes: stats.recalled_bytes,
                    recalled_blocks_used: stats.recalled_blocks_used,
                }),
            }),
            Event::Error(e) => return Err(engine_status(&e)),
        }),
    })
}

/// Bytes of the prefix cache no request shares (evicted whenever the pool needs them).
pub(crate) fn cached_idle(cache: &Option<Arc<kv_transfer::PrefixCache>>) -> u64 {
    cache.as_ref().map_or(0, |c| c.usage().idle_bytes)
}

/// The node's load now, as GetLoad and WatchLoad report it.
fn load_report(st: &NodeState) -> pb::LoadReport {
    let load = st.engine.load();
    let pool = st.pool.usage();
    pb::LoadReport {
        running: load.running,
        waiting: load.waiting,
        // Idle cached blocks go whenever admission needs them: free as far as a router cares.
        host_kv_bytes_used: (pool.used + pool.reserved)
            .saturating_sub(cached_idle(&st.prefix_cache)),
        host_kv_bytes_capacity: pool.capacity,
        device_kv_bytes_used: load.device_bytes,
        device_kv_bytes_capacity: load.device_capacity,
        device_kv_bytes_lent: load.device_lent,
        tokens_per_second: load.tokens_per_second,
        draining: st.registry.is_draining(),
        committed_unclaimed: st.registry.committed_unclaimed() as u32,
    }
}

/// Checks a request before anything is waited for.
fn validate(
    r: &pb::GenerateRequest,
    info: &pb::ModelInfo,
) -> Result<(Sampling, OutputOptions), Status> {
    let vocab = info.vocab_size;
    kv_transfer::check_request_id(&r.request_id)?;
    if r.max_new_tokens == 0 || r.max_new_tokens > info.max_context {
        return Err(Status::invalid_argument(format!(
            "max_new_tokens must be within 1..={} (the model's context), got {}",
            info.max_context, r.max_new_tokens
        )));
    }
    if u64::from(r.kv_timeout_ms) > MAX_KV_TIMEOUT.as_millis() as u64 {
        return Err(Status::invalid_argument(format!(
            "kv_timeout_ms must be at most {} (0 = the default of {} s), got {}",
            MAX_KV_TIMEOUT.as_millis(),
            DEFAULT_KV_TIMEOUT.as_secs(),
            r.kv_timeout_ms
        )));
    }
    if r.stop_token_ids.len() > MAX_STOP_TOKENS {
        return Err(Status::invalid_argument(format!(
            "at most {MAX_STOP_TOKENS} stop_token_ids, got {}",
            r.stop_token_ids.len()
        )));
    }
    if let Some(bad) = r.stop_token_ids.iter().find(|t| **t >= vocab) {
        return Err(Status::invalid_argument(format!(
            "stop token id {bad} is outside the vocabulary of {vocab}"
        )));
    }
    let s = r.sampling.unwrap_or_default();
    if !s.temperature.is_finite() || s.temperature < 0.0 {
        return Err(Status::invalid_argument(
            "sampling.temperature must be finite and >= 0",
        ));
    }
    if !(0.0..=1.0).contains(&s.top_p) {
        return Err(Status::invalid_argument(
            "sampling.top_p must be within [0, 1]",
        ));
    }
    if !s.repetition_penalty.is_finite() || s.repetition_penalty < 0.0 {
        return Err(Status::invalid_argument(
            "sampling.repetition_penalty must be finite and > 0 (0 or 1: off)",
        ));
    }
    for (name, v) in [
        ("presence_penalty", s.presence_penalty),
        ("frequency_penalty", s.frequency_penalty),
    ] {
        if !(-2.0..=2.0).contains(&v) {
            return Err(Status::invalid_argument(format!(
                "sampling.{name} must be within [-2, 2], got {v}"
            )));
        }
    }
    if r.min_tokens > r.max_new_tokens {
        return Err(Status::invalid_argument(format!(
            "min_tokens ({}) must be at most max_new_tokens ({})",
            r.min_tokens, r.max_new_tokens
        )));
    }
    if r.stop.len() > MAX_STOP_STRINGS {
        return Err(Status::invalid_argument(format!(
            "at most {MAX_STOP_STRINGS} stop strings, got {}",
            r.stop.len()
        )));
    }
    if let Some(bad) = r
        .stop
        .iter()
        .find(|s| s.is_empty() || s.len() > MAX_STOP_STRING_BYTES)
    {
        return Err(Status::invalid_argument(format!(
            "a stop string must be 1..={MAX_STOP_STRING_BYTES} bytes, got {}",
            bad.len()
        )));
    }
    if r.top_logprobs > MAX_TOP_LOGPROBS {
        return Err(Status::invalid_argument(format!(
            "top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {}",
            r.top_logprobs
        )));
    }
    let sampling = Sampling {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: s.top_p,
        seed: s.seed,
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
    };
    let output = OutputOptions {
        min_tokens: r.min_tokens,
        stop_strings: r.stop.clone(),
        top_logprobs: r.top_logprobs,
    };
    Ok((sampling, output))
}

#[tonic::async_trait]
impl Decode for DecodeService {
    type GenerateStream = ReceiverStream<Result<pb::GenerateResponse, Status>>;

    async fn generate(
        &self,
        req: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let arrived = Instant::now();
        let st = self.state.clone();
        let r = req.into_inner();
        let (sampling, output) = validate(&r, &st.info)?;
        // A draining node still serves the KV it was given (committed or arriving).
        if st.registry.is_draining() && !st.registry.holds(&r.request_id) {
            return Err(Status::unavailable(
                "node is draining: only requests whose KV it holds are served",
            ));
        }
        let id = r.request_id.clone();
        let timeout = match r.kv_timeout_ms {
            0 => DEFAULT_KV_TIMEOUT,
            ms => Duration::from_millis(ms as u64),
        };
        let (out_tx, out_rx) = mpsc::channel(64);
        let ended = take_id(&st, &id, &r.lease, &out_tx).await?;
        let span = tracing::info_span!(
            "generate",
            request_id = %kv_transfer::clip(&id),
            prompt_tokens = tracing::field::Empty
        );
        tokio::spawn(
            async move {
                run_generate(&st, r, (sampling, output), timeout, arrived, out_tx).await;
                st.active().remove(&id);
                drop(ended);
            }
            .instrument(span),
        );
        Ok(Response::new(ReceiverStream::new(out_rx)))
    }

    async fn cancel(
        &self,
        req: Request<pb::CancelRequest>,
    ) -> Result<Response<pb::CancelResponse>, Status> {
        let req = req.into_inner();
        let id = req.request_id;
        kv_transfer::check_request_id(&id)?;
        let reg = &self.state.registry;
        let running = {
            // Under the lock a Generate submits under: the job is either not submitted yet
            // (and sees the flag) or queued before this Cancel reaches the engine.
            let mut active = self.state.active();
            match active.get_mut(&id) {
                Some(a) => {
                    reg.fence(&id, &a.lease, &req.lease).map_err(Status::from)?;
                    a.cancelled = true;
                    self.state
                        .engine
                        .send(Control::Cancel(id.clone(), "client"));
                    true
                }
                None => false,
            }
        };
        let held = match reg.stop(&id, StopReason::Cancelled, &req.lease) {
            Ok(_) => true,
            Err(e @ kv_transfer::Error::Lease(_)) => return Err(e.into()),
            Err(_) => false,
        };
        Ok(Response::new(pb::CancelResponse {
            cancelled: running || held,
        }))
    }

    async fn get_load(
        &self,
        _req: Request<pb::GetLoadRequest>,
    ) -> Result<Response<pb::LoadReport>, Status> {
        Ok(Response::new(load_report(&self.state)))
    }

    type WatchLoadStream = ReceiverStream<Result<pb::LoadReport, Status>>;

    async fn watch_load(
        &self,
        req: Request<pb::WatchLoadRequest>,
    ) -> Result<Response<Self::WatchLoadStream>, Status> {
        let ms = match req.get_ref().interval_ms {
            0 => 100,
            v @ 10..=100 => v,
            v => {
                return Err(Status::invalid_argument(format!(
                    "interval_ms must be 0 (100) or within 10..=100, got {v}"
                )));
            }
        };
        let (tx, rx) = mpsc::channel(2);
        let st = self.state.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(u64::from(ms)));
            // A slow reader gets the current load when it reads, not a backlog of old ones.
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = tx.closed() => return,
                }
                if tx.send(Ok(load_report(&st))).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn get_model_info(
        &self,
        _req: Request<pb::GetModelInfoRequest>,
    ) -> Result<Response<pb::ModelInfo>, Status> {
        Ok(Response::new(self.state.info.clone()))
    }
}

/// Makes `id` this Generate's; the returned sender is dropped when its task ends. An id whose
/// Generate is live is ALREADY_EXISTS; one whose client has gone is taken once that
/// Generate's task has let go of it (a retry right after a disconnect works).
async fn take_id(
    st: &NodeState,
    id: &str,
    lease: &str,
    client: &Out,
) -> Result<watch::Sender<()>, Status> {
    let taken = || {
        Status::already_exists(format!(
            "request {:?} is already generating",
            kv_transfer::clip(id)
        ))
    };
    for _ in 0..2 {
        let gone = {
            let mut active = st.active();
            match active.get(id) {
                None => {
                    let (ended_tx, ended_rx) = watch::channel(());
                    active.insert(
                        id.to_string(),
                        Active {
                            lease: lease.to_string(),
                            cancelled: false,
                            client: Some(client.clone()),
                            ended: Some(ended_rx),
                        },
                    );
                    return Ok(ended_tx);
                }
                Some(a) if a.client.as_ref().is_some_and(Out::is_closed) => a.ended.clone(),
                Some(_) => return Err(taken()),
            }
        };
        if let Some(mut ended) = gone {
            // Err once the sender is dropped: the task has ended.
            let _ = tokio::time::timeout(GONE_TASK_WAIT, ended.changed()).await;
        }
    }
    Err(taken())
}

/// Waits for the KV, hands the job to the engine and forwards its events; cancels the job
/// when the client goes away.
async fn run_generate(
    st: &NodeState,
    r: pb::GenerateRequest,
    (sampling, output): (Sampling, OutputOptions),
    timeout: Duration,
    arrived: Instant,
    out: mpsc::Sender<Result<pb::GenerateResponse, Status>>,
) {
    let id = r.request_id.clone();
    let kv = tokio::select! {
        kv = st.registry.claim_leased(&id, timeout, &r.lease) => kv,
        () = out.closed() => return,
    };
    let kv = match kv {
        Ok(kv) => kv,
        Err(e) => {
            let _ = out.send(Err(e.into())).await;
            return;
        }
    };
    let (ev_tx, mut ev_rx) = mpsc::unbounded_channel();
    let spec = JobSpec {
        request_id: id.clone(),
        sampling,
        max_new_tokens: r.max_new_tokens,
        stop_ids: r.stop_token_ids,
        ignore_eos: r.ignore_eos,
        output,
        arrived,
        events: ev_tx,
        span: tracing::Span::current(),
    };
    tracing::Span::current().record("prompt_tokens", kv.info.prompt_token_ids.len());
    let submitted = {
        let mut active = st.active();
        let a = active.entry(id.clone()).or_default();
        // From here a Cancel is checked against the KV's own lease.
        a.lease = kv.lease().to_string();
        if a.cancelled {
            None
        } else {
            Some(st.engine.send(Control::Submit(Job { kv, spec })))
        }
    };
    match submitted {
        Some(true) => {}
        Some(false) => {
            let _ = out
                .send(Err(Status::unavailable("the engine has stopped")))
                .await;
            return;
        }
        // Cancelled while it waited for its KV: the KV is freed here, as the engine would.
        None => {
            let fin = Event::Finish {
                reason: FinishReason::Cancelled,
                generated: 0,
                stats: RequestStats {
                    total_seconds: arrived.elapsed().as_secs_f64(),
                    ..RequestStats::default()
                },
            };
            let _ = out.send(to_response(fin)).await;
            return;
        }
    }
    loop {
        tokio::select! {
            ev = ev_rx.recv() => {
                let Some(ev) = ev else { return };
                let last = matches!(ev, Event::Finish { .. } | Event::Error(_));
                if out.send(to_response(ev)).await.is_err() {
                    st.engine.send(Control::Cancel(id.clone(), "disconnect"));
                    return;
                }
                if last {
                    return;
                }
            }
            () = out.closed() => {
                st.engine.send(Control::Cancel(id.clone(), "disconnect"));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::*;

    #[test]
    fn engine_errors_map_to_codes_a_client_can_act_on() {
        let table = [
            (
                EngineError::Exhausted("full".into()),
                Code::ResourceExhausted,
            ),
            (EngineError::ShuttingDown, Code::Unavailable),
            (
                EngineError::Input("token 99999".into()),
                Code::InvalidArgument,
            ),
            // A failing device is the node's fault, never the request's.
            (EngineError::Device("ECC error".into()), Code::Unavailable),
            (EngineError::DeviceLost("lost".into()), Code::Unavailable),
            (
                EngineError::Attention("CPU part lost".into()),
                Code::Internal,
            ),
            (EngineError::Internal("bug".into()), Code::Internal),
            (EngineError::NonFinite("NaN".into()), Code::DataLoss),
        ];
        for (e, want) in table {
            let s = engine_status(&e);
            assert_eq!(s.code(), want, "{e:?}");
            assert!(!s.message().is_empty(), "{e:?}");
        }
    }
}
