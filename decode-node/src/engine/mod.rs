//! The engine: one thread owns the batch and runs the step loop.
//!
//! Callers never lock: they send [`Control`] messages (a new [`Job`], a cancel, shutdown)
//! and read [`Event`]s from the job's channel. Each step admits waiting jobs (by batch size,
//! host KV for their growth, and device KV), runs one batched decode step through the model
//! with `attend::BatchAttention`, appends the new KV, samples and streams a token per
//! request, and retires finished ones (dropping their KV returns it to the pool).

pub(crate) mod admission;
mod attend;
mod error;
mod job;
mod lend;
mod profile;
mod running;
mod solo;
mod step;
mod stop_text;

pub use error::EngineError;
pub use job::{
    Control, Event, FinishReason, Job, JobSpec, OutputOptions, RequestStats, TopLogprob,
};
pub(crate) use running::take_pages;
pub use solo::SoloDecoder;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use attention::AttentionConfig;
use kv_transfer::HostPool;
use tokio::sync::mpsc;

use crate::backend::DeviceKv;
use crate::metrics::{Metrics, OutcomeLabel, ReasonLabel};
use crate::model::LoadedModel;
use admission::{Decision, Need, Room};
use running::Running;

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
    /// Threads of the CPU-attention pool. On a backend that runs on rayon (the CPU device),
    /// the whole step runs in this pool: model, selection and attention share its threads
    /// rather than two pools contending for the same cores.
    pub cpu_threads: usize,
    /// Where a finished request's KV goes for the next turn (none: back to the pool).
    pub prefix_cache: Option<Arc<kv_transfer::PrefixCache>>,
    /// Lend device KV no request counts on to running `scout` and `recall` requests, each
    /// taking room for every block it may hold (`--spare-device-kv`).
    pub lend_spare_device: bool,
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
    /// Device KV bytes admission counts against: `--device-kv-bytes`, or what the device's
    /// arena holds where free memory allowed less.
    pub device_capacity: u64,
    /// Of `device_bytes`, what requests hold past the share admission counted for them: blocks
    /// on loans of spare device KV (`--spare-device-kv`). Not taken, to a router: a loan goes
    /// back as soon as a request needs the room to start.
    pub device_lent: u64,
    /// Tokens per second over the last steps.
    pub tokens_per_second: f64,
    /// The device was lost: the engine refuses everything until the process restarts.
    pub device_lost: bool,
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
        tracing::info!(
            threads = cpu_pool.current_num_threads(),
            "CPU-attention pool"
        );
        let device_kv = model
            .model
            .backend()
            .device_kv(*pool.geometry(), cfg.device_kv_bytes, &pool)
            .map_err(std::io::Error::other)?;
        let mut cfg = cfg;
        if let Some(d) = &device_kv {
            if d.capacity_bytes() < cfg.device_kv_bytes {
                if cfg.device_kv_bytes != crate::cli::DEVICE_KV_AUTO {
                    tracing::warn!(
                        asked = cfg.device_kv_bytes,
                        holds = d.capacity_bytes(),
                        "the device KV arena holds less than --device-kv-bytes (free device memory); admission counts what it holds"
                    );
                }
                cfg.device_kv_bytes = d.capacity_bytes();
            }
            metrics
                .device_kv_copies_staged
                .set(i64::from(!d.host_pool_pinned()));
            check_resident(&model.model, d, pool.geometry());
        }
        if let Ok(mut l) = load.lock() {
            // What GetLoad and the metrics read before the loop's first publish.
            l.device_capacity = reported_capacity(device_kv.is_some(), cfg.device_kv_bytes);
        }
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
            lost: None,
            profile: profile::ProfileWindow::from_env(),
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

/// The device KV capacity GetLoad and the metrics report: what admission counts against, or
/// 0 where there is no device and no limit was given (`--device-kv-bytes auto` on the CPU).
fn reported_capacity(device: bool, bytes: u64) -> u64 {
    if !device && bytes == crate::cli::DEVICE_KV_AUTO {
        0
    } else {
        bytes
    }
}

/// Largest distance, relative to the largest logit, between a decode step whose layers run
/// resident on the device and the host path's (the device residual's own tolerance).
const RESIDENT_TOLERANCE: f64 = crate::model::llama::RESIDUAL_TOLERANCE;

/// A backend whose layers attend where the residual is must give the host path's logits:
/// checked once at start on a short sequence in `dev`; where they differ with the device's
/// graphs on, again with them off; where they still differ, layers attend through the host
/// from then on.
fn check_resident(
    model: &crate::model::Model,
    dev: &Arc<dyn crate::backend::DeviceKv>,
    geom: &attention::BlockGeometry,
) {
    let backend = model.backend();
    if !backend.attention_on_device() {
        return;
    }
    // At most twice: with graphs, then without.
    for _ in 0..2 {
        let why = match crate::backend::resident::resident_diff(model, dev, geom) {
            Ok((diff, None)) if diff <= RESIDENT_TOLERANCE => {
                tracing::info!(
                    diff,
                    "layers attended on the device give the host path's logits"
                );
                return;
            }
            Ok((diff, err)) => format!("relative difference {diff:e}, error {err:?}"),
            Err(e) => format!("the check failed: {e}"),
        };
        if backend.graphs_on() {
            tracing::error!(%why, "layers attended on the device with CUDA graphs do not give the host path's logits; graphs off, checking again");
            backend.turn_graphs_off(&why);
            continue;
        }
        tracing::error!(%why, "layers attended on the device do not give the host path's logits; attending through the host");
        break;
    }
    backend.keep_attention_on_host();
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
    /// Set when a step lost the device: why; every request after it is refused.
    lost: Option<String>,
    /// Steps the device profiler records (`DECODE_NODE_PROFILE_STEPS`).
    profile: Option<profile::ProfileWindow>,
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
                    let (events, arrived) = (job.spec.events.clone(), job.spec.arrived);
                    let prompt_len = job.kv.info.prompt_token_ids.len();
                    drop(job); // frees its KV before the client hears the end
                    self.cancelled_event(&events, reason, arrived, prompt_len);
                }
                if let Some(i) = self.running.iter().position(|r| r.job.request_id == id) {
                    let r = self.running.swap_remove(i);
                    self.retire(r, FinishReason::Cancelled, Some(reason));
                }
                // GetLoad sees the cancel now, not after the next step.
                self.publish_load();
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
            job.spec.span.in_scope(|| {
                tracing::warn!("shutdown: a request waiting for admission is refused UNAVAILABLE")
            });
            let _ = job
                .spec
                .events
                .send(Event::Error(EngineError::ShuttingDown));
        }
        for r in std::mem::take(&mut self.running) {
            r.job.span.in_scope(|| {
                tracing::warn!(
                    generated = r.generated,
                    "shutdown: a running request is ended CANCELLED"
                )
            });
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

    fn admit(&mut self) {
        if let Some(why) = &self.lost {
            let e = EngineError::DeviceLost(why.clone());
            for job in std::mem::take(&mut self.waiting) {
                self.count_outcome("error");
                let events = job.spec.events.clone();
                drop(job); // frees its KV before the client hears the end
                let _ = events.send(Event::Error(e.clone()));
            }
            return;
        }
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
            let geom = *job.kv.geometry();
            let group = self.model.model.cfg.num_heads / geom.num_kv_heads.max(1);
            let sketch = admission::SketchSlots::of_node(
                &self.cfg.attention,
                &geom,
                job.kv.num_layers(),
                self.device_kv
                    .as_ref()
                    .is_some_and(|d| d.keeps_sketch(group)),
            );
            let request = admission::Request {
                geom,
                num_layers: job.kv.num_layers(),
                num_tokens: job.kv.num_tokens(),
                prompt_bytes: job.kv.bytes(),
                max_new_tokens: job.spec.max_new_tokens,
            };
            let max_context = self.model.model.cfg.max_position_embeddings;
            let need = Need::of(
                &request,
                max_context,
                self.cfg.attention.resident_blocks_per_head(),
                sketch,
            );
            let share = request.share(
                max_context,
                self.cfg.attention.resident_blocks_per_head(),
                sketch,
            );
            let mut room = self.room(!keep.is_empty());
            let mut decision = admission::decide(&need, &room);
            if decision == Decision::Wait && self.call_back_loans_for(&need, &room) {
                room = self.room(!keep.is_empty());
                decision = admission::decide(&need, &room);
            }
            let grow = match decision {
                Decision::Start => self.pool.reserve(need.grow_blocks + need.sketch_pages).ok(),
                Decision::Wait => None,
            };
            if let Some(mut r) = grow {
                let pages = running::take_pages(&mut r, need.sketch_pages);
                job.kv.grow(r);
                let mut run = self.start(job, share, now);
                if let Some(s) = sketch.filter(|s| !s.on_device) {
                    run.seq
                        .keep_sketch(&self.cfg.attention, pages, s.tokens_per_slot);
                }
                self.running.push(run);
                continue;
            }
            let waited = now.duration_since(job.spec.arrived);
            match admission::refusal(&need, &room, waited, timeout) {
                Some(why) => {
                    self.metrics
                        .requests
                        .get_or_create(&OutcomeLabel {
                            outcome: "rejected".into(),
                        })
                        .inc();
                    let msg = why.message(&job.spec.request_id, &need, &room);
                    let events = job.spec.events.clone();
                    drop(job); // frees its KV before the client hears the refusal
                    let _ = events.send(Event::Error(EngineError::Exhausted(msg)));
                }
                None => keep.push_back(job),
            }
        }
        self.waiting = keep;
        if self.waiting.is_empty() {
            self.lend_spare_device();
        }
    }

    /// The node's room for the next admission (`queue_blocked`: a request ahead of it waits).
    fn room(&self, queue_blocked: bool) -> Room {
        Room {
            running: self.running.len(),
            max_batch: self.cfg.max_batch,
            device_used: self.running.iter().map(|r| r.device.counted()).sum(),
            device_capacity: self.cfg.device_kv_bytes,
            host_capacity: self.pool.usage().capacity,
            queue_blocked,
        }
    }

    /// True where spare device KV is lent: a device keeps KV, lending is on, and the mode
    /// attends a selection whose blocks may all live on the device (`scout`, `recall`).
    fn lends(&self) -> bool {
        self.cfg.lend_spare_device
            && self.device_kv.is_some()
            && matches!(
                self.cfg.attention.mode,
                attention::Mode::Scout | attention::Mode::Recall
            )
    }

    /// Lends what no running request counts on ([`lend::lend_to`]).
    fn lend_spare_device(&mut self) {
        if !self.lends() {
            return;
        }
        // Oldest first: the batch's order is not the order of admission once a request
        // has left it.
        let mut order: Vec<usize> = (0..self.running.len()).collect();
        order.sort_by_key(|&i| self.running[i].admitted);
        let shares: Vec<lend::Share> = order.iter().map(|&i| self.running[i].device).collect();
        for loan in lend::lend_to(&shares, self.cfg.device_kv_bytes) {
            let r = &mut self.running[order[loan.index]];
            match r.set_loan(&self.cfg.attention, loan.lent) {
                Ok(()) => {
                    self.metrics.loan("lent");
                    r.job.span.in_scope(|| {
                        tracing::debug!(
                            device_bytes = r.device.counted(),
                            blocks_per_head = r.device.slots(),
                            every_block = r.device.slots() >= r.device.whole,
                            "lent spare device KV"
                        )
                    })
                }
                Err(e) => {
                    // Asked no more: its device holds what it has.
                    r.device.whole = r.device.slots();
                    r.job.span.in_scope(|| {
                        tracing::warn!(error = %e, "lending spare device KV failed; the request keeps what it holds")
                    })
                }
            }
        }
    }

    /// Where `need` waits for device KV that loans hold and would start without them (in
    /// `room`), shrinks the loans as little as makes room ([`lend::call_back_for`]); true
    /// when any shrank. A request whose device fails to give its loan back ends with that
    /// error.
    fn call_back_loans_for(&mut self, need: &Need, room: &Room) -> bool {
        if !self.lends() {
            return false;
        }
        let shares: Vec<lend::Share> = self.running.iter().map(|r| r.device).collect();
        let Some(back) = lend::call_back_for(&shares, room.device_capacity, need.device) else {
            return false;
        };
        let freed: u64 = back
            .iter()
            .map(|l| shares[l.index].counted() - shares[l.index].with_lent(l.lent).counted())
            .sum();
        let without = Room {
            device_used: room.device_used - freed,
            ..*room
        };
        if back.is_empty() || admission::decide(need, &without) == Decision::Wait {
            return false;
        }
        let mut failed = Vec::new();
        for loan in &back {
            let r = &mut self.running[loan.index];
            if let Err(e) = r.set_loan(&self.cfg.attention, loan.lent) {
                failed.push((
                    loan.index,
                    EngineError::from(crate::model::ModelError::Backend(e)),
                ));
            } else {
                self.metrics.loan("called_back");
                r.job.span.in_scope(|| {
                    tracing::debug!(
                        blocks_per_head = r.device.slots(),
                        "gave spare device KV back"
                    )
                });
            }
        }
        // Highest index first: `swap_remove` moves only entries past the ones still to go.
        failed.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, e) in failed {
            if matches!(e, EngineError::DeviceLost(_)) {
                self.fail_batch(e);
                return false;
            }
            let r = self.running.swap_remove(i);
            r.job.span.in_scope(|| {
                tracing::warn!(error = %e, "giving its loan of spare device KV back failed; the request ends")
            });
            self.count_outcome("error");
            let events = r.job.events.clone();
            drop(r); // frees its KV before the client hears the end
            let _ = events.send(Event::Error(e));
        }
        true
    }

    fn start(&self, job: Job, device: lend::Share, now: Instant) -> Running {
        let queue = now.duration_since(job.spec.arrived).as_secs_f64();
        self.metrics.queue_time.observe(queue);
        self.metrics
            .prompt_tokens
            .inc_by(job.kv.info.prompt_token_ids.len() as u64);
        job.spec.span.in_scope(|| {
            tracing::debug!(
                mode = self.cfg.attention.mode.name(),
                queue_s = queue,
                device_bytes = device.base_bytes(),
                batch = self.running.len() + 1,
                "admitted"
            )
        });
        Running::start(
            job,
            device,
            now,
            &self.model.tokenizer,
            self.device_kv.as_ref(),
            self.cfg.attention.resident_blocks_per_head(),
        )
    }
}

#[cfg(test)]
mod tests;
