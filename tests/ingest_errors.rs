//! Every PushKv error code over loopback; a client killed mid-push; lease expiry; pool
//! exhaustion with concurrent pushers. The pool always returns to its previous bytes.

mod common;
use common::*;
use decode_node_proto::v1 as pb;
use kv_transfer::client::push_messages;
use pb::push_kv_request::Item;
use tokio_stream::StreamExt;

/// Sends `msgs` as one push; returns the final status code (Ok when committed).
async fn send(s: &Served, msgs: Vec<pb::PushKvRequest>) -> tonic::Code {
    let mut c = pb::kv_transfer_client::KvTransferClient::new(s.channel().await);
    let mut stream = match c.push_kv(tokio_stream::iter(msgs)).await {
        Ok(r) => r.into_inner(),
        Err(e) => return e.code(),
    };
    loop {
        match stream.next().await {
            Some(Ok(a)) if a.committed => return tonic::Code::Ok,
            Some(Ok(_)) => {}
            Some(Err(e)) => return e.code(),
            None => return tonic::Code::Unknown,
        }
    }
}

fn msgs(id: &str, n: usize) -> Vec<pb::PushKvRequest> {
    push_messages(&prompt_kv(id, &prompt(n, 7)), 16)
}

fn chunk_mut(m: &mut pb::PushKvRequest) -> &mut pb::KvChunk {
    match &mut m.item {
        Some(Item::Chunk(c)) => c,
        _ => panic!("not a chunk"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_code_and_nothing_leaks() {
    use tonic::Code::*;
    let s = Served::start(&["--host-kv-bytes", "1Mi"]);
    let good = msgs("g", 40);
    let header = good[0].clone();
    let n = good.len();

    let cases: Vec<(&str, Vec<pb::PushKvRequest>, tonic::Code)> = vec![
        ("chunk first", good[1..].to_vec(), InvalidArgument),
        (
            "two headers",
            [vec![header.clone()], good.clone()].concat(),
            InvalidArgument,
        ),
        (
            "model id",
            {
                let mut m = good.clone();
                if let Some(Item::Header(h)) = &mut m[0].item {
                    h.model_id = "other".into()
                }
                m
            },
            FailedPrecondition,
        ),
        (
            "kv heads",
            {
                let mut m = good.clone();
                if let Some(Item::Header(h)) = &mut m[0].item {
                    h.num_kv_heads = 3
                }
                m
            },
            FailedPrecondition,
        ),
        (
            "dtype",
            {
                let mut m = good.clone();
                if let Some(Item::Header(h)) = &mut m[0].item {
                    h.dtype = 0
                }
                m
            },
            InvalidArgument,
        ),
        (
            "crc",
            {
                let mut m = good.clone();
                chunk_mut(&mut m[1]).crc32c ^= 0x55;
                m
            },
            InvalidArgument,
        ),
        (
            "layer range",
            {
                let mut m = good.clone();
                chunk_mut(&mut m[1]).layer = 99;
                m
            },
            InvalidArgument,
        ),
        (
            "token range",
            {
                let mut m = good.clone();
                chunk_mut(&mut m[1]).token_start = 39;
                m
            },
            InvalidArgument,
        ),
        (
            "length",
            {
                let mut m = good.clone();
                let c = chunk_mut(&mut m[1]);
                c.value = c.value.slice(4..);
                m
            },
            InvalidArgument,
        ),
        (
            "duplicate",
            {
                let mut m = good.clone();
                m.insert(2, m[1].clone());
                m
            },
            InvalidArgument,
        ),
        (
            "missing coverage",
            {
                let mut m = good.clone();
                m.remove(3);
                m
            },
            InvalidArgument,
        ),
        ("no commit", good[..n - 1].to_vec(), InvalidArgument),
        ("too big", msgs("big", 1500), ResourceExhausted),
    ];
    for (name, m, want) in cases {
        assert_eq!(send(&s, m).await, want, "case {name}");
        assert_eq!(load(&s).await.host_kv_bytes_used, 0, "case {name} leaked");
    }
    assert_eq!(send(&s, good.clone()).await, Ok);
    assert_eq!(send(&s, good.clone()).await, AlreadyExists);
    let mut c = pb::kv_transfer_client::KvTransferClient::new(s.channel().await);
    let r = c
        .drop_kv(pb::DropKvRequest {
            request_id: "g".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.dropped && r.bytes_freed > 0);
    assert_eq!(
        c.drop_kv(pb::DropKvRequest {
            request_id: "g".into(),
            ..Default::default()
        })
        .await
        .unwrap_err()
        .code(),
        NotFound
    );
    assert_eq!(load(&s).await.host_kv_bytes_used, 0);
    let m = s.metrics_text();
    assert!(
        m.contains("decode_node_kv_ingest_errors_total{code=\"invalid_argument\"} 10"),
        "{m}"
    );
    assert!(m.contains("decode_node_kv_ingest_errors_total{code=\"failed_precondition\"} 2"));
    assert!(m.contains("decode_node_kv_ingest_errors_total{code=\"resource_exhausted\"} 1"));
    assert!(m.contains("decode_node_kv_ingest_errors_total{code=\"already_exists\"} 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_client_mid_push_returns_the_pool_to_its_previous_bytes() {
    let s = Served::start(&[]);
    // Something already committed, so "previous bytes" is not just zero.
    assert_eq!(send(&s, msgs("keep", 30)).await, tonic::Code::Ok);
    let before = load(&s).await.host_kv_bytes_used;
    assert!(before > 0);
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let ch = s.channel().await;
    let call = tokio::spawn(async move {
        let mut c = pb::kv_transfer_client::KvTransferClient::new(ch);
        let mut st = c
            .push_kv(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        while st.message().await?.is_some() {}
        Ok::<_, tonic::Status>(())
    });
    let m = msgs("half", 100);
    for msg in &m[..m.len() / 2] {
        tx.send(msg.clone()).await.unwrap();
    }
    let mid = wait_load(&s, |l| l.host_kv_bytes_used > before)
        .await
        .host_kv_bytes_used;
    assert!(mid > before, "the push holds its reservation");
    call.abort();
    drop(tx);
    let after = wait_load(&s, |l| l.host_kv_bytes_used == before)
        .await
        .host_kv_bytes_used;
    assert_eq!(after, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unclaimed_kv_expires_with_its_lease() {
    let s = Served::start(&["--kv-lease", "0.3"]);
    assert_eq!(send(&s, msgs("l", 30)).await, tonic::Code::Ok);
    let l = wait_load(&s, |l| l.host_kv_bytes_used == 0).await;
    assert_eq!(l.host_kv_bytes_used, 0);
    assert!(
        s.metrics_text()
            .contains("decode_node_kv_leases_expired_total 1")
    );
    let mut req = gen_req("l", 2);
    req.kv_timeout_ms = 50;
    assert_eq!(
        generate(&s, req).await.unwrap_err().code(),
        tonic::Code::NotFound
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_pushers_exhaust_the_pool_cleanly() {
    // 40 tokens x 4 layers = 8 blocks of 8 KiB each: room for 3 such prompts.
    let s = Served::start(&["--host-kv-bytes", "200Ki"]);
    let s = &s;
    let results =
        futures_all((0..8).map(|i| async move { send(s, msgs(&format!("p{i}"), 40)).await })).await;
    let ok = results.iter().filter(|c| **c == tonic::Code::Ok).count();
    let full = results
        .iter()
        .filter(|c| **c == tonic::Code::ResourceExhausted)
        .count();
    assert_eq!(ok + full, 8, "{results:?}");
    assert_eq!(ok, 3, "{results:?}");
    let l = load(s).await;
    assert!(l.host_kv_bytes_used <= l.host_kv_bytes_capacity);
    let mut c = pb::kv_transfer_client::KvTransferClient::new(s.channel().await);
    for i in 0..8 {
        let _ = c
            .drop_kv(pb::DropKvRequest {
                request_id: format!("p{i}"),
                ..Default::default()
            })
            .await;
    }
    assert_eq!(load(s).await.host_kv_bytes_used, 0);
}

async fn futures_all<T, F: std::future::Future<Output = T>>(fs: impl Iterator<Item = F>) -> Vec<T> {
    let mut pinned: Vec<_> = fs.map(Box::pin).collect();
    let mut out: Vec<Option<T>> = pinned.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in pinned.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

/// Sends `body` as a raw PushKv request (hand-made gRPC framing) with `headers`; returns the
/// status the node ends it with.
async fn raw_push(s: &Served, body: Vec<bytes::Bytes>, headers: &[(&str, &str)]) -> tonic::Code {
    use http_body::Frame;
    use tonic::codec::Codec;
    use tower_service::Service;
    let mut ch = s.channel().await;
    let body = tonic::body::Body::new(http_body_util::StreamBody::new(tokio_stream::iter(
        body.into_iter()
            .map(|b| Ok::<_, tonic::Status>(Frame::data(b))),
    )));
    let mut req = http::Request::builder()
        .method("POST")
        .version(http::Version::HTTP_2)
        .uri(kv_transfer::wire::PUSH_KV_PATH)
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(body).unwrap();
    std::future::poll_fn(|cx| ch.poll_ready(cx)).await.unwrap();
    let res = ch.call(req).await.unwrap();
    let (parts, body) = res.into_parts();
    if let Some(st) = tonic::Status::from_header_map(&parts.headers) {
        return st.code();
    }
    let dec = tonic_prost::ProstCodec::<pb::PushKvRequest, pb::PushKvResponse>::default().decoder();
    let mut stream = tonic::codec::Streaming::new_response(dec, body, parts.status, None, None);
    loop {
        match stream.message().await {
            Ok(Some(a)) if a.committed => return tonic::Code::Ok,
            Ok(Some(_)) => {}
            Ok(None) => return tonic::Code::Ok,
            Err(e) => return e.code(),
        }
    }
}

fn framed(flag: u8, msg: &[u8]) -> bytes::Bytes {
    let mut b = vec![flag];
    b.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    b.extend_from_slice(msg);
    b.into()
}

/// The zero-copy PushKv route refuses what is wrong before it is a message, with the code a
/// gRPC server would give, and holds nothing afterwards; a push split into tiny frames (as a
/// client with small HTTP/2 frames sends it) is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framing_errors_are_refused_and_any_frame_split_is_accepted() {
    use tonic::Code::*;
    let s = Served::start(&["--host-kv-bytes", "1Mi"]);
    let good: Vec<bytes::Bytes> = msgs("f", 40)
        .iter()
        .map(|m| kv_transfer::wire::encode_message(m).unwrap())
        .collect();
    let header = good[0].clone();
    type Case<'a> = (
        &'a str,
        Vec<bytes::Bytes>,
        Vec<(&'a str, &'a str)>,
        tonic::Code,
    );
    let cases: Vec<Case<'_>> = vec![
        (
            "over the message limit",
            vec![
                header.clone(),
                bytes::Bytes::from_static(&[0, 0xff, 0, 0, 0]),
            ],
            vec![],
            ResourceExhausted,
        ),
        (
            "compressed without grpc-encoding",
            vec![header.clone(), framed(1, &[1, 2, 3])],
            vec![],
            Unimplemented,
        ),
        (
            "gzip",
            good.clone(),
            vec![("grpc-encoding", "gzip")],
            Unimplemented,
        ),
        (
            "ends inside a message",
            vec![header.clone(), good[1].slice(..good[1].len() - 3)],
            vec![],
            Internal,
        ),
        (
            "not a PushKvRequest",
            vec![header.clone(), framed(0, &[0x12, 0x7f, 1])],
            vec![],
            InvalidArgument,
        ),
    ];
    for (what, body, headers, code) in cases {
        assert_eq!(raw_push(&s, body, &headers).await, code, "{what}");
        assert_eq!(load(&s).await.host_kv_bytes_used, 0, "{what}");
    }
    // The whole push cut into 7-byte frames, straddling every message boundary.
    let all: Vec<u8> = good.iter().flat_map(|b| b.iter().copied()).collect();
    let tiny: Vec<bytes::Bytes> = all.chunks(7).map(bytes::Bytes::copy_from_slice).collect();
    assert_eq!(raw_push(&s, tiny, &[]).await, Ok);
    assert!(load(&s).await.host_kv_bytes_used > 0);
}

/// Starts a push that sends `sent` of its messages and then goes silent (stream kept open);
/// returns the sender (keep it alive to keep the stream open) and the call's final status.
async fn stalled_push(
    s: &Served,
    msgs: Vec<pb::PushKvRequest>,
    sent: usize,
) -> (
    tokio::sync::mpsc::Sender<pb::PushKvRequest>,
    tokio::task::JoinHandle<tonic::Code>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(msgs.len().max(1));
    for m in msgs.into_iter().take(sent) {
        tx.try_send(m).unwrap();
    }
    let ch = s.channel().await;
    let call = tokio::spawn(async move {
        let mut c = pb::kv_transfer_client::KvTransferClient::new(ch);
        let mut st = match c
            .push_kv(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
        {
            Ok(r) => r.into_inner(),
            Err(e) => return e.code(),
        };
        loop {
            match st.message().await {
                Ok(Some(_)) => {}
                Ok(None) => return tonic::Code::Ok,
                Err(e) => return e.code(),
            }
        }
    });
    (tx, call)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_pusher_is_ended_by_the_idle_timeout_dropkv_or_cancel() {
    // Header only, then silence: the idle timeout ends it.
    {
        let s = Served::start(&["--push-idle-timeout", "1"]);
        let (_tx, call) = stalled_push(&s, msgs("idle", 100), 1).await;
        assert!(
            wait_load(&s, |l| l.host_kv_bytes_used > 0)
                .await
                .host_kv_bytes_used
                > 0,
            "the header reserves"
        );
        let t0 = std::time::Instant::now();
        assert_eq!(call.await.unwrap(), tonic::Code::DeadlineExceeded);
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
        assert_eq!(
            wait_load(&s, |l| l.host_kv_bytes_used == 0)
                .await
                .host_kv_bytes_used,
            0
        );
        let m = s.metrics_text();
        assert!(m.contains("decode_node_kv_push_ends_total{outcome=\"idle_timeout\"}"));
    }

    // The rest on a node whose idle timeout cannot race them (a loaded CI host once took
    // over a second between a push's last chunk and the DropKv below).
    let s = Served::start(&["--push-idle-timeout", "600"]);
    assert_eq!(send(&s, msgs("keep", 30)).await, tonic::Code::Ok);
    let before = load(&s).await.host_kv_bytes_used;
    let held = |l: &pb::LoadReport| l.host_kv_bytes_used > before;
    let back = |l: &pb::LoadReport| l.host_kv_bytes_used == before;

    // Half its chunks, then silence: DropKv ends it at once, ABORTED, and says what it freed.
    let (_tx, call) = stalled_push(&s, msgs("dropped", 100), 4).await;
    let mid = wait_load(&s, held).await.host_kv_bytes_used;
    let mut c = pb::kv_transfer_client::KvTransferClient::new(s.channel().await);
    let r = c
        .drop_kv(pb::DropKvRequest {
            request_id: "dropped".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.dropped);
    assert_eq!(r.bytes_freed, mid - before);
    assert_eq!(call.await.unwrap(), tonic::Code::Aborted);
    assert_eq!(wait_load(&s, back).await.host_kv_bytes_used, before);

    // Cancel ends a stalled push CANCELLED.
    let (_tx, call) = stalled_push(&s, msgs("cancelled", 100), 2).await;
    wait_load(&s, held).await;
    let mut d = pb::decode_client::DecodeClient::new(s.channel().await);
    let r = d
        .cancel(pb::CancelRequest {
            request_id: "cancelled".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.cancelled);
    assert_eq!(call.await.unwrap(), tonic::Code::Cancelled);
    assert_eq!(wait_load(&s, back).await.host_kv_bytes_used, before);

    // Nothing held under an id: not dropped. The id is free again for a new push.
    let r = c
        .drop_kv(pb::DropKvRequest {
            request_id: "keep".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.dropped && r.bytes_freed == before);
    assert_eq!(send(&s, msgs("dropped", 30)).await, tonic::Code::Ok);

    let m = s.metrics_text();
    for outcome in ["dropped", "cancelled", "committed"] {
        assert!(
            m.contains(&format!(
                "decode_node_kv_push_ends_total{{outcome=\"{outcome}\"}}"
            )),
            "{outcome} missing from metrics"
        );
    }
}

/// 256 pushes each stalled right after its header: no more than `--max-push-streams` are in
/// flight, the rest are refused at once, the stalled ones end by the idle timeout, and the
/// pool returns to its start.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_streams_are_capped_and_stalled_headers_free_everything() {
    let s = Served::start(&["--max-push-streams", "16", "--push-idle-timeout", "3"]);
    let before = load(&s).await.host_kv_bytes_used;
    let t0 = std::time::Instant::now();
    let mut open = Vec::new();
    for i in 0..256 {
        open.push(stalled_push(&s, msgs(&format!("s{i}"), 64), 1).await);
    }
    let mut per_code = std::collections::BTreeMap::<String, usize>::new();
    for (tx, call) in open {
        let code = call.await.unwrap();
        drop(tx);
        *per_code.entry(format!("{code:?}")).or_default() += 1;
    }
    let exhausted = per_code.get("ResourceExhausted").copied().unwrap_or(0);
    let timed_out = per_code.get("DeadlineExceeded").copied().unwrap_or(0);
    assert_eq!(exhausted + timed_out, 256, "{per_code:?}");
    // An admitted push holds its stream until the 3 s idle timeout ends it, so every
    // admission came at least 3 s before the last end (by now), and each of the 16 streams
    // took at most one push per 3 s until then: one wave where the 256 reached the node
    // within 3 s, more where a loaded host took longer (a third wave once, beside busy loops).
    let idle = std::time::Duration::from_secs(3);
    let waves = 1 + (t0.elapsed().saturating_sub(idle).as_secs_f64() / idle.as_secs_f64()) as usize;
    assert!(
        (16..=16 * waves).contains(&timed_out),
        "{per_code:?} in {waves} waves"
    );
    let back = |l: &pb::LoadReport| l.host_kv_bytes_used == before;
    assert_eq!(wait_load(&s, back).await.host_kv_bytes_used, before);
    // The cap frees with its pushes: a new one goes through.
    assert_eq!(send(&s, msgs("after", 30)).await, tonic::Code::Ok);
}

/// A header larger than any prompt this model can take is refused before it is decoded,
/// whether sent at once or as repeated header fields that prost would merge; ids longer
/// than allowed are refused, and what an error echoes of a client's string is clipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_and_ids_are_refused_and_echoes_are_clipped() {
    use prost::Message;
    let s = Served::start(&[]);
    let header = |ids: usize| {
        let mut m = msgs("big", 30).remove(0);
        if let Some(Item::Header(h)) = &mut m.item {
            h.prompt_token_ids = vec![300; ids];
            h.num_tokens = ids as u32;
        }
        m.encode_to_vec()
    };
    // Once: 100k token ids (the tiny model's context is 32k: a header of ~170 KB at most).
    let one = framed(0, &header(100_000));
    assert_eq!(
        raw_push(&s, vec![one], &[]).await,
        tonic::Code::InvalidArgument
    );
    // Twice 50k ids (100 KB each), each half under the limit, together over it.
    let twice = [header(50_000), header(50_000)].concat();
    assert_eq!(
        raw_push(&s, vec![framed(0, &twice)], &[]).await,
        tonic::Code::InvalidArgument
    );
    assert_eq!(load(&s).await.host_kv_bytes_used, 0);

    let mut c = pb::kv_transfer_client::KvTransferClient::new(s.channel().await);
    let e = c
        .drop_kv(pb::DropKvRequest {
            request_id: "x".repeat(10_000),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().len() < 200, "{}", e.message());
    let e = c
        .drop_kv(pb::DropKvRequest {
            request_id: "y".repeat(256),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    assert!(
        e.message().len() <= kv_transfer::MAX_ECHO + 32,
        "{}",
        e.message()
    );
}
