//! `bench decode`: tokens/s per attention mode and context length through a node on
//! loopback, as a ratio to `full` in the same run, with the bytes a step moves (weights + KV
//! attended) per second as a ratio to a bound measured in the same run: host read bandwidth
//! on the CPU, the device's copy bandwidth on a GPU. Each mode decodes in rounds, each
//! divided by the probes around it (`--rounds`); a row is the middle round.

use super::*; // the shared helpers and imports of `bench`

/// Decode throughput per attention mode and context length, ratio to `full` in the same run.
pub(super) async fn decode(args: &DecodeBench) -> anyhow::Result<serde_json::Value> {
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
    // A step streams the weights and the KV it attends: on the CPU from host memory, whose
    // bound is the read bandwidth of all cores; on a device from its own memory, whose copy
    // bandwidth the backend measures. Both are read off the first node started, while it is
    // idle; on the CPU, read bandwidth again after each round (a VM's moves by half over
    // minutes), and each round divides by the larger of the two around it. A CPU step also
    // multiplies every weight by each row of the batch: from a few rows on, the FMA rate of
    // the row kernels' SIMD bounds it before memory does.
    let cfg = model_config(&args.common.model)?;
    let on_device = args.common.model.device != "cpu";
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut bound: Option<(u64, u64, ReadPasses)> = None;
    let fma_peak = (!on_device)
        .then(|| fma_peak_threads(crate::backend::row_fma_path(args.batch as usize), cpus, 0.3));
    let bound_name = if on_device { "device copy" } else { "read" };
    let pool_dtype = crate::node::kv_dtype(&args.common.model.kv_dtype, &cfg.torch_dtype)?;
    let mut rows = Vec::new();
    for &ctx in &contexts {
        let mut full_tps = None;
        // Generated once per context (Bytes clones share it), pushed to each mode's node.
        let mut prompts = Vec::new();
        for mode in &modes {
            let mut m = args.common.model.clone();
            m.attention = mode.clone();
            let node_device = m.device.clone();
            // Room for the whole context of every request on the host (and its key sketch,
            // where the host keeps one), and on the device in `full` (the other modes hold
            // their budget there).
            let tokens = ctx + args.tokens as usize + 64;
            let batch = u64::from(args.batch.max(1));
            let kv_bytes = kv_bytes_for(&cfg, tokens) * batch;
            let host =
                kv_bytes + (kv_bytes >> 4) + sketch_bytes_for(&cfg, tokens) * batch + (64 << 20);
            let device = if mode == "full" { host } else { 4 << 30 };
            let node = start_node(
                m,
                host,
                device,
                args.batch.max(1),
                600.0,
                false,
                args.cpu_attention_threads,
            )
            .await?;
            let (weights, params, mut passes_before) = match bound {
                Some(b) => b,
                None => {
                    let m = &node.model.model;
                    let passes = match m.backend().memory_bandwidth() {
                        Some(bw) => ReadPasses::known(bw),
                        None => host_read_passes(cpus)?,
                    };
                    let b = (m.weight_bytes(), m.weight_params(), passes);
                    bound = Some(b);
                    b
                }
            };
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
            // Rounds of push, decode and probe: each round's rate is divided by the probes
            // just before and after it, so a VM whose bandwidth moves between rounds moves
            // both; the row is the middle round by that ratio.
            // With a batch, each round first decodes the first request alone on the same node:
            // the batch's speedup over one request, each pair a few seconds apart, so a VM's
            // drift over minutes moves both.
            let mut rounds = Vec::new();
            // What the device's CUDA graphs did over the rounds (a device that runs none: None).
            let graphs_before = node.model.model.backend().graph_stats();
            for _ in 0..args.rounds.max(1) {
                let alone = if args.batch > 1 {
                    client::push(ch.clone(), &prompts[0], None, |_| {}).await?;
                    Some(run_round(&ch, 1, args.tokens).await?.tps)
                } else {
                    None
                };
                for kv in &prompts {
                    client::push(ch.clone(), kv, None, |_| {}).await?;
                }
                let round = run_round(&ch, args.batch, args.tokens).await?;
                // The larger figure of the probes around the round, for the best pass and
                // the median.
                let around = if on_device {
                    Bound {
                        best: passes_before.best,
                        median: None,
                    }
                } else {
                    let after = host_read_passes(cpus)?;
                    let b = Bound {
                        best: passes_before.best.max(after.best),
                        median: Some(passes_before.median.max(after.median)),
                    };
                    bound = Some((weights, params, after));
                    passes_before = after;
                    b
                };
                rounds.push((round, around, alone));
            }
            let graphs = graphs_before
                .zip(node.model.model.backend().graph_stats())
                .map(|(a, b)| {
                    [
                        b.replays.saturating_sub(a.replays),
                        b.captures.saturating_sub(a.captures),
                        b.queued.saturating_sub(a.queued),
                    ]
                })
                .filter(|counts| counts.iter().any(|&c| c > 0));
            node.stop().await?;
            let nb = args.batch.max(1) as f64;
            // Bytes a step moves: the weights once for the batch, and each request's KV over
            // the tokens it attends (its mean context in `full`, at most the budget otherwise).
            let (step_bytes, attended) = {
                let mean_ctx = ctx as f64 + f64::from(args.tokens) / 2.0;
                let attended = if mode == "full" {
                    mean_ctx
                } else {
                    mean_ctx.min(f64::from(args.common.model.budget_tokens))
                };
                // The pool's bytes per token (int8 and fp8 with their scales), all layers.
                let geom = BlockGeometry {
                    block_size: info.block_size.max(1) as usize,
                    num_kv_heads: info.num_kv_heads as usize,
                    head_dim: info.head_dim as usize,
                    dtype: pool_dtype,
                };
                let kv_per_token =
                    (geom.block_bytes() * info.num_layers as usize) as f64 / geom.block_size as f64;
                (weights as f64 + nb * attended * kv_per_token, attended)
            };
            let gbps_of = |r: &Round| step_bytes * r.tps / nb;
            // The middle round by its rate against the median pass around it (the best pass
            // on a device, whose bound is one figure).
            let key =
                |(r, b, _): &(Round, Bound, Option<f64>)| gbps_of(r) / b.median.unwrap_or(b.best);
            let mut order: Vec<usize> = (0..rounds.len()).collect();
            order.sort_by(|&a, &b| key(&rounds[a]).total_cmp(&key(&rounds[b])));
            let (r, around, _) = &rounds[order[order.len() / 2]];
            let (tps, bw, bw_median) = (r.tps, around.best, around.median);
            // Each round's batch rate over the rate of one request just before it; the median.
            let speedups: Vec<f64> = rounds
                .iter()
                .filter_map(|(r, _, alone)| alone.map(|one| r.tps / one))
                .collect();
            let speedup = {
                let mut sorted = speedups.clone();
                sorted.sort_by(f64::total_cmp);
                sorted.get(sorted.len() / 2).copied()
            };
            if mode == "full" {
                full_tps = Some(tps);
            }
            let traffic = (step_bytes / nb, gbps_of(r), bw, attended);
            // The roofline: the slower of streaming the step's bytes and issuing its FMAs
            // (every weight once per row; q·k and p·v per attended token and query head).
            let roofline = fma_peak.map(|peak| {
                let attn_fmas = 2.0
                    * traffic.3
                    * f64::from(info.num_layers)
                    * cfg.num_heads as f64
                    * f64::from(info.head_dim);
                let step_fmas = nb * (params as f64 + attn_fmas);
                let (mem_s, fma_s) = (traffic.0 * nb / bw, step_fmas / peak);
                let bound = if fma_s > mem_s { "FMA" } else { "memory" };
                (nb / mem_s.max(fma_s), bound, step_fmas / nb, peak)
            });
            // Recall's traffic per generated token, and the share of recalled blocks that their
            // layer selected at its next step (what the copies were worth).
            let recall_per_token = r.recalled_bytes as f64 / r.tokens.max(1) as f64;
            let recall_used_share =
                (r.recalled > 0).then(|| r.recalled_used as f64 / r.recalled as f64);
            let (first_token_s, device_wait_share) = (r.first_token_s, r.device_wait_share);
            let (cpu, hit) = (r.cpu_share, r.hit);
            // Every request of the batch counts the same steps' idle time: their mean.
            let device_idle_share = on_device.then_some(r.device_idle_share);
            let round_rows: Vec<serde_json::Value> = rounds
                .iter()
                .map(|(r, b, alone)| {
                    json!({
                        "tokens_per_s": r.tps, "gb_per_s": gbps_of(r) / 1e9,
                        "read_gb_per_s": b.best / 1e9,
                        "read_median_gb_per_s": b.median.map(|m| m / 1e9),
                        "alone_tokens_per_s": alone,
                    })
                })
                .collect();
            let row = json!({
                "context": ctx, "mode": mode, "batch": args.batch, "tokens_per_s": tps,
                "first_token_s": first_token_s, "device": node_device,
                "ratio_to_full": full_tps.map(|f| tps / f),
                "cpu_share": cpu, "prediction_hit_ratio": hit, "device_wait_share": device_wait_share,
                "device_idle_share": device_idle_share,
                "recall_bytes_per_token": recall_per_token, "recall_used_share": recall_used_share,
                "bytes_per_token": traffic.0,
                "gb_per_s": traffic.1 / 1e9,
                "read_gb_per_s": traffic.2 / 1e9, "bound": bound_name,
                "ratio_to_read_bandwidth": traffic.1 / traffic.2,
                "read_median_gb_per_s": bw_median.map(|m| m / 1e9),
                "ratio_to_median_read": bw_median.map(|m| traffic.1 / m),
                "fits_in_cache": !on_device && cache_note(traffic.0 * nb).is_some(),
                "fmas_per_token": roofline.map(|r| r.2),
                "fma_g_per_s": roofline.map(|r| r.3 / 1e9),
                "roofline_tokens_per_s": roofline.map(|r| r.0),
                "roofline_bound": roofline.map(|r| r.1),
                "ratio_to_roofline": roofline.map(|r| tps / r.0),
                "speedup_over_one_request": speedup,
                "graph_pieces": graphs.map(|[r, c, q]| json!({"replayed": r, "captured": c, "queued": q})),
                "rounds": round_rows,
            });
            if !args.common.json {
                if rounds.len() > 1 {
                    let ratios: Vec<String> =
                        rounds.iter().map(|r| format!("{:.2}", key(r))).collect();
                    eprintln!(
                        "decode ctx={ctx} {mode:>6}: {} rounds, each against the {} around it: {}; the middle one below",
                        rounds.len(),
                        if on_device {
                            "device's copy bandwidth"
                        } else {
                            "median read pass"
                        },
                        ratios.join(" ")
                    );
                }
                eprintln!(
                    "decode ctx={ctx} {mode:>6}: {tps:8.1} tok/s, x{} of full, first token {:.3} s, CPU share {:.1}%, hit {:.1}%, device waits {:.1}%",
                    // Without `full` among the modes there is nothing to divide by.
                    full_tps.map_or("-".to_string(), |f| format!("{:.2}", tps / f)),
                    first_token_s,
                    cpu * 100.0,
                    hit * 100.0,
                    device_wait_share * 100.0
                );
                if let Some(idle) = device_idle_share {
                    eprintln!(
                        "decode ctx={ctx} {mode:>6}: device idle {:.1}% of the time (nothing queued while the host worked)",
                        idle * 100.0
                    );
                }
                if let Some([replayed, captured, queued]) = graphs {
                    eprintln!(
                        "decode ctx={ctx} {mode:>6}: step pieces {replayed} replayed from CUDA graphs, {captured} captured, {queued} queued as they are (all rounds)"
                    );
                }
                if r.recalled > 0 {
                    eprintln!(
                        "decode ctx={ctx} {mode:>6}: recall {:.2} MB per token, {:.1}% of recalled blocks used at the next step",
                        recall_per_token / 1e6,
                        recall_used_share.unwrap_or(0.0) * 100.0
                    );
                }
                let (per_token, gbps, bw, _) = traffic;
                eprintln!(
                    "decode ctx={ctx} {mode:>6}: {:.1} MB moved per token, {:.2} GB/s / {:.2} GB/s {bound_name} = {:.2}{}",
                    per_token / 1e6,
                    gbps / 1e9,
                    bw / 1e9,
                    gbps / bw,
                    bw_median.map_or(String::new(), |m| format!(
                        " (median pass {:.2} GB/s: {:.2})",
                        m / 1e9,
                        gbps / m
                    ))
                );
                if let Some((roof, bound, _, peak)) = roofline {
                    eprintln!(
                        "decode ctx={ctx} {mode:>6}: roofline {roof:.1} tok/s ({bound} bound; FMA {:.0} G/s) = {:.2}",
                        peak / 1e9,
                        tps / roof
                    );
                }
                if let Some(x) = speedup {
                    let each: Vec<String> = speedups.iter().map(|v| format!("{v:.2}")).collect();
                    eprintln!(
                        "decode ctx={ctx} {mode:>6}: batch {} = {x:.2}x one request alone on the same node (median; each round: {})",
                        args.batch,
                        each.join(" ")
                    );
                }
                if let Some(note) = cache_note(per_token * nb).filter(|_| !on_device) {
                    eprintln!("decode ctx={ctx} {mode:>6}: {note}");
                }
            }
            rows.push(row);
        }
    }
    Ok(json!({ "bench": "decode", "results": rows }))
}

/// One round of a mode: its decode.
struct Round {
    /// Steady tokens/s of the batch (after every request's first token).
    tps: f64,
    /// When the batch's last first token came, from the start.
    first_token_s: f64,
    /// Tokens generated, all requests.
    tokens: u64,
    /// Per request, means over the batch.
    cpu_share: f64,
    hit: f64,
    /// The step thread's waits on the device, and its idle time, as shares of the round.
    device_wait_share: f64,
    device_idle_share: f64,
    recalled: u64,
    recalled_bytes: u64,
    recalled_used: u64,
}

/// The bound around a round: the best pass (or the device's copy bandwidth) and, on the
/// host, the median pass, each the larger of the probes before and after it.
struct Bound {
    best: f64,
    median: Option<f64>,
}

/// Generates `tokens` for each of the first `batch` pushed requests at once and times it.
async fn run_round(
    ch: &tonic::transport::Channel,
    batch: u32,
    tokens: u32,
) -> anyhow::Result<Round> {
    let batch = batch.max(1);
    let t = Instant::now();
    let gens: Vec<_> = (0..batch)
        .map(|b| spawn_generate(ch.clone(), format!("d{b}"), tokens.max(1)))
        .collect();
    let mut tokens = 0u64;
    let (mut cpu, mut hit, mut wait, mut idle) = (0f64, 0f64, 0f64, 0f64);
    let (mut recalled, mut recalled_bytes, mut recalled_used) = (0u64, 0u64, 0u64);
    let mut last_first = t;
    for g in gens {
        let (out, first, _) = g.await??;
        last_first = last_first.max(first.unwrap_or(t));
        tokens += out.ids.len() as u64;
        let s = out.finish.and_then(|f| f.stats).unwrap_or_default();
        cpu += s.cpu_attention_ratio;
        hit += s.prediction_hit_ratio;
        wait += s.device_wait_seconds;
        idle += s.device_idle_seconds;
        recalled += s.recalled_blocks;
        recalled_bytes += s.recalled_bytes;
        recalled_used += s.recalled_blocks_used;
    }
    let secs = t.elapsed().as_secs_f64();
    // Steady decode: tokens after every request's first, over the time after it. The first
    // token carries the one-off fill of the device (all of it in `full`).
    let first_token_s = last_first.duration_since(t).as_secs_f64();
    let after = (secs - first_token_s).max(1e-9);
    let nb = f64::from(batch);
    Ok(Round {
        tps: tokens.saturating_sub(u64::from(batch)) as f64 / after,
        first_token_s,
        tokens,
        cpu_share: cpu / nb,
        hit: hit / nb,
        // The step thread serves the whole batch: its waits add up against wall time.
        device_wait_share: wait / secs,
        device_idle_share: idle / nb / secs,
        recalled,
        recalled_bytes,
        recalled_used,
    })
}
