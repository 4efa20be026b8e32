//! The second turn of a conversation pushes only what the node does not hold: the first
//! turn's whole blocks (prompt and generated tokens) stay in the prefix cache, the header ack
//! says how many tokens were reused, and the continuation is still the exact greedy one.

mod common;
use common::*;

use decode_node_proto::v1 as pb;
use kv_transfer::client::{PromptKv, PushOptions, push_kv};

/// Pushes with `reuse_prefix` set, returning the final ack and the payload bytes acked.
async fn push_reusing(s: &Served, kv: &PromptKv) -> (pb::PushKvResponse, u64) {
    let mut kv = kv.clone();
    kv.header.reuse_prefix = true;
    let opts = PushOptions {
        chunk_tokens: 16,
        retries: 0,
        auth_token: None,
    };
    let mut last = 0;
    let ack = push_kv(s.channel().await, &kv, &opts, |b| last = b)
        .await
        .unwrap();
    (ack, last)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_second_turn_reuses_the_first_turns_blocks_and_decodes_the_same() {
    // Blocks of 32: turn one holds 100 prompt + 12 fed tokens, so three whole blocks.
    let s = Served::start(&["--attention", "full", "--prefix-cache-bytes", "64Mi"]);
    let p1 = prompt(100, 7);
    let kv1 = prompt_kv("t1", &p1);
    let (ack1, bytes1) = push_reusing(&s, &kv1).await;
    assert_eq!(ack1.reused_tokens, 0, "nothing cached yet");
    let (out1, _) = generate(&s, gen_req("t1", 12)).await.unwrap();

    // Turn two: the whole history, the first turn's reply and a new user message.
    let mut p2 = p1.clone();
    p2.push(kv1.header.next_token_id);
    p2.extend_from_slice(&out1);
    p2.extend(prompt(20, 8).into_iter().skip(1));
    let want = reference_greedy(&p2, 8);
    let kv2 = prompt_kv("t2", &p2);
    let (ack2, bytes2) = push_reusing(&s, &kv2).await;
    assert_eq!(ack2.reused_tokens, 96);
    assert!(ack2.committed);
    let per_token = bytes1 / p1.len() as u64;
    assert_eq!(
        bytes2,
        per_token * (p2.len() as u64 - 96),
        "only the rest was sent"
    );
    let (out2, _) = generate(&s, gen_req("t2", 8)).await.unwrap();
    assert_eq!(out2, want, "the reused KV decodes as a full push does");

    // Without asking, nothing is reused (and the same tokens decode the same).
    let ack3 = push(&s, &prompt_kv("t3", &p2)).await.unwrap();
    assert_eq!(ack3.reused_tokens, 0, "not asked");
    let (out3, _) = generate(&s, gen_req("t3", 8)).await.unwrap();
    assert_eq!(out3, want);

    // Cached blocks count as free in the load report, and have their own metric state.
    let l = wait_load(&s, |l| l.running == 0 && l.host_kv_bytes_used == 0).await;
    assert_eq!(
        l.host_kv_bytes_used, 0,
        "idle cached blocks are free to admission"
    );
    let text = s.metrics_text();
    assert!(
        text.contains("decode_node_kv_prefix_reused_tokens_total 96"),
        "{text}"
    );
    let cached = text
        .lines()
        .find(|l| l.starts_with("decode_node_host_kv_bytes{state=\"cached\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(cached > 0.0, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_evicts_cached_blocks_rather_than_refuse() {
    let s = Served::start(&[
        "--attention",
        "full",
        "--host-kv-bytes",
        "2Mi",
        "--prefix-cache-bytes",
        "1Gi",
    ]);
    let cap = load(&s).await.host_kv_bytes_capacity;
    // KV bytes per token, from a probe (the wire dtype is the pool's, f32).
    let (probe, bytes) = push_reusing(&s, &prompt_kv("probe", &prompt(32, 99))).await;
    assert!(probe.committed);
    generate(&s, gen_req("probe", 1)).await.unwrap();
    let per_token = bytes / 32;
    // Requests of about 40% of the pool each: without eviction the third would be refused.
    let n = (cap * 2 / 5 / per_token) as usize;
    for i in 0..6u64 {
        let id = format!("r{i}");
        let (ack, _) = push_reusing(&s, &prompt_kv(&id, &prompt(n, 100 + i))).await;
        assert_eq!(ack.reused_tokens, 0);
        let (out, _) = generate(&s, gen_req(&id, 4)).await.unwrap();
        assert_eq!(out.len(), 4);
    }
    let text = s.metrics_text();
    assert!(
        text.contains("decode_node_host_kv_bytes{state=\"cached\"}"),
        "{text}"
    );
}

#[test]
fn the_prefill_cli_reuses_with_its_flag() {
    let s = Served::start(&["--prefix-cache-bytes", "16Mi", "--block-size", "4"]);
    // The same synthetic prompt twice; the first request ends before the second push.
    let prefill = |id: &str| {
        let out = bin()
            .args(["--log-format", "json", "prefill", "--target", &s.target()])
            .args([
                "--prompt-tokens",
                "42",
                "--reuse-prefix",
                "--request-id",
                id,
            ])
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{log}");
        log.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find_map(|v| v["fields"]["reused_tokens"].as_u64())
            .unwrap_or_else(|| panic!("no reused_tokens in {log}"))
    };
    assert_eq!(prefill("cli-p1"), 0);
    let out = bin()
        .args([
            "generate",
            "--target",
            &s.target(),
            "--request-id",
            "cli-p1",
        ])
        .args(["--max-new-tokens", "2", "--ignore-eos"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(prefill("cli-p2"), 40, "the prompt's whole blocks");
}

/// A block's hash as `WatchKvEvents` documents it, from tokens alone.
fn router_hashes(model_id: &str, dtype: &str, tokens: &[u32], block: usize) -> Vec<u64> {
    use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};
    let seed = xxh3_64(&[model_id.as_bytes(), &[0], dtype.as_bytes()].concat());
    let mut parent = 0u64;
    tokens
        .chunks_exact(block)
        .map(|b| {
            let mut buf = parent.to_le_bytes().to_vec();
            b.iter()
                .for_each(|t| buf.extend_from_slice(&t.to_le_bytes()));
            parent = xxh3_64_with_seed(&buf, seed);
            parent
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_tell_a_router_which_blocks_the_node_holds() {
    use pb::kv_event::Event;
    let s = Served::start(&["--prefix-cache-bytes", "64Mi", "--block-size", "16"]);
    let mut kvc = pb::kv_transfer_client::KvTransferClient::new(s.channel().await);
    let mut events = kvc
        .watch_kv_events(pb::WatchKvEventsRequest {})
        .await
        .unwrap()
        .into_inner();
    let first = events.message().await.unwrap().unwrap();
    assert!(first.snapshot && first.events.is_empty(), "{first:?}");

    let p = prompt(40, 3);
    let kv = prompt_kv("ev", &p);
    push(&s, &kv).await.unwrap();
    let (out, _) = generate(&s, gen_req("ev", 9)).await.unwrap();
    // Held: the prompt and the fed tokens (the first token, then all generated but the last).
    let mut held = p.clone();
    held.push(kv.header.next_token_id);
    held.extend_from_slice(&out[..8]);
    let want = router_hashes(&kv.header.model_id, "f32", &held, 16);
    assert_eq!(want.len(), 3);
    let got = events.message().await.unwrap().unwrap();
    assert!(!got.snapshot);
    match &got.events[..] {
        [
            pb::KvEvent {
                event: Some(Event::Stored(st)),
            },
        ] => {
            assert_eq!((st.parent_hash, st.block_size), (0, 16));
            assert_eq!(st.block_hashes, want);
        }
        other => panic!("{other:?}"),
    }

    // A node without a prefix cache says so.
    let plain = Served::start(&[]);
    let mut c = pb::kv_transfer_client::KvTransferClient::new(plain.channel().await);
    let e = c
        .watch_kv_events(pb::WatchKvEventsRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
}
