//! `PushKvRequest` on the wire without copying payloads.
//!
//! tonic joins a message's HTTP/2 DATA frames into one buffer before prost sees it, and its
//! encoder copies every payload into a message buffer: two extra passes over every byte of KV.
//! This module decodes a `PushKvRequest` held as the frames it arrived in, leaving a chunk's
//! key and value where they are ([`Payload`]), and encodes one as a short list of buffers whose
//! key and value are the caller's own. Decoding follows prost's rules (fields in any order,
//! unknown fields skipped, the last scalar wins, a repeated oneof message merges); a property
//! test holds it to prost on arbitrary splits.

use bytes::{BufMut, Bytes, BytesMut};
use decode_node_proto::v1::push_kv_request::Item;
use decode_node_proto::v1::{KvChunk, KvCommit, KvHeader, PushKvRequest};
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};

use crate::Error;
use crate::payload::Payload;

/// The HTTP/2 path of `KvTransfer.PushKv`.
pub const PUSH_KV_PATH: &str = "/decode_node.v1.KvTransfer/PushKv";

/// Bytes before each gRPC message: a compression flag and a big-endian length.
pub const GRPC_PREFIX_LEN: usize = 5;

/// Deepest nesting of unknown groups skipped (prost's recursion limit).
const MAX_DEPTH: u32 = 100;

/// A `KvChunk` whose key and value may lie in several buffers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chunk {
    /// Layer.
    pub layer: u32,
    /// First token.
    pub token_start: u32,
    /// Tokens.
    pub token_count: u32,
    /// `[token_count][heads][head_dim]` keys in the header's dtype.
    pub key: Payload,
    /// Values, likewise.
    pub value: Payload,
    /// CRC-32C of key then value.
    pub crc32c: u32,
    /// First KV head in the chunk (tensor-parallel producers).
    pub head_start: u32,
    /// KV heads in the chunk; 0 is every head.
    pub head_count: u32,
}

impl From<KvChunk> for Chunk {
    fn from(c: KvChunk) -> Self {
        Self {
            layer: c.layer,
            token_start: c.token_start,
            token_count: c.token_count,
            key: c.key.into(),
            value: c.value.into(),
            crc32c: c.crc32c,
            head_start: c.head_start,
            head_count: c.head_count,
        }
    }
}

/// A decoded `PushKvRequest`.
#[derive(Debug, Clone, PartialEq)]
pub enum PushMessage {
    /// `item.header`.
    Header(KvHeader),
    /// `item.chunk`.
    Chunk(Chunk),
    /// `item.commit`, with its `next_token_id` if set.
    Commit(Option<u32>),
    /// No item set.
    Empty,
}

impl From<PushKvRequest> for PushMessage {
    fn from(m: PushKvRequest) -> Self {
        match m.item {
            Some(Item::Header(h)) => PushMessage::Header(h),
            Some(Item::Chunk(c)) => PushMessage::Chunk(c.into()),
            Some(Item::Commit(c)) => PushMessage::Commit(c.next_token_id),
            None => PushMessage::Empty,
        }
    }
}

fn malformed(what: impl std::fmt::Display) -> Error {
    Error::Invalid(format!("malformed PushKvRequest: {what}"))
}

/// Reads protobuf primitives from a [`Payload`] without joining its parts.
struct Cursor<'a> {
    p: &'a Payload,
    part: usize,
    off: usize,
    left: usize,
}

impl<'a> Cursor<'a> {
    fn new(p: &'a Payload) -> Self {
        Self {
            p,
            part: 0,
            off: 0,
            left: p.len(),
        }
    }

    fn byte(&mut self) -> Result<u8, Error> {
        if self.left == 0 {
            return Err(malformed("truncated field"));
        }
        let parts = self.p.parts();
        while self.off == parts[self.part].len() {
            self.part += 1;
            self.off = 0;
        }
        let b = parts[self.part][self.off];
        self.off += 1;
        self.left -= 1;
        Ok(b)
    }

    fn varint(&mut self) -> Result<u64, Error> {
        let mut v = 0u64;
        for i in 0..10 {
            let b = self.byte()?;
            // The tenth byte may only carry the top bit of a u64.
            if i == 9 && b > 1 {
                break;
            }
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(malformed("invalid varint"))
    }

    /// The next `n` bytes, sharing the parts.
    fn take(&mut self, n: usize) -> Result<Payload, Error> {
        if n > self.left {
            return Err(malformed("length past the end of the message"));
        }
        let mut out = Payload::new();
        let mut need = n;
        let parts = self.p.parts();
        while need > 0 {
            let p = &parts[self.part];
            let k = need.min(p.len() - self.off);
            out.push(p.slice(self.off..self.off + k));
            self.off += k;
            need -= k;
            if self.off == p.len() && need > 0 {
                self.part += 1;
                self.off = 0;
            }
        }
        self.left -= n;
        Ok(out)
    }

    fn len_delimited(&mut self) -> Result<Payload, Error> {
        let n = self.varint()?;
        let n = usize::try_from(n).map_err(|_| malformed("length too large"))?;
        self.take(n)
    }

    /// A field key: (number, wire type).
    fn key(&mut self) -> Result<(u32, WireType), Error> {
        let k = self.varint()?;
        if k > u64::from(u32::MAX) {
            return Err(malformed(format!("invalid key value {k}")));
        }
        let wt = WireType::try_from(k & 7).map_err(|_| malformed("invalid wire type"))?;
        let field = (k >> 3) as u32;
        if field == 0 {
            return Err(malformed("field number 0"));
        }
        Ok((field, wt))
    }

    fn skip(&mut self, field: u32, wt: WireType, depth: u32) -> Result<(), Error> {
        match wt {
            WireType::Varint => self.varint().map(drop),
            WireType::SixtyFourBit => self.take(8).map(drop),
            WireType::ThirtyTwoBit => self.take(4).map(drop),
            WireType::LengthDelimited => self.len_delimited().map(drop),
            WireType::StartGroup => {
                if depth >= MAX_DEPTH {
                    return Err(malformed("groups nested too deep"));
                }
                loop {
                    let (f, w) = self.key()?;
                    if w == WireType::EndGroup {
                        return if f == field {
                            Ok(())
                        } else {
                            Err(malformed("unexpected end group tag"))
                        };
                    }
                    self.skip(f, w, depth + 1)?;
                }
            }
            WireType::EndGroup => Err(malformed("unexpected end group tag")),
        }
    }
}

fn expect(wt: WireType, want: WireType, field: &str) -> Result<(), Error> {
    if wt == want {
        Ok(())
    } else {
        Err(malformed(format!(
            "{field}: wire type {wt:?}, expected {want:?}"
        )))
    }
}

/// Merges the `KvChunk` encoded in `p` into `c`, as prost's `merge` would.
fn merge_chunk(c: &mut Chunk, p: &Payload) -> Result<(), Error> {
    let mut cur = Cursor::new(p);
    while cur.left > 0 {
        let (field, wt) = cur.key()?;
        // `uint32` fields keep the low 32 bits of the varint, as prost does.
        let u32_field = |name: &str, cur: &mut Cursor<'_>| -> Result<u32, Error> {
            expect(wt, WireType::Varint, name)?;
            Ok(cur.varint()? as u32)
        };
        match field {
            1 => c.layer = u32_field("KvChunk.layer", &mut cur)?,
            2 => c.token_start = u32_field("KvChunk.token_start", &mut cur)?,
            3 => c.token_count = u32_field("KvChunk.token_count", &mut cur)?,
            6 => c.crc32c = u32_field("KvChunk.crc32c", &mut cur)?,
            7 => c.head_start = u32_field("KvChunk.head_start", &mut cur)?,
            8 => c.head_count = u32_field("KvChunk.head_count", &mut cur)?,
            4 => {
                expect(wt, WireType::LengthDelimited, "KvChunk.key")?;
                c.key = cur.len_delimited()?;
            }
            5 => {
                expect(wt, WireType::LengthDelimited, "KvChunk.value")?;
                c.value = cur.len_delimited()?;
            }
            _ => cur.skip(field, wt, 0)?,
        }
    }
    Ok(())
}

/// Decodes one `PushKvRequest` (a whole gRPC message, without its 5-byte prefix).
pub fn decode_push_request(msg: &Payload) -> Result<PushMessage, Error> {
    decode_push_request_limited(msg, usize::MAX)
}

/// As [`decode_push_request`], refusing a header of more than `max_header` encoded bytes (all
/// its occurrences in the message together, as prost merges them) before decoding it.
pub fn decode_push_request_limited(msg: &Payload, max_header: usize) -> Result<PushMessage, Error> {
    let mut item = PushMessage::Empty;
    let mut header_bytes = 0usize;
    let mut cur = Cursor::new(msg);
    let prost_err = |e: prost::DecodeError| malformed(e);
    while cur.left > 0 {
        let (field, wt) = cur.key()?;
        match field {
            1 => {
                expect(wt, WireType::LengthDelimited, "PushKvRequest.header")?;
                let p = cur.len_delimited()?;
                header_bytes = header_bytes.saturating_add(p.len());
                if header_bytes > max_header {
                    return Err(Error::Invalid(format!(
                        "KvHeader of {header_bytes} bytes or more is over this node's limit of {max_header} bytes"
                    )));
                }
                let b = p.to_bytes();
                match &mut item {
                    PushMessage::Header(h) => h.merge(b).map_err(prost_err)?,
                    _ => item = PushMessage::Header(KvHeader::decode(b).map_err(prost_err)?),
                }
            }
            2 => {
                expect(wt, WireType::LengthDelimited, "PushKvRequest.chunk")?;
                let p = cur.len_delimited()?;
                if !matches!(item, PushMessage::Chunk(_)) {
                    item = PushMessage::Chunk(Chunk::default());
                }
                if let PushMessage::Chunk(c) = &mut item {
                    merge_chunk(c, &p)?;
                }
            }
            3 => {
                expect(wt, WireType::LengthDelimited, "PushKvRequest.commit")?;
                // A repeated oneof field merges into the message already there, as prost does.
                let mut c = KvCommit {
                    next_token_id: match item {
                        PushMessage::Commit(t) => t,
                        _ => None,
                    },
                };
                c.merge(cur.len_delimited()?.to_bytes())
                    .map_err(prost_err)?;
                item = PushMessage::Commit(c.next_token_id);
            }
            _ => cur.skip(field, wt, 0)?,
        }
    }
    Ok(item)
}

fn grpc_prefix(buf: &mut BytesMut, len: usize) -> Result<(), Error> {
    let len = u32::try_from(len).map_err(|_| Error::Invalid("message over 4 GiB".into()))?;
    buf.put_u8(0);
    buf.put_u32(len);
    Ok(())
}

/// One gRPC message (prefix included) for a small message: a header, a commit, an ack.
pub fn encode_message(m: &impl Message) -> Result<Bytes, Error> {
    let len = m.encoded_len();
    let mut buf = BytesMut::with_capacity(GRPC_PREFIX_LEN + len);
    grpc_prefix(&mut buf, len)?;
    m.encode(&mut buf)
        .map_err(|e| Error::Invalid(format!("encoding a message: {e}")))?;
    Ok(buf.freeze())
}

/// One gRPC message for a chunk, as buffers to send in order: the key and value are `key`
/// and `value` themselves. The bytes equal prost's encoding of the same `PushKvRequest`.
pub fn encode_chunk(
    layer: u32,
    token_start: u32,
    token_count: u32,
    key: Bytes,
    value: Bytes,
    crc32c: u32,
) -> Result<Vec<Bytes>, Error> {
    // proto3: fields at their default value are not written.
    let varint_len = |tag: u32, v: u32| {
        if v == 0 {
            0
        } else {
            key_len(tag) + encoded_len_varint(u64::from(v))
        }
    };
    let bytes_len = |tag: u32, b: &Bytes| {
        if b.is_empty() {
            0
        } else {
            key_len(tag) + encoded_len_varint(b.len() as u64) + b.len()
        }
    };
    let inner = varint_len(1, layer)
        + varint_len(2, token_start)
        + varint_len(3, token_count)
        + bytes_len(4, &key)
        + bytes_len(5, &value)
        + varint_len(6, crc32c);
    let outer = key_len(2) + encoded_len_varint(inner as u64) + inner;

    let mut head = BytesMut::with_capacity(64);
    grpc_prefix(&mut head, outer)?;
    encode_key(2, WireType::LengthDelimited, &mut head);
    encode_varint(inner as u64, &mut head);
    for (tag, v) in [(1, layer), (2, token_start), (3, token_count)] {
        if v != 0 {
            encode_key(tag, WireType::Varint, &mut head);
            encode_varint(u64::from(v), &mut head);
        }
    }
    let mut out = Vec::with_capacity(5);
    for (tag, b) in [(4, key), (5, value)] {
        if !b.is_empty() {
            encode_key(tag, WireType::LengthDelimited, &mut head);
            encode_varint(b.len() as u64, &mut head);
            out.push(head.split().freeze());
            out.push(b);
        }
    }
    if crc32c != 0 {
        encode_key(6, WireType::Varint, &mut head);
        encode_varint(u64::from(crc32c), &mut head);
    }
    if !head.is_empty() {
        out.push(head.freeze());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn split(data: &[u8], cuts: &[usize]) -> Payload {
        let whole = Bytes::copy_from_slice(data);
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (data.len() + 1)).collect();
        cuts.extend([0, data.len()]);
        cuts.sort_unstable();
        Payload::from(
            cuts.windows(2)
                .map(|w| whole.slice(w[0]..w[1]))
                .collect::<Vec<_>>(),
        )
    }

    fn chunk_msg() -> impl Strategy<Value = PushKvRequest> {
        let chunk = (
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            proptest::collection::vec(any::<u8>(), 0..40),
            proptest::collection::vec(any::<u8>(), 0..40),
            any::<u32>(),
        )
            .prop_map(|(layer, token_start, token_count, k, v, crc32c)| {
                Item::Chunk(KvChunk {
                    layer: layer % 4,
                    token_start,
                    token_count,
                    key: k.into(),
                    value: v.into(),
                    crc32c,
                    // Some chunks name a head range (derived, to keep the tuple small).
                    head_start: crc32c % 3,
                    head_count: (crc32c >> 8) % 3,
                })
            });
        let header = (
            "[a-z]{0,8}",
            0u32..100,
            proptest::collection::vec(0u32..9, 0..5),
        )
            .prop_map(|(id, n, ids)| {
                Item::Header(KvHeader {
                    request_id: id,
                    num_tokens: n,
                    prompt_token_ids: ids,
                    ..KvHeader::default()
                })
            });
        proptest::option::of(prop_oneof![
            chunk,
            header,
            proptest::option::of(any::<u32>())
                .prop_map(|next_token_id| Item::Commit(KvCommit { next_token_id }))
        ])
        .prop_map(|item| PushKvRequest { item })
    }

    /// Protobuf noise prost must skip: unknown fields of every wire type, groups included.
    fn unknown_fields() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec((7u32..40, 0u8..5, any::<u32>()), 0..4).prop_map(|fs| {
            let mut b = Vec::new();
            for (f, kind, v) in fs {
                match kind {
                    0 => {
                        encode_key(f, WireType::Varint, &mut b);
                        encode_varint(u64::from(v), &mut b);
                    }
                    1 => {
                        encode_key(f, WireType::SixtyFourBit, &mut b);
                        b.extend_from_slice(&u64::from(v).to_le_bytes());
                    }
                    2 => {
                        encode_key(f, WireType::LengthDelimited, &mut b);
                        encode_varint(3, &mut b);
                        b.extend_from_slice(&[1, 2, 3]);
                    }
                    3 => {
                        encode_key(f, WireType::ThirtyTwoBit, &mut b);
                        b.extend_from_slice(&v.to_le_bytes());
                    }
                    _ => {
                        encode_key(f, WireType::StartGroup, &mut b);
                        encode_key(f + 1, WireType::Varint, &mut b);
                        encode_varint(u64::from(v), &mut b);
                        encode_key(f, WireType::EndGroup, &mut b);
                    }
                }
            }
            b
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 5000,
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x317E),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// Any sequence of messages (concatenated, as repeated fields and oneof merges do),
        /// with unknown fields, split anywhere: the same result as prost's decode.
        #[test]
        fn decodes_as_prost_does_on_any_split(
            msgs in proptest::collection::vec(chunk_msg(), 1..3),
            noise in unknown_fields(),
            cuts in proptest::collection::vec(any::<usize>(), 0..6),
        ) {
            let mut data = Vec::new();
            for m in &msgs {
                m.encode(&mut data).unwrap();
            }
            data.extend_from_slice(&noise);
            let want = PushMessage::from(PushKvRequest::decode(data.as_slice()).unwrap());
            prop_assert_eq!(decode_push_request(&split(&data, &cuts)).unwrap(), want);
        }

        /// Arbitrary bytes: an error or prost's answer, never a panic or a different result.
        #[test]
        fn garbage_is_refused_like_prost(data in proptest::collection::vec(any::<u8>(), 0..64), cuts in proptest::collection::vec(any::<usize>(), 0..4)) {
            let ours = decode_push_request(&split(&data, &cuts));
            match PushKvRequest::decode(data.as_slice()) {
                Ok(m) => prop_assert_eq!(ours.unwrap(), PushMessage::from(m)),
                Err(_) => prop_assert!(ours.is_err()),
            }
        }

        /// The client's zero-copy encoding is byte for byte prost's.
        #[test]
        fn chunk_encoding_equals_prost(mut m in chunk_msg()) {
            // The node's own client pushes every head.
            if let Some(Item::Chunk(c)) = &mut m.item {
                (c.head_start, c.head_count) = (0, 0);
            }
            let Some(Item::Chunk(c)) = m.item.clone() else { return Ok(()) };
            let parts = encode_chunk(c.layer, c.token_start, c.token_count, c.key.clone(), c.value.clone(), c.crc32c).unwrap();
            let got: Vec<u8> = parts.iter().flat_map(|b| b.iter().copied()).collect();
            let mut want = vec![0u8];
            want.extend_from_slice(&(m.encoded_len() as u32).to_be_bytes());
            m.encode(&mut want).unwrap();
            prop_assert_eq!(got, want.clone());
            let one = encode_message(&m).unwrap();
            prop_assert_eq!(one.as_ref(), want.as_slice());
        }
    }

    #[test]
    fn a_chunk_split_mid_key_keeps_the_frames() {
        let key = Bytes::from(vec![7u8; 1000]);
        let parts = encode_chunk(1, 2, 3, key.clone(), Bytes::from_static(b"vv"), 9).unwrap();
        let msg: Vec<u8> = parts.iter().flat_map(|b| b.iter().copied()).collect();
        let p = split(&msg[GRPC_PREFIX_LEN..], &[400]);
        let PushMessage::Chunk(c) = decode_push_request(&p).unwrap() else {
            panic!("not a chunk")
        };
        assert_eq!(
            c.key.parts().len(),
            2,
            "the key spans the two frames, unjoined"
        );
        assert_eq!(c.key.to_bytes(), key);
        assert_eq!(
            (c.layer, c.token_start, c.token_count, c.crc32c),
            (1, 2, 3, 9)
        );
    }
}
