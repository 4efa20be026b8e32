//! The 4-bit key sketch ([`crate::sketch`]) kept on the host, so a CPU node scores every block
//! from it instead of quantizing every key it reads at every step.
//!
//! Each (layer, KV head) of a sequence keeps its sketch in pages the node hands over (pool
//! blocks, so the sketch is accounted as KV is). A page holds whole KV blocks
//! ([`tokens_per_page`] tokens); each block is its tokens' f32 scales, then its nibbles
//! transposed as K is in the pool: a row per byte (channels `2j`, `2j + 1`), a column per
//! token, so the AVX2 path widens 8 or 16 tokens' nibbles at once for every head of the group
//! and needs no horizontal sums.
//! The sketch follows the pool: before a layer scores, the blocks it scores that are not
//! sketched yet are quantized from the KV (the prompt at the first step, then a block each
//! time one fills) exactly as [`crate::sketch::sketch_tokens`] does, so the scores are the
//! definition's up to the order of sums and a polynomial `exp2` on AVX2.

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
        let mut lse = vec![0f32; blocks.len() * g];
        let fill = |chunk: &mut [f32], first: usize, buf: &mut Vec<f32>| {
            for (j, out) in chunk.chunks_mut(g).enumerate() {
                let from = blocks[first + j] * bs;
                let len = self.tokens.min(from + bs).saturating_sub(from);
                if len == 0 {
                    out.fill(f32::NEG_INFINITY);
                    continue;
                }
                let page = self.pages[from / tpp].bytes();
                let at = (from % tpp) / bs * stride;
                let block = &page[at..at + stride];
                lse_of_block(q_group, &bias, d, bs, temp, block, len, buf, out);
            }
        };
        // A few dozen blocks a task: each block is a few microseconds.
        let per_task = 32;
        if blocks.len() >= PARALLEL_SELECT_BLOCKS {
            lse.par_chunks_mut(per_task * g)
                .enumerate()
                .for_each_init(Vec::new, |buf, (i, c)| fill(c, i * per_task, buf));
        } else {
            fill(&mut lse, 0, &mut Vec::new());
        }
        crate::sparq::group_shares(&lse, g, how)
    }
}

/// Each query head's log2-sum-exp2 over the first `len` tokens of one block's sketch
/// (`block`: scales, then transposed nibbles), into `out[G]`: on AVX2 (block size a multiple
/// of 8) widened in registers with a polynomial `exp2`, else by the definition.
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }

    /// [`super::sketch_block`] compiled for AVX2.
    ///
    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn sketch_block(
        geom: &crate::block::BlockGeometry,
        src: &dyn crate::sequence::KvSource,
        layer: usize,
        head: usize,
        block: usize,
        range: std::ops::Range<usize>,
        dst: &mut [u8],
    ) {
        super::sketch_block_body(geom, src, layer, head, block, range, dst);
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
        let len = scales.len();
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
            for (o, a) in outs.iter_mut().zip(acc.chunks_exact_mut(bs)) {
                let a = &mut a[..len];
                for (x, &s) in a.iter_mut().zip(scales) {
                    *x *= temp * s;
                }
                *o = crate::sparq::log2_sum_exp2(a);
            }
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::KvDType;
    use crate::sketch::tests::lcg;
    use crate::sparq::tests::keys;

    fn pages(n: usize, bytes: usize) -> Vec<Box<dyn SketchPage>> {
        (0..n)
            .map(|_| Box::new(vec![0u8; bytes]) as Box<dyn SketchPage>)
            .collect()
    }

    #[test]
    fn kept_scores_equal_the_definition_read_from_the_pool() {
        let mut seed = 9;
        for (d, g, dtype) in [
            (64, 3, KvDType::Bf16),
            (128, 5, KvDType::F16),
            (128, 11, KvDType::I8),
            (48, 2, KvDType::F32),
        ] {
            let geom = BlockGeometry {
                block_size: 16,
                num_kv_heads: 1,
                head_dim: d,
                dtype,
            };
            let n: usize = 16 * 23 + 7;
            let k: Vec<Vec<f32>> = (0..n)
                .map(|_| (0..d).map(|_| 3.0 * lcg(&mut seed)).collect())
                .collect();
            let src = keys(geom, &k);
            // Pages of 5 blocks: 120 tokens a page, so the sketch spans pages.
            let page_bytes = 80 * (nibble_bytes(d) + 4) + 3;
            let tpp = tokens_per_page(page_bytes, d, 16);
            assert_eq!(tpp, 80);
            let mut hs = HeadSketch::new(pages(pages_for(n, tpp), page_bytes), tpp);
            // In pieces, as blocks fill: a prompt, then a block at a time.
            assert!(hs.catch_up(&geom, &src, 0, 0, 16 * 9));
            assert!(hs.catch_up(&geom, &src, 0, 0, 16 * 10));
            assert!(!hs.catch_up(&geom, &src, 0, 0, n + 1), "past the KV");
            assert!(hs.catch_up(&geom, &src, 0, 0, n));
            assert_eq!(hs.tokens(), n);
            let q: Vec<f32> = (0..g * d).map(|_| 2.0 * lcg(&mut seed)).collect();
            let blocks: Vec<usize> = (0..n.div_ceil(16)).collect();
            for how in [GroupScore::Max, GroupScore::Sum] {
                let want = crate::sketch::block_scores(&geom, &src, 0, 0, &q, 0.1, how, &blocks);
                let got = hs.block_scores(&geom, &q, 0.1, how, &blocks);
                for (b, (w, x)) in want.iter().zip(&got).enumerate() {
                    assert!(
                        (w - x).abs() <= 1e-5 * (1.0 + w.abs()),
                        "d {d} G {g} {dtype:?} block {b}: {w} vs {x}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_kept_sketch_is_the_definitions_bit_for_bit() {
        // Every stored type, broken keys included (NaN, infinite, zero), in pieces that end
        // inside blocks.
        let mut seed = 4;
        for dtype in [
            KvDType::F32,
            KvDType::Bf16,
            KvDType::F16,
            KvDType::I8,
            KvDType::F8E4M3,
        ] {
            let (bs, d) = (16, 66);
            let geom = BlockGeometry {
                block_size: bs,
                num_kv_heads: 2,
                head_dim: d,
                dtype,
            };
            let n = 16 * 7 + 3;
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
            let tpp = 48;
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
