//! One step of the batch, phase by phase: the forward pass ([`StepLoop::forward`]: attention
//! for every request and the model's projections), then per request the new KV appended,
//! a token sampled and streamed, and its end decided ([`StepLoop::emit`]), the step's figures
//! recorded, and finished requests retired.

use std::time::{Duration, Instant};

use attention::Mode;
use rayon::prelude::*;

use super::attend::{AttnTiming, BatchAttention, SeqSlot, Shape};
use super::profile::Switch;
use super::running::{Latency, Running};
use super::{EngineError, Event, FinishReason, LoadSnapshot, StepLoop, TopLogprob, solo};
use crate::metrics::{OutcomeLabel, ReasonLabel};
use crate::model::pick::{PickSpec, RowOut};
use crate::model::{ModelConfig, logits, sampling};

/// One f32 row per layer (a token's K or V).
type LayerRows = Vec<Vec<f32>>;

/// What the forward pass of a step gives back.
struct Forward {
    /// Per request: its token picked by the backend, or its logits `[vocab]`.
    rows: Vec<RowOut>,
    /// Per request: the draw its pick uses (`None`: greedy).
    draws: Vec<Option<f64>>,
    /// Per request: the new token's K and V rows, and the seconds the device waited on its
    /// CPU attention.
    new_kv: Vec<(LayerRows, LayerRows, f64)>,
    /// Seconds in the model (attention included).
    model_s: f64,
    timing: AttnTiming,
}

/// How a request's step ended: still running, finished, or failed.
type Outcome = Option<Result<FinishReason, EngineError>>;

/// A request's token of this step, picked in the parallel pass.
struct Pick {
    tok: u32,
    /// Its log-probability under the model.
    logprob: f32,
    /// The most likely tokens under the model, with their log-probabilities.
    top: Vec<(u32, f32)>,
}

impl StepLoop {
    /// One decode step of every running request.
    pub(super) fn step(&mut self) {
        let batch = self.running.len();
        if let Some(w) = self.profile.as_mut() {
            let switch = w.before(batch);
            self.switch_profiler(switch);
        }
        let t0 = Instant::now();
        let idle0 = self.model.model.backend().device_idle_seconds();
        let graphs0 = self.model.model.backend().graph_stats();
        let fwd = self.forward();
        if let Some(w) = self.profile.as_mut() {
            let switch = w.after();
            self.switch_profiler(switch);
        }
        let fwd = match fwd {
            Ok(f) => f,
            Err(e) => return self.fail_batch(e),
        };
        // The device's idle time inside this step (its wait between steps is not counted).
        if let (Some(a), Some(b)) = (idle0, self.model.model.backend().device_idle_seconds()) {
            let idle = (b - a).max(0.0);
            self.metrics.device_idle_seconds.inc_by(idle);
            for r in &mut self.running {
                r.device_idle += idle;
            }
        }
        if let (Some(a), Some(b)) = (graphs0, self.model.model.backend().graph_stats()) {
            self.metrics.graph_pieces(a, b);
        }
        let now = Instant::now();
        let outcomes = self.emit(&fwd, now);
        self.record(t0, now, &fwd);
        self.retire_finished(outcomes);
    }

    /// Starts or stops the device profiler; a failure is logged and ends the window.
    fn switch_profiler(&mut self, switch: Switch) {
        let on = match switch {
            Switch::Start => true,
            Switch::Stop => false,
            Switch::None => return,
        };
        match self.model.model.backend().profile(on) {
            Ok(()) => tracing::info!(on, "device profiler switched"),
            Err(e) => {
                tracing::error!(error = %e, "switching the device profiler failed; no profile window");
                self.profile = None;
            }
        }
    }

    /// Attention and the model's projections for the whole batch.
    fn forward(&mut self) -> Result<Forward, EngineError> {
        let cfg = &self.model.model.cfg;
        let (nl, nkv, hd) = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim);
        let shape = Shape {
            num_heads: cfg.num_heads,
            num_kv_heads: nkv,
            head_dim: hd,
            scale: self.model.model.attn_scale(),
        };
        let tokens: Vec<u32> = self.running.iter().map(|r| r.next_token).collect();
        // Each request's draw before the logits exist, so a backend that picks where the
        // logits are picks what the host would. Penalties and bans need the host.
        let draws: Vec<Option<f64>> = self.running.iter_mut().map(|r| r.sampler.draw()).collect();
        let picks: Vec<Option<PickSpec>> = self
            .running
            .iter()
            .zip(&draws)
            .map(|(r, &draw)| {
                let plain = !r.logits.penalises() && r.banned(cfg).is_empty();
                let top = r.job.output.top_logprobs as usize;
                plain.then(|| PickSpec::of(&r.sampler, draw, top)).flatten()
            })
            .collect();
        let positions: Vec<usize> = self.running.iter().map(|r| r.kv.num_tokens()).collect();
        let slots = self
            .running
            .iter_mut()
            .map(|r| SeqSlot {
                kv: &r.kv,
                seq: &mut r.seq,
                dev: r.dev.as_mut(),
                new_k: vec![vec![0.0; nkv * hd]; nl],
                new_v: vec![vec![0.0; nkv * hd]; nl],
                device_wait: 0.0,
            })
            .collect();
        let mut batch = BatchAttention::new(&self.cfg.attention, shape, &self.cpu_pool, slots);
        let t = Instant::now();
        let model = &self.model.model;
        let result = if model.backend().parallel_on_rayon() {
            self.cpu_pool
                .install(|| model.decode_step_picking(&tokens, &positions, &mut batch, &picks))
        } else {
            model.decode_step_picking(&tokens, &positions, &mut batch, &picks)
        };
        let model_s = t.elapsed().as_secs_f64();
        for g in &batch.guard_checks {
            self.metrics.observe_guard(g.layer, g.cosine, g.fell_back);
        }
        let timing = batch.timing;
        let new_kv = batch
            .slots
            .into_iter()
            .map(|s| (s.new_k, s.new_v, s.device_wait))
            .collect();
        Ok(Forward {
            rows: result?,
            draws,
            new_kv,
            model_s,
            timing,
        })
    }

    /// A step that failed for the whole batch ends every running request with its error.
    pub(super) fn fail_batch(&mut self, e: EngineError) {
        tracing::error!(error = %e, batch = self.running.len(), "decode step failed; its requests end");
        if let EngineError::DeviceLost(why) = &e {
            tracing::error!("the device is lost: this node refuses all work until it restarts");
            self.lost = Some(why.clone());
        }
        for r in std::mem::take(&mut self.running) {
            self.count_outcome("error");
            r.job
                .span
                .in_scope(|| tracing::warn!(error = %e, "ended by a failed step"));
            let events = r.job.events.clone();
            drop(r); // frees its KV before the client hears the end
            let _ = events.send(Event::Error(e.clone()));
        }
    }

    /// Per request: appends the step's KV, samples and streams a token, decides its end.
    fn emit(&mut self, fwd: &Forward, now: Instant) -> Vec<Outcome> {
        let cfg = &self.model.model.cfg;
        let attention = &self.cfg.attention;
        // Every request's KV append and token first, in parallel: a sampled token costs passes
        // over the whole vocabulary (softmax, log-probability), and an append encodes a row
        // per layer, one request after another at batch 64. Non-finite logits are not
        // sampled; the loop below ends their request.
        // On a CPU node, on the pool the model ran on: rayon's global pool would be a second
        // set of threads on the same cores, spinning idle after each batch.
        let mut settle_all = || -> Vec<(Result<(), kv_transfer::Error>, Option<Pick>)> {
            self.running
                .par_iter_mut()
                .zip(fwd.rows.par_iter().zip(&fwd.draws))
                .zip(&fwd.new_kv)
                .map(|((r, (row, &draw)), (ks, vs, _))| {
                    // The step's KV (the token just fed) into the host pool and the digests.
                    let appended =
                        solo::append_step(&mut r.kv, &mut r.seq, attention, r.next_token, ks, vs);
                    (appended, pick(r, row, draw, cfg))
                })
                .collect()
        };
        let settled = if self.model.model.backend().parallel_on_rayon() {
            self.cpu_pool.install(settle_all)
        } else {
            settle_all()
        };
        let mut out = Vec::with_capacity(self.running.len());
        for (i, ((r, (_, _, wait)), (appended, picked))) in self
            .running
            .iter_mut()
            .zip(&fwd.new_kv)
            .zip(settled)
            .enumerate()
        {
            r.device_wait += wait;
            if let Err(e) = appended {
                // Growth was reserved at admission, so this is a bug, not a full context: say so.
                r.job
                    .span
                    .in_scope(|| tracing::error!(error = %e, "appending KV failed"));
                out.push(Some(Err(EngineError::Internal(format!(
                    "appending KV: {e}"
                )))));
                continue;
            }
            let s = *r.seq.stats();
            self.metrics.add_attention(
                s.selected_tokens - r.seen.selected_tokens,
                s.cpu_tokens - r.seen.cpu_tokens,
                s.prediction_hits - r.seen.prediction_hits,
                s.prediction_total - r.seen.prediction_total,
            );
            self.metrics
                .recall_blocks
                .inc_by(s.recall_blocks - r.seen.recall_blocks);
            self.metrics
                .recall_bytes
                .inc_by(s.recall_bytes - r.seen.recall_bytes);
            self.metrics
                .recall_used_blocks
                .inc_by(s.recall_used_blocks - r.seen.recall_used_blocks);
            r.seen = s;

            let Some(Pick { tok, logprob, top }) = picked else {
                // A backend's pick is never of non-finite logits: those rows come back whole.
                let bad = match &fwd.rows[i] {
                    RowOut::Logits(l) => l.iter().find(|x| !x.is_finite()).copied(),
                    RowOut::Picked(_) => None,
                }
                .unwrap_or(f32::NAN);
                r.job.span.in_scope(
                    || tracing::warn!(value = %bad, generated = r.generated, "non-finite logits"),
                );
                out.push(Some(Err(EngineError::NonFinite(format!(
                    "the model's logits hold {bad} after {} generated tokens: the pushed KV \
                     holds NaN or infinite values",
                    r.generated
                )))));
                continue;
            };
            let tokenizer = &self.model.tokenizer;
            let piece = r.text.step(tokenizer, tok);
            let index = r.generated;
            match r.token_at(now) {
                Latency::First(s) => self.metrics.ttft.observe(s),
                Latency::Next(s) => self.metrics.itl.observe(s),
            }
            self.metrics.generation_tokens.inc();
            // A stop string ends it first; any other end releases the text held for them.
            let check = r.generated >= r.job.output.min_tokens;
            let (mut text, stopped) = r.stops.push(&piece, check);
            let end = if stopped {
                Some(FinishReason::Stop)
            } else {
                r.stop_reason(tok, cfg)
            };
            if end.is_some() && !stopped {
                text += &r.stops.flush();
            }
            let top_logprobs = top
                .into_iter()
                .map(|(id, logprob)| TopLogprob {
                    id,
                    text: tokenizer.decode(&[id]),
                    logprob,
                })
                .collect();
            let sent = r.job.events.send(Event::Token {
                index,
                id: tok,
                text,
                logprob,
                top_logprobs,
            });
            if sent.is_err() {
                out.push(Some(Ok(FinishReason::Cancelled)));
                continue;
            }
            r.next_token = tok;
            out.push(end.map(Ok));
        }
        out
    }

    /// The step's figures: duration, batch size, the tokens/s window.
    fn record(&mut self, t0: Instant, now: Instant, fwd: &Forward) {
        let step_s = t0.elapsed().as_secs_f64();
        self.metrics.step_duration.observe(step_s);
        let device_wait: f64 = fwd.new_kv.iter().map(|x| x.2).sum();
        self.metrics.device_wait_seconds.inc_by(device_wait);
        let t = &fwd.timing;
        let attn_s = t.ahead + t.plan + t.device + t.finish + t.queue;
        tracing::debug!(
            batch = self.running.len(),
            step_s,
            model_s = fwd.model_s,
            attn_ahead_s = t.ahead,
            attn_plan_s = t.plan,
            attn_device_s = t.device,
            attn_cpu_wait_s = device_wait,
            attn_finish_s = t.finish,
            attn_scores_s = t.scores,
            attn_select_s = t.select,
            attn_cpu_s = t.cpu,
            attn_cpu_start_s = t.cpu_start,
            attn_queue_scores_s = t.queue,
            attn_layers_on_device = t.layers_on_device,
            projections_s = fwd.model_s - attn_s,
            "step"
        );
        self.metrics.batch_size.set(self.running.len() as i64);
        self.recent.push_back((now, self.running.len()));
        while self
            .recent
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > Duration::from_secs(5))
        {
            self.recent.pop_front();
        }
    }

    /// Retires the requests whose step ended them (`outcomes` is in batch order).
    fn retire_finished(&mut self, outcomes: Vec<Outcome>) {
        for (i, outcome) in outcomes.into_iter().enumerate().rev() {
            let Some(outcome) = outcome else { continue };
            let r = self.running.swap_remove(i);
            match outcome {
                Ok(reason) => {
                    let why = (reason == FinishReason::Cancelled).then_some("disconnect");
                    self.retire(r, reason, why);
                }
                Err(e) => {
                    self.count_outcome("error");
                    let events = r.job.events.clone();
                    drop(r);
                    let _ = events.send(Event::Error(e));
                }
            }
        }
    }

    pub(super) fn count_outcome(&self, outcome: &str) {
        self.metrics
            .requests
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .inc();
    }

    /// Ends `r` with `reason`; dropping it frees its pool blocks and growth reservation.
    pub(super) fn retire(&self, r: Running, reason: FinishReason, cancel_reason: Option<&str>) {
        let stats = r.stats(Instant::now());
        r.job.span.in_scope(|| {
            tracing::info!(
                reason = reason.label(),
                generated = r.generated,
                ttft_s = stats.first_token_seconds,
                total_s = stats.total_seconds,
                cpu_attention_ratio = stats.cpu_attention_ratio,
                "finished"
            )
        });
        self.metrics.e2e.observe(stats.total_seconds);
        self.count_outcome(reason.label());
        if let Some(why) = cancel_reason {
            self.metrics
                .cancellations
                .get_or_create(&ReasonLabel { reason: why.into() })
                .inc();
        }
        // Free the KV before the client hears the end, so a load read after it sees it freed
        // (or cached: what the prefix cache keeps it may give back whenever the pool asks).
        let (events, generated) = (r.job.events.clone(), r.generated);
        match &self.cfg.prefix_cache {
            Some(cache) if reason != FinishReason::Cancelled => r.into_cache(cache),
            _ => drop(r),
        }
        let _ = events.send(Event::Finish {
            reason,
            generated,
            stats,
        });
    }

    /// Publishes the load figures `GetLoad` and the gauges read.
    pub(super) fn publish_load(&mut self) {
        let now = Instant::now();
        let tokens: usize = self.recent.iter().map(|(_, n)| n).sum();
        let span = self
            .recent
            .front()
            .map_or(0.0, |(t, _)| now.duration_since(*t).as_secs_f64());
        // Each request's device bytes in use, and of them what is past its share (on loan).
        let (device_bytes, device_lent) = self
            .running
            .iter()
            .map(|r| {
                let used = match self.cfg.attention.mode {
                    Mode::Full => r.kv.bytes().min(r.device.counted()),
                    _ => r.seq.device_bytes() as u64,
                };
                (used, used.saturating_sub(r.device.base_bytes()))
            })
            .fold((0, 0), |(u, l), (du, dl)| (u + du, l + dl));
        let snap = LoadSnapshot {
            running: self.running.len() as u32,
            waiting: self.waiting.len() as u32,
            device_bytes,
            device_capacity: super::reported_capacity(
                self.device_kv.is_some(),
                self.cfg.device_kv_bytes,
            ),
            device_lent,
            tokens_per_second: if span > 0.0 {
                tokens as f64 / span
            } else {
                0.0
            },
            device_lost: self.lost.is_some(),
        };
        self.metrics.running.set(snap.running as i64);
        self.metrics.waiting.set(snap.waiting as i64);
        *self.load.lock().unwrap_or_else(|p| p.into_inner()) = snap;
    }
}

/// Request `r`'s token from its row of the step: the backend's pick, or one sampled from
/// its logits (`None`: they hold a non-finite value).
fn pick(r: &mut Running, row: &RowOut, draw: Option<f64>, cfg: &ModelConfig) -> Option<Pick> {
    let logits = match row {
        RowOut::Picked(p) => {
            r.logits.observe(p.token);
            return Some(Pick {
                tok: p.token,
                logprob: p.logprob,
                top: p.top.clone(),
            });
        }
        RowOut::Logits(l) => l,
    };
    if !logits.iter().all(|x| x.is_finite()) {
        return None;
    }
    // Penalties and bans change what is picked, not the reported log-probabilities.
    let banned = r.banned(cfg);
    let tok = r.sampler.pick_drawn(r.logits.apply(logits, &banned), draw);
    r.logits.observe(tok);
    let top = r.job.output.top_logprobs as usize;
    Some(Pick {
        tok,
        logprob: sampling::logprob(logits, tok as usize),
        top: logits::top_logprobs(logits, top),
    })
}
