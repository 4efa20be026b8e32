//! An ingest's keys in AVX2 (x86-64): K rows transposed into a block's channel rows, 8 tokens
//! x 8 channels in registers at a time, with the block's digest (each channel's minimum and
//! maximum) taken from the untransposed rows on the way, so every lane is one channel and no
//! horizontal reduction is needed. One loop for every wire dtype ([`Keys`]): bf16 and f16
//! share the 16-bit transpose and differ in how a key widens to f32 for the digest (a shift,
//! or F16C); f32 has its own transpose.
//!
//! Whole blocks leave through non-temporal stores (`block::stream_rows_avx`, as V rows do);
//! tokens past a multiple of 8 go one by one. Min/max operands are ordered so a NaN key is
//! skipped, as `f32::min` does on the scalar path, which tests compare these with.

use std::arch::x86_64::*;

use crate::dtype::KvDType;

/// `(block_size, head_dim, first slot, tokens, bytes from one token's keys to the next)`.
pub(crate) type Shape = (usize, usize, usize, usize, usize);

/// Longest block whose K rows are streamed whole.
const STREAM_MAX_SLOTS: usize = 128;

/// Transposes `n` keys of `dtype` into slots `slot0..` of `kt` (`[d][b]`) and folds them into
/// `min`/`max`, if this CPU and shape take a SIMD path; false (nothing written) otherwise.
///
/// # Panics
/// Where the slices do not hold the shape: the same checks as the scalar path's indexing.
pub(crate) fn fold_keys(
    dtype: KvDType,
    kt: &mut [u8],
    k: &[u8],
    shape: Shape,
    min: &mut [f32],
    max: &mut [f32],
) -> bool {
    let (b, d, slot0, n, stride) = shape;
    let es = dtype.size();
    if !d.is_multiple_of(8) || n < 8 || !available(dtype) {
        return false;
    }
    assert!(
        slot0 + n <= b
            && kt.len() >= d * b * es
            && k.len() >= (n - 1) * stride + d * es
            && min.len() >= d
            && max.len() >= d,
        "keys out of bounds: {n} tokens from slot {slot0} of {b}, head dim {d}, {} key bytes {stride} apart",
        k.len()
    );
    // SAFETY: the CPU has the features `available` names; the bounds were checked above.
    unsafe {
        match dtype {
            KvDType::Bf16 => fold::<Half<false>>(kt, k, shape, min, max),
            KvDType::F16 => fold::<Half<true>>(kt, k, shape, min, max),
            KvDType::F32 => fold::<F32x8>(kt, k, shape, min, max),
            KvDType::I8 | KvDType::F8E4M3 => unreachable!("no SIMD fold for {dtype:?}"),
        }
    }
    true
}

/// True where this CPU has a SIMD fold for `dtype`.
fn available(dtype: KvDType) -> bool {
    matches!(dtype, KvDType::Bf16 | KvDType::F16 | KvDType::F32)
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("f16c")
}

/// A whole block's K rows, staged for streaming: 8 channel rows of up to
/// [`STREAM_MAX_SLOTS`] f32 keys (or twice as many 16-bit ones).
#[repr(align(32))]
struct Lines {
    _bytes: [u8; 8 * STREAM_MAX_SLOTS * 4],
}

/// True when a call writes whole channel rows of a 32-byte aligned block, which then
/// leave through `Lines` and non-temporal stores.
fn streams(kt: &[u8], (b, _, slot0, n, _): Shape, es: usize) -> bool {
    slot0 == 0
        && n == b
        && (b * es).is_multiple_of(32)
        && b <= STREAM_MAX_SLOTS
        && (kt.as_ptr() as usize).is_multiple_of(32)
}

/// Copies token `t`'s 8 keys of channels `c0..c0 + 8` (`es` bytes each) to their rows, one by
/// one: the tokens past the last whole group of 8.
fn scatter_one(
    kt: &mut [u8],
    k: &[u8],
    (b, _, slot0, _, stride): Shape,
    es: usize,
    c0: usize,
    t: usize,
) {
    let at = t * stride + c0 * es;
    for j in 0..8 {
        let dst = ((c0 + j) * b + slot0 + t) * es;
        kt[dst..dst + es].copy_from_slice(&k[at + j * es..at + (j + 1) * es]);
    }
}

/// Eight rows of 8 16-bit values transposed: row `j` of the result holds element `j` of each.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose_8x8_u16(r: &[__m128i; 8]) -> [__m128i; 8] {
    let a = [
        _mm_unpacklo_epi16(r[0], r[1]),
        _mm_unpackhi_epi16(r[0], r[1]),
        _mm_unpacklo_epi16(r[2], r[3]),
        _mm_unpackhi_epi16(r[2], r[3]),
        _mm_unpacklo_epi16(r[4], r[5]),
        _mm_unpackhi_epi16(r[4], r[5]),
        _mm_unpacklo_epi16(r[6], r[7]),
        _mm_unpackhi_epi16(r[6], r[7]),
    ];
    let bb = [
        _mm_unpacklo_epi32(a[0], a[2]),
        _mm_unpackhi_epi32(a[0], a[2]),
        _mm_unpacklo_epi32(a[1], a[3]),
        _mm_unpackhi_epi32(a[1], a[3]),
        _mm_unpacklo_epi32(a[4], a[6]),
        _mm_unpackhi_epi32(a[4], a[6]),
        _mm_unpacklo_epi32(a[5], a[7]),
        _mm_unpackhi_epi32(a[5], a[7]),
    ];
    [
        _mm_unpacklo_epi64(bb[0], bb[4]),
        _mm_unpackhi_epi64(bb[0], bb[4]),
        _mm_unpacklo_epi64(bb[1], bb[5]),
        _mm_unpackhi_epi64(bb[1], bb[5]),
        _mm_unpacklo_epi64(bb[2], bb[6]),
        _mm_unpackhi_epi64(bb[2], bb[6]),
        _mm_unpacklo_epi64(bb[3], bb[7]),
        _mm_unpackhi_epi64(bb[3], bb[7]),
    ]
}

/// Eight rows of 8 f32 transposed, as [`transpose_8x8_u16`].
#[inline]
#[target_feature(enable = "avx")]
fn transpose_8x8_f32(r: &[__m256; 8]) -> [__m256; 8] {
    // Pairs of tokens interleaved, then fours per 128-bit lane, then the lanes exchanged.
    let t = [
        _mm256_unpacklo_ps(r[0], r[1]),
        _mm256_unpackhi_ps(r[0], r[1]),
        _mm256_unpacklo_ps(r[2], r[3]),
        _mm256_unpackhi_ps(r[2], r[3]),
        _mm256_unpacklo_ps(r[4], r[5]),
        _mm256_unpackhi_ps(r[4], r[5]),
        _mm256_unpacklo_ps(r[6], r[7]),
        _mm256_unpackhi_ps(r[6], r[7]),
    ];
    let s = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    [
        _mm256_permute2f128_ps::<0x20>(s[0], s[4]),
        _mm256_permute2f128_ps::<0x20>(s[1], s[5]),
        _mm256_permute2f128_ps::<0x20>(s[2], s[6]),
        _mm256_permute2f128_ps::<0x20>(s[3], s[7]),
        _mm256_permute2f128_ps::<0x31>(s[0], s[4]),
        _mm256_permute2f128_ps::<0x31>(s[1], s[5]),
        _mm256_permute2f128_ps::<0x31>(s[2], s[6]),
        _mm256_permute2f128_ps::<0x31>(s[3], s[7]),
    ]
}

/// Eight keys of one token, as [`fold`] loads, widens, transposes and stores them.
trait Keys: Copy {
    /// Bytes of one key.
    const SIZE: usize;

    /// # Safety
    /// `8 * SIZE` readable bytes at `p`; AVX2 and F16C.
    unsafe fn load(p: *const u8) -> Self;

    /// # Safety
    /// AVX2 and F16C.
    unsafe fn widen(self) -> __m256;

    /// Eight tokens' keys as eight channels' rows.
    ///
    /// # Safety
    /// AVX2.
    unsafe fn transpose(r: &[Self; 8]) -> [Self; 8];

    /// # Safety
    /// `8 * SIZE` writable bytes at `p`; AVX2.
    unsafe fn store(self, p: *mut u8);
}

/// 16-bit keys: f16 when `F16` (widened by F16C), else bf16 (a bf16 value is its f32's high
/// half).
#[derive(Clone, Copy)]
struct Half<const F16: bool>(__m128i);

/// f32 keys.
#[derive(Clone, Copy)]
struct F32x8(__m256);

impl<const F16: bool> Keys for Half<F16> {
    const SIZE: usize = 2;
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load(p: *const u8) -> Self {
        // SAFETY: 16 readable bytes at `p` (the caller's contract).
        Self(unsafe { _mm_loadu_si128(p.cast()) })
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn widen(self) -> __m256 {
        if F16 {
            _mm256_cvtph_ps(self.0)
        } else {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(self.0)))
        }
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn transpose(r: &[Self; 8]) -> [Self; 8] {
        transpose_8x8_u16(&r.map(|x| x.0)).map(Self)
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn store(self, p: *mut u8) {
        // SAFETY: 16 writable bytes at `p` (the caller's contract).
        unsafe { _mm_storeu_si128(p.cast(), self.0) }
    }
}

impl Keys for F32x8 {
    const SIZE: usize = 4;
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load(p: *const u8) -> Self {
        // SAFETY: 32 readable bytes at `p` (the caller's contract).
        Self(unsafe { _mm256_loadu_ps(p.cast()) })
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn widen(self) -> __m256 {
        self.0
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn transpose(r: &[Self; 8]) -> [Self; 8] {
        transpose_8x8_f32(&r.map(|x| x.0)).map(Self)
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn store(self, p: *mut u8) {
        // SAFETY: 32 writable bytes at `p` (the caller's contract).
        unsafe { _mm256_storeu_ps(p.cast(), self.0) }
    }
}

/// The fold for keys `K`.
///
/// # Safety
/// AVX2 and F16C; the bounds [`fold_keys`] checks; `d` a multiple of 8.
#[target_feature(enable = "avx2,f16c")]
unsafe fn fold<K: Keys>(kt: &mut [u8], k: &[u8], shape: Shape, min: &mut [f32], max: &mut [f32]) {
    let (b, d, slot0, n, stride) = shape;
    let es = K::SIZE;
    // Uninitialised: only the bytes the transposes write are read back (zeroing 2 KiB per
    // call was 5% of an ingest).
    let mut lines = std::mem::MaybeUninit::<Lines>::uninit();
    let stream = streams(kt, shape, es);
    for c0 in (0..d).step_by(8) {
        // SAFETY: c0 + 8 <= d <= min.len(), max.len() (checked).
        let (mut lo, mut hi) = unsafe {
            (
                _mm256_loadu_ps(min.as_ptr().add(c0)),
                _mm256_loadu_ps(max.as_ptr().add(c0)),
            )
        };
        // SAFETY (every call below): the features are this function's; each pointer's bytes
        // lie where its comment says.
        let mut t0 = 0;
        while t0 + 8 <= n {
            // Token t0+i < n, channels c0..c0+8 <= d: inside `k` (checked).
            let r: [K; 8] = std::array::from_fn(|i| unsafe {
                K::load(k.as_ptr().add((t0 + i) * stride + c0 * es))
            });
            for x in &r {
                let f = unsafe { x.widen() };
                lo = _mm256_min_ps(f, lo);
                hi = _mm256_max_ps(f, hi);
            }
            // Channel rows c0..c0+8, each the 8 tokens t0..t0+8.
            for (j, row) in unsafe { K::transpose(&r) }.iter().enumerate() {
                let dst = if stream {
                    // j < 8 and t0 + 8 <= n = b <= STREAM_MAX_SLOTS: inside `lines`.
                    lines
                        .as_mut_ptr()
                        .cast::<u8>()
                        .wrapping_add((j * b + t0) * es)
                } else {
                    // Row c0+j < d, slots slot0+t0 .. +8 <= slot0 + n <= b.
                    kt.as_mut_ptr()
                        .wrapping_add(((c0 + j) * b + slot0 + t0) * es)
                };
                unsafe { row.store(dst) };
            }
            t0 += 8;
        }
        if stream {
            // Eight whole channel rows, streamed out: `lines` holds 8 rows of b*es bytes (a
            // multiple of 32), all written above (n = b tokens, a multiple of 8); `kt` is
            // 32-byte aligned and holds rows c0..c0+8 (checked).
            let row = b * es;
            unsafe {
                let staged = std::slice::from_raw_parts(lines.as_ptr().cast::<u8>(), 8 * row);
                let rows = &mut kt[c0 * row..(c0 + 8) * row];
                crate::block::stream_rows_avx(rows, staged, row, 8, row);
            }
        }
        for t in t0..n {
            // Token t < n, channels c0..c0+8 <= d.
            let f = unsafe { K::load(k.as_ptr().add(t * stride + c0 * es)).widen() };
            lo = _mm256_min_ps(f, lo);
            hi = _mm256_max_ps(f, hi);
            scatter_one(kt, k, shape, es, c0, t);
        }
        // SAFETY: as the loads above.
        unsafe {
            _mm256_storeu_ps(min.as_mut_ptr().add(c0), lo);
            _mm256_storeu_ps(max.as_mut_ptr().add(c0), hi);
        }
    }
    if stream {
        // Order the streamed stores before anything that publishes the block.
        _mm_sfence();
    }
}
