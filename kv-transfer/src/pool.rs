//! The host KV pool: fixed-size blocks carved from one allocation made at start-up.
//!
//! Memory is accounted in two steps, so a push can be refused before any byte is read:
//! [`HostPool::reserve`] promises blocks (a [`Reservation`]), and [`Reservation::take`] turns a
//! promise into a [`Block`]. Both are RAII: dropping a reservation returns what it did not
//! take, dropping a block returns it to the free list. No error path can leak.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use attention::BlockGeometry;

use crate::Error;

/// Byte counts of the pool, for `host_kv_bytes{state}` and `GetLoad`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolUsage {
    /// Bytes in blocks handed out.
    pub used: u64,
    /// Bytes promised to reservations and not yet taken.
    pub reserved: u64,
    /// Bytes of the whole pool.
    pub capacity: u64,
}

/// The pool's memory: one anonymous mapping, so pages cost RSS only once written.
struct Region {
    ptr: NonNull<u8>,
    /// Owns the mapping `ptr` points into; unmapped on drop.
    _map: Option<memmap2::MmapMut>,
}

// SAFETY: the region is plain bytes; access is partitioned by block index (see `Block`).
unsafe impl Send for Region {}
// SAFETY: as above; no two live `Block`s share an index.
unsafe impl Sync for Region {}

struct Inner {
    geom: BlockGeometry,
    block_bytes: usize,
    num_blocks: usize,
    region: Region,
    free: Mutex<Vec<u32>>,
    /// Blocks promised (taken or not) to live reservations.
    promised: AtomicUsize,
    /// Blocks handed out.
    taken: AtomicUsize,
    /// Frees idle cached blocks when a reservation would fail (the prefix cache).
    reclaimer: std::sync::OnceLock<Reclaimer>,
}

/// Asked for a number of pool blocks, frees what it can of them and says how many.
pub type Reclaimer = Box<dyn Fn(usize) -> usize + Send + Sync>;

/// `len` zeroed bytes in an anonymous mapping advised onto transparent huge pages, for data
/// the CPU streams (the KV pool; `bench`'s probes of read bandwidth, so that their bound is
/// what such memory allows). On 4 KiB pages a stream crosses a page every 64 lines, each a
/// TLB fill (a two-level walk under nested paging) and a stop for the hardware prefetchers.
/// Measured on a 2-core EPYC VM (AVX2 paths, alternating builds): one thread read 512 MiB at
/// 18-23 GB/s on 4 KiB pages and 28-31 on 2 MiB, and attended bf16 KV 10-35% faster (G=1 and
/// G=8); a batch of 8 at 4k tokens decoded 164-170 tok/s against 140-160. Best effort: where
/// the kernel has no transparent huge pages (or `enabled` is `never`), small pages, as
/// before. With `defrag` at its default (`madvise`), a fault may compact memory to find a
/// huge page.
pub fn map_huge(len: usize) -> std::io::Result<memmap2::MmapMut> {
    let map = memmap2::MmapOptions::new().len(len).map_anon()?;
    #[cfg(target_os = "linux")]
    if let Err(e) = map.advise(memmap2::Advice::HugePage) {
        tracing::debug!(error = %e, len, "no transparent huge pages for an anonymous mapping");
    }
    Ok(map)
}

/// A pool of KV blocks of one [`BlockGeometry`]. Cheap to clone (shared).
#[derive(Clone)]
pub struct HostPool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for HostPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPool")
            .field("geom", &self.inner.geom)
            .field("num_blocks", &self.inner.num_blocks)
            .field("usage", &self.usage())
            .finish()
    }
}

impl HostPool {
    /// Allocates `capacity_bytes / block_bytes` blocks up front (zeroed, page-aligned, on huge
    /// pages where the kernel gives them: [`map_huge`]; the OS maps pages lazily, so resident
    /// memory grows as blocks are written, 2 MiB at a time on huge pages).
    pub fn new(geom: BlockGeometry, capacity_bytes: u64) -> Result<Self, Error> {
        Self::with_prefault(geom, capacity_bytes, false)
    }

    /// As [`HostPool::new`]; with `prefault`, every page is made resident up front,
    /// trading start-up time for no page faults while KV arrives and a
    /// resident size that no longer moves with use.
    pub fn with_prefault(
        geom: BlockGeometry,
        capacity_bytes: u64,
        prefault: bool,
    ) -> Result<Self, Error> {
        let block_bytes = geom.block_bytes();
        if block_bytes == 0 {
            return Err(Error::Config("KV block size is zero bytes".into()));
        }
        let num_blocks = usize::try_from(capacity_bytes / block_bytes as u64)
            .map_err(|_| Error::Config("host KV capacity does not fit in memory".into()))?
            .min(u32::MAX as usize);
        let size = num_blocks * block_bytes;
        // An anonymous mapping rather than the allocator: aligned allocations are zeroed
        // eagerly by glibc, which would make a 64 GiB pool resident at start-up.
        let (ptr, map) = if size == 0 {
            (NonNull::dangling(), None)
        } else {
            let mut map = map_huge(size).map_err(|e| {
                Error::Config(format!("cannot map {size} bytes of host KV pool: {e}"))
            })?;
            if prefault {
                // Touched after the advice (MAP_POPULATE would fault small pages first).
                for page in map.chunks_mut(4096) {
                    // SAFETY: a write of one byte inside the mapping; volatile so it is kept.
                    unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) };
                }
            }
            let ptr = NonNull::new(map.as_mut_ptr())
                .ok_or_else(|| Error::Config("host KV pool mapped at null".into()))?;
            (ptr, Some(map))
        };
        let free = (0..num_blocks as u32).rev().collect();
        Ok(Self {
            inner: Arc::new(Inner {
                geom,
                block_bytes,
                num_blocks,
                region: Region { ptr, _map: map },
                free: Mutex::new(free),
                promised: AtomicUsize::new(0),
                taken: AtomicUsize::new(0),
                reclaimer: std::sync::OnceLock::new(),
            }),
        })
    }

    /// The whole pool's memory (start, bytes), for a device backend to page-lock it
    /// (`cuMemHostRegister`) so that copies to the device run asynchronously. The range stays
    /// mapped while any clone of this pool lives.
    pub fn region(&self) -> (NonNull<u8>, usize) {
        (
            self.inner.region.ptr,
            self.inner.num_blocks * self.inner.block_bytes,
        )
    }

    /// Geometry of every block.
    pub fn geometry(&self) -> &BlockGeometry {
        &self.inner.geom
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.inner.num_blocks
    }

    /// Current byte counts.
    pub fn usage(&self) -> PoolUsage {
        let bb = self.inner.block_bytes as u64;
        let promised = self.inner.promised.load(Ordering::Acquire) as u64;
        let taken = self.inner.taken.load(Ordering::Acquire) as u64;
        PoolUsage {
            used: taken * bb,
            reserved: promised.saturating_sub(taken) * bb,
            capacity: self.inner.num_blocks as u64 * bb,
        }
    }

    /// Sets what frees blocks held only by a cache when a reservation falls short (once; a
    /// second call is ignored).
    pub fn set_reclaimer(&self, r: Reclaimer) {
        let _ = self.inner.reclaimer.set(r);
    }

    /// Promises `blocks` blocks, or fails with [`Error::Exhausted`] leaving the pool unchanged.
    /// When short, it first has the reclaimer (the prefix cache) free what it can.
    pub fn reserve(&self, blocks: usize) -> Result<Reservation, Error> {
        match self.try_reserve(blocks) {
            Err(Error::Exhausted { needed, free }) => {
                let bb = self.inner.block_bytes as u64;
                let short = needed.saturating_sub(free).div_ceil(bb) as usize;
                match self.inner.reclaimer.get() {
                    Some(reclaim) if reclaim(short) > 0 => self.try_reserve(blocks),
                    _ => Err(Error::Exhausted { needed, free }),
                }
            }
            r => r,
        }
    }

    fn try_reserve(&self, blocks: usize) -> Result<Reservation, Error> {
        let cap = self.inner.num_blocks;
        self.inner
            .promised
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                p.checked_add(blocks).filter(|n| *n <= cap)
            })
            .map_err(|p| Error::Exhausted {
                needed: blocks as u64 * self.inner.block_bytes as u64,
                free: (cap.saturating_sub(p)) as u64 * self.inner.block_bytes as u64,
            })?;
        Ok(Reservation {
            pool: self.clone(),
            remaining: blocks,
        })
    }
}

/// Blocks promised by the pool and not yet taken; the rest returns on drop.
#[derive(Debug)]
pub struct Reservation {
    pool: HostPool,
    remaining: usize,
}

impl Reservation {
    /// Blocks still promised.
    pub fn remaining(&self) -> usize {
        self.remaining
    }

    /// Takes one promised block; `None` when the reservation is used up.
    pub fn take(&mut self) -> Option<Block> {
        if self.remaining == 0 {
            return None;
        }
        let inner = &self.pool.inner;
        // Promises never exceed the pool, so a promised block is always on the free list.
        let idx = inner.free.lock().unwrap_or_else(|p| p.into_inner()).pop()?;
        self.remaining -= 1;
        inner.taken.fetch_add(1, Ordering::AcqRel);
        Some(Block {
            pool: self.pool.clone(),
            idx,
        })
    }

    /// Folds `other` into this reservation.
    pub fn absorb(&mut self, mut other: Reservation) {
        self.remaining += std::mem::take(&mut other.remaining);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.remaining > 0 {
            self.pool
                .inner
                .promised
                .fetch_sub(self.remaining, Ordering::AcqRel);
        }
    }
}

/// One block of the pool, exclusively owned; returns to the pool on drop.
pub struct Block {
    pool: HostPool,
    idx: u32,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block").field("idx", &self.idx).finish()
    }
}

impl Block {
    /// The block's bytes.
    pub fn bytes(&self) -> &[u8] {
        let inner = &self.pool.inner;
        // SAFETY: `idx < num_blocks`, so the range lies inside the region; this `Block` is the
        // only owner of the index, and `&self` forbids a concurrent `bytes_mut`.
        unsafe {
            std::slice::from_raw_parts(
                inner
                    .region
                    .ptr
                    .as_ptr()
                    .add(self.idx as usize * inner.block_bytes),
                inner.block_bytes,
            )
        }
    }

    /// The block's bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let inner = &self.pool.inner;
        // SAFETY: as in `bytes`; `&mut self` makes this the only live view of the block.
        unsafe {
            std::slice::from_raw_parts_mut(
                inner
                    .region
                    .ptr
                    .as_ptr()
                    .add(self.idx as usize * inner.block_bytes),
                inner.block_bytes,
            )
        }
    }
}

/// A block holds a page of a sequence's host-kept key sketch, so the sketch is pool memory,
/// reserved and freed as KV is.
impl attention::host_sketch::SketchPage for Block {
    fn bytes(&self) -> &[u8] {
        Block::bytes(self)
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        Block::bytes_mut(self)
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        let inner = &self.pool.inner;
        inner
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.idx);
        inner.taken.fetch_sub(1, Ordering::AcqRel);
        inner.promised.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attention::KvDType;

    fn geom() -> BlockGeometry {
        BlockGeometry {
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: KvDType::F16,
        }
    }

    /// A prefaulted pool (touched page by page after the huge-page advice) spanning several
    /// huge pages hands out zeroed blocks that keep what is written, first and last alike.
    #[test]
    fn prefaulted_pool_blocks_are_zeroed_and_writable() {
        let bb = geom().block_bytes();
        let n = (5 << 20) / bb + 3;
        let pool = HostPool::with_prefault(geom(), (n * bb) as u64, true).unwrap();
        assert_eq!(pool.num_blocks(), n);
        let mut r = pool.reserve(n).unwrap();
        let mut blocks: Vec<Block> = (0..n).map(|_| r.take().unwrap()).collect();
        for (i, b) in blocks.iter_mut().enumerate() {
            assert!(b.bytes().iter().all(|x| *x == 0));
            b.bytes_mut().fill(i as u8);
        }
        for (i, b) in blocks.iter().enumerate() {
            assert!(b.bytes().iter().all(|x| *x == i as u8));
        }
        let map = map_huge(3 << 20).unwrap();
        assert_eq!(map.len(), 3 << 20);
        assert!(map.iter().all(|x| *x == 0));
    }

    #[test]
    fn reserve_take_free_accounts_exactly() {
        let bb = geom().block_bytes() as u64;
        let pool = HostPool::new(geom(), 10 * bb + 7).unwrap();
        assert_eq!(pool.num_blocks(), 10);
        let mut r = pool.reserve(6).unwrap();
        assert_eq!(
            pool.usage(),
            PoolUsage {
                used: 0,
                reserved: 6 * bb,
                capacity: 10 * bb
            }
        );
        assert!(matches!(pool.reserve(5), Err(Error::Exhausted { .. })));
        let mut a = r.take().unwrap();
        let b = r.take().unwrap();
        a.bytes_mut().fill(7);
        assert!(b.bytes().iter().all(|x| *x == 0));
        assert_eq!(pool.usage().used, 2 * bb);
        assert_eq!(pool.usage().reserved, 4 * bb);
        drop(r);
        assert_eq!(pool.usage().reserved, 0);
        drop(a);
        drop(b);
        assert_eq!(
            pool.usage(),
            PoolUsage {
                used: 0,
                reserved: 0,
                capacity: 10 * bb
            }
        );
        assert!(pool.reserve(10).is_ok());
    }

    #[test]
    fn concurrent_reservations_never_exceed_capacity() {
        let pool = HostPool::new(geom(), 64 * geom().block_bytes() as u64).unwrap();
        let barrier = std::sync::Barrier::new(8);
        let got: usize = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8)
                .map(|_| {
                    let pool = pool.clone();
                    let barrier = &barrier;
                    s.spawn(move || {
                        let mut held = Vec::new();
                        for _ in 0..20 {
                            if let Ok(mut r) = pool.reserve(3) {
                                held.push(r.take().unwrap());
                                held.push(r.take().unwrap());
                                held.push(r.take().unwrap());
                            }
                        }
                        // Everyone holds what they got until all are done reserving.
                        barrier.wait();
                        held.len()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert!(got <= 64);
        assert_eq!(pool.usage().used, 0);
    }
}
