//! Where pushes, `Generate` and the lease meet: one map from request id to its state.
//!
//! States: `Ingesting` (a push holds the id, and maybe a `Generate` waits for it),
//! `Committed` (KV waits for its `Generate`, under a lease) and `Waiting` (a `Generate`
//! arrived first and no push holds the id). A claim takes the KV out of the map: from then
//! on the engine owns it, and it frees itself on drop. Every waiting state is bounded: the
//! lease for committed KV, the caller's timeout for a claim.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::Error;
use crate::ingest::CommittedKv;
use crate::metrics::IngestMetrics;

type Waiter = oneshot::Sender<Box<CommittedKv>>;

#[derive(Debug)]
enum Entry {
    /// A push is in flight; the flag tells it to stop (DropKv).
    Ingesting {
        cancelled: Arc<AtomicBool>,
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
}

/// Holds a request id for a push in flight; frees the id when dropped uncommitted.
#[derive(Debug)]
pub struct PushSlot {
    registry: Registry,
    id: String,
    cancelled: Arc<AtomicBool>,
    done: bool,
}

impl PushSlot {
    /// True once `DropKv` asked this push to stop.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// Publishes the committed KV: to a waiting `Generate` if any, else under the lease.
    pub fn commit(mut self, kv: CommittedKv) -> Result<(), Error> {
        self.done = true;
        let mut map = self.registry.lock();
        let waiter = match map.remove(&self.id) {
            Some(Entry::Ingesting { waiter, .. }) => waiter,
            _ => None,
        };
        if self.cancelled.load(Ordering::Acquire) {
            return Err(Error::Cancelled(self.id.clone()));
        }
        let mut kv = Box::new(kv);
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
        if let Some(Entry::Ingesting { waiter, .. }) = map.remove(&self.id) {
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
        }
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
        let cancelled = Arc::new(AtomicBool::new(false));
        map.insert(
            id.into(),
            Entry::Ingesting {
                cancelled: cancelled.clone(),
                waiter,
            },
        );
        Ok(PushSlot {
            registry: self.clone(),
            id: id.into(),
            cancelled,
            done: false,
        })
    }

    /// Takes the committed KV of `id`, waiting up to `timeout` for its push to commit.
    pub async fn claim(&self, id: &str, timeout: Duration) -> Result<Box<CommittedKv>, Error> {
        let rx = {
            let mut map = self.lock();
            let (tx, rx) = oneshot::channel();
            match map.remove(id) {
                Some(Entry::Committed { kv, .. }) => return Ok(kv),
                Some(Entry::Ingesting {
                    cancelled,
                    waiter: None,
                }) => {
                    map.insert(
                        id.into(),
                        Entry::Ingesting {
                            cancelled,
                            waiter: Some(tx),
                        },
                    );
                }
                // A Generate that went away left its waiter behind: take its place.
                Some(Entry::Waiting(old)) if old.is_closed() => {
                    map.insert(id.into(), Entry::Waiting(tx));
                }
                Some(e @ (Entry::Waiting(_) | Entry::Ingesting { .. })) => {
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
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(kv)) => Ok(kv),
            Ok(Err(_)) => Err(Error::Cancelled(id.into())),
            Err(_) => {
                let mut map = self.lock();
                match map.remove(id) {
                    // The commit raced the timeout: take it after all.
                    Some(Entry::Committed { kv, .. }) => Ok(kv),
                    // Nothing arrived at all: the id is unknown here.
                    Some(Entry::Waiting(_)) | None => Err(Error::NotFound(id.into())),
                    Some(Entry::Ingesting { cancelled, .. }) => {
                        map.insert(
                            id.into(),
                            Entry::Ingesting {
                                cancelled,
                                waiter: None,
                            },
                        );
                        Err(Error::Timeout(id.into()))
                    }
                }
            }
        }
    }

    /// Frees `id`'s committed KV, tells its push to stop, or fails its waiting `Generate`.
    /// Returns the bytes freed now.
    pub fn drop_kv(&self, id: &str) -> Result<u64, Error> {
        let mut map = self.lock();
        match map.remove(id) {
            Some(Entry::Committed { kv, .. }) => Ok(kv.bytes()),
            Some(Entry::Ingesting { cancelled, .. }) => {
                cancelled.store(true, Ordering::Release);
                // Dropping the waiter tells a waiting Generate it was cancelled.
                map.insert(
                    id.into(),
                    Entry::Ingesting {
                        cancelled,
                        waiter: None,
                    },
                );
                Ok(0)
            }
            Some(Entry::Waiting(_)) => Ok(0),
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
        ing.commit().unwrap()
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
    async fn drop_kv_cancels_a_push_in_flight() {
        let (reg, pool) = setup(60_000);
        let slot = reg.begin_push("d").unwrap();
        assert_eq!(reg.drop_kv("d"), Ok(0));
        assert!(slot.is_cancelled());
        assert!(matches!(
            slot.commit(committed(&pool, "d")),
            Err(Error::Cancelled(_))
        ));
        assert_eq!(pool.usage().used, 0);
        assert!(reg.begin_push("d").is_ok());
    }
}
