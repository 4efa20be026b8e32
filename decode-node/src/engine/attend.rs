//! The attention of one decode step for a whole batch: plans each request's layer with its
//! `SeqAttention` (in `scout` a layer ahead, by the predicted query, while the layer before
//! attends), runs the device part on the step thread and the CPU part on the CPU pool, and
//! merges the two exactly.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError, mpsc};
use std::time::{Duration, Instant};

use attention::{
    AttentionConfig, BlockKeys, BlockScorer, DeviceBlock, DevicePlan, HeadPlan, HeadQuery, Mode,
    Partial, Scratch, SeqAttention, attend_head, cosine,
};
use kv_transfer::CommittedKv;
use rayon::prelude::*;

use crate::backend::{DeviceSeq, Landing, ResidentSeq, Scored, SketchCall, Ticket};
use crate::model::{DecodeAttention, ModelError};

/// Steps between measurements of the layer-ahead prediction (hit ratio, query cosine).
const PREDICTION_SAMPLE_STEPS: u64 = 8;

/// What one request brings to a step's attention.
#[derive(Debug)]
pub(crate) struct SeqSlot<'a> {
    pub(crate) kv: &'a Arc<CommittedKv>,
    pub(crate) seq: &'a mut SeqAttention,
    /// Device memory of this sequence's hot blocks; `None`: the device part reads the host
    /// pool (CPU backend).
    pub(crate) dev: Option<&'a mut Box<dyn DeviceSeq>>,
    /// New K and V of this step, per layer (`[num_kv_heads * head_dim]`), appended after it.
    pub(crate) new_k: Vec<Vec<f32>>,
    pub(crate) new_v: Vec<Vec<f32>>,
    /// Seconds the device side waited on this sequence's CPU part during the step.
    pub(crate) device_wait: f64,
}

/// A layer planned ahead: the layer, its plans and, where the CPU part is attended with the
/// predicted query ([`attention::PredictionGuard::predicted_cpu`]), where its result arrives.
#[derive(Debug)]
struct Ahead {
    layer: usize,
    plans: Vec<HeadPlan>,
    q_pred: Vec<f32>,
    job: Option<CpuJob>,
}

/// A CPU part running on the CPU pool.
#[derive(Debug)]
struct CpuJob {
    /// The partials, the seconds the part took and the seconds it waited for a thread.
    rx: mpsc::Receiver<(Vec<Partial>, f64, f64)>,
    /// Set when the result is no longer wanted: heads not started yet are skipped.
    cancel: Arc<AtomicBool>,
    /// Where the part lands as soon as it ends, when the step goes on without waiting.
    hook: Arc<Mutex<JobHook>>,
}

/// A CPU part's landing ticket, handed over while the part may be running.
#[derive(Debug, Default)]
struct JobHook {
    ticket: Option<Ticket>,
    /// The part has ended: a ticket handed over now is not taken.
    ended: bool,
}

impl CpuJob {
    /// Has the part land its partials with `ticket` when it ends; the ticket back where it
    /// has ended already (its result is then on `rx`).
    fn land_with(&self, ticket: Ticket) -> Option<Ticket> {
        let mut hook = self.hook.lock().unwrap_or_else(PoisonError::into_inner);
        if hook.ended {
            return Some(ticket);
        }
        hook.ticket = Some(ticket);
        None
    }
}

/// One guard check: a layer's lowest query cosine and whether it was redone.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct GuardCheck {
    pub(crate) layer: usize,
    pub(crate) cosine: f32,
    pub(crate) fell_back: bool,
}

/// Shapes the attention needs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) scale: f32,
}

/// Seconds the step thread spent in each part of attention during one step (logged at
/// debug level: where a step's time goes on the host).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct AttnTiming {
    /// Planning a layer ahead (selection with the predicted query, CPU part started).
    pub(crate) ahead: f64,
    /// Planning at the layer itself (selection, prediction bookkeeping).
    pub(crate) plan: f64,
    /// The device part (copies, kernels, results back) and merging.
    pub(crate) device: f64,
    /// Recording the layer and starting recall copies.
    pub(crate) finish: f64,
    /// CPU parts, on the CPU pool (not the step thread), redone ones included.
    pub(crate) cpu: f64,
    /// Of `plan` and `ahead`: waiting for block scores from a device (its sketch kernels and
    /// their copy back, where they were not done when asked for).
    pub(crate) scores: f64,
    /// Of `plan` and `ahead`: choosing the blocks (scoring them too where the host scores)
    /// and planning their residency.
    pub(crate) select: f64,
    /// CPU parts' waits for a thread of the pool, from being started to running.
    pub(crate) cpu_start: f64,
    /// Queuing a device's block scoring of a resident layer's query rows (the sketch's new
    /// tokens, its upload and launches, the copy back): host time while the device runs the
    /// projections, so not in `plan`, which the device waits through.
    pub(crate) queue: f64,
    /// Resident layers a device planned alone, summed over the batch's sequences (a count,
    /// not seconds).
    pub(crate) layers_on_device: usize,
}

impl AttnTiming {
    /// Adds `o`'s seconds to these.
    pub(crate) fn add(&mut self, o: &AttnTiming) {
        self.ahead += o.ahead;
        self.plan += o.plan;
        self.device += o.device;
        self.finish += o.finish;
        self.cpu += o.cpu;
        self.scores += o.scores;
        self.select += o.select;
        self.cpu_start += o.cpu_start;
        self.queue += o.queue;
        self.layers_on_device += o.layers_on_device;
    }
}

/// [`DecodeAttention`] over a batch of sequences.
#[derive(Debug)]
pub(crate) struct BatchAttention<'a> {
    pub(crate) cfg: &'a AttentionConfig,
    pub(crate) shape: Shape,
    pub(crate) cpu_pool: &'a rayon::ThreadPool,
    pub(crate) slots: Vec<SeqSlot<'a>>,
    /// Per sequence, the layers planned ahead, found by layer when they attend: layer
    /// `i + 1`'s is planned during layer `i`, after layer `i`'s own was taken.
    ahead: Vec<Vec<Ahead>>,
    /// The layer and batch's predicted query handed over last, planned once the current
    /// layer's parts are under way.
    deferred: Option<(usize, Vec<f32>)>,
    /// Per sequence, what its device is scoring without a wait (`queue_scores`), for
    /// `device_scores` to take.
    queued: Vec<Option<Scoring>>,
    pub(crate) timing: AttnTiming,
    /// This step's guard checks, for the per-layer metrics.
    pub(crate) guard_checks: Vec<GuardCheck>,
    /// Per sequence, the resident layer planned last: its plans and CPU part (none where its
    /// device planned it).
    resident_pending: Vec<Planned>,
    /// Per sequence, the layers its device planned alone this step (`device_plan`), planned
    /// on the host from their picks once the step's wait brought them back (`resident_done`).
    on_device: Vec<Vec<usize>>,
    /// Every sequence's selection is scored on its device (`selects_on_device`).
    selects_on_device: bool,
    /// CPU parts that land where the residual is (`finish_resident` with a landing), by
    /// sequence: their timing and errors are taken at the step's end.
    landing_jobs: Vec<(usize, CpuJob)>,
    /// This step's landings, checked whole at its end.
    landings: Vec<Arc<Landing>>,
    /// Each layer's plans, whether its CPU part used the predicted query, and each head's
    /// resident blocks when the plan was made (a recall after the layer changes them).
    #[cfg(test)]
    plan_log: Vec<PlanRecord>,
}

/// Block scores a device was asked for: a layer's, by its predicted query or the real one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Scoring {
    layer: usize,
    predicted: bool,
}

/// A sequence's layer as planned: its heads' plans and its CPU part, if any.
type Planned = (Vec<HeadPlan>, Option<CpuJob>);

/// A layer's plans, whether its CPU part used the predicted query, and each head's resident
/// blocks when the plan was made.
#[cfg(test)]
type PlanRecord = (usize, Vec<HeadPlan>, bool, Vec<Vec<usize>>);

/// How long a device's step thread spins on a CPU part's answer before it blocks.
const SPIN_BEFORE_BLOCKING: Duration = Duration::from_micros(500);

/// Fewest blocks a task takes when a part's blocks are split across threads: a model with
/// few KV heads (SmolLM2 has 3) would otherwise leave threads idle or wait on the last head.
const MIN_BLOCKS_PER_TASK: usize = 16;

/// About how many tasks at most a layer's attention of long lists is cut into ([`runs`]):
/// runs longer than [`MIN_BLOCKS_PER_TASK`] where the work allows, since each task starts its
/// stream of prefetches cold (its first block is read on demand) and makes and merges a
/// partial of its own. Batch 8 at 4k on SmolLM2 (24 lists of 128 blocks, 2 threads, AVX2): attention took
/// 26-29 ms a step with runs of 16 and 24.5-28 with runs of 128 (four alternating runs
/// each), but a later A/B of these runs of 64 against 16 stayed within the VM's noise. A
/// count, not a share of the threads, so the result does not depend on the thread count;
/// 64 leaves 4 tasks a thread at 16 threads.
const TASKS_PER_LAYER: usize = 64;

/// Each list cut into runs of nearly equal length, by list and in order: `(list, start, end)`.
/// A run is at least a target length and under twice it: the total's share of
/// [`TASKS_PER_LAYER`] runs, and never under [`MIN_BLOCKS_PER_TASK`]. A list shorter than the
/// target is one run (so many short lists make more runs than that), an empty one none.
fn runs(lens: impl Iterator<Item = usize> + Clone) -> impl Iterator<Item = (usize, usize, usize)> {
    let total: usize = lens.clone().sum();
    let target = total.div_ceil(TASKS_PER_LAYER).max(MIN_BLOCKS_PER_TASK);
    lens.enumerate().flat_map(move |(i, len)| {
        let n = if len == 0 { 0 } else { (len / target).max(1) };
        (0..n).map(move |k| (i, len * k / n, len * (k + 1) / n))
    })
}

/// Attention of each head's `blocks` with `q`, on the current rayon pool: every head's list
/// in [`runs`], all runs in parallel, merged per head in list order (so the result does not
/// depend on the thread count). Runs not started when `cancel` is set are skipped; the
/// caller then discards the result.
fn attend_lists(
    kv: &CommittedKv,
    shape: Shape,
    layer: usize,
    lists: &[&[usize]],
    q: &[f32],
    cancel: Option<&AtomicBool>,
) -> Vec<Partial> {
    let mut parts = attend_seqs(shape, layer, &[SeqLists { kv, lists, q }], cancel);
    parts.pop().unwrap_or_default()
}

/// One sequence's share of [`attend_seqs`]: its KV, each head's blocks and its query.
struct SeqLists<'a> {
    kv: &'a CommittedKv,
    lists: &'a [&'a [usize]],
    q: &'a [f32],
}

/// [`attend_lists`] for several sequences in one parallel region: at batch 8 on a model with
/// few KV heads, a region per sequence was 240 fork-joins a step over a few microseconds of
/// work each, with 3 heads' runs on 2 threads leaving one idle. Each sequence's partials
/// are merged in its own list order, as [`attend_lists`] does, so batching changes no bit.
fn attend_seqs(
    shape: Shape,
    layer: usize,
    seqs: &[SeqLists<'_>],
    cancel: Option<&AtomicBool>,
) -> Vec<Vec<Partial>> {
    // Every sequence's lists in one numbering: `(sequence, head)` by list.
    let lists: Vec<(usize, usize, &[usize])> = seqs
        .iter()
        .enumerate()
        .flat_map(|(b, s)| s.lists.iter().enumerate().map(move |(h, l)| (b, h, *l)))
        .collect();
    let runs: Vec<(usize, usize, &[usize])> = runs(lists.iter().map(|l| l.2.len()))
        .map(|(i, start, end)| (lists[i].0, lists[i].1, &lists[i].2[start..end]))
        .collect();
    let partials: Vec<Option<Partial>> = runs
        .par_iter()
        .map_init(Scratch::default, |scratch, &(b, h, blocks)| {
            if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                return None;
            }
            let s = &seqs[b];
            let per = s.q.len() / shape.num_kv_heads;
            let hq = HeadQuery {
                layer,
                head: h,
                q: &s.q[h * per..(h + 1) * per],
                scale: shape.scale,
            };
            Some(attend_head(s.kv.geometry(), s.kv, hq, blocks, scratch))
        })
        .collect();
    let mut parts: Vec<Vec<Partial>> = seqs
        .iter()
        .map(|s| {
            let group = s.q.len() / shape.num_kv_heads / shape.head_dim;
            (0..s.lists.len())
                .map(|_| Partial::empty(group, shape.head_dim))
                .collect()
        })
        .collect();
    for (&(b, h, _), p) in runs.iter().zip(&partials) {
        if let Some(p) = p {
            parts[b][h].merge_from(p);
        }
    }
    parts
}

/// One sequence's planning of a layer: its state, KV, query (`None`: not planned) and the
/// block scores (or picks) a device made for it.
type Planning<'a> = (
    &'a mut SeqAttention,
    &'a CommittedKv,
    Option<&'a [f32]>,
    Option<Scored>,
);

/// Plans `seq`'s `layer` from what its device scored (`None`: scored here, by `q` over
/// `keys`). Picks that are not the answer the layer's cut asks for are logged and the host
/// scores instead: a device's answer is checked, not trusted.
fn plan_from(
    seq: &mut SeqAttention,
    cfg: &AttentionConfig,
    layer: usize,
    q: &[f32],
    keys: BlockKeys<'_>,
    scored: Option<Scored>,
) -> Vec<HeadPlan> {
    match scored {
        Some(Scored::Scores(s)) => seq.plan_layer_scored(cfg, layer, &s),
        Some(Scored::Picks(p)) => seq.plan_layer_picked(cfg, layer, &p).unwrap_or_else(|| {
            tracing::warn!(
                layer,
                "device block picks are not the layer's cut; the host scores"
            );
            seq.plan_layer(cfg, layer, q, keys)
        }),
        None => seq.plan_layer(cfg, layer, q, keys),
    }
}

/// Runs the CPU part: every head's `plan.cpu` blocks with `q`, on the current rayon pool
/// (the CPU attention pool: this runs inside one of its tasks).
fn cpu_part(
    kv: &CommittedKv,
    shape: Shape,
    layer: usize,
    plans: &[HeadPlan],
    q: &[f32],
    cancel: &AtomicBool,
) -> Vec<Partial> {
    let lists: Vec<&[usize]> = plans.iter().map(|p| p.cpu.as_slice()).collect();
    attend_lists(kv, shape, layer, &lists, q, Some(cancel))
}

/// The answer on `rx`, `None` when its sender is gone. On a thread of a rayon pool (the step
/// of the CPU device runs in the CPU-attention pool itself) the wait runs the pool's pending
/// jobs meanwhile: the CPU part waited for may be queued behind this very thread, which would
/// deadlock a blocking receive on a pool of one thread. Elsewhere, with `spin` (a device's
/// step thread), it spins for up to [`SPIN_BEFORE_BLOCKING`] first: a CPU part takes a few
/// hundred microseconds, and a blocked thread woke 8.6 us (median) after the answer was sent
/// where spinning saw it after 0.9 (2-core Xeon VM, 150 us jobs).
fn recv_in_pool<T>(rx: &mpsc::Receiver<T>, spin: bool) -> Option<T> {
    if rayon::current_thread_index().is_none() {
        let start = Instant::now();
        while spin && start.elapsed() < SPIN_BEFORE_BLOCKING {
            match rx.try_recv() {
                Ok(v) => return Some(v),
                Err(mpsc::TryRecvError::Disconnected) => return None,
                Err(mpsc::TryRecvError::Empty) => std::hint::spin_loop(),
            }
        }
        return rx.recv().ok();
    }
    loop {
        match rx.try_recv() {
            Ok(v) => return Some(v),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) => {
                if rayon::yield_now() != Some(rayon::Yield::Executed) {
                    std::thread::yield_now();
                }
            }
        }
    }
}

impl<'a> BatchAttention<'a> {
    pub(crate) fn new(
        cfg: &'a AttentionConfig,
        shape: Shape,
        cpu_pool: &'a rayon::ThreadPool,
        slots: Vec<SeqSlot<'a>>,
    ) -> Self {
        let n = slots.len();
        let selects_on_device = Self::selecting_on_device(cfg, shape, &slots);
        Self {
            cfg,
            shape,
            cpu_pool,
            slots,
            ahead: (0..n).map(|_| Vec::with_capacity(2)).collect(),
            deferred: None,
            queued: vec![None; n],
            timing: AttnTiming::default(),
            guard_checks: Vec::new(),
            resident_pending: Vec::new(),
            on_device: vec![Vec::new(); n],
            selects_on_device,
            landing_jobs: Vec::new(),
            landings: Vec::new(),
            #[cfg(test)]
            plan_log: Vec::new(),
        }
    }

    /// Sequence `b`'s `layer` as its device can plan it alone this step (#21 item 4): where
    /// every sequence selects on its device, the sequence's residency allows it
    /// ([`SeqAttention::device_plan`]: every block on the device) and the device holds every
    /// block it may pick and picks them itself. The layer's query then stays on the device,
    /// and the layer waits for nothing: no host round trip between its projections and its
    /// attention.
    fn device_plan(&self, b: usize, layer: usize) -> Option<(DevicePlan, SketchCall)> {
        let call = self.device_call(b, layer)?;
        let plan = self.slots[b].seq.device_plan(self.cfg, layer)?;
        Some((plan, call))
    }

    /// [`Self::device_plan`]'s test alone (no lists made): the device's sketch call where it
    /// plans sequence `b`'s `layer` alone.
    fn device_call(&self, b: usize, layer: usize) -> Option<SketchCall> {
        if !self.selects_on_device() {
            return None;
        }
        let n = self.scored_blocks(b, layer)?;
        let slot = &self.slots[b];
        let cut = slot.seq.device_cut(self.cfg, layer)?;
        let call = SketchCall {
            pick: Some(cut),
            ..self.sketch_call(b, layer, n - 1)
        };
        let dev = slot.dev.as_deref()?;
        dev.picks_resident(&call).then_some(call)
    }

    fn spawn_cpu(&self, b: usize, layer: usize, plans: &[HeadPlan], q: &[f32]) -> CpuJob {
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let kv = Arc::clone(self.slots[b].kv);
        let plans = plans.to_vec();
        let q = q.to_vec();
        let shape = self.shape;
        let flag = Arc::clone(&cancel);
        let hook = Arc::new(Mutex::new(JobHook::default()));
        let landing = Arc::clone(&hook);
        let queued = Instant::now();
        self.cpu_pool.spawn(move || {
            let t = Instant::now();
            let out = cpu_part(&kv, shape, layer, &plans, &q, &flag);
            let out = (out, t.elapsed().as_secs_f64(), (t - queued).as_secs_f64());
            // Let go of the KV before answering: the step appends to it right after the last
            // answer, which needs it unshared.
            drop(kv);
            let ticket = {
                let mut hook = landing.lock().unwrap_or_else(PoisonError::into_inner);
                hook.ended = true;
                hook.ticket.take()
            };
            if let Some(ticket) = ticket {
                // Partials that do not fit land empty and break the landing, which the
                // step's end reports.
                let _ = ticket.land(&out.0);
            }
            // The receiver is gone only if the step was abandoned; nothing to do then.
            let _ = tx.send(out);
        });
        CpuJob { rx, cancel, hook }
    }

    /// Waits for sequence `b`'s CPU part; the wait is device idle time. A part that never
    /// answers (its task panicked) is an error, not an empty result: merging nothing would
    /// silently change the attention.
    fn wait(&mut self, b: usize, job: &CpuJob) -> Result<Vec<Partial>, ModelError> {
        let t = Instant::now();
        // A device's step thread has its core to itself; elsewhere the wait shares the
        // cores the CPU part runs on.
        let spin = self.slots[b].dev.is_some();
        let r = recv_in_pool(&job.rx, spin).ok_or_else(|| {
            ModelError::Attention("the CPU part of attention was lost (its task failed)".into())
        });
        self.slots[b].device_wait += t.elapsed().as_secs_f64();
        let (parts, secs, start) = r?;
        self.timing.cpu += secs;
        self.timing.cpu_start += start;
        Ok(parts)
    }

    /// What selection may read of sequence `b` besides its digests.
    fn block_keys(&self, b: usize) -> BlockKeys<'a> {
        let kv: &'a Arc<CommittedKv> = self.slots[b].kv;
        BlockKeys {
            src: &**kv,
            scale: self.shape.scale,
        }
    }

    /// Drops a CPU part started ahead whose result will not be used; waits for its task, which
    /// holds the sequence's KV until it ends.
    fn discard(&mut self, b: usize, job: CpuJob) -> Result<(), ModelError> {
        job.cancel.store(true, Ordering::Relaxed);
        self.wait(b, &job).map(drop)
    }

    /// Plans and CPU part of sequence `b`'s `layer`: the ones started a layer ahead when the
    /// guard accepts the prediction, else planned now with the real query `qb` (the CPU part
    /// then runs while the device part does).
    fn plans_for(
        &mut self,
        b: usize,
        layer: usize,
        qb: &[f32],
    ) -> Result<(Vec<HeadPlan>, Option<CpuJob>, bool), ModelError> {
        if let Some((plans, job)) = self.accepted(b, layer, qb)? {
            return Ok((plans, job, true));
        }
        let scored = self.device_scores(b, layer, qb, false);
        let t = Instant::now();
        let keys = self.block_keys(b);
        let plans = plan_from(self.slots[b].seq, self.cfg, layer, qb, keys, scored);
        self.timing.select += t.elapsed().as_secs_f64();
        let job = self.spawn_real_cpu(b, layer, &plans, qb);
        Ok((plans, job, false))
    }

    /// True when every sequence's selection is scored on its device and no CPU part is
    /// started with a predicted query: a prediction then only costs (a projection per layer)
    /// and selects worse than the real query, which the device scores in microseconds. On an
    /// H200 (Qwen3-14B shape, 10 layers, budget 2048) scout with the sketch scorer gave 74.7
    /// tokens/s at 64k without predictions against 65.8 with them; on SmolLM2 at 7.8k
    /// (budget 1024) top-1 agreement with full 0.957 (KL 0.0104) against 0.953 (KL 0.0113).
    /// Read once a step ([`Self::new`]): it is asked for each sequence and layer.
    fn selects_on_device(&self) -> bool {
        self.selects_on_device
    }

    /// [`Self::selects_on_device`] of a step over `slots`.
    fn selecting_on_device(cfg: &AttentionConfig, shape: Shape, slots: &[SeqSlot<'_>]) -> bool {
        let group = shape.num_heads / shape.num_kv_heads.max(1);
        cfg.scorer == BlockScorer::Sketch
            && !cfg.guard.predicted_cpu
            && !slots.is_empty()
            && slots
                .iter()
                .all(|s| s.dev.as_deref().is_some_and(|d| d.scores_on_device(group)))
    }

    /// Sequence `b`'s block scores of `layer` by `q`, computed on its device where the
    /// scorer is the sketch and the device keeps one (every block, as
    /// `SeqAttention::block_scores` gives them), or where the device chose them, each head's
    /// picks of the layer's `top_cut`; `None`: the host scores. The ones its device queued
    /// for this `(layer, predicted)` (`queue_scores`) where there are, else asked for now (a
    /// wait).
    fn device_scores(
        &mut self,
        b: usize,
        layer: usize,
        q: &[f32],
        predicted: bool,
    ) -> Option<Scored> {
        let n = self.scored_blocks(b, layer)?;
        let call = self.sketch_call(b, layer, n - 1);
        let queued = self.queued[b] == Some(Scoring { layer, predicted });
        if queued {
            self.queued[b] = None;
        }
        let t = Instant::now();
        let slot = &mut self.slots[b];
        let dev = slot.dev.as_deref_mut()?;
        let taken = if queued {
            dev.take_sketch_scores(layer)
        } else {
            Ok(None)
        };
        let scores = match taken {
            Ok(Some(s)) => Ok(Some(s)),
            Ok(None) => dev.sketch_scores(slot.kv.as_ref(), q, call),
            Err(e) => Err(e),
        };
        self.timing.scores += t.elapsed().as_secs_f64();
        match scores {
            Ok(Some(Scored::Scores(mut scores))) => {
                for s in &mut scores {
                    s.resize(n, 0.0);
                }
                Some(Scored::Scores(scores))
            }
            Ok(Some(picks)) => Some(picks),
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(error = %e, layer, "device sketch scores failed; the host scores");
                None
            }
        }
    }

    /// Sequence `b`'s blocks where its device scores `layer` (the newest block, always
    /// attended, scores 0 and is not sent: at least one older block); `None`: the host scores.
    fn scored_blocks(&self, b: usize, layer: usize) -> Option<usize> {
        let slot = &self.slots[b];
        if self.cfg.scorer != BlockScorer::Sketch
            || slot.dev.is_none()
            || !slot.seq.needs_scores(self.cfg, layer)
        {
            return None;
        }
        let n = slot.seq.num_blocks();
        (n > 1).then_some(n)
    }

    /// Queues sequence `b`'s device scores of `layer` by `q` without a wait, for
    /// `device_scores` to take (a device holds one such call; this one replaces any other).
    /// Nothing where the host scores, or these are queued already.
    fn queue_scores(&mut self, b: usize, layer: usize, q: &[f32], predicted: bool) {
        self.queue_with(b, Scoring { layer, predicted }, |dev, kv, call| {
            dev.queue_sketch_scores(kv, q, call)
        });
    }

    /// The device scoring of sequence `b`'s `layer`, blocks `0 .. blocks`, this attention
    /// asks for: with the picks of the layer's `top_cut` where every sequence selects on its
    /// device, which then plans with the real query alone (no plan made ahead, whose guard
    /// and reselection read every score).
    fn sketch_call(&self, b: usize, layer: usize, blocks: usize) -> SketchCall {
        let pick = if self.selects_on_device() {
            self.slots[b].seq.top_cut(self.cfg, layer)
        } else {
            None
        };
        SketchCall {
            layer,
            scale: self.shape.scale,
            how: self.cfg.group_score,
            blocks,
            pick,
        }
    }

    /// Queues sequence `b`'s device scores `key` by `queue` (given the device, the KV and the
    /// call) where its device scores that layer and they are not queued already; records what
    /// was queued.
    fn queue_with(
        &mut self,
        b: usize,
        key: Scoring,
        queue: impl FnOnce(
            &mut dyn DeviceSeq,
            &dyn attention::KvSource,
            SketchCall,
        ) -> Result<bool, crate::backend::BackendError>,
    ) {
        if self.queued[b] == Some(key) {
            return;
        }
        let Some(n) = self.scored_blocks(b, key.layer) else {
            return;
        };
        let call = self.sketch_call(b, key.layer, n - 1);
        let slot = &mut self.slots[b];
        let Some(dev) = slot.dev.as_deref_mut() else {
            return;
        };
        self.queued[b] = match queue(dev.as_mut(), slot.kv.as_ref(), call) {
            Ok(queued) => queued.then_some(key),
            Err(e) => {
                tracing::warn!(error = %e, layer = key.layer, "queuing device sketch scores failed; they are asked for when planned");
                None
            }
        };
    }

    /// Queues on each device the scores of the layer whose predicted query arrived last, so
    /// they are back when that layer is planned ahead (`plan_ahead`, once this layer's second
    /// half is queued): called while the device would otherwise wait for the CPU part. Where
    /// the scores were planned from after a wait behind the second half, on an H200 the
    /// prediction was slower than none (65.8 against 74.7 tokens/s at 64k, session 28).
    fn queue_ahead_scores(&mut self) {
        let Some((layer, q_pred)) = self.deferred.take() else {
            return;
        };
        let t = Instant::now();
        let width = self.shape.num_heads * self.shape.head_dim;
        for (b, q) in q_pred.chunks_exact(width).enumerate() {
            self.queue_scores(b, layer, q, true);
        }
        self.deferred = Some((layer, q_pred));
        self.timing.ahead += t.elapsed().as_secs_f64();
    }

    /// Queues every sequence's device scores of `layer` by its real query (`q`, the batch's
    /// rows) where planning will ask for them (`wants_real_scores`) and they are not queued
    /// yet. One wait, at the first take, then covers the batch.
    fn queue_real_scores(&mut self, layer: usize, q: &[f32]) {
        let width = self.shape.num_heads * self.shape.head_dim;
        for (b, qb) in q.chunks_exact(width).enumerate().take(self.slots.len()) {
            if self.wants_real_scores(b, layer) {
                self.queue_scores(b, layer, qb, false);
            }
        }
    }

    /// True when planning sequence `b`'s `layer` asks for its device's scores by the real
    /// query: a fresh plan, or a plan made ahead whose device part is reselected by the real
    /// query (or whose prediction is sampled).
    fn wants_real_scores(&self, b: usize, layer: usize) -> bool {
        let ahead = self.ahead[b].iter().any(|a| a.layer == layer);
        let sampled = self.slots[b]
            .seq
            .step()
            .is_multiple_of(PREDICTION_SAMPLE_STEPS);
        self.cfg.mode != Mode::Full && (!ahead || sampled || self.cfg.guard.device_real_query)
    }

    /// Sequence `b`'s `layer` as planned a layer ahead, where there is such a plan and the
    /// guard accepts its prediction against the real query `qb`: the plans and the CPU part
    /// (started ahead, or now with `qb`). `None`: the layer must be planned with `qb`.
    fn accepted(
        &mut self,
        b: usize,
        layer: usize,
        qb: &[f32],
    ) -> Result<Option<Planned>, ModelError> {
        let at = self.ahead[b].iter().position(|a| a.layer == layer);
        let Some(a) = at.map(|i| self.ahead[b].swap_remove(i)) else {
            return Ok(None);
        };
        let per = qb.len() / self.shape.num_kv_heads;
        let cos = (0..self.shape.num_kv_heads)
            .map(|h| {
                cosine(
                    &a.q_pred[h * per..(h + 1) * per],
                    &qb[h * per..(h + 1) * per],
                )
            })
            .fold(f32::INFINITY, |m, c| if c.is_nan() { c } else { m.min(c) });
        let fell_back = self.cfg.guard.rejects(cos);
        self.guard_checks.push(GuardCheck {
            layer,
            cosine: cos,
            fell_back,
        });
        self.slots[b].seq.record_guard(fell_back);
        // The real query's scores from the device, where it scores: the sample and the
        // device part's reselection below share them.
        let sampled = self.slots[b]
            .seq
            .step()
            .is_multiple_of(PREDICTION_SAMPLE_STEPS);
        let wanted = sampled || (!fell_back && self.cfg.guard.device_real_query);
        // Every score: picks (never asked for while plans are made ahead) read as none.
        let real = if wanted {
            match self.device_scores(b, layer, qb, false) {
                Some(Scored::Scores(s)) => Some(s),
                _ => None,
            }
        } else {
            None
        };
        if sampled {
            self.sample_prediction(b, layer, qb, &a, real.as_deref());
        }
        if fell_back {
            if let Some(job) = a.job {
                self.discard(b, job)?;
            }
            return Ok(None);
        }
        let Ahead { mut plans, job, .. } = a;
        if self.cfg.guard.device_real_query {
            let t = Instant::now();
            let seq = &mut self.slots[b].seq;
            match &real {
                Some(scores) => seq.reselect_device_scored(self.cfg, layer, scores, &mut plans),
                None => {
                    let keys = self.block_keys(b);
                    self.slots[b]
                        .seq
                        .reselect_device(self.cfg, layer, qb, keys, &mut plans);
                }
            }
            self.timing.select += t.elapsed().as_secs_f64();
        }
        // The predicted blocks, attended with the real query unless the predicted query's
        // part was started ahead.
        let job = job.or_else(|| self.spawn_real_cpu(b, layer, &plans, qb));
        Ok(Some((plans, job)))
    }

    /// `plan_layer` of `layer` for every sequence given a query (`None`: not planned). With
    /// several, the sequences plan in parallel, each its own state: a batch's selections one
    /// after another were most of a sparse step on a GPU host (8 sequences of scout at 8k on
    /// an H200: 120 ms of a 137 ms step).
    /// `predicted`: the queries are the predicted ones handed over for `layer`.
    fn plan_layers(
        &mut self,
        layer: usize,
        qs: &[Option<&[f32]>],
        predicted: bool,
    ) -> Vec<Option<Vec<HeadPlan>>> {
        let (cfg, scale) = (self.cfg, self.shape.scale);
        // Scores from the devices first, where they make them: every sequence's queued, then
        // taken, so one wait covers the batch (a wait each made a batch of 8 at 8k on an
        // H200 plan for 17.9 ms a step, session 28).
        for (b, q) in qs.iter().enumerate() {
            if let Some(q) = q {
                self.queue_scores(b, layer, q, predicted);
            }
        }
        let scored: Vec<Option<Scored>> = qs
            .iter()
            .enumerate()
            .map(|(b, q)| q.and_then(|q| self.device_scores(b, layer, q, predicted)))
            .collect();
        let work: Vec<Planning<'_>> = self
            .slots
            .iter_mut()
            .zip(qs)
            .zip(scored)
            .map(|((slot, q), s)| (&mut *slot.seq, &**slot.kv, *q, s))
            .collect();
        let t = Instant::now();
        let plan = |(seq, kv, q, scored): Planning<'_>| {
            q.map(|q| plan_from(seq, cfg, layer, q, BlockKeys { src: kv, scale }, scored))
        };
        let plans = if qs.iter().flatten().count() > 1 {
            work.into_par_iter().map(plan).collect()
        } else {
            work.into_iter().map(plan).collect()
        };
        self.timing.select += t.elapsed().as_secs_f64();
        plans
    }

    /// The CPU part of `plans` with the real query `q`, started now where sequence `b` has a
    /// device; `None` where no head has CPU blocks, or where `b` has none: its "device" blocks
    /// are read from the same host pool, and `attend` takes both lists in one parallel
    /// region. Spawned as a job of its own, the CPU part cost a second region, a channel and
    /// a wait a layer on the cores the first one ran on: SmolLM2 at 7.8k, scout, 2 threads
    /// (Xeon), three alternating runs, attention 3.7-4.2 ms a step with it and 3.4-3.8
    /// without (batch 8 at 4k: within the noise either way).
    fn spawn_real_cpu(
        &self,
        b: usize,
        layer: usize,
        plans: &[HeadPlan],
        q: &[f32],
    ) -> Option<CpuJob> {
        if self.slots[b].dev.is_some() {
            self.spawn_cpu_if_any(b, layer, plans, q)
        } else {
            None
        }
    }

    /// The CPU part of `plans` with `q`, started now; `None` where no head has CPU blocks.
    fn spawn_cpu_if_any(
        &self,
        b: usize,
        layer: usize,
        plans: &[HeadPlan],
        q: &[f32],
    ) -> Option<CpuJob> {
        let has_cpu = plans.iter().any(|p| !p.cpu.is_empty());
        has_cpu.then(|| self.spawn_cpu(b, layer, plans, q))
    }

    /// Plans the layer whose predicted query arrived last (`DecodeAttention::predicted`) for
    /// every sequence: its selection by that query and, where the CPU part is attended with
    /// the predicted query, that part started.
    fn plan_ahead(&mut self) {
        let Some((layer, q_pred)) = self.deferred.take() else {
            return;
        };
        let t = Instant::now();
        let width = self.shape.num_heads * self.shape.head_dim;
        let qs: Vec<Option<&[f32]>> = q_pred.chunks_exact(width).map(Some).collect();
        let planned = self.plan_layers(layer, &qs, true);
        for (b, plans) in planned.into_iter().enumerate() {
            let q = &q_pred[b * width..(b + 1) * width];
            let plans = plans.unwrap_or_default();
            let job = if self.cfg.guard.predicted_cpu {
                self.spawn_cpu_if_any(b, layer, &plans, q)
            } else {
                None
            };
            self.ahead[b].push(Ahead {
                layer,
                plans,
                q_pred: q.to_vec(),
                job,
            });
        }
        self.timing.ahead += t.elapsed().as_secs_f64();
    }

    /// Records sequence `b`'s `layer` as attended by `plans` and starts the recall it calls
    /// for: the blocks the CPU attended, copied to the device on the recall stream.
    fn finish_plans(
        &mut self,
        b: usize,
        layer: usize,
        plans: &[HeadPlan],
    ) -> Result<(), ModelError> {
        let slot = &mut self.slots[b];
        slot.seq.finish_layer(self.cfg, layer, plans);
        if let Some(dev) = slot.dev.as_deref_mut() {
            let recalled: Vec<Vec<DeviceBlock>> = (0..self.shape.num_kv_heads)
                .map(|h| slot.seq.recalled(layer, h))
                .collect();
            if recalled.iter().any(|r| !r.is_empty()) {
                let lists: Vec<&[DeviceBlock]> = recalled.iter().map(Vec::as_slice).collect();
                dev.recall(slot.kv.as_ref(), layer, &lists)?;
            }
        }
        Ok(())
    }

    /// The plans of sequence `b`'s `layer`, which its device planned alone this step: made
    /// from the picks it sends back, as the host would have made them before the attention
    /// (every block was resident: nothing else changes). Picks that are not an answer of the
    /// layer's cut, or a plan with a CPU part, are a device defect: the attention already
    /// ran on them, and the device is told to plan no more layers.
    fn planned_by_device(&mut self, b: usize, layer: usize) -> Result<Vec<HeadPlan>, ModelError> {
        let slot = &mut self.slots[b];
        let picks = match slot.dev.as_deref_mut() {
            Some(dev) => dev.take_device_picks(layer)?,
            None => None,
        };
        let plans = picks.and_then(|p| slot.seq.plan_layer_picked(self.cfg, layer, &p));
        match plans {
            Some(plans) if plans.iter().all(|p| p.cpu.is_empty()) => Ok(plans),
            other => {
                // The step's attention read those picks: it fails; the next ones plan on the host.
                if let Some(dev) = slot.dev.as_deref() {
                    dev.refuse_device_plans();
                }
                Err(ModelError::Attention(format!(
                    "layer {layer} was planned on the device, but its picks plan as {other:?}"
                )))
            }
        }
    }

    /// Measures the prediction's hit ratio against a selection with the real query (its
    /// block scores `real` where a device made them): sampled, as that costs as much as the
    /// selection itself.
    fn sample_prediction(
        &mut self,
        b: usize,
        layer: usize,
        qb: &[f32],
        a: &Ahead,
        real: Option<&[Vec<f32>]>,
    ) {
        let keys = self.block_keys(b);
        let seq = &mut *self.slots[b].seq;
        let hk = self.shape.num_kv_heads;
        let per = qb.len() / hk;
        let q_of = |h: usize| &qb[h * per..(h + 1) * per];
        let real = match real {
            Some(scores) => seq.select_layer(self.cfg, layer, scores),
            None => {
                let scores: Vec<Vec<f32>> = if seq.needs_scores(self.cfg, layer) {
                    (0..hk)
                        .map(|h| seq.block_scores(self.cfg, layer, h, q_of(h), keys))
                        .collect()
                } else {
                    Vec::new()
                };
                seq.select_layer(self.cfg, layer, &scores)
            }
        };
        for (h, real) in real.iter().enumerate() {
            let predicted = a.plans[h].selected();
            seq.record_prediction(&predicted, real, &a.q_pred[h * per..(h + 1) * per], q_of(h));
        }
    }

    /// [`DecodeAttention::finish_resident`] with a landing: each sequence's CPU part lands
    /// there when it ends (a part that ended already, and a sequence without one, land now);
    /// the layer's bookkeeping is done meanwhile.
    fn land_resident(&mut self, layer: usize, landing: &Arc<Landing>) -> Result<(), ModelError> {
        let pending = std::mem::take(&mut self.resident_pending);
        let tickets = landing.tickets();
        if tickets.len() != pending.len() {
            // The tickets, dropped, raise the flag over empty rows: nothing waits forever.
            return Err(ModelError::Attention(format!(
                "a landing of {} rows for a batch of {}",
                tickets.len(),
                pending.len()
            )));
        }
        self.landings.push(Arc::clone(landing));
        for (b, ((plans, job), ticket)) in pending.into_iter().zip(tickets).enumerate() {
            let t = Instant::now();
            match job {
                None => ticket.land_empty(),
                Some(job) => match job.land_with(ticket) {
                    None => self.landing_jobs.push((b, job)),
                    Some(ticket) => {
                        let parts = self.wait(b, &job)?;
                        ticket.land(&parts)?;
                    }
                },
            }
            let t_fin = Instant::now();
            self.timing.device += (t_fin - t).as_secs_f64();
            if self.on_device[b].last() != Some(&layer) {
                self.finish_plans(b, layer, &plans)?;
            }
            self.timing.finish += t_fin.elapsed().as_secs_f64();
        }
        Ok(())
    }
}

impl DecodeAttention for BatchAttention<'_> {
    fn wants_prediction(&self, layer: usize) -> bool {
        // `exact` selects with the real query only: a prediction would be projected, planned
        // and then thrown away.
        self.cfg.mode == Mode::Scout
            && self.cfg.precompute
            && !self.cfg.exact
            && layer >= self.cfg.guard.real_query_layers
            && !self.selects_on_device()
    }

    fn predicted(&mut self, layer: usize, q_pred: &[f32]) {
        // Planned once this layer's parts are under way (see `attend`), so the selection runs
        // while the device and the CPU attend instead of before they start.
        self.plan_ahead();
        self.deferred = Some((layer, q_pred.to_vec()));
    }

    fn resident_ok(&self) -> bool {
        self.slots.iter().all(|s| s.dev.is_some())
    }

    fn needs_query(&self, layer: usize) -> bool {
        // `full` plans read no query and have no CPU part; a layer every device plans alone
        // reads it where it is.
        self.cfg.mode != Mode::Full
            && !(0..self.slots.len()).all(|b| self.device_call(b, layer).is_some())
    }

    fn queue_scores_by(&mut self, layer: usize, rows: &dyn std::any::Any) {
        let t = Instant::now();
        let key = Scoring {
            layer,
            predicted: false,
        };
        for b in 0..self.slots.len() {
            if self.wants_real_scores(b, layer) && self.device_call(b, layer).is_none() {
                self.queue_with(b, key, |dev, kv, call| {
                    dev.queue_sketch_scores_by(kv, (rows, b), call)
                });
            }
        }
        self.timing.queue += t.elapsed().as_secs_f64();
    }

    fn plan_resident(
        &mut self,
        layer: usize,
        q: &[f32],
    ) -> Result<Vec<ResidentSeq<'_>>, ModelError> {
        let t = Instant::now();
        let hk = self.shape.num_kv_heads;
        let width = self.shape.num_heads * self.shape.head_dim;
        if self.deferred.as_ref().is_some_and(|d| d.0 <= layer) {
            self.plan_ahead();
        }
        let n = self.slots.len();
        let full = self.cfg.mode == Mode::Full;
        let mut on_device: Vec<Option<(DevicePlan, SketchCall)>> =
            (0..n).map(|b| self.device_plan(b, layer)).collect();
        let all_on_device = on_device.iter().all(Option::is_some);
        let q_fits = full || (all_on_device && q.is_empty()) || q.len() == n * width;
        if !q_fits {
            return Err(ModelError::Attention(format!(
                "{} query floats for a batch of {n}",
                q.len()
            )));
        }
        let qb = |b: usize| {
            if full {
                &[][..]
            } else {
                &q[b * width..(b + 1) * width]
            }
        };
        if !full && !q.is_empty() {
            for (b, qb) in q.chunks_exact(width).enumerate().take(n) {
                if on_device[b].is_none() && self.wants_real_scores(b, layer) {
                    self.queue_scores(b, layer, qb, false);
                }
            }
        }
        // Plans accepted from a layer ahead, then every other sequence's selection at once.
        let mut accepted = Vec::with_capacity(n);
        for (b, dp) in on_device.iter().enumerate() {
            accepted.push(if full || dp.is_some() {
                None
            } else {
                self.accepted(b, layer, qb(b))?
            });
        }
        let fresh: Vec<Option<&[f32]>> = accepted
            .iter()
            .enumerate()
            .map(|(b, a)| (a.is_none() && on_device[b].is_none()).then(|| qb(b)))
            .collect();
        let fresh = self.plan_layers(layer, &fresh, false);
        let mut lists = Vec::with_capacity(n);
        let mut picks = Vec::with_capacity(n);
        self.resident_pending.clear();
        for (b, (accepted, fresh)) in accepted.into_iter().zip(fresh).enumerate() {
            if let Some((plan, call)) = on_device[b].take() {
                lists.push(plan.fixed);
                picks.push(Some(call));
                self.on_device[b].push(layer);
                self.resident_pending.push((Vec::new(), None));
                continue;
            }
            picks.push(None);
            let (plans, job) = match accepted {
                Some(a) => a,
                None => {
                    let plans = fresh.unwrap_or_default();
                    let job = if full {
                        None
                    } else {
                        self.spawn_cpu_if_any(b, layer, &plans, qb(b))
                    };
                    (plans, job)
                }
            };
            let seq = &*self.slots[b].seq;
            let blocks = (0..hk)
                .map(|h| seq.device_blocks(layer, h, &plans[h].device))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| ModelError::Attention(e.to_string()))?;
            lists.push(blocks);
            self.resident_pending.push((plans, job));
        }
        self.timing.plan += t.elapsed().as_secs_f64();
        let seqs = self
            .slots
            .iter_mut()
            .zip(lists)
            .zip(picks)
            .filter_map(|((slot, blocks), picks)| {
                let dev = slot.dev.as_deref_mut()?;
                Some(ResidentSeq {
                    kv: slot.kv.as_ref(),
                    dev: dev.as_mut(),
                    blocks,
                    picks,
                })
            })
            .collect();
        Ok(seqs)
    }

    fn cpu_in_flight(&self, _layer: usize) -> bool {
        self.resident_pending.iter().any(|(_, job)| job.is_some())
    }

    fn finish_resident(
        &mut self,
        layer: usize,
        landing: Option<&Arc<Landing>>,
    ) -> Result<Vec<Vec<Partial>>, ModelError> {
        // The device has this layer's attention queued and then waits for the CPU parts:
        // the next layer's scores by its predicted query fit there.
        self.queue_ahead_scores();
        if let Some(landing) = landing {
            self.land_resident(layer, landing)?;
            return Ok(Vec::new());
        }
        let hk = self.shape.num_kv_heads;
        let group = self.shape.num_heads / hk.max(1);
        let pending = std::mem::take(&mut self.resident_pending);
        let any_cpu = pending.iter().any(|(_, job)| job.is_some());
        let mut cpu = Vec::with_capacity(if any_cpu { pending.len() } else { 0 });
        for (b, (plans, job)) in pending.into_iter().enumerate() {
            let t = Instant::now();
            if let Some(job) = &job {
                cpu.push(self.wait(b, job)?);
            } else if any_cpu {
                cpu.push(
                    (0..hk)
                        .map(|_| Partial::empty(group, self.shape.head_dim))
                        .collect(),
                );
            }
            let t_fin = Instant::now();
            self.timing.device += (t_fin - t).as_secs_f64();
            if self.on_device[b].last() != Some(&layer) {
                self.finish_plans(b, layer, &plans)?;
            }
            self.timing.finish += t_fin.elapsed().as_secs_f64();
        }
        Ok(cpu)
    }

    fn resident_done(&mut self) -> Result<(), ModelError> {
        let t = Instant::now();
        // The device waited for these parts' flags before the LM head, so they have ended:
        // their time, and whether any failed (its row landed empty).
        for (b, job) in std::mem::take(&mut self.landing_jobs) {
            self.wait(b, &job)?;
        }
        if std::mem::take(&mut self.landings)
            .iter()
            .any(|l| !l.whole())
        {
            return Err(ModelError::Attention(
                "a CPU part of attention did not land (its task failed)".into(),
            ));
        }
        for b in 0..self.slots.len() {
            for layer in std::mem::take(&mut self.on_device[b]) {
                self.timing.layers_on_device += 1;
                let plans = self.planned_by_device(b, layer)?;
                #[cfg(test)]
                self.plan_log
                    .push((layer, plans.clone(), false, Vec::new()));
                self.finish_plans(b, layer, &plans)?;
            }
        }
        self.timing.finish += t.elapsed().as_secs_f64();
        Ok(())
    }

    fn resident_queued(&mut self, _layer: usize) {
        // The next layer's selection by its predicted query, while the device runs this
        // layer's second half: planned any earlier, the device would wait for it with only
        // the (short) sparse attention queued.
        self.plan_ahead();
    }

    fn resident_kv(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let kvw = self.shape.num_kv_heads * self.shape.head_dim;
        for (b, slot) in self.slots.iter_mut().enumerate() {
            slot.new_k[layer].copy_from_slice(&k[b * kvw..(b + 1) * kvw]);
            slot.new_v[layer].copy_from_slice(&v[b * kvw..(b + 1) * kvw]);
        }
    }

    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let Shape {
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        } = self.shape;
        let width = num_heads * head_dim;
        let kvw = num_kv_heads * head_dim;
        let group = num_heads / num_kv_heads;
        if self.deferred.as_ref().is_some_and(|d| d.0 <= layer) {
            // A prediction for this very layer (the model hands them over a layer early).
            self.plan_ahead();
        }
        self.queue_real_scores(layer, q);
        // Every sequence's plan and device part first: the device works through the queued
        // parts while the host plans the next sequence; the first collect below waits.
        let mut planned = Vec::with_capacity(self.slots.len());
        for b in 0..self.slots.len() {
            let t_plan = Instant::now();
            let qb = &q[b * width..(b + 1) * width];
            let (plans, pending, _predicted) = self.plans_for(b, layer, qb)?;
            #[cfg(test)]
            {
                let seq = &*self.slots[b].seq;
                let resident = (0..num_kv_heads)
                    .map(|h| {
                        (0..seq.num_blocks())
                            .filter(|x| seq.is_resident(layer, h, *x))
                            .collect()
                    })
                    .collect();
                self.plan_log
                    .push((layer, plans.clone(), _predicted, resident));
            }
            // Device part with the real query.
            let t_dev = Instant::now();
            self.timing.plan += (t_dev - t_plan).as_secs_f64();
            let slot = &mut self.slots[b];
            if let Some(dev) = slot.dev.as_deref_mut() {
                let placed = (0..num_kv_heads)
                    .map(|h| slot.seq.device_blocks(layer, h, &plans[h].device))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| ModelError::Attention(e.to_string()))?;
                let lists: Vec<&[DeviceBlock]> = placed.iter().map(Vec::as_slice).collect();
                dev.submit(slot.kv.as_ref(), layer, &lists, qb, scale)?;
            }
            self.timing.device += t_dev.elapsed().as_secs_f64();
            planned.push((plans, pending));
        }
        // The next layer's selection by its predicted query, while these parts run.
        self.plan_ahead();
        // No device memory: the "device" blocks of every such sequence are attended from
        // the host pool, on the pool this step runs on, in one parallel region.
        let t_host = Instant::now();
        // Each head's CPU blocks follow its device blocks, unless its CPU part was started
        // a layer ahead (with the predicted query).
        let host_lists: Vec<(usize, Vec<Vec<usize>>)> = planned
            .iter()
            .enumerate()
            .filter(|(b, _)| self.slots[*b].dev.is_none())
            .map(|(b, (plans, pending))| {
                let lists = plans
                    .iter()
                    .map(|p| match pending {
                        Some(_) => p.device.clone(),
                        None => [&p.device[..], &p.cpu].concat(),
                    })
                    .collect();
                (b, lists)
            })
            .collect();
        let host_refs: Vec<Vec<&[usize]>> = host_lists
            .iter()
            .map(|(_, lists)| lists.iter().map(Vec::as_slice).collect())
            .collect();
        let host_seqs: Vec<SeqLists<'_>> = host_lists
            .iter()
            .zip(&host_refs)
            .map(|((b, _), lists)| SeqLists {
                kv: self.slots[*b].kv,
                lists,
                q: &q[b * width..(b + 1) * width],
            })
            .collect();
        let mut host_parts = attend_seqs(self.shape, layer, &host_seqs, None).into_iter();
        drop(host_seqs);
        self.timing.device += t_host.elapsed().as_secs_f64();
        for (b, (plans, pending)) in planned.into_iter().enumerate() {
            let t_dev = Instant::now();
            let qb = &q[b * width..(b + 1) * width];
            let (kb, vb) = (&k[b * kvw..(b + 1) * kvw], &v[b * kvw..(b + 1) * kvw]);
            let slot = &mut self.slots[b];
            let mut parts: Vec<Partial> = match slot.dev.as_deref_mut() {
                Some(dev) => dev.collect()?,
                None => host_parts.next().unwrap_or_default(),
            };
            // Plus the new token itself.
            for (h, part) in parts.iter_mut().enumerate() {
                part.merge_from(&Partial::of_one_key(
                    &qb[h * group * head_dim..(h + 1) * group * head_dim],
                    &kb[h * head_dim..(h + 1) * head_dim],
                    &vb[h * head_dim..(h + 1) * head_dim],
                    scale,
                ));
            }
            if let Some(job) = &pending {
                let cpu = self.wait(b, job)?;
                for (part, c) in parts.iter_mut().zip(&cpu) {
                    part.merge_from(c);
                }
            }
            for (h, p) in parts.iter().enumerate() {
                out[b * width + h * group * head_dim..b * width + (h + 1) * group * head_dim]
                    .copy_from_slice(&p.out);
            }
            let t_fin = Instant::now();
            self.timing.device += (t_fin - t_dev).as_secs_f64();
            self.finish_plans(b, layer, &plans)?;
            let slot = &mut self.slots[b];
            slot.new_k[layer].copy_from_slice(kb);
            slot.new_v[layer].copy_from_slice(vb);
            self.timing.finish += t_fin.elapsed().as_secs_f64();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! One scout step, layer by layer, against a reference computed straight from the
    //! definition: selection by the query the plan claims (predicted, or real where the guard
    //! redid it), the device's blocks attended with the real query, the CPU's with the
    //! selection query, each selected block once, plus the token itself.

    use std::collections::HashMap;

    use attention::{KvDType, PredictionGuard, SeqAttention};
    use kv_transfer::{HostPool, KvLayout};

    use super::*;
    use crate::backend::CpuBackend;
    use crate::client::{ingest_local, prefill_kv};
    use crate::model::random::{preset, random_weights};
    use crate::model::{Arch, LoadedModel, Model, Tokenizer};

    #[test]
    fn runs_cover_each_list_in_order_and_lengthen_with_the_work() {
        let cut = |lens: &[usize]| runs(lens.iter().copied()).collect::<Vec<_>>();
        let check = |lens: &[usize]| {
            let got = cut(lens);
            // Each list's blocks exactly once, in order, and no empty run.
            let mut at = vec![0; lens.len()];
            for &(i, start, end) in &got {
                assert_eq!(start, at[i], "{lens:?}");
                assert!(end > start, "{lens:?}");
                at[i] = end;
            }
            assert_eq!(at, lens, "{lens:?}");
            got
        };
        // Little work: runs of at least 16, a short list whole, an empty list none.
        assert_eq!(check(&[4, 4, 4]), [(0, 0, 4), (1, 0, 4), (2, 0, 4)]);
        assert_eq!(check(&[0, 40]), [(1, 0, 20), (1, 20, 40)]);
        assert!(check(&[128; 3]).iter().all(|r| r.2 - r.1 >= 16));
        // Batch 8 at 4k on 3 KV heads (3072 blocks, a share of 48): 48 runs of 64, not 192
        // of 16.
        let big = check(&[128; 24]);
        assert_eq!(big.len(), 48);
        assert!(big.iter().all(|r| r.2 - r.1 == 64));
        // Nearly equal runs: 100 blocks at the floor of 16 are 6 runs of 16-17, not 6 x 16 + 4.
        let small = check(&[100]);
        assert_eq!(small.len(), 6);
        assert!(small.iter().all(|r| (16..=17).contains(&(r.2 - r.1))));
    }

    /// (layer, q, k, v, out) of one attend call.
    type Call = (usize, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

    /// Forwards to the engine's attention and records what the model handed it.
    struct Spy<'a> {
        inner: BatchAttention<'a>,
        predicted: HashMap<usize, Vec<f32>>,
        calls: Vec<Call>,
    }

    impl DecodeAttention for Spy<'_> {
        fn wants_prediction(&self, layer: usize) -> bool {
            self.inner.wants_prediction(layer)
        }
        fn predicted(&mut self, layer: usize, q_pred: &[f32]) {
            self.predicted.insert(layer, q_pred.to_vec());
            self.inner.predicted(layer, q_pred);
            assert!(
                self.inner.ahead.iter().flatten().all(|a| a.layer != layer),
                "layer {layer} planned ahead before the layer before it started attending"
            );
        }
        fn attend(
            &mut self,
            layer: usize,
            q: &[f32],
            k: &[f32],
            v: &[f32],
            out: &mut [f32],
        ) -> Result<(), ModelError> {
            self.inner.attend(layer, q, k, v, out)?;
            if self.predicted.contains_key(&(layer + 1)) {
                assert!(
                    self.inner
                        .ahead
                        .iter()
                        .all(|a| a.iter().any(|a| a.layer == layer + 1)),
                    "layer {} not planned ahead during layer {layer}",
                    layer + 1
                );
            }
            self.calls
                .push((layer, q.to_vec(), k.to_vec(), v.to_vec(), out.to_vec()));
            Ok(())
        }
    }

    /// Quest top-k from the definition: sink and newest block always, then the highest
    /// `sum_g sum_d max(q_gd min_d, q_gd max_d)` among the rest.
    #[allow(clippy::too_many_arguments)] // the definition's inputs, spelled out
    fn reference_selection(
        keys: &[f32],
        n: usize,
        hk: usize,
        h: usize,
        d: usize,
        bs: usize,
        q_group: &[f32],
        budget_blocks: usize,
        group_max: bool,
    ) -> Vec<usize> {
        let nb = n.div_ceil(bs);
        if nb <= budget_blocks {
            return (0..nb).collect();
        }
        let middle: Vec<usize> = (1..nb - 1).collect();
        let mut sel = reference_best(
            keys,
            n,
            hk,
            h,
            d,
            bs,
            q_group,
            group_max,
            &middle,
            budget_blocks - 2,
        );
        sel.push(0);
        sel.push(nb - 1);
        sel.sort_unstable();
        sel
    }

    /// The `k` of `blocks` with the largest Quest bound for `q_group`, from the definition.
    #[allow(clippy::too_many_arguments)]
    fn reference_best(
        keys: &[f32],
        n: usize,
        hk: usize,
        h: usize,
        d: usize,
        bs: usize,
        q_group: &[f32],
        group_max: bool,
        blocks: &[usize],
        k: usize,
    ) -> Vec<usize> {
        let mut scored: Vec<(f32, usize)> = blocks
            .iter()
            .map(|&b| {
                let mut s = if group_max { f32::NEG_INFINITY } else { 0.0 };
                for q in q_group.chunks_exact(d) {
                    let mut head = 0f32;
                    for (c, qd) in q.iter().enumerate() {
                        let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
                        for t in b * bs..((b + 1) * bs).min(n) {
                            let x = keys[(t * hk + h) * d + c];
                            lo = lo.min(x);
                            hi = hi.max(x);
                        }
                        head += (qd * lo).max(qd * hi);
                    }
                    s = if group_max { s.max(head) } else { s + head };
                }
                (s, b)
            })
            .collect();
        scored.sort_by(|a, b| b.0.total_cmp(&a.0));
        scored.iter().take(k).map(|x| x.1).collect()
    }

    /// What [`check`] saw, so a test can tell that its path ran.
    #[derive(Debug, Default)]
    struct Seen {
        /// Head plans of an accepted prediction whose device part was chosen again with the
        /// real query.
        reselected: usize,
        /// CPU blocks of accepted predictions.
        predicted_cpu_blocks: usize,
    }

    /// Runs `steps` decode steps of a random-weight model with `cfg` and compares each
    /// layer's plans and output with the definition.
    fn check(cfg: AttentionConfig, steps: usize) -> Seen {
        let mut counts = Seen::default();
        let mut mc = preset("tiny", Arch::Llama).unwrap();
        mc.num_layers = 5;
        let model = Model::from_weights(
            mc.clone(),
            "t",
            random_weights(&mc, 11, KvDType::F32),
            Arc::new(CpuBackend),
        )
        .unwrap();
        let lm = LoadedModel {
            model,
            tokenizer: Tokenizer::Bytes,
        };
        let (hk, d, nh) = (mc.num_kv_heads, mc.head_dim, mc.num_heads);
        let g = nh / hk;
        let bs = 16;
        let geom = attention::BlockGeometry {
            block_size: bs,
            num_kv_heads: hk,
            head_dim: d,
            dtype: KvDType::F32,
        };
        let layout = KvLayout {
            model_id: lm.model.model_id.clone(),
            num_layers: mc.num_layers,
            geom,
            vocab_size: mc.vocab_size,
            max_context: mc.max_context(),
        };
        let pool = HostPool::new(geom, 64 << 20).unwrap();
        let prompt: Vec<u32> = (0..203).map(|i| (i * 37 % 250) as u32).collect();
        let kv = prefill_kv(&lm, &prompt, "r", KvDType::F32).unwrap();
        let mut keys: Vec<Vec<f32>> = lm.model.prefill(&prompt).unwrap().keys;
        let mut values: Vec<Vec<f32>> = lm.model.prefill(&prompt).unwrap().values;
        let mut committed = ingest_local(&layout, &pool, &kv).unwrap();
        committed.grow(pool.reserve(committed.blocks_to_grow(steps + 1)).unwrap());
        let digests = committed.take_digests();
        let mut seq = SeqAttention::new(geom, mc.num_layers, prompt.len(), digests);
        let mut kv = Arc::new(committed);
        let cpu_pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let shape = Shape {
            num_heads: nh,
            num_kv_heads: hk,
            head_dim: d,
            scale: lm.model.attn_scale(),
        };
        let mut token = kv.info.next_token_id;
        let mut cpu_blocks = 0;
        for step in 0..steps {
            let n = prompt.len() + step;
            let slot = SeqSlot {
                kv: &kv,
                seq: &mut seq,
                dev: None,
                new_k: vec![vec![0.0; hk * d]; mc.num_layers],
                new_v: vec![vec![0.0; hk * d]; mc.num_layers],
                device_wait: 0.0,
            };
            let mut spy = Spy {
                inner: BatchAttention::new(&cfg, shape, &cpu_pool, vec![slot]),
                predicted: HashMap::new(),
                calls: Vec::new(),
            };
            let logits = lm.model.decode_step(&[token], &[n], &mut spy).unwrap();
            let log = std::mem::take(&mut spy.inner.plan_log);
            assert_eq!(log.len(), mc.num_layers);
            for ((layer, plans, used_pred, resident), (l2, q, k, v, out)) in
                log.iter().zip(&spy.calls)
            {
                assert_eq!(layer, l2, "plans were made for another layer");
                let pred = spy.predicted.get(layer);
                assert_eq!(
                    *used_pred,
                    pred.is_some() && !cfg.exact && {
                        let c = spy.inner.guard_checks.iter().find(|c| c.layer == *layer);
                        c.is_some_and(|c| !c.fell_back)
                    }
                );
                let sel_q: &[f32] = if *used_pred { pred.unwrap() } else { q };
                // The query the CPU attends with: the predicted one only where its part was
                // started a layer ahead.
                let cpu_q: &[f32] = if *used_pred && cfg.guard.predicted_cpu {
                    sel_q
                } else {
                    q
                };
                let group_max = cfg.group_score == attention::GroupScore::Max;
                let budget = cfg.budget_blocks(bs);
                for h in 0..hk {
                    let p = &plans[h];
                    let qg = &sel_q[h * g * d..(h + 1) * g * d];
                    let by_sel_q =
                        reference_selection(&keys[*layer], n, hk, h, d, bs, qg, budget, group_max);
                    let nb = n.div_ceil(bs);
                    let want = if *used_pred && cfg.guard.device_real_query && nb > budget {
                        // The CPU part keeps the predicted blocks that were not resident; the
                        // device takes the sink, the newest block and the best resident rest
                        // by the real query.
                        let resident = &resident[h];
                        assert!(p.cpu.iter().all(|b| by_sel_q.contains(b)));
                        assert!(p.cpu.iter().all(|b| !resident.contains(b)));
                        let (forced, rest): (Vec<usize>, Vec<usize>) = (0..nb)
                            .filter(|b| resident.contains(b) && !p.cpu.contains(b))
                            .partition(|b| *b == 0 || *b == nb - 1);
                        let k = budget.saturating_sub(p.cpu.len() + forced.len());
                        let qr = &q[h * g * d..(h + 1) * g * d];
                        let best =
                            reference_best(&keys[*layer], n, hk, h, d, bs, qr, group_max, &rest, k);
                        let mut device: Vec<usize> = forced.into_iter().chain(best).collect();
                        device.sort_unstable();
                        assert_eq!(p.device, device, "layer {layer} head {h}: device part");
                        counts.reselected += 1;
                        p.selected()
                    } else {
                        by_sel_q
                    };
                    assert_eq!(p.selected(), want, "layer {layer} head {h}: selection");
                    assert!(
                        p.device.iter().all(|b| !p.cpu.contains(b)),
                        "a block on both sides"
                    );
                    cpu_blocks += p.cpu.len();
                    if *used_pred {
                        counts.predicted_cpu_blocks += p.cpu.len();
                    }
                    // Attention from the definition, f64.
                    for qh in 0..g {
                        let head = h * g + qh;
                        let mut ws: Vec<(f64, &[f32])> = Vec::new();
                        for &blk in &want {
                            let side_q = if p.device.contains(&blk) { q } else { cpu_q };
                            let qv = &side_q[head * d..(head + 1) * d];
                            for t in blk * bs..((blk + 1) * bs).min(n) {
                                let kt = &keys[*layer][(t * hk + h) * d..(t * hk + h + 1) * d];
                                let s: f64 = qv
                                    .iter()
                                    .zip(kt)
                                    .map(|(a, b)| (*a as f64) * (*b as f64))
                                    .sum();
                                ws.push((
                                    s * shape.scale as f64,
                                    &values[*layer][(t * hk + h) * d..(t * hk + h + 1) * d],
                                ));
                            }
                        }
                        let qv = &q[head * d..(head + 1) * d];
                        let s: f64 = qv
                            .iter()
                            .zip(&k[h * d..(h + 1) * d])
                            .map(|(a, b)| (*a as f64) * (*b as f64))
                            .sum();
                        ws.push((s * shape.scale as f64, &v[h * d..(h + 1) * d]));
                        let m = ws.iter().fold(f64::NEG_INFINITY, |a, w| a.max(w.0));
                        let z: f64 = ws.iter().map(|w| (w.0 - m).exp()).sum();
                        for c in 0..d {
                            let want: f64 =
                                ws.iter().map(|w| (w.0 - m).exp() / z * w.1[c] as f64).sum();
                            let got = out[head * d + c] as f64;
                            assert!(
                                (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                                "layer {layer} head {head} step {step}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
            let slot = spy.inner.slots.pop().unwrap();
            let (ks, vs) = (slot.new_k, slot.new_v);
            drop(spy);
            for (l, (k, v)) in ks.iter().zip(&vs).enumerate() {
                keys[l].extend_from_slice(k);
                values[l].extend_from_slice(v);
            }
            super::super::solo::append_step(&mut kv, &mut seq, &cfg, token, &ks, &vs).unwrap();
            token = crate::model::sampling::argmax(&logits) as u32;
        }
        assert!(cpu_blocks > 0, "the test must exercise the CPU part");
        counts
    }

    fn scout() -> AttentionConfig {
        let mut cfg = AttentionConfig::scout(16);
        cfg.budget_tokens = 80;
        cfg.device_blocks_per_head = 3;
        cfg
    }

    #[test]
    fn scout_step_equals_its_definition_without_guard() {
        check(
            AttentionConfig {
                guard: PredictionGuard::OFF,
                ..scout()
            },
            3,
        );
    }

    /// A guard that accepts some predictions of the random-weight model and rejects others.
    fn loose_guard(device_real_query: bool, predicted_cpu: bool) -> PredictionGuard {
        PredictionGuard {
            min_cosine: 0.3,
            real_query_layers: 2,
            device_real_query,
            predicted_cpu,
        }
    }

    #[test]
    fn scout_step_equals_its_definition_with_guard() {
        // On random weights the prediction is poor: most layers are redone, some are not.
        // An accepted prediction's CPU blocks are attended with the real query, or (the
        // paper's behaviour) with the predicted one a layer ahead.
        for predicted_cpu in [false, true] {
            let seen = check(
                AttentionConfig {
                    guard: loose_guard(false, predicted_cpu),
                    ..scout()
                },
                3,
            );
            assert!(seen.predicted_cpu_blocks > 0, "no accepted CPU part");
        }
    }

    #[test]
    fn scout_step_equals_its_definition_with_the_device_part_by_the_real_query() {
        let seen = check(
            AttentionConfig {
                guard: loose_guard(true, false),
                // More resident blocks than the budget: the device part has a choice.
                device_blocks_per_head: 8,
                ..scout()
            },
            3,
        );
        assert!(
            seen.reselected > 0,
            "no accepted prediction had its device part chosen again"
        );
    }

    #[test]
    fn scout_step_equals_its_definition_with_group_sum() {
        check(
            AttentionConfig {
                group_score: attention::GroupScore::Sum,
                ..scout()
            },
            3,
        );
    }

    #[test]
    fn exact_scout_is_real_query_block_top_k() {
        check(
            AttentionConfig {
                exact: true,
                ..scout()
            },
            3,
        );
    }
}
