//! Push then generate, and generate then push, both stream the exact greedy continuation.

mod common;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_then_generate_and_generate_then_push_match_the_reference() {
    for mode in ["full", "scout"] {
        let s = Served::start(&["--attention", mode]);
        let p = prompt(40, 1);
        let want = reference_greedy(&p, 12);

        push(&s, &prompt_kv("a", &p)).await.unwrap();
        let (ids, fin) = generate(&s, gen_req("a", 12)).await.unwrap();
        assert_eq!(ids, want, "{mode}: push then generate");
        assert_eq!(fin.generated_tokens, 12);
        assert_eq!(
            fin.reason,
            decode_node_proto::v1::FinishReason::Length as i32
        );

        let s2 = &s;
        let waiter = async move { generate(s2, gen_req("b", 12)).await };
        let pusher = async move {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            push(s2, &prompt_kv("b", &p)).await
        };
        let (g, pushed) = tokio::join!(waiter, pusher);
        pushed.unwrap();
        assert_eq!(g.unwrap().0, want, "{mode}: generate then push");

        let l = wait_load(&s, |l| l.host_kv_bytes_used == 0).await;
        assert_eq!(l.host_kv_bytes_used, 0, "finished requests free their KV");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_without_kv_is_not_found_after_the_timeout() {
    let s = Served::start(&[]);
    let mut req = gen_req("ghost", 4);
    req.kv_timeout_ms = 100;
    let e = generate(&s, req).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e}");
    let mut bad = gen_req("x", 0);
    bad.max_new_tokens = 0;
    assert_eq!(
        generate(&s, bad).await.unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scout_with_a_whole_budget_and_cpu_part_equals_full_and_sparse_uses_the_cpu() {
    let p = prompt(120, 3);
    let want = reference_greedy(&p, 10);
    // Budget covers the context; only 2 blocks per head fit the device: the CPU does the rest.
    // With --exact; and without it but with every prediction accepted, where the prediction
    // only chooses the blocks (all of them here) and the real query attends them. (Attending
    // them with the predicted query, `--guard-predicted-cpu`, gives other tokens here.)
    for (id, how) in [("e", "--exact"), ("g", "--guard-min-cosine=-1")] {
        let s = Served::start(&[
            "--attention",
            "scout",
            how,
            "--block-size",
            "8",
            "--budget-tokens",
            "512",
            "--device-blocks",
            "2",
        ]);
        push(&s, &prompt_kv(id, &p)).await.unwrap();
        let (ids, fin) = generate(&s, gen_req(id, 10)).await.unwrap();
        assert_eq!(ids, want, "scout {how} equals full");
        let st = fin.stats.unwrap();
        assert!(
            st.cpu_attention_ratio > 0.5,
            "most selected tokens ran on the CPU: {st:?}"
        );
    }

    // Real sparse attention: small budget, layer-ahead prediction (off by default on the
    // CPU), recall.
    let s = Served::start(&[
        "--attention",
        "scout",
        "--layer-ahead",
        "on",
        "--block-size",
        "8",
        "--budget-tokens",
        "32",
        "--device-blocks",
        "4",
    ]);
    push(&s, &prompt_kv("f", &p)).await.unwrap();
    let (ids, fin) = generate(&s, gen_req("f", 10)).await.unwrap();
    assert_eq!(ids.len(), 10);
    let st = fin.stats.unwrap();
    assert!(
        st.prediction_hit_ratio > 0.0 && st.prediction_hit_ratio <= 1.0,
        "{st:?}"
    );
    let text = s.metrics_text();
    assert!(text.contains("decode_node_query_prediction_hit_ratio"));
}

/// Over the wire: a stop string ends the stream before it (STOP) and every token carries the
/// model's most likely tokens, the greedy pick first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_and_top_logprobs_over_grpc() {
    use decode_node_proto::v1 as pb;
    let s = Served::start(&[]);
    let p = prompt(40, 2);
    let want = reference_greedy(&p, 12);
    let full = tiny().tokenizer.decode(&want);
    let stop: String = full.chars().skip(4).take(2).collect();
    let before = full[..full.find(&stop).unwrap()].to_string();
    push(&s, &prompt_kv("st", &p)).await.unwrap();
    let mut req = gen_req("st", 12);
    req.stop = vec![stop.clone()];
    req.top_logprobs = 2;
    let mut c = pb::decode_client::DecodeClient::new(s.channel().await);
    let mut stream = c.generate(req).await.unwrap().into_inner();
    let (mut text, mut fin) = (String::new(), None);
    while let Some(m) = stream.message().await.unwrap() {
        match m.event {
            Some(pb::generate_response::Event::Token(t)) => {
                text += &t.text;
                assert_eq!(t.top_logprobs.len(), 2);
                assert_eq!(t.top_logprobs[0].id, t.id);
                assert!((t.top_logprobs[0].logprob - t.logprob).abs() < 1e-5);
            }
            Some(pb::generate_response::Event::Finish(f)) => fin = Some(f),
            None => {}
        }
    }
    assert_eq!(text, before, "stop {stop:?} in {full:?}");
    assert_eq!(fin.unwrap().reason, pb::FinishReason::Stop as i32);
}
