//! Layout of one KV block and the writes that fill it.
//!
//! A block holds `block_size` consecutive tokens of one layer for every KV head. Within it,
//! each head's data is contiguous: K transposed (`[head_dim][block_size]`, so scoring a block
//! streams rows of `block_size` keys for one channel), then V (`[block_size][head_dim]`).

use crate::dtype::{
    KvDType, decode_to_f32, encode_from_f32, magnitude_bits, magnitude_top, quant_scale, quantize,
    quantize_by, scales_of_tops,
};

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
    /// Bytes of one head's K and V within a block (with a scaled dtype, [`KvDType::scaled`],
    /// each token's K and V scale after them).
    pub const fn head_bytes(&self) -> usize {
        2 * self.block_size * self.head_dim * self.dtype.size() + self.scale_bytes()
    }

    /// Bytes of one head's scales within a block: `[block_size]` f32 for K, then for V (0
    /// for the unscaled dtypes).
    pub const fn scale_bytes(&self) -> usize {
        if self.dtype.scaled() {
            2 * self.block_size * 4
        } else {
            0
        }
    }

    /// Each token's K scale and V scale in one head's bytes (`head`, [`BlockGeometry::head_range`]
    /// of a block), for a scaled dtype: `(k_scales, v_scales)`, `block_size` each.
    pub fn scales<'a>(&self, head: &'a [u8]) -> (&'a [u8], &'a [u8]) {
        let at = 2 * self.block_size * self.head_dim * self.dtype.size();
        let sc = &head[at..at + self.scale_bytes()];
        sc.split_at(sc.len() / 2)
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
        self.write_token_body(block, h, slot, k, v);
    }

    /// Writes the keys of tokens `slot0..slot0 + n` of head `h` into `block` as
    /// [`write_token`] writes them, from f32 rows (token `i`'s K at `i * stride` of `k`,
    /// `head_dim` each), folding each into `digest` (the block's minima and maxima,
    /// `head_dim` each): with [`BlockGeometry::write_values`], the ingest's path where the
    /// pool stores another dtype than the wire's. Compiled for AVX2 where the CPU has it (the
    /// loops over a token's elements run 8 wide, and int8 and e4m3 codes come from
    /// `dtype::quantize_by_avx2`, inlined). Eight tokens at a time: their keys are folded
    /// into the digest together (`fold_eight`: each channel's minimum and maximum loaded and
    /// stored once for the eight), their scales taken in two vector divisions
    /// (`scales_of_tops`), and their codes transposed into the channels' rows sixteen
    /// channels at a time by byte unpacks (`transpose_8x16_sse2`; `transpose_8x8` in general
    /// registers elsewhere): a store of eight codes where there were eight stores of one,
    /// each `block_size` bytes apart. With the ingest's run-wise structure
    /// (`kv_transfer::Ingest`), `bench ingest --kv-dtype int8` on SmolLM2-135M stores 3.5-3.65
    /// GB/s on the Xeon VM, 0.27-0.28 of memcpy (fp8 2.85-3.3); `cargo bench -p kv-transfer
    /// --bench store` 5.1-5.4 GiB/s at 8 KV heads of 128 (bf16 on the wire) and 4.6-4.7 at
    /// SmolLM2's 3 of 64 (f16).
    ///
    /// [`write_token`]: BlockGeometry::write_token
    pub fn write_keys(
        &self,
        block: &mut [u8],
        (h, slot0): (usize, usize),
        k: &[f32],
        (stride, n): (usize, usize),
        digest: (&mut [f32], &mut [f32]),
    ) {
        #[cfg(target_arch = "x86_64")]
        if crate::kernel_avx2::available() {
            // SAFETY: the CPU has AVX2 and FMA.
            unsafe { self.write_keys_avx2(block, (h, slot0), k, (stride, n), digest) };
            return;
        }
        self.write_keys_body::<false>(block, (h, slot0), k, (stride, n), digest);
    }

    /// [`BlockGeometry::write_keys`] compiled for AVX2.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn write_keys_avx2(
        &self,
        block: &mut [u8],
        at: (usize, usize),
        k: &[f32],
        rows: (usize, usize),
        digest: (&mut [f32], &mut [f32]),
    ) {
        self.write_keys_body::<true>(block, at, k, rows, digest);
    }

    /// [`BlockGeometry::write_keys`]' definition, for the compiler to vectorise at each call
    /// site's features; `AVX2` where that is a function compiled for AVX2 (which then
    /// inlines the AVX2 quantizer, [`quantize_in`]).
    #[inline(always)]
    fn write_keys_body<const AVX2: bool>(
        &self,
        block: &mut [u8],
        (h, slot0): (usize, usize),
        k: &[f32],
        (stride, n): (usize, usize),
        (min, max): (&mut [f32], &mut [f32]),
    ) {
        let (dt, b, d) = (self.dtype, self.block_size, self.head_dim);
        let es = dt.size();
        let head = &mut block[self.head_range(h)];
        let (kt, rest) = head.split_at_mut(b * d * es);
        let row = |i: usize| &k[i * stride..][..d];
        if !dt.scaled() {
            for i in 0..n {
                fold_token(min, max, row(i));
                for (c, x) in row(i).iter().enumerate() {
                    let at = (c * b + slot0 + i) * es;
                    encode_from_f32(dt, std::slice::from_ref(x), &mut kt[at..at + es]);
                }
            }
            return;
        }
        let ksc = &mut rest[b * d..][..4 * b];
        // Eight tokens at a time: their codes, 64 channels at a time, into a tile of eight
        // rows, then eight channels by eight tokens into the channels' rows.
        let mut tile = [[0u8; 64]; 8];
        let mut i0 = 0;
        while i0 < n {
            let m = (n - i0).min(8);
            let tops = if m == 8 {
                fold_eight(min, max, std::array::from_fn(|j| row(i0 + j)))
            } else {
                std::array::from_fn(|j| {
                    if j < m {
                        fold_token(min, max, row(i0 + j))
                    } else {
                        0
                    }
                })
            };
            let (scale, inv) = scales_of_tops::<AVX2>(dt, tops);
            for (j, ks) in scale.iter().enumerate().take(m) {
                let slot = slot0 + i0 + j;
                ksc[slot * 4..slot * 4 + 4].copy_from_slice(&ks.to_le_bytes());
            }
            let slot = slot0 + i0;
            for c0 in (0..d).step_by(64) {
                let w = (d - c0).min(64);
                for (j, codes) in tile.iter_mut().enumerate().take(m) {
                    quantize_in::<AVX2>(dt, &row(i0 + j)[c0..c0 + w], inv[j], &mut codes[..w]);
                }
                let whole = if m == 8 { w / 8 * 8 } else { 0 };
                // Sixteen channels at a time by byte unpacks where the body is compiled
                // for AVX2: a sixth of the general registers' operations.
                let by16 = if AVX2 { whole / 16 * 16 } else { 0 };
                #[cfg(target_arch = "x86_64")]
                for c in (0..by16).step_by(16) {
                    // SAFETY: `by16` is 0 unless the body is compiled for AVX2 (so SSE2).
                    let cols = unsafe {
                        transpose_8x16_sse2(std::array::from_fn(|j| &tile[j][c..c + 16]))
                    };
                    for (x, col) in cols.iter().enumerate() {
                        let at = (c0 + c + x) * b + slot;
                        kt[at..at + 8].copy_from_slice(&col.to_le_bytes());
                    }
                }
                for c in (by16..whole).step_by(8) {
                    let cols = transpose_8x8(std::array::from_fn(|j| {
                        u64::from_le_bytes(std::array::from_fn(|x| tile[j][c + x]))
                    }));
                    for (x, col) in cols.iter().enumerate() {
                        let at = (c0 + c + x) * b + slot;
                        kt[at..at + 8].copy_from_slice(&col.to_le_bytes());
                    }
                }
                for c in whole..w {
                    let at = (c0 + c) * b + slot;
                    for (j, codes) in tile.iter().enumerate().take(m) {
                        kt[at + j] = codes[c];
                    }
                }
            }
            i0 += m;
        }
    }

    /// Writes the values of tokens `slot0..slot0 + n` of head `h` into `block` as
    /// [`write_token`] writes them, from f32 rows (token `i`'s V at `i * stride` of `v`,
    /// `head_dim` each); the other half of [`BlockGeometry::write_keys`].
    ///
    /// [`write_token`]: BlockGeometry::write_token
    pub fn write_values(
        &self,
        block: &mut [u8],
        (h, slot0): (usize, usize),
        v: &[f32],
        (stride, n): (usize, usize),
    ) {
        #[cfg(target_arch = "x86_64")]
        if crate::kernel_avx2::available() {
            // SAFETY: the CPU has AVX2 and FMA.
            unsafe { self.write_values_avx2(block, (h, slot0), v, (stride, n)) };
            return;
        }
        self.write_values_body::<false>(block, (h, slot0), v, (stride, n));
    }

    /// [`BlockGeometry::write_values`] compiled for AVX2.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn write_values_avx2(
        &self,
        block: &mut [u8],
        at: (usize, usize),
        v: &[f32],
        rows: (usize, usize),
    ) {
        self.write_values_body::<true>(block, at, v, rows);
    }

    /// [`BlockGeometry::write_values`]' definition, for the compiler to vectorise at each
    /// call site's features; `AVX2` as [`BlockGeometry::write_keys_body`]'s.
    #[inline(always)]
    fn write_values_body<const AVX2: bool>(
        &self,
        block: &mut [u8],
        (h, slot0): (usize, usize),
        v: &[f32],
        (stride, n): (usize, usize),
    ) {
        let (dt, b, d) = (self.dtype, self.block_size, self.head_dim);
        let es = dt.size();
        let head = &mut block[self.head_range(h)];
        let (vq, sc) = head[b * d * es..].split_at_mut(b * d * es);
        let row = |i: usize| &v[i * stride..][..d];
        if !dt.scaled() {
            for i in 0..n {
                let slot = slot0 + i;
                encode_from_f32(dt, row(i), &mut vq[slot * d * es..(slot + 1) * d * es]);
            }
            return;
        }
        // Eight rows' scales at a time (`scales_of_tops`), then their codes.
        for i0 in (0..n).step_by(8) {
            let m = (n - i0).min(8);
            let tops = std::array::from_fn(|j| if j < m { magnitude_top(row(i0 + j)) } else { 0 });
            let (scale, inv) = scales_of_tops::<AVX2>(dt, tops);
            for j in 0..m {
                let slot = slot0 + i0 + j;
                quantize_in::<AVX2>(dt, row(i0 + j), inv[j], &mut vq[slot * d..(slot + 1) * d]);
                sc[(b + slot) * 4..(b + slot) * 4 + 4].copy_from_slice(&scale[j].to_le_bytes());
            }
        }
    }

    /// [`BlockGeometry::write_token`]'s definition, inlined where it is called.
    #[inline(always)]
    fn write_token_body(&self, block: &mut [u8], h: usize, slot: usize, k: &[f32], v: &[f32]) {
        let es = self.dtype.size();
        let (b, d) = (self.block_size, self.head_dim);
        let head = &mut block[self.head_range(h)];
        if self.dtype.scaled() {
            let dt = self.dtype;
            let (ks, vs) = (quant_scale(dt, k), quant_scale(dt, v));
            let (kt, rest) = head.split_at_mut(b * d);
            let (vq, sc) = rest.split_at_mut(b * d);
            // K 64 channels at a time into a row of codes (one vectorised pass), then each
            // into its channel's row.
            let mut kq = [0u8; 64];
            for (c0, kc) in k.chunks(64).enumerate() {
                let codes = &mut kq[..kc.len()];
                quantize(dt, kc, ks, codes);
                for (i, q) in codes.iter().enumerate() {
                    kt[(64 * c0 + i) * b + slot] = *q;
                }
            }
            quantize(dt, v, vs, &mut vq[slot * d..(slot + 1) * d]);
            sc[slot * 4..slot * 4 + 4].copy_from_slice(&ks.to_le_bytes());
            sc[(b + slot) * 4..(b + slot) * 4 + 4].copy_from_slice(&vs.to_le_bytes());
            return;
        }
        let (kt, vs) = head.split_at_mut(b * d * es);
        for (c, kc) in k.iter().enumerate() {
            let at = (c * b + slot) * es;
            encode_from_f32(self.dtype, std::slice::from_ref(kc), &mut kt[at..at + es]);
        }
        encode_from_f32(self.dtype, v, &mut vs[slot * d * es..(slot + 1) * d * es]);
    }
}

impl BlockGeometry {
    /// Token `slot` of head `h` of `block` as stored, back in f32 (`head_dim` each into `k`
    /// and `v`): what the kernels attend.
    pub fn read_token(&self, block: &[u8], h: usize, slot: usize, k: &mut [f32], v: &mut [f32]) {
        let es = self.dtype.size();
        let (b, d) = (self.block_size, self.head_dim);
        let head = &block[self.head_range(h)];
        for (c, kc) in k.iter_mut().enumerate() {
            let at = (c * b + slot) * es;
            decode_to_f32(self.dtype, &head[at..at + es], std::slice::from_mut(kc));
        }
        let at = b * d * es + slot * d * es;
        decode_to_f32(self.dtype, &head[at..at + d * es], v);
        if self.dtype.scaled() {
            let (ks, vs) = self.scales(head);
            let (ks, vs) = (scale_at(ks, slot), scale_at(vs, slot));
            k.iter_mut().for_each(|x| *x *= ks);
            v.iter_mut().for_each(|x| *x *= vs);
        }
    }
}

/// Scale `t` of a little-endian f32 scale row.
pub(crate) fn scale_at(row: &[u8], t: usize) -> f32 {
    f32::from_le_bytes([row[4 * t], row[4 * t + 1], row[4 * t + 2], row[4 * t + 3]])
}

/// [`quantize`] by the factor `inv` ([`scales_of_tops`]'s) in a body of
/// [`BlockGeometry::write_keys`] or `write_values`: inlined, AVX2 code where `AVX2` (the body
/// is compiled into an AVX2 function, which only a CPU with AVX2 runs), else the loop the
/// compiler vectorises for the body.
#[inline(always)]
fn quantize_in<const AVX2: bool>(dt: KvDType, x: &[f32], inv: f32, dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: only the bodies compiled into `write_keys_avx2` and `write_values_avx2`
        // pass `AVX2`, and those run where the CPU has AVX2.
        unsafe { crate::dtype::quantize_by_avx2(dt, x, inv, dst) };
        return;
    }
    quantize_by(dt, x, inv, dst);
}

/// Folds one token's key `k` into a block's digest (`min`, `max`), returning its largest
/// [`magnitude_bits`] (its scale's) from the same pass. A NaN key leaves the digest as it
/// was (the comparisons are false), as `f32::min` would; written as comparisons, which
/// compile to one instruction a vector where `f32::min` took three.
#[inline(always)]
fn fold_token(min: &mut [f32], max: &mut [f32], k: &[f32]) -> u32 {
    let mut top = 0u32;
    for ((lo, hi), x) in min.iter_mut().zip(max.iter_mut()).zip(k) {
        *lo = if *x < *lo { *x } else { *lo };
        *hi = if *x > *hi { *x } else { *hi };
        top = top.max(magnitude_bits(*x));
    }
    top
}

/// [`fold_token`] of eight tokens' keys at once: each eight channels' minima and maxima
/// are loaded and stored once for the eight tokens, not once a token.
#[inline(always)]
fn fold_eight(min: &mut [f32], max: &mut [f32], rows: [&[f32]; 8]) -> [u32; 8] {
    let mut tops = [[0u32; 8]; 8];
    let (lo8, lo_rest) = min.as_chunks_mut::<8>();
    let (hi8, hi_rest) = max.as_chunks_mut::<8>();
    let whole = 8 * lo8.len();
    for (ci, (lo, hi)) in lo8.iter_mut().zip(hi8.iter_mut()).enumerate() {
        let (mut l, mut h) = (*lo, *hi);
        for (row, top) in rows.iter().zip(tops.iter_mut()) {
            let x = &row[8 * ci..8 * ci + 8];
            for e in 0..8 {
                l[e] = if x[e] < l[e] { x[e] } else { l[e] };
                h[e] = if x[e] > h[e] { x[e] } else { h[e] };
                top[e] = top[e].max(magnitude_bits(x[e]));
            }
        }
        (*lo, *hi) = (l, h);
    }
    let mut tops = tops.map(|t| t.into_iter().fold(0, u32::max));
    // Folded into the reduced maxima, not into the lanes: a scalar store into a vector
    // about to be loaded whole stalls the load (its store cannot be forwarded), which cost
    // a tenth of `write_keys` at SmolLM2's shape even with no channels left.
    if !lo_rest.is_empty() {
        for (row, top) in rows.iter().zip(tops.iter_mut()) {
            *top = (*top).max(fold_token(lo_rest, hi_rest, &row[whole..]));
        }
    }
    tops
}

/// The transpose of an 8x8 matrix of bytes held as eight rows (byte `j` of row `i`, little
/// endian, is element `(i, j)`): three rounds of swapping the off-diagonal halves of 2x2,
/// then 4x4, then 8x8 sub-blocks, a few shifts and masks each, in general registers (no
/// shuffles, so it compiles as well on any target).
#[inline(always)]
fn transpose_8x8(mut r: [u64; 8]) -> [u64; 8] {
    for (shift, mask, pairs) in [
        (
            8,
            0x00ff_00ff_00ff_00ffu64,
            [(0, 1), (2, 3), (4, 5), (6, 7)],
        ),
        (16, 0x0000_ffff_0000_ffff, [(0, 2), (1, 3), (4, 6), (5, 7)]),
        (32, 0x0000_0000_ffff_ffff, [(0, 4), (1, 5), (2, 6), (3, 7)]),
    ] {
        for (a, b) in pairs {
            let t = ((r[a] >> shift) ^ r[b]) & mask;
            r[b] ^= t;
            r[a] ^= t << shift;
        }
    }
    r
}

/// [`transpose_8x8`] of two 8x8 matrices side by side: eight rows of 16 bytes in, sixteen
/// columns of eight out (column `x`'s byte `j` is row `j`'s byte `x`), by three rounds of
/// byte, word and dword unpacks (24 shuffles for 128 bytes, where the general registers
/// took about 150 operations).
///
/// # Safety
/// The CPU has SSE2 (every x86-64 does), and the caller is compiled for it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn transpose_8x16_sse2(rows: [&[u8]; 8]) -> [u64; 16] {
    use std::arch::x86_64::*;
    // SAFETY: each load reads 16 bytes of a row of at least 16 (the slices' bounds are
    // checked first); the stores write into `out`'s 128 bytes.
    unsafe {
        let r: [__m128i; 8] = std::array::from_fn(|j| {
            let row = &rows[j][..16];
            _mm_loadu_si128(row.as_ptr().cast())
        });
        // Byte pairs of rows (0,1), (2,3), (4,5), (6,7): channels 0-7, then 8-15.
        let a: [__m128i; 8] = std::array::from_fn(|i| {
            let (x, y) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
            if i % 2 == 0 {
                _mm_unpacklo_epi8(x, y)
            } else {
                _mm_unpackhi_epi8(x, y)
            }
        });
        // Four rows' bytes of channels 0-3, 4-7, 8-11, 12-15 for rows 0-3, then 4-7.
        let q: [__m128i; 8] = std::array::from_fn(|i| {
            let (half, k) = (i / 4, i % 4);
            let (x, y) = (a[4 * half + k / 2], a[4 * half + 2 + k / 2]);
            if k % 2 == 0 {
                _mm_unpacklo_epi16(x, y)
            } else {
                _mm_unpackhi_epi16(x, y)
            }
        });
        // Eight rows' bytes of two channels each: 0-1, 2-3, ..., 14-15.
        let mut out = [0u64; 16];
        for k in 0..4 {
            let (x, y) = (q[k], q[4 + k]);
            let lo = _mm_unpacklo_epi32(x, y);
            let hi = _mm_unpackhi_epi32(x, y);
            _mm_storeu_si128(out[4 * k..].as_mut_ptr().cast(), lo);
            _mm_storeu_si128(out[4 * k + 2..].as_mut_ptr().cast(), hi);
        }
        out
    }
}

/// `n` token rows `stride` bytes apart, each starting at one head's vector.
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    /// The first row's bytes onward.
    pub bytes: &'a [u8],
    /// Bytes from one token to the next.
    pub stride: usize,
    /// Tokens.
    pub n: usize,
}

/// Consecutive tokens of one KV head in wire layout (`[token][kv_head][head_dim]`), already
/// in the pool's dtype: token `t`'s vector starts at byte `t * stride` of `k` and `v`.
#[derive(Debug, Clone, Copy)]
pub struct WireTokens<'a> {
    /// Keys, starting at the first token's head vector.
    pub k: &'a [u8],
    /// Values, likewise.
    pub v: &'a [u8],
    /// Bytes from one token to the next.
    pub stride: usize,
    /// Tokens.
    pub n: usize,
}

impl BlockGeometry {
    /// Copies `src` into head `h` of `block`, slots `slot0..slot0 + src.n`.
    pub fn copy_tokens(&self, block: &mut [u8], h: usize, slot0: usize, src: WireTokens<'_>) {
        let WireTokens { k, v, stride, n } = src;
        let es = self.dtype.size();
        let (b, d) = (self.block_size, self.head_dim);
        let head = &mut block[self.head_range(h)];
        let (kt, vs) = head.split_at_mut(b * d * es);
        copy_values(vs, v, d * es, slot0, n, stride);
        // K is transposed: each channel's row gets `n` consecutive slots. Element copies of a
        // constant width, so they compile to moves rather than `memcpy` calls.
        fn scatter<const E: usize>(
            kt: &mut [u8],
            k: &[u8],
            b: usize,
            d: usize,
            slot0: usize,
            n: usize,
            stride: usize,
        ) {
            for c in 0..d {
                let row = &mut kt[(c * b + slot0) * E..(c * b + slot0 + n) * E];
                for (t, dst) in row.chunks_exact_mut(E).enumerate() {
                    let at = t * stride + c * E;
                    let src: [u8; E] = k[at..at + E].try_into().unwrap_or([0; E]);
                    dst.copy_from_slice(&src);
                }
            }
        }
        match es {
            2 => scatter::<2>(kt, k, b, d, slot0, n, stride),
            _ => scatter::<4>(kt, k, b, d, slot0, n, stride),
        }
    }
}

impl BlockGeometry {
    /// True when [`BlockGeometry::copy_tokens_digest`] takes this dtype: the ones a prefill
    /// node sends (f32, f16, bf16), not the scaled 8-bit ones, which an ingest converts to.
    pub fn folds_digest_in_copy(&self) -> bool {
        matches!(self.dtype, KvDType::F32 | KvDType::F16 | KvDType::Bf16)
    }

    /// As [`BlockGeometry::copy_tokens`], folding the keys into `digest` (the block's minima and
    /// maxima) in the same pass over K, so no f32 copy of the keys is made. Only for dtypes where
    /// [`BlockGeometry::folds_digest_in_copy`]; an 8-bit block is left untouched.
    pub fn copy_tokens_digest(
        &self,
        block: &mut [u8],
        h: usize,
        slot0: usize,
        src: WireTokens<'_>,
        digest: (&mut [f32], &mut [f32]),
    ) {
        let WireTokens { k, v, stride, n } = src;
        self.copy_value_rows(
            block,
            h,
            slot0,
            Rows {
                bytes: v,
                stride,
                n,
            },
        );
        self.copy_keys_digest(
            block,
            h,
            slot0,
            Rows {
                bytes: k,
                stride,
                n,
            },
            digest,
        );
    }

    /// V rows of head `h` into slots `slot0..slot0 + rows.n` of `block`.
    pub fn copy_value_rows(&self, block: &mut [u8], h: usize, slot0: usize, rows: Rows<'_>) {
        let es = self.dtype.size();
        let (b, d) = (self.block_size, self.head_dim);
        let head = &mut block[self.head_range(h)];
        let vs = &mut head[b * d * es..];
        copy_values(vs, rows.bytes, d * es, slot0, rows.n, rows.stride);
    }

    /// K rows of head `h`, transposed into slots `slot0..slot0 + rows.n` of `block` and folded
    /// into `digest` (the block's minima and maxima, `head_dim` each) on the way. Dtypes as
    /// [`BlockGeometry::copy_tokens_digest`].
    pub fn copy_keys_digest(
        &self,
        block: &mut [u8],
        h: usize,
        slot0: usize,
        rows: Rows<'_>,
        (min, max): (&mut [f32], &mut [f32]),
    ) {
        let Rows {
            bytes: k,
            stride,
            n,
        } = rows;
        let es = self.dtype.size();
        let (b, d) = (self.block_size, self.head_dim);
        debug_assert!(self.folds_digest_in_copy());
        let head = &mut block[self.head_range(h)];
        let kt = &mut head[..b * d * es];
        // Monomorphised per element width so the conversion inlines into the copy loop.
        #[allow(clippy::too_many_arguments)]
        fn fold<const E: usize>(
            kt: &mut [u8],
            k: &[u8],
            (b, d, slot0, n, stride): (usize, usize, usize, usize, usize),
            to_f32: impl Fn([u8; E]) -> f32,
            min: &mut [f32],
            max: &mut [f32],
        ) {
            for c in 0..d {
                let row = &mut kt[(c * b + slot0) * E..(c * b + slot0 + n) * E];
                let (mut lo, mut hi) = (min[c], max[c]);
                for (t, dst) in row.chunks_exact_mut(E).enumerate() {
                    let at = t * stride + c * E;
                    let x: [u8; E] = k[at..at + E].try_into().unwrap_or([0; E]);
                    dst.copy_from_slice(&x);
                    let f = to_f32(x);
                    lo = lo.min(f);
                    hi = hi.max(f);
                }
                min[c] = lo;
                max[c] = hi;
            }
        }
        let shape = (b, d, slot0, n, stride);
        #[cfg(target_arch = "x86_64")]
        if crate::fold_avx2::fold_keys(self.dtype, kt, k, shape, min, max) {
            return;
        }
        match self.dtype {
            KvDType::Bf16 => fold::<2>(
                kt,
                k,
                shape,
                |x| f32::from_bits(u32::from(u16::from_le_bytes(x)) << 16),
                min,
                max,
            ),
            KvDType::F16 => fold::<2>(
                kt,
                k,
                shape,
                |x| half::f16::from_le_bytes(x).to_f32(),
                min,
                max,
            ),
            KvDType::F32 => fold::<4>(kt, k, shape, f32::from_le_bytes, min, max),
            KvDType::I8 | KvDType::F8E4M3 => {}
        }
    }
}

/// Copies `n` V rows of `row` bytes, `stride` apart in `v`, to slots `slot0..` of `vs`.
fn copy_values(vs: &mut [u8], v: &[u8], row: usize, slot0: usize, n: usize, stride: usize) {
    let dst = &mut vs[slot0 * row..(slot0 + n) * row];
    #[cfg(target_arch = "x86_64")]
    if n >= STREAM_MIN_ROWS
        && row.is_multiple_of(32)
        && (dst.as_ptr() as usize).is_multiple_of(32)
        && is_x86_feature_detected!("avx")
    {
        // SAFETY: AVX checked; `dst` is 32-byte aligned and holds n rows of `row` bytes (a
        // multiple of 32); the bounds of `v` are checked inside.
        unsafe {
            stream_rows_avx(dst, v, row, n, stride);
            // Order the streamed stores before anything that publishes the block.
            std::arch::x86_64::_mm_sfence();
        }
        return;
    }
    for (t, d) in dst.chunks_exact_mut(row).enumerate() {
        d.copy_from_slice(&v[t * stride..t * stride + row]);
    }
}

/// Runs of at least this many V rows are written with non-temporal stores.
#[cfg(target_arch = "x86_64")]
const STREAM_MIN_ROWS: usize = 8;

/// Copies rows with non-temporal stores: an ingest writes the pool once and does not read it
/// back soon, so fetching each destination line first (what a plain store does) only doubles
/// the memory traffic. `bench store`: 8-17% faster for the whole ingest store path. The
/// caller fences (`_mm_sfence`) before it publishes what was written.
///
/// # Safety
/// AVX; `dst` 32-byte aligned, `dst.len() == n * row`, `row` a multiple of 32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
pub(crate) unsafe fn stream_rows_avx(
    dst: &mut [u8],
    v: &[u8],
    row: usize,
    n: usize,
    stride: usize,
) {
    use std::arch::x86_64::*;
    assert!(
        n == 0 || v.len() >= (n - 1) * stride + row,
        "V rows out of bounds"
    );
    debug_assert!(
        dst.len() == n * row
            && row.is_multiple_of(32)
            && (dst.as_ptr() as usize).is_multiple_of(32)
    );
    for t in 0..n {
        for i in (0..row).step_by(32) {
            // SAFETY: t < n and i + 32 <= row, within both buffers (checked above); the
            // destination offset keeps the 32-byte alignment.
            unsafe {
                let x = _mm256_loadu_si256(v.as_ptr().add(t * stride + i).cast());
                _mm256_stream_si256(dst.as_mut_ptr().add(t * row + i).cast(), x);
            }
        }
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
    use proptest::prelude::*;

    #[test]
    fn fused_digest_copy_equals_copy_then_digest() {
        let cases = [
            (KvDType::Bf16, 16, 8, 11, 3),
            (KvDType::F32, 16, 8, 11, 3),
            (KvDType::Bf16, 32, 128, 33, 0),
            (KvDType::Bf16, 32, 64, 20, 7),
            (KvDType::Bf16, 8, 8, 3, 5),
            // Longer runs: several groups of 8 tokens, then single ones (the AVX2 path).
            (KvDType::Bf16, 32, 64, 30, 2),
            (KvDType::Bf16, 64, 16, 60, 0),
            (KvDType::Bf16, 64, 24, 25, 39),
            // The f16 and f32 SIMD paths: whole groups of 8, single tokens, an offset slot.
            (KvDType::F16, 32, 64, 30, 2),
            (KvDType::F16, 64, 24, 25, 39),
            (KvDType::F32, 32, 64, 30, 2),
            (KvDType::F32, 64, 24, 25, 39),
        ];
        for (dtype, bs, d, n, slot0) in cases {
            let geom = BlockGeometry {
                block_size: bs,
                num_kv_heads: 2,
                head_dim: d,
                dtype,
            };
            let es = dtype.size();
            let row = geom.num_kv_heads * geom.head_dim * es;
            // Some NaN keys, which the digest skips; every channel's extremes somewhere.
            let vals: Vec<f32> = (0..n * row / es)
                .map(|i| match i % 89 {
                    13 => f32::NAN,
                    _ => ((i * 37 % 101) as f32 - 50.0) * 0.03,
                })
                .collect();
            let mut wire = vec![0u8; vals.len() * es];
            encode_from_f32(dtype, &vals, &mut wire);
            let m = n - 1;
            let m = m.min(bs - slot0);
            let src = WireTokens {
                k: &wire[row / 2..],
                v: &wire,
                stride: row,
                n: m,
            };
            let (mut a, mut b) = (vec![0u8; geom.block_bytes()], vec![0u8; geom.block_bytes()]);
            geom.copy_tokens(&mut a, 1, slot0, src);
            let mut dg = crate::Digest::new(d);
            for t in 0..m {
                let mut k = vec![0f32; d];
                let at = row / 2 + t * row;
                decode_to_f32(dtype, &wire[at..at + d * es], &mut k);
                dg.update(&k);
            }
            let mut got = crate::Digest::new(d);
            assert!(geom.folds_digest_in_copy());
            geom.copy_tokens_digest(&mut b, 1, slot0, src, (&mut got.min, &mut got.max));
            assert_eq!(a, b, "{dtype:?}");
            assert_eq!(got, dg, "{dtype:?}");
        }
    }

    #[test]
    fn whole_blocks_streamed_at_every_alignment_equal_the_plain_copy() {
        let dtypes = [KvDType::Bf16, KvDType::F16, KvDType::F32];
        for (dtype, (bs, d)) in dtypes
            .into_iter()
            .flat_map(|t| [(32, 128), (16, 64), (32, 8), (8, 16)].map(|s| (t, s)))
        {
            let geom = BlockGeometry {
                block_size: bs,
                num_kv_heads: 2,
                head_dim: d,
                dtype,
            };
            let es = dtype.size();
            let row = geom.num_kv_heads * d * es;
            let vals: Vec<f32> = (0..bs * row / es)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.07)
                .collect();
            let mut wire = vec![0u8; vals.len() * es];
            encode_from_f32(dtype, &vals, &mut wire);
            let src = WireTokens {
                k: &wire[d * es..],
                v: &wire[d * es..],
                stride: row,
                n: bs,
            };
            let mut want = vec![0u8; geom.block_bytes()];
            geom.copy_tokens(&mut want, 1, 0, src);
            let mut want_dg = crate::Digest::new(d);
            for t in 0..bs {
                let mut k = vec![0f32; d];
                decode_to_f32(dtype, &wire[d * es + t * row..][..d * es], &mut k);
                want_dg.update(&k);
            }
            let mut buf = vec![0u8; geom.block_bytes() + 64];
            for shift in [0, 16, 32, 48, 1] {
                buf.fill(0);
                let block = &mut buf[shift..shift + geom.block_bytes()];
                let mut dg = crate::Digest::new(d);
                geom.copy_tokens_digest(block, 1, 0, src, (&mut dg.min, &mut dg.max));
                assert_eq!(block, &want[..], "{dtype:?} bs {bs} d {d} shift {shift}");
                assert_eq!(dg, want_dg, "{dtype:?} bs {bs} d {d} shift {shift}");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(17), ..ProptestConfig::default() })]
        /// The fused copy (SIMD where the CPU has it) writes the bytes of the plain copy and
        /// the digest of the keys decoded one by one, for random shapes and runs, with NaN,
        /// infinite and subnormal keys among them.
        #[test]
        fn fused_keys_equal_the_scalar_copy_and_digest(
            dtype in proptest::sample::select(vec![KvDType::Bf16, KvDType::F16, KvDType::F32]),
            bs in proptest::sample::select(vec![8usize, 16, 32, 64]),
            d in (1usize..=17).prop_map(|x| 8 * x),
            hk in 1usize..=3,
            seed in any::<u64>(),
            // (slot0, n) as fractions of the block.
            at in 0f64..1.0,
            len in 0f64..=1.0,
        ) {
            let slot0 = ((at * bs as f64) as usize).min(bs - 1);
            let n = ((len * (bs - slot0) as f64).ceil() as usize).clamp(1, bs - slot0);
            let h = (seed % hk as u64) as usize;
            let geom = BlockGeometry { block_size: bs, num_kv_heads: hk, head_dim: d, dtype };
            let es = dtype.size();
            let row = hk * d * es;
            let mut r = seed;
            let vals: Vec<f32> = (0..n * row / es)
                .map(|_| {
                    r = r.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    match r >> 58 {
                        0 => f32::NAN,
                        1 => f32::INFINITY,
                        2 => f32::NEG_INFINITY,
                        3 => 1e-41 * (r >> 40 & 0xff) as f32, // subnormal in f32 (zero in f16)
                        4 => 3e-6,                            // subnormal in f16
                        _ => ((r >> 32) as u32 as f32 / u32::MAX as f32 - 0.5) * 8.0,
                    }
                })
                .collect();
            let mut wire = vec![0u8; vals.len() * es];
            encode_from_f32(dtype, &vals, &mut wire);
            let src = WireTokens { k: &wire[h * d * es..], v: &wire, stride: row, n };
            let (mut want, mut got) = (vec![7u8; geom.block_bytes()], vec![7u8; geom.block_bytes()]);
            geom.copy_tokens(&mut want, h, slot0, src);
            let mut want_dg = crate::Digest::new(d);
            let mut k = vec![0f32; d];
            for t in 0..n {
                decode_to_f32(dtype, &wire[h * d * es + t * row..][..d * es], &mut k);
                want_dg.update(&k);
            }
            let mut dg = crate::Digest::new(d);
            geom.copy_tokens_digest(&mut got, h, slot0, src, (&mut dg.min, &mut dg.max));
            prop_assert_eq!(&got, &want, "{:?} bs {} d {} slot0 {} n {}", dtype, bs, d, slot0, n);
            // Bitwise, so NaN-free extremes and signed zeros compare exactly.
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&dg.min), bits(&want_dg.min));
            prop_assert_eq!(bits(&dg.max), bits(&want_dg.max));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(23), ..ProptestConfig::default() })]
        /// The converting path (`write_keys` then `write_values`: eight tokens at a time,
        /// their scales by vector divisions, AVX2 codes transposed sixteen or eight channels
        /// at a time where the CPU has it) writes the bytes that each token written alone by
        /// `write_token` does, and the digest that `Digest::update` folds, for random head
        /// dims (whole vectors or not), blocks, runs and row gaps, with NaN, infinite,
        /// subnormal and large values among them.
        #[test]
        fn converted_runs_equal_tokens_written_alone(
            dtype in proptest::sample::select(vec![
                KvDType::I8, KvDType::F8E4M3, KvDType::F16, KvDType::Bf16, KvDType::F32,
            ]),
            bs in proptest::sample::select(vec![8usize, 16, 32, 64]),
            d in 1usize..=150,
            hk in 1usize..=3,
            seed in any::<u64>(),
            // (slot0, n) as fractions of the block.
            at in 0f64..1.0,
            len in 0f64..=1.0,
            gap in 0usize..=9,
        ) {
            let slot0 = ((at * bs as f64) as usize).min(bs - 1);
            let n = ((len * (bs - slot0) as f64).ceil() as usize).clamp(1, bs - slot0);
            let h = (seed % hk as u64) as usize;
            let geom = BlockGeometry { block_size: bs, num_kv_heads: hk, head_dim: d, dtype };
            let stride = d + gap;
            let mut r = seed;
            let mut rows = || -> Vec<f32> {
                (0..n * stride)
                    .map(|_| {
                        r = r.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        match r >> 57 {
                            0 => f32::NAN,
                            1 => f32::INFINITY,
                            2 => f32::NEG_INFINITY,
                            3 => 1e-41 * (r >> 40 & 0xff) as f32, // subnormal
                            4 => -3e37,
                            _ => ((r >> 32) as u32 as f32 / u32::MAX as f32 - 0.5) * 8.0,
                        }
                    })
                    .collect()
            };
            let (k, v) = (rows(), rows());
            let (mut want, mut got) = (vec![7u8; geom.block_bytes()], vec![7u8; geom.block_bytes()]);
            let mut want_dg = crate::Digest::new(d);
            for i in 0..n {
                let (ki, vi) = (&k[i * stride..][..d], &v[i * stride..][..d]);
                geom.write_token(&mut want, h, slot0 + i, ki, vi);
                want_dg.update(ki);
            }
            let mut dg = crate::Digest::new(d);
            geom.write_keys(&mut got, (h, slot0), &k, (stride, n), (&mut dg.min, &mut dg.max));
            geom.write_values(&mut got, (h, slot0), &v, (stride, n));
            prop_assert!(got == want, "{:?} bs {} d {} slot0 {} n {}", dtype, bs, d, slot0, n);
            // NaN never enters a digest; zeros of either sign compare equal.
            prop_assert_eq!(&dg.min, &want_dg.min);
            prop_assert_eq!(&dg.max, &want_dg.max);
        }
    }

    #[test]
    fn value_rows_land_alike_streamed_or_not() {
        let (row, stride, n, slot0) = (64, 96, 12, 3);
        let v: Vec<u8> = (0..n * stride).map(|i| (i * 7 % 253) as u8).collect();
        let mut want = vec![0u8; (slot0 + n + 1) * row];
        for t in 0..n {
            want[(slot0 + t) * row..(slot0 + t + 1) * row]
                .copy_from_slice(&v[t * stride..t * stride + row]);
        }
        // Every alignment of the destination: streamed where it is 32-byte aligned.
        let mut buf = vec![0u8; want.len() + 64];
        for shift in 0..32 {
            buf.fill(0);
            let dst = &mut buf[shift..shift + want.len()];
            copy_values(dst, &v, row, slot0, n, stride);
            assert_eq!(dst, &want[..], "shift {shift}");
        }
    }

    /// A run of tokens written at once (the ingest's converting path: keys then values, 8
    /// wide on AVX2, keys transposed eight by eight) lands as each written alone, with its
    /// keys folded into the digest, for every dtype: head dims of several 8-lane vectors and
    /// a rest, runs of one, of eight and a rest, of two eights, starting mid-block or not,
    /// rows apart in their buffer, and an infinity and a NaN among the values (their
    /// vectors' scale NaN).
    #[test]
    fn a_run_of_tokens_lands_as_each_token_alone() {
        let dtypes = [
            KvDType::F32,
            KvDType::F16,
            KvDType::Bf16,
            KvDType::I8,
            KvDType::F8E4M3,
        ];
        for dtype in dtypes {
            for d in [8, 67, 128] {
                let g = BlockGeometry {
                    block_size: 16,
                    num_kv_heads: 2,
                    head_dim: d,
                    dtype,
                };
                for (slot0, n) in [(3, 11), (0, 16), (5, 1), (1, 9)] {
                    let stride = 2 * d + 5;
                    let mut x = 0.37f32;
                    let mut next = || {
                        x = (x * 7.31 + 0.113).fract();
                        (x - 0.5) * 9.0
                    };
                    let mut k: Vec<f32> = (0..n * stride).map(|_| next()).collect();
                    let mut v: Vec<f32> = (0..n * stride).map(|_| next()).collect();
                    k[2.min(n - 1) * stride + 5] = f32::INFINITY;
                    v[4.min(n - 1) * stride + 1] = f32::NAN;
                    let (mut one, mut run) =
                        (vec![0u8; g.block_bytes()], vec![0u8; g.block_bytes()]);
                    let (mut lo, mut hi) = (vec![f32::INFINITY; d], vec![f32::NEG_INFINITY; d]);
                    for i in 0..n {
                        let (ki, vi) = (&k[i * stride..][..d], &v[i * stride..][..d]);
                        g.write_token(&mut one, 1, slot0 + i, ki, vi);
                        for c in 0..d {
                            lo[c] = lo[c].min(ki[c]);
                            hi[c] = hi[c].max(ki[c]);
                        }
                    }
                    let (mut lo2, mut hi2) = (vec![f32::INFINITY; d], vec![f32::NEG_INFINITY; d]);
                    g.write_keys(&mut run, (1, slot0), &k, (stride, n), (&mut lo2, &mut hi2));
                    g.write_values(&mut run, (1, slot0), &v, (stride, n));
                    assert!(one == run, "{dtype} d={d}: the block");
                    assert_eq!((lo, hi), (lo2, hi2), "{dtype} d={d}: the digest");
                }
            }
        }
    }

    #[test]
    fn bytes_transpose_eight_by_eight() {
        let m: [[u8; 8]; 8] = std::array::from_fn(|i| std::array::from_fn(|j| (16 * i + j) as u8));
        let t = transpose_8x8(m.map(u64::from_le_bytes)).map(u64::to_le_bytes);
        for (i, row) in m.iter().enumerate() {
            for (j, x) in row.iter().enumerate() {
                assert_eq!(t[j][i], *x, "({i}, {j})");
            }
        }
    }

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
