//! The push client: chunks a prompt's KV, checksums it and streams it to a decode node.
//!
//! [`push_kv`] sends K and V from the caller's buffers without copying them into messages.

use std::time::Duration;

use bytes::Bytes;
use decode_node_proto::v1::push_kv_request::Item;
use decode_node_proto::v1::{DType, KvChunk, KvCommit, KvHeader, PushKvRequest, PushKvResponse};
use http::header::{AUTHORIZATION, CONTENT_TYPE, TE};
use http_body::Frame;
use http_body_util::StreamBody;
use tonic::body::Body;
use tonic::codec::{Codec, Streaming};
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};
use tonic_prost::ProstCodec;
use tower_service::Service;

use crate::wire::{PUSH_KV_PATH, encode_chunk, encode_message};

/// A prompt's KV in wire layout: per layer, K and V as `[num_tokens][num_kv_heads][head_dim]`
/// little-endian bytes of the header's dtype.
#[derive(Debug, Clone)]
pub struct PromptKv {
    /// The header to send (`num_tokens`, dtype, ids, …).
    pub header: KvHeader,
    /// `(key, value)` bytes per layer.
    pub layers: Vec<(Bytes, Bytes)>,
}

/// Adds `authorization: Bearer <token>` to every call when a token is set.
#[derive(Debug, Clone, Default)]
pub struct BearerAuth(pub Option<String>);

impl Interceptor for BearerAuth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(t) = &self.0 {
            let v: MetadataValue<_> = format!("Bearer {t}")
                .parse()
                .map_err(|_| Status::invalid_argument("auth token is not valid ASCII metadata"))?;
            req.metadata_mut().insert("authorization", v);
        }
        Ok(req)
    }
}

/// How to push.
#[derive(Debug, Clone)]
pub struct PushOptions {
    /// Tokens per chunk.
    pub chunk_tokens: usize,
    /// Whole-push retries on UNAVAILABLE.
    pub retries: u32,
    /// Bearer token.
    pub auth_token: Option<String>,
}

impl Default for PushOptions {
    fn default() -> Self {
        Self {
            chunk_tokens: 256,
            retries: 3,
            auth_token: None,
        }
    }
}

/// A push's chunks, layer by layer: K and V of each are ranges of the layer's buffers. Lazy:
/// each chunk's CRC is taken when it is reached, so a push streams while it is checksummed.
fn chunks(
    kv: &PromptKv,
    chunk_tokens: usize,
    from: usize,
) -> impl Iterator<Item = KvChunk> + Send + 'static {
    let h = &kv.header;
    let n = h.num_tokens as usize;
    let es = match DType::try_from(h.dtype) {
        Ok(DType::DtypeF32) => 4,
        _ => 2,
    };
    let row = h.num_kv_heads as usize * h.head_dim as usize * es;
    let step = chunk_tokens.max(1);
    kv.layers
        .clone()
        .into_iter()
        .enumerate()
        .flat_map(move |(layer, (k, v))| {
            (from.min(n)..n).step_by(step).map(move |start| {
                let count = step.min(n - start);
                // Zero-copy: a chunk's K and V are contiguous ranges of the layer's buffers.
                let range = (start * row).min(k.len())..((start + count) * row).min(k.len());
                let key = k.slice(range.clone());
                let value = v.slice(range.start.min(v.len())..range.end.min(v.len()));
                let crc32c = crate::crc::crc32c([&key[..], &value[..]]);
                KvChunk {
                    layer: layer as u32,
                    token_start: start as u32,
                    token_count: count as u32,
                    key,
                    value,
                    crc32c,
                    ..KvChunk::default()
                }
            })
        })
}

/// The messages of one push: header, chunks layer by layer, commit.
pub fn push_messages(kv: &PromptKv, chunk_tokens: usize) -> Vec<PushKvRequest> {
    let mut out = vec![PushKvRequest {
        item: Some(Item::Header(kv.header.clone())),
    }];
    out.extend(chunks(kv, chunk_tokens, 0).map(|c| PushKvRequest {
        item: Some(Item::Chunk(c)),
    }));
    out.push(PushKvRequest {
        item: Some(Item::Commit(KvCommit::default())),
    });
    out
}

/// The request body of one push as buffers, produced as they are sent: gRPC framing and
/// protobuf field headers around K and V, which are `kv`'s own buffers. The bytes are
/// [`push_messages`] encoded by prost.
pub fn push_body(
    kv: &PromptKv,
    chunk_tokens: usize,
) -> impl Iterator<Item = Result<Bytes, Status>> + Send + 'static {
    std::iter::once(header_bytes(kv)).chain(body_after_header(kv, chunk_tokens, 0))
}

fn invalid(e: crate::Error) -> Status {
    Status::invalid_argument(e.to_string())
}

/// The header message, framed.
fn header_bytes(kv: &PromptKv) -> Result<Bytes, Status> {
    encode_message(&PushKvRequest {
        item: Some(Item::Header(kv.header.clone())),
    })
    .map_err(invalid)
}

/// The chunks of tokens from `from` on, then the commit, framed.
fn body_after_header(
    kv: &PromptKv,
    chunk_tokens: usize,
    from: usize,
) -> impl Iterator<Item = Result<Bytes, Status>> + Send + 'static {
    let commit = encode_message(&PushKvRequest {
        item: Some(Item::Commit(KvCommit::default())),
    })
    .map_err(invalid);
    let chunks = chunks(kv, chunk_tokens, from).flat_map(move |c| {
        match encode_chunk(
            c.layer,
            c.token_start,
            c.token_count,
            c.key,
            c.value,
            c.crc32c,
        ) {
            Ok(parts) => parts.into_iter().map(Ok).collect::<Vec<_>>(),
            Err(e) => vec![Err(invalid(e))],
        }
    });
    chunks.chain(std::iter::once(commit))
}

/// Pushes `kv` to the node behind `channel`; `progress(bytes_acked)` sees every ack.
/// Retries the whole push on UNAVAILABLE with a short backoff.
///
/// The request goes out as [`push_body`]'s buffers, straight to HTTP/2: the KV is not copied
/// into message buffers as a generated client's encoder would.
pub async fn push_kv(
    channel: Channel,
    kv: &PromptKv,
    opts: &PushOptions,
    mut progress: impl FnMut(u64),
) -> Result<PushKvResponse, Status> {
    let mut attempt = 0;
    loop {
        match push_once(channel.clone(), kv, opts, &mut progress).await {
            Err(s) if s.code() == Code::Unavailable && attempt < opts.retries => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
            }
            other => return other,
        }
    }
}

async fn push_once(
    mut channel: Channel,
    kv: &PromptKv,
    opts: &PushOptions,
    progress: &mut impl FnMut(u64),
) -> Result<PushKvResponse, Status> {
    // A push that asks to reuse the node's prefix sends its header alone, and its chunks
    // only once the header's ack has said how many tokens the node already holds.
    let reuse = kv.header.reuse_prefix;
    let mut tx_for_rest = None;
    let body = if reuse {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Status>>(16);
        // Room for 16 frames: the header goes in at once.
        let _ = tx.try_send(header_bytes(kv).map(Frame::data));
        tx_for_rest = Some(tx);
        Body::new(StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
    } else {
        Body::new(StreamBody::new(tokio_stream::iter(
            push_body(kv, opts.chunk_tokens).map(|b| b.map(Frame::data)),
        )))
    };
    let mut feeder: Option<tokio::task::JoinHandle<()>> = None;
    let mut req = http::Request::builder()
        .method(http::Method::POST)
        .version(http::Version::HTTP_2)
        .uri(PUSH_KV_PATH)
        .header(CONTENT_TYPE, "application/grpc")
        .header(TE, "trailers");
    if let Some(t) = &opts.auth_token {
        let v = http::HeaderValue::try_from(format!("Bearer {t}"))
            .map_err(|_| Status::invalid_argument("auth token is not valid ASCII metadata"))?;
        req = req.header(AUTHORIZATION, v);
    }
    let req = req
        .body(body)
        .map_err(|e| Status::internal(format!("building the PushKv request: {e}")))?;
    // Connection errors map to codes as a generated client's would (refused: UNAVAILABLE).
    let transport = |e: tonic::transport::Error| Status::from_error(Box::new(e));
    std::future::poll_fn(|cx| channel.poll_ready(cx))
        .await
        .map_err(transport)?;
    let res = channel.call(req).await.map_err(transport)?;
    let (parts, body) = res.into_parts();
    if let Some(s) = Status::from_header_map(&parts.headers) {
        // A trailers-only response: refused before any ack.
        return Err(if s.code() == Code::Ok {
            Status::unknown("push stream ended without a commit acknowledgement")
        } else {
            s
        });
    }
    let decoder = ProstCodec::<PushKvRequest, PushKvResponse>::default().decoder();
    let mut stream = Streaming::new_response(decoder, body, parts.status, None, Some(64 << 20));
    while let Some(ack) = stream.message().await? {
        progress(ack.bytes_received);
        if ack.committed {
            return Ok(ack);
        }
        if reuse && feeder.is_none() {
            // The header's ack: send what the node does not hold, on a task of its own so
            // the acks keep being read while it streams.
            let rest = body_after_header(kv, opts.chunk_tokens, ack.reused_tokens as usize);
            let tx = tx_for_rest.take();
            feeder = Some(tokio::spawn(async move {
                if let Some(tx) = tx {
                    for b in rest {
                        if tx.send(b.map(Frame::data)).await.is_err() {
                            break;
                        }
                    }
                }
            }));
        }
    }
    Err(Status::unknown(
        "push stream ended without a commit acknowledgement",
    ))
}
