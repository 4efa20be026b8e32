//! `KvTransfer` over HTTP/2 with `PushKv` read straight from the DATA frames.
//!
//! [`KvTransferRoute`] answers `PushKv` itself: it cuts gRPC messages out of the frames as they
//! arrive, decodes them with [`crate::wire`] (a chunk's key and value stay in the frames) and
//! runs the same state machine as the tonic service, so every byte of KV is copied once, into
//! the pool. Every other method goes to the generated tonic service it wraps.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use decode_node_proto::v1::PushKvResponse;
use http::header::CONTENT_TYPE;
use http_body::{Body as HttpBody, Frame};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::body::Body;
use tonic::codegen::BoxFuture;
use tonic::server::NamedService;
use tonic::{Code, Status};
use tower_service::Service;

use crate::payload::Payload;
use crate::service::{Inbound, KvTransferService};
use crate::wire::{
    GRPC_PREFIX_LEN, PUSH_KV_PATH, PushMessage, decode_push_request_limited, encode_message,
};

/// The `KvTransfer` service with a zero-copy `PushKv`; `inner` serves the other methods.
#[derive(Debug, Clone)]
pub struct KvTransferRoute<S> {
    svc: KvTransferService,
    inner: S,
    max_message: usize,
}

impl<S> KvTransferRoute<S> {
    /// Serves `PushKv` with `svc`, refusing messages over `max_message` bytes, and the rest
    /// of the service with `inner`.
    pub fn new(svc: KvTransferService, inner: S, max_message: usize) -> Self {
        Self {
            svc,
            inner,
            max_message,
        }
    }
}

impl<S> NamedService for KvTransferRoute<S> {
    const NAME: &'static str = "decode_node.v1.KvTransfer";
}

impl<S> Service<http::Request<Body>> for KvTransferRoute<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        if req.uri().path() != PUSH_KV_PATH {
            return Box::pin(self.inner.call(req));
        }
        let res = serve_push(self.svc.clone(), req, self.max_message);
        Box::pin(async move { Ok(res) })
    }
}

fn serve_push(
    svc: KvTransferService,
    req: http::Request<Body>,
    max_message: usize,
) -> http::Response<Body> {
    let permit = match svc.admit() {
        Ok(p) => p,
        Err(s) => return s.into_http(),
    };
    if let Some(enc) = req.headers().get("grpc-encoding")
        && enc != "identity"
    {
        svc.metrics_error(Code::Unimplemented);
        return Status::unimplemented(format!(
            "PushKv is not compressed here: grpc-encoding {enc:?} is not supported"
        ))
        .into_http();
    }
    let inbound = Messages {
        body: req.into_body(),
        buf: Frames::default(),
        max_message,
        max_header: svc.max_header_bytes(),
        done: false,
    };
    let (tx, rx) = mpsc::channel(8);
    tokio::spawn(async move {
        svc.run_push(inbound, tx).await;
        drop(permit);
    });
    let mut res = http::Response::new(Body::new(Acks { rx, done: false }));
    res.headers_mut().insert(
        CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    res
}

/// Received DATA frames not yet cut into messages.
///
/// Frames are kept as they came, except small ones: those are copied together into `tail`, so a
/// client sending tiny frames costs a copy, not a buffer handle per few bytes (which would let
/// memory grow far past the message limit).
#[derive(Debug, Default)]
struct Frames {
    parts: VecDeque<Bytes>,
    tail: BytesMut,
    /// Bytes held, `tail` included.
    len: usize,
}

/// Frames shorter than this are joined rather than kept.
const JOIN_BELOW: usize = 4096;

impl Frames {
    fn push(&mut self, b: Bytes) {
        self.len += b.len();
        if b.len() < JOIN_BELOW {
            self.tail.extend_from_slice(&b);
            if self.tail.len() >= JOIN_BELOW {
                self.flush_tail();
            }
            return;
        }
        self.flush_tail();
        self.parts.push_back(b);
    }

    fn flush_tail(&mut self) {
        if !self.tail.is_empty() {
            self.parts.push_back(self.tail.split().freeze());
        }
    }

    /// The first `n` bytes, shared.
    fn split(&mut self, n: usize) -> Payload {
        let mut out = Payload::new();
        let mut need = n;
        while need > 0 {
            let Some(front) = self.parts.front_mut() else {
                break;
            };
            if front.len() <= need {
                need -= front.len();
                out.push(self.parts.pop_front().unwrap_or_default());
            } else {
                out.push(front.split_to(need));
                need = 0;
            }
        }
        self.len -= n - need;
        out
    }

    /// The next whole message, if it has arrived; refuses a bad prefix as soon as it is here.
    fn message(&mut self, max: usize) -> Result<Option<Payload>, Status> {
        if self.len < GRPC_PREFIX_LEN {
            return Ok(None);
        }
        self.flush_tail();
        let mut prefix = [0u8; GRPC_PREFIX_LEN];
        let mut at = 0;
        for p in &self.parts {
            let k = (GRPC_PREFIX_LEN - at).min(p.len());
            prefix[at..at + k].copy_from_slice(&p[..k]);
            at += k;
            if at == GRPC_PREFIX_LEN {
                break;
            }
        }
        let len = (&prefix[1..]).get_u32() as usize;
        match prefix[0] {
            0 => {}
            1 => {
                return Err(Status::unimplemented(
                    "compressed message, but no grpc-encoding was negotiated",
                ));
            }
            f => {
                return Err(Status::internal(format!(
                    "invalid gRPC compression flag {f}"
                )));
            }
        }
        if len > max {
            return Err(Status::resource_exhausted(format!(
                "message of {len} bytes is over this node's limit of {max} bytes"
            )));
        }
        if self.len < GRPC_PREFIX_LEN + len {
            return Ok(None);
        }
        self.flush_tail();
        self.split(GRPC_PREFIX_LEN);
        Ok(Some(self.split(len)))
    }
}

/// The request body as a stream of decoded `PushKvRequest`s.
struct Messages<B> {
    body: B,
    buf: Frames,
    max_message: usize,
    max_header: usize,
    done: bool,
}

impl<B> Stream for Messages<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    type Item = Result<PushMessage, Inbound>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            match this.buf.message(this.max_message) {
                Err(s) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(Inbound::Refused(s))));
                }
                Ok(Some(msg)) => {
                    let m = decode_push_request_limited(&msg, this.max_header)
                        .map_err(|e| Inbound::Refused(e.into()));
                    return Poll::Ready(Some(m));
                }
                Ok(None) => {}
            }
            match ready!(Pin::new(&mut this.body).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    // Request trailers carry nothing for us.
                    if let Ok(data) = frame.into_data() {
                        this.buf.push(data);
                    }
                }
                Some(Err(e)) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(Inbound::Broken(e.to_string()))));
                }
                None => {
                    this.done = true;
                    if this.buf.len > 0 {
                        return Poll::Ready(Some(Err(Inbound::Refused(Status::internal(
                            format!("the stream ended inside a message ({} bytes)", this.buf.len),
                        )))));
                    }
                    return Poll::Ready(None);
                }
            }
        }
    }
}

/// The response body: acks as gRPC messages, then the status as trailers.
struct Acks {
    rx: mpsc::Receiver<Result<PushKvResponse, Status>>,
    done: bool,
}

fn trailers(s: &Status) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    if s.add_header(&mut h).is_err() {
        // Only the message failed to encode; the code alone still tells the client.
        h.insert("grpc-status", http::HeaderValue::from(s.code() as i32));
    }
    h
}

impl HttpBody for Acks {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let frame = match ready!(self.rx.poll_recv(cx)) {
            Some(Ok(ack)) => {
                Frame::data(encode_message(&ack).map_err(|e| Status::internal(e.to_string()))?)
            }
            Some(Err(status)) => {
                self.done = true;
                Frame::trailers(trailers(&status))
            }
            None => {
                self.done = true;
                Frame::trailers(trailers(&Status::new(Code::Ok, "")))
            }
        };
        Poll::Ready(Some(Ok(frame)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(parts: &[&[u8]]) -> Frames {
        let mut f = Frames::default();
        for p in parts {
            f.push(Bytes::copy_from_slice(p));
        }
        f
    }

    #[test]
    fn messages_are_cut_across_frames_without_joining_them() {
        let body: Vec<u8> = (0..10_000).map(|i| (i % 251) as u8).collect();
        let mut wire = vec![0u8, 0, 0, 0x27, 0x10];
        wire.extend_from_slice(&body);
        wire.extend_from_slice(&[0, 0, 0, 0, 0]);
        let mut f = Frames::default();
        f.push(Bytes::copy_from_slice(&wire[..5000]));
        assert!(f.message(1 << 20).unwrap().is_none());
        f.push(Bytes::copy_from_slice(&wire[5000..]));
        let m = f.message(1 << 20).unwrap().unwrap();
        assert_eq!(m.to_bytes(), Bytes::from(body));
        assert_eq!(m.parts().len(), 2, "large frames are shared, not joined");
        // An empty message follows.
        assert_eq!(f.message(1 << 20).unwrap().unwrap().len(), 0);
        assert!(f.message(1 << 20).unwrap().is_none());
        assert_eq!(f.len, 0);
    }

    #[test]
    fn tiny_frames_are_joined_not_kept_one_by_one() {
        let mut msg = vec![0u8, 0, 0, 0x27, 0x10];
        msg.extend((0..10_000).map(|i| i as u8));
        let mut f = Frames::default();
        for b in msg.iter().chain(msg.iter()) {
            f.push(Bytes::copy_from_slice(std::slice::from_ref(b)));
            assert!(f.parts.len() <= 6, "{} parts", f.parts.len());
        }
        for _ in 0..2 {
            let m = f.message(1 << 20).unwrap().unwrap();
            assert_eq!(m.to_bytes(), Bytes::copy_from_slice(&msg[5..]));
            assert!(m.parts().len() <= 4);
        }
        assert_eq!(f.len, 0);
    }

    #[test]
    fn a_bad_prefix_is_refused_before_its_body_arrives() {
        let big = frames(&[&[0, 0, 0, 1, 0]]);
        for (mut f, code) in [
            (big, Code::ResourceExhausted),
            (frames(&[&[1, 0, 0, 0, 1]]), Code::Unimplemented),
            (frames(&[&[7, 0, 0, 0, 1]]), Code::Internal),
        ] {
            assert_eq!(f.message(100).unwrap_err().code(), code);
        }
        assert!(
            frames(&[&[0, 0, 0, 0, 9, 1]])
                .message(100)
                .unwrap()
                .is_none()
        );
    }
}
