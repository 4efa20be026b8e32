//! AVX-512 BF16 pieces of the CPU kernel: full 32-token blocks of bf16 KV for GQA groups of
//! 5 to 8 heads, where the CPU has `VDPBF16PS` (AMD Zen 4 on, Intel Cooper Lake and Sapphire
//! Rapids on: the CPUs beside today's GPUs).
//!
//! `VDPBF16PS` multiplies pairs of bf16 values and adds both products to an f32 lane: 32
//! products an instruction against an f32 FMA's 16, at the same rate (a 2-core Zen 4: 3.55
//! against 3.61 G instructions a second). A group of four or more heads is bound by its FMAs
//! on one core (G=8: 4 per KV byte), so this path halves the bound that held G=8 at 0.75-0.81
//! of the FMA roofline. The price is the rounding tensor cores take too: the (pre-scaled)
//! query is rounded to bf16 once a call, and each block's softmax weights once, before the
//! products; sums, the softmax and the running state stay f32. Keys and values are bf16
//! already, so nothing else changes.
//!
//! The pairs a lane sums are two key channels (scores) or two tokens (V). `VPUNPCKLWD` and
//! `VPUNPCKHWD` of two rows give those pairs, for the tokens (or channels) 0-3, 8-11, 16-19
//! and 24-27 and for the other half; the scores stay in that order through the softmax (which
//! does not care) and the weights' pairs name the V rows to read, so only the V
//! accumulators are put in order, once per 32-channel slice and block.
//!
//! Groups of 5 to 8 heads take it, where a core's f32 FMAs bound the kernel below its read
//! bandwidth (bf16, 2.5 to 4 FMAs a byte). Smaller groups are bound by memory: there this
//! path ran 1.4x faster with the blocks in L2 but 10-25% slower streaming from DRAM (one
//! thread of a 2-core Zen 4, `bench kernels` 256 MiB, G=2-3). The scores' pair products are
//! what lose there (why, not found without hardware counters): a throwaway build with the f32
//! score loop and these V products matched the f32 kernel from DRAM at G=2-3 and ran 10%
//! faster at G=4 (slower than this path at G=5-8).
//!
//! All of that rests on `VDPBF16PS` issuing at an FMA's rate, and not every CPU with it does:
//! a 2-core Intel Xeon VM (Sapphire Rapids class, AMX and AVX-512 FP16 on) issued it at about
//! half its FMA rate (31-33 G products a second against 64-68 G FMAs), and there this path
//! ran slower than the `avx512` one at every shape it takes (bf16, one thread, blocks in L2:
//! G=5 7.0-7.2 GB/s against 10.5-14.8, G=8 4.5-4.8 against 6.7-8.8; from DRAM, G=8 D=128
//! 0.39-0.51 of read bandwidth against 0.69-0.76). So [`KernelPath::best`] takes it only
//! where [`preferred`] measured the products at least [`PAIRS_OVER_FMAS`] times the FMAs, once
//! a process. `DECODE_NODE_BF16_DOT=0` turns the path off (the `avx512` path runs those
//! blocks), `on` takes it without measuring, `all` also gives it groups of 2 to 8: for
//! measuring what the rounding costs.
//!
//! [`KernelPath::best`]: crate::KernelPath::best

use std::arch::x86_64::*;

use crate::kernel::State;
use crate::kernel_avx2::Prefetch;
use crate::kernel_avx512::Sets;

/// True when this CPU has AVX-512 BF16 beside what `kernel_avx512` needs, and neither
/// `DECODE_NODE_BF16_DOT=0` nor `DECODE_NODE_AVX512=0` turns it off: the path can run (a
/// bench may ask for it); [`preferred`] says whether the node takes it.
pub(crate) fn available() -> bool {
    switch().is_some()
}

/// What `DECODE_NODE_BF16_DOT` and the CPU allow: `None` where the path is off or the CPU
/// lacks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Switch {
    /// The smallest group the path takes: [`MIN_GROUP`], or 2 with `all`.
    min_group: usize,
    /// Taken without measuring (`on` or `all`).
    forced: bool,
}

/// [`Switch`] as this process was started. Read once.
fn switch() -> Option<Switch> {
    static ON: std::sync::OnceLock<Option<Switch>> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let var = std::env::var("DECODE_NODE_BF16_DOT").unwrap_or_default();
        let cpu = crate::kernel_avx512::available() && is_x86_feature_detected!("avx512bf16");
        parse_switch(&var, cpu)
    })
}

fn parse_switch(var: &str, cpu: bool) -> Option<Switch> {
    let (min_group, forced) = match var.trim() {
        _ if !cpu => return None,
        "0" | "off" | "false" | "no" => return None,
        "all" => (2, true),
        "1" | "on" | "true" | "yes" => (MIN_GROUP, true),
        _ => (MIN_GROUP, false),
    };
    Some(Switch { min_group, forced })
}

/// The smallest group the path takes by default (see the module doc).
const MIN_GROUP: usize = 5;

/// How many bf16 products a second, per f32 FMA a second, make the path worth taking: each
/// `VDPBF16PS` does two products a lane where an FMA does one, so a CPU that issues both at
/// one rate measures 2 (a 2-core Zen 4: 1.97) and one that issues the products at half the
/// rate measures 1 (the Intel VM of the module doc: 0.48). The path's rounding and shuffles
/// cost something, so it must win clearly.
const PAIRS_OVER_FMAS: f64 = 1.5;

/// Whether products at `products_per_s` beat FMAs at `fmas_per_s` by [`PAIRS_OVER_FMAS`].
fn pairs_pay(products_per_s: f64, fmas_per_s: f64) -> bool {
    fmas_per_s > 0.0 && products_per_s >= PAIRS_OVER_FMAS * fmas_per_s
}

/// Whether [`KernelPath::best`](crate::KernelPath::best) takes this path where it runs:
/// [`available`], and forced or measured worth it ([`pairs_pay`]: one thread's products and
/// AVX-512 FMAs a second, three short passes of each in turn, about 30 ms once a process).
pub(crate) fn preferred() -> bool {
    static PREFERRED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PREFERRED.get_or_init(|| match switch() {
        None => false,
        Some(Switch { forced: true, .. }) => true,
        Some(_) => {
            let (mut products, mut fmas) = (0f64, 0f64);
            for _ in 0..3 {
                products = products.max(crate::peak::bf16_dot_peak(0.005));
                fmas = fmas.max(crate::peak::fma_peak_on(crate::KernelPath::Avx512, 0.005));
            }
            pairs_pay(products, fmas)
        }
    })
}

/// Rounds `qs` to bf16 (to nearest, ties to even) in place, and puts the bf16 bits in `out`
/// for the products: a call the path takes rounds its query for every block, its partly
/// filled last one (which the f32 loops attend) too, so all its scores come from one query.
pub(crate) fn round_query(qs: &mut [f32], out: &mut Vec<u16>) {
    // Sized first and zipped (no push), so the loop compiles to vector code.
    out.clear();
    out.resize(qs.len(), 0);
    for (x, o) in qs.iter_mut().zip(out.iter_mut()) {
        let r = half::bf16::from_f32(*x);
        *x = r.to_f32();
        *o = r.to_bits();
    }
}

/// Whether [`block`] takes full blocks of this shape: blocks of 32 tokens, a group of 5 to 8
/// heads (2 to 8 with `DECODE_NODE_BF16_DOT=all`), head dim a multiple of 32.
pub(crate) fn shape(g: usize, b: usize, d: usize) -> bool {
    let min = switch().map_or(MIN_GROUP, |s| s.min_group);
    b == 32 && (min..=8).contains(&g) && d.is_multiple_of(32)
}

/// Whether [`block`] takes this block: [`shape`], and full.
pub(crate) fn takes(g: usize, b: usize, len: usize, d: usize) -> bool {
    shape(g, b, d) && len == b
}

/// Folds one full 32-token bf16 block (`kt` its keys, `vs` its values) into `st`: scores by
/// bf16 products with `qb` (the pre-scaled query rounded, `[G][d]`), the AVX-512 softmax, V
/// by bf16 products with the weights rounded. False (nothing done) where [`shape`] does not
/// hold for blocks of 32.
///
/// # Safety
/// The CPU has what [`available`] checks (the environment switch aside); the block holds 32
/// tokens, all filled, so `st.s` is `[G][32]`. The slices' lengths are checked here, once a
/// block, so the loops index without checks.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(crate) unsafe fn block(
    kt: &[u8],
    vs: &[u8],
    d: usize,
    qb: &[u16],
    st: &mut State<'_>,
    pf: &mut Prefetch<'_>,
) -> bool {
    let g = qb.len() / d.max(1);
    if !shape(g, 32, d) {
        return false;
    }
    assert!(
        kt.len() >= 32 * d * 2
            && vs.len() >= 32 * d * 2
            && qb.len() == g * d
            && st.s.len() >= g * 32
            && st.acc.len() >= g * d
            && st.m.len() >= g
            && st.l.len() >= g
    );
    // The V products leave each 32-channel slice in their own order: `acc` stays so until
    // a block of another path or the call's end needs it in channel order.
    if !*st.pairs {
        to_pair_order(st.acc);
        *st.pairs = true;
    }
    let w = &mut *st.bf16_weights;
    // SAFETY: the CPU is the caller's promise; the lengths are checked above; `g` is 2..=8
    // and `d` a multiple of 32, which every piece takes.
    unsafe {
        crate::kernel_avx512::with_group!(g, G => {
            scores::<G>(kt, qb, d, st.s, pf);
            crate::kernel_avx512::softmax_dyn(g, st.s, 32, st.m, st.l, st.acc, d);
            round_weights::<G>(st.s, w);
            accumulate_v::<G>(vs, d, w, st.acc, pf);
        })
    }
}

/// The next block's lines requested before head `g`'s products in a pass of four rows (or
/// tokens), four lines a pass, one at a time ([`Prefetch::one`]): before the second,
/// middle and last quarters of the group's heads, the fourth after them (by the caller).
#[inline(always)]
fn requests<const G: usize>(g: usize, next: &mut Prefetch<'_>) {
    for at in [G / 4, G / 2, 3 * G / 4] {
        if g == at.max(1) {
            next.one();
        }
    }
}

/// Head `g`'s pass: the pairs `x` times the pair at `pa` (broadcast) into the first set of
/// `sets`, `y` times the pair at `pb` into the second (`kernel_avx512`'s sets and their rule:
/// two a head leave fewer than the chains that hide the products' latency on both pipes).
///
/// # Safety
/// Four readable bytes at `pa` and at `pb`.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn fold<const G: usize>(
    sets: &mut Sets<G>,
    g: usize,
    (x, pa): ((__m512bh, __m512bh), *const u16),
    (y, pb): ((__m512bh, __m512bh), *const u16),
) {
    let e = &mut sets.even[g];
    // SAFETY: the caller's promise.
    unsafe {
        e[0] = dot_at(e[0], x.0, pa);
        e[1] = dot_at(e[1], x.1, pa);
        let o = sets.second(g);
        o[0] = dot_at(o[0], y.0, pb);
        o[1] = dot_at(o[1], y.1, pb);
    }
}

/// `acc` plus the pair products of `x` and the pair at `p` in every lane, the broadcast
/// folded into `VDPBF16PS` (`{1to16}`), for the reason `kernel_avx512`'s FMAs fold theirs
/// (blocks in L2, one thread: G=5 +5-15%, G=8 +5-25%).
///
/// # Safety
/// Four readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_at(acc: __m512, x: __m512bh, p: *const u16) -> __m512 {
    let mut acc = acc;
    // SAFETY: 512 bits either way.
    let x = unsafe { std::mem::transmute::<__m512bh, __m512i>(x) };
    // SAFETY: the caller's promise; the instruction reads four bytes at `p` and writes `acc`.
    unsafe {
        std::arch::asm!(
            "vdpbf16ps {a}, {x}, dword ptr [{p}]{{1to16}}",
            a = inout(zmm_reg) acc,
            x = in(zmm_reg) x,
            p = in(reg) p,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    acc
}

/// Rows `r` and `r + 1` (64 bytes each, at `p` and `p + stride`) as the bf16 pairs of their
/// elements 0-3, 8-11, 16-19, 24-27 (first) and 4-7, 12-15, 20-23, 28-31 (second), row `r` in
/// each pair's low half.
///
/// # Safety
/// Both rows readable; AVX-512BW.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pairs(p: *const u8, stride: usize) -> (__m512bh, __m512bh) {
    // SAFETY: the caller guarantees both rows.
    let (r0, r1) = unsafe {
        (
            _mm512_loadu_si512(p.cast()),
            _mm512_loadu_si512(p.add(stride).cast()),
        )
    };
    // SAFETY: both are 512 bits of bf16 pairs.
    unsafe {
        (
            std::mem::transmute::<__m512i, __m512bh>(_mm512_unpacklo_epi16(r0, r1)),
            std::mem::transmute::<__m512i, __m512bh>(_mm512_unpackhi_epi16(r0, r1)),
        )
    }
}

/// Scores of a full 32-token block, `s[g][..32] = sum_c q[g][c] K[c][t]`, with each head's
/// tokens in the order of [`pairs`] (0-3, 8-11, 16-19, 24-27, then 4-7, ...).
///
/// # Safety
/// AVX-512F/BW/BF16; `kt` holds `d` rows of 32 bf16, `d` a multiple of 4; `qb` is `[G][d]`;
/// `s` holds `G * 32`.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn scores<const G: usize>(
    kt: &[u8],
    qb: &[u16],
    d: usize,
    s: &mut [f32],
    pf: &mut Prefetch<'_>,
) {
    let mut sets = Sets::<G>::from([[_mm512_setzero_ps(); 2]; G]);
    // A local copy of the cursor stays in a register (see `Prefetch`).
    let mut next = *pf;
    let (k, q) = (kt.as_ptr(), qb.as_ptr());
    // Four rows a pass: two pairs, the second into the second set where there is one.
    for c in (0..d).step_by(4) {
        // SAFETY: rows c..c + 4 <= d of 64 bytes lie inside `kt` (the contract).
        let (x, y) = unsafe { (pairs(k.add(c * 64), 64), pairs(k.add((c + 2) * 64), 64)) };
        for g in 0..G {
            requests::<G>(g, &mut next);
            // SAFETY: g < G, c + 4 <= d: inside `qb` (the contract).
            unsafe {
                let a = q.add(g * d + c);
                fold(&mut sets, g, (x, a), (y, a.add(2)));
            }
        }
        next.one();
    }
    *pf = next;
    for (g, [lo, hi]) in sets.sums().into_iter().enumerate() {
        // SAFETY: s holds G*32 elements.
        unsafe {
            _mm512_storeu_ps(s.as_mut_ptr().add(g * 32), lo);
            _mm512_storeu_ps(s.as_mut_ptr().add(g * 32 + 16), hi);
        }
    }
}

/// Each head's 32 weights (in [`scores`]' order) rounded to bf16 into `w[g * 32..]`, two to
/// a 32-bit pair ([`pair_of`]).
///
/// # Safety
/// AVX-512F/BF16; `s` holds `G * 32`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn round_weights<const G: usize>(s: &[f32], w: &mut [u16; 8 * 32]) {
    for g in 0..G {
        // SAFETY: s holds G*32 elements, w 8*32.
        unsafe {
            let lo = _mm512_loadu_ps(s.as_ptr().add(g * 32));
            let hi = _mm512_loadu_ps(s.as_ptr().add(g * 32 + 16));
            // Words 0..16 from the second operand, 16..32 from the first.
            let r = _mm512_cvtne2ps_pbh(hi, lo);
            _mm512_storeu_si512(
                w.as_mut_ptr().add(g * 32).cast(),
                std::mem::transmute::<__m512bh, __m512i>(r),
            );
        }
    }
}

/// [`round_weights`] for a run-time group of 2 to 8 heads (`kernel_amx`'s blocks); nothing
/// outside that.
///
/// # Safety
/// AVX-512F/BW/BF16; `s` holds `g * 32`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(crate) unsafe fn round_weights_dyn(g: usize, s: &[f32], w: &mut [u16; 8 * 32]) {
    assert!(s.len() >= g * 32);
    // SAFETY: the CPU is the caller's promise; `s` holds G * 32 (checked above).
    unsafe { crate::kernel_avx512::with_group!(g, G => round_weights::<G>(s, w)) };
}

/// The first of the two tokens in the weights' 32-bit pair `j` (0..16): pairs 0..8 are lanes
/// 0..16 of [`scores`]' first vector (tokens 0-3, 8-11, ...), pairs 8..16 its second (4 on).
pub(crate) const fn first_token(j: usize) -> usize {
    8 * ((j % 8) / 2) + 2 * (j % 2) + 4 * (j / 8)
}

/// The weights' 32-bit pair that holds (even) token `t` and the one after: pairs 0..8 are
/// lanes 0..16 of [`scores`]' first vector (tokens 0-3, 8-11, ...), pairs 8..16 its second
/// (tokens 4-7, 12-15, ...).
const fn pair_of(t: usize) -> usize {
    let (eight, within) = (t / 8, t % 8);
    if within < 4 {
        2 * eight + within / 2
    } else {
        8 + 2 * eight + (within - 4) / 2
    }
}

/// Channel `c` of a 32-channel slice in the order of [`pairs`]: lane `c` of the first vector
/// for `c` < 16, of the second for `c` >= 16.
const PAIR_ORDER: [i32; 32] = {
    let mut o = [0i32; 32];
    let mut i = 0;
    while i < 32 {
        let (half, lane) = (i / 16, i % 16);
        o[i] = (8 * (lane / 4) + lane % 4 + 4 * half) as i32;
        i += 1;
    }
    o
};

/// The inverse of [`PAIR_ORDER`]: where channel `c` lies in the two vectors (16 on: the
/// second).
const NATURAL_ORDER: [i32; 32] = {
    let mut o = [0i32; 32];
    let mut i = 0;
    while i < 32 {
        o[PAIR_ORDER[i] as usize] = i as i32;
        i += 1;
    }
    o
};

/// Puts each 32-channel slice of `acc` (`[G][d]`, `d` a multiple of 32) in the order the V
/// products leave it: lane `i` holds channel [`PAIR_ORDER`]`[i]`. Once a call, not once a
/// block: permuting every slice in and out of each block was a tenth of a G=8 block's time
/// (perf, blocks in L2).
pub(crate) fn to_pair_order(acc: &mut [f32]) {
    permute_slices(acc, &PAIR_ORDER);
}

/// The inverse of [`to_pair_order`].
pub(crate) fn to_channel_order(acc: &mut [f32]) {
    permute_slices(acc, &NATURAL_ORDER);
}

/// `slice[i] = old[order[i]]` for every 32-float slice of `acc`.
fn permute_slices(acc: &mut [f32], order: &[i32; 32]) {
    debug_assert!(acc.len().is_multiple_of(32));
    for slice in acc.chunks_exact_mut(32) {
        let mut old = [0f32; 32];
        old.copy_from_slice(slice);
        for (x, &from) in slice.iter_mut().zip(order) {
            *x = old[from as usize];
        }
    }
}

/// `acc[g] += sum_t w[g][t] V[t]` over a full 32-token block, 32 channels at a time, by bf16
/// products of token pairs, `acc` in the pairs' channel order ([`to_pair_order`]).
///
/// # Safety
/// AVX-512F/BW/BF16; `vs` holds 32 rows of `d` bf16, `d` a multiple of 32; `w` as
/// [`round_weights`] left it for `G` heads; `acc` is `[G][d]`.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn accumulate_v<const G: usize>(
    vs: &[u8],
    d: usize,
    w: &[u16; 8 * 32],
    acc: &mut [f32],
    pf: &mut Prefetch<'_>,
) {
    let (a, v, wp) = (acc.as_mut_ptr(), vs.as_ptr(), w.as_ptr());
    let row = 2 * d; // bytes of a V row
    let mut next = *pf;
    for c0 in (0..d).step_by(32) {
        let mut start = [[_mm512_setzero_ps(); 2]; G];
        for g in 0..G {
            // SAFETY: g*d + c0 + 32 <= G*d.
            start[g] = unsafe {
                [
                    _mm512_loadu_ps(a.add(g * d + c0)),
                    _mm512_loadu_ps(a.add(g * d + c0 + 16)),
                ]
            };
        }
        let mut sets = Sets::<G>::from(start);
        // Two token pairs a pass, the second into the second set where there is one.
        for ta in (0..32).step_by(4) {
            let tb = ta + 2;
            let (ja, jb) = (pair_of(ta), pair_of(tb));
            // SAFETY: tokens ta..ta + 4 < 32 rows of `row` bytes; c0 + 32 <= d.
            let (x, y) = unsafe {
                (
                    pairs(v.add(ta * row + 2 * c0), row),
                    pairs(v.add(tb * row + 2 * c0), row),
                )
            };
            for g in 0..G {
                requests::<G>(g, &mut next);
                // SAFETY: g < G, pairs ja, jb < 16 of head g inside `w`.
                unsafe {
                    fold(
                        &mut sets,
                        g,
                        (x, wp.add(g * 32 + 2 * ja)),
                        (y, wp.add(g * 32 + 2 * jb)),
                    )
                };
            }
            next.one();
        }
        for (g, [lo, hi]) in sets.sums().into_iter().enumerate() {
            // SAFETY: as the loads above.
            unsafe {
                _mm512_storeu_ps(a.add(g * d + c0), lo);
                _mm512_storeu_ps(a.add(g * d + c0 + 16), hi);
            }
        }
    }
    *pf = next;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rates measured on the two CPUs of the module doc decide as measured there: Zen 4's
    /// products (two per FMA) take the path, the Intel VM's (half an FMA's) do not; nothing
    /// measured is never worth it.
    #[test]
    fn pair_products_are_taken_only_where_they_outrun_fmas() {
        assert!(pairs_pay(3.55e9 * 32.0, 3.61e9 * 16.0));
        assert!(!pairs_pay(31e9, 66e9));
        assert!(!pairs_pay(64e9, 64e9));
        assert!(!pairs_pay(1e9, 0.0));
    }

    /// `DECODE_NODE_BF16_DOT`: off by `0` (or any switch's off) or a CPU without the
    /// instructions; `on` and `all` skip the measurement; anything else measures.
    #[test]
    fn the_switch_reads_off_on_all_and_default() {
        let sw = |min_group, forced| Some(Switch { min_group, forced });
        assert_eq!(parse_switch("", true), sw(MIN_GROUP, false));
        assert_eq!(parse_switch("0", true), None);
        assert_eq!(parse_switch("off", true), None);
        assert_eq!(parse_switch("on", true), sw(MIN_GROUP, true));
        assert_eq!(parse_switch(" all ", true), sw(2, true));
        assert_eq!(parse_switch("all", false), None);
        assert_eq!(parse_switch("", false), None);
    }

    /// The pairs' order, the weights' token pairs and the accumulators' channel order say the
    /// same thing: each of 0..32 once, pairs of adjacent tokens.
    #[test]
    fn orders_cover_every_token_and_channel_once() {
        let mut seen = [false; 32];
        for c in PAIR_ORDER {
            assert!(!seen[c as usize]);
            seen[c as usize] = true;
        }
        for j in 0..16 {
            assert_eq!(pair_of(first_token(j)), j);
        }
        let mut tokens = [false; 32];
        for j in 0..16 {
            let t = first_token(j);
            // Pair j is lanes 2j, 2j + 1 of the scores' order.
            assert_eq!(t, PAIR_ORDER[2 * j] as usize);
            assert_eq!(t + 1, PAIR_ORDER[2 * j + 1] as usize);
            assert!(!tokens[t] && !tokens[t + 1]);
            tokens[t] = true;
            tokens[t + 1] = true;
        }
    }
}
