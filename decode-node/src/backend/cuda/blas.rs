//! cuBLAS projections: the handle, device copies of the weights (uploaded once), activation
//! buffers and pinned staging, and the one GEMM shape the model needs.

use std::collections::HashMap;
use std::ffi::c_void;

use attention::KvDType;
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream};

use super::driver::{
    DevBuf, GEMV_MAX_BATCH, GEMV_WARPS, Pinned, Shared, dev_err, dtype_code, launch_on, lib_err,
};
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
    pub(crate) kv_keep: DevBuf,
    /// Host side of `kv_keep`, filled under the LM head's wait.
    pub(crate) kv_staging: Pinned,
    /// Host side of `x` and `y`.
    pub(crate) staging: Pinned,
    /// Device picks' spec and results, and their host side (`pick::sample_rows`).
    pub(crate) pick: DevBuf,
    pub(crate) pick_staging: Pinned,
    /// `gemv_b{B}` (the stream the handle issues on): a batch of at most `gemv_up_to` rows
    /// of 16-bit activations takes it instead of cuBLAS.
    gemv: Vec<CudaFunction>,
    stream: Arc<CudaStream>,
    /// The largest batch `gemv_b{B}` takes; 0 = none (`DECODE_NODE_GEMV=0`, or a start-up
    /// check that found it disagreeing with cuBLAS).
    pub(crate) gemv_up_to: usize,
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
            kv_keep: DevBuf::default(),
            kv_staging: Pinned::empty(),
            staging: Pinned::empty(),
            pick: DevBuf::default(),
            pick_staging: Pinned::empty(),
            gemv,
            stream: Arc::clone(sh_stream),
            gemv_up_to: gemv_up_to(
                std::env::var("DECODE_NODE_GEMV").ok().as_deref(),
                std::env::var("DECODE_NODE_GEMV_MAX_BATCH").ok().as_deref(),
            ),
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
        if let Some(f) = self.gemv_for(dtype, (rows, batch, cols), w, x) {
            let (r, c, d) = (rows as i32, cols as i32, dtype_code(dtype));
            // SAFETY: the caller's ranges; `gemv_for` checked the type, width and alignment the
            // kernel reads with.
            return unsafe {
                launch_on(
                    &self.stream,
                    f,
                    (rows.div_ceil(GEMV_WARPS) as u32, 1),
                    (GEMV_WARPS * 32) as u32,
                    &[&w, &x, &y, &r, &c, &d, &beta],
                )
            };
        }
        let alpha = 1f32;
        let ty = half_type(dtype);
        // Row-major y = x · wᵀ is, column-major, Y(rows×batch) = Wᵀ(rows×cols) · X(cols×batch)
        // with W stored as (cols×rows).
        // SAFETY: the caller's ranges; alpha and beta live across the call.
        unsafe {
            blas::gemm_ex(
                self.handle,
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                rows as i32,
                batch as i32,
                cols as i32,
                (&alpha as *const f32).cast::<c_void>(),
                w as *const c_void,
                ty,
                cols as i32,
                x as *const c_void,
                ty,
                cols as i32,
                (&beta as *const f32).cast::<c_void>(),
                y as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                rows as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| lib_err("cuBLAS GemmEx", e))
    }
}

impl Blas {
    /// The stream the projections issue on.
    pub(crate) fn stream_handle(&self) -> Arc<CudaStream> {
        Arc::clone(&self.stream)
    }

    /// `gemv_b{batch}` where it takes this product: on, 16-bit operands, a batch it is built
    /// for, rows of whole 16-byte chunks at 16-byte aligned addresses.
    fn gemv_for(
        &self,
        dtype: KvDType,
        (rows, batch, cols): (usize, usize, usize),
        w: u64,
        x: u64,
    ) -> Option<&CudaFunction> {
        let fits = matches!(dtype, KvDType::F16 | KvDType::Bf16)
            && (1..=self.gemv_up_to.min(GEMV_MAX_BATCH)).contains(&batch)
            && cols.is_multiple_of(8)
            && i32::try_from(cols).is_ok()
            && i32::try_from(rows).is_ok()
            && (w | x).is_multiple_of(16);
        fits.then(|| self.gemv.get(batch - 1)).flatten()
    }
}

/// The largest batch `gemv_b{B}` is used for. One by default: on an H200 (Qwen3-14B shape,
/// 10 layers, bf16) `bench step` gave 333 tokens/s with it at batch 1 against cuBLAS's 310,
/// but 912 against 1485 at batch 8, where each weight chunk's eight x loads and unpacks
/// outweigh the saved bandwidth. `DECODE_NODE_GEMV=0` turns it off, and
/// `DECODE_NODE_GEMV_MAX_BATCH` (up to 8) sets the limit, to measure the batches between.
fn gemv_up_to(gemv: Option<&str>, max_batch: Option<&str>) -> usize {
    if gemv == Some("0") {
        return 0;
    }
    max_batch
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map_or(1, |b| b.min(GEMV_MAX_BATCH))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_takes_batch_one_unless_told() {
        assert_eq!(gemv_up_to(None, None), 1);
        assert_eq!(gemv_up_to(Some("1"), None), 1);
        assert_eq!(gemv_up_to(Some("0"), Some("4")), 0);
        assert_eq!(gemv_up_to(None, Some("4")), 4);
        assert_eq!(gemv_up_to(None, Some("0")), 0);
        assert_eq!(gemv_up_to(None, Some("99")), GEMV_MAX_BATCH);
        assert_eq!(gemv_up_to(None, Some("x")), 1);
    }
}
