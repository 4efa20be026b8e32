//! Cancel and client disconnect mid-stream free the request's KV and are counted.

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
        .generate(gen_req("k1", 100_000))
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
        .generate(gen_req("k2", 100_000))
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
            request_id: "k3".into()
        })
        .await
        .unwrap()
        .into_inner()
        .cancelled
    );
    assert_eq!(load(&s).await.host_kv_bytes_used, 0);
    assert!(
        !c.cancel(pb::CancelRequest {
            request_id: "nope".into()
        })
        .await
        .unwrap()
        .into_inner()
        .cancelled
    );
}
