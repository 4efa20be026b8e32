//! A request while it decodes: its KV, attention state, sampler and timings. Dropping one frees
//! everything it holds: device copies first, then its pool blocks and growth reservation.

use std::sync::Arc;
use std::time::Instant;

use attention::{AttentionConfig, SeqAttention, SeqStats};
use kv_transfer::CommittedKv;

use super::lend::Share;
use super::stop_text::StopText;
use super::{FinishReason, Job, JobSpec, RequestStats};
use crate::backend::{BackendError, DeviceKv, DeviceSeq};
use crate::model::logits::LogitsProcessor;
use crate::model::tokenizer::{TextState, Tokenizer};
use crate::model::{ModelConfig, Sampler};

pub(super) struct Running {
    pub(super) job: JobSpec,
    /// Device copies of hot blocks; declared before `kv` so it is dropped (and its copies
    /// finished) first.
    pub(super) dev: Option<Box<dyn DeviceSeq>>,
    pub(super) kv: Arc<CommittedKv>,
    pub(super) seq: SeqAttention,
    pub(super) sampler: Sampler,
    /// Penalties and bans applied before the sampler picks.
    pub(super) logits: LogitsProcessor,
    /// Stop strings and the text held back for them.
    pub(super) stops: StopText,
    /// The token the next step feeds.
    pub(super) next_token: u32,
    pub(super) generated: u32,
    pub(super) admitted: Instant,
    pub(super) first_token: Option<Instant>,
    pub(super) last_token: Instant,
    /// Device KV admission counted for it, the slots that would hold every block it may
    /// have, and those lent to it (spare device KV, [`super::lend`]).
    pub(super) device: Share,
    pub(super) text: TextState,
    pub(super) device_wait: f64,
    /// Device idle seconds of the steps it was in.
    pub(super) device_idle: f64,
    /// Attention counters already added to the metrics.
    pub(super) seen: SeqStats,
}

/// `n` blocks of `r` as pages of a host-kept key sketch (fewer only if `r` holds fewer).
pub(crate) fn take_pages(
    r: &mut kv_transfer::Reservation,
    n: usize,
) -> Vec<Box<dyn attention::host_sketch::SketchPage>> {
    (0..n)
        .map_while(|_| r.take())
        .map(|b| Box::new(b) as Box<dyn attention::host_sketch::SketchPage>)
        .collect()
}

/// The time between a token and the one before it, or since arrival for the first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Latency {
    /// Time to the first token.
    First(f64),
    /// Inter-token latency.
    Next(f64),
}

impl Running {
    /// Starts `job`, admitted at `now` with its growth reserved and `device` counted (no
    /// loan yet): digests go to the attention state, the device (if any) gets a sequence
    /// with `resident_per_head` blocks per head.
    pub(super) fn start(
        job: Job,
        device: Share,
        now: Instant,
        tokenizer: &Tokenizer,
        device_kv: Option<&Arc<dyn DeviceKv>>,
        resident_per_head: usize,
    ) -> Self {
        let Job { mut kv, spec } = job;
        let digests = kv.take_digests();
        let seq = SeqAttention::new(*kv.geometry(), kv.num_layers(), kv.num_tokens(), digests);
        let mut ctx = kv.info.prompt_token_ids.clone();
        ctx.push(kv.info.next_token_id);
        let text = tokenizer.text_state(&ctx);
        let next_token = kv.info.next_token_id;
        let kv: Arc<CommittedKv> = Arc::from(kv);
        let dev = device_kv.map(|d| d.clone().new_seq(kv.num_layers(), resident_per_head));
        Self {
            dev,
            sampler: Sampler::new(spec.sampling),
            logits: {
                // The prefill's token is the output's first: penalties count it.
                let mut l = LogitsProcessor::new(&spec.sampling, &kv.info.prompt_token_ids);
                l.observe(next_token);
                l
            },
            stops: StopText::new(spec.output.stop_strings.clone()),
            job: spec,
            kv,
            seq,
            next_token,
            generated: 0,
            admitted: now,
            first_token: None,
            last_token: now,
            device: device.with_lent(0),
            text,
            device_wait: 0.0,
            device_idle: 0.0,
            seen: SeqStats::default(),
        }
    }

    /// Ends the request, its whole blocks (prompt and fed tokens) going to `cache`: the
    /// device copies are released first; KV still shared (never, once a step has ended)
    /// simply returns to the pool.
    pub(super) fn into_cache(self, cache: &kv_transfer::PrefixCache) {
        let Self { dev, kv, seq, .. } = self;
        drop(dev);
        if let Ok(kv) = Arc::try_unwrap(kv) {
            kv.into_cache(cache, &seq.into_digests());
        }
    }

    /// Holds `lent` device slots per (layer, KV head) beyond its share. Growing, the device
    /// takes the slots first, then the attention state: where it holds every block, each
    /// finish of a layer brings up more of the blocks still on the host (within the recall
    /// budget). Shrinking, the attention state keeps its most recently used blocks first,
    /// then the device frees the rest before the next step. A device that refuses a larger
    /// count leaves the loan as it was.
    pub(super) fn set_loan(
        &mut self,
        cfg: &AttentionConfig,
        lent: usize,
    ) -> Result<(), BackendError> {
        let next = self.device.with_lent(lent);
        // No loan: the config's share, as the sequence started with.
        let (cap, slots) = match lent {
            0 => (None, cfg.resident_blocks_per_head()),
            _ => (Some(next.slots()), next.slots()),
        };
        let growing = next.slots() > self.device.slots();
        if growing && let Some(d) = self.dev.as_mut() {
            d.set_slots_per_head(slots)?;
        }
        self.seq.set_device_cap(cfg, cap);
        self.device = next;
        match self.dev.as_mut() {
            Some(d) if !growing => d.set_slots_per_head(slots),
            _ => Ok(()),
        }
    }

    /// Records a token streamed at `now`; returns its latency.
    pub(super) fn token_at(&mut self, now: Instant) -> Latency {
        self.generated += 1;
        let l = match self.first_token {
            None => {
                self.first_token = Some(now);
                Latency::First(now.duration_since(self.job.arrived).as_secs_f64())
            }
            Some(_) => Latency::Next(now.duration_since(self.last_token).as_secs_f64()),
        };
        self.last_token = now;
        l
    }

    /// Tokens it may not generate now: EOS (unless ignored) and the stop ids, before
    /// `min_tokens`.
    pub(super) fn banned(&self, cfg: &ModelConfig) -> Vec<u32> {
        if self.generated >= self.job.output.min_tokens {
            return Vec::new();
        }
        let eos = (!self.job.ignore_eos).then_some(&cfg.eos_token_ids[..]);
        self.job
            .stop_ids
            .iter()
            .chain(eos.into_iter().flatten())
            .copied()
            .collect()
    }

    /// Why the request ends after generating `tok`, if it does.
    pub(super) fn stop_reason(&self, tok: u32, cfg: &ModelConfig) -> Option<FinishReason> {
        stop_reason(
            &self.job,
            tok,
            self.generated,
            self.kv.num_tokens(),
            &cfg.eos_token_ids,
            cfg.max_context(),
        )
    }

    /// The figures sent with its finish.
    pub(super) fn stats(&self, now: Instant) -> RequestStats {
        let s = self.seq.stats();
        let arrived = self.job.arrived;
        RequestStats {
            queue_seconds: self.admitted.duration_since(arrived).as_secs_f64(),
            first_token_seconds: self
                .first_token
                .map_or(0.0, |t| t.duration_since(arrived).as_secs_f64()),
            total_seconds: now.duration_since(arrived).as_secs_f64(),
            cpu_attention_ratio: s.cpu_ratio(),
            recalled_blocks: s.recall_blocks,
            recalled_bytes: s.recall_bytes,
            recalled_blocks_used: s.recall_used_blocks,
            prediction_hit_ratio: s.hit_ratio(),
            prompt_tokens: self.kv.info.prompt_token_ids.len() as u32,
            device_wait_seconds: self.device_wait,
            device_idle_seconds: self.device_idle,
            layer_cpu_history: self.seq.layer_history(),
        }
    }
}

/// Why a request ends after generating `tok` as its `generated`-th token with `kv_tokens`
/// positions held: a stop id, EOS (unless ignored), its length, or a full context.
fn stop_reason(
    job: &JobSpec,
    tok: u32,
    generated: u32,
    kv_tokens: usize,
    eos: &[u32],
    max_context: usize,
) -> Option<FinishReason> {
    if job.stop_ids.contains(&tok) {
        Some(FinishReason::Stop)
    } else if !job.ignore_eos && eos.contains(&tok) {
        Some(FinishReason::Eos)
    } else if generated >= job.max_new_tokens {
        Some(FinishReason::Length)
    } else if kv_tokens + 1 >= max_context {
        Some(FinishReason::ContextFull)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::*;
    use crate::model::Sampling;

    fn spec(max_new_tokens: u32, stop_ids: Vec<u32>, ignore_eos: bool) -> JobSpec {
        JobSpec {
            request_id: "r".into(),
            sampling: Sampling::default(),
            max_new_tokens,
            stop_ids,
            ignore_eos,
            output: Default::default(),
            arrived: Instant::now(),
            events: mpsc::unbounded_channel().0,
            span: tracing::Span::none(),
        }
    }

    #[test]
    fn stop_reasons_in_their_order() {
        use FinishReason::*;
        let eos = [2u32];
        // (max_new, stop ids, ignore_eos, token, generated, kv tokens) -> reason; context 100.
        let table = [
            ((10, vec![7], false, 5, 1, 10), None),
            ((10, vec![7], false, 7, 1, 10), Some(Stop)),
            ((10, vec![2], true, 2, 1, 10), Some(Stop)),
            ((10, vec![], false, 2, 1, 10), Some(Eos)),
            ((10, vec![], true, 2, 1, 10), None),
            ((10, vec![], false, 5, 10, 10), Some(Length)),
            ((10, vec![], false, 2, 10, 10), Some(Eos)),
            ((10, vec![], false, 5, 3, 99), Some(ContextFull)),
            ((10, vec![], false, 5, 10, 99), Some(Length)),
        ];
        for ((max_new, stops, ignore, tok, generated, kv), want) in table {
            let j = spec(max_new, stops.clone(), ignore);
            assert_eq!(
                stop_reason(&j, tok, generated, kv, &eos, 100),
                want,
                "max_new {max_new} stops {stops:?} ignore_eos {ignore} tok {tok} gen {generated} kv {kv}"
            );
        }
    }
}
