//! `bench kernels`: CPU sparse attention, KV bytes scanned per second ÷ the read bandwidth
//! of the same threads, measured in the same run.

use super::*; // the shared helpers and imports of `bench`

/// CPU sparse attention: KV bytes scanned per second ÷ read bandwidth, per configuration.
pub(super) fn kernels(args: &KernelsBench) -> anyhow::Result<serde_json::Value> {
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
                    if !args.common.json {
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
