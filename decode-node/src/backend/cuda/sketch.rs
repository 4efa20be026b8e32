//! A sequence's 4-bit key sketch on the device (`attention::sketch`) and the block scores of
//! `--block-scorer sketch` computed from it: selection then reads no host KV and costs two
//! kernel launches and one small copy back per layer.
//!
//! The sketch of each layer is one allocation, `[num_kv_heads][cap][head_dim / 2]` nibbles
//! then `[num_kv_heads][cap]` f32 scales, filled from the host pool as tokens arrive (the
//! prompt on a layer's first scoring, then the tokens appended since). Outgrowing `cap`
//! allocates twice the room and sketches the layer again from the host.

use attention::sketch::{nibble_bytes, sketch_tokens};
use attention::{BlockGeometry, GroupScore, KvSource};
use rayon::prelude::*;

use super::driver::Pinned;
use super::{DevBuf, Shared, f32_bytes, htod};
use crate::backend::BackendError;

/// Query heads per KV head, and head dims, the kernels take (`sketch_lse`'s registers and
/// its whole 16-byte loads).
const MAX_GROUP: usize = 8;
const MAX_HEAD_DIM: usize = 128;
/// Blocks one `sketch_lse` CUDA block scores (one per warp: the kernels' `SKETCH_WARPS`).
const SKETCH_WARPS: usize = 4;
/// Tokens sketched per host task when a layer is filled: big enough to amortise a task,
/// small enough that a long prompt's layer spreads over every core.
const FILL_TOKENS: usize = 2048;
/// Fills up to this many tokens a head go up through page-locked staging, so the copy
/// does not wait for the stream's queued work (a copy from pageable memory may); a longer
/// fill (a prompt) is a one-off and goes straight from the host buffers.
const STAGED_TOKENS: usize = 64;

/// One layer's sketch.
#[derive(Debug, Default)]
struct Layer {
    buf: DevBuf,
    /// Tokens per KV head the buffer has room for.
    cap: usize,
    /// Tokens sketched so far.
    done: usize,
}

/// A sequence's sketch, every layer, and the scratch of its scoring.
#[derive(Debug)]
pub(super) struct SeqSketch {
    layers: Vec<Layer>,
    lse: DevBuf,
    scores: DevBuf,
    /// The query, then a short fill's nibbles and scales, on their way up. Reused once the
    /// last call's copy back (which follows every copy up in stream order) has finished.
    staging: Pinned,
    /// Where the staged query lands.
    q: DevBuf,
}

impl Default for SeqSketch {
    fn default() -> Self {
        Self {
            layers: Vec::new(),
            lse: DevBuf::default(),
            scores: DevBuf::default(),
            staging: Pinned::empty(),
            q: DevBuf::default(),
        }
    }
}

/// True when the sketch kernels take this shape.
pub(super) fn supported(geom: &BlockGeometry, group: usize) -> bool {
    let d = geom.head_dim;
    d.is_multiple_of(32) && d <= MAX_HEAD_DIM && (1..=MAX_GROUP).contains(&group)
}

impl SeqSketch {
    /// Brings `layer`'s sketch up to `kv`'s tokens: the ones not sketched yet are quantized
    /// here and copied up (all of them after a growth).
    /// `staging_offset`: floats of the staging buffer already holding this call's query.
    fn fill(
        &mut self,
        sh: &Shared,
        geom: &BlockGeometry,
        kv: &dyn KvSource,
        layer: usize,
        staging_offset: usize,
    ) -> Result<u64, BackendError> {
        if self.layers.len() <= layer {
            self.layers.resize_with(layer + 1, Layer::default);
        }
        let (hk, d) = (geom.num_kv_heads, geom.head_dim);
        let nb = nibble_bytes(d);
        let n = kv.num_tokens();
        let Self {
            layers, staging, ..
        } = self;
        let l = &mut layers[layer];
        if n > l.cap {
            l.cap = (2 * l.cap).max(n + 256).next_multiple_of(256);
            l.done = 0;
        }
        let cap = l.cap;
        let base = l.buf.ptr(&sh.stream, hk * cap * (nb + 4))?;
        let (from, to) = (l.done, n);
        if from < to {
            // Every head's new tokens, quantized in pieces on the host in parallel.
            let pieces: Vec<(usize, usize)> = (0..hk)
                .flat_map(|h| (from..to).step_by(FILL_TOKENS).map(move |t| (h, t)))
                .collect();
            let made: Vec<(usize, usize, Vec<u8>, Vec<f32>)> = pieces
                .into_par_iter()
                .map(|(h, t)| {
                    let end = (t + FILL_TOKENS).min(to);
                    let mut nib = vec![0u8; (end - t) * nb];
                    let mut scales = vec![0f32; end - t];
                    sketch_tokens(geom, kv, layer, h, t, end, &mut nib, &mut scales);
                    (h, t, nib, scales)
                })
                .collect();
            let scales_at = base + (hk * cap * nb) as u64;
            if to - from <= STAGED_TOKENS {
                // Nibble rows are whole f32 words (head_dim is a multiple of 32).
                let words: usize = made.iter().map(|m| m.2.len() / 4 + m.3.len()).sum();
                let stage = staging.get(staging_offset + words)?;
                let mut at = staging_offset;
                for (h, t, nib, scales) in &made {
                    let row = (h * cap + t) as u64;
                    let w = nib.len() / 4;
                    for (dst, src) in stage[at..at + w].iter_mut().zip(nib.chunks_exact(4)) {
                        *dst = f32::from_ne_bytes([src[0], src[1], src[2], src[3]]);
                    }
                    htod(
                        base + row * nb as u64,
                        f32_bytes(&stage[at..at + w]),
                        &sh.stream,
                    )?;
                    at += w;
                    stage[at..at + scales.len()].copy_from_slice(scales);
                    htod(
                        scales_at + row * 4,
                        f32_bytes(&stage[at..at + scales.len()]),
                        &sh.stream,
                    )?;
                    at += scales.len();
                }
            } else {
                for (h, t, nib, scales) in &made {
                    let row = (h * cap + t) as u64;
                    htod(base + row * nb as u64, nib, &sh.stream)?;
                    htod(scales_at + row * 4, f32_bytes(scales), &sh.stream)?;
                }
            }
            l.done = to;
        }
        Ok(base)
    }

    /// Scores of blocks `0 .. blocks` of `layer` for every KV head (`q` is
    /// `[num_kv_heads][G][head_dim]`), as `attention::sketch::scores_from_sketch` gives them
    /// over `kv`'s tokens: one launch of each kernel and one wait for the copy back.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn scores(
        &mut self,
        sh: &Shared,
        geom: &BlockGeometry,
        kv: &dyn KvSource,
        layer: usize,
        q: &[f32],
        scale: f32,
        how: GroupScore,
        blocks: usize,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        let (hk, d, bs) = (geom.num_kv_heads, geom.head_dim, geom.block_size);
        let group = q.len() / (hk * d).max(1);
        if !supported(geom, group) || q.len() != hk * group * d {
            return Err(BackendError::Unsupported(format!(
                "sketch scores with {} query floats for {hk} KV heads of head_dim {d} (kernels: head_dim a multiple of 32 up to {MAX_HEAD_DIM}, at most {MAX_GROUP} query heads per KV head)",
                q.len()
            )));
        }
        let n = kv.num_tokens().min(blocks * bs);
        if blocks == 0 || n <= (blocks - 1) * bs {
            // Nothing to score, or a block past the tokens: the host answers that.
            return Err(BackendError::Unsupported(format!(
                "sketch scores of {blocks} blocks over {n} tokens"
            )));
        }
        sh.bind()?;
        sh.idle.busy();
        let qp = self.q.ptr(&sh.stream, q.len() * 4)?;
        // Room for the query and the longest staged fill at once: growing the buffer later
        // would free memory a queued copy still reads.
        let fill_words = hk * STAGED_TOKENS * (nibble_bytes(d) / 4 + 1);
        let staged = &mut self.staging.get(q.len() + fill_words)?[..q.len()];
        staged.copy_from_slice(q);
        htod(qp, f32_bytes(staged), &sh.stream)?;
        let base = self.fill(sh, geom, kv, layer, q.len())?;
        let cap = self.layers[layer].cap;
        let nib = base;
        let scl = base + (hk * cap * nibble_bytes(d)) as u64;
        let lse = self.lse.ptr(&sh.stream, hk * blocks * group * 4)?;
        let out = self.scores.ptr(&sh.stream, hk * blocks * 4)?;
        let temp = scale * std::f32::consts::LOG2_E;
        let as_i32 = |x: usize, what: &str| {
            i32::try_from(x).map_err(|_| BackendError::Unsupported(format!("{what} {x}")))
        };
        let (n32, bs32, blocks32) = (
            as_i32(n, "tokens")?,
            as_i32(bs, "block size")?,
            as_i32(blocks, "blocks")?,
        );
        let (g32, d32) = (as_i32(group, "group")?, as_i32(d, "head_dim")?);
        let how32: i32 = match how {
            GroupScore::Max => 0,
            GroupScore::Sum => 1,
        };
        let grid_x = u32::try_from(blocks.div_ceil(SKETCH_WARPS))
            .map_err(|_| BackendError::Unsupported(format!("{blocks} blocks")))?;
        let hk32 = hk as u32;
        let cap64 = cap as i64;
        // SAFETY: the buffers hold what the kernels index: the sketch [hk][cap] rows with
        // n <= cap filled, q [hk][G][D], lse [hk][blocks][G] and scores [hk][blocks]; the
        // argument types are the kernels'.
        unsafe {
            sh.launch(
                &sh.k.sketch_lse,
                (grid_x, hk32),
                (SKETCH_WARPS * 32) as u32,
                &[
                    &nib, &scl, &cap64, &n32, &bs32, &blocks32, &qp, &g32, &d32, &temp, &lse,
                ],
            )?;
            sh.launch(
                &sh.k.sketch_shares,
                (hk32, 1),
                256,
                &[&lse, &blocks32, &g32, &how32, &out],
            )?;
        }
        let mut host = vec![0f32; hk * blocks];
        sh.read_back(&mut host, out)?;
        Ok(host.chunks_exact(blocks).map(<[f32]>::to_vec).collect())
    }
}
