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

#[cfg(test)]
mod tests {
    use super::*;

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
