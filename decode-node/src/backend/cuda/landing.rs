//! Where a resident layer's CPU partials land on CUDA (#21 item 5, [`crate::backend::landing`]):
//! pinned host memory mapped into the device's address space. The CPU workers write their
//! rows there and raise the flag; the stream waits on the flag (`cuStreamWaitValue32`) and
//! `lse2_merge` reads the rows where they are, so the step thread queues the merge and the
//! layer's second half without waiting for the CPU. Off unless `DECODE_NODE_CPU_FLAG=on`:
//! not yet run on a GPU.

use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use cudarc::driver::{result as drv, sys};

use super::driver::dev_err;
use crate::backend::{BackendError, LandingMem};

/// Pinned, device-mapped words and a flag after them.
#[derive(Debug)]
pub(crate) struct MappedLandingMem {
    ptr: *mut AtomicU32,
    words: usize,
    /// The device's address of `ptr`.
    dev: u64,
}

// SAFETY: the memory is owned by this value and only touched through atomics.
unsafe impl Send for MappedLandingMem {}
// SAFETY: as above: shared access is atomic loads and stores.
unsafe impl Sync for MappedLandingMem {}

impl MappedLandingMem {
    /// Room for `words` words (zeroed) and the flag (down).
    fn new(words: usize) -> Result<Self, BackendError> {
        let bytes = (words + 1) * 4;
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: a fresh allocation of `bytes`; DEVICEMAP maps it for the device to read.
        let p = unsafe { drv::malloc_host(bytes, flags) }
            .map_err(|e| dev_err("mapped landing memory", e))?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `p` is mapped pinned memory of this context; flags must be 0.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, p, 0) }.result();
        let mem = Self {
            ptr: p.cast(),
            words,
            dev,
        };
        mapped.map_err(|e| dev_err("mapping landing memory", e))?;
        // SAFETY: `bytes` writable bytes at `p`; all-zero words are valid AtomicU32s.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, bytes) };
        Ok(mem)
    }

    /// The device's addresses of the words and of the flag.
    pub(crate) fn addresses(&self) -> (u64, u64) {
        (self.dev, self.dev + (self.words * 4) as u64)
    }
}

impl LandingMem for MappedLandingMem {
    fn words(&self) -> &[AtomicU32] {
        // SAFETY: `words + 1` initialised words owned by this value.
        unsafe { std::slice::from_raw_parts(self.ptr, self.words) }
    }

    fn flag(&self) -> &AtomicU32 {
        // SAFETY: the word after `words`, in the same allocation.
        unsafe { &*self.ptr.add(self.words) }
    }

    fn device(&self) -> Option<(u64, u64)> {
        Some(self.addresses())
    }
}

impl Drop for MappedLandingMem {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host`, freed once; the pool frees it only after the
        // event that follows its last read (`LandingPool`).
        let _ = unsafe { drv::free_host(self.ptr.cast()) };
    }
}

/// A landing's memory and the event recorded after the merge that read it last.
#[derive(Debug)]
struct Slot {
    mem: Arc<MappedLandingMem>,
    read: sys::CUevent,
}

/// The landing memories of a backend, reused once nobody holds them and the device has read
/// them; each landing gets a new flag value, so a flag left up from an earlier use never
/// lets a wait through.
#[derive(Debug, Default)]
pub(crate) struct LandingPool {
    slots: Vec<Slot>,
    seq: u32,
}

// SAFETY: the events are used under the backend's mutex, one thread at a time.
unsafe impl Send for LandingPool {}

/// Slots kept before a new landing waits for an old one to be read rather than allocate.
const MAX_SLOTS: usize = 256;

impl LandingPool {
    /// Memory of at least `words` words no landing in flight uses, and a flag value it was
    /// never raised to.
    pub(crate) fn take(
        &mut self,
        words: usize,
    ) -> Result<(Arc<MappedLandingMem>, u32), BackendError> {
        self.seq = self.seq.wrapping_add(1).max(1);
        let free = |s: &Slot| Arc::strong_count(&s.mem) == 1;
        // SAFETY: the events are live; a query only reads their state.
        let read = |s: &Slot| unsafe { drv::event::query(s.read) }.is_ok();
        let fits = |s: &Slot| s.mem.words >= words;
        if let Some(s) = self.slots.iter().find(|s| free(s) && fits(s) && read(s)) {
            return Ok((Arc::clone(&s.mem), self.seq));
        }
        let grow = words.next_power_of_two().max(1024);
        let full = self.slots.len() >= MAX_SLOTS;
        if let Some(s) = self.slots.iter_mut().find(|s| full && free(s)) {
            // SAFETY: a live event.
            unsafe { drv::event::synchronize(s.read) }
                .map_err(|e| dev_err("waiting for a landing's merge", e))?;
            if !fits(s) {
                s.mem = Arc::new(MappedLandingMem::new(grow)?);
            }
            return Ok((Arc::clone(&s.mem), self.seq));
        }
        let mem = Arc::new(MappedLandingMem::new(grow)?);
        let read = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| dev_err("creating an event", e))?;
        self.slots.push(Slot {
            mem: Arc::clone(&mem),
            read,
        });
        Ok((mem, self.seq))
    }

    /// Marks, on `stream`, where the device is done reading `mem` (after the merge).
    pub(crate) fn mark_read(
        &self,
        mem: &Arc<dyn LandingMem>,
        stream: sys::CUstream,
    ) -> Result<(), BackendError> {
        let at = Arc::as_ptr(mem).cast::<()>();
        let Some(s) = self
            .slots
            .iter()
            .find(|s| Arc::as_ptr(&s.mem).cast::<()>() == at)
        else {
            return Err(BackendError::Unsupported(
                "a landing in memory this backend did not hand out".into(),
            ));
        };
        // SAFETY: the event and the stream are live.
        unsafe { drv::event::record(s.read, stream) }
            .map_err(|e| dev_err("marking a landing read", e))
    }
}

impl Drop for LandingPool {
    fn drop(&mut self) {
        for s in self.slots.drain(..) {
            // SAFETY: live events, destroyed once; the memory is freed (with the last Arc)
            // after its last read.
            unsafe {
                let _ = drv::event::synchronize(s.read);
                let _ = drv::event::destroy(s.read);
            }
        }
    }
}

/// Queues on `stream` a wait until `flag` (a device address) reaches `seq` (compared with
/// wrap-around: a later landing's raise lets an older wait through too).
pub(crate) fn queue_wait_flag(
    stream: sys::CUstream,
    flag: u64,
    seq: u32,
) -> Result<(), BackendError> {
    let geq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
    // SAFETY: `flag` is a mapped word that outlives the wait (its pool slot is reused only
    // after the event recorded behind the merge).
    unsafe { sys::cuStreamWaitValue32_v2(stream, flag, seq, geq) }
        .result()
        .map_err(|e| dev_err("queueing the wait for the CPU partials", e))
}
