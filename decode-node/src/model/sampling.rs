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
    /// 0 or 1 = off (see [`super::logits::LogitsProcessor`]).
    pub repetition_penalty: f32,
    /// 0 = off.
    pub presence_penalty: f32,
    /// 0 = off.
    pub frequency_penalty: f32,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 0.0,
            seed: 0,
            repetition_penalty: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

/// A request's sampler: parameters plus its random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: Sampling,
    rng: SplitMix,
}

/// True when `temperature` means greedy picks: 0 or less, or not finite.
pub fn greedy_at(temperature: f32) -> bool {
    temperature <= 0.0 || !temperature.is_finite()
}

/// `log_softmax(logits)[token]`, computed stably.
pub fn logprob(logits: &[f32], token: usize) -> f32 {
    logits[token] - log_sum_exp(logits)
}

/// `ln(sum(exp(logits)))`, computed stably: the maximum `m` comes out first and each
/// `exp(x - m)` is summed in f64. Every token of every request pays for it over the whole
/// vocabulary, so the exponential is `exp_le0`, which the compiler vectorises, not libm's
/// f64 `exp` (272 us a token on a 49k vocabulary, 2-core EPYC; about 2% of a SmolLM2 step).
pub fn log_sum_exp(logits: &[f32]) -> f32 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        // All -inf (or empty): no mass anywhere; +inf: infinite mass. NaN logits are skipped
        // by `max` but reach the sum below.
        return if logits.iter().any(|x| x.is_nan()) {
            f32::NAN
        } else {
            m
        };
    }
    const LANES: usize = 8;
    let mut acc = [0f64; LANES];
    let chunks = logits.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            acc[i] += f64::from(exp_le0(c[i] - m));
        }
    }
    let sum = acc.iter().sum::<f64>() + rest.iter().map(|x| f64::from(exp_le0(x - m))).sum::<f64>();
    m + sum.ln() as f32
}

/// `e^x` for `x <= 0` (and NaN) as `2^(x log2 e)`: an integer power times `2^f` for
/// `|f| <= 1/2`, the latter a degree-6 polynomial (Cephes' `exp2f` coefficients, as in the
/// attention kernels). Relative error below `2e-7 + 1e-7 |x|` (the rounding of `x log2 e`
/// grows with `x`, where the terms weigh least). Written without calls or branches so a loop
/// over it vectorises; below 2^-126 it gives 2^-126, which no sum that includes the
/// maximum's 1 can see.
#[inline(always)]
pub(crate) fn exp_le0(x: f32) -> f32 {
    let t = x * std::f32::consts::LOG2_E;
    // A comparison with NaN is false: NaN passes through to the polynomial.
    let t = if t < -126.0 { -126.0 } else { t };
    // Round to nearest by the 1.5 * 2^23 trick (`round` is a call on baseline x86-64): the
    // sum's low mantissa bits are then the integer itself, read without a conversion.
    const MAGIC: f32 = 12_582_912.0;
    let shifted = t + MAGIC;
    let n = shifted - MAGIC;
    let f = t - n;
    let ni = shifted.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    // Multiply and add, not `mul_add`: without FMA in the target that is a libm call.
    let mut p = 1.535_336_2e-4_f32;
    p = p * f + 1.339_887_4e-3;
    p = p * f + 9.618_437e-3;
    p = p * f + 5.550_332_5e-2;
    p = p * f + 2.402_264_8e-1;
    p = p * f + 6.931_472e-1;
    p = p * f + 1.0;
    p * f32::from_bits(((ni + 127) as u32) << 23)
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
        let tok = self.pick(logits);
        (tok, logprob(logits, tok as usize))
    }

    /// Picks the next token from `logits` (greedy or by the request's draw).
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        let draw = self.draw();
        self.pick_drawn(logits, draw)
    }

    /// The request's parameters.
    pub fn params(&self) -> &Sampling {
        &self.params
    }

    /// True when picks are the argmax (no draw).
    pub fn is_greedy(&self) -> bool {
        greedy_at(self.params.temperature)
    }

    /// The uniform draw in [0, 1) the next pick uses, taken from the request's stream; `None`
    /// when picks are greedy. A step draws before its logits exist, so a device that picks
    /// the token itself picks what [`Sampler::pick_drawn`] would.
    pub fn draw(&mut self) -> Option<f64> {
        (!self.is_greedy()).then(|| self.rng.next_f64())
    }

    /// Picks from `logits` with `draw` from [`Sampler::draw`] (`None`: greedy).
    pub fn pick_drawn(&self, logits: &[f32], draw: Option<f64>) -> u32 {
        match draw {
            Some(r) if !self.is_greedy() => self.sample_tempered(logits, r) as u32,
            _ => argmax(logits) as u32,
        }
    }

    /// Temperature, top-k and top-p sampling. Walks the tokens from the most likely down
    /// until the random draw falls in one; only the head of that order is sorted (the best
    /// [`SORTED_HEAD`] by partial selection), the whole vocabulary only when the draw or the
    /// nucleus reaches past it (rare: the head holds nearly all the mass of a trained
    /// model). Same tokens as a full sort for the same seed.
    fn sample_tempered(&self, logits: &[f32], r: f64) -> usize {
        let p = self.params;
        let n = logits.len();
        debug_assert!(n > 0, "an empty vocabulary");
        // Equal logits go lower id first, so the order (and with it the pick for a draw) is one
        // thing, not whatever an unstable sort left.
        let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weight = |i: usize| (((logits[i] - m) / p.temperature) as f64).exp();
        let keep = if p.top_k > 0 { p.top_k.min(n) } else { n };
        let mut idx: Vec<usize> = (0..n).collect();
        let head = keep.min(SORTED_HEAD);
        if head < n {
            idx.select_nth_unstable_by(head - 1, by_logit);
        }
        idx[..head].sort_unstable_by(by_logit);
        // The mass the draw is scaled by: the top-k's, or everything's.
        let total: f64 = if keep < n {
            if keep > head {
                idx[head..].select_nth_unstable_by(keep - head - 1, by_logit);
            }
            idx[..keep].iter().map(|&i| weight(i)).sum()
        } else {
            (0..n).map(weight).sum()
        };
        let nucleus = p.top_p > 0.0 && p.top_p < 1.0;
        // Walks `order` (sorted, most likely first) and returns the pick, or None when the
        // draw or the nucleus needs tokens past its end.
        let walk = |order: &[usize], r: f64| -> Option<usize> {
            let mut acc = 0.0;
            let mut kept = 0.0;
            // The nucleus: the shortest prefix whose mass reaches top_p.
            let mut len = order.len();
            if nucleus {
                len = order.iter().position(|&i| {
                    acc += weight(i) / total;
                    acc >= p.top_p as f64
                })? + 1;
                kept = order[..len].iter().map(|&i| weight(i)).sum();
            }
            let mut r = if nucleus { r * kept } else { r * total };
            for &i in &order[..len] {
                let w = weight(i);
                if r < w {
                    return Some(i);
                }
                r -= w;
            }
            // Past the end of the nucleus (rounding) the last token is the pick; past the
            // end of a head, the rest of the order is needed.
            (nucleus || len == keep).then(|| order[len - 1])
        };
        if let Some(t) = walk(&idx[..head], r) {
            return t;
        }
        idx[..keep].sort_unstable_by(by_logit);
        walk(&idx[..keep], r).unwrap_or(idx[keep - 1])
    }
}

/// Tokens sorted by partial selection before sampling walks them (see
/// `Sampler::sample_tempered`); a device that samples sorts as many.
pub const SORTED_HEAD: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorised log-sum-exp against f64 `exp` and `ln`, on vocabularies of odd length,
    /// wide and narrow spreads, -inf entries, and the special cases.
    #[test]
    fn log_sum_exp_matches_f64() {
        let reference = |l: &[f32]| -> f64 {
            let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            m + l.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
        };
        let mut rng = SplitMix(7);
        for (len, spread) in [(1, 1.0), (7, 3.0), (49_155, 30.0), (1000, 1e4), (333, 0.01)] {
            let mut l: Vec<f32> = (0..len)
                .map(|_| (rng.next_f64() as f32 - 0.5) * spread)
                .collect();
            if len > 10 {
                l[3] = f32::NEG_INFINITY;
            }
            let (got, want) = (log_sum_exp(&l) as f64, reference(&l));
            assert!(
                (got - want).abs() <= 2e-6 * want.abs().max(1.0),
                "len {len} spread {spread}: {got} vs {want}"
            );
        }
        // e^x itself, from 0 down past f32's normal range.
        for i in 0..2000 {
            let x = -(i as f32) * 0.05;
            let (got, want) = (exp_le0(x) as f64, (x as f64).exp());
            assert!(
                (got - want).abs() <= (2e-7 + 1e-7 * x.abs() as f64) * want + 1e-37,
                "exp({x}) = {got} vs {want}"
            );
        }
        assert!(log_sum_exp(&[1.0, f32::NAN, 0.5]).is_nan());
        assert_eq!(log_sum_exp(&[f32::NEG_INFINITY; 3]), f32::NEG_INFINITY);
        assert_eq!(log_sum_exp(&[0.0, f32::INFINITY]), f32::INFINITY);
        assert_eq!(log_sum_exp(&[]), f32::NEG_INFINITY);
    }

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
            ..Sampling::default()
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
            ..Sampling::default()
        });
        assert_eq!(nucleus.sample(&logits).0, 1);
        let lp = logprob(&logits, 1);
        assert!(lp < 0.0 && lp > -1.0);
    }

    /// The sampler as it was before partial selection: the whole vocabulary sorted (equal
    /// logits lower id first).
    fn full_sort_pick(p: Sampling, logits: &[f32], r: f64) -> usize {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_unstable_by(|a, b| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b)));
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
        let mut r = r * total;
        for (j, x) in w.iter().enumerate() {
            if r < *x {
                return idx[j];
            }
            r -= x;
        }
        idx[idx.len() - 1]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 300,
            rng_seed: proptest::test_runner::RngSeed::Fixed(21),
            ..proptest::prelude::ProptestConfig::default()
        })]
        /// Partial selection picks what a full sort picks, for the same draw: flat and
        /// peaked vocabularies larger and smaller than the sorted head, every mix of
        /// top-k and top-p.
        #[test]
        fn partial_selection_picks_what_a_full_sort_picks(
            n in 1usize..2000,
            seed in 0u64..1000,
            spread in 0.1f32..30.0,
            temperature in 0.05f32..3.0,
            top_k in proptest::prop_oneof![proptest::strategy::Just(0usize), 1usize..600],
            top_p in proptest::prop_oneof![proptest::strategy::Just(0.0f32), 0.01f32..1.0],
        ) {
            let mut g = SplitMix(seed);
            let logits: Vec<f32> = (0..n).map(|_| (g.next_f64() as f32 - 0.5) * spread).collect();
            let p = Sampling { temperature, top_k, top_p, seed, ..Sampling::default() };
            let mut s = Sampler::new(p);
            for _ in 0..4 {
                // The draw the sampler is about to make.
                let r = s.rng.clone().next_f64();
                let want = full_sort_pick(p, &logits, r);
                let (got, _) = s.sample(&logits);
                proptest::prop_assert_eq!(got as usize, want);
            }
        }
    }
}
