//! NEON path of the CPU kernel (arm64: Grace, Graviton, Ampere), chosen at run time.
//!
//! Per block: scores come from register tiles of up to eight heads x eight tokens, each key
//! vector widened once per tile and reused by every head in it; the online softmax is the
//! portable one ([`crate::kernel::softmax_block`]); V rows are widened as they stream into
//! tiles of up to eight heads x eight channels held in registers. So each K and V element is
//! loaded and converted once per eight heads, where the portable loop reloads its score and
//! accumulator rows from memory for every head. Every loop is compiled once per element type
//! ([`Elem`]), so no branch on the type sits inside one. Int8 and fp8 blocks are widened the
//! same way, their per-token scales applied to the scores and the weights around the softmax.
//!
//! Not here, for want of an arm64 host to measure on: software prefetch of the next block
//! (the x86 paths need it because blocks lie anywhere in the pool; arm64 cores' prefetchers
//! are more eager, which only a measurement can settle).

use std::arch::aarch64::*;

use crate::block::BlockGeometry;
use crate::dtype::KvDType;
use crate::kernel::State;

/// True when this CPU can run the path (every arm64 Linux CPU has NEON; checked anyway).
pub(crate) fn available() -> bool {
    std::arch::is_aarch64_feature_detected!("neon")
}

/// A stored element type, widened to f32 four at a time.
trait Elem {
    /// Bytes per element.
    const SIZE: usize;
    /// Loads 4 elements at `p` as f32.
    ///
    /// # Safety
    /// `p` must point at 4 readable elements.
    unsafe fn load4(p: *const u8) -> float32x4_t;
}

struct AsF32;
struct AsF16;
struct AsBf16;
/// Signed 8-bit integers as their values (the caller applies the scales).
struct AsI8;
/// fp8 e4m3 codes as their values (the caller applies the scales).
struct AsF8;

/// Four signed bytes at `p`, sign-extended to 32-bit lanes. Reads exactly four bytes (a
/// wider load could run past the block's last row).
///
/// # Safety
/// `p` must point at 4 readable bytes.
#[inline(always)]
unsafe fn widen4_i8(p: *const u8) -> int32x4_t {
    // SAFETY: the caller guarantees 4 readable bytes.
    let w = unsafe { std::ptr::read_unaligned(p.cast::<u32>()) };
    // SAFETY: register-only NEON operations.
    unsafe {
        let b = vreinterpret_s8_u32(vdup_n_u32(w));
        vmovl_s16(vget_low_s16(vmovl_s8(b)))
    }
}

impl Elem for AsI8 {
    const SIZE: usize = 1;
    #[inline(always)]
    unsafe fn load4(p: *const u8) -> float32x4_t {
        // SAFETY: forwarded (4 readable bytes).
        unsafe { vcvtq_f32_s32(widen4_i8(p)) }
    }
}

impl Elem for AsF8 {
    const SIZE: usize = 1;
    /// As [`crate::dtype::f8_e4m3_value`]: shift, mask, one multiply.
    #[inline(always)]
    unsafe fn load4(p: *const u8) -> float32x4_t {
        // SAFETY: forwarded (4 readable bytes); the rest is register-only.
        unsafe {
            let w = vshlq_n_s32::<20>(widen4_i8(p));
            let bits = vandq_u32(vreinterpretq_u32_s32(w), vdupq_n_u32(crate::dtype::F8_MASK));
            vmulq_n_f32(vreinterpretq_f32_u32(bits), crate::dtype::F8_REBIAS)
        }
    }
}

impl Elem for AsF32 {
    const SIZE: usize = 4;
    #[inline(always)]
    unsafe fn load4(p: *const u8) -> float32x4_t {
        // SAFETY: the caller guarantees 16 readable bytes; NEON loads need no alignment.
        unsafe { vld1q_f32(p.cast()) }
    }
}

impl Elem for AsBf16 {
    const SIZE: usize = 2;
    #[inline(always)]
    unsafe fn load4(p: *const u8) -> float32x4_t {
        // SAFETY: the caller guarantees 8 readable bytes. A bf16 is the top half of an f32.
        unsafe { vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p.cast()))) }
    }
}

impl Elem for AsF16 {
    const SIZE: usize = 2;
    #[inline(always)]
    unsafe fn load4(p: *const u8) -> float32x4_t {
        // SAFETY: the caller guarantees 8 readable bytes.
        let h = unsafe { vld1_u16(p.cast()) };
        let out: float32x4_t;
        // FCVTL (half to single, base AdvSIMD) through asm: the intrinsic takes
        // `float16x4_t`, which stable Rust does not have yet. Exact for every f16, NaN and
        // infinities included.
        // SAFETY: a register-only instruction of base AdvSIMD.
        unsafe {
            std::arch::asm!(
                "fcvtl {out:v}.4s, {h:v}.4h",
                out = lateout(vreg) out,
                h = in(vreg) h,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        out
    }
}

/// Folds one block (`len` tokens) into `st`. `qs` is the pre-scaled `[G][D]` query.
///
/// # Safety
/// The CPU must have NEON ([`available`]); `bytes` must hold a whole head block of `geom`;
/// `geom.block_size` and `geom.head_dim` must be multiples of 8; `len <= block_size`.
pub(crate) unsafe fn block(
    geom: &BlockGeometry,
    qs: &[f32],
    bytes: &[u8],
    len: usize,
    st: &mut State<'_>,
) {
    // SAFETY (every arm): forwarded; the element type is the block's.
    unsafe {
        match geom.dtype {
            KvDType::F32 => block_as::<AsF32>(geom, qs, bytes, len, st),
            KvDType::F16 => block_as::<AsF16>(geom, qs, bytes, len, st),
            KvDType::Bf16 => block_as::<AsBf16>(geom, qs, bytes, len, st),
            KvDType::I8 => block_as::<AsI8>(geom, qs, bytes, len, st),
            KvDType::F8E4M3 => block_as::<AsF8>(geom, qs, bytes, len, st),
        }
    }
}

/// [`block`] for element type `E`.
///
/// # Safety
/// As [`block`]; `E` is `geom.dtype`.
unsafe fn block_as<E: Elem>(
    geom: &BlockGeometry,
    qs: &[f32],
    bytes: &[u8],
    len: usize,
    st: &mut State<'_>,
) {
    let (b, d) = (geom.block_size, geom.head_dim);
    let g = qs.len() / d;
    assert!(b % 8 == 0 && d % 8 == 0 && len <= b && bytes.len() >= 2 * b * d * E::SIZE);
    assert!(st.s.len() >= g * b && st.acc.len() >= g * d && st.m.len() >= g && st.l.len() >= g);
    let (kt, vs) = bytes.split_at(b * d * E::SIZE);
    // Scores of whole 8-token tiles: past `len` they read the block's unused (possibly stale)
    // slots, which the softmax below never looks at.
    let tiles = len.div_ceil(8);
    let mut h0 = 0;
    while h0 < g {
        let n = (g - h0).min(8);
        // SAFETY: heads h0..h0+n exist; 8 * tiles <= b; the bounds were asserted above.
        unsafe {
            match n {
                1 => scores::<E, 1>(kt, b, d, tiles, qs, h0, st.s),
                2 => scores::<E, 2>(kt, b, d, tiles, qs, h0, st.s),
                3 => scores::<E, 3>(kt, b, d, tiles, qs, h0, st.s),
                4 => scores::<E, 4>(kt, b, d, tiles, qs, h0, st.s),
                5 => scores::<E, 5>(kt, b, d, tiles, qs, h0, st.s),
                6 => scores::<E, 6>(kt, b, d, tiles, qs, h0, st.s),
                7 => scores::<E, 7>(kt, b, d, tiles, qs, h0, st.s),
                _ => scores::<E, 8>(kt, b, d, tiles, qs, h0, st.s),
            }
        }
        h0 += n;
    }
    // Int8 and fp8: each token's K scale on its scores, then (after the softmax, whose sums
    // take the weights as they are) its V scale on its weights.
    let scaled = geom.dtype.scaled();
    let (k_scales, v_scales) = geom.scales(&bytes[..geom.head_bytes()]);
    if scaled {
        crate::kernel::scale_tokens(st.s, g, b, len, k_scales);
    }
    crate::kernel::softmax_block(st.s, st.acc, st.m, st.l, g, b, d, len);
    if scaled {
        crate::kernel::scale_tokens(st.s, g, b, len, v_scales);
    }
    let mut h0 = 0;
    while h0 < g {
        let n = (g - h0).min(8);
        // SAFETY: as above; only the first `len` tokens' V rows are read.
        unsafe {
            match n {
                1 => accumulate_v::<E, 1>(vs, len, b, d, h0, st.s, st.acc),
                2 => accumulate_v::<E, 2>(vs, len, b, d, h0, st.s, st.acc),
                3 => accumulate_v::<E, 3>(vs, len, b, d, h0, st.s, st.acc),
                4 => accumulate_v::<E, 4>(vs, len, b, d, h0, st.s, st.acc),
                5 => accumulate_v::<E, 5>(vs, len, b, d, h0, st.s, st.acc),
                6 => accumulate_v::<E, 6>(vs, len, b, d, h0, st.s, st.acc),
                7 => accumulate_v::<E, 7>(vs, len, b, d, h0, st.s, st.acc),
                _ => accumulate_v::<E, 8>(vs, len, b, d, h0, st.s, st.acc),
            }
        }
        h0 += n;
    }
}

/// Scores of heads `h0..h0+H` for tokens `0..8*tiles`: `s[h][t] = sum_c qs[h][c] k[c][t]`,
/// K stored transposed (`[d][b]`). 2H accumulators and two key vectors: at most 18 of the
/// 32 vector registers.
///
/// # Safety
/// `kt` holds `d * b` elements of `E`; `8 * tiles <= b`; `qs` holds heads up to `h0 + H`
/// and `s` their `b` scores each.
// Indexed loops over constant bounds keep the accumulators in registers.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn scores<E: Elem, const H: usize>(
    kt: &[u8],
    b: usize,
    d: usize,
    tiles: usize,
    qs: &[f32],
    h0: usize,
    s: &mut [f32],
) {
    let k = kt.as_ptr();
    let q = qs[h0 * d..].as_ptr();
    for t in 0..tiles {
        // SAFETY (whole tile): element (c, 8t..8t+8) lies in `kt` for c < d; query and score
        // indices stay below the caller's bounds.
        unsafe {
            let mut acc = [[vdupq_n_f32(0.0); 2]; H];
            for c in 0..d {
                let at = (c * b + 8 * t) * E::SIZE;
                let k0 = E::load4(k.add(at));
                let k1 = E::load4(k.add(at + 4 * E::SIZE));
                for h in 0..H {
                    let qc = vld1q_dup_f32(q.add(h * d + c));
                    acc[h][0] = vfmaq_f32(acc[h][0], k0, qc);
                    acc[h][1] = vfmaq_f32(acc[h][1], k1, qc);
                }
            }
            for h in 0..H {
                let out = s.as_mut_ptr().add((h0 + h) * b + 8 * t);
                vst1q_f32(out, acc[h][0]);
                vst1q_f32(out.add(4), acc[h][1]);
            }
        }
    }
}

/// `acc[h] += sum_t w[h][t] v[t]` for heads `h0..h0+H`, tokens `0..len`, eight channels at
/// a time: each V vector is widened once for all H heads.
///
/// # Safety
/// `vs` holds `b * d` elements of `E`; `len <= b`; `s` holds heads up to `h0 + H` with `b`
/// weights each, `acc` their `d` outputs.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn accumulate_v<E: Elem, const H: usize>(
    vs: &[u8],
    len: usize,
    b: usize,
    d: usize,
    h0: usize,
    s: &[f32],
    acc: &mut [f32],
) {
    let v = vs.as_ptr();
    let w = s[h0 * b..].as_ptr();
    let a = acc[h0 * d..].as_mut_ptr();
    for c in (0..d).step_by(8) {
        // SAFETY (whole tile): row t < len <= b and channels c..c+8 <= d lie in `vs`; weight
        // and output indices stay below the caller's bounds.
        unsafe {
            let mut r = [[vdupq_n_f32(0.0); 2]; H];
            for h in 0..H {
                r[h][0] = vld1q_f32(a.add(h * d + c));
                r[h][1] = vld1q_f32(a.add(h * d + c + 4));
            }
            for t in 0..len {
                let at = (t * d + c) * E::SIZE;
                let v0 = E::load4(v.add(at));
                let v1 = E::load4(v.add(at + 4 * E::SIZE));
                for h in 0..H {
                    let p = vld1q_dup_f32(w.add(h * b + t));
                    r[h][0] = vfmaq_f32(r[h][0], v0, p);
                    r[h][1] = vfmaq_f32(r[h][1], v1, p);
                }
            }
            for h in 0..H {
                vst1q_f32(a.add(h * d + c), r[h][0]);
                vst1q_f32(a.add(h * d + c + 4), r[h][1]);
            }
        }
    }
}

/// `reps` rounds of `N` independent 4-lane FMA chains: the NEON issue rate for
/// [`crate::fma_peak_on`].
pub(crate) fn fma_chains<const N: usize>(reps: usize) {
    // SAFETY: NEON is part of every aarch64 target this crate builds for.
    unsafe {
        let a = vdupq_n_f32(std::hint::black_box(0.999));
        let b = vdupq_n_f32(std::hint::black_box(1e-6));
        let mut acc = [vdupq_n_f32(1.0); N];
        for _ in 0..reps {
            for x in &mut acc {
                *x = vfmaq_f32(b, *x, a);
            }
        }
        std::hint::black_box(acc);
    }
}
