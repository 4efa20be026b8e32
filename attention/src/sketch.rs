//! Block scores from a 4-bit sketch of every key (`--block-scorer sketch`).
//!
//! Each key is quantized per token to 4 bits a channel (symmetric, the token's largest
//! magnitude maps to 7), and a block is scored as SparQ scores its candidates: each query
//! head's log2-sum-exp2 of `q·k̂` over the block's tokens, normalised over the blocks scored
//! and combined over the GQA group. With every block scored and every channel read, this is
//! close to a top-k by each block's exact attention mass: on SmolLM2-135M at 7.8k tokens
//! (budget 1024, block 32, real queries, 256 teacher-forced positions) it keeps top-1
//! agreement with full attention 0.961 (KL 0.0103), where that oracle keeps 0.973 (KL 0.0091)
//! and SparQ's default 0.957 (KL 0.0216).
//!
//! The sketch is an eighth of a 16-bit K+V cache, so a GPU can hold all of it and score every
//! block of a long context in microseconds: selection then never reads host KV. This module is
//! the definition (and the CPU path, which quantizes the keys it reads); the CUDA backend
//! keeps the sketch on the device and must agree with `block_scores`.

use rayon::prelude::*;

use crate::block::BlockGeometry;
use crate::digest::GroupScore;
use crate::dtype::decode_to_f32;
use crate::plan::PARALLEL_SELECT_BLOCKS;
use crate::sequence::KvSource;

/// The quantized value a nibble `n` stands for is `scale * (n - NIBBLE_ZERO)`.
pub const NIBBLE_ZERO: i32 = 8;
/// The largest magnitude maps to this level (the range is -8 ..= 7).
pub(crate) const LEVEL_MAX: f32 = 7.0;

/// Bytes of one token's nibbles for one KV head (its scale is kept apart, as an f32).
pub const fn nibble_bytes(head_dim: usize) -> usize {
    head_dim.div_ceil(2)
}

/// A query head rounded to int8 as the integer scorers score it (the host sketch's AVX2 path
/// and the device's `sketch_lse`): `step = max |q| / 127`, each channel `round(q * (1 /
/// step))` clamped to ±127 (0 for an all-zero head). Both take `q8 · nibbles` exactly in
/// integers; the rounding moves a token's score by at most `step / 2` a channel times the
/// key's level, far below the keys' own 4 bits. `None` where a channel is NaN or infinite:
/// such a query is scored in floats.
pub fn round_query_i8(q: &[f32]) -> Option<(f32, Vec<i8>)> {
    if q.iter().any(|x| !x.is_finite()) {
        return None;
    }
    let amax = q.iter().fold(0f32, |m, x| m.max(x.abs()));
    let step = amax / 127.0;
    let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
    let q8 = q
        .iter()
        .map(|&x| (x * inv).round().clamp(-127.0, 127.0) as i8)
        .collect();
    Some((step, q8))
}

/// The query an integer scorer scores for `q_group` (`[G][head_dim]`): each head as `step *
/// q8` ([`round_query_i8`]), or the group itself where any channel is not finite (the
/// scorers then take floats for the whole group). What a device's integer `sketch_lse` must
/// agree with through [`scores_from_sketch`].
pub fn query_as_rounded(q_group: &[f32], head_dim: usize) -> Vec<f32> {
    let heads: Option<Vec<(f32, Vec<i8>)>> = q_group
        .chunks(head_dim.max(1))
        .map(round_query_i8)
        .collect();
    match heads {
        Some(heads) => heads
            .into_iter()
            .flat_map(|(step, q8)| q8.into_iter().map(move |x| step * f32::from(x)))
            .collect(),
        None => q_group.to_vec(),
    }
}

/// Tokens of one KV head's sketch that fit in `slot_bytes` (a device keeps its sketch in
/// the slots of its KV arena, a head block each): their nibble rows, then their f32 scales.
pub const fn tokens_per_slot(slot_bytes: usize, head_dim: usize) -> usize {
    slot_bytes / (nibble_bytes(head_dim) + 4)
}

/// Quantizes key `k` into `nib` (channel `2j` in the low nibble of byte `j`, `2j + 1` in the
/// high one) and returns the scale: `k[c] ≈ scale * (nibble(c) - 8)`. A zero key (or one
/// with an infinite channel) gives scale 0, so it scores 0 whatever the query; a NaN channel
/// counts as 0.
pub fn quantize_key(k: &[f32], nib: &mut [u8]) -> f32 {
    // Eight lanes, so it vectorises; NaN is passed over as `f32::max` does.
    let mut lanes = [0f32; 8];
    let (k8, k_tail) = k.split_at(k.len() / 8 * 8);
    for c in k8.chunks_exact(8) {
        for i in 0..8 {
            let a = c[i].abs();
            lanes[i] = if a > lanes[i] { a } else { lanes[i] };
        }
    }
    let amax = lanes.iter().chain(k_tail).fold(0f32, |m, x| m.max(x.abs()));
    let scale = if amax.is_finite() && amax > 0.0 {
        amax / LEVEL_MAX
    } else {
        0.0
    };
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    let level = |x: f32| level(x * inv);
    let (pairs, odd) = k.split_at(k.len() / 2 * 2);
    for (byte, p) in nib.iter_mut().zip(pairs.chunks_exact(2)) {
        *byte = level(p[0]) | (level(p[1]) << 4);
    }
    let rest = nib.len().min(pairs.len() / 2);
    if let (Some(&x), Some(byte)) = (odd.first(), nib.get_mut(rest)) {
        *byte = level(x) | ((NIBBLE_ZERO as u8) << 4);
    }
    for byte in nib.iter_mut().skip(k.len().div_ceil(2)) {
        *byte = (NIBBLE_ZERO as u8) | ((NIBBLE_ZERO as u8) << 4);
    }
    scale
}

/// The nibble of `t` (a key channel over its scale): `t` rounded half away from zero, as
/// `f32::round` does, clamped to -8 ..= 7 and offset by 8; NaN gives 8 (zero). Integer
/// steps, not `round`, which is a libm call per element on the baseline x86-64 target (most
/// of the quantizing's time); the same value for every `|t| < 2^23`.
#[inline(always)]
pub(crate) fn level(t: f32) -> u8 {
    let a = t.abs();
    // Saturating: NaN gives 0, and `a - whole` is exact below 2^23.
    let whole = a as i32;
    let mag = whole + i32::from(a - whole as f32 >= 0.5);
    // Branch-free, so the callers' loops vectorise.
    let r = mag * (1 - 2 * i32::from(t < 0.0));
    (r.clamp(-8, LEVEL_MAX as i32) + NIBBLE_ZERO) as u8
}

/// `sum_c q[c] * (nibble(c) - 8)`, the sketch's dot product before its scale.
pub fn nibble_dot(q: &[f32], nib: &[u8]) -> f32 {
    let mut k = vec![0f32; q.len()];
    unpack(nib, &mut k);
    dot(q, &k)
}

/// The levels (`nibble - 8`) of a token's row, as floats, into `out` (one per channel).
fn unpack(nib: &[u8], out: &mut [f32]) {
    for (pair, &b) in out.chunks_mut(2).zip(nib) {
        pair[0] = f32::from(b & 0xf) - NIBBLE_ZERO as f32;
        if let Some(hi) = pair.get_mut(1) {
            *hi = f32::from(b >> 4) - NIBBLE_ZERO as f32;
        }
    }
}

/// `sum a[i] * b[i]` over eight independent lanes (so it vectorises), then their sum. Plain
/// multiply and add: `mul_add` is a libm call on the baseline x86-64 target.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (a8, a_tail) = a.split_at(a.len() / 8 * 8);
    let (b8, b_tail) = b.split_at(a8.len().min(b.len()));
    for (x, y) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    let tail: f32 = a_tail.iter().zip(b_tail).map(|(x, y)| x * y).sum();
    lanes.iter().sum::<f32>() + tail
}

/// Every token's key of (`layer`, `head`) in `block`, `[len][head_dim]` f32 (int8 and fp8
/// scaled back), into `out`; returns `len`.
fn block_keys(
    geom: &BlockGeometry,
    src: &dyn KvSource,
    layer: usize,
    head: usize,
    block: usize,
    rows: &mut [f32],
    out: &mut [f32],
) -> usize {
    let (bs, d, es) = (geom.block_size, geom.head_dim, geom.dtype.size());
    let len = src.num_tokens().saturating_sub(block * bs).min(bs);
    if len == 0 {
        return 0;
    }
    let hb = &src.block(layer, block)[geom.head_range(head)];
    // K is stored transposed: a row per channel.
    for c in 0..d {
        let at = c * bs * es;
        decode_to_f32(
            geom.dtype,
            &hb[at..at + len * es],
            &mut rows[c * bs..c * bs + len],
        );
    }
    let k_scales = geom.dtype.scaled().then(|| geom.scales(hb).0);
    for t in 0..len {
        let s = k_scales.map_or(1.0, |ks| crate::block::scale_at(ks, t));
        for c in 0..d {
            out[t * d + c] = rows[c * bs + t] * s;
        }
    }
    len
}

/// The sketch of tokens `from .. to` of (`layer`, `head`): `nib` gets `to - from` rows of
/// [`nibble_bytes`] bytes, `scales` one scale each. Tokens past `src`'s end are left alone.
#[allow(clippy::too_many_arguments)]
pub fn sketch_tokens(
    geom: &BlockGeometry,
    src: &dyn KvSource,
    layer: usize,
    head: usize,
    from: usize,
    to: usize,
    nib: &mut [u8],
    scales: &mut [f32],
) {
    let (bs, d) = (geom.block_size, geom.head_dim);
    let nb = nibble_bytes(d);
    let to = to.min(src.num_tokens());
    if from >= to {
        return;
    }
    let mut rows = vec![0f32; d * bs];
    let mut keys = vec![0f32; bs * d];
    for block in from / bs..to.div_ceil(bs) {
        let len = block_keys(geom, src, layer, head, block, &mut rows, &mut keys);
        let first = block * bs;
        for t in from.max(first)..to.min(first + len) {
            let i = t - from;
            let k = &keys[(t - first) * d..(t - first + 1) * d];
            scales[i] = quantize_key(k, &mut nib[i * nb..(i + 1) * nb]);
        }
    }
}

/// Each query head's log2-sum-exp2 over the tokens of one block of `temp * scale_t *
/// nibble_dot(q_h, k̂_t)`, into `out[G]`; `-inf` for an empty block.
pub(crate) fn block_lse(
    q_group: &[f32],
    d: usize,
    temp: f32,
    nib: &[u8],
    scales: &[f32],
    out: &mut [f32],
) {
    let nb = nibble_bytes(d);
    let g = out.len();
    // Each token's levels once, then every head's dot product with them.
    let mut acc = vec![0f32; g * scales.len()];
    let mut k = vec![0f32; d];
    for (t, &s) in scales.iter().enumerate() {
        unpack(&nib[t * nb..(t + 1) * nb], &mut k);
        for (h, q) in q_group.chunks_exact(d).enumerate() {
            acc[h * scales.len() + t] = temp * s * dot(q, &k);
        }
    }
    for (o, a) in out.iter_mut().zip(acc.chunks_exact(scales.len().max(1))) {
        *o = log2_sum_exp2(a);
    }
}

/// `log2(sum 2^x)`, exactly (no polynomial): the reference the device is held to.
fn log2_sum_exp2(x: &[f32]) -> f32 {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return m;
    }
    m + x.iter().map(|&v| (v - m).exp2()).sum::<f32>().log2()
}

/// Scores `blocks` of (`layer`, `head`) for the group query `q_group` (`[G][head_dim]`) from
/// the sketch of their keys: each head's share of an attention (softmax scale `scale`) over
/// these blocks' sketched keys, combined over the group as `how` says. Blocks past the tokens
/// `src` holds score as empty (0 share).
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_scores(
    geom: &BlockGeometry,
    src: &dyn KvSource,
    layer: usize,
    head: usize,
    q_group: &[f32],
    scale: f32,
    how: GroupScore,
    blocks: &[usize],
) -> Vec<f32> {
    let (bs, d) = (geom.block_size, geom.head_dim);
    let g = (q_group.len() / d.max(1)).max(1);
    let temp = scale * std::f32::consts::LOG2_E;
    let nb = nibble_bytes(d);
    let one = |(j, out): (usize, &mut [f32])| {
        let b = blocks[j];
        let from = b * bs;
        let to = (from + bs).min(src.num_tokens());
        if to <= from {
            out.fill(f32::NEG_INFINITY);
            return;
        }
        let mut nib = vec![0u8; (to - from) * nb];
        let mut scales = vec![0f32; to - from];
        sketch_tokens(geom, src, layer, head, from, to, &mut nib, &mut scales);
        block_lse(q_group, d, temp, &nib, &scales, out);
    };
    let mut lse = vec![0f32; blocks.len() * g];
    if blocks.len() >= PARALLEL_SELECT_BLOCKS {
        lse.par_chunks_mut(g).enumerate().for_each(one);
    } else {
        lse.chunks_mut(g).enumerate().for_each(one);
    }
    crate::sparq::group_shares(&lse, g, how)
}

/// `block_scores` from a sketch already made: `nib`/`scales` hold tokens `0 ..
/// num_tokens` of one KV head, and every block `0 .. blocks` is scored. What a device holding
/// the sketch computes; the tests hold the two to the same scores.
#[allow(clippy::too_many_arguments)]
pub fn scores_from_sketch(
    nib: &[u8],
    scales: &[f32],
    num_tokens: usize,
    block_size: usize,
    head_dim: usize,
    blocks: usize,
    q_group: &[f32],
    scale: f32,
    how: GroupScore,
) -> Vec<f32> {
    let d = head_dim;
    let g = (q_group.len() / d.max(1)).max(1);
    let nb = nibble_bytes(d);
    let temp = scale * std::f32::consts::LOG2_E;
    let mut lse = vec![f32::NEG_INFINITY; blocks * g];
    for (b, out) in lse.chunks_mut(g).enumerate() {
        let from = b * block_size;
        let to = (from + block_size).min(num_tokens);
        if to > from {
            block_lse(
                q_group,
                d,
                temp,
                &nib[from * nb..to * nb],
                &scales[from..to],
                out,
            );
        }
    }
    crate::sparq::group_shares(&lse, g, how)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::dtype::KvDType;
    use crate::sparq::tests::keys;

    /// Uniform in [-1, 1), from a 64-bit LCG.
    pub(crate) fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn a_query_rounds_to_int8_within_half_a_step() {
        let mut seed = 17;
        for scale in [1e-3f32, 1.0, 3.0e4] {
            let q: Vec<f32> = (0..67).map(|_| scale * lcg(&mut seed)).collect();
            let (step, q8) = round_query_i8(&q).unwrap();
            let amax = q.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert_eq!(step, amax / 127.0);
            // The largest channel takes the whole range; every channel lands within half a
            // step (and a rounding of the reciprocal) of itself.
            assert_eq!(q8.iter().map(|x| x.unsigned_abs()).max(), Some(127));
            for (&x, &r) in q.iter().zip(&q8) {
                assert!(
                    (x - step * f32::from(r)).abs() <= step * 0.5001,
                    "{x} vs {r} x {step}"
                );
            }
        }
        assert_eq!(round_query_i8(&[0.0; 8]), Some((0.0, vec![0; 8])));
        assert_eq!(round_query_i8(&[1.0, f32::NAN]), None);
        assert_eq!(round_query_i8(&[f32::INFINITY, 1.0]), None);
    }

    #[test]
    fn a_group_with_a_broken_channel_is_scored_as_it_is() {
        let mut seed = 5;
        let mut q: Vec<f32> = (0..3 * 16).map(|_| lcg(&mut seed)).collect();
        let rounded = query_as_rounded(&q, 16);
        assert_eq!(rounded.len(), q.len());
        assert!(rounded.iter().zip(&q).any(|(a, b)| a != b));
        for (h, head) in rounded.chunks(16).enumerate() {
            let (step, q8) = round_query_i8(&q[h * 16..(h + 1) * 16]).unwrap();
            let want: Vec<f32> = q8.iter().map(|&x| step * f32::from(x)).collect();
            assert_eq!(head, &want[..]);
        }
        // One NaN anywhere in the group: every head as it is (the scorers take floats).
        q[40] = f32::NAN;
        let same = query_as_rounded(&q, 16);
        assert!(same.iter().zip(&q).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn quantized_keys_are_within_half_a_level() {
        let mut seed = 7;
        for d in [1usize, 7, 64, 128] {
            let k: Vec<f32> = (0..d).map(|_| 3.0 * lcg(&mut seed)).collect();
            let mut nib = vec![0u8; nibble_bytes(d)];
            let s = quantize_key(&k, &mut nib);
            let amax = k.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!((s - amax / 7.0).abs() <= 1e-6 * amax);
            for (c, &x) in k.iter().enumerate() {
                let n = (nib[c / 2] >> (4 * (c % 2))) & 0xf;
                let back = s * (i32::from(n) - NIBBLE_ZERO) as f32;
                assert!(
                    (back - x).abs() <= 0.5 * s + 1e-6,
                    "d {d} c {c}: {x} -> {back}"
                );
            }
            // The dot product is the dequantized key's.
            let q: Vec<f32> = (0..d).map(|_| lcg(&mut seed)).collect();
            let want: f32 = q
                .iter()
                .enumerate()
                .map(|(c, &x)| x * (i32::from((nib[c / 2] >> (4 * (c % 2))) & 0xf) - 8) as f32)
                .sum();
            assert!((nibble_dot(&q, &nib) - want).abs() <= 1e-4);
        }
        let mut nib = [0u8; 2];
        assert_eq!(quantize_key(&[0.0; 4], &mut nib), 0.0);
        assert_eq!(nib, [0x88, 0x88]);
        // A NaN channel (a broken key) counts as 0; the rest keep their scale.
        assert_eq!(quantize_key(&[f32::NAN, 7.0, 0.0, -7.0], &mut nib), 1.0);
        assert_eq!(nib, [0xf8, 0x18]);
    }

    #[test]
    fn levels_round_half_away_from_zero_as_f32_round_does() {
        let want = |t: f32| (t.round().clamp(-8.0, 7.0) as i32 + NIBBLE_ZERO) as u8;
        let mut seed = 5;
        let mut ts: Vec<f32> = (0..100_000).map(|_| 9.0 * lcg(&mut seed)).collect();
        for w in -9..=9 {
            let x = w as f32 + 0.5;
            ts.extend([
                x,
                -x,
                x.next_up(),
                x.next_down(),
                -x.next_up(),
                -x.next_down(),
            ]);
        }
        ts.extend([0.0, -0.0, 7.0, -8.0, 1e-30, -1e-30, 0.49999997, -0.49999997]);
        for t in ts {
            assert_eq!(level(t), want(t), "{t:e}");
        }
        assert_eq!(level(f32::NAN), NIBBLE_ZERO as u8);
    }

    #[test]
    fn scores_from_a_kept_sketch_equal_the_ones_read_from_the_pool() {
        let geom = BlockGeometry {
            block_size: 16,
            num_kv_heads: 1,
            head_dim: 64,
            dtype: KvDType::Bf16,
        };
        let mut seed = 3;
        let n: usize = 16 * 9 + 5;
        let k: Vec<Vec<f32>> = (0..n)
            .map(|_| (0..64).map(|_| lcg(&mut seed)).collect())
            .collect();
        let src = keys(geom, &k);
        let nbk = n.div_ceil(16);
        let q: Vec<f32> = (0..3 * 64).map(|_| 2.0 * lcg(&mut seed)).collect();
        let mut nib = vec![0u8; n * nibble_bytes(64)];
        let mut scales = vec![0f32; n];
        // Two pieces, as a device brings its sketch up to date.
        sketch_tokens(&geom, &src, 0, 0, 0, 40, &mut nib, &mut scales);
        let nb = nibble_bytes(64);
        sketch_tokens(
            &geom,
            &src,
            0,
            0,
            40,
            n,
            &mut nib[40 * nb..],
            &mut scales[40..],
        );
        for how in [GroupScore::Max, GroupScore::Sum] {
            let blocks: Vec<usize> = (0..nbk).collect();
            let read = block_scores(&geom, &src, 0, 0, &q, 0.125, how, &blocks);
            let kept = scores_from_sketch(&nib, &scales, n, 16, 64, nbk, &q, 0.125, how);
            assert_eq!(read, kept);
            let total: f32 = read.iter().sum();
            match how {
                GroupScore::Sum => assert!((total - 3.0).abs() < 1e-4, "{total}"),
                GroupScore::Max => assert!(total >= 1.0 - 1e-4),
            }
        }
    }

    #[test]
    fn the_sketch_ranks_blocks_as_exact_scores_do_when_they_differ_plainly() {
        // One block whose keys line up with the query, the rest noise: the sketch finds it.
        let geom = BlockGeometry {
            block_size: 32,
            num_kv_heads: 1,
            head_dim: 128,
            dtype: KvDType::Bf16,
        };
        let mut seed = 11;
        let q: Vec<f32> = (0..128).map(|_| lcg(&mut seed)).collect();
        let k: Vec<Vec<f32>> = (0..32 * 8)
            .map(|t| {
                (0..128)
                    .map(|c| {
                        let noise = 0.3 * lcg(&mut seed);
                        if t / 32 == 5 { q[c] + noise } else { noise }
                    })
                    .collect()
            })
            .collect();
        let src = keys(geom, &k);
        let s = block_scores(
            &geom,
            &src,
            0,
            0,
            &q,
            1.0 / 128f32.sqrt(),
            GroupScore::Max,
            &(0..8).collect::<Vec<_>>(),
        );
        let best = (0..8).max_by(|&a, &b| s[a].total_cmp(&s[b])).unwrap();
        assert_eq!(best, 5, "{s:?}");
    }
}
