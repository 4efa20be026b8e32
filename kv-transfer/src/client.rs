//! The push client: chunks a prompt's KV, checksums it and streams it to a decode node.

use std::time::Duration;

use bytes::Bytes;
use decode_node_proto::v1::kv_transfer_client::KvTransferClient;
use decode_node_proto::v1::push_kv_request::Item;
use decode_node_proto::v1::{DType, KvChunk, KvCommit, KvHeader, PushKvRequest, PushKvResponse};
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

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

/// The messages of one push: header, chunks layer by layer, commit.
pub fn push_messages(kv: &PromptKv, chunk_tokens: usize) -> Vec<PushKvRequest> {
    let h = &kv.header;
    let n = h.num_tokens as usize;
    let es = match DType::try_from(h.dtype) {
        Ok(DType::DtypeF32) => 4,
        _ => 2,
    };
    let row = h.num_kv_heads as usize * h.head_dim as usize * es;
    let step = chunk_tokens.max(1);
    let mut out = vec![PushKvRequest {
        item: Some(Item::Header(h.clone())),
    }];
    for (layer, (k, v)) in kv.layers.iter().enumerate() {
        for start in (0..n).step_by(step) {
            let count = step.min(n - start);
            // Zero-copy: a chunk's K and V are contiguous ranges of the layer's buffers.
            let key = k.slice(start * row..(start + count) * row);
            let value = v.slice(start * row..(start + count) * row);
            let crc = crc32c::crc32c_append(crc32c::crc32c(&key), &value);
            out.push(PushKvRequest {
                item: Some(Item::Chunk(KvChunk {
                    layer: layer as u32,
                    token_start: start as u32,
                    token_count: count as u32,
                    key,
                    value,
                    crc32c: crc,
                })),
            });
        }
    }
    out.push(PushKvRequest {
        item: Some(Item::Commit(KvCommit {})),
    });
    out
}

/// Pushes `kv` to the node behind `channel`; `progress(bytes_acked)` sees every ack.
/// Retries the whole push on UNAVAILABLE with a short backoff.
pub async fn push_kv(
    channel: Channel,
    kv: &PromptKv,
    opts: &PushOptions,
    mut progress: impl FnMut(u64),
) -> Result<PushKvResponse, Status> {
    let mut client =
        KvTransferClient::with_interceptor(channel, BearerAuth(opts.auth_token.clone()))
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(256 << 20);
    let mut attempt = 0;
    loop {
        let msgs = push_messages(kv, opts.chunk_tokens);
        let res = async {
            let mut stream = client.push_kv(tokio_stream::iter(msgs)).await?.into_inner();
            let mut last = None;
            while let Some(ack) = stream.message().await? {
                progress(ack.bytes_received);
                let done = ack.committed;
                last = Some(ack);
                if done {
                    break;
                }
            }
            match last {
                Some(a) if a.committed => Ok(a),
                _ => Err(Status::unknown(
                    "push stream ended without a commit acknowledgement",
                )),
            }
        }
        .await;
        match res {
            Err(s) if s.code() == Code::Unavailable && attempt < opts.retries => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
            }
            other => return other,
        }
    }
}
