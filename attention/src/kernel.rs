//! CPU decode attention over a list of blocks for one KV head and its GQA group.
//!
//! Loop order follows llama.cpp's lesson: each K and V element is read once for all `G`
//! query heads of the group. K is stored transposed in a block, so the score loop streams
//! one channel's row of keys and updates `G x block_size` scores with contiguous FMAs that
//! the compiler vectorises. The softmax is online (flash-decoding style), rescaled once per
//! block, accumulated in f32, in base 2 (see [`crate::merge`]).
//!
//! Element conversion uses `half`'s slice converters, which pick F16C/AVX2 at run time.

use crate::block::{BlockGeometry, HeadBlock};
use crate::dtype::decode_to_f32;
use crate::merge::Partial;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Reusable buffers of [`attend_blocks`]; one per worker thread avoids allocation per call.
#[derive(Debug, Default)]
pub struct Scratch {
    qs: Vec<f32>,
    row: Vec<f32>,
    s: Vec<f32>,
    acc: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    /// The pre-scaled query rounded to bf16 (the `avx512bf16` path's bf16 blocks, the `amx`
    /// path's bf16, int8 and fp8 blocks).
    qb: Vec<u16>,
    /// Where the `amx` path stages its tiles.
    #[cfg(target_arch = "x86_64")]
    staging: crate::kernel_amx::Staging,
}

/// Running softmax state of a group over the blocks seen so far, as the SIMD paths fold
/// blocks into it.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) struct State<'a> {
    /// `[G][D]` unnormalised output.
    pub(crate) acc: &'a mut [f32],
    /// `[G]` running max (base 2), the point the weights are taken against; the AVX2 and
    /// AVX-512 paths may leave it up to `LAZY_MAX_SLACK` below the true maximum, which every
    /// path accepts (`l` and `acc` are kept against whatever `m` holds).
    pub(crate) m: &'a mut [f32],
    /// `[G]` running denominator.
    pub(crate) l: &'a mut [f32],
    /// `[G][B]` scores, then weights.
    pub(crate) s: &'a mut [f32],
    /// Whether `acc` holds each 32-channel slice in the order the bf16 pair products leave
    /// it (`kernel_bf16`), which keeps it so from block to block of a call; every other
    /// piece reads it in channel order ([`State::in_channel_order`]).
    #[cfg(target_arch = "x86_64")]
    pub(crate) pairs: &'a mut bool,
    /// The bf16 pair products' weights, rounded (`kernel_bf16`): the call's one buffer, so no
    /// block clears its own (a fresh one zeroed each block cost 1.5-3% at G=5 and G=8, one
    /// thread, blocks in L2, Zen 4).
    #[cfg(target_arch = "x86_64")]
    pub(crate) bf16_weights: &'a mut [u16; 8 * 32],
    /// This thread's tiles, configured for the call's group, and their staging area, where
    /// the call takes the `amx` path (`kernel_amx`).
    #[cfg(target_arch = "x86_64")]
    pub(crate) amx: Option<(
        &'a crate::kernel_amx::Tiles,
        &'a mut crate::kernel_amx::Staging,
    )>,
}

#[cfg(target_arch = "x86_64")]
impl State<'_> {
    /// Puts `acc` back in channel order if the pair products left it in theirs.
    pub(crate) fn in_channel_order(&mut self) {
        if *self.pairs {
            crate::kernel_bf16::to_channel_order(self.acc);
            *self.pairs = false;
        }
    }
}

/// The implementation that runs a call's blocks, picked per call from the CPU's features
/// (detection is cached by the standard library) and the block shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelPath {
    /// Portable Rust for any CPU and shape, written for the compiler to vectorise (NEON on
    /// arm64, SSE2 on any x86-64); the SIMD paths are tested against it.
    Scalar,
    /// AVX2 + FMA + F16C (x86-64).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// [`KernelPath::Avx2`] with AVX-512 (F, BW) for full 32-token blocks of groups of 2 to
    /// 8 heads, where the CPU has it.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// [`KernelPath::Avx512`] with AVX-512 BF16 dot products for full 32-token bf16 blocks of
    /// groups of 5 to 8 heads (2 to 8 with `DECODE_NODE_BF16_DOT=all`): the query and each
    /// block's weights rounded to bf16 before the products, as tensor cores take them
    /// (`kernel_bf16`).
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16,
    /// [`KernelPath::Avx512`] with AMX tile products (`TDPBF16PS`) for full 32-token bf16
    /// blocks of groups of 4 to 8 heads (7 and 8 above head dim 64; 2 to 8 with
    /// `DECODE_NODE_AMX=all`), the query and each block's weights rounded to bf16 as for
    /// [`KernelPath::Avx512Bf16`] (`kernel_amx`).
    #[cfg(target_arch = "x86_64")]
    Amx,
    /// NEON (arm64).
    #[cfg(target_arch = "aarch64")]
    Neon,
}

impl KernelPath {
    /// Every path this build has, the portable one first.
    pub const ALL: &'static [Self] = &[
        Self::Scalar,
        #[cfg(target_arch = "x86_64")]
        Self::Avx2,
        #[cfg(target_arch = "x86_64")]
        Self::Avx512,
        #[cfg(target_arch = "x86_64")]
        Self::Avx512Bf16,
        #[cfg(target_arch = "x86_64")]
        Self::Amx,
        #[cfg(target_arch = "aarch64")]
        Self::Neon,
    ];

    /// Its name in benches and logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => "avx512",
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Bf16 => "avx512bf16",
            #[cfg(target_arch = "x86_64")]
            Self::Amx => "amx",
            #[cfg(target_arch = "aarch64")]
            Self::Neon => "neon",
        }
    }

    /// True when this CPU can run the path on blocks of `geom` (SIMD needs block size and
    /// head dim in multiples of 8); a path that cannot runs as [`KernelPath::Scalar`].
    pub fn runs(self, geom: &BlockGeometry) -> bool {
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        let _ = geom;
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        let simd_shape = geom.block_size.is_multiple_of(8) && geom.head_dim.is_multiple_of(8);
        match self {
            Self::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => simd_shape && crate::kernel_avx2::available(),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => {
                simd_shape && crate::kernel_avx2::available() && crate::kernel_avx512::available()
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Bf16 => Self::Avx512.runs(geom) && crate::kernel_bf16::available(),
            #[cfg(target_arch = "x86_64")]
            Self::Amx => Self::Avx512.runs(geom) && crate::kernel_amx::available(),
            #[cfg(target_arch = "aarch64")]
            Self::Neon => simd_shape && crate::kernel_neon::available(),
        }
    }

    /// The fastest path this CPU has for blocks of `geom` that multiplies in f32 throughout
    /// (not [`KernelPath::Avx512Bf16`] or [`KernelPath::Amx`]): the reference other
    /// implementations of the same attention (a GPU's kernels) are held to at f32 precision.
    pub fn best_f32(geom: &BlockGeometry) -> Self {
        Self::ALL
            .iter()
            .rev()
            .copied()
            .filter(|p| {
                #[cfg(target_arch = "x86_64")]
                return !matches!(p, Self::Avx512Bf16 | Self::Amx);
                #[cfg(not(target_arch = "x86_64"))]
                return {
                    let _ = p;
                    true
                };
            })
            .find(|p| p.runs(geom))
            .unwrap_or(Self::Scalar)
    }

    /// Whether this path, for a group of `g` query heads over blocks of `geom`, multiplies
    /// bf16 pairs (the query and the weights rounded to bf16) rather than f32 FMAs:
    /// [`KernelPath::Avx512Bf16`] (`VDPBF16PS`) on bf16 blocks and [`KernelPath::Amx`]
    /// (tiles) on bf16, int8 and fp8 blocks, of the shapes they take. Its multiply-add rate is then
    /// [`crate::bf16_dot_peak`]'s or [`crate::amx_peak`]'s, not [`crate::fma_peak_on`]'s.
    pub fn multiplies_bf16(self, geom: &BlockGeometry, g: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        return self.runs(geom)
            && match self {
                Self::Avx512Bf16 => {
                    geom.dtype == crate::KvDType::Bf16
                        && crate::kernel_bf16::shape(g, geom.block_size, geom.head_dim)
                }
                Self::Amx => {
                    crate::kernel_amx::shape(geom.dtype, g, geom.block_size, geom.head_dim)
                }
                _ => false,
            };
        #[cfg(not(target_arch = "x86_64"))]
        return {
            let _ = (geom, g);
            false
        };
    }

    /// The fastest path this CPU has for blocks of `geom`: the widest it runs (AVX-512 on
    /// Zen 4's half-width units too: see `kernel_avx512`), AMX tiles where the CPU and OS
    /// have them, but the bf16 pair products only where they outrun the FMAs here
    /// (`kernel_bf16::preferred`: measured once a process).
    pub fn best(geom: &BlockGeometry) -> Self {
        Self::ALL
            .iter()
            .rev()
            .copied()
            .filter(|p| {
                #[cfg(target_arch = "x86_64")]
                return *p != Self::Avx512Bf16 || crate::kernel_bf16::preferred();
                #[cfg(not(target_arch = "x86_64"))]
                return {
                    let _ = p;
                    true
                };
            })
            .find(|p| p.runs(geom))
            .unwrap_or(Self::Scalar)
    }
}

/// The path [`attend_blocks`] takes in this process, where a bench set one: an index into
/// [`KernelPath::ALL`] plus one, 0 for [`KernelPath::best`].
static FORCED_PATH: AtomicUsize = AtomicUsize::new(0);

/// Makes every later [`attend_blocks`] call in this process take `path` (one this CPU cannot
/// run falls back as [`attend_blocks_on`] says) instead of [`KernelPath::best`]; `None`
/// restores the choice. For benches that compare paths on a whole model (`bench fidelity
/// --cpu-paths`): a server never calls it.
pub fn force_kernel_path(path: Option<KernelPath>) {
    let i = path.and_then(|p| KernelPath::ALL.iter().position(|x| *x == p));
    FORCED_PATH.store(i.map_or(0, |i| i + 1), Ordering::Relaxed);
}

/// Attends `q` (`[G][head_dim]`, unscaled) over `blocks` of one KV head, on the fastest path
/// this CPU has ([`KernelPath::best`]).
///
/// `scale` is the softmax scale (usually `1/sqrt(head_dim)`). Returns per-head normalised
/// output and `lse2`; with no blocks the partial is empty.
pub fn attend_blocks<'a>(
    geom: &BlockGeometry,
    q: &[f32],
    scale: f32,
    blocks: impl IntoIterator<Item = HeadBlock<'a>>,
    scratch: &mut Scratch,
) -> Partial {
    let path = match FORCED_PATH.load(Ordering::Relaxed) {
        0 => KernelPath::best(geom),
        i => KernelPath::ALL[i - 1],
    };
    attend_blocks_on(path, geom, q, scale, blocks, scratch)
}

/// [`attend_blocks`] on a given path (a path this CPU or shape cannot run falls back to
/// [`KernelPath::Scalar`]).
pub fn attend_blocks_on<'a>(
    path: KernelPath,
    geom: &BlockGeometry,
    q: &[f32],
    scale: f32,
    blocks: impl IntoIterator<Item = HeadBlock<'a>>,
    scratch: &mut Scratch,
) -> Partial {
    let (b, d) = (geom.block_size, geom.head_dim);
    let g = q.len() / d;
    let es = geom.dtype.size();
    let Scratch {
        qs,
        row,
        s,
        acc,
        m,
        l,
        qb,
        #[cfg(target_arch = "x86_64")]
        staging,
    } = scratch;
    // Pre-scaling by log2(e) turns exp into exp2 for the whole crate.
    qs.clear();
    qs.extend(q.iter().map(|x| x * scale * std::f32::consts::LOG2_E));
    row.resize(b.max(d), 0.0);
    s.clear();
    s.resize(g * b, 0.0);
    acc.clear();
    acc.resize(g * d, 0.0);
    m.clear();
    m.resize(g, f32::NEG_INFINITY);
    l.clear();
    l.resize(g, 0.0);

    #[cfg(target_arch = "x86_64")]
    let simd = path != KernelPath::Scalar && path.runs(geom);
    #[cfg(target_arch = "x86_64")]
    let wide = matches!(
        path,
        KernelPath::Avx512 | KernelPath::Avx512Bf16 | KernelPath::Amx
    ) && simd;
    // The bf16 dot products' query, rounded once a call.
    #[cfg(target_arch = "x86_64")]
    let qb = if path.multiplies_bf16(geom, g) {
        crate::kernel_bf16::round_query(qs, qb);
        Some(&qb[..])
    } else {
        None
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = qb;
    // The tiles, configured for the call's group on this thread and released at its end.
    #[cfg(target_arch = "x86_64")]
    let tiles = match path {
        KernelPath::Amx if qb.is_some() => crate::kernel_amx::Tiles::configure(geom.dtype, g, d),
        _ => None,
    };
    #[cfg(target_arch = "aarch64")]
    let simd = path == KernelPath::Neon && path.runs(geom);
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = path;
    // Whether `acc` is in the bf16 pair products' order (`State::pairs`).
    #[cfg(target_arch = "x86_64")]
    let mut pairs = false;
    #[cfg(target_arch = "x86_64")]
    let mut bf16_weights = [0u16; 8 * 32];
    let mut blocks = blocks.into_iter().peekable();
    // The SIMD paths peek at the next block to prefetch it.
    #[cfg_attr(not(target_arch = "x86_64"), allow(clippy::while_let_on_iterator))]
    while let Some(blk) = blocks.next() {
        let len = blk.len.min(b);
        if len == 0 {
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if simd && blk.bytes.len() >= geom.head_bytes() {
            // The next block's bytes are requested while this one computes, spread over its
            // loops (`Prefetch`): blocks lie anywhere in the pool, so the hardware prefetcher
            // stops at each block's end.
            let next = match blocks.peek() {
                Some(n) => &n.bytes[..geom.head_bytes().min(n.bytes.len())],
                None => &[],
            };
            let mut pf = crate::kernel_avx2::Prefetch::new(next);
            let mut st = State {
                acc,
                m,
                l,
                s,
                pairs: &mut pairs,
                bf16_weights: &mut bf16_weights,
                amx: tiles.as_ref().map(|t| (t, &mut *staging)),
            };
            // SAFETY: `best` checked the CPU and that block size and head dim are multiples of
            // 8; the block holds a whole head block.
            unsafe {
                crate::kernel_avx2::block(geom, qs, qb, blk.bytes, len, &mut st, &mut pf, wide)
            };
            continue;
        }
        #[cfg(target_arch = "aarch64")]
        if simd && blk.bytes.len() >= geom.head_bytes() {
            let mut st = State { acc, m, l, s };
            // SAFETY: `runs` checked the CPU and that block size and head dim are multiples
            // of 8; the block holds a whole head block; `len <= b`.
            unsafe { crate::kernel_neon::block(geom, qs, blk.bytes, len, &mut st) };
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if std::mem::take(&mut pairs) {
            crate::kernel_bf16::to_channel_order(acc);
        }
        let (kt, vs) = blk.bytes.split_at(b * d * es);
        // Int8 and fp8: each token's K and V scale (1 for the float dtypes).
        let scaled = geom.dtype.scaled();
        let (k_scales, v_scales) = geom.scales(&blk.bytes[..geom.head_bytes()]);
        let scale = |row: &[u8], t: usize| {
            if scaled {
                crate::block::scale_at(row, t)
            } else {
                1.0
            }
        };
        s[..g * b].fill(0.0);
        for c in 0..d {
            let krow = &mut row[..len];
            decode_to_f32(geom.dtype, &kt[c * b * es..(c * b + len) * es], krow);
            for h in 0..g {
                let qc = qs[h * d + c];
                let sh = &mut s[h * b..h * b + len];
                for (sv, kv) in sh.iter_mut().zip(krow.iter()) {
                    *sv += qc * kv;
                }
            }
        }
        if scaled {
            scale_tokens(s, g, b, len, k_scales);
        }
        softmax_block(s, acc, m, l, g, b, d, len);
        for t in 0..len {
            let vrow = &mut row[..d];
            decode_to_f32(geom.dtype, &vs[t * d * es..(t + 1) * d * es], vrow);
            let vscale = scale(v_scales, t);
            for h in 0..g {
                let p = s[h * b + t] * vscale;
                let ah = &mut acc[h * d..(h + 1) * d];
                for (a, v) in ah.iter_mut().zip(vrow.iter()) {
                    *a += p * v;
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    if pairs {
        crate::kernel_bf16::to_channel_order(acc);
    }
    let mut out = Partial::empty(g, d);
    for h in 0..g {
        // A NaN denominator is passed on (as NaN output), never read as "no blocks".
        if l[h] > 0.0 || l[h].is_nan() {
            let inv = 1.0 / l[h];
            for (o, a) in out.out[h * d..(h + 1) * d]
                .iter_mut()
                .zip(&acc[h * d..(h + 1) * d])
            {
                *o = a * inv;
            }
            out.lse2[h] = m[h] + l[h].log2();
        }
    }
    out
}

/// `s[h][t] *= scale[t]` for every head and the first `len` tokens (`scale`: little-endian
/// f32 per token): a scaled dtype's K scales on the scores, then its V scales on the weights
/// (every path's share of [`crate::KvDType::scaled`]).
pub(crate) fn scale_tokens(s: &mut [f32], g: usize, b: usize, len: usize, scale: &[u8]) {
    debug_assert!(scale.len() >= 4 * len);
    for h in 0..g {
        // Whole 4-byte chunks, so the loop compiles to vector loads and multiplies: a scale
        // read byte by byte through `scale_at`'s bounds checks was a third of an int8 block's
        // time at G=4 (perf, `bench kernels --kv-dtype int8`).
        for (x, c) in s[h * b..h * b + len].iter_mut().zip(scale.chunks_exact(4)) {
            *x *= f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
}

/// The online softmax over one block's scores (`s`, `[G][b]`, the first `len` of each
/// head's valid): rescales each head's running state `acc`, `m`, `l` to the block's new
/// maximum and leaves the weights in place of the scores. Shared by the portable and NEON
/// paths.
#[allow(clippy::too_many_arguments)] // the state's parts, borrowed apart
pub(crate) fn softmax_block(
    s: &mut [f32],
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    g: usize,
    b: usize,
    d: usize,
    len: usize,
) {
    for h in 0..g {
        let sh = &mut s[h * b..h * b + len];
        // NaN (a NaN or an infinity times zero in the stored keys) is kept, not skipped
        // as `f32::max` would: the head's output becomes NaN rather than quietly
        // ignoring the token.
        let bm = sh.iter().fold(f32::NEG_INFINITY, |a, &x| nan_max(a, x));
        let m_new = nan_max(m[h], bm);
        if m_new == f32::NEG_INFINITY {
            // Every score is -inf (only possible with infinite inputs): nothing to add.
            sh.fill(0.0);
            continue;
        }
        let alpha = (m[h] - m_new).exp2();
        l[h] *= alpha;
        for a in &mut acc[h * d..(h + 1) * d] {
            *a *= alpha;
        }
        let mut sum = 0f32;
        for sv in sh.iter_mut() {
            *sv = (*sv - m_new).exp2();
            sum += *sv;
        }
        l[h] += sum;
        m[h] = m_new;
    }
}

/// `max` that returns NaN when either side is NaN.
#[inline]
pub(crate) fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::dtype::KvDType;
    use proptest::prelude::*;

    /// Deterministic xorshift values in [-amp, amp).
    pub(crate) fn values(seed: u64, n: usize, amp: f32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * amp
            })
            .collect()
    }

    /// Writes `keys`/`vals` (`[n][d]`) as blocks of one head and returns them with lengths.
    pub(crate) fn build_blocks(
        geom: &BlockGeometry,
        keys: &[f32],
        vals: &[f32],
    ) -> Vec<(Vec<u8>, usize)> {
        let d = geom.head_dim;
        let n = keys.len() / d;
        let one = BlockGeometry {
            num_kv_heads: 1,
            ..*geom
        };
        (0..one.blocks_for(n))
            .map(|bi| {
                let mut blk = vec![0u8; one.block_bytes()];
                let len = (n - bi * geom.block_size).min(geom.block_size);
                for t in 0..len {
                    let i = bi * geom.block_size + t;
                    one.write_token(
                        &mut blk,
                        0,
                        t,
                        &keys[i * d..(i + 1) * d],
                        &vals[i * d..(i + 1) * d],
                    );
                }
                (blk, len)
            })
            .collect()
    }

    /// The query as `path` reads it for `g` heads of blocks of `geom` (unscaled, for
    /// [`reference`]): rounded to bf16 after its scaling where the bf16 dot products take
    /// the call (`kernel_bf16`), else as it is.
    fn query_as_read(path: KernelPath, geom: &BlockGeometry, q: &[f32], scale: f32) -> Vec<f32> {
        if !path.multiplies_bf16(geom, q.len() / geom.head_dim) {
            return q.to_vec();
        }
        let k = scale as f64 * std::f64::consts::LOG2_E;
        q.iter()
            .map(|x| {
                (half::bf16::from_f32(x * scale * std::f32::consts::LOG2_E).to_f64() / k) as f32
            })
            .collect()
    }

    /// What `path` may add to an output against [`reference`] by the query from
    /// [`query_as_read`]: where it rounds each weight to bf16 (relative error at most 2^-9)
    /// before the products with V, up to 2^-9 of the largest |V| it reads (twice that, for
    /// the f32 sums).
    fn weight_rounding(path: KernelPath, geom: &BlockGeometry, g: usize, vals: &[f32]) -> f64 {
        if !path.multiplies_bf16(geom, g) {
            return 0.0;
        }
        2f64.powi(-8) * vals.iter().fold(0f64, |m, v| m.max(v.abs() as f64))
    }

    /// Every path this CPU runs for `geom`, over `blocks` with query `q`, against
    /// [`reference`] on the query as the path reads it: outputs and `lse2` within `tol`
    /// relative (outputs plus what the path's weight rounding adds).
    fn assert_paths_match(
        geom: &BlockGeometry,
        q: &[f32],
        blocks: &[(Vec<u8>, usize)],
        tol: f64,
        what: &str,
    ) {
        let d = geom.head_dim;
        let g = q.len() / d;
        let (keys, vals) = read_back(geom, blocks);
        let scale = 1.0 / (d as f32).sqrt();
        for &path in KernelPath::ALL.iter().filter(|p| p.runs(geom)) {
            let (ro, rl) = reference(&query_as_read(path, geom, q, scale), &keys, &vals, d, scale);
            let slack = weight_rounding(path, geom, g, &vals);
            let p = attend_blocks_on(
                path,
                geom,
                q,
                scale,
                blocks.iter().map(|(b, l)| HeadBlock { bytes: b, len: *l }),
                &mut Scratch::default(),
            );
            for (a, b) in p.out.iter().zip(&ro) {
                assert!(
                    (*a as f64 - b).abs() <= tol * b.abs().max(1.0) + slack,
                    "{path:?} {what}: {a} vs {b}"
                );
            }
            for (a, b) in p.lse2.iter().zip(&rl) {
                assert!(
                    (*a as f64 - b).abs() <= tol * b.abs().max(1.0),
                    "{path:?} {what}: lse2 {a} vs {b}"
                );
            }
        }
    }

    /// Scalar f64 reference over the values as stored (after rounding to the dtype).
    fn reference(
        q: &[f32],
        keys: &[f32],
        vals: &[f32],
        d: usize,
        scale: f32,
    ) -> (Vec<f64>, Vec<f64>) {
        let g = q.len() / d;
        let n = keys.len() / d;
        let mut outs = vec![0f64; g * d];
        let mut lses = vec![0f64; g];
        for h in 0..g {
            let s: Vec<f64> = (0..n)
                .map(|i| {
                    (0..d)
                        .map(|c| q[h * d + c] as f64 * keys[i * d + c] as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
            let sum: f64 = w.iter().sum();
            for i in 0..n {
                for c in 0..d {
                    outs[h * d + c] += w[i] / sum * vals[i * d + c] as f64;
                }
            }
            lses[h] = (mx + sum.ln()) * std::f64::consts::LOG2_E;
        }
        (outs, lses)
    }

    /// Every token's K and V as the blocks hold them (`[n][d]` each), in f32.
    fn read_back(geom: &BlockGeometry, blocks: &[(Vec<u8>, usize)]) -> (Vec<f32>, Vec<f32>) {
        let one = BlockGeometry {
            num_kv_heads: 1,
            ..*geom
        };
        let d = geom.head_dim;
        let (mut keys, mut vals) = (Vec::new(), Vec::new());
        let (mut k, mut v) = (vec![0f32; d], vec![0f32; d]);
        for (blk, len) in blocks {
            for t in 0..*len {
                one.read_token(blk, 0, t, &mut k, &mut v);
                keys.extend_from_slice(&k);
                vals.extend_from_slice(&v);
            }
        }
        (keys, vals)
    }

    /// Int8 and fp8 tokens come back within half a quantization step: for int8 a step of the
    /// scale (max |x| / 127); for fp8 (3 mantissa bits) 1/8 of the element's binade, or the
    /// subnormal step near zero. A zero vector stays zero, a non-finite one reads as NaN, and
    /// heads do not overwrite each other.
    #[test]
    fn scaled_tokens_come_back_within_half_a_step() {
        for dtype in [KvDType::I8, KvDType::F8E4M3] {
            let geom = BlockGeometry {
                block_size: 8,
                num_kv_heads: 2,
                head_dim: 16,
                dtype,
            };
            assert_eq!(geom.head_bytes(), 2 * 8 * 16 + 2 * 8 * 4);
            let mut blk = vec![0u8; geom.block_bytes()];
            let k = values(1, 16, 3.0);
            let v = values(2, 16, 0.01);
            geom.write_token(&mut blk, 1, 5, &k, &v);
            let (mut kb, mut vb) = (vec![0f32; 16], vec![0f32; 16]);
            geom.read_token(&blk, 1, 5, &mut kb, &mut vb);
            for (x, y) in [(&k, &kb), (&v, &vb)] {
                let max = x.iter().fold(0f32, |m, a| m.max(a.abs()));
                for (a, b) in x.iter().zip(y.iter()) {
                    let half_step = match dtype {
                        KvDType::I8 => max / 127.0 * 0.5,
                        _ => (a.abs() / 16.0).max(max / 448.0 * 2f32.powi(-10)),
                    };
                    assert!((a - b).abs() <= half_step * 1.0001, "{dtype}: {a} {b}");
                }
            }
            geom.write_token(&mut blk, 0, 0, &[0.0; 16], &[f32::INFINITY; 16]);
            geom.read_token(&blk, 0, 0, &mut kb, &mut vb);
            assert!(kb.iter().all(|x| *x == 0.0) && vb.iter().all(|x| x.is_nan()));
            // Head 1 slot 5 is untouched by head 0's writes.
            geom.read_token(&blk, 1, 5, &mut kb, &mut vb);
            assert!((kb[0] - k[0]).abs() <= 3.0 / 16.0, "{dtype}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, rng_seed: proptest::test_runner::RngSeed::Fixed(11), ..ProptestConfig::default() })]
        /// The kernel equals a scalar f64 reference to 1e-5 relative for every dtype,
        /// group size, head dim and partly filled last block.
        #[test]
        fn kernel_matches_scalar_reference(
            dt in prop_oneof![Just(KvDType::F32), Just(KvDType::F16), Just(KvDType::Bf16), Just(KvDType::I8), Just(KvDType::F8E4M3)],
            g in prop_oneof![Just(1usize), Just(2), Just(3), Just(4), Just(5), Just(6), Just(7), Just(8), Just(12)],
            d in prop_oneof![Just(64usize), Just(128), Just(8), Just(12)],
            n in 1usize..150,
            bs in prop_oneof![Just(16usize), Just(32)],
            seed in any::<u64>(),
        ) {
            let geom = BlockGeometry { block_size: bs, num_kv_heads: 1, head_dim: d, dtype: dt };
            let q = values(seed, g * d, 2.0);
            let blocks = build_blocks(&geom, &values(seed + 1, n * d, 2.0), &values(seed + 2, n * d, 1.0));
            // The reference attends the values as stored (rounded, or quantized with scales).
            let (keys, vals) = read_back(&geom, &blocks);
            let scale = 1.0 / (d as f32).sqrt();
            // Every path this CPU runs (on an AVX-512 host, the AVX2-only one too).
            for &path in KernelPath::ALL.iter().filter(|p| p.runs(&geom)) {
                let (ro, rl) = reference(&query_as_read(path, &geom, &q, scale), &keys, &vals, d, scale);
                let slack = weight_rounding(path, &geom, g, &vals);
                let p = attend_blocks_on(path, &geom, &q, scale, blocks.iter().map(|(b, l)| HeadBlock { bytes: b, len: *l }), &mut Scratch::default());
                for (a, b) in p.out.iter().zip(&ro) {
                    prop_assert!((*a as f64 - b).abs() <= 1e-5 * b.abs().max(1.0) + slack, "{path:?}: {a} vs {b}");
                }
                for (a, b) in p.lse2.iter().zip(&rl) {
                    prop_assert!((*a as f64 - b).abs() <= 1e-5 * b.abs().max(1.0), "{path:?}: {a} vs {b}");
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 96, rng_seed: proptest::test_runner::RngSeed::Fixed(12), ..ProptestConfig::default() })]
        /// NaN and infinities in the stored K or V (a corrupt or overflowing push) never panic
        /// and give the same result on the SIMD path as on the scalar one: equal where both
        /// are finite, non-finite in the same heads.
        #[test]
        fn non_finite_inputs_agree_with_the_scalar_path(
            dt in prop_oneof![Just(KvDType::F32), Just(KvDType::F16), Just(KvDType::Bf16), Just(KvDType::I8), Just(KvDType::F8E4M3)],
            g in prop_oneof![Just(1usize), Just(3), Just(4), Just(8)],
            d in prop_oneof![Just(64usize), Just(8)],
            n in 1usize..100,
            bad in proptest::collection::vec((any::<bool>(), any::<prop::sample::Index>(), prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY)]), 1..4),
            seed in any::<u64>(),
        ) {
            let geom = BlockGeometry { block_size: 32, num_kv_heads: 1, head_dim: d, dtype: dt };
            let q = values(seed, g * d, 2.0);
            let mut keys = values(seed + 1, n * d, 2.0);
            let mut vals = values(seed + 2, n * d, 1.0);
            for (in_keys, at, x) in &bad {
                let v = if *in_keys { &mut keys } else { &mut vals };
                let i = at.index(v.len());
                v[i] = *x;
            }
            let blocks = build_blocks(&geom, &keys, &vals);
            let run = |path, q: &[f32]| attend_blocks_on(path, &geom, q, 0.125, blocks.iter().map(|(b, l)| HeadBlock { bytes: b, len: *l }), &mut Scratch::default());
            for &path in KernelPath::ALL.iter().filter(|p| p.runs(&geom)) {
            // The scalar path given the query as this path reads it.
            let want = run(KernelPath::Scalar, &query_as_read(path, &geom, &q, 0.125));
            let finite_vals: Vec<f32> = vals.iter().copied().filter(|v| v.is_finite()).collect();
            let slack = weight_rounding(path, &geom, g, &finite_vals);
            let got = run(path, &q);
            for h in 0..g {
                let (w, o) = (&want.out[h * d..(h + 1) * d], &got.out[h * d..(h + 1) * d]);
                let finite = |x: &[f32]| x.iter().all(|v| v.is_finite());
                prop_assert_eq!(finite(w), finite(o), "head {}: {:?} vs {:?}", h, &w[..4.min(d)], &o[..4.min(d)]);
                if finite(w) {
                    for (a, b) in o.iter().zip(w) {
                        prop_assert!(((a - b).abs() as f64) <= 1e-4 * b.abs().max(1.0) as f64 + slack, "{:?}: {} vs {}", path, a, b);
                    }
                }
            }
            }
        }
    }

    /// Scores that rise past the running maximum block after block and fall again (each
    /// block rescales the state by a different factor), and scores that jump by hundreds
    /// (base 2) after the first block, where a state not rescaled would overflow: every path
    /// equals the reference.
    #[test]
    fn rising_and_jumping_scores_match_the_reference() {
        let n = 7 * 32 + 5;
        // Each token's key scale: 16x over the first half and back, or 30000x after block 0.
        let rise = |i: usize| (i.min(n - i) as f32 / 28.0).exp2();
        let jump = |i: usize| if i < 32 { 0.01 } else { 300.0 };
        let profiles: [(&dyn Fn(usize) -> f32, f64); 2] = [(&rise, 1e-5), (&jump, 1e-4)];
        for (profile, tol) in profiles {
            for dt in [KvDType::F32, KvDType::Bf16] {
                for (g, d) in [(1, 64), (3, 64), (8, 128)] {
                    let geom = BlockGeometry {
                        block_size: 32,
                        num_kv_heads: 1,
                        head_dim: d,
                        dtype: dt,
                    };
                    let q = values(3, g * d, 1.0);
                    let mut keys = values(4, n * d, 1.0);
                    for (i, k) in keys.chunks_mut(d).enumerate() {
                        let x = profile(i);
                        k.iter_mut().for_each(|v| *v *= x);
                    }
                    let blocks = build_blocks(&geom, &keys, &values(5, n * d, 1.0));
                    assert_paths_match(&geom, &q, &blocks, tol, &format!("{dt} G={g}"));
                }
            }
        }
    }

    /// Every head dim a SIMD path takes (a multiple of 8), every group size and dtype, on
    /// blocks of 32 and of 16 tokens (full, and a partly filled last one), equals the
    /// reference: the AVX-512 pieces
    /// take some of a block's phases and leave the others to the AVX2 loops (scores and
    /// softmax where V does not divide in 32-channel slices), which must read the weights in
    /// the order they were left (bf16's even-then-odd tokens once reached the AVX2 V loop,
    /// which read them in token order, at head dims 8, 16, 24, 48, 80, 112).
    #[test]
    fn every_head_dim_and_group_matches_the_reference() {
        let n = 2 * 32 + 9;
        let dtypes = [
            KvDType::F32,
            KvDType::F16,
            KvDType::Bf16,
            KvDType::I8,
            KvDType::F8E4M3,
        ];
        for (dt, block_size) in dtypes.into_iter().flat_map(|dt| [(dt, 32), (dt, 16)]) {
            for d in [8, 16, 24, 40, 48, 80, 96, 112] {
                for g in 1..=8 {
                    let geom = BlockGeometry {
                        block_size,
                        num_kv_heads: 1,
                        head_dim: d,
                        dtype: dt,
                    };
                    let q = values(31, g * d, 2.0);
                    let blocks =
                        build_blocks(&geom, &values(32, n * d, 2.0), &values(33, n * d, 1.0));
                    assert_paths_match(
                        &geom,
                        &q,
                        &blocks,
                        1e-5,
                        &format!("{dt} G={g} D={d} B={block_size}"),
                    );
                }
            }
        }
    }

    /// Where rounding to bf16 changes nothing, the bf16 dot products equal the reference to
    /// f32 precision, with the query and the weights as every other path reads them: the
    /// scaled query and the keys small integers (exact in bf16), so every score is an integer
    /// and every weight a power of two. This pins what the looser tests cannot: each token's
    /// weight meets its own V row, each channel lands in its place, each pair of rows and
    /// tokens is summed once, for every group size the path takes and a partly filled last
    /// block.
    #[test]
    fn bf16_dot_products_are_exact_where_rounding_is() {
        // A partly filled last block (the f32 loops take it) and none (the call ends on
        // the pair products, which leave the output in their own channel order).
        for (n, g, d) in [5 * 32 + 7, 4 * 32].into_iter().flat_map(|n| {
            [
                (2, 64),
                (3, 128),
                (4, 64),
                (5, 64),
                (6, 128),
                (7, 64),
                (8, 64),
                (8, 128),
            ]
            .map(|(g, d)| (n, g, d))
        }) {
            let geom = BlockGeometry {
                block_size: 32,
                num_kv_heads: 1,
                head_dim: d,
                dtype: KvDType::Bf16,
            };
            let scale = 1.0 / (d as f32).sqrt();
            let int = |seed, len| -> Vec<f32> {
                values(seed, len, 1.5).iter().map(|x| x.round()).collect()
            };
            // Scaled by `scale * log2(e)` in the kernel, each is within a few ulps of an
            // integer in -1..=1, which bf16 rounds to the integer.
            let q: Vec<f32> = int(21, g * d)
                .iter()
                .map(|x| x / (scale * std::f32::consts::LOG2_E))
                .collect();
            let keys = int(22, n * d);
            let blocks = build_blocks(&geom, &keys, &values(23, n * d, 1.0));
            let (keys, vals) = read_back(&geom, &blocks);
            let (ro, rl) = reference(&q, &keys, &vals, d, scale);
            for &path in KernelPath::ALL.iter().filter(|p| p.runs(&geom)) {
                let p = attend_blocks_on(
                    path,
                    &geom,
                    &q,
                    scale,
                    blocks.iter().map(|(b, l)| HeadBlock { bytes: b, len: *l }),
                    &mut Scratch::default(),
                );
                for (a, b) in p.out.iter().zip(&ro).chain(p.lse2.iter().zip(&rl)) {
                    assert!(
                        (*a as f64 - b).abs() <= 1e-5 * b.abs().max(1.0),
                        "{path:?} G={g} D={d}: {a} vs {b}"
                    );
                }
            }
        }
    }

    /// A first block whose every score is -inf (a key channel of -inf against a positive
    /// query channel) adds nothing, on every path: the state stays empty through it rather
    /// than turning NaN (-inf minus -inf), so the result is the other blocks' alone.
    #[test]
    fn a_block_of_minus_infinity_scores_adds_nothing() {
        let n = 3 * 32;
        for dt in [KvDType::F32, KvDType::Bf16] {
            for (g, d) in [(1, 64), (3, 64), (8, 64), (8, 128)] {
                let geom = BlockGeometry {
                    block_size: 32,
                    num_kv_heads: 1,
                    head_dim: d,
                    dtype: dt,
                };
                let mut q = values(6, g * d, 1.0);
                q.chunks_mut(d).for_each(|h| h[0] = 1.0);
                let mut keys = values(7, n * d, 1.0);
                keys[..32 * d]
                    .chunks_mut(d)
                    .for_each(|k| k[0] = f32::NEG_INFINITY);
                let blocks = build_blocks(&geom, &keys, &values(8, n * d, 1.0));
                for &path in KernelPath::ALL.iter().filter(|p| p.runs(&geom)) {
                    let run = |from: usize| {
                        attend_blocks_on(
                            path,
                            &geom,
                            &q,
                            0.125,
                            blocks[from..]
                                .iter()
                                .map(|(b, l)| HeadBlock { bytes: b, len: *l }),
                            &mut Scratch::default(),
                        )
                    };
                    let (all, rest) = (run(0), run(1));
                    assert_eq!(all.out, rest.out, "{path:?} {dt} G={g} D={d}");
                    assert_eq!(all.lse2, rest.lse2, "{path:?} {dt} G={g} D={d}");
                }
            }
        }
    }

    #[test]
    fn no_blocks_is_empty() {
        let geom = BlockGeometry {
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 2,
            dtype: KvDType::F16,
        };
        let p = attend_blocks(
            &geom,
            &[1.0, 2.0],
            1.0,
            std::iter::empty(),
            &mut Scratch::default(),
        );
        assert!(p.is_empty());
    }
}
