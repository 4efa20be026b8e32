//! AVX-512 pieces of the CPU kernel for full 32-token blocks and GQA groups of 2 to 8 heads,
//! chosen at run time inside the AVX2 path.
//!
//! With 32 registers of 16 lanes, a whole group's accumulators for a 32-token row (scores) or a
//! 32-channel slice (V) stay in registers, so each K and V element is loaded and converted once
//! for the whole group; with AVX2's 16 registers of 8 lanes the group is split in pairs and
//! every row is converted again for each pair.
//!
//! The softmax between them holds each head's 32 scores in two registers. Every loop is
//! compiled once per element type ([`Elem512`]) and indexes without bounds checks, the
//! lengths checked once a block: on a Xeon (Emerald Rapids, one thread, blocks in L2) a
//! `match` on the type per row, eight bounds checks per row and the AVX2 softmax held G=8
//! to 0.41-0.46 of the FMA peak, against 0.58-0.66 after. Both loops then take two rows
//! (tokens) a pass, small groups into a second set of accumulators ([`two_sets`]), and the
//! softmax moves a head's maximum only when a block's scores rise 2^8 past it
//! ([`LAZY_MAX_SLACK`]): G=2 0.36-0.42 → 0.49-0.55 of the FMA peak (D=64), G=3 0.45 → 0.53,
//! G=4 0.48-0.52 → 0.59, G=8 0.62-0.63 → 0.63-0.68.
//!
//! Both loops request the next block's lines as they go (two lines per two K rows and per
//! two V rows of 32 channels, one after each half of the group's FMAs, [`request`]: the whole
//! next block of a 16-bit dtype), as the AVX2 loops do;
//! without it, the kernel ran at 0.26-0.42 of read bandwidth on a 256 MiB working set instead
//! of 0.6-0.97.
//!
//! Each FMA of both loops takes its factor (a query channel, a weight) from memory as a
//! broadcast operand ([`fmadd_at`]): on Zen 4 a separate broadcast runs on the vector pipes
//! that the f16 conversions need, and held f16 groups of 4 to 8 at 0.60-0.79 of the FMA
//! rate (0.82-0.89 after, blocks in L2).
//!
//! AMD Zen 4 issues each 512-bit operation as two 256-bit halves, and once took the AVX2 path
//! (3-10% faster there before these loops were compiled per type and the softmax came here).
//! Measured again on a 2-core EPYC (Zen 4), `bench kernels` 256 MiB, paths alternated, three
//! runs, AVX-512 over AVX2 in GB/s: bf16 G=3-8 1.07-1.21 at one thread, 1.03-1.44 at two;
//! f16 0.95-1.15; bf16 G=2 D=128 the one loss, 0.83-0.87 (equal or faster with the blocks in
//! L2). A later run with the VM quiet: bf16 G=4-8 0.95-1.19 (all but one above 1), G=2
//! D=128 0.88-0.91; f16 0.93-1.13, G=2 D=128 0.88-0.96, G=5 0.93-0.98. `bench decode`
//! SmolLM2-135M (G=3, bf16) at 7.8k, three rounds each: full 46-55 -> 58-60 tok/s, scout
//! 57-65 -> 70-71. So every CPU that has AVX-512 takes it; a rule per dtype and group on
//! Zen 4 would win a few percent in the cases it loses.
//!
//! Intel's cores run 512-bit vector ops on two ports only, the two FMA pipes, so the bf16
//! widening (a shift and an AND per 32 elements) and f16's conversions (two uops per 16)
//! take FMA slots there: a pass of two K rows (or two V tokens) of a G-head group is 4G FMAs
//! against 4 (bf16) or 8 (f16) widening ops, at best G/(G+1) or G/(G+2) of the FMA rate. On
//! a 2-core Xeon VM (AVX-512 FP16 and AMX; 2026-12-02) the clock under these loops was also
//! 0.86 of the FMA probe's: an FMA loop timed right after 20 ms of the tiles ran at 92.5 G
//! lanes/s, idle at 108, and took about 10 ms to recover. `perf` (cpu-clock) of `bench
//! kernels` G=4 bf16 D=64, blocks in L2, with [`Loaded`] factors: V 41%, scores 39%, the
//! softmax 14%, the rest 6%; the tiles ran as fast as a model of them without the kernel's
//! bookkeeping, 0.59-0.62 of the probe, which is those two bounds (0.8 x 0.86 = 0.69) less
//! the loads of the factors.

use std::arch::x86_64::*;

use crate::avx2::{AsBf16, AsF8, AsF16, AsF32, AsI8, Elem};
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

/// An element type's loads on AVX-512, implemented for the AVX2 path's element types so
/// every loop here is compiled once per type, as there (a `match` on the type in the inner
/// loop, with its jump table, cost more than the loop's FMAs on a Xeon).
pub(crate) trait Elem512: Elem {
    /// Loads 16 elements at `p` as f32.
    ///
    /// # Safety
    /// `p` must point at 16 readable elements; the CPU must have AVX-512F/BW.
    unsafe fn load16x(p: *const u8) -> __m512;

    /// Loads 32 elements at `p` as two f32 vectors in this type's cheapest lane order:
    /// elements 0..16 and 16..32, or with [`Elem::SPLIT`] the even elements and the odd ones
    /// ([`interleave16`] puts them back).
    ///
    /// # Safety
    /// `p` must point at 32 readable elements; the CPU must have AVX-512F/BW.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load32(p: *const u8) -> (__m512, __m512) {
        // SAFETY: the caller guarantees 32 readable elements at `p`.
        unsafe { (Self::load16x(p), Self::load16x(p.add(16 * Self::SIZE))) }
    }
}

impl Elem512 for AsF32 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load16x(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 16 readable elements at `p`.
        unsafe { _mm512_loadu_ps(p.cast()) }
    }
}

impl Elem512 for AsF16 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load16x(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 16 readable elements at `p`.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}

impl Elem512 for AsBf16 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load16x(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 16 readable elements at `p`.
        unsafe {
            let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
        }
    }

    /// One load and one op per vector, as [`AsBf16::load16`] on AVX2: a widening shuffle
    /// and a shift per 16 elements would take the ports the FMAs use.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load32(p: *const u8) -> (__m512, __m512) {
        // SAFETY: the caller guarantees 32 readable elements (64 bytes) at `p`.
        let w = unsafe { _mm512_loadu_si512(p.cast()) };
        let odd = _mm512_and_si512(w, _mm512_set1_epi32(0xffff_0000_u32 as i32));
        (
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w)),
            _mm512_castsi512_ps(odd),
        )
    }
}

impl Elem512 for AsI8 {
    /// The integers as they are: the caller applies the per-token scales.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load16x(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 16 readable bytes at `p`.
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))) }
    }
}

impl Elem512 for AsF8 {
    /// As [`AsF8::load8`], sixteen at a time.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load16x(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 16 readable bytes at `p`.
        let w = unsafe { _mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())) };
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

/// Elements 0..16 and 16..32 from the even elements `e` and the odd ones `o`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn interleave16(e: __m512, o: __m512) -> (__m512, __m512) {
    let lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    (
        _mm512_permutex2var_ps(e, lo, o),
        _mm512_permutex2var_ps(e, hi, o),
    )
}

/// The even and the odd elements of elements 0..16 (`lo`) and 16..32 (`hi`).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn deinterleave16(lo: __m512, hi: __m512) -> (__m512, __m512) {
    let e = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let o = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    (
        _mm512_permutex2var_ps(lo, e, hi),
        _mm512_permutex2var_ps(lo, o, hi),
    )
}

/// Whether a group of `G` heads sums the odd rows (K) or tokens (V) of each pass in
/// accumulators of their own: with two per head, fewer than eight chains would leave the
/// FMA units waiting on their four-cycle latency (G=3: 0.75 of their rate at best), and
/// more than five heads' second set would not fit in the registers.
/// `kernel_bf16`'s pair products take the same rule (their latency is longer still).
pub(crate) const fn two_sets<const G: usize>() -> bool {
    G <= 5
}

/// A group's accumulators, two vectors a head, and the second set of [`two_sets`].
pub(crate) struct Sets<const G: usize> {
    pub(crate) even: [[__m512; 2]; G],
    odd: [[__m512; 2]; G],
}

impl<const G: usize> Sets<G> {
    /// Starts from `even` (the second set at zero).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn from(even: [[__m512; 2]; G]) -> Self {
        Self {
            even,
            odd: [[_mm512_setzero_ps(); 2]; G],
        }
    }

    /// Head `g`'s pass of two rows (tokens): `*pa * x` into the first set, `*pb * y` into
    /// the second where there is one, each factor broadcast as `F` does it.
    ///
    /// # Safety
    /// `pa` and `pb` point at readable f32s.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fold<F: Factor>(
        &mut self,
        g: usize,
        (pa, x): (*const f32, [__m512; 2]),
        (pb, y): (*const f32, [__m512; 2]),
    ) {
        let e = &mut self.even[g];
        // SAFETY: the caller's promise.
        unsafe {
            *e = F::fma2(x, pa, *e);
            let o = self.second(g);
            *o = F::fma2(y, pb, *o);
        }
    }

    /// Head `g`'s vectors in the second set: its own where [`two_sets`], else the first's.
    #[inline]
    pub(crate) fn second(&mut self, g: usize) -> &mut [__m512; 2] {
        if two_sets::<G>() {
            &mut self.odd[g]
        } else {
            &mut self.even[g]
        }
    }

    /// Each head's two vectors, the sets added.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn sums(self) -> [[__m512; 2]; G] {
        let mut out = self.even;
        if two_sets::<G>() {
            for (o, d) in out.iter_mut().zip(&self.odd) {
                *o = [_mm512_add_ps(o[0], d[0]), _mm512_add_ps(o[1], d[1])];
            }
        }
        out
    }
}

/// `acc + x * *p`, the broadcast of `*p` folded into the FMA (`{1to16}`).
///
/// Zen 4 runs a separate `VBROADCASTSS` from memory on a vector pipe, as it does
/// `VCVTPH2PS`: with both in a loop their pipes, not the FMAs, set its pace (a loop of eight
/// FMAs, two f16 conversions and four broadcasts ran at 0.73-0.77 of the FMA rate; with the
/// broadcasts folded into the FMAs, 0.97). The folded form is a load uop only; so is a
/// separate broadcast on Intel, where one load serving both FMAs beats two ([`Loaded`]). LLVM
/// folds a broadcast only into its single use, and each factor here has two, hence the `asm!`.
/// Measured in the kernel on Zen 4 (`bench kernels` `--paths avx512`, one thread, blocks in
/// L2, three alternated runs): f16 G=4 0.60-0.70 -> 0.82-0.88 of the roofline, G=5 0.63-0.73
/// -> 0.83-0.89, G=8 0.69-0.79 -> 0.83-0.89; bf16 G=4 0.73-0.80 -> 0.81-0.86, G=5 0.72-0.80 ->
/// 0.81-0.87, G=8 0.78-0.83 -> 0.81-0.87.
///
/// # Safety
/// `p` points at a readable f32.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn fmadd_at(x: __m512, p: *const f32, acc: __m512) -> __m512 {
    let mut acc = acc;
    // SAFETY: the caller's promise; the instruction reads four bytes at `p` and writes `acc`.
    unsafe {
        std::arch::asm!(
            "vfmadd231ps {a}, {x}, dword ptr [{p}]{{1to16}}",
            a = inout(zmm_reg) acc,
            x = in(zmm_reg) x,
            p = in(reg) p,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    acc
}

/// How the loops' FMAs get their broadcast factor (a query channel, a weight), each used by
/// two FMAs: folded into both ([`Folded`]), or loaded once into a register that both take
/// ([`Loaded`]). The products and their order are the same, so are the bits; only the speed
/// differs, and by CPU: Zen 4 runs a separate broadcast on a vector pipe (see [`fmadd_at`]),
/// Intel's cores on a load port alone, where each folded one is a load of its own. On a
/// 2-core Xeon VM (AVX-512 FP16 and AMX; two 512-bit FMA pipes), a G=4 bf16 model of the loops
/// with blocks in L2 ran the score tile at 0.62-0.64 of the FMA rate folded and 0.69-0.71
/// loaded, the V tile at 0.59-0.60 and 0.67-0.70: with every factor folded, a pass of two K
/// rows asks 18 loads of the load ports for 16 FMAs, loaded 10. [`loads_factors`] measures
/// which is faster here, once a process.
pub(crate) trait Factor {
    /// `acc + x * *p`, both vectors.
    ///
    /// # Safety
    /// `p` points at a readable f32; the CPU has AVX-512F.
    unsafe fn fma2(x: [__m512; 2], p: *const f32, acc: [__m512; 2]) -> [__m512; 2];
}

/// The factor folded into each FMA as a broadcast operand ([`fmadd_at`]).
pub(crate) struct Folded;

/// The factor broadcast into a register once, both FMAs taking the register.
pub(crate) struct Loaded;

impl Factor for Folded {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fma2(x: [__m512; 2], p: *const f32, acc: [__m512; 2]) -> [__m512; 2] {
        // SAFETY: the caller's promise.
        unsafe { [fmadd_at(x[0], p, acc[0]), fmadd_at(x[1], p, acc[1])] }
    }
}

impl Factor for Loaded {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fma2(x: [__m512; 2], p: *const f32, acc: [__m512; 2]) -> [__m512; 2] {
        // SAFETY: the caller's promise. LLVM folds a broadcast only into its single use, so
        // with two this stays one `VBROADCASTSS` from memory.
        let b = _mm512_set1_ps(unsafe { *p });
        [
            _mm512_fmadd_ps(x[0], b, acc[0]),
            _mm512_fmadd_ps(x[1], b, acc[1]),
        ]
    }
}

/// Whether this CPU runs the loops faster with [`Loaded`] factors than [`Folded`] ones: a
/// G=4 bf16 and an f16 block's score and V tiles in L1 timed with each, six alternated rounds,
/// the best of each kept, 1-2 ms once a process (the Xeon VM above: 0.103-0.109 ms a round
/// loaded, 0.115-0.116 folded). Loaded must win by 3%; where they tie, folded, as the loops
/// ran before. `DECODE_NODE_AVX512_FACTORS=load` or `fold` picks without measuring.
pub(crate) fn loads_factors() -> bool {
    static LOADS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LOADS.get_or_init(|| {
        match std::env::var("DECODE_NODE_AVX512_FACTORS")
            .unwrap_or_default()
            .trim()
        {
            "load" => return true,
            "fold" => return false,
            _ => {}
        }
        if !available() {
            return false;
        }
        let (mut loaded, mut folded) = (f64::INFINITY, f64::INFINITY);
        for round in 0..6 {
            // SAFETY: AVX-512F/BW checked just above.
            unsafe {
                if round % 2 == 0 {
                    folded = folded.min(factor_probe::<Folded>());
                    loaded = loaded.min(factor_probe::<Loaded>());
                } else {
                    loaded = loaded.min(factor_probe::<Loaded>());
                    folded = folded.min(factor_probe::<Folded>());
                }
            }
        }
        loaded < 0.97 * folded
    })
}

/// How the AVX-512 loops take their factors on this CPU (measured once a process): `loaded` or
/// `folded`; `none` where the AVX-512 path does not run.
pub fn avx512_factors() -> &'static str {
    match (available(), loads_factors()) {
        (false, _) => "none",
        (true, true) => "loaded",
        (true, false) => "folded",
    }
}

/// Seconds for 200 passes of a G=4 block (D=64, in L1) of bf16 and one of f16 through
/// [`scores`] and [`accumulate_v`] with factors `F`: both types, as their widening takes
/// different pipes (Zen 4 runs f16 conversions on the pipes a separate broadcast takes).
///
/// # Safety
/// AVX-512F/BW.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn factor_probe<F: Factor>() -> f64 {
    const D: usize = 64;
    // Values near 1: K and V blocks of each type.
    let vals: Vec<f32> = (0..2 * 32 * D)
        .map(|i| 1.0 + (i % 13) as f32 / 64.0)
        .collect();
    let mut bf16 = vec![0u8; vals.len() * 2];
    let mut f16 = vec![0u8; vals.len() * 2];
    crate::encode_from_f32(crate::KvDType::Bf16, &vals, &mut bf16);
    crate::encode_from_f32(crate::KvDType::F16, &vals, &mut f16);
    let q: Vec<f32> = (0..4 * D).map(|i| (i % 5) as f32 * 0.01).collect();
    let mut s = vec![0f32; 4 * 32];
    let mut acc = vec![0f32; 4 * D];
    let start = std::time::Instant::now();
    for _ in 0..200 {
        let mut pf = Prefetch::new(&[]);
        let (kb, vb) = bf16.split_at(32 * D * 2);
        let (kh, vh) = f16.split_at(32 * D * 2);
        // SAFETY: the shapes are the functions' contracts: each K and V holds 32 rows of D
        // 2-byte elements, `q` and `acc` are [4][D], `s` [4][32]. The weights are whatever
        // the scores left (their sizes do not matter to the timing).
        unsafe {
            scores::<AsBf16, 4, F>(kb, std::hint::black_box(&q), D, &mut s, &mut pf);
            accumulate_v::<AsBf16, 4, F>(vb, D, &s, 32, &mut acc, &mut pf);
            scores::<AsF16, 4, F>(kh, std::hint::black_box(&q), D, &mut s, &mut pf);
            accumulate_v::<AsF16, 4, F>(vh, D, &s, 32, &mut acc, &mut pf);
        }
        s.fill(0.01);
    }
    std::hint::black_box(&acc);
    start.elapsed().as_secs_f64()
}

/// Scores of a full 32-token block for all `G` query heads: `s[g][t] = sum_c q[g][c] K[c][t]`,
/// the tokens of each head in `E`'s lane order (with [`Elem::SPLIT`], the even ones first).
///
/// # Safety
/// AVX-512F/BW ([`available`]); `kt` holds `d` rows of 32 elements of `E`; `qs` is `[G][d]`;
/// `s` holds at least `G * 32` elements.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn scores<E: Elem512, const G: usize, F: Factor>(
    kt: &[u8],
    qs: &[f32],
    d: usize,
    s: &mut [f32],
    pf: &mut Prefetch<'_>,
) {
    let es = E::SIZE;
    let mut sets = Sets::<G>::from([[_mm512_setzero_ps(); 2]; G]);
    // A local copy of the cursor stays in a register (see `Prefetch`).
    let mut next = *pf;
    let (k, q) = (kt.as_ptr(), qs.as_ptr());
    // Two rows a pass (`d` is even): the loop's own work and the prefetch's bookkeeping
    // were as many instructions as a small group's FMAs.
    for c in (0..d).step_by(2) {
        // SAFETY: rows c, c + 1 < d of 32 elements lie inside `kt` (the contract).
        let (k0, k1) = unsafe { E::load32(k.add(c * 32 * es)) };
        let (k2, k3) = unsafe { E::load32(k.add((c + 1) * 32 * es)) };
        for g in 0..G {
            // Half the group's FMAs between this pass's two requests (see `request`).
            if g == G / 2 {
                request::<E, G>(&mut next);
            }
            // SAFETY: g < G, c + 1 < d: inside `qs` (the contract).
            unsafe {
                let qa = q.add(g * d + c);
                sets.fold::<F>(g, (qa, [k0, k1]), (qa.add(1), [k2, k3]));
            }
        }
        request::<E, G>(&mut next);
    }
    let acc = sets.sums();
    *pf = next;
    // In the lane order of the loads (split: even tokens, then odd): the softmax does not
    // care, and [`accumulate_v`] reads the weights in that order.
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
/// AVX-512F/BW; `vs` holds 32 rows of `d` elements of `E`, `d` a multiple of 32; `p` is
/// `[G][32]` (row stride `b`); `acc` is `[G][d]`.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn accumulate_v<E: Elem512, const G: usize, F: Factor>(
    vs: &[u8],
    d: usize,
    p: &[f32],
    b: usize,
    acc: &mut [f32],
    pf: &mut Prefetch<'_>,
) {
    let es = E::SIZE;
    let (a, w, v) = (acc.as_mut_ptr(), p.as_ptr(), vs.as_ptr());
    let mut next = *pf;
    for c0 in (0..d).step_by(32) {
        let mut r = [[_mm512_setzero_ps(); 2]; G];
        for g in 0..G {
            // SAFETY: g*d + c0 + 32 <= G*d.
            let (lo, hi) = unsafe {
                (
                    _mm512_loadu_ps(a.add(g * d + c0)),
                    _mm512_loadu_ps(a.add(g * d + c0 + 16)),
                )
            };
            r[g] = if E::SPLIT {
                let (e, o) = deinterleave16(lo, hi);
                [e, o]
            } else {
                [lo, hi]
            };
        }
        let mut sets = Sets::<G>::from(r);
        // Tokens 2j and 2j + 1 a pass, as [`scores`] takes two rows.
        for j in 0..16 {
            let t = 2 * j;
            // SAFETY: rows t, t + 1 < 32 of d elements; c0 + 32 <= d.
            let (v0, v1) = unsafe { E::load32(v.add((t * d + c0) * es)) };
            let (v2, v3) = unsafe { E::load32(v.add(((t + 1) * d + c0) * es)) };
            // The tokens' weights where [`scores`] left them: split, the even tokens first.
            let (at, bt) = if E::SPLIT { (j, 16 + j) } else { (t, t + 1) };
            for g in 0..G {
                if g == G / 2 {
                    request::<E, G>(&mut next);
                }
                // SAFETY: g < G, at, bt < 32 <= b: inside `p` (the contract).
                unsafe {
                    sets.fold::<F>(
                        g,
                        (w.add(g * b + at), [v0, v1]),
                        (w.add(g * b + bt), [v2, v3]),
                    )
                };
            }
            request::<E, G>(&mut next);
        }
        let r = sets.sums();
        for g in 0..G {
            let (lo, hi) = if E::SPLIT {
                interleave16(r[g][0], r[g][1])
            } else {
                (r[g][0], r[g][1])
            };
            // SAFETY: as the loads above.
            unsafe {
                _mm512_storeu_ps(a.add(g * d + c0), lo);
                _mm512_storeu_ps(a.add(g * d + c0 + 16), hi);
            }
        }
    }
    *pf = next;
}

/// The next block's lines requested at one point of a pass of [`scores`] or
/// [`accumulate_v`], which make two a pass, after each half of the group's FMAs: one line
/// (two for f32, whose blocks have twice the lines; int8 and fp8 ask for the last line
/// again over their second half). [`Prefetch::one`] says why one at a time.
///
/// A group of 8 asks for them into L1 ([`Prefetch::one_l1`]), the others into L2. On the
/// Intel Xeon VM (AVX-512 FP16, AMX; f16 KV from DRAM, one thread, `bench kernels`, two
/// builds alternated three times), L1 gave G=8 D=128 0.83-0.85 of read bandwidth against
/// 0.78-0.79 (D=64 0.78-0.81 both ways), but G=4 and 5 0.92-0.99 against 0.96-1.04 and G=6
/// and 7 0.83-0.90 against 0.84-0.93: a group of 8 takes longest over a block, so its lines
/// wait in L1 least.
#[inline(always)]
fn request<E: Elem512, const G: usize>(next: &mut Prefetch<'_>) {
    let one = |next: &mut Prefetch<'_>| {
        if G >= 8 {
            next.one_l1();
        } else {
            next.one();
        }
    };
    one(next);
    if E::SIZE > 2 {
        one(next);
    }
}

/// `2^x` per lane as [`crate::kernel_avx2::exp2_ps`] computes it, sixteen lanes at a time:
/// lanes below -126 give 0, NaN stays NaN.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn exp2_ps(x: __m512) -> __m512 {
    let lo = _mm512_set1_ps(-126.0);
    let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, lo);
    // `max_ps` returns its second operand when either is NaN: NaN lanes stay NaN.
    let x = _mm512_max_ps(lo, x);
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
    let f = _mm512_sub_ps(x, n);
    let mut p = _mm512_set1_ps(crate::kernel_avx2::EXP2_POLY[0]);
    for k in &crate::kernel_avx2::EXP2_POLY[1..] {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(*k));
    }
    // p * 2^n in one op (n >= -126 here, so the result is a normal number or NaN).
    _mm512_maskz_scalef_ps(!tiny, p, n)
}

/// How far (base 2) a block's scores may rise above a head's running maximum before
/// [`softmax`] (and the AVX2 path's `softmax_block`) moves the maximum: up to it, the
/// weights are taken against the maximum as it stands (at most 2^8 each, far from overflow),
/// and neither the block's maximum nor a rescale of the state is computed. The state holds `l = sum 2^(s - m)` and the matching
/// `acc` for whatever `m` it holds, so every path may fold the next block into it; `m` is
/// then a lower bound of the running maximum, within this slack of it.
pub(crate) const LAZY_MAX_SLACK: f32 = 8.0;

/// The online softmax over a full 32-token block's scores for all `G` heads, as
/// `kernel_avx2::softmax_block` does it (a NaN score makes its head's output NaN; a head with
/// no finite score yet keeps its state and gets zero weights), with each head's 32 scores in
/// two registers and every head's rescale factor from one vector `exp2`; where every score
/// lies within [`LAZY_MAX_SLACK`] of its head's maximum, the maximum stays as it is.
///
/// # Safety
/// AVX-512F/BW ([`available`]); `s` is `[G][b]` with `b >= 32`, `m` and `l` hold `G`
/// elements, `acc` is `[G][d]`.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn softmax<const G: usize>(
    s: &mut [f32],
    b: usize,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
    d: usize,
) {
    let sp = s.as_mut_ptr();
    let mut v = [[_mm512_setzero_ps(); 2]; G];
    // Whether no head's scores rise more than `LAZY_MAX_SLACK` above its running maximum
    // (ordered compares: a NaN score fails, so does a head with no maximum yet).
    let mut near = true;
    for h in 0..G {
        // SAFETY: h < G: the head's 32 scores lie inside `s` (the contract).
        v[h] = unsafe {
            [
                _mm512_loadu_ps(sp.add(h * b)),
                _mm512_loadu_ps(sp.add(h * b + 16)),
            ]
        };
        let top = _mm512_set1_ps(m[h] + LAZY_MAX_SLACK);
        near &= m[h].is_finite()
            && _mm512_cmp_ps_mask::<_CMP_LE_OQ>(v[h][0], top)
                & _mm512_cmp_ps_mask::<_CMP_LE_OQ>(v[h][1], top)
                == 0xffff;
    }
    if near {
        // The weights against the maximum as it stands (each at most 2^LAZY_MAX_SLACK): the
        // state needs no rescale, and the block no reduction of its maximum.
        for h in 0..G {
            let mb = _mm512_set1_ps(m[h]);
            let p0 = exp2_ps(_mm512_sub_ps(v[h][0], mb));
            let p1 = exp2_ps(_mm512_sub_ps(v[h][1], mb));
            // SAFETY: as the loads above.
            unsafe {
                _mm512_storeu_ps(sp.add(h * b), p0);
                _mm512_storeu_ps(sp.add(h * b + 16), p1);
            }
            l[h] += _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
        }
        return;
    }
    let mut m_old = [f32::NEG_INFINITY; 16];
    let mut m_new = [f32::NEG_INFINITY; 16];
    for h in 0..G {
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v[h][0], v[h][0])
            | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v[h][1], v[h][1]);
        m_old[h] = m[h];
        m_new[h] = if nan != 0 {
            f32::NAN
        } else {
            crate::kernel::nan_max(
                m_old[h],
                _mm512_reduce_max_ps(_mm512_max_ps(v[h][0], v[h][1])),
            )
        };
    }
    // -inf - -inf is NaN: such heads (no finite score yet) are skipped below.
    let mut alpha = [0f32; 16];
    // SAFETY: sixteen lanes from and into arrays of sixteen floats.
    unsafe {
        let (o, n) = (
            _mm512_loadu_ps(m_old.as_ptr()),
            _mm512_loadu_ps(m_new.as_ptr()),
        );
        _mm512_storeu_ps(alpha.as_mut_ptr(), exp2_ps(_mm512_sub_ps(o, n)));
    }
    for h in 0..G {
        let out = [h * b, h * b + 16];
        if m_new[h] == f32::NEG_INFINITY {
            for at in out {
                // SAFETY: as the loads above.
                unsafe { _mm512_storeu_ps(sp.add(at), _mm512_setzero_ps()) };
            }
            continue;
        }
        let mb = _mm512_set1_ps(m_new[h]);
        let p0 = exp2_ps(_mm512_sub_ps(v[h][0], mb));
        let p1 = exp2_ps(_mm512_sub_ps(v[h][1], mb));
        // SAFETY: as the loads above.
        unsafe {
            _mm512_storeu_ps(sp.add(out[0]), p0);
            _mm512_storeu_ps(sp.add(out[1]), p1);
        }
        l[h] = l[h] * alpha[h] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
        m[h] = m_new[h];
        if alpha[h] != 1.0 {
            let a = _mm512_set1_ps(alpha[h]);
            for x in acc[h * d..(h + 1) * d].chunks_exact_mut(16) {
                // SAFETY: sixteen floats of `x`.
                unsafe {
                    _mm512_storeu_ps(
                        x.as_mut_ptr(),
                        _mm512_mul_ps(a, _mm512_loadu_ps(x.as_ptr())),
                    )
                };
            }
        }
    }
}

/// Runs `$body` with the constant `$G` set to a group size of 2 to 8 (true), or nothing for
/// any other size (false).
macro_rules! with_group {
    ($g:expr, $G:ident => $body:expr) => {
        match $g {
            2 => {
                const $G: usize = 2;
                $body;
                true
            }
            3 => {
                const $G: usize = 3;
                $body;
                true
            }
            4 => {
                const $G: usize = 4;
                $body;
                true
            }
            5 => {
                const $G: usize = 5;
                $body;
                true
            }
            6 => {
                const $G: usize = 6;
                $body;
                true
            }
            7 => {
                const $G: usize = 7;
                $body;
                true
            }
            8 => {
                const $G: usize = 8;
                $body;
                true
            }
            _ => false,
        }
    };
}
pub(crate) use with_group;

/// [`scores`] for a run-time group size; false (nothing done) outside 2..=8.
///
/// # Safety
/// AVX-512F/BW ([`available`]). The slices' lengths are checked here, once a block, so the
/// loops index without checks.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn scores_dyn<E: Elem512>(
    g: usize,
    kt: &[u8],
    qs: &[f32],
    d: usize,
    s: &mut [f32],
    pf: &mut Prefetch<'_>,
) -> bool {
    assert!(kt.len() >= 32 * d * E::SIZE && qs.len() >= g * d && s.len() >= g * 32);
    // SAFETY: the CPU is the caller's promise; the lengths are checked above.
    unsafe {
        if loads_factors() {
            with_group!(g, G => scores::<E, G, Loaded>(kt, qs, d, s, pf))
        } else {
            with_group!(g, G => scores::<E, G, Folded>(kt, qs, d, s, pf))
        }
    }
}

/// [`softmax`] for a run-time group size; false (nothing done) outside 2..=8 or when `d` is
/// not a multiple of 16.
///
/// # Safety
/// AVX-512F/BW ([`available`]). The slices' lengths are checked here.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn softmax_dyn(
    g: usize,
    s: &mut [f32],
    b: usize,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
    d: usize,
) -> bool {
    if !d.is_multiple_of(16) {
        return false;
    }
    assert!(
        b >= 32
            && s.len() >= (g - 1) * b + 32
            && m.len() >= g
            && l.len() >= g
            && acc.len() >= g * d
    );
    // SAFETY: the CPU is the caller's promise; the lengths are checked above.
    unsafe { with_group!(g, G => softmax::<G>(s, b, m, l, acc, d)) }
}

/// [`accumulate_v`] for a run-time group size; false (nothing done) outside 2..=8 or when `d`
/// is not a multiple of 32.
///
/// # Safety
/// AVX-512F/BW ([`available`]). The multiple of 32 and the slices' lengths are checked here.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn accumulate_v_dyn<E: Elem512>(
    g: usize,
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
    assert!(
        b >= 32
            && vs.len() >= 32 * d * E::SIZE
            && p.len() >= (g - 1) * b + 32
            && acc.len() >= g * d
    );
    // SAFETY: the CPU is the caller's promise; the lengths are checked above.
    unsafe {
        if loads_factors() {
            with_group!(g, G => accumulate_v::<E, G, Loaded>(vs, d, p, b, acc, pf))
        } else {
            with_group!(g, G => accumulate_v::<E, G, Folded>(vs, d, p, b, acc, pf))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvDType;

    /// Scores and V sums of one block through `F`, for a group of `G` heads.
    fn tiles<E: Elem512, const G: usize, F: Factor>(
        kv: &[u8],
        q: &[f32],
        w: &[f32],
        d: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let (kt, vs) = kv.split_at(32 * d * E::SIZE);
        let mut s = vec![0f32; G * 32];
        let mut acc: Vec<f32> = (0..G * d).map(|i| i as f32 * 0.5).collect();
        let mut pf = Prefetch::new(&[]);
        // SAFETY: the tests run only where `available()`; the shapes are the contracts.
        unsafe {
            scores::<E, G, F>(kt, q, d, &mut s, &mut pf);
            accumulate_v::<E, G, F>(vs, d, w, 32, &mut acc, &mut pf);
        }
        (s, acc)
    }

    fn same_bits_for<E: Elem512>(dtype: KvDType) {
        let mut seed = 0x9e37_79b9_u32;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed as f32 / u32::MAX as f32) - 0.5
        };
        for d in [32, 64, 128] {
            let vals: Vec<f32> = (0..2 * 32 * d).map(|_| next()).collect();
            let mut kv = vec![0u8; vals.len() * dtype.size()];
            crate::encode_from_f32(dtype, &vals, &mut kv);
            let q: Vec<f32> = (0..8 * d).map(|_| next()).collect();
            let w: Vec<f32> = (0..8 * 32).map(|_| next().abs()).collect();
            for g in 2..=8 {
                with_group!(g, G => {
                    let folded = tiles::<E, G, Folded>(&kv, &q, &w, d);
                    let loaded = tiles::<E, G, Loaded>(&kv, &q, &w, d);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&folded.0), bits(&loaded.0), "{dtype:?} G={g} D={d} scores");
                    assert_eq!(bits(&folded.1), bits(&loaded.1), "{dtype:?} G={g} D={d} V");
                });
            }
        }
    }

    #[test]
    fn loaded_and_folded_factors_give_the_same_bits() {
        if !available() {
            return;
        }
        same_bits_for::<AsBf16>(KvDType::Bf16);
        same_bits_for::<AsF16>(KvDType::F16);
        same_bits_for::<AsF32>(KvDType::F32);
    }

    #[test]
    fn the_factor_choice_is_made_and_named() {
        let name = avx512_factors();
        assert!(["none", "loaded", "folded"].contains(&name), "{name}");
        assert_eq!(name == "none", !available());
    }
}
