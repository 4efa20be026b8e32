//! The store path of an ingest, without transport: `Ingest::chunk` writing bf16 KV into a
//! prefaulted pool (CRC check, K transposed with the digest folded in, V rows copied), and into
//! int8 and fp8 pools (each token converted), then each stage alone over the same bytes, and
//! memcpy of them as the bound.
//! `cargo bench -p kv-transfer --bench store`

use attention::{BlockGeometry, KvDType, Rows};
use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use decode_node_proto::v1::{DType, KvHeader};
use kv_transfer::client::{PromptKv, push_messages};
use kv_transfer::{HostPool, Ingest, KvLayout};

fn store(c: &mut Criterion) {
    let geom = BlockGeometry {
        block_size: 32,
        num_kv_heads: 8,
        head_dim: 128,
        dtype: KvDType::Bf16,
    };
    let kv = prompt(&geom, DType::DtypeBf16, 4, 2048);
    let mut g = c.benchmark_group("store");
    for chunk_tokens in [256, 2048] {
        bench_push(&mut g, &geom, &kv, chunk_tokens, "bf16 8x128");
    }
    // Pools of a scaled 8-bit dtype convert every token (`BlockGeometry::write_keys`, `write_values`): a
    // Qwen3-8B-shaped head and SmolLM2-135M's (3 KV heads of 64, f16 on the wire).
    for dtype in [KvDType::I8, KvDType::F8E4M3] {
        let g8 = BlockGeometry { dtype, ..geom };
        bench_push(&mut g, &g8, &kv, 256, "bf16 8x128");
        let small = BlockGeometry {
            num_kv_heads: 3,
            head_dim: 64,
            ..g8
        };
        let kv = prompt(&small, DType::DtypeF16, 4, 4096);
        bench_push(&mut g, &small, &kv, 256, "f16 3x64");
        // The embedded `tiny` model's (`bench ingest`'s default): 2 KV heads of 16, f32.
        let tiny = BlockGeometry {
            num_kv_heads: 2,
            head_dim: 16,
            ..g8
        };
        let kv = prompt(&tiny, DType::DtypeF32, 4, 8192);
        bench_push(&mut g, &tiny, &kv, 256, "f32 2x16");
    }
    g.finish();
    stages(c, &geom, &kv);
}

/// `tokens` tokens of `layers` layers of the shape of `geom` in `wire` (f32, or 2 bytes an
/// element): small values with varied bits, finite.
fn prompt(geom: &BlockGeometry, wire: DType, layers: usize, tokens: usize) -> PromptKv {
    let es = if wire == DType::DtypeF32 { 4 } else { 2 };
    let row = geom.num_kv_heads * geom.head_dim * es;
    let data = |seed: usize| {
        Bytes::from(
            (0..tokens * row)
                .map(|i| {
                    if i % es == es - 1 {
                        0x3f
                    } else {
                        ((i * 31 + seed) % 251) as u8
                    }
                })
                .collect::<Vec<u8>>(),
        )
    };
    PromptKv {
        header: KvHeader {
            request_id: "b".into(),
            model_id: "bench".into(),
            num_layers: layers as u32,
            num_kv_heads: geom.num_kv_heads as u32,
            head_dim: geom.head_dim as u32,
            dtype: wire as i32,
            num_tokens: tokens as u32,
            prompt_token_ids: vec![1; tokens],
            next_token_id: 1,
            num_streams: 0,
            reuse_prefix: false,
        },
        layers: (0..layers)
            .map(|l| (data(2 * l), data(2 * l + 1)))
            .collect(),
    }
}

/// `Ingest::chunk` of every chunk of `kv` (cut `chunk_tokens` tokens at a time) into a
/// prefaulted pool of `geom`, in wire bytes/s.
fn bench_push(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    geom: &BlockGeometry,
    kv: &PromptKv,
    chunk_tokens: usize,
    wire: &str,
) {
    let layout = KvLayout {
        model_id: "bench".into(),
        num_layers: kv.layers.len(),
        geom: *geom,
        vocab_size: 1000,
        max_context: 1 << 20,
    };
    let bytes: u64 = kv
        .layers
        .iter()
        .map(|(k, v)| (k.len() + v.len()) as u64)
        .sum();
    let pool = HostPool::with_prefault(*geom, 2 * bytes, true).expect("pool");
    g.throughput(Throughput::Bytes(bytes));
    let msgs = push_messages(kv, chunk_tokens);
    let chunks: Vec<_> = msgs[1..msgs.len() - 1]
        .iter()
        .filter_map(|m| match &m.item {
            Some(decode_node_proto::v1::push_kv_request::Item::Chunk(c)) => Some(c.clone().into()),
            _ => None,
        })
        .collect();
    let name = format!(
        "{wire} into {:?}, chunks of {chunk_tokens} tokens",
        geom.dtype
    );
    g.bench_function(name, |b| {
        b.iter(|| {
            let mut ing = Ingest::begin(&layout, &pool, &kv.header).expect("begin");
            for c in &chunks {
                ing.chunk(c).expect("chunk");
            }
            ing.commit(None).expect("commit")
        })
    });
}

/// Each stage of the store path alone over one layer's K and V: memcpy of the same bytes
/// (the bound), CRC-32C, K transposed into blocks with the digest folded in, V rows copied.
fn stages(c: &mut Criterion, geom: &BlockGeometry, kv: &PromptKv) {
    let (k, v) = &kv.layers[0];
    let (hk, d, es, bs) = (
        geom.num_kv_heads,
        geom.head_dim,
        geom.dtype.size(),
        geom.block_size,
    );
    let row = hk * d * es;
    let tokens = k.len() / row;
    let nblocks = tokens.div_ceil(bs);
    let mut blocks = vec![0u8; nblocks * geom.block_bytes()];
    let (mut min, mut max) = (vec![0f32; d], vec![0f32; d]);
    let mut g = c.benchmark_group("store stages");
    g.throughput(Throughput::Bytes((k.len() + v.len()) as u64));
    let mut dst = vec![0u8; k.len() + v.len()];
    g.bench_function("memcpy K+V", |b| {
        b.iter(|| {
            dst[..k.len()].copy_from_slice(k);
            dst[k.len()..].copy_from_slice(v);
        })
    });
    g.bench_function("crc32c K+V", |b| {
        b.iter(|| {
            let mut d = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
            d.update(k);
            d.update(v);
            d.finalize()
        })
    });
    g.throughput(Throughput::Bytes(k.len() as u64));
    g.bench_function("K transpose + digest", |b| {
        b.iter(|| {
            for (bi, blk) in blocks.chunks_exact_mut(geom.block_bytes()).enumerate() {
                let n = bs.min(tokens - bi * bs);
                for h in 0..hk {
                    let rows = Rows {
                        bytes: &k[bi * bs * row + h * d * es..],
                        stride: row,
                        n,
                    };
                    geom.copy_keys_digest(blk, h, 0, rows, (&mut min, &mut max));
                }
            }
        })
    });
    g.throughput(Throughput::Bytes(v.len() as u64));
    g.bench_function("V rows copy", |b| {
        b.iter(|| {
            for (bi, blk) in blocks.chunks_exact_mut(geom.block_bytes()).enumerate() {
                let n = bs.min(tokens - bi * bs);
                for h in 0..hk {
                    let rows = Rows {
                        bytes: &v[bi * bs * row + h * d * es..],
                        stride: row,
                        n,
                    };
                    geom.copy_value_rows(blk, h, 0, rows);
                }
            }
        })
    });
    g.finish();
}

criterion_group!(benches, store);
criterion_main!(benches);
