//! Decoder layers driven where the residual is (#21 items 1, 3 and 5). Where every sequence
//! of the batch has device memory, the model runs each layer in three calls on the residual:
//! [`Residual::resident_project`](super::Residual::resident_project) queues the norm, q|k|v,
//! their biases, q/k-norm and RoPE (and the next layer's predicted query), bringing the query
//! rows back only where the host plans with them (sparse modes: one wait; `full`: none);
//! [`Residual::resident_attend`](super::Residual::resident_attend) queues every sequence's
//! attention over its device blocks and the token's own key while the CPU attends its part;
//! [`Residual::resident_finish`](super::Residual::resident_finish) merges the CPU's partials
//! in and queues the second half. The new K and V rows come back once per step, with the LM
//! head ([`Residual::resident_kv`](super::Residual::resident_kv)), for the host pool.
//!
//! `host::HostLayers` (tests only) is the same through the host-side calls in the order the
//! model's own path makes them: what a device implementation must equal, and what the
//! engine's tests drive without a GPU.

use std::sync::Arc;

use attention::{BlockGeometry, DeviceBlock, KvSource, Partial};

use super::{Backend, BackendError, DeviceKv, DeviceSeq, LayerOut, rel_diff};
use crate::model::rope::Rotations;
use crate::tensor::Tensor;

/// A layer run resident: its weights and the step's rotations.
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
    /// Where the device plans the layer alone ([`super::DeviceSeq::picks_resident`]): each
    /// head's `blocks` are an `attention::DevicePlan`'s fixed blocks (the sink, then the
    /// window), and the device attends its picks of this call between the two, scored by
    /// the sequence's query row of the layer where it is; the host learns them after the
    /// step ([`super::DeviceSeq::take_device_picks`]).
    pub picks: Option<super::SketchCall>,
}

impl std::fmt::Debug for ResidentSeq<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidentSeq")
            .field("tokens", &self.kv.num_tokens())
            .field("dev", &self.dev)
            .field("blocks", &self.blocks)
            .field("picks", &self.picks)
            .finish()
    }
}

/// What the next layer's predicted query is made of (scout's layer-ahead selection): its
/// input norm, its q projection and q-norm, over this layer's input.
#[derive(Debug, Clone, Copy)]
pub struct NextQuery<'a> {
    pub norm: &'a [f32],
    pub q: (&'a Tensor, Option<&'a [f32]>),
    pub q_norm: Option<&'a [f32]>,
}

/// A resident layer's query rows brought back for planning, `[batch][num_heads * head_dim]`:
/// the layer's own (normed, rotated) and the next layer's predicted one (empty where none).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResidentQuery {
    pub q: Vec<f32>,
    pub next: Vec<f32>,
}

/// The norm-and-project groups of a layer's first half, in the order one `norm_project`
/// takes them: the next layer's predicted query (where `next` is given, into `pred`), then
/// the layer's q, k and v normed by `norm` (into `qkv`).
pub(crate) fn first_half<'a, 'b>(
    (norm, eps): (&'a [f32], f32),
    next: Option<NextQuery<'a>>,
    pred: &'b mut [super::LinearOut<'a>],
    qkv: &'b mut [super::LinearOut<'a>],
) -> Vec<super::NormProject<'a, 'b>> {
    let mut groups = Vec::with_capacity(2);
    if let Some(nq) = next {
        groups.push(super::NormProject {
            norm: nq.norm,
            eps,
            outs: pred,
        });
    }
    groups.push(super::NormProject {
        norm,
        eps,
        outs: qkv,
    });
    groups
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

/// Each KV head's partial of `parts` (one sequence's) merged with the token's own key: its
/// rows `q` (`[num_heads * head_dim]`), `k` and `v` (`[num_kv_heads * head_dim]`).
fn merge_own_key(parts: &mut [Partial], (q, k, v): (&[f32], &[f32], &[f32]), scale: f32) {
    let hk = parts.len().max(1);
    let (per_q, d) = (q.len() / hk, k.len() / hk);
    for (h, p) in parts.iter_mut().enumerate() {
        p.merge_from(&Partial::of_one_key(
            &q[h * per_q..(h + 1) * per_q],
            &k[h * d..(h + 1) * d],
            &v[h * d..(h + 1) * d],
            scale,
        ));
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
/// resident or through [`crate::model::DecodeAttention::attend`]: every block on the device,
/// or (`split`) the even ones on the device and the odd ones as a CPU part by the real query.
struct Probe {
    kv: MemKv,
    geom: BlockGeometry,
    dev: Box<dyn DeviceSeq>,
    scale: f32,
    resident: bool,
    split: bool,
    /// The query rows a resident layer was planned with, for its CPU part.
    q: Vec<f32>,
    /// The layers that ran resident.
    resident_layers: usize,
}

impl Probe {
    /// Per KV head: the device blocks.
    fn lists(&self) -> Vec<Vec<DeviceBlock>> {
        let step = if self.split { 2 } else { 1 };
        let all: Vec<DeviceBlock> = (0..self.kv.blocks.len())
            .step_by(step)
            .map(|block| DeviceBlock {
                block,
                slot: block as u32,
            })
            .collect();
        vec![all; self.geom.num_kv_heads]
    }

    /// Per KV head: the CPU part with `q` (`[num_heads * head_dim]`); empty unless `split`.
    fn cpu_part(&self, layer: usize, q: &[f32]) -> Vec<Partial> {
        if !self.split {
            return Vec::new();
        }
        let hk = self.geom.num_kv_heads;
        let per = q.len() / hk;
        let odd: Vec<usize> = (1..self.kv.blocks.len()).step_by(2).collect();
        (0..hk)
            .map(|head| {
                let hq = attention::HeadQuery {
                    layer,
                    head,
                    q: &q[head * per..(head + 1) * per],
                    scale: self.scale,
                };
                attention::attend_head(&self.geom, &self.kv, hq, &odd, &mut Default::default())
            })
            .collect()
    }
}

impl crate::model::DecodeAttention for Probe {
    fn resident_ok(&self) -> bool {
        self.resident
    }

    fn needs_query(&self, _layer: usize) -> bool {
        self.split
    }

    fn plan_resident(
        &mut self,
        _layer: usize,
        q: &[f32],
    ) -> Result<Vec<ResidentSeq<'_>>, crate::model::ModelError> {
        self.resident_layers += 1;
        self.q = q.to_vec();
        let blocks = self.lists();
        Ok(vec![ResidentSeq {
            kv: &self.kv,
            dev: self.dev.as_mut(),
            blocks,
            picks: None,
        }])
    }

    fn finish_resident(
        &mut self,
        layer: usize,
        _landing: Option<&Arc<super::Landing>>,
    ) -> Result<Vec<Vec<Partial>>, crate::model::ModelError> {
        Ok(if self.split {
            vec![self.cpu_part(layer, &self.q)]
        } else {
            Vec::new()
        })
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
        let mut parts = self.dev.attend(&self.kv, layer, &lists, q, self.scale)?;
        merge_own_key(&mut parts, (q, k, v), self.scale);
        let cpu = self.cpu_part(layer, q);
        let per = q.len() / parts.len().max(1);
        for (h, p) in parts.iter_mut().enumerate() {
            if let Some(c) = cpu.get(h) {
                p.merge_from(c);
            }
            out[h * per..(h + 1) * per].copy_from_slice(&p.out);
        }
        Ok(())
    }
}

/// Resident runs of each shape [`resident_diff`] compares (see there).
const RESIDENT_RUNS: usize = 3;

/// Tokens of the KV the resident check attends: more than one block, the last one partial.
const PROBE_TOKENS: usize = 40;

/// How far a decode step with resident layers is from the host path's, relative to the
/// largest logit (the worse of two shapes: every block on the device, and half of them a CPU
/// part merged on the device), on one sequence of `PROBE_TOKENS` tokens of KV in `dev`; and
/// the error of the resident run where it failed (the distance is then infinite). A backend
/// that does not run layers resident gives 0.
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
        geom: *geom,
        scale: model.attn_scale(),
        resident: false,
        split: false,
        q: Vec::new(),
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
    let mut worst = 0f64;
    for split in [false, true] {
        probe.split = split;
        probe.resident = false;
        let want = logits(&mut probe)?;
        probe.resident = true;
        // More than once: a device that runs a step's pieces as graphs queues them at their
        // first sighting, captures them at the next and replays them after; each run is
        // compared.
        for _ in 0..RESIDENT_RUNS {
            let got = match logits(&mut probe) {
                Ok(l) => l,
                Err(e) => return Ok((f64::INFINITY, Some(e))),
            };
            if probe.resident_layers == 0 {
                return Ok((0.0, None));
            }
            let d = rel_diff(&got, &want);
            worst = if d.is_nan() || worst.is_nan() {
                f64::NAN
            } else {
                worst.max(d)
            };
        }
    }
    Ok((worst, None))
}

/// Resident layers through the host-side calls, for the engine's tests.
#[cfg(test)]
pub(crate) mod host {
    use super::*;
    use crate::backend::{CpuPart, Landing, LinearOut, Residual};

    /// The finished query rows, `[batch][width]` (`width` = num_heads * head_dim), as
    /// `project` hands them to its `scores` (a device's handle names device memory).
    #[derive(Debug, Clone)]
    pub(crate) struct HostQueryRows {
        pub(crate) q: Vec<f32>,
        pub(crate) width: usize,
    }

    /// The layer between its calls.
    #[derive(Debug)]
    struct Layer {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        /// Per row, per KV head: the device part and the token's own key.
        parts: Vec<Vec<Partial>>,
    }

    /// Resident layers on the host: the calls of [`Residual`]'s resident path for a residual
    /// `r` of backend `b`, each in the order the model's own path makes them (so with the
    /// same sums).
    #[derive(Debug, Default)]
    pub(crate) struct HostLayers {
        layer: Option<Layer>,
        kv: Vec<ResidentKv>,
    }

    fn out<'a>((w, bias): (&'a Tensor, Option<&'a [f32]>), y: &'a mut [f32]) -> LinearOut<'a> {
        LinearOut { w, bias, y }
    }

    impl HostLayers {
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn project<R: Residual + ?Sized, B: Backend + ?Sized>(
            &mut self,
            r: &mut R,
            b: &B,
            l: &ResidentLayer<'_>,
            next: Option<NextQuery<'_>>,
            bring_back: bool,
            scores: &mut dyn FnMut(&dyn std::any::Any),
        ) -> Result<ResidentQuery, BackendError> {
            let n = l.rot.positions();
            let (mut q, mut k, mut v) = (
                vec![0f32; n * l.q.0.rows()],
                vec![0f32; n * l.k.0.rows()],
                vec![0f32; n * l.v.0.rows()],
            );
            let mut qn = vec![0f32; next.map_or(0, |nq| n * nq.q.0.rows())];
            let mut pred: Vec<LinearOut<'_>> =
                next.map(|nq| out(nq.q, &mut qn)).into_iter().collect();
            let mut qkv = [out(l.q, &mut q), out(l.k, &mut k), out(l.v, &mut v)];
            r.norm_project(&mut first_half((l.norm, l.eps), next, &mut pred, &mut qkv))?;
            drop((pred, qkv));
            if let Some(nq) = next {
                norm_rope(b, &mut qn, nq.q_norm, l.eps, l.rot);
            }
            norm_rope(b, &mut q, l.q_norm, l.eps, l.rot);
            norm_rope(b, &mut k, l.k_norm, l.eps, l.rot);
            if bring_back {
                scores(&HostQueryRows {
                    q: q.clone(),
                    width: l.num_heads * l.head_dim,
                });
            }
            let back = ResidentQuery {
                q: if bring_back { q.clone() } else { Vec::new() },
                next: if bring_back { qn } else { Vec::new() },
            };
            self.layer = Some(Layer {
                q,
                k,
                v,
                parts: Vec::new(),
            });
            Ok(back)
        }

        pub(crate) fn attend(
            &mut self,
            l: &ResidentLayer<'_>,
            seqs: &mut [ResidentSeq<'_>],
        ) -> Result<(), BackendError> {
            let Some(st) = self.layer.as_mut() else {
                return Err(BackendError::Unsupported("attend before project".into()));
            };
            let (hd, hk) = (l.head_dim, l.num_kv_heads);
            let (width, kvw) = (l.num_heads * hd, hk * hd);
            for (i, s) in seqs.iter_mut().enumerate() {
                let qi = &st.q[i * width..(i + 1) * width];
                if let Some(call) = s.picks {
                    Self::insert_picks(s, qi, call)?;
                }
                let lists: Vec<&[DeviceBlock]> = s.blocks.iter().map(Vec::as_slice).collect();
                s.dev.submit(s.kv, l.layer, &lists, qi, l.scale)?;
            }
            st.parts = Vec::with_capacity(seqs.len());
            for (i, s) in seqs.iter_mut().enumerate() {
                let mut parts = s.dev.collect()?;
                let rows = (
                    &st.q[i * width..(i + 1) * width],
                    &st.k[i * kvw..(i + 1) * kvw],
                    &st.v[i * kvw..(i + 1) * kvw],
                );
                merge_own_key(&mut parts, rows, l.scale);
                st.parts.push(parts);
            }
            Ok(())
        }

        /// A layer the device plans alone: its picks of `call`, made by the row `q`, go
        /// between each head's sink and window. A device that reads blocks by index (this
        /// one) takes them in the sink's slot; a GPU reads each pick's slot from its table.
        fn insert_picks(
            s: &mut ResidentSeq<'_>,
            q: &[f32],
            call: crate::backend::SketchCall,
        ) -> Result<(), BackendError> {
            let picks = match s.dev.sketch_scores(s.kv, q, call)? {
                Some(crate::backend::Scored::Picks(p)) if p.len() == s.blocks.len() => p,
                other => {
                    return Err(BackendError::Unsupported(format!(
                        "a layer planned on the device answered {other:?}"
                    )));
                }
            };
            for (list, picks) in s.blocks.iter_mut().zip(picks) {
                let Some(&sink) = list.first() else {
                    return Err(BackendError::Unsupported(
                        "a layer planned on the device without its sink".into(),
                    ));
                };
                let at = list.len().min(1);
                list.splice(
                    at..at,
                    picks.into_iter().map(|block| DeviceBlock {
                        block,
                        slot: sink.slot,
                    }),
                );
            }
            Ok(())
        }

        pub(crate) fn finish<R: Residual + ?Sized>(
            &mut self,
            r: &mut R,
            l: &ResidentLayer<'_>,
            cpu: CpuPart<'_>,
        ) -> Result<(), BackendError> {
            let Some(mut st) = self.layer.take() else {
                return Err(BackendError::Unsupported("finish before project".into()));
            };
            let landed;
            let cpu: &[Vec<Partial>] = match cpu {
                CpuPart::Ready(rows) => rows,
                CpuPart::Landing(landing) => {
                    landed = wait_landed(landing)?;
                    &landed
                }
            };
            let width = l.num_heads * l.head_dim;
            let mut attn = vec![0f32; st.parts.len() * width];
            for (i, parts) in st.parts.iter_mut().enumerate() {
                let row = &mut attn[i * width..(i + 1) * width];
                let per = width / parts.len().max(1);
                for (h, p) in parts.iter_mut().enumerate() {
                    if let Some(c) = cpu.get(i).and_then(|c| c.get(h)) {
                        p.merge_from(c);
                    }
                    row[h * per..(h + 1) * per].copy_from_slice(&p.out);
                }
            }
            r.finish_layer(&attn, l.out)?;
            self.kv.push(ResidentKv {
                layer: l.layer,
                k: st.k,
                v: st.v,
            });
            Ok(())
        }

        pub(crate) fn take_kv(&mut self) -> Vec<ResidentKv> {
            std::mem::take(&mut self.kv)
        }
    }

    /// Longest a host residual waits for a landing's flag: far past any CPU part of a
    /// test's shapes, short of hanging a test run on a flag that is never raised.
    const LANDING_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

    /// What a device's stream does before the merge: waits for the landing's flag, then
    /// reads its rows. On a thread of a rayon pool (the CPU device's step runs in the CPU
    /// attention pool) the wait runs the pool's jobs meanwhile: the parts it waits for may be
    /// queued behind it.
    fn wait_landed(landing: &Arc<Landing>) -> Result<Vec<Vec<Partial>>, BackendError> {
        let start = std::time::Instant::now();
        loop {
            if let Some(rows) = landing.read() {
                return Ok(rows);
            }
            if start.elapsed() > LANDING_PATIENCE {
                return Err(BackendError::Unsupported(format!(
                    "the CPU partials did not land in {LANDING_PATIENCE:?}"
                )));
            }
            if rayon::yield_now() != Some(rayon::Yield::Executed) {
                std::thread::yield_now();
            }
        }
    }
}
