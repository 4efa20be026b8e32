//! Block scores from an approximate attention over each query head's largest channels
//! (SparQ's first step), summed per block.
//!
//! Quest's bound (`digest`) ranks a block by the largest `q·k` its min/max box allows, which
//! on a small head dimension is loose: on SmolLM2-135M (3.8k tokens, budget 512, block 32) a
//! top-k by the bound keeps top-1 agreement 0.62 with dense attention (KL 0.50), where a top-k
//! by each block's exact attention mass keeps 0.86 (KL 0.056). Scoring every key on the
//! `r` channels where the query is largest (16 of 64 there) keeps 0.84 (KL 0.07), reading
//! `r / head_dim` of the keys: the host layout stores each block's K transposed, so a channel
//! of a block is one contiguous row.

use rayon::prelude::*;

use crate::block::BlockGeometry;
use crate::digest::GroupScore;
use crate::dtype::{KvDType, decode_to_f32};
use crate::plan::PARALLEL_SELECT_BLOCKS;
use crate::sequence::KvSource;

/// A GQA group's query reduced to each head's `r` largest-magnitude channels.
#[derive(Debug)]
struct ChannelQuery {
    /// Channels kept by any head of the group, ascending: the key rows read per block.
    rows: Vec<usize>,
    /// Per head, its kept channels as (index into `rows`, query value times temperature).
    taps: Vec<Vec<(usize, f32)>>,
    /// Every head's kept channels as (channel, query value times temperature), head after
    /// head, [`ChannelQuery::per`] each (the AVX2 path's taps).
    #[cfg(target_arch = "x86_64")]
    flat: Vec<(usize, f32)>,
    /// Channels kept per head.
    #[cfg(target_arch = "x86_64")]
    per: usize,
}

impl ChannelQuery {
    /// SparQ's temperature: a partial dot product over channels holding a share `f` of the
    /// query's L1 norm has its spread scaled as by `sqrt(f)`, so the softmax scale is divided
    /// by it to keep the distribution about as sharp as the full one.
    fn new(q_group: &[f32], d: usize, r: usize, scale: f32) -> Self {
        let r = r.clamp(1, d.max(1));
        // In base 2: the block sums use powers of two.
        let scale = scale * std::f32::consts::LOG2_E;
        let mut keep = vec![false; d];
        let mut order: Vec<usize> = (0..d).collect();
        let mut heads = Vec::new();
        for q in q_group.chunks_exact(d) {
            order.sort_unstable_by(|&a, &b| q[b].abs().total_cmp(&q[a].abs()).then(a.cmp(&b)));
            let total: f32 = q.iter().map(|x| x.abs()).sum();
            let kept: f32 = order[..r].iter().map(|&c| q[c].abs()).sum();
            let temp = if kept > 0.0 && total > 0.0 {
                scale / (kept / total).sqrt()
            } else {
                scale
            };
            let mut chosen: Vec<(usize, f32)> =
                order[..r].iter().map(|&c| (c, q[c] * temp)).collect();
            chosen.sort_unstable_by_key(|t| t.0);
            for &(c, _) in &chosen {
                keep[c] = true;
            }
            heads.push(chosen);
        }
        let rows: Vec<usize> = (0..d).filter(|&c| keep[c]).collect();
        #[cfg(target_arch = "x86_64")]
        let flat = heads.iter().flatten().copied().collect();
        let taps = heads
            .into_iter()
            .map(|h| {
                h.into_iter()
                    .map(|(c, w)| (rows.partition_point(|&x| x < c), w))
                    .collect()
            })
            .collect();
        Self {
            rows,
            taps,
            #[cfg(target_arch = "x86_64")]
            flat,
            #[cfg(target_arch = "x86_64")]
            per: r,
        }
    }

    fn heads(&self) -> usize {
        self.taps.len()
    }

    /// Each head's log2-sum-exp2 of approximate scores over the first `len` keys of one
    /// head's transposed K block (`kt`, `[head_dim][block_size]` elements), into `out[G]`.
    fn block_lse(
        &self,
        geom: &BlockGeometry,
        kt: &[u8],
        k_scales: Option<&[u8]>,
        len: usize,
        buf: &mut Buf,
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if crate::kernel_avx2::available()
            && geom.block_size.is_multiple_of(8)
            && kt.len() >= geom.head_dim * geom.block_size * geom.dtype.size()
        {
            use crate::avx2::{AsBf16, AsF8, AsF16, AsF32, AsI8};
            // SAFETY: the CPU has AVX2, FMA and F16C, the block size is a multiple of 8 and
            // `kt` holds every row (checked just above); the element type is the block's.
            unsafe {
                match geom.dtype {
                    KvDType::F32 => self.block_lse_avx2::<AsF32>(geom, kt, k_scales, len, buf, out),
                    KvDType::F16 => self.block_lse_avx2::<AsF16>(geom, kt, k_scales, len, buf, out),
                    KvDType::Bf16 => {
                        self.block_lse_avx2::<AsBf16>(geom, kt, k_scales, len, buf, out)
                    }
                    KvDType::I8 => self.block_lse_avx2::<AsI8>(geom, kt, k_scales, len, buf, out),
                    KvDType::F8E4M3 => {
                        self.block_lse_avx2::<AsF8>(geom, kt, k_scales, len, buf, out)
                    }
                }
            }
            return;
        }
        self.block_lse_body(geom, kt, k_scales, len, buf, out);
    }

    /// [`ChannelQuery::block_lse_body`] with each head's taps read straight from the stored
    /// rows and widened in registers, two heads at a time over four token vectors (eight
    /// FMA chains: one head's four wait on the FMA latency). The body widens every row into
    /// a buffer and reloads it per tap: `bench select` (G=5, D=128, one thread, AMD EPYC) gave
    /// 2x this path's time with the keys in cache and 1.25x with them in memory, where
    /// scattered rows bound both. Each head's sums are the body's, in the same order.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `E` is `geom.dtype`; `geom.block_size` is a multiple of 8 and
    /// `kt` holds `head_dim` rows of `block_size` elements.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block_lse_avx2<E: crate::avx2::Elem>(
        &self,
        geom: &BlockGeometry,
        kt: &[u8],
        k_scales: Option<&[u8]>,
        len: usize,
        buf: &mut Buf,
        out: &mut [f32],
    ) {
        let bs = geom.block_size;
        let nv = len.div_ceil(8);
        let scales = &mut buf.scales[..len];
        if let Some(ks) = k_scales {
            for (t, s) in scales.iter_mut().enumerate() {
                *s = crate::block::scale_at(ks, t);
            }
        }
        let (taps, per) = (&self.flat, self.per);
        let acc = &mut buf.acc[..2 * bs];
        let (a0, a1) = acc.split_at_mut(bs);
        let mut h = 0;
        while h < out.len() {
            let pair = h + 1 < out.len();
            let t0 = &taps[h * per..(h + 1) * per];
            let t1 = if pair {
                &taps[(h + 1) * per..(h + 2) * per]
            } else {
                t0
            };
            // SAFETY: every tap's channel is a row of `kt` and `8 nv <= bs` (the caller's
            // contract); `a0` and `a1` hold `bs` sums.
            unsafe { tap_sums::<E>(kt.as_ptr(), bs, nv, t0, t1, a0, a1) };
            for (k, a) in [&mut a0[..len], &mut a1[..len]]
                .into_iter()
                .enumerate()
                .take(1 + usize::from(pair))
            {
                if k_scales.is_some() {
                    for (a, s) in a.iter_mut().zip(scales.iter()) {
                        *a *= s;
                    }
                }
                out[h + k] = log2_sum_exp2(a);
            }
            h += 1 + usize::from(pair);
        }
    }

    #[inline(always)]
    fn block_lse_body(
        &self,
        geom: &BlockGeometry,
        kt: &[u8],
        k_scales: Option<&[u8]>,
        len: usize,
        buf: &mut Buf,
        out: &mut [f32],
    ) {
        let (bs, es) = (geom.block_size, geom.dtype.size());
        // The rows the group reads, widened once.
        for (i, &c) in self.rows.iter().enumerate() {
            let at = c * bs * es;
            let row = &mut buf.rows[i * bs..i * bs + len];
            let src = &kt[at..at + len * es];
            match geom.dtype {
                KvDType::Bf16 => {
                    for (r, b) in row.iter_mut().zip(src.chunks_exact(2)) {
                        *r = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                    }
                }
                // Inline, so it widens eight at a time (the scales come after the sums).
                KvDType::I8 => {
                    for (r, b) in row.iter_mut().zip(src) {
                        *r = f32::from(*b as i8);
                    }
                }
                KvDType::F8E4M3 => {
                    for (r, b) in row.iter_mut().zip(src) {
                        *r = crate::dtype::f8_e4m3_value(*b);
                    }
                }
                _ => decode_to_f32(geom.dtype, src, row),
            }
        }
        // Int8 and fp8: each token's K scale, applied once to each head's sum rather than to every
        // row read (the score is linear in the key).
        let scales = &mut buf.scales[..len];
        if let Some(ks) = k_scales {
            for (t, s) in scales.iter_mut().enumerate() {
                *s = crate::block::scale_at(ks, t);
            }
        }
        let acc = &mut buf.acc[..len];
        for (o, taps) in out.iter_mut().zip(&self.taps) {
            // Eight tokens at a time with their sums in one register across the taps (a
            // pass per tap over the whole block would store and reload every sum).
            let mut t0 = 0;
            while t0 + 8 <= len {
                let mut v = [0f32; 8];
                for &(i, w) in taps {
                    let r = &buf.rows[i * bs + t0..i * bs + t0 + 8];
                    for (v, k) in v.iter_mut().zip(r) {
                        *v = k.mul_add(w, *v);
                    }
                }
                acc[t0..t0 + 8].copy_from_slice(&v);
                t0 += 8;
            }
            for (t, a) in acc.iter_mut().enumerate().skip(t0) {
                *a = taps
                    .iter()
                    .fold(0.0, |s, &(i, w)| buf.rows[i * bs + t].mul_add(w, s));
            }
            if k_scales.is_some() {
                for (a, s) in acc.iter_mut().zip(scales.iter()) {
                    *a *= s;
                }
            }
            *o = log2_sum_exp2(acc);
        }
    }
}

/// Sums over two heads' taps (`t0`, `t1`: channels, weights; the same number each) of the
/// first `8 nv` tokens of every tapped row (`bs` elements each), into `a0` and `a1`: four token
/// vectors at a time, both heads in one pass (eight independent FMA chains).
///
/// # Safety
/// AVX2, FMA and F16C; `kt` holds every tapped channel's row, `8 nv <= bs`;
/// `a0` and `a1` hold `8 nv` sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tap_sums<E: crate::avx2::Elem>(
    kt: *const u8,
    bs: usize,
    nv: usize,
    t0: &[(usize, f32)],
    t1: &[(usize, f32)],
    a0: &mut [f32],
    a1: &mut [f32],
) {
    let mut j0 = 0;
    while j0 + 4 <= nv {
        // SAFETY: forwarded, vectors j0..j0 + 4 <= nv.
        unsafe { tap_tile::<E, 4>(kt, bs, j0, t0, t1, a0, a1) };
        j0 += 4;
    }
    // 16-token blocks: two vectors, four chains.
    while j0 + 2 <= nv {
        // SAFETY: forwarded, vectors j0..j0 + 2 <= nv.
        unsafe { tap_tile::<E, 2>(kt, bs, j0, t0, t1, a0, a1) };
        j0 += 2;
    }
    while j0 < nv {
        // SAFETY: forwarded, vector j0 < nv.
        unsafe { tap_tile::<E, 1>(kt, bs, j0, t0, t1, a0, a1) };
        j0 += 1;
    }
}

/// [`tap_sums`] of token vectors `j0..j0 + W`, accumulated in registers.
///
/// # Safety
/// As [`tap_sums`], with `j0 + W <= nv`.
// Indexed loops over constant bounds keep the sums in registers.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tap_tile<E: crate::avx2::Elem, const W: usize>(
    kt: *const u8,
    bs: usize,
    j0: usize,
    t0: &[(usize, f32)],
    t1: &[(usize, f32)],
    a0: &mut [f32],
    a1: &mut [f32],
) {
    use std::arch::x86_64::*;
    let es = E::SIZE;
    let mut s0 = [_mm256_setzero_ps(); W];
    let mut s1 = [_mm256_setzero_ps(); W];
    for (&(r0, w0), &(r1, w1)) in t0.iter().zip(t1) {
        // SAFETY: rows r0, r1 hold tokens 8 j0 .. 8 (j0 + W) (the caller's contract).
        let (p0, p1) = unsafe {
            (
                kt.add((r0 * bs + 8 * j0) * es),
                kt.add((r1 * bs + 8 * j0) * es),
            )
        };
        let (w0, w1) = (_mm256_set1_ps(w0), _mm256_set1_ps(w1));
        for j in 0..W {
            // SAFETY: as above, vector j0 + j.
            unsafe {
                s0[j] = _mm256_fmadd_ps(E::load8(p0.add(8 * j * es)), w0, s0[j]);
                s1[j] = _mm256_fmadd_ps(E::load8(p1.add(8 * j * es)), w1, s1[j]);
            }
        }
    }
    for j in 0..W {
        // SAFETY: 8 (j0 + j) + 8 <= a0.len(), a1.len() (the caller's contract).
        unsafe {
            _mm256_storeu_ps(a0.as_mut_ptr().add(8 * (j0 + j)), s0[j]);
            _mm256_storeu_ps(a1.as_mut_ptr().add(8 * (j0 + j)), s1[j]);
        }
    }
}

/// Key rows (channels) SparQ reads of each block it scores for the group query `q_group`
/// (`[G][head_dim]`) keeping `channels` per head: the union of the heads' largest channels.
pub fn rows_read(q_group: &[f32], head_dim: usize, channels: usize) -> usize {
    ChannelQuery::new(q_group, head_dim, channels, 1.0)
        .rows
        .len()
}

/// Blocks ahead whose rows are prefetched while one is scored.
const PREFETCH_BLOCKS: usize = 4;

/// Byte offsets of the 64-byte lines that rows `rows` (`row_bytes` each) of a transposed K
/// block span, ascending.
fn row_lines(rows: &[usize], row_bytes: usize) -> Vec<usize> {
    let mut lines: Vec<usize> = rows
        .iter()
        .flat_map(|&c| (c * row_bytes / 64)..((c + 1) * row_bytes).div_ceil(64))
        .map(|l| l * 64)
        .collect();
    lines.dedup();
    lines
}

/// Asks for the cache lines at byte offsets `lines` of a transposed K block `kt`.
fn prefetch_lines(kt: &[u8], lines: &[usize]) {
    #[cfg(target_arch = "x86_64")]
    if lines.last().is_some_and(|&l| l < kt.len()) {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        // Into L2, as the attention kernels' prefetch (`kernel_avx2::Prefetch`): into L1 the
        // few miss buffers capped the lines in flight, and the 32k Qwen3-14B-shaped
        // selection (`bench select`, 1 thread, 2-core EPYC) took 6.2-8.9 ms a layer against
        // 3.4-5.0 into L2.
        for &l in lines {
            // SAFETY: a prefetch is a hint and never faults; every offset is at most the
            // last, which lies inside `kt` (checked above).
            unsafe { _mm_prefetch::<_MM_HINT_T1>(kt.as_ptr().add(l).cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (kt, lines);
}

/// Scratch of one scoring thread.
#[derive(Debug)]
struct Buf {
    /// `[rows][block_size]`: the rows read, as f32.
    rows: Vec<f32>,
    /// `[2][block_size]`: two heads' approximate scores.
    acc: Vec<f32>,
    /// `[block_size]`: an int8 or fp8 block's K scales.
    scales: Vec<f32>,
}

/// `log2 sum 2^x`, stable; -inf for no elements. Ranking needs little precision, so the
/// per-key powers use [`exp2_approx`], which the compiler vectorises (libm's `exp2f` is a
/// call per key, and there is one key per block token and head).
#[inline(always)]
pub(crate) fn log2_sum_exp2(x: &[f32]) -> f32 {
    // Eight independent lanes over whole chunks, so both reductions vectorise without
    // reassociation; the tail (blocks not a multiple of 8) apart.
    let (body, tail) = x.split_at(x.len() / 8 * 8);
    let mut mx = [f32::NEG_INFINITY; 8];
    for c in body.chunks_exact(8) {
        for (m, &v) in mx.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let m = mx
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    if !m.is_finite() {
        return m;
    }
    let mut sum = [0f32; 8];
    for c in body.chunks_exact(8) {
        for (s, &v) in sum.iter_mut().zip(c) {
            *s += exp2_approx(v - m);
        }
    }
    let tail: f32 = tail.iter().map(|&v| exp2_approx(v - m)).sum();
    m + log2_from_one(sum.iter().sum::<f32>() + tail)
}

/// `log2 x` for `x >= 1` (what a sum of powers led by `2^0` is), within 1e-7 of libm's plus
/// its rounding; libm's elsewhere (NaN included). libm's `log2f` is a call, once per block and
/// query head, a tenth of a sketch block's scoring. `x = 2^k m` with `m` in [√½, √2), and
/// `ln m = 2 atanh(s)`, `s = (m - 1) / (m + 1)`, by its series to `s^7` (`|s| <= 0.172`: the
/// next term is below 3e-8).
#[inline(always)]
pub(crate) fn log2_from_one(x: f32) -> f32 {
    if !(1.0..f32::INFINITY).contains(&x) {
        return x.log2();
    }
    let bits = x.to_bits();
    // Taking √½'s bits away leaves the exponent that puts the mantissa in [√½, √2).
    let k = (bits - 0.5f32.sqrt().to_bits()) >> 23;
    let m = f32::from_bits(bits - (k << 23));
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let ln_m = s * (2.0 + s2 * (2.0 / 3.0 + s2 * (2.0 / 5.0 + s2 * (2.0 / 7.0))));
    k as f32 + ln_m * std::f32::consts::LOG2_E
}

/// `2^x` for `x <= 0` (relative error below 1e-5; 0 below -126): round to the nearest
/// integer `i` by the 1.5·2^23 trick, `2^(x-i)` by a degree-5 Taylor polynomial on
/// [-0.5, 0.5], and `2^i` built in the exponent bits. Branch-free and without libm.
#[inline(always)]
fn exp2_approx(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23
    let x = if x < -126.0 { -126.0 } else { x };
    let t = x + ROUND;
    let i = t.to_bits() as i32 - ROUND.to_bits() as i32;
    let f = x - (t - ROUND);
    let l = std::f32::consts::LN_2;
    let p = 1.0
        + f * (l + f
            * (l * l / 2.0
                + f * (l * l * l / 6.0
                    + f * (l * l * l * l / 24.0 + f * (l * l * l * l * l / 120.0)))));
    f32::from_bits(((i + 127) << 23) as u32) * p
}

/// [`exp2_approx`], but 0 below -126 (an empty block's share is none at all), NaN for NaN.
#[inline(always)]
fn exp2_or_zero(x: f32) -> f32 {
    if x < -126.0 { 0.0 } else { exp2_approx(x) }
}

/// Scores `blocks` of (`layer`, `head`) for the group query `q_group` (`[G][head_dim]`):
/// each head's approximate attention share of every block (its softmax over these blocks'
/// keys, scores from its `channels` largest channels, scale `scale`), combined over the
/// group's heads as `how` says (the sum is the group's attention mass). Blocks past the
/// tokens `src` holds score 0.
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_scores(
    geom: &BlockGeometry,
    src: &dyn KvSource,
    layer: usize,
    head: usize,
    q_group: &[f32],
    channels: usize,
    scale: f32,
    how: GroupScore,
    blocks: &[usize],
) -> Vec<f32> {
    let (bs, d) = (geom.block_size, geom.head_dim);
    let cq = ChannelQuery::new(q_group, d, channels, scale);
    let g = cq.heads().max(1);
    let n = src.num_tokens();
    let range = geom.head_range(head);
    let row_bytes = bs * geom.dtype.size();
    let lines = row_lines(&cq.rows, row_bytes);
    let k_bytes = d * row_bytes;
    let scratch = || Buf {
        rows: vec![0f32; cq.rows.len() * bs],
        acc: vec![0f32; 2 * bs],
        scales: vec![0f32; bs],
    };
    let one = |buf: &mut Buf, (j, out): (usize, &mut [f32])| {
        let b = blocks[j];
        let len = n.saturating_sub(b * bs).min(bs);
        if len == 0 {
            out.fill(f32::NEG_INFINITY);
            return;
        }
        // The rows read are scattered over the block's K: without a prefetch every one is
        // a cache miss waited for in turn.
        if let Some(&ahead) = blocks.get(j + PREFETCH_BLOCKS)
            && ahead * bs < n
        {
            prefetch_lines(&src.block(layer, ahead)[range.clone()], &lines);
        }
        let head = &src.block(layer, b)[range.clone()];
        let k_scales = geom.dtype.scaled().then(|| geom.scales(head).0);
        cq.block_lse(geom, &head[..k_bytes], k_scales, len, buf, out);
    };
    // The first blocks' rows, which no earlier block prefetches.
    for &b in blocks.iter().take(PREFETCH_BLOCKS) {
        if b * bs < n {
            prefetch_lines(&src.block(layer, b)[range.clone()], &lines);
        }
    }
    let mut lse = vec![0f32; blocks.len() * g];
    if blocks.len() >= PARALLEL_SELECT_BLOCKS {
        lse.par_chunks_mut(g)
            .enumerate()
            .for_each_init(scratch, one);
    } else {
        let mut s = scratch();
        lse.chunks_mut(g).enumerate().for_each(|x| one(&mut s, x));
    }
    group_shares(&lse, g, how)
}

/// Each head's share of every block (`lse` is `[blocks][G]` log2-sum-exp2 sums, normalised
/// over the blocks scored), combined over the group as `how` says (the sum is the group's
/// attention mass).
pub(crate) fn group_shares(lse: &[f32], g: usize, how: GroupScore) -> Vec<f32> {
    let g = g.max(1);
    #[cfg(target_arch = "x86_64")]
    if lse.len().is_multiple_of(g) && crate::kernel_avx2::available() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { group_shares_avx2(lse, g, how) };
    }
    group_shares_scalar(lse, g, how)
}

/// [`group_shares`] one block at a time.
fn group_shares_scalar(lse: &[f32], g: usize, how: GroupScore) -> Vec<f32> {
    let mut scores = vec![
        match how {
            GroupScore::Sum => 0f32,
            GroupScore::Max => f32::NEG_INFINITY,
        };
        lse.len() / g
    ];
    for h in 0..g {
        let col = || lse.iter().skip(h).step_by(g).copied();
        let m = col().fold(f32::NEG_INFINITY, f32::max);
        let total = m + col().map(|l| exp2_or_zero(l - m)).sum::<f32>().log2();
        for (s, l) in scores.iter_mut().zip(col()) {
            let share = if total.is_finite() {
                exp2_or_zero(l - total)
            } else {
                0.0
            };
            *s = match how {
                GroupScore::Sum => *s + share,
                GroupScore::Max => s.max(share),
            };
        }
    }
    scores
}

/// [`group_shares`] eight blocks a vector: each head's column copied out once, its maximum
/// and sum of `2^(lse - max)` in vectors, the shares by the kernel's `exp2` (0 below -126,
/// as `exp2_or_zero`). Per block and head the scalar path spent two `exp2`s, 7% of a sketch
/// step's scoring at 7.8k tokens (G = 3).
///
/// # Safety
/// AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn group_shares_avx2(lse: &[f32], g: usize, how: GroupScore) -> Vec<f32> {
    use std::arch::x86_64::*;
    let n = lse.len() / g;
    let nv = n.div_ceil(8);
    let neg = _mm256_set1_ps(f32::NEG_INFINITY);
    // The column, padded to whole vectors with -inf (whose powers are 0).
    let mut col = vec![f32::NEG_INFINITY; 8 * nv];
    let mut scores = vec![
        match how {
            GroupScore::Sum => 0f32,
            GroupScore::Max => f32::NEG_INFINITY,
        };
        8 * nv
    ];
    for h in 0..g {
        for (c, l) in col.iter_mut().zip(lse.iter().skip(h).step_by(g)) {
            *c = *l;
        }
        let at = |i: usize| {
            // SAFETY: vector i of the column, 8 i + 8 <= its length.
            unsafe { _mm256_loadu_ps(col.as_ptr().add(8 * i)) }
        };
        // A NaN (first operand) is passed over, as `f32::max` does.
        let m = (0..nv).fold(neg, |m, i| _mm256_max_ps(at(i), m));
        let mut top = [0f32; 8];
        // SAFETY: eight floats.
        unsafe { _mm256_storeu_ps(top.as_mut_ptr(), m) };
        let m = top.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mv = _mm256_set1_ps(m);
        let sum = (0..nv).fold(_mm256_setzero_ps(), |s, i| {
            _mm256_add_ps(s, crate::kernel_avx2::exp2_ps(_mm256_sub_ps(at(i), mv)))
        });
        let mut lanes = [0f32; 8];
        // SAFETY: eight floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
        let total = m + lanes.iter().sum::<f32>().log2();
        if !total.is_finite() {
            // Every share 0: a sum keeps its value, a maximum takes 0 in.
            if how == GroupScore::Max {
                scores.iter_mut().for_each(|s| *s = s.max(0.0));
            }
            continue;
        }
        let tv = _mm256_set1_ps(total);
        for i in 0..nv {
            let share = crate::kernel_avx2::exp2_ps(_mm256_sub_ps(at(i), tv));
            let p = scores[8 * i..8 * i + 8].as_mut_ptr();
            // SAFETY: vector i of `scores`, as long as the column.
            unsafe {
                let s = _mm256_loadu_ps(p);
                _mm256_storeu_ps(
                    p,
                    match how {
                        GroupScore::Sum => _mm256_add_ps(s, share),
                        // A NaN share (first operand) is passed over, as `f32::max` does.
                        GroupScore::Max => _mm256_max_ps(share, s),
                    },
                );
            }
        }
    }
    scores.truncate(n);
    scores
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// One layer of `n` tokens, K only (V zero), in the pool's block layout.
    pub(crate) struct Keys {
        blocks: Vec<Vec<u8>>,
        n: usize,
    }
    impl KvSource for Keys {
        fn block(&self, _layer: usize, block: usize) -> &[u8] {
            &self.blocks[block]
        }
        fn num_tokens(&self) -> usize {
            self.n
        }
    }

    /// Token `t`'s keys of every KV head are `k[t]` (`[num_kv_heads][head_dim]`).
    pub(crate) fn keys(geom: BlockGeometry, k: &[Vec<f32>]) -> Keys {
        let (bs, d) = (geom.block_size, geom.head_dim);
        let nb = k.len().div_ceil(bs);
        let mut blocks = vec![vec![0u8; geom.block_bytes()]; nb];
        for (t, kt) in k.iter().enumerate() {
            for h in 0..geom.num_kv_heads {
                geom.write_token(
                    &mut blocks[t / bs],
                    h,
                    t % bs,
                    &kt[h * d..(h + 1) * d],
                    &vec![0.0; d],
                );
            }
        }
        Keys { blocks, n: k.len() }
    }

    fn rand(seed: u64) -> impl FnMut() -> f32 {
        let mut r = seed;
        move || {
            r ^= r << 13;
            r ^= r >> 7;
            r ^= r << 17;
            (r % 2001) as f32 / 1000.0 - 1.0
        }
    }

    /// With every channel kept, the scores are each block's exact share of the attention
    /// (summed or maxed over the group's heads), from the definition.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_shares_are_the_scalar_ones() {
        if !crate::kernel_avx2::available() {
            return;
        }
        let mut seed = 11u64;
        for g in 1..=9 {
            for n in [1, 7, 8, 9, 40, 243] {
                let mut lse: Vec<f32> = (0..n * g)
                    .map(|_| 20.0 * crate::sketch::tests::lcg(&mut seed))
                    .collect();
                // Far below the rest (a share under 2^-126), absent, and NaN entries; in
                // one case a whole column absent.
                lse[0] = -300.0;
                if n > 2 {
                    lse[g] = f32::NEG_INFINITY;
                    lse[2 * g + (g - 1)] = f32::NAN;
                }
                if n == 9 {
                    lse.iter_mut()
                        .skip(g - 1)
                        .step_by(g)
                        .for_each(|l| *l = f32::NEG_INFINITY);
                }
                for how in [GroupScore::Max, GroupScore::Sum] {
                    let want = group_shares_scalar(&lse, g, how);
                    // SAFETY: AVX2 and FMA are present.
                    let got = unsafe { group_shares_avx2(&lse, g, how) };
                    assert_eq!(want.len(), got.len());
                    for (b, (w, x)) in want.iter().zip(&got).enumerate() {
                        assert!(
                            (w.is_nan() && x.is_nan()) || (w - x).abs() <= 1e-6 * (1.0 + w.abs()),
                            "G {g} n {n} {how:?} block {b}: {w} vs {x}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn all_channels_give_each_blocks_exact_attention_share() {
        for dtype in [KvDType::F32, KvDType::Bf16, KvDType::I8, KvDType::F8E4M3] {
            let geom = BlockGeometry {
                block_size: 4,
                num_kv_heads: 2,
                head_dim: 8,
                dtype,
            };
            let mut next = rand(7);
            let n = 21;
            let k: Vec<Vec<f32>> = (0..n)
                .map(|_| (0..16).map(|_| 2.0 * next()).collect())
                .collect();
            let src = keys(geom, &k);
            // Keys as stored (rounded to the dtype, or quantized with their scale).
            let stored = |t: usize, h: usize| -> Vec<f32> {
                let (mut f, mut v) = (vec![0f32; 8], vec![0f32; 8]);
                geom.read_token(&src.blocks[t / 4], h, t % 4, &mut f, &mut v);
                f
            };
            let q: Vec<f32> = (0..3 * 8).map(|_| next()).collect();
            let scale = 0.35;
            for how in [GroupScore::Sum, GroupScore::Max] {
                let head = 1;
                let got =
                    block_scores(&geom, &src, 0, head, &q, 8, scale, how, &[0, 1, 2, 3, 4, 5]);
                let mut want = vec![0f32; 6];
                for g in 0..3 {
                    let qg = &q[g * 8..(g + 1) * 8];
                    let s: Vec<f32> = (0..n)
                        .map(|t| {
                            let kt = stored(t, head);
                            scale * qg.iter().zip(&kt).map(|(a, b)| a * b).sum::<f32>()
                        })
                        .collect();
                    let m = s.iter().copied().fold(f32::MIN, f32::max);
                    let z: f32 = s.iter().map(|x| (x - m).exp()).sum();
                    for (b, w) in want.iter_mut().enumerate() {
                        let share: f32 = s[b * 4..((b + 1) * 4).min(n)]
                            .iter()
                            .map(|x| (x - m).exp() / z)
                            .sum();
                        *w = match how {
                            GroupScore::Sum => *w + share,
                            GroupScore::Max => w.max(share),
                        };
                    }
                }
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() < 1e-5,
                        "{dtype:?} {how:?}: {got:?} vs {want:?}"
                    );
                }
            }
        }
    }

    /// With few channels, a block holding a key along the query's largest channels still
    /// ranks first; blocks past the stored tokens score nothing.
    #[test]
    fn few_channels_find_the_block_aligned_with_the_query() {
        let geom = BlockGeometry {
            block_size: 8,
            num_kv_heads: 1,
            head_dim: 16,
            dtype: KvDType::F16,
        };
        let mut next = rand(11);
        let mut k: Vec<Vec<f32>> = (0..40)
            .map(|_| (0..16).map(|_| 0.3 * next()).collect())
            .collect();
        let mut q = vec![0.05f32; 16];
        q[3] = 2.0;
        q[11] = -1.5;
        k[21][3] = 3.0;
        k[21][11] = -3.0;
        let src = keys(geom, &k);
        let s = block_scores(
            &geom,
            &src,
            0,
            0,
            &q,
            2,
            0.25,
            GroupScore::Sum,
            &[0, 1, 2, 3, 4, 5],
        );
        let best = (0..5).max_by(|&a, &b| s[a].total_cmp(&s[b])).unwrap();
        assert_eq!(best, 2, "{s:?}");
        assert_eq!(s[5], 0.0);
        assert!((s.iter().sum::<f32>() - 1.0).abs() < 1e-5);
    }

    /// The AVX2 path gives the portable body's sums exactly (same FMAs in the same order),
    /// for every element type, group size, block size and partly filled block.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_block_sums_equal_the_portable_body() {
        if !crate::kernel_avx2::available() {
            return;
        }
        let mut next = rand(23);
        for dtype in [
            KvDType::F32,
            KvDType::F16,
            KvDType::Bf16,
            KvDType::I8,
            KvDType::F8E4M3,
        ] {
            for (bs, d) in [(8, 16), (16, 64), (32, 128)] {
                let geom = BlockGeometry {
                    block_size: bs,
                    num_kv_heads: 1,
                    head_dim: d,
                    dtype,
                };
                let k: Vec<Vec<f32>> = (0..bs)
                    .map(|_| (0..d).map(|_| 3.0 * next()).collect())
                    .collect();
                let src = keys(geom, &k);
                let head = &src.blocks[0][geom.head_range(0)];
                let k_scales = dtype.scaled().then(|| geom.scales(head).0);
                let kt = &head[..d * bs * dtype.size()];
                for g in [1, 2, 3, 5] {
                    let q: Vec<f32> = (0..g * d).map(|_| next()).collect();
                    let cq = ChannelQuery::new(&q, d, d / 4, 0.3);
                    let mut buf = Buf {
                        rows: vec![0f32; cq.rows.len() * bs],
                        acc: vec![0f32; 2 * bs],
                        scales: vec![0f32; bs],
                    };
                    for len in [1, 7, bs / 2 + 1, bs] {
                        let (mut want, mut got) = (vec![0f32; g], vec![0f32; g]);
                        cq.block_lse_body(&geom, kt, k_scales, len, &mut buf, &mut want);
                        cq.block_lse(&geom, kt, k_scales, len, &mut buf, &mut got);
                        assert_eq!(got, want, "{dtype:?} bs={bs} G={g} len={len}");
                        assert!(want.iter().all(|x| x.is_finite()));
                    }
                }
            }
        }
    }

    #[test]
    fn log_sum_exp_of_nothing_and_of_infinities() {
        assert_eq!(log2_sum_exp2(&[]), f32::NEG_INFINITY);
        assert_eq!(log2_sum_exp2(&[f32::NEG_INFINITY; 3]), f32::NEG_INFINITY);
        assert!((log2_sum_exp2(&[0.0, 0.0]) - 1.0).abs() < 1e-6);
        assert!((log2_sum_exp2(&[3.0, 1.0]) - (8f32 + 2.0).log2()).abs() < 1e-5);
    }

    #[test]
    fn log2_from_one_is_libms_within_its_rounding() {
        let mut x = 1.0f32;
        while x < 1e30 {
            let (want, got) = (x.log2(), log2_from_one(x));
            assert!(
                (got - want).abs() <= 1e-7 + 2.0 * f32::EPSILON * want,
                "{x}: {got} vs {want}"
            );
            x = x * 1.000_731 + 1e-7;
        }
        for x in [1.0, 2.0, 1.5, 32.0, 0.5f32.sqrt() * 2.0, 2f32.sqrt()] {
            assert!((log2_from_one(x) - x.log2()).abs() <= 1e-7, "{x}");
        }
        for x in [0.5, 0.0, f32::INFINITY] {
            assert_eq!(log2_from_one(x), x.log2(), "{x}");
        }
        assert!(log2_from_one(-1.0).is_nan() && log2_from_one(f32::NAN).is_nan());
    }

    #[test]
    fn exp2_approx_is_close_everywhere_below_zero() {
        let mut x = 0.0f32;
        while x > -140.0 {
            let (want, got) = (x.exp2(), exp2_approx(x));
            if x >= -126.0 {
                assert!((got - want).abs() <= 1e-5 * want, "{x}: {got} vs {want}");
            } else {
                assert!(got <= 2f32.powi(-125), "{x}: {got}");
            }
            x -= 0.037;
        }
        assert_eq!(exp2_approx(f32::NEG_INFINITY), exp2_approx(-126.0));
    }
}
