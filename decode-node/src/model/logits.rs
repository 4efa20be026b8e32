//! What is done to a step's logits before a token is picked, and what is reported of them:
//! penalties for tokens the prompt and the output already hold, tokens banned until
//! `min_tokens`, and the most likely tokens with their log-probabilities. The semantics are
//! transformers' and vLLM's, so a client moving from either gets the same tokens.

use std::collections::{HashMap, HashSet};

use super::Sampling;

/// Penalties of one request and the history they look at.
#[derive(Debug, Clone)]
pub struct LogitsProcessor {
    /// Divides positive logits, multiplies negative ones, of tokens in the prompt or output;
    /// 1 = off.
    repetition: f32,
    presence: f32,
    frequency: f32,
    /// Distinct prompt tokens (only kept when the repetition penalty is on).
    prompt: HashSet<u32>,
    /// Generated tokens and their counts.
    counts: HashMap<u32, u32>,
    /// The processed copy of the logits.
    scratch: Vec<f32>,
}

impl LogitsProcessor {
    /// The processor of a request with sampling `s` after `prompt`.
    pub fn new(s: &Sampling, prompt: &[u32]) -> Self {
        let repetition = if s.repetition_penalty > 0.0 {
            s.repetition_penalty
        } else {
            1.0
        };
        let prompt = if repetition != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Self {
            repetition,
            presence: s.presence_penalty,
            frequency: s.frequency_penalty,
            prompt,
            counts: HashMap::new(),
            scratch: Vec::new(),
        }
    }

    /// True when any penalty changes the logits.
    pub fn penalises(&self) -> bool {
        self.repetition != 1.0 || self.presence != 0.0 || self.frequency != 0.0
    }

    /// The logits to pick from: `logits` itself when nothing applies, else a processed copy
    /// (repetition penalty over prompt and output, then presence and frequency over the
    /// output, then `banned` set to -inf). Ids outside the vocabulary are ignored.
    pub fn apply<'a>(&'a mut self, logits: &'a [f32], banned: &[u32]) -> &'a [f32] {
        if !self.penalises() && banned.is_empty() {
            return logits;
        }
        self.scratch.clear();
        self.scratch.extend_from_slice(logits);
        let x = &mut self.scratch;
        if self.repetition != 1.0 {
            let r = self.repetition;
            for t in self
                .prompt
                .iter()
                .chain(self.counts.keys().filter(|t| !self.prompt.contains(t)))
            {
                if let Some(v) = x.get_mut(*t as usize) {
                    *v = if *v > 0.0 { *v / r } else { *v * r };
                }
            }
        }
        for (t, c) in &self.counts {
            if let Some(v) = x.get_mut(*t as usize) {
                *v -= self.frequency * *c as f32 + self.presence;
            }
        }
        for t in banned {
            if let Some(v) = x.get_mut(*t as usize) {
                *v = f32::NEG_INFINITY;
            }
        }
        &self.scratch
    }

    /// Records a generated token.
    pub fn observe(&mut self, tok: u32) {
        if self.penalises() {
            *self.counts.entry(tok).or_default() += 1;
        }
    }
}

/// The `n` most likely tokens under `logits`, most likely first (the lower id first on ties),
/// with their log-probabilities. Partial selection: the vocabulary is not sorted.
pub fn top_logprobs(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    let lse = super::sampling::log_sum_exp(logits);
    let by = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, by);
    }
    idx.truncate(n);
    idx.sort_unstable_by(by);
    idx.into_iter()
        .map(|i| (i as u32, logits[i] - lse))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::sampling::logprob;

    fn sampling(rep: f32, pres: f32, freq: f32) -> Sampling {
        Sampling {
            repetition_penalty: rep,
            presence_penalty: pres,
            frequency_penalty: freq,
            ..Sampling::default()
        }
    }

    #[test]
    fn nothing_to_do_returns_the_logits_themselves() {
        let l = [1.0, 2.0, 3.0];
        let mut p = LogitsProcessor::new(&sampling(0.0, 0.0, 0.0), &[0, 1]);
        p.observe(2);
        assert!(std::ptr::eq(p.apply(&l, &[]), &l[..]));
        let mut p = LogitsProcessor::new(&sampling(1.0, 0.0, 0.0), &[0, 1]);
        assert!(std::ptr::eq(p.apply(&l, &[]), &l[..]));
    }

    #[test]
    fn penalties_as_transformers_and_vllm_define_them() {
        let l = [2.0, -2.0, 4.0, 1.0, 0.5];
        // Repetition 2 over prompt {0, 1} and output {2}: positive halved, negative doubled.
        let mut p = LogitsProcessor::new(&sampling(2.0, 0.0, 0.0), &[0, 1, 1]);
        p.observe(2);
        assert_eq!(p.apply(&l, &[]), &[1.0, -4.0, 2.0, 1.0, 0.5]);
        // Presence 0.5 and frequency 0.25 over the output only: token 3 twice, token 4 once.
        let mut p = LogitsProcessor::new(&sampling(0.0, 0.5, 0.25), &[0]);
        for t in [3, 4, 3] {
            p.observe(t);
        }
        assert_eq!(p.apply(&l, &[]), &[2.0, -2.0, 4.0, 0.0, -0.25]);
        // Banned tokens (and ids past the vocabulary, ignored).
        let got = p.apply(&l, &[2, 99]).to_vec();
        assert_eq!(got[2], f32::NEG_INFINITY);
        assert_eq!(got[0], 2.0);
    }

    #[test]
    fn top_logprobs_are_the_best_tokens_in_order() {
        let l = [0.5, 3.0, -1.0, 3.0, 2.0];
        let top = top_logprobs(&l, 3);
        let ids: Vec<u32> = top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 4]);
        for (id, lp) in top {
            assert!((lp - logprob(&l, id as usize)).abs() < 1e-6);
        }
        assert_eq!(top_logprobs(&l, 10).len(), 5);
        assert!(top_logprobs(&l, 0).is_empty());
    }
}
