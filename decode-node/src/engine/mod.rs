//! The engine: one thread owns the batch and runs the step loop.
//!
//! Callers never lock: they send [`Control`] messages (a new [`Job`], a cancel, shutdown)
//! and read [`Event`]s from the job's channel. Each step admits waiting jobs (by batch size,
//! host KV for their growth, and device KV), runs one batched decode step through the model
//! with [`attend::BatchAttention`], appends the new KV, samples and streams a token per
//! request, and retires finished ones (dropping their KV returns it to the pool).

mod attend;
mod solo;

pub use solo::SoloDecoder;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use attention::{AttentionConfig, Mode, SeqAttention};
use kv_transfer::{CommittedKv, HostPool};

use crate::backend::{DeviceKv, DeviceSeq};
use tokio::sync::mpsc;

use crate::metrics::{Metrics, OutcomeLabel, ReasonLabel};
use crate::model::tokenizer::TextState;
use crate::model::{LoadedModel, Sampler, Sampling};
use attend::{BatchAttention, SeqSlot, Shape};

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_new_tokens` reached.
    Length,
    /// A stop id was generated.
    Stop,
    /// EOS was generated.
    Eos,
    /// Cancelled (Cancel, client gone, drain timeout).
    Cancelled,
    /// The model's context is full.
    ContextFull,
}

impl FinishReason {
    /// Label for `requests_total{outcome}`.
    pub fn label(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Eos => "eos",
            FinishReason::Cancelled => "cancelled",
            FinishReason::ContextFull => "context_full",
        }
    }
}

/// Per-request figures sent with the finish.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestStats {
    /// Seconds waiting for admission.
    pub queue_seconds: f64,
    /// Seconds from Generate arrival to the first token.
    pub first_token_seconds: f64,
    /// Seconds from Generate arrival to finish.
    pub total_seconds: f64,
    /// Share of selected tokens attended on the CPU.
    pub cpu_attention_ratio: f64,
    /// Blocks recalled.
    pub recalled_blocks: u64,
    /// Share of the real selection the predicted query found.
    pub prediction_hit_ratio: f64,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Seconds the device side waited on this request's CPU attention.
    pub device_wait_seconds: f64,
    /// Each layer's CPU share at every step, when the attention config profiles.
    pub layer_cpu_history: Vec<Vec<f32>>,
}

/// What a job's stream carries.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// One generated token.
    Token {
        /// 0-based index in the stream.
        index: u32,
        /// Token id.
        id: u32,
        /// Text it completes.
        text: String,
        /// Log-probability under the model.
        logprob: f32,
    },
    /// The last event of a stream.
    Finish {
        /// Why.
        reason: FinishReason,
        /// Tokens generated.
        generated: u32,
        /// Figures.
        stats: RequestStats,
    },
    /// The request could not run (the last event).
    Error(EngineError),
}

/// Why a job failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// Host or device KV cannot hold the request now (waited too long in the queue).
    #[error("{0}")]
    Exhausted(String),
    /// The engine is shutting down.
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// The model refused the input.
    #[error("{0}")]
    Model(String),
    /// A bug in the node; the request cannot go on.
    #[error("internal error: {0}")]
    Internal(String),
}

/// A generation to run: its committed KV (taken from the registry) and what to do.
#[derive(Debug)]
pub struct Job {
    /// The KV.
    pub kv: Box<CommittedKv>,
    /// The rest.
    pub spec: JobSpec,
}

/// What to generate and where to send it.
#[derive(Debug)]
pub struct JobSpec {
    /// Request id.
    pub request_id: String,
    /// Sampling.
    pub sampling: Sampling,
    /// Tokens to generate at most (> 0).
    pub max_new_tokens: u32,
    /// Extra stop ids.
    pub stop_ids: Vec<u32>,
    /// Do not stop on EOS.
    pub ignore_eos: bool,
    /// When the Generate arrived.
    pub arrived: Instant,
    /// Where events go.
    pub events: mpsc::UnboundedSender<Event>,
}

/// Messages to the engine thread.
#[derive(Debug)]
pub enum Control {
    /// Queue a job.
    Submit(Job),
    /// Cancel a job by id (queued or running).
    Cancel(String, &'static str),
    /// Cancel everything and exit.
    Shutdown,
}

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Attention policy.
    pub attention: AttentionConfig,
    /// Requests per step at most.
    pub max_batch: usize,
    /// Device KV bytes for resident blocks.
    pub device_kv_bytes: u64,
    /// Longest a job may wait for admission.
    pub queue_timeout: Duration,
    /// Threads of the CPU attention pool (separate from the device's).
    pub cpu_threads: usize,
}

/// Load figures read by `GetLoad` and metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct LoadSnapshot {
    /// Decoding.
    pub running: u32,
    /// Queued.
    pub waiting: u32,
    /// Device KV bytes in use.
    pub device_bytes: u64,
    /// Tokens per second over the last steps.
    pub tokens_per_second: f64,
}

/// Handle to the engine thread.
#[derive(Debug, Clone)]
pub struct Engine {
    tx: std_mpsc::Sender<Control>,
    load: Arc<std::sync::Mutex<LoadSnapshot>>,
}

impl Engine {
    /// Starts the engine thread.
    pub fn start(
        model: Arc<LoadedModel>,
        pool: HostPool,
        cfg: EngineConfig,
        metrics: Metrics,
    ) -> std::io::Result<(Self, std::thread::JoinHandle<()>)> {
        let (tx, rx) = std_mpsc::channel();
        let load = Arc::new(std::sync::Mutex::new(LoadSnapshot::default()));
        let cpu_pool = rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.cpu_threads.max(1))
            .thread_name(|i| format!("cpu-attn-{i}"))
            .build()
            .map_err(std::io::Error::other)?;
        let device_kv = model
            .model
            .backend()
            .device_kv(*pool.geometry(), cfg.device_kv_bytes, &pool)
            .map_err(std::io::Error::other)?;
        let mut lp = StepLoop {
            model,
            device_kv,
            pool,
            cfg,
            metrics,
            cpu_pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            load: load.clone(),
            recent: VecDeque::new(),
        };
        let h = std::thread::Builder::new()
            .name("step-loop".into())
            .spawn(move || lp.run(rx))?;
        Ok((Self { tx, load }, h))
    }

    /// Sends a control message; false when the engine has stopped.
    pub fn send(&self, c: Control) -> bool {
        self.tx.send(c).is_ok()
    }

    /// Current load.
    pub fn load(&self) -> LoadSnapshot {
        *self.load.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One f32 row per layer (a token's K or V).
type LayerRows = Vec<Vec<f32>>;

struct Running {
    job: JobSpec,
    /// Device copies of hot blocks; declared before `kv` so it is dropped (and its copies
    /// finished) first.
    dev: Option<Box<dyn DeviceSeq>>,
    kv: Arc<CommittedKv>,
    seq: SeqAttention,
    sampler: Sampler,
    next_token: u32,
    generated: u32,
    admitted: Instant,
    first_token: Option<Instant>,
    last_token: Instant,
    device_need: u64,
    text: TextState,
    device_wait: f64,
    seen: attention::SeqStats,
}

struct StepLoop {
    model: Arc<LoadedModel>,
    /// Device memory for hot blocks (`None` on the CPU backend).
    device_kv: Option<Arc<dyn DeviceKv>>,
    pool: HostPool,
    cfg: EngineConfig,
    metrics: Metrics,
    cpu_pool: rayon::ThreadPool,
    waiting: VecDeque<Job>,
    running: Vec<Running>,
    load: Arc<std::sync::Mutex<LoadSnapshot>>,
    recent: VecDeque<(Instant, usize)>,
}

impl StepLoop {
    fn run(&mut self, rx: std_mpsc::Receiver<Control>) {
        loop {
            // Block only when idle; otherwise take what arrived and step.
            if self.running.is_empty() && self.waiting.is_empty() {
                self.publish_load();
                match rx.recv() {
                    Ok(c) => {
                        if !self.control(c) {
                            return;
                        }
                    }
                    Err(_) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(c) => {
                        if !self.control(c) {
                            return;
                        }
                    }
                    Err(std_mpsc::TryRecvError::Empty) => break,
                    Err(std_mpsc::TryRecvError::Disconnected) => {
                        self.shutdown();
                        return;
                    }
                }
            }
            self.admit();
            self.publish_load();
            if self.running.is_empty() {
                // Everything waits for memory: poll again shortly.
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            self.step();
        }
    }

    fn control(&mut self, c: Control) -> bool {
        match c {
            Control::Submit(job) => {
                self.waiting.push_back(job);
                true
            }
            Control::Cancel(id, reason) => {
                if let Some(i) = self.waiting.iter().position(|j| j.spec.request_id == id)
                    && let Some(job) = self.waiting.remove(i)
                {
                    let s = &job.spec;
                    self.cancelled_event(
                        &s.events,
                        reason,
                        s.arrived,
                        job.kv.info.prompt_token_ids.len(),
                    );
                }
                if let Some(i) = self.running.iter().position(|r| r.job.request_id == id) {
                    let r = self.running.swap_remove(i);
                    self.retire(r, FinishReason::Cancelled, Some(reason));
                }
                true
            }
            Control::Shutdown => {
                self.shutdown();
                false
            }
        }
    }

    fn shutdown(&mut self) {
        for job in std::mem::take(&mut self.waiting) {
            tracing::warn!(request_id = %kv_transfer::clip(&job.spec.request_id), "shutdown: a request waiting for admission is refused UNAVAILABLE");
            let _ = job
                .spec
                .events
                .send(Event::Error(EngineError::ShuttingDown));
        }
        for r in std::mem::take(&mut self.running) {
            tracing::warn!(request_id = %kv_transfer::clip(&r.job.request_id), generated = r.generated, "shutdown: a running request is ended CANCELLED");
            self.retire(r, FinishReason::Cancelled, Some("shutdown"));
        }
    }

    fn cancelled_event(
        &self,
        tx: &mpsc::UnboundedSender<Event>,
        reason: &str,
        arrived: Instant,
        prompt: usize,
    ) {
        self.metrics
            .cancellations
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
        self.metrics
            .requests
            .get_or_create(&OutcomeLabel {
                outcome: "cancelled".into(),
            })
            .inc();
        let stats = RequestStats {
            total_seconds: arrived.elapsed().as_secs_f64(),
            prompt_tokens: prompt as u32,
            ..Default::default()
        };
        let _ = tx.send(Event::Finish {
            reason: FinishReason::Cancelled,
            generated: 0,
            stats,
        });
    }

    /// Device bytes a request may hold at most under the current mode: what it can ever
    /// attend (its prompt, the token fed first and `max_new` more, in whole blocks), capped by
    /// the resident blocks a sparse mode keeps per head — never more than it can use.
    fn device_need(&self, kv: &CommittedKv, max_new: u32) -> u64 {
        let g = kv.geometry();
        let can_attend = g.blocks_for(kv.num_tokens() + max_new as usize + 1);
        let per_head = can_attend.min(self.cfg.attention.resident_blocks_per_head());
        (per_head * g.head_bytes() * g.num_kv_heads * kv.num_layers()) as u64
    }

    fn admit(&mut self) {
        let now = Instant::now();
        // Jobs that cannot fit any more are refused rather than left waiting unbounded.
        let timeout = self.cfg.queue_timeout;
        let mut keep = VecDeque::new();
        while let Some(mut job) = self.waiting.pop_front() {
            if job.spec.events.is_closed() {
                self.metrics
                    .cancellations
                    .get_or_create(&ReasonLabel {
                        reason: "disconnect".into(),
                    })
                    .inc();
                self.metrics
                    .requests
                    .get_or_create(&OutcomeLabel {
                        outcome: "cancelled".into(),
                    })
                    .inc();
                continue;
            }
            let max_ctx = self.model.model.cfg.max_position_embeddings;
            let room = max_ctx.saturating_sub(job.kv.num_tokens() + 1);
            let max_new = (job.spec.max_new_tokens as usize).min(room.max(1)) as u32;
            let device_need = self.device_need(&job.kv, max_new);
            let device_used: u64 = self.running.iter().map(|r| r.device_need).sum();
            let fits_device = device_used + device_need <= self.cfg.device_kv_bytes;
            let can_run = self.running.len() < self.cfg.max_batch && fits_device && keep.is_empty();
            // One growth block per layer covers the token fed first; then max_new more.
            let grow_blocks = job.kv.blocks_to_grow(max_new as usize + 1);
            let host_need = (grow_blocks * job.kv.geometry().block_bytes()) as u64;
            let host_room = self.pool.usage().capacity.saturating_sub(job.kv.bytes());
            let grow = if can_run {
                self.pool.reserve(grow_blocks).ok()
            } else {
                None
            };
            match grow {
                Some(r) => {
                    job.kv.grow(r);
                    self.start(job, device_need, now);
                }
                None if now.duration_since(job.spec.arrived) > timeout
                    || device_need > self.cfg.device_kv_bytes
                    || host_need > host_room =>
                {
                    self.metrics
                        .requests
                        .get_or_create(&OutcomeLabel {
                            outcome: "rejected".into(),
                        })
                        .inc();
                    let _ = job.spec.events.send(Event::Error(EngineError::Exhausted(format!(
                        "request {:?} needs {device_need} bytes of device KV (capacity {}) and {host_need} more bytes of host KV for {max_new} new tokens (host capacity {}, {} held by its prompt); {}",
                        kv_transfer::clip(&job.spec.request_id),
                        self.cfg.device_kv_bytes,
                        self.pool.usage().capacity,
                        job.kv.bytes(),
                        if device_need > self.cfg.device_kv_bytes || host_need > host_room {
                            "it can never fit on this node"
                        } else {
                            "not available within the queue timeout"
                        }
                    ))));
                }
                None => keep.push_back(job),
            }
        }
        self.waiting = keep;
    }

    fn start(&mut self, job: Job, device_need: u64, now: Instant) {
        let Job { mut kv, spec: job } = job;
        let digests = kv.take_digests();
        let geom = *kv.geometry();
        let seq = SeqAttention::new(geom, kv.num_layers(), kv.num_tokens(), digests);
        let queue = now.duration_since(job.arrived).as_secs_f64();
        self.metrics.queue_time.observe(queue);
        let mut ctx = kv.info.prompt_token_ids.clone();
        ctx.push(kv.info.next_token_id);
        let text = self.model.tokenizer.text_state(&ctx);
        let next_token = kv.info.next_token_id;
        let kv: Arc<CommittedKv> = Arc::from(kv);
        let per_head = self.cfg.attention.resident_blocks_per_head();
        let dev = self
            .device_kv
            .clone()
            .map(|d| d.new_seq(kv.num_layers(), per_head));
        self.running.push(Running {
            dev,
            sampler: Sampler::new(job.sampling),
            job,
            kv,
            seq,
            next_token,
            generated: 0,
            admitted: now,
            first_token: None,
            last_token: now,
            device_need,
            text,
            device_wait: 0.0,
            seen: attention::SeqStats::default(),
        });
    }

    fn step(&mut self) {
        let t0 = Instant::now();
        let cfg = &self.model.model.cfg;
        let (nl, nkv, hd) = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim);
        let shape = Shape {
            num_heads: cfg.num_heads,
            num_kv_heads: nkv,
            head_dim: hd,
            scale: self.model.model.attn_scale(),
        };
        let tokens: Vec<u32> = self.running.iter().map(|r| r.next_token).collect();
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
        let t_model = Instant::now();
        let result = self
            .model
            .model
            .decode_step(&tokens, &positions, &mut batch);
        let model_s = t_model.elapsed().as_secs_f64();
        let timing = batch.timing;
        for g in &batch.guard_checks {
            self.metrics.observe_guard(g.layer, g.cosine, g.fell_back);
        }
        let new_kv: Vec<(LayerRows, LayerRows, f64)> = batch
            .slots
            .into_iter()
            .map(|s| (s.new_k, s.new_v, s.device_wait))
            .collect();
        let device_wait: f64 = new_kv.iter().map(|x| x.2).sum();
        self.metrics.device_wait_seconds.inc_by(device_wait);
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                for r in std::mem::take(&mut self.running) {
                    let _ = r
                        .job
                        .events
                        .send(Event::Error(EngineError::Model(e.to_string())));
                }
                return;
            }
        };
        let vocab = cfg.vocab_size;
        let now = Instant::now();
        let mut finished = Vec::new();
        for (i, (r, (ks, vs, wait))) in self.running.iter_mut().zip(new_kv).enumerate() {
            r.device_wait += wait;
            // Append this step's KV (the token just fed) to the host pool and the digests.
            if let Err(e) = solo::append_step(&mut r.kv, &mut r.seq, &self.cfg.attention, &ks, &vs)
            {
                // Growth was reserved at admission, so this is a bug, not a full context: say so.
                tracing::error!(request_id = %r.job.request_id, error = %e, "appending KV failed");
                finished.push((i, Err(e.to_string())));
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
            r.seen = s;

            let (tok, logprob) = r.sampler.sample(&logits[i * vocab..(i + 1) * vocab]);
            let text = r.text.step(&self.model.tokenizer, tok);
            let index = r.generated;
            r.generated += 1;
            match r.first_token {
                None => {
                    r.first_token = Some(now);
                    self.metrics
                        .ttft
                        .observe(now.duration_since(r.job.arrived).as_secs_f64());
                }
                Some(_) => self
                    .metrics
                    .itl
                    .observe(now.duration_since(r.last_token).as_secs_f64()),
            }
            r.last_token = now;
            self.metrics.generation_tokens.inc();
            if r.job
                .events
                .send(Event::Token {
                    index,
                    id: tok,
                    text,
                    logprob,
                })
                .is_err()
            {
                finished.push((i, Ok(FinishReason::Cancelled)));
                continue;
            }
            r.next_token = tok;
            let eos = !r.job.ignore_eos && cfg.eos_token_ids.contains(&tok);
            let reason = if r.job.stop_ids.contains(&tok) {
                Some(FinishReason::Stop)
            } else if eos {
                Some(FinishReason::Eos)
            } else if r.generated >= r.job.max_new_tokens {
                Some(FinishReason::Length)
            } else if r.kv.num_tokens() + 1 >= cfg.max_context() {
                Some(FinishReason::ContextFull)
            } else {
                None
            };
            if let Some(reason) = reason {
                finished.push((i, Ok(reason)));
            }
        }
        let step_s = t0.elapsed().as_secs_f64();
        self.metrics.step_duration.observe(step_s);
        let attn_s = timing.ahead + timing.plan + timing.device + timing.finish;
        tracing::debug!(
            batch = self.running.len(),
            step_s,
            model_s,
            attn_ahead_s = timing.ahead,
            attn_plan_s = timing.plan,
            attn_device_s = timing.device,
            attn_cpu_wait_s = device_wait,
            attn_finish_s = timing.finish,
            projections_s = model_s - attn_s,
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
        for (i, outcome) in finished.into_iter().rev() {
            let r = self.running.swap_remove(i);
            match outcome {
                Ok(reason) => {
                    let why = (reason == FinishReason::Cancelled).then_some("disconnect");
                    self.retire(r, reason, why);
                }
                Err(msg) => {
                    self.metrics
                        .requests
                        .get_or_create(&OutcomeLabel {
                            outcome: "error".into(),
                        })
                        .inc();
                    let _ = r.job.events.send(Event::Error(EngineError::Internal(msg)));
                }
            }
        }
    }

    fn retire(&self, r: Running, reason: FinishReason, cancel_reason: Option<&str>) {
        let now = Instant::now();
        let s = r.seq.stats();
        let stats = RequestStats {
            queue_seconds: r.admitted.duration_since(r.job.arrived).as_secs_f64(),
            first_token_seconds: r
                .first_token
                .map_or(0.0, |t| t.duration_since(r.job.arrived).as_secs_f64()),
            total_seconds: now.duration_since(r.job.arrived).as_secs_f64(),
            cpu_attention_ratio: s.cpu_ratio(),
            recalled_blocks: s.recall_blocks,
            prediction_hit_ratio: s.hit_ratio(),
            prompt_tokens: r.kv.info.prompt_token_ids.len() as u32,
            device_wait_seconds: r.device_wait,
            layer_cpu_history: r.seq.layer_history(),
        };
        self.metrics.e2e.observe(stats.total_seconds);
        self.metrics
            .requests
            .get_or_create(&OutcomeLabel {
                outcome: reason.label().into(),
            })
            .inc();
        if let Some(why) = cancel_reason {
            self.metrics
                .cancellations
                .get_or_create(&ReasonLabel { reason: why.into() })
                .inc();
        }
        let _ = r.job.events.send(Event::Finish {
            reason,
            generated: r.generated,
            stats,
        });
        // Dropping `r` frees its pool blocks and growth reservation.
    }

    fn publish_load(&mut self) {
        let now = Instant::now();
        let tokens: usize = self.recent.iter().map(|(_, n)| n).sum();
        let span = self
            .recent
            .front()
            .map_or(0.0, |(t, _)| now.duration_since(*t).as_secs_f64());
        let device_bytes: u64 = self
            .running
            .iter()
            .map(|r| match self.cfg.attention.mode {
                Mode::Full => r.kv.bytes().min(r.device_need),
                _ => r.seq.device_bytes() as u64,
            })
            .sum();
        let snap = LoadSnapshot {
            running: self.running.len() as u32,
            waiting: self.waiting.len() as u32,
            device_bytes,
            tokens_per_second: if span > 0.0 {
                tokens as f64 / span
            } else {
                0.0
            },
        };
        self.metrics.running.set(snap.running as i64);
        self.metrics.waiting.set(snap.waiting as i64);
        *self.load.lock().unwrap_or_else(|p| p.into_inner()) = snap;
    }
}
