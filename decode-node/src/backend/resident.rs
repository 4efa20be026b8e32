//! A decoder layer whose attention stays where the residual is (#21 items 1 and 3): where every
//! block a layer attends is in device memory and nothing of it runs on the CPU (`full`), the
//! device needs nothing from the host between the layer's input norm and its down projection.
//! [`Residual::attend_resident`](super::Residual::attend_resident) runs the whole layer there: norm and q|k|v, q/k-norm and RoPE,
//! each sequence's attention over its device blocks merged with the token's own key, the
//! layer's second half. The new K and V rows come back once per step, after the LM head
//! ([`Residual::resident_kv`](super::Residual::resident_kv)), for the host pool.
//!
//! `host::attend_on_host` (tests only) is the same layer through the host-side calls in the order the model's
//! own path makes them: what a device implementation must equal, and what the engine's tests
//! drive without a GPU.

use std::sync::Arc;

use attention::{BlockGeometry, DeviceBlock, KvSource, Partial};

use super::{Backend, BackendError, DeviceKv, DeviceSeq, LayerOut, rel_diff};
use crate::model::rope::Rotations;
use crate::tensor::Tensor;

/// A layer run by [`Residual::attend_resident`](super::Residual::attend_resident): its weights and the step's rotations.
#[derive(Debug, Clone, Copy)]
pub struct ResidentLayer<'a> {
    pub layer: usize,
    /// Layers of the model (a device sizes the step's K/V rows by it).
    pub num_layers: usize,
    /// RMSNorm weight before attention, `[hidden]`, and the model's epsilon.
    pub norm: &'a [f32],
    pub eps: f32,
    /// The q, k and v projections and their biases.
    pub q: (&'a Tensor, Option<&'a [f32]>),
    pub k: (&'a Tensor, Option<&'a [f32]>),
    pub v: (&'a Tensor, Option<&'a [f32]>),
    /// Per-head RMSNorm of q and of k before RoPE (Qwen3), `[head_dim]`.
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    /// Each row's rotation.
    pub rot: &'a Rotations,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Softmax scale of the attention scores.
    pub scale: f32,
    /// The layer's second half.
    pub out: LayerOut<'a>,
}

/// One sequence of a resident layer: its KV and device state, and the blocks it attends.
pub struct ResidentSeq<'a> {
    pub kv: &'a dyn KvSource,
    pub dev: &'a mut dyn DeviceSeq,
    /// Per KV head, the device blocks to attend.
    pub blocks: Vec<Vec<DeviceBlock>>,
}

impl std::fmt::Debug for ResidentSeq<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidentSeq")
            .field("tokens", &self.kv.num_tokens())
            .field("dev", &self.dev)
            .field("blocks", &self.blocks)
            .finish()
    }
}

/// A resident layer's new K (normed, rotated) and V rows, `[batch][num_kv_heads * head_dim]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ResidentKv {
    pub layer: usize,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// `y`'s heads normed by `head_norm` (where given), then each row rotated: the model's
/// q/k step between projection and attention.
pub(crate) fn norm_rope<B: Backend + ?Sized>(
    b: &B,
    y: &mut [f32],
    head_norm: Option<&[f32]>,
    eps: f32,
    rot: &Rotations,
) {
    let width = y.len() / rot.positions().max(1);
    if let Some(w) = head_norm {
        let tmp = y.to_vec();
        b.rms_norm(&tmp, w, eps, y);
    }
    for (i, row) in y.chunks_exact_mut(width).enumerate() {
        rot.rotate(i, row);
    }
}

/// One sequence's attention output `out` (`[num_heads * head_dim]`): each KV head's partial of
/// `parts` merged with the token's own key, its rows `q` (`[num_heads * head_dim]`), `k` and
/// `v` (`[num_kv_heads * head_dim]`).
fn with_own_key(
    parts: Vec<Partial>,
    (q, k, v): (&[f32], &[f32], &[f32]),
    scale: f32,
    out: &mut [f32],
) {
    let hk = parts.len().max(1);
    let (per_q, d) = (q.len() / hk, k.len() / hk);
    for (h, mut p) in parts.into_iter().enumerate() {
        p.merge_from(&Partial::of_one_key(
            &q[h * per_q..(h + 1) * per_q],
            &k[h * d..(h + 1) * d],
            &v[h * d..(h + 1) * d],
            scale,
        ));
        out[h * per_q..(h + 1) * per_q].copy_from_slice(&p.out);
    }
}

/// KV blocks of one layer in plain memory, for the resident check.
struct MemKv {
    blocks: Vec<Vec<u8>>,
    n: usize,
}

impl KvSource for MemKv {
    fn block(&self, _layer: usize, block: usize) -> &[u8] {
        &self.blocks[block]
    }
    fn num_tokens(&self) -> usize {
        self.n
    }
}

/// `n` tokens of K and V in `geom`'s layout, every layer the same: a smooth, deterministic
/// pattern (no RNG needed: the check compares two paths over the same bytes).
fn probe_kv(geom: &BlockGeometry, n: usize) -> MemKv {
    let d = geom.head_dim;
    let blocks = (0..geom.blocks_for(n))
        .map(|b| {
            let mut blk = vec![0u8; geom.block_bytes()];
            for t in 0..(n - b * geom.block_size).min(geom.block_size) {
                let pos = b * geom.block_size + t;
                for h in 0..geom.num_kv_heads {
                    let wave = |c: usize, f: f32| ((pos * 7 + h * 13 + c) as f32 * f).sin();
                    let k: Vec<f32> = (0..d).map(|c| wave(c, 0.37)).collect();
                    let v: Vec<f32> = (0..d).map(|c| wave(c, 0.11)).collect();
                    geom.write_token(&mut blk, h, t, &k, &v);
                }
            }
            blk
        })
        .collect();
    MemKv { blocks, n }
}

/// One sequence over [`MemKv`] with every block in the slot of its own index, attended
/// resident or through [`crate::model::DecodeAttention::attend`].
struct Probe {
    kv: MemKv,
    dev: Box<dyn DeviceSeq>,
    num_kv_heads: usize,
    scale: f32,
    resident: bool,
    /// The layers that ran resident.
    resident_layers: usize,
}

impl Probe {
    fn lists(&self) -> Vec<Vec<DeviceBlock>> {
        let blocks = self.kv.blocks.len();
        let all: Vec<DeviceBlock> = (0..blocks)
            .map(|block| DeviceBlock {
                block,
                slot: block as u32,
            })
            .collect();
        vec![all; self.num_kv_heads]
    }
}

impl crate::model::DecodeAttention for Probe {
    fn resident(
        &mut self,
        _layer: usize,
    ) -> Result<Option<Vec<ResidentSeq<'_>>>, crate::model::ModelError> {
        if !self.resident {
            return Ok(None);
        }
        self.resident_layers += 1;
        let blocks = self.lists();
        Ok(Some(vec![ResidentSeq {
            kv: &self.kv,
            dev: self.dev.as_mut(),
            blocks,
        }]))
    }

    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), crate::model::ModelError> {
        let lists = self.lists();
        let lists: Vec<&[DeviceBlock]> = lists.iter().map(Vec::as_slice).collect();
        let parts = self.dev.attend(&self.kv, layer, &lists, q, self.scale)?;
        with_own_key(parts, (q, k, v), self.scale, out);
        Ok(())
    }
}

/// Tokens of the KV the resident check attends: more than one block, the last one partial.
const PROBE_TOKENS: usize = 40;

/// How far a decode step with resident layers ([`Residual::attend_resident`](super::Residual::attend_resident)) is from the
/// host path's, relative to the largest logit, on one sequence of `PROBE_TOKENS` tokens of
/// KV in `dev`; and the error of the resident run where it failed (the distance is then
/// infinite). A backend that does not attend resident gives 0.
pub fn resident_diff(
    model: &crate::model::Model,
    dev: &Arc<dyn DeviceKv>,
    geom: &BlockGeometry,
) -> Result<(f64, Option<crate::model::ModelError>), crate::model::ModelError> {
    let cfg = &model.cfg;
    let kv = probe_kv(geom, PROBE_TOKENS);
    let mut probe = Probe {
        dev: Arc::clone(dev).new_seq(cfg.num_layers, kv.blocks.len()),
        kv,
        num_kv_heads: cfg.num_kv_heads,
        scale: model.attn_scale(),
        resident: false,
        resident_layers: 0,
    };
    let vocab = cfg.vocab_size as u32;
    let tokens = [3.min(vocab - 1)];
    let positions = [PROBE_TOKENS];
    let logits = |p: &mut Probe| -> Result<Vec<f32>, crate::model::ModelError> {
        let rows = model.decode_step_picking(&tokens, &positions, p, &[None])?;
        match rows.into_iter().next() {
            Some(crate::model::pick::RowOut::Logits(l)) => Ok(l),
            other => Err(crate::model::ModelError::Backend(
                BackendError::Unsupported(format!(
                    "the LM head gave {other:?} for a row that asked for logits"
                )),
            )),
        }
    };
    let want = logits(&mut probe)?;
    probe.resident = true;
    let got = match logits(&mut probe) {
        Ok(l) => l,
        Err(e) => return Ok((f64::INFINITY, Some(e))),
    };
    if probe.resident_layers == 0 {
        return Ok((0.0, None));
    }
    Ok((rel_diff(&got, &want), None))
}

/// The resident layer through the host-side calls, for the engine's tests.
#[cfg(test)]
pub(crate) mod host {
    use super::*;
    use crate::backend::{LinearOut, NormProject, Residual};

    /// [`Residual::attend_resident`](super::Residual::attend_resident) through `r`'s host-side calls, in the order the model's own
    /// path makes them (so with the same sums): the layer's K and V rows.
    pub(crate) fn attend_on_host<R: Residual + ?Sized, B: Backend + ?Sized>(
        r: &mut R,
        b: &B,
        l: &ResidentLayer<'_>,
        seqs: &mut [ResidentSeq<'_>],
    ) -> Result<ResidentKv, BackendError> {
        let n = l.rot.positions();
        let (hd, hk) = (l.head_dim, l.num_kv_heads);
        let width = l.num_heads * hd;
        let group = l.num_heads / hk.max(1);
        if seqs.len() != n || hk == 0 || group * hk != l.num_heads {
            return Err(BackendError::Unsupported(format!(
                "a resident layer of {} sequences for {n} rows, {} query and {hk} KV heads",
                seqs.len(),
                l.num_heads
            )));
        }
        let (mut q, mut k, mut v) = (
            vec![0f32; n * l.q.0.rows()],
            vec![0f32; n * l.k.0.rows()],
            vec![0f32; n * l.v.0.rows()],
        );
        fn out<'a>((w, bias): (&'a Tensor, Option<&'a [f32]>), y: &'a mut [f32]) -> LinearOut<'a> {
            LinearOut { w, bias, y }
        }
        r.norm_project(&mut [NormProject {
            norm: l.norm,
            eps: l.eps,
            outs: &mut [out(l.q, &mut q), out(l.k, &mut k), out(l.v, &mut v)],
        }])?;
        norm_rope(b, &mut q, l.q_norm, l.eps, l.rot);
        norm_rope(b, &mut k, l.k_norm, l.eps, l.rot);
        for (i, s) in seqs.iter_mut().enumerate() {
            let lists: Vec<&[DeviceBlock]> = s.blocks.iter().map(Vec::as_slice).collect();
            s.dev.submit(
                s.kv,
                l.layer,
                &lists,
                &q[i * width..(i + 1) * width],
                l.scale,
            )?;
        }
        let mut attn = vec![0f32; n * width];
        for (i, s) in seqs.iter_mut().enumerate() {
            let parts = s.dev.collect()?;
            let kvw = hk * hd;
            with_own_key(
                parts,
                (
                    &q[i * width..(i + 1) * width],
                    &k[i * kvw..(i + 1) * kvw],
                    &v[i * kvw..(i + 1) * kvw],
                ),
                l.scale,
                &mut attn[i * width..(i + 1) * width],
            );
        }
        r.finish_layer(&attn, l.out)?;
        Ok(ResidentKv {
            layer: l.layer,
            k,
            v,
        })
    }
}
