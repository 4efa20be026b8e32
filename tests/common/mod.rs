//! Shared helpers of the end-to-end tests: start the real binary on loopback ports, talk to
//! it over gRPC and HTTP, build prompt KV with the same embedded model.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

use decode_node::backend::CpuBackend;
use decode_node::model::{self, LoadedModel};
use decode_node_proto::v1 as pb;
use kv_transfer::client::PromptKv;
use tonic::transport::Channel;

/// The binary under test.
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_decode-node"))
}

/// Runs the binary with `args`, which must succeed, and parses its stdout as JSON.
pub fn run_json(args: &[&str]) -> serde_json::Value {
    let out = bin().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A running `decode-node serve`.
pub struct Served {
    child: Child,
    pub grpc: SocketAddr,
    pub metrics: SocketAddr,
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Served {
    /// Starts `serve` on ephemeral loopback ports with `extra` flags; waits until it listens.
    pub fn start(extra: &[&str]) -> Self {
        let mut child = bin()
            .args([
                "--log-format",
                "json",
                "serve",
                "--grpc-addr",
                "127.0.0.1:0",
                "--metrics-addr",
                "127.0.0.1:0",
            ])
            .args(extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn decode-node serve");
        let stderr = child.stderr.take().expect("stderr piped");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                    let f = &v["fields"];
                    if f["message"] == "serving" {
                        let g = f["grpc_addr"].as_str().unwrap_or_default().parse().ok();
                        let m = f["metrics_addr"].as_str().unwrap_or_default().parse().ok();
                        if let (Some(g), Some(m)) = (g, m) {
                            let _ = tx.send((g, m));
                        }
                    }
                }
                log2.lock().unwrap().push(line);
            }
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok((grpc, metrics)) => Self {
                child,
                grpc,
                metrics,
                log,
            },
            Err(_) => {
                let _ = child.kill();
                panic!("serve did not start: {:?}", log.lock().unwrap());
            }
        }
    }

    /// `http://addr` of the gRPC port.
    pub fn target(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// A connected channel.
    pub async fn channel(&self) -> Channel {
        decode_node::client::connect(&self.target())
            .await
            .expect("connect")
    }

    /// Sends SIGTERM.
    pub fn sigterm(&self) {
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }

    /// Waits for the process to exit.
    pub fn wait(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Prometheus text of `/metrics`.
    pub fn metrics_text(&self) -> String {
        let (code, body) = http_get(self.metrics, "/metrics");
        assert_eq!(code, 200);
        body
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP/1.1 GET; returns status and body.
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let (code, _, body) = http_get_with(addr, path, "");
    (code, body)
}

/// A plain HTTP/1.1 GET with `extra` header lines (each ending in CRLF); returns status,
/// response headers and body.
pub fn http_get_with(addr: SocketAddr, path: &str, extra: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).expect("connect metrics port");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\n{extra}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let code = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    (code, head.to_string(), body.to_string())
}

/// The embedded model, loaded once per test binary.
pub fn tiny() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| model::load("tiny", Arc::new(CpuBackend)).expect("tiny loads"))
}

/// A deterministic prompt of `n` tokens (printable bytes after BOS).
pub fn prompt(n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    std::iter::once(256)
        .chain((1..n).map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 95 + 32) as u32
        }))
        .collect()
}

/// The push of `prompt` for `id` (f32 KV, like the tiny model's pool).
pub fn prompt_kv(id: &str, prompt: &[u32]) -> PromptKv {
    decode_node::client::prefill_kv(tiny(), prompt, id, attention::KvDType::F32).expect("prefill")
}

/// Pushes and returns the final ack.
pub async fn push(s: &Served, kv: &PromptKv) -> Result<pb::PushKvResponse, tonic::Status> {
    let opts = kv_transfer::client::PushOptions {
        chunk_tokens: 16,
        retries: 0,
        auth_token: None,
    };
    kv_transfer::client::push_kv(s.channel().await, kv, &opts, |_| {}).await
}

/// A greedy Generate request.
pub fn gen_req(id: &str, max_new: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: id.into(),
        sampling: Some(pb::SamplingParams::default()),
        max_new_tokens: max_new,
        ignore_eos: true,
        kv_timeout_ms: 20_000,
        ..Default::default()
    }
}

/// Runs a Generate to its end: (token ids, finish).
pub async fn generate(
    s: &Served,
    req: pb::GenerateRequest,
) -> Result<(Vec<u32>, pb::Finish), tonic::Status> {
    let mut c = pb::decode_client::DecodeClient::new(s.channel().await);
    let mut stream = c.generate(req).await?.into_inner();
    let mut ids = Vec::new();
    while let Some(m) = stream.message().await? {
        match m.event {
            Some(pb::generate_response::Event::Token(t)) => {
                assert_eq!(t.index as usize, ids.len(), "token indices are consecutive");
                ids.push(t.id);
            }
            Some(pb::generate_response::Event::Finish(f)) => return Ok((ids, f)),
            None => {}
        }
    }
    Err(tonic::Status::unknown("stream ended without Finish"))
}

/// The exact greedy continuation, recomputed by full prefills (the slowest, plainest way).
pub fn reference_greedy(prompt: &[u32], n: usize) -> Vec<u32> {
    let m = &tiny().model;
    let mut seq = prompt.to_vec();
    let first = model::sampling::argmax(&m.prefill(&seq).unwrap().logits) as u32;
    seq.push(first);
    let mut out = Vec::new();
    for _ in 0..n {
        let t = model::sampling::argmax(&m.prefill(&seq).unwrap().logits) as u32;
        out.push(t);
        seq.push(t);
    }
    out
}

/// `GetLoad`.
pub async fn load(s: &Served) -> pb::LoadReport {
    let mut c = pb::decode_client::DecodeClient::new(s.channel().await);
    c.get_load(pb::GetLoadRequest {})
        .await
        .unwrap()
        .into_inner()
}

/// Polls `GetLoad` until `f` holds or 10 s pass.
pub async fn wait_load(s: &Served, f: impl Fn(&pb::LoadReport) -> bool) -> pb::LoadReport {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let l = load(s).await;
        if f(&l) || Instant::now() > end {
            return l;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
