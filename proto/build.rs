//! Compiles `decode_node/v1/*.proto` with protox (pure Rust), so no system `protoc` is needed.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "decode_node/v1/kv_transfer.proto",
        "decode_node/v1/decode.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    println!("cargo:rerun-if-changed=decode_node/v1/common.proto");

    let fds = protox::compile(files, ["."])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // Kept for gRPC reflection.
    std::fs::write(
        out.join("decode_node_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;

    tonic_prost_build::configure()
        // Payloads are large; `Bytes` lets prost slice the receive buffer instead of copying.
        .bytes(".decode_node.v1.KvChunk")
        .compile_fds(fds)?;
    Ok(())
}
