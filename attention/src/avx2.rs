//! AVX2 pieces shared by the attention kernel and the model executor's projections (x86-64):
//! stored element types (f32, f16, bf16) widened to f32 lanes eight at a time, since both read
//! values as stored and widen them in registers, and the horizontal sum of a vector.

use std::arch::x86_64::*;

/// A stored element type, loaded 8 at a time as f32. One type per [`crate::KvDType`], so
/// every loop is compiled once per type with no branch on the type inside it.
pub trait Elem {
    /// Bytes per element.
    const SIZE: usize;
    /// Loads 8 elements at `p` as f32.
    ///
    /// # Safety
    /// `p` must point at 8 readable elements; the CPU must have AVX2 and F16C.
    unsafe fn load8(p: *const u8) -> __m256;

    /// Whether [`Elem::load16`] splits even and odd elements (see [`interleave`]).
    const SPLIT: bool = false;

    /// Loads 16 elements at `p` as two f32 vectors in this type's cheapest lane order:
    /// elements 0..8 and 8..16, or with [`Elem::SPLIT`] the even elements and the odd ones.
    ///
    /// # Safety
    /// `p` must point at 16 readable elements; the CPU must have AVX2 and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load16(p: *const u8) -> (__m256, __m256) {
        // SAFETY: the caller guarantees 16 readable elements at `p`.
        unsafe { (Self::load8(p), Self::load8(p.add(8 * Self::SIZE))) }
    }
}

/// Elements 0..8 and 8..16 from the even elements `e` and the odd ones `o` (the inverse of
/// [`deinterleave`]): four shuffles, once per tile rather than once per load.
///
/// # Safety
/// The CPU must have AVX2 (callable safely from code compiled with it).
#[inline]
#[target_feature(enable = "avx2")]
pub fn interleave(e: __m256, o: __m256) -> (__m256, __m256) {
    let (lo, hi) = (_mm256_unpacklo_ps(e, o), _mm256_unpackhi_ps(e, o));
    (
        _mm256_permute2f128_ps::<0x20>(lo, hi),
        _mm256_permute2f128_ps::<0x31>(lo, hi),
    )
}

/// The even and the odd elements of elements 0..8 (`lo`) and 8..16 (`hi`).
///
/// # Safety
/// The CPU must have AVX2 (callable safely from code compiled with it).
#[inline]
#[target_feature(enable = "avx2")]
pub fn deinterleave(lo: __m256, hi: __m256) -> (__m256, __m256) {
    let e = _mm256_shuffle_ps::<0b10_00_10_00>(lo, hi);
    let o = _mm256_shuffle_ps::<0b11_01_11_01>(lo, hi);
    let fix = |v| _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(v)));
    (fix(e), fix(o))
}

/// IEEE single precision.
#[derive(Debug)]
pub struct AsF32;
/// IEEE half precision.
#[derive(Debug)]
pub struct AsF16;
/// bfloat16: the top half of an f32, widened by a shift.
#[derive(Debug)]
pub struct AsBf16;
/// Signed 8-bit integers, widened to their values (scales are applied by the caller).
#[derive(Debug)]
pub struct AsI8;
/// fp8 e4m3 codes, widened to their values (scales are applied by the caller).
#[derive(Debug)]
pub struct AsF8;

impl Elem for AsF8 {
    const SIZE: usize = 1;
    /// As `dtype::f8_e4m3_value`: sign-extend each code to 32 bits and shift it so
    /// its exponent and mantissa sit at the top of f32's fields; the mask keeps those and the
    /// sign; one multiply by 2^120 moves the exponent bias from 7 to 127.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 8 readable bytes at `p`.
        let w = unsafe { _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())) };
        let bits = _mm256_and_si256(
            _mm256_slli_epi32::<20>(w),
            _mm256_set1_epi32(crate::dtype::F8_MASK as i32),
        );
        _mm256_mul_ps(
            _mm256_castsi256_ps(bits),
            _mm256_set1_ps(crate::dtype::F8_REBIAS),
        )
    }
}

impl Elem for AsI8 {
    const SIZE: usize = 1;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 8 readable bytes at `p`.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))) }
    }
}

impl Elem for AsF32 {
    const SIZE: usize = 4;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements at `p`.
        unsafe { _mm256_loadu_ps(p.cast()) }
    }
}

impl Elem for AsF16 {
    const SIZE: usize = 2;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements at `p`.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

impl Elem for AsBf16 {
    const SIZE: usize = 2;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements at `p`.
        unsafe {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
        }
    }

    const SPLIT: bool = true;

    /// One load and one op per vector: each 32-bit lane holds an even element in its low half
    /// (moved up by a shift) and an odd one in its high half (kept by a mask). Widening eight
    /// at a time costs a shuffle and a shift per vector, on the ports the FMAs also use.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load16(p: *const u8) -> (__m256, __m256) {
        // SAFETY: the caller guarantees 16 readable elements (32 bytes) at `p`.
        let w = unsafe { _mm256_loadu_si256(p.cast()) };
        let odd = _mm256_and_si256(w, _mm256_set1_epi32(0xffff_0000_u32 as i32));
        (
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w)),
            _mm256_castsi256_ps(odd),
        )
    }
}

/// The sum of a vector's eight lanes.
///
/// # Safety
/// The CPU must have AVX2 (callable safely from code compiled with it).
#[inline]
#[target_feature(enable = "avx2")]
pub fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lanes(v: __m256) -> [f32; 8] {
        let mut out = [0f32; 8];
        // SAFETY: eight lanes into eight floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
        out
    }

    #[test]
    fn bf16_pairs_are_the_even_and_odd_elements_and_interleave_puts_them_back() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")) {
            return;
        }
        let x: Vec<f32> = (0..16).map(|i| i as f32 - 5.5).collect();
        let bytes: Vec<u8> = x
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        // SAFETY: AVX2 and F16C checked; 16 bf16 elements.
        let (e, o) = unsafe { AsBf16::load16(bytes.as_ptr()) };
        let even: Vec<f32> = x.iter().step_by(2).copied().collect();
        let odd: Vec<f32> = x.iter().skip(1).step_by(2).copied().collect();
        assert_eq!((lanes(e).to_vec(), lanes(o).to_vec()), (even, odd));
        // SAFETY: AVX2 checked.
        let (lo, hi) = unsafe { interleave(e, o) };
        assert_eq!([lanes(lo), lanes(hi)].concat(), x);
        // SAFETY: AVX2 checked.
        let (e2, o2) = unsafe { deinterleave(lo, hi) };
        assert_eq!((lanes(e2), lanes(o2)), (lanes(e), lanes(o)));
        // The other types load in order.
        let f: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        // SAFETY: as above, 16 f32 elements.
        let (a, b) = unsafe { AsF32::load16(f.as_ptr()) };
        assert_eq!([lanes(a), lanes(b)].concat(), x);
    }
}
