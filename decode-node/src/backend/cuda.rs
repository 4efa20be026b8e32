//! The CUDA backend, loaded at run time through cudarc (dynamic loading), so this compiles on
//! a machine without a CUDA toolkit and fails with a clear message where no driver exists.
//!
//! What runs on the GPU: every projection (cuBLAS, weights uploaded once and kept in device
//! memory; f16/bf16 weights multiply activations rounded to the same type, f32 accumulation)
//! and the device part of attention over hot KV blocks kept in GPU memory ([`store`]): a
//! split-K block-sparse kernel and its log-sum-exp combine, recall copies on their own stream
//! ordered by events, the host pool page-locked for asynchronous copies. A decode step's
//! residual stays in device memory ([`layer`]): norms, SwiGLU and the residual adds run there,
//! and the LM head's tokens are picked there ([`pick`]); q, k and v cross PCIe for the host's
//! q/k-norm, RoPE and selection, and the attention output comes back.

mod attend_pick;
mod attn_bench;
mod blas;
mod call;
mod driver;
mod graph;
mod landing;
mod layer;
mod pick;
pub mod selftest;
mod sketch;
mod slots;
mod store;
mod tactic;

use tactic::Tactic;

pub use attn_bench::{AttnBenchSpec, AttnTiming};
use blas::{Blas, upload};
pub(crate) use driver::{
    DevBuf, Kernels, Shared, dev_err, dtoh_f32, dtype_code, f32_bytes, htod, launch_on,
};
pub use driver::{DeviceInfo, compile_kernels, compile_kernels_for, probe};

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use attention::{BlockGeometry, KvDType};
use cudarc::driver::{CudaContext, DevicePtr, result as drv};
use kv_transfer::HostPool;

use super::{Backend, BackendError, DeviceKv, LinearOut};
use crate::tensor::Tensor;

/// Fills each projection's output from `back` (their results one after another) and adds its
/// bias.
fn take_outputs<'a, 'b: 'a>(back: &[f32], outs: impl Iterator<Item = &'a mut LinearOut<'b>>) {
    let mut at = 0usize;
    for o in outs {
        let n = o.y.len();
        o.y.copy_from_slice(&back[at..at + n]);
        at += n;
        if let Some(b) = o.bias {
            for row in o.y.chunks_exact_mut(b.len()) {
                row.iter_mut().zip(b).for_each(|(v, bb)| *v += bb);
            }
        }
    }
}

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
    /// An environment setting of the backend names no choice it has.
    #[error("{0}")]
    Setting(String),
}

/// The CUDA backend of one device.
pub struct CudaBackend {
    shared: Arc<Shared>,
    blas: Mutex<Blas>,
    /// Whether the one-round-trip layer agreed with the op-by-op one on this device.
    fused: layer::FusedCheck,
    /// Decode steps keep their residual in device memory (until a model's check says no).
    residual_on_device: std::sync::atomic::AtomicBool,
    /// The device residual's LM head picks tokens on the device (until a check says no).
    picks_on_device: std::sync::atomic::AtomicBool,
    /// The device residual runs `full` layers' attention on the device (until a check says
    /// no; `DECODE_NODE_RESIDENT_LAYERS=0` starts with it off).
    attention_on_device: std::sync::atomic::AtomicBool,
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
        let info = probe(ordinal)?;
        let attend_choice = driver::AttendChoice::parse(
            std::env::var("DECODE_NODE_ATTENTION_KERNEL")
                .ok()
                .as_deref(),
        )
        .map_err(CudaError::Setting)?;
        let prefetch_choice = driver::PrefetchChoice::parse(
            std::env::var("DECODE_NODE_ATTENTION_PREFETCH")
                .ok()
                .as_deref(),
        )
        .map_err(CudaError::Setting)?;
        // SAFETY: only tries to dlopen libcublas.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::NoCublas);
        }
        let ptx = compile_kernels_for(info.compute)?;
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
            silu_mul_stacked: f("silu_mul_stacked")?,
            quest_scores: f("quest_scores")?,
            lse2_merge: f("lse2_merge")?,
            kv_append: f("kv_append")?,
            gather_copy: f("gather_copy")?,
            copy_tokens: f("copy_tokens")?,
            sample_rows: f("sample_rows")?,
            row_max_parts: f("row_max_parts")?,
            row_sum_parts: f("row_sum_parts")?,
            qkv_finish: f("qkv_finish")?,
            merge_self: f("merge_self")?,
            rms_norm_half: f("rms_norm_half")?,
            silu_mul_stacked_half: f("silu_mul_stacked_half")?,
            sketch_lse: f("sketch_lse")?,
            sketch_shares: f("sketch_shares")?,
            top_blocks: f("top_blocks")?,
            place_picks: f("place_picks")?,
            scatter_runs: f("scatter_runs")?,
            warps: Kernels::warps_names()
                .map(|n| f(&n))
                .collect::<Result<_, _>>()?,
            gemv: Kernels::gemv_names()
                .map(|n| f(&n))
                .collect::<Result<_, _>>()?,
            gemv_tc: f("gemv_tc")?,
            tc: Kernels::tc_names()
                .map(|n| f(&n))
                .collect::<Result<_, _>>()?,
        };
        let mut blas_state = Blas::new(&stream, k.gemv.clone(), k.gemv_tc.clone())?;
        // A small-batch kernel may replace cuBLAS only where it gives cuBLAS's products here;
        // `gemv_tc` needs the MMAs of sm_80 on.
        let mma = info.compute.is_some_and(|(major, _)| major >= 8);
        blas_state.tactics.mma = mma;
        if blas_state.tactics.up_to > 0 {
            let kernels = [Tactic::Gemv]
                .into_iter()
                .chain(mma.then_some(Tactic::GemvTc));
            for t in kernels {
                let r = selftest::gemv_vs_cublas(&blas_state, t);
                let ok = matches!(r, Ok(err) if err <= selftest::GEMV_TOLERANCE);
                if ok {
                    tracing::info!(kernel = t.name(), result = ?r, "agrees with cuBLAS on this device; small batches may take it");
                } else {
                    tracing::error!(kernel = t.name(), result = ?r, "disagrees with cuBLAS on this device; not used");
                }
                match t {
                    Tactic::GemvTc => blas_state.tactics.tc_ok = ok,
                    _ => blas_state.tactics.gemv_ok = ok,
                }
            }
        }
        Ok(Self {
            shared: Arc::new(Shared {
                uploads: Mutex::new(driver::UploadRing::empty()),
                ordinal,
                ctx,
                stream,
                recall,
                k,
                warps_on: std::sync::atomic::AtomicBool::new(
                    attend_choice != driver::AttendChoice::Split,
                ),
                tc_groups: std::sync::atomic::AtomicU16::new(0),
                tc_picked_for: Mutex::new(None),
                attend_choice,
                prefetch_groups: std::sync::atomic::AtomicU16::new(
                    prefetch_choice.initial_groups(),
                ),
                prefetch_choice,
                mma,
                sketch_on: std::sync::atomic::AtomicBool::new(
                    std::env::var("DECODE_NODE_DEVICE_SKETCH").map_or(true, |v| v != "0"),
                ),
                sketch_int8: std::env::var("DECODE_NODE_SKETCH_SUMS").map_or(true, |v| v != "f32"),
                sketch_picks: std::sync::atomic::AtomicBool::new(
                    std::env::var("DECODE_NODE_DEVICE_TOPK").map_or(true, |v| v != "off"),
                ),
                device_plan: std::sync::atomic::AtomicBool::new(
                    std::env::var("DECODE_NODE_DEVICE_PLAN").is_ok_and(|v| v == "on"),
                ),
                cpu_flag: std::sync::atomic::AtomicBool::new(
                    std::env::var("DECODE_NODE_CPU_FLAG").is_ok_and(|v| v == "on"),
                ),
                engine_copies: std::sync::atomic::AtomicBool::new(
                    std::env::var("DECODE_NODE_RECALL_COPY").is_ok_and(|v| v == "engine"),
                ),
                sketch_blocks_per_warp: std::sync::atomic::AtomicUsize::new(
                    sketch_blocks_per_warp(),
                ),
                sketch_target_warps: sketch::target_warps(info.sms),
                attention_ctas: std::sync::atomic::AtomicUsize::new(attention_ctas(info.sms)),
                idle: Default::default(),
            }),
            blas: Mutex::new(blas_state),
            fused: layer::FusedCheck::default(),
            residual_on_device: std::sync::atomic::AtomicBool::new(true),
            picks_on_device: std::sync::atomic::AtomicBool::new(true),
            attention_on_device: std::sync::atomic::AtomicBool::new(
                std::env::var("DECODE_NODE_RESIDENT_LAYERS").map_or(true, |v| v != "0"),
            ),
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
        let mut g = self.lock()?;
        g.weights.clear();
        g.parts.clear();
        g.stacks.clear();
        g.graphs.cache.clear();
        g.consts.clear();
        Ok(())
    }

    /// Forgets the device copies of `ts` alone (a check's tensors), stacks they begin included:
    /// the model's weights stay where they are.
    pub(crate) fn forget_weights(&self, ts: &[&Tensor]) -> Result<(), BackendError> {
        let mut g = self.lock()?;
        let g = &mut *g;
        for t in ts {
            g.weights.remove(&t.id());
            if let Some(at) = g.parts.remove(&t.id()) {
                g.stacks
                    .retain(|s| s.device_ptr(&self.shared.stream).0 != at);
            }
        }
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
            src.map_err(|e| dev_err("the copy bandwidth probe", e))?,
            dst.map_err(|e| dev_err("the copy bandwidth probe", e))?,
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

/// CUDA blocks an attention launch aims for: `DECODE_NODE_ATTENTION_CTAS` where it is a
/// count from 1 to 65535, else two per multiprocessor (where the driver says how many).
fn attention_ctas(sms: Option<usize>) -> usize {
    let default = call::default_ctas(sms);
    match std::env::var("DECODE_NODE_ATTENTION_CTAS") {
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if (1..=65535).contains(&n) => n,
            _ => {
                tracing::warn!(value = %v, default, "DECODE_NODE_ATTENTION_CTAS is not a count from 1 to 65535; using the default");
                default
            }
        },
        Err(_) => default,
    }
}

/// `DECODE_NODE_SKETCH_BLOCKS_PER_WARP`: blocks each warp of `sketch_lse` scores; 0 (unset,
/// or not a count from 1 to [`sketch::MAX_BLOCKS_PER_WARP`]): as the call's size says.
fn sketch_blocks_per_warp() -> usize {
    match std::env::var("DECODE_NODE_SKETCH_BLOCKS_PER_WARP") {
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if (1..=sketch::MAX_BLOCKS_PER_WARP).contains(&n) => n,
            _ => {
                tracing::warn!(value = %v, "DECODE_NODE_SKETCH_BLOCKS_PER_WARP is not a count from 1 to {}; sized by the call", sketch::MAX_BLOCKS_PER_WARP);
                0
            }
        },
        Err(_) => 0,
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

    fn prepare_stack(&self, parts: &[&Tensor]) -> Result<(), BackendError> {
        self.shared.bind()?;
        let mut g = self.lock()?;
        if !blas::upload_stack(&mut g, &self.shared, parts)? {
            for w in parts {
                upload(&mut g, &self.shared, w)?;
            }
        }
        Ok(())
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
        sh.idle.busy();
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
            let w_dev = blas::weight_ptr(g, sh, o.w)?;
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
            // SAFETY: w_dev holds rows×cols, b_dev batch×cols of the weights' type, and y_dev
            // room for `at` + batch×rows floats.
            unsafe {
                g.gemm(
                    o.w.dtype,
                    rows,
                    batch,
                    cols,
                    w_dev,
                    b_dev,
                    y_dev + (at * 4) as u64,
                )
            }?;
            at += o.y.len();
        }
        let host = g.staging.get(x.len().max(total))?;
        let host = &mut host[..total];
        sh.read_back(host, y_dev)?;
        take_outputs(host, outs.iter_mut());
        Ok(())
    }

    fn residual<'a>(
        &'a self,
        x: Vec<f32>,
        batch: usize,
    ) -> Result<Box<dyn super::Residual + 'a>, BackendError> {
        if self.residual_on_device() {
            Ok(Box::new(self.device_residual(x, batch)?))
        } else {
            Ok(Box::new(super::HostResidual::new(self, x, batch)))
        }
    }

    fn residual_on_device(&self) -> bool {
        self.residual_on_device
            .load(std::sync::atomic::Ordering::Acquire)
    }

    fn device_idle_seconds(&self) -> Option<f64> {
        Some(self.shared.idle.seconds())
    }

    fn graph_stats(&self) -> Option<super::graphs::GraphStats> {
        self.lock().ok().map(|g| g.graphs.cache.stats())
    }

    fn graphs_on(&self) -> bool {
        self.lock()
            .is_ok_and(|g| g.graphs.cache.why_off().is_none())
    }

    fn turn_graphs_off(&self, why: &str) {
        if let Ok(mut g) = self.lock() {
            g.graphs.cache.turn_off(why);
        }
    }

    fn profile(&self, on: bool) -> Result<(), BackendError> {
        self.shared.bind()?;
        let r = if on {
            cudarc::driver::profiler_start()
        } else {
            cudarc::driver::profiler_stop()
        };
        r.map_err(|e| driver::dev_err("switching the profiler", e))
    }

    fn keep_residual_on_host(&self) {
        self.residual_on_device
            .store(false, std::sync::atomic::Ordering::Release);
    }

    fn picks_on_device(&self) -> bool {
        self.residual_on_device()
            && self
                .picks_on_device
                .load(std::sync::atomic::Ordering::Acquire)
    }

    fn keep_picks_on_host(&self) {
        self.picks_on_device
            .store(false, std::sync::atomic::Ordering::Release);
    }

    fn attention_on_device(&self) -> bool {
        self.residual_on_device()
            && self
                .attention_on_device
                .load(std::sync::atomic::Ordering::Acquire)
    }

    fn keep_attention_on_host(&self) {
        self.attention_on_device
            .store(false, std::sync::atomic::Ordering::Release);
    }

    fn finish_layer(
        &self,
        x: &mut [f32],
        attn: &[f32],
        batch: usize,
        w: super::LayerOut<'_>,
    ) -> Result<(), BackendError> {
        match self.fused.state() {
            Some(true) => return self.finish_layer_fused(x, attn, batch, &w),
            Some(false) => return super::finish_layer_unfused(self, x, attn, batch, w),
            None => {}
        }
        // First use on this device: both paths, the fused one kept only if they agree.
        let mut want = x.to_vec();
        super::finish_layer_unfused(self, &mut want, attn, batch, w)?;
        let fused = self.finish_layer_fused(x, attn, batch, &w);
        if let Err(e @ BackendError::DeviceLost(_)) = fused {
            return Err(e);
        }
        let diff = match &fused {
            Ok(()) => layer::rel_diff(x, &want),
            Err(_) => f64::NAN,
        };
        let agrees = diff <= layer::FUSED_TOLERANCE;
        if agrees {
            tracing::info!(
                diff,
                "the one-round-trip layer agrees with the op-by-op one; using it"
            );
        } else {
            tracing::error!(diff, error = ?fused.err(), "the one-round-trip layer disagrees with the op-by-op one on this device; using the op-by-op path");
            x.copy_from_slice(&want);
        }
        self.fused.record(agrees);
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
        selftest::check_warps_or_off(&self.shared, geom.dtype, geom.block_size, geom.head_dim);
        attend_pick::pick(&self.shared, &geom);
        selftest::check_sketch_or_off(&self.shared, &geom);
        selftest::check_picks_or_off(&self.shared);
        selftest::check_plan_or_off(&self.shared);
        selftest::check_landing_or_off(&self.shared);
        selftest::check_graphs_or_off(self);
        selftest::check_batch_copy_or_off(&self.shared, &geom);
        // Int8 and fp8 blocks go to the device as the pool holds them (codes and per-token
        // scales, about half of f16's bytes to copy and keep); the attention kernel applies
        // the scales as it loads each tile. That path is checked on this device before it
        // serves: a kernel that disagrees with the CPU's is refused, not used.
        if geom.dtype.scaled() {
            let err = selftest::check_split_attention(
                &self.shared,
                geom.dtype,
                4,
                geom.head_dim,
                geom.block_size,
            )?;
            if err.is_nan() || err > selftest::ATTENTION_TOLERANCE {
                return Err(BackendError::Unsupported(format!(
                    "{d} host KV (--kv-dtype {d}): the device attention kernel disagrees with \
                     the CPU's on this device (relative error {err:e}); use --device cpu or a \
                     float --kv-dtype",
                    d = geom.dtype
                )));
            }
        }
        let store = store::CudaKvStore::new(Arc::clone(&self.shared), geom, capacity_bytes, pool)?;
        Ok(Some(Arc::new(store)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_compile_to_ptx_where_nvrtc_exists() {
        // For no device and for an H100's 9.0 at once (each compile takes NVRTC ~20 s on CI's
        // two cores), then for one this NVRTC cannot know: the first's PTX again. The 9.0
        // compile also sets a tunable (`DECODE_NODE_KERNEL_DEFINES`), which must take.
        let (default, hopper) = std::thread::scope(|s| {
            let hopper = s.spawn(|| {
                driver::compile_cached(Some((9, 0)), &["-DATTEND_WARPS_MIN_BLOCKS=2".into()])
            });
            (
                compile_kernels(),
                hopper.join().expect("the compile thread"),
            )
        });
        match default {
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
                let hopper = hopper.unwrap();
                assert!(hopper.contains(".target sm_90"), "not built for sm_90");
                assert!(
                    hopper.contains(".minnctapersm 2") && !ptx.contains(".minnctapersm 2"),
                    "ATTEND_WARPS_MIN_BLOCKS did not reach attend_warps' launch bounds"
                );
                // The sketch's integer sums as the instruction itself, not an emulation.
                for p in [&ptx, &hopper] {
                    assert!(p.contains("dp4a.s32.s32"), "sketch_lse without dp4a");
                }
                // `gemv_tc`'s MMAs where the architecture has them (both types), and none
                // where it does not: there the kernel writes NaN and the start-up check
                // keeps it out.
                for ty in ["bf16.bf16", "f16.f16"] {
                    let mma = format!("mma.sync.aligned.m16n8k16.row.col.f32.{ty}.f32");
                    assert!(hopper.contains(&mma), "gemv_tc without {mma}");
                }
                assert!(!ptx.contains("mma.sync"), "MMAs in the PTX for any device");
                // `attend_tc`'s operands packed on the device by the conversion instruction.
                for ty in ["bf16x2", "f16x2"] {
                    assert!(
                        hopper.contains(&format!("cvt.rn.{ty}.f32")),
                        "no {ty} packing"
                    );
                }
                assert_eq!(compile_kernels_for(Some((99, 9))).unwrap(), ptx);
            }
        }
    }

    /// The value `#define name` gives in the kernels' source.
    fn defined(name: &str) -> usize {
        let line = attention::cuda::KERNELS_CU
            .lines()
            .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("no #define {name}"));
        line.trim()
            .parse()
            .unwrap_or_else(|_| panic!("#define {name} {line}"))
    }

    #[test]
    fn the_launch_constants_are_the_kernels() {
        use attention::cuda::*;
        assert_eq!(defined("SAMPLE_THREADS"), SAMPLE_THREADS as usize);
        assert_eq!(defined("SAMPLE_TOP"), SAMPLE_TOP);
        assert_eq!(defined("SAMPLE_SPEC_WORDS"), SAMPLE_SPEC_WORDS);
        assert_eq!(defined("PART_THREADS"), PART_THREADS as usize);
        assert_eq!(defined("PART_LOGITS"), PART_LOGITS);
        assert_eq!(defined("NORM_THREADS"), NORM_THREADS as usize);
        assert_eq!(defined("GEMV_WARPS"), driver::GEMV_WARPS);
        assert_eq!(defined("GEMV_TC_WARPS"), driver::GEMV_TC_WARPS);
        assert_eq!(defined("SKETCH_WARPS"), sketch::SKETCH_WARPS);
        assert_eq!(defined("SHARES_THREADS"), sketch::SHARES_THREADS as usize);
        assert_eq!(defined("ATTEND_PREFETCH"), call::ATTEND_PREFETCH as usize);
        assert!(
            attention::cuda::KERNELS_CU.contains("#define SAMPLE_OUT_WORDS (4 + 2 * SAMPLE_TOP)")
        );
    }

    #[test]
    fn every_generated_entry_name_is_a_kernel() {
        let warps: Vec<String> = Kernels::warps_names().collect();
        assert_eq!(
            warps.len(),
            driver::WARPS_BLOCK_SIZES.len()
                * driver::WARPS_HEAD_DIMS.len()
                * driver::WARPS_MAX_GROUP
        );
        let tc: Vec<String> = Kernels::tc_names().collect();
        assert_eq!(
            tc.len(),
            driver::WARPS_BLOCK_SIZES.len() * driver::WARPS_HEAD_DIMS.len()
        );
        for n in warps.iter().cloned().chain(Kernels::gemv_names()).chain(tc) {
            assert!(
                attention::cuda::ENTRY_POINTS.contains(&n.as_str()),
                "{n} not listed"
            );
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
