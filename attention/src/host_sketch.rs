//! The 4-bit key sketch ([`crate::sketch`]) kept on the host, so a CPU node scores every block
//! from it instead of quantizing every key it reads at every step.
//!
//! Each (layer, KV head) of a sequence keeps its sketch in pages the node hands over (pool
//! blocks, so the sketch is accounted as KV is). A page holds whole KV blocks
//! ([`tokens_per_page`] tokens); each block is its tokens' f32 scales, then its nibbles
//! transposed as K is in the pool: a row per byte (channels `2j`, `2j + 1`), a column per
//! token, so the AVX2 path reads 16 tokens' nibbles at once for every head of the group and
//! needs no horizontal sums.
//! The sketch follows the pool: before a layer scores, the blocks it scores that are not
//! sketched yet are quantized from the KV (the prompt at the first step, then a block each
//! time one fills) exactly as [`crate::sketch::sketch_tokens`] does, so the scores are the
//! definition's up to the order of sums and a polynomial `exp2` on AVX2, where the query is
//! also rounded to int8 (`QueryI8`) for blocks of a multiple of 16 tokens: integer dot
//! products, 1.2-1.7x faster than widening each nibble to f32 (G=3 to 8), for a rounding far
//! below the keys' own 4 bits.

use rayon::prelude::*;

use crate::block::BlockGeometry;
use crate::digest::GroupScore;
use crate::dtype::decode_to_f32;
use crate::plan::PARALLEL_SELECT_BLOCKS;
use crate::sequence::KvSource;
use crate::sketch::{LEVEL_MAX, NIBBLE_ZERO, block_lse, level, nibble_bytes, tokens_per_slot};

/// Memory of one sketch page: in the node a host pool block, in tests a vector.
pub trait SketchPage: Send + Sync + std::fmt::Debug {
    /// The page.
    fn bytes(&self) -> &[u8];
    /// The page, to write.
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl SketchPage for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// Tokens of one KV head's sketch a page of `page_bytes` holds: whole blocks of
/// `block_size` tokens (0 where not even one fits).
pub const fn tokens_per_page(page_bytes: usize, head_dim: usize, block_size: usize) -> usize {
    let bs = if block_size == 0 { 1 } else { block_size };
    tokens_per_slot(page_bytes, head_dim) / bs * bs
}

/// Pages one (layer, KV head) needs to sketch `tokens` tokens (`usize::MAX` where no page
/// holds a block).
pub const fn pages_for(tokens: usize, tokens_per_page: usize) -> usize {
    if tokens_per_page == 0 {
        usize::MAX
    } else {
        tokens.div_ceil(tokens_per_page)
    }
}

/// One (layer, KV head)'s sketch in its pages.
#[derive(Debug)]
pub(crate) struct HeadSketch {
    pages: Vec<Box<dyn SketchPage>>,
    tokens_per_page: usize,
    /// Tokens sketched, from the first.
    tokens: usize,
}

/// Blocks a task of [`HeadSketch::block_scores`] scores.
const SKETCH_TASK_BLOCKS: usize = 32;

/// Blocks of one head from which [`HeadSketch::block_scores`] runs in tasks: a block costs
/// 140-230 ns (G = 3, head_dim 64, AVX2; in cache, from DRAM), so two tasks already pay for
/// a thread. At the scans' shared [`PARALLEL_SELECT_BLOCKS`] (256), a head of a context
/// below 8k tokens was one task, and a layer's 3 heads on 2 threads took as long as two
/// heads: SmolLM2 at 7.8k, `scout`, 2 threads, AVX2, three alternating runs each, the step's
/// selection 3.9-4.3 ms with 256 and 3.0-3.2 ms with 64 (tasks of 16 blocks: 3.1-3.7).
const PARALLEL_SKETCH_BLOCKS: usize = 2 * SKETCH_TASK_BLOCKS;

/// Bytes of one block's sketch: `block_size` scales, then `nibble_bytes` rows of
/// `block_size` bytes.
fn block_stride(block_size: usize, head_dim: usize) -> usize {
    block_size * (nibble_bytes(head_dim) + 4)
}

/// Sketches tokens `range` of `block` of (`layer`, `head`) into `dst` (that block's sketch:
/// scales, then transposed nibbles) straight from the pool's transposed K, every token at
/// once a channel row at a time: [`crate::sketch::quantize_key`]'s values, bit for bit.
/// Compiled for AVX2 too, where the CPU has it: its loops over tokens vectorise 8 wide
/// (a prompt's sketch is made at its first step, so this is time to the first token).
fn sketch_block(
    geom: &BlockGeometry,
    src: &dyn KvSource,
    layer: usize,
    head: usize,
    block: usize,
    range: std::ops::Range<usize>,
    dst: &mut [u8],
) {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has AVX2 and FMA.
        unsafe { avx2::sketch_block(geom, src, layer, head, block, range, dst) };
        return;
    }
    sketch_block_body(geom, src, layer, head, block, range, dst);
}

/// [`sketch_block`]'s definition, for the compiler to vectorise at each call site's features.
#[inline(always)]
fn sketch_block_body(
    geom: &BlockGeometry,
    src: &dyn KvSource,
    layer: usize,
    head: usize,
    block: usize,
    range: std::ops::Range<usize>,
    dst: &mut [u8],
) {
    let (bs, d, es) = (geom.block_size, geom.head_dim, geom.dtype.size());
    let (t0, n) = (range.start, range.len());
    let hb = &src.block(layer, block)[geom.head_range(head)];
    // K as stored: a row per channel; int8 and fp8 scaled back per token.
    let mut k = vec![0f32; d * n];
    for (c, row) in k.chunks_exact_mut(n).enumerate() {
        let at = (c * bs + t0) * es;
        decode_to_f32(geom.dtype, &hb[at..at + n * es], row);
    }
    if geom.dtype.scaled() {
        let ks = geom.scales(hb).0;
        let s: Vec<f32> = range
            .clone()
            .map(|t| crate::block::scale_at(ks, t))
            .collect();
        for row in k.chunks_exact_mut(n) {
            for (x, s) in row.iter_mut().zip(&s) {
                *x *= s;
            }
        }
    }
    // Each token's largest magnitude (NaN passed over), as `quantize_key` finds it.
    let mut amax = vec![0f32; n];
    for row in k.chunks_exact(n) {
        for (m, x) in amax.iter_mut().zip(row) {
            let a = x.abs();
            *m = if a > *m { a } else { *m };
        }
    }
    let (scales, nib) = dst.split_at_mut(bs * 4);
    let mut inv = vec![0f32; n];
    for (t, (m, i)) in amax.iter().zip(&mut inv).enumerate() {
        let scale = if m.is_finite() && *m > 0.0 {
            m / LEVEL_MAX
        } else {
            0.0
        };
        *i = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        scales[(t0 + t) * 4..(t0 + t + 1) * 4].copy_from_slice(&scale.to_ne_bytes());
    }
    let zero = NIBBLE_ZERO as u8;
    for (j, out) in nib.chunks_exact_mut(bs).take(nibble_bytes(d)).enumerate() {
        let out = &mut out[t0..t0 + n];
        let even = &k[2 * j * n..(2 * j + 1) * n];
        match k.get((2 * j + 1) * n..(2 * j + 2) * n) {
            Some(odd) => {
                for (((o, &e), &x), &i) in out.iter_mut().zip(even).zip(odd).zip(&inv) {
                    *o = level(e * i) | (level(x * i) << 4);
                }
            }
            // An odd head_dim's last byte: its high nibble stands for 0.
            None => {
                for ((o, &e), &i) in out.iter_mut().zip(even).zip(&inv) {
                    *o = level(e * i) | (zero << 4);
                }
            }
        }
    }
}

impl HeadSketch {
    pub(crate) fn new(pages: Vec<Box<dyn SketchPage>>, tokens_per_page: usize) -> Self {
        Self {
            pages,
            tokens_per_page,
            tokens: 0,
        }
    }

    /// Tokens the pages can hold.
    pub(crate) fn capacity(&self) -> usize {
        self.pages.len() * self.tokens_per_page
    }

    /// Tokens sketched.
    pub(crate) fn tokens(&self) -> usize {
        self.tokens
    }

    /// Sketches (`layer`, `head`)'s tokens up to `to` from `src`; false (nothing written)
    /// where the pages cannot hold them or `src` does not hold them yet.
    pub(crate) fn catch_up(
        &mut self,
        geom: &BlockGeometry,
        src: &dyn KvSource,
        layer: usize,
        head: usize,
        to: usize,
    ) -> bool {
        if to > self.capacity() || to > src.num_tokens() {
            return false;
        }
        let (tpp, bs, d) = (self.tokens_per_page, geom.block_size, geom.head_dim);
        let stride = block_stride(bs, d);
        while self.tokens < to {
            let page = self.tokens / tpp;
            let first = page * tpp;
            let upto = to.min(first + tpp);
            let start = self.tokens;
            let from_block = (start - first) / bs;
            let blocks = (upto - first).div_ceil(bs) - from_block;
            let one = |(j, dst): (usize, &mut [u8])| {
                let b = first / bs + from_block + j;
                let b0 = b * bs;
                let (lo, hi) = (start.max(b0) - b0, upto.min(b0 + bs) - b0);
                sketch_block(geom, src, layer, head, b, lo..hi, dst);
            };
            let region = &mut self.pages[page].bytes_mut()[from_block * stride..];
            if blocks >= PARALLEL_SELECT_BLOCKS / 8 {
                region
                    .par_chunks_mut(stride)
                    .take(blocks)
                    .enumerate()
                    .for_each(one);
            } else {
                region
                    .chunks_mut(stride)
                    .take(blocks)
                    .enumerate()
                    .for_each(one);
            }
            self.tokens = upto;
        }
        true
    }

    /// [`crate::sketch::block_scores`] of `blocks` from the kept sketch: every block must lie
    /// within the tokens sketched (tokens past them count as absent).
    pub(crate) fn block_scores(
        &self,
        geom: &BlockGeometry,
        q_group: &[f32],
        scale: f32,
        how: GroupScore,
        blocks: &[usize],
    ) -> Vec<f32> {
        let (bs, d) = (geom.block_size, geom.head_dim);
        let g = (q_group.len() / d.max(1)).max(1);
        let temp = scale * std::f32::consts::LOG2_E;
        let (tpp, stride) = (self.tokens_per_page, block_stride(bs, d));
        // Levels are `nibble - 8`: each head's sums start from `-8 sum(q)`.
        let bias: Vec<f32> = q_group
            .chunks_exact(d.max(1))
            .map(|q| -8.0 * q.iter().sum::<f32>())
            .collect();
        let int8 = QueryI8::for_blocks(q_group, d, bs);
        let mut lse = vec![0f32; blocks.len() * g];
        let sketch_of = |b: usize| {
            let from = b * bs;
            let page = self.pages[from / tpp].bytes();
            let at = (from % tpp) / bs * stride;
            &page[at..at + stride]
        };
        let tokens_of = |b: usize| self.tokens.min(b * bs + bs).saturating_sub(b * bs);
        let fill = |chunk: &mut [f32], first: usize, buf: &mut Vec<f32>| {
            let mine = &blocks[first..first + chunk.len() / g];
            #[cfg(not(target_arch = "x86_64"))]
            let _ = &int8; // always `None` here
            #[cfg(target_arch = "x86_64")]
            if let Some(qi) = int8.as_ref() {
                let sketches: Vec<(&[u8], usize)> = mine
                    .iter()
                    .map(|&b| match tokens_of(b) {
                        0 => (&[][..], 0),
                        len => (sketch_of(b), len),
                    })
                    .collect();
                // AVX-512 where the CPU has it, as the attention kernel takes it.
                let avx512 = crate::kernel_avx512::available();
                // SAFETY: `QueryI8::for_blocks` made one only where AVX2 is present and 16
                // divides `bs`, `available` checked AVX-512; each sketch is a whole block's
                // (or empty, with no tokens).
                unsafe { avx2::chunk_lse_i8(qi, d, bs, temp, &sketches, buf, chunk, avx512) };
                return;
            }
            for (&b, out) in mine.iter().zip(chunk.chunks_mut(g)) {
                let len = tokens_of(b);
                if len == 0 {
                    out.fill(f32::NEG_INFINITY);
                    continue;
                }
                lse_of_block(q_group, &bias, d, bs, temp, sketch_of(b), len, buf, out);
            }
        };
        if blocks.len() >= PARALLEL_SKETCH_BLOCKS {
            lse.par_chunks_mut(SKETCH_TASK_BLOCKS * g)
                .enumerate()
                .for_each_init(Vec::new, |buf, (i, c)| fill(c, i * SKETCH_TASK_BLOCKS, buf));
        } else {
            fill(&mut lse, 0, &mut Vec::new());
        }
        crate::sparq::group_shares(&lse, g, how)
    }
}

/// Each query head's log2-sum-exp2 over the first `len` tokens of one block's sketch
/// (`block`: scales, then transposed nibbles), into `out[G]`, where the integer path
/// ([`avx2::chunk_lse_i8`]) does not apply: on AVX2 (block size a multiple of 8) widened to
/// f32 in registers, with a polynomial `exp2`; elsewhere by the definition.
#[allow(clippy::too_many_arguments)]
fn lse_of_block(
    q_group: &[f32],
    bias: &[f32],
    d: usize,
    bs: usize,
    temp: f32,
    block: &[u8],
    len: usize,
    buf: &mut Vec<f32>,
    out: &mut [f32],
) {
    let nb = nibble_bytes(d);
    let (sc, nib) = block.split_at(bs * 4);
    // The scales, then the AVX2 path's sums, in the caller's buffer: one allocation per
    // thread, not per block.
    buf.resize(9 * bs, 0.0);
    let (scales, acc) = buf.split_at_mut(bs);
    let scales = &mut scales[..len];
    for (s, b) in scales.iter_mut().zip(sc.chunks_exact(4)) {
        *s = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
    }
    #[cfg(target_arch = "x86_64")]
    if bs.is_multiple_of(8) && avx2::available() {
        // SAFETY: AVX2 and FMA are present; `nib` holds `nb` rows of `bs` bytes and
        // `q_group` `out.len()` heads of `d` floats.
        unsafe { avx2::block_lse(q_group, bias, d, bs, temp, nib, scales, acc, out) };
        return;
    }
    // The definition's layout back: a row of `nb` bytes per token.
    let mut rows = vec![0u8; len * nb];
    for (t, row) in rows.chunks_exact_mut(nb).enumerate() {
        for (j, r) in row.iter_mut().enumerate() {
            *r = nib[j * bs + t];
        }
    }
    let _ = (acc, bias);
    block_lse(q_group, d, temp, &rows, scales, out);
}

/// The group's query as the integer path ([`avx2::chunk_lse_i8`]) reads it: each head rounded
/// to int8 on its own step (`q ≈ step * q8`, `|q8| <= 127`), so a block's dot products are exact
/// integer sums that `vpmaddubsw` forms 32 nibble products at a time, where widening each
/// nibble to f32 for an FMA took 8. The rounding moves a token's score by at most
/// `step / 2 * 8 * head_dim` times its key scale (the levels are at most 8 from zero): for a
/// query whose channels are alike in size, about a 250th of the score's own spread, against
/// the key's 4 bits, which move it by about a 14th.
#[derive(Debug)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // made and read on x86-64 only
pub(crate) struct QueryI8 {
    /// `[G][nibble_bytes]`: channel `2j` of a head in byte 0, `2j + 1` in byte 1 (0 past an
    /// odd `d`), the pair again in bytes 2-3: the pairing `vpmaddubsw` makes of a token's
    /// two nibbles, for a 32-bit broadcast.
    pairs: Vec<u32>,
    /// `[G][nibble_bytes.div_ceil(2)]`: channels `4m .. 4m + 4` of a head in bytes 0-3 (0
    /// past `d`): the four products one `vpdpbusd` lane sums.
    quads: Vec<u32>,
    /// Each head's step.
    step: Vec<f32>,
    /// Each head's `8 sum(q8)`: what the nibbles' offset from their level adds.
    zero: Vec<i32>,
}

impl QueryI8 {
    /// The integer form of `q_group` (`[G][d]`) where this CPU and block size take the
    /// integer path (AVX2, 16 | `bs`); `None` elsewhere, and for a query with a NaN or
    /// infinite channel, which the float paths score as the definition does.
    fn for_blocks(q_group: &[f32], d: usize, bs: usize) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if d > 0 && bs.is_multiple_of(16) && avx2::available() {
            return Self::new(q_group, d);
        }
        let _ = (q_group, d, bs);
        None
    }

    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn new(q_group: &[f32], d: usize) -> Option<Self> {
        if q_group.iter().any(|x| !x.is_finite()) {
            return None;
        }
        let nb = nibble_bytes(d);
        let g = q_group.len() / d;
        let mut me = Self {
            pairs: Vec::with_capacity(g * nb),
            quads: Vec::with_capacity(g * nb.div_ceil(2)),
            step: Vec::with_capacity(g),
            zero: Vec::with_capacity(g),
        };
        for q in q_group.chunks_exact(d) {
            let (step, q8) = crate::sketch::round_query_i8(q)?;
            me.step.push(step);
            me.zero
                .push(8 * q8.iter().map(|&x| i32::from(x)).sum::<i32>());
            me.pairs.extend(q8.chunks(2).map(|p| {
                let pair = u32::from(p[0] as u8) | u32::from(*p.get(1).unwrap_or(&0) as u8) << 8;
                pair | pair << 16
            }));
            me.quads.extend(q8.chunks(4).map(|p| {
                (0..4).fold(0u32, |w, i| {
                    w | u32::from(*p.get(i).unwrap_or(&0) as u8) << (8 * i)
                })
            }));
        }
        Some(me)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Most heads [`dots_i8_wide`] takes: two 16-bit sums a head live through its row loop,
    /// and eight heads' would not fit the 16 registers beside the row's.
    const WIDE_HEADS: usize = 4;

    /// How many blocks ahead [`chunk_lse_i8`] asks for the sketch, into L2. `bench select
    /// --kv-heads 3 --group 3 --head-dim 64 --scorers sketch --layers 30` (AVX2, 2-core EPYC,
    /// four alternating runs, ms a layer at 1 / 2 threads), against two blocks into L1 with
    /// nothing for a task's first two: 32k (past L3) 0.51-0.54 / 0.26-0.38 -> 0.44-0.51 /
    /// 0.23-0.25; 8k 0.116-0.141 / 0.064-0.085 -> 0.115-0.126 / 0.062-0.078. Into L1 at four
    /// blocks was slower than at two (a block is 18 lines: L1's miss buffers fill); into L2 at
    /// two, three or six blocks, or at two with the task's first, no better than this.
    ///
    /// Each block's row loop asks for that block a line at a time ([`Prefetch::line`], spread
    /// over its rows), where it once asked for all its lines at its start: on the Xeon VM
    /// (`--scorers sketch --context 32768`, two alternations, ns a token and KV head at 1 / 2
    /// threads) G=3 D=64 4.8-5.0 / 3.5-3.6 -> 4.3-4.4 / 3.1 (8k: 4.4-4.7 -> 3.9-4.1 at one
    /// thread), G=5 D=128 (8 KV heads) 9.8 / 5.0 -> 8.8 / 4.6; on its AVX2 loops
    /// (`DECODE_NODE_AVX512=0`) G=5 14.4-14.7 / 7.6 -> 12.9-13.4 / 6.7-6.8, G=3 alike. Two
    /// blocks ahead so measured 8.2 / 4.3 at G=5 but no better than four at G=3. With the
    /// sketch in L3 (`--layers 1`) G=5 takes 6.8: its integer sums 4.1 of that, the scores'
    /// log2-sum-exp2 1.2, the rest of a block ~1.1 (requests 0.5 of it).
    const SKETCH_AHEAD: usize = 4;

    use crate::avx2::{AsBf16, AsF8, AsF16, AsF32, AsI8, Elem};
    use crate::block::BlockGeometry;
    use crate::dtype::KvDType;
    use crate::kernel_avx2::Prefetch;
    use crate::sketch::{LEVEL_MAX, NIBBLE_ZERO, nibble_bytes};

    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }

    /// [`super::sketch_block`] on AVX2: eight tokens at a time straight from the stored K
    /// ([`sketch_tokens`]), the rest of the range (under eight tokens) by the definition.
    ///
    /// # Safety
    /// AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn sketch_block(
        geom: &BlockGeometry,
        src: &dyn crate::sequence::KvSource,
        layer: usize,
        head: usize,
        block: usize,
        range: std::ops::Range<usize>,
        dst: &mut [u8],
    ) {
        let whole = range.start..range.start + range.len() / 8 * 8;
        if !whole.is_empty() {
            let hb = &src.block(layer, block)[geom.head_range(head)];
            // SAFETY (every arm): AVX2, FMA and F16C; `E` is the block's element type.
            unsafe {
                match geom.dtype {
                    KvDType::F32 => sketch_tokens::<AsF32>(geom, hb, whole.clone(), dst),
                    KvDType::F16 => sketch_tokens::<AsF16>(geom, hb, whole.clone(), dst),
                    KvDType::Bf16 => sketch_tokens::<AsBf16>(geom, hb, whole.clone(), dst),
                    KvDType::I8 => sketch_tokens::<AsI8>(geom, hb, whole.clone(), dst),
                    KvDType::F8E4M3 => sketch_tokens::<AsF8>(geom, hb, whole.clone(), dst),
                }
            }
        }
        if whole.end < range.end {
            super::sketch_block_body(geom, src, layer, head, block, whole.end..range.end, dst);
        }
    }

    /// [`super::sketch_block_body`]'s values, bit for bit, for tokens `range` (a multiple of
    /// eight) of a head block `hb` of element type `E`, a lane per token: each channel row's
    /// eight tokens read as stored (int8 and fp8 times their token's scale), their largest
    /// magnitude, then each pair of channels rounded to nibbles and packed eight bytes at a
    /// time. The definition's element-wise loops do not vectorise (its float-to-integer
    /// conversion saturates, which x86 has no vector instruction for): at head_dim 64 they
    /// took 150 ns a token, this 45-55 (2-core Xeon VM, one thread).
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `E` is `geom.dtype`'s element type (the sizes are asserted).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sketch_tokens<E: Elem>(
        geom: &BlockGeometry,
        hb: &[u8],
        range: std::ops::Range<usize>,
        dst: &mut [u8],
    ) {
        let (bs, d, es) = (geom.block_size, geom.head_dim, E::SIZE);
        let nb = nibble_bytes(d);
        assert!(
            range.end <= bs
                && range.len().is_multiple_of(8)
                && es == geom.dtype.size()
                && hb.len() >= bs * d * es
                && dst.len() >= bs * (4 + nb)
        );
        let scaled = geom.dtype.scaled();
        let token_scales = geom.scales(hb).0;
        let (scales, nib) = dst.split_at_mut(bs * 4);
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let zero = _mm256_setzero_ps();
        for t in range.step_by(8) {
            // Each token's scale (int8, fp8) multiplies its channels, as the definition's.
            let ts = if scaled {
                assert!(token_scales.len() >= (t + 8) * 4);
                // SAFETY: eight f32 scales from token t, inside the scales (asserted).
                unsafe { _mm256_loadu_ps(token_scales.as_ptr().add(t * 4).cast()) }
            } else {
                _mm256_set1_ps(1.0)
            };
            // SAFETY: channel c < d of tokens t .. t + 8 <= bs: inside the head's K rows.
            let key = |c: usize| unsafe {
                let k = E::load8(hb.as_ptr().add((c * bs + t) * es));
                if scaled { _mm256_mul_ps(k, ts) } else { k }
            };
            // The largest magnitude; a NaN (first operand) is passed over.
            let mut m = zero;
            for c in 0..d {
                m = _mm256_max_ps(_mm256_and_ps(key(c), abs), m);
            }
            let usable = _mm256_and_ps(
                _mm256_cmp_ps::<_CMP_LT_OQ>(m, _mm256_set1_ps(f32::INFINITY)),
                _mm256_cmp_ps::<_CMP_GT_OQ>(m, zero),
            );
            let scale = _mm256_and_ps(usable, _mm256_div_ps(m, _mm256_set1_ps(LEVEL_MAX)));
            let inv = _mm256_and_ps(
                _mm256_cmp_ps::<_CMP_GT_OQ>(scale, zero),
                _mm256_div_ps(_mm256_set1_ps(1.0), scale),
            );
            // SAFETY: eight scales of tokens t .. t + 8 <= bs, inside `scales`.
            unsafe { _mm256_storeu_ps(scales.as_mut_ptr().add(t * 4).cast(), scale) };
            for j in 0..nb {
                let lo = level8(_mm256_mul_ps(key(2 * j), inv));
                let hi = if 2 * j + 1 < d {
                    level8(_mm256_mul_ps(key(2 * j + 1), inv))
                } else {
                    _mm256_set1_epi32(NIBBLE_ZERO)
                };
                let bytes = _mm256_or_si256(lo, _mm256_slli_epi32::<4>(hi));
                // Eight 32-bit lanes of 0..=255 down to bytes: lanes 0-3 land in the low
                // 128 bits' first word, lanes 4-7 in the high's.
                let w = _mm256_packus_epi32(bytes, bytes);
                let b = _mm256_packus_epi16(w, w);
                let packed = u64::from(_mm256_cvtsi256_si32(b) as u32)
                    | u64::from(_mm256_extract_epi32::<4>(b) as u32) << 32;
                nib[j * bs + t..j * bs + t + 8].copy_from_slice(&packed.to_le_bytes());
            }
        }
    }

    /// [`crate::sketch::level`] of eight lanes: rounded half away from zero, clamped to
    /// -8 ..= 7, offset by 8; NaN gives 8.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn level8(t: __m256) -> __m256i {
        // |t| with NaN as 0, and no more than 16 (a larger one clamps to 7 either way): the
        // truncation below then never meets a value out of its range.
        let ordered = _mm256_cmp_ps::<_CMP_ORD_Q>(t, t);
        let a = _mm256_min_ps(
            _mm256_and_ps(
                _mm256_and_ps(t, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff))),
                ordered,
            ),
            _mm256_set1_ps(16.0),
        );
        let whole = _mm256_cvttps_epi32(a);
        let up = _mm256_cmp_ps::<_CMP_GE_OQ>(
            _mm256_sub_ps(a, _mm256_cvtepi32_ps(whole)),
            _mm256_set1_ps(0.5),
        );
        // The comparison's mask is -1: taking it away adds one.
        let mag = _mm256_sub_epi32(whole, _mm256_castps_si256(up));
        let neg = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(t, _mm256_setzero_ps()));
        let r = _mm256_sub_epi32(_mm256_xor_si256(mag, neg), neg);
        let r = _mm256_min_epi32(
            _mm256_max_epi32(r, _mm256_set1_epi32(-NIBBLE_ZERO)),
            _mm256_set1_epi32(LEVEL_MAX as i32),
        );
        _mm256_add_epi32(r, _mm256_set1_epi32(NIBBLE_ZERO))
    }

    /// [`super::lse_of_block`] on AVX2: heads in groups of up to eight, each byte row of
    /// `8 V` tokens widened once for all the group's heads, the even and odd channels summed
    /// apart (`S` = 2) where registers allow, so no FMA waits on the one before it.
    ///
    /// # Safety
    /// AVX2 and FMA; `bs` a multiple of 8; `nib` holds `d.div_ceil(2)` rows of `bs` bytes,
    /// `q_group` `out.len()` heads of `d` floats and `bias` (`-8 sum(q_h)`) one per head,
    /// `acc` `8 bs` floats.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block_lse(
        q_group: &[f32],
        bias: &[f32],
        d: usize,
        bs: usize,
        temp: f32,
        nib: &[u8],
        scales: &[f32],
        acc: &mut [f32],
        out: &mut [f32],
    ) {
        for ((qs, outs), bias) in q_group
            .chunks(8 * d)
            .zip(out.chunks_mut(8))
            .zip(bias.chunks(8))
        {
            let g = outs.len();
            // As many token vectors a head as registers hold (broadcasts and loop costs are
            // shared by more tokens); two sums a vector where one head alone would wait on
            // its FMAs.
            let v = match g {
                1..=5 => 2,
                _ => 1,
            }
            .min(bs / 8);
            // SAFETY: as the caller promises; `dots` asserts that `8 v` divides `bs`.
            unsafe {
                match (g, v) {
                    (1, 2) => dots::<1, 2, 2>(qs, d, bs, nib, bias, acc),
                    (1, _) => dots::<1, 1, 2>(qs, d, bs, nib, bias, acc),
                    (2, 2) => dots::<2, 2, 2>(qs, d, bs, nib, bias, acc),
                    (2, _) => dots::<2, 1, 2>(qs, d, bs, nib, bias, acc),
                    (3, 2) => dots::<3, 2, 1>(qs, d, bs, nib, bias, acc),
                    (3, _) => dots::<3, 1, 2>(qs, d, bs, nib, bias, acc),
                    (4, 2) => dots::<4, 2, 1>(qs, d, bs, nib, bias, acc),
                    (4, _) => dots::<4, 1, 2>(qs, d, bs, nib, bias, acc),
                    (5, 2) => dots::<5, 2, 1>(qs, d, bs, nib, bias, acc),
                    (5, _) => dots::<5, 1, 2>(qs, d, bs, nib, bias, acc),
                    (6, _) => dots::<6, 1, 1>(qs, d, bs, nib, bias, acc),
                    (7, _) => dots::<7, 1, 1>(qs, d, bs, nib, bias, acc),
                    _ => dots::<8, 1, 1>(qs, d, bs, nib, bias, acc),
                }
            }
            scaled_lse(acc, bs, scales, outs, |_| temp);
        }
    }

    /// The integer path of [`super::HeadSketch::block_scores`]: each head's log2-sum-exp2
    /// over each of `blocks` (each block's sketch and its tokens; none: empty) into
    /// `out[j * G + h]` for block `j` and head `h`, in two passes over the blocks. First every
    /// token's sum (`dots_i8`, heads in groups of up to eight), scaled back by its head's
    /// step and its token's key scale, into `x` (`[block][head][bs]`), with each head's
    /// maximum `M` over all the blocks; then each block's `M + log2(sum 2^(x - M))`, eight
    /// blocks' sums reduced together and their `log2` in one vector. Per block and head that
    /// leaves no maximum or sum tree and no scalar `log2`: done block by block, those took
    /// two fifths of a block's time at head_dim 64 (G = 3).
    ///
    /// # Safety
    /// AVX2 and FMA; `bs` a multiple of 16; every block holds `bs` scales and
    /// `d.div_ceil(2)` rows of `bs` bytes, `qi` `G` heads of `d` channels; `out` holds
    /// `blocks.len() * G` (the sizes are asserted).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn chunk_lse_i8(
        qi: &super::QueryI8,
        d: usize,
        bs: usize,
        temp: f32,
        blocks: &[(&[u8], usize)],
        x: &mut Vec<f32>,
        out: &mut [f32],
        avx512: bool,
    ) {
        let nb = d.div_ceil(2);
        let g = qi.step.len();
        assert!(
            bs.is_multiple_of(16)
                && out.len() >= blocks.len() * g
                && blocks
                    .iter()
                    .all(|(b, len)| *len == 0 || (b.len() >= bs * (4 + nb) && *len <= bs))
        );
        let n = blocks.len();
        for h0 in (0..g).step_by(8) {
            let gn = (g - h0).min(8);
            let (pairs, zero) = (&qi.pairs[h0 * nb..], &qi.zero[h0..h0 + gn]);
            let quads = &qi.quads[h0 * nb.div_ceil(2)..];
            let temps: [f32; 8] =
                std::array::from_fn(|h| if h < gn { temp * qi.step[h0 + h] } else { 0.0 });
            x.resize(n * gn * bs, 0.0);
            let mut top = [_mm256_set1_ps(f32::NEG_INFINITY); 8];
            let wide = bs.is_multiple_of(32) && gn <= WIDE_HEADS;
            let wide512 = bs.is_multiple_of(32) && avx512;
            for (j, &(blk, len)) in blocks.iter().enumerate() {
                // A task's own first blocks, all at once with its first (nothing fetched
                // them); each block's loop asks for the one `SKETCH_AHEAD` on.
                if j == 0 {
                    for (next, _) in blocks.iter().take(SKETCH_AHEAD) {
                        for at in (0..next.len()).step_by(64) {
                            // SAFETY: a prefetch is a hint; the address lies in `next`.
                            unsafe { _mm_prefetch::<_MM_HINT_T1>(next.as_ptr().add(at).cast()) };
                        }
                    }
                }
                let acc = &mut x[j * gn * bs..(j + 1) * gn * bs];
                if len == 0 {
                    acc.fill(f32::NEG_INFINITY);
                    continue;
                }
                let (sc, nib) = blk.split_at(bs * 4);
                let dots = Dots {
                    pairs,
                    quads,
                    zero,
                    nb,
                    bs,
                    nib,
                    sc,
                    len,
                    temps: &temps[..gn],
                    next: blocks.get(j + SKETCH_AHEAD).map_or(&[][..], |b| b.0),
                };
                let top = &mut top;
                if wide512 {
                    // SAFETY: `available` checked AVX-512 F and BW, `vnni` VNNI and VBMI; the
                    // loops assert the sizes.
                    unsafe {
                        if vnni() {
                            dots_i8_vnni_dyn(gn, &dots, acc, top)
                        } else {
                            dots_i8_512_dyn(gn, &dots, acc, top)
                        }
                    };
                    continue;
                }
                // SAFETY: the caller promises AVX2; the loops assert the sizes.
                unsafe {
                    match gn {
                        1 if wide => dots_i8_wide::<1>(&dots, acc, top),
                        2 if wide => dots_i8_wide::<2>(&dots, acc, top),
                        3 if wide => dots_i8_wide::<3>(&dots, acc, top),
                        4 if wide => dots_i8_wide::<4>(&dots, acc, top),
                        1 => dots_i8::<1>(&dots, acc, top),
                        2 => dots_i8::<2>(&dots, acc, top),
                        3 => dots_i8::<3>(&dots, acc, top),
                        4 => dots_i8::<4>(&dots, acc, top),
                        5 => dots_i8::<5>(&dots, acc, top),
                        6 => dots_i8::<6>(&dots, acc, top),
                        7 => dots_i8::<7>(&dots, acc, top),
                        _ => dots_i8::<8>(&dots, acc, top),
                    }
                };
            }
            for (h, m) in top.iter().take(gn).enumerate() {
                let m = _mm256_cvtss_f32(all_lanes(*m, |a, b| _mm256_max_ps(a, b)));
                let rows = Rows { x, n, gn, h, bs };
                let out = Out { out, g, h: h0 + h };
                if wide512 {
                    // SAFETY: the caller checked AVX-512; 32 divides `bs`.
                    unsafe { lse_rows_512(rows, m, out) };
                } else {
                    lse_rows(rows, m, out);
                }
            }
        }
    }

    /// Head `h`'s score rows of [`chunk_lse_i8`]'s `x` (`[n][gn][bs]`).
    #[derive(Clone, Copy)]
    struct Rows<'a> {
        x: &'a [f32],
        n: usize,
        gn: usize,
        h: usize,
        bs: usize,
    }

    impl<'a> Rows<'a> {
        /// Block `j`'s row.
        fn row(&self, j: usize) -> &'a [f32] {
            &self.x[(j * self.gn + self.h) * self.bs..][..self.bs]
        }
    }

    /// Where [`chunk_lse_i8`] puts head `h`'s block scores: `out[j * g + h]`.
    struct Out<'a> {
        out: &'a mut [f32],
        g: usize,
        h: usize,
    }

    impl Out<'_> {
        /// Blocks `j0..j0 + k`'s scores from the sums of their rows' `2^(x - m)`.
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        fn put(&mut self, j0: usize, k: usize, m: f32, sums: [__m256; 8]) {
            let mut lse = [0f32; 8];
            // SAFETY: eight floats.
            unsafe {
                _mm256_storeu_ps(
                    lse.as_mut_ptr(),
                    _mm256_add_ps(_mm256_set1_ps(m), log2_ps(sum_each(sums))),
                )
            };
            for (i, l) in lse.iter().take(k).enumerate() {
                self.out[(j0 + i) * self.g + self.h] = if m.is_finite() { *l } else { m };
            }
        }
    }

    /// Each block's `m + log2(sum 2^(x - m))` of head `rows.h`, eight blocks' sums reduced
    /// together.
    #[target_feature(enable = "avx2,fma")]
    fn lse_rows(rows: Rows<'_>, m: f32, mut out: Out<'_>) {
        let mv = _mm256_set1_ps(m);
        for j0 in (0..rows.n).step_by(8) {
            let k = (rows.n - j0).min(8);
            let mut sums = [_mm256_setzero_ps(); 8];
            for (i, s) in sums.iter_mut().take(k).enumerate() {
                for v in rows.row(j0 + i).chunks_exact(8) {
                    // SAFETY: eight floats of the row.
                    let v = unsafe { _mm256_loadu_ps(v.as_ptr()) };
                    *s = _mm256_add_ps(*s, crate::kernel_avx2::exp2_ps(_mm256_sub_ps(v, mv)));
                }
            }
            out.put(j0, k, m, sums);
        }
    }

    /// [`lse_rows`] with each `exp2` sixteen lanes at a time ([`exp_sums_512`]): the same
    /// bits. One function for the head, so the AVX-512 sums inline into it: called a row at
    /// a time from AVX2 code, each call went through memory and `vzeroupper`, and the rows'
    /// exponentials could not overlap (`chunk_lse_i8`'s own code, mostly waiting after those
    /// calls, was a quarter of `bench select`'s sketch samples; this way the sketch scores
    /// 5-7% faster, one thread).
    ///
    /// # Safety
    /// AVX-512 F; 16 divides `rows.bs`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn lse_rows_512(rows: Rows<'_>, m: f32, mut out: Out<'_>) {
        for j0 in (0..rows.n).step_by(8) {
            let k = (rows.n - j0).min(8);
            let mut sums = [_mm256_setzero_ps(); 8];
            for (i, s) in sums.iter_mut().take(k).enumerate() {
                // SAFETY: forwarded.
                *s = unsafe { exp_sums_512(rows.row(j0 + i), m, *s) };
            }
            out.put(j0, k, m, sums);
        }
    }

    /// `s` plus `2^(x - m)` of each eight floats of `row` in turn, as the AVX2 loop of
    /// [`chunk_lse_i8`] sums them (so the same bits), each `exp2` taken sixteen lanes at a
    /// time: per lane the same bits as [`crate::kernel_avx2::exp2_ps`].
    ///
    /// # Safety
    /// AVX-512 F; `row.len()` a multiple of 16.
    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    unsafe fn exp_sums_512(row: &[f32], m: f32, mut s: __m256) -> __m256 {
        let mv = _mm512_set1_ps(m);
        for v in row.chunks_exact(16) {
            // SAFETY: sixteen floats of the row.
            let v = unsafe { _mm512_loadu_ps(v.as_ptr()) };
            let (lo, hi) = halves(crate::kernel_avx512::exp2_ps(_mm512_sub_ps(v, mv)));
            s = _mm256_add_ps(_mm256_add_ps(s, lo), hi);
        }
        s
    }

    /// `v`'s low eight lanes and its high eight.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn halves(v: __m512) -> (__m256, __m256) {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        (_mm512_castps512_ps256(v), hi)
    }

    /// Lane `i` holds the sum of `v[i]`'s lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn sum_each(v: [__m256; 8]) -> __m256 {
        let a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
        let b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
        // a: [v0 v1 v2 v3 | v0 v1 v2 v3] halves' sums, b the same for v4..v7.
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        )
    }

    /// `log2 x` per lane for positive normal `x` (`-inf` for 0): `x = 2^k m` with `m` in
    /// [√½, √2) and `ln m = 2 atanh(s)`, `s = (m - 1) / (m + 1)`, by its series to `s^7`
    /// ([`crate::sparq::log2_from_one`]'s, for any exponent).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn log2_ps(x: __m256) -> __m256 {
        let bits = _mm256_castps_si256(x);
        let k = _mm256_srai_epi32::<23>(_mm256_sub_epi32(
            bits,
            _mm256_set1_epi32(0.5f32.sqrt().to_bits() as i32),
        ));
        let m = _mm256_castsi256_ps(_mm256_sub_epi32(bits, _mm256_slli_epi32::<23>(k)));
        let one = _mm256_set1_ps(1.0);
        let s = _mm256_div_ps(_mm256_sub_ps(m, one), _mm256_add_ps(m, one));
        let s2 = _mm256_mul_ps(s, s);
        let c = |v: f32| _mm256_set1_ps(v);
        let mut p = _mm256_fmadd_ps(s2, c(2.0 / 7.0), c(2.0 / 5.0));
        p = _mm256_fmadd_ps(s2, p, c(2.0 / 3.0));
        p = _mm256_fmadd_ps(s2, p, c(2.0));
        let ln_m = _mm256_mul_ps(s, p);
        let r = _mm256_fmadd_ps(ln_m, c(std::f32::consts::LOG2_E), _mm256_cvtepi32_ps(k));
        let zero = _mm256_cmp_ps::<_CMP_LE_OQ>(x, _mm256_setzero_ps());
        _mm256_blendv_ps(r, _mm256_set1_ps(f32::NEG_INFINITY), zero)
    }

    /// Each head `h`'s log2-sum-exp2 into `outs[h]` over its row of `acc` (`bs` apart), the
    /// block's `scales.len()` tokens, each sum times `temp_of(h)` and its token's key scale:
    /// [`crate::sparq::log2_sum_exp2`]'s value, eight tokens a vector (lanes past the block's
    /// tokens -inf), the maximum and the sum by halving trees and `exp2` by a polynomial with
    /// FMAs. As scalar code (sequential reductions, `exp2` without FMAs) it took as long as
    /// the dot products at head_dim 64.
    ///
    /// Needs AVX2 and FMA (callable safely from code compiled with them); the sizes (`bs` a
    /// multiple of 8 and at least `scales.len()`, `acc` `outs.len()` rows of `bs`) are asserted.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn scaled_lse(
        acc: &mut [f32],
        bs: usize,
        scales: &[f32],
        outs: &mut [f32],
        temp_of: impl Fn(usize) -> f32,
    ) {
        let len = scales.len();
        assert!(bs.is_multiple_of(8) && len <= bs && acc.len() >= outs.len() * bs);
        if len == 0 {
            outs.fill(f32::NEG_INFINITY);
            return;
        }
        let nv = len.div_ceil(8);
        // The last vector's scales, zero past the block's tokens (their lanes are masked).
        let mut last = [0f32; 8];
        last[..len - 8 * (nv - 1)].copy_from_slice(&scales[8 * (nv - 1)..]);
        let tail = _mm256_cmp_ps::<_CMP_LT_OQ>(
            _mm256_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0),
            _mm256_set1_ps((len - 8 * (nv - 1)) as f32),
        );
        let neg = _mm256_set1_ps(f32::NEG_INFINITY);
        for (h, (o, a)) in outs.iter_mut().zip(acc.chunks_exact_mut(bs)).enumerate() {
            let temp = _mm256_set1_ps(temp_of(h));
            let mut m = neg;
            for i in 0..nv {
                // SAFETY: 8 (i + 1) <= 8 nv <= bs: inside the row; the scales' vector inside
                // `scales` (or `last`).
                unsafe {
                    let s = if i + 1 < nv {
                        _mm256_loadu_ps(scales.as_ptr().add(8 * i))
                    } else {
                        _mm256_loadu_ps(last.as_ptr())
                    };
                    let p = a.as_mut_ptr().add(8 * i);
                    let mut x = _mm256_mul_ps(_mm256_loadu_ps(p), _mm256_mul_ps(temp, s));
                    if i + 1 == nv {
                        x = _mm256_blendv_ps(neg, x, tail);
                    }
                    _mm256_storeu_ps(p, x);
                    // A NaN (first operand) is passed over, as the scalar maximum does.
                    m = _mm256_max_ps(x, m);
                }
            }
            let m = all_lanes(m, |a, b| _mm256_max_ps(a, b));
            let top = _mm256_cvtss_f32(m);
            if !top.is_finite() {
                *o = top;
                continue;
            }
            let mut sum = _mm256_setzero_ps();
            for i in 0..nv {
                // SAFETY: as above.
                let x = unsafe { _mm256_loadu_ps(a.as_ptr().add(8 * i)) };
                sum = _mm256_add_ps(sum, crate::kernel_avx2::exp2_ps(_mm256_sub_ps(x, m)));
            }
            let sum = _mm256_cvtss_f32(all_lanes(sum, |a, b| _mm256_add_ps(a, b)));
            *o = top + crate::sparq::log2_from_one(sum);
        }
    }

    /// `f` of all eight lanes, in every lane: three halving steps.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn all_lanes(v: __m256, f: impl Fn(__m256, __m256) -> __m256) -> __m256 {
        let v = f(v, _mm256_permute2f128_ps::<1>(v, v));
        let v = f(v, _mm256_permute_ps::<0b0100_1110>(v));
        f(v, _mm256_permute_ps::<0b1011_0001>(v))
    }

    /// What [`dots_i8`] and [`dots_i8_wide`] read of a block and its query: the query's
    /// channel pairs and zero offsets (`[G][nb]` and `[G]`), the block's `nb` byte rows of
    /// `bs` tokens, its `bs` key scales (bytes) of which the first `len` are tokens, and each
    /// head's factor.
    #[derive(Clone, Copy)]
    struct Dots<'a> {
        pairs: &'a [u32],
        quads: &'a [u32],
        zero: &'a [i32],
        nb: usize,
        bs: usize,
        nib: &'a [u8],
        sc: &'a [u8],
        len: usize,
        temps: &'a [f32],
        /// The sketch [`SKETCH_AHEAD`] blocks on (empty: none), requested a line at a time
        /// as the rows are read.
        next: &'a [u8],
    }

    impl Dots<'_> {
        /// Panics unless `g` heads, `acc` (`[g][bs]`) and `top` fit, and `bs` is a multiple
        /// of `tokens` (the loop's step): what the loops' unchecked reads rely on.
        fn assert_fits(&self, g: usize, tokens: usize, acc: &[f32], top: &[__m256]) {
            let (nb, bs) = (self.nb, self.bs);
            assert!(
                self.pairs.len() >= g * nb
                    && self.zero.len() >= g
                    && self.nib.len() >= nb * bs
                    && self.sc.len() >= 4 * bs
                    && self.len <= bs
                    && self.temps.len() >= g
                    && top.len() >= g
                    && acc.len() >= g * bs
                    && bs.is_multiple_of(tokens)
            );
        }
    }

    /// Eight tokens of a block as the integer loops scale them: their first token, key scales
    /// and which lanes hold one.
    #[derive(Clone, Copy)]
    struct Tokens {
        first: usize,
        scales: __m256,
        keep: __m256,
    }

    /// How [`dots_i8`] and [`dots_i8_wide`] turn a head's integer sums into scores: times the
    /// head's factor and each token's key scale, lanes at or past the block's tokens -inf
    /// (their scales may be stale bytes).
    impl Dots<'_> {
        /// Tokens `first .. first + 8`, whose scales lie in the block's (`8 <= bs - first`).
        #[inline]
        #[target_feature(enable = "avx2")]
        fn tokens(&self, first: usize) -> Tokens {
            let valid = self.len.saturating_sub(first).min(8) as f32;
            let lane = _mm256_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0);
            Tokens {
                first,
                // SAFETY: 32 bytes, a slice checked in bounds.
                scales: unsafe {
                    _mm256_loadu_ps(self.sc[4 * first..4 * first + 32].as_ptr().cast())
                },
                keep: _mm256_cmp_ps::<_CMP_LT_OQ>(lane, _mm256_set1_ps(valid)),
            }
        }

        /// Head `h`'s sums of 16 tokens, the even ones in `even` and the odd in `odd` (each
        /// 128-bit lane 8 tokens: `lo`'s, then `hi`'s), as scores at their tokens in the
        /// head's row of `acc` (`[G][bs]`), raising `max`.
        #[inline]
        #[target_feature(enable = "avx2")]
        fn store(
            &self,
            h: usize,
            (even, odd): (__m256i, __m256i),
            (lo, hi): (Tokens, Tokens),
            acc: &mut [f32],
            max: &mut __m256,
        ) {
            // Lanes [0 1 2 3 | 8 9 10 11] and [4 5 6 7 | 12 13 14 15], then in order.
            let a = _mm256_unpacklo_epi32(even, odd);
            let b = _mm256_unpackhi_epi32(even, odd);
            let (t, neg) = (
                _mm256_set1_ps(self.temps[h]),
                _mm256_set1_ps(f32::NEG_INFINITY),
            );
            let score = |sums: __m256i, tok: Tokens| {
                let x = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(t, tok.scales));
                _mm256_blendv_ps(neg, x, tok.keep)
            };
            let l = score(_mm256_permute2x128_si256::<0x20>(a, b), lo);
            let r = score(_mm256_permute2x128_si256::<0x31>(a, b), hi);
            *max = _mm256_max_ps(l, _mm256_max_ps(r, *max));
            let row = &mut acc[h * self.bs..(h + 1) * self.bs];
            for (tok, x) in [(lo, l), (hi, r)] {
                // SAFETY: eight floats, a slice checked in bounds.
                unsafe { _mm256_storeu_ps(row[tok.first..tok.first + 8].as_mut_ptr(), x) };
            }
        }

        /// The AVX-512 loops' [`Dots::tokens`]: tokens `first .. first + 16` (`16 <= bs -
        /// first`), their scales and a mask of those in the block.
        #[inline]
        #[target_feature(enable = "avx512f,avx2")]
        fn tokens16(&self, first: usize) -> (usize, __m512, __mmask16) {
            let valid = self.len.saturating_sub(first).min(16);
            // SAFETY: 64 bytes, a slice checked in bounds.
            let scales =
                unsafe { _mm512_loadu_ps(self.sc[4 * first..4 * first + 64].as_ptr().cast()) };
            (first, scales, ((1u32 << valid) - 1) as __mmask16)
        }

        /// The AVX-512 loops' [`Dots::store`]: head `h`'s sums of sixteen tokens in order, as
        /// scores at their tokens, raising `max` in [`dots_i8`]'s order (the first eight
        /// tokens, then the next eight).
        #[inline]
        #[target_feature(enable = "avx512f,avx2")]
        fn store16(
            &self,
            h: usize,
            sums: __m512i,
            (first, scales, keep): (usize, __m512, __mmask16),
            acc: &mut [f32],
            max: &mut __m256,
        ) {
            let t = _mm512_set1_ps(self.temps[h]);
            let x = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(t, scales));
            let x = _mm512_mask_blend_ps(keep, _mm512_set1_ps(f32::NEG_INFINITY), x);
            let (l, r) = halves(x);
            *max = _mm256_max_ps(l, _mm256_max_ps(r, *max));
            let row = &mut acc[h * self.bs + first..h * self.bs + first + 16];
            // SAFETY: sixteen floats, a slice checked in bounds.
            unsafe { _mm512_storeu_ps(row.as_mut_ptr(), x) };
        }
    }

    /// `acc[h * bs + t] = temps[h] * scale_t * (sum_c q8_h[c] * nibble_t(c) - zero[h])` for
    /// `G` heads and the block's first `len` tokens (`-inf` past them), raising each head's
    /// running maximum `top[h]`, 16 tokens at a time. The sums are exact (in i32, then f32:
    /// below 2^24 for any head of fewer than 8,800 channels). A token's two nibbles of a byte
    /// row sit in the two bytes of its 16-bit lane, so `vpmaddubsw` against the head's channel
    /// pair sums both products (at most `2 * 15 * 127`) into that lane; eight rows fit in 16
    /// bits, then `vpmaddwd` against 1 and 0 widens the even and the odd tokens apart. The
    /// scaling rides on the sums while they are in registers (a pass of its own over `acc`
    /// cost a load and a store per vector, and the maxima went through memory).
    ///
    /// # Safety
    /// AVX2 (the sizes are asserted).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dots_i8<const G: usize>(
        blk: &Dots<'_>,
        acc: &mut [f32],
        top: &mut [__m256],
    ) -> usize {
        blk.assert_fits(G, 16, acc, top);
        let Dots {
            pairs,
            zero,
            nb,
            bs,
            nib,
            ..
        } = *blk;
        let mut maxima: [__m256; G] = std::array::from_fn(|h| top[h]);
        let nibbles = _mm256_set1_epi16(0x0f0f);
        let (even_of, odd_of) = (_mm256_set1_epi32(1), _mm256_set1_epi32(1 << 16));
        let (qp, np) = (pairs.as_ptr(), nib.as_ptr());
        // The block `SKETCH_AHEAD` on, a line at a time over the rows (see `SKETCH_AHEAD`).
        let mut pf = Prefetch::new(blk.next);
        pf.spread_over(bs / 16 * nb);
        for t0 in (0..bs).step_by(16) {
            // Tokens t0 + [0 2 .. 14] and t0 + [1 3 .. 15], each head's sum from -zero.
            let mut even: [__m256i; G] = std::array::from_fn(|h| _mm256_set1_epi32(-zero[h]));
            let mut odd = even;
            for j0 in (0..nb).step_by(8) {
                let mut sum = [_mm256_setzero_si256(); G];
                for j in j0..(j0 + 8).min(nb) {
                    pf.line();
                    // SAFETY: row j's columns t0 .. t0 + 16 lie in `nib` (asserted above).
                    let x = _mm256_cvtepu8_epi16(unsafe {
                        _mm_loadu_si128(np.add(j * bs + t0).cast())
                    });
                    // The byte is 0x00HL: (0x0HL0 | 0x00HL) & 0x0f0f is 0x0H0L, its low
                    // nibble in the low byte and its high one in the high byte.
                    let both =
                        _mm256_and_si256(_mm256_or_si256(x, _mm256_slli_epi16::<4>(x)), nibbles);
                    for (h, s) in sum.iter_mut().enumerate() {
                        // SAFETY: head h's pair j, inside `pairs`.
                        let q = _mm256_set1_epi32(unsafe { *qp.add(h * nb + j) } as i32);
                        *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(both, q));
                    }
                }
                for h in 0..G {
                    even[h] = _mm256_add_epi32(even[h], _mm256_madd_epi16(sum[h], even_of));
                    odd[h] = _mm256_add_epi32(odd[h], _mm256_madd_epi16(sum[h], odd_of));
                }
            }
            let halves = (blk.tokens(t0), blk.tokens(t0 + 8));
            for h in 0..G {
                blk.store(h, (even[h], odd[h]), halves, acc, &mut maxima[h]);
            }
        }
        top[..G].copy_from_slice(&maxima);
        pf.requested()
    }

    /// [`dots_i8`] for blocks of a multiple of 32 tokens and at most [`WIDE_HEADS`] heads: a
    /// byte row is read 32 tokens at a time and split into its tokens' nibble pairs once (5
    /// ops, where two 16-token reads take 8), and each head's channel pair is broadcast once
    /// for both halves. `vpunpck{l,h}bw` pair a token's nibbles within each 128-bit lane, so
    /// the halves hold tokens `[0, 8) | [16, 24)` and `[8, 16) | [24, 32)`; they are stored in
    /// place. The same integer sums and float products as [`dots_i8`], so the same bits.
    ///
    /// # Safety
    /// AVX2 (the sizes are asserted).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dots_i8_wide<const G: usize>(
        blk: &Dots<'_>,
        acc: &mut [f32],
        top: &mut [__m256],
    ) -> usize {
        assert!(G <= WIDE_HEADS);
        blk.assert_fits(G, 32, acc, top);
        let Dots {
            pairs,
            zero,
            nb,
            bs,
            nib,
            ..
        } = *blk;
        let mut maxima: [__m256; G] = std::array::from_fn(|h| top[h]);
        let low = _mm256_set1_epi8(0x0f);
        let (even_of, odd_of) = (_mm256_set1_epi32(1), _mm256_set1_epi32(1 << 16));
        let (qp, np) = (pairs.as_ptr(), nib.as_ptr());
        // The block `SKETCH_AHEAD` on, a line at a time over the rows (see `SKETCH_AHEAD`).
        let mut pf = Prefetch::new(blk.next);
        pf.spread_over(bs / 32 * nb);
        for t0 in (0..bs).step_by(32) {
            // [head][half]: the even and the odd tokens of each half, each head's sum from
            // -zero.
            let mut even: [[__m256i; 2]; G] =
                std::array::from_fn(|h| [_mm256_set1_epi32(-zero[h]); 2]);
            let mut odd = even;
            for j0 in (0..nb).step_by(8) {
                let mut sum = [[_mm256_setzero_si256(); 2]; G];
                for j in j0..(j0 + 8).min(nb) {
                    pf.line();
                    // SAFETY: row j's columns t0 .. t0 + 32 lie in `nib` (asserted above).
                    let x = unsafe { _mm256_loadu_si256(np.add(j * bs + t0).cast()) };
                    // Each byte is 0xHL: L in one vector's bytes, H in the other's, then a
                    // token's L and H side by side in its 16-bit lane.
                    let l = _mm256_and_si256(x, low);
                    let h = _mm256_and_si256(_mm256_srli_epi16::<4>(x), low);
                    let both = [_mm256_unpacklo_epi8(l, h), _mm256_unpackhi_epi8(l, h)];
                    for (hd, s) in sum.iter_mut().enumerate() {
                        // SAFETY: head hd's pair j, inside `pairs`.
                        let q = _mm256_set1_epi32(unsafe { *qp.add(hd * nb + j) } as i32);
                        for (s, b) in s.iter_mut().zip(both) {
                            *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(b, q));
                        }
                    }
                }
                for h in 0..G {
                    for k in 0..2 {
                        even[h][k] =
                            _mm256_add_epi32(even[h][k], _mm256_madd_epi16(sum[h][k], even_of));
                        odd[h][k] =
                            _mm256_add_epi32(odd[h][k], _mm256_madd_epi16(sum[h][k], odd_of));
                    }
                }
            }
            for k in 0..2 {
                // Half k: tokens t0 + 8k .. + 8 in the low lanes, t0 + 16 + 8k .. + 8 in the
                // high ones.
                let halves = (blk.tokens(t0 + 8 * k), blk.tokens(t0 + 16 + 8 * k));
                for h in 0..G {
                    blk.store(h, (even[h][k], odd[h][k]), halves, acc, &mut maxima[h]);
                }
            }
        }
        top[..G].copy_from_slice(&maxima);
        pf.requested()
    }

    /// `$body` with `$G` the constant head count `$g` is, 1..=8 (8 for any above).
    macro_rules! with_heads {
        ($g:expr, $G:ident => $body:expr) => {
            match $g {
                1 => {
                    const $G: usize = 1;
                    $body
                }
                2 => {
                    const $G: usize = 2;
                    $body
                }
                3 => {
                    const $G: usize = 3;
                    $body
                }
                4 => {
                    const $G: usize = 4;
                    $body
                }
                5 => {
                    const $G: usize = 5;
                    $body
                }
                6 => {
                    const $G: usize = 6;
                    $body
                }
                7 => {
                    const $G: usize = 7;
                    $body
                }
                _ => {
                    const $G: usize = 8;
                    $body
                }
            }
        };
    }

    /// Whether [`dots_i8_vnni`] can run here (AVX-512 VNNI and VBMI, beside the F and BW
    /// that the caller's `avx512` says). Read once.
    fn vnni() -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vbmi")
        })
    }

    /// [`dots_i8_vnni`] for `g` heads (1..=8).
    ///
    /// # Safety
    /// As [`dots_i8_vnni`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,avx2")]
    unsafe fn dots_i8_vnni_dyn(
        g: usize,
        blk: &Dots<'_>,
        acc: &mut [f32],
        top: &mut [__m256],
    ) -> usize {
        // SAFETY: forwarded.
        unsafe { with_heads!(g, G => dots_i8_vnni::<G>(blk, acc, top)) }
    }

    /// [`dots_i8_512`] with VNNI: two byte rows (four channels) a pass, each token's four
    /// nibbles gathered into its 32-bit lane by two `vpermt2b` (tokens in order, 16 a
    /// register), so one `vpdpbusd` a head sums four products per token straight into 32
    /// bits, where `vpmaddubsw` summed two into 16 and every eighth row widened them. The
    /// same integer sums (exact either way), float products and order of maxima as
    /// [`dots_i8`], so the same bits.
    ///
    /// Its cost grows with the group (two `vpdpbusd` a head per quad). Tried and not kept:
    /// the same lanes stored as rows of B tiles and summed by AMX-INT8 (`TDPBSUD`, the int8
    /// query an A tile in place, two products per 64 channels for every head at once; the
    /// same bits). Xeon VM, `bench select --scorers sketch --context 32768 --threads 1`, D=128,
    /// ns a token and KV head, this loop against the tiles: with the sketch in L3
    /// (`--layers 1`) G=1 3.8 / 6.1, G=3 5.3 / 6.9, G=5 7.4 / 8.2, G=8 10.6 / 9.8; from DRAM
    /// G=3 7.4 / 9.1, G=5 9.2 / 10.2, G=8 12.1 / 11.7. The tiles cost ~2.3 a token whatever
    /// the group (a block's staging stores, then its tile loads, products and stores in a
    /// row), where each head costs this loop ~0.9.
    ///
    /// # Safety
    /// AVX-512 F, BW, VNNI and VBMI (the sizes are asserted).
    // Indexed loops over constant bounds keep the sums in registers.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,avx2")]
    unsafe fn dots_i8_vnni<const G: usize>(
        blk: &Dots<'_>,
        acc: &mut [f32],
        top: &mut [__m256],
    ) -> usize {
        blk.assert_fits(G, 32, acc, top);
        let nq = blk.nb.div_ceil(2);
        assert!(blk.quads.len() >= G * nq);
        let Dots {
            quads,
            zero,
            nb,
            bs,
            nib,
            ..
        } = *blk;
        let mut maxima: [__m256; G] = std::array::from_fn(|h| top[h]);
        let low = _mm512_set1_epi8(0x0f);
        // Token `first + t`'s lane, from `l` (its low nibbles: row 2m in bytes 0..32, row
        // 2m + 1 in 32..64) and `h` (the high ones, indices 64..128): channels 4m .. 4m + 4.
        let gather = |first: usize| {
            let mut idx = [0u8; 64];
            for (t, lane) in idx.chunks_exact_mut(4).enumerate() {
                let at = (first + t) as u8;
                lane.copy_from_slice(&[at, 64 + at, 32 + at, 96 + at]);
            }
            // SAFETY: 64 bytes.
            unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
        };
        let order = [gather(0), gather(16)];
        let (qp, np) = (quads.as_ptr(), nib.as_ptr());
        // The block `SKETCH_AHEAD` on, a line at a time over the rows (see `SKETCH_AHEAD`).
        let mut pf = Prefetch::new(blk.next);
        pf.spread_over(bs / 32 * nq);
        for t0 in (0..bs).step_by(32) {
            let mut sums: [[__m512i; 2]; G] =
                std::array::from_fn(|h| [_mm512_set1_epi32(-zero[h]); 2]);
            for m in 0..nq {
                pf.line();
                // An odd last row pairs with itself: the quad's upper channels are 0.
                let (r0, r1) = (2 * m, (2 * m + 1).min(nb - 1));
                // SAFETY: rows r0, r1 < nb: columns t0 .. t0 + 32 lie in `nib` (asserted);
                // with blocks of 32, row r0 + 1 = r1 follows row r0.
                let x = unsafe {
                    if bs == 32 && r1 == r0 + 1 {
                        _mm512_loadu_si512(np.add(r0 * bs).cast())
                    } else {
                        _mm512_inserti64x4::<1>(
                            _mm512_castsi256_si512(_mm256_loadu_si256(np.add(r0 * bs + t0).cast())),
                            _mm256_loadu_si256(np.add(r1 * bs + t0).cast()),
                        )
                    }
                };
                let l = _mm512_and_si512(x, low);
                let h = _mm512_and_si512(_mm512_srli_epi16::<4>(x), low);
                let lanes = order.map(|o| _mm512_permutex2var_epi8(l, o, h));
                for (hd, s) in sums.iter_mut().enumerate() {
                    // SAFETY: head hd's quad m, inside `quads` (asserted).
                    let q = _mm512_set1_epi32(unsafe { *qp.add(hd * nq + m) } as i32);
                    for (s, v) in s.iter_mut().zip(lanes) {
                        *s = _mm512_dpbusd_epi32(*s, v, q);
                    }
                }
            }
            for k in 0..2 {
                let tokens = blk.tokens16(t0 + 16 * k);
                for h in 0..G {
                    blk.store16(h, sums[h][k], tokens, acc, &mut maxima[h]);
                }
            }
        }
        top[..G].copy_from_slice(&maxima);
        pf.requested()
    }

    /// [`dots_i8_512`] for `g` heads (1..=8).
    ///
    /// # Safety
    /// As [`dots_i8_512`].
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    unsafe fn dots_i8_512_dyn(
        g: usize,
        blk: &Dots<'_>,
        acc: &mut [f32],
        top: &mut [__m256],
    ) -> usize {
        // SAFETY: forwarded.
        unsafe { with_heads!(g, G => dots_i8_512::<G>(blk, acc, top)) }
    }

    /// [`dots_i8`] on AVX-512 (F, BW) for blocks of a multiple of 32 tokens: a byte row's 32
    /// tokens widen into one register of 16-bit lanes, each token's two nibbles in its two
    /// bytes (as [`dots_i8`] makes them), so one `vpmaddubsw` a head and row takes 32 tokens
    /// where AVX2 takes two. The even and the odd tokens widen apart as there and two
    /// permutes put them back in order. The same integer sums, float products and order of
    /// maxima as [`dots_i8`], so the same bits.
    ///
    /// # Safety
    /// AVX-512 F and BW (the sizes are asserted).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    unsafe fn dots_i8_512<const G: usize>(
        blk: &Dots<'_>,
        acc: &mut [f32],
        top: &mut [__m256],
    ) -> usize {
        blk.assert_fits(G, 32, acc, top);
        let Dots {
            pairs,
            zero,
            nb,
            bs,
            nib,
            ..
        } = *blk;
        let mut maxima: [__m256; G] = std::array::from_fn(|h| top[h]);
        let nibbles = _mm512_set1_epi16(0x0f0f);
        let (even_of, odd_of) = (_mm512_set1_epi32(1), _mm512_set1_epi32(1 << 16));
        // Tokens 0..16 and 16..32 from the even (lanes 0..16 of the first operand: tokens
        // 0, 2, .., 30) and the odd (16..32: tokens 1, 3, .., 31).
        let first_half = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        let second_half =
            _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        let (qp, np) = (pairs.as_ptr(), nib.as_ptr());
        // The block `SKETCH_AHEAD` on, a line at a time over the rows (see `SKETCH_AHEAD`).
        let mut pf = Prefetch::new(blk.next);
        pf.spread_over(bs / 32 * nb);
        for t0 in (0..bs).step_by(32) {
            let mut even: [__m512i; G] = std::array::from_fn(|h| _mm512_set1_epi32(-zero[h]));
            let mut odd = even;
            for j0 in (0..nb).step_by(8) {
                let mut sum = [_mm512_setzero_si512(); G];
                for j in j0..(j0 + 8).min(nb) {
                    pf.line();
                    // SAFETY: row j's columns t0 .. t0 + 32 lie in `nib` (asserted above).
                    let x = _mm512_cvtepu8_epi16(unsafe {
                        _mm256_loadu_si256(np.add(j * bs + t0).cast())
                    });
                    // As in `dots_i8`: 0x00HL becomes 0x0H0L.
                    let both =
                        _mm512_and_si512(_mm512_or_si512(x, _mm512_slli_epi16::<4>(x)), nibbles);
                    for (h, s) in sum.iter_mut().enumerate() {
                        // SAFETY: head h's pair j, inside `pairs`.
                        let q = _mm512_set1_epi32(unsafe { *qp.add(h * nb + j) } as i32);
                        *s = _mm512_add_epi16(*s, _mm512_maddubs_epi16(both, q));
                    }
                }
                for h in 0..G {
                    even[h] = _mm512_add_epi32(even[h], _mm512_madd_epi16(sum[h], even_of));
                    odd[h] = _mm512_add_epi32(odd[h], _mm512_madd_epi16(sum[h], odd_of));
                }
            }
            for (k, idx) in [first_half, second_half].into_iter().enumerate() {
                let tokens = blk.tokens16(t0 + 16 * k);
                for h in 0..G {
                    let sums = _mm512_permutex2var_epi32(even[h], idx, odd[h]);
                    blk.store16(h, sums, tokens, acc, &mut maxima[h]);
                }
            }
        }
        top[..G].copy_from_slice(&maxima);
        pf.requested()
    }

    /// `acc[h * bs + t] = bias[h] + sum_c q_h[c] * nibble_t(c)` for `G` heads and every
    /// token of the block, `8 V` tokens at a time, in `S` sums per head and token vector.
    ///
    /// # Safety
    /// As [`block_lse`] (the sizes are asserted).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dots<const G: usize, const V: usize, const S: usize>(
        q: &[f32],
        d: usize,
        bs: usize,
        nib: &[u8],
        bias: &[f32],
        acc: &mut [f32],
    ) {
        let nb = d.div_ceil(2);
        assert!(
            q.len() >= G * d
                && nib.len() >= nb * bs
                && acc.len() >= G * bs
                && bs.is_multiple_of(8 * V)
        );
        let low = _mm256_set1_epi32(0x0f);
        let (qp, np) = (q.as_ptr(), nib.as_ptr());
        for t0 in (0..bs).step_by(8 * V) {
            let mut sum = [[[_mm256_setzero_ps(); V]; G]; S];
            for (h, s) in sum[0].iter_mut().enumerate() {
                *s = [_mm256_set1_ps(bias[h]); V];
            }
            for j in 0..nb {
                // SAFETY: row j's columns t0 .. t0 + 8 V lie in `nib` (asserted above).
                let row = unsafe { np.add(j * bs + t0) };
                // Each token's byte in a lane: channel 2j is its low nibble, 2j + 1 its
                // high one (none past an odd d).
                // SAFETY: 8 bytes of the row from column t0 + 8 i, inside the block.
                let b: [__m256i; V] = std::array::from_fn(|i| unsafe {
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(row.add(8 * i).cast()))
                });
                let lo = b.map(|x| _mm256_cvtepi32_ps(_mm256_and_si256(x, low)));
                for (h, s) in sum[0].iter_mut().enumerate() {
                    // SAFETY: channel 2j of head h, inside `q`.
                    let qc = _mm256_set1_ps(unsafe { *qp.add(h * d + 2 * j) });
                    for (s, &k) in s.iter_mut().zip(&lo) {
                        *s = _mm256_fmadd_ps(k, qc, *s);
                    }
                }
                if 2 * j + 1 < d {
                    let hi = b.map(|x| _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(x)));
                    for (h, s) in sum[S - 1].iter_mut().enumerate() {
                        // SAFETY: channel 2j + 1 of head h, inside `q`.
                        let qc = _mm256_set1_ps(unsafe { *qp.add(h * d + 2 * j + 1) });
                        for (s, &k) in s.iter_mut().zip(&hi) {
                            *s = _mm256_fmadd_ps(k, qc, *s);
                        }
                    }
                }
            }
            let (even, odd) = (&sum[0], &sum[S - 1]);
            for (h, (e, o)) in even.iter().zip(odd).enumerate() {
                for (i, (&e, &o)) in e.iter().zip(o).enumerate() {
                    let s = if S == 2 { _mm256_add_ps(e, o) } else { e };
                    let at = h * bs + t0 + 8 * i;
                    // SAFETY: 8 floats of head h's row of `acc`, inside it.
                    unsafe { _mm256_storeu_ps(acc[at..at + 8].as_mut_ptr(), s) };
                }
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::sketch::tests::lcg;

        /// A chunk's block LSEs on AVX-512 (rows and exponentials) are the AVX2 path's bit
        /// for bit: every head count, blocks of 32 and 64, full, partial and empty blocks.
        #[test]
        fn avx512_chunks_score_as_avx2_ones_bit_for_bit() {
            if !super::super::avx2::available() || !crate::kernel_avx512::available() {
                return;
            }
            let mut seed = 7;
            for (d, bs) in [(64, 32), (128, 64)] {
                let nb = crate::sketch::nibble_bytes(d);
                let lens = [bs, 1, 0, 17, bs, 31];
                let bytes: Vec<Vec<u8>> = lens
                    .iter()
                    .map(|_| {
                        let mut b: Vec<u8> = (0..bs)
                            .flat_map(|_| (0.05 + lcg(&mut seed).abs()).to_ne_bytes())
                            .collect();
                        b.extend((0..nb * bs).map(|_| (lcg(&mut seed) * 1e4) as u8));
                        b
                    })
                    .collect();
                let blocks: Vec<(&[u8], usize)> = bytes
                    .iter()
                    .zip(lens)
                    .map(|(b, len)| {
                        if len == 0 {
                            (&[][..], 0)
                        } else {
                            (&b[..], len)
                        }
                    })
                    .collect();
                for g in 1..=8 {
                    let q: Vec<f32> = (0..g * d).map(|_| 4.0 * lcg(&mut seed)).collect();
                    let qi = super::super::QueryI8::new(&q, d).unwrap();
                    let run = |avx512: bool| {
                        let (mut x, mut out) = (Vec::new(), vec![0f32; blocks.len() * g]);
                        // SAFETY: AVX2 and AVX-512 are present; whole blocks or empty ones.
                        unsafe { chunk_lse_i8(&qi, d, bs, 0.3, &blocks, &mut x, &mut out, avx512) };
                        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    };
                    let avx2 = run(false);
                    assert_eq!(avx2, run(true), "d {d} block {bs} G {g}");
                    assert!(
                        avx2.iter().any(|&b| f32::from_bits(b).is_finite()),
                        "d {d} block {bs} G {g}: some finite LSE"
                    );
                }
            }
        }

        /// The 32-token rows, and the AVX-512 ones where this CPU has them, give
        /// [`dots_i8`]'s scores and maxima bit for bit: every head count they take, blocks of
        /// 32 and 64, full and partial, an odd head_dim (a short last group of rows), and
        /// every nibble value. Each requests every line of the block after.
        #[test]
        fn wide_rows_score_as_narrow_ones_bit_for_bit() {
            if !super::super::avx2::available() {
                return;
            }
            // The AVX-512 rows where this CPU has them.
            let avx512 = crate::kernel_avx512::available();
            let mut seed = 31;
            for (d, bs) in [(64, 32), (65, 32), (128, 64)] {
                let nb = crate::sketch::nibble_bytes(d);
                for g in 1..=8 {
                    let q: Vec<f32> = (0..g * d).map(|_| 4.0 * lcg(&mut seed)).collect();
                    let qi = super::super::QueryI8::new(&q, d).unwrap();
                    let nib: Vec<u8> = (0..nb * bs)
                        .map(|i| {
                            if i < 256 {
                                i as u8
                            } else {
                                (lcg(&mut seed) * 1e4) as u8
                            }
                        })
                        .collect();
                    let sc: Vec<u8> = (0..bs)
                        .flat_map(|_| (0.05 + lcg(&mut seed).abs()).to_ne_bytes())
                        .collect();
                    let temps: Vec<f32> = (0..g).map(|h| 0.1 * qi.step[h]).collect();
                    // The sketch of the block after: every line of it is requested.
                    let next = vec![0u8; bs * (nb + 4)];
                    for len in [1, 7, 17, 31, bs] {
                        // 0: `dots_i8`; 1: `dots_i8_wide`; 2: `dots_i8_512`.
                        let run = |path: usize| {
                            let mut acc = vec![0f32; g * bs];
                            // SAFETY: AVX2 is present.
                            let mut top = unsafe { [_mm256_set1_ps(-1e3); 8] };
                            let dots = Dots {
                                pairs: &qi.pairs,
                                quads: &qi.quads,
                                zero: &qi.zero,
                                nb,
                                bs,
                                nib: &nib,
                                sc: &sc,
                                len,
                                temps: &temps,
                                next: &next,
                            };
                            let (acc, top) = (&mut acc, &mut top);
                            // SAFETY: AVX2 is present, AVX-512 F and BW for path 2, and
                            // VNNI and VBMI for path 3; the loops assert the sizes.
                            let requested = unsafe {
                                match (g, path) {
                                    (_, 2) => dots_i8_512_dyn(g, &dots, acc, top),
                                    (_, 3) => dots_i8_vnni_dyn(g, &dots, acc, top),
                                    (1, 1) => dots_i8_wide::<1>(&dots, acc, top),
                                    (2, 1) => dots_i8_wide::<2>(&dots, acc, top),
                                    (3, 1) => dots_i8_wide::<3>(&dots, acc, top),
                                    (_, 1) => dots_i8_wide::<4>(&dots, acc, top),
                                    (1, _) => dots_i8::<1>(&dots, acc, top),
                                    (2, _) => dots_i8::<2>(&dots, acc, top),
                                    (3, _) => dots_i8::<3>(&dots, acc, top),
                                    (4, _) => dots_i8::<4>(&dots, acc, top),
                                    (5, _) => dots_i8::<5>(&dots, acc, top),
                                    (6, _) => dots_i8::<6>(&dots, acc, top),
                                    (7, _) => dots_i8::<7>(&dots, acc, top),
                                    _ => dots_i8::<8>(&dots, acc, top),
                                }
                            };
                            let mut tops = [0f32; 64];
                            for (h, t) in top.iter().enumerate() {
                                // SAFETY: eight floats.
                                unsafe { _mm256_storeu_ps(tops[8 * h..].as_mut_ptr(), *t) };
                            }
                            let bits =
                                |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            (
                                bits(acc),
                                tops[..8 * g].iter().fold(f32::MIN, |m, &x| m.max(x)),
                                requested,
                            )
                        };
                        let narrow = run(0);
                        let case = format!("d {d} block {bs} G {g} len {len}");
                        assert!(narrow.1 > -1e3, "{case}: the scores raised the maximum");
                        assert_eq!(narrow.2, next.len(), "{case}: the next block requested");
                        let others = [
                            (g <= WIDE_HEADS, 1, "wide"),
                            (avx512, 2, "AVX-512"),
                            (avx512 && vnni(), 3, "VNNI"),
                        ];
                        for (_, path, name) in others.into_iter().filter(|o| o.0) {
                            let other = run(path);
                            assert_eq!(narrow.0, other.0, "{case}, {name}: scores");
                            assert_eq!(
                                narrow.1.to_bits(),
                                other.1.to_bits(),
                                "{case}, {name}: maximum"
                            );
                            assert_eq!(other.2, next.len(), "{case}, {name}: next block");
                        }
                    }
                }
            }
        }
    }
}

/// The query [`HeadSketch::block_scores`] scores with (each head of `q`, `d` channels): `q`
/// itself on the float paths, its int8 rounding where the integer path runs (this CPU, block
/// size `bs`).
#[cfg(test)]
pub(crate) fn query_scored(q: &[f32], d: usize, bs: usize) -> Vec<f32> {
    let Some(qi) = QueryI8::for_blocks(q, d, bs) else {
        return q.to_vec();
    };
    let nb = nibble_bytes(d);
    let mut out = Vec::with_capacity(q.len());
    for (pairs, &step) in qi.pairs.chunks(nb).zip(&qi.step) {
        let q8 = pairs
            .iter()
            .flat_map(|&p| [p as u8 as i8, (p >> 8) as u8 as i8]);
        out.extend(q8.take(d).map(|x| step * f32::from(x)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::KvDType;
    use crate::sketch::tests::lcg;
    use crate::sparq::tests::{Keys, keys};

    fn pages(n: usize, bytes: usize) -> Vec<Box<dyn SketchPage>> {
        (0..n)
            .map(|_| Box::new(vec![0u8; bytes]) as Box<dyn SketchPage>)
            .collect()
    }

    /// A kept sketch of `n` random keys of `geom` and a random group query of `g` heads.
    fn sketched(
        geom: &BlockGeometry,
        g: usize,
        n: usize,
        seed: &mut u64,
    ) -> (Keys, HeadSketch, Vec<f32>) {
        let (bs, d) = (geom.block_size, geom.head_dim);
        let k: Vec<Vec<f32>> = (0..n)
            .map(|_| (0..d).map(|_| 3.0 * lcg(seed)).collect())
            .collect();
        let src = keys(*geom, &k);
        // Pages of 5 blocks, so the sketch spans pages.
        let page_bytes = 5 * bs * (nibble_bytes(d) + 4) + 3;
        let tpp = tokens_per_page(page_bytes, d, bs);
        assert_eq!(tpp, 5 * bs);
        let mut hs = HeadSketch::new(pages(pages_for(n, tpp), page_bytes), tpp);
        // In pieces, as blocks fill: a prompt, then a block at a time.
        assert!(hs.catch_up(geom, &src, 0, 0, bs * 9));
        assert!(hs.catch_up(geom, &src, 0, 0, bs * 10));
        assert!(!hs.catch_up(geom, &src, 0, 0, n + 1), "past the KV");
        assert!(hs.catch_up(geom, &src, 0, 0, n));
        assert_eq!(hs.tokens(), n);
        let q: Vec<f32> = (0..g * d).map(|_| 2.0 * lcg(seed)).collect();
        (src, hs, q)
    }

    #[test]
    fn kept_scores_equal_the_definition_read_from_the_pool() {
        // Block 8 takes the float path; 16 and up the integer one where the CPU has AVX2 (32
        // and 64 with up to four heads its 32-token rows), which must then equal the
        // definition for the query rounded as it rounds it.
        let mut seed = 9;
        for (d, g, dtype, bs) in [
            (64, 3, KvDType::Bf16, 16),
            (64, 3, KvDType::Bf16, 32),
            (128, 5, KvDType::F16, 32),
            (128, 11, KvDType::I8, 16),
            (48, 2, KvDType::F32, 8),
            (66, 4, KvDType::Bf16, 8),
            (66, 8, KvDType::Bf16, 32),
            (66, 2, KvDType::F16, 64),
            (63, 7, KvDType::F16, 16),
        ] {
            let geom = BlockGeometry {
                block_size: bs,
                num_kv_heads: 1,
                head_dim: d,
                dtype,
            };
            let n = bs * 23 + 7;
            let (src, hs, q) = sketched(&geom, g, n, &mut seed);
            let scored = query_scored(&q, d, bs);
            let blocks: Vec<usize> = (0..n.div_ceil(bs)).collect();
            for how in [GroupScore::Max, GroupScore::Sum] {
                let want =
                    crate::sketch::block_scores(&geom, &src, 0, 0, &scored, 0.1, how, &blocks);
                let got = hs.block_scores(&geom, &q, 0.1, how, &blocks);
                for (b, (w, x)) in want.iter().zip(&got).enumerate() {
                    assert!(
                        (w - x).abs() <= 1e-5 * (1.0 + w.abs()),
                        "d {d} G {g} {dtype:?} block size {bs} block {b}: {w} vs {x}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_host_and_a_device_round_the_query_alike() {
        // Where this CPU takes the integer path, it scores the query a device's integer
        // `sketch_lse` scores: `sketch::query_as_rounded`, whatever the CPU.
        let mut seed = 12;
        let q: Vec<f32> = (0..5 * 64).map(|_| 3.0 * lcg(&mut seed)).collect();
        if QueryI8::for_blocks(&q, 64, 32).is_some() {
            assert_eq!(
                query_scored(&q, 64, 32),
                crate::sketch::query_as_rounded(&q, 64)
            );
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_log2_is_libms_for_every_exponent() {
        if !avx2::available() {
            return;
        }
        let mut seed = 3;
        let mut xs: Vec<f32> = vec![0.0, f32::MIN_POSITIVE, 0.5f32.sqrt(), 1.0, 2.0, 31.99, 1e30];
        xs.extend(
            (0..200).map(|_| 2f32.powf(60.0 * lcg(&mut seed)) * (1.0 + lcg(&mut seed).abs())),
        );
        for x8 in xs.chunks(8) {
            let mut v = [1f32; 8];
            v[..x8.len()].copy_from_slice(x8);
            let mut got = [0f32; 8];
            // SAFETY: AVX2 and FMA are present; eight floats in and out.
            unsafe {
                use std::arch::x86_64::*;
                _mm256_storeu_ps(got.as_mut_ptr(), avx2::log2_ps(_mm256_loadu_ps(v.as_ptr())));
            }
            for (x, g) in v.iter().zip(got) {
                let want = x.log2();
                assert!(
                    g == want || (g - want).abs() <= 2e-7 * want.abs().max(1.0),
                    "log2 {x}: {g} vs {want}"
                );
            }
        }
    }

    #[test]
    fn blocks_past_the_sketch_score_nothing_and_change_no_other_score() {
        // The integer path takes a task's blocks together: an empty one among them (past
        // the tokens) must neither read a page nor move the others' shares.
        let mut seed = 5;
        for (bs, g) in [(32, 3), (16, 9)] {
            let geom = BlockGeometry {
                block_size: bs,
                num_kv_heads: 1,
                head_dim: 64,
                dtype: KvDType::Bf16,
            };
            // Past `PARALLEL_SKETCH_BLOCKS`: the blocks go in tasks, which the empty one
            // shifts.
            let blocks = PARALLEL_SKETCH_BLOCKS + 44;
            let (_, hs, q) = sketched(&geom, g, bs * blocks, &mut seed);
            let inside: Vec<usize> = (0..blocks).collect();
            let mut mixed = inside.clone();
            mixed.insert(7, blocks);
            mixed.push(10_000);
            for how in [GroupScore::Max, GroupScore::Sum] {
                let want = hs.block_scores(&geom, &q, 0.1, how, &inside);
                let got = hs.block_scores(&geom, &q, 0.1, how, &mixed);
                assert_eq!((got[7], got[blocks + 1]), (0.0, 0.0), "bs {bs} G {g}");
                let rest: Vec<f32> = got
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != 7 && *i != blocks + 1)
                    .map(|(_, s)| *s)
                    .collect();
                for (w, x) in want.iter().zip(&rest) {
                    assert!(
                        (w - x).abs() <= 1e-6 * (1.0 + w.abs()),
                        "bs {bs} G {g}: {w} vs {x}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_int8_query_moves_a_block_score_within_its_bound() {
        // Against the definition with the query itself: each token's score moves by at most
        // temp * key scale * step / 2 * (8 a channel), so each head's log2-sum-exp2 by the
        // largest of those, and a share (2^(lse - total)) by twice that in log2.
        let mut seed = 21;
        for (d, g, bs) in [(64, 3, 32), (128, 5, 16), (65, 8, 32)] {
            let geom = BlockGeometry {
                block_size: bs,
                num_kv_heads: 1,
                head_dim: d,
                dtype: KvDType::Bf16,
            };
            let n = bs * 40;
            let (src, hs, mut q) = sketched(&geom, g, n, &mut seed);
            // One channel far larger than the rest: the coarsest step a head can get.
            q[5] = 40.0;
            let Some(qi) = QueryI8::for_blocks(&q, d, bs) else {
                return; // no integer path on this CPU
            };
            let scale = 0.125f32;
            let temp = scale * std::f32::consts::LOG2_E;
            let (mut rows, mut key_scales) = (vec![0u8; n * nibble_bytes(d)], vec![0f32; n]);
            crate::sketch::sketch_tokens(&geom, &src, 0, 0, 0, n, &mut rows, &mut key_scales);
            let top_scale = key_scales.iter().fold(0f32, |m, &s| m.max(s));
            let step = qi.step.iter().fold(0f32, |m, &s| m.max(s));
            let bound = temp * top_scale * step / 2.0 * 8.0 * d as f32;
            assert!(bound > 1e-3, "the test must let the rounding show: {bound}");
            let blocks: Vec<usize> = (0..n / bs).collect();
            for how in [GroupScore::Max, GroupScore::Sum] {
                let want = crate::sketch::block_scores(&geom, &src, 0, 0, &q, scale, how, &blocks);
                let got = hs.block_scores(&geom, &q, scale, how, &blocks);
                let mut moved = 0f32;
                for (w, x) in want.iter().zip(&got) {
                    let rel = (x / w).log2().abs();
                    moved = moved.max(rel);
                    assert!(
                        rel <= 2.0 * bound + 1e-4,
                        "d {d} G {g}: {w} vs {x}, bound {bound}"
                    );
                }
                assert!(moved > 0.0, "the integer path ran, so something moved");
            }
        }
    }

    #[test]
    fn the_kept_sketch_is_the_definitions_bit_for_bit() {
        // Every stored type, broken keys included (NaN, infinite, zero), in pieces that end
        // inside blocks (runs of eight tokens and the rest), an odd head_dim too.
        let mut seed = 4;
        for (dtype, bs, d) in [
            (KvDType::F32, 16, 66),
            (KvDType::Bf16, 16, 66),
            (KvDType::F16, 16, 66),
            (KvDType::I8, 16, 66),
            (KvDType::F8E4M3, 16, 66),
            (KvDType::Bf16, 32, 65),
            (KvDType::I8, 32, 65),
        ] {
            let geom = BlockGeometry {
                block_size: bs,
                num_kv_heads: 2,
                head_dim: d,
                dtype,
            };
            let n = bs * 7 + 3;
            let k: Vec<Vec<f32>> = (0..n)
                .map(|t| {
                    (0..2 * d)
                        .map(|c| match (t % 17, c % 29) {
                            (3, 5) => f32::NAN,
                            (5, 7) => f32::INFINITY,
                            (7, _) => 0.0,
                            _ => 4.0 * lcg(&mut seed),
                        })
                        .collect()
                })
                .collect();
            let src = keys(geom, &k);
            let nb = nibble_bytes(d);
            let tpp = 3 * bs;
            let mut hs = HeadSketch::new(pages(3, tpp * (nb + 4)), tpp);
            for to in [5, 21, 50, n] {
                assert!(hs.catch_up(&geom, &src, 0, 1, to));
            }
            let (mut rows, mut scales) = (vec![0u8; n * nb], vec![0f32; n]);
            crate::sketch::sketch_tokens(&geom, &src, 0, 1, 0, n, &mut rows, &mut scales);
            for t in 0..n {
                let page = hs.pages[t / tpp].bytes();
                let block = &page[(t % tpp) / bs * block_stride(bs, d)..];
                let c = t % bs;
                let s = f32::from_ne_bytes(block[c * 4..c * 4 + 4].try_into().unwrap());
                assert_eq!(s.to_bits(), scales[t].to_bits(), "{dtype:?} token {t}");
                for j in 0..nb {
                    assert_eq!(
                        block[bs * 4 + j * bs + c],
                        rows[t * nb + j],
                        "{dtype:?} token {t} byte {j}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_sketch_never_writes_past_its_pages() {
        let geom = BlockGeometry {
            block_size: 16,
            num_kv_heads: 1,
            head_dim: 64,
            dtype: KvDType::Bf16,
        };
        let k = vec![vec![1.0f32; 64]; 100];
        let src = keys(geom, &k);
        let tpp = tokens_per_page(16 * 36, 64, 16);
        assert_eq!(tpp, 16);
        let mut hs = HeadSketch::new(pages(2, 16 * 36), tpp);
        assert_eq!(hs.capacity(), 32);
        assert!(!hs.catch_up(&geom, &src, 0, 0, 48));
        assert_eq!(hs.tokens(), 0);
        assert!(hs.catch_up(&geom, &src, 0, 0, 32));
        assert_eq!(tokens_per_page(10, 64, 16), 0);
        assert_eq!(pages_for(10, 0), usize::MAX);
    }
}
