//! The decode side's prefix cache: whole token blocks of finished requests (prompt and
//! generated tokens) stay in the host pool, so the next turn of a conversation pushes only
//! what is new.
//!
//! A cached block holds one block of tokens for every layer, with its digests, and is named
//! by a chain hash: `hash(i) = xxh3_64(hash(i - 1) ‖ tokens of block i, seed)`, the tokens as
//! little-endian u32, `hash(-1) = 0`, and the seed the xxh3 of the model id and the push's
//! wire dtype, so another model's or dtype's KV never matches. A lookup also compares the
//! tokens and the parent hash, so a hash collision cannot hand out someone else's KV.
//!
//! Requests that reuse blocks share them (`Arc`): a block is evictable only while the cache
//! alone holds it. Eviction is least recently used, under `limit_bytes`, and whenever the
//! pool is short: the pool calls [`PrefixCache::reclaim`] before it refuses a reservation,
//! so cached blocks never cause a refusal.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use attention::{HeadDigests, KvDType};
use tokio::sync::broadcast;

use crate::pool::{Block, HostPool};

/// One block of tokens, every layer, as the cache keeps it.
#[derive(Debug)]
pub struct CachedBlock {
    hash: u64,
    parent: u64,
    tokens: Box<[u32]>,
    /// `[layer]`.
    layers: Vec<Block>,
    /// Per (layer, KV head): the block's key minimum, then maximum (`2 * head_dim`).
    digests: Vec<Box<[f32]>>,
}

impl CachedBlock {
    /// The block's bytes in `layer`.
    pub fn bytes(&self, layer: usize) -> &[u8] {
        self.layers[layer].bytes()
    }

    /// Its chain hash.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// Copies its digest for (`layer`, `head`) into block `b` of `into`.
    pub(crate) fn digest_into(
        &self,
        layer: usize,
        head: usize,
        hk: usize,
        into: &mut HeadDigests,
        b: usize,
    ) {
        let src = &self.digests[layer * hk + head];
        let (min, max) = into.block_mut(b);
        let d = min.len();
        min.copy_from_slice(&src[..d]);
        max.copy_from_slice(&src[d..]);
    }
}

/// A change to what the cache holds, for routers (`WatchKvEvents`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks now held, in chain order: `parent` is the hash before the first (0 at the
    /// start of a sequence).
    Stored {
        /// Hash of the block before the first one.
        parent: u64,
        /// Hashes of the stored blocks.
        hashes: Vec<u64>,
        /// Tokens per block.
        block_size: u32,
    },
    /// Blocks no longer held.
    Removed {
        /// Their hashes.
        hashes: Vec<u64>,
    },
}

/// Byte counts and counters of the cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixUsage {
    /// Blocks of tokens held (each spans every layer).
    pub blocks: u64,
    /// Pool bytes they hold.
    pub bytes: u64,
    /// Of those, bytes no live request shares (evictable now).
    pub idle_bytes: u64,
}

#[derive(Debug)]
struct Entry {
    block: Arc<CachedBlock>,
    tick: u64,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<u64, Entry>,
    /// tick -> hash, oldest first.
    lru: BTreeMap<u64, u64>,
    tick: u64,
}

impl State {
    fn touch(&mut self, hash: u64) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.entries.get_mut(&hash) {
            self.lru.remove(&e.tick);
            e.tick = tick;
            self.lru.insert(tick, hash);
        }
    }

    /// Evicts idle blocks, oldest first, while `more` says so; returns their hashes.
    fn evict_while(&mut self, mut more: impl FnMut(usize) -> bool) -> Vec<u64> {
        let mut gone = Vec::new();
        let idle: Vec<(u64, u64)> = self
            .lru
            .iter()
            .filter(|(_, h)| {
                self.entries
                    .get(h)
                    .is_some_and(|e| Arc::strong_count(&e.block) == 1)
            })
            .map(|(t, h)| (*t, *h))
            .collect();
        for (tick, hash) in idle {
            if !more(gone.len()) {
                break;
            }
            self.lru.remove(&tick);
            // Dropping the entry returns its blocks to the pool.
            self.entries.remove(&hash);
            gone.push(hash);
        }
        gone
    }
}

/// The prefix cache of one node (one model, one pool).
#[derive(Debug)]
pub struct PrefixCache {
    model_id: String,
    block_size: usize,
    num_layers: usize,
    num_kv_heads: usize,
    /// Bytes of one cached block (every layer).
    block_bytes: u64,
    limit_bytes: u64,
    state: Mutex<State>,
    events: broadcast::Sender<KvEvent>,
}

/// Events a slow watcher may fall behind by before it is told it lagged.
const EVENT_BACKLOG: usize = 4096;

impl PrefixCache {
    /// A cache of at most `limit_bytes` of `pool`'s blocks, for `model_id` with `num_layers`
    /// layers; the pool reclaims from it before refusing a reservation.
    pub fn new(pool: &HostPool, model_id: &str, num_layers: usize, limit_bytes: u64) -> Arc<Self> {
        let geom = *pool.geometry();
        let cache = Arc::new(Self {
            model_id: model_id.to_string(),
            block_size: geom.block_size,
            num_layers,
            num_kv_heads: geom.num_kv_heads,
            block_bytes: (geom.block_bytes() * num_layers) as u64,
            limit_bytes,
            state: Mutex::new(State::default()),
            events: broadcast::channel(EVENT_BACKLOG).0,
        });
        let weak = Arc::downgrade(&cache);
        pool.set_reclaimer(Box::new(move |blocks| {
            weak.upgrade().map_or(0, |c| c.reclaim(blocks))
        }));
        cache
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The seed of every hash for KV pushed in `dtype`.
    fn seed(&self, dtype: KvDType) -> u64 {
        let mut s = self.model_id.as_bytes().to_vec();
        s.push(0);
        s.extend_from_slice(dtype.name().as_bytes());
        xxhash_rust::xxh3::xxh3_64(&s)
    }

    /// The chain hashes of `tokens`' whole blocks, for KV pushed in `dtype`.
    pub fn hashes(&self, dtype: KvDType, tokens: &[u32]) -> Vec<u64> {
        let seed = self.seed(dtype);
        let mut parent = 0u64;
        tokens
            .chunks_exact(self.block_size)
            .map(|blk| {
                parent = chain_hash(seed, parent, blk);
                parent
            })
            .collect()
    }

    /// The cached blocks that begin `tokens` (pushed in `dtype`), in order; they are shared
    /// from here on, so eviction leaves them alone until the caller drops them.
    pub fn lookup(&self, dtype: KvDType, tokens: &[u32]) -> Vec<Arc<CachedBlock>> {
        let hashes = self.hashes(dtype, tokens);
        let mut st = self.lock();
        let mut found = Vec::new();
        let mut parent = 0;
        for (blk, hash) in tokens.chunks_exact(self.block_size).zip(hashes) {
            match st.entries.get(&hash) {
                Some(e) if e.block.parent == parent && *e.block.tokens == *blk => {
                    found.push(Arc::clone(&e.block));
                }
                _ => break,
            }
            parent = hash;
        }
        // Newest last: a chain's later blocks are evicted before its first ones, which
        // every continuation needs.
        for b in found.iter().rev() {
            st.touch(b.hash);
        }
        found
    }

    /// Takes a finished request's whole blocks: `tokens` are the tokens whose KV it holds
    /// (prompt, then fed), `prefix` the cached blocks it began with, `blocks[layer]` its own
    /// blocks after those, `digests[layer * num_kv_heads + head]` its digests. Blocks already
    /// cached (by this request or another) are only touched; a partial last block returns to
    /// the pool. Then evicts down to the limit.
    pub fn insert(
        &self,
        dtype: KvDType,
        tokens: &[u32],
        prefix: Vec<Arc<CachedBlock>>,
        blocks: Vec<Vec<Block>>,
        digests: &[HeadDigests],
    ) {
        let (bs, hk) = (self.block_size, self.num_kv_heads);
        let whole = tokens.len() / bs;
        let hashes = self.hashes(dtype, tokens);
        let skip = prefix.len();
        drop(prefix);
        // Per layer, its own blocks in order; taken block by block below.
        let mut own: Vec<std::vec::IntoIter<Block>> =
            blocks.into_iter().map(Vec::into_iter).collect();
        let mut st = self.lock();
        // Runs of consecutive blocks stored, each with the hash before it: a block another
        // request cached meanwhile splits the run (an event's blocks form one chain).
        let mut runs: Vec<(u64, Vec<u64>)> = Vec::new();
        let mut open = false;
        for b in skip..whole.min(skip + own.first().map_or(0, |l| l.len())) {
            let layers: Vec<Block> = own.iter_mut().filter_map(Iterator::next).collect();
            if layers.len() != self.num_layers {
                break;
            }
            let hash = hashes[b];
            let parent = if b == 0 { 0 } else { hashes[b - 1] };
            if st.entries.contains_key(&hash) {
                // Another request cached the same tokens meanwhile: ours go back.
                open = false;
                continue;
            }
            let digests = (0..self.num_layers * hk)
                .map(|i| {
                    let (min, max) = digests[i].block(b);
                    [min, max].concat().into_boxed_slice()
                })
                .collect();
            let block = Arc::new(CachedBlock {
                hash,
                parent,
                tokens: tokens[b * bs..(b + 1) * bs].into(),
                layers,
                digests,
            });
            st.entries.insert(hash, Entry { block, tick: 0 });
            match runs.last_mut() {
                Some((_, hs)) if open => hs.push(hash),
                _ => runs.push((parent, vec![hash])),
            }
            open = true;
        }
        for &h in hashes[..whole].iter().rev() {
            st.touch(h);
        }
        let limit_blocks = (self.limit_bytes / self.block_bytes.max(1)) as usize;
        let held = st.entries.len();
        let removed = st.evict_while(|gone| held - gone > limit_blocks);
        drop(st);
        for (parent, hashes) in runs {
            let _ = self.events.send(KvEvent::Stored {
                parent,
                hashes,
                block_size: bs as u32,
            });
        }
        if !removed.is_empty() {
            let _ = self.events.send(KvEvent::Removed { hashes: removed });
        }
    }

    /// Evicts idle blocks, oldest first, until `pool_blocks` pool blocks are freed (or none
    /// is left idle); returns the pool blocks freed.
    pub fn reclaim(&self, pool_blocks: usize) -> usize {
        let per = self.num_layers.max(1);
        let removed = self.lock().evict_while(|gone| gone * per < pool_blocks);
        let freed = removed.len() * per;
        if !removed.is_empty() {
            tracing::debug!(blocks = removed.len(), "prefix cache evicted for room");
            let _ = self.events.send(KvEvent::Removed { hashes: removed });
        }
        freed
    }

    /// Drops every idle block.
    pub fn clear(&self) {
        self.reclaim(usize::MAX);
    }

    /// What the cache holds.
    pub fn usage(&self) -> PrefixUsage {
        let st = self.lock();
        let blocks = st.entries.len() as u64;
        let idle = st
            .entries
            .values()
            .filter(|e| Arc::strong_count(&e.block) == 1)
            .count() as u64;
        PrefixUsage {
            blocks,
            bytes: blocks * self.block_bytes,
            idle_bytes: idle * self.block_bytes,
        }
    }

    /// Changes from now on; a receiver that falls more than a few thousand events behind
    /// is told it lagged (and should resync from [`PrefixCache::snapshot`]).
    pub fn subscribe(&self) -> broadcast::Receiver<KvEvent> {
        self.events.subscribe()
    }

    /// Every block held, as one `Stored` event per chain start (for a watcher that starts or
    /// resyncs).
    pub fn snapshot(&self) -> Vec<KvEvent> {
        let st = self.lock();
        let mut by_parent: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for e in st.entries.values() {
            by_parent
                .entry(e.block.parent)
                .or_default()
                .push(e.block.hash);
        }
        by_parent
            .into_iter()
            .map(|(parent, hashes)| KvEvent::Stored {
                parent,
                hashes,
                block_size: self.block_size as u32,
            })
            .collect()
    }
}

/// `xxh3_64(parent ‖ tokens, seed)`, tokens as little-endian u32.
fn chain_hash(seed: u64, parent: u64, tokens: &[u32]) -> u64 {
    let mut buf = Vec::with_capacity(8 + 4 * tokens.len());
    buf.extend_from_slice(&parent.to_le_bytes());
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64_with_seed(&buf, seed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use crate::ingest::Ingest;
    use crate::ingest::tests::{chunk, header, layout};
    use attention::KvSource;

    fn pool(blocks: usize) -> HostPool {
        HostPool::new(layout().geom, (blocks * layout().geom.block_bytes()) as u64).unwrap()
    }

    /// A push of `n` tokens of the test pattern (ids `i % 100`), reusing `cache`'s prefix.
    fn push(pool: &HostPool, cache: &PrefixCache, id: &str, n: usize) -> crate::CommittedKv {
        let h = header(id, n as u32);
        let info = crate::validate_header(&layout(), &h).unwrap();
        let prefix = cache.lookup(info.wire_dtype, &info.prompt_token_ids);
        let mut ing = Ingest::with_prefix(&layout(), pool, info, prefix).unwrap();
        let from = ing.reused_tokens();
        if from < n {
            for l in 0..2 {
                ing.chunk(&chunk(l, from, n - from).into()).unwrap();
            }
        }
        ing.commit(None).unwrap()
    }

    /// Ends `kv` into the cache with the digests it was pushed with.
    fn finish(kv: crate::CommittedKv, cache: &PrefixCache) {
        let mut kv = kv;
        let digests = kv.take_digests();
        kv.into_cache(cache, &digests);
    }

    fn idle(pool: &HostPool) -> u64 {
        pool.usage().used + pool.usage().reserved
    }

    #[test]
    fn a_second_push_reuses_whole_blocks_with_their_bytes_and_digests() {
        let pool = pool(64);
        let cache = PrefixCache::new(&pool, "m1", 2, u64::MAX);
        // 10 tokens: blocks of 4, so two whole blocks are cached and the partial one freed.
        finish(push(&pool, &cache, "a", 10), &cache);
        assert_eq!(cache.usage().blocks, 2);
        assert_eq!(
            pool.usage().used,
            2 * 2 * layout().geom.block_bytes() as u64
        );
        let mut reused = push(&pool, &cache, "b", 13);
        assert_eq!(reused.reused_tokens(), 8);
        let mut plain = {
            let other = PrefixCache::new(&pool, "m1", 2, 0);
            push(&pool, &other, "c", 13)
        };
        assert_eq!(plain.reused_tokens(), 0);
        // Whole blocks (a partial last block's free slots hold whatever the pool had there).
        for l in 0..2 {
            for b in 0..3 {
                assert_eq!(reused.block(l, b), plain.block(l, b), "layer {l} block {b}");
            }
        }
        assert_eq!(reused.take_digests(), plain.take_digests());
        drop((reused, plain));
        cache.clear();
        assert_eq!(cache.usage(), PrefixUsage::default());
        assert_eq!(idle(&pool), 0);
    }

    #[test]
    fn another_model_dtype_or_token_reuses_nothing() {
        let pool = pool(64);
        let cache = PrefixCache::new(&pool, "m1", 2, u64::MAX);
        finish(push(&pool, &cache, "a", 8), &cache);
        let ids: Vec<u32> = (0..8).collect();
        assert_eq!(cache.lookup(KvDType::F16, &ids).len(), 2);
        assert_eq!(cache.lookup(KvDType::Bf16, &ids).len(), 0, "another dtype");
        let mut changed = ids.clone();
        changed[5] = 99;
        assert_eq!(
            cache.lookup(KvDType::F16, &changed).len(),
            1,
            "stops at the change"
        );
        let other_model = PrefixCache::new(&pool, "m2", 2, u64::MAX);
        assert_ne!(
            other_model.hashes(KvDType::F16, &ids),
            cache.hashes(KvDType::F16, &ids)
        );
        // A hash that matched with other tokens (a collision) is refused: tokens compared.
        let h0 = cache.hashes(KvDType::F16, &ids)[0];
        {
            let mut st = cache.lock();
            let e = st.entries.remove(&h0).unwrap();
            let mut blk = Arc::try_unwrap(e.block).unwrap();
            blk.tokens[0] = 77;
            let block = Arc::new(blk);
            st.entries.insert(
                h0,
                Entry {
                    block,
                    tick: e.tick,
                },
            );
        }
        assert_eq!(cache.lookup(KvDType::F16, &ids).len(), 0);
        cache.clear();
        assert_eq!(idle(&pool), 0);
    }

    #[test]
    fn the_limit_evicts_the_oldest_idle_blocks_newest_chain_end_first() {
        let pool = pool(64);
        let bb = 2 * layout().geom.block_bytes() as u64;
        let cache = PrefixCache::new(&pool, "m1", 2, 3 * bb);
        let mut events = cache.subscribe();
        finish(push(&pool, &cache, "a", 16), &cache);
        // Four blocks over a limit of three: the chain's last goes, its start stays.
        assert_eq!(cache.usage().blocks, 3);
        let ids: Vec<u32> = (0..16).collect();
        assert_eq!(cache.lookup(KvDType::F16, &ids).len(), 3);
        let hashes = cache.hashes(KvDType::F16, &ids);
        assert_eq!(
            events.try_recv().unwrap(),
            KvEvent::Stored {
                parent: 0,
                hashes: hashes.clone(),
                block_size: 4
            }
        );
        assert_eq!(
            events.try_recv().unwrap(),
            KvEvent::Removed {
                hashes: vec![hashes[3]]
            }
        );
        cache.clear();
        assert_eq!(idle(&pool), 0);
    }

    #[test]
    fn blocks_stored_around_ones_already_held_are_announced_as_separate_chains() {
        let pool = pool(64);
        let cache = PrefixCache::new(&pool, "m1", 2, u64::MAX);
        finish(push(&pool, &cache, "a", 16), &cache);
        let ids: Vec<u32> = (0..16).collect();
        let h = cache.hashes(KvDType::F16, &ids);
        // Blocks 1 and 3 leave (as eviction could have it); a second request stores them again.
        {
            let mut st = cache.lock();
            st.entries.remove(&h[1]);
            st.entries.remove(&h[3]);
        }
        let mut events = cache.subscribe();
        finish(push(&pool, &cache, "b", 16), &cache);
        let stored = |parent, hashes| KvEvent::Stored {
            parent,
            hashes,
            block_size: 4,
        };
        assert_eq!(events.try_recv().unwrap(), stored(h[0], vec![h[1]]));
        assert_eq!(events.try_recv().unwrap(), stored(h[2], vec![h[3]]));
        assert!(events.try_recv().is_err());
        assert_eq!(cache.usage().blocks, 4);
        cache.clear();
        assert_eq!(idle(&pool), 0);
    }

    #[test]
    fn cached_blocks_never_cause_a_refusal_but_shared_ones_stay() {
        // 8 pool blocks: a 16-token push takes all of them (4 per layer).
        let pool = pool(8);
        let cache = PrefixCache::new(&pool, "m1", 2, u64::MAX);
        finish(push(&pool, &cache, "a", 16), &cache);
        assert_eq!(pool.usage().used, pool.usage().capacity);
        // A push of other tokens needs room: the pool reclaims the idle cached blocks.
        let mut h = header("b", 8);
        h.prompt_token_ids = (50..58).collect();
        let other = Ingest::begin(&layout(), &pool, &h).unwrap();
        assert_eq!(
            cache.usage().blocks,
            2,
            "two of the four blocks went for room"
        );
        drop(other);
        // A request sharing the cached prefix keeps it: eviction racing the reuse loses.
        let sharing = push(&pool, &cache, "c", 8);
        assert_eq!(sharing.reused_tokens(), 8);
        assert_eq!(cache.reclaim(usize::MAX), 0);
        assert!(matches!(pool.reserve(8), Err(Error::Exhausted { .. })));
        // Shared by two requests, freed only when the last one ends and the cache lets go.
        let again = push(&pool, &cache, "d", 8);
        assert_eq!(again.reused_tokens(), 8);
        drop(sharing);
        assert_eq!(cache.reclaim(usize::MAX), 0);
        drop(again);
        assert_eq!(cache.reclaim(usize::MAX), 4);
        assert_eq!(idle(&pool), 0);
    }

    #[test]
    fn a_chunk_into_the_reused_prefix_is_refused() {
        let pool = pool(64);
        let cache = PrefixCache::new(&pool, "m1", 2, u64::MAX);
        finish(push(&pool, &cache, "a", 8), &cache);
        let h = header("b", 10);
        let info = crate::validate_header(&layout(), &h).unwrap();
        let prefix = cache.lookup(info.wire_dtype, &info.prompt_token_ids);
        let mut ing = Ingest::with_prefix(&layout(), &pool, info, prefix).unwrap();
        assert_eq!(ing.reused_tokens(), 8);
        assert!(
            matches!(ing.chunk(&chunk(0, 6, 4).into()), Err(Error::Invalid(m)) if m.contains("reused"))
        );
        ing.chunk(&chunk(0, 8, 2).into()).unwrap();
        ing.chunk(&chunk(1, 8, 2).into()).unwrap();
        let kv = ing.commit(None).unwrap();
        assert_eq!(kv.token_ids().len(), 10);
        drop(kv);
        cache.clear();
        assert_eq!(idle(&pool), 0);
    }
}
