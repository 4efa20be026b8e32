//! The CPU backend: what CI tests, and the model executor wherever no device is given.
//!
//! A projection of a few rows (a decode step) is memory-bound: each task runs every input
//! against a slice of weight rows, read as stored and widened in registers (AVX2; elsewhere
//! widened to f32 once per task). Projections of one input (q/k/v, gate/up) share one
//! parallel region, and gate/up leave only `silu(gate) * up`: a step of a small model is
//! otherwise a few hundred wake-ups and joins. A projection of many rows (a
//! prefill) is compute-bound: the weight is widened once and multiplied with a blocked GEMM,
//! tiles of inputs in parallel.

use rayon::prelude::*;
use smallvec::SmallVec;

#[cfg(target_arch = "x86_64")]
mod rows_avx2;
#[cfg(target_arch = "x86_64")]
mod rows_avx512;

use super::gemm::{Mat, MatMut, gemm};
use super::team;
use super::{Backend, BackendError, LinearOut};
use crate::tensor::Tensor;

/// The CPU backend: rayon across output rows (few inputs) or input tiles (many).
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

/// Output rows per rayon task on the row path: large enough to amortise scheduling, small
/// enough to balance; a multiple of every tile height (4 rows at batch 1-2, 2 on AVX2, 3 on
/// AVX-512), so no task ends in a short tile.
const ROWS_PER_TASK: usize = 24;

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

/// How far ahead of each weight row stream the row path asks for lines, into L2. A decode
/// step reads each weight once, in short rows (a 576-wide bf16 row is 18 lines), too short a
/// stream for the hardware prefetchers to ramp up. Measured on SmolLM2 (2-core EPYC, batch 1):
/// the next tile's rows into L1 (the old distance, ~4.6 KiB) streamed 14 GB/s; 16 KiB into L2
/// 20-25 GB/s (read bandwidth 30); 4 and 8 KiB were between; 32 KiB no better. Into L2
/// because L1's few miss buffers cap the lines in flight; the demand load then finds the line
/// in L2, and the loop's FMAs hide that.
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 16 << 10;

/// Asks for the line at `p` into L2. A prefetch never faults, so `p` may lie past the weights
/// (the callers form it with `wrapping_add`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_l2(p: *const u8) {
    // SAFETY: a prefetch reads nothing the program sees and never faults.
    unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p.cast()) }
}

/// The SIMD path whose FMA rate bounds the row path at `batch` inputs: AVX2's 8 lanes below
/// [`AVX512_MIN_BATCH`] on x86-64, the widest this CPU has from there (what `bench decode`
/// measures its roofline with).
pub(crate) fn row_fma_path(batch: usize) -> attention::KernelPath {
    #[cfg(target_arch = "x86_64")]
    if batch < AVX512_MIN_BATCH {
        return attention::KernelPath::Avx2;
    }
    let _ = batch;
    attention::KernelPath::Scalar
}

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

/// The inner loop a projection of few inputs runs its weight rows through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RowKernel {
    /// AVX-512 tiles of the stored dtype (x86-64, from [`AVX512_MIN_BATCH`] inputs).
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// AVX2 + FMA + F16C tiles of the stored dtype (x86-64).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// Rows widened to f32 into a scratch, then plain dot products.
    Widen,
}

/// One projection on the row path: its weight, bias, inner loop and the inputs in the order
/// that loop reads them.
struct RowJob<'a> {
    w: &'a Tensor,
    bias: Option<&'a [f32]>,
    kernel: RowKernel,
    x: &'a [f32],
}

/// A projection group's inputs, with the even/odd orders the bf16 row loops read made once
/// for every projection that wants them (q, k and v share one input).
struct RowInputs<'a> {
    x: &'a [f32],
    #[cfg(target_arch = "x86_64")]
    split16: std::cell::OnceCell<Vec<f32>>,
    #[cfg(target_arch = "x86_64")]
    split32: std::cell::OnceCell<Vec<f32>>,
}

impl<'a> RowInputs<'a> {
    fn new(x: &'a [f32]) -> Self {
        Self {
            x,
            #[cfg(target_arch = "x86_64")]
            split16: Default::default(),
            #[cfg(target_arch = "x86_64")]
            split32: Default::default(),
        }
    }

    /// The inputs in split order by `chunk` (16 or 32), or as given.
    #[cfg(target_arch = "x86_64")]
    fn in_order(&self, split: Option<usize>, inp: usize) -> &[f32] {
        let (cell, chunk) = match split {
            None => return self.x,
            Some(16) => (&self.split16, 16),
            Some(chunk) => (&self.split32, chunk),
        };
        debug_assert!(chunk == 16 || chunk == 32);
        cell.get_or_init(|| rows_avx2::split_order(self.x, inp, chunk))
    }
}

impl<'a> RowJob<'a> {
    fn new(x: &'a RowInputs<'a>, batch: usize, w: &'a Tensor, bias: Option<&'a [f32]>) -> Self {
        let inp = w.cols();
        let direct = direct_rows(inp, w.dtype);
        #[cfg(target_arch = "x86_64")]
        let (kernel, x) = {
            let wide = direct
                && batch >= AVX512_MIN_BATCH
                && inp.is_multiple_of(16)
                && rows_avx512::available();
            let (kernel, split) = if wide {
                (
                    RowKernel::Avx512,
                    rows_avx512::reads_split(w.dtype, inp).then_some(32),
                )
            } else if direct {
                (
                    RowKernel::Avx2,
                    rows_avx2::reads_split(w.dtype, inp).then_some(16),
                )
            } else {
                (RowKernel::Widen, None)
            };
            (kernel, x.in_order(split, inp))
        };
        #[cfg(not(target_arch = "x86_64"))]
        let (kernel, x) = {
            let _ = (batch, direct);
            (RowKernel::Widen, x.x)
        };
        Self { w, bias, kernel, x }
    }

    /// Rows `r0..r0 + n` against every input, into `chunk` (`[n][batch]`); `rows` is the
    /// task's scratch for widened rows.
    fn run(&self, r0: usize, batch: usize, chunk: &mut [f32], rows: &mut Vec<f32>) {
        let (w, inp) = (self.w, self.w.cols());
        let n = chunk.len() / batch;
        match self.kernel {
            #[cfg(target_arch = "x86_64")]
            RowKernel::Avx512 | RowKernel::Avx2 => {
                let row_bytes = inp * w.dtype.size();
                let bytes = &w.bytes()[r0 * row_bytes..(r0 + n) * row_bytes];
                // SAFETY: `RowJob::new` checked the CPU and that `inp` is a multiple of 8
                // (AVX-512: and of 16); `bytes` holds `n` rows, `x` `batch` inputs and
                // `chunk` `n * batch` outputs.
                unsafe {
                    if self.kernel == RowKernel::Avx512 {
                        rows_avx512::rows_times_inputs(w.dtype, bytes, n, self.x, batch, inp, chunk)
                    } else {
                        rows_avx2::rows_times_inputs(w.dtype, bytes, n, self.x, batch, inp, chunk)
                    }
                };
            }
            RowKernel::Widen => {
                rows.resize(n * inp, 0.0);
                for (ri, row) in rows.chunks_exact_mut(inp).enumerate() {
                    w.row_f32(r0 + ri, row);
                }
                rows_times_inputs(rows, n, self.x, batch, inp, chunk);
            }
        }
        if let Some(b) = self.bias {
            for (ri, c) in chunk.chunks_exact_mut(batch).enumerate() {
                c.iter_mut().for_each(|v| *v += b[r0 + ri]);
            }
        }
    }
}

/// `y = x · wᵀ + bias` for every projection of `outs`, one weight row at a time (few
/// inputs), as ONE parallel region over all their rows: a decode step of a small model has
/// a few hundred such projections, and each region costs a start and a join. Tasks are
/// indices into the projections' rows, not a list built before the region: building one
/// (2048 tasks for SmolLM2's LM head alone) was ~4% of a batch-1 step, serial on the step
/// thread (perf).
fn linear_rows(x: &[f32], batch: usize, outs: &mut [LinearOut<'_>]) {
    let inputs = RowInputs::new(x);
    let mut first = 0;
    let jobs: SmallVec<[(RowJob<'_>, RowsOut<'_>, usize); 4]> = outs
        .iter_mut()
        .map(|o| {
            let rows = o.w.rows();
            let job = (
                RowJob::new(&inputs, batch, o.w, o.bias),
                RowsOut::new(o.y, rows, batch),
                first,
            );
            first += rows.div_ceil(ROWS_PER_TASK);
            job
        })
        .collect();
    team::for_each(first, &|t| {
        // The last projection whose first task is at or before `t` (one with no rows
        // shares its first task with the next).
        let Some((job, out, first)) = jobs.iter().rev().find(|(_, _, first)| *first <= t) else {
            return;
        };
        let r0 = (t - first) * ROWS_PER_TASK;
        let n = ROWS_PER_TASK.min(job.w.rows() - r0);
        // SAFETY: task `t` is the only one given rows `r0..r0 + n` of this projection.
        unsafe { out.fill(r0, n, |chunk, rows| job.run(r0, batch, chunk, rows)) };
    });
}

/// A projection's output `y` (`[batch][out]`) that a region's tasks write, each its own rows.
/// A task computes its rows `[n][batch]` (the order the row loops write) and puts each value
/// in place, so no pass over `y` runs on one thread after the region. It holds `y`'s borrow
/// for as long as it lives.
struct RowsOut<'y> {
    y: *mut f32,
    out: usize,
    batch: usize,
    _y: std::marker::PhantomData<&'y mut [f32]>,
}

// SAFETY: tasks write disjoint rows of `y` (see `fill`), which it borrows.
unsafe impl Send for RowsOut<'_> {}
// SAFETY: as above.
unsafe impl Sync for RowsOut<'_> {}

/// A task's scratch: its rows' outputs `[n][batch]`, a second output (GLU) and widened rows.
/// One per thread: a step's regions reuse it (a fresh one per task was malloc and free in
/// the profile).
#[derive(Default)]
struct RowScratch {
    out: Vec<f32>,
    other: Vec<f32>,
    rows: Vec<f32>,
}

thread_local! {
    static ROW_SCRATCH: std::cell::RefCell<RowScratch> = std::cell::RefCell::default();
}

impl<'y> RowsOut<'y> {
    fn new(y: &'y mut [f32], out: usize, batch: usize) -> Self {
        assert!(
            y.len() >= out * batch,
            "output of {} for {batch} x {out}",
            y.len()
        );
        Self {
            y: y.as_mut_ptr(),
            out,
            batch,
            _y: std::marker::PhantomData,
        }
    }

    /// Runs `compute` (given `[n][batch]` and the thread's widened-rows scratch) for rows
    /// `r0..r0 + n` and writes them to `y`: with one input, straight into place.
    ///
    /// # Safety
    /// `r0 + n <= out`, and no other task writes rows `r0..r0 + n` while this runs.
    unsafe fn fill(&self, r0: usize, n: usize, compute: impl FnOnce(&mut [f32], &mut Vec<f32>)) {
        debug_assert!(r0 + n <= self.out);
        if n == 0 || self.batch == 0 {
            return;
        }
        ROW_SCRATCH.with_borrow_mut(|scratch| {
            if self.batch == 1 {
                // SAFETY: rows r0..r0 + n of the one input are in `y` and this task's alone.
                let dst = unsafe { std::slice::from_raw_parts_mut(self.y.add(r0), n) };
                return compute(dst, &mut scratch.rows);
            }
            let mut out = std::mem::take(&mut scratch.out);
            out.resize(n * self.batch, 0.0);
            compute(&mut out, &mut scratch.rows);
            for b in 0..self.batch {
                // SAFETY: as above, for input `b`'s rows.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(self.y.add(b * self.out + r0), n) };
                for (r, v) in dst.iter_mut().enumerate() {
                    *v = out[r * self.batch + b];
                }
            }
            scratch.out = out;
        })
    }
}

/// `y = silu(x · gateᵀ) * (x · upᵀ)` on the row path, in one parallel region: each task
/// runs the same rows of both weights and writes only their product.
fn glu_rows(x: &[f32], batch: usize, gate: &Tensor, up: &Tensor, y: &mut [f32]) {
    let inputs = RowInputs::new(x);
    let (g, u) = (
        RowJob::new(&inputs, batch, gate, None),
        RowJob::new(&inputs, batch, up, None),
    );
    let rows = gate.rows();
    let out = RowsOut::new(y, rows, batch);
    team::for_each(rows.div_ceil(ROWS_PER_TASK), &|t| {
        let r0 = t * ROWS_PER_TASK;
        let n = ROWS_PER_TASK.min(rows - r0);
        let mut ups = ROW_SCRATCH.with_borrow_mut(|s| std::mem::take(&mut s.other));
        // SAFETY: task `t` is the only one given rows `r0..r0 + n`.
        unsafe {
            out.fill(r0, n, |chunk, widened| {
                g.run(r0, batch, chunk, widened);
                ups.resize(chunk.len(), 0.0);
                u.run(r0, batch, &mut ups, widened);
                chunk
                    .iter_mut()
                    .zip(ups.iter())
                    .for_each(|(a, b)| *a = super::silu_times(*a, *b));
            })
        };
        ROW_SCRATCH.with_borrow_mut(|s| s.other = ups);
    });
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

    fn streams_host_weights(&self) -> bool {
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
        self.linear_many(x, batch, &mut [LinearOut { w, bias, y }])
    }

    fn linear_many(
        &self,
        x: &[f32],
        batch: usize,
        outs: &mut [LinearOut<'_>],
    ) -> Result<(), BackendError> {
        for o in outs.iter() {
            debug_assert_eq!(x.len(), batch * o.w.cols());
            debug_assert_eq!(o.y.len(), batch * o.w.rows());
        }
        if batch >= GEMM_MIN_BATCH {
            for o in outs.iter_mut() {
                linear_gemm(x, o.w, o.bias, o.y);
            }
        } else {
            linear_rows(x, batch, outs);
        }
        Ok(())
    }

    fn linear_glu(
        &self,
        x: &[f32],
        batch: usize,
        gate: &Tensor,
        up: &Tensor,
        y: &mut [f32],
    ) -> Result<(), BackendError> {
        debug_assert_eq!((gate.rows(), gate.cols()), (up.rows(), up.cols()));
        debug_assert_eq!(y.len(), batch * gate.rows());
        if batch >= GEMM_MIN_BATCH {
            super::glu_unfused(self, x, batch, gate, up, y)?;
        } else {
            glu_rows(x, batch, gate, up, y);
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

    /// An empty batch is a no-op on both row paths (no chunk of zero width, no division by it).
    #[test]
    fn empty_batch_is_a_no_op() {
        let w = Tensor::from_bytes(vec![3, 8], KvDType::F32, vec![0u8; 3 * 8 * 4]);
        CpuBackend.linear(&[], 0, &w, None, &mut []).unwrap();
        CpuBackend.linear_glu(&[], 0, &w, &w, &mut []).unwrap();
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
        // Tasks ending in each tile height (24 + 14 rows: 3-row tiles end in a 2-row one).
        for batch in [3, 8] {
            for dtype in [KvDType::F16, KvDType::Bf16] {
                check_linear_in(dtype, 38, 64, batch);
            }
        }
    }

    fn ramp(n: usize, dtype: KvDType, seed: usize) -> Tensor {
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * seed % 17) as f32 - 8.0) * 0.05)
            .collect();
        let mut bytes = vec![0u8; n * dtype.size()];
        encode_from_f32(dtype, &v, &mut bytes);
        Tensor::from_bytes(vec![n / 64, 64], dtype, bytes)
    }

    /// One region over several projections (rows of different counts, dtypes and biases)
    /// gives what each alone gives, bit for bit; so does the fused gate/up.
    #[test]
    fn linear_many_and_glu_equal_separate_projections() {
        for batch in [1, 2, 3, 8, GEMM_MIN_BATCH] {
            let x: Vec<f32> = (0..batch * 64)
                .map(|i| ((i % 23) as f32 - 11.0) * 0.1)
                .collect();
            let ws = [
                ramp(37 * 64, KvDType::Bf16, 7),
                ramp(5 * 64, KvDType::F16, 5),
                ramp(33 * 64, KvDType::F32, 3),
            ];
            let bias: Vec<f32> = (0..37).map(|i| i as f32 * 0.01).collect();
            let alone: Vec<Vec<f32>> = ws
                .iter()
                .enumerate()
                .map(|(j, w)| {
                    let mut y = vec![0f32; batch * w.rows()];
                    let b = (j == 0).then_some(&bias[..]);
                    CpuBackend.linear(&x, batch, w, b, &mut y).unwrap();
                    y
                })
                .collect();
            let mut ys: Vec<Vec<f32>> = ws
                .iter()
                .map(|w| vec![f32::NAN; batch * w.rows()])
                .collect();
            let mut outs: Vec<LinearOut<'_>> = ws
                .iter()
                .zip(ys.iter_mut())
                .enumerate()
                .map(|(j, (w, y))| LinearOut {
                    w,
                    bias: (j == 0).then_some(&bias[..]),
                    y,
                })
                .collect();
            CpuBackend.linear_many(&x, batch, &mut outs).unwrap();
            assert_eq!(ys, alone, "batch {batch}");

            let (gate, up) = (
                ramp(37 * 64, KvDType::Bf16, 7),
                ramp(37 * 64, KvDType::Bf16, 11),
            );
            let mut want = vec![0f32; batch * 37];
            let mut u = vec![0f32; batch * 37];
            CpuBackend
                .linear(&x, batch, &gate, None, &mut want)
                .unwrap();
            CpuBackend.linear(&x, batch, &up, None, &mut u).unwrap();
            CpuBackend.silu_mul(&mut want, &u);
            let mut got = vec![f32::NAN; batch * 37];
            CpuBackend
                .linear_glu(&x, batch, &gate, &up, &mut got)
                .unwrap();
            assert_eq!(got, want, "glu, batch {batch}");
        }
    }

    #[test]
    fn linear_matches_naive_on_the_gemm_path() {
        // A batch that is not a multiple of the task tile, and odd shapes.
        check_linear(37, 19, GEMM_MIN_BATCH);
        check_linear(53, 70, GEMM_ROWS_PER_TASK * 2 + 5);
    }
}
