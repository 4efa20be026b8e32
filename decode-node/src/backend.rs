//! The `Backend`: every dense op of the model executor, on one device, and (for a real
//! device) the device side of attention: hot KV blocks in device memory.
//!
//! The CPU backend is what CI tests; its "device" part of attention reads the host pool
//! directly. The CUDA backend (cudarc, dynamic loading, behind the `cuda` feature) runs the
//! projections with cuBLAS and keeps resident blocks in GPU memory ([`DeviceKv`]). Planning
//! (which blocks, which side) lives in the `attention` crate, driven by the engine.

#[cfg(feature = "cuda")]
pub mod cuda;

use std::sync::Arc;

use attention::{BlockGeometry, KvSource, Partial};
use kv_transfer::HostPool;
use rayon::prelude::*;

use crate::model::weights::Tensor;

/// Why a backend op failed (only device backends fail).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The device or one of its libraries returned an error.
    #[error("device error: {0}")]
    Device(String),
    /// Device memory for resident KV blocks is exhausted.
    #[error("device KV memory is full: {0}")]
    DeviceFull(String),
    /// A shape the device kernels do not support.
    #[error("unsupported on this device: {0}")]
    Unsupported(String),
}

/// One projection of [`Backend::linear_many`]: `y = x · wᵀ + bias`.
#[derive(Debug)]
pub struct LinearOut<'a> {
    /// Weight `[out][in]`.
    pub w: &'a Tensor,
    /// Optional bias `[out]`.
    pub bias: Option<&'a [f32]>,
    /// Output `[batch][out]`.
    pub y: &'a mut [f32],
}

/// Device memory for hot KV blocks, shared by every sequence of the engine.
pub trait DeviceKv: Send + Sync + std::fmt::Debug {
    /// Per-sequence device state holding at most `blocks_per_head` blocks per (layer, KV
    /// head); dropping it frees the sequence's device blocks.
    fn new_seq(self: Arc<Self>, num_layers: usize, blocks_per_head: usize) -> Box<dyn DeviceSeq>;
}

/// The device side of one sequence's attention.
pub trait DeviceSeq: Send + std::fmt::Debug {
    /// The device part of `layer`: for each KV head `h`, attends `blocks[h]` of `kv` with the
    /// query group `q[h]` (`q` is `[num_kv_heads][G][head_dim]`). Blocks not on the device,
    /// or with tokens added since they were copied, are copied from `kv` first.
    fn attend(
        &mut self,
        kv: &dyn KvSource,
        layer: usize,
        blocks: &[&[usize]],
        q: &[f32],
        scale: f32,
    ) -> Result<Vec<Partial>, BackendError>;
    /// Starts copying, for each KV head `h`, `blocks[h]` of `layer` to the device on the
    /// recall stream (one batch); they are ready for the next [`DeviceSeq::attend`] of
    /// `layer`, which orders after the copies on the device without waiting on the host.
    fn recall(
        &mut self,
        kv: &dyn KvSource,
        layer: usize,
        blocks: &[&[usize]],
    ) -> Result<(), BackendError>;
}

/// Dense ops of the executor. Activations are f32, row-major `[batch][features]`.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// A short name for logs and metrics (`cpu`, `cuda:0`).
    fn name(&self) -> String;

    /// `y[b][o] = sum_i x[b][i] * w[o][i] + bias[o]` for `w` of shape `[out][in]`; reads each
    /// weight once for the whole batch.
    fn linear(
        &self,
        x: &[f32],
        batch: usize,
        w: &Tensor,
        bias: Option<&[f32]>,
        y: &mut [f32],
    ) -> Result<(), BackendError>;

    /// Makes `w` ready for [`Backend::linear`] ahead of the first step (a device backend
    /// uploads it now rather than inside a request's first token).
    fn prepare(&self, _w: &Tensor) -> Result<(), BackendError> {
        Ok(())
    }

    /// Several projections of the same input (q/k/v, gate/up): a device backend uploads `x`
    /// once and waits once.
    fn linear_many(
        &self,
        x: &[f32],
        batch: usize,
        outs: &mut [LinearOut<'_>],
    ) -> Result<(), BackendError> {
        for o in outs.iter_mut() {
            self.linear(x, batch, o.w, o.bias, o.y)?;
        }
        Ok(())
    }

    /// Bytes per second the device's memory moves (a copy's read plus write), measured now;
    /// `None` for the CPU backend, whose bound the benches measure themselves.
    fn memory_bandwidth(&self) -> Option<f64> {
        None
    }

    /// Device memory for resident KV blocks of `geom`, `capacity_bytes` of it, with `pool`
    /// page-locked for asynchronous copies. `None`: the backend has no separate device memory
    /// (the CPU backend attends the host pool directly).
    fn device_kv(
        &self,
        _geom: BlockGeometry,
        _capacity_bytes: u64,
        _pool: &HostPool,
    ) -> Result<Option<Arc<dyn DeviceKv>>, BackendError> {
        Ok(None)
    }

    /// RMSNorm of each `w.len()`-sized row of `x` into `out`, as HF computes it in f32.
    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let d = w.len();
        for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for ((o, v), g) in or.iter_mut().zip(xr).zip(w) {
                *o = g * (v * inv);
            }
        }
    }

    /// `gate[i] = silu(gate[i]) * up[i]`.
    fn silu_mul(&self, gate: &mut [f32], up: &[f32]) {
        for (g, u) in gate.iter_mut().zip(up) {
            *g = *g / (1.0 + (-*g).exp()) * u;
        }
    }
}

/// The CPU backend: rayon across output rows, f32 accumulation.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

/// Output rows per rayon task: large enough to amortise scheduling, small enough to balance.
const ROWS_PER_TASK: usize = 16;

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

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn linear(
        &self,
        x: &[f32],
        batch: usize,
        w: &Tensor,
        bias: Option<&[f32]>,
        y: &mut [f32],
    ) -> Result<(), BackendError> {
        let (out, inp) = (w.rows(), w.cols());
        debug_assert_eq!(x.len(), batch * inp);
        debug_assert_eq!(y.len(), batch * out);
        // Computed transposed ([out][batch]) so each task owns a contiguous slice. A task
        // widens its rows to f32 once, then runs every input against them: the rows stay in
        // cache while the batch streams by (a prefill of thousands of tokens would otherwise
        // reread its whole input once per weight row).
        let mut yt = vec![0f32; out * batch];
        yt.par_chunks_mut(ROWS_PER_TASK * batch)
            .enumerate()
            .for_each_init(
                || vec![0f32; ROWS_PER_TASK * inp],
                |rows, (ci, chunk)| {
                    let r0 = ci * ROWS_PER_TASK;
                    let n = chunk.len() / batch;
                    for (ri, row) in rows.chunks_exact_mut(inp).take(n).enumerate() {
                        w.row_f32(r0 + ri, row);
                    }
                    for bi in 0..batch {
                        let xb = &x[bi * inp..(bi + 1) * inp];
                        for (ri, row) in rows.chunks_exact(inp).take(n).enumerate() {
                            let b = bias.map_or(0.0, |b| b[r0 + ri]);
                            chunk[ri * batch + bi] = dot(row, xb) + b;
                        }
                    }
                },
            );
        for o in 0..out {
            for b in 0..batch {
                y[b * out + o] = yt[o * batch + b];
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_matches_naive() {
        let (out, inp, batch) = (37, 19, 3);
        let wv: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
            .collect();
        let x: Vec<f32> = (0..batch * inp)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.2)
            .collect();
        let bias: Vec<f32> = (0..out).map(|i| i as f32 * 0.01).collect();
        let w = Tensor::from_f32(vec![out, inp], &wv);
        let mut y = vec![0f32; batch * out];
        CpuBackend
            .linear(&x, batch, &w, Some(&bias), &mut y)
            .unwrap();
        for b in 0..batch {
            for o in 0..out {
                let want: f32 = (0..inp)
                    .map(|i| wv[o * inp + i] * x[b * inp + i])
                    .sum::<f32>()
                    + bias[o];
                assert!((y[b * out + o] - want).abs() < 1e-5, "{b} {o}");
            }
        }
    }
}
