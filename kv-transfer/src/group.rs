//! The streams of one push: a push may arrive on several streams (`KvHeader.num_streams`),
//! from producers in separate processes — tensor-parallel ranks pushing their own KV heads,
//! pipeline stages their own layers. They share one [`Ingest`] and one registry slot; the
//! KV commits when every stream has committed, and a stream that fails ends them all.
//! A plain push is a group of one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::Error;
use crate::ingest::{Ingest, PromptInfo};
use crate::registry::{PushSlot, StopSignal};
use crate::wire::Chunk;

/// Most streams one push may arrive on.
pub const MAX_PUSH_STREAMS: u32 = 256;

/// Where a push stands, as all its streams see it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum GroupState {
    Open,
    Committed,
    /// Ended uncommitted; what the streams still running end with.
    Failed(Error),
}

#[derive(Debug)]
struct Live {
    slot: PushSlot,
    ingest: Ingest,
}

#[derive(Debug)]
struct Inner {
    /// Taken when the push commits or fails, which frees the id and the blocks at once.
    live: Option<Live>,
    joined: usize,
    committed: usize,
    /// The first token decode feeds, as the commits named it (they must agree).
    next_token: Option<u32>,
    last_activity: Instant,
}

/// What one stream's commit did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CommitPart {
    /// This was the last stream: the KV is published.
    Done,
    /// Other streams have yet to commit.
    Waiting,
}

/// One push and the streams it arrives on.
#[derive(Debug)]
pub(crate) struct PushGroup {
    info: PromptInfo,
    /// Leading tokens taken from the prefix cache.
    reused_tokens: usize,
    streams: usize,
    lease: String,
    signal: StopSignal,
    inner: Mutex<Inner>,
    state: watch::Sender<GroupState>,
}

impl PushGroup {
    /// A push whose first stream took `slot` and reserved `ingest`; `streams` will send it.
    pub(crate) fn new(slot: PushSlot, ingest: Ingest, streams: usize) -> Arc<Self> {
        slot.set_held(ingest.bytes_held());
        Arc::new(Self {
            info: ingest.info().clone(),
            reused_tokens: ingest.reused_tokens(),
            streams,
            lease: slot.lease().to_string(),
            signal: slot.signal(),
            inner: Mutex::new(Inner {
                live: Some(Live { slot, ingest }),
                joined: 1,
                committed: 0,
                next_token: None,
                last_activity: Instant::now(),
            }),
            state: watch::Sender::new(GroupState::Open),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn request_id(&self) -> &str {
        &self.info.request_id
    }

    pub(crate) fn lease(&self) -> &str {
        &self.lease
    }

    pub(crate) fn reused_tokens(&self) -> usize {
        self.reused_tokens
    }

    pub(crate) fn streams(&self) -> usize {
        self.streams
    }

    pub(crate) fn signal(&self) -> &StopSignal {
        &self.signal
    }

    pub(crate) fn state(&self) -> GroupState {
        self.state.borrow().clone()
    }

    /// Resolves once the push has committed or failed.
    pub(crate) async fn resolved(&self) -> GroupState {
        let mut rx = self.state.subscribe();
        match rx.wait_for(|s| *s != GroupState::Open).await {
            Ok(s) => s.clone(),
            // The sender lives as long as `self`.
            Err(_) => GroupState::Open,
        }
    }

    /// How long no stream of the push has sent anything.
    pub(crate) fn idle_for(&self) -> Duration {
        self.lock().last_activity.elapsed()
    }

    /// Lets one more stream in: it must send the first stream's header, while streams are
    /// missing. A push that has all its streams, or has ended, is ALREADY_EXISTS.
    pub(crate) fn join(&self, info: &PromptInfo, streams: usize) -> Result<(), Error> {
        let mut g = self.lock();
        if g.live.is_none() || g.joined >= self.streams {
            return Err(Error::AlreadyExists(info.request_id.clone()));
        }
        let differs = |field: &'static str, expected: String, got: String| Error::Mismatch {
            field,
            expected: format!("{expected} (this push's first stream)"),
            got,
        };
        if streams != self.streams {
            return Err(differs(
                "num_streams",
                self.streams.to_string(),
                streams.to_string(),
            ));
        }
        if info.wire_dtype != self.info.wire_dtype {
            return Err(differs(
                "dtype",
                format!("{:?}", self.info.wire_dtype),
                format!("{:?}", info.wire_dtype),
            ));
        }
        if info.next_token_id != self.info.next_token_id {
            return Err(differs(
                "next_token_id",
                self.info.next_token_id.to_string(),
                info.next_token_id.to_string(),
            ));
        }
        if info.prompt_token_ids != self.info.prompt_token_ids {
            return Err(differs(
                "prompt_token_ids",
                format!("{} tokens", self.info.prompt_token_ids.len()),
                format!("{} tokens, or other ids", info.prompt_token_ids.len()),
            ));
        }
        g.joined += 1;
        g.last_activity = Instant::now();
        Ok(())
    }

    /// The state a push that is no longer open ended in, as an error for a stream that
    /// still sends to it.
    fn ended(&self) -> Error {
        match self.state() {
            GroupState::Failed(e) => e,
            _ => Error::Invalid("the push has already committed".into()),
        }
    }

    /// Writes one stream's chunk.
    pub(crate) fn chunk(&self, c: &Chunk) -> Result<(), Error> {
        let mut g = self.lock();
        g.last_activity = Instant::now();
        let Some(live) = g.live.as_mut() else {
            return Err(self.ended());
        };
        if let Some(why) = live.slot.stop_reason() {
            return Err(why.error(&self.info.request_id));
        }
        live.ingest.chunk(c)
    }

    /// One stream's commit; the last one publishes the KV. The streams must agree on the
    /// first decode token where they name it.
    pub(crate) fn commit(&self, next_token: Option<u32>) -> Result<CommitPart, Error> {
        let mut g = self.lock();
        g.last_activity = Instant::now();
        if g.live.is_none() {
            return Err(self.ended());
        }
        if let (Some(a), Some(b)) = (g.next_token, next_token)
            && a != b
        {
            return Err(Error::Invalid(format!(
                "commit's next_token_id {b} differs from {a}, which another stream of this push committed"
            )));
        }
        g.next_token = g.next_token.or(next_token);
        g.committed += 1;
        if g.committed < self.streams {
            return Ok(CommitPart::Waiting);
        }
        let Some(Live { slot, ingest }) = g.live.take() else {
            unreachable!("checked above")
        };
        let next_token = g.next_token;
        drop(g);
        let published = ingest.commit(next_token).and_then(|kv| slot.commit(kv));
        match published {
            Ok(()) => {
                self.state.send_replace(GroupState::Committed);
                Ok(CommitPart::Done)
            }
            Err(e) => {
                // The ingest and the slot were dropped above: everything is freed.
                self.state
                    .send_replace(GroupState::Failed(Error::StreamFailed(e.to_string())));
                Err(e)
            }
        }
    }

    /// Ends the push uncommitted: frees its blocks and its id now, and ends every other
    /// stream with `for_others`. The first failure wins; a committed push stays committed.
    pub(crate) fn fail(&self, for_others: Error) {
        let live = self.lock().live.take();
        if live.is_some() {
            self.state.send_replace(GroupState::Failed(for_others));
        }
        drop(live);
    }
}

/// The pushes on several streams that may still be joined, by request id.
#[derive(Debug, Clone, Default)]
pub(crate) struct Groups(Arc<Mutex<HashMap<String, Weak<PushGroup>>>>);

impl Groups {
    /// The open push of `id` that a stream announcing `streams` joins, or a new one made by
    /// `start` (which takes the id in the registry and reserves the KV).
    pub(crate) fn join_or_start(
        &self,
        info: &PromptInfo,
        streams: usize,
        start: impl FnOnce() -> Result<(PushSlot, Ingest), Error>,
    ) -> Result<Arc<PushGroup>, Error> {
        if streams <= 1 {
            let (slot, ingest) = start()?;
            return Ok(PushGroup::new(slot, ingest, 1));
        }
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(g) = map.get(&info.request_id).and_then(Weak::upgrade)
            && g.state() == GroupState::Open
        {
            g.join(info, streams)?;
            return Ok(g);
        }
        map.retain(|_, w| w.upgrade().is_some_and(|g| g.state() == GroupState::Open));
        let (slot, ingest) = start()?;
        let g = PushGroup::new(slot, ingest, streams);
        map.insert(info.request_id.clone(), Arc::downgrade(&g));
        Ok(g)
    }
}
