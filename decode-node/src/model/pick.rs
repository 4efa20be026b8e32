//! Picking a step's tokens where the logits are (#21 item 2): a device backend that keeps the
//! LM head's output in device memory picks each row's token there and sends back a few words
//! (token, log-probability, the most likely tokens) instead of the whole vocabulary's logits.
//!
//! [`pick_row`] is the definition the device must meet: for the same draw it picks what the
//! host path picks ([`Sampler::pick_drawn`], [`logprob`], [`top_logprobs`]). Where that needs
//! more than the most likely [`SORTED_HEAD`] tokens, or the row holds a non-finite logit (the
//! host reports it), there is no device pick and the row's logits come back instead.

use super::logits::top_logprobs;
use super::sampling::{SORTED_HEAD, Sampler, greedy_at, logprob};

/// Most `top_logprobs` a device pick reports (OpenAI's limit, as the service enforces).
pub const PICK_TOP: usize = 20;

/// What a backend needs to pick one row's token itself: the request's sampling with no
/// penalty and no banned token (those rows come back as logits), and its draw for this step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PickSpec {
    /// 0 (or not finite) = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 0 or >= 1 = off.
    pub top_p: f32,
    /// The draw in [0, 1) ([`Sampler::draw`]); `None` = greedy.
    pub draw: Option<f64>,
    /// Most likely tokens reported with their log-probabilities (at most [`PICK_TOP`]).
    pub top_logprobs: usize,
}

impl PickSpec {
    /// The spec of a row sampled by `s` with `draw`, reporting `top_logprobs` alternatives;
    /// `None` when the device cannot report that many.
    pub fn of(s: &Sampler, draw: Option<f64>, top_logprobs: usize) -> Option<Self> {
        let p = s.params();
        (top_logprobs <= PICK_TOP).then_some(Self {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            draw,
            top_logprobs,
        })
    }

    /// The greedy pick, reporting `top_logprobs` alternatives.
    pub fn greedy(top_logprobs: usize) -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 0.0,
            draw: None,
            top_logprobs,
        }
    }

    fn tempered(&self) -> Option<f64> {
        self.draw.filter(|_| !greedy_at(self.temperature))
    }
}

/// A token picked where the logits are, with what the step reports of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Picked {
    pub token: u32,
    /// Its log-probability under the model.
    pub logprob: f32,
    /// The most likely tokens, most likely first, with their log-probabilities.
    pub top: Vec<(u32, f32)>,
}

/// One row of a step's LM head.
#[derive(Debug, Clone, PartialEq)]
pub enum RowOut {
    /// The backend picked the token.
    Picked(Picked),
    /// The row's logits `[vocab]`: the host picks.
    Logits(Vec<f32>),
}

/// The device pick of one row by its definition; `None` where the host must pick (see the
/// module). Tokens are ranked by logit, the lower id first on ties, as the host sorts them.
pub fn pick_row(logits: &[f32], spec: &PickSpec) -> Option<Picked> {
    let n = logits.len();
    if n == 0 || !logits.iter().all(|x| x.is_finite()) {
        return None;
    }
    let top = top_logprobs(logits, spec.top_logprobs.min(PICK_TOP));
    let token = match spec.tempered() {
        None => super::sampling::argmax(logits),
        Some(r) => pick_tempered(logits, spec, r)?,
    };
    Some(Picked {
        token: token as u32,
        logprob: logprob(logits, token),
        top,
    })
}

/// The tempered pick from the head of the order alone (`None`: it needs tokens past it).
fn pick_tempered(logits: &[f32], spec: &PickSpec, r: f64) -> Option<usize> {
    let n = logits.len();
    let keep = if spec.top_k > 0 { spec.top_k.min(n) } else { n };
    let head = keep.min(SORTED_HEAD);
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_unstable_by(|a, b| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b)));
    idx.truncate(head);
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weight = |i: usize| (((logits[i] - m) / spec.temperature) as f64).exp();
    let total: f64 = if keep < n {
        if keep > head {
            return None;
        }
        idx.iter().map(|&i| weight(i)).sum()
    } else {
        (0..n).map(weight).sum()
    };
    let nucleus = spec.top_p > 0.0 && spec.top_p < 1.0;
    let mut len = head;
    let mut kept = total;
    if nucleus {
        let mut acc = 0.0;
        match idx.iter().position(|&i| {
            acc += weight(i) / total;
            acc >= spec.top_p as f64
        }) {
            Some(p) => len = p + 1,
            // Rounding kept the nucleus from reaching top_p within the kept tokens: the host
            // takes the last of them.
            None if head == keep => return Some(idx[keep - 1]),
            None => return None,
        }
        kept = idx[..len].iter().map(|&i| weight(i)).sum::<f64>();
    }
    let mut r = r * kept;
    for &i in &idx[..len] {
        let w = weight(i);
        if r < w {
            return Some(i);
        }
        r -= w;
    }
    (nucleus || len == keep).then(|| idx[len - 1])
}

/// A residual that picks as a device would, by [`pick_row`] over the logits of `inner`, its
/// tokens shifted by `shift` (0: a correct device); counts the rows it picked. For tests of
/// what surrounds device picks.
#[cfg(test)]
pub(crate) struct PickingResidual<R> {
    pub(crate) inner: R,
    pub(crate) shift: Option<u32>,
    pub(crate) picked: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

#[cfg(test)]
impl<R: crate::backend::Residual> crate::backend::Residual for PickingResidual<R> {
    fn norm_project(
        &mut self,
        groups: &mut [crate::backend::NormProject<'_, '_>],
    ) -> Result<(), crate::backend::BackendError> {
        self.inner.norm_project(groups)
    }

    fn finish_layer(
        &mut self,
        attn: &[f32],
        w: crate::backend::LayerOut<'_>,
    ) -> Result<(), crate::backend::BackendError> {
        self.inner.finish_layer(attn, w)
    }

    fn lm_head(
        &mut self,
        head: crate::backend::LmHead<'_>,
        picks: &[Option<PickSpec>],
    ) -> Result<Vec<RowOut>, crate::backend::BackendError> {
        let rows = self.inner.lm_head(head, picks)?;
        let Some(shift) = self.shift else {
            return Ok(rows);
        };
        Ok(rows
            .into_iter()
            .zip(picks)
            .map(|(row, spec)| match (row, spec) {
                (RowOut::Logits(l), Some(s)) => match pick_row(&l, s) {
                    Some(mut p) => {
                        p.token = (p.token + shift) % l.len() as u32;
                        self.picked
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        RowOut::Picked(p)
                    }
                    None => RowOut::Logits(l),
                },
                (row, _) => row,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Sampling;
    use crate::model::random::SplitMix;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 400,
            rng_seed: proptest::test_runner::RngSeed::Fixed(22),
            ..proptest::prelude::ProptestConfig::default()
        })]
        /// Wherever the definition picks, it picks and reports what the host path does for
        /// the same draw; it leaves a row to the host only where the head does not hold the
        /// answer.
        #[test]
        fn a_device_pick_is_the_host_pick(
            n in 1usize..1500,
            seed in 0u64..1000,
            spread in 0.1f32..30.0,
            coarse in proptest::bool::ANY,
            temperature in proptest::prop_oneof![proptest::strategy::Just(0.0f32), 0.05f32..3.0],
            top_k in proptest::prop_oneof![proptest::strategy::Just(0usize), 1usize..600],
            top_p in proptest::prop_oneof![proptest::strategy::Just(0.0f32), 0.01f32..1.0],
            ntop in 0usize..=PICK_TOP,
        ) {
            let mut g = SplitMix(seed);
            // Coarse logits tie often: ties must rank the lower id first on both sides.
            let logits: Vec<f32> = (0..n)
                .map(|_| {
                    let v = (g.next_f64() as f32 - 0.5) * spread;
                    if coarse { v.round() } else { v }
                })
                .collect();
            let mut s = Sampler::new(Sampling { temperature, top_k, top_p, seed, ..Sampling::default() });
            let draw = s.draw();
            let spec = PickSpec::of(&s, draw, ntop).expect("within the limit");
            match pick_row(&logits, &spec) {
                Some(p) => {
                    let tok = s.pick_drawn(&logits, draw);
                    proptest::prop_assert_eq!(p.token, tok);
                    proptest::prop_assert_eq!(p.logprob, logprob(&logits, tok as usize));
                    proptest::prop_assert_eq!(p.top, top_logprobs(&logits, ntop));
                }
                None => {
                    // Only a top-k past the head, or a nucleus past it.
                    let keep = if top_k > 0 { top_k.min(n) } else { n };
                    proptest::prop_assert!(draw.is_some() && keep > SORTED_HEAD, "{keep}");
                }
            }
        }
    }

    #[test]
    fn non_finite_rows_and_long_top_lists_are_left_to_the_host() {
        let s = Sampler::new(Sampling::default());
        let spec = PickSpec::of(&s, None, 3).unwrap();
        assert!(pick_row(&[1.0, f32::NAN, 0.0], &spec).is_none());
        assert!(pick_row(&[1.0, f32::INFINITY], &spec).is_none());
        assert!(PickSpec::of(&s, None, PICK_TOP + 1).is_none());
        let p = pick_row(&[1.0, 3.0, 3.0, -2.0], &spec).unwrap();
        assert_eq!(p.token, 1, "the first of equal logits");
        assert_eq!(p.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2, 0]);
    }
}
