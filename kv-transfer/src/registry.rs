//! Where pushes, `Generate` and the lease meet: one map from request id to its state.
//!
//! States: `Ingesting` (a push holds the id, and maybe a `Generate` waits for it),
//! `Committed` (KV waits for its `Generate`, under a lease) and `Waiting` (a `Generate`
//! arrived first and no push holds the id). A claim takes the KV out of the map: from then
//! on the engine owns it, and it frees itself on drop. Every waiting state is bounded: the
//! lease for committed KV, the caller's timeout for a claim.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, oneshot};

use crate::Error;
use crate::committed::CommittedKv;
use crate::metrics::IngestMetrics;

type Waiter = oneshot::Sender<Box<CommittedKv>>;

/// Why a push in flight was told to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// `DropKv`: the stream ends ABORTED.
    Dropped,
    /// `Decode.Cancel`: the stream ends CANCELLED.
    Cancelled,
}

impl StopReason {
    /// The error the push's stream ends with.
    pub fn error(self, id: &str) -> Error {
        match self {
            StopReason::Dropped => Error::Dropped(id.into()),
            StopReason::Cancelled => Error::Cancelled(id.into()),
        }
    }
}

/// Shared by a push in flight and the registry: a stop request that wakes the push at
/// once (a stalled client sends nothing that would let it notice), and the bytes it holds.
#[derive(Debug, Default)]
struct PushControl {
    /// 0: running; else a [`StopReason`] + 1.
    stop: AtomicU8,
    wake: Notify,
    held: AtomicU64,
    /// The push's lease: what a Generate, Cancel or DropKv of it presents.
    lease: String,
}

/// 128 random bits in hex: a lease nobody can guess from ids or timing.
fn new_lease() -> String {
    let mut b = [0u8; 16];
    // No OS randomness is a broken host; a lease from the clock still fences epochs.
    if getrandom::fill(&mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        b = t.to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Compares without an early exit, so timing does not reveal a prefix of the lease.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

impl PushControl {
    fn reason(&self) -> Option<StopReason> {
        match self.stop.load(Ordering::Acquire) {
            0 => None,
            1 => Some(StopReason::Dropped),
            _ => Some(StopReason::Cancelled),
        }
    }

    fn stop(&self, why: StopReason) {
        let code = match why {
            StopReason::Dropped => 1,
            StopReason::Cancelled => 2,
        };
        // The first reason wins; `notify_one` keeps a permit, so a push that is not
        // waiting yet still wakes.
        let _ = self
            .stop
            .compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire);
        self.wake.notify_one();
    }
}

/// What [`Registry::drop_kv`] and [`Registry::cancel`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// Committed KV, freed now (bytes).
    Committed(u64),
    /// A push in flight, told to stop; it frees what it holds (bytes) as it ends.
    Push(u64),
    /// Only a `Generate` waiting for KV that never came; it fails. Nothing was held.
    Waiter,
}

impl Dropped {
    /// Bytes of host KV freed.
    pub fn bytes(self) -> u64 {
        match self {
            Dropped::Committed(b) | Dropped::Push(b) => b,
            Dropped::Waiter => 0,
        }
    }

    /// True when memory was held (and so is freed).
    pub fn freed(self) -> bool {
        !matches!(self, Dropped::Waiter)
    }
}

#[derive(Debug)]
enum Entry {
    /// A push is in flight; `control` tells it to stop (DropKv, Cancel).
    Ingesting {
        control: Arc<PushControl>,
        waiter: Option<Waiter>,
    },
    Committed {
        kv: Box<CommittedKv>,
        deadline: Instant,
    },
    Waiting(Waiter),
}

/// Shared map of request states. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Registry {
    inner: Arc<Mutex<HashMap<String, Entry>>>,
    lease: Duration,
    metrics: IngestMetrics,
    draining: Arc<AtomicBool>,
    require_lease: bool,
}

/// Holds a request id for a push in flight; frees the id when dropped uncommitted.
#[derive(Debug)]
pub struct PushSlot {
    registry: Registry,
    id: String,
    control: Arc<PushControl>,
    done: bool,
}

/// A push's stop request, as every stream of the push sees it (see [`PushSlot::signal`]).
#[derive(Debug, Clone)]
pub struct StopSignal(Arc<PushControl>);

impl StopSignal {
    /// Why the push was asked to stop, if it was.
    pub fn reason(&self) -> Option<StopReason> {
        self.0.reason()
    }

    /// Resolves once `DropKv` or `Cancel` asks the push to stop. Where several tasks wait,
    /// one of them wakes; it is the one that tells the others.
    pub async fn stopped(&self) -> StopReason {
        loop {
            if let Some(why) = self.0.reason() {
                return why;
            }
            self.0.wake.notified().await;
        }
    }
}

impl PushSlot {
    /// Why the push was asked to stop, if it was.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.control.reason()
    }

    /// Resolves once `DropKv` or `Cancel` asks this push to stop.
    pub async fn stopped(&self) -> StopReason {
        self.signal().stopped().await
    }

    /// The stop request, for streams that share this push without holding the slot.
    pub fn signal(&self) -> StopSignal {
        StopSignal(self.control.clone())
    }

    /// The push's lease, for its client (an ack after the header, and the commit's).
    pub fn lease(&self) -> &str {
        &self.control.lease
    }

    /// Records the host KV bytes the push holds (what a `DropKv` reports freed).
    pub fn set_held(&self, bytes: u64) {
        self.control.held.store(bytes, Ordering::Release);
    }

    /// Removes this push's own entry (a later push of the same id has its own control).
    fn take_own(&self, map: &mut HashMap<String, Entry>) -> Option<Option<Waiter>> {
        match map.get(&self.id) {
            Some(Entry::Ingesting { control, .. }) if Arc::ptr_eq(control, &self.control) => {}
            _ => return None,
        }
        match map.remove(&self.id) {
            Some(Entry::Ingesting { waiter, .. }) => Some(waiter),
            _ => None,
        }
    }

    /// Publishes the committed KV: to a waiting `Generate` if any, else under the lease.
    pub fn commit(mut self, kv: CommittedKv) -> Result<(), Error> {
        self.done = true;
        let mut map = self.registry.lock();
        let waiter = self.take_own(&mut map).flatten();
        if let Some(why) = self.control.reason() {
            return Err(why.error(&self.id));
        }
        let mut kv = Box::new(kv);
        kv.lease = self.control.lease.clone();
        if let Some(tx) = waiter {
            match tx.send(kv) {
                Ok(()) => return Ok(()),
                // The Generate gave up a moment ago: keep the KV under lease.
                Err(back) => kv = back,
            }
        }
        let deadline = Instant::now() + self.registry.lease;
        map.insert(self.id.clone(), Entry::Committed { kv, deadline });
        Ok(())
    }
}

impl Drop for PushSlot {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut map = self.registry.lock();
        if let Some(waiter) = self.take_own(&mut map) {
            // A waiting Generate keeps waiting: the prefill node may retry the push.
            if let Some(tx) = waiter.filter(|tx| !tx.is_closed()) {
                map.insert(self.id.clone(), Entry::Waiting(tx));
            }
        }
    }
}

impl Registry {
    /// A registry whose committed KV lives `lease` without a claim.
    pub fn new(lease: Duration, metrics: IngestMetrics) -> Self {
        Self {
            inner: Arc::default(),
            lease,
            metrics,
            draining: Arc::default(),
            require_lease: false,
        }
    }

    /// The same registry, requiring every Generate, Cancel and DropKv to present its push's
    /// lease (`--require-lease`). A lease that is given is checked either way.
    pub fn with_require_lease(mut self, on: bool) -> Self {
        self.require_lease = on;
        self
    }

    /// PERMISSION_DENIED unless `given` may act on a request whose lease is `have`.
    pub fn fence(&self, id: &str, have: &str, given: &str) -> Result<(), Error> {
        if (self.require_lease || !given.is_empty()) && !same(have, given) {
            return Err(Error::Lease(id.into()));
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Metrics handles.
    pub fn metrics(&self) -> &IngestMetrics {
        &self.metrics
    }

    /// Stops admitting pushes (UNAVAILABLE).
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// True once draining.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Claims the id for a push: ALREADY_EXISTS when it holds KV or is being pushed.
    pub fn begin_push(&self, id: &str) -> Result<PushSlot, Error> {
        if self.is_draining() {
            return Err(Error::Draining);
        }
        let mut map = self.lock();
        let waiter = match map.remove(id) {
            Some(e @ (Entry::Ingesting { .. } | Entry::Committed { .. })) => {
                map.insert(id.into(), e);
                return Err(Error::AlreadyExists(id.into()));
            }
            Some(Entry::Waiting(tx)) => Some(tx),
            None => None,
        };
        let control = Arc::new(PushControl {
            lease: new_lease(),
            ..PushControl::default()
        });
        map.insert(
            id.into(),
            Entry::Ingesting {
                control: control.clone(),
                waiter,
            },
        );
        Ok(PushSlot {
            registry: self.clone(),
            id: id.into(),
            control,
            done: false,
        })
    }

    /// Takes the committed KV of `id`, waiting up to `timeout` for its push to commit.
    pub async fn claim(&self, id: &str, timeout: Duration) -> Result<Box<CommittedKv>, Error> {
        self.claim_leased(id, timeout, "").await
    }

    /// [`Registry::claim`] presenting `lease` (empty: none): KV of another lease stays where
    /// it is and the claim is refused PERMISSION_DENIED.
    pub async fn claim_leased(
        &self,
        id: &str,
        timeout: Duration,
        lease: &str,
    ) -> Result<Box<CommittedKv>, Error> {
        let mut rx = {
            let mut map = self.lock();
            let (tx, rx) = oneshot::channel();
            match map.get(id) {
                Some(Entry::Committed { kv, .. }) => self.fence(id, &kv.lease, lease)?,
                Some(Entry::Ingesting { control, .. }) => self.fence(id, &control.lease, lease)?,
                _ => {}
            }
            match map.remove(id) {
                Some(Entry::Committed { kv, .. }) => return Ok(kv),
                // No live waiter (none, or one whose Generate went away): this claim waits.
                Some(Entry::Ingesting { control, waiter })
                    if control.reason().is_none()
                        && waiter.as_ref().is_none_or(oneshot::Sender::is_closed) =>
                {
                    map.insert(
                        id.into(),
                        Entry::Ingesting {
                            control,
                            waiter: Some(tx),
                        },
                    );
                }
                // Another Generate waits for this push.
                Some(Entry::Ingesting {
                    control,
                    waiter: Some(w),
                }) if control.reason().is_none() => {
                    map.insert(
                        id.into(),
                        Entry::Ingesting {
                            control,
                            waiter: Some(w),
                        },
                    );
                    return Err(Error::AlreadyExists(format!(
                        "{id} (a Generate already waits for it)"
                    )));
                }
                // Its push was dropped or cancelled and is ending: there will be no KV.
                Some(e @ Entry::Ingesting { .. }) => {
                    map.insert(id.into(), e);
                    return Err(Error::NotFound(id.into()));
                }
                // A Generate that went away left its waiter behind: take its place.
                Some(Entry::Waiting(old)) if old.is_closed() => {
                    map.insert(id.into(), Entry::Waiting(tx));
                }
                Some(e @ Entry::Waiting(_)) => {
                    map.insert(id.into(), e);
                    return Err(Error::AlreadyExists(format!(
                        "{id} (a Generate already waits for it)"
                    )));
                }
                None => {
                    map.insert(id.into(), Entry::Waiting(tx));
                }
            }
            rx
        };
        let got = match tokio::time::timeout(timeout, &mut rx).await {
            Ok(Ok(kv)) => Ok(kv),
            Ok(Err(_)) => Err(Error::Cancelled(id.into())),
            Err(_) => {
                // A commit may hand the KV over right as the timeout fires: close the
                // channel, then take what was sent, so the KV is neither lost nor dropped.
                rx.close();
                if let Ok(kv) = rx.try_recv() {
                    return self.check_handed(id, kv, lease);
                }
                let mut map = self.lock();
                match map.remove(id) {
                    // The commit raced the timeout: take it after all.
                    Some(Entry::Committed { kv, .. }) => Ok(kv),
                    // Nothing arrived at all: the id is unknown here.
                    Some(Entry::Waiting(_)) | None => Err(Error::NotFound(id.into())),
                    Some(Entry::Ingesting { control, .. }) => {
                        map.insert(
                            id.into(),
                            Entry::Ingesting {
                                control,
                                waiter: None,
                            },
                        );
                        Err(Error::Timeout(id.into()))
                    }
                }
            }
        };
        self.check_handed(id, got?, lease)
    }

    /// KV handed to a claim that waited for its push: if its lease is not the one the claim
    /// presented, it goes back under its own lease and the claim is refused.
    fn check_handed(
        &self,
        id: &str,
        kv: Box<CommittedKv>,
        lease: &str,
    ) -> Result<Box<CommittedKv>, Error> {
        if let Err(e) = self.fence(id, &kv.lease, lease) {
            let deadline = Instant::now() + self.lease;
            self.lock()
                .insert(id.into(), Entry::Committed { kv, deadline });
            return Err(e);
        }
        Ok(kv)
    }

    /// `DropKv`: frees `id`'s committed KV, or ends its push in flight (ABORTED) — which
    /// frees what it holds at once, however silent its client — or fails its waiting
    /// `Generate`.
    pub fn drop_kv(&self, id: &str) -> Result<Dropped, Error> {
        self.stop(id, StopReason::Dropped, "")
    }

    /// `Cancel`: as [`Registry::drop_kv`], but a push in flight ends CANCELLED.
    pub fn cancel(&self, id: &str) -> Result<Dropped, Error> {
        self.stop(id, StopReason::Cancelled, "")
    }

    /// [`Registry::drop_kv`] or [`Registry::cancel`] presenting `lease` (empty: none).
    pub fn stop(&self, id: &str, why: StopReason, lease: &str) -> Result<Dropped, Error> {
        let mut map = self.lock();
        match map.get(id) {
            Some(Entry::Committed { kv, .. }) => self.fence(id, &kv.lease, lease)?,
            Some(Entry::Ingesting { control, .. }) => self.fence(id, &control.lease, lease)?,
            _ => {}
        }
        match map.remove(id) {
            Some(Entry::Committed { kv, .. }) => Ok(Dropped::Committed(kv.bytes())),
            Some(Entry::Ingesting { control, .. }) => {
                let held = control.held.load(Ordering::Acquire);
                control.stop(why);
                // The entry stays until the push task has ended and freed (so the id is
                // not reused meanwhile); dropping the waiter fails a waiting Generate.
                map.insert(
                    id.into(),
                    Entry::Ingesting {
                        control,
                        waiter: None,
                    },
                );
                Ok(Dropped::Push(held))
            }
            Some(Entry::Waiting(_)) => Ok(Dropped::Waiter),
            None => Err(Error::NotFound(id.into())),
        }
    }

    /// Frees committed KV whose lease ran out; returns how many.
    pub fn expire(&self, now: Instant) -> usize {
        let mut map = self.lock();
        let before = map.len();
        map.retain(|_, e| !matches!(e, Entry::Committed { deadline, .. } if *deadline <= now));
        let n = before - map.len();
        self.metrics.leases_expired.inc_by(n as u64);
        n
    }

    /// True when `id` has KV committed or a push of it in flight: what a `Generate` may
    /// still be served from while the node drains.
    pub fn holds(&self, id: &str) -> bool {
        matches!(
            self.lock().get(id),
            Some(Entry::Committed { .. } | Entry::Ingesting { .. })
        )
    }

    /// Requests with KV committed or being pushed: what a drain waits for.
    pub fn pending(&self) -> usize {
        self.lock()
            .values()
            .filter(|e| matches!(e, Entry::Committed { .. } | Entry::Ingesting { .. }))
            .count()
    }

    /// The end of a drain: frees every committed KV nobody claimed and stops every push in
    /// flight (ABORTED); returns each request dropped and the bytes it held.
    pub fn drop_all(&self) -> Vec<(String, u64)> {
        let mut map = self.lock();
        let mut out = Vec::new();
        map.retain(|id, e| match e {
            Entry::Committed { kv, .. } => {
                out.push((id.clone(), kv.bytes()));
                false
            }
            Entry::Ingesting { control, .. } => {
                out.push((id.clone(), control.held.load(Ordering::Acquire)));
                control.stop(StopReason::Dropped);
                true
            }
            Entry::Waiting(_) => false,
        });
        out
    }

    /// Committed requests nobody has claimed yet.
    pub fn committed_unclaimed(&self) -> usize {
        self.lock()
            .values()
            .filter(|e| matches!(e, Entry::Committed { .. }))
            .count()
    }

    /// Runs [`Registry::expire`] every `period`, forever (abort the handle to stop).
    pub fn spawn_lease_sweeper(&self, period: Duration) -> tokio::task::JoinHandle<()> {
        let reg = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            loop {
                tick.tick().await;
                reg.expire(Instant::now());
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostPool;
    use crate::ingest::Ingest;
    use crate::ingest::tests::{chunk, header, layout};

    fn committed(pool: &HostPool, id: &str) -> CommittedKv {
        let mut ing = Ingest::begin(&layout(), pool, &header(id, 4)).unwrap();
        ing.chunk(&chunk(0, 0, 4).into()).unwrap();
        ing.chunk(&chunk(1, 0, 4).into()).unwrap();
        ing.commit(None).unwrap()
    }

    fn setup(lease_ms: u64) -> (Registry, HostPool) {
        let pool = HostPool::new(layout().geom, 64 * layout().geom.block_bytes() as u64).unwrap();
        (
            Registry::new(Duration::from_millis(lease_ms), IngestMetrics::default()),
            pool,
        )
    }

    #[tokio::test]
    async fn push_then_claim_and_claim_then_push() {
        let (reg, pool) = setup(60_000);
        reg.begin_push("a")
            .unwrap()
            .commit(committed(&pool, "a"))
            .unwrap();
        assert!(matches!(reg.begin_push("a"), Err(Error::AlreadyExists(_))));
        let kv = reg.claim("a", Duration::from_millis(10)).await.unwrap();
        assert_eq!(kv.num_tokens(), 4);

        let r2 = reg.clone();
        let waiter = tokio::spawn(async move { r2.claim("b", Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let slot = reg.begin_push("b").unwrap();
        slot.commit(committed(&pool, "b")).unwrap();
        assert_eq!(waiter.await.unwrap().unwrap().info.request_id, "b");
    }

    #[tokio::test]
    async fn claim_times_out_and_lease_expires() {
        let (reg, pool) = setup(0);
        assert!(matches!(
            reg.claim("x", Duration::from_millis(5)).await,
            Err(Error::NotFound(_))
        ));
        let slot = reg.begin_push("y").unwrap();
        assert!(matches!(
            reg.claim("y", Duration::from_millis(5)).await,
            Err(Error::Timeout(_))
        ));
        drop(slot);
        reg.begin_push("a")
            .unwrap()
            .commit(committed(&pool, "a"))
            .unwrap();
        assert!(pool.usage().used > 0);
        assert_eq!(reg.expire(Instant::now()), 1);
        assert_eq!(pool.usage().used, 0);
        assert_eq!(reg.metrics().leases_expired.get(), 1);
        assert!(matches!(reg.drop_kv("a"), Err(Error::NotFound(_))));
    }

    #[tokio::test]
    async fn abandoned_push_frees_and_a_retry_serves_the_waiter() {
        let (reg, pool) = setup(60_000);
        let r2 = reg.clone();
        let waiter = tokio::spawn(async move { r2.claim("c", Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        {
            let _slot = reg.begin_push("c").unwrap();
            let _ing = Ingest::begin(&layout(), &pool, &header("c", 4)).unwrap();
            // Both dropped: the client went away mid-push.
        }
        assert_eq!(pool.usage().used, 0);
        reg.begin_push("c")
            .unwrap()
            .commit(committed(&pool, "c"))
            .unwrap();
        assert!(waiter.await.unwrap().is_ok());
    }

    #[tokio::test]
    async fn one_live_waiter_per_push_and_a_gone_one_gives_way() {
        let (reg, pool) = setup(60_000);
        let slot = reg.begin_push("w").unwrap();
        let r2 = reg.clone();
        let first = tokio::spawn(async move { r2.claim("w", Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        // A second Generate while the first waits on the push in flight: refused, and the
        // push is left alone.
        let second = reg.claim("w", Duration::from_millis(10)).await;
        assert!(matches!(second, Err(Error::AlreadyExists(_))), "{second:?}");
        // The first goes away: the next one takes its place and gets the KV.
        first.abort();
        let _ = first.await;
        let r3 = reg.clone();
        let third = tokio::spawn(async move { r3.claim("w", Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        slot.commit(committed(&pool, "w")).unwrap();
        assert_eq!(third.await.unwrap().unwrap().info.request_id, "w");
    }

    #[tokio::test]
    async fn drop_kv_stops_a_push_in_flight_and_reports_what_it_held() {
        let (reg, pool) = setup(60_000);
        let slot = reg.begin_push("d").unwrap();
        slot.set_held(4096);
        // A push that is not waiting yet still wakes: the stop leaves a permit.
        assert_eq!(reg.drop_kv("d"), Ok(Dropped::Push(4096)));
        assert_eq!(
            tokio::time::timeout(Duration::from_secs(1), slot.stopped()).await,
            Ok(StopReason::Dropped)
        );
        // The id stays busy until the push has ended.
        assert!(matches!(reg.begin_push("d"), Err(Error::AlreadyExists(_))));
        assert!(matches!(
            slot.commit(committed(&pool, "d")),
            Err(Error::Dropped(_))
        ));
        assert_eq!(pool.usage().used, 0);
        assert!(reg.begin_push("d").is_ok());
    }

    #[tokio::test]
    async fn cancel_wakes_a_waiting_push_and_a_late_slot_leaves_the_new_push_alone() {
        let (reg, _pool) = setup(60_000);
        let old = reg.begin_push("e").unwrap();
        let waiting = tokio::spawn(async move {
            let why = old.stopped().await;
            (why, old)
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(reg.cancel("e"), Ok(Dropped::Push(0)));
        let (why, old) = waiting.await.unwrap();
        assert_eq!(why, StopReason::Cancelled);
        // A second stop keeps the first reason.
        assert_eq!(reg.drop_kv("e"), Ok(Dropped::Push(0)));
        assert_eq!(old.stop_reason(), Some(StopReason::Cancelled));
        drop(old);
        let new = reg.begin_push("e").unwrap();
        assert_eq!(new.stop_reason(), None);
        assert_eq!(reg.drop_kv("nobody"), Err(Error::NotFound("nobody".into())));
    }

    #[tokio::test]
    async fn dropping_a_waiting_generate_frees_nothing() {
        let (reg, _pool) = setup(60_000);
        let r2 = reg.clone();
        let waiter = tokio::spawn(async move { r2.claim("w", Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let d = reg.drop_kv("w").unwrap();
        assert_eq!((d, d.freed(), d.bytes()), (Dropped::Waiter, false, 0));
        assert!(matches!(waiter.await.unwrap(), Err(Error::Cancelled(_))));
    }

    /// A commit landing as a waiting claim times out: the KV ends with the claim or stays
    /// committed for a retry, never lost in between.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_commit_racing_a_claim_timeout_never_loses_the_kv() {
        let (reg, pool) = setup(60_000);
        for i in 0..200u64 {
            let id = format!("race{i}");
            let slot = reg.begin_push(&id).unwrap();
            let kv = committed(&pool, &id);
            let r2 = reg.clone();
            let id2 = id.clone();
            let claim =
                tokio::spawn(async move { r2.claim(&id2, Duration::from_micros(500)).await });
            // Land the commit around the timeout, earlier or later by turns.
            std::thread::sleep(Duration::from_micros(300 + (i % 5) * 100));
            slot.commit(kv).unwrap();
            match claim.await.unwrap() {
                Ok(kv) => drop(kv),
                Err(e) => {
                    assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e}");
                    assert_eq!(reg.committed_unclaimed(), 1, "round {i}: the KV stays");
                    reg.drop_kv(&id).unwrap();
                }
            }
            let u = pool.usage();
            assert_eq!((u.used, u.reserved), (0, 0), "round {i}");
        }
    }

    /// A lease, once given, fences claims and drops: a wrong one is refused and leaves the
    /// KV where it was; the right one works.
    #[tokio::test]
    async fn a_wrong_lease_is_refused_and_leaves_the_kv() {
        let (reg, pool) = setup(60_000);
        let reg = reg.with_require_lease(true);
        let slot = reg.begin_push("l").unwrap();
        let lease = slot.lease().to_string();
        slot.commit(committed(&pool, "l")).unwrap();
        for wrong in ["", "x", &"0".repeat(32)] {
            let e = reg.claim_leased("l", Duration::from_millis(5), wrong).await;
            assert_eq!(e.unwrap_err().code(), tonic::Code::PermissionDenied);
            let e = reg.stop("l", StopReason::Dropped, wrong).unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied);
            assert_eq!(reg.committed_unclaimed(), 1);
        }
        let kv = reg
            .claim_leased("l", Duration::from_millis(5), &lease)
            .await
            .unwrap();
        assert_eq!(kv.lease(), lease);
        // A claim that waits for a push is handed the KV only under its own lease.
        let r2 = reg.clone();
        let waiter =
            tokio::spawn(async move { r2.claim_leased("w", Duration::from_secs(5), "bad").await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let slot = reg.begin_push("w").unwrap();
        slot.commit(committed(&pool, "w")).unwrap();
        let e = waiter.await.unwrap().unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert_eq!(
            reg.committed_unclaimed(),
            1,
            "the KV went back under its lease"
        );
    }
}
