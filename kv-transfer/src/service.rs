//! The `KvTransfer` gRPC service over the pool and the registry.

use std::sync::Arc;
use std::time::{Duration, Instant};

use decode_node_proto::v1::kv_transfer_server::KvTransfer;
use decode_node_proto::v1::{
    DropKvRequest, DropKvResponse, KvEvents, PushKvRequest, PushKvResponse, WatchKvEventsRequest,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::group::{CommitPart, GroupState, Groups, MAX_PUSH_STREAMS, PushGroup};
use crate::ingest::{Ingest, validate_header};
use crate::pool::HostPool;
use crate::prefix::{KvEvent, PrefixCache};
use crate::registry::{Registry, StopReason};
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
    /// One permit per push stream in flight.
    streams: Arc<Semaphore>,
    /// Pushes on several streams, for the streams that join them.
    groups: Groups,
    /// Finished requests' blocks, for pushes that ask to reuse them.
    prefix: Option<Arc<PrefixCache>>,
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
            groups: Groups::default(),
            prefix: None,
        }
    }

    /// The same service reusing `cache`'s blocks for pushes that ask (`reuse_prefix`).
    pub fn with_prefix_cache(mut self, cache: Arc<PrefixCache>) -> Self {
        self.prefix = Some(cache);
        self
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
    /// Another stream of the same push failed.
    StreamFailed,
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
            PushEnd::StreamFailed => "stream_failed",
        }
    }
}

impl PushEnd {
    /// How a stream that ends with `e` ended.
    fn of(e: &Error) -> Self {
        match e {
            Error::Dropped(_) => PushEnd::Dropped,
            Error::Cancelled(_) => PushEnd::Cancelled,
            Error::StreamFailed(_) => PushEnd::StreamFailed,
            _ => PushEnd::Refused,
        }
    }
}

/// Resolves when something other than this stream ends the push: `DropKv` or `Cancel`
/// (which this stream then passes on to the others), or another stream's failure.
async fn interrupted(group: &PushGroup) -> Error {
    tokio::select! {
        why = group.signal().stopped() => {
            let e = why.error(group.request_id());
            group.fail(e.clone());
            e
        }
        state = group.resolved() => match state {
            GroupState::Failed(e) => e,
            // Committed while this stream still sends: its next message is refused.
            GroupState::Committed | GroupState::Open => std::future::pending().await,
        }
    }
}

/// Ends a stream with `e`: its push fails, telling its other streams why, and the stream
/// gets `e`.
fn ended(state: &Option<Push>, end: PushEnd, e: Error) -> (PushEnd, Option<Status>) {
    if let Some(p) = state {
        let others = match &e {
            Error::Dropped(_) | Error::Cancelled(_) | Error::StreamFailed(_) => e.clone(),
            _ => Error::StreamFailed(e.to_string()),
        };
        p.group.fail(others);
    }
    (end, Some(e.into()))
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

/// One stream of a push (most pushes have one).
pub(crate) struct Push {
    group: Arc<PushGroup>,
    started: Instant,
    /// This stream's payload bytes and chunks, as its acks report them.
    bytes: u64,
    chunks: u32,
    acked_bytes: u64,
    /// This stream sent its commit (its push waits for other streams).
    sent_commit: bool,
}

impl Drop for Push {
    /// A stream that ends while its push is open ends the push: the other streams would
    /// never see the part this one was to send.
    fn drop(&mut self) {
        self.group.fail(Error::StreamFailed(
            "a stream of this push ended before the push committed".into(),
        ));
    }
}

impl Push {
    fn ack(&self, committed: bool) -> PushKvResponse {
        PushKvResponse {
            request_id: self.group.request_id().to_string(),
            bytes_received: self.bytes,
            chunks_received: self.chunks,
            committed,
            lease: self.group.lease().to_string(),
            reused_tokens: self.group.reused_tokens() as u32,
        }
    }
}

/// What one message did to a push stream.
#[derive(Debug)]
pub(crate) enum Stepped {
    Quiet,
    Ack(PushKvResponse),
    /// The push committed; the ack says so.
    Committed(PushKvResponse),
    /// This stream committed its part; the push waits for its other streams.
    Waiting,
}

impl KvTransferService {
    /// Feeds one message.
    pub(crate) fn step(
        &self,
        state: &mut Option<Push>,
        msg: PushMessage,
    ) -> Result<Stepped, Error> {
        match (msg, state.as_mut()) {
            (PushMessage::Empty, _) => Err(Error::Invalid(
                "empty PushKvRequest (no header, chunk or commit)".into(),
            )),
            (PushMessage::Header(h), None) => {
                // The whole header is checked before the id is taken or a byte reserved.
                let info = validate_header(&self.layout, &h)?;
                let streams = h.num_streams;
                let reuse = h.reuse_prefix;
                drop(h);
                if streams > MAX_PUSH_STREAMS {
                    return Err(Error::Invalid(format!(
                        "header num_streams {streams} is over {MAX_PUSH_STREAMS}"
                    )));
                }
                tracing::Span::current()
                    .record("request_id", crate::clip(&info.request_id).as_ref());
                let group = self.groups.join_or_start(&info, streams as usize, || {
                    let slot = self.registry.begin_push(&info.request_id)?;
                    let prefix = match (&self.prefix, reuse) {
                        (Some(c), true) => c.lookup(info.wire_dtype, &info.prompt_token_ids),
                        _ => Vec::new(),
                    };
                    let ingest =
                        Ingest::with_prefix(&self.layout, &self.pool, info.clone(), prefix)?;
                    self.registry
                        .metrics()
                        .reused_tokens
                        .inc_by(ingest.reused_tokens() as u64);
                    Ok((slot, ingest))
                })?;
                let p = Push {
                    group,
                    started: Instant::now(),
                    bytes: 0,
                    chunks: 0,
                    acked_bytes: 0,
                    sent_commit: false,
                };
                // The first ack carries the lease, so the orchestrator has it before the commit.
                let first = p.ack(false);
                *state = Some(p);
                Ok(Stepped::Ack(first))
            }
            (PushMessage::Header(_), Some(_)) => {
                Err(Error::Invalid("second KvHeader in one push".into()))
            }
            (_, None) => Err(Error::Invalid(
                "the first message of a push must be a KvHeader".into(),
            )),
            (_, Some(p)) if p.sent_commit => Err(Error::Invalid("message after KvCommit".into())),
            (PushMessage::Chunk(c), Some(p)) => {
                p.group.chunk(&c)?;
                let bytes = (c.key.len() + c.value.len()) as u64;
                p.bytes += bytes;
                p.chunks += 1;
                let m = self.registry.metrics();
                m.chunks.inc();
                m.bytes.inc_by(bytes);
                if p.bytes - p.acked_bytes >= ACK_EVERY_BYTES {
                    p.acked_bytes = p.bytes;
                    return Ok(Stepped::Ack(p.ack(false)));
                }
                Ok(Stepped::Quiet)
            }
            (PushMessage::Commit(next_token_id), Some(p)) => {
                p.sent_commit = true;
                match p.group.commit(next_token_id)? {
                    CommitPart::Waiting => Ok(Stepped::Waiting),
                    CommitPart::Done => {
                        let reply = p.ack(true);
                        self.committed(p);
                        *state = None;
                        Ok(Stepped::Committed(reply))
                    }
                }
            }
        }
    }

    /// Records a push that committed (once, by the stream whose commit completed it).
    fn committed(&self, p: &Push) {
        let seconds = p.started.elapsed().as_secs_f64();
        self.registry.metrics().push_duration.observe(seconds);
        tracing::info!(
            streams = p.group.streams(),
            bytes = p.bytes,
            seconds,
            "kv committed"
        );
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
                let interrupted = async {
                    match &state {
                        Some(p) => interrupted(&p.group).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    next = inbound.next() => next,
                    e = interrupted => return (PushEnd::of(&e), Some(e.into())),
                    () = tokio::time::sleep(limits.idle) => {
                        let e = Error::PushTimeout(format!(
                            "no PushKv message for {:?} (push idle timeout); the push is dropped",
                            limits.idle
                        ));
                        return ended(&state, PushEnd::IdleTimeout, e);
                    }
                    () = tokio::time::sleep_until(deadline) => {
                        let e = Error::PushTimeout(format!(
                            "push not committed within {:?} (push deadline); it is dropped",
                            limits.deadline
                        ));
                        return ended(&state, PushEnd::Deadline, e);
                    }
                }
            };
            let msg = match next {
                None => {
                    // Half-closed without a commit: nothing was published, everything is freed.
                    let e = Error::Invalid("push stream ended before KvCommit".into());
                    return ended(&state, PushEnd::Incomplete, e);
                }
                Some(Ok(m)) => m,
                Some(Err(Inbound::Broken(why))) => {
                    // The client broke the stream: drop everything it held.
                    tracing::debug!(%why, "push stream broke");
                    self.registry.metrics().error("cancelled");
                    let e = Error::StreamFailed("a stream of this push broke".into());
                    ended(&state, PushEnd::ClientGone, e);
                    return (PushEnd::ClientGone, None);
                }
                Some(Err(Inbound::Refused(status))) => {
                    let e = Error::StreamFailed(status.message().to_string());
                    ended(&state, PushEnd::Refused, e);
                    return (PushEnd::Refused, Some(status));
                }
            };
            match self.step(&mut state, msg) {
                Ok(Stepped::Quiet) => {}
                Ok(Stepped::Ack(ack)) => {
                    if tx.send(Ok(ack)).await.is_err() {
                        self.registry.metrics().error("cancelled");
                        let e = Error::StreamFailed("a stream of this push went away".into());
                        ended(&state, PushEnd::ClientGone, e);
                        return (PushEnd::ClientGone, None);
                    }
                }
                Ok(Stepped::Committed(ack)) => {
                    let _ = tx.send(Ok(ack)).await;
                    return self.after_commit(&mut inbound).await;
                }
                Ok(Stepped::Waiting) => {
                    let Some(p) = state.as_ref() else {
                        unreachable!("a stream that waits has its push")
                    };
                    if let Err(e) = self.await_streams(p, deadline).await {
                        return (PushEnd::of(&e), Some(e.into()));
                    }
                    let _ = tx.send(Ok(p.ack(true))).await;
                    return self.after_commit(&mut inbound).await;
                }
                Err(e) => return ended(&state, PushEnd::of(&e), e),
            }
        }
    }

    /// A stream that committed its part waits for the push's other streams: until the push
    /// commits, fails, is stopped, or goes without a message on any of its streams for the
    /// idle timeout, and at most until the deadline.
    async fn await_streams(&self, p: &Push, deadline: tokio::time::Instant) -> Result<(), Error> {
        let idle = self.limits.idle;
        loop {
            let quiet = idle.saturating_sub(p.group.idle_for());
            tokio::select! {
                e = interrupted(&p.group) => return Err(e),
                state = p.group.resolved() => {
                    return match state {
                        GroupState::Failed(e) => Err(e),
                        GroupState::Committed | GroupState::Open => Ok(()),
                    };
                }
                () = tokio::time::sleep(quiet) => {
                    if p.group.idle_for() >= idle {
                        let e = Error::PushTimeout(format!(
                            "no PushKv message on any stream of this push for {idle:?} (push idle \
                             timeout) while this stream waited for the others to commit; the push \
                             is dropped"
                        ));
                        p.group.fail(Error::StreamFailed(e.to_string()));
                        return Err(e);
                    }
                }
                () = tokio::time::sleep_until(deadline) => {
                    let e = Error::PushTimeout(format!(
                        "push not committed within {:?} (push deadline); it is dropped",
                        self.limits.deadline
                    ));
                    p.group.fail(Error::StreamFailed(e.to_string()));
                    return Err(e);
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

    type WatchKvEventsStream = ReceiverStream<Result<KvEvents, Status>>;

    async fn watch_kv_events(
        &self,
        _req: Request<WatchKvEventsRequest>,
    ) -> Result<Response<Self::WatchKvEventsStream>, Status> {
        let cache = self.prefix.clone().ok_or_else(|| {
            Status::failed_precondition(
                "this node keeps no prefix cache (start it with --prefix-cache-bytes)",
            )
        })?;
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(watch_events(cache, tx));
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

/// Streams `cache`'s events to a watcher: a snapshot, then changes (batched as they
/// come); a watcher that lagged gets a snapshot again. Ends when the watcher goes.
async fn watch_events(cache: Arc<PrefixCache>, tx: mpsc::Sender<Result<KvEvents, Status>>) {
    use tokio::sync::broadcast::error::RecvError;
    // Subscribed before the snapshot is taken: a change in between is sent twice, never lost.
    let mut rx = cache.subscribe();
    let mut next = Some(KvEvents {
        snapshot: true,
        events: cache.snapshot().into_iter().map(event_pb).collect(),
    });
    loop {
        if let Some(m) = next.take()
            && tx.send(Ok(m)).await.is_err()
        {
            return;
        }
        let first = tokio::select! {
            r = rx.recv() => r,
            () = tx.closed() => return,
        };
        next = Some(match first {
            Ok(e) => {
                let mut events = vec![event_pb(e)];
                while let Ok(e) = rx.try_recv() {
                    events.push(event_pb(e));
                }
                KvEvents {
                    snapshot: false,
                    events,
                }
            }
            Err(RecvError::Lagged(_)) => KvEvents {
                snapshot: true,
                events: cache.snapshot().into_iter().map(event_pb).collect(),
            },
            Err(RecvError::Closed) => return,
        });
    }
}

fn event_pb(e: KvEvent) -> decode_node_proto::v1::KvEvent {
    use decode_node_proto::v1::kv_event::Event;
    use decode_node_proto::v1::{KvBlocksRemoved, KvBlocksStored};
    decode_node_proto::v1::KvEvent {
        event: Some(match e {
            KvEvent::Stored {
                parent,
                hashes,
                block_size,
            } => Event::Stored(KvBlocksStored {
                parent_hash: parent,
                block_hashes: hashes,
                block_size,
            }),
            KvEvent::Removed { hashes } => Event::Removed(KvBlocksRemoved {
                block_hashes: hashes,
            }),
        }),
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
            /// Announces two streams (each op sequence drives one of them).
            two: bool,
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
                proptest::bool::weighted(0.1),
                proptest::bool::weighted(0.2)
            )
                .prop_map(|(id, tokens, bad_model, bad_dtype, two)| Op::Header {
                    id,
                    tokens,
                    bad_model,
                    bad_dtype,
                    two
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
                two,
            } => {
                let mut h: KvHeader = header(&format!("r{id}"), *tokens as u32);
                h.num_streams = if *two { 2 } else { 0 };
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
        fn arbitrary_message_sequences_never_panic_or_leak(
            ops in proptest::collection::vec((0usize..2, op()), 0..24)
        ) {
            let l = layout();
            let pool = HostPool::new(l.geom, 24 * l.geom.block_bytes() as u64).unwrap();
            let registry = Registry::new(Duration::from_secs(60), IngestMetrics::default());
            let svc = KvTransferService::new(l, pool.clone(), registry.clone());
            // Two client streams, which may be two streams of one push.
            let mut states: [Option<Push>; 2] = [None, None];
            for (s, op) in &ops {
                let state = &mut states[*s];
                match op {
                    Op::Break => *state = None,
                    Op::Drop { id } => {
                        let _ = registry.drop_kv(&format!("r{id}"));
                    }
                    _ => {
                        if let Some(msg) = message(op) {
                            // As the service does: an error ends the stream and drops its state.
                            match svc.step(state, msg.into()) {
                                Ok(_) => {}
                                Err(_) => *state = None,
                            }
                        }
                    }
                }
                let u = pool.usage();
                prop_assert!(u.used + u.reserved <= u.capacity);
            }
            drop(states);
            for id in 0..4 {
                let _ = registry.drop_kv(&format!("r{id}"));
            }
            let u = pool.usage();
            prop_assert_eq!((u.used, u.reserved), (0, 0));
        }
    }
}

#[cfg(test)]
mod streams {
    //! A push on several streams (`KvHeader.num_streams`), as tensor-parallel ranks in
    //! separate processes send it: each stream its own KV heads.

    use super::*;
    use crate::IngestMetrics;
    use crate::ingest::tests::{chunk, head_part, header, layout};
    use attention::KvSource;
    use decode_node_proto::v1::KvHeader;
    use tonic::Code;

    struct Node {
        svc: KvTransferService,
        pool: HostPool,
        registry: Registry,
    }

    fn node(idle: Duration) -> Node {
        let l = layout();
        let pool = HostPool::new(l.geom, 64 * l.geom.block_bytes() as u64).unwrap();
        let registry = Registry::new(Duration::from_secs(60), IngestMetrics::default());
        let svc =
            KvTransferService::new(l, pool.clone(), registry.clone()).with_limits(PushLimits {
                idle,
                ..PushLimits::default()
            });
        Node {
            svc,
            pool,
            registry,
        }
    }

    fn tp_header(id: &str, streams: u32) -> KvHeader {
        KvHeader {
            num_streams: streams,
            reuse_prefix: false,
            ..header(id, 7)
        }
    }

    /// KV head `h` of every layer, as rank `h` of two sends it.
    fn rank_chunks(h: usize) -> Vec<PushMessage> {
        (0..2)
            .map(|layer| PushMessage::Chunk(head_part(&chunk(layer, 0, 7), h, 1, 2).into()))
            .collect()
    }

    fn used(pool: &HostPool) -> (u64, u64) {
        let u = pool.usage();
        (u.used, u.reserved)
    }

    #[tokio::test]
    async fn two_streams_of_one_push_commit_together_and_equal_one_stream() {
        let n = node(Duration::from_secs(10));
        let (mut a, mut b) = (None, None);
        n.svc
            .step(&mut a, PushMessage::Header(tp_header("tp", 2)))
            .unwrap();
        let held = used(&n.pool);
        n.svc
            .step(&mut b, PushMessage::Header(tp_header("tp", 2)))
            .unwrap();
        assert_eq!(used(&n.pool), held, "the second stream reserves nothing");
        // A third rank, or one with another prompt, is not let in.
        let e = n
            .svc
            .step(&mut None, PushMessage::Header(tp_header("tp", 2)))
            .unwrap_err();
        assert_eq!(e.code(), Code::AlreadyExists);
        for (m0, m1) in rank_chunks(0).into_iter().zip(rank_chunks(1)) {
            n.svc.step(&mut b, m1).unwrap();
            n.svc.step(&mut a, m0).unwrap();
        }
        assert!(matches!(
            n.svc.step(&mut a, PushMessage::Commit(Some(9))).unwrap(),
            Stepped::Waiting
        ));
        // One stream cannot commit for another.
        let e = n.svc.step(&mut a, PushMessage::Commit(None)).unwrap_err();
        assert!(e.to_string().contains("after KvCommit"), "{e}");
        let Stepped::Committed(ack) = n.svc.step(&mut b, PushMessage::Commit(None)).unwrap() else {
            panic!("the last commit publishes the push")
        };
        assert!(ack.committed && !ack.lease.is_empty());
        assert_eq!(a.as_ref().unwrap().ack(true).lease, ack.lease, "one lease");
        assert_eq!(ack.chunks_received, 2, "each stream counts its own chunks");
        let mut got = n.registry.claim("tp", Duration::ZERO).await.unwrap();
        assert_eq!(got.info.next_token_id, 9, "the token one stream committed");

        // The same KV on one stream.
        let mut whole = None;
        n.svc
            .step(&mut whole, PushMessage::Header(header("one", 7)))
            .unwrap();
        for layer in 0..2 {
            n.svc
                .step(&mut whole, PushMessage::Chunk(chunk(layer, 0, 7).into()))
                .unwrap();
        }
        n.svc.step(&mut whole, PushMessage::Commit(None)).unwrap();
        let mut one = n.registry.claim("one", Duration::ZERO).await.unwrap();
        for layer in 0..2 {
            for blk in 0..2 {
                assert_eq!(got.block(layer, blk), one.block(layer, blk));
            }
        }
        for (x, y) in got.take_digests().iter().zip(&one.take_digests()) {
            assert_eq!(format!("{x:?}"), format!("{y:?}"));
        }
        drop((a, b, got, one));
        assert_eq!(used(&n.pool), (0, 0));
    }

    #[test]
    fn a_joining_stream_must_send_the_same_header() {
        let n = node(Duration::from_secs(10));
        let mut a = None;
        n.svc
            .step(&mut a, PushMessage::Header(tp_header("tp", 2)))
            .unwrap();
        let other_prompt = KvHeader {
            prompt_token_ids: (1..8).collect(),
            ..tp_header("tp", 2)
        };
        let other_count = tp_header("tp", 3);
        for (h, field) in [
            (other_prompt, "prompt_token_ids"),
            (other_count, "num_streams"),
        ] {
            let e = n.svc.step(&mut None, PushMessage::Header(h)).unwrap_err();
            assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
            assert!(e.to_string().contains(field), "{e}");
        }
        // A stream announcing one stream does not join: the id is taken.
        let e = n
            .svc
            .step(&mut None, PushMessage::Header(header("tp", 7)))
            .unwrap_err();
        assert_eq!(e.code(), Code::AlreadyExists);
        let e = n
            .svc
            .step(
                &mut None,
                PushMessage::Header(tp_header("big", MAX_PUSH_STREAMS + 1)),
            )
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
    }

    #[test]
    fn a_stream_that_fails_ends_the_push_and_frees_it() {
        let n = node(Duration::from_secs(10));
        // One stream goes away, one sends a bad chunk, one commits a different first token.
        for how in 0..3 {
            let (mut a, mut b) = (None, None);
            n.svc
                .step(&mut a, PushMessage::Header(tp_header("tp", 2)))
                .unwrap();
            n.svc
                .step(&mut b, PushMessage::Header(tp_header("tp", 2)))
                .unwrap();
            for m in rank_chunks(0) {
                n.svc.step(&mut a, m).unwrap();
            }
            n.svc.step(&mut a, PushMessage::Commit(Some(3))).unwrap();
            match how {
                0 => drop(b.take()),
                1 => {
                    let mut c = head_part(&chunk(0, 0, 7), 1, 1, 2);
                    c.crc32c ^= 1;
                    let e = n
                        .svc
                        .step(&mut b, PushMessage::Chunk(c.into()))
                        .unwrap_err();
                    assert_eq!(e.code(), Code::InvalidArgument);
                    drop(b.take());
                }
                _ => {
                    for m in rank_chunks(1) {
                        n.svc.step(&mut b, m).unwrap();
                    }
                    let e = n
                        .svc
                        .step(&mut b, PushMessage::Commit(Some(4)))
                        .unwrap_err();
                    assert!(e.to_string().contains("differs"), "{e}");
                    drop(b.take());
                }
            }
            assert_eq!(used(&n.pool), (0, 0), "case {how}: freed at once");
            let GroupState::Failed(e) = a.as_ref().unwrap().group.state() else {
                panic!("case {how}: the push failed")
            };
            assert_eq!(e.code(), Code::Aborted, "{e}");
            drop(a);
            // The id is free for a new push.
            let mut again = None;
            n.svc
                .step(&mut again, PushMessage::Header(tp_header("tp", 2)))
                .unwrap();
            assert_eq!(again.as_ref().unwrap().group.state(), GroupState::Open);
        }
    }

    type Inbox = mpsc::Sender<Result<PushMessage, Inbound>>;
    type Outbox = mpsc::Receiver<Result<PushKvResponse, Status>>;

    /// One stream run by the service as `serve` runs it.
    fn stream(n: &Node) -> (Inbox, Outbox, tokio::task::JoinHandle<()>) {
        let (in_tx, in_rx) = mpsc::channel(16);
        let (out_tx, out_rx) = mpsc::channel(16);
        let svc = n.svc.clone();
        let task = tokio::spawn(async move {
            svc.run_push(ReceiverStream::new(in_rx), out_tx).await;
        });
        (in_tx, out_rx, task)
    }

    /// The stream's last reply.
    async fn last(mut rx: Outbox) -> Result<PushKvResponse, Status> {
        let mut end = Err(Status::unknown("no reply"));
        while let Some(r) = rx.recv().await {
            end = r;
        }
        end
    }

    #[tokio::test]
    async fn over_grpc_streams_each_stream_hears_the_commit_or_why_the_push_failed() {
        let n = node(Duration::from_millis(300));
        // Both commit: both are told.
        let (a_in, a_out, _) = stream(&n);
        let (b_in, b_out, _) = stream(&n);
        for (tx, h) in [(&a_in, 0), (&b_in, 1)] {
            tx.send(Ok(PushMessage::Header(tp_header("ok", 2))))
                .await
                .unwrap();
            for m in rank_chunks(h) {
                tx.send(Ok(m)).await.unwrap();
            }
        }
        a_in.send(Ok(PushMessage::Commit(None))).await.unwrap();
        drop(a_in); // half-closed after its commit, as a client does
        tokio::time::sleep(Duration::from_millis(50)).await;
        b_in.send(Ok(PushMessage::Commit(None))).await.unwrap();
        drop(b_in);
        assert!(last(a_out).await.unwrap().committed);
        assert!(last(b_out).await.unwrap().committed);
        assert!(n.registry.claim("ok", Duration::ZERO).await.is_ok());

        // One stream breaks after the other committed: the waiting one hears ABORTED.
        let (a_in, a_out, _) = stream(&n);
        let (b_in, b_out, _) = stream(&n);
        a_in.send(Ok(PushMessage::Header(tp_header("broken", 2))))
            .await
            .unwrap();
        b_in.send(Ok(PushMessage::Header(tp_header("broken", 2))))
            .await
            .unwrap();
        for m in rank_chunks(0) {
            a_in.send(Ok(m)).await.unwrap();
        }
        a_in.send(Ok(PushMessage::Commit(None))).await.unwrap();
        b_in.send(Err(Inbound::Broken("reset".into())))
            .await
            .unwrap();
        let e = last(a_out).await.unwrap_err();
        assert_eq!(e.code(), Code::Aborted, "{e:?}");
        drop(last(b_out).await);
        assert_eq!(used(&n.pool), (0, 0));

        // The second rank never comes: the first gives up after the idle timeout.
        let (a_in, a_out, _) = stream(&n);
        a_in.send(Ok(PushMessage::Header(tp_header("alone", 2))))
            .await
            .unwrap();
        for m in rank_chunks(0) {
            a_in.send(Ok(m)).await.unwrap();
        }
        a_in.send(Ok(PushMessage::Commit(None))).await.unwrap();
        let e = last(a_out).await.unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
        assert_eq!(used(&n.pool), (0, 0));

        // DropKv of a push on two streams ends both ABORTED.
        let (a_in, a_out, _) = stream(&n);
        let (b_in, b_out, _) = stream(&n);
        for tx in [&a_in, &b_in] {
            tx.send(Ok(PushMessage::Header(tp_header("dropped", 2))))
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let d = n.registry.drop_kv("dropped").unwrap();
        assert!(d.freed());
        for out in [a_out, b_out] {
            let e = last(out).await.unwrap_err();
            assert_eq!(e.code(), Code::Aborted, "{e:?}");
        }
        drop((a_in, b_in));
        assert_eq!(used(&n.pool), (0, 0));
    }
}
