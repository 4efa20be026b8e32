//! The FMA rate one thread reaches with the widest SIMD path the kernel uses on this CPU: the
//! compute side of the CPU attention roofline (`bench kernels` puts it next to memory
//! bandwidth). Independent accumulator chains hide the FMA latency, so this is the issue rate.

use std::time::{Duration, Instant};

use crate::KernelPath;

/// Independent accumulator chains: more than latency × FMA ports on any x86 core.
const CHAINS: usize = 12;

/// Scalar FMAs per second one thread issues over `seconds` (best of a few passes).
pub fn fma_peak(seconds: f64) -> f64 {
    fma_peak_on(KernelPath::Scalar, seconds)
}

/// [`fma_peak`] with the vector width of `path` (the AVX2 path's 8 lanes on a CPU that also
/// has AVX-512); [`KernelPath::Scalar`] measures the widest this CPU has, the bound the
/// portable path is held to.
pub fn fma_peak_on(path: KernelPath, seconds: f64) -> f64 {
    let end = Instant::now() + Duration::from_secs_f64(seconds.max(0.01));
    let mut best = 0f64;
    while Instant::now() < end || best == 0.0 {
        let reps = 1 << 20;
        let t = Instant::now();
        let lanes = run(reps, path);
        best = best.max((reps * CHAINS * lanes) as f64 / t.elapsed().as_secs_f64());
    }
    best
}

/// Products a second one thread's `VDPBF16PS` issue over `seconds` (32 a 512-bit
/// instruction, each pair's two), the multiply-add rate of [`KernelPath::Avx512Bf16`]'s bf16
/// blocks; 0 where the path cannot run.
pub fn bf16_dot_peak(seconds: f64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if crate::kernel_bf16::available() {
        let end = Instant::now() + Duration::from_secs_f64(seconds.max(0.01));
        let mut best = 0f64;
        while Instant::now() < end || best == 0.0 {
            let reps = 1 << 20;
            let t = Instant::now();
            // SAFETY: `available` checked AVX-512F and BF16.
            unsafe { x86::dot512(reps) };
            best = best.max((reps * CHAINS * 32) as f64 / t.elapsed().as_secs_f64());
        }
        return best;
    }
    let _ = seconds;
    0.0
}

/// Products a second one thread's AMX tile products (`TDPBF16PS`) issue over `seconds`, the
/// multiply-add rate of [`KernelPath::Amx`]'s bf16 blocks; 0 where the path cannot run.
pub fn amx_peak(seconds: f64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    return crate::kernel_amx::tile_peak(seconds);
    #[cfg(not(target_arch = "x86_64"))]
    return {
        let _ = seconds;
        0.0
    };
}

/// `reps` rounds of `CHAINS` FMAs; returns the lanes per FMA of the path used.
fn run(reps: usize, path: KernelPath) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        let narrow = path == KernelPath::Avx2;
        if !narrow && crate::kernel_avx512::available() {
            // SAFETY: the CPU has AVX-512F.
            unsafe { x86::fma512(reps) };
            return 16;
        }
        if crate::kernel_avx2::available() {
            // SAFETY: the CPU has AVX2 and FMA.
            unsafe { x86::fma256(reps) };
            return 8;
        }
    }
    #[cfg(target_arch = "aarch64")]
    if crate::kernel_neon::available() {
        crate::kernel_neon::fma_chains::<CHAINS>(reps);
        return 4;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = path;
    portable(reps);
    1
}

/// Lane FMAs a second of one short burst of `reps` rounds of the chains at `path`'s width,
/// timed once: the rate this core has now, not its best (20 000 rounds: about 0.1 ms of
/// 16-lane FMAs at 3 GHz). `bench kernels` times one right after each kernel pass: the clock
/// a core keeps under the kernels' loads can sit below the one an FMA loop alone gets (a
/// 2-core Xeon VM, AVX-512: 92.5 G/s right after 20 ms of the tiles, 108 idle, recovering
/// over about 10 ms of FMAs).
pub fn fma_burst_on(path: KernelPath, reps: usize) -> f64 {
    let t = Instant::now();
    let lanes = run(reps.max(1), path);
    (reps.max(1) * CHAINS * lanes) as f64 / t.elapsed().as_secs_f64()
}

/// The portable path's rate: scalar `mul_add` chains.
fn portable(reps: usize) {
    let mut acc = [1f32; CHAINS];
    let (a, b) = (
        std::hint::black_box(0.999_f32),
        std::hint::black_box(1e-6_f32),
    );
    for _ in 0..reps {
        for x in &mut acc {
            *x = x.mul_add(a, b);
        }
    }
    std::hint::black_box(acc);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::CHAINS;

    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fma256(reps: usize) {
        let a = _mm256_set1_ps(std::hint::black_box(0.999));
        let b = _mm256_set1_ps(std::hint::black_box(1e-6));
        let mut acc = [_mm256_set1_ps(1.0); CHAINS];
        for _ in 0..reps {
            for x in &mut acc {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        std::hint::black_box(acc);
    }

    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fma512(reps: usize) {
        let a = _mm512_set1_ps(std::hint::black_box(0.999));
        let b = _mm512_set1_ps(std::hint::black_box(1e-6));
        let mut acc = [_mm512_set1_ps(1.0); CHAINS];
        for _ in 0..reps {
            for x in &mut acc {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        std::hint::black_box(acc);
    }

    /// # Safety
    /// The CPU must have AVX-512F and AVX-512 BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn dot512(reps: usize) {
        // SAFETY: 512 bits of bf16 pairs either way.
        let a = unsafe {
            std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi16(std::hint::black_box(
                0x3f80,
            )))
        };
        let mut acc = [_mm512_set1_ps(1.0); CHAINS];
        for _ in 0..reps {
            for x in &mut acc {
                *x = _mm512_dpbf16_ps(*x, a, a);
            }
        }
        std::hint::black_box(acc);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_peak_is_a_plausible_rate() {
        let p = super::fma_peak(0.02);
        // Between an emulated core (CI runs the arm64 tests under qemu, on a busy host: 6e7
        // once) and a wide server core with two 16-lane FMA ports; a broken measurement gives
        // zero, infinity or NaN.
        assert!((1e6..2e12).contains(&p), "{p}");
        // None, or a rate of the same order as the FMAs' (twice the products an instruction).
        let d = super::bf16_dot_peak(0.02);
        assert!(d == 0.0 || (1e8..4e12).contains(&d), "{d}");
        let b = super::fma_burst_on(crate::KernelPath::Scalar, 20_000);
        assert!((1e6..2e12).contains(&b), "{b}");
    }
}
