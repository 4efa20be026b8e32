//! `bench capacity`: how many requests of one context length each attention mode serves at
//! once on this node's memory, and their aggregate tokens/s. `full` keeps every request's
//! whole KV on the device, so device memory bounds it; the sparse modes keep only their
//! resident blocks there and the rest in host DRAM, so they are bounded by the host pool.

use super::*; // the shared helpers and imports of `bench`

use crate::cli::CapacityBench;
use crate::engine::admission::{Need, Request};

/// What bounded a mode's concurrency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bound {
    Device,
    Host,
    Requests,
}

impl Bound {
    fn name(self) -> &'static str {
        match self {
            Bound::Device => "device KV",
            Bound::Host => "host KV",
            Bound::Requests => "--max-requests",
        }
    }
}

/// Requests that fit `capacity` at once when each takes `need` of it (the device: its
/// [`Need`] for its whole life, as admission counts it; the host pool: its prompt's blocks
/// and its decode growth, in whole blocks).
fn fit(need: u64, capacity: u64) -> u64 {
    capacity.checked_div(need).unwrap_or(u64::MAX)
}

/// Concurrency and aggregate tok/s per attention mode at one context length.
pub(super) async fn capacity(args: &CapacityBench) -> anyhow::Result<serde_json::Value> {
    let ctx = parse_tokens(&args.context)?;
    let modes: Vec<String> = args
        .modes
        .split(',')
        .map(|m| m.trim().to_string())
        .collect();
    anyhow::ensure!(args.max_requests > 0, "--max-requests must be at least 1");
    anyhow::ensure!(args.tokens > 0, "--tokens must be at least 1");
    let cfg = model_config(&args.common.model)?;
    let dtype = crate::node::kv_dtype(&args.common.model.kv_dtype, &cfg.torch_dtype)?;
    let geom = BlockGeometry {
        block_size: args.common.model.block_size as usize,
        num_kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        dtype,
    };
    anyhow::ensure!(
        ctx + 1 < cfg.max_context(),
        "context {ctx} leaves no room to generate within the model's {} positions",
        cfg.max_context()
    );
    let mut rows = Vec::new();
    let mut full_tps = None;
    let mut prompt: Option<PromptKv> = None;
    for mode in &modes {
        let mut m = args.common.model.clone();
        m.attention = mode.clone();
        let group = cfg.num_heads / cfg.num_kv_heads.max(1);
        let attention = crate::node::attention_config(&m, geom, cfg.num_layers, group)?;
        let need = Need::of(
            &Request {
                geom,
                num_layers: cfg.num_layers,
                num_tokens: ctx,
                prompt_bytes: 0,
                max_new_tokens: args.tokens,
            },
            cfg.max_context(),
            attention.resident_blocks_per_head(),
            crate::engine::admission::SketchSlots::of_node(
                &attention,
                &geom,
                cfg.num_layers,
                m.device != "cpu",
            ),
        );
        let by_device = fit(need.device, args.device_kv_bytes);
        let pool_blocks = args.host_kv_bytes / geom.block_bytes() as u64;
        let blocks_each =
            (geom.blocks_for(ctx) * cfg.num_layers + need.grow_blocks + need.sketch_pages) as u64;
        let by_host = fit(blocks_each, pool_blocks);
        let most = by_device.min(by_host).min(u64::from(args.max_requests));
        let node = start_node(
            m,
            args.host_kv_bytes,
            args.device_kv_bytes,
            args.max_requests,
            600.0,
            false,
            args.cpu_attention_threads,
        )
        .await?;
        let target = node.target();
        let info = model_info(&target).await?;
        let ch = client::connect(&target).await?;
        // One prompt's KV, pushed under a new id for each request (the node does not share
        // blocks between requests, so each holds its own copy).
        let base = prompt.get_or_insert_with(|| synthetic_kv(&info, "c", ctx, 7));
        let mut admitted = 0u64;
        let mut bound = if most == by_device {
            Bound::Device
        } else if most == by_host {
            Bound::Host
        } else {
            Bound::Requests
        };
        while admitted < most {
            let mut kv = base.clone();
            kv.header.request_id = format!("c{admitted}");
            match push_kv(ch.clone(), &kv, &PushOptions::default(), |_| {}).await {
                Ok(_) => admitted += 1,
                Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                    bound = Bound::Host;
                    break;
                }
                Err(s) => anyhow::bail!("push {admitted}: {:?}: {}", s.code(), s.message()),
            }
        }
        anyhow::ensure!(
            admitted > 0,
            "{mode}: not one request of {ctx} tokens fits (device KV {} bytes, one needs {}; host KV {} bytes)",
            args.device_kv_bytes,
            need.device,
            args.host_kv_bytes
        );
        // Device KV in use as GetLoad reports it (in the sparse modes, the blocks resident),
        // and of it what loans of spare device KV hold (scout, recall), each at its most.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let poll = tokio::spawn({
            let (ch, stop) = (ch.clone(), std::sync::Arc::clone(&stop));
            async move {
                let mut dc = client::decode_client(ch, None);
                let mut most = (0u64, 0u64);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(r) = dc.get_load(pb::GetLoadRequest {}).await {
                        let r = r.into_inner();
                        most.0 = most.0.max(r.device_kv_bytes_used);
                        most.1 = most.1.max(r.device_kv_bytes_lent);
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                most
            }
        });
        // A request that finds no room waits for one to finish: counted as queued below.
        let t = Instant::now();
        let mut gens = Vec::new();
        for i in 0..admitted {
            gens.push(spawn_generate(ch.clone(), format!("c{i}"), args.tokens));
        }
        let (mut tokens, mut cpu, mut queued, mut refused) = (0u64, 0f64, 0u64, 0u64);
        let mut last_first = t;
        let mut firsts = Vec::new();
        let mut earliest_end: Option<Instant> = None;
        for g in gens {
            match g.await? {
                Ok((out, first, end)) => {
                    let first = first.unwrap_or(t);
                    last_first = last_first.max(first);
                    tokens += out.ids.len() as u64;
                    let s = out.finish.and_then(|f| f.stats).unwrap_or_default();
                    cpu += s.cpu_attention_ratio;
                    firsts.push(first);
                    earliest_end = Some(earliest_end.map_or(end, |e| e.min(end)));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "a capacity request failed");
                    refused += 1;
                }
            }
        }
        let secs = t.elapsed().as_secs_f64();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (device_used, device_lent) = poll.await.unwrap_or_default();
        // A request whose first token came after another had finished did not run alongside
        // the rest: it waited for room.
        if let Some(end) = earliest_end {
            queued = firsts.iter().filter(|f| **f > end).count() as u64;
        }
        let concurrent = admitted - queued - refused;
        let first_token_s = last_first.duration_since(t).as_secs_f64();
        // Steady decode: tokens after each request's first, over the time after the last first.
        let after = (secs - first_token_s).max(1e-9);
        let tps = tokens.saturating_sub(admitted - refused) as f64 / after;
        node.stop().await?;
        if mode == "full" {
            full_tps = Some(tps);
        }
        let n = (admitted - refused).max(1) as f64;
        let row = json!({
            "context": ctx, "mode": mode, "concurrent": concurrent, "pushed": admitted,
            "bound": bound.name(), "queued": queued, "failed": refused,
            "device_bytes_per_request": need.device, "device_kv_bytes": args.device_kv_bytes,
            "host_kv_bytes": args.host_kv_bytes,
            "aggregate_tokens_per_s": tps, "tokens_per_s_per_request": tps / n,
            "ratio_to_full": full_tps.map(|f| tps / f),
            "first_token_s": first_token_s, "cpu_share": cpu / n,
            "device_kv_bytes_used_max": device_used,
            "device_kv_bytes_lent_max": device_lent,
        });
        if !args.common.json {
            eprintln!(
                "capacity ctx={ctx} {mode:>6}: {concurrent} concurrent (bound: {}; {queued} queued, {refused} failed), {tps:8.1} tok/s aggregate, {:.1} per request, x{} of full, CPU share {:.1}%, device KV up to {:.2} GB ({:.2} GB lent)",
                bound.name(),
                tps / n,
                full_tps.map_or("-".to_string(), |f| format!("{:.2}", tps / f)),
                cpu / n * 100.0,
                device_used as f64 / 1e9,
                device_lent as f64 / 1e9,
            );
        }
        rows.push(row);
    }
    Ok(json!({ "bench": "capacity", "results": rows }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_divides_and_survives_a_zero_need() {
        assert_eq!(fit(100, 1000), 10);
        assert_eq!(fit(300, 1000), 3);
        assert_eq!(fit(2000, 1000), 0);
        assert_eq!(fit(0, 1000), u64::MAX);
    }
}
