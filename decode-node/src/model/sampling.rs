//! Token sampling: greedy, temperature, top-k, top-p; seeded per request.

use super::random::SplitMix;

/// Sampling parameters of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 0 or >= 1 = off.
    pub top_p: f32,
    /// Seed.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 0.0,
            seed: 0,
        }
    }
}

/// A request's sampler: parameters plus its random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: Sampling,
    rng: SplitMix,
}

/// `log_softmax(logits)[token]`, computed stably.
pub fn logprob(logits: &[f32], token: usize) -> f32 {
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|x| ((x - m) as f64).exp()).sum();
    (logits[token] - m) - sum.ln() as f32
}

/// Index of the largest logit (the first on ties, like `torch.argmax`).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, x) in logits.iter().enumerate() {
        if *x > logits[best] {
            best = i;
        }
    }
    best
}

impl Sampler {
    /// A sampler seeded from the request's seed.
    pub fn new(params: Sampling) -> Self {
        Self {
            params,
            rng: SplitMix(params.seed ^ 0x5EED),
        }
    }

    /// Picks the next token from `logits`; returns it and its log-probability under the model.
    pub fn sample(&mut self, logits: &[f32]) -> (u32, f32) {
        let p = self.params;
        let tok = if p.temperature <= 0.0 || !p.temperature.is_finite() {
            argmax(logits)
        } else {
            let mut idx: Vec<usize> = (0..logits.len()).collect();
            idx.sort_unstable_by(|a, b| logits[*b].total_cmp(&logits[*a]));
            if p.top_k > 0 {
                idx.truncate(p.top_k);
            }
            let m = logits[idx[0]];
            let mut w: Vec<f64> = idx
                .iter()
                .map(|i| (((logits[*i] - m) / p.temperature) as f64).exp())
                .collect();
            let total: f64 = w.iter().sum();
            if p.top_p > 0.0 && p.top_p < 1.0 {
                let mut acc = 0.0;
                let mut keep = w.len();
                for (j, x) in w.iter().enumerate() {
                    acc += x / total;
                    if acc >= p.top_p as f64 {
                        keep = j + 1;
                        break;
                    }
                }
                w.truncate(keep);
                idx.truncate(keep);
            }
            let total: f64 = w.iter().sum();
            let mut r = self.rng.next_f64() * total;
            let mut pick = idx[idx.len() - 1];
            for (j, x) in w.iter().enumerate() {
                if r < *x {
                    pick = idx[j];
                    break;
                }
                r -= x;
            }
            pick
        };
        (tok as u32, logprob(logits, tok))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_seeded_sampling() {
        let logits = [0.1, 2.0, 1.9, -1.0];
        let mut g = Sampler::new(Sampling::default());
        assert_eq!(g.sample(&logits).0, 1);
        let p = Sampling {
            temperature: 1.0,
            top_k: 2,
            top_p: 0.0,
            seed: 9,
        };
        let a: Vec<u32> = (0..50)
            .map({
                let mut s = Sampler::new(p);
                move |_| s.sample(&logits).0
            })
            .collect();
        let b: Vec<u32> = (0..50)
            .map({
                let mut s = Sampler::new(p);
                move |_| s.sample(&logits).0
            })
            .collect();
        assert_eq!(a, b, "same seed, same tokens");
        assert!(a.iter().all(|t| *t == 1 || *t == 2), "top-k 2");
        assert!(a.contains(&1) && a.contains(&2));
        let mut nucleus = Sampler::new(Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.01,
            seed: 1,
        });
        assert_eq!(nucleus.sample(&logits).0, 1);
        let lp = logprob(&logits, 1);
        assert!(lp < 0.0 && lp > -1.0);
    }
}
