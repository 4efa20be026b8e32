//! Bearer auth on every RPC but health; TLS and mTLS.

mod common;
use common::*;
use decode_node_proto::v1 as pb;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_is_refused_without_the_token_and_accepted_with_it() {
    let dir = tempdir("auth");
    let tok = dir.join("token");
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
    ] {
        std::fs::write(dir.join(name), body).unwrap();
    }
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let s = Served::start(&[
        "--tls-cert",
        &p("srv.pem"),
        "--tls-key",
        &p("srv.key"),
        "--tls-client-ca",
        &p("ca.pem"),
    ]);
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
}

fn tempdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("decode-node-test-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
