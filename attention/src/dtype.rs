//! Element types of KV blocks and their conversion to f32.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Storage type of K and V elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDType {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// Host KV only: 8-bit integers, each token's K and V vector of a head scaled by its own
    /// f32 (max |x| / 127), the scales kept in the block after the vectors. Half of f16's
    /// bytes; converted from the wire dtype on ingest, never sent on the wire.
    I8,
    /// Host KV only: fp8 e4m3 (OCP "fn": 4 exponent bits, 3 mantissa bits, no infinities),
    /// scaled per token and head like [`KvDType::I8`] (max |x| / 448, so each vector uses the
    /// format's whole range). Codes 0x7f and 0xff (the format's NaN) are never written: a
    /// vector holding a non-finite value gets a NaN scale instead.
    F8E4M3,
}

impl KvDType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            KvDType::F32 => 4,
            KvDType::F16 | KvDType::Bf16 => 2,
            KvDType::I8 | KvDType::F8E4M3 => 1,
        }
    }

    /// True for the dtypes stored with a scale per token and head ([`KvDType::I8`],
    /// [`KvDType::F8E4M3`]): the kernels multiply each token's scores by its K scale and its
    /// softmax weights by its V scale.
    pub const fn scaled(self) -> bool {
        matches!(self, KvDType::I8 | KvDType::F8E4M3)
    }

    /// The largest magnitude a scaled dtype's code holds (a vector's max |x| maps to it).
    const fn code_max(self) -> f32 {
        match self {
            KvDType::F8E4M3 => 448.0,
            _ => 127.0,
        }
    }

    /// Lower-case name used on the command line and in logs.
    pub const fn name(self) -> &'static str {
        match self {
            KvDType::F32 => "f32",
            KvDType::F16 => "f16",
            KvDType::Bf16 => "bf16",
            KvDType::I8 => "int8",
            KvDType::F8E4M3 => "fp8",
        }
    }

    /// Parses `f32`, `f16`, `bf16`, `int8` or `fp8` (e4m3), and their common spellings.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(KvDType::F32),
            "f16" | "float16" | "half" => Some(KvDType::F16),
            "bf16" | "bfloat16" => Some(KvDType::Bf16),
            "int8" | "i8" => Some(KvDType::I8),
            "fp8" | "fp8_e4m3" | "f8e4m3" | "float8_e4m3fn" => Some(KvDType::F8E4M3),
            _ => None,
        }
    }
}

impl std::fmt::Display for KvDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Decodes little-endian elements of `dtype` from `src` into `dst` (`dst.len()` elements).
/// Scaled dtypes ([`KvDType::scaled`]) decode to their codes' values: the caller applies the
/// scales.
///
/// `src` may be unaligned (it usually comes straight off the wire).
pub fn decode_to_f32(dtype: KvDType, src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len() * dtype.size());
    match dtype {
        KvDType::F32 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        KvDType::F16 => {
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("f16c") {
                // SAFETY: the CPU has F16C (and so AVX).
                unsafe { decode_f16_f16c(src, dst) };
                return;
            }
            match bytemuck::try_cast_slice::<u8, f16>(src) {
                Ok(h) => h.convert_to_f32_slice(dst),
                Err(_) => {
                    for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                        *d = f16::from_le_bytes([c[0], c[1]]).to_f32();
                    }
                }
            }
        }
        KvDType::Bf16 => {
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2.
                unsafe { decode_bf16_avx2(src, dst) };
                return;
            }
            decode_bf16(src, dst);
        }
        KvDType::I8 => {
            for (d, c) in dst.iter_mut().zip(src) {
                *d = f32::from(*c as i8);
            }
        }
        KvDType::F8E4M3 => {
            for (d, c) in dst.iter_mut().zip(src) {
                *d = f8_e4m3_value(*c);
            }
        }
    }
}

/// [`decode_to_f32`] of bf16: each element's bits the top half of an f32's, whatever the
/// alignment; a loop the compiler vectorises at its caller's features.
#[inline(always)]
fn decode_bf16(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
    }
}

/// [`decode_bf16`] compiled for AVX2 (8 at a time).
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn decode_bf16_avx2(src: &[u8], dst: &mut [f32]) {
    decode_bf16(src, dst);
}

/// [`decode_to_f32`] of f16 by F16C, 8 at a time from any alignment: wire bytes are as
/// often odd-aligned as not, and `half`'s slice conversion takes aligned input only (its
/// element-wise fallback asks for the CPU's features at every element).
///
/// # Safety
/// The CPU has F16C and AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
#[inline]
unsafe fn decode_f16_f16c(src: &[u8], dst: &mut [f32]) {
    // SAFETY: as this function's.
    unsafe { f16c_row(src, dst) }
}

/// The body of [`decode_f16_f16c`], for callers compiled with F16C to inline (a
/// `#[target_feature]` function may not be `#[inline(always)]`, and LLVM kept
/// [`decode_f16_f16c`] a call in [`decode_f16_rows_f16c`]'s loop: 9% of the store path into
/// an fp8 pool at SmolLM2's 3 heads of 64, where a row is 8 vectors).
///
/// # Safety
/// The CPU has F16C and AVX.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn f16c_row(src: &[u8], dst: &mut [f32]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
    let (src, dst) = (&src[..2 * dst.len()], dst);
    let (eights, rest) = dst.as_chunks_mut::<8>();
    let (src8, src_rest) = src.split_at(eights.len() * 16);
    for (d, s) in eights.iter_mut().zip(src8.chunks_exact(16)) {
        // SAFETY: `s` is 16 bytes, `d` 8 f32; both loads and stores are unaligned ones; the
        // CPU has F16C (the caller's promise).
        unsafe {
            let h = _mm_loadu_si128(s.as_ptr().cast::<__m128i>());
            _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
    }
    for (d, c) in rest.iter_mut().zip(src_rest.chunks_exact(2)) {
        *d = f16::from_le_bytes([c[0], c[1]]).to_f32();
    }
}

/// Decodes rows of `d` elements of `dtype`, `stride` bytes apart in `src` (the first at its
/// start), into consecutive rows of `dst`, as many as it holds: one head's tokens out of a
/// wire chunk, which holds every head's. The CPU's features are asked once for all rows (a
/// row of a small head is a few vectors).
pub fn decode_rows(dtype: KvDType, src: &[u8], stride: usize, dst: &mut [f32], d: usize) {
    let es = dtype.size();
    let rows = dst.chunks_exact_mut(d.max(1)).enumerate();
    if dtype == KvDType::F32 {
        // A copy: one loop for all rows, not a call a row.
        for (i, out) in rows {
            let src = &src[i * stride..][..4 * d];
            for (x, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    match dtype {
        KvDType::F16 if is_x86_feature_detected!("f16c") => {
            // SAFETY: the CPU has F16C.
            unsafe { decode_f16_rows_f16c(src, stride, dst, d) };
            return;
        }
        KvDType::Bf16 if is_x86_feature_detected!("avx2") => {
            // SAFETY: the CPU has AVX2.
            unsafe { decode_bf16_rows_avx2(src, stride, dst, d) };
            return;
        }
        _ => {}
    }
    for (i, out) in rows {
        decode_to_f32(dtype, &src[i * stride..][..d * es], out);
    }
}

/// [`decode_rows`] of bf16 compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn decode_bf16_rows_avx2(src: &[u8], stride: usize, dst: &mut [f32], d: usize) {
    for (i, out) in dst.chunks_exact_mut(d.max(1)).enumerate() {
        decode_bf16(&src[i * stride..][..2 * d], out);
    }
}

/// [`decode_rows`] of f16 compiled for F16C: the features asked once for all rows (1-3% of the
/// store path into int8 pools at SmolLM2's 3 heads of 64), and each row's conversion inlined
/// ([`f16c_row`]), not a call a row: a further 5-9% into int8 and 4-6% into fp8 there
/// (`cargo bench -p kv-transfer --bench store`, Xeon VM, two builds alternated twice).
///
/// # Safety
/// The CPU has F16C and AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn decode_f16_rows_f16c(src: &[u8], stride: usize, dst: &mut [f32], d: usize) {
    for (i, out) in dst.chunks_exact_mut(d.max(1)).enumerate() {
        // SAFETY: as this function's.
        unsafe { f16c_row(&src[i * stride..][..2 * d], out) };
    }
}

/// 2^120: moves an e4m3 exponent (bias 7) placed in an f32's exponent field (bias 127) to
/// its value.
pub(crate) const F8_REBIAS: f32 = f32::from_bits((127 + 120) << 23);
/// The f32 bits an e4m3 code keeps once sign-extended and shifted left by 20: the sign, and
/// the exponent and mantissa in the top of f32's fields.
pub(crate) const F8_MASK: u32 = 0x87f0_0000;

/// The value of an e4m3 code, the way the SIMD paths widen it (sign-extend, shift, mask,
/// rescale: subnormals come out exact as well). The NaN codes, never written, read as ±480.
#[inline(always)]
pub(crate) fn f8_e4m3_value(code: u8) -> f32 {
    f32::from_bits((((code as i8 as i32) << 20) as u32) & F8_MASK) * F8_REBIAS
}

/// Encodes `src` as little-endian elements of `dtype` into `dst` (`src.len() * size` bytes).
/// Scaled dtypes take values already divided by their scale (rounded, saturated).
#[inline]
pub fn encode_from_f32(dtype: KvDType, src: &[f32], dst: &mut [u8]) {
    debug_assert_eq!(dst.len(), src.len() * dtype.size());
    match dtype {
        KvDType::F32 => {
            for (s, c) in src.iter().zip(dst.chunks_exact_mut(4)) {
                c.copy_from_slice(&s.to_le_bytes());
            }
        }
        KvDType::F16 => {
            for (s, c) in src.iter().zip(dst.chunks_exact_mut(2)) {
                c.copy_from_slice(&f16::from_f32(*s).to_le_bytes());
            }
        }
        KvDType::Bf16 => {
            for (s, c) in src.iter().zip(dst.chunks_exact_mut(2)) {
                c.copy_from_slice(&bf16::from_f32(*s).to_le_bytes());
            }
        }
        KvDType::I8 | KvDType::F8E4M3 => {
            for (s, c) in src.iter().zip(dst) {
                *c = scaled_code(dtype, *s);
            }
        }
    }
}

/// The code of a scaled dtype nearest `x` (a value already divided by its scale): int8
/// rounded and saturated at ±127, fp8 as [`f8_code`]. NaN becomes 0 (a scaled vector is
/// never NaN: its scale is).
#[inline(always)]
fn scaled_code(dtype: KvDType, x: f32) -> u8 {
    match dtype {
        KvDType::F8E4M3 => f8_code(x),
        _ => i8_code(x),
    }
}

/// The int8 code nearest `x`, ties away from zero (`f32::round`'s), saturated at ±127; 0 for
/// NaN. Written without `round` (a libm call on x86-64's baseline, one per element, which
/// kept the ingest of int8 KV at 0.8 GB/s) and without branches, so loops over it vectorise:
/// the magnitude's integer part and whether the rest reaches one half, both exact below 2^24.
/// The integer part by an unchecked conversion of a value in range: `as` (saturating, NaN to
/// 0) compiled to a scalar conversion and two compares a lane, half of the loop's time.
#[inline(always)]
fn i8_code(x: f32) -> u8 {
    let a = if x.is_nan() { 0.0 } else { x.abs().min(255.0) };
    // SAFETY: `a` is in 0..=255, which i32 holds. (`as`, which saturates and sends NaN to 0,
    // was taken a lane at a time.)
    let whole = unsafe { a.to_int_unchecked::<i32>() };
    let r = (whole + i32::from(a - whole as f32 >= 0.5)).min(127);
    (if x.is_sign_negative() { -r } else { r }) as i8 as u8
}

/// The e4m3 code nearest `x` (ties to even), saturated at ±448; 0 for NaN: the `float8`
/// crate's conversion (CUDA's with saturation), without its branches, so loops over it
/// vectorise (it took the ingest of fp8 KV to 0.35 GB/s). Normal results round the f32 bits
/// at the third mantissa bit; below 2^-6 the value is a multiple of 2^-9, rounded by adding
/// and taking away 2^23 (exact there).
#[inline(always)]
fn f8_code(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7fff_ffff;
    let normal = (abs.wrapping_add(0x7_ffff + ((abs >> 20) & 1)) >> 20).wrapping_sub(120 << 3);
    let a = f32::from_bits(abs);
    // SAFETY: at most 2^-6 * 512 = 8 (a NaN `a` gives 2^-6), which i32 holds.
    let tiny = unsafe {
        ((a.min(1.0 / 64.0) * 512.0 + 8_388_608.0) - 8_388_608.0).to_int_unchecked::<i32>() as u32
    };
    let code = if a < 1.0 / 64.0 {
        tiny
    } else {
        normal.min(0x7e)
    };
    if x.is_nan() { 0 } else { (code | sign) as u8 }
}

/// The scale of one vector of a scaled `dtype`: max |x| / its code's max (0 for a zero
/// vector); NaN when `x` holds a non-finite value, so that every dequantized element is NaN
/// and the output says so, as the float dtypes' would.
#[inline(always)]
pub(crate) fn quant_scale(dtype: KvDType, x: &[f32]) -> f32 {
    // The largest magnitude's bits: for magnitudes (sign cleared) the integers order as the
    // floats do, and an infinity or NaN lies above every finite one. An integer maximum
    // vectorises where `f32::max` (NaN-aware) stayed scalar.
    scale_of_top(dtype, magnitude_top(x))
}

/// The largest [`magnitude_bits`] of `x` (0 for an empty `x`).
#[inline(always)]
pub(crate) fn magnitude_top(x: &[f32]) -> u32 {
    x.iter().fold(0u32, |m, v| m.max(magnitude_bits(*v)))
}

/// Eight vectors' scales ([`scale_of_top`] of their largest [`magnitude_bits`], `tops`) and
/// the factors [`quantize`] multiplies by (`1 / scale`, 0 where the scale is not above 0):
/// by two vector divisions where a vector at a time took two scalar ones, whose latency
/// (about 11 cycles each, one waiting on the other) stood between a row's fold and its codes.
#[inline(always)]
pub(crate) fn scales_of_tops<const AVX2: bool>(
    dtype: KvDType,
    tops: [u32; 8],
) -> ([f32; 8], [f32; 8]) {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: only bodies compiled for AVX2 pass `AVX2` (as `block::quantize_in`'s).
        return unsafe { scales_of_tops_avx2(dtype, tops) };
    }
    let scales = tops.map(|t| scale_of_top(dtype, t));
    (scales, scales.map(|s| if s > 0.0 { 1.0 / s } else { 0.0 }))
}

/// [`scales_of_tops`] by AVX2: the same divisions, eight lanes at once.
///
/// # Safety
/// The CPU has AVX2, and the caller is compiled for it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scales_of_tops_avx2(dtype: KvDType, tops: [u32; 8]) -> ([f32; 8], [f32; 8]) {
    use std::arch::x86_64::*;
    // SAFETY: as this function's; the loads and stores are of 8-lane arrays.
    unsafe {
        let t = _mm256_loadu_si256(tops.as_ptr().cast());
        // Magnitudes' bits are at most `i32::MAX`, so a signed compare orders them.
        let finite = _mm256_cmpgt_epi32(_mm256_set1_epi32(f32::INFINITY.to_bits() as i32), t);
        let scale = _mm256_div_ps(_mm256_castsi256_ps(t), _mm256_set1_ps(dtype.code_max()));
        let scale = _mm256_blendv_ps(_mm256_set1_ps(f32::NAN), scale, _mm256_castsi256_ps(finite));
        let inv = _mm256_div_ps(_mm256_set1_ps(1.0), scale);
        let inv = _mm256_and_ps(inv, _mm256_cmp_ps::<_CMP_GT_OQ>(scale, _mm256_setzero_ps()));
        let (mut scales, mut invs) = ([0f32; 8], [0f32; 8]);
        _mm256_storeu_ps(scales.as_mut_ptr(), scale);
        _mm256_storeu_ps(invs.as_mut_ptr(), inv);
        (scales, invs)
    }
}

/// `x`'s magnitude's bits, which order as the magnitudes do ([`quant_scale`]).
#[inline(always)]
pub(crate) fn magnitude_bits(x: f32) -> u32 {
    x.to_bits() & 0x7fff_ffff
}

/// [`quant_scale`] of a vector whose largest [`magnitude_bits`] are `top`.
#[inline(always)]
pub(crate) fn scale_of_top(dtype: KvDType, top: u32) -> f32 {
    if top < f32::INFINITY.to_bits() {
        f32::from_bits(top) / dtype.code_max()
    } else {
        f32::NAN
    }
}

/// `x` of a scaled `dtype` quantized with `scale` into `dst` (one byte per element).
#[inline(always)]
pub(crate) fn quantize(dtype: KvDType, x: &[f32], scale: f32, dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        unsafe { quantize_on_avx2(dtype, x, scale, dst) };
        return;
    }
    quantize_scalar(dtype, x, scale, dst);
}

/// [`quantize`]'s definition, a loop the compiler vectorises at its caller's features.
#[inline(always)]
fn quantize_scalar(dtype: KvDType, x: &[f32], scale: f32, dst: &mut [u8]) {
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    quantize_by(dtype, x, inv, dst);
}

/// [`quantize`] given the factor `inv` (as [`scales_of_tops`] gives it), not the scale: a
/// loop the compiler vectorises at its caller's features.
#[inline(always)]
pub(crate) fn quantize_by(dtype: KvDType, x: &[f32], inv: f32, dst: &mut [u8]) {
    for (v, d) in x.iter().zip(dst) {
        *d = scaled_code(dtype, v * inv);
    }
}

/// [`quantize`] for a caller compiled for AVX2, into which it is inlined
/// ([`quantize_8bit_avx2`]: a small head's rows are a few vectors, and a call a row cost as
/// much as its codes).
///
/// # Safety
/// The CPU has AVX2, and the caller is compiled for it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn quantize_avx2(dtype: KvDType, x: &[f32], scale: f32, dst: &mut [u8]) {
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    // SAFETY: as this function's.
    unsafe { quantize_by_avx2(dtype, x, inv, dst) }
}

/// [`quantize_avx2`] given the factor `inv` (as [`scales_of_tops`] gives it), not the scale.
///
/// # Safety
/// The CPU has AVX2, and the caller is compiled for it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn quantize_by_avx2(dtype: KvDType, x: &[f32], inv: f32, dst: &mut [u8]) {
    // SAFETY: as this function's.
    let done = unsafe {
        match dtype {
            KvDType::I8 => quantize_8bit_avx2::<false>(x, inv, dst),
            KvDType::F8E4M3 => quantize_8bit_avx2::<true>(x, inv, dst),
            _ => 0,
        }
    };
    for (v, d) in x[done..].iter().zip(&mut dst[done..]) {
        *d = scaled_code(dtype, v * inv);
    }
}

/// [`quantize_avx2`] behind a call, for callers not compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_on_avx2(dtype: KvDType, x: &[f32], scale: f32, dst: &mut [u8]) {
    // SAFETY: the CPU has AVX2, and this function is compiled for it.
    unsafe { quantize_avx2(dtype, x, scale, dst) }
}

/// Eight int8 codes of `v` (values already divided by their scale) as [`i8_code`] gives
/// them, in the dwords of a vector, except that a NaN's is `i32::MIN` (the packs saturate it
/// to -128, which no other element gives, and [`quantize_8bit_avx2`] clears those bytes 32 at
/// a time): the magnitude, at most 127, plus the largest float below one half, truncated,
/// then given the element's sign. Adding that constant and truncating rounds ties away from
/// zero, as `i8_code` does, for every f32 (`every_f32_quantizes_to_its_code` checks all
/// 2^32); six operations where the integer part and a compare of the rest with one half
/// took twelve.
///
/// # Safety
/// The CPU has AVX2, and the caller is compiled for it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn i8_codes_avx2(v: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: as this function's.
    unsafe {
        let a = _mm256_andnot_ps(_mm256_set1_ps(-0.0), v);
        // `min(127, a)` keeps a NaN `a` (the second operand), which truncates to `i32::MIN`;
        // an infinity becomes 127.
        let a = _mm256_min_ps(_mm256_set1_ps(127.0), a);
        let half_down = _mm256_set1_ps(f32::from_bits(0x3eff_ffff));
        let r = _mm256_cvttps_epi32(_mm256_add_ps(a, half_down));
        // Negated where `v`'s sign bit is set (as an i32 it is negative); a zero `v` gives 0,
        // as its code is.
        _mm256_sign_epi32(r, _mm256_castps_si256(v))
    }
}

/// Eight e4m3 codes of the magnitudes of `x` (values already divided by their scale) as
/// [`f8_code`] gives them, in the dwords of a vector, except that a NaN's is above
/// `i16::MAX` (the packs saturate it to 0xff, which no other element gives, and
/// [`quantize_8bit_avx2`] clears those bytes 32 at a time, where it also sets the signs).
///
/// One rounding for normal and subnormal codes alike: the magnitude (at most 448) plus
/// `m`, the power of two whose last mantissa bit is worth the code's step at that magnitude
/// (2^(e+20) for a magnitude in [2^e, 2^(e+1)), 2^14 below 2^-6, where the steps are 2^-9),
/// rounds it to its code's value, ties to even; the sum's bits less `m`'s count the steps
/// above `m`'s exponent's first code, which `m`'s own bits give. Ten operations (the signs
/// are packed 32 at a time) where the two cases and the sign took fifteen; checked against
/// `f8_code` over all 2^32 f32 by `every_f32_quantizes_to_its_code` (the store path into fp8 pools went from 2.9-3.3 to 3.4-3.8
/// GiB/s in `cargo bench -p kv-transfer --bench store`).
///
/// # Safety
/// The CPU has AVX2, and the caller is compiled for it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn f8_codes_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: as this function's.
    unsafe {
        let one = _mm256_set1_epi32;
        let a = _mm256_andnot_ps(_mm256_set1_ps(-0.0), x);
        // Saturated at 448 (an infinity too); `min(448, a)` keeps a NaN `a`.
        let a = _mm256_min_ps(_mm256_set1_ps(448.0), a);
        let exp = _mm256_and_si256(_mm256_castps_si256(a), one(0x7f80_0000));
        // A NaN's exponent plus 20 wraps negative, so its `m` is 2^14 and its sum a NaN,
        // whose bits less `m`'s are above `i16::MAX`.
        let m = _mm256_max_epi32(_mm256_add_epi32(exp, one(20 << 23)), one(0x4680_0000));
        let sum = _mm256_castps_si256(_mm256_add_ps(a, _mm256_castsi256_ps(m)));
        // `m`'s first code: 8 per exponent step above 2^-6's (`m` = 2^14 there), whose
        // `m >> 20` is 1128.
        let first = _mm256_sub_epi32(_mm256_srli_epi32::<20>(m), one(1128));
        _mm256_add_epi32(_mm256_sub_epi32(sum, m), first)
    }
}

/// The codes of the eight f32 at `p` times `inv` (int8, or e4m3 where `FP8`), and the
/// scaled values' bits (whose signs [`pack_codes_avx2`] gives e4m3 codes).
///
/// # Safety
/// The CPU has AVX2, the caller is compiled for it, and `p` points at eight f32. (Functions,
/// not closures: a closure is not compiled for its caller's features, and once too large to
/// inline, each of its intrinsics became a call.)
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn codes_avx2<const FP8: bool>(
    p: *const f32,
    inv: std::arch::x86_64::__m256,
) -> (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i) {
    use std::arch::x86_64::*;
    // SAFETY: as this function's.
    unsafe {
        let v = _mm256_mul_ps(_mm256_loadu_ps(p), inv);
        let c = if FP8 {
            f8_codes_avx2(v)
        } else {
            i8_codes_avx2(v)
        };
        (c, _mm256_castps_si256(v))
    }
}

/// Four vectors of [`codes_avx2`] as 32 bytes, in the order of dwords 0 4 1 5 2 6 3 7 (the
/// packs work within 128-bit lanes): two saturating packs to the codes, and a NaN's code
/// (-128 for int8, 0xff for e4m3) to 0; e4m3's signs from the same packs of the values'
/// bits, which saturate each to a byte of its sign.
///
/// # Safety
/// The CPU has AVX2, and the caller is compiled for it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pack_codes_avx2<const FP8: bool>(
    [(c0, x0), (c1, x1), (c2, x2), (c3, x3)]: [(std::arch::x86_64::__m256i, std::arch::x86_64::__m256i);
        4],
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: as this function's.
    unsafe {
        let (a, b) = (_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
        if FP8 {
            let b = _mm256_packus_epi16(a, b);
            let signs = _mm256_packs_epi16(_mm256_packs_epi32(x0, x1), _mm256_packs_epi32(x2, x3));
            let b = _mm256_or_si256(b, _mm256_and_si256(signs, _mm256_set1_epi8(i8::MIN)));
            _mm256_andnot_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi8(-1)), b)
        } else {
            let b = _mm256_packs_epi16(a, b);
            _mm256_andnot_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi8(i8::MIN)), b)
        }
    }
}

/// [`quantize`] into int8 (or e4m3, `FP8`) by AVX2, 32 codes a store (then 8); returns how
/// many it wrote (a multiple of 8: the rest is the caller's). The four vectors' codes are
/// packed by two saturating packs (signed to the int8 codes, unsigned to the e4m3 bytes) and
/// one lane permute, where the compiler's loop packed each eight by four shuffles.
///
/// # Safety
/// The CPU has AVX2, and the caller is compiled for it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn quantize_8bit_avx2<const FP8: bool>(x: &[f32], inv: f32, dst: &mut [u8]) -> usize {
    use std::arch::x86_64::*;
    let n = x.len().min(dst.len()) / 32 * 32;
    let m = x.len().min(dst.len()) / 8 * 8;
    // SAFETY: the CPU has AVX2; every load and store is an unaligned one within `x[..m]`
    // and `dst[..m]` (32 or 8 f32 from `src`, as many bytes at `out`).
    unsafe {
        let inv = _mm256_set1_ps(inv);
        // Each pack works within 128-bit lanes: the bytes come out in the order of dwords 0
        // 4 1 5 2 6 3 7, which the permute undoes.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (src, out) in x[..n].chunks_exact(32).zip(dst[..n].chunks_exact_mut(32)) {
            let p = src.as_ptr();
            let b = pack_codes_avx2::<FP8>([
                codes_avx2::<FP8>(p, inv),
                codes_avx2::<FP8>(p.add(8), inv),
                codes_avx2::<FP8>(p.add(16), inv),
                codes_avx2::<FP8>(p.add(24), inv),
            ]);
            let b = _mm256_permutevar8x32_epi32(b, order);
            _mm256_storeu_si256(out.as_mut_ptr().cast(), b);
        }
        // Then eight at a time (a small head's whole row): the same packs of one vector,
        // whose codes land in dwords 0 and 4.
        for (src, out) in x[n..m].chunks_exact(8).zip(dst[n..m].chunks_exact_mut(8)) {
            let c = codes_avx2::<FP8>(src.as_ptr(), inv);
            let zero = (_mm256_setzero_si256(), _mm256_setzero_si256());
            let b = pack_codes_avx2::<FP8>([c, c, zero, zero]);
            let b = _mm256_permutevar8x32_epi32(b, order);
            _mm_storel_epi64(out.as_mut_ptr().cast(), _mm256_castsi256_si128(b));
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let v = [0.0f32, 1.5, -2.25, 65504.0, 1e-3];
        for dt in [KvDType::F32, KvDType::F16, KvDType::Bf16] {
            let mut bytes = vec![0u8; v.len() * dt.size()];
            encode_from_f32(dt, &v, &mut bytes);
            let mut back = vec![0f32; v.len()];
            decode_to_f32(dt, &bytes, &mut back);
            for (a, b) in v.iter().zip(&back) {
                let tol = match dt {
                    KvDType::F32 => 0.0,
                    KvDType::F16 => 1e-3,
                    KvDType::Bf16 => 1e-2,
                    KvDType::I8 | KvDType::F8E4M3 => 1.0,
                };
                assert!((a - b).abs() <= tol * a.abs().max(1.0), "{dt} {a} {b}");
            }
            // Unaligned input decodes the same.
            let mut shifted = vec![0u8; bytes.len() + 1];
            shifted[1..].copy_from_slice(&bytes);
            let mut back2 = vec![0f32; v.len()];
            decode_to_f32(dt, &shifted[1..], &mut back2);
            assert_eq!(back, back2);
        }
    }

    /// [`quantize`] of every f32 (scale 1) gives [`scaled_code`]'s code, int8 and e4m3: the
    /// AVX2 quantizers' roundings are exact by argument, and this checks the argument.
    /// Half a minute, so left out of `cargo test` and run by `.ci/run` on its own: `cargo
    /// test -p attention --lib -- --ignored every_f32`.
    #[test]
    #[ignore]
    fn every_f32_quantizes_to_its_code() {
        let mut x = vec![0f32; 1 << 20];
        let mut got = vec![0u8; x.len()];
        for dtype in [KvDType::I8, KvDType::F8E4M3] {
            for hi in 0..(1u32 << 12) {
                for (i, v) in x.iter_mut().enumerate() {
                    *v = f32::from_bits(hi << 20 | i as u32);
                }
                quantize(dtype, &x, 1.0, &mut got);
                for (v, g) in x.iter().zip(&got) {
                    assert_eq!(*g, scaled_code(dtype, *v), "{dtype} {:#x}", v.to_bits());
                }
            }
        }
    }

    /// Quantizing a vector (32 at a time on AVX2) gives each element's code by
    /// [`scaled_code`]: lengths about the vector width, exact halves and their neighbours
    /// (and, unscaled, e4m3's ties), its own scale, a zero, a NaN, a scale too small (codes
    /// saturate) and one so large that e4m3's codes are subnormal, infinities and NaN among
    /// the elements.
    #[test]
    fn quantizing_gives_each_elements_code() {
        let mut s = 0x2545_f491u32;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 2001) as f32 / 8.0 - 125.0
        };
        // k + 1/2 exactly for k in -128..128, and the floats either side of it.
        let halves: Vec<f32> = (-128..128)
            .map(|k| k as f32 + 0.5)
            .flat_map(|h| {
                [
                    h,
                    f32::from_bits(h.to_bits() - 1),
                    f32::from_bits(h.to_bits() + 1),
                ]
            })
            .collect();
        for dtype in [KvDType::I8, KvDType::F8E4M3] {
            for len in [0usize, 1, 31, 32, 33, 64, 100, 257, halves.len()] {
                let mut x: Vec<f32> = (0..len).map(|_| next()).collect();
                if len == halves.len() {
                    x.copy_from_slice(&halves);
                } else {
                    for (i, v) in x.iter_mut().step_by(3).enumerate() {
                        *v = halves[(7 * i) % halves.len()];
                    }
                }
                let own = quant_scale(dtype, &x);
                // 1e4: values below e4m3's normal range.
                let mut scales = vec![1.0, own, 0.0, f32::NAN, own / 64.0, 1e-30, 1e4];
                if len > 40 {
                    x[37] = f32::INFINITY;
                    x[38] = f32::NEG_INFINITY;
                    x[39] = f32::NAN;
                    scales.push(quant_scale(dtype, &x));
                }
                for scale in scales {
                    let mut got = vec![0xaau8; len];
                    quantize(dtype, &x, scale, &mut got);
                    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    for (i, (v, g)) in x.iter().zip(&got).enumerate() {
                        let want = scaled_code(dtype, v * inv);
                        assert_eq!(*g, want, "{dtype} len {len} scale {scale} [{i}] = {v}");
                    }
                }
            }
        }
    }

    /// Strided rows from any alignment decode as the `half` crate decodes each element (the
    /// F16C and AVX2 paths, and the definition elsewhere), with head dims of a few vectors
    /// and a rest, and subnormal, infinite and NaN elements.
    #[test]
    fn strided_rows_decode_as_each_element() {
        let specials = [
            0x0001u16, 0x03ff, 0x7c00, 0xfc00, 0x7e00, 0x8000, 0x3c00, 0xc1a3,
        ];
        for dt in [KvDType::F16, KvDType::Bf16, KvDType::F32] {
            for d in [1, 8, 13, 64] {
                for offset in [0, 1] {
                    let (es, rows) = (dt.size(), 5);
                    let stride = d * es + 3;
                    let bytes: Vec<u8> = (0..offset + rows * stride)
                        .map(|i| {
                            let s = specials[i / 2 % specials.len()].to_le_bytes();
                            if i % 7 < 2 {
                                s[i % 2]
                            } else {
                                (i * 37 % 251) as u8
                            }
                        })
                        .collect();
                    let src = &bytes[offset..];
                    let mut got = vec![0f32; rows * d];
                    decode_rows(dt, src, stride, &mut got, d);
                    for r in 0..rows {
                        for c in 0..d {
                            let e = &src[r * stride + c * es..][..es];
                            let want = match dt {
                                KvDType::F16 => f16::from_le_bytes([e[0], e[1]]).to_f32(),
                                KvDType::Bf16 => bf16::from_le_bytes([e[0], e[1]]).to_f32(),
                                _ => f32::from_le_bytes([e[0], e[1], e[2], e[3]]),
                            };
                            let g = got[r * d + c];
                            assert!(
                                g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                                "{dt} d={d} offset {offset} ({r}, {c}): {g} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The int8 and e4m3 encoders give the codes of their definitions (`f32::round`
    /// saturated at ±127; the `float8` crate's e4m3, saturated at ±448), NaN 0: every
    /// exponent and sign with the mantissa bits that decide a rounding (the kept ones, the
    /// one below, and a sticky rest or none), every half-integer to ±300 and its
    /// neighbours, and the infinities.
    #[test]
    fn the_8_bit_encoders_give_their_definitions_codes() {
        let i8_def = |x: f32| (x.round() as i8).max(-127) as u8;
        let f8_def = |x: f32| {
            if x.is_nan() {
                0
            } else {
                float8::F8E4M3::from_f32(x).to_bits()
            }
        };
        let mut xs = vec![f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 0.0, -0.0];
        for sign in [0u32, 1 << 31] {
            for exp in 0..=255u32 {
                for top in 0..64u32 {
                    for rest in [0u32, 1, 0x1_0000, 0x1_ffff] {
                        xs.push(f32::from_bits(sign | exp << 23 | top << 17 | rest));
                    }
                }
            }
        }
        for k in -600..=600 {
            let x = k as f32 * 0.5;
            xs.extend([x, x.next_up(), x.next_down()]);
        }
        for x in xs {
            assert_eq!(
                i8_code(x),
                i8_def(x),
                "int8 of {x:e} ({:#010x})",
                x.to_bits()
            );
            assert_eq!(
                f8_code(x),
                f8_def(x),
                "e4m3 of {x:e} ({:#010x})",
                x.to_bits()
            );
        }
    }

    #[test]
    fn parses_names() {
        assert_eq!(KvDType::parse("BF16"), Some(KvDType::Bf16));
        assert_eq!(KvDType::parse("FP8"), Some(KvDType::F8E4M3));
        assert_eq!(KvDType::parse("f8"), None);
    }

    /// Every e4m3 code but the two NaNs widens to the value the `float8` crate (CUDA's
    /// conversion) gives it, and encoding that value gives the code back.
    #[test]
    fn fp8_codes_widen_to_their_values_and_back() {
        for code in 0..=255u8 {
            let want = float8::F8E4M3::from_bits(code).to_f32();
            if code & 0x7f == 0x7f {
                assert!(want.is_nan());
                continue;
            }
            let got = f8_e4m3_value(code);
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "code {code:#04x}: {got} vs {want}"
            );
            if got != 0.0 {
                assert_eq!(f8_code(got), code, "{got}");
            }
        }
        // Rounding to nearest, saturating, NaN to 0.
        assert_eq!(f8_e4m3_value(f8_code(1000.0)), 448.0);
        assert_eq!(f8_e4m3_value(f8_code(-1000.0)), -448.0);
        assert_eq!(f8_e4m3_value(f8_code(1.06)), 1.0);
        assert_eq!(f8_e4m3_value(f8_code(1.07)), 1.125);
        assert_eq!(f8_code(f32::NAN), 0);
    }
}
