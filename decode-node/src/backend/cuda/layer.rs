//! A decoder layer's second half on the device in one round trip (#21 item 1, first part):
//! the residual and the attention output go up once, the output projection adds into the
//! residual inside its GEMM (beta = 1), RMSNorm, gate and up, SiLU-mul and the down
//! projection (beta = 1 again) run back to back on the stream, and the residual comes back
//! with the step's one wait, where the op-by-op path crosses PCIe and waits three times and
//! adds, norms and multiplies on the host in between.
//!
//! Until it has been compared on this device, it is not trusted: the first call runs both
//! paths and keeps the fused one only when they agree ([`FusedCheck`]).

use std::sync::atomic::{AtomicU8, Ordering};

use attention::KvDType;

use super::blas::{Blas, weight_ptr};
use super::driver::{Shared, dtoh_f32, dtype_code, f32_bytes, htod};
use super::{BackendError, CudaBackend};
use crate::backend::LayerOut;

/// Largest relative difference (to the largest magnitude of the op-by-op result) the fused
/// path may show: both round the same activations to the weights' type, but the norm runs on
/// a different processor, so a value on a rounding edge may round the other way.
pub(super) const FUSED_TOLERANCE: f64 = 1e-2;

/// Whether the fused layer has been checked on this device, and how it went (0: not yet).
#[derive(Debug, Default)]
pub(super) struct FusedCheck(AtomicU8);

const AGREES: u8 = 1;
const DISAGREES: u8 = 2;

impl FusedCheck {
    pub(super) fn state(&self) -> Option<bool> {
        match self.0.load(Ordering::Acquire) {
            AGREES => Some(true),
            DISAGREES => Some(false),
            _ => None,
        }
    }

    pub(super) fn record(&self, agrees: bool) {
        self.0
            .store(if agrees { AGREES } else { DISAGREES }, Ordering::Release);
    }
}

/// Largest `|got - want|` over the largest `|want|` (0 for two empty slices; NaN anywhere
/// gives NaN, which no tolerance accepts).
pub(super) fn rel_diff(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::NAN;
    }
    let scale = want.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
    let mut diff = 0f64;
    for (a, b) in got.iter().zip(want) {
        let d = f64::from(a - b).abs();
        if d.is_nan() {
            return f64::NAN;
        }
        diff = diff.max(d);
    }
    diff / scale.max(1e-30)
}

/// Offsets (in floats) of the fused layer's device buffers, each 64-float aligned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Plan {
    pub(super) x: usize,
    pub(super) attn: usize,
    pub(super) norm: usize,
    pub(super) xn: usize,
    pub(super) gate: usize,
    pub(super) up: usize,
    /// Floats in all.
    pub(super) total: usize,
    /// Floats uploaded at once from the start: residual, attention output, norm weight.
    pub(super) upload: usize,
}

impl Plan {
    /// Buffers for `n` rows of `hidden`, attention width `attn_w`, MLP width `inter`. The
    /// upload is contiguous: x, attn and the norm weight sit back to back.
    pub(super) fn new(n: usize, hidden: usize, attn_w: usize, inter: usize) -> Self {
        let align = |v: usize| v.div_ceil(64) * 64;
        let x = 0;
        let attn = x + n * hidden;
        let norm = attn + n * attn_w;
        let upload = norm + hidden;
        let xn = align(upload);
        let gate = align(xn + n * hidden);
        let up = align(gate + n * inter);
        let total = align(up + n * inter);
        Self {
            x,
            attn,
            norm,
            xn,
            gate,
            up,
            total,
            upload,
        }
    }
}

/// `src` (`n` f32s) as the GEMM input for weights of `dtype`: itself for f32, else converted
/// into `half`.
fn as_input(
    sh: &Shared,
    dtype: KvDType,
    src: u64,
    n: usize,
    half: u64,
) -> Result<u64, BackendError> {
    if dtype == KvDType::F32 {
        return Ok(src);
    }
    let len = n as i64;
    // SAFETY: `src` holds n floats and `half` room for n halves (sized by the caller).
    unsafe {
        sh.launch(
            &sh.k.f32_to_half,
            ((n as u32).div_ceil(256), 1),
            256,
            &[&src, &half, &len, &dtype_code(dtype)],
        )?;
    }
    Ok(half)
}

impl CudaBackend {
    /// [`crate::backend::Backend::finish_layer`] in one round trip (see the module).
    pub(super) fn finish_layer_fused(
        &self,
        x: &mut [f32],
        attn: &[f32],
        n: usize,
        w: &LayerOut<'_>,
    ) -> Result<(), BackendError> {
        let hidden = w.post_norm.len();
        let inter = w.gate.rows();
        let attn_w = attn.len() / n.max(1);
        let shapes_ok = n > 0
            && x.len() == n * hidden
            && attn.len() == n * attn_w
            && (w.o.rows(), w.o.cols()) == (hidden, attn_w)
            && w.gate.cols() == hidden
            && (w.up.rows(), w.up.cols()) == (inter, hidden)
            && (w.down.rows(), w.down.cols()) == (hidden, inter);
        if !shapes_ok {
            return Err(BackendError::Unsupported(format!(
                "layer of {n} rows: residual {} floats, attention {} floats, o {}x{}, gate {}x{}, up {}x{}, down {}x{}, norm {hidden}",
                x.len(),
                attn.len(),
                w.o.rows(),
                w.o.cols(),
                w.gate.rows(),
                w.gate.cols(),
                w.up.rows(),
                w.up.cols(),
                w.down.rows(),
                w.down.cols()
            )));
        }
        let sh = &*self.shared;
        sh.bind()?;
        let mut guard = self.lock()?;
        let g: &mut Blas = &mut guard;
        let p = Plan::new(n, hidden, attn_w, inter);
        let base = g.y.ptr(&sh.stream, p.total * 4)?;
        let at = |floats: usize| base + (floats * 4) as u64;
        let widest = attn_w.max(hidden).max(inter);
        let half = g.xh.ptr(&sh.stream, n * widest * 2)?;
        let (wo, wg, wu, wd) = (
            weight_ptr(g, sh, w.o)?,
            weight_ptr(g, sh, w.gate)?,
            weight_ptr(g, sh, w.up)?,
            weight_ptr(g, sh, w.down)?,
        );
        let stage = g.staging.get(p.upload)?;
        stage[p.x..p.attn].copy_from_slice(x);
        stage[p.attn..p.norm].copy_from_slice(attn);
        stage[p.norm..p.upload].copy_from_slice(w.post_norm);
        htod(base, f32_bytes(&stage[..p.upload]), &sh.stream)?;
        // x += attn · oᵀ
        let a_in = as_input(sh, w.o.dtype, at(p.attn), n * attn_w, half)?;
        // SAFETY (every GEMM and launch below): the ranges are the plan's, sized above for
        // these shapes; weights are cached device copies of the tensors' shapes (checked).
        unsafe { g.gemm_beta(w.o.dtype, hidden, n, attn_w, wo, a_in, at(p.x), 1.0) }?;
        let (xp, np, xnp, dim) = (at(p.x), at(p.norm), at(p.xn), hidden as i32);
        unsafe {
            sh.launch(
                &sh.k.rms_norm,
                (n as u32, 1),
                256,
                &[&xp, &np, &xnp, &dim, &w.eps],
            )?;
        }
        let m_in = as_input(sh, w.gate.dtype, xnp, n * hidden, half)?;
        unsafe { g.gemm(w.gate.dtype, inter, n, hidden, wg, m_in, at(p.gate)) }?;
        // The up projection reads the same rounded input unless its type differs (the stream
        // orders the conversion after the gate GEMM that reads `half`).
        let m_in = if w.up.dtype == w.gate.dtype {
            m_in
        } else {
            as_input(sh, w.up.dtype, xnp, n * hidden, half)?
        };
        unsafe { g.gemm(w.up.dtype, inter, n, hidden, wu, m_in, at(p.up)) }?;
        let (gp, upp, len) = (at(p.gate), at(p.up), (n * inter) as i64);
        unsafe {
            sh.launch(
                &sh.k.silu_mul,
                (((n * inter) as u32).div_ceil(256), 1),
                256,
                &[&gp, &upp, &len],
            )?;
        }
        let d_in = as_input(sh, w.down.dtype, gp, n * inter, half)?;
        unsafe { g.gemm_beta(w.down.dtype, hidden, n, inter, wd, d_in, at(p.x), 1.0) }?;
        let back = &mut g.staging.get(p.upload)?[..n * hidden];
        dtoh_f32(back, at(p.x), &sh.stream)?;
        x.copy_from_slice(back);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_keeps_the_upload_contiguous_and_the_buffers_apart() {
        let p = Plan::new(3, 576, 576, 1536);
        assert_eq!((p.x, p.attn, p.norm, p.upload), (0, 1728, 3456, 4032));
        let ranges = [
            (p.x, p.attn),
            (p.attn, p.norm),
            (p.norm, p.upload),
            (p.xn, p.xn + 3 * 576),
            (p.gate, p.gate + 3 * 1536),
            (p.up, p.up + 3 * 1536),
        ];
        for w in ranges.windows(2) {
            assert!(w[0].1 <= w[1].0, "{ranges:?}");
        }
        assert!(p.up + 3 * 1536 <= p.total);
        for start in [p.xn, p.gate, p.up, p.total] {
            assert_eq!(start % 64, 0);
        }
    }

    #[test]
    fn rel_diff_is_relative_to_the_largest_value_and_refuses_nan() {
        assert_eq!(rel_diff(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((rel_diff(&[1.0, 4.1], &[1.0, 4.0]) - 0.025).abs() < 1e-6);
        assert!(rel_diff(&[f32::NAN, 1.0], &[1.0, 1.0]).is_nan());
        assert!(rel_diff(&[1.0], &[1.0, 2.0]).is_nan());
    }
}
