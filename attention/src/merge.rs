//! Exact merge of partial attention results with log-sum-exp, in base 2.
//!
//! One base in the whole crate: every score is pre-scaled by `log2(e)` so the kernels
//! use `exp2`, and a partial's normaliser is `lse2 = log2(sum_j 2^(s_j))`. Mixing base-2 and
//! natural-log partials has shipped as a bug in vLLM and SGLang; the field name says which.

/// Attention over a subset of keys for `num_heads` query heads of dimension `head_dim`.
///
/// `out` is already normalised by its own softmax denominator; an empty partial has
/// `lse2 = -inf` and is a no-op in [`Partial::merge_from`].
#[derive(Debug, Clone, PartialEq)]
pub struct Partial {
    /// `[num_heads][head_dim]` normalised outputs.
    pub out: Vec<f32>,
    /// `[num_heads]` base-2 log of each head's softmax denominator.
    pub lse2: Vec<f32>,
    /// Query heads.
    pub num_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
}

impl Partial {
    /// A partial over no keys.
    pub fn empty(num_heads: usize, head_dim: usize) -> Self {
        Self {
            out: vec![0.0; num_heads * head_dim],
            lse2: vec![f32::NEG_INFINITY; num_heads],
            num_heads,
            head_dim,
        }
    }

    /// True when no head has seen a key.
    pub fn is_empty(&self) -> bool {
        self.lse2.iter().all(|l| *l == f32::NEG_INFINITY)
    }

    /// Merges `other` into `self`: the result equals attention over the union of both
    /// key sets (they must be disjoint).
    pub fn merge_from(&mut self, other: &Partial) {
        debug_assert_eq!(self.num_heads, other.num_heads);
        debug_assert_eq!(self.head_dim, other.head_dim);
        let d = self.head_dim;
        for h in 0..self.num_heads {
            let (la, lb) = (self.lse2[h], other.lse2[h]);
            if lb == f32::NEG_INFINITY {
                continue;
            }
            let out = &mut self.out[h * d..(h + 1) * d];
            let ob = &other.out[h * d..(h + 1) * d];
            if la == f32::NEG_INFINITY {
                out.copy_from_slice(ob);
                self.lse2[h] = lb;
                continue;
            }
            let m = la.max(lb);
            let wa = (la - m).exp2();
            let wb = (lb - m).exp2();
            let total = wa + wb;
            let (wa, wb) = (wa / total, wb / total);
            for (o, b) in out.iter_mut().zip(ob) {
                *o = *o * wa + *b * wb;
            }
            self.lse2[h] = m + total.log2();
        }
    }

    /// Attention of each query head of a group (`q_group`, `[G][head_dim]`) over one key: the
    /// token being decoded attends to itself, and this partial merges like any other.
    pub fn of_one_key(q_group: &[f32], k: &[f32], v: &[f32], scale: f32) -> Self {
        let d = k.len();
        let g = q_group.len() / d.max(1);
        let mut p = Self::empty(g, d);
        for h in 0..g {
            let s: f32 = q_group[h * d..(h + 1) * d]
                .iter()
                .zip(k)
                .map(|(a, b)| a * b)
                .sum::<f32>()
                * scale;
            p.out[h * d..(h + 1) * d].copy_from_slice(v);
            p.lse2[h] = s * std::f32::consts::LOG2_E;
        }
        p
    }

    /// Output of head `h`.
    pub fn head(&self, h: usize) -> &[f32] {
        &self.out[h * self.head_dim..(h + 1) * self.head_dim]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Dense softmax attention of one head in f64, base e: the reference.
    fn dense(q: &[f32], keys: &[Vec<f32>], vals: &[Vec<f32>], scale: f32) -> (Vec<f64>, f64) {
        let s: Vec<f64> = keys
            .iter()
            .map(|k| {
                q.iter()
                    .zip(k)
                    .map(|(a, b)| (*a as f64) * (*b as f64))
                    .sum::<f64>()
                    * scale as f64
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let l: f64 = w.iter().sum();
        let mut o = vec![0f64; q.len()];
        for (wi, v) in w.iter().zip(vals) {
            for (oi, vi) in o.iter_mut().zip(v) {
                *oi += wi * *vi as f64 / l;
            }
        }
        (o, m + l.ln())
    }

    fn partial_of(q: &[f32], keys: &[Vec<f32>], vals: &[Vec<f32>], scale: f32) -> Partial {
        if keys.is_empty() {
            return Partial::empty(1, q.len());
        }
        let (o, lse) = dense(q, keys, vals, scale);
        Partial {
            out: o.iter().map(|x| *x as f32).collect(),
            lse2: vec![(lse * std::f64::consts::LOG2_E) as f32],
            num_heads: 1,
            head_dim: q.len(),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, rng_seed: proptest::test_runner::RngSeed::Fixed(7), ..ProptestConfig::default() })]
        /// Merging the partials of any partition of the keys equals full softmax attention.
        #[test]
        fn merge_of_any_partition_equals_full(
            n in 1usize..40,
            d in 1usize..9,
            seed in any::<u64>(),
            parts in proptest::collection::vec(0usize..4, 40),
        ) {
            let mut rng = seed;
            let mut next = || { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; ((rng >> 11) as f64 / (1u64 << 53) as f64) as f32 * 6.0 - 3.0 };
            let q: Vec<f32> = (0..d).map(|_| next()).collect();
            let keys: Vec<Vec<f32>> = (0..n).map(|_| (0..d).map(|_| next()).collect()).collect();
            let vals: Vec<Vec<f32>> = (0..n).map(|_| (0..d).map(|_| next()).collect()).collect();
            let (full, full_lse) = dense(&q, &keys, &vals, 0.5);
            let mut acc = Partial::empty(1, d);
            for p in 0..4 {
                let idx: Vec<usize> = (0..n).filter(|i| parts[*i] == p).collect();
                let ks: Vec<_> = idx.iter().map(|i| keys[*i].clone()).collect();
                let vs: Vec<_> = idx.iter().map(|i| vals[*i].clone()).collect();
                acc.merge_from(&partial_of(&q, &ks, &vs, 0.5));
            }
            for (a, b) in acc.out.iter().zip(&full) {
                prop_assert!((*a as f64 - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
            }
            let lse = acc.lse2[0] as f64 / std::f64::consts::LOG2_E;
            prop_assert!((lse - full_lse).abs() <= 1e-5 * full_lse.abs().max(1.0));
        }
    }

    #[test]
    fn empty_partial_is_a_no_op_both_ways() {
        let p = Partial {
            out: vec![1.0, 2.0],
            lse2: vec![3.0],
            num_heads: 1,
            head_dim: 2,
        };
        let mut a = p.clone();
        a.merge_from(&Partial::empty(1, 2));
        assert_eq!(a, p);
        let mut b = Partial::empty(1, 2);
        b.merge_from(&p);
        assert_eq!(b, p);
        let mut e = Partial::empty(1, 2);
        e.merge_from(&Partial::empty(1, 2));
        assert!(e.is_empty());
        assert!(e.out.iter().all(|x| x.is_finite()));
    }
}
