//! The node's network face: gRPC (KvTransfer, Decode, health, reflection) with auth and TLS,
//! the HTTP metrics/probe port, and drain on SIGTERM.

pub mod auth;
pub mod decode;
mod http;
mod server;

pub use server::{Bound, InProcess, serve};
