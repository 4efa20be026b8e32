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

#[cfg(test)]
mod tests {
    use super::*;

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
