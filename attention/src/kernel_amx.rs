//! AMX pieces of the CPU kernel: full 32-token bf16 blocks of GQA groups of 4 to 8 heads
//! (7 and 8 above D=64), and int8 and fp8 blocks of groups of 6 to 8, by tile products
//! (`TDPBF16PS`), where the CPU has AMX-BF16 (Intel Sapphire Rapids on: the Xeons beside
//! today's GPUs) and the kernel grants the process its tile state.
//!
//! Why: on those Xeons only ports 0 and 5 run 512-bit vector ops, and the bf16 widening takes
//! FMA slots, so the `avx512` loops of a group of 4 to 8 heads top out at 0.45-0.6 of the FMA
//! roofline with the blocks in L2, and G=8 streams at 0.65-0.8 of read bandwidth. One
//! `TDPBF16PS` does 16 x 16 x 32 products in about 16 cycles (1.6-1.7 T a second a core
//! against 0.11 T of f32 FMAs), so a block's products cost next to nothing, whatever the
//! group; what is left is staging the block's rows for the tiles, the softmax, and the reads.
//! On a 2-core Xeon VM (blocks in L2, one thread): G=8 15 -> 26 GB/s at D=64, 17 -> 31 at
//! D=128; from DRAM G=8 reaches 0.79-0.95 of read bandwidth where the FMAs reached 0.71-0.75.
//! Below the groups [`min_group`] names the FMAs keep up with the reads, and they win.
//!
//! The arithmetic is `kernel_bf16`'s, with the same rounding (the pre-scaled query once a
//! call, each block's weights once, to bf16 to nearest; products exact, sums f32) and the
//! same orders: a tile multiplies pairs of bf16 along the sum, so the B operand's rows are
//! pairs of key channels (scores) or of tokens (V), which `VPUNPCKLWD`/`VPUNPCKHWD` of two
//! rows give, for the tokens (or channels) 0-3, 8-11, 16-19, 24-27 and for the other half.
//! The scores stay in that token order through the softmax, the weights' pairs name the V
//! rows to pair, and the V sums land in `kernel_bf16`'s pair order, which `acc` keeps for
//! the call (`State::pairs`). So for a block:
//!
//! - scores: the K rows staged as B tiles (16 channel pairs x 16 tokens, two per 32
//!   channels) in L1, each multiplied by the query's 32 channels (an A tile of G rows read in
//!   place from the rounded query) into two C tiles (G x 16 tokens), stored into `s`;
//! - the `avx512` softmax, then the weights rounded (`kernel_bf16::round_weights`);
//! - V: the V rows staged as B tiles (16 token pairs x 16 channels), multiplied by the
//!   weights' A tile into C tiles loaded from and stored back to `acc` in place.
//!
//! Int8 codes and fp8 (e4m3) values are exact in bf16, so their blocks are staged as bf16
//! rows ([`Rows`]: widened to f32 by the `avx512` loops' loads, narrowed to bf16) and take
//! the same steps, each token's K scale on its scores before the softmax and its V scale on
//! its weight before the rounding, in the tiles' token order. The widening (six ops of ports 0
//! and 5 per 32 elements) is what the FMA loops pay per element too; what the tiles save is
//! the group's FMAs. Xeon VM, GB/s of codes and scales, D=64/128: with the blocks in L2,
//! one thread, int8 G=8 8.9/9.6 -> 11.8/13.5, G=5 13.3/14.5 alike, G=4 15.2/17.0 ->
//! 13.5/15.2. From DRAM (`bench kernels`, two builds alternated twice), one thread: int8 G=8
//! +9-26%, G=7 +16-19%, G=6 +10-17%, G=5 +3-7%; fp8 G=8 +13-19%, G=7 +4-15%, G=6 +2-8%, G=5
//! -1 to +6%. Two threads: int8 G=8 +10-21%, G=6 +1-15%, G=5 -4 to +4%; fp8 G=8 +11-19%,
//! G=5 -5 to +10%. So groups of 6 on ([`MIN8`]): at G=5 the FMA loops, which keep the
//! query in f32, are as fast. On SmolLM2 at 2k (`bench fidelity
//! --kv-dtypes f32,int8,fp8 --cpu-paths avx512,amx`, `DECODE_NODE_AMX=all` for its G=3) the
//! rounding moved the KL from full f32 from 0.00046 to 0.00052 (int8) and 0.0064 to 0.0071
//! (fp8), the 8-bit storage's own being the most of it.
//!
//! The tiles could read K's rows in place (tokens as the pairs) with the query's channels in
//! every other lane of A and zeros between; but 0 x inf is NaN, so a key of -inf would spoil
//! its neighbour's score where every other path drops just its own token. Hence the staging.
//! The products take no denormal inputs or outputs (AMX treats them as zero), as
//! `VDPBF16PS`. `DECODE_NODE_AMX=0` turns the path off; `all` gives it groups of 2 to 8.
//!
//! f16 blocks stay on the FMA loops, even at G=8 where those reached only 0.74-0.81 of read
//! bandwidth (0.78-0.84 once a group of 8 prefetched into L1: `kernel_avx512::request`).
//! Tried and measured slower: each f16 element staged as a bf16 pair that sums to it
//! exactly (its widened f32 cut after 8 bits, and the rest), with the query and the
//! weights in three bf16 parts each, so the tiles gave the FMA loops' results (to 1e-5
//! against the f64 reference). The staging alone takes 6 ops of ports 0 and 5 per 16
//! elements, against 10 for the FMAs at G=8, but the block then waits on more than twice
//! the tile products (each C tile's chain 24 deep at D=128, against 4). One thread, G=8
//! D=128, Xeon VM with AMX-BF16 (no AMX-FP16): blocks in L2 13.3 GB/s against the FMA
//! loops' 19.2, and 15.5 with one part only (timing only, wrong results); from DRAM 8.2
//! against 13.5. AMX-FP16 (`TDPFP16PS`, Granite Rapids on) would take f16 rows as they are.
//!
//! Int8 blocks stay on bf16 tiles, though AMX-INT8 (`TDPBSSD`) could take the codes as
//! stored. Tried and measured no faster from DRAM: K staged as 4 channels x 16 tokens a tile
//! row (one `VPERMT2B` per 64 bytes), V as 4 tokens x 16 channels (two permutes per 64
//! bytes), the query (once a call) and each block's weights times V's scales split into two
//! int8 parts each (`s * (hi + lo / 254)`, 2^-16 of the largest), C tiles stored and added
//! to `acc` in f32. Xeon VM, one thread, G=8 D=128, blocks in L2: 11.9 GB/s -> 14.7. A
//! block's pieces, each run alone (ns): staging K 59, score tiles 87, staging V 80, V tiles
//! 154 (two products per 16 channels, the weights' A tile half zeros, and their stores),
//! their sums into `acc` 69, the weights' split 62, the softmax 58, the call's own 48. From
//! DRAM, two builds alternated twice, G=8 D=64/128: 8.7-9.1 / 9.4-9.5 GB/s against
//! 9.0 / 9.2-9.7, G=6 10.0-10.5 / 10.2-10.5 against 9.3-9.7; two threads G=8 16.9-17.9 /
//! 18.2-18.3 against 17.6-19.2 / 17.8-19.3. Int8 blocks from DRAM stop at 0.5-0.6 of read
//! bandwidth on every path, even G=1 and 2 on the FMA loops at 0.67-0.8 (in L2 those run at
//! 21-22 GB/s): a block is 8 KiB, and its fixed costs do not overlap the next one's reads.
//! Also seen there: LLVM turned `_mm512_permutex2var_epi8` with a constant index into 26
//! 128-bit shuffles a row (staging K alone 160 -> 59 ns once the index was opaque to it).

use std::arch::asm;
use std::arch::x86_64::*;
use std::marker::PhantomData;

use crate::KvDType;
use crate::avx2::{AsBf16, AsF8, AsI8};
use crate::kernel::State;
use crate::kernel_avx2::Prefetch;
use crate::kernel_avx512::Elem512;

/// True when this CPU has AMX-BF16 beside what the `avx512` loops and `kernel_bf16`'s
/// rounding need, the OS gave this process the tile state, and `DECODE_NODE_AMX` does not
/// turn it off. Decided once a process.
pub(crate) fn available() -> bool {
    switch() != Switch::Off
}

/// What `DECODE_NODE_AMX` and the CPU allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Switch {
    /// Off (`0`, `off`, `false`, `no`), or the CPU or OS lacks it.
    Off,
    /// The groups [`min_group`] names.
    Default,
    /// Groups of 2 to 8 (`all`): for measuring what the rounding costs on a model with small
    /// groups, and the path where the FMAs are faster.
    All,
}

/// [`Switch`] as this process was started. Read once.
fn switch() -> Switch {
    static ON: std::sync::OnceLock<Switch> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let var = std::env::var("DECODE_NODE_AMX").unwrap_or_default();
        match parse_switch(&var) {
            Switch::Off => Switch::Off,
            _ if !(crate::kernel_avx512::available()
                && is_x86_feature_detected!("avx512bf16")
                && cpu_has_amx_bf16()
                && os_grants_tiles()) =>
            {
                Switch::Off
            }
            on => on,
        }
    })
}

fn parse_switch(var: &str) -> Switch {
    match var.trim() {
        "0" | "off" | "false" | "no" => Switch::Off,
        "all" => Switch::All,
        _ => Switch::Default,
    }
}

/// The smallest group the path takes by default for blocks of `dtype` at head dim `d`:
/// where its blocks ran at least as fast as the `avx512` loops' from DRAM. Int8 and fp8:
/// [`MIN8`]. Bf16 (a 2-core Xeon VM, one and two threads;
/// from L2 it wins from G=4 at either head dim): 4 heads at D=64 (G=2-3 alike, G=4 0.96
/// of read bandwidth against 0.82-0.86, G=8 0.91-0.92 against 0.73-0.75), 7 above. At D=128
/// the tile path streams at 0.79-0.88 whatever the group (why, not found), where the FMAs
/// reach 0.89-0.99 up to G=6; G=7 came out alike (0.79-0.81 against 0.81-0.84), G=8 ahead
/// (0.79-0.83 against 0.73-0.74).
fn min_group(dtype: KvDType, d: usize) -> usize {
    match switch() {
        Switch::All => 2,
        _ if dtype.scaled() => MIN8,
        _ if d <= 64 => 4,
        _ => 7,
    }
}

/// [`min_group`] for int8 and fp8 blocks (figures in the module doc): from DRAM the tiles
/// ran faster than the FMA loops from G=6, at both head dims and thread counts.
const MIN8: usize = 6;

/// CPUID leaf 7: AMX-TILE (EDX bit 24) and AMX-BF16 (bit 22).
fn cpu_has_amx_bf16() -> bool {
    // Leaf 7 is read only where the CPU has it.
    if __get_cpuid_max(0).0 < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    edx & (1 << 24) != 0 && edx & (1 << 22) != 0
}

/// Linux hands out the 8 KiB of tile data per process on request
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, 5.16 on); a tile instruction
/// before that raises SIGILL. XCR0 then has both tile bits.
#[cfg(target_os = "linux")]
fn os_grants_tiles() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain syscall with two integer arguments; it changes only this process's
    // permission to use the tile state.
    let granted = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    };
    // SAFETY: OSXSAVE is set wherever the OS enabled AVX, which `kernel_avx512::available`
    // checked before this runs.
    granted && unsafe { _xgetbv(0) } & (0b11 << 17) == 0b11 << 17
}

/// Other systems: not tried here (each has its own way to grant the tile state).
#[cfg(not(target_os = "linux"))]
fn os_grants_tiles() -> bool {
    false
}

/// Whether [`block`] takes full blocks of this shape: bf16, int8 or fp8, 32 tokens, a group
/// of [`min_group`] to 8 heads (the `avx512` softmax's largest), head dim a multiple of 32.
pub(crate) fn shape(dtype: KvDType, g: usize, b: usize, d: usize) -> bool {
    matches!(dtype, KvDType::Bf16 | KvDType::I8 | KvDType::F8E4M3)
        && b == 32
        && (min_group(dtype, d)..=8).contains(&g)
        && d.is_multiple_of(32)
}

/// Whether [`block`] takes this block: [`shape`], and full.
pub(crate) fn takes(dtype: KvDType, g: usize, b: usize, len: usize, d: usize) -> bool {
    shape(dtype, g, b, d) && len == b
}

/// Requests of the next block's lines made before each tile step (32 channels of scores or
/// of V): with one per staged row pair, one line a request covers the next block (`2d`
/// lines). The tile steps and the softmax read nothing from memory; requests made only
/// while staging came in bursts the core waited on (from DRAM, one thread: G=8 D=128
/// 9.8 GB/s against 12.7-14 with these).
const REQUESTS_PER_TILE_STEP: usize = 16;

/// One 64-byte tile row, so staged tiles start on a cache line.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Where [`block`] stages its B tiles: a block's K tiles (two of 16 rows for each 32
/// channels), all before the first product, so the stores have left for L1 before the tile
/// loads read them (a tile load waits for the stores it reads: staging 32 channels at a time
/// ran 8-10% slower with the blocks in L2); then its V tiles in the same place. One area for
/// both keeps L1 for the block's rows: two (16 KiB at D=128) ran 5-10% slower from DRAM.
#[derive(Debug, Default)]
pub(crate) struct Staging(Vec<Line>);

impl Staging {
    /// Room for the tiles of blocks of head dim `d`.
    fn fit(&mut self, d: usize) {
        let lines = 16 * (d / 16);
        if self.0.len() < lines {
            self.0.resize(lines, Line([0; 64]));
        }
    }

    /// The first byte of staged tile `i` (the area holds [`Staging::fit`]'s tiles).
    fn tile(&mut self, i: usize) -> *mut u8 {
        self.0[16 * i].0.as_mut_ptr()
    }
}

/// The tile configuration for a group of `g` heads: tiles 0 and 1 the C tiles (`g` rows of
/// 16 f32), 2 and 3 the B tiles (16 rows of 32 bf16), 4 the A tile (`g` rows of 32 bf16);
/// 5 and 6 shaped as B and 7 as A, which only [`tile_peak`]'s extra chains use.
#[repr(C, align(64))]
struct Config([u8; 64]);

impl Config {
    fn for_group(g: usize) -> Self {
        let mut c = [0u8; 64];
        c[0] = 1; // palette 1: eight tiles of up to 16 rows of 64 bytes
        for t in 0..8 {
            let rows = if matches!(t, 2 | 3 | 5 | 6) {
                16
            } else {
                g as u8
            };
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
            c[48 + t] = rows;
        }
        Self(c)
    }
}

/// This thread's tiles, configured for one call's group; released when dropped. Not `Send`:
/// the configuration belongs to the thread that loaded it.
pub(crate) struct Tiles {
    g: usize,
    _thread: PhantomData<*const ()>,
}

impl Tiles {
    /// Configures this thread's tiles for groups of `g` heads over blocks of `dtype` at head
    /// dim `d`, where [`available`] and [`shape`] allow (else `None`).
    pub(crate) fn configure(dtype: KvDType, g: usize, d: usize) -> Option<Self> {
        if !available() || !shape(dtype, g, 32, d) {
            return None;
        }
        let cfg = Config::for_group(g);
        // SAFETY: `available` checked AMX-TILE and the OS's grant; the configuration is a
        // valid palette-1 one (rows <= 16, 64 bytes a row).
        unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
        Some(Self {
            g,
            _thread: PhantomData,
        })
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: tiles were configured on this thread (`configure`); releasing them returns
        // the thread to the init state, so context switches stop saving 8 KiB of tiles.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// A block's elements as the tiles take them: 32 at a time as 32 bf16, exactly (bf16 as
/// stored; int8 codes, at most 8 significant bits; fp8 E4M3 values, 4 bits and an exponent
/// bf16 spans). Int8 and fp8 blocks then take their per-token scales as the FMA loops do:
/// K's on the scores, V's on the weights before they are rounded.
pub(crate) trait Rows {
    /// The blocks' type.
    const DTYPE: KvDType;
    /// Bytes an element.
    const SIZE: usize;

    /// 32 elements at `p` as bf16, in order.
    ///
    /// # Safety
    /// `32 * SIZE` readable bytes at `p`; AVX-512F/BW/BF16.
    unsafe fn bf16x32(p: *const u8) -> __m512i;
}

impl Rows for AsBf16 {
    const DTYPE: KvDType = KvDType::Bf16;
    const SIZE: usize = 2;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn bf16x32(p: *const u8) -> __m512i {
        // SAFETY: the caller's promise.
        unsafe { _mm512_loadu_si512(p.cast()) }
    }
}

/// Widened to f32 (exactly) by the `avx512` loops' loads, then narrowed to bf16 (exactly).
macro_rules! rows_via_f32 {
    ($t:ty, $dtype:expr) => {
        impl Rows for $t {
            const DTYPE: KvDType = $dtype;
            const SIZE: usize = 1;
            #[inline]
            #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
            unsafe fn bf16x32(p: *const u8) -> __m512i {
                // SAFETY: the caller's promise: 32 bytes.
                unsafe {
                    let lo = <$t as Elem512>::load16x(p);
                    let hi = <$t as Elem512>::load16x(p.add(16));
                    std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo))
                }
            }
        }
    };
}
rows_via_f32!(AsI8, KvDType::I8);
rows_via_f32!(AsF8, KvDType::F8E4M3);

/// Folds one full 32-token block (`kt` its keys, `vs` its values, elements of `E`; `scales`
/// its K and V scales where `E` is int8 or fp8) into `st` by tile products: the scores from
/// `qb` (the pre-scaled query rounded, `[G][d]`), the `avx512` softmax, V by the weights
/// rounded. False (nothing done) where `st` holds no tiles ([`State::amx`]) or [`shape`]
/// does not hold for their group.
///
/// # Safety
/// The CPU has what [`available`] checks; the block holds 32 tokens, all filled, so `st.s` is
/// `[G][32]`. The slices' lengths are checked here, once a block, so the loops index without
/// checks.
///
/// [`State::amx`]: crate::kernel::State::amx
#[allow(clippy::too_many_arguments)] // the block, its scales, the query and the state
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(crate) unsafe fn block<E: Rows>(
    kt: &[u8],
    vs: &[u8],
    scales: Option<(&[u8], &[u8])>,
    d: usize,
    qb: &[u16],
    st: &mut State<'_>,
    pf: &mut Prefetch<'_>,
) -> bool {
    let Some((tiles, staging)) = st.amx.as_mut() else {
        return false;
    };
    let g = tiles.g;
    let short = |(k, v): (&[u8], &[u8])| k.len() < 128 || v.len() < 128;
    if !shape(E::DTYPE, g, 32, d) || qb.len() != g * d || scales.is_some_and(short) {
        return false;
    }
    assert!(
        kt.len() >= 32 * d * E::SIZE
            && vs.len() >= 32 * d * E::SIZE
            && st.s.len() >= g * 32
            && st.acc.len() >= g * d
            && st.m.len() >= g
            && st.l.len() >= g
    );
    if !*st.pairs {
        crate::kernel_bf16::to_pair_order(st.acc);
        *st.pairs = true;
    }
    staging.fit(d);
    // One request per staged row pair (d) and REQUESTS_PER_TILE_STEP per tile step.
    pf.spread_over(d + 2 * REQUESTS_PER_TILE_STEP * (d / 32));
    // SAFETY: the CPU is the caller's promise, the tiles `Tiles`' (configured on this thread
    // for `g`); the lengths are checked above, the staging area fits `d`.
    unsafe {
        stage_k::<E>(kt, d, pf, staging);
        scores(qb, d, g, st.s, pf, staging);
        // Staged while the score tiles finish and their stores drain, which the softmax
        // waits for (G=8 D=128 from DRAM, one thread: 14.4-14.5 -> 15.2-15.3 GB/s).
        stage_v::<E>(vs, d, pf, staging);
        if let Some((k, _)) = scales {
            scale_pairs(g, st.s, k);
        }
        crate::kernel_avx512::softmax_dyn(g, st.s, 32, st.m, st.l, st.acc, d);
        if let Some((_, v)) = scales {
            scale_pairs(g, st.s, v);
        }
        crate::kernel_bf16::round_weights_dyn(g, st.s, st.bf16_weights);
        accumulate_v(d, st.bf16_weights, st.acc, pf, staging);
    }
    true
}

/// `s[h][i] *= scale[t]` for every head, `t` the token of lane `i` in the tiles' order
/// (tokens 0-3, 8-11, 16-19, 24-27, then the others); `scale` is 32 little-endian f32.
///
/// # Safety
/// AVX-512F; `s` holds `g * 32`, `scale` 128 bytes.
#[target_feature(enable = "avx512f")]
unsafe fn scale_pairs(g: usize, s: &mut [f32], scale: &[u8]) {
    assert!(s.len() >= g * 32 && scale.len() >= 128);
    let first = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    let second = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    // SAFETY: 128 bytes of `scale` and 32 floats a head of `s` (checked above).
    unsafe {
        let a = _mm512_loadu_ps(scale.as_ptr().cast());
        let b = _mm512_loadu_ps(scale.as_ptr().add(64).cast());
        let (x, y) = (
            _mm512_permutex2var_ps(a, first, b),
            _mm512_permutex2var_ps(a, second, b),
        );
        for h in 0..g {
            let p = s.as_mut_ptr().add(32 * h);
            _mm512_storeu_ps(p, _mm512_mul_ps(_mm512_loadu_ps(p), x));
            _mm512_storeu_ps(p.add(16), _mm512_mul_ps(_mm512_loadu_ps(p.add(16)), y));
        }
    }
}

/// Rows `r` and `r + 1` (32 elements each, at `p` and `p + stride`) interleaved as bf16
/// pairs into row `j` of staged tiles `lo` (elements 0-3, 8-11, 16-19, 24-27) and `hi` (the
/// rest), row `r` in each pair's low half.
///
/// # Safety
/// Both rows readable; `lo` and `hi` each hold 16 rows of 64 bytes; `j < 16`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn stage_pair<E: Rows>(p: *const u8, stride: usize, lo: *mut u8, hi: *mut u8, j: usize) {
    // SAFETY: the caller's promise.
    unsafe {
        let r0 = E::bf16x32(p);
        let r1 = E::bf16x32(p.add(stride));
        _mm512_store_si512(lo.add(64 * j).cast(), _mm512_unpacklo_epi16(r0, r1));
        _mm512_store_si512(hi.add(64 * j).cast(), _mm512_unpackhi_epi16(r0, r1));
    }
}

/// Stages a full 32-token block's K tiles: for each 32 key channels `c0`, tiles `c0 / 16`
/// and `c0 / 16 + 1` (16 channel pairs x the tokens 0-3, 8-11, 16-19, 24-27, then the
/// others). One request of the next block's lines per row pair.
///
/// # Safety
/// AVX-512F/BW/BF16; `kt` holds `d` rows of 32 elements of `E`, `d` a multiple of 32;
/// `staging` fits `d`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn stage_k<E: Rows>(kt: &[u8], d: usize, pf: &mut Prefetch<'_>, staging: &mut Staging) {
    let (k, row) = (kt.as_ptr(), 32 * E::SIZE);
    let mut next = *pf;
    for c0 in (0..d).step_by(32) {
        let (lo, hi) = (staging.tile(c0 / 16), staging.tile(c0 / 16 + 1));
        for j in 0..16 {
            next.line();
            // SAFETY: rows c0 + 2j, c0 + 2j + 1 < d of `row` bytes lie inside `kt`.
            unsafe { stage_pair::<E>(k.add((c0 + 2 * j) * row), row, lo, hi, j) };
        }
    }
    *pf = next;
}

/// Stages a full 32-token block's V tiles where [`stage_k`] put the K tiles (the score tiles
/// loaded before these stores, which x86 keeps in order): for each 32
/// value channels `c0`, tiles `c0 / 16` and the next (16 token pairs,
/// `kernel_bf16::first_token`'s, x those channels' two halves). Row pair by row pair, each
/// read whole (from DRAM, one thread, D=128: 3-5% faster than 32 channels at a time). One
/// request of the next block's lines per row pair and 32 channels.
///
/// # Safety
/// AVX-512F/BW/BF16; `vs` holds 32 rows of `d` elements of `E`, `d` a multiple of 32;
/// `staging` fits `d`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn stage_v<E: Rows>(vs: &[u8], d: usize, pf: &mut Prefetch<'_>, staging: &mut Staging) {
    let v = vs.as_ptr();
    let row = E::SIZE * d; // bytes of a V row
    let mut next = *pf;
    for j in 0..16 {
        let t = crate::kernel_bf16::first_token(j);
        for c0 in (0..d).step_by(32) {
            next.line();
            let (lo, hi) = (staging.tile(c0 / 16), staging.tile(c0 / 16 + 1));
            // SAFETY: tokens t, t + 1 < 32 rows of `row` bytes; c0 + 32 <= d.
            unsafe { stage_pair::<E>(v.add(t * row + E::SIZE * c0), row, lo, hi, j) };
        }
    }
    *pf = next;
}

/// Scores of a full 32-token block into `s` (`[G][32]`, each head's tokens in the pairs'
/// order: 0-3, 8-11, 16-19, 24-27, then 4-7, ...), from the staged K tiles.
///
/// # Safety
/// AMX configured for `g` ([`Tiles`]); [`stage_k`] staged the block for head dim `d`, a
/// multiple of 32; `qb` is `[g][d]`; `s` holds `g * 32`.
unsafe fn scores(
    qb: &[u16],
    d: usize,
    g: usize,
    s: &mut [f32],
    pf: &mut Prefetch<'_>,
    staging: &mut Staging,
) {
    debug_assert!(s.len() >= g * 32 && qb.len() >= g * d);
    let mut next = *pf;
    let q = qb.as_ptr().cast::<u8>();
    // SAFETY (whole body): tiles 0 and 1 are the C tiles of the configuration.
    unsafe { asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem)) };
    for c0 in (0..d).step_by(32) {
        for _ in 0..REQUESTS_PER_TILE_STEP {
            next.line();
        }
        let (lo, hi) = (staging.tile(c0 / 16), staging.tile(c0 / 16 + 1));
        // SAFETY: the staged tiles are 16 rows of 64 bytes; the A tile is g rows of 64
        // bytes, row h at the query's channel c0 of head h (`qb` is `[g][d]`, 2d bytes a
        // row); tiles 2-4 as `Config` shapes them. (Alternating two sets of registers from
        // step to step measured the same: G=4 and 8, D=64 and 128, blocks in L2.)
        unsafe {
            asm!(
                "tileloadd tmm2, [{lo} + {s64}*1]",
                "tileloadd tmm3, [{hi} + {s64}*1]",
                "tileloadd tmm4, [{q} + {qs}*1]",
                "tdpbf16ps tmm0, tmm4, tmm2",
                "tdpbf16ps tmm1, tmm4, tmm3",
                lo = in(reg) lo, hi = in(reg) hi, s64 = in(reg) 64usize,
                q = in(reg) q.add(2 * c0), qs = in(reg) 2 * d,
                options(nostack, readonly),
            );
        }
    }
    // SAFETY: head h's 32 scores at s[h * 32..]: the first tile's 16 then the second's, g
    // rows of 128 bytes.
    unsafe {
        let out = s.as_mut_ptr().cast::<u8>();
        asm!(
            "tilestored [{a} + {rs}*1], tmm0",
            "tilestored [{b} + {rs}*1], tmm1",
            a = in(reg) out, b = in(reg) out.add(64), rs = in(reg) 128usize,
            options(nostack),
        );
    }
    *pf = next;
}

/// `acc[h] += sum_t w[h][t] V[t]` over a full 32-token block, 32 channels at a time, from the
/// staged V tiles, `acc` in the pairs' channel order (`kernel_bf16::to_pair_order`).
///
/// # Safety
/// AMX configured for `g` ([`Tiles`]); [`stage_v`] staged the block for head dim `d`, a
/// multiple of 32; `w` as `kernel_bf16::round_weights_dyn` left it for `g` heads; `acc` is
/// `[g][d]`.
unsafe fn accumulate_v(
    d: usize,
    w: &[u16; 8 * 32],
    acc: &mut [f32],
    pf: &mut Prefetch<'_>,
    staging: &mut Staging,
) {
    let mut next = *pf;
    let a = acc.as_mut_ptr().cast::<u8>();
    // SAFETY: the weights' A tile: g rows of 32 bf16, 64 bytes apart.
    unsafe {
        asm!("tileloadd tmm4, [{w} + {s64}*1]", w = in(reg) w.as_ptr(), s64 = in(reg) 64usize,
             options(nostack, readonly));
    }
    for c0 in (0..d).step_by(32) {
        for _ in 0..REQUESTS_PER_TILE_STEP {
            next.line();
        }
        let (lo, hi) = (staging.tile(c0 / 16), staging.tile(c0 / 16 + 1));
        // SAFETY: the C tiles are g rows of 16 f32 at acc[h * d + c0] and acc[h * d + c0 +
        // 16] (4d bytes a row), inside `acc`; the staged tiles 16 rows of 64 bytes.
        unsafe {
            asm!(
                "tileloadd tmm0, [{a} + {rs}*1]",
                "tileloadd tmm1, [{b} + {rs}*1]",
                "tileloadd tmm2, [{lo} + {s64}*1]",
                "tileloadd tmm3, [{hi} + {s64}*1]",
                "tdpbf16ps tmm0, tmm4, tmm2",
                "tdpbf16ps tmm1, tmm4, tmm3",
                "tilestored [{a} + {rs}*1], tmm0",
                "tilestored [{b} + {rs}*1], tmm1",
                a = in(reg) a.add(4 * c0), b = in(reg) a.add(4 * c0 + 64), rs = in(reg) 4 * d,
                lo = in(reg) lo, hi = in(reg) hi, s64 = in(reg) 64usize,
                options(nostack),
            );
        }
    }
    *pf = next;
}

/// Products a second one thread's `TDPBF16PS` issue over `seconds` (16 x 16 x 32 an
/// instruction, on tiles in registers): the multiply-add bound of [`block`]'s products; 0
/// where the path cannot run.
pub(crate) fn tile_peak(seconds: f64) -> f64 {
    let Some(_tiles) = Tiles::configure(KvDType::Bf16, 8, 64) else {
        return 0.0;
    };
    // The peak wants full 16-row tiles: a configuration of its own, released with `_tiles`.
    let cfg = Config::for_group(16);
    // SAFETY: `configure` checked the CPU and the OS's grant; a valid palette-1 configuration.
    unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
    let end = std::time::Instant::now() + std::time::Duration::from_secs_f64(seconds.max(0.01));
    let mut best = 0f64;
    while std::time::Instant::now() < end || best == 0.0 {
        let reps: usize = 1 << 14;
        let t = std::time::Instant::now();
        // SAFETY: tiles configured above; products of whatever the tiles hold (zeros).
        unsafe {
            asm!(
                "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3",
                "tilezero tmm4", "tilezero tmm7",
                "2:",
                "tdpbf16ps tmm0, tmm4, tmm2",
                "tdpbf16ps tmm1, tmm4, tmm3",
                "tdpbf16ps tmm5, tmm7, tmm2",
                "tdpbf16ps tmm6, tmm7, tmm3",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) reps => _,
                options(nostack, nomem),
            );
        }
        best = best.max((reps * 4 * 16 * 16 * 32) as f64 / t.elapsed().as_secs_f64());
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `DECODE_NODE_AMX`: off by an off word, every group by `all`, anything else the
    /// default groups.
    #[test]
    fn the_switch_reads_off_all_and_default() {
        for off in ["0", "off", " false ", "no"] {
            assert_eq!(parse_switch(off), Switch::Off, "{off}");
        }
        assert_eq!(parse_switch(" all "), Switch::All);
        for on in ["", "1", "on", "yes"] {
            assert_eq!(parse_switch(on), Switch::Default, "{on}");
        }
    }

    /// Each tile's rows and row bytes as `block` uses them: C and A tiles one row a head,
    /// B tiles 16 rows, every row 64 bytes; palette 1.
    #[test]
    fn the_configuration_shapes_each_tile() {
        let c = Config::for_group(5);
        assert_eq!(c.0[0], 1);
        for t in 0..8 {
            assert_eq!(u16::from_le_bytes([c.0[16 + 2 * t], c.0[17 + 2 * t]]), 64);
            let rows = if [2, 3, 5, 6].contains(&t) { 16 } else { 5 };
            assert_eq!(c.0[48 + t], rows, "tile {t}");
        }
    }
}
