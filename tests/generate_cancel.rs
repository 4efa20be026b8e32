//! Cancel, client disconnect and KV that turns the model's output NaN end a request mid-stream,
//! free its KV and are counted.

mod common;
use common::*;
use decode_node_proto::v1 as pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_disconnect_free_kv_and_count() {
    let s = Served::start(&[]);
    let before = load(&s).await.host_kv_bytes_used;
    assert_eq!(before, 0);

    // Cancel RPC mid-stream.
    push(&s, &prompt_kv("k1", &prompt(30, 1))).await.unwrap();
    let mut c = pb::decode_client::DecodeClient::new(s.channel().await);
    let mut stream = c
        .generate(gen_req("k1", 20_000))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert!(matches!(
        first.event,
        Some(pb::generate_response::Event::Token(_))
    ));
    let r = c
        .cancel(pb::CancelRequest {
            request_id: "k1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.cancelled);
    let mut finish = None;
    while let Some(m) = stream.message().await.unwrap() {
        if let Some(pb::generate_response::Event::Finish(f)) = m.event {
            finish = Some(f);
        }
    }
    assert_eq!(finish.unwrap().reason, pb::FinishReason::Cancelled as i32);

    // Client disconnect mid-stream.
    push(&s, &prompt_kv("k2", &prompt(30, 2))).await.unwrap();
    let mut stream = c
        .generate(gen_req("k2", 20_000))
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().unwrap();
    drop(stream);

    let l = wait_load(&s, |l| l.host_kv_bytes_used == 0 && l.running == 0).await;
    assert_eq!(
        (l.host_kv_bytes_used, l.running),
        (0, 0),
        "KV freed after cancel and disconnect"
    );
    let m = s.metrics_text();
    assert!(
        m.contains("decode_node_cancellations_total{reason=\"client\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("decode_node_cancellations_total{reason=\"disconnect\"} 1"),
        "{m}"
    );

    // Cancel of committed-but-unclaimed KV frees it too; unknown ids say so.
    push(&s, &prompt_kv("k3", &prompt(30, 3))).await.unwrap();
    assert!(load(&s).await.host_kv_bytes_used > 0);
    assert!(
        c.cancel(pb::CancelRequest {
            request_id: "k3".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .cancelled
    );
    assert_eq!(load(&s).await.host_kv_bytes_used, 0);
    assert!(
        !c.cancel(pb::CancelRequest {
            request_id: "nope".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .cancelled
    );
}

/// Admission reserves what a request can use (its prompt plus max_new_tokens, in blocks),
/// not the whole budget: a huge sparse budget still admits a short request. One that can
/// never fit is refused at once naming the sizes; client numbers out of range are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_counts_what_a_request_can_use_and_numbers_are_clamped() {
    let s = Served::start(&[
        "--attention",
        "scout",
        "--budget-tokens",
        "1000000",
        "--device-kv-bytes",
        "1Mi",
    ]);
    let p = prompt(24, 3);
    push(&s, &prompt_kv("short", &p)).await.unwrap();
    let (ids, _) = generate(&s, gen_req("short", 8)).await.expect("admitted");
    assert_eq!(ids, reference_greedy(&p, 8));

    // 4000 tokens of device KV for one request cannot fit in 1 MiB: refused at once.
    push(&s, &prompt_kv("long", &prompt(2000, 3)))
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    let e = generate(&s, gen_req("long", 2000)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{}", e.message());
    assert!(e.message().contains("never fit"), "{}", e.message());
    assert!(t0.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!(
        wait_load(&s, |l| l.host_kv_bytes_used == 0)
            .await
            .host_kv_bytes_used,
        0
    );

    let bad = [
        ("kv_timeout_ms", {
            let mut r = gen_req("x", 4);
            r.kv_timeout_ms = 3_600_000;
            r
        }),
        ("stop_token_ids", {
            let mut r = gen_req("x", 4);
            r.stop_token_ids = vec![1; 65];
            r
        }),
        ("max_new_tokens", gen_req("x", 1_000_000)),
        ("repetition_penalty", {
            let mut r = gen_req("x", 4);
            r.sampling.as_mut().unwrap().repetition_penalty = -1.0;
            r
        }),
        ("presence_penalty", {
            let mut r = gen_req("x", 4);
            r.sampling.as_mut().unwrap().presence_penalty = 3.0;
            r
        }),
        ("frequency_penalty", {
            let mut r = gen_req("x", 4);
            r.sampling.as_mut().unwrap().frequency_penalty = f32::NAN;
            r
        }),
        ("min_tokens", {
            let mut r = gen_req("x", 4);
            r.min_tokens = 5;
            r
        }),
        ("stop strings", {
            let mut r = gen_req("x", 4);
            r.stop = vec!["s".into(); 17];
            r
        }),
        ("stop string", {
            let mut r = gen_req("x", 4);
            r.stop = vec![String::new()];
            r
        }),
        ("top_logprobs", {
            let mut r = gen_req("x", 4);
            r.top_logprobs = 21;
            r
        }),
    ];
    for (what, r) in bad {
        let e = generate(&s, r).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{what}");
        assert!(e.message().contains(what), "{what}: {}", e.message());
    }
}

/// A Cancel that arrives before its Generate has KV (so before the job reaches the engine)
/// ends that Generate CANCELLED; a Generate whose client went away leaves no waiter behind;
/// a retry of the same id then works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_before_submit_and_a_gone_waiter_leave_the_id_usable() {
    let s = Served::start(&[]);
    let mut c = pb::decode_client::DecodeClient::new(s.channel().await);
    let mut waiting = c.generate(gen_req("early", 4)).await.unwrap().into_inner();
    wait_load(&s, |_| true).await;
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let r = c
        .cancel(pb::CancelRequest {
            request_id: "early".into(),
            lease: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.cancelled);
    let e = waiting.message().await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Cancelled, "{e}");

    // A client that gives up while waiting: its waiter goes with it.
    let gone = c.generate(gen_req("early", 4)).await.unwrap().into_inner();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    drop(gone);
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;

    let p = prompt(24, 8);
    push(&s, &prompt_kv("early", &p)).await.unwrap();
    let (ids, fin) = generate(&s, gen_req("early", 4)).await.unwrap();
    assert_eq!(fin.reason, pb::FinishReason::Length as i32);
    assert_eq!(ids, reference_greedy(&p, 4));
    assert_eq!(
        wait_load(&s, |l| l.host_kv_bytes_used == 0)
            .await
            .host_kv_bytes_used,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_holding_nan_ends_the_request_with_data_loss_and_frees_it() {
    let s = Served::start(&["--attention", "full"]);
    let mut kv = prompt_kv("nan", &prompt(40, 3));
    // One NaN key and one infinite value (f32 KV), layer 0, token 0: CRC-correct, so the
    // push is accepted; the first step's logits turn NaN.
    let (k, v) = &mut kv.layers[0];
    let mut kb = k.to_vec();
    kb[..4].copy_from_slice(&f32::NAN.to_le_bytes());
    let mut vb = v.to_vec();
    vb[..4].copy_from_slice(&f32::INFINITY.to_le_bytes());
    *k = kb.into();
    *v = vb.into();
    push(&s, &kv).await.unwrap();
    let err = generate(&s, gen_req("nan", 8)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::DataLoss, "{err:?}");
    assert!(err.message().contains("NaN"), "{}", err.message());
    let l = wait_load(&s, |l| l.host_kv_bytes_used == 0 && l.running == 0).await;
    assert_eq!((l.host_kv_bytes_used, l.running), (0, 0), "KV freed");
    // The node goes on serving clean requests.
    push(&s, &prompt_kv("ok", &prompt(40, 3))).await.unwrap();
    let (ids, _) = generate(&s, gen_req("ok", 8)).await.unwrap();
    assert_eq!(ids.len(), 8);
}
