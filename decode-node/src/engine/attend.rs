//! The attention of one decode step for a whole batch: plans each request's layer with its
//! `SeqAttention`, runs the device part on the step thread and the CPU part on the CPU pool
//! (one layer ahead in `scout`), and merges the two exactly.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use attention::{
    AttentionConfig, HeadPlan, HeadQuery, Mode, Partial, Scratch, SeqAttention, attend_head,
    cosine,
};
use kv_transfer::CommittedKv;
use rayon::prelude::*;

use crate::backend::DeviceSeq;
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

/// A CPU part started ahead: the layer it is for, its plans and where its result arrives.
#[derive(Debug)]
struct Ahead {
    layer: usize,
    plans: Vec<HeadPlan>,
    q_pred: Vec<f32>,
    job: CpuJob,
}

/// A CPU part running on the CPU pool.
#[derive(Debug)]
struct CpuJob {
    rx: mpsc::Receiver<Vec<Partial>>,
    /// Set when the result is no longer wanted: heads not started yet are skipped.
    cancel: Arc<AtomicBool>,
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
}

/// [`DecodeAttention`] over a batch of sequences.
#[derive(Debug)]
pub(crate) struct BatchAttention<'a> {
    pub(crate) cfg: &'a AttentionConfig,
    pub(crate) shape: Shape,
    pub(crate) cpu_pool: &'a rayon::ThreadPool,
    pub(crate) slots: Vec<SeqSlot<'a>>,
    /// Per sequence, the CPU parts started ahead: at most two, since layer `i + 1`'s is started
    /// before layer `i` (whose own was started during layer `i - 1`) attends.
    ahead: Vec<Vec<Ahead>>,
    scratch: Scratch,
    pub(crate) timing: AttnTiming,
    /// This step's guard checks, for the per-layer metrics.
    pub(crate) guard_checks: Vec<GuardCheck>,
}

/// Runs the CPU part: every head's `plan.cpu` blocks with `q`, heads in parallel on the
/// current rayon pool (the CPU attention pool: this runs inside one of its tasks). Heads not
/// started when `cancel` is set come back empty.
fn cpu_part(
    kv: &CommittedKv,
    shape: Shape,
    layer: usize,
    plans: &[HeadPlan],
    q: &[f32],
    cancel: &AtomicBool,
) -> Vec<Partial> {
    let per = q.len() / shape.num_kv_heads;
    plans
        .par_iter()
        .enumerate()
        .map_init(Scratch::default, |scratch, (h, p)| {
            if cancel.load(Ordering::Relaxed) {
                return Partial::empty(0, 0);
            }
            let hq = HeadQuery {
                layer,
                head: h,
                q: &q[h * per..(h + 1) * per],
                scale: shape.scale,
            };
            attend_head(kv.geometry(), kv, hq, &p.cpu, scratch)
        })
        .collect()
}

impl<'a> BatchAttention<'a> {
    pub(crate) fn new(
        cfg: &'a AttentionConfig,
        shape: Shape,
        cpu_pool: &'a rayon::ThreadPool,
        slots: Vec<SeqSlot<'a>>,
    ) -> Self {
        let n = slots.len();
        Self {
            cfg,
            shape,
            cpu_pool,
            slots,
            ahead: (0..n).map(|_| Vec::with_capacity(2)).collect(),
            scratch: Scratch::default(),
            timing: AttnTiming::default(),
            guard_checks: Vec::new(),
        }
    }

    fn spawn_cpu(&self, b: usize, layer: usize, plans: &[HeadPlan], q: &[f32]) -> CpuJob {
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let kv = Arc::clone(self.slots[b].kv);
        let plans = plans.to_vec();
        let q = q.to_vec();
        let shape = self.shape;
        let flag = Arc::clone(&cancel);
        self.cpu_pool.spawn(move || {
            let out = cpu_part(&kv, shape, layer, &plans, &q, &flag);
            // Let go of the KV before answering: the step appends to it right after the last
            // answer, which needs it unshared.
            drop(kv);
            // The receiver is gone only if the step was abandoned; nothing to do then.
            let _ = tx.send(out);
        });
        CpuJob { rx, cancel }
    }

    /// Waits for sequence `b`'s CPU part; the wait is device idle time. A part that never
    /// answers (its task panicked) is an error, not an empty result: merging nothing would
    /// silently change the attention.
    fn wait(&mut self, b: usize, job: &CpuJob) -> Result<Vec<Partial>, ModelError> {
        let t = Instant::now();
        let r = job.rx.recv().map_err(|_| {
            ModelError::Attention("the CPU part of attention was lost (its task failed)".into())
        });
        self.slots[b].device_wait += t.elapsed().as_secs_f64();
        r
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
    ) -> Result<(Vec<HeadPlan>, Option<CpuJob>), ModelError> {
        let at = self.ahead[b].iter().position(|a| a.layer == layer);
        if let Some(a) = at.map(|i| self.ahead[b].swap_remove(i)) {
            let per = qb.len() / self.shape.num_kv_heads;
            let cos = (0..self.shape.num_kv_heads)
                .map(|h| cosine(&a.q_pred[h * per..(h + 1) * per], &qb[h * per..(h + 1) * per]))
                .fold(f32::INFINITY, |m, c| if c.is_nan() { c } else { m.min(c) });
            let fell_back = self.cfg.exact || self.cfg.guard.rejects(cos);
            self.guard_checks.push(GuardCheck {
                layer,
                cosine: cos,
                fell_back,
            });
            self.slots[b].seq.record_guard(fell_back);
            self.sample_prediction(b, layer, qb, &a);
            if !fell_back {
                return Ok((a.plans, Some(a.job)));
            }
            self.discard(b, a.job)?;
        }
        let plans = self.slots[b].seq.plan_layer(self.cfg, layer, qb);
        let has_cpu = plans.iter().any(|p| !p.cpu.is_empty());
        let job = has_cpu.then(|| self.spawn_cpu(b, layer, &plans, qb));
        Ok((plans, job))
    }

    /// Measures the prediction's hit ratio against a selection with the real query: sampled,
    /// as that costs as much as the selection itself.
    fn sample_prediction(&mut self, b: usize, layer: usize, qb: &[f32], a: &Ahead) {
        let seq = &mut *self.slots[b].seq;
        if !seq.step().is_multiple_of(PREDICTION_SAMPLE_STEPS) {
            return;
        }
        let per = qb.len() / self.shape.num_kv_heads;
        for h in 0..self.shape.num_kv_heads {
            let qh = &qb[h * per..(h + 1) * per];
            let real = seq.select(self.cfg, layer, h, qh);
            let predicted = a.plans[h].selected();
            seq.record_prediction(&predicted, &real, &a.q_pred[h * per..(h + 1) * per], qh);
        }
    }
}

impl DecodeAttention for BatchAttention<'_> {
    fn wants_prediction(&self, layer: usize) -> bool {
        self.cfg.mode == Mode::Scout
            && self.cfg.precompute
            && layer >= self.cfg.guard.real_query_layers
    }

    fn predicted(&mut self, layer: usize, q_pred: &[f32]) {
        let t = Instant::now();
        let width = self.shape.num_heads * self.shape.head_dim;
        for b in 0..self.slots.len() {
            let q = &q_pred[b * width..(b + 1) * width];
            let plans = self.slots[b].seq.plan_layer(self.cfg, layer, q);
            let job = self.spawn_cpu(b, layer, &plans, q);
            self.ahead[b].push(Ahead {
                layer,
                plans,
                q_pred: q.to_vec(),
                job,
            });
        }
        self.timing.ahead += t.elapsed().as_secs_f64();
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
        for b in 0..self.slots.len() {
            let t_plan = Instant::now();
            let qb = &q[b * width..(b + 1) * width];
            let (kb, vb) = (&k[b * kvw..(b + 1) * kvw], &v[b * kvw..(b + 1) * kvw]);
            let (plans, pending) = self.plans_for(b, layer, qb)?;
            // Device part with the real query, plus the new token itself.
            let t_dev = Instant::now();
            self.timing.plan += (t_dev - t_plan).as_secs_f64();
            let kv = self.slots[b].kv;
            let mut parts: Vec<Partial> = match self.slots[b].dev.as_deref_mut() {
                Some(dev) => {
                    let lists: Vec<&[usize]> = plans.iter().map(|p| p.device.as_slice()).collect();
                    dev.attend(kv.as_ref(), layer, &lists, qb, scale)?
                }
                None => plans
                    .iter()
                    .enumerate()
                    .map(|(h, p)| {
                        let hq = HeadQuery {
                            layer,
                            head: h,
                            q: &qb[h * group * head_dim..(h + 1) * group * head_dim],
                            scale,
                        };
                        attend_head(kv.geometry(), kv.as_ref(), hq, &p.device, &mut self.scratch)
                    })
                    .collect(),
            };
            for (h, part) in parts.iter_mut().enumerate() {
                part.merge_from(&self_partial(
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
            let slot = &mut self.slots[b];
            slot.seq.finish_layer(self.cfg, layer, &plans);
            if let Some(dev) = slot.dev.as_deref_mut() {
                // Recall: copy what the CPU did to the device now, on the recall stream.
                let pending: Vec<&[usize]> = (0..num_kv_heads)
                    .map(|h| slot.seq.pending(layer, h))
                    .collect();
                if pending.iter().any(|p| !p.is_empty()) {
                    dev.recall(slot.kv.as_ref(), layer, &pending)?;
                }
            }
            slot.new_k[layer].copy_from_slice(kb);
            slot.new_v[layer].copy_from_slice(vb);
            self.timing.finish += t_fin.elapsed().as_secs_f64();
        }
        Ok(())
    }
}

/// Attention of each query head of a group over one key: the token being decoded attends
/// to itself; this partial is merged like any other.
fn self_partial(q_group: &[f32], k: &[f32], v: &[f32], scale: f32) -> Partial {
    let d = k.len();
    let g = q_group.len() / d;
    let mut p = Partial::empty(g, d);
    for h in 0..g {
        let s: f32 = q_group[h * d..(h + 1) * d]
            .iter()
            .zip(k)
            .map(|(a, b)| a * b)
            .sum::<f32>()
            * scale;
        p.out[h * d..(h + 1) * d].copy_from_slice(v);
        p.lse2[h] = s * std::f32::consts::LOG2_E;
    }
    p
}
