//! Client side of the reference tools: a prefill node that pushes KV, an orchestrator that
//! generates. Used by `prefill`, `generate`, `demo` and the benches.

use anyhow::Context;
use attention::{KvDType, encode_from_f32};
use bytes::Bytes;
use decode_node_proto::v1 as pb;
use kv_transfer::client::{BearerAuth, PromptKv, PushOptions, push_kv};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::cli::ClientTlsArgs;

use crate::model::{LoadedModel, sampling};

/// Connects to `target` (`http://host:port`).
pub async fn connect(target: &str) -> anyhow::Result<Channel> {
    connect_with(target, &ClientTlsArgs::default()).await
}

/// The TLS settings for `target`: none for `http://`; for `https://`, the CA to trust (this
/// client has no built-in roots: a node's certificate comes from the operator's own CA), an
/// optional client identity and the name to verify.
fn client_tls(target: &str, tls: &ClientTlsArgs) -> anyhow::Result<Option<ClientTlsConfig>> {
    let read =
        |p: &std::path::Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let given =
        tls.tls_ca_cert.is_some() || tls.tls_client_cert.is_some() || tls.tls_domain.is_some();
    if !target.starts_with("https://") {
        anyhow::ensure!(
            !given,
            "TLS flags were given but the target {target:?} is not https://"
        );
        return Ok(None);
    }
    let ca = tls.tls_ca_cert.as_deref().with_context(|| {
        format!("the target {target:?} is https://: give --tls-ca-cert, the CA that signed the node's certificate")
    })?;
    let mut cfg = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(ca)?));
    if let (Some(cert), Some(key)) = (&tls.tls_client_cert, &tls.tls_client_key) {
        cfg = cfg.identity(Identity::from_pem(read(cert)?, read(key)?));
    }
    if let Some(d) = &tls.tls_domain {
        cfg = cfg.domain_name(d.clone());
    }
    Ok(Some(cfg))
}

/// Connects to `target` (`http://` or `https://host:port`) with `tls`.
pub async fn connect_with(target: &str, tls: &ClientTlsArgs) -> anyhow::Result<Channel> {
    let mut ep = Endpoint::from_shared(target.to_string())
        .with_context(|| format!("bad target URL {target:?}"))?;
    if let Some(cfg) = client_tls(target, tls)? {
        ep = ep.tls_config(cfg).context("TLS configuration")?;
    }
    ep.tcp_nodelay(true)
        .initial_stream_window_size(Some(16 << 20))
        .initial_connection_window_size(Some(64 << 20))
        .max_frame_size(Some(1 << 20))
        .connect()
        .await
        .with_context(|| format!("connecting to {target}"))
}

/// Reads a bearer token file.
pub fn read_token(path: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    match path {
        None => Ok(None),
        Some(p) => Ok(Some(
            std::fs::read_to_string(p)
                .with_context(|| format!("reading {}", p.display()))?
                .trim()
                .to_string(),
        )),
    }
}

/// Runs `prompt` through the model and returns the push: KV in the model's dtype (`dtype`),
/// the greedy next token, and a header for `request_id`.
pub fn prefill_kv(
    model: &LoadedModel,
    prompt: &[u32],
    request_id: &str,
    dtype: KvDType,
) -> anyhow::Result<PromptKv> {
    let m = &model.model;
    let out = m.prefill(prompt)?;
    let next = sampling::argmax(&out.logits) as u32;
    let enc = |v: &[f32]| {
        let mut b = vec![0u8; v.len() * dtype.size()];
        encode_from_f32(dtype, v, &mut b);
        Bytes::from(b)
    };
    let layers = out
        .keys
        .iter()
        .zip(&out.values)
        .map(|(k, v)| (enc(k), enc(v)))
        .collect();
    let header = pb::KvHeader {
        request_id: request_id.into(),
        model_id: m.model_id.clone(),
        num_layers: m.cfg.num_layers as u32,
        num_kv_heads: m.cfg.num_kv_heads as u32,
        head_dim: m.cfg.head_dim as u32,
        dtype: match dtype {
            KvDType::F32 => pb::DType::DtypeF32,
            KvDType::F16 => pb::DType::DtypeF16,
            KvDType::Bf16 => pb::DType::DtypeBf16,
            KvDType::I8 | KvDType::F8E4M3 => {
                anyhow::bail!("{dtype} is a host KV dtype, not a wire dtype: push f32, f16 or bf16")
            }
        } as i32,
        num_tokens: prompt.len() as u32,
        prompt_token_ids: prompt.to_vec(),
        next_token_id: next,
        num_streams: 0,
        reuse_prefix: false,
    };
    Ok(PromptKv { header, layers })
}

/// A push written into `pool` in-process (no transport), as the node's ingest writes it:
/// for benches and tests that drive the engine's parts without a server.
pub fn ingest_local(
    layout: &kv_transfer::KvLayout,
    pool: &kv_transfer::HostPool,
    kv: &PromptKv,
) -> anyhow::Result<kv_transfer::CommittedKv> {
    use kv_transfer::{Ingest, client::push_messages};
    let mut ingest = None;
    for m in push_messages(kv, 256) {
        match m.item {
            Some(pb::push_kv_request::Item::Header(h)) => {
                ingest = Some(Ingest::begin(layout, pool, &h)?)
            }
            Some(pb::push_kv_request::Item::Chunk(c)) => ingest
                .as_mut()
                .ok_or_else(|| anyhow::anyhow!("a chunk before the header"))?
                .chunk(&c.into())?,
            _ => {}
        }
    }
    Ok(ingest
        .ok_or_else(|| anyhow::anyhow!("no header"))?
        .commit(None)?)
}

/// Pushes a prompt's KV, reporting acked bytes.
pub async fn push(
    channel: Channel,
    kv: &PromptKv,
    token: Option<String>,
    progress: impl FnMut(u64),
) -> anyhow::Result<pb::PushKvResponse> {
    let opts = PushOptions {
        auth_token: token,
        ..PushOptions::default()
    };
    push_kv(channel, kv, &opts, progress)
        .await
        .map_err(|s| anyhow::anyhow!("PushKv failed: {:?}: {}", s.code(), s.message()))
}

/// A Decode client with the bearer token attached.
pub fn decode_client(
    channel: Channel,
    token: Option<String>,
) -> pb::decode_client::DecodeClient<
    tonic::service::interceptor::InterceptedService<Channel, BearerAuth>,
> {
    pb::decode_client::DecodeClient::with_interceptor(channel, BearerAuth(token))
}

/// What a finished generation produced.
#[derive(Debug, Default, Clone)]
pub struct Generated {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Concatenated text.
    pub text: String,
    /// The finish event.
    pub finish: Option<pb::Finish>,
}

/// Runs `Generate` and collects the stream; `on_token` sees each token as it arrives.
pub async fn generate(
    channel: Channel,
    token: Option<String>,
    req: pb::GenerateRequest,
    mut on_token: impl FnMut(&pb::Token),
) -> anyhow::Result<Generated> {
    let mut client = decode_client(channel, token);
    let mut stream = client
        .generate(req)
        .await
        .map_err(|s| anyhow::anyhow!("Generate failed: {:?}: {}", s.code(), s.message()))?
        .into_inner();
    let mut out = Generated::default();
    loop {
        match stream.message().await {
            Ok(Some(msg)) => match msg.event {
                Some(pb::generate_response::Event::Token(t)) => {
                    on_token(&t);
                    out.ids.push(t.id);
                    out.text.push_str(&t.text);
                }
                Some(pb::generate_response::Event::Finish(f)) => {
                    out.finish = Some(f);
                    return Ok(out);
                }
                None => {}
            },
            Ok(None) => anyhow::bail!("Generate stream ended without a Finish"),
            Err(s) => anyhow::bail!("Generate failed: {:?}: {}", s.code(), s.message()),
        }
    }
}
