//! Bearer auth on every RPC but health; TLS and mTLS.

mod common;
use common::*;
use decode_node_proto::v1 as pb;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_is_refused_without_the_token_and_accepted_with_it() {
    let dir = tempdir("auth");
    let tok = dir.path().join("token");
    std::fs::write(&tok, "s3cret-token\n").unwrap();
    let s = Served::start(&["--auth-token-file", tok.to_str().unwrap()]);
    let ch = s.channel().await;

    let mut anon = pb::decode_client::DecodeClient::new(ch.clone());
    let e = anon
        .get_model_info(pb::GetModelInfoRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    let opts = kv_transfer::client::PushOptions {
        auth_token: Some("wrong".into()),
        retries: 0,
        ..Default::default()
    };
    let e = kv_transfer::client::push_kv(ch.clone(), &prompt_kv("a", &prompt(8, 1)), &opts, |_| {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);

    let mut ok = decode_node::client::decode_client(ch.clone(), Some("s3cret-token".into()));
    let info = ok
        .get_model_info(pb::GetModelInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.model_id, tiny().model.model_id);
    let opts = kv_transfer::client::PushOptions {
        auth_token: Some("s3cret-token".into()),
        ..Default::default()
    };
    kv_transfer::client::push_kv(ch.clone(), &prompt_kv("a", &prompt(8, 1)), &opts, |_| {})
        .await
        .unwrap();

    // Health needs no token.
    let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
    let r = h
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap();
    assert_eq!(
        r.into_inner().status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_mutual_tls() {
    let dir = tempdir("tls");
    let ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    let mut ca = ca;
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let leaf = |names: Vec<String>| {
        let k = rcgen::KeyPair::generate().unwrap();
        let c = rcgen::CertificateParams::new(names)
            .unwrap()
            .signed_by(&k, &issuer)
            .unwrap();
        (c.pem(), k.serialize_pem())
    };
    let (srv_cert, srv_key) = leaf(vec!["localhost".into()]);
    let (cli_cert, cli_key) = leaf(vec!["client".into()]);
    for (name, body) in [
        ("ca.pem", ca_cert.pem()),
        ("srv.pem", srv_cert),
        ("srv.key", srv_key),
        ("cli.pem", cli_cert.clone()),
        ("cli.key", cli_key.clone()),
    ] {
        std::fs::write(dir.path().join(name), body).unwrap();
    }
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let s = Served::start(&[
        "--tls-cert",
        &p("srv.pem"),
        "--tls-key",
        &p("srv.key"),
        "--tls-client-ca",
        &p("ca.pem"),
        "--tls-handshake-timeout",
        "1",
    ]);
    // A client that connects and never starts its handshake is cut off at the timeout.
    {
        use std::io::Read;
        let mut raw = std::net::TcpStream::connect(s.grpc).unwrap();
        raw.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let t0 = std::time::Instant::now();
        let mut buf = [0u8; 16];
        let n = raw.read(&mut buf).unwrap_or(0);
        assert_eq!(n, 0, "the server closes, sending nothing");
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            t0.elapsed()
        );
    }
    let url = format!("https://localhost:{}", s.grpc.port());
    let base = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_cert.pem()))
        .domain_name("localhost");

    // Without a client certificate the handshake or the call fails.
    let no_cert = Channel::from_shared(url.clone())
        .unwrap()
        .tls_config(base.clone())
        .unwrap()
        .connect()
        .await;
    if let Ok(ch) = no_cert {
        let mut c = pb::decode_client::DecodeClient::new(ch);
        assert!(
            c.get_model_info(pb::GetModelInfoRequest {}).await.is_err(),
            "mTLS requires a client cert"
        );
    }
    let ch = Channel::from_shared(url)
        .unwrap()
        .tls_config(base.identity(Identity::from_pem(cli_cert, cli_key)))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = pb::decode_client::DecodeClient::new(ch);
    let info = c
        .get_model_info(pb::GetModelInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.block_size, 32);

    // The reference tools reach the same node: `prefill` and `generate` with the CA and a
    // client identity; without the CA an https target is a clear error.
    let tls_flags = [
        "--tls-ca-cert",
        &p("ca.pem"),
        "--tls-client-cert",
        &p("cli.pem"),
        "--tls-client-key",
        &p("cli.key"),
    ];
    let target = format!("https://localhost:{}", s.grpc.port());
    let run = |args: &[&str]| {
        let out = common::bin().args(args).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let prefill = [
        "prefill",
        "--target",
        &target,
        "--prompt-tokens",
        "8",
        "--request-id",
        "tls-cli",
    ];
    let (ok, out, err) = run(&[&prefill[..], &tls_flags].concat());
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "tls-cli");
    let generate = [
        "generate",
        "--target",
        &target,
        "--request-id",
        "tls-cli",
        "--max-new-tokens",
        "3",
        "--ids",
        "--ignore-eos",
    ];
    let (ok, out, err) = run(&[&generate[..], &tls_flags].concat());
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 3, "{out}");
    let (ok, _, err) = run(&prefill);
    assert!(!ok && err.contains("--tls-ca-cert"), "{err}");
    let plain = format!("http://localhost:{}", s.grpc.port());
    let (ok, _, err) = run(&[
        &["prefill", "--target", &plain, "--prompt-tokens", "8"][..],
        &tls_flags,
    ]
    .concat());
    assert!(!ok && err.contains("not https://"), "{err}");
}

/// A scratch directory removed when the test ends, however it ends.
fn tempdir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("decode-node-test-{tag}-"))
        .tempdir()
        .unwrap()
}

/// Runs a Generate with `token` to its end: the token ids, or the status.
async fn generate_as(
    ch: &Channel,
    token: &str,
    req: pb::GenerateRequest,
) -> Result<Vec<u32>, tonic::Status> {
    let mut c = decode_node::client::decode_client(ch.clone(), Some(token.into()));
    let mut stream = c.generate(req).await?.into_inner();
    let mut ids = Vec::new();
    while let Some(m) = stream.message().await? {
        if let Some(pb::generate_response::Event::Token(t)) = m.event {
            ids.push(t.id);
        }
    }
    Ok(ids)
}

/// Roles per token, and the lease fence: with `--require-lease`, only the holder of a push's
/// lease may generate from, cancel or drop its KV; a wrong lease leaves the KV in place; a
/// re-push after a drop is a new epoch whose KV is never mixed with the old stream's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_and_leases_fence_who_may_use_a_request() {
    use tonic::Code::{Aborted, PermissionDenied};
    let dir = tempdir("lease");
    let tok = dir.path().join("tokens");
    std::fs::write(&tok, "# prefill side\np1 push\ng1 generate\n").unwrap();
    let s = Served::start(&[
        "--auth-token-file",
        tok.to_str().unwrap(),
        "--require-lease",
    ]);
    let ch = s.channel().await;
    let push_as = |token: &str| kv_transfer::client::PushOptions {
        auth_token: Some(token.into()),
        retries: 0,
        chunk_tokens: 16,
    };
    let p = prompt(40, 9);
    let kv = prompt_kv("r", &p);
    // Roles: a generate token cannot push, a push token cannot generate.
    let e = kv_transfer::client::push_kv(ch.clone(), &kv, &push_as("g1"), |_| {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), PermissionDenied);
    let ack = kv_transfer::client::push_kv(ch.clone(), &kv, &push_as("p1"), |_| {})
        .await
        .unwrap();
    assert!(ack.committed && ack.lease.len() == 32, "{ack:?}");
    let req = |lease: &str| pb::GenerateRequest {
        lease: lease.into(),
        ..gen_req("r", 6)
    };
    let e = generate_as(&ch, "p1", req(&ack.lease)).await.unwrap_err();
    assert_eq!(e.code(), PermissionDenied);
    // No lease, or a wrong one: refused, and the KV stays.
    for lease in ["", "0123456789abcdef0123456789abcdef"] {
        let e = generate_as(&ch, "g1", req(lease)).await.unwrap_err();
        assert_eq!(e.code(), PermissionDenied, "{lease:?}");
        let mut kc = pb::kv_transfer_client::KvTransferClient::with_interceptor(
            ch.clone(),
            kv_transfer::client::BearerAuth(Some("p1".into())),
        );
        let e = kc
            .drop_kv(pb::DropKvRequest {
                request_id: "r".into(),
                lease: lease.into(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), PermissionDenied, "{lease:?}");
    }
    assert!(load_as(&ch).await.host_kv_bytes_used > 0);
    let ids = generate_as(&ch, "g1", req(&ack.lease)).await.unwrap();
    assert_eq!(ids, reference_greedy(&p, 6));

    // Epochs: an old push of "e" (another prompt's KV) is dropped half way; the re-push
    // commits under a new lease; the old stream's late chunks go nowhere.
    let old = prompt_kv("e", &prompt(64, 1));
    let mut msgs = kv_transfer::client::push_messages(&old, 16).into_iter();
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    for m in msgs.by_ref().take(3) {
        tx.send(m).await.unwrap();
    }
    let mut kc = pb::kv_transfer_client::KvTransferClient::with_interceptor(
        ch.clone(),
        kv_transfer::client::BearerAuth(Some("p1".into())),
    );
    let mut old_stream = kc
        .push_kv(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let first = old_stream.message().await.unwrap().unwrap();
    assert_eq!(first.lease.len(), 32, "the header's ack carries the lease");
    let d = kc
        .drop_kv(pb::DropKvRequest {
            request_id: "e".into(),
            lease: first.lease.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(d.dropped);
    let mut end = None;
    while end.is_none() {
        match old_stream.message().await {
            Ok(Some(_)) => {}
            Ok(None) => end = Some(tonic::Code::Ok),
            Err(e) => end = Some(e.code()),
        }
    }
    assert_eq!(end, Some(Aborted));
    let pe = prompt(64, 2);
    let new =
        kv_transfer::client::push_kv(ch.clone(), &prompt_kv("e", &pe), &push_as("p1"), |_| {})
            .await
            .unwrap();
    assert_ne!(new.lease, first.lease);
    for m in msgs {
        let _ = tx.send(m).await;
    }
    drop(tx);
    let e = generate_as(
        &ch,
        "g1",
        pb::GenerateRequest {
            lease: first.lease.clone(),
            ..gen_req("e", 6)
        },
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), PermissionDenied, "the old epoch's lease is dead");
    let ids = generate_as(
        &ch,
        "g1",
        pb::GenerateRequest {
            lease: new.lease,
            ..gen_req("e", 6)
        },
    )
    .await
    .unwrap();
    assert_eq!(ids, reference_greedy(&pe, 6));
    let back = load_as(&ch).await;
    assert_eq!(back.host_kv_bytes_used, 0);
}

async fn load_as(ch: &Channel) -> pb::LoadReport {
    decode_node::client::decode_client(ch.clone(), Some("g1".into()))
        .get_load(pb::GetLoadRequest {})
        .await
        .unwrap()
        .into_inner()
}

/// HTTP/2 rapid reset (CVE-2023-44487): a client that opens streams and resets them at once, as
/// fast as it can, gets its connection closed well before it has sent 20 000; other clients are
/// served throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rapid_reset_flood_loses_its_connection_and_nobody_else_notices() {
    let s = Served::start(&[]);
    let tcp = tokio::net::TcpStream::connect(s.grpc).await.unwrap();
    let (mut sr, conn) = h2::client::handshake(tcp).await.unwrap();
    let conn = tokio::spawn(conn);
    let mut sent = 0;
    for _ in 0..20_000 {
        let req = http::Request::post(format!("http://{}/decode_node.v1.Decode/GetLoad", s.grpc))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
        let ready = match sr.ready().await {
            Ok(r) => r,
            Err(_) => break,
        };
        sr = ready;
        match sr.send_request(req, false) {
            Ok((_resp, mut stream)) => stream.send_reset(h2::Reason::CANCEL),
            Err(_) => break,
        }
        sent += 1;
        // Let the frames go out in bursts, as a flood would.
        if sent % 64 == 0 {
            tokio::task::yield_now().await;
        }
    }
    let ended = tokio::time::timeout(std::time::Duration::from_secs(10), conn).await;
    assert!(
        sent < 20_000 || matches!(ended, Ok(Ok(Err(_)))),
        "the flood went on unchecked: {sent} streams opened and reset, connection {ended:?}"
    );
    // The node still serves everyone else.
    let l = load(&s).await;
    assert_eq!(l.running + l.waiting, 0);
}
