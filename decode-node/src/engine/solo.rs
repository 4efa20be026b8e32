//! One sequence decoded with the engine's own attention, outside the step loop: the fidelity
//! bench forces tokens through it (teacher forcing) and compares logits across modes, and
//! tests drive single steps with it. Each step is exactly what the step loop does for one
//! request: [`BatchAttention`] for the attention, then [`append_step`].

use std::sync::Arc;

use attention::{AttentionConfig, SeqAttention, SeqStats};
use kv_transfer::{CommittedKv, HostPool};

use super::attend::{AttnTiming, BatchAttention, GuardCheck, SeqSlot, Shape};
use crate::model::{Model, ModelError};

/// Appends one step's K and V of `token` (`[layer][num_kv_heads * head_dim]`) to the host KV and the
/// attention state. The KV must be unshared (every CPU part of the step has answered).
pub(crate) fn append_step(
    kv: &mut Arc<CommittedKv>,
    seq: &mut SeqAttention,
    cfg: &AttentionConfig,
    token: u32,
    ks: &[Vec<f32>],
    vs: &[Vec<f32>],
) -> Result<(), kv_transfer::Error> {
    let kv = Arc::get_mut(kv)
        .ok_or_else(|| kv_transfer::Error::Config("KV still shared after the step".into()))?;
    for (l, (k, v)) in ks.iter().zip(vs).enumerate() {
        kv.append(l, k, v)?;
    }
    kv.advance(token);
    for (l, k) in ks.iter().enumerate() {
        seq.append_token(cfg, l, k);
    }
    seq.advance();
    Ok(())
}

/// A single sequence and its attention state.
#[derive(Debug)]
pub struct SoloDecoder<'a> {
    model: &'a Model,
    cfg: &'a AttentionConfig,
    cpu_pool: &'a rayon::ThreadPool,
    kv: Arc<CommittedKv>,
    seq: SeqAttention,
    timing: AttnTiming,
    guard: Vec<GuardCheck>,
}

impl<'a> SoloDecoder<'a> {
    /// Decoder over committed `kv`, with host KV reserved from `pool` for `max_new` tokens.
    pub fn new(
        model: &'a Model,
        cfg: &'a AttentionConfig,
        cpu_pool: &'a rayon::ThreadPool,
        pool: &HostPool,
        mut kv: CommittedKv,
        max_new: usize,
    ) -> Result<Self, kv_transfer::Error> {
        // The pool blocks the step loop would take: growth, and the sketch where the host
        // keeps one.
        let geom = *kv.geometry();
        let sketch = super::admission::SketchSlots::of_node(cfg, &geom, kv.num_layers(), false);
        let positions = kv.num_tokens() + max_new + 1;
        let sketch_pages = sketch.map_or(0, |s| s.pool_pages(positions, geom.num_kv_heads));
        let mut r = pool.reserve(kv.blocks_to_grow(max_new + 1) + sketch_pages)?;
        let pages = super::running::take_pages(&mut r, sketch_pages);
        kv.grow(r);
        let digests = kv.take_digests();
        let mut seq = SeqAttention::new(geom, kv.num_layers(), kv.num_tokens(), digests);
        if let Some(s) = sketch {
            seq.keep_sketch(cfg, pages, s.tokens_per_slot);
        }
        Ok(Self {
            model,
            cfg,
            cpu_pool,
            kv: Arc::new(kv),
            seq,
            timing: AttnTiming::default(),
            guard: Vec::new(),
        })
    }

    /// Feeds `token` at the next position; returns the logits of the position after it.
    pub fn step(&mut self, token: u32) -> Result<Vec<f32>, ModelError> {
        let c = &self.model.cfg;
        let (nl, width) = (c.num_layers, c.num_kv_heads * c.head_dim);
        let shape = Shape {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            scale: self.model.attn_scale(),
        };
        let position = self.kv.num_tokens();
        let slot = SeqSlot {
            kv: &self.kv,
            seq: &mut self.seq,
            dev: None,
            new_k: vec![vec![0.0; width]; nl],
            new_v: vec![vec![0.0; width]; nl],
            device_wait: 0.0,
        };
        let mut batch = BatchAttention::new(self.cfg, shape, self.cpu_pool, vec![slot]);
        let logits = self.model.decode_step(&[token], &[position], &mut batch);
        self.timing.add(&batch.timing);
        self.guard.append(&mut batch.guard_checks);
        let slot = batch.slots.pop();
        let logits = logits?;
        let (ks, vs) = slot
            .map(|s| (s.new_k, s.new_v))
            .ok_or_else(|| ModelError::Attention("the step lost its sequence".into()))?;
        append_step(&mut self.kv, &mut self.seq, self.cfg, token, &ks, &vs)
            .map_err(|e| ModelError::Attention(format!("appending KV: {e}")))?;
        Ok(logits)
    }

    /// The sequence's attention counters.
    pub fn stats(&self) -> &SeqStats {
        self.seq.stats()
    }

    /// Seconds of CPU-side attention work so far (every CPU part, redone ones included).
    pub fn cpu_seconds(&self) -> f64 {
        self.timing.cpu
    }

    /// Every guard check so far: (layer, lowest query cosine, redone).
    pub fn guard_checks(&self) -> impl Iterator<Item = (usize, f32, bool)> + '_ {
        self.guard.iter().map(|g| (g.layer, g.cosine, g.fell_back))
    }
}
