//! cuBLAS projections: the handle, device copies of the weights (uploaded once), activation
//! buffers and pinned staging, and the one GEMM shape the model needs.

use std::collections::HashMap;
use std::ffi::c_void;

use attention::KvDType;
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, result as drv, sys};

use super::driver::{
    DevBuf, GEMV_MAX_BATCH, GEMV_TC_ROWS, GEMV_TC_WARPS, GEMV_WARPS, Pinned, Shared, dev_err,
    dtype_code, launch_on, lib_err,
};
use super::tactic::{Choice, Shape, Tactic, Tactics};
use super::{BackendError, CudaError, Tensor};

/// The state of the projections, behind one lock (one main stream).
pub(crate) struct Blas {
    handle: blas_sys::cublasHandle_t,
    /// Device copies of the weights, by [`Tensor::id`].
    pub(crate) weights: HashMap<u64, CudaSlice<u8>>,
    /// Weights uploaded as parts of one stacked matrix ([`upload_stack`]): each part's device
    /// address inside its stack, by [`Tensor::id`]; the stacks themselves.
    pub(crate) parts: HashMap<u64, u64>,
    pub(crate) stacks: Vec<CudaSlice<u8>>,
    pub(crate) x: DevBuf,
    pub(crate) xh: DevBuf,
    pub(crate) y: DevBuf,
    /// A decode step's residual, and the scratch of the ops on it (`layer::CudaResidual`).
    pub(crate) res: DevBuf,
    pub(crate) work: DevBuf,
    /// A resident layer's biases, head norms, rotations, attention output and lse2
    /// (`layer::CudaResidual`'s resident layers), and the step's K and V rows of every layer.
    pub(crate) resident: DevBuf,
    /// The step's rotation table where graphed layers read it (`layer::CudaResidual`).
    pub(crate) rot: DevBuf,
    pub(crate) kv_keep: DevBuf,
    /// Host side of `kv_keep`, filled under the LM head's wait.
    pub(crate) kv_staging: Pinned,
    /// Host side of `x` and `y`.
    pub(crate) staging: Pinned,
    /// Device picks' spec and results, and their host side (`pick::sample_rows`).
    pub(crate) pick: DevBuf,
    pub(crate) pick_staging: Pinned,
    /// Where resident layers' CPU partials land (`layer::CudaResidual::cpu_landing`).
    pub(crate) landings: super::landing::LandingPool,
    /// `gemv_b{B}` and `gemv_tc` (on the stream the handle issues on), and which products
    /// take them.
    gemv: Vec<CudaFunction>,
    gemv_tc: CudaFunction,
    pub(crate) tactics: Tactics,
    /// Where a shape's first product times the kernels: a scratch output.
    trial: DevBuf,
    /// CUDA graphs of the step's pieces (`graph`).
    pub(crate) graphs: super::graph::StepGraphs,
    /// Layers' constants (norm weights, biases, head norms) on the device, for the pieces
    /// graphs replay.
    pub(crate) consts: super::graph::LayerConsts,
    /// Inside a graph capture: a GEMM shape must not be timed now (the timing waits).
    pub(crate) capturing: bool,
    /// cuBLAS's workspace, set before the first capture so that a captured GEMM never asks
    /// for memory ([`Blas::ensure_workspace`]).
    workspace: Option<CudaSlice<u8>>,
    stream: Arc<CudaStream>,
}

// SAFETY: the cuBLAS handle is only used under the backend's mutex, from one thread at a time.
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `create_handle` and is destroyed once.
        if let Err(e) = unsafe { blas::destroy_handle(self.handle) } {
            tracing::warn!(error = ?e, "destroying the cuBLAS handle failed");
        }
    }
}

impl Blas {
    /// A cuBLAS handle issuing on `sh`'s main stream.
    pub(crate) fn new(
        sh_stream: &Arc<CudaStream>,
        gemv: Vec<CudaFunction>,
        gemv_tc: CudaFunction,
    ) -> Result<Self, CudaError> {
        let handle = blas::create_handle().map_err(|e| CudaError::Driver(format!("{e:?}")))?;
        let b = Self {
            handle,
            weights: HashMap::new(),
            parts: HashMap::new(),
            stacks: Vec::new(),
            x: DevBuf::default(),
            xh: DevBuf::default(),
            y: DevBuf::default(),
            res: DevBuf::default(),
            work: DevBuf::default(),
            resident: DevBuf::default(),
            rot: DevBuf::default(),
            kv_keep: DevBuf::default(),
            kv_staging: Pinned::empty(),
            staging: Pinned::empty(),
            pick: DevBuf::default(),
            pick_staging: Pinned::empty(),
            landings: Default::default(),
            gemv,
            gemv_tc,
            tactics: Tactics::from_env(
                std::env::var("DECODE_NODE_GEMV").ok().as_deref(),
                std::env::var("DECODE_NODE_GEMV_MAX_BATCH").ok().as_deref(),
                std::env::var("DECODE_NODE_GEMV_TACTIC").ok().as_deref(),
            ),
            trial: DevBuf::default(),
            graphs: super::graph::StepGraphs::from_env(),
            consts: Default::default(),
            capturing: false,
            workspace: None,
            stream: Arc::clone(sh_stream),
        };
        // SAFETY: the handle is valid and the stream outlives it (both owned by the backend).
        unsafe { blas::set_stream(handle, sh_stream.cu_stream() as _) }
            .map_err(|e| CudaError::Driver(format!("{e:?}")))?;
        Ok(b)
    }

    /// Row-major `y[batch][rows] = x[batch][cols] · w[rows][cols]ᵀ` with `w` and `x` of
    /// `dtype`, f32 accumulation and output.
    ///
    /// # Safety
    /// `w`, `x` and `y` are device ranges of rows×cols, batch×cols (`dtype`) and batch×rows
    /// (f32) elements.
    #[allow(clippy::too_many_arguments)] // the GEMM's shape and operands, spelled out
    pub(crate) unsafe fn gemm(
        &mut self,
        dtype: KvDType,
        rows: usize,
        batch: usize,
        cols: usize,
        w: u64,
        x: u64,
        y: u64,
    ) -> Result<(), BackendError> {
        // SAFETY: forwarded.
        unsafe { self.gemm_beta(dtype, rows, batch, cols, w, x, y, 0.0) }
    }

    /// [`Blas::gemm`] adding to what `y` holds times `beta`: `y = x · wᵀ + beta y` (1: a
    /// residual add inside the GEMM).
    ///
    /// # Safety
    /// As [`Blas::gemm`]; `y` holds initialised floats when `beta` is not 0.
    #[allow(clippy::too_many_arguments)] // the GEMM's shape and operands, spelled out
    pub(crate) unsafe fn gemm_beta(
        &mut self,
        dtype: KvDType,
        rows: usize,
        batch: usize,
        cols: usize,
        w: u64,
        x: u64,
        y: u64,
        beta: f32,
    ) -> Result<(), BackendError> {
        let shape = (dtype, rows, batch, cols);
        let tactic = match self.tactics.choose(shape, small_fits(shape, w, x)) {
            Choice::Use(t) => t,
            Choice::Time(_) if self.capturing => {
                return Err(BackendError::Device(format!(
                    "a GEMM of shape {shape:?} not yet timed, inside a graph capture"
                )));
            }
            // SAFETY: the caller's ranges (x is read; only the scratch output is written).
            Choice::Time(candidates) => {
                match unsafe { self.time_shape(shape, w, x, &candidates) } {
                    Ok(t) => t,
                    // Not timed: cuBLAS for the shape. A lost device fails the product below.
                    Err(e) => {
                        tracing::warn!(error = %e, "timing the small-batch GEMM kernels failed; cuBLAS");
                        self.tactics.keep_fastest(shape, &[])
                    }
                }
            }
        };
        // SAFETY: forwarded; `choose` took the small-batch kernels only where they fit.
        unsafe { self.gemm_with(tactic, shape, w, x, y, beta) }
    }

    /// [`Blas::gemm_beta`] by `tactic`.
    ///
    /// # Safety
    /// As [`Blas::gemm_beta`]; a small-batch tactic only where [`small_fits`] holds.
    pub(crate) unsafe fn gemm_with(
        &self,
        tactic: Tactic,
        (dtype, rows, batch, cols): Shape,
        w: u64,
        x: u64,
        y: u64,
        beta: f32,
    ) -> Result<(), BackendError> {
        let (r, c, d) = (rows as i32, cols as i32, dtype_code(dtype));
        match tactic {
            Tactic::Gemv => {
                let f = self.gemv.get(batch.wrapping_sub(1)).ok_or_else(|| {
                    BackendError::Unsupported(format!("gemv for a batch of {batch}"))
                })?;
                // SAFETY: the caller's ranges, of a shape the kernel takes.
                unsafe {
                    launch_on(
                        &self.stream,
                        f,
                        (rows.div_ceil(GEMV_WARPS) as u32, 1),
                        (GEMV_WARPS * 32) as u32,
                        &[&w, &x, &y, &r, &c, &d, &beta],
                    )
                }
            }
            Tactic::GemvTc => {
                let b = batch as i32;
                // SAFETY: as above.
                unsafe {
                    launch_on(
                        &self.stream,
                        &self.gemv_tc,
                        (rows.div_ceil(GEMV_TC_ROWS) as u32, 1),
                        (GEMV_TC_WARPS * 32) as u32,
                        &[&w, &x, &y, &r, &c, &b, &d, &beta],
                    )
                }
            }
            Tactic::Cublas => {
                let alpha = 1f32;
                let ty = half_type(dtype);
                // Row-major y = x · wᵀ is, column-major, Y(rows×batch) =
                // Wᵀ(rows×cols) · X(cols×batch) with W stored as (cols×rows).
                // SAFETY: the caller's ranges; alpha and beta live across the call.
                unsafe {
                    blas::gemm_ex(
                        self.handle,
                        blas_sys::cublasOperation_t::CUBLAS_OP_T,
                        blas_sys::cublasOperation_t::CUBLAS_OP_N,
                        r,
                        batch as i32,
                        c,
                        (&alpha as *const f32).cast::<c_void>(),
                        w as *const c_void,
                        ty,
                        c,
                        x as *const c_void,
                        ty,
                        c,
                        (&beta as *const f32).cast::<c_void>(),
                        y as *mut c_void,
                        blas_sys::cudaDataType::CUDA_R_32F,
                        r,
                        blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
                    )
                }
                .map_err(|e| lib_err("cuBLAS GemmEx", e))
            }
        }
    }

    /// Times each of `candidates` on a product of `shape` into scratch (the real one follows),
    /// keeps the fastest for the shape and returns it. The wait for the timings is a stream
    /// sync, once per shape. A tactic whose launch fails is not kept; the timing itself
    /// failing is an error (the caller then keeps cuBLAS).
    ///
    /// # Safety
    /// `w` and `x` as [`Blas::gemm_beta`] says.
    unsafe fn time_shape(
        &mut self,
        shape: Shape,
        w: u64,
        x: u64,
        candidates: &[Tactic],
    ) -> Result<Tactic, BackendError> {
        let (_, rows, batch, _) = shape;
        let y = self.trial.ptr(&self.stream, rows * batch * 4)?;
        let timer = Timer::new()?;
        let mut timed = Vec::with_capacity(candidates.len());
        for &t in candidates {
            // One untimed run first: a kernel's first launch loads its code.
            // SAFETY: the caller's w and x; y is scratch of batch x rows floats.
            let run = |n: usize| -> Result<(), BackendError> {
                for _ in 0..n {
                    unsafe { self.gemm_with(t, shape, w, x, y, 0.0)? };
                }
                Ok(())
            };
            let secs = match run(1) {
                Ok(()) => {
                    timer.start(&self.stream)?;
                    run(TIMED_RUNS)?;
                    Some(timer.stop(&self.stream)? / TIMED_RUNS as f64)
                }
                Err(e) => {
                    tracing::warn!(tactic = t.name(), error = %e, "a small-batch GEMM kernel failed; not used for this shape");
                    None
                }
            };
            timed.push((t, secs));
        }
        let kept = self.tactics.keep_fastest(shape, &timed);
        let us = |t: Tactic| {
            timed
                .iter()
                .find(|x| x.0 == t)
                .and_then(|x| x.1)
                .map(|s| (s * 1e6 * 10.0).round() / 10.0)
        };
        let (dtype, rows, batch, cols) = shape;
        tracing::info!(
            ?dtype,
            rows,
            batch,
            cols,
            cublas_us = ?us(Tactic::Cublas),
            gemv_us = ?us(Tactic::Gemv),
            tc_us = ?us(Tactic::GemvTc),
            kept = kept.name(),
            "small-batch GEMM timed"
        );
        Ok(kept)
    }
}

/// cuBLAS's workspace for captured GEMMs: what it asks for on Hopper.
const WORKSPACE_BYTES: usize = 32 << 20;

impl Blas {
    /// Gives cuBLAS a workspace of its own, once: a GEMM captured into a graph must not
    /// allocate one.
    pub(crate) fn ensure_workspace(&mut self) -> Result<(), BackendError> {
        if self.workspace.is_some() {
            return Ok(());
        }
        // SAFETY: scratch that only cuBLAS writes and reads.
        let ws = unsafe { self.stream.alloc::<u8>(WORKSPACE_BYTES) }
            .map_err(|e| dev_err("cuBLAS's workspace", e))?;
        let ptr = cudarc::driver::DevicePtr::device_ptr(&ws, &self.stream).0;
        // SAFETY: the handle is live; the workspace lives as long as it (both in `self`).
        unsafe {
            blas_sys::cublasSetWorkspace_v2(self.handle, ptr as *mut c_void, WORKSPACE_BYTES)
        }
        .result()
        .map_err(|e| lib_err("setting cuBLAS's workspace", e))?;
        self.workspace = Some(ws);
        Ok(())
    }

    /// The stream the projections issue on.
    pub(crate) fn stream_handle(&self) -> Arc<CudaStream> {
        Arc::clone(&self.stream)
    }
}

/// Products each timed candidate runs, after one untimed.
const TIMED_RUNS: usize = 3;

/// True where the small-batch kernels take a product of `shape`: 16-bit operands, rows of
/// whole 16-byte chunks at 16-byte aligned addresses, sizes an i32 holds.
fn small_fits((dtype, rows, batch, cols): Shape, w: u64, x: u64) -> bool {
    matches!(dtype, KvDType::F16 | KvDType::Bf16)
        && (1..=GEMV_MAX_BATCH).contains(&batch)
        && cols.is_multiple_of(8)
        && i32::try_from(cols).is_ok()
        && i32::try_from(rows).is_ok()
        && (w | x).is_multiple_of(16)
}

/// Two timing events around queued work.
pub(super) struct Timer {
    start: sys::CUevent,
    end: sys::CUevent,
}

impl Timer {
    pub(super) fn new() -> Result<Self, BackendError> {
        let create = || {
            drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(|e| dev_err("creating a timing event", e))
        };
        let start = create()?;
        match create() {
            Ok(end) => Ok(Self { start, end }),
            Err(e) => {
                // SAFETY: created above, destroyed once.
                let _ = unsafe { drv::event::destroy(start) };
                Err(e)
            }
        }
    }

    pub(super) fn start(&self, stream: &CudaStream) -> Result<(), BackendError> {
        // SAFETY: a live event and stream.
        unsafe { drv::event::record(self.start, stream.cu_stream()) }
            .map_err(|e| dev_err("recording a timing event", e))
    }

    /// Seconds from `start` to what is queued now, waiting for it.
    pub(super) fn stop(&self, stream: &CudaStream) -> Result<f64, BackendError> {
        // SAFETY: live events and stream; `start` was recorded before `end`.
        unsafe {
            drv::event::record(self.end, stream.cu_stream())
                .and_then(|()| drv::event::synchronize(self.end))
                .and_then(|()| drv::event::elapsed(self.start, self.end))
        }
        .map(|ms| f64::from(ms) / 1e3)
        .map_err(|e| dev_err("timing a kernel", e))
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        // SAFETY: created by `event::create`, destroyed once; nothing waits on them after.
        unsafe {
            let _ = drv::event::destroy(self.start);
            let _ = drv::event::destroy(self.end);
        }
    }
}

/// The device address of `w`, uploaded on first use.
pub(crate) fn weight_ptr(g: &mut Blas, sh: &Shared, w: &Tensor) -> Result<u64, BackendError> {
    if let Some(&p) = g.parts.get(&w.id()) {
        return Ok(p);
    }
    let key = upload(g, sh, w)?;
    match g.weights.get(&key) {
        Some(d) => Ok(cudarc::driver::DevicePtr::device_ptr(d, &sh.stream).0),
        None => Err(BackendError::Device("weight cache".into())),
    }
}

/// Uploads `parts` (one type, one width) once as one matrix, their rows one after another, so
/// consecutive parts project the same input with one GEMM (q|k|v, gate|up); each part is then
/// addressed inside the stack, with no copy of its own. False (nothing done) where the parts
/// differ in type or width, or one is on the device already.
pub(crate) fn upload_stack(
    g: &mut Blas,
    sh: &Shared,
    parts: &[&Tensor],
) -> Result<bool, BackendError> {
    let Some(first) = parts.first() else {
        return Ok(false);
    };
    let fits = parts.len() >= 2
        && parts.iter().all(|t| {
            t.dtype == first.dtype
                && t.cols() == first.cols()
                && !g.weights.contains_key(&t.id())
                && !g.parts.contains_key(&t.id())
        });
    if !fits {
        return Ok(false);
    }
    let mut bytes = Vec::with_capacity(parts.iter().map(|t| t.bytes().len()).sum());
    for t in parts {
        bytes.extend_from_slice(t.bytes());
    }
    let dev = sh
        .stream
        .clone_htod(&bytes)
        .map_err(|e| dev_err("stacked weights", e))?;
    let base = cudarc::driver::DevicePtr::device_ptr(&dev, &sh.stream).0;
    let mut at = 0u64;
    for t in parts {
        g.parts.insert(t.id(), base + at);
        at += t.bytes().len() as u64;
    }
    g.stacks.push(dev);
    Ok(true)
}

/// Uploads `w` once; returns its cache key.
pub(crate) fn upload(g: &mut Blas, sh: &Shared, w: &Tensor) -> Result<u64, BackendError> {
    let key = w.id();
    if let std::collections::hash_map::Entry::Vacant(slot) = g.weights.entry(key) {
        let dev = sh
            .stream
            .clone_htod(w.bytes())
            .map_err(|e| dev_err("weights", e))?;
        slot.insert(dev);
    }
    Ok(key)
}

fn half_type(d: KvDType) -> blas_sys::cudaDataType {
    match d {
        KvDType::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        KvDType::F16 => blas_sys::cudaDataType::CUDA_R_16F,
        KvDType::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
        // Weights are never int8 or fp8 (loaders make f32, f16 or bf16 tensors).
        KvDType::I8 => blas_sys::cudaDataType::CUDA_R_8I,
        KvDType::F8E4M3 => blas_sys::cudaDataType::CUDA_R_8F_E4M3,
    }
}
