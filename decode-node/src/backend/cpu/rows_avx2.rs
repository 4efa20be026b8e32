//! AVX2 + FMA inner loop of the CPU backend's row path (x86-64), chosen at run time: a task's
//! weight rows, read in their stored dtype and widened in registers (no f32 copy of the
//! weights), against every input of the batch in register tiles, so each weight vector is
//! loaded once per tile of inputs and each input vector once per tile of rows. Few inputs get
//! tall tiles (four rows) so a batch of one still keeps four FMA chains in flight. bf16 rows
//! are read 16 elements at a time as their even and odd elements, one op per vector, against
//! inputs reordered to match once per projection (batch 1 +5-10%, batch 8 +3-4% on SmolLM2,
//! Intel Xeon 2 threads). Taller tiles for many inputs (three rows by four) spill registers
//! and measured a fifth slower.

use std::arch::x86_64::*;
use std::marker::PhantomData;

use attention::KvDType;
use attention::avx2::{AsBf16, AsF16, AsF32, Elem, hsum};

/// True when this CPU can run [`rows_times_inputs`].
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Whether rows of `dtype` and `inp` elements are read 16 at a time as their even and odd
/// elements (bf16: one op per widened vector, where widening in order costs a shuffle and a
/// shift on the ports the FMAs use). The inputs must then come in [`split_order`] by 16.
pub(super) fn reads_split(dtype: KvDType, inp: usize) -> bool {
    dtype == KvDType::Bf16 && inp.is_multiple_of(16)
}

/// `x` (rows of `inp` values, a multiple of `chunk`) with each `chunk`-value run reordered as
/// its even values, then its odd ones: the lane order of a split read, 16 values here and 32
/// on AVX-512 (a dot product does not care about the order, as long as both sides share it).
pub(super) fn split_order(x: &[f32], inp: usize, chunk: usize) -> Vec<f32> {
    debug_assert!(inp.is_multiple_of(chunk) && x.len().is_multiple_of(inp));
    // Indexed pairs, not `step_by` iterators: those compiled to a scalar loop that was ~1% of
    // a batch-8 step (perf, SmolLM2).
    let mut out = vec![0f32; x.len()];
    for (src, dst) in x.chunks_exact(chunk).zip(out.chunks_exact_mut(chunk)) {
        let (even, odd) = dst.split_at_mut(chunk / 2);
        for (i, (e, o)) in even.iter_mut().zip(odd).enumerate() {
            (*e, *o) = (src[2 * i], src[2 * i + 1]);
        }
    }
    out
}

/// `out[r * batch + b] = row[r] · x[b]` for `n` weight rows of `inp` elements of `dtype`
/// (little-endian bytes in `rows`) and `batch` f32 inputs, given in [`split_order`] where
/// [`reads_split`] says so.
///
/// # Safety
/// The CPU must pass [`available`]; `inp` a multiple of 8; `rows` holds `n * inp` elements,
/// `x` `batch * inp` values and `out` `n * batch`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows_times_inputs(
    dtype: KvDType,
    rows: &[u8],
    n: usize,
    x: &[f32],
    batch: usize,
    inp: usize,
    out: &mut [f32],
) {
    debug_assert!(inp.is_multiple_of(8) && rows.len() >= n * inp * dtype.size());
    debug_assert!(x.len() >= batch * inp && out.len() >= n * batch);
    // SAFETY: forwarded.
    unsafe {
        match dtype {
            KvDType::F32 => tiles::<AsF32>(rows, n, x, batch, inp, out),
            KvDType::F16 => tiles::<AsF16>(rows, n, x, batch, inp, out),
            KvDType::Bf16 if reads_split(dtype, inp) => {
                tiles::<Split<AsBf16>>(rows, n, x, batch, inp, out)
            }
            KvDType::Bf16 => tiles::<AsBf16>(rows, n, x, batch, inp, out),
            // `direct_rows` keeps int8 off this path (and loaders make no int8 weights).
            KvDType::I8 | KvDType::F8E4M3 => unreachable!("scaled weights on the AVX2 row path"),
        }
    }
}

/// How a tile reads a weight row: `STEP` elements at a time, as `PARTS` vectors of eight,
/// part `p` against the input's values `8p..8p+8` from the same place.
trait Read {
    /// Bytes per element.
    const SIZE: usize;
    /// Elements per read.
    const STEP: usize;
    /// Vectors per read.
    const PARTS: usize;
    /// Part `p` of the `STEP` elements at `w`, widened.
    ///
    /// # Safety
    /// `STEP` readable elements at `w`; AVX2, FMA and F16C.
    unsafe fn part(w: *const u8, p: usize) -> __m256;
}

/// Eight elements at a time, in order.
impl<E: Elem> Read for E {
    const SIZE: usize = E::SIZE;
    const STEP: usize = 8;
    const PARTS: usize = 1;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn part(w: *const u8, _: usize) -> __m256 {
        // SAFETY: forwarded.
        unsafe { E::load8(w) }
    }
}

/// Sixteen elements at a time as [`Elem::load16`] splits them (even, then odd), against
/// inputs in [`split_order`].
struct Split<E>(PhantomData<E>);

impl<E: Elem> Read for Split<E> {
    const SIZE: usize = E::SIZE;
    const STEP: usize = 16;
    const PARTS: usize = 2;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn part(w: *const u8, p: usize) -> __m256 {
        // SAFETY: forwarded. Each part loads the 32 bytes again (from L1, and two loads
        // are cheaper than keeping both halves of every row live across the tile).
        let (e, o) = unsafe { E::load16(w) };
        if p == 0 { e } else { o }
    }
}

/// # Safety
/// As [`rows_times_inputs`], with `W` the rows' element type and read.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tiles<W: Read>(
    rows: &[u8],
    n: usize,
    x: &[f32],
    batch: usize,
    inp: usize,
    out: &mut [f32],
) {
    let t = Tiles {
        rows: rows.as_ptr(),
        x: x.as_ptr(),
        batch,
        inp,
    };
    // SAFETY (every call): rows r..r+R <= n and inputs b..b+I <= batch; the rest forwarded.
    unsafe {
        if batch <= 2 {
            let mut r = 0;
            while r + 4 <= n {
                match batch {
                    2 => t.tile::<W, 4, 2>(r, 0, out),
                    _ => t.tile::<W, 4, 1>(r, 0, out),
                }
                r += 4;
            }
            while r < n {
                match batch {
                    2 => t.tile::<W, 1, 2>(r, 0, out),
                    _ => t.tile::<W, 1, 1>(r, 0, out),
                }
                r += 1;
            }
            return;
        }
        let mut r = 0;
        while r < n {
            let nr = (n - r).min(2);
            let mut b = 0;
            while b < batch {
                let nb = (batch - b).min(4);
                match (nr, nb) {
                    (2, 4) => t.tile::<W, 2, 4>(r, b, out),
                    (2, 3) => t.tile::<W, 2, 3>(r, b, out),
                    (2, 2) => t.tile::<W, 2, 2>(r, b, out),
                    (2, _) => t.tile::<W, 2, 1>(r, b, out),
                    (_, 4) => t.tile::<W, 1, 4>(r, b, out),
                    (_, 3) => t.tile::<W, 1, 3>(r, b, out),
                    (_, 2) => t.tile::<W, 1, 2>(r, b, out),
                    _ => t.tile::<W, 1, 1>(r, b, out),
                }
                b += nb;
            }
            r += nr;
        }
    }
}

struct Tiles {
    rows: *const u8,
    x: *const f32,
    batch: usize,
    inp: usize,
}

impl Tiles {
    /// Rows `r0..r0+R` against inputs `b0..b0+I`.
    ///
    /// # Safety
    /// As [`rows_times_inputs`]; `r0 + R <= n`, `b0 + I <= batch`.
    // Indexed loops over constant bounds keep the accumulators in registers.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<W: Read, const R: usize, const I: usize>(
        &self,
        r0: usize,
        b0: usize,
        out: &mut [f32],
    ) {
        let inp = self.inp;
        let mut acc = [[_mm256_setzero_ps(); I]; R];
        for c in (0..inp).step_by(W::STEP) {
            // Each row stream asks for the line `PREFETCH_AHEAD` bytes past it: the rows are
            // contiguous, so together the streams fetch every line of the weight once, ahead.
            if (c * W::SIZE) % 64 == 0 {
                for r in 0..R {
                    let at = ((r0 + r) * inp + c) * W::SIZE + super::PREFETCH_AHEAD;
                    super::prefetch_l2(self.rows.wrapping_add(at));
                }
            }
            for p in 0..W::PARTS {
                let mut w = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    // SAFETY: row r0+r < n, c + STEP <= inp.
                    w[r] = unsafe { W::part(self.rows.add(((r0 + r) * inp + c) * W::SIZE), p) };
                }
                for i in 0..I {
                    // SAFETY: input b0+i < batch, c + 8p + 8 <= c + STEP <= inp.
                    let xv = unsafe { _mm256_loadu_ps(self.x.add((b0 + i) * inp + c + 8 * p)) };
                    for r in 0..R {
                        acc[r][i] = _mm256_fmadd_ps(w[r], xv, acc[r][i]);
                    }
                }
            }
        }
        for r in 0..R {
            for i in 0..I {
                out[(r0 + r) * self.batch + b0 + i] = hsum(acc[r][i]);
            }
        }
    }
}
