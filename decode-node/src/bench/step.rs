//! `bench step`: one decode step's dense work against the weights' bandwidth bound.

use super::*; // the shared helpers and imports of `bench`

/// One decode step of the model: tokens/s and weight bytes streamed per second ÷ read
/// bandwidth measured in the same run (all cores).
pub(super) fn step(args: &StepBench) -> anyhow::Result<serde_json::Value> {
    let node = crate::node::Node::build(&args.common.model)?;
    let m = &node.model.model;
    let cfg = &m.cfg;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The bound: the device's own memory where weights live there, else host read bandwidth.
    let bw = match m.backend().memory_bandwidth() {
        Some(bw) => bw,
        None => host_read_bandwidth(threads)?,
    };
    let cached = cache_note(m.weight_bytes() as f64);
    if let Some(note) = cached.as_ref().filter(|_| !args.common.json) {
        eprintln!("{note}");
    }
    // As the engine runs a CPU model: inside a pool of its own with every core (the engine's
    // CPU-attention pool), not rayon's global one.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    let mut rows = Vec::new();
    for batch in [1usize, args.batch.max(1) as usize] {
        // Attention over the token itself only: the step's cost is then the weights it streams.
        let mut attn = crate::model::SelfAttention::of(cfg);
        let tokens = vec![1u32; batch];
        let positions = vec![8usize; batch];
        // Warm-up step maps the weights in.
        m.decode_step(&tokens, &positions, &mut attn)?;
        let mut steps = 0u32;
        let t = Instant::now();
        let mut run = || -> anyhow::Result<()> {
            while steps == 0 || t.elapsed().as_secs_f64() < args.seconds {
                m.decode_step(&tokens, &positions, &mut attn)?;
                steps += 1;
            }
            Ok(())
        };
        if m.backend().parallel_on_rayon() {
            pool.install(run)?;
        } else {
            run()?;
        }
        let per_step = t.elapsed().as_secs_f64() / steps as f64;
        let gbps = m.weight_bytes() as f64 / per_step;
        if !args.common.json {
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
            "ratio": gbps / bw, "threads": threads, "weights_fit_in_cache": cached.is_some(),
        }));
        if args.batch <= 1 {
            break;
        }
    }
    Ok(
        json!({ "bench": "step", "model_id": m.model_id, "device": m.backend().name(), "results": rows }),
    )
}
