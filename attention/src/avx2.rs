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
