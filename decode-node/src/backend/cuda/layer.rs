//! The layers' dense work on the device (#21 item 1).
//!
//! A layer's second half is one queue of work: the output projection adds into the residual
//! inside its GEMM (beta = 1), then RMSNorm, gate and up, SiLU-mul and the down projection
//! (beta = 1 again) run back to back on the stream ([`queue_layer`]), where the op-by-op path
//! crosses PCIe and waits three times and adds, norms and multiplies on the host in between.
//!
//! [`CudaResidual`] keeps a decode step's residual in device memory from the embeddings to the
//! LM head: a layer's first half norms it and projects on the device and brings back only
//! q, k and v, with the next layer's predicted q where scout asks for it (one wait), its
//! second half sends only the attention output (no wait).
//!
//! With CUDA graphs on (`graph`, #21 item 6) a resident layer's two halves are placed first
//! ([`ProjectPlan`], [`QkvFinish`], [`Operands`]: every address fixed, every upload done) and
//! queued after, over the batch padded to its bucket, so that a graph replays them.
//!
//! Neither is trusted before it has been compared on the device at hand: the standalone
//! [`CudaBackend::finish_layer_fused`] on its first call against the op-by-op path
//! ([`FusedCheck`]), the device residual by the model at load against the host residual
//! (`Model::residual_diff`); a disagreement keeps the op-by-op path.

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use attention::cuda::NORM_THREADS;
use attention::{DeviceBlock, KvDType};

use cudarc::driver::{result as drv, sys};

use super::blas::{Blas, weight_ptr};
use super::call::SlotList;
use super::driver::{Shared, dev_err, dtype_code, f32_bytes, htod};
use super::graph::{self, Const};
use super::landing;
use super::sketch::SketchQuery;
use super::store::{CudaSeq, ResidentRows};
use super::{BackendError, CudaBackend};
use crate::backend::graphs::{GraphKey, Piece};
pub(super) use crate::backend::rel_diff;
use crate::backend::{
    CpuPart, Landing, LandingShape, LayerOut, LinearOut, LmHead, NextQuery, NormProject,
    ResidentKv, ResidentLayer, ResidentQuery, ResidentSeq, Residual, logits_rows,
};
use crate::model::pick::{PickSpec, RowOut};
use crate::tensor::Tensor;

/// Largest relative difference (to the largest magnitude of the op-by-op result) the fused
/// path may show: both round the same activations to the weights' type, but the norm runs on
/// a different processor, so a value on a rounding edge may round the other way.
pub(super) const FUSED_TOLERANCE: f64 = 1e-2;

/// Whether the fused layer has been checked on this device, and how it went (0: not yet).
#[derive(Debug, Default)]
pub(super) struct FusedCheck(AtomicU8);

const AGREES: u8 = 1;
const DISAGREES: u8 = 2;

impl FusedCheck {
    pub(super) fn state(&self) -> Option<bool> {
        match self.0.load(Ordering::Acquire) {
            AGREES => Some(true),
            DISAGREES => Some(false),
            _ => None,
        }
    }

    pub(super) fn record(&self, agrees: bool) {
        self.0
            .store(if agrees { AGREES } else { DISAGREES }, Ordering::Release);
    }
}

/// Projections of one input run by one GEMM: `rows` of each, from output `first` on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Run {
    pub(super) first: usize,
    pub(super) rows: Vec<usize>,
}

/// Groups projections of one input (each `(device address, type, rows)` of a `[rows][cols]`
/// weight) into runs whose weights follow one another in device memory with one type: a
/// stack uploaded at load, projected with one GEMM.
pub(super) fn stacked_runs(weights: &[(u64, KvDType, usize)], cols: usize) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    let mut end: Option<(u64, KvDType)> = None;
    for (i, &(ptr, dtype, rows)) in weights.iter().enumerate() {
        match runs.last_mut() {
            Some(run) if end == Some((ptr, dtype)) => run.rows.push(rows),
            _ => runs.push(Run {
                first: i,
                rows: vec![rows],
            }),
        }
        end = Some((ptr + (rows * cols * dtype.size()) as u64, dtype));
    }
    runs
}

/// The outputs of `runs` (each `[n][rows of the run]`, one run after another) as each
/// projection's `[n][rows]`, one after another: `back` itself where the two layouts agree
/// (one row, or no run of several parts).
pub(super) fn unstack<'a>(back: &'a [f32], n: usize, runs: &[Run]) -> Cow<'a, [f32]> {
    if n == 1 || runs.iter().all(|r| r.rows.len() == 1) {
        return Cow::Borrowed(back);
    }
    let mut out = Vec::with_capacity(back.len());
    let mut at = 0;
    for run in runs {
        let width: usize = run.rows.iter().sum();
        let mut col = 0;
        for &rows in &run.rows {
            for b in 0..n {
                let from = at + b * width + col;
                out.extend_from_slice(&back[from..from + rows]);
            }
            col += rows;
        }
        at += n * width;
    }
    Cow::Owned(out)
}

/// Offsets (in floats) of the fused layer's device buffers, each 64-float aligned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Plan {
    pub(super) x: usize,
    pub(super) attn: usize,
    pub(super) norm: usize,
    pub(super) xn: usize,
    pub(super) gate: usize,
    pub(super) up: usize,
    /// Floats in all.
    pub(super) total: usize,
    /// Floats uploaded at once from the start: residual, attention output, norm weight.
    pub(super) upload: usize,
}

impl Plan {
    /// Buffers for `n` rows of `hidden`, attention width `attn_w`, MLP width `inter`. The
    /// upload is contiguous: x, attn and the norm weight sit back to back.
    pub(super) fn new(n: usize, hidden: usize, attn_w: usize, inter: usize) -> Self {
        let align = |v: usize| v.div_ceil(64) * 64;
        let x = 0;
        let attn = x + n * hidden;
        let norm = attn + n * attn_w;
        let upload = norm + hidden;
        let xn = align(upload);
        let gate = align(xn + n * hidden);
        // Room for gate|up from one GEMM (`[n][2 * inter]`) where they are stacked.
        let up = align(gate + 2 * n * inter);
        let total = align(up + n * inter);
        Self {
            x,
            attn,
            norm,
            xn,
            gate,
            up,
            total,
            upload,
        }
    }
}

impl Plan {
    /// The plan's buffers placed at device address `base`, with `half` for the halves.
    fn operands(&self, base: u64, half: u64) -> Operands {
        let at = |floats: usize| base + (floats * 4) as u64;
        Operands {
            x: at(self.x),
            attn: at(self.attn),
            norm: at(self.norm),
            xn: at(self.xn),
            gate: at(self.gate),
            up: at(self.up),
            half,
        }
    }
}

/// `src` (`n` f32s) as the GEMM input for weights of `dtype`: itself for f32, else converted
/// into `half`.
fn as_input(
    sh: &Shared,
    dtype: KvDType,
    src: u64,
    n: usize,
    half: u64,
) -> Result<u64, BackendError> {
    if dtype == KvDType::F32 {
        return Ok(src);
    }
    let len = n as i64;
    // SAFETY: `src` holds n floats and `half` room for n halves (sized by the caller).
    unsafe {
        sh.launch(
            &sh.k.f32_to_half,
            ((n as u32).div_ceil(256), 1),
            256,
            &[&src, &half, &len, &dtype_code(dtype)],
        )?;
    }
    Ok(half)
}

/// RMSNorm of `n` rows of `dim` at `x` by the weight at `w`.
#[derive(Debug, Clone, Copy)]
struct NormRows {
    x: u64,
    w: u64,
    eps: f32,
    n: usize,
    dim: usize,
}

impl NormRows {
    /// Queues the norm into the projection input type `dtype`: f32 rows at `xn`, or halves at
    /// `half` written by the norm itself (no f32 rows, no conversion pass); returns where.
    fn queue(&self, sh: &Shared, dtype: KvDType, xn: u64, half: u64) -> Result<u64, BackendError> {
        let (grid, dim) = ((self.n as u32, 1), self.dim as i32);
        let (x, w, eps) = (self.x, self.w, self.eps);
        // SAFETY: x holds n rows of dim, w dim floats; the caller sized `xn` for n x dim
        // floats and `half` for n x dim halves.
        unsafe {
            if dtype == KvDType::F32 {
                sh.launch(
                    &sh.k.rms_norm,
                    grid,
                    NORM_THREADS,
                    &[&x, &w, &xn, &dim, &eps],
                )?;
                Ok(xn)
            } else {
                sh.launch(
                    &sh.k.rms_norm_half,
                    grid,
                    NORM_THREADS,
                    &[&x, &w, &half, &dim, &eps, &dtype_code(dtype)],
                )?;
                Ok(half)
            }
        }
    }
}

/// Device addresses of the fused layer's operands.
#[derive(Debug, Clone, Copy)]
struct Operands {
    /// Residual `[n][hidden]`, updated in place.
    x: u64,
    /// Attention output `[n][attn_w]`.
    attn: u64,
    /// RMSNorm weight `[hidden]`.
    norm: u64,
    /// Scratch: normed rows `[n][hidden]`, gate (`[n][2 * inter]`: room for gate|up from one
    /// GEMM) and up `[n][inter]`, and halves of the widest.
    xn: u64,
    gate: u64,
    up: u64,
    half: u64,
}

/// The shapes of a layer's second half, checked against its weights: `(hidden, attn_w,
/// inter)`.
fn layer_shape(
    n: usize,
    x_len: usize,
    attn_len: usize,
    w: &LayerOut<'_>,
) -> Result<(usize, usize, usize), BackendError> {
    let hidden = w.post_norm.len();
    let inter = w.gate.rows();
    let attn_w = attn_len / n.max(1);
    let ok = n > 0
        && x_len == n * hidden
        && attn_len == n * attn_w
        && (w.o.rows(), w.o.cols()) == (hidden, attn_w)
        && w.gate.cols() == hidden
        && (w.up.rows(), w.up.cols()) == (inter, hidden)
        && (w.down.rows(), w.down.cols()) == (hidden, inter);
    if ok {
        Ok((hidden, attn_w, inter))
    } else {
        Err(BackendError::Unsupported(format!(
            "layer of {n} rows: residual {x_len} floats, attention {attn_len} floats, o {}x{}, gate {}x{}, up {}x{}, down {}x{}, norm {hidden}",
            w.o.rows(),
            w.o.cols(),
            w.gate.rows(),
            w.gate.cols(),
            w.up.rows(),
            w.up.cols(),
            w.down.rows(),
            w.down.cols()
        )))
    }
}

/// Device addresses of a layer's second-half weights: o, gate, up, down.
#[derive(Debug, Clone, Copy)]
struct OutWeights([u64; 4]);

impl OutWeights {
    /// Each uploaded on first use.
    fn of(g: &mut Blas, sh: &Shared, w: &LayerOut<'_>) -> Result<Self, BackendError> {
        Ok(Self([
            weight_ptr(g, sh, w.o)?,
            weight_ptr(g, sh, w.gate)?,
            weight_ptr(g, sh, w.up)?,
            weight_ptr(g, sh, w.down)?,
        ]))
    }
}

/// Everything [`queue_layer`]'s launches are built from besides the row count, as a graph's
/// key ([`crate::backend::graphs::GraphKey::args`]).
fn second_half_args(
    (hidden, attn_w, inter): (usize, usize, usize),
    w: &LayerOut<'_>,
    ws: OutWeights,
    op: Operands,
) -> Vec<u64> {
    let mut args = vec![hidden as u64, attn_w as u64, inter as u64];
    args.extend(ws.0);
    args.extend([op.x, op.attn, op.norm, op.xn, op.gate, op.up, op.half]);
    args.extend([w.o, w.gate, w.up, w.down].map(|t| dtype_code(t.dtype) as u64));
    args.push(u64::from(w.eps.to_bits()));
    args
}

/// Queues a layer's second half on the main stream over operands already on the device.
/// Nothing in it sizes a buffer or uploads: a graph may capture it.
///
/// # Safety
/// The operands are device ranges of the sizes [`Operands`] names for `n` rows of the shape
/// `(hidden, attn_w, inter)` that [`layer_shape`] returned for `w`; `half` holds
/// `n * max(hidden, attn_w, inter)` halves; `ws` are `w`'s device copies.
unsafe fn queue_layer(
    sh: &Shared,
    g: &mut Blas,
    n: usize,
    (hidden, attn_w, inter): (usize, usize, usize),
    w: &LayerOut<'_>,
    ws: OutWeights,
    op: Operands,
) -> Result<(), BackendError> {
    let OutWeights([wo, wg, wu, wd]) = ws;
    // x += attn · oᵀ
    let a_in = as_input(sh, w.o.dtype, op.attn, n * attn_w, op.half)?;
    // SAFETY (every GEMM and launch below): the caller's ranges; the weights are cached
    // device copies of tensors of the checked shapes.
    unsafe { g.gemm_beta(w.o.dtype, hidden, n, attn_w, wo, a_in, op.x, 1.0) }?;
    let len = (n * inter) as i64;
    let grid = (((n * inter) as u32).div_ceil(256), 1);
    let stacked = stacked_runs(
        &[(wg, w.gate.dtype, inter), (wu, w.up.dtype, inter)],
        hidden,
    )
    .len()
        == 1;
    // Normed straight into the gate's input type where gate and up read one input (the f32
    // rows are then never written).
    let one_input = stacked || w.up.dtype == w.gate.dtype;
    let norm_type = if one_input {
        w.gate.dtype
    } else {
        KvDType::F32
    };
    let normed = NormRows {
        x: op.x,
        w: op.norm,
        eps: w.eps,
        n,
        dim: hidden,
    };
    let m_in = normed.queue(sh, norm_type, op.xn, op.half)?;
    let m_in = if one_input {
        m_in
    } else {
        as_input(sh, w.gate.dtype, m_in, n * hidden, op.half)?
    };
    // The MLP's product, the down projection's input.
    let act = if stacked {
        // gate|up stacked at load: one GEMM gives `[n][gate | up]`; the SiLU-mul reads both
        // halves of each row, into the down projection's input type where that is a half.
        unsafe { g.gemm(w.gate.dtype, 2 * inter, n, hidden, wg, m_in, op.gate) }?;
        let width = inter as i32;
        if w.down.dtype != KvDType::F32 {
            // SAFETY: `half` holds n x inter halves; the stream orders this after the GEMMs
            // that read `half`.
            unsafe {
                sh.launch(
                    &sh.k.silu_mul_stacked_half,
                    grid,
                    256,
                    &[&op.gate, &op.half, &width, &len, &dtype_code(w.down.dtype)],
                )?;
            }
            return unsafe { g.gemm_beta(w.down.dtype, hidden, n, inter, wd, op.half, op.x, 1.0) };
        }
        unsafe {
            sh.launch(
                &sh.k.silu_mul_stacked,
                grid,
                256,
                &[&op.gate, &op.up, &width, &len],
            )?;
        }
        op.up
    } else {
        unsafe { g.gemm(w.gate.dtype, inter, n, hidden, wg, m_in, op.gate) }?;
        // The up projection reads the same rounded input unless its type differs (the stream
        // orders the conversion after the gate GEMM that reads `half`).
        let m_in = if w.up.dtype == w.gate.dtype {
            m_in
        } else {
            as_input(sh, w.up.dtype, op.xn, n * hidden, op.half)?
        };
        unsafe { g.gemm(w.up.dtype, inter, n, hidden, wu, m_in, op.up) }?;
        unsafe {
            sh.launch(&sh.k.silu_mul, grid, 256, &[&op.gate, &op.up, &len])?;
        }
        op.gate
    };
    let d_in = as_input(sh, w.down.dtype, act, n * inter, op.half)?;
    unsafe { g.gemm_beta(w.down.dtype, hidden, n, inter, wd, d_in, op.x, 1.0) }
}

/// Places a layer's second half in `base` by `p` (and `half`), and queues the upload of its
/// inputs from the pinned staging: the residual `x` where given (else the caller's residual
/// stays where it is and `x` of the result must be replaced), the attention output and the
/// norm weight, back to back.
#[allow(clippy::too_many_arguments)] // the layer's inputs and where they go, spelled out
fn upload_layer(
    sh: &Shared,
    g: &mut Blas,
    base: u64,
    half: u64,
    p: &Plan,
    x: Option<&[f32]>,
    attn: &[f32],
    norm: &[f32],
) -> Result<Operands, BackendError> {
    let at = |floats: usize| base + (floats * 4) as u64;
    let stage = g.staging.get(p.upload)?;
    let from = if let Some(x) = x {
        stage[p.x..p.attn].copy_from_slice(x);
        p.x
    } else {
        p.attn
    };
    stage[p.attn..p.norm].copy_from_slice(attn);
    stage[p.norm..p.upload].copy_from_slice(norm);
    htod(at(from), f32_bytes(&stage[from..p.upload]), &sh.stream)?;
    Ok(p.operands(base, half))
}

/// How a call's small uploads leave the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Staging {
    /// Through the pinned staging: true DMA, but the host must not rewrite the staging until
    /// the copy ran (the residual's fence), which a layer that never waits cannot promise.
    Pinned,
    /// Through the upload ring ([`super::driver::UploadRing`]): DMA too, and safe without a
    /// fence, for a layer that never waits.
    Ring,
}

/// Where a norm-and-project call's norm weights come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NormsFrom {
    /// Uploaded with the call.
    Upload(Staging),
    /// Kept on the device for this layer ([`super::graph::LayerConsts`]): a graph replays
    /// their addresses.
    Layer(usize),
}

/// One `qkv_finish` launch: the projected rows (address, stride) of q, k and v (k and v
/// absent for a predicted query), their biases and head norms (0: none), the rotation table,
/// and where the finished rows go.
#[derive(Debug, Clone, Copy)]
struct QkvFinish {
    n: usize,
    rows: [(u64, usize); 3],
    biases: [u64; 3],
    norms: [u64; 2],
    /// Query and KV heads.
    heads: (usize, usize),
    d: usize,
    rot: u64,
    eps: f32,
    keeps: [u64; 3],
}

impl QkvFinish {
    /// What the launch is built from, for a graph's key.
    fn args(&self) -> Vec<u64> {
        let mut args = vec![self.n as u64, self.heads.0 as u64, self.heads.1 as u64];
        args.extend(self.rows.iter().flat_map(|&(a, s)| [a, s as u64]));
        args.extend(self.biases);
        args.extend(self.norms);
        args.extend([self.d as u64, self.rot, u64::from(self.eps.to_bits())]);
        args.extend(self.keeps);
        args
    }

    /// # Safety
    /// The rows hold `n` rows of their heads at their strides, the biases, norms and table
    /// are device ranges of their shapes (or 0), the keeps hold `n` rows of their heads.
    unsafe fn queue(&self, sh: &Shared) -> Result<(), BackendError> {
        let [(q, qs), (k, ks), (v, vs)] = self.rows;
        let (qs, ks, vs) = (qs as i32, ks as i32, vs as i32);
        let [pbq, pbk, pbv] = self.biases;
        let [pqn, pkn] = self.norms;
        let (h_q, h_k, d32) = (self.heads.0 as i32, self.heads.1 as i32, self.d as i32);
        let [kq, kk, kv] = self.keeps;
        // SAFETY: per this function's contract.
        unsafe {
            sh.launch(
                &sh.k.qkv_finish,
                ((self.heads.0 + 2 * self.heads.1) as u32, self.n as u32),
                64,
                &[
                    &q, &k, &v, &qs, &ks, &vs, &pbq, &pbk, &pbv, &pqn, &pkn, &self.rot, &h_q, &h_k,
                    &d32, &self.eps, &kq, &kk, &kv,
                ],
            )
        }
    }
}

/// One group of a [`ProjectPlan`]: its norm weight's address and epsilon, and each
/// projection's weight (address, type, rows).
#[derive(Debug, Clone)]
struct PlannedGroup {
    norm: u64,
    eps: f32,
    weights: Vec<(u64, KvDType, usize)>,
}

/// Norms and projections of a residual's rows, placed: every address fixed, so that queuing
/// them sizes and uploads nothing (a graph may capture [`ProjectPlan::queue`]).
#[derive(Debug, Clone)]
struct ProjectPlan {
    /// The residual, `n` rows of `hidden`.
    x: u64,
    n: usize,
    hidden: usize,
    groups: Vec<PlannedGroup>,
    /// Scratch: normed rows, their halves, and every projection's output from `y` on (one
    /// run after another, `[n][rows of the run]` each).
    xn: u64,
    half: u64,
    y: u64,
}

impl ProjectPlan {
    /// The runs of every group, in the order their outputs follow one another from `y`.
    fn runs(&self) -> Vec<Run> {
        self.groups
            .iter()
            .filter(|gr| !gr.weights.is_empty())
            .flat_map(|gr| stacked_runs(&gr.weights, self.hidden))
            .collect()
    }

    /// What the launches are built from, for a graph's key.
    fn args(&self) -> Vec<u64> {
        let mut args = vec![self.x, self.n as u64, self.hidden as u64];
        args.extend([self.xn, self.half, self.y]);
        for gr in &self.groups {
            args.extend([
                gr.norm,
                u64::from(gr.eps.to_bits()),
                gr.weights.len() as u64,
            ]);
            for &(w, dtype, rows) in &gr.weights {
                args.extend([w, dtype_code(dtype) as u64, rows as u64]);
            }
        }
        args
    }

    /// Queues each group's norm, then its projections (consecutive parts of a stack as one
    /// GEMM).
    ///
    /// # Safety
    /// The plan's addresses are device ranges of its shapes (as `place_norm_project` sized
    /// them), the weights `rows x hidden` of their type.
    unsafe fn queue(&self, sh: &Shared, g: &mut Blas) -> Result<(), BackendError> {
        let (n, hidden) = (self.n, self.hidden);
        let at = |floats: usize| self.y + (floats * 4) as u64;
        let mut y = 0;
        for gr in &self.groups {
            let weights = &gr.weights;
            let Some(&(_, first, _)) = weights.first() else {
                continue;
            };
            // Normed straight into the projections' type where they share one; else f32
            // rows, converted per type below.
            let one_type = weights.iter().all(|w| w.1 == first);
            let norm_type = if one_type { first } else { KvDType::F32 };
            let normed = NormRows {
                x: self.x,
                w: gr.norm,
                eps: gr.eps,
                n,
                dim: hidden,
            };
            let input = normed.queue(sh, norm_type, self.xn, self.half)?;
            let mut converted: Option<(KvDType, u64)> = Some((norm_type, input));
            for run in stacked_runs(weights, hidden) {
                let (w_dev, dtype) = (weights[run.first].0, weights[run.first].1);
                let rows: usize = run.rows.iter().sum();
                let input = match converted {
                    Some((d, p)) if d == dtype => p,
                    _ => {
                        let p = as_input(sh, dtype, self.xn, n * hidden, self.half)?;
                        converted = Some((dtype, p));
                        p
                    }
                };
                // SAFETY: the run's weights are `rows x hidden` in one piece of device memory
                // (one tensor, or consecutive parts of a stack), the input `n x hidden`, the
                // output range `n x rows` floats of the scratch.
                unsafe { g.gemm(dtype, rows, n, hidden, w_dev, input, at(y)) }?;
                y += n * rows;
            }
        }
        Ok(())
    }
}

/// Where each projection of one `queue_norm_project` group laid out in `runs` sits in its
/// output (`n` rows): offset of its first row and row stride, in floats.
pub(super) fn projection_rows(n: usize, runs: &[Run]) -> Vec<(usize, usize)> {
    let mut rows = Vec::new();
    let mut base = 0;
    for run in runs {
        let width: usize = run.rows.iter().sum();
        let mut col = 0;
        for r in &run.rows {
            rows.push((base + col, width));
            col += r;
        }
        base += n * width;
    }
    rows
}

impl CudaBackend {
    /// [`crate::backend::Backend::finish_layer`] in one round trip (see the module).
    pub(super) fn finish_layer_fused(
        &self,
        x: &mut [f32],
        attn: &[f32],
        n: usize,
        w: &LayerOut<'_>,
    ) -> Result<(), BackendError> {
        let shape = layer_shape(n, x.len(), attn.len(), w)?;
        let (hidden, attn_w, inter) = shape;
        let sh = &*self.shared;
        sh.bind()?;
        let mut guard = self.lock()?;
        let g: &mut Blas = &mut guard;
        sh.idle.busy();
        let p = Plan::new(n, hidden, attn_w, inter);
        let base = g.y.ptr(&sh.stream, p.total * 4)?;
        let half =
            g.xh.ptr(&sh.stream, n * attn_w.max(hidden).max(inter) * 2)?;
        let op = upload_layer(sh, g, base, half, &p, Some(x), attn, w.post_norm)?;
        let ws = OutWeights::of(g, sh, w)?;
        // SAFETY: the plan's ranges for this shape, `half` sized for the widest input.
        unsafe { queue_layer(sh, g, n, shape, w, ws, op) }?;
        let back = &mut g.staging.get(p.upload)?[..n * hidden];
        sh.read_back(back, op.x)?;
        x.copy_from_slice(back);
        Ok(())
    }

    /// How far a layer's second half `w` run through a fresh graph cache is from the same
    /// piece queued as it is, over each of `inputs` (residual and attention output of `n`
    /// rows, zero-padded to `rows`): the first input is queued, the second captured and
    /// launched, the rest replayed (a replay must read its inputs where they are now, not
    /// as they were at the capture). The largest difference relative to the largest
    /// magnitude; infinite where a padding row of the residual did not stay zero. The
    /// device's own cache is left as it was.
    pub(super) fn second_half_replay_diff(
        &self,
        w: &LayerOut<'_>,
        n: usize,
        rows: usize,
        inputs: &[(Vec<f32>, Vec<f32>)],
    ) -> Result<f64, BackendError> {
        let (hidden, attn_w) = (w.post_norm.len(), w.o.cols());
        let shape = layer_shape(rows, rows * hidden, rows * attn_w, w)?;
        let inter = shape.2;
        if n > rows
            || inputs
                .iter()
                .any(|(x, a)| x.len() != n * hidden || a.len() != n * attn_w)
        {
            return Err(BackendError::Unsupported(format!(
                "inputs of {n} rows padded to {rows} for a layer of {hidden} x {attn_w}"
            )));
        }
        let sh = &*self.shared;
        sh.bind()?;
        let mut guard = self.lock()?;
        let g: &mut Blas = &mut guard;
        g.ensure_workspace()?;
        let p = Plan::new(rows, hidden, attn_w, inter);
        let base = g.y.ptr(&sh.stream, p.total * 4)?;
        let at = |floats: usize| base + (floats * 4) as u64;
        let half =
            g.xh.ptr(&sh.stream, rows * attn_w.max(hidden).max(inter) * 2)?;
        htod(at(p.norm), f32_bytes(w.post_norm), &sh.stream)?;
        let ws = OutWeights::of(g, sh, w)?;
        let op = p.operands(base, half);
        let key = GraphKey {
            piece: Piece::SecondHalf,
            layer: usize::MAX,
            rows,
            args: second_half_args(shape, w, ws, op),
        };
        let load = |x: &[f32], attn: &[f32]| -> Result<(), BackendError> {
            let mut up = vec![0f32; p.norm];
            up[..x.len()].copy_from_slice(x);
            up[p.attn..p.attn + attn.len()].copy_from_slice(attn);
            htod(at(p.x), f32_bytes(&up), &sh.stream)?;
            // The pageable copy has read `up` once the stream is past it.
            sh.stream.synchronize().map_err(|e| dev_err("sync", e))
        };
        // SAFETY (both queues below): the plan's ranges for `rows` rows, `half` for the
        // widest input, `ws` the layer's weights.
        let queue = |g: &mut Blas| unsafe { queue_layer(sh, g, rows, shape, w, ws, op) };
        let saved = std::mem::replace(
            &mut g.graphs.cache,
            crate::backend::graphs::GraphCache::new(2),
        );
        let mut run = || -> Result<f64, BackendError> {
            let mut worst = 0f64;
            for (x, attn) in inputs {
                load(x, attn)?;
                queue(g)?;
                let mut want = vec![0f32; rows * hidden];
                sh.read_back(&mut want, op.x)?;
                load(x, attn)?;
                graph::run_piece(g, sh, key.clone(), queue)?;
                let mut got = vec![0f32; rows * hidden];
                sh.read_back(&mut got, op.x)?;
                if got[n * hidden..].iter().any(|&v| v != 0.0) {
                    return Ok(f64::INFINITY);
                }
                worst = worst.max(rel_diff(&got[..n * hidden], &want[..n * hidden]));
            }
            let s = g.graphs.cache.stats();
            if inputs.len() >= 3 && (s.captures != 1 || s.replays == 0) {
                return Err(BackendError::Device(format!(
                    "the graph cache did not capture once and replay: {s:?}"
                )));
            }
            Ok(worst)
        };
        let r = run();
        g.graphs.cache = saved;
        r
    }

    /// A decode step's residual in device memory (see [`CudaResidual`]).
    pub(super) fn device_residual(
        &self,
        x: Vec<f32>,
        batch: usize,
    ) -> Result<CudaResidual<'_>, BackendError> {
        let sh = &*self.shared;
        sh.bind()?;
        let mut g = self.lock()?;
        if batch == 0 || !x.len().is_multiple_of(batch) {
            return Err(BackendError::Unsupported(format!(
                "a residual of {} floats for {batch} rows",
                x.len()
            )));
        }
        sh.idle.busy();
        let (rows, hidden) = (g.graphs.rows(batch), x.len() / batch);
        let x_dev = g.res.ptr(&sh.stream, rows * hidden * 4)?;
        let stage = g.staging.get(x.len())?;
        stage[..x.len()].copy_from_slice(&x);
        htod(x_dev, f32_bytes(&stage[..x.len()]), &sh.stream)?;
        if rows > batch {
            let pad = x_dev + (x.len() * 4) as u64;
            // SAFETY: the residual buffer holds `rows` rows.
            unsafe {
                drv::memset_d8_async(pad, 0, (rows - batch) * hidden * 4, sh.stream.cu_stream())
            }
            .map_err(|e| dev_err("zeroing the residual's padding rows", e))?;
        }
        let graphed = g.graphs.cache.why_off().is_none();
        let mut r = CudaResidual {
            b: self,
            g,
            x: x_dev,
            n: batch,
            rows,
            graphed,
            rot: None,
            hidden,
            fence: None,
            resident: Vec::new(),
            keep_layers: 0,
            keep_width: 0,
            cur: None,
            kv_back: None,
        };
        r.fence()?;
        Ok(r)
    }
}

/// A decode step's residual stream in device memory: uploaded once with the embeddings;
/// [`Residual::norm_project`] norms it and projects on the device and brings back only the
/// projections (the one wait of a layer's first half), and [`Residual::finish_layer`] sends
/// only the attention output and waits for nothing. Holds the backend's projection state for
/// the whole step (the step thread is its only user meanwhile).
pub(super) struct CudaResidual<'a> {
    b: &'a CudaBackend,
    g: std::sync::MutexGuard<'a, Blas>,
    /// The residual, `rows * hidden` floats (`Blas::res`): the batch's `n` rows, then zero
    /// rows padding it to its graphs' bucket.
    x: u64,
    n: usize,
    rows: usize,
    /// Resident layers run their halves as graphs (`graph::run_piece`), over `rows` rows.
    graphed: bool,
    /// The step's rotation table where a graphed first half reads it, and its host copy.
    rot: Option<(Vec<f32>, u64)>,
    hidden: usize,
    /// Marks the end of the last upload from the pinned staging, which the host must not
    /// rewrite before then.
    fence: Option<sys::CUevent>,
    /// Layers run resident this step; their K and V rows wait in `Blas::kv_keep`, sized for
    /// `keep_layers` layers of rows `keep_width` wide.
    resident: Vec<usize>,
    keep_layers: usize,
    keep_width: usize,
    /// The resident layer between its calls.
    cur: Option<ResidentAt>,
    /// Floats of K and V rows queued into `Blas::kv_staging` before the LM head.
    kv_back: Option<usize>,
}

impl CudaResidual<'_> {
    /// The step's rotation table on the device (`Blas::rot`) for a graphed first half, its
    /// padding rows unrotated: uploaded at the step's first such layer, and again only where
    /// a layer's differs.
    fn rotations(&mut self, l: &ResidentLayer<'_>) -> Result<u64, BackendError> {
        let mut table: Vec<f32> = l.rot.table().iter().flat_map(|&(c, s)| [c, s]).collect();
        // (cos, sin) = (1, 0) for each pair of each padding row.
        let floats = table.len() / self.n.max(1) * self.rows;
        while table.len() < floats {
            table.extend([1.0, 0.0]);
        }
        if let Some((held, at)) = &self.rot
            && *held == table
        {
            return Ok(*at);
        }
        let sh = &*self.b.shared;
        let at = self.g.rot.ptr(&sh.stream, table.len() * 4)?;
        sh.upload(at, f32_bytes(&table))?;
        self.rot = Some((table, at));
        Ok(at)
    }

    /// Records the fence after the uploads queued so far.
    fn fence(&mut self) -> Result<(), BackendError> {
        let ev = match self.fence {
            Some(e) => e,
            None => {
                let e = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| dev_err("creating an event", e))?;
                self.fence = Some(e);
                e
            }
        };
        // SAFETY: the event and the stream are live.
        unsafe { drv::event::record(ev, self.b.shared.stream.cu_stream()) }
            .map_err(|e| dev_err("recording an upload", e))
    }

    /// Waits until the staging may be written again (the last upload has been read).
    fn wait_fence(&self) -> Result<(), BackendError> {
        match self.fence {
            // SAFETY: a live event. The fence is the last work queued whenever the host
            // waits on it (after a layer's second half, or after a copy back), so the stream
            // is empty afterwards.
            Some(e) => {
                let r = unsafe { drv::event::synchronize(e) }
                    .map_err(|e| dev_err("waiting on an upload", e));
                self.b.shared.idle.emptied();
                r
            }
            None => Ok(()),
        }
    }
}

impl Drop for CudaResidual<'_> {
    fn drop(&mut self) {
        // The staging outlives this value: nothing may still read it after the step.
        let _ = self.wait_fence();
        if let Some(e) = self.fence.take() {
            // SAFETY: created by `event::create`, destroyed once.
            let _ = unsafe { drv::event::destroy(e) };
        }
    }
}

impl CudaResidual<'_> {
    /// Queues the norms and projections of `groups` (shapes checked; the outputs' lengths are
    /// the caller's) after one upload of their norm weights. Consecutive projections whose
    /// weights sit one after another in a stack (`upload_stack`) run as one GEMM. Returns the
    /// device address of the outputs, one run after another (`[n][rows of the run]` each),
    /// the runs, and their floats in all.
    fn queue_norm_project(
        &mut self,
        groups: &[NormProject<'_, '_>],
    ) -> Result<(u64, Vec<Run>, usize), BackendError> {
        self.queue_norm_project_via(groups, Staging::Pinned)
    }

    /// [`Self::queue_norm_project`], its norm weights uploaded through `via`.
    fn queue_norm_project_via(
        &mut self,
        groups: &[NormProject<'_, '_>],
        via: Staging,
    ) -> Result<(u64, Vec<Run>, usize), BackendError> {
        let n = self.n;
        let (plan, total) = self.place_norm_project(groups, NormsFrom::Upload(via), n)?;
        let sh = &*self.b.shared;
        // SAFETY: the plan's ranges, placed just now for this residual.
        unsafe { plan.queue(sh, &mut self.g) }?;
        Ok((plan.y, plan.runs(), total))
    }

    /// Places the norms and projections of `groups` over the residual's first `n` rows (the
    /// batch's, or with its padding; shapes checked; the outputs' lengths are the caller's):
    /// the scratch sized, the norm weights uploaded through `norms` or taken where they are,
    /// every weight on the device. Also returns the outputs' floats in all.
    fn place_norm_project(
        &mut self,
        groups: &[NormProject<'_, '_>],
        norms: NormsFrom,
        n: usize,
    ) -> Result<(ProjectPlan, usize), BackendError> {
        let hidden = self.hidden;
        for gr in groups {
            for o in gr.outs.iter() {
                if gr.norm.len() != hidden || o.w.cols() != hidden {
                    return Err(BackendError::Unsupported(format!(
                        "projection of {}x{} after a norm of {} on a residual of {n}x{hidden}",
                        o.w.rows(),
                        o.w.cols(),
                        gr.norm.len()
                    )));
                }
            }
        }
        let sh = &*self.b.shared;
        if norms == NormsFrom::Upload(Staging::Pinned) {
            self.wait_fence()?;
        }
        sh.idle.busy();
        let g = &mut *self.g;
        let align = |v: usize| v.div_ceil(64) * 64;
        let total: usize = groups
            .iter()
            .flat_map(|gr| gr.outs.iter())
            .map(|o| n * o.w.rows())
            .sum();
        // Device scratch: every group's norm weight (uploaded at once), the normed rows (one
        // group after another: the stream orders each group's norm after the last one's
        // GEMMs), then every projection's output.
        let uploaded = groups.len() * hidden;
        let xn_at = align(uploaded);
        let y_at = align(xn_at + n * hidden);
        let base = g.work.ptr(&sh.stream, (y_at + total) * 4)?;
        let at = |floats: usize| base + (floats * 4) as u64;
        let half = g.xh.ptr(&sh.stream, n * hidden * 2)?;
        let norm_at: Vec<u64> = match norms {
            NormsFrom::Upload(Staging::Pinned) => {
                let stage = g.staging.get(uploaded.max(total))?;
                for (k, gr) in groups.iter().enumerate() {
                    stage[k * hidden..(k + 1) * hidden].copy_from_slice(gr.norm);
                }
                htod(at(0), f32_bytes(&stage[..uploaded]), &sh.stream)?;
                (0..groups.len()).map(|k| at(k * hidden)).collect()
            }
            NormsFrom::Upload(Staging::Ring) => {
                let all: Vec<f32> = groups
                    .iter()
                    .flat_map(|gr| gr.norm.iter().copied())
                    .collect();
                sh.upload(at(0), f32_bytes(&all))?;
                (0..groups.len()).map(|k| at(k * hidden)).collect()
            }
            // Counted from the last group (a layer's own q|k|v, after the next layer's
            // predicted query where there is one): a layer's own norm keeps its key.
            NormsFrom::Layer(layer) => groups
                .iter()
                .enumerate()
                .map(|(k, gr)| {
                    let from_last = groups.len() - 1 - k;
                    g.consts
                        .get(&sh.stream, (layer, Const::Norm(from_last)), gr.norm)
                })
                .collect::<Result<_, _>>()?,
        };
        let mut planned = Vec::with_capacity(groups.len());
        for (gr, w) in groups.iter().zip(norm_at) {
            let mut weights = Vec::with_capacity(gr.outs.len());
            for o in gr.outs.iter() {
                weights.push((weight_ptr(g, sh, o.w)?, o.w.dtype, o.w.rows()));
            }
            planned.push(PlannedGroup {
                norm: w,
                eps: gr.eps,
                weights,
            });
        }
        let plan = ProjectPlan {
            x: self.x,
            n,
            hidden,
            groups: planned,
            xn: at(xn_at),
            half,
            y: at(y_at),
        };
        Ok((plan, total))
    }

    /// Copies `floats` floats at device address `src` back (the one wait).
    fn bring_back(&mut self, src: u64, floats: usize) -> Result<&[f32], BackendError> {
        let sh = &*self.b.shared;
        let back = &mut self.g.staging.get(floats)?[..floats];
        sh.read_back(back, src)?;
        Ok(back)
    }
}

/// A resident layer's shapes, checked against its weights and the batch.
fn resident_shape(
    n: usize,
    l: &ResidentLayer<'_>,
    seqs: usize,
) -> Result<(usize, usize, usize), BackendError> {
    let (hq, hk, d) = (l.num_heads, l.num_kv_heads, l.head_dim);
    let group = hq / hk.max(1);
    let len_ok = |b: Option<&[f32]>, want: usize| b.is_none_or(|b| b.len() == want);
    let ok = seqs == n
        && hk > 0
        && group * hk == hq
        && d > 0
        && d.is_multiple_of(2)
        && d <= 128
        && l.rot.positions() == n
        && l.rot.table().len() == n * d / 2
        && l.layer < l.num_layers
        && l.q.0.rows() == hq * d
        && l.k.0.rows() == hk * d
        && l.v.0.rows() == hk * d
        && len_ok(l.q.1, hq * d)
        && len_ok(l.k.1, hk * d)
        && len_ok(l.v.1, hk * d)
        && len_ok(l.q_norm, d)
        && len_ok(l.k_norm, d);
    if ok {
        Ok((hq, hk, d))
    } else {
        Err(BackendError::Unsupported(format!(
            "resident layer {} of {}: {seqs} sequences for {n} rows, {hq} query and {hk} KV heads of {d}, q {}x{}, k {}x{}, v {}x{}, {} rotations",
            l.layer,
            l.num_layers,
            l.q.0.rows(),
            l.q.0.cols(),
            l.k.0.rows(),
            l.k.0.cols(),
            l.v.0.rows(),
            l.v.0.cols(),
            l.rot.positions()
        )))
    }
}

/// Where a resident layer's rows are between its calls (device addresses).
#[derive(Debug, Clone, Copy)]
pub(super) struct ResidentAt {
    layer: usize,
    /// Attention output `[rows][hq][d]` (the batch's rows, then room for the padding rows)
    /// and its lse2 `[n][hq]`.
    attn: u64,
    lse: u64,
    /// Packed q `[rows][hq][d]`, K and V `[rows][hk][d]`, the batch's rows first.
    q: u64,
    k: u64,
    v: u64,
    /// Room for the CPU partials: outputs `[n][hq][d]`, then lse2 `[n][hq]`.
    cpu: u64,
}

impl CudaResidual<'_> {
    /// [`Residual::resident_project`]: everything queued on the main stream, its uploads
    /// through the upload ring (nothing of a layer that never waits may sit in the pinned
    /// staging) or, graphed, from constants kept on the device (the piece replayed by
    /// `graph::run_piece`), and one wait where the query comes back.
    fn queue_resident_project(
        &mut self,
        l: &ResidentLayer<'_>,
        next: Option<NextQuery<'_>>,
        bring_back: bool,
        scores: &mut dyn FnMut(&dyn std::any::Any),
    ) -> Result<ResidentQuery, BackendError> {
        let n = self.n;
        let (hq, hk, d) = resident_shape(n, l, n)?;
        let (qw, kw) = (hq * d, hk * d);
        if let Some(nq) = next
            && (nq.q.0.rows() != qw
                || nq.q.1.is_some_and(|b| b.len() != qw)
                || nq.q_norm.is_some_and(|w| w.len() != d))
        {
            return Err(BackendError::Unsupported(format!(
                "layer {}'s predicted query of {} rows for {hq} heads of {d}",
                l.layer,
                nq.q.0.rows()
            )));
        }
        // Biases are added by `qkv_finish`, with the rest of the rows' finishing.
        fn lin<'a>((w, _): (&'a Tensor, Option<&'a [f32]>)) -> LinearOut<'a> {
            LinearOut {
                w,
                bias: None,
                y: &mut [],
            }
        }
        let mut pred: Vec<LinearOut<'_>> = next.map(|nq| lin(nq.q)).into_iter().collect();
        let mut qkv = [lin(l.q), lin(l.k), lin(l.v)];
        let groups =
            crate::backend::resident::first_half((l.norm, l.eps), next, &mut pred, &mut qkv);
        // Graphed: the norm weights and constants where they stay, the piece queued by
        // `graph::run_piece`; else both uploaded with the call.
        let graphed = self.graphed;
        let norms = if graphed {
            NormsFrom::Layer(l.layer)
        } else {
            NormsFrom::Upload(Staging::Ring)
        };
        // Graphed, the first half runs over the bucket's rows too (the padding rows' q, K and
        // V are computed and never read), so that a graph serves every batch of its bucket.
        let padded = self.rows;
        let (plan, _) = self.place_norm_project(&groups, norms, padded)?;
        drop(groups);
        let runs = plan.runs();
        let rows = projection_rows(padded, &runs);
        let (pred_rows, own) = rows.split_at(usize::from(next.is_some()));
        let [(q_at, qs), (k_at, ks), (v_at, vs)] = own[..] else {
            return Err(BackendError::Device(format!(
                "{} projection rows for q, k and v",
                rows.len()
            )));
        };
        let rot = if graphed {
            Some(self.rotations(l)?)
        } else {
            None
        };
        let sh = &*self.b.shared;
        let g = &mut *self.g;
        let at_y = |floats: usize| plan.y + (floats * 4) as u64;
        // This layer's constants: biases, head norms, and (ungraphed) the rotations, one
        // upload; then the rows the kernels write: attention output, lse2, packed q and
        // predicted q, CPU partials.
        let align = |v: usize| v.div_ceil(64) * 64;
        let mut consts: Vec<f32> = Vec::new();
        let mut put = |part: Option<&[f32]>| {
            part.map(|p| {
                let at = consts.len();
                consts.extend_from_slice(p);
                consts.resize(align(consts.len()), 0.0);
                at
            })
        };
        let (bq, bk, bv) = (put(l.q.1), put(l.k.1), put(l.v.1));
        let (qn, kn) = (put(l.q_norm), put(l.k_norm));
        let (nbq, nqn) = (
            put(next.and_then(|nq| nq.q.1)),
            put(next.and_then(|nq| nq.q_norm)),
        );
        let cs = if rot.is_none() {
            let table: Vec<f32> = l.rot.table().iter().flat_map(|&(c, s)| [c, s]).collect();
            put(Some(&table))
        } else {
            None
        };
        let attn_at = if graphed { 0 } else { align(consts.len()) };
        // Room for the padding rows a graphed second half reads (`self.rows`).
        let lse_at = align(attn_at + self.rows * qw);
        let q_at_r = align(lse_at + n * hq);
        // The predicted rows follow the real ones (and the padding): one copy brings both back.
        let qn_at_r = q_at_r + padded * qw;
        let cpu_at = align(qn_at_r + padded * qw);
        let base = g
            .resident
            .ptr(&sh.stream, (cpu_at + n * hq * (d + 1)) * 4)?;
        let at = |floats: usize| base + (floats * 4) as u64;
        let consts_at = if !graphed {
            sh.upload(base, f32_bytes(&consts))?;
            base
        } else if consts.is_empty() {
            0
        } else {
            g.consts
                .get(&sh.stream, (l.layer, Const::FirstHalf), &consts)?
        };
        let opt = |o: Option<usize>| o.map_or(0u64, |f| consts_at + (f * 4) as u64);
        let rot = rot.unwrap_or_else(|| opt(cs));
        // The step's K and V rows, every layer's in place until `resident_kv`.
        if (self.keep_layers, self.keep_width) != (l.num_layers, kw) {
            self.resident.clear();
            (self.keep_layers, self.keep_width) = (l.num_layers, kw);
        }
        let keep = g
            .kv_keep
            .ptr(&sh.stream, l.num_layers * 2 * padded * kw * 4)?;
        let keep_k = keep + (l.layer * 2 * padded * kw * 4) as u64;
        let keep_v = keep_k + (padded * kw * 4) as u64;
        let (keep_q, keep_qn) = (at(q_at_r), at(qn_at_r));
        let own = QkvFinish {
            n: padded,
            rows: [(at_y(q_at), qs), (at_y(k_at), ks), (at_y(v_at), vs)],
            biases: [opt(bq), opt(bk), opt(bv)],
            norms: [opt(qn), opt(kn)],
            heads: (hq, hk),
            d,
            rot,
            eps: l.eps,
            keeps: [keep_q, keep_k, keep_v],
        };
        // The predicted query alone: q heads only, no K or V.
        let predicted = pred_rows.first().map(|&(p_at, ps)| QkvFinish {
            rows: [(at_y(p_at), ps), (0, 0), (0, 0)],
            biases: [opt(nbq), 0, 0],
            norms: [opt(nqn), 0],
            heads: (hq, 0),
            keeps: [keep_qn, 0, 0],
            ..own
        });
        // SAFETY: the plan's ranges; the finishes' rows are the plan's outputs at their
        // strides, their constants placed above, their keeps `padded` rows of their heads.
        let queue = |g: &mut Blas| unsafe {
            plan.queue(sh, g)?;
            own.queue(sh)?;
            predicted.map_or(Ok(()), |p| p.queue(sh))
        };
        if graphed {
            let mut args = plan.args();
            args.extend(own.args());
            args.extend(predicted.map_or(vec![0], |p| p.args()));
            let key = GraphKey {
                piece: Piece::FirstHalf,
                layer: l.layer,
                rows: padded,
                args,
            };
            graph::run_piece(g, sh, key, queue)?;
        } else {
            queue(g)?;
        }
        self.cur = Some(ResidentAt {
            layer: l.layer,
            attn: at(attn_at),
            lse: at(lse_at),
            q: keep_q,
            k: keep_k,
            v: keep_v,
            cpu: at(cpu_at),
        });
        if !bring_back {
            return Ok(ResidentQuery::default());
        }
        // Blocks scored by the finished rows where they are, before the one wait below.
        scores(&super::store::DeviceQueryRows {
            addr: keep_q,
            width: qw,
            rows: n,
        });
        // The predicted rows start past the padding: one copy brings both back.
        let floats = if next.is_some() {
            (padded + n) * qw
        } else {
            n * qw
        };
        let mut back = vec![0f32; floats];
        sh.read_back(&mut back, keep_q)?;
        let next_q = back.split_off(padded * qw);
        back.truncate(n * qw);
        Ok(ResidentQuery {
            q: back,
            next: next_q,
        })
    }

    /// Floats of the step's K and V rows (`Blas::kv_keep`).
    fn kv_floats(&self) -> usize {
        self.keep_layers * 2 * self.rows * self.keep_width
    }

    /// Queues the copy of the step's K and V rows into the pinned staging (without waiting),
    /// where layers ran resident: the LM head's wait, the step's last, then covers it.
    fn queue_kv_back(&mut self) -> Result<(), BackendError> {
        if self.resident.is_empty() {
            return Ok(());
        }
        let floats = self.kv_floats();
        let sh = &*self.b.shared;
        let g = &mut *self.g;
        let src = g.kv_keep.ptr(&sh.stream, floats * 4)?;
        let dst = &mut g.kv_staging.get(floats)?[..floats];
        // SAFETY: `kv_keep` holds `floats` floats; the staging is page-locked, owned by the
        // backend state this residual holds locked, and not touched again before the LM
        // head's wait (`resident_kv` reads it after).
        unsafe { drv::memcpy_dtoh_async(dst, src, sh.stream.cu_stream()) }
            .map_err(|e| dev_err("copying K and V back", e))?;
        self.kv_back = Some(floats);
        Ok(())
    }

    /// The rows [`Self::queue_resident_project`] left for `l`.
    fn resident_at(&self, l: &ResidentLayer<'_>) -> Result<ResidentAt, BackendError> {
        match self.cur {
            Some(at) if at.layer == l.layer => Ok(at),
            _ => Err(BackendError::Unsupported(format!(
                "layer {} attended or finished resident before its projections",
                l.layer
            ))),
        }
    }

    /// [`Residual::resident_attend`]: one attention launch for the batch, every sequence's KV
    /// heads heads of the call, then the own-key merge. Nothing waits.
    fn queue_resident_attend(
        &mut self,
        l: &ResidentLayer<'_>,
        seqs: &mut [ResidentSeq<'_>],
    ) -> Result<(), BackendError> {
        let n = self.n;
        let (hq, hk, _) = resident_shape(n, l, seqs.len())?;
        let at = self.resident_at(l)?;
        // Each sequence's device state must be in one arena of this device.
        let group = hq / hk;
        let mut list = SlotList::new();
        let mut store: Option<Arc<super::store::CudaKvStore>> = None;
        let width = hq * l.head_dim;
        for (row, s) in seqs.iter_mut().enumerate() {
            let kv = s.kv;
            let lists: Vec<&[DeviceBlock]> = s.blocks.iter().map(Vec::as_slice).collect();
            let seq = s
                .dev
                .as_any_mut()
                .downcast_mut::<CudaSeq>()
                .filter(|c| {
                    c.on(&self.b.shared) && store.as_ref().is_none_or(|f| Arc::ptr_eq(f, c.store()))
                })
                .ok_or_else(|| {
                    BackendError::Unsupported(
                        "a resident layer over device state of another device or arena".into(),
                    )
                })?;
            let placed = match s.picks {
                // Planned on the device: its query row scored where it is.
                Some(call) if call.layer == l.layer => {
                    let q = SketchQuery::Device {
                        addr: at.q + (row * width * 4) as u64,
                        len: width,
                    };
                    seq.place_picked(kv, &lists, group, call, q)?
                }
                Some(call) => {
                    return Err(BackendError::Unsupported(format!(
                        "layer {} attended with picks of layer {}",
                        l.layer, call.layer
                    )));
                }
                None => seq.place_resident(kv, l.layer, &lists, group)?,
            };
            list.append(&placed);
            store = Some(Arc::clone(seq.store()));
        }
        let Some(store) = store else {
            return Ok(());
        };
        let rows = ResidentRows {
            q: at.q,
            k: at.k,
            v: at.v,
            out: at.attn,
            lse: at.lse,
            group,
        };
        store.launch_resident(&list, rows, l.scale)
    }

    /// [`Residual::resident_finish`]: the CPU partials merged by `lse2_merge` (ready ones up
    /// in one pageable copy; landing ones read where they land, after a wait on their flag
    /// queued on the stream), then the second half over the attention output where it is.
    /// Nothing waits on the host.
    fn queue_resident_finish(
        &mut self,
        l: &ResidentLayer<'_>,
        cpu: CpuPart<'_>,
    ) -> Result<(), BackendError> {
        let n = self.n;
        let (hq, hk, d) = resident_shape(n, l, n)?;
        let at = self.resident_at(l)?;
        let shape = layer_shape(n, n * self.hidden, n * hq * d, &l.out)?;
        let (hidden, attn_w, inter) = shape;
        let group = hq / hk;
        let merge_from = match cpu {
            CpuPart::Ready([]) => None,
            CpuPart::Ready(rows) => {
                let fits = rows.len() == n
                    && rows.iter().all(|row| {
                        row.len() == hk
                            && row
                                .iter()
                                .all(|p| p.out.len() == group * d && p.lse2.len() == group)
                    });
                if !fits {
                    return Err(BackendError::Unsupported(format!(
                        "CPU partials of {} rows for a batch of {n} with {hk} KV heads of {group} x {d}",
                        rows.len()
                    )));
                }
                let mut up = Vec::with_capacity(n * hq * (d + 1));
                up.extend(rows.iter().flatten().flat_map(|p| p.out.iter().copied()));
                up.extend(rows.iter().flatten().flat_map(|p| p.lse2.iter().copied()));
                self.b.shared.upload(at.cpu, f32_bytes(&up))?;
                Some(at.cpu)
            }
            CpuPart::Landing(ld) => {
                let (Some((words, flag)), true) =
                    (ld.mem().device(), ld.shape() == LandingShape::of(l, n))
                else {
                    return Err(BackendError::Unsupported(format!(
                        "a landing of shape {:?} for a batch of {n} with {hk} KV heads of \
                         {group} x {d}, or in memory the device does not read",
                        ld.shape()
                    )));
                };
                landing::queue_wait_flag(self.b.shared.stream.cu_stream(), flag, ld.seq())?;
                Some(words)
            }
        };
        let sh = &*self.b.shared;
        let g = &mut *self.g;
        if let Some(from) = merge_from {
            let (heads, dd) = ((n * hq) as i32, d as i32);
            let from_lse = from + (n * hq * d * 4) as u64;
            // SAFETY: attn/lse hold n x hq rows of d and their lse2; `from` as many (the
            // upload's room, or the landing's memory of this shape).
            let merged = unsafe {
                sh.launch(
                    &sh.k.lse2_merge,
                    ((n * hq) as u32, 1),
                    64,
                    &[&at.attn, &at.lse, &from, &from_lse, &heads, &dd],
                )
            };
            if let CpuPart::Landing(ld) = cpu {
                // Marked even when the launch failed: the wait before it still reads the flag.
                g.landings.mark_read(ld.mem(), sh.stream.cu_stream())?;
            }
            merged?;
        }
        // The second half over the attention output where it is, over the bucket's rows
        // (the batch's where graphs are off). Graphed: the norm weight kept on the device,
        // the padding rows of the attention output zeroed (the attention wrote the batch's
        // rows only) so the residual's stay zero, the piece run by `graph::run_piece`. Else
        // only the norm weight goes up.
        let rows = self.rows;
        let p = Plan::new(rows, hidden, attn_w, inter);
        let work = g.work.ptr(&sh.stream, p.total * 4)?;
        let half =
            g.xh.ptr(&sh.stream, rows * attn_w.max(hidden).max(inter) * 2)?;
        let in_work = |floats: usize| work + (floats * 4) as u64;
        let norm = if self.graphed {
            g.consts
                .get(&sh.stream, (l.layer, Const::PostNorm), l.out.post_norm)?
        } else {
            sh.upload(in_work(p.norm), f32_bytes(l.out.post_norm))?;
            in_work(p.norm)
        };
        if rows > n {
            let pad = at.attn + (n * attn_w * 4) as u64;
            // SAFETY: the attention output has room for `rows` rows (`queue_resident_project`).
            unsafe { drv::memset_d8_async(pad, 0, (rows - n) * attn_w * 4, sh.stream.cu_stream()) }
                .map_err(|e| dev_err("zeroing the padding rows", e))?;
        }
        let op = Operands {
            x: self.x,
            attn: at.attn,
            norm,
            xn: in_work(p.xn),
            gate: in_work(p.gate),
            up: in_work(p.up),
            half,
        };
        let ws = OutWeights::of(g, sh, &l.out)?;
        // SAFETY: the residual and the attention output hold `rows` rows of `hidden` and
        // attn_w (the padding ones zero); the plan's ranges for this shape and `rows`.
        let queue = |g: &mut Blas| unsafe { queue_layer(sh, g, rows, shape, &l.out, ws, op) };
        if self.graphed {
            let key = GraphKey {
                piece: Piece::SecondHalf,
                layer: l.layer,
                rows,
                args: second_half_args(shape, &l.out, ws, op),
            };
            graph::run_piece(g, sh, key, queue)?;
        } else {
            queue(g)?;
        }
        self.resident.push(l.layer);
        self.cur = None;
        Ok(())
    }
}

impl Residual for CudaResidual<'_> {
    fn norm_project(&mut self, groups: &mut [NormProject<'_, '_>]) -> Result<(), BackendError> {
        let n = self.n;
        for o in groups.iter().flat_map(|gr| gr.outs.iter()) {
            if o.y.len() != n * o.w.rows() {
                return Err(BackendError::Unsupported(format!(
                    "projection of {} rows into {} floats for {n} rows",
                    o.w.rows(),
                    o.y.len()
                )));
            }
        }
        if groups.iter().all(|gr| gr.outs.is_empty()) {
            return Ok(());
        }
        let (y, runs, total) = self.queue_norm_project(groups)?;
        // The wait for the projections also ends the norm weights' upload.
        let back = self.bring_back(y, total)?;
        let back = unstack(back, n, &runs);
        super::take_outputs(&back, groups.iter_mut().flat_map(|gr| gr.outs.iter_mut()));
        Ok(())
    }

    fn lm_head(
        &mut self,
        head: LmHead<'_>,
        picks: &[Option<PickSpec>],
    ) -> Result<Vec<RowOut>, BackendError> {
        self.queue_kv_back()?;
        let (n, vocab) = (self.n, head.w.rows());
        if picks.len() != n {
            return Err(BackendError::Unsupported(format!(
                "{} pick specs for {n} rows",
                picks.len()
            )));
        }
        if !crate::backend::Backend::picks_on_device(self.b) || picks.iter().all(Option::is_none) {
            return logits_rows(self, head, n);
        }
        let (logits, _, _) = self.queue_norm_project(&[NormProject {
            norm: head.norm,
            eps: head.eps,
            outs: &mut [LinearOut {
                w: head.w,
                bias: None,
                y: &mut [],
            }],
        }])?;
        let sh = &*self.b.shared;
        let picked = super::pick::sample_rows(sh, &mut self.g, logits, vocab, picks)?;
        let mut rows = Vec::with_capacity(n);
        for (i, p) in picked.into_iter().enumerate() {
            rows.push(match p {
                Some(p) => RowOut::Picked(p),
                // Rows the host picks (penalties, bans, a pick past the head) bring back
                // their logits alone.
                None => {
                    let at = logits + (i * vocab * 4) as u64;
                    RowOut::Logits(self.bring_back(at, vocab)?.to_vec())
                }
            });
        }
        Ok(rows)
    }

    fn attends_resident(&self) -> bool {
        crate::backend::Backend::attention_on_device(self.b)
    }

    fn resident_project(
        &mut self,
        l: &ResidentLayer<'_>,
        next: Option<NextQuery<'_>>,
        bring_back: bool,
        scores: &mut dyn FnMut(&dyn std::any::Any),
    ) -> Result<ResidentQuery, BackendError> {
        self.queue_resident_project(l, next, bring_back, scores)
    }

    fn resident_attend(
        &mut self,
        l: &ResidentLayer<'_>,
        seqs: &mut [ResidentSeq<'_>],
    ) -> Result<(), BackendError> {
        self.queue_resident_attend(l, seqs)
    }

    fn cpu_landing(&mut self, l: &ResidentLayer<'_>) -> Result<Option<Arc<Landing>>, BackendError> {
        if !self
            .b
            .shared
            .cpu_flag
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return Ok(None);
        }
        let n = self.n;
        resident_shape(n, l, n)?;
        let shape = LandingShape::of(l, n);
        let (mem, seq) = self.g.landings.take(shape.words())?;
        Landing::new(mem, seq, shape).map(Some)
    }

    fn resident_finish(
        &mut self,
        l: &ResidentLayer<'_>,
        cpu: CpuPart<'_>,
    ) -> Result<(), BackendError> {
        self.queue_resident_finish(l, cpu)
    }

    fn resident_kv(&mut self) -> Result<Vec<ResidentKv>, BackendError> {
        if self.resident.is_empty() {
            return Ok(Vec::new());
        }
        let floats = self.kv_floats();
        let layers = self.keep_layers;
        let sh = &*self.b.shared;
        let all: Vec<f32> = if self.kv_back.take() == Some(floats) {
            // Copied into the pinned staging before the LM head, whose wait it rode (this
            // wait finds the stream empty; it only makes that certain).
            sh.stream
                .synchronize()
                .map_err(|e| dev_err("synchronising", e))?;
            self.g.kv_staging.get(floats)?[..floats].to_vec()
        } else {
            let src = self.g.kv_keep.ptr(&sh.stream, floats * 4)?;
            let mut all = vec![0f32; floats];
            sh.read_back(&mut all, src)?;
            all
        };
        let per_layer = floats / layers.max(1);
        let half = per_layer / 2;
        // The batch's rows of each; the padding rows after them are not the batch's.
        let own = self.n * self.keep_width;
        Ok(std::mem::take(&mut self.resident)
            .into_iter()
            .map(|layer| {
                let at = layer * per_layer;
                ResidentKv {
                    layer,
                    k: all[at..at + own].to_vec(),
                    v: all[at + half..at + half + own].to_vec(),
                }
            })
            .collect())
    }

    fn finish_layer(&mut self, attn: &[f32], w: LayerOut<'_>) -> Result<(), BackendError> {
        let n = self.n;
        let shape = layer_shape(n, n * self.hidden, attn.len(), &w)?;
        let (hidden, attn_w, inter) = shape;
        let sh = &*self.b.shared;
        self.wait_fence()?;
        sh.idle.busy();
        let g = &mut *self.g;
        // The plan's residual slot goes unused: the residual stays in `Blas::res`.
        let p = Plan::new(n, hidden, attn_w, inter);
        let base = g.work.ptr(&sh.stream, p.total * 4)?;
        let half =
            g.xh.ptr(&sh.stream, n * attn_w.max(hidden).max(inter) * 2)?;
        let op = Operands {
            x: self.x,
            ..upload_layer(sh, g, base, half, &p, None, attn, w.post_norm)?
        };
        let ws = OutWeights::of(g, sh, &w)?;
        // SAFETY: the residual holds n rows of `hidden`; the plan's ranges for this shape.
        unsafe { queue_layer(sh, g, n, shape, &w, ws, op) }?;
        // No wait: the next call orders after this on the stream; only the staging must not
        // be rewritten before its upload has been read.
        self.fence()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_parts_of_a_stack_run_as_one_projection_and_come_back_apart() {
        let bf = KvDType::Bf16;
        // q|k|v stacked (64, 32, 32 rows of 256 bf16), then a weight elsewhere, then one that
        // follows v in memory but in another type.
        let (base, cols) = (1 << 20, 256);
        let w = [
            (base, bf, 64),
            (base + 64 * 256 * 2, bf, 32),
            (base + 96 * 256 * 2, bf, 32),
            (9 << 20, bf, 16),
            (9 << 20, bf, 16),
            ((9 << 20) + 16 * 256 * 2, KvDType::F32, 8),
        ];
        let runs = stacked_runs(&w, cols);
        assert_eq!(
            runs,
            vec![
                Run {
                    first: 0,
                    rows: vec![64, 32, 32]
                },
                Run {
                    first: 3,
                    rows: vec![16]
                },
                Run {
                    first: 4,
                    rows: vec![16]
                },
                Run {
                    first: 5,
                    rows: vec![8]
                },
            ]
        );
        // Two rows of a run of widths 2 and 1, then a lone projection of width 2.
        let runs = [
            Run {
                first: 0,
                rows: vec![2, 1],
            },
            Run {
                first: 2,
                rows: vec![2],
            },
        ];
        let back = [1., 2., 3., 4., 5., 6., 7., 8., 9., 10.];
        assert_eq!(
            unstack(&back, 2, &runs)[..],
            [1., 2., 4., 5., 3., 6., 7., 8., 9., 10.]
        );
        // One row, or only lone projections: the layouts agree and nothing is copied.
        assert!(matches!(unstack(&back, 1, &runs), Cow::Borrowed(_)));
        let lone = [
            Run {
                first: 0,
                rows: vec![5],
            },
            Run {
                first: 1,
                rows: vec![5],
            },
        ];
        assert!(matches!(unstack(&back, 2, &lone), Cow::Borrowed(_)));
    }

    #[test]
    fn each_projection_is_found_in_its_run_at_its_stride() {
        let run = |first: usize, rows: &[usize]| Run {
            first,
            rows: rows.to_vec(),
        };
        // q|k|v stacked: one run [n][q | k | v].
        assert_eq!(
            projection_rows(3, &[run(0, &[8, 4, 4])]),
            [(0, 16), (8, 16), (12, 16)]
        );
        // Apart: one run after another, each [n][rows].
        assert_eq!(
            projection_rows(3, &[run(0, &[8]), run(1, &[4]), run(2, &[4])]),
            [(0, 8), (24, 4), (36, 4)]
        );
        // q alone, k|v stacked.
        assert_eq!(
            projection_rows(2, &[run(0, &[8]), run(1, &[4, 4])]),
            [(0, 8), (16, 8), (20, 8)]
        );
    }

    #[test]
    fn plan_keeps_the_upload_contiguous_and_the_buffers_apart() {
        let p = Plan::new(3, 576, 576, 1536);
        assert_eq!((p.x, p.attn, p.norm, p.upload), (0, 1728, 3456, 4032));
        let ranges = [
            (p.x, p.attn),
            (p.attn, p.norm),
            (p.norm, p.upload),
            (p.xn, p.xn + 3 * 576),
            (p.gate, p.gate + 3 * 1536),
            (p.up, p.up + 3 * 1536),
        ];
        for w in ranges.windows(2) {
            assert!(w[0].1 <= w[1].0, "{ranges:?}");
        }
        assert!(p.up + 3 * 1536 <= p.total);
        for start in [p.xn, p.gate, p.up, p.total] {
            assert_eq!(start % 64, 0);
        }
    }
}
