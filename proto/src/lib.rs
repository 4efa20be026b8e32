//! The gRPC contract of decode-node: package `decode_node.v1`.
//!
//! - [`v1::kv_transfer_server::KvTransfer`] / [`v1::kv_transfer_client::KvTransferClient`]:
//!   prefill nodes push a prompt's KV cache (`PushKv`) and may drop it (`DropKv`).
//! - [`v1::decode_server::Decode`] / [`v1::decode_client::DecodeClient`]: an orchestrator
//!   starts generations, cancels them and reads load and model info.
//!
//! The `.proto` sources live beside this crate in `decode_node/v1/` and are the published
//! contract; [`FILE_DESCRIPTOR_SET`] serves gRPC reflection.
//!
//! ```
//! use decode_node_proto::v1::{DType, KvHeader};
//! let h = KvHeader { request_id: "r1".into(), dtype: DType::DtypeF16 as i32, ..Default::default() };
//! assert_eq!(h.dtype(), DType::DtypeF16);
//! ```
#![warn(missing_debug_implementations, rust_2018_idioms)]

/// Generated messages, clients and servers of `decode_node.v1`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("decode_node.v1");
}

/// Encoded `FileDescriptorSet` of every `decode_node.v1` file, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/decode_node_descriptor.bin"));

#[cfg(test)]
mod tests {
    use super::v1::*;

    #[test]
    fn services_and_messages_exist() {
        // Clients and servers for both services are generated.
        fn _types(
            _: Option<kv_transfer_client::KvTransferClient<tonic::transport::Channel>>,
            _: Option<decode_client::DecodeClient<tonic::transport::Channel>>,
        ) {
        }
        let chunk = KvChunk {
            key: bytes_of(&[1, 2]),
            ..Default::default()
        };
        assert_eq!(chunk.key.len(), 2);
        let req = PushKvRequest {
            item: Some(push_kv_request::Item::Chunk(chunk)),
        };
        let enc = prost::Message::encode_to_vec(&req);
        let dec: PushKvRequest = prost::Message::decode(enc.as_slice()).unwrap();
        assert_eq!(dec, req);
    }

    fn bytes_of(b: &[u8]) -> prost::bytes::Bytes {
        prost::bytes::Bytes::copy_from_slice(b)
    }

    #[test]
    fn descriptor_set_names_both_services() {
        let fds: prost_types_shim::Fds =
            prost::Message::decode(super::FILE_DESCRIPTOR_SET).unwrap();
        let names: Vec<_> = fds
            .file
            .iter()
            .map(|f| f.name.clone().unwrap_or_default())
            .collect();
        assert!(
            names.iter().any(|n| n.ends_with("kv_transfer.proto")),
            "{names:?}"
        );
        assert!(
            names.iter().any(|n| n.ends_with("decode.proto")),
            "{names:?}"
        );
    }

    /// Just enough of `google.protobuf.FileDescriptorSet` to read the file names.
    mod prost_types_shim {
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Fds {
            #[prost(message, repeated, tag = "1")]
            pub file: Vec<Fd>,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Fd {
            #[prost(string, optional, tag = "1")]
            pub name: Option<String>,
        }
    }
}
