//! The `KvTransfer` gRPC service over the pool and the registry.

use std::sync::Arc;
use std::time::{Duration, Instant};

use decode_node_proto::v1::kv_transfer_server::KvTransfer;
use decode_node_proto::v1::{DropKvRequest, DropKvResponse, PushKvRequest, PushKvResponse};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::ingest::{Ingest, validate_header};
use crate::pool::HostPool;
use crate::registry::{PushSlot, Registry, StopReason};
use crate::wire::PushMessage;
use crate::{Error, KvLayout, code_label};

/// Acknowledge at least this often (payload bytes).
pub const ACK_EVERY_BYTES: u64 = 8 << 20;

/// How long a push may take: a client that goes silent, or trickles, gives back what it
/// holds instead of keeping it for as long as its stream stays open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushLimits {
    /// Longest wait for the next message (the header included).
    pub idle: Duration,
    /// Longest a whole push may take, from its stream's start to the commit.
    pub deadline: Duration,
    /// Pushes in flight at once; one more is refused RESOURCE_EXHAUSTED at its start. With
    /// the message limit this bounds what push streams can make the node buffer.
    pub max_streams: usize,
}

impl Default for PushLimits {
    fn default() -> Self {
        Self {
            idle: Duration::from_secs(10),
            deadline: Duration::from_secs(300),
            max_streams: 64,
        }
    }
}

/// `KvTransfer` implementation.
#[derive(Debug, Clone)]
pub struct KvTransferService {
    layout: KvLayout,
    pool: HostPool,
    registry: Registry,
    limits: PushLimits,
    /// One permit per push in flight.
    streams: Arc<Semaphore>,
}

impl KvTransferService {
    /// A service storing into `pool` and publishing to `registry`, with default limits.
    pub fn new(layout: KvLayout, pool: HostPool, registry: Registry) -> Self {
        let limits = PushLimits::default();
        Self {
            layout,
            pool,
            registry,
            limits,
            streams: Arc::new(Semaphore::new(limits.max_streams)),
        }
    }

    /// The same service with other push limits.
    pub fn with_limits(mut self, limits: PushLimits) -> Self {
        self.limits = limits;
        self.streams = Arc::new(Semaphore::new(limits.max_streams));
        self
    }

    /// Largest `KvHeader` accepted (encoded bytes).
    pub(crate) fn max_header_bytes(&self) -> usize {
        self.layout.max_header_bytes()
    }
}

/// How a push ended: the `outcome` label of `kv_push_ends_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PushEnd {
    Committed,
    IdleTimeout,
    Deadline,
    Dropped,
    Cancelled,
    ClientGone,
    Refused,
    Incomplete,
}

impl PushEnd {
    fn label(self) -> &'static str {
        match self {
            PushEnd::Committed => "committed",
            PushEnd::IdleTimeout => "idle_timeout",
            PushEnd::Deadline => "deadline",
            PushEnd::Dropped => "dropped",
            PushEnd::Cancelled => "cancelled",
            PushEnd::ClientGone => "client_gone",
            PushEnd::Refused => "refused",
            PushEnd::Incomplete => "incomplete",
        }
    }
}

/// Why the inbound side of a push ended early.
#[derive(Debug)]
pub(crate) enum Inbound {
    /// The client's stream broke (reset, disconnect): nobody is listening for a reply.
    Broken(String),
    /// The stream carried what we refuse before it is a message (oversized, compressed,
    /// truncated): the client is told why.
    Refused(Status),
}

pub(crate) struct Push {
    slot: PushSlot,
    ingest: Ingest,
    started: Instant,
    acked_bytes: u64,
}

impl KvTransferService {
    /// Feeds one message; returns an ack to send, if one is due.
    pub(crate) fn step(
        &self,
        state: &mut Option<Push>,
        msg: PushMessage,
    ) -> Result<Option<PushKvResponse>, Error> {
        let ack = |p: &Push, committed: bool| PushKvResponse {
            request_id: p.ingest.request_id().to_string(),
            bytes_received: p.ingest.bytes_received,
            chunks_received: p.ingest.chunks_received,
            committed,
            lease: p.slot.lease().to_string(),
        };
        match (msg, state.as_mut()) {
            (PushMessage::Empty, _) => Err(Error::Invalid(
                "empty PushKvRequest (no header, chunk or commit)".into(),
            )),
            (PushMessage::Header(h), None) => {
                // The whole header is checked before the id is taken or a byte reserved.
                let info = validate_header(&self.layout, &h)?;
                drop(h);
                tracing::Span::current()
                    .record("request_id", crate::clip(&info.request_id).as_ref());
                let slot = self.registry.begin_push(&info.request_id)?;
                let ingest = Ingest::with_info(&self.layout, &self.pool, info)?;
                slot.set_held(ingest.bytes_held());
                let p = Push {
                    slot,
                    ingest,
                    started: Instant::now(),
                    acked_bytes: 0,
                };
                // The first ack carries the lease, so the orchestrator has it before the commit.
                let first = ack(&p, false);
                *state = Some(p);
                Ok(Some(first))
            }
            (PushMessage::Header(_), Some(_)) => {
                Err(Error::Invalid("second KvHeader in one push".into()))
            }
            (_, None) => Err(Error::Invalid(
                "the first message of a push must be a KvHeader".into(),
            )),
            (PushMessage::Chunk(c), Some(p)) => {
                if let Some(why) = p.slot.stop_reason() {
                    return Err(why.error(p.ingest.request_id()));
                }
                p.ingest.chunk(&c)?;
                let m = self.registry.metrics();
                m.chunks.inc();
                m.bytes.inc_by((c.key.len() + c.value.len()) as u64);
                if p.ingest.bytes_received - p.acked_bytes >= ACK_EVERY_BYTES {
                    p.acked_bytes = p.ingest.bytes_received;
                    return Ok(Some(ack(p, false)));
                }
                Ok(None)
            }
            (PushMessage::Commit(next_token_id), Some(_)) => {
                let Some(p) = state.take() else {
                    unreachable!("matched Some above")
                };
                let reply = ack(&p, true);
                let kv = p.ingest.commit(next_token_id)?;
                p.slot.commit(kv)?;
                self.registry
                    .metrics()
                    .push_duration
                    .observe(p.started.elapsed().as_secs_f64());
                tracing::info!(
                    bytes = reply.bytes_received,
                    seconds = p.started.elapsed().as_secs_f64(),
                    "kv committed"
                );
                Ok(Some(reply))
            }
        }
    }

    /// Counts an error ended before the state machine saw the push.
    pub(crate) fn metrics_error(&self, code: tonic::Code) {
        self.registry.metrics().error(code_label(code));
    }

    /// Admits a push: refused up front while draining, or when `max_streams` pushes are
    /// already in flight. The permit is held until the push has ended and freed.
    pub(crate) fn admit(&self) -> Result<OwnedSemaphorePermit, Status> {
        if self.registry.is_draining() {
            self.registry.metrics().error("unavailable");
            return Err(Error::Draining.into());
        }
        Arc::clone(&self.streams).try_acquire_owned().map_err(|_| {
            let m = self.registry.metrics();
            m.error("resource_exhausted");
            m.push_end(PushEnd::Refused.label());
            Status::resource_exhausted(format!(
                "{} pushes are in flight, this node's limit (--max-push-streams); retry later",
                self.limits.max_streams
            ))
        })
    }

    /// Runs one push to its end: feeds `inbound` through [`Self::step`] and sends acks, or the
    /// error that ended it, to `tx`. Whatever the push held is freed when this returns
    /// without a commit: a client that stalls past the idle timeout or the deadline, or whose
    /// request is dropped or cancelled meanwhile, is cut off at once.
    pub(crate) async fn run_push<S>(
        &self,
        inbound: S,
        tx: mpsc::Sender<Result<PushKvResponse, Status>>,
    ) where
        S: Stream<Item = Result<PushMessage, Inbound>> + Unpin,
    {
        // The request id is recorded once the header is accepted.
        let span = tracing::info_span!("push", request_id = tracing::field::Empty);
        let end = self.push_loop(inbound, &tx).instrument(span.clone()).await;
        let m = self.registry.metrics();
        m.push_end(end.0.label());
        if let Some(status) = end.1 {
            span.in_scope(|| {
                tracing::info!(
                    outcome = end.0.label(),
                    code = ?status.code(),
                    message = status.message(),
                    "push ended"
                )
            });
            m.error(code_label(status.code()));
            let _ = tx.send(Err(status)).await;
        }
    }

    /// The push's state machine against its client, the clock and the registry; returns how
    /// it ended and the status to send, if any.
    async fn push_loop<S>(
        &self,
        mut inbound: S,
        tx: &mpsc::Sender<Result<PushKvResponse, Status>>,
    ) -> (PushEnd, Option<Status>)
    where
        S: Stream<Item = Result<PushMessage, Inbound>> + Unpin,
    {
        let limits = self.limits;
        let deadline = tokio::time::Instant::now() + limits.deadline;
        let mut state: Option<Push> = None;
        loop {
            let next = {
                let stop = async {
                    match &state {
                        Some(p) => p.slot.stopped().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    next = inbound.next() => next,
                    why = stop => {
                        let id = state.as_ref().map_or("", |p| p.ingest.request_id());
                        let end = match why {
                            StopReason::Dropped => PushEnd::Dropped,
                            StopReason::Cancelled => PushEnd::Cancelled,
                        };
                        return (end, Some(why.error(id).into()));
                    }
                    () = tokio::time::sleep(limits.idle) => {
                        let e = Error::PushTimeout(format!(
                            "no PushKv message for {:?} (push idle timeout); the push is dropped",
                            limits.idle
                        ));
                        return (PushEnd::IdleTimeout, Some(e.into()));
                    }
                    () = tokio::time::sleep_until(deadline) => {
                        let e = Error::PushTimeout(format!(
                            "push not committed within {:?} (push deadline); it is dropped",
                            limits.deadline
                        ));
                        return (PushEnd::Deadline, Some(e.into()));
                    }
                }
            };
            let msg = match next {
                None => {
                    // Half-closed without a commit: nothing was published, everything is freed.
                    let e = Error::Invalid("push stream ended before KvCommit".into());
                    return (PushEnd::Incomplete, Some(e.into()));
                }
                Some(Ok(m)) => m,
                Some(Err(Inbound::Broken(why))) => {
                    // The client broke the stream: drop everything it held.
                    tracing::debug!(%why, "push stream broke");
                    self.registry.metrics().error("cancelled");
                    return (PushEnd::ClientGone, None);
                }
                Some(Err(Inbound::Refused(status))) => return (PushEnd::Refused, Some(status)),
            };
            match self.step(&mut state, msg) {
                Ok(Some(ack)) => {
                    let committed = ack.committed;
                    let sent = tx.send(Ok(ack)).await.is_ok();
                    if committed {
                        return self.after_commit(&mut inbound).await;
                    }
                    if !sent {
                        self.registry.metrics().error("cancelled");
                        return (PushEnd::ClientGone, None);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    let end = match e {
                        Error::Dropped(_) => PushEnd::Dropped,
                        Error::Cancelled(_) => PushEnd::Cancelled,
                        _ => PushEnd::Refused,
                    };
                    return (end, Some(e.into()));
                }
            }
        }
    }

    /// After the commit the client may only close its side; a further message is an error
    /// (the KV stays committed). Waits at most the idle timeout.
    async fn after_commit<S>(&self, inbound: &mut S) -> (PushEnd, Option<Status>)
    where
        S: Stream<Item = Result<PushMessage, Inbound>> + Unpin,
    {
        match tokio::time::timeout(self.limits.idle, inbound.next()).await {
            Ok(Some(Ok(_))) => (
                PushEnd::Committed,
                Some(Error::Invalid("message after KvCommit".into()).into()),
            ),
            Ok(Some(Err(Inbound::Refused(status)))) => (PushEnd::Committed, Some(status)),
            _ => (PushEnd::Committed, None),
        }
    }
}

/// A request id from a client: 1 to [`crate::MAX_REQUEST_ID_LEN`] bytes.
pub fn check_request_id(id: &str) -> Result<(), Status> {
    if id.is_empty() || id.len() > crate::MAX_REQUEST_ID_LEN {
        return Err(Status::invalid_argument(format!(
            "request_id must be 1..={} bytes, got {}",
            crate::MAX_REQUEST_ID_LEN,
            id.len()
        )));
    }
    Ok(())
}

#[tonic::async_trait]
impl KvTransfer for KvTransferService {
    type PushKvStream = ReceiverStream<Result<PushKvResponse, Status>>;

    /// Served by [`crate::KvTransferRoute`] in `serve`, which reads chunks without joining
    /// frames; this tonic path (same state machine) remains for plain tonic servers.
    async fn push_kv(
        &self,
        req: Request<Streaming<PushKvRequest>>,
    ) -> Result<Response<Self::PushKvStream>, Status> {
        let permit = self.admit()?;
        let inbound = req.into_inner().map(|m| {
            m.map(PushMessage::from)
                .map_err(|s| Inbound::Broken(s.to_string()))
        });
        let (tx, rx) = mpsc::channel(8);
        let this = self.clone();
        tokio::spawn(async move {
            this.run_push(inbound, tx).await;
            drop(permit);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn drop_kv(
        &self,
        req: Request<DropKvRequest>,
    ) -> Result<Response<DropKvResponse>, Status> {
        let req = req.into_inner();
        check_request_id(&req.request_id)?;
        let d = self
            .registry
            .stop(&req.request_id, StopReason::Dropped, &req.lease)?;
        Ok(Response::new(DropKvResponse {
            dropped: d.freed(),
            bytes_freed: d.bytes(),
        }))
    }
}

#[cfg(test)]
mod fuzz {
    //! The ingest state machine fed arbitrary message sequences: it never panics, and once
    //! every push has ended and every committed request is dropped, the pool is empty again.

    use super::*;
    use crate::IngestMetrics;
    use crate::ingest::tests::{chunk, header, layout};
    use decode_node_proto::v1::push_kv_request::Item;
    use decode_node_proto::v1::{KvCommit, KvHeader};
    use proptest::prelude::*;
    use std::time::Duration;

    #[derive(Debug, Clone)]
    enum Op {
        Header {
            id: u8,
            tokens: u8,
            bad_model: bool,
            bad_dtype: bool,
        },
        Chunk {
            layer: u8,
            start: u8,
            count: u8,
            corrupt_crc: bool,
            short: bool,
        },
        Commit,
        Empty,
        /// The client goes away: the push's state is dropped mid-stream.
        Break,
        Drop {
            id: u8,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (
                0u8..4,
                0u8..40,
                proptest::bool::weighted(0.1),
                proptest::bool::weighted(0.1)
            )
                .prop_map(|(id, tokens, bad_model, bad_dtype)| Op::Header {
                    id,
                    tokens,
                    bad_model,
                    bad_dtype
                }),
            (
                0u8..3,
                0u8..40,
                0u8..20,
                proptest::bool::weighted(0.05),
                proptest::bool::weighted(0.05)
            )
                .prop_map(|(layer, start, count, corrupt_crc, short)| Op::Chunk {
                    layer,
                    start,
                    count,
                    corrupt_crc,
                    short
                }),
            Just(Op::Commit),
            Just(Op::Empty),
            Just(Op::Break),
            (0u8..4).prop_map(|id| Op::Drop { id }),
        ]
    }

    fn message(op: &Op) -> Option<PushKvRequest> {
        let item = match op {
            Op::Header {
                id,
                tokens,
                bad_model,
                bad_dtype,
            } => {
                let mut h: KvHeader = header(&format!("r{id}"), *tokens as u32);
                if *bad_model {
                    h.model_id = "other".into();
                }
                if *bad_dtype {
                    h.dtype = 7;
                }
                Some(Item::Header(h))
            }
            Op::Chunk {
                layer,
                start,
                count,
                corrupt_crc,
                short,
            } => {
                // Build a well-formed chunk when the shape allows, then damage it as asked.
                let (l, s, n) = (*layer as usize, *start as usize, (*count as usize).max(1));
                let mut c = chunk(l.min(1), s, n);
                c.layer = *layer as u32;
                if *count == 0 {
                    c.token_count = 0;
                }
                if *corrupt_crc {
                    c.crc32c ^= 1;
                }
                if *short {
                    c.key = c.key.slice(1..);
                }
                Some(Item::Chunk(c))
            }
            Op::Commit => Some(Item::Commit(KvCommit::default())),
            Op::Empty => None,
            Op::Break | Op::Drop { .. } => return None,
        };
        Some(PushKvRequest { item })
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: std::env::var("INGEST_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000),
            rng_seed: proptest::test_runner::RngSeed::Fixed(0xF022),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]
        #[test]
        fn arbitrary_message_sequences_never_panic_or_leak(ops in proptest::collection::vec(op(), 0..24)) {
            let l = layout();
            let pool = HostPool::new(l.geom, 24 * l.geom.block_bytes() as u64).unwrap();
            let registry = Registry::new(Duration::from_secs(60), IngestMetrics::default());
            let svc = KvTransferService::new(l, pool.clone(), registry.clone());
            let mut state: Option<Push> = None;
            for op in &ops {
                match op {
                    Op::Break => state = None,
                    Op::Drop { id } => {
                        let _ = registry.drop_kv(&format!("r{id}"));
                    }
                    _ => {
                        if let Some(msg) = message(op) {
                            // As the service does: an error ends the stream and drops its state.
                            match svc.step(&mut state, msg.into()) {
                                Ok(_) => {}
                                Err(_) => state = None,
                            }
                        }
                    }
                }
                let u = pool.usage();
                prop_assert!(u.used + u.reserved <= u.capacity);
            }
            drop(state);
            for id in 0..4 {
                let _ = registry.drop_kv(&format!("r{id}"));
            }
            let u = pool.usage();
            prop_assert_eq!((u.used, u.reserved), (0, 0));
        }
    }
}
