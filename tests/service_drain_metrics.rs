//! SIGTERM drains (running requests finish, new work is refused, exit 0); `/metrics`
//! exposes every required name; `/live` and `/health` answer probes.

mod common;
use common::*;
use decode_node_proto::v1 as pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_running_requests_then_exits_zero() {
    let mut s = Served::start(&["--drain-timeout", "30"]);
    push(&s, &prompt_kv("d1", &prompt(20, 1))).await.unwrap();
    let mut c = pb::decode_client::DecodeClient::new(s.channel().await);
    let mut stream = c.generate(gen_req("d1", 400)).await.unwrap().into_inner();
    stream.message().await.unwrap().unwrap();
    s.sigterm();
    // Draining: health says 503, new pushes are UNAVAILABLE.
    let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while http_get(s.metrics, "/health").0 != 503 && std::time::Instant::now() < end {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(http_get(s.metrics, "/health").0, 503);
    assert_eq!(http_get(s.metrics, "/live").0, 200);
    let e = push(&s, &prompt_kv("d2", &prompt(8, 2))).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    let mut n = 1;
    let mut fin = None;
    while let Some(m) = stream.message().await.unwrap() {
        match m.event {
            Some(pb::generate_response::Event::Token(_)) => n += 1,
            Some(pb::generate_response::Event::Finish(f)) => fin = Some(f),
            None => {}
        }
    }
    let fin = fin.expect("the running request finishes");
    assert_eq!(fin.reason, pb::FinishReason::Length as i32);
    assert_eq!(n, 400);
    let status = s
        .wait(std::time::Duration::from_secs(20))
        .expect("exits after draining");
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_expose_every_required_name() {
    // Layer-ahead on, so its families (prediction cosine, guard) have samples: a CPU node
    // predicts nothing by default.
    let s = Served::start(&["--served-model-name", "tiny-chat", "--layer-ahead", "on"]);
    assert_eq!(http_get(s.metrics, "/health").0, 200);
    push(&s, &prompt_kv("m1", &prompt(20, 1))).await.unwrap();
    generate(&s, gen_req("m1", 3)).await.unwrap();
    // One refused push, so the error family has a sample.
    let mut bad = prompt_kv("m2", &prompt(8, 2));
    bad.header.model_id = "other".into();
    assert_eq!(
        push(&s, &bad).await.unwrap_err().code(),
        tonic::Code::FailedPrecondition
    );
    let text = s.metrics_text();
    for name in decode_node::metrics::REQUIRED {
        assert!(text.contains(name), "/metrics lacks {name}");
    }
    assert!(
        text.contains("decode_node_kv_ingest_errors_total{code=\"failed_precondition\"} 1"),
        "{text}"
    );
    assert!(text.contains("decode_node_generation_tokens_total 3"));
    assert!(
        text.contains("decode_node_prompt_tokens_total 20"),
        "{text}"
    );
    // Without an Accept for OpenMetrics, the classic text format: a counter's family is
    // named with its suffix and nothing follows the samples.
    assert!(
        text.contains("# TYPE decode_node_requests_total counter") && !text.contains("# EOF"),
        "{text}"
    );
    let (code, head, open) = http_get_with(
        s.metrics,
        "/metrics",
        "Accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n",
    );
    assert_eq!(code, 200);
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text; version=1.0.0"),
        "{head}"
    );
    assert!(
        open.contains("# TYPE decode_node_requests counter") && open.ends_with("# EOF\n"),
        "{open}"
    );
    let info = text
        .lines()
        .find(|l| l.starts_with("decode_node_model_info{"))
        .unwrap_or_else(|| panic!("no model info in {text}"));
    assert!(
        info.contains("served_model_name=\"tiny-chat\"")
            && info.contains(&format!("model_id=\"{}\"", tiny().model.model_id))
            && info.contains("device=\"cpu\"")
            && info.ends_with(" 1"),
        "{info}"
    );
}

/// SIGTERM with KV committed but not yet generated from: a Generate for it is still served
/// during the drain, while new pushes and Generates for KV the node does not hold are
/// refused; KV nobody claims is dropped at the drain timeout, logged by id, and the node
/// exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_serves_committed_kv_until_the_drain_timeout() {
    let mut s = Served::start(&["--drain-timeout", "3"]);
    let p = prompt(20, 4);
    push(&s, &prompt_kv("kept", &p)).await.unwrap();
    push(&s, &prompt_kv("orphan", &prompt(20, 5)))
        .await
        .unwrap();
    s.sigterm();
    let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while http_get(s.metrics, "/health").0 != 503 && std::time::Instant::now() < end {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let t0 = std::time::Instant::now();
    let (ids, fin) = generate(&s, gen_req("kept", 8))
        .await
        .expect("committed KV is served");
    assert_eq!(fin.reason, pb::FinishReason::Length as i32);
    assert_eq!(ids, reference_greedy(&p, 8));
    let e = generate(&s, gen_req("never-pushed", 8)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    let e = push(&s, &prompt_kv("late", &prompt(8, 2)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    let status = s
        .wait(std::time::Duration::from_secs(20))
        .expect("exits after the drain timeout");
    assert!(status.success(), "{status:?}");
    assert!(
        t0.elapsed() >= std::time::Duration::from_millis(1500),
        "the drain waited for the unclaimed KV"
    );
    let log = s.log.lock().unwrap().join("\n");
    let dropped: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("KV never generated from is dropped"))
        .collect();
    assert_eq!(dropped.len(), 1, "{log}");
    assert!(dropped[0].contains("orphan"), "{}", dropped[0]);
}

/// WatchLoad pushes the load as GetLoad reports it until the client goes away: a push shows up
/// in a later report, and an interval past 100 ms is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_load_streams_the_load_as_it_changes() {
    let s = Served::start(&[]);
    let mut c = pb::decode_client::DecodeClient::new(s.channel().await);
    let mut watch = c
        .watch_load(pb::WatchLoadRequest { interval_ms: 10 })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!((first.host_kv_bytes_used, first.running), (0, 0));
    assert!(first.host_kv_bytes_capacity > 0);
    push(&s, &prompt_kv("w1", &prompt(20, 1))).await.unwrap();
    // Reports made while the push was under way may still be in the stream: its blocks are
    // reserved (bytes used) before it commits. The committed push shows in a later one.
    let mut seen = None;
    for _ in 0..1000 {
        let r = watch.message().await.unwrap().unwrap();
        if r.committed_unclaimed > 0 {
            seen = Some(r);
            break;
        }
    }
    let r = seen.expect("the pushed KV shows in a report");
    assert_eq!(r.committed_unclaimed, 1);
    assert!(r.host_kv_bytes_used > 0);
    drop(watch);
    let e = c
        .watch_load(pb::WatchLoadRequest { interval_ms: 1000 })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("interval_ms"), "{}", e.message());
}
