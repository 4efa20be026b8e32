//! A request's KV once its push committed: blocks in the host pool, the digests the attention
//! engine takes over, and the growth reservation decode appends draw from. Dropping it returns
//! every block (and what is left of the reservation) to the pool.

use std::sync::Arc;

use attention::{BlockGeometry, HeadDigests, KvSource};

use crate::Error;
use crate::ingest::PromptInfo;
use crate::pool::{Block, Reservation};
use crate::prefix::CachedBlock;

/// One request's KV in the host pool: the prefix cache's blocks it reused, then its own
/// `blocks[layer][block]`; digests per (layer, KV head).
#[derive(Debug)]
pub struct CommittedKv {
    /// What the header said.
    pub info: PromptInfo,
    geom: BlockGeometry,
    num_layers: usize,
    num_tokens: usize,
    /// Whole blocks of the prompt's start, shared with the prefix cache (read only).
    prefix: Vec<Arc<CachedBlock>>,
    /// Own blocks, after the prefix's.
    blocks: Vec<Vec<Block>>,
    /// Tokens fed by decode, whose KV follows the prompt's.
    fed: Vec<u32>,
    digests: Vec<HeadDigests>,
    /// Blocks promised for decode growth (see [`CommittedKv::grow`]).
    growth: Option<Reservation>,
    /// The push's lease (set when the registry publishes it).
    pub(crate) lease: String,
}

impl CommittedKv {
    /// A committed push: `prefix`, then `blocks[layer][block]`, hold `num_tokens` tokens of
    /// every layer.
    pub(crate) fn new(
        info: PromptInfo,
        geom: BlockGeometry,
        num_tokens: usize,
        prefix: Vec<Arc<CachedBlock>>,
        blocks: Vec<Vec<Block>>,
        digests: Vec<HeadDigests>,
    ) -> Self {
        Self {
            info,
            geom,
            num_layers: blocks.len(),
            num_tokens,
            prefix,
            blocks,
            fed: Vec::new(),
            digests,
            growth: None,
            lease: String::new(),
        }
    }

    /// Tokens held.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// The lease of the push that brought this KV (empty before it is published).
    pub fn lease(&self) -> &str {
        &self.lease
    }

    /// Layers.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Block geometry.
    pub fn geometry(&self) -> &BlockGeometry {
        &self.geom
    }

    /// Takes the digests out (the attention engine owns them from here on).
    /// `[layer * num_kv_heads + head]`.
    pub fn take_digests(&mut self) -> Vec<HeadDigests> {
        std::mem::take(&mut self.digests)
    }

    /// Bytes of pool blocks held (and promised for growth).
    pub fn bytes(&self) -> u64 {
        let held: usize = self.blocks.iter().map(Vec::len).sum();
        let promised = self.growth.as_ref().map_or(0, Reservation::remaining);
        ((held + promised) * self.geom.block_bytes()) as u64
    }

    /// Attaches a reservation that later [`CommittedKv::append`]s draw new blocks from.
    pub fn grow(&mut self, r: Reservation) {
        match &mut self.growth {
            Some(g) => g.absorb(r),
            None => self.growth = Some(r),
        }
    }

    /// Blocks needed to hold `extra` more tokens in every layer.
    pub fn blocks_to_grow(&self, extra: usize) -> usize {
        let have = self.geom.blocks_for(self.num_tokens);
        (self.geom.blocks_for(self.num_tokens + extra) - have) * self.num_layers
    }

    /// Tokens reused from the prefix cache at the push.
    pub fn reused_tokens(&self) -> usize {
        self.prefix.len() * self.geom.block_size
    }

    /// Appends one token's K and V (`[num_kv_heads][head_dim]` f32 each) to `layer`.
    /// Call for every layer, then [`CommittedKv::advance`].
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), Error> {
        let (b, d) = (self.geom.block_size, self.geom.head_dim);
        // Cached blocks are whole, so the token lands in an own block.
        let pos = self.num_tokens - self.reused_tokens();
        if pos / b >= self.blocks[layer].len() {
            let blk = self
                .growth
                .as_mut()
                .and_then(Reservation::take)
                .ok_or_else(|| Error::Exhausted {
                    needed: self.geom.block_bytes() as u64,
                    free: 0,
                })?;
            self.blocks[layer].push(blk);
        }
        let block = self.blocks[layer][pos / b].bytes_mut();
        for h in 0..self.geom.num_kv_heads {
            self.geom.write_token(
                block,
                h,
                pos % b,
                &k[h * d..(h + 1) * d],
                &v[h * d..(h + 1) * d],
            );
        }
        Ok(())
    }

    /// Ends token `id` after [`CommittedKv::append`] ran for every layer.
    pub fn advance(&mut self, id: u32) {
        self.num_tokens += 1;
        self.fed.push(id);
    }

    /// The tokens whose KV this holds: the prompt's, then those decode fed.
    pub fn token_ids(&self) -> Vec<u32> {
        let mut t = self.info.prompt_token_ids.clone();
        t.extend_from_slice(&self.fed);
        t
    }

    /// Hands its blocks to the prefix cache (`digests` as the attention engine kept them,
    /// with decode's tokens folded in); the growth reservation and a partial last block
    /// return to the pool.
    pub fn into_cache(self, cache: &crate::PrefixCache, digests: &[HeadDigests]) {
        let tokens = self.token_ids();
        cache.insert(
            self.info.wire_dtype,
            &tokens,
            self.prefix,
            self.blocks,
            digests,
        );
    }
}

impl KvSource for CommittedKv {
    fn block(&self, layer: usize, block: usize) -> &[u8] {
        match self.prefix.get(block) {
            Some(c) => c.bytes(layer),
            None => self.blocks[layer][block - self.prefix.len()].bytes(),
        }
    }
    fn num_tokens(&self) -> usize {
        self.num_tokens
    }
}
