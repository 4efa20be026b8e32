//! The Llama-family forward pass (Llama, Qwen2, Qwen3, Mistral), top to bottom like the
//! model card: embed → for each layer: norm, attention, residual, norm, MLP, residual →
//! norm → LM head.

use std::sync::Arc;

use attention::Partial;
use rayon::prelude::*;

use super::ModelError;
use super::config::ModelConfig;
use super::pick::{PickSpec, RowOut, pick_row};
use super::rope::{self, Rotations};
use super::weights::{Tensor, WeightMap};
use crate::backend::gemm::{Mat, MatMut, gemm};
use crate::backend::resident::first_half;
use crate::backend::{
    Backend, BackendError, CpuPart, HostResidual, Landing, LayerOut, LinearOut, LmHead, NextQuery,
    ResidentLayer, ResidentSeq, Residual, rel_diff,
};

/// A projection: weight `[out][in]` and optional bias.
#[derive(Debug)]
pub struct Linear {
    /// Weight.
    pub w: Tensor,
    /// Bias.
    pub b: Option<Vec<f32>>,
}

#[derive(Debug)]
struct Layer {
    input_norm: Vec<f32>,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    post_norm: Vec<f32>,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// Attention for a decode step, provided by the engine (sparse or dense, per request).
/// `Send`: a host backend runs the whole step on one of its pool's threads.
pub trait DecodeAttention: Send {
    /// True when the engine wants layer `layer`'s predicted query (made during `layer - 1`).
    fn wants_prediction(&self, _layer: usize) -> bool {
        false
    }
    /// Called at the start of layer `layer - 1` with layer `layer`'s predicted query
    /// (`[batch][num_heads * head_dim]`, after q-norm and RoPE).
    fn predicted(&mut self, _layer: usize, _q_pred: &[f32]) {}
    /// True when every sequence can run its layers resident (each has device memory): a
    /// residual that runs them ([`crate::backend::Residual::attends_resident`]) is then
    /// driven through [`DecodeAttention::plan_resident`] and
    /// [`DecodeAttention::finish_resident`] instead of [`DecodeAttention::attend`].
    fn resident_ok(&self) -> bool {
        false
    }
    /// True when planning `layer` needs its query rows on the host (selection, a CPU part).
    fn needs_query(&self, _layer: usize) -> bool {
        true
    }
    /// Resident layer `layer`'s query rows are finished where the residual holds them
    /// (`rows`, the backend's handle, for `DeviceSeq::queue_sketch_scores_by`): scores
    /// queued by them now come back in the wait that brings the rows.
    fn queue_scores_by(&mut self, _layer: usize, _rows: &dyn std::any::Any) {}
    /// Plans resident layer `layer` by its query rows `q` (`[batch][num_heads*head_dim]`;
    /// empty where [`DecodeAttention::needs_query`] is false) and starts every CPU part: one
    /// [`ResidentSeq`] per row, its device blocks.
    fn plan_resident(
        &mut self,
        layer: usize,
        _q: &[f32],
    ) -> Result<Vec<ResidentSeq<'_>>, ModelError> {
        Err(ModelError::Attention(format!(
            "layer {layer} planned resident by an attention that does not"
        )))
    }
    /// True when some row's CPU part of resident layer `layer` (started by
    /// [`DecodeAttention::plan_resident`]) is still running: worth a landing
    /// ([`crate::backend::landing`]) where the residual offers one.
    fn cpu_in_flight(&self, _layer: usize) -> bool {
        false
    }
    /// Ends resident layer `layer`'s bookkeeping and gives its CPU parts: without `landing`,
    /// waits for them and returns, per row, one partial per KV head (empty: no row has a CPU
    /// part); with it, lands every row there (each part as it ends, without waiting) and
    /// returns nothing. What is not landed, the model lands from the returned rows.
    fn finish_resident(
        &mut self,
        _layer: usize,
        _landing: Option<&Arc<Landing>>,
    ) -> Result<Vec<Vec<Partial>>, ModelError> {
        Ok(Vec::new())
    }
    /// Resident layer `layer`'s rest (merge, second half) is queued on the device: host work
    /// done now overlaps it instead of leaving the device idle.
    fn resident_queued(&mut self, _layer: usize) {}
    /// After the step: the K and V rows (`[batch][num_kv_heads*head_dim]`) of a layer that ran
    /// resident.
    fn resident_kv(&mut self, _layer: usize, _k: &[f32], _v: &[f32]) {}
    /// After the step and [`DecodeAttention::resident_kv`]: the bookkeeping of the layers a
    /// device planned alone (`DeviceSeq::picks_resident`), from the picks it made.
    fn resident_done(&mut self) -> Result<(), ModelError> {
        Ok(())
    }
    /// Attention of layer `layer` for the batch: `q` is `[batch][num_heads*head_dim]`,
    /// `k`/`v` the new token's `[batch][num_kv_heads*head_dim]`; writes `out` like `q`.
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), ModelError>;
}

/// A prompt's KV (HF `past_key_values` layout per layer: `[token][kv_head][head_dim]`, K after
/// RoPE) and the logits of its last token.
#[derive(Debug, Clone)]
pub struct PrefillOutput {
    /// Per layer K.
    pub keys: Vec<Vec<f32>>,
    /// Per layer V.
    pub values: Vec<Vec<f32>>,
    /// Logits of the last prompt token.
    pub logits: Vec<f32>,
}

/// A layer's new q, k (normed, RoPE'd) and v rows.
type Qkv = (Vec<f32>, Vec<f32>, Vec<f32>);

/// A loaded model on a backend.
#[derive(Debug)]
pub struct Model {
    /// Configuration.
    pub cfg: ModelConfig,
    /// Fingerprint a push must carry.
    pub model_id: String,
    backend: Arc<dyn Backend>,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Option<Tensor>,
    inv_freq: Vec<f32>,
}

impl Model {
    /// Builds the model from `weights` (HF tensor names).
    pub fn from_weights(
        cfg: ModelConfig,
        name: &str,
        mut wm: WeightMap,
        backend: Arc<dyn Backend>,
    ) -> Result<Self, ModelError> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (qd, kvd) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let vec = |wm: &mut WeightMap, n: &str, len: usize| wm.take(n, &[len]).map(|t| t.to_f32());
        let lin = |wm: &mut WeightMap,
                   n: &str,
                   out: usize,
                   inp: usize,
                   bias: bool|
         -> Result<Linear, ModelError> {
            let w = wm.take(&format!("{n}.weight"), &[out, inp])?;
            let b = if bias {
                Some(wm.take(&format!("{n}.bias"), &[out])?.to_f32())
            } else {
                None
            };
            Ok(Linear { w, b })
        };
        let mut embed = wm.take("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            layers.push(Layer {
                input_norm: vec(&mut wm, &format!("{p}.input_layernorm.weight"), h)?,
                q: lin(&mut wm, &format!("{a}.q_proj"), qd, h, cfg.qkv_bias)?,
                k: lin(&mut wm, &format!("{a}.k_proj"), kvd, h, cfg.qkv_bias)?,
                v: lin(&mut wm, &format!("{a}.v_proj"), kvd, h, cfg.qkv_bias)?,
                o: lin(&mut wm, &format!("{a}.o_proj"), h, qd, false)?,
                q_norm: if cfg.qk_norm {
                    Some(vec(&mut wm, &format!("{a}.q_norm.weight"), hd)?)
                } else {
                    None
                },
                k_norm: if cfg.qk_norm {
                    Some(vec(&mut wm, &format!("{a}.k_norm.weight"), hd)?)
                } else {
                    None
                },
                post_norm: vec(&mut wm, &format!("{p}.post_attention_layernorm.weight"), h)?,
                gate: lin(
                    &mut wm,
                    &format!("{p}.mlp.gate_proj"),
                    cfg.intermediate_size,
                    h,
                    false,
                )?,
                up: lin(
                    &mut wm,
                    &format!("{p}.mlp.up_proj"),
                    cfg.intermediate_size,
                    h,
                    false,
                )?,
                down: lin(
                    &mut wm,
                    &format!("{p}.mlp.down_proj"),
                    h,
                    cfg.intermediate_size,
                    false,
                )?,
            });
        }
        let norm = vec(&mut wm, "model.norm.weight", h)?;
        let mut lm_head = if cfg.tie_word_embeddings {
            let _ = wm.take_opt("lm_head.weight", &[cfg.vocab_size, h])?;
            None
        } else {
            Some(wm.take("lm_head.weight", &[cfg.vocab_size, h])?)
        };
        if backend.streams_host_weights() {
            let mut all: Vec<&mut Tensor> = vec![&mut embed];
            all.extend(lm_head.as_mut());
            for l in &mut layers {
                all.extend([
                    &mut l.q.w,
                    &mut l.k.w,
                    &mut l.v.w,
                    &mut l.o.w,
                    &mut l.gate.w,
                    &mut l.up.w,
                    &mut l.down.w,
                ]);
            }
            crate::tensor::pack_onto_huge_pages(&mut all)
                .map_err(|e| ModelError::Io("packing the weights onto huge pages".into(), e))?;
        }
        for l in &layers {
            backend.prepare_stack(&[&l.q.w, &l.k.w, &l.v.w])?;
            backend.prepare(&l.o.w)?;
            backend.prepare_stack(&[&l.gate.w, &l.up.w])?;
            backend.prepare(&l.down.w)?;
        }
        backend.prepare(lm_head.as_ref().unwrap_or(&embed))?;
        for left in wm.remaining() {
            tracing::warn!(tensor = left, "unused tensor in checkpoint");
        }
        let model = Self {
            model_id: cfg.model_id(name),
            inv_freq: rope::inv_freq(&cfg),
            cfg,
            backend,
            embed,
            layers,
            norm,
            lm_head,
        };
        model.check_residual()?;
        model.check_picks();
        Ok(model)
    }

    /// Bytes of weights one decode step streams (every projection and the LM head).
    pub fn weight_bytes(&self) -> u64 {
        self.sum_over_weights(|w| w.bytes().len() as u64)
    }

    /// Weight elements one decode step multiplies each input row by: its FMAs per row.
    pub fn weight_params(&self) -> u64 {
        self.sum_over_weights(|w| (w.rows() * w.cols()) as u64)
    }

    /// `f` summed over every projection's weight and the LM head.
    fn sum_over_weights(&self, f: impl Fn(&Tensor) -> u64) -> u64 {
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| {
                [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]
                    .into_iter()
                    .map(|lin| f(&lin.w))
                    .sum::<u64>()
            })
            .sum();
        layers + f(self.lm_head.as_ref().unwrap_or(&self.embed))
    }

    /// The backend it runs on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The softmax scale of attention.
    pub fn attn_scale(&self) -> f32 {
        1.0 / (self.cfg.head_dim as f32).sqrt()
    }

    fn eps(&self) -> f32 {
        self.cfg.rms_norm_eps as f32
    }

    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        let h = self.cfg.hidden_size;
        let mut x = vec![0f32; tokens.len() * h];
        for (t, row) in tokens.iter().zip(x.chunks_exact_mut(h)) {
            self.embed.row_f32(*t as usize, row);
        }
        x
    }

    /// Per-head norm (Qwen3) and RoPE by `rot`, in place, of q or k rows.
    fn norm_rope(&self, y: &mut [f32], head_norm: Option<&[f32]>, rot: &Rotations) {
        crate::backend::resident::norm_rope(&*self.backend, y, head_norm, self.eps(), rot);
    }

    /// q, k (normed, RoPE'd) and v of normed rows `xn`, in one backend call.
    fn qkv(&self, layer: &Layer, xn: &[f32], rot: &Rotations) -> Result<Qkv, ModelError> {
        let n = rot.positions();
        let mut q = vec![0f32; n * layer.q.w.rows()];
        let mut k = vec![0f32; n * layer.k.w.rows()];
        let mut v = vec![0f32; n * layer.v.w.rows()];
        fn lin(l: &Linear) -> (&Tensor, Option<&[f32]>) {
            (&l.w, l.b.as_deref())
        }
        let ((wq, bq), (wk, bk), (wv, bv)) = (lin(&layer.q), lin(&layer.k), lin(&layer.v));
        self.backend.linear_many(
            xn,
            n,
            &mut [
                LinearOut {
                    w: wq,
                    bias: bq,
                    y: &mut q,
                },
                LinearOut {
                    w: wk,
                    bias: bk,
                    y: &mut k,
                },
                LinearOut {
                    w: wv,
                    bias: bv,
                    y: &mut v,
                },
            ],
        )?;
        self.norm_rope(&mut q, layer.q_norm.as_deref(), rot);
        self.norm_rope(&mut k, layer.k_norm.as_deref(), rot);
        Ok((q, k, v))
    }

    fn lm_head(&self, x: &[f32], n: usize) -> Result<Vec<f32>, ModelError> {
        let h = self.cfg.hidden_size;
        let mut xn = vec![0f32; n * h];
        self.backend.rms_norm(x, &self.norm, self.eps(), &mut xn);
        let w = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut logits = vec![0f32; n * self.cfg.vocab_size];
        self.backend.linear(&xn, n, w, None, &mut logits)?;
        Ok(logits)
    }

    /// Second half of a layer: output projection, residual, MLP, residual.
    fn finish_layer(
        &self,
        layer: &Layer,
        x: &mut [f32],
        attn: &[f32],
        n: usize,
    ) -> Result<(), ModelError> {
        Ok(self
            .backend
            .finish_layer(x, attn, n, self.layer_out(layer))?)
    }

    /// Runs a whole prompt (causal, dense attention) and returns its KV and last logits.
    pub fn prefill(&self, tokens: &[u32]) -> Result<PrefillOutput, ModelError> {
        self.check_tokens(tokens)?;
        let n = tokens.len();
        if n == 0 {
            return Err(ModelError::Input("empty prompt".into()));
        }
        if n >= self.cfg.max_context() {
            return Err(ModelError::Input(format!(
                "prompt of {n} tokens does not fit the context of {}",
                self.cfg.max_context()
            )));
        }
        let cfg = &self.cfg;
        let (h, hd, nh, nkv) = (
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
        );
        let positions: Vec<usize> = (0..n).collect();
        let rot = Rotations::new(&self.inv_freq, &positions);
        let mut x = self.embed(tokens);
        let mut keys = Vec::with_capacity(cfg.num_layers);
        let mut values = Vec::with_capacity(cfg.num_layers);
        let scale = self.attn_scale();
        for layer in &self.layers {
            let mut xn = vec![0f32; n * h];
            self.backend
                .rms_norm(&x, &layer.input_norm, self.eps(), &mut xn);
            let (q, k, v) = self.qkv(layer, &xn, &rot)?;
            let attn = causal_attention(&q, &k, &v, n, nh, nkv, hd, scale);
            self.finish_layer(layer, &mut x, &attn, n)?;
            keys.push(k);
            values.push(v);
        }
        let last = &x[(n - 1) * h..];
        let logits = self.lm_head(last, 1)?;
        Ok(PrefillOutput {
            keys,
            values,
            logits,
        })
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<(), ModelError> {
        match tokens.iter().find(|t| **t as usize >= self.cfg.vocab_size) {
            Some(t) => Err(ModelError::Input(format!(
                "token id {t} is outside the vocabulary of {}",
                self.cfg.vocab_size
            ))),
            None => Ok(()),
        }
    }

    /// One decode step for a batch: `tokens[b]` at `positions[b]`; attention through `attn`.
    /// Returns logits `[batch][vocab]`.
    pub fn decode_step(
        &self,
        tokens: &[u32],
        positions: &[usize],
        attn: &mut dyn DecodeAttention,
    ) -> Result<Vec<f32>, ModelError> {
        let rows = self.decode_step_picking(tokens, positions, attn, &vec![None; tokens.len()])?;
        self.logits_of(rows)
    }

    /// [`Self::decode_step`] where the backend may pick row `b`'s token itself by
    /// `picks[b]` (see [`Residual::lm_head`]): one [`RowOut`] per row.
    pub fn decode_step_picking(
        &self,
        tokens: &[u32],
        positions: &[usize],
        attn: &mut dyn DecodeAttention,
        picks: &[Option<PickSpec>],
    ) -> Result<Vec<RowOut>, ModelError> {
        if picks.len() != tokens.len() {
            return Err(ModelError::Input(format!(
                "{} pick specs for {} rows",
                picks.len(),
                tokens.len()
            )));
        }
        if self.backend.parallel_on_rayon() {
            // On the pool's own threads, with the others held as the step's team: each of
            // its ~200 small parallel ops then starts without waking a sleeping thread.
            crate::backend::team::run_step(|| self.decode_step_here(tokens, positions, attn, picks))
        } else {
            self.decode_step_here(tokens, positions, attn, picks)
        }
    }

    /// [`Self::decode_step_picking`] on the calling thread, the residual where the backend
    /// keeps it.
    fn decode_step_here(
        &self,
        tokens: &[u32],
        positions: &[usize],
        attn: &mut dyn DecodeAttention,
        picks: &[Option<PickSpec>],
    ) -> Result<Vec<RowOut>, ModelError> {
        self.check_tokens(tokens)?;
        let r = self.backend.residual(self.embed(tokens), tokens.len())?;
        self.decode_on(r, positions, attn, picks)
    }

    /// The logits `[batch][vocab]` of rows no backend picked.
    fn logits_of(&self, rows: Vec<RowOut>) -> Result<Vec<f32>, ModelError> {
        let mut logits = Vec::with_capacity(rows.len() * self.cfg.vocab_size);
        for row in rows {
            match row {
                RowOut::Logits(l) if l.len() == self.cfg.vocab_size => logits.extend(l),
                other => {
                    return Err(ModelError::Backend(BackendError::Unsupported(format!(
                        "the LM head gave {other:?} for a row that asked for logits"
                    ))));
                }
            }
        }
        Ok(logits)
    }

    /// The layers and LM head of a decode step over the residual `r` (the batch's
    /// embeddings), one row per position.
    fn decode_on<'a>(
        &'a self,
        mut r: Box<dyn Residual + 'a>,
        positions: &[usize],
        attn: &mut dyn DecodeAttention,
        picks: &[Option<PickSpec>],
    ) -> Result<Vec<RowOut>, ModelError> {
        let n = positions.len();
        let cfg = &self.cfg;
        let rot = Rotations::new(&self.inv_freq, positions);
        let lin = |l: &'a Linear| (&l.w, l.b.as_deref());
        let resident = r.attends_resident();
        for (i, layer) in self.layers.iter().enumerate() {
            // Layer-ahead: layer i+1's query from layer i's input (residuals change it little),
            // projected in the same call as this layer's q, k and v.
            let next = self
                .layers
                .get(i + 1)
                .filter(|_| attn.wants_prediction(i + 1));
            let next_q = next.map(|nl| NextQuery {
                norm: &nl.input_norm,
                q: lin(&nl.q),
                q_norm: nl.q_norm.as_deref(),
            });
            if resident && attn.resident_ok() {
                let l = ResidentLayer {
                    layer: i,
                    num_layers: self.layers.len(),
                    norm: &layer.input_norm,
                    eps: self.eps(),
                    q: lin(&layer.q),
                    k: lin(&layer.k),
                    v: lin(&layer.v),
                    q_norm: layer.q_norm.as_deref(),
                    k_norm: layer.k_norm.as_deref(),
                    rot: &rot,
                    num_heads: cfg.num_heads,
                    num_kv_heads: cfg.num_kv_heads,
                    head_dim: cfg.head_dim,
                    scale: self.attn_scale(),
                    out: self.layer_out(layer),
                };
                let back = attn.needs_query(i) || next.is_some();
                let rq = r.resident_project(&l, next_q, back, &mut |rows| {
                    attn.queue_scores_by(i, rows)
                })?;
                if next.is_some() {
                    attn.predicted(i + 1, &rq.next);
                }
                let mut seqs = attn.plan_resident(i, &rq.q)?;
                r.resident_attend(&l, &mut seqs)?;
                drop(seqs);
                // The CPU parts land where the residual is without this thread waiting for
                // them, where it offers a place; the merge waits there instead.
                let landing = if attn.cpu_in_flight(i) {
                    r.cpu_landing(&l)?
                } else {
                    None
                };
                let cpu = attn.finish_resident(i, landing.as_ref())?;
                match &landing {
                    Some(ld) => {
                        ld.land_rest(&cpu)?;
                        r.resident_finish(&l, CpuPart::Landing(ld))?;
                    }
                    None => r.resident_finish(&l, CpuPart::Ready(&cpu))?,
                }
                attn.resident_queued(i);
                continue;
            }
            let width = |l: &Linear| n * l.w.rows();
            let mut qp = vec![0f32; next.map_or(0, |l| width(&l.q))];
            let (mut q, mut k, mut v) = (
                vec![0f32; width(&layer.q)],
                vec![0f32; width(&layer.k)],
                vec![0f32; width(&layer.v)],
            );
            let out = |(w, bias): (&'a Tensor, Option<&'a [f32]>), y| LinearOut { w, bias, y };
            let mut pred: Vec<LinearOut<'_>> =
                next.map(|l| out(lin(&l.q), &mut qp)).into_iter().collect();
            let mut qkv = [
                out(lin(&layer.q), &mut q),
                out(lin(&layer.k), &mut k),
                out(lin(&layer.v), &mut v),
            ];
            let mut groups =
                first_half((&layer.input_norm, self.eps()), next_q, &mut pred, &mut qkv);
            r.norm_project(&mut groups)?;
            drop(groups);
            drop((pred, qkv));
            if let Some(l) = next {
                self.norm_rope(&mut qp, l.q_norm.as_deref(), &rot);
                attn.predicted(i + 1, &qp);
            }
            self.norm_rope(&mut q, layer.q_norm.as_deref(), &rot);
            self.norm_rope(&mut k, layer.k_norm.as_deref(), &rot);
            let mut out = vec![0f32; n * cfg.num_heads * cfg.head_dim];
            attn.attend(i, &q, &k, &v, &mut out)?;
            r.finish_layer(&out, self.layer_out(layer))?;
        }
        let rows = r.lm_head(
            LmHead {
                norm: &self.norm,
                eps: self.eps(),
                w: self.lm_head.as_ref().unwrap_or(&self.embed),
            },
            picks,
        )?;
        for kv in r.resident_kv()? {
            attn.resident_kv(kv.layer, &kv.k, &kv.v);
        }
        attn.resident_done()?;
        Ok(rows)
    }

    /// The weights of `layer`'s second half.
    fn layer_out<'a>(&'a self, layer: &'a Layer) -> LayerOut<'a> {
        LayerOut {
            o: &layer.o.w,
            post_norm: &layer.post_norm,
            eps: self.eps(),
            gate: &layer.gate.w,
            up: &layer.up.w,
            down: &layer.down.w,
        }
    }

    /// A backend that keeps the residual on its device must give the host path's logits:
    /// checked once per model on a decode step of two tokens that attend only themselves;
    /// where they differ, the backend keeps the residual on the host from then on.
    fn check_residual(&self) -> Result<(), ModelError> {
        if !self.backend.residual_on_device() {
            return Ok(());
        }
        let (diff, err) = self.residual_diff()?;
        if diff <= RESIDUAL_TOLERANCE {
            tracing::info!(
                diff,
                "the device-resident residual gives the host path's logits"
            );
        } else {
            tracing::error!(diff, error = ?err, "the device-resident residual does not give the host path's logits; keeping the residual on the host");
            self.backend.keep_residual_on_host();
        }
        Ok(())
    }

    /// A backend that picks tokens where the logits are must pick what the host picks from
    /// the same logits: checked once per model on a decode step of two tokens (greedy with a
    /// top list, and a tempered draw under top-k and top-p); where it does not, the backend
    /// brings every row's logits back from then on.
    fn check_picks(&self) {
        if !self.backend.picks_on_device() {
            return;
        }
        match self.picks_diff() {
            Ok(None) => tracing::info!("the device picks the host path's tokens"),
            Ok(Some(why)) => {
                tracing::error!(%why, "the device does not pick the host path's tokens; picking on the host");
                self.backend.keep_picks_on_host();
            }
            Err(e) => {
                tracing::error!(error = %e, "device picks failed; picking on the host");
                self.backend.keep_picks_on_host();
            }
        }
    }

    /// Where the backend's picks on a decode step of two tokens that attend only themselves
    /// differ from [`pick_row`] over the same step's logits (`None`: they agree).
    pub fn picks_diff(&self) -> Result<Option<String>, ModelError> {
        let vocab = self.cfg.vocab_size as u32;
        let tokens = [1.min(vocab - 1), 2.min(vocab - 1)];
        let positions = [0usize, 1];
        let specs = [
            Some(PickSpec::greedy(5)),
            Some(PickSpec {
                temperature: 0.8,
                top_k: 50,
                top_p: 0.9,
                draw: Some(0.37),
                top_logprobs: 3,
            }),
        ];
        let mut attn = SelfAttention::of(&self.cfg);
        let residual = || self.backend.residual(self.embed(&tokens), 2);
        let logits = self.decode_on(residual()?, &positions, &mut attn, &[None, None])?;
        let logits = self.logits_of(logits)?;
        let rows = self.decode_on(residual()?, &positions, &mut attn, &specs)?;
        let v = self.cfg.vocab_size;
        for (i, (row, spec)) in rows.iter().zip(&specs).enumerate() {
            let want = spec.and_then(|s| pick_row(&logits[i * v..(i + 1) * v], &s));
            let close = |a: f32, b: f32| (a - b).abs() <= 1e-3 * b.abs().max(1.0);
            let agree = match (row, &want) {
                (RowOut::Picked(got), Some(want)) => {
                    got.token == want.token
                        && close(got.logprob, want.logprob)
                        && got.top.len() == want.top.len()
                        && got
                            .top
                            .iter()
                            .zip(&want.top)
                            .all(|(a, b)| a.0 == b.0 && close(a.1, b.1))
                }
                (RowOut::Logits(l), None) => l.len() == v,
                _ => false,
            };
            if !agree {
                let got = match row {
                    RowOut::Picked(p) => format!("{p:?}"),
                    RowOut::Logits(_) => "logits".into(),
                };
                return Ok(Some(format!(
                    "row {i} ({spec:?}): the device gave {got}, the host picks {want:?}"
                )));
            }
        }
        Ok(None)
    }

    /// How far the logits of the backend's residual are from the host path's on a decode step
    /// of two tokens that attend only themselves (relative to the largest; NaN with the
    /// device path's error where it failed).
    pub fn residual_diff(&self) -> Result<(f64, Option<ModelError>), ModelError> {
        let vocab = self.cfg.vocab_size as u32;
        let tokens = [1.min(vocab - 1), 2.min(vocab - 1)];
        let positions = [0usize, 1];
        let mut attn = SelfAttention::of(&self.cfg);
        let on_host = self.decode_on(
            Box::new(HostResidual::new(&*self.backend, self.embed(&tokens), 2)),
            &positions,
            &mut attn,
            &[None, None],
        );
        let on_host = self.logits_of(on_host?)?;
        let on_device = self
            .decode_on(
                self.backend.residual(self.embed(&tokens), 2)?,
                &positions,
                &mut attn,
                &[None, None],
            )
            .and_then(|rows| self.logits_of(rows));
        Ok(match on_device {
            Ok(l) => (rel_diff(&l, &on_host), None),
            Err(e) => (f64::NAN, Some(e)),
        })
    }
}

/// Largest difference of logits (relative to the largest) between the device-resident
/// residual and the host path: both round the same activations to the weights' type, but
/// norms run on different processors, so a value on a rounding edge may round the other way.
pub const RESIDUAL_TOLERANCE: f64 = 1e-2;

/// Attention of each token to itself only (`out` of a head = its KV head's new `v`): a decode
/// step's dense work without any KV, for checks and `bench step`.
#[derive(Debug, Clone, Copy)]
pub struct SelfAttention {
    group: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl SelfAttention {
    /// For a model of `cfg`'s shape.
    pub fn of(cfg: &ModelConfig) -> Self {
        Self {
            group: cfg.num_heads / cfg.num_kv_heads.max(1),
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        }
    }
}

impl DecodeAttention for SelfAttention {
    fn attend(
        &mut self,
        _layer: usize,
        _q: &[f32],
        _k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let d = self.head_dim;
        let heads = self.group * self.num_kv_heads;
        for (i, o) in out.chunks_exact_mut(d).enumerate() {
            let (b, h) = (i / heads, i % heads);
            let at = (b * self.num_kv_heads + h / self.group) * d;
            o.copy_from_slice(&v[at..at + d]);
        }
        Ok(())
    }
}

/// Query tokens per task of [`causal_attention`]: the score tile `[tile][n]` stays small
/// while each GEMM is still wide.
const PREFILL_QUERY_TILE: usize = 64;

/// Dense causal attention of a whole prompt: `q` is `[n][nh][hd]`, `k` and `v` are
/// `[n][nkv][hd]`; returns `[n][nh][hd]`. Tiles of query tokens in parallel; within a tile,
/// per head, scores and the weighted sum of values are two GEMMs over strided views.
#[allow(clippy::too_many_arguments)]
fn causal_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    scale: f32,
) -> Vec<f32> {
    let group = nh / nkv;
    let mut attn = vec![0f32; n * nh * hd];
    attn.par_chunks_mut(PREFILL_QUERY_TILE * nh * hd)
        .enumerate()
        .for_each_init(Vec::new, |scores, (ti, out)| {
            let t0 = ti * PREFILL_QUERY_TILE;
            let rows = out.len() / (nh * hd);
            // Keys this tile can see: up to and including its last token.
            let keys = t0 + rows;
            scores.resize(rows * keys, 0f32);
            for head in 0..nh {
                let kvh = head / group;
                let qh = Mat::new(&q[(t0 * nh + head) * hd..], rows, hd, nh * hd, 1);
                let kh = Mat::new(&k[kvh * hd..], keys, hd, nkv * hd, 1);
                let vh = Mat::new(&v[kvh * hd..], keys, hd, nkv * hd, 1);
                gemm(
                    scale,
                    qh,
                    kh.t(),
                    0.0,
                    MatMut::new(scores, rows, keys, keys, 1),
                );
                for (i, row) in scores.chunks_exact_mut(keys).enumerate() {
                    let visible = t0 + i + 1;
                    let (seen, future) = row.split_at_mut(visible);
                    let m = seen.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0f32;
                    for s in seen.iter_mut() {
                        *s = (*s - m).exp();
                        sum += *s;
                    }
                    let inv = 1.0 / sum;
                    seen.iter_mut().for_each(|s| *s *= inv);
                    future.fill(0.0);
                }
                gemm(
                    1.0,
                    Mat::rows(scores, rows, keys),
                    vh,
                    0.0,
                    MatMut::new(&mut out[head * hd..], rows, hd, nh * hd, 1),
                );
            }
        });
    attn
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;
    use crate::model::Arch;
    use crate::model::random::{preset, random_weights};
    use attention::KvDType;

    /// Dense attention over KV kept in vectors: the plainest possible reference.
    struct Dense {
        keys: Vec<Vec<f32>>,
        values: Vec<Vec<f32>>,
        cfg: ModelConfig,
    }

    impl DecodeAttention for Dense {
        fn attend(
            &mut self,
            layer: usize,
            q: &[f32],
            k: &[f32],
            v: &[f32],
            out: &mut [f32],
        ) -> Result<(), ModelError> {
            let c = &self.cfg;
            let (hd, nh, nkv) = (c.head_dim, c.num_heads, c.num_kv_heads);
            self.keys[layer].extend_from_slice(k);
            self.values[layer].extend_from_slice(v);
            let n = self.keys[layer].len() / (nkv * hd);
            for head in 0..nh {
                let kvh = head / (nh / nkv);
                let qv = &q[head * hd..(head + 1) * hd];
                let s: Vec<f32> = (0..n)
                    .map(|j| {
                        let kk = &self.keys[layer][(j * nkv + kvh) * hd..(j * nkv + kvh + 1) * hd];
                        qv.iter().zip(kk).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let w: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                let sum: f32 = w.iter().sum();
                for (j, wj) in w.iter().enumerate() {
                    let vv = &self.values[layer][(j * nkv + kvh) * hd..(j * nkv + kvh + 1) * hd];
                    for (o, x) in out[head * hd..(head + 1) * hd].iter_mut().zip(vv) {
                        *o += wj / sum * x;
                    }
                }
            }
            Ok(())
        }
    }

    #[test]
    fn decode_after_prefill_equals_longer_prefill() {
        for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
            let mut cfg = preset("tiny", arch).unwrap();
            cfg.vocab_size = 300;
            let wm = random_weights(&cfg, 3, KvDType::F32);
            let m = Model::from_weights(cfg.clone(), "t", wm, Arc::new(CpuBackend)).unwrap();
            let toks: Vec<u32> = (0..12).map(|i| (i * 37 % 300) as u32).collect();
            let pre = m.prefill(&toks[..11]).unwrap();
            let full = m.prefill(&toks).unwrap();
            let mut dense = Dense {
                keys: pre.keys.clone(),
                values: pre.values.clone(),
                cfg: cfg.clone(),
            };
            let logits = m.decode_step(&toks[11..], &[11], &mut dense).unwrap();
            for (a, b) in logits.iter().zip(&full.logits) {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                    "{arch:?}: {a} vs {b}"
                );
            }
            // The new token's KV equals the longer prefill's last row.
            assert_eq!(dense.keys[1].len(), full.keys[1].len());
            for (a, b) in dense.keys[1].iter().zip(&full.keys[1]) {
                assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0));
            }
        }
    }

    /// A backend that claims to keep the residual on a device: `skew` makes that path wrong
    /// (the residual scaled), as a faulty device kernel would.
    #[derive(Debug)]
    struct FakeDevice {
        on_device: std::sync::atomic::AtomicBool,
        skew: f32,
        /// Picks tokens "on the device" (the host's pick plus `pick_shift`).
        picks: std::sync::atomic::AtomicBool,
        pick_shift: u32,
    }

    impl FakeDevice {
        fn new(skew: f32, pick_shift: u32) -> Self {
            Self {
                on_device: true.into(),
                skew,
                picks: true.into(),
                pick_shift,
            }
        }
    }

    impl Backend for FakeDevice {
        fn name(&self) -> String {
            "fake".into()
        }
        fn linear(
            &self,
            x: &[f32],
            batch: usize,
            w: &Tensor,
            bias: Option<&[f32]>,
            y: &mut [f32],
        ) -> Result<(), crate::backend::BackendError> {
            CpuBackend.linear(x, batch, w, bias, y)
        }
        fn residual<'a>(
            &'a self,
            mut x: Vec<f32>,
            batch: usize,
        ) -> Result<Box<dyn Residual + 'a>, crate::backend::BackendError> {
            if self.residual_on_device() {
                x.iter_mut().for_each(|v| *v *= self.skew);
            }
            Ok(Box::new(crate::model::pick::PickingResidual {
                inner: HostResidual::new(self, x, batch),
                shift: self.picks_on_device().then_some(self.pick_shift),
                picked: Default::default(),
            }))
        }
        fn picks_on_device(&self) -> bool {
            self.residual_on_device() && self.picks.load(std::sync::atomic::Ordering::Relaxed)
        }
        fn keep_picks_on_host(&self) {
            self.picks
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
        fn residual_on_device(&self) -> bool {
            self.on_device.load(std::sync::atomic::Ordering::Relaxed)
        }
        fn keep_residual_on_host(&self) {
            self.on_device
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
    }

    #[test]
    fn a_device_residual_that_disagrees_with_the_host_path_is_turned_off_at_load() {
        let mut cfg = preset("tiny", Arch::Llama).unwrap();
        cfg.vocab_size = 300;
        let toks = [5u32, 77];
        let reference = Model::from_weights(
            cfg.clone(),
            "t",
            random_weights(&cfg, 4, KvDType::F32),
            Arc::new(CpuBackend),
        )
        .unwrap()
        .decode_step(&toks, &[0, 1], &mut SelfAttention::of(&cfg))
        .unwrap();
        for (skew, kept) in [(1.0, true), (1.5, false)] {
            let b = Arc::new(FakeDevice::new(skew, 0));
            let wm = random_weights(&cfg, 4, KvDType::F32);
            let m = Model::from_weights(cfg.clone(), "t", wm, b.clone()).unwrap();
            assert_eq!(b.residual_on_device(), kept, "skew {skew}");
            // Whatever the check decided, decoding now gives the host path's logits.
            let got = m
                .decode_step(&toks, &[0, 1], &mut SelfAttention::of(&cfg))
                .unwrap();
            assert_eq!(got, reference, "skew {skew}");
        }
    }

    #[test]
    fn device_picks_that_disagree_with_the_host_are_turned_off_at_load() {
        let mut cfg = preset("tiny", Arch::Llama).unwrap();
        cfg.vocab_size = 300;
        let toks = [5u32, 77];
        let specs = [Some(PickSpec::greedy(2)), None];
        for (shift, kept) in [(0, true), (1, false)] {
            let b = Arc::new(FakeDevice::new(1.0, shift));
            let wm = random_weights(&cfg, 4, KvDType::F32);
            let m = Model::from_weights(cfg.clone(), "t", wm, b.clone()).unwrap();
            assert!(b.residual_on_device());
            assert_eq!(b.picks_on_device(), kept, "shift {shift}");
            let logits = m
                .decode_step(&toks, &[0, 1], &mut SelfAttention::of(&cfg))
                .unwrap();
            let rows = m
                .decode_step_picking(&toks, &[0, 1], &mut SelfAttention::of(&cfg), &specs)
                .unwrap();
            // A row without a spec always comes back as logits; one with a spec is picked
            // where the device is trusted, and then as the host picks.
            assert_eq!(rows[1], RowOut::Logits(logits[300..].to_vec()));
            match &rows[0] {
                RowOut::Picked(p) => {
                    assert!(kept);
                    assert_eq!(
                        Some(p.clone()),
                        pick_row(&logits[..300], &specs[0].unwrap())
                    );
                }
                RowOut::Logits(l) => {
                    assert!(!kept);
                    assert_eq!(l[..], logits[..300]);
                }
            }
        }
    }

    #[test]
    fn refuses_out_of_vocab_tokens() {
        let cfg = preset("tiny", Arch::Llama).unwrap();
        let m = Model::from_weights(
            cfg.clone(),
            "t",
            random_weights(&cfg, 1, KvDType::F32),
            Arc::new(CpuBackend),
        )
        .unwrap();
        assert!(matches!(m.prefill(&[1, 999]), Err(ModelError::Input(_))));
        assert!(matches!(m.prefill(&[]), Err(ModelError::Input(_))));
    }

    #[test]
    fn tiled_causal_attention_equals_the_definition() {
        // More tokens than one query tile, GQA groups of 3, a prompt not a tile multiple.
        let (n, nh, nkv, hd) = (PREFILL_QUERY_TILE * 2 + 9, 6, 2, 8);
        let val = |i: usize, s: usize| (((i * 31 + s * 17) % 23) as f32 - 11.0) * 0.05;
        let q: Vec<f32> = (0..n * nh * hd).map(|i| val(i, 1)).collect();
        let k: Vec<f32> = (0..n * nkv * hd).map(|i| val(i, 2)).collect();
        let v: Vec<f32> = (0..n * nkv * hd).map(|i| val(i, 3)).collect();
        let scale = 0.3;
        let got = causal_attention(&q, &k, &v, n, nh, nkv, hd, scale);
        for t in 0..n {
            for head in 0..nh {
                let kvh = head / (nh / nkv);
                let qv = &q[(t * nh + head) * hd..][..hd];
                let s: Vec<f64> = (0..=t)
                    .map(|j| {
                        let kv = &k[(j * nkv + kvh) * hd..][..hd];
                        qv.iter()
                            .zip(kv)
                            .map(|(a, b)| f64::from(a * b))
                            .sum::<f64>()
                            * f64::from(scale)
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for d in 0..hd {
                    let want: f64 = (0..=t)
                        .map(|j| (s[j] - m).exp() / z * f64::from(v[(j * nkv + kvh) * hd + d]))
                        .sum();
                    let g = got[(t * nh + head) * hd + d];
                    assert!(
                        (f64::from(g) - want).abs() < 1e-5,
                        "t {t} head {head} d {d}"
                    );
                }
            }
        }
    }
}
