//! AVX-512 inner loop of the CPU backend's row path (x86-64), chosen at run time where the CPU
//! has it: as [`super::rows_avx2`], weight rows read as stored and widened in registers, with
//! sixteen lanes and 32 registers. A tile is three rows by up to eight inputs (24
//! accumulators), so a decode batch of eight reads each weight vector once and each input
//! vector once per three rows. Two rows by eight spent ten loads per sixteen FMAs and ran at
//! 36-41 G FMA/s on one Zen 4 thread with the weights in L2 (bf16, rows of 576 and 1536);
//! three rows run at 50-55 of the ~58 the FMA units allow. Measured to pay off only from
//! three inputs on (below that a step is bound by memory, not by FMAs), so smaller batches
//! stay on the AVX2 loop.

use std::arch::x86_64::*;

use attention::KvDType;

/// True when this CPU can run [`rows_times_inputs`].
/// (`DECODE_NODE_AVX512=0` turns it off, as for the attention kernels.)
pub(super) fn available() -> bool {
    attention::avx512_enabled() && super::rows_avx2::available()
}

/// Whether rows of `dtype` and `inp` elements are read 32 at a time as their even and odd
/// elements (bf16: one op per widened vector); the inputs must then come in
/// [`super::rows_avx2::split_order`] by 32.
pub(super) fn reads_split(dtype: KvDType, inp: usize) -> bool {
    dtype == KvDType::Bf16 && inp.is_multiple_of(32)
}

/// `out[r * batch + b] = row[r] · x[b]` for `n` weight rows of `inp` elements of `dtype`
/// (little-endian bytes in `rows`) and `batch` f32 inputs, given in split order by 32 where
/// [`reads_split`] says so.
///
/// # Safety
/// The CPU must pass [`available`]; `inp` a multiple of 16; `rows` holds `n * inp` elements,
/// `x` `batch * inp` values and `out` `n * batch`.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn rows_times_inputs(
    dtype: KvDType,
    rows: &[u8],
    n: usize,
    x: &[f32],
    batch: usize,
    inp: usize,
    out: &mut [f32],
) {
    debug_assert!(inp.is_multiple_of(16) && rows.len() >= n * inp * dtype.size());
    debug_assert!(x.len() >= batch * inp && out.len() >= n * batch);
    let t = Tiles {
        rows: rows.as_ptr(),
        x: x.as_ptr(),
        batch,
        inp,
    };
    // SAFETY (every arm): forwarded.
    unsafe {
        match dtype {
            KvDType::F32 => t.run::<F32>(n, out),
            KvDType::F16 => t.run::<F16>(n, out),
            KvDType::Bf16 if reads_split(dtype, inp) => t.run::<SplitBf16>(n, out),
            KvDType::Bf16 => t.run::<Bf16>(n, out),
            // `direct_rows` keeps the scaled dtypes off the row paths (and loaders make none).
            KvDType::I8 | KvDType::F8E4M3 => unreachable!("scaled weights on the AVX-512 row path"),
        }
    }
}

/// How a tile reads a weight row: `STEP` elements at a time, as `PARTS` vectors of sixteen,
/// part `p` against the input's values `16p..16p+16` from the same place.
trait Read {
    const SIZE: usize;
    const STEP: usize;
    const PARTS: usize;
    /// Part `p` of the `STEP` elements at `w`, widened.
    ///
    /// # Safety
    /// `STEP` readable elements at `w`; AVX-512F/BW.
    unsafe fn part(w: *const u8, p: usize) -> __m512;
}

struct F32;
struct F16;
struct Bf16;
/// bf16 read 32 at a time as its even elements (shifted up) and odd ones (masked).
struct SplitBf16;

impl Read for F32 {
    const SIZE: usize = 4;
    const STEP: usize = 16;
    const PARTS: usize = 1;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn part(w: *const u8, _: usize) -> __m512 {
        // SAFETY: forwarded.
        unsafe { _mm512_loadu_ps(w.cast()) }
    }
}

impl Read for F16 {
    const SIZE: usize = 2;
    const STEP: usize = 16;
    const PARTS: usize = 1;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn part(w: *const u8, _: usize) -> __m512 {
        // SAFETY: forwarded.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(w.cast())) }
    }
}

impl Read for Bf16 {
    const SIZE: usize = 2;
    const STEP: usize = 16;
    const PARTS: usize = 1;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn part(w: *const u8, _: usize) -> __m512 {
        // SAFETY: forwarded.
        let h = unsafe { _mm512_cvtepu16_epi32(_mm256_loadu_si256(w.cast())) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
    }
}

impl Read for SplitBf16 {
    const SIZE: usize = 2;
    const STEP: usize = 32;
    const PARTS: usize = 2;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn part(w: *const u8, p: usize) -> __m512 {
        // SAFETY: forwarded (64 bytes: 32 elements). Each part loads them again, from L1.
        let v = unsafe { _mm512_loadu_si512(w.cast()) };
        if p == 0 {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))
        } else {
            _mm512_castsi512_ps(_mm512_and_si512(
                v,
                _mm512_set1_epi32(0xffff_0000_u32 as i32),
            ))
        }
    }
}

struct Tiles {
    rows: *const u8,
    x: *const f32,
    batch: usize,
    inp: usize,
}

/// Runs `tile::<W, R, $nb>` for a run-time input count `$nb` in 1..=8.
macro_rules! inputs {
    ($t:expr, $w:ty, $r:expr, $r0:expr, $b0:expr, $nb:expr, $out:expr) => {
        match $nb {
            8 => $t.tile::<$w, $r, 8>($r0, $b0, $out),
            7 => $t.tile::<$w, $r, 7>($r0, $b0, $out),
            6 => $t.tile::<$w, $r, 6>($r0, $b0, $out),
            5 => $t.tile::<$w, $r, 5>($r0, $b0, $out),
            4 => $t.tile::<$w, $r, 4>($r0, $b0, $out),
            3 => $t.tile::<$w, $r, 3>($r0, $b0, $out),
            2 => $t.tile::<$w, $r, 2>($r0, $b0, $out),
            _ => $t.tile::<$w, $r, 1>($r0, $b0, $out),
        }
    };
}

impl Tiles {
    /// Every row and input, in tiles of three rows by up to eight inputs.
    ///
    /// # Safety
    /// As [`rows_times_inputs`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn run<W: Read>(&self, n: usize, out: &mut [f32]) {
        let mut r = 0;
        while r < n {
            let nr = (n - r).min(3);
            let mut b = 0;
            while b < self.batch {
                let nb = (self.batch - b).min(8);
                // SAFETY: rows r..r+nr <= n, inputs b..b+nb <= batch; the rest forwarded.
                unsafe {
                    if nr == 3 {
                        inputs!(self, W, 3, r, b, nb, out)
                    } else if nr == 2 {
                        inputs!(self, W, 2, r, b, nb, out)
                    } else {
                        inputs!(self, W, 1, r, b, nb, out)
                    }
                }
                b += nb;
            }
            r += nr;
        }
    }

    /// Rows `r0..r0+R` against inputs `b0..b0+I`.
    ///
    /// # Safety
    /// As [`rows_times_inputs`]; `r0 + R <= n`, `b0 + I <= batch`.
    // Indexed loops over constant bounds keep the accumulators in registers.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn tile<W: Read, const R: usize, const I: usize>(
        &self,
        r0: usize,
        b0: usize,
        out: &mut [f32],
    ) {
        let inp = self.inp;
        let mut acc = [[_mm512_setzero_ps(); I]; R];
        if inp == 0 {
            for r in 0..R {
                out[(r0 + r) * self.batch + b0..][..I].fill(0.0);
            }
            return;
        }
        // At least one pass, tested at its end: with a pass that may not run, the
        // accumulators' zeros went through a stack copy (a 1.5 KiB memset per tile).
        let mut c = 0;
        loop {
            // Lines `PREFETCH_AHEAD` bytes ahead of each row stream, as on the AVX2 loop.
            for r in 0..R {
                let at = ((r0 + r) * inp + c) * W::SIZE + super::PREFETCH_AHEAD;
                for line in (0..W::STEP * W::SIZE).step_by(64) {
                    super::prefetch_l2(self.rows.wrapping_add(at + line));
                }
            }
            for p in 0..W::PARTS {
                let mut w = [_mm512_setzero_ps(); R];
                for r in 0..R {
                    // SAFETY: row r0+r < n, c + STEP <= inp.
                    w[r] = unsafe { W::part(self.rows.add(((r0 + r) * inp + c) * W::SIZE), p) };
                }
                for i in 0..I {
                    // SAFETY: input b0+i < batch, c + 16p + 16 <= c + STEP <= inp.
                    let xv = unsafe { _mm512_loadu_ps(self.x.add((b0 + i) * inp + c + 16 * p)) };
                    for r in 0..R {
                        acc[r][i] = _mm512_fmadd_ps(w[r], xv, acc[r][i]);
                    }
                }
            }
            c += W::STEP;
            if c >= inp {
                break;
            }
        }
        for r in 0..R {
            let at = (r0 + r) * self.batch + b0;
            if I == 8 {
                let sums = sum_lanes8(&acc[r][..]);
                // SAFETY: outputs at..at + 8 lie in `out` (input b0 + 7 < batch).
                unsafe { _mm256_storeu_ps(out[at..at + 8].as_mut_ptr(), sums) };
            } else {
                for i in 0..I {
                    out[at + i] = _mm512_reduce_add_ps(acc[r][i]);
                }
            }
        }
    }
}

/// The sums of the lanes of each of eight vectors, as lanes 0..8: 24 ops where eight
/// separate reductions take 64, half of them shuffles on the one port that runs them (a
/// tile's reductions were a fifth of its time on rows of 576).
#[inline]
#[target_feature(enable = "avx512f")]
fn sum_lanes8(v: &[__m512]) -> __m256 {
    debug_assert_eq!(v.len(), 8);
    // Halves: [a.lo + a.hi, b.lo + b.hi] for each pair (8 partial sums each).
    let pair = |a: __m512, b: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        )
    };
    let (p0, p1, p2, p3) = (
        pair(v[0], v[1]),
        pair(v[2], v[3]),
        pair(v[4], v[5]),
        pair(v[6], v[7]),
    );
    // Quarters: 128-bit lane k holds four partial sums of vector k (and of 4 + k).
    let quad = |a: __m512, b: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        )
    };
    let (u, w) = (quad(p0, p1), quad(p2, p3));
    // Within each 128-bit lane k: [u_k, w_k] summed down to lanes 0 and 1.
    let s = _mm512_add_ps(_mm512_unpacklo_ps(u, w), _mm512_unpackhi_ps(u, w));
    let s = _mm512_add_ps(s, _mm512_permute_ps::<0b01_00_11_10>(s));
    // Lane 4k holds vector k's sum, lane 4k + 1 vector 4 + k's.
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, s))
}
