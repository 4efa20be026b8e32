//! `bench recall-profile`: each layer's CPU share over a decode, and the recall intervals
//! derived from it for `serve --recall-profile`.

use super::*; // the shared helpers and imports of `bench`

/// Offline recall profile: decodes a real prompt with `scout` and recall off, records each
/// layer's CPU share per step, and derives per-layer recall intervals (the steps a layer stays
/// under `--recall-threshold` after the device is filled). Feed the JSON to
/// `serve --recall-profile FILE`.
pub(super) fn recall_profile(args: &RecallProfileBench) -> anyhow::Result<serde_json::Value> {
    use crate::engine::{Control, Engine, EngineConfig, Event, Job, JobSpec};
    use kv_transfer::{HostPool, Ingest, client::push_messages};
    use pb::push_kv_request::Item;

    let mut margs = args.common.model.clone();
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
    let kv = client::prefill_kv(&node.model, &prompt, "profile", node.wire_dtype())?;
    let geom = node.layout.geom;
    let positions = ctx + args.tokens as usize + 1;
    let nl = node.layout.num_layers;
    // The KV, and the key sketch's pages where the host keeps one.
    let sketch = crate::engine::admission::SketchSlots::of_node(&node.attention, &geom, nl, false)
        .map_or(0, |s| s.pool_pages(positions, geom.num_kv_heads));
    let blocks = (geom.blocks_for(positions) + 1) * nl + sketch;
    let pool = HostPool::new(geom, (blocks * geom.block_bytes()) as u64)?;
    let mut ingest = None;
    for m in push_messages(&kv, 256) {
        match m.item {
            Some(Item::Header(h)) => ingest = Some(Ingest::begin(&node.layout, &pool, &h)?),
            Some(Item::Chunk(c)) => ingest.as_mut().context("header first")?.chunk(&c.into())?,
            _ => {}
        }
    }
    let committed = ingest.context("no header")?.commit(None)?;
    let (engine, thread) = Engine::start(
        node.model.clone(),
        pool,
        EngineConfig {
            attention: node.attention.clone(),
            max_batch: 1,
            device_kv_bytes: u64::MAX / 4,
            queue_timeout: Duration::from_secs(60),
            cpu_threads: 1,
            prefix_cache: None,
            // The profile is of recall under the configured share.
            lend_spare_device: false,
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
        output: Default::default(),
        arrived: Instant::now(),
        events: tx,
        span: tracing::Span::none(),
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
    let threshold = args.common.model.recall_threshold;
    let intervals = attention::recall_intervals(&history, threshold);
    let means: Vec<f32> = history
        .iter()
        .map(|h| h.iter().sum::<f32>() / h.len().max(1) as f32)
        .collect();
    if !args.common.json {
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
