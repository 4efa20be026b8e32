//! `bench ingest`: loopback PushKv bytes/s ÷ single-thread memcpy, and the store path alone.

use super::*; // the shared helpers and imports of `bench`

/// The same pushes written into a pool of `layout` in-process (no transport): the store
/// path's own rate. The messages (the client's CRCs and slicing) are built once, outside the
/// clock.
fn store_rate(layout: &kv_transfer::KvLayout, kv: &PromptKv, rounds: u64) -> anyhow::Result<f64> {
    use kv_transfer::Ingest;
    use pb::push_kv_request::Item;
    let bytes: u64 = kv
        .layers
        .iter()
        .map(|(k, v)| (k.len() + v.len()) as u64)
        .sum();
    let pool = kv_transfer::HostPool::with_prefault(layout.geom, 2 * bytes + (64 << 20), true)?;
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
        let mut ingest = Ingest::begin(layout, &pool, &kv.header)?;
        for c in &chunks {
            ingest.chunk(c)?;
        }
        drop(ingest.commit(None)?);
    }
    Ok((rounds * bytes) as f64 / t.elapsed().as_secs_f64())
}

/// Each stage of the store path alone, in bytes/s of the wire bytes it handles, over the
/// same push written `rounds` times into blocks of the pool's layout (fresh memory, as a
/// pool's): the CRC-32C of K and V; the V rows' copy, or where the pool stores another dtype
/// their conversion (each head's run decoded to f32, then `BlockGeometry::write_values`);
/// and the K transpose with the digests folded in, or likewise its conversion
/// (`write_keys`).
struct StageRates {
    crc: f64,
    values: f64,
    keys_digests: f64,
}

/// One head's tokens of one block: `n` tokens of head `h` in block `bi`, K and V from the
/// first one's vector onward (wire layout).
#[derive(Clone, Copy)]
struct HeadRun<'a> {
    h: usize,
    n: usize,
    bi: usize,
    k: &'a [u8],
    v: &'a [u8],
}

fn stage_rates(geom: BlockGeometry, kv: &PromptKv, rounds: u64) -> anyhow::Result<StageRates> {
    use attention::{Rows, decode_rows};
    let wire = match pb::DType::try_from(kv.header.dtype) {
        Ok(pb::DType::DtypeF16) => KvDType::F16,
        Ok(pb::DType::DtypeBf16) => KvDType::Bf16,
        _ => KvDType::F32,
    };
    // A pool of the wire's dtype copies; any other converts every token.
    let copies = geom.dtype == wire && geom.folds_digest_in_copy();
    let (hk, d, ws, bs) = (
        geom.num_kv_heads,
        geom.head_dim,
        wire.size(),
        geom.block_size,
    );
    let row = hk * d * ws; // wire bytes of a token
    let half: u64 = kv.layers.iter().map(|(k, _)| k.len() as u64).sum();
    let timed = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        for _ in 0..rounds {
            f();
        }
        t.elapsed().as_secs_f64()
    };
    let crc = timed(&mut || {
        for (k, v) in &kv.layers {
            std::hint::black_box(kv_transfer::crc32c([&k[..], &v[..]]));
        }
    });
    // Every layer's blocks, as the pool lays them out.
    let tokens = kv.layers.first().map_or(0, |(k, _)| k.len() / row.max(1));
    let nb = tokens.div_ceil(bs);
    // Written (not zeroed, which the allocator may leave unmapped) so no page fault is timed.
    let mut blocks = vec![vec![1u8; nb * geom.block_bytes()]; kv.layers.len()];
    let mut scratch = vec![0f32; bs * d];
    // Calls `f` for every (layer, block, head) with the block's bytes.
    let mut each = |f: &mut dyn FnMut(&mut [u8], HeadRun<'_>)| {
        for ((k, v), layer) in kv.layers.iter().zip(blocks.iter_mut()) {
            for (bi, block) in layer.chunks_exact_mut(geom.block_bytes()).enumerate() {
                let n = (tokens - bi * bs).min(bs);
                for h in 0..hk {
                    let at = bi * bs * row + h * d * ws;
                    let (k, v) = (&k[at..], &v[at..]);
                    f(block, HeadRun { h, n, bi, k, v });
                }
            }
        }
    };
    let values = timed(&mut || {
        each(&mut |block, r| {
            let x = &mut scratch[..r.n * d];
            if copies {
                let rows = Rows {
                    bytes: r.v,
                    stride: row,
                    n: r.n,
                };
                geom.copy_value_rows(block, r.h, 0, rows);
            } else {
                decode_rows(wire, r.v, row, x, d);
                geom.write_values(block, (r.h, 0), x, (d, r.n));
            }
        })
    });
    let mut digests = vec![attention::HeadDigests::new(nb, d); hk];
    let keys_digests = timed(&mut || {
        each(&mut |block, r| {
            let (x, digest) = (&mut scratch[..r.n * d], digests[r.h].block_mut(r.bi));
            if copies {
                let rows = Rows {
                    bytes: r.k,
                    stride: row,
                    n: r.n,
                };
                geom.copy_keys_digest(block, r.h, 0, rows, digest);
            } else {
                decode_rows(wire, r.k, row, x, d);
                geom.write_keys(block, (r.h, 0), x, (d, r.n), digest);
            }
        })
    });
    let bytes = (rounds * half) as f64;
    Ok(StageRates {
        crc: 2.0 * bytes / crc,
        values: bytes / values,
        keys_digests: bytes / keys_digests,
    })
}

/// Loopback ingest: bytes/s ÷ single-thread memcpy bytes/s in the same run.
pub(super) async fn ingest(args: &IngestBench) -> anyhow::Result<serde_json::Value> {
    let memcpy = memcpy_bandwidth(256 << 20, 1.0)?;
    let node = start_node(
        args.common.model.clone(),
        2 << 30,
        1 << 30,
        8,
        600.0,
        true,
        0,
    )
    .await?;
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
    let cpu = CpuTimes::now();
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
    let cpu = CpuTimes::now().since(cpu);
    let rate = (rounds * push_bytes) as f64 / secs;
    // The served node's layout, from the model it loaded (not loaded again: a 16 GB model
    // took longer to load than the whole push).
    let layout =
        crate::node::Node::of(&args.common.model, std::sync::Arc::clone(&node.model))?.layout;
    node.stop().await?;
    let store = {
        let (layout, kv) = (layout.clone(), kv.clone());
        tokio::task::spawn_blocking(move || store_rate(&layout, &kv, rounds)).await??
    };
    let stages = {
        let (geom, kv) = (layout.geom, kv.clone());
        tokio::task::spawn_blocking(move || stage_rates(geom, &kv, rounds)).await??
    };
    let gb = |r: f64| r / 1e9;
    if !args.common.json {
        eprintln!(
            "ingest: {:.2} GB in {secs:.2}s over {streams} stream(s) = {:.2} GB/s (store alone {:.2} GB/s); memcpy {:.2} GB/s; ratio {:.3} (goal 0.25)",
            (rounds * push_bytes) as f64 / 1e9,
            rate / 1e9,
            store / 1e9,
            memcpy / 1e9,
            rate / memcpy
        );
        eprintln!(
            "ingest stages alone: crc32c {:.2} GB/s, V rows {:.2} GB/s, K transpose + digests {:.2} GB/s{}; store {:.2} GB/s = {:.3} of memcpy",
            gb(stages.crc),
            gb(stages.values),
            gb(stages.keys_digests),
            if layout.geom.folds_digest_in_copy() {
                ""
            } else {
                " (each converted)"
            },
            gb(store),
            store / memcpy
        );
        eprintln!(
            "ingest push CPU (the client and the node, both in this process): {:.2}s user + {:.2}s system over {secs:.2}s = {:.2} of {} CPUs busy",
            cpu.user,
            cpu.system,
            (cpu.user + cpu.system) / secs,
            std::thread::available_parallelism().map_or(1, |n| n.get()),
        );
    }
    Ok(json!({
        "bench": "ingest", "bytes": rounds * push_bytes, "seconds": secs, "gb_per_s": rate / 1e9,
        "memcpy_gb_per_s": memcpy / 1e9, "ratio": rate / memcpy, "goal_ratio": 0.25,
        "store_gb_per_s": store / 1e9, "store_ratio": store / memcpy, "streams": streams,
        "stages_gb_per_s": {
            "crc32c": gb(stages.crc), "value_rows": gb(stages.values),
            "key_transpose_digests": gb(stages.keys_digests),
        },
        "push_bytes": push_bytes, "tokens_per_push": tokens,
        "push_cpu_seconds": { "user": cpu.user, "system": cpu.system },
    }))
}
