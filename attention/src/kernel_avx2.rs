//! AVX2 + FMA + F16C path of the CPU kernel (x86-64), chosen at run time (with AVX-512 for
//! full 32-token blocks of GQA groups where the CPU has it: `kernel_avx512`).
//!
//! Per block: scores come from register tiles of heads x token vectors read straight from the
//! stored keys (each key vector converted once per tile); the softmax uses a vector `exp2`
//! (a degree-6 polynomial on [-0.5, 0.5], error below 1e-7 relative) and keeps a head's maximum
//! until a block rises 2^8 past it, as the AVX-512 one does; V rows are converted as they
//! stream and accumulated into up to six heads held in registers. Every loop is compiled once
//! per element type ([`Elem`]), so no branch on the type sits inside one.
//!
//! Where a block's time goes once the FMAs bound it (bf16, one thread, blocks in L2, Zen 4;
//! `bench kernels --paths avx2` on throwaway builds with pieces taken out): the score tiles
//! alone run at 0.74 (D=64) and 0.80-0.84 (D=128) of the FMA peak, the V tiles alone at
//! 0.63-0.65 / 0.66-0.70 at G=4 and 0.76 / 0.79 at G=8, and the softmax is 11-17% of a
//! block at D=64, 6-9% at D=128. Without any softmax, G=4 would run at 0.77-0.78. Measured
//! no faster, so not kept: one V pass over two blocks' tokens per accumulator fill (V alone
//! over the same 32 rows twice reached 0.77; over two blocks it did not), V's rows fetched
//! into L1 ahead (1-5% slower), the softmax's sums reduced eight heads at a time, two
//! channels a pass of the score tiles, and V's bf16 accumulators left in their split order.
//! Nor, on a Sapphire Rapids VM (f16, G=4, L2), V tiles of four heads three vectors wide (12
//! FMA chains instead of 8, the head dim's rest a vector at a time): D=128 19.3-19.5 GB/s
//! against 18.6-19.4, D=64 16.2-17.2 against 17.2-17.9.
//!
//! What the algorithm itself allows (`scripts/kernel-model/avx2_block.c`: the same tiles,
//! softmax and V loop in C with none of the bookkeeping; G=4 bf16 in L2, Zen 4, p95 over the
//! peak's p95): 0.92 without the softmax, 0.78-0.80 with it at D=64 and 0.84-0.86 at D=128,
//! where this kernel runs at 0.66 and 0.72. The softmax's cost is its instructions (it halves
//! with D), not a wait between the score and V loops: scoring block n and running its softmax
//! before block n-1's V gained nothing. Its cheaper `exp2` (rounding by adding 1.5 * 2^23, a
//! degree-5 polynomial, the exponent added as an integer: 8.7 FMA slots a vector against
//! 10.4) gained 1-2%. The kernel's own rest, measured by taking it out (wrong results, timing
//! only): prefetch 0-3%, the bf16 order shuffles of score and V tiles 0-3%, and ~80 cycles a
//! block of setup (`line_calls`, `spread_over`, scales, state): ~7% of a G=4 D=64 block
//! alone, less beside the arithmetic (the spread hoisted out of the block: +0-1.5%). From
//! memory, without the next block's prefetch, D=128 fell from 16.6 to 7 GB/s. A Rust copy of
//! the model runs as fast as the C one (0.76-0.79), and with the order shuffles and a
//! prefetch added still at 0.75-0.76. Swapping the kernel's pieces for the model's one at a
//! time, alternated in one process (p95 of 300 rounds; runs in separate processes move by
//! more than these differences on a shared VM): scores 0.68 -> 0.72, softmax -> 0.73, V ->
//! 0.72, all three 0.76. The softmax's gain is kept ([`softmax_near_full`]), and the V
//! loop's was its width chosen inside it ([`v_tile`]). The score tile's is not yet known: the
//! model's loop with its shapes passed at run time, or with the prefetch counting added, ran
//! as fast; nor did the kernel gain from its block at constant shapes (G=4, D=64 and 32
//! tokens known to the compiler), `s` and `acc` on 64-byte boundaries, or 8 instead of 32
//! blocks a call.
//!
//! Those in-process figures came from variants timed in a fixed order each round; the first
//! after the FMA probe runs 5-10% slower, so such an A/B favours the later variant (with
//! the order turned each round, [`softmax_near_full`] measured +1-3%, not +3-8%). Taken
//! apart that way (G=4 bf16, blocks in L2, one thread, Zen 4, pieces left out, timing only),
//! a block's time is V 47% / 50% (D=64 / 128; its loop at 0.71 / 0.70 of the FMA peak),
//! scores 40% (0.84 / 0.87), softmax 10% / 6% (9-11 cycles per 8 weights) and the rest 5% /
//! 3% (75-95 cycles). V's loop has the score loop's instructions (a row load, its widening,
//! four broadcasts, eight FMAs on eight chains) and its L2 lines per FMA, yet runs ~15%
//! slower, and none of these moved it by more than 3%: rows taken as floats unwidened (no
//! faster), constant weights in place of the broadcasts (+3%), no prefetch (-1%), no order
//! shuffles (+2%), 32 tokens as a constant trip count (+1-3%), chains started from zero and
//! added to the accumulators after the loop (+0-1%), two tokens a pass for every tile
//! (+0-1%; f16 G=8 ran 25% slower, its registers spilled). What moved it is fewer loop
//! instructions per FMA where registers allow ([`score_steps`], [`v_steps`]) and a second
//! accumulator set where a tile had fewer than eight chains (three bf16 heads).

use std::arch::x86_64::*;
use std::marker::PhantomData;

use crate::avx2::{AsBf16, AsF8, AsF16, AsF32, AsI8, Elem, deinterleave, hsum, interleave};
use crate::block::BlockGeometry;
use crate::dtype::KvDType;
use crate::kernel::State;
use crate::kernel_avx512::LAZY_MAX_SLACK;

/// True when this CPU can run the path.
pub(crate) fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// `2^f` for `|f| <= 0.5` as `1 + f P(f)`, P of degree 5, by Horner from the highest
/// coefficient (Cephes' exp2f coefficients: relative error below 1e-7 in f32, measured; three
/// ops fewer than a Taylor series of `e^(f ln 2)`). Every vector `exp2` of the kernels uses it.
pub(crate) const EXP2_POLY: [f32; 7] = [
    1.535_336_2e-4,
    1.339_887_4e-3,
    9.618_437e-3,
    5.550_332_5e-2,
    2.402_264_8e-1,
    6.931_472e-1,
    1.0,
];

/// `2^x` per lane; lanes below -126 give 0 (exact enough: the weight underflows anyway).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn exp2_ps(x: __m256) -> __m256 {
    let lo = _mm256_set1_ps(-126.0);
    let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, lo);
    // `max_ps` returns its second operand when either is NaN: NaN lanes stay NaN.
    let x = _mm256_max_ps(lo, x);
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
    let f = _mm256_sub_ps(x, n);
    let mut p = _mm256_set1_ps(EXP2_POLY[0]);
    for k in &EXP2_POLY[1..] {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(*k));
    }
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    let r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    _mm256_andnot_ps(tiny, r)
}

/// `2^x` per lane for a softmax's weights: [`exp2_ps`]'s bits where `-126 <= x <= 127`
/// (the weights of every score within 126 of its maximum), exactly 0 for `x <= -127`
/// (`-inf` too), a value below `2^-126` between, where `exp2_ps` gives 0; NaN stays NaN.
///
/// Three ops fewer than `exp2_ps` (a multiply among them, on a pipe the FMAs need): `n` is
/// added to the polynomial's exponent field as an integer, which also leaves out `exp2_ps`'s
/// underflow mask. Exact where it agrees: `p` lies in `[2^-0.5, 2^0.5]`, and `p >= 1` where
/// `x >= -126` rounds to `n = -126` (`x - n >= 0` there), so the sum is a normal number's
/// bits; at `x <= -127` (clamped) it is `p(0) = 1`'s zero mantissa with an exponent field
/// of zero. Alone (one thread, Zen 4, 16 vectors in L1, alternated in one process) it takes
/// 4.8 cycles a vector where `exp2_ps` takes 6.1; in the kernel's weights, AVX2 blocks in L2
/// ran 1-2% faster at G >= 4 (p95 of 300 rounds over the FMA peak, bf16 G=4 D=64 0.645 ->
/// 0.658, f16 G=8 D=128 0.811 -> 0.819; the variants' order turned each round), the same at
/// G=1.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp2_weights(x: __m256) -> __m256 {
    // `max_ps` returns its second operand when either is NaN: NaN lanes stay NaN.
    let x = _mm256_max_ps(_mm256_set1_ps(-127.0), x);
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
    let f = _mm256_sub_ps(x, n);
    let mut p = _mm256_set1_ps(EXP2_POLY[0]);
    for k in &EXP2_POLY[1..] {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(*k));
    }
    let e = _mm256_slli_epi32::<23>(_mm256_cvtps_epi32(n));
    _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e))
}

#[inline]
#[target_feature(enable = "avx2")]
fn hmax(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
    _mm_cvtss_f32(m)
}

/// Prefetches of the next block, spread evenly over this block's inner loops (each calls
/// [`Prefetch::line`] once per iteration, or places single requests itself with
/// [`Prefetch::one`]): its bytes arrive while this block computes,
/// without a burst that fills the miss buffers ahead of this block's own loads. Into L2, not
/// L1: L1's few miss buffers capped the lines in flight.
///
/// Evenly means the block's calls and the next block's lines in proportion
/// ([`Prefetch::spread_over`]): one line per call had a group of 3+ heads request all of it
/// during its K loops, and a burst at the start (once used for one head) stalled the loads
/// behind it. The counts stay whole numbers: an exact ratio kept in a running credit, or a
/// loop over the lines of a call, cost 15-25% at one thread in the calls' own instructions.
/// `bench kernels` AVX2, 2-core EPYC, three alternating runs, GB/s at 1 / 2 threads, against
/// one line per call: G=3 D=64 (SmolLM2's shape) 16.5 -> 21 / 31 -> 38; G=4 D=64
/// 16.5 -> 18.5 / 28 -> 35; G=4 D=128 15 -> 15.5 / 25 -> 29; G=8 +0-5%. Against the burst,
/// G=1 (two lines a call): 11-13 -> 18-25 / 18-24 -> 29-32 (bf16, D=64 and 128).
///
/// Every line is requested: the hardware does not fill gaps. On an Intel Xeon VM (AVX-512,
/// f16, one thread, from DRAM), requesting one line of each pair, one pair of each two or
/// four, or only the first lines of each 4 KiB page took G=1 from 0.85 of read bandwidth to
/// 0.55-0.6 and G=5 and 8 to 0.4-0.5: neither the adjacent-line prefetcher nor the L2
/// streamer fetched the rest. Requesting two blocks ahead rather than one measured the same.
///
/// A plain value that each loop copies into a local and hands back: kept behind a shared
/// reference (a `Cell`), the cursor went through memory every iteration, a store-to-load
/// chain longer than a small tile's FMAs.
#[derive(Clone, Copy)]
pub(crate) struct Prefetch<'a> {
    next: &'a [u8],
    off: usize,
    /// Bytes a request covers: one line, or two where a block makes fewer calls than the
    /// next has lines (one head). Two prefetches either way, the second of the same line
    /// when one: no branch or loop, which measured 20-25% slower in a group's tiles.
    step: usize,
    /// Calls passed over after each request, and left to pass over.
    skip: u8,
    wait: u8,
    /// Calls made (tests compare them with [`line_calls`]).
    #[cfg(test)]
    pub(crate) made: usize,
}

impl<'a> Prefetch<'a> {
    /// Prefetches of `next` (empty: none), a line per call until [`Prefetch::spread_over`].
    pub(crate) fn new(next: &'a [u8]) -> Self {
        Self {
            next,
            off: 0,
            step: 64,
            skip: 0,
            wait: 0,
            #[cfg(test)]
            made: 0,
        }
    }

    /// Spreads the lines left over the next `calls` calls: two lines a call where there are
    /// more lines than calls, or one every `floor(calls / lines)` calls, so the last line
    /// goes out a little early rather than late.
    pub(crate) fn spread_over(&mut self, calls: usize) {
        let lines = self.next.len().saturating_sub(self.off).div_ceil(64);
        let calls = calls.max(1);
        (self.step, self.skip) = if lines > calls {
            (128, 0)
        } else {
            (64, (calls / lines.max(1) - 1).min(u8::MAX as usize) as u8)
        };
        self.wait = 0;
    }

    /// Bytes of the next block requested so far (all of it once every line was).
    pub(crate) fn requested(&self) -> usize {
        self.off.min(self.next.len())
    }

    /// Requests one line: the next not yet requested, or the last again once all were.
    ///
    /// For loops that place their requests themselves, one at a time between FMAs (the
    /// AVX-512 group loops). Two requests side by side, as [`Prefetch::line`] makes them,
    /// stream less from memory: on an Intel Xeon (AVX-512 FP16, AMX), f16 KV from DRAM at
    /// one thread, paired ratio to read bandwidth against two a pass at its top (three
    /// alternations of two builds): G=5 0.78-0.83 -> 0.91-0.94, G=8 0.73-0.78 -> 0.75-0.84,
    /// with no change in L2. A C model of the loop with blocks in L2 at the same speed gave 11 -> 18 GB/s, 2
    /// lines a pass of 8-16 FMAs a line, whatever the alignment of the loop's code; the two
    /// side by side anywhere in the pass measured alike. No branch, so that the compiler
    /// leaves it where it is written: [`Prefetch::line`]'s branches, called between FMAs,
    /// were moved to the end of the pass. With no next block, the address is the empty
    /// slice's, which the CPU drops as cheaply as a cached line (0.7 cycles a request).
    #[inline]
    pub(crate) fn one(&mut self) {
        let p = self.next_line();
        // SAFETY: a prefetch is a hint and never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) };
    }

    /// [`Prefetch::one`] into L1 as well (the AVX-512 loops of a group of 8).
    #[inline]
    pub(crate) fn one_l1(&mut self) {
        let p = self.next_line();
        // SAFETY: as `one`'s.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) };
    }

    /// The line [`Prefetch::one`] asks for, the cursor moved past it.
    #[inline(always)]
    fn next_line(&mut self) -> *const u8 {
        #[cfg(test)]
        {
            self.made += 1;
        }
        let last = self.next.len().saturating_sub(64);
        let p = self.next.as_ptr().wrapping_add(self.off.min(last));
        self.off += 64;
        p
    }

    /// Requests the lines this call owes, if any are left.
    ///
    /// The register tiles call it at the top of each pass (`u` steps, or 8 V tokens) and
    /// keep it so. On the Intel Xeon VM (`bench kernels --paths avx2 --kv-dtype f16`, one
    /// thread, from DRAM, two alternations), calls moved between the steps and tokens were
    /// compiled back to the top of the pass, and the V loop's tokens taken one call apart
    /// ran G=4 10% slower (G=5 2-5%, G=8 the same); a branchless `line` (a request every
    /// call, the cursor moved on its turn only) ran G=5 20-24% and G=8 28% slower.
    #[inline]
    pub(crate) fn line(&mut self) {
        #[cfg(test)]
        {
            self.made += 1;
        }
        if self.wait > 0 {
            self.wait -= 1;
            return;
        }
        self.wait = self.skip;
        if self.off < self.next.len() {
            let p = self.next.as_ptr().wrapping_add(self.off);
            // SAFETY: a prefetch is a hint and never faults, whatever the address (the
            // second may lie past `next`, computed without `add`'s in-bounds promise).
            unsafe {
                _mm_prefetch::<_MM_HINT_T1>(p.cast());
                _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(self.step - 64).cast());
            }
            self.off += self.step;
        }
    }
}

/// Calls to [`Prefetch::line`] that [`block`] makes for a block of `len` tokens (`nv`
/// vectors of 8) of a group of `g` heads on the register tiles (not the AVX-512 group path,
/// which requests its lines one at a time, [`Prefetch::one`]): K once per tile, run of
/// `T` vectors (then single vectors) and `P` channels; V once per tile, token and slice of
/// `8 W` channels. It mirrors the tile shapes that [`scores`] and [`block_as`] pick (a
/// test counts the calls).
fn line_calls(g: usize, d: usize, nv: usize, len: usize) -> usize {
    let mut calls = 0;
    let mut h0 = 0;
    while h0 < g {
        let h = tile_heads(g - h0);
        let (t, p, w) = match h {
            1 => (4, 2, 8),
            2 => (4, 1, 4),
            3 => (2, 2, 2),
            _ => (2, 1, 2),
        };
        let singles = nv % t;
        let single_p = if h <= 4 { 2 } else { 1 };
        calls += (nv / t) * (d / p) + singles * (d / single_p);
        let w = if d.is_multiple_of(8 * w) { w } else { 1 };
        calls += (d / (8 * w)) * len;
        h0 += h;
    }
    calls
}

/// Folds one block (`len` tokens) into `st`. `qs` is the pre-scaled `[G][D]` query; `qb`,
/// where given, the same rounded to bf16, for bf16 blocks that `kernel_bf16` takes.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]), AVX-512 F/BW when `avx512`, and
/// AVX-512 BF16 too when `qb` is given;
/// `bytes` must hold a whole head block of `geom`; `geom.block_size` and `geom.head_dim` must
/// be multiples of 8.
#[allow(clippy::too_many_arguments)] // the block, the state and how to run it
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn block(
    geom: &BlockGeometry,
    qs: &[f32],
    qb: Option<&[u16]>,
    bytes: &[u8],
    len: usize,
    st: &mut State<'_>,
    pf: &mut Prefetch<'_>,
    avx512: bool,
) {
    let (b, d) = (geom.block_size, geom.head_dim);
    if let Some(qb) = qb
        && geom.dtype == KvDType::Bf16
    {
        let g = qs.len() / d;
        let (kt, vs) = bytes.split_at(b * d * 2);
        if st.amx.is_some() && crate::kernel_amx::takes(geom.dtype, g, b, len, d) {
            // SAFETY: the CPU is the caller's promise (tiles exist only where it has AMX);
            // the lengths are checked inside, which spreads its own requests.
            if unsafe { crate::kernel_amx::block::<AsBf16>(kt, vs, None, d, qb, st, pf) } {
                return;
            }
        }
        if crate::kernel_bf16::takes(g, b, len, d) {
            // It requests the next block's lines itself, one at a time (`Prefetch::one`).
            // SAFETY: the CPU is the caller's promise; the lengths are checked inside.
            if unsafe { crate::kernel_bf16::block(kt, vs, d, qb, st, pf) } {
                return;
            }
        }
    }
    // Int8 and fp8 blocks by tiles too, their elements widened to bf16 exactly.
    if let Some(qb) = qb
        && geom.dtype.scaled()
        && st.amx.is_some()
        && crate::kernel_amx::takes(geom.dtype, qs.len() / d, b, len, d)
    {
        let (kt, vs) = bytes.split_at(b * d);
        let scales = Some(geom.scales(&bytes[..geom.head_bytes()]));
        // SAFETY: the CPU is the caller's promise (tiles exist only where it has AMX); the
        // lengths are checked inside.
        let done = unsafe {
            match geom.dtype {
                KvDType::I8 => crate::kernel_amx::block::<AsI8>(kt, vs, scales, d, qb, st, pf),
                _ => crate::kernel_amx::block::<AsF8>(kt, vs, scales, d, qb, st, pf),
            }
        };
        if done {
            return;
        }
    }
    st.in_channel_order();
    // SAFETY (every arm): forwarded; the element type is the block's.
    unsafe {
        match geom.dtype {
            KvDType::F32 => block_as::<AsF32>(geom, qs, bytes, len, st, pf, avx512),
            KvDType::F16 => block_as::<AsF16>(geom, qs, bytes, len, st, pf, avx512),
            KvDType::Bf16 => block_as::<AsBf16>(geom, qs, bytes, len, st, pf, avx512),
            KvDType::I8 => block_as::<AsI8>(geom, qs, bytes, len, st, pf, avx512),
            KvDType::F8E4M3 => block_as::<AsF8>(geom, qs, bytes, len, st, pf, avx512),
        }
    }
}

/// [`block`] for element type `E`.
///
/// # Safety
/// As [`block`]; `E` is `geom.dtype`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_as<E: crate::kernel_avx512::Elem512>(
    geom: &BlockGeometry,
    qs: &[f32],
    bytes: &[u8],
    len: usize,
    st: &mut State<'_>,
    pf: &mut Prefetch<'_>,
    avx512: bool,
) {
    let (b, d, es, dt) = (geom.block_size, geom.head_dim, E::SIZE, geom.dtype);
    let g = qs.len() / d;
    debug_assert!(b % 8 == 0 && d % 8 == 0 && bytes.len() >= 2 * b * d * es);
    let nv = len.div_ceil(8);
    let (kt, vs) = bytes.split_at(b * d * es);
    let scaled = dt.scaled();
    // AVX-512 keeps a whole group of 2..8 heads in registers for full 32-token blocks (each K
    // and V element converted once per group); `avx512` says the CPU has it. Its scores of a
    // split type leave the tokens even-then-odd, which only its own V loop reads: where that
    // loop cannot take the head dim (not a multiple of 32), the AVX2 loops take the block.
    let wide = avx512
        && b == 32
        && len == 32
        && (2..=8).contains(&g)
        && (!E::SPLIT || d.is_multiple_of(32));
    // The AVX-512 group loops place their requests themselves (`Prefetch::one`).
    if !wide {
        pf.spread_over(line_calls(g, d, nv, len));
    }
    // SAFETY: forwarded from this function's contract; `s` holds G x b scores; `wide` checked
    // the CPU.
    let done = wide && unsafe { crate::kernel_avx512::scores_dyn::<E>(g, kt, qs, d, st.s, pf) };
    if !done {
        // SAFETY: forwarded from this function's contract; `s` holds G x b >= G x 8nv scores.
        unsafe { scores::<E>(kt, b, d, nv, qs, g, st.s, pf) };
    }
    // Int8 and fp8: each token's K scale multiplies its scores; after the softmax (whose sums
    // take the weights as they are), its V scale multiplies its weights.
    let (k_scales, v_scales) = geom.scales(&bytes[..geom.head_bytes()]);
    if scaled {
        crate::kernel::scale_tokens(st.s, g, b, len, k_scales);
    }
    // SAFETY: `wide` checked the CPU and a full block of 32 tokens; `s` holds G x b >= G x
    // 8nv scores; `acc`, `m`, `l` hold G heads.
    unsafe {
        let done = (wide && crate::kernel_avx512::softmax_dyn(g, st.s, b, st.m, st.l, st.acc, d))
            || (len == FULL && b == FULL && softmax_near_full(st, g));
        if !done {
            softmax_block(st, g, b, d, nv, len)
        }
    };
    if scaled {
        crate::kernel::scale_tokens(st.s, g, b, len, v_scales);
    }
    // SAFETY: `wide` checked the CPU; a full block of 32 tokens; `s` is [G][b], acc [G][d].
    if wide && unsafe { crate::kernel_avx512::accumulate_v_dyn::<E>(g, vs, d, st.s, b, st.acc, pf) }
    {
        return;
    }
    // V: a tile of up to six heads' accumulators lives in registers, so each V vector is
    // loaded and converted once per tile (8..12 chains: fewer slices for more heads).
    let mut h0 = 0;
    while h0 < g {
        let n = tile_heads(g - h0);
        // SAFETY: forwarded from this function's contract; heads h0..h0+n exist.
        unsafe {
            match n {
                1 => v_tile::<E, 1, 8>(vs, len, b, d, h0, st, pf),
                2 => v_tile::<E, 2, 4>(vs, len, b, d, h0, st, pf),
                3 => v_tile::<E, 3, 2>(vs, len, b, d, h0, st, pf),
                4 => v_tile::<E, 4, 2>(vs, len, b, d, h0, st, pf),
                5 => v_tile::<E, 5, 2>(vs, len, b, d, h0, st, pf),
                _ => v_tile::<E, 6, 2>(vs, len, b, d, h0, st, pf),
            }
        }
        h0 += n;
    }
}

/// The online softmax over one block's scores, eight heads at a time: each head's block
/// maximum (a NaN score makes the head's output NaN, as on the scalar path), the eight
/// rescale factors of the running state in one vector `exp2`, then the weights in place of
/// the scores. Only a partly filled last vector is masked (its slots may hold stale bytes).
/// Where every score of the eight lies within [`LAZY_MAX_SLACK`] of its head's maximum, the
/// maxima stay as they are and only the weights are computed.
///
/// # Safety
/// AVX2 and FMA; `st.s` holds `g * b` scores with `8 * nv <= b`, `len <= 8 * nv`; `st.acc`
/// holds `g * d` and `st.m`, `st.l` hold `g`.
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_block(st: &mut State<'_>, g: usize, b: usize, d: usize, nv: usize, len: usize) {
    let neg = _mm256_set1_ps(f32::NEG_INFINITY);
    let tail = len - 8 * (nv - 1); // valid lanes of the last vector, 1..=8
    let tail_mask = _mm256_cmp_ps::<_CMP_LT_OQ>(
        _mm256_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0),
        _mm256_set1_ps(tail as f32),
    );
    for h0 in (0..g).step_by(8) {
        let n = (g - h0).min(8);
        // Whether no head's scores rise more than `LAZY_MAX_SLACK` above its running maximum
        // (ordered compares: a NaN score fails, so does a head with no maximum yet), as the
        // AVX-512 softmax does it.
        let mut near = true;
        for i in 0..n {
            let sh = &mut st.s[(h0 + i) * b..(h0 + i) * b + nv * 8];
            if tail < 8 {
                // SAFETY: the last vector lies in `sh`.
                unsafe {
                    let p = sh.as_mut_ptr().add(8 * (nv - 1));
                    _mm256_storeu_ps(p, _mm256_blendv_ps(neg, _mm256_loadu_ps(p), tail_mask));
                }
            }
            let m = st.m[h0 + i];
            near &= m.is_finite() && {
                let top = _mm256_set1_ps(m + LAZY_MAX_SLACK);
                let mut le = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
                for j in 0..nv {
                    // SAFETY: in bounds of sh.
                    let v = unsafe { _mm256_loadu_ps(sh.as_ptr().add(8 * j)) };
                    le = _mm256_and_ps(le, _mm256_cmp_ps::<_CMP_LE_OQ>(v, top));
                }
                _mm256_movemask_ps(le) == 0xff
            };
        }
        if near {
            // The weights against each maximum as it stands (each at most 2^LAZY_MAX_SLACK):
            // no block maximum, no rescale of the state.
            for i in 0..n {
                let h = h0 + i;
                st.l[h] += weights(&mut st.s[h * b..h * b + nv * 8], st.m[h]);
            }
            continue;
        }
        let mut m_old = [f32::NEG_INFINITY; 8];
        let mut m_new = [f32::NEG_INFINITY; 8];
        for i in 0..n {
            let sh = &st.s[(h0 + i) * b..(h0 + i) * b + nv * 8];
            let mut vmax = neg;
            let mut nan = _mm256_setzero_ps();
            for j in 0..nv {
                // SAFETY: in bounds of sh.
                let v = unsafe { _mm256_loadu_ps(sh.as_ptr().add(8 * j)) };
                vmax = _mm256_max_ps(vmax, v);
                nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            }
            m_old[i] = st.m[h0 + i];
            m_new[i] = if _mm256_movemask_ps(nan) != 0 {
                f32::NAN
            } else {
                crate::kernel::nan_max(m_old[i], hmax(vmax))
            };
        }
        // -inf - -inf is NaN: such heads (no finite score yet) are skipped below.
        let mut alpha = [0f32; 8];
        // SAFETY: eight lanes from and into arrays of eight floats.
        unsafe {
            let (o, n) = (
                _mm256_loadu_ps(m_old.as_ptr()),
                _mm256_loadu_ps(m_new.as_ptr()),
            );
            _mm256_storeu_ps(alpha.as_mut_ptr(), exp2_ps(_mm256_sub_ps(o, n)));
        }
        for i in 0..n {
            let h = h0 + i;
            let sh = &mut st.s[h * b..h * b + nv * 8];
            if m_new[i] == f32::NEG_INFINITY {
                sh.fill(0.0);
                continue;
            }
            st.l[h] = st.l[h] * alpha[i] + weights(sh, m_new[i]);
            st.m[h] = m_new[i];
            if alpha[i] != 1.0 {
                for x in &mut st.acc[h * d..(h + 1) * d] {
                    *x *= alpha[i];
                }
            }
        }
    }
}

/// Tokens of a full block, as [`softmax_near_full`] takes them.
const FULL: usize = 32;

/// [`softmax_block`]'s lazy case for a full block of 32 tokens whose every score lies within
/// [`LAZY_MAX_SLACK`] of its head's finite maximum: the weights against each maximum as it
/// stands, and their sums, in the same operations and order as `softmax_block` (so the same
/// bits). False, with nothing changed, where any head's do not (a NaN score, a first block,
/// a maximum that rises): `softmax_block` then takes the block.
///
/// Over constant trip counts with no per-head slicing or tail mask, the whole block ran
/// faster beside the AVX2 score and V loops (one thread, blocks in L2, Zen 4, 300 rounds
/// alternated in one process, p95 of the FMA peak): bf16 G=1 0.39-0.42 -> 0.41-0.51, G=4
/// 0.66/0.73 -> 0.69/0.77 (D=64/128), G=5 0.69/0.76 -> 0.73/0.80, G=8 0.68/0.78 ->
/// 0.71/0.82; f16 +4-6%.
///
/// `st.s` holds `g` rows of 32 scores, `st.m` and `st.l` `g` values.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn softmax_near_full(st: &mut State<'_>, g: usize) -> bool {
    let (s, m, l) = (&mut st.s[..g * FULL], &st.m[..g], &mut st.l[..g]);
    let mut near = true;
    for (row, &mh) in s.chunks_exact(FULL).zip(m) {
        let top = _mm256_set1_ps(mh + LAZY_MAX_SLACK);
        let mut le = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        for v in row.chunks_exact(8) {
            // SAFETY: eight floats of `v`.
            let x = unsafe { _mm256_loadu_ps(v.as_ptr()) };
            le = _mm256_and_ps(le, _mm256_cmp_ps::<_CMP_LE_OQ>(x, top));
        }
        near &= mh.is_finite() && _mm256_movemask_ps(le) == 0xff;
    }
    if !near {
        return false;
    }
    for ((row, &mh), lh) in s.chunks_exact_mut(FULL).zip(m).zip(l) {
        *lh += weights(row, mh);
    }
    true
}

/// `2^(s - m)` in place of each score of `sh` (whole vectors of 8, by [`exp2_weights`]);
/// returns their sum.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn weights(sh: &mut [f32], m: f32) -> f32 {
    let mb = _mm256_set1_ps(m);
    let mut vsum = _mm256_setzero_ps();
    for v in sh.chunks_exact_mut(8) {
        // SAFETY: eight floats of `v`.
        let p = exp2_weights(_mm256_sub_ps(unsafe { _mm256_loadu_ps(v.as_ptr()) }, mb));
        vsum = _mm256_add_ps(vsum, p);
        // SAFETY: as the load.
        unsafe { _mm256_storeu_ps(v.as_mut_ptr(), p) };
    }
    hsum(vsum)
}

/// Heads in the next register tile when `rest` heads are left: all of them up to six; eight
/// as six and two (12 accumulator chains for most of the FMAs: +5-20% over four and four on
/// Zen 3, `bench kernels` G=8; five and three measured 3-4% slower on Zen 4); seven as five
/// and two (10 chains, then 8 over four token vectors: +3-5% over four and three, whose
/// three-head tile takes two channel phases, and +2-9% over six and one; Zen 4, AVX2 path,
/// one thread, L2, three alternated runs); else four. A 7- or 8-head tile has room for one
/// vector per head only, so it spends a load per FMA, and measured ~30% slower than two
/// 4-head tiles.
///
/// Where the loops' code lands moves these figures too: after the seven-head change, which
/// touches no G=3 code, bf16 G=3 ran 5% slower (L2, one thread). A build with every loop on a
/// 64-byte boundary (`-C llvm-args=-align-loops=64`) ran it as before and kept the G=7 gain. So
/// an A/B of two builds within ~5% at one group size says little without such a build.
fn tile_heads(rest: usize) -> usize {
    match rest {
        0..=6 => rest,
        7 => 5,
        8 => 6,
        _ => 4,
    }
}

/// Channel steps a pass of a score tile of `heads` heads takes (`P` channels each, one
/// prefetch call a step) for element type `E`: the loop's own instructions (counter, bound,
/// branch, prefetch test) come once per four steps for two, four and five heads of f16 or
/// bf16 and for six of bf16 (whose rows load in even/odd pairs); two for a lone head, whose
/// steps are already two channels; else one. Int8 and fp8 keep one step (int8 G=5 measured
/// 2-3% slower in four, fp8 0-7% faster).
///
/// `bench kernels --paths avx2 --threads 1 --working-set-mib 1`, Zen 4, the two builds
/// alternated twice, ratio to the FMA roofline at D=64/128, with [`v_steps`]' passes against
/// one step and one token a pass: bf16 G=2 0.53/0.60 -> 0.56/0.63, G=4 0.65/0.72 ->
/// 0.69/0.75, G=5 0.69/0.75 -> 0.73/0.78, G=6 0.70/0.77 -> 0.75/0.81, G=8 0.72/0.77 ->
/// 0.74/0.79; f16 G=2 0.55/0.63 -> 0.59/0.67, G=4 0.69/0.75 -> 0.70/0.75, G=5 0.72/0.77 ->
/// 0.76/0.81; G=1, G=3 and six or eight f16 heads as before. Three heads in four steps
/// measured no faster (bf16) or 10-15% slower (f16 D=128); six f16 heads 25-40% slower,
/// which [`v_steps`] shares. A lone head (once, against one step): G=1 bf16 32-37 -> 43-47
/// GB/s, f16 26 -> 38-42.
///
/// Code placement moves these rows by ±5%. With every loop on a 64-byte boundary in both
/// builds (`-C llvm-args=-align-loops=64`, two alternations) the gains held for bf16 G=5
/// (0.66-0.68/0.72-0.75 -> 0.71-0.72/0.76) and G=6 (0.69-0.70/0.77 -> 0.75-0.76/0.77-0.78);
/// the other rows moved within ±4%, f16 G=8 D=64 down (0.73-0.76 -> 0.67-0.72; only its
/// two-head tile changed). Timed in one process on a busy shared host, the pieces switched
/// at run time, the same passes measured +20-60% at G=4 and G=5: fewer instructions count
/// for more where something else shares the core.
const fn score_steps<E: Elem>(heads: usize) -> usize {
    match heads {
        1 => 2,
        2 | 4 | 5 if E::SIZE == 2 => 4,
        6 if E::SPLIT => 4,
        _ => 1,
    }
}

/// Tokens a pass of a V tile of `heads` heads takes (one prefetch call a token, made at the
/// pass's start), so its loop's own instructions come once a pass: eight where four or five
/// heads of f16 or bf16 leave registers free for the unrolled rows, two for one head and
/// for six of bf16, else one (measured with [`score_steps`]). Eight tokens measured 10%
/// slower for two f16 heads and 5% for three bf16 heads (in one process); two tokens for
/// six f16 heads, 25-40% slower.
const fn v_steps<E: Elem>(heads: usize) -> usize {
    match heads {
        1 => 2,
        4 | 5 if E::SIZE == 2 => 8,
        6 if E::SPLIT => 2,
        _ => 1,
    }
}

/// Scores of the first `nv` token vectors of a block for every query head,
/// `s[h][t] = sum_c q[h][c] K[c][t]`, read straight from the stored keys (K is `[d][b]`). The
/// group is cut in register tiles of `H` heads x `T` token vectors (x `P` channel phases for a
/// lone head and for three heads), sized so each tile keeps 8..12 independent FMA chains in
/// registers and loads each key vector once for all its heads. Three heads in one phase kept
/// six chains, short of the eight that hide a four-cycle FMA latency on two units: two
/// phases measured +5-13% at G=3 (Xeon, AVX2 path, one thread, L2).
///
/// # Safety
/// As [`block`]; `nv * 8 <= b`; `s` holds at least `g * b` elements.
#[allow(clippy::too_many_arguments)] // the block's shape, spelled out
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores<E: Elem>(
    kt: &[u8],
    b: usize,
    d: usize,
    nv: usize,
    qs: &[f32],
    g: usize,
    s: &mut [f32],
    pf: &mut Prefetch<'_>,
) {
    let t = Tile::<E> {
        kt,
        b,
        d,
        qs,
        elem: PhantomData,
    };
    let mut h0 = 0;
    while h0 < g {
        let h = tile_heads(g - h0);
        // SAFETY (every arm): heads h0..h0+H exist, vectors j0..j0+T lie within nv.
        unsafe {
            match h {
                1 => t.run::<1, 4, 2>(h0, nv, s, pf),
                2 => t.run::<2, 4, 1>(h0, nv, s, pf),
                3 => t.run::<3, 2, 2>(h0, nv, s, pf),
                4 => t.run::<4, 2, 1>(h0, nv, s, pf),
                5 => t.run::<5, 2, 1>(h0, nv, s, pf),
                _ => t.run::<6, 2, 1>(h0, nv, s, pf),
            }
        }
        h0 += h;
    }
}

/// What a score tile reads.
struct Tile<'a, E> {
    kt: &'a [u8],
    b: usize,
    d: usize,
    qs: &'a [f32],
    elem: PhantomData<E>,
}

impl<E: Elem> Tile<'_, E> {
    /// Heads `h0..h0+H` over every token vector, `T` vectors at a time (then one at a time
    /// for the rest).
    ///
    /// # Safety
    /// As [`scores`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const H: usize, const T: usize, const P: usize>(
        &self,
        h0: usize,
        nv: usize,
        s: &mut [f32],
        pf: &mut Prefetch<'_>,
    ) {
        let mut j0 = 0;
        while j0 + T <= nv {
            // SAFETY: forwarded; vectors j0..j0+T < nv.
            unsafe { self.tile::<H, T, P>(h0, j0, s, pf) };
            j0 += T;
        }
        while j0 < nv {
            // SAFETY: as above, one vector. Small tiles split channels for more chains.
            unsafe {
                if H <= 4 {
                    self.tile::<H, 1, 2>(h0, j0, s, pf)
                } else {
                    self.tile::<H, 1, 1>(h0, j0, s, pf)
                }
            };
            j0 += 1;
        }
    }

    /// `s[h0+i][8(j0+j)..][..8]` for `i < H`, `j < T`; channels are split in `P` phases with
    /// their own accumulators (more chains for small tiles), summed at the end.
    ///
    /// # Safety
    /// As [`scores`]; `8 (j0 + T) <= b`; `d` is a multiple of `P`.
    // Indexed loops over constant bounds keep the accumulators in registers.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const H: usize, const T: usize, const P: usize>(
        &self,
        h0: usize,
        j0: usize,
        s: &mut [f32],
        pf: &mut Prefetch<'_>,
    ) {
        let (b, d, es) = (self.b, self.d, E::SIZE);
        let mut pfl = *pf; // in a register through the loop
        let mut acc = [[[_mm256_setzero_ps(); T]; H]; P];
        let q = self.qs.as_ptr();
        let k = self.kt.as_ptr();
        // `u` steps of P channels a pass ([`score_steps`]), one prefetch call a step still
        // (a lone head's two lines a call cover the whole next block).
        let u = score_steps::<E>(H);
        debug_assert!(d.is_multiple_of(u * P));
        let mut c = 0;
        while c + u * P <= d {
            for _ in 0..u {
                pfl.line();
            }
            for p in 0..u * P {
                // SAFETY: row c+p < d, vectors j0..j0+T <= b/8: inside the block's keys.
                let kv = unsafe {
                    load_row::<E, T>(k.add(((c + p) * b + 8 * j0) * es), T.is_multiple_of(2))
                };
                for i in 0..H {
                    // SAFETY: head h0+i < g, channel c+p < d: inside `qs`.
                    let qv = unsafe { _mm256_broadcast_ss(&*q.add((h0 + i) * d + c + p)) };
                    for j in 0..T {
                        acc[p % P][i][j] = _mm256_fmadd_ps(qv, kv[j], acc[p % P][i][j]);
                    }
                }
            }
            c += u * P;
        }
        *pf = pfl;
        for i in 0..H {
            let mut v = [_mm256_setzero_ps(); T];
            for j in 0..T {
                v[j] = acc[0][i][j];
                for p in 1..P {
                    v[j] = _mm256_add_ps(v[j], acc[p][i][j]);
                }
            }
            if E::SPLIT && T.is_multiple_of(2) {
                for j in 0..T / 2 {
                    (v[2 * j], v[2 * j + 1]) = interleave(v[2 * j], v[2 * j + 1]);
                }
            }
            for j in 0..T {
                // SAFETY: (h0+i) * b + 8 (j0+j) + 8 <= g * b.
                unsafe { _mm256_storeu_ps(s.as_mut_ptr().add((h0 + i) * b + 8 * (j0 + j)), v[j]) };
            }
        }
    }
}

/// [`accumulate_v`] `W` vectors at a time where they divide the head dim, else one.
///
/// The choice is made here, outside the loops: made inside `accumulate_v` (a call of itself
/// with `W = 1`), its loops ran 5-7% slower at G=4 bf16 (D=64 0.70 -> 0.74 of the FMA peak,
/// D=128 0.74 -> 0.80; one thread, blocks in L2, Zen 4, alternated in one process).
///
/// # Safety
/// As [`accumulate_v`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn v_tile<E: Elem, const N: usize, const W: usize>(
    vs: &[u8],
    len: usize,
    b: usize,
    d: usize,
    h0: usize,
    st: &mut State<'_>,
    pf: &mut Prefetch<'_>,
) {
    // SAFETY (both): forwarded; W = 1 divides any head dim that is a multiple of 8.
    unsafe {
        if d.is_multiple_of(8 * W) {
            accumulate_v::<E, N, W>(vs, len, b, d, h0, st, pf)
        } else {
            accumulate_v::<E, N, 1>(vs, len, b, d, h0, st, pf)
        }
    }
}

/// `acc[h0+i] += sum_t s[h0+i][t] * V[t]` for `N` heads, `W` vectors of the head dim at a
/// time (N*W independent accumulator chains, constant trip counts only, so every accumulator
/// stays in a register).
///
/// # Safety
/// As [`block`]; `8 W` divides `d` ([`v_tile`] picks `W`).
// Indexed loops over constant bounds keep the accumulator arrays in registers.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate_v<E: Elem, const N: usize, const W: usize>(
    vs: &[u8],
    len: usize,
    b: usize,
    d: usize,
    h0: usize,
    st: &mut State<'_>,
    pf: &mut Prefetch<'_>,
) {
    debug_assert!(d.is_multiple_of(8 * W));
    let mut pfl = *pf; // in a register through the loop
    let (acc_ptr, s) = (st.acc.as_mut_ptr(), st.s[h0 * b..(h0 + N) * b].as_ptr());
    for c0 in (0..d).step_by(8 * W) {
        // bf16 rows load as even and odd channels (one op per vector, not two): the
        // accumulators are held in that order and put back in place around the token loop.
        let split = E::SPLIT && W.is_multiple_of(2);
        let mut acc = [[_mm256_setzero_ps(); W]; N];
        for i in 0..N {
            for j in 0..W {
                // SAFETY: (h0+i)*d + c0 + 8j + 8 <= G*d.
                acc[i][j] = unsafe { _mm256_loadu_ps(acc_ptr.add((h0 + i) * d + c0 + 8 * j)) };
            }
            if split {
                for j in 0..W / 2 {
                    (acc[i][2 * j], acc[i][2 * j + 1]) =
                        deinterleave(acc[i][2 * j], acc[i][2 * j + 1]);
                }
            }
        }
        // `v_steps` tokens a pass, then one at a time; a prefetch call a token.
        let mut t = 0;
        match v_steps::<E>(N) {
            8 => {
                while t + 8 <= len {
                    for _ in 0..8 {
                        pfl.line();
                    }
                    // SAFETY: tokens t..t + 8 < len.
                    unsafe { v_rows::<E, N, W, 8>(vs, s, b, d, c0, t, split, &mut acc) };
                    t += 8;
                }
            }
            2 => {
                while t + 2 <= len {
                    pfl.line();
                    pfl.line();
                    // SAFETY: tokens t, t + 1 < len.
                    unsafe { v_rows::<E, N, W, 2>(vs, s, b, d, c0, t, split, &mut acc) };
                    t += 2;
                }
            }
            // Three bf16 heads hold six chains, short of the eight that hide the FMA latency
            // on two units: two tokens a pass, the second into a set of its own, added after
            // (`bench kernels --paths avx2`, one thread, L2, Zen 4, three alternations: bf16
            // G=3 0.59-0.60/0.64-0.65 -> 0.61-0.62/0.67-0.68 at D=64/128; f16's rows, two
            // loads each, ran 15% slower so, and keep one set).
            _ if E::SPLIT && N * W < 8 => {
                let mut odd = [[_mm256_setzero_ps(); W]; N];
                while t + 2 <= len {
                    pfl.line();
                    pfl.line();
                    // SAFETY: tokens t, t + 1 < len.
                    unsafe {
                        v_rows::<E, N, W, 1>(vs, s, b, d, c0, t, split, &mut acc);
                        v_rows::<E, N, W, 1>(vs, s, b, d, c0, t + 1, split, &mut odd);
                    }
                    t += 2;
                }
                for i in 0..N {
                    for j in 0..W {
                        acc[i][j] = _mm256_add_ps(acc[i][j], odd[i][j]);
                    }
                }
            }
            _ => {}
        }
        while t < len {
            pfl.line();
            // SAFETY: token t < len.
            unsafe { v_rows::<E, N, W, 1>(vs, s, b, d, c0, t, split, &mut acc) };
            t += 1;
        }
        for i in 0..N {
            if split {
                for j in 0..W / 2 {
                    (acc[i][2 * j], acc[i][2 * j + 1]) =
                        interleave(acc[i][2 * j], acc[i][2 * j + 1]);
                }
            }
            for j in 0..W {
                // SAFETY: as the load above.
                unsafe { _mm256_storeu_ps(acc_ptr.add((h0 + i) * d + c0 + 8 * j), acc[i][j]) };
            }
        }
    }
    *pf = pfl;
}

/// `W` vectors of 8 elements from `row`: where `pairs` (and `W` even) and `E` is a split
/// type, each 16 as their even elements, then the odd ones ([`Elem::load16`]).
///
/// # Safety
/// `8 W` readable elements at `row`; AVX2, FMA and F16C.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_row<E: Elem, const W: usize>(row: *const u8, pairs: bool) -> [__m256; W] {
    let (es, mut v) = (E::SIZE, [_mm256_setzero_ps(); W]);
    if E::SPLIT && pairs && W.is_multiple_of(2) {
        for j in 0..W / 2 {
            // SAFETY: 16 elements from element 16j < 8W.
            (v[2 * j], v[2 * j + 1]) = unsafe { E::load16(row.add(16 * j * es)) };
        }
    } else {
        for j in 0..W {
            // SAFETY: 8 elements from element 8j < 8W.
            v[j] = unsafe { E::load8(row.add(8 * j * es)) };
        }
    }
    v
}

/// Tokens `t..t + U` of [`accumulate_v`]'s slice at channel `c0`, into `acc`.
///
/// # Safety
/// As [`accumulate_v`]; `t + U <= len`; `s` points at head `h0`'s weights (`N` rows of `b`).
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn v_rows<E: Elem, const N: usize, const W: usize, const U: usize>(
    vs: &[u8],
    s: *const f32,
    b: usize,
    d: usize,
    c0: usize,
    t: usize,
    split: bool,
    acc: &mut [[__m256; W]; N],
) {
    let es = E::SIZE;
    for u in 0..U {
        // SAFETY: t + u < len <= b rows of d elements; c0 + 8W <= d.
        let v = unsafe { load_row::<E, W>(vs.as_ptr().add(((t + u) * d + c0) * es), split) };
        for i in 0..N {
            // SAFETY: i < N heads of b weights each, t + u < len <= b.
            let p = unsafe { _mm256_broadcast_ss(&*s.add(i * b + t + u)) };
            for j in 0..W {
                acc[i][j] = _mm256_fmadd_ps(p, v[j], acc[i][j]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One head-group's softmax state and scores, owned, so a test can run two softmaxes on
    /// copies and compare them.
    #[derive(Clone, PartialEq, Debug)]
    struct Owned {
        s: Vec<f32>,
        acc: Vec<f32>,
        m: Vec<f32>,
        l: Vec<f32>,
    }

    impl Owned {
        fn run<R>(&mut self, f: impl FnOnce(&mut State<'_>) -> R) -> R {
            let (mut pairs, mut bf16_weights) = (false, [0u16; 8 * 32]);
            let mut st = State {
                acc: &mut self.acc,
                m: &mut self.m,
                l: &mut self.l,
                s: &mut self.s,
                pairs: &mut pairs,
                bf16_weights: &mut bf16_weights,
                amx: None,
            };
            f(&mut st)
        }
    }

    /// The weights' `exp2` gives `exp2_ps`'s bits from -126 to 127 (a sweep of every 1/4096,
    /// both ends and the rounding ties), 0 at and below -127 and for -inf, at most `2^-126`
    /// between, and NaN for NaN.
    #[test]
    fn the_weights_exp2_is_exp2_ps_where_a_weight_is_normal() {
        if !available() {
            return;
        }
        let both = |xs: [f32; 8]| {
            // SAFETY: `available` checked AVX2 and FMA.
            unsafe {
                let v = _mm256_loadu_ps(xs.as_ptr());
                let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
                _mm256_storeu_ps(a.as_mut_ptr(), exp2_weights(v));
                _mm256_storeu_ps(b.as_mut_ptr(), exp2_ps(v));
                (a, b)
            }
        };
        let mut xs: Vec<f32> = (-126 * 4096..=127 * 4096)
            .map(|i| i as f32 / 4096.0)
            .collect();
        xs.extend((-126..=126).map(|n| n as f32 + 0.5));
        xs.extend([-126.0, f32::from_bits((-126f32).to_bits() - 1), 127.0]);
        for chunk in xs.chunks(8) {
            let mut v = [0f32; 8];
            v[..chunk.len()].copy_from_slice(chunk);
            let (a, b) = both(v);
            for i in 0..8 {
                assert_eq!(a[i].to_bits(), b[i].to_bits(), "2^{}", v[i]);
            }
        }
        let (a, _) = both([
            -127.0,
            -128.0,
            -1e30,
            f32::NEG_INFINITY,
            -126.25,
            -126.5,
            -126.75,
            f32::NAN,
        ]);
        assert_eq!(a[..4], [0.0; 4]);
        for w in &a[4..7] {
            assert!((0.0..f32::MIN_POSITIVE).contains(w), "{w}");
        }
        assert!(a[7].is_nan());
    }

    /// Where every head's scores lie within the slack of its finite maximum, the full-block
    /// softmax leaves exactly the bits `softmax_block` leaves; anywhere else it declines and
    /// changes nothing, so `softmax_block` takes the block as before.
    #[test]
    fn the_full_block_softmax_is_softmax_blocks_lazy_case_or_nothing() {
        if !available() {
            return;
        }
        let d = 8;
        for g in 1..=9 {
            let mut seed = g as u32 * 7919;
            let mut next = || {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (seed >> 8) as f32 / (1u32 << 24) as f32
            };
            let base = Owned {
                // Within [m - 20, m + 8): all near their maximum of 3.
                s: (0..g * FULL).map(|_| 3.0 - 20.0 + 28.0 * next()).collect(),
                acc: (0..g * d).map(|_| next()).collect(),
                m: vec![3.0; g],
                l: (0..g).map(|_| 1.0 + next()).collect(),
            };
            let (mut fast, mut slow) = (base.clone(), base.clone());
            // SAFETY (both): `available` checked AVX2 and FMA; g rows of 32 scores.
            assert!(fast.run(|st| unsafe { softmax_near_full(st, g) }), "g={g}");
            slow.run(|st| unsafe { softmax_block(st, g, FULL, d, FULL / 8, FULL) });
            assert_eq!(fast, slow, "g={g}");
            // Each way a head can fall outside the lazy case, in the last head.
            let h = g - 1;
            type Spoil = fn(&mut Owned, usize);
            let cases: [(&str, Spoil); 4] = [
                ("first block", |o, h| o.m[h] = f32::NEG_INFINITY),
                ("NaN score", |o, h| o.s[h * FULL + 5] = f32::NAN),
                ("maximum rises", |o, h| o.s[h * FULL + 31] = o.m[h] + 9.0),
                ("NaN maximum", |o, h| o.m[h] = f32::NAN),
            ];
            for (what, spoil) in cases {
                let mut o = base.clone();
                spoil(&mut o, h);
                let before = o.clone();
                // SAFETY: as above.
                let took = o.run(|st| unsafe { softmax_near_full(st, g) });
                assert!(!took, "g={g}: {what}");
                assert_eq!(format!("{o:?}"), format!("{before:?}"), "g={g}: {what}");
            }
        }
    }

    /// What [`block`] did with one block of `dtype` (zeros) for a group of `g` (query `qs`,
    /// `qb` its bf16 rounding where given), the next block as long: its requests (calls,
    /// bytes covered) and whether it left `acc` in the bf16 pairs' order.
    ///
    /// # Safety
    /// The CPU has AVX2 (and AVX-512 when `avx512`, BF16 too where `qb` is given); `d` a
    /// multiple of 8.
    unsafe fn requests_of(
        dtype: KvDType,
        d: usize,
        qs: &[f32],
        qb: Option<&[u16]>,
        len: usize,
        avx512: bool,
    ) -> (usize, usize, usize, bool) {
        let g = qs.len() / d;
        let geom = BlockGeometry {
            block_size: 32,
            num_kv_heads: 1,
            head_dim: d,
            dtype,
        };
        let bytes = vec![0u8; geom.head_bytes()];
        let next = vec![0u8; geom.head_bytes()];
        let (mut acc, mut m, mut l, mut sc) = (
            vec![0f32; g * d],
            vec![f32::NEG_INFINITY; g],
            vec![0f32; g],
            vec![0f32; g * 32],
        );
        let (mut pairs, mut bf16_weights) = (false, [0u16; 8 * 32]);
        let mut st = State {
            acc: &mut acc,
            m: &mut m,
            l: &mut l,
            s: &mut sc,
            pairs: &mut pairs,
            bf16_weights: &mut bf16_weights,
            amx: None,
        };
        let mut pf = Prefetch::new(&next);
        // SAFETY: the caller's promise; a whole head block; 32 and d multiples of 8.
        unsafe { block(&geom, qs, qb, &bytes, len, &mut st, &mut pf, avx512) };
        (pf.made, pf.off, next.len(), *st.pairs)
    }

    /// The AVX-512 group loops request every line of the next block, whatever its element
    /// type (one line a request holds f16 and bf16, f32 needs two), and so do the bf16
    /// products' loops (`kernel_bf16`) where the CPU has them.
    #[test]
    fn the_group_loops_request_every_line_of_the_next_block() {
        if !available() || !crate::kernel_avx512::available() {
            return;
        }
        let dtypes = [
            KvDType::F32,
            KvDType::F16,
            KvDType::Bf16,
            KvDType::I8,
            KvDType::F8E4M3,
        ];
        for dtype in dtypes {
            for d in [64, 96, 128] {
                for g in 2..=8 {
                    let products = dtype == KvDType::Bf16
                        && crate::kernel_bf16::available()
                        && crate::kernel_bf16::takes(g, 32, 32, d);
                    for bf16_products in [false, products] {
                        let mut qs = vec![0.5f32; g * d];
                        let mut qb = Vec::new();
                        if bf16_products {
                            crate::kernel_bf16::round_query(&mut qs, &mut qb);
                        }
                        let qb = bf16_products.then_some(&qb[..]);
                        // SAFETY: checked the CPU (AVX-512, and BF16 where `qb` is given).
                        let (made, off, len, pairs) =
                            unsafe { requests_of(dtype, d, &qs, qb, 32, true) };
                        let case = format!("{dtype:?} d={d} g={g} bf16 products {bf16_products}");
                        // The bf16 loops leave `acc` in their pairs' order: they took it.
                        assert_eq!(pairs, bf16_products, "{case}");
                        assert!(made > 0, "{case}: no request");
                        assert!(off >= len, "{case}: {off} of {len}");
                    }
                }
            }
        }
    }

    /// `line_calls` counts the calls the tiles make, for every group size, both head dims
    /// the tiles split differently, full and partial blocks, and each element type.
    #[test]
    fn line_calls_counts_the_calls_a_block_makes() {
        if !available() {
            return;
        }
        for dtype in [KvDType::F32, KvDType::F16, KvDType::Bf16, KvDType::I8] {
            for d in [64, 72, 128] {
                for g in 1..=9 {
                    for len in [1, 8, 9, 24, 32] {
                        let qs = vec![0.5f32; g * d];
                        // SAFETY: checked the CPU.
                        let (made, off, next, _) =
                            unsafe { requests_of(dtype, d, &qs, None, len, false) };
                        let calls = line_calls(g, d, len.div_ceil(8), len);
                        let case = format!("{dtype:?} d={d} g={g} len={len}");
                        assert_eq!(made, calls, "{case}");
                        // Every line, where two a call can carry them.
                        if next.div_ceil(64) <= 2 * calls {
                            assert!(off >= next, "{case}: {off} of {next}");
                        }
                    }
                }
            }
        }
    }
}
