//! The CUDA backend, loaded at run time through cudarc (dynamic loading), so this compiles on
//! a machine without a CUDA toolkit and fails with a clear message where no driver exists.
//!
//! What runs on the GPU: every projection (cuBLAS, weights uploaded once and kept in device
//! memory; f16/bf16 weights multiply activations rounded to the same type, f32 accumulation)
//! and the device part of attention over hot KV blocks kept in GPU memory ([`store`]): a
//! split-K block-sparse kernel and its log-sum-exp combine, recall copies on their own stream
//! ordered by events, the host pool page-locked for asynchronous copies. Activations cross
//! PCIe once per projection group (they are a few KiB per token); norms, RoPE and SwiGLU run
//! on the host between them. Their device kernels exist and are checked by `selftest`;
//! keeping whole layers on the device is the next step.

pub mod selftest;
mod slots;
mod store;

use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use attention::{BlockGeometry, KvDType};
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
    result as drv, sys,
};
use kv_transfer::HostPool;

use super::{Backend, BackendError, DeviceKv, LinearOut};
use crate::tensor::Tensor;

/// Why CUDA cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// libcuda could not be loaded.
    #[error("no CUDA driver found (libcuda.so could not be loaded); use --device cpu")]
    NoDriver,
    /// The driver failed to initialise or count devices.
    #[error("CUDA driver error: {0}")]
    Driver(String),
    /// The requested ordinal does not exist.
    #[error("CUDA device {ordinal} does not exist ({count} visible)")]
    NoSuchDevice {
        /// Requested.
        ordinal: usize,
        /// Visible devices.
        count: usize,
    },
    /// libnvrtc could not be loaded.
    #[error("NVRTC (libnvrtc.so) could not be loaded; install the CUDA runtime libraries")]
    NoNvrtc,
    /// libcublas could not be loaded.
    #[error("cuBLAS (libcublas.so) could not be loaded; install the CUDA runtime libraries")]
    NoCublas,
    /// A kernel failed to compile.
    #[error("NVRTC compile error: {0}")]
    Compile(String),
}

/// What the probe found.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Ordinal.
    pub ordinal: usize,
    /// Devices visible.
    pub count: usize,
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cuda:{} ({} visible)", self.ordinal, self.count)
    }
}

/// Checks that libcuda loads and `ordinal` exists, before any other CUDA call: with dynamic
/// loading, the first call into a missing library would panic.
pub fn probe(ordinal: usize) -> Result<DeviceInfo, CudaError> {
    // SAFETY: only tries to dlopen libcuda; no CUDA function is called.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    cudarc::driver::result::init().map_err(|e| CudaError::Driver(format!("{e:?}")))?;
    let count = cudarc::driver::result::device::get_count()
        .map_err(|e| CudaError::Driver(format!("{e:?}")))?;
    let count = usize::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    Ok(DeviceInfo { ordinal, count })
}

/// Compiles the device kernels to PTX with NVRTC.
pub fn compile_kernels() -> Result<String, CudaError> {
    // SAFETY: only tries to dlopen libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let ptx = cudarc::nvrtc::compile_ptx(attention::cuda::KERNELS_CU)
        .map_err(|e| CudaError::Compile(format!("{e:?}")))?;
    Ok(ptx.to_src())
}

pub(crate) fn dev_err(what: &str, e: impl fmt::Debug) -> BackendError {
    BackendError::Device(format!("{what}: {e:?}"))
}

/// The compiled kernels.
#[derive(Debug)]
pub(crate) struct Kernels {
    pub(crate) f32_to_half: CudaFunction,
    pub(crate) split: CudaFunction,
    pub(crate) combine: CudaFunction,
    pub(crate) rms_norm: CudaFunction,
    pub(crate) rope: CudaFunction,
    pub(crate) silu_mul: CudaFunction,
    pub(crate) quest_scores: CudaFunction,
    pub(crate) lse2_merge: CudaFunction,
    pub(crate) kv_append: CudaFunction,
    pub(crate) gather_copy: CudaFunction,
}

/// What the backend and its KV store share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) ordinal: usize,
    pub(crate) ctx: Arc<CudaContext>,
    /// Projections and the device part of attention, in order.
    pub(crate) stream: Arc<CudaStream>,
    /// Recall copies, overlapping the main stream.
    pub(crate) recall: Arc<CudaStream>,
    pub(crate) k: Kernels,
}

impl Shared {
    pub(crate) fn bind(&self) -> Result<(), BackendError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| dev_err("binding the context", e))
    }

    /// Launches `f` on the main stream with raw arguments (device pointers as `u64`).
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number, order and type, and every device
    /// pointer among them must be valid for what the kernel touches.
    pub(crate) unsafe fn launch(
        &self,
        f: &CudaFunction,
        grid: (u32, u32),
        block: u32,
        args: &[&dyn Arg],
    ) -> Result<(), BackendError> {
        // SAFETY: per this function's contract.
        unsafe { launch_on(&self.stream, f, grid, block, args) }
    }
}

/// Launches `f` on `stream` with raw arguments (device pointers as `u64`).
///
/// # Safety
/// As [`Shared::launch`].
pub(crate) unsafe fn launch_on(
    stream: &CudaStream,
    f: &CudaFunction,
    grid: (u32, u32),
    block: u32,
    args: &[&dyn Arg],
) -> Result<(), BackendError> {
    {
        let mut b = stream.launch_builder(f);
        for a in args {
            a.push(&mut b);
        }
        let cfg = LaunchConfig {
            grid_dim: (grid.0.max(1), grid.1.max(1), 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: per this function's contract.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| dev_err("kernel launch", e))
    }
}

/// A kernel argument passed by value.
pub(crate) trait Arg {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>);
}

macro_rules! impl_arg {
    ($($t:ty),*) => {$(
        impl Arg for $t {
            fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
                b.arg(self);
            }
        }
    )*};
}
impl_arg!(u64, i64, i32, f32);

/// A device buffer that grows to the largest size asked of it.
#[derive(Debug, Default)]
pub(crate) struct DevBuf {
    buf: Option<CudaSlice<u8>>,
}

impl DevBuf {
    /// Device address of at least `bytes` bytes (contents undefined).
    pub(crate) fn ptr(
        &mut self,
        stream: &Arc<CudaStream>,
        bytes: usize,
    ) -> Result<u64, BackendError> {
        let bytes = bytes.max(256);
        if self.buf.as_ref().is_none_or(|b| b.len() < bytes) {
            self.buf = None;
            // SAFETY: contents are written before they are read by every user of `DevBuf`.
            let b = unsafe { stream.alloc::<u8>(bytes.next_power_of_two()) }.map_err(|e| {
                BackendError::DeviceFull(format!("{bytes} bytes of scratch: {e:?}"))
            })?;
            self.buf = Some(b);
        }
        match &self.buf {
            Some(b) => Ok(b.device_ptr(stream).0),
            None => Err(BackendError::Device("scratch buffer missing".into())),
        }
    }
}

/// Page-locked host memory for the activations crossing PCIe: copies from it are true DMA,
/// without the driver's staging copy and the synchronisation pageable memory implies.
#[derive(Debug)]
pub(crate) struct Pinned {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by this value; used under the backend's mutex.
unsafe impl Send for Pinned {}

impl Pinned {
    const fn empty() -> Self {
        Self {
            ptr: std::ptr::null_mut(),
            len: 0,
        }
    }

    /// At least `n` floats (contents undefined until written).
    fn get(&mut self, n: usize) -> Result<&mut [f32], BackendError> {
        if self.len < n {
            self.release();
            let len = n.next_power_of_two().max(1024);
            // SAFETY: a fresh allocation of `len` floats; PORTABLE pins it for every context.
            let p = unsafe { drv::malloc_host(len * 4, sys::CU_MEMHOSTALLOC_PORTABLE) }
                .map_err(|e| BackendError::DeviceFull(format!("pinned staging: {e:?}")))?;
            self.ptr = p.cast();
            self.len = len;
        }
        // SAFETY: `ptr` holds `len >= n` floats owned by us; f32 accepts any bit pattern.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, n) })
    }

    fn release(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: allocated by `malloc_host`, freed once.
            let _ = unsafe { drv::free_host(self.ptr.cast()) };
            self.ptr = std::ptr::null_mut();
            self.len = 0;
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        self.release();
    }
}

/// Copies `src` to device address `dst` on `stream` (asynchronous for page-locked memory).
pub(crate) fn htod(dst: u64, src: &[u8], stream: &CudaStream) -> Result<(), BackendError> {
    // SAFETY: callers pass a device range of at least `src.len()` bytes.
    unsafe { drv::memcpy_htod_async(dst, src, stream.cu_stream()) }
        .map_err(|e| dev_err("copy to device", e))
}

/// Copies device address `src` into `dst` and waits for it.
pub(crate) fn dtoh_f32(dst: &mut [f32], src: u64, stream: &CudaStream) -> Result<(), BackendError> {
    // SAFETY: callers pass a device range of at least `dst.len()` floats; the stream is
    // synchronised before `dst` is read.
    unsafe { drv::memcpy_dtoh_async(dst, src, stream.cu_stream()) }
        .map_err(|e| dev_err("copy to host", e))?;
    stream
        .synchronize()
        .map_err(|e| dev_err("synchronising", e))
}

pub(crate) fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern of u8 is valid.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// The state of the projections, behind one lock (one main stream).
struct Blas {
    handle: blas_sys::cublasHandle_t,
    /// Device copies of weights, by the address of their host bytes.
    weights: HashMap<(usize, usize), CudaSlice<u8>>,
    x: DevBuf,
    xh: DevBuf,
    y: DevBuf,
    /// Host side of `x` and `y`.
    staging: Pinned,
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

/// The CUDA backend of one device.
pub struct CudaBackend {
    shared: Arc<Shared>,
    blas: Mutex<Blas>,
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.shared.ordinal)
            .finish()
    }
}

impl CudaBackend {
    /// Opens device `ordinal`: probes the driver, loads cuBLAS and compiles the kernels.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        probe(ordinal)?;
        // SAFETY: only tries to dlopen libcublas.
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(CudaError::NoCublas);
        }
        let ptx = compile_kernels()?;
        let drv_err = |e: drv::DriverError| CudaError::Driver(format!("{e:?}"));
        let ctx = CudaContext::new(ordinal).map_err(drv_err)?;
        // We order work ourselves (one main stream, explicit events for recall); cudarc's
        // per-buffer event tracking would add a record and a wait to every launch.
        // SAFETY: no buffer is shared between streams without our own event or sync.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(drv_err)?;
        let recall = ctx.new_stream().map_err(drv_err)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(drv_err)?;
        let f = |name: &str| module.load_function(name).map_err(drv_err);
        let k = Kernels {
            f32_to_half: f("f32_to_half")?,
            split: f("sparse_attention_split")?,
            combine: f("combine_splits")?,
            rms_norm: f("rms_norm")?,
            rope: f("rope")?,
            silu_mul: f("silu_mul")?,
            quest_scores: f("quest_scores")?,
            lse2_merge: f("lse2_merge")?,
            kv_append: f("kv_append")?,
            gather_copy: f("gather_copy")?,
        };
        let handle = blas::create_handle().map_err(|e| CudaError::Driver(format!("{e:?}")))?;
        let blas_state = Blas {
            handle,
            weights: HashMap::new(),
            x: DevBuf::default(),
            xh: DevBuf::default(),
            y: DevBuf::default(),
            staging: Pinned::empty(),
        };
        // SAFETY: the handle is valid and the stream outlives it (both owned here).
        unsafe { blas::set_stream(handle, stream.cu_stream() as _) }
            .map_err(|e| CudaError::Driver(format!("{e:?}")))?;
        Ok(Self {
            shared: Arc::new(Shared {
                ordinal,
                ctx,
                stream,
                recall,
                k,
            }),
            blas: Mutex::new(blas_state),
        })
    }

    fn lock(&self) -> Result<MutexGuard<'_, Blas>, BackendError> {
        self.blas
            .lock()
            .map_err(|_| BackendError::Device("backend lock poisoned".into()))
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Forgets device copies of weights (their host tensors are about to be dropped).
    pub fn clear_weights(&self) -> Result<(), BackendError> {
        self.lock()?.weights.clear();
        Ok(())
    }

    /// Bytes moved per second (read plus write) by device-to-device copies of 1 GiB: the
    /// bound the weights and KV a step streams are measured against.
    pub fn copy_bandwidth(&self) -> Result<f64, BackendError> {
        let sh = &self.shared;
        sh.bind()?;
        let n = 1usize << 30;
        // SAFETY: only copied between; never read on the host.
        let (src, dst) = unsafe { (sh.stream.alloc::<u8>(n), sh.stream.alloc::<u8>(n)) };
        let (src, dst) = (
            src.map_err(|e| BackendError::DeviceFull(format!("{e:?}")))?,
            dst.map_err(|e| BackendError::DeviceFull(format!("{e:?}")))?,
        );
        let (s, d) = (src.device_ptr(&sh.stream).0, dst.device_ptr(&sh.stream).0);
        let copy = || {
            // SAFETY: both ranges hold n bytes.
            unsafe { drv::memcpy_dtod_async(d, s, n, sh.stream.cu_stream()) }
                .map_err(|e| dev_err("copy", e))
        };
        copy()?;
        sh.stream.synchronize().map_err(|e| dev_err("sync", e))?;
        let reps = 10;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            copy()?;
        }
        sh.stream.synchronize().map_err(|e| dev_err("sync", e))?;
        Ok((2 * n * reps) as f64 / t.elapsed().as_secs_f64())
    }
}

/// Uploads `w` once; returns its cache key.
fn upload(g: &mut Blas, sh: &Shared, w: &Tensor) -> Result<(usize, usize), BackendError> {
    let key = (w.bytes().as_ptr() as usize, w.bytes().len());
    if let std::collections::hash_map::Entry::Vacant(slot) = g.weights.entry(key) {
        let dev = sh
            .stream
            .clone_htod(w.bytes())
            .map_err(|e| BackendError::DeviceFull(format!("weights: {e:?}")))?;
        slot.insert(dev);
    }
    Ok(key)
}

fn half_type(d: KvDType) -> blas_sys::cudaDataType {
    match d {
        KvDType::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        KvDType::F16 => blas_sys::cudaDataType::CUDA_R_16F,
        KvDType::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
    }
}

fn dtype_code(d: KvDType) -> i32 {
    match d {
        KvDType::F32 => 0,
        KvDType::F16 => 1,
        KvDType::Bf16 => 2,
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:{}", self.shared.ordinal)
    }

    fn linear(
        &self,
        x: &[f32],
        batch: usize,
        w: &Tensor,
        bias: Option<&[f32]>,
        y: &mut [f32],
    ) -> Result<(), BackendError> {
        self.linear_many(x, batch, &mut [LinearOut { w, bias, y }])
    }

    fn prepare(&self, w: &Tensor) -> Result<(), BackendError> {
        self.shared.bind()?;
        upload(&mut *self.lock()?, &self.shared, w).map(|_| ())
    }

    fn linear_many(
        &self,
        x: &[f32],
        batch: usize,
        outs: &mut [LinearOut<'_>],
    ) -> Result<(), BackendError> {
        let sh = &*self.shared;
        sh.bind()?;
        let mut g = self.lock()?;
        let g = &mut *g;
        let inp = x.len() / batch.max(1);
        let x_dev = g.x.ptr(&sh.stream, x.len() * 4)?;
        let total: usize = outs.iter().map(|o| o.y.len()).sum();
        let stage = g.staging.get(x.len().max(total))?;
        stage[..x.len()].copy_from_slice(x);
        // The staging buffer is reused for y below, after this copy has run (stream order,
        // then the synchronisation in `dtoh_f32`).
        htod(x_dev, f32_bytes(&stage[..x.len()]), &sh.stream)?;
        let y_dev = g.y.ptr(&sh.stream, total * 4)?;
        let mut converted: Option<(KvDType, u64)> = None;
        let mut at = 0usize;
        for o in outs.iter() {
            let (rows, cols) = (o.w.rows(), o.w.cols());
            if cols != inp || o.y.len() != batch * rows {
                return Err(BackendError::Unsupported(format!(
                    "projection of {rows}x{cols} for input width {inp}"
                )));
            }
            let key = upload(g, sh, o.w)?;
            let w_dev = match g.weights.get(&key) {
                Some(w) => w.device_ptr(&sh.stream).0,
                None => return Err(BackendError::Device("weight cache".into())),
            };
            // Activations in the weights' type (cuBLAS takes one input type).
            let b_dev = match o.w.dtype {
                KvDType::F32 => x_dev,
                dt => match converted {
                    Some((c, p)) if c == dt => p,
                    _ => {
                        let p = g.xh.ptr(&sh.stream, x.len() * 2)?;
                        let n = x.len() as i64;
                        // SAFETY: x_dev holds n floats, p room for n halves.
                        unsafe {
                            sh.launch(
                                &sh.k.f32_to_half,
                                ((x.len() as u32).div_ceil(256), 1),
                                256,
                                &[&x_dev, &p, &n, &dtype_code(dt)],
                            )?;
                        }
                        converted = Some((dt, p));
                        p
                    }
                },
            };
            let (alpha, beta) = (1f32, 0f32);
            let ty = half_type(o.w.dtype);
            // Row-major y[batch][rows] = x[batch][cols] · w[rows][cols]ᵀ is, column-major,
            // Y(rows×batch) = Wᵀ(rows×cols) · X(cols×batch) with W stored as (cols×rows).
            // SAFETY: pointers are device ranges of the sizes named by m, n, k and lds.
            unsafe {
                blas::gemm_ex(
                    g.handle,
                    blas_sys::cublasOperation_t::CUBLAS_OP_T,
                    blas_sys::cublasOperation_t::CUBLAS_OP_N,
                    rows as i32,
                    batch as i32,
                    cols as i32,
                    (&alpha as *const f32).cast::<c_void>(),
                    w_dev as *const c_void,
                    ty,
                    cols as i32,
                    b_dev as *const c_void,
                    ty,
                    cols as i32,
                    (&beta as *const f32).cast::<c_void>(),
                    (y_dev + (at * 4) as u64) as *mut c_void,
                    blas_sys::cudaDataType::CUDA_R_32F,
                    rows as i32,
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
                )
            }
            .map_err(|e| dev_err("cuBLAS GemmEx", e))?;
            at += o.y.len();
        }
        let host = g.staging.get(x.len().max(total))?;
        let host = &mut host[..total];
        dtoh_f32(host, y_dev, &sh.stream)?;
        let mut at = 0usize;
        for o in outs.iter_mut() {
            let n = o.y.len();
            o.y.copy_from_slice(&host[at..at + n]);
            at += n;
            if let Some(b) = o.bias {
                for row in o.y.chunks_exact_mut(b.len()) {
                    row.iter_mut().zip(b).for_each(|(v, bb)| *v += bb);
                }
            }
        }
        Ok(())
    }

    fn memory_bandwidth(&self) -> Option<f64> {
        self.copy_bandwidth().ok()
    }

    fn device_kv(
        &self,
        geom: BlockGeometry,
        capacity_bytes: u64,
        pool: &HostPool,
    ) -> Result<Option<Arc<dyn DeviceKv>>, BackendError> {
        let store = store::CudaKvStore::new(Arc::clone(&self.shared), geom, capacity_bytes, pool)?;
        Ok(Some(Arc::new(store)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_compile_to_ptx_where_nvrtc_exists() {
        match compile_kernels() {
            Err(CudaError::NoNvrtc) => {
                eprintln!(
                    "skipped: libnvrtc is not loadable here (pip install nvidia-cuda-nvrtc, LD_LIBRARY_PATH)"
                );
            }
            Err(e) => panic!("{e}"),
            Ok(ptx) => {
                for entry in attention::cuda::ENTRY_POINTS {
                    assert!(
                        ptx.contains(&format!(".entry {entry}")),
                        "PTX lacks {entry}"
                    );
                }
            }
        }
    }

    #[test]
    fn probe_fails_cleanly_without_a_driver() {
        // On CI there is no libcuda: a clear error, never a panic. With a GPU, device 0 exists.
        match probe(0) {
            Ok(info) => assert!(info.count > 0),
            Err(e) => assert!(
                matches!(e, CudaError::NoDriver | CudaError::Driver(_)),
                "{e}"
            ),
        }
        assert!(matches!(
            probe(usize::MAX),
            Err(CudaError::NoDriver | CudaError::Driver(_) | CudaError::NoSuchDevice { .. })
        ));
    }
}
