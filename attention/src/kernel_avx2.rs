//! AVX2 + FMA + F16C path of the CPU kernel (x86-64), chosen at run time (with AVX-512 for
//! full 32-token blocks of GQA groups where the CPU has it: `kernel_avx512`).
//!
//! Per block: K^T rows are converted to f32 once into an L1-resident scratch; each query head
//! of the group scores all tokens with four 8-lane accumulators; the softmax uses a vector
//! `exp2` (Taylor to degree 7 on [-0.5, 0.5], error ~1e-8 relative); V rows are converted as
//! they stream and accumulated into up to eight heads held in registers.

use std::arch::x86_64::*;

use crate::block::BlockGeometry;
use crate::dtype::KvDType;

/// True when this CPU can run the path.
pub(crate) fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Loads 8 elements at `p` as f32.
///
/// # Safety
/// `p` must point at 8 readable elements of `dtype`; the CPU must have AVX2 and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8(dtype: KvDType, p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees 8 readable elements at `p`.
    unsafe {
        match dtype {
            KvDType::F32 => _mm256_loadu_ps(p.cast()),
            KvDType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            KvDType::Bf16 => {
                let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
            }
        }
    }
}

/// `2^x` per lane; lanes below -126 give 0 (exact enough: the weight underflows anyway).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp2_ps(x: __m256) -> __m256 {
    let lo = _mm256_set1_ps(-126.0);
    let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, lo);
    let x = _mm256_max_ps(x, lo);
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
    let y = _mm256_mul_ps(_mm256_sub_ps(x, n), _mm256_set1_ps(std::f32::consts::LN_2));
    // e^y for |y| <= 0.347 by Horner.
    let c = |v: f32| _mm256_set1_ps(v);
    let mut p = c(1.0 / 5040.0);
    p = _mm256_fmadd_ps(p, y, c(1.0 / 720.0));
    p = _mm256_fmadd_ps(p, y, c(1.0 / 120.0));
    p = _mm256_fmadd_ps(p, y, c(1.0 / 24.0));
    p = _mm256_fmadd_ps(p, y, c(1.0 / 6.0));
    p = _mm256_fmadd_ps(p, y, c(0.5));
    p = _mm256_fmadd_ps(p, y, c(1.0));
    p = _mm256_fmadd_ps(p, y, c(1.0));
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    let r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    _mm256_andnot_ps(tiny, r)
}

#[inline]
#[target_feature(enable = "avx2")]
fn hmax(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
    _mm_cvtss_f32(m)
}

#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// Running softmax state of a group over the blocks seen so far.
pub(crate) struct State<'a> {
    /// `[G][D]` unnormalised output.
    pub(crate) acc: &'a mut [f32],
    /// `[G]` running max (base 2).
    pub(crate) m: &'a mut [f32],
    /// `[G]` running denominator.
    pub(crate) l: &'a mut [f32],
    /// `[D][B]` f32 keys of the current block.
    pub(crate) kf: &'a mut [f32],
    /// `[G][B]` scores, then weights.
    pub(crate) s: &'a mut [f32],
}

/// Folds one block (`len` tokens) into `st`. `qs` is the pre-scaled `[G][D]` query.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]); `bytes` must hold a whole head
/// block of `geom`; `geom.block_size` and `geom.head_dim` must be multiples of 8.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn block(
    geom: &BlockGeometry,
    qs: &[f32],
    bytes: &[u8],
    len: usize,
    st: &mut State<'_>,
) {
    let (b, d, es, dt) = (
        geom.block_size,
        geom.head_dim,
        geom.dtype.size(),
        geom.dtype,
    );
    let g = qs.len() / d;
    debug_assert!(b % 8 == 0 && d % 8 == 0 && bytes.len() >= 2 * b * d * es);
    let nv = len.div_ceil(8);
    let (kt, vs) = bytes.split_at(b * d * es);
    // Full 32-token blocks score straight from the stored keys (no f32 copy to spill L1);
    // other shapes convert K^T rows to f32 once, only the vectors that hold valid tokens.
    let direct = b == 32 && len == 32;
    // AVX-512 keeps a whole group of 2..8 heads in registers (each K and V element converted
    // once per group); its availability is cached by the detection macro.
    let wide = direct && (2..=8).contains(&g) && crate::kernel_avx512::available();
    if direct {
        // SAFETY: forwarded from this function's contract; `s` holds G x 32 scores; `wide`
        // checked the CPU.
        let done = wide && unsafe { crate::kernel_avx512::scores_dyn(g, dt, kt, qs, d, st.s) };
        if !done {
            // SAFETY: as above.
            unsafe { scores_direct(dt, kt, qs, d, g, st.s) };
        }
    } else {
        for c in 0..d {
            for j in 0..nv {
                // SAFETY: (c*b + 8j + 8) <= d*b elements lie inside `kt`.
                let v = unsafe { load8(dt, kt.as_ptr().add((c * b + 8 * j) * es)) };
                // SAFETY: kf has d*b elements.
                unsafe { _mm256_storeu_ps(st.kf.as_mut_ptr().add(c * b + 8 * j), v) };
            }
        }
    }
    let neg = _mm256_set1_ps(f32::NEG_INFINITY);
    for h in 0..g {
        let q = &qs[h * d..(h + 1) * d];
        let sh = &mut st.s[h * b..h * b + nv * 8];
        let mut t0 = if direct { nv } else { 0 };
        // Full 32-token groups: eight independent FMA chains (two per vector, even and odd
        // channels) keep both FMA ports busy despite the 4-cycle latency.
        while nv - t0 >= 4 {
            let mut e = [_mm256_setzero_ps(); 4];
            let mut o = [_mm256_setzero_ps(); 4];
            let base = st.kf.as_ptr();
            let mut c = 0;
            while c + 1 < d {
                let qe = _mm256_set1_ps(q[c]);
                let qo = _mm256_set1_ps(q[c + 1]);
                for j in 0..4 {
                    // SAFETY: (c+1)*b + 8*(t0+j) + 8 <= d*b.
                    unsafe {
                        e[j] = _mm256_fmadd_ps(
                            qe,
                            _mm256_loadu_ps(base.add(c * b + 8 * (t0 + j))),
                            e[j],
                        );
                        o[j] = _mm256_fmadd_ps(
                            qo,
                            _mm256_loadu_ps(base.add((c + 1) * b + 8 * (t0 + j))),
                            o[j],
                        );
                    }
                }
                c += 2;
            }
            for j in 0..4 {
                // SAFETY: sh has nv*8 elements.
                unsafe {
                    _mm256_storeu_ps(sh.as_mut_ptr().add(8 * (t0 + j)), _mm256_add_ps(e[j], o[j]))
                };
            }
            t0 += 4;
        }
        while t0 < nv {
            let mut acc = _mm256_setzero_ps();
            for (c, qc) in q.iter().enumerate() {
                // SAFETY: c*b + 8*t0 + 8 <= d*b.
                let k = unsafe { _mm256_loadu_ps(st.kf.as_ptr().add(c * b + 8 * t0)) };
                acc = _mm256_fmadd_ps(_mm256_set1_ps(*qc), k, acc);
            }
            // SAFETY: sh has nv*8 elements.
            unsafe { _mm256_storeu_ps(sh.as_mut_ptr().add(8 * t0), acc) };
            t0 += 1;
        }
        // Mask the tail of a partly filled block (its slots may hold stale bytes).
        let lane = _mm256_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0);
        let mut vmax = neg;
        for j in 0..nv {
            // SAFETY: in bounds of sh.
            let mut v = unsafe { _mm256_loadu_ps(sh.as_ptr().add(8 * j)) };
            let idx = _mm256_add_ps(lane, _mm256_set1_ps((8 * j) as f32));
            let valid = _mm256_cmp_ps::<_CMP_LT_OQ>(idx, _mm256_set1_ps(len as f32));
            v = _mm256_blendv_ps(neg, v, valid);
            // SAFETY: in bounds of sh.
            unsafe { _mm256_storeu_ps(sh.as_mut_ptr().add(8 * j), v) };
            vmax = _mm256_max_ps(vmax, v);
        }
        let m_new = st.m[h].max(hmax(vmax));
        if m_new == f32::NEG_INFINITY {
            sh.fill(0.0);
            continue;
        }
        let alpha = (st.m[h] - m_new).exp2();
        let mb = _mm256_set1_ps(m_new);
        let mut vsum = _mm256_setzero_ps();
        for j in 0..nv {
            // SAFETY: in bounds of sh.
            let v = unsafe { _mm256_loadu_ps(sh.as_ptr().add(8 * j)) };
            let p = exp2_ps(_mm256_sub_ps(v, mb));
            vsum = _mm256_add_ps(vsum, p);
            // SAFETY: in bounds of sh.
            unsafe { _mm256_storeu_ps(sh.as_mut_ptr().add(8 * j), p) };
        }
        st.l[h] = st.l[h] * alpha + hsum(vsum);
        st.m[h] = m_new;
        if alpha != 1.0 {
            for a in &mut st.acc[h * d..(h + 1) * d] {
                *a *= alpha;
            }
        }
    }
    // SAFETY: `wide` checked the CPU; a full block of 32 tokens; `s` is [G][b], acc [G][d].
    if wide && unsafe { crate::kernel_avx512::accumulate_v_dyn(g, dt, vs, d, st.s, b, st.acc) } {
        return;
    }
    // V: up to four heads' accumulators (two 8-wide slices each) live in registers.
    let mut h0 = 0;
    while h0 < g {
        let n = match g - h0 {
            r if r >= 4 => 4,
            r if r >= 2 => 2,
            _ => 1,
        };
        // SAFETY: forwarded from this function's contract; heads h0..h0+n exist.
        unsafe {
            match n {
                4 => accumulate_v::<4, 2>(dt, vs, len, b, d, h0, st),
                2 => accumulate_v::<2, 4>(dt, vs, len, b, d, h0, st),
                _ => accumulate_v::<1, 4>(dt, vs, len, b, d, h0, st),
            }
        }
        h0 += n;
    }
}

/// Scores of a full 32-token block for every query head: two heads at a time share each
/// converted K row (eight FMA chains); a lone head splits its channels even/odd instead.
///
/// # Safety
/// As [`block`], with `block_size == 32`; `s` holds at least `g * 32` elements.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_direct(dt: KvDType, kt: &[u8], qs: &[f32], d: usize, g: usize, s: &mut [f32]) {
    let es = dt.size();
    let row = |c: usize| -> [__m256; 4] {
        // SAFETY: c < d rows of 32 elements lie inside `kt` (the caller's contract).
        unsafe {
            let p = kt.as_ptr().add(c * 32 * es);
            [
                load8(dt, p),
                load8(dt, p.add(8 * es)),
                load8(dt, p.add(16 * es)),
                load8(dt, p.add(24 * es)),
            ]
        }
    };
    let mut h = 0;
    while h < g {
        let mut a = [_mm256_setzero_ps(); 4];
        let mut b = [_mm256_setzero_ps(); 4];
        let pair = h + 1 < g;
        if pair {
            let (qa, qb) = (&qs[h * d..(h + 1) * d], &qs[(h + 1) * d..(h + 2) * d]);
            for c in 0..d {
                let k = row(c);
                let (x, y) = (_mm256_set1_ps(qa[c]), _mm256_set1_ps(qb[c]));
                for j in 0..4 {
                    a[j] = _mm256_fmadd_ps(x, k[j], a[j]);
                    b[j] = _mm256_fmadd_ps(y, k[j], b[j]);
                }
            }
        } else {
            let q = &qs[h * d..(h + 1) * d];
            let mut c = 0;
            while c + 1 < d {
                let (ke, ko) = (row(c), row(c + 1));
                let (x, y) = (_mm256_set1_ps(q[c]), _mm256_set1_ps(q[c + 1]));
                for j in 0..4 {
                    a[j] = _mm256_fmadd_ps(x, ke[j], a[j]);
                    b[j] = _mm256_fmadd_ps(y, ko[j], b[j]);
                }
                c += 2;
            }
            for j in 0..4 {
                a[j] = _mm256_add_ps(a[j], b[j]);
            }
        }
        for j in 0..4 {
            // SAFETY: s holds g*32 elements.
            unsafe { _mm256_storeu_ps(s.as_mut_ptr().add(h * 32 + 8 * j), a[j]) };
            if pair {
                // SAFETY: as above, head h+1 < g.
                unsafe { _mm256_storeu_ps(s.as_mut_ptr().add((h + 1) * 32 + 8 * j), b[j]) };
            }
        }
        h += if pair { 2 } else { 1 };
    }
}

/// `acc[h0+i] += sum_t s[h0+i][t] * V[t]` for `N` heads, `W` vectors of the head dim at a
/// time (N*W independent accumulator chains; the tail of the head dim goes 8 wide).
///
/// # Safety
/// As [`block`].
// Indexed loops over constant bounds keep the accumulator arrays in registers.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate_v<const N: usize, const W: usize>(
    dt: KvDType,
    vs: &[u8],
    len: usize,
    b: usize,
    d: usize,
    h0: usize,
    st: &mut State<'_>,
) {
    // Constant trip counts only, so every accumulator stays in a register.
    if !d.is_multiple_of(8 * W) {
        // SAFETY: forwarded; W = 1 divides any head dim that is a multiple of 8.
        return unsafe { accumulate_v::<N, 1>(dt, vs, len, b, d, h0, st) };
    }
    let es = dt.size();
    let (acc_ptr, s) = (st.acc.as_mut_ptr(), &st.s[h0 * b..(h0 + N) * b]);
    for c0 in (0..d).step_by(8 * W) {
        let mut acc = [[_mm256_setzero_ps(); W]; N];
        for i in 0..N {
            for j in 0..W {
                // SAFETY: (h0+i)*d + c0 + 8j + 8 <= G*d.
                acc[i][j] = unsafe { _mm256_loadu_ps(acc_ptr.add((h0 + i) * d + c0 + 8 * j)) };
            }
        }
        for t in 0..len {
            let mut v = [_mm256_setzero_ps(); W];
            for j in 0..W {
                // SAFETY: t < len <= b rows of d elements; c0 + 8j + 8 <= d.
                v[j] = unsafe { load8(dt, vs.as_ptr().add((t * d + c0 + 8 * j) * es)) };
            }
            for i in 0..N {
                let p = _mm256_set1_ps(s[i * b + t]);
                for j in 0..W {
                    acc[i][j] = _mm256_fmadd_ps(p, v[j], acc[i][j]);
                }
            }
        }
        for i in 0..N {
            for j in 0..W {
                // SAFETY: as the load above.
                unsafe { _mm256_storeu_ps(acc_ptr.add((h0 + i) * d + c0 + 8 * j), acc[i][j]) };
            }
        }
    }
}
