//! `decode-node bench`: every figure is a ratio against a bound measured in the same run.

use std::time::{Duration, Instant};

use anyhow::Context;
use attention::{BlockGeometry, HeadBlock, KvDType, Scratch, attend_blocks, encode_from_f32};
use bytes::Bytes;
use decode_node_proto::v1 as pb;
use kv_transfer::client::{PromptKv, PushOptions, push_kv};
use rayon::prelude::*;
use serde_json::json;

mod fidelity;

use crate::cli::BenchArgs;
use crate::client;
use crate::model::random::SplitMix;
use crate::service::InProcess;

/// Runs the bench named by `args.what`.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let report = match args.what.as_str() {
        "kernels" => tokio::task::spawn_blocking(move || kernels(&args)).await??,
        "ingest" => ingest(&args).await?,
        "decode" => decode(&args).await?,
        "step" => tokio::task::spawn_blocking(move || step(&args)).await??,
        "recall-profile" => tokio::task::spawn_blocking(move || recall_profile(&args)).await??,
        "soak" => soak(&args).await?,
        "fidelity" => tokio::task::spawn_blocking(move || fidelity::fidelity(&args)).await??,
        other => anyhow::bail!("`bench {other}` is not built yet in this version"),
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// Bytes/s of reading `buf` with `threads` threads (best of a few passes).
fn read_bandwidth(buf: &[f32], threads: usize, seconds: f64) -> f64 {
    let chunk = buf.len().div_ceil(threads);
    let mut best = 0f64;
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    let mut sink = 0f32;
    while Instant::now() < end || best == 0.0 {
        let t = Instant::now();
        let sums: Vec<f32> = std::thread::scope(|s| {
            let hs: Vec<_> = buf.chunks(chunk).map(|c| s.spawn(move || sum(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0.0)).collect()
        });
        sink += sums.iter().sum::<f32>();
        best = best.max((buf.len() * 4) as f64 / t.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink);
    best
}

fn sum(c: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for x in c.chunks_exact(16) {
        for i in 0..16 {
            acc[i] += x[i];
        }
    }
    acc.iter().sum()
}

/// Bytes/s of single-thread memcpy (best of a few passes).
fn memcpy_bandwidth(bytes: usize, seconds: f64) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut best = 0f64;
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < end || best == 0.0 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        best = best.max(bytes as f64 / t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    best
}

fn parse_list<T: std::str::FromStr>(s: &str, what: &str) -> anyhow::Result<Vec<T>> {
    s.split(',')
        .map(|x| {
            x.trim()
                .parse()
                .map_err(|_| anyhow::anyhow!("bad {what} {x:?}"))
        })
        .collect()
}

/// CPU sparse attention: KV bytes scanned per second ÷ read bandwidth, per configuration.
fn kernels(args: &BenchArgs) -> anyhow::Result<serde_json::Value> {
    let threads: Vec<usize> = parse_list(&args.threads, "thread count")?;
    let working_set = 256usize << 20;
    let buf: Vec<f32> = (0..working_set / 4).map(|i| (i % 7) as f32).collect();
    let mut rows = Vec::new();
    for &t in &threads {
        let bw = read_bandwidth(&buf, t, args.seconds.min(1.0));
        for dtype in [KvDType::F16, KvDType::Bf16] {
            for g in [1usize, 4, 8] {
                for d in [64usize, 128] {
                    let geom = BlockGeometry {
                        block_size: 32,
                        num_kv_heads: 1,
                        head_dim: d,
                        dtype,
                    };
                    let hb = geom.head_bytes();
                    let nblocks = (working_set / hb).max(1);
                    let mut data = vec![0u8; nblocks * hb];
                    let vals: Vec<f32> = {
                        let mut r = SplitMix(7);
                        (0..hb / dtype.size())
                            .map(|_| (r.next_f64() as f32) - 0.5)
                            .collect()
                    };
                    for blk in data.chunks_exact_mut(hb) {
                        encode_from_f32(dtype, &vals, blk);
                    }
                    let q: Vec<f32> = (0..g * d).map(|i| (i % 5) as f32 * 0.1).collect();
                    let per = nblocks.div_ceil(t);
                    let mut best = 0f64;
                    let end = Instant::now() + Duration::from_secs_f64(args.seconds);
                    while Instant::now() < end || best == 0.0 {
                        let start = Instant::now();
                        std::thread::scope(|s| {
                            for part in data.chunks(per * hb) {
                                let q = &q;
                                s.spawn(move || {
                                    let mut scratch = Scratch::default();
                                    let blocks = part
                                        .chunks_exact(hb)
                                        .map(|b| HeadBlock { bytes: b, len: 32 });
                                    std::hint::black_box(attend_blocks(
                                        &geom,
                                        q,
                                        0.1,
                                        blocks,
                                        &mut scratch,
                                    ));
                                });
                            }
                        });
                        best = best.max(data.len() as f64 / start.elapsed().as_secs_f64());
                    }
                    let row = json!({
                        "dtype": dtype.name(), "group": g, "head_dim": d, "threads": t,
                        "kv_gb_per_s": best / 1e9, "read_gb_per_s": bw / 1e9, "ratio": best / bw,
                    });
                    if !args.json {
                        eprintln!(
                            "kernels {:>4} G={g} D={d:>3} threads={t}: {:6.2} GB/s of KV / {:6.2} GB/s read = {:.2}",
                            dtype.name(),
                            best / 1e9,
                            bw / 1e9,
                            best / bw
                        );
                    }
                    rows.push(row);
                }
            }
        }
    }
    Ok(json!({ "bench": "kernels", "goal_ratio": 0.8, "results": rows }))
}

/// Starts an in-process node on loopback for `model` with these serve settings.
async fn start_node(
    model: crate::cli::ModelArgs,
    host_kv_bytes: u64,
    device_kv_bytes: u64,
    max_batch: u32,
    kv_lease: f64,
    prefault: bool,
) -> anyhow::Result<InProcess> {
    let mut sa = InProcess::loopback_args(model, host_kv_bytes, device_kv_bytes);
    sa.max_batch = max_batch;
    sa.kv_lease = kv_lease;
    sa.host_kv_prefault = prefault;
    InProcess::start(sa)
        .await
        .context("the bench node did not start")
}

/// Random KV for `info`'s layout, as a push for `id` of `tokens` tokens.
fn synthetic_kv(info: &pb::ModelInfo, id: &str, tokens: usize, seed: u64) -> PromptKv {
    let dtype = match pb::DType::try_from(info.kv_dtype) {
        Ok(pb::DType::DtypeF16) => KvDType::F16,
        Ok(pb::DType::DtypeBf16) => KvDType::Bf16,
        _ => KvDType::F32,
    };
    let n = tokens * info.num_kv_heads as usize * info.head_dim as usize;
    let make = |seed: u64| {
        let mut r = SplitMix(seed);
        let v: Vec<f32> = (0..n).map(|_| (r.next_f64() as f32 - 0.5) * 2.0).collect();
        let mut b = vec![0u8; n * dtype.size()];
        encode_from_f32(dtype, &v, &mut b);
        Bytes::from(b)
    };
    // Layers in parallel: long contexts of large models are gigabytes of random KV.
    let layers = (0..u64::from(info.num_layers))
        .into_par_iter()
        .map(|l| (make(seed ^ (l << 32)), make(seed ^ (l << 32) ^ 1)))
        .collect();
    let mut r = SplitMix(seed);
    let vocab = info.vocab_size.max(1) as u64;
    PromptKv {
        header: pb::KvHeader {
            request_id: id.into(),
            model_id: info.model_id.clone(),
            num_layers: info.num_layers,
            num_kv_heads: info.num_kv_heads,
            head_dim: info.head_dim,
            dtype: info.kv_dtype,
            num_tokens: tokens as u32,
            prompt_token_ids: (0..tokens).map(|_| (r.next_u64() % vocab) as u32).collect(),
            next_token_id: (r.next_u64() % vocab) as u32,
        },
        layers,
    }
}

async fn model_info(target: &str) -> anyhow::Result<pb::ModelInfo> {
    let ch = client::connect(target).await?;
    Ok(client::decode_client(ch, None)
        .get_model_info(pb::GetModelInfoRequest {})
        .await?
        .into_inner())
}

/// The same pushes written into a pool in-process (no transport): the store path's own rate.
fn store_rate(model: &crate::cli::ModelArgs, kv: &PromptKv, rounds: u64) -> anyhow::Result<f64> {
    let node = crate::node::Node::build(model)?;
    let bytes: u64 = kv
        .layers
        .iter()
        .map(|(k, v)| (k.len() + v.len()) as u64)
        .sum();
    let pool =
        kv_transfer::HostPool::with_prefault(node.layout.geom, 2 * bytes + (64 << 20), true)?;
    let t = Instant::now();
    for _ in 0..rounds {
        drop(client::ingest_local(&node.layout, &pool, kv)?);
    }
    Ok((rounds * bytes) as f64 / t.elapsed().as_secs_f64())
}

/// Loopback ingest: bytes/s ÷ single-thread memcpy bytes/s in the same run.
async fn ingest(args: &BenchArgs) -> anyhow::Result<serde_json::Value> {
    let memcpy = memcpy_bandwidth(256 << 20, 1.0);
    let node = start_node(args.model.clone(), 2 << 30, 1 << 30, 8, 600.0, true).await?;
    let target = node.target();
    let info = model_info(&target).await?;
    let per_token =
        2 * info.num_layers as u64 * info.num_kv_heads as u64 * info.head_dim as u64 * {
            if info.kv_dtype == pb::DType::DtypeF32 as i32 {
                4
            } else {
                2
            }
        };
    let tokens = ((256u64 << 20) / per_token).clamp(1, info.max_context as u64 - 1) as usize;
    let kv = synthetic_kv(&info, "ingest-0", tokens, 1);
    let push_bytes: u64 = kv
        .layers
        .iter()
        .map(|(k, v)| (k.len() + v.len()) as u64)
        .sum();
    let total = (args.gib * (1u64 << 30) as f64) as u64;
    let rounds = total.div_ceil(push_bytes).max(1);
    let ch = client::connect(&target).await?;
    let dc = client::decode_client(ch.clone(), None);
    let opts = PushOptions {
        chunk_tokens: ((4u64 << 20) / per_token * info.num_layers as u64).max(1) as usize,
        ..Default::default()
    };
    let streams = u64::from(args.streams.max(1));
    let t = Instant::now();
    let mut tasks = Vec::new();
    for s in 0..streams {
        let (ch, kv, opts) = (ch.clone(), kv.clone(), opts.clone());
        let mut dc = dc.clone();
        tasks.push(tokio::spawn(async move {
            for i in (s..rounds).step_by(streams as usize) {
                let mut kv = kv.clone();
                kv.header.request_id = format!("ingest-{i}");
                push_kv(ch.clone(), &kv, &opts, |_| {})
                    .await
                    .map_err(|s| anyhow::anyhow!("push: {s}"))?;
                dc.cancel(pb::CancelRequest {
                    request_id: kv.header.request_id.clone(),
                    lease: String::new(),
                })
                .await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let secs = t.elapsed().as_secs_f64();
    let rate = (rounds * push_bytes) as f64 / secs;
    node.stop().await?;
    let store = {
        let (model, kv) = (args.model.clone(), kv.clone());
        tokio::task::spawn_blocking(move || store_rate(&model, &kv, rounds)).await??
    };
    if !args.json {
        eprintln!(
            "ingest: {:.2} GB in {secs:.2}s over {streams} stream(s) = {:.2} GB/s (store alone {:.2} GB/s); memcpy {:.2} GB/s; ratio {:.3} (goal 0.25)",
            (rounds * push_bytes) as f64 / 1e9,
            rate / 1e9,
            store / 1e9,
            memcpy / 1e9,
            rate / memcpy
        );
    }
    Ok(json!({
        "bench": "ingest", "bytes": rounds * push_bytes, "seconds": secs, "gb_per_s": rate / 1e9,
        "memcpy_gb_per_s": memcpy / 1e9, "ratio": rate / memcpy, "goal_ratio": 0.25,
        "store_gb_per_s": store / 1e9, "streams": streams,
        "push_bytes": push_bytes, "tokens_per_push": tokens,
    }))
}

fn parse_tokens(s: &str) -> anyhow::Result<usize> {
    let s = s.trim().to_ascii_lowercase();
    let (num, mult) = match s.strip_suffix('k') {
        Some(n) => (n, 1024),
        None => (s.as_str(), 1),
    };
    Ok(num
        .parse::<usize>()
        .with_context(|| format!("bad context length {s:?}"))?
        * mult)
}

/// Bytes of KV for `tokens` tokens of `model` in its own dtype (f32 where it names none).
fn kv_bytes_for(model: &crate::cli::ModelArgs, tokens: usize) -> anyhow::Result<u64> {
    let cfg = if model.model == "tiny" {
        crate::model::random::tiny().0
    } else {
        crate::model::ModelConfig::from_dir(std::path::Path::new(&model.model))?
    };
    let es = KvDType::parse(&cfg.torch_dtype).map_or(4, |d| d.size());
    Ok((tokens * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * es) as u64)
}

/// Decode throughput per attention mode and context length, ratio to `full` in the same run.
async fn decode(args: &BenchArgs) -> anyhow::Result<serde_json::Value> {
    let contexts: Vec<usize> = args
        .context
        .split(',')
        .map(parse_tokens)
        .collect::<Result<_, _>>()?;
    let modes: Vec<String> = args
        .modes
        .split(',')
        .map(|m| m.trim().to_string())
        .collect();
    let mut rows = Vec::new();
    for &ctx in &contexts {
        let mut full_tps = None;
        // Generated once per context (Bytes clones share it), pushed to each mode's node.
        let mut prompts = Vec::new();
        for mode in &modes {
            let mut m = args.model.clone();
            m.attention = mode.clone();
            let node_device = m.device.clone();
            // Room for the whole context of every request on the host, and on the device in
            // `full` (the other modes hold their budget there).
            let kv_bytes = kv_bytes_for(&args.model, ctx + args.tokens as usize + 64)?
                * u64::from(args.batch.max(1));
            let host = kv_bytes + (kv_bytes >> 4) + (64 << 20);
            let device = if mode == "full" { host } else { 4 << 30 };
            let node = start_node(m, host, device, args.batch.max(1), 600.0, false).await?;
            let target = node.target();
            let info = model_info(&target).await?;
            anyhow::ensure!(
                (ctx as u32) < info.max_context,
                "context {ctx} exceeds the model's {}",
                info.max_context
            );
            let ch = client::connect(&target).await?;
            if prompts.is_empty() {
                for b in 0..args.batch.max(1) {
                    prompts.push(synthetic_kv(&info, &format!("d{b}"), ctx, b as u64 + 1));
                }
            }
            for kv in &prompts {
                client::push(ch.clone(), kv, None, |_| {}).await?;
            }
            let t = Instant::now();
            let mut gens = Vec::new();
            for b in 0..args.batch.max(1) {
                let req = pb::GenerateRequest {
                    request_id: format!("d{b}"),
                    sampling: Some(pb::SamplingParams::default()),
                    max_new_tokens: args.tokens.max(1),
                    ignore_eos: true,
                    ..Default::default()
                };
                let ch = ch.clone();
                gens.push(tokio::spawn(async move {
                    let mut first = None;
                    let out = client::generate(ch, None, req, |_| {
                        first.get_or_insert_with(Instant::now);
                    })
                    .await;
                    out.map(|o| (o, first))
                }));
            }
            let mut tokens = 0u64;
            let mut cpu = 0f64;
            let mut hit = 0f64;
            let mut wait = 0f64;
            let mut last_first = t;
            for g in gens {
                let (out, first) = g.await??;
                last_first = last_first.max(first.unwrap_or(t));
                tokens += out.ids.len() as u64;
                let s = out.finish.and_then(|f| f.stats).unwrap_or_default();
                cpu += s.cpu_attention_ratio;
                hit += s.prediction_hit_ratio;
                wait += s.device_wait_seconds;
            }
            let secs = t.elapsed().as_secs_f64();
            // Steady decode: tokens after every request's first, over the time after it. The
            // first token carries the one-off fill of the device (all of it in `full`).
            let first_token_s = last_first.duration_since(t).as_secs_f64();
            let after = (secs - first_token_s).max(1e-9);
            let tps = tokens.saturating_sub(u64::from(args.batch.max(1))) as f64 / after;
            // The step thread serves the whole batch: its waits add up against wall time.
            let device_wait_share = wait / secs;
            node.stop().await?;
            if mode == "full" {
                full_tps = Some(tps);
            }
            let nb = args.batch.max(1) as f64;
            let row = json!({
                "context": ctx, "mode": mode, "batch": args.batch, "tokens_per_s": tps,
                "first_token_s": first_token_s, "device": node_device,
                "ratio_to_full": full_tps.map(|f| tps / f),
                "cpu_share": cpu / nb, "prediction_hit_ratio": hit / nb, "device_wait_share": device_wait_share,
            });
            if !args.json {
                eprintln!(
                    "decode ctx={ctx} {mode:>6}: {tps:8.1} tok/s, x{:.2} of full, first token {:.3} s, CPU share {:.1}%, hit {:.1}%, device waits {:.1}%",
                    full_tps.map_or(f64::NAN, |f| tps / f),
                    first_token_s,
                    cpu / nb * 100.0,
                    hit / nb * 100.0,
                    device_wait_share * 100.0
                );
            }
            rows.push(row);
        }
    }
    Ok(json!({ "bench": "decode", "results": rows }))
}

/// Attention over the token itself only: the step's cost is then the weights it streams.
#[derive(Debug)]
struct SelfOnly {
    group: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl crate::model::DecodeAttention for SelfOnly {
    fn attend(
        &mut self,
        _layer: usize,
        _q: &[f32],
        _k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), crate::model::ModelError> {
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

/// One decode step of the model: tokens/s and weight bytes streamed per second ÷ read
/// bandwidth measured in the same run (all cores).
fn step(args: &BenchArgs) -> anyhow::Result<serde_json::Value> {
    let node = crate::node::Node::build(&args.model)?;
    let m = &node.model.model;
    let cfg = &m.cfg;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The bound: the device's own memory where weights live there, else host read bandwidth.
    let bw = match m.backend().memory_bandwidth() {
        Some(bw) => bw,
        None => {
            let buf: Vec<f32> = (0..(512usize << 20) / 4).map(|i| (i % 7) as f32).collect();
            read_bandwidth(&buf, threads, 1.0)
        }
    };
    let mut rows = Vec::new();
    for batch in [1usize, args.batch.max(1) as usize] {
        let mut attn = SelfOnly {
            group: cfg.num_heads / cfg.num_kv_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        };
        let tokens = vec![1u32; batch];
        let positions = vec![8usize; batch];
        // Warm-up step maps the weights in.
        m.decode_step(&tokens, &positions, &mut attn)?;
        let mut steps = 0u32;
        let t = Instant::now();
        while steps == 0 || t.elapsed().as_secs_f64() < args.seconds {
            m.decode_step(&tokens, &positions, &mut attn)?;
            steps += 1;
        }
        let per_step = t.elapsed().as_secs_f64() / steps as f64;
        let gbps = m.weight_bytes() as f64 / per_step;
        if !args.json {
            eprintln!(
                "step batch={batch}: {:.3} s/step, {:.2} tokens/s, weights {:.2} GB/s / read {:.2} GB/s = {:.2}",
                per_step,
                batch as f64 / per_step,
                gbps / 1e9,
                bw / 1e9,
                gbps / bw
            );
        }
        rows.push(json!({
            "batch": batch, "seconds_per_step": per_step, "tokens_per_s": batch as f64 / per_step,
            "weight_bytes": m.weight_bytes(), "weights_gb_per_s": gbps / 1e9, "read_gb_per_s": bw / 1e9,
            "ratio": gbps / bw, "threads": threads,
        }));
        if args.batch <= 1 {
            break;
        }
    }
    Ok(
        json!({ "bench": "step", "model_id": m.model_id, "device": m.backend().name(), "results": rows }),
    )
}

/// Offline recall profile: decodes a real prompt with `scout` and recall off, records each
/// layer's CPU share per step, and derives per-layer recall intervals (the steps a layer stays
/// under `--recall-threshold` after the device is filled). Feed the JSON to
/// `serve --recall-profile FILE`.
fn recall_profile(args: &BenchArgs) -> anyhow::Result<serde_json::Value> {
    use crate::engine::{Control, Engine, EngineConfig, Event, Job, JobSpec};
    use kv_transfer::{HostPool, Ingest, client::push_messages};
    use pb::push_kv_request::Item;

    let mut margs = args.model.clone();
    margs.attention = "scout".into();
    margs.no_recall = true;
    let mut node = crate::node::Node::build(&margs)?;
    node.attention.profile = true;
    let ctx = parse_tokens(args.context.split(',').next().unwrap_or("2k"))?;
    let vocab = node.model.model.cfg.vocab_size as u64;
    let mut r = SplitMix(11);
    let prompt: Vec<u32> = (0..ctx)
        .map(|_| (r.next_u64() % vocab.min(256)) as u32)
        .collect();
    let kv = client::prefill_kv(&node.model, &prompt, "profile", node.layout.geom.dtype)?;
    let geom = node.layout.geom;
    let blocks = (geom.blocks_for(ctx + args.tokens as usize + 1) + 1) * node.layout.num_layers;
    let pool = HostPool::new(geom, (blocks * geom.block_bytes()) as u64)?;
    let mut ingest = None;
    for m in push_messages(&kv, 256) {
        match m.item {
            Some(Item::Header(h)) => ingest = Some(Ingest::begin(&node.layout, &pool, &h)?),
            Some(Item::Chunk(c)) => ingest.as_mut().context("header first")?.chunk(&c.into())?,
            _ => {}
        }
    }
    let committed = ingest.context("no header")?.commit()?;
    let (engine, thread) = Engine::start(
        node.model.clone(),
        pool,
        EngineConfig {
            attention: node.attention.clone(),
            max_batch: 1,
            device_kv_bytes: u64::MAX / 4,
            queue_timeout: Duration::from_secs(60),
            cpu_threads: 1,
        },
        crate::metrics::Metrics::new(),
    )?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let spec = JobSpec {
        request_id: "profile".into(),
        sampling: crate::model::Sampling::default(),
        max_new_tokens: args.tokens.max(2),
        stop_ids: Vec::new(),
        ignore_eos: true,
        arrived: Instant::now(),
        events: tx,
    };
    engine.send(Control::Submit(Job {
        kv: Box::new(committed),
        spec,
    }));
    let history = loop {
        match rx.blocking_recv() {
            Some(Event::Finish { stats, .. }) => break stats.layer_cpu_history,
            Some(Event::Error(e)) => anyhow::bail!("profile run failed: {e}"),
            Some(Event::Token { .. }) => {}
            None => anyhow::bail!("the engine stopped during the profile"),
        }
    };
    engine.send(Control::Shutdown);
    let _ = thread.join();
    let threshold = args.model.recall_threshold;
    let intervals = attention::recall_intervals(&history, threshold);
    let means: Vec<f32> = history
        .iter()
        .map(|h| h.iter().sum::<f32>() / h.len().max(1) as f32)
        .collect();
    if !args.json {
        eprintln!(
            "recall-profile: context {ctx}, {} steps, threshold {threshold}",
            args.tokens
        );
        for (l, (iv, m)) in intervals.iter().zip(&means).enumerate() {
            eprintln!(
                "  layer {l:>3}: interval {iv:>4} steps, mean CPU share without recall {:.1}%",
                m * 100.0
            );
        }
    }
    Ok(json!({
        "bench": "recall-profile", "context": ctx, "steps": args.tokens,
        "threshold": (threshold as f64 * 1e6).round() / 1e6,
        "intervals": intervals, "mean_cpu_ratio_without_recall": means,
    }))
}

fn parse_duration(s: &str) -> anyhow::Result<Duration> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num
        .parse()
        .with_context(|| format!("bad duration {s:?} (use e.g. 90s or 10m)"))?;
    anyhow::ensure!(v > 0.0 && v.is_finite(), "bad duration {s:?}");
    Ok(Duration::from_secs_f64(v * mult))
}

/// Resident bytes after handing the allocator's free memory back to the OS, so that what is
/// compared is memory still in use, not glibc's cached free lists.
fn rss_bytes() -> u64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions; it only releases free heap pages.
    unsafe {
        libc::malloc_trim(0);
    }
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|x| x.parse::<u64>().ok())
        })
        .map_or(0, |p| p * 4096)
}

/// Latencies in log-spaced buckets (10 us .. 100 s, ~2% wide): fixed memory, ~2% quantiles.
#[derive(Debug, Clone)]
struct LogHistogram {
    counts: Vec<u64>,
}

impl Default for LogHistogram {
    fn default() -> Self {
        Self {
            counts: vec![0; Self::BUCKETS],
        }
    }
}

impl LogHistogram {
    const BUCKETS: usize = 800;
    const LO: f64 = 1e-5;
    const PER_DECADE: f64 = 114.0;

    fn add(&mut self, s: f64) {
        let i = ((s.max(Self::LO) / Self::LO).log10() * Self::PER_DECADE) as usize;
        self.counts[i.min(Self::BUCKETS - 1)] += 1;
    }

    fn quantile(&self, q: f64) -> f64 {
        let n: u64 = self.counts.iter().sum();
        if n == 0 {
            return 0.0;
        }
        let want = ((n - 1) as f64 * q).round() as u64;
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen > want {
                return Self::LO * 10f64.powf((i as f64 + 0.5) / Self::PER_DECADE);
            }
        }
        Self::LO * 10f64.powf(Self::BUCKETS as f64 / Self::PER_DECADE)
    }
}

/// Running totals of a soak.
#[derive(Debug, Default)]
struct SoakTally {
    requests: u64,
    by_code: std::collections::BTreeMap<&'static str, u64>,
    ttft: LogHistogram,
    itl: LogHistogram,
}

impl SoakTally {
    fn add(&mut self, o: SoakOutcome) {
        self.requests += 1;
        *self.by_code.entry(o.code).or_default() += 1;
        if let Some(t) = o.ttft {
            self.ttft.add(t);
        }
        o.itl.iter().for_each(|t| self.itl.add(*t));
    }
}

/// Lease of the soak's node: short, so KV of pushes killed after their commit expires.
const SOAK_LEASE_S: f64 = 2.0;

/// What one soak request ended as.
#[derive(Debug, Default)]
struct SoakOutcome {
    code: &'static str,
    ttft: Option<f64>,
    itl: Vec<f64>,
}

/// One soak request: push, then generate; some are cancelled, some streams are killed.
async fn soak_one(target: String, info: pb::ModelInfo, i: u64) -> SoakOutcome {
    let mut r = SplitMix(i ^ 0xABCD);
    let ctx = 16 + (r.next_u64() % 240) as usize;
    let id = format!("soak-{i}");
    let kv = synthetic_kv(&info, &id, ctx, i);
    let fate = r.next_u64() % 10;
    let Ok(ch) = client::connect(&target).await else {
        return SoakOutcome {
            code: "unavailable",
            ..Default::default()
        };
    };
    if fate == 0 {
        // A prefill node that dies mid-push: the push task is killed after it started.
        let ch2 = ch.clone();
        let kv2 = kv.clone();
        let t = tokio::spawn(async move { client::push(ch2, &kv2, None, |_| {}).await });
        tokio::time::sleep(Duration::from_micros(200)).await;
        t.abort();
        return SoakOutcome {
            code: "killed_push",
            ..Default::default()
        };
    }
    if let Err(e) = push_kv(
        ch.clone(),
        &kv,
        &PushOptions {
            retries: 0,
            ..Default::default()
        },
        |_| {},
    )
    .await
    {
        return SoakOutcome {
            code: kv_transfer::code_label(e.code()),
            ..Default::default()
        };
    }
    let req = pb::GenerateRequest {
        request_id: id.clone(),
        sampling: Some(pb::SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            seed: i,
        }),
        max_new_tokens: 8 + (r.next_u64() % 56) as u32,
        ignore_eos: true,
        kv_timeout_ms: 5_000,
        ..Default::default()
    };
    let start = Instant::now();
    let mut dc = client::decode_client(ch.clone(), None);
    let mut stream = match dc.generate(req).await {
        Ok(s) => s.into_inner(),
        Err(e) => {
            return SoakOutcome {
                code: kv_transfer::code_label(e.code()),
                ..Default::default()
            };
        }
    };
    let mut out = SoakOutcome {
        code: "ok",
        ..Default::default()
    };
    let mut last = start;
    let mut n = 0;
    loop {
        match stream.message().await {
            Ok(Some(m)) => match m.event {
                Some(pb::generate_response::Event::Token(_)) => {
                    let now = Instant::now();
                    if out.ttft.is_none() {
                        out.ttft = Some(now.duration_since(start).as_secs_f64());
                    } else {
                        out.itl.push(now.duration_since(last).as_secs_f64());
                    }
                    last = now;
                    n += 1;
                    if fate == 1 && n == 3 {
                        let _ = dc
                            .cancel(pb::CancelRequest {
                                request_id: id.clone(),
                                lease: String::new(),
                            })
                            .await;
                        out.code = "cancelled";
                    }
                    if fate == 2 && n == 2 {
                        // An orchestrator that goes away mid-stream.
                        out.code = "disconnected";
                        return out;
                    }
                }
                Some(pb::generate_response::Event::Finish(_)) => return out,
                None => {}
            },
            Ok(None) => return out,
            Err(e) => {
                out.code = kv_transfer::code_label(e.code());
                return out;
            }
        }
    }
}

/// Pushers and generators at a fixed rate for `--duration`, with random cancels and killed
/// streams; RSS and pool bytes must return to where they started.
async fn soak(args: &BenchArgs) -> anyhow::Result<serde_json::Value> {
    let duration = parse_duration(&args.duration)?;
    let node = start_node(
        args.model.clone(),
        512 << 20,
        256 << 20,
        32,
        SOAK_LEASE_S,
        true,
    )
    .await?;
    let target = node.target();
    let info = model_info(&target).await?;
    let ch = client::connect(&target).await?;
    let mut dc = client::decode_client(ch, None);
    let load0 = dc.get_load(pb::GetLoadRequest {}).await?.into_inner();
    let period = Duration::from_secs_f64(1.0 / args.rate.max(0.1));
    // Warm up at the same rate (connections, allocator arenas, buffers reach their working
    // size), then take the baseline RSS.
    let warmup = (duration / 10).min(Duration::from_secs(30));
    let mut warm = tokio::task::JoinSet::new();
    let w0 = Instant::now();
    let mut w = 0u64;
    while w0.elapsed() < warmup {
        warm.spawn(soak_one(target.clone(), info.clone(), u64::MAX - w));
        w += 1;
        tokio::time::sleep(period).await;
    }
    while warm.join_next().await.is_some() {}
    let rss0 = rss_bytes();
    let started = Instant::now();
    let mut tick = tokio::time::interval(period);
    let mut tasks = tokio::task::JoinSet::new();
    let mut i = 0u64;
    // Results are folded into fixed-size tallies as they arrive, so the bench's own memory
    // does not grow with the run and the RSS comparison sees only the node.
    let mut tally = SoakTally::default();
    while started.elapsed() < duration {
        tick.tick().await;
        tasks.spawn(soak_one(target.clone(), info.clone(), i));
        i += 1;
        while let Some(r) = tasks.try_join_next() {
            tally.add(r?);
        }
    }
    while let Some(r) = tasks.join_next().await {
        tally.add(r?);
    }
    // Killed pushes and abandoned streams are cleaned up asynchronously, and a push killed
    // after its commit leaves KV under lease, as it should: wait out the lease.
    let mut load1 = dc.get_load(pb::GetLoadRequest {}).await?.into_inner();
    let settle = Instant::now();
    while (load1.host_kv_bytes_used != load0.host_kv_bytes_used
        || load1.running + load1.waiting > 0)
        && settle.elapsed() < Duration::from_secs_f64(SOAK_LEASE_S + 10.0)
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
        load1 = dc.get_load(pb::GetLoadRequest {}).await?.into_inner();
    }
    let rss1 = rss_bytes();
    node.stop().await?;
    let SoakTally {
        requests,
        by_code,
        ttft,
        itl,
    } = tally;
    let report = json!({
        "bench": "soak", "seconds": started.elapsed().as_secs_f64(), "requests": requests,
        "outcomes": by_code,
        "ttft_p50_s": ttft.quantile(0.5), "ttft_p99_s": ttft.quantile(0.99),
        "itl_p50_s": itl.quantile(0.5), "itl_p99_s": itl.quantile(0.99),
        "warmup_s": warmup.as_secs_f64(), "rss_start_bytes": rss0, "rss_end_bytes": rss1,
        "pool_used_start_bytes": load0.host_kv_bytes_used, "pool_used_end_bytes": load1.host_kv_bytes_used,
        "pool_returned": load1.host_kv_bytes_used == load0.host_kv_bytes_used,
    });
    if !args.json {
        eprintln!(
            "soak: {requests} requests in {:.0}s, outcomes {by_code:?}",
            started.elapsed().as_secs_f64()
        );
        eprintln!(
            "soak: pool used {} -> {} bytes; RSS {:.1} -> {:.1} MiB",
            load0.host_kv_bytes_used,
            load1.host_kv_bytes_used,
            rss0 as f64 / 1048576.0,
            rss1 as f64 / 1048576.0
        );
    }
    anyhow::ensure!(
        load1.host_kv_bytes_used == load0.host_kv_bytes_used,
        "the pool did not return to its start: {report}"
    );
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_histogram_quantiles_within_two_percent() {
        let mut h = LogHistogram::default();
        for i in 1..=1000 {
            h.add(i as f64 * 1e-3);
        }
        for (q, want) in [(0.5, 0.5005), (0.99, 0.99), (0.0, 0.001)] {
            let got = h.quantile(q);
            assert!((got - want).abs() <= 0.025 * want, "q{q}: {got} vs {want}");
        }
        assert_eq!(LogHistogram::default().quantile(0.5), 0.0);
        h.add(1e9);
        h.add(0.0);
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("-1s").is_err());
    }
}
