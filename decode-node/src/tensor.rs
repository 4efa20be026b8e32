//! [`Tensor`]: a weight in its checkpoint dtype, owned or memory-mapped. Below both the model
//! (which loads tensors) and the backends (which run ops on them), so neither depends on the
//! other for it.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use attention::{KvDType, decode_to_f32};
use memmap2::Mmap;

#[derive(Debug)]
enum Storage {
    Owned(Vec<u8>),
    Mapped(Arc<Mmap>, Range<usize>),
}

/// A weight tensor in its checkpoint dtype (f32, f16 or bf16), row-major.
#[derive(Debug)]
pub struct Tensor {
    /// Shape.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: KvDType,
    storage: Storage,
    id: u64,
}

/// Source of [`Tensor::id`]s.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

impl Tensor {
    /// A tensor over owned little-endian bytes.
    pub fn from_bytes(shape: Vec<usize>, dtype: KvDType, bytes: Vec<u8>) -> Self {
        debug_assert_eq!(bytes.len(), shape.iter().product::<usize>() * dtype.size());
        Self {
            shape,
            dtype,
            storage: Storage::Owned(bytes),
            id: next_id(),
        }
    }

    /// A tensor over `range` of a memory-mapped file (already checked to hold it).
    pub(crate) fn mapped(
        shape: Vec<usize>,
        dtype: KvDType,
        map: Arc<Mmap>,
        range: Range<usize>,
    ) -> Self {
        debug_assert_eq!(range.len(), shape.iter().product::<usize>() * dtype.size());
        Self {
            shape,
            dtype,
            storage: Storage::Mapped(map, range),
            id: next_id(),
        }
    }

    /// An f32 tensor.
    pub fn from_f32(shape: Vec<usize>, v: &[f32]) -> Self {
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        Self::from_bytes(shape, KvDType::F32, bytes)
    }

    /// This tensor's identity, unique in the process and never reused: a device keys its copy
    /// of the weights by it (a host address can be reused by a later tensor once one is freed).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Raw little-endian bytes.
    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Owned(v) => v,
            Storage::Mapped(m, r) => &m[r.clone()],
        }
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Rows of a 2-D tensor (its first dimension).
    pub fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(0)
    }

    /// Columns of a 2-D tensor (its last dimension).
    pub fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(0)
    }

    /// All elements as f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.numel()];
        decode_to_f32(self.dtype, self.bytes(), &mut out);
        out
    }

    /// Row `r` of a 2-D tensor into `out` (`cols` elements).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let c = self.cols();
        let es = self.dtype.size();
        decode_to_f32(self.dtype, &self.bytes()[r * c * es..(r + 1) * c * es], out);
    }
}

/// Moves every tensor of `tensors` into one read-only anonymous mapping that asks the kernel
/// for transparent huge pages, which neither the tensors' own heap blocks (most under 2 MiB)
/// nor a checkpoint's file mapping get. The CPU backend streams every weight once a step:
/// with 2 MiB pages a read stream of 512 MiB went 8-15% faster (2-core EPYC VM: 4 KiB pages
/// 24.5-30.0 GB/s, huge 28.3-33.1), page walks being dearer under nested paging. Best
/// effort: where the kernel refuses the advice the tensors still move, on small pages. A
/// mapped checkpoint's pages are left to the page cache, which may reclaim them. Each tensor
/// starts 64-byte aligned.
pub fn pack_onto_huge_pages(tensors: &mut [&mut Tensor]) -> std::io::Result<()> {
    const HUGE: usize = 2 << 20;
    const ALIGN: usize = 64;
    let total: usize = tensors
        .iter()
        .map(|t| t.bytes().len().next_multiple_of(ALIGN))
        .sum();
    if total < HUGE {
        return Ok(()); // no whole huge page to gain
    }
    // One huge page more than the tensors, so they can start on a huge page's boundary.
    let mut map = kv_transfer::map_huge(total + HUGE)?;
    let start = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
    let mut ranges = Vec::with_capacity(tensors.len());
    let mut off = start;
    for t in tensors.iter_mut() {
        let r = off..off + t.bytes().len();
        map[r.clone()].copy_from_slice(t.bytes());
        // Freed as it goes, so the load peaks at the mapping plus one tensor.
        t.storage = Storage::Owned(Vec::new());
        off = r.end.next_multiple_of(ALIGN);
        ranges.push(r);
    }
    let map = Arc::new(map.make_read_only()?);
    for (t, r) in tensors.iter_mut().zip(ranges) {
        t.storage = Storage::Mapped(map.clone(), r);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packed tensors read back the same bytes, each 64-byte aligned in one mapping, mapped
    /// ones included; their identities stay (a device keys its copies by them).
    #[test]
    fn packing_keeps_every_tensor() {
        let big: Vec<f32> = (0..(1 << 20)).map(|i| i as f32).collect();
        let mut a = Tensor::from_f32(vec![1 << 20], &big);
        let mut b = Tensor::from_f32(vec![3], &[1.0, 2.0, 3.0]);
        let file: Vec<u8> = big.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut anon = memmap2::MmapMut::map_anon(file.len() + 8).unwrap();
        anon[8..].copy_from_slice(&file);
        let map = Arc::new(anon.make_read_only().unwrap());
        let mut c = Tensor::mapped(vec![1 << 20], KvDType::F32, map.clone(), 8..8 + file.len());
        let ids = [a.id(), b.id(), c.id()];
        pack_onto_huge_pages(&mut [&mut a, &mut b, &mut c]).unwrap();
        for t in [&a, &b, &c] {
            assert!(matches!(&t.storage, Storage::Mapped(m, _) if !Arc::ptr_eq(m, &map)));
            assert_eq!(t.bytes().as_ptr() as usize % 64, 0);
        }
        assert_eq!(a.to_f32(), big);
        assert_eq!(b.to_f32(), vec![1.0, 2.0, 3.0]);
        assert_eq!(c.to_f32(), big);
        assert_eq!([a.id(), b.id(), c.id()], ids);
        // Below one huge page there is nothing to gain: left as they are.
        let mut d = Tensor::from_f32(vec![3], &[1.0, 2.0, 3.0]);
        pack_onto_huge_pages(&mut [&mut d]).unwrap();
        assert!(matches!(d.storage, Storage::Owned(..)));
    }

    #[test]
    fn tensors_are_told_apart_even_at_a_reused_address() {
        let a = Tensor::from_f32(vec![2], &[1.0, 2.0]);
        let id = a.id();
        drop(a);
        // The allocator may well hand the same bytes to the next tensor of that size.
        let b = Tensor::from_f32(vec![2], &[3.0, 4.0]);
        assert_ne!(b.id(), id);
        assert_eq!(b.to_f32(), vec![3.0, 4.0]);
    }
}
