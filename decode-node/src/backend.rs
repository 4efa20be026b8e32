//! The `Backend`: every dense op of the model executor, on one device, and (for a real
//! device) the device side of attention: hot KV blocks in device memory.
//!
//! The CPU backend is what CI tests; its "device" part of attention reads the host pool
//! directly. The CUDA backend (cudarc, dynamic loading, behind the `cuda` feature) runs the
//! projections with cuBLAS and keeps resident blocks in GPU memory ([`DeviceKv`]). Planning
//! (which blocks, which side) lives in the `attention` crate, driven by the engine.

mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub(crate) mod gemm;
pub mod graphs;
pub mod landing;
pub mod resident;
pub(crate) mod team;

pub use cpu::CpuBackend;
pub(crate) use cpu::row_fma_path;
pub use landing::{HostLandingMem, Landing, LandingMem, LandingShape, Ticket};
pub use resident::{NextQuery, ResidentKv, ResidentLayer, ResidentQuery, ResidentSeq};

use std::sync::Arc;

use attention::{BlockGeometry, DeviceBlock, KvSource, Partial};
use kv_transfer::HostPool;

use crate::model::pick::{PickSpec, RowOut};
use crate::tensor::Tensor;

/// Why a backend op failed (only device backends fail).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The device or one of its libraries returned an error.
    #[error("device error: {0}")]
    Device(String),
    /// Device memory for resident KV blocks is exhausted (every arena slot in use).
    #[error("device KV memory is full: {0}")]
    DeviceFull(String),
    /// The device's allocator ran out of memory (weights, scratch, an arena): not the KV
    /// slots' accounting, which is [`BackendError::DeviceFull`].
    #[error("device memory ran out: {0}")]
    OutOfMemory(String),
    /// A shape the device kernels do not support.
    #[error("unsupported on this device: {0}")]
    Unsupported(String),
    /// The device can run nothing more in this process (its context was lost to a fault:
    /// an illegal address, a failed launch, an uncorrectable ECC error).
    #[error("device lost: {0}")]
    DeviceLost(String),
}

/// One projection of [`Backend::linear_many`]: `y = x · wᵀ + bias`.
#[derive(Debug)]
pub struct LinearOut<'a> {
    /// Weight `[out][in]`.
    pub w: &'a Tensor,
    /// Optional bias `[out]`.
    pub bias: Option<&'a [f32]>,
    /// Output `[batch][out]`.
    pub y: &'a mut [f32],
}

/// The weights of a decoder layer's second half, [`Backend::finish_layer`].
#[derive(Debug, Clone, Copy)]
pub struct LayerOut<'a> {
    /// Output projection `[hidden][heads * head_dim]`.
    pub o: &'a Tensor,
    /// RMSNorm weight before the MLP `[hidden]`.
    pub post_norm: &'a [f32],
    /// RMSNorm epsilon.
    pub eps: f32,
    /// MLP gate `[intermediate][hidden]`.
    pub gate: &'a Tensor,
    /// MLP up, the gate's shape.
    pub up: &'a Tensor,
    /// MLP down `[hidden][intermediate]`.
    pub down: &'a Tensor,
}

/// One decode step's residual stream `[batch][hidden]`, kept where the backend computes: a
/// device backend holds it in device memory from the embedding to the LM head, so a layer
/// sends the host only what the host needs (q, k, v) and receives only what the host made
/// (the attention output).
pub trait Residual {
    /// For each group in order, `outs[i].y = (rms_norm(x) * norm) · outs[i].wᵀ + bias` of the
    /// residual `x`: several norms of the same residual in one call (a layer's QKV and the
    /// next layer's predicted query) come back with one wait.
    fn norm_project(&mut self, groups: &mut [NormProject<'_, '_>]) -> Result<(), BackendError>;

    /// [`Backend::finish_layer`] on the residual.
    fn finish_layer(&mut self, attn: &[f32], w: LayerOut<'_>) -> Result<(), BackendError>;

    /// The step's LM head, one [`RowOut`] per row (`picks` has one entry per row): a device
    /// backend picks the token of each row with a spec where the logits are, and brings back
    /// the logits of the rest and of any row its pick leaves to the host
    /// ([`crate::model::pick::pick_row`] is what it must meet). Here every row comes back as
    /// its logits.
    fn lm_head(
        &mut self,
        head: LmHead<'_>,
        picks: &[Option<PickSpec>],
    ) -> Result<Vec<RowOut>, BackendError> {
        logits_rows(self, head, picks.len())
    }

    /// True when this residual runs layers resident ([`resident`]): the model then drives
    /// each layer through [`Residual::resident_project`], [`Residual::resident_attend`] and
    /// [`Residual::resident_finish`].
    fn attends_resident(&self) -> bool {
        false
    }

    /// A resident layer's first half for the batch, queued: `l`'s norm and q|k|v, their
    /// biases, q/k-norm and RoPE, and with `next` the next layer's predicted query from the
    /// same input. With `bring_back` it waits and returns the finished query rows (and the
    /// predicted ones) for the host's planning; else nothing waits and both are empty.
    ///
    /// With `bring_back`, `scores` is first handed the query rows where they are, finished
    /// (a backend's own handle, for [`DeviceSeq::queue_sketch_scores_by`]): blocks scored by
    /// them come back in the same wait as the rows.
    fn resident_project(
        &mut self,
        l: &ResidentLayer<'_>,
        _next: Option<NextQuery<'_>>,
        _bring_back: bool,
        _scores: &mut dyn FnMut(&dyn std::any::Any),
    ) -> Result<ResidentQuery, BackendError> {
        Err(not_resident(l.layer))
    }

    /// Queues the attention of the layer [`Residual::resident_project`] began: each
    /// sequence's device blocks (one [`ResidentSeq`] per row) and the token's own key.
    fn resident_attend(
        &mut self,
        l: &ResidentLayer<'_>,
        _seqs: &mut [ResidentSeq<'_>],
    ) -> Result<(), BackendError> {
        Err(not_resident(l.layer))
    }

    /// Memory for layer `l`'s CPU partials to land in while the step thread goes on
    /// ([`landing`]): the layer's end then waits for it where the residual is, not on the
    /// host. `None`: this residual merges only partials handed to it ready.
    fn cpu_landing(
        &mut self,
        _l: &ResidentLayer<'_>,
    ) -> Result<Option<Arc<Landing>>, BackendError> {
        Ok(None)
    }

    /// Ends the layer: merges `cpu` (the CPU part, ready or landing) into its attention and
    /// queues its second half.
    fn resident_finish(
        &mut self,
        l: &ResidentLayer<'_>,
        _cpu: CpuPart<'_>,
    ) -> Result<(), BackendError> {
        Err(not_resident(l.layer))
    }

    /// After the LM head: the K and V rows of every layer run resident this step, in layer
    /// order.
    fn resident_kv(&mut self) -> Result<Vec<ResidentKv>, BackendError> {
        Ok(Vec::new())
    }
}

/// The CPU part of a resident layer, as its end merges it.
#[derive(Debug, Clone, Copy)]
pub enum CpuPart<'a> {
    /// Per row, one partial per KV head; empty: no row has one.
    Ready(&'a [Vec<Partial>]),
    /// Still being attended: it lands in [`Residual::cpu_landing`]'s memory, and the merge
    /// waits for the landing's flag.
    Landing(&'a Arc<Landing>),
}

/// A resident call on a residual that runs no layer resident.
fn not_resident(layer: usize) -> BackendError {
    BackendError::Unsupported(format!(
        "layer {layer} run where the residual is, on a residual that does not"
    ))
}

/// [`Residual::lm_head`] with every row's logits brought back (`n` rows).
pub(crate) fn logits_rows<R: Residual + ?Sized>(
    r: &mut R,
    head: LmHead<'_>,
    n: usize,
) -> Result<Vec<RowOut>, BackendError> {
    let vocab = head.w.rows();
    let mut logits = vec![0f32; n * vocab];
    r.norm_project(&mut [NormProject {
        norm: head.norm,
        eps: head.eps,
        outs: &mut [LinearOut {
            w: head.w,
            bias: None,
            y: &mut logits,
        }],
    }])?;
    Ok(logits
        .chunks_exact(vocab.max(1))
        .map(|row| RowOut::Logits(row.to_vec()))
        .collect())
}

/// The LM head of [`Residual::lm_head`]: `rms_norm(x) * norm · wᵀ`.
#[derive(Debug, Clone, Copy)]
pub struct LmHead<'a> {
    /// Final RMSNorm weight `[hidden]`.
    pub norm: &'a [f32],
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Projection onto the vocabulary `[vocab][hidden]`.
    pub w: &'a Tensor,
}

/// One group of [`Residual::norm_project`]: projections of the residual normed by `norm`.
#[derive(Debug)]
pub struct NormProject<'a, 'b> {
    /// RMSNorm weight `[hidden]`.
    pub norm: &'a [f32],
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Projections of the normed rows.
    pub outs: &'b mut [LinearOut<'a>],
}

/// The residual in host memory, each op a call of its backend.
#[derive(Debug)]
pub struct HostResidual<'a, B: ?Sized> {
    b: &'a B,
    x: Vec<f32>,
    xn: Vec<f32>,
    batch: usize,
}

impl<'a, B: Backend + ?Sized> HostResidual<'a, B> {
    /// The residual `x` (`[batch][hidden]`) on the host of `b`.
    pub fn new(b: &'a B, x: Vec<f32>, batch: usize) -> Self {
        let xn = vec![0f32; x.len()];
        Self { b, x, xn, batch }
    }
}

impl<B: Backend + ?Sized> Residual for HostResidual<'_, B> {
    fn norm_project(&mut self, groups: &mut [NormProject<'_, '_>]) -> Result<(), BackendError> {
        for g in groups {
            self.b.rms_norm(&self.x, g.norm, g.eps, &mut self.xn);
            self.b.linear_many(&self.xn, self.batch, g.outs)?;
        }
        Ok(())
    }

    fn finish_layer(&mut self, attn: &[f32], w: LayerOut<'_>) -> Result<(), BackendError> {
        self.b.finish_layer(&mut self.x, attn, self.batch, w)
    }
}

/// Largest `|got - want|` over the largest `|want|`: NaN where either holds NaN or their
/// lengths differ, which no tolerance accepts.
pub(crate) fn rel_diff(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::NAN;
    }
    let scale = want.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
    let mut diff = 0f64;
    for (a, b) in got.iter().zip(want) {
        let d = f64::from(a - b).abs();
        if d.is_nan() {
            return f64::NAN;
        }
        diff = diff.max(d);
    }
    diff / scale.max(1e-30)
}

/// Device memory for hot KV blocks, shared by every sequence of the engine.
pub trait DeviceKv: Send + Sync + std::fmt::Debug {
    /// Per-sequence device state with `blocks_per_head` slots per (layer, KV head); dropping
    /// it frees the sequence's device blocks.
    fn new_seq(self: Arc<Self>, num_layers: usize, blocks_per_head: usize) -> Box<dyn DeviceSeq>;

    /// False when the host pool could not be page-locked: copies to the device are then
    /// staged by the driver, correct but slow (exported as a metric, not only logged).
    fn host_pool_pinned(&self) -> bool {
        true
    }

    /// True when its sequences keep the key sketch here and score blocks with it
    /// ([`DeviceSeq::scores_on_device`]) for `group` query heads per KV head: admission then
    /// counts the sketch in device memory, not in host pool blocks.
    fn keeps_sketch(&self, _group: usize) -> bool {
        false
    }

    /// Bytes of KV it holds in all (what admission may count against it): where free device
    /// memory allowed less than asked for, less than the node's `--device-kv-bytes`.
    fn capacity_bytes(&self) -> u64 {
        u64::MAX
    }
}

/// The device side of one sequence's attention. It decides nothing about placement: the
/// sequence's residency table (`attention::SeqAttention`) names the slot of every block it
/// hands over, and the device keeps each slot holding that block, copying it in when the
/// slot's block changed or the block has grown since it was copied.
pub trait DeviceSeq: Send + std::fmt::Debug + std::any::Any {
    /// This value, for the backend that made it to reach its own type
    /// ([`Residual::resident_attend`] drives the sequence's device state directly).
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;

    /// Queues the device part of `layer`: for each KV head `h`, attention over `blocks[h]` of
    /// `kv` with the query group `q[h]` (`q` is `[num_kv_heads][G][head_dim]`). Nothing
    /// waits: a step queues every sequence's part before it collects the first, so the device
    /// works through them while the host plans the next.
    fn submit(
        &mut self,
        kv: &dyn KvSource,
        layer: usize,
        blocks: &[&[DeviceBlock]],
        q: &[f32],
        scale: f32,
    ) -> Result<(), BackendError>;

    /// The partials (one per KV head) of the last [`DeviceSeq::submit`], waiting for them.
    fn collect(&mut self) -> Result<Vec<Partial>, BackendError>;

    /// [`DeviceSeq::submit`], then [`DeviceSeq::collect`].
    fn attend(
        &mut self,
        kv: &dyn KvSource,
        layer: usize,
        blocks: &[&[DeviceBlock]],
        q: &[f32],
        scale: f32,
    ) -> Result<Vec<Partial>, BackendError> {
        self.submit(kv, layer, blocks, q, scale)?;
        self.collect()
    }
    /// True when [`DeviceSeq::sketch_scores`] answers for `group` query heads per KV head.
    fn scores_on_device(&self, _group: usize) -> bool {
        false
    }

    /// Block scores of `call.layer`'s blocks `0 .. call.blocks` for every KV head by
    /// `attention::BlockScorer::Sketch` (`q` is `[num_kv_heads][G][head_dim]`), computed where
    /// this sequence keeps a sketch of its keys, brought up to `kv`'s tokens first; with
    /// `call.pick`, only each head's best blocks of that cut ([`Scored::Picks`]), where the
    /// device chooses them. `Ok(None)`: this device keeps none (the host scores instead).
    fn sketch_scores(
        &mut self,
        _kv: &dyn KvSource,
        _q: &[f32],
        _call: SketchCall,
    ) -> Result<Option<Scored>, BackendError> {
        Ok(None)
    }

    /// Queues [`DeviceSeq::sketch_scores`] without waiting for them, for
    /// [`DeviceSeq::take_sketch_scores`] to collect: a layer planned ahead is scored while
    /// the device would otherwise wait for the host, and its scores are back by the time the
    /// host plans it. One call is held at a time; a new one drops the one before. `Ok(false)`:
    /// nothing queued (this device keeps no sketch, or scores only when asked).
    fn queue_sketch_scores(
        &mut self,
        _kv: &dyn KvSource,
        _q: &[f32],
        _call: SketchCall,
    ) -> Result<bool, BackendError> {
        Ok(false)
    }

    /// [`DeviceSeq::queue_sketch_scores`] by row `row` of query rows a residual holds where
    /// its backend computed them (`rows`: the handle [`Residual::resident_project`] hands
    /// over; `Ok(false)` for one this device cannot read), so the scores are made before the
    /// rows come back, in the same wait.
    fn queue_sketch_scores_by(
        &mut self,
        _kv: &dyn KvSource,
        _rows: (&dyn std::any::Any, usize),
        _call: SketchCall,
    ) -> Result<bool, BackendError> {
        Ok(false)
    }

    /// The scores [`DeviceSeq::queue_sketch_scores`] queued for `layer`, waiting for them
    /// (what `sketch_scores` would have answered then). `Ok(None)`: none queued for `layer`;
    /// a call queued for another layer is dropped.
    fn take_sketch_scores(&mut self, _layer: usize) -> Result<Option<Scored>, BackendError> {
        Ok(None)
    }

    /// Starts copying, for each KV head `h`, `blocks[h]` of `layer` into their slots on the
    /// recall stream (one batch); they are ready for the next [`DeviceSeq::attend`] of
    /// `layer`, which orders after the copies on the device without waiting on the host.
    fn recall(
        &mut self,
        kv: &dyn KvSource,
        layer: usize,
        blocks: &[&[DeviceBlock]],
    ) -> Result<(), BackendError>;

    /// True when this device can plan `call.layer` alone this step (#21 item 4): pick each
    /// KV head's blocks of `call.pick` by the layer's query rows where they are (a resident
    /// layer's, [`ResidentSeq::picks`]) and attend them with no host list, each pick's slot
    /// read from a table the device keeps of every block it holds whole. It holds every block
    /// below the cut's end of the layer whole, and scores and picks `call` itself.
    fn picks_resident(&self, _call: &SketchCall) -> bool {
        false
    }

    /// A layer this device planned alone gave picks the host refused (a device defect): it
    /// plans no layer alone from now on, for any sequence (the host plans them all).
    fn refuse_device_plans(&self) {}

    /// The picks of `layer` this device made for a resident layer this step
    /// ([`ResidentSeq::picks`]), per KV head in ascending order, taken once after the step's
    /// wait (the LM head's). `Ok(None)`: none made for `layer`.
    fn take_device_picks(
        &mut self,
        _layer: usize,
    ) -> Result<Option<Vec<Vec<usize>>>, BackendError> {
        Ok(None)
    }

    /// From now on the sequence's residency numbers `blocks_per_head` slots per (layer, KV
    /// head), more or fewer than it was created with (a share of spare device memory lent, or
    /// given back after [`attention::SeqAttention::set_device_cap`] moved every block into
    /// the slots below it): the memory behind the slots past it goes back to the device.
    /// Called between steps, never with a call of the sequence still to collect.
    fn set_slots_per_head(&mut self, blocks_per_head: usize) -> Result<(), BackendError>;
}

/// What a device's sketch scoring is asked for: `layer`'s blocks `0 .. blocks`, with the
/// softmax `scale` and how a group's query heads combine (`how`); with `pick`, each KV head's
/// best blocks of that cut instead of every score, where the device can choose them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SketchCall {
    pub layer: usize,
    pub scale: f32,
    pub how: attention::GroupScore,
    pub blocks: usize,
    pub pick: Option<attention::TopCut>,
}

/// A device's answer to a [`SketchCall`].
#[derive(Debug, Clone, PartialEq)]
pub enum Scored {
    /// Every block's score, per KV head (`blocks` each).
    Scores(Vec<Vec<f32>>),
    /// Per KV head, the call's `pick` answered (`attention::best_in`: its best blocks in
    /// ascending order): `k` block indices where every score would be `blocks` floats.
    Picks(Vec<Vec<usize>>),
}

/// True when a GPU's sketch kernels (`--block-scorer sketch` scored on the device) take heads
/// of `head_dim` in groups of `group`: whole 16-byte loads of 4-bit rows, a register per
/// query head.
pub fn sketch_fits(head_dim: usize, group: usize) -> bool {
    head_dim.is_multiple_of(32) && head_dim <= 128 && (1..=8).contains(&group)
}

/// Dense ops of the executor. Activations are f32, row-major `[batch][features]`.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// A short name for logs and metrics (`cpu`, `cuda:0`).
    fn name(&self) -> String;

    /// `y[b][o] = sum_i x[b][i] * w[o][i] + bias[o]` for `w` of shape `[out][in]`; reads each
    /// weight once for the whole batch.
    fn linear(
        &self,
        x: &[f32],
        batch: usize,
        w: &Tensor,
        bias: Option<&[f32]>,
        y: &mut [f32],
    ) -> Result<(), BackendError>;

    /// True when the ops run on rayon's global pool from the calling thread (the CPU backend):
    /// a model step is then best run on one of that pool's threads. A device backend's ops
    /// must stay on the thread its context is bound to.
    fn parallel_on_rayon(&self) -> bool {
        false
    }

    /// True when every step reads the weights from host memory (the CPU backend): the model
    /// then packs them onto huge pages ([`crate::tensor::pack_onto_huge_pages`]).
    fn streams_host_weights(&self) -> bool {
        false
    }

    /// Makes `w` ready for [`Backend::linear`] ahead of the first step (a device backend
    /// uploads it now rather than inside a request's first token).
    fn prepare(&self, _w: &Tensor) -> Result<(), BackendError> {
        Ok(())
    }

    /// Makes `parts` ready as [`Backend::prepare`] does, where a device backend may keep them as
    /// one stacked matrix (q|k|v, gate|up of a layer) and project consecutive ones with one
    /// call.
    fn prepare_stack(&self, parts: &[&Tensor]) -> Result<(), BackendError> {
        for w in parts {
            self.prepare(w)?;
        }
        Ok(())
    }

    /// Several projections of the same input (q/k/v, gate/up): a device backend uploads `x`
    /// once and waits once.
    fn linear_many(
        &self,
        x: &[f32],
        batch: usize,
        outs: &mut [LinearOut<'_>],
    ) -> Result<(), BackendError> {
        for o in outs.iter_mut() {
            self.linear(x, batch, o.w, o.bias, o.y)?;
        }
        Ok(())
    }

    /// The MLP's input to its down projection, `y = silu(x · gateᵀ) * (x · upᵀ)`, for `gate`
    /// and `up` of one shape: the CPU backend runs both in one pass over their rows.
    fn linear_glu(
        &self,
        x: &[f32],
        batch: usize,
        gate: &Tensor,
        up: &Tensor,
        y: &mut [f32],
    ) -> Result<(), BackendError> {
        glu_unfused(self, x, batch, gate, up, y)
    }

    /// The second half of a decoder layer on the residual `x` (`[batch][hidden]`), in place:
    /// `x += attn · oᵀ`, then `x += down(silu(gate(m)) * up(m))` with `m` the RMSNorm of `x`.
    /// A device backend runs it in one round trip instead of one per projection.
    fn finish_layer(
        &self,
        x: &mut [f32],
        attn: &[f32],
        batch: usize,
        w: LayerOut<'_>,
    ) -> Result<(), BackendError> {
        finish_layer_unfused(self, x, attn, batch, w)
    }

    /// A decode step's residual stream, starting from the embeddings `x` (`[batch][hidden]`):
    /// on the host by default, in device memory on a device backend.
    fn residual<'a>(
        &'a self,
        x: Vec<f32>,
        batch: usize,
    ) -> Result<Box<dyn Residual + 'a>, BackendError> {
        Ok(Box::new(HostResidual::new(self, x, batch)))
    }

    /// True when [`Backend::residual`] keeps the residual off the host: the model then checks
    /// it once against [`HostResidual`].
    fn residual_on_device(&self) -> bool {
        false
    }

    /// From now on [`Backend::residual`] keeps the residual on the host (a check found the
    /// device path wrong).
    fn keep_residual_on_host(&self) {}

    /// True when this backend's residual runs layers resident ([`resident`]): the engine then
    /// checks that path once against the host path at start.
    fn attention_on_device(&self) -> bool {
        false
    }

    /// From now on no residual runs layers resident (a check found that path wrong).
    fn keep_attention_on_host(&self) {}

    /// Seconds so far the device sat with nothing queued while the host worked (a lower
    /// bound: gaps between queued launches are not counted); `None` for the CPU backend.
    fn device_idle_seconds(&self) -> Option<f64> {
        None
    }

    /// What the device's CUDA graphs of step pieces did so far ([`graphs::GraphStats`],
    /// counts since start); `None` where the backend runs no graphs.
    fn graph_stats(&self) -> Option<graphs::GraphStats> {
        None
    }

    /// True while the device runs step pieces as graphs.
    fn graphs_on(&self) -> bool {
        false
    }

    /// No more graphs (a check found them disagreeing: `why`).
    fn turn_graphs_off(&self, _why: &str) {}

    /// Turns the device profiler's collection on or off (`cuProfilerStart`/`Stop`: what
    /// `ncu --profile-from-start off` records); nothing where there is no device.
    fn profile(&self, _on: bool) -> Result<(), BackendError> {
        Ok(())
    }

    /// True when [`Residual::lm_head`] picks tokens where the logits are: the model then
    /// checks those picks once against the host's.
    fn picks_on_device(&self) -> bool {
        false
    }

    /// From now on [`Residual::lm_head`] brings every row's logits back (a check found the
    /// device's picks wrong).
    fn keep_picks_on_host(&self) {}

    /// Bytes per second the device's memory moves (a copy's read plus write), measured now;
    /// `None` for the CPU backend, whose bound the benches measure themselves.
    fn memory_bandwidth(&self) -> Option<f64> {
        None
    }

    /// Device memory for resident KV blocks of `geom`, `capacity_bytes` of it, with `pool`
    /// page-locked for asynchronous copies. `None`: the backend has no separate device memory
    /// (the CPU backend attends the host pool directly).
    fn device_kv(
        &self,
        _geom: BlockGeometry,
        _capacity_bytes: u64,
        _pool: &HostPool,
    ) -> Result<Option<Arc<dyn DeviceKv>>, BackendError> {
        Ok(None)
    }

    /// RMSNorm of each `w.len()`-sized row of `x` into `out`, as HF computes it in f32.
    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let d = w.len();
        for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for ((o, v), g) in or.iter_mut().zip(xr).zip(w) {
                *o = g * (v * inv);
            }
        }
    }

    /// `gate[i] = silu(gate[i]) * up[i]`.
    fn silu_mul(&self, gate: &mut [f32], up: &[f32]) {
        for (g, u) in gate.iter_mut().zip(up) {
            *g = silu_times(*g, *u);
        }
    }
}

/// [`Backend::finish_layer`] op by op: each projection a call of its own, the residual adds
/// and the norm on the host.
pub(crate) fn finish_layer_unfused<B: Backend + ?Sized>(
    b: &B,
    x: &mut [f32],
    attn: &[f32],
    n: usize,
    w: LayerOut<'_>,
) -> Result<(), BackendError> {
    let h = w.post_norm.len();
    let mut o = vec![0f32; n * h];
    b.linear(attn, n, w.o, None, &mut o)?;
    x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
    let mut xn = vec![0f32; n * h];
    b.rms_norm(x, w.post_norm, w.eps, &mut xn);
    let mut gate = vec![0f32; n * w.gate.rows()];
    b.linear_glu(&xn, n, w.gate, w.up, &mut gate)?;
    b.linear(&gate, n, w.down, None, &mut o)?;
    x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
    Ok(())
}

/// [`Backend::linear_glu`] as two projections in one call, then the SiLU-mul.
fn glu_unfused<B: Backend + ?Sized>(
    b: &B,
    x: &[f32],
    batch: usize,
    gate: &Tensor,
    up: &Tensor,
    y: &mut [f32],
) -> Result<(), BackendError> {
    let mut u = vec![0f32; y.len()];
    b.linear_many(
        x,
        batch,
        &mut [
            LinearOut {
                w: gate,
                bias: None,
                y,
            },
            LinearOut {
                w: up,
                bias: None,
                y: &mut u,
            },
        ],
    )?;
    b.silu_mul(y, &u);
    Ok(())
}

/// `silu(g) * u`, within a few ulps of HF's f32 graph (tested against f64).
fn silu_times(g: f32, u: f32) -> f32 {
    // sigmoid(g) from e = e^-|g| <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) below. The
    // polynomial `exp_le0` vectorises where libm's `expf` is a call per element (2.3% of a
    // batch-8 step on SmolLM2 went to `expf` and its loop).
    let e = crate::model::sampling::exp_le0(-g.abs());
    let num = if g >= 0.0 { 1.0 } else { e };
    g * (num / (1.0 + e)) * u
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SiLU through the polynomial exponential against f64, across both signs, the range
    /// where the sigmoid saturates, zero and NaN.
    #[test]
    fn silu_times_matches_f64() {
        for i in -4000..=4000 {
            let g = i as f32 * 0.025;
            let want = g as f64 / (1.0 + (-(g as f64)).exp()) * 1.5;
            let got = silu_times(g, 1.5) as f64;
            // `exp_le0`'s bound (its error grows with |g|, where the sigmoid is tiny) plus a
            // few roundings.
            let tol = 1e-6 + 1e-7 * f64::from(g.abs());
            assert!(
                (got - want).abs() <= tol * want.abs() + 1e-30,
                "silu({g}) * 1.5 = {got}, want {want}"
            );
        }
        assert_eq!(silu_times(0.0, 3.0), 0.0);
        assert!(silu_times(f32::NAN, 1.0).is_nan());
        assert_eq!(silu_times(f32::INFINITY, 2.0), f32::INFINITY);
    }

    #[test]
    fn rel_diff_is_relative_to_the_largest_value_and_refuses_nan() {
        assert_eq!(rel_diff(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((rel_diff(&[1.0, 4.1], &[1.0, 4.0]) - 0.025).abs() < 1e-6);
        assert!(rel_diff(&[f32::NAN, 1.0], &[1.0, 1.0]).is_nan());
        assert!(rel_diff(&[1.0], &[1.0, 2.0]).is_nan());
    }
}
