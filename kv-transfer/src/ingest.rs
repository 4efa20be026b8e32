//! The `PushKv` state machine: header, chunks, commit — strict and leak-free.
//!
//! [`Ingest`] is fed one message at a time by the service (or a test, or the fuzzer). It
//! reserves the whole request's blocks at the header, writes each chunk into its blocks in
//! the pool's layout and dtype while folding keys into the digests, and on commit hands a
//! [`CommittedKv`] to the registry. Dropping an unfinished `Ingest` frees everything.

use std::ops::Range;
use std::sync::Arc;

use attention::{HeadDigests, KvDType, Rows, decode_rows};
use decode_node_proto::v1::{DType, KvHeader};

use crate::committed::CommittedKv;
use crate::crc::Crc32c;
use crate::pool::{Block, HostPool};
use crate::prefix::CachedBlock;
use crate::wire::Chunk;
use crate::{Error, KvLayout, Payload};

/// Longest request id accepted.
pub const MAX_REQUEST_ID_LEN: usize = 256;

/// A validated header: what the pushed KV claims to be.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptInfo {
    /// Request id.
    pub request_id: String,
    /// Prompt token ids (`num_tokens`).
    pub prompt_token_ids: Vec<u32>,
    /// The token decode feeds first.
    pub next_token_id: u32,
    /// Wire dtype of the chunks.
    pub wire_dtype: KvDType,
}

/// Progress of one push.
#[derive(Debug)]
pub struct Ingest {
    layout: KvLayout,
    info: PromptInfo,
    num_tokens: usize,
    /// The prompt's first blocks, from the prefix cache: their tokens count as sent.
    prefix: Vec<Arc<CachedBlock>>,
    /// Own blocks, after the prefix's: `blocks[layer][block - prefix.len()]`.
    blocks: Vec<Vec<Block>>,
    digests: Vec<HeadDigests>,
    /// Per layer, one bit per token already written.
    covered: Vec<Vec<u64>>,
    remaining: usize,
    /// Payload bytes accepted.
    pub bytes_received: u64,
    /// Chunks accepted.
    pub chunks_received: u32,
    /// One head's run of keys or values in f32, on the way to a pool of another dtype.
    scratch: Vec<f32>,
    /// Key and value rows that straddle two received frames, joined.
    gather_k: Vec<u8>,
    gather_v: Vec<u8>,
    /// A chunk failed its CRC after being written: the push can only be dropped.
    poisoned: bool,
}

/// Block-sized runs of `count` tokens from `start`: (offset in the chunk, block, slot, tokens).
fn runs(
    block_size: usize,
    start: usize,
    count: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    let mut t = 0;
    std::iter::from_fn(move || {
        (t < count).then(|| {
            let pos = start + t;
            let n = (block_size - pos % block_size).min(count - t);
            let run = (t, pos / block_size, pos % block_size, n);
            t += n;
            run
        })
    })
}

/// A byte range of a payload to be asked for ahead of its use in `steps` about equal steps of
/// whole cache lines ([`Payload::prefetch`]).
struct Ahead<'a> {
    payload: &'a Payload,
    at: usize,
    end: usize,
    step: usize,
}

impl<'a> Ahead<'a> {
    fn new(payload: &'a Payload, at: usize, len: usize, steps: usize) -> Self {
        let end = (at + len).min(payload.len());
        let step = (end.saturating_sub(at))
            .div_ceil(steps.max(1))
            .next_multiple_of(64);
        Self {
            payload,
            at,
            end,
            step,
        }
    }

    /// Asks for the next step's lines, if any are left.
    fn step(&mut self) {
        if self.at < self.end {
            let to = (self.at + self.step).min(self.end);
            self.payload.prefetch(self.at..to);
            self.at = to;
        }
    }
}

fn wire_dtype(d: i32) -> Result<KvDType, Error> {
    match DType::try_from(d) {
        Ok(DType::DtypeF32) => Ok(KvDType::F32),
        Ok(DType::DtypeF16) => Ok(KvDType::F16),
        Ok(DType::DtypeBf16) => Ok(KvDType::Bf16),
        _ => Err(Error::Invalid(format!(
            "header dtype {d} is not DTYPE_F32, DTYPE_F16 or DTYPE_BF16"
        ))),
    }
}

fn check_field<E, G>(field: &'static str, expected: E, got: G) -> Result<(), Error>
where
    E: ToString + PartialEq<G>,
    G: ToString,
{
    if expected == got {
        Ok(())
    } else {
        Err(Error::Mismatch {
            field,
            expected: expected.to_string(),
            got: got.to_string(),
        })
    }
}

/// Checks a header against the node's layout, without touching the pool.
pub fn validate_header(layout: &KvLayout, h: &KvHeader) -> Result<PromptInfo, Error> {
    if h.request_id.is_empty() {
        return Err(Error::Invalid("header request_id is empty".into()));
    }
    if h.request_id.len() > MAX_REQUEST_ID_LEN {
        return Err(Error::Invalid(format!(
            "header request_id is longer than {MAX_REQUEST_ID_LEN} bytes"
        )));
    }
    check_field("model_id", layout.model_id.as_str(), h.model_id.as_str())?;
    check_field("num_layers", layout.num_layers as u32, h.num_layers)?;
    check_field(
        "num_kv_heads",
        layout.geom.num_kv_heads as u32,
        h.num_kv_heads,
    )?;
    check_field("head_dim", layout.geom.head_dim as u32, h.head_dim)?;
    let wire = wire_dtype(h.dtype)?;
    if h.num_tokens == 0 {
        return Err(Error::Invalid("header num_tokens is 0".into()));
    }
    if h.num_tokens as usize >= layout.max_context {
        return Err(Error::Invalid(format!(
            "header num_tokens {} leaves no room to decode within the model's context of {}",
            h.num_tokens, layout.max_context
        )));
    }
    if h.prompt_token_ids.len() != h.num_tokens as usize {
        return Err(Error::Invalid(format!(
            "header has {} prompt_token_ids for num_tokens {}",
            h.prompt_token_ids.len(),
            h.num_tokens
        )));
    }
    let vocab = layout.vocab_size as u32;
    if let Some(bad) = h
        .prompt_token_ids
        .iter()
        .chain([&h.next_token_id])
        .find(|t| **t >= vocab)
    {
        return Err(Error::Invalid(format!(
            "token id {bad} is outside the vocabulary of {vocab}"
        )));
    }
    Ok(PromptInfo {
        request_id: h.request_id.clone(),
        prompt_token_ids: h.prompt_token_ids.clone(),
        next_token_id: h.next_token_id,
        wire_dtype: wire,
    })
}

/// The KV heads a chunk carries: its range, or every head when `head_count` is 0.
fn chunk_heads(c: &Chunk, hk: usize) -> Result<Range<usize>, Error> {
    let (start, count) = (c.head_start as usize, c.head_count as usize);
    if count == 0 {
        if start != 0 {
            return Err(Error::Invalid(format!(
                "chunk head_start {start} without head_count"
            )));
        }
        return Ok(0..hk);
    }
    match start.checked_add(count) {
        Some(end) if end <= hk => Ok(start..end),
        _ => Err(Error::Invalid(format!(
            "chunk heads [{start}, {start}+{count}) outside the model's {hk} KV heads"
        ))),
    }
}

impl Ingest {
    /// Validates `header` and reserves and takes every block the prompt needs.
    pub fn begin(layout: &KvLayout, pool: &HostPool, header: &KvHeader) -> Result<Self, Error> {
        Self::with_info(layout, pool, validate_header(layout, header)?)
    }

    /// Reserves and takes every block of a prompt whose header [`validate_header`] accepted.
    pub fn with_info(layout: &KvLayout, pool: &HostPool, info: PromptInfo) -> Result<Self, Error> {
        Self::with_prefix(layout, pool, info, Vec::new())
    }

    /// [`Ingest::with_info`] for a prompt whose first blocks are `prefix` (from the prefix
    /// cache): their tokens count as sent, and only the rest is reserved and awaited.
    pub fn with_prefix(
        layout: &KvLayout,
        pool: &HostPool,
        info: PromptInfo,
        prefix: Vec<Arc<CachedBlock>>,
    ) -> Result<Self, Error> {
        let geom = layout.geom;
        let n = info.prompt_token_ids.len();
        let per_layer = geom.blocks_for(n);
        let p = prefix.len();
        if p * geom.block_size > n {
            return Err(Error::Config("reused prefix longer than the prompt".into()));
        }
        let own = per_layer - p;
        let mut r = pool.reserve(own * layout.num_layers)?;
        let blocks = (0..layout.num_layers)
            .map(|_| {
                (0..own)
                    .map(|_| {
                        r.take()
                            .ok_or_else(|| Error::Config("reservation short".into()))
                    })
                    .collect()
            })
            .collect::<Result<Vec<Vec<Block>>, Error>>()?;
        let hk = geom.num_kv_heads;
        let mut digests = vec![HeadDigests::new(per_layer, geom.head_dim); layout.num_layers * hk];
        let mut covered = vec![vec![0u64; n.div_ceil(64)]; layout.num_layers * hk];
        let reused = p * geom.block_size;
        for (i, (dg, cov)) in digests.iter_mut().zip(&mut covered).enumerate() {
            for (b, c) in prefix.iter().enumerate() {
                c.digest_into(i / hk, i % hk, hk, dg, b);
            }
            for t in 0..reused {
                cov[t / 64] |= 1 << (t % 64);
            }
        }
        Ok(Self {
            layout: layout.clone(),
            info,
            num_tokens: n,
            prefix,
            blocks,
            digests,
            covered,
            remaining: (n - reused) * layout.num_layers * hk,
            bytes_received: 0,
            chunks_received: 0,
            scratch: Vec::new(),
            gather_k: Vec::new(),
            gather_v: Vec::new(),
            poisoned: false,
        })
    }

    /// What the header said.
    pub fn info(&self) -> &PromptInfo {
        &self.info
    }

    /// The request id.
    pub fn request_id(&self) -> &str {
        &self.info.request_id
    }

    /// Leading tokens taken from the prefix cache (the pusher sends only the rest).
    pub fn reused_tokens(&self) -> usize {
        self.prefix.len() * self.layout.geom.block_size
    }

    /// Bytes of pool blocks this push holds.
    pub fn bytes_held(&self) -> u64 {
        (self.blocks.iter().map(Vec::len).sum::<usize>() * self.layout.geom.block_bytes()) as u64
    }

    /// Validates and writes one chunk. After a CRC mismatch every later call fails: the push
    /// must be dropped (which frees its blocks).
    pub fn chunk(&mut self, c: &Chunk) -> Result<(), Error> {
        self.check_poisoned()?;
        let geom = self.layout.geom;
        let (hk, d) = (geom.num_kv_heads, geom.head_dim);
        if c.layer as usize >= self.layout.num_layers {
            return Err(Error::Invalid(format!(
                "chunk layer {} >= num_layers {}",
                c.layer, self.layout.num_layers
            )));
        }
        let (start, count) = (c.token_start as usize, c.token_count as usize);
        if count == 0
            || start
                .checked_add(count)
                .is_none_or(|end| end > self.num_tokens)
        {
            return Err(Error::Invalid(format!(
                "chunk tokens [{start}, {start}+{count}) outside the prompt's {} tokens",
                self.num_tokens
            )));
        }
        let heads = chunk_heads(c, hk)?;
        let hc = heads.len();
        let es = self.info.wire_dtype.size();
        let want = count * hc * d * es;
        if c.key.len() != want || c.value.len() != want {
            return Err(Error::Invalid(format!(
                "chunk of {count} tokens needs {want} key and value bytes ({count}x{hc}x{d}x{es}), got {} and {}",
                c.key.len(),
                c.value.len()
            )));
        }
        let layer = c.layer as usize;
        let reused = self.reused_tokens();
        if start < reused {
            return Err(Error::Invalid(format!(
                "chunk tokens [{start}, {}) lie in the {reused} tokens this node reused from its prefix cache; send tokens from {reused} on",
                start + count
            )));
        }
        let sent = |h: usize, t: usize| self.covered[layer * hk + h][t / 64] >> (t % 64) & 1 == 1;
        if heads
            .clone()
            .any(|h| (start..start + count).any(|t| sent(h, t)))
        {
            return Err(Error::Invalid(format!(
                "chunk layer {layer} heads [{}, {}) tokens [{start}, {}) overlaps what was already sent",
                heads.start,
                heads.end,
                start + count
            )));
        }
        let crc_mismatch = |crc: u32| {
            Error::Invalid(format!(
                "chunk layer {layer} tokens [{start}, {}) CRC-32C mismatch: computed {crc:#010x}, sent {:#010x}",
                start + count,
                c.crc32c
            ))
        };

        // Same dtype (a wire dtype, which always folds): digests fold in while K is
        // transposed, no f32 copy of K. Otherwise each token is converted. Either way each
        // run is checksummed just before it is written, and the blocks are written before
        // the check.
        let crc = if self.info.wire_dtype == geom.dtype && geom.folds_digest_in_copy() {
            self.write_fused(c, layer, heads.clone(), start, count)
        } else {
            self.write_converted(c, layer, heads.clone(), start, count)
        };
        if crc != c.crc32c {
            self.poisoned = true;
            return Err(crc_mismatch(crc));
        }
        for h in heads {
            let cov = &mut self.covered[layer * hk + h];
            for t in start..start + count {
                cov[t / 64] |= 1 << (t % 64);
            }
        }
        self.remaining -= count * hc;
        self.bytes_received += (2 * want) as u64;
        self.chunks_received += 1;
        Ok(())
    }

    /// Writes a same-dtype chunk whose keys fold into the digests in the copy; returns the
    /// CRC-32C of its key and value. Each run is checksummed just before it is copied, while
    /// its rows are in L1 (a separate pass read them from memory twice): keys first, then
    /// values, so one running CRC follows the wire order. The caller checks the CRC after
    /// the blocks are written.
    fn write_fused(
        &mut self,
        c: &Chunk,
        layer: usize,
        heads: Range<usize>,
        start: usize,
        count: usize,
    ) -> u32 {
        let geom = self.layout.geom;
        let (hk, d, es) = (geom.num_kv_heads, geom.head_dim, geom.dtype.size());
        let row = heads.len() * d * es;
        let mut crc = Crc32c::new();
        for (t, bi, slot, n) in runs(geom.block_size, start, count) {
            let kr = c.key.slice(t * row..(t + n) * row, &mut self.gather_k);
            crc.update(kr);
            let block = self.blocks[layer][bi - self.prefix.len()].bytes_mut();
            for (i, h) in heads.clone().enumerate() {
                let rows = Rows {
                    bytes: &kr[i * d * es..],
                    stride: row,
                    n,
                };
                let digest = self.digests[layer * hk + h].block_mut(bi);
                geom.copy_keys_digest(block, h, slot, rows, digest);
            }
        }
        for (t, bi, slot, n) in runs(geom.block_size, start, count) {
            let vr = c.value.slice(t * row..(t + n) * row, &mut self.gather_v);
            crc.update(vr);
            let block = self.blocks[layer][bi - self.prefix.len()].bytes_mut();
            for (i, h) in heads.clone().enumerate() {
                let rows = Rows {
                    bytes: &vr[i * d * es..],
                    stride: row,
                    n,
                };
                geom.copy_value_rows(block, h, slot, rows);
            }
        }
        crc.value()
    }

    /// Writes a chunk whose pool stores another dtype than the wire's; returns the CRC-32C
    /// of its key and value, each run checksummed just before it is written, as
    /// [`Ingest::write_fused`] does. Each head's rows of a run are decoded to f32 (a block's
    /// worth of one head: they stay in L1 while they are encoded), then encoded into their
    /// slots, the keys folded into the block's digest.
    fn write_converted(
        &mut self,
        c: &Chunk,
        layer: usize,
        heads: Range<usize>,
        start: usize,
        count: usize,
    ) -> u32 {
        let geom = self.layout.geom;
        let (hk, d, bs) = (geom.num_kv_heads, geom.head_dim, geom.block_size);
        let (wire, es) = (self.info.wire_dtype, self.info.wire_dtype.size());
        let hc = heads.len();
        let row = hc * d * es; // wire bytes of a token
        self.scratch.resize(bs.min(count) * d, 0.0);
        let mut crc = Crc32c::new();
        let first = bs.min(count) * row;
        for keys in [true, false] {
            let (payload, gather) = if keys {
                (&c.key, &mut self.gather_k)
            } else {
                (&c.value, &mut self.gather_v)
            };
            for (t, bi, slot, n) in runs(bs, start, count) {
                let bytes = payload.slice(t * row..(t + n) * row, gather);
                crc.update(bytes);
                let block = self.blocks[layer][bi - self.prefix.len()].bytes_mut();
                // The next run's bytes (after the keys' last, the values' first) are asked
                // for a few lines at a time while this run is converted (up to 16 with each
                // group of a head's rows): the checksum then reads them from cache. (Asked
                // for a head's share at once, 128 lines at 8 heads of 128, the requests
                // stalled on the CPU's line-fill buffers.)
                let (next, at) = if (t + n) * row < payload.len() {
                    (payload, (t + n) * row)
                } else {
                    (&c.value, if keys { 0 } else { c.value.len() })
                };
                let groups = first.div_ceil(64 * 16 * hc).clamp(1, n);
                let per = n.div_ceil(groups); // rows of a group
                let mut ahead = Ahead::new(next, at, first, hc * groups);
                for (j, h) in heads.clone().enumerate() {
                    let x = &mut self.scratch[..n * d];
                    for (i, rows) in x.chunks_mut((per * d).max(1)).enumerate() {
                        let from = i * per * row + j * d * es;
                        decode_rows(wire, &bytes[from..], row, rows, d);
                        ahead.step();
                    }
                    if keys {
                        let digest = self.digests[layer * hk + h].block_mut(bi);
                        geom.write_keys(block, (h, slot), x, (d, n), digest);
                    } else {
                        geom.write_values(block, (h, slot), x, (d, n));
                    }
                }
            }
        }
        crc.value()
    }

    /// Whether every (layer, token, head) has arrived, as `commit` requires.
    #[cfg(test)]
    fn commit_ready(&self) -> Result<(), Error> {
        if self.remaining == 0 {
            Ok(())
        } else {
            Err(Error::Invalid(format!(
                "{} entries not sent",
                self.remaining
            )))
        }
    }

    fn check_poisoned(&self) -> Result<(), Error> {
        if self.poisoned {
            return Err(Error::Invalid(
                "push already failed a CRC-32C check; start it again".into(),
            ));
        }
        Ok(())
    }

    /// Ends the push: every (layer, token) must have arrived. `next_token_id`, when the
    /// producer sends it at commit, replaces the header's.
    pub fn commit(mut self, next_token_id: Option<u32>) -> Result<CommittedKv, Error> {
        self.check_poisoned()?;
        if let Some(t) = next_token_id {
            let vocab = self.layout.vocab_size as u32;
            if t >= vocab {
                return Err(Error::Invalid(format!(
                    "commit's next_token_id {t} is outside the vocabulary of {vocab}"
                )));
            }
            self.info.next_token_id = t;
        }
        if self.remaining != 0 {
            return Err(Error::Invalid(format!(
                "commit with {} of {} (layer, token, KV head) entries not sent",
                self.remaining,
                self.num_tokens * self.layout.num_layers * self.layout.geom.num_kv_heads
            )));
        }
        Ok(CommittedKv::new(
            self.info,
            self.layout.geom,
            self.num_tokens,
            self.prefix,
            self.blocks,
            self.digests,
        ))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::Payload;
    use attention::{BlockGeometry, KvSource};
    use attention::{decode_to_f32, encode_from_f32};
    use bytes::Bytes;
    use decode_node_proto::v1::KvChunk;

    pub(crate) fn layout() -> KvLayout {
        KvLayout {
            model_id: "m1".into(),
            num_layers: 2,
            geom: BlockGeometry {
                block_size: 4,
                num_kv_heads: 2,
                head_dim: 4,
                dtype: KvDType::F32,
            },
            vocab_size: 100,
            max_context: 1000,
        }
    }

    pub(crate) fn header(id: &str, n: u32) -> KvHeader {
        KvHeader {
            request_id: id.into(),
            model_id: "m1".into(),
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 4,
            dtype: DType::DtypeF16 as i32,
            num_tokens: n,
            prompt_token_ids: (0..n).map(|i| i % 100).collect(),
            next_token_id: 5,
            num_streams: 0,
            reuse_prefix: false,
        }
    }

    /// Value of K (or V when `v`) at (layer, token, head, channel): distinct and exact in f16.
    pub(crate) fn val(layer: usize, t: usize, h: usize, c: usize, v: bool) -> f32 {
        ((layer * 1000 + t * 16 + h * 4 + c) % 2000) as f32 * if v { -0.25 } else { 0.5 }
    }

    pub(crate) fn chunk(layer: usize, start: usize, count: usize) -> KvChunk {
        let mut k = Vec::new();
        let mut v = Vec::new();
        for t in start..start + count {
            for h in 0..2 {
                for c in 0..4 {
                    k.push(val(layer, t, h, c, false));
                    v.push(val(layer, t, h, c, true));
                }
            }
        }
        let mut kb = vec![0u8; k.len() * 2];
        let mut vb = vec![0u8; v.len() * 2];
        encode_from_f32(KvDType::F16, &k, &mut kb);
        encode_from_f32(KvDType::F16, &v, &mut vb);
        let crc = crc32c::crc32c_append(crc32c::crc32c(&kb), &vb);
        KvChunk {
            layer: layer as u32,
            token_start: start as u32,
            token_count: count as u32,
            key: Bytes::from(kb),
            value: Bytes::from(vb),
            crc32c: crc,
            head_start: 0,
            head_count: 0,
        }
    }

    /// Heads [h0, h0 + hc) of a whole-head chunk whose elements are `es` bytes, as a
    /// tensor-parallel rank sends them.
    pub(crate) fn head_part(c: &KvChunk, h0: usize, hc: usize, es: usize) -> KvChunk {
        let (hk, d) = (2, 4);
        let row = hk * d * es;
        let part = |b: &Bytes| -> Vec<u8> {
            b.chunks(row)
                .flat_map(|r| r[h0 * d * es..(h0 + hc) * d * es].to_vec())
                .collect()
        };
        let (kb, vb) = (part(&c.key), part(&c.value));
        KvChunk {
            crc32c: crc32c::crc32c_append(crc32c::crc32c(&kb), &vb),
            key: Bytes::from(kb),
            value: Bytes::from(vb),
            head_start: h0 as u32,
            head_count: hc as u32,
            ..c.clone()
        }
    }

    #[test]
    fn heads_pushed_by_separate_ranks_assemble_to_the_whole_push() {
        // Fused (f32 into f32, f16 into f16) and converting (f16 into f32) writes.
        for (pool_dtype, wire_f32) in [
            (KvDType::F32, true),
            (KvDType::F32, false),
            (KvDType::F16, false),
        ] {
            let mut l = layout();
            l.geom.dtype = pool_dtype;
            let pool = HostPool::new(l.geom, 64 * l.geom.block_bytes() as u64).unwrap();
            let mut h = header("tp", 7);
            let es = if wire_f32 { 4 } else { 2 };
            if wire_f32 {
                h.dtype = DType::DtypeF32 as i32;
            }
            let make = |layer, start, count| {
                let c = chunk(layer, start, count);
                if wire_f32 { to_f32(c) } else { c }
            };
            let mut whole = Ingest::begin(&l, &pool, &h).unwrap();
            let mut ranks = Ingest::begin(&l, &pool, &h).unwrap();
            for layer in 0..2 {
                whole.chunk(&make(layer, 0, 7).into()).unwrap();
                // Rank 1 sends its head in two pieces, rank 0 in one, out of order.
                ranks
                    .chunk(&head_part(&make(layer, 2, 5), 1, 1, es).into())
                    .unwrap();
                ranks
                    .chunk(&head_part(&make(layer, 0, 7), 0, 1, es).into())
                    .unwrap();
                assert!(ranks.commit_ready().is_err());
                let dup = head_part(&make(layer, 0, 3), 0, 1, es);
                assert!(
                    matches!(ranks.chunk(&dup.into()), Err(Error::Invalid(m)) if m.contains("overlaps"))
                );
                ranks
                    .chunk(&head_part(&make(layer, 0, 2), 1, 1, es).into())
                    .unwrap();
            }
            let mut bad = head_part(&make(0, 0, 1), 1, 1, es);
            bad.head_count = 2;
            assert!(
                matches!(ranks.chunk(&bad.into()), Err(Error::Invalid(m)) if m.contains("outside"))
            );
            let mut bad = make(0, 0, 1);
            bad.head_start = 1;
            assert!(
                matches!(ranks.chunk(&bad.into()), Err(Error::Invalid(m)) if m.contains("head_count"))
            );
            let (mut a, mut b) = (whole.commit(None).unwrap(), ranks.commit(None).unwrap());
            for layer in 0..2 {
                for blk in 0..2 {
                    assert_eq!(
                        a.block(layer, blk),
                        b.block(layer, blk),
                        "{pool_dtype:?} {wire_f32}"
                    );
                }
            }
            let (da, db) = (a.take_digests(), b.take_digests());
            for (x, y) in da.iter().zip(&db) {
                for blk in 0..2 {
                    assert_eq!(x.block(blk), y.block(blk));
                }
            }
        }
    }

    /// The same chunk with f32 keys and values (exact: the f16 values widen).
    fn to_f32(c16: KvChunk) -> KvChunk {
        let mut k = vec![0f32; c16.key.len() / 2];
        let mut v = vec![0f32; c16.value.len() / 2];
        decode_to_f32(KvDType::F16, &c16.key, &mut k);
        decode_to_f32(KvDType::F16, &c16.value, &mut v);
        let kb: Vec<u8> = k.iter().flat_map(|x| x.to_le_bytes()).collect();
        let vb: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let crc = crc32c::crc32c_append(crc32c::crc32c(&kb), &vb);
        KvChunk {
            key: Bytes::from(kb),
            value: Bytes::from(vb),
            crc32c: crc,
            ..c16
        }
    }

    /// On both paths, the copy of a wire dtype (f32 into f32) and the conversion (f16 into
    /// f32), a chunk is written before its CRC is checked: a mismatch ends the push.
    #[test]
    fn a_crc_mismatch_after_writing_poisons_the_push_and_frees_on_drop() {
        let pool = pool();
        let f16 = |c: KvChunk| c;
        for (wire, conv) in [
            (DType::DtypeF32, to_f32 as fn(_) -> _),
            (DType::DtypeF16, f16),
        ] {
            let mut h = header("p", 6);
            h.dtype = wire as i32;
            let mut ing = Ingest::begin(&layout(), &pool, &h).unwrap();
            let mut bad = conv(chunk(0, 0, 6));
            bad.crc32c ^= 1;
            assert!(
                matches!(ing.chunk(&bad.into()), Err(Error::Invalid(m)) if m.contains("CRC")),
                "{wire:?}"
            );
            // The good data does not revive it.
            assert!(ing.chunk(&conv(chunk(0, 0, 6)).into()).is_err());
            assert!(ing.chunk(&conv(chunk(1, 0, 6)).into()).is_err());
            assert!(ing.commit(None).is_err());
            assert_eq!(pool.usage().used + pool.usage().reserved, 0);
        }
    }

    fn pool() -> HostPool {
        HostPool::new(layout().geom, 64 * layout().geom.block_bytes() as u64).unwrap()
    }

    #[test]
    fn the_commit_may_name_the_first_token() {
        let pool = pool();
        let full = |pool: &HostPool| {
            let mut ing = Ingest::begin(&layout(), pool, &header("t", 6)).unwrap();
            ing.chunk(&chunk(0, 0, 6).into()).unwrap();
            ing.chunk(&chunk(1, 0, 6).into()).unwrap();
            ing
        };
        let kv = full(&pool).commit(Some(7)).unwrap();
        assert_eq!(kv.info.next_token_id, 7);
        drop(kv);
        let vocab = layout().vocab_size as u32;
        assert!(matches!(
            full(&pool).commit(Some(vocab)),
            Err(Error::Invalid(m)) if m.contains("vocabulary")
        ));
        // Without one, the header's stands.
        let kv = full(&pool).commit(None).unwrap();
        assert_eq!(kv.info.next_token_id, header("t", 6).next_token_id);
        drop(kv);
        assert_eq!(pool.usage().used + pool.usage().reserved, 0);
    }

    #[test]
    fn chunks_land_in_blocks_and_digests() {
        let pool = pool();
        let mut ing = Ingest::begin(&layout(), &pool, &header("a", 6)).unwrap();
        assert_eq!(pool.usage().used, 4 * layout().geom.block_bytes() as u64);
        ing.chunk(&chunk(1, 2, 4).into()).unwrap();
        ing.chunk(&chunk(0, 0, 6).into()).unwrap();
        assert!(
            matches!(ing.chunk(&chunk(1, 0, 3).into()), Err(Error::Invalid(m)) if m.contains("overlaps"))
        );
        ing.chunk(&chunk(1, 0, 2).into()).unwrap();
        let mut kv = ing.commit(None).unwrap();
        // Token 5 of layer 1, head 1 sits in block 1, slot 1: K^T[c][1], V[1][c].
        let g = layout().geom;
        let blk = kv.block(1, 1);
        let head = &blk[g.head_range(1)];
        let mut f = vec![0f32; head.len() / 4];
        decode_to_f32(KvDType::F32, head, &mut f);
        for c in 0..4 {
            assert_eq!(f[c * 4 + 1], val(1, 5, 1, c, false));
            assert_eq!(f[16 + 4 + c], val(1, 5, 1, c, true));
        }
        let dg = kv.take_digests();
        assert_eq!(dg[2 + 1].block(1).1[0], val(1, 5, 1, 0, false));
        assert_eq!(dg[2 + 1].block(1).0[0], val(1, 4, 1, 0, false));
        drop(kv);
        assert_eq!(pool.usage().used, 0);
    }

    #[test]
    fn same_dtype_copy_equals_converting_write() {
        // An f16 pool fed f16 chunks (fused path) and f32 chunks (convert path).
        let mut l = layout();
        l.geom.dtype = KvDType::F16;
        let pool = HostPool::new(l.geom, 64 * l.geom.block_bytes() as u64).unwrap();
        let mut copy = Ingest::begin(&l, &pool, &header("c", 7)).unwrap();
        copy.chunk(&chunk(0, 0, 3).into()).unwrap();
        copy.chunk(&chunk(0, 3, 4).into()).unwrap();
        copy.chunk(&chunk(1, 0, 7).into()).unwrap();
        let mut h = header("f", 7);
        h.dtype = DType::DtypeF32 as i32;
        let mut conv = Ingest::begin(&l, &pool, &h).unwrap();
        for (layer, s, n) in [(0, 0, 7), (1, 0, 7)] {
            conv.chunk(&to_f32(chunk(layer, s, n)).into()).unwrap();
        }
        let (mut a, mut b) = (copy.commit(None).unwrap(), conv.commit(None).unwrap());
        for layer in 0..2 {
            for blk in 0..2 {
                let g = l.geom;
                for hd in 0..2 {
                    let len = (7 - blk * 4).min(4);
                    let (x, y) = (
                        &a.block(layer, blk)[g.head_range(hd)],
                        &b.block(layer, blk)[g.head_range(hd)],
                    );
                    for c in 0..4 {
                        assert_eq!(&x[c * 8..c * 8 + len * 2], &y[c * 8..c * 8 + len * 2]);
                    }
                    assert_eq!(&x[32..32 + len * 8], &y[32..32 + len * 8]);
                }
            }
        }
        assert_eq!(a.take_digests(), b.take_digests());
    }

    #[test]
    fn every_bad_message_is_refused_with_its_code() {
        let pool = pool();
        let l = layout();
        let mut h = header("a", 6);
        h.model_id = "other".into();
        assert!(matches!(
            Ingest::begin(&l, &pool, &h),
            Err(Error::Mismatch {
                field: "model_id",
                ..
            })
        ));
        let mut h = header("a", 6);
        h.head_dim = 8;
        assert!(matches!(
            Ingest::begin(&l, &pool, &h),
            Err(Error::Mismatch {
                field: "head_dim",
                ..
            })
        ));
        let mut h = header("a", 6);
        h.dtype = 0;
        assert!(matches!(
            Ingest::begin(&l, &pool, &h),
            Err(Error::Invalid(_))
        ));
        let mut h = header("a", 6);
        h.prompt_token_ids.pop();
        assert!(matches!(
            Ingest::begin(&l, &pool, &h),
            Err(Error::Invalid(_))
        ));
        let mut h = header("a", 6);
        h.next_token_id = 100;
        assert!(matches!(
            Ingest::begin(&l, &pool, &h),
            Err(Error::Invalid(_))
        ));
        assert!(matches!(
            Ingest::begin(&l, &pool, &header("a", 600)),
            Err(Error::Exhausted { .. })
        ));
        assert_eq!(pool.usage().used + pool.usage().reserved, 0);

        let mut ing = Ingest::begin(&l, &pool, &header("a", 6)).unwrap();
        let mut c = chunk(0, 0, 2);
        c.crc32c ^= 1;
        assert!(
            matches!(ing.chunk(&c.clone().into()), Err(Error::Invalid(m)) if m.contains("CRC"))
        );
        // A CRC failure ends the push (the chunk was written before its check, on every
        // path): the next starts again.
        drop(ing);
        let mut ing = Ingest::begin(&l, &pool, &header("a", 6)).unwrap();
        assert!(matches!(
            ing.chunk(&chunk(2, 0, 2).into()),
            Err(Error::Invalid(_))
        ));
        assert!(matches!(
            ing.chunk(&chunk(0, 5, 2).into()),
            Err(Error::Invalid(_))
        ));
        let mut c = chunk(0, 0, 2);
        c.value = c.value.slice(2..);
        assert!(matches!(
            ing.chunk(&c.clone().into()),
            Err(Error::Invalid(_))
        ));
        ing.chunk(&chunk(0, 0, 6).into()).unwrap();
        assert!(matches!(ing.commit(None), Err(Error::Invalid(m)) if m.contains("not sent")));
        assert_eq!(
            pool.usage().used + pool.usage().reserved,
            0,
            "failed commit frees"
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 64,
            rng_seed: proptest::test_runner::RngSeed::Fixed(3),
            ..Default::default()
        })]
        /// Any split of the prompt into chunks, sent in any order, commits the same blocks and
        /// digests as one in-order push.
        #[test]
        fn chunk_order_and_split_do_not_matter(
            n in 1usize..40,
            cuts in proptest::collection::vec(1usize..40, 0..8),
            order in proptest::collection::vec(proptest::prelude::any::<u32>(), 64),
            wire_f32: bool,
        ) {
            let pool = HostPool::new(layout().geom, 64 * layout().geom.block_bytes() as u64).unwrap();
            let mut reference = Ingest::begin(&layout(), &pool, &header("r", n as u32)).unwrap();
            reference.chunk(&chunk(0, 0, n).into()).unwrap();
            reference.chunk(&chunk(1, 0, n).into()).unwrap();
            let mut reference = reference.commit(None).unwrap();

            let mut bounds: Vec<usize> = cuts.into_iter().filter(|c| *c < n).collect();
            bounds.extend([0, n]);
            bounds.sort_unstable();
            bounds.dedup();
            let mut chunks: Vec<KvChunk> = (0..2)
                .flat_map(|l| bounds.windows(2).map(move |w| chunk(l, w[0], w[1] - w[0])))
                .collect();
            // A permutation driven by the generated keys.
            let mut keyed: Vec<(u32, KvChunk)> = chunks.drain(..).enumerate().map(|(i, c)| (order[i % 64] ^ i as u32, c)).collect();
            keyed.sort_by_key(|k| k.0);
            // f32 on the wire into the f32 pool takes the fused path (CRC and digest per run);
            // f16 converts. Both must land exactly as the in-order f16 reference.
            let mut h = header("s", n as u32);
            if wire_f32 {
                h.dtype = DType::DtypeF32 as i32;
                for k in &mut keyed {
                    k.1 = to_f32(k.1.clone());
                }
            }
            let mut ing = Ingest::begin(&layout(), &pool, &h).unwrap();
            for (key, c) in &keyed {
                // Key and value split in up to three frames, as HTTP/2 may deliver them.
                let split = |b: &Bytes, salt: u32| {
                    let (x, y) = ((key ^ salt) as usize % (b.len() + 1), (key >> 7) as usize % (b.len() + 1));
                    let (x, y) = (x.min(y), x.max(y));
                    Payload::from(vec![b.slice(..x), b.slice(x..y), b.slice(y..)])
                };
                let mut parts = Chunk::from(c.clone());
                parts.key = split(&c.key, 0x55);
                parts.value = split(&c.value, 0xAA);
                ing.chunk(&parts).unwrap();
            }
            let mut got = ing.commit(None).unwrap();
            let g = layout().geom;
            for l in 0..2 {
                for b in 0..g.blocks_for(n) {
                    let len = (n - b * g.block_size).min(g.block_size);
                    for h in 0..2 {
                        let r = &reference.block(l, b)[g.head_range(h)];
                        let x = &got.block(l, b)[g.head_range(h)];
                        // Compare only written slots: K^T columns < len, V rows < len.
                        let es = 4;
                        for c in 0..g.head_dim {
                            let row = c * g.block_size * es;
                            proptest::prop_assert_eq!(&r[row..row + len * es], &x[row..row + len * es]);
                        }
                        let v0 = g.block_size * g.head_dim * es;
                        proptest::prop_assert_eq!(&r[v0..v0 + len * g.head_dim * es], &x[v0..v0 + len * g.head_dim * es]);
                    }
                }
            }
            proptest::prop_assert_eq!(reference.take_digests(), got.take_digests());
        }
    }
}
