//! `bench select`: host block selection — what every sparse mode runs per layer and KV head
//! before it attends, on the step's critical path — as bytes read per second ÷ the read
//! bandwidth of the same threads, measured in the same run. On an H200 host it took 12 of
//! scout's 28 ms per step at 32k (Qwen3-14B shape, 10 layers), more than the device's work.

use super::*; // the shared helpers and imports of `bench`
use crate::cli::{BenchCommon, SelectBench};
use attention::{AttentionConfig, BlockKeys, BlockScorer, HeadDigests, KvSource, SeqAttention};

/// A sequence's KV blocks, taken from a host pool as an ingest takes them.
struct Blocks {
    /// `[layer][block]`.
    layers: Vec<Vec<kv_transfer::Block>>,
    tokens: usize,
}

impl KvSource for Blocks {
    fn block(&self, layer: usize, block: usize) -> &[u8] {
        self.layers[layer][block].bytes()
    }
    fn num_tokens(&self) -> usize {
        self.tokens
    }
}

/// Random keys and values for `tokens` tokens of `layers` layers in blocks of `pool`, with
/// their digests.
fn sequence(
    pool: &kv_transfer::HostPool,
    layers: usize,
    tokens: usize,
) -> anyhow::Result<(Blocks, Vec<HeadDigests>)> {
    let geom = *pool.geometry();
    let (hk, d) = (geom.num_kv_heads, geom.head_dim);
    let nb = geom.blocks_for(tokens);
    let mut res = pool.reserve(layers * nb)?;
    let mut taken: Vec<Vec<kv_transfer::Block>> = (0..layers)
        .map(|_| (0..nb).filter_map(|_| res.take()).collect())
        .collect();
    anyhow::ensure!(
        taken.iter().all(|l| l.len() == nb),
        "host pool reservation short"
    );
    // Layers in parallel: 32k tokens of 8 heads is a quarter of a billion values a layer.
    let digests: Vec<Vec<HeadDigests>> = taken
        .par_iter_mut()
        .enumerate()
        .map(|(l, blocks)| {
            let mut r = SplitMix(0x5e1ec7 + l as u64);
            let mut digests: Vec<HeadDigests> = (0..hk).map(|_| HeadDigests::new(nb, d)).collect();
            let (mut k, mut v) = (vec![0f32; d], vec![0f32; d]);
            for t in 0..tokens {
                let b = t / geom.block_size;
                for (h, dig) in digests.iter_mut().enumerate() {
                    k.iter_mut()
                        .chain(v.iter_mut())
                        .for_each(|x| *x = r.next_f64() as f32 * 2.0 - 1.0);
                    geom.write_token(blocks[b].bytes_mut(), h, t % geom.block_size, &k, &v);
                    dig.update(b, &k);
                }
            }
            digests
        })
        .collect();
    Ok((
        Blocks {
            layers: taken,
            tokens,
        },
        digests.into_iter().flatten().collect(),
    ))
}

/// Host selection per scorer, context and thread count.
pub(super) fn select(args: &SelectBench) -> anyhow::Result<serde_json::Value> {
    let contexts: Vec<usize> = args
        .context
        .split(',')
        .map(parse_tokens)
        .collect::<anyhow::Result<_>>()?;
    let threads: Vec<usize> = parse_list(&args.threads, "thread count")?;
    let scorers: Vec<String> = parse_list(&args.scorers, "scorer")?;
    anyhow::ensure!(
        scorers
            .iter()
            .all(|s| ["quest", "sparq", "sketch", "device", "device-picks"].contains(&s.as_str())),
        "--scorers takes `quest`, `sparq`, `sketch`, `device` and/or `device-picks`"
    );
    anyhow::ensure!(
        (1..=64).contains(&args.kv_heads)
            && (1..=16).contains(&args.group)
            && [64, 128, 256].contains(&args.head_dim)
            && args.layers <= 64
            && threads.iter().all(|&t| (1..=1024).contains(&t))
            && contexts.iter().all(|&c| (1..=1 << 20).contains(&c)),
        "--kv-heads 1..=64, --group 1..=16, --head-dim 64/128/256, --layers 0..=64, \
         --threads 1..=1024, --context 1..=1M tokens"
    );
    // `auto`: a bf16 model's KV.
    let dtype = crate::node::kv_dtype(&args.common.model.kv_dtype, "bfloat16")?;
    let geom = BlockGeometry {
        block_size: args.common.model.block_size as usize,
        num_kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        dtype,
    };
    anyhow::ensure!(
        geom.block_size.is_power_of_two() && (8..=256).contains(&geom.block_size),
        "--block-size must be a power of two in 8..=256"
    );
    let (hk, g, d) = (args.kv_heads, args.group, args.head_dim);
    let scale = 1.0 / (d as f32).sqrt();
    let bw_buf = HugeBuf::probe(beyond_cache(256 << 20) / 4)?;
    let mut rows = Vec::new();
    for &ctx in &contexts {
        let layers = match args.layers {
            0 => layers_beyond_cache(geom, ctx),
            n => n,
        };
        let base = crate::node::attention_config(&args.common.model, geom, layers, args.group)?;
        // The KV, and the pages of a host-kept sketch for every (layer, KV head).
        let tpp = attention::host_sketch::tokens_per_page(geom.block_bytes(), d, geom.block_size);
        let sketch_pages = attention::host_sketch::pages_for(ctx, tpp) * hk * layers;
        let blocks = layers * geom.blocks_for(ctx) + sketch_pages;
        let pool = kv_transfer::HostPool::new(geom, (blocks * geom.block_bytes()) as u64)?;
        let (src, digests) = sequence(&pool, layers, ctx)?;
        let seq = SeqAttention::new(geom, layers, ctx, digests.clone());
        let keys = BlockKeys { src: &src, scale };
        // A query per layer: a few large channels per head over small ones, as trained
        // models' are (SparQ's channel union then depends on the data, as it would).
        let mut r = SplitMix(ctx as u64);
        let queries: Vec<Vec<f32>> = (0..layers)
            .map(|_| {
                (0..hk * g * d)
                    .map(|_| {
                        let x = r.next_f64() as f32 * 2.0 - 1.0;
                        if r.next_f64() < 0.1 { 8.0 * x } else { x }
                    })
                    .collect()
            })
            .collect();
        for name in &scorers {
            if name.starts_with("device") {
                rows.push(device_scored(
                    &args.common,
                    &base,
                    (geom, layers, ctx),
                    &digests,
                    args.seconds,
                    name == "device-picks",
                ));
                continue;
            }
            let cfg = AttentionConfig {
                scorer: match (name.as_str(), base.scorer) {
                    ("quest", _) => BlockScorer::Quest,
                    ("sketch", _) => BlockScorer::Sketch,
                    (_, s @ BlockScorer::Sparq { .. }) => s,
                    (_, BlockScorer::Quest | BlockScorer::Sketch) => BlockScorer::Sparq {
                        channels: (d / 4).max(1),
                        candidates: 4,
                    },
                },
                ..base.clone()
            };
            let bytes = bytes_per_layer(&cfg, geom, ctx, &queries, g);
            // The sketch as a node keeps it: in pool pages, made before the first step.
            let kept = (cfg.scorer == BlockScorer::Sketch)
                .then(|| -> anyhow::Result<SeqAttention> {
                    let mut kept = SeqAttention::new(geom, layers, ctx, digests.clone());
                    let mut r = pool.reserve(sketch_pages)?;
                    kept.keep_sketch(&cfg, crate::engine::take_pages(&mut r, sketch_pages), tpp);
                    for (layer, q) in queries.iter().enumerate() {
                        for h in 0..hk {
                            kept.select(&cfg, layer, h, &q[h * g * d..(h + 1) * g * d], keys);
                        }
                    }
                    Ok(kept)
                })
                .transpose()?;
            let seq = kept.as_ref().unwrap_or(&seq);
            for &t in &threads {
                let bw = read_bandwidth(bw_buf.floats(), t, args.seconds.min(1.0));
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(t)
                    .thread_name(|i| format!("bench-select-{i}"))
                    .build()?;
                // Layer after layer, every head of one in parallel, as a step plans them: from
                // a thread of the pool, as a CPU node's step runs (entering the pool for each
                // layer from outside woke the caller every layer, 15-25 us on this class of
                // VM, counted as selection).
                let mut times = Vec::new();
                let end = Instant::now() + Duration::from_secs_f64(args.seconds);
                pool.install(|| {
                    while Instant::now() < end || times.len() < layers {
                        let layer = times.len() % layers;
                        let q = &queries[layer];
                        let start = Instant::now();
                        let picked: Vec<Vec<usize>> = (0..hk)
                            .into_par_iter()
                            .map(|h| {
                                seq.select(&cfg, layer, h, &q[h * g * d..(h + 1) * g * d], keys)
                            })
                            .collect();
                        times.push(start.elapsed().as_secs_f64());
                        std::hint::black_box(picked);
                    }
                });
                times.sort_by(f64::total_cmp);
                let per_layer = times[times.len() / 2];
                let gbps = bytes / per_layer / 1e9;
                let row = json!({
                    "scorer": name, "context": ctx, "threads": t, "kv_heads": hk, "group": g,
                    "head_dim": d, "dtype": dtype.name(), "block_size": geom.block_size,
                    "budget_tokens": cfg.budget_tokens,
                    "ms_per_layer": per_layer * 1e3,
                    "us_per_head_thread": per_layer * 1e6 * t as f64 / hk as f64,
                    "bytes_per_layer": bytes, "gb_per_s": gbps,
                    "read_gb_per_s": bw / 1e9, "ratio": gbps * 1e9 / bw,
                });
                if !args.common.json {
                    eprintln!(
                        "select {name:>5} ctx={ctx:>6} H={hk} G={g} D={d} threads={t}: {:7.3} ms/layer, {:6.1} MB/layer, {:6.2} GB/s / {:6.2} GB/s read = {:.2}",
                        per_layer * 1e3,
                        bytes / 1e6,
                        gbps,
                        bw / 1e9,
                        gbps * 1e9 / bw,
                    );
                }
                rows.push(row);
            }
        }
    }
    Ok(json!({ "bench": "select", "results": rows }))
}

/// The host's part of a layer's plan where the device scored every block (a GPU's sketch):
/// each head's top-k of the scores and its residency plan, on the step thread, as a batch of
/// one plans; with `picks`, where the device also picked the blocks (`top_blocks`), the
/// residency plan of its picks alone (the picks are made here, untimed). The scores change
/// every step (as on a random-weight model, the worst case for residency): four sets per
/// layer taken in turn.
fn device_scored(
    common: &BenchCommon,
    base: &AttentionConfig,
    (geom, layers, ctx): (BlockGeometry, usize, usize),
    digests: &[HeadDigests],
    seconds: f64,
    picks: bool,
) -> serde_json::Value {
    let cfg = AttentionConfig {
        scorer: BlockScorer::Sketch,
        ..base.clone()
    };
    let (hk, nb) = (geom.num_kv_heads, geom.blocks_for(ctx));
    let mut seq = SeqAttention::new(geom, layers, ctx, digests.to_vec());
    let mut r = SplitMix(ctx as u64 ^ 0xd1ce);
    let sets: Vec<Vec<Vec<f32>>> = (0..4 * layers)
        .map(|_| {
            (0..hk)
                .map(|_| (0..nb).map(|_| r.next_f64() as f32 / nb as f32).collect())
                .collect()
        })
        .collect();
    let keys = vec![0.5f32; hk * geom.head_dim];
    let mut times = Vec::new();
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < end || times.len() < 4 * layers {
        let i = times.len();
        let layer = i % layers;
        // A step's new token can open a block the sets do not cover: it scores 0, as the
        // newest block does.
        let mut scores = sets[i % sets.len()].clone();
        for s in &mut scores {
            s.resize(seq.num_blocks(), 0.0);
        }
        let cut = seq.top_cut(&cfg, layer).filter(|_| picks);
        let picked = cut.map(|cut| {
            let rows: Vec<&[f32]> = scores.iter().map(Vec::as_slice).collect();
            attention::best_in(&rows, cut)
        });
        let start = Instant::now();
        let plans = match &picked {
            Some(p) => seq.plan_layer_picked(&cfg, layer, p),
            None => Some(seq.plan_layer_scored(&cfg, layer, &scores)),
        };
        times.push(start.elapsed().as_secs_f64());
        std::hint::black_box(plans);
        if layer == layers - 1 {
            for l in 0..layers {
                seq.append_token(&cfg, l, &keys);
            }
            seq.advance();
        }
    }
    times.sort_by(f64::total_cmp);
    let per_layer = times[times.len() / 2];
    let (name, what) = if picks {
        (
            "device-picks",
            "the host's residency plan of blocks picked on the device",
        )
    } else {
        (
            "device",
            "the host's top-k and residency plan of scores made on the device",
        )
    };
    if !common.json {
        eprintln!(
            "select {name} ctx={ctx:>6} H={hk} {:?}: {:7.3} ms/layer ({what}, 1 thread)",
            cfg.mode,
            per_layer * 1e3,
        );
    }
    json!({
        "scorer": name, "context": ctx, "threads": 1, "kv_heads": hk,
        "block_size": geom.block_size, "budget_tokens": cfg.budget_tokens,
        "mode": format!("{:?}", cfg.mode).to_lowercase(), "ms_per_layer": per_layer * 1e3,
    })
}

/// Most layers `--layers 0` takes.
const MAX_LAYERS: usize = 64;

/// A layer's digests (Quest's bound: two f32 vectors a block and head) and host sketch
/// (each token's nibbles and scale), in bytes, over the blocks before the newest.
fn digest_and_sketch_bytes(geom: BlockGeometry, ctx: usize) -> (usize, usize) {
    let (hk, d, bs) = (geom.num_kv_heads, geom.head_dim, geom.block_size);
    let older = geom.blocks_for(ctx).saturating_sub(1);
    (
        hk * older * 2 * d * 4,
        hk * older * bs * (attention::sketch::nibble_bytes(d) + 4),
    )
}

/// `--layers 0`: as many layers as make every scorer's data for `ctx` (digests and the
/// sketch) at least twice the last-level cache, so a layer's are read from memory on its
/// next visit, as in a node, where a step's weights stream through the cache between two
/// visits; 4..=64 layers, and at most 4 GiB of KV. With 4 layers, SmolLM2's shape at 8k (0.9
/// MB of sketch a layer) stayed in a 32 MiB cache: 0.08 ms a layer against 0.12 with 30.
fn layers_beyond_cache(geom: BlockGeometry, ctx: usize) -> usize {
    let (digests, sketch) = digest_and_sketch_bytes(geom, ctx);
    let cache = last_level_cache_bytes().unwrap_or(32 << 20);
    let kv = (geom.blocks_for(ctx) * geom.block_bytes()).max(1);
    (2 * cache)
        .div_ceil((digests + sketch).max(1))
        .min((4usize << 30) / kv)
        .clamp(4, MAX_LAYERS)
}

/// Bytes one layer's selection reads, averaged over `queries`' layers: every digest of
/// every head (Quest's bound), for SparQ the key rows it reads of the blocks it scores, and
/// for the sketch every token's nibbles and scale.
fn bytes_per_layer(
    cfg: &AttentionConfig,
    geom: BlockGeometry,
    ctx: usize,
    queries: &[Vec<f32>],
    g: usize,
) -> f64 {
    let (hk, d, bs) = (geom.num_kv_heads, geom.head_dim, geom.block_size);
    let older = geom.blocks_for(ctx).saturating_sub(1);
    let (digests, sketch) = digest_and_sketch_bytes(geom, ctx);
    let digests = digests as f64;
    if cfg.scorer == BlockScorer::Sketch {
        return sketch as f64;
    }
    let BlockScorer::Sparq {
        channels,
        candidates,
    } = cfg.scorer
    else {
        return digests;
    };
    let pool = candidates.saturating_mul(cfg.budget_blocks(bs));
    let (scored, bound) = if candidates == 0 || older <= pool {
        (older, 0.0)
    } else {
        (pool, digests)
    };
    let row_bytes = bs * geom.dtype.size();
    let rows: usize = queries
        .iter()
        .flat_map(|q| q.chunks_exact(g * d))
        .map(|qg| attention::sparq_rows_read(qg, d, channels))
        .sum();
    let rows_per_head = rows as f64 / (queries.len() * hk) as f64;
    bound + hk as f64 * scored as f64 * rows_per_head * row_bytes as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom(hk: usize, d: usize) -> BlockGeometry {
        BlockGeometry {
            block_size: 32,
            num_kv_heads: hk,
            head_dim: d,
            dtype: KvDType::Bf16,
        }
    }

    /// `--layers 0` takes layers until their selection data are twice the last-level cache,
    /// between 4 and 64 layers and within 4 GiB of KV.
    #[test]
    fn auto_layers_outgrow_the_cache_within_their_bounds() {
        let cache = last_level_cache_bytes().unwrap_or(32 << 20);
        for (hk, d, ctx) in [
            (3, 64, 8192),
            (8, 128, 32768),
            (8, 128, 1 << 20),
            (1, 64, 33),
        ] {
            let g = geom(hk, d);
            let n = layers_beyond_cache(g, ctx);
            assert!((4..=MAX_LAYERS).contains(&n), "{hk} {d} {ctx}: {n}");
            let kv = g.blocks_for(ctx) * g.block_bytes();
            assert!(n == 4 || n * kv <= 4 << 30, "{hk} {d} {ctx}: {n}");
            let older = g.blocks_for(ctx) - 1;
            let per_layer = hk * older * (2 * d * 4 + 32 * (d / 2 + 4));
            // Short of twice the cache only where a bound stopped it.
            assert!(
                n * per_layer >= 2 * cache || n == MAX_LAYERS || (n + 1) * kv > 4 << 30,
                "{hk} {d} {ctx}: {n}"
            );
        }
        // A million tokens of Qwen3-14B's shape: 4 GiB of KV a layer, so the floor.
        assert_eq!(layers_beyond_cache(geom(8, 128), 1 << 20), 4);
    }
}
