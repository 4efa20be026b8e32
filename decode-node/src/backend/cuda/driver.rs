//! The CUDA driver side: probing, kernel compilation (NVRTC), the context and streams shared
//! by the backend and the KV store, device buffers, pinned host memory and copies.

use std::fmt;
use std::sync::{Arc, Mutex};

use attention::KvDType;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError, LaunchConfig,
    PushKernelArg, result as drv, sys,
};

use super::{BackendError, CudaError};

/// What the probe found.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Ordinal.
    pub ordinal: usize,
    /// Devices visible.
    pub count: usize,
    /// Its compute capability (major, minor), where the driver says.
    pub compute: Option<(i32, i32)>,
    /// Its streaming multiprocessors, where the driver says.
    pub sms: Option<usize>,
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cuda:{} ({} visible", self.ordinal, self.count)?;
        match self.compute {
            Some((major, minor)) => write!(f, ", compute capability {major}.{minor})"),
            None => write!(f, ")"),
        }
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
    use sys::CUdevice_attribute as A;
    let compute = attribute(ordinal, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).zip(
        attribute(ordinal, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
    );
    let sms = attribute(ordinal, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .and_then(|n| usize::try_from(n).ok());
    Ok(DeviceInfo {
        ordinal,
        count,
        compute,
        sms,
    })
}

/// One attribute of device `ordinal`; `None` where the driver does not say.
fn attribute(ordinal: usize, a: sys::CUdevice_attribute) -> Option<i32> {
    use cudarc::driver::result::device;
    let dev = device::get(i32::try_from(ordinal).ok()?).ok()?;
    // SAFETY: `dev` came from `device::get`.
    unsafe { device::get_attribute(dev, a) }.ok()
}

/// Compiles the device kernels to PTX with NVRTC for no particular device.
pub fn compile_kernels() -> Result<String, CudaError> {
    compile_kernels_for(None)
}

/// Compiles the device kernels to PTX with NVRTC for compute capability `compute` (the
/// driver then has less to translate, and the compiler knows the device's instructions);
/// where this NVRTC does not know that architecture, for no particular device. Compiled once
/// per process and architecture: NVRTC takes seconds over these kernels, and every backend a
/// process opens (each bench row's node, each selftest model) needs them.
pub fn compile_kernels_for(compute: Option<(i32, i32)>) -> Result<String, CudaError> {
    let defines = kernel_defines(&std::env::var(KERNEL_DEFINES_ENV).unwrap_or_default())
        .map_err(|e| CudaError::Compile(format!("{KERNEL_DEFINES_ENV}: {e}")))?;
    compile_cached(compute, &defines)
}

/// [`compile_kernels_for`] with `defines` (NVRTC options, see `kernel_defines`).
pub(crate) fn compile_cached(
    compute: Option<(i32, i32)>,
    defines: &[String],
) -> Result<String, CudaError> {
    static PTX: std::sync::OnceLock<Mutex<PtxCache>> = std::sync::OnceLock::new();
    let cache = PTX.get_or_init(Default::default);
    let key = (compute, defines.to_vec());
    if let Some(ptx) = cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok(ptx);
    }
    let ptx = compile_uncached(compute, defines)?;
    if let Ok(mut c) = cache.lock() {
        c.insert(key, ptx.clone());
    }
    Ok(ptx)
}

/// PTX by the architecture and the defines it was compiled with.
type PtxCache = std::collections::HashMap<(Option<(i32, i32)>, Vec<String>), String>;

/// Names the kernels' compile-time tunables to set, as `NAME=VALUE[,NAME=VALUE...]` (integer
/// values): what `scripts/gpu-run.sh` A/Bs on a device in one run, e.g.
/// `ATTEND_WARPS_MIN_BLOCKS=3` (see `kernels.cu`). Unset: the kernels' defaults.
pub const KERNEL_DEFINES_ENV: &str = "DECODE_NODE_KERNEL_DEFINES";

/// NVRTC's `-D` options for `spec` (`NAME=VALUE` pairs split by commas or whitespace; a name
/// in upper case, digits and `_`, an integer value), or what is wrong with it.
fn kernel_defines(spec: &str) -> Result<Vec<String>, String> {
    spec.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (name, value) = pair
                .split_once('=')
                .ok_or_else(|| format!("`{pair}` is not NAME=VALUE"))?;
            let name_ok = name.starts_with(|c: char| c.is_ascii_uppercase())
                && name
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            if !name_ok {
                return Err(format!("`{name}` is not a tunable's name (A-Z, 0-9, _)"));
            }
            value
                .parse::<i64>()
                .map_err(|_| format!("`{value}` (for {name}) is not an integer"))?;
            Ok(format!("-D{name}={value}"))
        })
        .collect()
}

fn compile_uncached(compute: Option<(i32, i32)>, defines: &[String]) -> Result<String, CudaError> {
    // SAFETY: only tries to dlopen libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let compile = |mut options: Vec<String>| {
        options.extend(defines.iter().cloned());
        let opts = cudarc::nvrtc::CompileOptions {
            options,
            ..Default::default()
        };
        cudarc::nvrtc::compile_ptx_with_opts(attention::cuda::KERNELS_CU, opts)
            .map(|p| p.to_src())
            .map_err(|e| CudaError::Compile(format!("{e:?}")))
    };
    if let Some((major, minor)) = compute {
        match compile(vec![format!("--gpu-architecture=compute_{major}{minor}")]) {
            Ok(ptx) => return Ok(ptx),
            Err(e) => tracing::warn!(
                major,
                minor,
                error = %e,
                "NVRTC could not compile for this device's architecture; compiling for none in particular"
            ),
        }
        return compile_cached(None, defines);
    }
    compile(Vec::new())
}

/// A driver call that failed, by what it means for the node: out of memory is
/// [`BackendError::DeviceFull`]; a sticky fault (the context is unusable) is
/// [`BackendError::DeviceLost`]; anything else fails the call only.
pub(crate) fn dev_err(what: &str, e: DriverError) -> BackendError {
    use sys::CUresult as R;
    // The code's name, not `DriverError`'s Debug: that asks the driver for a message.
    let code = e.0;
    match code {
        R::CUDA_ERROR_OUT_OF_MEMORY => BackendError::OutOfMemory(what.to_string()),
        // Sticky: the context is unusable and every later call fails the same way.
        R::CUDA_ERROR_ILLEGAL_ADDRESS
        | R::CUDA_ERROR_LAUNCH_FAILED
        | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
        | R::CUDA_ERROR_MISALIGNED_ADDRESS
        | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
        | R::CUDA_ERROR_INVALID_PC
        | R::CUDA_ERROR_HARDWARE_STACK_ERROR
        | R::CUDA_ERROR_ECC_UNCORRECTABLE
        | R::CUDA_ERROR_CONTEXT_IS_DESTROYED
        | R::CUDA_ERROR_DEVICE_UNAVAILABLE
        | R::CUDA_ERROR_DEINITIALIZED => BackendError::DeviceLost(format!("{what}: {code:?}")),
        _ => BackendError::Device(format!("{what}: {code:?}")),
    }
}

/// An error of a CUDA library other than the driver (cuBLAS): a device error.
pub(crate) fn lib_err(what: &str, e: impl fmt::Debug) -> BackendError {
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
    pub(crate) silu_mul_stacked: CudaFunction,
    pub(crate) quest_scores: CudaFunction,
    pub(crate) lse2_merge: CudaFunction,
    pub(crate) kv_append: CudaFunction,
    pub(crate) gather_copy: CudaFunction,
    pub(crate) copy_tokens: CudaFunction,
    pub(crate) sample_rows: CudaFunction,
    pub(crate) row_max_parts: CudaFunction,
    pub(crate) row_sum_parts: CudaFunction,
    pub(crate) qkv_finish: CudaFunction,
    pub(crate) merge_self: CudaFunction,
    pub(crate) rms_norm_half: CudaFunction,
    pub(crate) silu_mul_stacked_half: CudaFunction,
    pub(crate) sketch_lse: CudaFunction,
    pub(crate) sketch_shares: CudaFunction,
    pub(crate) top_blocks: CudaFunction,
    pub(crate) place_picks: CudaFunction,
    pub(crate) scatter_runs: CudaFunction,
    /// `attend_warps_g{G}_d{D}`: [`Kernels::warps`] picks one.
    pub(crate) warps: Vec<CudaFunction>,
    /// `gemv_b{B}`, B = 1 ..= [`GEMV_MAX_BATCH`], in order.
    pub(crate) gemv: Vec<CudaFunction>,
    pub(crate) gemv_tc: CudaFunction,
    /// `attend_tc_d{D}` (and `_b16`): [`Kernels::tc`] picks one.
    pub(crate) tc: Vec<CudaFunction>,
}

/// Largest batch `gemv_b{B}` is built for, and `gemv_tc` takes (its MMA's 8 columns).
pub(crate) const GEMV_MAX_BATCH: usize = 8;
/// Warps of a `gemv_tc` CUDA block (the kernels' `GEMV_TC_WARPS`), and rows of w it takes.
pub(crate) const GEMV_TC_WARPS: usize = 8;
pub(crate) const GEMV_TC_ROWS: usize = 16;
/// Rows of w per `gemv_b{B}` CUDA block (one per warp; the kernels' `GEMV_WARPS`).
pub(crate) const GEMV_WARPS: usize = 8;

/// Block sizes `attend_warps` is built for, in [`Kernels::warps`]' order (the entries for 16
/// end in `_b16`).
pub(crate) const WARPS_BLOCK_SIZES: [usize; 2] = [32, 16];
/// Head dims `attend_warps` is built for, in [`Kernels::warps`]' order.
pub(crate) const WARPS_HEAD_DIMS: [usize; 2] = [64, 128];
/// Query heads per KV head `attend_warps` is built for: 1 ..= this.
pub(crate) const WARPS_MAX_GROUP: usize = 8;
/// Where `attend_warps` for this shape sits in [`Kernels::warps`]; `None`: no such entry.
fn warps_index(dtype: KvDType, block_size: usize, group: usize, d: usize) -> Option<usize> {
    tc_index(dtype, block_size, group, d).map(|shape| shape * WARPS_MAX_GROUP + group - 1)
}

/// Blocks one `attend_warps` CUDA block takes at least: one per warp.
pub(crate) const WARPS_PER_BLOCK: usize = 4;

/// Where `attend_tc` for this shape sits in [`Kernels::tc`] (the same block sizes and head
/// dims as `attend_warps`, any group up to [`WARPS_MAX_GROUP`]); `None`: no such entry. Also
/// the shape's place among `attend_warps`' entries, a group's run of them each.
fn tc_index(dtype: KvDType, block_size: usize, group: usize, d: usize) -> Option<usize> {
    let half = matches!(dtype, KvDType::F16 | KvDType::Bf16);
    let bi = WARPS_BLOCK_SIZES.iter().position(|&x| x == block_size)?;
    let di = WARPS_HEAD_DIMS.iter().position(|&x| x == d)?;
    (half && (1..=WARPS_MAX_GROUP).contains(&group)).then_some(bi * WARPS_HEAD_DIMS.len() + di)
}

/// Which kernel attention takes, as `DECODE_NODE_ATTENTION_KERNEL` says: `split` (the general
/// kernel only), `warps` (`attend_warps`, not the tensor cores), `tc` (`attend_tc` wherever it
/// passed the start-up check), or unset: `attend_tc` for the groups where it passed the check
/// and was the faster of the two at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AttendChoice {
    Timed,
    Split,
    Warps,
    Tc,
}

impl AttendChoice {
    /// The choice `value` names (unset: [`AttendChoice::Timed`]); `Err`: an unknown name.
    pub(crate) fn parse(value: Option<&str>) -> Result<Self, String> {
        match value {
            None | Some("") => Ok(Self::Timed),
            Some("split") => Ok(Self::Split),
            Some("warps") => Ok(Self::Warps),
            Some("tc") => Ok(Self::Tc),
            Some(other) => Err(format!(
                "DECODE_NODE_ATTENTION_KERNEL={other}: expected split, warps or tc"
            )),
        }
    }
}

/// Whether `attend_warps` and `attend_tc` ask L2 for their next batch of loads as they issue
/// one (the kernels' `ATTEND_PREFETCH` flag), as `DECODE_NODE_ATTENTION_PREFETCH` says: `on`,
/// `off`, or unset: per group, where it made the kernel picked at start faster
/// (`attend_pick`; off where nothing is timed: forced `split` or `warps`, or no MMAs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PrefetchChoice {
    Timed,
    On,
    Off,
}

impl PrefetchChoice {
    /// The choice `value` names (unset: [`PrefetchChoice::Timed`]); `Err`: an unknown name.
    pub(crate) fn parse(value: Option<&str>) -> Result<Self, String> {
        match value {
            None | Some("") => Ok(Self::Timed),
            Some("on" | "1") => Ok(Self::On),
            Some("off" | "0") => Ok(Self::Off),
            Some(other) => Err(format!(
                "DECODE_NODE_ATTENTION_PREFETCH={other}: expected on or off"
            )),
        }
    }

    /// [`Shared::prefetch_groups`] before anything is timed.
    pub(crate) fn initial_groups(self) -> u16 {
        match self {
            Self::On => u16::MAX,
            Self::Timed | Self::Off => 0,
        }
    }
}

impl Kernels {
    /// The `attend_warps` entry for this shape, where there is one (16-bit KV in 16- or 32-token
    /// blocks, head_dim 64 or 128, at most 8 query heads per KV head).
    pub(crate) fn warps(
        &self,
        dtype: KvDType,
        block_size: usize,
        group: usize,
        d: usize,
    ) -> Option<&CudaFunction> {
        self.warps.get(warps_index(dtype, block_size, group, d)?)
    }

    /// The `attend_tc` entry for this shape, where there is one.
    pub(crate) fn tc(
        &self,
        dtype: KvDType,
        block_size: usize,
        group: usize,
        d: usize,
    ) -> Option<&CudaFunction> {
        self.tc.get(tc_index(dtype, block_size, group, d)?)
    }

    /// Entry names of [`Kernels::tc`], in its order.
    pub(crate) fn tc_names() -> impl Iterator<Item = String> {
        WARPS_BLOCK_SIZES.iter().flat_map(|&bs| {
            let tail = if bs == 32 { "" } else { "_b16" };
            WARPS_HEAD_DIMS
                .iter()
                .map(move |d| format!("attend_tc_d{d}{tail}"))
        })
    }

    /// Entry names of [`Kernels::gemv`], in its order.
    pub(crate) fn gemv_names() -> impl Iterator<Item = String> {
        (1..=GEMV_MAX_BATCH).map(|b| format!("gemv_b{b}"))
    }

    /// Entry names of [`Kernels::warps`], in its order.
    pub(crate) fn warps_names() -> impl Iterator<Item = String> {
        WARPS_BLOCK_SIZES.iter().flat_map(|&bs| {
            let tail = if bs == 32 {
                String::new()
            } else {
                format!("_b{bs}")
            };
            WARPS_HEAD_DIMS.iter().flat_map(move |d| {
                let tail = tail.clone();
                (1..=WARPS_MAX_GROUP).map(move |g| format!("attend_warps_g{g}_d{d}{tail}"))
            })
        })
    }
}

/// True where the driver has batched copies (`cuMemcpyBatchAsync_v2`, CUDA 13): cudarc panics
/// on a call of a symbol the driver lacks, so it is looked up first, once.
pub(crate) fn has_batch_copy() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        // SAFETY: only asked with a driver loaded (a backend exists); the symbol is looked up,
        // not called.
        unsafe {
            sys::culib()
                .get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync_v2")
                .is_ok()
        }
    })
}

/// What the backend and its KV store share.
#[derive(Debug)]
pub(crate) struct Shared {
    /// The main stream's per-layer uploads ([`Shared::upload`]); first, so it is freed while
    /// the context lives.
    pub(crate) uploads: Mutex<UploadRing>,
    pub(crate) ordinal: usize,
    pub(crate) ctx: Arc<CudaContext>,
    /// Projections and the device part of attention, in order.
    pub(crate) stream: Arc<CudaStream>,
    /// Recall copies, overlapping the main stream.
    pub(crate) recall: Arc<CudaStream>,
    pub(crate) k: Kernels,
    /// Attention takes `attend_warps` where the shape has one; off: always the general
    /// `sparse_attention_split` (`DECODE_NODE_ATTENTION_KERNEL=split`, or a start-up check
    /// that found it disagreeing).
    pub(crate) warps_on: std::sync::atomic::AtomicBool,
    /// Bit `g` set: attention calls of `g` query heads per KV head take `attend_tc` where the
    /// shape has one (before `attend_warps`). Set at start where it passed the check (and,
    /// unless forced, measured faster): `attend_pick`.
    pub(crate) tc_groups: std::sync::atomic::AtomicU16,
    /// What `DECODE_NODE_ATTENTION_KERNEL` asked for.
    pub(crate) attend_choice: AttendChoice,
    /// Bit `g` set: `attend_warps` and `attend_tc` calls of `g` query heads per KV head
    /// prefetch their next loads into L2 ([`PrefetchChoice`]).
    pub(crate) prefetch_groups: std::sync::atomic::AtomicU16,
    /// What `DECODE_NODE_ATTENTION_PREFETCH` asked for.
    pub(crate) prefetch_choice: PrefetchChoice,
    /// The block shape [`Shared::tc_groups`] was last chosen for (a second store or bench
    /// call of that shape does not check and time again).
    pub(crate) tc_picked_for: Mutex<Option<attention::BlockGeometry>>,
    /// The device has the MMAs of sm_80 on (`attend_tc`, `gemv_tc`).
    pub(crate) mma: bool,
    /// Sequences keep their key sketch here and `--block-scorer sketch` scores on the device;
    /// off: the host scores (`DECODE_NODE_DEVICE_SKETCH=0`, or a start-up check that found
    /// the device's scores disagreeing with the host's).
    pub(crate) sketch_on: std::sync::atomic::AtomicBool,
    /// `sketch_lse` sums in integers against the query rounded to int8, as the host sketch's
    /// AVX2 path does (`attention::sketch::round_query_i8`); off: in floats against the
    /// query itself (`DECODE_NODE_SKETCH_SUMS=f32`, the A/B of `scripts/gpu-run.sh`).
    pub(crate) sketch_int8: bool,
    /// A sketch call that asks for each head's best blocks gets them from `top_blocks`, not
    /// every score; off: every score comes back and the host picks
    /// (`DECODE_NODE_DEVICE_TOPK=off`, or a start-up check that found the picks wrong).
    pub(crate) sketch_picks: std::sync::atomic::AtomicBool,
    /// A resident layer whose every block a sequence holds here is planned by the device
    /// alone (#21 item 4: `top_blocks`' picks laid into the attention's list by `place_picks`,
    /// no query back to the host). Off unless `DECODE_NODE_DEVICE_PLAN=on`: not yet run on a
    /// GPU; a start-up check that finds `place_picks` wrong turns it off.
    pub(crate) device_plan: std::sync::atomic::AtomicBool,
    /// A resident layer's CPU partials land in mapped host memory and the stream waits on
    /// their flag (#21 item 5, `landing`), so the step thread never waits for the CPU part.
    /// Off unless `DECODE_NODE_CPU_FLAG=on`: not yet run on a GPU; a start-up check that
    /// finds the merge reading a landing wrongly turns it off.
    pub(crate) cpu_flag: std::sync::atomic::AtomicBool,
    /// Blocks go up to the device with one batched copy through the copy engines
    /// (`cuMemcpyBatchAsync`, #21 item 7) where the driver has it, not the `gather_copy`
    /// kernel over the mapped pool. Off unless `DECODE_NODE_RECALL_COPY=engine`: not yet run
    /// on a GPU; a start-up check that finds the copies wrong turns it off.
    pub(crate) engine_copies: std::sync::atomic::AtomicBool,
    /// Blocks each warp of `sketch_lse` scores (`DECODE_NODE_SKETCH_BLOCKS_PER_WARP`); 0: as
    /// many as bring a call to about [`Shared::sketch_target_warps`] warps
    /// (`sketch::blocks_per_warp`).
    pub(crate) sketch_blocks_per_warp: std::sync::atomic::AtomicUsize,
    /// Warps a `sketch_lse` launch aims for: 32 a multiprocessor.
    pub(crate) sketch_target_warps: usize,
    /// CUDA blocks an attention call's split-K launch aims for (`DECODE_NODE_ATTENTION_CTAS`;
    /// `bench kernels --device cuda` sweeps it).
    pub(crate) attention_ctas: std::sync::atomic::AtomicUsize,
    /// How long the main stream sat empty while the host worked.
    pub(crate) idle: IdleClock,
}

impl Drop for Shared {
    /// The ring is freed after the copies that read it.
    fn drop(&mut self) {
        let _ = self.bind();
        let _ = self.stream.synchronize();
    }
}

/// Time the main stream had nothing to do: from each wait that emptied it (a copy back, a
/// fence) to the host's next piece of device work. Launch gaps inside queued work are not
/// counted, so this is a lower bound on the device's idle time; it is what a step driven from
/// the host loses between its round trips.
#[derive(Debug)]
pub(crate) struct IdleClock {
    state: Mutex<(std::time::Duration, Option<std::time::Instant>)>,
}

impl Default for IdleClock {
    /// Idle from creation: nothing is queued yet.
    fn default() -> Self {
        Self {
            state: Mutex::new((std::time::Duration::ZERO, Some(std::time::Instant::now()))),
        }
    }
}

impl IdleClock {
    /// The stream is empty from now (the host just waited for all of it).
    pub(crate) fn emptied(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.1.get_or_insert_with(std::time::Instant::now);
        }
    }

    /// The host is about to queue work: an idle stretch ends.
    pub(crate) fn busy(&self) {
        if let Ok(mut s) = self.state.lock()
            && let Some(since) = s.1.take()
        {
            s.0 += since.elapsed();
        }
    }

    /// Idle seconds so far, the stretch under way included.
    pub(crate) fn seconds(&self) -> f64 {
        self.state.lock().map_or(0.0, |s| {
            (s.0 + s.1.map_or(std::time::Duration::ZERO, |t| t.elapsed())).as_secs_f64()
        })
    }
}

impl Shared {
    pub(crate) fn bind(&self) -> Result<(), BackendError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| dev_err("binding the context", e))
    }

    /// Copies main-stream device address `src` into `dst` and waits for it: the stream is
    /// empty afterwards ([`IdleClock`]).
    pub(crate) fn read_back(&self, dst: &mut [f32], src: u64) -> Result<(), BackendError> {
        let r = dtoh_f32(dst, src, &self.stream);
        self.idle.emptied();
        r
    }

    /// Queues the copy of `src` to device address `dst` on the main stream through the
    /// page-locked [`UploadRing`]: the host does not wait for the device.
    pub(crate) fn upload(&self, dst: u64, src: &[u8]) -> Result<(), BackendError> {
        self.uploads
            .lock()
            .map_err(|_| BackendError::Device("upload ring lock poisoned".into()))?
            .upload(dst, src, &self.stream)
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
            let b = unsafe { stream.alloc::<u8>(bytes.next_power_of_two()) }
                .map_err(|e| dev_err(&format!("{bytes} bytes of scratch"), e))?;
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
    /// No memory yet.
    pub(crate) const fn empty() -> Self {
        Self {
            ptr: std::ptr::null_mut(),
            len: 0,
        }
    }

    /// At least `n` floats (contents undefined until written).
    pub(crate) fn get(&mut self, n: usize) -> Result<&mut [f32], BackendError> {
        if self.len < n {
            self.release();
            let len = n.next_power_of_two().max(1024);
            // SAFETY: a fresh allocation of `len` floats; PORTABLE pins it for every context.
            let p = unsafe { drv::malloc_host(len * 4, sys::CU_MEMHOSTALLOC_PORTABLE) }
                .map_err(|e| dev_err("pinned staging", e))?;
            self.ptr = p.cast();
            self.len = len;
        }
        // SAFETY: `ptr` holds `len >= n` floats owned by us; f32 accepts any bit pattern.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, n) })
    }

    /// At least `n` bytes (contents undefined until written).
    pub(crate) fn bytes(&mut self, n: usize) -> Result<&mut [u8], BackendError> {
        let floats = self.get(n.div_ceil(4))?;
        // SAFETY: the floats' memory, `4 * len >= n` bytes; u8 has no alignment or validity
        // requirement.
        Ok(unsafe { std::slice::from_raw_parts_mut(floats.as_mut_ptr().cast::<u8>(), n) })
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

/// Where [`UploadRing`] puts the next upload: its offset, and the halves the cursor leaves
/// and enters on the way. Pure, so tested without a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    pub offset: usize,
    /// The half the cursor left: mark how far the stream has to get to be done with it.
    pub leave: Option<usize>,
    /// The half the cursor entered: wait until the stream is done with its last uses.
    pub enter: Option<usize>,
}

/// The cursor of a ring of two halves of `half` bytes each: uploads are laid one after the
/// other (16-byte aligned) in the current half, and one that does not fit starts the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RingCursor {
    half: usize,
    /// The half in use, and the first byte past its last upload.
    cur: usize,
    at: usize,
}

impl RingCursor {
    pub(crate) const ALIGN: usize = 16;

    /// Halves of at least `half` bytes (a multiple of [`Self::ALIGN`], so both start aligned).
    pub(crate) const fn new(half: usize) -> Self {
        Self {
            half: half.next_multiple_of(Self::ALIGN),
            cur: 0,
            at: 0,
        }
    }

    /// Room for `len` bytes, or `None` where they exceed a half.
    pub(crate) fn take(&mut self, len: usize) -> Option<Slot> {
        if len > self.half {
            return None;
        }
        let h = self.cur;
        let start = self.at.next_multiple_of(Self::ALIGN);
        if start + len <= (h + 1) * self.half {
            self.at = start + len;
            return Some(Slot {
                offset: start,
                leave: None,
                enter: None,
            });
        }
        let next = 1 - h;
        (self.cur, self.at) = (next, next * self.half + len);
        Some(Slot {
            offset: next * self.half,
            leave: Some(h),
            enter: Some(next),
        })
    }
}

/// Page-locked memory that the main stream's per-layer uploads (slot lists, CPU partials,
/// small constants) leave through. From pageable memory, a copy may synchronise with its
/// stream ("the driver may synchronize with the stream and stage the copy", CUDA's API
/// synchronisation notes), and copies past the driver's own staging do: a slot list of a 64k
/// context (~200 KB) would make the host wait for the device at every layer. From here the
/// copy is DMA and the host goes on. Two halves: the cursor moves into one only once the
/// stream is past the last copy from it (an event recorded as the cursor left it, which a
/// half of several megabytes put a step or more back).
pub(crate) struct UploadRing {
    ptr: *mut u8,
    cursor: RingCursor,
    /// Recorded on the stream as the cursor left each half.
    marks: [Option<sys::CUevent>; 2],
}

// SAFETY: plain memory and event handles owned by this value, used under the `Shared` mutex.
unsafe impl Send for UploadRing {}

impl fmt::Debug for UploadRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UploadRing")
            .field("cursor", &self.cursor)
            .finish()
    }
}

impl UploadRing {
    /// Bytes of each half where nothing larger was asked for.
    const HALF: usize = 4 << 20;

    /// No memory yet.
    pub(crate) const fn empty() -> Self {
        Self {
            ptr: std::ptr::null_mut(),
            cursor: RingCursor::new(0),
            marks: [None, None],
        }
    }

    /// Queues the copy of `src` to device address `dst` on `stream` through the ring.
    pub(crate) fn upload(
        &mut self,
        dst: u64,
        src: &[u8],
        stream: &CudaStream,
    ) -> Result<(), BackendError> {
        if src.is_empty() {
            return Ok(());
        }
        let slot = match self.cursor.take(src.len()) {
            Some(s) if !self.ptr.is_null() => s,
            _ => {
                self.grow(src.len(), stream)?;
                self.cursor
                    .take(src.len())
                    .ok_or_else(|| BackendError::Device("upload ring too small".into()))?
            }
        };
        if let Some(h) = slot.leave {
            let ev = match self.marks[h] {
                Some(e) => e,
                None => {
                    let e = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                        .map_err(|e| dev_err("creating an event", e))?;
                    self.marks[h] = Some(e);
                    e
                }
            };
            // SAFETY: the event and the stream are live.
            unsafe { drv::event::record(ev, stream.cu_stream()) }
                .map_err(|e| dev_err("marking the upload ring", e))?;
        }
        if let Some(e) = slot.enter.and_then(|h| self.marks[h]) {
            // SAFETY: a live event; recorded before (an unrecorded one returns at once).
            unsafe { drv::event::synchronize(e) }
                .map_err(|e| dev_err("waiting for the upload ring", e))?;
        }
        // SAFETY: the slot lies in the ring (`take` keeps it within two halves) and the
        // stream is past every earlier copy from it (the wait above); the copy reads it before
        // the cursor comes back round.
        unsafe {
            let at = self.ptr.add(slot.offset);
            std::ptr::copy_nonoverlapping(src.as_ptr(), at, src.len());
            drv::memcpy_htod_async(
                dst,
                std::slice::from_raw_parts(at, src.len()),
                stream.cu_stream(),
            )
        }
        .map_err(|e| dev_err("copy to device", e))
    }

    /// A ring whose halves hold `len` bytes, once the stream is done with the old one.
    fn grow(&mut self, len: usize, stream: &CudaStream) -> Result<(), BackendError> {
        stream
            .synchronize()
            .map_err(|e| dev_err("synchronising", e))?;
        self.release();
        // The cursor's halves, which it rounds up, are what is allocated.
        let cursor = RingCursor::new(len.max(Self::HALF));
        // SAFETY: a fresh allocation; PORTABLE pins it for every context.
        let p = unsafe { drv::malloc_host(2 * cursor.half, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| dev_err("pinned upload ring", e))?;
        self.ptr = p.cast();
        self.cursor = cursor;
        Ok(())
    }

    fn release(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: allocated by `malloc_host`, freed once, the stream past its copies
            // (`grow` waited for it; `Shared`'s drop does before its ring goes).
            let _ = unsafe { drv::free_host(self.ptr.cast()) };
            self.ptr = std::ptr::null_mut();
        }
        for e in self.marks.iter_mut().filter_map(Option::take) {
            // SAFETY: created by `event::create`, destroyed once.
            let _ = unsafe { drv::event::destroy(e) };
        }
    }
}

impl Drop for UploadRing {
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

/// The kernels' code for a KV dtype.
pub(crate) fn dtype_code(d: KvDType) -> i32 {
    match d {
        KvDType::F32 => 0,
        KvDType::F16 => 1,
        KvDType::Bf16 => 2,
        // Codes with per-token scales: only the attention kernel reads them.
        KvDType::I8 => 3,
        KvDType::F8E4M3 => 4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_never_hands_out_bytes_the_stream_may_still_read() {
        // Model the stream as the copies queued since each half was last left: a half's
        // copies are only known done once the cursor has left it and come back (its mark).
        let mut c = RingCursor::new(1000);
        let half = c.half;
        assert_eq!(half, 1008);
        let mut live: Vec<(usize, usize)> = Vec::new(); // queued, not known done
        let mut in_half: [Vec<(usize, usize)>; 2] = [Vec::new(), Vec::new()];
        let mut seed = 1u64;
        let mut switches = 0;
        for _ in 0..5000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = 1 + (seed >> 33) as usize % 400;
            let s = c.take(len).expect("fits a half");
            assert_eq!(s.offset % RingCursor::ALIGN, 0);
            assert_eq!(s.leave.is_some(), s.enter.is_some());
            if let (Some(l), Some(e)) = (s.leave, s.enter) {
                assert_ne!(l, e);
                switches += 1;
                // Entering a half waits for its mark: its copies are done.
                for r in std::mem::take(&mut in_half[e]) {
                    live.retain(|x| *x != r);
                }
            }
            let h = s.offset / half;
            assert!(s.offset + len <= (h + 1) * half, "a copy crosses its half");
            for &(a, n) in &live {
                assert!(
                    s.offset + len <= a || a + n <= s.offset,
                    "[{}, {}) overlaps a queued copy [{a}, {})",
                    s.offset,
                    s.offset + len,
                    a + n
                );
            }
            live.push((s.offset, len));
            in_half[h].push((s.offset, len));
        }
        assert!(switches > 100, "the test must wrap the ring: {switches}");
        assert_eq!(
            c.take(half + 1),
            None,
            "larger than a half: the caller grows the ring"
        );
        assert!(c.take(half).is_some());
    }

    #[test]
    fn driver_errors_are_told_apart_full_lost_or_failed() {
        use sys::CUresult as R;
        let oom = dev_err("weights", DriverError(R::CUDA_ERROR_OUT_OF_MEMORY));
        assert!(matches!(oom, BackendError::OutOfMemory(_)), "{oom:?}");
        assert_eq!(oom.to_string(), "device memory ran out: weights");
        for lost in [
            R::CUDA_ERROR_CONTEXT_IS_DESTROYED,
            R::CUDA_ERROR_ILLEGAL_ADDRESS,
            R::CUDA_ERROR_LAUNCH_FAILED,
            R::CUDA_ERROR_ECC_UNCORRECTABLE,
        ] {
            let e = dev_err("sync", DriverError(lost));
            assert!(matches!(e, BackendError::DeviceLost(_)), "{e:?}");
        }
        for failed in [R::CUDA_ERROR_INVALID_VALUE, R::CUDA_ERROR_NOT_READY] {
            let e = dev_err("weights", DriverError(failed));
            assert!(matches!(e, BackendError::Device(_)), "{e:?}");
            assert!(e.to_string().contains("weights"), "{e}");
        }
    }

    #[test]
    fn attend_warps_is_picked_only_for_the_shapes_it_is_built_for() {
        let names: Vec<String> = Kernels::warps_names().collect();
        let name = |dt, bs, g, d| warps_index(dt, bs, g, d).map(|i| names[i].as_str());
        assert_eq!(
            name(KvDType::Bf16, 32, 5, 128),
            Some("attend_warps_g5_d128")
        );
        assert_eq!(name(KvDType::F16, 32, 1, 64), Some("attend_warps_g1_d64"));
        assert_eq!(name(KvDType::Bf16, 32, 8, 64), Some("attend_warps_g8_d64"));
        assert_eq!(
            name(KvDType::Bf16, 16, 4, 128),
            Some("attend_warps_g4_d128_b16")
        );
        assert_eq!(
            name(KvDType::F16, 16, 1, 64),
            Some("attend_warps_g1_d64_b16")
        );
        for &(dt, bs, g, d) in UNBUILT {
            assert_eq!(name(dt, bs, g, d), None, "{dt:?} {bs} {g} {d}");
        }
    }

    /// (dtype, block size, group, head dim) that neither `attend_warps` nor `attend_tc` is
    /// built for.
    const UNBUILT: &[(KvDType, usize, usize, usize)] = &[
        (KvDType::F32, 32, 4, 128),
        (KvDType::I8, 32, 4, 128),
        (KvDType::F8E4M3, 32, 4, 128),
        (KvDType::F32, 16, 4, 128),
        (KvDType::Bf16, 8, 4, 128),
        (KvDType::Bf16, 64, 4, 128),
        (KvDType::Bf16, 32, 9, 128),
        (KvDType::Bf16, 32, 0, 128),
        (KvDType::Bf16, 32, 4, 96),
    ];

    #[test]
    fn attend_tc_is_picked_only_for_the_shapes_it_is_built_for() {
        let names: Vec<String> = Kernels::tc_names().collect();
        let name = |dt, bs, g, d| tc_index(dt, bs, g, d).map(|i| names[i].as_str());
        for g in 1..=WARPS_MAX_GROUP {
            assert_eq!(name(KvDType::Bf16, 32, g, 128), Some("attend_tc_d128"));
            assert_eq!(name(KvDType::F16, 32, g, 64), Some("attend_tc_d64"));
            assert_eq!(name(KvDType::Bf16, 16, g, 128), Some("attend_tc_d128_b16"));
            assert_eq!(name(KvDType::F16, 16, g, 64), Some("attend_tc_d64_b16"));
        }
        for &(dt, bs, g, d) in UNBUILT {
            assert_eq!(name(dt, bs, g, d), None, "{dt:?} {bs} {g} {d}");
        }
    }

    #[test]
    fn the_idle_clock_counts_only_from_an_emptied_stream_to_the_next_work() {
        let c = IdleClock::default();
        c.busy();
        let start = c.seconds();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(c.seconds(), start, "work queued: not idle");
        c.emptied();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let during = c.seconds();
        assert!(during - start >= 0.02, "{during}");
        // A second wait inside an idle stretch does not restart it.
        c.emptied();
        c.busy();
        let after = c.seconds();
        assert!(after >= during);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(c.seconds(), after);
    }

    #[test]
    fn kernel_defines_become_nvrtc_options_and_refuse_anything_else() {
        assert_eq!(kernel_defines(""), Ok(vec![]));
        assert_eq!(
            kernel_defines("ATTEND_WARPS_MIN_BLOCKS=3, ATTEND_WARPS_LOADS=8"),
            Ok(vec![
                "-DATTEND_WARPS_MIN_BLOCKS=3".to_string(),
                "-DATTEND_WARPS_LOADS=8".to_string()
            ])
        );
        assert_eq!(kernel_defines("X=-1"), Ok(vec!["-DX=-1".to_string()]));
        // Anything that could smuggle another NVRTC option in, or is no integer, is refused.
        for bad in [
            "MIN",
            "min=3",
            "A=3 --use_fast_math",
            "A=3;B",
            "A=x",
            "_A=1",
            "A=1.5",
        ] {
            assert!(kernel_defines(bad).is_err(), "{bad}");
        }
    }
}
