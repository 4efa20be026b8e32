//! The device part of attention alone, for `bench kernels --device cuda`: one call over every
//! block of a context (what `full` attends per layer), timed as serving queues it (slot list
//! packed and uploaded, split-K kernel, combine), with the combine and the host's packing
//! timed apart, so a slow call can be told from a slow kernel.

use std::sync::Arc;
use std::time::Instant;

use attention::{BlockGeometry, KvDType};
use cudarc::driver::{DevicePtr, result as drv};
use kv_transfer::HostPool;

use super::call::{SlotList, pack};
use super::store::{CudaKvStore, Parts, Query};
use super::{CudaBackend, dev_err, htod};
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
    /// `attend_warps` (true) or the general kernel.
    pub warps: bool,
}

impl CudaBackend {
    /// Times the device attention over `spec.context` tokens of `spec.kv_heads` heads.
    pub fn bench_attention(&self, spec: &AttnBenchSpec) -> Result<AttnTiming, BackendError> {
        let sh = Arc::clone(self.shared());
        sh.bind()?;
        let geom = BlockGeometry {
            block_size: spec.block_size,
            num_kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
            dtype: spec.dtype,
        };
        let nb = spec.context.div_ceil(spec.block_size).max(1);
        let hb = geom.head_bytes();
        let slots = nb * spec.kv_heads;
        // The store page-locks a pool; nothing is copied from it here.
        let pool = HostPool::new(geom, geom.block_bytes() as u64)
            .map_err(|e| BackendError::Device(e.to_string()))?;
        let store = CudaKvStore::new(Arc::clone(&sh), geom, (slots * hb) as u64, &pool)?;
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
        .map_err(|e| dev_err("filling the bench's KV", e))?;
        let mut list = SlotList::new();
        for h in 0..spec.kv_heads {
            for b in 0..nb {
                let len = (spec.context - b * spec.block_size).min(spec.block_size);
                list.push(((h * nb + b) * hb) as i64, len.max(1));
            }
            list.end_head();
        }
        let q_len = spec.kv_heads * spec.group * spec.head_dim;
        let q: Vec<f32> = (0..q_len).map(|i| ((i % 13) as f32 - 6.0) * 0.05).collect();
        // SAFETY: written by the copy below before any kernel reads them.
        let (q_dev, out_dev) = unsafe {
            (
                sh.stream.alloc::<f32>(q_len),
                sh.stream.alloc::<f32>(q_len + spec.kv_heads * spec.group),
            )
        };
        let q_dev = q_dev.map_err(|e| dev_err("the bench's query", e))?;
        let out_dev = out_dev.map_err(|e| dev_err("the bench's output", e))?;
        let (q_at, out_at) = (
            q_dev.device_ptr(&sh.stream).0,
            out_dev.device_ptr(&sh.stream).0,
        );
        htod(q_at, super::f32_bytes(&q), &sh.stream)?;
        let lse_at = out_at + (q_len * 4) as u64;
        let old = sh.attention_ctas.load(std::sync::atomic::Ordering::Relaxed);
        if spec.ctas > 0 {
            sh.attention_ctas
                .store(spec.ctas, std::sync::atomic::Ordering::Relaxed);
        }
        let r = timed(&store, &list, spec, q_at, (out_at, lse_at));
        sh.attention_ctas
            .store(old, std::sync::atomic::Ordering::Relaxed);
        let (call_s, combine_s, parts) = r?;
        let pack_s = per_call(spec.seconds, || {
            std::hint::black_box(pack(&list, &[]));
            Ok(())
        })?;
        let up = pack(&list, &[]);
        // SAFETY: only written by the copies below.
        let up_dev = unsafe { sh.stream.alloc::<u8>(up.bytes.len()) }
            .map_err(|e| dev_err("the bench's upload buffer", e))?;
        let up_at = up_dev.device_ptr(&sh.stream).0;
        let scale = 1.0 / (spec.head_dim as f32).sqrt();
        let behind = |copy: &dyn Fn() -> Result<(), BackendError>| {
            let mut host = 0.0;
            for _ in 0..16 {
                for _ in 0..8 {
                    store.launch_attention(
                        &list,
                        Query::Device(q_at),
                        spec.group,
                        scale,
                        (out_at, lse_at),
                    )?;
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
            warps: store.takes_warps(spec.group),
        })
    }
}

/// Seconds per call of whole attention calls and of the combine alone, and how the calls
/// split the list.
fn timed(
    store: &CudaKvStore,
    list: &SlotList,
    spec: &AttnBenchSpec,
    q: u64,
    out: (u64, u64),
) -> Result<(f64, f64, Parts), BackendError> {
    let sh = store.shared();
    let sync = || sh.stream.synchronize().map_err(|e| dev_err("sync", e));
    let scale = 1.0 / (spec.head_dim as f32).sqrt();
    let call = || store.launch_attention(list, Query::Device(q), spec.group, scale, out);
    let parts = call()?;
    sync()?;
    let call_s = per_call(spec.seconds, || {
        // Queued back to back as a step's layers are; a sync every 32 calls bounds the queue.
        for _ in 0..32 {
            call()?;
        }
        sync()
    })? / 32.0;
    let combine_s = per_call(spec.seconds, || {
        for _ in 0..32 {
            store.launch_combine(&parts, out)?;
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
