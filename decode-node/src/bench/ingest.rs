//! `bench ingest`: loopback PushKv bytes/s ÷ single-thread memcpy, and the store path alone.

use super::*; // the shared helpers and imports of `bench`

/// The same pushes written into a pool in-process (no transport): the store path's own rate.
/// The messages (the client's CRCs and slicing) are built once, outside the clock.
fn store_rate(model: &crate::cli::ModelArgs, kv: &PromptKv, rounds: u64) -> anyhow::Result<f64> {
    use kv_transfer::Ingest;
    use pb::push_kv_request::Item;
    let node = crate::node::Node::build(model)?;
    let bytes: u64 = kv
        .layers
        .iter()
        .map(|(k, v)| (k.len() + v.len()) as u64)
        .sum();
    let pool =
        kv_transfer::HostPool::with_prefault(node.layout.geom, 2 * bytes + (64 << 20), true)?;
    let msgs = kv_transfer::client::push_messages(kv, 256);
    let chunks: Vec<kv_transfer::wire::Chunk> = msgs
        .iter()
        .filter_map(|m| match &m.item {
            Some(Item::Chunk(c)) => Some(c.clone().into()),
            _ => None,
        })
        .collect();
    let t = Instant::now();
    for _ in 0..rounds {
        let mut ingest = Ingest::begin(&node.layout, &pool, &kv.header)?;
        for c in &chunks {
            ingest.chunk(c)?;
        }
        drop(ingest.commit()?);
    }
    Ok((rounds * bytes) as f64 / t.elapsed().as_secs_f64())
}

/// Loopback ingest: bytes/s ÷ single-thread memcpy bytes/s in the same run.
pub(super) async fn ingest(args: &IngestBench) -> anyhow::Result<serde_json::Value> {
    let memcpy = memcpy_bandwidth(256 << 20, 1.0);
    let node = start_node(args.common.model.clone(), 2 << 30, 1 << 30, 8, 600.0, true).await?;
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
        let (model, kv) = (args.common.model.clone(), kv.clone());
        tokio::task::spawn_blocking(move || store_rate(&model, &kv, rounds)).await??
    };
    if !args.common.json {
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
