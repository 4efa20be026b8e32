//! The store path of an ingest, without transport: `Ingest::chunk` writing bf16 KV into a
//! prefaulted pool (CRC check, K transposed with the digest folded in, V rows copied).
//! `cargo bench -p kv-transfer --bench store`

use attention::{BlockGeometry, KvDType};
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
    let (layers, tokens) = (4usize, 2048usize);
    let layout = KvLayout {
        model_id: "bench".into(),
        num_layers: layers,
        geom,
        vocab_size: 1000,
        max_context: 1 << 20,
    };
    let row = geom.num_kv_heads * geom.head_dim * 2;
    // Small bf16 values with varied bits (finite, no NaN).
    let data = |seed: usize| {
        Bytes::from(
            (0..tokens * row)
                .map(|i| {
                    if i % 2 == 1 {
                        0x3f
                    } else {
                        ((i * 31 + seed) % 251) as u8
                    }
                })
                .collect::<Vec<u8>>(),
        )
    };
    let kv = PromptKv {
        header: KvHeader {
            request_id: "b".into(),
            model_id: "bench".into(),
            num_layers: layers as u32,
            num_kv_heads: geom.num_kv_heads as u32,
            head_dim: geom.head_dim as u32,
            dtype: DType::DtypeBf16 as i32,
            num_tokens: tokens as u32,
            prompt_token_ids: vec![1; tokens],
            next_token_id: 1,
        },
        layers: (0..layers)
            .map(|l| (data(2 * l), data(2 * l + 1)))
            .collect(),
    };
    let bytes = (2 * layers * tokens * row) as u64;
    let pool = HostPool::with_prefault(geom, 2 * bytes, true).expect("pool");
    let mut g = c.benchmark_group("store");
    g.throughput(Throughput::Bytes(bytes));
    for chunk_tokens in [256, 2048] {
        let msgs = push_messages(&kv, chunk_tokens);
        let chunks: Vec<_> = msgs[1..msgs.len() - 1]
            .iter()
            .filter_map(|m| match &m.item {
                Some(decode_node_proto::v1::push_kv_request::Item::Chunk(c)) => {
                    Some(c.clone().into())
                }
                _ => None,
            })
            .collect();
        g.bench_function(format!("bf16 8x128 chunks of {chunk_tokens} tokens"), |b| {
            b.iter(|| {
                let mut ing = Ingest::begin(&layout, &pool, &kv.header).expect("begin");
                for c in &chunks {
                    ing.chunk(c).expect("chunk");
                }
                ing.commit().expect("commit")
            })
        });
    }
    g.finish();
}

criterion_group!(benches, store);
criterion_main!(benches);
