//! AVX-512 pieces of the CPU kernel for full 32-token blocks and GQA groups of 2 to 8 heads,
//! chosen at run time inside the AVX2 path.
//!
//! With 32 registers of 16 lanes, a whole group's accumulators for a 32-token row (scores) or a
//! 32-channel slice (V) stay in registers, so each K and V element is loaded and converted once
//! for the whole group; with AVX2's 16 registers of 8 lanes the group is split in pairs and
//! every row is converted again for each pair.
//!
//! Both request the next block's lines as they go (one per K row, one per V row and 32
//! channels: the whole next block of a 16-bit dtype), as the AVX2 loops do; without it, the
//! kernel ran at 0.26-0.42 of read bandwidth on a 256 MiB working set instead of 0.6-0.97.

use std::arch::x86_64::*;

use crate::dtype::KvDType;
use crate::kernel_avx2::Prefetch;

/// True when this CPU can run these functions and `DECODE_NODE_AVX512=0` does not turn them
/// off. The switch makes an AVX-512 host run what a CPU without it runs (CI's class, AMD EPYC
/// before Zen 4), for measurements; it covers the model executor's row loops too
/// ([`avx512_enabled`]). Read once.
pub(crate) fn available() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && std::env::var("DECODE_NODE_AVX512").map_or(true, |v| v.trim() != "0")
    })
}

/// Whether the AVX-512 paths (F and BW) may run here: the CPU has them and
/// `DECODE_NODE_AVX512=0` does not turn them off.
pub fn avx512_enabled() -> bool {
    available()
}

/// Whether [`crate::KernelPath::best`] takes the attention kernel's AVX-512 path: where it
/// can run, unless the CPU issues each 512-bit operation as two 256-bit halves (AMD Zen 4),
/// where the AVX2 path measured faster; `DECODE_NODE_AVX512=1` takes it there too. Read once.
///
/// `bench kernels`, one thread, bf16 and head dim 128, paths alternated in one run on a 2-core
/// EPYC (Zen 4), GB/s AVX2 against AVX-512: G=2 24.2-25.0 / 22.5, G=4 17.0 / 16.2, G=5
/// 14.8-15.0 / 14.0, G=8 10.2-10.3 / 9.9, G=3 19.1-19.3 / 19.5. The model executor's row loops
/// do not follow this: there the two measured alike.
pub(crate) fn preferred() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let forced = std::env::var("DECODE_NODE_AVX512").is_ok_and(|v| v.trim() == "1");
        available() && (forced || !half_width(cpu_id()))
    })
}

/// The CPU's vendor string and family/model signature (CPUID leaves 0 and 1).
fn cpu_id() -> ([u8; 12], u32) {
    let v = __cpuid(0);
    let mut vendor = [0u8; 12];
    for (dst, r) in vendor.chunks_exact_mut(4).zip([v.ebx, v.edx, v.ecx]) {
        dst.copy_from_slice(&r.to_le_bytes());
    }
    (vendor, __cpuid(1).eax)
}

/// True for a CPU that has AVX-512 but runs it on 256-bit units: AMD family 19h (Zen 4; Zen 3
/// in the same family has no AVX-512). Zen 5 (family 1Ah) has full-width units.
fn half_width((vendor, signature): ([u8; 12], u32)) -> bool {
    let base = (signature >> 8) & 0xf;
    let family = if base == 0xf {
        base + ((signature >> 20) & 0xff)
    } else {
        base
    };
    &vendor == b"AuthenticAMD" && family == 0x19
}

/// Loads 16 elements at `p` as f32.
///
/// # Safety
/// `p` must point at 16 readable elements of `dtype`; the CPU must have AVX-512F/BW.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn load16(dtype: KvDType, p: *const u8) -> __m512 {
    // SAFETY: the caller guarantees 16 readable elements at `p`.
    unsafe {
        match dtype {
            KvDType::F32 => _mm512_loadu_ps(p.cast()),
            KvDType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            KvDType::Bf16 => {
                let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
            }
            // The integers as they are: the caller applies the per-token scales.
            KvDType::I8 => _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))),
            // As `avx2::AsF8`, sixteen at a time.
            KvDType::F8E4M3 => {
                let w = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()));
                let bits = _mm512_and_si512(
                    _mm512_slli_epi32::<20>(w),
                    _mm512_set1_epi32(crate::dtype::F8_MASK as i32),
                );
                _mm512_mul_ps(
                    _mm512_castsi512_ps(bits),
                    _mm512_set1_ps(crate::dtype::F8_REBIAS),
                )
            }
        }
    }
}

/// Scores of a full 32-token block for all `G` query heads: `s[g][t] = sum_c q[g][c] K[c][t]`.
///
/// # Safety
/// AVX-512F/BW ([`available`]); `kt` holds `d` rows of 32 elements of `dt`; `qs` is `[G][d]`;
/// `s` holds at least `G * 32` elements.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn scores<const G: usize>(
    dt: KvDType,
    kt: &[u8],
    qs: &[f32],
    d: usize,
    s: &mut [f32],
    pf: &mut Prefetch<'_>,
) {
    let es = dt.size();
    let mut acc = [[_mm512_setzero_ps(); 2]; G];
    // A local copy of the cursor stays in a register (see `Prefetch`).
    let mut next = *pf;
    for c in 0..d {
        // One line of the next block per row of this one: as many as this block's K rows.
        next.line();
        // SAFETY: row c of 32 elements lies inside `kt` (the contract).
        let (k0, k1) = unsafe {
            let p = kt.as_ptr().add(c * 32 * es);
            (load16(dt, p), load16(dt, p.add(16 * es)))
        };
        for g in 0..G {
            let q = _mm512_set1_ps(qs[g * d + c]);
            acc[g][0] = _mm512_fmadd_ps(q, k0, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(q, k1, acc[g][1]);
        }
    }
    *pf = next;
    for g in 0..G {
        // SAFETY: s holds G*32 elements.
        unsafe {
            _mm512_storeu_ps(s.as_mut_ptr().add(g * 32), acc[g][0]);
            _mm512_storeu_ps(s.as_mut_ptr().add(g * 32 + 16), acc[g][1]);
        }
    }
}

/// `acc[g] += sum_t p[g][t] V[t]` over a full 32-token block for all `G` heads, 32 channels at
/// a time.
///
/// # Safety
/// AVX-512F/BW; `vs` holds 32 rows of `d` elements of `dt`, `d` a multiple of 32; `p` is
/// `[G][32]` (row stride `b`); `acc` is `[G][d]`.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn accumulate_v<const G: usize>(
    dt: KvDType,
    vs: &[u8],
    d: usize,
    p: &[f32],
    b: usize,
    acc: &mut [f32],
    pf: &mut Prefetch<'_>,
) {
    let es = dt.size();
    let a = acc.as_mut_ptr();
    let mut next = *pf;
    for c0 in (0..d).step_by(32) {
        let mut r = [[_mm512_setzero_ps(); 2]; G];
        for g in 0..G {
            // SAFETY: g*d + c0 + 32 <= G*d.
            unsafe {
                r[g][0] = _mm512_loadu_ps(a.add(g * d + c0));
                r[g][1] = _mm512_loadu_ps(a.add(g * d + c0 + 16));
            }
        }
        for t in 0..32 {
            next.line();
            // SAFETY: row t < 32 of d elements; c0 + 32 <= d.
            let (v0, v1) = unsafe {
                let q = vs.as_ptr().add((t * d + c0) * es);
                (load16(dt, q), load16(dt, q.add(16 * es)))
            };
            for g in 0..G {
                let w = _mm512_set1_ps(p[g * b + t]);
                r[g][0] = _mm512_fmadd_ps(w, v0, r[g][0]);
                r[g][1] = _mm512_fmadd_ps(w, v1, r[g][1]);
            }
        }
        for g in 0..G {
            // SAFETY: as the loads above.
            unsafe {
                _mm512_storeu_ps(a.add(g * d + c0), r[g][0]);
                _mm512_storeu_ps(a.add(g * d + c0 + 16), r[g][1]);
            }
        }
    }
    *pf = next;
}

/// Runs `f::<G>` for a group size of 2 to 8; false for any other.
macro_rules! dispatch {
    ($g:expr, $f:ident, $($arg:expr),*) => {
        match $g {
            2 => { $f::<2>($($arg),*); true }
            3 => { $f::<3>($($arg),*); true }
            4 => { $f::<4>($($arg),*); true }
            5 => { $f::<5>($($arg),*); true }
            6 => { $f::<6>($($arg),*); true }
            7 => { $f::<7>($($arg),*); true }
            8 => { $f::<8>($($arg),*); true }
            _ => false,
        }
    };
}

/// [`scores`] for a run-time group size; false (nothing done) outside 2..=8.
///
/// # Safety
/// As [`scores`].
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn scores_dyn(
    g: usize,
    dt: KvDType,
    kt: &[u8],
    qs: &[f32],
    d: usize,
    s: &mut [f32],
    pf: &mut Prefetch<'_>,
) -> bool {
    // SAFETY: forwarded.
    unsafe { dispatch!(g, scores, dt, kt, qs, d, s, pf) }
}

/// [`accumulate_v`] for a run-time group size; false (nothing done) outside 2..=8 or when `d`
/// is not a multiple of 32.
///
/// # Safety
/// As [`accumulate_v`] (except the multiple of 32, checked here).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn accumulate_v_dyn(
    g: usize,
    dt: KvDType,
    vs: &[u8],
    d: usize,
    p: &[f32],
    b: usize,
    acc: &mut [f32],
    pf: &mut Prefetch<'_>,
) -> bool {
    if !d.is_multiple_of(32) {
        return false;
    }
    // SAFETY: forwarded.
    unsafe { dispatch!(g, accumulate_v, dt, vs, d, p, b, acc, pf) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPUID signatures of real parts: only AMD's family 19h with AVX-512 is half width.
    #[test]
    fn half_width_is_amd_family_19h() {
        let (amd, intel) = (*b"AuthenticAMD", *b"GenuineIntel");
        assert!(half_width((amd, 0x00A1_0F11))); // EPYC 9004 (Zen 4), family 19h model 11h
        assert!(half_width((amd, 0x00A6_0F12))); // Ryzen 7040 (Zen 4)
        assert!(!half_width((amd, 0x00B0_0F21))); // EPYC 9005 (Zen 5), family 1Ah
        assert!(!half_width((amd, 0x0083_0F10))); // EPYC 7002 (Zen 2), family 17h
        assert!(!half_width((intel, 0x0008_06F8))); // Xeon Sapphire Rapids, family 6
        assert!(!half_width((intel, 0x00A1_0F11))); // Zen 4's signature, another vendor
    }
}
