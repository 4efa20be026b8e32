//! The device part of attention alone, for `bench kernels --device cuda`: one call over every
//! block of a context (what `full` attends per layer), timed as serving queues it (slot list
//! packed and uploaded, split-K kernel, combine), with the combine and the host's packing
//! timed apart, so a slow call can be told from a slow kernel.

use std::sync::Arc;
use std::time::Instant;

use attention::{BlockGeometry, KvDType};
use cudarc::driver::{CudaSlice, DevicePtr, result as drv};
use kv_transfer::HostPool;

use super::call::{SlotList, pack};
use super::store::{CudaKvStore, Parts, Query};
use super::{CudaBackend, Shared, dev_err, htod};
use crate::backend::BackendError;

/// One configuration to time.
#[derive(Debug, Clone, Copy)]
pub struct AttnBenchSpec {
    pub dtype: KvDType,
    pub block_size: usize,
    pub kv_heads: usize,
    pub group: usize,
    pub head_dim: usize,
    /// Tokens per KV head, all attended.
    pub context: usize,
    /// CUDA blocks the split aims for (0: the backend's setting).
    pub ctas: usize,
    /// Seconds to spend on each of the timings.
    pub seconds: f64,
}

/// What one configuration measured.
#[derive(Debug, Clone, Copy)]
pub struct AttnTiming {
    /// One whole call as serving queues it, calls back to back.
    pub call_s: f64,
    /// The combine kernel alone.
    pub combine_s: f64,
    /// Packing the slot list on the host (part of `call_s` where the host is the slower side).
    pub pack_s: f64,
    /// Host time to queue the packed list's copy from pageable memory behind eight queued
    /// calls: a copy that waits for the stream takes about their time, one that does not a
    /// few microseconds.
    pub upload_s: f64,
    /// The same through the page-locked upload ring, as a call queues it now.
    pub upload_ring_s: f64,
    /// KV bytes one call reads.
    pub kv_bytes: u64,
    /// CUDA blocks the split-K kernel ran, and the splits per head.
    pub ctas: usize,
    pub splits: usize,
    /// The kernel the call took: `attend_tc`, `attend_warps` or `split`.
    pub kernel: &'static str,
    /// It prefetched its next loads into L2 (`DECODE_NODE_ATTENTION_PREFETCH`, or timed at
    /// start).
    pub prefetch: bool,
}

/// One attention call over every block of a context, all of it resident, with its query and
/// output on the device: what `bench kernels --device cuda` times, and what the start-up
/// choice of attention kernel times (`attend_pick`).
pub(super) struct Synthetic {
    // Dropped in this order: the store before the pool it page-locked.
    pub(super) store: CudaKvStore,
    _pool: HostPool,
    pub(super) list: SlotList,
    q: CudaSlice<f32>,
    out: CudaSlice<f32>,
    group: usize,
    scale: f32,
}

impl Synthetic {
    /// `context` tokens of each of `geom`'s KV heads, attended by `group` query heads each.
    pub(super) fn new(
        sh: &Arc<Shared>,
        geom: BlockGeometry,
        group: usize,
        context: usize,
    ) -> Result<Self, BackendError> {
        sh.bind()?;
        let nb = context.div_ceil(geom.block_size).max(1);
        let hb = geom.head_bytes();
        let heads = geom.num_kv_heads;
        let slots = nb * heads;
        // The store page-locks a pool; nothing is copied from it here.
        let pool = HostPool::new(geom, geom.block_bytes() as u64)
            .map_err(|e| BackendError::Device(e.to_string()))?;
        let store = CudaKvStore::new(Arc::clone(sh), geom, (slots * hb) as u64, &pool)?;
        if store.slot_count() < slots {
            return Err(BackendError::DeviceFull(format!(
                "{slots} KV blocks of {hb} bytes do not fit on the device"
            )));
        }
        // Small finite values in every dtype (0x3c3c: 0.0115 in bf16, 1.06 in f16).
        // SAFETY: the range is the arena's first `slots` slots.
        unsafe {
            drv::memset_d8_async(store.slot_addr(0), 0x3c, slots * hb, sh.stream.cu_stream())
        }
        .map_err(|e| dev_err("filling the synthetic KV", e))?;
        let mut list = SlotList::new();
        for h in 0..heads {
            for b in 0..nb {
                let len = (context - b * geom.block_size).min(geom.block_size);
                list.push(((h * nb + b) * hb) as i64, len.max(1));
            }
            list.end_head();
        }
        let q_len = heads * group * geom.head_dim;
        let q_host: Vec<f32> = (0..q_len).map(|i| ((i % 13) as f32 - 6.0) * 0.05).collect();
        // SAFETY: written by the copy below before any kernel reads them.
        let (q, out) = unsafe {
            (
                sh.stream.alloc::<f32>(q_len),
                sh.stream.alloc::<f32>(q_len + heads * group),
            )
        };
        let q = q.map_err(|e| dev_err("the synthetic query", e))?;
        let out = out.map_err(|e| dev_err("the synthetic output", e))?;
        htod(
            q.device_ptr(&sh.stream).0,
            super::f32_bytes(&q_host),
            &sh.stream,
        )?;
        Ok(Self {
            store,
            _pool: pool,
            list,
            q,
            out,
            group,
            scale: 1.0 / (geom.head_dim as f32).sqrt(),
        })
    }

    /// Calls from now on as of `group` query heads a KV head (at most the one it was made
    /// for: the query and output are that large).
    pub(super) fn set_group(&mut self, group: usize) {
        let made_for = self.q.len() / (self.list.heads() * self.store.geom().head_dim).max(1);
        self.group = group.min(made_for);
    }

    /// Where the outputs and their log-sum-exps go.
    fn out_at(&self) -> (u64, u64) {
        let stream = &self.store.shared().stream;
        let at = self.out.device_ptr(stream).0;
        let q_len = self.list.heads() * self.group * self.store.geom().head_dim;
        (at, at + (q_len * 4) as u64)
    }

    /// Queues the call as serving does (list packed and uploaded, split-K, combine).
    pub(super) fn call(&self) -> Result<Parts, BackendError> {
        let q = self.q.device_ptr(&self.store.shared().stream).0;
        self.store.launch_attention(
            &self.list,
            Query::Device(q),
            self.group,
            self.scale,
            self.out_at(),
        )
    }
}

impl CudaBackend {
    /// Times the device attention over `spec.context` tokens of `spec.kv_heads` heads.
    pub fn bench_attention(&self, spec: &AttnBenchSpec) -> Result<AttnTiming, BackendError> {
        let sh = Arc::clone(self.shared());
        let geom = BlockGeometry {
            block_size: spec.block_size,
            num_kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
            dtype: spec.dtype,
        };
        // The kernel the node would take for this shape (timed at its first call).
        super::attend_pick::pick(&sh, &geom);
        let call = Synthetic::new(&sh, geom, spec.group, spec.context)?;
        let old = sh.attention_ctas.load(std::sync::atomic::Ordering::Relaxed);
        if spec.ctas > 0 {
            sh.attention_ctas
                .store(spec.ctas, std::sync::atomic::Ordering::Relaxed);
        }
        let r = timed(&call, spec.seconds);
        sh.attention_ctas
            .store(old, std::sync::atomic::Ordering::Relaxed);
        let (call_s, combine_s, parts) = r?;
        let pack_s = per_call(spec.seconds, || {
            std::hint::black_box(pack(&call.list, &[]));
            Ok(())
        })?;
        let up = pack(&call.list, &[]);
        // SAFETY: only written by the copies below.
        let up_dev = unsafe { sh.stream.alloc::<u8>(up.bytes.len()) }
            .map_err(|e| dev_err("the bench's upload buffer", e))?;
        let up_at = up_dev.device_ptr(&sh.stream).0;
        let behind = |copy: &dyn Fn() -> Result<(), BackendError>| {
            let mut host = 0.0;
            for _ in 0..16 {
                for _ in 0..8 {
                    call.call()?;
                }
                let t = Instant::now();
                copy()?;
                host += t.elapsed().as_secs_f64();
                sh.stream.synchronize().map_err(|e| dev_err("sync", e))?;
            }
            Ok::<_, BackendError>(host / 16.0)
        };
        let upload_s = behind(&|| htod(up_at, &up.bytes, &sh.stream))?;
        let upload_ring_s = behind(&|| sh.upload(up_at, &up.bytes))?;
        Ok(AttnTiming {
            call_s,
            combine_s,
            pack_s,
            upload_s,
            upload_ring_s,
            kv_bytes: (spec.kv_heads * spec.context * spec.head_dim * 2 * spec.dtype.size()) as u64,
            ctas: parts.splits * parts.heads,
            splits: parts.splits,
            kernel: call.store.kernel_name(spec.group),
            prefetch: call.store.prefetches(spec.group),
        })
    }
}

/// Seconds per call of whole attention calls and of the combine alone, and how the calls
/// split the list.
fn timed(call: &Synthetic, seconds: f64) -> Result<(f64, f64, Parts), BackendError> {
    let sh = call.store.shared();
    let sync = || sh.stream.synchronize().map_err(|e| dev_err("sync", e));
    let parts = call.call()?;
    sync()?;
    let call_s = per_call(seconds, || {
        // Queued back to back as a step's layers are; a sync every 32 calls bounds the queue.
        for _ in 0..32 {
            call.call()?;
        }
        sync()
    })? / 32.0;
    let combine_s = per_call(seconds, || {
        for _ in 0..32 {
            call.store.launch_combine(&parts, call.out_at())?;
        }
        sync()
    })? / 32.0;
    Ok((call_s, combine_s, parts))
}

/// Mean seconds of `f` over at least `seconds` (at least 3 runs, after one warm-up).
fn per_call(
    seconds: f64,
    mut f: impl FnMut() -> Result<(), BackendError>,
) -> Result<f64, BackendError> {
    f()?;
    let t = Instant::now();
    let mut n = 0u32;
    while n < 3 || t.elapsed().as_secs_f64() < seconds {
        f()?;
        n += 1;
    }
    Ok(t.elapsed().as_secs_f64() / f64::from(n))
}
