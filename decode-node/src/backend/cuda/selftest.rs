//! `decode-node selftest --device cuda`: every device kernel against the CPU code on random
//! inputs. The end-to-end half (tokens equal to the CPU backend's) is in `commands`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use attention::cuda::NORM_THREADS;
use attention::{
    BlockGeometry, DeviceBlock, Digest, HeadBlock, KernelPath, KvDType, KvSource, Partial, Scratch,
    attend_blocks_on, decode_to_f32, encode_from_f32,
};
use cudarc::driver::{CudaSlice, DevicePtr};
use kv_transfer::HostPool;

use super::blas::Blas;
use super::driver::GEMV_MAX_BATCH;
use super::tactic::Tactic;
use super::{CudaBackend, Shared, dtype_code};
use crate::backend::{Backend, BackendError, CpuBackend, DeviceKv, LayerOut, LinearOut, Scored};
use crate::model::pick::{PickSpec, pick_row};
use crate::model::random::SplitMix;
use crate::tensor::Tensor;

/// One kernel's verdict.
#[derive(Debug, Clone)]
pub struct Check {
    /// What was checked.
    pub name: String,
    /// Largest error relative to the reference's magnitude.
    pub max_rel_err: f64,
    /// The bound it must stay under.
    pub tolerance: f64,
    /// A device error, if the check could not run.
    pub error: Option<String>,
}

impl Check {
    /// True when it ran and stayed within tolerance.
    pub fn passed(&self) -> bool {
        self.error.is_none() && self.max_rel_err <= self.tolerance
    }
}

fn random(r: &mut SplitMix, n: usize, amp: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (r.next_f64() as f32 - 0.5) * 2.0 * amp)
        .collect()
}

/// max |a - b| / max(max |b|, tiny): error relative to the reference's scale.
fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let scale = want
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f64, |m, x| m.max(x.abs() as f64))
        .max(1e-30);
    got.iter()
        .zip(want)
        .map(|(a, b)| {
            if a == b || (a.is_nan() && b.is_nan()) {
                0.0
            } else if !a.is_finite() || !b.is_finite() {
                f64::INFINITY
            } else {
                (*a as f64 - *b as f64).abs() / scale
            }
        })
        .fold(0.0, f64::max)
}

struct Dev<'a> {
    sh: &'a Shared,
    held: Vec<CudaSlice<u8>>,
}

impl Dev<'_> {
    fn up(&mut self, bytes: &[u8]) -> Result<u64, BackendError> {
        let s = self
            .sh
            .stream
            .clone_htod(&bytes.to_vec())
            .map_err(|e| super::dev_err("upload", e))?;
        let p = s.device_ptr(&self.sh.stream).0;
        self.held.push(s);
        Ok(p)
    }
    fn up_f32(&mut self, v: &[f32]) -> Result<u64, BackendError> {
        self.up(super::f32_bytes(v))
    }
    fn zeros(&mut self, n_f32: usize) -> Result<u64, BackendError> {
        self.up_f32(&vec![0f32; n_f32])
    }
    fn down(&self, p: u64, n: usize) -> Result<Vec<f32>, BackendError> {
        let mut v = vec![0f32; n];
        super::dtoh_f32(&mut v, p, &self.sh.stream)?;
        Ok(v)
    }
    fn down_u16(&self, p: u64, n: usize) -> Result<Vec<u16>, BackendError> {
        let mut v = vec![0f32; n.div_ceil(2)];
        super::dtoh_f32(&mut v, p, &self.sh.stream)?;
        Ok(v.iter()
            .flat_map(|f| {
                let b = f.to_le_bytes();
                [
                    u16::from_le_bytes([b[0], b[1]]),
                    u16::from_le_bytes([b[2], b[3]]),
                ]
            })
            .take(n)
            .collect())
    }
}

/// KV blocks in plain vectors, one layer.
struct Mem {
    blocks: Vec<Vec<u8>>,
    n: usize,
}

impl KvSource for Mem {
    fn block(&self, _layer: usize, block: usize) -> &[u8] {
        &self.blocks[block]
    }
    fn num_tokens(&self) -> usize {
        self.n
    }
}

/// KV blocks in the host pool, one layer.
struct PoolKv {
    blocks: Vec<kv_transfer::Block>,
    n: usize,
}

impl KvSource for PoolKv {
    fn block(&self, _layer: usize, block: usize) -> &[u8] {
        self.blocks[block].bytes()
    }
    fn num_tokens(&self) -> usize {
        self.n
    }
}

fn mem_kv(r: &mut SplitMix, geom: &BlockGeometry, n: usize) -> Mem {
    let blocks = (0..geom.blocks_for(n))
        .map(|b| {
            let mut blk = vec![0u8; geom.block_bytes()];
            for t in 0..(n - b * geom.block_size).min(geom.block_size) {
                for h in 0..geom.num_kv_heads {
                    let k = random(r, geom.head_dim, 1.0);
                    let v = random(r, geom.head_dim, 1.0);
                    geom.write_token(&mut blk, h, t, &k, &v);
                }
            }
            blk
        })
        .collect();
    Mem { blocks, n }
}

/// Runs every check; never panics on a device error (it is reported in the check).
pub fn run(backend: &CudaBackend) -> Vec<Check> {
    let mut out = Vec::new();
    let mut add = |name: &str, tolerance: f64, r: Result<f64, BackendError>| {
        out.push(match r {
            Ok(e) => Check {
                name: name.into(),
                max_rel_err: e,
                tolerance,
                error: None,
            },
            Err(e) => Check {
                name: name.into(),
                max_rel_err: f64::INFINITY,
                tolerance,
                error: Some(e.to_string()),
            },
        });
    };
    add(
        "gemv vs cuBLAS (batch 1-8, f16 and bf16, beta 0 and 1)",
        GEMV_TOLERANCE,
        backend
            .lock()
            .and_then(|g| gemv_vs_cublas(&g, Tactic::Gemv)),
    );
    if backend.lock().is_ok_and(|g| g.tactics.mma) {
        add(
            "gemv_tc (tensor cores) vs cuBLAS (batch 1-8, f16 and bf16, beta 0 and 1)",
            GEMV_TOLERANCE,
            backend
                .lock()
                .and_then(|g| gemv_vs_cublas(&g, Tactic::GemvTc)),
        );
    }
    for dt in [KvDType::F32, KvDType::F16, KvDType::Bf16] {
        add(
            &format!("linear (cuBLAS) {dt:?}"),
            1e-4,
            check_linear(backend, dt),
        );
    }
    for dt in [KvDType::F32, KvDType::Bf16] {
        for stacked in [false, true] {
            let how = if stacked { ", gate|up stacked" } else { "" };
            add(
                &format!("finish_layer one round trip vs op by op {dt:?}{how}"),
                super::layer::FUSED_TOLERANCE,
                check_finish_layer(backend, dt, stacked),
            );
        }
        add(
            &format!("q|k|v stacked: device residual and linear_many vs CPU {dt:?}"),
            super::layer::FUSED_TOLERANCE,
            check_stacked_projections(backend, dt),
        );
    }
    add(
        "a layer's second half replayed from a CUDA graph (3 rows in a bucket of 4) vs queued",
        GRAPH_TOLERANCE,
        check_graphs(backend),
    );
    let sh = backend.shared();
    add("f32_to_half", 0.0, check_f32_to_half(sh));
    add("rms_norm", 1e-5, check_rms_norm(sh, false));
    add("rms_norm_half (bf16)", 1e-2, check_rms_norm(sh, true));
    add("rope", 1e-5, check_rope(sh));
    add("silu_mul", 1e-5, check_silu(sh));
    add("quest_scores", 1e-5, check_quest(sh));
    add(
        "top_blocks (device block picks) vs best_in",
        0.0,
        check_top_blocks(sh),
    );
    add(
        "place_picks (lists of layers planned on the device) vs the host's",
        0.0,
        check_place_picks(sh),
    );
    add("lse2_merge", 1e-5, check_merge(sh));
    add(
        "lse2_merge of CPU partials landed after the stream's wait on their flag",
        1e-5,
        check_landing(sh),
    );
    add("kv_append", 0.0, check_append(sh));
    if super::driver::has_batch_copy() {
        add(
            "blocks up through the copy engines (cuMemcpyBatchAsync) vs the pool's bytes",
            0.0,
            check_batch_copy(sh, &three_heads(KvDType::Bf16, 128, 32)),
        );
    }
    add(
        "sample_rows (device picks) vs pick_row",
        1e-5,
        check_sample_rows(backend),
    );
    for (dt, g, d, bs) in [
        (KvDType::Bf16, 5, 128, 32),
        (KvDType::F16, 8, 64, 16),
        (KvDType::I8, 3, 128, 32),
    ] {
        add(
            &format!("sketch scores (prompt, a step, a regrowth) {dt:?} G={g} D={d} block {bs}"),
            SKETCH_TOLERANCE,
            check_sketch(sh, dt, g, d, bs),
        );
    }
    // Several blocks a warp, as a long context's call takes them (these calls are short).
    let per_warp = sh.sketch_blocks_per_warp.swap(3, Ordering::AcqRel);
    add(
        "sketch scores, 3 blocks a warp, Bf16 G=5 D=128 block 32",
        SKETCH_TOLERANCE,
        check_sketch(sh, KvDType::Bf16, 5, 128, 32),
    );
    sh.sketch_blocks_per_warp.store(per_warp, Ordering::Release);
    for (dt, g, d, bs) in [
        (KvDType::F16, 1, 64, 32),
        (KvDType::Bf16, 4, 128, 32),
        (KvDType::F16, 5, 128, 32),
        (KvDType::Bf16, 8, 128, 32),
        (KvDType::F32, 2, 128, 32),
        (KvDType::Bf16, 5, 64, 32),
        (KvDType::I8, 1, 64, 32),
        (KvDType::I8, 4, 128, 32),
        (KvDType::F8E4M3, 8, 128, 32),
        (KvDType::F8E4M3, 5, 64, 32),
        (KvDType::Bf16, 5, 128, 16),
        (KvDType::F16, 3, 64, 16),
    ] {
        // Each shape through the general kernel, then through `attend_warps` and `attend_tc`
        // where it has them, each without and with the prefetch of its next loads.
        let on = sh.warps_on.swap(false, Ordering::AcqRel);
        let tc_on = sh.tc_groups.swap(0, Ordering::AcqRel);
        let pf_on = sh.prefetch_groups.swap(0, Ordering::AcqRel);
        add(
            &format!("sparse_attention_split+combine {dt:?} G={g} D={d} block {bs}"),
            ATTENTION_TOLERANCE,
            check_split_attention(sh, dt, g, d, bs),
        );
        // The kernel now on for `g`, without and with the prefetch of its next loads.
        let mut both = |name: &str| {
            for pf in [false, true] {
                sh.prefetch_groups
                    .store(if pf { 1 << g } else { 0 }, Ordering::Release);
                let how = if pf { ", prefetching" } else { "" };
                add(
                    &format!("{name}+combine {dt:?} G={g} D={d} block {bs}{how}"),
                    ATTENTION_TOLERANCE,
                    check_split_attention(sh, dt, g, d, bs),
                );
            }
        };
        if sh.k.warps(dt, bs, g, d).is_some() {
            sh.warps_on.store(true, Ordering::Release);
            both("attend_warps");
        }
        if sh.mma && sh.k.tc(dt, bs, g, d).is_some() {
            sh.tc_groups.store(1 << g, Ordering::Release);
            both("attend_tc (tensor cores)");
        }
        sh.warps_on.store(on, Ordering::Release);
        sh.tc_groups.store(tc_on, Ordering::Release);
        sh.prefetch_groups.store(pf_on, Ordering::Release);
    }
    out
}

/// Checks `attend_warps` for every group it is built for at `dtype`, `block_size` and
/// `head_dim` and turns it off on `sh` where any disagrees with the CPU: attention then takes
/// the general kernel. Nothing to check where the shape has no `attend_warps` or it is off.
pub(super) fn check_warps_or_off(
    sh: &Arc<Shared>,
    dtype: KvDType,
    block_size: usize,
    head_dim: usize,
) {
    if !sh.warps_on.load(Ordering::Acquire) {
        return;
    }
    for g in 1..=super::driver::WARPS_MAX_GROUP {
        if sh.k.warps(dtype, block_size, g, head_dim).is_none() {
            return;
        }
        match check_split_attention(sh, dtype, g, head_dim, block_size) {
            Ok(err) if err <= ATTENTION_TOLERANCE => {}
            r => {
                tracing::error!(group = g, head_dim, block_size, result = ?r, "attend_warps disagrees with the CPU on this device; attention takes the general kernel");
                sh.warps_on.store(false, Ordering::Release);
                return;
            }
        }
    }
    tracing::info!(
        head_dim,
        block_size,
        "attend_warps agrees with the CPU on this device; using it"
    );
}

/// Checks the device's sketch scores against the host's at `geom`'s dtype, block size and
/// head dim (4 query heads per KV head) and turns them off on `sh` where they disagree or
/// fail: `--block-scorer sketch` then scores on the host. Nothing to check where the shape
/// has no sketch kernels or they are off.
pub(super) fn check_sketch_or_off(sh: &Arc<Shared>, geom: &BlockGeometry) {
    if !sh.sketch_on.load(Ordering::Acquire) || !super::sketch::supported(geom, 4) {
        return;
    }
    match check_sketch(sh, geom.dtype, 4, geom.head_dim, geom.block_size) {
        Ok(err) if err <= SKETCH_TOLERANCE => tracing::info!(
            err,
            "the device's sketch scores agree with the host's; sequences keep their sketch there"
        ),
        r => {
            tracing::error!(result = ?r, "the device's sketch scores disagree with the host's on this device; --block-scorer sketch scores on the host");
            sh.sketch_on.store(false, Ordering::Release);
        }
    }
}

/// A random bf16 model (the `small` preset) on a fresh backend of device `ordinal`.
fn selftest_model(ordinal: usize) -> Result<(Arc<CudaBackend>, crate::model::Model), String> {
    let backend = Arc::new(CudaBackend::new(ordinal).map_err(|e| e.to_string())?);
    let cfg = crate::model::random::preset("small", crate::model::Arch::Llama)
        .ok_or("no `small` preset")?;
    let wm = crate::model::random::random_weights(&cfg, 0x5e1f, KvDType::Bf16);
    let m = crate::model::Model::from_weights(cfg, "selftest", wm, backend.clone())
        .map_err(|e| e.to_string())?;
    Ok((backend, m))
}

/// A check from a model-level comparison: its error, or what went wrong.
fn model_check(name: &str, tolerance: f64, r: Result<f64, String>) -> Check {
    match r {
        Ok(e) => Check {
            name: name.into(),
            max_rel_err: e,
            tolerance,
            error: None,
        },
        Err(e) => Check {
            name: name.into(),
            max_rel_err: f64::INFINITY,
            tolerance,
            error: Some(e),
        },
    }
}

/// A random bf16 model's decode step with the residual in device memory against the host
/// path's, on device `ordinal`. A disagreement at load has already turned the device residual
/// off, which fails the check too.
pub fn check_device_residual(ordinal: usize) -> Check {
    let run = || -> Result<f64, String> {
        let (backend, m) = selftest_model(ordinal)?;
        if !backend.residual_on_device() {
            return Err("the model's check at load turned the device residual off".into());
        }
        match m.residual_diff().map_err(|e| e.to_string())? {
            (d, None) => Ok(d),
            (_, Some(e)) => Err(e.to_string()),
        }
    };
    model_check(
        "decode step, residual on the device vs on the host",
        crate::model::llama::RESIDUAL_TOLERANCE,
        run(),
    )
}

/// A random bf16 model's decode step whose layers run resident on the device (q/k/v
/// finished, attention over device slots and the token's own key, the second half: nothing
/// back until the LM head) against the host path's, over 40 tokens of KV in device slots, on
/// device `ordinal`. A disagreement at the engine's start turns the path off instead.
pub fn check_resident_layers(ordinal: usize) -> Check {
    let run = || -> Result<f64, String> {
        let (backend, m) = selftest_model(ordinal)?;
        if !backend.attention_on_device() {
            return Err("resident layers are off (DECODE_NODE_RESIDENT_LAYERS=0, or the device residual is off)".into());
        }
        let geom = BlockGeometry {
            block_size: 16,
            num_kv_heads: m.cfg.num_kv_heads,
            head_dim: m.cfg.head_dim,
            dtype: KvDType::Bf16,
        };
        let pool =
            HostPool::new(geom, 64 * geom.block_bytes() as u64).map_err(|e| e.to_string())?;
        let dev = backend
            .device_kv(geom, 1 << 28, &pool)
            .map_err(|e| e.to_string())?
            .ok_or("the CUDA backend gave no device KV")?;
        match crate::backend::resident::resident_diff(&m, &dev, &geom).map_err(|e| e.to_string())? {
            (d, None) => Ok(d),
            (_, Some(e)) => Err(e.to_string()),
        }
    };
    model_check(
        "decode step, layers resident on the device vs through the host",
        crate::model::llama::RESIDUAL_TOLERANCE,
        run(),
    )
}

/// A random bf16 model's tokens picked on the device (LM head and `sample_rows`) against the
/// host's picks from the same logits, on device `ordinal`.
pub fn check_device_picks(ordinal: usize) -> Check {
    let run = || -> Result<f64, String> {
        let (backend, m) = selftest_model(ordinal)?;
        if !backend.picks_on_device() {
            return Err("the model's check at load turned device picks off".into());
        }
        match m.picks_diff().map_err(|e| e.to_string())? {
            None => Ok(0.0),
            Some(why) => Err(why),
        }
    };
    model_check(
        "decode step, tokens picked on the device vs on the host",
        0.0,
        run(),
    )
}

/// `sample_rows` against [`pick_row`] on random logits: a Qwen-sized vocabulary and a small
/// one, flat and peaked, with ties, every mix of greedy, temperature, top-k (within the
/// sorted head and past it) and top-p, and a row with a NaN (left to the host). Any pick or
/// top-list id that differs is an error of 1; else the largest log-probability difference.
fn check_sample_rows(b: &CudaBackend) -> Result<f64, BackendError> {
    let mut r = SplitMix(23);
    let sh = b.shared();
    let mut worst = 0f64;
    for (vocab, spread, ties) in [
        (151_936, 12.0, false),
        (1000, 3.0, true),
        (49_152, 30.0, false),
    ] {
        let mut picks = Vec::new();
        let mut logits = Vec::new();
        for row in 0..12 {
            let mut l = random(&mut r, vocab, spread);
            if ties {
                l.iter_mut().for_each(|v| *v = v.round());
            }
            if row == 11 {
                l[vocab / 2] = f32::NAN;
            }
            logits.extend(l);
            let tempered = row % 4 != 0;
            picks.push(Some(PickSpec {
                temperature: if tempered {
                    0.3 + row as f32 * 0.1
                } else {
                    0.0
                },
                top_k: [0, 40, 256, 1000][row % 4],
                top_p: [0.0, 0.9, 0.5][row % 3],
                draw: tempered.then(|| r.next_f64()),
                top_logprobs: row % 7 * 3,
            }));
        }
        let mut dev = Dev { sh, held: vec![] };
        let lp = dev.up_f32(&logits)?;
        let got = {
            let mut g = b.lock()?;
            super::pick::sample_rows(sh, &mut g, lp, vocab, &picks)?
        };
        for (i, (got, spec)) in got.iter().zip(&picks).enumerate() {
            let want = spec.and_then(|s| pick_row(&logits[i * vocab..(i + 1) * vocab], &s));
            match (got, &want) {
                (None, None) => {}
                (Some(g), Some(w))
                    if g.token == w.token
                        && g.top.len() == w.top.len()
                        && g.top.iter().zip(&w.top).all(|(a, b)| a.0 == b.0) =>
                {
                    let d = |a: f32, b: f32| f64::from((a - b).abs()) / f64::from(b.abs().max(1.0));
                    worst = worst.max(d(g.logprob, w.logprob));
                    for (a, b) in g.top.iter().zip(&w.top) {
                        worst = worst.max(d(a.1, b.1));
                    }
                }
                _ => {
                    tracing::error!(vocab, row = i, ?got, ?want, "sample_rows disagrees");
                    return Ok(1.0);
                }
            }
        }
    }
    Ok(worst)
}

/// A layer's second half with random weights of one type at SmolLM2's widths.
struct SecondHalf {
    hidden: usize,
    attn_w: usize,
    o: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    norm: Vec<f32>,
}

impl SecondHalf {
    fn random(r: &mut SplitMix, dt: KvDType) -> Self {
        let (hidden, attn_w, inter) = (576, 576, 1536);
        let mut tensor = |rows: usize, cols: usize| {
            let v = random(r, rows * cols, 0.05);
            let mut bytes = vec![0u8; v.len() * dt.size()];
            encode_from_f32(dt, &v, &mut bytes);
            Tensor::from_bytes(vec![rows, cols], dt, bytes)
        };
        let (o, gate, up, down) = (
            tensor(hidden, attn_w),
            tensor(inter, hidden),
            tensor(inter, hidden),
            tensor(hidden, inter),
        );
        Self {
            hidden,
            attn_w,
            o,
            gate,
            up,
            down,
            norm: random(r, hidden, 1.0),
        }
    }

    fn out(&self) -> LayerOut<'_> {
        LayerOut {
            o: &self.o,
            post_norm: &self.norm,
            eps: 1e-6,
            gate: &self.gate,
            up: &self.up,
            down: &self.down,
        }
    }
}

/// The fused second half of a layer against the op-by-op one on the same device (SmolLM2's
/// widths, three rows).
fn check_finish_layer(b: &CudaBackend, dt: KvDType, stacked: bool) -> Result<f64, BackendError> {
    let mut r = SplitMix(21);
    let n = 3;
    let l = SecondHalf::random(&mut r, dt);
    if stacked {
        // The fused path then projects gate|up with one GEMM; op by op, each part alone.
        b.prepare_stack(&[&l.gate, &l.up])?;
    }
    let x = random(&mut r, n * l.hidden, 1.0);
    let attn = random(&mut r, n * l.attn_w, 1.0);
    let w = l.out();
    let mut want = x.clone();
    let mut got = x;
    let res = crate::backend::finish_layer_unfused(b, &mut want, &attn, n, w)
        .and_then(|()| b.finish_layer_fused(&mut got, &attn, n, &w));
    b.clear_weights()?;
    res?;
    Ok(super::layer::rel_diff(&got, &want))
}

/// Largest relative difference a replayed piece may show against it queued: the same
/// kernels over the same bytes give 0; the slack only admits a library whose reductions are
/// not bit for bit repeatable. A wrong replay (stale inputs, another shape) is far past it.
const GRAPH_TOLERANCE: f64 = 1e-6;

/// A layer's second half (SmolLM2's widths, bf16, gate|up stacked) over 3 rows padded to a
/// bucket of 4, through a graph (queued, captured, replayed over four inputs) against the
/// piece queued as it is ([`GRAPH_TOLERANCE`]); the padding row must stay exactly zero.
fn check_graphs(b: &CudaBackend) -> Result<f64, BackendError> {
    let mut r = SplitMix(31);
    let (n, rows) = (3, 4);
    let l = SecondHalf::random(&mut r, KvDType::Bf16);
    b.prepare_stack(&[&l.gate, &l.up])?;
    let inputs: Vec<(Vec<f32>, Vec<f32>)> = (0..4)
        .map(|_| {
            (
                random(&mut r, n * l.hidden, 1.0),
                random(&mut r, n * l.attn_w, 1.0),
            )
        })
        .collect();
    let res = b.second_half_replay_diff(&l.out(), n, rows, &inputs);
    // At start-up the model's weights may be on the device already: only these go.
    b.forget_weights(&[&l.o, &l.gate, &l.up, &l.down])?;
    res
}

/// Head blocks of a page-locked pool copied to arena slots with one batched copy through the
/// copy engines (`cuMemcpyBatchAsync`), read back: the bytes that differ (0).
fn check_batch_copy(sh: &Arc<Shared>, geom: &BlockGeometry) -> Result<f64, BackendError> {
    let mut r = SplitMix(41);
    let blocks = 6;
    let err = |e: kv_transfer::Error| BackendError::Device(e.to_string());
    let pool = HostPool::new(*geom, (blocks * geom.block_bytes()) as u64).map_err(err)?;
    let mut res = pool.reserve(blocks).map_err(err)?;
    let mut held = Vec::with_capacity(blocks);
    for _ in 0..blocks {
        let mut blk = res
            .take()
            .ok_or_else(|| BackendError::Device("pool reservation short".into()))?;
        for b in blk.bytes_mut() {
            *b = (r.next_u64() >> 56) as u8;
        }
        held.push(blk);
    }
    let hb = geom.head_bytes();
    let sources: Vec<&[u8]> = held
        .iter()
        .flat_map(|b| b.bytes().chunks_exact(hb))
        .collect();
    let arena = (sources.len() * hb) as u64;
    let store = super::store::CudaKvStore::new(Arc::clone(sh), *geom, arena, &pool)?;
    store.batch_copy_mismatches(&sources).map(|d| d as f64)
}

/// With `DECODE_NODE_RECALL_COPY=engine`, turns batched copies off where they do not copy
/// the pool's bytes on this device (or the driver has none).
pub(super) fn check_batch_copy_or_off(sh: &Arc<Shared>, geom: &BlockGeometry) {
    if !sh.engine_copies.load(Ordering::Acquire) {
        return;
    }
    match check_batch_copy(sh, geom) {
        Ok(0.0) => {}
        r => {
            tracing::error!(result = ?r, "batched copies through the copy engines do not copy the pool's blocks on this device; blocks go up by the gather kernel");
            sh.engine_copies.store(false, Ordering::Release);
        }
    }
}

/// With `DECODE_NODE_GRAPHS=on`, turns graphs off where a replay disagrees with the piece
/// queued as it is on this device (or the capture fails).
pub(super) fn check_graphs_or_off(b: &CudaBackend) {
    if b.lock().is_ok_and(|g| g.graphs.cache.why_off().is_some()) {
        return;
    }
    match check_graphs(b) {
        Ok(e) if e <= GRAPH_TOLERANCE => {}
        r => {
            tracing::error!(result = ?r, "a layer's second half replayed from a CUDA graph disagrees with it queued on this device; graphs are off");
            if let Ok(mut g) = b.lock() {
                g.graphs
                    .cache
                    .turn_off(format!("the start-up check found {r:?}"));
            }
        }
    }
}

/// Three projections of one input uploaded as one stack (q|k|v of a layer, with a bias on k):
/// through the device residual (one GEMM for the stack, rows regrouped on the host) and
/// through `linear_many` (each part addressed inside the stack), against the CPU, three rows.
fn check_stacked_projections(b: &CudaBackend, dt: KvDType) -> Result<f64, BackendError> {
    let mut r = SplitMix(24);
    let (n, hidden) = (3, 256);
    let mut tensor = |rows: usize| {
        let v = random(&mut r, rows * hidden, 0.1);
        let mut bytes = vec![0u8; v.len() * dt.size()];
        encode_from_f32(dt, &v, &mut bytes);
        Tensor::from_bytes(vec![rows, hidden], dt, bytes)
    };
    let (q, k, v) = (tensor(64), tensor(32), tensor(32));
    let bias = random(&mut r, 32, 0.1);
    let norm = random(&mut r, hidden, 1.0);
    let x = random(&mut r, n * hidden, 1.0);
    let run = || -> Result<f64, BackendError> {
        b.prepare_stack(&[&q, &k, &v])?;
        // The reference: the norm on the CPU, its rows rounded to the weights' type as the
        // device rounds them, each projection alone.
        let mut xn = vec![0f32; x.len()];
        CpuBackend.rms_norm(&x, &norm, 1e-6, &mut xn);
        let mut xb = vec![0u8; xn.len() * dt.size()];
        encode_from_f32(dt, &xn, &mut xb);
        decode_to_f32(dt, &xb, &mut xn);
        let mut want = [vec![0f32; n * 64], vec![0f32; n * 32], vec![0f32; n * 32]];
        for (w, (y, bias)) in
            [&q, &k, &v]
                .into_iter()
                .zip(want.iter_mut().zip([None, Some(&bias[..]), None]))
        {
            CpuBackend.linear(&xn, n, w, bias, y)?;
        }
        let mut worst = 0f64;
        let mut got = [vec![0f32; n * 64], vec![0f32; n * 32], vec![0f32; n * 32]];
        {
            let [gq, gk, gv] = &mut got[..] else {
                unreachable!("three outputs")
            };
            let mut res = b.residual(x.clone(), n)?;
            let outs = &mut [
                LinearOut {
                    w: &q,
                    bias: None,
                    y: gq,
                },
                LinearOut {
                    w: &k,
                    bias: Some(&bias),
                    y: gk,
                },
                LinearOut {
                    w: &v,
                    bias: None,
                    y: gv,
                },
            ];
            res.norm_project(&mut [crate::backend::NormProject {
                norm: &norm,
                eps: 1e-6,
                outs,
            }])?;
        }
        for (g, w) in got.iter().zip(&want) {
            worst = worst.max(rel_err(g, w));
        }
        {
            let [gq, gk, gv] = &mut got[..] else {
                unreachable!("three outputs")
            };
            b.linear_many(
                &xn,
                n,
                &mut [
                    LinearOut {
                        w: &q,
                        bias: None,
                        y: gq,
                    },
                    LinearOut {
                        w: &k,
                        bias: Some(&bias),
                        y: gk,
                    },
                    LinearOut {
                        w: &v,
                        bias: None,
                        y: gv,
                    },
                ],
            )?;
        }
        for (g, w) in got.iter().zip(&want) {
            worst = worst.max(rel_err(g, w));
        }
        Ok(worst)
    };
    let res = run();
    b.clear_weights()?;
    res
}

fn check_linear(b: &CudaBackend, dt: KvDType) -> Result<f64, BackendError> {
    let mut r = SplitMix(11);
    let (out, inp, batch) = (300, 260, 3);
    let wv = random(&mut r, out * inp, 0.1);
    let mut wb = vec![0u8; wv.len() * dt.size()];
    encode_from_f32(dt, &wv, &mut wb);
    let w = Tensor::from_bytes(vec![out, inp], dt, wb);
    let x = random(&mut r, batch * inp, 1.0);
    let bias = random(&mut r, out, 0.1);
    // The device multiplies activations rounded to the weights' type.
    let mut xb = vec![0u8; x.len() * dt.size()];
    encode_from_f32(dt, &x, &mut xb);
    let mut xr = vec![0f32; x.len()];
    decode_to_f32(dt, &xb, &mut xr);
    let mut want = vec![0f32; batch * out];
    CpuBackend.linear(&xr, batch, &w, Some(&bias), &mut want)?;
    let mut got = vec![0f32; batch * out];
    let res = b.linear(&x, batch, &w, Some(&bias), &mut got);
    b.clear_weights()?;
    res?;
    Ok(rel_err(&got, &want))
}

/// How far `gemv_b{B}` and `gemv_tc` may be from cuBLAS (relative to the product's scale):
/// all sum in f32, in different orders.
pub(super) const GEMV_TOLERANCE: f64 = 1e-4;

/// Largest difference of the small-batch kernel `tactic` from cuBLAS GemmEx (relative to the
/// reference's scale) over batches 1 ..= 8, f16 and bf16, beta 0 and 1, on random data with a
/// width that leaves the kernels a tail (`gemv_tc`: part of a 32-column chunk) and rows that
/// leave `gemv_tc` half a tile.
pub(super) fn gemv_vs_cublas(b: &Blas, tactic: Tactic) -> Result<f64, BackendError> {
    let mut r = SplitMix(31);
    let (rows, cols) = (72, 1064);
    let stream = b.stream_handle();
    let up = |bytes: &[u8]| {
        stream
            .clone_htod(bytes)
            .map_err(|e| super::dev_err("upload", e))
    };
    let mut worst = 0f64;
    for dt in [KvDType::F16, KvDType::Bf16] {
        let half = |v: &[f32]| {
            let mut out = vec![0u8; v.len() * 2];
            encode_from_f32(dt, v, &mut out);
            out
        };
        let w = up(&half(&random(&mut r, rows * cols, 0.1)))?;
        let x = up(&half(&random(&mut r, GEMV_MAX_BATCH * cols, 1.0)))?;
        let y0 = random(&mut r, GEMV_MAX_BATCH * rows, 1.0);
        let y = up(super::driver::f32_bytes(&y0))?;
        let (wp, xp, yp) = (
            w.device_ptr(&stream).0,
            x.device_ptr(&stream).0,
            y.device_ptr(&stream).0,
        );
        for batch in 1..=GEMV_MAX_BATCH {
            for beta in [0f32, 1.0] {
                let mut got = [vec![0f32; batch * rows], vec![0f32; batch * rows]];
                for (t, out) in [Tactic::Cublas, tactic].into_iter().zip(got.iter_mut()) {
                    super::driver::htod(yp, super::driver::f32_bytes(&y0), &stream)?;
                    // SAFETY: w, x and y hold rows x cols, 8 x cols and 8 x rows elements, 16-byte
                    // aligned (fresh allocations), cols a multiple of 8.
                    unsafe { b.gemm_with(t, (dt, rows, batch, cols), wp, xp, yp, beta)? };
                    super::driver::dtoh_f32(out, yp, &stream)?;
                }
                worst = worst.max(rel_err(&got[1], &got[0]));
            }
        }
    }
    Ok(worst)
}

fn check_f32_to_half(sh: &Shared) -> Result<f64, BackendError> {
    let mut r = SplitMix(12);
    let mut x = random(&mut r, 1000, 100.0);
    x.extend([
        0.0,
        -0.0,
        1e-8,
        -6e-5,
        65504.0,
        70000.0,
        f32::INFINITY,
        f32::NAN,
    ]);
    let mut worst = 0f64;
    for dt in [KvDType::F16, KvDType::Bf16] {
        let mut want = vec![0u8; x.len() * 2];
        encode_from_f32(dt, &x, &mut want);
        let mut dev = Dev { sh, held: vec![] };
        let (xp, yp) = (dev.up_f32(&x)?, dev.zeros(x.len())?);
        let n = x.len() as i64;
        // SAFETY: xp holds n floats, yp room for n halves.
        unsafe {
            sh.launch(
                &sh.k.f32_to_half,
                ((x.len() as u32).div_ceil(256), 1),
                256,
                &[&xp, &yp, &n, &dtype_code(dt)],
            )?
        };
        let got = dev.down_u16(yp, x.len())?;
        let mismatches = got
            .iter()
            .zip(want.chunks_exact(2))
            .filter(|(g, w)| **g != u16::from_le_bytes([w[0], w[1]]))
            .count();
        worst = worst.max(mismatches as f64);
    }
    Ok(worst)
}

/// `rms_norm` (f32 rows), or with `bf16` `rms_norm_half` (bf16 rows straight from the norm),
/// against the CPU's f32 norm.
fn check_rms_norm(sh: &Shared, bf16: bool) -> Result<f64, BackendError> {
    let mut r = SplitMix(13);
    let (rows, dim) = (3, 5120);
    let x = random(&mut r, rows * dim, 2.0);
    let w = random(&mut r, dim, 1.0);
    let mut want = vec![0f32; x.len()];
    CpuBackend.rms_norm(&x, &w, 1e-6, &mut want);
    let mut dev = Dev { sh, held: vec![] };
    let (xp, wp, op) = (dev.up_f32(&x)?, dev.up_f32(&w)?, dev.zeros(x.len())?);
    let (grid, d, eps) = ((rows as u32, 1), dim as i32, 1e-6f32);
    // SAFETY: x/out hold rows*dim floats, w dim floats (halves take less).
    unsafe {
        if bf16 {
            let code = dtype_code(KvDType::Bf16);
            sh.launch(
                &sh.k.rms_norm_half,
                grid,
                NORM_THREADS,
                &[&xp, &wp, &op, &d, &eps, &code],
            )?
        } else {
            sh.launch(
                &sh.k.rms_norm,
                grid,
                NORM_THREADS,
                &[&xp, &wp, &op, &d, &eps],
            )?
        }
    };
    let got: Vec<f32> = if bf16 {
        dev.down_u16(op, x.len())?
            .into_iter()
            .map(|h| f32::from_bits(u32::from(h) << 16))
            .collect()
    } else {
        dev.down(op, x.len())?
    };
    Ok(rel_err(&got, &want))
}

fn check_rope(sh: &Shared) -> Result<f64, BackendError> {
    let mut r = SplitMix(14);
    let cfg = crate::model::random::preset("qwen3-14b", crate::model::Arch::Qwen3)
        .ok_or_else(|| BackendError::Device("preset".into()))?;
    let inv = crate::model::rope::inv_freq(&cfg);
    let (heads, d) = (cfg.num_heads, cfg.head_dim);
    let x = random(&mut r, heads * d, 1.0);
    let pos = 1234usize;
    let mut want = x.clone();
    crate::model::rope::apply(&mut want, &inv, pos);
    let mut dev = Dev { sh, held: vec![] };
    let (xp, fp) = (dev.up_f32(&x)?, dev.up_f32(&inv)?);
    let n = (heads * d / 2) as u32;
    // SAFETY: x holds heads*d floats, inv_freq d/2.
    unsafe {
        sh.launch(
            &sh.k.rope,
            (n.div_ceil(128), 1),
            128,
            &[&xp, &fp, &(pos as i32), &(heads as i32), &(d as i32)],
        )?
    };
    Ok(rel_err(&dev.down(xp, x.len())?, &want))
}

fn check_silu(sh: &Shared) -> Result<f64, BackendError> {
    let mut r = SplitMix(15);
    let n = 17408 * 2;
    let g = random(&mut r, n, 6.0);
    let u = random(&mut r, n, 2.0);
    let mut want = g.clone();
    CpuBackend.silu_mul(&mut want, &u);
    let mut dev = Dev { sh, held: vec![] };
    let (gp, up) = (dev.up_f32(&g)?, dev.up_f32(&u)?);
    // SAFETY: both hold n floats.
    unsafe {
        sh.launch(
            &sh.k.silu_mul,
            ((n as u32).div_ceil(256), 1),
            256,
            &[&gp, &up, &(n as i64)],
        )?
    };
    Ok(rel_err(&dev.down(gp, n)?, &want))
}

fn check_quest(sh: &Shared) -> Result<f64, BackendError> {
    let mut r = SplitMix(16);
    let (nb, g, d) = (300, 5, 128);
    let q = random(&mut r, g * d, 1.0);
    let digests: Vec<Digest> = (0..nb)
        .map(|_| {
            let mut dg = Digest::new(d);
            for _ in 0..4 {
                dg.update(&random(&mut r, d, 1.0));
            }
            dg
        })
        .collect();
    let want: Vec<f32> = digests.iter().map(|x| x.score(&q)).collect();
    let mins: Vec<f32> = digests.iter().flat_map(|x| x.min.clone()).collect();
    let maxs: Vec<f32> = digests.iter().flat_map(|x| x.max.clone()).collect();
    let mut dev = Dev { sh, held: vec![] };
    let (qp, lo, hi, sp) = (
        dev.up_f32(&q)?,
        dev.up_f32(&mins)?,
        dev.up_f32(&maxs)?,
        dev.zeros(nb)?,
    );
    // SAFETY: sizes as above.
    unsafe {
        sh.launch(
            &sh.k.quest_scores,
            ((nb as u32).div_ceil(128), 1),
            128,
            &[&qp, &lo, &hi, &(nb as i32), &(g as i32), &(d as i32), &sp],
        )?
    };
    Ok(rel_err(&dev.down(sp, nb)?, &want))
}

/// `top_blocks` against `attention::best_in` on scores made to catch a ranking's slips: a
/// few values (ties across the k-th), NaN, infinities and both zeros; each head alone and
/// heads together (a layer's shared budget), up to `TOP_MAX` candidates; k of one, half and
/// all but one. The error is the number of heads whose picks differ (exact, or wrong).
fn check_top_blocks(sh: &Shared) -> Result<f64, BackendError> {
    let mut r = SplitMix(23);
    let odd = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        0.5,
        0.25,
    ];
    let mut wrong = 0usize;
    for (hk, blocks, to, k, shared) in [
        (3, 50, 49, 7, false),
        (8, 2047, 2045, 61, false),
        (8, 2047, 2045, 8 * 61, true),
        (2, 700, 600, 1, false),
        (2, 700, 600, 598, false),
        (
            1,
            super::sketch::TOP_MAX + 1,
            super::sketch::TOP_MAX + 1,
            300,
            false,
        ),
        (4, 700, 650, 900, true),
    ] {
        for kind in 0..3 {
            let scores: Vec<f32> = (0..hk * blocks)
                .map(|_| {
                    let x = r.next_f64();
                    match kind {
                        0 => x as f32,
                        1 => (x * 5.0).floor() as f32 / 4.0,
                        _ => odd[(x * 7.0) as usize % 7],
                    }
                })
                .collect();
            let cut = attention::TopCut {
                from: 1,
                to,
                k,
                shared,
            };
            let rows = if shared { hk } else { 1 };
            let kk = cut.picks(rows);
            let mut dev = Dev { sh, held: vec![] };
            let (sp, pp) = (dev.up_f32(&scores)?, dev.zeros(hk / rows * kk)?);
            let args = [blocks, 1, to, rows, kk].map(|x| x as i32);
            // SAFETY: [hk][blocks] scores, room for kk picks of each of hk / rows groups,
            // 1..to inside a row, at most TOP_MAX candidates a group.
            unsafe {
                sh.launch(
                    &sh.k.top_blocks,
                    ((hk / rows) as u32, 1),
                    super::sketch::TOP_THREADS,
                    &[&sp, &args[0], &args[1], &args[2], &args[3], &args[4], &pp],
                )?
            };
            let got = dev.down(pp, hk / rows * kk)?;
            let back = super::sketch::Back::Picks {
                k: kk,
                rows,
                blocks,
            };
            let Scored::Picks(picks) = back.answer(hk, &got) else {
                return Err(BackendError::Device("picks read back as scores".into()));
            };
            let refs: Vec<&[f32]> = scores.chunks_exact(blocks).collect();
            let want = attention::best_in(&refs, cut);
            for h in (0..hk).filter(|&h| picks[h] != want[h]) {
                tracing::error!(
                    head = h,
                    blocks,
                    k,
                    shared,
                    kind,
                    "top_blocks differs from the host's ranking"
                );
                wrong += 1;
            }
        }
    }
    Ok(wrong as f64)
}

/// Checks `top_blocks` (`check_top_blocks`) and turns the device's picks off on `sh` where
/// they are wrong: the sketch's scores then come back whole and the host picks.
pub(super) fn check_picks_or_off(sh: &Shared) {
    if !sh.sketch_picks.load(Ordering::Acquire) {
        return;
    }
    match check_top_blocks(sh) {
        Ok(0.0) => {}
        r => {
            tracing::error!(result = ?r, "top_blocks disagrees with the host's ranking on this device; the host picks the blocks");
            sh.sketch_picks.store(false, Ordering::Release);
        }
    }
}

/// `place_picks` against `call::place_picks_host` (#21 item 4): a head before, a sequence
/// whose 3 heads pick their own blocks (one with a block no slot holds), one whose 8 heads
/// share more picks than a CUDA block has threads, with windows of 1 and 3 blocks. The error
/// is the number of entries and head starts that differ.
fn check_place_picks(sh: &Shared) -> Result<f64, BackendError> {
    use super::call::{PLACE_THREADS, Picked, SlotList, pack, place_picks_host};
    let mut r = SplitMix(29);
    let (slot_bytes, bs) = (4096i64, 32i32);
    let mut dev = Dev { sh, held: vec![] };
    let mut list = SlotList::new();
    list.push(77 * slot_bytes, 5);
    list.end_head();
    let mut inputs = Vec::new();
    for (hk, rows, k, window, blocks) in [(3, 1, 4, 1, 40), (8, 8, 300, 3, 200)] {
        let (to, stride) = (blocks + 1 - window, blocks + 5);
        // Block b of head h in a shuffled arena slot; head 1's block 2 held by none.
        let mut slots: Vec<u32> = (0..(hk * stride) as u32).collect();
        for i in (1..slots.len()).rev() {
            slots.swap(i, r.next_u64() as usize % (i + 1));
        }
        slots[stride + 2] = super::slots::NOT_WHOLE;
        // Each group's picks: distinct places of the cut, ascending.
        let mut picks = Vec::new();
        for _ in 0..hk / rows {
            let mut cand: Vec<u32> = (0..rows)
                .flat_map(|h| (1..to).map(move |b| (h * blocks + b) as u32))
                .collect();
            for i in (1..cand.len()).rev() {
                cand.swap(i, r.next_u64() as usize % (i + 1));
            }
            cand.truncate(k);
            cand.sort_unstable();
            picks.extend(cand);
        }
        if rows == 1 {
            picks[k] = 2; // head 1's first pick: the block without a slot
            picks[k..2 * k].sort_unstable();
        }
        let mut fixed = SlotList::new();
        for h in 0..hk {
            for b in std::iter::once(0).chain(to..blocks + 1) {
                let len = if b == blocks { 9 } else { bs as usize };
                fixed.push(i64::from(slots[h * stride + b]) * slot_bytes, len);
            }
            fixed.end_head();
        }
        let bytes = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let (pp, tp) = (dev.up(&bytes(&picks))?, dev.up(&bytes(&slots))?);
        let p = Picked {
            k,
            rows,
            blocks,
            from: 1,
            to,
            picks: pp,
            table: tp,
            stride,
        };
        let seq = SlotList::picked(&fixed, p)
            .ok_or_else(|| BackendError::Unsupported(format!("place_picks check: {p:?}")))?;
        list.append(&seq);
        inputs.push((pp, picks, slots));
    }
    let of = |job: &[i64; super::call::PLACE_WORDS], i: usize| {
        inputs
            .iter()
            .find(|x| x.0 as i64 == job[9])
            .map(|x| if i == 1 { x.1.clone() } else { x.2.clone() })
            .unwrap_or_default()
    };
    let mut want = list.clone();
    place_picks_host(&mut want, |j| of(j, 1), |j| of(j, 2), slot_bytes, bs);
    let up = pack(&list, &[]);
    let io = dev.up(&up.bytes)?;
    let (offs, lens, heads, jobs) = (
        io,
        io + up.at_lens as u64,
        io + up.at_heads as u64,
        io + up.at_jobs as u64,
    );
    // SAFETY: the upload holds the list's entries, head starts and jobs (`pack`); each job's
    // picks and table were uploaded above, as many as it names.
    unsafe {
        sh.launch(
            &sh.k.place_picks,
            (list.picked.len() as u32, 1),
            PLACE_THREADS,
            &[&offs, &lens, &heads, &jobs, &slot_bytes, &bs],
        )?
    };
    let words = dev.down(io, up.at_jobs.div_ceil(4))?;
    let raw: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let i64_at = |at: usize| i64::from_le_bytes(raw[at..at + 8].try_into().unwrap_or([0; 8]));
    let i32_at = |at: usize| i32::from_le_bytes(raw[at..at + 4].try_into().unwrap_or([0; 4]));
    let n = list.offs.len();
    let wrong = (0..n)
        .filter(|&i| i64_at(8 * i) != want.offs[i] || i32_at(up.at_lens + 4 * i) != want.lens[i])
        .count()
        + (0..want.head_start.len())
            .filter(|&h| i32_at(up.at_heads + 4 * h) != want.head_start[h])
            .count();
    Ok(wrong as f64)
}

/// Checks `place_picks` (`check_place_picks`) where layers may be planned on the device, and
/// turns that off on `sh` where the device lays the lists out wrong: the host then plans
/// every layer.
pub(super) fn check_plan_or_off(sh: &Shared) {
    if !sh.device_plan.load(Ordering::Acquire) {
        return;
    }
    match check_place_picks(sh) {
        Ok(0.0) => {}
        r => {
            tracing::error!(result = ?r, "place_picks disagrees with the host's lists on this device; the host plans every layer");
            sh.device_plan.store(false, Ordering::Release);
        }
    }
}

/// With `DECODE_NODE_CPU_FLAG=on`, turns the landing of CPU partials off where the merge
/// behind the flag's wait reads them wrongly on this device.
pub(super) fn check_landing_or_off(sh: &Shared) {
    if !sh.cpu_flag.load(Ordering::Acquire) {
        return;
    }
    match check_landing(sh) {
        Ok(e) if e <= 1e-5 => {}
        r => {
            tracing::error!(result = ?r, "lse2_merge behind a landing's flag disagrees with the host's merge on this device; the step thread waits for the CPU parts");
            sh.cpu_flag.store(false, Ordering::Release);
        }
    }
}

fn check_merge(sh: &Shared) -> Result<f64, BackendError> {
    let mut r = SplitMix(17);
    let (g, d) = (6, 128);
    let mut a = Partial {
        out: random(&mut r, g * d, 1.0),
        lse2: random(&mut r, g, 8.0),
        num_heads: g,
        head_dim: d,
    };
    let mut b = Partial {
        out: random(&mut r, g * d, 1.0),
        lse2: random(&mut r, g, 8.0),
        num_heads: g,
        head_dim: d,
    };
    // Empty heads on either side must be no-ops.
    a.lse2[1] = f32::NEG_INFINITY;
    b.lse2[2] = f32::NEG_INFINITY;
    a.out[d..2 * d].fill(0.0);
    let mut dev = Dev { sh, held: vec![] };
    let (ao, al, bo, bl) = (
        dev.up_f32(&a.out)?,
        dev.up_f32(&a.lse2)?,
        dev.up_f32(&b.out)?,
        dev.up_f32(&b.lse2)?,
    );
    let mut want = a.clone();
    want.merge_from(&b);
    // SAFETY: sizes as above.
    unsafe {
        sh.launch(
            &sh.k.lse2_merge,
            (g as u32, 1),
            128,
            &[&ao, &al, &bo, &bl, &(g as i32), &(d as i32)],
        )?
    };
    let got = dev.down(ao, g * d)?;
    let lse = dev.down(al, g)?;
    Ok(rel_err(&got, &want.out).max(rel_err(&lse, &want.lse2)))
}

/// #21 item 5: a merge queued behind the wait on a landing's flag reads the rows a thread
/// lands after it was queued (one row's partials, one row empty). Without the wait it would
/// read the zeroed memory (lse2 0, not empty) and merge wrongly.
fn check_landing(sh: &Shared) -> Result<f64, BackendError> {
    use crate::backend::{Landing, LandingShape};
    let mut r = SplitMix(19);
    let (rows, hk, g, d) = (2, 2, 3, 64);
    let hq = hk * g;
    let part = |r: &mut SplitMix| Partial {
        out: random(r, g * d, 1.0),
        lse2: random(r, g, 8.0),
        num_heads: g,
        head_dim: d,
    };
    let a: Vec<Partial> = (0..rows * hk).map(|_| part(&mut r)).collect();
    let b: Vec<Partial> = (0..hk).map(|_| part(&mut r)).collect();
    let mut pool = super::landing::LandingPool::default();
    let shape = LandingShape {
        rows,
        kv_heads: hk,
        group: g,
        head_dim: d,
    };
    let (mem, seq) = pool.take(shape.words())?;
    let (words, flag) = mem.addresses();
    let landing = Landing::new(mem, seq, shape)?;
    let mut dev = Dev { sh, held: vec![] };
    let a_out: Vec<f32> = a.iter().flat_map(|p| p.out.iter().copied()).collect();
    let a_lse: Vec<f32> = a.iter().flat_map(|p| p.lse2.iter().copied()).collect();
    let (ao, al) = (dev.up_f32(&a_out)?, dev.up_f32(&a_lse)?);
    let stream = sh.stream.cu_stream();
    super::landing::queue_wait_flag(stream, flag, seq)?;
    let (heads, dd) = ((rows * hq) as i32, d as i32);
    let words_lse = words + (rows * hq * d * 4) as u64;
    // SAFETY: a and the landing hold rows x hq heads of d and their lse2.
    unsafe {
        sh.launch(
            &sh.k.lse2_merge,
            ((rows * hq) as u32, 1),
            64,
            &[&ao, &al, &words, &words_lse, &heads, &dd],
        )?
    };
    pool.mark_read(landing.mem(), stream)?;
    let mut tickets = landing.tickets().into_iter();
    let (first, second) = (tickets.next(), tickets.next());
    let lander = {
        let b = b.clone();
        std::thread::spawn(move || -> Result<(), BackendError> {
            std::thread::sleep(std::time::Duration::from_millis(50));
            if let Some(t) = second {
                t.land_empty();
            }
            first.map_or(Ok(()), |t| t.land(&b))
        })
    };
    let got = dev.down(ao, rows * hq * d)?;
    let lse = dev.down(al, rows * hq)?;
    lander
        .join()
        .map_err(|_| BackendError::Device("the landing thread panicked".into()))??;
    let mut want = a;
    for (w, p) in want.iter_mut().zip(&b) {
        w.merge_from(p);
    }
    let want_out: Vec<f32> = want.iter().flat_map(|p| p.out.iter().copied()).collect();
    let want_lse: Vec<f32> = want.iter().flat_map(|p| p.lse2.iter().copied()).collect();
    Ok(rel_err(&got, &want_out).max(rel_err(&lse, &want_lse)))
}

fn check_append(sh: &Shared) -> Result<f64, BackendError> {
    let mut r = SplitMix(18);
    let mut worst = 0f64;
    for dt in [KvDType::F32, KvDType::F16, KvDType::Bf16] {
        let geom = BlockGeometry {
            block_size: 32,
            num_kv_heads: 1,
            head_dim: 128,
            dtype: dt,
        };
        let mut want = vec![0u8; geom.head_bytes()];
        let mut dg = Digest::new(128);
        let mut dev = Dev { sh, held: vec![] };
        let blk = dev.up(&want)?;
        let (lo, hi) = (dev.up_f32(&dg.min)?, dev.up_f32(&dg.max)?);
        for slot in [0usize, 7, 31] {
            let (k, v) = (random(&mut r, 128, 3.0), random(&mut r, 128, 3.0));
            geom.write_token(&mut want, 0, slot, &k, &v);
            dg.update(&k);
            let (kp, vp) = (dev.up_f32(&k)?, dev.up_f32(&v)?);
            // SAFETY: the block holds head_bytes, k/v/min/max 128 floats.
            unsafe {
                sh.launch(
                    &sh.k.kv_append,
                    (1, 1),
                    128,
                    &[
                        &blk,
                        &kp,
                        &vp,
                        &(slot as i32),
                        &128i32,
                        &32i32,
                        &dtype_code(dt),
                        &lo,
                        &hi,
                    ],
                )?
            };
        }
        let got = dev.down(blk, geom.head_bytes() / 4)?;
        let got_bytes: Vec<u8> = got.iter().flat_map(|f| f.to_le_bytes()).collect();
        let diff = got_bytes.iter().zip(&want).filter(|(a, b)| a != b).count();
        let lo_got = dev.down(lo, 128)?;
        let hi_got = dev.down(hi, 128)?;
        worst = worst
            .max(diff as f64)
            .max(rel_err(&lo_got, &dg.min))
            .max(rel_err(&hi_got, &dg.max));
    }
    Ok(worst)
}

/// CPU reference for one KV head's group over `blocks` of `kv`.
fn cpu_attention(
    geom: &BlockGeometry,
    kv: &Mem,
    q: &[f32],
    scale: f32,
    blocks: &[usize],
) -> Partial {
    let mut scratch = Scratch::default();
    let it = blocks.iter().map(|&b| HeadBlock {
        bytes: &kv.blocks[b][geom.head_range(0)],
        len: (kv.n - b * geom.block_size).min(geom.block_size),
    });
    // f32 throughout: the bf16 pair products' rounding is not what the device is held to.
    attend_blocks_on(KernelPath::best_f32(geom), geom, q, scale, it, &mut scratch)
}

/// Largest relative error `sparse_attention_split` may show against the CPU kernel.
pub(super) const ATTENTION_TOLERANCE: f64 = 1e-5;

/// The device attention of `dt` blocks of `block_size` tokens (group `g`, head dimension `d`)
/// against the CPU kernel on random KV: the largest relative error of outputs and LSEs.
/// The geometry of the attention and sketch checks: three KV heads.
fn three_heads(dtype: KvDType, head_dim: usize, block_size: usize) -> BlockGeometry {
    BlockGeometry {
        block_size,
        num_kv_heads: 3,
        head_dim,
        dtype,
    }
}

/// Block scores are shares (at most 1): an absolute bound.
const SKETCH_TOLERANCE: f64 = 1e-5;

/// The device's sketch scores (`--block-scorer sketch`) against `attention::sketch` on the
/// host, over three calls on one sequence: its prompt (the first fill, many pages), 31 tokens
/// more (a staged fill, one upload and `scatter_runs`, that takes a page and grows the page
/// table; queued without a wait: `SeqSketch::queue`, a waiting call in between; then by the
/// query in device memory) and 700 more (copied straight up). Group max and sum. The host
/// scores the query the device's sums see: rounded to int8 (`query_as_rounded`) unless
/// `DECODE_NODE_SKETCH_SUMS=f32`. Then an arena too small for the sketch: the call fails as device-full, nothing copied.
fn check_sketch(
    sh: &Arc<Shared>,
    dt: KvDType,
    g: usize,
    d: usize,
    block_size: usize,
) -> Result<f64, BackendError> {
    use super::sketch::SketchQuery;
    use super::{DevBuf, f32_bytes, htod};
    use crate::backend::SketchCall;
    use attention::GroupScore;
    use attention::sketch::{nibble_bytes, query_as_rounded, scores_from_sketch, sketch_tokens};
    let mut r = SplitMix(44);
    let geom = three_heads(dt, d, block_size);
    let hk = geom.num_kv_heads;
    // The prompt ends 30 tokens before a sketch page does; the next call's 31 tokens (a
    // staged fill) take a page and grow the page table.
    let page = super::sketch::Pages::new(&geom).tokens;
    let prompt = (block_size * 120).div_ceil(page) * page - 30;
    let last = prompt + 31 + 700;
    let mut kv = mem_kv(&mut r, &geom, last);
    let scale = 1.0 / (d as f32).sqrt();
    let err = |e: kv_transfer::Error| BackendError::Device(e.to_string());
    let pool = HostPool::new(geom, geom.block_bytes() as u64).map_err(err)?;
    let store = super::store::CudaKvStore::new(Arc::clone(sh), geom, 64 << 20, &pool)?;
    let mut sketch = super::sketch::SeqSketch::default();
    let mut worst = 0f64;
    for (round, n) in [prompt, prompt + 31, last].into_iter().enumerate() {
        kv.n = n;
        let blocks = geom.blocks_for(n) - 1;
        let q = random(&mut r, hk * g * d, 2.0);
        let how = if round == 1 {
            GroupScore::Sum
        } else {
            GroupScore::Max
        };
        let call = SketchCall {
            layer: 0,
            scale,
            how,
            blocks,
            pick: None,
        };
        // The same call asking for the best blocks: 40 of ~120, the newest three always
        // taken; each head's own, or (the queued round) the layer's shared budget.
        let cut = if round == 1 {
            attention::TopCut::shared_of(blocks + 1, 40, 3, hk)
        } else {
            attention::TopCut::of(blocks + 1, 40, 3)
        }
        .ok_or_else(|| BackendError::Device("no cut of the sketch's blocks".into()))?;
        let picking = SketchCall {
            pick: Some(cut),
            ..call
        };
        let host = |q: &[f32]| -> Vec<Vec<f32>> {
            (0..hk)
                .map(|h| {
                    let mut nib = vec![0u8; n * nibble_bytes(d)];
                    let mut scales = vec![0f32; n];
                    sketch_tokens(&geom, &kv, 0, h, 0, n, &mut nib, &mut scales);
                    let qg = &q[h * g * d..(h + 1) * g * d];
                    // The query the device's sums see: rounded to int8 unless they are floats.
                    let qg = if sh.sketch_int8 {
                        query_as_rounded(qg, d)
                    } else {
                        qg.to_vec()
                    };
                    scores_from_sketch(&nib, &scales, n, block_size, d, blocks, &qg, scale, how)
                })
                .collect()
        };
        let mut compare = |got: &Scored, want: &[Vec<f32>]| -> Result<(), BackendError> {
            let Scored::Scores(got) = got else {
                return Err(BackendError::Device(
                    "picks where scores were asked for".into(),
                ));
            };
            for (got, want) in got.iter().zip(want) {
                if got.len() != want.len() {
                    return Err(BackendError::Device(format!(
                        "{} sketch scores for {} blocks",
                        got.len(),
                        want.len()
                    )));
                }
                for (a, b) in got.iter().zip(want) {
                    worst = worst.max(f64::from((a - b).abs()));
                }
            }
            Ok(())
        };
        if round == 1 {
            // Queued without a wait (its fill staged through its own buffer), a waiting
            // call with another query in between, then taken; a take for another layer
            // finds nothing.
            sketch.queue(&store, &kv, SketchQuery::Host(&q), call)?;
            let q2 = random(&mut r, hk * g * d, 2.0);
            let between = sketch.scores(&store, &kv, &q2, call)?;
            compare(&between, &host(&q2))?;
            let got = sketch.take(0)?.ok_or_else(|| {
                BackendError::Device("queued sketch scores not found for their layer".into())
            })?;
            compare(&got, &host(&q))?;
            // Picks, queued the same way, by the same query.
            sketch.queue(&store, &kv, SketchQuery::Host(&q), picking)?;
            let picks = sketch.take(0)?.ok_or_else(|| {
                BackendError::Device("queued sketch picks not found for their layer".into())
            })?;
            check_picks(sh, &picks, &got, cut)?;
            // By a query already in device memory (a resident layer's rows).
            let mut rows = DevBuf::default();
            let at = rows.ptr(&sh.stream, q.len() * 4)?;
            htod(at, f32_bytes(&q), &sh.stream)?;
            let q_dev = SketchQuery::Device {
                addr: at,
                len: q.len(),
            };
            sketch.queue(&store, &kv, q_dev, call)?;
            let got = sketch.take(0)?.ok_or_else(|| {
                BackendError::Device("sketch scores by device rows not found".into())
            })?;
            compare(&got, &host(&q))?;
            sketch.queue(&store, &kv, SketchQuery::Host(&q), call)?;
            if sketch.take(1)?.is_some() || sketch.take(0)?.is_some() {
                return Err(BackendError::Device(
                    "queued sketch scores taken for another layer, or twice".into(),
                ));
            }
        } else {
            let got = sketch.scores(&store, &kv, &q, call)?;
            compare(&got, &host(&q))?;
            check_picks(sh, &sketch.scores(&store, &kv, &q, picking)?, &got, cut)?;
        }
    }
    store.give_back(sketch.take_slots());
    // Gone before the next arena page-locks the same pool (a second registration of one
    // range fails, and the node warned of it at every start).
    drop(store);
    // Two slots: not enough pages for three heads' sketch.
    let small =
        super::store::CudaKvStore::new(Arc::clone(sh), geom, 2 * geom.head_bytes() as u64, &pool)?;
    let q = random(&mut r, hk * g * d, 2.0);
    let blocks = geom.blocks_for(kv.n) - 1;
    let mut starved = super::sketch::SeqSketch::default();
    let call = SketchCall {
        layer: 0,
        scale,
        how: GroupScore::Max,
        blocks,
        pick: None,
    };
    match starved.scores(&small, &kv, &q, call) {
        Err(BackendError::DeviceFull(_)) => {}
        r => {
            return Err(BackendError::Device(format!(
                "a sketch bigger than the arena: {:?}",
                r.map(|_| "scores")
            )));
        }
    }
    small.give_back(starved.take_slots());
    Ok(worst)
}

/// The device's picks of `cut` (`got`) against the host's ranking of the device's own
/// scores by the same query (`scores`): equal, exactly. Scores where picks were asked for
/// pass only where the device's picks are off.
fn check_picks(
    sh: &Shared,
    got: &Scored,
    scores: &Scored,
    cut: attention::TopCut,
) -> Result<(), BackendError> {
    let Scored::Scores(scores) = scores else {
        return Err(BackendError::Device(
            "picks where scores were asked for".into(),
        ));
    };
    match got {
        Scored::Picks(picks) => {
            let refs: Vec<&[f32]> = scores.iter().map(Vec::as_slice).collect();
            let want = attention::best_in(&refs, cut);
            for (h, (p, w)) in picks.iter().zip(&want).enumerate() {
                if p != w {
                    return Err(BackendError::Device(format!(
                        "head {h}: the device picked {p:?}, the host's ranking of its scores {w:?}"
                    )));
                }
            }
            if picks.len() != scores.len() {
                return Err(BackendError::Device(format!(
                    "picks of {} heads for {}",
                    picks.len(),
                    scores.len()
                )));
            }
            Ok(())
        }
        Scored::Scores(_) if !sh.sketch_picks.load(Ordering::Acquire) => Ok(()),
        Scored::Scores(_) => Err(BackendError::Device(
            "every score where the device's picks were asked for".into(),
        )),
    }
}

pub(super) fn check_split_attention(
    sh: &Arc<Shared>,
    dt: KvDType,
    g: usize,
    d: usize,
    block_size: usize,
) -> Result<f64, BackendError> {
    let mut r = SplitMix(20);
    let geom = three_heads(dt, d, block_size);
    let hk = geom.num_kv_heads;
    let n = block_size * 300 + 5;
    let kv = mem_kv(&mut r, &geom, n);
    let q = random(&mut r, hk * g * d, 1.0);
    let scale = 1.0 / (d as f32).sqrt();
    // Head 0: everything; head 1: a sparse pick with the partial newest block; head 2: none.
    let nb = geom.blocks_for(n);
    let lists: Vec<Vec<usize>> = vec![(0..nb).collect(), vec![0, 5, 6, 100, 250, nb - 1], vec![]];
    // The device reads from the (page-locked, mapped) pool, as in serving: gathered copies.
    let err = |e: kv_transfer::Error| BackendError::Device(e.to_string());
    let pool = HostPool::new(geom, (nb * geom.block_bytes()) as u64).map_err(err)?;
    let mut res = pool.reserve(nb).map_err(err)?;
    let mut held = Vec::with_capacity(nb);
    for b in &kv.blocks {
        let mut blk = res
            .take()
            .ok_or_else(|| BackendError::Device("pool reservation short".into()))?;
        blk.bytes_mut().copy_from_slice(b);
        held.push(blk);
    }
    let mut pooled = PoolKv { blocks: held, n };
    let mut kv = kv;
    let store = super::store::CudaKvStore::new(Arc::clone(sh), geom, 64 << 20, &pool)?;
    let mut seq = Arc::new(store).new_seq(1, usize::MAX);
    // Each head's residency would number its slots densely: the list order does.
    let placed: Vec<Vec<DeviceBlock>> = lists
        .iter()
        .map(|l| {
            (0..)
                .zip(l)
                .map(|(slot, &block)| DeviceBlock { block, slot })
                .collect()
        })
        .collect();
    let refs: Vec<&[DeviceBlock]> = placed.iter().map(Vec::as_slice).collect();
    // Twice: the second call reads the slots the first one filled; then the sequence grows by
    // two tokens, which reach the device as the newest block's tail (`copy_tokens`).
    let mut worst = 0f64;
    for round in 0..3 {
        if round == 2 {
            let last = nb - 1;
            for t in kv.n - last * geom.block_size..kv.n - last * geom.block_size + 2 {
                for h in 0..hk {
                    let k = random(&mut r, d, 1.0);
                    let v = random(&mut r, d, 1.0);
                    geom.write_token(&mut kv.blocks[last], h, t, &k, &v);
                    geom.write_token(pooled.blocks[last].bytes_mut(), h, t, &k, &v);
                }
            }
            kv.n += 2;
            pooled.n += 2;
        }
        let n = kv.n;
        let got = seq.attend(&pooled, 0, &refs, &q, scale)?;
        for (h, list) in lists.iter().enumerate() {
            let one = BlockGeometry {
                num_kv_heads: 1,
                ..geom
            };
            let head_kv = Mem {
                blocks: kv
                    .blocks
                    .iter()
                    .map(|b| b[geom.head_range(h)].to_vec())
                    .collect(),
                n,
            };
            let want = cpu_attention(&one, &head_kv, &q[h * g * d..(h + 1) * g * d], scale, list);
            worst = worst
                .max(rel_err(&got[h].out, &want.out))
                .max(rel_err(&got[h].lse2, &want.lse2));
        }
    }
    Ok(worst)
}
