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
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.dropped && r.bytes_freed > 0);
    assert_eq!(
        c.drop_kv(pb::DropKvRequest {
            request_id: "g".into()
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
