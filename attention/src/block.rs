//! Layout of one KV block and the writes that fill it.
//!
//! A block holds `block_size` consecutive tokens of one layer for every KV head. Within it,
//! each head's data is contiguous: K transposed (`[head_dim][block_size]`, so scoring a block
//! streams rows of `block_size` keys for one channel), then V (`[block_size][head_dim]`).

use crate::dtype::{KvDType, encode_from_f32};

/// Shape of a KV block; fixed for the life of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockGeometry {
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads per layer.
    pub num_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Storage type.
    pub dtype: KvDType,
}

impl BlockGeometry {
    /// Bytes of one head's K and V within a block.
    pub const fn head_bytes(&self) -> usize {
        2 * self.block_size * self.head_dim * self.dtype.size()
    }

    /// Bytes of a whole block (all KV heads).
    pub const fn block_bytes(&self) -> usize {
        self.num_kv_heads * self.head_bytes()
    }

    /// Blocks needed for `tokens` tokens.
    pub const fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// The byte range of head `h` within a block.
    pub const fn head_range(&self, h: usize) -> std::ops::Range<usize> {
        h * self.head_bytes()..(h + 1) * self.head_bytes()
    }

    /// Writes token `slot` (0..block_size) of head `h` into `block`, from f32 `k` and `v`
    /// (`head_dim` each).
    pub fn write_token(&self, block: &mut [u8], h: usize, slot: usize, k: &[f32], v: &[f32]) {
        let es = self.dtype.size();
        let (b, d) = (self.block_size, self.head_dim);
        let head = &mut block[self.head_range(h)];
        let (kt, vs) = head.split_at_mut(b * d * es);
        for (c, kc) in k.iter().enumerate() {
            let at = (c * b + slot) * es;
            encode_from_f32(self.dtype, std::slice::from_ref(kc), &mut kt[at..at + es]);
        }
        encode_from_f32(self.dtype, v, &mut vs[slot * d * es..(slot + 1) * d * es]);
    }
}

/// One KV head's part of one block, as the kernels read it.
#[derive(Debug, Clone, Copy)]
pub struct HeadBlock<'a> {
    /// `head_bytes()` bytes: K transposed then V.
    pub bytes: &'a [u8],
    /// Valid tokens (1..=block_size); the newest block may be partly filled.
    pub len: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::decode_to_f32;

    #[test]
    fn token_lands_transposed() {
        let g = BlockGeometry {
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 3,
            dtype: KvDType::F32,
        };
        let mut blk = vec![0u8; g.block_bytes()];
        g.write_token(&mut blk, 1, 2, &[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]);
        let mut f = vec![0f32; blk.len() / 4];
        decode_to_f32(KvDType::F32, &blk, &mut f);
        let head = &f[24..48];
        // K^T[c][slot]
        assert_eq!([head[2], head[4 + 2], head[8 + 2]], [1.0, 2.0, 3.0]);
        // V[slot][c]
        assert_eq!(&head[12 + 6..12 + 9], &[4.0, 5.0, 6.0]);
        assert!(f[..24].iter().all(|x| *x == 0.0));
    }
}
