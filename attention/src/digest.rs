//! Quest block digests: channel-wise min and max of post-RoPE K over a block.

/// Digest of one KV head's keys in one block.
#[derive(Debug, Clone, PartialEq)]
pub struct Digest {
    /// `[head_dim]` channel-wise minimum.
    pub min: Vec<f32>,
    /// `[head_dim]` channel-wise maximum.
    pub max: Vec<f32>,
}

impl Digest {
    /// A digest of no keys (min = +inf, max = -inf).
    pub fn new(head_dim: usize) -> Self {
        Self {
            min: vec![f32::INFINITY; head_dim],
            max: vec![f32::NEG_INFINITY; head_dim],
        }
    }

    /// Folds one key into the digest.
    pub fn update(&mut self, k: &[f32]) {
        for ((lo, hi), x) in self.min.iter_mut().zip(self.max.iter_mut()).zip(k) {
            *lo = lo.min(*x);
            *hi = hi.max(*x);
        }
    }

    /// Quest's upper bound on `q·k` over the block, summed over a GQA group's query heads:
    /// `sum_g sum_d max(q_gd·min_d, q_gd·max_d)`. Unscaled, in f32.
    pub fn score(&self, q_group: &[f32]) -> f32 {
        let d = self.min.len();
        let mut s = 0f32;
        for q in q_group.chunks_exact(d) {
            for ((qd, lo), hi) in q.iter().zip(&self.min).zip(&self.max) {
                s += (qd * lo).max(qd * hi);
            }
        }
        s
    }
}

/// The digests of one (layer, KV head), flat: `[block][head_dim]` minima, then maxima. Built
/// by the ingest as chunks arrive and handed to the attention state as they are (no per-block
/// allocation, no copy at admission); scoring every block streams two contiguous arrays.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeadDigests {
    min: Vec<f32>,
    max: Vec<f32>,
    d: usize,
}

impl HeadDigests {
    /// `blocks` digests of no keys (min = +inf, max = -inf).
    pub fn new(blocks: usize, head_dim: usize) -> Self {
        Self {
            min: vec![f32::INFINITY; blocks * head_dim],
            max: vec![f32::NEG_INFINITY; blocks * head_dim],
            d: head_dim,
        }
    }

    /// Blocks.
    pub fn len(&self) -> usize {
        self.min.len() / self.d.max(1)
    }

    /// Whether there are no blocks.
    pub fn is_empty(&self) -> bool {
        self.min.is_empty()
    }

    /// Appends a digest of no keys.
    pub fn push_empty(&mut self) {
        self.min.extend(std::iter::repeat_n(f32::INFINITY, self.d));
        self.max
            .extend(std::iter::repeat_n(f32::NEG_INFINITY, self.d));
    }

    /// Folds one key into block `b`'s digest.
    pub fn update(&mut self, b: usize, k: &[f32]) {
        let (min, max) = self.block_mut(b);
        for ((lo, hi), x) in min.iter_mut().zip(max.iter_mut()).zip(k) {
            *lo = lo.min(*x);
            *hi = hi.max(*x);
        }
    }

    /// Block `b`'s (minima, maxima).
    pub fn block(&self, b: usize) -> (&[f32], &[f32]) {
        let r = b * self.d..(b + 1) * self.d;
        (&self.min[r.clone()], &self.max[r])
    }

    /// Block `b`'s (minima, maxima), to fold keys into.
    pub fn block_mut(&mut self, b: usize) -> (&mut [f32], &mut [f32]) {
        let r = b * self.d..(b + 1) * self.d;
        (&mut self.min[r.clone()], &mut self.max[r])
    }

    /// Block `b`'s Quest score for a folded group query.
    pub fn score(&self, gq: &GroupQuery, b: usize) -> f32 {
        let (min, max) = self.block(b);
        gq.score_raw(min, max)
    }
}

/// How a GQA group's query heads combine into one block score.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GroupScore {
    /// The sum of the heads' Quest bounds (one folded dot product per block).
    #[default]
    Sum,
    /// The largest of the heads' bounds: a block one head needs is not outvoted by the
    /// others (G dot products per block).
    Max,
}

impl GroupScore {
    /// Parses `sum` or `max`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "sum" => Some(Self::Sum),
            "max" => Some(Self::Max),
            _ => None,
        }
    }
}

/// A GQA group's query prepared once for scoring many digests.
///
/// `sum_g max(q_gd·min_d, q_gd·max_d)` takes `q_gd·max_d` for positive `q_gd` and `q_gd·min_d`
/// otherwise, so it equals `max_d·pos_d + min_d·neg_d` with `pos_d` (`neg_d`) the sum of the
/// group's positive (negative) `q_gd`: one dot product of `2·head_dim` per block instead of
/// `2·G·head_dim` products, whatever the group size. For [`GroupScore::Max`] each head keeps
/// its own `pos`/`neg` and the block's score is the largest head's.
#[derive(Debug, Clone)]
pub struct GroupQuery {
    /// `[heads][head_dim]`: one row when folded (sum), one per query head (max).
    pos: Vec<f32>,
    neg: Vec<f32>,
    d: usize,
}

impl GroupQuery {
    /// Folds `q_group` (`[G][head_dim]`) for [`GroupScore::Sum`].
    pub fn new(q_group: &[f32], head_dim: usize) -> Self {
        Self::with(q_group, head_dim, GroupScore::Sum)
    }

    /// Prepares `q_group` (`[G][head_dim]`) for `how`.
    pub fn with(q_group: &[f32], head_dim: usize, how: GroupScore) -> Self {
        let rows = match how {
            GroupScore::Sum => 1,
            GroupScore::Max => (q_group.len() / head_dim.max(1)).max(1),
        };
        let mut pos = vec![0f32; rows * head_dim];
        let mut neg = vec![0f32; rows * head_dim];
        for (i, q) in q_group.chunks_exact(head_dim).enumerate() {
            let r = if rows == 1 { 0 } else { i };
            let (p, n) = (
                &mut pos[r * head_dim..(r + 1) * head_dim],
                &mut neg[r * head_dim..(r + 1) * head_dim],
            );
            for ((p, n), x) in p.iter_mut().zip(n.iter_mut()).zip(q) {
                if *x > 0.0 {
                    *p += x;
                } else {
                    *n += x;
                }
            }
        }
        Self {
            pos,
            neg,
            d: head_dim,
        }
    }

    /// The group's Quest score of `d` (as [`Digest::score`], up to rounding, for a sum).
    pub fn score(&self, d: &Digest) -> f32 {
        self.score_raw(&d.min, &d.max)
    }

    /// As [`GroupQuery::score`], for a digest given as its minima and maxima.
    pub fn score_raw(&self, min: &[f32], max: &[f32]) -> f32 {
        let d = self.d.max(1);
        #[cfg(target_arch = "x86_64")]
        if let Some(s) = rows_bound(&self.pos, &self.neg, d, min, max) {
            return s;
        }
        self.pos
            .chunks_exact(d)
            .zip(self.neg.chunks_exact(d))
            .map(|(p, n)| bound(p, n, min, max))
            .fold(f32::NEG_INFINITY, f32::max)
    }
}

/// [`GroupQuery::score_raw`] in one pass over the digest for all of a group's rows (at most
/// 8), with AVX2: each chunk of minima and maxima is loaded once for every row, and each row
/// keeps two independent accumulators. `None` where the CPU lacks AVX2 or the shapes do not
/// fit (the portable path then scores).
#[cfg(target_arch = "x86_64")]
fn rows_bound(pos: &[f32], neg: &[f32], d: usize, min: &[f32], max: &[f32]) -> Option<f32> {
    let rows = pos.len() / d;
    let fits = (1..=8).contains(&rows)
        && pos.len() == rows * d
        && neg.len() == pos.len()
        && min.len() >= d
        && max.len() >= d;
    if !fits || !crate::kernel_avx2::available() {
        return None;
    }
    // SAFETY: AVX2 and FMA are present (checked above); the slices hold `rows * d` and `d`
    // floats (checked above), which is all the kernel reads.
    Some(unsafe {
        match rows {
            1 => rows_bound_avx2::<1>(pos, neg, d, min, max),
            2 => rows_bound_avx2::<2>(pos, neg, d, min, max),
            3 => rows_bound_avx2::<3>(pos, neg, d, min, max),
            4 => rows_bound_avx2::<4>(pos, neg, d, min, max),
            5 => rows_bound_avx2::<5>(pos, neg, d, min, max),
            6 => rows_bound_avx2::<6>(pos, neg, d, min, max),
            7 => rows_bound_avx2::<7>(pos, neg, d, min, max),
            _ => rows_bound_avx2::<8>(pos, neg, d, min, max),
        }
    })
}

/// The largest of `R` rows' `sum_d pos_rd·max_d + neg_rd·min_d`.
///
/// # Safety
/// AVX2 and FMA must be present; `pos` and `neg` hold at least `R * d` floats, `min` and `max`
/// at least `d`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_bound_avx2<const R: usize>(
    pos: &[f32],
    neg: &[f32],
    d: usize,
    min: &[f32],
    max: &[f32],
) -> f32 {
    use std::arch::x86_64::*;
    let mut ap = [_mm256_setzero_ps(); R];
    let mut an = [_mm256_setzero_ps(); R];
    let whole = d / 8 * 8;
    let (p, n) = (pos.as_ptr(), neg.as_ptr());
    for o in (0..whole).step_by(8) {
        // SAFETY: o + 8 <= d and r * d + o + 8 <= R * d: inside the caller's slices.
        unsafe {
            let hi = _mm256_loadu_ps(max.as_ptr().add(o));
            let lo = _mm256_loadu_ps(min.as_ptr().add(o));
            for r in 0..R {
                ap[r] = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(r * d + o)), hi, ap[r]);
                an[r] = _mm256_fmadd_ps(_mm256_loadu_ps(n.add(r * d + o)), lo, an[r]);
            }
        }
    }
    let mut best = f32::NEG_INFINITY;
    for r in 0..R {
        let mut s = crate::avx2::hsum(_mm256_add_ps(ap[r], an[r]));
        for i in whole..d {
            s += pos[r * d + i] * max[i] + neg[r * d + i] * min[i];
        }
        best = best.max(s);
    }
    best
}

/// `sum_d pos_d·max_d + neg_d·min_d`.
fn bound(pos: &[f32], neg: &[f32], min: &[f32], max: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::kernel_avx2::available() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        return unsafe { bound_avx2(pos, neg, min, max) };
    }
    bound_body(pos, neg, min, max)
}

/// [`bound_body`] compiled for AVX2: selection scores every block of every head with it, on
/// the step thread's critical path when a device waits for the selection.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn bound_avx2(pos: &[f32], neg: &[f32], min: &[f32], max: &[f32]) -> f32 {
    bound_body(pos, neg, min, max)
}

#[inline(always)]
fn bound_body(pos: &[f32], neg: &[f32], min: &[f32], max: &[f32]) -> f32 {
    // 32 independent accumulators: four vectors' worth, so the adds of one chunk do not wait
    // on the previous chunk's (one accumulator vector was latency-bound at a quarter of the
    // adder's throughput). Independent lanes also vectorise without reassociation flags.
    const W: usize = 32;
    let mut acc = [0f32; W];
    let chunks = pos
        .chunks_exact(W)
        .zip(neg.chunks_exact(W))
        .zip(max.chunks_exact(W).zip(min.chunks_exact(W)));
    for ((p, n), (hi, lo)) in chunks {
        for i in 0..W {
            acc[i] += p[i] * hi[i] + n[i] * lo[i];
        }
    }
    let tail = pos.len() / W * W;
    // A tree, not `iter().sum()`: its 32 dependent scalar adds cost more than the loop.
    let mut v = [0f32; 8];
    for i in 0..8 {
        v[i] = (acc[i] + acc[i + 8]) + (acc[i + 16] + acc[i + 24]);
    }
    let v4 = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
    let mut s = (v4[0] + v4[2]) + (v4[1] + v4[3]);
    for i in tail..pos.len() {
        s += pos[i] * max[i] + neg[i] * min[i];
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values in [-1, 1] from a xorshift generator seeded with `r`.
    fn uniform(mut r: u64) -> impl FnMut() -> f32 {
        move || {
            r ^= r << 13;
            r ^= r >> 7;
            r ^= r << 17;
            (r % 2001) as f32 / 1000.0 - 1.0
        }
    }

    #[test]
    fn folded_group_query_scores_like_the_definition() {
        let mut next = uniform(0x1234_5678);
        for (g, d) in [(1, 64), (5, 128), (8, 12), (3, 7)] {
            let mut dg = Digest::new(d);
            for _ in 0..9 {
                let k: Vec<f32> = (0..d).map(|_| next()).collect();
                dg.update(&k);
            }
            let q: Vec<f32> = (0..g * d).map(|_| next()).collect();
            let (want, got) = (dg.score(&q), GroupQuery::new(&q, d).score(&dg));
            assert!(
                (want - got).abs() <= 1e-5 * want.abs().max(1.0),
                "{g} {d}: {want} {got}"
            );
        }
    }

    #[test]
    fn max_group_score_matches_each_heads_definition_at_every_width() {
        let mut next = uniform(0x9e37_79b9);
        // Widths with and without a tail past the 8-wide chunks; 9 rows take the portable path.
        for (g, d) in [(1, 64), (5, 128), (8, 12), (3, 7), (9, 16)] {
            let mut dg = Digest::new(d);
            for _ in 0..5 {
                let k: Vec<f32> = (0..d).map(|_| next()).collect();
                dg.update(&k);
            }
            let q: Vec<f32> = (0..g * d).map(|_| next()).collect();
            let want = q
                .chunks_exact(d)
                .map(|h| dg.score(h))
                .fold(f32::NEG_INFINITY, f32::max);
            let got = GroupQuery::with(&q, d, GroupScore::Max).score(&dg);
            assert!(
                (want - got).abs() <= 1e-5 * want.abs().max(1.0),
                "{g} {d}: {want} {got}"
            );
        }
    }

    #[test]
    fn max_group_score_is_the_largest_heads_bound() {
        let mut dg = Digest::new(2);
        dg.update(&[1.0, -2.0]);
        dg.update(&[0.5, 3.0]);
        let (h0, h1) = ([1.0f32, 0.0], [0.0f32, -1.0]);
        let q = [h0, h1].concat();
        let want = dg.score(&h0).max(dg.score(&h1));
        assert_eq!(GroupQuery::with(&q, 2, GroupScore::Max).score(&dg), want);
        assert_eq!(
            GroupQuery::with(&q, 2, GroupScore::Sum).score(&dg),
            dg.score(&q)
        );
    }

    #[test]
    fn score_bounds_every_key() {
        let keys = [[1.0f32, -2.0], [0.5, 3.0], [-1.0, 0.0]];
        let mut dg = Digest::new(2);
        keys.iter().for_each(|k| dg.update(k));
        assert_eq!(dg.min, vec![-1.0, -2.0]);
        assert_eq!(dg.max, vec![1.0, 3.0]);
        let q = [0.7f32, -0.4];
        let best = keys
            .iter()
            .map(|k| q[0] * k[0] + q[1] * k[1])
            .fold(f32::MIN, f32::max);
        assert!(dg.score(&q) >= best);
    }
}
