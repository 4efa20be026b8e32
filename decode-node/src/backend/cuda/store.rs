//! Hot KV blocks in GPU memory: one arena of head-block slots shared by every sequence, a
//! slot table per sequence, the device part of attention over it, and recall copies on their
//! own stream.
//!
//! A slot holds one (layer, KV head, block) in the host layout (K transposed, then V), so a
//! copy is one contiguous `head_bytes` transfer from the page-locked host pool. A slot
//! remembers how many tokens it holds: the newest block grows by one token a step and is
//! copied again when attended with more tokens than it holds.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use attention::{BlockGeometry, DeviceBlock, KvSource, Partial};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, result as drv, sys};
use kv_transfer::HostPool;

use super::call::{SlotList, SplitK, pack, partials, prefetch_flags};
use super::driver::WARPS_PER_BLOCK;
use super::sketch::{SeqSketch, SketchQuery};
use super::slots::{Fill, NoSlot, SlotTable};
use super::{DevBuf, Shared, dev_err, htod};
use crate::backend::{BackendError, DeviceKv, DeviceSeq, Scored, SketchCall};

/// Largest GQA group and head dimension the attention kernel takes.
const MAX_GROUP: usize = 8;
const MAX_HEAD_DIM: usize = 128;

/// Which stream a copy goes on.
#[derive(Debug, Clone, Copy)]
enum Lane {
    /// Before this call's kernels, in order with them.
    Main,
    /// Recall, overlapping the main stream.
    Recall,
}

/// Where an attention call's query is.
#[derive(Debug, Clone, Copy)]
pub(super) enum Query<'a> {
    /// On the host: it goes up with the call's slot list.
    Host(&'a [f32]),
    /// Already on the device (a resident layer's q rows), at this address.
    Device(u64),
}

/// Scratch of the attention calls, reused in stream order by one sequence after another
/// (each sequence's output has its own buffer: it is read after later sequences ran).
#[derive(Debug, Default)]
struct Scratch {
    io: DevBuf,
    parts: DevBuf,
}

/// The arena and what every sequence shares.
pub(crate) struct CudaKvStore {
    shared: Arc<Shared>,
    geom: BlockGeometry,
    _arena: CudaSlice<u8>,
    base: u64,
    slots: usize,
    free: Mutex<Vec<u32>>,
    scratch: Mutex<Scratch>,
    /// Keeps the pool mapped while it is registered.
    pool: HostPool,
    pinned: bool,
    /// The pool's host start, length and device address, where it is mapped.
    mapped: Option<(usize, usize, u64)>,
    /// Copy tables of `gather_copy`, one per stream (a stream's uses are ordered).
    gather_main: Mutex<DevBuf>,
    gather_recall: Mutex<DevBuf>,
}

impl std::fmt::Debug for CudaKvStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKvStore")
            .field("slots", &self.slots)
            .field("pinned", &self.pinned)
            .finish()
    }
}

impl CudaKvStore {
    /// Allocates `capacity_bytes` of head-block slots (capped by free device memory) and
    /// page-locks `pool`.
    pub(crate) fn new(
        shared: Arc<Shared>,
        geom: BlockGeometry,
        capacity_bytes: u64,
        pool: &HostPool,
    ) -> Result<Self, BackendError> {
        if geom.head_dim > MAX_HEAD_DIM {
            return Err(BackendError::Unsupported(format!(
                "head_dim {} (the device attention kernel takes up to {MAX_HEAD_DIM})",
                geom.head_dim
            )));
        }
        shared.bind()?;
        let hb = geom.head_bytes() as u64;
        let (free_mem, _) = shared
            .ctx
            .mem_get_info()
            .map_err(|e| dev_err("reading free device memory", e))?;
        // Leave room for scratch and the allocator.
        let room = (free_mem as u64).saturating_sub(1 << 30);
        let bytes = capacity_bytes.min(room);
        let slots = usize::try_from(bytes / hb.max(1))
            .unwrap_or(0)
            .min(u32::MAX as usize);
        if slots == 0 {
            return Err(BackendError::DeviceFull(format!(
                "no room for one KV block of {hb} bytes on the device ({free_mem} bytes free)"
            )));
        }
        // SAFETY: slots are written (copied from the host) before any kernel reads them.
        let arena = unsafe { shared.stream.alloc::<u8>(slots * hb as usize) }
            .map_err(|e| dev_err(&format!("{} bytes of device KV", slots as u64 * hb), e))?;
        let base = arena.device_ptr(&shared.stream).0;
        let (ptr, len) = pool.region();
        // Page-locked, the pool copies to the device by DMA without staging and overlaps
        // compute. PORTABLE: pinned for every context, not only this one.
        let pinned = len > 0
            // SAFETY: the range is one live mapping, kept alive by the `pool` clone we hold
            // and unregistered in `drop` before that clone goes.
            && match unsafe {
                sys::cuMemHostRegister_v2(
                    ptr.as_ptr().cast(),
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                )
            }
            .result()
            {
                Ok(()) => true,
                // Another arena of this process holds the pool page-locked (and would unlock
                // it when it goes): this one stages its copies, which is slower, not wrong.
                Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => {
                    tracing::info!(bytes = len, "the host KV pool is page-locked by another device KV arena; this arena's copies are staged");
                    false
                }
                Err(e) => {
                    tracing::warn!(error = ?e, bytes = len, "could not page-lock the host KV pool; copies to the device will be staged");
                    false
                }
            };
        // The pool as the device addresses it (mapped): recall gathers read it directly.
        let mut pool_dev: u64 = 0;
        let mapped = pinned
            // SAFETY: the range was registered with DEVICEMAP just above.
            && unsafe { sys::cuMemHostGetDevicePointer_v2(&mut pool_dev, ptr.as_ptr().cast(), 0) }
                .result()
                .is_ok();
        tracing::info!(
            slots,
            bytes = slots as u64 * hb,
            pinned,
            "device KV arena allocated"
        );
        Ok(Self {
            shared,
            geom,
            _arena: arena,
            base,
            slots,
            free: Mutex::new((0..slots as u32).rev().collect()),
            scratch: Mutex::new(Scratch::default()),
            pool: pool.clone(),
            pinned,
            mapped: mapped.then_some((ptr.as_ptr() as usize, len, pool_dev)),
            gather_main: Mutex::new(DevBuf::default()),
            gather_recall: Mutex::new(DevBuf::default()),
        })
    }

    /// A free arena slot, taken.
    pub(super) fn take_slot(&self) -> Option<u32> {
        self.free.lock().ok()?.pop()
    }

    /// The arena is full.
    pub(super) fn full(&self) -> BackendError {
        full(self.slots)
    }

    /// The block geometry of the slots.
    pub(super) fn geom(&self) -> &BlockGeometry {
        &self.geom
    }

    /// The device this arena is on.
    pub(super) fn shared(&self) -> &Shared {
        &self.shared
    }

    pub(super) fn give_back(&self, slots: impl IntoIterator<Item = u32>) {
        if let Ok(mut f) = self.free.lock() {
            f.extend(slots);
        }
    }

    /// The stream of `lane` and the buffer of its gather tables (a stream's uses of its own
    /// buffer are ordered; the two lanes must not share one).
    fn lane(&self, lane: Lane) -> (&Arc<CudaStream>, &Mutex<DevBuf>) {
        match lane {
            Lane::Main => (&self.shared.stream, &self.gather_main),
            Lane::Recall => (&self.shared.recall, &self.gather_recall),
        }
    }

    /// Copies host head blocks to their slots on `lane`: whole ones with one `gather_copy`
    /// launch where the pool is mapped (a block is 16 KiB: a driver call per copy would cost
    /// more than the copy), else one by one; the new tokens of grown ones with one
    /// `copy_tokens` launch where the pool is mapped, else whole.
    fn copy_in(&self, copies: &Copies<'_>, lane: Lane) -> Result<(), BackendError> {
        let mut whole = copies.whole.clone();
        if !copies.tails.is_empty() && !self.copy_tails(&copies.tails, lane)? {
            whole.extend(copies.tails.iter().map(|&(dst, src, _, _)| (dst, src)));
        }
        let engine = self.shared.engine_copies.load(Ordering::Acquire);
        if whole.is_empty()
            || (whole.len() > 2
                && ((engine && self.batch_copy(&whole, lane)?) || self.gather(&whole, lane)?))
        {
            return Ok(());
        }
        let stream = self.lane(lane).0;
        for (dst, src) in &whole {
            htod(*dst, src, stream)?;
        }
        Ok(())
    }

    /// The new tokens `[from, to)` of each `(dst, src, from, to)` with one `copy_tokens`
    /// launch reading the mapped pool; false (nothing done) where that does not apply.
    fn copy_tails(&self, tails: &[Tail<'_>], lane: Lane) -> Result<bool, BackendError> {
        let Some((host, len, dev)) = self.mapped else {
            return Ok(false);
        };
        let hb = self.geom.head_bytes();
        let bs = self.geom.block_size;
        let fits = |&(_, src, from, to): &Tail<'_>| {
            let p = src.as_ptr() as usize;
            p >= host && p + src.len() <= host + len && src.len() == hb && from < to && to <= bs
        };
        if !tails.iter().all(fits) {
            return Ok(false);
        }
        let n = tails.len();
        let mut table = Vec::with_capacity(n * 32);
        for &(_, src, _, _) in tails {
            table.extend_from_slice(&(dev + (src.as_ptr() as usize - host) as u64).to_le_bytes());
        }
        for &(dst, _, _, _) in tails {
            table.extend_from_slice(&dst.to_le_bytes());
        }
        for &(_, _, from, _) in tails {
            table.extend_from_slice(&(from as u64).to_le_bytes());
        }
        for &(_, _, _, to) in tails {
            table.extend_from_slice(&(to as u64).to_le_bytes());
        }
        let (stream, t) = self.upload_table(lane, &table)?;
        let (count, d, b, dt) = (
            n as i32,
            self.geom.head_dim as i32,
            bs as i32,
            super::dtype_code(self.geom.dtype),
        );
        // SAFETY: the table holds n sources (mapped pool ranges of a whole head block,
        // checked above), n slots we own, and token ranges within a block.
        unsafe {
            super::launch_on(
                stream,
                &self.shared.k.copy_tokens,
                (n as u32, 1),
                128,
                &[&t, &count, &d, &b, &dt],
            )?;
        }
        Ok(true)
    }

    /// Queues the copy of a launch's address table to `lane`'s table buffer (the lane's later
    /// uses of it are ordered after the launch that reads it); its stream and the address.
    fn upload_table(
        &self,
        lane: Lane,
        table: &[u8],
    ) -> Result<(&Arc<CudaStream>, u64), BackendError> {
        let (stream, buf) = self.lane(lane);
        let mut buf = buf
            .lock()
            .map_err(|_| BackendError::Device("gather table lock poisoned".into()))?;
        let t = buf.ptr(stream, table.len())?;
        match lane {
            Lane::Main => self.shared.upload(t, table)?,
            // The recall stream waits for nothing of the main stream's here.
            Lane::Recall => htod(t, table, stream)?,
        }
        Ok((stream, t))
    }

    /// Copies with one `cuMemcpyBatchAsync` on `lane`'s stream (#21 item 7): the copy engines
    /// move the blocks from the page-locked pool, with no kernel reading PCIe on SMs the step
    /// needs and no host copy gathering them first. False (nothing done) where the driver has
    /// no batched copies (before CUDA 13) or a source is outside the page-locked pool.
    fn batch_copy(&self, copies: &[(u64, &[u8])], lane: Lane) -> Result<bool, BackendError> {
        let Some((host, len, dev)) = self.mapped else {
            return Ok(false);
        };
        let inside = |c: &(u64, &[u8])| {
            let p = c.1.as_ptr() as usize;
            p >= host && p + c.1.len() <= host + len
        };
        if !super::driver::has_batch_copy() || !copies.iter().all(inside) {
            return Ok(false);
        }
        let mut dsts: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.0).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = copies
            .iter()
            .map(|c| dev + (c.1.as_ptr() as usize - host) as u64)
            .collect();
        let mut sizes: Vec<usize> = copies.iter().map(|c| c.1.len()).collect();
        let at = |type_, id| sys::CUmemLocation { type_, id };
        let mut attrs = [sys::CUmemcpyAttributes {
            // The host writes a block before it is copied and not while the copy is queued
            // (the pool's contract for every copy to the device).
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: at(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, 0),
            dstLocHint: at(
                sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                self.shared.ordinal as i32,
            ),
            flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
        }];
        let mut attr_at = [0usize];
        let stream = self.lane(lane).0;
        // SAFETY: n destinations (slots we own) and n sources (page-locked pool ranges,
        // checked above) of the given sizes; one attribute for all of them.
        unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                copies.len(),
                attrs.as_mut_ptr(),
                attr_at.as_mut_ptr(),
                1,
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(|e| dev_err("batched copies to the device", e))?;
        Ok(true)
    }

    /// For the start-up check: copies `sources` (page-locked pool ranges of one head block
    /// each) to slots 0, 1, ... with one batched copy on the recall stream and reads them
    /// back; the bytes that differ. Unsupported where batched copies are not available.
    pub(super) fn batch_copy_mismatches(&self, sources: &[&[u8]]) -> Result<usize, BackendError> {
        let hb = self.geom.head_bytes();
        if sources.len() > self.slots || sources.iter().any(|s| s.len() != hb) {
            return Err(BackendError::Unsupported(format!(
                "{} copies of a head block into {} slots",
                sources.len(),
                self.slots
            )));
        }
        let copies: Vec<(u64, &[u8])> = (0..)
            .zip(sources)
            .map(|(i, s)| (self.slot_addr(i), *s))
            .collect();
        if !self.batch_copy(&copies, Lane::Recall)? {
            return Err(BackendError::Unsupported(
                "no batched copies: a driver before CUDA 13, or the pool is not page-locked".into(),
            ));
        }
        let recall = &self.shared.recall;
        recall
            .synchronize()
            .map_err(|e| dev_err("waiting for the batched copies", e))?;
        let mut differ = 0;
        let mut back = vec![0u8; hb];
        for (dst, src) in &copies {
            // SAFETY: a slot of `hb` bytes; the copy into it has completed.
            unsafe { drv::memcpy_dtoh_sync(&mut back, *dst) }
                .map_err(|e| dev_err("reading a slot back", e))?;
            differ += back.iter().zip(src.iter()).filter(|(a, b)| a != b).count();
        }
        Ok(differ)
    }

    /// Copies with one `gather_copy` launch reading the mapped pool; false (nothing done)
    /// where that does not apply (pool not mapped, a source outside it, odd sizes).
    fn gather(&self, copies: &[(u64, &[u8])], lane: Lane) -> Result<bool, BackendError> {
        let Some((host, len, dev)) = self.mapped else {
            return Ok(false);
        };
        let bytes = copies[0].1.len();
        let inside = |c: &(u64, &[u8])| {
            let p = c.1.as_ptr() as usize;
            p >= host && p + c.1.len() <= host + len && c.1.len() == bytes && p.is_multiple_of(16)
        };
        if !bytes.is_multiple_of(16) || !copies.iter().all(inside) {
            return Ok(false);
        }
        let mut table = Vec::with_capacity(copies.len() * 16);
        for c in copies {
            table.extend_from_slice(&(dev + (c.1.as_ptr() as usize - host) as u64).to_le_bytes());
        }
        for c in copies {
            table.extend_from_slice(&c.0.to_le_bytes());
        }
        let (stream, t) = self.upload_table(lane, &table)?;
        let n = copies.len() as i32;
        let srcs = t;
        let dsts = t + (copies.len() * 8) as u64;
        let b = bytes as i64;
        // SAFETY: the table holds n source and n destination addresses: mapped pool ranges
        // of `bytes` bytes (checked above) and slots we own.
        unsafe {
            super::launch_on(
                stream,
                &self.shared.k.gather_copy,
                (copies.len() as u32, 1),
                256,
                &[&srcs, &dsts, &n, &b],
            )?;
        }
        Ok(true)
    }

    pub(super) fn slot_addr(&self, slot: u32) -> u64 {
        self.base + slot as u64 * self.geom.head_bytes() as u64
    }
}

impl CudaKvStore {
    /// The kernel attention calls of `group` take over this store's blocks, the fewest blocks
    /// one of its CUDA blocks should take and its name; `None`: the general kernel. `attend_tc` where the group takes it ([`Shared::tc_groups`]), else
    /// `attend_warps` where it is on ([`Shared::warps_on`]); either only where built for the
    /// shape.
    fn fast_kernel(&self, group: usize) -> Option<(&CudaFunction, usize, &'static str)> {
        let tc = group < 16 && self.shared.tc_groups.load(Ordering::Acquire) & (1 << group) != 0;
        self.fast_kernel_as(group, tc)
    }

    /// [`CudaKvStore::fast_kernel`] with the group's `attend_tc` bit taken as `tc`.
    fn fast_kernel_as(
        &self,
        group: usize,
        tc: bool,
    ) -> Option<(&CudaFunction, usize, &'static str)> {
        let sh = &*self.shared;
        let g = &self.geom;
        if let Some(f) = tc
            .then(|| sh.k.tc(g.dtype, g.block_size, group, g.head_dim))
            .flatten()
        {
            // As few as `attend_warps`' blocks a CUDA block, though a warp takes 64 tokens at a
            // time: a short list (scout's device part) then runs in twice the CUDA blocks with
            // half their warps idle, where a whole share per warp would halve its parallelism.
            return Some((f, WARPS_PER_BLOCK, "attend_tc"));
        }
        if !sh.warps_on.load(Ordering::Acquire) {
            return None;
        }
        let f = sh.k.warps(g.dtype, g.block_size, group, g.head_dim)?;
        Some((f, WARPS_PER_BLOCK, "attend_warps"))
    }

    /// Queues the split-K attention over `list` with the query `q` (`[hk][group][d]`) and its
    /// combine into `out`: `[hk][group][d]` outputs at the first address, their base-2
    /// log-sum-exps `[hk][group]` at the second, `hk` being the list's heads. The list (and a
    /// host query) go up in one upload; nothing waits.
    pub(super) fn launch_attention(
        &self,
        list: &SlotList,
        q: Query<'_>,
        group: usize,
        scale: f32,
        out: (u64, u64),
    ) -> Result<Parts, BackendError> {
        let mut scratch = self
            .scratch
            .lock()
            .map_err(|_| BackendError::Device("scratch lock poisoned".into()))?;
        let parts = self.launch_split(&mut scratch, list, q, group, scale)?;
        self.launch_combine(&parts, out)?;
        Ok(parts)
    }

    /// The kernel attention calls of `group` take: `attend_tc`, `attend_warps` or `split`.
    pub(super) fn kernel_name(&self, group: usize) -> &'static str {
        self.fast_kernel(group).map_or("split", |(_, _, name)| name)
    }

    /// The kernel calls of `group` would take with the group's `attend_tc` bit as `tc`.
    pub(super) fn kernel_name_as(&self, group: usize, tc: bool) -> &'static str {
        self.fast_kernel_as(group, tc)
            .map_or("split", |(_, _, name)| name)
    }

    /// True where attention calls of `group` prefetch their next loads: a fast kernel whose
    /// group's bit of [`Shared::prefetch_groups`] is set.
    pub(super) fn prefetches(&self, group: usize) -> bool {
        self.fast_kernel(group).is_some()
            && prefetch_flags(self.shared.prefetch_groups.load(Ordering::Acquire), group) != 0
    }

    /// Slots in the arena.
    pub(super) fn slot_count(&self) -> usize {
        self.slots
    }

    /// Queues the split-K kernel over `list`; where its partials are.
    fn launch_split(
        &self,
        scratch: &mut Scratch,
        list: &SlotList,
        q: Query<'_>,
        group: usize,
        scale: f32,
    ) -> Result<Parts, BackendError> {
        let sh = &*self.shared;
        // Every KV head of the list, a sequence's or (resident) a batch's.
        let (hk, d) = (list.heads(), self.geom.head_dim);
        let target = sh.attention_ctas.load(Ordering::Relaxed);
        let (kernel, mut split, mut flags, min_chunk) = match self.fast_kernel(group) {
            Some((f, min_chunk, _)) => (
                f,
                SplitK::at_least(target, hk, list.longest_head(), min_chunk),
                prefetch_flags(sh.prefetch_groups.load(Ordering::Acquire), group),
                min_chunk,
            ),
            None => (
                &sh.k.split,
                SplitK::new(target, hk, list.longest_head()),
                0,
                1,
            ),
        };
        if !list.picked.is_empty() {
            // Heads laid out on the device: the grid as for the longest a head may be, each
            // head's entries cut evenly over it (a chunk of the bound would leave most of a
            // head's splits idle where a batch's heads share the grid).
            flags |= super::call::ATTEND_SPREAD;
            split.chunk = min_chunk.min(split.chunk);
        }
        let up = pack(
            list,
            match q {
                Query::Host(q) => q,
                Query::Device(_) => &[],
            },
        );
        let io_dev = scratch.io.ptr(&sh.stream, up.bytes.len())?;
        sh.upload(io_dev, &up.bytes)?;
        let part_floats = hk * split.splits * group * (d + 1);
        let parts_dev = scratch.parts.ptr(&sh.stream, part_floats * 4)?;
        let part_lse = parts_dev + (hk * split.splits * group * d * 4) as u64;
        let (offs_dev, lens_dev, heads_dev) = (
            io_dev,
            io_dev + up.at_lens as u64,
            io_dev + up.at_heads as u64,
        );
        let q_dev = match q {
            Query::Host(_) => io_dev + up.at_q as u64,
            Query::Device(at) => at,
        };
        if !list.picked.is_empty() {
            let jobs = io_dev + up.at_jobs as u64;
            let (slot_bytes, bs) = (self.geom.head_bytes() as i64, self.geom.block_size as i32);
            // SAFETY: the jobs (uploaded above) name ranges of this list, laid out by
            // `SlotList::picked` within its bounds, picks written before this in stream order
            // (`top_blocks`) and a block table of `stride` entries a head at least to the cut's
            // end; each table entry names an arena slot or none.
            unsafe {
                sh.launch(
                    &sh.k.place_picks,
                    (list.picked.len() as u32, 1),
                    super::call::PLACE_THREADS,
                    &[&offs_dev, &lens_dev, &heads_dev, &jobs, &slot_bytes, &bs],
                )?;
            }
        }
        let dtype = super::dtype_code(self.geom.dtype);
        let (g, dd, b, c, s) = (
            group as i32,
            d as i32,
            self.geom.block_size as i32,
            split.chunk as i32,
            split.splits as i32,
        );
        // SAFETY: every pointer names a range sized above; the arena offsets are slots the
        // calling sequence owns.
        unsafe {
            sh.launch(
                kernel,
                (split.splits as u32, hk as u32),
                128,
                &[
                    &self.base, &offs_dev, &lens_dev, &heads_dev, &q_dev, &g, &dd, &b, &dtype,
                    &scale, &c, &s, &parts_dev, &part_lse, &flags,
                ],
            )?;
        }
        Ok(Parts {
            out: parts_dev,
            lse: part_lse,
            heads: hk,
            group,
            splits: split.splits,
        })
    }

    /// Queues the merge of `parts` into `[heads][group][d]` outputs at the first address and
    /// their base-2 log-sum-exps `[heads][group]` at the second.
    pub(super) fn launch_combine(
        &self,
        parts: &Parts,
        (out_dev, lse_dev): (u64, u64),
    ) -> Result<(), BackendError> {
        let sh = &*self.shared;
        let (s, g, d) = (
            parts.splits as i32,
            parts.group as i32,
            self.geom.head_dim as i32,
        );
        // SAFETY: `parts` was sized for these heads, splits and group (`launch_split`), and
        // the caller sized the outputs for them; splits <= MAX_SPLITS (`SplitK`).
        unsafe {
            sh.launch(
                &sh.k.combine,
                ((parts.heads * parts.group) as u32, 1),
                128,
                &[&parts.out, &parts.lse, &s, &g, &d, &out_dev, &lse_dev],
            )
        }
    }
}

/// Where a split-K launch left its partials, and their shape.
#[derive(Debug, Clone, Copy)]
pub(super) struct Parts {
    out: u64,
    lse: u64,
    pub(super) heads: usize,
    group: usize,
    pub(super) splits: usize,
}

/// Device addresses of a resident layer's batch (see [`CudaKvStore::launch_resident`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct ResidentRows {
    /// Query rows `[rows * hk][group][d]`, the token's own K and V rows `[rows * hk][d]`.
    pub(super) q: u64,
    pub(super) k: u64,
    pub(super) v: u64,
    /// The attention output `[rows * hk][group][d]` and its lse2 `[rows * hk][group]`.
    pub(super) out: u64,
    pub(super) lse: u64,
    pub(super) group: usize,
}

impl CudaKvStore {
    /// Queues a resident layer's attention for the whole batch: `list` holds every sequence's
    /// KV heads one after another (each a head of the call), one split-K launch and its
    /// combine over them all, then one `merge_self` for every query head's own key. Nothing
    /// waits.
    pub(super) fn launch_resident(
        &self,
        list: &SlotList,
        at: ResidentRows,
        scale: f32,
    ) -> Result<(), BackendError> {
        let sh = &*self.shared;
        let heads = list.heads();
        let empty = i32::from(list.is_empty());
        if !list.is_empty() {
            self.launch_attention(list, Query::Device(at.q), at.group, scale, (at.out, at.lse))?;
        }
        let (g, d) = (at.group as i32, self.geom.head_dim as i32);
        // SAFETY: `at` names ranges the caller sized for `heads` x group query heads of d
        // (and `heads` K and V rows of d).
        unsafe {
            sh.launch(
                &sh.k.merge_self,
                ((heads * at.group) as u32, 1),
                64,
                &[
                    &at.out, &at.lse, &at.q, &at.k, &at.v, &g, &d, &scale, &empty,
                ],
            )
        }
    }
}

impl Drop for CudaKvStore {
    fn drop(&mut self) {
        let _ = self.shared.bind();
        let _ = self.shared.stream.synchronize();
        let _ = self.shared.recall.synchronize();
        if self.pinned {
            let (ptr, _) = self.pool.region();
            // SAFETY: registered in `new`, still mapped (we hold `pool`).
            if let Err(e) = unsafe { sys::cuMemHostUnregister(ptr.as_ptr().cast()) }.result() {
                tracing::warn!(error = ?e, "unregistering the host KV pool failed");
            }
        }
    }
}

impl DeviceKv for CudaKvStore {
    fn host_pool_pinned(&self) -> bool {
        self.pinned
    }

    fn keeps_sketch(&self, group: usize) -> bool {
        super::sketch::supported(&self.geom, group) && self.shared.sketch_on.load(Ordering::Acquire)
    }

    fn capacity_bytes(&self) -> u64 {
        self.slots as u64 * self.geom.head_bytes() as u64
    }

    fn new_seq(self: Arc<Self>, num_layers: usize, blocks_per_head: usize) -> Box<dyn DeviceSeq> {
        let hk = self.geom.num_kv_heads;
        Box::new(CudaSeq {
            table: SlotTable::new(num_layers * hk, blocks_per_head, self.geom.block_size),
            recall_events: vec![None; num_layers],
            out: DevBuf::default(),
            pending: None,
            main_mark: None,
            sketch: SeqSketch::default(),
            block_table: DevBuf::default(),
            table_stride: 0,
            store: self,
        })
    }
}

/// A resident layer's query rows in device memory (`rows` of `width` floats at `addr`, normed
/// and rotated), handed to the engine before they come back so each sequence's device scores
/// its blocks by them in the same wait (`DeviceSeq::queue_sketch_scores_by`). The stream
/// orders the scoring after the kernels that write them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeviceQueryRows {
    pub(crate) addr: u64,
    pub(crate) width: usize,
    pub(crate) rows: usize,
}

/// A recorded event on the recall stream.
#[derive(Debug, Clone, Copy)]
struct Event(sys::CUevent);
// SAFETY: a CUevent is a handle usable from any thread of the context.
unsafe impl Send for Event {}

/// A grown block's copy: slot address, the whole host head block, and the new tokens'
/// range `[from, to)`.
type Tail<'a> = (u64, &'a [u8], usize, usize);

/// The copies a call queues: whole head blocks, and the new tokens of grown ones.
#[derive(Debug, Default)]
struct Copies<'a> {
    whole: Vec<(u64, &'a [u8])>,
    tails: Vec<Tail<'a>>,
}

impl Copies<'_> {
    fn is_empty(&self) -> bool {
        self.whole.is_empty() && self.tails.is_empty()
    }
}

/// One sequence's slots.
#[derive(Debug)]
pub(super) struct CudaSeq {
    store: Arc<CudaKvStore>,
    /// Slots by `layer * num_kv_heads + head` and block.
    table: SlotTable,
    /// Per layer: recall copies the next attend of that layer must be ordered after.
    recall_events: Vec<Option<Event>>,
    /// This sequence's attention output on the device.
    out: DevBuf,
    /// What the last submit left for collect.
    pending: Option<Pending>,
    /// Marks the main stream for the recall stream to wait on.
    main_mark: Option<Event>,
    /// The keys' 4-bit sketch, for `--block-scorer sketch` (empty until first scored).
    sketch: SeqSketch,
    /// The device's copy of [`SlotTable`]'s block table, `[layer * num_kv_heads + head]`
    /// rows of `table_stride` arena slots (`slots::NOT_WHOLE` where none holds the block
    /// whole), which `place_picks` reads for a layer planned on the device.
    block_table: DevBuf,
    table_stride: usize,
}

/// A submitted device part, for [`DeviceSeq::collect`].
#[derive(Debug)]
enum Pending {
    /// No block on the device: every head's partial is empty.
    Empty { hk: usize, group: usize, d: usize },
    /// Queued; `floats` at `out` once the stream gets there.
    Queued {
        out: u64,
        floats: usize,
        hk: usize,
        group: usize,
        d: usize,
    },
}

impl CudaSeq {
    /// True when this sequence's sketch scores `layer` for a query of `q_len` floats (the
    /// kernels take its group, and the layer exists).
    fn sketch_takes(&self, layer: usize, q_len: usize) -> bool {
        let geom = self.store.geom;
        let group = q_len / (geom.num_kv_heads * geom.head_dim).max(1);
        self.scores_on_device(group) && layer < self.recall_events.len()
    }

    /// `SeqSketch::queue` where the sketch takes the call; `Ok(false)` where it does not.
    fn queue_sketch(
        &mut self,
        kv: &dyn KvSource,
        q: SketchQuery<'_>,
        call: SketchCall,
    ) -> Result<bool, BackendError> {
        if !self.sketch_takes(call.layer, q.len()) {
            return Ok(false);
        }
        let store = Arc::clone(&self.store);
        self.sketch.queue(&store, kv, q, call).map(|()| true)
    }

    /// The arena slot of `b` of head `lh` and what it needs to hold `len` tokens.
    fn slot_for(
        &mut self,
        lh: usize,
        b: DeviceBlock,
        len: usize,
    ) -> Result<(u32, Fill), BackendError> {
        let store = &self.store;
        self.table
            .slot_for(lh, b, len, &mut || store.take_slot())
            .map_err(|e| match e {
                NoSlot::ArenaFull => full(store.slots),
                NoSlot::PastCap { slot, cap } => BackendError::Unsupported(format!(
                    "residency slot {slot} of a sequence created with {cap} per head"
                )),
            })
    }

    /// Finds the arena slot of each block of `list` for `layer`'s KV head `h` (blocks past
    /// the sequence's end skipped), queues the copies of those not yet holding their tokens,
    /// and appends every (slot offset, tokens) to `out` where there is one (an attention's
    /// list: a recall's copies have none, and leave the head's last placement as it was).
    fn place<'a>(
        &mut self,
        kv: &'a dyn KvSource,
        layer: usize,
        h: usize,
        list: &[DeviceBlock],
        copies: &mut Copies<'a>,
        mut out: Option<&mut SlotList>,
    ) -> Result<(), BackendError> {
        let geom = self.store.geom;
        let (hk, bs, hb) = (geom.num_kv_heads, geom.block_size, geom.head_bytes() as i64);
        let n = kv.num_tokens();
        let lh = layer * hk + h;
        // The blocks placed whole last time need nothing but their slots.
        let reused = match out.as_deref_mut() {
            Some(o) => {
                let whole = self.table.placed_before(lh, list, n);
                o.extend_whole(whole, hb, bs);
                whole.len()
            }
            None => 0,
        };
        for &b in list[reused..].iter().filter(|b| b.block * bs < n) {
            let len = (n - b.block * bs).min(bs);
            let (slot, fill) = self.slot_for(lh, b, len)?;
            if fill != Fill::Keep {
                let (dst, src) = (
                    self.store.slot_addr(slot),
                    head_bytes(kv, &geom, layer, b.block, h),
                );
                match fill {
                    Fill::Whole => copies.whole.push((dst, src)),
                    Fill::Tail { from } => copies.tails.push((dst, src, from, len)),
                    Fill::Keep => {}
                }
                self.table.set_valid(lh, b, len);
            }
            if let Some(o) = out.as_deref_mut() {
                o.push(slot as i64 * hb, len);
            }
        }
        if out.is_some() {
            self.table.placed(lh, list, reused, n, bs);
        }
        Ok(())
    }

    /// True when this sequence's slots are on the device `sh` runs.
    pub(super) fn on(&self, sh: &Arc<Shared>) -> bool {
        Arc::ptr_eq(&self.store.shared, sh)
    }

    /// The slot list of `blocks` (one list per KV head) of `layer`, after queuing, behind
    /// `layer`'s recall copies, the copies of those whose slots do not hold their tokens yet.
    fn place_all<'a>(
        &mut self,
        kv: &'a dyn KvSource,
        layer: usize,
        blocks: &[&[DeviceBlock]],
    ) -> Result<(SlotList, Copies<'a>), BackendError> {
        self.after_recall(layer)?;
        let mut list = SlotList::new();
        let mut copies = Copies::default();
        for (h, heads_blocks) in blocks.iter().enumerate() {
            self.place(kv, layer, h, heads_blocks, &mut copies, Some(&mut list))?;
            list.end_head();
        }
        self.store.copy_in(&copies, Lane::Main)?;
        Ok((list, copies))
    }

    /// The slot list of a resident layer (`layer` of this sequence, `group` query heads per
    /// KV head) over `blocks`, their copies queued: the sequence's part of the batch's one
    /// attention launch ([`CudaKvStore::launch_resident`]).
    pub(super) fn place_resident(
        &mut self,
        kv: &dyn KvSource,
        layer: usize,
        blocks: &[&[DeviceBlock]],
        group: usize,
    ) -> Result<SlotList, BackendError> {
        let (hk, d) = (self.store.geom.num_kv_heads, self.store.geom.head_dim);
        if group == 0
            || group > MAX_GROUP
            || d > MAX_HEAD_DIM
            || blocks.len() != hk
            || layer >= self.recall_events.len()
        {
            return Err(BackendError::Unsupported(format!(
                "resident attention of layer {layer} (of {}) with {group} query heads for each of {hk} KV heads of head_dim {d}, {} head lists (kernel: group <= {MAX_GROUP}, head_dim <= {MAX_HEAD_DIM})",
                self.recall_events.len(),
                blocks.len()
            )));
        }
        self.store.shared.idle.busy();
        Ok(self.place_all(kv, layer, blocks)?.0)
    }

    /// A resident layer its device plans alone (#21 item 4): the fixed blocks (each head's
    /// sink, then its window) placed as [`CudaSeq::place_resident`] places them, the layer's
    /// blocks scored by its query row `q` where it is and picked (`call`), and the list laid
    /// out on the device from those picks (`place_picks`, in the attention's launch). The
    /// picks come back for [`DeviceSeq::take_device_picks`] after the step's wait. Nothing
    /// waits.
    pub(super) fn place_picked(
        &mut self,
        kv: &dyn KvSource,
        fixed: &[&[DeviceBlock]],
        group: usize,
        call: SketchCall,
        q: SketchQuery<'_>,
    ) -> Result<SlotList, BackendError> {
        let layer = call.layer;
        let (Some(cut), true) = (call.pick, self.picks_resident(&call)) else {
            return Err(BackendError::Unsupported(format!(
                "layer {layer} planned on a device that cannot plan it"
            )));
        };
        let list = self.place_resident(kv, layer, fixed, group)?;
        // Placing the fixed blocks hands no slot of a pickable block to another (every block
        // is resident, each in its own slot); were one lost, its pick would be attended empty.
        let hk = self.store.geom.num_kv_heads;
        if !(0..hk).all(|h| {
            self.table
                .holds_whole_below(layer * hk + h, cut.to, call.blocks)
        }) {
            return Err(BackendError::Unsupported(format!(
                "layer {layer} planned on the device lost a block it may pick"
            )));
        }
        let store = Arc::clone(&self.store);
        let (picks, back) = self.sketch.plan(&store, kv, q, call)?;
        let super::sketch::Back::Picks { k, rows, blocks } = back else {
            return Err(BackendError::Unsupported(format!(
                "layer {layer} planned on the device without picks"
            )));
        };
        let (table, stride) = self.block_table(layer, call.blocks + 1)?;
        let p = super::call::Picked {
            k,
            rows,
            blocks,
            from: cut.from,
            to: cut.to,
            picks,
            table,
            stride,
        };
        SlotList::picked(&list, p).ok_or_else(|| {
            BackendError::Unsupported(format!(
                "layer {layer}'s picks do not fit place_picks ({} heads, {p:?})",
                list.heads()
            ))
        })
    }

    /// `layer`'s rows of the device's block table, brought up to date with [`SlotTable`]
    /// (its changes since the last call uploaded, in stream order), for a sequence of
    /// `blocks` blocks: their address and stride. Grown (and sent whole) where the sequence
    /// has outgrown it.
    fn block_table(&mut self, layer: usize, blocks: usize) -> Result<(u64, usize), BackendError> {
        let r = self.block_table_unchecked(layer, blocks);
        if r.is_err() {
            // Some changes may have been taken and not sent: send everything next time.
            self.table.all_dirty();
        }
        r
    }

    fn block_table_unchecked(
        &mut self,
        layer: usize,
        blocks: usize,
    ) -> Result<(u64, usize), BackendError> {
        let hk = self.store.geom.num_kv_heads;
        let rows = self.recall_events.len() * hk;
        if blocks > self.table_stride {
            self.table_stride = blocks.next_power_of_two().max(64);
            self.table.all_dirty();
        }
        let stride = self.table_stride;
        let sh = Arc::clone(&self.store.shared);
        let base = self.block_table.ptr(&sh.stream, rows * stride * 4)?;
        for lh in layer * hk..(layer + 1) * hk {
            if let Some((from, entries)) = self.table.take_dirty(lh) {
                let upto = entries.len().min(stride.saturating_sub(from));
                let bytes: Vec<u8> = entries[..upto]
                    .iter()
                    .flat_map(|e| e.to_le_bytes())
                    .collect();
                sh.upload(base + ((lh * stride + from) * 4) as u64, &bytes)?;
            }
        }
        Ok((base + (layer * hk * stride * 4) as u64, stride))
    }

    /// The arena this sequence's slots are in.
    pub(super) fn store(&self) -> &Arc<CudaKvStore> {
        &self.store
    }

    /// Orders the recall stream's next work after the main stream's work queued so far, on
    /// the device: the host never waits.
    fn after_main(&mut self) -> Result<(), BackendError> {
        let sh = &*self.store.shared;
        let ev = match self.main_mark {
            Some(e) => e,
            None => {
                let e = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| dev_err("creating an event", e))?;
                self.main_mark = Some(Event(e));
                Event(e)
            }
        };
        // SAFETY: the event and both streams are live.
        unsafe {
            drv::event::record(ev.0, sh.stream.cu_stream())
                .map_err(|e| dev_err("marking the main stream", e))?;
            drv::stream::wait_event(
                sh.recall.cu_stream(),
                ev.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(|e| dev_err("ordering recall after the main stream", e))
        }
    }

    /// Orders this call after `layer`'s recall copies, on the device: the host never waits.
    fn after_recall(&self, layer: usize) -> Result<(), BackendError> {
        let Some(e) = self.recall_events[layer] else {
            return Ok(());
        };
        // SAFETY: both handles are live.
        unsafe {
            drv::stream::wait_event(
                self.store.shared.stream.cu_stream(),
                e.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| dev_err("waiting on recall", e))
    }
}

impl Drop for CudaSeq {
    fn drop(&mut self) {
        let sh = &self.store.shared;
        let _ = sh.bind();
        // A scoring queued and never taken may still read the sketch's pages, given back
        // below (a recall into one would race it).
        let _ = self.sketch.settle();
        // A layer planned on the device may still copy its picks into page-locked memory
        // freed with the sketch (a step that failed before its wait).
        if self.sketch.plans_pending() {
            let _ = sh.stream.synchronize();
        }
        // Recall copies may still be writing into our slots.
        if self.recall_events.iter().any(Option::is_some) {
            let _ = sh.recall.synchronize();
        }
        for e in self
            .recall_events
            .iter_mut()
            .filter_map(Option::take)
            .chain(self.main_mark.take())
        {
            // SAFETY: created by `event::create`, destroyed once.
            let _ = unsafe { drv::event::destroy(e.0) };
        }
        let slots: Vec<u32> = self.table.held().collect();
        self.store.give_back(slots);
        self.store.give_back(self.sketch.take_slots());
    }
}

fn full(slots: usize) -> BackendError {
    BackendError::DeviceFull(format!("all {slots} device KV slots are in use"))
}

/// Host bytes of head `h` of `block` of `layer`.
fn head_bytes<'a>(
    kv: &'a dyn KvSource,
    geom: &BlockGeometry,
    layer: usize,
    block: usize,
    h: usize,
) -> &'a [u8] {
    &kv.block(layer, block)[geom.head_range(h)]
}

impl DeviceSeq for CudaSeq {
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }

    fn submit(
        &mut self,
        kv: &dyn KvSource,
        layer: usize,
        blocks: &[&[DeviceBlock]],
        q: &[f32],
        scale: f32,
    ) -> Result<(), BackendError> {
        self.pending = None;
        let store = Arc::clone(&self.store);
        let sh = &*store.shared;
        let geom = store.geom;
        let (hk, d) = (geom.num_kv_heads, geom.head_dim);
        let group = q.len() / (hk * d).max(1);
        if group == 0
            || group > MAX_GROUP
            || d > MAX_HEAD_DIM
            || blocks.len() != hk
            || q.len() != hk * group * d
            || layer >= self.recall_events.len()
        {
            return Err(BackendError::Unsupported(format!(
                "attention of layer {layer} (of {}) with {} query floats for {hk} KV heads of head_dim {d} ({group} query heads each), {} head lists (kernel: group <= {MAX_GROUP}, head_dim <= {MAX_HEAD_DIM})",
                self.recall_events.len(),
                q.len(),
                blocks.len()
            )));
        }
        let t_start = std::time::Instant::now();
        sh.bind()?;
        sh.idle.busy();
        let (list, copies) = self.place_all(kv, layer, blocks)?;
        if list.is_empty() {
            self.pending = Some(Pending::Empty { hk, group, d });
            return Ok(());
        }
        let floats = hk * group * (d + 1);
        let out = self.out.ptr(&sh.stream, floats * 4)?;
        let lse = out + (hk * group * d * 4) as u64;
        store.launch_attention(&list, Query::Host(q), group, scale, (out, lse))?;
        tracing::trace!(
            layer,
            entries = list.offs.len(),
            copies = copies.whole.len(),
            tails = copies.tails.len(),
            seconds = t_start.elapsed().as_secs_f64(),
            "device attention queued"
        );
        self.pending = Some(Pending::Queued {
            out,
            floats,
            hk,
            group,
            d,
        });
        Ok(())
    }

    fn collect(&mut self) -> Result<Vec<Partial>, BackendError> {
        match self.pending.take() {
            None => Err(BackendError::Unsupported(
                "collect without a submitted device part".into(),
            )),
            Some(Pending::Empty { hk, group, d }) => {
                Ok((0..hk).map(|_| Partial::empty(group, d)).collect())
            }
            Some(Pending::Queued {
                out,
                floats,
                hk,
                group,
                d,
            }) => {
                let sh = &*self.store.shared;
                sh.bind()?;
                let mut host = vec![0f32; floats];
                sh.read_back(&mut host, out)?;
                Ok(partials(&host, hk, group, d))
            }
        }
    }

    fn scores_on_device(&self, group: usize) -> bool {
        self.store.keeps_sketch(group)
    }

    fn picks_resident(&self, call: &SketchCall) -> bool {
        let sh = &*self.store.shared;
        let hk = self.store.geom.num_kv_heads;
        let Some(cut) = call.pick else {
            return false;
        };
        // Fixed entries of every head: the sink and the window (`cut.to ..` of `blocks + 1`).
        let fixed = hk * (2 + call.blocks).saturating_sub(cut.to);
        sh.device_plan.load(Ordering::Acquire)
            && sh.sketch_on.load(Ordering::Acquire)
            && sh.sketch_picks.load(Ordering::Relaxed)
            && call.layer < self.recall_events.len()
            && super::sketch::picks_fit(&cut, call.blocks, hk)
            && hk <= super::call::PLACE_MAX_HEADS
            && fixed <= super::call::PLACE_MAX_FIXED
            && (0..hk).all(|h| {
                self.table
                    .holds_whole_below(call.layer * hk + h, cut.to, call.blocks)
            })
    }

    fn refuse_device_plans(&self) {
        tracing::error!(
            "picks of a layer planned on the device were refused; the host plans every layer from now on"
        );
        self.store
            .shared
            .device_plan
            .store(false, Ordering::Release);
    }

    fn take_device_picks(&mut self, layer: usize) -> Result<Option<Vec<Vec<usize>>>, BackendError> {
        let hk = self.store.geom.num_kv_heads;
        match self.sketch.take_planned(layer, hk)? {
            Some(Scored::Picks(p)) => Ok(Some(p)),
            Some(Scored::Scores(_)) | None => Ok(None),
        }
    }

    fn sketch_scores(
        &mut self,
        kv: &dyn KvSource,
        q: &[f32],
        call: SketchCall,
    ) -> Result<Option<Scored>, BackendError> {
        if !self.sketch_takes(call.layer, q.len()) {
            return Ok(None);
        }
        let store = Arc::clone(&self.store);
        self.sketch.scores(&store, kv, q, call).map(Some)
    }

    fn queue_sketch_scores(
        &mut self,
        kv: &dyn KvSource,
        q: &[f32],
        call: SketchCall,
    ) -> Result<bool, BackendError> {
        self.queue_sketch(kv, SketchQuery::Host(q), call)
    }

    fn queue_sketch_scores_by(
        &mut self,
        kv: &dyn KvSource,
        (rows, row): (&dyn std::any::Any, usize),
        call: SketchCall,
    ) -> Result<bool, BackendError> {
        let Some(&DeviceQueryRows { addr, width, rows }) = rows.downcast_ref() else {
            return Ok(false);
        };
        if row >= rows {
            return Ok(false);
        }
        let q = SketchQuery::Device {
            addr: addr + (row * width * 4) as u64,
            len: width,
        };
        self.queue_sketch(kv, q, call)
    }

    fn take_sketch_scores(&mut self, layer: usize) -> Result<Option<Scored>, BackendError> {
        self.store.shared.bind()?;
        self.sketch.take(layer)
    }

    fn recall(
        &mut self,
        kv: &dyn KvSource,
        layer: usize,
        blocks: &[&[DeviceBlock]],
    ) -> Result<(), BackendError> {
        let store = Arc::clone(&self.store);
        let hk = store.geom.num_kv_heads;
        if blocks.len() != hk || layer >= self.recall_events.len() {
            return Err(BackendError::Unsupported(format!(
                "recall of layer {layer} with {} head lists ({hk} KV heads, {} layers)",
                blocks.len(),
                self.recall_events.len()
            )));
        }
        let sh = &*store.shared;
        sh.bind()?;
        let mut copies = Copies::default();
        for (h, list) in blocks.iter().enumerate() {
            self.place(kv, layer, h, list, &mut copies, None)?;
        }
        if !copies.is_empty() {
            // A resident layer's attention may still be reading the slots these copies
            // refill: the recall stream waits for what the main stream holds so far.
            self.after_main()?;
        }
        store.copy_in(&copies, Lane::Recall)?;
        if !copies.is_empty() {
            let ev = match self.recall_events[layer] {
                Some(e) => e,
                None => {
                    let e = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                        .map_err(|e| dev_err("creating an event", e))?;
                    self.recall_events[layer] = Some(Event(e));
                    Event(e)
                }
            };
            // SAFETY: both handles are live.
            unsafe { drv::event::record(ev.0, sh.recall.cu_stream()) }
                .map_err(|e| dev_err("recording recall", e))?;
        }
        Ok(())
    }

    fn set_slots_per_head(&mut self, blocks_per_head: usize) -> Result<(), BackendError> {
        if blocks_per_head < self.table.cap() && self.recall_events.iter().any(Option::is_some) {
            // Recall copies may still be writing into the slots given back, and the next
            // owner's copies may go on the main stream, which is not ordered after them.
            // (Kernels that read them are on the main stream, ahead of anything queued there.)
            let sh = &*self.store.shared;
            sh.bind()?;
            sh.recall
                .synchronize()
                .map_err(|e| dev_err("waiting for recall before giving slots back", e))?;
        }
        let freed = self.table.set_cap(blocks_per_head);
        self.store.give_back(freed);
        Ok(())
    }
}
