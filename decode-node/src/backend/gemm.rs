//! A checked, safe face on `matrixmultiply`'s f32 GEMM (runtime-dispatched AVX/FMA
//! micro-kernels), for the batched ops of the CPU backend: a prefill's projections and
//! its causal attention. Strided views let callers multiply rows of interleaved
//! `[token][head][dim]` buffers in place, without gathering them first.

/// A read-only strided f32 matrix: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mat<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

/// A writable strided f32 matrix.
#[derive(Debug)]
pub(crate) struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

/// Panics unless every element of a `rows x cols` view with strides `rs`, `cs` lies in
/// `len` (a caller's shape bug, never input).
fn check(len: usize, rows: usize, cols: usize, rs: usize, cs: usize) {
    if rows > 0 && cols > 0 {
        let last = (rows - 1) * rs + (cols - 1) * cs;
        assert!(
            last < len,
            "gemm view {rows}x{cols} strides ({rs},{cs}) overruns {len}"
        );
    }
}

impl<'a> Mat<'a> {
    /// A view of `data` with the given shape and strides.
    pub(crate) fn new(data: &'a [f32], rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        check(data.len(), rows, cols, rs, cs);
        Self {
            data,
            rows,
            cols,
            rs,
            cs,
        }
    }

    /// A dense row-major `rows x cols` matrix.
    pub(crate) fn rows(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::new(data, rows, cols, cols, 1)
    }

    /// The transpose (no copy).
    pub(crate) fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
}

impl<'a> MatMut<'a> {
    /// A writable view of `data` with the given shape and strides.
    pub(crate) fn new(data: &'a mut [f32], rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        check(data.len(), rows, cols, rs, cs);
        Self {
            data,
            rows,
            cols,
            rs,
            cs,
        }
    }
}

/// `c = alpha * a * b + beta * c` (with `beta == 0`, `c`'s old contents are ignored, NaN
/// included).
pub(crate) fn gemm(alpha: f32, a: Mat<'_>, b: Mat<'_>, beta: f32, c: MatMut<'_>) {
    assert_eq!(a.cols, b.rows, "gemm inner dimensions");
    assert_eq!((a.rows, b.cols), (c.rows, c.cols), "gemm output shape");
    if c.rows == 0 || c.cols == 0 {
        return;
    }
    let as_isize = |v: usize| isize::try_from(v).expect("stride fits isize");
    // SAFETY: `check` proved every element of each view lies inside its slice, `c` is
    // borrowed mutably (so it aliases neither input) and matrixmultiply reads exactly the
    // `m x k`, `k x n` and writes the `m x n` elements addressed by these strides.
    unsafe {
        matrixmultiply::sgemm(
            a.rows,
            a.cols,
            b.cols,
            alpha,
            a.data.as_ptr(),
            as_isize(a.rs),
            as_isize(a.cs),
            b.data.as_ptr(),
            as_isize(b.rs),
            as_isize(b.cs),
            beta,
            c.data.as_mut_ptr(),
            as_isize(c.rs),
            as_isize(c.cs),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 37 + seed * 11) % 29) as f32 - 14.0) * 0.07)
            .collect()
    }

    #[test]
    fn strided_product_equals_the_definition() {
        // a: 5x7 read through a transposed view; b: 7x3 with a row stride wider than its
        // columns; c: 5x3 inside a wider buffer whose other columns must stay untouched.
        let (m, k, n) = (5, 7, 3);
        let at = values(k * m, 1); // stored as [k][m]
        let b = values(k * 4, 2); // [k][4], the 4th column unused
        let mut c = vec![f32::NAN; m * 6];
        gemm(
            1.0,
            Mat::rows(&at, k, m).t(),
            Mat::new(&b, k, n, 4, 1),
            0.0,
            MatMut::new(&mut c[1..], m, n, 6, 1),
        );
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|p| at[p * m + i] * b[p * 4 + j]).sum();
                let got = c[1 + i * 6 + j];
                assert!((got - want).abs() < 1e-5, "({i},{j}) {got} vs {want}");
            }
            assert!(
                c[i * 6].is_nan() && c[i * 6 + 5].is_nan(),
                "row {i} overwritten"
            );
        }
    }

    #[test]
    #[should_panic(expected = "overruns")]
    fn a_view_past_its_slice_is_refused() {
        let v = vec![0f32; 10];
        let _ = Mat::new(&v, 3, 4, 4, 1);
    }
}
