//! The CPU backend: what CI tests, and the model executor wherever no device is given.
//!
//! A projection of a few rows (a decode step) is memory-bound: each task runs every input
//! against a slice of weight rows, read as stored and widened in registers (AVX2; elsewhere
//! widened to f32 once per task). A projection of many rows (a
//! prefill) is compute-bound: the weight is widened once and multiplied with a blocked GEMM,
//! tiles of inputs in parallel.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod rows_avx2;
#[cfg(target_arch = "x86_64")]
mod rows_avx512;

use super::gemm::{Mat, MatMut, gemm};
use super::{Backend, BackendError};
use crate::tensor::Tensor;

/// The CPU backend: rayon across output rows (few inputs) or input tiles (many).
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

/// Output rows per rayon task on the row path: large enough to amortise scheduling, small
/// enough to balance.
const ROWS_PER_TASK: usize = 16;

/// From this many inputs on (a prefill), a projection runs as a GEMM: widening the whole
/// weight to f32 costs about one pass over it, which the blocked kernel wins back over long
/// prompts. Below it, the register tiles of the row path win: on SmolLM2 (2-core EPYC) a
/// decode step of 64 went at 348 tokens/s on rows against 184 as a GEMM, 16 at 365 against
/// 96. Above the default `--max-batch`, so a decode step never widens its weights.
const GEMM_MIN_BATCH: usize = 128;

/// From this many inputs on, the row path runs on AVX-512 where the CPU has it: a step of
/// fewer is bound by memory, which wider FMAs do not help.
#[cfg(target_arch = "x86_64")]
const AVX512_MIN_BATCH: usize = 3;

/// Inputs per rayon task on the GEMM path.
const GEMM_ROWS_PER_TASK: usize = 64;

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise without reassociation flags.
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `out[r * batch + b] = rows[r] · x[b]` for `n` widened rows.
fn rows_times_inputs(rows: &[f32], n: usize, x: &[f32], batch: usize, inp: usize, out: &mut [f32]) {
    for bi in 0..batch {
        let xb = &x[bi * inp..(bi + 1) * inp];
        for (ri, row) in rows.chunks_exact(inp).take(n).enumerate() {
            out[ri * batch + bi] = dot(row, xb);
        }
    }
}

/// Whether this CPU runs the row path from the stored weights (AVX2 + FMA + F16C, x86-64),
/// for rows of `inp` elements.
fn direct_rows(inp: usize, dtype: attention::KvDType) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        inp.is_multiple_of(8) && !dtype.scaled() && rows_avx2::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (inp, dtype);
        false
    }
}

/// `y = x · wᵀ + bias` one weight row at a time (few inputs).
fn linear_rows(x: &[f32], batch: usize, w: &Tensor, bias: Option<&[f32]>, y: &mut [f32]) {
    let (out, inp) = (w.rows(), w.cols());
    let direct = direct_rows(inp, w.dtype);
    // Computed transposed ([out][batch]) so each task owns a contiguous slice. A task runs
    // every input against its rows: read as stored and widened in registers where the CPU
    // allows, else widened to f32 once into a scratch.
    #[cfg(target_arch = "x86_64")]
    let wide =
        direct && batch >= AVX512_MIN_BATCH && inp.is_multiple_of(16) && rows_avx512::available();
    #[cfg(target_arch = "x86_64")]
    let xs = if wide && rows_avx512::reads_split(w.dtype, inp) {
        std::borrow::Cow::Owned(rows_avx2::split_order(x, inp, 32))
    } else if !wide && direct && rows_avx2::reads_split(w.dtype, inp) {
        std::borrow::Cow::Owned(rows_avx2::split_order(x, inp, 16))
    } else {
        std::borrow::Cow::Borrowed(x)
    };
    let mut yt = vec![0f32; out * batch];
    yt.par_chunks_mut(ROWS_PER_TASK * batch)
        .enumerate()
        .for_each_init(
            || vec![0f32; if direct { 0 } else { ROWS_PER_TASK * inp }],
            |rows, (ci, chunk)| {
                let r0 = ci * ROWS_PER_TASK;
                let n = chunk.len() / batch;
                if direct {
                    #[cfg(target_arch = "x86_64")]
                    {
                        let row_bytes = inp * w.dtype.size();
                        let bytes = &w.bytes()[r0 * row_bytes..(r0 + n) * row_bytes];
                        // SAFETY: `direct_rows` checked the CPU and that `inp` is a multiple
                        // of 8 (`wide`: AVX-512 and 16); `bytes` holds `n` rows, `x` `batch`
                        // inputs and `chunk` `n * batch` outputs.
                        unsafe {
                            if wide {
                                rows_avx512::rows_times_inputs(
                                    w.dtype, bytes, n, &xs, batch, inp, chunk,
                                )
                            } else {
                                rows_avx2::rows_times_inputs(
                                    w.dtype, bytes, n, &xs, batch, inp, chunk,
                                )
                            }
                        };
                    }
                } else {
                    for (ri, row) in rows.chunks_exact_mut(inp).take(n).enumerate() {
                        w.row_f32(r0 + ri, row);
                    }
                    rows_times_inputs(rows, n, x, batch, inp, chunk);
                }
                if let Some(b) = bias {
                    for (ri, c) in chunk.chunks_exact_mut(batch).enumerate() {
                        c.iter_mut().for_each(|v| *v += b[r0 + ri]);
                    }
                }
            },
        );
    for o in 0..out {
        for b in 0..batch {
            y[b * out + o] = yt[o * batch + b];
        }
    }
}

/// `y = x · wᵀ + bias` as a GEMM over tiles of inputs (many inputs).
fn linear_gemm(x: &[f32], w: &Tensor, bias: Option<&[f32]>, y: &mut [f32]) {
    let (out, inp) = (w.rows(), w.cols());
    let mut wf = vec![0f32; out * inp];
    wf.par_chunks_mut(ROWS_PER_TASK * inp)
        .enumerate()
        .for_each(|(ci, rows)| {
            for (ri, row) in rows.chunks_exact_mut(inp).enumerate() {
                w.row_f32(ci * ROWS_PER_TASK + ri, row);
            }
        });
    let wt = Mat::rows(&wf, out, inp).t();
    y.par_chunks_mut(GEMM_ROWS_PER_TASK * out)
        .zip(x.par_chunks(GEMM_ROWS_PER_TASK * inp))
        .for_each(|(yc, xc)| {
            let n = xc.len() / inp;
            gemm(
                1.0,
                Mat::rows(xc, n, inp),
                wt,
                0.0,
                MatMut::new(yc, n, out, out, 1),
            );
            if let Some(b) = bias {
                for row in yc.chunks_exact_mut(out) {
                    row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
                }
            }
        });
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn parallel_on_rayon(&self) -> bool {
        true
    }

    fn linear(
        &self,
        x: &[f32],
        batch: usize,
        w: &Tensor,
        bias: Option<&[f32]>,
        y: &mut [f32],
    ) -> Result<(), BackendError> {
        debug_assert_eq!(x.len(), batch * w.cols());
        debug_assert_eq!(y.len(), batch * w.rows());
        if batch >= GEMM_MIN_BATCH {
            linear_gemm(x, w, bias, y);
        } else {
            linear_rows(x, batch, w, bias, y);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use attention::{KvDType, encode_from_f32};

    use super::*;

    fn check_linear(out: usize, inp: usize, batch: usize) {
        check_linear_in(KvDType::F32, out, inp, batch);
    }

    /// Against a naive product over the weights as stored (widened exactly).
    fn check_linear_in(dtype: KvDType, out: usize, inp: usize, batch: usize) {
        let wv: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
            .collect();
        let mut bytes = vec![0u8; out * inp * dtype.size()];
        encode_from_f32(dtype, &wv, &mut bytes);
        let w = Tensor::from_bytes(vec![out, inp], dtype, bytes);
        let wv = w.to_f32();
        let x: Vec<f32> = (0..batch * inp)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.2)
            .collect();
        let bias: Vec<f32> = (0..out).map(|i| i as f32 * 0.01).collect();
        let mut y = vec![f32::NAN; batch * out];
        CpuBackend
            .linear(&x, batch, &w, Some(&bias), &mut y)
            .unwrap();
        for b in 0..batch {
            for o in 0..out {
                let want: f32 = (0..inp)
                    .map(|i| wv[o * inp + i] * x[b * inp + i])
                    .sum::<f32>()
                    + bias[o];
                let got = y[b * out + o];
                assert!(
                    (got - want).abs() < 1e-4,
                    "{dtype:?} batch {batch}: [{b}][{o}] {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn linear_matches_naive_on_the_row_path() {
        check_linear(37, 19, 3);
        // Head dims the AVX2 tiles take (multiples of 8), every tile remainder of rows and
        // inputs.
        // Weights read as stored (f16, bf16) too.
        for dtype in [KvDType::F32, KvDType::F16, KvDType::Bf16] {
            for batch in 1..=9 {
                check_linear_in(dtype, 37, 64, batch);
            }
        }
        // bf16 rows of a multiple of 8 but not of 16 are read in order, not split; on
        // AVX-512 (from three inputs on), rows of a multiple of 16 but not of 32 too.
        for batch in [1, 2, 5, 8] {
            check_linear_in(KvDType::Bf16, 21, 72, batch);
            check_linear_in(KvDType::Bf16, 21, 80, batch);
        }
    }

    #[test]
    fn linear_matches_naive_on_the_gemm_path() {
        // A batch that is not a multiple of the task tile, and odd shapes.
        check_linear(37, 19, GEMM_MIN_BATCH);
        check_linear(53, 70, GEMM_ROWS_PER_TASK * 2 + 5);
    }
}
