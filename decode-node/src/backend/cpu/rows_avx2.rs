//! AVX2 + FMA inner loop of the CPU backend's row path (x86-64), chosen at run time: a task's
//! widened weight rows against every input of the batch, in register tiles of two rows by four
//! inputs, so each row vector is loaded once per four inputs and each input vector once per two
//! rows (eight FMA chains). The portable loop compiles for baseline x86-64 (SSE, no FMA).

use std::arch::x86_64::*;

/// True when this CPU can run [`rows_times_inputs`].
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// `out[r * batch + b] = rows[r] · x[b]` for `n` rows and `batch` inputs of `inp` values.
///
/// # Safety
/// The CPU must have AVX2 and FMA ([`available`]); `inp` a multiple of 8; `rows` holds
/// `n * inp`, `x` `batch * inp` and `out` `n * batch` values.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rows_times_inputs(
    rows: &[f32],
    n: usize,
    x: &[f32],
    batch: usize,
    inp: usize,
    out: &mut [f32],
) {
    debug_assert!(inp.is_multiple_of(8) && rows.len() >= n * inp && x.len() >= batch * inp);
    debug_assert!(out.len() >= n * batch);
    let t = Tiles {
        rows,
        x,
        batch,
        inp,
    };
    let mut r = 0;
    while r < n {
        let nr = (n - r).min(2);
        let mut b = 0;
        while b < batch {
            let nb = (batch - b).min(4);
            // SAFETY (every arm): rows r..r+R < n and inputs b..b+I < batch; forwarded.
            unsafe {
                match (nr, nb) {
                    (2, 4) => t.tile::<2, 4>(r, b, out),
                    (2, 3) => t.tile::<2, 3>(r, b, out),
                    (2, 2) => t.tile::<2, 2>(r, b, out),
                    (2, _) => t.tile::<2, 1>(r, b, out),
                    (_, 4) => t.tile::<1, 4>(r, b, out),
                    (_, 3) => t.tile::<1, 3>(r, b, out),
                    (_, 2) => t.tile::<1, 2>(r, b, out),
                    _ => t.tile::<1, 1>(r, b, out),
                }
            }
            b += nb;
        }
        r += nr;
    }
}

struct Tiles<'a> {
    rows: &'a [f32],
    x: &'a [f32],
    batch: usize,
    inp: usize,
}

impl Tiles<'_> {
    /// Rows `r0..r0+R` against inputs `b0..b0+I`.
    ///
    /// # Safety
    /// As [`rows_times_inputs`]; `r0 + R <= n`, `b0 + I <= batch`.
    // Indexed loops over constant bounds keep the accumulators in registers.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const R: usize, const I: usize>(&self, r0: usize, b0: usize, out: &mut [f32]) {
        let inp = self.inp;
        let (rp, xp) = (self.rows.as_ptr(), self.x.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); I]; R];
        for c in (0..inp).step_by(8) {
            let mut w = [_mm256_setzero_ps(); R];
            for r in 0..R {
                // SAFETY: row r0+r < n, c + 8 <= inp.
                w[r] = unsafe { _mm256_loadu_ps(rp.add((r0 + r) * inp + c)) };
            }
            for i in 0..I {
                // SAFETY: input b0+i < batch, c + 8 <= inp.
                let xv = unsafe { _mm256_loadu_ps(xp.add((b0 + i) * inp + c)) };
                for r in 0..R {
                    acc[r][i] = _mm256_fmadd_ps(w[r], xv, acc[r][i]);
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

#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}
